"""One rank of the fault tests (tests/deploy/test_faults.py), as its own process inside a node's namespace:
iterate one epoch of the named Ray loader, pausing between microbatches, and print JSON lines: ``ready`` once
the loader is built, ``started`` at the first microbatch, then the result (its users, and the error that ended it:
its class, whether it is a ``loader.errors.LoaderError``, its text, and when it was raised). Its imports done, it
builds the loader once a line comes on stdin (the test starts every rank's process at once, and lets a rank attach
once rank 0 has created the coordinator)."""

import json
import os
import sys
import time

from loader import SequenceLoader
from loader.errors import LoaderError

data, address, name, rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
liveness, pause = float(sys.argv[5]), float(sys.argv[6])


def say(**fields) -> None:
    print(json.dumps({"rank": rank, **fields}), flush=True)


sys.stdin.readline()
with SequenceLoader(data, ranks=2, microbatches=1, samples_per_step=20, shuffle_window=400, seed=3, num_readers=2,
                    prefetch_steps=1, backend="ray", ray_address=address, name=name,
                    liveness_timeout=liveness) as loader:
    say(ready=True)
    users: list[int] = []
    try:
        for mb in loader.iter_rank(rank):
            if not users:
                say(started=True)
            users += mb.user_ids.tolist()
            time.sleep(pause)
    except Exception as exc:  # reported to the test, which checks what it is
        say(users=users, error=f"{type(exc).__module__}.{type(exc).__name__}", named=isinstance(exc, LoaderError),
            text=str(exc), at=time.time())
    else:
        say(users=users, error=None, at=time.time())
os._exit(0)  # Ray's shutdown at exit need not wait on a lost node: the test has what it needs

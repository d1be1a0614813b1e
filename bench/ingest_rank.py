"""One trainer process of ``bench/ingest.py``'s named-loader cases, as torchrun starts them: rank ``--rank`` of
``--ranks``, iterating its rank of a named ``SequenceLoader`` on the bench's running Ray.

Started once per contender by the bench (imports, ``ray.init(address=...)``), it prints ``ready`` and then runs one
pass per line ``go <loader name> [epochs]`` on stdin: builds ``SequenceLoader(path, ranks=P, microbatches=M,
samples_per_step=G, backend="ray", name=<loader name>)``, drains ``iter_rank(rank)`` (and ``iter_rank(rank, epoch=e)``
for each later epoch, as a training job does with the loader it built once), closes the loader, and prints
``result`` and a JSON object on one line (other lines on stdout, Ray's or a library's, are not the bench's): epoch
0's rows, tokens, microbatches, ``first`` and ``end`` (``time.monotonic()``, the same clock in every process of the
machine), ``later`` (``start``, ``first``, ``end`` and ``rows`` of each later epoch), and the loader's ``stats()``
from rank 0. ``quit`` (or end of input) ends it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--address", required=True, help="GCS address of the bench's Ray")
    ap.add_argument("--path", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--samples-per-step", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import ray

    from loader import SequenceLoader

    ray.init(address=args.address, logging_level=logging.WARNING, log_to_driver=False)
    print("ready", flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "quit":
            break
        epochs = int(command[2]) if len(command) > 2 else 1
        loader = SequenceLoader(args.path, ranks=args.ranks, microbatches=args.microbatches,
                                samples_per_step=args.samples_per_step, backend="ray", seed=args.seed,
                                name=command[1])
        try:
            passes = [drain(loader, args.rank, epoch) for epoch in range(epochs)]
            stats = loader.stats() if args.rank == 0 else None
        finally:
            loader.close()
        print("result " + json.dumps({**passes[0], "later": passes[1:], "stats": stats}, default=str), flush=True)
    ray.shutdown()


def drain(loader, rank: int, epoch: int) -> dict:
    """Rank ``rank``'s epoch ``epoch``: rows, tokens, microbatches, and when it started, had its first batch, ended."""
    rows = tokens = mbs = 0
    start, first = time.monotonic(), None
    for mb in loader.iter_rank(rank, epoch=epoch):
        if first is None:
            first = time.monotonic()
        rows += len(mb.user_ids)
        tokens += len(mb.item_ids)
        mbs += 1
    return {"rows": rows, "tokens": tokens, "microbatches": mbs, "start": start, "first": first,
            "end": time.monotonic()}


if __name__ == "__main__":
    main()

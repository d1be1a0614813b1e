"""One loader rank of the end-to-end deploy test, as its own process (run inside the head's namespace):
iterate one epoch of the named Ray loader and print the user ids and reader nodes as one JSON line."""

import json
import sys

from loader import SequenceLoader

data, address, name, rank = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
with SequenceLoader(data, ranks=2, microbatches=2, samples_per_step=40, shuffle_window=40, seed=3,
                    num_readers=4, backend="ray", ray_address=address, name=name) as loader:
    users = [int(u) for mb in loader.iter_rank(rank) for u in mb.user_ids.tolist()]
    nodes = sorted(set(loader.reader_nodes()))
import ray  # noqa: E402

alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
print(json.dumps({"rank": rank, "users": users, "reader_nodes": nodes, "alive": alive}))

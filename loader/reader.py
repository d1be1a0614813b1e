"""Reader actors: decode row groups into their node's object store, pack rows for other nodes.

Kept apart from the coordinator so a reader process imports only what reading needs (pyarrow,
NumPy, the ragged-copy kernel), not the planner: readers start sooner.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import ray
from ray.exceptions import ObjectLostError

from loader.assemble import pack
from loader.clean import UnitMeta
from loader.read import read_unit
from loader.sources import SourceIndex


def reader_nodes() -> list[str]:
    """Ids of the alive nodes readers go to, round-robin: those with CPUs (a head node started with
    ``--num-cpus=0`` is kept free), or every alive node if none has any."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    with_cpus = [n for n in alive if n.get("Resources", {}).get("CPU", 0) > 0]
    return sorted(n["NodeID"] for n in (with_cpus or alive))


@dataclass(frozen=True)
class Held:
    """A reader's object (a unit's rows or a packed piece): ``ref``, owned by reader ``reader``
    while its process ``pid`` lives (Ray loses an object with its owner)."""

    ref: ray.ObjectRef
    reader: int
    pid: int


@ray.remote(num_cpus=0)
class Reader:
    """Reads units and packs rows on its node; holds no state but the objects it owns.

    A read puts the unit's decoded rows into this node's object store and returns only its
    statuses and lengths plus the object's ref: the coordinator never maps the rows. A pack maps
    units of this node (zero-copy) and puts one object per rank holding just that rank's rows.
    The objects live as long as this process (and someone holds their refs): after a restart the
    coordinator reads again what the old process held.
    """

    def __init__(self, index: SourceIndex, max_seq_len: int | None, skip_corrupt: bool) -> None:
        self.index = index
        self.max_seq_len = max_seq_len
        self.skip_corrupt = skip_corrupt
        self.dtypes = index.roles[0]

    def read(self, unit: int) -> tuple[UnitMeta, ray.ObjectRef, int]:
        chunk = read_unit(self.index, unit, max_seq_len=self.max_seq_len, skip_corrupt=self.skip_corrupt)
        return chunk.meta(), ray.put(chunk.rows), os.getpid()

    def pack(self, pieces: dict[int, tuple[np.ndarray, np.ndarray]], refs: dict[int, ray.ObjectRef]):
        """{rank: ref of its rows ``pieces[rank]`` = (unit, row)}, this process's pid; or
        ``("lost", error)`` when a unit's rows are gone."""
        units = list(refs)
        try:
            held = dict(zip(units, ray.get([refs[u] for u in units])))
        except ObjectLostError as exc:
            return "lost", str(exc)
        return {rank: ray.put(pack(held, unit, row, self.dtypes)) for rank, (unit, row) in pieces.items()}, os.getpid()

    def alive(self, pids: list[int]) -> list[bool]:
        """Whether each process of this node still runs (a zombie counts as dead)."""
        return [_running(pid) for pid in pids]

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"

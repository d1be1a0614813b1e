"""Reader actors: decode row groups into their node's object store, pack rows for other nodes.

Kept apart from the coordinator so a reader process imports only what reading needs (pyarrow,
NumPy, the ragged-copy kernel), not the planner: readers start sooner. A reader holds no state
but the objects it owns: every call names what to read (:meth:`SourceIndex.only`), so a restarted
reader serves at once, and one process serves loader after loader. Readers a loader (named or
not) started stay warm in this process after it closes (:func:`take_readers`, :func:`give_back`), as
Ray's own worker pool does for tasks: the next loader skips their start (about 0.8 CPU-s and
0.5 s each). :func:`shutdown_readers` (or ``ray.shutdown``) ends them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import ray
from ray.exceptions import ObjectLostError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from loader.stages.assemble import pack
from loader.stages.rows import keep_rows
from loader.stages.clean import UnitMeta
from loader.backends.telemetry import record_read
from loader.control.protocol import Lost
from loader.stages.decode import decode_unit, fetch_unit, reader_priority
from loader.contract.sources import SourceIndex

READER_RESTARTS = 8  # per reader actor; a reader that keeps dying points at a real problem
READ_AHEAD = 1  # row groups a reader fetches while it decodes another
_PING_S = 10.0  # a warm reader that does not answer this fast is dropped


def reader_nodes() -> list[str]:
    """Ids of the alive nodes readers go to, round-robin: those with CPUs (a head node started with
    ``--num-cpus=0`` is kept free), or every alive node if none has any."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    with_cpus = [n for n in alive if n.get("Resources", {}).get("CPU", 0) > 0]
    return sorted(n["NodeID"] for n in (with_cpus or alive))


@dataclass(frozen=True)
class Held:
    """A reader's object (a unit's rows or a packed piece): ``ref``, owned by reader ``reader`` on
    ``node`` while its process ``pid`` lives (Ray loses an object with its owner)."""

    ref: ray.ObjectRef
    reader: int
    pid: int
    node: str


@ray.remote(num_cpus=0, concurrency_groups={"control": 1, "read": READ_AHEAD + 1})
class Reader:
    """Reads units and packs rows on its node; holds no state but the objects it owns.

    A read puts the unit's decoded rows into this node's object store and returns only its
    statuses and lengths plus the object's ref: the coordinator never maps the rows. A pack maps
    units of this node (zero-copy) and puts one object per rank holding just that rank's rows.
    The objects live as long as this process (and someone holds their refs): after a restart the
    coordinator reads again what the old process held. Reads decode one at a time, but while one
    decodes, the bytes of up to ``READ_AHEAD`` more are fetched from remote filesystems (the
    read-ahead: object storage answers while this process decodes; local files are fetched when
    their decode starts, so their bytes are not held meanwhile); packs run one at a time; the small control calls
    (``alive``, ``pid``, ``node_id``) on a thread of their own, so a liveness check never waits
    behind queued reads.
    """

    def __init__(self) -> None:
        self.decoding = threading.Lock()
        # Ray sets OMP_NUM_THREADS=1 in a zero-CPU actor, and pyarrow sizes its thread pool from it: a part of
        # a row group (decoded on pyarrow's threads, loader.stages.decode) would decode on one core only
        pa.set_cpu_count(len(os.sched_getaffinity(0)))

    @ray.method(concurrency_group="read")
    def read(self, unit: SourceIndex, max_seq_len: int | None, skip_corrupt: bool, loader: str,
             nice: int, alone: bool = False) -> tuple[UnitMeta, ray.ObjectRef, int]:
        """Read ``unit`` (an index of one row group or part, :meth:`SourceIndex.only`) for the loader
        tagged ``loader`` in the metrics, ``nice`` below this process's priority (:func:`reader_priority`);
        ``alone``: nothing else is read meanwhile, so a whole row group decodes on pyarrow's threads."""
        reader_priority(nice)
        fetched = fetch_unit(unit, 0, skip_corrupt=skip_corrupt) if unit.files[0].remote else None  # beside a decode
        with self.decoding:
            if fetched is None:  # a local file: its bytes come at page-cache speed, fetched bytes would only wait
                fetched = fetch_unit(unit, 0, skip_corrupt=skip_corrupt)
            chunk = decode_unit(unit, fetched, max_seq_len=max_seq_len, skip_corrupt=skip_corrupt, threads=alone,
                                sliced=True)  # a part's slices go into the object store as they are: one copy
            del fetched
            record_read(loader, ray.get_runtime_context().get_node_id(), len(chunk.status), chunk.rows.nbytes)
            return chunk.meta(), ray.put(chunk.rows), os.getpid()

    def pack(self, pieces: dict[int, tuple[np.ndarray, np.ndarray]], refs: dict[int, ray.ObjectRef],
             dtypes: dict[str, np.dtype]) -> tuple[dict[int, ray.ObjectRef], int] | Lost:
        """({rank: ref of its rows ``pieces[rank]`` = (unit, row)}, this process's pid), or
        :class:`loader.control.protocol.Lost` when a unit's rows are gone."""
        held = _mapped(refs)
        if isinstance(held, Lost):
            return held
        return {rank: ray.put(pack(held, unit, row, dtypes)) for rank, (unit, row) in pieces.items()}, os.getpid()

    def keep(self, refs: dict[int, ray.ObjectRef], kept: dict[int, np.ndarray],
             dtypes: dict[str, np.dtype]) -> tuple[dict[int, ray.ObjectRef], int] | Lost:
        """({unit: ref of a copy of its rows holding rows ``kept[unit]`` only}, this process's pid), or
        :class:`loader.control.protocol.Lost` when a unit's rows are gone."""
        held = _mapped(refs)
        if isinstance(held, Lost):
            return held
        return {u: ray.put(keep_rows(rows, kept[u], dtypes)) for u, rows in held.items()}, os.getpid()

    @ray.method(concurrency_group="control")
    def alive(self, pids: list[int]) -> list[bool]:
        """Whether each process of this node still runs (a zombie counts as dead)."""
        return [_running(pid) for pid in pids]

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


def _mapped(refs: dict[int, ray.ObjectRef]) -> dict | Lost:
    """Each unit's rows, mapped from this node's object store, or :class:`Lost` when one is gone."""
    try:
        return dict(zip(refs, ray.get(list(refs.values()))))
    except ObjectLostError as exc:
        return Lost(str(exc))


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (its parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rindex(b")") + 2 : stat.rindex(b")") + 3] != b"Z"


# ---------------------------------------------------------------- warm readers of this process

_lock = threading.Lock()
# (Ray job id, environment settings) -> [(node id, reader)] not serving a loader
_idle: dict[tuple[str, tuple[tuple[str, str], ...]], list[tuple[str, object]]] = {}


def take_readers(count: int, env: Mapping[str, str] | None = None) -> tuple[list, list[str]]:
    """``count`` readers, round-robin over :func:`reader_nodes`, and the node each is pinned to:
    warm ones of this process first (those that still answer), new ones for the rest.

    ``env``: environment variables the readers' processes run with (Ray's ``runtime_env``), over those Ray's workers
    inherit from where Ray started; a warm reader serves only a loader that asks for the same ones."""
    nodes = reader_nodes()
    key = _pool_key(env)
    with _lock:
        for other in [k for k in _idle if k[0] != key[0]]:  # handles of an earlier ray.init: gone
            del _idle[other]
        idle = _idle.pop(key, [])
    wanted = [nodes[i % len(nodes)] for i in range(count)]
    warm: list = [None] * count
    for i, node in enumerate(wanted):
        match = next((k for k in reversed(range(len(idle))) if idle[k][0] == node), None)  # the latest parked
        if match is not None:
            warm[i] = idle.pop(match)[1]
    _park(idle, env)  # more warm readers than wanted: they wait for another loader
    alive = {id(r) for r in _answering([r for r in warm if r is not None])}
    return [reader if id(reader) in alive else _start(node, env) for reader, node in zip(warm, wanted)], wanted


def give_back(readers: list, nodes: list[str], env: Mapping[str, str] | None = None) -> None:
    """Readers of a closed loader (taken with ``env``) wait here for the next loader of this process."""
    _park(list(zip(nodes, readers)), env)


def _pool_key(env: Mapping[str, str] | None) -> tuple[str, tuple[tuple[str, str], ...]]:
    """Where warm readers of ``env`` wait in :data:`_idle`: (this Ray job, the settings, sorted)."""
    return ray.get_runtime_context().get_job_id(), tuple(sorted((env or {}).items()))


def _park(pairs: list[tuple[str, object]], env: Mapping[str, str] | None) -> None:
    key = _pool_key(env)
    with _lock:
        _idle.setdefault(key, []).extend(pairs)


def shutdown_readers() -> None:
    """End this process's warm readers (they also end with ``ray.shutdown`` or this process)."""
    with _lock:
        pairs = [pair for pairs in _idle.values() for pair in pairs]
        _idle.clear()
    for _, reader in pairs:
        try:
            ray.kill(reader)
        except (RayActorError, ValueError):
            pass


def _start(node: str, env: Mapping[str, str] | None):
    extra = {"runtime_env": {"env_vars": dict(env)}} if env else {}
    return Reader.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False), max_restarts=READER_RESTARTS, **extra
    ).remote()


def _answering(readers: list) -> list:
    """Those of ``readers`` whose process answers (a warm reader may have died since); the others
    are killed."""
    if not readers:
        return []
    pings = [r.pid.remote() for r in readers]
    ready, _ = ray.wait(pings, num_returns=len(pings), timeout=_PING_S)
    out = []
    for reader, ping in zip(readers, pings):
        try:
            if ping in ready:
                ray.get(ping)
                out.append(reader)
                continue
        except RayActorError:  # died (or is restarting): replaced
            pass
        try:
            ray.kill(reader)
        except (RayActorError, ValueError):
            pass
    return out

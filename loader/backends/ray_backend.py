"""``backend="ray"``: reader actors and a control plane, thin shells over the pure stages and the control plane.

- :class:`loader.backends.reader.Reader` actors (default one per available CPU, pinned round-robin to the
  nodes that have CPUs; restartable) decode, validate and truncate row groups into their node's
  object store and return only statuses, lengths and the object's ref; on request they pack the
  rows of their node that ranks on other nodes train on, one object per (node, rank).
- :class:`RayReaders` is the control plane's :class:`loader.control.protocol.Readers` over them:
  each unit read on a reader of its home node (the least busy; a read whose reader died is
  re-issued: reads are pure, so nothing is lost or repeated), liveness from the readers of each
  node and Ray's view of the nodes. No call waits longer than ``liveness_timeout``.
- :class:`Control` wraps :class:`loader.control.service.Service` over :class:`RayReaders`, with its
  metrics; :class:`Host`, a named loader's coordinator actor, holds one while loaders are attached to it.
  Neither maps a row group.

  - A loader with a ``name`` runs it as the :data:`Coordinator` actor, named after the loader in
    the ``freescale`` namespace and placed on the node of the process that creates it (which owns
    it), so trainer processes constructing the loader with the same arguments and ``name`` attach
    to it (telling it their node, for the locality-aware plan, and their process id, so a dead
    rank fails the run at once). The last to ``close()`` closes its control plane; the actor (a :class:`Host`)
    stays warm for the next loader of the name for ``COORDINATOR_IDLE_S`` seconds, with the readers it
    started and owns.
  - An unnamed loader is private to this process, so its control plane runs here, on the control
    loop thread (:class:`LocalControl`): no coordinator process to start, no actor call per
    message. Its readers stay warm for this process's next loader (:func:`loader.backends.reader.take_readers`).
  - An unnamed loader on a Ray whose only node with CPUs is this one (``readers="auto"``), or asked to
    (``readers="threads"``), reads on threads of this process instead (:class:`ThreadClient`: the inline
    backend's readers, with this backend's metrics): every row it decodes stays in this process, none
    goes through the object store (docs/benchmarks.md: 0.16 against 2.3 GB of memory on long histories).
- :func:`make_client` picks what a :class:`loader.SequenceLoader` holds: a :class:`RayClient` in each trainer
  process, or a :class:`ThreadClient`;
  :class:`RayStream` maps a message's objects (zero-copy for row groups of its own node; a piece
  packed on another node crosses the network once). After decoding, an event is written once into
  the object store of the node that read it and once into the trainer's tensor; rows that cross
  nodes are packed once more on the way.

Ray's exceptions end here: where the loader knows what was lost they become its named errors
(:mod:`loader.errors`: a silent or dead coordinator, a lost node, readers that keep dying).

The control plane publishes the loader's stats as Ray metrics and readers count what they decode
(:mod:`loader.backends.telemetry`); a trainer process tells the control plane, with each request, how long
its rank waited for the previous message and how many bytes it mapped for it.

A named coordinator is owned by the process that created it, and its readers by the coordinator; an unnamed
loader's readers by its process: an owner must outlive the others' use of what it owns (Ray kills a non-detached
actor with its owner).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import threading
import time

import ray
from ray.exceptions import (ActorUnavailableError, GetTimeoutError, ObjectLostError, RayActorError, RayTaskError,
                            WorkerCrashedError)
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from loader.stages.assemble import RankMessage
from loader.config import LoaderConfig
from loader.errors import CoordinatorLost, NodeLost, ReadersLost
from loader.backends.telemetry import PUBLISH_S, Publisher, loader_tag
from loader.stages.rows import flatten
from loader.stages.pipeline import Resume, warm_up
from loader.control.production import MESSAGE_BYTES, REMOTE_MESSAGE_BYTES
from loader.control.protocol import End, Fetched, Health, Lost, Opened, Packed, Reply, Step, Wait, Where
from loader.stages.decode import readahead_units
from loader.backends.inline import InlineClient
from loader.backends.reader import Held, give_back, take_readers
from loader.control.runs import RunKey
from loader.control.service import Service
from loader.contract.sources import SourceIndex
from loader.control.stream import POLL_S, ControlCalls, LoopCalls, Stream, control_loop

NAMESPACE = "freescale"
READ_ATTEMPTS = 10  # per unit, over restarts and other readers
_POLL_S = POLL_S  # a blocking call returns Wait after this long (at most), so the caller can warn
STARTUP_S = 120.0  # a coordinator that has not answered its first call this long (not placed, not started) is lost
COORDINATOR_IDLE_S = 60.0  # a named coordinator with no loader attached stays warm this long for the next one
ATTACH_ATTEMPTS = 5  # a named coordinator that died as this process attached to it is looked up (or started) again
ASK_ATTEMPTS = 10  # per step: a call that failed in transit is asked again (the coordinator resends)
_LOST = (RayActorError, ObjectLostError, WorkerCrashedError)


def coordinator_name(name: str) -> str:
    return f"freescale-loader:{name}"


class RayReaders:
    """The :class:`loader.control.protocol.Readers` of the Ray backend: reader actors pinned to nodes.

    Reads go to the least busy reader of the unit's home node; a read whose reader died is re-issued
    (reads are pure, so nothing is lost or repeated). No call waits longer than
    ``config.liveness_timeout``: a node whose readers stay silent that long, or that Ray declares
    dead, is reported lost (:class:`loader.errors.NodeLost`), so the control plane ends the run with
    a named error instead of waiting without end.
    """

    def __init__(self, index: SourceIndex, config: LoaderConfig) -> None:
        self.index = index
        self.config = config
        self.liveness = config.liveness_timeout
        self.dtypes = index.roles[0]
        self.groups = index.groups  # (U,) row group of each unit: a row group's parts go to one reader
        self.tag = loader_tag(config.name)
        self.readers: list = []
        self.nodes: list[str] = []
        self.busy: list[int] = []  # calls in flight per reader
        self.ready = asyncio.Event()
        self.inflight: set[ray.ObjectRef] = set()  # reads sent and not answered yet
        self.silent: dict[str, float] = {}  # node -> since when its readers have not answered a liveness check
        self.passes: dict[int, int] = {}  # row group -> the reader its parts go to, while some are still to read

    def set(self, readers: list, nodes: list[str]) -> None:
        """The readers, and the node each is pinned to."""
        self.readers = readers
        self.busy = [0] * len(readers)
        self.nodes = list(nodes)
        self.ready.set()

    def cancel(self) -> None:
        """Cancel the reads still queued on the readers (warm readers would make the next loader wait behind them)."""
        for call in list(self.inflight):
            ray.cancel(call)

    def _on(self, node) -> list[int]:
        """Readers on ``node`` (every reader when none is there, or ``node`` is None)."""
        here = [i for i, n in enumerate(self.nodes) if n == node]
        return here or list(range(len(self.readers)))

    async def _call(self, candidates: list[int], what: str, call, prefer: int | None = None, storage: bool = False):
        """``call(i)`` on candidate reader ``prefer`` if given, else on the least busy one; when that reader died,
        on the least busy of the others (the dead one restarts meanwhile), up to READ_ATTEMPTS times, within the
        liveness timeout (and, for a call that reads the ``storage``, the time it may try a read again)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.liveness + (self.config.storage_retry_s if storage else 0.0)
        tried: set[int] = set()
        for attempt in range(READ_ATTEMPTS):
            untried = [i for i in candidates if i not in tried] or candidates
            owner = prefer if prefer in untried else min(untried, key=lambda i: (self.busy[i], i))
            self.busy[owner] += 1
            try:
                return await asyncio.wait_for(call(owner), max(0.0, deadline - loop.time()))
            except RayTaskError as exc:  # the call itself failed: a real error, not a lost reader
                raise exc.cause from None
            except asyncio.TimeoutError:
                retry = f" + storage_retry_s={self.config.storage_retry_s:g} s" if storage else ""
                raise NodeLost(self.nodes[owner], [], f"its reader did not finish {what} within "
                               f"liveness_timeout={self.liveness:g} s{retry}") from None
            except _LOST as exc:
                lost = exc
                tried.add(owner)
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
            finally:
                self.busy[owner] -= 1
        raise ReadersLost(what, READ_ATTEMPTS, str(lost))

    async def fetch(self, unit: int, node, *, alone: bool = False) -> Fetched:
        """Read ``unit`` on a reader of ``node`` (its home); ``alone``: on every core of the reader's node."""
        await self.ready.wait()
        spec = self.index.only(unit)

        async def read(i: int) -> Fetched:
            call = self.readers[i].read.remote(spec, self.config.max_seq_len, self.config.skip_corrupt, self.tag,
                                                self.config.reader_nice, alone)
            self.inflight.add(call)
            try:
                meta, ref, pid = await call
            finally:
                self.inflight.discard(call)
            return Fetched(meta, Held(ref, i, pid, self.nodes[i]), self.nodes[i])

        candidates = self._on(node)
        u = self.index.units[unit]
        prefer = None if u.whole else self._pass_reader(int(self.groups[unit]), candidates, last=u.part == u.parts - 1)
        return await self._call(candidates, self.index.describe(unit), read, prefer, storage=True)

    def _pass_reader(self, group: int, candidates: list[int], *, last: bool) -> int:
        """The reader of ``candidates`` for the next part of row group ``group``: the one that read its other parts
        (it decodes them in one pass over the row group), else the least busy, as for a whole row group (a fixed
        reader per row group put a shuffle block's first units on one reader while the other read ahead: the first
        step waited for both in turn). ``last``: the row group's last part, whose reader is then forgotten."""
        reader = self.passes.get(group)
        if reader not in candidates:
            reader = min(candidates, key=lambda i: (self.busy[i], i))
        if last:
            self.passes.pop(group, None)
        else:
            self.passes[group] = reader
        return reader

    async def pack(self, node, pieces: dict, handles: dict[int, Held]) -> Packed | Lost:
        """Pack ``pieces`` on a reader of ``node``, where ``handles``' rows are held."""

        async def pack_on(i: int) -> Packed | Lost:
            done = await self.readers[i].pack.remote(pieces, {u: h.ref for u, h in handles.items()}, self.dtypes)
            if isinstance(done, Lost):
                return done
            refs, pid = done
            return Packed({rank: Held(ref, i, pid, self.nodes[i]) for rank, ref in refs.items()})

        return await self._call(self._on(node), f"packing rows on node {node}", pack_on)

    async def keep(self, node, handles: dict[int, Held], kept: dict) -> dict[int, Held] | Lost:
        """Copies of ``handles``' units holding rows ``kept`` only, made by a reader of ``node``."""

        async def keep_on(i: int) -> dict[int, Held] | Lost:
            done = await self.readers[i].keep.remote({u: h.ref for u, h in handles.items()}, kept, self.dtypes)
            if isinstance(done, Lost):
                return done
            refs, pid = done
            return {u: Held(ref, i, pid, self.nodes[i]) for u, ref in refs.items()}

        return await self._call(self._on(node), f"keeping carried rows on node {node}", keep_on)

    async def renew(self, held: dict[int, Fetched | None]) -> dict[int, Fetched]:
        """Fresh reads of the units whose handle is missing or whose reader process is gone."""
        readers = sorted({read.handle.reader for read in held.values() if read is not None})
        pids = dict(zip(readers, await asyncio.gather(*(self._pid(i) for i in readers))))
        lost = [u for u, read in held.items() if read is None or pids[read.handle.reader] != read.handle.pid]
        reads = await asyncio.gather(*(self.fetch(u, None if held[u] is None else held[u].node) for u in lost))
        return dict(zip(lost, reads))

    async def _pid(self, i: int) -> int | None:
        try:
            return await asyncio.wait_for(self.readers[i].pid.remote(), self.liveness)
        except (*_LOST, asyncio.TimeoutError):  # dead for good, or unreachable: whatever it held is lost
            return None

    async def alive(self, wheres: list[Where]) -> Health:
        """Ask a reader on each process's node whether the processes run; a node Ray declared dead, or
        whose readers have not answered for the liveness timeout, is lost. A node without readers is
        watched through Ray's view of it only."""
        if not self.ready.is_set():
            return Health()
        loop = asyncio.get_running_loop()
        wanted = {w.node for w in wheres if w.node is not None}
        dead_nodes = await _dead_nodes(wanted, timeout=min(_POLL_S, self.liveness / 2))
        dead: set[int] = set()
        lost: dict[str, str] = {}
        for node in wanted:
            if node in dead_nodes:
                lost[node] = "Ray declared the node dead (its raylet stopped answering the head node)"
                continue
            here = [i for i, n in enumerate(self.nodes) if n == node]
            if not here:
                continue
            mine = [i for i, w in enumerate(wheres) if w.node == node]
            asked = loop.time()
            try:
                found = await asyncio.wait_for(self.readers[here[0]].alive.remote([wheres[i].pid for i in mine]),
                                               min(_POLL_S, self.liveness / 2))
            except (*_LOST, ActorUnavailableError, asyncio.TimeoutError):  # restarting, or unreachable
                since = self.silent.setdefault(node, asked)
                if loop.time() - since >= self.liveness:
                    lost[node] = (f"its readers have not answered for {loop.time() - since:.0f} s "
                                  f"(liveness_timeout={self.liveness:g} s): the node is down or cut off")
                continue
            self.silent.pop(node, None)
            dead.update(i for i, ok in zip(mine, found) if not ok)
        return Health(frozenset(dead), lost)


async def _dead_nodes(nodes: set[str], timeout: float) -> set[str]:
    """Those of ``nodes`` that Ray's head declared dead (nothing, when the head does not answer in time)."""
    if not nodes:
        return set()
    try:
        table = await asyncio.wait_for(asyncio.to_thread(ray.nodes), timeout)
    except asyncio.TimeoutError:
        return set()
    return {n["NodeID"] for n in table if n["NodeID"] in nodes and not n.get("Alive")}


class Control:
    """One loader's control plane: a :class:`loader.control.service.Service` over :class:`RayReaders`, and its
    metrics. ``remote_ranks``: the ranks run in other processes (a named loader's coordinator): their processes
    and nodes are checked to live, and messages are larger (``REMOTE_MESSAGE_BYTES``: each costs a Ray call)."""

    def __init__(self, index: SourceIndex, config: LoaderConfig, remote_ranks: bool = True) -> None:
        self.config = config
        self.readers = RayReaders(index, config)
        self.publisher = Publisher(self.readers.tag)
        self.publishing: asyncio.Task | None = None
        self.service = Service(index, config, self.readers, watch=remote_ranks,
                               readahead=readahead_units(index, config.num_readers or 2),
                               message_bytes=REMOTE_MESSAGE_BYTES if remote_ranks else MESSAGE_BYTES)
        # compile or load the planner's kernels beside the first reads (the first plan waits on numba's lock)
        threading.Thread(target=warm_up, args=(config,), daemon=True).start()

    async def set_readers(self, readers: list, nodes: list[str]) -> None:
        """The readers, and the node each is pinned to."""
        self.readers.set(readers, nodes)
        self.publishing = asyncio.ensure_future(self._publish())

    async def _publish(self) -> None:
        while True:
            self.publisher.publish(self.service.stats.as_dict())
            await asyncio.sleep(PUBLISH_S)

    async def close(self) -> None:
        """Stop serving: the run in progress ends, and reads still queued on the readers are cancelled."""
        self.service.close()
        self.readers.cancel()
        if self.publishing is not None:
            self.publishing.cancel()
            self.publisher.publish(self.service.stats.as_dict())

    async def open(self, ranks: list[int], key: RunKey, timeout: float, where: Where) -> Opened | Wait:
        return await self.service.open(ranks, key, timeout, where)

    async def next(self, rank: int, run_id: int, step: int, timeout: float, taken: tuple[float, int]) -> Reply:
        return await self.service.next(rank, run_id, step, timeout, taken)

    async def repair(self, rank: int, run_id: int, step: int) -> Step | End:
        return await self.service.repair(rank, run_id, step)

    async def leave(self, ranks: list[int], run_id: int) -> None:
        await self.service.leave(ranks, run_id)

    async def stats(self) -> dict:
        return self.service.stats.as_dict()

    async def reader_handles(self) -> list:
        await self.readers.ready.wait()
        return self.readers.readers

    async def reader_nodes(self) -> list[str]:
        await self.readers.ready.wait()
        return list(self.readers.nodes)


class Host:
    """A named loader's coordinator actor (:data:`Coordinator`): the :class:`Control` of the loaders attached to
    it, idle between loaders, and the reader actors they read on.

    Trainer processes attach to it by name; the first to attach arms it with its loader's source and arguments
    (a later loader with others is refused while any is attached), and the last to detach closes that control
    plane. The actor stays, idle and warm, for the next loader of the same name, which may bring other data or
    arguments: its process, imports and planner kernels are what a named loader's construction waited for
    (about 1 s on the bench machine). It starts the readers (:func:`loader.backends.reader.take_readers`, begun
    as it starts) and owns them, so they stay warm with it whichever trainer process attaches first, and end
    with it. It ends once idle for ``idle_s`` seconds, or with its owner (the process that created it).
    """

    def __init__(self, idle_s: float, readers: int, env: dict[str, str]) -> None:
        self.control: Control | None = None
        self.fingerprint: tuple | None = None
        self.attached: list[Where] = []  # the process of each attached loader
        self.lifecycle = asyncio.Lock()  # attach and detach one at a time: none joins a control plane closing
        self.idle_s = idle_s
        self.expiry: asyncio.Task | None = None
        # readers start as this actor starts (beside the first attach, not after it: each is a process start and
        # imports); between loaders they wait warm in this process (loader.backends.reader.give_back)
        starter = concurrent.futures.ThreadPoolExecutor(1)
        self.env = env  # the readers' environment settings (its creator's: RayClient)
        self.starting: concurrent.futures.Future | None = starter.submit(take_readers, readers, env)
        starter.shutdown(wait=False)  # its one thread ends with the start, not with this actor
        self.readers: tuple[list, list[str]] | None = None  # the armed loader's

    async def attach(self, index: SourceIndex, config: LoaderConfig, fingerprint: tuple, count: int, where: Where,
                     ) -> str:
        """Count the loader of the process at ``where`` (``count``: the readers it wants, where it arms this
        coordinator); this coordinator's node."""
        async with self.lifecycle:
            if self.control is None:
                control = Control(index, config)  # its planner kernels load while the readers come
                if self.starting is not None:
                    started, self.starting = self.starting, None
                    give_back(*await asyncio.wrap_future(started), self.env)
                # warm ones that answer, new ones for the rest
                self.readers = await asyncio.to_thread(take_readers, count, self.env)
                await control.set_readers(*self.readers)
                self.control, self.fingerprint = control, tuple(fingerprint)
            elif tuple(fingerprint) != self.fingerprint:
                raise ValueError(
                    f"a loader named {config.name!r} already runs with other data or arguments; construct this "
                    "loader with the same source and arguments, or give it another name"
                )
            if self.expiry is not None:
                self.expiry.cancel()
                self.expiry = None
            self.attached.append(where)
            return ray.get_runtime_context().get_node_id()

    async def detach(self, where: Where) -> int:
        """The loader of the process at ``where`` let go: the number of loaders still attached whose process
        lives (one that died without closing, such as a failed trainer worker, is not waited for). When none is
        left, the control plane closes (the run in progress ends, reads still queued are cancelled)."""
        async with self.lifecycle:
            if where not in self.attached:  # judged dead and dropped already (or this coordinator is idle)
                return len(self.attached)
            control = self._armed()
            self.attached.remove(where)
            if self.attached:
                health = await control.readers.alive(self.attached)
                self.attached = [w for i, w in enumerate(self.attached)
                                 if i not in health.dead and w.node not in health.lost]
            if not self.attached:
                await control.close()
                give_back(*self.readers, self.env)
                self.control = self.fingerprint = self.readers = None
                self.expiry = asyncio.ensure_future(self._expire())
            return len(self.attached)

    async def _expire(self) -> None:
        """End this actor (freeing its name) once idle for ``idle_s`` seconds; an attach meanwhile keeps it."""
        await asyncio.sleep(self.idle_s)
        async with self.lifecycle:
            if self.control is None:
                ray.kill(ray.get_runtime_context().current_actor)

    def _armed(self) -> Control:
        if self.control is None:
            raise RuntimeError("no loader is attached to this coordinator any more (every loader of its name was "
                               "closed); construct the loader again")
        return self.control

    async def loaders(self) -> int:
        """How many loaders are attached (0: idle)."""
        return len(self.attached)

    async def open(self, ranks: list[int], key: RunKey, timeout: float, where: Where) -> Opened | Wait:
        return await self._armed().open(ranks, key, timeout, where)

    async def next(self, rank: int, run_id: int, step: int, timeout: float, taken: tuple[float, int]) -> Reply:
        return End() if self.control is None else await self.control.next(rank, run_id, step, timeout, taken)

    async def repair(self, rank: int, run_id: int, step: int) -> Step | End:
        return End() if self.control is None else await self.control.repair(rank, run_id, step)

    async def leave(self, ranks: list[int], run_id: int) -> None:
        if self.control is not None:
            await self.control.leave(ranks, run_id)

    async def stats(self) -> dict:
        return await self._armed().stats()

    async def reader_handles(self) -> list:
        return await self._armed().reader_handles()

    async def reader_nodes(self) -> list[str]:
        return await self._armed().reader_nodes()

    async def pid(self) -> int:
        return os.getpid()


Coordinator = ray.remote(num_cpus=0, max_restarts=0)(Host)  # a named loader's control plane


class RayCalls(ControlCalls):
    """:class:`loader.control.stream.ControlCalls`, and the calls that name a Ray control plane's readers."""

    def reader_handles(self):
        return self.submit(self.handle.reader_handles)

    def reader_nodes(self):
        return self.submit(self.handle.reader_nodes)


class ActorControl(RayCalls):
    """Calls into the :data:`Coordinator` actor (a :class:`Host`): each returns an ObjectRef."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def submit(self, method, *args) -> ray.ObjectRef:
        return method.remote(*args)

    def attach(self, index: SourceIndex, config: LoaderConfig, fingerprint: tuple, count: int, where: Where):
        return self.submit(self.handle.attach, index, config, fingerprint, count, where)

    def detach(self, where: Where):
        return self.submit(self.handle.detach, where)


class LocalControl(LoopCalls, RayCalls):
    """A :class:`Control` on this process's control-plane event loop (:func:`loader.control.stream.control_loop`):
    each call returns a future."""

    def __init__(self, index: SourceIndex, config: LoaderConfig) -> None:
        async def make() -> Control:
            return Control(index, config, remote_ranks=False)

        super().__init__(asyncio.run_coroutine_threadsafe(make(), control_loop()).result())

    def set_readers(self, readers: list, nodes: list[str]):
        """Hand the control plane this process's readers (a named loader's coordinator starts its own)."""
        return self.submit(self.handle.set_readers, readers, nodes)


def connect(address: str | None, *, name: str | None = None, processes: int = 1) -> None:
    """Join the running Ray of this process, or ``ray.init`` (no address: start or join a local Ray).

    A named loader shared by ``processes`` > 1 trainer processes (torchrun's, as the caller read them) joins a
    running Ray only: a private local Ray per process would leave each rank alone with its own coordinator.
    """
    if ray.is_initialized():
        return
    if address is None and name is not None and processes > 1:
        try:
            ray.init(address="auto")
        except ConnectionError:
            raise RuntimeError(
                f"the loader named {name!r} is shared by the {processes} trainer processes torchrun started, "
                "through one Ray, and none runs: start it first (`ray start --head`, or set RAY_ADDRESS to "
                "a cluster), or pass backend='inline' (every process then reads the whole epoch itself)"
            ) from None
        return
    ray.init(address=address)


def make_client(index: SourceIndex, config: LoaderConfig, fingerprint: int, *, processes: int = 1,
                reader_env: dict[str, str] | None = None):
    """The Ray backend's client in this process: :class:`ThreadClient` for an unnamed loader whose readers are
    threads here (``readers="threads"``, or ``"auto"`` when this node is the only one of this Ray with CPUs),
    :class:`RayClient` otherwise. ``processes``: trainer processes sharing a named loader (torchrun's);
    ``reader_env``: environment settings of this process that reader actors take with them (:class:`RayClient`)."""
    connect(config.ray_address, name=config.name, processes=processes)
    if config.name is None and (config.readers == "threads" or (config.readers == "auto" and _only_node())):
        return ThreadClient(index, config)
    return RayClient(index, config, fingerprint, reader_env or {})


def _only_node() -> bool:
    """Whether every live node of this Ray with CPUs is this process's (reader actors would all run here)."""
    here = ray.get_runtime_context().get_node_id()
    return all(n["NodeID"] == here for n in ray.nodes() if n.get("Alive") and n["Resources"].get("CPU", 0) > 0)


class ThreadClient(InlineClient):
    """An unnamed Ray loader that reads on threads of this process (:func:`make_client`): the inline backend's
    control plane and readers, with the Ray backend's metrics (:mod:`loader.backends.telemetry`)."""

    def __init__(self, index: SourceIndex, config: LoaderConfig) -> None:
        super().__init__(index, config)
        self.publisher = Publisher(loader_tag(None))
        self.publishing = asyncio.run_coroutine_threadsafe(self._publish(), control_loop())

    async def _publish(self) -> None:
        while True:
            self.publisher.publish(self.calls.handle.stats.as_dict())
            await asyncio.sleep(PUBLISH_S)

    def reader_nodes(self) -> list[str]:
        raise ValueError(self._threads())

    def reader_handles(self) -> list:
        raise ValueError(self._threads())

    def _threads(self) -> str:
        why = "readers='threads'" if self.config.readers == "threads" else "readers='auto' on a one-node Ray"
        return (f"this loader reads on threads of this process ({why}), it has no reader actors; pass "
                "readers='actors' for them")

    def close(self) -> None:
        self.publishing.cancel()
        self.publisher.publish(self.stats())  # the final figures
        super().close()


class RayClient:
    """A trainer process's handle on its loader's control plane: in this process for an unnamed
    loader, the named coordinator actor otherwise.

    The named coordinator is placed on the node of the process that creates it (the first trainer
    process to construct the loader, usually rank 0's, which owns it and must outlive the others'
    use of it): it then lives no longer than its owner (idle, it ends after ``COORDINATOR_IDLE_S``),
    and a node lost elsewhere takes no control plane with it. Every call to it is bounded by
    ``liveness_timeout``; Ray's exceptions about it end here, as :class:`loader.errors.CoordinatorLost`.

    ``reader_env``: environment variables the reader actors run with (the S3 client's settings this process chose:
    ``loader.sequence``), whichever environment Ray's workers inherited where it started; a named coordinator's
    readers take its creator's.
    """

    def __init__(self, index: SourceIndex, config: LoaderConfig, fingerprint: int, reader_env: dict[str, str]) -> None:
        self.config = config
        self.reader_env = reader_env
        shape = (fingerprint, config.locality, config.ranks_per_node)
        count = config.num_readers or max(1, int(ray.available_resources().get("CPU", 1)))
        here = ray.get_runtime_context().get_node_id()
        self.where = Where(node=here, pid=os.getpid())
        self.node = here  # the coordinator's node, for errors that name it
        self.closed = False
        self.readers: tuple[list, list[str]] | None = None  # an unnamed loader's, given back on close
        if config.name is None:
            self.control = LocalControl(index, config)
            self.readers = take_readers(count, reader_env)
            self.control.set_readers(*self.readers)
            return
        options = {"namespace": NAMESPACE, "name": coordinator_name(config.name), "get_if_exists": True,
                   "scheduling_strategy": NodeAffinitySchedulingStrategy(here, soft=False)}
        for attempt in range(ATTACH_ATTEMPTS):
            coordinator = Coordinator.options(**options).remote(COORDINATOR_IDLE_S, count, reader_env)
            self.control = ActorControl(coordinator)
            # Held past this loader's close: Ray ends a named actor once its creator drops the handle it
            # created with. A handle to the same actor found later (equal) must not replace that one.
            if _coordinators.get(config.name) != self.control.handle:
                _coordinators[config.name] = self.control.handle
            try:  # the first call waits for the coordinator to start (a process and its imports), not for a lost one
                self.node = self.get(self.control.attach(index, config, shape, count, self.where),
                                     timeout=max(STARTUP_S, config.liveness_timeout))
                break
            except CoordinatorLost:  # an idle one that ended (COORDINATOR_IDLE_S) as this process found it is gone:
                if attempt == ATTACH_ATTEMPTS - 1 or _exists(options):  # start anew; a silent one is lost
                    raise
                time.sleep(0.1 * 2**attempt)

    def get(self, pending, rank: int | None = None, timeout: float | None = None):
        """The reply of a control call: a local future's result, or ``ray.get`` within ``timeout``
        (default: the liveness timeout) that raises the remote exception itself (a ValueError stays
        a ValueError). A coordinator that died or stayed silent is :class:`CoordinatorLost`."""
        timeout = self.config.liveness_timeout if timeout is None else timeout
        try:
            return _get(pending, timeout)
        except GetTimeoutError:
            raise CoordinatorLost(self.config.name, self.node, rank, f"it has not answered for {timeout:.0f} s "
                                  f"(liveness_timeout={self.config.liveness_timeout:g} s): its node is down or "
                                  "cut off from this one") from None
        except RayActorError as exc:
            if isinstance(exc, ActorUnavailableError):
                raise
            raise CoordinatorLost(self.config.name, self.node, rank, f"it died ({type(exc).__name__}: its "
                                  "owner, the process that created it, or its node is gone)") from None

    def open(self, ranks: tuple[int, ...], epoch: int, start: Resume) -> RayStream:
        return RayStream(self, ranks, RunKey(epoch, start))

    def stats(self) -> dict:
        return self.get(self.control.stats())

    def reader_handles(self) -> list:
        return self.get(self.control.reader_handles())

    def reader_nodes(self) -> list[str]:
        return self.get(self.control.reader_nodes())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if isinstance(self.control, LocalControl):
                self.get(self.control.close())
            else:
                self._detach()
        finally:
            if self.readers is not None:  # an unnamed loader's: warm for this process's next loader
                give_back(*self.readers, self.reader_env)

    def _detach(self) -> None:
        """Leave the named coordinator; the last loader to leave closes its control plane (the coordinator
        stays, idle, for the next loader of the name)."""
        try:
            self.get(self.control.detach(self.where))
        except CoordinatorLost:  # already gone (its owner exited, it was killed, or it is cut off)
            pass


class RayStream(Stream):
    """A :class:`loader.control.stream.Stream` over a Ray control plane: every wait bounded, Ray's errors named.

    The coordinator answers every request within a poll interval (a :class:`Wait` when it has
    nothing yet), so a reply missing for the liveness timeout means the coordinator is lost. A
    message's rows are mapped before the next is asked for (zero-copy on this node; pieces packed
    for it on other nodes cross the network once): asked for first, a rank's fetch could wait
    forever on an object its owner had already let go.
    """

    def __init__(self, client: RayClient, ranks: tuple[int, ...], key: RunKey) -> None:
        self.client = client
        self.liveness = client.config.liveness_timeout
        super().__init__(client.control, ranks, key, client.where, poll=min(_POLL_S, self.liveness / 4))

    def get(self, pending, rank: int) -> Reply:
        return self.client.get(pending, rank, self.poll + self.liveness)

    def take(self, rank: int) -> Reply:
        """The reply to the rank's request in flight; asked again while the call fails in transit."""
        attempt = 0
        while True:
            try:
                return super().take(rank)
            except ActorUnavailableError:
                attempt += 1
                if attempt == ASK_ATTEMPTS:
                    raise CoordinatorLost(self.client.config.name, self.client.node, rank,
                                          f"{ASK_ATTEMPTS} calls in a row failed in transit") from None
                time.sleep(min(0.1 * 2**attempt, 2.0))
                self.ahead[rank] = self._request(rank)

    def fetch(self, rank: int, message: RankMessage) -> tuple[RankMessage, int]:
        """Map the message's sources; rows lost with a dead reader are read again (``repair``); rows
        on a node that stays silent for the liveness timeout end the rank with :class:`NodeLost`."""
        for attempt in range(READ_ATTEMPTS):
            try:
                # a copy: the control plane keeps the message it handed out, with its handles
                rows = ray.get([held.ref for held in message.sources], timeout=self.liveness)
                sources, source, row = flatten(rows, message.source, message.row)  # parts put as decoded, sliced
                return (dataclasses.replace(message, sources=sources, source=source, row=row),
                        sum(r.nbytes for r in rows))
            except GetTimeoutError:  # the rows of other nodes did not come (this node's are in place)
                here = self.client.where.node
                nodes = sorted({held.node for held in message.sources if held.node != here}) or [here]
                raise NodeLost(", ".join(nodes), [], f"rank {rank} could not fetch the rows of step "
                               f"{message.first_step} held there within liveness_timeout={self.liveness:g} s",
                               ) from None
            except ObjectLostError:
                if attempt == READ_ATTEMPTS - 1:
                    raise ReadersLost(f"rank {rank}'s rows of step {message.first_step}", READ_ATTEMPTS,
                                      "their reader died each time they were read again") from None
                reply = self.get(self.calls.repair(rank, self.run_id, message.first_step), rank)
                if not isinstance(reply, Step):
                    raise RuntimeError(f"rank {rank}: step {message.first_step} was lost and its run has ended")
                message = reply.message
        raise AssertionError("unreachable")

    def close(self) -> None:
        try:
            super().close()
        except RayActorError:  # the coordinator is gone: no run to leave
            self.members, self.ahead = set(), {}


_coordinators: dict[str, object] = {}  # loader name -> the coordinator this process attached to last


def _exists(options: dict) -> bool:
    """Whether the named coordinator of ``options`` runs already."""
    try:
        ray.get_actor(options["name"], namespace=options["namespace"])
    except ValueError:
        return False
    return True


def _get(ref, timeout: float):
    """A local future's result, or ``ray.get`` within ``timeout`` that raises the remote exception
    itself (a ValueError stays a ValueError)."""
    if isinstance(ref, concurrent.futures.Future):
        return ref.result()
    try:
        return ray.get(ref, timeout=timeout)
    except RayTaskError as exc:
        raise exc.cause from None

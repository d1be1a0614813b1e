"""``backend="ray"``: reader actors and a control plane, thin shells over the pure stages.

- :class:`loader.reader.Reader` actors (default one per available CPU, pinned round-robin to the
  nodes that have CPUs; restartable) decode, validate and truncate row groups into their node's
  object store and return only statuses, lengths and the object's ref; on request they pack the
  rows of their node that ranks on other nodes train on, one object per (node, rank).
- :class:`Control` wraps :class:`loader.service.Service`, the control plane: it reads each row
  group on a reader of its home node (the least busy; re-issuing a read whose reader died: reads
  are pure, so nothing is lost or repeated), plans each step from statuses and lengths, and
  queues every rank's messages: object refs plus row indices. It never maps a row group.

  - A loader with a ``name`` runs it as the :data:`Coordinator` actor, named after the loader in
    the ``freescale`` namespace, so trainer processes constructing the loader with the same
    arguments and ``name`` attach to it (telling it their node, for the locality-aware plan, and
    their process id, so a dead rank fails the run at once); the last to ``close()`` kills it
    and its readers.
  - An unnamed loader is private to this process, so its control plane runs here, on an event
    loop thread (:class:`LocalControl`): no coordinator process to start, no actor call per
    message. Its readers stay warm for this process's next loader (:func:`loader.reader.take_readers`).
- :class:`RayClient` is what a :class:`loader.SequenceLoader` holds in each trainer process: it
  maps a message's objects (zero-copy for row groups of its own node; a piece packed on another
  node crosses the network once) and gathers its rows into torch tensors. After decoding, an
  event is written once into the object store of the node that read it and once into the
  trainer's tensor; rows that cross nodes are packed once more on the way.

The control plane publishes the loader's stats as Ray metrics and readers count what they decode
(:mod:`loader.metrics`); a trainer process tells the control plane, with each request, how long
its rank waited for the previous message and how many bytes it mapped for it.

The coordinator and readers are owned by the process that created them: that process must outlive
the others' use of them (Ray kills a non-detached actor with its owner's job).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import threading
import time
import warnings

import ray
from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError

from loader.assemble import RankMessage
from loader.clean import UnitMeta
from loader.config import LoaderConfig
from loader.metrics import PUBLISH_S, Publisher, loader_tag
from loader.pipeline import Resume, warm_up
from loader.read import readahead_units
from loader.reader import Held, give_back, take_readers
from loader.service import RunKey, Service, SourcesLost, Where
from loader.sources import SourceIndex

NAMESPACE = "freescale"
READ_ATTEMPTS = 10  # per unit, over restarts and other readers
_POLL_S = 5.0  # a blocking call returns "wait" after this long, so the caller can warn
ASK_ATTEMPTS = 10  # per step: a call that failed in transit is asked again (the coordinator resends)
_WARN_AFTER_S = 30.0
_LOST = (RayActorError, ObjectLostError, WorkerCrashedError)


def coordinator_name(name: str) -> str:
    return f"freescale-loader:{name}"


class Control:
    """One loader's control plane: readers in, per-rank queues of messages out.

    ``watch``: check that the ranks' processes live (off when they all run in this process)."""

    def __init__(self, index: SourceIndex, config: LoaderConfig, fingerprint: tuple, watch: bool = True) -> None:
        self.index = index
        self.config = config
        self.fingerprint = fingerprint
        self.dtypes = index.roles[0]
        self.attached: list[Where] = []  # the process of each attached loader
        self.detaching = asyncio.Lock()
        self.readers: list = []
        self.nodes: list[str] = []
        self.ready = asyncio.Event()
        self.inflight: set[ray.ObjectRef] = set()  # reads sent and not answered yet
        self.tag = loader_tag(config.name)
        self.publisher = Publisher(self.tag)
        self.publishing: asyncio.Task | None = None
        self.service = Service(index, config, fetch=self._fetch, pack=self._pack, renew=self._renew,
                               alive=self._alive if watch else None, readahead=readahead_units(index, config.num_readers or 2))
        # compile or load the planner's kernels beside the first reads (the first plan waits on numba's lock)
        threading.Thread(target=warm_up, args=(config,), daemon=True).start()

    async def attach(self, fingerprint: tuple, name: str, where: Where) -> bool:
        """Count the loader of the process at ``where``; True for the first, which must start the readers."""
        if tuple(fingerprint) != tuple(self.fingerprint):
            raise ValueError(
                f"a loader named {name!r} already runs with other data or arguments; construct this "
                "loader with the same source and arguments, or give it another name"
            )
        self.attached.append(where)
        return len(self.attached) == 1

    async def set_readers(self, readers: list, nodes: list[str]) -> None:
        """The readers, and the node each is pinned to."""
        self.readers = readers
        self.busy = [0] * len(readers)  # calls in flight per reader
        self.nodes = list(nodes)
        self.ready.set()
        self.publishing = asyncio.ensure_future(self._publish())

    async def _publish(self) -> None:
        while True:
            self.publisher.publish(self.service.stats.as_dict())
            await asyncio.sleep(PUBLISH_S)

    async def release(self) -> None:
        """Kill the readers: the last loader closes."""
        for reader in self.readers:
            ray.kill(reader)

    async def detach(self, where: Where) -> int:
        """The loader of the process at ``where`` let go: the number of loaders still attached whose
        process lives (one that died without closing, such as a failed trainer worker, is not waited for)."""
        async with self.detaching:  # one at a time: exactly one caller sees none left, and releases
            self.attached.remove(where)
            if self.attached:
                alive = await self._alive(self.attached)
                self.attached = [w for w, ok in zip(self.attached, alive) if ok]
            return len(self.attached)

    async def close(self) -> None:
        """Stop serving: the run in progress ends, and reads still queued on the readers are
        cancelled (warm readers would otherwise make the next loader wait behind them)."""
        self.service.close()
        for call in list(self.inflight):
            ray.cancel(call)
        if self.publishing is not None:
            self.publishing.cancel()
            self.publisher.publish(self.service.stats.as_dict())

    async def open(self, ranks: list[int], key: RunKey, timeout: float, where: Where):
        return await self.service.open(ranks, key, timeout, where)

    async def next(self, rank: int, run_id: int, step: int, timeout: float, taken: tuple[float, int]):
        return await self.service.next(rank, run_id, step, timeout, taken)

    async def repair(self, rank: int, run_id: int, step: int):
        return await self.service.repair(rank, run_id, step)

    async def leave(self, ranks: list[int], run_id: int) -> None:
        await self.service.leave(ranks, run_id)

    async def stats(self) -> dict:
        return self.service.stats.as_dict()

    async def reader_handles(self) -> list:
        await self.ready.wait()
        return self.readers

    async def reader_nodes(self) -> list[str]:
        await self.ready.wait()
        return list(self.nodes)

    async def pid(self) -> int:
        return os.getpid()

    def _on(self, node) -> list[int]:
        """Readers on ``node`` (every reader when none is there, or ``node`` is None)."""
        here = [i for i, n in enumerate(self.nodes) if n == node]
        return here or list(range(len(self.readers)))

    async def _call(self, candidates: list[int], what: str, call):
        """``call(i)`` on the least busy candidate reader i; when that reader died, on the least busy
        of the others (the dead one restarts meanwhile), up to READ_ATTEMPTS times."""
        tried: set[int] = set()
        for attempt in range(READ_ATTEMPTS):
            untried = [i for i in candidates if i not in tried] or candidates
            owner = min(untried, key=lambda i: (self.busy[i], i))
            self.busy[owner] += 1
            try:
                return await call(owner)
            except RayTaskError as exc:  # the call itself failed: a real error, not a lost reader
                raise exc.cause from None
            except _LOST as exc:
                lost = exc
                tried.add(owner)
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
            finally:
                self.busy[owner] -= 1
        raise RuntimeError(
            f"{what}: {READ_ATTEMPTS} attempts failed because reader actors died ({lost}); check the "
            "readers' logs (memory, node failures)"
        )

    async def _fetch(self, unit: int, node) -> tuple[UnitMeta, Held, str]:
        """Read ``unit`` on a reader of ``node`` (its home); returns its meta, its rows' handle
        and the node that holds them."""
        await self.ready.wait()

        spec = self.index.only(unit)

        async def read(i: int):
            call = self.readers[i].read.remote(spec, self.config.max_seq_len, self.config.skip_corrupt, self.tag)
            self.inflight.add(call)
            try:
                meta, ref, pid = await call
            finally:
                self.inflight.discard(call)
            return meta, Held(ref, i, pid), self.nodes[i]

        return await self._call(self._on(node), self.index.describe(unit), read)

    async def _pack(self, node, pieces: dict, handles: dict[int, Held]) -> dict[int, Held]:
        """Pack ``pieces`` on a reader of ``node``, where ``handles``' rows are held."""

        async def pack_on(i: int):
            done, pid = await self.readers[i].pack.remote(pieces, {u: h.ref for u, h in handles.items()}, self.dtypes)
            if done == "lost":
                raise SourcesLost(pid)
            return {rank: Held(ref, i, pid) for rank, ref in done.items()}

        return await self._call(self._on(node), f"packing rows on node {node}", pack_on)

    async def _renew(self, handles: dict) -> dict:
        """Fresh reads of the units whose handle is missing or whose reader process is gone."""
        readers = sorted({h.reader for h, _ in handles.values() if h is not None})
        pids = dict(zip(readers, await asyncio.gather(*(self._pid(i) for i in readers))))
        lost = [u for u, (h, _) in handles.items() if h is None or pids[h.reader] != h.pid]
        reads = await asyncio.gather(*(self._fetch(u, handles[u][1]) for u in lost))
        return {u: (held, node) for u, (_, held, node) in zip(lost, reads)}

    async def _pid(self, i: int) -> int | None:
        try:
            return await self.readers[i].pid.remote()
        except _LOST:  # dead for good: whatever it held is lost
            return None

    async def _alive(self, wheres: list[Where]) -> list[bool]:
        """Ask a reader on each process's node; a node without readers is not watched."""
        out = [True] * len(wheres)
        for node in {w.node for w in wheres}:
            here = [i for i, n in enumerate(self.nodes) if n == node]
            if not here:
                continue
            mine = [i for i, w in enumerate(wheres) if w.node == node]
            try:
                found = await self.readers[here[0]].alive.remote([wheres[i].pid for i in mine])
            except _LOST:  # the reader restarts: look again next time
                continue
            for i, ok in zip(mine, found):
                out[i] = ok
        return out


Coordinator = ray.remote(num_cpus=0, max_restarts=0)(Control)  # a named loader's control plane


class ActorControl:
    """Calls into the :data:`Coordinator` actor: ``call`` returns an ObjectRef (see :func:`_get`)."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def call(self, method: str, *args):
        return getattr(self.handle, method).remote(*args)


class LocalControl:
    """A :class:`Control` on this process's control-plane event loop: ``call`` returns a future
    (see :func:`_get`). Messages are handed over as they are, nothing is serialised."""

    _loop: asyncio.AbstractEventLoop | None = None
    _lock = threading.Lock()

    def __init__(self, index: SourceIndex, config: LoaderConfig, fingerprint: tuple) -> None:
        self.loop = self._shared_loop()

        async def make() -> Control:
            return Control(index, config, fingerprint, watch=False)

        self.control = asyncio.run_coroutine_threadsafe(make(), self.loop).result()

    def call(self, method: str, *args) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(getattr(self.control, method)(*args), self.loop)

    @classmethod
    def _shared_loop(cls) -> asyncio.AbstractEventLoop:
        """One daemon thread per process runs every local control plane's event loop."""
        with cls._lock:
            if cls._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="freescale-control", daemon=True).start()
                cls._loop = loop
            return cls._loop


def connect(address: str | None, *, name: str | None = None) -> None:
    """Join the running Ray of this process, or ``ray.init`` (no address: start or join a local Ray).

    A named loader in one of several processes torchrun started (``WORLD_SIZE`` > 1) joins a running
    Ray only: a private local Ray per process would leave each rank alone with its own coordinator.
    """
    if ray.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", 1))
    if address is None and name is not None and world > 1:
        try:
            ray.init(address="auto")
        except ConnectionError:
            raise RuntimeError(
                f"the loader named {name!r} is shared by the {world} trainer processes torchrun started, "
                "through one Ray, and none runs: start it first (`ray start --head`, or set RAY_ADDRESS to "
                "a cluster), or pass backend='inline' (every process then reads the whole epoch itself)"
            ) from None
        return
    ray.init(address=address)


class RayClient:
    """A trainer process's handle on its loader's control plane: in this process for an unnamed
    loader, the named coordinator actor otherwise."""

    def __init__(self, index: SourceIndex, config: LoaderConfig, fingerprint: int) -> None:
        connect(config.ray_address, name=config.name)
        self.config = config
        shape = (fingerprint, config.locality, config.ranks_per_node)
        count = config.num_readers or max(1, int(ray.available_resources().get("CPU", 1)))
        self.where = Where(node=ray.get_runtime_context().get_node_id(), pid=os.getpid())
        self.closed = False
        self.readers: tuple[list, list[str]] | None = None  # readers this process gives back on close
        if config.name is None:
            self.control = LocalControl(index, config, shape)
            self.readers = take_readers(count)
            self.control.call("set_readers", *self.readers)
            return
        options = {"namespace": NAMESPACE, "name": coordinator_name(config.name), "get_if_exists": True}
        # Readers start beside the coordinator, not after it, when this process will likely create
        # it: both take a process start and their imports, and the first batch waits for both.
        readers = take_readers(count) if not _exists(options) else None
        self.control = ActorControl(Coordinator.options(**options).remote(index, config, shape))
        if _get(self.control.call("attach", shape, config.name, self.where)):
            self.control.call("set_readers", *(readers or take_readers(count)))
        elif readers is not None:  # another process created it first: its readers serve
            give_back(*readers)

    def open(self, ranks: tuple[int, ...], epoch: int, start: Resume) -> RayStream:
        return RayStream(self.control, ranks, RunKey(epoch, start.step, start.cursor), self.where)

    def stats(self) -> dict:
        return _get(self.control.call("stats"))

    def reader_handles(self) -> list:
        return _get(self.control.call("reader_handles"))

    def reader_nodes(self) -> list[str]:
        return _get(self.control.call("reader_nodes"))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if isinstance(self.control, LocalControl):
            _get(self.control.call("close"))
            give_back(*self.readers)  # warm for this process's next loader
            return
        try:
            remaining = _get(self.control.call("detach", self.where))
        except RayActorError:  # already gone (its owner exited, or it was killed)
            return
        if remaining <= 0:
            _get(self.control.call("release"))  # its readers (this process owns them)
            ray.kill(self.control.handle)
            _wait_name_released(coordinator_name(self.config.name))  # before a new loader may reuse it


class RayStream:
    """Messages of one run for ``ranks``, one request per rank kept in flight ahead of the consumer.

    Each request names the step it wants, so a call that failed in transit (Ray cannot tell
    whether it ran) is simply asked again. Ranks that did not reach the end leave the run on
    :meth:`close`, however the iteration stopped: a rank that failed must not hold the others.
    """

    def __init__(self, control, ranks: tuple[int, ...], key: RunKey, where: Where) -> None:
        self.control = control
        self.ranks = ranks
        self.want = dict.fromkeys(ranks, key.step)  # rank -> the step it asks for next
        # rank -> (seconds it waited for its last message, bytes it mapped for it), told with its next request
        self.taken = dict.fromkeys(ranks, (0.0, 0))
        since, warned = time.monotonic(), False
        while True:
            kind, value = _get(control.call("open", list(ranks), key, _POLL_S, where))
            if kind == "open":
                break
            warned = _warn_once(value, since, warned)
        self.run_id = value
        self.members = set(ranks)  # ranks still in the run: leave it on close
        self.ahead = {rank: self._request(rank) for rank in ranks}

    def next_message(self) -> dict[int, RankMessage] | None:
        """Every rank's next message, or None at the end of the run."""
        messages = {}
        since, warned = time.monotonic(), False
        for rank in self.ranks:
            if rank not in self.members:
                continue
            asked = time.monotonic()
            while (reply := self._take(rank))[0] == "wait":
                warned = _warn_once(reply[1], since, warned)
                self.ahead[rank] = self._request(rank)
            kind, value = reply
            if kind != "step":  # the coordinator has finished the rank
                self.members.discard(rank)
                if kind == "error":
                    raise value
                continue
            # Map the rows it reads (zero-copy on this node; pieces packed for it on other nodes cross
            # the network once) before asking for the next message: until then the coordinator holds
            # this one, so the owner of these objects keeps its own reference while this process
            # borrows them. Asked for first, a rank's fetch could wait forever on an object its owner
            # had already let go (a rank "stopped taking its queued steps").
            value = self._fetch_sources(rank, value)
            self.taken[rank] = (time.monotonic() - asked, sum(rows.nbytes for rows in value.sources))
            self.want[rank] = value.last_step + 1
            self.ahead[rank] = self._request(rank)
            messages[rank] = value
        return messages or None

    def _fetch_sources(self, rank: int, message: RankMessage) -> RankMessage:
        """Map the message's sources; rows lost with a dead reader are read again (``repair``)."""
        for attempt in range(READ_ATTEMPTS):
            try:
                # a copy: the control plane keeps the message it handed out, with its handles
                return dataclasses.replace(message, sources=ray.get([held.ref for held in message.sources]))
            except ObjectLostError:
                if attempt == READ_ATTEMPTS - 1:
                    raise
                kind, repaired = _get(self.control.call("repair", rank, self.run_id, message.first_step))
                if kind != "step":
                    raise RuntimeError(f"rank {rank}: step {message.first_step} was lost and its run has ended")
                message = repaired
        raise AssertionError("unreachable")

    def close(self) -> None:
        if self.members:  # ranks that did not reach the end leave the run
            try:
                self.control.call("leave", sorted(self.members), self.run_id)
            except RayActorError:
                pass
            self.members = set()
        self.ahead = {}

    def _request(self, rank: int):
        return self.control.call("next", rank, self.run_id, self.want[rank], _POLL_S, self.taken[rank])

    def _take(self, rank: int) -> tuple[str, object]:
        """The reply to the rank's request in flight; asked again while the call fails in transit."""
        attempt = 0
        while True:
            try:
                return _get(self.ahead.pop(rank))
            except ActorUnavailableError:
                attempt += 1
                if attempt == ASK_ATTEMPTS:
                    raise
                time.sleep(min(0.1 * 2**attempt, 2.0))
                self.ahead[rank] = self._request(rank)


def _exists(options: dict) -> bool:
    """Whether the named coordinator of ``options`` runs already."""
    try:
        ray.get_actor(options["name"], namespace=options["namespace"])
    except ValueError:
        return False
    return True


def _wait_name_released(name: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:  # no actor of that name any more
            return
        time.sleep(0.05)


def _warn_once(why: str, since: float, warned: bool) -> bool:
    """Warn (once per blocked call) when a call has waited long: usually a rank nobody iterates."""
    waited = time.monotonic() - since
    if waited >= _WARN_AFTER_S and not warned:
        warnings.warn(f"loader has waited {waited:.0f} s: {why}", RuntimeWarning, stacklevel=4)
        return True
    return warned


def _get(ref):
    """The reply of a control call: a local future's result, or ``ray.get`` that raises the remote
    exception itself (a ValueError stays a ValueError)."""
    if isinstance(ref, concurrent.futures.Future):
        return ref.result()
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        raise exc.cause from None

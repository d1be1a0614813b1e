"""The control plane's readers on Ray: :class:`RayReaders`, the :class:`loader.control.protocol.Readers` over the
reader actors (:class:`loader.backends.reader.Reader`), with every wait bounded and Ray's errors named."""

from __future__ import annotations

import asyncio

import ray
from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError

from loader.config import LoaderConfig
from loader.errors import NodeLost, ReadersLost
from loader.backends.reader import Held
from loader.backends.telemetry import loader_tag
from loader.control.protocol import Fetched, Health, Lost, Packed, Where
from loader.control.stream import POLL_S
from loader.contract.sources import SourceIndex

READ_ATTEMPTS = 10  # per unit, over restarts and other readers
_POLL_S = POLL_S  # a liveness check waits at most this long (or half the liveness timeout) for a node's readers
_LOST = (RayActorError, ObjectLostError, WorkerCrashedError)


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

"""``backend="ray"``: reader actors and a named coordinator actor, thin shells over the pure stages.

- :class:`Reader` actors (default one per available CPU, pinned round-robin to the nodes that have
  CPUs: Ray's SPREAD and soft affinity do not reliably spread zero-CPU actors; restartable; a
  reader whose node is lost stays dead and the others take its reads)
  decode, validate and truncate row groups, returning each as two objects in the object store:
  the row statuses and the valid rows (numpy buffers).
- :class:`Coordinator` wraps :class:`loader.service.Service`: it hands each row group to the reader
  with the fewest reads in flight (re-issuing a read whose reader died: reads are pure, so
  nothing is lost or repeated), cuts and plans each step from statuses and lengths (it maps each
  row group's objects: zero-copy on its node, a transfer from other nodes), and queues every
  rank's share: object refs plus row indices, never the events themselves. It is named after
  the loader's ``name`` in the ``freescale`` namespace, so trainer processes constructing the
  loader with the same arguments and ``name`` attach to the same one; the last to ``close()``
  kills it (and so its readers, and the objects it owns).
- :class:`RayClient` is what a :class:`loader.SequenceLoader` holds in each trainer process: it
  fetches a share's objects (zero-copy on the same node) and gathers its rows into torch tensors.
  After decoding, an event is copied twice: into the object store, and into the trainer's tensor.

The coordinator is owned by the process that created it: that process must outlive the others'
use of it (Ray kills a non-detached actor with its owner's job).
"""

from __future__ import annotations

import asyncio
import time
import warnings

import numpy as np
import ray
from ray.exceptions import ActorUnavailableError, ObjectLostError, RayActorError, RayTaskError, WorkerCrashedError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from loader.assemble import RankStep, warm_up
from loader.clean import Chunk
from loader.config import LoaderConfig
from loader.pipeline import Resume
from loader.read import read_unit
from loader.rows import Rows
from loader.service import RunKey, Service
from loader.sources import SourceIndex

NAMESPACE = "freescale"
READER_RESTARTS = 8  # per reader actor; a reader that keeps dying points at a real problem
READ_ATTEMPTS = 10  # per unit, over restarts and other readers
_POLL_S = 5.0  # a blocking call returns "wait" after this long, so the caller can warn
ASK_ATTEMPTS = 10  # per step: a call that failed in transit is asked again (the coordinator resends)
_WARN_AFTER_S = 30.0
_LOST = (RayActorError, ObjectLostError, WorkerCrashedError)


def reader_nodes() -> list[str]:
    """Ids of the alive nodes readers go to, round-robin: those with CPUs (a head node started with
    ``--num-cpus=0`` is kept free), or every alive node if none has any."""
    alive = [n for n in ray.nodes() if n.get("Alive")]
    with_cpus = [n for n in alive if n.get("Resources", {}).get("CPU", 0) > 0]
    return sorted(n["NodeID"] for n in (with_cpus or alive))


def coordinator_name(name: str) -> str:
    return f"freescale-loader:{name}"


@ray.remote(num_cpus=0)
class Reader:
    """Reads units of one source on request; holds nothing between calls."""

    def __init__(self, index: SourceIndex, max_seq_len: int | None, skip_corrupt: bool) -> None:
        self.index = index
        self.max_seq_len = max_seq_len
        self.skip_corrupt = skip_corrupt

    @ray.method(num_returns=2)
    def read(self, unit: int) -> tuple[np.ndarray, Rows]:
        chunk = read_unit(self.index, unit, max_seq_len=self.max_seq_len, skip_corrupt=self.skip_corrupt)
        return chunk.status, chunk.rows

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


@ray.remote(num_cpus=0, max_restarts=0)
class Coordinator:
    """One loader's pipeline: readers in, per-rank queues of published steps out."""

    def __init__(self, index: SourceIndex, config: LoaderConfig, fingerprint: int, num_readers: int) -> None:
        self.index = index
        self.fingerprint = fingerprint
        self.attached = 0
        nodes = reader_nodes()
        self.readers = [
            Reader.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False),
                max_restarts=READER_RESTARTS,
            ).remote(index, config.max_seq_len, config.skip_corrupt)
            for i in range(num_readers)
        ]
        self.busy = [0] * num_readers  # reads in flight per reader
        self.service = Service(index, config, fetch=self._fetch, store=ray.put, readahead=2 * num_readers)
        warm_up(config)

    async def attach(self, fingerprint: int, name: str) -> None:
        if fingerprint != self.fingerprint:
            raise ValueError(
                f"a loader named {name!r} already runs with other data or arguments; construct this "
                "loader with the same source and arguments, or give it another name"
            )
        self.attached += 1

    async def detach(self) -> int:
        """One loader let go; the number still attached."""
        self.attached -= 1
        return self.attached

    async def open(self, ranks: list[int], key: RunKey, timeout: float):
        return await self.service.open(ranks, key, timeout)

    async def next(self, rank: int, run_id: int, step: int, timeout: float):
        return await self.service.next(rank, run_id, step, timeout)

    async def leave(self, ranks: list[int], run_id: int) -> None:
        await self.service.leave(ranks, run_id)

    async def stats(self) -> dict:
        return self.service.stats.as_dict()

    async def reader_handles(self) -> list:
        return self.readers

    async def reader_nodes(self) -> list[str]:
        return await asyncio.gather(*(r.node_id.remote() for r in self.readers))

    async def _fetch(self, unit: int) -> tuple[Chunk, ray.ObjectRef]:
        """Read ``unit`` on the least busy reader; if that reader died, on the least busy of the
        others (the dead one restarts meanwhile). Returns the chunk and the ref of its rows."""
        tried: set[int] = set()
        for attempt in range(READ_ATTEMPTS):
            untried = [i for i in range(len(self.readers)) if i not in tried] or list(range(len(self.readers)))
            owner = min(untried, key=lambda i: (self.busy[i], i))
            self.busy[owner] += 1
            try:
                status_ref, rows_ref = self.readers[owner].read.remote(unit)
                status, rows = await asyncio.gather(status_ref, rows_ref)
                return Chunk(status=status, rows=rows), rows_ref
            except RayTaskError as exc:  # the read itself failed: a real error, not a lost reader
                raise exc.cause from None
            except _LOST as exc:
                lost = exc
                tried.add(owner)
                await asyncio.sleep(min(0.1 * 2**attempt, 2.0))
            finally:
                self.busy[owner] -= 1
        raise RuntimeError(
            f"{self.index.describe(unit)}: {READ_ATTEMPTS} reads failed because reader actors died "
            f"({lost}); check the readers' logs (memory, node failures)"
        )


def connect(address: str | None) -> None:
    """Join the running Ray of this process, or ``ray.init`` (no address: start or join a local Ray)."""
    if not ray.is_initialized():
        ray.init(address=address)


class RayClient:
    """A trainer process's handle on the named (or private) coordinator of one loader."""

    def __init__(self, index: SourceIndex, config: LoaderConfig, fingerprint: int) -> None:
        connect(config.ray_address)
        readers = config.num_readers or max(1, int(ray.available_resources().get("CPU", 1)))
        options = {"namespace": NAMESPACE}
        if config.name is not None:
            options.update(name=coordinator_name(config.name), get_if_exists=True)
        self.config = config
        self.coordinator = Coordinator.options(**options).remote(index, config, fingerprint, readers)
        _get(self.coordinator.attach.remote(fingerprint, config.name or "(unnamed)"))
        self.closed = False

    def open(self, ranks: tuple[int, ...], epoch: int, start: Resume) -> RayStream:
        return RayStream(self.coordinator, ranks, RunKey(epoch, start.step, start.cursor))

    def stats(self) -> dict:
        return _get(self.coordinator.stats.remote())

    def reader_handles(self) -> list:
        return _get(self.coordinator.reader_handles.remote())

    def reader_nodes(self) -> list[str]:
        return _get(self.coordinator.reader_nodes.remote())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            remaining = _get(self.coordinator.detach.remote())
        except RayActorError:  # already gone (its owner exited, or it was killed)
            return
        if remaining <= 0:
            ray.kill(self.coordinator)
            if self.config.name is not None:  # free the name before a new loader may reuse it
                _wait_name_released(coordinator_name(self.config.name))


class RayStream:
    """Steps of one run for ``ranks``, one request per rank kept in flight ahead of the consumer.

    Each request names the step it wants, so a call that failed in transit (Ray cannot tell
    whether it ran) is simply asked again. Ranks that did not reach the end leave the run on
    :meth:`close`, however the iteration stopped: a rank that failed must not hold the others.
    """

    def __init__(self, coordinator, ranks: tuple[int, ...], key: RunKey) -> None:
        self.coordinator = coordinator
        self.ranks = ranks
        self.want = dict.fromkeys(ranks, key.step)  # rank -> the step it asks for next
        since, warned = time.monotonic(), False
        while True:
            kind, value = _get(coordinator.open.remote(list(ranks), key, _POLL_S))
            if kind == "open":
                break
            warned = _warn_once(value, since, warned)
        self.run_id = value
        self.members = set(ranks)  # ranks still in the run: leave it on close
        self.ahead = {rank: self._request(rank) for rank in ranks}

    def next_step(self) -> dict[int, RankStep] | None:
        """Every rank's share of the next step, or None at the end of the run."""
        shares = {}
        since, warned = time.monotonic(), False
        for rank in self.ranks:
            if rank not in self.members:
                continue
            while (message := self._take(rank))[0] == "wait":
                warned = _warn_once(message[1], since, warned)
                self.ahead[rank] = self._request(rank)
            kind, value = message
            if kind != "step":  # the coordinator has finished the rank
                self.members.discard(rank)
                if kind == "error":
                    raise value
                continue
            # Map the rows it reads (zero-copy on this node) before asking for the next step: until then
            # the coordinator holds this share, so the owner of these objects keeps its own reference
            # while this process borrows them. Asked for first, a rank's fetch could wait forever on an
            # object its owner had already let go (a rank "stopped taking its queued steps").
            value.sources = ray.get(value.sources)
            self.want[rank] = value.step + 1
            self.ahead[rank] = self._request(rank)
            shares[rank] = value
        return shares or None

    def close(self) -> None:
        if self.members:  # ranks that did not reach the end leave the run
            try:
                self.coordinator.leave.remote(sorted(self.members), self.run_id)
            except RayActorError:
                pass
            self.members = set()
        self.ahead = {}

    def _request(self, rank: int):
        return self.coordinator.next.remote(rank, self.run_id, self.want[rank], _POLL_S)

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
    """``ray.get`` that raises the remote exception itself (a ValueError stays a ValueError)."""
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        raise exc.cause from None


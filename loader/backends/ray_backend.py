"""``backend="ray"``: what a trainer process holds, thin shells over the pure stages and the control plane.

- :class:`loader.backends.reader.Reader` actors (default one per available CPU, pinned round-robin to the
  nodes that have CPUs; restartable) decode, validate and truncate row groups into their node's
  object store and return only statuses, lengths and the object's ref; on request they pack the
  rows of their node that ranks on other nodes train on, one object per (node, rank).
  :class:`loader.backends.ray_readers.RayReaders` is the control plane's
  :class:`loader.control.protocol.Readers` over them.
- The control plane (:mod:`loader.backends.coordinator`) runs where the loader's ranks can reach it:

  - A loader with a ``name`` runs it as the coordinator actor, named after the loader in
    the ``freescale`` namespace and placed on the node of the process that creates it (which owns
    it), so trainer processes constructing the loader with the same arguments and ``name`` attach
    to it (telling it their node, for the locality-aware plan, and their process id, so a dead
    rank fails the run at once). The last to ``close()`` closes its control plane; the actor
    stays warm for the next loader of the name for ``COORDINATOR_IDLE_S`` seconds, with the readers it
    started and owns.
  - An unnamed loader is private to this process, so its control plane runs here, on the control
    loop thread: no coordinator process to start, no actor call per
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

An unnamed loader's readers are owned by its process (a named one's by its coordinator,
:mod:`loader.backends.coordinator`): an owner must outlive the others' use of what it owns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import os
import time

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, ObjectLostError, RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from loader.stages.assemble import RankMessage
from loader.config import LoaderConfig
from loader.errors import CoordinatorLost, NodeLost, ReadersLost
from loader.backends.coordinator import ActorControl, Coordinator, LocalControl
from loader.backends.inline import InlineClient
from loader.backends.ray_readers import READ_ATTEMPTS
from loader.backends.reader import give_back, take_readers
from loader.backends.telemetry import PUBLISH_S, Publisher, loader_tag
from loader.stages.rows import flatten
from loader.stages.pipeline import Resume
from loader.control.protocol import Reply, Step, Where
from loader.control.runs import RunKey
from loader.contract.sources import SourceIndex
from loader.control.stream import POLL_S, Stream, control_loop

NAMESPACE = "freescale"
_POLL_S = POLL_S  # a blocking call returns Wait after this long (at most), so the caller can warn
STARTUP_S = 120.0  # a coordinator that has not answered its first call this long (not placed, not started) is lost
COORDINATOR_IDLE_S = 60.0  # a named coordinator with no loader attached stays warm this long for the next one
ATTACH_ATTEMPTS = 5  # a named coordinator that died as this process attached to it is looked up (or started) again
ASK_ATTEMPTS = 10  # per step: a call that failed in transit is asked again (the coordinator resends)


def coordinator_name(name: str) -> str:
    return f"freescale-loader:{name}"


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

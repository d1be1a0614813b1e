"""Where a Ray loader's control plane runs: :class:`Control` (a :class:`loader.control.service.Service` over
:class:`loader.backends.ray_readers.RayReaders`, with its metrics), in a named loader's coordinator actor
(:data:`Coordinator`, a :class:`Host`) or on this process's control loop (an unnamed loader's :class:`LocalControl`),
and the calls a trainer process makes into either (:class:`ActorControl`, :class:`LocalControl`). Neither maps a
row group.

A named coordinator stays warm between loaders of its name (its process, imports, planner kernels and readers are
what a named loader's construction waits for), is owned by the process that created it, and owns its readers: an
owner must outlive the others' use of what it owns (Ray kills a non-detached actor with its owner).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading

import ray

from loader.config import LoaderConfig
from loader.backends.ray_readers import RayReaders
from loader.backends.reader import give_back, take_readers
from loader.backends.telemetry import PUBLISH_S, Publisher
from loader.control.production import MESSAGE_BYTES, REMOTE_MESSAGE_BYTES
from loader.control.protocol import End, Opened, Reply, Step, Wait, Where
from loader.control.runs import RunKey
from loader.control.service import Service
from loader.control.stream import ControlCalls, LoopCalls, control_loop
from loader.contract.sources import SourceIndex
from loader.stages.decode import readahead_units
from loader.stages.pipeline import warm_up


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

"""The control plane as plain asyncio, both backends': runs, messages, bounded per-rank queues.

No Ray here: the Ray coordinator actor (and the inline backend) is a thin shell that passes in its
:class:`loader.control.protocol.Readers` (read a unit, pack rows on a node, renew lost units, tell
whether the ranks' processes and nodes live), and tests drive this class directly. It is a control
plane: it receives each row group's statuses and lengths (:class:`loader.stages.clean.UnitMeta`) and a
*handle* to its decoded rows, which stay where they were read; it plans, and hands each rank a
:class:`loader.stages.assemble.RankMessage` of handles and indices. It never reads event data.

A *run* (:mod:`loader.control.runs`) is one pass over an epoch from a resume point, keyed by
:class:`RunKey`. Ranks join it with :meth:`Service.open`, telling where they run (a node key, and a
process id to watch); the plan's node layout is fixed once every rank has joined. Ranks take
messages with :meth:`Service.next` and finish by reaching the end or with :meth:`Service.leave`. A
request names the step it wants, so one repeated after its reply was lost (a call that failed in
transit may or may not have run) gets the same message again instead of the next one: no step is
lost or skipped. Apart:

- production (:mod:`loader.control.production`): the steps read, planned, grouped into messages and
  queued; a slow rank's full queue stops it, faster ranks keep taking what is queued;
- routing (:mod:`loader.control.routing`): which rows each rank reads in place and which come packed
  from other nodes; lost rows read again;
- liveness (:mod:`loader.control.liveness`): a rank whose process died, or whose node is lost, ends
  the run for every other rank with a named error (:mod:`loader.errors`).

A run retires once every rank has finished it; a run with another key waits until then, so all
ranks must iterate the same epochs in the same order (each rank in its own process or thread).
Every reply is a :data:`loader.control.protocol.Reply`.
"""

from __future__ import annotations

import asyncio
import itertools

import numpy as np

from loader.config import LoaderConfig
from loader.control.liveness import bury, watch
from loader.control.production import MESSAGE_BYTES, produce
from loader.control.protocol import End, Opened, Readers, Reply, Step, Wait, Where
from loader.control.runs import Run, RunKey, drop
from loader.contract.sources import SourceIndex
from loader.stages.stats import Stats

class Service:
    """Serves per-rank messages of one loader; see the module docstring.

    ``readers`` read, pack and renew units and say whether the ranks' processes and nodes live
    (:class:`loader.control.protocol.Readers`); ``watch``: check that they do (off when every rank runs
    in this process). At most ``readahead`` units beyond the current block are read ahead.

    ``here``: every rank runs in this process, at ``here`` (the inline backend). A run then plans as
    soon as a rank opens it (the layout is known), and a rank that has not opened it is left out of
    it (its queue dropped) once it holds the others back: when a rank that iterates finds its queue
    empty while the producer waits on the absent rank's full queue, or the producer finds that queue
    full while a rank that iterates has nothing queued (:meth:`loader.control.runs.Run.holds_back`),
    or when every rank that iterates has finished. Ranks iterated at the same time share one pass over the epoch; a rank iterated
    later (or never, as in one process per rank) gets a pass of its own.
    """

    def __init__(
        self,
        index: SourceIndex,
        config: LoaderConfig,
        readers: Readers,
        *,
        readahead: int,
        watch: bool = True,
        here: Where | None = None,
        message_bytes: int = MESSAGE_BYTES,
    ) -> None:
        self.index = index
        self.config = config
        self.readers = readers
        self.watch = watch
        self.here = here
        self.readahead = readahead
        self.message_bytes = message_bytes
        self.stats = Stats(config.ranks, index.skipped_files, storage_retries=index.storage_retries)
        self.run: Run | None = None
        self._told: dict[int, tuple[int, int]] = {}  # rank -> (run, step) of the request whose ``taken`` was counted
        self._ids = itertools.count()
        dtypes = index.roles[0]
        self.event_bytes = sum(np.dtype(t).itemsize for t in dtypes.values())  # per event, every column

    async def open(self, ranks: list[int], key: RunKey, timeout: float, where: Where = Where()) -> Opened | Wait:
        """Join ``ranks`` (running at ``where``) to the run ``key``: :class:`Opened`, or :class:`Wait`
        after ``timeout`` seconds while another run is still being iterated."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            run = self.run
            if run is None:
                run = self.run = self._start(key)
            busy = set(ranks) & (run.joined - run.finished)
            if busy and self.watch:  # a restarted rank: its old process may be gone, unnoticed yet
                await bury(self.readers, run, sorted(busy))
                busy -= run.finished
                if self.run is not run:  # burying retired it
                    continue
            if busy:
                raise ValueError(
                    f"rank(s) {sorted(busy)} already iterate {run.key} on this loader; finish or close "
                    "that iterator before starting another for the same rank"
                )
            if run.key == key and not set(ranks) & run.finished:
                run.joined.update(ranks)
                run.where.update(dict.fromkeys(ranks, where))
                if len(run.joined) == self.config.ranks:
                    run.all_joined.set()
                return Opened(run.id)
            try:
                await asyncio.wait_for(run.retired.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return Wait(f"{key} waits until every rank has finished {run.key}: {run.describe()}")

    async def next(self, rank: int, run_id: int, step: int, timeout: float,
                   taken: tuple[float, int] | None = None) -> Reply:
        """The rank's message starting at step ``step`` (the step after the last one it received):
        :class:`Step`, :class:`End`, :class:`Failed`, or :class:`Wait` after ``timeout`` seconds
        without one. Asking again for the message handed out last
        returns it again (its reply was lost); asking for a later step lets it go. ``taken``: the
        seconds the rank waited for its previous message and the bytes it mapped for it, counted
        in :attr:`stats` once however often the request is repeated."""
        if taken is not None and self._told.get(rank) != (run_id, step):
            self._told[rank] = (run_id, step)
            self.stats.taken(rank, *taken)
        run = self.run
        if run is None or run.id != run_id or rank in run.finished:
            return End()
        run.asked[rank] = step
        held = run.held.pop(rank, None)
        if held is not None and held.first_step == step:
            run.held[rank] = held
            return Step(held)
        del held  # let go now: kept while this waits for the next message, its rows would outlive their steps
        blocked = run.blocked_on
        if blocked is not None and run.holds_back(blocked):
            run.leave_out_absent()  # the producer waits on a rank nobody iterates
        try:
            reply = await asyncio.wait_for(run.queues[rank].get(), timeout)
        except asyncio.TimeoutError:
            return Wait(f"rank {rank} waits for step {step} of {run.key}: {run.describe()}")
        if not isinstance(reply, Step):
            run.finish(rank)
            return reply
        self.stats.queue_depth[rank] -= 1
        if reply.message.first_step != step:
            raise RuntimeError(
                f"rank {rank} asked for step {step} of {run.key} but step {reply.message.first_step} is next"
            )
        run.held[rank] = reply.message
        return reply

    async def repair(self, rank: int, run_id: int, step: int) -> Step | End:
        """The message the rank was handed last (starting at ``step``), with its sources renewed:
        a rank whose fetch found rows gone (their reader died) asks for this, and gets the same
        rows from fresh reads; :class:`End` if the run is gone."""
        run = self.run
        if run is None or run.id != run_id or rank in run.finished or run.sources is None:
            return End()
        message = run.held.get(rank)
        if message is None or message.first_step != step:
            raise RuntimeError(f"rank {rank} asked to repair step {step}, but it holds no message starting there")
        units = np.unique(message.unit).tolist()
        held = {u: run.sources.handles.get(u) for u in units}
        (repaired,) = await run.sources.complete([message], await run.sources.renew(held))
        return Step(repaired)

    async def leave(self, ranks: list[int], run_id: int) -> None:
        """``ranks`` stop iterating run ``run_id`` early; their queued messages are dropped."""
        run = self.run
        if run is not None and run.id == run_id:
            for rank in ranks:
                if rank in run.joined:
                    run.finish(rank)

    def close(self) -> None:
        """Stop: the run in progress ends where it is (its reads and packs are dropped)."""
        run, self.run = self.run, None
        if run is not None:
            drop(run.tasks)
            run.retired.set()
        self.stats.queue_depth = [0] * self.config.ranks

    def _start(self, key: RunKey) -> Run:
        run = Run(next(self._ids), key, self.config.ranks, self.config.prefetch_steps, self.stats,
                  here=self.here is not None, retire=self._retired)
        if self.here is not None:
            run.where = dict.fromkeys(range(self.config.ranks), self.here)
            run.all_joined.set()
        run.tasks.append(asyncio.ensure_future(produce(self, run)))
        if self.watch:
            run.tasks.append(asyncio.ensure_future(watch(self.readers, run, self.config.liveness_timeout)))
        return run

    def _retired(self, run: Run) -> None:
        if self.run is run:
            self.run = None

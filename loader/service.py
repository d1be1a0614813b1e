"""The coordinator's logic as plain asyncio: runs, per-rank bounded queues, backpressure, stats.

No Ray here: the Ray coordinator actor is a thin shell that passes in how to read a unit (reader
actors; a chunk and the object ref shares name it by) and how to store carried-over rows
(``ray.put``), and tests drive this class directly. Shares hold handles, not event data: queues
stay small, and trainers gather their rows from the readers' objects themselves.

A *run* is one pass over an epoch from a resume point, keyed by :class:`RunKey`. Ranks join it
with :meth:`Service.open` (trainer processes that loaded the same state pass the same key and
share one run), take steps with :meth:`Service.next` and finish by reaching the end or with
:meth:`Service.leave`. A request names the step it wants, so one repeated after its reply was lost
(a call that failed in transit may or may not have run) gets the same share again instead of
the next one: no step is lost or skipped. The producer plans each step once and puts every rank's
share into that rank's queue of ``prefetch_steps`` places:

- a slow rank's full queue stops the producer (nothing is buffered beyond ``prefetch_steps`` steps
  per rank), while faster ranks keep taking the steps already in their queues;
- a run retires once every rank has finished it; a run with another key waits until then, so all
  ranks must iterate the same epochs in the same order (each rank in its own process or thread).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from loader.clean import Chunk
from loader.config import LoaderConfig
from loader.pipeline import EpochRun, PlannedStep, Resume
from loader.rows import Rows
from loader.sources import SourceIndex
from loader.stats import Stats


@dataclass(frozen=True)
class RunKey:
    """One pass over ``epoch`` starting after ``step`` steps at epoch position ``cursor``."""

    epoch: int
    step: int = 0
    cursor: int = 0

    def __str__(self) -> str:
        return f"epoch {self.epoch} from step {self.step}"


class _Run:
    def __init__(self, run_id: int, key: RunKey, ranks: int, prefetch: int) -> None:
        self.id = run_id
        self.key = key
        self.queues = {rank: asyncio.Queue(prefetch) for rank in range(ranks)}
        self.joined: set[int] = set()
        self.held: dict[int, object] = {}  # rank -> the share it was handed last, until it asks for a later step
        self.finished: set[int] = set()  # reached the end, saw an error, or left
        self.retired = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.produced = 0  # steps planned so far
        self.blocked_on: int | None = None  # rank whose full queue holds the producer back


class Service:
    """Serves per-rank steps of one loader; see the module docstring.

    ``fetch(unit)`` reads one unit: awaitable (chunk, handle shares name its rows by), any reader,
    any order; ``store(rows)`` gives the handle of rows carried over to the next block (called in a
    worker thread); at most ``readahead`` units beyond the current block are read ahead.
    """

    def __init__(
        self,
        index: SourceIndex,
        config: LoaderConfig,
        *,
        fetch: Callable[[int], Awaitable[tuple[Chunk, object]]],
        store: Callable[[Rows], object],
        readahead: int,
    ) -> None:
        self.index = index
        self.config = config
        self.fetch = fetch
        self.store = store
        self.readahead = readahead
        self.stats = Stats(index.skipped_files)
        self.run: _Run | None = None
        self._ids = itertools.count()

    async def open(self, ranks: list[int], key: RunKey, timeout: float) -> tuple[str, object]:
        """Join ``ranks`` to the run ``key``: ``("open", run_id)``, or ``("wait", why)`` after
        ``timeout`` seconds while another run is still being iterated."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            run = self.run
            if run is None:
                run = self.run = self._start(key)
            busy = set(ranks) & (run.joined - run.finished)
            if busy:
                raise ValueError(
                    f"rank(s) {sorted(busy)} already iterate {run.key} on this loader; finish or close "
                    "that iterator before starting another for the same rank"
                )
            if run.key == key and not set(ranks) & run.finished:
                run.joined.update(ranks)
                return "open", run.id
            try:
                await asyncio.wait_for(run.retired.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                return "wait", f"{key} waits until every rank has finished {run.key}: {self._describe(run)}"

    async def next(self, rank: int, run_id: int, step: int, timeout: float) -> tuple[str, object]:
        """The rank's message for step ``step`` (the step after the last one it received):
        ``("step", RankStep)``, ``("end", None)``, ``("error", exception)``, or ``("wait", why)``
        after ``timeout`` seconds without a step. Asking again for the step handed out last
        returns that share again (its reply was lost); asking for a later one lets it go."""
        run = self.run
        if run is None or run.id != run_id or rank in run.finished:
            return "end", None
        held = run.held.pop(rank, None)
        if held is not None and held.step == step:
            run.held[rank] = held
            return "step", held
        try:
            kind, value = await asyncio.wait_for(run.queues[rank].get(), timeout)
        except asyncio.TimeoutError:
            return "wait", f"rank {rank} waits for step {run.produced} of {run.key}: {self._describe(run)}"
        if kind != "step":
            self._finish(run, rank)
        elif value.step != step:
            raise RuntimeError(f"rank {rank} asked for step {step} of {run.key} but step {value.step} is next")
        else:
            run.held[rank] = value
        return kind, value

    async def leave(self, ranks: list[int], run_id: int) -> None:
        """``ranks`` stop iterating run ``run_id`` early; their queued steps are dropped."""
        run = self.run
        if run is not None and run.id == run_id:
            for rank in ranks:
                if rank in run.joined:
                    self._finish(run, rank)

    def _start(self, key: RunKey) -> _Run:
        run = _Run(next(self._ids), key, self.config.ranks, self.config.prefetch_steps)
        run.task = asyncio.ensure_future(self._produce(run))
        return run

    def _finish(self, run: _Run, rank: int) -> None:
        run.finished.add(rank)
        run.held.pop(rank, None)
        queue = run.queues[rank]
        if queue.empty():  # a next() may wait on it: wake it
            queue.put_nowait(("end", None))
        else:  # no next() waits on a non-empty queue, but the producer may: free it (an "end"
            while not queue.empty():  # put here would block it again at prefetch_steps=1)
                queue.get_nowait()
        if len(run.finished) == self.config.ranks:
            run.task.cancel()
            self.run = None
            run.retired.set()

    async def _produce(self, run: _Run) -> None:
        inflight: deque[asyncio.Future] = deque()
        try:
            epoch_run = EpochRun(self.index, self.config, epoch=run.key.epoch,
                                 start=Resume(run.key.step, run.key.cursor), store=self.store)
            blocks = epoch_run.blocks()
            sequence = (unit for block in blocks for unit in epoch_run.units(block))
            for block in blocks:
                need = len(epoch_run.units(block))
                for unit in itertools.islice(sequence, max(0, need + self.readahead - len(inflight))):
                    inflight.append(asyncio.ensure_future(self.fetch(unit)))
                chunks, handles = zip(*[await inflight.popleft() for _ in range(need)])
                await self._deliver(run, epoch_run.feed(block, list(chunks), list(handles)))
            await self._deliver(run, epoch_run.finish())
            self.stats.record(run.key.epoch, "end", epoch_run.tail)
            for rank in range(self.config.ranks):
                if rank not in run.finished:
                    await run.queues[rank].put(("end", None))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every rank gets the error instead of its remaining steps
            for rank in range(self.config.ranks):
                if rank not in run.finished:
                    queue = run.queues[rank]
                    while not queue.empty():
                        queue.get_nowait()
                    queue.put_nowait(("error", exc))
        finally:
            for future in inflight:
                future.cancel()

    async def _deliver(self, run: _Run, steps: Iterator[PlannedStep]) -> None:
        """Plan each step in a worker thread, then queue every rank's share."""
        while (planned := await asyncio.to_thread(next, steps, None)) is not None:
            self.stats.record(planned.epoch, planned.step, planned.counts, planned.planner_seconds)
            run.produced = planned.step + 1
            for rank, share in enumerate(planned.shares):
                if rank not in run.finished:
                    run.blocked_on = rank
                    await run.queues[rank].put(("step", share))
            run.blocked_on = None

    def _describe(self, run: _Run) -> str:
        never = sorted(set(range(self.config.ranks)) - run.joined)
        parts = [f"{run.produced} step(s) planned"]
        if run.blocked_on is not None:
            parts.append(
                f"the next waits for rank {run.blocked_on} to take one of its "
                f"{self.config.prefetch_steps} queued steps"
            )
        if never:
            parts.append(f"rank(s) {never} have not started iterating")
        parts.append(
            "every rank must be iterated at the same time (a process or thread per rank), "
            "or use iter_steps() to take all ranks in one loop"
        )
        return "; ".join(parts)

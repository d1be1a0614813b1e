"""Runs: one pass over an epoch from a resume point, and who takes part in it.

A :class:`Run` holds each rank's bounded queue of replies, who joined it and where they run, who
finished it, and the message each rank was handed last (kept until it asks for a later step, so a
request repeated after its reply was lost gets the same message). It retires once every rank has
finished it. No Ray, no planning here: :mod:`loader.control.production` fills the queues,
:mod:`loader.control.liveness` finishes ranks that are gone, :class:`loader.control.service.Service`
answers the ranks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from loader.stages.assemble import RankMessage
from loader.stages.pipeline import Resume, kernels_warm
from loader.control.protocol import End, Failed, Where
from loader.stages.stats import Stats


def drop(futures: Iterable[asyncio.Future]) -> None:
    """Cancel ``futures`` (tasks and futures of the control loop), and retrieve the exception of any that ends with
    one all the same: a read whose reader call the readers' cancellation ended as it was cancelled raises that
    error (Python 3.11's ``asyncio.wait_for``), which would be logged as "Task exception was never retrieved"
    whenever the task is garbage-collected, long after its loader closed."""
    for future in futures:
        future.cancel()
        future.add_done_callback(_retrieve)


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()


@dataclass(frozen=True)
class RunKey:
    """One pass over ``epoch`` from ``start``."""

    epoch: int
    start: Resume = Resume()

    def __str__(self) -> str:
        return f"epoch {self.epoch} from step {self.start.step}"


class Run:
    """The state of run ``key`` over ``ranks`` ranks, each with a queue of ``prefetch`` places.

    ``here``: every rank runs in this process (the inline backend): ranks that never opened the run
    are finished with the last one that did (see :class:`loader.control.service.Service`).
    ``retire(run)`` is called once every rank has finished. ``stats`` keeps the queue depths.
    """

    def __init__(self, run_id: int, key: RunKey, ranks: int, prefetch: int, stats: Stats, *,
                 here: bool, retire: Callable[[Run], None]) -> None:
        self.id, self.key, self.ranks, self.prefetch = run_id, key, ranks, prefetch
        self.stats, self.here, self.retire = stats, here, retire
        self.queues = {rank: asyncio.Queue(prefetch) for rank in range(ranks)}
        self.joined: set[int] = set()
        self.where: dict[int, Where] = {}
        self.all_joined = asyncio.Event()
        self.asked: dict[int, int] = {}  # rank -> the step it asked for last
        self.held: dict[int, RankMessage] = {}  # rank -> the message it was handed last, until it asks for a later step
        self.finished: set[int] = set()  # reached the end, saw an error, or left
        self.retired = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        self.produced = 0  # steps planned so far
        self.blocked_on: int | None = None  # rank whose full queue holds the producer back
        self.failed = False  # every rank still in it was handed an error
        self.sources = None  # the run's loader.control.routing.Sources, once production starts

    def finish(self, rank: int) -> None:
        """``rank`` is done with the run (and, with every rank here, so are those that never opened it
        once every rank that did is done); the run retires when every rank is."""
        done = [rank]
        if self.here and self.joined <= self.finished | {rank}:
            done += [r for r in range(self.ranks) if r not in self.finished | {rank}]
        for r in done:
            self.finished.add(r)
            self.held.pop(r, None)
            if self.queues[r].empty():  # a next() may wait on it: wake it
                self.queues[r].put_nowait(End())
            else:  # no next() waits on a non-empty queue, but the producer may: free it (an End put
                self.drop_queued(r)  # here would block it again at prefetch_steps=1)
        if len(self.finished) == self.ranks:
            drop(self.tasks)
            self.retire(self)
            self.retired.set()

    def holds_back(self, rank: int) -> bool:
        """With every rank here: whether ``rank``, which has not opened the run, holds the producer back (its queue
        is full) while a rank that iterates has nothing queued. The Service then leaves it out
        (:meth:`leave_out_absent`), whichever side sees it first: a rank's request, or the producer about to wait."""
        return (self.here and rank not in self.joined and self.queues[rank].full()
                and any(self.queues[r].empty() for r in self.joined - self.finished))

    def leave_out_absent(self) -> None:
        """Finish the ranks that have not opened the run (every rank here: see the Service)."""
        for rank in range(self.ranks):
            if rank not in self.joined and rank not in self.finished:
                self.finish(rank)

    def fail(self, error: Exception) -> None:
        """Every rank still in the run gets ``error`` instead of its remaining messages."""
        self.failed = True
        for rank in range(self.ranks):
            if rank not in self.finished:
                self.drop_queued(rank)
                self.queues[rank].put_nowait(Failed(error))

    def drop_queued(self, rank: int) -> None:
        queue = self.queues[rank]
        while not queue.empty():
            queue.get_nowait()
        self.stats.queue_depth[rank] = 0

    def describe(self) -> str:
        """Where the run stands, for a rank told to wait."""
        never = sorted(set(range(self.ranks)) - self.joined)
        parts = [f"{self.produced} step(s) planned"]
        if self.blocked_on is not None:
            parts.append(f"the next waits for rank {self.blocked_on} to take one of its {self.prefetch} queued messages")
        if never:
            parts.append(f"rank(s) {never} have not started iterating")
        warm = kernels_warm()  # read once: it may turn while this runs
        if not warm:
            parts.append(
                "the planner's kernels are still being compiled: numba compiles them once per machine and "
                "version (one to three minutes; NUMBA_CACHE_DIR keeps them for later runs)"
            )
        if never or warm:
            parts.append(
                "every rank must be iterated at the same time (a process or thread per rank), "
                "or use iter_steps() to take all ranks in one loop"
            )
        return "; ".join(parts)

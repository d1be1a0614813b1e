"""Prioritized prefetch: the next microbatch's embedding exchange runs while the current one computes.

A step is M microbatches (forward + backward each) and one update (`ShardedEmbedding.step`). Before microbatch
k computes, microbatch k+1's fetch is started (`ShardedEmbedding.start_fetch`: counts and ids are exchanged,
the row all-to-all is left under way) over the prefetch's own process group, and waited for after k's
backward: no thread, one order of collectives per group on every rank. The rows travel beside compute on the
transport's own engine: gloo's worker threads, NCCL's stream of the prefetch group (a high-priority one), the
copy engines' stream; `wait()` orders the caller's stream after them.

Only the prefetch of the next step's first microbatch crosses an update. Its rows are split by their OWNER,
the only rank that knows every requester: a row served to any rank since the owner's last update may get a
gradient and change ("collision"), so the owner holds it back; the rest ("exclusive") it sends at once. The
main thread waits for the early part before the update, runs the update, then receives the collided rows.
Every row is therefore read exactly as the non-overlapped schedule reads it: same losses, same parameters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

from torch import Tensor
from torch.profiler import record_function

from trainer.embedding import Fetch, PendingFetch, ShardedEmbedding
from trainer.transport.base import Exchange

MB = TypeVar("MB")


@dataclass
class StepStats:
    """One step of one rank.

    exclusive, collisions: unique rows of the next step's first microbatch fetched before this step's update
    and after it (0 and 0 without overlap or on the last step). The scheduler keeps no clock: the exchanges it
    is given time themselves (`trainer.instrument.TimedExchange`), hidden and exposed communication included.
    """

    step: int
    exclusive: int = 0
    collisions: int = 0


class OverlapScheduler:
    """Runs steps of microbatches through `embedding`, prefetching when `overlap` is on.

    prefetch_exchange: the prefetch's exchange over its own process group (`trainer.place.Placement.exchange(
    transport, own_group="prefetch", urgent=True)`), required when overlapping.
    """

    def __init__(self, embedding: ShardedEmbedding, *, overlap: bool, prefetch_exchange: Exchange | None = None):
        if overlap and prefetch_exchange is None:
            raise ValueError("overlap=True needs prefetch_exchange: create it on every rank with "
                             "Placement.exchange(transport, own_group=\"prefetch\", urgent=True) so the prefetch "
                             "has its own process group")
        self.embedding, self.overlap, self.prefetch_exchange = embedding, overlap, prefetch_exchange

    def run(self, steps: Iterable[Sequence[MB]], *, ids: Callable[[MB], Tensor],
            compute: Callable[[MB, Tensor], None], step_end: Callable[[], None] | None = None
            ) -> Iterator[StepStats]:
        """For each step (a sequence of M microbatches, the same M on every rank): compute(mb, rows) for
        each microbatch, rows = embeddings (T, dim) of ids(mb), compute runs forward and backward; then
        step_end() (e.g. the dense optimizer) and the embedding update. Yields each step's StepStats."""
        if self.overlap:
            yield from self._run_overlapped(steps, ids, compute, step_end)
        else:
            yield from self._run_plain(steps, ids, compute, step_end)

    def _run_plain(self, steps, ids, compute, step_end) -> Iterator[StepStats]:
        for number, microbatches in enumerate(steps):
            for mb in microbatches:
                fetch = self.embedding.fetch(ids(mb))
                compute(mb, self.embedding.gather(fetch))
            self._update(step_end)
            yield StepStats(number)

    def _run_overlapped(self, steps, ids, compute, step_end) -> Iterator[StepStats]:
        it = iter(steps)
        current = next(it, None)
        ready: Fetch | None = None  # the current step's first fetch, when prefetched
        number = 0
        while current is not None:
            following = next(it, None)
            if not len(current):
                raise ValueError(f"step {number} has no microbatches; every step needs M >= 1 on every rank")
            stats = StepStats(number)
            if ready is None:
                ready = self._start(ids(current[0]), False).wait()
            for k, mb in enumerate(current):
                if k + 1 < len(current):
                    pending = self._start(ids(current[k + 1]), False)
                elif following is not None and len(following):
                    pending = self._start(ids(following[0]), True)
                else:
                    pending = None
                compute(mb, self.embedding.gather(ready))
                ready = None if pending is None else pending.wait()  # before the update: nothing under way crosses it
            self._update(step_end)
            if ready is not None and ready.pending:
                stats.exclusive, stats.collisions = ready.exclusive, ready.collisions
                self.embedding.fetch_deferred(ready, exchange=self.prefetch_exchange)
            yield stats
            current, number = following, number + 1

    def _start(self, ids: Tensor, after_update: bool) -> PendingFetch:
        """Start the fetch of ids over the prefetch group."""
        return self.embedding.start_fetch(ids, exchange=self.prefetch_exchange, after_update=after_update)

    def _update(self, step_end: Callable[[], None] | None) -> None:
        if step_end is not None:
            step_end()
        with record_function("## optimizer: embedding rows ##"):
            self.embedding.step()

"""Prioritized prefetch: the next microbatch's embedding exchange runs while the current one computes.

A step is M microbatches (forward + backward each) and one update (`ShardedEmbedding.step`). While
microbatch k computes, microbatch k+1's fetch runs on a prefetch thread with its own process group (so its
collectives never interleave with the gradient all-to-alls of the main thread); on CUDA that thread works on
a high-priority stream of the table's device (named, never torch's current device: a new thread's current
device is cuda:0) and its group asks NCCL for a high-priority stream too.

Only the prefetch of the next step's first microbatch crosses an update. Its rows are split by their OWNER,
the only rank that knows every requester: a row served to any rank since the owner's last update may get a
gradient and change ("collision"), so the owner holds it back; the rest ("exclusive") it sends at once. The
main thread joins the early part before the update, runs the update, then receives the collided rows. Every
row is therefore read exactly as the non-overlapped schedule reads it: same losses, same parameters.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import torch
from torch import Tensor

from trainer.embedding import Fetch, ShardedEmbedding
from trainer.transport.base import Exchange

MB = TypeVar("MB")


@dataclass
class StepStats:
    """One step of one rank.

    exclusive, collisions: unique rows of the next step's first microbatch fetched before this step's update
    and after it (0 and 0 without overlap or on the last step). exposed_s: seconds the main thread spent in
    or waiting for embedding fetches; hidden_s: fetch seconds that ran behind compute.
    """

    step: int
    exclusive: int = 0
    collisions: int = 0
    exposed_s: float = 0.0
    hidden_s: float = 0.0


class OverlapScheduler:
    """Runs steps of microbatches through `embedding`, prefetching when `overlap` is on.

    prefetch_exchange: the prefetch thread's exchange over its own process group (`trainer.place.Placement.exchange(
    transport, own_group="prefetch", urgent=True)`), required when overlapping. Streams and events are made on
    the table's device (`embedding.device`).
    """

    def __init__(self, embedding: ShardedEmbedding, *, overlap: bool, prefetch_exchange: Exchange | None = None):
        if overlap and prefetch_exchange is None:
            raise ValueError("overlap=True needs prefetch_exchange: create it on every rank with "
                             "Placement.exchange(transport, own_group=\"prefetch\", urgent=True) so the prefetch "
                             "has its own process group")
        self.embedding, self.overlap, self.prefetch_exchange = embedding, overlap, prefetch_exchange
        self.device = embedding.device
        on_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device, priority=-1) if overlap and on_cuda else None

    def run(self, steps: Iterable[Sequence[MB]], *, ids: Callable[[MB], Tensor],
            compute: Callable[[MB, Tensor], None], step_end: Callable[[], None] | None = None
            ) -> Iterator[StepStats]:
        """For each step (a sequence of M microbatches, the same M on every rank): compute(mb, rows) for
        each microbatch, rows = embeddings (T, dim) of ids(mb), compute runs forward and backward; then
        step_end() (e.g. the dense optimizer) and the embedding update. Yields each step's StepStats."""
        if not self.overlap:
            yield from self._run_plain(steps, ids, compute, step_end)
            return
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="emb-prefetch") as pool:
            yield from self._run_overlapped(pool, steps, ids, compute, step_end)

    def _run_plain(self, steps, ids, compute, step_end) -> Iterator[StepStats]:
        for number, microbatches in enumerate(steps):
            stats = StepStats(number)
            for mb in microbatches:
                start = time.perf_counter()
                fetch = self.embedding.fetch(ids(mb))
                stats.exposed_s += time.perf_counter() - start
                compute(mb, self.embedding.gather(fetch))
            self._update(step_end)
            yield stats

    def _run_overlapped(self, pool, steps, ids, compute, step_end) -> Iterator[StepStats]:
        it = iter(steps)
        current = next(it, None)
        ready: Fetch | None = None  # the current step's first fetch, when prefetched
        fetch_s = [0.0]  # seconds spent inside prefetch tasks (on the thread)
        number = 0
        while current is not None:
            following = next(it, None)
            if not len(current):
                raise ValueError(f"step {number} has no microbatches; every step needs M >= 1 on every rank")
            stats = StepStats(number)
            exposed, fetch_s[0] = 0.0, 0.0
            if ready is None:
                start = time.perf_counter()
                ready = self._wait(self._prefetch(pool, ids(current[0]), False, fetch_s))
                exposed += time.perf_counter() - start
            for k, mb in enumerate(current):
                if k + 1 < len(current):
                    future = self._prefetch(pool, ids(current[k + 1]), False, fetch_s)
                elif following is not None and len(following):
                    future = self._prefetch(pool, ids(following[0]), True, fetch_s)
                else:
                    future = None
                compute(mb, self.embedding.gather(ready))
                start = time.perf_counter()
                ready = self._wait(future)  # joined before the update below: the thread is idle across it
                exposed += time.perf_counter() - start
            self._update(step_end)
            if ready is not None and ready.pending:
                stats.exclusive, stats.collisions = ready.exclusive, ready.collisions
                start = time.perf_counter()
                self.embedding.fetch_deferred(ready, exchange=self.prefetch_exchange)
                exposed += time.perf_counter() - start
                fetch_s[0] += time.perf_counter() - start
            stats.exposed_s, stats.hidden_s = exposed, max(0.0, fetch_s[0] - exposed)
            yield stats
            current, number = following, number + 1

    def _prefetch(self, pool: ThreadPoolExecutor, ids: Tensor, after_update: bool, fetch_s: list[float]
                  ) -> Future:
        """Fetch ids on the prefetch thread (and stream); the future gives (Fetch, CUDA event or None)."""
        ready_event = None
        if self._stream is not None:  # the ids and the weights were written on the main stream
            ready_event = torch.cuda.Event()
            ready_event.record(torch.cuda.current_stream(self.device))

        def task():
            start = time.perf_counter()
            if self._stream is None:
                fetch, done = self.embedding.fetch(ids, exchange=self.prefetch_exchange,
                                                   after_update=after_update), None
            else:  # the thread's own current device would be cuda:0: name the table's
                with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                    self._stream.wait_event(ready_event)
                    fetch = self.embedding.fetch(ids, exchange=self.prefetch_exchange, after_update=after_update)
                    done = torch.cuda.Event()
                    done.record(self._stream)
            fetch_s[0] += time.perf_counter() - start
            return fetch, done

        return pool.submit(task)

    def _wait(self, future: Future | None) -> Fetch | None:
        """The prefetched Fetch, ordered after the prefetch stream's work on CUDA."""
        if future is None:
            return None
        fetch, done = future.result()
        if done is not None:
            main = torch.cuda.current_stream(self.device)
            main.wait_event(done)
            for tensor in (fetch.inverse, fetch.served, fetch.rows, fetch.collided, fetch.deferred):
                if tensor is not None:  # made on the prefetch stream, used and freed on the main stream
                    tensor.record_stream(main)
        return fetch

    def _update(self, step_end: Callable[[], None] | None) -> None:
        if step_end is not None:
            step_end()
        self.embedding.step()

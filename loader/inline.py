"""``backend="inline"``: the same pipeline in-process, for machines without Ray and for debugging.

Row groups are read by a thread pool (pyarrow decodes without the GIL), the next block's while the
current one is planned (two blocks in memory, as with Ray). The planner sees the row groups'
statuses and lengths only, as the Ray coordinator does, and every rank's tensors are gathered
straight from the decoded row groups. Every iterator runs its own pass over the epoch and keeps
its ranks' messages, so ranks may be iterated one after another. Steps are counted once in
``stats()`` however many iterators plan them; each rank's wait is the time its iterator spent reading
and planning its next step (nothing is queued or fetched: queue depth and bytes fetched stay 0).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from loader.assemble import RankMessage, rank_messages, route_ranks
from loader.clean import Chunk
from loader.config import LoaderConfig
from loader.nodes import NodeLayout
from loader.pipeline import EpochRun, PlannedStep, Resume, warm_up
from loader.read import read_unit
from loader.sources import SourceIndex
from loader.stats import Stats


class InlineClient:
    def __init__(self, index: SourceIndex, config: LoaderConfig) -> None:
        self.index = index
        self.config = config
        self.pool = ThreadPoolExecutor(max_workers=config.num_readers or os.cpu_count() or 1)
        self._stats = Stats(config.ranks, index.skipped_files)
        self._lock = threading.Lock()
        # one process: the layout only shapes the plans, when the user declares one
        self.layout = NodeLayout.per_node(config.ranks, config.ranks_per_node) if config.ranks_per_node else None
        warm_up(config)

    def open(self, ranks: tuple[int, ...], epoch: int, start: Resume) -> InlineStream:
        return InlineStream(self, ranks, self._steps(epoch, start))

    def stats(self) -> dict:
        with self._lock:
            return self._stats.as_dict()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _steps(self, epoch: int, start: Resume) -> Iterator[tuple[PlannedStep, dict[int, Chunk]]]:
        """Planned steps, each with the decoded row groups it reads (unit -> chunk)."""
        run = EpochRun(self.index, self.config, epoch=epoch, start=start, layout=self.layout)
        held: dict[int, Chunk] = {}
        with closing(read_blocks(run, self.index, self.config, self.pool)) as blocks:
            for block, chunks in blocks:
                held.update(zip(run.units(block), chunks))
                for planned in run.feed(block, [c.meta() for c in chunks]):
                    self._record(planned)
                    yield planned, held
                held = {u: held[u] for u in run.held_units().tolist()}  # what later steps read
        for planned in run.finish():
            self._record(planned)
            yield planned, held
        with self._lock:
            self._stats.record_end(epoch, run.tail)

    def _record(self, planned: PlannedStep) -> None:
        with self._lock:
            self._stats.record(planned)

    def taken(self, ranks: tuple[int, ...], seconds: float) -> None:
        with self._lock:
            for rank in ranks:
                self._stats.taken(rank, seconds, 0)


def read_blocks(
    run: EpochRun, index: SourceIndex, config: LoaderConfig, pool: ThreadPoolExecutor
) -> Iterator[tuple[int, list[Chunk]]]:
    """Each block of ``run`` still to visit with its units' decoded chunks (in ``run.units`` order),
    read on ``pool``; the next block's row groups are read while the caller works on this one."""

    def submit(block: int) -> list[Future]:
        return [
            pool.submit(read_unit, index, unit, max_seq_len=config.max_seq_len, skip_corrupt=config.skip_corrupt)
            for unit in run.units(block)
        ]

    blocks = run.blocks()
    reads = submit(blocks[0]) if blocks else []
    try:
        for i, block in enumerate(blocks):
            chunks = [read.result() for read in reads]
            reads = submit(blocks[i + 1]) if i + 1 < len(blocks) else []
            yield block, chunks
    finally:
        for read in reads:  # an iterator closed early: drop the read-ahead
            read.cancel()


class InlineStream:
    """Messages of one pass for ``ranks``, one step each, every row read in place."""

    def __init__(self, client: InlineClient, ranks: tuple[int, ...], steps) -> None:
        self.client = client
        self.ranks = ranks
        self.steps = steps
        self.holder = np.zeros(len(client.index.units), dtype=np.int64)  # every unit is held here

    def next_message(self) -> dict[int, RankMessage] | None:
        asked = time.monotonic()
        item = next(self.steps, None)
        if item is None:
            return None
        planned, held = item
        config = self.client.config
        every = rank_messages([planned], config.ranks, config.microbatches, self.client.index.roles)
        messages = [every[rank] for rank in self.ranks]
        out = {}
        for message, way in zip(messages, route_ranks(messages, self.holder, [0] * len(messages)).routes):
            message.take(way, [held[u].rows for u in way.units.tolist()], [])
            out[message.rank] = message
        self.client.taken(self.ranks, time.monotonic() - asked)
        return out

    def close(self) -> None:
        self.steps.close()

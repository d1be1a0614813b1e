"""``backend="inline"``: the same pipeline in-process, for machines without Ray and for debugging.

Row groups are read by a thread pool (pyarrow decodes without the GIL), the next block's while the
current one is planned (two blocks in memory, as with Ray); every iterator
runs its own pass over the epoch and keeps its ranks' shares, so ranks may be iterated one after
another. Steps are counted once in ``stats()`` however many iterators plan them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

from loader.assemble import RankStep, warm_up
from loader.config import LoaderConfig
from loader.pipeline import EpochRun, PlannedStep, Resume
from loader.read import read_unit
from loader.sources import SourceIndex
from loader.stats import Stats


class InlineClient:
    def __init__(self, index: SourceIndex, config: LoaderConfig) -> None:
        self.index = index
        self.config = config
        self.pool = ThreadPoolExecutor(max_workers=config.num_readers or os.cpu_count() or 1)
        self._stats = Stats(index.skipped_files)
        self._lock = threading.Lock()
        warm_up(config)

    def open(self, ranks: tuple[int, ...], epoch: int, start: Resume) -> InlineStream:
        return InlineStream(self._steps(epoch, start), ranks)

    def stats(self) -> dict:
        with self._lock:
            return self._stats.as_dict()

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _steps(self, epoch: int, start: Resume) -> Iterator[PlannedStep]:
        run = EpochRun(self.index, self.config, epoch=epoch, start=start)
        blocks = run.blocks()
        reads = self._submit(run, blocks[0]) if blocks else []
        try:
            for i, block in enumerate(blocks):
                chunks = [read.result() for read in reads]
                reads = self._submit(run, blocks[i + 1]) if i + 1 < len(blocks) else []
                for planned in run.feed(block, chunks):
                    self._record(planned)
                    yield planned
        finally:
            for read in reads:  # an iterator closed early: drop the read-ahead
                read.cancel()
        for planned in run.finish():
            self._record(planned)
            yield planned
        with self._lock:
            self._stats.record(epoch, "end", run.tail)

    def _submit(self, run: EpochRun, block: int) -> list[Future]:
        return [self.pool.submit(self._read, unit) for unit in run.units(block)]

    def _read(self, unit: int):
        return read_unit(
            self.index, unit, max_seq_len=self.config.max_seq_len, skip_corrupt=self.config.skip_corrupt
        )

    def _record(self, planned: PlannedStep) -> None:
        with self._lock:
            self._stats.record(planned.epoch, planned.step, planned.counts, planned.planner_seconds)


class InlineStream:
    """Steps of one pass for ``ranks``."""

    def __init__(self, steps: Iterator[PlannedStep], ranks: tuple[int, ...]) -> None:
        self.steps = steps
        self.ranks = ranks

    def next_step(self) -> dict[int, RankStep] | None:
        planned = next(self.steps, None)
        return None if planned is None else {rank: planned.shares[rank] for rank in self.ranks}

    def close(self) -> None:
        self.steps.close()

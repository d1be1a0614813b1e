"""One epoch of the pipeline, fed block by block: order -> validate -> cut -> plan -> split.

Both backends drive an :class:`EpochRun` the same way; only who reads the row groups differs::

    run = EpochRun(index, config, epoch=e, start=Resume(step, cursor), store=...)
    for block in run.blocks():
        chunks = [read_unit(index, u, ...) for u in run.units(block)]  # any reader, any order
        for step in run.feed(block, chunks, handles): ...            # PlannedStep, in step order
    for step in run.finish(): ...

Shares name their rows' sources by *handle*: the chunk itself in-process, the reader's object ref
with Ray (``handles``), and ``store(rows)`` for rows carried over from an earlier block.

A step's membership is decided by the order of *valid* rows, so it never depends on timing: the
rows of a block are visited in epoch order, invalid ones are counted under their reason, and a
batch closes at its ``samples_per_step``-th valid row. Valid rows left over at the end of a block
are copied out (fewer than one batch) and wait for the next block, so a block's chunks are let go
once the steps that read them are consumed. Resuming at a step boundary needs only (step, cursor): nothing is pending there.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from loader.assemble import RankStep, plan_step
from loader.clean import DROP_LAST, REASONS, VALID, Chunk
from loader.config import LoaderConfig
from loader.order import cut_batches, epoch_order
from loader.rows import Rows, gather
from loader.sources import SourceIndex
from loader.stats import Counts


@dataclass(frozen=True)
class Resume:
    """Where an epoch starts: after ``step`` steps, at epoch position ``cursor``."""

    step: int = 0
    cursor: int = 0


@dataclass
class PlannedStep:
    """One global batch, planned: every rank's share, and what the order passed to build it."""

    epoch: int
    step: int
    cursor: int
    shares: list[RankStep]
    counts: Counts
    planner_seconds: float


class EpochRun:
    """The steps of epoch ``epoch`` from ``start`` on; see the module docstring."""

    def __init__(
        self,
        index: SourceIndex,
        config: LoaderConfig,
        *,
        epoch: int,
        start: Resume = Resume(),
        store: Callable[[Rows], object] = lambda rows: rows,
    ) -> None:
        self.index = index
        self.store = store
        self.config = config
        self.epoch = epoch
        self.unit_rows = np.array([u.rows for u in index.units], dtype=np.int64)
        self.order = epoch_order(
            self.unit_rows, seed=config.seed, epoch=epoch, shuffle=config.shuffle, window=config.window
        )
        if not 0 <= start.cursor <= self.order.rows:
            raise ValueError(f"resume cursor {start.cursor} is outside epoch {epoch} of {self.order.rows} rows")
        self.start = start
        self.step = start.step
        self.cursor = start.cursor  # first position not yet visited
        self.dtypes = {column: np.dtype(t.to_pandas_dtype()) for column, t in index.lists}
        self.pending = Rows.empty(self.dtypes)  # valid rows visited but not yet in a batch
        self.pending_handle = None
        self.pending_counts = Counts()  # what the order passed since the last step closed
        self.tail = Counts()  # set by finish(): what the order passed after the last step

    def blocks(self) -> range:
        """Blocks still to visit, in order."""
        return range(self.order.block_of(self.start.cursor), self.order.blocks)

    def units(self, block: int) -> list[int]:
        """Unit ids to read for ``block``, in the order :meth:`feed` wants their chunks."""
        return self.order.units_of(block).tolist()

    def feed(self, block: int, chunks: list[Chunk], handles: list | None = None) -> Iterator[PlannedStep]:
        """Visit the block's rows (from the cursor on) given its units' chunks (and the handles
        shares name their rows by, default the chunks' rows); yield closed steps."""
        member, row = self.order.rows_of(block, self.unit_rows)  # (n,) each, in epoch order
        begin = int(self.order.block_starts[block])
        skip = self.cursor - begin  # positions of this block visited before a resume
        member, row = member[skip:], row[skip:]
        sizes = [len(c.status) for c in chunks]
        flat = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)[member] + row  # (n,)
        status = np.concatenate([c.status for c in chunks])[flat]  # (n,) in epoch order
        # valid_id: (rows of the block,) index of each valid row within its chunk's Rows
        valid_id = np.concatenate([np.cumsum(c.status == VALID) - 1 for c in chunks]).astype(np.int64)
        positions = np.flatnonzero(status == VALID)  # (v,)
        # sources: 0 = rows pending from earlier blocks, 1 + k = chunk k's valid rows
        sources = [self.pending, *(c.rows for c in chunks)]
        handles = [self.pending_handle, *(handles or [c.rows for c in chunks])]
        new_source, new_row = member[positions] + 1, valid_id[flat[positions]]  # (v,) each
        old = len(self.pending)
        ends = cut_batches(status == VALID, pending=old, size=self.config.samples_per_step)
        start = first = 0
        for end in ends.tolist():
            last = int(np.searchsorted(positions, end))  # valid rows before end
            counts = self.pending_counts
            self._visit(counts, status[start:end], sources, new_source[first:last], new_row[first:last])
            counts.delivered += old + last - first
            batch_source = np.concatenate([np.zeros(old, np.int64), new_source[first:last]])
            batch_row = np.concatenate([np.arange(old, dtype=np.int64), new_row[first:last]])
            self.pending_counts, old = Counts(), 0
            self.cursor = begin + skip + end
            yield self._plan(sources, handles, batch_source, batch_row, counts)
            start, first = end, last
        self._visit(self.pending_counts, status[start:], sources, new_source[first:], new_row[first:])
        self.pending = gather(
            sources,
            np.concatenate([np.zeros(old, np.int64), new_source[first:]]),
            np.concatenate([np.arange(old, dtype=np.int64), new_row[first:]]),
            self.dtypes,
        )
        self.pending_handle = self.store(self.pending) if len(self.pending) else None
        self.cursor = int(self.order.block_starts[block + 1])

    def finish(self) -> Iterator[PlannedStep]:
        """After the last block: the last short batch (unless ``drop_last``), then :attr:`tail`.

        :attr:`tail` holds what the order passed after the last step (trailing skipped rows, and
        the short batch's rows under ``drop_last``); the caller counts it as the epoch's ``"end"``.
        """
        n = len(self.pending)
        counts, self.pending_counts = self.pending_counts, Counts()
        if n and not self.config.drop_last:
            counts.delivered += n
            yield self._plan([self.pending], [self.pending_handle], np.zeros(n, np.int64),
                             np.arange(n, dtype=np.int64), counts)
            return
        counts.skip(DROP_LAST, n)  # these rows were counted as truncated when visited; undo that
        counts.truncated_rows -= int(np.count_nonzero(self.pending.cut))
        counts.truncated_events -= int(self.pending.cut.sum())
        self.tail = counts

    @staticmethod
    def _visit(counts: Counts, status: np.ndarray, sources: list[Rows], source: np.ndarray, row: np.ndarray) -> None:
        """Count positions just visited: skipped rows by reason, truncation of the new valid rows."""
        codes = np.bincount(status, minlength=len(REASONS))
        for code in range(1, len(REASONS)):
            counts.skip(REASONS[code], int(codes[code]))
        for s in np.unique(source).tolist():
            cut = sources[s].cut[row[source == s]]
            counts.truncated_rows += int(np.count_nonzero(cut))
            counts.truncated_events += int(cut.sum())

    def _plan(self, sources: list[Rows], handles: list, source: np.ndarray, row: np.ndarray,
              counts: Counts) -> PlannedStep:
        shares, seconds = plan_step(
            sources, handles, source, row, step=self.step, cursor=self.cursor, config=self.config,
            dtypes=self.dtypes, roles=(self.index.columns.items, self.index.timestamps),
        )
        planned = PlannedStep(self.epoch, self.step, self.cursor, shares, counts, seconds)
        self.step += 1
        return planned

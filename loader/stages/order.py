"""The epoch order: a seeded permutation of every row, computed from row counts alone.

Two levels, so memory stays at a window of row groups however large the dataset:

1. the units (row groups) are permuted with a seeded generator; the parts of a row group listed in parts
   (:data:`loader.contract.sources.PART_BYTES`) move together and stay in row order, so one reader decodes
   them in a single pass;
2. consecutive units of that order are grouped into *blocks* of at least ``window`` rows, and the
   rows of each block are permuted, so samples of a block mix across its row groups. The epoch's first
   block may close sooner, once it holds ``first_rows`` rows (one global batch:
   :meth:`loader.config.LoaderConfig.first_block_rows`): no step is cut before every unit of its block is
   decoded, so the first step waits for that much only.

Position ``p`` of the epoch order (its *cursor*) is therefore a known (unit, row) before any data is
read; nothing depends on which reader finishes first. ``shuffle=False`` keeps file order.

Rows that turn out invalid when read are skipped, so global batches are cut from the order of
*valid* rows: batch k holds valid rows ``k*size .. (k+1)*size - 1`` (see :func:`cut_batches`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Independent random streams per (seed, epoch).
_UNITS, _BLOCKS = 0, 1


@dataclass(frozen=True)
class EpochOrder:
    """The order of one epoch over units with ``unit_rows`` (U,) rows.

    ``units`` (U,) is the unit order; block b holds units ``units[block_units[b]:block_units[b+1]]``
    and covers cursors ``block_starts[b] .. block_starts[b+1] - 1``.
    """

    units: np.ndarray  # int64 (U,)
    block_units: np.ndarray  # int64 (B + 1,)
    block_starts: np.ndarray  # int64 (B + 1,)
    seed: int
    epoch: int
    shuffle: bool

    @property
    def blocks(self) -> int:
        return len(self.block_units) - 1

    @property
    def rows(self) -> int:
        return int(self.block_starts[-1])

    def block_of(self, cursor: int) -> int:
        """The block holding position ``cursor`` (``blocks`` when the cursor is at the end)."""
        return int(np.searchsorted(self.block_starts, cursor, side="right")) - 1 if cursor < self.rows else self.blocks

    def units_of(self, block: int) -> np.ndarray:
        """Unit ids of ``block``, in order (k,)."""
        return self.units[self.block_units[block] : self.block_units[block + 1]]

    def rows_of(self, block: int, unit_rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The block's rows in epoch order: ``member`` (n,) indexes ``units_of(block)`` and ``row``
        (n,) is the row inside that unit."""
        sizes = unit_rows[self.units_of(block)]  # (k,)
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # (k + 1,)
        n = int(starts[-1])
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, _BLOCKS, block])
            position = rng.permutation(n)
        else:
            position = np.arange(n, dtype=np.int64)
        member = np.searchsorted(starts, position, side="right") - 1
        return member, position - starts[member]


def epoch_order(unit_rows: np.ndarray, *, seed: int, epoch: int, shuffle: bool, window: int,
                groups: np.ndarray | None = None, first_rows: int | None = None) -> EpochOrder:
    """The order of epoch ``epoch`` over units of ``unit_rows`` (U,) rows, blocks of >= ``window`` rows, the first
    of >= ``first_rows`` (default ``window``).

    ``groups`` (U,): the row group of each unit, consecutive ids from 0 (:attr:`SourceIndex.groups`; default:
    every unit its own). Row groups are permuted; a row group's units follow one another in index order. With
    one unit per row group this is the permutation of the units themselves."""
    unit_rows = np.asarray(unit_rows, dtype=np.int64)
    groups = np.arange(len(unit_rows), dtype=np.int64) if groups is None else np.asarray(groups, dtype=np.int64)
    first = np.searchsorted(groups, np.arange(int(groups[-1]) + 2 if len(groups) else 1))  # (G + 1,) unit bounds
    if shuffle:
        picked = np.random.default_rng([seed, epoch, _UNITS]).permutation(len(first) - 1).astype(np.int64)
    else:
        picked = np.arange(len(first) - 1, dtype=np.int64)
    sizes = np.diff(first)[picked]  # units of each picked row group, in order
    placed = np.concatenate([[0], np.cumsum(sizes)[:-1]])  # where each row group's units start in the order
    units = np.repeat(first[:-1][picked] - placed, sizes) + np.arange(len(unit_rows), dtype=np.int64)
    block_units = cut_blocks(unit_rows[units], window, first=first_rows)
    cumulative = np.concatenate([[0], np.cumsum(unit_rows[units])]).astype(np.int64)  # (U + 1,)
    return EpochOrder(units, block_units, cumulative[block_units], seed, epoch, shuffle)


def cut_blocks(rows_in_order: np.ndarray, window: int, *, first: int | None = None) -> np.ndarray:
    """Block boundaries (B + 1,) over units in order: a block closes once it holds >= ``window`` rows, the first
    block once it holds >= ``first`` (default ``window``).

    Empty units join the block they fall in; the last block may be short.
    """
    bounds = [0]
    filled = 0
    for i, rows in enumerate(rows_in_order.tolist()):
        filled += rows
        if filled >= (window if len(bounds) > 1 or first is None else first):
            bounds.append(i + 1)
            filled = 0
    if bounds[-1] != len(rows_in_order):
        bounds.append(len(rows_in_order))
    return np.asarray(bounds, dtype=np.int64)


def cut_batches(valid: np.ndarray, *, pending: int, size: int) -> np.ndarray:
    """Where global batches close inside a run of the order.

    ``valid`` bool (n,) marks valid rows of consecutive positions; ``pending`` valid rows from
    earlier positions already wait for a batch of ``size``. Returns the exclusive end position
    (int64 (k,)) of each batch completed here: right after its ``size``-th valid row.
    """
    positions = np.flatnonzero(valid)
    need = size - pending  # valid rows that complete the open batch
    return (positions[need - 1 :: size] + 1).astype(np.int64)

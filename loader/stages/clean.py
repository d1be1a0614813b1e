"""Validate the rows of one row group and truncate long histories (pure NumPy).

Every row gets a status: valid, or the first reason it cannot be trained on (the order of
``REASONS``). Rows are never dropped silently: the pipeline counts each skipped row under its reason
when the epoch order passes it. Histories longer than ``max_seq_len`` keep their most recent events
in every list column; the number of events cut is kept per row (``Rows.cut``) and counted too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from loader.stages.kernels import copy_ranges
from loader.stages.rows import Rows, Sliced

VALID = 0
# status code -> reason; code 0 is a valid row
REASONS = (
    "",
    "null user id",
    "null history",
    "empty history",
    "mismatched list lengths",
    "null event",
    "corrupt row group",
)
NULL_USER, NULL_HISTORY, EMPTY_HISTORY, MISMATCHED, NULL_EVENT, CORRUPT = range(1, len(REASONS))
# counted by the pipeline, never a row status: rows of the last short batch under drop_last=True
DROP_LAST = "drop_last"


@dataclass
class ListColumn:
    """One decoded list column of n rows: row i is ``values[offsets[i]:offsets[i + 1]]``."""

    offsets: np.ndarray  # int64 (n + 1,), absolute positions in values
    values: np.ndarray  # (m,), nulls filled with 0
    row_null: np.ndarray | None = None  # bool (n,): the list itself is null; None when there are none
    event_null: np.ndarray | None = None  # bool (m,): a null inside a list; None when there are none


@dataclass
class Chunk:
    """A cleaned row group: ``status`` int8 (rows,) per row in file order, ``rows`` the valid ones (a part decoded
    slice by slice: :class:`Sliced`); ``retries``: reads of it the storage refused and were tried again."""

    status: np.ndarray
    rows: Rows | Sliced
    retries: int = 0

    def meta(self) -> UnitMeta:
        """What the control plane needs of this row group: statuses and lengths, no events. Lengths
        and cuts travel as int32 (5-9 bytes a row), so a row group's meta stays small enough for
        Ray to pass inline instead of through the object store."""
        return UnitMeta(status=self.status, lengths=self.rows.lengths.astype(np.int32),
                        cut=self.rows.cut.astype(np.int32), retries=self.retries)


@dataclass
class UnitMeta:
    """A cleaned row group as the planner sees it: ``status`` int8 (rows,) in file order, and per
    valid row (in file order) its ``lengths`` and ``cut`` (events lost to ``max_seq_len``), int32
    (valid,) each, and the ``retries`` of its reads (``stats()["storage_retries"]``). A few bytes a row: this is all
    the coordinator ever receives of the data."""

    status: np.ndarray
    lengths: np.ndarray
    cut: np.ndarray
    retries: int = 0


def clean(
    user_ids: np.ndarray,
    user_null: np.ndarray | None,
    lists: dict[str, ListColumn],
    *,
    items: str,
    max_seq_len: int | None,
) -> Chunk:
    """Status of each of the n rows and the valid rows, truncated to ``max_seq_len``.

    ``lists`` maps column names to list columns of n rows; ``lists[items]`` holds the histories.
    """
    n = len(user_ids)
    status = np.zeros(n, dtype=np.int8)
    items_column = lists[items]
    lengths = np.diff(items_column.offsets)  # (n,)
    if user_null is not None:
        _mark(status, user_null, NULL_USER)
    if items_column.row_null is not None:
        _mark(status, items_column.row_null, NULL_HISTORY)
    _mark(status, lengths == 0, EMPTY_HISTORY)
    for column in lists.values():
        mismatched = np.diff(column.offsets) != lengths
        if column.row_null is not None:
            mismatched |= column.row_null
        _mark(status, mismatched, MISMATCHED)
    for column in lists.values():
        if column.event_null is not None:
            _mark(status, _rows_with(column.event_null, column.offsets, n), NULL_EVENT)
    return Chunk(status=status, rows=_keep(status == VALID, user_ids, lists, lengths, max_seq_len))


def corrupt(rows: int) -> Chunk:
    """A row group that could not be decoded: all ``rows`` are skipped as corrupt."""
    return Chunk(status=np.full(rows, CORRUPT, dtype=np.int8), rows=Rows.empty({}))


def _mark(status: np.ndarray, mask: np.ndarray, code: int) -> None:
    """Give rows in ``mask`` that are still valid the status ``code`` (first reason wins)."""
    status[mask & (status == VALID)] = code


def _rows_with(event_mask: np.ndarray, offsets: np.ndarray, n: int) -> np.ndarray:
    """bool (n,): rows owning at least one event of ``event_mask`` (m,)."""
    owners = np.searchsorted(offsets, np.flatnonzero(event_mask), side="right") - 1
    rows = np.zeros(n, dtype=bool)
    rows[owners[(owners >= 0) & (owners < n)]] = True
    return rows


def _keep(
    valid: np.ndarray,
    user_ids: np.ndarray,
    lists: dict[str, ListColumn],
    lengths: np.ndarray,
    max_seq_len: int | None,
) -> Rows:
    """The valid rows with their most recent ``max_seq_len`` events, as one jagged :class:`Rows`."""
    kept_rows = np.flatnonzero(valid)  # (k,)
    full = lengths[kept_rows]
    kept = full if max_seq_len is None else np.minimum(full, max_seq_len)  # (k,)
    offsets = np.zeros(len(kept_rows) + 1, dtype=np.int64)
    np.cumsum(kept, out=offsets[1:])
    contiguous = len(kept_rows) == len(valid) and bool(np.all(kept == full))
    events = {}
    for name, column in lists.items():
        starts = column.offsets[kept_rows] + (full - kept)  # (k,) first kept event of each row
        if contiguous:  # every row whole: the values are already laid out as wanted
            events[name] = column.values[int(column.offsets[0]) : int(column.offsets[-1])]
        else:
            events[name] = np.empty(int(offsets[-1]), dtype=column.values.dtype)
            copy_ranges(column.values, starts, kept, events[name], offsets[:-1])
    return Rows(
        user_ids=np.ascontiguousarray(user_ids[kept_rows], dtype=np.int64),
        offsets=offsets,
        events=events,
        cut=(full - kept).astype(np.int64),
    )

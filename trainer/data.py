"""The trainer's data, written once: the leave-last-out split of a dataset, item ids already table rows.

`write_split` reads the dataset (user ids, item ids, timestamps of every history, in the data contract) in the
launching process, maps raw item ids to dense rows ``0 .. V-1`` of the embedding table (row r is the r-th
smallest distinct id) and writes, as Parquet in the contract, for the histories of >= 2 events:

- the *training split*: every such history without its last event;
- the *held-out set*: the same histories whole (evaluation reads all but the last event and ranks every item
  for it; the popularity baseline counts the events before the last).

The ranks read both only through ``loader.SequenceLoader``; what a rank is given is the `Split` (paths and
sizes).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from loader.contract import layout
from loader.contract.schema import Columns, contract_schema, list_array
from loader.contract.sources import index_source


@dataclass(frozen=True)
class Split:
    """Where a run's data is and how big it is (all a rank needs to be given about it)."""

    train: str  # the training split: histories of >= 2 events without their last one, items as table rows
    heldout: str  # the same histories whole
    num_items: int  # rows of the embedding table: the distinct item ids of the dataset
    rows: int  # histories in either (those of >= 2 events)

    @classmethod
    def under(cls, work: str | Path, *, num_items: int, rows: int) -> Split:
        """The split `write_split(..., work)` writes."""
        return cls(str(Path(work) / "train"), str(Path(work) / "heldout"), num_items, rows)


@dataclass
class Histories:
    """Every user's history, oldest first: ``items`` and ``times`` (T,) int64, ``offsets`` (n + 1,)."""

    users: np.ndarray
    items: np.ndarray
    times: np.ndarray
    offsets: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


def read_histories(source: str | Path) -> Histories:
    """All histories of a dataset in the contract (user id, item ids, timestamps), in file order."""
    index = index_source(str(source), columns=Columns())
    columns = Columns()
    if index.timestamps is None:
        raise ValueError(f"{source}: the trainer needs the {columns.timestamps!r} column (event times, oldest first)")
    tables = [pq.read_table(f.path, columns=[columns.user, columns.items, columns.timestamps]) for f in index.files]
    table = pa.concat_tables(tables)
    items = table.column(columns.items).combine_chunks()
    times = table.column(columns.timestamps).combine_chunks()
    offsets = np.asarray(items.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    first = offsets[0]
    return Histories(
        users=table.column(columns.user).to_numpy().astype(np.int64),
        items=items.values.to_numpy(zero_copy_only=False)[first : offsets[-1]].astype(np.int64),
        times=times.values.to_numpy(zero_copy_only=False)[first : offsets[-1]].astype(np.int64),
        offsets=offsets - first,
    )


def write_split(source: str | Path, work: str | Path) -> Split:
    """Read `source` once, map its item ids to table rows, write the training split and the held-out set under
    `work` (``train/``, ``heldout/``)."""
    histories = read_histories(source)
    ids, rows = np.unique(histories.items, return_inverse=True)  # (V,) sorted distinct ids; (T,) row of each
    mapped = Histories(histories.users, rows.astype(np.int64), histories.times, histories.offsets)
    split = Split.under(work, num_items=len(ids), rows=int((histories.lengths >= 2).sum()))
    write_training_split(mapped, split.train)
    _write(mapped, split.heldout, drop_last_event=False, desc="held-out set")
    return split


def write_training_split(histories: Histories, out_dir: str | Path) -> int:
    """Write every history without its last event (those of >= 2 events) in the data contract (the
    layout ``freescale convert`` writes); returns the rows."""
    return _write(histories, out_dir, drop_last_event=True, desc="training split")


def _write(histories: Histories, out_dir: str | Path, *, drop_last_event: bool, desc: str) -> int:
    """Write the histories of >= 2 events, without their last event if `drop_last_event`; returns the rows."""
    keep = np.flatnonzero(histories.lengths >= 2)  # (k,)
    starts, stops = histories.offsets[keep], histories.offsets[keep + 1] - int(drop_last_event)  # (k,) each
    offsets = np.concatenate([[0], np.cumsum(stops - starts)]).astype(np.int64)  # (k + 1,)
    take = np.repeat(starts - offsets[:-1], stops - starts) + np.arange(offsets[-1])  # (events kept,)
    items, times, users = histories.items[take], histories.times[take], histories.users[keep]
    schema = contract_schema()
    out = layout.prepare_out_dir(out_dir, overwrite=True)

    def make_table(start: int, stop: int) -> pa.Table:
        first, last = int(offsets[start]), int(offsets[stop])
        rows = offsets[start : stop + 1] - first
        return pa.Table.from_arrays([pa.array(users[start:stop]), list_array(rows, items[first:last]),
                                     list_array(rows, times[first:last])], schema=schema)

    layout.write_parts(out, schema, layout.plan_parts(len(keep), files=layout.DEFAULT_FILES), make_table, desc=desc)
    return len(keep)

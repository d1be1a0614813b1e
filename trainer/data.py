"""Leave-last-out data for training: the training split on disk, the item vocabulary, the evaluation set.

The trainer reads the dataset once (user ids, item ids, timestamps of every history, in the data
contract), then:

- writes the *training split*: every history without its last event (histories of one event are
  dropped there), as Parquet in the contract, which the ranks stream through ``loader.SequenceLoader``;
- maps raw item ids to dense rows ``0 .. V-1`` of the embedding table (``Vocabulary``: sorted unique ids);
- keeps the full histories for leave-last-out evaluation (the model reads all but the last event and
  ranks every item for it) and the training counts of every item for the most-popular baseline.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from loader import layout
from loader.schema import Columns, contract_schema, list_array
from loader.sources import index_source


@dataclass(frozen=True)
class Vocabulary:
    """Raw item ids, sorted unique: int64 (V,). Row r of the table is item ``ids[r]``."""

    ids: np.ndarray

    def rows(self, raw: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Raw ids (T,) -> table rows (T,) int64; an id outside the vocabulary is a ValueError."""
        raw = np.asarray(raw, dtype=np.int64)
        rows = np.searchsorted(self.ids, raw)
        bad = (rows >= len(self.ids)) | (self.ids[np.minimum(rows, len(self.ids) - 1)] != raw)
        if bad.any():
            raise ValueError(f"item id {int(raw[bad][0])} is not in the training vocabulary of {len(self.ids)} items")
        return torch.from_numpy(rows)


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


def write_training_split(histories: Histories, out_dir: str | Path) -> int:
    """Write every history without its last event (those of >= 2 events) in the data contract (the
    layout ``freescale convert`` writes); returns the rows."""
    keep = np.flatnonzero(histories.lengths >= 2)  # (k,)
    starts, stops = histories.offsets[keep], histories.offsets[keep + 1] - 1  # (k,) each: drop the last event
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

    layout.write_parts(out, schema, layout.plan_parts(len(keep), files=layout.DEFAULT_FILES), make_table,
                       desc="training split")
    return len(keep)


def training_counts(histories: Histories, vocabulary: Vocabulary) -> torch.Tensor:
    """How often each table row occurs in the training split (every event but each history's last): (V,)."""
    last = histories.offsets[1:] - 1
    mask = np.ones(len(histories.items), dtype=bool)
    mask[last[histories.lengths >= 1]] = False
    return torch.bincount(vocabulary.rows(histories.items[mask]), minlength=len(vocabulary.ids))

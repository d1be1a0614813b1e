"""History lengths of a Parquet dataset in the data contract, read without decoding the items.

Used by ``freescale plan`` (and later the offline report) to plan whole epochs from lengths alone:
only the list offsets of the item column are read, one row group at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loader.convert import input_files
from loader.schema import Columns, validate_schema


def read_lengths(source: str | Path, *, columns: Columns = Columns(),
                 progress: Callable[[Iterable], Iterable] = iter) -> tuple[np.ndarray, dict]:
    """Lengths (int64 (N,), file then row order) of every non-empty history, and skip counts.

    Null and empty histories cannot be planned; they are counted in the returned dict
    (``{"null history": n, "empty history": m}``, non-zero reasons only), never dropped silently.
    """
    paths = [p for p in input_files(source) if p.suffix.lower() in (".parquet", ".pq")]
    if not paths:
        raise FileNotFoundError(f"{source}: holds no .parquet files")
    chunks: list[np.ndarray] = []
    skipped = {"null history": 0, "empty history": 0}
    for path in progress(paths):
        try:
            parquet = pq.ParquetFile(path)
        except Exception as exc:  # pyarrow raises several types for a corrupt footer
            raise ValueError(f"{path}: not a readable Parquet file ({exc})") from exc
        validate_schema(parquet.schema_arrow, str(path), columns)
        for group in range(parquet.num_row_groups):
            items = parquet.read_row_group(group, columns=[columns.items]).column(0)
            lengths = pc.list_value_length(items).to_numpy(zero_copy_only=False)  # (rows,) float if nulls
            null = np.isnan(lengths) if lengths.dtype.kind == "f" else np.zeros(lengths.shape, bool)
            lengths = np.where(null, 0, lengths).astype(np.int64)
            skipped["null history"] += int(null.sum())
            skipped["empty history"] += int(((lengths == 0) & ~null).sum())
            chunks.append(lengths[lengths > 0])
    lengths = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
    return lengths, {reason: n for reason, n in skipped.items() if n}

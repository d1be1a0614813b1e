"""Read one row group (a :class:`loader.sources.Unit`) into a cleaned :class:`loader.clean.Chunk`.

The one reading function both backends call: in-process for ``backend="inline"``, inside reader
actors for ``backend="ray"``. Only the carried columns are decoded; ids and timestamps are cast to
int64 (losslessly, as the schema check promised), features keep the first file's value type.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from loader.clean import Chunk, ListColumn, clean, corrupt
from loader.sources import SourceIndex

# What pyarrow raises for pages that do not decode (bad compression, garbled encodings, short reads).
_DECODE_ERRORS = (pa.ArrowException, OSError)


def read_unit(index: SourceIndex, unit: int, *, max_seq_len: int | None, skip_corrupt: bool) -> Chunk:
    """Decode, validate and truncate row group ``unit`` of ``index``.

    Decoded on the calling thread (``use_threads=False``): readers run side by side, one row group
    each, and pyarrow's own thread pool on top of them only adds switching (about 10% more CPU).
    A row group that does not decode raises ValueError naming the file and row group, or with
    ``skip_corrupt`` comes back with every row marked corrupt (counted, never delivered).
    """
    u = index.units[unit]
    file = index.files[u.file]
    names = [index.columns.user, *(column for column, _ in index.lists)]
    try:
        table = file.open().read_row_group(u.row_group, columns=names, use_threads=False)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{file.path}: the file disappeared after the loader indexed it") from exc
    except _DECODE_ERRORS as exc:
        if skip_corrupt:
            return corrupt(u.rows)
        raise ValueError(
            f"{index.describe(unit)}: cannot be decoded ({_one_line(exc)}); the file is corrupt: replace it, or "
            "pass skip_corrupt=True to skip its rows and count them"
        ) from exc
    if table.num_rows != u.rows:
        raise ValueError(
            f"{index.describe(unit)}: holds {table.num_rows} rows, but its footer said {u.rows} when "
            "the loader was built; the file changed: construct the loader again"
        )
    users = table.column(index.columns.user).combine_chunks().cast(pa.int64())
    user_null = users.is_null().to_numpy(zero_copy_only=False) if users.null_count else None
    if users.null_count:
        users = users.fill_null(0)
    user_ids = _view(users)
    lists = {column: _list_column(table.column(column).combine_chunks(), t) for column, t in index.lists}
    return clean(user_ids, user_null, lists, items=index.columns.items, max_seq_len=max_seq_len)


def _list_column(array: pa.Array, value_type: pa.DataType) -> ListColumn:
    """A list<...> / large_list<...> array as offsets (n + 1,), values (m,) and null masks."""
    values = array.values
    event_null = values.is_null().to_numpy(zero_copy_only=False) if values.null_count else None
    if values.null_count:
        values = values.fill_null(0)
    if values.type != value_type:
        values = pc.cast(values, value_type)
    return ListColumn(
        offsets=_view(array.offsets).astype(np.int64),
        values=_view(values),
        row_null=array.is_null().to_numpy(zero_copy_only=False) if array.null_count else None,
        event_null=event_null,
    )


def _view(array: pa.Array) -> np.ndarray:
    """A fixed-width array without nulls as a zero-copy NumPy view of its data buffer. (pyarrow's
    ``to_numpy`` and ``np.asarray`` import pandas on first use: about a second of start-up per reader.)"""
    dtype = np.dtype(array.type.to_pandas_dtype())
    return np.frombuffer(array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * dtype.itemsize)


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())

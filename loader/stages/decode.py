"""Read one row group (a :class:`loader.contract.sources.Unit`) into a cleaned :class:`loader.stages.clean.Chunk`.

The one reading function both backends call: in-process for ``backend="inline"``, inside reader
actors for ``backend="ray"``. Only the carried columns are decoded; ids and timestamps are cast to
int64 (losslessly, as the schema check promised), features keep the first file's value type.

Reading is two steps, so that the bytes of one row group can be fetched while another decodes
(a reader's read-ahead, :mod:`loader.backends.reader`): :func:`fetch_unit` reads the byte range of the row
group's carried column chunks in one ranged read (one request to object storage), and
:func:`decode_unit` decodes it from memory. File footers are read once per process and file
(:meth:`loader.contract.sources.DataFile.footer`), not once per row group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loader.stages.clean import Chunk, ListColumn, clean, corrupt
from loader.contract.sources import SourceIndex, carried_chunks

# What pyarrow raises for pages that do not decode (bad compression, garbled encodings, short reads).
_DECODE_ERRORS = (pa.ArrowException, OSError)
READ_AHEAD_BYTES = 1 << 30  # decoded row groups read ahead of the current shuffle block, at most (one at least)


def readahead_units(index: SourceIndex, readers: int) -> int:
    """Row groups to keep in flight beyond the current shuffle block: two per reader, so none waits for work,
    but no more than ``READ_AHEAD_BYTES`` of the largest row group decoded (at least one): row groups of 0.5 GB
    are read one ahead, not four (the memory a loader holds is the block, the window and this read-ahead)."""
    largest = max((u.nbytes for u in index.units), default=0)
    return max(1, min(2 * readers, READ_AHEAD_BYTES // max(largest, 1)))


_SLACK = 1024  # bytes fetched past a row group's last column chunk: pyarrow pads the chunks of some old writers'
# files by up to 100 bytes (PARQUET-816) and would read them


@dataclass
class RowGroupBytes:
    """The bytes ``[start, start + data.size)`` of a unit's file of ``size`` bytes: every carried column chunk
    of its row group, and the file's footer (``data`` None: they could not be read, and ``skip_corrupt`` skips
    the unit)."""

    unit: int
    start: int
    data: pa.Buffer | None
    metadata: pq.FileMetaData | None
    size: int = 0


def read_unit(index: SourceIndex, unit: int, *, max_seq_len: int | None, skip_corrupt: bool) -> Chunk:
    """Decode, validate and truncate row group ``unit`` of ``index`` (:func:`fetch_unit`, then :func:`decode_unit`)."""
    return decode_unit(index, fetch_unit(index, unit, skip_corrupt=skip_corrupt), max_seq_len=max_seq_len,
                       skip_corrupt=skip_corrupt)


def fetch_unit(index: SourceIndex, unit: int, *, skip_corrupt: bool) -> RowGroupBytes:
    """The bytes of row group ``unit``'s carried column chunks, in one ranged read (pyarrow releases the GIL)."""
    u = index.units[unit]
    file = index.files[u.file]
    try:
        metadata = file.footer()
        start, stop = _chunk_range(metadata.row_group(u.row_group), set(_names(index)))
        with file.filesystem.open_input_file(file.path) as stream:
            size = stream.size()
            if stop > size:
                raise OSError(f"its column chunks end at byte {stop}, past the file's end ({size} bytes)")
            stream.seek(start)
            data = stream.read_buffer(min(stop + _SLACK, size) - start)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{file.path}: the file disappeared after the loader indexed it") from exc
    except _DECODE_ERRORS as exc:
        if skip_corrupt:
            return RowGroupBytes(unit, 0, None, None)
        raise _undecodable(index, unit, exc) from exc
    return RowGroupBytes(unit, start, data, metadata, size)


def decode_unit(index: SourceIndex, fetched: RowGroupBytes, *, max_seq_len: int | None,
                skip_corrupt: bool) -> Chunk:
    """Decode, validate and truncate the row group ``fetched`` holds.

    Decoded on the calling thread (``use_threads=False``): readers run side by side, one row group
    each, and pyarrow's own thread pool on top of them only adds switching (about 10% more CPU).
    A row group that does not decode raises ValueError naming the file and row group, or with
    ``skip_corrupt`` comes back with every row marked corrupt (counted, never delivered).
    """
    unit = fetched.unit
    u = index.units[unit]
    if fetched.data is None:
        return corrupt(u.rows)
    try:
        source = pa.PythonFile(_RangeFile(fetched.data, fetched.start, fetched.size), mode="r")
        parquet = pq.ParquetFile(source, metadata=fetched.metadata)
        table = parquet.read_row_group(u.row_group, columns=_names(index), use_threads=False)
    except _DECODE_ERRORS as exc:
        if skip_corrupt:
            return corrupt(u.rows)
        raise _undecodable(index, unit, exc) from exc
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


def _names(index: SourceIndex) -> list[str]:
    return [index.columns.user, *(column for column, _ in index.lists)]


def _chunk_range(group: pq.RowGroupMetaData, names: set[str]) -> tuple[int, int]:
    """[start, stop) file offsets spanning the column chunks of ``group`` whose top-level column is in ``names``."""
    start, stop = None, 0
    for chunk in carried_chunks(group, names):
        first = chunk.data_page_offset
        if chunk.has_dictionary_page and chunk.dictionary_page_offset is not None:
            first = min(first, chunk.dictionary_page_offset)
        start = first if start is None else min(start, first)
        stop = max(stop, first + chunk.total_compressed_size)
    if start is None:
        raise OSError("the row group holds none of the carried columns")
    return start, stop


class _RangeFile:
    """A read-only file object of ``size`` bytes holding bytes ``[start, start + data.size)``, for
    ``pa.PythonFile``: reads outside that range fail (the reader would have asked for bytes it was not given)."""

    closed = False

    def __init__(self, data: pa.Buffer, start: int, size: int) -> None:
        self.data, self.start, self.position, self.length = data, start, start, size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.position = offset if whence == 0 else self.position + offset if whence == 1 else self.size() + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def size(self) -> int:
        return self.length

    def read_buffer(self, nbytes: int = -1) -> pa.Buffer:
        """The next ``nbytes`` as a zero-copy slice (``pa.PythonFile`` uses this where a file has it)."""
        at = self.position - self.start
        if nbytes < 0:
            nbytes = self.data.size - at
        if at < 0 or at + nbytes > self.data.size:
            raise OSError(f"read of {nbytes} bytes at offset {self.position} outside the fetched range "
                          f"[{self.start}, {self.start + self.data.size})")
        self.position += nbytes
        return self.data.slice(at, nbytes)

    def read(self, nbytes: int = -1) -> bytes:
        return self.read_buffer(nbytes).to_pybytes()

    def close(self) -> None:
        pass


def _undecodable(index: SourceIndex, unit: int, exc: Exception) -> ValueError:
    return ValueError(
        f"{index.describe(unit)}: cannot be decoded ({_one_line(exc)}); the file is corrupt: replace it, or "
        "pass skip_corrupt=True to skip its rows and count them"
    )


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

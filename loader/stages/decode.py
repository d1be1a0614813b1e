"""Read one row group (a :class:`loader.contract.sources.Unit`) into a cleaned :class:`loader.stages.clean.Chunk`.

The one reading function both backends call: in-process for ``backend="inline"``, inside reader
actors for ``backend="ray"``. Only the carried columns are decoded; ids and timestamps are cast to
int64 (losslessly, as the schema check promised), features keep the first file's value type.

Reading is two steps, so that the bytes of one row group can be fetched while another decodes
(a reader's read-ahead, :mod:`loader.backends.reader`): :func:`fetch_unit` reads the byte range of the row
group's carried column chunks in one ranged read (one request to object storage), and
:func:`decode_unit` decodes it from memory. A part of a row group (:data:`loader.contract.sources.PART_BYTES`)
is not fetched: its rows are taken from the process's pass over the row group (:mod:`loader.stages.passes`),
whose pages are read as they are decoded, ``SLICE_BYTES`` at a time, into arrays sized once: memory for the
part and one slice, never the whole row group. On object storage, where each request waits and costs, a row
group's parts share one fetch of the whole row group's chunks (up to ``REMOTE_PASS_BYTES``), and its pass
decodes from them. File footers are read once per process and file
(:meth:`loader.contract.sources.DataFile.footer`), not once per row group.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from loader.stages.clean import Chunk, ListColumn, clean, corrupt
from loader.stages.rows import Sliced
from loader.contract.sources import (DataFile, SourceIndex, StorageError, Unit, carried_chunks, counting_retries,
                                     one_line, retrying, storage_error)
from loader.stages.passes import PASSES

# What pyarrow raises for pages that do not decode (bad compression, garbled encodings, short reads).
_DECODE_ERRORS = (pa.ArrowException, OSError)
READ_AHEAD_BYTES = 512 << 20  # decoded units read ahead of the current shuffle block, at most (one at least)
# A part is decoded about SLICE_BYTES at a time (docs/benchmarks.md "Row groups in parts", and "Composition windows
# closed at block boundaries": 16 MiB held 100-170 MiB less than 32 on 0.5 GB row groups at the same CPU), its pages
# read through a buffer of STREAM_BUFFER bytes from a local file, and of REMOTE_BUFFER from object storage (one
# request each).
SLICE_BYTES = 16 << 20
STREAM_BUFFER = 1 << 20
REMOTE_BUFFER = 8 << 20
REMOTE_PASS_BYTES = 512 << 20  # a row group on object storage read in parts is fetched whole up to this size


def readahead_units(index: SourceIndex, readers: int) -> int:
    """Units to keep in flight beyond the current shuffle block: two per reader, so none waits for work,
    but no more than ``READ_AHEAD_BYTES`` of the largest unit decoded (at least one): the memory a loader holds
    is the block, the window and this read-ahead."""
    largest = max((u.nbytes for u in index.units), default=0)
    return max(1, min(2 * readers, READ_AHEAD_BYTES // max(largest, 1)))


def reader_priority(nice: int) -> None:
    """Run the calling (reading) thread ``nice`` steps below its process's main thread: Linux, where the nice value
    is per thread; elsewhere nothing. Where every CPU is busy, the stages each step waits for (cutting, planning,
    delivery, the trainer's own work) then run first and decoding takes the CPU they leave, while the read-ahead
    (:func:`readahead_units`) keeps it ahead of them; an idle CPU runs a reader whatever its nice value. The value
    is set, not added: calling again changes nothing. Raising a thread's priority again needs privileges, so a
    warm reader actor keeps the lowest priority a loader gave it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        thread = threading.get_native_id()
        if os.getpriority(os.PRIO_PROCESS, thread) < target:
            os.setpriority(os.PRIO_PROCESS, thread, target)
    except OSError:  # a sandbox that forbids it: the reader keeps its priority
        pass


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
    streamed: bool = False  # a part, taken from the process's pass over its row group (``data``: the whole row
    # group's carried chunks where its parts on object storage share them, else None: pages read as decoded)
    retries: int = 0  # reads of the fetch tried again (:func:`loader.contract.sources.retrying`)


def read_unit(index: SourceIndex, unit: int, *, max_seq_len: int | None, skip_corrupt: bool,
              threads: bool = False) -> Chunk:
    """Decode, validate and truncate row group ``unit`` of ``index`` (:func:`fetch_unit`, then :func:`decode_unit`)."""
    return decode_unit(index, fetch_unit(index, unit, skip_corrupt=skip_corrupt), max_seq_len=max_seq_len,
                       skip_corrupt=skip_corrupt, threads=threads)


def fetch_unit(index: SourceIndex, unit: int, *, skip_corrupt: bool) -> RowGroupBytes:
    """The bytes of row group ``unit``'s carried column chunks, in one ranged read (pyarrow releases the GIL).
    A part of a row group on a local disk fetches none: :func:`decode_unit` reads its pages as it decodes them.
    On object storage (up to ``REMOTE_PASS_BYTES``) the parts of a row group share one fetch of the whole row
    group's chunks (:class:`_SharedFetches`): one request, made ahead like any row group's, where reading pages
    as decoded would ask ``REMOTE_BUFFER`` at a time, the decode waiting on each answer."""
    fetched, retries = counting_retries(lambda: _fetch(index, unit, skip_corrupt))
    return replace(fetched, retries=retries)


def _fetch(index: SourceIndex, unit: int, skip_corrupt: bool) -> RowGroupBytes:
    """:func:`fetch_unit`'s work."""
    u = index.units[unit]
    file = index.files[u.file]
    try:
        metadata = file.footer()
        if not u.whole and not file.remote:  # pages read as decoded, in one pass over the row group
            return RowGroupBytes(unit, 0, None, metadata, streamed=True)
        start, stop = _chunk_range(metadata.row_group(u.row_group), set(_names(index)))
        if not u.whole:
            data = None
            if stop - start <= REMOTE_PASS_BYTES:
                data = SHARED_FETCHES.get(_pass_key(index, file, u), first=u.start == 0,
                                          read=lambda: _read_range(file, start, stop)[0])
            return RowGroupBytes(unit, start, data, metadata, file.size, streamed=True)
        data, size = _read_range(file, start, stop)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{file.path}: the file disappeared after the loader indexed it") from exc
    except StorageError:
        raise  # the store did not answer: not a corrupt row group, never skipped
    except _DECODE_ERRORS as exc:
        if skip_corrupt:
            return RowGroupBytes(unit, 0, None, None)
        raise _undecodable(index, unit, exc) from exc
    return RowGroupBytes(unit, start, data, metadata, size)


def _read_range(file: DataFile, start: int, stop: int) -> tuple[pa.Buffer, int]:
    """(bytes ``[start, stop)`` of ``file`` and ``_SLACK`` more where the file has them, the file's size);
    :class:`StorageError` where the storage does not answer (tried again for ``file.retry_s`` s)."""
    return retrying(file.retry_s, lambda: _read_range_once(file, start, stop))


def _read_range_once(file: DataFile, start: int, stop: int) -> tuple[pa.Buffer, int]:
    with file.ranged() as ranged:
        try:
            size = ranged.size()
            if stop <= size:
                return ranged.read(start, min(stop + _SLACK, size) - start), size
        except OSError as exc:
            raise storage_error(file.path, file.filesystem, f"reading bytes {start}-{stop}", exc) from exc
    raise OSError(f"its column chunks end at byte {stop}, past the file's end ({size} bytes)")  # a corrupt footer


class _SharedFetches:
    """Row groups on object storage read in parts, fetched whole once per process for all their parts: the
    first part's fetch reads them, a later part's waits for that read (so no part decodes before the bytes are
    here, and none asks the server again) or takes them while a part or a pass still holds them (they are held
    weakly here); a part that finds neither fetch continues its row group's pass (:mod:`loader.stages.passes`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reading: dict[tuple, threading.Event] = {}
        self.held: weakref.WeakValueDictionary[tuple, pa.Buffer] = weakref.WeakValueDictionary()
        self.pid = os.getpid()

    def get(self, key: tuple, *, first: bool, read: Callable[[], pa.Buffer]) -> pa.Buffer | None:
        """Row group ``key``'s bytes: held ones, the ones being read (None where that read failed), read now by
        the ``first`` part, or None."""
        with self.lock:
            if self.pid != os.getpid():  # a forked child: the parent's reads finish in the parent
                self.reading, self.held, self.pid = {}, weakref.WeakValueDictionary(), os.getpid()
            data, reading = self.held.get(key), self.reading.get(key)
            if data is not None or (reading is None and not first):
                return data
            if reading is None:
                self.reading[key] = threading.Event()
        if reading is not None:
            reading.wait()
            with self.lock:
                return self.held.get(key)
        try:
            data = read()
            with self.lock:
                self.held[key] = data
            return data
        finally:
            with self.lock:
                self.reading.pop(key).set()


SHARED_FETCHES = _SharedFetches()


def decode_unit(index: SourceIndex, fetched: RowGroupBytes, *, max_seq_len: int | None,
                skip_corrupt: bool, sliced: bool = False, threads: bool = False) -> Chunk:
    """Decode, validate and truncate the row group (or part) ``fetched`` holds.

    A whole row group (up to ``PART_BYTES``) is decoded on the calling thread (``use_threads=False``): readers
    run side by side, one row group each, and pyarrow's own thread pool on top of them only adds switching
    (about 10% more CPU); with ``threads`` (a run's first block of one row group, read alone: the first step waits
    for it) on pyarrow's threads, its columns side by side. A part is taken from the pass over its row group
    (:func:`_decode_part`), on pyarrow's threads: the parts of a row group are decoded one after another, so one
    part's decode uses the cores.
    With ``sliced`` (a reader actor, which puts the rows into the object store at once) a part's rows stay the
    slices pyarrow decoded, as a :class:`loader.stages.rows.Sliced`: the one copy they get is the put, not a copy
    into arrays of the whole part first.
    A row group that does not decode raises ValueError naming the file and row group, or with
    ``skip_corrupt`` comes back with every row marked corrupt (counted, never delivered). The chunk counts the
    reads of its fetch and decode that were tried again (``Chunk.retries``).
    """
    chunk, retries = counting_retries(lambda: _decode(index, fetched, max_seq_len, skip_corrupt, sliced, threads))
    chunk.retries = fetched.retries + retries
    return chunk


def _decode(index: SourceIndex, fetched: RowGroupBytes, max_seq_len: int | None, skip_corrupt: bool,
            sliced: bool, threads: bool) -> Chunk:
    """:func:`decode_unit`'s work."""
    unit = fetched.unit
    u = index.units[unit]
    if fetched.data is None and not fetched.streamed:
        return corrupt(u.rows)
    file = index.files[u.file]
    try:
        if fetched.streamed:  # a pass whose reads failed is closed: the part is tried anew on a new one
            slices = retrying(file.retry_s, lambda: _decode_part(index, fetched, file, sliced))
        else:
            parquet = pq.ParquetFile(pa.PythonFile(_RangeFile(fetched.data, fetched.start, fetched.size), mode="r"),
                                     metadata=fetched.metadata)
            slices = [_columns(index, parquet.read_row_group(u.row_group, columns=_names(index), use_threads=threads))]
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"{file.path}: the file disappeared after the loader indexed it") from exc
    except StorageError:
        raise
    except _DECODE_ERRORS as exc:
        if skip_corrupt:
            return corrupt(u.rows)
        raise _undecodable(index, unit, exc) from exc
    rows = sum(len(user_ids) for user_ids, _, _ in slices)
    if rows != u.rows:
        raise ValueError(
            f"{index.describe(unit)}: holds {rows} rows, but its footer said {u.rows} when "
            "the loader was built; the file changed: construct the loader again"
        )
    chunks = [clean(*d, items=index.columns.items, max_seq_len=max_seq_len) for d in slices]
    if len(chunks) == 1:  # a whole row group, a part filled into its arrays, or a part of one slice
        return chunks[0]
    return Chunk(status=np.concatenate([c.status for c in chunks]), rows=Sliced([c.rows for c in chunks]))


Decoded = tuple[np.ndarray, "np.ndarray | None", dict[str, ListColumn]]  # user ids, their null mask, list columns


def _columns(index: SourceIndex, table: pa.Table | pa.RecordBatch) -> Decoded:
    """The carried columns of ``table`` as NumPy (zero-copy where pyarrow's buffers allow)."""
    users = _whole(table.column(index.columns.user)).cast(pa.int64())
    user_null = users.is_null().to_numpy(zero_copy_only=False) if users.null_count else None
    if users.null_count:
        users = users.fill_null(0)
    return _view(users), user_null, {column: _list_column(_whole(table.column(column)), t) for column, t in index.lists}


def _whole(column: pa.ChunkedArray | pa.Array) -> pa.Array:
    """``column`` as one array: its chunk where it has one (``combine_chunks`` copies even a single chunk)."""
    if not isinstance(column, pa.ChunkedArray):
        return column
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


def _decode_part(index: SourceIndex, fetched: RowGroupBytes, file: DataFile, sliced: bool) -> list[Decoded]:
    """Part ``fetched.unit`` of a row group, taken from this process's pass over it (:mod:`loader.stages.passes`;
    a new one from the row group's start where none can reach the part: over the fetched bytes where the part
    brought the row group's, else over the file), ``SLICE_BYTES`` at a time into arrays sized once from the
    footer (rows; the row group's leaf values, which bound a part's events; what the part leaves untouched is
    never resident): one filled :data:`Decoded`, or with ``sliced`` the slices themselves (zero-copy views of
    pyarrow's buffers)."""
    unit, metadata = fetched.unit, fetched.metadata
    u = index.units[unit]
    group = metadata.row_group(u.row_group)
    names = _names(index)
    key = _pass_key(index, file, u)
    run = PASSES.acquire(key, u.start)
    done = True  # unless the part ends before the row group: a failed pass is closed
    try:
        if run.batches is None:  # a new pass
            if fetched.data is not None:
                source = pa.PythonFile(_RangeFile(fetched.data, fetched.start, fetched.size), mode="r")
            elif file.remote:  # a failed read is the store's, not a corrupt page (one more copy of the pages)
                source = file.answering(f"reading the pages of row group {u.row_group}")
            else:  # a local file's pages read without Python in between (about 5% less CPU on 0.5 GB row groups)
                source = file.open()
            parquet = pq.ParquetFile(source, metadata=metadata, pre_buffer=False,
                                     buffer_size=REMOTE_BUFFER if file.remote else STREAM_BUFFER)
            batch_rows = max(1, u.rows * SLICE_BYTES // max(u.nbytes, 1))
            run.open(parquet.iter_batches(batch_size=batch_rows, row_groups=[u.row_group], columns=names,
                                          use_threads=True), source.close)
        out = None if sliced else _filling(index, group, u.rows)
        taken: list[Decoded] = []
        try:
            for _ in run.take(u.start - run.row):  # the rows of earlier parts, where this pass did not take them
                pass
            for batch in run.take(u.rows):
                if out is None:
                    taken.append(_columns(index, batch))
                else:
                    out.add(*_columns(index, batch))
        except ValueError as exc:
            raise ValueError(f"{index.describe(unit)}: its row group {exc}; the file changed: construct the "
                             "loader again") from None
        done = run.row >= group.num_rows
        return taken if out is None else [out.result()]
    finally:
        PASSES.release(key, run, done=done)


def _filling(index: SourceIndex, group: pq.RowGroupMetaData, rows: int) -> _Filling:
    """Arrays for a part of ``rows`` rows of row group ``group``, a list column's values sized from its leaf count."""
    leaves = {chunk.path_in_schema.split(".", 1)[0]: chunk.num_values
              for chunk in carried_chunks(group, {column for column, _ in index.lists})}
    return _Filling(rows, {column: (leaves.get(column, 0), np.dtype(t.to_pandas_dtype())) for column, t in index.lists})


class _Filling:
    """A part's carried columns filled slice by slice into arrays allocated once: ``rows`` rows, and a list
    column's values sized from its ``leaves`` (a footer's leaf count bounds its events); grown should a footer
    undercount (the row count is checked after)."""

    def __init__(self, rows: int, lists: dict[str, tuple[int, np.dtype]]) -> None:
        self.n = 0
        self.user_ids = np.empty(rows, dtype=np.int64)
        self.user_null: np.ndarray | None = None
        self.lists = {column: _ListFilling(rows, leaves, dtype) for column, (leaves, dtype) in lists.items()}

    def add(self, user_ids: np.ndarray, user_null: np.ndarray | None, lists: dict[str, ListColumn]) -> None:
        start, self.n = self.n, self.n + len(user_ids)
        self.user_ids = _fit(self.user_ids, self.n)
        self.user_ids[start : self.n] = user_ids
        self.user_null = _put_mask(self.user_null, user_null, start, len(self.user_ids))
        for column, filling in self.lists.items():
            filling.add(start, lists[column])

    def result(self) -> Decoded:
        n = self.n
        return (self.user_ids[:n], None if self.user_null is None else self.user_null[:n],
                {column: filling.result(n) for column, filling in self.lists.items()})


class _ListFilling:
    """One list column of :class:`_Filling`: offsets from 0, values packed."""

    def __init__(self, rows: int, leaves: int, dtype: np.dtype) -> None:
        self.offsets = np.zeros(rows + 1, dtype=np.int64)
        self.values = np.empty(leaves, dtype=dtype)
        self.events = 0
        self.row_null: np.ndarray | None = None
        self.event_null: np.ndarray | None = None

    def add(self, start: int, column: ListColumn) -> None:
        rows = len(column.offsets) - 1
        first, last = int(column.offsets[0]), int(column.offsets[-1])
        at, self.events = self.events, self.events + last - first
        self.offsets = _fit(self.offsets, start + rows + 1)
        np.add(column.offsets[1:], at - first, out=self.offsets[start + 1 : start + rows + 1])
        self.values = _fit(self.values, self.events)
        self.values[at : self.events] = column.values[first:last]
        self.row_null = _put_mask(self.row_null, column.row_null, start, len(self.offsets) - 1)
        event_null = None if column.event_null is None else column.event_null[first:last]
        self.event_null = _put_mask(self.event_null, event_null, at, len(self.values))

    def result(self, rows: int) -> ListColumn:
        return ListColumn(self.offsets[: rows + 1], self.values[: self.events],
                          None if self.row_null is None else self.row_null[:rows],
                          None if self.event_null is None else self.event_null[: self.events])


def _fit(array: np.ndarray, size: int) -> np.ndarray:
    """``array``, or a copy at least ``size`` long (doubling; the new tail zeroed) where it is shorter."""
    if len(array) >= size:
        return array
    grown = np.zeros(max(size, 2 * len(array)), dtype=array.dtype)
    grown[: len(array)] = array
    return grown


def _put_mask(mask: np.ndarray | None, part: np.ndarray | None, start: int, size: int) -> np.ndarray | None:
    """``mask`` (bool, at least ``size`` long once made) with ``part`` written at ``start``; made on the first
    part that has one (all False before it)."""
    if part is None:
        return mask if mask is None else _fit(mask, size)
    mask = np.zeros(size, dtype=bool) if mask is None else _fit(mask, size)
    mask[start : start + len(part)] = part
    return mask


def _names(index: SourceIndex) -> list[str]:
    return [index.columns.user, *(column for column, _ in index.lists)]


def _pass_key(index: SourceIndex, file: DataFile, u: Unit) -> tuple:
    """What a row group read in parts is known by in this process (:data:`PASSES`, :data:`SHARED_FETCHES`)."""
    return file.filesystem.type_name, file.path, file.size, u.row_group, tuple(_names(index))


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
        f"{index.describe(unit)}: cannot be decoded ({one_line(exc)}); the file is corrupt: replace it, or "
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



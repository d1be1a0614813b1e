"""Resolve a dataset source into an index of Parquet row groups, from the file footers alone.

``source`` is a file, a directory (its ``.parquet``/``.pq`` files, recursively, hidden ``.``/``_``
entries skipped), a glob (``*``, ``?``, ``[...]`` within one path component) or a list of them, each
a local path or a pyarrow filesystem URI (``file:///data``, ``s3://bucket/prefix``; a URI's query
string is the filesystem's options: ``s3://bucket/prefix?endpoint_override=host:port&scheme=http``
for an S3-compatible server). Files are read in the given order (directory and glob matches sorted),
each file once.

The index lists every row group as a :class:`Unit` (file, row group, rows): the unit of reading,
of shuffling and of ownership by reader actors. A row group decoding to more than ``PART_BYTES`` is listed
as several units, its *parts*: consecutive row ranges of about ``PART_BYTES`` each, so that a shuffle block
(and the memory a loader holds) need not be a whole row group (docs/loader.md, "Row groups in parts").
Every file's schema is checked against the data contract here, before any work; every file must carry the
same event columns as the first.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from loader.contract.schema import Columns, type_name, validate_schema

PARQUET_SUFFIXES = (".parquet", ".pq")
_WILDCARDS = "*?["
_FOOTER_THREADS = 16
PART_BYTES = 128 << 20  # a row group decoding to more than this is listed as parts of about this many bytes


class StorageError(OSError):
    """Reading a file's bytes failed: the storage holding it refused or did not answer (on object storage, after
    pyarrow's own retries). Never taken for a corrupt file: ``skip_corrupt`` does not skip it, so an outage of the
    store cannot turn into rows skipped."""


def storage_error(path: str, filesystem: pafs.FileSystem, what: str, exc: BaseException) -> StorageError:
    """The :class:`StorageError` of ``what`` (e.g. "reading its footer") on ``path`` of ``filesystem``, raised by
    ``exc``."""
    where = "local disk" if filesystem.type_name == "local" else f"{filesystem.type_name} storage"
    return StorageError(f"{path}: {what} from {where} failed ({one_line(exc)}); the storage refused or did not "
                        "answer: check its endpoint, credentials, network or permissions, then construct the loader "
                        "again, or load the last saved state (SequenceLoader.load_state_dict); no rows were skipped")


_LOG = logging.getLogger(__name__)
_T = TypeVar("_T")
RETRY_PAUSES = (0.25, 8.0)  # the first pause between tries of a read the storage did not answer, and the longest


class _Tally(threading.local):
    retries = 0  # reads this thread tried again (:func:`retrying`)


_TALLY = _Tally()


def retrying(seconds: float, attempt: Callable[[], _T]) -> _T:
    """``attempt()``; tried again while it raises :class:`StorageError`, after pauses doubling from
    ``RETRY_PAUSES[0]`` to ``RETRY_PAUSES[1]`` s, each logged as a warning and counted (:func:`counting_retries`),
    until ``seconds`` have passed since its first failure: then its last StorageError, saying how long it was tried.
    Reads are pure: a read tried again gives the same bytes, so the rows and their order never depend on it.
    ``seconds`` 0: tried once."""
    pause, first = RETRY_PAUSES[0], None
    tries = 0
    while True:
        try:
            return attempt()
        except StorageError as exc:
            tries += 1
            now = time.monotonic()
            first = now if first is None else first
            if now + pause > first + seconds:
                if tries == 1:
                    raise
                raise StorageError(f"{exc} (tried {tries} times over {now - first:.0f} s: storage_retry_s="
                                   f"{seconds:g})") from exc
            _LOG.warning("%s; trying again in %.2f s (storage_retry_s=%g)", exc, pause, seconds)
            _TALLY.retries += 1
            time.sleep(pause)
            pause = min(2 * pause, RETRY_PAUSES[1])


def counting_retries(work: Callable[[], _T]) -> tuple[_T, int]:
    """``work()`` and how many reads :func:`retrying` tried again on this thread while it ran (what a row group's
    meta and the index carry to ``stats()["storage_retries"]``)."""
    before = _TALLY.retries
    result = work()
    return result, _TALLY.retries - before


class _Answering:
    """A pyarrow input stream as a Python file for ``pa.PythonFile``: its read errors raise :class:`StorageError`
    (``what``: what the reads are for), so a parse that fails on bytes read (a corrupt footer or page) is told
    apart from a read that failed. Reads hand pyarrow the stream's own buffers (no bytes object); closing it closes
    the stream where it was opened for it (``owned``)."""

    def __init__(self, file: DataFile, stream, what: str, *, owned: bool) -> None:
        self.file, self.stream, self.what, self.owned, self.closed = file, stream, what, owned, False

    def read_buffer(self, nbytes: int = -1) -> pa.Buffer:
        try:
            return self.stream.read_buffer(None if nbytes < 0 else nbytes)
        except OSError as exc:
            raise storage_error(self.file.path, self.file.filesystem, self.what, exc) from exc

    def read(self, nbytes: int = -1) -> pa.Buffer:  # pyarrow copies it where it reads into its own buffer
        return self.read_buffer(nbytes)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.stream.seek(offset, whence)

    def tell(self) -> int:
        return self.stream.tell()

    def size(self) -> int:
        return self.stream.size()

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        if self.owned and not self.closed:
            self.stream.close()
        self.closed = True


@dataclass(frozen=True)
class DataFile:
    """One Parquet file and the filesystem that holds it; ``size`` in bytes once its footer was read
    (:func:`index_source`), None before; ``retry_s``: how long a read of it that the storage refused or did not
    answer is tried again (:func:`retrying`; ``LoaderConfig.storage_retry_s``)."""

    path: str
    filesystem: pafs.FileSystem
    size: int | None = None
    retry_s: float = 0.0

    def open(self):
        """The file as a pyarrow input stream; :class:`StorageError` where the storage does not answer."""
        try:
            return self.filesystem.open_input_file(self.path)
        except FileNotFoundError:
            raise
        except OSError as exc:
            raise storage_error(self.path, self.filesystem, "opening it", exc) from exc

    @contextlib.contextmanager
    def ranged(self) -> Iterator[_Seeking]:
        """The file open for reads of byte ranges (``size()``, ``read(start, nbytes)``); OSError where a read fails.
        A local file is opened for the context. On object storage, this process's open handle of the file, kept for
        the next reads (:class:`_OpenFiles`): opening an object asks the store for its size (a HEAD request: to
        moto's server about half the CPU of the ranged GET of a 7 MB row group that follows, docs/benchmarks.md), so
        each fetch would cost two requests; kept open, one. Threads share it (:class:`_Positional`); a read that
        fails drops it, and the next read opens the file anew."""
        if not self.remote:
            with self.open() as stream:
                yield _Seeking(stream)
            return
        shared = OPEN_FILES.get(self)
        try:
            yield shared
        except OSError:
            OPEN_FILES.drop(self, shared)
            raise

    def answering(self, what: str, stream=None) -> pa.PythonFile:
        """The file (or ``stream``, its already open input stream, left open) for a parser: a read that fails
        raises :class:`StorageError` naming ``what`` was read, where the parser's own error would call the file
        corrupt."""
        owned = stream is None
        return pa.PythonFile(_Answering(self, self.open() if owned else stream, what, owned=owned), mode="r")

    @property
    def remote(self) -> bool:
        """Whether the file lies on another filesystem than this machine's (object storage): worth fetching
        ahead while another row group decodes."""
        return self.filesystem.type_name != "local"

    def footer(self, stream=None) -> pq.FileMetaData:
        """The file's Parquet footer, read once per process and file version (path and size) while recently
        used: a reader of many row groups of one file asks object storage for its footer once. ``stream``:
        the file already open, to read it from on a miss."""
        key = (self.filesystem.type_name, self.path, self.size)
        with _footer_lock:
            if key in _footers:
                _footers.move_to_end(key)
                return _footers[key]
        if stream is None:  # its own open and read, tried again as one
            metadata = retrying(self.retry_s, lambda: self._parsed_footer(None))
        else:
            metadata = self._parsed_footer(stream)
        with _footer_lock:
            _footers[key] = metadata
            while len(_footers) > _FOOTERS:
                _footers.popitem(last=False)
        return metadata

    def _parsed_footer(self, stream) -> pq.FileMetaData:
        with self.answering("reading its footer", stream) as answering:
            return pq.ParquetFile(answering).metadata


class _Seeking:
    """A file open for reads of byte ranges by one thread at a time: a seek, then a read into pyarrow's memory
    pool."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def size(self) -> int:
        return self.stream.size()

    def read(self, start: int, nbytes: int) -> pa.Buffer:
        self.stream.seek(start)
        return self.stream.read_buffer(nbytes)


class _Positional(_Seeking):
    """An object-storage file shared by threads, one ranged GET a read. A read seeks and reads into pyarrow's memory
    pool where no other thread is reading the handle; one that finds it busy reads at its offset (``read_at``), which
    moves no position but lands in a new Python ``bytes``: its pages are fresh to the process, a 4 KiB page fault
    each (240k per GB, 0.2-0.5 client CPU-s: docs/benchmarks.md, thirty-third session), where the pool's are reused."""

    def __init__(self, stream) -> None:
        super().__init__(stream)
        self.seeking = threading.Lock()

    def read(self, start: int, nbytes: int) -> pa.Buffer:
        if self.seeking.acquire(blocking=False):
            try:
                return super().read(start, nbytes)
            finally:
                self.seeking.release()
        return pa.py_buffer(self.stream.read_at(nbytes, start))


class _OpenFiles:
    """Files on object storage kept open per process for ranged reads (:meth:`DataFile.ranged`), the most recently
    used ``_OPEN_FILES``, by path and size, each with the filesystem it was opened on: a file asked on an equal
    filesystem (the same store and options: a reader actor unpickles the index's filesystem with every read) takes the
    open one, so a file is opened (one HEAD request) once per process, not once per row group. A forked child opens
    its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.files: OrderedDict[tuple, tuple[pafs.FileSystem, _Positional]] = OrderedDict()
        self.opening: dict[tuple, threading.Lock] = {}  # key -> held while a thread opens the file
        self.pid = os.getpid()

    def get(self, file: DataFile) -> _Positional:
        """``file`` open, shared by this process's threads; opened here where it is not (threads asking meanwhile
        wait for it)."""
        key = (file.filesystem.type_name, file.path, file.size)
        with self.lock:
            if self.pid != os.getpid():
                self.files, self.opening, self.pid = OrderedDict(), {}, os.getpid()
            opening = self.opening.setdefault(key, threading.Lock())
        with opening:  # not under self.lock: a slow store holds up no other file's reads
            with self.lock:
                held = self.files.get(key)
                if held is not None and held[0].equals(file.filesystem):
                    self.files.move_to_end(key)
                    return held[1]
            try:
                handle = _Positional(file.open())
            finally:
                with self.lock:
                    self.opening.pop(key, None)
            with self.lock:
                self.files[key] = (file.filesystem, handle)
                self.files.move_to_end(key)
                while len(self.files) > _OPEN_FILES:  # dropped, not closed: a read on another thread may use it
                    self.files.popitem(last=False)
            return handle

    def drop(self, file: DataFile, handle: _Positional) -> None:
        """Forget ``handle`` of ``file`` (a read on it failed), unless another has taken its place."""
        key = (file.filesystem.type_name, file.path, file.size)
        with self.lock:
            if key in self.files and self.files[key][1] is handle:
                del self.files[key]


_OPEN_FILES = 64  # files on object storage kept open per process
OPEN_FILES = _OpenFiles()
_FOOTERS = 256  # file footers kept per process
_footer_lock = threading.Lock()
_footers: OrderedDict[tuple, pq.FileMetaData] = OrderedDict()


@dataclass(frozen=True)
class Unit:
    """Rows ``start .. start + rows - 1`` of row group ``row_group`` of file ``file`` (an index into
    ``SourceIndex.files``): the whole row group, or part ``part`` of its ``parts``; ``nbytes``: the uncompressed
    size of those rows' carried columns, from the footer (about what they decode to; a part's share)."""

    file: int
    row_group: int
    rows: int
    nbytes: int = 0
    start: int = 0
    part: int = 0
    parts: int = 1

    @property
    def whole(self) -> bool:
        return self.parts == 1


def split_row_group(file: int, row_group: int, rows: int, nbytes: int) -> list[Unit]:
    """Row group ``row_group`` as units: whole up to ``PART_BYTES``, else in parts of about ``PART_BYTES``
    (equal row counts, the first ones a row longer; one row per part at most)."""
    parts = max(1, min(rows, -(-nbytes // PART_BYTES)))
    if parts == 1:
        return [Unit(file, row_group, rows, nbytes)]
    size, extra = divmod(rows, parts)
    counts = [size + (p < extra) for p in range(parts)]
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    return [Unit(file, row_group, n, nbytes * n // rows, start, p, parts)
            for p, (start, n) in enumerate(zip(starts, counts))]


@dataclass(frozen=True)
class SourceIndex:
    """Every readable row group of a source, and what each row carries.

    ``lists`` are the list columns the loader carries, as (file column, Arrow value type): the
    items column first, then the timestamps column if the files have it, then per-event features.
    ``skipped_files`` lists (path, reason) of corrupt files left out under ``skip_corrupt``; ``storage_retries``
    counts the reads of the listing and the footers that were tried again (:func:`retrying`).
    """

    files: tuple[DataFile, ...]
    units: tuple[Unit, ...]
    columns: Columns
    lists: tuple[tuple[str, pa.DataType], ...]
    skipped_files: tuple[tuple[str, str], ...]
    storage_retries: int = 0

    @property
    def rows(self) -> int:
        return sum(u.rows for u in self.units)

    @property
    def groups(self) -> np.ndarray:
        """The row group of each unit as consecutive ids from 0, int64 (U,): a row group's parts share one."""
        keys = [(u.file, u.row_group) for u in self.units]
        first = np.array([i == 0 or key != keys[i - 1] for i, key in enumerate(keys)], dtype=bool)
        return np.cumsum(first).astype(np.int64) - 1

    @property
    def timestamps(self) -> str | None:
        """The timestamps column, if the files carry one."""
        return self.columns.timestamps if self.columns.timestamps in dict(self.lists) else None

    @property
    def roles(self) -> tuple[dict[str, np.dtype], str, str | None]:
        """(dtype of every carried event column, the items column, the timestamps column or None)."""
        dtypes = {column: np.dtype(t.to_pandas_dtype()) for column, t in self.lists}
        return dtypes, self.columns.items, self.timestamps

    def only(self, unit: int) -> SourceIndex:
        """An index of row group ``unit`` alone (as its unit 0): all a reader needs to read it, a
        few hundred bytes however large the source."""
        u = self.units[unit]
        return replace(self, files=(self.files[u.file],), units=(replace(u, file=0),), skipped_files=())

    def describe(self, unit: int) -> str:
        """``path (row group g)`` (or ``path (row group g, rows a-b)`` for a part) for messages."""
        u = self.units[unit]
        rows = "" if u.whole else f", rows {u.start}-{u.start + u.rows - 1}"
        return f"{self.files[u.file].path} (row group {u.row_group}{rows})"


def index_source(source, *, columns: Columns = Columns(), skip_corrupt: bool = False,
                 storage_retry_s: float = 0.0) -> SourceIndex:
    """Resolve ``source``, read every footer and check every schema; see the module docstring. Reads the storage
    refused or did not answer, here and by the readers of the index's files, are tried again for
    ``storage_retry_s`` seconds (``LoaderConfig.storage_retry_s``).

    Raises FileNotFoundError for a path that matches nothing, ValueError naming the file (and the
    column) for a corrupt file (unless ``skip_corrupt``) or a schema that breaks the contract.
    """
    files, retries = counting_retries(lambda: resolve(source, storage_retry_s))
    with ThreadPoolExecutor(max_workers=min(_FOOTER_THREADS, len(files))) as pool:
        footers = []
        for footer, tried in pool.map(lambda file: counting_retries(lambda: _read_footer(file)), files):
            footers.append(footer)
            retries += tried
    units: list[Unit] = []
    skipped: list[tuple[str, str]] = []
    kept: list[DataFile] = []
    reference: tuple[str, dict[str, pa.DataType]] | None = None
    for file, footer in zip(files, footers):
        if isinstance(footer, Exception):
            if not skip_corrupt:
                raise ValueError(
                    f"{file.path}: not a readable Parquet file ({one_line(footer)}); replace the file, or pass "
                    "skip_corrupt=True to skip it and count it in stats()['files_skipped']"
                ) from footer
            skipped.append((file.path, f"corrupt file: {one_line(footer)}"))
            continue
        file, schema, row_counts = footer
        carried = _carried_columns(schema, file.path, columns)
        if reference is None:
            reference = (file.path, carried)
        _check_same_columns(file.path, carried, *reference)
        sizes = _carried_bytes(file.footer(), {columns.user, *carried})
        for group, rows in enumerate(row_counts):
            units.extend(split_row_group(len(kept), group, rows, sizes[group]))
        kept.append(file)
    if reference is None:
        raise ValueError(
            f"{source}: none of its {len(files)} Parquet file(s) is readable; every one is corrupt"
        )
    return SourceIndex(tuple(kept), tuple(units), columns, tuple(reference[1].items()), tuple(skipped), retries)


def resolve(source, retry_s: float = 0.0) -> list[DataFile]:
    """The Parquet files named by ``source``, in reading order, without repeats; a listing the storage did not
    answer tried again for ``retry_s`` seconds (:func:`retrying`), the files' own reads as long."""
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not items:
        raise ValueError("source is an empty list; pass a file, a directory, a glob or a list of them")
    files: list[DataFile] = []
    seen: set[tuple[str, str]] = set()
    for item in items:
        if not isinstance(item, (str, os.PathLike)):
            raise ValueError(f"source entries must be paths or URIs, got {type(item).__name__}: {item!r}")
        for file in retrying(retry_s, lambda: _resolve_one(os.fspath(item))):
            key = (file.filesystem.type_name, file.path)
            if key not in seen:
                seen.add(key)
                files.append(replace(file, retry_s=retry_s))
    return files


def _resolve_one(text: str) -> list[DataFile]:
    text, query = _split_query(text)
    wild = next((i for i, ch in enumerate(text) if ch in _WILDCARDS), None)
    if wild is not None:
        base_end = text.rfind("/", 0, wild)
        base, pattern = (text[:base_end], text[base_end + 1 :]) if base_end >= 0 else (".", text)
        filesystem, base_path = _filesystem((base or "/") + query)
        with _listing(text, filesystem):
            return [DataFile(p, filesystem) for p in _glob(filesystem, base_path, pattern, text)]
    filesystem, path = _filesystem(text + query)
    with _listing(text, filesystem):
        return _listed(filesystem, path, text)


@contextlib.contextmanager
def _listing(text: str, filesystem: pafs.FileSystem):
    """Listing ``text`` (a path, a glob; without its query, which may hold credentials): a failed listing is a
    :class:`StorageError`."""
    try:
        yield
    except (FileNotFoundError, StorageError):
        raise
    except OSError as exc:
        raise storage_error(text, filesystem, "listing it", exc) from exc


def _listed(filesystem: pafs.FileSystem, path: str, text: str) -> list[DataFile]:
    """The file ``path``, or the Parquet files under the directory ``path`` (``text`` as the user wrote it)."""
    info = filesystem.get_file_info(path)
    if info.type == pafs.FileType.NotFound:
        raise FileNotFoundError(f"{text}: no such file or directory")
    if info.type == pafs.FileType.File:
        return [DataFile(path, filesystem)]
    selector = pafs.FileSelector(path, recursive=True)
    found = sorted(
        i.path
        for i in filesystem.get_file_info(selector)
        if i.type == pafs.FileType.File
        and i.path.lower().endswith(PARQUET_SUFFIXES)
        and not _hidden(i.path[len(path) :])
    )
    if not found:
        raise FileNotFoundError(f"{text}: directory holds no .parquet or .pq files")
    return [DataFile(p, filesystem) for p in found]


def _split_query(text: str) -> tuple[str, str]:
    """A URI's path and its query (``"?endpoint_override=...&scheme=http"``: the filesystem's options, as pyarrow
    reads them), so that the query's ``?`` is not taken for a wildcard; ``(text, "")`` for anything else."""
    if "://" not in text or "?" not in text:
        return text, ""
    path, query = text.rsplit("?", 1)
    if all("=" in option for option in query.split("&")):
        return path, "?" + query
    return text, ""


def _filesystem(text: str) -> tuple[pafs.FileSystem, str]:
    if "://" in text:
        try:
            return pafs.FileSystem.from_uri(text)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
            raise ValueError(f"{text}: not a filesystem URI pyarrow can open ({exc})") from exc
    return pafs.LocalFileSystem(), os.path.abspath(text)


def _glob(filesystem: pafs.FileSystem, base: str, pattern: str, text: str) -> list[str]:
    """Files under ``base`` whose path below it matches ``pattern`` component by component."""
    parts = pattern.split("/")
    info = filesystem.get_file_info(base)
    if info.type != pafs.FileType.Directory:
        raise FileNotFoundError(f"{text}: no files match this pattern ({base} is not a directory)")
    selector = pafs.FileSelector(base, recursive=len(parts) > 1)
    matches = []
    for entry in filesystem.get_file_info(selector):
        rel = entry.path[len(base.rstrip("/")) + 1 :].split("/")
        if (
            entry.type == pafs.FileType.File
            and len(rel) == len(parts)
            and all(fnmatch.fnmatchcase(r, p) for r, p in zip(rel, parts))
        ):
            matches.append(entry.path)
    if not matches:
        raise FileNotFoundError(f"{text}: no files match this pattern")
    return sorted(matches)


def _hidden(relative: str) -> bool:
    return any(part.startswith((".", "_")) for part in relative.split("/") if part)


def _read_footer(file: DataFile) -> tuple[DataFile, pa.Schema, list[int]] | Exception:
    """(the file with its size, schema, rows per row group), or the exception a corrupt footer raised.
    The footer stays in this process's cache (:meth:`DataFile.footer`) for the reads that follow."""
    def read() -> tuple[DataFile, pq.FileMetaData]:
        with file.open() as stream:  # one open (on object storage: one HEAD)
            sized = replace(file, size=stream.size())
            return sized, sized.footer(stream)

    try:
        file, metadata = retrying(file.retry_s, read)
        schema = metadata.schema.to_arrow_schema()
        return file, schema, [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
    except (FileNotFoundError, StorageError):
        raise
    except (pa.ArrowException, OSError) as exc:  # bad magic bytes, truncated or garbled thrift
        return exc


def carried_chunks(group: pq.RowGroupMetaData, names: set[str]) -> list[pq.ColumnChunkMetaData]:
    """The column chunks of ``group`` whose top-level column is in ``names``."""
    chunks = (group.column(j) for j in range(group.num_columns))
    return [chunk for chunk in chunks if chunk.path_in_schema.split(".", 1)[0] in names]


def _carried_bytes(metadata: pq.FileMetaData, names: set[str]) -> list[int]:
    """Uncompressed bytes of the column chunks of ``names`` (top-level columns) in each row group."""
    return [sum(chunk.total_uncompressed_size for chunk in carried_chunks(metadata.row_group(g), names))
            for g in range(metadata.num_row_groups)]


def _carried_columns(schema: pa.Schema, path: str, columns: Columns) -> dict[str, pa.DataType]:
    """File column -> Arrow value type of every list column the loader carries, items first."""
    features = validate_schema(schema, path, columns)
    carried = {columns.items: pa.int64()}
    if columns.timestamps is not None and columns.timestamps in schema.names:
        carried[columns.timestamps] = pa.int64()
    for name in features:
        carried[name] = schema.field(name).type.value_type
    return carried


def _check_same_columns(
    path: str, carried: dict[str, pa.DataType], ref_path: str, reference: dict[str, pa.DataType]
) -> None:
    for name, value_type in reference.items():
        if name not in carried:
            raise ValueError(
                f"{path}: column {name!r} is missing, but {ref_path} has it; every file of a source "
                "must carry the same list columns (rewrite the file, or leave it out of the source)"
            )
        if carried[name] != value_type:
            raise ValueError(
                f"{path}: column {name!r} has values of type {type_name(carried[name])}, but "
                f"{ref_path} has {type_name(value_type)}; write every file with the same types"
            )
    for name in carried.keys() - reference.keys():
        raise ValueError(
            f"{path}: column {name!r} is not in {ref_path}; every file of a source must carry the "
            "same list columns (rewrite the file, or leave it out of the source)"
        )



def one_line(exc: BaseException) -> str:
    """An exception's message on one line."""
    return " ".join(str(exc).split())

"""Sources: files, directories, globs, lists and URIs resolved to row groups; bad files named."""

import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from loader.contract import sources
from loader.contract.schema import Columns
from loader.contract.sources import StorageError, index_source, resolve

from .helpers import synth


def _write(path, table, **kwargs):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, **kwargs)
    return path


def _table(n=4, **extra):
    columns = {"user_id": list(range(n)), "item_ids": [[1, 2]] * n, **extra}
    return pa.table(columns)


def test_directory_glob_list_and_uri(tmp_path):
    data = synth(tmp_path / "d", users=60, files=3, rows_per_group=7)
    _write(tmp_path / "d" / "_tmp" / "junk.parquet", _table())  # hidden: skipped
    (tmp_path / "d" / "notes.txt").write_text("not data")
    parts = sorted(str(p) for p in data.glob("part-*.parquet"))
    assert [f.path for f in resolve(data)] == parts
    assert [f.path for f in resolve(str(data / "part-*.parquet"))] == parts
    assert [f.path for f in resolve([parts[2], str(data / "part-0000[01].parquet"), parts[2]])] == [parts[2], *parts[:2]]
    assert [f.path for f in resolve(f"file://{data}")] == parts
    assert [f.path for f in resolve(f"file://{data}/part-*.parquet")] == parts
    index = index_source(data)
    assert index.rows == 60 and sum(u.rows for u in index.units) == 60
    assert [u.rows for u in index.units] == [
        pq.ParquetFile(p).metadata.row_group(g).num_rows for p in parts for g in range(pq.ParquetFile(p).num_row_groups)
    ]
    assert [column for column, _ in index.lists] == ["item_ids", "timestamps", "ratings"]
    assert index.timestamps == "timestamps" and index_source(data, columns=Columns(timestamps=None)).timestamps is None


def test_missing_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope: no such file or directory"):
        resolve(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty: directory holds no \.parquet"):
        resolve(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no files match this pattern"):
        resolve(str(tmp_path / "empty" / "*.parquet"))
    with pytest.raises(ValueError, match="source is an empty list"):
        resolve([])
    with pytest.raises(ValueError, match="source entries must be paths or URIs, got int"):
        resolve([3])


def test_missing_and_mistyped_columns_name_file_and_column(tmp_path):
    bad = _write(tmp_path / "a" / "x.parquet", pa.table({"user_id": [1], "items": [[1, 2]]}))
    with pytest.raises(ValueError, match=rf"{bad}: required column 'item_ids' \(item ids\) is missing"):
        index_source(bad)
    assert index_source(bad, columns=Columns(items="items")).rows == 1
    bad = _write(tmp_path / "b" / "x.parquet", _table(item_ids=[["a"]] * 4))
    with pytest.raises(ValueError, match=rf"{bad}: column 'item_ids' has type list<string>, expected list<int64>"):
        index_source(bad)
    bad = _write(tmp_path / "c" / "x.parquet", _table(user_id=[0.5, 1.5, 2.5, 3.5]))
    with pytest.raises(ValueError, match=rf"{bad}: column 'user_id' has type double"):
        index_source(bad)


def test_files_must_carry_the_same_columns(tmp_path):
    first = _write(tmp_path / "a" / "0.parquet", _table(timestamps=[[1, 2]] * 4))
    second = _write(tmp_path / "a" / "1.parquet", _table())
    with pytest.raises(ValueError, match=rf"{second}: column 'timestamps' is missing, but {first} has it"):
        index_source(tmp_path / "a")
    _write(tmp_path / "b" / "0.parquet", _table(rating=pa.array([[1.0, 2.0]] * 4, pa.list_(pa.float32()))))
    other = _write(tmp_path / "b" / "1.parquet", _table(rating=pa.array([[1.0, 2.0]] * 4, pa.list_(pa.float64()))))
    with pytest.raises(ValueError, match=rf"{other}: column 'rating' has values of type double, but .* has float"):
        index_source(tmp_path / "b")
    _write(tmp_path / "c" / "0.parquet", _table())
    extra = _write(tmp_path / "c" / "1.parquet", _table(rating=[[1, 2]] * 4))
    with pytest.raises(ValueError, match=rf"{extra}: column 'rating' is not in"):
        index_source(tmp_path / "c")


def test_corrupt_file_is_named_or_skipped_and_counted(tmp_path):
    data = synth(tmp_path / "d", users=50, files=2)
    broken = tmp_path / "d" / "part-00001.parquet"
    broken.write_bytes(broken.read_bytes()[:-30])  # the footer is gone
    with pytest.raises(ValueError, match=rf"{broken}: not a readable Parquet file .*skip_corrupt=True"):
        index_source(data)
    index = index_source(data, skip_corrupt=True)
    assert [path for path, _ in index.skipped_files] == [str(broken)]
    assert index.rows == pq.ParquetFile(tmp_path / "d" / "part-00000.parquet").metadata.num_rows
    (tmp_path / "d" / "part-00000.parquet").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="none of its 2 Parquet file"):
        index_source(data, skip_corrupt=True)


def test_units_carry_the_decoded_size_of_their_carried_columns_and_bound_the_read_ahead(tmp_path, monkeypatch):
    from loader.stages import decode

    table = _table(6, timestamps=[[5, 6]] * 6, notes=["x" * 500] * 6)  # notes: not a list column, not carried
    path = _write(tmp_path / "a.parquet", table, row_group_size=3)
    index = index_source(path)
    meta = pq.ParquetFile(path).metadata
    for unit in index.units:
        group = meta.row_group(unit.row_group)
        carried = [group.column(j) for j in range(group.num_columns)
                   if group.column(j).path_in_schema.split(".")[0] != "notes"]
        assert unit.nbytes == sum(c.total_uncompressed_size for c in carried) > 0
        assert index.only(index.units.index(unit)).units[0].nbytes == unit.nbytes
    largest = max(u.nbytes for u in index.units)
    assert decode.readahead_units(index, 2) == 4  # small row groups: two per reader
    monkeypatch.setattr(decode, "READ_AHEAD_BYTES", 3 * largest)
    assert decode.readahead_units(index, 2) == 3
    monkeypatch.setattr(decode, "READ_AHEAD_BYTES", largest // 2)
    assert decode.readahead_units(index, 2) == 1  # at least one


class _Clock:
    """A stand-in for the ``time`` module in :mod:`loader.contract.sources`: sleeping advances it."""

    def __init__(self) -> None:
        self.now, self.pauses = 100.0, []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        self.now += seconds


def _failing(times: int, clock: _Clock, spent: float = 6.0):
    """An attempt that fails with a StorageError ``times`` times (each spending ``spent`` s, as pyarrow's own
    retries do), then returns "bytes"; ``calls`` counts the tries."""
    calls = []

    def attempt():
        calls.append(clock.now)
        if len(calls) <= times:
            clock.now += spent
            raise StorageError(f"x.parquet: reading bytes 0-10 from s3 storage failed (try {len(calls)})")
        return "bytes"

    return attempt, calls


def test_a_read_the_storage_did_not_answer_is_tried_again_until_storage_retry_s(monkeypatch, caplog):
    clock = _Clock()
    monkeypatch.setattr(sources, "time", clock)
    attempt, calls = _failing(3, clock)
    with caplog.at_level("WARNING", logger="loader.contract.sources"):  # a brief outage passes, counted
        assert sources.counting_retries(lambda: sources.retrying(30.0, attempt)) == ("bytes", 3)
    assert len(calls) == 4 and clock.pauses == [0.25, 0.5, 1.0]
    assert [r.getMessage() for r in caplog.records] == [
        f"x.parquet: reading bytes 0-10 from s3 storage failed (try {i}); trying again in {p:.2f} s "
        "(storage_retry_s=30)" for i, p in [(1, 0.25), (2, 0.5), (3, 1.0)]]

    attempt, calls = _failing(100, clock)  # a lasting one: the last error, saying how long it was tried
    with pytest.raises(StorageError, match=r"failed \(try 4\) \(tried 4 times over 20 s: storage_retry_s=20\)"):
        sources.retrying(20.0, attempt)
    assert clock.pauses[3:] == [0.25, 0.5, 1.0]  # the fourth failure comes 19.75 s after the first: no room for 2 s

    attempt, calls = _failing(1, clock)
    with pytest.raises(StorageError, match=r"failed \(try 1\)$"):  # 0: tried once, the error as it was
        sources.retrying(0.0, attempt)
    assert len(calls) == 1 and len(clock.pauses) == 6

    def corrupt():
        calls.append(1)
        raise ValueError("not a storage failure")

    calls.clear()
    with pytest.raises(ValueError):  # only what the storage did not answer is tried again
        sources.retrying(30.0, corrupt)
    assert calls == [1]


def test_every_file_of_an_index_carries_the_storage_retry_time(tmp_path):
    data = synth(tmp_path / "d", users=30, files=2, rows_per_group=7)
    assert {f.retry_s for f in index_source(data).files} == {0.0}
    index = index_source(data, storage_retry_s=12.5)
    assert {f.retry_s for f in index.files} == {12.5}
    assert index.only(3).files[0].retry_s == 12.5  # what a reader gets
    assert index.storage_retries == 0


def test_an_index_counts_the_footer_reads_tried_again(tmp_path, monkeypatch):
    """Footers are read on a thread pool: each read the storage refused is counted in the index (which the loader's
    ``stats()["storage_retries"]`` starts from), however many threads read them."""
    data = synth(tmp_path / "d", users=30, files=3, rows_per_group=7)
    clock = _Clock()
    monkeypatch.setattr(sources, "time", clock)
    opened, refused = sources.DataFile.open, []
    lock = threading.Lock()

    def refusing(self):
        with lock:  # the first two opens of each file fail
            refused.append(self.path)
            if refused.count(self.path) <= 2:
                raise StorageError(f"{self.path}: opening it failed")
        return opened(self)

    monkeypatch.setattr(sources.DataFile, "open", refusing)
    index = index_source(data, storage_retry_s=30)
    assert len(index.files) == 3 and index.storage_retries == 6 and len(refused) == 9

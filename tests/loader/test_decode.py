"""A row group read in parts (row groups over ``PART_BYTES``, one pass over each) equals the same row group
decoded whole, whatever order its parts are asked in."""

import itertools
import multiprocessing
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.contract import sources
from loader.contract.sources import index_source
from loader.errors import StorageError
from loader.stages import decode
from loader.stages.clean import CORRUPT, VALID, Chunk, ListColumn
from loader.stages.rows import Sliced, flatten, gather

from .helpers import corrupt_row_group, synth

# A row: (user id or None, items or None (items may hold None: a null event), timestamps or None)
row = st.tuples(
    st.integers(0, 9).map(lambda k: None if k == 0 else k * 2**37),  # a null user in one row of ten
    st.none() | st.lists(st.none() | st.integers(0, 2**31 - 1), max_size=6),
    st.none() | st.lists(st.integers(0, 2**31 - 1), max_size=6),
)
_names = itertools.count()


def _write(tmp_path, rows, item_type, group_rows) -> str:
    table = pa.table({
        "user_id": pa.array([r[0] for r in rows], pa.int64()),
        "item_ids": pa.array([r[1] for r in rows], item_type),
        "timestamps": pa.array([r[2] for r in rows], pa.list_(pa.int64())),
    })
    path = tmp_path / f"part-{next(_names)}.parquet"  # a new name per example: footers are kept per file
    pq.write_table(table, path, row_group_size=group_rows)
    return str(path)


def _index(path, monkeypatch, part_bytes=None):
    """``path``'s index with row groups whole (``part_bytes`` None) or in parts of about ``part_bytes``."""
    monkeypatch.setattr(sources, "PART_BYTES", 2**62 if part_bytes is None else max(1, part_bytes))
    return index_source(path)


def _read(index, unit, max_seq_len=None, sliced=False, threads=False):
    """Unit ``unit`` decoded; ``sliced``: as a reader actor decodes it (a part's slices as they are), its rows then
    gathered into one :class:`Rows` to compare; ``threads``: a whole row group on pyarrow's threads (read alone)."""
    fetched = decode.fetch_unit(index, unit, skip_corrupt=False)
    return _gathered(index, decode.decode_unit(index, fetched, max_seq_len=max_seq_len, skip_corrupt=False,
                                               sliced=sliced, threads=threads))


def _gathered(index, chunk):
    """``chunk`` with its rows in one :class:`Rows`: gathered through ``flatten`` where they come sliced."""
    if not isinstance(chunk.rows, Sliced):
        return chunk
    every = np.arange(len(chunk.rows), dtype=np.int64)
    dtypes = {name: t.to_pandas_dtype() for name, t in index.lists}
    return Chunk(chunk.status, gather(*flatten([chunk.rows], np.zeros_like(every), every), dtypes))


@given(rows=st.lists(row, min_size=1, max_size=40), group_rows=st.integers(1, 17), part_share=st.floats(0, 1),
       slice_share=st.floats(0, 1), order=st.sampled_from(["forward", "backward", "shuffled"]),
       item_type=st.sampled_from([pa.list_(pa.int64()), pa.list_(pa.int32()), pa.large_list(pa.int64())]),
       max_seq_len=st.none() | st.integers(1, 4), sliced=st.booleans(), threads=st.booleans())
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_parts_equal_whole(tmp_path, monkeypatch, rows, group_rows, part_share, slice_share, order, item_type,
                           max_seq_len, sliced, threads):
    path = _write(tmp_path, rows, item_type, group_rows)
    whole_index = _index(path, monkeypatch)
    largest = max(u.nbytes for u in whole_index.units)
    index = _index(path, monkeypatch, int(largest * part_share))
    monkeypatch.setattr(decode, "SLICE_BYTES", int(largest * slice_share))
    monkeypatch.setattr("loader.stages.passes.GRACE_S", 0.0)
    units = list(range(len(index.units)))
    if order == "backward":
        units.reverse()
    elif order == "shuffled":
        random.Random(len(rows)).shuffle(units)
    got = {unit: _read(index, unit, max_seq_len, sliced) for unit in units}
    assert [(u.file, u.row_group) for u in index.units] == sorted((u.file, u.row_group) for u in index.units)
    for g, w in enumerate(whole_index.units):
        whole = _read(whole_index, g, max_seq_len, threads=threads)  # decoded on pyarrow's threads or not: the same
        parts = [i for i, u in enumerate(index.units) if u.row_group == w.row_group]
        starts = np.cumsum([0] + [index.units[i].rows for i in parts])[:-1]
        assert [index.units[i].start for i in parts] == starts.tolist()
        assert sum(index.units[i].rows for i in parts) == w.rows
        for i in parts:
            u = index.units[i]
            status = whole.status[u.start : u.start + u.rows]
            first = int(np.count_nonzero(whole.status[: u.start] == VALID))
            expected = whole.rows.slice(first, first + int(np.count_nonzero(status == VALID)))
            _same(status, expected, got[i])


@pytest.mark.parametrize("max_seq_len", [None, 7])
def test_a_part_decoded_sliced_holds_the_rows_the_part_filled_whole_does(tmp_path, monkeypatch, max_seq_len):
    """What a reader actor puts for a part (its slices as decoded, ``sliced``) names the same rows in the same order
    as the part filled into one array per column, through :func:`flatten`; valid rows in every slice (the
    property test above draws mostly invalid ones), truncated or not."""
    path = synth(tmp_path, users=300, max_len=60, files=1, rows_per_group=300)
    largest = max(u.nbytes for u in _index(path, monkeypatch).units)
    index = _index(path, monkeypatch, largest // 3)
    monkeypatch.setattr(decode, "SLICE_BYTES", largest // 30)
    assert len(index.units) == 3
    for unit in range(len(index.units)):
        filled = _read(index, unit, max_seq_len)
        fetched = decode.fetch_unit(index, unit, skip_corrupt=False)
        chunk = decode.decode_unit(index, fetched, max_seq_len=max_seq_len, skip_corrupt=False, sliced=True)
        assert isinstance(chunk.rows, Sliced) and sum(len(p) > 0 for p in chunk.rows.parts) >= 5
        assert chunk.status.tolist() == filled.status.tolist() and len(chunk.rows) == len(filled.rows) > 0
        assert chunk.rows.lengths.tolist() == filled.rows.lengths.tolist()
        _same(filled.status, filled.rows, _gathered(index, chunk))


def _same(status, rows, chunk):
    assert chunk.status.tolist() == status.tolist()
    a, b = rows, chunk.rows
    assert b.user_ids.tolist() == a.user_ids.tolist()
    assert b.offsets.tolist() == a.offsets.tolist()
    assert b.cut.tolist() == a.cut.tolist()
    assert set(b.events) == set(a.events)
    for name in a.events:
        assert b.events[name].dtype == a.events[name].dtype
        assert b.events[name].tolist() == a.events[name].tolist()


def test_filling_grows_past_an_undercounting_footer():
    """Arrays sized from a footer that undercounts rows or leaf values grow instead of overflowing."""
    filling = decode._Filling(1, {"item_ids": (0, np.dtype(np.int64))})
    parts = [
        (np.array([5, 6]), None, {"item_ids": ListColumn(np.array([0, 2, 3]), np.array([1, 2, 3]))}),
        (np.array([7]), np.array([True]), {"item_ids": ListColumn(
            np.array([4, 6]), np.array([0, 0, 0, 0, 8, 9]), row_null=np.array([False]),
            event_null=np.array([0, 0, 0, 0, 1, 0], bool))}),
    ]
    for part in parts:
        filling.add(*part)
    users, user_null, lists = filling.result()
    assert users.tolist() == [5, 6, 7]
    assert user_null.tolist() == [False, False, True]
    items = lists["item_ids"]
    assert items.offsets.tolist() == [0, 2, 3, 5]
    assert items.values.tolist() == [1, 2, 3, 8, 9]
    assert items.row_null.tolist() == [False, False, False]
    assert items.event_null.tolist() == [False, False, False, True, False]


def _counting(monkeypatch):
    """Rows of every batch pyarrow's batch reader gives, one list per pass opened."""
    passes = []
    real = pq.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        passes.append([])
        for batch in real(self, *args, **kwargs):
            passes[-1].append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counted)
    return passes


def test_a_large_row_group_is_read_in_parts_in_one_pass(tmp_path, monkeypatch):
    """Over ``PART_BYTES`` a row group is listed as parts; read in order they take one pass over it, in
    slices; a whole row group is read without one."""
    path = _write(tmp_path, [(i, [i] * 5, [i] * 5) for i in range(100)], pa.list_(pa.int64()), 100)
    nbytes = _index(path, monkeypatch).units[0].nbytes
    index = _index(path, monkeypatch, -(-nbytes // 4))
    assert [(u.start, u.rows, u.part, u.parts) for u in index.units] == [(0, 25, 0, 4), (25, 25, 1, 4),
                                                                         (50, 25, 2, 4), (75, 25, 3, 4)]
    assert index.describe(2) == f"{path} (row group 0, rows 50-74)"
    monkeypatch.setattr(decode, "SLICE_BYTES", nbytes // 10)
    passes = _counting(monkeypatch)
    users = [_read(index, unit).rows.user_ids.tolist() for unit in range(4)]
    assert users == [list(range(25 * p, 25 * p + 25)) for p in range(4)]
    assert len(passes) == 1 and sum(passes[0]) == 100 and len(passes[0]) >= 8
    assert not [key for key in decode.PASSES.groups if key[1] == path]  # read to its end: closed
    passes.clear()
    _read(_index(path, monkeypatch), 0)
    assert passes == []


def test_a_part_asked_again_or_out_of_order_reads_the_row_group_again(tmp_path, monkeypatch):
    path = _write(tmp_path, [(i, [i], [i]) for i in range(40)], pa.list_(pa.int64()), 40)
    index = _index(path, monkeypatch, -(-_index(path, monkeypatch).units[0].nbytes // 4))  # 4 parts
    monkeypatch.setattr("loader.stages.passes.GRACE_S", 0.0)
    passes = _counting(monkeypatch)
    assert _read(index, 2).rows.user_ids.tolist() == list(range(20, 30))
    assert _read(index, 1).rows.user_ids.tolist() == list(range(10, 20))  # behind the pass: a new one
    assert _read(index, 2).rows.user_ids.tolist() == list(range(20, 30))  # continues it
    assert _read(index, 2).rows.user_ids.tolist() == list(range(20, 30))  # asked again: a new one
    assert len(passes) == 3


def test_two_readers_of_one_row_group_in_step_keep_a_pass_each(tmp_path, monkeypatch):
    """Two epochs reading the same row group's parts at once in one process (interleaved) each keep their
    own pass: two decodes of the row group, not one per part."""
    path = _write(tmp_path, [(i, [i], [i]) for i in range(40)], pa.list_(pa.int64()), 40)
    index = _index(path, monkeypatch, -(-_index(path, monkeypatch).units[0].nbytes // 4))
    passes = _counting(monkeypatch)
    for unit in range(4):
        for _ in range(2):
            assert _read(index, unit).rows.user_ids.tolist() == list(range(10 * unit, 10 * unit + 10))
    assert len(passes) == 2 and [sum(rows) for rows in passes] == [40, 40]


def test_a_part_waits_for_the_pass_decoding_the_part_before_it(tmp_path, monkeypatch):
    """A part asked while a thread decodes the part before it continues that pass instead of opening one."""
    path = _write(tmp_path, [(i, [i], [i]) for i in range(40)], pa.list_(pa.int64()), 40)
    index = _index(path, monkeypatch, -(-_index(path, monkeypatch).units[0].nbytes // 2))  # 2 parts
    passes = _counting(monkeypatch)
    run = decode.PASSES.acquire(_key(index, 0), 0)  # as if a reader thread decoded part 0 now
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(_read, index, 1)
        time.sleep(0.3)
        assert not second.done()  # waiting for the pass, not skipping ahead on a new one
        decode.PASSES.release(_key(index, 0), run, done=True)  # (that reader failed: its pass closed)
        assert second.result(timeout=30).rows.user_ids.tolist() == list(range(20, 40))
    assert len(passes) == 1


def _key(index, unit):
    u, file = index.units[unit], index.files[index.units[unit].file]
    return (file.filesystem.type_name, file.path, file.size, u.row_group, ("user_id", "item_ids", "timestamps"))


def test_parts_asked_from_threads_in_any_order_are_each_right(tmp_path, monkeypatch):
    """Reader threads asking a row group's parts at once, in any order, each get their own rows."""
    path = _write(tmp_path, [(i, [i] * (1 + i % 7), [i] * (1 + i % 7)) for i in range(300)], pa.list_(pa.int64()), 100)
    index = _index(path, monkeypatch, -(-_index(path, monkeypatch).units[0].nbytes // 5))
    units = list(range(len(index.units))) * 2
    random.Random(0).shuffle(units)
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda unit: (unit, _read(index, unit).rows.user_ids.tolist()), units))
    for unit, users in got:
        u = index.units[unit]
        assert users == list(range(100 * u.row_group + u.start, 100 * u.row_group + u.start + u.rows))


@pytest.mark.parametrize("part_bytes", [1, None])
def test_a_changed_row_count_is_named_either_way(tmp_path, monkeypatch, part_bytes):
    path = _write(tmp_path, [(i, [i], [i]) for i in range(6)], pa.list_(pa.int64()), 6)
    index = _index(path, monkeypatch, part_bytes)
    pq.write_table(pa.table({"user_id": pa.array([1], pa.int64()), "item_ids": pa.array([[1]]),
                             "timestamps": pa.array([[1]])}), path)
    with pytest.raises((ValueError, OSError), match="changed|outside|past"):
        for unit in range(len(index.units)):
            _read(index, unit)


def test_a_file_gone_before_a_part_is_read_is_named(tmp_path, monkeypatch):
    path = _write(tmp_path, [(i, [i], [i]) for i in range(6)], pa.list_(pa.int64()), 6)
    index = _index(path, monkeypatch, 1)
    fetched = decode.fetch_unit(index, 0, skip_corrupt=False)
    assert fetched.streamed and fetched.data is None
    (tmp_path / path.rsplit("/", 1)[1]).unlink()
    with pytest.raises(FileNotFoundError, match="disappeared after the loader indexed it"):
        decode.decode_unit(index, fetched, max_seq_len=None, skip_corrupt=True)


@pytest.mark.parametrize("part_bytes", [1, 600, None])
def test_a_corrupt_row_group_is_named_or_skipped_in_parts_too(tmp_path, monkeypatch, part_bytes):
    data = synth(tmp_path / "d", users=60, files=1, rows_per_group=20)
    broken = data / "part-00000.parquet"
    lost = corrupt_row_group(broken, 1)
    index = _index(str(data), monkeypatch, part_bytes)
    parts = [i for i, u in enumerate(index.units) if u.row_group == 1]
    with pytest.raises(ValueError, match=r"\(row group 1(, rows \d+-\d+)?\): cannot be decoded .*skip_corrupt=True"):
        _read(index, parts[0])
    skipped = [decode.read_unit(index, i, max_seq_len=None, skip_corrupt=True) for i in parts]
    assert sum(len(s.status) for s in skipped) == lost
    assert all(s.status.tolist() == [CORRUPT] * len(s.status) and len(s.rows.user_ids) == 0 for s in skipped)
    first = [i for i, u in enumerate(index.units) if u.row_group == 0]
    assert sum(len(_read(index, i).rows.user_ids) for i in first) == 20


@pytest.mark.parametrize("skip_corrupt", [False, True])
def test_a_read_failing_inside_a_pass_is_a_storage_error_never_a_corrupt_row_group(tmp_path, monkeypatch,
                                                                                   skip_corrupt):
    """Parts of a row group on object storage over ``REMOTE_PASS_BYTES``, whose pages are read as they decode: a
    read that fails in the middle of the decode is the store's, a StorageError naming the row group, ``skip_corrupt``
    or not; not pages that do not decode (those stay a corrupt row group, above). (A file taken as remote here.)"""
    data = synth(tmp_path / "d", users=60, files=1, rows_per_group=20)
    index = _index(str(data), monkeypatch, 600)
    parts = [i for i, u in enumerate(index.units) if u.row_group == 1]
    assert len(parts) > 1
    monkeypatch.setattr(sources.DataFile, "remote", True)
    monkeypatch.setattr(decode, "REMOTE_PASS_BYTES", 0)  # no part fetches its row group: pages read as decoded
    assert decode.fetch_unit(index, parts[0], skip_corrupt=False).data is None
    opened = sources.DataFile.open
    monkeypatch.setattr(sources.DataFile, "open", lambda self: _Refusing(opened(self)))
    with pytest.raises(StorageError, match=r"part-00000\.parquet: reading the pages of row group 1 from local disk "
                       r"failed \(Connection reset by peer\); the storage refused .* no rows were skipped"):
        decode.read_unit(index, parts[0], max_seq_len=None, skip_corrupt=skip_corrupt)
    monkeypatch.setattr(sources.DataFile, "open", opened)  # the storage answers again: the same part reads
    assert len(_read(index, parts[0]).rows.user_ids) == index.units[parts[0]].rows


def test_a_pass_whose_reads_failed_is_tried_anew_within_storage_retry_s(tmp_path, monkeypatch):
    """The same remote pass with ``storage_retry_s``: the connection dropped on its first try, the part is decoded
    on a new pass from the row group's start, as it would have been."""
    data = synth(tmp_path / "d", users=60, files=1, rows_per_group=20)
    monkeypatch.setattr(sources, "PART_BYTES", 600)
    index = index_source(str(data), storage_retry_s=5)
    expected = {i: _read(index, i).rows.user_ids.tolist() for i, u in enumerate(index.units) if u.row_group == 1}
    monkeypatch.setattr(sources.DataFile, "remote", True)
    monkeypatch.setattr(decode, "REMOTE_PASS_BYTES", 0)
    opened, tries = sources.DataFile.open, []
    monkeypatch.setattr(sources.DataFile, "open",
                        lambda self: tries.append(1) or (_Refusing(opened(self)) if len(tries) == 1 else opened(self)))
    last = max(expected)  # the row group's last part: the new pass skips the parts before it
    chunk = decode.read_unit(index, last, max_seq_len=None, skip_corrupt=False)
    assert chunk.rows.user_ids.tolist() == expected[last]
    assert len(tries) == 2 and chunk.meta().retries == 1  # the control plane counts it (stats()["storage_retries"])


class _Refusing:
    """An open input stream whose reads fail as a dropped connection does."""

    def __init__(self, stream) -> None:
        self.stream = stream

    def read_buffer(self, nbytes=None):
        raise ConnectionResetError("Connection reset by peer")

    def __getattr__(self, name):
        return getattr(self.stream, name)


def test_a_forked_child_opens_its_own_passes(tmp_path, monkeypatch):
    """A process forked while a pass stands open (a DataLoader worker) reads its parts on passes of its own."""
    path = _write(tmp_path, [(i, [i], [i]) for i in range(40)], pa.list_(pa.int64()), 40)
    index = _index(path, monkeypatch, -(-_index(path, monkeypatch).units[0].nbytes // 4))
    assert _read(index, 0).rows.user_ids.tolist() == list(range(10))  # the parent's pass stands at row 10
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply(_users_and_passes, (index, 1)) == (list(range(10, 20)), 1)
    assert _read(index, 1).rows.user_ids.tolist() == list(range(10, 20))  # the parent's pass goes on


def _users_and_passes(index, unit):
    opened = []
    real = pq.ParquetFile.iter_batches
    pq.ParquetFile.iter_batches = lambda self, *a, **k: (opened.append(1), real(self, *a, **k))[1]
    return _read(index, unit).rows.user_ids.tolist(), len(opened)


def test_parts_share_one_fetch_of_their_row_group():
    """The first part reads the row group's bytes; a part asked meanwhile waits for that read instead of reading
    again, and takes the bytes while anything holds them; a failed read leaves the waiters with none (they read
    as decoded, and meet the error themselves)."""
    shared = decode._SharedFetches()
    reads, release = [], threading.Event()

    def read():
        reads.append(1)
        release.wait(5)
        return pa.py_buffer(b"row group")

    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(shared.get, "g", first=True, read=read)
        while not reads:
            time.sleep(0.001)
        later = pool.submit(shared.get, "g", first=False, read=read)
        time.sleep(0.05)
        assert not later.done()  # waits for the first part's read
        release.set()
        data = first.result(5)
        assert later.result(5) is data and len(reads) == 1
    assert shared.get("g", first=False, read=read) is data and len(reads) == 1  # held by a part: taken
    del data, first, later
    assert shared.get("g", first=False, read=read) is None and len(reads) == 1  # nothing holds it: not read again

    def fails():
        reads.append(1)
        release.wait(5)
        raise OSError("gone")

    release.clear()
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(shared.get, "h", first=True, read=fails)
        while len(reads) < 2:
            time.sleep(0.001)
        later = pool.submit(shared.get, "h", first=False, read=fails)
        time.sleep(0.02)
        release.set()
        with pytest.raises(OSError, match="gone"):
            first.result(5)
        assert later.result(5) is None
    assert not shared.reading


def test_a_column_of_one_chunk_is_taken_without_a_copy():
    """A whole row group's column comes back from pyarrow as one chunk: taken as is (``combine_chunks`` would copy
    it); columns of several chunks are joined."""
    one = pa.chunked_array([pa.array([[1, 2], [3]], pa.list_(pa.int64()))])
    assert decode._whole(one).values.buffers()[1].address == one.chunk(0).values.buffers()[1].address
    two = pa.chunked_array([pa.array([[1, 2]]), pa.array([[3]])])
    assert decode._whole(two).to_pylist() == [[1, 2], [3]]
    array = pa.array([1, 2])
    assert decode._whole(array) is array

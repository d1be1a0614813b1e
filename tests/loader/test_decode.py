"""A row group decoded in slices (large row groups, ``SLICED_ABOVE``) equals the same row group decoded whole."""

import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loader.contract.sources import index_source
from loader.stages import decode
from loader.stages.clean import CORRUPT, ListColumn

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


def _decoded(index, unit, slice_bytes, monkeypatch, max_seq_len):
    """``unit`` read whole (``slice_bytes`` None) or in slices of ``slice_bytes`` (the setting left so)."""
    _slices(monkeypatch, slice_bytes)
    return decode.read_unit(index, unit, max_seq_len=max_seq_len, skip_corrupt=False)


@given(rows=st.lists(row, min_size=1, max_size=40), group_rows=st.integers(1, 17), slice_share=st.floats(0, 0.99),
       item_type=st.sampled_from([pa.list_(pa.int64()), pa.list_(pa.int32()), pa.large_list(pa.int64())]),
       max_seq_len=st.none() | st.integers(1, 4))
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_slices_equal_whole(tmp_path, monkeypatch, rows, group_rows, slice_share, item_type, max_seq_len):
    index = index_source(_write(tmp_path, rows, item_type, group_rows))
    for unit in range(len(index.units)):
        whole = _decoded(index, unit, None, monkeypatch, max_seq_len)
        # below the row group's size: decoded in slices (of one row at 0)
        slice_bytes = int(index.units[unit].nbytes * slice_share)
        streamed = _decoded(index, unit, slice_bytes, monkeypatch, max_seq_len)  # a local file: read as decoded
        _slices(monkeypatch, None)
        fetched = decode.fetch_unit(index, unit, skip_corrupt=False)  # as from object storage: the bytes first
        _slices(monkeypatch, slice_bytes)
        from_memory = decode.decode_unit(index, fetched, max_seq_len=max_seq_len, skip_corrupt=False)
        for sliced in (streamed, from_memory):
            _same(whole, sliced)


def _slices(monkeypatch, slice_bytes):
    """Row groups decoded whole (``slice_bytes`` None), or every one in slices of ``slice_bytes``."""
    monkeypatch.setattr(decode, "SLICED_ABOVE", 2**62 if slice_bytes is None else -1)
    monkeypatch.setattr(decode, "SLICE_BYTES", slice_bytes or 0)


def _same(whole, sliced):
    assert sliced.status.tolist() == whole.status.tolist()
    a, b = whole.rows, sliced.rows
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


def test_large_row_groups_are_decoded_in_slices(tmp_path, monkeypatch):
    """A row group over ``SLICED_ABOVE`` goes through pyarrow's batch reader, several slices of it."""
    path = _write(tmp_path, [(i, [i] * 5, [i] * 5) for i in range(100)], pa.list_(pa.int64()), 100)
    index = index_source(path)
    batches = []
    real = pq.ParquetFile.iter_batches

    def counted(self, *args, **kwargs):
        for batch in real(self, *args, **kwargs):
            batches.append(batch.num_rows)
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", counted)
    monkeypatch.setattr(decode, "SLICED_ABOVE", index.units[0].nbytes - 1)
    monkeypatch.setattr(decode, "SLICE_BYTES", index.units[0].nbytes // 4)
    chunk = decode.read_unit(index, 0, max_seq_len=None, skip_corrupt=False)
    assert chunk.rows.user_ids.tolist() == list(range(100))
    assert len(batches) >= 4 and sum(batches) == 100
    batches.clear()
    monkeypatch.setattr(decode, "SLICED_ABOVE", index.units[0].nbytes)
    decode.read_unit(index, 0, max_seq_len=None, skip_corrupt=False)
    assert batches == []


@pytest.mark.parametrize("slice_bytes", [0, None])
def test_a_changed_row_count_is_named_either_way(tmp_path, monkeypatch, slice_bytes):
    path = _write(tmp_path, [(i, [i], [i]) for i in range(6)], pa.list_(pa.int64()), 6)
    index = index_source(path)
    pq.write_table(pa.table({"user_id": pa.array([1], pa.int64()), "item_ids": pa.array([[1]]),
                             "timestamps": pa.array([[1]])}), path)
    _slices(monkeypatch, slice_bytes)
    with pytest.raises((ValueError, OSError), match="changed|outside|past"):
        decode.read_unit(index, 0, max_seq_len=None, skip_corrupt=False)


def test_a_file_gone_before_a_streamed_read_is_named(tmp_path, monkeypatch):
    path = _write(tmp_path, [(i, [i], [i]) for i in range(6)], pa.list_(pa.int64()), 6)
    index = index_source(path)
    _slices(monkeypatch, 0)
    fetched = decode.fetch_unit(index, 0, skip_corrupt=False)
    assert fetched.streamed and fetched.data is None
    (tmp_path / path.rsplit("/", 1)[1]).unlink()
    with pytest.raises(FileNotFoundError, match="disappeared after the loader indexed it"):
        decode.decode_unit(index, fetched, max_seq_len=None, skip_corrupt=True)


@pytest.mark.parametrize("slice_bytes", [0, 64, None])
def test_a_corrupt_row_group_is_named_or_skipped_in_slices_too(tmp_path, monkeypatch, slice_bytes):
    data = synth(tmp_path / "d", users=60, files=1, rows_per_group=20)
    broken = data / "part-00000.parquet"
    lost = corrupt_row_group(broken, 1)
    index = index_source(str(data))
    _slices(monkeypatch, slice_bytes)
    with pytest.raises(ValueError, match=r"\(row group 1\): cannot be decoded .*skip_corrupt=True"):
        decode.read_unit(index, 1, max_seq_len=None, skip_corrupt=False)
    skipped = decode.read_unit(index, 1, max_seq_len=None, skip_corrupt=True)
    assert skipped.status.tolist() == [CORRUPT] * lost and len(skipped.rows.user_ids) == 0
    assert len(decode.read_unit(index, 0, max_seq_len=None, skip_corrupt=False).rows.user_ids) == 20

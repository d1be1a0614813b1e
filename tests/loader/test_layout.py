import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from loader.contract import layout


@given(
    n_rows=st.integers(0, 5000),
    files=st.integers(1, 8),
    rows_per_group=st.one_of(st.none(), st.integers(1, 3000)),
)
def test_plan_covers_every_row_once_in_order(n_rows, files, rows_per_group):
    parts = layout.plan_parts(n_rows, files=files, rows_per_group=rows_per_group)
    assert len(parts) == max(1, min(files, n_rows))
    bounds = np.concatenate([b[:-1] for b in parts] + [parts[-1][-1:]])
    assert bounds[0] == 0 and bounds[-1] == n_rows
    assert np.all(np.diff(bounds) > 0)  # contiguous, non-empty groups
    for b in parts:
        if rows_per_group is not None:
            assert np.all(np.diff(b) <= rows_per_group)
        elif b[-1] - b[0] >= 2:
            assert len(b) - 1 >= 2  # small files still get two row groups


def test_bad_options_rejected():
    with pytest.raises(ValueError, match="files must be >= 1, got 0"):
        layout.plan_parts(10, files=0)
    with pytest.raises(ValueError, match="rows_per_group must be >= 1, got 0"):
        layout.plan_parts(10, files=1, rows_per_group=0)


def test_out_dir_refuses_parquet_unless_overwrite(tmp_path):
    (tmp_path / "part-00007.parquet").write_bytes(b"old")
    with pytest.raises(ValueError, match="already holds Parquet files.*--overwrite"):
        layout.prepare_out_dir(tmp_path, overwrite=False)
    layout.prepare_out_dir(tmp_path, overwrite=True)
    assert not list(tmp_path.iterdir())
    (tmp_path / "other.parquet").write_bytes(b"not ours")
    with pytest.raises(ValueError, match="other.parquet"):
        layout.prepare_out_dir(tmp_path, overwrite=True)
    with pytest.raises(ValueError, match="not a directory"):
        layout.prepare_out_dir(tmp_path / "other.parquet", overwrite=False)


def test_write_parts_one_row_group_per_plan_entry(tmp_path):
    schema = pa.schema([("x", pa.int64())])
    parts = layout.plan_parts(10, files=3, rows_per_group=2)
    written = layout.write_parts(
        tmp_path,
        schema,
        parts,
        lambda start, stop: pa.table({"x": np.arange(start, stop)}, schema=schema),
        desc="test",
        workers=2,
    )
    assert written["files"] == 3
    assert written["row_groups"] == sum(len(b) - 1 for b in parts)
    for path, bounds in zip(written["paths"], parts):
        assert pq.ParquetFile(path).num_row_groups == len(bounds) - 1
    assert pq.read_table(tmp_path).column("x").to_pylist() == list(range(10))

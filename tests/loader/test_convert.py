import csv
import tempfile
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from freescale.cli import main
from loader.contract.convert import convert_events
from loader.sample_data import MOVIELENS_COLUMNS, movielens_ratings_path
from loader.contract.schema import validate_schema

ML = movielens_ratings_path()


def _read(out) -> pa.Table:
    return pq.read_table(sorted(Path(out).glob("part-*.parquet")))


def _histories(out) -> dict[int, tuple]:
    """user -> (items, times[, more features]) read back from a converted dataset."""
    rows = _read(out).to_pylist()
    return {r.pop("user_id"): tuple(zip(*r.values())) for r in rows}


@pytest.fixture(scope="module")
def ml_reference():
    """user -> [(movie, time, rating)] sorted by time, ties in file order: plain Python over the CSV."""
    by_user = defaultdict(list)
    with open(ML, newline="") as f:
        for row in csv.DictReader(f):
            by_user[int(row["userId"])].append(
                (int(row["movieId"]), int(row["timestamp"]), float(row["rating"]))
            )
    return {u: sorted(events, key=lambda e: e[1]) for u, events in by_user.items()}


@pytest.fixture(scope="module")
def ml_converted(tmp_path_factory):
    out = tmp_path_factory.mktemp("ml")
    summary = convert_events(ML, out, **MOVIELENS_COLUMNS, feature_cols=["rating"])
    return out, summary


def test_movielens_histories_match_reference(ml_converted, ml_reference):
    out, summary = ml_converted
    assert summary["users"] == 610 and summary["rows_read"] == summary["rows_written"] == 100_836
    assert summary["rows_skipped"] == {} and summary["events_truncated"] == 0
    histories = _histories(out)
    assert sorted(histories) == list(histories) == sorted(ml_reference)
    for user, events in ml_reference.items():
        assert histories[user] == tuple(events)


def test_movielens_layout_and_schema(ml_converted):
    out, summary = ml_converted
    paths = sorted(out.glob("part-*.parquet"))
    assert summary["files"] == len(paths) == 4
    for path in paths:
        assert pq.ParquetFile(path).num_row_groups >= 2
        assert validate_schema(pq.read_schema(path), str(path)) == ("rating",)
    table = _read(out)
    assert table.schema.field("rating").type == pa.list_(pa.float64())
    times = table.column("timestamps").combine_chunks()
    for row in times.to_pylist():
        assert row == sorted(row)


def test_max_seq_len_keeps_most_recent(tmp_path, ml_reference):
    summary = convert_events(ML, tmp_path, **MOVIELENS_COLUMNS, feature_cols=["rating"], max_seq_len=25)
    long_users = [u for u, e in ml_reference.items() if len(e) > 25]
    assert summary["users_truncated"] == len(long_users) > 0
    assert summary["events_truncated"] == sum(len(ml_reference[u]) - 25 for u in long_users)
    assert summary["rows_written"] + summary["events_truncated"] == summary["rows_read"]
    histories = _histories(tmp_path)
    for user, events in ml_reference.items():
        assert histories[user] == tuple(events[-25:])


def _write_csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_missing_file_and_pattern(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.csv: no such file"):
        convert_events(tmp_path / "nope.csv", tmp_path / "out")
    with pytest.raises(FileNotFoundError, match=r"no files match"):
        convert_events(str(tmp_path / "*.parquet"), tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="holds no .csv or .parquet"):
        convert_events(tmp_path, tmp_path / "out")


def test_missing_column_names_file_column_and_present_columns(tmp_path):
    with pytest.raises(ValueError, match=r"ratings.csv: column 'user_id' \(the user column\) not found"
                       r".*columns present: userId, movieId, rating, timestamp.*--user-col"):
        convert_events(ML, tmp_path / "out")
    with pytest.raises(ValueError, match=r"ratings.csv: column 'genre' \(the feature column\)"):
        convert_events(ML, tmp_path / "out", **MOVIELENS_COLUMNS, feature_cols=["genre"])
    assert not (tmp_path / "out").exists()  # checked before anything is written


@pytest.mark.parametrize(
    "text, column",
    [
        ("user,item,time\nu1,1,10\nu2,2,11\n", "user"),
        ("user,item,time\n1,1.5,10\n2,2,11\n", "item"),
        ("user,item,time\n1,1,10.5\n2,2,11\n", "time"),
    ],
)
def test_non_integer_columns_name_file_and_column(tmp_path, text, column):
    src = _write_csv(tmp_path / "events.csv", text)
    with pytest.raises(ValueError, match=rf"events.csv: column '{column}' .*has type .*expected integers"):
        convert_events(src, tmp_path / "out", user_col="user", item_col="item", time_col="time")


def test_arrow_timestamp_column_rejected_with_fix(tmp_path):
    src = tmp_path / "events.parquet"
    pq.write_table(pa.table({"u": [1], "i": [2], "t": pa.array([3], pa.timestamp("s"))}), src)
    with pytest.raises(ValueError, match=r"events.parquet: column 't' \(the time column\) has type "
                       r"timestamp\[ms\], expected integers; store times as integers"):
        convert_events(src, tmp_path / "out", user_col="u", item_col="i", time_col="t")


def test_non_numeric_feature_rejected(tmp_path):
    src = _write_csv(tmp_path / "events.csv", "user,item,time,tag\n1,1,10,a\n")
    with pytest.raises(ValueError, match="events.csv: feature column 'tag' has type string"):
        convert_events(src, tmp_path / "out", user_col="user", item_col="item", time_col="time",
                       feature_cols=["tag"])


def test_conflicting_column_options(tmp_path):
    with pytest.raises(ValueError, match="must differ"):
        convert_events(ML, tmp_path, user_col="a", item_col="a", time_col="t")
    with pytest.raises(ValueError, match="already the time column"):
        convert_events(ML, tmp_path, **MOVIELENS_COLUMNS, feature_cols=["timestamp"])
    with pytest.raises(ValueError, match="max_seq_len must be >= 1"):
        convert_events(ML, tmp_path, **MOVIELENS_COLUMNS, max_seq_len=0)


def test_null_rows_counted_per_reason_and_skipped(tmp_path):
    src = _write_csv(
        tmp_path / "events.csv",
        "user,item,time,w\n1,5,10,0.5\n,6,11,1\n1,,12,1\n1,7,,1\n,,,\n2,8,9,\n2,9,3,2\n",
    )
    summary = convert_events(src, tmp_path / "out", user_col="user", item_col="item",
                             time_col="time", feature_cols=["w"])
    assert summary["rows_read"] == 7 and summary["rows_written"] == 2
    assert summary["rows_skipped"] == {"null user": 2, "null item": 1, "null time": 1, "null w": 1}
    assert _histories(tmp_path / "out") == {1: ((5, 10, 0.5),), 2: ((9, 3, 2.0),)}


def test_parquet_directory_and_glob_equal_single_file(tmp_path):
    events = pa.table({
        "u": pa.array([3, 1, 3, 1, 2, 1], pa.int32()),
        "i": [10, 11, 12, 13, 14, 15],
        "t": [5, 5, 1, 2, 7, 5],
    })
    (tmp_path / "in").mkdir()
    pq.write_table(events.slice(0, 4), tmp_path / "in" / "a.parquet")
    pq.write_table(events.slice(4), tmp_path / "in" / "b.parquet")
    cols = {"user_col": "u", "item_col": "i", "time_col": "t"}
    convert_events(tmp_path / "in", tmp_path / "dir", **cols)
    convert_events(str(tmp_path / "in" / "*.parquet"), tmp_path / "glob", **cols)
    expected = {1: ((13, 2), (11, 5), (15, 5)), 2: ((14, 7),), 3: ((12, 1), (10, 5))}
    assert _histories(tmp_path / "dir") == _histories(tmp_path / "glob") == expected


def test_all_rows_skipped_writes_an_empty_dataset(tmp_path):
    src = _write_csv(tmp_path / "events.csv", "user,item,time\n,1,2\n")
    summary = convert_events(src, tmp_path / "out", user_col="user", item_col="item", time_col="time")
    assert summary["users"] == 0 and summary["files"] == 1
    assert _read(tmp_path / "out").num_rows == 0


event_logs = st.lists(
    st.tuples(st.integers(-3, 5), st.integers(0, 1000), st.integers(0, 4)), max_size=60
)


@settings(max_examples=40, deadline=None)
@given(events=event_logs, max_seq_len=st.one_of(st.none(), st.integers(1, 4)))
def test_random_logs_group_and_sort_stably(events, max_seq_len):
    users, items, times = (list(c) for c in zip(*events)) if events else ([], [], [])
    table = pa.table({"u": pa.array(users, pa.int64()), "i": pa.array(items, pa.int64()),
                      "t": pa.array(times, pa.int64())})
    with tempfile.TemporaryDirectory() as tmp:
        pq.write_table(table, Path(tmp) / "events.parquet")
        summary = convert_events(Path(tmp) / "events.parquet", Path(tmp) / "out", user_col="u",
                                 item_col="i", time_col="t", max_seq_len=max_seq_len, files=3)
        got = _histories(Path(tmp) / "out")
    expected = defaultdict(list)
    for user, item, t in events:  # stable sort by time keeps input order among ties
        expected[user].append((item, t))
    expected = {u: sorted(e, key=lambda x: x[1]) for u, e in sorted(expected.items())}
    if max_seq_len is not None:
        expected = {u: e[-max_seq_len:] for u, e in expected.items()}
    assert got == {u: tuple(e) for u, e in expected.items()}
    assert list(got) == sorted(got)
    assert summary["rows_written"] + summary["events_truncated"] == summary["rows_read"] == len(events)


def test_cli_convert_movielens(tmp_path, capsys):
    out = tmp_path / "ml"
    rc = main(["convert", str(ML), str(out), "--user-col", "userId", "--item-col", "movieId",
               "--feature-col", "rating", "--max-seq-len", "50", "--files", "2"])
    assert rc == 0
    assert "100,836 rows read" in capsys.readouterr().out
    table = _read(out)
    assert table.num_rows == 610 and table.column_names[-1] == "rating"
    assert max(table.column("item_ids").combine_chunks().value_lengths().to_pylist()) == 50


def test_cli_errors_exit_2_with_message(tmp_path, capsys):
    assert main(["convert", str(ML), str(tmp_path / "out")]) == 2
    assert "freescale convert: error: " in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "missing.csv"), str(tmp_path / "out")]) == 2
    assert "missing.csv: no such file" in capsys.readouterr().err


def test_cli_synth(tmp_path, capsys):
    out = tmp_path / "syn"
    rc = main(["synth", str(out), "--users", "300", "--lengths", "uniform", "--max-len", "40",
               "--seed", "3", "--files", "3"])
    assert rc == 0
    assert "300 users" in capsys.readouterr().out
    table = _read(out)
    assert table.num_rows == 300 and table.column_names == ["user_id", "item_ids", "timestamps", "ratings"]
    assert main(["synth", str(out), "--users", "0"]) == 2
    assert "users must be >= 1" in capsys.readouterr().err


def test_bundled_sample_path():
    assert ML.is_file() and ML.name == "ratings.csv"
    assert ML.read_text().splitlines()[0] == "userId,movieId,rating,timestamp"

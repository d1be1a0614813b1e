"""``bench/ingest.py``: its argument checks, the plain-pyarrow datasets, and one end-to-end run at tiny sizes (every
contender on one shape, a local Ray of its own, started and shut down by the script)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from tests.bench import load, refused

SCRIPT = Path(__file__).parents[2] / "bench" / "ingest.py"
bench_ingest = load("ingest")


@pytest.mark.parametrize("argv, message", [
    (["--contenders", "floor,dali"], "--contenders: unknown ['dali']"),
    (["--datasets", ""], "--datasets: unknown empty list"),
    (["--short-rows", "0"], "--short-rows must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--ranks", "16", "--samples-per-step", "8"], "a global batch of 8 samples is below --ranks 16"),
    (["--ranks", "200", "--datasets", "movielens"], "a global batch of 128 samples is below --ranks 200"),
])
def test_bad_arguments_name_the_value(argv, message, capsys):
    assert message in refused(bench_ingest, argv, capsys)


def test_quick_defaults():
    args = bench_ingest.parse_args(["--quick", "--short-rows", "50"])
    assert args.rows["long"] == 6_000 and args.rows["short"] == 50 and args.repeats == 1 and args.quiet_wait == 0
    args = bench_ingest.parse_args([])
    assert args.rows["long"] == 120_000 and args.rows["short"] == 1_500_000 and args.repeats == 2
    assert args.datasets == ["long", "short"]


@pytest.mark.parametrize("events", [2, 3])
def test_plain_dataset_is_what_pyarrow_wrote(tmp_path, events):
    tokens = bench_ingest.write_plain(tmp_path, rows=1001, median=15, group=100, events=events, seed=3)
    files = sorted(tmp_path.glob("part-*.parquet"))
    assert len(files) == bench_ingest.FILES
    table = pq.ParquetDataset(files).read()
    assert table.num_rows == 1001 and table.column_names == ["user_id", "item_ids", "timestamps", "ratings"][:1 + events]
    assert sorted(table.column("user_id").to_pylist()) == list(range(1001))
    lengths = np.array([len(x) for x in table.column("item_ids").to_pylist()])
    assert lengths.sum() == tokens and lengths.min() >= 1 and 5 < np.median(lengths) < 40
    for column in table.column_names[2:]:  # every event column as long as the items
        assert [len(x) for x in table.column(column).to_pylist()] == lengths.tolist()
    assert {pq.ParquetFile(f).metadata.row_group(0).num_rows for f in files} == {100}


@pytest.mark.slow
def test_end_to_end_tiny(tmp_path):
    pytest.importorskip("pydantic", reason="Ray Data's iter_torch_batches needs the bench extra (pydantic)")
    pytest.importorskip("spdl", reason="the spdl contender needs the bench extra (spdl)")
    pytest.importorskip("moto.server", reason="the ours_s3 contender needs the test extra (moto[server])")
    out = tmp_path / "bench.json"
    env = {**os.environ, "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", "/tmp/numba-cache"),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    contenders = ["floor", "spdl", "spdl_shuffle", "raysplit", "ours", "ours_loop", "ours_loop_steps", "ours_s3",
                   "named2", "split2"]
    # 2001 rows, so raysplit's and split2's equal splits over 2 drop exactly one
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--short-rows", "2001", "--datasets", "short",
                           "--contenders", ",".join(contenders), "--ranks", "2", "--microbatches", "2",
                           "--samples-per-step", "256", "--warmups", "0", "--num-cpus", "2", "--named-epochs", "2",
                           "--cpu-breakdown", "--data-dir", str(tmp_path / "data"), "--json-out", str(out)],
                          capture_output=True, text=True, timeout=280, env=env, cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result  # the JSON line is printed last
    assert "== targets (issue 28" in proc.stdout
    (dataset,) = result["datasets"]
    assert dataset["params"]["median"] == 15 and dataset["params"]["writer"] == "pyarrow"
    got = {r["contender"]: r for r in result["rows"]}
    assert list(got) == contenders
    for contender, row in got.items():
        assert row["available"] and row["error"] is None and row["complete"], (contender, row)
        # CPU comes in 10 ms clock ticks: a tiny pass on warm readers can take none
        assert row["rows_per_s"] > 0 and row["cpu_s"] >= 0 and row["cpu_s_per_mrow"] == pytest.approx(
            row["cpu_s"] / row["rows"] * 1e6)
        assert 0 < row["first_batch_s"] <= row["wall_s"]
        assert row["consumers"] == (2 if contender in ("raysplit", "ours", "ours_s3", "named2", "split2") else 1)
        # --cpu-breakdown: the process roles add up to the tree's CPU (each rounded to a millisecond)
        by_process = row["cpu_by_process"]
        assert sum(by_process.values()) == pytest.approx(row["cpu_s"], abs=0.001 * len(by_process))
    for split in ("raysplit", "split2"):
        assert got[split]["rows"] == 2000 and got[split]["dropped_rows"] == 1
        assert got[split]["batch_size_per_split"] == 128
    assert got["ours"]["rows"] == got["ours_loop"]["rows"] == got["ours_loop_steps"]["rows"] == 2001
    assert got["ours_s3"]["rows"] == got["named2"]["rows"] == 2001
    assert result["config"]["s3_checksums"] == "skip"  # the S3 client's setting docs/loader.md advises
    for name in ("ours", "ours_loop", "ours_loop_steps", "named2"):
        assert got[name]["equal_microbatches"], name
    # one loop over every rank's steps takes the microbatches the rank threads take
    assert got["ours_loop"]["microbatches_per_rank"] == got["ours"]["microbatches_per_rank"]
    assert got["ours_loop_steps"]["microbatches_per_rank"] == got["ours"]["microbatches_per_rank"]  # M a packed step
    assert "rank process" in got["named2"]["cpu_by_process"]  # (the S3 server's share can be under a clock tick)
    assert got["named2"]["faults_by_process"]["rank process"] > 0  # a process that starts a loader maps new pages
    (later,) = got["named2"]["later_epochs"]  # epoch 1 of the same loaders, every row delivered again
    assert later["epoch"] == 1 and later["rows_per_s"] > 0 and 0 < later["first_batch_s"] <= later["wall_s"]
    entry = result["targets"]["datasets"]["short"]
    for key in ("ours_vs_spdl_rows_per_s", "ours_vs_spdl_cpu_per_row", "ours_first_batch_s", "named2_vs_spdl_rows_per_s",
                "named2_vs_split2_rows_per_s", "named2_first_batch_s", "ours_vs_raysplit_rows_per_s",
                "ours_s3_vs_ours_rows_per_s", "ours_loop_vs_spdl_rows_per_s", "ours_loop_vs_spdl_cpu_per_row",
                "ours_loop_steps_vs_spdl_rows_per_s", "ours_loop_steps_vs_spdl_cpu_per_row"):
        least = 0 if "cpu" in key else 1e-12  # ours' CPU can be 0 ticks (above)
        assert entry[key]["value"] >= least and entry[key]["verdict"] in ("PASS", "FAIL"), key
    assert "named8_vs_spdl_rows_per_s" not in entry and "ours_vs_floor_mem_rise" not in entry  # not run / not mem
    assert entry["spdl_vs_floor_rows_per_s"] > 0
    if got["spdl"]["cpu_s"] and got["spdl_shuffle"]["cpu_s"]:  # (tiny passes can take no CPU tick)
        assert entry["spdl_shuffle_vs_spdl_cpu_per_row"] == pytest.approx(
            got["spdl_shuffle"]["cpu_s_per_row"] / got["spdl"]["cpu_s_per_row"])
    assert isinstance(result["targets"]["all_targets_pass"], bool)


def test_shuffled_batches_hold_every_row_once_with_its_own_events(tmp_path):
    """The ``spdl_shuffle`` contender's batches: the permutation's rows, each with its own events, contiguous."""
    bench_ingest.write_plain(tmp_path, rows=1001, median=15, group=1001, events=3, seed=4)
    table = pq.read_table(sorted(tmp_path.glob("part-*.parquet"))[0])
    lists = ["item_ids", "timestamps", "ratings"]
    rows = np.random.default_rng(0).permutation(table.num_rows)
    batches = list(bench_ingest.shuffled_batches(table, rows, 64, lists))
    assert [len(b["user_ids"]) for b in batches] == [64] * (len(rows) // 64) + [len(rows) % 64]
    users = table.column("user_id").to_numpy()
    np.testing.assert_array_equal(np.concatenate([b["user_ids"].numpy() for b in batches]), users[rows])
    for name in lists:
        want = table.column(name).to_pylist()
        got = [b[name][a:z].tolist() for b in batches
               for a, z in zip(b[name + "_offsets"][:-1].tolist(), b[name + "_offsets"][1:].tolist())]
        assert got == [pytest.approx(want[r]) for r in rows.tolist()], name


def test_mem_contenders_run_in_fresh_processes(tmp_path, monkeypatch):
    """A memory pool keeps what an earlier contender freed: on ``mem`` a contender is measured by a bench process of
    its own, given this run's other options (the dataset, contender and output options replaced)."""
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("NUMBA_CACHE_DIR", os.environ.get("NUMBA_CACHE_DIR", "/tmp/numba-cache"))
    argv = ["--quick", "--mem-rows", "300", "--datasets", "short,mem", "--contenders=floor,ours", "--warmups", "0",
            "--num-cpus", "1", "--data-dir", str(tmp_path / "data"), "--json-out", str(tmp_path / "parent.json")]
    row = bench_ingest.measure_in_child("floor", argv)
    assert row["dataset"] == "mem" and row["contender"] == "floor" and row["complete"] and row["rows"] == 300
    assert row["bench_pid"] != os.getpid() and not (tmp_path / "parent.json").exists()


def test_shuffle_window_reaches_the_loaders_of_ours(monkeypatch):
    """``--shuffle-window`` is what the memory table of docs/benchmarks.md varies: it must reach ours' loader (and
    be left to the loader's default when not given)."""
    import loader

    seen = []

    class Stop(Exception):
        pass

    def fake(path, **kwargs):
        seen.append(kwargs)
        raise Stop

    monkeypatch.setattr(loader, "SequenceLoader", fake)
    ds = {"path": "unused", "rows": 10}
    for argv, want in ((["--shuffle-window", "4096"], 4096), ([], None)):
        with pytest.raises(Stop):
            bench_ingest.run_ours(ds, [], bench_ingest.run_config(bench_ingest.parse_args(argv), "short"), {})
        assert seen[-1].get("shuffle_window") == want


def _row(contender: str, rows_per_s: float, cpu_s_per_row: float, wall_s: float, first: float = 0.5) -> dict:
    """A measured row as :func:`measure` returns it, with the fields the rounds and verdicts read."""
    return {"dataset": "short", "contender": contender, "available": True, "error": None, "complete": True,
            "rows_per_s": rows_per_s, "cpu_s_per_row": cpu_s_per_row, "first_batch_s": first, "wall_s": wall_s,
            "peak_mem_mib": wall_s, "mem_rise_mib": 1.0, "peak_rss_mib": 2.0, "all_walls_s": [wall_s],
            "all_cpu_s": [1.0], "all_foreign_cpu_s": [0.0], "warmup_first_batch_s": [first], "runs": "best of 1"}


def test_rounds_alternate_and_each_ratio_is_the_median_of_its_rounds(capsys):
    assert bench_ingest.contender_turns(["spdl", "ours", "named2"], 3) == [
        (0, "spdl"), (0, "ours"), (0, "named2"), (1, "named2"), (1, "ours"), (1, "spdl"),
        (2, "spdl"), (2, "ours"), (2, "named2")]
    # the machine drifts: spdl's passes speed up while ours' passes stay beside them
    spdl = bench_ingest.merge_rounds([_row("spdl", 100.0, 3.0, 3.0), _row("spdl", 150.0, 2.0, 2.0),
                                      _row("spdl", 90.0, 3.3, 3.3)])
    ours = bench_ingest.merge_rounds([_row("ours", 95.0, 3.3, 3.2), _row("ours", 120.0, 2.6, 2.5),
                                      _row("ours", 88.0, 3.5, 3.4)])
    assert ours["wall_s"] == 2.5 and ours["all_walls_s"] == [3.2, 2.5, 3.4] and ours["peak_mem_mib"] == 3.4
    assert [r["rows_per_s"] for r in ours["rounds"]] == [95.0, 120.0, 88.0]
    entry = bench_ingest.verdicts([spdl, ours], [{"name": "short"}])["datasets"]["short"]
    rows, cpu = entry["ours_vs_spdl_rows_per_s"], entry["ours_vs_spdl_cpu_per_row"]
    assert rows["rounds"] == pytest.approx([0.95, 0.8, 88 / 90]) and rows["value"] == pytest.approx(0.95)
    assert rows["best_passes"] == pytest.approx(0.8) and rows["verdict"] == "PASS"  # the best passes alone: FAIL
    assert cpu["value"] == pytest.approx(3.3 / 3.0) and cpu["verdict"] == "PASS"
    assert cpu["best_passes"] == pytest.approx(1.3)
    assert "median of 3 rounds: 0.95, 0.80, 0.98" in capsys.readouterr().out


def test_a_failed_round_is_the_contenders_row():
    failed = {**_row("ours", 1.0, 1.0, 1.0), "error": "RuntimeError: lost"}
    assert bench_ingest.merge_rounds([_row("ours", 2.0, 1.0, 1.0), failed])["error"] == "RuntimeError: lost"
    one = _row("ours", 2.0, 1.0, 1.0)
    assert bench_ingest.merge_rounds([one]) is one and "rounds" not in one

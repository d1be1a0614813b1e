"""``bench/ingest.py``: its argument checks, and one end-to-end run at tiny sizes (every contender on both shapes,
a local Ray of its own, started and shut down by the script)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import load

SCRIPT = Path(__file__).parents[2] / "bench" / "ingest.py"
bench_ingest = load("ingest")


@pytest.mark.parametrize("argv, message", [
    (["--contenders", "floor,spdl"], "--contenders: unknown ['spdl']"),
    (["--datasets", ""], "--datasets: unknown empty list"),
    (["--short-rows", "0"], "--short-rows must be >= 1, got 0"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--ranks", "16", "--samples-per-step", "8"], "a global batch of 8 samples is below --ranks 16"),
    (["--ranks", "200", "--datasets", "movielens"], "a global batch of 128 samples is below --ranks 200"),
])
def test_bad_arguments_name_the_value(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_ingest.parse_args(argv)
    assert message in capsys.readouterr().err


def test_quick_defaults():
    args = bench_ingest.parse_args(["--quick", "--short-rows", "50"])
    assert args.rows == {"long": 10_000, "short": 50} and args.repeats == 1 and args.quiet_wait == 0
    args = bench_ingest.parse_args([])
    assert args.rows == {"long": 120_000, "short": 1_500_000} and args.repeats == 2 and args.datasets == ["long", "short"]


@pytest.mark.slow
def test_end_to_end_tiny(tmp_path):
    pytest.importorskip("pydantic", reason="Ray Data's iter_torch_batches needs the bench extra (pydantic)")
    out = tmp_path / "bench.json"
    env = {**os.environ, "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", "/tmp/numba-cache"),
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    # short: 2001 rows, so raysplit's equal split over 2 ranks drops exactly one
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--long-rows", "300", "--short-rows", "2001",
                           "--ranks", "2", "--microbatches", "2", "--samples-per-step", "256", "--warmups", "0",
                           "--num-cpus", "2", "--data-dir", str(tmp_path / "data"), "--json-out", str(out)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result  # the JSON line is printed last
    assert "== targets (issue 16" in proc.stdout
    assert [d["name"] for d in result["datasets"]] == ["long", "short"]
    assert [d["params"]["median"] for d in result["datasets"]] == [400, 15]
    got = {(r["dataset"], r["contender"]): r for r in result["rows"]}
    assert set(got) == {(d, c) for d in ("long", "short") for c in bench_ingest.CONTENDERS}
    for (dataset, contender), row in got.items():
        assert row["available"] and row["error"] is None and row["complete"], (dataset, contender, row)
        # CPU comes in 10 ms clock ticks: a tiny pass on warm readers can take none
        assert row["rows_per_s"] > 0 and row["cpu_s"] >= 0 and row["cpu_s_per_mrow"] == pytest.approx(
            row["cpu_s"] / row["rows"] * 1e6)
        assert 0 < row["first_batch_s"] <= row["wall_s"]
        assert row["consumers"] == (2 if contender in ("raysplit", "ours", "ours_dl") else 1)
    assert got["short", "raysplit"]["rows"] == 2000 and got["short", "raysplit"]["dropped_rows"] == 1
    assert got["short", "raysplit"]["batch_size_per_split"] == 128 and got["short", "ours"]["rows"] == 2001
    assert got["long", "ours"]["equal_microbatches"] and got["long", "ours_dl"]["equal_microbatches"]
    assert got["short", "ours_dl"]["rows"] == 2001
    targets = result["targets"]
    for dataset in ("long", "short"):
        entry = targets["datasets"][dataset]
        for key in ("ours_vs_raydata_rows_per_s", "ours_vs_raydata_cpu_per_row", "ours_vs_raysplit_rows_per_s",
                    "ours_vs_raysplit_cpu_per_row", "ours_first_batch_s", "ours_vs_floor_rows_per_s",
                    "ours_dl_vs_ours_rows_per_s"):
            least = 0 if "cpu" in key else 1e-12  # ours' CPU can be 0 ticks (above)
            assert entry[key]["value"] >= least and entry[key]["verdict"] in ("PASS", "FAIL"), (dataset, key)
        assert entry["raydata_vs_floor_rows_per_s"] > 0 and entry["raysplit_vs_floor_rows_per_s"] > 0
    assert isinstance(targets["all_targets_pass"], bool) and isinstance(targets["all_goals_pass"], bool)

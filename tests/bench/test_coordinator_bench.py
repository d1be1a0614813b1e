"""``bench/coordinator.py``: its argument checks, and end-to-end runs at tiny sizes (not a timing test): the
run completes and every rank receives every step exactly once."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import load, refused

SCRIPT = Path(__file__).parents[2] / "bench" / "coordinator.py"
bench_coordinator = load("coordinator")


@pytest.mark.parametrize("argv, message", [
    (["--ranks", "10", "--nodes", "4"], "--nodes 4 does not divide --ranks 10"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--shape", "medium"], "invalid choice: 'medium'"),
    (["--median", "-3"], "--median must be > 0, got -3.0"),
    (["--max-seq-len", "0"], "--max-seq-len must be >= 1, got 0"),
])
def test_bad_arguments_name_the_value(argv, message, capsys):
    assert message in refused(bench_coordinator, argv, capsys)


def test_defaults_are_the_docs_projection():
    args = bench_coordinator.parse_args([])
    assert (args.ranks, args.nodes, args.microbatches, args.samples_per_step) == (256, 32, 8, 8192)
    assert args.shape == "long" and args.steps == 1000 and not args.no_locality
    assert bench_coordinator.parse_args(["--shape", "short"]).steps == 2000


@pytest.mark.parametrize("extra, locality", [
    (["--shape", "long"], True),
    (["--shape", "short", "--no-locality"], False),
    (["--shape", "long", "--max-seq-len", "50"], True),
])
def test_tiny_run_gives_every_rank_every_step_once(tmp_path, extra, locality):
    out = tmp_path / "coordinator.json"
    env = {**os.environ, "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", "/tmp/numba-cache")}
    steps = 12
    proc = subprocess.run([sys.executable, str(SCRIPT), *extra, "--ranks", "8", "--nodes", "2", "--microbatches", "2",
                           "--samples-per-step", "64", "--steps", str(steps), "--rows-per-group", "100",
                           "--quiet-wait", "0", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=120, env=env, cwd=SCRIPT.parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result  # the JSON line is printed last
    row = result["row"]
    assert row["complete"] and row["every_rank_every_step_once"] and row["every_row_once"]
    assert row["steps_per_rank"] == [steps]  # equal step counts on every rank
    assert row["microbatches_per_step_ok"] and row["locality"] is locality
    assert row["ranks"] == 8 and row["nodes"] == 2 and row["rows"] == steps * 64
    assert row["stats"]["rows_delivered"] == steps * 64 and row["stats"]["steps"] == steps
    # the first message holds one step, then 2, 4, ...: 12 steps -> messages of 1, 2, 4, 5
    assert row["rank_messages"] == 8 * 4 and row["steps_per_message"]["max"] == 5
    assert row["wall_s"] > 0 and row["cpu_s"] > 0 and row["control_bytes_out_per_step"] > 0
    truncated = "--max-seq-len" in extra
    assert row["max_seq_len"] == (50 if truncated else None) and (row["stats"]["rows_truncated"] > 0) is truncated
    assert "checks: " in proc.stdout and ": PASS" in proc.stdout and "| steps/s |" in proc.stdout

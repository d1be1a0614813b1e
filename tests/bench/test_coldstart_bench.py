"""``bench/coldstart.py``: its argument checks, and one run at tiny size (not a timing test): it decodes exactly
the loader's first shuffle block, in processes and in threads, and reports every figure."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loader.stages.decode import read_unit
from tests.loader.helpers import synth
from tests.bench import load, refused

SCRIPT = Path(__file__).parents[2] / "bench" / "coldstart.py"
bench_coldstart = load("coldstart")


@pytest.mark.parametrize("argv, message", [
    (["--procs", "0"], "--procs must be >= 1, got 0"),
    (["--samples-per-step", "0"], "--samples-per-step must be >= 1, got 0"),
    (["--rest", "-1"], "--rest must be >= 0, got -1.0"),
])
def test_bad_arguments_name_the_value(argv, message, capsys):
    assert message in refused(bench_coldstart, argv, capsys)


def test_decodes_the_loaders_first_block(tmp_path):
    data = synth(tmp_path / "d", users=300, files=3, rows_per_group=40)
    index, units = bench_coldstart.first_block(str(data), 3, 32, 100)
    # an epoch's first block holds one global batch (32 rows), not a window (100): one row group of 40 rows
    assert 32 <= sum(index.units[u].rows for u in units) < 72 and len(set(units)) == len(units)
    expected = sum(a.nbytes for u in units for r in [read_unit(index, u, max_seq_len=None, skip_corrupt=False).rows]
                   for a in (r.user_ids, r.offsets, r.cut, *r.events.values()))
    out = tmp_path / "cold.json"
    env = {**os.environ, "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", str(tmp_path / "numba"))}
    subprocess.run([sys.executable, str(SCRIPT), "--data", str(data), "--seed", "3", "--samples-per-step", "32",
                    "--shuffle-window", "100", "--rest", "0", "--json-out", str(out)],
                   check=True, env=env, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    assert result["block_row_groups"] == len(units) and result["decoded_bytes"] == expected
    # every decode takes time: a wall of 0 or below (rounded to 0.1 ms) is a clock read in the wrong place (the
    # parent woke from the barrier after a child's decode ended: -0.0001 s once)
    for key in ("decode_cold_s", "decode_warm_s", "threads_cold_s", "threads_warm_s", "reader_start_wall_s",
                "reader_start_cpu_s"):
        assert result[key] > 0, key
    assert isinstance(result["touch_fresh_s"], float) and isinstance(result["touch_again_s"], float)

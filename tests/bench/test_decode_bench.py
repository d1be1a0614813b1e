"""``bench/decode.py``: its argument checks, and one run at tiny size (not a timing test): every way reads the
same row group and reports its figures."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import load, refused
from tests.loader.helpers import synth

SCRIPT = Path(__file__).parents[2] / "bench" / "decode.py"
bench_decode = load("decode")


@pytest.mark.parametrize("argv, message", [
    (["--datasets", "long,nope"], "unknown datasets ['nope']"),
    (["--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["--unit", "-1"], "--unit must be >= 0, got -1"),
])
def test_bad_arguments_name_the_value(argv, message, capsys):
    assert message in refused(bench_decode, argv, capsys)


def test_reads_one_row_group_each_way(tmp_path):
    data = synth(tmp_path / "d", users=120, files=2, rows_per_group=20)
    out = tmp_path / "decode.json"
    env = {**os.environ, "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", str(tmp_path / "numba"))}
    subprocess.run([sys.executable, str(SCRIPT), "--data", str(data), "--unit", "2", "--repeats", "1",
                    "--json-out", str(out)], check=True, env=env, timeout=300, capture_output=True)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["rows"] == 20 and row["unit"] == 2
    assert row["whole"]["units"] == row["loader"]["units"] == 1 and row["parts"]["units"] >= 2
    for way in bench_decode.WAYS:
        assert row[way]["cpu_s"] > 0 and row[way]["wall_s"] > 0 and "peak_rise_mib" in row[way], way

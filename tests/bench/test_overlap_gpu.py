"""``bench/overlap_gpu.py``: its ``--smoke`` CPU mode (helpers, argument parsing, the spawn scaffolding of part 2
with a stub gloo exchange, the JSON line), the no-CUDA exit, and (``gpu``-marked) the real script at tiny sizes.

The script runs as a subprocess: part 2 spawns ranks, which must import its worker from ``__main__``."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

SCRIPT = Path(__file__).parents[2] / "bench" / "overlap_gpu.py"


def _run(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    # PYTHONPATH: the repository's packages also where the project is not installed (the GPU machines' image)
    env = {**os.environ, "NUMBA_CACHE_DIR": os.environ.get("NUMBA_CACHE_DIR", "/tmp/numba-cache"),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(SCRIPT.parents[1]), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=SCRIPT.parents[1])


def test_smoke_runs_the_logic_on_cpu(tmp_path):
    out = tmp_path / "overlap.json"
    proc = _run("--smoke", "--worlds", "2,3", "--json-out", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == result  # the JSON line is printed last
    assert result["bench"] == "overlap_gpu" and result["smoke"] and "commit" in result["provenance"]
    checks = result["checks"]
    assert checks["median"] == 2.0 and math.isclose(checks["slowdown"], 0.02)
    assert checks["gbps"] == 4.0 and checks["even_counts"] == [4, 3, 3] and checks["collective_seconds"] == [3.0, 2.0]
    assert checks["chunks"] == math.ceil(1.25 * 0.1 * 10e9 / (1 << 20)) + 1
    assert checks["rate_inside"] == [1.0, 3]  # ends 2, 3, 4 ms inside [1.5, 4.5]: 2 MB in 2 ms
    assert result["config"]["worlds"] == [2, 3] and result["config"]["steps"] == 4  # given options beat --smoke's
    assert [row["world"] for row in result["all_to_all"]] == [2, 3]
    for row in result["all_to_all"]:
        assert row["equal"] and row["bytes_per_rank"] == 1 << 20 and row["ce_gbps"] > 0 and row["sm_gbps"] > 0


def test_without_cuda_it_exits_2_with_a_message():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    proc = _run("--parts", "3")
    assert proc.returncode == 2
    assert "needs a CUDA device" in proc.stderr and "--smoke" in proc.stderr


def test_unknown_mode_is_an_argument_error():
    proc = _run("--smoke", "--modes", "sm,nvlink")
    assert proc.returncode == 2 and "unknown transfer mode(s) ['nvlink']" in proc.stderr


@pytest.mark.gpu
def test_quick_run_on_a_gpu(tmp_path):
    out = tmp_path / "overlap.json"
    proc = _run("--quick", "--json-out", str(out), timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    for row in result["attention_overlap"]:
        assert "error" not in row, row
        assert set(row["modes"]) == {"sm", "ce_d2d", "ce_d2h", "staged"}
        assert all(m["gbps_alone"] > 0 and m["beside_step_s"] > 0 for m in row["modes"].values())
    for row in result["all_to_all"]:
        assert "error" not in row and row["equal"], row
    for row in result["compression"]:
        assert "error" not in row and row["bound_holds"] and row["equals_cpu_reference"] and row["triton_equals_cu"], row

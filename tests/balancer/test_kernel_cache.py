"""numba's cache of the planner's kernels follows every file of ``balancer.kernels``, not only the kernel's own."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORDER = ("import numpy as np; from balancer.kernels.order import order_by_length_desc; "
         "print(order_by_length_desc(np.full(8, 3, dtype=np.int64), 7).tolist())")


def test_a_kernel_compiles_again_when_a_kernel_it_calls_from_another_file_changes(tmp_path):
    """``order_by_length_desc`` (order.py) orders equal lengths by ``splitmix64`` (common.py). Cached, then with
    common.py's stream changed, it must give the new order: numba alone stamps the cache with order.py only and
    would load the old code."""
    shutil.copytree(ROOT / "balancer", tmp_path / "src" / "balancer", ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": str(tmp_path / "src")}

    def order() -> str:
        done = subprocess.run([sys.executable, "-c", ORDER], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip()

    first = order()
    assert list((tmp_path / "cache").rglob("order.order_by_length_desc-*.nbi")), "the kernel was not cached"
    common = tmp_path / "src" / "balancer" / "kernels" / "common.py"
    text = common.read_text()
    changed = text.replace("0x9E3779B97F4A7C15", "0x9E3779B97F4A7C17")
    assert changed != text
    common.write_text(changed)
    second = order()
    assert second != first
    assert order() == second  # and cached again

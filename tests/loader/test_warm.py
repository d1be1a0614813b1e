"""``freescale warm``: every kernel a loader run calls is ready after it (loaded, not compiled, by a later run)."""

import json
import os
import subprocess
import sys
from pathlib import Path

from .helpers import messy, synth

ROOT = Path(__file__).resolve().parents[2]

# warm_kernels, then loader runs over other data and with other arguments: a kernel signature the runs call that
# the warm-up did not is one a run on a machine warmed this way would wait for numba's compiler on.
SCRIPT = """
import json, sys
from loader import SequenceLoader
from loader.config import LoaderConfig
from loader.warm import signatures, warm_kernels

runs = json.loads(sys.argv[1])
warmed = warm_kernels(LoaderConfig(ranks=3, microbatches=2, samples_per_step=6))
before = signatures()
for path, options in runs:
    with SequenceLoader(path, ranks=3, microbatches=2, backend="inline", **options) as loader:
        for _ in loader.iter_steps():
            pass
after = signatures()
print(json.dumps({"warmed": str(warmed), "signatures": warmed.signatures,
                  "added": {k: sorted(map(str, v - before.get(k, set()))) for k, v in after.items()
                            if v - before.get(k, set())}}))
"""


def test_after_warm_a_run_calls_no_kernel_signature_it_did_not(tmp_path):
    bad, _ = messy(tmp_path / "messy")
    good = synth(tmp_path / "synth", users=300, max_len=300, files=2, rows_per_group=50)
    runs = [(str(bad), dict(samples_per_step=17, max_seq_len=12, skip_corrupt=True)),
            (str(good), dict(samples_per_step=40, shuffle_window=120, compose_window=3, equal_count=True)),
            (str(good), dict(samples_per_step=24, max_tokens=3000, max_seq_len=200, drop_last=True)),
            (str(good), dict(samples_per_step=30, ranks_per_node=1)),  # three trainer nodes: locality-aware plans
            (str(good), dict(samples_per_step=36, ranks_per_node=1, equal_count=True))]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(runs)], capture_output=True, text=True,
                          timeout=280, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["signatures"] > 5 and out["warmed"].startswith("numba kernels ready in ")
    assert out["added"] == {}, out["added"]


def test_the_cli_says_what_is_ready_and_where(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "freescale", "warm", "--ranks", "2", "--microbatches", "2"],
                          capture_output=True, text=True, timeout=280, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    line = done.stdout.strip().splitlines()[-1]
    assert line.startswith("numba kernels ready in ") and line.endswith(f"cache: {os.environ['NUMBA_CACHE_DIR']}")
    bad = subprocess.run([sys.executable, "-m", "freescale", "warm", "--ranks", "0"], capture_output=True, text=True,
                         timeout=120, env=env, cwd=tmp_path)
    assert bad.returncode == 2 and "ranks" in bad.stderr

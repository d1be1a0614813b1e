"""The trainer's GPU path needs no Ray: the GPU machines' images have none (docs/benchmarks.md, "Runbook").
Importing its entry points loads no ``ray`` module, and a run with the inline loader goes through where
``import ray`` fails."""

import json
import os
import subprocess
import sys
from pathlib import Path

from analysis.synth import write_synthetic

ROOT = Path(__file__).resolve().parents[2]
# what `make gpu-check` and `freescale train` import: the trainer, its CLI, the CUDA build, the GPU benches
ENTRY_POINTS = ("trainer.train", "trainer.command", "trainer.launch", "freescale.cli", "cuda_ext.build")
BENCHES = ("train_gpu", "overlap_gpu")

IMPORT_ALL = f"""
import importlib, importlib.util, json, sys
for name in {ENTRY_POINTS!r}:
    importlib.import_module(name)
for name in {BENCHES!r}:
    spec = importlib.util.spec_from_file_location("bench_" + name, {str(ROOT / "bench")!r} + "/" + name + ".py")
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
print(json.dumps(sorted(m for m in sys.modules if m == "ray" or m.startswith("ray."))))
"""


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*extra.pop("first", []), str(ROOT)]),
            "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", **extra}


def test_the_trainer_entry_points_and_gpu_benches_import_no_ray():
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL], env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert not loaded, f"importing the trainer's GPU path loaded {len(loaded)} ray modules: {loaded[:3]} ..."


def test_freescale_train_runs_where_ray_cannot_be_imported(tmp_path):
    shadow = tmp_path / "shadow" / "ray"  # first on the path: `import ray` fails, as on a machine without it
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('ray was imported on the trainer path')\n")
    data = tmp_path / "data"
    write_synthetic(data, users=60, max_len=24, items=100, seed=1, files=1)
    cmd = [sys.executable, "-m", "freescale", "train", "--data", str(data), "--nproc", "1", "--steps", "2",
           "--microbatches", "2", "--samples-per-step", "8", "--d-model", "8", "--layers", "1", "--heads", "1",
           "--max-len", "16", "--negatives", "4"]
    done = subprocess.run(cmd, env=_env(first=[str(tmp_path / "shadow")]), capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "ray was imported" not in done.stderr

"""scripts/gpu_check.sh (`make gpu-check`) on the CPU: its argument handling, its refusal without a CUDA device,
and its step runner (every step runs, a failed one makes the exit status 1) with a stand-in interpreter. The GPU
steps themselves run only on a CUDA machine."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

# An interpreter that claims one CUDA device and whose `-m cuda_ext.build` fails: every other step "passes"
STAND_IN = """#!/usr/bin/env bash
case "$*" in
    "-c "*) echo "torch 9.9.9+stand-in, 1 x Stand-in GPU" ;;
    "-m cuda_ext.build") echo "nvcc: not found" >&2; exit 3 ;;
    *) echo "ran: $*" ;;
esac
"""


def run(args, *, python=sys.executable, make=False, timeout=120):
    env = {**os.environ, "PYTHON": str(python)}
    cmd = ["make", "-s", "gpu-check", f"PYTHON={python}", *args] if make else ["bash", str(SCRIPT), *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_without_a_cuda_device_it_says_so_and_stops_before_any_step(tmp_path):
    out = tmp_path / "out"
    done = run([str(out)])  # this interpreter's torch: the CPU build, or no GPU
    assert done.returncode == 2, done.stdout + done.stderr
    assert "gpu_check: no CUDA device:" in done.stderr and "sees none" in done.stderr
    assert not out.exists()  # no step ran, nothing written


def test_bad_arguments_and_a_missing_interpreter_are_named():
    done = run(["a", "b"])
    assert done.returncode == 2 and "one argument (the output folder) expected, got 2: a b" in done.stderr
    done = run(["--out"])
    assert done.returncode == 2 and "unknown option '--out'" in done.stderr
    done = run([], python="/nonexistent/python3")
    assert done.returncode == 2 and "no python: '/nonexistent/python3' is not on PATH" in done.stderr
    done = run(["--help"])
    assert done.returncode == 0 and done.stdout.startswith("usage: scripts/gpu_check.sh [OUT]")


def test_every_step_runs_and_a_failed_one_fails_the_check(tmp_path):
    python = tmp_path / "python3"
    python.write_text(STAND_IN)
    python.chmod(0o755)
    out = tmp_path / "gpu"
    done = run([f"OUT={out}"], python=python, make=True)  # the make target: no .venv, the given interpreter
    assert done.returncode != 0, done.stdout + done.stderr
    assert "1 step(s) failed: build" in done.stderr
    summary = (out / "summary.txt").read_text().splitlines()
    assert summary[0] == "torch 9.9.9+stand-in, 1 x Stand-in GPU"
    names = [line.split(":")[0] for line in summary[1:7]]
    # warm runs in the background beside overlap_gpu and attention_gpu: its line lands after build, among theirs
    assert [n for n in names if n != "warm"] == ["build", "overlap_gpu", "attention_gpu", "pytest_gpu", "train_gpu"]
    assert 1 <= names.index("warm") <= 3, names  # after build, before pytest_gpu
    assert summary[1].startswith("build: FAILED (exit 3)") and all(": ok in " in line for line in summary[2:7])
    assert (out / "build.log").read_text() == "nvcc: not found\n"
    assert (out / "warm.log").read_text() == "ran: -m freescale warm\n"
    assert (out / "pytest_gpu.log").read_text() == (
        "ran: -m pytest -m gpu -rs --durations=15 tests/cuda_ext tests/bench tests/trainer\n")
    assert (out / "train_gpu.log").read_text() == f"ran: bench/train_gpu.py --json-out {out}/train_gpu.json\n"
    assert (out / "attention_gpu.log").read_text() == (
        f"ran: bench/attention_gpu.py --json-out {out}/attention_gpu.json\n")


def test_the_step_limits_sum_to_under_ten_minutes():
    text = SCRIPT.read_text()
    limits = {words[i + 1]: int(words[i + 2]) for words in map(str.split, text.splitlines())
              for i, word in enumerate(words[:-2]) if word == "step" and words[i + 2].isdigit()}
    assert sorted(limits) == ["attention_gpu", "build", "overlap_gpu", "pytest_gpu", "train_gpu", "warm"], limits
    # warm runs beside overlap_gpu and attention_gpu; the others one after another
    worst = (limits["build"] + max(limits["warm"], limits["overlap_gpu"] + limits["attention_gpu"])
             + limits["pytest_gpu"] + limits["train_gpu"])
    assert worst < 600, limits
    assert f"together {worst} s" in text  # the header says the worst case it has

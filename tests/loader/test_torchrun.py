"""A named loader in one of torchrun's processes with no Ray running: a clear error, not a private Ray per
process where each rank would wait alone on its own coordinator. No Ray session in this module: ``ray.init(
address="auto")`` would find one on this machine and join it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import synth


def _ray_runs() -> bool:
    """Whether a Ray GCS process (not a zombie) runs on this machine."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        if "(gcs_server)" in text and text[text.rindex(")") + 2] != "Z":
            return True
    return False


@pytest.mark.serial  # another test's Ray, running meanwhile, would skip it
def test_torchrun_processes_without_a_running_ray_are_told_to_start_one(tmp_path):
    if _ray_runs():
        pytest.skip("a Ray runs on this machine: ray.init(address='auto') joins it, as it should")
    data = synth(tmp_path / "d", users=40, files=1)
    env = {**os.environ, "WORLD_SIZE": "2"}
    env.pop("RAY_ADDRESS", None)
    code = f"from loader import SequenceLoader; SequenceLoader({str(data)!r}, ranks=2, microbatches=1, " \
           "samples_per_step=20, name='torchrun-job')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "loader named 'torchrun-job' is shared by the 2 trainer processes" in done.stderr
    assert "start it first (`ray start --head`, or set RAY_ADDRESS" in done.stderr

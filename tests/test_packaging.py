"""The installed package (what `pip install .` and deploy/Dockerfile put in an image) carries its non-Python
files: the CUDA sources that cuda_ext compiles on first use, the bundled MovieLens sample, and the real
datasets' length histograms that analysis.workloads.dataset_lengths reads."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("freescale", "analysis", "balancer", "loader", "trainer", "cuda_ext")


def test_wheel_ships_the_cuda_sources_and_the_sample_data(tmp_path):
    pytest.importorskip("setuptools", reason="building a wheel without network needs setuptools installed")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:  # a copy: the build writes build/ and *.egg-info next to the sources
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "wheel"), str(src)], check=True)
    (wheel,) = (tmp_path / "wheel").glob("freescale-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.name for p in (ROOT / "cuda_ext").glob("*.cu"))
    assert sources and {f"cuda_ext/{name}" for name in sources} <= names
    sample = ROOT / "loader" / "sample_data" / "ml-latest-small"
    assert {f"loader/sample_data/ml-latest-small/{p.name}" for p in sample.iterdir()} <= names
    assert "analysis/data/length_histograms.json" in names

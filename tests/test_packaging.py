"""The installed package (what `pip install .` and deploy/Dockerfile put in an image) carries its non-Python
files: the CUDA sources that cuda_ext compiles on first use, the bundled MovieLens sample, and the real
datasets' length histograms that analysis.workloads.dataset_lengths reads."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

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


def test_the_package_asks_for_a_torch_range_and_make_pins_it_by_constraints():
    # pip install on a GPU machine keeps the CUDA torch it has; `make` (and CI through it) installs the pinned wheel
    tomllib = pytest.importorskip("tomllib")
    requirements = pytest.importorskip("packaging.requirements")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch,) = [r for r in map(requirements.Requirement, project["dependencies"]) if r.name == "torch"]
    assert all(spec.operator not in ("==", "===", "~=") for spec in torch.specifier), f"pyproject pins {torch}"
    assert torch.specifier.contains("2.5.0") and torch.specifier.contains("2.11.0")  # the GPU images' torch
    pins = [requirements.Requirement(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    (pin,) = [r for r in pins if r.name == "torch"]
    assert str(pin.specifier) == "==2.13.0" and torch.specifier.contains("2.13.0")
    installs = [line for line in (ROOT / "Makefile").read_text().splitlines() if "pip install" in line
                and "-e " in line]
    assert installs and all("-c constraints.txt" in line for line in installs), installs

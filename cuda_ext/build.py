"""Compile every `cuda_ext/*.cu` with nvcc into one shared library, cached by a hash of what went into it.

Plain CUDA runtime API (cudart linked statically), no torch headers: the build needs nvcc, not a CUDA build
of torch, and the library loads with ctypes even where no GPU driver is installed (CUDA calls fail later).

    python -m cuda_ext.build            # builds (or finds) the library and prints its path

The library is `libfreescale_cuda-<hash>.so` in `$FREESCALE_CUDA_CACHE` (else `~/.cache/freescale/cuda`);
the hash covers every source, the nvcc version and the flags, so a change to any of them builds a new file.
Architectures: `$FREESCALE_CUDA_ARCH` (e.g. `sm_90` or `80,90`), else the visible GPUs' compute capability
(nvidia-smi), else sm_90; PTX of the newest one is embedded for forward compatibility.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
LIB_NAME = "libfreescale_cuda"
DEFAULT_ARCH = "90"
FALLBACK_CUDA_HOME = Path("/usr/local/cuda")  # where CUDA installs when neither CUDA_HOME nor PATH says
BASE_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-cudart", "static")


def find_nvcc() -> Path:
    """$CUDA_HOME/bin/nvcc, else nvcc on PATH, else FALLBACK_CUDA_HOME/bin/nvcc; a clear error without one."""
    cuda_home = os.environ.get("CUDA_HOME")
    candidates = [Path(cuda_home) / "bin" / "nvcc"] if cuda_home else []
    on_path = shutil.which("nvcc")
    candidates += [Path(on_path)] if on_path else []
    candidates.append(FALLBACK_CUDA_HOME / "bin" / "nvcc")
    for nvcc in candidates:
        if nvcc.is_file() and os.access(nvcc, os.X_OK):
            return nvcc
    raise RuntimeError(
        f"nvcc not found (CUDA_HOME={cuda_home!r}, not on PATH, not in {FALLBACK_CUDA_HOME}/bin); cuda_ext "
        f"needs the CUDA toolkit compiler: install it (e.g. `apt-get install cuda-toolkit-13-0` or "
        f"`conda install -c nvidia cuda-nvcc`) and put its bin/ on PATH, or set CUDA_HOME to the toolkit folder")


def cache_dir() -> Path:
    """$FREESCALE_CUDA_CACHE, else ~/.cache/freescale/cuda."""
    return Path(os.environ.get("FREESCALE_CUDA_CACHE") or Path.home() / ".cache" / "freescale" / "cuda")


def _visible_archs() -> list[str]:
    """Compute capabilities of the visible GPUs as ["90", ...] (empty without nvidia-smi or a GPU)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({line.strip().replace(".", "") for line in out.splitlines() if line.strip()})


def archs() -> list[str]:
    """The architectures to build for, as ["80", "90", ...] sorted ascending."""
    spec = os.environ.get("FREESCALE_CUDA_ARCH", "")
    found = [a.strip().removeprefix("sm_").removeprefix("compute_") for a in spec.split(",") if a.strip()]
    for arch in found:
        if not arch.rstrip("af").isdigit():
            raise ValueError(f"FREESCALE_CUDA_ARCH={spec!r} has {arch!r}, which is not an architecture; "
                             f"give compute capabilities like 'sm_90' or '80,90'")
    return sorted(set(found), key=lambda a: int(a.rstrip("af"))) or _visible_archs() or [DEFAULT_ARCH]


def flags(arch_list: list[str]) -> list[str]:
    """nvcc flags: BASE_FLAGS, SASS for every arch and PTX of the newest one."""
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in arch_list]
    gencode.append(f"-gencode=arch=compute_{arch_list[-1]},code=compute_{arch_list[-1]}")
    return [*BASE_FLAGS, *gencode]


def sources() -> list[Path]:
    """Every cuda_ext/*.cu, sorted by name."""
    found = sorted(SOURCE_DIR.glob("*.cu"))
    if not found:
        raise RuntimeError(f"no .cu sources in {SOURCE_DIR}; the cuda_ext package is incomplete")
    return found


def _nvcc_version(nvcc: Path) -> str:
    return subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout


def library_path(nvcc: Path, nvcc_flags: list[str], srcs: list[Path]) -> Path:
    """Where the library of these inputs lives: the name carries a hash of sources, nvcc version and flags."""
    digest = hashlib.sha256()
    for part in (_nvcc_version(nvcc), " ".join(nvcc_flags)):
        digest.update(part.encode() + b"\0")
    for src in srcs:
        digest.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    return cache_dir() / f"{LIB_NAME}-{digest.hexdigest()[:16]}.so"


def _run_nvcc(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed on {what} (exit {done.returncode}):\n{done.stdout}{done.stderr}\n"
                           f"command: {' '.join(cmd)}")


def build(force: bool = False) -> Path:
    """The shared library of all cuda_ext/*.cu, compiled now unless an identical one is cached (force: always).

    Objects compile in parallel in a private temp folder; the library lands by an atomic rename, so ranks
    that build at the same time never load a half-written file.
    """
    nvcc = find_nvcc()
    srcs = sources()
    nvcc_flags = flags(archs())
    lib = library_path(nvcc, nvcc_flags, srcs)
    if lib.is_file() and not force:
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent, prefix=".build-") as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in srcs]
        with ThreadPoolExecutor(max_workers=min(len(srcs), os.cpu_count() or 1)) as pool:
            compiled = [pool.submit(_run_nvcc, [str(nvcc), *nvcc_flags, "-c", str(src), "-o", str(obj)], str(src))
                        for src, obj in zip(srcs, objects)]
            for job in compiled:
                job.result()
        staged = Path(tmp) / lib.name
        _run_nvcc([str(nvcc), *nvcc_flags, "-shared", *map(str, objects), "-o", str(staged)],
                  f"the link of {lib.name}")
        os.replace(staged, lib)
    return lib


@functools.cache
def load() -> ctypes.CDLL:
    """The library, built on first use (once per process)."""
    return ctypes.CDLL(str(build()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cuda_ext.build",
        description="Compile cuda_ext/*.cu with nvcc into one shared library (cached; also done on first use) "
                    "and print its path. FREESCALE_CUDA_CACHE sets the cache folder, FREESCALE_CUDA_ARCH the "
                    "GPU architectures.")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cached library is current")
    args = parser.parse_args(argv)
    try:
        print(build(force=args.force))
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Compile every `cuda_ext/*.cu` with nvcc into one shared library, cached by a hash of what went into it.

Plain CUDA runtime API, no torch headers: the build needs nvcc, not a CUDA build of torch. The library links
the CUDA runtime *shared* (``-cudart shared``), the same ``libcudart.so.<major>`` torch loads, so the process
has one runtime; `load` makes sure that runtime is loaded first (torch's, else the nvidia-cuda-runtime wheel's,
else the toolkit's) and refuses an nvcc whose CUDA major differs from torch's.

    python -m cuda_ext.build [--arch 80,90]   # builds (or finds) the library and prints its path

The library is `libfreescale_cuda-<hash>.so` in `$FREESCALE_CUDA_CACHE` (else `~/.cache/freescale/cuda`);
the hash covers every source and header, the nvcc version and the flags, so a change to any of them builds a
new file. Architectures: an explicit list (`build(arch_list)`; on the command line `--arch`, else
`$FREESCALE_CUDA_ARCH`, else `$TORCH_CUDA_ARCH_LIST`, parsed by `parse_arch_list`), else the compute
capabilities of the visible GPUs (torch), else `DEFAULT_ARCHS` (no GPU: a build for CI or for later); SASS
for each, PTX of the newest one for forward compatibility.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SOURCE_DIR = Path(__file__).resolve().parent
LIB_NAME = "libfreescale_cuda"
DEFAULT_ARCHS = ("80", "90")  # A100, H100/H200 (PTX of 90 runs on newer GPUs through the driver's JIT)
FALLBACK_CUDA_HOME = Path("/usr/local/cuda")  # where CUDA installs when neither CUDA_HOME nor PATH says
BASE_FLAGS = ("-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-cudart", "shared")


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


def visible_archs() -> list[str]:
    """Compute capabilities of the GPUs torch sees, as ["90", ...] sorted (empty without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return []
    found = {"".join(map(str, torch.cuda.get_device_capability(i))) for i in range(torch.cuda.device_count())}
    return sorted(found, key=int)


def parse_arch_list(spec: str) -> list[str]:
    """Architectures from a list like TORCH_CUDA_ARCH_LIST's ("8.0;9.0+PTX", "8.0 9.0") or nvcc's ("sm_90,80",
    "90a"), as ["80", "90", ...] sorted, duplicates dropped. "+PTX" is accepted and implied: the newest
    architecture always gets PTX."""
    found = []
    for item in re.split(r"[,;\s]+", spec.strip()):
        if not item:
            continue
        arch = item.removesuffix("+PTX").removeprefix("sm_").removeprefix("compute_").replace(".", "")
        if not re.fullmatch(r"\d{2,3}[af]?", arch):
            raise ValueError(f"architecture list {spec!r} has {item!r}, which is not an architecture; give compute "
                             f"capabilities like '9.0', 'sm_90' or '80,90' (TORCH_CUDA_ARCH_LIST's '8.0;9.0+PTX' too)")
        found.append(arch)
    if not found:
        raise ValueError(f"architecture list {spec!r} names no architecture; give e.g. '90' or '8.0;9.0'")
    return sorted(set(found), key=lambda a: int(a.rstrip("af")))


def archs(arch_list: list[str] | None = None) -> list[str]:
    """The architectures to build for: `arch_list` if given, else the visible GPUs', else DEFAULT_ARCHS."""
    return arch_list or visible_archs() or list(DEFAULT_ARCHS)


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


def headers() -> list[Path]:
    """Every cuda_ext/*.cuh the sources include, sorted by name."""
    return sorted(SOURCE_DIR.glob("*.cuh"))


@functools.cache  # build() and load_runtime() both ask: one subprocess per process
def _nvcc_version(nvcc: Path) -> str:
    return subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout


def cuda_major(nvcc: Path) -> int:
    """The CUDA major version of nvcc ("release 13.0" -> 13): the libcudart.so.<major> the library links."""
    found = re.search(r"release (\d+)\.", _nvcc_version(nvcc))
    if found is None:
        raise RuntimeError(f"cannot read the CUDA release from `{nvcc} --version`")
    return int(found.group(1))


def library_path(nvcc: Path, nvcc_flags: list[str], srcs: list[Path]) -> Path:
    """Where the library of these inputs lives: the name carries a hash of sources (and the headers beside
    them), nvcc version and flags."""
    digest = hashlib.sha256()
    for part in (_nvcc_version(nvcc), " ".join(nvcc_flags)):
        digest.update(part.encode() + b"\0")
    for src in [*srcs, *headers()]:
        digest.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    return cache_dir() / f"{LIB_NAME}-{digest.hexdigest()[:16]}.so"


def _run_nvcc(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nvcc failed on {what} (exit {done.returncode}):\n{done.stdout}{done.stderr}\n"
                           f"command: {' '.join(cmd)}")


def compile_commands(nvcc: Path, arch_list: list[str], lib: Path, out_dir: Path) -> list[list[str]]:
    """The nvcc command lines of a build: one compile per source into out_dir, then the link into lib."""
    nvcc_flags = flags(arch_list)
    objects = [out_dir / f"{src.stem}.o" for src in sources()]
    compiles = [[str(nvcc), *nvcc_flags, "-c", str(src), "-o", str(obj)] for src, obj in zip(sources(), objects)]
    return [*compiles, [str(nvcc), *nvcc_flags, "-shared", *map(str, objects), "-o", str(lib)]]


def build(arch_list: list[str] | None = None, *, force: bool = False) -> Path:
    """The shared library of all cuda_ext/*.cu for `archs(arch_list)`, compiled now unless an identical one is
    cached (force: always).

    Objects compile in parallel in a private temp folder; the library lands by an atomic rename, so ranks
    that build at the same time never load a half-written file.
    """
    nvcc = find_nvcc()
    targets = archs(arch_list)
    lib = library_path(nvcc, flags(targets), sources())
    if lib.is_file() and not force:
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent, prefix=".build-") as tmp:
        staged = Path(tmp) / lib.name
        *compiles, link = compile_commands(nvcc, targets, staged, Path(tmp))
        with ThreadPoolExecutor(max_workers=min(len(compiles), os.cpu_count() or 1)) as pool:
            for job in [pool.submit(_run_nvcc, cmd, cmd[-3]) for cmd in compiles]:
                job.result()
        _run_nvcc(link, f"the link of {lib.name}")
        os.replace(staged, lib)
    return lib


def runtime_dirs(nvcc: Path) -> list[Path]:
    """Where a libcudart.so.<major> may be, in the order `load_runtime` tries them: torch's lib folder, the
    nvidia-cuda-runtime wheels (``nvidia/cu<major>/lib`` since CUDA 13, ``nvidia/cuda_runtime/lib`` before),
    then the toolkit of nvcc."""
    found = [Path(root) / "lib" for root in _package_roots("torch")]
    for root in map(Path, _package_roots("nvidia")):
        found += [*sorted(root.glob("cu*/lib")), root / "cuda_runtime" / "lib"]
    for toolkit in dict.fromkeys([nvcc.resolve().parent.parent, FALLBACK_CUDA_HOME]):  # nvcc may be a wrapper
        found += [toolkit / "lib64", toolkit / "lib", *sorted(toolkit.glob("targets/*/lib"))]
    return found


def _package_roots(package: str) -> list[str]:
    """The folders of an installed package (several for a namespace package like nvidia), [] if absent."""
    spec = importlib.util.find_spec(package)
    return list(spec.submodule_search_locations or []) if spec else []


def _loaded(name: str) -> bool:
    """Whether a library of this file name is mapped into this process already (e.g. torch's libcudart)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return any(line.rstrip().endswith("/" + name) for line in maps.splitlines())


def load_runtime(nvcc: Path) -> str:
    """Make sure this process has the one CUDA runtime the library links, before loading the library: torch's
    when it is a CUDA build (a different CUDA major than nvcc's is an error), else the first
    libcudart.so.<major> of `runtime_dirs`. Returns the runtime's file name."""
    major = cuda_major(nvcc)
    import torch

    torch_cuda = torch.version.cuda
    if torch_cuda is not None and int(torch_cuda.split(".")[0]) != major:
        raise RuntimeError(f"nvcc ({nvcc}) is CUDA {major}, but torch {torch.__version__} runs CUDA {torch_cuda}: "
                           f"the library would link a second CUDA runtime; put a CUDA {torch_cuda.split('.')[0]} "
                           f"toolkit's nvcc first on PATH (or CUDA_HOME)")
    name = f"libcudart.so.{major}"
    if _loaded(name):
        return name
    dirs = runtime_dirs(nvcc)
    for folder in dirs:
        if (folder / name).is_file():
            ctypes.CDLL(str(folder / name), mode=ctypes.RTLD_GLOBAL)
            return name
    raise RuntimeError(f"{name} is not loaded and not in {', '.join(map(str, dirs))}; install the CUDA runtime "
                       f"(`pip install nvidia-cuda-runtime-cu{major}` or the CUDA toolkit)")


@functools.cache
def load() -> ctypes.CDLL:
    """The library for the visible GPUs (built on first use, once per process), after its CUDA runtime."""
    lib = build()
    load_runtime(find_nvcc())
    return ctypes.CDLL(str(lib))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cuda_ext.build",
        description="Compile cuda_ext/*.cu with nvcc into one shared library (cached; also done on first use, "
                    "for the visible GPUs) and print its path. FREESCALE_CUDA_CACHE sets the cache folder.")
    parser.add_argument("--arch", help="architectures, e.g. '80,90' or '8.0;9.0+PTX' (default: "
                                       "$FREESCALE_CUDA_ARCH, else $TORCH_CUDA_ARCH_LIST, else the visible GPUs, "
                                       f"else {','.join(DEFAULT_ARCHS)})")
    parser.add_argument("--force", action="store_true", help="rebuild even when the cached library is current")
    args = parser.parse_args(argv)
    spec = args.arch or os.environ.get("FREESCALE_CUDA_ARCH") or os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        print(build(parse_arch_list(spec) if spec else None, force=args.force))
    except (RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

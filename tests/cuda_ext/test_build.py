"""cuda_ext.build: every .cu compiles into one cached library; errors name the file or say how to get nvcc."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from cuda_ext import build

PROBE = 'extern "C" int fs_probe_{tag}() {{ return {value}; }}\n'


def _has_nvcc() -> bool:
    try:
        build.find_nvcc()
    except RuntimeError:
        return False
    return True


needs_nvcc = pytest.mark.skipif(not _has_nvcc(), reason="needs nvcc (the CUDA toolkit compiler)")


@pytest.fixture
def sources(tmp_path, monkeypatch) -> Path:
    """A copy of cuda_ext/*.cu plus probe.cu in a temp source folder; the cache in another temp folder."""
    src = tmp_path / "src"
    src.mkdir()
    for cu in build.SOURCE_DIR.glob("*.cu"):
        shutil.copy(cu, src / cu.name)
    (src / "probe.cu").write_text(PROBE.format(tag="a", value=1))
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    monkeypatch.setenv("FREESCALE_CUDA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("FREESCALE_CUDA_ARCH", "sm_90")
    return src


def _exported(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}


@needs_nvcc
def test_build_compiles_every_source_into_one_loadable_library(sources):
    lib = build.build(force=True)
    assert lib.parent == sources.parent / "cache" and lib.name.startswith("libfreescale_cuda-")
    symbols = _exported(lib)
    assert {"fs_probe_a", "fs_ipc_get_handle", "fs_ipc_open", "fs_ipc_close", "fs_stream_create",
            "fs_memcpy_async", "fs_event_record"} <= symbols
    loaded = ctypes.CDLL(str(lib))  # cudart is linked statically: loads without a GPU driver
    assert loaded.fs_probe_a() == 1
    loaded.fs_error_string.restype = ctypes.c_char_p
    assert loaded.fs_error_string(0) == b"no error"


@needs_nvcc
def test_cache_is_reused_until_a_source_changes(sources):
    first = build.build()
    stamp = first.stat().st_mtime_ns
    assert build.build() == first and first.stat().st_mtime_ns == stamp
    (sources / "probe.cu").write_text(PROBE.format(tag="a", value=2))
    second = build.build()
    assert second != first and second.is_file()
    assert ctypes.CDLL(str(second)).fs_probe_a() == 2


@needs_nvcc
def test_flags_are_part_of_the_name(sources):
    nvcc, srcs = build.find_nvcc(), build.sources()
    assert build.library_path(nvcc, build.flags(["90"]), srcs) != build.library_path(nvcc, build.flags(["80"]), srcs)


@needs_nvcc
def test_compiler_error_names_the_file(sources):
    (sources / "broken.cu").write_text("extern \"C\" int fs_broken() { return undeclared_name; }\n")
    with pytest.raises(RuntimeError, match=r"nvcc failed on .*broken\.cu[\s\S]*undeclared_name"):
        build.build()


def test_missing_nvcc_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(build, "FALLBACK_CUDA_HOME", tmp_path / "no-cuda")
    with pytest.raises(RuntimeError, match="nvcc not found.*install it.*PATH.*set CUDA_HOME"):
        build.build()
    assert build.main([]) == 1
    assert "nvcc not found" in capsys.readouterr().err


def test_arch_from_environment(monkeypatch):
    monkeypatch.setenv("FREESCALE_CUDA_ARCH", "sm_90, 80")
    assert build.archs() == ["80", "90"]
    assert build.flags(["80", "90"])[-3:] == ["-gencode=arch=compute_80,code=sm_80",
                                              "-gencode=arch=compute_90,code=sm_90",
                                              "-gencode=arch=compute_90,code=compute_90"]
    monkeypatch.setenv("FREESCALE_CUDA_ARCH", "hopper")
    with pytest.raises(ValueError, match="FREESCALE_CUDA_ARCH='hopper'.*'sm_90'"):
        build.archs()

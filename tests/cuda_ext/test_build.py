"""cuda_ext.build: every .cu compiles into one cached library; errors name the file or say how to get nvcc."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from cuda_ext import build

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

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
    """A copy of cuda_ext/*.cu and *.cuh plus probe.cu in a temp source folder; the cache in another temp folder."""
    src = tmp_path / "src"
    src.mkdir()
    for cu in [*build.SOURCE_DIR.glob("*.cu"), *build.SOURCE_DIR.glob("*.cuh")]:
        shutil.copy(cu, src / cu.name)
    (src / "probe.cu").write_text(PROBE.format(tag="a", value=1))
    monkeypatch.setattr(build, "SOURCE_DIR", src)
    monkeypatch.setenv("FREESCALE_CUDA_CACHE", str(tmp_path / "cache"))
    return src


ARCH = ["90"]  # one architecture keeps the test builds short


def _exported(lib: Path) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True)
    return {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}


def _needed(lib: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return [line.split("[")[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


@needs_nvcc
def test_build_compiles_every_source_into_one_loadable_library(sources):
    lib = build.build(ARCH, force=True)
    assert lib.parent == sources.parent / "cache" and lib.name.startswith("libfreescale_cuda-")
    symbols = _exported(lib)
    assert {"fs_probe_a", "fs_ipc_get_handle", "fs_ipc_open", "fs_ipc_close", "fs_memcpy_async", "fs_eb_encode",
            "fs_eb_decode"} <= symbols
    # one CUDA runtime in the process: the shared libcudart of nvcc's major (torch's), none linked in
    runtime = f"libcudart.so.{build.cuda_major(build.find_nvcc())}"
    assert runtime in _needed(lib) and not {"cudaMalloc", "cudaMemcpyAsync"} & symbols
    assert build.load_runtime(build.find_nvcc()) == runtime  # loads without a GPU driver
    loaded = ctypes.CDLL(str(lib))
    assert loaded.fs_probe_a() == 1
    loaded.fs_error_string.restype = ctypes.c_char_p
    assert loaded.fs_error_string(0) == b"no error"


@needs_nvcc
def test_cache_is_reused_until_a_source_changes(sources):
    first = build.build(ARCH)
    stamp = first.stat().st_mtime_ns
    assert build.build(ARCH) == first and first.stat().st_mtime_ns == stamp
    (sources / "probe.cu").write_text(PROBE.format(tag="a", value=2))
    second = build.build(ARCH)
    assert second != first and second.is_file()
    build.load_runtime(build.find_nvcc())
    assert ctypes.CDLL(str(second)).fs_probe_a() == 2
    (sources / "device_guard.cuh").write_text((sources / "device_guard.cuh").read_text() + "\n// changed\n")
    assert build.library_path(build.find_nvcc(), build.flags(ARCH), build.sources()) != second  # headers count


@needs_nvcc
def test_flags_are_part_of_the_name(sources):
    nvcc, srcs = build.find_nvcc(), build.sources()
    assert build.library_path(nvcc, build.flags(["90"]), srcs) != build.library_path(nvcc, build.flags(["80"]), srcs)


@needs_nvcc
def test_compiler_error_names_the_file(sources):
    (sources / "broken.cu").write_text("extern \"C\" int fs_broken() { return undeclared_name; }\n")
    with pytest.raises(RuntimeError, match=r"nvcc failed on .*broken\.cu[\s\S]*undeclared_name"):
        build.build(ARCH)


def test_missing_nvcc_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.setattr(build, "FALLBACK_CUDA_HOME", tmp_path / "no-cuda")
    with pytest.raises(RuntimeError, match="nvcc not found.*install it.*PATH.*set CUDA_HOME"):
        build.build()
    assert build.main([]) == 1
    assert "nvcc not found" in capsys.readouterr().err


def test_arch_lists_parse_as_torch_and_nvcc_write_them():
    assert build.parse_arch_list("sm_90, 80") == ["80", "90"]
    assert build.parse_arch_list("8.0;9.0+PTX") == ["80", "90"] == build.parse_arch_list("9.0 8.0 9.0")
    assert build.parse_arch_list("90a;10.0") == ["90a", "100"]
    with pytest.raises(ValueError, match="architecture list 'hopper' has 'hopper'.*'sm_90'"):
        build.parse_arch_list("hopper")
    with pytest.raises(ValueError, match="names no architecture"):
        build.parse_arch_list(" ; ")


def test_architectures_come_from_the_argument_else_the_visible_gpus_else_the_documented_list(monkeypatch):
    monkeypatch.setattr(build, "visible_archs", lambda: ["86"])
    assert build.archs(["80"]) == ["80"] and build.archs() == ["86"]
    monkeypatch.setattr(build, "visible_archs", lambda: [])
    assert build.archs() == list(build.DEFAULT_ARCHS) == ["80", "90"]


def test_the_nvcc_command_lines_link_the_shared_runtime_for_every_architecture(tmp_path):
    nvcc = Path("/opt/cuda/bin/nvcc")
    *compiles, link = build.compile_commands(nvcc, ["80", "90"], tmp_path / "lib.so", tmp_path)
    assert [cmd[-3] for cmd in compiles] == [str(src) for src in build.sources()]
    for cmd in [*compiles, link]:
        assert cmd[0] == str(nvcc) and cmd[cmd.index("-cudart") + 1] == "shared"
        assert [flag for flag in cmd if flag.startswith("-gencode")] == [
            "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
            "-gencode=arch=compute_90,code=compute_90"]  # SASS for each, PTX of the newest
    assert "-shared" in link and link[-1] == str(tmp_path / "lib.so")


def test_the_command_line_reads_the_architectures_from_the_environment(monkeypatch, capsys, tmp_path):
    built = []
    monkeypatch.setattr(build, "build", lambda arch_list, force: built.append(arch_list) or tmp_path / "lib.so")
    monkeypatch.delenv("FREESCALE_CUDA_ARCH", raising=False)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    assert build.main([]) == 0
    monkeypatch.setenv("FREESCALE_CUDA_ARCH", "sm_90")
    assert build.main([]) == 0 and build.main(["--arch", "86"]) == 0
    monkeypatch.delenv("FREESCALE_CUDA_ARCH")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    assert build.main([]) == 0
    assert built == [["80", "90"], ["90"], ["86"], None]  # None: the library's default (visible GPUs)
    assert build.main(["--arch", "hopper"]) == 1
    assert "error: architecture list 'hopper'" in capsys.readouterr().err


def test_a_torch_of_another_cuda_major_is_refused(monkeypatch):
    import torch

    monkeypatch.setattr(build, "cuda_major", lambda nvcc: 12)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    with pytest.raises(RuntimeError, match="nvcc .* is CUDA 12, but torch .* runs CUDA 13.0: .* a second CUDA "
                                           "runtime; put a CUDA 13 toolkit's nvcc first"):
        build.load_runtime(Path("/opt/cuda/bin/nvcc"))

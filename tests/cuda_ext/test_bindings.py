"""cuda_ext.bindings: every entry point takes its device explicitly (in the C sources, the declared signatures,
the Python layer and its callers); a failing CUDA call raises, naming the call, the device and
cudaGetErrorString."""
from __future__ import annotations

import ast
import ctypes
import inspect
import re

import pytest

from cuda_ext import bindings
from cuda_ext.build import SOURCE_DIR
from tests.cuda_ext.test_build import needs_nvcc
from tests.source import parse

pytestmark = pytest.mark.kernel_free  # make test runs it beside freescale warm (tests/conftest.py)

ROOT = SOURCE_DIR.parent
ENTRY = re.compile(r'(?:extern "C"\s+)?(?:const char\*|int)\s+(fs_\w+)\(([^)]*)\)\s*\{', re.S)


def _entry_points() -> dict[str, tuple[str, str]]:
    """Every fs_* function defined in cuda_ext/*.cu: name -> (parameters, body up to the next entry point)."""
    found = {}
    for src in sorted(SOURCE_DIR.glob("*.cu")):
        text = src.read_text()
        matches = list(ENTRY.finditer(text))
        for match, following in zip(matches, [*matches[1:], None]):
            found[match.group(1)] = (match.group(2), text[match.end():following.start() if following else None])
    return found


def test_every_entry_point_takes_its_device_and_guards_it():
    entries = _entry_points()
    assert {"fs_malloc", "fs_ipc_open", "fs_memcpy_async", "fs_eb_encode", "fs_eb_decode"} <= set(entries)
    for name, (params, body) in entries.items():
        if name == "fs_error_string":  # text of an error code: no device involved
            continue
        assert params.split(",")[0].split() == ["int", "device"], f"{name}({params}) does not take the device first"
        assert "DeviceGuard guard(device);" in body, f"{name} does not switch to its device under a DeviceGuard"
        assert "cudaSetDevice" not in body, f"{name} sets the device without restoring the caller's"
    # the declared signatures are exactly the entry points, each with the device (a C int) first
    assert set(bindings.SIGNATURES) == set(entries) - {"fs_error_string"}
    assert all(argtypes[0] is ctypes.c_int for argtypes in bindings.SIGNATURES.values())


class FakeLibrary:
    """Stands in for the CUDA library: records each call's arguments and succeeds."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append((name, args)) or 0


def test_every_binding_passes_the_device_it_is_given(monkeypatch):
    fake = FakeLibrary()
    monkeypatch.setattr(bindings, "library", lambda: fake)
    public = {name: fn for name, fn in vars(bindings).items()
              if inspect.isfunction(fn) and fn.__module__ == bindings.__name__ and not name.startswith("_")
              and name not in ("library", "cuda_call")}
    for name, fn in public.items():
        params = list(inspect.signature(fn).parameters)
        assert params[0] == "device", f"bindings.{name}{inspect.signature(fn)} does not take the device first"
        args = [bytes(bindings.HANDLE_BYTES) if p == "handle" else 0 for p in params[1:]]
        fn(3, *args)
        assert fake.calls[-1][1][0] == 3, f"bindings.{name} called {fake.calls[-1][0]} without device 3"
    assert {call[0] for call in fake.calls} == set(bindings.SIGNATURES)
    with pytest.raises(ValueError, match=r"fs_malloc needs a CUDA device index >= 0, got -1"):
        bindings.malloc(-1, 16)
    with pytest.raises(ValueError, match=r"fs_free needs a CUDA device index >= 0, got 'cuda:0'"):
        bindings.free("cuda:0", 0)


@pytest.mark.parametrize("module", ["trainer/transport/copy_engine.py", "cuda_ext/compress.py"])
def test_the_callers_pass_the_device_of_what_they_copy(module):
    # every call into the bindings names the device: the exchange's own (self.device.index, or `dev` bound to
    # it) or the tensor's (x.device.index), never torch's current device
    tree = parse(ROOT / module)
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and isinstance(node.func.value, ast.Name) and node.func.value.id == "bindings"]
    assert calls, f"{module} makes no call into cuda_ext.bindings"
    for call in calls:
        first = ast.unparse(call.args[0]) if call.args else ""
        assert first.endswith(".device.index") or first == "dev", \
            f"{module}:{call.lineno}: bindings.{call.func.attr}({first}, ...) does not pass an explicit device"


@pytest.fixture
def cuda_cache(tmp_path_factory, monkeypatch):
    """Build into a temp cache instead of ~/.cache."""
    monkeypatch.setenv("FREESCALE_CUDA_CACHE", str(tmp_path_factory.getbasetemp() / "cuda-cache"))


@needs_nvcc
def test_a_failing_cuda_call_names_the_call(cuda_cache):
    with pytest.raises(RuntimeError, match=r"fs_malloc failed on cuda:9999: .+ \(cudaError_t \d+\)"):
        bindings.malloc(9999, 16)  # no driver here; an invalid device on a GPU machine

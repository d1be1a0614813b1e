"""ctypes bindings of the library `cuda_ext.build` compiles from every `cuda_ext/*.cu`: the one module that
declares the C signatures and calls into the library.

Every C function returns its `cudaError_t` as an int; `cuda_call` raises `RuntimeError` naming the function
and `cudaGetErrorString` when it is not 0. Every one takes the device it works on as its first argument (the
library sets it for the call and gives the caller its current device back: cuda_ext/device_guard.cuh), so
nothing here depends on torch's current device. Handles (device pointers, streams) are plain ints here. The
library is built and loaded on first use, so importing this module needs neither nvcc nor a GPU.
"""
from __future__ import annotations

import ctypes
import functools

from cuda_ext.build import load

HANDLE_BYTES = 64  # a cudaIpcMemHandle_t
_ptr = ctypes.c_void_p
_i64 = ctypes.c_longlong
_device = ctypes.c_int
SIGNATURES = {  # name: argtypes, the device first; every function returns its cudaError_t as an int
    # ce.cu: receive buffers, IPC, copies (streams and events are torch's)
    "fs_stream_priority_range": [_device, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
    "fs_malloc": [_device, ctypes.c_size_t, ctypes.POINTER(_ptr)],
    "fs_free": [_device, _ptr],
    "fs_ipc_get_handle": [_device, _ptr, ctypes.c_char * HANDLE_BYTES],
    "fs_ipc_open": [_device, ctypes.c_char * HANDLE_BYTES, ctypes.POINTER(_ptr)],
    "fs_ipc_close": [_device, _ptr],
    "fs_memcpy_async": [_device, _ptr, _ptr, ctypes.c_size_t, _ptr],
    # compress.cu: the error-bounded codec's kernels
    "fs_eb_encode": [_device, _ptr, ctypes.c_int, _i64, _i64, ctypes.c_float, ctypes.c_double, ctypes.c_int,
                     _ptr, _ptr, _ptr, _i64, _ptr, _ptr],
    "fs_eb_decode": [_device, _ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int, _ptr, _ptr],
}


@functools.cache
def library() -> ctypes.CDLL:
    """The library with every signature declared (built with nvcc on the first call of the process)."""
    lib = load()
    for name, argtypes in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.fs_error_string.argtypes, lib.fs_error_string.restype = [ctypes.c_int], ctypes.c_char_p
    return lib


def cuda_call(name: str, device: int, *args) -> None:
    """lib.name(device, *args); a nonzero cudaError_t raises RuntimeError with the call and cudaGetErrorString."""
    if isinstance(device, bool) or not isinstance(device, int) or device < 0:
        raise ValueError(f"{name} needs a CUDA device index >= 0, got {device!r}; pass torch.device.index of the "
                         f"rank's device (trainer.place.Placement.device)")
    lib = library()
    code = getattr(lib, name)(device, *args)
    if code != 0:
        raise RuntimeError(f"{name} failed on cuda:{device}: {lib.fs_error_string(code).decode()} "
                           f"(cudaError_t {code})")


def _new(name: str, device: int, *args) -> int:
    """A handle (pointer) returned through the last argument of lib.name."""
    out = _ptr()
    cuda_call(name, device, *args, ctypes.byref(out))
    return out.value or 0


def stream_priority_range(device: int) -> tuple[int, int]:
    """(least, greatest) stream priority of `device`, CUDA's scale: greatest is the most urgent (lowest)."""
    least, greatest = ctypes.c_int(), ctypes.c_int()
    cuda_call("fs_stream_priority_range", device, ctypes.byref(least), ctypes.byref(greatest))
    return least.value, greatest.value


def malloc(device: int, nbytes: int) -> int:
    return _new("fs_malloc", device, nbytes)


def free(device: int, ptr: int) -> None:
    cuda_call("fs_free", device, ptr)


def ipc_get_handle(device: int, ptr: int) -> bytes:
    """The HANDLE_BYTES-byte IPC handle of the allocation at ptr."""
    handle = (ctypes.c_char * HANDLE_BYTES)()
    cuda_call("fs_ipc_get_handle", device, ptr, handle)
    return handle.raw


def ipc_open(device: int, handle: bytes) -> int:
    """Map another process's allocation from its IPC handle (peer access enabled where the GPUs allow it)."""
    return _new("fs_ipc_open", device, (ctypes.c_char * HANDLE_BYTES).from_buffer_copy(handle))


def ipc_close(device: int, ptr: int) -> None:
    cuda_call("fs_ipc_close", device, ptr)


def memcpy_async(device: int, dst: int, src: int, nbytes: int, stream: int) -> None:
    """cudaMemcpyAsync of nbytes on `stream`, a stream of `device` (the kind is inferred from the pointers)."""
    cuda_call("fs_memcpy_async", device, dst, src, nbytes, stream)


def eb_encode(device: int, x: int, dtype: int, rows: int, cols: int, step_factor: float, eb: float, bits: int,
              lo: int, step: int, packed: int, row_bytes: int, status: int, stream: int) -> None:
    """compress.cu's fs_eb_encode on device pointers of `device` (see cuda_ext.compress.encode_rows_cuda)."""
    cuda_call("fs_eb_encode", device, x, dtype, rows, cols, step_factor, eb, bits, lo, step, packed, row_bytes,
              status, stream)


def eb_decode(device: int, lo: int, step: int, packed: int, rows: int, cols: int, row_bytes: int, bits: int,
              dtype: int, out: int, stream: int) -> None:
    """compress.cu's fs_eb_decode on device pointers of `device` (see cuda_ext.compress.decode_rows_cuda)."""
    cuda_call("fs_eb_decode", device, lo, step, packed, rows, cols, row_bytes, bits, dtype, out, stream)

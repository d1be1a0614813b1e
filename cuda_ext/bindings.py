"""ctypes bindings of the library `cuda_ext.build` compiles from every `cuda_ext/*.cu`: the one module that
declares the C signatures and calls into the library.

Every C function returns its `cudaError_t` as an int; `cuda_call` raises `RuntimeError` naming the function
and `cudaGetErrorString` when it is not 0. Handles (device pointers, streams, events) are plain ints here;
the functions below take and return them as such. The library is built and loaded on first use, so importing
this module needs neither nvcc nor a GPU.
"""
from __future__ import annotations

import ctypes
import functools

from cuda_ext.build import load

HANDLE_BYTES = 64  # a cudaIpcMemHandle_t
_ptr = ctypes.c_void_p
_i64 = ctypes.c_longlong
_SIGNATURES = {  # name: argtypes; every function returns its cudaError_t as an int
    # ce.cu: memory, IPC, streams, events, copies
    "fs_stream_priority_range": [ctypes.c_int, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)],
    "fs_malloc": [ctypes.c_int, ctypes.c_size_t, ctypes.POINTER(_ptr)],
    "fs_free": [ctypes.c_int, _ptr],
    "fs_ipc_get_handle": [ctypes.c_int, _ptr, ctypes.c_char * HANDLE_BYTES],
    "fs_ipc_open": [ctypes.c_int, ctypes.c_char * HANDLE_BYTES, ctypes.POINTER(_ptr)],
    "fs_ipc_close": [ctypes.c_int, _ptr],
    "fs_stream_create": [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_ptr)],
    "fs_stream_destroy": [_ptr],
    "fs_event_create": [ctypes.c_int, ctypes.POINTER(_ptr)],
    "fs_event_destroy": [_ptr],
    "fs_event_record": [_ptr, _ptr],
    "fs_event_synchronize": [_ptr],
    "fs_stream_wait_event": [_ptr, _ptr],
    "fs_memcpy_async": [_ptr, _ptr, ctypes.c_size_t, _ptr],
    # compress.cu: the error-bounded codec's kernels
    "fs_eb_encode": [_ptr, ctypes.c_int, _i64, _i64, ctypes.c_float, ctypes.c_double, ctypes.c_int,
                     _ptr, _ptr, _ptr, _i64, _ptr, _ptr],
    "fs_eb_decode": [_ptr, _ptr, _ptr, _i64, _i64, _i64, ctypes.c_int, ctypes.c_int, _ptr, _ptr],
}


@functools.cache
def library() -> ctypes.CDLL:
    """The library with every signature declared (built with nvcc on the first call of the process)."""
    lib = load()
    for name, argtypes in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, ctypes.c_int
    lib.fs_error_string.argtypes, lib.fs_error_string.restype = [ctypes.c_int], ctypes.c_char_p
    return lib


def cuda_call(name: str, *args) -> None:
    """lib.name(*args); a nonzero cudaError_t raises RuntimeError with the call and cudaGetErrorString."""
    lib = library()
    code = getattr(lib, name)(*args)
    if code != 0:
        raise RuntimeError(f"{name} failed: {lib.fs_error_string(code).decode()} (cudaError_t {code})")


def _new(name: str, *args) -> int:
    """A handle (pointer, stream, event) returned through the last argument of lib.name."""
    out = _ptr()
    cuda_call(name, *args, ctypes.byref(out))
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


def stream_create(device: int, priority: int) -> int:
    """A non-blocking stream of `priority` on `device`."""
    return _new("fs_stream_create", device, priority)


def stream_destroy(stream: int) -> None:
    cuda_call("fs_stream_destroy", stream)


def event_create(device: int) -> int:
    return _new("fs_event_create", device)


def event_destroy(event: int) -> None:
    cuda_call("fs_event_destroy", event)


def event_record(event: int, stream: int) -> None:
    cuda_call("fs_event_record", event, stream)


def event_synchronize(event: int) -> None:
    cuda_call("fs_event_synchronize", event)


def stream_wait_event(stream: int, event: int) -> None:
    cuda_call("fs_stream_wait_event", stream, event)


def memcpy_async(dst: int, src: int, nbytes: int, stream: int) -> None:
    """cudaMemcpyAsync of nbytes on `stream` (the kind is inferred from the pointers)."""
    cuda_call("fs_memcpy_async", dst, src, nbytes, stream)


def eb_encode(x: int, dtype: int, rows: int, cols: int, step_factor: float, eb: float, bits: int, lo: int,
              step: int, packed: int, row_bytes: int, status: int, stream: int) -> None:
    """compress.cu's fs_eb_encode on device pointers (see cuda_ext.compress.encode_rows_cuda)."""
    cuda_call("fs_eb_encode", x, dtype, rows, cols, step_factor, eb, bits, lo, step, packed, row_bytes, status,
              stream)


def eb_decode(lo: int, step: int, packed: int, rows: int, cols: int, row_bytes: int, bits: int, dtype: int,
              out: int, stream: int) -> None:
    """compress.cu's fs_eb_decode on device pointers (see cuda_ext.compress.decode_rows_cuda)."""
    cuda_call("fs_eb_decode", lo, step, packed, rows, cols, row_bytes, bits, dtype, out, stream)

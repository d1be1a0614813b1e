// Copy-engine transport primitives: CUDA IPC receive buffers and cudaMemcpyAsync.
//
// Plain CUDA runtime API (the shared libcudart torch loads, see cuda_ext/build.py) behind extern "C" launchers
// for ctypes (cuda_ext/bindings.py). Every function returns its cudaError_t as an int (0 = success);
// fs_error_string turns it into text. Nothing here launches a kernel: every byte moves by cudaMemcpyAsync,
// which the driver hands to a copy engine. Streams and events are torch's (torch.cuda.Stream, torch.cuda.Event).
//
// Every entry point takes the device it works on and runs under a DeviceGuard: the caller's current device
// (torch's) is the same after the call as before it.
#include <cuda_runtime.h>

#include <cstring>

#include "device_guard.cuh"

static_assert(sizeof(cudaIpcMemHandle_t) == 64, "cudaIpcMemHandle_t is expected to be 64 bytes");

extern "C" {

const char* fs_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

// least: the lowest priority (numerically largest), greatest: the highest (numerically smallest).
int fs_stream_priority_range(int device, int* least, int* greatest) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  return cudaDeviceGetStreamPriorityRange(least, greatest);
}

int fs_malloc(int device, size_t nbytes, void** ptr) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  return cudaMalloc(ptr, nbytes);
}

int fs_free(int device, void* ptr) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  return cudaFree(ptr);
}

// ptr must be the base of a cudaMalloc allocation (fs_malloc), so a peer's mapping starts at the same byte.
int fs_ipc_get_handle(int device, void* ptr, char out[64]) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaIpcMemHandle_t handle;
  cudaError_t err = cudaIpcGetMemHandle(&handle, ptr);
  if (err == cudaSuccess) std::memcpy(out, &handle, sizeof(handle));
  return err;
}

// Maps a handle exported by another process into this process on `device` (the exporter's device or, with
// peer access, another GPU of the node: the lazy flag enables peer access on first use).
int fs_ipc_open(int device, const char handle_bytes[64], void** ptr) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, handle_bytes, sizeof(handle));
  return cudaIpcOpenMemHandle(ptr, handle, cudaIpcMemLazyEnablePeerAccess);
}

int fs_ipc_close(int device, void* ptr) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  return cudaIpcCloseMemHandle(ptr);
}

// One copy of n bytes on `stream` (a stream of `device`); cudaMemcpyDefault lets unified addressing pick
// device-to-device, peer, or host<->device.
int fs_memcpy_async(int device, void* dst, const void* src, size_t nbytes, cudaStream_t stream) {
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  return cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream);
}

}  // extern "C"

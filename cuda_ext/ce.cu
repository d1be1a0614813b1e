// Copy-engine transport primitives: CUDA IPC buffers, prioritized streams, events, cudaMemcpyAsync.
//
// Plain CUDA runtime API behind extern "C" launchers for ctypes (cuda_ext/ce.py). Every function returns
// its cudaError_t as an int (0 = success); fs_error_string turns it into text. Nothing here launches a
// kernel: every byte moves by cudaMemcpyAsync, which the driver hands to a copy engine.
#include <cuda_runtime.h>

#include <cstring>

static_assert(sizeof(cudaIpcMemHandle_t) == 64, "cudaIpcMemHandle_t is expected to be 64 bytes");

extern "C" {

const char* fs_error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int fs_device_count(int* count) { return cudaGetDeviceCount(count); }

// least: the lowest priority (numerically largest), greatest: the highest (numerically smallest).
int fs_stream_priority_range(int device, int* least, int* greatest) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  return cudaDeviceGetStreamPriorityRange(least, greatest);
}

int fs_malloc(int device, size_t nbytes, void** ptr) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  return cudaMalloc(ptr, nbytes);
}

int fs_free(int device, void* ptr) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  return cudaFree(ptr);
}

// ptr must be the base of a cudaMalloc allocation (fs_malloc), so a peer's mapping starts at the same byte.
int fs_ipc_get_handle(int device, void* ptr, char out[64]) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  cudaIpcMemHandle_t handle;
  err = cudaIpcGetMemHandle(&handle, ptr);
  if (err == cudaSuccess) std::memcpy(out, &handle, sizeof(handle));
  return err;
}

// Maps a handle exported by another process into this process on `device` (the exporter's device or, with
// peer access, another GPU of the node: the lazy flag enables peer access on first use).
int fs_ipc_open(int device, const char handle_bytes[64], void** ptr) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  cudaIpcMemHandle_t handle;
  std::memcpy(&handle, handle_bytes, sizeof(handle));
  return cudaIpcOpenMemHandle(ptr, handle, cudaIpcMemLazyEnablePeerAccess);
}

int fs_ipc_close(int device, void* ptr) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  return cudaIpcCloseMemHandle(ptr);
}

int fs_stream_create(int device, int priority, cudaStream_t* stream) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  return cudaStreamCreateWithPriority(stream, cudaStreamNonBlocking, priority);
}

int fs_stream_destroy(cudaStream_t stream) { return cudaStreamDestroy(stream); }

int fs_event_create(int device, cudaEvent_t* event) {
  cudaError_t err = cudaSetDevice(device);
  if (err != cudaSuccess) return err;
  return cudaEventCreateWithFlags(event, cudaEventDisableTiming);
}

int fs_event_destroy(cudaEvent_t event) { return cudaEventDestroy(event); }

int fs_event_record(cudaEvent_t event, cudaStream_t stream) { return cudaEventRecord(event, stream); }

int fs_event_synchronize(cudaEvent_t event) { return cudaEventSynchronize(event); }

int fs_stream_wait_event(cudaStream_t stream, cudaEvent_t event) { return cudaStreamWaitEvent(stream, event, 0); }

// One copy of n bytes; cudaMemcpyDefault lets unified addressing pick device-to-device, peer, or host<->device.
int fs_memcpy_async(void* dst, const void* src, size_t nbytes, cudaStream_t stream) {
  return cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, stream);
}

}  // extern "C"

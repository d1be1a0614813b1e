// DeviceGuard: run one entry point of cuda_ext on an explicit device and give the caller its device back.
//
// The CUDA runtime's current device is per host thread and shared by every library in the process (torch's
// CUDAGuard and ours set the same state), so an entry point that called cudaSetDevice and returned would move
// torch's current device under it. The guard reads the current device, switches only when it differs, and
// restores it on scope exit. In the trainer the rank's device is set once (trainer/place.py), so the guard
// finds it current and switches nothing.
#pragma once

#include <cuda_runtime.h>

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    error_ = cudaGetDevice(&previous_);
    if (error_ == cudaSuccess && previous_ != device) {
      error_ = cudaSetDevice(device);
      restore_ = error_ == cudaSuccess;
    }
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  // cudaSuccess, or why the device could not be read or set (the entry point returns it).
  cudaError_t error() const { return error_; }

 private:
  int previous_ = 0;
  bool restore_ = false;
  cudaError_t error_ = cudaSuccess;
};

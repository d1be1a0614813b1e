// Error-bounded row quantisation of embedding payloads: the kernels behind cuda_ext/compress.py.
//
// The torch reference (`encode_rows_reference`, `decode_rows_reference` in compress.py) computes the same
// values op by op; the two must agree bit for bit. Every float operation is therefore an explicit
// round-to-nearest intrinsic (__fsub_rn, __fdiv_rn, __fmul_rn, __fadd_rn, __dsub_rn, __dmul_rn): nvcc
// contracts a * b + c into one fused multiply-add by default (one rounding instead of two), and the
// intrinsics are never contracted, so each operation rounds exactly as torch's separate CPU ops do.
//
// Layout (one row of x is one block of the encoder):
//   x       (rows, cols) float32 / bfloat16 / float16 (dtype 0 / 1 / 2), row-major
//   lo      (rows,) float32   row minimum (-0 made +0)
//   step    (rows,) float32   (hi - lo) * k, k = float32(1 / qmax), qmax = 2^bits - 1
//   packed  (rows, row_bytes) uint8, row_bytes = ceil(cols * bits / 8): code c of a row sits at bits
//           [c * bits, (c + 1) * bits) of the row, least significant bit first
//   status  (rows,) uint8     0: every element verified within the bound, 1: some element was not (the
//           Python side stores that row raw), 2: the row holds a NaN or an Inf
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <float.h>
#include <stdint.h>

#include "device_guard.cuh"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxGrid = 1 << 20;
// 1 - 2^-50: covers the three float64 roundings of the bound check (VERIFY_MARGIN in compress.py).
constexpr double kCheck = 1.0 - 1.0 / 1125899906842624.0;

template <typename T> __device__ __forceinline__ float to_f32(T v);
template <> __device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// The code of x: round((x - lo) / step) clamped to qmax; 0 when step is 0 or not finite (constant or overflowed row).
__device__ __forceinline__ uint32_t code_of(float x, float lo, float step, float qmax) {
    if (!(step > 0.0f && step <= FLT_MAX)) return 0u;
    float t = __fdiv_rn(__fsub_rn(x, lo), step);  // >= 0: x >= lo and rounding is monotone
    return (uint32_t)fminf(rintf(t), qmax);        // rintf: half to even, as torch.round
}

// lo + q * step rounded to the payload dtype, as the decoder writes it (returned widened to float).
template <typename T> __device__ __forceinline__ float reconstruct(float lo, float step, uint32_t q) {
    return to_f32<T>(from_f32<T>(__fadd_rn(lo, __fmul_rn((float)q, step))));
}

__device__ __forceinline__ float warp_min(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) encode_rows(const T* __restrict__ x, long long rows, long long cols,
                                                        float k, double eb, int bits, float* __restrict__ lo_out,
                                                        float* __restrict__ step_out, uint8_t* __restrict__ packed,
                                                        long long row_bytes, uint8_t* __restrict__ status) {
    __shared__ float s_min[kThreads / 32], s_max[kThreads / 32];
    __shared__ float s_lo, s_step;
    __shared__ double s_bound;
    __shared__ int s_bad, s_fail;
    const float qmax = (float)((1u << bits) - 1u);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * cols;
        if (threadIdx.x == 0) { s_bad = 0; s_fail = 0; }
        float mn = FLT_MAX, mx = -FLT_MAX;
        int bad = 0;
        for (long long c = threadIdx.x; c < cols; c += blockDim.x) {
            float v = to_f32<T>(xr[c]);
            bad |= !isfinite(v);
            mn = fminf(mn, v);
            mx = fmaxf(mx, v);
        }
        mn = warp_min(mn);
        mx = warp_max(mx);
        if (lane == 0) { s_min[warp] = mn; s_max[warp] = mx; }
        __syncthreads();
        if (bad) atomicOr(&s_bad, 1);
        if (threadIdx.x == 0) {
            for (int w = 1; w < kThreads / 32; ++w) { mn = fminf(mn, s_min[w]); mx = fmaxf(mx, s_max[w]); }
            mn = mn == 0.0f ? 0.0f : mn;  // -0 -> +0, as the reference
            mx = mx == 0.0f ? 0.0f : mx;
            s_lo = mn;
            s_step = __fmul_rn(__fsub_rn(mx, mn), k);
            s_bound = __dmul_rn(__dmul_rn(__dsub_rn((double)mx, (double)mn), eb), kCheck);
        }
        __syncthreads();
        const float lo = s_lo, step = s_step;
        const double bound = s_bound;
        int fail = 0;
        for (long long b = threadIdx.x; b < row_bytes; b += blockDim.x) {
            const long long bit0 = b * 8;
            const long long c0 = bit0 / bits;
            const long long c1 = min((bit0 + 7) / bits, cols - 1);
            uint32_t byte = 0;
            for (long long c = c0; c <= c1; ++c) {
                const float v = to_f32<T>(xr[c]);
                const uint32_t q = code_of(v, lo, step, qmax);
                const double err = fabs(__dsub_rn((double)v, (double)reconstruct<T>(lo, step, q)));
                fail |= !(err <= bound);  // NaN (an overflowed step) fails too
                const long long sh = c * bits - bit0;  // < 8
                byte |= sh >= 0 ? (q << sh) : (q >> -sh);
            }
            packed[row * row_bytes + b] = (uint8_t)(byte & 0xffu);
        }
        if (fail) atomicOr(&s_fail, 1);
        __syncthreads();
        if (threadIdx.x == 0) {
            lo_out[row] = lo;
            step_out[row] = step;
            status[row] = s_bad ? 2 : (s_fail ? 1 : 0);
        }
        __syncthreads();  // shared values are rewritten by the next row
    }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) decode_rows(const float* __restrict__ lo, const float* __restrict__ step,
                                                        const uint8_t* __restrict__ packed, long long rows,
                                                        long long cols, long long row_bytes, int bits,
                                                        T* __restrict__ out) {
    const uint32_t mask = (1u << bits) - 1u;
    const long long n = rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / cols, c = i - row * cols;
        const long long bit = c * bits, byte = bit >> 3, left = row_bytes - byte;  // bytes to the row's end
        const uint8_t* p = packed + row * row_bytes + byte;
        uint32_t w = p[0];
        if (left > 1) w |= (uint32_t)p[1] << 8;
        if (left > 2) w |= (uint32_t)p[2] << 16;  // bits <= 16 and shift <= 7: 3 bytes hold any code
        const uint32_t q = (w >> (bit & 7)) & mask;
        out[i] = from_f32<T>(__fadd_rn(lo[row], __fmul_rn((float)q, step[row])));
    }
}

int grid_for(long long blocks) { return (int)(blocks < kMaxGrid ? blocks : kMaxGrid); }

}  // namespace

// device: where x, the outputs and stream live (current for the launch, the caller's device restored after).
// x: (rows, cols) of dtype 0/1/2; writes lo, step (rows,), packed (rows, row_bytes), status (rows,). k = float32(1 / (2^bits - 1)); eb: the bound as a double. Returns a cudaError_t code.
extern "C" int fs_eb_encode(int device, const void* x, int dtype, long long rows, long long cols, float k, double eb,
                            int bits, float* lo, float* step, unsigned char* packed, long long row_bytes,
                            unsigned char* status, cudaStream_t stream) {
    if (rows <= 0) return (int)cudaSuccess;
    DeviceGuard guard(device);  // kernels launch on the current device: the stream's, the caller's back after
    if (guard.error() != cudaSuccess) return (int)guard.error();
    if (bits < 1 || bits > 16 || cols < 1) return (int)cudaErrorInvalidValue;
    const int grid = grid_for(rows);
    switch (dtype) {
        case 0: encode_rows<float><<<grid, kThreads, 0, stream>>>(static_cast<const float*>(x), rows, cols, k, eb,
                                                                  bits, lo, step, packed, row_bytes, status); break;
        case 1: encode_rows<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x),
                    rows, cols, k, eb, bits, lo, step, packed, row_bytes, status); break;
        case 2: encode_rows<__half><<<grid, kThreads, 0, stream>>>(static_cast<const __half*>(x), rows, cols, k,
                                                                   eb, bits, lo, step, packed, row_bytes, status);
                break;
        default: return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}

// The inverse of fs_eb_encode for quantised rows: out (rows, cols) of dtype 0/1/2 = lo + code * step.
extern "C" int fs_eb_decode(int device, const float* lo, const float* step, const unsigned char* packed,
                            long long rows, long long cols, long long row_bytes, int bits, int dtype, void* out,
                            cudaStream_t stream) {
    if (rows <= 0 || cols <= 0) return (int)cudaSuccess;
    DeviceGuard guard(device);
    if (guard.error() != cudaSuccess) return (int)guard.error();
    if (bits < 1 || bits > 16) return (int)cudaErrorInvalidValue;
    const int grid = grid_for((rows * cols + kThreads - 1) / kThreads);
    switch (dtype) {
        case 0: decode_rows<float><<<grid, kThreads, 0, stream>>>(lo, step, packed, rows, cols, row_bytes, bits,
                                                                  static_cast<float*>(out)); break;
        case 1: decode_rows<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(lo, step, packed, rows, cols, row_bytes,
                    bits, static_cast<__nv_bfloat16*>(out)); break;
        case 2: decode_rows<__half><<<grid, kThreads, 0, stream>>>(lo, step, packed, rows, cols, row_bytes, bits,
                                                                   static_cast<__half*>(out)); break;
        default: return (int)cudaErrorInvalidValue;
    }
    return (int)cudaGetLastError();
}

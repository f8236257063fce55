// Shared device helpers for the subspace_ref CuPy kernels.
//
// Every kernel reads its inputs in the storage dtype (float, __half or __nv_bfloat16) and does all
// arithmetic in float32: spec A9 requires attention "accumulated in at least float32", and the
// same rule is applied to the projections of spec A6/A7 step 1 so that the residual of A7 step 2
// is not swamped by half-precision rounding.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

// NVRTC compiles without the C library headers, so INFINITY may be undefined there; nvcc and the
// host emulation get it from math.h.
#ifdef INFINITY
#define SUBSPACE_INFINITY INFINITY
#else
#define SUBSPACE_INFINITY __int_as_float(0x7f800000)
#endif

namespace subspace {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

// Round-to-nearest-even conversions, so a float32 result stored in a 16-bit dtype matches what
// NumPy/Torch do when they cast the oracle's float32 result.
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// Butterfly reductions leave the result in every lane, which lets each lane use it without a
// second broadcast.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        x += __shfl_xor_sync(kFullMask, x, offset);
    }
    return x;
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        x = fmaxf(x, __shfl_xor_sync(kFullMask, x, offset));
    }
    return x;
}

// exp(a - b) with exp(-inf - b) := 0 (spec A3.2), also when b is -inf: the identity partial
// (-inf, 0, 0) must contribute nothing instead of producing exp(NaN).
__device__ __forceinline__ float exp_shift(float a, float b) {
    return a == -SUBSPACE_INFINITY ? 0.0f : expf(a - b);
}

}  // namespace subspace

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

// Asynchronous global -> shared copies (cp.async, sm_80+): a copy issued now lands while the
// threads compute on another buffer; it is complete, for the issuing thread, after the
// cp_async_wait<N> that leaves at most N newer committed groups pending, and for the block after
// a __syncthreads that follows that wait. Below sm_80 (and in NVRTC builds for such devices) the
// copy is an ordinary synchronous one and commit/wait do nothing, which keeps the same ordering
// rules valid. The host emulation (emulation/host_cuda.h) supplies its own versions, which defer
// each copy until the wait that covers it, so a kernel reading a buffer before its wait reads
// stale data there and fails the oracle comparison.
#ifndef SUBSPACE_HOST_EMULATION
template <int kBytes>
struct CopyWord;
template <>
struct CopyWord<4> { using type = unsigned int; };
template <>
struct CopyWord<8> { using type = uint2; };
template <>
struct CopyWord<16> { using type = uint4; };

template <int kBytes>
__device__ __forceinline__ void cp_async(void* dst_shared, const void* src_global) {
    static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(dst_shared));
    if constexpr (kBytes == 16) {
        // .cg: bypass L1, the tile is read once per block
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src_global) : "memory");
    } else {
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(src_global), "n"(kBytes) : "memory");
    }
#else
    using W = typename CopyWord<kBytes>::type;
    *static_cast<W*>(dst_shared) = *static_cast<const W*>(src_global);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}
#endif  // SUBSPACE_HOST_EMULATION

}  // namespace subspace

// INT8 coefficient storage (spec A10; seed 001 §10, seed 003 "Quantization combination"): the one
// CUDA definition of the quantisation, matching subspace_ref/quantization.py.
//
// One float32 scale per (token, head), separately for key and value coefficients:
//   scale = absmax / 127   (absmax over the r coefficients of that token and head)
//   q     = round_half_even(x / scale), clamped to [-127, 127];  q = 0 when scale == 0
//   x'    = q * scale
// Half-to-even rounding is rintf, the same as numpy.rint and torch.round in the oracle, so both
// store the same integers for the same float32 inputs (up to the rounding of c itself, which the
// kernel and the oracle compute in different orders). -128 is never produced: the code range is
// symmetric, so negating a vector negates its codes.
#pragma once

#include "common.cuh"

namespace subspace {

constexpr float kInt8CoefMax = 127.0f;

__host__ __device__ __forceinline__ float int8_coef_scale(float absmax) {
    return absmax / kInt8CoefMax;
}

__host__ __device__ __forceinline__ signed char int8_coef_quantize(float x, float scale) {
    if (scale == 0.0f) {
        return 0;
    }
    // The clamp only absorbs x / (absmax / 127) rounding to a hair above 127.
    const float v = fminf(fmaxf(rintf(x / scale), -kInt8CoefMax), kInt8CoefMax);
    return static_cast<signed char>(v);
}

__host__ __device__ __forceinline__ float int8_coef_dequantize(signed char q, float scale) {
    return static_cast<float>(q) * scale;
}

// How the decode kernel reads a coefficient from the raw row its shared tile holds: the stored
// number as float32, before the per-token scale of int8 storage (kScaled), which the kernel
// applies once per token (to the logit, to the weight) instead of once per coefficient.
template <typename CoefT>
struct CoefReader {
    static constexpr bool kScaled = false;
    __device__ __forceinline__ static float code(CoefT x) { return to_float(x); }
};

template <>
struct CoefReader<signed char> {
    static constexpr bool kScaled = true;
    __device__ __forceinline__ static float code(signed char x) { return static_cast<float>(x); }
};

}  // namespace subspace

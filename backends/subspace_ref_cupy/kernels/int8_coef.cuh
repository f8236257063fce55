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

// Low-bit coefficient storage (spec/quantization.md Q2): bytes of packed codes, 8 / kBits per
// byte, code c of a row in bits [(c mod 8/kBits) kBits, ...) of byte c / (8/kBits). The types
// only name the format for the decode template; the bytes are read through CoefReader.
struct Int4Codes {
    unsigned char byte;
};
struct Int2Codes {
    unsigned char byte;
};

// How the decode kernel reads a coefficient from the raw row its shared tile holds: the stored
// number as float32, before the per-token scale of int8 storage (kScaled), which the kernel
// applies once per token (to the logit, to the weight) instead of once per coefficient; for the
// low-bit formats (kLowBit) the code, to which the kernel applies the scale and zero point.
template <typename CoefT>
struct CoefReader {
    static constexpr bool kScaled = false;
    static constexpr bool kLowBit = false;
    static constexpr int kBits = 8 * static_cast<int>(sizeof(CoefT));
    __device__ __forceinline__ static float code(CoefT x) { return to_float(x); }
    __device__ __forceinline__ static float at(const unsigned char* row, int i) { return code(reinterpret_cast<const CoefT*>(row)[i]); }
};

template <>
struct CoefReader<signed char> {
    static constexpr bool kScaled = true;
    static constexpr bool kLowBit = false;
    static constexpr int kBits = 8;
    __device__ __forceinline__ static float code(signed char x) { return static_cast<float>(x); }
    __device__ __forceinline__ static float at(const unsigned char* row, int i) { return code(reinterpret_cast<const signed char*>(row)[i]); }
};

template <int kCodeBits>
struct LowBitReader {
    static constexpr bool kScaled = false;
    static constexpr bool kLowBit = true;
    static constexpr int kBits = kCodeBits;
    static constexpr int kPerByte = 8 / kCodeBits;
    // shifts and masks: kPerByte is a power of two, so no division per code
    __device__ __forceinline__ static float at(const unsigned char* row, int i) {
        const unsigned byte = row[i / kPerByte];
        return static_cast<float>((byte >> ((i % kPerByte) * kCodeBits)) & ((1u << kCodeBits) - 1u));
    }
};

template <>
struct CoefReader<Int4Codes> : LowBitReader<4> {};
template <>
struct CoefReader<Int2Codes> : LowBitReader<2> {};

// Spec Q1 step 3: x^ = q s + z rounded to the state's dtype T, as the oracle rounds its float64
// reading. q s is exact in float32 (at most 4 + 11 significant bits), so fmaf rounds
// once, exactly as the oracle does for T = float32; for 16-bit T a second rounding follows, which
// can differ from the oracle's single one by an ulp of T at a tie.
template <typename T>
__device__ __forceinline__ float low_bit_value(float code, float s, float z) {
    return to_float(from_float<T>(fmaf(code, s, z)));
}

}  // namespace subspace

// Projection of new tokens onto the open chunk's bases (spec A6 step 1, A7 steps 1-2, A8 step 2).
//
// One launch covers every (sequence, KV head) and both keys and values:
//   grid (ceil(n / tokens_per_block), 2 * H, N); blockIdx.y < H projects keys with B, the rest
//   projects values with E. Each warp owns one token at a time: its lanes hold the token's d
//   entries in registers, each basis row is read coalesced and reduced across the warp.
// Outputs: c = B k and d = E v written to rows offset..offset+n-1 of the coefficient buffers (the
// launcher guarantees the capacity), and the relative residual norms of spec A7 step 2,
//   rho = sqrt(max(|k|^2 - |c|^2, 0)) / |k|   (0 when k = 0),
// computed from the float32 coefficients before any rounding to the storage dtype, so that the
// chunk trigger sees the projection error and not the storage error.
#include "common.cuh"
#include "int8_coef.cuh"

namespace subspace {

constexpr int kProjectThreads = 128;
constexpr int kProjectWarps = kProjectThreads / kWarpSize;

template <typename CoefT>
struct CoefWriter {
    // Rows of `vals` (RT floats per warp, `rank` used) go to coef[row * rank + i].
    __device__ __forceinline__ static void store(CoefT* coef, float* /*scales*/, long long row,
                                                 const float* vals, int rank, int lane) {
        for (int i = lane; i < rank; i += kWarpSize) {
            coef[row * rank + i] = from_float<CoefT>(vals[i]);
        }
    }
};

template <>
struct CoefWriter<signed char> {
    __device__ __forceinline__ static void store(signed char* coef, float* scales, long long row,
                                                 const float* vals, int rank, int lane) {
        float absmax = 0.0f;
        for (int i = lane; i < rank; i += kWarpSize) {
            absmax = fmaxf(absmax, fabsf(vals[i]));
        }
        const float scale = int8_coef_scale(warp_max(absmax));
        for (int i = lane; i < rank; i += kWarpSize) {
            coef[row * rank + i] = int8_coef_quantize(vals[i], scale);
        }
        if (lane == 0) {
            scales[row] = scale;
        }
    }
};

// One warp projects tokens t = first, first + stride, ... of one head onto `basis` (rank x dim).
// A fixed DIM keeps the token in registers (DIM / 32 entries per lane); DIM = 0 takes the size at
// run time and rereads the token from global memory (L1) for each basis row.
template <typename T, typename CoefT, int DIM>
__device__ __forceinline__ void project_head(const T* __restrict__ x,      // (n, dim) of this head
                                             const T* __restrict__ basis,  // (rank, dim)
                                             CoefT* __restrict__ coef,     // (T_cap, rank) of this head
                                             float* __restrict__ scales,   // (T_cap) of this head, INT8 only
                                             float* __restrict__ rho,      // (n) of this head
                                             float* __restrict__ s_vals,   // >= rank floats of this warp
                                             int dim_rt, int n_new, int rank, int offset, int first, int stride,
                                             int lane) {
    static_assert(DIM >= 0 && DIM % kWarpSize == 0, "a fixed DIM gives each lane DIM / 32 entries");
    const int dim = DIM > 0 ? DIM : dim_rt;
    constexpr int kCols = DIM > 0 ? DIM / kWarpSize : 1;
    for (int t = first; t < n_new; t += stride) {
        const T* xt = x + static_cast<long long>(t) * dim;
        [[maybe_unused]] float xv[kCols];
        float norm2 = 0.0f;
        if constexpr (DIM > 0) {
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                xv[c] = to_float(xt[lane + c * kWarpSize]);
                norm2 += xv[c] * xv[c];
            }
        } else {
            for (int k = lane; k < dim; k += kWarpSize) {
                const float v = to_float(xt[k]);
                norm2 += v * v;
            }
        }
        norm2 = warp_sum(norm2);
        float coef2 = 0.0f;
        for (int i = 0; i < rank; ++i) {
            const T* row = basis + static_cast<long long>(i) * dim;
            float dot = 0.0f;
            if constexpr (DIM > 0) {
#pragma unroll
                for (int c = 0; c < kCols; ++c) {
                    dot += to_float(row[lane + c * kWarpSize]) * xv[c];
                }
            } else {
                for (int k = lane; k < dim; k += kWarpSize) {
                    dot += to_float(row[k]) * to_float(xt[k]);
                }
            }
            dot = warp_sum(dot);
            coef2 += dot * dot;
            if (lane == 0) {
                s_vals[i] = dot;
            }
        }
        __syncwarp();
        CoefWriter<CoefT>::store(coef, scales, static_cast<long long>(offset) + t, s_vals, rank, lane);
        if (lane == 0) {
            rho[t] = norm2 > 0.0f ? sqrtf(fmaxf(norm2 - coef2, 0.0f)) / sqrtf(norm2) : 0.0f;
        }
        // s_vals is rewritten by the next token.
        __syncwarp();
    }
}

// T: dtype of the new tokens and of the bases. CoefT: coefficient storage (T, or signed char for
// INT8 with one float32 scale per token and head, spec A10). D, DV: key and value head sizes, or 0
// for sizes given at run time (d_rt, d_v_rt). RT: upper bound on both ranks (sizes the per-warp
// staging buffer). The basis used for head (n, h) is that of its open chunk, num_chunks[n, h] - 1
// (spec A9).
template <typename T, typename CoefT, int D, int DV, int RT>
__global__ void __launch_bounds__(kProjectThreads)
project_append(const T* __restrict__ keys,                 // (N, H, n, d)
               const T* __restrict__ values,               // (N, H, n, d_v)
               const T* __restrict__ key_bases,            // (N, H, J_cap, r, d)
               const T* __restrict__ value_bases,          // (N, H, J_cap, r_v, d_v)
               const long long* __restrict__ num_chunks,   // (N, H)
               CoefT* __restrict__ key_coef,               // (N, H, T_cap, r)
               CoefT* __restrict__ value_coef,             // (N, H, T_cap, r_v)
               float* __restrict__ key_scale,              // (N, H, T_cap), INT8 only
               float* __restrict__ value_scale,            // (N, H, T_cap), INT8 only
               float* __restrict__ rho_k,                  // (N, H, n)
               float* __restrict__ rho_v,                  // (N, H, n)
               int num_kv_heads, int n_new, int t_cap, int j_cap, int rank, int rank_v,
               int d_rt, int d_v_rt, int offset) {
    __shared__ float s_vals[kProjectWarps][RT];
    const int lane = threadIdx.x % kWarpSize;
    const int warp = threadIdx.x / kWarpSize;
    const bool is_value = blockIdx.y >= num_kv_heads;
    const int h = is_value ? blockIdx.y - num_kv_heads : blockIdx.y;
    const long long nh = static_cast<long long>(blockIdx.z) * num_kv_heads + h;
    const long long j = num_chunks[nh] - 1;
    const int first = blockIdx.x * kProjectWarps + warp;
    const int stride = gridDim.x * kProjectWarps;
    const long long d = D > 0 ? D : d_rt;
    const long long dv = DV > 0 ? DV : d_v_rt;
    float* scales_k = key_scale == nullptr ? nullptr : key_scale + nh * t_cap;
    float* scales_v = value_scale == nullptr ? nullptr : value_scale + nh * t_cap;
    if (!is_value) {
        project_head<T, CoefT, D>(keys + nh * n_new * d, key_bases + (nh * j_cap + j) * rank * d,
                                  key_coef + nh * t_cap * rank, scales_k, rho_k + nh * n_new,
                                  s_vals[warp], d_rt, n_new, rank, offset, first, stride, lane);
    } else {
        project_head<T, CoefT, DV>(values + nh * n_new * dv, value_bases + (nh * j_cap + j) * rank_v * dv,
                                   value_coef + nh * t_cap * rank_v, scales_v, rho_v + nh * n_new,
                                   s_vals[warp], d_v_rt, n_new, rank_v, offset, first, stride, lane);
    }
}

}  // namespace subspace

/* Spec A6 on a CPU core for a static state with quantised or float32 coefficients: the tokens
 * of a decode step projected, c_t = B k_t and d_t = E v_t, and stored by the stores of
 * quantized_stores.c (float32 rows as they are); for a pre-RoPE state (spec/rope.md P2 step 1)
 * each key first turned back by R_p^{-1} at its position p.
 *
 * Why a kernel of our own: a decode step appends one token, and its projection, un-rotation
 * and the two stores spelled in tensor operations were a dozen calls each costing more to start
 * than the arithmetic (2 r d fmas per KV head: ~5 k at d = 64, r = 37).
 *
 * Numbers: the un-rotation is rope.rotate's (float64 angles p theta_i, cos and sin times the
 * attention scaling a, divided by a^2, rounded to float32, then (c x_i + s x_j, -s x_i + c x_j)
 * in float32 without contraction); each coefficient is one float32 dot product over d. The
 * torch path's matmul sums in another order, so the two differ by float32 rounding, as two
 * BLAS libraries would; the stores are the same bit for bit.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The rotating planes of a pre-RoPE state's keys (spec/rope.md §1): plane i turns dims
 * first[i] and second[i] by the angle p inv_freq[i]; `scaling` is a (attention_scaling) and
 * `scaling_squared` a^2 as the caller computed it. */
struct key_unrotation {
    const int32_t *first, *second;
    int64_t planes;
    const double *inv_freq;
    double scaling, scaling_squared;
};

/* out[j] = sum_i basis[j][i] x[i], j < rank, over d */
static void project_row(const float *basis, int64_t rank, int64_t d, const float *x, float *out) {
    for (int64_t j = 0; j < rank; ++j) {
        const float *b = basis + j * d;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int64_t i = 0; i < d; ++i) s += b[i] * x[i];
        out[j] = s;
    }
}

/* Tokens [a, a + count) of every head h < heads: keys (heads, count, d) and values (heads,
 * count, d_v) float32, bases (heads, rank, d) and (heads, rank_v, d_v) float32 as attention
 * reads them; with `rope`, key t sits at position first_position + a + t (spec/window.md W10).
 * `bits` 8: int8 stores (spec A10); 4 or 2: the int4 / int2 stores (spec Q2), the keys' rows of
 * the unfinished group from old_tail into new_tail (low_bit_store_keys); FLOAT_BITS: float32
 * coefficients, written as they are. Returns 0; -1 for a
 * shape beyond the buffers or memory; -2 with *magnitude set when a side's coefficients exceed
 * float16's range: then nothing the state reads has changed (rows past its tokens and a new
 * tail only). */
int static_append(int bits, int64_t heads, int64_t a, int64_t count, const float *keys, const float *values, int64_t d, int64_t d_v,
                  const float *key_basis, const float *value_basis, const struct key_unrotation *rope, int64_t first_position,
                  const float *old_tail, float *new_tail, const struct quantized_side *key_side, const struct quantized_side *value_side,
                  double *magnitude) {
    const int64_t r = key_side->rank, r_v = value_side->rank;
    const int64_t planes = rope ? rope->planes : 0;
    if (r > MAX_RANK || r_v > MAX_RANK || planes > MAX_DIM / 2 || (bits != 8 && bits != 4 && bits != 2 && bits != FLOAT_BITS)) return -1;
    float *coef = malloc(sizeof(float) * (size_t)(heads * count * (r + r_v) + 1)), *turned = malloc(sizeof(float) * (size_t)(d + 1));
    if (!coef || !turned) {
        free(coef), free(turned);
        return -1;
    }
    float *coef_v = coef + heads * count * r;
    for (int64_t t = 0; t < count; ++t) {
        float c[MAX_DIM / 2], s[MAX_DIM / 2];
        for (int64_t i = 0; i < planes; ++i) {
            const double angle = (double)(first_position + a + t) * rope->inv_freq[i];
            c[i] = (float)(rope->scaling * cos(angle) / rope->scaling_squared);
            s[i] = (float)(-(rope->scaling * sin(angle)) / rope->scaling_squared);
        }
        for (int64_t h = 0; h < heads; ++h) {
            const float *k = keys + (h * count + t) * d;
            if (planes) {
                memcpy(turned, k, sizeof(float) * (size_t)d);
                for (int64_t i = 0; i < planes; ++i) {
                    const float x = k[rope->first[i]], y = k[rope->second[i]];
                    const float cx = c[i] * x, sy = s[i] * y, sx = s[i] * x, cy = c[i] * y; /* rounded apart, as rotate's */
                    turned[rope->first[i]] = cx - sy;
                    turned[rope->second[i]] = sx + cy;
                }
                k = turned;
            }
            project_row(key_basis + h * r * d, r, d, k, coef + (h * count + t) * r);
            project_row(value_basis + h * r_v * d_v, r_v, d_v, values + (h * count + t) * d_v, coef_v + (h * count + t) * r_v);
        }
    }
    int rc = 0;
    if (bits == FLOAT_BITS) { /* float32 rows (strides counting floats) take the coefficients as they are */
        for (int64_t h = 0; h < heads; ++h) {
            memcpy((float *)key_side->codes + h * key_side->head_stride + a * r, coef + h * count * r, sizeof(float) * (size_t)(count * r));
            memcpy((float *)value_side->codes + h * value_side->head_stride + a * r_v, coef_v + h * count * r_v, sizeof(float) * (size_t)(count * r_v));
        }
    } else if (bits == 8) {
        int8_store(heads, a, count, coef, key_side);
        int8_store(heads, a, count, coef_v, value_side);
    } else if ((rc = low_bit_store_keys(bits, heads, a, count, coef, old_tail, new_tail, key_side, magnitude)) == 0) {
        rc = low_bit_store_values(bits, heads, a, count, coef_v, value_side, magnitude);
    }
    free(coef), free(turned);
    return rc;
}

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

/* Tokens [a, a + count) of one side from coef (heads, count, rank) float32, stored in the
 * side's format `bits`: float32 rows (strides counting floats) as they are, int8 (spec A10),
 * int4 / int2 keys (`keys` 1: with the tails of low_bit_store_keys) or values (spec Q2).
 * Returns as the stores. */
static int store_side(int bits, int keys, int64_t heads, int64_t a, int64_t count, const float *coef, const float *old_tail, float *new_tail,
                      const struct quantized_side *side, double *magnitude) {
    const int64_t r = side->rank;
    if (bits == FLOAT_BITS) {
        for (int64_t h = 0; h < heads; ++h) memcpy((float *)side->codes + h * side->head_stride + a * r, coef + h * count * r, sizeof(float) * (size_t)(count * r));
        return 0;
    }
    if (bits == 8) return int8_store(heads, a, count, coef, side);
    if (keys) return low_bit_store_keys(bits, heads, a, count, coef, old_tail, new_tail, side, magnitude);
    return low_bit_store_values(bits, heads, a, count, coef, side, magnitude);
}

/* Tokens [a, a + count) of every head h < heads: keys (heads, count, d) and values (heads,
 * count, d_v) float32, bases (heads, rank, d) and (heads, rank_v, d_v) float32 as attention
 * reads them; with `rope`, key t sits at position first_position + a + t (spec/window.md W10).
 * `key_bits` and `value_bits`, each side's format: 8: int8 stores (spec A10); 4 or 2: the int4 /
 * int2 stores (spec Q2), the keys' rows of the unfinished group from old_tail into new_tail
 * (low_bit_store_keys); FLOAT_BITS: float32 coefficients, written as they are. Returns 0; -1 for a
 * shape beyond the buffers or memory; -2 with *magnitude set when a side's coefficients exceed
 * float16's range: then nothing the state reads has changed (rows past its tokens and a new
 * tail only). */
int static_append(int key_bits, int value_bits, int64_t heads, int64_t a, int64_t count, const float *keys, const float *values, int64_t d, int64_t d_v,
                  const float *key_basis, const float *value_basis, const struct key_unrotation *rope, int64_t first_position,
                  const float *old_tail, float *new_tail, const struct quantized_side *key_side, const struct quantized_side *value_side,
                  double *magnitude) {
    const int64_t r = key_side->rank, r_v = value_side->rank;
    const int64_t planes = rope ? rope->planes : 0;
#define KNOWN_BITS(b) ((b) == 8 || (b) == 4 || (b) == 2 || (b) == FLOAT_BITS)
    if (r > MAX_RANK || r_v > MAX_RANK || planes > MAX_DIM / 2 || !KNOWN_BITS(key_bits) || !KNOWN_BITS(value_bits)) return -1;
#undef KNOWN_BITS
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
    int rc = store_side(key_bits, 1, heads, a, count, coef, old_tail, new_tail, key_side, magnitude);
    if (rc == 0) rc = store_side(value_bits, 0, heads, a, count, coef_v, NULL, NULL, value_side, magnitude);
    free(coef), free(turned);
    return rc;
}

/* A decode step's appends of every head group of a layer (spec/layer_state.md L3 with
 * spec/window.md W2 and W7, each group's exact window full and its sinks filled): the layer's
 * new token of each (sequence, KV head) enters its group's recent window, whose oldest token
 * leaves it for the compressed part, projected (un-rotated first for pre-RoPE keys) and stored
 * at row `a` as static_append stores it. One group's arguments: */
struct window_append {
    int key_bits, value_bits;  /* each side's format: 8, 4, 2 or FLOAT_BITS */
    int64_t heads;             /* N x H_g (sequence, head) pairs */
    int64_t a;                 /* the compressed row written: the tokens the compressed part holds */
    const float *keys, *values; /* the layer's new tokens, (N x H, d) and (N x H, d_v) */
    const int64_t *rows;       /* per pair, its row in keys / values */
    int64_t d, d_v, window;    /* head sizes and W >= 1 */
    const float *window_keys, *window_values; /* the recent exact tokens (heads, W, d) and (heads, W, d_v) */
    float *new_window_keys, *new_window_values; /* written: tokens 1.. of those, then the new one */
    const float *key_basis, *value_basis; /* (heads, r, d) and (heads, r_v, d_v), as attention reads them */
    const struct key_unrotation *rope; /* NULL: post-RoPE keys */
    int64_t first_position;    /* position of compressed token 0 (the sinks: spec/window.md W10) */
    const float *old_tail;     /* int4 / int2 keys: the state's tail (heads, G, r) */
    float *new_tail;           /* written (zeroed first): the new tail */
    const struct quantized_side *key_side, *value_side;
};

/* The sum of squares of n floats in double: NaN or infinite for a non-finite entry. Far below
 * float32's range (1e36), the operations layer's check (a non-finite token, a squared norm that
 * overflows) cannot fail; otherwise the caller takes the path that runs it and names the failure. */
static double squares(const float *x, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += (double)x[i] * (double)x[i];
    return s;
}

/* Returns 0; else the failing group's index i as -(4 * i + 1) - code, code 0 for a shape
 * beyond the buffers or memory, 1 for coefficients beyond float16's range (*magnitude set), 2
 * for a new token that may fail the operations layer's finite check (every group first). Whatever it returns, nothing a
 * state reads has changed: rows at `a` and past, new windows and new tails only. */
int layer_window_append(int64_t groups, const struct window_append *calls, double *magnitude) {
    for (int64_t g = 0; g < groups; ++g) {
        const struct window_append *c = calls + g;
        double keys = 0.0, values = 0.0; /* the sums of squares of the group's new keys and values */
        for (int64_t p = 0; p < c->heads; ++p) keys += squares(c->keys + c->rows[p] * c->d, c->d), values += squares(c->values + c->rows[p] * c->d_v, c->d_v);
        if (!(keys < 1e36) || !(values < 1e36)) return -(4 * g + 1) - 2;
    }
    for (int64_t g = 0; g < groups; ++g) {
        const struct window_append *c = calls + g;
        const int64_t heads = c->heads, d = c->d, d_v = c->d_v, W = c->window;
        const int64_t r = c->key_side->rank, r_v = c->value_side->rank;
        const int64_t planes = c->rope ? c->rope->planes : 0;
        const int bits_ok = (c->key_bits == 8 || c->key_bits == 4 || c->key_bits == 2 || c->key_bits == FLOAT_BITS) &&
                            (c->value_bits == 8 || c->value_bits == 4 || c->value_bits == 2 || c->value_bits == FLOAT_BITS);
        if (r > MAX_RANK || r_v > MAX_RANK || planes > MAX_DIM / 2 || d > MAX_DIM || W < 1 || !bits_ok) return -(4 * g + 1);
        float *coef = malloc(sizeof(float) * (size_t)(heads * (r + r_v) + 1));
        if (!coef) return -(4 * g + 1);
        float *coef_v = coef + heads * r;
        float cs[MAX_DIM / 2], sn[MAX_DIM / 2], turned[MAX_DIM];
        for (int64_t i = 0; i < planes; ++i) {
            const double angle = (double)(c->first_position + c->a) * c->rope->inv_freq[i];
            cs[i] = (float)(c->rope->scaling * cos(angle) / c->rope->scaling_squared);
            sn[i] = (float)(-(c->rope->scaling * sin(angle)) / c->rope->scaling_squared);
        }
        for (int64_t h = 0; h < heads; ++h) {
            const float *k = c->window_keys + h * W * d, *v = c->window_values + h * W * d_v; /* the leaving token */
            if (planes) {
                memcpy(turned, k, sizeof(float) * (size_t)d);
                for (int64_t i = 0; i < planes; ++i) {
                    const float x = k[c->rope->first[i]], y = k[c->rope->second[i]];
                    const float cx = cs[i] * x, sy = sn[i] * y, sx = sn[i] * x, cy = cs[i] * y; /* rounded apart, as rotate's */
                    turned[c->rope->first[i]] = cx - sy;
                    turned[c->rope->second[i]] = sx + cy;
                }
                k = turned;
            }
            project_row(c->key_basis + h * r * d, r, d, k, coef + h * r);
            project_row(c->value_basis + h * r_v * d_v, r_v, d_v, v, coef_v + h * r_v);
        }
        if (c->key_bits == 4 || c->key_bits == 2) memset(c->new_tail, 0, sizeof(float) * (size_t)(heads * c->key_side->group * r));
        int rc = store_side(c->key_bits, 1, heads, c->a, 1, coef, c->old_tail, c->new_tail, c->key_side, magnitude);
        if (rc == 0) rc = store_side(c->value_bits, 0, heads, c->a, 1, coef_v, NULL, NULL, c->value_side, magnitude);
        free(coef);
        if (rc == -2) return -(4 * g + 1) - 1;
        if (rc != 0) return -(4 * g + 1);
        for (int64_t h = 0; h < heads; ++h) { /* the window moves by one token */
            memcpy(c->new_window_keys + h * W * d, c->window_keys + h * W * d + d, sizeof(float) * (size_t)((W - 1) * d));
            memcpy(c->new_window_keys + (h * W + W - 1) * d, c->keys + c->rows[h] * d, sizeof(float) * (size_t)d);
            memcpy(c->new_window_values + h * W * d_v, c->window_values + h * W * d_v + d_v, sizeof(float) * (size_t)((W - 1) * d_v));
            memcpy(c->new_window_values + (h * W + W - 1) * d_v, c->values + c->rows[h] * d_v, sizeof(float) * (size_t)d_v);
        }
    }
    return 0;
}

/* A layer's whole decode step (spec/layer_state.md L5.3): layer_window_append's appends,
 * then layer_attention over the states they leave (`attention` points at the new windows, tails
 * and token counts). Returns 0, or the first non-zero return of the two; whatever it returns,
 * nothing a state reads has changed (the appends write only past each state's rows and into
 * fresh arrays, which the caller adopts on 0). */
int layer_decode(int64_t groups, const struct window_append *appends, double *magnitude, const struct group_call *attention) {
    const int rc = layer_window_append(groups, appends, magnitude);
    return rc != 0 ? rc : layer_attention(groups, attention);
}

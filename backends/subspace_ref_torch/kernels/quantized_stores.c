/* Stores of quantised coefficients on a CPU core: int8 with per-token scales (spec A10), bit for
 * bit subspace_ref.quantization.quantize_rows, and int4 / int2 (spec/quantization.md Q1-Q2), bit for bit
 * the oracle's quantize_groups, pack and store_low_bit (subspace_ref/quantization.py).
 *
 * Why a kernel of our own: a decode step quantises one token's coefficients per head, a few
 * dozen numbers, and the definition spelled in array operations is tens of operations each
 * costing more to start than the arithmetic (docs/benchmarks.md, "CPU kernels").
 *
 * Bit for bit: the oracle computes in float64 from the float32 coefficients, which is exact up
 * to its divisions, and C's double operations are the same IEEE operations; float16 roundings are
 * done here from the double directly (a conversion through float32 would round twice), to
 * nearest even as NumPy's astype(float16), then moved one float16 step where they fell on the
 * wrong side (the zero point rounded down, the scale up: Q1). tests/test_cpu_kernels.py checks
 * every array against the oracle's on boundary cases.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define FP16_MAX 65504.0

/* x rounded to the nearest float16, ties to even (|x| >= 65520 gives infinity), as bits */
static uint16_t half_nearest(double x) {
    const uint16_t sign = signbit(x) ? 0x8000 : 0;
    const double a = fabs(x);
    if (!(a < 65520.0)) return sign | 0x7C00;
    if (a < 0x1p-14) return sign | (uint16_t)nearbyint(a * 0x1p24); /* subnormal: m 2^-24; m = 1024 is the least normal */
    int e;
    frexp(a, &e); /* a = f 2^e, f in [0.5, 1): the leading bit is 2^(e - 1) */
    double m = nearbyint(ldexp(a, 11 - e)); /* 11 significant bits, in [1024, 2048] */
    int biased = e - 1 + 15;
    if (m == 2048.0) m = 1024.0, ++biased;
    if (biased >= 31) return sign | 0x7C00;
    return sign | (uint16_t)(biased << 10) | (uint16_t)(m - 1024.0);
}

static double half_value(uint16_t h) {
    const int biased = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    const double magnitude = biased == 0 ? ldexp(mantissa, -24) : biased == 31 ? INFINITY : ldexp(1024 + mantissa, biased - 25);
    return (h & 0x8000) ? -magnitude : magnitude;
}

/* the next float16 towards -inf / +inf (NumPy's nextafter on float16: from either zero, the
 * least subnormal of the direction's sign) */
static uint16_t half_below(uint16_t h) { return (h & 0x7FFF) == 0 ? 0x8001 : (h & 0x8000) ? h + 1 : h - 1; }
static uint16_t half_above(uint16_t h) { return (h & 0x7FFF) == 0 ? 0x0001 : (h & 0x8000) ? h - 1 : h + 1; }

static uint16_t half_down(double x) {
    const uint16_t h = half_nearest(x);
    return half_value(h) > x ? half_below(h) : h;
}

static uint16_t half_up(double x) {
    const uint16_t h = half_nearest(x);
    return half_value(h) < x ? half_above(h) : h;
}

/* Q1 over one slice of `count` values x: its zero point and scale (float16 bits) and its codes,
 * one per byte (not yet packed). */
static void quantize_slice(const float *x, int64_t count, int bits, uint16_t *scale_out, uint16_t *zero_out, uint8_t *codes) {
    const int levels = (1 << bits) - 1;
    double lo = x[0], hi = x[0];
    for (int64_t i = 1; i < count; ++i) {
        const double v = x[i];
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    const uint16_t zero = half_down(lo), scale = half_up((hi - half_value(zero)) / levels);
    const double z = half_value(zero), s = half_value(scale), safe = s > 0 ? s : 1.0;
    for (int64_t i = 0; i < count; ++i) {
        const double q = nearbyint((x[i] - z) / safe);
        codes[i] = (uint8_t)(q < 0 ? 0 : q > levels ? levels : q);
    }
    *scale_out = scale;
    *zero_out = zero;
}

/* codes (one per byte, `rank` of them) -> `width` bytes, code i of a byte in bits [i bits,
 * (i + 1) bits), the last byte zero-padded (Q1's pack) */
static void pack_row(const uint8_t *codes, int64_t rank, int bits, int64_t width, uint8_t *out) {
    const int per = 8 / bits;
    for (int64_t k = 0; k < width; ++k) {
        unsigned byte = 0;
        for (int i = 0; i < per && k * per + i < rank; ++i) byte |= (unsigned)codes[k * per + i] << (i * bits);
        out[k] = (uint8_t)byte;
    }
}

/* the larger of two magnitudes, NaN the largest (it is out of range too) */
static double larger(double m, double a) { return a > m || a != a ? a : m; }

static double max_magnitude(const float *x, int64_t count, double m) {
    for (int64_t i = 0; i < count; ++i) m = larger(m, fabs((double)x[i]));
    return m;
}

/* One side of a quantised layout as stored, writable (the fields of coefficient_products.c's
 * struct coefficient_side): int8 codes (rows of `rank` bytes) and float32 scales per token, or
 * packed int4 / int2 codes (rows of `width` bytes) and float16 scale and zero per value token,
 * or per channel and group of `group` keys. */
struct quantized_side {
    uint8_t *codes;
    int64_t head_stride, width, rank;
    void *scale;
    uint16_t *zero;
    int64_t scale_head_stride, group;
};

/* Spec A10: tokens [a, a + count) of every head from coef (heads, count, rank) float32, each
 * token as s = max |c| / 127 and codes round(c / s) (s = 0 and codes 0 for a zero token), in
 * float32 as subspace_ref.quantization.quantize_rows computes them. Returns 0. */
int int8_store(int64_t heads, int64_t a, int64_t count, const float *coef, const struct quantized_side *side) {
    const int64_t r = side->rank;
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t t = 0; t < count; ++t) {
            const float *x = coef + (h * count + t) * r;
            float largest = 0.0f;
            for (int64_t j = 0; j < r; ++j) largest = fabsf(x[j]) > largest ? fabsf(x[j]) : largest;
            const float s = largest / 127.0f, safe = s > 0.0f ? s : 1.0f;
            int8_t *codes = (int8_t *)side->codes + h * side->head_stride + (a + t) * r;
            for (int64_t j = 0; j < r; ++j) {
                const float q = nearbyintf(x[j] / safe);
                codes[j] = (int8_t)(q < -127.0f ? -127.0f : q > 127.0f ? 127.0f : q);
            }
            ((float *)side->scale)[h * side->scale_head_stride + a + t] = s;
        }
    return 0;
}

#define MAX_RANK 512 /* coefficients per row */
#define MAX_GROUP 128 /* key tokens per scale group */

/* Spec Q2, values: tokens [a, a + count) of every head from coef (heads, count, rank) float32,
 * each token quantised over its rank coefficients. Returns 0, -1 for a rank beyond MAX_RANK, or
 * -2 with *magnitude = max |coef| when that exceeds float16's range (nothing written). */
int low_bit_store_values(int bits, int64_t heads, int64_t a, int64_t count, const float *coef, const struct quantized_side *side,
                         double *magnitude) {
    const int64_t r = side->rank;
    if (r > MAX_RANK) return -1;
    *magnitude = max_magnitude(coef, heads * count * r, 0.0);
    if (!(*magnitude <= FP16_MAX)) return -2;
    uint8_t codes[MAX_RANK];
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t t = 0; t < count; ++t) {
            const int64_t token = a + t;
            uint16_t *scale = (uint16_t *)side->scale + h * side->scale_head_stride + token, *zero = side->zero + h * side->scale_head_stride + token;
            quantize_slice(coef + (h * count + t) * r, r, bits, scale, zero, codes);
            pack_row(codes, r, bits, side->width, side->codes + h * side->head_stride + token * side->width);
        }
    return 0;
}

/* Spec Q2, keys: tokens [a, a + count) of every head from coef (heads, count, rank) float32.
 * The rows of the group a falls in that came before a are old_tail[h][0 .. a mod G) (float32,
 * (heads, G, rank)); every group these rows and the new ones complete is quantised per channel
 * over its G tokens, and the rows after the last complete group go to new_tail (zeroed by the
 * caller, same shape): the state's own tail is never written. Returns as the values' store, -1
 * also for a group beyond MAX_GROUP (the range checked over the completed groups only, as the
 * oracle's). */
int low_bit_store_keys(int bits, int64_t heads, int64_t a, int64_t count, const float *coef, const float *old_tail, float *new_tail,
                       const struct quantized_side *side, double *magnitude) {
    const int64_t r = side->rank, G = side->group, g0 = a / G, before = a - g0 * G, rows = before + count, done = rows / G * G;
    if (r > MAX_RANK || G < 1 || G > MAX_GROUP) return -1;
    /* row i of head h's run of `rows`: the old tail's first `before`, then the new ones */
#define FULL_ROW(h, i) ((i) < before ? old_tail + ((h) * G + (i)) * r : coef + ((h) * count + (i) - before) * r)
    *magnitude = 0.0;
    for (int64_t h = 0; h < heads; ++h)
        for (int64_t i = 0; i < done; ++i) *magnitude = max_magnitude(FULL_ROW(h, i), r, *magnitude);
    if (!(*magnitude <= FP16_MAX)) return -2;
    float channel[MAX_GROUP];
    uint8_t channel_codes[MAX_GROUP], codes[MAX_GROUP][MAX_RANK];
    for (int64_t h = 0; h < heads; ++h) {
        for (int64_t g = 0; g < done / G; ++g) {
            uint8_t *first = side->codes + h * side->head_stride + (g0 + g) * G * side->width;
            uint16_t *scale = (uint16_t *)side->scale + h * side->scale_head_stride + (g0 + g) * r, *zero = side->zero + h * side->scale_head_stride + (g0 + g) * r;
            for (int64_t j = 0; j < r; ++j) { /* channel j over the group's tokens */
                for (int64_t u = 0; u < G; ++u) channel[u] = FULL_ROW(h, g * G + u)[j];
                quantize_slice(channel, G, bits, scale + j, zero + j, channel_codes);
                for (int64_t u = 0; u < G; ++u) codes[u][j] = channel_codes[u];
            }
            for (int64_t u = 0; u < G; ++u) pack_row(codes[u], r, bits, side->width, first + u * side->width);
        }
        for (int64_t i = done; i < rows; ++i) memcpy(new_tail + (h * G + i - done) * r, FULL_ROW(h, i), sizeof(float) * (size_t)r);
    }
#undef FULL_ROW
    return 0;
}

/* Decode products over quantised coefficients on the CPU, dequantised in registers
 * (spec A10 for int8, spec/quantization.md Q1-Q2 for int4/int2; the decode path spec R14).
 *
 * Why a kernel of our own: torch has no CPU operation that contracts a float vector with integer
 * codes, and dequantising a tile first writes and re-reads it (docs/benchmarks.md, "CPU
 * kernels"). Here every code is read once, widened in registers and multiplied at once.
 *
 * Codes of a row are packed PER = 8 / bits to a byte, code i of a byte in bits [i bits, (i+1) bits)
 * (Q1), so row column c = k PER + p sits in byte k at plane p. Rather than interleave the codes
 * back, the float operand is de-interleaved into planes (operand[p][k] = x[k PER + p]) and each
 * plane is contracted with the bytes as they lie: contiguous loads and no shuffles, which the
 * compiler vectorises.
 *
 * Accumulation is in float32, the work dtype of every non-float64 state; value sums are taken
 * per tile of `tile` tokens and then over tiles, which bounds their rounding as the torch path's
 * VALUE_TILE does. Heads are (sequence, KV head) pairs; each head's rows are contiguous, heads are
 * `*_head_stride` elements apart.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

/* Scales and zero points of int4 / int2 layouts are float16 (Q1), read here as stored: the bits,
 * widened by the F16C instruction where there is one (a scalar _Float16 conversion may be a
 * library call). */
typedef uint16_t half;
#if defined(__F16C__)
static inline float widen_half(half h) { return _cvtsh_ss(h); }
#else
static inline float widen_half(half h) {
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}
#endif

#define MAX_BYTES 256 /* packed bytes of one row: rank <= 256 for int8, more for int4 / int2 */
#define MAX_QUERIES 64 /* query heads per KV head */
#define REGISTER_QUERIES 8 /* query heads per KV head of the in-register logits path */
/* Tokens per block of the value sums, whatever the vector width: the sums' rounding is that of
 * 16-token blocks added per tile, on every path (see rows_value_sums). */
#define VALUE_BLOCK 16
/* `bits` of a side stored as float32 coefficients: rows of `rank` floats, `head_stride` and
 * `width` (= rank) counting floats, no scales. */
#define FLOAT_BITS 0

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The register paths are written once, over vectors of LANES floats: 16 with AVX-512 (F, BW and
 * VL: every AVX-512 CPU but the Xeon Phi), 8 with AVX2, FMA and F16C (x86-64-v3: the AMD and
 * Intel cores without AVX-512). Below is only what the two spell differently: lane-masked loads
 * and stores (AVX2 has none of bytes or 16-bit words, and masks are vectors), the fold of a
 * block's dot products, the operand permutes and the scaling by 2^n. Elsewhere the portable loops
 * run. A partial load ("first count lanes") reads no byte past them and gives 0 in the others. */
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define LANES 16
typedef __m512 vf;
typedef __m512i vi;
#define vf_load _mm512_loadu_ps
#define vf_store _mm512_storeu_ps
#define vf_set1 _mm512_set1_ps
#define vf_zero _mm512_setzero_ps
#define vf_add _mm512_add_ps
#define vf_sub _mm512_sub_ps
#define vf_mul _mm512_mul_ps
#define vf_max _mm512_max_ps
#define vf_fmadd _mm512_fmadd_ps
#define vf_fnmadd _mm512_fnmadd_ps
#define vf_from_vi _mm512_cvtepi32_ps
#define vi_load(p) _mm512_loadu_si512(p)
#define vi_set1 _mm512_set1_epi32
#define vi_add _mm512_add_epi32
#define vi_and _mm512_and_si512
#define vi_srli _mm512_srli_epi32
#define vi_slli _mm512_slli_epi32
#define vi_srlv _mm512_srlv_epi32
#define vi_widen_u8 _mm512_cvtepu8_epi32 /* the 16 bytes of an __m128i */
#define vi_widen_i8 _mm512_cvtepi8_epi32
#define vf_permute(v, idx) _mm512_permutexvar_ps(idx, v)
ALWAYS_INLINE vi vi_lanes(void) { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
ALWAYS_INLINE __m128i load_lane_bytes(const uint8_t *p) { return _mm_loadu_si128((const __m128i *)p); }
ALWAYS_INLINE __mmask16 first_lanes(int64_t count) {
    return count >= 16 ? (__mmask16)0xFFFF : count <= 0 ? (__mmask16)0 : (__mmask16)((1u << count) - 1u);
}
ALWAYS_INLINE vf vf_load_first(const float *p, int64_t count) { return _mm512_maskz_loadu_ps(first_lanes(count), p); }
ALWAYS_INLINE void vf_store_first(float *p, int64_t count, vf v) { _mm512_mask_storeu_ps(p, first_lanes(count), v); }
ALWAYS_INLINE vf vf_keep_first(int64_t count, vf v) { return _mm512_maskz_mov_ps(first_lanes(count), v); }
ALWAYS_INLINE vf vf_load_half(const half *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
ALWAYS_INLINE vf vf_load_half_first(const half *p, int64_t count) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_lanes(count), p)); }
ALWAYS_INLINE float vf_reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
/* GCC's and clang's: halving steps, lanes[i] + lanes[i + 8], then + 4, + 2, + 1 */
ALWAYS_INLINE float vf_reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
ALWAYS_INLINE vf vf_round(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
ALWAYS_INLINE vf vf_scale2(vf y, vf n) { return _mm512_scalef_ps(y, n); }

/* The 16 sums of v[0..15] (one 16-lane vector of partial sums per token) as one vector, lane
 * order given by block_lanes: a dot product's horizontal sum costs ~8 shuffles and adds, and
 * a token's whole dot product ~6 instructions at r = 32, so summing tokens one by one is most
 * of the work; folded in four halving steps, 16 tokens share 15 shuffle pairs. */
ALWAYS_INLINE vf fold_block(vf *v) {
    for (int t = 0; t < 8; ++t) /* 256-bit halves: tokens t, t + 8 share a vector */
        v[t] = _mm512_add_ps(_mm512_shuffle_f32x4(v[t], v[t + 8], 0x44), _mm512_shuffle_f32x4(v[t], v[t + 8], 0xEE));
    for (int t = 0; t < 4; ++t) /* 128-bit quarters */
        v[t] = _mm512_add_ps(_mm512_shuffle_f32x4(v[t], v[t + 4], 0x88), _mm512_shuffle_f32x4(v[t], v[t + 4], 0xDD));
    for (int t = 0; t < 2; ++t) /* pairs within quarters */
        v[t] = _mm512_add_ps(_mm512_shuffle_ps(v[t], v[t + 2], 0x44), _mm512_shuffle_ps(v[t], v[t + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

/* deinterleave for n <= 64 (a multiple of 16), the operand in four registers (src, 0 past the
 * rank): each 16 positions are two two-source permutes and a blend, instead of a gather
 * (microcoded, ~20% of the logits at G = 32). */
ALWAYS_INLINE void deinterleave_registers(const __m512 *loaded, int64_t width, int64_t n, const int32_t *order, float *planes) {
    (void)width;
    __m512 src[4];
    for (int s = 0; s < 4; ++s) src[s] = s < n / 16 ? loaded[s] : _mm512_setzero_ps(); /* the first n / 16 are loaded */
    for (int64_t c = 0; c < n; c += 16) {
        const __m512i idx = _mm512_loadu_si512(order + c);
        const __mmask16 valid = _mm512_cmpge_epi32_mask(idx, _mm512_setzero_si512());
        const __mmask16 high = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
        const __m512 low_part = _mm512_permutex2var_ps(src[0], idx, src[1]);
        const __m512 high_part = _mm512_permutex2var_ps(src[2], idx, src[3]);
        _mm512_storeu_ps(planes + c, _mm512_maskz_mov_ps(valid, _mm512_mask_blend_ps(high, low_part, high_part)));
    }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LANES 8
typedef __m256 vf;
typedef __m256i vi;
#define vf_load _mm256_loadu_ps
#define vf_store _mm256_storeu_ps
#define vf_set1 _mm256_set1_ps
#define vf_zero _mm256_setzero_ps
#define vf_add _mm256_add_ps
#define vf_sub _mm256_sub_ps
#define vf_mul _mm256_mul_ps
#define vf_max _mm256_max_ps
#define vf_fmadd _mm256_fmadd_ps
#define vf_fnmadd _mm256_fnmadd_ps
#define vf_from_vi _mm256_cvtepi32_ps
#define vi_load(p) _mm256_loadu_si256((const __m256i *)(p))
#define vi_set1 _mm256_set1_epi32
#define vi_add _mm256_add_epi32
#define vi_and _mm256_and_si256
#define vi_srli _mm256_srli_epi32
#define vi_slli _mm256_slli_epi32
#define vi_srlv _mm256_srlv_epi32
#define vi_widen_u8 _mm256_cvtepu8_epi32 /* the low 8 bytes of an __m128i */
#define vi_widen_i8 _mm256_cvtepi8_epi32
#define vf_permute(v, idx) _mm256_permutevar8x32_ps(v, idx)
ALWAYS_INLINE vi vi_lanes(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
ALWAYS_INLINE __m128i load_lane_bytes(const uint8_t *p) { return _mm_loadl_epi64((const __m128i *)p); }
ALWAYS_INLINE vi first_lanes(int64_t count) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count >= 8 ? 8 : count <= 0 ? 0 : (int)count), vi_lanes());
}
ALWAYS_INLINE vf vf_load_first(const float *p, int64_t count) { return _mm256_maskload_ps(p, first_lanes(count)); }
ALWAYS_INLINE void vf_store_first(float *p, int64_t count, vf v) { _mm256_maskstore_ps(p, first_lanes(count), v); }
ALWAYS_INLINE vf vf_keep_first(int64_t count, vf v) { return _mm256_and_ps(_mm256_castsi256_ps(first_lanes(count)), v); }
ALWAYS_INLINE vf vf_load_half(const half *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
ALWAYS_INLINE vf vf_load_half_first(const half *p, int64_t count) {
    if (count >= 8) return vf_load_half(p);
    half part[8] = {0};
    for (int64_t k = 0; k < count; ++k) part[k] = p[k];
    return vf_load_half(part);
}
ALWAYS_INLINE float vf_reduce_max(vf v) {
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
}
/* in halving steps, lanes[i] + lanes[i + 4], then + 2, + 1: the order of AVX-512's reduction
 * after its first step, so that a sum over 16 lanes held in two vectors is the same number */
ALWAYS_INLINE float vf_reduce_add(vf v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
ALWAYS_INLINE vf vf_round(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
/* y 2^n for integral n >= -252 (the exponential's n is >= -150): 2^n itself may be below
 * float32's normal range, which an exponent field cannot hold, so it is applied as two powers
 * of two in it, 2^(n - floor(n/2)) after 2^floor(n/2); y (in [0.7, 1.5)) times the first is
 * exact and the second product rounds once, as AVX-512's scalef does. */
ALWAYS_INLINE vf vf_scale2(vf y, vf n) {
    const __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
    const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, _mm256_set1_epi32(127)), 23));
    const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, _mm256_set1_epi32(127)), 23));
    return _mm256_mul_ps(_mm256_mul_ps(y, p1), p2);
}

/* The 8 sums of v[0..7] (one vector of partial sums per token) as one vector, lane order given
 * by block_lanes: three halving steps shared by 8 tokens instead of a horizontal sum each (as
 * the 16-lane fold). */
ALWAYS_INLINE vf fold_block(vf *v) {
    for (int t = 0; t < 4; ++t) /* 128-bit halves: tokens t, t + 4 share a vector */
        v[t] = _mm256_add_ps(_mm256_permute2f128_ps(v[t], v[t + 4], 0x20), _mm256_permute2f128_ps(v[t], v[t + 4], 0x31));
    for (int t = 0; t < 2; ++t) /* pairs within halves */
        v[t] = _mm256_add_ps(_mm256_shuffle_ps(v[t], v[t + 2], 0x44), _mm256_shuffle_ps(v[t], v[t + 2], 0xEE));
    return _mm256_add_ps(_mm256_shuffle_ps(v[0], v[1], 0x88), _mm256_shuffle_ps(v[0], v[1], 0xDD));
}

/* The even and the odd lanes of a, b in order ([a0 a2 a4 a6 b0 b2 b4 b6], [a1 a3 ...]): the
 * operand's columns at stride 2 (int4's two planes), and twice, at stride 4 (int2's four). */
ALWAYS_INLINE __m256 even_lanes(__m256 a, __m256 b) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
}
ALWAYS_INLINE __m256 odd_lanes(__m256 a, __m256 b) {
    return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

/* deinterleave for n <= 64 (a multiple of 8), the operand in eight registers (src, 0 past the
 * rank). Planes of a
 * multiple of 8 columns (int4 / int2 rows of a multiple of 8 bytes: r = 32, 64) are the
 * operand's columns at stride PER: split by in-lane shuffles, two per vector and halving of the
 * stride. Otherwise each 8 positions take, from every register that holds one of their
 * columns, a one-source permute blended in where the column is that register's (AVX2 has no
 * two-source permute, and a gather is slower). */
ALWAYS_INLINE void deinterleave_registers(const __m256 *src, int64_t width, int64_t n, const int32_t *order, float *planes) {
    const int64_t per = n / width;
    if (width % 8 == 0 && (per == 2 || per == 4)) {
        const int64_t halves = n / 16; /* vector pairs of the operand */
        __m256 even[4], odd[4];
        for (int64_t m = 0; m < halves; ++m) even[m] = even_lanes(src[2 * m], src[2 * m + 1]), odd[m] = odd_lanes(src[2 * m], src[2 * m + 1]);
        if (per == 2)
            for (int64_t m = 0; m < halves; ++m) _mm256_storeu_ps(planes + 8 * m, even[m]), _mm256_storeu_ps(planes + width + 8 * m, odd[m]);
        else /* columns 4k, 4k + 2 are the even columns' even and odd ones; 4k + 1, 4k + 3 the odd columns' */
            for (int64_t m = 0; m < halves / 2; ++m) {
                _mm256_storeu_ps(planes + 8 * m, even_lanes(even[2 * m], even[2 * m + 1]));
                _mm256_storeu_ps(planes + width + 8 * m, even_lanes(odd[2 * m], odd[2 * m + 1]));
                _mm256_storeu_ps(planes + 2 * width + 8 * m, odd_lanes(even[2 * m], even[2 * m + 1]));
                _mm256_storeu_ps(planes + 3 * width + 8 * m, odd_lanes(odd[2 * m], odd[2 * m + 1]));
            }
        return;
    }
    for (int64_t c = 0; c < n; c += 8) {
        const __m256i idx = vi_load(order + c), reg = _mm256_srai_epi32(idx, 3); /* -1 past the rank: no register */
        __m256 v = _mm256_setzero_ps();
        for (int s = 0; s < n / 8; ++s) /* the columns (< n) of a position are in the first n / 8 */
            v = _mm256_blendv_ps(v, _mm256_permutevar8x32_ps(src[s], idx), _mm256_castsi256_ps(_mm256_cmpeq_epi32(reg, _mm256_set1_epi32(s))));
        _mm256_storeu_ps(planes + c, v);
    }
}
#endif

#if defined(LANES)
/* The first `count` (any integer) floats at p, then zeros: a plain load where the vector is whole
 * and none where it is empty, the masked one only between. */
ALWAYS_INLINE vf vf_load_upto(const float *p, int64_t count) { return count >= LANES ? vf_load(p) : count <= 0 ? vf_zero() : vf_load_first(p, count); }
ALWAYS_INLINE vf vf_load_half_upto(const half *p, int64_t count) {
    return count >= LANES ? vf_load_half(p) : count <= 0 ? vf_zero() : vf_load_half_first(p, count);
}

/* The permutation that puts token t of fold_block's result in lane t, found once by folding
 * markers (the order is fixed by its shuffles; deriving it keeps the two in step). */
static int32_t block_lanes[LANES];
__attribute__((constructor)) static void find_block_order(void) {
    vf v[LANES];
    for (int t = 0; t < LANES; ++t) v[t] = vf_set1((float)t / (float)LANES); /* lanes sum to t */
    float lanes[LANES];
    vf_store(lanes, fold_block(v));
    for (int lane = 0; lane < LANES; ++lane) block_lanes[(int)(lanes[lane] + 0.5f)] = lane;
}

/* e^x for x <= 0 (softmax exponents, logit minus the maximum), LANES at a time: Cody-Waite
 * reduction x = n ln2 + r, |r| <= ln2 / 2, with ln2 split so n ln2 is exact, the Cephes
 * polynomial for e^r (relative error below 2^-23 on that interval) and 2^n applied by
 * vf_scale2, which gives 0 below float32's range. Below -104 every result is 0 (e^-104 < half
 * the least subnormal); NaN stays NaN (max returns its second operand when either is NaN). */
ALWAYS_INLINE vf exp_lanes(vf x) {
    x = vf_max(vf_set1(-104.0f), x);
    const vf n = vf_round(vf_mul(x, vf_set1(1.44269504088896341f)));
    vf r = vf_fnmadd(n, vf_set1(0.693359375f), x);
    r = vf_fnmadd(n, vf_set1(-2.12194440e-4f), r);
    vf p = vf_set1(1.9875691500e-4f);
    p = vf_fmadd(p, r, vf_set1(1.3981999507e-3f));
    p = vf_fmadd(p, r, vf_set1(8.3334519073e-3f));
    p = vf_fmadd(p, r, vf_set1(4.1665795894e-2f));
    p = vf_fmadd(p, r, vf_set1(1.6666665459e-1f));
    p = vf_fmadd(p, r, vf_set1(5.0000001201e-1f));
    const vf y = vf_add(vf_fmadd(p, vf_mul(r, r), r), vf_set1(1.0f));
    return vf_scale2(y, n);
}

/* Whether rows of `width` bytes split into whole LANES-lane chunks of the widened row (in plane
 * order), which chunk_codes builds in registers: int8 rows of a multiple of LANES bytes; int4 /
 * int2 rows of a multiple of LANES bytes (a chunk within one plane) or of 4 or 8 bytes, fewer
 * than LANES (a chunk spans LANES / width planes). */
ALWAYS_INLINE int whole_chunks(int64_t width, int bits) {
    return (8 / bits) * width % LANES == 0 && (width % LANES == 0 || (bits < 8 && (width == 4 || width == 8)));
}

/* ... and at most 4 chunks, so that the query, scale and zero chunks stay in registers. */
ALWAYS_INLINE int register_chunks(int64_t width, int bits) { return whole_chunks(width, bits) && (8 / bits) * width <= 4 * LANES; }

/* Chunk c (lanes LANES c .. LANES c + LANES - 1 of the widened row, plane order) of byte row
 * `row`, as floats: the codes, not yet scaled. */
ALWAYS_INLINE vf chunk_codes(const uint8_t *row, int64_t width, int bits, int64_t c) {
    if (bits == 8) return vf_from_vi(vi_widen_i8(load_lane_bytes(row + LANES * c)));
    const vi mask = vi_set1((1 << bits) - 1);
    if (width % LANES == 0) {
        const int p = (int)(LANES * c / width);
        const vi codes = vi_srli(vi_widen_u8(load_lane_bytes(row + LANES * c % width)), p * bits);
        return vf_from_vi(p == 8 / bits - 1 ? codes : vi_and(codes, mask)); /* the last plane's are the byte's top bits */
    }
    /* Rows of 4 or 8 bytes: lane l holds column k = l mod width of plane p = (LANES c + l) / width:
     * the row's bytes repeated across the vector, each lane shifted by its plane's bits. */
    __m128i bytes;
    if (width == 4) {
        int32_t word;
        memcpy(&word, row, 4);
        bytes = _mm_set1_epi32(word);
    } else {
        int64_t word;
        memcpy(&word, row, 8);
        bytes = _mm_set1_epi64x(word);
    }
    const vi plane = vi_srli(vi_add(vi_lanes(), vi_set1((int)(LANES * c))), width == 4 ? 2 : 3);
    const vi shift = vi_slli(plane, bits == 4 ? 2 : 1);
    return vf_from_vi(vi_and(vi_srlv(vi_widen_u8(bytes), shift), mask));
}

#if LANES == 16
/* Rows that are not whole chunks (any width; 16 lanes, which have masked byte loads): chunk c of
 * the widened row, zero past n, built in registers from a plan made once per call. Lane l (row
 * position j = LANES c + l, plane j / width, column k = j mod width) takes byte k from a byte
 * shuffle of the row's first 16 bytes or, in rows wider than a vector, from a masked load at
 * `start` (the lanes in the chunk's first plane), then its plane's shift: such rows widened plane
 * by plane were read back as vectors straddling two planes' stores, which stalls store forwarding. */
#define PLAN_CHUNKS 8 /* n <= 8 LANES */
struct chunk_plan {
    __m512i shift;
    __m128i index; /* the byte of each lane from the first 16, or 0x80: from `start`, or past n */
    int64_t start;
    __mmask16 direct; /* the lanes read at `start` */
};

static void plan_chunks(int64_t width, int bits, struct chunk_plan *plan) {
    const int64_t n = (8 / bits) * width;
    for (int64_t c = 0; c < PLAN_CHUNKS && LANES * c < n; ++c) {
        uint8_t index[LANES];
        int32_t shift[LANES];
        unsigned direct = 0;
        const int64_t start = LANES * c % width;
        for (int l = 0; l < LANES; ++l) {
            const int64_t j = LANES * c + l, k = j % width;
            shift[l] = j < n ? (int32_t)(j / width * bits) : 0;
            index[l] = j < n ? (uint8_t)k : 0x80;
            if (j < n && width > LANES && k == start + l) direct |= 1u << l, index[l] = 0x80; /* the other lanes' k are < 16 */
        }
        memcpy(&plan[c].index, index, sizeof index);
        memcpy(&plan[c].shift, shift, sizeof shift);
        plan[c].start = start;
        plan[c].direct = (__mmask16)direct;
    }
}

/* Chunk c of byte row `row` by its plan, as floats: the codes, not yet scaled (0 past n). */
ALWAYS_INLINE vf planned_chunk(const uint8_t *row, int64_t width, int bits, int64_t c, const struct chunk_plan *plan) {
    if (bits == 8) /* the row itself, in order: no shuffle */
        return vf_from_vi(vi_widen_i8(_mm_maskz_loadu_epi8(first_lanes(width - LANES * c), row + LANES * c)));
    const __m128i head = width >= LANES ? load_lane_bytes(row) : _mm_maskz_loadu_epi8(first_lanes(width), row);
    __m128i bytes = _mm_shuffle_epi8(head, plan[c].index);
    if (width > LANES) bytes = _mm_mask_loadu_epi8(bytes, plan[c].direct, row + plan[c].start);
    return vf_from_vi(vi_and(vi_srlv(vi_widen_u8(bytes), plan[c].shift), vi_set1((1 << bits) - 1)));
}
#else
#define PLAN_CHUNKS 1
struct chunk_plan { int unused; }; /* 8 lanes read only whole chunks: no plan is made */
static void plan_chunks(int64_t width, int bits, struct chunk_plan *plan) { (void)width, (void)bits, (void)plan; }
#endif

/* Chunk c by the plan where there is one, else of a row of whole chunks. */
ALWAYS_INLINE vf plan_or_chunk(const uint8_t *row, int64_t width, int bits, int64_t c, const struct chunk_plan *plan) {
#if LANES == 16
    if (plan) return planned_chunk(row, width, bits, c, plan);
#else
    (void)plan;
#endif
    return chunk_codes(row, width, bits, c);
}

/* Spec Q6 (step 2): the codes of `total` contiguous bytes (whole rows of `width` bytes) minus the middle
 * code M = 2^(b-1), times F = 2^(8-b) (centred_unscale), as signed bytes in plane order: out[p total
 * + b width + k] is F (code - M) of plane p of byte k of row b. 32 bytes at a time: the top bit of
 * every code flipped (a b-bit code with its top bit flipped, read as a signed b-bit number, is
 * code - M), then each plane's codes moved to the top bits of their byte by a 16-bit left shift
 * and a byte mask (what the shift brings in from the byte below stays under the mask): two
 * operations a plane and one for all, fewer than a table lookup. The loops then read a
 * code as they read an int8 one, one widening load and one conversion, instead of a widening
 * load, a mask or shift, a conversion and the dequantising fma. `total` is a multiple of 32. */
ALWAYS_INLINE void centred_planes(const uint8_t *bytes, int64_t total, int bits, int8_t *out) {
    const __m256i flip = _mm256_set1_epi8((char)(bits == 4 ? 0x88 : 0xAA)), top = _mm256_set1_epi8((char)(0xFF << (8 - bits)));
    for (int64_t o = 0; o < total; o += 32) {
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(bytes + o)), flip);
        for (int p = 0; p < 8 / bits; ++p) {
            const int shift = 8 - bits * (p + 1); /* plane p's bits start at bit p b */
            _mm256_storeu_si256((__m256i *)(out + p * total + o), _mm256_and_si256(shift ? _mm256_slli_epi16(v, shift) : v, top));
        }
    }
}

/* 1/F, F = 2^(8-b) the factor of centred_planes' codes: their readers fold it into the operand
 * the codes multiply (a power of two: the products are the same numbers). */
ALWAYS_INLINE float centred_unscale(int bits) { return 1.0f / (float)(1 << (8 - bits)); }

/* Chunk c (lanes LANES c .. LANES c + LANES - 1, plane order) of row b of centred_planes' output
 * of `total` bytes, as floats: F (code - M). */
ALWAYS_INLINE vf centred_chunk(const int8_t *planes, int64_t total, int64_t width, int64_t b, int64_t c) {
    return vf_from_vi(vi_widen_i8(load_lane_bytes((const uint8_t *)planes + LANES * c / width * total + b * width + LANES * c % width)));
}

/* Whether rows of `width` bytes are read through centred_planes: whole LANES-byte chunks. */
ALWAYS_INLINE int centred_rows(int64_t width, int bits) { return bits < 8 && width % LANES == 0; }
#endif

/* The bytes of the rows PREFETCH_ROWS ahead are requested while a block is computed: a decode
 * step finds its coefficients out of cache (the layers before it evicted them), which the
 * hardware prefetcher alone does not hide (docs/benchmarks.md, "CPU kernels"). */
#define PREFETCH_ROWS 128
#define PREFETCH_GROUPS 4 /* key groups of int4 / int2 scales and zeros: G = 32 tokens each */
ALWAYS_INLINE void prefetch_rows(const uint8_t *codes, int64_t first, int64_t rows, int64_t limit, int64_t width) {
    const int64_t end = first + rows < limit ? first + rows : limit;
    for (int64_t off = first * width; off < end * width; off += 64) __builtin_prefetch(codes + off, 0, 0);
}

/* Runs STATEMENT with W bound to `width`, as a compile-time constant for the common row widths:
 * rows are 4-128 bytes, and a vectorised loop of run-time length that short spends more time in
 * its trip-count checks and remainder than in the arithmetic. */
#define WITH_WIDTH(width, STATEMENT)                   \
    do {                                               \
        switch (width) {                               \
        case 8: { const int64_t W = 8; STATEMENT; } break;     \
        case 16: { const int64_t W = 16; STATEMENT; } break;   \
        case 32: { const int64_t W = 32; STATEMENT; } break;   \
        case 64: { const int64_t W = 64; STATEMENT; } break;   \
        case 128: { const int64_t W = 128; STATEMENT; } break; \
        default: { const int64_t W = (width); STATEMENT; }     \
        }                                              \
    } while (0)

/* WITH_WIDTH for value rows of `per` codes a byte, with V bound to their vectors of LANES codes
 * (rounded up): a compile-time constant for rows of at most 8 vectors whatever the width, since
 * value sums indexed by a run-time vector count were kept on the stack, each fma a load and a
 * store (the rows of 12, 14, 20 and 40 bytes, which WITH_WIDTH leaves at run time). */
#if defined(LANES)
#define VALUE_VECTORS(v) (((v) + LANES - 1) / LANES)
#else
#define VALUE_VECTORS(v) 1
#endif
#define VALUE_CASE(v, STATEMENT) case v: { const int64_t V = v; STATEMENT; } break;
#define WITH_VALUE_WIDTH(width, per, STATEMENT)                                                                          \
    do {                                                                                                                 \
        switch (width) {                                                                                                 \
        case 8: { const int64_t W = 8, V = VALUE_VECTORS(per * 8); STATEMENT; } break;                                  \
        case 16: { const int64_t W = 16, V = VALUE_VECTORS(per * 16); STATEMENT; } break;                               \
        case 32: { const int64_t W = 32, V = VALUE_VECTORS(per * 32); STATEMENT; } break;                               \
        case 64: { const int64_t W = 64, V = VALUE_VECTORS(per * 64); STATEMENT; } break;                               \
        case 128: { const int64_t W = 128, V = VALUE_VECTORS(per * 128); STATEMENT; } break;                            \
        default: {                                                                                                       \
            const int64_t W = (width);                                                                                   \
            switch (VALUE_VECTORS(per * W)) {                                                                            \
                VALUE_CASE(1, STATEMENT) VALUE_CASE(2, STATEMENT) VALUE_CASE(3, STATEMENT) VALUE_CASE(4, STATEMENT)      \
                VALUE_CASE(5, STATEMENT) VALUE_CASE(6, STATEMENT) VALUE_CASE(7, STATEMENT) VALUE_CASE(8, STATEMENT)      \
                default: { const int64_t V = VALUE_VECTORS(per * W); STATEMENT; }                                        \
            }                                                                                                            \
        }                                                                                                                \
        }                                                                                                                \
    } while (0)

/* The codes of byte row `row` (`width` bytes) at plane p, widened to float. int8 codes are
 * signed and fill their byte; int4 / int2 codes are unsigned. */
ALWAYS_INLINE void widen_plane(const uint8_t *row, int64_t width, int bits, int p, float *out) {
    if (bits == 8) {
        const int8_t *s = (const int8_t *)row;
#pragma omp simd
        for (int64_t k = 0; k < width; ++k) out[k] = (float)s[k];
        return;
    }
    /* widened to 32 bits before the shift: x86 has no vector shift of bytes */
    const int32_t shift = p * bits, mask = (1 << bits) - 1;
    int64_t k = 0;
#if defined(LANES) && LANES == 16
    /* LANES bytes at a time, the last ones by a byte-masked load (rows of any width: a scalar
     * loop per plane was most of the value sums of rows that are not whole chunks) */
    for (; k < width; k += LANES) {
        const __mmask16 lanes = first_lanes(width - k);
        const vi codes = vi_and(vi_srli(vi_widen_u8(_mm_maskz_loadu_epi8(lanes, row + k)), shift), vi_set1(mask));
        _mm512_mask_storeu_ps(out + k, lanes, vf_from_vi(codes));
    }
#endif
    for (; k < width; ++k) out[k] = (float)(((int32_t)row[k] >> shift) & mask);
}

/* The de-interleaving of a rank-long operand into planes: order[j] = the operand column at plane
 * position j = p width + k, that is k PER + p, or -1 past the rank. Found once per call, so that
 * the per-group work below is free of divisions. */
static void plane_order(int64_t rank, int64_t width, int bits, int32_t *order) {
    const int per = 8 / bits;
    for (int64_t j = 0; j < per * width; ++j) {
        const int64_t c = (j % width) * per + j / width;
        order[j] = c < rank ? (int32_t)c : -1;
    }
}

/* The register path of deinterleave / deinterleave_half (x float32, or float16 when is_half, a
 * constant at every call): 1 where it applies (n <= 64, whole vectors), else 0. */
ALWAYS_INLINE int deinterleave_in_registers(const void *x, int is_half, int64_t rank, int64_t width, int64_t n, const int32_t *order, float *planes) {
#if defined(LANES)
    if (n % LANES == 0 && n <= 64) {
        vf src[64 / LANES];
        for (int s = 0; s < n / LANES; ++s)
            src[s] = is_half ? vf_load_half_upto((const half *)x + LANES * s, rank - LANES * s) : vf_load_upto((const float *)x + LANES * s, rank - LANES * s);
        deinterleave_registers(src, width, n, order, planes);
        return 1;
    }
#endif
    return 0;
}

/* operand x (rank) -> planes[j] = x[order[j]] (0 where order[j] < 0), for n = PER width
 * positions. int4 / int2 keys do this twice per group of G tokens (scales, zeros), in registers
 * where n <= 64. */
ALWAYS_INLINE void deinterleave(const float *x, int64_t rank, int64_t width, int64_t n, const int32_t *order, float *planes) {
    if (deinterleave_in_registers(x, 0, rank, width, n, order, planes)) return;
    for (int64_t j = 0; j < n; ++j) planes[j] = order[j] < 0 ? 0.0f : x[order[j]];
}

/* As deinterleave, for a float16 operand (a group's scales or zeros), widened first (in
 * registers where the vector path takes it: a group's are put in order in ~20 instructions). */
ALWAYS_INLINE void deinterleave_half(const half *x, int64_t rank, int64_t width, int64_t n, const int32_t *order, float *planes) {
    if (deinterleave_in_registers(x, 1, rank, width, n, order, planes)) return;
    float wide[8 * MAX_BYTES];
    for (int64_t c = 0; c < rank; ++c) wide[c] = widen_half(x[c]);
    deinterleave(wide, rank, width, n, order, planes);
}

ALWAYS_INLINE float plane_dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t k = 0; k < n; ++k) s += a[k] * b[k];
    return s;
}

/* Byte row `row` widened to floats in plane order (out[p width + k] = column k PER + p), as
 * stored values: int8 codes as they are (their per-token scale is applied by the caller, a common
 * factor of the row), int4 / int2 codes as the oracle reads them, fl32(code s + z) with the
 * row's scale and zero in the same plane order (NULL: the codes alone): one rounding of the exact value (code s is exact
 * in float32: a b-bit integer times a float16), which an fma gives. Factoring s and z out of the
 * sums instead would leave two large terms that cancel (z is the slice minimum), losing more
 * than the oracle's float32 error on long streams; the one-query-head paths factor about the
 * middle code instead (spec Q6, centred_planes). */
ALWAYS_INLINE void widen_row(const uint8_t *row, int64_t width, int bits, const float *scale_planes, const float *zero_planes,
                             float *out) {
    const int per = 8 / bits;
#if defined(LANES)
    /* Rows of 4 or 8 bytes (int2 at r = 16 / 32, int4 at r = 16) have planes narrower than a
     * vector, and storing planes one by one, then reading a vector back, stalls store forwarding
     * (the compiler's version spent most of its time there): chunk_codes fills whole vectors. */
    if (whole_chunks(width, bits))
        for (int64_t c = 0; c < per * width / LANES; ++c) vf_store(out + LANES * c, chunk_codes(row, width, bits, c));
    else
#endif
        for (int p = 0; p < per; ++p) widen_plane(row, width, bits, p, out + p * width);
    if (bits == 8 || !scale_planes) return; /* int8, or per-token scales applied by the caller */
    const int64_t n = per * width;
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) out[k] = __builtin_fmaf(out[k], scale_planes[k], zero_planes[k]);
}

/* logits[i][t] = query_planes[i] . widened row t (times row_scale[t] when given), t < tokens.
 * `readable` rows of codes exist (>= tokens: the caller goes on with the rows after these, as it
 * does group after group), the bound of the prefetches. */
ALWAYS_INLINE void rows_logits(const uint8_t *codes, int64_t tokens, int64_t readable, int64_t width, int bits, int64_t queries,
                               const float *query_planes, const float *scale_planes, const float *zero_planes,
                               const float *row_scale, float *out, int64_t out_row_stride) {
    const int64_t n = (8 / bits) * width;
    int64_t t = 0;
#if defined(LANES)
    /* blocks of LANES tokens, their dot products folded together (fold_block) */
    const vi order = vi_load(block_lanes);
    /* Each row dequantised and dotted in registers, chunk by chunk: no widened copy stored and
     * read back, one fma per element for the reading and one for the dot. One query head: chunk
     * after chunk over the block's rows, so that a chunk's query, scale and zero take three
     * registers and the rows' sums are LANES independent fma chains (AVX2 has 16 registers: row
     * after row, the four chunks' twelve would spill). Several:
     * row after row, each row serving every query head. The sums are added in the same order. */
    if (register_chunks(width, bits) && queries == 1) {
        const int64_t chunks = n / LANES;
        for (; t + LANES <= tokens; t += LANES) {
            prefetch_rows(codes, t + PREFETCH_ROWS, LANES, readable, width);
            vf v[LANES];
#pragma GCC unroll 4
            for (int64_t c = 0; c < chunks; ++c) {
                const vf qc = vf_load(query_planes + LANES * c);
                const vf s = bits < 8 ? vf_load(scale_planes + LANES * c) : vf_zero(), z = bits < 8 ? vf_load(zero_planes + LANES * c) : vf_zero();
#pragma GCC unroll 16
                for (int b = 0; b < LANES; ++b) {
                    vf x = chunk_codes(codes + (t + b) * width, width, bits, c);
                    if (bits < 8) x = vf_fmadd(x, s, z);
                    v[b] = c == 0 ? vf_mul(qc, x) : vf_fmadd(qc, x, v[b]);
                }
            }
            vf dots = vf_permute(fold_block(v), order);
            if (row_scale) dots = vf_mul(dots, vf_load(row_scale + t));
            vf_store(out + t, dots);
        }
    }
    if (register_chunks(width, bits) && queries <= REGISTER_QUERIES) {
        const int64_t chunks = n / LANES;
        vf S[4], Z[4];
        for (int64_t c = 0; c < chunks; ++c)
            if (bits < 8) {
                S[c] = vf_load(scale_planes + LANES * c);
                Z[c] = vf_load(zero_planes + LANES * c);
            }
        vf v[REGISTER_QUERIES][LANES];
        for (; t + LANES <= tokens; t += LANES) {
            prefetch_rows(codes, t + PREFETCH_ROWS, LANES, readable, width);
#pragma GCC unroll 16
            for (int b = 0; b < LANES; ++b) {
                const uint8_t *row = codes + (t + b) * width;
                vf x[4];
#pragma GCC unroll 4
                for (int64_t c = 0; c < chunks; ++c) {
                    x[c] = chunk_codes(row, width, bits, c);
                    if (bits < 8) x[c] = vf_fmadd(x[c], S[c], Z[c]);
                }
                for (int64_t i = 0; i < queries; ++i) { /* the row serves every query head of the group */
                    const float *qi = query_planes + i * n;
                    vf acc = vf_mul(vf_load(qi), x[0]);
#pragma GCC unroll 4
                    for (int64_t c = 1; c < chunks; ++c) acc = vf_fmadd(vf_load(qi + LANES * c), x[c], acc);
                    v[i][b] = acc;
                }
            }
            for (int64_t i = 0; i < queries; ++i) {
                vf dots = vf_permute(fold_block(v[i]), order);
                if (row_scale) dots = vf_mul(dots, vf_load(row_scale + t));
                vf_store(out + i * out_row_stride + t, dots);
            }
        }
    }
    if (n % LANES == 0 && n <= 8 * MAX_BYTES / LANES) {
        float block[8 * MAX_BYTES];
        for (; t + LANES <= tokens; t += LANES) {
            prefetch_rows(codes, t + PREFETCH_ROWS, LANES, readable, width);
            for (int b = 0; b < LANES; ++b) widen_row(codes + (t + b) * width, width, bits, scale_planes, zero_planes, block + b * n);
            for (int64_t i = 0; i < queries; ++i) {
                const float *qi = query_planes + i * n;
                vf v[LANES];
                for (int b = 0; b < LANES; ++b) {
                    vf acc = vf_mul(vf_load(qi), vf_load(block + b * n));
                    for (int64_t k = LANES; k < n; k += LANES) acc = vf_fmadd(vf_load(qi + k), vf_load(block + b * n + k), acc);
                    v[b] = acc;
                }
                vf dots = vf_permute(fold_block(v), order);
                if (row_scale) dots = vf_mul(dots, vf_load(row_scale + t));
                vf_store(out + i * out_row_stride + t, dots);
            }
        }
    }
#endif
    float widened[8 * MAX_BYTES];
    for (; t < tokens; ++t) {
        widen_row(codes + t * width, width, bits, scale_planes, zero_planes, widened);
        for (int64_t i = 0; i < queries; ++i) {
            const float dot = plane_dot(query_planes + i * n, widened, n);
            out[i * out_row_stride + t] = row_scale ? dot * row_scale[t] : dot;
        }
    }
}

#if defined(LANES)
/* Query heads whose value sums a `direct` block takes together (each row widened once in
 * registers, then added into every one's sums): their sums must stay in registers, which
 * AVX-512's 32 hold for two query heads (at most 2 x 8 vectors beside the row's) and AVX2's 16
 * for one. */
#define DIRECT_QUERIES (LANES == 16 ? 2 : 1)

/* Chunk k of row b of a block (`bytes`: its first row) as stored values: int8 codes, int4 / int2
 * fl32(code s + z) with the row's s and z, or from centred_planes' codes (`centred`). */
ALWAYS_INLINE vf block_chunk(const uint8_t *bytes, int64_t width, int bits, int b, int64_t k, const float *scales, const float *zeros,
                             const int8_t *centred, const struct chunk_plan *plan) {
    if (centred) return centred_chunk(centred, VALUE_BLOCK * width, width, b, k);
    vf x = plan_or_chunk(bytes + b * width, width, bits, k, plan);
    if (bits != 8) x = vf_fmadd(x, vf_set1(scales[b]), vf_set1(zeros[b]));
    return x;
}

/* acc[i][p width + k] += sum of w[i][t + b] x(t + b) over one block of 16 rows b (see
 * rows_value_sums), int4 / int2 rows as fl32(code s + z) with their token's s and z, rows of n
 * codes in `vectors` (a constant: WITH_VALUE_WIDTH) vectors. `direct`: at most DIRECT_QUERIES query
 * heads, rows of whole chunks (whole_chunks, n <= 8 LANES) or read by a `plan`: each chunk goes
 * from the codes into every query head's sums in registers. Otherwise the block's rows are
 * widened into `block` once and read by every query head: AVX2 stores one vector a cycle, so
 * for one query head the store of the widened block, not the arithmetic, bound the sums. Both
 * add in the same order. */
ALWAYS_INLINE void block_value_sums(const uint8_t *codes, int64_t width, int bits, int64_t queries, const float *w, int64_t w_row_stride,
                                    const float *scales, const float *zeros, float *acc, float *block, int direct, const int8_t *centred,
                                    const struct chunk_plan *plan, const int64_t vectors) {
    /* rows read by a plan (planned_chunk) fill their last vector partly: the block's rows are
     * whole vectors, and only the first n lanes of the sums are added to acc */
    const int64_t n = (8 / bits) * width, stride = LANES * vectors;
    if (!direct)
#pragma GCC unroll 1 /* whole, the unrolled rows made GCC keep the block in (spilled) registers */
        for (int b = 0; b < VALUE_BLOCK; ++b) {
            float *row = block + b * stride;
            const uint8_t *bytes = codes + b * width;
            if (plan || whole_chunks(width, bits)) { /* widened and dequantised in one pass */
                for (int64_t c = 0; c < vectors; ++c) vf_store(row + LANES * c, block_chunk(codes, width, bits, b, c, scales, zeros, NULL, plan));
                continue;
            }
            widen_row(bytes, width, bits, NULL, NULL, row);
            if (bits != 8) {
                const vf s = vf_set1(scales[b]), z = vf_set1(zeros[b]);
                for (int64_t k = 0; k < n; k += LANES) vf_store(row + k, vf_fmadd(vf_load(row + k), s, z));
            }
        }
    /* query heads in passes of `group`: all of them at once where direct (queries <= DIRECT_QUERIES) */
    const int64_t group = direct ? queries : 1;
    for (int64_t first = 0; first < queries; first += group) {
        /* the block's own sum, then added to the tile's: a sequential sum over the tile's tokens
         * rounds too much where the weighted sum cancels (docs/benchmarks.md, "value tiles") */
        /* `centred` (one query head, rows of whole chunks: the block's codes minus M, from
         * centred_planes): spec Q6.1's form, w x = (w s)(code - M) + w (z + M s), the second
         * term the same in every column, summed once per block (in vectors: a scalar chain of
         * 16 dependent fmas per block cost 10%) */
        float offset = 0.0f, scaled_w[VALUE_BLOCK];
        const float *weights[DIRECT_QUERIES];
        for (int64_t i = 0; i < group && i < DIRECT_QUERIES; ++i) weights[i] = w + (first + i) * w_row_stride;
        if (centred) {
            const vf middle = vf_set1((float)(1 << (bits - 1))), over_f = vf_set1(centred_unscale(bits));
            vf sum = vf_zero();
            for (int b = 0; b < VALUE_BLOCK; b += LANES) {
                const vf wb = vf_load(weights[0] + b), sb = vf_load(scales + b);
                sum = vf_fmadd(wb, vf_fmadd(middle, sb, vf_load(zeros + b)), sum);
                vf_store(scaled_w + b, vf_mul(vf_mul(wb, sb), over_f)); /* (w s)/F, exactly: the codes are F (code - M) */
            }
            offset = vf_reduce_add(sum);
            weights[0] = scaled_w;
        }
        /* `sets` interleaved partial sums (token b feeds set b mod sets): with one chain per
         * register the fma latency, not the throughput, bound narrow rows (n = 32 in 16 lanes:
         * two chains of 16 dependent fmas per block); up to ~8 chains a query head */
        enum { MAX_SETS = 4 };
        const int sets = vectors <= 2 ? 4 : vectors <= 4 ? 2 : 1;
        vf sums[DIRECT_QUERIES][MAX_SETS][128 / LANES];
#pragma GCC unroll 2
        for (int64_t i = 0; i < DIRECT_QUERIES; ++i)
#pragma GCC unroll 4
            for (int j = 0; j < sets; ++j)
#pragma GCC unroll 16
                for (int64_t k = 0; k < vectors; ++k) sums[i][j][k] = vf_zero();
        /* the loops over sets, query heads and vectors unrolled whole: sums and x in registers */
        for (int b = 0; b < VALUE_BLOCK; b += sets)
#pragma GCC unroll 4
            for (int j = 0; j < sets; ++j) {
                vf x[128 / LANES];
#pragma GCC unroll 16
                for (int64_t k = 0; k < vectors; ++k)
                    x[k] = direct ? block_chunk(codes, width, bits, b + j, k, scales, zeros, centred, plan) : vf_load(block + (b + j) * stride + LANES * k);
#pragma GCC unroll 2
                for (int64_t i = 0; i < DIRECT_QUERIES; ++i) {
                    if (i >= group) break;
                    const vf wt = vf_set1(weights[i][b + j]);
#pragma GCC unroll 16
                    for (int64_t k = 0; k < vectors; ++k) sums[i][j][k] = vf_fmadd(wt, x[k], sums[i][j][k]);
                }
            }
#pragma GCC unroll 2
        for (int64_t i = 0; i < DIRECT_QUERIES; ++i) {
            if (i >= group) break;
            float *a = acc + (first + i) * n;
#pragma GCC unroll 16
            for (int64_t k = 0; k < vectors; ++k) {
                vf total = sums[i][0][k];
#pragma GCC unroll 4
                for (int j = 1; j < sets; ++j) total = vf_add(total, sums[i][j][k]);
                if (centred) total = vf_add(total, vf_set1(offset));
                const int64_t left = n - LANES * k;
                if (left >= LANES)
                    vf_store(a + LANES * k, vf_add(vf_load(a + LANES * k), total));
                else
                    vf_store_first(a + LANES * k, left, vf_add(vf_load_first(a + LANES * k, left), total));
            }
        }
    }
}

/* The blocks of 16 rows of rows_value_sums from row t (while a whole block is left) on the vector
 * path, rows in `vectors` (a constant) vectors; returns the first row not summed. */
ALWAYS_INLINE int64_t value_blocks(const uint8_t *codes, int64_t t, int64_t tokens, int64_t readable, int64_t width, int bits, int64_t queries,
                                   const float *w, int64_t w_row_stride, const half *token_scale, const half *token_zero, float *acc,
                                   const struct chunk_plan *plan, const int64_t vectors) {
    const int64_t n = (8 / bits) * width;
    const int direct = queries <= DIRECT_QUERIES && (plan || whole_chunks(width, bits)) && n <= 8 * LANES;
    float block[VALUE_BLOCK * 128];
    /* direct rows of whole chunks for one query head are read centred (spec Q6), the next
     * block's codes put in order while a block is summed (see centred_logits) */
    const int centred = direct && queries == 1 && centred_rows(width, bits);
    int8_t centred_codes[2][VALUE_BLOCK * 128] __attribute__((aligned(64)));
    for (int64_t k = 0; t + VALUE_BLOCK <= tokens; t += VALUE_BLOCK, ++k) {
        if (centred && k == 0) centred_planes(codes, VALUE_BLOCK * width, bits, centred_codes[0]);
        if (centred && t + 2 * VALUE_BLOCK <= tokens) centred_planes(codes + (t + VALUE_BLOCK) * width, VALUE_BLOCK * width, bits, centred_codes[(k + 1) % 2]);
        float scales[VALUE_BLOCK], zeros[VALUE_BLOCK];
        if (bits != 8)
            for (int j = 0; j < VALUE_BLOCK; j += LANES) {
                vf_store(scales + j, vf_load_half(token_scale + t + j));
                vf_store(zeros + j, vf_load_half(token_zero + t + j));
            }
        prefetch_rows(codes, t + PREFETCH_ROWS, VALUE_BLOCK, readable, width);
        if (direct && queries == 1)
            block_value_sums(codes + t * width, width, bits, 1, w + t, w_row_stride, scales, zeros, acc, block, 1, centred ? centred_codes[k % 2] : NULL, plan, vectors);
        else if (direct)
            block_value_sums(codes + t * width, width, bits, DIRECT_QUERIES, w + t, w_row_stride, scales, zeros, acc, block, 1, NULL, plan, vectors);
        else
            block_value_sums(codes + t * width, width, bits, queries, w + t, w_row_stride, scales, zeros, acc, block, 0, NULL, plan, vectors);
    }
    return t;
}
#endif

/* acc[i][p width + k] += w[i][t] x_{k PER + p}(t) over the rows of one tile, x the widened row;
 * int4 / int2 rows take their token's scale and zero (token_scale[t], token_zero[t]). Prefetches
 * reach into the `readable` rows, as rows_logits. */
ALWAYS_INLINE void rows_value_sums(const uint8_t *codes, int64_t tokens, int64_t readable, int64_t width, int bits, int64_t queries,
                                   const float *w, int64_t w_row_stride, const half *token_scale, const half *token_zero,
                                   float *acc, float *blocks, const int64_t vectors) {
    const int64_t n = (8 / bits) * width;
    int64_t t = 0;
#if defined(LANES)
    /* blocks of 16 rows, each query's sums kept in registers over the block (n / LANES vectors,
     * rounded up, n <= 128) instead of loaded and stored for every token; 16 lanes read rows of
     * any width by a plan, 8 lanes rows of whole vectors */
    struct chunk_plan plans[PLAN_CHUNKS], *plan = NULL;
    if (LANES == 16 && !whole_chunks(width, bits) && n <= 128) plan_chunks(width, bits, plan = plans);
    if ((plan || n % LANES == 0) && n <= 128)
        t = value_blocks(codes, t, tokens, readable, width, bits, queries, w, w_row_stride, token_scale, token_zero, acc, plan, vectors);
#else
    (void)vectors;
#endif
    /* the same per-block sums (16 tokens) added to the tile's, on rows of any width */
    float widened[8 * MAX_BYTES];
    for (; t < tokens; t += VALUE_BLOCK) {
        const int64_t end = t + VALUE_BLOCK < tokens ? t + VALUE_BLOCK : tokens;
        memset(blocks, 0, sizeof(float) * queries * n);
        for (int64_t u = t; u < end; ++u) {
            widen_row(codes + u * width, width, bits, NULL, NULL, widened);
            if (bits != 8) {
                const float s = widen_half(token_scale[u]), z = widen_half(token_zero[u]);
#pragma omp simd
                for (int64_t k = 0; k < n; ++k) widened[k] = __builtin_fmaf(widened[k], s, z);
            }
            for (int64_t i = 0; i < queries; ++i) {
                const float wt = w[i * w_row_stride + u];
                float *b = blocks + i * n;
#pragma omp simd
                for (int64_t k = 0; k < n; ++k) b[k] += wt * widened[k];
            }
        }
#pragma omp simd
        for (int64_t k = 0; k < queries * n; ++k) acc[k] += blocks[k];
    }
}


/* For tests of the exponential the softmax uses: out[i] = e^x[i]. */
void softmax_exp(int64_t count, const float *x, float *out) {
    int64_t i = 0;
#if defined(LANES)
    for (; i + LANES <= count; i += LANES) vf_store(out + i, exp_lanes(vf_load(x + i)));
    if (i < count) {
        vf_store_first(out + i, count - i, exp_lanes(vf_load_first(x + i, count - i)));
        i = count;
    }
#endif
    for (; i < count; ++i) out[i] = expf(x[i]);
}

/* One side (keys or values) of a one-chunk quantised state, as stored (N H heads evenly spaced):
 * int8: codes (rows of `rank` bytes) and per-token float32 scales (spec A10); int4 / int2: packed
 * codes (rows of `width` bytes) and float16 scale and zero, per channel and group of `group`
 * tokens for keys, per token for values (spec/quantization.md Q2). */
struct coefficient_side {
    const uint8_t *codes;
    int64_t head_stride, width, rank;
    const void *scale; /* float32 (int8) or float16 */
    const half *zero; /* int4 / int2 only */
    int64_t scale_head_stride;
    int64_t group; /* keys of int4 / int2: tokens per scale group */
};

#if defined(LANES)
/* Spec Q6 step 1 for one key group (its float16 scales and zeros as stored, widened once for
 * both terms): (q∘s)/F in plane order into `terms` (centred_planes' codes are F (code - M)), and
 * the constant term q . (z + M s) in column order as LANES partial sums. q and q_over_f: the
 * projected query and it over F, in column order, `chunks` vectors (0 past the rank). */
ALWAYS_INLINE vf group_terms(const vf *q, const vf *q_over_f, const half *scale, const half *zero, int64_t rank, int64_t width, int64_t chunks,
                             const int32_t *order, float middle, float *terms) {
    vf products[4], sum = vf_zero();
    for (int64_t c = 0; c < chunks; ++c) {
        const vf s = vf_load_half_upto(scale + LANES * c, rank - LANES * c);
        products[c] = vf_mul(q_over_f[c], s);
        sum = vf_fmadd(q[c], vf_fmadd(vf_set1(middle), s, vf_load_half_upto(zero + LANES * c, rank - LANES * c)), sum);
    }
    deinterleave_registers(products, width, LANES * chunks, order, terms);
    return sum;
}

/* Logits of one head's whole key groups for one query head, rows of whole chunks
 * (centred_rows) and groups of whole blocks of LANES tokens: spec Q6.1's centred form,
 * l_t = (q∘s) . (code_t - M) + q . (z + M s) with the group's s, z. Each code costs one widening
 * load, one conversion and the dot's fma (centred_planes); the dequantising fma of the other
 * paths is folded into q∘s, once per group. The groups' q∘s (in plane order) and constant terms
 * (group_terms) are taken first, GROUP_TERMS groups at a time, in a loop of their own, which
 * keeps the row loop free of them. The codes of block k + 1 are put in order while block k is
 * summed: a 32-byte store forwards slowly to the 8-byte loads right after it. */
#define GROUP_TERMS 32
ALWAYS_INLINE void centred_logits(const uint8_t *codes, const half *scale, const half *zero, int64_t tokens, int64_t G, int64_t rank, int64_t width,
                                  int bits, const int32_t *order, const float *q, float *out) {
    const int64_t n = (8 / bits) * width, chunks = n / LANES, block = LANES * width, blocks = tokens / LANES, groups = tokens / G;
    const float middle = (float)(1 << (bits - 1));
    if (groups == 0) return;
    const vi lanes = vi_load(block_lanes);
    vf q_columns[4], q_over_f[4]; /* (q/F)∘s = (q∘s)/F, exactly */
    for (int64_t c = 0; c < chunks; ++c) {
        q_columns[c] = vf_load_upto(q + LANES * c, rank - LANES * c);
        q_over_f[c] = vf_mul(q_columns[c], vf_set1(centred_unscale(bits)));
    }
    float terms[GROUP_TERMS][4 * LANES] __attribute__((aligned(64))), offsets[GROUP_TERMS]; /* n <= 4 LANES (register_chunks) */
    int8_t centred[2][4 * LANES * LANES] __attribute__((aligned(64)));
    centred_planes(codes, block, bits, centred[0]);
    int64_t k = 0; /* blocks done */
    for (int64_t first = 0; first < groups; first += GROUP_TERMS) {
        const int64_t count = groups - first < GROUP_TERMS ? groups - first : GROUP_TERMS;
        /* LANES groups at a time, their constant terms' partial sums folded together (a
         * horizontal sum each cost ~50 cycles a group, most of the groups' time) */
        int64_t g = 0;
        for (vf sums[LANES]; g + LANES <= count; g += LANES) {
            for (int b = 0; b < LANES; ++b)
                sums[b] = group_terms(q_columns, q_over_f, scale + (first + g + b) * rank, zero + (first + g + b) * rank, rank, width, chunks, order, middle, terms[g + b]);
            vf_store(offsets + g, vf_permute(fold_block(sums), lanes));
        }
        for (; g < count; ++g)
            offsets[g] = vf_reduce_add(group_terms(q_columns, q_over_f, scale + (first + g) * rank, zero + (first + g) * rank, rank, width, chunks, order, middle, terms[g]));
        for (int64_t i = 0; i < count; ++i) {
            vf scaled_q[4];
            for (int64_t c = 0; c < chunks; ++c) scaled_q[c] = vf_load(terms[i] + LANES * c);
            const vf offset = vf_set1(offsets[i]);
            for (int64_t j = 0; j < G / LANES; ++j, ++k) {
                const int64_t t = k * LANES;
                prefetch_rows(codes, t + PREFETCH_ROWS, LANES, tokens, width);
                if (k + 1 < blocks) centred_planes(codes + (t + LANES) * width, block, bits, centred[(k + 1) % 2]);
                const int8_t *rows = centred[k % 2];
                vf v[LANES];
#pragma GCC unroll 4
                for (int64_t c = 0; c < chunks; ++c) {
#pragma GCC unroll 16
                    for (int b = 0; b < LANES; ++b) {
                        const vf x = centred_chunk(rows, block, width, b, c);
                        v[b] = c == 0 ? vf_mul(scaled_q[c], x) : vf_fmadd(scaled_q[c], x, v[b]);
                    }
                }
                vf_store(out + t, vf_add(vf_permute(fold_block(v), lanes), offset));
            }
        }
    }
}
#endif

/* Logits of one head's whole key groups of int4 / int2 keys (`scale`, `zero`: the head's group
 * scales and zeros), rows of `width` bytes (constant where WITH_WIDTH makes it one), for the
 * projected queries q (queries, rank). One query head over rows of whole chunks goes to
 * centred_logits; otherwise the queries are put in plane order at planes[0 .. queries n), and
 * group g's scales and zeros at planes + (queries + 2 (g mod 2)) n, one group ahead, so that
 * their loads, shuffles and stores overlap the logits of the group before instead of delaying
 * its first rows. */
ALWAYS_INLINE void group_logits(const uint8_t *codes, const half *scale, const half *zero, int64_t tokens, int64_t G, int64_t rank, int64_t width,
                                int bits, int64_t queries, const int32_t *order, const float *q, float *planes, float *out, int64_t out_row_stride) {
    const int64_t n = (8 / bits) * width, groups = tokens / G;
#if defined(LANES)
    if (queries == 1 && register_chunks(width, bits) && centred_rows(width, bits) && G % LANES == 0) {
        centred_logits(codes, scale, zero, groups * G, G, rank, width, bits, order, q, out);
        return;
    }
#endif
    for (int64_t i = 0; i < queries; ++i) deinterleave(q + i * rank, rank, width, n, order, planes + i * n);
    if (groups > 0) {
        deinterleave_half(scale, rank, width, n, order, planes + queries * n);
        deinterleave_half(zero, rank, width, n, order, planes + (queries + 1) * n);
    }
    for (int64_t g = 0; g < groups; ++g) {
        if (g + PREFETCH_GROUPS < groups) { /* one group's scales or zeros: 2 r bytes */
            for (int64_t off = 0; off < 2 * rank; off += 64) {
                __builtin_prefetch((const char *)(scale + (g + PREFETCH_GROUPS) * rank) + off, 0, 0);
                __builtin_prefetch((const char *)(zero + (g + PREFETCH_GROUPS) * rank) + off, 0, 0);
            }
        }
        const float *scale_planes = planes + (queries + 2 * (g % 2)) * n, *zero_planes = scale_planes + n;
        if (g + 1 < groups) {
            float *next = planes + (queries + 2 * ((g + 1) % 2)) * n;
            deinterleave_half(scale + (g + 1) * rank, rank, width, n, order, next);
            deinterleave_half(zero + (g + 1) * rank, rank, width, n, order, next + n);
        }
        rows_logits(codes + g * G * width, G, tokens - g * G, width, bits, queries, planes, scale_planes, zero_planes, NULL, out + g * G, out_row_stride);
    }
}

/* Logits of one head's first `tokens` keys (int4 / int2: whole groups) into out (queries rows,
 * `out_row_stride` apart) for projected queries q (queries, rank). planes: (queries + 4) n floats. */
static void head_logits(int bits, const struct coefficient_side *keys, int64_t h, int64_t queries, int64_t tokens, const float *q,
                        float *planes, float *out, int64_t out_row_stride) {
    const uint8_t *codes = keys->codes + h * keys->head_stride;
    if (bits == FLOAT_BITS) {
        const float *rows = (const float *)keys->codes + h * keys->head_stride; /* strides count floats */
        const int64_t rank = keys->rank, width = keys->width;
        for (int64_t i = 0; i < queries; ++i) {
            const float *qi = q + i * rank;
            float *o = out + i * out_row_stride;
            int64_t t = 0;
            for (; t + 4 <= tokens; t += 4) { /* four tokens' dots at once: four independent fma chains */
                const float *r0 = rows + t * width, *r1 = r0 + width, *r2 = r1 + width, *r3 = r2 + width;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int64_t k = 0; k < rank; ++k) {
                    s0 += qi[k] * r0[k];
                    s1 += qi[k] * r1[k];
                    s2 += qi[k] * r2[k];
                    s3 += qi[k] * r3[k];
                }
                o[t] = s0, o[t + 1] = s1, o[t + 2] = s2, o[t + 3] = s3;
            }
            for (; t < tokens; ++t) o[t] = plane_dot(qi, rows + t * width, rank);
        }
        return;
    }
    if (bits == 8) {
        const float *scale = (const float *)keys->scale + h * keys->scale_head_stride;
        WITH_WIDTH(keys->rank, rows_logits(codes, tokens, tokens, W, 8, queries, q, NULL, NULL, scale, out, out_row_stride));
        return;
    }
    const int64_t width = keys->width, rank = keys->rank, G = keys->group;
    int32_t order[8 * MAX_BYTES];
    plane_order(rank, width, bits, order);
    const half *scale = (const half *)keys->scale + h * keys->scale_head_stride, *zero = keys->zero + h * keys->scale_head_stride;
    if (bits == 4)
        WITH_WIDTH(width, group_logits(codes, scale, zero, tokens, G, rank, W, 4, queries, order, q, planes, out, out_row_stride));
    else
        WITH_WIDTH(width, group_logits(codes, scale, zero, tokens, G, rank, W, 2, queries, order, q, planes, out, out_row_stride));
}

/* Spec A3 with the global maximum (A3.1) over one query head's `tokens` logits, in place:
 * m = max(initial, max_t l_t), l_t <- e^(l_t - m) times value_scale[t] when given (int8 values:
 * spec A10 folds the per-token scale into the weight), returns m and Z = sum_t e^(l_t - m), the
 * latter summed per lane over each tile of `tile` tokens, then over lanes and tiles (the value
 * sums' order). */
static void row_weights(float *l, int64_t tokens, int64_t tile, float initial, const float *value_scale, float *max_out, float *total_out) {
    float m = initial, Z = 0.0f;
    int64_t t = 0;
#if defined(LANES)
    vf mv = vf_set1(initial);
    for (; t + LANES <= tokens; t += LANES) mv = vf_max(mv, vf_load(l + t));
    m = vf_reduce_max(mv);
#endif
    for (; t < tokens; ++t) m = l[t] > m ? l[t] : m;
    for (int64_t a = 0; a < tokens; a += tile) {
        const int64_t end = a + tile < tokens ? a + tile : tokens;
        float part = 0.0f;
#if defined(LANES)
        /* 16 lanes whatever the vector width (token u in lane (u - a) mod 16: 16 / LANES vectors,
         * added first), then halving steps: one order on every path */
        const vf mv = vf_set1(m);
        vf sum[16 / LANES];
        for (int j = 0; j < 16 / LANES; ++j) sum[j] = vf_zero();
        for (int64_t u = a; u < end; u += 16)
            for (int j = 0; j < 16 / LANES; ++j) {
                const int64_t v = u + LANES * j, left = end - v;
                if (left >= LANES) { /* masked AVX2 stores are slow (microcoded on AMD): the tile's last vector only */
                    const vf e = exp_lanes(vf_sub(vf_load(l + v), mv));
                    sum[j] = vf_add(sum[j], e);
                    vf_store(l + v, value_scale ? vf_mul(e, vf_load(value_scale + v)) : e);
                } else { /* lanes past `end` read nothing and add 0 */
                    const vf e = vf_keep_first(left, exp_lanes(vf_sub(vf_load_first(l + v, left), mv)));
                    sum[j] = vf_add(sum[j], e);
                    vf_store_first(l + v, left, value_scale ? vf_mul(e, vf_load_first(value_scale + v, left)) : e);
                }
            }
        for (int j = 1; j < 16 / LANES; ++j) sum[0] = vf_add(sum[0], sum[j]);
        part = vf_reduce_add(sum[0]);
#else
        /* the vector path's order: 16 lanes, token u in lane (u - a) mod 16, then halving steps,
         * so every build holds the same tolerance (docs/benchmarks.md, "value tiles") */
        float lanes[16] = {0};
        for (int64_t u = a; u < end; ++u) {
            const float e = expf(l[u] - m);
            lanes[(u - a) & 15] += e;
            l[u] = value_scale ? e * value_scale[u] : e;
        }
        for (int half_width = 8; half_width >= 1; half_width /= 2)
            for (int i = 0; i < half_width; ++i) lanes[i] += lanes[i + half_width];
        part = lanes[0];
#endif
        Z += part;
    }
    *max_out = m;
    *total_out = Z;
}

/* Spec Q1 read of one packed row into column order: out[c] = fl32(code_c s_c + z_c), c < rank,
 * with per-channel float16 scales and zeros (keys: their group's row) or, where `scale` is NULL,
 * the token's s and z for every column (values). 16 columns at a time: their 16 / PER bytes,
 * each repeated PER times by a byte shuffle, shifted per lane to its code and widened. */
ALWAYS_INLINE void read_row(const uint8_t *row, int64_t width, int bits, int64_t rank, const half *scale, const half *zero, float s, float z,
                            float *out) {
    const int per = 8 / bits, mask = (1 << bits) - 1;
    int64_t c = 0;
#if defined(LANES)
    /* lane l: byte l / PER of the LANES columns' LANES / PER bytes, bits (l mod PER) b of it */
    const __m128i spread = bits == 4 ? _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0) : _mm_set_epi8(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const vi shifts = vi_slli(vi_and(vi_lanes(), vi_set1(per - 1)), bits == 4 ? 2 : 1);
    const vi codes_mask = vi_set1(mask);
    for (; c < rank; c += LANES) {
        const int64_t left = rank - c, bytes = width - c / per < LANES / per ? width - c / per : LANES / per;
        uint64_t packed = 0; /* the row's last bytes may end before a whole vector's */
        if (bytes == LANES / per)
            memcpy(&packed, row + c / per, LANES / per);
        else
            for (int64_t k = 0; k < bytes; ++k) packed |= (uint64_t)row[c / per + k] << (8 * k);
        const vi wide = vi_widen_u8(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)&packed), spread));
        const vf x = vf_from_vi(vi_and(vi_srlv(wide, shifts), codes_mask));
        const vf sv = scale ? vf_load_half_first(scale + c, left) : vf_set1(s);
        const vf zv = scale ? vf_load_half_first(zero + c, left) : vf_set1(z);
        vf_store_first(out + c, left, vf_fmadd(x, sv, zv));
    }
#endif
    for (; c < rank; ++c) {
        const float code = (float)((row[c / per] >> ((c % per) * bits)) & mask);
        out[c] = scale ? __builtin_fmaf(code, widen_half(scale[c]), widen_half(zero[c])) : __builtin_fmaf(code, s, z);
    }
}

/* Spec Q1-Q2: the int4 / int2 coefficients of tokens [first, first + count) of every head, in
 * column order, out (heads, out_rows >= count, rank): keys (`side->group` > 0) with their group's per-channel
 * scales and zeros (the tokens in whole groups: the caller reads the float tail), values with
 * their token's. As the oracle reads them: fl32(code s + z), code s exact in float32. Returns 0,
 * or -1 for a layout the kernel does not read. */
int low_bit_rows(int bits, int64_t heads, int64_t first, int64_t count, const struct coefficient_side *side, float *out, int64_t out_rows) {
    if ((bits != 4 && bits != 2) || side->width * (8 / bits) < side->rank) return -1;
    const int64_t rank = side->rank, width = side->width, G = side->group;
    for (int64_t h = 0; h < heads; ++h) {
        const uint8_t *codes = side->codes + h * side->head_stride;
        const half *scale = (const half *)side->scale + h * side->scale_head_stride, *zero = side->zero + h * side->scale_head_stride;
        for (int64_t t = first; t < first + count; ++t) {
            float *o = out + (h * out_rows + t - first) * rank;
            if (G > 0 && bits == 4)
                read_row(codes + t * width, width, 4, rank, scale + (t / G) * rank, zero + (t / G) * rank, 0.0f, 0.0f, o);
            else if (G > 0)
                read_row(codes + t * width, width, 2, rank, scale + (t / G) * rank, zero + (t / G) * rank, 0.0f, 0.0f, o);
            else if (bits == 4)
                read_row(codes + t * width, width, 4, rank, NULL, NULL, widen_half(scale[t]), widen_half(zero[t]), o);
            else
                read_row(codes + t * width, width, 2, rank, NULL, NULL, widen_half(scale[t]), widen_half(zero[t]), o);
        }
    }
    return 0;
}

/* out[i][c] = sum_k x[i][k] M[k][c] for rows i < rows (x rows x inner, M inner x cols, out rows x
 * cols): a query times its map, coefficient sums times the value basis. The sum over k is kept in
 * two halves (even and odd k; `odd`: cols floats of scratch), two fma chains instead of one. */
static void map_rows(const float *x, int64_t rows, int64_t inner, const float *M, int64_t cols, float *odd, float *out) {
    for (int64_t i = 0; i < rows; ++i) {
        float *o = out + i * cols;
        const float *xi = x + i * inner;
        memset(o, 0, sizeof(float) * cols);
        memset(odd, 0, sizeof(float) * cols);
        int64_t k = 0;
        for (; k + 2 <= inner; k += 2) {
            const float a = xi[k], b = xi[k + 1];
            const float *m0 = M + k * cols, *m1 = m0 + cols;
#pragma omp simd
            for (int64_t c = 0; c < cols; ++c) {
                o[c] = __builtin_fmaf(a, m0[c], o[c]);
                odd[c] = __builtin_fmaf(b, m1[c], odd[c]);
            }
        }
        if (k < inner)
#pragma omp simd
            for (int64_t c = 0; c < cols; ++c) o[c] = __builtin_fmaf(xi[k], M[k * cols + c], o[c]);
#pragma omp simd
        for (int64_t c = 0; c < cols; ++c) o[c] += odd[c];
    }
}

/* The keys of a pre-RoPE state (spec/rope.md P3): stored in coefficients of bases taken before
 * the rotation, so each is rebuilt, u_t = B^T c_t, and turned to its position by R_t before its
 * dot products (the rebuild serves every query head of the group: spec/roofline.md R13).
 * `order` permutes the d dims so that the m rotating planes' first dims come first, their second
 * dims next and the fixed dims last, as the caller's bases are permuted (a dot product is
 * invariant under it); the rotation of plane i at position p is by the angle p inv_freq[i],
 * cos and sin scaled by `scaling` (transformers' attention_scaling). Token t sits at position
 * first + t (the sinks come first: spec/window.md W10). */
struct rope_keys {
    const int32_t *order;
    int64_t planes;
    const double *inv_freq;
    double scaling;
    int64_t first;
    const float *offsets; /* rope_tables': cos, then sin, of k inv_freq[i], (ROPE_BLOCK, m) each */
    const double *turns; /* rope_tables': cos, then sin, of ROPE_BLOCK inv_freq[i], (m) each */
};

#define ROPE_BLOCK 16 /* tokens per base angle: cos and sin of the offsets k < 16 come from a table */
#define ROPE_RESEED 64 /* blocks between base angles taken from libm rather than by the recurrence */
#define MAX_DIM 512 /* head size of the rebuilt keys */

/* The tables of a rotation, made once per rotation by the caller and kept in rope_keys: cos and
 * sin of the angles k inv_freq[i] for k < ROPE_BLOCK, offsets (2, ROPE_BLOCK, m) float32, and of
 * ROPE_BLOCK inv_freq[i], turns (2, m) double (the turn from one block's base to the next).
 * Returns 0. */
int rope_offset_tables(int64_t planes, const double *inv_freq, float *offsets, double *turns) {
    for (int64_t i = 0; i < planes; ++i) {
        for (int k = 0; k < ROPE_BLOCK; ++k) {
            offsets[k * planes + i] = (float)cos(k * inv_freq[i]);
            offsets[(ROPE_BLOCK + k) * planes + i] = (float)sin(k * inv_freq[i]);
        }
        turns[i] = cos(ROPE_BLOCK * inv_freq[i]);
        turns[planes + i] = sin(ROPE_BLOCK * inv_freq[i]);
    }
    return 0;
}

/* The base angle of block b (positions first + ROPE_BLOCK b ..): scaling cos and sin of
 * (first + ROPE_BLOCK b) inv_freq[i] into base_* (double, carried from block to block by the
 * turn step_*; every ROPE_RESEED blocks taken afresh from libm, so that the recurrence's
 * rounding, ~1e-16 a step, never reaches float32's) and their float32 roundings into ca, sa. */
static void rope_base(const struct rope_keys *rope, int64_t b, const double *step_cos, const double *step_sin, double *base_cos, double *base_sin,
                      float *ca, float *sa) {
    const int64_t m = rope->planes;
    if (b % ROPE_RESEED == 0) {
        for (int64_t i = 0; i < m; ++i) {
            const double angle = (double)(rope->first + ROPE_BLOCK * b) * rope->inv_freq[i];
            base_cos[i] = cos(angle);
            base_sin[i] = sin(angle);
        }
    } else { /* the test out of the loop, which then vectorises (it ran scalar, a tenth of the keys' time at small ranks) */
#pragma omp simd
        for (int64_t i = 0; i < m; ++i) {
            const double c = base_cos[i], s = base_sin[i];
            base_cos[i] = c * step_cos[i] - s * step_sin[i];
            base_sin[i] = s * step_cos[i] + c * step_sin[i];
        }
    }
#pragma omp simd
    for (int64_t i = 0; i < m; ++i) {
        ca[i] = (float)(rope->scaling * base_cos[i]);
        sa[i] = (float)(rope->scaling * base_sin[i]);
    }
}

/* a . b over n floats: two chains of vectors where n is a multiple of two vectors (the head sizes
 * of models), one horizontal sum per call instead of the reduction loop's prologue and epilogue */
ALWAYS_INLINE float key_dot(const float *a, const float *b, int64_t n) {
#if defined(LANES)
    if (n % (2 * LANES) == 0) {
        vf s0 = vf_zero(), s1 = vf_zero();
        for (int64_t k = 0; k < n; k += 2 * LANES) {
            s0 = vf_fmadd(vf_load(a + k), vf_load(b + k), s0);
            s1 = vf_fmadd(vf_load(a + k + LANES), vf_load(b + k + LANES), s1);
        }
        return vf_reduce_add(vf_add(s0, s1));
    }
#endif
    return plane_dot(a, b, n);
}

/* keys[t][e] = sum_j c_t[j] B[j][e], e < d, for `count` tokens whose coefficients are rows of
 * `rank` floats `stride` apart: the rebuilt keys u_t = B^T c_t (B rank x d, row-major; keys rows of
 * d floats). Each element is one fma chain over j from 0, the same number whichever path takes
 * it: four tokens by four vectors of accumulators share each row of B they load (a token at a
 * time, each fma waits on the one before it and every row is loaded per token), then single
 * tokens, single vectors and scalars. */
ALWAYS_INLINE void rebuild_keys(const float *c, int64_t stride, int64_t count, int64_t rank, const float *B, int64_t d, float *keys) {
    int64_t e = 0;
#if defined(LANES)
    for (; e + 4 * LANES <= d; e += 4 * LANES) {
        int64_t t = 0;
        for (; t + 4 <= count; t += 4) {
            vf acc[4][4];
            for (int u = 0; u < 4; ++u)
                for (int v = 0; v < 4; ++v) acc[u][v] = vf_zero();
            for (int64_t j = 0; j < rank; ++j) {
                const float *row = B + j * d + e;
                const vf b0 = vf_load(row), b1 = vf_load(row + LANES), b2 = vf_load(row + 2 * LANES), b3 = vf_load(row + 3 * LANES);
#pragma GCC unroll 4
                for (int u = 0; u < 4; ++u) {
                    const vf cj = vf_set1(c[(t + u) * stride + j]);
                    acc[u][0] = vf_fmadd(cj, b0, acc[u][0]), acc[u][1] = vf_fmadd(cj, b1, acc[u][1]);
                    acc[u][2] = vf_fmadd(cj, b2, acc[u][2]), acc[u][3] = vf_fmadd(cj, b3, acc[u][3]);
                }
            }
            for (int u = 0; u < 4; ++u)
                for (int v = 0; v < 4; ++v) vf_store(keys + (t + u) * d + e + LANES * v, acc[u][v]);
        }
        for (; t < count; ++t) {
            vf acc[4];
            for (int v = 0; v < 4; ++v) acc[v] = vf_zero();
            for (int64_t j = 0; j < rank; ++j) {
                const vf cj = vf_set1(c[t * stride + j]);
                for (int v = 0; v < 4; ++v) acc[v] = vf_fmadd(cj, vf_load(B + j * d + e + LANES * v), acc[v]);
            }
            for (int v = 0; v < 4; ++v) vf_store(keys + t * d + e + LANES * v, acc[v]);
        }
    }
    for (; e + LANES <= d; e += LANES)
        for (int64_t t = 0; t < count; ++t) {
            vf acc = vf_zero();
            for (int64_t j = 0; j < rank; ++j) acc = vf_fmadd(vf_set1(c[t * stride + j]), vf_load(B + j * d + e), acc);
            vf_store(keys + t * d + e, acc);
        }
#endif
    for (; e < d; ++e)
        for (int64_t t = 0; t < count; ++t) {
            float acc = 0.0f;
            for (int64_t j = 0; j < rank; ++j) acc = __builtin_fmaf(c[t * stride + j], B[j * d + e], acc);
            keys[t * d + e] = acc;
        }
}

/* The coefficients of int8 key tokens first .. first + count - 1 of head h into rows of `rank`
 * floats, as the oracle reads them: fl32(code s) with the token's scale. */
ALWAYS_INLINE void int8_block(const struct coefficient_side *keys, int64_t h, int64_t first, int64_t count, int64_t rank, int64_t width, float *c) {
    const int8_t *s8 = (const int8_t *)keys->codes + h * keys->head_stride;
    const float *scale = (const float *)keys->scale + h * keys->scale_head_stride;
    for (int64_t k = 0; k < count; ++k) {
        const int8_t *row = s8 + (first + k) * width;
        float *out = c + k * rank;
#if defined(LANES) && LANES == 16 /* GCC leaves the scalar loop unvectorised (docs/benchmarks.md) */
        const vf s = vf_set1(scale[first + k]);
        int64_t j = 0;
        for (; j + LANES <= rank; j += LANES) vf_store(out + j, vf_mul(vf_from_vi(vi_widen_i8(load_lane_bytes((const uint8_t *)row + j))), s));
        if (j < rank) vf_store_first(out + j, rank - j, vf_mul(vf_from_vi(vi_widen_i8(_mm_maskz_loadu_epi8(first_lanes(rank - j), row + j))), s));
#else
        for (int64_t j = 0; j < rank; ++j) out[j] = (float)row[j] * scale[first + k];
#endif
    }
}

/* The coefficients of coded tokens first .. first + count - 1 of a low-bit key side (all of one
 * block, a new group's scales and zeros de-interleaved into `planes` where one starts: `next` is
 * the token that starts the next group) into rows of n floats, in plane order, as the oracle reads
 * them: fl32(code s + z) with the group's channel scales (widen_row). */
ALWAYS_INLINE void widen_block(const struct coefficient_side *keys, int64_t h, int bits, int64_t first, int64_t count, int64_t width, int64_t n,
                               const int32_t *order, int64_t *next, float *planes, float *c) {
    const uint8_t *codes = keys->codes + h * keys->head_stride;
    for (int64_t k = 0; k < count; ++k) {
        const int64_t t = first + k;
        if (t == *next) {
            const int64_t offset = h * keys->scale_head_stride + (t / keys->group) * keys->rank;
            deinterleave_half((const half *)keys->scale + offset, keys->rank, width, n, order, planes);
            deinterleave_half(keys->zero + offset, keys->rank, width, n, order, planes + n);
            *next += keys->group;
        }
        widen_row(codes + t * width, width, bits, planes, planes + n, c + k * n);
    }
}

#if defined(LANES) && LANES == 16
/* Keys whose d dims and m planes' first dims are whole vectors, d a multiple of two vectors
 * (key_dot's two chains) and at most 128 (the head sizes of the models, full or partial rotary)
 * are rebuilt, turned and dotted in registers (rope_tile): no key is stored and read back. */
ALWAYS_INLINE int rope_in_registers(int64_t d, int64_t m) { return (d == 32 || d == 64 || d == 128) && m % LANES == 0; }

/* Where a run of tokens' coefficients lie: token k's coefficient j = s length + i (segment s < segments,
 * i < length) at c[k token_stride + s segment_stride + i], its basis row at B + j d. */
struct rope_source {
    const float *c;
    int64_t token_stride, segments, length, segment_stride;
    const float *B;
};

/* `tok` tokens of `src` from token k of the block (tok, vecs = d / LANES and pv = m / LANES are
 * constants: the keys are tok x vecs registers): each key rebuilt as rebuild_keys does (one fma
 * chain over j from 0 per element, the tokens sharing each row of B they load), turned by its
 * offset k in the block only (the table's cos and sin: the block's base angle is in the queries,
 * turn_queries), and dotted with every query head in key_dot's two chains, whose sum goes to
 * dots[i][k] for fold_block. */
ALWAYS_INLINE void rope_tile(int tok, int vecs, int pv, struct rope_source src, int64_t k, int64_t d, int64_t m, const float *off_cos,
                             const float *off_sin, int64_t queries, const float *q, float *dots) {
    vf acc[4][8];
#pragma GCC unroll 4
    for (int u = 0; u < tok; ++u)
#pragma GCC unroll 8
        for (int v = 0; v < vecs; ++v) acc[u][v] = vf_zero();
    const float *row = src.B;
    for (int64_t s = 0; s < src.segments; ++s) {
        const float *c = src.c + s * src.segment_stride;
        for (int64_t j = 0; j < src.length; ++j, row += d) {
            vf b[8];
#pragma GCC unroll 8
            for (int v = 0; v < vecs; ++v) {
                b[v] = vf_load(row + LANES * v);
                __asm__("" : "+v"(b[v])); /* kept in a register: GCC would fold the load into each token's fma, a load per fma */
            }
#pragma GCC unroll 4
            for (int u = 0; u < tok; ++u) {
                const vf cj = vf_set1(c[u * src.token_stride + j]);
#pragma GCC unroll 8
                for (int v = 0; v < vecs; ++v) acc[u][v] = vf_fmadd(cj, b[v], acc[u][v]);
            }
        }
    }
#pragma GCC unroll 4
    for (int u = 0; u < tok; ++u)
#pragma GCC unroll 4
        for (int i = 0; i < pv; ++i) {
            const vf cs = vf_load(off_cos + (k + u) * m + LANES * i), sn = vf_load(off_sin + (k + u) * m + LANES * i);
            const vf ua = acc[u][i], ub = acc[u][pv + i];
            acc[u][i] = vf_sub(vf_mul(ua, cs), vf_mul(ub, sn));
            acc[u][pv + i] = vf_add(vf_mul(ub, cs), vf_mul(ua, sn));
        }
    for (int64_t i = 0; i < queries; ++i) {
        const float *qi = q + i * d;
#pragma GCC unroll 4
        for (int u = 0; u < tok; ++u) {
            vf s0 = vf_zero(), s1 = vf_zero();
#pragma GCC unroll 4
            for (int v = 0; v < vecs; v += 2) {
                s0 = vf_fmadd(vf_load(qi + LANES * v), acc[u][v], s0);
                s1 = vf_fmadd(vf_load(qi + LANES * (v + 1)), acc[u][v + 1], s1);
            }
            vf_store(dots + (i * ROPE_BLOCK + k + u) * LANES, vf_add(s0, s1));
        }
    }
}

/* Tokens k0 .. k1 - 1 of the block from `src` (at token k0): tiles of 4 tokens (2 where d = 128,
 * whose 8 vectors a token would leave too few registers), then single tokens. */
ALWAYS_INLINE void rope_run(int vecs, int pv, struct rope_source src, int64_t k0, int64_t k1, int64_t d, int64_t m, const float *off_cos,
                            const float *off_sin, int64_t queries, const float *q, float *dots) {
    const int tok = vecs <= 4 ? 4 : 2;
    int64_t k = k0;
    for (; k + tok <= k1; k += tok, src.c += tok * src.token_stride)
        rope_tile(tok, vecs, pv, src, k, d, m, off_cos, off_sin, queries, q, dots);
    for (; k < k1; ++k, src.c += src.token_stride) rope_tile(1, vecs, pv, src, k, d, m, off_cos, off_sin, queries, q, dots);
}

/* rope_run with its shape made constant: d / LANES vectors, m / LANES of them turning (rope_in_registers). */
static void rope_runs(struct rope_source src, int64_t k0, int64_t k1, int64_t d, int64_t m, const float *off_cos, const float *off_sin,
                      int64_t queries, const float *q, float *dots) {
#define ROPE_RUN(V, PV) rope_run(V, PV, src, k0, k1, d, m, off_cos, off_sin, queries, q, dots)
    switch ((d / LANES) * 8 + m / LANES) {
    case 2 * 8 + 1: ROPE_RUN(2, 1); break;
    case 4 * 8 + 1: ROPE_RUN(4, 1); break;
    case 4 * 8 + 2: ROPE_RUN(4, 2); break;
    case 8 * 8 + 1: ROPE_RUN(8, 1); break;
    case 8 * 8 + 2: ROPE_RUN(8, 2); break;
    case 8 * 8 + 3: ROPE_RUN(8, 3); break;
    default: ROPE_RUN(8, 4); break; /* 8 * 8 + 4, the last shape rope_in_registers admits */
    }
#undef ROPE_RUN
}

/* The `total` bytes (whole rows of `width`, all of one group) of an int4 / int2 block widened plane
 * by plane, as widen_row reads them (fl32(code s + z)), but LANES bytes of the block at a time
 * whatever the width (rows of a few bytes widened one by one were most of the keys' cost at small
 * ranks): out[p ROPE_BLOCK width + b] is plane p of the block's byte b, which is column b mod
 * width of its row. `wrapped` holds the group's scales, then its zeros, plane by plane, each
 * plane's width columns followed by its first LANES again (rope_wrap): a chunk's LANES scales
 * are those from its first column on. */
ALWAYS_INLINE void widen_block_planes(const uint8_t *bytes, int64_t total, int64_t width, int bits, const float *wrapped, float *out) {
    const int per = 8 / bits;
    const int64_t stride = ROPE_BLOCK * width, plane = width + LANES, step = LANES % width;
    const vi mask = vi_set1((1 << bits) - 1);
    int64_t column = 0;
    for (int64_t b = 0; b < total; b += LANES) {
        const __m128i raw = total - b >= LANES ? load_lane_bytes(bytes + b) : _mm_maskz_loadu_epi8(first_lanes(total - b), bytes + b);
        const vi codes = vi_widen_u8(raw);
#pragma GCC unroll 4
        for (int p = 0; p < per; ++p) {
            const vf x = vf_from_vi(vi_and(vi_srli(codes, p * bits), mask));
            const float *scale = wrapped + p * plane + column, *zero = scale + per * plane;
            vf_store(out + p * stride + b, vf_fmadd(x, vf_load(scale), vf_load(zero)));
        }
        column += step;
        if (column >= width) column -= width;
    }
}

/* widen_block_planes' operand: the scale planes (n = PER width floats, plane order) and the zero
 * planes after them, each plane as its width columns and then its first LANES columns again
 * (cyclically, for rows narrower than LANES). */
static void rope_wrap(const float *planes, int64_t width, int64_t n, float *wrapped) {
    for (int64_t j = 0; j < 2 * n; j += width, wrapped += width + LANES) {
        memcpy(wrapped, planes + j, sizeof(float) * width);
        for (int64_t i = width; i < width + LANES; ++i) wrapped[i] = wrapped[i - width];
    }
}

/* The query heads q (queries, d) turned back by a block's base angle (ca, sa: its scaled cos and
 * sin, rope_base) into turned: q . R(base + k) key = (R(base)^T q) . (R(k) key) (spec/rope.md P3),
 * so that a key is turned by its offset k alone. */
static void turn_queries(const float *q, int64_t queries, int64_t d, int64_t m, const float *ca, const float *sa, float *turned) {
    for (int64_t i = 0; i < queries; ++i, q += d, turned += d) {
        for (int64_t p = 0; p < m; p += LANES) {
            const vf a = vf_load(ca + p), b = vf_load(sa + p), qa = vf_load(q + p), qb = vf_load(q + m + p);
            vf_store(turned + p, vf_add(vf_mul(qa, a), vf_mul(qb, b)));
            vf_store(turned + m + p, vf_sub(vf_mul(qb, a), vf_mul(qa, b)));
        }
        memcpy(turned + 2 * m, q + 2 * m, sizeof(float) * (d - 2 * m)); /* partial rotary: the rest is not turned */
    }
}

/* head_rope_logits where rope_in_registers: a block's keys never stored, each turned by its offset
 * in the block and the queries by the block's base (turn_queries). Its
 * coefficients: float rows as stored, int8 widened row by row, int4 / int2 plane by plane
 * (widen_block_planes) where groups are whole blocks, else row by row (widen_block); the unfinished
 * group's from the float tail. `block`: scratch of ROPE_BLOCK (n + LANES queries) + queries d floats. */
static void head_rope_registers(int bits, const struct coefficient_side *keys, int64_t h, int64_t queries, int64_t complete, int64_t tokens,
                                const float *key_tail, const float *q, const float *B, int64_t d, const struct rope_keys *rope,
                                const float *plane_basis, const int32_t *order, float *planes, float *block, float *out, int64_t out_row_stride) {
    const int64_t rank = keys->rank, m = rope->planes, width = keys->width, G = keys->group;
    const float *off_cos = rope->offsets, *off_sin = rope->offsets + ROPE_BLOCK * m;
    const double *step_cos = rope->turns, *step_sin = rope->turns + m;
    const int low_bit = bits == 4 || bits == 2, per = low_bit ? 8 / bits : 1;
    const int64_t n = low_bit ? per * width : rank;
    const int by_planes = low_bit && width > 0 && G % ROPE_BLOCK == 0; /* every block within one group */
    float *c = block, *dots = block + ROPE_BLOCK * n, *turned = dots + ROPE_BLOCK * LANES * queries;
    float wrapped[2 * (8 * MAX_BYTES + 4 * LANES)];
    double base_cos[MAX_DIM / 2], base_sin[MAX_DIM / 2];
    float ca[MAX_DIM / 2], sa[MAX_DIM / 2];
    int64_t next_group = 0, plane_group = -1;
    const vi lanes = vi_load(block_lanes);
    for (int64_t t0 = 0; t0 < tokens; t0 += ROPE_BLOCK) {
        const int64_t count = tokens - t0 < ROPE_BLOCK ? tokens - t0 : ROPE_BLOCK;
        const int64_t coded = complete - t0 <= 0 ? 0 : complete - t0 < count ? complete - t0 : count; /* the rest: the float tail */
        rope_base(rope, t0 / ROPE_BLOCK, step_cos, step_sin, base_cos, base_sin, ca, sa);
        turn_queries(q, queries, d, m, ca, sa, turned);
        if (coded) {
            struct rope_source src = {c, n, 1, n, 0, low_bit ? plane_basis : B};
            if (bits == FLOAT_BITS) {
                src.c = (const float *)keys->codes + h * keys->head_stride + t0 * width, src.token_stride = width; /* strides count floats */
            } else if (bits == 8) {
                int8_block(keys, h, t0, coded, rank, width, c);
            } else if (by_planes) {
                if (t0 / G != plane_group) {
                    plane_group = t0 / G;
                    const int64_t offset = h * keys->scale_head_stride + plane_group * rank;
                    deinterleave_half((const half *)keys->scale + offset, rank, width, n, order, planes);
                    deinterleave_half(keys->zero + offset, rank, width, n, order, planes + n);
                    rope_wrap(planes, width, n, wrapped);
                }
                widen_block_planes(keys->codes + h * keys->head_stride + t0 * width, coded * width, width, bits, wrapped, c);
                src.token_stride = width, src.segments = per, src.length = width, src.segment_stride = ROPE_BLOCK * width;
            } else if (bits == 4) {
                WITH_WIDTH(width, widen_block(keys, h, 4, t0, coded, W, n, order, &next_group, planes, c));
            } else {
                WITH_WIDTH(width, widen_block(keys, h, 2, t0, coded, W, n, order, &next_group, planes, c));
            }
            rope_runs(src, 0, coded, d, m, off_cos, off_sin, queries, turned, dots);
        }
        if (coded < count) { /* the unfinished group's keys, in float */
            const struct rope_source tail = {key_tail + (t0 + coded - complete) * rank, rank, 1, rank, 0, B};
            rope_runs(tail, coded, count, d, m, off_cos, off_sin, queries, turned, dots);
        }
        for (int64_t i = 0; i < queries; ++i) { /* each token's sums folded as key_dot's horizontal sum adds them */
            vf v[LANES];
            for (int u = 0; u < LANES; ++u) v[u] = u < count ? vf_load(dots + (i * ROPE_BLOCK + u) * LANES) : vf_zero();
            const vf sums = vf_permute(fold_block(v), lanes);
            if (count == LANES)
                vf_store(out + i * out_row_stride + t0, sums);
            else
                vf_store_first(out + i * out_row_stride + t0, count, sums);
        }
    }
}
#endif

/* Logits of one head's `tokens` pre-RoPE keys (spec/rope.md P3 steps 1-2) into out (queries
 * rows, `out_row_stride` apart), for the query heads q (queries, d) in the rope order: each key's
 * coefficients read as the oracle reads them (int8: fl32(code s); int4 / int2: fl32(code s + z)
 * with its group's channel scales; the unfinished group's from the float tail), rebuilt by the
 * head's scaled, permuted basis B (rank x d), turned by R at its position and dotted with every
 * query head. cos and sin of position (block base + k) come by the angle addition from the
 * block's base and the offset tables, in float32, as the torch path's rope_tables computes them.
 * int4 / int2 rows are widened in plane order (widen_row: no shuffles), and rebuilt by B's rows
 * in that order, `plane_basis` (n = PER width rows, 0 past the rank; scratch of n d floats);
 * `planes` holds a group's scales and zeros in plane order (2 n floats). The work goes a block of
 * ROPE_BLOCK tokens at a time (`block`: scratch of ROPE_BLOCK (n + d + ROPE_BLOCK queries) + queries d
 * floats): the block's coefficients, its keys rebuilt together (rebuild_keys), turned, then each
 * query head's dot products of LANES tokens folded together (fold_block: the same sums as
 * key_dot's); with AVX-512, for the head sizes of rope_in_registers, head_rope_registers. */
static void head_rope_logits(int bits, const struct coefficient_side *keys, int64_t h, int64_t queries, int64_t complete, int64_t tokens,
                             const float *key_tail, const float *q, const float *B, int64_t d, const struct rope_keys *rope, float *plane_basis,
                             float *planes, float *block, float *out, int64_t out_row_stride) {
    const int64_t rank = keys->rank, m = rope->planes, width = keys->width;
    const float *off_cos = rope->offsets, *off_sin = rope->offsets + ROPE_BLOCK * m;
    const double *step_cos = rope->turns, *step_sin = rope->turns + m;
    const int64_t n = bits == 8 || bits == FLOAT_BITS ? rank : (8 / bits) * width;
    const float *rows = (const float *)keys->codes + h * keys->head_stride; /* FLOAT_BITS: strides count floats */
    int32_t order[8 * MAX_BYTES];
    if (bits == 4 || bits == 2) {
        plane_order(rank, width, bits, order);
        for (int64_t j = 0; j < n; ++j)
            if (order[j] < 0)
                memset(plane_basis + j * d, 0, sizeof(float) * d);
            else
                memcpy(plane_basis + j * d, B + order[j] * d, sizeof(float) * d);
    }
#if defined(LANES) && LANES == 16
    if (rope_in_registers(d, m)) {
        head_rope_registers(bits, keys, h, queries, complete, tokens, key_tail, q, B, d, rope, plane_basis, order, planes, block, out, out_row_stride);
        return;
    }
#endif
    double base_cos[MAX_DIM / 2], base_sin[MAX_DIM / 2];
    float ca[MAX_DIM / 2], sa[MAX_DIM / 2];
    float *c = block, *key = block + ROPE_BLOCK * n; /* the block's coefficients (rows of n) and keys (rows of d) */
    int64_t next_group = 0;
#if defined(LANES)
    const vi lanes = vi_load(block_lanes);
#endif
    for (int64_t t0 = 0; t0 < tokens; t0 += ROPE_BLOCK) {
        const int64_t count = tokens - t0 < ROPE_BLOCK ? tokens - t0 : ROPE_BLOCK;
        const int64_t coded = complete - t0 <= 0 ? 0 : complete - t0 < count ? complete - t0 : count; /* the rest: the float tail */
        rope_base(rope, t0 / ROPE_BLOCK, step_cos, step_sin, base_cos, base_sin, ca, sa);
        if (bits == FLOAT_BITS) {
            rebuild_keys(rows + t0 * width, width, coded, rank, B, d, key);
        } else if (bits == 8) {
            int8_block(keys, h, t0, coded, rank, width, c);
            rebuild_keys(c, rank, coded, rank, B, d, key);
        } else if (coded) {
            if (bits == 4)
                WITH_WIDTH(width, widen_block(keys, h, 4, t0, coded, W, n, order, &next_group, planes, c));
            else
                WITH_WIDTH(width, widen_block(keys, h, 2, t0, coded, W, n, order, &next_group, planes, c));
            rebuild_keys(c, n, coded, n, plane_basis, d, key);
        }
        if (coded < count) /* the unfinished group's keys, in float */
            rebuild_keys(key_tail + (t0 + coded - complete) * rank, rank, count - coded, rank, B, d, key + coded * d);
        for (int64_t k = 0; k < count; ++k) {
            const float *oc = off_cos + k * m, *os = off_sin + k * m;
            float *u = key + k * d;
#pragma omp simd
            for (int64_t i = 0; i < m; ++i) {
                const float cs = oc[i] * ca[i] - os[i] * sa[i], sn = os[i] * ca[i] + oc[i] * sa[i];
                const float ua = u[i], ub = u[m + i];
                u[i] = ua * cs - ub * sn;
                u[m + i] = ub * cs + ua * sn;
            }
        }
        int64_t k = 0;
#if defined(LANES)
        if (d % (2 * LANES) == 0) /* key_dot's two chains per token, their horizontal sums folded LANES tokens at a time */
            for (; k + LANES <= count; k += LANES)
                for (int64_t i = 0; i < queries; ++i) {
                    const float *qi = q + i * d;
                    vf v[LANES];
                    for (int u = 0; u < LANES; ++u) {
                        const float *x = key + (k + u) * d;
                        vf s0 = vf_zero(), s1 = vf_zero();
                        for (int64_t e = 0; e < d; e += 2 * LANES) {
                            s0 = vf_fmadd(vf_load(qi + e), vf_load(x + e), s0);
                            s1 = vf_fmadd(vf_load(qi + e + LANES), vf_load(x + e + LANES), s1);
                        }
                        v[u] = vf_add(s0, s1);
                    }
                    vf_store(out + i * out_row_stride + t0 + k, vf_permute(fold_block(v), lanes));
                }
#endif
        for (; k < count; ++k)
            for (int64_t i = 0; i < queries; ++i) out[i * out_row_stride + t0 + k] = key_dot(q + i * d, key + k * d, d);
    }
}

#if defined(LANES)
/* float_value_sums' columns [c0, c0 + cols) (cols <= 4 LANES; `whole`, a constant: cols = 4 LANES)
 * of one query head's weights wi into its sums a: each block's sums in registers, no memset
 * block loaded and stored for every token. */
ALWAYS_INLINE void float_value_columns(const float *rows, int64_t tokens, int64_t rank, int64_t c0, int64_t cols, const int whole, const float *wi,
                                       float *a) {
    for (int64_t t = 0; t < tokens; t += VALUE_BLOCK) {
        const int64_t end = t + VALUE_BLOCK < tokens ? t + VALUE_BLOCK : tokens;
        vf s[4] = {vf_zero(), vf_zero(), vf_zero(), vf_zero()};
        for (int64_t u = t; u < end; ++u) {
            const vf wt = vf_set1(wi[u]);
            const float *x = rows + u * rank + c0;
            for (int v = 0; v < 4; ++v) /* the block's sum as the portable loop's: 0 + w x, then + w x (no fma) */
                s[v] = vf_add(s[v], vf_mul(wt, whole ? vf_load(x + LANES * v) : vf_load_upto(x + LANES * v, cols - LANES * v)));
        }
        for (int v = 0; v < 4; ++v)
            if (whole)
                vf_store(a + c0 + LANES * v, vf_add(vf_load(a + c0 + LANES * v), s[v]));
            else if (cols > LANES * v)
                vf_store_first(a + c0 + LANES * v, cols - LANES * v, vf_add(vf_load_first(a + c0 + LANES * v, cols - LANES * v), s[v]));
    }
}
#endif

/* acc[i][k] += w[i][t] x_k(t) over `tokens` float rows of `rank` (FLOAT_BITS values), summed per
 * block of VALUE_BLOCK tokens and then added, as rows_value_sums adds its blocks (`blocks`: scratch
 * of queries rank floats, for the loop without vectors). */
static void float_value_sums(const float *rows, int64_t tokens, int64_t rank, int64_t queries, const float *w, int64_t w_row_stride, float *acc,
                             float *blocks) {
#if defined(LANES)
    (void)blocks;
    for (int64_t i = 0; i < queries; ++i)
        for (int64_t c0 = 0; c0 < rank; c0 += 4 * LANES) {
            if (rank - c0 >= 4 * LANES)
                float_value_columns(rows, tokens, rank, c0, 4 * LANES, 1, w + i * w_row_stride, acc + i * rank);
            else
                float_value_columns(rows, tokens, rank, c0, rank - c0, 0, w + i * w_row_stride, acc + i * rank);
        }
#else
    for (int64_t t = 0; t < tokens; t += VALUE_BLOCK) {
        const int64_t end = t + VALUE_BLOCK < tokens ? t + VALUE_BLOCK : tokens;
        memset(blocks, 0, sizeof(float) * queries * rank);
        for (int64_t u = t; u < end; ++u)
            for (int64_t i = 0; i < queries; ++i) {
                const float wt = w[i * w_row_stride + u], *x = rows + u * rank;
                float *b = blocks + i * rank;
#pragma omp simd
                for (int64_t k = 0; k < rank; ++k) b[k] += wt * x[k];
            }
#pragma omp simd
        for (int64_t k = 0; k < queries * rank; ++k) acc[k] += blocks[k];
    }
#endif
}

/* The exact tokens of a windowed state (spec/window.md W1, W7): the sinks (part 0) and the
 * recent window (part 1), each (heads, count[p], d) keys and (heads, count[p], d_v) values,
 * float32, rows back to back; `scale` is their logit scale (gamma = 1: they are not projected,
 * W3). A part of count 0 is not read. */
struct exact_part {
    const float *keys[2];
    const float *values[2];
    int64_t count[2];
    float scale;
};

/* Logits scale q_i . k_j of head h's exact tokens, sinks then recent, into out[i][0 .. count0 +
 * count1) (`stride` apart per query head); returns nothing, sets start[i] to their maximum
 * (-inf without any). */
static void head_exact_logits(const struct exact_part *exact, int64_t h, int64_t queries, const float *q, int64_t d, float *out,
                         int64_t stride, float *start) {
    for (int64_t i = 0; i < queries; ++i) {
        float m = -INFINITY;
        int64_t j = 0;
        for (int p = 0; p < 2; ++p)
            for (int64_t u = 0; u < exact->count[p]; ++u, ++j) {
                const float l = exact->scale * plane_dot(q + i * d, exact->keys[p] + (h * exact->count[p] + u) * d, d);
                out[i * stride + j] = l;
                m = l > m ? l : m;
            }
        start[i] = m;
    }
}

/* W3's exact terms of one query head: w_j = e^(l_j - m) in place over its `count` exact logits,
 * o += sum_j w_j v_j (in blocks of VALUE_BLOCK tokens, as the value sums), returns sum_j w_j. */
static float head_exact_terms(const struct exact_part *exact, int64_t h, float *l, int64_t count, float m, int64_t d_v, float *block, float *o) {
    for (int64_t j = 0; j < count; ++j) l[j] -= m;
    softmax_exp(count, l, l);
    float Z = 0.0f;
    for (int64_t j = 0; j < count; ++j) Z += l[j];
    for (int p = 0, j = 0; p < 2; j += (int)exact->count[p], ++p)
        if (exact->count[p]) float_value_sums(exact->values[p] + h * exact->count[p] * d_v, exact->count[p], d_v, 1, l + j, 0, o, block);
    return Z;
}

/* Whether `bits` names a side's format: FLOAT_BITS (float32 rows), 8 (int8, A10), 4 or 2 (Q2). */
static int known_bits(int bits) { return bits == FLOAT_BITS || bits == 8 || bits == 4 || bits == 2; }

/* Codes per byte of a side's rows (one float or int8 per entry otherwise). */
static int codes_per_entry(int bits) { return bits == 4 || bits == 2 ? 8 / bits : 1; }

/* Spec A2/A3 for a one-chunk state on a CPU core, each side in its own format (`key_bits`,
 * `value_bits`: FLOAT_BITS for float32 rows, 8 for int8 (A10), 4 or 2 for int4 / int2 (Q2)), for every head
 * h < heads (a (sequence, KV head) pair) and query head i < queries of its group:
 *
 * 1. the projected query q~ = q query_map[h] (query_map = gamma scale B^T, d x r: spec A3 step
 *    2.1 with the logit scale folded in);
 * 2. logits of the keys (int4 / int2: of whole groups; the unfinished group's keys are the float
 *    rows key_tail[h][0 .. tokens - complete), `tail_head_stride` apart per head); with `rope`
 *    (a pre-RoPE state, spec/rope.md P3) instead: query_map[h] is gamma scale B (r x d, the dims
 *    in rope->order), each key is rebuilt and rotated (head_rope_logits) and dotted with q;
 *    with `exact` (a windowed state, spec/window.md W3), the exact tokens' logits scale q . k;
 * 3. m = max over every logit, weights w_t = e^(l_t - m), Z = sum_t w_t (A3.1: one maximum and
 *    one normaliser over the compressed and the exact tokens);
 * 4. s = sum_t w_t v_t over the value coefficients, per tile of `tile` tokens then over tiles;
 * 5. out[h][i] = (s value_map[h] (the value basis E, r_v x d_v) + sum_j w_j v_j over the exact
 *    tokens) / Z.
 *
 * q (heads, queries, d) float32; out (heads, queries, d_v). Returns 0, or -1 when a shape
 * exceeds the fixed buffers or memory runs out. */
static int head_rows_attention(int key_bits, int value_bits, int64_t heads, int64_t queries, int64_t tokens, int64_t tile, const float *q, int64_t d,
                               const float *query_map, const struct coefficient_side *keys, const float *key_tail, int64_t tail_head_stride,
                               const struct rope_keys *rope, const struct coefficient_side *values, const float *value_map, int64_t d_v,
                               const struct exact_part *exact, const int64_t *rows, float *out) {
    if (!known_bits(key_bits) || !known_bits(value_bits)) return -1;
    const int key_per = codes_per_entry(key_bits), per = codes_per_entry(value_bits);
    const int low_bit_keys = key_bits == 4 || key_bits == 2, low_bit = value_bits == 4 || value_bits == 2;
    if (queries > MAX_QUERIES || tile < 1 || keys->width > MAX_BYTES || values->width > MAX_BYTES || keys->width * key_per < keys->rank ||
        values->width * per < values->rank || (low_bit_keys && keys->group < 1) || (rope && (d > MAX_DIM || rope->planes < 1 || 2 * rope->planes > d)))
        return -1;
    const int64_t r = keys->rank, r_v = values->rank, complete = low_bit_keys ? tokens / keys->group * keys->group : tokens;
    const int64_t key_n = key_per * keys->width, value_n = queries * per * values->width;
    const int64_t widest = d > d_v ? d : d_v, exact_count = exact ? exact->count[0] + exact->count[1] : 0;
    float *planes = malloc(sizeof(float) * (queries + 4) * key_n), *logits = malloc(sizeof(float) * (queries * tokens + 1));
    float *part = malloc(sizeof(float) * value_n), *total = malloc(sizeof(float) * value_n), *blocks = malloc(sizeof(float) * value_n);
    float *projected = malloc(sizeof(float) * queries * r), *sums = malloc(sizeof(float) * queries * r_v);
    float *odd = malloc(sizeof(float) * (widest > r ? widest : r));
    float *exact_l = malloc(sizeof(float) * (queries * exact_count + 1)), *exact_block = malloc(sizeof(float) * d_v);
    /* pre-RoPE keys: the queries in rope order; the basis rows in the codes' plane order, 64-byte
     * aligned (its rows are read a vector at a time, and a load across two cache lines costs two) */
    float *permuted = rope ? malloc(sizeof(float) * queries * d) : NULL;
    float *plane_basis = rope ? aligned_alloc(64, (sizeof(float) * key_n * d + 63) / 64 * 64) : NULL;
    float *rope_block = rope ? malloc(sizeof(float) * (ROPE_BLOCK * (key_n + d + ROPE_BLOCK * queries) + queries * d)) : NULL;
    if (!planes || !logits || !part || !total || !blocks || !projected || !sums || !odd || !exact_l || !exact_block ||
        (rope && (!permuted || !plane_basis || !rope_block))) {
        free(planes), free(logits), free(part), free(total), free(blocks), free(projected), free(sums), free(odd);
        free(exact_l), free(exact_block), free(permuted), free(plane_basis), free(rope_block);
        return -1;
    }
    for (int64_t h = 0; h < heads; ++h) {
        float start[MAX_QUERIES];
        const int64_t row = rows ? rows[h] : h * queries; /* the first query row of head h in q and out */
        const float *qh = q + row * d;
        if (exact)
            head_exact_logits(exact, h, queries, qh, d, exact_l, exact_count, start);
        else
            for (int64_t i = 0; i < queries; ++i) start[i] = -INFINITY;
        if (rope) {
            for (int64_t i = 0; i < queries; ++i)
                for (int64_t e = 0; e < d; ++e) permuted[i * d + e] = qh[i * d + rope->order[e]];
            head_rope_logits(key_bits, keys, h, queries, complete, tokens, key_tail ? key_tail + h * tail_head_stride : NULL, permuted,
                             query_map + h * r * d, d, rope, plane_basis, planes, rope_block, logits, tokens);
        } else {
            map_rows(qh, queries, d, query_map + h * d * r, r, odd, projected);
            head_logits(key_bits, keys, h, queries, complete, projected, planes, logits, tokens);
            for (int64_t i = 0; i < queries; ++i)
                for (int64_t t = complete; t < tokens; ++t)
                    logits[i * tokens + t] = plane_dot(projected + i * r, key_tail + h * tail_head_stride + (t - complete) * r, r);
        }

        const float *value_scale = value_bits == 8 ? (const float *)values->scale + h * values->scale_head_stride : NULL; /* int8: folded into w_t */
        float m[MAX_QUERIES], Z[MAX_QUERIES];
        for (int64_t i = 0; i < queries; ++i)
            row_weights(logits + i * tokens, tokens, tile, start[i], value_scale, m + i, Z + i);

        const uint8_t *vc = values->codes + h * values->head_stride;
        const float *vf = (const float *)values->codes + h * values->head_stride; /* FLOAT_BITS: strides count floats */
        const half *ts = low_bit ? (const half *)values->scale + h * values->scale_head_stride : NULL;
        const half *tz = low_bit ? values->zero + h * values->scale_head_stride : NULL;
        memset(total, 0, sizeof(float) * value_n);
        for (int64_t a = 0; a < tokens; a += tile) {
            const int64_t len = tokens - a < tile ? tokens - a : tile;
            memset(part, 0, sizeof(float) * value_n);
            if (value_bits == FLOAT_BITS)
                float_value_sums(vf + a * values->width, len, values->width, queries, logits + a, tokens, part, blocks);
            else if (value_bits == 8)
                WITH_VALUE_WIDTH(values->width, 1, rows_value_sums(vc + a * values->width, len, tokens - a, W, 8, queries, logits + a, tokens, NULL, NULL, part, blocks, V));
            else if (value_bits == 4)
                WITH_VALUE_WIDTH(values->width, 2, rows_value_sums(vc + a * values->width, len, tokens - a, W, 4, queries, logits + a, tokens, ts + a, tz + a, part, blocks, V));
            else
                WITH_VALUE_WIDTH(values->width, 4, rows_value_sums(vc + a * values->width, len, tokens - a, W, 2, queries, logits + a, tokens, ts + a, tz + a, part, blocks, V));
#pragma omp simd
            for (int64_t k = 0; k < value_n; ++k) total[k] += part[k];
        }
        for (int64_t i = 0; i < queries; ++i)
            for (int p = 0; p < per; ++p)
                for (int64_t k = 0; k < values->width; ++k) {
                    const int64_t c = k * per + p;
                    if (c < r_v) sums[i * r_v + c] = total[(i * per + p) * values->width + k];
                }
        float *oh = out + row * d_v;
        map_rows(sums, queries, r_v, value_map + h * r_v * d_v, d_v, odd, oh);
        for (int64_t i = 0; i < queries; ++i) {
            float total_weight = Z[i];
            if (exact_count) total_weight += head_exact_terms(exact, h, exact_l + i * exact_count, exact_count, m[i], d_v, exact_block, oh + i * d_v);
            for (int64_t e = 0; e < d_v; ++e) oh[i * d_v + e] /= total_weight;
        }
    }
    free(planes), free(logits), free(part), free(total), free(blocks), free(projected), free(sums), free(odd);
    free(exact_l), free(exact_block), free(permuted), free(plane_basis), free(rope_block);
    return 0;
}

/* Spec A2/A3 of a one-chunk state, as head_rows_attention with rows = NULL: head h's query heads
 * are rows h queries .. (h + 1) queries - 1 of q (heads * queries, d) and of out (heads * queries, d_v). */
int coefficient_attention(int key_bits, int value_bits, int64_t heads, int64_t queries, int64_t tokens, int64_t tile, const float *q, int64_t d,
                          const float *query_map, const struct coefficient_side *keys, const float *key_tail, int64_t tail_head_stride,
                          const struct rope_keys *rope, const struct coefficient_side *values, const float *value_map, int64_t d_v,
                          const struct exact_part *exact, float *out) {
    return head_rows_attention(key_bits, value_bits, heads, queries, tokens, tile, q, d, query_map, keys, key_tail, tail_head_stride, rope, values,
                               value_map, d_v, exact, NULL, out);
}

/* The arguments of coefficient_attention for one head group of a layer (spec/layer_state.md L5),
 * plus `rows`: head h's (a (sequence, KV head) pair of the group) first query row in the layer's
 * q (sequences * H_q, d) and out (sequences * H_q, d_v), so that each group reads its query heads
 * and writes its outputs where they lie in the layer's query-head order. */
struct group_call {
    int key_bits, value_bits;
    int64_t heads, queries, tokens, tile;
    const float *q;
    int64_t d;
    const float *query_map;
    const struct coefficient_side *keys;
    const float *key_tail;
    int64_t tail_head_stride;
    const struct rope_keys *rope;
    const struct coefficient_side *values;
    const float *value_map;
    int64_t d_v;
    const struct exact_part *exact;
    const int64_t *rows;
    float *out;
};

/* One decode step of a layer whose head groups are each served by coefficient_attention: every
 * group's attention in one call (spec/layer_state.md L5.2), in order. Returns 0, or the first
 * group's non-zero return (its outputs and the later groups' are then not written). */
int layer_attention(int64_t groups, const struct group_call *calls) {
    for (int64_t i = 0; i < groups; ++i) {
        const struct group_call *c = calls + i;
        const int rc = head_rows_attention(c->key_bits, c->value_bits, c->heads, c->queries, c->tokens, c->tile, c->q, c->d, c->query_map, c->keys,
                                           c->key_tail, c->tail_head_stride, c->rope, c->values, c->value_map, c->d_v, c->exact, c->rows, c->out);
        if (rc) return rc;
    }
    return 0;
}

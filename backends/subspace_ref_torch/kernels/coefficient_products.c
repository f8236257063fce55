/* Decode products over quantised coefficients on the CPU, dequantised in registers
 * (spec A10 for int8, spec/quantization.md Q1-Q2 for int4/int2; the decode path spec R14).
 *
 * Why a kernel of our own: torch has no CPU operation that contracts a float vector with integer
 * codes. Dequantising a tile to float first writes it and reads it back (for int4, three more
 * passes to unpack the nibbles), which made int8 coefficients slower than float32 ones and int4
 * slower still, although they move 4x and 8x fewer bytes. Here every code is read once, widened
 * in registers and multiplied at once.
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Scales and zero points of int4 / int2 layouts are float16 (Q1), read here as stored: the bits,
 * widened by the F16C instruction where there is one (a scalar _Float16 conversion is a library
 * call in GCC 12, slower than the whole dot product it feeds). */
typedef uint16_t half;
#if defined(__F16C__)
#include <immintrin.h>
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

#define ALWAYS_INLINE static inline __attribute__((always_inline))

/* The bytes of the rows PREFETCH_ROWS ahead are requested while a block is computed: a decode
 * step finds its coefficients out of cache (the layers before it evicted them), and the
 * hardware prefetcher alone left a cold int4 pass ~25% slower than a warm one. */
#define PREFETCH_ROWS 128
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
    for (int64_t k = 0; k < width; ++k) out[k] = (float)(((int32_t)row[k] >> shift) & mask);
}

/* operand (rank) -> planes[p][k] = operand[k PER + p], zero past the rank. */
ALWAYS_INLINE void deinterleave(const float *x, int64_t rank, int64_t width, int bits, float *planes) {
    const int per = 8 / bits;
#if defined(__AVX512F__)
    /* int4 / int2 keys do this twice per group of G tokens (scales, zeros): a gather per 16
     * lanes instead of a scalar loop where rows fill whole planes of 4, 8 or 16k bytes */
    if (bits < 8 && rank == per * width && rank % 16 == 0 && (width % 16 == 0 || width == 4 || width == 8)) {
        const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        for (int64_t c = 0; c < rank; c += 16) {
            const __m512i i = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)c));
            __m512i p, k;
            if (width % 16 == 0) {
                p = _mm512_set1_epi32((int)(c / width));
                k = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)(c % width)));
            } else {
                p = _mm512_srli_epi32(i, width == 4 ? 2 : 3);
                k = _mm512_and_si512(i, _mm512_set1_epi32((int)width - 1));
            }
            const __m512i source = _mm512_add_epi32(_mm512_mullo_epi32(k, _mm512_set1_epi32(per)), p);
            _mm512_storeu_ps(planes + c, _mm512_i32gather_ps(source, x, 4));
        }
        return;
    }
#endif
    for (int p = 0; p < per; ++p)
        for (int64_t k = 0; k < width; ++k) {
            const int64_t c = k * per + p;
            planes[p * width + k] = c < rank ? x[c] : 0.0f;
        }
}

/* As deinterleave, for a float16 operand (a group's scales or zeros: once per group of tokens,
 * so the widening is vectorised where it can be). */
ALWAYS_INLINE void deinterleave_half(const half *x, int64_t rank, int64_t width, int bits, float *planes) {
    float wide[8 * MAX_BYTES];
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= rank; c += 16) _mm512_storeu_ps(wide + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + c))));
#endif
    for (; c < rank; ++c) wide[c] = widen_half(x[c]);
    deinterleave(wide, rank, width, bits, planes);
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
 * than the oracle's float32 error on long streams. */
ALWAYS_INLINE void widen_row(const uint8_t *row, int64_t width, int bits, const float *scale_planes, const float *zero_planes,
                             float *out) {
    const int per = 8 / bits;
#if defined(__AVX512BW__)
    if (bits < 8 && (width == 4 || width == 8)) {
        /* Rows of 4 or 8 bytes (int2 at r = 16 / 32, int4 at r = 16): a plane is 4 or 8 floats, and
         * storing planes one by one, then reading 16 floats back, stalls store forwarding (the
         * compiler's version spent most of its time there). So each 16-lane vector takes
         * 16 / width planes at once: lane l holds column k = l mod width of plane p = l / width,
         * its byte placed by a permute and its plane's bits by a per-lane shift. */
        const int log_width = width == 4 ? 2 : 3;
        const __m512i wide = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8((__mmask16)((1u << width) - 1u), row));
        const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
        const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        for (int64_t c = 0; c < per * width; c += 16) {
            const __m512i i = _mm512_add_epi32(lanes, _mm512_set1_epi32((int)c));
            const __m512i bytes = _mm512_permutexvar_epi32(_mm512_and_si512(i, _mm512_set1_epi32((int)width - 1)), wide);
            const __m512i shift = _mm512_mullo_epi32(_mm512_srli_epi32(i, log_width), _mm512_set1_epi32(bits));
            _mm512_storeu_ps(out + c, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(bytes, shift), mask)));
        }
    } else
#endif
        for (int p = 0; p < per; ++p) widen_plane(row, width, bits, p, out + p * width);
    if (bits == 8 || !scale_planes) return; /* int8, or per-token scales applied by the caller */
    const int64_t n = per * width;
#pragma omp simd
    for (int64_t k = 0; k < n; ++k) out[k] = __builtin_fmaf(out[k], scale_planes[k], zero_planes[k]);
}

/* logits[i][t] = query_planes[i] . widened row t (times row_scale[t] when given). */
#if defined(__AVX512F__)
#include <immintrin.h>
#define BLOCK 16
/* The 16 sums of v[0..15] (one 16-lane vector of partial sums per token) as one vector, lane
 * order given by block_lanes: a dot product's horizontal sum costs ~8 shuffles and adds, and
 * a token's whole dot product ~6 instructions at r = 32, so summing tokens one by one is most
 * of the work; folded in four halving steps, 16 tokens share 15 shuffle pairs. */
ALWAYS_INLINE __m512 fold16(__m512 *v) {
    for (int t = 0; t < 8; ++t) /* 256-bit halves: tokens t, t + 8 share a vector */
        v[t] = _mm512_add_ps(_mm512_shuffle_f32x4(v[t], v[t + 8], 0x44), _mm512_shuffle_f32x4(v[t], v[t + 8], 0xEE));
    for (int t = 0; t < 4; ++t) /* 128-bit quarters */
        v[t] = _mm512_add_ps(_mm512_shuffle_f32x4(v[t], v[t + 4], 0x88), _mm512_shuffle_f32x4(v[t], v[t + 4], 0xDD));
    for (int t = 0; t < 2; ++t) /* pairs within quarters */
        v[t] = _mm512_add_ps(_mm512_shuffle_ps(v[t], v[t + 2], 0x44), _mm512_shuffle_ps(v[t], v[t + 2], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(v[0], v[1], 0x88), _mm512_shuffle_ps(v[0], v[1], 0xDD));
}

/* The permutation that puts token t of fold16's result in lane t, found once by folding markers
 * (the order is fixed by the shuffles above; deriving it keeps the two in step). */
static int32_t block_lanes[16];
__attribute__((constructor)) static void find_block_order(void) {
    __m512 v[16];
    for (int t = 0; t < 16; ++t) v[t] = _mm512_set1_ps((float)t / 16.0f); /* lanes sum to t */
    float lanes[16];
    _mm512_storeu_ps(lanes, fold16(v));
    for (int lane = 0; lane < 16; ++lane) block_lanes[(int)(lanes[lane] + 0.5f)] = lane;
}

/* Whether rows of `width` bytes split into whole 16-lane chunks of the widened row (in plane
 * order), which chunk_codes builds in registers: int8 rows of a multiple of 16 bytes; int4 / int2
 * rows of a multiple of 16 bytes (a chunk within one plane) or of 4 or 8 bytes (a chunk spans
 * 16 / width planes); at most 4 chunks (n <= 64: the query, scale and zero chunks stay in
 * registers). */
ALWAYS_INLINE int register_chunks(int64_t width, int bits) {
    const int64_t n = (8 / bits) * width;
    return n % 16 == 0 && n <= 64 && (width % 16 == 0 || (bits < 8 && (width == 4 || width == 8)));
}

/* Chunk c (lanes 16c .. 16c + 15 of the widened row, plane order) of byte row `row`, as floats:
 * the codes, not yet scaled. Rows of 4 or 8 bytes: lane l holds column k = l mod width of plane
 * p = l / width, its byte placed by a permute and its plane's bits by a per-lane shift. */
ALWAYS_INLINE __m512 chunk_codes(const uint8_t *row, int64_t width, int bits, int64_t c) {
    if (bits == 8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * c))));
    const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
    if (width % 16 == 0) {
        const int64_t p = 16 * c / width, k0 = 16 * c % width;
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + k0)));
        return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(bytes, _mm512_set1_epi32((int)(p * bits))), mask));
    }
    const int log_width = width == 4 ? 2 : 3;
    const __m512i wide = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8((__mmask16)((1u << width) - 1u), row));
    const __m512i i = _mm512_add_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32((int)(16 * c)));
    const __m512i bytes = _mm512_permutexvar_epi32(_mm512_and_si512(i, _mm512_set1_epi32((int)width - 1)), wide);
    const __m512i shift = _mm512_mullo_epi32(_mm512_srli_epi32(i, log_width), _mm512_set1_epi32(bits));
    return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(bytes, shift), mask));
}
#endif

/* logits[i][t] = query_planes[i] . widened row t (times row_scale[t] when given). */
ALWAYS_INLINE void rows_logits(const uint8_t *codes, int64_t tokens, int64_t width, int bits, int64_t queries,
                               const float *query_planes, const float *scale_planes, const float *zero_planes,
                               const float *row_scale, float *out, int64_t out_row_stride) {
    const int64_t n = (8 / bits) * width;
    int64_t t = 0;
#if defined(__AVX512BW__)
    /* each row dequantised and dotted in registers, chunk by chunk: no widened copy stored and
     * read back, one fma per element for the reading and one for the dot */
    if (register_chunks(width, bits) && queries <= REGISTER_QUERIES) {
        const int64_t chunks = n / 16;
        const __m512i order = _mm512_loadu_si512(block_lanes);
        __m512 S[4], Z[4];
        for (int64_t c = 0; c < chunks; ++c)
            if (scale_planes) {
                S[c] = _mm512_loadu_ps(scale_planes + 16 * c);
                Z[c] = _mm512_loadu_ps(zero_planes + 16 * c);
            }
        __m512 v[REGISTER_QUERIES][BLOCK];
        for (; t + BLOCK <= tokens; t += BLOCK) {
            prefetch_rows(codes, t + PREFETCH_ROWS, BLOCK, tokens, width);
            for (int b = 0; b < BLOCK; ++b) {
                const uint8_t *row = codes + (t + b) * width;
                __m512 x[4];
                for (int64_t c = 0; c < chunks; ++c) {
                    x[c] = chunk_codes(row, width, bits, c);
                    if (scale_planes) x[c] = _mm512_fmadd_ps(x[c], S[c], Z[c]);
                }
                for (int64_t i = 0; i < queries; ++i) { /* the row serves every query head of the group */
                    const float *qi = query_planes + i * n;
                    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qi), x[0]);
                    for (int64_t c = 1; c < chunks; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qi + 16 * c), x[c], acc);
                    v[i][b] = acc;
                }
            }
            for (int64_t i = 0; i < queries; ++i) {
                __m512 dots = _mm512_permutexvar_ps(order, fold16(v[i]));
                if (row_scale) dots = _mm512_mul_ps(dots, _mm512_loadu_ps(row_scale + t));
                _mm512_storeu_ps(out + i * out_row_stride + t, dots);
            }
        }
    }
#endif
#if defined(__AVX512F__)
    if (n % 16 == 0 && n <= 8 * MAX_BYTES / BLOCK) {
        const __m512i order = _mm512_loadu_si512(block_lanes);
        float block[BLOCK * 8 * MAX_BYTES / BLOCK];
        for (; t + BLOCK <= tokens; t += BLOCK) {
            prefetch_rows(codes, t + PREFETCH_ROWS, BLOCK, tokens, width);
            for (int b = 0; b < BLOCK; ++b) widen_row(codes + (t + b) * width, width, bits, scale_planes, zero_planes, block + b * n);
            for (int64_t i = 0; i < queries; ++i) {
                const float *qi = query_planes + i * n;
                __m512 v[BLOCK];
                for (int b = 0; b < BLOCK; ++b) {
                    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qi), _mm512_loadu_ps(block + b * n));
                    for (int64_t k = 16; k < n; k += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qi + k), _mm512_loadu_ps(block + b * n + k), acc);
                    v[b] = acc;
                }
                __m512 dots = _mm512_permutexvar_ps(order, fold16(v));
                if (row_scale) dots = _mm512_mul_ps(dots, _mm512_loadu_ps(row_scale + t));
                _mm512_storeu_ps(out + i * out_row_stride + t, dots);
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

/* Spec A10: logits[h][i][t] = scale[h][t] (q[h][i] . c[h][t]) over int8 codes, per-token scales.
 * q (heads, queries, rank) contiguous; codes rows of `rank` bytes. Returns 0, or -1 if the shape
 * exceeds the kernel's fixed buffers. */
int int8_logits(int64_t heads, int64_t queries, int64_t rank, int64_t tokens, const float *q,
                const int8_t *codes, int64_t codes_head_stride, const float *scale, int64_t scale_head_stride,
                float *out, int64_t out_head_stride, int64_t out_row_stride) {
    if (rank > MAX_BYTES || queries > MAX_QUERIES) return -1;
    for (int64_t h = 0; h < heads; ++h)
        WITH_WIDTH(rank, rows_logits((const uint8_t *)(codes + h * codes_head_stride), tokens, W, 8, queries, q + h * queries * rank,
                                     NULL, NULL, scale + h * scale_head_stride, out + h * out_head_stride, out_row_stride));
    return 0;
}

/* Spec Q2, keys of complete groups: codes per channel over groups of G tokens, (s, z) per group
 * and channel, float16 (heads, >= groups, rank); logits of tokens [0, groups G). The query is
 * de-interleaved once per head, the group's scales and zeros once per group. */
int low_bit_logits(int bits, int64_t heads, int64_t queries, int64_t rank, int64_t groups, int64_t G, const float *q,
                   const uint8_t *codes, int64_t codes_head_stride, int64_t width, const half *scale, const half *zero,
                   int64_t scale_head_stride, float *out, int64_t out_head_stride, int64_t out_row_stride) {
    if ((bits != 4 && bits != 2) || width > MAX_BYTES || queries > MAX_QUERIES || width * (8 / bits) < rank) return -1;
    const int64_t n = (8 / bits) * width;
    float *planes = malloc(sizeof(float) * (queries + 2) * n);
    if (!planes) return -1;
    float *scale_planes = planes + queries * n, *zero_planes = scale_planes + n;
    for (int64_t h = 0; h < heads; ++h) {
        for (int64_t i = 0; i < queries; ++i) deinterleave(q + (h * queries + i) * rank, rank, width, bits, planes + i * n);
        for (int64_t g = 0; g < groups; ++g) {
            deinterleave_half(scale + h * scale_head_stride + g * rank, rank, width, bits, scale_planes);
            deinterleave_half(zero + h * scale_head_stride + g * rank, rank, width, bits, zero_planes);
            const uint8_t *rows = codes + h * codes_head_stride + g * G * width;
            float *o = out + h * out_head_stride + g * G;
            if (bits == 4)
                WITH_WIDTH(width, rows_logits(rows, G, W, 4, queries, planes, scale_planes, zero_planes, NULL, o, out_row_stride));
            else
                WITH_WIDTH(width, rows_logits(rows, G, W, 2, queries, planes, scale_planes, zero_planes, NULL, o, out_row_stride));
        }
    }
    free(planes);
    return 0;
}

/* acc[i][p width + k] += w[i][t] x_{k PER + p}(t) over the rows of one tile, x the widened row;
 * int4 / int2 rows take their token's scale and zero (token_scale[t], token_zero[t]). */
ALWAYS_INLINE void rows_value_sums(const uint8_t *codes, int64_t tokens, int64_t width, int bits, int64_t queries,
                                   const float *w, int64_t w_row_stride, const half *token_scale, const half *token_zero,
                                   float *acc, float *blocks) {
    const int64_t n = (8 / bits) * width;
    int64_t t = 0;
#if defined(__AVX512F__)
    /* blocks of 16 rows widened once, then each query's sums kept in registers over the block
     * (up to 8 vectors: n <= 128) instead of loaded and stored for every token */
    if (n % 16 == 0 && n <= 128) {
        float block[BLOCK * 128];
        for (; t + BLOCK <= tokens; t += BLOCK) {
            float scales[BLOCK], zeros[BLOCK];
            if (bits != 8) {
                _mm512_storeu_ps(scales, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(token_scale + t))));
                _mm512_storeu_ps(zeros, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(token_zero + t))));
            }
            prefetch_rows(codes, t + PREFETCH_ROWS, BLOCK, tokens, width);
            for (int b = 0; b < BLOCK; ++b) {
                float *row = block + b * n;
                const uint8_t *bytes = codes + (t + b) * width;
#if defined(__AVX512BW__)
                if (register_chunks(width, bits)) { /* widened and dequantised in one pass */
                    for (int64_t c = 0; c < n / 16; ++c) {
                        __m512 x = chunk_codes(bytes, width, bits, c);
                        if (bits != 8) x = _mm512_fmadd_ps(x, _mm512_set1_ps(scales[b]), _mm512_set1_ps(zeros[b]));
                        _mm512_storeu_ps(row + 16 * c, x);
                    }
                    continue;
                }
#endif
                widen_row(bytes, width, bits, NULL, NULL, row);
                if (bits != 8) {
                    const __m512 s = _mm512_set1_ps(scales[b]), z = _mm512_set1_ps(zeros[b]);
                    for (int64_t k = 0; k < n; k += 16) _mm512_storeu_ps(row + k, _mm512_fmadd_ps(_mm512_loadu_ps(row + k), s, z));
                }
            }
            for (int64_t i = 0; i < queries; ++i) {
                float *a = acc + i * n;
                const float *wi = w + i * w_row_stride + t;
                /* the block's own sum, then added to the tile's: summed sequentially over the
                 * tile instead, float32 rounding grows with its 1024 tokens, and on values whose
                 * weighted sum cancels to a few percent of its terms that was 4x the oracle's error */
                __m512 sums[8];
                for (int64_t k = 0; k < n / 16; ++k) sums[k] = _mm512_setzero_ps();
                for (int b = 0; b < BLOCK; ++b) {
                    const __m512 wt = _mm512_set1_ps(wi[b]);
                    for (int64_t k = 0; k < n / 16; ++k) sums[k] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(block + b * n + 16 * k), sums[k]);
                }
                for (int64_t k = 0; k < n / 16; ++k) _mm512_storeu_ps(a + 16 * k, _mm512_add_ps(_mm512_loadu_ps(a + 16 * k), sums[k]));
            }
        }
    }
#endif
    /* the same per-block sums (16 tokens) added to the tile's, on rows of any width */
    float widened[8 * MAX_BYTES];
    for (; t < tokens; t += 16) {
        const int64_t end = t + 16 < tokens ? t + 16 : tokens;
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

/* sums[h][i][c] = sum_t w[h][i][t] x_c(t): int8 codes as they are (spec A10: the caller folds the
 * per-token scales into w), int4 / int2 codes dequantised with token_scale / token_zero (heads,
 * >= tokens) float16, token_head_stride apart (spec Q2: values per token). w (heads, queries,
 * >= tokens) with rows w_row_stride apart; sums (heads, queries, rank). */
int code_value_sums(int bits, int64_t heads, int64_t queries, int64_t rank, int64_t tokens, const float *w,
                    int64_t w_head_stride, int64_t w_row_stride, const uint8_t *codes, int64_t codes_head_stride,
                    int64_t width, const half *token_scale, const half *token_zero, int64_t token_head_stride,
                    int64_t tile, float *sums) {
    if ((bits != 8 && bits != 4 && bits != 2) || width > MAX_BYTES || queries > MAX_QUERIES || width * (8 / bits) < rank || tile < 1 ||
        (bits != 8 && (!token_scale || !token_zero)))
        return -1;
    const int per = 8 / bits;
    const int64_t n = queries * per * width;
    float *part = malloc(sizeof(float) * n);
    float *total = malloc(sizeof(float) * n);
    float *blocks = malloc(sizeof(float) * n);
    if (!part || !total || !blocks) {
        free(part);
        free(total);
        free(blocks);
        return -1;
    }
    for (int64_t h = 0; h < heads; ++h) {
        const uint8_t *ch = codes + h * codes_head_stride;
        const float *wh = w + h * w_head_stride;
        const half *ts = token_scale ? token_scale + h * token_head_stride : NULL;
        const half *tz = token_zero ? token_zero + h * token_head_stride : NULL;
        memset(total, 0, sizeof(float) * n);
        for (int64_t a = 0; a < tokens; a += tile) {
            const int64_t len = tokens - a < tile ? tokens - a : tile;
            memset(part, 0, sizeof(float) * n);
            if (bits == 8)
                WITH_WIDTH(width, rows_value_sums(ch + a * width, len, W, 8, queries, wh + a, w_row_stride, NULL, NULL, part, blocks));
            else if (bits == 4)
                WITH_WIDTH(width, rows_value_sums(ch + a * width, len, W, 4, queries, wh + a, w_row_stride, ts + a, tz + a, part, blocks));
            else
                WITH_WIDTH(width, rows_value_sums(ch + a * width, len, W, 2, queries, wh + a, w_row_stride, ts + a, tz + a, part, blocks));
#pragma omp simd
            for (int64_t k = 0; k < n; ++k) total[k] += part[k];
        }
        for (int64_t i = 0; i < queries; ++i)
            for (int p = 0; p < per; ++p)
                for (int64_t k = 0; k < width; ++k) {
                    const int64_t c = k * per + p;
                    if (c < rank) sums[(h * queries + i) * rank + c] = total[(i * per + p) * width + k];
                }
    }
    free(part);
    free(total);
    free(blocks);
    return 0;
}

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
#include <math.h>
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

/* operand x (rank) -> planes[j] = x[order[j]] (0 where order[j] < 0), for n = PER width
 * positions. int4 / int2 keys do this twice per group of G tokens (scales, zeros): where n <= 64
 * the operand sits in four registers and each 16 positions are two two-source permutes and a
 * blend, instead of a gather (microcoded, ~20% of the logits at G = 32 on this core). */
ALWAYS_INLINE void deinterleave(const float *x, int64_t rank, int64_t n, const int32_t *order, float *planes) {
#if defined(__AVX512F__)
    if (n % 16 == 0 && n <= 64) {
        __m512 src[4];
        for (int s = 0; s < 4; ++s) {
            const int64_t left = rank - 16 * s;
            const __mmask16 m = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
            src[s] = _mm512_maskz_loadu_ps(m, x + 16 * s);
        }
        for (int64_t c = 0; c < n; c += 16) {
            const __m512i idx = _mm512_loadu_si512(order + c);
            const __mmask16 valid = _mm512_cmpge_epi32_mask(idx, _mm512_setzero_si512());
            const __mmask16 high = _mm512_test_epi32_mask(idx, _mm512_set1_epi32(32));
            const __m512 low_part = _mm512_permutex2var_ps(src[0], idx, src[1]);
            const __m512 high_part = _mm512_permutex2var_ps(src[2], idx, src[3]);
            _mm512_storeu_ps(planes + c, _mm512_maskz_mov_ps(valid, _mm512_mask_blend_ps(high, low_part, high_part)));
        }
        return;
    }
#endif
    for (int64_t j = 0; j < n; ++j) planes[j] = order[j] < 0 ? 0.0f : x[order[j]];
}

/* As deinterleave, for a float16 operand (a group's scales or zeros), widened first. */
ALWAYS_INLINE void deinterleave_half(const half *x, int64_t rank, int64_t n, const int32_t *order, float *planes) {
    float wide[8 * MAX_BYTES];
    int64_t c = 0;
#if defined(__AVX512F__)
    for (; c + 16 <= rank; c += 16) _mm512_storeu_ps(wide + c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(x + c))));
#endif
    for (; c < rank; ++c) wide[c] = widen_half(x[c]);
    deinterleave(wide, rank, n, order, planes);
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

/* logits[i][t] = query_planes[i] . widened row t (times row_scale[t] when given), t < tokens.
 * `readable` rows of codes exist (>= tokens: the caller goes on with the rows after these, as it
 * does group after group), the bound of the prefetches. */
ALWAYS_INLINE void rows_logits(const uint8_t *codes, int64_t tokens, int64_t readable, int64_t width, int bits, int64_t queries,
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
            prefetch_rows(codes, t + PREFETCH_ROWS, BLOCK, readable, width);
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
            prefetch_rows(codes, t + PREFETCH_ROWS, BLOCK, readable, width);
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

/* acc[i][p width + k] += w[i][t] x_{k PER + p}(t) over the rows of one tile, x the widened row;
 * int4 / int2 rows take their token's scale and zero (token_scale[t], token_zero[t]). Prefetches
 * reach into the `readable` rows, as rows_logits. */
ALWAYS_INLINE void rows_value_sums(const uint8_t *codes, int64_t tokens, int64_t readable, int64_t width, int bits, int64_t queries,
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
            prefetch_rows(codes, t + PREFETCH_ROWS, BLOCK, readable, width);
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
                /* `sets` interleaved partial sums (token b feeds set b mod sets): with one chain per
                 * register the fma latency, not the throughput, bound narrow rows (n = 32: two
                 * chains of 16 dependent fmas per block) */
                enum { MAX_SETS = 4 };
                const int sets = n <= 32 ? 4 : n <= 64 ? 2 : 1;
                __m512 sums[MAX_SETS][8];
                for (int j = 0; j < sets; ++j)
                    for (int64_t k = 0; k < n / 16; ++k) sums[j][k] = _mm512_setzero_ps();
                for (int b = 0; b < BLOCK; b += sets)
                    for (int j = 0; j < sets; ++j) {
                        const __m512 wt = _mm512_set1_ps(wi[b + j]);
                        for (int64_t k = 0; k < n / 16; ++k) sums[j][k] = _mm512_fmadd_ps(wt, _mm512_loadu_ps(block + (b + j) * n + 16 * k), sums[j][k]);
                    }
                for (int64_t k = 0; k < n / 16; ++k) {
                    __m512 total = sums[0][k];
                    for (int j = 1; j < sets; ++j) total = _mm512_add_ps(total, sums[j][k]);
                    _mm512_storeu_ps(a + 16 * k, _mm512_add_ps(_mm512_loadu_ps(a + 16 * k), total));
                }
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


/* e^x for x <= 0 (softmax exponents, logit minus the maximum), 16 at a time: Cody-Waite reduction
 * x = n ln2 + r, |r| <= ln2 / 2, with ln2 split so n ln2 is exact, the Cephes polynomial for e^r
 * (relative error below 2^-23 on that interval) and 2^n applied by scalef, which gives 0 below
 * float32's range. Below -104 every result is 0 (e^-104 < half the least subnormal); NaN stays
 * NaN (max returns its second operand when either is NaN). */
#if defined(__AVX512F__)
ALWAYS_INLINE __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}
#endif

/* For tests of the exponential the softmax uses: out[i] = e^x[i]. */
void softmax_exp(int64_t count, const float *x, float *out) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i < count; i += 16) {
        const __mmask16 m = count - i >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count - i)) - 1u);
        _mm512_mask_storeu_ps(out + i, m, exp16(_mm512_maskz_loadu_ps(m, x + i)));
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

/* Logits of one head's first `tokens` keys (int4 / int2: whole groups) into out (queries rows,
 * `out_row_stride` apart) for projected queries q (queries, rank). planes: (queries + 2) n floats. */
static void head_logits(int bits, const struct coefficient_side *keys, int64_t h, int64_t queries, int64_t tokens, const float *q,
                        float *planes, float *out, int64_t out_row_stride) {
    const uint8_t *codes = keys->codes + h * keys->head_stride;
    if (bits == 8) {
        const float *scale = (const float *)keys->scale + h * keys->scale_head_stride;
        WITH_WIDTH(keys->rank, rows_logits(codes, tokens, tokens, W, 8, queries, q, NULL, NULL, scale, out, out_row_stride));
        return;
    }
    const int64_t width = keys->width, n = (8 / bits) * width, rank = keys->rank, G = keys->group;
    float *scale_planes = planes + queries * n, *zero_planes = scale_planes + n;
    int32_t order[8 * MAX_BYTES];
    plane_order(rank, width, bits, order);
    for (int64_t i = 0; i < queries; ++i) deinterleave(q + i * rank, rank, n, order, planes + i * n);
    const half *scale = (const half *)keys->scale + h * keys->scale_head_stride, *zero = keys->zero + h * keys->scale_head_stride;
    for (int64_t g = 0; g < tokens / G; ++g) {
        if (g + PREFETCH_GROUPS < tokens / G) { /* one group's scales or zeros: 2 r bytes */
            for (int64_t off = 0; off < 2 * rank; off += 64) {
                __builtin_prefetch((const char *)(scale + (g + PREFETCH_GROUPS) * rank) + off, 0, 0);
                __builtin_prefetch((const char *)(zero + (g + PREFETCH_GROUPS) * rank) + off, 0, 0);
            }
        }
        deinterleave_half(scale + g * rank, rank, n, order, scale_planes);
        deinterleave_half(zero + g * rank, rank, n, order, zero_planes);
        const uint8_t *rows = codes + g * G * width;
        if (bits == 4)
            WITH_WIDTH(width, rows_logits(rows, G, tokens - g * G, W, 4, queries, planes, scale_planes, zero_planes, NULL, out + g * G, out_row_stride));
        else
            WITH_WIDTH(width, rows_logits(rows, G, tokens - g * G, W, 2, queries, planes, scale_planes, zero_planes, NULL, out + g * G, out_row_stride));
    }
}

/* Spec A3 with the global maximum (A3.1) over one query head's `tokens` logits, in place:
 * m = max(initial, max_t l_t), l_t <- e^(l_t - m) times value_scale[t] when given (int8 values:
 * spec A10 folds the per-token scale into the weight), returns m and Z = sum_t e^(l_t - m), the
 * latter summed per lane over each tile of `tile` tokens, then over lanes and tiles (the value
 * sums' order). */
static void row_weights(float *l, int64_t tokens, int64_t tile, float initial, const float *value_scale, float *max_out, float *total_out) {
    float m = initial, Z = 0.0f;
    int64_t t = 0;
#if defined(__AVX512F__)
    __m512 mv = _mm512_set1_ps(initial);
    for (; t + 16 <= tokens; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(l + t));
    m = _mm512_reduce_max_ps(mv);
#endif
    for (; t < tokens; ++t) m = l[t] > m ? l[t] : m;
    for (int64_t a = 0; a < tokens; a += tile) {
        const int64_t end = a + tile < tokens ? a + tile : tokens;
        float part = 0.0f;
#if defined(__AVX512F__)
        const __m512 mv16 = _mm512_set1_ps(m);
        __m512 sum = _mm512_setzero_ps();
        for (int64_t u = a; u < end; u += 16) {
            const __mmask16 k = end - u >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (end - u)) - 1u);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, l + u), mv16));
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(k, e));
            _mm512_mask_storeu_ps(l + u, k, value_scale ? _mm512_mul_ps(e, _mm512_maskz_loadu_ps(k, value_scale + u)) : e);
        }
        part = _mm512_reduce_add_ps(sum);
#else
        /* the vector path's order: 16 lanes, token u in lane (u - a) mod 16, then halving steps;
         * one sequential sum over a tile's 1024 weights was up to 1.8x the derived tolerance */
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
#if defined(__AVX512BW__) && defined(__AVX512VL__)
    /* lane l: byte l / PER of the 16 columns' bytes, bits (l mod PER) b of it */
    const __m128i spread = bits == 4 ? _mm_set_epi8(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0) : _mm_set_epi8(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i shifts = bits == 4 ? _mm512_set_epi32(4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0) : _mm512_set_epi32(6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0, 6, 4, 2, 0);
    const __m512i codes_mask = _mm512_set1_epi32(mask);
    for (; c < rank; c += 16) {
        const int64_t left = rank - c, bytes = width - c / per < 16 ? width - c / per : 16;
        const __mmask16 lanes = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1u);
        const __m128i packed = _mm_maskz_loadu_epi8((__mmask16)((1u << bytes) - 1u), row + c / per);
        const __m512i wide = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(packed, spread));
        const __m512 x = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(wide, shifts), codes_mask));
        const __m512 sv = scale ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, scale + c)) : _mm512_set1_ps(s);
        const __m512 zv = scale ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes, zero + c)) : _mm512_set1_ps(z);
        _mm512_mask_storeu_ps(out + c, lanes, _mm512_fmadd_ps(x, sv, zv));
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

/* Spec A2/A3 for a one-chunk int8 (A10) or int4 / int2 (Q2) state on a CPU core, for every head
 * h < heads (a (sequence, KV head) pair) and query head i < queries of its group:
 *
 * 1. the projected query q~ = q query_map[h] (query_map = gamma scale B^T, d x r: spec A3 step
 *    2.1 with the logit scale folded in);
 * 2. logits of the keys (int4 / int2: of whole groups; the unfinished group's keys are the float
 *    rows key_tail[h][0 .. tokens - complete), `tail_head_stride` apart per head);
 * 3. m = max(initial_max[h][i] (the exact tokens' maximum; NULL: -inf), max_t l_t), weights
 *    w_t = e^(l_t - m), Z = sum_t w_t (A3.1: the global maximum);
 * 4. s = sum_t w_t v_t over the value coefficients, per tile of `tile` tokens then over tiles;
 * 5. out[h][i] = s value_map[h] (the value basis E, r_v x d_v), divided by Z when `normalize`
 *    (else the caller adds the exact tokens' terms and divides: spec/window.md W3).
 *
 * q (heads, queries, d) float32; out (heads, queries, d_v); max_out and total_out (heads,
 * queries) or NULL. Returns 0, or -1 when a shape exceeds the fixed buffers or memory runs out. */
int coefficient_attention(int bits, int64_t heads, int64_t queries, int64_t tokens, int64_t tile, const float *q, int64_t d,
                          const float *query_map, const struct coefficient_side *keys, const float *key_tail, int64_t tail_head_stride,
                          const struct coefficient_side *values, const float *value_map, int64_t d_v, const float *initial_max,
                          int normalize, float *out, float *max_out, float *total_out) {
    if ((bits != 8 && bits != 4 && bits != 2) || queries > MAX_QUERIES || tile < 1 || keys->width > MAX_BYTES || values->width > MAX_BYTES ||
        keys->width * (8 / bits) < keys->rank || values->width * (8 / bits) < values->rank || (bits != 8 && keys->group < 1))
        return -1;
    const int per = 8 / bits;
    const int64_t r = keys->rank, r_v = values->rank, complete = bits == 8 ? tokens : tokens / keys->group * keys->group;
    const int64_t key_n = per * keys->width, value_n = queries * per * values->width;
    const int64_t widest = d > d_v ? d : d_v;
    float *planes = malloc(sizeof(float) * (queries + 2) * key_n), *logits = malloc(sizeof(float) * (queries * tokens + 1));
    float *part = malloc(sizeof(float) * value_n), *total = malloc(sizeof(float) * value_n), *blocks = malloc(sizeof(float) * value_n);
    float *projected = malloc(sizeof(float) * queries * r), *sums = malloc(sizeof(float) * queries * r_v);
    float *odd = malloc(sizeof(float) * (widest > r ? widest : r));
    if (!planes || !logits || !part || !total || !blocks || !projected || !sums || !odd) {
        free(planes), free(logits), free(part), free(total), free(blocks), free(projected), free(sums), free(odd);
        return -1;
    }
    for (int64_t h = 0; h < heads; ++h) {
        map_rows(q + h * queries * d, queries, d, query_map + h * d * r, r, odd, projected);
        head_logits(bits, keys, h, queries, complete, projected, planes, logits, tokens);
        for (int64_t i = 0; i < queries; ++i)
            for (int64_t t = complete; t < tokens; ++t)
                logits[i * tokens + t] = plane_dot(projected + i * r, key_tail + h * tail_head_stride + (t - complete) * r, r);

        const float *value_scale = bits == 8 ? (const float *)values->scale + h * values->scale_head_stride : NULL;
        float m[MAX_QUERIES], Z[MAX_QUERIES];
        for (int64_t i = 0; i < queries; ++i)
            row_weights(logits + i * tokens, tokens, tile, initial_max ? initial_max[h * queries + i] : -INFINITY, value_scale, m + i, Z + i);

        const uint8_t *vc = values->codes + h * values->head_stride;
        const half *ts = bits == 8 ? NULL : (const half *)values->scale + h * values->scale_head_stride;
        const half *tz = bits == 8 ? NULL : values->zero + h * values->scale_head_stride;
        memset(total, 0, sizeof(float) * value_n);
        for (int64_t a = 0; a < tokens; a += tile) {
            const int64_t len = tokens - a < tile ? tokens - a : tile;
            memset(part, 0, sizeof(float) * value_n);
            if (bits == 8)
                WITH_WIDTH(values->width, rows_value_sums(vc + a * values->width, len, tokens - a, W, 8, queries, logits + a, tokens, NULL, NULL, part, blocks));
            else if (bits == 4)
                WITH_WIDTH(values->width, rows_value_sums(vc + a * values->width, len, tokens - a, W, 4, queries, logits + a, tokens, ts + a, tz + a, part, blocks));
            else
                WITH_WIDTH(values->width, rows_value_sums(vc + a * values->width, len, tokens - a, W, 2, queries, logits + a, tokens, ts + a, tz + a, part, blocks));
#pragma omp simd
            for (int64_t k = 0; k < value_n; ++k) total[k] += part[k];
        }
        for (int64_t i = 0; i < queries; ++i)
            for (int p = 0; p < per; ++p)
                for (int64_t k = 0; k < values->width; ++k) {
                    const int64_t c = k * per + p;
                    if (c < r_v) sums[i * r_v + c] = total[(i * per + p) * values->width + k];
                }
        float *oh = out + h * queries * d_v;
        map_rows(sums, queries, r_v, value_map + h * r_v * d_v, d_v, odd, oh);
        for (int64_t i = 0; i < queries; ++i) {
            if (normalize)
                for (int64_t e = 0; e < d_v; ++e) oh[i * d_v + e] /= Z[i];
            if (max_out) max_out[h * queries + i] = m[i];
            if (total_out) total_out[h * queries + i] = Z[i];
        }
    }
    free(planes), free(logits), free(part), free(total), free(blocks), free(projected), free(sums), free(odd);
    return 0;
}

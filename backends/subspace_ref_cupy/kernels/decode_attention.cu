// Decode attention over the chunked coefficient cache (spec A2, A3, A3.2; packed layout spec A9).
//
// Flash-decoding in two launches:
//   1. decode_split_partial: grid (S splits, H KV heads, N sequences). One block owns the g query
//      heads of one GQA group, so every coefficient it reads from global memory serves all g of
//      them. It walks the tokens of its split chunk by chunk and writes the split's partial
//      (m, Z, N) of spec A3.2 in float32.
//   2. merge_splits: one block per (sequence, query head) merges the S partials (spec A3.2) and
//      writes N / Z in the query's dtype.
//
// Coefficient tiles stream through shared memory: while the block computes on one tile, the next
// one is in flight (cp.async, double-buffered; see DecodeTiles for where a single buffer remains).
//
// The projected query q~_j = gamma * scale * B_j q is computed in-kernel, once per chunk and split,
// rather than passed in: it costs r*d MACs per query head and chunk, far less than the chunk's
// tokens, and avoids an (N, H_q, J, r) temporary whose size grows with the number of chunks.
#include "common.cuh"
#include "int8_coef.cuh"

namespace subspace {

constexpr int kDecodeThreads = 128;
constexpr int kDecodeWarps = kDecodeThreads / kWarpSize;
// Blocks per SM the register allocation is held to (__launch_bounds__' second argument): <= 128
// registers per thread. Without it ptxas kept 56-72 registers and spilled 12-44 bytes in most
// instantiations (subspace-kv gpu-report); with it none spills, and 4 blocks of 4 warps fit an
// SM of sm_80 and sm_90 (shared memory allowing: see DecodeTiles).
constexpr int kDecodeMinBlocks = 4;
// Tokens per tile: two per lane in the per-head softmax update (half the barriers per token of a
// one-warp-wide tile) when the tiles fit kStageBudgetBytes, else one per lane.
constexpr int kTokenTile = 2 * kWarpSize;
constexpr int kTokenTileSmall = kWarpSize;
// Shared memory the coefficient tiles (keys and values, every stage) may take. 24 KiB leaves
// room for the block's other ~6-8 KB (query, q~, weights, accumulators at GQA group 4, d = 128)
// under 40 KB, the most a block may use for 4 blocks per SM on A100 (164 KB per SM, 1 KB of it
// reserved per block); H100 (228 KB) fits 5 such blocks.
constexpr int kStageBudgetBytes = 24 * 1024;
// Padding after each tile row: a float or int8 side's rows are whole 16-byte vectors (RT * sizeof
// of its type is a multiple of 32 bytes), so one more vector makes the row stride an odd number of them and the 8 threads
// of a quarter warp, reading one vector each from 8 consecutive rows, hit 8 distinct bank groups.
constexpr int kRowPadBytes = 16;

// Shared-memory geometry of a decode kernel's coefficient tiles: kStages stages, each a key tile
// and a value tile of TT rows. The two sides may store their coefficients in different formats
// (KeyT, ValT: spec/quantization.md Q0, "int4/int8"), so each tile has its own row size. Tiles
// hold the coefficients as stored (no dequantisation on the copy, so the copy can be
// asynchronous); a row is RT * bits / 8 + kRowPadBytes bytes of its side's format, the bytes past
// a row's rank coefficients are never copied. Two stages (the next tile in flight while the block
// computes on the current one) when they fit kStageBudgetBytes, else one (the copy of the next tile
// then waits for the compute on the current one).
template <int RT, typename KeyT, typename ValT, int TT>
struct TileGeometry {
    using KeyReader = CoefReader<KeyT>;
    using ValReader = CoefReader<ValT>;
    static constexpr int kRankTile = RT;
    static constexpr int kKeyRowBytes = RT * KeyReader::kBits / 8 + kRowPadBytes;
    static constexpr int kValRowBytes = RT * ValReader::kBits / 8 + kRowPadBytes;
    static constexpr int kTokens = TT;
    static constexpr int kKeyTileBytes = kTokens * kKeyRowBytes;
    static constexpr int kValTileBytes = kTokens * kValRowBytes;
    static constexpr int kStageBytes = kKeyTileBytes + kValTileBytes;  // a multiple of 16: rows are multiples of 8, TT even
    static constexpr int kStages = 2 * kStageBytes <= kStageBudgetBytes ? 2 : 1;
    // Per stage, each side's own slots: int8 keys, the key scales; low-bit values, their zero
    // points; int8 or low-bit values, their scales (float16 widened) -- in that order.
    static constexpr int kKeyScaleSlot = KeyReader::kScaled ? kTokens : 0;
    static constexpr int kValZeroSlot = ValReader::kLowBit ? kTokens : 0;
    static constexpr int kValScaleSlot = (ValReader::kScaled || ValReader::kLowBit) ? kTokens : 0;
    static constexpr int kScaleStride = kKeyScaleSlot + kValZeroSlot + kValScaleSlot;
    static constexpr int kScaleFloats = kStages * kScaleStride;
    // low-bit keys: each token's key group (-1: the tail), per stage
    static constexpr int kGroupInts = KeyReader::kLowBit ? kStages * kTokens : 0;
    // Low-bit keys are dequantised once per tile into floats (rows of RT + 1: lanes reading one
    // column of consecutive rows hit distinct banks), which every query head then reads.
    static constexpr int kKeyFloats = KeyReader::kLowBit ? kTokens * (RT + 1) : 0;
    static constexpr int kBytes = kStages * kStageBytes + 4 * (kScaleFloats + kGroupInts + kKeyFloats);
};

// The tiles of decode_split_partial: the first of these that fits the budget is used:
//   two stages of 64-token tiles  (16-bit coefficients at rank tile 32; int8 at 32 and 64),
//   two stages of 32-token tiles  (float32 at 32; 16-bit at 64; int8 at 128),
//   one stage of 32-token tiles   (the rest).
// At rank tile 64 two 64-row stages of 16-bit coefficients take 4 x 64 x 144 B = 36.9 KB, which
// with the rest (7.2 KB) exceeds the 40 KB per block of 4 blocks on A100; 32-row stages take
// 18.4 KB.
template <int RT, typename KeyT, typename ValT>
using DecodeTiles = TileGeometry<RT, KeyT, ValT, TileGeometry<RT, KeyT, ValT, kTokenTile>::kStages == 2 ? kTokenTile : kTokenTileSmall>;

// Dynamic shared memory of decode_split_partial, in bytes (the Python launcher uses the same
// formula, subspace_ref_cupy._kernels.decode_shared_bytes):
//   DecodeTiles<RT, KeyT, ValT>::kBytes + 4 * group * (d + 2 * RT + TT + d_v + 4),  TT = kTokens
// (int4/int2 rows hold RT * bits / 8 bytes).
//
// Template parameters: T is the dtype of q and of the bases; KeyT and ValT the key and the value
// coefficient storage, each one of T, signed char for INT8 with per-token scales, Int4Codes /
// Int2Codes for spec/quantization.md Q2 (equal for a uniform layout; different for a layout with
// a format per side, spec/quantization.md Q0, which then takes the same one launch); D and DV the key and value head sizes, or 0 for
// "given at run time" (d_rt, d_v_rt; any size); RT the rank tile, an upper bound on both ranks r
// and r_v (tile rows are zero past r, so the per-token loops have a compile-time trip count). The
// per-token work depends on RT only; D and DV shape the once-per-chunk query projection and
// value-basis map, which is why a run-time head size costs little.

// q~ row i for every head of the group: one warp, lanes over the d columns of the basis row,
// which is read from global memory once (fixed D: kept in registers) and reused for all g heads.
template <typename T, int D>
__device__ __forceinline__ void project_query_row(const T* __restrict__ row, const float* s_q, float* s_qt_col,
                                                  int d, int group, int row_stride, float logit_scale, int lane) {
    if constexpr (D > 0) {
        constexpr int kCols = D / kWarpSize;
        float reg[kCols];
#pragma unroll
        for (int c = 0; c < kCols; ++c) {
            reg[c] = to_float(row[lane + c * kWarpSize]);
        }
        for (int g = 0; g < group; ++g) {
            float dot = 0.0f;
#pragma unroll
            for (int c = 0; c < kCols; ++c) {
                dot += reg[c] * s_q[g * D + lane + c * kWarpSize];
            }
            dot = warp_sum(dot);
            if (lane == 0) {
                s_qt_col[g * row_stride] = logit_scale * dot;
            }
        }
    } else {
        for (int g = 0; g < group; ++g) {
            float dot = 0.0f;
            for (int k = lane; k < d; k += kWarpSize) {
                dot += to_float(row[k]) * s_q[g * d + k];
            }
            dot = warp_sum(dot);
            if (lane == 0) {
                s_qt_col[g * row_stride] = logit_scale * dot;
            }
        }
    }
}

// A flat index into rows of `width` elements as (row t, column i); advance() adds another
// RowCol (the step, its column < width) to (t, i) without dividing.
struct RowCol {
    int t, i;
    __device__ __forceinline__ static RowCol of(int flat, int width) { return RowCol{flat / width, flat % width}; }
    __device__ __forceinline__ void advance(int& row, int& col, int width) const {
        row += t;
        col += i;
        if (col >= width) {
            col -= width;
            ++row;
        }
    }
};

// Issues the copies of rows row0 .. row0 + len - 1 of one head's coefficients (rows of `width`
// elements) into a tile of kRowBytes-byte rows. Each row goes in the widest piece (16, 8 or 4
// bytes) that divides its bytes and the source's alignment; consecutive threads copy consecutive
// pieces of the contiguous source rows. (row, piece) advance by a step computed once per call,
// not by a division per piece. Rows whose bytes no 4-byte piece divides (an odd rank in 16-bit,
// a rank not a multiple of 4 in int8) are copied byte by byte, synchronously.
template <int kPiece, int kRowBytes>
__device__ __forceinline__ void copy_rows(unsigned char* dst, const unsigned char* src, int len, int row_bytes, int tid) {
    const int pieces = row_bytes / kPiece;
    const RowCol step = RowCol::of(kDecodeThreads, pieces);
    RowCol at = RowCol::of(tid, pieces);
    for (int idx = tid; idx < len * pieces; idx += kDecodeThreads, step.advance(at.t, at.i, pieces)) {
        unsigned char* d = dst + at.t * kRowBytes + at.i * kPiece;
        const unsigned char* s = src + static_cast<long long>(idx) * kPiece;
        if constexpr (kPiece == 1) {
            *d = *s;
        } else {
            cp_async<kPiece>(d, s);
        }
    }
}

template <int kRowBytes, typename CoefT>
__device__ __forceinline__ void issue_tile(unsigned char* s_tile, float* s_scale, const CoefT* __restrict__ coef,
                                           const float* __restrict__ scales, long long row0, int len, int width, int tid) {
    const int row_bytes = (width * CoefReader<CoefT>::kBits + 7) / 8;
    const unsigned char* src = reinterpret_cast<const unsigned char*>(coef) + row0 * row_bytes;
    const unsigned long long align = reinterpret_cast<unsigned long long>(src) | static_cast<unsigned long long>(row_bytes);
    if (align % 16 == 0) {
        copy_rows<16, kRowBytes>(s_tile, src, len, row_bytes, tid);
    } else if (align % 8 == 0) {
        copy_rows<8, kRowBytes>(s_tile, src, len, row_bytes, tid);
    } else if (align % 4 == 0) {
        copy_rows<4, kRowBytes>(s_tile, src, len, row_bytes, tid);
    } else {
        copy_rows<1, kRowBytes>(s_tile, src, len, row_bytes, tid);
    }
    if constexpr (CoefReader<CoefT>::kScaled) {
        for (int t = tid; t < len; t += kDecodeThreads) {
            cp_async<4>(s_scale + t, scales + row0 + t);
        }
    }
}

// The per-token numbers a low-bit side needs beside its codes, for tokens t0 .. t0 + len - 1 (rows
// row0 ..): low-bit keys, each token's key group (one division per token, not per coefficient;
// -1 for the tokens of the unfinished group, read from key_tail); low-bit values, the zero point
// and scale. Plain loads: a float16 pair per token is below cp.async's 4-byte piece.
__device__ __forceinline__ void stage_key_groups(int* s_group, int t0, int len, int complete, int key_group, int tid) {
    for (int t = tid; t < len; t += kDecodeThreads) {
        const int token = t0 + t;
        s_group[t] = token < complete ? token / key_group : -1;
    }
}

__device__ __forceinline__ void stage_value_zero_scale(float* s_zero, float* s_scale, const __half* __restrict__ v_scale,
                                                       const __half* __restrict__ v_zero, long long row0, int len, int tid) {
    for (int t = tid; t < len; t += kDecodeThreads) {
        s_zero[t] = to_float(v_zero[row0 + t]);
        s_scale[t] = to_float(v_scale[row0 + t]);
    }
}

// q~ . c for one token: RT coefficients of a raw tile row read as 16-byte vectors (a compile-time
// count of them), against RT floats of q~ (zero past the rank, as the row).
template <int RT, typename CoefT>
__device__ __forceinline__ float row_dot(const float* qt, const unsigned char* row) {
    constexpr int kVec = 16 / static_cast<int>(sizeof(CoefT));
    static_assert(RT % kVec == 0, "a tile row is whole 16-byte vectors");
    const uint4* v = reinterpret_cast<const uint4*>(row);
    float acc = 0.0f;
#pragma unroll 4
    for (int k = 0; k < RT / kVec; ++k) {
        const uint4 raw = v[k];
        CoefT e[kVec];
        memcpy(e, &raw, sizeof(raw));  // NVRTC has memcpy in device code, not __builtin_memcpy
#pragma unroll
        for (int u = 0; u < kVec; ++u) {
            acc += qt[k * kVec + u] * CoefReader<CoefT>::code(e[u]);
        }
    }
    return acc;
}

// q . k for a query and a key row held in shared memory (keys in rows of d + 1 floats: the pad
// keeps consecutive threads' rows in different banks). Rebuilt pre-RoPE keys and exact keys alike.
__device__ __forceinline__ float shared_key_dot(const float* q, const float* k, int d) {
    float acc = 0.0f;
    for (int c = 0; c < d; ++c) {
        acc = fmaf(q[c], k[c], acc);
    }
    return acc;
}

// Spec A3 step 2.2 for query head g after a tile: the running maximum moves from m_old to m_new,
// so the sums so far are rescaled by alpha = e^(m_old - m_new) (s_alpha, read by the value update)
// and the tile's weight sum w_sum (already relative to m_new) joins Z. One lane writes.
__device__ __forceinline__ void commit_tile_softmax(float* s_alpha, float* s_z, float* s_m, int g, float m_old, float m_new, float w_sum, int lane) {
    __syncwarp();
    if (lane == 0) {
        const float alpha = exp_shift(m_old, m_new);
        s_alpha[g] = alpha;
        s_z[g] = s_z[g] * alpha + w_sum;
        s_m[g] = m_new;
    }
}

// ------------------------------------------------------------------ coefficient tile stream
// The coefficient arrays of one (sequence n, KV head h) as the decode kernels read them: the rows
// as stored (spec A9), with int8's per-token scales (spec A10) or int4/int2's key group scales
// and zero points, unfinished key group and value scales and zero points (spec/quantization.md Q2).
template <typename T, typename KeyT, typename ValT>
struct HeadCoefs {
    const KeyT* key_coef;             // (N, H, T_cap, r)
    const ValT* value_coef;           // (N, H, T_cap, r_v)
    const float* key_scale;           // (N, H, T_cap), int8 only
    const float* value_scale;         // (N, H, T_cap), int8 only
    const __half* key_group_scale;    // (N, H, ceil(T_cap / G), r), int4/int2 only
    const __half* key_group_zero;     // (N, H, ceil(T_cap / G), r), int4/int2 only
    const T* key_tail;                // (N, H, G, r), int4/int2 only
    const __half* value_token_scale;  // (N, H, T_cap), int4/int2 only
    const __half* value_token_zero;   // (N, H, T_cap), int4/int2 only
    long long nh;                     // n H + h
    long long row0;                   // the head's token 0 in the (N, H, T_cap) arrays
    long long key_groups_cap;         // rows per head of key_group_scale/zero: ceil(T_cap / G), or fewer (a copy cut to its live groups)
    int rank, rank_v;
    int key_group;                    // G (1 for float and int8)
    int complete;                     // low-bit: tokens below are in complete key groups (spec Q2 step 2)

    __device__ __forceinline__ HeadCoefs(const KeyT* key_coef, const ValT* value_coef, const float* key_scale, const float* value_scale,
                                         const __half* key_group_scale, const __half* key_group_zero, const T* key_tail,
                                         const __half* value_token_scale, const __half* value_token_zero, long long nh, int t_cap,
                                         int rank, int rank_v, int num_tokens, int key_group, int key_groups_cap)
        : key_coef(key_coef), value_coef(value_coef), key_scale(key_scale), value_scale(value_scale), key_group_scale(key_group_scale),
          key_group_zero(key_group_zero), key_tail(key_tail), value_token_scale(value_token_scale), value_token_zero(value_token_zero),
          nh(nh), row0(nh * t_cap), key_groups_cap(key_groups_cap), rank(rank), rank_v(rank_v),
          key_group(key_group), complete(CoefReader<KeyT>::kLowBit ? (num_tokens / key_group) * key_group : 0) {}
};

// A block's coefficient tiles at the start of its dynamic shared memory (the tiles first: their
// 16-byte alignment is the buffer's); the kernel's own arrays start at end().
template <class Tiles>
struct TileBuffers {
    unsigned char* tiles;  // stage s at s kStageBytes: the key tile, then the value tile
    float* scales;         // stage s at s kScaleStride: key scales (int8 keys), value zero points (low-bit values), value scales
    int* groups;           // low-bit keys: stage s at s TT, each token's key group (-1: the tail)
    float* keys;           // low-bit keys: the current tile's keys dequantised, TT rows of RT + 1 floats

    __device__ __forceinline__ explicit TileBuffers(float* smem)
        : tiles(reinterpret_cast<unsigned char*>(smem)),
          scales(reinterpret_cast<float*>(tiles + Tiles::kStages * Tiles::kStageBytes)),
          groups(reinterpret_cast<int*>(scales + Tiles::kScaleFloats)),
          keys(reinterpret_cast<float*>(groups + Tiles::kGroupInts)) {}
    __device__ __forceinline__ float* end() const { return keys + Tiles::kKeyFloats; }
    __device__ __forceinline__ unsigned char* key_tile(int stage) const { return tiles + stage * Tiles::kStageBytes; }
    __device__ __forceinline__ unsigned char* value_tile(int stage) const { return key_tile(stage) + Tiles::kKeyTileBytes; }
    __device__ __forceinline__ float* key_scale(int stage) const { return scales + stage * Tiles::kScaleStride; }
    __device__ __forceinline__ float* value_zero(int stage) const { return key_scale(stage) + Tiles::kKeyScaleSlot; }
    __device__ __forceinline__ float* value_scale(int stage) const { return value_zero(stage) + Tiles::kValZeroSlot; }
};

// The tile of tokens t0 .. t0 + len - 1 as a kernel's per-tile work reads it, its copies landed.
template <class Tiles>
struct Tile {
    using KeyReader = typename Tiles::KeyReader;
    const unsigned char* key_codes;    // rows of kKeyRowBytes bytes, as stored
    const unsigned char* value_codes;  // rows of kValRowBytes bytes, as stored
    const float* key_scale;            // int8 keys: per token
    const float* value_scale;          // int8 and int4/int2 values: per token
    const float* value_zero;           // int4/int2 values: per token
    const float* keys;                 // int4/int2 keys: dequantised, rows of RT + 1 floats
    int t0, len;

    // Key coefficient i of token t: the stored number (int8: before the token's scale, which the
    // logit takes once), or the dequantised low-bit key.
    __device__ __forceinline__ float key(int t, int i) const {
        if constexpr (KeyReader::kLowBit) {
            return keys[t * (Tiles::kRankTile + 1) + i];
        } else {
            return KeyReader::at(key_codes + t * Tiles::kKeyRowBytes, i);
        }
    }
};

// Issues the copies of tokens t0 .. t0 + len - 1 into stage `stage`: key and value rows and int8
// scales asynchronously, each side in its own format; the low-bit per-token numbers (key groups,
// value zero points and scales) as plain loads.
template <class Tiles, typename T, typename KeyT, typename ValT>
__device__ __forceinline__ void issue_stage(const TileBuffers<Tiles>& buf, const HeadCoefs<T, KeyT, ValT>& src, int stage, int t0, int len,
                                            int tid) {
    issue_tile<Tiles::kKeyRowBytes>(buf.key_tile(stage), buf.key_scale(stage), src.key_coef, src.key_scale, src.row0 + t0, len, src.rank, tid);
    issue_tile<Tiles::kValRowBytes>(buf.value_tile(stage), buf.value_scale(stage), src.value_coef, src.value_scale, src.row0 + t0, len,
                                    src.rank_v, tid);
    if constexpr (CoefReader<KeyT>::kLowBit) {
        stage_key_groups(buf.groups + stage * Tiles::kTokens, t0, len, src.complete, src.key_group, tid);
    }
    if constexpr (CoefReader<ValT>::kLowBit) {
        stage_value_zero_scale(buf.value_zero(stage), buf.value_scale(stage), src.value_token_scale, src.value_token_zero, src.row0 + t0, len, tid);
    }
}

// Low-bit keys of a landed tile (spec Q2 step 2): a complete group's codes with its per-channel
// scale and zero point, the unfinished group's tokens from key_tail as they are; zero past the
// rank. Ends at a barrier.
template <class Tiles, typename T, typename KeyT, typename ValT>
__device__ __forceinline__ void dequantize_keys(const Tile<Tiles>& tile, float* s_kf, const int* s_grp, const HeadCoefs<T, KeyT, ValT>& src,
                                                int tid) {
    using Reader = CoefReader<KeyT>;
    constexpr int RT = Tiles::kRankTile;
    const RowCol step = RowCol::of(kDecodeThreads, RT);
    RowCol at = RowCol::of(tid, RT);
    for (int idx = tid; idx < tile.len * RT; idx += kDecodeThreads, step.advance(at.t, at.i, RT)) {
        float x = 0.0f;
        if (at.i < src.rank) {
            const int grp = s_grp[at.t];
            if (grp >= 0) {
                const long long sz = (src.nh * src.key_groups_cap + grp) * src.rank + at.i;
                x = low_bit_value<T>(Reader::at(tile.key_codes + at.t * Tiles::kKeyRowBytes, at.i), to_float(src.key_group_scale[sz]),
                                     to_float(src.key_group_zero[sz]));
            } else {
                x = to_float(src.key_tail[(src.nh * src.key_group + (tile.t0 + at.t - src.complete)) * src.rank + at.i]);
            }
        }
        s_kf[at.t * (RT + 1) + at.i] = x;
    }
    __syncthreads();
}

// The tile pipeline of both decode kernels over tokens lo .. hi - 1 of one head, in tiles of TT
// tokens, tile k in stage k mod kStages. start_tiles issues the first tile (which lands while the
// block computes something else) and commits its copy group, even when the range is empty.
template <class Tiles, typename T, typename KeyT, typename ValT>
__device__ __forceinline__ void start_tiles(const TileBuffers<Tiles>& buf, const HeadCoefs<T, KeyT, ValT>& src, int lo, int hi, int tid) {
    if (lo < hi) {
        issue_stage(buf, src, 0, lo, min(Tiles::kTokens, hi - lo), tid);
    }
    cp_async_commit();
}

// Then, per tile: two stages, issue the next tile into the other stage (last read by the previous
// tile, which ended at a barrier) and wait for all but that newest copy group; one stage, wait for
// all. After a barrier the tile has landed for the whole block; low-bit keys are dequantised, and
// body(tile) runs. A barrier ends the tile (so its stage may be overwritten), and with one stage the
// next tile is issued into it. Returns with no copy pending.
template <class Tiles, typename T, typename KeyT, typename ValT, class Body>
__device__ __forceinline__ void stream_tiles(const TileBuffers<Tiles>& buf, const HeadCoefs<T, KeyT, ValT>& src, int lo, int hi, int tid,
                                             Body&& body) {
    constexpr int TT = Tiles::kTokens;
    constexpr int kStages = Tiles::kStages;
    int stage = 0;
    for (int t0 = lo; t0 < hi; t0 += TT, stage ^= kStages - 1) {
        const int next = t0 + TT;
        if constexpr (kStages == 2) {
            if (next < hi) {
                issue_stage(buf, src, stage ^ 1, next, min(TT, hi - next), tid);
            }
            // Committed even when empty, so that "all groups but the newest" is always the
            // current tile's.
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();
        const Tile<Tiles> tile{buf.key_tile(stage), buf.value_tile(stage), buf.key_scale(stage), buf.value_scale(stage), buf.value_zero(stage),
                               buf.keys, t0, min(TT, hi - t0)};
        if constexpr (CoefReader<KeyT>::kLowBit) {
            dequantize_keys(tile, buf.keys, buf.groups + stage * TT, src, tid);
        }
        body(tile);
        __syncthreads();
        if constexpr (kStages == 1) {
            if (next < hi) {
                issue_stage(buf, src, 0, next, min(TT, hi - next), tid);
                cp_async_commit();
            }
        }
    }
    // an empty range committed its (empty) first group and never waited
    cp_async_wait<0>();
}

// One tile's update of the value sums in coefficient space (spec A2 step 4, A3 step 2.3): each
// thread owns (query head g, coefficient i) pairs, rescales its running sum by the tile's alpha
// and adds the tile's weighted codes: r_v numbers per head per token instead of d_v. int8 codes
// take their per-token scale; int4/int2 codes are read as x = code s + z (the value scales and
// zero points). The value side's own format (ValT), whatever the keys'. Shared by the plain and
// the pre-RoPE decode kernels.
template <typename T, class Tiles>
__device__ __forceinline__ void accumulate_value_tile(float* s_acc, const float* s_alpha, const float* s_w, const Tile<Tiles>& tile, int group, int tid) {
    using Reader = typename Tiles::ValReader;
    constexpr int RT = Tiles::kRankTile;
    constexpr int TT = Tiles::kTokens;
    for (int idx = tid; idx < group * RT; idx += kDecodeThreads) {
        const int g = idx / RT;
        const int i = idx - g * RT;
        float acc = s_acc[idx] * s_alpha[g];
        for (int t = 0; t < tile.len; ++t) {
            float w = s_w[g * TT + t];
            const float code = Reader::at(tile.value_codes + t * Tiles::kValRowBytes, i);
            if constexpr (Reader::kLowBit) {
                acc += w * low_bit_value<T>(code, tile.value_scale[t], tile.value_zero[t]);
            } else {
                if constexpr (Reader::kScaled) {
                    w *= tile.value_scale[t];
                }
                acc += w * code;
            }
        }
        s_acc[idx] = acc;
    }
}

template <typename T, typename KeyT, typename ValT, int D, int DV, int RT>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeMinBlocks)
decode_split_partial(const T* __restrict__ q,                    // (N, H_q, d)
                     const KeyT* __restrict__ key_coef,          // (N, H, T_cap, r)
                     const ValT* __restrict__ value_coef,        // (N, H, T_cap, r_v)
                     const float* __restrict__ key_scale,        // (N, H, T_cap), INT8 only
                     const float* __restrict__ value_scale,      // (N, H, T_cap), INT8 only
                     const __half* __restrict__ key_group_scale, // (N, H, ceil(T_cap / G), r), int4/int2 only
                     const __half* __restrict__ key_group_zero,  // (N, H, ceil(T_cap / G), r), int4/int2 only
                     const T* __restrict__ key_tail,             // (N, H, G, r), int4/int2 only
                     const __half* __restrict__ value_token_scale, // (N, H, T_cap), int4/int2 only
                     const __half* __restrict__ value_token_zero,  // (N, H, T_cap), int4/int2 only
                     const T* __restrict__ key_bases,            // (N, H, J_cap, r, d)
                     const T* __restrict__ value_bases,          // (N, H, J_cap, r_v, d_v)
                     const long long* __restrict__ chunk_starts, // (N, H, J_cap)
                     const long long* __restrict__ num_chunks,   // (N, H)
                     const float* __restrict__ gamma,            // (H,)
                     float* __restrict__ part_m,                 // (N, H_q, S)
                     float* __restrict__ part_z,                 // (N, H_q, S)
                     float* __restrict__ part_o,                 // (N, H_q, S, d_v)
                     int num_kv_heads, int group, int t_cap, int j_cap, int rank, int rank_v,
                     int d_rt, int d_v_rt, int num_tokens, int split_len, int key_group, int key_groups_cap, float scale) {
    static_assert(D >= 0 && D % kWarpSize == 0, "a fixed D gives each lane D / 32 columns");
    static_assert(DV >= 0, "DV is a head size, or 0 for a run-time one");
    static_assert(RT % kWarpSize == 0, "rank tiles are whole warps");
    using Tiles = DecodeTiles<RT, KeyT, ValT>;
    using Reader = CoefReader<KeyT>;  // the logits read the keys; accumulate_value_tile the values in theirs
    constexpr int TT = Tiles::kTokens;
    constexpr int kPerLane = TT / kWarpSize;
    const int d = D > 0 ? D : d_rt;
    const int dv = DV > 0 ? DV : d_v_rt;

    const int split = blockIdx.x;
    const int h = blockIdx.y;
    const int n = blockIdx.z;
    const int num_splits = gridDim.x;
    const int tid = threadIdx.x;
    const int lane = tid % kWarpSize;
    const int warp = tid / kWarpSize;
    const int num_q_heads = num_kv_heads * group;

    extern __shared__ float smem[];
    const TileBuffers<Tiles> buf(smem);
    float* s_q = buf.end();                     // group x d
    float* s_qt = s_q + group * d;              // group x RT, scaled by gamma * scale
    float* s_w = s_qt + group * RT;             // group x TT: logits, then weights
    float* s_acc = s_w + group * TT;            // group x RT: value-coefficient accumulator
    float* s_out = s_acc + group * RT;          // group x d_v: N of spec A3, at scale s_mout
    float* s_m = s_out + group * dv;            // group: running max m
    float* s_z = s_m + group;                   // group: Z
    float* s_mout = s_z + group;                // group: the m that s_out is scaled to
    float* s_alpha = s_mout + group;            // group: exp(m_old - m_new) of the current tile

    const long long nh = static_cast<long long>(n) * num_kv_heads + h;
    const long long q_row0 = static_cast<long long>(n) * num_q_heads + static_cast<long long>(h) * group;
    const HeadCoefs<T, KeyT, ValT> src(key_coef, value_coef, key_scale, value_scale, key_group_scale, key_group_zero, key_tail, value_token_scale,
                                  value_token_zero, nh, t_cap, rank, rank_v, num_tokens, key_group, key_groups_cap);

    for (int i = tid; i < group * d; i += kDecodeThreads) {
        s_q[i] = to_float(q[q_row0 * d + i]);
    }
    for (int i = tid; i < group * RT; i += kDecodeThreads) {
        s_acc[i] = 0.0f;
    }
    for (int i = tid; i < group * dv; i += kDecodeThreads) {
        s_out[i] = 0.0f;
    }
    // Bytes past a row's rank coefficients are never copied; zero makes them inert in the RT-long
    // dots (and finite in the value sums, whose columns past r_v are never read).
    for (int i = tid; i < Tiles::kStages * Tiles::kStageBytes / 16; i += kDecodeThreads) {
        reinterpret_cast<uint4*>(buf.tiles)[i] = make_uint4(0u, 0u, 0u, 0u);
    }
    for (int i = tid; i < group; i += kDecodeThreads) {
        s_m[i] = -SUBSPACE_INFINITY;
        s_z[i] = 0.0f;
        s_mout[i] = -SUBSPACE_INFINITY;
    }
    __syncthreads();

    const int lo = split * split_len;
    const int hi = min(num_tokens, lo + split_len);
    const float logit_scale = gamma[h] * scale;
    const long long num_j = num_chunks[nh];
    const long long* starts = chunk_starts + nh * j_cap;

    // An empty split (lo >= hi) skips the walk and writes the merge identity (-inf, 0, 0).
    if (lo < hi && num_j > 0) {
        // The chunk holding token lo: the last j with starts[j] <= lo (starts[0] = 0).
        long long a = 0, b = num_j - 1;
        while (a < b) {
            const long long mid = (a + b + 1) / 2;
            if (starts[mid] <= lo) {
                a = mid;
            } else {
                b = mid - 1;
            }
        }
        for (long long j = a; j < num_j; ++j) {
            const long long chunk_end = (j + 1 < num_j) ? starts[j + 1] : num_tokens;
            const int c_lo = static_cast<int>(max(static_cast<long long>(lo), starts[j]));
            const int c_hi = static_cast<int>(min(static_cast<long long>(hi), chunk_end));
            if (c_lo >= hi) {
                break;
            }
            if (c_lo >= c_hi) {
                continue;
            }

            // The chunk's first tile is in flight while q~_j is computed.
            start_tiles(buf, src, c_lo, c_hi, tid);

            // Spec A3 step 2.1: q~_j = B_j q, one warp per basis row.
            const T* basis = key_bases + (nh * j_cap + j) * static_cast<long long>(rank) * d;
            for (int i = warp; i < RT; i += kDecodeWarps) {
                if (i < rank) {
                    project_query_row<T, D>(basis + static_cast<long long>(i) * d, s_q, s_qt + i, d, group, RT, logit_scale, lane);
                } else {
                    for (int g = lane; g < group; g += kWarpSize) {
                        s_qt[g * RT + i] = 0.0f;
                    }
                }
            }
            __syncthreads();

            stream_tiles(buf, src, c_lo, c_hi, tid, [&](const Tile<Tiles>& tile) {
                // Logits gamma * scale * q~_j . c_t; tokens past the tile end get -inf so that
                // they weigh exactly 0.
                for (int idx = tid; idx < group * TT; idx += kDecodeThreads) {
                    const int g = idx / TT;
                    const int t = idx - g * TT;
                    float logit = -SUBSPACE_INFINITY;
                    if (t < tile.len) {
                        if constexpr (Reader::kLowBit) {
                            logit = 0.0f;
#pragma unroll 8
                            for (int i = 0; i < RT; ++i) {
                                logit += s_qt[g * RT + i] * tile.key(t, i);
                            }
                        } else {
                            logit = row_dot<RT, KeyT>(s_qt + g * RT, tile.key_codes + t * Tiles::kKeyRowBytes);
                            if constexpr (Reader::kScaled) {
                                logit *= tile.key_scale[t];
                            }
                        }
                    }
                    s_w[idx] = logit;
                }
                __syncthreads();

                // Spec A3 steps 2.2-2.3 at tile granularity (A3.1: any partition of the tokens
                // gives the same result), one warp per query head, kPerLane tokens per lane.
                for (int g = warp; g < group; g += kDecodeWarps) {
                    float logit[kPerLane];
                    float tile_max = -SUBSPACE_INFINITY;
#pragma unroll
                    for (int k = 0; k < kPerLane; ++k) {
                        logit[k] = s_w[g * TT + k * kWarpSize + lane];
                        tile_max = fmaxf(tile_max, logit[k]);
                    }
                    const float m_old = s_m[g];
                    const float m_new = fmaxf(m_old, warp_max(tile_max));
                    float lane_sum = 0.0f;
#pragma unroll
                    for (int k = 0; k < kPerLane; ++k) {
                        const float w = exp_shift(logit[k], m_new);
                        s_w[g * TT + k * kWarpSize + lane] = w;
                        lane_sum += w;
                    }
                    commit_tile_softmax(s_alpha, s_z, s_m, g, m_old, m_new, warp_sum(lane_sum), lane);
                }
                __syncthreads();

                // The weighted sum stays in coefficient space (spec A2 step 4): r_v numbers per
                // head per token instead of d_v.
                accumulate_value_tile<T>(s_acc, s_alpha, s_w, tile, group, tid);
            });

            // Once per chunk, not per token: N <- N * exp(m_out - m) + acc E_j (spec A3 step 2.3).
            // s_out was last brought to scale s_mout; acc is at the current m.
            const T* vbasis = value_bases + (nh * j_cap + j) * static_cast<long long>(rank_v) * dv;
            for (int idx = tid; idx < group * dv; idx += kDecodeThreads) {
                const int g = idx / dv;
                const int c = idx - g * dv;
                float out = s_out[idx] * exp_shift(s_mout[g], s_m[g]);
                for (int i = 0; i < rank_v; ++i) {
                    out += s_acc[g * RT + i] * to_float(vbasis[static_cast<long long>(i) * dv + c]);
                }
                s_out[idx] = out;
            }
            __syncthreads();
            for (int i = tid; i < group * RT; i += kDecodeThreads) {
                s_acc[i] = 0.0f;
            }
            for (int g = tid; g < group; g += kDecodeThreads) {
                s_mout[g] = s_m[g];
            }
            __syncthreads();
        }
    }

    for (int idx = tid; idx < group * dv; idx += kDecodeThreads) {
        const int g = idx / dv;
        const int c = idx - g * dv;
        const long long row = (q_row0 + g) * num_splits + split;
        part_o[row * dv + c] = s_out[idx];
    }
    for (int g = tid; g < group; g += kDecodeThreads) {
        const long long row = (q_row0 + g) * num_splits + split;
        part_m[row] = s_m[g];
        part_z[row] = s_z[g];
    }
}

// ------------------------------------------------------------------ softmax over a tile
// Spec A3 steps 2.2-2.3 for one tile of `tt` (a multiple of 32) logits per query head in s_w,
// one warp per head: s_w becomes the weights exp(logit - m_new), s_m/s_z are updated and s_alpha
// holds exp(m_old - m_new) for the caller's accumulator. Ends at a barrier.
__device__ __forceinline__ void softmax_tile(float* s_w, float* s_m, float* s_z, float* s_alpha, int group, int tt, int warp, int lane) {
    for (int g = warp; g < group; g += kDecodeWarps) {
        float tile_max = -SUBSPACE_INFINITY;
        for (int t = lane; t < tt; t += kWarpSize) {
            tile_max = fmaxf(tile_max, s_w[g * tt + t]);
        }
        const float m_old = s_m[g];
        const float m_new = fmaxf(m_old, warp_max(tile_max));
        float lane_sum = 0.0f;
        for (int t = lane; t < tt; t += kWarpSize) {
            const float w = exp_shift(s_w[g * tt + t], m_new);
            s_w[g * tt + t] = w;
            lane_sum += w;
        }
        commit_tile_softmax(s_alpha, s_z, s_m, g, m_old, m_new, warp_sum(lane_sum), lane);
    }
    __syncthreads();
}

// ------------------------------------------------------------------ pre-RoPE static states
// Spec/rope.md P3, spec/roofline.md R13: the logit of compressed token t is q . R_{p(t)} B^T c_t
// with p(t) = first_position + t (spec/window.md W10: the sinks hold positions 0..S-1). No
// r-dimensional transport exists for a general basis (spec/rope.md R4), so each tile's keys are
// rebuilt (u_t = B^T c_t, O(r d) per token, shared by the g query heads of the group: cheaper
// than rotating the query per token once g >= 2), rotated, and dotted with the queries; values
// stay in coefficient space. One chunk (static states), so E is applied once per split.
//
// A thread rebuilds one plane (two dims) of kRopeSub consecutive tokens, so the rotation happens
// in registers; cos/sin of (p0 + k) theta by angle addition of the item's base angle (float64,
// one sincos per item) and the offsets k theta (float64 once per block, kept in shared memory as
// float), so no table of positions is read.
constexpr int kRopeTokens = kWarpSize;
constexpr int kRopeSub = 8;

// 32-token tiles, two stages where they fit the budget (at rank tile 32 every storage; at 64 all
// but float32; at 128 int8 and int4/int2; at 256 int4/int2).
template <int RT, typename KeyT, typename ValT>
using RopeTiles = TileGeometry<RT, KeyT, ValT, kRopeTokens>;

// Dynamic shared memory of decode_rope_partial (subspace_ref_cupy._kernels.rope_shared_bytes):
//   RopeTiles<RT, KeyT, ValT>::kBytes + 4 * (TT * (d + 1) + 2 * kRopeSub * (d / 2) + group * (d + TT + RT + 3))
// Coefficient storage as decode_split_partial's: float, int8 with per-token scales (applied to the
// logit and the weight), or int4/int2 codes (keys dequantised once per tile before the rebuild,
// values in the weighted sum).
template <typename T, typename KeyT, typename ValT, int RT>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeMinBlocks)
decode_rope_partial(const T* __restrict__ q,                    // (N, H_q, d), post-RoPE
                    const KeyT* __restrict__ key_coef,          // (N, H, T_cap, r)
                    const ValT* __restrict__ value_coef,        // (N, H, T_cap, r_v)
                    const float* __restrict__ key_scale,        // (N, H, T_cap), INT8 only
                    const float* __restrict__ value_scale,      // (N, H, T_cap), INT8 only
                    const __half* __restrict__ key_group_scale, // (N, H, ceil(T_cap / G), r), int4/int2 only
                    const __half* __restrict__ key_group_zero,  // (N, H, ceil(T_cap / G), r), int4/int2 only
                    const T* __restrict__ key_tail,             // (N, H, G, r), int4/int2 only
                    const __half* __restrict__ value_token_scale, // (N, H, T_cap), int4/int2 only
                    const __half* __restrict__ value_token_zero,  // (N, H, T_cap), int4/int2 only
                    const T* __restrict__ key_bases,            // (N, H, J_cap, r, d), chunk 0 read
                    const T* __restrict__ value_bases,          // (N, H, J_cap, r_v, d_v)
                    const float* __restrict__ gamma,            // (H,)
                    const double* __restrict__ inv_freq,        // (m,)
                    const int* __restrict__ order,              // (d,): planes' first dims, second dims, fixed dims
                    float* __restrict__ part_m,                 // (N, H_q, S)
                    float* __restrict__ part_z,                 // (N, H_q, S)
                    float* __restrict__ part_o,                 // (N, H_q, S, d_v)
                    int num_kv_heads, int group, int t_cap, int j_cap, int rank, int rank_v, int d, int dv,
                    int num_tokens, int split_len, int key_group, int key_groups_cap, int num_rotating, int first_position, float rope_scale, float scale) {
    static_assert(RT % kWarpSize == 0, "rank tiles are whole warps");
    using Tiles = RopeTiles<RT, KeyT, ValT>;
    using Reader = CoefReader<KeyT>;  // the key rebuild and logits; accumulate_value_tile reads the values in theirs
    constexpr int TT = Tiles::kTokens;
    static_assert(TT % kRopeSub == 0, "a tile is whole rebuild items");

    const int split = blockIdx.x;
    const int h = blockIdx.y;
    const int n = blockIdx.z;
    const int num_splits = gridDim.x;
    const int tid = threadIdx.x;
    const int lane = tid % kWarpSize;
    const int warp = tid / kWarpSize;
    const int num_q_heads = num_kv_heads * group;
    const int half = d / 2;
    const int m = num_rotating;

    extern __shared__ float smem[];
    const TileBuffers<Tiles> buf(smem);
    float* s_k = buf.end();                        // TT x (d + 1): rotated keys (odd stride: no bank conflicts per token)
    float* s_cs = s_k + TT * (d + 1);              // 2 x kRopeSub x half: cos, then sin, of k theta_i
    float* s_q = s_cs + 2 * kRopeSub * half;       // group x d, scaled by gamma * scale
    float* s_w = s_q + group * d;                  // group x TT
    float* s_acc = s_w + group * TT;               // group x RT
    float* s_m = s_acc + group * RT;
    float* s_z = s_m + group;
    float* s_alpha = s_z + group;

    const long long nh = static_cast<long long>(n) * num_kv_heads + h;
    const long long q_row0 = static_cast<long long>(n) * num_q_heads + static_cast<long long>(h) * group;
    const HeadCoefs<T, KeyT, ValT> src(key_coef, value_coef, key_scale, value_scale, key_group_scale, key_group_zero, key_tail, value_token_scale,
                                  value_token_zero, nh, t_cap, rank, rank_v, num_tokens, key_group, key_groups_cap);
    const int lo = split * split_len;
    const int hi = min(num_tokens, lo + split_len);

    // The split's first tile is in flight while the block fills its tables.
    start_tiles(buf, src, lo, hi, tid);

    const float logit_scale = gamma[h] * scale;
    for (int i = tid; i < group * d; i += kDecodeThreads) {
        s_q[i] = logit_scale * to_float(q[q_row0 * d + i]);
    }
    for (int i = tid; i < group * RT; i += kDecodeThreads) {
        s_acc[i] = 0.0f;
    }
    for (int i = tid; i < kRopeSub * m; i += kDecodeThreads) {
        const int k = i / m;
        const int p = i - k * m;
        const double angle = static_cast<double>(k) * inv_freq[p];
        s_cs[k * half + p] = static_cast<float>(cos(angle));
        s_cs[(kRopeSub + k) * half + p] = static_cast<float>(sin(angle));
    }
    for (int g = tid; g < group; g += kDecodeThreads) {
        s_m[g] = -SUBSPACE_INFINITY;
        s_z[g] = 0.0f;
    }
    __syncthreads();

    const T* basis = key_bases + nh * j_cap * static_cast<long long>(rank) * d;
    stream_tiles(buf, src, lo, hi, tid, [&](const Tile<Tiles>& tile) {
        // P3 step 1: rebuild and rotate, one (plane, kRopeSub tokens) item per thread. Rows past
        // tile.len hold an earlier tile's coefficients; their logits are masked below.
        for (int item = tid; item < half * (TT / kRopeSub); item += kDecodeThreads) {
            const int sub = item / half;
            const int p = item - sub * half;
            const int k0 = sub * kRopeSub;
            if (k0 >= tile.len) {
                continue;
            }
            // fixed dims are paired consecutively after the 2m rotating ones: plane p >= m is
            // (order[2p], order[2p + 1])
            const int a = order[p < m ? p : 2 * p];
            const int b = order[p < m ? m + p : 2 * p + 1];
            float ua[kRopeSub], ub[kRopeSub];
#pragma unroll
            for (int k = 0; k < kRopeSub; ++k) {
                ua[k] = 0.0f;
                ub[k] = 0.0f;
            }
            for (int i = 0; i < rank; ++i) {
                const float ba = to_float(basis[static_cast<long long>(i) * d + a]);
                const float bb = to_float(basis[static_cast<long long>(i) * d + b]);
#pragma unroll
                for (int k = 0; k < kRopeSub; ++k) {
                    const float c = tile.key(k0 + k, i);
                    ua[k] = fmaf(c, ba, ua[k]);
                    ub[k] = fmaf(c, bb, ub[k]);
                }
            }
            float* row = s_k + k0 * (d + 1);
            if (p < m) {
                double sin_base, cos_base;
                sincos(static_cast<double>(first_position + tile.t0 + k0) * inv_freq[p], &sin_base, &cos_base);
                const float cb = static_cast<float>(rope_scale * cos_base);
                const float sb = static_cast<float>(rope_scale * sin_base);
#pragma unroll
                for (int k = 0; k < kRopeSub; ++k) {
                    const float ck = s_cs[k * half + p];
                    const float sk = s_cs[(kRopeSub + k) * half + p];
                    const float c = ck * cb - sk * sb;
                    const float s = sk * cb + ck * sb;
                    row[k * (d + 1) + a] = ua[k] * c - ub[k] * s;
                    row[k * (d + 1) + b] = ua[k] * s + ub[k] * c;
                }
            } else {
#pragma unroll
                for (int k = 0; k < kRopeSub; ++k) {
                    row[k * (d + 1) + a] = ua[k];
                    row[k * (d + 1) + b] = ub[k];
                }
            }
        }
        __syncthreads();

        // P3 step 2: logits gamma * scale * q . k^_t (INT8: times the key scale, spec A10).
        for (int idx = tid; idx < group * TT; idx += kDecodeThreads) {
            const int g = idx / TT;
            const int t = idx - g * TT;
            float logit = -SUBSPACE_INFINITY;
            if (t < tile.len) {
                logit = shared_key_dot(s_q + g * d, s_k + t * (d + 1), d);
                if constexpr (Reader::kScaled) {
                    logit *= tile.key_scale[t];
                }
            }
            s_w[idx] = logit;
        }
        __syncthreads();
        softmax_tile(s_w, s_m, s_z, s_alpha, group, TT, warp, lane);

        accumulate_value_tile<T>(s_acc, s_alpha, s_w, tile, group, tid);
    });

    // One chunk: N = acc E once per split (spec A3 step 2.3); an empty split writes (-inf, 0, 0).
    const T* vbasis = value_bases + nh * j_cap * static_cast<long long>(rank_v) * dv;
    for (int idx = tid; idx < group * dv; idx += kDecodeThreads) {
        const int g = idx / dv;
        const int c = idx - g * dv;
        float out = 0.0f;
        for (int i = 0; i < rank_v; ++i) {
            out += s_acc[g * RT + i] * to_float(vbasis[static_cast<long long>(i) * dv + c]);
        }
        part_o[((q_row0 + g) * num_splits + split) * dv + c] = out;
    }
    for (int g = tid; g < group; g += kDecodeThreads) {
        const long long row = (q_row0 + g) * num_splits + split;
        part_m[row] = s_m[g];
        part_z[row] = s_z[g];
    }
}

// ------------------------------------------------------------------ exact tokens
// Spec/window.md W3, W8: the recent window and the attention sinks are exact chunks of spec A3
// (B = I, E = I, gamma = 1): this writes their partial (m, Z, N) of spec A3.2 into column `col`
// of (N, H_q, num_cols) partials, which merge_splits combines with the compressed part's splits,
// one softmax over every token. One block per (KV head, sequence) serves the g query heads of
// the group; a window holds a few hundred tokens against the compressed part's thousands, so it
// is not split further. Plain loads: the keys are read once.
constexpr int kExactTokens = kWarpSize;

// Dynamic shared memory (subspace_ref_cupy._kernels.exact_shared_bytes):
//   4 * (group * (d + TT + d_v + 3) + TT * (d + 1) + TT * d_v),  TT = kExactTokens
template <typename T>
__global__ void __launch_bounds__(kDecodeThreads)
exact_partial(const T* __restrict__ q,       // (N, H_q, d)
              const T* __restrict__ keys,    // (N, H, n, d), post-RoPE as given
              const T* __restrict__ values,  // (N, H, n, d_v)
              float* __restrict__ part_m,    // (N, H_q, num_cols)
              float* __restrict__ part_z,
              float* __restrict__ part_o,    // (N, H_q, num_cols, d_v)
              int num_kv_heads, int group, int num_tokens, int d, int dv, int col, int num_cols, float scale) {
    constexpr int TT = kExactTokens;
    const int h = blockIdx.y;
    const int n = blockIdx.z;
    const int tid = threadIdx.x;
    const int lane = tid % kWarpSize;
    const int warp = tid / kWarpSize;
    const int num_q_heads = num_kv_heads * group;

    extern __shared__ float smem[];
    float* s_q = smem;                 // group x d, scaled
    float* s_k = s_q + group * d;      // TT x (d + 1)
    float* s_v = s_k + TT * (d + 1);   // TT x d_v
    float* s_w = s_v + TT * dv;        // group x TT
    float* s_acc = s_w + group * TT;   // group x d_v
    float* s_m = s_acc + group * dv;
    float* s_z = s_m + group;
    float* s_alpha = s_z + group;

    const long long nh = static_cast<long long>(n) * num_kv_heads + h;
    const long long q_row0 = static_cast<long long>(n) * num_q_heads + static_cast<long long>(h) * group;
    for (int i = tid; i < group * d; i += kDecodeThreads) {
        s_q[i] = scale * to_float(q[q_row0 * d + i]);
    }
    for (int i = tid; i < group * dv; i += kDecodeThreads) {
        s_acc[i] = 0.0f;
    }
    for (int g = tid; g < group; g += kDecodeThreads) {
        s_m[g] = -SUBSPACE_INFINITY;
        s_z[g] = 0.0f;
    }
    const T* k_head = keys + nh * num_tokens * static_cast<long long>(d);
    const T* v_head = values + nh * num_tokens * static_cast<long long>(dv);
    for (int t0 = 0; t0 < num_tokens; t0 += TT) {
        const int tile_len = min(TT, num_tokens - t0);
        // the previous tile's readers finished at the barrier that ends the loop body
        for (int i = tid; i < tile_len * d; i += kDecodeThreads) {
            const int t = i / d;
            s_k[t * (d + 1) + (i - t * d)] = to_float(k_head[static_cast<long long>(t0) * d + i]);
        }
        for (int i = tid; i < tile_len * dv; i += kDecodeThreads) {
            s_v[i] = to_float(v_head[static_cast<long long>(t0) * dv + i]);
        }
        __syncthreads();
        for (int idx = tid; idx < group * TT; idx += kDecodeThreads) {
            const int g = idx / TT;
            const int t = idx - g * TT;
            float logit = -SUBSPACE_INFINITY;
            if (t < tile_len) {
                logit = shared_key_dot(s_q + g * d, s_k + t * (d + 1), d);
            }
            s_w[idx] = logit;
        }
        __syncthreads();
        softmax_tile(s_w, s_m, s_z, s_alpha, group, TT, warp, lane);
        for (int idx = tid; idx < group * dv; idx += kDecodeThreads) {
            const int g = idx / dv;
            const int c = idx - g * dv;
            float acc = s_acc[idx] * s_alpha[g];
            for (int t = 0; t < tile_len; ++t) {
                acc = fmaf(s_w[g * TT + t], s_v[t * dv + c], acc);
            }
            s_acc[idx] = acc;
        }
        __syncthreads();
    }
    for (int idx = tid; idx < group * dv; idx += kDecodeThreads) {
        const int g = idx / dv;
        part_o[((q_row0 + g) * num_cols + col) * dv + (idx - g * dv)] = s_acc[idx];
    }
    for (int g = tid; g < group; g += kDecodeThreads) {
        const long long row = (q_row0 + g) * num_cols + col;
        part_m[row] = s_m[g];
        part_z[row] = s_z[g];
    }
}

constexpr int kMergeThreads = 128;

// Spec A3.2: merge the S split partials of one (sequence, query head) and write N / Z.
// Grid: N * H_q blocks. Every thread recomputes the max and weights over the S splits (S is small)
// instead of sharing them through shared memory and a barrier.
template <typename T>
__global__ void __launch_bounds__(kMergeThreads)
merge_splits(const float* __restrict__ part_m,  // (N * H_q, S)
             const float* __restrict__ part_z,  // (N * H_q, S)
             const float* __restrict__ part_o,  // (N * H_q, S, d_v)
             T* __restrict__ out,               // (N * H_q, d_v)
             int num_splits, int dv) {
    const long long row = blockIdx.x;
    const float* m_row = part_m + row * num_splits;
    const float* z_row = part_z + row * num_splits;
    float m = -SUBSPACE_INFINITY;
    for (int s = 0; s < num_splits; ++s) {
        m = fmaxf(m, m_row[s]);
    }
    float z = 0.0f;
    for (int s = 0; s < num_splits; ++s) {
        z += z_row[s] * exp_shift(m_row[s], m);
    }
    // z >= 1 whenever any token was attended (spec A3.1); the launcher refuses T = 0.
    for (int c = threadIdx.x; c < dv; c += kMergeThreads) {
        float o = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            o += part_o[(row * num_splits + s) * dv + c] * exp_shift(m_row[s], m);
        }
        out[row * dv + c] = from_float<T>(o / z);
    }
}

}  // namespace subspace

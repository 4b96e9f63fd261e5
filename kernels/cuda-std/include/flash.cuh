// kiln-cuda-std/flash.cuh — one tile of keys of attention on tensor cores, after FlashAttention-2
// (Dao, 2023: per warp, 16 query rows against a tile of keys in shared memory, the softmax kept
// online in registers), for kernels that hold their query rows as mma A fragments and stage K and
// V rows in shared memory: kiln-attention's prompt attention (GroupQueryAttention) and its ONNX
// Attention / ReshapedAttention kernel.
//
// Shared-memory tiles are rows of HD 16-bit elements (HD / 8 vectors of 16 bytes), each row's
// vectors swizzled by kiln_swz so that ldmatrix's eight rows hit eight bank groups.
#pragma once
#include "kiln.cuh"
#include "kiln-cuda-std/async.cuh"
#include "kiln-cuda-std/mma.cuh"

// Index of 16-byte vector u of row r in a swizzled tile of rows of `vpr` vectors (a power of
// two): rows r … r + 7 keep vector u in 8 different bank groups.
__device__ __forceinline__ unsigned kiln_swz(unsigned r, unsigned u, unsigned vpr) {
    return r * vpr + (u ^ (r & (vpr - 1) & 7u));
}

// The running state of a warp's 16 query rows: O (HD / 8 fragments of 16 × 8, f32), and per
// lane its two rows' (g and g + 8, g = lane / 4) running maximum and this lane's part of the
// running sum of weights (the quad's four parts are summed by kiln_flash_finish).
template <int HD>
struct kiln_flash_rows {
    float o[HD / 8][4];
    float m[2], l[2];
};

template <int HD>
__device__ __forceinline__ void kiln_flash_init(kiln_flash_rows<HD>& f) {
    const float neg_inf = -__int_as_float(0x7f800000);
#pragma unroll
    for (unsigned n = 0; n < HD / 8; ++n)
#pragma unroll
        for (unsigned i = 0; i < 4; ++i) f.o[n][i] = 0.f;
    f.m[0] = f.m[1] = neg_inf;
    f.l[0] = f.l[1] = 0.f;
}

// The A fragments of the warp's 16 query rows (rows 16·warp … of `q_s`, swizzled rows of HD
// elements), HD / 16 steps of 16 dimensions. Every lane of the warp calls it.
template <int HD>
__device__ __forceinline__ void kiln_flash_load_q(unsigned (&qa)[HD / 16][4], const uint4* q_s) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
#pragma unroll
    for (unsigned s = 0; s < HD / 16; ++s)
        kiln_ldmatrix_x4<false>(qa[s], &q_s[kiln_swz(16 * warp + (lane & 15u), 2 * s + (lane >> 4), HD / 8)]);
}

// Key tiles 0 … tiles − 1 through two shared-memory buffers: tile it + 1's copies
// (`load(it + 1)`: cp.async and one commit per thread) in flight while `step(it)` works on tile
// it, which the block's barrier made visible; the caller issued tile 0's copies. Every thread of
// the block calls it.
template <typename Load, typename Step>
__device__ __forceinline__ void kiln_flash_pipeline(unsigned tiles, const Load& load, const Step& step) {
    for (unsigned it = 0; it < tiles; ++it) {
        if (it + 1 < tiles) {
            load(it + 1);
            kiln_cp_async_wait<1>();
        } else {
            kiln_cp_async_wait<0>();
        }
        __syncthreads();  // tile it in shared memory
        step(it);
        __syncthreads();  // its buffer is free for tile it + 2
    }
}

// One tile of KEYS keys (a multiple of 16) for the warp's rows: `qa` the rows' A fragments (HD / 16
// steps of 16 dimensions), `k_t` / `v_t` the tile's K and V rows (swizzled, KEYS rows each).
// `score(r, key, qk)` gives the score of row r (0: g, 1: g + 8) for key `key` of the tile from
// its raw product qk (scaled, biased; −inf drops the key). Then, as FlashAttention-2:
// 1. S = Q·Kᵀ (m16n8k16, f32 accumulators, K rows as the B operand through ldmatrix);
// 2. the rows' online softmax (a row's values lie on the 4 lanes of a quad);
// 3. O += P·V, P straight from the score fragments (the C layout of two 8-key tiles is the A
//    layout of one 16-key step), split into its 16-bit rounding and the rest (two mma's: about
//    22 bits of each weight), V rows as B through ldmatrix.trans.
// Every lane of the warp calls it.
template <typename Tag, int HD, int KEYS, typename Score>
__device__ __forceinline__ void kiln_flash_tile(kiln_flash_rows<HD>& f, const unsigned (&qa)[HD / 16][4],
                                                const uint4* k_t, const uint4* v_t, Score score) {
    constexpr unsigned VPR = HD / 8, KS = HD / 16, NT = HD / 8;
    const float neg_inf = -__int_as_float(0x7f800000);
    const unsigned lane = threadIdx.x & 31u, q2 = (lane & 3u) * 2;
    // 1. n-tile nt is keys 8·nt …; ldmatrix x4 gives the B fragments of two n-tiles (matrix i:
    // keys 16·p + 8·(i >> 1), dimensions 16·s + 8·(i & 1)).
    float sc[KEYS / 8][4];
#pragma unroll
    for (unsigned nt = 0; nt < KEYS / 8; ++nt)
#pragma unroll
        for (unsigned i = 0; i < 4; ++i) sc[nt][i] = 0.f;
#pragma unroll
    for (unsigned s = 0; s < KS; ++s)
#pragma unroll
        for (unsigned p = 0; p < KEYS / 16; ++p) {
            unsigned kb[4];
            kiln_ldmatrix_x4<false>(kb,
                                    &k_t[kiln_swz(16 * p + (lane & 7u) + ((lane >> 4) << 3), 2 * s + ((lane >> 3) & 1u), VPR)]);
            kiln_mma16816<Tag>(sc[2 * p], qa[s][0], qa[s][1], qa[s][2], qa[s][3], kb[0], kb[1]);
            kiln_mma16816<Tag>(sc[2 * p + 1], qa[s][0], qa[s][1], qa[s][2], qa[s][3], kb[2], kb[3]);
        }
    // sc[nt][i] is row g + 8·(i >> 1), key 8·nt + q2 + (i & 1).
    float mx[2] = {neg_inf, neg_inf};
#pragma unroll
    for (unsigned nt = 0; nt < KEYS / 8; ++nt)
#pragma unroll
        for (unsigned i = 0; i < 4; ++i) {
            const unsigned r = i >> 1;
            const float x = score(r, 8 * nt + q2 + (i & 1u), sc[nt][i]);
            sc[nt][i] = x;
            mx[r] = fmaxf(mx[r], x);
        }
    // 2. The quad's maximum, the correction of the running sums.
    float corr[2];
#pragma unroll
    for (unsigned r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        const float m_new = fmaxf(f.m[r], mx[r]);
        corr[r] = f.m[r] == neg_inf ? 0.f : expf(f.m[r] - m_new);
        f.m[r] = m_new;
        f.l[r] *= corr[r];
    }
#pragma unroll
    for (unsigned nt = 0; nt < KEYS / 8; ++nt)
#pragma unroll
        for (unsigned i = 0; i < 4; ++i) {
            const unsigned r = i >> 1;
            const float p = sc[nt][i] == neg_inf ? 0.f : expf(sc[nt][i] - f.m[r]);
            sc[nt][i] = p;
            f.l[r] += p;
        }
#pragma unroll
    for (unsigned n = 0; n < NT; ++n) {
        f.o[n][0] *= corr[0];
        f.o[n][1] *= corr[0];
        f.o[n][2] *= corr[1];
        f.o[n][3] *= corr[1];
    }
    // 3. 16 keys a step: A from the score fragments of n-tiles 2·kt and 2·kt + 1, high and low
    // parts; B from V rows by ldmatrix.trans (matrix i: keys 16·kt + 8·(i & 1), dimensions
    // 8·(2·n2 + (i >> 1))).
#pragma unroll
    for (unsigned kt = 0; kt < KEYS / 16; ++kt) {
        unsigned ah[4], al[4];
#pragma unroll
        for (unsigned i = 0; i < 4; ++i) {
            const float* c = &sc[2 * kt + (i >> 1)][(i & 1u) * 2];
            const float h0 = kiln_to_f32(Tag(), kiln_from_f32(Tag(), c[0]));
            const float h1 = kiln_to_f32(Tag(), kiln_from_f32(Tag(), c[1]));
            ah[i] = kiln_pack2<Tag>(h0, h1);
            al[i] = kiln_pack2<Tag>(c[0] - h0, c[1] - h1);
        }
#pragma unroll
        for (unsigned n2 = 0; n2 < NT / 2; ++n2) {
            unsigned vb[4];
            kiln_ldmatrix_x4<true>(vb,
                                   &v_t[kiln_swz(16 * kt + (lane & 7u) + (((lane >> 3) & 1u) << 3), 2 * n2 + (lane >> 4), VPR)]);
            kiln_mma16816<Tag>(f.o[2 * n2], ah[0], ah[1], ah[2], ah[3], vb[0], vb[1]);
            kiln_mma16816<Tag>(f.o[2 * n2], al[0], al[1], al[2], al[3], vb[0], vb[1]);
            kiln_mma16816<Tag>(f.o[2 * n2 + 1], ah[0], ah[1], ah[2], ah[3], vb[2], vb[3]);
            kiln_mma16816<Tag>(f.o[2 * n2 + 1], al[0], al[1], al[2], al[3], vb[2], vb[3]);
        }
    }
}

// Sums each row's weight over its quad (the rows' full sums in f.l); every lane calls it once,
// after the last tile.
template <int HD>
__device__ __forceinline__ void kiln_flash_finish(kiln_flash_rows<HD>& f) {
#pragma unroll
    for (unsigned r = 0; r < 2; ++r) {
        f.l[r] += __shfl_xor_sync(0xffffffffu, f.l[r], 1);
        f.l[r] += __shfl_xor_sync(0xffffffffu, f.l[r], 2);
    }
}

// Writes row r (0: g, 1: g + 8) of the warp's O times `inv` to `dst` (the row's HD elements, two
// per store: 4-byte aligned).
template <typename Tag, int HD>
__device__ __forceinline__ void kiln_flash_store_row(const kiln_flash_rows<HD>& f, unsigned r,
                                                     typename Tag::storage* dst, float inv) {
    const unsigned q2 = (threadIdx.x & 3u) * 2;
#pragma unroll
    for (unsigned n = 0; n < HD / 8; ++n)
        *(unsigned*)(dst + 8 * n + q2) = kiln_pack2<Tag>(f.o[n][2 * r] * inv, f.o[n][2 * r + 1] * inv);
}

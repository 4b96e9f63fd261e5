// kiln-quant CUDA kernels: MatMulNBits (GEMV with in-register dequantization, dequantize to a
// weight matrix for the GEMM path, bias fill) and GatherBlockQuantized. Semantics follow the
// CPU reference in shim/src/lib.rs. Argument order matches the shim's `launch` calls exactly.
#include "kiln.cuh"
#include "kiln-cuda-std/vec.cuh"

// Zero-point kinds (shim: `Zp`).
#define ZP_DEFAULT 0u
#define ZP_PACKED 1u
#define ZP_FLOAT 2u

// Rows of A per GEMV tile (accumulators in registers).
#define MNB_TILE_M 8

// Zero point of block `blk` of weight row `n`.
template <typename Tag>
__device__ __forceinline__ float mnb_zero(const unsigned char* zp_u8, const typename Tag::storage* zp_f, unsigned zp_kind,
                                          kiln_u64 n, unsigned blk, unsigned kb, unsigned bits, unsigned zp_row) {
    if (zp_kind == ZP_PACKED) {
        unsigned per = 8u / bits;
        unsigned mask = (1u << bits) - 1u;
        return (float)((zp_u8[n * zp_row + blk / per] >> ((blk % per) * bits)) & mask);
    }
    if (zp_kind == ZP_FLOAT) return kiln_to_f32(Tag(), zp_f[n * kb + blk]);
    return (float)(1u << (bits - 1));
}

// Y[m, n] = Σ_k A[m, k] · (q[n, k] − z) · s + bias[n], for rows m of tile blockIdx.y (MNB_TILE_M
// rows), one warp per column n (blockDim.x / 32 columns per block). Each lane reads 32-bit words
// of the packed row (a word never straddles a quantization block: block_size·bits/8 is a
// multiple of 4 bytes), dequantizes them in registers and accumulates in f32.
// `g_idx` (has_gidx): the block of element k is g_idx[k] (out-of-range entries contribute 0).
template <typename Tag>
__device__ void mnb_gemv(const typename Tag::storage* A, const unsigned* B, const typename Tag::storage* scales,
                         const unsigned char* zp_u8, const typename Tag::storage* zp_f, const int* g_idx,
                         const typename Tag::storage* bias, typename Tag::storage* Y, kiln_u64 M, unsigned N, unsigned K,
                         unsigned block, unsigned bits, unsigned kb, unsigned zp_kind, unsigned zp_row,
                         unsigned has_gidx, unsigned has_bias) {
    const unsigned lane = threadIdx.x & 31u;
    const kiln_u64 n = (kiln_u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (n >= N) return;
    const kiln_u64 m0 = (kiln_u64)blockIdx.y * MNB_TILE_M;
    const unsigned rows = (unsigned)(M - m0 < MNB_TILE_M ? M - m0 : MNB_TILE_M);
    const unsigned per_word = 32u / bits;
    const unsigned mask = (1u << bits) - 1u;
    const unsigned words = kb * block * bits / 32u;  // 32-bit words per weight row
    const unsigned* row = B + n * words;
    const bool aligned = kiln_aligned(B, 4);
    float acc[MNB_TILE_M];
#pragma unroll
    for (int r = 0; r < MNB_TILE_M; ++r) acc[r] = 0.f;

    for (unsigned w = lane; w < words; w += 32u) {
        const unsigned k0 = w * per_word;
        if (k0 >= K) break;
        unsigned word;
        if (aligned) {
            word = __ldg(row + w);
        } else {  // A packed tensor at an offset that is not a multiple of 4 bytes.
            const unsigned char* p = (const unsigned char*)(row + w);
            word = p[0] | (p[1] << 8) | (p[2] << 16) | ((unsigned)p[3] << 24);
        }
        float s = 0.f, z = 0.f;
        if (!has_gidx) {
            const unsigned blk = k0 / block;
            s = kiln_to_f32(Tag(), scales[n * kb + blk]);
            z = mnb_zero<Tag>(zp_u8, zp_f, zp_kind, n, blk, kb, bits, zp_row);
        }
        for (unsigned e = 0; e < per_word; ++e) {
            const unsigned k = k0 + e;
            if (k >= K) break;
            float wv;
            const float q = (float)((word >> (e * bits)) & mask);
            if (has_gidx) {
                const int g = g_idx[k];
                if (g < 0 || (unsigned)g >= kb) continue;
                wv = (q - mnb_zero<Tag>(zp_u8, zp_f, zp_kind, n, (unsigned)g, kb, bits, zp_row)) *
                     kiln_to_f32(Tag(), scales[n * kb + g]);
            } else {
                wv = (q - z) * s;
            }
#pragma unroll
            for (int r = 0; r < MNB_TILE_M; ++r)
                if (r < (int)rows) acc[r] += kiln_to_f32(Tag(), A[(m0 + r) * K + k]) * wv;
        }
    }
    const float b = has_bias ? kiln_to_f32(Tag(), bias[n]) : 0.f;
#pragma unroll
    for (int r = 0; r < MNB_TILE_M; ++r) {
        const float v = kiln_warp_sum(acc[r]);
        if (lane == 0 && r < (int)rows) Y[(m0 + r) * N + n] = kiln_from_f32(Tag(), v + b);
    }
}

// W[n, k] = (q[n, k] − z) · s for k < K (row-major N × K, A's dtype): the weight matrix of the
// GEMM path. Grid-stride over N · K.
template <typename Tag>
__device__ void mnb_dequant(const unsigned char* B, const typename Tag::storage* scales, const unsigned char* zp_u8,
                            const typename Tag::storage* zp_f, const int* g_idx, typename Tag::storage* W, unsigned N,
                            unsigned K, unsigned block, unsigned bits, unsigned kb, unsigned zp_kind, unsigned zp_row,
                            unsigned has_gidx) {
    const unsigned per = 8u / bits;
    const unsigned mask = (1u << bits) - 1u;
    const kiln_u64 row_bytes = (kiln_u64)kb * block * bits / 8u;
    KILN_FOR(i, (kiln_u64)N * K) {
        const kiln_u64 n = i / K;
        const unsigned k = (unsigned)(i % K);
        const float q = (float)((B[n * row_bytes + k / per] >> ((k % per) * bits)) & mask);
        unsigned blk = k / block;
        float v = 0.f;
        bool ok = true;
        if (has_gidx) {
            const int g = g_idx[k];
            ok = g >= 0 && (unsigned)g < kb;
            blk = ok ? (unsigned)g : 0u;
        }
        if (ok)
            v = (q - mnb_zero<Tag>(zp_u8, zp_f, zp_kind, n, blk, kb, bits, zp_row)) *
                kiln_to_f32(Tag(), scales[n * kb + blk]);
        W[i] = kiln_from_f32(Tag(), v);
    }
}

// Y[m, n] = bias[n] (has_bias) or 0: an omitted projection or K = 0.
template <typename Tag>
__device__ void mnb_fill(const typename Tag::storage* bias, typename Tag::storage* Y, kiln_u64 total, unsigned N,
                         unsigned has_bias) {
    KILN_FOR(i, total) { Y[i] = kiln_from_f32(Tag(), has_bias ? kiln_to_f32(Tag(), bias[i % N]) : 0.f); }
}

// GatherBlockQuantized, uint8 data (bits 2/4 packed along the last axis, low bits first, or 8),
// gather axis 0: out[i, e] = (q − zp) · scale for index i and element e of a gathered row.
// Out-of-range indices give zeros. Mirrors `GbqPlan::run`.
template <typename Tag>
__device__ void gbq(const unsigned char* data, const void* indices, const typename Tag::storage* scales,
                    const unsigned char* zp, typename Tag::storage* out, kiln_u64 total, kiln_u64 rows,
                    kiln_u64 row_len, kiln_u64 q_dim, kiln_u64 q_inner, kiln_u64 q_blocks, unsigned block,
                    unsigned bits, unsigned has_zp, unsigned idx64) {
    const unsigned comps = 8u / bits;
    const unsigned mask = (1u << bits) - 1u;
    const kiln_u64 zp_row = (q_blocks + comps - 1) / comps;
    KILN_FOR(o, total) {
        const kiln_u64 which = o / row_len;
        const kiln_u64 e = o % row_len;
        long long idx = idx64 ? ((const long long*)indices)[which] : (long long)((const int*)indices)[which];
        const long long g = (long long)rows;
        float v = 0.f;
        if (idx >= -g && idx < g) {
            const kiln_u64 row = (kiln_u64)(idx < 0 ? idx + g : idx);
            const kiln_u64 i = row * row_len + e;
            const int q = (int)((data[i / comps] >> ((i % comps) * bits)) & mask);
            const kiln_u64 x = i / (q_dim * q_inner);
            const kiln_u64 y = (i / q_inner) % q_dim;
            const kiln_u64 z = i % q_inner;
            const kiln_u64 s = (x * q_blocks + y / block) * q_inner + z;
            int zpv;
            if (!has_zp) {
                zpv = 1 << (bits - 1);
            } else if (comps > 1) {
                const kiln_u64 zr = s / q_blocks, zb = s % q_blocks;
                zpv = (int)((zp[zr * zp_row + zb / comps] >> ((zb % comps) * bits)) & mask);
            } else {
                zpv = (int)zp[s];
            }
            v = (float)(q - zpv) * kiln_to_f32(Tag(), scales[s]);
        }
        out[o] = kiln_from_f32(Tag(), v);
    }
}

// The kernels, one template each over the prelude's dtype tag (kiln_tag_f32, kiln_tag_f16,
// kiln_tag_bf16): kernel.toml lists their instantiations by name expression (schema 6), and the
// shim names them with DType::cuda_tag.
template <typename Tag>
__global__ void kiln_mnb_gemv(const typename Tag::storage* A, const unsigned* B, const typename Tag::storage* scales,
                              const unsigned char* zp_u8, const typename Tag::storage* zp_f, const int* g_idx,
                              const typename Tag::storage* bias, typename Tag::storage* Y, kiln_u64 M, unsigned N,
                              unsigned K, unsigned block, unsigned bits, unsigned kb, unsigned zp_kind,
                              unsigned zp_row, unsigned has_gidx, unsigned has_bias) {
    mnb_gemv<Tag>(A, B, scales, zp_u8, zp_f, g_idx, bias, Y, M, N, K, block, bits, kb, zp_kind, zp_row, has_gidx,
                  has_bias);
}

template <typename Tag>
__global__ void kiln_mnb_dequant(const unsigned char* B, const typename Tag::storage* scales,
                                 const unsigned char* zp_u8, const typename Tag::storage* zp_f, const int* g_idx,
                                 typename Tag::storage* W, unsigned N, unsigned K, unsigned block, unsigned bits,
                                 unsigned kb, unsigned zp_kind, unsigned zp_row, unsigned has_gidx) {
    mnb_dequant<Tag>(B, scales, zp_u8, zp_f, g_idx, W, N, K, block, bits, kb, zp_kind, zp_row, has_gidx);
}

template <typename Tag>
__global__ void kiln_mnb_fill(const typename Tag::storage* bias, typename Tag::storage* Y, kiln_u64 total, unsigned N,
                              unsigned has_bias) {
    mnb_fill<Tag>(bias, Y, total, N, has_bias);
}

template <typename Tag>
__global__ void kiln_gbq(const unsigned char* data, const void* indices, const typename Tag::storage* scales,
                         const unsigned char* zp, typename Tag::storage* out, kiln_u64 total, kiln_u64 rows,
                         kiln_u64 row_len, kiln_u64 q_dim, kiln_u64 q_inner, kiln_u64 q_blocks, unsigned block,
                         unsigned bits, unsigned has_zp, unsigned idx64) {
    gbq<Tag>(data, indices, scales, zp, out, total, rows, row_len, q_dim, q_inner, q_blocks, block, bits, has_zp,
             idx64);
}

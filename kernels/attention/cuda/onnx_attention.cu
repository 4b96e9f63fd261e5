// kiln-attention CUDA kernels of ONNX's Attention-23/24 (shim/src/onnx_attention.rs holds the CPU
// reference and the semantics, after ONNX 1.20's node tests): the present K/V concatenation
// and the attention itself. Argument order matches the shim's `launch` calls exactly.
//
// Every tensor is seen 4-D, [B, heads, S, head size]: 4-D inputs are that already; 3-D inputs
// [B, S, heads · head size] (`three_d`) are the same elements through other strides.
#include "kiln.cuh"
#include "kiln-cuda-std/async.cuh"
#include "kiln-cuda-std/flash.cuh"
#include "kiln-cuda-std/vec.cuh"

// Largest head size (Q/K and V): each lane holds ceil(head / 32) ≤ 8 elements.
#define ATT_MAX_CHUNKS 8
#define ATT_WARPS 4

// Element strides (batch, head, sequence) of a [B, heads, S, hs] tensor stored 4-D, or 3-D as
// rows of `rs` elements whose first heads · hs are [heads, hs] (rs = heads · hs, or wider: a
// column block of packed [Q | K | V] rows).
struct att_strides {
    kiln_u64 b, h, s;
};

__device__ __forceinline__ att_strides att_layout(bool three_d, unsigned heads, unsigned seq, unsigned hs,
                                                  kiln_u64 rs) {
    return three_d ? att_strides{(kiln_u64)seq * rs, hs, rs}
                   : att_strides{(kiln_u64)heads * seq * hs, (kiln_u64)seq * hs, hs};
}

// present [B, Nkv, P + S, hs] = past [B, Nkv, P, hs] (when P > 0) followed by the new rows
// `src` (4-D, or 3-D with three_d), one thread per present element (grid-stride).
template <typename Tag>
__global__ void kiln_attention_present(const typename Tag::storage* past, const typename Tag::storage* src,
                                       typename Tag::storage* present, kiln_u64 total, unsigned Nkv, unsigned P,
                                       unsigned S, unsigned hs, unsigned three_d) {
    const att_strides ls = att_layout(three_d != 0, Nkv, S, hs, (kiln_u64)Nkv * hs);
    const unsigned T = P + S;
    KILN_FOR(i, total) {
        const unsigned d = (unsigned)(i % hs);
        const kiln_u64 r = i / hs;
        const unsigned t = (unsigned)(r % T);
        const kiln_u64 bj = r / T;
        const unsigned j = (unsigned)(bj % Nkv), b = (unsigned)(bj / Nkv);
        present[i] = t < P ? past[(bj * P + t) * hs + d] : src[b * ls.b + j * ls.h + (kiln_u64)(t - P) * ls.s + d];
    }
}

// The score of key t for query row (b, h, s) after the attention bias: qk (the scaled product)
// plus the mask (float, or bool: 0 / −inf; past its width −inf), the causal mask (key t after
// position P + s: −inf) and the padding mask (t ≥ nonpad_kv_seqlen[b]: −inf), in ONNX 1.20's
// order; then the softcap. `stage` gets qk_matmul_output's value for modes 0–2.
struct att_bias {
    const void* mask;
    const long long* nonpad;
    kiln_u64 mb, mh, ms;  // the mask's element strides (0 where it broadcasts)
    unsigned mode;        // 0 none, 1 float (the dtype of Q), 2 bool
    unsigned width;       // the mask's last dimension (≤ total)
    unsigned causal, P;
    float softcap;
};

// The attention bias of key t for query row (b, h, s): the mask, the causal and the padding masks.
template <typename Tag>
__device__ __forceinline__ float att_bias_at(const att_bias& a, unsigned b, unsigned h, unsigned s, unsigned t) {
    const float neg_inf = -__int_as_float(0x7f800000);
    float bias = 0.f;
    if (a.mode != 0) {
        const kiln_u64 at = b * a.mb + h * a.mh + s * a.ms + t;
        if (t >= a.width)
            bias = neg_inf;
        else if (a.mode == 1)
            bias = kiln_to_f32(Tag(), ((const typename Tag::storage*)a.mask)[at]);
        else
            bias = ((const unsigned char*)a.mask)[at] ? 0.f : neg_inf;
    }
    if (a.causal && t > a.P + s) bias += neg_inf;
    if (a.nonpad && (long long)t >= a.nonpad[b]) bias += neg_inf;
    return bias;
}

// The score from qk (the scaled product) and its bias (att_bias_at), then the softcap; `stage`
// gets qk_matmul_output's value for modes 0–2.
__device__ __forceinline__ float att_finish(float qk, float bias, const att_bias& a, unsigned qk_mode, float* stage) {
    float x = qk + bias;
    float st = qk_mode == 0 ? qk : x;
    if (a.softcap > 0.f) {
        x = a.softcap * tanhf(x / a.softcap);
        if (qk_mode == 2) st = x;
    }
    *stage = st;
    return x;
}

template <typename Tag>
__device__ __forceinline__ float att_score(float qk, const att_bias& a, unsigned b, unsigned h, unsigned s, unsigned t,
                                           unsigned qk_mode, float* stage) {
    return att_finish(qk, att_bias_at<Tag>(a, b, h, s, t), a, qk_mode, stage);
}

// The rows kiln_attention and kiln_attention_tiled read and write for query head h of batch row
// b (KV head j = h / (Nq / Nkv)): Q's and Y's row s, and row t of the present keys and values
// (t < P from the past [B, Nkv, P, head size], the others from K / V; three_d: 3-D inputs, rows of
// q_rs, k_rs and v_rs elements, and a 3-D Y).
template <typename Tag>
struct att_rows {
    typedef typename Tag::storage T;
    const T *q, *k, *v, *past_k, *past_v;
    T* y;
    att_strides lq, lk, lv, ly;
    unsigned Nkv, P, H, Hv, b, h, j;
    __device__ att_rows(const T* q_, const T* k_, const T* v_, const T* past_k_, const T* past_v_, T* y_, unsigned Nq,
                        unsigned Nkv_, unsigned Sq, unsigned Skv, unsigned P_, unsigned H_, unsigned Hv_, bool td,
                        kiln_u64 q_rs, kiln_u64 k_rs, kiln_u64 v_rs, unsigned b_, unsigned h_)
        : q(q_), k(k_), v(v_), past_k(past_k_), past_v(past_v_), y(y_), lq(att_layout(td, Nq, Sq, H_, q_rs)),
          lk(att_layout(td, Nkv_, Skv, H_, k_rs)), lv(att_layout(td, Nkv_, Skv, Hv_, v_rs)),
          ly(att_layout(td, Nq, Sq, Hv_, (kiln_u64)Nq * Hv_)), Nkv(Nkv_), P(P_), H(H_), Hv(Hv_), b(b_), h(h_),
          j(h_ / (Nq / Nkv_)) {}
    __device__ const T* query(unsigned s) const { return q + b * lq.b + h * lq.h + (kiln_u64)s * lq.s; }
    __device__ T* out(unsigned s) const { return y + b * ly.b + h * ly.h + (kiln_u64)s * ly.s; }
    __device__ const T* key(unsigned t) const {
        return t < P ? past_k + (((kiln_u64)b * Nkv + j) * P + t) * H : k + b * lk.b + j * lk.h + (t - P) * lk.s;
    }
    __device__ const T* value(unsigned t) const {
        return t < P ? past_v + (((kiln_u64)b * Nkv + j) * P + t) * Hv : v + b * lv.b + j * lv.h + (t - P) * lv.s;
    }
};

// Attention for query row s = blockIdx.x, head h = blockIdx.y, batch row b = blockIdx.z:
// each warp keeps an online softmax over keys warp, warp + ATT_WARPS, … (a key's product is a
// warp reduction over the head), the warps merge through shared memory, and thread d writes
// Y[b, h, s, d]. Keys t < P come from the past, the others from K/V (three_d: 3-D inputs, rows of
// q_rs, k_rs and v_rs elements).
// Query head h reads KV head h / (Nq / Nkv). qk (has_qk) gets qk_matmul_output [B, Nq, Sq, T]
// in mode qk_mode (3: the softmax, in a second pass). A row whose keys are all masked gives NaN
// (0 / 0), as ONNX's reference softmax does.
template <typename Tag>
__global__ void __launch_bounds__(ATT_WARPS * 32)
    kiln_attention(const typename Tag::storage* q, const typename Tag::storage* k, const typename Tag::storage* v,
                   const typename Tag::storage* past_k, const typename Tag::storage* past_v, const void* mask,
                   const long long* nonpad, typename Tag::storage* y, typename Tag::storage* qk, unsigned Nq,
                   unsigned Nkv, unsigned Sq, unsigned Skv, unsigned P, unsigned H, unsigned Hv, unsigned three_d,
                   kiln_u64 q_rs, kiln_u64 k_rs, kiln_u64 v_rs, kiln_u64 mb, kiln_u64 mh, kiln_u64 ms, unsigned mask_mode, unsigned mask_width, unsigned causal,
                   unsigned has_nonpad, float scale, float softcap, unsigned has_qk, unsigned qk_mode) {
    typedef typename Tag::storage T;
    __shared__ float q_s[ATT_MAX_CHUNKS * 32];
    __shared__ float s_m[ATT_WARPS], s_l[ATT_WARPS];
    __shared__ float s_acc[ATT_WARPS][ATT_MAX_CHUNKS * 32];
    const float neg_inf = -__int_as_float(0x7f800000);
    const unsigned s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned Tn = P + Skv;
    const att_rows<Tag> rw(q, k, v, past_k, past_v, y, Nq, Nkv, Sq, Skv, P, H, Hv, three_d != 0, q_rs, k_rs, v_rs, b, h);
    const att_bias a{mask, has_nonpad ? nonpad : nullptr, mb, mh, ms, mask_mode, mask_width, causal, P, softcap};
    for (unsigned d = threadIdx.x; d < H; d += blockDim.x) q_s[d] = kiln_to_f32(Tag(), rw.query(s)[d]);
    __syncthreads();
    const auto product = [&](unsigned t) {
        const T* kr = rw.key(t);
        float dot = 0.f;
        for (unsigned d = lane; d < H; d += 32) dot += q_s[d] * kiln_to_f32(Tag(), kr[d]);
        return kiln_warp_sum(dot) * scale;
    };
    typename Tag::storage* qk_row = has_qk ? qk + (((kiln_u64)b * Nq + h) * Sq + s) * Tn : nullptr;
    float m = neg_inf, l = 0.f, acc[ATT_MAX_CHUNKS];
#pragma unroll
    for (int c = 0; c < ATT_MAX_CHUNKS; ++c) acc[c] = 0.f;
    for (unsigned t = warp; t < Tn; t += ATT_WARPS) {
        float stage;
        const float x = att_score<Tag>(product(t), a, b, h, s, t, qk_mode, &stage);
        if (qk_row && qk_mode < 3 && lane == 0) qk_row[t] = kiln_from_f32(Tag(), stage);
        if (x == neg_inf) continue;  // weight 0 (and no −inf − −inf)
        const float m2 = fmaxf(m, x), c = expf(m - m2), p = expf(x - m2);
        const T* vr = rw.value(t);
        l = l * c + p;
#pragma unroll
        for (int i = 0; i < ATT_MAX_CHUNKS; ++i) {
            const unsigned d = lane + 32 * i;
            if (d < Hv) acc[i] = acc[i] * c + p * kiln_to_f32(Tag(), vr[d]);
        }
        m = m2;
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < ATT_MAX_CHUNKS; ++i)
        if (lane + 32 * i < Hv) s_acc[warp][lane + 32 * i] = acc[i];
    __syncthreads();
    float M = neg_inf;
    for (unsigned w = 0; w < ATT_WARPS; ++w)
        if (s_l[w] > 0.f) M = fmaxf(M, s_m[w]);
    float L = 0.f;
    for (unsigned w = 0; w < ATT_WARPS; ++w)
        if (s_l[w] > 0.f) L += s_l[w] * expf(s_m[w] - M);
    for (unsigned d = threadIdx.x; d < Hv; d += blockDim.x) {
        float o = 0.f;
        for (unsigned w = 0; w < ATT_WARPS; ++w)
            if (s_l[w] > 0.f) o += s_acc[w][d] * expf(s_m[w] - M);
        rw.out(s)[d] = kiln_from_f32(Tag(), Tn == 0 ? 0.f : o / L);  // no key: 0, as the CPU
    }
    if (qk_row && qk_mode == 3)
        for (unsigned t = warp; t < Tn; t += ATT_WARPS) {
            float stage;
            const float x = att_score<Tag>(product(t), a, b, h, s, t, qk_mode, &stage);
            if (lane == 0) qk_row[t] = kiln_from_f32(Tag(), (x == neg_inf ? 0.f : expf(x - M)) / L);
        }
}

// Attention over tiles on CUDA cores (the shim takes it where the tensor-core kernel does not
// and there is no qk_matmul_output, head sizes up to ATT_TILE_MAX_HEAD, and the tiles make at
// least 256 blocks: float32 above all, where TF32 is not allowed). Block (query tile, h, b) takes
// ATT_TILE_ROWS query rows of head h, batch row b, and walks the keys in tiles of ATT_TILE_KEYS
// whose K and V rows (as float) it stages in shared memory, so that each key row is read once
// per block (att_stage_t and the V loop: batches of four 4-element groups a thread, every load of
// a batch issued before its stores; the tile's mask terms are loaded before its products, so
// their latency hides behind them). Under __launch_bounds__(128, 3), 3 blocks share an SM at head
// size 64 (167 registers, sm_90). The products are register tiles, as a SIMT GEMM's: thread (ty, tx) = (tid / 8,
// tid % 8) owns query rows 4·ty … 4·ty + 3; it computes their scores against keys 4·tx … 4·tx + 3
// of the tile (per head element one float4 of Q and one of K for 16 products), merges the rows'
// online-softmax statistics with the other seven lanes of its rows (shuffles), and accumulates
// the rows' outputs d = 32·c + 4·tx … + 3 (one float4 of the weights and one of V per key and c).
// Scores, masks and outputs as kiln_attention (att_bias_at and att_finish; a row whose keys are all masked gives
// NaN, no key at all 0). Shared memory (dynamic), as float: Q transposed [H][ROWS + 4], K
// transposed [H][KEYS + 4], V [KEYS][Hv rounded up to 32] and the weights transposed
// [KEYS][ROWS + 4] (the + 4s keep float4 alignment and spread the transposing stores over
// banks); the shim sizes it (attention_tiled_shared_bytes).
#define ATT_TILE_ROWS 64
#define ATT_TILE_KEYS 32
#define ATT_TILE_THREADS 128
#define ATT_TILE_MAX_HEAD 128

// Four elements of a row at p (n of them there, zeros after) as float: one access of
// 4 · sizeof(T) bytes when `vec` (p aligned to that) and n ≥ 4, else element by element.
template <typename Tag>
__device__ __forceinline__ float4 att_ld4(const typename Tag::storage* p, unsigned n, bool vec) {
    typedef typename Tag::storage T;
    if (vec && n >= 4) {
        const kiln_vec<T, 4> w = *(const kiln_vec<T, 4>*)p;
        return make_float4(kiln_to_f32(Tag(), w.e[0]), kiln_to_f32(Tag(), w.e[1]), kiln_to_f32(Tag(), w.e[2]),
                           kiln_to_f32(Tag(), w.e[3]));
    }
    float e[4];
#pragma unroll
    for (unsigned i = 0; i < 4; ++i) e[i] = i < n ? kiln_to_f32(Tag(), p[i]) : 0.f;
    return make_float4(e[0], e[1], e[2], e[3]);
}

// Rows 0 … NR − 1 of a tile (row r at src(r) for r < valid, zeros after), H elements each, into
// dst transposed as float (dst[d · pitch + r]): thread tid takes row tid % NR and, per batch of
// 4 · (threads / NR) column groups of four, the four consecutive groups 4 · (tid / NR) …, all
// four loaded before any is stored (one memory latency a batch, not one an element); a warp
// stores 32 consecutive rows of one column, so the transposing stores hit 32 banks.
template <unsigned NR, typename Tag, typename Src>
__device__ __forceinline__ void att_stage_t(float* dst, unsigned pitch, unsigned H, unsigned valid, bool vec,
                                            Src src) {
    constexpr unsigned PER = ATT_TILE_THREADS / NR;
    const unsigned r = threadIdx.x % NR, q4 = 4 * (threadIdx.x / NR), groups = (H + 3) / 4;
    const typename Tag::storage* p = r < valid ? src(r) : nullptr;
    for (unsigned base = 0; base < groups; base += 4 * PER) {
        float4 w[4];
#pragma unroll
        for (unsigned j = 0; j < 4; ++j) {
            const unsigned g = base + q4 + j;
            w[j] = p && g < groups ? att_ld4<Tag>(p + 4 * g, H - 4 * g, vec) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (unsigned j = 0; j < 4; ++j) {
            const unsigned d = 4 * (base + q4 + j);
            const float e[4] = {w[j].x, w[j].y, w[j].z, w[j].w};
#pragma unroll
            for (unsigned i = 0; i < 4; ++i)
                if (d + i < H) dst[(d + i) * pitch + r] = e[i];
        }
    }
}

template <typename Tag>
__global__ void __launch_bounds__(ATT_TILE_THREADS, 3)
    kiln_attention_tiled(const typename Tag::storage* q, const typename Tag::storage* k,
                         const typename Tag::storage* v, const typename Tag::storage* past_k,
                         const typename Tag::storage* past_v, const void* mask, const long long* nonpad,
                         typename Tag::storage* y, typename Tag::storage* qk_unused, unsigned Nq, unsigned Nkv,
                         unsigned Sq, unsigned Skv, unsigned P, unsigned H, unsigned Hv, unsigned three_d,
                         kiln_u64 q_rs, kiln_u64 k_rs, kiln_u64 v_rs, kiln_u64 mb, kiln_u64 mh, kiln_u64 ms,
                         unsigned mask_mode, unsigned mask_width, unsigned causal, unsigned has_nonpad, float scale,
                         float softcap, unsigned has_qk_unused, unsigned qk_mode_unused) {
    constexpr unsigned R = ATT_TILE_ROWS, KT = ATT_TILE_KEYS, RP = R + 4, KP = KT + 4,
                       C = ATT_TILE_MAX_HEAD / 32;  // float4 column groups of the outputs, at most
    extern __shared__ __align__(16) float att_tile_smem[];
    const unsigned vp = (Hv + 31) / 32 * 32, groups = vp / 32;
    float* qs = att_tile_smem;  // [H][RP]
    float* ks = qs + H * RP;    // [H][KP]
    float* vs = ks + H * KP;    // [KT][vp]
    float* ps = vs + KT * vp;   // [KT][RP]
    const float neg_inf = -__int_as_float(0x7f800000);
    const unsigned s0 = blockIdx.x * R, h = blockIdx.y, b = blockIdx.z;
    const unsigned tid = threadIdx.x, tx = tid & 7u, ty = tid >> 3;
    const unsigned Tn = P + Skv;
    const att_rows<Tag> rw(q, k, v, past_k, past_v, y, Nq, Nkv, Sq, Skv, P, H, Hv, three_d != 0, q_rs, k_rs, v_rs, b, h);
    const att_bias a{mask, has_nonpad ? nonpad : nullptr, mb, mh, ms, mask_mode, mask_width, causal, P, softcap};
    // Whole float4-sized accesses where every row start allows them.
    const unsigned vb = 4 * sizeof(typename Tag::storage);
    const bool vec = H % 4 == 0 && Hv % 4 == 0 && kiln_aligned(q, vb) && kiln_aligned(k, vb) && kiln_aligned(v, vb) &&
                     (P == 0 || (kiln_aligned(past_k, vb) && kiln_aligned(past_v, vb))) &&
                     (!three_d || (q_rs % 4 == 0 && k_rs % 4 == 0 && v_rs % 4 == 0));
    att_stage_t<R, Tag>(qs, RP, H, s0 < Sq ? Sq - s0 : 0, vec, [&](unsigned r) { return rw.query(s0 + r); });
    float o[4][4 * C];
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int i = 0; i < 4 * C; ++i) o[r][i] = 0.f;
    float m[4], l[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) m[r] = neg_inf, l[r] = 0.f;
    for (unsigned t0 = 0; t0 < Tn; t0 += KT) {
        __syncthreads();  // the last tile's K, V and weights are read (and Q written, the first time)
        att_stage_t<KT, Tag>(ks, KP, H, Tn - t0, vec, [&](unsigned r) { return rw.key(t0 + r); });
        // V as rows, four elements a thread: a warp reads whole rows, each batch of four loaded
        // before it is stored.
        const unsigned gv = vp / 4;
        for (unsigned i0 = tid; i0 < KT * gv; i0 += 4 * ATT_TILE_THREADS) {
            float4 w[4];
#pragma unroll
            for (unsigned j = 0; j < 4; ++j) {
                const unsigned i = i0 + j * ATT_TILE_THREADS, kk = i / gv, d = 4 * (i % gv);
                w[j] = i < KT * gv && t0 + kk < Tn && d < Hv ? att_ld4<Tag>(rw.value(t0 + kk) + d, Hv - d, vec)
                                                             : make_float4(0.f, 0.f, 0.f, 0.f);
            }
#pragma unroll
            for (unsigned j = 0; j < 4; ++j) {
                const unsigned i = i0 + j * ATT_TILE_THREADS;
                if (i < KT * gv) *(float4*)&vs[i / gv * vp + 4 * (i % gv)] = w[j];
            }
        }
        __syncthreads();
        // The tile's mask terms, loaded while the products run.
        float bias[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const unsigned s = s0 + 4 * ty + r, t = t0 + 4 * tx + c;
                bias[r][c] = t < Tn && s < Sq ? att_bias_at<Tag>(a, b, h, s, t) : 0.f;
            }
        float x[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int c = 0; c < 4; ++c) x[r][c] = 0.f;
#pragma unroll 4
        for (unsigned d = 0; d < H; ++d) {
            const float4 qv = *(const float4*)&qs[d * RP + 4 * ty];
            const float4 kv = *(const float4*)&ks[d * KP + 4 * tx];
            const float qa[4] = {qv.x, qv.y, qv.z, qv.w}, ka[4] = {kv.x, kv.y, kv.z, kv.w};
#pragma unroll
            for (int r = 0; r < 4; ++r)
#pragma unroll
                for (int c = 0; c < 4; ++c) x[r][c] = fmaf(qa[r], ka[c], x[r][c]);
        }
        float cr[4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const unsigned s = s0 + 4 * ty + r;
            float tm = neg_inf;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const unsigned t = t0 + 4 * tx + c;
                float stage;
                x[r][c] = t < Tn && s < Sq ? att_finish(x[r][c] * scale, bias[r][c], a, 0, &stage) : neg_inf;
                tm = fmaxf(tm, x[r][c]);
            }
            tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 1));
            tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 2));
            tm = fmaxf(tm, __shfl_xor_sync(0xffffffffu, tm, 4));
            const float m2 = fmaxf(m[r], tm);
            // Only −inf so far: nothing to rescale (and no −inf − −inf).
            cr[r] = m2 == neg_inf ? 1.f : expf(m[r] - m2);
            float ts = 0.f;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                x[r][c] = x[r][c] == neg_inf ? 0.f : expf(x[r][c] - m2);
                ts += x[r][c];
            }
            ts += __shfl_xor_sync(0xffffffffu, ts, 1);
            ts += __shfl_xor_sync(0xffffffffu, ts, 2);
            ts += __shfl_xor_sync(0xffffffffu, ts, 4);
            l[r] = l[r] * cr[r] + ts;
            m[r] = m2;
        }
#pragma unroll
        for (int c = 0; c < 4; ++c)
            *(float4*)&ps[(4 * tx + c) * RP + 4 * ty] = make_float4(x[0][c], x[1][c], x[2][c], x[3][c]);
        __syncwarp();  // the rows' weights, written by the eight lanes of their warp
#pragma unroll
        for (int r = 0; r < 4; ++r)
#pragma unroll
            for (int i = 0; i < 4 * C; ++i) o[r][i] *= cr[r];
#pragma unroll 2
        for (unsigned kk = 0; kk < KT; ++kk) {
            const float4 pv = *(const float4*)&ps[kk * RP + 4 * ty];
            const float pa[4] = {pv.x, pv.y, pv.z, pv.w};
#pragma unroll
            for (unsigned g = 0; g < C; ++g) {
                if (g >= groups) break;
                const float4 vv = *(const float4*)&vs[kk * vp + 32 * g + 4 * tx];
                const float va[4] = {vv.x, vv.y, vv.z, vv.w};
#pragma unroll
                for (int r = 0; r < 4; ++r)
#pragma unroll
                    for (int e = 0; e < 4; ++e) o[r][4 * g + e] = fmaf(pa[r], va[e], o[r][4 * g + e]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const unsigned s = s0 + 4 * ty + r;
        if (s >= Sq) continue;
#pragma unroll
        for (unsigned g = 0; g < C; ++g)
#pragma unroll
            for (unsigned e = 0; e < 4; ++e) {
                const unsigned d = 32 * g + 4 * tx + e;
                if (d < Hv) rw.out(s)[d] = kiln_from_f32(Tag(), Tn == 0 ? 0.f : o[r][4 * g + e] / l[r]);
            }
    }
}

// Tensor-core attention (the shim takes it for float16 / bfloat16, head sizes Q = V = HD of 64 or
// 128, no past, no softcap and no qk_matmul_output; 3-D rows of q_rs, k_rs, v_rs elements): block (query tile, h, b) takes ATT_MMA_ROWS
// query rows s0 … of head h, batch row b, 16 per warp, and walks keys 0 … in tiles of
// att_mma_keys(HD), each tile's K and V rows copied into shared memory (cp.async when Q, K and V
// are 16-byte aligned, the next tile's copies in flight while the warps work on this one), each
// tile through kiln-cuda-std's kiln_flash_tile (FlashAttention-2's step). A score is qk · scale
// plus att_score's bias (the mask, −inf past its width, the causal and padding masks); keys at
// or past nonpad_kv_seqlen[b], or after the block's last row (causal), are not read, and a warp
// skips a tile whose keys all come after its rows (causal).
// A row whose keys are all masked gives NaN and a row with no key at all 0, as kiln_attention.
#define ATT_MMA_ROWS 64
#define ATT_MMA_THREADS 128

// Keys per tile at head size HD: 64, and 32 at 128 (shared memory within the 48 KiB every device
// grants).
__host__ __device__ constexpr unsigned att_mma_keys(unsigned HD) { return HD > 64 ? 32 : 64; }

// Eight 16-bit elements from `src` (2-byte aligned) as one vector.
template <typename T>
__device__ __forceinline__ uint4 att_row8(const T* src) {
    union {
        uint4 v;
        T e[8];
    } u;
#pragma unroll
    for (int i = 0; i < 8; ++i) u.e[i] = src[i];
    return u.v;
}

template <typename Tag, int HD>
__global__ void __launch_bounds__(ATT_MMA_THREADS)
    kiln_attention_mma(const typename Tag::storage* q, const typename Tag::storage* k, const typename Tag::storage* v,
                       const void* mask, const long long* nonpad, typename Tag::storage* y, unsigned Nq, unsigned Nkv,
                       unsigned Sq, unsigned Skv, unsigned three_d, kiln_u64 q_rs, kiln_u64 k_rs, kiln_u64 v_rs,
                       kiln_u64 mb, kiln_u64 mh, kiln_u64 ms,
                       unsigned mask_mode, unsigned mask_width, unsigned causal, unsigned has_nonpad, float scale) {
    typedef typename Tag::storage T;
    constexpr unsigned VPR = HD / 8, KS = HD / 16, KEYS = att_mma_keys(HD);
    const float neg_inf = -__int_as_float(0x7f800000);
    extern __shared__ __align__(16) unsigned char att_dyn[];
    uint4* const q_s = (uint4*)att_dyn;            // [ATT_MMA_ROWS][VPR]
    uint4* const kv_s = q_s + ATT_MMA_ROWS * VPR;  // [2][K, V][KEYS][VPR]
    const unsigned s0 = blockIdx.x * ATT_MMA_ROWS, h = blockIdx.y, b = blockIdx.z;
    const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5, g = lane >> 2;
    const unsigned j = h / (Nq / Nkv);
    const bool td = three_d != 0;
    const att_strides lq = att_layout(td, Nq, Sq, HD, q_rs), lk = att_layout(td, Nkv, Skv, HD, k_rs),
                      lv = att_layout(td, Nkv, Skv, HD, v_rs), ly = att_layout(td, Nq, Sq, HD, (kiln_u64)Nq * HD);
    const unsigned rows = Sq - s0 < ATT_MMA_ROWS ? Sq - s0 : ATT_MMA_ROWS;
    // 16-byte copies when every row starts 16-byte aligned (at head sizes 64 and 128 the row
    // strides and packed offsets are multiples of 8 elements: only a base pointer can break it).
    const bool vec = (((kiln_u64)q | (kiln_u64)k | (kiln_u64)v | (q_rs * 2) | (k_rs * 2) | (v_rs * 2)) & 15u) == 0;
    const att_bias a{mask, has_nonpad ? nonpad : nullptr, mb, mh, ms, mask_mode, mask_width, causal, 0, 0.f};
    // The block's keys [0, hi): none at or past nonpad_kv_seqlen[b] or after its last row.
    unsigned hi = Skv;
    if (has_nonpad) hi = nonpad[b] <= 0 ? 0u : (nonpad[b] < (long long)hi ? (unsigned)nonpad[b] : hi);
    if (causal && s0 + rows < hi) hi = s0 + rows;
    // 1. The block's query rows (zeros past Sq), then each warp's 16 as A fragments.
    for (unsigned i = tid; i < ATT_MMA_ROWS * VPR; i += blockDim.x) {
        const unsigned r = i / VPR, u = i % VPR;
        uint4 x = make_uint4(0, 0, 0, 0);
        if (r < rows) {
            const T* src = q + b * lq.b + h * lq.h + (s0 + r) * lq.s + u * 8;
            x = vec ? *(const uint4*)src : att_row8(src);
        }
        q_s[kiln_swz(r, u, VPR)] = x;
    }
    // Tile `it` (keys KEYS·it …) into buffer it & 1; zeros past hi (a weight of 0 would not clear
    // NaN bits there).
    const auto load_tile = [&](unsigned it) {
        uint4* const k_t = kv_s + (it & 1u) * 2 * KEYS * VPR;
        uint4* const v_t = k_t + KEYS * VPR;
        const unsigned t0 = KEYS * it;
        for (unsigned i = tid; i < KEYS * VPR; i += blockDim.x) {
            const unsigned kk = i / VPR, u = i % VPR, at = kiln_swz(kk, u, VPR);
            if (t0 + kk < hi) {
                const T* const ks = k + b * lk.b + j * lk.h + (kiln_u64)(t0 + kk) * lk.s + u * 8;
                const T* const vs = v + b * lv.b + j * lv.h + (kiln_u64)(t0 + kk) * lv.s + u * 8;
                if (vec) {
                    kiln_cp_async16(&k_t[at], ks);
                    kiln_cp_async16(&v_t[at], vs);
                } else {
                    k_t[at] = att_row8(ks);
                    v_t[at] = att_row8(vs);
                }
            } else {
                k_t[at] = make_uint4(0, 0, 0, 0);
                v_t[at] = make_uint4(0, 0, 0, 0);
            }
        }
        kiln_cp_async_commit();
    };
    const unsigned tiles = (hi + KEYS - 1) / KEYS;
    if (tiles > 0) load_tile(0);
    __syncthreads();  // q_s
    unsigned qa[KS][4];
    kiln_flash_load_q<HD>(qa, q_s);
    kiln_flash_rows<HD> f;
    kiln_flash_init(f);
    kiln_flash_pipeline(tiles, load_tile, [&](unsigned it) {
        const uint4* const k_t = kv_s + (it & 1u) * 2 * KEYS * VPR;
        const unsigned t0 = KEYS * it;
        if (causal && t0 > s0 + 16 * warp + 15) return;  // every key of the tile after the warp's rows
        kiln_flash_tile<Tag, HD, KEYS>(f, qa, k_t, k_t + KEYS * VPR, [&](unsigned r, unsigned key, float qk) {
            const unsigned t = t0 + key, s = s0 + 16 * warp + g + 8 * r;
            if (t >= hi || s >= Sq) return neg_inf;  // past the keys read, or a row past Sq
            float stage;
            return att_score<Tag>(qk * scale, a, b, h, s, t, 0, &stage);
        });
    });
    kiln_flash_finish(f);
    const float nan = __int_as_float(0x7fc00000);
#pragma unroll
    for (unsigned r = 0; r < 2; ++r) {
        const unsigned row = 16 * warp + g + 8 * r;
        if (row >= rows) continue;
        const float inv = f.l[r] > 0.f ? 1.f / f.l[r] : (Skv == 0 ? 0.f : nan);
        kiln_flash_store_row<Tag, HD>(f, r, y + b * ly.b + h * ly.h + (s0 + row) * ly.s, inv);
    }
}

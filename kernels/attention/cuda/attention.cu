// kiln-attention CUDA kernels: GroupQueryAttention (present K/V write with rotary, then causal
// attention with online softmax) and RotaryEmbedding. Semantics follow the CPU reference in
// shim/src/lib.rs. Argument order matches the shim's `launch` calls exactly.
#include "kiln.cuh"
#include "kiln-cuda-std/async.cuh"
#include "kiln-cuda-std/cluster.cuh"
#include "kiln-cuda-std/flash.cuh"
#include "kiln-cuda-std/mma.cuh"
#include "kiln-cuda-std/reduce.cuh"

// Phase marks of the cluster decode kernel for bench/layer_probe.cu (-DLP_MARKS defines GQA_MARK to record
// the global timer of each block reaching mark i); nothing otherwise.
#ifndef GQA_MARK
#define GQA_MARK(i) \
    do {            \
    } while (0)
#endif

// The layer probe's hook for a grid-dependency wait after the cluster decode kernel's first
// loads (-DLP_ATTN_EARLY); nothing otherwise.
#ifndef GQA_EARLY_WAIT
#define GQA_EARLY_WAIT() ((void)0)
#endif

// Largest head size of the attention kernel: each lane holds ceil(H / 32) ≤ 8 elements.
#define GQA_MAX_CHUNKS 8
// Most warps per attention block.
#define GQA_MAX_WARPS 16
// Keys each warp has in flight at once in the attention loop.
#define GQA_KEYS 4

// Rotary element from its pair (xa, xb) and the position's cos and sin: the first of the pair
// (xa·c − xb·s) or the second (xa·s + xb·c), in f32.
__device__ __forceinline__ float rope_combine(float xa, float xb, float c, float s, bool first) {
    return first ? xa * c - xb * s : xa * s + xb * c;
}

// Where rope_elem reads element d's pair and its cos/sin entry: pair (a, b), cache column i,
// and whether d is the pair's first element.
__device__ __forceinline__ void rope_index(unsigned half, unsigned d, unsigned interleaved, unsigned* i, unsigned* a,
                                           unsigned* b, bool* first) {
    if (interleaved) {
        *i = d >> 1;
        *a = 2 * *i;
        *b = *a + 1;
        *first = (d & 1u) == 0;
    } else {
        *first = d < half;
        *i = *first ? d : d - half;
        *a = *i;
        *b = *i + half;
    }
}

// Rotated element d (< 2·half) of a head `x` at cache row `pos`, in f32. Positions outside the
// cache (the CPU reference fails the node) give NaN.
template <typename Tag>
__device__ __forceinline__ float rope_elem(const typename Tag::storage* x, const typename Tag::storage* cos_c,
                                           const typename Tag::storage* sin_c, long long pos, kiln_u64 cache_rows,
                                           unsigned half, unsigned d, unsigned interleaved) {
    if (pos < 0 || (kiln_u64)pos >= cache_rows) return __int_as_float(0x7fc00000);
    unsigned i, a, b;
    bool first;
    rope_index(half, d, interleaved, &i, &a, &b, &first);
    const float c = kiln_to_f32(Tag(), cos_c[(kiln_u64)pos * half + i]);
    const float s = kiln_to_f32(Tag(), sin_c[(kiln_u64)pos * half + i]);
    return rope_combine(kiln_to_f32(Tag(), x[a]), kiln_to_f32(Tag(), x[b]), c, s, first);
}

// Per batch row b: total valid length T_b = seqlens_k[b] + 1 and past length past_b.
__device__ __forceinline__ void gqa_row(const int* seqlens, unsigned b, unsigned S, unsigned first_prompt, long long* t_b,
                                        long long* past_b) {
    *t_b = (long long)seqlens[b] + 1;
    *past_b = first_prompt ? 0 : *t_b - (long long)S;
}

// Where element (b, j, t, 0) of a present K or V buffer lies, in elements from its start: batch
// row b, KV head j, position t, with positions in pages of 2^shift that lie `page` elements apart
// and H elements apart within a page (ABI.md §6.1.1 paged layouts: the host's paged KV cache, which
// kernel.toml's paged_inputs accept). A row-major [B, Nk, PL, H] buffer is row = Nk·PL·H,
// head = PL·H, page = 0, shift = 31 (every position in the first page).
struct gqa_layout {
    kiln_u64 row, head, page;
    unsigned shift;
};

__device__ __forceinline__ kiln_u64 gqa_at(const gqa_layout& lay, unsigned b, unsigned j, long long t, unsigned H) {
    const kiln_u64 u = (kiln_u64)t;
    return (kiln_u64)b * lay.row + (kiln_u64)j * lay.head + (u >> lay.shift) * lay.page +
           (u & ((1ull << lay.shift) - 1ull)) * H;
}

// The past row (b, j, t): in the present's layout when past and present have one length (one
// buffer bound in place, or a paged past, which the shim accepts only beside a present of its
// layout), else row-major [B, Nk, P, H].
__device__ __forceinline__ kiln_u64 gqa_past_at(const gqa_layout& lay, unsigned b, unsigned j, long long t, unsigned H,
                                                unsigned Nk, unsigned P, unsigned PL) {
    return P == PL ? gqa_at(lay, b, j, t, H) : (((kiln_u64)b * Nk + j) * P + (kiln_u64)t) * H;
}

// The B rows' sequence lengths and rotary positions against the CPU reference's checks, in its
// order (every row's length first, then the positions row by row), reported through the node's
// status record (ABI.md §7.5; the codes are kernel.toml's [[device_errors]]): 1 seqlens_k out of
// range, 2 more past rows than past_key holds (check_past: a past and present that are not one
// buffer), 3 a position outside the cos/sin caches. One thread of the node's first block calls
// it. The kernels never index outside their buffers either way (gqa_range clamps, rope_elem
// gives NaN).
__device__ __noinline__ void gqa_check(kiln_status* st, const int* seqlens, unsigned B, unsigned S,
                                       unsigned first_prompt, unsigned total, unsigned check_past, unsigned P,
                                       kiln_u64 cache_rows, unsigned rotary_half) {
    for (unsigned b = 0; b < B; ++b) {
        const long long sk = seqlens[b], t = sk + 1;
        const bool bad = first_prompt ? (t < 1 || t > (long long)S) : (t < (long long)S || t > (long long)total);
        if (bad) {
            kiln_fail(st, 1, b, sk, S, total);
            return;
        }
        const long long past_b = first_prompt ? 0 : t - (long long)S;
        if (check_past && past_b > (long long)P) {
            kiln_fail(st, 2, b, sk, past_b, P);
            return;
        }
    }
    if (rotary_half == 0) return;
    for (unsigned b = 0; b < B; ++b) {
        const long long past_b = first_prompt ? 0 : (long long)seqlens[b] + 1 - (long long)S;
        if (past_b + (long long)S > (long long)cache_rows) {
            kiln_fail(st, 3, past_b > (long long)cache_rows ? past_b : (long long)cache_rows, cache_rows);
            return;
        }
    }
}

// Writes the present K and V [B, Nk, PL, H] in layout `lay` (only the new rows when present is the past buffer
// itself, else every row): rows past_b .. past_b + S are the new keys
// (rotated at their position when rotary_half > 0, rounded to the dtype) and values; other rows
// are the past rows (shared buffer: every row; otherwise rows < past_b) or zeros.
// k_src/v_src rows are (b·S + s)·kv_w elements apart, head j at k_off + j·H (v_off + j·H).
template <typename Tag>
__device__ void gqa_kv(const typename Tag::storage* k_src, const typename Tag::storage* v_src,
                       const typename Tag::storage* past_k, const typename Tag::storage* past_v, const int* seqlens,
                       const typename Tag::storage* cos_c, const typename Tag::storage* sin_c,
                       typename Tag::storage* pres_k, typename Tag::storage* pres_v, unsigned B, unsigned S,
                       unsigned Nk, unsigned H, unsigned PL, unsigned P, kiln_u64 kv_w, kiln_u64 k_off, kiln_u64 v_off,
                       unsigned first_prompt, unsigned shared, kiln_u64 cache_rows, unsigned rotary_half,
                       unsigned interleaved, unsigned total, gqa_layout lay, kiln_status* st) {
    typedef typename Tag::storage T;
    if (blockIdx.x == 0 && threadIdx.x == 0)
        gqa_check(st, seqlens, B, S, first_prompt, total, !shared, P, cache_rows, rotary_half);
    // Past and present are one buffer (bound in place by the host): only the new rows change,
    // so only they are visited.
    if (shared && P == PL && pres_k == past_k && pres_v == past_v) {
        KILN_FOR(i, (kiln_u64)B * Nk * S * H) {
            const unsigned d = (unsigned)(i % H);
            const unsigned s = (unsigned)((i / H) % S);
            const unsigned j = (unsigned)((i / ((kiln_u64)H * S)) % Nk);
            const unsigned b = (unsigned)(i / ((kiln_u64)H * S * Nk));
            long long t_b, past_b;
            gqa_row(seqlens, b, S, first_prompt, &t_b, &past_b);
            const long long t = past_b + (long long)s;
            if (t < 0 || t >= (long long)PL) continue;
            const kiln_u64 row = ((kiln_u64)b * S + s) * kv_w;
            const T* kr = k_src + row + k_off + (kiln_u64)j * H;
            const kiln_u64 at = gqa_at(lay, b, j, t, H) + d;
            if (rotary_half > 0 && d < 2 * rotary_half)
                pres_k[at] = kiln_from_f32(Tag(), rope_elem<Tag>(kr, cos_c, sin_c, t, cache_rows, rotary_half, d, interleaved));
            else
                pres_k[at] = kr[d];
            pres_v[at] = v_src[row + v_off + (kiln_u64)j * H + d];
        }
        return;
    }
    KILN_FOR(i, (kiln_u64)B * Nk * PL * H) {
        const unsigned d = (unsigned)(i % H);
        const unsigned t = (unsigned)((i / H) % PL);
        const unsigned j = (unsigned)((i / ((kiln_u64)H * PL)) % Nk);
        const unsigned b = (unsigned)(i / ((kiln_u64)H * PL * Nk));
        long long t_b, past_b;
        gqa_row(seqlens, b, S, first_prompt, &t_b, &past_b);
        // A paged present maps only the positions below each row's length: none past them.
        if (lay.page != 0 && (long long)t >= t_b) continue;
        const long long s = (long long)t - past_b;
        T kv = 0, vv = 0;
        if (s >= 0 && s < (long long)S) {
            const kiln_u64 row = ((kiln_u64)b * S + (kiln_u64)s) * kv_w;
            const T* kr = k_src + row + k_off + (kiln_u64)j * H;
            if (rotary_half > 0 && d < 2 * rotary_half)
                kv = kiln_from_f32(Tag(), rope_elem<Tag>(kr, cos_c, sin_c, (long long)t, cache_rows, rotary_half, d,
                                                         interleaved));
            else
                kv = kr[d];
            vv = v_src[row + v_off + (kiln_u64)j * H + d];
        } else if (P > 0 && t < P && (shared || (long long)t < past_b)) {
            const kiln_u64 src = gqa_past_at(lay, b, j, t, H, Nk, P, PL) + d;
            kv = past_k[src];
            vv = past_v[src];
        }
        const kiln_u64 at = gqa_at(lay, b, j, t, H) + d;
        pres_k[at] = kv;
        pres_v[at] = vv;
    }
}

// Element d of query row `qr` at position `pos` as the attention kernels use it: rotated (d <
// 2·rotary_half) and rounded to the storage type as the CPU reference rounds it, in f32.
template <typename Tag>
__device__ __forceinline__ float gqa_query_elem(const typename Tag::storage* qr, const typename Tag::storage* cos_c,
                                                const typename Tag::storage* sin_c, long long pos,
                                                kiln_u64 cache_rows, unsigned rotary_half, unsigned d,
                                                unsigned interleaved) {
    if (rotary_half > 0 && d < 2 * rotary_half)
        return kiln_to_f32(Tag(), kiln_from_f32(Tag(), rope_elem<Tag>(qr, cos_c, sin_c, pos, cache_rows, rotary_half,
                                                                      d, interleaved)));
    return kiln_to_f32(Tag(), qr[d]);
}

// The query row of head h at position pos, rotated (rotary_half > 0) and rounded to the dtype
// as the CPU reference does; lane holds elements d = lane + 32·c.
template <typename Tag>
__device__ __forceinline__ void gqa_query(const typename Tag::storage* qr, const typename Tag::storage* cos_c,
                                          const typename Tag::storage* sin_c, long long pos, kiln_u64 cache_rows,
                                          unsigned rotary_half, unsigned interleaved, unsigned H, unsigned lane,
                                          float* q) {
#pragma unroll
    for (int c = 0; c < GQA_MAX_CHUNKS; ++c) {
        const unsigned d = lane + 32u * c;
        q[c] = d < H ? gqa_query_elem<Tag>(qr, cos_c, sin_c, pos, cache_rows, rotary_half, d, interleaved) : 0.f;
    }
}

// Folds keys [lo, hi) of KV head j, batch row b (K/V row t at gqa_at(lay, b, j, t, H)) into an online
// softmax per warp (f32): warp w takes keys lo + w, lo + w + warps, …, GQA_KEYS at a time so
// the loads overlap. On return, after a __syncthreads, the block's state is merged: `*mx` is
// the largest score, `*den` = Σ e^(x − mx), and s_acc[0][d] = Σ e^(x − mx)·v[d] for d < H.
template <typename Tag>
__device__ void gqa_fold(const float* q, const typename Tag::storage* pk, const typename Tag::storage* pv,
                         const gqa_layout& lay, unsigned b, unsigned j, long long lo, long long hi, unsigned H,
                         float scale, float softcap,
                         const typename Tag::storage* bias_row, float (*s_acc)[GQA_MAX_CHUNKS * 32], float* s_m,
                         float* s_l, float* mx, float* den) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float acc[GQA_MAX_CHUNKS];
#pragma unroll
    for (int c = 0; c < GQA_MAX_CHUNKS; ++c) acc[c] = 0.f;
    float m = -__int_as_float(0x7f800000), l = 0.f;
    for (long long t0 = lo + warp; t0 < hi; t0 += (long long)warps * GQA_KEYS) {
        float x[GQA_KEYS];
        float v[GQA_KEYS][GQA_MAX_CHUNKS];
#pragma unroll
        for (int u = 0; u < GQA_KEYS; ++u) {
            const long long t = t0 + (long long)u * warps;
            const bool live = t < hi;
            const kiln_u64 at = gqa_at(lay, b, j, t, H);
            const typename Tag::storage* kr = pk + at;
            const typename Tag::storage* vr = pv + at;
            float dot = 0.f;
#pragma unroll
            for (int c = 0; c < GQA_MAX_CHUNKS; ++c) {
                const unsigned d = lane + 32u * c;
                const bool in = live && d < H;
                dot += in ? q[c] * kiln_to_f32(Tag(), kr[d]) : 0.f;
                v[u][c] = in ? kiln_to_f32(Tag(), vr[d]) : 0.f;
            }
            x[u] = dot;
        }
#pragma unroll
        for (int u = 0; u < GQA_KEYS; ++u) {
            const long long t = t0 + (long long)u * warps;
            float xu = kiln_warp_sum(x[u]) * scale;
            if (t >= hi) continue;
            if (softcap > 0.f) xu = softcap * tanhf(xu / softcap);
            if (bias_row) xu += kiln_to_f32(Tag(), bias_row[t]);
            if (xu == -__int_as_float(0x7f800000)) continue;  // exp(−inf) = 0: no weight.
            const float m_new = fmaxf(m, xu);
            const float corr = expf(m - m_new);  // m = −inf → 0
            const float p = expf(xu - m_new);
            l = l * corr + p;
#pragma unroll
            for (int c = 0; c < GQA_MAX_CHUNKS; ++c) acc[c] = acc[c] * corr + p * v[u][c];
            m = m_new;
        }
    }
    if (lane == 0) {
        s_m[warp] = m;
        s_l[warp] = l;
    }
#pragma unroll
    for (int c = 0; c < GQA_MAX_CHUNKS; ++c) s_acc[warp][lane + 32u * c] = acc[c];
    __syncthreads();
    // Merge: M = max over warps, L = Σ l_w·e^(m_w − M); acc likewise, into s_acc[0] (each d is
    // read and written by one thread only).
    float M = -__int_as_float(0x7f800000);
    for (unsigned w = 0; w < warps; ++w) M = fmaxf(M, s_m[w]);
    float L = 0.f;
    for (unsigned w = 0; w < warps; ++w)
        if (s_l[w] > 0.f) L += s_l[w] * expf(s_m[w] - M);
    for (unsigned d = threadIdx.x; d < H; d += blockDim.x) {
        float a = 0.f;
        for (unsigned w = 0; w < warps; ++w)
            if (s_l[w] > 0.f) a += s_acc[w][d] * expf(s_m[w] - M);
        s_acc[0][d] = a;
    }
    *mx = M;
    *den = L;
}

// The bias row of (b, h, s) over `total` keys, or null.
template <typename Tag>
__device__ __forceinline__ const typename Tag::storage* gqa_bias_row(const typename Tag::storage* bias,
                                                                     unsigned has_bias, unsigned bias_b,
                                                                     unsigned bias_h, unsigned b, unsigned h,
                                                                     unsigned s, unsigned S, unsigned total) {
    if (!has_bias) return 0;
    return bias + (((kiln_u64)(bias_b == 1 ? 0 : b) * bias_h + (bias_h == 1 ? 0 : h)) * S + s) * total;
}

// The key range [*start, *end) query row s of batch row b attends to (causal, window, clamped
// to the present length PL).
__device__ __forceinline__ void gqa_range(const int* seqlens, unsigned b, unsigned s, unsigned S,
                                          unsigned first_prompt, int window, unsigned PL, long long* start,
                                          long long* end, long long* pos) {
    long long t_b, past_b;
    gqa_row(seqlens, b, S, first_prompt, &t_b, &past_b);
    const long long causal = past_b + (long long)s + 1;
    long long st = (window >= 0 && causal > (long long)window) ? causal - window : 0;
    long long en = causal < t_b ? causal : t_b;
    if (st < 0) st = 0;
    if (en > (long long)PL) en = PL;
    *start = st;
    *end = en;
    *pos = past_b + (long long)s;
}

// Attention for query row s = blockIdx.x, head h = blockIdx.y, batch row b = blockIdx.z over the
// present K/V [B, Nk, PL, H]: one online softmax per warp (gqa_fold), merged through shared
// memory. sink_mode: 0 none, 1 smooth softmax (sink 0), 2 head_sink[h]. bias (has_bias):
// [bias_b, bias_h, S, total] broadcast over batch / heads when 1.
template <typename Tag>
__device__ void gqa_attn(const typename Tag::storage* q_src, const typename Tag::storage* pres_k,
                         const typename Tag::storage* pres_v, const int* seqlens, const typename Tag::storage* cos_c,
                         const typename Tag::storage* sin_c, const typename Tag::storage* bias,
                         const typename Tag::storage* sink, typename Tag::storage* out, unsigned S, unsigned N,
                         unsigned Nk, unsigned H, unsigned PL, kiln_u64 q_w, unsigned first_prompt, kiln_u64 cache_rows,
                         unsigned rotary_half, unsigned interleaved, float scale, float softcap, int window,
                         unsigned has_bias, unsigned bias_b, unsigned bias_h, unsigned total, unsigned sink_mode,
                         gqa_layout lay, kiln_status* st) {
    __shared__ float s_acc[GQA_MAX_WARPS][GQA_MAX_CHUNKS * 32];
    __shared__ float s_m[GQA_MAX_WARPS], s_l[GQA_MAX_WARPS];
    const unsigned s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    if (s == 0 && h == 0 && b == 0 && threadIdx.x == 0)
        gqa_check(st, seqlens, gridDim.z, S, first_prompt, total, 0, 0, cache_rows, rotary_half);
    const unsigned j = h / (N / Nk);
    long long start, end, pos;
    gqa_range(seqlens, b, s, S, first_prompt, window, PL, &start, &end, &pos);
    typename Tag::storage* o = out + ((kiln_u64)b * S + s) * ((kiln_u64)N * H) + (kiln_u64)h * H;
    if (start >= end) {
        for (unsigned d = threadIdx.x; d < H; d += blockDim.x) o[d] = kiln_from_f32(Tag(), 0.f);
        return;
    }
    float q[GQA_MAX_CHUNKS];
    gqa_query<Tag>(q_src + ((kiln_u64)b * S + s) * q_w + (kiln_u64)h * H, cos_c, sin_c, pos, cache_rows, rotary_half,
                   interleaved, H, threadIdx.x & 31u, q);
    float mx, den;
    gqa_fold<Tag>(q, pres_k, pres_v, lay, b, j, start, end, H, scale, softcap,
                  gqa_bias_row<Tag>(bias, has_bias, bias_b, bias_h, b, h, s, S, total), s_acc, s_m, s_l, &mx, &den);
    float sink_v = 0.f;
    if (sink_mode == 2) sink_v = kiln_to_f32(Tag(), sink[h]);
    if (sink_mode != 0) {
        const float m2 = fmaxf(mx, sink_v);
        const float a = expf(mx - m2);  // mx = −inf (no weight) → 0
        den = den * a + expf(sink_v - m2);
        for (unsigned d = threadIdx.x; d < H; d += blockDim.x) o[d] = kiln_from_f32(Tag(), s_acc[0][d] * a / den);
        return;
    }
    for (unsigned d = threadIdx.x; d < H; d += blockDim.x) o[d] = kiln_from_f32(Tag(), s_acc[0][d] / den);
}

// The keys [lo, hi) that any of query rows s0 … s0 + rows − 1 of batch row b attends to: the
// union of their gqa_range ranges (lo = PL, hi = 0 when none attends to a key).
__device__ __forceinline__ void gqa_rows_keys(const int* seqlens, unsigned b, unsigned s0, unsigned rows, unsigned S,
                                              unsigned first_prompt, int window, unsigned PL, long long* lo,
                                              long long* hi) {
    *lo = (long long)PL;
    *hi = 0;
    for (unsigned r = 0; r < rows; ++r) {
        long long a, e, p;
        gqa_range(seqlens, b, s0 + r, S, first_prompt, window, PL, &a, &e, &p);
        if (a < e) {
            *lo = a < *lo ? a : *lo;
            *hi = e > *hi ? e : *hi;
        }
    }
}

// Prompt attention by tiles (S > 1, no bias, softcap or sink; H ≤ GQA_PF_MAX_HEAD): block
// (query tile, h, b) takes GQA_PF_ROWS query rows s0 … of head h, batch row b, and folds the
// keys any of them attends to in tiles of GQA_PF_KEYS, each tile's K and V rows loaded once
// into shared memory (coalesced) for all the block's rows, as flash-attention tiles a prompt.
// Warp w owns rows w, w + GQA_PF_WARPS, …: for each, lane l scores key l of the tile (its
// causal and window range masked), the warp takes the tile's max and sum (shuffles) into the
// row's online softmax, and lane l sums weight·V for dimensions l, l + 32, …. Query rows are
// rotated and rounded as in gqa_attn, so the result is gqa_attn's up to f32 summation order.
#define GQA_PF_ROWS 16
#define GQA_PF_KEYS 32
#define GQA_PF_WARPS 4
#define GQA_PF_MAX_HEAD 128
#define GQA_PF_ROWS_PER_WARP (GQA_PF_ROWS / GQA_PF_WARPS)
#define GQA_PF_CHUNKS (GQA_PF_MAX_HEAD / 32)

template <typename Tag>
__device__ void gqa_prefill(const typename Tag::storage* q_src, const typename Tag::storage* pres_k,
                            const typename Tag::storage* pres_v, const int* seqlens,
                            const typename Tag::storage* cos_c, const typename Tag::storage* sin_c,
                            typename Tag::storage* out, unsigned S, unsigned N, unsigned Nk, unsigned H, unsigned PL,
                            kiln_u64 q_w, unsigned first_prompt, kiln_u64 cache_rows, unsigned rotary_half,
                            unsigned interleaved, float scale, int window, unsigned total, gqa_layout lay,
                            kiln_status* st) {
    typedef typename Tag::storage T;
    const float NEG_INF = -__int_as_float(0x7f800000);
    __shared__ float q_s[GQA_PF_ROWS][GQA_PF_MAX_HEAD];
    __shared__ float k_s[GQA_PF_KEYS][GQA_PF_MAX_HEAD + 1];  // +1: lanes read one key each, no bank conflicts
    __shared__ float v_s[GQA_PF_KEYS][GQA_PF_MAX_HEAD];
    __shared__ float p_s[GQA_PF_WARPS][GQA_PF_KEYS];
    const unsigned s0 = blockIdx.x * GQA_PF_ROWS, h = blockIdx.y, b = blockIdx.z;
    const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    if (blockIdx.x == 0 && h == 0 && b == 0 && tid == 0)
        gqa_check(st, seqlens, gridDim.z, S, first_prompt, total, 0, 0, cache_rows, rotary_half);
    const unsigned j = h / (N / Nk);
    const unsigned rows = S - s0 < GQA_PF_ROWS ? S - s0 : GQA_PF_ROWS;
    long long lo, hi;
    gqa_rows_keys(seqlens, b, s0, rows, S, first_prompt, window, PL, &lo, &hi);
    // 1. Query rows, rotated and rounded as gqa_query does.
    for (unsigned i = tid; i < rows * H; i += blockDim.x) {
        const unsigned r = i / H, d = i - r * H;
        long long a, e, pos;
        gqa_range(seqlens, b, s0 + r, S, first_prompt, window, PL, &a, &e, &pos);
        const T* qr = q_src + ((kiln_u64)b * S + s0 + r) * q_w + (kiln_u64)h * H;
        q_s[r][d] = gqa_query_elem<Tag>(qr, cos_c, sin_c, pos, cache_rows, rotary_half, d, interleaved);
    }
    // Each warp's rows: range, running max and sum, Σ weight·V for dimensions lane + 32·c.
    long long r_lo[GQA_PF_ROWS_PER_WARP], r_hi[GQA_PF_ROWS_PER_WARP];
    float m[GQA_PF_ROWS_PER_WARP], l[GQA_PF_ROWS_PER_WARP], acc[GQA_PF_ROWS_PER_WARP][GQA_PF_CHUNKS];
#pragma unroll
    for (int rr = 0; rr < GQA_PF_ROWS_PER_WARP; ++rr) {
        const unsigned r = warp + rr * GQA_PF_WARPS;
        long long p;
        r_lo[rr] = 0;
        r_hi[rr] = 0;
        if (r < rows) gqa_range(seqlens, b, s0 + r, S, first_prompt, window, PL, &r_lo[rr], &r_hi[rr], &p);
        m[rr] = NEG_INF;
        l[rr] = 0.f;
#pragma unroll
        for (int c = 0; c < GQA_PF_CHUNKS; ++c) acc[rr][c] = 0.f;
    }
    for (long long t0 = lo; t0 < hi; t0 += GQA_PF_KEYS) {
        __syncthreads();  // the previous tile is done with (and q_s written, the first time)
        // 2. The tile's K and V rows into shared memory, in f32.
        for (unsigned i = tid; i < GQA_PF_KEYS * H; i += blockDim.x) {
            const unsigned k = i / H, d = i - k * H;
            const long long t = t0 + k;
            const bool in = t < hi;
            const kiln_u64 at = gqa_at(lay, b, j, t, H) + d;
            k_s[k][d] = in ? kiln_to_f32(Tag(), pres_k[at]) : 0.f;
            v_s[k][d] = in ? kiln_to_f32(Tag(), pres_v[at]) : 0.f;
        }
        __syncthreads();
        // 3. Each of the warp's rows: lane = key.
#pragma unroll
        for (int rr = 0; rr < GQA_PF_ROWS_PER_WARP; ++rr) {
            const unsigned r = warp + rr * GQA_PF_WARPS;
            if (r >= rows || r_hi[rr] <= t0 || r_lo[rr] >= t0 + GQA_PF_KEYS) continue;  // warp-uniform
            const long long t = t0 + lane;
            float x = 0.f;
            for (unsigned d = 0; d < H; ++d) x += q_s[r][d] * k_s[lane][d];
            x = t >= r_lo[rr] && t < r_hi[rr] ? x * scale : NEG_INF;
            const float mt = kiln_warp_max(x);
            const float m_new = fmaxf(m[rr], mt);
            const float corr = m[rr] == NEG_INF ? 0.f : expf(m[rr] - m_new);
            const float p = x == NEG_INF ? 0.f : expf(x - m_new);
            l[rr] = l[rr] * corr + kiln_warp_sum(p);
            m[rr] = m_new;
            p_s[warp][lane] = p;
            __syncwarp();
#pragma unroll
            for (int c = 0; c < GQA_PF_CHUNKS; ++c) {
                const unsigned d = lane + 32u * c;
                if (d >= H) break;
                float a = 0.f;
#pragma unroll 8
                for (unsigned k = 0; k < GQA_PF_KEYS; ++k) a += p_s[warp][k] * v_s[k][d];
                acc[rr][c] = acc[rr][c] * corr + a;
            }
            __syncwarp();  // p_s is the next row's
        }
    }
    // 4. Out: acc / l (a row with no key gets zeros, as gqa_attn).
#pragma unroll
    for (int rr = 0; rr < GQA_PF_ROWS_PER_WARP; ++rr) {
        const unsigned r = warp + rr * GQA_PF_WARPS;
        if (r >= rows) continue;
        T* o = out + ((kiln_u64)b * S + s0 + r) * ((kiln_u64)N * H) + (kiln_u64)h * H;
#pragma unroll
        for (int c = 0; c < GQA_PF_CHUNKS; ++c) {
            const unsigned d = lane + 32u * c;
            if (d < H) o[d] = kiln_from_f32(Tag(), l[rr] > 0.f ? acc[rr][c] / l[rr] : 0.f);
        }
    }
}

// Split-K decode attention (flash-decoding), S = 1 and not a first prompt: block (split, h, b)
// folds keys [split·chunk, (split + 1)·chunk) ∩ [start, end) into a partial state in f32 at
// partial + ((b·N + h)·splits + split)·(H + 2): m, l, then acc[0..H) (unnormalized). Splits
// past the row's length write l = 0 and return at once, so a step reads only its own keys.
template <typename Tag>
__device__ void gqa_decode_split(const typename Tag::storage* q_src, const typename Tag::storage* pres_k,
                                 const typename Tag::storage* pres_v, const int* seqlens,
                                 const typename Tag::storage* cos_c, const typename Tag::storage* sin_c,
                                 const typename Tag::storage* bias, float* partial, unsigned N, unsigned Nk,
                                 unsigned H, unsigned PL, kiln_u64 q_w, kiln_u64 cache_rows, unsigned rotary_half,
                                 unsigned interleaved, float scale, float softcap, int window, unsigned has_bias,
                                 unsigned bias_b, unsigned bias_h, unsigned total, unsigned chunk, gqa_layout lay,
                                 kiln_status* st) {
    __shared__ float s_acc[GQA_MAX_WARPS][GQA_MAX_CHUNKS * 32];
    __shared__ float s_m[GQA_MAX_WARPS], s_l[GQA_MAX_WARPS];
    const unsigned split = blockIdx.x, h = blockIdx.y, b = blockIdx.z, splits = gridDim.x;
    if (split == 0 && h == 0 && b == 0 && threadIdx.x == 0)
        gqa_check(st, seqlens, gridDim.z, 1, 0, total, 0, 0, cache_rows, rotary_half);
    const unsigned j = h / (N / Nk);
    long long start, end, pos;
    gqa_range(seqlens, b, 0, 1, 0, window, PL, &start, &end, &pos);
    long long lo = (long long)split * chunk, hi = lo + chunk;
    if (lo < start) lo = start;
    if (hi > end) hi = end;
    float* part = partial + (((kiln_u64)b * N + h) * splits + split) * (H + 2);
    if (lo >= hi) {
        if (threadIdx.x == 0) {
            part[0] = -__int_as_float(0x7f800000);
            part[1] = 0.f;
        }
        return;
    }
    float q[GQA_MAX_CHUNKS];
    gqa_query<Tag>(q_src + (kiln_u64)b * q_w + (kiln_u64)h * H, cos_c, sin_c, pos, cache_rows, rotary_half,
                   interleaved, H, threadIdx.x & 31u, q);
    float mx, den;
    gqa_fold<Tag>(q, pres_k, pres_v, lay, b, j, lo, hi, H, scale, softcap,
                  gqa_bias_row<Tag>(bias, has_bias, bias_b, bias_h, b, h, 0, 1, total), s_acc, s_m, s_l, &mx, &den);
    if (threadIdx.x == 0) {
        part[0] = mx;
        part[1] = den;
    }
    for (unsigned d = threadIdx.x; d < H; d += blockDim.x) part[2 + d] = s_acc[0][d];
}

// Decode attention by KV head (gqa_decode_regs and gqa_decode_tiled below): the most keys per
// block, the largest query group and group × head size, and warps (the shim's DEC_* constants).
#define GQA_DEC_KEYS 256
#define GQA_DEC_MAX_GROUP 8
#define GQA_DEC_MAX_QH 1024
#define GQA_DEC_WARPS 8
#define GQA_DEC_ROW_VECS 8  // 16-byte vectors of a K row in registers together
#define GQA_DEC_MAX_ROW_BYTES 512  // bytes of one K/V row (H·sizeof(T))
#define GQA_DEC_V_KEYS 4    // V rows per thread gqa_decode_tiled reads from shared memory together

// The K/V layout parameters every kernel that reads or writes the present takes before its status
// record (gqa_layout), and the layout they make.
#define KILN_GQA_LAYOUT_PARAMS kiln_u64 kv_row, kiln_u64 kv_head, kiln_u64 kv_page, unsigned kv_shift
#define KILN_GQA_LAYOUT (gqa_layout{kv_row, kv_head, kv_page, kv_shift})

// The parameters of both decode kernels (one signature in kernel.toml).
#define KILN_GQA_DECODE_PARAMS                                                                                         \
    const typename Tag::storage *q_src, typename Tag::storage *pres_k, typename Tag::storage *pres_v,                  \
        const int *seqlens, const typename Tag::storage *cos_c, const typename Tag::storage *sin_c,                    \
        const typename Tag::storage *bias, const typename Tag::storage *sink, float *partial,                          \
        typename Tag::storage *out, unsigned N, unsigned Nk, unsigned H, unsigned PL, kiln_u64 q_w,                    \
        kiln_u64 cache_rows, unsigned rotary_half, unsigned interleaved, float scale, float softcap, int window,        \
        unsigned has_bias, unsigned bias_b, unsigned bias_h, unsigned total, unsigned sink_mode,                       \
        const typename Tag::storage *k_src, const typename Tag::storage *v_src, const typename Tag::storage *past_k,   \
        const typename Tag::storage *past_v, unsigned P, kiln_u64 kv_w, kiln_u64 k_off, kiln_u64 v_off,                \
        unsigned append, unsigned kpb, KILN_GQA_LAYOUT_PARAMS, unsigned fold, kiln_counter *counters, kiln_status *st
// The decode kernels' parameters as arguments, for the kernels that pass them on.
#define KILN_GQA_DECODE_ARGS                                                                                           \
    q_src, pres_k, pres_v, seqlens, cos_c, sin_c, bias, sink, partial, out, N, Nk, H, PL, q_w, cache_rows, rotary_half, \
        interleaved, scale, softcap, window, has_bias, bias_b, bias_h, total, sink_mode, k_src, v_src, past_k, past_v,  \
        P, kv_w, k_off, v_off, append, kpb, kv_row, kv_head, kv_page, kv_shift, fold, counters, st

// Bytes of gqa_decode_tiled's K tile, which the cross-warp reduction reuses once the scores are
// computed; the V tile follows it.
__host__ __device__ __forceinline__ unsigned gqa_decode_k_bytes(unsigned kpb, unsigned row_bytes, unsigned qh) {
    const unsigned k = kpb * row_bytes, red = GQA_DEC_WARPS * qh * 4u;
    return k > red ? k : red;
}

// The present rows [r0, r1) of KV head j, batch row b that a block of a decode kernel owns (rows
// split·kpb .. + kpb, or the keys it attends to, gqa_decode_regs), as kiln_gqa_kv writes them
// for a shared past and present (S = 1): bound in place (present is the past buffer) only the
// new row at `pos`, else every owned row (the new row, past rows below P, zeros). Every key a
// block reads is a row it owns, so the append needs no other block: a decode step runs one kernel
// fewer. knew / vnew (this block's shared memory, H values each, or null) also receive the new row
// at `pos` (K rotated), so that the block's own reads of it wait on no global store.
template <typename Tag>
__device__ __forceinline__ void gqa_decode_append(
    const typename Tag::storage* k_src, const typename Tag::storage* v_src, const typename Tag::storage* past_k,
    const typename Tag::storage* past_v, const typename Tag::storage* cos_c, const typename Tag::storage* sin_c,
    typename Tag::storage* pres_k, typename Tag::storage* pres_v, long long r0, long long r1, unsigned j, unsigned b,
    unsigned Nk, unsigned H, unsigned PL, unsigned P, long long pos, kiln_u64 kv_w, kiln_u64 k_off, kiln_u64 v_off,
    kiln_u64 cache_rows, unsigned rotary_half, unsigned interleaved, const gqa_layout& lay,
    typename Tag::storage* knew = 0, typename Tag::storage* vnew = 0) {
    typedef typename Tag::storage T;
    if (r1 > (long long)PL) r1 = PL;
    const T* kr = k_src + (kiln_u64)b * kv_w + k_off + (kiln_u64)j * H;
    const T* vr = v_src + (kiln_u64)b * kv_w + v_off + (kiln_u64)j * H;
    const bool in_place = pres_k == past_k && pres_v == past_v;
    const long long lo = in_place ? (pos > r0 ? pos : r0) : r0;
    // In place, or paged (whose pages are mapped only up to the row's position): rows to pos.
    const long long hi = in_place || lay.page != 0 ? (pos + 1 < r1 ? pos + 1 : r1) : r1;
    if (lo >= hi) return;
    for (kiln_u64 i = threadIdx.x; i < (kiln_u64)(hi - lo) * H; i += blockDim.x) {
        const long long t = lo + (long long)(i / H);
        const unsigned d = (unsigned)(i % H);
        const kiln_u64 at = gqa_at(lay, b, j, t, H) + d;
        T kv = 0, vv = 0;
        if (t == pos) {
            if (rotary_half > 0 && d < 2 * rotary_half)
                kv = kiln_from_f32(Tag(), rope_elem<Tag>(kr, cos_c, sin_c, t, cache_rows, rotary_half, d, interleaved));
            else
                kv = kr[d];
            vv = vr[d];
            if (knew) {
                knew[d] = kv;
                vnew[d] = vv;
            }
        } else if (t < (long long)P) {
            const kiln_u64 src = gqa_past_at(lay, b, j, t, H, Nk, P, PL) + d;
            kv = past_k[src];
            vv = past_v[src];
        }
        pres_k[at] = kv;
        pres_v[at] = vv;
    }
}

// Steps both decode kernels share (gqa_decode_regs, gqa_decode_tiled); the scores and weights
// live in s_sc [G][GQA_DEC_KEYS].

// The splits of a decode kernel's grid that hold keys of batch row b ([start, end), kpb keys per
// split): `used` splits from `first`, none when the row attends to no key. Only those blocks
// write a partial state and count in on the fold; the others return after their append. With
// kiln_gqa_merge after the kernel (merge_after), which reads every split, every split is used.
struct gqa_dec_span {
    unsigned first, used;
};

__device__ __forceinline__ gqa_dec_span gqa_dec_spans(long long start, long long end, unsigned kpb, unsigned splits,
                                                      bool merge_after) {
    if (merge_after) return gqa_dec_span{0u, splits};
    if (end <= start) return gqa_dec_span{0u, 0u};
    const unsigned first = (unsigned)(start / kpb), last = (unsigned)((end - 1) / kpb);
    return gqa_dec_span{first, last - first + 1};
}

// A block with no key to attend to: zeros as its output (to_out: the row attends to no key, and
// split 0 writes them) or an empty partial state (for kiln_gqa_merge).
template <typename Tag>
__device__ __forceinline__ void gqa_dec_empty(typename Tag::storage* out, float* partial, unsigned b, unsigned N,
                                              unsigned H, unsigned j, unsigned group, unsigned split,
                                              unsigned splits, bool to_out) {
    if (to_out) {
        for (unsigned i = threadIdx.x; i < group * H; i += blockDim.x)
            out[(kiln_u64)b * N * H + (kiln_u64)(j * group) * H + i] = kiln_from_f32(Tag(), 0.f);
    } else if (threadIdx.x < group) {
        float* part = partial + (((kiln_u64)b * N + j * group + threadIdx.x) * splits + split) * (H + 2);
        part[0] = -__int_as_float(0x7f800000);
        part[1] = 0.f;
    }
}

// The group's query rows, rotated and rounded as the CPU reference does, into q_s [group·H], in
// two steps: start() loads the values of element threadIdx.x (query head i / H, dimension i % H)
// into registers, so that their latency overlaps the append and the K/V loads; finish() computes
// it (as gqa_query_elem) and the elements past blockDim.x, then a barrier must follow.
template <typename Tag>
struct gqa_dec_queries {
    typedef typename Tag::storage T;
    const T *q_src, *cos_c, *sin_c;
    long long pos;
    kiln_u64 cache_rows, q_w;
    unsigned rotary_half, interleaved, b, j, group, H;
    T xa, xb, c, s;
    unsigned mode;  // 0 plain, 1 / 2 first / second of a rotary pair, 3 a position outside the caches (NaN)

    __device__ __forceinline__ const T* row(unsigned i) const {
        return q_src + (kiln_u64)b * q_w + (kiln_u64)(j * group + i / H) * H;
    }
    __device__ __forceinline__ void start() {
        const unsigned i = threadIdx.x, d = i % H;
        if (i >= group * H) return;
        const T* qr = row(i);
        if (rotary_half > 0 && d < 2 * rotary_half) {
            if (pos < 0 || (kiln_u64)pos >= cache_rows) {
                mode = 3;
                return;
            }
            unsigned ci, a, bb;
            bool first;
            rope_index(rotary_half, d, interleaved, &ci, &a, &bb, &first);
            c = cos_c[(kiln_u64)pos * rotary_half + ci];
            s = sin_c[(kiln_u64)pos * rotary_half + ci];
            xa = qr[a];
            xb = qr[bb];
            mode = first ? 1 : 2;
        } else {
            xa = qr[d];
            mode = 0;
        }
    }
    __device__ __forceinline__ void finish(float* q_s) const {
        const unsigned i = threadIdx.x;
        if (i < group * H) {
            float v;
            if (mode == 0) {
                v = kiln_to_f32(Tag(), xa);
            } else if (mode == 3) {
                v = __int_as_float(0x7fc00000);
            } else {
                const float r = rope_combine(kiln_to_f32(Tag(), xa), kiln_to_f32(Tag(), xb), kiln_to_f32(Tag(), c),
                                             kiln_to_f32(Tag(), s), mode == 1);
                v = kiln_to_f32(Tag(), kiln_from_f32(Tag(), r));
            }
            q_s[i] = v;
        }
        for (unsigned k = i + blockDim.x; k < group * H; k += blockDim.x)
            q_s[k] = gqa_query_elem<Tag>(row(k), cos_c, sin_c, pos, cache_rows, rotary_half, k % H, interleaved);
    }
};

// dot[g] += the 16-byte vector c of a K row against query row g (q_s).
template <typename Tag, int G>
__device__ __forceinline__ void gqa_dec_dot(float (&dot)[G], const uint4& raw, const float* q_s, unsigned c,
                                            unsigned H, unsigned group) {
    const unsigned VE = 16 / sizeof(typename Tag::storage);
    const typename Tag::storage* e = (const typename Tag::storage*)&raw;
    float kf[16 / sizeof(typename Tag::storage)];
#pragma unroll
    for (unsigned x = 0; x < VE; ++x) kf[x] = kiln_to_f32(Tag(), e[x]);
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= (int)group) break;
        const float4* qv = (const float4*)(q_s + g * H + c * VE);
#pragma unroll
        for (unsigned x = 0; x < VE / 4; ++x) {
            const float4 qq = qv[x];
            dot[g] += qq.x * kf[4 * x] + qq.y * kf[4 * x + 1] + qq.z * kf[4 * x + 2] + qq.w * kf[4 * x + 3];
        }
    }
}

// The score of query head g of the group against key `key` from their dot product: scale, softcap
// and the bias.
template <typename Tag>
__device__ __forceinline__ float gqa_dec_score(float dot, long long key, unsigned g, float scale, float softcap,
                                               const typename Tag::storage* bias, unsigned has_bias, unsigned bias_b,
                                               unsigned bias_h, unsigned b, unsigned j, unsigned group,
                                               unsigned total) {
    float xs = dot * scale;
    if (softcap > 0.f) xs = softcap * tanhf(xs / softcap);
    const typename Tag::storage* br = gqa_bias_row<Tag>(bias, has_bias, bias_b, bias_h, b, j * group + g, 0, 1, total);
    if (br) xs += kiln_to_f32(Tag(), br[key]);
    return xs;
}

// Key k's scores (key lo + k) into s_sc.
template <typename Tag, int G>
__device__ __forceinline__ void gqa_dec_scores(const float (&dot)[G], float (*s_sc)[GQA_DEC_KEYS], unsigned k,
                                               long long lo, float scale, float softcap,
                                               const typename Tag::storage* bias, unsigned has_bias,
                                               unsigned bias_b, unsigned bias_h, unsigned b, unsigned j,
                                               unsigned group, unsigned total) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= (int)group) break;
        s_sc[g][k] = gqa_dec_score<Tag>(dot[g], lo + k, g, scale, softcap, bias, has_bias, bias_b, bias_h, b, j, group,
                                        total);
    }
}

// Tensor-core steps of gqa_decode_tiled (float16 and bfloat16, H a multiple of 16; kiln-cuda-std's
// mma.cuh, m16n8k16 with f32 accumulators). Warp w takes keys 32w … 32w + 31 of the block, as two
// 16-key steps, and the query heads of the group are the 8 columns of the B operand (heads past
// `group` are zeros). The block's compute then costs a few hundred cycles where the scalar steps
// (one key per thread against every query row, then Σ weight·V over key lanes) took thousands, so
// the kernel is bound by its K/V stream (bench/RESULTS.md, 2026-12-04, session 15).
template <typename Tag>
__device__ __forceinline__ bool gqa_dec_tc(unsigned H) {
    return kiln_has_mma<Tag>::value && H % 16 == 0;
}

// Scores S [keys × heads] = K · Qᵀ of keys [0, n) into s_sc (as gqa_dec_scores): A is the K tile
// k_s (kiln_swz rows of vpr 16-byte vectors) through ldmatrix, B the query rows q_s, exact in the
// 16-bit type (gqa_dec_queries rounds them to it).
template <typename Tag, int G>
__device__ __forceinline__ void gqa_dec_scores_mma(const uint4* k_s, const float* q_s, float (*s_sc)[GQA_DEC_KEYS],
                                                   unsigned n, unsigned vpr, unsigned H, long long lo, float scale,
                                                   float softcap, const typename Tag::storage* bias,
                                                   unsigned has_bias, unsigned bias_b, unsigned bias_h, unsigned b,
                                                   unsigned j, unsigned group, unsigned total) {
    const unsigned lane = threadIdx.x & 31u, r = lane >> 2, c = (lane & 3u) * 2;
    const unsigned m0 = (threadIdx.x >> 5) * 32;
    if (m0 >= n) return;
    const unsigned steps = n - m0 > 16 ? 2 : 1;  // the same for the whole warp
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    for (unsigned s = 0; s < H / 16; ++s) {
        // B: query head r at dimensions 16s + c, c + 1 (b0) and 16s + 8 + c, c + 1 (b1).
        unsigned b0 = 0, b1 = 0;
        if (r < group) {
            const float* q = q_s + r * H + 16 * s + c;
            b0 = kiln_pack2<Tag>(q[0], q[1]);
            b1 = kiln_pack2<Tag>(q[8], q[9]);
        }
#pragma unroll
        for (unsigned t = 0; t < 2; ++t) {
            if (t >= steps) break;
            // A: matrix i (lanes 8i …) is keys + 8·(i & 1), dimensions 16s + 8·(i >> 1).
            unsigned a[4];
            kiln_ldmatrix_x4<false>(a, &k_s[kiln_swz(m0 + 16 * t + (lane & 15u), 2 * s + (lane >> 4), vpr)]);
            kiln_mma16816<Tag>(acc[t], a[0], a[1], a[2], a[3], b0, b1);
        }
    }
    // C: key m0 + 16t + r (+ 8 for c2, c3), heads c and c + 1.
#pragma unroll
    for (unsigned t = 0; t < 2; ++t)
#pragma unroll
        for (unsigned i = 0; i < 4; ++i) {
            const unsigned k = m0 + 16 * t + r + (i & 2u) * 4, g = c + (i & 1u);
            if (k < n && g < group)
                s_sc[g][k] = gqa_dec_score<Tag>(acc[t][i], lo + k, g, scale, softcap, bias, has_bias, bias_b, bias_h,
                                                b, j, group, total);
        }
}

// Σ weight·V of keys [0, n): Oᵀ [H × heads] = Vᵀ · Pᵀ, A the V tile v_s through ldmatrix.trans (V
// rows [n, n rounded up to 16) must be zeros: a weight of 0 would not clear NaN bits there), B the
// weights s_sc. Each weight is split into its 16-bit rounding and the rest, one mma each, so that
// the weights keep about 22 bits (16 for bfloat16) rather than the 11 of one rounding. Warp w
// writes its sums to s_red [w·stride + g·H + d]; the warps with keys are the first ⌈n / 32⌉.
#define GQA_DEC_PV_TILES 4

template <typename Tag>
__device__ __forceinline__ void gqa_dec_pv_mma(const uint4* v_s, const float (*s_sc)[GQA_DEC_KEYS], float* s_red,
                                               unsigned stride, unsigned n, unsigned vpr, unsigned H,
                                               unsigned group) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, r = lane >> 2, c = (lane & 3u) * 2;
    const unsigned k0 = warp * 32;
    if (k0 >= n) return;
    const unsigned steps = n - k0 > 16 ? 2 : 1;
    // B: head r's weights at keys k0 + 16t + c, c + 1 (+ 8 for the second register), high and low parts.
    unsigned bh[2][2], bl[2][2];
#pragma unroll
    for (unsigned t = 0; t < 2; ++t)
#pragma unroll
        for (unsigned h = 0; h < 2; ++h) {
            const unsigned k = k0 + 16 * t + 8 * h + c;
            const float p0 = r < group && k < n ? s_sc[r][k] : 0.f, p1 = r < group && k + 1 < n ? s_sc[r][k + 1] : 0.f;
            const float h0 = kiln_to_f32(Tag(), kiln_from_f32(Tag(), p0)), h1 = kiln_to_f32(Tag(), kiln_from_f32(Tag(), p1));
            bh[t][h] = kiln_pack2<Tag>(h0, h1);
            bl[t][h] = kiln_pack2<Tag>(p0 - h0, p1 - h1);
        }
    // GQA_DEC_PV_TILES dimension tiles at a time, their accumulator chains independent.
    for (unsigned dt0 = 0; dt0 < H / 16; dt0 += GQA_DEC_PV_TILES) {
        float acc[GQA_DEC_PV_TILES][4];
#pragma unroll
        for (unsigned q = 0; q < GQA_DEC_PV_TILES; ++q)
#pragma unroll
            for (unsigned i = 0; i < 4; ++i) acc[q][i] = 0.f;
#pragma unroll
        for (unsigned t = 0; t < 2; ++t) {
            if (t >= steps) break;
#pragma unroll
            for (unsigned q = 0; q < GQA_DEC_PV_TILES; ++q) {
                const unsigned dt = dt0 + q;
                if (dt >= H / 16) break;
                // A (transposed): matrix i is keys + 8·(i >> 1), dimensions 16·dt + 8·(i & 1).
                unsigned a[4];
                kiln_ldmatrix_x4<true>(a, &v_s[kiln_swz(k0 + 16 * t + (lane & 7u) + ((lane >> 4) << 3),
                                                       2 * dt + ((lane >> 3) & 1u), vpr)]);
                kiln_mma16816<Tag>(acc[q], a[0], a[1], a[2], a[3], bh[t][0], bh[t][1]);
                kiln_mma16816<Tag>(acc[q], a[0], a[1], a[2], a[3], bl[t][0], bl[t][1]);
            }
        }
        // C: dimension 16·dt + r (+ 8 for c2, c3), heads c and c + 1.
#pragma unroll
        for (unsigned q = 0; q < GQA_DEC_PV_TILES; ++q)
#pragma unroll
            for (unsigned i = 0; i < 4; ++i) {
                const unsigned d = 16 * (dt0 + q) + r + (i & 2u) * 4, g = c + (i & 1u);
                if (dt0 + q < H / 16 && g < group) s_red[warp * stride + g * H + d] = acc[q][i];
            }
    }
}

// One warp per query row: the max and Σ e^(x − max) of its n scores (into s_m, s_l), the scores
// turned into weights.
__device__ __forceinline__ void gqa_dec_weights(float (*s_sc)[GQA_DEC_KEYS], float* s_m, float* s_l, unsigned n,
                                                unsigned group) {
    const unsigned lane = threadIdx.x & 31u;
    for (unsigned g = threadIdx.x >> 5; g < group; g += blockDim.x >> 5) {
        float m = -__int_as_float(0x7f800000);
        for (unsigned k = lane; k < n; k += 32) m = fmaxf(m, s_sc[g][k]);
        m = kiln_warp_max(m);
        float l = 0.f;
        for (unsigned k = lane; k < n; k += 32) {
            const float p = m == -__int_as_float(0x7f800000) ? 0.f : expf(s_sc[g][k] - m);
            s_sc[g][k] = p;
            l += p;
        }
        l = kiln_warp_sum(l);
        if (lane == 0) {
            s_m[g] = m;
            s_l[g] = l;
        }
    }
}

// acc[g] += weight(g, k) × the 16-byte vector of key k's V row this thread holds.
template <typename Tag, int G>
__device__ __forceinline__ void gqa_dec_accumulate(float (&acc)[G][8], const uint4& raw,
                                                   const float (*s_sc)[GQA_DEC_KEYS], unsigned k, unsigned group) {
    const unsigned VE = 16 / sizeof(typename Tag::storage);
    const typename Tag::storage* e = (const typename Tag::storage*)&raw;
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= (int)group) break;
        const float p = s_sc[g][k];
#pragma unroll
        for (int x = 0; x < 8; ++x)
            if (x < (int)VE) acc[g][x] += p * kiln_to_f32(Tag(), e[x]);
    }
}

// Reduces acc over the key lanes of a warp (lanes vi + vpr·i) and writes each warp's sums to
// s_red [warp][stride] (a barrier must follow).
template <typename Tag, int G>
__device__ __forceinline__ void gqa_dec_reduce(float (&acc)[G][8], float* s_red, unsigned stride, unsigned vpr,
                                               unsigned vi, unsigned H, unsigned group) {
    const unsigned VE = 16 / sizeof(typename Tag::storage), lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
    for (unsigned o = vpr; o < 32; o <<= 1)
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int x = 0; x < 8; ++x) acc[g][x] += __shfl_xor_sync(0xffffffffu, acc[g][x], o);
    if (lane < vpr) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= (int)group) break;
#pragma unroll
            for (int x = 0; x < 8; ++x)
                if (x < (int)VE) s_red[warp * stride + g * H + vi * VE + x] = acc[g][x];
        }
    }
}

// Sums the warps' rows of s_red [warp][stride], each weighted by wscale [warp][GQA_DEC_MAX_GROUP]
// (per query head; null: all 1) and writes the output (`direct`: the only split with keys;
// sink_mode as gqa_attn) or the partial state of gqa_decode_split, for the fold or kiln_gqa_merge.
template <typename Tag>
__device__ __forceinline__ void gqa_dec_write(const float* s_red, unsigned stride, unsigned warps_used,
                                              const float* s_m, const float* s_l,
                                              const typename Tag::storage* sink, unsigned sink_mode,
                                              typename Tag::storage* out, float* partial, unsigned b, unsigned N,
                                              unsigned H, unsigned j, unsigned group, unsigned split,
                                              unsigned splits, bool direct, const float* wscale = 0) {
    for (unsigned i = threadIdx.x; i < group * H; i += blockDim.x) {
        const unsigned g = i / H, d = i - g * H;
        float a = 0.f;
        for (unsigned w = 0; w < warps_used; ++w) {
            if (!wscale) {
                a += s_red[w * stride + i];
            } else if (wscale[w * GQA_DEC_MAX_GROUP + g] > 0.f) {  // an empty warp's sums are unset
                a += wscale[w * GQA_DEC_MAX_GROUP + g] * s_red[w * stride + i];
            }
        }
        const unsigned h = j * group + g;
        if (direct) {
            float den = s_l[g], scale_o = 1.f;
            if (sink_mode != 0) {
                const float sink_v = sink_mode == 2 ? kiln_to_f32(Tag(), sink[h]) : 0.f;
                const float m2 = fmaxf(s_m[g], sink_v);
                scale_o = expf(s_m[g] - m2);
                den = den * scale_o + expf(sink_v - m2);
            }
            out[(kiln_u64)b * N * H + (kiln_u64)h * H + d] = kiln_from_f32(Tag(), a * scale_o / den);
        } else {
            float* part = partial + (((kiln_u64)b * N + h) * splits + split) * (H + 2);
            if (d == 0) {
                part[0] = s_m[g];
                part[1] = s_l[g];
            }
            part[2 + d] = a;
        }
    }
}

// The split merge folded into the decode kernels (`fold`, 2 to GQA_FOLD_MAX_SPLITS splits): each
// block of KV head j, batch row b that holds keys (the `used` splits from `first`, gqa_dec_span)
// counts itself in on counters[b·Nk + j] (the node's counters, ABI.md §6.3, zero between
// launches) once its partial state is written, and the last block to finish merges those splits
// of the group's query heads as kiln_gqa_merge would (sink_mode as gqa_attn), then puts the
// counter back to zero. The count is one acquire-release atomic of thread 0 after a block
// barrier (the pattern of CUTLASS's generic barrier): it publishes the block's partial state and,
// in the last block, makes every other block's visible. Each thread of the last block then merges
// one output (query head g, dimension d) in a single pass over the splits, reading every split's
// maximum, sum and value d through L2 (__ldcg) with GQA_FOLD_CHUNK splits' loads in flight and an
// online rescaling between chunks. So the merge after the last partial state costs two L2 round
// trips (the atomic, the loads) where a fence, the atomic and two dependent passes of loads took
// five (bench/RESULTS.md, 2026-12-04, session 15), and a decode step runs one kernel fewer per
// layer, at any context up to GQA_FOLD_MAX_SPLITS splits. Block-uniform: every thread of the
// block calls it.
#define GQA_FOLD_MAX_SPLITS 128
#define GQA_FOLD_CHUNK 16

template <typename Tag>
__device__ __noinline__ void gqa_dec_fold(const float* partial, kiln_counter* counters, const typename Tag::storage* sink,
                                          unsigned sink_mode, typename Tag::storage* out, unsigned b, unsigned N,
                                          unsigned H, unsigned j, unsigned group, unsigned splits, unsigned first,
                                          unsigned used) {
    __shared__ unsigned s_last;
    __syncthreads();  // the block's partial state is written
    if (threadIdx.x == 0) {
        unsigned prev;
        asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], 1;"
                     : "=r"(prev)
                     : "l"(&counters[b * gridDim.y + j])
                     : "memory");
        s_last = prev == used - 1;
    }
    __syncthreads();
    if (!s_last) return;
    const kiln_u64 stride = H + 2;
    const float neg_inf = -__int_as_float(0x7f800000);
    for (unsigned i = threadIdx.x; i < group * H; i += blockDim.x) {
        const unsigned g = i / H, d = i - g * H, h = j * group + g;
        const float* part = partial + (((kiln_u64)b * N + h) * splits + first) * stride;
        const float sink_v = sink_mode == 2 ? kiln_to_f32(Tag(), sink[h]) : 0.f;
        // M: the largest maximum so far of the splits that saw a key (and the sink's); den and a:
        // Σ l_s·e^(m_s − M) and Σ acc_s[d]·e^(m_s − M) over them.
        float M = sink_mode != 0 ? sink_v : neg_inf, den = 0.f, a = 0.f;
        for (unsigned s0 = 0; s0 < used; s0 += GQA_FOLD_CHUNK) {
            float m[GQA_FOLD_CHUNK], l[GQA_FOLD_CHUNK], v[GQA_FOLD_CHUNK];
#pragma unroll
            for (unsigned u = 0; u < GQA_FOLD_CHUNK; ++u) {
                const float* ps = part + (kiln_u64)(s0 + u) * stride;
                const bool ok = s0 + u < used;
                m[u] = ok ? __ldcg(ps) : 0.f;
                l[u] = ok ? __ldcg(ps + 1) : 0.f;
                v[u] = ok ? __ldcg(ps + 2 + d) : 0.f;
            }
            float Mc = M;
#pragma unroll
            for (unsigned u = 0; u < GQA_FOLD_CHUNK; ++u)
                if (l[u] > 0.f) Mc = fmaxf(Mc, m[u]);  // an empty split's maximum is unset
            if (Mc != M) {
                // Earlier splits whose weight underflows drop out, as in kiln_gqa_merge (0 · inf
                // would be NaN).
                const float r = M == neg_inf ? 0.f : expf(M - Mc);
                den = r > 0.f ? den * r : 0.f;
                a = r > 0.f ? a * r : 0.f;
                M = Mc;
            }
#pragma unroll
            for (unsigned u = 0; u < GQA_FOLD_CHUNK; ++u)
                if (l[u] > 0.f) {  // an empty split's sums are unset (any bits)
                    const float w = expf(m[u] - M);
                    den += l[u] * w;
                    a += w > 0.f ? v[u] * w : 0.f;
                }
        }
        if (sink_mode != 0) den += expf(sink_v - M);
        out[(kiln_u64)b * N * H + (kiln_u64)h * H + d] = kiln_from_f32(Tag(), a / den);
    }
    if (threadIdx.x == 0) counters[b * gridDim.y + j] = 0;
}

// The split merge through a thread block cluster (compute capability 9.0): the CL blocks
// (GQA_DEC_CLUSTER, or GQA_DEC_CLUSTER_WIDE) of one (KV head, batch row) are one cluster, and
// each block merges one slice of the group's query heads × dimensions (gqa_dec_slice elements, in
// order of rank) and writes that slice of the output. Each block pushes its partial state (maxima, sums, and every slice of its
// Σ weight·V) into the receiving blocks' shared memory (s_recv [sender rank]) by asynchronous
// stores that count their bytes on the receiver's mbarrier (kiln-cuda-std's cluster.cuh, the
// pattern of Hopper's distributed shared memory pipelines); the receiver waits on its own mbarrier
// and merges from its own shared memory as gqa_dec_fold does. No fence, no global memory and no
// second barrier: a cluster barrier's release (a GPU-scope MEMBAR in the SASS, behind every
// outstanding store of the append and the output) and a block 0 that merged alone took 2.6 µs of
// an 8.1 µs attention kernel on an H100 (bench/RESULTS.md, 2026-12-06, session 26). The mbarrier
// is initialised at the kernel's start (gqa_dec_cluster_begin), whose cluster barrier the senders
// wait on before their first store. Block-uniform: every thread of every block of the cluster
// calls both once.
#define GQA_DEC_CLUSTER 8        // the portable cluster size: kiln_gqa_decode_cluster(_rows, _plain)
#define GQA_DEC_CLUSTER_WIDE 16  // kiln_gqa_decode_cluster16_rows: a non-portable size on sm_90
// Floats of one sender's row of s_recv in a cluster of CL blocks: maxima and sums of up to
// GQA_DEC_MAX_GROUP heads, then a slice of Σ weight·V.
#define GQA_DEC_RECV_ROW(CL) (2 * GQA_DEC_MAX_GROUP + GQA_DEC_MAX_QH / (CL))
// Floats of a decode kernel's s_recv for a cluster of CL blocks (1 without a cluster, CL = 0).
template <int CL>
__host__ __device__ constexpr unsigned gqa_dec_recv_floats() {
    return CL > 0 ? CL * GQA_DEC_RECV_ROW(CL > 0 ? CL : 1) : 1;
}

// Elements of the group's qh = group·H outputs per block of a cluster of CL blocks: a multiple of
// 4 (one float4 store), so that a slice starts 16-byte aligned; the last blocks' slices may be
// short or empty.
template <int CL>
__device__ __forceinline__ unsigned gqa_dec_slice(unsigned qh) {
    return ((qh + CL - 1) / CL + 3u) & ~3u;
}

#if __CUDA_ARCH__ >= 900
// At the kernel's start: thread 0 initialises the block's mbarrier (one arrival, its own), then
// every thread arrives (relaxed) at the cluster barrier gqa_dec_cluster_merge waits on.
__device__ __forceinline__ void gqa_dec_cluster_begin(unsigned long long* bar) {
    if (threadIdx.x == 0) kiln_mbar_init_cluster(bar, 1);
    kiln_cluster_arrive_relaxed();
}

// has_keys: this block's state is s_m, s_l [GQA_DEC_MAX_GROUP] and its GQA_DEC_WARPS warps' Σ
// weight·V in s_red [warp][GQA_DEC_MAX_QH] (16-byte aligned), each weighted by ws
// [warp][GQA_DEC_MAX_GROUP] (gqa_dec_combine; null: every warp's sums against the block's
// maximum, weight 1); otherwise it holds no key. no_keys: the row attends to no key (zeros, as
// kiln_gqa_merge writes). s_recv [CL][GQA_DEC_RECV_ROW(CL)], 16-byte aligned, receives
// the senders' states.
template <typename Tag, int CL>
__device__ __forceinline__ void gqa_dec_cluster_merge(const float* s_red, const float* ws, const float* s_m,
                                                      const float* s_l, float* s_recv,
                                                   unsigned long long* bar, bool has_keys, bool no_keys,
                                                   const typename Tag::storage* sink, unsigned sink_mode,
                                                   typename Tag::storage* out, unsigned b, unsigned N, unsigned H,
                                                   unsigned j, unsigned group) {
    static_assert(CL > 0 && GQA_DEC_MAX_QH % (4 * CL) == 0, "a cluster's slices are whole float4 rows");
    const unsigned tid = threadIdx.x, qh = group * H, c = gqa_dec_slice<CL>(qh), rank = kiln_cluster_rank();
    const unsigned mine = qh > rank * c ? (qh - rank * c < c ? qh - rank * c : c) : 0;
    if (tid == 0) kiln_mbar_arrive_expect_tx(bar, CL * (2 * group + mine) * 4u);
    kiln_cluster_wait();  // every block's mbarrier is initialised
    GQA_MARK(7);  // the cluster barrier of the start passed
    float* row = s_recv + rank * GQA_DEC_RECV_ROW(CL);  // this block's row, in every receiver
    // Σ weight·V over the warps, four outputs (of one query head) per thread, to the block that
    // merges them.
    for (unsigned v = tid; v < qh / 4; v += blockDim.x) {
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
        if (has_keys) {
            // Every warp's weight and sums loaded at once, then the products.
            const unsigned g = 4 * v / H;
            float f[GQA_DEC_WARPS];
            float4 x[GQA_DEC_WARPS];
#pragma unroll
            for (unsigned w = 0; w < GQA_DEC_WARPS; ++w) {
                f[w] = ws ? ws[w * GQA_DEC_MAX_GROUP + g] : 1.f;
                x[w] = *(const float4*)(s_red + w * GQA_DEC_MAX_QH + 4 * v);
            }
#pragma unroll
            for (unsigned w = 0; w < GQA_DEC_WARPS; ++w) {
                if (f[w] == 0.f) continue;  // an empty warp's sums are unset
                a.x += f[w] * x[w].x;
                a.y += f[w] * x[w].y;
                a.z += f[w] * x[w].z;
                a.w += f[w] * x[w].w;
            }
        }
        const unsigned to = 4 * v / c;
        kiln_cluster_st_async(row + 2 * GQA_DEC_MAX_GROUP + (4 * v - to * c), to, a, bar);
    }
    // The maxima and sums, to every block (an empty block's: −∞ and 0).
    for (unsigned i = tid; i < CL * 2 * group; i += blockDim.x) {
        const unsigned to = i / (2 * group), e = i - to * 2 * group, g = e < group ? e : e - group;
        const float x = e < group ? (has_keys ? s_m[g] : -__int_as_float(0x7f800000)) : (has_keys ? s_l[g] : 0.f);
        kiln_cluster_st_async(row + (e < group ? 0 : GQA_DEC_MAX_GROUP) + g, to, x, bar);
    }
    GQA_MARK(9);  // the block's state sent
    kiln_mbar_wait_cluster(bar, 0);
    GQA_MARK(10);  // every block's state received
    for (unsigned i = tid; i < mine; i += blockDim.x) {
        const unsigned e = rank * c + i, g = e / H, d = e - g * H, h = j * group + g;
        typename Tag::storage* o = out + (kiln_u64)b * N * H + (kiln_u64)h * H;
        if (no_keys) {
            o[d] = kiln_from_f32(Tag(), 0.f);
            continue;
        }
        float m[CL], l[CL], v[CL];
#pragma unroll
        for (unsigned r = 0; r < CL; ++r) {
            m[r] = s_recv[r * GQA_DEC_RECV_ROW(CL) + g];
            l[r] = s_recv[r * GQA_DEC_RECV_ROW(CL) + GQA_DEC_MAX_GROUP + g];
            v[r] = s_recv[r * GQA_DEC_RECV_ROW(CL) + 2 * GQA_DEC_MAX_GROUP + i];
        }
        float M = -__int_as_float(0x7f800000);
#pragma unroll
        for (unsigned r = 0; r < CL; ++r)
            if (l[r] > 0.f) M = fmaxf(M, m[r]);
        float sink_v = 0.f;
        if (sink_mode == 2) sink_v = kiln_to_f32(Tag(), sink[h]);
        if (sink_mode != 0) M = fmaxf(M, sink_v);
        float den = 0.f, a = 0.f;
#pragma unroll
        for (unsigned r = 0; r < CL; ++r) {
            const float w = l[r] > 0.f ? expf(m[r] - M) : 0.f;
            den += l[r] > 0.f ? l[r] * w : 0.f;
            a += w > 0.f ? v[r] * w : 0.f;
        }
        if (sink_mode != 0) den += expf(sink_v - M);
        o[d] = kiln_from_f32(Tag(), a / den);
    }
}
#endif

// Whether a decode kernel's blocks take even shares (gqa_dec_share_of): a cluster kernel (CL > 0)
// merging through its cluster (compute capability 9.0), where the append writes only the new row
// (the present bound in place, or no append).
template <int CL>
__device__ __forceinline__ bool gqa_dec_even(unsigned append, bool in_place) {
#if __CUDA_ARCH__ >= 900
    return CL > 0 && (!append || in_place);
#else
    return false;
#endif
}

// The keys [lo, hi) block `split` of a decode kernel's `splits` attends to within the row's
// [start, end), and the present rows [r0, r1) its append owns (gqa_decode_append). Split by
// kpb: keys split·kpb .. + kpb, which it also owns. `even` (gqa_dec_even): an even share of
// the row's keys, so that a short row spreads over every block of the cluster rather than the
// first few, at most kpb of them (the shim's ceil(present / splits), which a share never exceeds);
// the new row, the row's last key, is then the last non-empty block's, and with no key to attend
// to (a window of 0) the last block's, unless its position is invalid (seqlens_k < 0: the checks
// report it, and nothing is written).
struct gqa_dec_share {
    long long lo, hi, r0, r1;
};
__device__ __forceinline__ gqa_dec_share gqa_dec_share_of(long long start, long long end, long long pos,
                                                          unsigned split, unsigned splits, unsigned kpb, bool even) {
    gqa_dec_share r;
    if (even) {
        const long long share = (end - start + splits - 1) / splits;
        r.lo = start + (long long)split * share;
        r.hi = r.lo + (share < (long long)kpb ? share : (long long)kpb);
        if (r.hi > end) r.hi = end;
        const bool last_owns = start >= end && pos >= 0 && split == splits - 1;
        r.r0 = last_owns ? pos : r.lo;
        r.r1 = last_owns ? pos + 1 : r.hi;
    } else {
        r.r0 = (long long)split * kpb;
        r.r1 = r.r0 + kpb;
        r.lo = r.r0 < start ? start : r.r0;
        r.hi = r.r1 > end ? end : r.r1;
    }
    return r;
}

// Decode attention by KV head for the plain kernel kiln_gqa_decode (the shim's choice for a
// present past the cluster kernels' and few keys in all: blocks of up to GQA_DEC_KEYS keys, split
// over the present and folded): each thread loads its K row and GQA_DEC_ROWS_V_KEYS V rows into
// registers at the start, before the append and the query rows, then the scores one key per
// thread, the weights one warp per query row and Σ weight·V over (key lane, V vector), with a
// block barrier between. Its 256 K rows and V rows of a block are in flight at once, which at long
// contexts beats gqa_decode_regs' chunks of 2 keys per key lane (its one-chunk-ahead prefetch
// ran batch 1 at context 3840 of a 4096 cache in 0.948 ms/step where this took 0.768 on an H100,
// bench/RESULTS.md, 2026-12-06, session 26). Block (split, j, b) reads keys
// [split·kpb, (split + 1)·kpb) ∩ [start, end) (kpb ≤ GQA_DEC_KEYS). With CL, the cluster size
// (GQA_DEC_CLUSTER for kiln_gqa_decode_cluster_rows, GQA_DEC_CLUSTER_WIDE for
// kiln_gqa_decode_cluster16_rows), the block takes an even share of the row's keys where the append
// allows it (compute capability 9.0), copies its rows into dynamic shared memory rather than
// registers (cp.async, every row in flight at once) and merges through the cluster as
// gqa_decode_regs does: at prompt 1,792 of a 2,048 cache this took batch 1 from 0.811 ms/step
// (gqa_decode_regs' chunks of 64 keys one after another) to 0.681 in the same run on an H100
// (bench/RESULTS.md, 2026-12-06, session 27).
#define GQA_DEC_ROWS_V_KEYS 8  // V rows per thread loaded together (every V row of a 64-wide f16 block at once)

// The cluster rows kernels' dynamic shared memory for kpb keys of row_bytes-byte rows is
// gqa_decode_tiled's layout with the reduction at its fixed stride (the cluster merge reads
// GQA_DEC_MAX_QH per warp): gqa_decode_k_bytes(kpb, row_bytes, GQA_DEC_MAX_QH) bytes of K rows, over
// which the warps' Σ weight·V go once the scores are computed, then kpb·row_bytes of V rows.

template <typename Tag, int G, int CL = 0, int FH = 0, int FG = 0>
__device__ void gqa_decode_rows(KILN_GQA_DECODE_PARAMS) {
    typedef typename Tag::storage T;
    const gqa_layout lay = KILN_GQA_LAYOUT;
    const unsigned VE = 16 / sizeof(T);  // elements per 16-byte vector
    __shared__ __align__(16) float q_s[GQA_DEC_MAX_QH];
    __shared__ float s_sc[G][GQA_DEC_KEYS];
    __shared__ float s_m[G], s_l[G];
    // The cluster kernel's dynamic shared memory (above): the K rows, over which the warps' Σ
    // weight·V [GQA_DEC_WARPS][GQA_DEC_MAX_QH] go once the scores are computed (its static memory
    // stays under 48 KiB beside s_recv), then the V rows.
    __shared__ __align__(16) float s_red_static[CL > 0 ? 4 : GQA_DEC_WARPS * GQA_DEC_MAX_QH];
    extern __shared__ __align__(16) unsigned char gqa_dyn[];
    float* const s_red = CL > 0 ? (float*)gqa_dyn : s_red_static;
    const unsigned split = blockIdx.x, j = blockIdx.y, b = blockIdx.z, splits = gridDim.x;
    // FH, FG: the head size and query group compiled in (kiln_gqa_decode_cluster_*_hg), else 0.
    if constexpr (FH > 0) H = FH;
    const unsigned group = FG > 0 ? (unsigned)FG : N / Nk, tid = threadIdx.x;
#if __CUDA_ARCH__ >= 900
    __shared__ __align__(16) float s_recv[gqa_dec_recv_floats<CL>()];
    __shared__ __align__(8) unsigned long long s_bar;
    if (CL > 0) gqa_dec_cluster_begin(&s_bar);
#endif
    if (split == 0 && j == 0 && b == 0 && tid == 0)
        gqa_check(st, seqlens, gridDim.z, 1, 0, total, 0, 0, cache_rows, rotary_half);
    long long start, end, pos;
    gqa_range(seqlens, b, 0, 1, 0, window, PL, &start, &end, &pos);
    // The keys [lo, hi) this block attends to (gqa_dec_share_of): split·kpb .. + kpb, or, where
    // the cluster merges (compute capability 9.0) and the append writes only the new row (in
    // place, or no append), an even share of the row's keys.
    const bool in_place = pres_k == past_k && pres_v == past_v;
    const bool even = gqa_dec_even<CL>(append, in_place);
    const gqa_dec_share sh = gqa_dec_share_of(start, end, pos, split, splits, kpb, even);
    const long long lo = sh.lo, hi = sh.hi;
    const unsigned n = lo < hi ? (unsigned)(hi - lo) : 0;  // ≤ kpb ≤ GQA_DEC_KEYS = blockDim.x
    const unsigned vpr = H / VE;  // 16-byte vectors per K/V row
    // Key k's K and V rows are loaded before the append and the query rows (their latency
    // overlaps), except rows this block writes first: the new row, or every owned row when the
    // present is not the past buffer. Those are read after the __syncthreads below, from the
    // present. kiln_gqa_decode holds its rows in registers (kraw, vraw); the cluster kernel copies
    // them into dynamic shared memory (k_s, v_s, swizzled by 16-byte vector as gqa_decode_tiled's:
    // as sized above for kpb keys), so that its registers hold no load and none spills.
    const auto late = [&](unsigned k) { return append && (!in_place || lo + (long long)k == pos); };
    const auto krow = [&](unsigned k) { return (const uint4*)(pres_k + gqa_at(lay, b, j, lo + k, H)); };
    const auto vrow = [&](unsigned k) { return (const uint4*)(pres_v + gqa_at(lay, b, j, lo + k, H)); };
    const unsigned lanes = blockDim.x / vpr;
    const unsigned kl = tid / vpr, vi = tid - kl * vpr;
    uint4 kraw[GQA_DEC_ROW_VECS], vraw[GQA_DEC_ROWS_V_KEYS];
    uint4* const k_s = (uint4*)gqa_dyn;
    uint4* const v_s = (uint4*)(gqa_dyn + gqa_decode_k_bytes(kpb, vpr * 16u, GQA_DEC_MAX_QH));
    // Thread tid copies vector cu of keys key0, key0 + kstep, … (vpr a power of two).
    const unsigned lg_vpr = __ffs(vpr) - 1, cu = tid & (vpr - 1), key0 = tid >> lg_vpr, kstep = blockDim.x >> lg_vpr;
    const auto copy = [&](uint4* dst, bool v) {
        for (unsigned k = key0; k < n; k += kstep)
            if (!late(k)) kiln_cp_async16(&dst[kiln_swz(k, cu, vpr)], (v ? vrow(k) : krow(k)) + cu);
        kiln_cp_async_commit();
    };
    if (CL == 0) {
#pragma unroll
        for (unsigned u = 0; u < GQA_DEC_ROW_VECS; ++u)
            kraw[u] = tid < n && u < vpr && !late(tid) ? krow(tid)[u] : make_uint4(0, 0, 0, 0);
#pragma unroll
        for (unsigned u = 0; u < GQA_DEC_ROWS_V_KEYS; ++u) {
            const unsigned k = kl + u * lanes;
            vraw[u] = k < n && !late(k) ? vrow(k)[vi] : make_uint4(0, 0, 0, 0);
        }
    } else if (n > 0) {
        copy(k_s, false);
        copy(v_s, true);
    }
    gqa_dec_queries<Tag> queries{q_src, cos_c, sin_c, pos, cache_rows, q_w, rotary_half, interleaved, b, j, group, H};
    queries.start();
    if (append)
        gqa_decode_append<Tag>(k_src, v_src, past_k, past_v, cos_c, sin_c, pres_k, pres_v, sh.r0, sh.r1, j, b, Nk, H, PL,
                               P, pos, kv_w, k_off, v_off, cache_rows, rotary_half, interleaved, lay);
#if __CUDA_ARCH__ >= 900
    if constexpr (CL > 0)
        if (n == 0) {
            gqa_dec_cluster_merge<Tag, CL>(s_red, 0, s_m, s_l, s_recv, &s_bar, false, start >= end, sink, sink_mode,
                                           out, b, N, H, j, group);
            return;
        }
#endif
    const bool merge_after = !fold && splits > 1;
    const gqa_dec_span span = gqa_dec_spans(start, end, kpb, splits, merge_after);
    const bool direct = !merge_after && span.used <= 1;
    if (n == 0) {
        if (merge_after || (span.used == 0 && split == 0))
            gqa_dec_empty<Tag>(out, partial, b, N, H, j, group, split, splits, !merge_after);
        return;
    }
    // 1. Query rows.
    queries.finish(q_s);
    if (CL > 0) kiln_cp_async_wait<1>();  // this thread's copies of the K rows
    __syncthreads();  // the appended rows, q_s and everyone's K rows
    // 2. Scores, one key per thread.
    if (tid < n) {
        const unsigned k = tid;
        float dot[G];
#pragma unroll
        for (int g = 0; g < G; ++g) dot[g] = 0.f;
        for (unsigned c0 = 0; c0 < vpr; c0 += GQA_DEC_ROW_VECS) {
            // The row's vectors in flight together (the first ones loaded above), then the products.
            uint4 raw[GQA_DEC_ROW_VECS];
#pragma unroll
            for (unsigned u = 0; u < GQA_DEC_ROW_VECS; ++u) {
                const unsigned c = c0 + u;
                raw[u] = c >= vpr    ? make_uint4(0, 0, 0, 0)
                         : late(k)   ? krow(k)[c]
                         : CL > 0    ? k_s[kiln_swz(k, c, vpr)]
                         : c0 == 0   ? kraw[u]
                                     : krow(k)[c];
            }
#pragma unroll
            for (unsigned u = 0; u < GQA_DEC_ROW_VECS; ++u) {
                if (c0 + u >= vpr) break;
                gqa_dec_dot<Tag, G>(dot, raw[u], q_s, c0 + u, H, group);
            }
        }
        gqa_dec_scores<Tag, G>(dot, s_sc, k, lo, scale, softcap, bias, has_bias, bias_b, bias_h, b, j, group, total);
    }
    __syncthreads();
    // 3. Weights, one warp per query row.
    gqa_dec_weights(s_sc, s_m, s_l, n, group);
    if (CL > 0) kiln_cp_async_wait<0>();  // the V rows
    __syncthreads();
    // 4. Σ weight·V: thread (key lane kl, vector vi), GQA_DEC_ROWS_V_KEYS keys read together (the
    // first ones loaded above).
    float acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g)
#pragma unroll
        for (int x = 0; x < 8; ++x) acc[g][x] = 0.f;
    if (kl < lanes) {
        for (unsigned k0 = kl; k0 < n; k0 += GQA_DEC_ROWS_V_KEYS * lanes) {
            uint4 raw[GQA_DEC_ROWS_V_KEYS];
#pragma unroll
            for (unsigned u = 0; u < GQA_DEC_ROWS_V_KEYS; ++u) {
                const unsigned k = k0 + u * lanes;
                raw[u] = k >= n      ? make_uint4(0, 0, 0, 0)
                         : late(k)   ? vrow(k)[vi]
                         : CL > 0    ? v_s[kiln_swz(k, vi, vpr)]
                         : k0 == kl  ? vraw[u]
                                     : vrow(k)[vi];
            }
#pragma unroll
            for (unsigned u = 0; u < GQA_DEC_ROWS_V_KEYS; ++u) {
                const unsigned k = k0 + u * lanes;
                if (k >= n) break;
                gqa_dec_accumulate<Tag, G>(acc, raw[u], s_sc, k, group);
            }
        }
    }
    // Reduce over the key lanes of a warp (lanes vi + vpr·i), then over the warps.
    gqa_dec_reduce<Tag, G>(acc, s_red, GQA_DEC_MAX_QH, vpr, vi, H, group);
    __syncthreads();
#if __CUDA_ARCH__ >= 900
    if constexpr (CL > 0) {
        // Every warp's sums share the block's maximum: weight 1 each (null).
        gqa_dec_cluster_merge<Tag, CL>(s_red, 0, s_m, s_l, s_recv, &s_bar, true, false, sink, sink_mode, out, b, N, H,
                                       j, group);
        return;
    }
#endif
    gqa_dec_write<Tag>(s_red, GQA_DEC_MAX_QH, (lanes * vpr + 31) / 32, s_m, s_l, sink, sink_mode, out, partial, b, N, H,
                       j, group, split, splits, direct);
    if (!direct && fold)
        gqa_dec_fold<Tag>(partial, counters, sink, sink_mode, out, b, N, H, j, group, splits, span.first, span.used);
}

// The block's state from its warps' (s_wm, s_wl [warp][GQA_DEC_MAX_GROUP], gqa_decode_regs): per
// query head g the maximum s_m [g] and sum s_l [g] over the warps, and warp w's weight in them,
// ws [w][g] = e^(s_wm − s_m) (0 for a warp with no weight), for GQA_DEC_WARPS warps. Thread (w, g)
// computes its own weight and, redundantly but in parallel, the head's sum; a __syncthreads must
// follow.
__device__ __forceinline__ void gqa_dec_combine(const float* s_wm, const float* s_wl, float* ws, float* s_m, float* s_l,
                                                unsigned group) {
    const unsigned tid = threadIdx.x;
    if (tid >= GQA_DEC_WARPS * group) return;
    const unsigned w = tid / group, g = tid - w * group;
    // Every warp's maximum and sum loaded at once, then the arithmetic: a chain of shared-memory
    // round trips and exponentials one warp after another took 1 µs.
    float m[GQA_DEC_WARPS], l[GQA_DEC_WARPS];
#pragma unroll
    for (unsigned x = 0; x < GQA_DEC_WARPS; ++x) {
        m[x] = s_wm[x * GQA_DEC_MAX_GROUP + g];
        l[x] = s_wl[x * GQA_DEC_MAX_GROUP + g];
    }
    float M = -__int_as_float(0x7f800000), L = 0.f, mine = 0.f;
#pragma unroll
    for (unsigned x = 0; x < GQA_DEC_WARPS; ++x)
        if (l[x] > 0.f) M = fmaxf(M, m[x]);
#pragma unroll
    for (unsigned x = 0; x < GQA_DEC_WARPS; ++x) {
        const float f = l[x] > 0.f ? expf(m[x] - M) : 0.f;
        L += f * l[x];
        mine = x == w ? f : mine;
    }
    ws[w * GQA_DEC_MAX_GROUP + g] = mine;
    if (w == 0) {
        s_m[g] = M;
        s_l[g] = L;
    }
}

// Decode attention by KV head over a thread block cluster, kiln_gqa_decode_cluster (the shim's
// choice for a short present and few keys in all). Block (split, j, b) takes an even share of the
// row's keys [start, end) on compute capability 9.0 (else, or where the present is not the past
// buffer and the block copies the rows it owns, keys [split·kpb, (split + 1)·kpb) ∩ [start, end)),
// in chunks of KR·256 / vpr keys (KR = 1 for groups of 8, else GQA_DEC_CLUSTER_KEYS):
// thread (key lane, 16-byte vector) loads its vector of the K and V rows of KR keys into
// registers at the start, before the append and the query rows, so their latency overlaps
// those, and the next chunk's while it computes one. Each warp runs an online softmax over its
// own keys with no block barrier: a key's score summed over its row's threads by warp shuffles,
// the running maximum, the weights and Σ weight·V of the thread's V vector; the warps' states
// are then combined (gqa_dec_combine) and the GQA_DEC_CLUSTER blocks' states merged through the
// cluster (gqa_dec_cluster_merge) on compute capability 9.0 and later; before it they fold
// (`fold` must be set). No dynamic shared memory; 2 blocks per SM (128 registers, none spilled
// below groups of 8: a spilled register that a load is still filling stalls the thread for the
// whole load). On an H100 these steps took a 30-layer batch-1 step's attention from 8.2 to about
// 6 µs per layer (bench/RESULTS.md, 2026-12-06, session 26). PLAIN: no bias, softcap, sink or
// window (the caller guarantees it), compiled without them.
#ifndef GQA_DEC_CLUSTER_KEYS
#define GQA_DEC_CLUSTER_KEYS 2  // KR of kiln_gqa_decode_cluster below groups of 8
#endif

template <typename Tag, int G, int CL, bool PLAIN = false, int FH = 0, int FG = 0,
          int KR = (G >= 8 ? 1 : GQA_DEC_CLUSTER_KEYS)>
__device__ void gqa_decode_regs(KILN_GQA_DECODE_PARAMS) {
    typedef typename Tag::storage T;
    const gqa_layout lay = KILN_GQA_LAYOUT;
    const unsigned VE = 16 / sizeof(T);  // elements per 16-byte vector
    __shared__ __align__(16) float q_s[GQA_DEC_MAX_QH];
    __shared__ float s_m[G], s_l[G];
    __shared__ float s_wm[GQA_DEC_WARPS][GQA_DEC_MAX_GROUP], s_wl[GQA_DEC_WARPS][GQA_DEC_MAX_GROUP];
    __shared__ __align__(16) float s_red[GQA_DEC_WARPS][GQA_DEC_MAX_QH];
    // The appended row (K rotated), which this block reads from here rather than from the present.
    __shared__ __align__(16) T s_new[2][GQA_DEC_MAX_ROW_BYTES / sizeof(T)];
    const unsigned split = blockIdx.x, j = blockIdx.y, b = blockIdx.z, splits = gridDim.x;
    if (PLAIN) {  // the compiler drops what these options add (0.5 µs of a layer's attention)
        has_bias = 0;
        softcap = 0.f;
        sink_mode = 0;
        window = -1;
    }
    // FH, FG: the head size and query group compiled in (kiln_gqa_decode_cluster_*_hg), else 0.
    if constexpr (FH > 0) H = FH;
    const unsigned group = FG > 0 ? (unsigned)FG : N / Nk;
    const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5;
    // The checks run in one thread once the block's loads are in flight, where it would wait for
    // them anyway (at the kernel's start, their loads and cold code delayed the block by 0.4 µs).
    const auto check = [&] {
        if (split == 0 && j == 0 && b == 0 && tid == 0)
            gqa_check(st, seqlens, gridDim.z, 1, 0, total, 0, 0, cache_rows, rotary_half);
    };
#if __CUDA_ARCH__ >= 900
    __shared__ __align__(16) float s_recv[gqa_dec_recv_floats<CL>()];
    __shared__ __align__(8) unsigned long long s_bar;
    if (CL > 0) gqa_dec_cluster_begin(&s_bar);
#endif
    long long start, end, pos;
    gqa_range(seqlens, b, 0, 1, 0, window, PL, &start, &end, &pos);
    GQA_MARK(3);  // the row's length read
    // The keys [lo, hi) this block attends to and the present rows it owns (gqa_dec_share_of):
    // split·kpb .. + kpb, or, where the cluster merges (compute capability 9.0; the fold before it
    // counts the splits by kpb) and the append writes only the new row (in place, or no append),
    // an even share of the row's keys.
    const bool in_place = pres_k == past_k && pres_v == past_v;
    const bool even = gqa_dec_even<CL>(append, in_place);
    const gqa_dec_share sh = gqa_dec_share_of(start, end, pos, split, splits, kpb, even);
    const long long lo = sh.lo, hi = sh.hi;
    const unsigned n = lo < hi ? (unsigned)(hi - lo) : 0;  // any count: the chunks below loop
    const unsigned vpr = H / VE;  // 16-byte vectors per K/V row (≤ 32)
    // Thread (key lane kl, vector vi) holds vector vi of the K and V rows of keys kl + u·lanes,
    // u < KR, of each chunk of KR·lanes keys; the first chunk's rows are loaded here, before the
    // append and the query rows (their latency overlaps), except rows this block writes first:
    // the new row (read from s_new), or every owned row when the present is not the past buffer
    // (loaded after the __syncthreads below).
    const auto late = [&](unsigned k) { return append && (!in_place || lo + (long long)k == pos); };
    const unsigned lanes = blockDim.x / vpr;
    const unsigned kl = tid / vpr, vi = tid - kl * vpr;
    const unsigned kw = (tid & ~31u) / vpr;  // the warp's first key lane
    const auto krow = [&](unsigned k) { return ((const uint4*)(pres_k + gqa_at(lay, b, j, lo + k, H)))[vi]; };
    const auto vrow = [&](unsigned k) { return ((const uint4*)(pres_v + gqa_at(lay, b, j, lo + k, H)))[vi]; };
    uint4 kraw[KR], vraw[KR];
#pragma unroll
    for (unsigned u = 0; u < KR; ++u) {
        const unsigned k = kl + u * lanes;
        const bool early = k < n && !late(k);
        kraw[u] = early ? krow(k) : make_uint4(0, 0, 0, 0);
        vraw[u] = early ? vrow(k) : make_uint4(0, 0, 0, 0);
    }
    GQA_EARLY_WAIT();
    // Key k's row vector vi: loaded above (first chunk), the appended row from s_new, else loaded.
    const auto kvec = [&](unsigned k, unsigned u, bool first, unsigned which) {
        const uint4* held = which ? vraw : kraw;
        return k >= n                     ? make_uint4(0, 0, 0, 0)
               : first && !late(k)        ? held[u]
               : append && lo + k == pos ? ((const uint4*)s_new[which])[vi]
               : which                    ? vrow(k)
                                          : krow(k);
    };
    gqa_dec_queries<Tag> queries{q_src, cos_c, sin_c, pos, cache_rows, q_w, rotary_half, interleaved, b, j, group, H};
    queries.start();
    if (append)
        gqa_decode_append<Tag>(k_src, v_src, past_k, past_v, cos_c, sin_c, pres_k, pres_v, sh.r0, sh.r1, j, b, Nk, H, PL,
                               P, pos, kv_w, k_off, v_off, cache_rows, rotary_half, interleaved, lay, s_new[0],
                               s_new[1]);
    GQA_MARK(4);  // the append written
    const bool merge_after = !fold && splits > 1;
    const gqa_dec_span span = gqa_dec_spans(start, end, kpb, splits, merge_after);
    const bool direct = !merge_after && span.used <= 1;
#if __CUDA_ARCH__ >= 900
    if constexpr (CL > 0)
        if (n == 0) {
            check();
            gqa_dec_cluster_merge<Tag, CL>(&s_red[0][0], &s_wm[0][0], s_m, s_l, s_recv, &s_bar, false, start >= end,
                                           sink, sink_mode, out, b, N, H, j, group);
            return;
        }
#endif
    if (n == 0) {
        check();
        if (merge_after || (span.used == 0 && split == 0))
            gqa_dec_empty<Tag>(out, partial, b, N, H, j, group, split, splits, !merge_after);
        return;
    }
    // 1. Query rows.
    check();
    queries.finish(q_s);
    __syncthreads();  // the appended rows and q_s
    GQA_MARK(5);
    // 2. Per warp, an online softmax over the warp's keys, with no block barrier: each thread's
    // products of its K vector with the query rows, summed over the key's vpr threads
    // (neighbouring lanes) by shuffles, so that every thread of a key holds its scores; the
    // warp's running maximum over its key lanes; the weights; Σ weight·V of the thread's V vector.
    const float ninf = -__int_as_float(0x7f800000);
    float acc[G][8], wm[G], wl[G];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        wm[g] = ninf;
        wl[g] = 0.f;
#pragma unroll
        for (int x = 0; x < 8; ++x) acc[g][x] = 0.f;
    }
    for (unsigned k0 = 0; k0 < n; k0 += KR * lanes) {
        if (k0 + kw >= n) break;  // the warp has no key from here on
        // This chunk's rows (the first as loaded above, the others as prefetched below), then
        // the next chunk's loads in flight into kraw, vraw while this one is computed.
        uint4 kr[KR], vr[KR];
#pragma unroll
        for (unsigned u = 0; u < KR; ++u) {
            kr[u] = k0 == 0 ? kvec(kl + u * lanes, u, true, 0) : kraw[u];
            vr[u] = k0 == 0 ? kvec(kl + u * lanes, u, true, 1) : vraw[u];
        }
        const unsigned k1 = k0 + KR * lanes;
        if (k1 + kw < n)
#pragma unroll
            for (unsigned u = 0; u < KR; ++u) {
                kraw[u] = kvec(k1 + kl + u * lanes, u, false, 0);
                vraw[u] = kvec(k1 + kl + u * lanes, u, false, 1);
            }
        float sc[KR][G];
#pragma unroll
        for (unsigned u = 0; u < KR; ++u) {
#pragma unroll
            for (int g = 0; g < G; ++g) sc[u][g] = ninf;
            if (k0 + kw + u * lanes >= n) continue;  // none of the warp's keys
            float dot[G];
#pragma unroll
            for (int g = 0; g < G; ++g) dot[g] = 0.f;
            gqa_dec_dot<Tag, G>(dot, kr[u], q_s, vi, H, group);
            for (unsigned o = 1; o < vpr; o <<= 1)
#pragma unroll
                for (int g = 0; g < G; ++g)
                    if (g < (int)group) dot[g] += __shfl_xor_sync(0xffffffffu, dot[g], o);
            const unsigned k = k0 + kl + u * lanes;
            if (k < n)
#pragma unroll
                for (int g = 0; g < G; ++g)
                    if (g < (int)group)
                        sc[u][g] = gqa_dec_score<Tag>(dot[g], lo + k, g, scale, softcap, bias, has_bias, bias_b,
                                                      bias_h, b, j, group, total);
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (g >= (int)group) break;
            float cm = sc[0][g];
#pragma unroll
            for (unsigned u = 1; u < KR; ++u) cm = fmaxf(cm, sc[u][g]);
            for (unsigned o = vpr; o < 32; o <<= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
            const float mn = fmaxf(wm[g], cm);
            if (mn == ninf) continue;  // no finite score yet
            const float alpha = expf(wm[g] - mn);  // 0 for the first keys
            wm[g] = mn;
            wl[g] *= alpha;
#pragma unroll
            for (int x = 0; x < 8; ++x) acc[g][x] *= alpha;
#pragma unroll
            for (unsigned u = 0; u < KR; ++u) {
                const float p = expf(sc[u][g] - mn);
                wl[g] += p;
                const T* e = (const T*)&vr[u];
#pragma unroll
                for (int x = 0; x < 8; ++x)
                    if (x < (int)VE) acc[g][x] += p * kiln_to_f32(Tag(), e[x]);
            }
        }
    }
    GQA_MARK(6);  // the warp's keys
    // 3. Each warp's state to shared memory: Σ weight·V reduced over its key lanes (lanes
    // vi + vpr·i) into s_red [warp], its maxima and sums into s_wm, s_wl [warp].
    gqa_dec_reduce<Tag, G>(acc, &s_red[0][0], GQA_DEC_MAX_QH, vpr, vi, H, group);
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (g >= (int)group) break;
        for (unsigned o = vpr; o < 32; o <<= 1) wl[g] += __shfl_xor_sync(0xffffffffu, wl[g], o);
        if (lane == 0) {
            s_wm[warp][g] = wm[g];
            s_wl[warp][g] = wl[g];
        }
    }
    __syncthreads();
    GQA_MARK(8);  // the warps' states
    // 4. The block's state from its warps' (GQA_DEC_WARPS of them: 256 threads).
    __shared__ float s_ws[GQA_DEC_WARPS][GQA_DEC_MAX_GROUP];
    gqa_dec_combine(&s_wm[0][0], &s_wl[0][0], &s_ws[0][0], s_m, s_l, group);
    __syncthreads();
#if __CUDA_ARCH__ >= 900
    if constexpr (CL > 0) {
        gqa_dec_cluster_merge<Tag, CL>(&s_red[0][0], &s_ws[0][0], s_m, s_l, s_recv, &s_bar, true, false, sink,
                                       sink_mode, out, b, N, H, j, group);
        return;
    }
#endif
    gqa_dec_write<Tag>(&s_red[0][0], GQA_DEC_MAX_QH, GQA_DEC_WARPS, s_m, s_l, sink, sink_mode, out, partial, b, N, H, j,
                       group, split, splits, direct, &s_ws[0][0]);
    if (!direct && fold)
        gqa_dec_fold<Tag>(partial, counters, sink, sink_mode, out, b, N, H, j, group, splits, span.first, span.used);
}

// Decode attention by KV head (S = 1, not a first prompt), gqa_decode_tiled, for grids with many
// keys in all (bandwidth-bound): block (split, j, b) reads keys [split·kpb, (split + 1)·kpb) ∩
// [start, end) of KV head j once, for all `group` query heads that share it:
// 1. the rows are copied into shared memory asynchronously (K, then V, as two groups:
//    the scores start while V still arrives), swizzled by 16-byte vector so that both one row
//    per thread (scores) and one row per 8 threads (Σ weight·V), or ldmatrix's eight rows, read
//    without bank conflicts; the group's query rows, rotated and rounded as the CPU reference
//    does, into shared memory;
// 2. the scores of every key against every query row, on tensor cores (float16, bfloat16 and H a
//    multiple of 16: gqa_dec_scores_mma) or one thread per key;
// 3. one warp per query row: max and Σ e^(x − max), the scores turned into weights;
// 4. Σ weight·V per query row, on tensor cores (gqa_dec_pv_mma) or by threads over (key lane,
//    16-byte V vector) reduced over the key lanes (warp shuffles), then over the warps in shared
//    memory over the dead K tile.
// With one split the block writes the output (sink_mode as gqa_attn); with several it writes
// the partial state of gqa_decode_split for the fold or kiln_gqa_merge. With `append` it first
// writes the present rows it owns (gqa_decode_append) instead of kiln_gqa_kv; those rows reach
// shared memory by plain loads after the block's barrier. Needs group ≤ GQA_DEC_MAX_GROUP,
// group·H ≤ GQA_DEC_MAX_QH, H·sizeof(T) a power of two multiple of 16 (at most 512 bytes),
// kpb ≤ GQA_DEC_KEYS, 256 threads, and gqa_decode_k_bytes(kpb, H·sizeof(T), group·H) +
// kpb·H·sizeof(T) bytes of dynamic shared memory.
template <typename Tag, int G>
__device__ void gqa_decode_tiled(KILN_GQA_DECODE_PARAMS) {
    typedef typename Tag::storage T;
    const gqa_layout lay = KILN_GQA_LAYOUT;
    const unsigned VE = 16 / sizeof(T);  // elements per 16-byte vector
    extern __shared__ __align__(16) unsigned char gqa_dyn[];
    __shared__ __align__(16) float q_s[GQA_DEC_MAX_QH];
    __shared__ float s_sc[G][GQA_DEC_KEYS];
    __shared__ float s_m[G], s_l[G];
    const unsigned split = blockIdx.x, j = blockIdx.y, b = blockIdx.z, splits = gridDim.x;
    const unsigned group = N / Nk, tid = threadIdx.x;
    const unsigned vpr = H / VE;  // 16-byte vectors per K/V row
    const unsigned row_bytes = H * (unsigned)sizeof(T);
    if (split == 0 && j == 0 && b == 0 && tid == 0)
        gqa_check(st, seqlens, gridDim.z, 1, 0, total, 0, 0, cache_rows, rotary_half);
    long long start, end, pos;
    gqa_range(seqlens, b, 0, 1, 0, window, PL, &start, &end, &pos);
    long long lo = (long long)split * kpb, hi = lo + kpb;
    if (lo < start) lo = start;
    if (hi > end) hi = end;
    const unsigned n = lo < hi ? (unsigned)(hi - lo) : 0;  // ≤ kpb ≤ GQA_DEC_KEYS = blockDim.x
    uint4* k_s = (uint4*)gqa_dyn;
    uint4* v_s = (uint4*)(gqa_dyn + gqa_decode_k_bytes(kpb, row_bytes, group * H));
    float* s_red = (float*)gqa_dyn;  // [GQA_DEC_WARPS][group·H], once the scores are computed
    // 1. Rows this block writes first (the new row, or every owned row when the present is not
    // the past buffer) are read after the barrier below; the others are copied now.
    const bool in_place = pres_k == past_k && pres_v == past_v;
    const auto late = [&](unsigned k) { return append && (!in_place || lo + (long long)k == pos); };
    // Thread tid copies 16-byte vector cu of keys key0, key0 + kstep, … (blockDim.x is a multiple of vpr,
    // a power of two), each key's offset computed once per row without a division: the copy loop
    // issues a block's 64 KiB at the rate the memory takes it (rows of a block may cross pages of a
    // paged layout).
    const unsigned lg_vpr = __ffs(vpr) - 1, cu = tid & (vpr - 1), key0 = tid >> lg_vpr, kstep = blockDim.x >> lg_vpr;
    const kiln_u64 kv_base = (kiln_u64)b * lay.row + (kiln_u64)j * lay.head + cu * VE;
    const auto at = [&](unsigned k) { return kv_base + gqa_at(gqa_layout{0, 0, lay.page, lay.shift}, 0, 0, lo + k, H); };
    for (unsigned k = key0; k < n; k += kstep)
        if (!late(k)) kiln_cp_async16(&k_s[kiln_swz(k, cu, vpr)], pres_k + at(k));
    kiln_cp_async_commit();
    for (unsigned k = key0; k < n; k += kstep)
        if (!late(k)) kiln_cp_async16(&v_s[kiln_swz(k, cu, vpr)], pres_v + at(k));
    kiln_cp_async_commit();
    gqa_dec_queries<Tag> queries{q_src, cos_c, sin_c, pos, cache_rows, q_w, rotary_half, interleaved, b, j, group, H};
    queries.start();
    if (append)
        gqa_decode_append<Tag>(k_src, v_src, past_k, past_v, cos_c, sin_c, pres_k, pres_v, (long long)split * kpb,
                               (long long)split * kpb + kpb, j, b, Nk, H, PL, P, pos, kv_w, k_off, v_off, cache_rows,
                               rotary_half, interleaved, lay);
    const bool merge_after = !fold && splits > 1;
    const gqa_dec_span span = gqa_dec_spans(start, end, kpb, splits, merge_after);
    const bool direct = !merge_after && span.used <= 1;
    if (n == 0) {
        if (merge_after || (span.used == 0 && split == 0))
            gqa_dec_empty<Tag>(out, partial, b, N, H, j, group, split, splits, !merge_after);
        kiln_cp_async_wait<0>();
        return;
    }
    queries.finish(q_s);
    if (append) {
        __syncthreads();  // the appended rows
        for (unsigned k = key0; k < n; k += kstep)
            if (late(k)) {
                k_s[kiln_swz(k, cu, vpr)] = *(const uint4*)(pres_k + at(k));
                v_s[kiln_swz(k, cu, vpr)] = *(const uint4*)(pres_v + at(k));
            }
    }
    const bool tc = gqa_dec_tc<Tag>(H);
    if (tc)  // the V rows of the last 16-key step past n (no copy targets them)
        for (unsigned i = n * vpr + tid; i < ((n + 15) & ~15u) * vpr; i += blockDim.x)
            v_s[kiln_swz(i / vpr, i % vpr, vpr)] = make_uint4(0, 0, 0, 0);
    kiln_cp_async_wait<1>();
    __syncthreads();  // K in shared memory, q_s
    // 2. Scores: on tensor cores, or one key per thread (n ≤ blockDim.x).
    if constexpr (kiln_has_mma<Tag>::value)
        if (tc)
            gqa_dec_scores_mma<Tag, G>(k_s, q_s, s_sc, n, vpr, H, lo, scale, softcap, bias, has_bias, bias_b, bias_h, b,
                                       j, group, total);
    if (!tc && tid < n) {
        const unsigned k = tid;
        float dot[G];
#pragma unroll
        for (int g = 0; g < G; ++g) dot[g] = 0.f;
        for (unsigned c0 = 0; c0 < vpr; c0 += GQA_DEC_ROW_VECS) {
            uint4 raw[GQA_DEC_ROW_VECS];
#pragma unroll
            for (unsigned u = 0; u < GQA_DEC_ROW_VECS; ++u)
                if (c0 + u < vpr) raw[u] = k_s[kiln_swz(k, c0 + u, vpr)];
#pragma unroll
            for (unsigned u = 0; u < GQA_DEC_ROW_VECS; ++u) {
                if (c0 + u >= vpr) break;
                gqa_dec_dot<Tag, G>(dot, raw[u], q_s, c0 + u, H, group);
            }
        }
        gqa_dec_scores<Tag, G>(dot, s_sc, k, lo, scale, softcap, bias, has_bias, bias_b, bias_h, b, j, group, total);
    }
    __syncthreads();
    // 3. Weights, one warp per query row.
    gqa_dec_weights(s_sc, s_m, s_l, n, group);
    kiln_cp_async_wait<0>();
    __syncthreads();  // the weights, V in shared memory
    // 4. Σ weight·V into s_red [warp][group·H], then over the warps: on tensor cores, or thread
    // (key lane kl, vector vi) with GQA_DEC_V_KEYS rows read together, reduced over the key lanes of
    // a warp (lanes vi + vpr·i).
    unsigned warps_used = (n + 31) / 32;
    if constexpr (kiln_has_mma<Tag>::value)
        if (tc) gqa_dec_pv_mma<Tag>(v_s, s_sc, s_red, group * H, n, vpr, H, group);
    if (!tc) {
        const unsigned lanes = blockDim.x / vpr;
        const unsigned kl = tid / vpr, vi = tid - kl * vpr;
        float acc[G][8];
#pragma unroll
        for (int g = 0; g < G; ++g)
#pragma unroll
            for (int x = 0; x < 8; ++x) acc[g][x] = 0.f;
        for (unsigned k0 = kl; k0 < n; k0 += GQA_DEC_V_KEYS * lanes) {
            uint4 raw[GQA_DEC_V_KEYS];
#pragma unroll
            for (unsigned u = 0; u < GQA_DEC_V_KEYS; ++u) {
                const unsigned k = k0 + u * lanes;
                if (k < n) raw[u] = v_s[kiln_swz(k, vi, vpr)];
            }
#pragma unroll
            for (unsigned u = 0; u < GQA_DEC_V_KEYS; ++u) {
                const unsigned k = k0 + u * lanes;
                if (k >= n) break;
                gqa_dec_accumulate<Tag, G>(acc, raw[u], s_sc, k, group);
            }
        }
        gqa_dec_reduce<Tag, G>(acc, s_red, group * H, vpr, vi, H, group);
        warps_used = (lanes * vpr + 31) / 32;
    }
    __syncthreads();
    gqa_dec_write<Tag>(s_red, group * H, warps_used, s_m, s_l, sink, sink_mode, out, partial, b, N, H, j, group, split,
                       splits, direct);
    if (!direct && fold)
        gqa_dec_fold<Tag>(partial, counters, sink, sink_mode, out, b, N, H, j, group, splits, span.first, span.used);
}

// Merges the splits of gqa_decode_split for head h = blockIdx.x, batch row b = blockIdx.y,
// with the sink (sink_mode as gqa_attn), into out [B, 1, N·H]. A row with no key to attend
// to gets zeros, as in gqa_attn. Up to GQA_MERGE_FEW splits, each thread merges its dimensions
// alone. Beyond, the block shares the work: the splits' maxima and weights
// exp(m_s − M) are computed once into shared memory (GQA_MERGE_CHUNK splits at a time), and
// each thread then sums its dimensions over the splits with the loads of several splits in
// flight, so a long context's many splits cost a few memory round trips, not one per split.
#define GQA_MERGE_CHUNK 1024
#define GQA_MERGE_UNROLL 8  // splits' loads in flight per thread
#define GQA_MERGE_FEW 8  // at most this many splits merge per thread, without shared memory

template <typename Tag>
__device__ void gqa_decode_merge(const float* partial, const int* seqlens, const typename Tag::storage* sink,
                                 typename Tag::storage* out, unsigned N, unsigned H, unsigned PL, int window,
                                 unsigned splits, unsigned sink_mode) {
    __shared__ float s_w[GQA_MERGE_CHUNK];
    __shared__ float s_red[32];
    const unsigned h = blockIdx.x, b = blockIdx.y, tid = threadIdx.x;
    long long start, end, pos;
    gqa_range(seqlens, b, 0, 1, 0, window, PL, &start, &end, &pos);
    typename Tag::storage* o = out + (kiln_u64)b * N * H + (kiln_u64)h * H;
    if (start >= end) {
        for (unsigned d = tid; d < H; d += blockDim.x) o[d] = kiln_from_f32(Tag(), 0.f);
        return;
    }
    const kiln_u64 stride = H + 2;
    const float* part = partial + ((kiln_u64)b * N + h) * splits * stride;
    if (splits <= GQA_MERGE_FEW) {
        // Few splits (a short context): each thread folds them alone, with no barrier.
        float M = -__int_as_float(0x7f800000);
        for (unsigned s = 0; s < splits; ++s)
            if (part[s * stride + 1] > 0.f) M = fmaxf(M, part[s * stride]);
        float sink_v = 0.f;
        if (sink_mode == 2) sink_v = kiln_to_f32(Tag(), sink[h]);
        if (sink_mode != 0) M = fmaxf(M, sink_v);
        float w[GQA_MERGE_FEW];
        float den = sink_mode != 0 ? expf(sink_v - M) : 0.f;
#pragma unroll
        for (unsigned s = 0; s < GQA_MERGE_FEW; ++s) {
            const float l = s < splits ? part[s * stride + 1] : 0.f;
            w[s] = l > 0.f ? expf(part[s * stride] - M) : 0.f;
            den += l * w[s];
        }
        for (unsigned d = tid; d < H; d += blockDim.x) {
            float v = 0.f;
#pragma unroll
            for (unsigned s = 0; s < GQA_MERGE_FEW; ++s)
                if (w[s] > 0.f) v += part[s * stride + 2 + d] * w[s];  // an empty split's sums are unset
            o[d] = kiln_from_f32(Tag(), v / den);
        }
        return;
    }
    // 1. The largest running maximum of the splits that saw a key, and the sink's.
    float M = -__int_as_float(0x7f800000);
    for (unsigned s = tid; s < splits; s += blockDim.x)
        if (part[s * stride + 1] > 0.f) M = fmaxf(M, part[s * stride]);
    M = kiln_block_reduce(M, s_red, true);
    float sink_v = 0.f;
    if (sink_mode == 2) sink_v = kiln_to_f32(Tag(), sink[h]);
    if (sink_mode != 0) M = fmaxf(M, sink_v);
    // 2. Per chunk of splits: weights into shared memory, the denominator, and each thread's
    // dimensions (at most 8 per thread: H ≤ 8·blockDim.x).
    float acc[8];
#pragma unroll
    for (int x = 0; x < 8; ++x) acc[x] = 0.f;
    float den = 0.f;
    for (unsigned c0 = 0; c0 < splits; c0 += GQA_MERGE_CHUNK) {
        const unsigned cn = splits - c0 < GQA_MERGE_CHUNK ? splits - c0 : GQA_MERGE_CHUNK;
        float l_part = 0.f;
        for (unsigned s = tid; s < cn; s += blockDim.x) {
            const float* p = part + (kiln_u64)(c0 + s) * stride;
            const float l = p[1];
            const float w = l > 0.f ? expf(p[0] - M) : 0.f;
            s_w[s] = w;
            l_part += l * w;
        }
        den += kiln_block_reduce(l_part, s_red, false);  // its barriers also publish s_w
#pragma unroll
        for (int x = 0; x < 8; ++x) {
            const unsigned d = tid + (unsigned)x * blockDim.x;
            if (d >= H) break;
            const float* col = part + (kiln_u64)c0 * stride + 2 + d;
            float a = 0.f;
            unsigned s = 0;
            for (; s + GQA_MERGE_UNROLL <= cn; s += GQA_MERGE_UNROLL) {
                float v[GQA_MERGE_UNROLL];
#pragma unroll
                for (int u = 0; u < GQA_MERGE_UNROLL; ++u) v[u] = col[(kiln_u64)(s + u) * stride];
#pragma unroll
                for (int u = 0; u < GQA_MERGE_UNROLL; ++u) a += s_w[s + u] > 0.f ? v[u] * s_w[s + u] : 0.f;
            }
            // An empty split's sums are unset (any bits): its weight 0 must not meet them.
            for (; s < cn; ++s) a += s_w[s] > 0.f ? col[(kiln_u64)s * stride] * s_w[s] : 0.f;
            acc[x] += a;
        }
        __syncthreads();  // s_w is rewritten by the next chunk
    }
    if (sink_mode != 0) den += expf(sink_v - M);
#pragma unroll
    for (int x = 0; x < 8; ++x) {
        const unsigned d = tid + (unsigned)x * blockDim.x;
        if (d >= H) break;
        o[d] = kiln_from_f32(Tag(), acc[x] / den);
    }
}

// RotaryEmbedding (com.microsoft's, and ONNX's RotaryEmbedding-23): y = x with the first
// R = 2·half elements of every head rotated at the row's position: pos[b·S + s] (pos_mode 0),
// pos[0] + s (1), or b·S + s over caches of [B, S, half] without position_ids (2). Layout
// [B, S, N·H] or, transposed, [B, N, S, H]. One thread per element (grid-stride).
template <typename Tag>
__device__ void rope(const typename Tag::storage* x, const long long* pos_ids, const typename Tag::storage* cos_c,
                     const typename Tag::storage* sin_c, typename Tag::storage* y, kiln_u64 total, unsigned S,
                     unsigned N, unsigned H, unsigned half, kiln_u64 cache_rows, unsigned transposed,
                     unsigned pos_mode, unsigned interleaved, kiln_status* st) {
    KILN_FOR(i, total) {
        const unsigned d = (unsigned)(i % H);
        if (d >= 2 * half && (half > 0 || d > 0)) {
            y[i] = x[i];
            continue;
        }
        unsigned s, b;
        if (transposed) {
            s = (unsigned)((i / H) % S);
            b = (unsigned)(i / ((kiln_u64)H * S * N));
        } else {
            s = (unsigned)((i / ((kiln_u64)H * N)) % S);
            b = (unsigned)(i / ((kiln_u64)H * N * S));
        }
        // pos_mode 0: position_ids [B, S]; 1: one start position; 2: no ids, caches [B, S, half].
        const long long p = pos_mode == 1   ? pos_ids[0] + (long long)s
                            : pos_mode == 2 ? (long long)b * S + s
                                            : pos_ids[(kiln_u64)b * S + s];
        if (d == 0 && (p < 0 || (kiln_u64)p >= cache_rows)) kiln_fail(st, 4, p, (long long)cache_rows);
        if (half == 0) {  // nothing to rotate: the position was only checked
            y[i] = x[i];
            continue;
        }
        y[i] = kiln_from_f32(Tag(), rope_elem<Tag>(x + (i - d), cos_c, sin_c, p, cache_rows, half, d, interleaved));
    }
}


// The kernels, templates over the prelude's dtype tag (and the decode kernels over the query heads
// per KV head, G), instantiated by the name expressions kernel.toml lists (schema 6).

// Decode attention by KV head, K/V rows loaded into registers (G query heads per block).
template <typename Tag, int G>
__global__ void __launch_bounds__(256, 2) kiln_gqa_decode(KILN_GQA_DECODE_PARAMS) {
    gqa_decode_rows<Tag, G>(KILN_GQA_DECODE_ARGS);
}

// Decode attention by KV head over GQA_DEC_CLUSTER splits (grid [GQA_DEC_CLUSTER, Nk, B] exactly:
// each cluster is one (KV head, batch row), and each block writes a slice of its output), K/V rows
// in registers, the splits merged through a thread block cluster on compute capability 9.0 and
// later (folded before it: the shim sets `fold`): gqa_decode_regs. G query heads per block.
#if __CUDA_ARCH__ >= 900
#define KILN_GQA_CLUSTER_DIMS __cluster_dims__(GQA_DEC_CLUSTER, 1, 1)
#define KILN_GQA_CLUSTER_WIDE_DIMS __cluster_dims__(GQA_DEC_CLUSTER_WIDE, 1, 1)
#else
#define KILN_GQA_CLUSTER_DIMS
#define KILN_GQA_CLUSTER_WIDE_DIMS
#endif
template <typename Tag, int G>
__global__ void KILN_GQA_CLUSTER_DIMS __launch_bounds__(256, 2) kiln_gqa_decode_cluster(KILN_GQA_DECODE_PARAMS) {
    gqa_decode_regs<Tag, G, GQA_DEC_CLUSTER>(KILN_GQA_DECODE_ARGS);
}

// Decode attention by KV head over GQA_DEC_CLUSTER splits merged through a thread block cluster
// (grid [GQA_DEC_CLUSTER, Nk, B] exactly), each block over an even share of the row's keys (at
// most kpb ≤ GQA_DEC_KEYS) with every row of it in flight at once: gqa_decode_rows, the rows
// copied into gqa_decode_k_bytes(kpb, H·sizeof(T), GQA_DEC_MAX_QH) + kpb·H·sizeof(T) bytes of
// dynamic shared memory. The shim's
// choice for shares longer than one chunk of kiln_gqa_decode_cluster.
template <typename Tag, int G>
__global__ void KILN_GQA_CLUSTER_DIMS __launch_bounds__(256, 2) kiln_gqa_decode_cluster_rows(KILN_GQA_DECODE_PARAMS) {
    gqa_decode_rows<Tag, G, GQA_DEC_CLUSTER>(KILN_GQA_DECODE_ARGS);
}

// kiln_gqa_decode_cluster_rows over GQA_DEC_CLUSTER_WIDE splits (grid [GQA_DEC_CLUSTER_WIDE, Nk,
// B] exactly): a cluster of 16 blocks, past the 8 that CUDA guarantees (the host allows it at
// load: CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED, which Hopper grants to clusters of
// 16 small blocks). The shim's choice for presents of 2,049 to 4,096 positions at a few rows:
// at batch 1 over a 4,096 cache on an H100, 12.70 µs per launch at position 4,094 against 13.92
// for kiln_gqa_decode's 16 folded splits (bench/attn_probe.cu, L2 flushed; bench/RESULTS.md,
// 2026-12-06, session 28).
template <typename Tag, int G>
__global__ void KILN_GQA_CLUSTER_WIDE_DIMS __launch_bounds__(256, 2)
    kiln_gqa_decode_cluster16_rows(KILN_GQA_DECODE_PARAMS) {
    gqa_decode_rows<Tag, G, GQA_DEC_CLUSTER_WIDE>(KILN_GQA_DECODE_ARGS);
}

// kiln_gqa_decode_cluster for a node without bias, softcap, sink or window (gqa_decode_regs' PLAIN).
template <typename Tag, int G>
__global__ void KILN_GQA_CLUSTER_DIMS __launch_bounds__(256, 2) kiln_gqa_decode_cluster_plain(KILN_GQA_DECODE_PARAMS) {
    gqa_decode_regs<Tag, G, GQA_DEC_CLUSTER, true>(KILN_GQA_DECODE_ARGS);
}

// The cluster kernels with the head size HS and the query group GS (num_heads / kv_num_heads)
// compiled in, for the shapes of common models (the shim's choice where the node's match; the
// kernel then ignores its head-size argument and N / Nk): the divisions by them become shifts and
// multiplications by constants, and their loops unroll. On an H100 a 30-layer batch-1 decode layer
// (bench/layer_probe.cu, head size 64, group 3) took 15.02 µs against 16.26 with both runtime, 15.60
// with the head size alone compiled in and 15.81 with the group alone (bench/RESULTS.md,
// 2026-12-06, session 30).

// The group rounded up to a power of two: the per-thread arrays' G, as the shim's runtime kernels.
constexpr int gqa_group_pow2(int gs) { return gs <= 1 ? 1 : gs <= 2 ? 2 : gs <= 4 ? 4 : 8; }
template <typename Tag, int HS, int GS>
__global__ void KILN_GQA_CLUSTER_DIMS __launch_bounds__(256, 2)
    kiln_gqa_decode_cluster_plain_hg(KILN_GQA_DECODE_PARAMS) {
    gqa_decode_regs<Tag, gqa_group_pow2(GS), GQA_DEC_CLUSTER, true, HS, GS>(KILN_GQA_DECODE_ARGS);
}
template <typename Tag, int HS, int GS>
__global__ void KILN_GQA_CLUSTER_DIMS __launch_bounds__(256, 2)
    kiln_gqa_decode_cluster_rows_hg(KILN_GQA_DECODE_PARAMS) {
    gqa_decode_rows<Tag, gqa_group_pow2(GS), GQA_DEC_CLUSTER, HS, GS>(KILN_GQA_DECODE_ARGS);
}
template <typename Tag, int HS, int GS>
__global__ void KILN_GQA_CLUSTER_WIDE_DIMS __launch_bounds__(256, 2)
    kiln_gqa_decode_cluster16_rows_hg(KILN_GQA_DECODE_PARAMS) {
    gqa_decode_rows<Tag, gqa_group_pow2(GS), GQA_DEC_CLUSTER_WIDE, HS, GS>(KILN_GQA_DECODE_ARGS);
}

// Decode attention by KV head, K/V tiles copied into shared memory (G query heads per block).
template <typename Tag, int G>
__global__ void __launch_bounds__(256, G <= 4 ? 3 : 2) kiln_gqa_decode_tiled(KILN_GQA_DECODE_PARAMS) {
    gqa_decode_tiled<Tag, G>(KILN_GQA_DECODE_ARGS);
}

// The present K/V: past rows copied, new rows rotated and appended.
template <typename Tag>
__global__ void kiln_gqa_kv(const typename Tag::storage* k_src, const typename Tag::storage* v_src,
                            const typename Tag::storage* past_k, const typename Tag::storage* past_v,
                            const int* seqlens, const typename Tag::storage* cos_c, const typename Tag::storage* sin_c,
                            typename Tag::storage* pres_k, typename Tag::storage* pres_v, unsigned B, unsigned S,
                            unsigned Nk, unsigned H, unsigned PL, unsigned P, kiln_u64 kv_w, kiln_u64 k_off,
                            kiln_u64 v_off, unsigned first_prompt, unsigned shared, kiln_u64 cache_rows,
                            unsigned rotary_half, unsigned interleaved, unsigned total, KILN_GQA_LAYOUT_PARAMS,
                            kiln_status* st) {
    gqa_kv<Tag>(k_src, v_src, past_k, past_v, seqlens, cos_c, sin_c, pres_k, pres_v, B, S, Nk, H, PL, P, kv_w, k_off,
                v_off, first_prompt, shared, cache_rows, rotary_half, interleaved, total, KILN_GQA_LAYOUT, st);
}

// Attention of one query row per block (the general path: bias, sinks, softcap).
template <typename Tag>
__global__ void kiln_gqa_attn(const typename Tag::storage* q_src, const typename Tag::storage* pres_k,
                              const typename Tag::storage* pres_v, const int* seqlens,
                              const typename Tag::storage* cos_c, const typename Tag::storage* sin_c,
                              const typename Tag::storage* bias, const typename Tag::storage* sink,
                              typename Tag::storage* out, unsigned S, unsigned N, unsigned Nk, unsigned H, unsigned PL,
                              kiln_u64 q_w, unsigned first_prompt, kiln_u64 cache_rows, unsigned rotary_half,
                              unsigned interleaved, float scale, float softcap, int window, unsigned has_bias,
                              unsigned bias_b, unsigned bias_h, unsigned total, unsigned sink_mode,
                              KILN_GQA_LAYOUT_PARAMS, kiln_status* st) {
    gqa_attn<Tag>(q_src, pres_k, pres_v, seqlens, cos_c, sin_c, bias, sink, out, S, N, Nk, H, PL, q_w, first_prompt,
                  cache_rows, rotary_half, interleaved, scale, softcap, window, has_bias, bias_b, bias_h, total,
                  sink_mode, KILN_GQA_LAYOUT, st);
}

// Prompt attention by tiles on tensor cores (S > 1, no bias, softcap or sink; float16 or
// bfloat16; head size HD = H, 64 or 128): block (query tile, h, b) takes GQA_PFM_ROWS query rows
// s0 … of head h, batch row b, 16 per warp, and walks the keys any of them attends to in tiles
// of gqa_pfm_keys(HD), each tile's K and V rows copied into shared memory (cp.async, the next tile's
// copies in flight while the warps work on this one), as FlashAttention-2 does:
// 1. the block's query rows, rotated and rounded as gqa_attn does, into shared memory, then each
//    warp's 16 rows into registers as mma A fragments;
// 2. per tile, kiln-cuda-std's kiln_flash_tile (flash.cuh): the warp's scores S = Q·Kᵀ, scaled and
//    masked by each row's causal and window range, the rows' online softmax in registers, and
//    O += P·V with about 22 bits of each weight (as gqa_dec_pv_mma).
// The output is O / Σ weight (zeros for a row with no key), as gqa_attn's.
#define GQA_PFM_ROWS 64
#define GQA_PFM_THREADS 128

// Keys per tile at head size HD: 64, and 32 at 128 (shared memory within the 48 KiB every device
// grants, and fewer score registers).
__host__ __device__ constexpr unsigned gqa_pfm_keys(unsigned HD) { return HD > 64 ? 32 : 64; }

// Dynamic shared memory of kiln_gqa_prefill_mma at head size HD: the query rows, and two K and V
// tiles, of 16-bit elements (40 KiB at 64, 48 KiB at 128).
__host__ __device__ constexpr unsigned gqa_pfm_smem(unsigned HD) {
    return (GQA_PFM_ROWS + 4 * gqa_pfm_keys(HD)) * HD * 2;
}

template <typename Tag, int HD>
__device__ void gqa_prefill_mma(const typename Tag::storage* q_src, const typename Tag::storage* pres_k,
                                const typename Tag::storage* pres_v, const int* seqlens,
                                const typename Tag::storage* cos_c, const typename Tag::storage* sin_c,
                                typename Tag::storage* out, unsigned S, unsigned N, unsigned Nk, unsigned PL,
                                kiln_u64 q_w, unsigned first_prompt, kiln_u64 cache_rows, unsigned rotary_half,
                                unsigned interleaved, float scale, int window, unsigned total, gqa_layout lay,
                                kiln_status* st) {
    typedef typename Tag::storage T;
    constexpr unsigned VPR = HD / 8;  // 16-byte vectors per row
    constexpr unsigned KS = HD / 16;  // 16-dimension steps of Q·Kᵀ
    constexpr unsigned KEYS = gqa_pfm_keys(HD);
    const float NEG_INF = -__int_as_float(0x7f800000);
    extern __shared__ __align__(16) unsigned char gqa_dyn[];
    uint4* const q_s = (uint4*)gqa_dyn;                   // [GQA_PFM_ROWS][VPR]
    uint4* const kv_s = q_s + GQA_PFM_ROWS * VPR;         // [2][K, V][KEYS][VPR]
    const unsigned s0 = blockIdx.x * GQA_PFM_ROWS, h = blockIdx.y, b = blockIdx.z;
    const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5, g = lane >> 2;
    if (blockIdx.x == 0 && h == 0 && b == 0 && tid == 0)
        gqa_check(st, seqlens, gridDim.z, S, first_prompt, total, 0, 0, cache_rows, rotary_half);
    const unsigned j = h / (N / Nk);
    const unsigned rows = S - s0 < GQA_PFM_ROWS ? S - s0 : GQA_PFM_ROWS;
    long long lo, hi;  // the block's keys
    gqa_rows_keys(seqlens, b, s0, rows, S, first_prompt, window, PL, &lo, &hi);
    // This lane's two rows (g and g + 8 of the warp's 16): their key ranges ([0, 0) past the prompt).
    long long ra[2] = {0, 0}, re[2] = {0, 0};
#pragma unroll
    for (unsigned i = 0; i < 2; ++i) {
        const unsigned r = 16 * warp + g + 8 * i;
        long long p;
        if (r < rows) gqa_range(seqlens, b, s0 + r, S, first_prompt, window, PL, &ra[i], &re[i], &p);
    }
    // The warp's keys (warp-uniform): tiles outside them are skipped.
    long long wlo = ra[0] < re[0] ? ra[0] : (long long)PL, whi = re[0];
    if (ra[1] < re[1]) {
        wlo = ra[1] < wlo ? ra[1] : wlo;
        whi = re[1] > whi ? re[1] : whi;
    }
#pragma unroll
    for (unsigned o = 16; o > 0; o >>= 1) {
        wlo = min(wlo, __shfl_xor_sync(0xffffffffu, wlo, o));
        whi = max(whi, __shfl_xor_sync(0xffffffffu, whi, o));
    }
    // 1. Query rows (zeros past the prompt), rotated and rounded.
    for (unsigned i = tid; i < GQA_PFM_ROWS * HD; i += blockDim.x) {
        const unsigned r = i / HD, d = i - r * HD;
        float x = 0.f;
        if (r < rows) {
            long long a, e, pos;
            gqa_range(seqlens, b, s0 + r, S, first_prompt, window, PL, &a, &e, &pos);
            const T* qr = q_src + ((kiln_u64)b * S + s0 + r) * q_w + (kiln_u64)h * HD;
            x = gqa_query_elem<Tag>(qr, cos_c, sin_c, pos, cache_rows, rotary_half, d, interleaved);
        }
        ((T*)&q_s[kiln_swz(r, d / 8, VPR)])[d % 8] = kiln_from_f32(Tag(), x);
    }
    // Tile `it` (keys lo + KEYS·it …) into buffer it & 1: cp.async for keys below hi, zeros past it
    // (a weight of 0 would not clear NaN bits there).
    const auto load_tile = [&](unsigned it) {
        uint4* const k_t = kv_s + (it & 1u) * 2 * KEYS * VPR;
        uint4* const v_t = k_t + KEYS * VPR;
        const long long t0 = lo + (long long)KEYS * it;
        for (unsigned i = tid; i < KEYS * VPR; i += blockDim.x) {
            const unsigned k = i / VPR, u = i % VPR;
            const unsigned at = kiln_swz(k, u, VPR);
            if (t0 + k < hi) {
                const kiln_u64 src = gqa_at(lay, b, j, t0 + k, HD) + u * 8;
                kiln_cp_async16(&k_t[at], pres_k + src);
                kiln_cp_async16(&v_t[at], pres_v + src);
            } else {
                k_t[at] = make_uint4(0, 0, 0, 0);
                v_t[at] = make_uint4(0, 0, 0, 0);
            }
        }
        kiln_cp_async_commit();
    };
    const unsigned tiles = lo < hi ? (unsigned)((hi - lo + KEYS - 1) / KEYS) : 0;
    if (tiles > 0) load_tile(0);
    __syncthreads();  // q_s
    unsigned qa[KS][4];
    kiln_flash_load_q<HD>(qa, q_s);
    kiln_flash_rows<HD> f;
    kiln_flash_init(f);
    kiln_flash_pipeline(tiles, load_tile, [&](unsigned it) {
        const long long t0 = lo + (long long)KEYS * it;
        if (whi > t0 && wlo < t0 + KEYS) {
            const uint4* const k_t = kv_s + (it & 1u) * 2 * KEYS * VPR;
            // 2.–4. Scores scaled and masked by each row's causal and window range, the online
            // softmax, O += P·V.
            kiln_flash_tile<Tag, HD, KEYS>(f, qa, k_t, k_t + KEYS * VPR, [&](unsigned r, unsigned key, float qk) {
                const long long t = t0 + key;
                return t >= ra[r] && t < re[r] ? qk * scale : NEG_INF;
            });
        }
    });
    // Out: O / Σ weight (zeros for a row with no key).
    kiln_flash_finish(f);
#pragma unroll
    for (unsigned r = 0; r < 2; ++r) {
        const unsigned row = 16 * warp + g + 8 * r;
        if (row >= rows) continue;
        T* const dst = out + ((kiln_u64)b * S + s0 + row) * ((kiln_u64)N * HD) + (kiln_u64)h * HD;
        kiln_flash_store_row<Tag, HD>(f, r, dst, f.l[r] > 0.f ? 1.f / f.l[r] : 0.f);
    }
}

// Prompt attention by tiles of query rows and keys.
template <typename Tag>
__global__ void __launch_bounds__(GQA_PF_WARPS * 32)
    kiln_gqa_prefill(const typename Tag::storage* q_src, const typename Tag::storage* pres_k,
                     const typename Tag::storage* pres_v, const int* seqlens, const typename Tag::storage* cos_c,
                     const typename Tag::storage* sin_c, typename Tag::storage* out, unsigned S, unsigned N,
                     unsigned Nk, unsigned H, unsigned PL, kiln_u64 q_w, unsigned first_prompt, kiln_u64 cache_rows,
                     unsigned rotary_half, unsigned interleaved, float scale, int window, unsigned total,
                     KILN_GQA_LAYOUT_PARAMS, kiln_status* st) {
    gqa_prefill<Tag>(q_src, pres_k, pres_v, seqlens, cos_c, sin_c, out, S, N, Nk, H, PL, q_w, first_prompt, cache_rows,
                     rotary_half, interleaved, scale, window, total, KILN_GQA_LAYOUT, st);
}

// Prompt attention by tiles of query rows and keys on tensor cores (head size HD).
template <typename Tag, int HD>
__global__ void __launch_bounds__(GQA_PFM_THREADS)
    kiln_gqa_prefill_mma(const typename Tag::storage* q_src, const typename Tag::storage* pres_k,
                         const typename Tag::storage* pres_v, const int* seqlens, const typename Tag::storage* cos_c,
                         const typename Tag::storage* sin_c, typename Tag::storage* out, unsigned S, unsigned N,
                         unsigned Nk, unsigned H, unsigned PL, kiln_u64 q_w, unsigned first_prompt,
                         kiln_u64 cache_rows, unsigned rotary_half, unsigned interleaved, float scale, int window,
                         unsigned total, KILN_GQA_LAYOUT_PARAMS, kiln_status* st) {
    (void)H;  // = HD: the shim picks the instantiation by head size
    gqa_prefill_mma<Tag, HD>(q_src, pres_k, pres_v, seqlens, cos_c, sin_c, out, S, N, Nk, PL, q_w, first_prompt,
                             cache_rows, rotary_half, interleaved, scale, window, total, KILN_GQA_LAYOUT, st);
}

// Decode attention by query head, split along the keys (partials for kiln_gqa_merge).
template <typename Tag>
__global__ void kiln_gqa_split(const typename Tag::storage* q_src, const typename Tag::storage* pres_k,
                               const typename Tag::storage* pres_v, const int* seqlens,
                               const typename Tag::storage* cos_c, const typename Tag::storage* sin_c,
                               const typename Tag::storage* bias, float* partial, unsigned N, unsigned Nk, unsigned H,
                               unsigned PL, kiln_u64 q_w, kiln_u64 cache_rows, unsigned rotary_half,
                               unsigned interleaved, float scale, float softcap, int window, unsigned has_bias,
                               unsigned bias_b, unsigned bias_h, unsigned total, unsigned chunk,
                               KILN_GQA_LAYOUT_PARAMS, kiln_status* st) {
    gqa_decode_split<Tag>(q_src, pres_k, pres_v, seqlens, cos_c, sin_c, bias, partial, N, Nk, H, PL, q_w, cache_rows,
                          rotary_half, interleaved, scale, softcap, window, has_bias, bias_b, bias_h, total, chunk,
                          KILN_GQA_LAYOUT, st);
}

// The merge of the splits' partials (log-sum-exp), with the sink.
template <typename Tag>
__global__ void kiln_gqa_merge(const float* partial, const int* seqlens, const typename Tag::storage* sink,
                               typename Tag::storage* out, unsigned N, unsigned H, unsigned PL, int window,
                               unsigned splits, unsigned sink_mode) {
    gqa_decode_merge<Tag>(partial, seqlens, sink, out, N, H, PL, window, splits, sink_mode);
}

// RotaryEmbedding, one thread per element.
template <typename Tag>
__global__ void kiln_rope(const typename Tag::storage* x, const long long* pos_ids, const typename Tag::storage* cos_c,
                          const typename Tag::storage* sin_c, typename Tag::storage* y, kiln_u64 total, unsigned S,
                          unsigned N, unsigned H, unsigned half, kiln_u64 cache_rows, unsigned transposed,
                          unsigned pos_mode, unsigned interleaved, kiln_status* st) {
    rope<Tag>(x, pos_ids, cos_c, sin_c, y, total, S, N, H, half, cache_rows, transposed, pos_mode, interleaved, st);
}

// kiln-attention CUDA kernels: GroupQueryAttention (present K/V write with rotary, then causal
// attention with online softmax) and RotaryEmbedding. Semantics follow the CPU reference in
// shim/src/lib.rs. Argument order matches the shim's `launch` calls exactly.
#include "kiln.cuh"

// Largest head size of the attention kernel: each lane holds ceil(H / 32) ≤ 8 elements.
#define GQA_MAX_CHUNKS 8
// Most warps per attention block.
#define GQA_MAX_WARPS 16
// Keys each warp has in flight at once in the attention loop.
#define GQA_KEYS 4

// Rotated element d (< 2·half) of a head `x` at cache row `pos`, in f32. Positions outside the
// cache (the CPU reference fails the node) give NaN.
template <typename Tag>
__device__ __forceinline__ float rope_elem(const typename Tag::storage* x, const typename Tag::storage* cos_c,
                                           const typename Tag::storage* sin_c, long long pos, kiln_u64 cache_rows,
                                           unsigned half, unsigned d, unsigned interleaved) {
    if (pos < 0 || (kiln_u64)pos >= cache_rows) return __int_as_float(0x7fc00000);
    unsigned i, a, b;
    bool first;
    if (interleaved) {
        i = d >> 1;
        a = 2 * i;
        b = a + 1;
        first = (d & 1u) == 0;
    } else {
        first = d < half;
        i = first ? d : d - half;
        a = i;
        b = i + half;
    }
    const float c = kiln_to_f32(Tag(), cos_c[(kiln_u64)pos * half + i]);
    const float s = kiln_to_f32(Tag(), sin_c[(kiln_u64)pos * half + i]);
    const float xa = kiln_to_f32(Tag(), x[a]), xb = kiln_to_f32(Tag(), x[b]);
    return first ? xa * c - xb * s : xa * s + xb * c;
}

// Per batch row b: total valid length T_b = seqlens_k[b] + 1 and past length past_b.
__device__ __forceinline__ void gqa_row(const int* seqlens, unsigned b, unsigned S, unsigned first_prompt, long long* t_b,
                                        long long* past_b) {
    *t_b = (long long)seqlens[b] + 1;
    *past_b = first_prompt ? 0 : *t_b - (long long)S;
}

// Writes the present K and V [B, Nk, PL, H] (only the new rows when present is the past buffer
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
                       unsigned interleaved) {
    typedef typename Tag::storage T;
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
            const kiln_u64 at = (((kiln_u64)b * Nk + j) * PL + (kiln_u64)t) * H + d;
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
            const kiln_u64 src = (((kiln_u64)b * Nk + j) * P + t) * H + d;
            kv = past_k[src];
            vv = past_v[src];
        }
        pres_k[i] = kv;
        pres_v[i] = vv;
    }
}

// Attention for query row s = blockIdx.x, head h = blockIdx.y, batch row b = blockIdx.z over the
// present K/V [B, Nk, PL, H]. Each warp takes keys start + w, start + w + warps, … with its own
// online softmax (f32); lanes hold head elements d = lane + 32·c. The warps' states are merged
// through shared memory. Query rows are rotated (rotary_half > 0) and rounded to the dtype as
// the CPU reference does. sink_mode: 0 none, 1 smooth softmax (sink 0), 2 head_sink[h].
// bias (has_bias): [bias_b, bias_h, S, total] broadcast over batch / heads when 1.
template <typename Tag>
__device__ void gqa_attn(const typename Tag::storage* q_src, const typename Tag::storage* pres_k,
                         const typename Tag::storage* pres_v, const int* seqlens, const typename Tag::storage* cos_c,
                         const typename Tag::storage* sin_c, const typename Tag::storage* bias,
                         const typename Tag::storage* sink, typename Tag::storage* out, unsigned S, unsigned N,
                         unsigned Nk, unsigned H, unsigned PL, kiln_u64 q_w, unsigned first_prompt, kiln_u64 cache_rows,
                         unsigned rotary_half, unsigned interleaved, float scale, float softcap, int window,
                         unsigned has_bias, unsigned bias_b, unsigned bias_h, unsigned total, unsigned sink_mode) {
    __shared__ float s_acc[GQA_MAX_WARPS][GQA_MAX_CHUNKS * 32];
    __shared__ float s_m[GQA_MAX_WARPS], s_l[GQA_MAX_WARPS];
    const unsigned s = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const unsigned group = N / Nk;
    const unsigned j = h / group;
    long long t_b, past_b;
    gqa_row(seqlens, b, S, first_prompt, &t_b, &past_b);
    const long long causal = past_b + (long long)s + 1;
    long long start = (window >= 0 && causal > (long long)window) ? causal - window : 0;
    long long end = causal < t_b ? causal : t_b;
    if (start < 0) start = 0;
    if (end > (long long)PL) end = PL;
    typename Tag::storage* o = out + ((kiln_u64)b * S + s) * ((kiln_u64)N * H) + (kiln_u64)h * H;
    if (start >= end) {
        for (unsigned d = threadIdx.x; d < H; d += blockDim.x) o[d] = kiln_from_f32(Tag(), 0.f);
        return;
    }

    const typename Tag::storage* qr = q_src + ((kiln_u64)b * S + s) * q_w + (kiln_u64)h * H;
    const long long pos = past_b + (long long)s;
    float q[GQA_MAX_CHUNKS], acc[GQA_MAX_CHUNKS];
#pragma unroll
    for (int c = 0; c < GQA_MAX_CHUNKS; ++c) {
        const unsigned d = lane + 32u * c;
        float v = 0.f;
        if (d < H) {
            if (rotary_half > 0 && d < 2 * rotary_half)
                v = kiln_to_f32(Tag(), kiln_from_f32(Tag(), rope_elem<Tag>(qr, cos_c, sin_c, pos, cache_rows,
                                                                           rotary_half, d, interleaved)));
            else
                v = kiln_to_f32(Tag(), qr[d]);
        }
        q[c] = v;
        acc[c] = 0.f;
    }

    const kiln_u64 head = ((kiln_u64)b * Nk + j) * PL * H;
    const typename Tag::storage* bias_row = 0;
    if (has_bias)
        bias_row = bias + (((kiln_u64)(bias_b == 1 ? 0 : b) * bias_h + (bias_h == 1 ? 0 : h)) * S + s) * total;
    float m = -__int_as_float(0x7f800000), l = 0.f;
    // Each warp takes GQA_KEYS keys at a time (start + warp, + warps, …): their K and V rows
    // are loaded together so the loads overlap, then folded into the online softmax in order.
    for (long long t0 = start + warp; t0 < end; t0 += (long long)warps * GQA_KEYS) {
        float x[GQA_KEYS];
        float v[GQA_KEYS][GQA_MAX_CHUNKS];
#pragma unroll
        for (int u = 0; u < GQA_KEYS; ++u) {
            const long long t = t0 + (long long)u * warps;
            const bool live = t < end;
            const typename Tag::storage* kr = pres_k + head + (kiln_u64)t * H;
            const typename Tag::storage* vr = pres_v + head + (kiln_u64)t * H;
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
            if (t >= end) continue;
            if (softcap > 0.f) xu = softcap * tanhf(xu / softcap);
            if (has_bias) xu += kiln_to_f32(Tag(), bias_row[t]);
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

    // Merge: M = max over warps (and the sink), L = Σ l_w·e^(m_w − M) (+ e^(sink − M)).
    float mx = -__int_as_float(0x7f800000);
    for (unsigned w = 0; w < warps; ++w) mx = fmaxf(mx, s_m[w]);
    float sink_v = 0.f;
    const bool has_sink = sink_mode != 0;
    if (sink_mode == 2) sink_v = kiln_to_f32(Tag(), sink[h]);
    if (has_sink) mx = fmaxf(mx, sink_v);
    float den = has_sink ? expf(sink_v - mx) : 0.f;
    for (unsigned w = 0; w < warps; ++w)
        if (s_l[w] > 0.f) den += s_l[w] * expf(s_m[w] - mx);
    for (unsigned d = threadIdx.x; d < H; d += blockDim.x) {
        float v = 0.f;
        for (unsigned w = 0; w < warps; ++w)
            if (s_l[w] > 0.f) v += s_acc[w][d] * expf(s_m[w] - mx);
        o[d] = kiln_from_f32(Tag(), v / den);
    }
}

// RotaryEmbedding: y = x with the first R = 2·half elements of every head rotated at the row's
// position (pos[0] + s when scalar_pos, else pos[b·S + s]). Layout [B, S, N·H] or, transposed,
// [B, N, S, H]. One thread per element (grid-stride).
template <typename Tag>
__device__ void rope(const typename Tag::storage* x, const long long* pos_ids, const typename Tag::storage* cos_c,
                     const typename Tag::storage* sin_c, typename Tag::storage* y, kiln_u64 total, unsigned S,
                     unsigned N, unsigned H, unsigned half, kiln_u64 cache_rows, unsigned transposed,
                     unsigned scalar_pos, unsigned interleaved) {
    KILN_FOR(i, total) {
        const unsigned d = (unsigned)(i % H);
        if (d >= 2 * half) {
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
        const long long p = scalar_pos ? pos_ids[0] + (long long)s : pos_ids[(kiln_u64)b * S + s];
        y[i] = kiln_from_f32(Tag(), rope_elem<Tag>(x + (i - d), cos_c, sin_c, p, cache_rows, half, d, interleaved));
    }
}

#define KILN_ATTENTION_KERNELS(SUF, TAG)                                                                               \
    extern "C" __global__ void kiln_gqa_kv_##SUF(                                                                      \
        const TAG::storage* k_src, const TAG::storage* v_src, const TAG::storage* past_k, const TAG::storage* past_v,  \
        const int* seqlens, const TAG::storage* cos_c, const TAG::storage* sin_c, TAG::storage* pres_k,                \
        TAG::storage* pres_v, unsigned B, unsigned S, unsigned Nk, unsigned H, unsigned PL, unsigned P, kiln_u64 kv_w, \
        kiln_u64 k_off, kiln_u64 v_off, unsigned first_prompt, unsigned shared, kiln_u64 cache_rows,                   \
        unsigned rotary_half, unsigned interleaved) {                                                                  \
        gqa_kv<TAG>(k_src, v_src, past_k, past_v, seqlens, cos_c, sin_c, pres_k, pres_v, B, S, Nk, H, PL, P, kv_w,     \
                    k_off, v_off, first_prompt, shared, cache_rows, rotary_half, interleaved);                         \
    }                                                                                                                  \
    extern "C" __global__ void kiln_gqa_attn_##SUF(                                                                    \
        const TAG::storage* q_src, const TAG::storage* pres_k, const TAG::storage* pres_v, const int* seqlens,         \
        const TAG::storage* cos_c, const TAG::storage* sin_c, const TAG::storage* bias, const TAG::storage* sink,      \
        TAG::storage* out, unsigned S, unsigned N, unsigned Nk, unsigned H, unsigned PL, kiln_u64 q_w,                 \
        unsigned first_prompt, kiln_u64 cache_rows, unsigned rotary_half, unsigned interleaved, float scale,           \
        float softcap, int window, unsigned has_bias, unsigned bias_b, unsigned bias_h, unsigned total,                \
        unsigned sink_mode) {                                                                                          \
        gqa_attn<TAG>(q_src, pres_k, pres_v, seqlens, cos_c, sin_c, bias, sink, out, S, N, Nk, H, PL, q_w,             \
                      first_prompt, cache_rows, rotary_half, interleaved, scale, softcap, window, has_bias, bias_b,    \
                      bias_h, total, sink_mode);                                                                       \
    }                                                                                                                  \
    extern "C" __global__ void kiln_rope_##SUF(const TAG::storage* x, const long long* pos_ids,                        \
                                               const TAG::storage* cos_c, const TAG::storage* sin_c, TAG::storage* y,  \
                                               kiln_u64 total, unsigned S, unsigned N, unsigned H, unsigned half,      \
                                               kiln_u64 cache_rows, unsigned transposed, unsigned scalar_pos,          \
                                               unsigned interleaved) {                                                 \
        rope<TAG>(x, pos_ids, cos_c, sin_c, y, total, S, N, H, half, cache_rows, transposed, scalar_pos, interleaved); \
    }

KILN_ATTENTION_KERNELS(f32, kiln_tag_f32)
KILN_ATTENTION_KERNELS(f16, kiln_tag_f16)
KILN_ATTENTION_KERNELS(bf16, kiln_tag_bf16)

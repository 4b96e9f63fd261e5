// prefill_probe.cu — prompt attention on tensor cores (kiln_gqa_prefill_mma below, a candidate for
// kiln-attention) beside kiln-attention's kiln_gqa_prefill (16 query rows per block, scalar f32
// products), at the SmolLM2-135M architecture's geometry (9 query heads over 3 KV heads, head size
// 64, float16; and 4 over 2 at head size 128), causal, against a float64 reference: the largest
// error over sampled rows of every head and batch row, then the GPU time per launch (CUDA events,
// mean of 10) at prompts of 128, 1,024 and 3,840 tokens, batch 1 and 8. Cases: a first prompt,
// a prompt after 500 cached positions, and a local window of 100.
//
//   mkdir -p inc/kiln-cuda-std && cp kernels/cuda-std/include/* inc/kiln-cuda-std/ && cp host/cuda/kiln.cuh inc/
//   nvcc -O3 -arch=sm_90 -std=c++17 -Iinc -Ibench -DATTN_SRC='"kernels/attention/cuda/attention.cu"' \
//     -o prefill_probe bench/prefill_probe.cu
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>
#include <cuda_runtime.h>

#include "check.cuh"

#define KT(i) \
    do {      \
    } while (0)
#include ATTN_SRC

// Prompt attention by tiles on tensor cores (S > 1, no bias, softcap or sink; float16 or
// bfloat16; head size HD = H, 64 or 128): block (query tile, h, b) takes GQA_PFM_ROWS query rows
// s0 … of head h, batch row b, 16 per warp, and walks the keys any of them attends to in tiles
// of gqa_pfm_keys(HD), each tile's K and V rows copied into shared memory (cp.async, the next tile's
// copies in flight while the warps work on this one), as FlashAttention-2 does:
// 1. the block's query rows, rotated and rounded as gqa_attn does, into shared memory, then each
//    warp's 16 rows into registers as mma A fragments;
// 2. per tile, the warp's scores S = Q·Kᵀ (16 rows × the tile's keys, m16n8k16 with f32 accumulators, K rows as the
//    B operand through ldmatrix), scaled and masked by each row's causal and window range;
// 3. the rows' online softmax in registers (a row's values are spread over the 4 lanes of a quad);
// 4. O += P·V, P straight from the score fragments (the C layout of two 8-key tiles is the A layout
//    of one 16-key step), split into its 16-bit rounding and the rest (two mma's: about 22 bits of
//    each weight, as gqa_dec_pv_mma), V rows as B through ldmatrix.trans.
// Rows and dimensions are swizzled by 16-byte vector (gqa_swz), so ldmatrix's eight rows hit eight
// bank groups. The output is O / Σ weight (zeros for a row with no key), as gqa_attn's.
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
    constexpr unsigned NT = HD / 8;   // 8-dimension tiles of O
    constexpr unsigned KEYS = gqa_pfm_keys(HD);
    const float NEG_INF = -__int_as_float(0x7f800000);
    extern __shared__ __align__(16) unsigned char gqa_dyn[];
    uint4* const q_s = (uint4*)gqa_dyn;                   // [GQA_PFM_ROWS][VPR]
    uint4* const kv_s = q_s + GQA_PFM_ROWS * VPR;         // [2][K, V][KEYS][VPR]
    const unsigned s0 = blockIdx.x * GQA_PFM_ROWS, h = blockIdx.y, b = blockIdx.z;
    const unsigned tid = threadIdx.x, lane = tid & 31u, warp = tid >> 5, g = lane >> 2, q2 = (lane & 3u) * 2;
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
        ((T*)&q_s[gqa_swz(r, d / 8, VPR)])[d % 8] = kiln_from_f32(Tag(), x);
    }
    // Tile `it` (keys lo + 64·it …) into buffer it & 1: cp.async for keys below hi, zeros past it
    // (a weight of 0 would not clear NaN bits there).
    const auto load_tile = [&](unsigned it) {
        uint4* const k_t = kv_s + (it & 1u) * 2 * KEYS * VPR;
        uint4* const v_t = k_t + KEYS * VPR;
        const long long t0 = lo + (long long)KEYS * it;
        for (unsigned i = tid; i < KEYS * VPR; i += blockDim.x) {
            const unsigned k = i / VPR, u = i % VPR;
            const unsigned at = gqa_swz(k, u, VPR);
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
#pragma unroll
    for (unsigned s = 0; s < KS; ++s)
        kiln_ldmatrix_x4<false>(qa[s], &q_s[gqa_swz(16 * warp + (lane & 15u), 2 * s + (lane >> 4), VPR)]);
    float o[NT][4];
#pragma unroll
    for (unsigned n = 0; n < NT; ++n)
#pragma unroll
        for (unsigned i = 0; i < 4; ++i) o[n][i] = 0.f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
    for (unsigned it = 0; it < tiles; ++it) {
        if (it + 1 < tiles) {
            load_tile(it + 1);
            kiln_cp_async_wait<1>();
        } else {
            kiln_cp_async_wait<0>();
        }
        __syncthreads();  // tile it in shared memory
        const long long t0 = lo + (long long)KEYS * it;
        if (whi > t0 && wlo < t0 + KEYS) {
            const uint4* const k_t = kv_s + (it & 1u) * 2 * KEYS * VPR;
            const uint4* const v_t = k_t + KEYS * VPR;
            // 2. Scores: n-tile nt is keys 8·nt …; ldmatrix x4 gives the B fragments of two n-tiles
            // (matrix i: keys 16·p + 8·(i >> 1), dimensions 16·s + 8·(i & 1)).
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
                    kiln_ldmatrix_x4<false>(
                        kb, &k_t[gqa_swz(16 * p + (lane & 7u) + ((lane >> 4) << 3), 2 * s + ((lane >> 3) & 1u), VPR)]);
                    kiln_mma16816<Tag>(sc[2 * p], qa[s][0], qa[s][1], qa[s][2], qa[s][3], kb[0], kb[1]);
                    kiln_mma16816<Tag>(sc[2 * p + 1], qa[s][0], qa[s][1], qa[s][2], qa[s][3], kb[2], kb[3]);
                }
            // Scaled and masked: sc[nt][i] is row g + 8·(i >> 1), key t0 + 8·nt + q2 + (i & 1).
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (unsigned nt = 0; nt < KEYS / 8; ++nt)
#pragma unroll
                for (unsigned i = 0; i < 4; ++i) {
                    const unsigned r = i >> 1;
                    const long long t = t0 + 8 * nt + q2 + (i & 1u);
                    const float x = t >= ra[r] && t < re[r] ? sc[nt][i] * scale : NEG_INF;
                    sc[nt][i] = x;
                    mx[r] = fmaxf(mx[r], x);
                }
            // 3. Online softmax per row: the quad's maximum, the correction of the running sums.
            float corr[2];
#pragma unroll
            for (unsigned r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_new = fmaxf(m[r], mx[r]);
                corr[r] = m[r] == NEG_INF ? 0.f : expf(m[r] - m_new);
                m[r] = m_new;
                l[r] *= corr[r];
            }
#pragma unroll
            for (unsigned nt = 0; nt < KEYS / 8; ++nt)
#pragma unroll
                for (unsigned i = 0; i < 4; ++i) {
                    const unsigned r = i >> 1;
                    const float p = sc[nt][i] == NEG_INF ? 0.f : expf(sc[nt][i] - m[r]);
                    sc[nt][i] = p;
                    l[r] += p;  // this lane's part; the quad's parts are summed at the end
                }
#pragma unroll
            for (unsigned n = 0; n < NT; ++n) {
                o[n][0] *= corr[0];
                o[n][1] *= corr[0];
                o[n][2] *= corr[1];
                o[n][3] *= corr[1];
            }
            // 4. O += P·V, 16 keys a step: A from the score fragments of n-tiles 2·kt and 2·kt + 1,
            // high and low parts; B from V rows by ldmatrix.trans (matrix i: keys 16·kt + 8·(i & 1),
            // dimensions 8·(2·n2 + (i >> 1))).
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
                    kiln_ldmatrix_x4<true>(
                        vb, &v_t[gqa_swz(16 * kt + (lane & 7u) + (((lane >> 3) & 1u) << 3), 2 * n2 + (lane >> 4), VPR)]);
                    kiln_mma16816<Tag>(o[2 * n2], ah[0], ah[1], ah[2], ah[3], vb[0], vb[1]);
                    kiln_mma16816<Tag>(o[2 * n2], al[0], al[1], al[2], al[3], vb[0], vb[1]);
                    kiln_mma16816<Tag>(o[2 * n2 + 1], ah[0], ah[1], ah[2], ah[3], vb[2], vb[3]);
                    kiln_mma16816<Tag>(o[2 * n2 + 1], al[0], al[1], al[2], al[3], vb[2], vb[3]);
                }
            }
        }
        __syncthreads();  // buffer it & 1 is free for tile it + 2
    }
    // Out: O / Σ weight, two dimensions per store (zeros for a row with no key).
#pragma unroll
    for (unsigned r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        const unsigned row = 16 * warp + g + 8 * r;
        if (row >= rows) continue;
        T* const dst = out + ((kiln_u64)b * S + s0 + row) * ((kiln_u64)N * HD) + (kiln_u64)h * HD;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
#pragma unroll
        for (unsigned n = 0; n < NT; ++n)
            *(unsigned*)(dst + 8 * n + q2) = kiln_pack2<Tag>(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
    }
}

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

// One case: B rows of S prompt tokens after `past` cached positions, N query heads over Nk, head
// size H, a 4,096-position cache, window `window` (< 0: none). Checks both kernels against float64
// on sampled rows; with `timed`, prints µs per launch of each.
template <int HD>
static bool run_case(unsigned B, unsigned S, unsigned past, unsigned N, unsigned Nk, int window, bool timed) {
    const unsigned H = HD, PL = 4096, q_w = N * H;
    const float scale = 1.f / std::sqrt((float)H);
    std::vector<unsigned short> q((size_t)B * S * q_w), kc((size_t)B * Nk * PL * H), vc(kc.size());
    unsigned seed = 12345u + S + 7u * B + past;
    const auto rnd = [&]() {
        seed = seed * 1664525u + 1013904223u;
        return probe_h16(((int)((seed >> 8) % 2001u) - 1000) / 1000.f);
    };
    for (auto& x : q) x = rnd();
    for (size_t i = 0; i < kc.size(); ++i) {
        kc[i] = rnd();
        vc[i] = rnd();
    }
    std::vector<int> seq(B, (int)(past + S - 1));
    kiln_f16 *d_q, *d_k, *d_v, *d_o1, *d_o2;
    int* d_seq;
    kiln_status* d_st;
    const size_t out_n = (size_t)B * S * N * H;
    CHECK(cudaMalloc(&d_q, q.size() * 2));
    CHECK(cudaMalloc(&d_k, kc.size() * 2));
    CHECK(cudaMalloc(&d_v, vc.size() * 2));
    CHECK(cudaMalloc(&d_o1, out_n * 2));
    CHECK(cudaMalloc(&d_o2, out_n * 2));
    CHECK(cudaMalloc(&d_seq, B * 4));
    CHECK(cudaMalloc(&d_st, sizeof(kiln_status)));
    CHECK(cudaMemcpy(d_q, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_k, kc.data(), kc.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_v, vc.data(), vc.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_seq, seq.data(), B * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(d_st, 0, sizeof(kiln_status)));
    CHECK(cudaMemset(d_o1, 0xff, out_n * 2));
    CHECK(cudaMemset(d_o2, 0xff, out_n * 2));
    const unsigned first = past == 0 ? 1u : 0u, smem = gqa_pfm_smem(HD);
    CHECK(cudaFuncSetAttribute(kiln_gqa_prefill_mma<kiln_tag_f16, HD>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)smem));
    const kiln_u64 row = (kiln_u64)Nk * PL * H, head = (kiln_u64)PL * H;
    const auto old_k = [&]() {
        kiln_gqa_prefill<kiln_tag_f16><<<dim3((S + 15) / 16, N, B), 128>>>(
            d_q, d_k, d_v, d_seq, d_q, d_q, d_o1, S, N, Nk, H, PL, q_w, first, (kiln_u64)PL, 0u, 0u, scale, window,
            past + S, row, head, 0ull, 31u, d_st);
    };
    const auto new_k = [&]() {
        kiln_gqa_prefill_mma<kiln_tag_f16, HD><<<dim3((S + GQA_PFM_ROWS - 1) / GQA_PFM_ROWS, N, B), GQA_PFM_THREADS,
                                                 smem>>>(d_q, d_k, d_v, d_seq, d_q, d_q, d_o2, S, N, Nk, H, PL, q_w,
                                                         first, (kiln_u64)PL, 0u, 0u, scale, window, past + S, row,
                                                         head, 0ull, 31u, d_st);
    };
    old_k();
    new_k();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    kiln_status hst;
    CHECK(cudaMemcpy(&hst, d_st, sizeof(hst), cudaMemcpyDeviceToHost));
    std::vector<unsigned short> o1(out_n), o2(out_n);
    CHECK(cudaMemcpy(o1.data(), d_o1, out_n * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(o2.data(), d_o2, out_n * 2, cudaMemcpyDeviceToHost));
    // float64 reference on sampled rows of every (b, head).
    const unsigned cand[] = {0, 1, 15, 16, 63, 64, 65, S / 2, S - 2, S - 1};
    double e1 = 0, e2 = 0;
    std::vector<double> sc(PL), acc(H);
    for (unsigned bb = 0; bb < B; ++bb)
        for (unsigned hh = 0; hh < N; ++hh) {
            const unsigned jj = hh / (N / Nk);
            for (unsigned s : cand) {
                if (s >= S) continue;
                const long long causal = (long long)past + s + 1;
                const long long st = window >= 0 && causal > window ? causal - window : 0;
                double mx = -1e300;
                for (long long t = st; t < causal; ++t) {
                    double x = 0;
                    for (unsigned d = 0; d < H; ++d)
                        x += probe_f64(q[((size_t)bb * S + s) * q_w + hh * H + d]) *
                             probe_f64(kc[(size_t)bb * row + jj * head + t * H + d]);
                    sc[t] = x * scale;
                    mx = std::max(mx, sc[t]);
                }
                double den = 0;
                std::fill(acc.begin(), acc.end(), 0.0);
                for (long long t = st; t < causal; ++t) {
                    const double w = std::exp(sc[t] - mx);
                    den += w;
                    for (unsigned d = 0; d < H; ++d) acc[d] += w * probe_f64(vc[(size_t)bb * row + jj * head + t * H + d]);
                }
                for (unsigned d = 0; d < H; ++d) {
                    const double want = acc[d] / den;
                    const size_t at = ((size_t)bb * S + s) * N * H + hh * H + d;
                    e1 = std::max(e1, std::fabs(probe_f64(o1[at]) - want));
                    e2 = std::max(e2, std::fabs(probe_f64(o2[at]) - want));
                    if (std::isnan(probe_f64(o2[at]))) e2 = INFINITY;
                }
            }
        }
    const bool ok = e2 <= 2e-3 && hst.code == 0;
    printf("B %u S %u past %u heads %u/%u H %u window %d: max |err| vs float64: kiln_gqa_prefill %.2e, "
           "kiln_gqa_prefill_mma %.2e; status %d%s\n",
           B, S, past, N, Nk, H, window, e1, e2, (int)hst.code, ok ? "" : "  <-- FAILED");
    if (timed) {
        cudaEvent_t a, z;
        CHECK(cudaEventCreate(&a));
        CHECK(cudaEventCreate(&z));
        float t1 = 0, t2 = 0;
        for (int k = 0; k < 2; ++k) {
            const auto launch = k == 0 ? std::function<void()>(old_k) : std::function<void()>(new_k);
            launch();
            CHECK(cudaEventRecord(a));
            for (int i = 0; i < 10; ++i) launch();
            CHECK(cudaEventRecord(z));
            CHECK(cudaEventSynchronize(z));
            CHECK(cudaEventElapsedTime(k == 0 ? &t1 : &t2, a, z));
        }
        printf("| %u | %u | %u | %.1f | %.1f | %.1fx |\n", B, S, H, t1 * 100.f, t2 * 100.f, t1 / t2);
        CHECK(cudaEventDestroy(a));
        CHECK(cudaEventDestroy(z));
    }
    cudaFree(d_q);
    cudaFree(d_k);
    cudaFree(d_v);
    cudaFree(d_o1);
    cudaFree(d_o2);
    cudaFree(d_seq);
    cudaFree(d_st);
    return ok;
}

int main() {
    bool ok = true;
    ok &= run_case<64>(2, 200, 0, 9, 3, -1, false);
    ok &= run_case<64>(2, 300, 500, 9, 3, -1, false);
    ok &= run_case<64>(1, 333, 0, 9, 3, 100, false);
    ok &= run_case<128>(2, 150, 40, 4, 2, -1, false);
    printf("| batch | prompt | head size | kiln_gqa_prefill µs | kiln_gqa_prefill_mma µs | speed-up |\n");
    printf("| ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (unsigned B : {1u, 8u})
        for (unsigned S : {128u, 1024u, 3840u}) ok &= run_case<64>(B, S, 0, 9, 3, -1, true);
    ok &= run_case<128>(1, 3840, 0, 32, 8, -1, true);
    printf(ok ? "all cases within 2e-3 of float64\n" : "FAILED\n");
    return ok ? 0 : 1;
}

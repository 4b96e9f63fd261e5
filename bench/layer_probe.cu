// layer_probe.cu — where a batch-1 decode step's time goes between and inside its kernels: the
// SmolLM2-135M architecture's 30 decoder layers (hidden 576, 9 query heads, 3 KV heads, head size
// 64, MLP 1536, float16, a 384-position cache at position 200) as kiln's fused decode runs them,
// five kernels per layer captured in one CUDA graph: kiln_linear_gemv RMSNORM (residual add, RMS
// norm, QKV), kiln_gqa_decode_cluster (rotary, KV append, attention), kiln_linear_gemv LINEAR (O),
// kiln_linear_gemv RMSNORM (residual add, RMS norm, gate·up), kiln_linear_gemv SWIGLU (SiLU·mul,
// down). The GEMVs are launched with programmatic stream serialization, attention without, as the
// manifests' `pdl` lists make kiln launch them. Weights are random, distinct per layer (160 MiB:
// the step streams them from HBM as a real one does).
//
// Prints the graph replay's time per step and per layer (CUDA events, mean of 200 replays), and,
// built with -DLP_MARKS, one replay's timeline from the global timer (32 ns ticks) at three marks
// per block: entry, return from the grid-dependency wait (entry for attention, which has none),
// exit. Per kernel of the layer (medians over layers 2–29, µs): the stage (its last block's exit
// after the previous kernel's), its first block's entry and first wait return after the previous
// kernel's last exit, and its work (last exit after first wait return). -DLP_NO_O leaves the O
// projection out (its stage's cost); -DLP_FUSED_OGU runs O, the residual add and RMS norm and
// gate·up as one kernel (lp_ogu, checked first against the two it replaces); -DLP_ATTN_PDL launches attention with programmatic stream
// serialization and a grid-dependency wait at its start (-DLP_ATTN_TRIGGER: and lets the O GEMV
// launch right after it); -DLIN_SRC='"path"' takes the GEMVs from another linear.cu.
//
//   mkdir -p inc/kiln-cuda-std && cp kernels/cuda-std/include/* inc/kiln-cuda-std/ && cp host/cuda/kiln.cuh inc/
//   nvcc -O3 -arch=sm_90 -std=c++17 -Iinc -I. [-DLP_MARKS] -o layer_probe bench/layer_probe.cu
#include "kiln.cuh"

#define LP_LAUNCHES 160
#define LP_BLOCKS 512

#ifdef LP_MARKS
__device__ unsigned long long g_lp[LP_LAUNCHES * LP_BLOCKS * 3];
__shared__ unsigned lp_launch;
// Mark i (0 entry, 1 wait returned, 2 exit) of this block of launch lp_launch, by thread 0.
__device__ __forceinline__ void lp_mark(int i) {
    if (threadIdx.x == 0) {
        const unsigned blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (blk < LP_BLOCKS && lp_launch < LP_LAUNCHES) g_lp[(lp_launch * LP_BLOCKS + blk) * 3 + i] = t;
    }
}
__device__ __forceinline__ void lp_begin(unsigned launch) {
    if (threadIdx.x == 0) lp_launch = launch;
    lp_mark(0);
}
// The kernels' grid-dependency wait, then mark 1 (the name inside is not expanded again).
#define kiln_griddep_wait() (kiln_griddep_wait(), lp_mark(1))
#else
#define lp_mark(i) ((void)0)
#define lp_begin(launch) ((void)(launch))
#endif

#ifndef LIN_SRC
#define LIN_SRC "kernels/matmul/cuda/linear.cu"  // -DLIN_SRC='"path"' probes another GEMV source
#endif
#include LIN_SRC
#include "kernels/attention/cuda/attention.cu"

typedef kiln_tag_f16::storage S;

template <int MODE>
__global__ void __launch_bounds__(LIN_WARPS * 32)
    lp_gemv(unsigned launch, const S* x, const S* skip, const S* gamma, const S* w, S* y, S* sum, kiln_u64 rows,
            kiln_u64 n, kiln_u64 k, kiln_u64 skip_len, unsigned flags, float eps) {
    lp_begin(launch);
    lin::gemv<lin::F16, MODE, 1>(x, skip, gamma, w, y, sum, rows, n, k, skip_len, flags, eps);
    lp_mark(2);
}

template <typename Tag>
__global__ void __cluster_dims__(GQA_DEC_CLUSTER, 1, 1) __launch_bounds__(256, 2)
    lp_attn(unsigned launch, KILN_GQA_DECODE_PARAMS) {
    lp_begin(launch);
#ifdef LP_ATTN_PDL
    kiln_griddep_wait();
#ifdef LP_ATTN_TRIGGER
    kiln_griddep_launch_dependents();
#endif
#else
    lp_mark(1);
#endif
    gqa_decode_regs<Tag, 4, GQA_DEC_CLUSTER>(q_src, pres_k, pres_v, seqlens, cos_c, sin_c, bias, sink, partial, out,
                                             N, Nk, H, PL, q_w, cache_rows, rotary_half, interleaved, scale, softcap,
                                             window, has_bias, bias_b, bias_h, total, sink_mode, k_src, v_src, past_k,
                                             past_v, P, kv_w, k_off, v_off, append, kpb, KILN_GQA_LAYOUT, fold,
                                             counters, st);
    lp_mark(2);
}

// ---- -DLP_FUSED_OGU: the O projection, the residual add and RMS norm, and gate·up in one kernel ----
//
// One row. Y2 = RMS(X·W1ᵀ + skip) · gamma · W2ᵀ, sum = X·W1ᵀ + skip, each step rounded to float16
// where the unfused Linear and RmsNormLinear store it. Clusters of OGU_CL blocks: each cluster
// computes all of X·W1ᵀ, block `rank` of it outputs rank·c1 .. (c1 = n1 / OGU_CL, its W1 rows
// copied into shared memory before the grid-dependency wait), and the blocks read each other's
// through distributed shared memory; then every block normalizes the whole row and computes its
// OGU_COLS2 outputs per warp of Y2 with W2 rows loaded into registers before the wait.
#define OGU_CL 8
#define OGU_WARPS 8
#define OGU_COLS2 3   // Y2 outputs per warp
#define OGU_UNROLL 3  // 16-byte W2 chunks per lane and output (k ≤ 32·3·8 = 768)

__device__ __forceinline__ void ogu_cluster_arrive() { asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory"); }
__device__ __forceinline__ void ogu_cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }
__device__ __forceinline__ float ogu_cluster_ld(const float* p, unsigned rank) {
    const unsigned local = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
}

// Dynamic shared memory: W1's c1 rows (c1·k1 values), then f32 x [k1], skip [n1], gamma [n1],
// a [n1], o [c1], red [32].
__global__ void __cluster_dims__(OGU_CL, 1, 1) __launch_bounds__(OGU_WARPS * 32, 1)
    lp_ogu(unsigned launch, const S* x, const S* w1, const S* skip, const S* gamma, const S* w2, S* y, S* sum,
           unsigned k1, unsigned n1, unsigned n2, float eps) {
    typedef lin::F16 T;
    lp_begin(launch);
    extern __shared__ __align__(16) unsigned char ogu_shared[];
    unsigned rank;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const unsigned c1 = n1 / OGU_CL, kc1 = k1 / 8, kc2 = n1 / 8;
    uint4* w1s = (uint4*)ogu_shared;
    float* xs = (float*)(w1s + c1 * kc1);
    float* ks = xs + k1;
    float* gs = ks + n1;
    float* as = gs + n1;
    float* os = as + n1;
    float* red = os + c1;
    // Before the wait: W1's rows rank·c1 .. into shared memory, this warp's W2 rows into registers.
    const uint4* w1r = (const uint4*)w1 + (size_t)rank * c1 * kc1;
    for (unsigned i = tid; i < c1 * kc1; i += blockDim.x) kiln_cp_async16(&w1s[i], &w1r[i]);
    kiln_cp_async_commit();
    const unsigned col2 = (blockIdx.x * OGU_WARPS + warp) * OGU_COLS2;
    uint4 wv[OGU_COLS2][OGU_UNROLL];
#pragma unroll
    for (int j = 0; j < OGU_COLS2; ++j)
#pragma unroll
        for (int u = 0; u < OGU_UNROLL; ++u) {
            const unsigned c = u * 32 + lane;
            wv[j][u] = col2 + j < n2 && c < kc2 ? __ldg((const uint4*)w2 + (size_t)(col2 + j) * kc2 + c)
                                                : make_uint4(0, 0, 0, 0);
        }
    kiln_griddep_launch_dependents();
    kiln_griddep_wait();
    // x, skip and gamma as f32.
    for (unsigned i = tid; i < kc1 + 2 * kc2; i += blockDim.x) {
        const uint4* src = i < kc1 ? (const uint4*)x + i : i < kc1 + kc2 ? (const uint4*)skip + (i - kc1)
                                                                          : (const uint4*)gamma + (i - kc1 - kc2);
        float* dst = i < kc1 ? xs + 8 * i : i < kc1 + kc2 ? ks + 8 * (i - kc1) : gs + 8 * (i - kc1 - kc2);
        float f[8];
        T::unpack(*src, f);
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e] = f[e];
    }
    kiln_cp_async_wait<0>();
    __syncthreads();
    // This block's outputs of X·W1ᵀ, rounded as Linear stores them.
    for (unsigned c = warp; c < c1; c += OGU_WARPS) {
        float acc = 0.f;
        for (unsigned ch = lane; ch < kc1; ch += 32) {
            float wf[8];
            T::unpack(w1s[c * kc1 + ch], wf);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(xs[8 * ch + e], wf[e], acc);
        }
        acc = kiln_warp_sum(acc);
        if (lane == 0) os[c] = T::ld(T::st(acc));
    }
    ogu_cluster_arrive();
    ogu_cluster_wait();
    // s = X·W1ᵀ + skip over the whole row (other blocks' parts through the cluster).
    float q = 0.f;
    for (unsigned i = tid; i < n1; i += blockDim.x) {
        const float s = ogu_cluster_ld(os + i % c1, i / c1) + ks[i];
        as[i] = s;
        q += s * s;
        if (blockIdx.x == 0) sum[i] = T::st(s);
    }
    ogu_cluster_arrive();  // this block reads no other block's shared memory after this
    const float inv = 1.f / sqrtf(kiln_block_reduce(q, red, false) / (float)n1 + eps);
    for (unsigned i = tid; i < n1; i += blockDim.x) as[i] = T::ld(T::st(as[i] * inv * gs[i]));
    __syncthreads();
    float acc[OGU_COLS2];
#pragma unroll
    for (int j = 0; j < OGU_COLS2; ++j) acc[j] = 0.f;
#pragma unroll
    for (int u = 0; u < OGU_UNROLL; ++u) {
        const unsigned c = u * 32 + lane;
        if (c < kc2) {
            float af[8];
            lin::load_a<T>(as + 8 * c, af);
#pragma unroll
            for (int j = 0; j < OGU_COLS2; ++j) {
                float wf[8];
                T::unpack(wv[j][u], wf);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[j] = fmaf(af[e], wf[e], acc[j]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < OGU_COLS2; ++j) {
        const float v = kiln_warp_sum(acc[j]);
        if (lane == 0 && col2 + j < n2) y[col2 + j] = T::st(v);
    }
    ogu_cluster_wait();  // every block has read this one's outputs
    lp_mark(2);
}

// lp_ogu's dynamic shared memory for W1 [n1, k1].
static inline unsigned ogu_shared_bytes(unsigned k1, unsigned n1) {
    return (n1 / OGU_CL) * k1 * 2 + (k1 + 3 * n1 + n1 / OGU_CL + 32) * 4;
}

#ifdef __CUDACC_RTC__
// For a compile check without a GPU (KILN_NVRTC_OPTS=-I. python3 scripts/nvrtc-check.py
// bench/layer_probe.cu): the kernels main() launches, instantiated.
__global__ void lp_instances(void** p) {
    p[0] = (void*)lp_gemv<LIN_LINEAR>;
    p[1] = (void*)lp_gemv<LIN_RMSNORM>;
    p[2] = (void*)lp_gemv<LIN_SWIGLU>;
    p[3] = (void*)lp_attn<kiln_tag_f16>;
    p[4] = (void*)lp_ogu;
}
#else
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>

#include "bench/check.cuh"

static S h16(float f) {
    // float → binary16 bits (round to nearest even; small normal values only here).
    unsigned u;
    memcpy(&u, &f, 4);
    const unsigned sign = (u >> 16) & 0x8000u;
    int e = (int)((u >> 23) & 0xff) - 127 + 15;
    unsigned m = u & 0x7fffffu;
    if (e <= 0) return (S)sign;
    unsigned h = sign | ((unsigned)e << 10) | (m >> 13);
    if ((m & 0x1fffu) > 0x1000u || ((m & 0x1fffu) == 0x1000u && (h & 1u))) ++h;
    return (S)h;
}

[[maybe_unused]] static double f64(S h) {
    // binary16 bits → double.
    const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    const double v = e == 0 ? std::ldexp((double)m, -24) : std::ldexp((double)(1024 + m), e - 25);
    return (h & 0x8000) ? -v : v;
}

// A device buffer of n float16 values, uniform in [-scale, scale].
static S* random_f16(size_t n, float scale) {
    std::vector<S> h(n);
    for (auto& v : h) v = h16(scale * ((rand() % 2001) - 1000) / 1000.f);
    S* d;
    CHECK(cudaMalloc(&d, n * 2));
    CHECK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
    return d;
}

int main() {
    const unsigned L = 30, D = 576, N = 9, Nk = 3, H = 64, I = 1536, PL = 384, pos = 200, rows = 4096, half = 32;
    const unsigned QKV = (N + 2 * Nk) * H, kpb = (PL + GQA_DEC_CLUSTER - 1) / GQA_DEC_CLUSTER;
    const float eps = 1e-5f;
    srand(1);
    struct Layer {
        S *g1, *wqkv, *wo, *g2, *wgu, *wd, *k, *v;
    };
    std::vector<Layer> layers(L);
    for (auto& l : layers) {
        l.g1 = random_f16(D, 1.f);
        l.wqkv = random_f16((size_t)QKV * D, 0.05f);
        l.wo = random_f16((size_t)D * D, 0.05f);
        l.g2 = random_f16(D, 1.f);
        l.wgu = random_f16((size_t)2 * I * D, 0.05f);
        l.wd = random_f16((size_t)D * I, 0.03f);
        l.k = random_f16((size_t)Nk * PL * H, 1.f);
        l.v = random_f16((size_t)Nk * PL * H, 1.f);
    }
    S *h = random_f16(D, 1.f), *res_a = random_f16(D, 1.f), *res_b = random_f16(D, 1.f);
    S *qkv = random_f16(QKV, 1.f), *attn = random_f16(N * H, 1.f), *o = random_f16(D, 1.f);
    S *gu = random_f16(2 * I, 1.f), *cs = random_f16((size_t)rows * half, 1.f);
    float* partial;
    int* seq;
    kiln_counter* ctr;
    kiln_status* st;
    CHECK(cudaMalloc(&partial, (size_t)N * GQA_DEC_CLUSTER * (H + 2) * 4));
    CHECK(cudaMalloc(&seq, 4));
    CHECK(cudaMemcpy(seq, &pos, 4, cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&ctr, Nk * 4));
    CHECK(cudaMemset(ctr, 0, Nk * 4));
    CHECK(cudaMalloc(&st, sizeof(kiln_status)));
    CHECK(cudaMemset(st, 0, sizeof(kiln_status)));

    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    unsigned launch = 0;
    std::vector<int> kind;  // kernel of the layer (0 QKV, 1 attention, 2 O, 3 gate·up, 4 down) per launch
    const auto gemv = [&](int k, auto kernel, unsigned blocks, const S* x, const S* skip, const S* gamma, const S* w,
                          S* y, S* sum, unsigned n, unsigned kk, unsigned flags) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(blocks, 1, 1);
        cfg.blockDim = dim3(LIN_WARPS * 32, 1, 1);
        cfg.dynamicSmemBytes = kk * 4;
        cfg.stream = s;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        CHECK(cudaLaunchKernelEx(&cfg, kernel, launch++, x, skip, gamma, w, y, sum, (kiln_u64)1, (kiln_u64)n,
                                 (kiln_u64)kk, (kiln_u64)kk, flags, eps));
        kind.push_back(k);
    };
    // GEMV blocks for n outputs (the shim's: LIN_WARPS · LIN_COLS outputs per block).
    const auto cols = [](unsigned n) { return (n + LIN_WARPS * LIN_COLS - 1) / (LIN_WARPS * LIN_COLS); };
    // O, residual add, RMS norm and gate·up in one kernel (lp_ogu): RMS(attn·Woᵀ + res_a) · g2 · Wguᵀ.
    const unsigned ogu_smem = ogu_shared_bytes(N * H, D);
    CHECK(cudaFuncSetAttribute(lp_ogu, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)ogu_smem));
    const auto ogu = [&](const Layer& l, const S* x, S* y, S* sum_out) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3((2 * I + OGU_WARPS * OGU_COLS2 - 1) / (OGU_WARPS * OGU_COLS2), 1, 1);
        cfg.blockDim = dim3(OGU_WARPS * 32, 1, 1);
        cfg.dynamicSmemBytes = ogu_smem;
        cfg.stream = s;
        cudaLaunchAttribute at[1];
        at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = at;
        cfg.numAttrs = 1;
        CHECK(cudaLaunchKernelEx(&cfg, lp_ogu, launch++, x, (const S*)l.wo, (const S*)res_a, (const S*)l.g2,
                                 (const S*)l.wgu, y, sum_out, N * H, D, 2 * I, eps));
        kind.push_back(5);
    };
    (void)ogu;  // launched only with -DLP_FUSED_OGU
#ifdef LP_FUSED_OGU
    {
        // The fused kernel against the two it replaces, on layer 0.
        S *gu_ref = random_f16(2 * I, 1.f), *sum_ref = random_f16(D, 1.f), *sum2 = random_f16(D, 1.f);
        gemv(2, lp_gemv<LIN_LINEAR>, cols(D), attn, attn, attn, layers[0].wo, o, o, D, N * H, lin::W_CONST);
        gemv(3, lp_gemv<LIN_RMSNORM>, cols(2 * I), o, res_a, layers[0].g2, layers[0].wgu, gu_ref, sum_ref, 2 * I, D,
             lin::HAS_SKIP | lin::HAS_SUM | lin::W_CONST);
        ogu(layers[0], attn, gu, sum2);
        CHECK(cudaStreamSynchronize(s));
        std::vector<S> a1(2 * I), a2(2 * I), b1(D), b2(D);
        CHECK(cudaMemcpy(a1.data(), gu_ref, a1.size() * 2, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(a2.data(), gu, a2.size() * 2, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(b1.data(), sum_ref, b1.size() * 2, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(b2.data(), sum2, b2.size() * 2, cudaMemcpyDeviceToHost));
        const auto cmp = [](const std::vector<S>& r, const std::vector<S>& g, const char* what) {
            double worst = 0, top = 0;
            for (size_t i = 0; i < r.size(); ++i) {
                worst = std::max(worst, std::fabs(f64(g[i]) - f64(r[i])));
                top = std::max(top, std::fabs(f64(r[i])));
            }
            printf("fused O + gate.up against the two kernels: %s max |diff| %.3g (max |ref| %.3g)\n", what, worst, top);
        };
        cmp(a1, a2, "gate.up");
        cmp(b1, b2, "sum");
    }
#endif
    const auto step = [&]() {
        launch = 0;
        kind.clear();
        for (auto& l : layers) {
            // QKV: RMS(h + res_b) · g1, sum → res_a.
            gemv(0, lp_gemv<LIN_RMSNORM>, cols(QKV), h, res_b, l.g1, l.wqkv, qkv, res_a, QKV, D,
                 lin::HAS_SKIP | lin::HAS_SUM | lin::W_CONST);
            cudaLaunchConfig_t acfg = {};
            acfg.gridDim = dim3(GQA_DEC_CLUSTER, Nk, 1);
            acfg.blockDim = dim3(256, 1, 1);
            acfg.stream = s;
#ifdef LP_ATTN_PDL
            cudaLaunchAttribute aat[1];
            aat[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            aat[0].val.programmaticStreamSerializationAllowed = 1;
            acfg.attrs = aat;
            acfg.numAttrs = 1;
#endif
            CHECK(cudaLaunchKernelEx(&acfg, lp_attn<kiln_tag_f16>,
                launch++, (const S*)qkv, l.k, l.v, seq, cs, cs, qkv, qkv, partial, attn, N, Nk, H, PL, (kiln_u64)QKV,
                (kiln_u64)rows, half, 0u, 0.125f, 0.f, -1, 0u, 1u, 1u, PL, 0u, qkv, qkv, l.k, l.v, PL, (kiln_u64)QKV,
                (kiln_u64)(N * H), (kiln_u64)((N + Nk) * H), 1u, kpb, (kiln_u64)Nk * PL * H, (kiln_u64)PL * H, 0ull,
                31u, 1u, ctr, st));
            kind.push_back(1);
#ifdef LP_FUSED_OGU
            ogu(l, attn, gu, res_b);
#else
#ifndef LP_NO_O
            gemv(2, lp_gemv<LIN_LINEAR>, cols(D), attn, attn, attn, l.wo, o, o, D, N * H, lin::W_CONST);
#endif
            // gate·up: RMS(o + res_a) · g2, sum → res_b.
            gemv(3, lp_gemv<LIN_RMSNORM>, cols(2 * I), o, res_a, l.g2, l.wgu, gu, res_b, 2 * I, D,
                 lin::HAS_SKIP | lin::HAS_SUM | lin::W_CONST);
#endif
            gemv(4, lp_gemv<LIN_SWIGLU>, cols(D), gu, gu, gu, l.wd, h, h, D, I, lin::W_CONST);
        }
    };
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    step();
    CHECK(cudaStreamEndCapture(s, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(graph, nullptr, &nodes));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 20; ++i) CHECK(cudaGraphLaunch(exec, s));
    const int reps = 200;
    CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < reps; ++i) CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    const double step_us = ms * 1000.0 / reps;
    printf("graph of %zu kernels, %u layers: %.1f us per step, %.2f us per layer\n", nodes, L, step_us, step_us / L);
    kiln_status hst;
    CHECK(cudaMemcpy(&hst, st, sizeof(hst), cudaMemcpyDeviceToHost));
    if (hst.code) printf("attention status code %u\n", hst.code);

#ifdef LP_MARKS
    static unsigned long long t[LP_LAUNCHES * LP_BLOCKS * 3];
    memset(t, 0, sizeof(t));
    CHECK(cudaMemcpyToSymbol(g_lp, t, sizeof(t)));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemcpyFromSymbol(t, g_lp, sizeof(t)));
    struct Span {
        unsigned long long entry_min = ~0ull, wait_min = ~0ull, wait_max = 0, end_max = 0;
        unsigned blocks = 0;
    };
    std::vector<Span> sp(launch);
    for (unsigned i = 0; i < launch; ++i)
        for (unsigned blk = 0; blk < LP_BLOCKS; ++blk) {
            const unsigned long long* m = &t[(i * LP_BLOCKS + blk) * 3];
            if (!m[0]) continue;
            Span& x = sp[i];
            ++x.blocks;
            x.entry_min = std::min(x.entry_min, m[0]);
            x.wait_min = std::min(x.wait_min, m[1]);
            x.wait_max = std::max(x.wait_max, m[1]);
            x.end_max = std::max(x.end_max, m[2]);
        }
    const char* names[6] = {"QKV (RmsNormLinear)", "attention (cluster)", "O (Linear)", "gate.up (RmsNormLinear)",
                            "down (SwiGluLinear)", "O + gate.up (fused)"};
    printf("| kernel | blocks | stage | first entry | first wait return | last wait return | work |\n");
    printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    const unsigned per = launch / L;
    double total = 0;
    for (unsigned k = 0; k < per; ++k) {
        std::vector<double> stage, entry, w0, w1, work;
        for (unsigned l = 2; l < L; ++l) {
            const unsigned i = l * per + k;
            const Span &x = sp[i], &p = sp[i - 1];
            stage.push_back(((long long)(x.end_max - p.end_max)) / 1000.0);
            entry.push_back(((long long)(x.entry_min - p.end_max)) / 1000.0);
            w0.push_back(((long long)(x.wait_min - p.end_max)) / 1000.0);
            w1.push_back(((long long)(x.wait_max - p.end_max)) / 1000.0);
            work.push_back(((long long)(x.end_max - x.wait_min)) / 1000.0);
        }
        const auto med = [](std::vector<double> v) {
            std::sort(v.begin(), v.end());
            return v[v.size() / 2];
        };
        total += med(stage);
        printf("| %s | %u | %.2f | %.2f | %.2f | %.2f | %.2f |\n", names[kind[k]], sp[k].blocks, med(stage), med(entry),
               med(w0), med(w1), med(work));
    }
    printf("sum of the median stages: %.2f us per layer (timeline of one replay: %.1f us for the step)\n", total,
           (sp[launch - 1].end_max - sp[0].entry_min) / 1000.0);
#endif
    CHECK(cudaGetLastError());
    return 0;
}
#endif

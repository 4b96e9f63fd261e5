// layer_probe.cu — where a batch-1 decode step's time goes between and inside its kernels: the
// SmolLM2-135M architecture's 30 decoder layers (hidden 576, 9 query heads, 3 KV heads, head size
// 64, MLP 1536, float16, a 384-position cache at position 200) as kiln's fused decode runs them,
// five kernels per layer captured in one CUDA graph: kiln_linear_gemv RMSNORM (residual add, RMS
// norm, QKV), kiln_gqa_decode_cluster_plain (rotary, KV append, attention), kiln_linear_gemv LINEAR (O),
// kiln_linear_gemv RMSNORM (residual add, RMS norm, gate·up), kiln_linear_gemv SWIGLU (SiLU·mul,
// down). The GEMVs are launched with programmatic stream serialization, attention without, as the
// manifests' `pdl` lists make kiln launch them. Weights are random, distinct per layer (160 MiB:
// the step streams them from HBM as a real one does).
//
// First checks layer 0's attention against a float64 reference at positions 0, 7, 64, 383 and
// 200 (the query and new K row rotated and rounded as the kernel does); then prints the graph
// replay's time per step and per layer (CUDA events, mean of 200 replays), and, built with
// -DLP_MARKS, one replay's timeline from the global timer (32 ns ticks) at marks per block:
// entry, return from the grid-dependency wait (entry for attention, which has none), exit, and
// decode attention's phases (attention.cu's GQA_MARK 3–10), and the SM clock over the blocks
// (clock64 against the global timer). Per kernel of the layer (medians over the launches of the
// middle layers, µs): the stage (its last block's exit after the previous kernel's), its first
// block's entry and first wait return after the previous kernel's last exit, and its work (last
// exit after first wait return); attention's phases by last block and by block of KV head 0.
// Options: -DLP_NO_O leaves the O projection out (its stage's cost); -DLP_FUSED_OGU runs O, the
// residual add and RMS norm and gate·up as one kernel (lp_fused, clusters of 8), -DLP_FUSED_ALL
// also each QKV with the previous layer's down (clusters of 16): three kernels per layer (each
// fused kernel is first checked against the two it replaces); -DLP_ATTN_PDL launches attention
// with programmatic stream serialization and a grid-dependency wait at its start
// (-DLP_ATTN_TRIGGER: and lets the O GEMV launch right after it; -DLP_ATTN_EARLY: the wait after
// the kernel's K/V loads instead, attention.cu's GQA_EARLY_WAIT); -DLP_KV_SHARED makes every layer
// read layer 0's K/V cache (L2-resident), -DLP_KV_ARENA puts every layer's in one allocation;
// -DLP_BATCH=2..8 runs that many batch rows at the same position, the projections as kiln
// runs them there (kiln_linear_mma: tensor cores, the weight as the M side); -DLP_EPI computes
// the SwiGLU in gate·up's epilogue and runs down as a plain Linear (kiln-matmul 1.11.0);
// -DGQA_FIXED_H=64 -DGQA_FIXED_GROUP=3 compile attention with the head size and group as constants
// (gqa_decode_regs' FH, FG, as kiln_gqa_decode_cluster_plain_hg; 37 integer divisions by a runtime
// value in its SASS become 6: 1.24 µs less per layer on an H100, session 30);
// -DLP_SPLITK=2|4|8 runs O and down with their K range split over a thread block cluster of that
// many blocks (lp_split, first checked against kiln_linear_gemv; at 2, down's slice takes a
// second pass of loads after the wait; slower than plain at 2, 4 and 8 on an H100, session 30);
// -DLIN_SRC='"path"' and -DATTN_SRC='"path"' take the GEMVs or attention from other sources
// (-DLP_OLD_ATTN for an attention.cu before session 26). On an H100 (bench/RESULTS.md, 2026-12-06)
// both fused forms and attention under PDL (early wait or not) were slower, and the L2-resident
// cache changed nothing.
//
//   mkdir -p inc/kiln-cuda-std && cp kernels/cuda-std/include/* inc/kiln-cuda-std/ && cp host/cuda/kiln.cuh inc/
//   nvcc -O3 -arch=sm_90 -std=c++17 -Iinc -I. [-DLP_MARKS] -o layer_probe bench/layer_probe.cu
#include "kiln.cuh"

#define LP_LAUNCHES 160
#define LP_BLOCKS 512
#define LP_PER 11  // marks per block: 0 entry, 1 wait return, 2 exit, 3–10 decode attention's phases

#ifdef LP_MARKS
__device__ unsigned long long g_lp[LP_LAUNCHES * LP_BLOCKS * LP_PER];
__device__ long long g_clk[LP_LAUNCHES * LP_BLOCKS * 2];  // the SM clock at entry and exit
__shared__ unsigned lp_launch;
// Mark i (0 entry, 1 wait returned, 2 exit, 3–8 attention.cu's GQA_MARK phases) of this block of
// launch lp_launch, by thread 0.
__device__ __forceinline__ void lp_mark(int i) {
    if (threadIdx.x == 0) {
        const unsigned blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        if (blk < LP_BLOCKS && lp_launch < LP_LAUNCHES) {
            g_lp[(lp_launch * LP_BLOCKS + blk) * LP_PER + i] = t;
            if (i == 0 || i == 2) g_clk[(lp_launch * LP_BLOCKS + blk) * 2 + i / 2] = clock64();
        }
    }
}
__device__ __forceinline__ void lp_begin(unsigned launch) {
    if (threadIdx.x == 0) lp_launch = launch;
    lp_mark(0);
}
// The kernels' grid-dependency wait, then mark 1 (the name inside is not expanded again); the
// decode attention kernel's phases.
#define kiln_griddep_wait() (kiln_griddep_wait(), lp_mark(1))
#define GQA_MARK(i) lp_mark(i)
#else
#define lp_mark(i) ((void)0)
#define lp_begin(launch) ((void)(launch))
#endif

#ifndef GQA_FIXED_H
#define GQA_FIXED_H 0  // the head size compiled into attention (0: a kernel argument)
#endif
#ifndef GQA_FIXED_GROUP
#define GQA_FIXED_GROUP 0  // the query group compiled into attention (0: num_heads / kv_num_heads)
#endif

#ifndef LIN_SRC
#define LIN_SRC "kernels/matmul/cuda/linear.cu"  // -DLIN_SRC='"path"' probes another GEMV source
#endif
#include LIN_SRC
#ifdef LP_ATTN_EARLY  // with LP_ATTN_PDL: the wait after the decode kernel's K/V loads
#define GQA_EARLY_WAIT() kiln_griddep_wait()
#endif
#ifndef ATTN_SRC
#define ATTN_SRC "kernels/attention/cuda/attention.cu"  // -DATTN_SRC='"path"' probes another attention source
#endif
#include ATTN_SRC
#include "kiln-cuda-std/cluster.cuh"

typedef kiln_tag_f16::storage S;

template <int MODE>
__global__ void __launch_bounds__(LIN_WARPS * 32)
    lp_gemv(unsigned launch, const S* x, const S* skip, const S* gamma, const S* w, S* y, S* sum, kiln_u64 rows,
            kiln_u64 n, kiln_u64 k, kiln_u64 skip_len, unsigned flags, float eps) {
    lp_begin(launch);
    lin::gemv<lin::F16, MODE, 1>(x, skip, gamma, w, y, sum, rows, n, k, skip_len, flags, eps);
    lp_mark(2);
}

#ifndef LP_BATCH
#define LP_BATCH 1  // batch rows: 1 runs kiln_linear_gemv, 2–8 kiln_linear_mma (tensor cores, NT = 1)
#endif
#if LP_BATCH > 8
#error "LP_BATCH is 1 to 8"
#endif
#if LP_BATCH > 1 && (defined(LP_FUSED_OGU) || defined(LP_FUSED_ALL))
#error "the fused forms are batch 1 only"
#endif
#if defined(LP_SPLITK) && (LP_BATCH > 1 || defined(LP_FUSED_OGU) || defined(LP_FUSED_ALL) || defined(LP_NO_O))
#error "LP_SPLITK replaces batch 1's plain O and down GEMVs"
#endif

template <int MODE>
__global__ void __launch_bounds__(MMA_WARPS * 32)
    lp_mma(unsigned launch, const S* x, const S* skip, const S* gamma, const S* w, S* y, S* sum, kiln_u64 rows,
           kiln_u64 n, kiln_u64 k, kiln_u64 skip_len, unsigned flags, float eps, unsigned ksplit) {
    lp_begin(launch);
    lin::gemv_mma<lin::F16, MODE, 1>(x, skip, gamma, w, y, sum, rows, n, k, skip_len, flags, eps, ksplit);
    lp_mark(2);
}

// Gate·up's and down's modes: RMS prologue, then SwiGLU in down's prologue; -DLP_EPI: the
// SwiGLU as gate·up's epilogue (kiln-matmul 1.11.0's fusion; h [I] between them), down plain.
#if defined(LP_EPI) && (defined(LP_SPLITK) || defined(LP_FUSED_OGU) || defined(LP_FUSED_ALL))
#error "LP_EPI changes gate·up's output to h [I]: the split and fused forms still read [gate | up]"
#endif
#ifdef LP_EPI
#define LP_GU_MODE LIN_RMSNORM_SWIGLU
#define LP_DOWN_MODE LIN_LINEAR
#else
#define LP_GU_MODE LIN_RMSNORM
#define LP_DOWN_MODE LIN_SWIGLU
#endif

// The decode GEMV of MODE that kiln runs at LP_BATCH rows.
#if LP_BATCH > 1
#define LP_GEMV(MODE) lp_mma<MODE>
#else
#define LP_GEMV(MODE) lp_gemv<MODE>
#endif

template <typename Tag>
__global__ void __cluster_dims__(GQA_DEC_CLUSTER, 1, 1) __launch_bounds__(256, 2)
    lp_attn(unsigned launch, KILN_GQA_DECODE_PARAMS) {
    lp_begin(launch);
#if defined(LP_ATTN_PDL) && !defined(LP_ATTN_EARLY)
    kiln_griddep_wait();
#ifdef LP_ATTN_TRIGGER
    kiln_griddep_launch_dependents();
#endif
#else
    lp_mark(1);
#endif
#ifdef LP_OLD_ATTN  // an attention.cu before session 26 (ATTN_SRC): no PLAIN, the layout as one argument
    gqa_decode_regs<Tag, 4, GQA_DEC_CLUSTER>(q_src, pres_k, pres_v, seqlens, cos_c, sin_c, bias, sink, partial, out,
                                             N, Nk, H, PL, q_w, cache_rows, rotary_half, interleaved, scale, softcap,
                                             window, has_bias, bias_b, bias_h, total, sink_mode, k_src, v_src, past_k,
                                             past_v, P, kv_w, k_off, v_off, append, kpb, KILN_GQA_LAYOUT, fold,
                                             counters, st);
#else
#if GQA_FIXED_H || GQA_FIXED_GROUP  // an attention.cu of session 30 or later (FH, FG)
    gqa_decode_regs<Tag, 4, GQA_DEC_CLUSTER, true, GQA_FIXED_H, GQA_FIXED_GROUP>(KILN_GQA_DECODE_ARGS);
#else
    gqa_decode_regs<Tag, 4, GQA_DEC_CLUSTER, true>(KILN_GQA_DECODE_ARGS);
#endif
#endif
    lp_mark(2);
}

// ---- Two projections with a residual add and RMS norm between them, as one kernel ----------
//
// One row. Y2 = RMS(A·W1ᵀ + skip) · gamma · W2ᵀ and sum = A·W1ᵀ + skip, each step rounded to
// float16 where the unfused kernels store it; A = X (MODE1 LIN_LINEAR: the O projection, then
// gate·up) or SiLU(gate)·up of X [gate | up] (LIN_SWIGLU: the down projection, then the next
// layer's QKV). Thread block clusters of any size cl (the launch's cluster dimension; 16 is past
// the portable 8): each cluster computes all of A·W1ᵀ, block `rank` of it outputs rank·c1 .. (c1 =
// n1 / cl, its W1 rows copied into shared memory before the grid-dependency wait), and the blocks
// read each other's through distributed shared memory; every block then normalizes the whole row
// and computes COLS2 outputs per warp of Y2, their W2 rows loaded into registers before the wait.
#define FU_WARPS 8
#define FU_UNROLL 3  // 16-byte W2 chunks per lane and output (n1 ≤ 32·3·8 = 768)

// Dynamic shared memory: W1's c1 rows (c1·k1 values), then f32 a [k1], skip [n1], gamma [n1],
// s [n1], o [c1], red [32].
template <int MODE1, int COLS2>
__global__ void __launch_bounds__(FU_WARPS * 32, 1)
    lp_fused(unsigned launch, const S* x, const S* w1, const S* skip, const S* gamma, const S* w2, S* y, S* sum,
             unsigned k1, unsigned n1, unsigned n2, float eps) {
    typedef lin::F16 T;
    lp_begin(launch);
    extern __shared__ __align__(16) unsigned char fu_shared[];
    const unsigned rank = kiln_cluster_rank(), cl = kiln_cluster_size();
    const unsigned tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const unsigned c1 = n1 / cl, kc1 = k1 / 8, kc2 = n1 / 8;
    uint4* w1s = (uint4*)fu_shared;
    float* as = (float*)(w1s + c1 * kc1);
    float* ks = as + k1;
    float* gs = ks + n1;
    float* ss = gs + n1;
    float* os = ss + n1;
    float* red = os + c1;
    // Before the wait: W1's rows rank·c1 .. into shared memory, this warp's W2 rows into registers.
    const uint4* w1r = (const uint4*)w1 + (size_t)rank * c1 * kc1;
    for (unsigned i = tid; i < c1 * kc1; i += blockDim.x) kiln_cp_async16(&w1s[i], &w1r[i]);
    kiln_cp_async_commit();
    const unsigned col2 = (blockIdx.x * FU_WARPS + warp) * COLS2;
    uint4 wv[COLS2][FU_UNROLL];
#pragma unroll
    for (int j = 0; j < COLS2; ++j)
#pragma unroll
        for (int u = 0; u < FU_UNROLL; ++u) {
            const unsigned c = u * 32 + lane;
            wv[j][u] = col2 + j < n2 && c < kc2 ? __ldg((const uint4*)w2 + (size_t)(col2 + j) * kc2 + c)
                                                : make_uint4(0, 0, 0, 0);
        }
    kiln_griddep_launch_dependents();
    kiln_griddep_wait();
    // A (rounded as the unfused graph stores it), skip and gamma as f32.
    for (unsigned i = tid; i < kc1 + 2 * kc2; i += blockDim.x) {
        float f[8];
        if (i < kc1) {
            T::unpack(((const uint4*)x)[i], f);
            if (MODE1 == LIN_SWIGLU) {
                float u[8];
                T::unpack(((const uint4*)x)[kc1 + i], u);
#pragma unroll
                for (int e = 0; e < 8; ++e) f[e] = T::ld(T::st(lin::silu_mul<T>(f[e], u[e])));
            }
        } else {
            T::unpack(i < kc1 + kc2 ? ((const uint4*)skip)[i - kc1] : ((const uint4*)gamma)[i - kc1 - kc2], f);
        }
        float* dst = i < kc1 ? as + 8 * i : i < kc1 + kc2 ? ks + 8 * (i - kc1) : gs + 8 * (i - kc1 - kc2);
#pragma unroll
        for (int e = 0; e < 8; ++e) dst[e] = f[e];
    }
    kiln_cp_async_wait<0>();
    __syncthreads();
    // This block's outputs of A·W1ᵀ, rounded as the unfused projection stores them.
    for (unsigned c = warp; c < c1; c += FU_WARPS) {
        float acc = 0.f;
        for (unsigned ch = lane; ch < kc1; ch += 32) {
            float wf[8], af[8];
            T::unpack(w1s[c * kc1 + ch], wf);
            lin::load_a<T>(as + 8 * ch, af);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(af[e], wf[e], acc);
        }
        acc = kiln_warp_sum(acc);
        if (lane == 0) os[c] = T::ld(T::st(acc));
    }
    kiln_cluster_arrive();
    kiln_cluster_wait();
    // s = A·W1ᵀ + skip over the whole row (the other blocks' parts through the cluster).
    float q = 0.f;
    for (unsigned i = tid; i < n1; i += blockDim.x) {
        const float v = kiln_cluster_ld(os + i % c1, i / c1) + ks[i];
        ss[i] = v;
        q += v * v;
        if (blockIdx.x == 0) sum[i] = T::st(v);
    }
    kiln_cluster_arrive();  // this block reads no other block's shared memory after this
    const float inv = 1.f / sqrtf(kiln_block_reduce(q, red, false) / (float)n1 + eps);
    for (unsigned i = tid; i < n1; i += blockDim.x) ss[i] = T::ld(T::st(ss[i] * inv * gs[i]));
    __syncthreads();
    float acc[COLS2];
#pragma unroll
    for (int j = 0; j < COLS2; ++j) acc[j] = 0.f;
#pragma unroll
    for (int u = 0; u < FU_UNROLL; ++u) {
        const unsigned c = u * 32 + lane;
        if (c < kc2) {
            float af[8];
            lin::load_a<T>(ss + 8 * c, af);
#pragma unroll
            for (int j = 0; j < COLS2; ++j) {
                float wf[8];
                T::unpack(wv[j][u], wf);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[j] = fmaf(af[e], wf[e], acc[j]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < COLS2; ++j) {
        const float v = kiln_warp_sum(acc[j]);
        if (lane == 0 && col2 + j < n2) y[col2 + j] = T::st(v);
    }
    kiln_cluster_wait();  // every block has read this one's outputs
    lp_mark(2);
}

// ---- One projection with its K range split over a thread block cluster (-DLP_SPLITK=cl) ----------
//
// One row, Y [n] = A · Wᵀ with A = X (LIN_LINEAR: the O projection) or SiLU(gate)·up of X [gate |
// up] (LIN_SWIGLU: down), as kiln_linear_gemv computes it, but each of its blocks of LIN_WARPS ·
// LIN_COLS outputs is a cluster of cl blocks (the launch's cluster dimension) that split K: block
// `rank` loads chunks rank·kcs .. of the outputs' weight rows (kcs = ⌈k / 8 / cl⌉) and computes
// that slice of A, so the projection runs on cl times the multiprocessors, each with a cl-th of
// the weight bytes and of the prologue. Rank 0 sums the blocks' f32 partial sums in rank order
// from their shared memory (distributed shared memory) and writes Y. The question it answers: O
// and down have 576 outputs, so kiln_linear_gemv runs them on 36 blocks; is their stage (3.0 and
// 4.0 µs in session 25's timeline) bound by that?
#define SP_UNROLL 2  // 16-byte weight loads per lane and output in flight

template <int MODE>
__global__ void __launch_bounds__(LIN_WARPS * 32)
    lp_split(unsigned launch, const S* x, const S* w, S* y, unsigned n, unsigned k) {
    typedef lin::F16 T;
    lp_begin(launch);
    extern __shared__ __align__(16) unsigned char sp_shared[];
    const unsigned rank = kiln_cluster_rank(), cl = kiln_cluster_size();
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const unsigned kc = k / 8, kcs = (kc + cl - 1) / cl, c0 = rank * kcs;
    const unsigned kch = c0 < kc ? min(kcs, kc - c0) : 0;  // this block's chunks
    float* a = (float*)sp_shared;                          // [kcs · 8]
    float* part = a + kcs * 8;                             // [LIN_WARPS · LIN_COLS]
    const unsigned col = ((blockIdx.x / cl) * LIN_WARPS + warp) * LIN_COLS;
    const uint4* w4 = (const uint4*)w;
    const auto load = [&](uint4 (&wv)[LIN_COLS][SP_UNROLL], unsigned base) {
#pragma unroll
        for (int j = 0; j < LIN_COLS; ++j)
#pragma unroll
            for (int u = 0; u < SP_UNROLL; ++u) {
                const unsigned c = base + u * 32 + lane;
                wv[j][u] = col + j < n && c < kch ? __ldg(w4 + (size_t)(col + j) * kc + c0 + c) : make_uint4(0, 0, 0, 0);
            }
    };
    // Before the wait: the first pass of this warp's weight chunks (W constant) into registers.
    uint4 wv[LIN_COLS][SP_UNROLL];
    load(wv, 0);
    kiln_griddep_launch_dependents();
    kiln_griddep_wait();
    const uint4* x4 = (const uint4*)x;
    for (unsigned i = threadIdx.x; i < kch; i += blockDim.x) {
        float f[8];
        T::unpack(x4[c0 + i], f);
        if (MODE == LIN_SWIGLU) {
            float u[8];
            T::unpack(x4[kc + c0 + i], u);
#pragma unroll
            for (int e = 0; e < 8; ++e) f[e] = lin::silu_mul<T>(f[e], u[e]);
        }
        lin::store_a<T>(a + 8 * i, f);
    }
    __syncthreads();
    float acc[LIN_COLS];
#pragma unroll
    for (int j = 0; j < LIN_COLS; ++j) acc[j] = 0.f;
    for (unsigned base = 0; base < kch; base += 32 * SP_UNROLL) {
        if (base > 0) load(wv, base);
#pragma unroll
        for (int u = 0; u < SP_UNROLL; ++u) {
            const unsigned c = base + u * 32 + lane;
            if (c >= kch) continue;
            float af[8];
            lin::load_a<T>(a + 8 * c, af);
#pragma unroll
            for (int j = 0; j < LIN_COLS; ++j) {
                float wf[8];
                T::unpack(wv[j][u], wf);
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[j] = fmaf(af[e], wf[e], acc[j]);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < LIN_COLS; ++j) {
        const float v = kiln_warp_sum(acc[j]);
        if (lane == 0) part[warp * LIN_COLS + j] = v;
    }
    kiln_cluster_arrive();
    kiln_cluster_wait();  // every block's partial sums
    if (rank == 0 && threadIdx.x < LIN_WARPS * LIN_COLS) {
        float v = 0.f;
        for (unsigned r = 0; r < cl; ++r) v += kiln_cluster_ld(part + threadIdx.x, r);
        const unsigned o = (blockIdx.x / cl) * LIN_WARPS * LIN_COLS + threadIdx.x;
        if (o < n) y[o] = T::st(v);
    }
    kiln_cluster_arrive();
    kiln_cluster_wait();  // rank 0 has read every block's sums
    lp_mark(2);
}

// lp_fused's dynamic shared memory for W1 [n1, k1] over clusters of cl blocks.
static inline unsigned fused_shared_bytes(unsigned k1, unsigned n1, unsigned cl) {
    return (n1 / cl) * k1 * 2 + (k1 + 3 * n1 + n1 / cl + 32) * 4;
}

#ifdef __CUDACC_RTC__
// For a compile check without a GPU (KILN_NVRTC_OPTS=-I. python3 scripts/nvrtc-check.py
// bench/layer_probe.cu): the kernels main() launches, instantiated.
__global__ void lp_instances(void** p) {
    p[0] = (void*)lp_gemv<LIN_LINEAR>;
    p[1] = (void*)lp_gemv<LIN_RMSNORM>;
    p[2] = (void*)lp_gemv<LIN_SWIGLU>;
    p[3] = (void*)lp_attn<kiln_tag_f16>;
    p[4] = (void*)lp_fused<LIN_LINEAR, 3>;
    p[5] = (void*)lp_fused<LIN_SWIGLU, 4>;
    p[6] = (void*)lp_mma<LIN_LINEAR>;
    p[7] = (void*)lp_mma<LIN_RMSNORM>;
    p[8] = (void*)lp_mma<LIN_SWIGLU>;
    p[9] = (void*)lp_split<LIN_LINEAR>;
    p[10] = (void*)lp_split<LIN_SWIGLU>;
    p[11] = (void*)lp_gemv<LIN_RMSNORM_SWIGLU>;
    p[12] = (void*)lp_mma<LIN_RMSNORM_SWIGLU>;
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

// A device buffer of n float16 values, uniform in [-scale, scale].
static S* random_f16(size_t n, float scale) {
    std::vector<S> h(n);
    for (auto& v : h) v = probe_h16(scale * ((rand() % 2001) - 1000) / 1000.f);
    S* d;
    CHECK(cudaMalloc(&d, n * 2));
    CHECK(cudaMemcpy(d, h.data(), n * 2, cudaMemcpyHostToDevice));
    return d;
}

int main() {
    const unsigned L = 30, D = 576, N = 9, Nk = 3, H = 64, I = 1536, PL = 384, pos = 200, rows = 4096, half = 32;
    const unsigned B = LP_BATCH;
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
        l.k = random_f16((size_t)B * Nk * PL * H, 1.f);
        l.v = random_f16((size_t)B * Nk * PL * H, 1.f);
    }
#ifdef LP_KV_SHARED
    // Every layer reads layer 0's K/V cache (L2-resident: the K/V loads' latency without HBM).
    for (auto& l : layers) {
        l.k = layers[0].k;
        l.v = layers[0].v;
    }
#endif
#ifdef LP_KV_ARENA
    {
        // Every layer's K/V cache in one allocation, as kiln's arena holds them.
        S* arena;
        const size_t per = (size_t)B * Nk * PL * H;
        CHECK(cudaMalloc(&arena, 2 * L * per * 2));
        for (unsigned li = 0; li < L; ++li) {
            CHECK(cudaMemcpy(arena + 2 * li * per, layers[li].k, per * 2, cudaMemcpyDeviceToDevice));
            CHECK(cudaMemcpy(arena + (2 * li + 1) * per, layers[li].v, per * 2, cudaMemcpyDeviceToDevice));
            layers[li].k = arena + 2 * li * per;
            layers[li].v = arena + (2 * li + 1) * per;
        }
    }
#endif
    S *h = random_f16(B * D, 1.f), *res_a = random_f16(B * D, 1.f), *res_b = random_f16(B * D, 1.f);
    S *qkv = random_f16(B * QKV, 1.f), *attn = random_f16(B * N * H, 1.f), *o = random_f16(B * D, 1.f);
    S *gu = random_f16((size_t)B * 2 * I, 1.f), *cs = random_f16((size_t)rows * half, 1.f);
    float* partial;
    int* seq;
    kiln_counter* ctr;
    kiln_status* st;
    // Every batch row at the same position.
    const auto set_position = [&](unsigned p) {
        const std::vector<int> v(B, (int)p);
        CHECK(cudaMemcpy(seq, v.data(), B * 4, cudaMemcpyHostToDevice));
    };
    CHECK(cudaMalloc(&partial, (size_t)B * N * GQA_DEC_CLUSTER * (H + 2) * 4));
    CHECK(cudaMalloc(&seq, B * 4));
    set_position(pos);
    CHECK(cudaMalloc(&ctr, B * Nk * 4));
    CHECK(cudaMemset(ctr, 0, B * Nk * 4));
    CHECK(cudaMalloc(&st, sizeof(kiln_status)));
    CHECK(cudaMemset(st, 0, sizeof(kiln_status)));

    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    unsigned launch = 0;
    // Kernel of each launch: 0 QKV, 1 attention, 2 O, 3 gate·up, 4 down, 5 O + gate·up fused,
    // 6 down + QKV fused.
    std::vector<int> kind;
    [[maybe_unused]] const char* names[7] = {"QKV (RmsNormLinear)", "attention (cluster)", "O (Linear)", "gate.up (RmsNormLinear)",
                            "down (SwiGluLinear)", "O + gate.up (fused)", "down + QKV (fused)"};
    cudaLaunchAttribute pdl = {};
    pdl.id = cudaLaunchAttributeProgrammaticStreamSerialization;
    pdl.val.programmaticStreamSerializationAllowed = 1;
    const auto gemv = [&](int k, auto kernel, unsigned blocks, const S* x, const S* skip, const S* gamma, const S* w,
                          S* y, S* sum, unsigned n, unsigned kk, unsigned flags) {
        cudaLaunchConfig_t cfg = {};
        cfg.stream = s;
        cfg.attrs = &pdl;
        cfg.numAttrs = 1;
#if LP_BATCH > 1
        // The shim's launch_mma: 16-output tiles, blocks of MMA_WARPS warps holding fewer tiles
        // (their warps splitting K) until the grid has 128 blocks; A in shared memory.
        (void)blocks;
        const unsigned tiles = (n + 15) / 16;
        unsigned per_block = MMA_WARPS;
        while (per_block > 1 && (tiles + per_block - 1) / per_block < 128) per_block /= 2;
        const unsigned kcp = (kk / 8 + 7) / 8 * 8;
        cfg.gridDim = dim3((tiles + per_block - 1) / per_block, 1, 1);
        cfg.blockDim = dim3(MMA_WARPS * 32, 1, 1);
        cfg.dynamicSmemBytes = std::max(8u * kcp * 16u, (unsigned)MMA_WARPS * 512u);
        CHECK(cudaLaunchKernelEx(&cfg, kernel, launch++, x, skip, gamma, w, y, sum, (kiln_u64)B, (kiln_u64)n,
                                 (kiln_u64)kk, (kiln_u64)B * kk, flags, eps, (unsigned)(MMA_WARPS / per_block)));
#else
        cfg.gridDim = dim3(blocks, 1, 1);
        cfg.blockDim = dim3(LIN_WARPS * 32, 1, 1);
        cfg.dynamicSmemBytes = kk * 4;
        CHECK(cudaLaunchKernelEx(&cfg, kernel, launch++, x, skip, gamma, w, y, sum, (kiln_u64)1, (kiln_u64)n,
                                 (kiln_u64)kk, (kiln_u64)kk, flags, eps));
#endif
        kind.push_back(k);
    };
    // GEMV blocks for n outputs (the shim's: LIN_WARPS · LIN_COLS outputs per block).
    const auto cols = [](unsigned n) { return (n + LIN_WARPS * LIN_COLS - 1) / (LIN_WARPS * LIN_COLS); };
    // lp_fused over clusters of `cl` blocks: Y2 [n2] = RMS(A·W1ᵀ + skip) · gamma · W2ᵀ, A from x [k1] (or
    // [2·k1], SwiGlu), sum [n1].
    const unsigned OGU_CL = 8, DQKV_CL = 16;
    // The launch attribute of clusters of `cl` blocks along x.
    const auto cluster = [](unsigned cl) {
        cudaLaunchAttribute a = {};
        a.id = cudaLaunchAttributeClusterDimension;
        a.val.clusterDim.x = cl;
        a.val.clusterDim.y = 1;
        a.val.clusterDim.z = 1;
        return a;
    };
    const auto fused = [&](int k, auto kernel, unsigned cols2, unsigned cl, const S* x, const S* w1, const S* skip,
                           const S* gamma, const S* w2, S* y, S* sum, unsigned k1, unsigned n1, unsigned n2) {
        const unsigned smem = fused_shared_bytes(k1, n1, cl);
        const unsigned blocks = (n2 + FU_WARPS * cols2 - 1) / (FU_WARPS * cols2);
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3((blocks + cl - 1) / cl * cl, 1, 1);
        cfg.blockDim = dim3(FU_WARPS * 32, 1, 1);
        cfg.dynamicSmemBytes = smem;
        cfg.stream = s;
        cudaLaunchAttribute at[2] = {pdl, cluster(cl)};
        cfg.attrs = at;
        cfg.numAttrs = 2;
        CHECK(cudaLaunchKernelEx(&cfg, kernel, launch++, x, w1, skip, gamma, w2, y, sum, k1, n1, n2, eps));
        kind.push_back(k);
    };
    // Their attributes, set outside the capture: the shared memory of W1's slice, and clusters
    // past the portable 8.
    CHECK(cudaFuncSetAttribute(lp_fused<LIN_LINEAR, 3>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)fused_shared_bytes(N * H, D, OGU_CL)));
    CHECK(cudaFuncSetAttribute(lp_fused<LIN_SWIGLU, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)fused_shared_bytes(I, D, DQKV_CL)));
    CHECK(cudaFuncSetAttribute(lp_fused<LIN_SWIGLU, 4>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
#ifdef LP_FUSED_ALL
    {
        // Clusters of 16 need 16 free multiprocessors of one GPC: stop where the GPU has none.
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(32, 1, 1);
        cfg.blockDim = dim3(FU_WARPS * 32, 1, 1);
        cfg.dynamicSmemBytes = fused_shared_bytes(I, D, DQKV_CL);
        cudaLaunchAttribute at[1] = {cluster(DQKV_CL)};
        cfg.attrs = at;
        cfg.numAttrs = 1;
        int clusters = 0;
        CHECK(cudaOccupancyMaxActiveClusters(&clusters, lp_fused<LIN_SWIGLU, 4>, &cfg));
        printf("clusters of %u blocks (%zu B of shared memory each) at once: %d\n", DQKV_CL, cfg.dynamicSmemBytes,
               clusters);
        if (clusters < 1) return 1;
    }
#endif
    const auto ogu = [&](const Layer& l, const S* skip, S* sum_out) {
        fused(5, lp_fused<LIN_LINEAR, 3>, 3, OGU_CL, attn, l.wo, skip, l.g2, l.wgu, gu, sum_out, N * H, D, 2 * I);
    };
    const auto dqkv = [&](const Layer& prev, const Layer& l, const S* skip, S* sum_out) {
        fused(6, lp_fused<LIN_SWIGLU, 4>, 4, DQKV_CL, gu, prev.wd, skip, l.g1, l.wqkv, qkv, sum_out, I, D, QKV);
    };
#ifdef LP_SPLITK
    // lp_split: a cluster of LP_SPLITK blocks per block of kiln_linear_gemv's outputs.
    const auto split = [&](int k, auto kernel, const S* x, const S* w, S* y, unsigned n, unsigned kk) {
        const unsigned cl = LP_SPLITK, kcs = (kk / 8 + cl - 1) / cl;
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(cols(n) * cl, 1, 1);
        cfg.blockDim = dim3(LIN_WARPS * 32, 1, 1);
        cfg.dynamicSmemBytes = (kcs * 8 + LIN_WARPS * LIN_COLS) * 4;
        cfg.stream = s;
        cudaLaunchAttribute at[2] = {pdl, cluster(cl)};
        cfg.attrs = at;
        cfg.numAttrs = 2;
        CHECK(cudaLaunchKernelEx(&cfg, kernel, launch++, x, w, y, n, kk));
        kind.push_back(k);
    };
    {
        // Each split projection against kiln_linear_gemv on the same inputs (the sums differ only
        // in their order: a float16 rounding at most).
        const Layer& l = layers[1];
        S *y_ref = random_f16(D, 1.f), *y_split = random_f16(D, 1.f);
        const auto compare = [&](const char* what) {
            CHECK(cudaStreamSynchronize(s));
            std::vector<S> r(D), g(D);
            CHECK(cudaMemcpy(r.data(), y_ref, D * 2, cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(g.data(), y_split, D * 2, cudaMemcpyDeviceToHost));
            double worst = 0, top = 0;
            for (unsigned i = 0; i < D; ++i) {
                worst = std::max(worst, std::fabs(probe_f64(g[i]) - probe_f64(r[i])));
                top = std::max(top, std::fabs(probe_f64(r[i])));
            }
            // The two sums differ in order only: within about one float16 rounding of the largest.
            const bool ok = worst <= top * std::ldexp(1.0, -9);
            printf("%s split over clusters of %d against kiln_linear_gemv: max |diff| %.3g (max |ref| %.3g)%s\n", what,
                   LP_SPLITK, worst, top, ok ? "" : " FAILED");
            return ok;
        };
        gemv(2, LP_GEMV(LIN_LINEAR), cols(D), attn, attn, attn, l.wo, y_ref, y_ref, D, N * H, lin::W_CONST);
        split(2, lp_split<LIN_LINEAR>, attn, l.wo, y_split, D, N * H);
        bool ok = compare("O (Linear)");
        gemv(4, LP_GEMV(LIN_SWIGLU), cols(D), gu, gu, gu, l.wd, y_ref, y_ref, D, I, lin::W_CONST);
        split(4, lp_split<LIN_SWIGLU>, gu, l.wd, y_split, D, I);
        ok &= compare("down (SwiGluLinear)");
        if (!ok) return 1;
    }
#endif
    const auto attention = [&](const Layer& l) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(GQA_DEC_CLUSTER, Nk, B);
        cfg.blockDim = dim3(256, 1, 1);
        cfg.stream = s;
#ifdef LP_ATTN_PDL
        cfg.attrs = &pdl;
        cfg.numAttrs = 1;
#endif
        CHECK(cudaLaunchKernelEx(&cfg, lp_attn<kiln_tag_f16>, launch++, (const S*)qkv, l.k, l.v, seq, cs, cs, qkv, qkv,
                                 partial, attn, N, Nk, H, PL, (kiln_u64)QKV, (kiln_u64)rows, half, 0u, 0.125f, 0.f, -1,
                                 0u, 1u, 1u, PL, 0u, qkv, qkv, l.k, l.v, PL, (kiln_u64)QKV, (kiln_u64)(N * H),
                                 (kiln_u64)((N + Nk) * H), 1u, kpb, (kiln_u64)Nk * PL * H, (kiln_u64)PL * H, 0ull, 31u,
                                 1u, ctr, st));
        kind.push_back(1);
    };
    (void)ogu;
    (void)dqkv;
    for (const unsigned pos : {0u, 7u, 64u, PL - 1, 200u}) {
        // Layer 0's attention against a float64 reference on the same inputs: the query and the
        // new K row rotated and rounded to float16 as the kernel does, keys 0 … pos (the graph
        // runs at the last one).
        set_position(pos);
        attention(layers[0]);
        CHECK(cudaStreamSynchronize(s));
        std::vector<S> hqa((size_t)B * QKV), hoa((size_t)B * N * H), hka((size_t)B * Nk * PL * H),
            hva((size_t)B * Nk * PL * H), hc((size_t)rows * half);
        CHECK(cudaMemcpy(hqa.data(), qkv, hqa.size() * 2, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(hoa.data(), attn, hoa.size() * 2, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(hka.data(), layers[0].k, hka.size() * 2, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(hva.data(), layers[0].v, hva.size() * 2, cudaMemcpyDeviceToHost));
        CHECK(cudaMemcpy(hc.data(), cs, hc.size() * 2, cudaMemcpyDeviceToHost));
        const auto rope = [&](const S* x, unsigned d) {
            const unsigned i = d < half ? d : d - half;
            const float c = (float)probe_f64(hc[(size_t)pos * half + i]), sn = c;  // cos and sin are one table
            const float xa = (float)probe_f64(x[i]), xb = (float)probe_f64(x[i + half]);
            return probe_f64(probe_h16(d < half ? xa * c - xb * sn : xa * sn + xb * c));
        };
        double worst = 0, top = 0, worst_row = 0;
        for (unsigned b = 0; b < B; ++b)
        for (unsigned j = 0; j < Nk; ++j) {
            // Batch row b's query, K/V caches and output.
            const S* hq = &hqa[(size_t)b * QKV];
            const S* hk = &hka[(size_t)b * Nk * PL * H];
            const S* hv = &hva[(size_t)b * Nk * PL * H];
            const S* ho = &hoa[(size_t)b * N * H];
            for (unsigned d = 0; d < H; ++d) {  // the appended row, K rotated
                const double kd = rope(&hq[(N + j) * H], d), kg = probe_f64(hk[(size_t)j * PL * H + pos * H + d]);
                const double vd = probe_f64(hq[(N + Nk + j) * H + d]);
                const double vg = probe_f64(hv[(size_t)j * PL * H + pos * H + d]);
                worst_row = std::max(worst_row, std::max(std::fabs(kd - kg), std::fabs(vd - vg)));
            }
            for (unsigned g = 0; g < N / Nk; ++g) {
                const unsigned h = j * (N / Nk) + g;
                std::vector<double> q(H), sc(pos + 1);
                for (unsigned d = 0; d < H; ++d) q[d] = rope(&hq[h * H], d);
                double m = -1e300, l = 0;
                for (unsigned t = 0; t <= pos; ++t) {
                    double dot = 0;
                    for (unsigned d = 0; d < H; ++d)
                        dot += q[d] * (t < pos ? probe_f64(hk[(size_t)j * PL * H + t * H + d])
                                               : rope(&hq[(N + j) * H], d));
                    sc[t] = 0.125 * dot;
                    m = std::max(m, sc[t]);
                }
                for (auto& x : sc) l += (x = std::exp(x - m));
                for (unsigned d = 0; d < H; ++d) {
                    double o = 0;
                    for (unsigned t = 0; t <= pos; ++t)
                        o += sc[t] * (t < pos ? probe_f64(hv[(size_t)j * PL * H + t * H + d])
                                              : probe_f64(hq[(N + Nk + j) * H + d]));
                    o /= l;
                    worst = std::max(worst, std::fabs(o - probe_f64(ho[h * H + d])));
                    top = std::max(top, std::fabs(o));
                }
            }
        }
        printf("attention at position %u against float64: max |diff| %.3g (max |ref| %.3g), appended row max "
               "|diff| %.3g\n", pos, worst, top, worst_row);
        if (!(worst <= 2e-3 * std::max(1.0, top)) || !(worst_row <= 4e-3)) {
            printf("attention output wrong\n");
            return 1;
        }
    }
#if defined(LP_FUSED_OGU) || defined(LP_FUSED_ALL)
    {
        // Each fused kernel against the two it replaces, on layer 1's weights (and layer 0's down).
        const auto check = [&](const char* what, S* y, size_t ny, S* sum_out, S* y_ref, S* sum_ref) {
            CHECK(cudaStreamSynchronize(s));
            std::vector<S> a1(ny), a2(ny), b1(D), b2(D);
            CHECK(cudaMemcpy(a1.data(), y_ref, ny * 2, cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(a2.data(), y, ny * 2, cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(b1.data(), sum_ref, D * 2, cudaMemcpyDeviceToHost));
            CHECK(cudaMemcpy(b2.data(), sum_out, D * 2, cudaMemcpyDeviceToHost));
            const auto cmp = [](const std::vector<S>& r, const std::vector<S>& g, double* worst, double* top) {
                for (size_t i = 0; i < r.size(); ++i) {
                    *worst = std::max(*worst, std::fabs(probe_f64(g[i]) - probe_f64(r[i])));
                    *top = std::max(*top, std::fabs(probe_f64(r[i])));
                }
            };
            double w1 = 0, t1 = 0, w2 = 0, t2 = 0;
            cmp(a1, a2, &w1, &t1);
            cmp(b1, b2, &w2, &t2);
            printf("%s against the two kernels: output max |diff| %.3g (max |ref| %.3g), sum max |diff| %.3g (max "
                   "|ref| %.3g)\n", what, w1, t1, w2, t2);
        };
        S *y_ref = random_f16(2 * I, 1.f), *sum_ref = random_f16(D, 1.f), *sum2 = random_f16(D, 1.f);
        const Layer& l = layers[1];
        gemv(2, LP_GEMV(LIN_LINEAR), cols(D), attn, attn, attn, l.wo, o, o, D, N * H, lin::W_CONST);
        gemv(3, LP_GEMV(LIN_RMSNORM), cols(2 * I), o, res_a, l.g2, l.wgu, y_ref, sum_ref, 2 * I, D,
             lin::HAS_SKIP | lin::HAS_SUM | lin::W_CONST);
        ogu(l, res_a, sum2);
        check("O + gate.up (fused)", gu, 2 * I, sum2, y_ref, sum_ref);
        gemv(4, LP_GEMV(LIN_SWIGLU), cols(D), gu, gu, gu, layers[0].wd, h, h, D, I, lin::W_CONST);
        gemv(0, LP_GEMV(LIN_RMSNORM), cols(QKV), h, res_b, l.g1, l.wqkv, y_ref, sum_ref, QKV, D,
             lin::HAS_SKIP | lin::HAS_SUM | lin::W_CONST);
        dqkv(layers[0], l, res_b, sum2);
        check("down + QKV (fused)", qkv, QKV, sum2, y_ref, sum_ref);
    }
#endif
    // One decode step: per layer QKV (RMS(h + res_b) · g1, sum → res_a), attention, O, gate·up
    // (RMS(o + res_a) · g2, sum → res_b), down; -DLP_FUSED_OGU: O + gate·up as one kernel;
    // -DLP_FUSED_ALL: that, and each layer's QKV fused with the previous layer's down (three
    // kernels per layer; the first QKV and the last down stay alone).
    const auto step = [&]() {
        launch = 0;
        kind.clear();
        for (unsigned li = 0; li < L; ++li) {
            const Layer& l = layers[li];
#ifdef LP_FUSED_ALL
            if (li == 0)
                gemv(0, LP_GEMV(LIN_RMSNORM), cols(QKV), h, res_b, l.g1, l.wqkv, qkv, res_a, QKV, D,
                     lin::HAS_SKIP | lin::HAS_SUM | lin::W_CONST);
            else
                dqkv(layers[li - 1], l, res_b, res_a);
#else
            gemv(0, LP_GEMV(LIN_RMSNORM), cols(QKV), h, res_b, l.g1, l.wqkv, qkv, res_a, QKV, D,
                 lin::HAS_SKIP | lin::HAS_SUM | lin::W_CONST);
#endif
            attention(l);
#if defined(LP_FUSED_OGU) || defined(LP_FUSED_ALL)
            ogu(l, res_a, res_b);
#else
#if defined(LP_SPLITK)
            split(2, lp_split<LIN_LINEAR>, attn, l.wo, o, D, N * H);
#elif !defined(LP_NO_O)
            gemv(2, LP_GEMV(LIN_LINEAR), cols(D), attn, attn, attn, l.wo, o, o, D, N * H, lin::W_CONST);
#endif
            gemv(3, LP_GEMV(LP_GU_MODE), cols(2 * I), o, res_a, l.g2, l.wgu, gu, res_b, 2 * I, D,
                 lin::HAS_SKIP | lin::HAS_SUM | lin::W_CONST);
#endif
#ifdef LP_FUSED_ALL
            if (li + 1 < L) continue;
#endif
#ifdef LP_SPLITK
            split(4, lp_split<LIN_SWIGLU>, gu, l.wd, h, D, I);
#else
            gemv(4, LP_GEMV(LP_DOWN_MODE), cols(D), gu, gu, gu, l.wd, h, h, D, I, lin::W_CONST);
#endif
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
    printf("graph of %zu kernels, %u layers, batch %u: %.1f us per step, %.2f us per layer\n", nodes, L, B, step_us,
           step_us / L);
    kiln_status hst;
    CHECK(cudaMemcpy(&hst, st, sizeof(hst), cudaMemcpyDeviceToHost));
    if (hst.code) printf("attention status code %u\n", hst.code);

#ifdef LP_MARKS
    static unsigned long long t[LP_LAUNCHES * LP_BLOCKS * LP_PER];
    memset(t, 0, sizeof(t));
    CHECK(cudaMemcpyToSymbol(g_lp, t, sizeof(t)));
    CHECK(cudaGraphLaunch(exec, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemcpyFromSymbol(t, g_lp, sizeof(t)));
    static long long clk[LP_LAUNCHES * LP_BLOCKS * 2];
    CHECK(cudaMemcpyFromSymbol(clk, g_clk, sizeof(clk)));
    struct Span {
        unsigned long long entry_min = ~0ull, wait_min = ~0ull, end_max = 0;
    };
    std::vector<Span> sp(launch);
    std::vector<unsigned> blocks(launch, 0);
    for (unsigned i = 0; i < launch && i < LP_LAUNCHES; ++i)
        for (unsigned blk = 0; blk < LP_BLOCKS; ++blk) {
            const unsigned long long* m = &t[(i * LP_BLOCKS + blk) * LP_PER];
            if (!m[0]) continue;
            ++blocks[i];
            sp[i].entry_min = std::min(sp[i].entry_min, m[0]);
            sp[i].wait_min = std::min(sp[i].wait_min, m[1]);
            sp[i].end_max = std::max(sp[i].end_max, m[2]);
        }
    // Per kernel kind, medians over the launches past the first and last fifteenth (µs from the previous
    // kernel's last block exit: its own last exit, first entry and first wait return; its work is
    // its last exit after its first wait return).
    printf("| kernel | blocks | launches | stage | first entry | first wait return | work |\n");
    printf("| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n");
    const auto med = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        return v.empty() ? 0.0 : v[v.size() / 2];
    };
    double total = 0;
    for (int k = 0; k < 7; ++k) {
        std::vector<double> stage, entry, w0, work;
        unsigned nb = 0;
        for (unsigned i = launch / 15; i + launch / 15 < launch; ++i) {
            if (kind[i] != k || !blocks[i] || !blocks[i - 1]) continue;
            const Span &x = sp[i], &p = sp[i - 1];
            nb = blocks[i];
            stage.push_back(((long long)(x.end_max - p.end_max)) / 1000.0);
            entry.push_back(((long long)(x.entry_min - p.end_max)) / 1000.0);
            w0.push_back(((long long)(x.wait_min - p.end_max)) / 1000.0);
            work.push_back(((long long)(x.end_max - x.wait_min)) / 1000.0);
        }
        if (stage.empty()) continue;
        total += med(stage);
        printf("| %s | %u | %zu | %.2f | %.2f | %.2f | %.2f |\n", names[k], nb, stage.size(), med(stage), med(entry),
               med(w0), med(work));
    }
    {
        // The SM clock while the blocks ran: cycles over nanoseconds from entry to exit, blocks
        // that ran at least 1 µs.
        std::vector<double> mhz;
        for (unsigned i = 0; i < launch && i < LP_LAUNCHES; ++i)
            for (unsigned blk = 0; blk < LP_BLOCKS; ++blk) {
                const unsigned long long* m = &t[(i * LP_BLOCKS + blk) * LP_PER];
                const long long* c = &clk[(i * LP_BLOCKS + blk) * 2];
                if (m[0] && m[2] > m[0] + 1000) mhz.push_back(1000.0 * (c[1] - c[0]) / (double)(m[2] - m[0]));
            }
        std::sort(mhz.begin(), mhz.end());
        if (!mhz.empty())
            printf("SM clock over the blocks of the replay: median %.0f MHz (10th percentile %.0f, 90th %.0f)\n",
                   mhz[mhz.size() / 2], mhz[mhz.size() / 10], mhz[mhz.size() * 9 / 10]);
    }
    printf("sum of the median stages: %.2f us per layer (timeline of one replay: %.1f us for the step)\n", total,
           (sp[launch - 1].end_max - sp[0].entry_min) / 1000.0);
    // Decode attention's phases: per launch, the last block to reach each mark (µs after the
    // launch's first block entry), median over the middle layers' launches.
    const char* phases[LP_PER] = {"", "", "exit (after the cluster merge)", "row length read", "append written",
                                  "queries in shared memory", "warp 0's keys (scores, weights, sum of weight.V)",
                                  "cluster merge: the start barrier passed", "the warps' states in shared memory",
                                  "cluster merge: the block's state sent", "cluster merge: every state received"};
    printf("| attention phase | last block, us after the first entry |\n| --- | ---: |\n");
    for (int m : {3, 4, 5, 6, 8, 7, 9, 10, 2}) {
        std::vector<double> v;
        for (unsigned i = launch / 15; i + launch / 15 < launch && i < LP_LAUNCHES; ++i) {
            if (kind[i] != 1 || !blocks[i]) continue;
            unsigned long long last = 0;
            for (unsigned blk = 0; blk < LP_BLOCKS; ++blk) last = std::max(last, t[(i * LP_BLOCKS + blk) * LP_PER + m]);
            if (last) v.push_back((long long)(last - sp[i].entry_min) / 1000.0);
        }
        if (!v.empty() && phases[m][0]) printf("| %s | %.2f |\n", phases[m], med(v));
    }
    // The same per block of KV head 0 (split = block x), each block's own mark, median over the
    // middle layers' launches: which split holds the kernel up.
    printf("| attention phase, KV head 0 | split 0 | 1 | 2 | 3 | 4 | 5 | 6 | 7 |\n| --- |%s\n",
           " ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (int m : {3, 4, 5, 6, 8, 7, 9, 10, 2}) {
        printf("| %s |", phases[m]);
        for (unsigned blk = 0; blk < GQA_DEC_CLUSTER; ++blk) {
            std::vector<double> v;
            for (unsigned i = launch / 15; i + launch / 15 < launch && i < LP_LAUNCHES; ++i) {
                const unsigned long long x = t[(i * LP_BLOCKS + blk) * LP_PER + m];
                if (kind[i] == 1 && blocks[i] && x) v.push_back((long long)(x - sp[i].entry_min) / 1000.0);
            }
            printf(v.empty() ? " |" : " %.2f |", med(v));
        }
        printf("\n");
    }
#endif
    CHECK(cudaGetLastError());
    return 0;
}
#endif

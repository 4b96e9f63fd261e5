// attn_probe.cu — kiln-attention's decode kernels alone, at the SmolLM2-135M architecture's
// decode geometry (9 query heads, 3 KV heads, head size 64, float16, rotary over the whole head,
// the cache bound in place), with L2 flushed before each launch as the decode step's weight stream
// would leave it: by reading 256 MiB, which leaves L2 full of clean lines (-DFLUSH_DIRTY: by a
// memset, whose dirty lines cost the kernel their write-back and about halve its read bandwidth
// here; bench/bw_probe.cu measures both). It prints the GPU time per launch (CUDA events, mean of 50) at several positions,
// the largest error of the output against a float64 reference of the same cache (after the last
// position), and, when the source marks its phases with KT(i) (a build with -DKT_ON), when the
// blocks reached each mark in one launch (the global timer; min, median and max over blocks). The kernel:
//   (default)   kiln_gqa_decode at batch 1 over a 384-position cache (256 keys per block);
//   -DCLUSTER   kiln_gqa_decode_cluster at batch 1 over 384 positions (8 blocks per KV head);
//   -DCLUSTER_ROWS kiln_gqa_decode_cluster_rows, likewise (with -DPB, -DPPL: caches up to 2,048);
//   -DCLUSTER16_ROWS kiln_gqa_decode_cluster16_rows (16 blocks per KV head, a non-portable
//               cluster, caches up to 4,096);
//   -DTILED     kiln_gqa_decode_tiled at batch 8 over a 4096-position cache (256 keys per block,
//               16 splits folded in the kernel): the long-context batch-8 case.
// -DPB=8 -DPPL=2048 set the batch and the cache length of any of them; -DKPB=128 the keys per block;
// -DNO_FLUSH times with the K/V cache left in L2 by the launch before (what prefetching it into L2
// while the projections run could gain at most); a one-block kernel that waits 20 µs without
// touching memory stands in for the flush, so that the timed launch still queues behind work (a
// launch into an idle stream would time the host's submission too).
//
//   mkdir -p inc/kiln-cuda-std && cp kernels/cuda-std/include/* inc/kiln-cuda-std/ && cp host/cuda/kiln.cuh inc/
//   nvcc -O3 -arch=sm_90 -Iinc -DATTN_SRC='"kernels/attention/cuda/attention.cu"' -o attn_probe bench/attn_probe.cu
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>

#include "check.cuh"

#ifdef KT_ON
// Phase marks: the global timer (ns) when thread 0 of each block reaches KT(i), i < 16.
#define KT_BLOCKS 512
__device__ unsigned long long g_kt[KT_BLOCKS * 16];
#define KT(i)                                                                                    \
    do {                                                                                         \
        if (threadIdx.x == 0) {                                                                  \
            const unsigned blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); \
            unsigned long long t;                                                                \
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));                                \
            if (blk < KT_BLOCKS) g_kt[blk * 16 + (i)] = t;                                       \
        }                                                                                        \
    } while (0)
#else
#define KT(i) \
    do {      \
    } while (0)
#endif

#include ATTN_SRC

// Evicts L2 (see the top): reads `n` 16-byte vectors, or writes them with -DFLUSH_DIRTY.
__global__ void probe_flush(uint4* p, size_t n, unsigned* sink) {
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
#ifdef FLUSH_DIRTY
        p[i] = make_uint4(acc, 1, 2, 3);
#else
        acc ^= __ldcs(p + i).x;
#endif
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

// Keeps the stream busy for `ns` nanoseconds without touching memory (-DNO_FLUSH).
__global__ void probe_spin(unsigned long long ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
}

int main() {
#if defined(PB) && defined(PPL)
    // -DPB=rows -DPPL=positions: any batch and cache length (positions spread over the cache).
    const unsigned B = PB, PL = PPL;
    const int positions[] = {100, PL / 4, PL / 2, PL - PL / 16, PL - 2};
#elif defined(TILED)
    const unsigned B = 8, PL = 4096;
    const int positions[] = {128, 1024, 3840, 4095};
#else
    const unsigned B = 1, PL = 384;
    const int positions[] = {100, 200, 300, 380};
#endif
    const unsigned N = 9, Nk = 3, H = 64, rows = 4096, half = 32, kv_w = (N + 2 * Nk) * H;
#if defined(CLUSTER16_ROWS)
#define CLUSTER_ROWS
#define PROBE_CL GQA_DEC_CLUSTER_WIDE
#define PROBE_ROWS_KERNEL kiln_gqa_decode_cluster16_rows
#else
#define PROBE_CL GQA_DEC_CLUSTER
#define PROBE_ROWS_KERNEL kiln_gqa_decode_cluster_rows
#endif
#if defined(CLUSTER) || defined(CLUSTER_ROWS)
    // kiln_gqa_decode_cluster(_rows): GQA_DEC_CLUSTER blocks per KV head (8), or
    // kiln_gqa_decode_cluster16_rows' GQA_DEC_CLUSTER_WIDE (16), over ceil(PL / blocks) keys each.
    const unsigned splits = PROBE_CL, kpb = (PL + PROBE_CL - 1) / PROBE_CL;
#else
#ifndef KPB
#define KPB 256  // keys per block (-DKPB=128 tries smaller tiles)
#endif
    const unsigned splits = (PL + KPB - 1) / KPB, kpb = KPB;
#endif
#ifdef TILED
    // kiln_gqa_decode_tiled's K and V tiles (the shim's tiled_shared_bytes for 128-byte rows).
    const unsigned smem = 2 * kpb * H * 2;
#elif defined(CLUSTER_ROWS)
    // kiln_gqa_decode_cluster_rows' K and V rows (the shim's tiled_shared_bytes at DEC_MAX_QH), for shares
    // of at most GQA_DEC_KEYS keys.
    static_assert((PL + PROBE_CL - 1) / PROBE_CL <= GQA_DEC_KEYS,
                  "-DCLUSTER_ROWS takes caches of up to 8 x GQA_DEC_KEYS positions, -DCLUSTER16_ROWS 16 x");
    const unsigned smem = gqa_decode_k_bytes(kpb, H * 2, GQA_DEC_MAX_QH) + kpb * H * 2;
#endif
    std::vector<kiln_f16> qkv(B * kv_w), cache((size_t)B * Nk * PL * H), cs((size_t)rows * half);
    srand(1);
    for (auto& v : qkv) v = probe_h16((rand() % 2001 - 1000) / 1000.f);
    for (auto& v : cache) v = probe_h16((rand() % 2001 - 1000) / 1000.f);
    for (auto& v : cs) v = probe_h16((rand() % 2001 - 1000) / 1000.f);
    kiln_f16 *d_qkv, *d_k, *d_v, *d_cos, *d_sin, *d_out;
    float* d_part;
    int* d_seq;
    kiln_counter* d_ctr;
    kiln_status* d_st;
    char* d_flush;
    unsigned* d_sink;
    const size_t flush_bytes = 256u << 20;
    CHECK(cudaMalloc(&d_qkv, qkv.size() * 2));
    CHECK(cudaMalloc(&d_k, cache.size() * 2));
    CHECK(cudaMalloc(&d_v, cache.size() * 2));
    CHECK(cudaMalloc(&d_cos, cs.size() * 2));
    CHECK(cudaMalloc(&d_sin, cs.size() * 2));
    CHECK(cudaMalloc(&d_out, B * N * H * 2));
    CHECK(cudaMalloc(&d_part, (size_t)B * N * splits * (H + 2) * 4));
    CHECK(cudaMalloc(&d_seq, B * 4));
    CHECK(cudaMalloc(&d_ctr, B * Nk * 4));
#ifdef TILED
    CHECK(cudaFuncSetAttribute(kiln_gqa_decode_tiled<kiln_tag_f16, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)smem));
#elif defined(CLUSTER_ROWS)
    CHECK(cudaFuncSetAttribute(PROBE_ROWS_KERNEL<kiln_tag_f16, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)smem));
#endif
#ifdef CLUSTER16_ROWS
    CHECK(cudaFuncSetAttribute(PROBE_ROWS_KERNEL<kiln_tag_f16, 4>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
#endif
    CHECK(cudaMalloc(&d_st, sizeof(kiln_status)));
    CHECK(cudaMalloc(&d_flush, flush_bytes));
    CHECK(cudaMemset(d_flush, 0, flush_bytes));
    CHECK(cudaMalloc(&d_sink, 4));
    CHECK(cudaMemcpy(d_qkv, qkv.data(), qkv.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_k, cache.data(), cache.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_v, cache.data(), cache.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_cos, cs.data(), cs.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_sin, cs.data(), cs.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(d_ctr, 0, B * Nk * 4));
    CHECK(cudaMemset(d_st, 0, sizeof(kiln_status)));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    const auto launch = [&]() {
#ifdef CLUSTER
        kiln_gqa_decode_cluster<kiln_tag_f16, 4><<<dim3(splits, Nk, B), 256, 0, s>>>(
#elif defined(CLUSTER_ROWS)
        PROBE_ROWS_KERNEL<kiln_tag_f16, 4><<<dim3(splits, Nk, B), 256, smem, s>>>(
#elif defined(TILED)
        kiln_gqa_decode_tiled<kiln_tag_f16, 4><<<dim3(splits, Nk, B), 256, smem, s>>>(
#else
        kiln_gqa_decode<kiln_tag_f16, 4><<<dim3(splits, Nk, B), 256, 0, s>>>(
#endif
            d_qkv, d_k, d_v, d_seq, d_cos, d_sin, d_qkv, d_qkv, d_part, d_out, N, Nk, H, PL, (kiln_u64)kv_w,
            (kiln_u64)rows, half, 0u, 0.125f, 0.f, -1, 0u, 1u, 1u, PL, 0u, d_qkv, d_qkv, d_k, d_v, PL, (kiln_u64)kv_w,
            (kiln_u64)(N * H), (kiln_u64)((N + Nk) * H), 1u, kpb, (kiln_u64)Nk * PL * H, (kiln_u64)PL * H, 0ull, 31u,
            1u, d_ctr, d_st);
    };
    #ifdef NO_FLUSH
    printf("| position | keys used | us per launch (events, L2 warm) |\n| ---: | ---: | ---: |\n");
#else
    printf("| position | keys used | us per launch (events, L2 flushed) |\n| ---: | ---: | ---: |\n");
#endif
    int pos = 0;
    for (int p : positions) {
        pos = p;
        const std::vector<int> seq(B, pos);
        CHECK(cudaMemcpy(d_seq, seq.data(), B * 4, cudaMemcpyHostToDevice));
        float total = 0;
        const int reps = 50;
        for (int i = 0; i < reps + 5; ++i) {
#ifndef NO_FLUSH
            probe_flush<<<1056, 256, 0, s>>>((uint4*)d_flush, flush_bytes / 16, d_sink);
#else
            probe_spin<<<1, 32, 0, s>>>(20000);
#endif
            CHECK(cudaEventRecord(a, s));
            launch();
            CHECK(cudaEventRecord(b, s));
            CHECK(cudaEventSynchronize(b));
            float ms;
            CHECK(cudaEventElapsedTime(&ms, a, b));
            if (i >= 5) total += ms;
        }
        printf("| %d | %d | %.2f |\n", pos, pos + 1, total * 1000.f / reps);
#ifdef KT_ON
        // One launch after a flush: per mark, the ns from the first block's start at which the
        // blocks that reached it did (min, median, max over blocks).
        static unsigned long long kt[KT_BLOCKS * 16];
        memset(kt, 0, sizeof(kt));
        CHECK(cudaMemcpyToSymbol(g_kt, kt, sizeof(kt)));
        probe_flush<<<1056, 256, 0, s>>>((uint4*)d_flush, flush_bytes / 16, d_sink);
        launch();
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaMemcpyFromSymbol(kt, g_kt, sizeof(kt)));
        const unsigned blocks = splits * Nk * B < KT_BLOCKS ? splits * Nk * B : KT_BLOCKS;
        unsigned long long t0 = ~0ull;
        for (unsigned blk = 0; blk < blocks; ++blk)
            if (kt[blk * 16] && kt[blk * 16] < t0) t0 = kt[blk * 16];
        for (int i = 0; i < 16; ++i) {
            std::vector<long long> v;
            for (unsigned blk = 0; blk < blocks; ++blk)
                if (kt[blk * 16 + i]) v.push_back((long long)(kt[blk * 16 + i] - t0));
            if (v.empty()) continue;
            std::sort(v.begin(), v.end());
            printf("  KT%d: %zu blocks, ns from the first start: min %lld, median %lld, max %lld\n", i, v.size(), v[0],
                   v[v.size() / 2], v.back());
        }
#endif
    }
    // The output after the last position against float64 over the cache the kernel left (its
    // append wrote each position's new row in place).
    std::vector<kiln_f16> hk(cache.size()), hv(cache.size()), ho(B * N * H);
    CHECK(cudaMemcpy(hk.data(), d_k, hk.size() * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(hv.data(), d_v, hv.size() * 2, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(ho.data(), d_out, ho.size() * 2, cudaMemcpyDeviceToHost));
    double worst = 0, worst_rel = 0;
    for (unsigned b = 0; b < B; ++b)
        for (unsigned h = 0; h < N; ++h) {
            const unsigned j = h / (N / Nk);
            double q[64], o[64] = {};
            for (unsigned d = 0; d < H; ++d) {
                const kiln_f16* x = &qkv[b * kv_w + h * H];
                const unsigned i = d < half ? d : d - half;
                const double c = probe_f64(cs[(size_t)pos * half + i]);
                const double sn = probe_f64(cs[(size_t)pos * half + i]);
                const double r = d < half ? probe_f64(x[d]) * c - probe_f64(x[d + half]) * sn
                                          : probe_f64(x[d - half]) * sn + probe_f64(x[d]) * c;
                q[d] = probe_f64(probe_h16((float)r));  // rounded to float16 as the kernels do
            }
            std::vector<double> sc(pos + 1);
            double m = -INFINITY, l = 0;
            for (int t = 0; t <= pos; ++t) {
                const kiln_f16* kr = &hk[((size_t)(b * Nk + j) * PL + t) * H];
                double dot = 0;
                for (unsigned d = 0; d < H; ++d) dot += q[d] * probe_f64(kr[d]);
                sc[t] = dot * 0.125;
                m = fmax(m, sc[t]);
            }
            for (int t = 0; t <= pos; ++t) {
                const double p = exp(sc[t] - m);
                l += p;
                const kiln_f16* vr = &hv[((size_t)(b * Nk + j) * PL + t) * H];
                for (unsigned d = 0; d < H; ++d) o[d] += p * probe_f64(vr[d]);
            }
            for (unsigned d = 0; d < H; ++d) {
                const double want = o[d] / l, got = probe_f64(ho[(b * N + h) * H + d]);
                worst = fmax(worst, fabs(got - want));
                worst_rel = fmax(worst_rel, fabs(got - want) / fmax(fabs(want), 1e-3));
            }
        }
    printf("position %d: largest error against float64 %.3g (relative %.3g)\n", pos, worst, worst_rel);
    kiln_status st;
    CHECK(cudaMemcpy(&st, d_st, sizeof(st), cudaMemcpyDeviceToHost));
    CHECK(cudaGetLastError());
    printf("status code %u\n", st.code);
    return 0;
}

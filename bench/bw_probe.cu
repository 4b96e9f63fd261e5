// bw_probe.cu — how fast one kernel can read a batch-8 decode step's K/V cache of one layer
// (8 rows × 3 KV heads × 4096 positions × 128 bytes, K and V: 24 MiB) on this GPU, by access
// pattern, with L2 flushed before each launch two ways: by a memset (L2 left full of dirty lines,
// as bench/attn_probe.cu does) and by reading a 256 MiB buffer (L2 left clean, as a decode step's
// weight stream leaves it). Patterns:
//   bulk:   kiln_gqa_decode_tiled's: a block per 256 positions of one (row, KV head), each thread
//           issuing its 16-byte cp.async copies of K, then of V, into 64 KiB of shared memory at once;
//   bulkN:  the same with N positions per block;
//   stream: a block per SM slot, each reading a contiguous share with 16-byte loads, 8 in flight.
// Prints µs per launch (CUDA events, mean of 50) and the bandwidth that makes.
//
//   nvcc -O3 -arch=sm_90 -o bw_probe bench/bw_probe.cu
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#include "check.cuh"

__device__ __forceinline__ void cp16(void* dst, const void* src) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
}

// Block (split, pair): positions split·kpb … of pair's K and V regions (each `len` 16-byte vectors
// per pair), into shared memory; one word of the result written so the loads are kept.
__global__ void __launch_bounds__(256) bulk(const uint4* k, const uint4* v, unsigned len, unsigned kpb_vecs,
                                            unsigned* sink) {
    extern __shared__ uint4 tile[];
    const unsigned pair = blockIdx.y, split = blockIdx.x;
    const uint4* kb = k + (size_t)pair * len + (size_t)split * kpb_vecs;
    const uint4* vb = v + (size_t)pair * len + (size_t)split * kpb_vecs;
    for (unsigned i = threadIdx.x; i < kpb_vecs; i += blockDim.x) cp16(&tile[i], kb + i);
    asm volatile("cp.async.commit_group;" ::: "memory");
    for (unsigned i = threadIdx.x; i < kpb_vecs; i += blockDim.x) cp16(&tile[kpb_vecs + i], vb + i);
    asm volatile("cp.async.commit_group;" ::: "memory");
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    __syncthreads();
    if (tile[threadIdx.x].x == 0x12345678u) sink[0] = 1;
}

// Each block reads vectors [b·per, (b + 1)·per) of the whole K and V, 8 loads in flight per thread.
__global__ void __launch_bounds__(256) stream(const uint4* k, const uint4* v, size_t total, size_t per,
                                              unsigned* sink) {
    const size_t lo = blockIdx.x * per, hi = lo + per < total ? lo + per : total;
    unsigned acc = 0;
    for (size_t i = lo + threadIdx.x; i < hi; i += 8 * blockDim.x) {
        uint4 r[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
            const size_t at = i + (size_t)u * blockDim.x;
            const uint4* src = at < total / 2 ? k + at : v + (at - total / 2);
            r[u] = at < hi ? __ldcs(src) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) acc ^= r[u].x ^ r[u].w;
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

__global__ void read_all(const uint4* p, size_t n, unsigned* sink) {
    unsigned acc = 0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        acc ^= __ldcs(p + i).x;
    if (acc == 0x12345678u) sink[0] = acc;
}

int main() {
    const unsigned pairs = 24, positions = 4096, row_vecs = 8;  // 128-byte rows
    const unsigned len = positions * row_vecs;                   // vectors per pair, K or V
    const size_t total = 2ull * pairs * len;                     // K and V
    uint4 *k, *v, *flush;
    unsigned* sink;
    const size_t flush_bytes = 256u << 20;
    CHECK(cudaMalloc(&k, (size_t)pairs * len * 16));
    CHECK(cudaMalloc(&v, (size_t)pairs * len * 16));
    CHECK(cudaMalloc(&flush, flush_bytes));
    CHECK(cudaMalloc(&sink, 4));
    CHECK(cudaMemset(k, 1, (size_t)pairs * len * 16));
    CHECK(cudaMemset(v, 2, (size_t)pairs * len * 16));
    CHECK(cudaMemset(flush, 3, flush_bytes));
    int sms;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaFuncSetAttribute(bulk, cudaFuncAttributeMaxDynamicSharedMemorySize, 128 << 10));
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    printf("| pattern | flush | us per launch | GB/s |\n| --- | --- | ---: | ---: |\n");
    for (int clean = 0; clean < 2; ++clean)
        for (int pat = 0; pat < 6; ++pat) {
            const unsigned kpbs[4] = {256, 128, 64, 512};
            float total_ms = 0;
            const int reps = 50;
            for (int i = 0; i < reps + 5; ++i) {
                if (clean)
                    read_all<<<sms * 8, 256, 0, s>>>(flush, flush_bytes / 16, sink);
                else
                    CHECK(cudaMemsetAsync(flush, i & 0xff, flush_bytes, s));
                CHECK(cudaEventRecord(a, s));
                if (pat < 4) {
                    const unsigned kpb = kpbs[pat], vecs = kpb * row_vecs;
                    bulk<<<dim3(positions / kpb, pairs), 256, 2 * vecs * 16, s>>>(k, v, len, vecs, sink);
                } else {
                    const unsigned blocks = sms * (pat == 4 ? 4 : 8);
                    const size_t per = (total + blocks - 1) / blocks;
                    stream<<<blocks, 256, 0, s>>>(k, v, total, per, sink);
                }
                CHECK(cudaGetLastError());
                CHECK(cudaEventRecord(b, s));
                CHECK(cudaEventSynchronize(b));
                float ms;
                CHECK(cudaEventElapsedTime(&ms, a, b));
                if (i >= 5) total_ms += ms;
            }
            const double us = total_ms * 1000.0 / reps;
            const char* names[6] = {"bulk256", "bulk128", "bulk64", "bulk512", "stream x4", "stream x8"};
            printf("| %s | %s | %.2f | %.0f |\n", names[pat], clean ? "read (clean)" : "memset (dirty)", us,
                   total * 16 / us / 1e3);
        }
    return 0;
}

// attn_probe.cu — kiln-attention's decode kernel (kiln_gqa_decode) alone, at the SmolLM2-135M
// architecture's batch-1 decode geometry (9 query heads, 3 KV heads, head size 64, float16, a
// 384-position cache bound in place, rotary over the whole head), with L2 flushed before each
// launch as the decode step's weight stream would leave it. It prints the GPU time per launch
// (CUDA events, mean of 50) at several positions, and, when the source marks its phases with
// KT(i) (a build with -DKT_ON), block 0's clock64 at each mark of one launch. -DCLUSTER times
// kiln_gqa_decode_cluster (8 blocks per KV head) instead.
//
//   mkdir -p inc/kiln-cuda-std && cp kernels/cuda-std/include/* inc/kiln-cuda-std/ && cp host/cuda/kiln.cuh inc/
//   nvcc -O3 -arch=sm_90 -Iinc -DATTN_SRC='"kernels/attention/cuda/attention.cu"' -o attn_probe bench/attn_probe.cu
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>

#ifdef KT_ON
__device__ long long g_kt[64 * 16];
#define KT(i)                                                                       \
    do {                                                                            \
        if (threadIdx.x == 0) {                                                     \
            const unsigned blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z); \
            if (blk < 64) g_kt[blk * 16 + (i)] = clock64();                         \
        }                                                                           \
    } while (0)
#else
#define KT(i) \
    do {      \
    } while (0)
#endif

#include ATTN_SRC

#define CHECK(x)                                                                             \
    do {                                                                                     \
        cudaError_t e = (x);                                                                 \
        if (e != cudaSuccess) {                                                              \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

static kiln_f16 h16(float f) {
    // float → binary16 bits (round to nearest even; small normal values only here).
    unsigned u;
    memcpy(&u, &f, 4);
    const unsigned sign = (u >> 16) & 0x8000u;
    int e = (int)((u >> 23) & 0xff) - 127 + 15;
    unsigned m = u & 0x7fffffu;
    if (e <= 0) return (kiln_f16)sign;
    unsigned h = sign | ((unsigned)e << 10) | (m >> 13);
    if ((m & 0x1fffu) > 0x1000u || ((m & 0x1fffu) == 0x1000u && (h & 1u))) ++h;
    return (kiln_f16)h;
}

int main() {
    const unsigned B = 1, N = 9, Nk = 3, H = 64, PL = 384, rows = 4096, half = 32, kv_w = (N + 2 * Nk) * H;
#ifdef CLUSTER
    // kiln_gqa_decode_cluster: 8 blocks per KV head over ceil(PL / 8) keys each.
    const unsigned splits = 8, kpb = (PL + 7) / 8;
#else
    const unsigned splits = (PL + 255) / 256, kpb = 256;
#endif
    std::vector<kiln_f16> qkv(B * kv_w), cache((size_t)B * Nk * PL * H), cs((size_t)rows * half);
    srand(1);
    for (auto& v : qkv) v = h16((rand() % 2001 - 1000) / 1000.f);
    for (auto& v : cache) v = h16((rand() % 2001 - 1000) / 1000.f);
    for (auto& v : cs) v = h16((rand() % 2001 - 1000) / 1000.f);
    kiln_f16 *d_qkv, *d_k, *d_v, *d_cos, *d_sin, *d_out;
    float* d_part;
    int* d_seq;
    kiln_counter* d_ctr;
    kiln_status* d_st;
    char* d_flush;
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
    CHECK(cudaMalloc(&d_st, sizeof(kiln_status)));
    CHECK(cudaMalloc(&d_flush, flush_bytes));
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
#else
        kiln_gqa_decode<kiln_tag_f16, 4><<<dim3(splits, Nk, B), 256, 0, s>>>(
#endif
            d_qkv, d_k, d_v, d_seq, d_cos, d_sin, d_qkv, d_qkv, d_part, d_out, N, Nk, H, PL, (kiln_u64)kv_w,
            (kiln_u64)rows, half, 0u, 0.125f, 0.f, -1, 0u, 1u, 1u, PL, 0u, d_qkv, d_qkv, d_k, d_v, PL, (kiln_u64)kv_w,
            (kiln_u64)(N * H), (kiln_u64)((N + Nk) * H), 1u, kpb, (kiln_u64)Nk * PL * H, (kiln_u64)PL * H, 0ull, 31u,
            1u, d_ctr, d_st);
    };
    printf("| position | keys used | us per launch (events, L2 flushed) |\n| ---: | ---: | ---: |\n");
    for (int pos : {100, 200, 300, 380}) {
        CHECK(cudaMemcpy(d_seq, &pos, 4, cudaMemcpyHostToDevice));
        float total = 0;
        const int reps = 50;
        for (int i = 0; i < reps + 5; ++i) {
            CHECK(cudaMemsetAsync(d_flush, i & 0xff, flush_bytes, s));
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
        CHECK(cudaMemsetAsync(d_flush, 1, flush_bytes, s));
        launch();
        CHECK(cudaStreamSynchronize(s));
        long long kt[64 * 16];
        CHECK(cudaMemcpyFromSymbol(kt, g_kt, sizeof(kt)));
        for (unsigned blk = 0; blk < splits * Nk; ++blk) {
            printf("  block %u cycles from its start:", blk);
            for (int i = 1; i < 16; ++i)
                if (kt[blk * 16 + i] >= kt[blk * 16]) printf(" KT%d %lld", i, kt[blk * 16 + i] - kt[blk * 16]);
            printf("\n");
        }
        static const long long zeros[64 * 16] = {};
        CHECK(cudaMemcpyToSymbol(g_kt, zeros, sizeof(zeros)));
#endif
    }
    kiln_status st;
    CHECK(cudaMemcpy(&st, d_st, sizeof(st), cudaMemcpyDeviceToHost));
    CHECK(cudaGetLastError());
    printf("status code %u\n", st.code);
    return 0;
}

// prefill_probe.cu — kiln-attention's prompt attention on tensor cores (kiln_gqa_prefill_mma) beside
// its kiln_gqa_prefill (16 query rows per block, scalar f32
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
#ifndef CHECK_ONLY  // -DCHECK_ONLY: the float64 checks alone (for compute-sanitizer)
    printf("| batch | prompt | head size | kiln_gqa_prefill µs | kiln_gqa_prefill_mma µs | speed-up |\n");
    printf("| ---: | ---: | ---: | ---: | ---: | ---: |\n");
    for (unsigned B : {1u, 8u})
        for (unsigned S : {128u, 1024u, 3840u}) ok &= run_case<64>(B, S, 0, 9, 3, -1, true);
    ok &= run_case<128>(1, 3840, 0, 32, 8, -1, true);
#endif
    printf(ok ? "all cases within 2e-3 of float64\n" : "FAILED\n");
    return ok ? 0 : 1;
}

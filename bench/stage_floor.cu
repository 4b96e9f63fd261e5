// stage_floor.cu — the cost of one dependent stage of a CUDA graph on this GPU, without kiln:
// a graph of N kernels, each reading what the one before it wrote, replayed many times.
// It sets the floor under a decode step of S dependent kernels (S × the per-stage time below).
//
//   nvcc -O3 -arch=sm_90 -o stage_floor bench/stage_floor.cu && ./stage_floor
//
// Rows: grid size (blocks of 128 threads), launch mode (plain stream order; programmatic
// dependent launch with the trigger before the wait, as kiln's GEMVs do; after the wait; one
// persistent kernel whose stages meet at grid barriers), and
// the work per block (none but the dependency, or a 576-value f16 row read from the predecessor
// and a 1,152-byte slice of weights per block, as a decode GEMV's prologue and product would).
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

#include "check.cuh"

enum { TRIGGER_NONE = 0, TRIGGER_FIRST = 1, TRIGGER_AFTER_WAIT = 2 };

__device__ __forceinline__ void wait_dep() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// A stage's work after its dependency: every block reads the 576-value row the previous stage
// wrote (in[0..72) as 16-byte vectors; WORK) and uses its weights `wv`, or reads one word (no
// WORK); block 0 writes the next row.
template <bool WORK>
__device__ __forceinline__ void stage_work(const uint4* in, uint4* out, const uint4 (&wv)[4]) {
    unsigned acc = 0;
    if (WORK) {
        if (threadIdx.x < 72) {
            const uint4 v = __ldcg(in + threadIdx.x);
            acc = v.x ^ v.y ^ v.z ^ v.w;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) acc += wv[u].x + wv[u].w;
        acc = __reduce_add_sync(0xffffffffu, acc);
    } else if (threadIdx.x == 0) {
        acc = __ldcg((const unsigned*)in);
    }
    if (blockIdx.x == 0 && threadIdx.x < 72) out[threadIdx.x] = make_uint4(acc + 1, 0, 0, 0);
}

// Stage i: every block reads the 576-value row the previous stage wrote (in[0..576)), and
// `weights` bytes of its own; block 0 writes the next row.
template <int TRIG, bool WORK>
__global__ void __launch_bounds__(128) stage(const uint4* __restrict__ in, uint4* __restrict__ out,
                                             const uint4* __restrict__ w, unsigned wvec) {
    uint4 wv[4];
    if (WORK) {
        // Weights are no predecessor's output: loaded before the wait.
        const uint4* wb = w + (size_t)blockIdx.x * wvec;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const unsigned c = threadIdx.x + u * 128;
            wv[u] = c < wvec ? __ldg(wb + c) : make_uint4(0, 0, 0, 0);
        }
    }
    if (TRIG == TRIGGER_FIRST) trigger();
    if (TRIG != TRIGGER_NONE) wait_dep();
    if (TRIG == TRIGGER_AFTER_WAIT) trigger();
    stage_work<WORK>(in, out, wv);
}

// Ends the capture on `s`, replays its graph 20 times to warm up, then 200 times under CUDA events:
// µs per stage of `stages`.
static float replay_us(cudaStream_t s, unsigned stages) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CHECK(cudaStreamEndCapture(s, &g));
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 20; ++i) CHECK(cudaGraphLaunch(ge, s));
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    const int reps = 200;
    CHECK(cudaEventRecord(a, s));
    for (int i = 0; i < reps; ++i) CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(b, s));
    CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
    return ms * 1000.f / reps / stages;
}

// The same stages inside one persistent kernel: a grid barrier (a counter every block adds to,
// read with acquire) replaces each kernel boundary; each block loads the next stage's weights
// before it waits, as a PDL kernel does before griddepcontrol.wait. Needs every block resident.
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

template <bool WORK>
__global__ void __launch_bounds__(128) persistent(uint4* rows, const uint4* __restrict__ w, unsigned wvec,
                                                  unsigned stages, unsigned* counter) {
    uint4 wv[4], nv[4];
    const auto load = [&](unsigned i, uint4(&dst)[4]) {
        const uint4* wb = w + ((size_t)i * gridDim.x + blockIdx.x) * wvec;
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            const unsigned c = threadIdx.x + u * 128;
            dst[u] = WORK && c < wvec ? __ldg(wb + c) : make_uint4(0, 0, 0, 0);
        }
    };
    load(0, wv);
    for (unsigned i = 0; i < stages; ++i) {
        const uint4* in = rows + (i % 2) * 128;
        uint4* out = rows + ((i + 1) % 2) * 128;
        stage_work<WORK>(in, out, wv);
        if (i + 1 < stages) load(i + 1, nv);
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence();
            atomicAdd(counter, 1u);
            const unsigned target = (i + 1) * gridDim.x;
            while (ld_acquire(counter) < target) {
            }
        }
        __syncthreads();
#pragma unroll
        for (int u = 0; u < 4; ++u) wv[u] = nv[u];
    }
}

static float run_persistent(bool work, unsigned grid, unsigned stages, uint4* rows, const uint4* w, unsigned* counter,
                            cudaStream_t s) {
    const unsigned wvec = work ? 72 : 0;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemsetAsync(counter, 0, 4, s));
    if (work)
        persistent<true><<<grid, 128, 0, s>>>(rows, w, wvec, stages, counter);
    else
        persistent<false><<<grid, 128, 0, s>>>(rows, w, wvec, stages, counter);
    CHECK(cudaGetLastError());
    return replay_us(s, stages);
}

typedef void (*Kernel)(const uint4*, uint4*, const uint4*, unsigned);

static float run(Kernel k, bool pdl, unsigned grid, unsigned stages, bool work, uint4* rows, const uint4* w,
                 cudaStream_t s) {
    const unsigned wvec = work ? 72 : 0;  // 1,152 bytes of weights per block
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (unsigned i = 0; i < stages; ++i) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = dim3(grid);
        cfg.blockDim = dim3(128);
        cfg.stream = s;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = pdl && i > 0 ? 1 : 0;
        CHECK(cudaLaunchKernelEx(&cfg, k, (const uint4*)(rows + (i % 2) * 128), rows + ((i + 1) % 2) * 128,
                                 w + (size_t)i * grid * wvec, wvec));
    }
    return replay_us(s, stages);
}

int main() {
    const unsigned stages = 150;
    uint4* rows;
    uint4* w;
    const size_t wbytes = (size_t)stages * 400 * 72 * 16;  // up to 400 blocks × 1,152 bytes per stage
    CHECK(cudaMalloc(&rows, 256 * 16));
    CHECK(cudaMemset(rows, 0, 256 * 16));
    CHECK(cudaMalloc(&w, wbytes));
    CHECK(cudaMemset(w, 1, wbytes));
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    const unsigned grids[] = {1, 6, 72, 132, 384};
    unsigned* counter;
    CHECK(cudaMalloc(&counter, 4));
    printf("| grid (128 threads) | work | plain (us/stage) | PDL, trigger first | PDL, trigger after wait | grid barrier |\n");
    printf("| ---: | --- | ---: | ---: | ---: | ---: |\n");
    for (int wk = 0; wk < 2; ++wk) {
        for (unsigned grid : grids) {
            const bool work = wk == 1;
            Kernel k0 = work ? stage<TRIGGER_NONE, true> : stage<TRIGGER_NONE, false>;
            Kernel k1 = work ? stage<TRIGGER_FIRST, true> : stage<TRIGGER_FIRST, false>;
            Kernel k2 = work ? stage<TRIGGER_AFTER_WAIT, true> : stage<TRIGGER_AFTER_WAIT, false>;
            const float plain = run(k0, false, grid, stages, work, rows, w, s);
            const float first = run(k1, true, grid, stages, work, rows, w, s);
            const float after = run(k2, true, grid, stages, work, rows, w, s);
            // The persistent kernel needs every block resident: 132 SMs hold 384 blocks of 128.
            const float barrier = run_persistent(work, grid, stages, rows, w, counter, s);
            printf("| %u | %s | %.2f | %.2f | %.2f | %.2f |\n", grid, work ? "row + 1,152 B/block" : "none", plain,
                   first, after, barrier);
        }
    }
    return 0;
}

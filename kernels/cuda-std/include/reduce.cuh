// kiln-cuda-std/reduce.cuh — reductions over a thread block (the prelude has the warp ones).
#pragma once
#include "kiln.cuh"

// Block-wide reduction of `v` over blockDim.x ≤ 1024 threads through `red` (shared memory of
// at least 32 floats); every thread gets the result. `max_op`: maximum, else sum. Every thread
// of the block must call it (it synchronizes the block twice, so `red` may be reused at once).
__device__ __forceinline__ float kiln_block_reduce(float v, float* red, bool max_op) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    v = max_op ? kiln_warp_max(v) : kiln_warp_sum(v);
    __syncthreads();  // `red` may still be read by the previous reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float r = max_op ? -__int_as_float(0x7f800000) : 0.f;
    for (unsigned w = 0; w < warps; ++w) r = max_op ? fmaxf(r, red[w]) : r + red[w];
    return r;
}

// kiln-cuda-std/reduce.cuh — reductions over a warp (by any operation; the prelude has float sums
// and maxima) and over a thread block, and the NaN-propagating maximum.
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

// Maximum that propagates NaN, as the CPU references do: a NaN `a` (the accumulator) stays, a
// NaN `b` wins. For integers, the larger.
template <typename T>
__device__ __forceinline__ T kiln_max_nan(T a, T b) {
    if (a != a) return a;
    return (b != b || b > a) ? b : a;
}

// The operations of kiln_warp_reduce and kiln_block_reduce_by: sum, and kiln_max_nan.
struct kiln_op_sum {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const {
        return a + b;
    }
};
struct kiln_op_max {
    template <typename T>
    __device__ __forceinline__ T operator()(T a, T b) const {
        return kiln_max_nan(a, b);
    }
};

// Reduction of `v` over the 32 lanes of a warp by `op` (float, double, int, unsigned, long long
// or unsigned long long): a shuffle tree, the same operations in the same order on every run,
// and every lane gets the result. All 32 lanes must call it.
template <typename T, typename Op>
__device__ __forceinline__ T kiln_warp_reduce(T v, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Reduction of `v` over a block of blockDim.x threads (a multiple of 32, at most 1024) by `op`
// through `red` (shared memory of at least blockDim.x / 32 values of T): each warp by
// kiln_warp_reduce, then the warps' results in warp order, so the result does not depend on
// timing; every thread gets it. Every thread of the block must call it. It synchronizes the
// block before it writes `red`, so the next reduction may take the same `red` at once; any other
// write to `red` after it needs a __syncthreads() first.
template <typename T, typename Op>
__device__ __forceinline__ T kiln_block_reduce_by(T v, T* red, Op op) {
    const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = kiln_warp_reduce(v, op);
    __syncthreads();  // `red` may still be read by the previous reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    T r = red[0];
    for (unsigned w = 1; w < warps; ++w) r = op(r, red[w]);
    return r;
}

// Reduction of (value, index) pairs over the 32 lanes of a warp (an argmax or argmin): each
// lane's (v, i) becomes the pair that `better(a, ia, b, ib)` ("does (a, ia) beat (b, ib)")
// prefers among the lanes' pairs; every lane gets it. With a total order the result does not
// depend on the order the pairs meet in. All 32 lanes must call it.
template <typename T, typename Better>
__device__ __forceinline__ void kiln_warp_reduce_pair(T& v, long long& i, Better better) {
    for (int o = 16; o > 0; o >>= 1) {
        const T ov = __shfl_xor_sync(0xffffffffu, v, o);
        const long long oi = __shfl_xor_sync(0xffffffffu, i, o);
        if (better(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

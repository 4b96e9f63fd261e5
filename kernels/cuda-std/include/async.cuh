// kiln-cuda-std/async.cuh — asynchronous copies into shared memory.
#pragma once
#include "kiln.cuh"

// Copies 16 bytes from global `src` to shared `dst` (both 16-byte aligned) without holding
// registers: `cp.async.cg` on compute capability 8.0 and later (PTX ISA: cp.async), a plain
// load and store before. Complete with kiln_cp_async_commit() and kiln_cp_async_wait<N>().
__device__ __forceinline__ void kiln_cp_async16(void* dst, const void* src) {
#if __CUDA_ARCH__ >= 800
    const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
#else
    *(uint4*)dst = *(const uint4*)src;
#endif
}

// Closes the group of the copies this thread issued since the last commit.
__device__ __forceinline__ void kiln_cp_async_commit() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most `N` of this thread's committed groups are still in flight. Other threads'
// copies become visible after a __syncthreads() that follows every thread's wait.
template <int N>
__device__ __forceinline__ void kiln_cp_async_wait() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

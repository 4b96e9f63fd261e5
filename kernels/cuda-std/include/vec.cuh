// kiln-cuda-std/vec.cuh — wide (16-byte) loads and stores.
#pragma once
#include "kiln.cuh"

// `V` elements of `T` aligned as one access of sizeof(T)·V bytes (16 for the vector paths).
template <typename T, int V>
struct alignas(sizeof(T) * V) kiln_vec {
    T e[V];
};

// Whether `p` is a multiple of `a` bytes (`a` a power of two).
__device__ __forceinline__ bool kiln_aligned(const void* p, unsigned a) {
    return ((unsigned long long)p & (a - 1)) == 0;
}

// kiln-cuda-std/cluster.cuh — thread block clusters (compute capability 9.0 and later; PTX ISA:
// barrier.cluster, mapa, ld.shared::cluster, %cluster_ctarank): a barrier over the blocks of a
// cluster, and another block's shared memory (distributed shared memory). Callers use them only
// where __CUDA_ARCH__ >= 900; before it the barriers and maps trap and the rank is 0.
#pragma once
#include "kiln.cuh"

// This block's rank in its cluster: 0 .. cluster size − 1.
__device__ __forceinline__ unsigned kiln_cluster_rank() {
#if __CUDA_ARCH__ >= 900
    unsigned r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
#else
    return 0;
#endif
}

// Blocks in this block's cluster (1 without one).
__device__ __forceinline__ unsigned kiln_cluster_size() {
#if __CUDA_ARCH__ >= 900
    unsigned n;
    asm("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
#else
    return 1;
#endif
}

// Arrives at the cluster barrier with release semantics: this thread's earlier writes to shared
// memory are visible to every thread of the cluster once it returns from the matching
// kiln_cluster_wait(). Every thread of every block of the cluster arrives once per phase. Not
// `.aligned`: a warp may arrive from divergent code.
__device__ __forceinline__ void kiln_cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#else
    asm volatile("trap;");
#endif
}

// Waits until every thread of the cluster has arrived at the current phase (acquire semantics).
__device__ __forceinline__ void kiln_cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#else
    asm volatile("trap;");
#endif
}

// kiln_cluster_arrive() then kiln_cluster_wait(): every block's shared-memory writes before it are
// visible to every block after it.
__device__ __forceinline__ void kiln_cluster_sync() {
    kiln_cluster_arrive();
    kiln_cluster_wait();
}

// The float at `p` in this block's shared memory, read from the same place in cluster block
// `rank` (mapa.shared::cluster, then ld.shared::cluster).
__device__ __forceinline__ float kiln_cluster_ld(const float* p, unsigned rank) {
#if __CUDA_ARCH__ >= 900
    const unsigned local = (unsigned)__cvta_generic_to_shared(p);
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    asm volatile("trap;");
    return 0.f;
#endif
}

// `p` (in this block's shared memory) at the same place in cluster block `rank`, as a generic
// address any load can read (mapa.u64).
template <typename T>
__device__ __forceinline__ const T* kiln_cluster_map(const T* p, unsigned rank) {
#if __CUDA_ARCH__ >= 900
    unsigned long long remote;
    asm volatile("mapa.u64 %0, %1, %2;" : "=l"(remote) : "l"(p), "r"(rank));
    return (const T*)remote;
#else
    asm volatile("trap;");
    return p;
#endif
}

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

// The shared::cluster address of the place of `p` (this block's shared memory) in cluster block
// `rank` (mapa.shared::cluster).
__device__ __forceinline__ unsigned kiln_cluster_addr(const void* p, unsigned rank) {
#if __CUDA_ARCH__ >= 900
    unsigned remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote)
                 : "r"((unsigned)__cvta_generic_to_shared(p)), "r"(rank));
    return remote;
#else
    asm volatile("trap;");
    return 0;
#endif
}

// The float at `p` in this block's shared memory, read from the same place in cluster block
// `rank` (mapa.shared::cluster, then ld.shared::cluster).
__device__ __forceinline__ float kiln_cluster_ld(const float* p, unsigned rank) {
#if __CUDA_ARCH__ >= 900
    const unsigned remote = kiln_cluster_addr(p, rank);
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

// Arrives at the cluster barrier without memory ordering (barrier.cluster.arrive.relaxed): for a
// barrier that orders only what a fence before it publishes, such as an mbarrier's
// initialisation (kiln_mbar_init_cluster).
__device__ __forceinline__ void kiln_cluster_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
#else
    asm volatile("trap;");
#endif
}

// Initialises the mbarrier at `bar` (this block's shared memory, 8-byte aligned) for `count`
// arrivals per phase and makes the initialisation visible to the cluster
// (fence.mbarrier_init.release.cluster): other blocks may signal it once a cluster barrier that
// this thread arrives at afterwards has completed.
__device__ __forceinline__ void kiln_mbar_init_cluster(unsigned long long* bar, unsigned count) {
#if __CUDA_ARCH__ >= 900
    const unsigned a = (unsigned)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(a), "r"(count) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#else
    asm volatile("trap;");
#endif
}

// One arrival at the mbarrier `bar` that also expects `bytes` more bytes of asynchronous stores
// (mbarrier.arrive.expect_tx): the phase completes once every arrival is in and those bytes have
// landed. The bytes may land before this call.
__device__ __forceinline__ void kiln_mbar_arrive_expect_tx(unsigned long long* bar, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    const unsigned a = (unsigned)__cvta_generic_to_shared(bar);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(a), "r"(bytes) : "memory");
#else
    asm volatile("trap;");
#endif
}

// Waits until the phase of parity `parity` of the mbarrier `bar` completes, with acquire
// semantics at cluster scope: the asynchronous stores it counted, from any block of the
// cluster, are visible after it.
__device__ __forceinline__ void kiln_mbar_wait_cluster(unsigned long long* bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
    const unsigned a = (unsigned)__cvta_generic_to_shared(bar);
    unsigned done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], %2;\n"
            " selp.u32 %0, 1, 0, p;\n}"
            : "=r"(done)
            : "r"(a), "r"(parity)
            : "memory");
    } while (!done);
#else
    asm volatile("trap;");
#endif
}

// Stores `v` at the place of `p` in cluster block `rank`'s shared memory and counts its bytes on
// that block's mbarrier at the place of `bar` (st.async …mbarrier::complete_tx::bytes): no fence
// and no barrier between blocks, the receiver waits on its mbarrier (kiln_mbar_wait_cluster).
// The sender may exit at once; the receiver must not exit before the bytes land. `p` 16-byte
// aligned for the float4 form.
__device__ __forceinline__ void kiln_cluster_st_async(float* p, unsigned rank, float4 v, unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    const unsigned rp = kiln_cluster_addr(p, rank), rb = kiln_cluster_addr(bar, rank);
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(rp),
                 "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(rb)
                 : "memory");
#else
    asm volatile("trap;");
#endif
}

__device__ __forceinline__ void kiln_cluster_st_async(float* p, unsigned rank, float v, unsigned long long* bar) {
#if __CUDA_ARCH__ >= 900
    const unsigned rp = kiln_cluster_addr(p, rank), rb = kiln_cluster_addr(bar, rank);
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];" ::"r"(rp), "f"(v), "r"(rb)
                 : "memory");
#else
    asm volatile("trap;");
#endif
}

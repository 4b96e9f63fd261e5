// kiln.cuh — the prelude the kiln host gives every package's CUDA source, as the NVRTC header
// "kiln.cuh" (sources `#include "kiln.cuh"`). It needs no CUDA toolkit headers: float16 and
// bfloat16 are their 16-bit patterns, converted with PTX `cvt` (PTX ISA: cvt).
#pragma once

typedef unsigned short kiln_f16;   // IEEE 754 binary16 bits
typedef unsigned short kiln_bf16;  // bfloat16 bits
typedef long long kiln_i64;
typedef unsigned long long kiln_u64;

__device__ __forceinline__ float kiln_f16_to_f32(kiln_f16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ kiln_f16 kiln_f32_to_f16(float f) {
    kiln_f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float kiln_bf16_to_f32(kiln_bf16 b) {
    return __uint_as_float(((unsigned)b) << 16);
}

__device__ __forceinline__ kiln_bf16 kiln_f32_to_bf16(float f) {
#if __CUDA_ARCH__ >= 800
    kiln_bf16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#else
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (kiln_bf16)((u >> 16) | 0x40);  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);                                              // round to nearest even
    return (kiln_bf16)(u >> 16);
#endif
}

// One tag type per dtype, its element's C type as `storage` (kiln_f16 and kiln_bf16 share
// theirs: the tags tell them apart). Kernels templated over the element type take the tag as
// their template argument, which a manifest's name expressions and a shim's
// kiln_kernel_abi::DType::cuda_tag spell alike (ABI.md §7.3.1): `kiln_cast<kiln_tag_f16>`.
struct kiln_tag_f32 { typedef float storage; };
struct kiln_tag_f16 { typedef kiln_f16 storage; };
struct kiln_tag_bf16 { typedef kiln_bf16 storage; };
struct kiln_tag_f64 { typedef double storage; };
struct kiln_tag_i8 { typedef signed char storage; };
struct kiln_tag_i16 { typedef short storage; };
struct kiln_tag_i32 { typedef int storage; };
struct kiln_tag_i64 { typedef long long storage; };
struct kiln_tag_u8 { typedef unsigned char storage; };
struct kiln_tag_u16 { typedef unsigned short storage; };
struct kiln_tag_u32 { typedef unsigned int storage; };
struct kiln_tag_u64 { typedef unsigned long long storage; };
struct kiln_tag_bool { typedef unsigned char storage; };

// Floating-point elements to and from f32, by tag.

__device__ __forceinline__ float kiln_to_f32(kiln_tag_f32, float v) { return v; }
__device__ __forceinline__ float kiln_to_f32(kiln_tag_f16, kiln_f16 v) { return kiln_f16_to_f32(v); }
__device__ __forceinline__ float kiln_to_f32(kiln_tag_bf16, kiln_bf16 v) { return kiln_bf16_to_f32(v); }
__device__ __forceinline__ float kiln_from_f32(kiln_tag_f32, float v) { return v; }
__device__ __forceinline__ kiln_f16 kiln_from_f32(kiln_tag_f16, float v) { return kiln_f32_to_f16(v); }
__device__ __forceinline__ kiln_bf16 kiln_from_f32(kiln_tag_bf16, float v) { return kiln_f32_to_bf16(v); }

// Grid-stride loop over n elements.
#define KILN_FOR(i, n)                                                                   \
    for (kiln_u64 i = blockIdx.x * (kiln_u64)blockDim.x + threadIdx.x; i < (kiln_u64)(n); \
         i += (kiln_u64)gridDim.x * blockDim.x)

// Warp reductions (full warp).
__device__ __forceinline__ float kiln_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float kiln_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Programmatic dependent launch (Hopper and later; PTX ISA: griddepcontrol). A kernel launched
// after its predecessor with programmatic stream serialization may start before that
// predecessor ends; kiln_griddep_wait() blocks until the predecessor has completed and its
// writes are visible. Before it, a kernel may read only what no earlier kernel of the stream
// writes (weights) and must write nothing. Without such a launch it returns at once.
__device__ __forceinline__ void kiln_griddep_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets the next kernel of the stream, when it is launched with programmatic dependent launch,
// start before this one ends (PTX ISA: griddepcontrol.launch_dependents); it still waits in
// kiln_griddep_wait() for this kernel's completion before it reads what this kernel writes.
__device__ __forceinline__ void kiln_griddep_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// A node's counters (ABI.md §6.3): a kernel whose signature has a `counters` parameter gets
// `kiln_counter*`, device words of its node that are zero between launches; a launch that counts
// on them leaves them at zero when it ends (its last block resets what it counted).
typedef unsigned int kiln_counter;

// Device status records (ABI.md §7.5). A kernel whose signature has a `status` parameter gets a
// pointer to its node's record (host memory the device writes through; it is only touched on
// failure). kiln_fail reports that an input is out of range: the first report of a node wins,
// with the code (1 and up, explained by the package's [[device_errors]]) and four values that
// its message names as {0}..{3}. The kernel must still stay inside its buffers (clamp, skip or
// write zeros): the run goes on to the step's synchronization, where the host fails it.
struct kiln_status {
    unsigned code;
    unsigned reserved;
    long long values[4];
};

__device__ __noinline__ void kiln_fail(kiln_status* st, unsigned code, long long v0, long long v1 = 0,
                                       long long v2 = 0, long long v3 = 0) {
    if (st == 0 || code == 0) return;
    if (atomicCAS(&st->code, 0u, 0xffffffffu) == 0u) {
        st->values[0] = v0;
        st->values[1] = v1;
        st->values[2] = v2;
        st->values[3] = v3;
        __threadfence_system();
        atomicExch(&st->code, code);
    }
}

// Philox4x32-10 (Salmon et al., SC 2011; Random123's constants), the counter-based generator
// kiln's samplers share with the host (kernel-abi's philox.rs): kiln_philox_uniform(seed, row,
// step) is the same f64 in [0, 1) as the host's philox::uniform, so seeded draws match across
// devices and a row's draws do not depend on the rest of its batch.
__device__ __forceinline__ void kiln_philox4x32_10(unsigned c[4], unsigned k0, unsigned k1) {
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        const unsigned hi0 = __umulhi(0xD2511F53u, c[0]), lo0 = 0xD2511F53u * c[0];
        const unsigned hi1 = __umulhi(0xCD9E8D57u, c[2]), lo1 = 0xCD9E8D57u * c[2];
        const unsigned n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0;
        c[1] = lo1;
        c[2] = n2;
        c[3] = lo0;
    }
}

// The uniform draw of one sampling decision: key = seed (low word first), counter = (step low,
// step high, row, 0), value = the top 53 bits of output words 0 (high) and 1, times 2^-53.
__device__ __forceinline__ double kiln_philox_uniform(kiln_u64 seed, unsigned row, kiln_u64 step) {
    unsigned c[4] = {(unsigned)step, (unsigned)(step >> 32), row, 0u};
    kiln_philox4x32_10(c, (unsigned)seed, (unsigned)(seed >> 32));
    const kiln_u64 bits = ((((kiln_u64)c[0]) << 32) | c[1]) >> 11;
    return (double)bits * (1.0 / 9007199254740992.0);
}

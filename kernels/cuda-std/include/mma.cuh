// kiln-cuda-std/mma.cuh — warp-level tensor-core matrix products for 16-bit floats
// (PTX ISA: mma.sync m16n8k16 with f32 accumulators, ldmatrix), by the prelude's dtype tag
// (kiln_tag_f16, kiln_tag_bf16). Before the instructions exist (mma: compute capability 8.0,
// ldmatrix: 7.5) the warp computes the same fragments from shuffled operands, so a kernel needs
// no second path for older devices.
//
// Fragment layout (PTX ISA, "Matrix Fragments for mma.m16n8k16"): lane l, g = l / 4, q = l % 4.
// A (16 × 16, row-major): a0 = A[g][2q, 2q+1], a1 = A[g+8][2q, 2q+1], a2 = A[g][2q+8, 2q+9],
// a3 = A[g+8][2q+8, 2q+9]. B (16 × 8, column-major): b0 = B[2q, 2q+1][g], b1 = B[2q+8, 2q+9][g].
// C (16 × 8, f32): c0, c1 = C[g][2q, 2q+1], c2, c3 = C[g+8][2q, 2q+1]. Two 16-bit values share a
// register, the lower column or row in the low half.
#pragma once
#include "kiln.cuh"
#include "kiln-cuda-std/elem.cuh"

// Whether kiln_mma16816 takes the tag's elements (float16 and bfloat16).
template <typename Tag>
struct kiln_has_mma {
    static const bool value = false;
};
template <>
struct kiln_has_mma<kiln_tag_f16> {
    static const bool value = true;
};
template <>
struct kiln_has_mma<kiln_tag_bf16> {
    static const bool value = true;
};

// Two floats rounded to the tag's 16-bit type, `lo` in the low half of the register.
template <typename Tag>
__device__ __forceinline__ unsigned kiln_pack2(float lo, float hi) {
    return (unsigned)kiln_from_f32(Tag(), lo) | ((unsigned)kiln_from_f32(Tag(), hi) << 16);
}

// d += A · B for one m16n8k16 fragment set, emulated by shuffles (every lane of the warp calls it).
template <typename Tag>
__device__ __forceinline__ void kiln_mma16816_emulated(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,
                                                       unsigned a3, unsigned b0, unsigned b1) {
    typedef kiln_elem<Tag> T;
    const unsigned lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
    for (unsigned p = 0; p < 4; ++p) {
        // Lane (g, p) holds A rows g, g + 8 at columns 2p, 2p + 1 (a0, a1) and 2p + 8, 2p + 9 (a2, a3);
        // lane (n, p) holds B column n at rows 2p, 2p + 1 (b0) and 2p + 8, 2p + 9 (b1).
        const unsigned ra[4] = {__shfl_sync(0xffffffffu, a0, g * 4 + p), __shfl_sync(0xffffffffu, a1, g * 4 + p),
                                __shfl_sync(0xffffffffu, a2, g * 4 + p), __shfl_sync(0xffffffffu, a3, g * 4 + p)};
        unsigned rb[2][2];
#pragma unroll
        for (unsigned j = 0; j < 2; ++j) {
            rb[j][0] = __shfl_sync(0xffffffffu, b0, (2 * q + j) * 4 + p);
            rb[j][1] = __shfl_sync(0xffffffffu, b1, (2 * q + j) * 4 + p);
        }
#pragma unroll
        for (unsigned i = 0; i < 4; ++i) {
            const unsigned half = i / 2, j = i % 2;  // output row g + 8·half, column 2q + j
#pragma unroll
            for (unsigned hi = 0; hi < 2; ++hi) {  // columns 2p.. (a0/a1, b0) or 2p + 8.. (a2/a3, b1)
                const unsigned av = ra[half + 2 * hi], bv = rb[j][hi];
                d[i] += T::ld((typename T::S)(av & 0xffffu)) * T::ld((typename T::S)(bv & 0xffffu)) +
                        T::ld((typename T::S)(av >> 16)) * T::ld((typename T::S)(bv >> 16));
            }
        }
    }
}

// d += A · B for one m16n8k16 fragment set of the tag's 16-bit floats (f32 accumulators).
template <typename Tag>
__device__ __forceinline__ void kiln_mma16816(float (&d)[4], unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                              unsigned b0, unsigned b1);

#if __CUDA_ARCH__ >= 800
#define KILN_MMA16816(TAG, PTX_TYPE)                                                                          \
    template <>                                                                                               \
    __device__ __forceinline__ void kiln_mma16816<TAG>(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,  \
                                                       unsigned a3, unsigned b0, unsigned b1) {               \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 {%0,%1,%2,%3}, "    \
                     "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"                                                 \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                         \
                     : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));                                 \
    }
#else
#define KILN_MMA16816(TAG, PTX_TYPE)                                                                          \
    template <>                                                                                               \
    __device__ __forceinline__ void kiln_mma16816<TAG>(float (&d)[4], unsigned a0, unsigned a1, unsigned a2,  \
                                                       unsigned a3, unsigned b0, unsigned b1) {               \
        kiln_mma16816_emulated<TAG>(d, a0, a1, a2, a3, b0, b1);                                               \
    }
#endif
KILN_MMA16816(kiln_tag_f16, "f16")
KILN_MMA16816(kiln_tag_bf16, "bf16")
#undef KILN_MMA16816

// Four 8 × 8 matrices of 16-bit values from shared memory (ldmatrix .x4): lanes 8i … 8i + 7 give
// the 16-byte rows of matrix i (`row`, 16-byte aligned), and each lane receives r[i] =
// matrix i [l / 4][2(l % 4), 2(l % 4) + 1]. With `trans` the matrices are transposed on the way:
// r[i] = matrix i [2(l % 4), 2(l % 4) + 1][l / 4] (the B operand from row-major rows, or the A
// operand from column-major ones). Every lane of the warp calls it.
template <bool trans>
__device__ __forceinline__ void kiln_ldmatrix_x4(unsigned (&r)[4], const void* row) {
#if __CUDA_ARCH__ >= 750
    const unsigned a = (unsigned)__cvta_generic_to_shared(row);
    if (trans)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(a));
#else
    const unsigned lane = threadIdx.x % 32;
    const kiln_u64 mine = (kiln_u64)row;
#pragma unroll
    for (unsigned i = 0; i < 4; ++i) {
        if (trans) {
            const unsigned short* p0 =
                (const unsigned short*)__shfl_sync(0xffffffffu, mine, 8 * i + 2 * (lane % 4));
            const unsigned short* p1 =
                (const unsigned short*)__shfl_sync(0xffffffffu, mine, 8 * i + 2 * (lane % 4) + 1);
            r[i] = (unsigned)p0[lane / 4] | ((unsigned)p1[lane / 4] << 16);
        } else {
            const unsigned* p = (const unsigned*)__shfl_sync(0xffffffffu, mine, 8 * i + lane / 4);
            r[i] = p[lane % 4];
        }
    }
#endif
}

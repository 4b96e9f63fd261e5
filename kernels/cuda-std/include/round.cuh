// kiln-cuda-std/round.cuh — rounding to odd, so that a value rounded twice (to float32, then
// to float16 or bfloat16) is rounded correctly once (as the CPU references'
// `kiln_kernel_abi::guest::element::f32_round_odd` and `f32_round_odd_int`).
#pragma once
#include "kiln.cuh"

// f64 → f32 rounded to odd: truncate toward zero, then set the last bit when inexact.
__device__ __forceinline__ float kiln_f32_round_odd(double v) {
    const float f = (float)v;
    if ((__float_as_uint(f) & 0x7f800000u) == 0x7f800000u || (double)f == v) return f;
    unsigned bits = __float_as_uint(f);
    if (fabs((double)f) > fabs(v)) bits -= 1;  // toward zero
    return __uint_as_float(bits | 1u);
}

// 64-bit integer → f32 rounded to odd.
__device__ __forceinline__ float kiln_f32_round_odd_s64(long long v) {
    const float f = __ll2float_rz(v);  // |f| <= |v| < 2^63: converting back is exact
    return __float2ll_rz(f) == v ? f : __uint_as_float(__float_as_uint(f) | 1u);
}
__device__ __forceinline__ float kiln_f32_round_odd_u64(kiln_u64 v) {
    const float f = __ull2float_rz(v);
    return __float2ull_rz(f) == v ? f : __uint_as_float(__float_as_uint(f) | 1u);
}

// kiln-cuda-std/math.cuh — the CUDA math library's functions overloaded for float and double, so
// that code templated over its compute type (kiln_elem<Tag>::C) calls one name: kiln_exp(x) is
// expf for a float and exp for a double. NVRTC gets no toolkit headers, so the overloads are
// spelled out here. Results are the CUDA math library's (CUDA Math API: their ulp bounds).
#pragma once
#include "kiln.cuh"

#define KILN_MATH1(NAME, F32, F64)                                                 \
    __device__ __forceinline__ float kiln_##NAME(float x) { return F32(x); }       \
    __device__ __forceinline__ double kiln_##NAME(double x) { return F64(x); }
#define KILN_MATH2(NAME, F32, F64)                                                           \
    __device__ __forceinline__ float kiln_##NAME(float a, float b) { return F32(a, b); }     \
    __device__ __forceinline__ double kiln_##NAME(double a, double b) { return F64(a, b); }

KILN_MATH1(exp, expf, exp)
KILN_MATH1(log, logf, log)
KILN_MATH1(log1p, log1pf, log1p)
KILN_MATH1(sqrt, sqrtf, sqrt)
KILN_MATH1(tanh, tanhf, tanh)
KILN_MATH1(abs, fabsf, fabs)
KILN_MATH1(erf, erff, erf)
KILN_MATH1(erfc, erfcf, erfc)
KILN_MATH1(sin, sinf, sin)
KILN_MATH1(cos, cosf, cos)
KILN_MATH1(floor, floorf, floor)
KILN_MATH1(ceil, ceilf, ceil)
KILN_MATH1(rint, rintf, rint)
KILN_MATH1(expm1, expm1f, expm1)
KILN_MATH1(tan, tanf, tan)
KILN_MATH1(asin, asinf, asin)
KILN_MATH1(acos, acosf, acos)
KILN_MATH1(atan, atanf, atan)
KILN_MATH1(sinh, sinhf, sinh)
KILN_MATH1(cosh, coshf, cosh)
KILN_MATH1(asinh, asinhf, asinh)
KILN_MATH1(acosh, acoshf, acosh)
KILN_MATH1(atanh, atanhf, atanh)
KILN_MATH2(pow, powf, pow)
KILN_MATH2(fmod, fmodf, fmod)

#undef KILN_MATH1
#undef KILN_MATH2

// Negative infinity of float or double (the start of a maximum).
template <typename T>
__device__ __forceinline__ T kiln_neg_inf();
template <>
__device__ __forceinline__ float kiln_neg_inf<float>() {
    return __int_as_float(0xff800000);
}
template <>
__device__ __forceinline__ double kiln_neg_inf<double>() {
    return __longlong_as_double(0xfff0000000000000ll);
}

// kiln-cuda-std/minifloat.cuh — values of ONNX's narrow element types on the GPU: the float8
// forms, float4e2m1, float8e8m0 and the packed 4-bit and 2-bit integers, exactly as the CPU
// references' `kiln_kernel_abi::minifloat` (which states the rules: Cast-25's tables, and
// ml_dtypes where they are silent). Types are named by their ONNX dtype codes.
#pragma once
#include "kiln.cuh"

enum KilnNarrowCode {
    KILN_DT_F8E4M3FN = 17, KILN_DT_F8E4M3FNUZ = 18, KILN_DT_F8E5M2 = 19, KILN_DT_F8E5M2FNUZ = 20,
    KILN_DT_U4 = 21, KILN_DT_I4 = 22, KILN_DT_F4E2M1 = 23, KILN_DT_F8E8M0 = 24, KILN_DT_U2 = 25,
    KILN_DT_I2 = 26
};

// Layout of a float8/float4 code: exponent and mantissa bits, bias, the largest finite value's
// exponent and mantissa field, and its kind (0 IEEE-style inf/NaN, 1 finite with NaN S.1111.111,
// 2 fnuz: 0x80 the only NaN and no -0, 3 finite without NaN).
struct KilnMiniFormat { int exp, man, bias, emax, max_man, kind; };

__device__ __forceinline__ KilnMiniFormat kiln_mini_format(unsigned code) {
    switch (code) {
    case KILN_DT_F8E4M3FN: return {4, 3, 7, 8, 6, 1};
    case KILN_DT_F8E4M3FNUZ: return {4, 3, 8, 7, 7, 2};
    case KILN_DT_F8E5M2: return {5, 2, 15, 15, 3, 0};
    case KILN_DT_F8E5M2FNUZ: return {5, 2, 16, 15, 3, 2};
    default: return {2, 1, 1, 2, 1, 3};  // float4e2m1
    }
}

// Bits per element of a dtype code (2, 4, 8 … 64; 0 for an unknown code).
__device__ __forceinline__ unsigned kiln_dtype_bits(unsigned code) {
    switch (code) {
    case KILN_DT_U2: case KILN_DT_I2: return 2;
    case KILN_DT_U4: case KILN_DT_I4: case KILN_DT_F4E2M1: return 4;
    case 2: case 3: case 9: case 17: case 18: case 19: case 20: case 24: return 8;
    case 4: case 5: case 10: case 16: return 16;
    case 1: case 6: case 12: return 32;
    case 7: case 11: case 13: return 64;
    default: return 0;
    }
}

// The value of a float8/float4/float8e8m0 code (float4 in the low 4 bits), exact.
__device__ __forceinline__ float kiln_minifloat_to_f32(unsigned code, unsigned bits) {
    if (code == KILN_DT_F8E8M0) {
        bits &= 0xFF;
        if (bits == 0xFF) return __int_as_float(0x7fc00000);
        return bits == 0 ? __uint_as_float(0x00400000u) : __uint_as_float(bits << 23);
    }
    const KilnMiniFormat f = kiln_mini_format(code);
    const int width = 1 + f.exp + f.man;
    bits &= (1u << width) - 1;
    const bool negative = (bits >> (width - 1)) != 0;
    const unsigned e = (bits >> f.man) & ((1u << f.exp) - 1), m = bits & ((1u << f.man) - 1);
    const unsigned ones = (1u << f.exp) - 1;
    const float nan = __int_as_float(negative ? 0xffc00000 : 0x7fc00000);  // a NaN keeps its sign
    if (f.kind == 2 && bits == 0x80) return __int_as_float(0x7fc00000);
    if (f.kind == 1 && e == ones && m == (1u << f.man) - 1) return nan;
    if (f.kind == 0 && e == ones) {
        if (m != 0) return nan;
        return negative ? __int_as_float(0xff800000) : __int_as_float(0x7f800000);
    }
    const float mag = e == 0 ? ldexpf((float)m, 1 - f.bias - f.man)
                             : ldexpf((float)((1u << f.man) | m), (int)e - f.bias - f.man);
    return negative ? -mag : mag;
}

// x as a float8 (not e8m0) or float4 code, rounded to nearest even; saturate as Cast says.
__device__ __forceinline__ unsigned kiln_minifloat_from_f64(unsigned code, double x, bool saturate) {
    const KilnMiniFormat f = kiln_mini_format(code);
    const unsigned sign = signbit(x) ? 1u << (f.exp + f.man) : 0u;
    const unsigned maxc = sign | ((unsigned)(f.emax + f.bias) << f.man) | (unsigned)f.max_man;
    const unsigned nan = f.kind == 0 ? (sign | 0x7E) : f.kind == 1 ? (sign | 0x7F) : f.kind == 2 ? 0x80u : (sign ^ 0x8u);
    const unsigned overflow = (saturate || f.kind == 3) ? maxc : f.kind == 0 ? (sign | 0x7C) : nan;
    const unsigned zero = f.kind == 2 ? 0u : sign;
    if (x != x) return nan;
    const double a = fabs(x);
    if (isinf(a)) return overflow;
    if (a == 0.0) return zero;
    const int e = (int)((__double_as_longlong(a) >> 52) & 0x7FF) - 1023;
    if (e > f.emax) return overflow;
    int exp = max(e, 1 - f.bias);
    const int q = exp - f.man;
    const double scaled = ldexp(a, -q);  // exact, below 2^(man + 1)
    const unsigned long long fl = (unsigned long long)scaled;
    const double frac = scaled - (double)fl;
    unsigned long long r = fl + ((frac > 0.5 || (frac == 0.5 && (fl & 1))) ? 1 : 0);
    if (r == 0) return zero;
    if (r >= (1ull << (f.man + 1))) { r >>= 1; exp += 1; }
    if (r < (1ull << f.man)) return sign | (unsigned)r;
    if (exp > f.emax || (exp == f.emax && (unsigned)(r - (1ull << f.man)) > (unsigned)f.max_man)) return overflow;
    return sign | ((unsigned)(exp + f.bias) << f.man) | (unsigned)(r - (1ull << f.man));
}

// x as a float8e8m0 code: round_mode 0 up, 1 down, 2 nearest (onnx.numpy_helper.to_float8e8m0).
__device__ __forceinline__ unsigned kiln_e8m0_from_f32(float x, bool saturate, unsigned round_mode) {
    const unsigned b = __float_as_uint(x);
    const unsigned exponent = (b >> 23) & 0xFF;
    if (exponent == 0xFF) return 0xFF;
    bool up;
    if (round_mode == 1) up = false;
    else if (round_mode == 0) up = (b & 0x7FFFFFu) != 0;
    else up = (b & 0x400000u) && ((b & 0x200000u) || (b & 0x1FFFFFu) || exponent > 0);
    if (saturate && exponent == 0xFE) up = false;
    return (exponent + (up ? 1u : 0u)) & 0xFF;
}

// The integer a 4-bit or 2-bit field holds (sign-extended for int4 and int2).
__device__ __forceinline__ long long kiln_narrow_int_value(unsigned code, unsigned field) {
    const unsigned bits = kiln_dtype_bits(code);
    const long long v = field & ((1u << bits) - 1);
    const bool is_signed = code == KILN_DT_I4 || code == KILN_DT_I2;
    return is_signed && v >= (1ll << (bits - 1)) ? v - (1ll << bits) : v;
}

// Packed element i's field (bits right-aligned) of a 4-bit or 2-bit tensor.
__device__ __forceinline__ unsigned kiln_packed_get(const unsigned char* p, unsigned bits, kiln_u64 i) {
    const kiln_u64 at = i * bits;
    return (p[at / 8] >> (at % 8)) & ((1u << bits) - 1);
}

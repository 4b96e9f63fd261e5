// kiln-cast CUDA kernels: y[i] = convert(x[i]) over n contiguous elements, grid-stride loops.
// Compiled by NVRTC for the GPU present. Conversions follow the CPU reference (shim/src/lib.rs):
//
// - float → float rounds to nearest even once (float64 → float16/bfloat16 through float32
//   rounded to odd); NaN and ±inf are kept, values beyond the target's range become ±inf;
// - float → integer truncates toward zero, saturating, NaN → 0 (Rust's `as`);
// - integer → float rounds to nearest even once; integer → integer wraps;
// - anything → bool is `x != 0` (NaN → true); bool (any nonzero byte) → number is 0 or 1.
//
// Entry points: the template kiln_cast<Tag>(const Tag::storage* x, void* y, u64 n, u32 to), Tag
// the prelude's tag of x's dtype (kiln_tag_f32 … kiln_tag_bool) and `to` the ONNX dtype code of
// y. kernel.toml lists the instantiations (name expressions, manifest schema 6), which NVRTC
// lowers; the shim names them with DType::cuda_tag. And kiln_cast_narrow(x, y, n, from, to,
// flags) for a cast from or to a float8, float4, 4-bit or 2-bit type (dtype codes 17-26), both
// dtypes by code: flags bit 0 is `saturate`, bits 1-2 `round_mode` (0 up, 1 down, 2 nearest).
#include "kiln.cuh"
#include "kiln-cuda-std/round.cuh"
#include "kiln-cuda-std/minifloat.cuh"

enum DTypeCode { DT_F32 = 1, DT_U8 = 2, DT_I8 = 3, DT_U16 = 4, DT_I16 = 5, DT_I32 = 6, DT_I64 = 7, DT_BOOL = 9,
                 DT_F16 = 10, DT_F64 = 11, DT_U32 = 12, DT_U64 = 13, DT_BF16 = 16 };

// Kinds of element: 0 float (value as float or double), 1 signed, 2 unsigned, 3 bool.
enum Kind { FLOAT = 0, SIGNED, UNSIGNED, BOOL };

// What the conversions need of an element type, by the prelude's tag: its C type S (the tag's
// storage), its kind and its ONNX dtype code.
template <typename Tag> struct Elem;
template <> struct Elem<kiln_tag_f32> { typedef kiln_tag_f32::storage S; static const int kind = FLOAT; static const int id = DT_F32; };
template <> struct Elem<kiln_tag_f16> { typedef kiln_tag_f16::storage S; static const int kind = FLOAT; static const int id = DT_F16; };
template <> struct Elem<kiln_tag_bf16> { typedef kiln_tag_bf16::storage S; static const int kind = FLOAT; static const int id = DT_BF16; };
template <> struct Elem<kiln_tag_f64> { typedef kiln_tag_f64::storage S; static const int kind = FLOAT; static const int id = DT_F64; };
template <> struct Elem<kiln_tag_i8> { typedef kiln_tag_i8::storage S; static const int kind = SIGNED; static const int id = DT_I8; };
template <> struct Elem<kiln_tag_i16> { typedef kiln_tag_i16::storage S; static const int kind = SIGNED; static const int id = DT_I16; };
template <> struct Elem<kiln_tag_i32> { typedef kiln_tag_i32::storage S; static const int kind = SIGNED; static const int id = DT_I32; };
template <> struct Elem<kiln_tag_i64> { typedef kiln_tag_i64::storage S; static const int kind = SIGNED; static const int id = DT_I64; };
template <> struct Elem<kiln_tag_u8> { typedef kiln_tag_u8::storage S; static const int kind = UNSIGNED; static const int id = DT_U8; };
template <> struct Elem<kiln_tag_u16> { typedef kiln_tag_u16::storage S; static const int kind = UNSIGNED; static const int id = DT_U16; };
template <> struct Elem<kiln_tag_u32> { typedef kiln_tag_u32::storage S; static const int kind = UNSIGNED; static const int id = DT_U32; };
template <> struct Elem<kiln_tag_u64> { typedef kiln_tag_u64::storage S; static const int kind = UNSIGNED; static const int id = DT_U64; };
template <> struct Elem<kiln_tag_bool> { typedef kiln_tag_bool::storage S; static const int kind = BOOL; static const int id = DT_BOOL; };
typedef Elem<kiln_tag_f32> TF32;
typedef Elem<kiln_tag_f16> TF16;
typedef Elem<kiln_tag_bf16> TBF16;
typedef Elem<kiln_tag_f64> TF64;
typedef Elem<kiln_tag_i8> TI8;
typedef Elem<kiln_tag_i16> TI16;
typedef Elem<kiln_tag_i32> TI32;
typedef Elem<kiln_tag_i64> TI64;
typedef Elem<kiln_tag_u8> TU8;
typedef Elem<kiln_tag_u16> TU16;
typedef Elem<kiln_tag_u32> TU32;
typedef Elem<kiln_tag_u64> TU64;
typedef Elem<kiln_tag_bool> TBool;


// A float source's value as float (float32, float16, bfloat16: exact).
template <typename T>
__device__ __forceinline__ float ld_float(typename T::S v) {
    if constexpr (sizeof(typename T::S) == 4) return v;
    else if constexpr (T::id == DT_F16) return kiln_f16_to_f32(v);
    else return kiln_bf16_to_f32(v);
}


// f64 → integer of `bits` bits as Rust's `as`: truncate toward zero, saturate, NaN → 0.
template <bool SIGNED, int BITS>
__device__ __forceinline__ kiln_u64 sat_int(double v) {
    const kiln_u64 top = 1ull << (BITS - 1);  // 2^(BITS-1)
    if (v != v) return 0;
    if constexpr (SIGNED) {
        if (v <= -(double)top) return 0ull - top;
        if (v >= (double)top) return top - 1;
        return (kiln_u64)(long long)v;
    } else {
        if (v <= 0.0) return 0;
        if (v >= 2.0 * (double)top) return BITS == 64 ? ~0ull : (top << 1) - 1;
        return (kiln_u64)v;
    }
}

// Float source (as double, exact) → integer target T.
template <typename To>
__device__ __forceinline__ typename To::S float_to_int(double v) {
    constexpr int bits = 8 * sizeof(typename To::S);
    return (typename To::S)sat_int<To::kind == SIGNED, bits>(v);
}

template <typename From, typename To>
__device__ __forceinline__ typename To::S convert(typename From::S x) {
    typedef typename To::S D;
    if constexpr (From::kind == FLOAT) {
        if constexpr (To::kind == BOOL) {
            if constexpr (From::id == DT_F64) return x != 0.0 ? 1 : 0;
            else return ld_float<From>(x) != 0.f ? 1 : 0;
        } else if constexpr (To::kind == FLOAT) {
            if constexpr (From::id == DT_F64) {
                if constexpr (To::id == DT_F64) return x;
                else if constexpr (To::id == DT_F32) return (float)x;
                else if constexpr (To::id == DT_F16) return kiln_f32_to_f16(kiln_f32_round_odd(x));
                else return kiln_f32_to_bf16(kiln_f32_round_odd(x));
            } else {
                const float f = ld_float<From>(x);  // exact
                if constexpr (To::id == DT_F64) return (double)f;
                else if constexpr (To::id == DT_F32) return f;
                else if constexpr (To::id == DT_F16) return kiln_f32_to_f16(f);
                else return kiln_f32_to_bf16(f);
            }
        } else {
            double v;
            if constexpr (From::id == DT_F64) v = x;
            else v = (double)ld_float<From>(x);
            return float_to_int<To>(v);
        }
    } else {
        // Integer or bool source: its value as a sign- or zero-extended 64-bit pattern.
        kiln_u64 u;
        bool neg_ok;  // the pattern is a signed value
        if constexpr (From::kind == BOOL) {
            u = x != 0 ? 1 : 0;
            neg_ok = false;
        } else {
            u = (kiln_u64)x;  // sign-extends signed sources
            neg_ok = From::kind == SIGNED;
        }
        if constexpr (To::kind == BOOL) {
            return u != 0 ? 1 : 0;
        } else if constexpr (To::kind == FLOAT) {
            if constexpr (To::id == DT_F64) {
                return neg_ok ? (double)(long long)u : (double)u;
            } else if constexpr (To::id == DT_F32) {
                return neg_ok ? (float)(long long)u : (float)u;
            } else {
                const float f = neg_ok ? kiln_f32_round_odd_s64((long long)u) : kiln_f32_round_odd_u64(u);
                if constexpr (To::id == DT_F16) return kiln_f32_to_f16(f);
                else return kiln_f32_to_bf16(f);
            }
        } else {
            return (D)u;  // keep the low bits
        }
    }
}

template <typename From, typename To>
__device__ __forceinline__ void cast_loop(const typename From::S* x, void* y_, kiln_u64 n) {
    typename To::S* y = (typename To::S*)y_;
    KILN_FOR(i, n) { y[i] = convert<From, To>(x[i]); }
}

template <typename From>
__device__ __forceinline__ void cast_from(const typename From::S* x, void* y, kiln_u64 n, unsigned to) {
    switch (to) {
    case DT_F32: cast_loop<From, TF32>(x, y, n); break;
    case DT_F16: cast_loop<From, TF16>(x, y, n); break;
    case DT_BF16: cast_loop<From, TBF16>(x, y, n); break;
    case DT_F64: cast_loop<From, TF64>(x, y, n); break;
    case DT_I8: cast_loop<From, TI8>(x, y, n); break;
    case DT_I16: cast_loop<From, TI16>(x, y, n); break;
    case DT_I32: cast_loop<From, TI32>(x, y, n); break;
    case DT_I64: cast_loop<From, TI64>(x, y, n); break;
    case DT_U8: cast_loop<From, TU8>(x, y, n); break;
    case DT_U16: cast_loop<From, TU16>(x, y, n); break;
    case DT_U32: cast_loop<From, TU32>(x, y, n); break;
    case DT_U64: cast_loop<From, TU64>(x, y, n); break;
    case DT_BOOL: cast_loop<From, TBool>(x, y, n); break;
    default: break;
    }
}

template <typename Tag>
__global__ void kiln_cast(const typename Tag::storage* x, void* y, kiln_u64 n, unsigned to) {
    cast_from<Elem<Tag>>(x, y, n, to);
}


// One element of any dtype, as the conversions above take it: `kind` FLOAT with its exact value
// in f, or SIGNED/UNSIGNED/BOOL with its 64-bit pattern in u (sign-extended when signed).
struct AnyVal { int kind; double f; kiln_u64 u; };

__device__ __forceinline__ AnyVal load_any(const unsigned char* x, unsigned from, kiln_u64 i) {
    AnyVal v = {FLOAT, 0.0, 0};
    switch (from) {
    case DT_F32: v.f = ((const float*)x)[i]; break;
    case DT_F64: v.f = ((const double*)x)[i]; break;
    case DT_F16: v.f = kiln_f16_to_f32(((const TF16::S*)x)[i]); break;
    case DT_BF16: v.f = kiln_bf16_to_f32(((const TBF16::S*)x)[i]); break;
    case KILN_DT_F8E4M3FN: case KILN_DT_F8E4M3FNUZ: case KILN_DT_F8E5M2: case KILN_DT_F8E5M2FNUZ:
    case KILN_DT_F8E8M0: v.f = kiln_minifloat_to_f32(from, x[i]); break;
    case KILN_DT_F4E2M1: v.f = kiln_minifloat_to_f32(from, kiln_packed_get(x, 4, i)); break;
    case KILN_DT_I4: case KILN_DT_U4: case KILN_DT_I2: case KILN_DT_U2:
        v.kind = (from == KILN_DT_I4 || from == KILN_DT_I2) ? SIGNED : UNSIGNED;
        v.u = (kiln_u64)kiln_narrow_int_value(from, kiln_packed_get(x, kiln_dtype_bits(from), i));
        break;
    case DT_I8: v.kind = SIGNED; v.u = (kiln_u64)(long long)((const TI8::S*)x)[i]; break;
    case DT_I16: v.kind = SIGNED; v.u = (kiln_u64)(long long)((const TI16::S*)x)[i]; break;
    case DT_I32: v.kind = SIGNED; v.u = (kiln_u64)(long long)((const TI32::S*)x)[i]; break;
    case DT_I64: v.kind = SIGNED; v.u = (kiln_u64)((const TI64::S*)x)[i]; break;
    case DT_U8: v.kind = UNSIGNED; v.u = ((const TU8::S*)x)[i]; break;
    case DT_U16: v.kind = UNSIGNED; v.u = ((const TU16::S*)x)[i]; break;
    case DT_U32: v.kind = UNSIGNED; v.u = ((const TU32::S*)x)[i]; break;
    case DT_U64: v.kind = UNSIGNED; v.u = ((const TU64::S*)x)[i]; break;
    default: v.kind = UNSIGNED; v.u = x[i] != 0 ? 1 : 0; break;  // bool
    }
    return v;
}

// v as a To element, by the rules of convert<> for a float64, int64 or uint64 source (which
// give a bool's 0/1 the same results as a bool source).
template <typename To>
__device__ __forceinline__ typename To::S from_any(AnyVal v) {
    if (v.kind == FLOAT) return convert<TF64, To>(v.f);
    if (v.kind == SIGNED) return convert<TI64, To>((long long)v.u);
    return convert<TU64, To>(v.u);
}

// v as a code of a float8, float4, 4-bit or 2-bit type.
__device__ __forceinline__ unsigned narrow_code(AnyVal v, unsigned to, unsigned flags) {
    const double f = v.kind == FLOAT ? v.f : v.kind == SIGNED ? (double)(long long)v.u : (double)v.u;
    switch (to) {
    case KILN_DT_F8E8M0: return kiln_e8m0_from_f32((float)f, flags & 1, (flags >> 1) & 3);
    case KILN_DT_I4: case KILN_DT_U4: case KILN_DT_I2: case KILN_DT_U2: {
        // Truncated toward zero (as Rust's `as`: saturating, NaN → 0), then the low bits.
        const kiln_u64 u = v.kind == FLOAT ? sat_int<true, 64>(v.f) : v.u;
        return (unsigned)(u & ((1u << kiln_dtype_bits(to)) - 1));
    }
    default: return kiln_minifloat_from_f64(to, f, flags & 1);
    }
}

// Element i of y (a byte-or-wider dtype) from v.
__device__ __forceinline__ void store_any(unsigned char* y, unsigned to, kiln_u64 i, AnyVal v, unsigned flags) {
    switch (to) {
    case DT_F32: ((TF32::S*)y)[i] = from_any<TF32>(v); break;
    case DT_F16: ((TF16::S*)y)[i] = from_any<TF16>(v); break;
    case DT_BF16: ((TBF16::S*)y)[i] = from_any<TBF16>(v); break;
    case DT_F64: ((TF64::S*)y)[i] = from_any<TF64>(v); break;
    case DT_I8: ((TI8::S*)y)[i] = from_any<TI8>(v); break;
    case DT_I16: ((TI16::S*)y)[i] = from_any<TI16>(v); break;
    case DT_I32: ((TI32::S*)y)[i] = from_any<TI32>(v); break;
    case DT_I64: ((TI64::S*)y)[i] = from_any<TI64>(v); break;
    case DT_U8: ((TU8::S*)y)[i] = from_any<TU8>(v); break;
    case DT_U16: ((TU16::S*)y)[i] = from_any<TU16>(v); break;
    case DT_U32: ((TU32::S*)y)[i] = from_any<TU32>(v); break;
    case DT_U64: ((TU64::S*)y)[i] = from_any<TU64>(v); break;
    case DT_BOOL: ((TBool::S*)y)[i] = from_any<TBool>(v); break;
    default: y[i] = (unsigned char)narrow_code(v, to, flags); break;  // float8
    }
}

// A cast from or to a float8, float4, 4-bit or 2-bit type, both dtypes by code. A packed target
// is written a whole byte per thread (its 2 or 4 elements), so that no two threads share a byte.
extern "C" __global__ void kiln_cast_narrow(const unsigned char* x, unsigned char* y, kiln_u64 n, unsigned from,
                                            unsigned to, unsigned flags) {
    const unsigned bits = kiln_dtype_bits(to);
    if (from == to) {
        // The same type: the bytes as they are, as the CPU reference copies them.
        KILN_FOR(b, (n * bits + 7) / 8) { y[b] = x[b]; }
        return;
    }
    if (bits >= 8) {
        KILN_FOR(i, n) { store_any(y, to, i, load_any(x, from, i), flags); }
        return;
    }
    const unsigned per = 8 / bits;
    const kiln_u64 bytes = (n + per - 1) / per;
    KILN_FOR(b, bytes) {
        unsigned byte = 0;
        for (unsigned k = 0; k < per; ++k) {
            const kiln_u64 i = b * per + k;
            if (i < n) byte |= narrow_code(load_any(x, from, i), to, flags) << (k * bits);
        }
        y[b] = (unsigned char)byte;
    }
}

// kiln-cast CUDA kernels: y[i] = convert(x[i]) over n contiguous elements, grid-stride loops.
// Compiled by NVRTC for the GPU present. Conversions follow the CPU reference (shim/src/lib.rs):
//
// - float → float rounds to nearest even once (float64 → float16/bfloat16 through float32
//   rounded to odd); NaN and ±inf are kept, values beyond the target's range become ±inf;
// - float → integer truncates toward zero, saturating, NaN → 0 (Rust's `as`);
// - integer → float rounds to nearest even once; integer → integer wraps;
// - anything → bool is `x != 0` (NaN → true); bool (any nonzero byte) → number is 0 or 1.
//
// Entry point: the template kiln_cast<Tag>(const Tag::storage* x, void* y, u64 n, u32 to), Tag
// the prelude's tag of x's dtype (kiln_tag_f32 … kiln_tag_bool) and `to` the ONNX dtype code of
// y. kernel.toml lists the instantiations (name expressions, manifest schema 6), which NVRTC
// lowers; the shim names them with DType::cuda_tag.
#include "kiln.cuh"
#include "kiln-cuda-std/round.cuh"

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

// kiln-unary CUDA kernels: y[i] = op(x[i]) over n contiguous elements, grid-stride loops.
// Compiled by NVRTC for the GPU present; op codes match `Op::code` in shim/src/lib.rs.
//
// Entry points (argument order is what shim/src/lib.rs `dispatch` passes), templates over the
// prelude's dtype tag (T = Tag::storage), which kernel.toml instantiates by name expressions
// (manifest schema 6) and the shim names with DType::cuda_tag:
//   kiln_unary<Tag>(const T* x, T* y, u64 n, u32 op, f32 alpha, f32 beta)     Tag f32 f16 bf16 f64
//   kiln_unary_int<Tag>(const T* x, T* y, u64 n, u32 op)     Relu, Neg, Abs (wrapping) and Sign of
//                                                            i8 .. i64; BitwiseNot of i8 .. u64
//   kiln_not(const u8* x, u8* y, u64 n)                                     bool (extern "C")
//   kiln_classify<Tag>(const T* x, u8* y, u64 n, u32 what)   IsNaN / IsInf, Tag f32 f16 bf16 f64
//   kiln_clip<Tag>(const T* x, T* y, u64 n, const T* lo, const T* hi, u32 flags, f64 lo_attr, f64 hi_attr)
//     Tag f32 f16 bf16 f64 i8 .. i64 u8 .. u64;
//     flags: bit 0 lower bound *lo, bit 1 upper bound *hi (opset 11+ inputs, device scalars),
//            bit 2 lower bound lo_attr, bit 3 upper bound hi_attr (opset 6 attributes).
#include "kiln.cuh"
#include "kiln-cuda-std/elem.cuh"
#include "kiln-cuda-std/vec.cuh"
#include "kiln-cuda-std/math.cuh"

enum UnaryOp {
    RELU = 0, LEAKY_RELU, SIGMOID, TANH, EXP, LOG, SQRT, NEG, ABS, ERF, RECIPROCAL,
    COS, SIN, FLOOR, CEIL, GELU, GELU_TANH, SOFTPLUS, HARD_SIGMOID, ELU, SELU, CELU, HARD_SWISH, MISH,
    THRESHOLDED_RELU, SOFTSIGN, SHRINK, TAN, ASIN, ACOS, ATAN, SINH, COSH, ASINH, ACOSH, ATANH, SIGN, ROUND,
    BITWISE_NOT, SWISH
};

// Same formulas as the CPU reference (`Op::apply`), in the compute type C (float or double).
template <typename C>
__device__ __forceinline__ C unary_apply(C x, unsigned op, C alpha, C beta) {
    switch (op) {
    case RELU: return x > C(0) ? x : C(0);
    case LEAKY_RELU: return x >= C(0) ? x : alpha * x;
    case SIGMOID:
        if (x >= C(0)) return C(1) / (C(1) + kiln_exp(-x));
        else {
            C e = kiln_exp(x);
            return e / (C(1) + e);
        }
    case TANH: return kiln_tanh(x);
    case EXP: return kiln_exp(x);
    case LOG: return kiln_log(x);
    case SQRT: return kiln_sqrt(x);
    case NEG: return -x;
    case ABS: return kiln_abs(x);
    case ERF: return kiln_erf(x);
    case RECIPROCAL: return C(1) / x;
    case COS: return kiln_cos(x);
    case SIN: return kiln_sin(x);
    case FLOOR: return kiln_floor(x);
    case CEIL: return kiln_ceil(x);
    // 0.5·x·(1 + erf(x/√2)) = 0.5·x·erfc(−x/√2), without cancellation for negative x.
    case GELU: return C(0.5) * x * kiln_erfc(x * C(-0.70710678118654752440));
    // 0.5·x·(1 + tanh(u)) = x / (1 + exp(−2u)), likewise.
    case GELU_TANH:
        return x / (C(1) + kiln_exp(C(-2) * (C(0.79788456080286535588) * (x + C(0.044715) * x * x * x))));
    case SOFTPLUS: return x > C(0) ? x + kiln_log1p(kiln_exp(-x)) : kiln_log1p(kiln_exp(x));
    case HARD_SIGMOID: {
        C v = alpha * x + beta;
        return v < C(0) ? C(0) : (v > C(1) ? C(1) : v);
    }
    case ELU: return x >= C(0) ? x : alpha * kiln_expm1(x);
    // alpha: Selu's alpha, beta: its gamma.
    case SELU: return x > C(0) ? beta * x : beta * alpha * kiln_expm1(x);
    case CELU: {
        const C e = alpha * kiln_expm1(x / alpha);
        return (x > C(0) ? x : C(0)) + (e < C(0) ? e : C(0));
    }
    case HARD_SWISH: {
        const C v = x / C(6) + C(0.5);
        return x * (v < C(0) ? C(0) : (v > C(1) ? C(1) : v));
    }
    case MISH: return x * kiln_tanh(x > C(0) ? x + kiln_log1p(kiln_exp(-x)) : kiln_log1p(kiln_exp(x)));
    case THRESHOLDED_RELU: return x > alpha ? x : C(0);
    case SOFTSIGN: return x / (C(1) + kiln_abs(x));
    // alpha: Shrink's bias, beta: its lambd.
    case SHRINK: return x < -beta ? x + alpha : (x > beta ? x - alpha : C(0));
    case TAN: return kiln_tan(x);
    case ASIN: return kiln_asin(x);
    case ACOS: return kiln_acos(x);
    case ATAN: return kiln_atan(x);
    case SINH: return kiln_sinh(x);
    case COSH: return kiln_cosh(x);
    case ASINH: return kiln_asinh(x);
    case ACOSH: return kiln_acosh(x);
    case ATANH: return kiln_atanh(x);
    // NaN and ±0 stay as they are.
    case SIGN: return x > C(0) ? C(1) : (x < C(0) ? C(-1) : x);
    // Halves to even (ONNX Round).
    case ROUND: return kiln_rint(x);
    case SWISH: {
        const C z = alpha * x;
        if (z >= C(0)) return x * (C(1) / (C(1) + kiln_exp(-z)));
        const C e = kiln_exp(z);
        return x * (e / (C(1) + e));
    }
    default: return x;
    }
}

// ---- element types, by the prelude's tag (kiln-cuda-std/elem.cuh): storage S, compute C ----
template <typename Tag>
using Elem = kiln_elem<Tag>;


// y[i] = f(x[i]) over n contiguous elements; 16-byte vector accesses when both pointers allow.
template <typename S, typename F>
__device__ __forceinline__ void map_contiguous(const S* x, S* y, kiln_u64 n, const F& f) {
    const int V = 16 / sizeof(S);
    if (kiln_aligned(x, 16) && kiln_aligned(y, 16)) {
        const kiln_u64 nv = n / V;
        const kiln_vec<S, V>* xv = (const kiln_vec<S, V>*)x;
        kiln_vec<S, V>* yv = (kiln_vec<S, V>*)y;
        KILN_FOR(i, nv) {
            kiln_vec<S, V> a = xv[i];
            kiln_vec<S, V> b;
#pragma unroll
            for (int j = 0; j < V; ++j) b.e[j] = f(a.e[j]);
            yv[i] = b;
        }
        KILN_FOR(i, n - nv * V) {
            const kiln_u64 k = nv * V + i;
            y[k] = f(x[k]);
        }
    } else {
        KILN_FOR(i, n) { y[i] = f(x[i]); }
    }
}

template <typename T>
struct FloatOp {
    unsigned op;
    typename T::C alpha, beta;
    __device__ typename T::S operator()(typename T::S v) const {
        return T::st(unary_apply<typename T::C>(T::ld(v), op, alpha, beta));
    }
};

// FloatOp with the op fixed at compile time: unary_apply's switch folds away, so the elements of
// a thread's vector interleave instead of each taking the switch in turn.
template <typename T, unsigned OP>
struct FixedFloatOp {
    typename T::C alpha, beta;
    __device__ typename T::S operator()(typename T::S v) const {
        return T::st(unary_apply<typename T::C>(T::ld(v), OP, alpha, beta));
    }
};

template <typename T>
__device__ __forceinline__ void unary_float(const typename T::S* x, typename T::S* y, kiln_u64 n, unsigned op,
                                            float alpha, float beta) {
    typedef typename T::C C;
    // The ops models run on large tensors (activations), each with a loop of its own; the rest
    // share one loop that switches per element.
#define KILN_UNARY_FIXED(OP)                                    \
    case OP:                                                    \
        map_contiguous(x, y, n, FixedFloatOp<T, OP>{(C)alpha, (C)beta}); \
        return;
    switch (op) {
        KILN_UNARY_FIXED(RELU)
        KILN_UNARY_FIXED(LEAKY_RELU)
        KILN_UNARY_FIXED(SIGMOID)
        KILN_UNARY_FIXED(TANH)
        KILN_UNARY_FIXED(EXP)
        KILN_UNARY_FIXED(ERF)
        KILN_UNARY_FIXED(GELU)
        KILN_UNARY_FIXED(GELU_TANH)
        KILN_UNARY_FIXED(HARD_SIGMOID)
        KILN_UNARY_FIXED(HARD_SWISH)
        KILN_UNARY_FIXED(SWISH)
    default: break;
    }
#undef KILN_UNARY_FIXED
    FloatOp<T> f;
    f.op = op;
    f.alpha = (C)alpha;
    f.beta = (C)beta;
    map_contiguous(x, y, n, f);
}

template <typename Tag>
__global__ void kiln_unary(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 n, unsigned op,
                           float alpha, float beta) {
    unary_float<Elem<Tag>>(x, y, n, op, alpha, beta);
}

// Integer Relu, Neg, Abs and Sign on signed types, wrapping (Neg/Abs of the minimum stay the
// minimum), and BitwiseNot on any integer type.
template <typename T>
struct IntOp {
    unsigned op;
    __device__ typename T::S operator()(typename T::S v) const {
        kiln_u64 x = T::ld(v);
        bool neg = (long long)x < 0;
        switch (op) {
        case RELU: return neg ? (typename T::S)0 : v;
        case NEG: return T::st(0ull - x);
        case ABS: return neg ? T::st(0ull - x) : v;
        case SIGN: return neg ? T::st(~0ull) : (typename T::S)(x != 0);
        case BITWISE_NOT: return T::st(~x);
        default: return v;
        }
    }
};

template <typename Tag>
__global__ void kiln_unary_int(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 n, unsigned op) {
    IntOp<Elem<Tag>> f;
    f.op = op;
    map_contiguous(x, y, n, f);
}

struct NotOp {
    __device__ unsigned char operator()(unsigned char v) const { return v == 0 ? 1 : 0; }
};

extern "C" __global__ void kiln_not(const unsigned char* x, unsigned char* y, kiln_u64 n) {
    map_contiguous(x, y, n, NotOp());
}

// IsNaN / IsInf: y[i] (bool) = x[i] is NaN (what bit 0), +inf (bit 1) or -inf (bit 2).
template <typename Tag>
__global__ void kiln_classify(const typename Tag::storage* x, unsigned char* y, kiln_u64 n, unsigned what) {
    typedef typename Elem<Tag>::C C;
    KILN_FOR(i, n) {
        const C v = Elem<Tag>::ld(x[i]);
        y[i] = ((what & 1u) && v != v) || ((what & 2u) && v == -kiln_neg_inf<C>()) ||
               ((what & 4u) && v == kiln_neg_inf<C>());
    }
}

// ---- Clip ----

// f64 → integer as Rust's `as`: truncate toward zero, saturate, NaN → 0.
template <typename S, bool SIGNED>
__device__ __forceinline__ S sat_from_f64(double v) {
    const kiln_u64 top = 1ull << (8 * sizeof(S) - 1);  // 2^(bits-1)
    if (v != v) return (S)0;
    if constexpr (SIGNED) {
        if (v <= -(double)top) return (S)top;  // the minimum's bit pattern
        if (v >= (double)top) return (S)(top - 1);
        return (S)(long long)v;
    } else {
        if (v <= 0.0) return (S)0;
        if (v >= 2.0 * (double)top) return (S)~0ull;
        return (S)(kiln_u64)v;
    }
}

// A bound of the CPU reference: the bound tensor's element read as f64, converted back to T.
template <typename T>
__device__ __forceinline__ typename T::S bound_from_f64(double v) {
    if constexpr (T::is_float) {
        return T::st((typename T::C)v);  // v is the f64 of a T value (or of an f32 attribute)
    } else {
        return sat_from_f64<typename T::S, T::is_signed>(v);
    }
}

template <typename T>
__device__ __forceinline__ double to_f64(typename T::S v) {
    if constexpr (T::is_float) {
        return (double)T::ld(v);
    } else if constexpr (T::is_signed) {
        return (double)(long long)T::ld(v);
    } else {
        return (double)T::ld(v);
    }
}

template <typename T>
__device__ __forceinline__ bool less(typename T::S a, typename T::S b) {
    if constexpr (T::is_float) {
        return T::ld(a) < T::ld(b);
    } else {
        return a < b;  // native signed or unsigned comparison
    }
}

template <typename T>
struct ClipOp {
    typename T::S lo, hi;
    bool has_lo, has_hi;
    __device__ typename T::S operator()(typename T::S v) const {
        typename T::S r = v;
        if (has_lo && less<T>(r, lo)) r = lo;
        if (has_hi && less<T>(hi, r)) r = hi;
        return r;
    }
};

template <typename T>
__device__ __forceinline__ void clip(const typename T::S* x, typename T::S* y, kiln_u64 n, const typename T::S* lo,
                                     const typename T::S* hi, unsigned flags, double lo_attr, double hi_attr) {
    ClipOp<T> f;
    f.has_lo = (flags & 5u) != 0;
    f.has_hi = (flags & 10u) != 0;
    f.lo = f.hi = typename T::S(0);
    // The CPU reference reads bounds as f64 and converts them back (exact but for 64-bit
    // integers beyond 2^53, which round): the same here.
    if (flags & 1u) f.lo = bound_from_f64<T>(to_f64<T>(*lo));
    else if (flags & 4u) f.lo = bound_from_f64<T>(lo_attr);
    if (flags & 2u) f.hi = bound_from_f64<T>(to_f64<T>(*hi));
    else if (flags & 8u) f.hi = bound_from_f64<T>(hi_attr);
    map_contiguous(x, y, n, f);
}

template <typename Tag>
__global__ void kiln_clip(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 n,
                          const typename Tag::storage* lo, const typename Tag::storage* hi, unsigned flags,
                          double lo_attr, double hi_attr) {
    clip<Elem<Tag>>(x, y, n, lo, hi, flags, lo_attr, hi_attr);
}

// SwiGlu (shim/src/swiglu.rs): y[r·N + c] = SiLU(g)·u with g = gate[r·ld + c] and
// u = up[r·ld + up_off + c]; n = rows·N outputs. Packed [..., 2N]: gate = up, ld = 2N,
// up_off = N; separate inputs: ld = N, up_off = 0. Computed in T::C (f32, f64 for f64).
//   kiln_swiglu<Tag>(const T* gate, const T* up, T* y, u64 n, u64 N, u64 ld, u64 up_off)   Tag f32 f16 bf16 f64
template <typename T>
__device__ __forceinline__ void swiglu(const typename T::S* gate, const typename T::S* up, typename T::S* y, kiln_u64 n,
                                       kiln_u64 N, kiln_u64 ld, kiln_u64 up_off) {
    typedef typename T::C C;
    KILN_FOR(i, n) {
        const kiln_u64 r = i / N, c = i - r * N;
        const C g = T::ld(gate[r * ld + c]);
        const C u = T::ld(up[r * ld + up_off + c]);
        y[i] = T::st(g * unary_apply<C>(g, SIGMOID, C(0), C(0)) * u);
    }
}

template <typename Tag>
__global__ void kiln_swiglu(const typename Tag::storage* gate, const typename Tag::storage* up,
                            typename Tag::storage* y, kiln_u64 n, kiln_u64 N, kiln_u64 ld, kiln_u64 up_off) {
    swiglu<Elem<Tag>>(gate, up, y, n, N, ld, up_off);
}

// kiln-binary CUDA kernels: elementwise ops with ONNX multidirectional broadcasting.
// Compiled by NVRTC for the GPU present; op codes match shim/src/lib.rs (`ArithOp`, `CmpOp`,
// `LogicOp`).
//
// Broadcasting: the output has `rank` (1..8) dims d0..d7 (row-major, d0 outermost; unused
// trailing dims are 1), and every input has element strides s?0..s?7 along those dims (0 on
// broadcast axes, unused ones 0). Output element i is at its row-major position; an input's
// element is at sum_k coord_k * s_k. The shim collapses adjacent dims where it can, so
// same-shape contiguous inputs arrive as rank 1 with strides 1 (the fast path, with 16-byte
// vector accesses for two same-type inputs when the pointers allow).
//
// Entry points (argument order is what shim/src/lib.rs `dispatch` passes):
//   kiln_binary<Tag>(const T* a, const T* b, T* y, u64 n, u32 op, u32 rank, DIMS, STRIDES(a), STRIDES(b))
//   kiln_compare<Tag>(const T* a, const T* b, u8* y, u64 n, u32 op, u32 rank, DIMS, STRIDES(a), STRIDES(b))
//   kiln_logic(const u8* a, const u8* b, u8* y, u64 n, u32 op, u32 rank, DIMS, STRIDES(a), STRIDES(b))
//   kiln_where<Size>(const u8* c, const T* x, const T* z, T* y, u64 n, u32 rank, DIMS,
//                    STRIDES(c), STRIDES(x), STRIDES(z))     (T by element size, Size 1, 2, 4 or 8)
//   kiln_nary<Tag>(T* y, u64 n, u32 op, u32 count, u32 mean, u32 rank, DIMS,
//                  const T* x0, .., const T* x7, STRIDES(x0) .. STRIDES(x7))
//     y = fold of op over x0..x{count-1} (count 1..8), divided by `mean` when it is not 0.
//   kiln_pow(const void* a, const void* b, void* y, u64 n, u32 a_dtype, u32 b_dtype, u32 rank,
//            DIMS, STRIDES(a), STRIDES(b))      Pow of mixed dtypes (ONNX dtype codes); y has a's
// with DIMS = u64 d0..d7 and STRIDES(p) = u64 p0..p7; Tag the prelude's tag of a numeric dtype
// (kiln_tag_f32 f16 bf16 f64 i8 i16 i32 i64 u8 u16 u32 u64), T = Tag::storage. kernel.toml
// instantiates the templates by name expressions (manifest schema 6), which the shim spells with
// DType::cuda_tag; kiln_logic and kiln_pow stay extern "C".
#include "kiln.cuh"
#include "kiln-cuda-std/elem.cuh"
#include "kiln-cuda-std/vec.cuh"
#include "kiln-cuda-std/round.cuh"
#include "kiln-cuda-std/math.cuh"

enum ArithOp { ADD = 0, SUB, MUL, DIV, POW, FMOD, MOD, MAX, MIN, BIT_AND, BIT_OR, BIT_XOR, SHIFT_LEFT, SHIFT_RIGHT, PRELU };
enum CmpOp { EQ = 0, LT, GT, LE, GE };
enum LogicOp { AND = 0, OR, XOR, LEQ };

// ---- element types, by the prelude's tag (kiln-cuda-std/elem.cuh): storage S, compute C ----
template <typename Tag>
using Elem = kiln_elem<Tag>;


template <typename C>
__device__ __forceinline__ C float_arith(C a, C b, unsigned op) {
    switch (op) {
    case ADD: return a + b;
    case SUB: return a - b;
    case MUL: return a * b;
    case DIV: return a / b;
    case POW: return kiln_pow(a, b);
    case FMOD:
    case MOD: return kiln_fmod(a, b);
    case MAX:
        if (a != a) return a;
        if (b != b) return b;
        return a > b ? a : b;
    case MIN:
        if (a != a) return a;
        if (b != b) return b;
        return a < b ? a : b;
    case PRELU: return a < C(0) ? a * b : a;
    default: return a;
    }
}

__device__ __forceinline__ bool int_lt(bool sg, kiln_u64 a, kiln_u64 b) {
    return sg ? (long long)a < (long long)b : a < b;
}

// `base ^ exp` wrapping; a negative (signed) exponent gives the truncated quotient (0 unless
// |base| = 1; the CPU reference refuses 0 to a negative power, which gives 0 here).
__device__ __forceinline__ kiln_u64 int_pow(kiln_u64 base, bool base_signed, kiln_u64 e, bool exp_signed) {
    if (exp_signed && (long long)e < 0) {
        if (base == 1) return 1;
        if (base_signed && (long long)base == -1) return (e & 1) ? ~0ull : 1;
        return 0;
    }
    kiln_u64 r = 1;
    while (e) {
        if (e & 1) r *= base;
        base *= base;
        e >>= 1;
    }
    return r;
}

// Integer ops of the CPU reference (`int_op`): division and modulo by 0 give 0; Div truncates;
// MOD takes the sign of the divisor, FMOD of the dividend.
__device__ __forceinline__ kiln_u64 int_arith(bool sg, kiln_u64 a, kiln_u64 b, unsigned op) {
    switch (op) {
    case ADD: return a + b;
    case SUB: return a - b;
    case MUL: return a * b;
    case DIV:
        if (b == 0) return 0;
        if (!sg) return a / b;
        if ((long long)b == -1) return 0ull - a;
        return (kiln_u64)((long long)a / (long long)b);
    case POW: return int_pow(a, sg, b, sg);
    case FMOD:
    case MOD: {
        if (b == 0) return 0;
        if (!sg) return a % b;
        if ((long long)b == -1) return 0;
        long long r = (long long)a % (long long)b;
        if (op == MOD && r != 0 && ((r < 0) != ((long long)b < 0))) r += (long long)b;
        return (kiln_u64)r;
    }
    case MAX: return int_lt(sg, a, b) ? b : a;
    case MIN: return int_lt(sg, b, a) ? b : a;
    case PRELU: return sg && (long long)a < 0 ? a * b : a;
    case BIT_AND: return a & b;
    case BIT_OR: return a | b;
    case BIT_XOR: return a ^ b;
    // Unsigned only (zero-extended a); bits past the element's width are dropped when stored.
    case SHIFT_LEFT: return b < 64 ? a << b : 0;
    case SHIFT_RIGHT: return b < 64 ? a >> b : 0;
    default: return a;
    }
}

template <typename T>
__device__ __forceinline__ typename T::C arith(typename T::C a, typename T::C b, unsigned op) {
    if constexpr (T::is_float) {
        return float_arith<typename T::C>(a, b, op);
    } else {
        return int_arith(T::is_signed, a, b, op);
    }
}

template <typename T>
struct Arith {
    unsigned op;
    __device__ typename T::S operator()(typename T::S a, typename T::S b) const {
        return T::st(arith<T>(T::ld(a), T::ld(b), op));
    }
};

template <typename C>
__device__ __forceinline__ bool cmp(C a, C b, unsigned op) {
    switch (op) {
    case EQ: return a == b;
    case LT: return a < b;
    case GT: return a > b;
    case LE: return a <= b;
    default: return a >= b;
    }
}

template <typename T>
struct Compare {
    unsigned op;
    __device__ unsigned char operator()(typename T::S a, typename T::S b) const {
        if constexpr (T::is_float) {
            return cmp<typename T::C>(T::ld(a), T::ld(b), op);
        } else if constexpr (T::is_signed) {
            return cmp<long long>((long long)T::ld(a), (long long)T::ld(b), op);
        } else {
            return cmp<kiln_u64>(T::ld(a), T::ld(b), op);
        }
    }
};

struct Logic {
    unsigned op;
    __device__ unsigned char operator()(unsigned char a, unsigned char b) const {
        bool p = a != 0, q = b != 0;
        switch (op) {
        case AND: return p && q;
        case OR: return p || q;
        case XOR: return p != q;
        default: return p == q;
        }
    }
};

// ---- broadcast indexing ----

#define KILN_DIMS kiln_u64 d0, kiln_u64 d1, kiln_u64 d2, kiln_u64 d3, kiln_u64 d4, kiln_u64 d5, kiln_u64 d6, kiln_u64 d7
#define KILN_STRIDES(p)                                                                                        \
    kiln_u64 p##0, kiln_u64 p##1, kiln_u64 p##2, kiln_u64 p##3, kiln_u64 p##4, kiln_u64 p##5, kiln_u64 p##6, \
        kiln_u64 p##7
#define KILN_ARR(p) {p##0, p##1, p##2, p##3, p##4, p##5, p##6, p##7}

// Element offsets of output element i in NIN inputs (I: 32-bit when the output fits).
template <int NIN, typename I>
__device__ __forceinline__ void bcast_offsets(I i, unsigned rank, const kiln_u64 (&d)[8], const kiln_u64 (&s)[NIN][8],
                                              kiln_u64 (&off)[NIN]) {
    I o[NIN];
#pragma unroll
    for (int j = 0; j < NIN; ++j) o[j] = 0;
#pragma unroll
    for (int k = 7; k >= 1; --k) {
        if (k < (int)rank) {
            const I dk = (I)d[k];
            const I c = i % dk;
            i /= dk;
#pragma unroll
            for (int j = 0; j < NIN; ++j) o[j] += c * (I)s[j][k];
        }
    }
#pragma unroll
    for (int j = 0; j < NIN; ++j) off[j] = (kiln_u64)(o[j] + i * (I)s[j][0]);
}

// Calls f(i, off) for every output element i, off[j] the element offset in input j.
template <int NIN, typename F>
__device__ __forceinline__ void for_each(kiln_u64 n, unsigned rank, const kiln_u64 (&d)[8],
                                         const kiln_u64 (&s)[NIN][8], F& f) {
    bool contiguous = rank == 1;
#pragma unroll
    for (int j = 0; j < NIN; ++j) contiguous = contiguous && s[j][0] == 1;
    if (contiguous) {
        KILN_FOR(i, n) {
            kiln_u64 off[NIN];
#pragma unroll
            for (int j = 0; j < NIN; ++j) off[j] = i;
            f(i, off);
        }
    } else if (n <= 0xffffffffull) {
        KILN_FOR(i, n) {
            kiln_u64 off[NIN];
            bcast_offsets<NIN, unsigned>((unsigned)i, rank, d, s, off);
            f(i, off);
        }
    } else {
        KILN_FOR(i, n) {
            kiln_u64 off[NIN];
            bcast_offsets<NIN, kiln_u64>(i, rank, d, s, off);
            f(i, off);
        }
    }
}


template <typename In, typename Out, typename F>
struct Apply2 {
    const In* a;
    const In* b;
    Out* y;
    F f;
    __device__ void operator()(kiln_u64 i, const kiln_u64 (&off)[2]) const { y[i] = f(a[off[0]], b[off[1]]); }
};

// y = f(a, b) with broadcasting; 16-byte vector accesses on the contiguous fast path.
template <typename In, typename Out, typename F>
__device__ __forceinline__ void ew2(const In* a, const In* b, Out* y, kiln_u64 n, unsigned rank, const kiln_u64 (&d)[8],
                                    const kiln_u64 (&s)[2][8], const F& f) {
    const int V = 16 / sizeof(In);
    if (rank == 1 && s[0][0] == 1 && s[1][0] == 1 && kiln_aligned(a, 16) && kiln_aligned(b, 16) &&
        kiln_aligned(y, sizeof(Out) * V)) {
        const kiln_u64 nv = n / V;
        const kiln_vec<In, V>* av = (const kiln_vec<In, V>*)a;
        const kiln_vec<In, V>* bv = (const kiln_vec<In, V>*)b;
        kiln_vec<Out, V>* yv = (kiln_vec<Out, V>*)y;
        KILN_FOR(i, nv) {
            const kiln_vec<In, V> p = av[i];
            const kiln_vec<In, V> q = bv[i];
            kiln_vec<Out, V> r;
#pragma unroll
            for (int j = 0; j < V; ++j) r.e[j] = f(p.e[j], q.e[j]);
            yv[i] = r;
        }
        KILN_FOR(i, n - nv * V) {
            const kiln_u64 k = nv * V + i;
            y[k] = f(a[k], b[k]);
        }
        return;
    }
    Apply2<In, Out, F> g{a, b, y, f};
    for_each<2>(n, rank, d, s, g);
}

// ---- entry points ----

template <typename Tag>
__global__ void kiln_binary(const typename Tag::storage* a, const typename Tag::storage* b, typename Tag::storage* y,
                            kiln_u64 n, unsigned op, unsigned rank, KILN_DIMS, KILN_STRIDES(sa), KILN_STRIDES(sb)) {
    const kiln_u64 d[8] = KILN_ARR(d);
    const kiln_u64 s[2][8] = {KILN_ARR(sa), KILN_ARR(sb)};
    Arith<Elem<Tag>> f{op};
    ew2(a, b, y, n, rank, d, s, f);
}

template <typename Tag>
__global__ void kiln_compare(const typename Tag::storage* a, const typename Tag::storage* b, unsigned char* y,
                             kiln_u64 n, unsigned op, unsigned rank, KILN_DIMS, KILN_STRIDES(sa), KILN_STRIDES(sb)) {
    const kiln_u64 d[8] = KILN_ARR(d);
    const kiln_u64 s[2][8] = {KILN_ARR(sa), KILN_ARR(sb)};
    Compare<Elem<Tag>> f{op};
    ew2(a, b, y, n, rank, d, s, f);
}

extern "C" __global__ void kiln_logic(const unsigned char* a, const unsigned char* b, unsigned char* y, kiln_u64 n,
                                      unsigned op, unsigned rank, KILN_DIMS, KILN_STRIDES(sa), KILN_STRIDES(sb)) {
    const kiln_u64 d[8] = KILN_ARR(d);
    const kiln_u64 s[2][8] = {KILN_ARR(sa), KILN_ARR(sb)};
    Logic f{op};
    ew2(a, b, y, n, rank, d, s, f);
}

// Where: y = c ? x : z, elements moved as bits of their size.
template <typename E>
struct WhereF {
    const unsigned char* c;
    const E* x;
    const E* z;
    E* y;
    __device__ void operator()(kiln_u64 i, const kiln_u64 (&off)[3]) const { y[i] = c[off[0]] ? x[off[1]] : z[off[2]]; }
};

// The unsigned integer type of `Size` bytes, which Where moves elements as.
template <int Size> struct Bits;
template <> struct Bits<1> { typedef unsigned char E; };
template <> struct Bits<2> { typedef unsigned short E; };
template <> struct Bits<4> { typedef unsigned E; };
template <> struct Bits<8> { typedef kiln_u64 E; };

template <int Size>
__global__ void kiln_where(const unsigned char* c, const typename Bits<Size>::E* x, const typename Bits<Size>::E* z,
                           typename Bits<Size>::E* y, kiln_u64 n, unsigned rank, KILN_DIMS, KILN_STRIDES(sc),
                           KILN_STRIDES(sx), KILN_STRIDES(sz)) {
    const kiln_u64 d[8] = KILN_ARR(d);
    const kiln_u64 s[3][8] = {KILN_ARR(sc), KILN_ARR(sx), KILN_ARR(sz)};
    WhereF<typename Bits<Size>::E> f{c, x, z, y};
    for_each<3>(n, rank, d, s, f);
}

// The fold of Sum/Mean (ADD), Max and Min: `arith` without the ops that variadic ops lack.
template <typename T>
__device__ __forceinline__ typename T::C nary_combine(typename T::C a, typename T::C b, unsigned op) {
    if constexpr (T::is_float) {
        if (op == ADD) return a + b;
        if (a != a) return a;
        if (b != b) return b;
        return op == MAX ? (a > b ? a : b) : (a < b ? a : b);
    } else {
        if (op == MAX) return int_lt(T::is_signed, a, b) ? b : a;
        return int_lt(T::is_signed, b, a) ? b : a;  // MIN (ADD is float-only)
    }
}

// Max, Min, Sum, Mean over up to 8 inputs (the shim chains launches for more, passing y as x0).
template <typename T>
struct NaryF {
    const typename T::S* x[8];
    typename T::S* y;
    unsigned op, count, mean;
    __device__ void operator()(kiln_u64 i, const kiln_u64 (&off)[8]) const {
        typename T::C acc = T::ld(x[0][off[0]]);
#pragma unroll
        for (int j = 1; j < 8; ++j) {
            if (j < (int)count) acc = nary_combine<T>(acc, T::ld(x[j][off[j]]), op);
        }
        if constexpr (T::is_float) {
            if (mean) acc = acc / (typename T::C)mean;
        }
        y[i] = T::st(acc);
    }
};

template <typename Tag>
__global__ void kiln_nary(typename Tag::storage* y, kiln_u64 n, unsigned op, unsigned count, unsigned mean,
                          unsigned rank, KILN_DIMS, const typename Tag::storage* x0, const typename Tag::storage* x1,
                          const typename Tag::storage* x2, const typename Tag::storage* x3,
                          const typename Tag::storage* x4, const typename Tag::storage* x5,
                          const typename Tag::storage* x6, const typename Tag::storage* x7, KILN_STRIDES(s0),
                          KILN_STRIDES(s1), KILN_STRIDES(s2), KILN_STRIDES(s3), KILN_STRIDES(s4), KILN_STRIDES(s5),
                          KILN_STRIDES(s6), KILN_STRIDES(s7)) {
    const kiln_u64 d[8] = KILN_ARR(d);
    const kiln_u64 s[8][8] = {KILN_ARR(s0), KILN_ARR(s1), KILN_ARR(s2), KILN_ARR(s3),
                              KILN_ARR(s4), KILN_ARR(s5), KILN_ARR(s6), KILN_ARR(s7)};
    NaryF<Elem<Tag>> f{{x0, x1, x2, x3, x4, x5, x6, x7}, y, op, count, mean};
    for_each<8>(n, rank, d, s, f);
}

// ---- Pow of mixed dtypes: elements loaded by ONNX dtype code ----

enum DTypeCode { DT_F32 = 1, DT_U8 = 2, DT_I8 = 3, DT_U16 = 4, DT_I16 = 5, DT_I32 = 6, DT_I64 = 7, DT_F16 = 10,
                 DT_F64 = 11, DT_U32 = 12, DT_U64 = 13, DT_BF16 = 16 };

__device__ __forceinline__ bool dt_float(unsigned dt) {
    return dt == DT_F32 || dt == DT_F16 || dt == DT_BF16 || dt == DT_F64;
}
__device__ __forceinline__ bool dt_unsigned(unsigned dt) {
    return dt == DT_U8 || dt == DT_U16 || dt == DT_U32 || dt == DT_U64;
}

__device__ __forceinline__ double load_f(const void* p, kiln_u64 i, unsigned dt) {
    switch (dt) {
    case DT_F32: return ((const float*)p)[i];
    case DT_F16: return kiln_f16_to_f32(((const kiln_f16*)p)[i]);
    case DT_BF16: return kiln_bf16_to_f32(((const kiln_bf16*)p)[i]);
    default: return ((const double*)p)[i];
    }
}

// Integers sign- or zero-extended to 64 bits.
__device__ __forceinline__ kiln_u64 load_i(const void* p, kiln_u64 i, unsigned dt) {
    switch (dt) {
    case DT_I8: return (kiln_u64)((const signed char*)p)[i];
    case DT_I16: return (kiln_u64)((const short*)p)[i];
    case DT_I32: return (kiln_u64)((const int*)p)[i];
    case DT_I64: return (kiln_u64)((const long long*)p)[i];
    case DT_U8: return ((const unsigned char*)p)[i];
    case DT_U16: return ((const unsigned short*)p)[i];
    case DT_U32: return ((const unsigned*)p)[i];
    default: return ((const kiln_u64*)p)[i];
    }
}


__device__ __forceinline__ void store_f(void* p, kiln_u64 i, unsigned dt, double v) {
    switch (dt) {
    case DT_F32: ((float*)p)[i] = (float)v; break;
    case DT_F16: ((kiln_f16*)p)[i] = kiln_f32_to_f16(kiln_f32_round_odd(v)); break;
    case DT_BF16: ((kiln_bf16*)p)[i] = kiln_f32_to_bf16(kiln_f32_round_odd(v)); break;
    default: ((double*)p)[i] = v; break;
    }
}

__device__ __forceinline__ void store_i(void* p, kiln_u64 i, unsigned dt, kiln_u64 v) {
    switch (dt) {
    case DT_I8:
    case DT_U8: ((unsigned char*)p)[i] = (unsigned char)v; break;
    case DT_I16:
    case DT_U16: ((unsigned short*)p)[i] = (unsigned short)v; break;
    case DT_I32:
    case DT_U32: ((unsigned*)p)[i] = (unsigned)v; break;
    default: ((kiln_u64*)p)[i] = v; break;
    }
}

// f64 → i64 (or u64 for a uint64 target) as Rust's `as`: truncate, saturate, NaN → 0.
__device__ __forceinline__ kiln_u64 f64_to_int(double v, bool to_u64) {
    if (v != v) return 0;
    if (to_u64) {
        if (v <= 0.0) return 0;
        if (v >= 18446744073709551616.0) return ~0ull;
        return (kiln_u64)v;
    }
    if (v <= -9223372036854775808.0) return 1ull << 63;
    if (v >= 9223372036854775808.0) return (1ull << 63) - 1;
    return (kiln_u64)(long long)v;
}

struct PowF {
    const void* a;
    const void* b;
    void* y;
    unsigned ta, tb;
    __device__ void operator()(kiln_u64 i, const kiln_u64 (&off)[2]) const {
        const bool af = dt_float(ta), bf = dt_float(tb);
        const bool au = dt_unsigned(ta), bu = dt_unsigned(tb);
        if (af) {
            const double e = bf ? load_f(b, off[1], tb)
                                : (bu ? (double)load_i(b, off[1], tb) : (double)(long long)load_i(b, off[1], tb));
            store_f(y, i, ta, pow(load_f(a, off[0], ta), e));
        } else if (bf) {
            const kiln_u64 p = load_i(a, off[0], ta);
            const double base = au ? (double)p : (double)(long long)p;
            const double e = load_f(b, off[1], tb);
            double r = pow(base, e);
            // An integer to a natural power is an integer: keep pow's last-ulp error from
            // truncating it to the one below (the CPU's libm is exact there).
            if (e >= 0.0 && e == floor(e) && fabs(r) < 9007199254740992.0) r = rint(r);
            store_i(y, i, ta, f64_to_int(r, ta == DT_U64));
        } else {
            store_i(y, i, ta, int_pow(load_i(a, off[0], ta), !au, load_i(b, off[1], tb), !bu));
        }
    }
};

extern "C" __global__ void kiln_pow(const void* a, const void* b, void* y, kiln_u64 n, unsigned a_dtype,
                                    unsigned b_dtype, unsigned rank, KILN_DIMS, KILN_STRIDES(sa), KILN_STRIDES(sb)) {
    const kiln_u64 d[8] = KILN_ARR(d);
    const kiln_u64 s[2][8] = {KILN_ARR(sa), KILN_ARR(sb)};
    PowF f{a, b, y, a_dtype, b_dtype};
    for_each<2>(n, rank, d, s, f);
}

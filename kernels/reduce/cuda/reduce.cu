// kiln-reduce CUDA kernels: ReduceSum / ReduceMean / ReduceMax (op codes match `Kind::code` in
// shim/src/lib.rs). Floating-point values accumulate in f32 (f64 for float64 input), integers in
// i64 with wrapping arithmetic; Max propagates NaN; an empty Mean is 0/0, an empty Max the
// dtype's lowest value.
//
// ReduceMin, ReduceProd, ReduceSumSquare, ReduceL1, ReduceL2, ReduceLogSum and ReduceLogSumExp
// take the same kernels: Min as Max mirrored; Prod multiplies (from 1); SumSquare, L1 and L2 sum
// v², |v| and v² (L2 then a square root), LogSum the logarithm of the sum; LogSumExp first finds
// the maximum m, then sums exp(v − m) and gives m + log of it.
//
// - kiln_reduce_rows<Tag>: x is [rows, count] contiguous; blockDim.x threads per row (a multiple
//   of 32), blockDim.y rows per block; warp reductions, then shared memory across the warps.
// - kiln_reduce_any<Tag>: any axis set: one output per threadIdx.x (consecutive outputs are
//   consecutive threads), threadIdx.y splits the reduced elements; kept and reduced dimensions
//   with their input strides (elements) are passed as scalars, at most 8 of each.
// - kiln_reduce_copy: byte copy (noop_with_empty_axes).
//
// Tag is the prelude's tag of x's dtype (kiln_tag_f32 f16 bf16 f64 i8 i32 i64 u8 u32 u64; bool
// reduces as its bytes, with kiln_tag_u8). kernel.toml lists the instantiations (name
// expressions, manifest schema 6), which NVRTC lowers; the shim names them with DType::cuda_tag.
#include "kiln.cuh"
#include "kiln-cuda-std/elem.cuh"
#include "kiln-cuda-std/reduce.cuh"
#include "kiln-cuda-std/math.cuh"
#include "kiln-cuda-std/vec.cuh"
#include "kiln-cuda-std/cluster.cuh"

// Op codes (the shim's `Kind`).
#define RED_SUM 0u
#define RED_MEAN 1u
#define RED_MAX 2u
#define RED_MIN 3u
#define RED_PROD 4u
#define RED_SUM_SQUARE 5u
#define RED_L1 6u
#define RED_L2 7u
#define RED_LOG_SUM 8u
#define RED_LOG_SUM_EXP 9u

// Per dtype tag: S the sum (and product) accumulator, M the max and min accumulator, ld / st
// between the storage type and them, lowest / highest the max's / min's start. Floats take kiln-cuda-std's kiln_elem (S = M = its C: f32,
// f64 for float64).
template <typename Tag, bool FLOAT = kiln_elem<Tag>::is_float>
struct RT : kiln_elem<Tag> {
    typedef typename kiln_elem<Tag>::C S;
    typedef S M;
    static __device__ __forceinline__ M lowest() { return kiln_neg_inf<M>(); }
    static __device__ __forceinline__ M highest() { return -kiln_neg_inf<M>(); }
};
// Integers: sums and products in i64 (wrapping), maxima and minima in their own signedness.
#define RED_INT_TRAITS(TAG, MT, LOW, HIGH)                                                \
    template <> struct RT<TAG, false> {                                                  \
        typedef TAG::storage T;                                                          \
        typedef long long S; typedef MT M;                                               \
        static __device__ __forceinline__ MT ld(T v) { return (MT)v; }                   \
        static __device__ __forceinline__ T st(MT v) { return (T)v; }                    \
        static __device__ __forceinline__ MT lowest() { return (MT)(LOW); }              \
        static __device__ __forceinline__ MT highest() { return (MT)(HIGH); }            \
    };
RED_INT_TRAITS(kiln_tag_i8, int, -128, 127)
RED_INT_TRAITS(kiln_tag_i32, int, (-2147483647 - 1), 2147483647)
RED_INT_TRAITS(kiln_tag_i64, long long, (-9223372036854775807ll - 1), 9223372036854775807ll)
RED_INT_TRAITS(kiln_tag_u8, unsigned, 0u, 255u)
RED_INT_TRAITS(kiln_tag_u32, unsigned, 0u, 4294967295u)
RED_INT_TRAITS(kiln_tag_u64, unsigned long long, 0ull, 18446744073709551615ull)

// Element → sum accumulator (integers sign- or zero-extend to i64).
template <typename Tag>
__device__ __forceinline__ typename RT<Tag>::S to_sum(typename Tag::storage v) {
    return (typename RT<Tag>::S)RT<Tag>::ld(v);
}

__device__ __forceinline__ float red_add(float a, float b) { return a + b; }
__device__ __forceinline__ double red_add(double a, double b) { return a + b; }
__device__ __forceinline__ long long red_add(long long a, long long b) {
    return (long long)((unsigned long long)a + (unsigned long long)b);  // wraps
}
__device__ __forceinline__ float red_mul(float a, float b) { return a * b; }
__device__ __forceinline__ double red_mul(double a, double b) { return a * b; }
__device__ __forceinline__ long long red_mul(long long a, long long b) {
    return (long long)((unsigned long long)a * (unsigned long long)b);  // wraps
}
__device__ __forceinline__ float red_abs(float a) { return kiln_abs(a); }
__device__ __forceinline__ double red_abs(double a) { return kiln_abs(a); }
__device__ __forceinline__ long long red_abs(long long a) { return a < 0 ? (long long)(0ull - (unsigned long long)a) : a; }
// Min that propagates NaN (the mirror of kiln_max_nan).
template <typename A>
__device__ __forceinline__ A red_min(A a, A b) {
    if (a != a) return a;
    return (b != b || b < a) ? b : a;
}
struct SumOp { template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return red_add(a, b); } };
struct MulOp { template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return red_mul(a, b); } };
struct MinOp { template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return red_min(a, b); } };

// The term a sum-like op adds for element v: v (Sum, Mean, LogSum), v² (SumSquare, L2), |v| (L1).
template <typename Tag>
__device__ __forceinline__ typename RT<Tag>::S red_term(typename Tag::storage v, unsigned op) {
    const typename RT<Tag>::S s = to_sum<Tag>(v);
    if (op == RED_SUM_SQUARE || op == RED_L2) return red_mul(s, s);
    return op == RED_L1 ? red_abs(s) : s;
}

// LogSumExp (floats): m + log(Σ exp(v − m)) with m the maximum; an infinite or NaN maximum is
// the result itself (all -inf, or empty: -inf). Integers do not take it (the shim refuses them).
template <typename Tag, bool FLOAT = kiln_elem<Tag>::is_float>
struct RedLse {
    typedef typename RT<Tag>::S S;
    typedef typename RT<Tag>::M M;
    static __device__ __forceinline__ S term(typename Tag::storage v, M m) { return kiln_exp(RT<Tag>::ld(v) - m); }
    static __device__ __forceinline__ typename Tag::storage fin(M m, S s) {
        return RT<Tag>::st(m - m != M(0) ? m : m + kiln_log(s));
    }
};
template <typename Tag>
struct RedLse<Tag, false> {
    static __device__ __forceinline__ long long term(typename Tag::storage, typename RT<Tag>::M) { return 0; }
    static __device__ __forceinline__ typename Tag::storage fin(typename RT<Tag>::M m, long long) {
        return RT<Tag>::st(m);
    }
};

// Reduces v over the blockDim.x threads of this row (threadIdx.y picks the row); every thread
// of the row gets the result. Called by every thread of the block when blockDim.x > 32.
template <typename A, typename Op> __device__ __forceinline__ A red_row(A v, Op op) {
    v = kiln_warp_reduce(v, op);
    const unsigned wpr = blockDim.x >> 5;
    if (wpr == 1) return v;
    __shared__ A buf[32];
    __syncthreads();
    if ((threadIdx.x & 31) == 0) buf[threadIdx.y * wpr + (threadIdx.x >> 5)] = v;
    __syncthreads();
    A r = buf[threadIdx.y * wpr];
    for (unsigned i = 1; i < wpr; ++i) r = op(r, buf[threadIdx.y * wpr + i]);
    return r;
}

// A sum-like op's output value: the sum (or product), for Mean the sum divided by count
// (integers: the sum in the element type, divided in f64, truncated back), for L2 its square
// root, for LogSum its logarithm (floats only).
__device__ __forceinline__ float red_mean(float s, kiln_u64 count) { return s / (float)count; }
__device__ __forceinline__ double red_mean(double s, kiln_u64 count) { return s / (double)count; }
template <typename Tag, bool FLOAT = kiln_elem<Tag>::is_float>
struct RedFin {
    static __device__ __forceinline__ typename Tag::storage fin(typename RT<Tag>::S s, unsigned op, kiln_u64 count) {
        if (op == RED_L2) return RT<Tag>::st(kiln_sqrt(s));
        if (op == RED_LOG_SUM) return RT<Tag>::st(kiln_log(s));
        return RT<Tag>::st(op == RED_MEAN ? red_mean(s, count) : s);
    }
};
template <typename Tag>
struct RedFin<Tag, false> {
    typedef typename Tag::storage T;
    static __device__ __forceinline__ T fin(long long s, unsigned op, kiln_u64 count) {
        T t = (T)s;
        return op == RED_MEAN ? (T)((double)t / (double)count) : t;
    }
};

template <typename Tag, typename T = typename Tag::storage>
__device__ void reduce_rows(const T* x, T* y, kiln_u64 rows, kiln_u64 count, unsigned op) {
    typedef typename RT<Tag>::S S;
    typedef typename RT<Tag>::M M;
    for (kiln_u64 row = (kiln_u64)blockIdx.x * blockDim.y + threadIdx.y;; row += (kiln_u64)gridDim.x * blockDim.y) {
        // The loop's exit is uniform per row group (a warp, or the block when blockDim.y == 1).
        if (row >= rows) break;
        const T* xr = x + row * count;
        if (op == RED_MAX || op == RED_MIN || op == RED_LOG_SUM_EXP) {
            const bool mx = op != RED_MIN;
            M m = mx ? RT<Tag>::lowest() : RT<Tag>::highest();
            for (kiln_u64 j = threadIdx.x; j < count; j += blockDim.x) {
                const M v = RT<Tag>::ld(xr[j]);
                m = mx ? kiln_max_nan(m, v) : red_min(m, v);
            }
            m = mx ? red_row(m, kiln_op_max()) : red_row(m, MinOp());
            if (op != RED_LOG_SUM_EXP) {
                if (threadIdx.x == 0) y[row] = RT<Tag>::st(m);
                continue;
            }
            S s = 0;
            for (kiln_u64 j = threadIdx.x; j < count; j += blockDim.x) s = red_add(s, RedLse<Tag>::term(xr[j], m));
            s = red_row(s, SumOp());
            if (threadIdx.x == 0) y[row] = RedLse<Tag>::fin(m, s);
        } else if (op == RED_PROD) {
            S s = 1;
            for (kiln_u64 j = threadIdx.x; j < count; j += blockDim.x) s = red_mul(s, to_sum<Tag>(xr[j]));
            s = red_row(s, MulOp());
            if (threadIdx.x == 0) y[row] = RedFin<Tag>::fin(s, op, count);
        } else {
            S s = 0;
            for (kiln_u64 j = threadIdx.x; j < count; j += blockDim.x) s = red_add(s, red_term<Tag>(xr[j], op));
            s = red_row(s, SumOp());
            if (threadIdx.x == 0) y[row] = RedFin<Tag>::fin(s, op, count);
        }
    }
}

struct RedGeom {
    unsigned kr, rr;
    kiln_u64 kd[8], ks[8], rd[8], rs[8];
};

// Offset of the count-index j within the reduced dimensions (row-major over them).
__device__ __forceinline__ kiln_u64 red_offset(const RedGeom& g, kiln_u64 j) {
    kiln_u64 off = 0;
    for (int d = (int)g.rr - 1; d >= 0; --d) {
        kiln_u64 q = j / g.rd[d];
        off += (j - q * g.rd[d]) * g.rs[d];
        j = q;
    }
    return off;
}

template <typename Tag, typename T = typename Tag::storage>
__device__ void reduce_any(const T* x, T* y, kiln_u64 n_out, kiln_u64 count, unsigned op, const RedGeom& g) {
    typedef typename RT<Tag>::S S;
    typedef typename RT<Tag>::M M;
    __shared__ S sbuf[32 * 8];
    __shared__ M mbuf[32 * 8];
    const kiln_u64 step = (kiln_u64)gridDim.x * blockDim.x;
    // Every thread of the block runs the same number of iterations (syncthreads inside).
    for (kiln_u64 base = (kiln_u64)blockIdx.x * blockDim.x; base < n_out; base += step) {
        kiln_u64 o = base + threadIdx.x;
        bool live = o < n_out;
        kiln_u64 off = 0;
        if (live) {
            kiln_u64 r = o;
            for (int d = (int)g.kr - 1; d >= 0; --d) {
                kiln_u64 q = r / g.kd[d];
                off += (r - q * g.kd[d]) * g.ks[d];
                r = q;
            }
        }
        const unsigned slot = threadIdx.y * blockDim.x + threadIdx.x;
        if (op == RED_MAX || op == RED_MIN || op == RED_LOG_SUM_EXP) {
            const bool mx = op != RED_MIN;
            M m = mx ? RT<Tag>::lowest() : RT<Tag>::highest();
            if (live)
                for (kiln_u64 j = threadIdx.y; j < count; j += blockDim.y) {
                    const M v = RT<Tag>::ld(x[off + red_offset(g, j)]);
                    m = mx ? kiln_max_nan(m, v) : red_min(m, v);
                }
            mbuf[slot] = m;
            __syncthreads();
            if (threadIdx.y == 0 && live) {
                for (unsigned k = 1; k < blockDim.y; ++k) {
                    const M v = mbuf[k * blockDim.x + threadIdx.x];
                    m = mx ? kiln_max_nan(m, v) : red_min(m, v);
                }
                if (op == RED_LOG_SUM_EXP) mbuf[threadIdx.x] = m;  // this thread's own slot
                else y[o] = RT<Tag>::st(m);
            }
            if (op == RED_LOG_SUM_EXP) {
                __syncthreads();
                m = mbuf[threadIdx.x];
                S s = 0;
                if (live)
                    for (kiln_u64 j = threadIdx.y; j < count; j += blockDim.y)
                        s = red_add(s, RedLse<Tag>::term(x[off + red_offset(g, j)], m));
                sbuf[slot] = s;
                __syncthreads();
                if (threadIdx.y == 0 && live) {
                    for (unsigned k = 1; k < blockDim.y; ++k) s = red_add(s, sbuf[k * blockDim.x + threadIdx.x]);
                    y[o] = RedLse<Tag>::fin(m, s);
                }
            }
        } else {
            const bool prod = op == RED_PROD;
            S s = prod ? 1 : 0;
            if (live)
                for (kiln_u64 j = threadIdx.y; j < count; j += blockDim.y) {
                    const T v = x[off + red_offset(g, j)];
                    s = prod ? red_mul(s, to_sum<Tag>(v)) : red_add(s, red_term<Tag>(v, op));
                }
            sbuf[slot] = s;
            __syncthreads();
            if (threadIdx.y == 0 && live) {
                for (unsigned k = 1; k < blockDim.y; ++k) {
                    const S v = sbuf[k * blockDim.x + threadIdx.x];
                    s = prod ? red_mul(s, v) : red_add(s, v);
                }
                y[o] = RedFin<Tag>::fin(s, op, count);
            }
        }
        __syncthreads();
    }
}

#define RED_GEOM_PARAMS                                                                                         \
    unsigned kr, kiln_u64 kd0, kiln_u64 kd1, kiln_u64 kd2, kiln_u64 kd3, kiln_u64 kd4, kiln_u64 kd5, kiln_u64 kd6, \
        kiln_u64 kd7, kiln_u64 ks0, kiln_u64 ks1, kiln_u64 ks2, kiln_u64 ks3, kiln_u64 ks4, kiln_u64 ks5,        \
        kiln_u64 ks6, kiln_u64 ks7, unsigned rr, kiln_u64 rd0, kiln_u64 rd1, kiln_u64 rd2, kiln_u64 rd3,        \
        kiln_u64 rd4, kiln_u64 rd5, kiln_u64 rd6, kiln_u64 rd7, kiln_u64 rs0, kiln_u64 rs1, kiln_u64 rs2,       \
        kiln_u64 rs3, kiln_u64 rs4, kiln_u64 rs5, kiln_u64 rs6, kiln_u64 rs7
#define RED_GEOM_BUILD(g)                                                                                     \
    RedGeom g;                                                                                                \
    g.kr = kr; g.rr = rr;                                                                                     \
    g.kd[0] = kd0; g.kd[1] = kd1; g.kd[2] = kd2; g.kd[3] = kd3; g.kd[4] = kd4; g.kd[5] = kd5; g.kd[6] = kd6; g.kd[7] = kd7; \
    g.ks[0] = ks0; g.ks[1] = ks1; g.ks[2] = ks2; g.ks[3] = ks3; g.ks[4] = ks4; g.ks[5] = ks5; g.ks[6] = ks6; g.ks[7] = ks7; \
    g.rd[0] = rd0; g.rd[1] = rd1; g.rd[2] = rd2; g.rd[3] = rd3; g.rd[4] = rd4; g.rd[5] = rd5; g.rd[6] = rd6; g.rd[7] = rd7; \
    g.rs[0] = rs0; g.rs[1] = rs1; g.rs[2] = rs2; g.rs[3] = rs3; g.rs[4] = rs4; g.rs[5] = rs5; g.rs[6] = rs6; g.rs[7] = rs7;

template <typename Tag>
__global__ void kiln_reduce_rows(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 rows,
                                 kiln_u64 count, unsigned op) {
    reduce_rows<Tag>(x, y, rows, count, op);
}

template <typename Tag>
__global__ void kiln_reduce_any(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 n_out,
                                kiln_u64 count, unsigned op, RED_GEOM_PARAMS) {
    RED_GEOM_BUILD(g)
    reduce_any<Tag>(x, y, n_out, count, op, g);
}

extern "C" __global__ void kiln_reduce_copy(const unsigned char* x, unsigned char* y, kiln_u64 nbytes) {
    KILN_FOR(i, nbytes) { y[i] = x[i]; }
}

// ArgMax / ArgMin (ONNX Operators.md): the input viewed as [outer, n, inner], reduced over n
// onto int64 indices. A NaN wins over any number (numpy's argmax and argmin); among equal
// values the first index wins, or the last with select_last_index. is_min picks ArgMin.
//
// - kiln_arg_rows<Tag>: inner == 1; one block per row (grid-stride over rows). Each thread scans
//   a strided part of the row: over a 16-byte aligned row as 16-byte vectors, ARG_UNROLL of them
//   in flight (a row of 8,192 float16 values is one round of loads for 1,024 threads), else
//   element by element; then warp shuffles merge (value, index) pairs within each warp and
//   across the warps. The pairs' order is total (arg_better), so the result does not depend on
//   the order they meet in.
// - kiln_arg_rows_split<Tag>: the same over a row cut into ARG_SPLIT slices, one block each,
//   merged through a thread block cluster (below).
// - kiln_arg_strided<Tag>: inner > 1; one thread per output (grid-stride), scanning n.
template <typename M>
__device__ __forceinline__ bool arg_better(M v, long long i, M best, long long bi, unsigned is_min, unsigned last) {
    const bool vn = v != v, bn = best != best;
    if (bi < 0) return true;
    if (vn || bn) {
        if (vn && !bn) return true;
        if (bn && !vn) return false;
        return last ? i > bi : i < bi;
    }
    if (v == best) return last ? i > bi : i < bi;
    return is_min ? v < best : v > best;
}

#define ARG_UNROLL 4  // 16-byte vectors per thread in flight

// Merges (v, i) of the lanes of a warp into every lane (invalid pairs have i < 0).
template <typename M>
__device__ __forceinline__ void arg_warp(M& best, long long& bi, unsigned is_min, unsigned last) {
    kiln_warp_reduce_pair(best, bi, [&](M v, long long i, M b, long long j) {
        return i >= 0 && arg_better(v, i, b, j, is_min, last);
    });
}

// One thread's best (value, index) pair over the elements [lo, hi) of row `xr` of n elements:
// over a 16-byte aligned row as 16-byte vectors (lo a multiple of a vector's elements), ARG_UNROLL
// of them in flight, strided by the block; the rest element by element.
template <typename Tag, typename T = typename Tag::storage, typename M = typename RT<Tag>::M>
__device__ __forceinline__ void arg_scan(const T* xr, kiln_u64 lo, kiln_u64 hi, unsigned is_min, unsigned last, M& best,
                                         long long& bi) {
    const unsigned VE = 16 / sizeof(T);  // elements per 16-byte vector (every T's size divides 16)
    best = RT<Tag>::lowest();
    bi = -1;
    const auto take = [&](M v, kiln_u64 j) {
        if (arg_better(v, (long long)j, best, bi, is_min, last)) {
            best = v;
            bi = (long long)j;
        }
    };
    const kiln_u64 v0 = lo / VE, nv = kiln_aligned(xr, 16) ? (hi - lo) / VE : 0;
    const uint4* xv = (const uint4*)xr + v0;
    for (kiln_u64 c0 = threadIdx.x; c0 < nv; c0 += (kiln_u64)blockDim.x * ARG_UNROLL) {
        uint4 raw[ARG_UNROLL];
#pragma unroll
        for (int u = 0; u < ARG_UNROLL; ++u) {
            const kiln_u64 c = c0 + (kiln_u64)u * blockDim.x;
            raw[u] = c < nv ? xv[c] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < ARG_UNROLL; ++u) {
            const kiln_u64 c = c0 + (kiln_u64)u * blockDim.x;
            if (c >= nv) break;
            const T* e = (const T*)&raw[u];
            for (unsigned k = 0; k < VE; ++k) take(RT<Tag>::ld(e[k]), (v0 + c) * VE + k);
        }
    }
    for (kiln_u64 j = lo + nv * VE + threadIdx.x; j < hi; j += blockDim.x) take(RT<Tag>::ld(xr[j]), j);
}

// Merges every thread's pair into warp 0's (every lane of warp 0 gets the block's pair). Every
// thread of the block calls it; `s_v` and `s_i` hold 32 pairs, reusable at once after it.
template <typename M>
__device__ __forceinline__ void arg_block(M& best, long long& bi, M* s_v, long long* s_i, M lowest, unsigned is_min,
                                          unsigned last) {
    arg_warp(best, bi, is_min, last);
    const unsigned warps = blockDim.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();  // the previous merge's pairs are read
    if (lane == 0) {
        s_v[threadIdx.x >> 5] = best;
        s_i[threadIdx.x >> 5] = bi;
    }
    __syncthreads();
    if (threadIdx.x < 32) {
        best = lane < warps ? s_v[lane] : lowest;
        bi = lane < warps ? s_i[lane] : -1;
        arg_warp(best, bi, is_min, last);
    }
}

template <typename Tag, typename T = typename Tag::storage>
__device__ void arg_rows(const T* x, long long* y, kiln_u64 rows, kiln_u64 n, unsigned is_min, unsigned last) {
    typedef typename RT<Tag>::M M;
    __shared__ M s_v[32];
    __shared__ long long s_i[32];
    for (kiln_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        M best;
        long long bi;
        arg_scan<Tag>(x + row * n, 0, n, is_min, last, best, bi);
        arg_block(best, bi, s_v, s_i, RT<Tag>::lowest(), is_min, last);
        if (threadIdx.x == 0) y[row] = bi < 0 ? 0 : bi;
    }
}

template <typename Tag, typename T = typename Tag::storage>
__device__ void arg_strided(const T* x, long long* y, kiln_u64 outer, kiln_u64 n, kiln_u64 inner, unsigned is_min,
                            unsigned last) {
    typedef typename RT<Tag>::M M;
    KILN_FOR(o, outer * inner) {
        const kiln_u64 a = o / inner, b = o - a * inner;
        const T* xr = x + a * n * inner + b;
        M best = RT<Tag>::lowest();
        long long bi = -1;
        for (kiln_u64 j = 0; j < n; ++j) {
            const M v = RT<Tag>::ld(xr[j * inner]);
            if (arg_better(v, (long long)j, best, bi, is_min, last)) {
                best = v;
                bi = (long long)j;
            }
        }
        y[o] = bi < 0 ? 0 : bi;
    }
}

template <typename Tag>
__global__ void __launch_bounds__(1024) kiln_arg_rows(const typename Tag::storage* x, long long* y, kiln_u64 rows,
                                                      kiln_u64 n, unsigned is_min, unsigned last) {
    arg_rows<Tag>(x, y, rows, n, is_min, last);
}

// kiln_arg_rows_split<Tag>: inner == 1, one row per ARG_SPLIT blocks (grid rows · ARG_SPLIT),
// for few long rows (a decode step's logits: one block of one SM took 11 µs over 49,152 values on
// an H100). Block r of a row scans its r-th slice (a multiple of 16 bytes of elements); on compute
// capability 9.0 and later the row's blocks are one thread block cluster, and block 0 merges the
// others' pairs from their shared memory (kiln-cuda-std's cluster.cuh: mapa, generic addresses)
// after a cluster barrier. Before 9.0 the row's block 0 scans the whole row and the others return.
#define ARG_SPLIT 8
#if __CUDA_ARCH__ >= 900
#define KILN_ARG_CLUSTER_DIMS __cluster_dims__(ARG_SPLIT, 1, 1)
#else
#define KILN_ARG_CLUSTER_DIMS
#endif

template <typename Tag>
__global__ void KILN_ARG_CLUSTER_DIMS __launch_bounds__(1024)
    kiln_arg_rows_split(const typename Tag::storage* x, long long* y, kiln_u64 rows, kiln_u64 n, unsigned is_min,
                        unsigned last) {
    typedef typename Tag::storage T;
    typedef typename RT<Tag>::M M;
    __shared__ M s_v[32];
    __shared__ long long s_i[32];
    const kiln_u64 row = blockIdx.x / ARG_SPLIT;
    const unsigned rank = blockIdx.x % ARG_SPLIT;
    M best = RT<Tag>::lowest();
    long long bi = -1;
#if __CUDA_ARCH__ >= 900
    const unsigned VE = 16 / sizeof(T);
    const kiln_u64 slice = (n + ARG_SPLIT * VE - 1) / (ARG_SPLIT * VE) * VE;
    const kiln_u64 lo = min(n, rank * slice), hi = min(n, lo + slice);
    if (row < rows) arg_scan<Tag>(x + row * n, lo, hi, is_min, last, best, bi);
    arg_block(best, bi, s_v, s_i, RT<Tag>::lowest(), is_min, last);
    __shared__ M c_v;
    __shared__ long long c_i;
    if (threadIdx.x == 0) {
        c_v = best;
        c_i = bi;
    }
    kiln_cluster_sync();  // every block's pair is in its shared memory
    if (rank == 0 && threadIdx.x < 32) {
        const unsigned lane = threadIdx.x;
        best = lane < ARG_SPLIT ? *kiln_cluster_map(&c_v, lane) : RT<Tag>::lowest();
        bi = lane < ARG_SPLIT ? *kiln_cluster_map(&c_i, lane) : -1;
        arg_warp(best, bi, is_min, last);
        if (lane == 0 && row < rows) y[row] = bi < 0 ? 0 : bi;
    }
    kiln_cluster_sync();  // block 0 has read every block's pair before any block exits
#else
    if (rank != 0 || row >= rows) return;
    arg_scan<Tag>(x + row * n, 0, n, is_min, last, best, bi);
    arg_block(best, bi, s_v, s_i, RT<Tag>::lowest(), is_min, last);
    if (threadIdx.x == 0) y[row] = bi < 0 ? 0 : bi;
#endif
}

template <typename Tag>
__global__ void kiln_arg_strided(const typename Tag::storage* x, long long* y, kiln_u64 outer, kiln_u64 n,
                                 kiln_u64 inner, unsigned is_min, unsigned last) {
    arg_strided<Tag>(x, y, outer, n, inner, is_min, last);
}

// CumSum and Hardmax (shim/src/lines.rs): the input viewed as [outer, n, inner], one thread per
// line (outer · inner of them, grid-stride), n elements apart by inner.

// y = the running sum of x along the line (exclusive: without the element itself; reverse: from
// the end), accumulated in kiln_elem's C (f32; f64 for float64; integers wrap).
template <typename Tag>
__global__ void kiln_cumsum(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 outer, kiln_u64 n,
                            kiln_u64 inner, unsigned exclusive, unsigned reverse) {
    typedef kiln_elem<Tag> E;
    KILN_FOR(line, outer * inner) {
        const kiln_u64 o = line / inner, i = line - o * inner, base = o * n * inner + i;
        typename E::C acc = 0;
        for (kiln_u64 j = 0; j < n; ++j) {
            const kiln_u64 k = base + (reverse ? n - 1 - j : j) * inner;
            const typename E::C before = acc;
            acc += E::ld(x[k]);
            y[k] = E::st(exclusive ? before : acc);
        }
    }
}

// y = 1 at the first largest element of the line (a NaN wins over every number), 0 elsewhere.
template <typename Tag>
__global__ void kiln_hardmax(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 outer, kiln_u64 n,
                             kiln_u64 inner) {
    typedef kiln_elem<Tag> E;
    KILN_FOR(line, outer * inner) {
        const kiln_u64 o = line / inner, i = line - o * inner, base = o * n * inner + i;
        kiln_u64 best = 0;
        typename E::C bv = E::ld(x[base]);
        for (kiln_u64 j = 1; j < n; ++j) {
            const typename E::C v = E::ld(x[base + j * inner]);
            if (bv == bv && (v != v || v > bv)) {
                bv = v;
                best = j;
            }
        }
        for (kiln_u64 j = 0; j < n; ++j) y[base + j * inner] = E::st(j == best ? 1 : 0);
    }
}

// TopK (shim/src/topk.rs): each line's best k elements (largest: greater first; else smaller
// first) and their indices along the line, written to values / indices [outer, k, inner], which
// hold the list while it is built: an element enters when it beats the last kept one (or fewer
// than k are kept), after every element it does not beat (equal ones keep index order). A NaN is
// larger than every number; integers compare with their sign. One thread per line.
template <typename Tag>
__global__ void kiln_topk(const typename Tag::storage* x, typename Tag::storage* values, long long* indices,
                          kiln_u64 outer, kiln_u64 n, kiln_u64 inner, kiln_u64 k, unsigned largest) {
    typedef kiln_elem<Tag> E;
    typedef typename E::C C;
    const auto beats = [&](C v, C w) {
        if (E::is_float) {
            const bool nv = v != v, nw = w != w;
            return largest ? (nv && !nw) || v > w : (!nv && nw) || v < w;
        }
        if (!E::is_signed) return largest ? v > w : v < w;
        return largest ? (long long)v > (long long)w : (long long)v < (long long)w;
    };
    KILN_FOR(line, outer * inner) {
        const kiln_u64 o = line / inner, i = line - o * inner, in = o * n * inner + i, out = o * k * inner + i;
        kiln_u64 kept = 0;
        for (kiln_u64 j = 0; j < n; ++j) {
            const typename Tag::storage s = x[in + j * inner];
            const C v = E::ld(s);
            if (kept == k && !beats(v, E::ld(values[out + (k - 1) * inner]))) continue;
            kiln_u64 at = kept < k ? kept : k - 1;  // where it goes: after every kept element it does not beat
            for (kiln_u64 p = 0; p < kept; ++p)
                if (beats(v, E::ld(values[out + p * inner]))) {
                    at = p;
                    break;
                }
            const kiln_u64 last = kept < k ? kept : k - 1;  // the list's last slot after the insertion
            for (kiln_u64 p = last; p > at; --p) {
                values[out + p * inner] = values[out + (p - 1) * inner];
                indices[out + p * inner] = indices[out + (p - 1) * inner];
            }
            values[out + at * inner] = s;
            indices[out + at * inner] = (long long)j;
            if (kept < k) ++kept;
        }
    }
}

// ---- Unique (shim/src/unique.rs) -------------------------------------------------------------
// X as [outer, n, inner]: slice j is the elements (o, j, i), compared in (o, i) order.

// -1, 0 or 1: a against b as numbers (signed or unsigned integers, floats; NaN equal to NaN and
// after every number).
template <typename E> __device__ __forceinline__ int uq_cmp(typename E::C a, typename E::C b) {
    if (E::is_float) {
        const bool na = a != a, nb = b != b;
        if (na || nb) return na == nb ? 0 : (na ? 1 : -1);
        return a < b ? -1 : (a > b ? 1 : 0);
    }
    if (E::is_signed) {
        const long long x = (long long)a, y = (long long)b;
        return x < y ? -1 : (x > y ? 1 : 0);
    }
    return a < b ? -1 : (a > b ? 1 : 0);
}

template <typename Tag>
__device__ int uq_cmp_slices(const typename Tag::storage* x, kiln_u64 a, kiln_u64 b, kiln_u64 n, kiln_u64 outer,
                             kiln_u64 inner) {
    typedef kiln_elem<Tag> E;
    for (kiln_u64 o = 0; o < outer; ++o)
        for (kiln_u64 i = 0; i < inner; ++i) {
            const int c = uq_cmp<E>(E::ld(x[(o * n + a) * inner + i]), E::ld(x[(o * n + b) * inner + i]));
            if (c != 0) return c;
        }
    return 0;
}

// first[e]: the first slice equal to slice e.
template <typename Tag>
__global__ void kiln_unique_first(const typename Tag::storage* x, long long* first, kiln_u64 n, kiln_u64 outer,
                                  kiln_u64 inner) {
    KILN_FOR(e, n) {
        kiln_u64 f = e;
        for (kiln_u64 j = 0; j < e; ++j)
            if (uq_cmp_slices<Tag>(x, j, e, n, outer, inner) == 0) {
                f = j;
                break;
            }
        first[e] = (long long)f;
    }
}

// For each first occurrence e: its output position p (sorted: the distinct slices below it;
// else the first occurrences before it) into pos[e], its slice into y [outer, u, inner], and
// (flags bit 0) indices[p] = e, (bit 1) counts[p] = the slices equal to it.
template <typename Tag>
__global__ void kiln_unique_place(const typename Tag::storage* x, const long long* first, long long* pos,
                                  typename Tag::storage* y, long long* indices, long long* counts, kiln_u64 u,
                                  unsigned sorted, unsigned flags, kiln_u64 n, kiln_u64 outer, kiln_u64 inner) {
    KILN_FOR(e, n) {
        if ((kiln_u64)first[e] != e) continue;
        kiln_u64 p = 0, count = 0;
        for (kiln_u64 j = 0; j < n; ++j) {
            if ((kiln_u64)first[j] == e) ++count;
            if ((kiln_u64)first[j] != j || j == e) continue;
            if (sorted ? uq_cmp_slices<Tag>(x, j, e, n, outer, inner) < 0 : j < e) ++p;
        }
        pos[e] = (long long)p;
        for (kiln_u64 o = 0; o < outer; ++o)
            for (kiln_u64 i = 0; i < inner; ++i) y[(o * u + p) * inner + i] = x[(o * n + e) * inner + i];
        if (flags & 1u) indices[p] = (long long)e;
        if (flags & 2u) counts[p] = (long long)count;
    }
}

// inverse[e] = pos[first[e]].
extern "C" __global__ void kiln_unique_inverse(const long long* first, const long long* pos, long long* inverse,
                                               kiln_u64 n, kiln_u64 outer, kiln_u64 inner) {
    KILN_FOR(e, n) inverse[e] = pos[first[e]];
}

// kiln-reduce CUDA kernels: ReduceSum / ReduceMean / ReduceMax (op codes match `Kind::code` in
// shim/src/lib.rs). Floating-point values accumulate in f32 (f64 for float64 input), integers in
// i64 with wrapping arithmetic; Max propagates NaN; an empty Mean is 0/0, an empty Max the
// dtype's lowest value.
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

#define RED_SUM 0u
#define RED_MEAN 1u
#define RED_MAX 2u

struct red_f16 { unsigned short b; };
struct red_bf16 { unsigned short b; };

// Per storage type: S the sum accumulator, M the max accumulator.
template <typename T> struct RT;
template <> struct RT<float> {
    typedef float S; typedef float M;
    static __device__ __forceinline__ float ld(float v) { return v; }
    static __device__ __forceinline__ float st(float v) { return v; }
    static __device__ __forceinline__ float lowest() { return __int_as_float(0xff800000); }
};
template <> struct RT<red_f16> {
    typedef float S; typedef float M;
    static __device__ __forceinline__ float ld(red_f16 v) { return kiln_f16_to_f32(v.b); }
    static __device__ __forceinline__ red_f16 st(float v) { red_f16 r; r.b = kiln_f32_to_f16(v); return r; }
    static __device__ __forceinline__ float lowest() { return __int_as_float(0xff800000); }
};
template <> struct RT<red_bf16> {
    typedef float S; typedef float M;
    static __device__ __forceinline__ float ld(red_bf16 v) { return kiln_bf16_to_f32(v.b); }
    static __device__ __forceinline__ red_bf16 st(float v) { red_bf16 r; r.b = kiln_f32_to_bf16(v); return r; }
    static __device__ __forceinline__ float lowest() { return __int_as_float(0xff800000); }
};
template <> struct RT<double> {
    typedef double S; typedef double M;
    static __device__ __forceinline__ double ld(double v) { return v; }
    static __device__ __forceinline__ double st(double v) { return v; }
    static __device__ __forceinline__ double lowest() { return __longlong_as_double(0xfff0000000000000ll); }
};
#define RED_INT_TRAITS(T, MT, LOW)                                                       \
    template <> struct RT<T> {                                                           \
        typedef long long S; typedef MT M;                                               \
        static __device__ __forceinline__ MT ld(T v) { return (MT)v; }                   \
        static __device__ __forceinline__ T st(MT v) { return (T)v; }                    \
        static __device__ __forceinline__ MT lowest() { return (MT)(LOW); }              \
    };
RED_INT_TRAITS(signed char, int, -128)
RED_INT_TRAITS(int, int, (-2147483647 - 1))
RED_INT_TRAITS(long long, long long, (-9223372036854775807ll - 1))
RED_INT_TRAITS(unsigned char, unsigned, 0u)
RED_INT_TRAITS(unsigned, unsigned, 0u)
RED_INT_TRAITS(unsigned long long, unsigned long long, 0ull)

// The storage type T the device code takes (what RT<T> and RedFin<T> are specialized for), by
// the prelude's tag of the dtype: float16 and bfloat16 as this package's own structs.
template <typename Tag> struct Elem;
template <> struct Elem<kiln_tag_f32> { typedef float T; };
template <> struct Elem<kiln_tag_f16> { typedef red_f16 T; };
template <> struct Elem<kiln_tag_bf16> { typedef red_bf16 T; };
template <> struct Elem<kiln_tag_f64> { typedef double T; };
template <> struct Elem<kiln_tag_i8> { typedef signed char T; };
template <> struct Elem<kiln_tag_i32> { typedef int T; };
template <> struct Elem<kiln_tag_i64> { typedef long long T; };
template <> struct Elem<kiln_tag_u8> { typedef unsigned char T; };
template <> struct Elem<kiln_tag_u32> { typedef unsigned T; };
template <> struct Elem<kiln_tag_u64> { typedef unsigned long long T; };

// Element → sum accumulator (integers sign- or zero-extend to i64).
template <typename T> __device__ __forceinline__ typename RT<T>::S to_sum(T v) { return (typename RT<T>::S)RT<T>::ld(v); }

__device__ __forceinline__ float red_add(float a, float b) { return a + b; }
__device__ __forceinline__ double red_add(double a, double b) { return a + b; }
__device__ __forceinline__ long long red_add(long long a, long long b) {
    return (long long)((unsigned long long)a + (unsigned long long)b);  // wraps
}
// Max that propagates NaN (as the CPU reference: a NaN accumulator stays, a NaN value wins).
template <typename A> __device__ __forceinline__ A red_max(A a, A b) {
    if (a != a) return a;
    return (b != b || b > a) ? b : a;
}

struct SumOp { template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return red_add(a, b); } };
struct MaxOp { template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return red_max(a, b); } };

template <typename A, typename Op> __device__ __forceinline__ A red_warp(A v, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Reduces v over the blockDim.x threads of this row (threadIdx.y picks the row); every thread
// of the row gets the result. Called by every thread of the block when blockDim.x > 32.
template <typename A, typename Op> __device__ __forceinline__ A red_row(A v, Op op) {
    v = red_warp(v, op);
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

// The sum's output value: the sum, or for Mean the sum divided by count (integers: the sum in
// the element type, divided in f64, truncated back).
__device__ __forceinline__ float red_mean(float s, kiln_u64 count) { return s / (float)count; }
__device__ __forceinline__ double red_mean(double s, kiln_u64 count) { return s / (double)count; }
template <typename T> struct RedFin {
    static __device__ __forceinline__ T fin(typename RT<T>::S s, unsigned op, kiln_u64 count) {
        return RT<T>::st(op == RED_MEAN ? red_mean(s, count) : s);
    }
};
#define RED_INT_FIN(T)                                                                  \
    template <> struct RedFin<T> {                                                      \
        static __device__ __forceinline__ T fin(long long s, unsigned op, kiln_u64 count) { \
            T t = (T)s;                                                                 \
            return op == RED_MEAN ? (T)((double)t / (double)count) : t;                 \
        }                                                                               \
    };
RED_INT_FIN(signed char)
RED_INT_FIN(int)
RED_INT_FIN(long long)
RED_INT_FIN(unsigned char)
RED_INT_FIN(unsigned)
RED_INT_FIN(unsigned long long)

template <typename T>
__device__ void reduce_rows(const T* x, T* y, kiln_u64 rows, kiln_u64 count, unsigned op) {
    typedef typename RT<T>::S S;
    typedef typename RT<T>::M M;
    for (kiln_u64 row = (kiln_u64)blockIdx.x * blockDim.y + threadIdx.y;; row += (kiln_u64)gridDim.x * blockDim.y) {
        // The loop's exit is uniform per row group (a warp, or the block when blockDim.y == 1).
        if (row >= rows) break;
        const T* xr = x + row * count;
        if (op == RED_MAX) {
            M m = RT<T>::lowest();
            for (kiln_u64 j = threadIdx.x; j < count; j += blockDim.x) m = red_max(m, RT<T>::ld(xr[j]));
            m = red_row(m, MaxOp());
            if (threadIdx.x == 0) y[row] = RT<T>::st(m);
        } else {
            S s = 0;
            for (kiln_u64 j = threadIdx.x; j < count; j += blockDim.x) s = red_add(s, to_sum(xr[j]));
            s = red_row(s, SumOp());
            if (threadIdx.x == 0) y[row] = RedFin<T>::fin(s, op, count);
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

template <typename T>
__device__ void reduce_any(const T* x, T* y, kiln_u64 n_out, kiln_u64 count, unsigned op, const RedGeom& g) {
    typedef typename RT<T>::S S;
    typedef typename RT<T>::M M;
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
        if (op == RED_MAX) {
            M m = RT<T>::lowest();
            if (live)
                for (kiln_u64 j = threadIdx.y; j < count; j += blockDim.y) m = red_max(m, RT<T>::ld(x[off + red_offset(g, j)]));
            mbuf[slot] = m;
            __syncthreads();
            if (threadIdx.y == 0 && live) {
                for (unsigned k = 1; k < blockDim.y; ++k) m = red_max(m, mbuf[k * blockDim.x + threadIdx.x]);
                y[o] = RT<T>::st(m);
            }
        } else {
            S s = 0;
            if (live)
                for (kiln_u64 j = threadIdx.y; j < count; j += blockDim.y) s = red_add(s, to_sum(x[off + red_offset(g, j)]));
            sbuf[slot] = s;
            __syncthreads();
            if (threadIdx.y == 0 && live) {
                for (unsigned k = 1; k < blockDim.y; ++k) s = red_add(s, sbuf[k * blockDim.x + threadIdx.x]);
                y[o] = RedFin<T>::fin(s, op, count);
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
__global__ void kiln_reduce_rows(const typename Elem<Tag>::T* x, typename Elem<Tag>::T* y, kiln_u64 rows,
                                 kiln_u64 count, unsigned op) {
    reduce_rows<typename Elem<Tag>::T>(x, y, rows, count, op);
}

template <typename Tag>
__global__ void kiln_reduce_any(const typename Elem<Tag>::T* x, typename Elem<Tag>::T* y, kiln_u64 n_out,
                                kiln_u64 count, unsigned op, RED_GEOM_PARAMS) {
    RED_GEOM_BUILD(g)
    reduce_any<typename Elem<Tag>::T>(x, y, n_out, count, op, g);
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
//   in flight (a decode step's logits row of 49,152 float16 values is two rounds of loads for
//   1,024 threads), else element by element; then warp shuffles merge (value, index) pairs
//   within each warp and across the warps. The pairs' order is total (arg_better), so the
//   result does not depend on the order they meet in.
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
    for (int o = 16; o > 0; o >>= 1) {
        const M v = __shfl_xor_sync(0xffffffffu, best, o);
        const long long i = __shfl_xor_sync(0xffffffffu, bi, o);
        if (i >= 0 && arg_better(v, i, best, bi, is_min, last)) {
            best = v;
            bi = i;
        }
    }
}

template <typename T>
__device__ void arg_rows(const T* x, long long* y, kiln_u64 rows, kiln_u64 n, unsigned is_min, unsigned last) {
    typedef typename RT<T>::M M;
    const unsigned VE = 16 / sizeof(T);  // elements per 16-byte vector (every T's size divides 16)
    __shared__ M s_v[32];
    __shared__ long long s_i[32];
    for (kiln_u64 row = blockIdx.x; row < rows; row += gridDim.x) {
        const T* xr = x + row * n;
        M best = RT<T>::lowest();
        long long bi = -1;
        const auto take = [&](M v, kiln_u64 j) {
            if (arg_better(v, (long long)j, best, bi, is_min, last)) {
                best = v;
                bi = (long long)j;
            }
        };
        // Vectors over an aligned row, then its tail element by element.
        const kiln_u64 nv = ((size_t)xr & 15u) == 0 ? n / VE : 0;
        const uint4* xv = (const uint4*)xr;
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
                for (unsigned k = 0; k < VE; ++k) take(RT<T>::ld(e[k]), c * VE + k);
            }
        }
        for (kiln_u64 j = nv * VE + threadIdx.x; j < n; j += blockDim.x) take(RT<T>::ld(xr[j]), j);
        arg_warp(best, bi, is_min, last);
        const unsigned warps = blockDim.x >> 5, lane = threadIdx.x & 31;
        __syncthreads();  // the previous row's pairs are read
        if (lane == 0) {
            s_v[threadIdx.x >> 5] = best;
            s_i[threadIdx.x >> 5] = bi;
        }
        __syncthreads();
        if (threadIdx.x < 32) {
            best = lane < warps ? s_v[lane] : RT<T>::lowest();
            bi = lane < warps ? s_i[lane] : -1;
            arg_warp(best, bi, is_min, last);
            if (lane == 0) y[row] = bi < 0 ? 0 : bi;
        }
    }
}

template <typename T>
__device__ void arg_strided(const T* x, long long* y, kiln_u64 outer, kiln_u64 n, kiln_u64 inner, unsigned is_min,
                            unsigned last) {
    typedef typename RT<T>::M M;
    KILN_FOR(o, outer * inner) {
        const kiln_u64 a = o / inner, b = o - a * inner;
        const T* xr = x + a * n * inner + b;
        M best = RT<T>::lowest();
        long long bi = -1;
        for (kiln_u64 j = 0; j < n; ++j) {
            const M v = RT<T>::ld(xr[j * inner]);
            if (arg_better(v, (long long)j, best, bi, is_min, last)) {
                best = v;
                bi = (long long)j;
            }
        }
        y[o] = bi < 0 ? 0 : bi;
    }
}

template <typename Tag>
__global__ void __launch_bounds__(1024) kiln_arg_rows(const typename Elem<Tag>::T* x, long long* y, kiln_u64 rows,
                                                      kiln_u64 n, unsigned is_min, unsigned last) {
    arg_rows<typename Elem<Tag>::T>(x, y, rows, n, is_min, last);
}

template <typename Tag>
__global__ void kiln_arg_strided(const typename Elem<Tag>::T* x, long long* y, kiln_u64 outer, kiln_u64 n,
                                 kiln_u64 inner, unsigned is_min, unsigned last) {
    arg_strided<typename Elem<Tag>::T>(x, y, outer, n, inner, is_min, last);
}

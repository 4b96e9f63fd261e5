// kiln-pool CUDA kernel: MaxPool, AveragePool, LpPool and their Global forms (shim/src/lib.rs
// gives the semantics and computes every window's geometry). One thread per output element
// (grid-stride) of [N·C, O1, O2, O3]: up to 3 spatial dimensions, fewer padded in front with
// dimensions of size 1. Values accumulate in f32 (f64 for float64); int8 and uint8 (MaxPool)
// compare in f32, which holds them exactly.
#include "kiln.cuh"
#include "kiln-cuda-std/elem.cuh"
#include "kiln-cuda-std/math.cuh"

// The type values are compared and summed in, and the conversions to and from it.
template <typename Tag, bool FLOAT = kiln_elem<Tag>::is_float>
struct PoolT {
    typedef typename kiln_elem<Tag>::C A;
    static __device__ __forceinline__ A ld(typename Tag::storage v) { return kiln_elem<Tag>::ld(v); }
    static __device__ __forceinline__ typename Tag::storage st(A v) { return kiln_elem<Tag>::st(v); }
};
template <typename Tag>
struct PoolT<Tag, false> {
    typedef float A;
    static __device__ __forceinline__ A ld(typename Tag::storage v) { return (float)v; }
    static __device__ __forceinline__ typename Tag::storage st(A v) { return (typename Tag::storage)v; }
};

// kind: 0 max (idx: int64 flat index of the first largest when has_idx; column_major: its
// offset within the plane column-major), 1 average (cip: count window positions before
// in + end, else the in-bounds ones), 2 Lp (exponent p). Per spatial dimension d: in, out,
// kernel, stride, dilation, padding at the begin and at the end.
template <typename Tag>
__global__ void kiln_pool(const typename Tag::storage* x, typename Tag::storage* y, long long* idx, kiln_u64 total,
                          unsigned kind, unsigned cip, unsigned has_idx, unsigned column_major, float p,
                          long long in0, long long out0, long long k0, long long s0, long long d0, long long b0,
                          long long e0, long long in1, long long out1, long long k1, long long s1, long long d1,
                          long long b1, long long e1, long long in2, long long out2, long long k2, long long s2,
                          long long d2, long long b2, long long e2) {
    typedef PoolT<Tag> P;
    typedef typename P::A A;
    const long long in[3] = {in0, in1, in2}, out[3] = {out0, out1, out2}, k[3] = {k0, k1, k2};
    const long long s[3] = {s0, s1, s2}, dil[3] = {d0, d1, d2}, b[3] = {b0, b1, b2}, e[3] = {e0, e1, e2};
    const kiln_u64 plane_in = (kiln_u64)(in0 * in1 * in2), plane_out = (kiln_u64)(out0 * out1 * out2);
    KILN_FOR(t, total) {
        const kiln_u64 plane = t / plane_out;
        kiln_u64 rest = t - plane * plane_out;
        long long start[3];
        for (int d = 2; d >= 0; --d) {
            const long long o = (long long)(rest % (kiln_u64)out[d]);
            rest /= (kiln_u64)out[d];
            start[d] = o * s[d] - b[d];
        }
        const typename Tag::storage* xp = x + plane * plane_in;
        A best = A(0), sum = A(0);
        long long best_at = -1, values = 0, counted = 0;
        for (long long i0 = 0; i0 < k[0]; ++i0) {
            const long long p0 = start[0] + i0 * dil[0];
            for (long long i1 = 0; i1 < k[1]; ++i1) {
                const long long p1 = start[1] + i1 * dil[1];
                for (long long i2 = 0; i2 < k[2]; ++i2) {
                    const long long p2 = start[2] + i2 * dil[2];
                    if (p0 < in[0] + e[0] && p1 < in[1] + e[1] && p2 < in[2] + e[2]) ++counted;
                    if (p0 < 0 || p0 >= in[0] || p1 < 0 || p1 >= in[1] || p2 < 0 || p2 >= in[2]) continue;
                    const long long row = (p0 * in[1] + p1) * in[2] + p2;
                    const A v = P::ld(xp[row]);
                    ++values;
                    if (kind == 0) {
                        if (best_at < 0 || v > best) {
                            best = v;
                            best_at = column_major ? p0 + in[0] * (p1 + in[1] * p2) : row;
                        }
                    } else if (kind == 1) {
                        sum += v;
                    } else {
                        sum += kiln_pow(kiln_abs(v), (A)p);
                    }
                }
            }
        }
        A r;
        if (kind == 0) r = best_at < 0 ? A(0) / A(0) : best;
        else if (kind == 1) r = sum / (A)(cip ? counted : values);
        else r = kiln_pow(sum, A(1) / (A)p);
        y[t] = P::st(r);
        if (kind == 0 && has_idx) idx[t] = (long long)(plane * plane_in) + (best_at < 0 ? 0 : best_at);
    }
}

// ---- MaxUnpool (shim/src/unpool.rs) ----------------------------------------------------------

extern "C" __global__ void kiln_unpool_zero(unsigned char* y, kiln_u64 nbytes) {
    KILN_FOR(t, nbytes) y[t] = 0;
}

// y at the output offset of unpooled flat index idx[e] gets x[e] (element bytes); the unpooled
// and output dims are the first `rank` of their eight. An index outside [0, total) writes nothing
// and fails the node (device error 1: element, index, total).
extern "C" __global__ void kiln_unpool(const unsigned char* x, const long long* idx, unsigned char* y, kiln_u64 n,
                                       unsigned esize, kiln_u64 total, unsigned rank, kiln_u64 u0, kiln_u64 u1,
                                       kiln_u64 u2, kiln_u64 u3, kiln_u64 u4, kiln_u64 u5, kiln_u64 u6, kiln_u64 u7,
                                       kiln_u64 o0, kiln_u64 o1, kiln_u64 o2, kiln_u64 o3, kiln_u64 o4, kiln_u64 o5,
                                       kiln_u64 o6, kiln_u64 o7, kiln_status* st) {
    const kiln_u64 from[8] = {u0, u1, u2, u3, u4, u5, u6, u7}, to[8] = {o0, o1, o2, o3, o4, o5, o6, o7};
    KILN_FOR(e, n) {
        const long long i = idx[e];
        if (i < 0 || (kiln_u64)i >= total) {
            kiln_fail(st, 1, (long long)e, i, (long long)total);
            continue;
        }
        kiln_u64 rest = (kiln_u64)i, at = 0, stride = 1;
        for (int a = (int)rank - 1; a >= 0; --a) {
            at += (rest % from[a]) * stride;
            rest /= from[a];
            stride *= to[a];
        }
        // The whole element in one access: duplicate indices then never mix two values' bytes.
        switch (esize) {
        case 2: ((unsigned short*)y)[at] = ((const unsigned short*)x)[e]; break;
        case 4: ((unsigned*)y)[at] = ((const unsigned*)x)[e]; break;
        case 8: ((kiln_u64*)y)[at] = ((const kiln_u64*)x)[e]; break;
        default: for (unsigned b = 0; b < esize; ++b) y[at * esize + b] = x[e * esize + b];
        }
    }
}

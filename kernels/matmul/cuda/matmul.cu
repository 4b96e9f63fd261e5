// kiln-matmul CUDA kernels. Float32 / float16 / bfloat16 products go through the host's gemm
// (cuBLASLt); these kernels cover the rest:
//
// - kiln_matmul_tiled<Tag>: a 16×16-tiled batched product for any dtype,
//   y[b](i, j) = alpha · Σ_p A[b](i, p) · B[b](p, j) (+ beta · C(i, j)), with A(i, p) at
//   a[a_off(b) + i·a_rs + p·a_cs] (transposes are strides), B likewise, and C(i, j) at
//   c[i·c_rs + j·c_cs] (0 strides broadcast). y is contiguous [batch, m, n]. The batch index
//   decomposes row-major over nb ≤ 6 dimensions bd with A and B strides as / bs (0 broadcasts).
//   Floats accumulate in f32 (f64 for float64). Integers accumulate in i64, wrapping; mode 0
//   adds C exactly, mode 1 is Gemm's scaled form: (double)(T)acc · alpha + (double)c · beta,
//   truncated to T (saturating).
// - kiln_matmul_bcast: y (m×n, esize-byte elements) = C broadcast (c_rs / c_cs strides, 0 on a
//   broadcast dimension): materialises Gemm's C for cuBLASLt.
#include "kiln.cuh"
#include "kiln-cuda-std/elem.cuh"

// The tiled product's arithmetic by dtype tag, over kiln-cuda-std's kiln_elem: A is the type
// products accumulate in (its C: f32, f64 for float64, the 64-bit pattern for integers), ld reads
// an element into it, and out(acc, c, alpha, beta, has_c, mode) gives the stored result.
template <typename Tag, bool FLOAT = kiln_elem<Tag>::is_float>
struct MT : kiln_elem<Tag> {
    typedef typename kiln_elem<Tag>::C A;
    static __device__ __forceinline__ typename Tag::storage out(A acc, A c, float alpha, float beta, unsigned has_c,
                                                                unsigned) {
        return kiln_elem<Tag>::st(has_c ? (A)alpha * acc + (A)beta * c : (A)alpha * acc);
    }
};
template <typename Tag>
struct MT<Tag, false> : kiln_elem<Tag> {
    typedef typename kiln_elem<Tag>::C A;
    typedef typename Tag::storage T;
    static __device__ __forceinline__ T out(A acc, A c, float alpha, float beta, unsigned has_c, unsigned mode) {
        if (mode == 0) return (T)(has_c ? acc + c : acc);
        double v = (double)(T)acc * (double)alpha;
        if (has_c) v += (double)(T)c * (double)beta;
        return (T)v;
    }
};

#define MM_TILE 16

template <typename Tag>
__device__ void matmul_tiled(const typename Tag::storage* a, const typename Tag::storage* b,
                             const typename Tag::storage* c, typename Tag::storage* y, kiln_u64 m, kiln_u64 n, kiln_u64 k,
                             kiln_u64 a_rs, kiln_u64 a_cs, kiln_u64 b_rs, kiln_u64 b_cs, kiln_u64 c_rs,
                             kiln_u64 c_cs, unsigned has_c, float alpha, float beta, unsigned mode, kiln_u64 batch,
                             unsigned nb, const kiln_u64* bd, const kiln_u64* as, const kiln_u64* bs) {
    typedef typename MT<Tag>::A A;
    __shared__ A ta[MM_TILE][MM_TILE + 1];
    __shared__ A tb[MM_TILE][MM_TILE + 1];
    const unsigned tx = threadIdx.x, ty = threadIdx.y;
    const kiln_u64 tiles_m = (m + MM_TILE - 1) / MM_TILE, tiles_n = (n + MM_TILE - 1) / MM_TILE;
    // Block-uniform loops (syncthreads inside).
    for (kiln_u64 bt = blockIdx.z; bt < batch; bt += gridDim.z) {
        kiln_u64 a_off = 0, b_off = 0, r = bt;
        for (int d = (int)nb - 1; d >= 0; --d) {
            const kiln_u64 q = r / bd[d], i = r - q * bd[d];
            a_off += i * as[d];
            b_off += i * bs[d];
            r = q;
        }
        for (kiln_u64 tm = blockIdx.y; tm < tiles_m; tm += gridDim.y) {
            for (kiln_u64 tn = blockIdx.x; tn < tiles_n; tn += gridDim.x) {
                const kiln_u64 i = tm * MM_TILE + ty, j = tn * MM_TILE + tx;
                A acc = 0;
                for (kiln_u64 p0 = 0; p0 < k; p0 += MM_TILE) {
                    const kiln_u64 pa = p0 + tx, pb = p0 + ty;
                    ta[ty][tx] = (i < m && pa < k) ? MT<Tag>::ld(a[a_off + i * a_rs + pa * a_cs]) : (A)0;
                    tb[ty][tx] = (pb < k && j < n) ? MT<Tag>::ld(b[b_off + pb * b_rs + j * b_cs]) : (A)0;
                    __syncthreads();
#pragma unroll
                    for (int q = 0; q < MM_TILE; ++q) acc += ta[ty][q] * tb[q][tx];
                    __syncthreads();
                }
                if (i < m && j < n) {
                    const A cv = has_c ? MT<Tag>::ld(c[i * c_rs + j * c_cs]) : (A)0;
                    y[(bt * m + i) * n + j] = MT<Tag>::out(acc, cv, alpha, beta, has_c, mode);
                }
            }
        }
    }
}

// The kernel, a template over the prelude's dtype tag, instantiated by the name expressions
// kernel.toml lists (schema 6).
template <typename Tag>
__global__ void kiln_matmul_tiled(const typename Tag::storage* a, const typename Tag::storage* b,
                                  const typename Tag::storage* c, typename Tag::storage* y, kiln_u64 m, kiln_u64 n,
                                  kiln_u64 k, kiln_u64 a_rs, kiln_u64 a_cs, kiln_u64 b_rs, kiln_u64 b_cs,
                                  kiln_u64 c_rs, kiln_u64 c_cs, unsigned has_c, float alpha, float beta,
                                  unsigned mode, kiln_u64 batch, unsigned nb, kiln_u64 bd0, kiln_u64 bd1, kiln_u64 bd2,
                                  kiln_u64 bd3, kiln_u64 bd4, kiln_u64 bd5, kiln_u64 as0, kiln_u64 as1, kiln_u64 as2,
                                  kiln_u64 as3, kiln_u64 as4, kiln_u64 as5, kiln_u64 bs0, kiln_u64 bs1, kiln_u64 bs2,
                                  kiln_u64 bs3, kiln_u64 bs4, kiln_u64 bs5) {
    const kiln_u64 bd[6] = {bd0, bd1, bd2, bd3, bd4, bd5};
    const kiln_u64 as[6] = {as0, as1, as2, as3, as4, as5};
    const kiln_u64 bs[6] = {bs0, bs1, bs2, bs3, bs4, bs5};
    matmul_tiled<Tag>(a, b, c, y, m, n, k, a_rs, a_cs, b_rs, b_cs, c_rs, c_cs, has_c, alpha, beta, mode, batch, nb, bd,
                      as, bs);
}

extern "C" __global__ void kiln_matmul_bcast(const unsigned char* c, unsigned char* y, kiln_u64 m, kiln_u64 n,
                                             kiln_u64 c_rs, kiln_u64 c_cs, unsigned esize) {
    KILN_FOR(t, m * n) {
        const kiln_u64 i = t / n, j = t - i * n;
        const kiln_u64 src = i * c_rs + j * c_cs;
        for (unsigned q = 0; q < esize; ++q) y[t * esize + q] = c[src * esize + q];
    }
}

// Einsum (shim/src/einsum.rs): y at output element i = Σ over the summed labels of x0[·]·x1[·]
// (one or two inputs), labels reordered so that the `n_out` output labels come first. sizes,
// s0, s1: each label's size and its element stride in each input (0 where it broadcasts; a
// repeated label's strides added). One thread per output element.
template <typename Tag>
__global__ void kiln_einsum(const typename Tag::storage* x0, const typename Tag::storage* x1, typename Tag::storage* y,
                            kiln_u64 total, unsigned n_inputs, unsigned n_labels, unsigned n_out, kiln_u64 z0,
                            kiln_u64 z1, kiln_u64 z2, kiln_u64 z3, kiln_u64 z4, kiln_u64 z5, kiln_u64 z6, kiln_u64 z7,
                            kiln_u64 a0, kiln_u64 a1, kiln_u64 a2, kiln_u64 a3, kiln_u64 a4, kiln_u64 a5, kiln_u64 a6,
                            kiln_u64 a7, kiln_u64 b0, kiln_u64 b1, kiln_u64 b2, kiln_u64 b3, kiln_u64 b4, kiln_u64 b5,
                            kiln_u64 b6, kiln_u64 b7) {
    typedef kiln_elem<Tag> E;
    typedef typename E::C A;
    const kiln_u64 size[8] = {z0, z1, z2, z3, z4, z5, z6, z7};
    const kiln_u64 s0[8] = {a0, a1, a2, a3, a4, a5, a6, a7};
    const kiln_u64 s1[8] = {b0, b1, b2, b3, b4, b5, b6, b7};
    kiln_u64 sum_n = 1;
    for (unsigned k = n_out; k < n_labels; ++k) sum_n *= size[k];
    KILN_FOR(i, total) {
        kiln_u64 base0 = 0, base1 = 0, r = i;
        for (int k = (int)n_out - 1; k >= 0; --k) {
            const kiln_u64 v = r % size[k];
            r /= size[k];
            base0 += v * s0[k];
            base1 += v * s1[k];
        }
        A acc = 0;
        for (kiln_u64 s = 0; s < sum_n; ++s) {
            kiln_u64 o0 = base0, o1 = base1, q = s;
            for (int k = (int)n_labels - 1; k >= (int)n_out; --k) {
                const kiln_u64 v = q % size[k];
                q /= size[k];
                o0 += v * s0[k];
                o1 += v * s1[k];
            }
            A p = (A)E::ld(x0[o0]);
            if (n_inputs > 1) p *= (A)E::ld(x1[o1]);
            acc += p;
        }
        y[i] = E::st(acc);
    }
}

// DFT (shim/src/dft.rs): x [outer, n_in, inner, 1 | 2] → y [outer, n_out, inner, 2], one thread
// per output value (re or im), summed in f64 over min(n, n_in) samples with twiddles from
// (k·m mod n).
template <typename Tag>
__global__ void kiln_dft(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 total, kiln_u64 n_in,
                         kiln_u64 inner, kiln_u64 n, kiln_u64 n_out, unsigned complex, unsigned inverse) {
    typedef kiln_elem<Tag> E;
    const unsigned c = complex ? 2 : 1;
    const double sign = inverse ? 1.0 : -1.0, pi2 = 6.283185307179586476925286766559;
    const kiln_u64 len = n < n_in ? n : n_in;
    KILN_FOR(t, total) {
        const unsigned part = (unsigned)(t & 1);
        const kiln_u64 e = t >> 1, i = e % inner, k = (e / inner) % n_out, o = e / (inner * n_out);
        double acc = 0.0;
        for (kiln_u64 m = 0; m < len; ++m) {
            const kiln_u64 at = ((o * n_in + m) * inner + i) * c;
            const double xr = (double)E::ld(x[at]), xi = complex ? (double)E::ld(x[at + 1]) : 0.0;
            double sn, cs;
            sincos(sign * pi2 * (double)((k * m) % n) / (double)n, &sn, &cs);
            acc += part == 0 ? xr * cs - xi * sn : xr * sn + xi * cs;
        }
        y[t] = E::st((typename E::C)(inverse ? acc / (double)n : acc));
    }
}

// Det (shim/src/det.rs): one thread per matrix, LU with partial pivoting over its f64 copy in
// `work` (m·m doubles per matrix).
template <typename Tag>
__global__ void kiln_det(const typename Tag::storage* x, double* work, typename Tag::storage* y, kiln_u64 n,
                         kiln_u64 m) {
    typedef kiln_elem<Tag> E;
    KILN_FOR(b, n) {
        double* a = work + b * m * m;
        for (kiln_u64 i = 0; i < m * m; ++i) a[i] = (double)E::ld(x[b * m * m + i]);
        double d = 1.0;
        for (kiln_u64 k = 0; k < m && d != 0.0; ++k) {
            kiln_u64 p = k;
            for (kiln_u64 i = k + 1; i < m; ++i)
                if (fabs(a[i * m + k]) > fabs(a[p * m + k])) p = i;
            if (a[p * m + k] == 0.0) {
                d = 0.0;
                break;
            }
            if (p != k) {
                for (kiln_u64 j = 0; j < m; ++j) {
                    const double t = a[k * m + j];
                    a[k * m + j] = a[p * m + j];
                    a[p * m + j] = t;
                }
                d = -d;
            }
            const double pivot = a[k * m + k];
            d *= pivot;
            for (kiln_u64 i = k + 1; i < m; ++i) {
                const double f = a[i * m + k] / pivot;
                for (kiln_u64 j = k + 1; j < m; ++j) a[i * m + j] -= f * a[k * m + j];
            }
        }
        y[b] = E::st((typename E::C)d);
    }
}

// STFT (shim/src/stft.rs): output value t = ((b, f, k), re or im) of [B, frames, bins, 2], summed
// in f64 over the frame's n samples, windowed (`has_window`), twiddles from (k·m mod n).
template <typename Tag>
__global__ void kiln_stft(const typename Tag::storage* x, const typename Tag::storage* window,
                          typename Tag::storage* y, kiln_u64 total, kiln_u64 len, kiln_u64 step, kiln_u64 n,
                          kiln_u64 frames, kiln_u64 bins, unsigned complex, unsigned has_window) {
    typedef kiln_elem<Tag> E;
    const unsigned c = complex ? 2 : 1;
    const double pi2 = 6.283185307179586476925286766559;
    KILN_FOR(t, total) {
        const unsigned part = (unsigned)(t & 1);
        const kiln_u64 e = t >> 1, k = e % bins, f = (e / bins) % frames, b = e / (bins * frames);
        double acc = 0.0;
        for (kiln_u64 m = 0; m < n; ++m) {
            const kiln_u64 at = (b * len + f * step + m) * c;
            const double wm = has_window ? (double)E::ld(window[m]) : 1.0;
            const double xr = (double)E::ld(x[at]) * wm, xi = complex ? (double)E::ld(x[at + 1]) * wm : 0.0;
            double sn, cs;
            sincos(-pi2 * (double)((k * m) % n) / (double)n, &sn, &cs);
            acc += part == 0 ? xr * cs - xi * sn : xr * sn + xi * cs;
        }
        y[t] = E::st((typename E::C)acc);
    }
}

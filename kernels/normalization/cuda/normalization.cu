// kiln-normalization CUDA kernels: Softmax / LogSoftmax, LayerNormalization, onnxruntime's
// SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization. Statistics accumulate in f32
// (f64 when a float64 tensor takes part), with warp reductions.
//
// Row kernels take [rows, cols] contiguous data: blockDim.x threads per row (a multiple of 32),
// blockDim.y rows per block (blockDim.y > 1 only with blockDim.x == 32), rows beyond the grid
// looped over. Scale / bias tensors broadcast as suffixes of X: element k of X (row-major) uses
// element k % len (the shim materialises other broadcasts with kiln_norm_expand first).
//
// Entry points are templates over the prelude's dtype tags (kiln_tag_f32 f16 bf16 f64):
// kiln_softmax_rows<Tag>, kiln_softmax_cols<Tag>, kiln_layer_norm<Tag>, kiln_skip_rms_norm<Tag>
// and kiln_rms_norm<XTag, YTag>; kernel.toml lists the instantiations (name expressions,
// manifest schema 6), which NVRTC lowers; the shim names them with DType::cuda_tag.
// kiln_norm_expand (bytes) is extern "C".
#include "kiln.cuh"

struct nf16 { unsigned short b; };
struct nbf16 { unsigned short b; };

// The storage type T and the accumulator A the device code takes, by the prelude's tag of the
// dtype: float16 and bfloat16 as this package's own structs; statistics in f32, f64 for float64.
template <typename Tag> struct NElem;
template <> struct NElem<kiln_tag_f32> { typedef float T; typedef float A; };
template <> struct NElem<kiln_tag_f16> { typedef nf16 T; typedef float A; };
template <> struct NElem<kiln_tag_bf16> { typedef nbf16 T; typedef float A; };
template <> struct NElem<kiln_tag_f64> { typedef double T; typedef double A; };

// The accumulator of two tensors' accumulators (rms_norm's x and scale): f64 when either is.
template <typename A1, typename A2> struct NAcc { typedef float A; };
template <typename A2> struct NAcc<double, A2> { typedef double A; };
template <typename A1> struct NAcc<A1, double> { typedef double A; };
template <> struct NAcc<double, double> { typedef double A; };

__device__ __forceinline__ float nld(const float* p, kiln_u64 i) { return p[i]; }
__device__ __forceinline__ double nld(const double* p, kiln_u64 i) { return p[i]; }
__device__ __forceinline__ float nld(const nf16* p, kiln_u64 i) { return kiln_f16_to_f32(p[i].b); }
__device__ __forceinline__ float nld(const nbf16* p, kiln_u64 i) { return kiln_bf16_to_f32(p[i].b); }
__device__ __forceinline__ void nst(float* p, kiln_u64 i, float v) { p[i] = v; }
__device__ __forceinline__ void nst(double* p, kiln_u64 i, double v) { p[i] = v; }
__device__ __forceinline__ void nst(nf16* p, kiln_u64 i, float v) { p[i].b = kiln_f32_to_f16(v); }
__device__ __forceinline__ void nst(nbf16* p, kiln_u64 i, float v) { p[i].b = kiln_f32_to_bf16(v); }

// Stores v as ONNX dtype `code` (1 float32, 10 float16, 11 float64, 16 bfloat16).
__device__ __forceinline__ void nst_code(void* p, kiln_u64 i, double v, unsigned code) {
    switch (code) {
    case 1: ((float*)p)[i] = (float)v; break;
    case 10: ((unsigned short*)p)[i] = kiln_f32_to_f16((float)v); break;
    case 11: ((double*)p)[i] = v; break;
    case 16: ((unsigned short*)p)[i] = kiln_f32_to_bf16((float)v); break;
    default: break;
    }
}

__device__ __forceinline__ float n_exp(float v) { return expf(v); }
__device__ __forceinline__ double n_exp(double v) { return exp(v); }
__device__ __forceinline__ float n_log(float v) { return logf(v); }
__device__ __forceinline__ double n_log(double v) { return log(v); }
__device__ __forceinline__ float n_sqrt(float v) { return sqrtf(v); }
__device__ __forceinline__ double n_sqrt(double v) { return sqrt(v); }
__device__ __forceinline__ float n_ninf(float) { return __int_as_float(0xff800000); }
__device__ __forceinline__ double n_ninf(double) { return __longlong_as_double(0xfff0000000000000ll); }

// Max that propagates NaN, as the CPU reference.
template <typename A> __device__ __forceinline__ A n_max(A a, A b) {
    if (a != a) return a;
    return (b != b || b > a) ? b : a;
}
struct NSum { template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return a + b; } };
struct NMax { template <typename A> __device__ __forceinline__ A operator()(A a, A b) const { return n_max(a, b); } };

// Reduces v over the blockDim.x threads of the row; every thread of the row gets the result.
// Called by every thread of the block when blockDim.x > 32.
template <typename A, typename Op> __device__ __forceinline__ A row_reduce(A v, Op op) {
    for (int o = 16; o > 0; o >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, o));
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

#define ROW_LOOP(row, rows) \
    for (kiln_u64 row = (kiln_u64)blockIdx.x * blockDim.y + threadIdx.y; row < (rows); row += (kiln_u64)gridDim.x * blockDim.y)
#define COL_LOOP(c, cols) for (kiln_u64 c = threadIdx.x; c < (cols); c += blockDim.x)

// Element k (column c of a row of `cols`) of a suffix-broadcast operand of `len` elements,
// without a 64-bit division in the common cases (one row's worth, or the whole tensor).
__device__ __forceinline__ kiln_u64 suffix_idx(kiln_u64 k, kiln_u64 c, kiln_u64 cols, kiln_u64 len) {
    return len == cols ? c : (k < len ? k : k % len);
}

// ---- Softmax / LogSoftmax ------------------------------------------------------------------

template <typename T, typename A>
__device__ void softmax_rows(const T* x, T* y, kiln_u64 rows, kiln_u64 n, unsigned log_out) {
    ROW_LOOP(row, rows) {
        const kiln_u64 base = row * n;
        A m = n_ninf(A());
        COL_LOOP(j, n) m = n_max(m, (A)nld(x, base + j));
        m = row_reduce(m, NMax());
        A s = 0;
        COL_LOOP(j, n) s += n_exp((A)nld(x, base + j) - m);
        s = row_reduce(s, NSum());
        if (log_out) {
            const A lse = m + n_log(s);
            COL_LOOP(j, n) nst(y, base + j, (A)nld(x, base + j) - lse);
        } else {
            COL_LOOP(j, n) nst(y, base + j, n_exp((A)nld(x, base + j) - m) / s);
        }
    }
}

// [outer, n, inner] with inner > 1: one thread per (outer, inner) column.
template <typename T, typename A>
__device__ void softmax_cols(const T* x, T* y, kiln_u64 outer, kiln_u64 n, kiln_u64 inner, unsigned log_out) {
    KILN_FOR(t, outer * inner) {
        const kiln_u64 o = t / inner, i = t - o * inner;
        const kiln_u64 base = o * n * inner + i;
        A m = n_ninf(A());
        for (kiln_u64 j = 0; j < n; ++j) m = n_max(m, (A)nld(x, base + j * inner));
        A s = 0;
        for (kiln_u64 j = 0; j < n; ++j) s += n_exp((A)nld(x, base + j * inner) - m);
        if (log_out) {
            const A lse = m + n_log(s);
            for (kiln_u64 j = 0; j < n; ++j) nst(y, base + j * inner, (A)nld(x, base + j * inner) - lse);
        } else {
            for (kiln_u64 j = 0; j < n; ++j) nst(y, base + j * inner, n_exp((A)nld(x, base + j * inner) - m) / s);
        }
    }
}

// ---- LayerNormalization ----------------------------------------------------------------------

// y = (x - mean) · inv_std · scale (+ bias); Mean and InvStdDev (dtype stat_code) when has_*.
template <typename T, typename A>
__device__ void layer_norm(const T* x, const T* scale, const T* bias, T* y, void* mean_out, void* inv_out,
                           kiln_u64 rows, kiln_u64 cols, kiln_u64 scale_len, kiln_u64 bias_len, unsigned has_bias,
                           float eps, unsigned stat_code, unsigned has_mean, unsigned has_inv) {
    ROW_LOOP(row, rows) {
        const kiln_u64 base = row * cols;
        A s = 0;
        COL_LOOP(c, cols) s += (A)nld(x, base + c);
        const A mean = row_reduce(s, NSum()) / (A)cols;
        A q = 0;
        COL_LOOP(c, cols) {
            const A d = (A)nld(x, base + c) - mean;
            q += d * d;
        }
        const A var = row_reduce(q, NSum()) / (A)cols;
        const A inv_std = (A)1 / n_sqrt(var + (A)eps);
        COL_LOOP(c, cols) {
            const kiln_u64 k = base + c;
            A v = ((A)nld(x, k) - mean) * inv_std * (A)nld(scale, suffix_idx(k, c, cols, scale_len));
            if (has_bias) v += (A)nld(bias, suffix_idx(k, c, cols, bias_len));
            nst(y, k, v);
        }
        if (threadIdx.x == 0) {
            if (has_mean) nst_code(mean_out, row, (double)mean, stat_code);
            if (has_inv) nst_code(inv_out, row, (double)inv_std, stat_code);
        }
    }
}

// ---- RMS normalisations (onnxruntime) ---------------------------------------------------------

// SimplifiedLayerNormalization: y = x · inv_std · scale, inv_std = 1 / sqrt(mean(x²) + eps); Y has
// scale's dtype.
template <typename X, typename Y, typename A>
__device__ void rms_norm(const X* x, const Y* scale, Y* y, void* inv_out, kiln_u64 rows, kiln_u64 cols,
                         kiln_u64 scale_len, float eps, unsigned stat_code, unsigned has_inv) {
    ROW_LOOP(row, rows) {
        const kiln_u64 base = row * cols;
        A q = 0;
        COL_LOOP(c, cols) {
            const A v = (A)nld(x, base + c);
            q += v * v;
        }
        const A rms = n_sqrt(row_reduce(q, NSum()) / (A)cols + (A)eps);
        const A inv_std = (A)1 / rms;
        COL_LOOP(c, cols) {
            const kiln_u64 k = base + c;
            nst(y, k, (A)nld(x, k) / rms * (A)nld(scale, suffix_idx(k, c, cols, scale_len)));
        }
        if (threadIdx.x == 0 && has_inv) nst_code(inv_out, row, (double)inv_std, stat_code);
    }
}

// Elements per thread a SkipSimplifiedLayerNormalization row keeps in registers.
#define SKIP_RMS_CACHE 8

// SkipSimplifiedLayerNormalization: s = input + skip (+ bias), out = s · inv_std · gamma; mean
// (float32 zeros), inv_std_var (float32) and input_skip_bias_sum when has_*.
template <typename T, typename A>
__device__ void skip_rms_norm(const T* x, const T* skip, const T* gamma, const T* bias, T* out, float* mean_out,
                              float* inv_out, T* sum_out, kiln_u64 rows, kiln_u64 hidden, kiln_u64 skip_len,
                              unsigned has_bias, unsigned has_mean, unsigned has_inv, unsigned has_sum, float eps) {
    ROW_LOOP(row, rows) {
        const kiln_u64 base = row * hidden;
        A q = 0, rms;
        if (hidden <= (kiln_u64)SKIP_RMS_CACHE * blockDim.x) {
            // A row of at most SKIP_RMS_CACHE elements per thread stays in registers: every load
            // is issued before the first store (which the compiler must assume may alias them),
            // and the row is read once. Same arithmetic, in the same order, as the loop below.
            A v[SKIP_RMS_CACHE], g[SKIP_RMS_CACHE];
#pragma unroll
            for (int i = 0; i < SKIP_RMS_CACHE; ++i) {
                const kiln_u64 c = threadIdx.x + (kiln_u64)i * blockDim.x, k = base + c;
                v[i] = 0;
                g[i] = 0;
                if (c < hidden) {
                    A s = (A)nld(x, k) + (A)nld(skip, suffix_idx(k, c, hidden, skip_len));
                    if (has_bias) s += (A)nld(bias, c);
                    v[i] = s;
                    g[i] = (A)nld(gamma, c);
                    q += s * s;
                }
            }
            rms = n_sqrt(row_reduce(q, NSum()) / (A)hidden + (A)eps);
#pragma unroll
            for (int i = 0; i < SKIP_RMS_CACHE; ++i) {
                const kiln_u64 c = threadIdx.x + (kiln_u64)i * blockDim.x, k = base + c;
                if (c < hidden) {
                    if (has_sum) nst(sum_out, k, v[i]);
                    nst(out, k, v[i] / rms * g[i]);
                }
            }
        } else {
            COL_LOOP(c, hidden) {
                const kiln_u64 k = base + c;
                A v = (A)nld(x, k) + (A)nld(skip, suffix_idx(k, c, hidden, skip_len));
                if (has_bias) v += (A)nld(bias, c);
                if (has_sum) nst(sum_out, k, v);
                q += v * v;
            }
            rms = n_sqrt(row_reduce(q, NSum()) / (A)hidden + (A)eps);
            COL_LOOP(c, hidden) {
                const kiln_u64 k = base + c;
                A v = (A)nld(x, k) + (A)nld(skip, suffix_idx(k, c, hidden, skip_len));
                if (has_bias) v += (A)nld(bias, c);
                nst(out, k, v / rms * (A)nld(gamma, c));
            }
        }
        if (threadIdx.x == 0) {
            if (has_mean) mean_out[row] = 0.f;
            if (has_inv) inv_out[row] = (float)((A)1 / rms);
        }
    }
}

// ---- entry points ----------------------------------------------------------------------------

template <typename Tag>
__global__ void kiln_softmax_rows(const typename NElem<Tag>::T* x, typename NElem<Tag>::T* y, kiln_u64 rows,
                                  kiln_u64 n, unsigned log_out) {
    softmax_rows<typename NElem<Tag>::T, typename NElem<Tag>::A>(x, y, rows, n, log_out);
}

template <typename Tag>
__global__ void kiln_softmax_cols(const typename NElem<Tag>::T* x, typename NElem<Tag>::T* y, kiln_u64 outer,
                                  kiln_u64 n, kiln_u64 inner, unsigned log_out) {
    softmax_cols<typename NElem<Tag>::T, typename NElem<Tag>::A>(x, y, outer, n, inner, log_out);
}

template <typename Tag>
__global__ void kiln_layer_norm(const typename NElem<Tag>::T* x, const typename NElem<Tag>::T* scale,
                                const typename NElem<Tag>::T* bias, typename NElem<Tag>::T* y, void* mean_out,
                                void* inv_out, kiln_u64 rows, kiln_u64 cols, kiln_u64 scale_len, kiln_u64 bias_len,
                                unsigned has_bias, float eps, unsigned stat_code, unsigned has_mean,
                                unsigned has_inv) {
    layer_norm<typename NElem<Tag>::T, typename NElem<Tag>::A>(x, scale, bias, y, mean_out, inv_out, rows, cols,
                                                               scale_len, bias_len, has_bias, eps, stat_code,
                                                               has_mean, has_inv);
}

template <typename Tag>
__global__ void kiln_skip_rms_norm(const typename NElem<Tag>::T* x, const typename NElem<Tag>::T* skip,
                                   const typename NElem<Tag>::T* gamma, const typename NElem<Tag>::T* bias,
                                   typename NElem<Tag>::T* out, float* mean_out, float* inv_out,
                                   typename NElem<Tag>::T* sum_out, kiln_u64 rows, kiln_u64 hidden,
                                   kiln_u64 skip_len, unsigned has_bias, unsigned has_mean, unsigned has_inv,
                                   unsigned has_sum, float eps) {
    skip_rms_norm<typename NElem<Tag>::T, typename NElem<Tag>::A>(x, skip, gamma, bias, out, mean_out, inv_out,
                                                                  sum_out, rows, hidden, skip_len, has_bias,
                                                                  has_mean, has_inv, has_sum, eps);
}

// X and Y (scale's dtype, the output's) by their tags; f64 statistics when either is float64.
template <typename XTag, typename YTag>
__global__ void kiln_rms_norm(const typename NElem<XTag>::T* x, const typename NElem<YTag>::T* scale,
                              typename NElem<YTag>::T* y, void* inv_out, kiln_u64 rows, kiln_u64 cols,
                              kiln_u64 scale_len, float eps, unsigned stat_code, unsigned has_inv) {
    rms_norm<typename NElem<XTag>::T, typename NElem<YTag>::T,
             typename NAcc<typename NElem<XTag>::A, typename NElem<YTag>::A>::A>(x, scale, y, inv_out, rows, cols,
                                                                                 scale_len, eps, stat_code, has_inv);
}

// dst (n elements of esize bytes, row-major over dims[0..rank]) = src broadcast: element index
// sum(i_d · strides[d]) of src, strides 0 on broadcast dimensions.
extern "C" __global__ void kiln_norm_expand(const unsigned char* src, unsigned char* dst, kiln_u64 n, unsigned esize,
                                            unsigned rank, kiln_u64 d0, kiln_u64 d1, kiln_u64 d2, kiln_u64 d3,
                                            kiln_u64 d4, kiln_u64 d5, kiln_u64 d6, kiln_u64 d7, kiln_u64 s0,
                                            kiln_u64 s1, kiln_u64 s2, kiln_u64 s3, kiln_u64 s4, kiln_u64 s5,
                                            kiln_u64 s6, kiln_u64 s7) {
    const kiln_u64 dims[8] = {d0, d1, d2, d3, d4, d5, d6, d7};
    const kiln_u64 strides[8] = {s0, s1, s2, s3, s4, s5, s6, s7};
    KILN_FOR(i, n) {
        kiln_u64 r = i, off = 0;
        for (int d = (int)rank - 1; d >= 0; --d) {
            const kiln_u64 q = r / dims[d];
            off += (r - q * dims[d]) * strides[d];
            r = q;
        }
        for (unsigned b = 0; b < esize; ++b) dst[i * esize + b] = src[off * esize + b];
    }
}

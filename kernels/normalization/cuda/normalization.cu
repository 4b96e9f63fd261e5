// kiln-normalization CUDA kernels: Softmax / LogSoftmax, LpNormalization, LayerNormalization, onnxruntime's
// SimplifiedLayerNormalization and SkipSimplifiedLayerNormalization. Statistics accumulate in f32
// (f64 when a float64 tensor takes part), with warp reductions.
//
// Row kernels take [rows, cols] contiguous data: blockDim.x threads per row (a multiple of 32),
// blockDim.y rows per block (blockDim.y > 1 only with blockDim.x == 32), rows beyond the grid
// looped over. Scale / bias tensors broadcast as suffixes of X: element k of X (row-major) uses
// element k % len (the shim materialises other broadcasts with kiln_norm_expand first).
//
// Entry points are templates over the prelude's dtype tags (kiln_tag_f32 f16 bf16 f64):
// kiln_softmax_rows<Tag>, kiln_softmax_cols<Tag>, kiln_lp_norm_rows<Tag>, kiln_lp_norm_cols<Tag>,
// kiln_layer_norm<Tag>, kiln_group_norm<Tag>, kiln_skip_rms_norm<Tag>, kiln_skip_layer_norm<Tag>
// and kiln_rms_norm<XTag, YTag>; kernel.toml lists the instantiations (name expressions,
// manifest schema 6), which NVRTC lowers; the shim names them with DType::cuda_tag.
// kiln_norm_expand (bytes) is extern "C".
#include "kiln.cuh"
#include "kiln-cuda-std/elem.cuh"
#include "kiln-cuda-std/reduce.cuh"
#include "kiln-cuda-std/math.cuh"
#include "kiln-cuda-std/vec.cuh"

// Element types by the prelude's dtype tag come from kiln-cuda-std's kiln_elem<Tag>: storage S,
// ld / st, and C, the type statistics accumulate in (f32; f64 for float64).

// The accumulator of two tensors' accumulators (rms_norm's x and scale): f64 when either is.
template <typename A1, typename A2> struct NAcc { typedef float A; };
template <typename A2> struct NAcc<double, A2> { typedef double A; };
template <typename A1> struct NAcc<A1, double> { typedef double A; };
template <> struct NAcc<double, double> { typedef double A; };

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

// Reduces v over the blockDim.x threads of the row; every thread of the row gets the result.
// Called by every thread of the block when blockDim.x > 32.
template <typename A, typename Op> __device__ __forceinline__ A row_reduce(A v, Op op) {
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

#define ROW_LOOP(row, rows) \
    for (kiln_u64 row = (kiln_u64)blockIdx.x * blockDim.y + threadIdx.y; row < (rows); row += (kiln_u64)gridDim.x * blockDim.y)
#define COL_LOOP(c, cols) for (kiln_u64 c = threadIdx.x; c < (cols); c += blockDim.x)

// Element k (column c of a row of `cols`) of a suffix-broadcast operand of `len` elements,
// without a 64-bit division in the common cases (one row's worth, or the whole tensor).
__device__ __forceinline__ kiln_u64 suffix_idx(kiln_u64 k, kiln_u64 c, kiln_u64 cols, kiln_u64 len) {
    return len == cols ? c : (k < len ? k : k % len);
}

// ---- Softmax / LogSoftmax ------------------------------------------------------------------

template <typename Tag, typename T = typename Tag::storage, typename E = kiln_elem<Tag>,
          typename A = typename kiln_elem<Tag>::C>
__device__ void softmax_rows(const T* x, T* y, kiln_u64 rows, kiln_u64 n, unsigned log_out) {
    ROW_LOOP(row, rows) {
        const kiln_u64 base = row * n;
        A m = kiln_neg_inf<A>();
        COL_LOOP(j, n) m = kiln_max_nan(m, (A)E::ld(x[base + j]));
        m = row_reduce(m, kiln_op_max());
        A s = 0;
        COL_LOOP(j, n) s += kiln_exp((A)E::ld(x[base + j]) - m);
        s = row_reduce(s, kiln_op_sum());
        if (log_out) {
            const A lse = m + kiln_log(s);
            COL_LOOP(j, n) y[base + j] = E::st((A)E::ld(x[base + j]) - lse);
        } else {
            COL_LOOP(j, n) y[base + j] = E::st(kiln_exp((A)E::ld(x[base + j]) - m) / s);
        }
    }
}

// [outer, n, inner] with inner > 1: one thread per (outer, inner) column.
template <typename Tag, typename T = typename Tag::storage, typename E = kiln_elem<Tag>,
          typename A = typename kiln_elem<Tag>::C>
__device__ void softmax_cols(const T* x, T* y, kiln_u64 outer, kiln_u64 n, kiln_u64 inner, unsigned log_out) {
    KILN_FOR(t, outer * inner) {
        const kiln_u64 o = t / inner, i = t - o * inner;
        const kiln_u64 base = o * n * inner + i;
        A m = kiln_neg_inf<A>();
        for (kiln_u64 j = 0; j < n; ++j) m = kiln_max_nan(m, (A)E::ld(x[base + j * inner]));
        A s = 0;
        for (kiln_u64 j = 0; j < n; ++j) s += kiln_exp((A)E::ld(x[base + j * inner]) - m);
        if (log_out) {
            const A lse = m + kiln_log(s);
            for (kiln_u64 j = 0; j < n; ++j) y[base + j * inner] = E::st((A)E::ld(x[base + j * inner]) - lse);
        } else {
            for (kiln_u64 j = 0; j < n; ++j)
                y[base + j * inner] = E::st(kiln_exp((A)E::ld(x[base + j * inner]) - m) / s);
        }
    }
}

// ---- MeanVarianceNormalization ---------------------------------------------------------------

// Offset of reduced index r within kept index k over eight dims (bit i of `mask`: dim i reduced).
__device__ __forceinline__ kiln_u64 mvn_offset(kiln_u64 k, kiln_u64 r, const kiln_u64* dims, unsigned mask) {
    kiln_u64 off = 0, stride = 1;
    for (int i = 7; i >= 0; --i) {
        const kiln_u64 d = dims[i];
        kiln_u64 idx;
        if (mask >> i & 1u) {
            idx = r % d;
            r /= d;
        } else {
            idx = k % d;
            k /= d;
        }
        off += idx * stride;
        stride *= d;
    }
    return off;
}

// y = (x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9) over the reduced dims (a variance rounding
// below 0 counts as 0): one block per kept index (blocks loop over the rest), sums in f64.
template <typename Tag, typename T = typename Tag::storage, typename E = kiln_elem<Tag>, typename A = double>
__device__ void mvn(const T* x, T* y, kiln_u64 kept, kiln_u64 per, unsigned mask, const kiln_u64* dims) {
    __shared__ A red[32];
    for (kiln_u64 k = blockIdx.x; k < kept; k += gridDim.x) {
        A s = 0, s2 = 0;
        for (kiln_u64 r = threadIdx.x; r < per; r += blockDim.x) {
            const A v = (A)E::ld(x[mvn_offset(k, r, dims, mask)]);
            s += v;
            s2 += v * v;
        }
        s = kiln_block_reduce_by(s, red, kiln_op_sum());
        s2 = kiln_block_reduce_by(s2, red, kiln_op_sum());
        const A mean = s / (A)per;
        const A var = s2 / (A)per - mean * mean;
        const A denom = sqrt(var > 0 ? var : (A)0) + (A)1e-9;
        for (kiln_u64 r = threadIdx.x; r < per; r += blockDim.x) {
            const kiln_u64 at = mvn_offset(k, r, dims, mask);
            y[at] = E::st((typename E::C)(((A)E::ld(x[at]) - mean) / denom));
        }
    }
}

template <typename Tag>
__global__ void kiln_mvn(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 kept, kiln_u64 per,
                         unsigned mask, kiln_u64 d0, kiln_u64 d1, kiln_u64 d2, kiln_u64 d3, kiln_u64 d4, kiln_u64 d5,
                         kiln_u64 d6, kiln_u64 d7) {
    const kiln_u64 dims[8] = {d0, d1, d2, d3, d4, d5, d6, d7};
    mvn<Tag>(x, y, kept, per, mask, dims);
}

// ---- LpNormalization -------------------------------------------------------------------------

// y = x / ‖x‖_p along the row (p 1: Σ|x|; 2: √Σx²); a zero norm divides as IEEE 754 does.
template <typename A>
__device__ __forceinline__ A lp_term(A v, unsigned p) {
    return p == 1 ? kiln_abs(v) : v * v;
}

template <typename A>
__device__ __forceinline__ A lp_norm_of(A s, unsigned p) {
    return p == 1 ? s : kiln_sqrt(s);
}

template <typename Tag, typename T = typename Tag::storage, typename E = kiln_elem<Tag>,
          typename A = typename kiln_elem<Tag>::C>
__device__ void lp_norm_rows(const T* x, T* y, kiln_u64 rows, kiln_u64 n, unsigned p) {
    ROW_LOOP(row, rows) {
        const kiln_u64 base = row * n;
        A s = 0;
        COL_LOOP(j, n) s += lp_term((A)E::ld(x[base + j]), p);
        const A norm = lp_norm_of(row_reduce(s, kiln_op_sum()), p);
        COL_LOOP(j, n) y[base + j] = E::st((A)E::ld(x[base + j]) / norm);
    }
}

// [outer, n, inner] with inner > 1: one thread per (outer, inner) column.
template <typename Tag, typename T = typename Tag::storage, typename E = kiln_elem<Tag>,
          typename A = typename kiln_elem<Tag>::C>
__device__ void lp_norm_cols(const T* x, T* y, kiln_u64 outer, kiln_u64 n, kiln_u64 inner, unsigned p) {
    KILN_FOR(t, outer * inner) {
        const kiln_u64 o = t / inner, i = t - o * inner;
        const kiln_u64 base = o * n * inner + i;
        A s = 0;
        for (kiln_u64 j = 0; j < n; ++j) s += lp_term((A)E::ld(x[base + j * inner]), p);
        const A norm = lp_norm_of(s, p);
        for (kiln_u64 j = 0; j < n; ++j)
            y[base + j * inner] = E::st((A)E::ld(x[base + j * inner]) / norm);
    }
}

// ---- LayerNormalization ----------------------------------------------------------------------

// The mean and 1 / sqrt(variance + eps) (population variance) of the row of `cols` elements at
// x + base, every thread of the row getting them (LayerNormalization, GroupNormalization).
template <typename E, typename A, typename T>
__device__ __forceinline__ void row_stats(const T* x, kiln_u64 base, kiln_u64 cols, float eps, A* mean, A* inv_std) {
    A s = 0;
    COL_LOOP(c, cols) s += (A)E::ld(x[base + c]);
    const A m = row_reduce(s, kiln_op_sum()) / (A)cols;
    A q = 0;
    COL_LOOP(c, cols) {
        const A d = (A)E::ld(x[base + c]) - m;
        q += d * d;
    }
    *mean = m;
    *inv_std = (A)1 / kiln_sqrt(row_reduce(q, kiln_op_sum()) / (A)cols + (A)eps);
}

// y = (x - mean) · inv_std · scale (+ bias); Mean and InvStdDev (dtype stat_code) when has_*.
template <typename Tag, typename T = typename Tag::storage, typename E = kiln_elem<Tag>,
          typename A = typename kiln_elem<Tag>::C>
__device__ void layer_norm(const T* x, const T* scale, const T* bias, T* y, void* mean_out, void* inv_out,
                           kiln_u64 rows, kiln_u64 cols, kiln_u64 scale_len, kiln_u64 bias_len, unsigned has_bias,
                           float eps, unsigned stat_code, unsigned has_mean, unsigned has_inv) {
    ROW_LOOP(row, rows) {
        const kiln_u64 base = row * cols;
        A mean, inv_std;
        row_stats<E>(x, base, cols, eps, &mean, &inv_std);
        COL_LOOP(c, cols) {
            const kiln_u64 k = base + c;
            A v = ((A)E::ld(x[k]) - mean) * inv_std * (A)E::ld(scale[suffix_idx(k, c, cols, scale_len)]);
            if (has_bias) v += (A)E::ld(bias[suffix_idx(k, c, cols, bias_len)]);
            y[k] = E::st(v);
        }
        if (threadIdx.x == 0) {
            if (has_mean) nst_code(mean_out, row, (double)mean, stat_code);
            if (has_inv) nst_code(inv_out, row, (double)inv_std, stat_code);
        }
    }
}

// GroupNormalization and InstanceNormalization: row r = (n, group g) of `cols` = channels per
// group × spatial elements; element c of the row is channel g·cpg + c / spatial, whose scale and
// bias are that channel's (per_channel) or the group's.
template <typename Tag, typename T = typename Tag::storage, typename E = kiln_elem<Tag>,
          typename A = typename kiln_elem<Tag>::C>
__device__ void group_norm(const T* x, const T* scale, const T* bias, T* y, kiln_u64 rows, kiln_u64 cols,
                           kiln_u64 groups, kiln_u64 cpg, kiln_u64 spatial, unsigned per_channel, float eps) {
    ROW_LOOP(row, rows) {
        const kiln_u64 base = row * cols, g = row % groups;
        A mean, inv_std;
        row_stats<E>(x, base, cols, eps, &mean, &inv_std);
        COL_LOOP(c, cols) {
            const kiln_u64 at = per_channel ? g * cpg + c / spatial : g;
            y[base + c] = E::st(((A)E::ld(x[base + c]) - mean) * inv_std * (A)E::ld(scale[at]) + (A)E::ld(bias[at]));
        }
    }
}

template <typename Tag>
__global__ void kiln_group_norm(const typename Tag::storage* x, const typename Tag::storage* scale,
                                const typename Tag::storage* bias, typename Tag::storage* y, kiln_u64 rows,
                                kiln_u64 cols, kiln_u64 groups, kiln_u64 cpg, kiln_u64 spatial, unsigned per_channel,
                                float eps) {
    group_norm<Tag>(x, scale, bias, y, rows, cols, groups, cpg, spatial, per_channel, eps);
}

// ---- RMS normalisations (onnxruntime) ---------------------------------------------------------

// SimplifiedLayerNormalization: y = x · inv_std · scale, inv_std = 1 / sqrt(mean(x²) + eps); Y has
// scale's dtype.
template <typename XTag, typename YTag, typename A, typename X = typename XTag::storage,
          typename Y = typename YTag::storage, typename EX = kiln_elem<XTag>, typename EY = kiln_elem<YTag> >
__device__ void rms_norm(const X* x, const Y* scale, Y* y, void* inv_out, kiln_u64 rows, kiln_u64 cols,
                         kiln_u64 scale_len, float eps, unsigned stat_code, unsigned has_inv) {
    ROW_LOOP(row, rows) {
        const kiln_u64 base = row * cols;
        A q = 0;
        COL_LOOP(c, cols) {
            const A v = (A)EX::ld(x[base + c]);
            q += v * v;
        }
        const A rms = kiln_sqrt(row_reduce(q, kiln_op_sum()) / (A)cols + (A)eps);
        const A inv_std = (A)1 / rms;
        COL_LOOP(c, cols) {
            const kiln_u64 k = base + c;
            y[k] = EY::st((A)EX::ld(x[k]) / rms * (A)EY::ld(scale[suffix_idx(k, c, cols, scale_len)]));
        }
        if (threadIdx.x == 0 && has_inv) nst_code(inv_out, row, (double)inv_std, stat_code);
    }
}

// One element of a skip row: s = x + skip (+ bias), rounded to the dtype when CENTER (as the Add
// SkipLayerNormalization replaces stores it), into v; its gamma into g; and s into the row's first
// statistic: t += s (CENTER) or q += s² (the RMS form).
template <bool CENTER, typename E, typename A, typename T>
__device__ __forceinline__ void skip_elem(T x, T skip, T bias, unsigned has_bias, T gamma, A& v, A& g, A& t, A& q) {
    A s = (A)E::ld(x) + (A)E::ld(skip);
    if (has_bias) s += (A)E::ld(bias);
    if (CENTER) s = (A)E::ld(E::st(s));
    v = s;
    g = (A)E::ld(gamma);
    if (CENTER)
        t += s;
    else
        q += s * s;
}

// Elements per thread a SkipSimplifiedLayerNormalization row keeps in registers.
#define SKIP_RMS_CACHE 8

// SkipSimplifiedLayerNormalization (CENTER false): s = input + skip (+ bias), out = s · inv_std ·
// gamma, mean float32 zeros; SkipLayerNormalization (CENTER true): s rounded to the dtype (as the
// Add it replaces stores it), out = (s − mean) · inv_std · gamma (+ beta) with inv_std over the
// centred values, gamma and beta of one value broadcast (one_mask bit 0 / 1); mean and
// inv_std_var (float32) and input_skip_bias_sum when has_*.
template <bool CENTER, typename Tag, typename T = typename Tag::storage, typename E = kiln_elem<Tag>,
          typename A = typename kiln_elem<Tag>::C>
__device__ void skip_norm(const T* x, const T* skip, const T* gamma, const T* beta, const T* bias, T* out,
                          float* mean_out, float* inv_out, T* sum_out, kiln_u64 rows, kiln_u64 hidden,
                          kiln_u64 skip_len, unsigned has_beta, unsigned has_bias, unsigned has_mean,
                          unsigned has_inv, unsigned has_sum, float eps, unsigned one_mask = 0) {
    const kiln_u64 gmul = (one_mask & 1) ? 0 : 1, bmul = (one_mask & 2) ? 0 : 1;
    ROW_LOOP(row, rows) {
        const kiln_u64 base = row * hidden;
        A q = 0, rms, mean = 0;
        if (hidden <= (kiln_u64)SKIP_RMS_CACHE * blockDim.x) {
            // A row of at most SKIP_RMS_CACHE elements per thread stays in registers: every load
            // is issued before the first store (which the compiler must assume may alias them),
            // and the row is read once. Same arithmetic, in the same order, as the loop below.
            A v[SKIP_RMS_CACHE], g[SKIP_RMS_CACHE];
            A t = 0;
#pragma unroll
            for (int i = 0; i < SKIP_RMS_CACHE; ++i) {
                const kiln_u64 c = threadIdx.x + (kiln_u64)i * blockDim.x, k = base + c;
                v[i] = 0;
                g[i] = 0;
                if (c < hidden)
                    skip_elem<CENTER, E>(x[k], skip[suffix_idx(k, c, hidden, skip_len)], has_bias ? bias[c] : T(),
                                         has_bias, gamma[c * gmul], v[i], g[i], t, q);
            }
            if (CENTER) {
                mean = row_reduce(t, kiln_op_sum()) / (A)hidden;
#pragma unroll
                for (int i = 0; i < SKIP_RMS_CACHE; ++i) {
                    const kiln_u64 c = threadIdx.x + (kiln_u64)i * blockDim.x;
                    if (c < hidden) q += (v[i] - mean) * (v[i] - mean);
                }
            }
            rms = kiln_sqrt(row_reduce(q, kiln_op_sum()) / (A)hidden + (A)eps);
#pragma unroll
            for (int i = 0; i < SKIP_RMS_CACHE; ++i) {
                const kiln_u64 c = threadIdx.x + (kiln_u64)i * blockDim.x, k = base + c;
                if (c < hidden) {
                    if (has_sum) sum_out[k] = E::st(v[i]);
                    A o = (v[i] - mean) / rms * g[i];
                    if (CENTER && has_beta) o += (A)E::ld(beta[c * bmul]);
                    out[k] = E::st(o);
                }
            }
        } else {
            // s at column c of this row, read again in each pass.
            auto sum_at = [&](kiln_u64 c) {
                const kiln_u64 k = base + c;
                A v = (A)E::ld(x[k]) + (A)E::ld(skip[suffix_idx(k, c, hidden, skip_len)]);
                if (has_bias) v += (A)E::ld(bias[c]);
                return CENTER ? (A)E::ld(E::st(v)) : v;
            };
            if (CENTER) {
                A t = 0;
                COL_LOOP(c, hidden) t += sum_at(c);
                mean = row_reduce(t, kiln_op_sum()) / (A)hidden;
            }
            COL_LOOP(c, hidden) {
                const A v = sum_at(c);
                if (has_sum) sum_out[base + c] = E::st(v);
                q += (v - mean) * (v - mean);
            }
            rms = kiln_sqrt(row_reduce(q, kiln_op_sum()) / (A)hidden + (A)eps);
            COL_LOOP(c, hidden) {
                A o = (sum_at(c) - mean) / rms * (A)E::ld(gamma[c * gmul]);
                if (CENTER && has_beta) o += (A)E::ld(beta[c * bmul]);
                out[base + c] = E::st(o);
            }
        }
        if (threadIdx.x == 0) {
            if (has_mean) mean_out[row] = (float)mean;
            if (has_inv) inv_out[row] = (float)((A)1 / rms);
        }
    }
}

// Chunks of four a thread of skip_norm_vec keeps in registers (rows up to 8 · blockDim.x).
#define SKIP_VEC_CHUNKS 2

// Whether skip_norm_vec takes the row: whole chunks of four (hidden % 4 == 0), skip a whole
// number of rows, gamma and beta whole rows, every tensor it touches aligned to a chunk, and the
// row within SKIP_VEC_CHUNKS chunks a thread. Uniform over the grid.
template <typename T>
__device__ __forceinline__ bool skip_vec_ok(const T* x, const T* skip, const T* gamma, const T* beta, const T* bias,
                                            const T* out, const T* sum_out, kiln_u64 hidden, kiln_u64 skip_len,
                                            unsigned has_beta, unsigned has_bias, unsigned has_sum, unsigned one_mask) {
    const unsigned a = 4 * sizeof(T);
    return hidden != 0 && hidden % 4 == 0 && skip_len % hidden == 0 && one_mask == 0 &&
           hidden <= (kiln_u64)SKIP_VEC_CHUNKS * 4 * blockDim.x && kiln_aligned(x, a) && kiln_aligned(skip, a) &&
           kiln_aligned(gamma, a) && kiln_aligned(out, a) && (!has_beta || kiln_aligned(beta, a)) &&
           (!has_bias || kiln_aligned(bias, a)) && (!has_sum || kiln_aligned(sum_out, a));
}

// skip_norm over whole chunks of four (skip_vec_ok): each thread loads its chunks of x, skip,
// bias and gamma as single accesses of 4 · sizeof(T) bytes, keeps the row's sums in registers
// and writes out (and sum_out) the same way; one row's addresses, not one per element, stay live.
template <bool CENTER, typename Tag, typename T = typename Tag::storage, typename E = kiln_elem<Tag>,
          typename A = typename kiln_elem<Tag>::C>
__device__ void skip_norm_vec(const T* x, const T* skip, const T* gamma, const T* beta, const T* bias, T* out,
                              float* mean_out, float* inv_out, T* sum_out, kiln_u64 rows, kiln_u64 hidden,
                              kiln_u64 skip_len, unsigned has_beta, unsigned has_bias, unsigned has_mean,
                              unsigned has_inv, unsigned has_sum, float eps) {
    typedef kiln_vec<T, 4> V;
    const unsigned chunks = (unsigned)(hidden / 4);
    ROW_LOOP(row, rows) {
        const kiln_u64 base = row * hidden;
        const V* xr = (const V*)(x + base);
        const V* sr = (const V*)(skip + base % skip_len);
        A v[SKIP_VEC_CHUNKS][4], g[SKIP_VEC_CHUNKS][4];
        A t = 0, q = 0, mean = 0;
#pragma unroll
        for (int i = 0; i < SKIP_VEC_CHUNKS; ++i) {
            const unsigned c = threadIdx.x + i * blockDim.x;
#pragma unroll
            for (int e = 0; e < 4; ++e) v[i][e] = g[i][e] = 0;
            if (c < chunks) {
                const V xv = xr[c], sv = sr[c], gv = ((const V*)gamma)[c];
                V bv;
                if (has_bias) bv = ((const V*)bias)[c];
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    skip_elem<CENTER, E>(xv.e[e], sv.e[e], has_bias ? bv.e[e] : T(), has_bias, gv.e[e], v[i][e],
                                         g[i][e], t, q);
            }
        }
        if (CENTER) {
            mean = row_reduce(t, kiln_op_sum()) / (A)hidden;
#pragma unroll
            for (int i = 0; i < SKIP_VEC_CHUNKS; ++i)
                if (threadIdx.x + i * blockDim.x < chunks)
#pragma unroll
                    for (int e = 0; e < 4; ++e) q += (v[i][e] - mean) * (v[i][e] - mean);
        }
        const A rms = kiln_sqrt(row_reduce(q, kiln_op_sum()) / (A)hidden + (A)eps);
#pragma unroll
        for (int i = 0; i < SKIP_VEC_CHUNKS; ++i) {
            const unsigned c = threadIdx.x + i * blockDim.x;
            if (c >= chunks) continue;
            V ov, sv, bv;
            if (CENTER && has_beta) bv = ((const V*)beta)[c];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                sv.e[e] = E::st(v[i][e]);
                A o = (v[i][e] - mean) / rms * g[i][e];
                if (CENTER && has_beta) o += (A)E::ld(bv.e[e]);
                ov.e[e] = E::st(o);
            }
            ((V*)(out + base))[c] = ov;
            if (has_sum) ((V*)(sum_out + base))[c] = sv;
        }
        if (threadIdx.x == 0) {
            if (has_mean) mean_out[row] = (float)mean;
            if (has_inv) inv_out[row] = (float)((A)1 / rms);
        }
    }
}

// ---- entry points ----------------------------------------------------------------------------

template <typename Tag>
__global__ void kiln_softmax_rows(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 rows, kiln_u64 n,
                                  unsigned log_out) {
    softmax_rows<Tag>(x, y, rows, n, log_out);
}

template <typename Tag>
__global__ void kiln_softmax_cols(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 outer,
                                  kiln_u64 n, kiln_u64 inner, unsigned log_out) {
    softmax_cols<Tag>(x, y, outer, n, inner, log_out);
}

template <typename Tag>
__global__ void kiln_lp_norm_rows(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 rows, kiln_u64 n,
                                  unsigned p) {
    lp_norm_rows<Tag>(x, y, rows, n, p);
}

template <typename Tag>
__global__ void kiln_lp_norm_cols(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 outer,
                                  kiln_u64 n, kiln_u64 inner, unsigned p) {
    lp_norm_cols<Tag>(x, y, outer, n, inner, p);
}

template <typename Tag>
__global__ void kiln_layer_norm(const typename Tag::storage* x, const typename Tag::storage* scale,
                                const typename Tag::storage* bias, typename Tag::storage* y, void* mean_out,
                                void* inv_out, kiln_u64 rows, kiln_u64 cols, kiln_u64 scale_len, kiln_u64 bias_len,
                                unsigned has_bias, float eps, unsigned stat_code, unsigned has_mean,
                                unsigned has_inv) {
    layer_norm<Tag>(x, scale, bias, y, mean_out, inv_out, rows, cols, scale_len, bias_len, has_bias, eps, stat_code,
                    has_mean, has_inv);
}

template <typename Tag>
__global__ void __launch_bounds__(1024) kiln_skip_rms_norm(const typename Tag::storage* x, const typename Tag::storage* skip,
                                   const typename Tag::storage* gamma, const typename Tag::storage* bias,
                                   typename Tag::storage* out, float* mean_out, float* inv_out,
                                   typename Tag::storage* sum_out, kiln_u64 rows, kiln_u64 hidden, kiln_u64 skip_len,
                                   unsigned has_bias, unsigned has_mean, unsigned has_inv, unsigned has_sum,
                                   float eps) {
    if (skip_vec_ok(x, skip, gamma, gamma, bias, out, sum_out, hidden, skip_len, 0, has_bias, has_sum, 0))
        skip_norm_vec<false, Tag>(x, skip, gamma, gamma, bias, out, mean_out, inv_out, sum_out, rows, hidden, skip_len,
                                  0, has_bias, has_mean, has_inv, has_sum, eps);
    else
        skip_norm<false, Tag>(x, skip, gamma, gamma, bias, out, mean_out, inv_out, sum_out, rows, hidden, skip_len, 0,
                              has_bias, has_mean, has_inv, has_sum, eps);
}

template <typename Tag>
__global__ void __launch_bounds__(1024) kiln_skip_layer_norm(const typename Tag::storage* x, const typename Tag::storage* skip,
                                     const typename Tag::storage* gamma, const typename Tag::storage* beta,
                                     const typename Tag::storage* bias, typename Tag::storage* out, float* mean_out,
                                     float* inv_out, typename Tag::storage* sum_out, kiln_u64 rows, kiln_u64 hidden,
                                     kiln_u64 skip_len, unsigned has_beta, unsigned has_bias, unsigned has_mean,
                                     unsigned has_inv, unsigned has_sum, float eps, unsigned one_mask) {
    if (skip_vec_ok(x, skip, gamma, beta, bias, out, sum_out, hidden, skip_len, has_beta, has_bias, has_sum, one_mask))
        skip_norm_vec<true, Tag>(x, skip, gamma, beta, bias, out, mean_out, inv_out, sum_out, rows, hidden, skip_len,
                                 has_beta, has_bias, has_mean, has_inv, has_sum, eps);
    else
        skip_norm<true, Tag>(x, skip, gamma, beta, bias, out, mean_out, inv_out, sum_out, rows, hidden, skip_len,
                             has_beta, has_bias, has_mean, has_inv, has_sum, eps, one_mask);
}

// X and Y (scale's dtype, the output's) by their tags; f64 statistics when either is float64.
template <typename XTag, typename YTag>
__global__ void kiln_rms_norm(const typename XTag::storage* x, const typename YTag::storage* scale,
                              typename YTag::storage* y, void* inv_out, kiln_u64 rows, kiln_u64 cols,
                              kiln_u64 scale_len, float eps, unsigned stat_code, unsigned has_inv) {
    rms_norm<XTag, YTag, typename NAcc<typename kiln_elem<XTag>::C, typename kiln_elem<YTag>::C>::A>(
        x, scale, y, inv_out, rows, cols, scale_len, eps, stat_code, has_inv);
}

// ---- BatchNormalization (shim/src/batch_norm.rs) ----------------------------------------------

// y = (x − mean[c]) / sqrt(var[c] + eps) · scale[c] + bias[c], one thread per element of
// [N, C, S] (grid-stride), c = (i / S) % C, computed in kiln_elem's C. mean and var are of X's
// dtype, or (stats_c: kiln_batch_stats's) of C.
template <typename Tag>
__global__ void kiln_batch_norm(const typename Tag::storage* x, const typename Tag::storage* scale,
                                const typename Tag::storage* bias, const void* mean, const void* var,
                                typename Tag::storage* y, kiln_u64 total, kiln_u64 C, kiln_u64 S, float eps,
                                unsigned stats_c) {
    typedef kiln_elem<Tag> E;
    typedef typename E::C A;
    typedef typename Tag::storage T;
    KILN_FOR(i, total) {
        const kiln_u64 c = (i / S) % C;
        const A m = stats_c ? ((const A*)mean)[c] : E::ld(((const T*)mean)[c]);
        const A v = stats_c ? ((const A*)var)[c] : E::ld(((const T*)var)[c]);
        y[i] = E::st((E::ld(x[i]) - m) / kiln_sqrt(v + (A)eps) * E::ld(scale[c]) + E::ld(bias[c]));
    }
}

// Training mode's statistics, one block per channel c: the mean over N and S, then the
// (population) variance about it, written to batch_mean[c] and batch_var[c] in kiln_elem's C;
// the running ones (input · momentum + batch · (1 − momentum), X's dtype) when has_mean / has_var.
template <typename Tag>
__global__ void kiln_batch_stats(const typename Tag::storage* x, const typename Tag::storage* mean_in,
                                 const typename Tag::storage* var_in, typename kiln_elem<Tag>::C* batch_mean,
                                 typename kiln_elem<Tag>::C* batch_var, typename Tag::storage* running_mean,
                                 typename Tag::storage* running_var, kiln_u64 N, kiln_u64 C, kiln_u64 S, float momentum,
                                 unsigned has_mean, unsigned has_var) {
    typedef kiln_elem<Tag> E;
    typedef typename E::C A;
    __shared__ A red[32];
    const kiln_u64 c = blockIdx.x, count = N * S;
    A s = A(0);
    for (kiln_u64 k = threadIdx.x; k < count; k += blockDim.x) s += E::ld(x[((k / S) * C + c) * S + k % S]);
    const A m = kiln_block_reduce_by(s, red, kiln_op_sum()) / (A)count;
    A q = A(0);
    for (kiln_u64 k = threadIdx.x; k < count; k += blockDim.x) {
        const A d = E::ld(x[((k / S) * C + c) * S + k % S]) - m;
        q += d * d;
    }
    const A v = kiln_block_reduce_by(q, red, kiln_op_sum()) / (A)count;
    if (threadIdx.x == 0) {
        const A mo = (A)momentum;
        batch_mean[c] = m;
        batch_var[c] = v;
        if (has_mean) running_mean[c] = E::st(E::ld(mean_in[c]) * mo + m * (A(1) - mo));
        if (has_var) running_var[c] = E::st(E::ld(var_in[c]) * mo + v * (A(1) - mo));
    }
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

// LRN (shim/src/lrn.rs): y = x / (bias + alpha / size · Σ x²)^beta over the neighbouring channels
// of x [N, C, inner], in f64. One thread per element.
template <typename Tag>
__global__ void kiln_lrn(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 total, kiln_u64 C,
                         kiln_u64 inner, unsigned size, double alpha, double beta, double bias) {
    typedef kiln_elem<Tag> E;
    const kiln_u64 lo = (size - 1) / 2, hi = size / 2;
    KILN_FOR(i, total) {
        const kiln_u64 k = i % inner, c = (i / inner) % C, n = i / (inner * C);
        const kiln_u64 c0 = c > lo ? c - lo : 0, c1 = c + hi < C ? c + hi : C - 1;
        double sq = 0.0;
        for (kiln_u64 cc = c0; cc <= c1; ++cc) {
            const double v = (double)E::ld(x[(n * C + cc) * inner + k]);
            sq += v * v;
        }
        y[i] = E::st((typename E::C)((double)E::ld(x[i]) / pow(bias + alpha / (double)size * sq, beta)));
    }
}

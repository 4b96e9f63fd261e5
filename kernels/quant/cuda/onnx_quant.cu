// kiln-quant CUDA kernels of ONNX's linear quantization ops (shim/src/onnx_quant.rs and
// shim/src/qmatmul.rs hold the CPU references and the semantics): QuantizeLinear,
// DequantizeLinear, DynamicQuantizeLinear, QLinearMatMul and MatMulInteger. Integer tensors
// are typed at run time by a code (the shim's `Int`): 0 uint8, 1 int8, 2 uint16, 3 int16,
// 4 int32. Argument order matches the shim's `launch` calls.
#include "kiln.cuh"

__device__ __forceinline__ long long oq_load(const void* p, kiln_u64 i, unsigned code) {
    switch (code) {
    case 0: return ((const unsigned char*)p)[i];
    case 1: return ((const signed char*)p)[i];
    case 2: return ((const unsigned short*)p)[i];
    case 3: return ((const short*)p)[i];
    default: return ((const int*)p)[i];
    }
}

__device__ __forceinline__ void oq_store(void* p, kiln_u64 i, unsigned code, long long v) {
    const long long lo[5] = {0, -128, 0, -32768, -2147483648LL};
    const long long hi[5] = {255, 127, 65535, 32767, 2147483647LL};
    v = v < lo[code] ? lo[code] : (v > hi[code] ? hi[code] : v);
    switch (code) {
    case 0: ((unsigned char*)p)[i] = (unsigned char)v; break;
    case 1: ((signed char*)p)[i] = (signed char)v; break;
    case 2: ((unsigned short*)p)[i] = (unsigned short)v; break;
    case 3: ((short*)p)[i] = (short)v; break;
    default: ((int*)p)[i] = (int)v; break;
    }
}

// The scale (and zero point) index of element i of a tensor seen as [outer, A, inner]: 0 per
// tensor (layout 0), the axis coordinate per axis (1), or blocks of `block` along the axis
// (2: scales [outer, SA, inner]).
__device__ __forceinline__ kiln_u64 oq_param(kiln_u64 i, unsigned layout, kiln_u64 A, kiln_u64 inner, kiln_u64 block,
                                             kiln_u64 SA) {
    if (layout == 0) return 0;
    const kiln_u64 in = i % inner, a = (i / inner) % A, o = i / (inner * A);
    if (layout == 1) return a;
    return (o * SA + a / block) * inner + in;
}

// y = saturate(rint(x / scale) + zero_point), x / scale in f32.
template <typename Tag>
__global__ void kiln_quantize_linear(const typename Tag::storage* x, const typename Tag::storage* scale,
                                     const void* zp, void* y, kiln_u64 n, unsigned has_zp, unsigned ycode,
                                     unsigned layout, kiln_u64 A, kiln_u64 inner, kiln_u64 block, kiln_u64 SA) {
    KILN_FOR(i, n) {
        const kiln_u64 p = oq_param(i, layout, A, inner, block, SA);
        const float q = rintf(kiln_to_f32(Tag(), x[i]) / kiln_to_f32(Tag(), scale[p]));
        const long long z = has_zp ? oq_load(zp, p, ycode) : 0;
        const float qc = fminf(fmaxf(q, -4.0e18f), 4.0e18f);  // NaN and huge values saturate
        oq_store(y, i, ycode, q != q ? z : (long long)qc + z);
    }
}

// y = (x − zero_point) · scale, in f32.
template <typename Tag>
__global__ void kiln_dequantize_linear(const void* x, const typename Tag::storage* scale, const void* zp,
                                       typename Tag::storage* y, kiln_u64 n, unsigned has_zp, unsigned xcode,
                                       unsigned layout, kiln_u64 A, kiln_u64 inner, kiln_u64 block, kiln_u64 SA) {
    KILN_FOR(i, n) {
        const kiln_u64 p = oq_param(i, layout, A, inner, block, SA);
        const long long z = has_zp ? oq_load(zp, p, xcode) : 0;
        y[i] = kiln_from_f32(Tag(), (float)(oq_load(x, i, xcode) - z) * kiln_to_f32(Tag(), scale[p]));
    }
}

// DynamicQuantizeLinear's scale and zero point from x's range (one block): min and max with 0,
// scale (max − min) / 255 (1 for an all-zero x), zero point rint(clamp(0 − min / scale, 0, 255)).
extern "C" __global__ void kiln_dql_params(const float* x, float* y_scale, unsigned char* y_zp, kiln_u64 n) {
    __shared__ float s_lo[32], s_hi[32];
    float lo = 0.f, hi = 0.f;
    for (kiln_u64 i = threadIdx.x; i < n; i += blockDim.x) {
        lo = fminf(lo, x[i]);
        hi = fmaxf(hi, x[i]);
    }
    for (int o = 16; o > 0; o >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, o));
        hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, o));
    }
    if (threadIdx.x % 32 == 0) {
        s_lo[threadIdx.x / 32] = lo;
        s_hi[threadIdx.x / 32] = hi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (unsigned w = 1; w < blockDim.x / 32; ++w) {
            lo = fminf(lo, s_lo[w]);
            hi = fmaxf(hi, s_hi[w]);
        }
        const float scale = hi == lo ? 1.f : (hi - lo) / 255.f;
        const float z = fminf(fmaxf(0.f - lo / scale, 0.f), 255.f);
        *y_scale = scale;
        *y_zp = (unsigned char)rintf(z);
    }
}

// DynamicQuantizeLinear's y = saturate(rint(x / scale) + zero point) as uint8.
extern "C" __global__ void kiln_dql_apply(const float* x, const float* y_scale, const unsigned char* y_zp, unsigned char* y,
                               kiln_u64 n) {
    const float scale = *y_scale;
    const float z = (float)*y_zp;
    KILN_FOR(i, n) y[i] = (unsigned char)fminf(fmaxf(rintf(x[i] / scale) + z, 0.f), 255.f);
}

// (A − a_zp) · (B − b_zp) in int32 over batches: A [batch_a, M, K], B [batch_b, K, N] (a batch
// of 1 broadcasts), one thread per output. a_zp per tensor or per row (a_zp_rows), b_zp per
// tensor or per column (b_zp_cols). QLinearMatMul (requant): y = saturate(rint(C · factor) +
// y_zp) with factor = a_scale · b_scale / y_scale rounded to the scales' dtype at each step (b's
// scale per column when b_scale_cols); MatMulInteger: y = C as int32.
template <typename Tag>
__global__ void kiln_qmatmul(const void* a, const void* b, const void* a_zp, const void* b_zp,
                             const typename Tag::storage* a_scale, const typename Tag::storage* b_scale,
                             const typename Tag::storage* y_scale, const void* y_zp, void* y, kiln_u64 batch,
                             kiln_u64 M, kiln_u64 N, kiln_u64 K, unsigned a_batched, unsigned b_batched,
                             unsigned acode, unsigned bcode, unsigned ycode, unsigned has_azp, unsigned has_bzp,
                             unsigned a_zp_rows, unsigned b_zp_cols, unsigned requant, unsigned b_scale_cols,
                             unsigned has_yzp) {
    KILN_FOR(i, batch * M * N) {
        const kiln_u64 col = i % N, row = (i / N) % M, bt = i / (M * N);
        const kiln_u64 abase = (a_batched ? bt : 0) * M * K + row * K, bbase = (b_batched ? bt : 0) * K * N + col;
        const long long za = has_azp ? oq_load(a_zp, a_zp_rows ? row : 0, acode) : 0;
        const long long zb = has_bzp ? oq_load(b_zp, b_zp_cols ? col : 0, bcode) : 0;
        long long c = 0;
        for (kiln_u64 k = 0; k < K; ++k) c += (oq_load(a, abase + k, acode) - za) * (oq_load(b, bbase + k * N, bcode) - zb);
        if (!requant) {
            ((int*)y)[i] = (int)c;
            continue;
        }
        const float ab = kiln_to_f32(Tag(), kiln_from_f32(Tag(), kiln_to_f32(Tag(), a_scale[0]) *
                                                                     kiln_to_f32(Tag(), b_scale[b_scale_cols ? col : 0])));
        const float factor = kiln_to_f32(Tag(), kiln_from_f32(Tag(), ab / kiln_to_f32(Tag(), y_scale[0])));
        const double d = (double)c * (double)factor + (double)(has_yzp ? oq_load(y_zp, 0, ycode) : 0);
        const double r = fmin(fmax(rint(d), -4.0e18), 4.0e18);
        oq_store(y, i, ycode, (long long)r);
    }
}

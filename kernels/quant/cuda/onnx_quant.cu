// kiln-quant CUDA kernels of ONNX's linear quantization ops (shim/src/onnx_quant.rs and
// shim/src/qmatmul.rs hold the CPU references and the semantics): QuantizeLinear,
// DequantizeLinear, DynamicQuantizeLinear, QLinearMatMul and MatMulInteger. Integer tensors
// are typed at run time by a code (the shim's `Int`): 0 uint8, 1 int8, 2 uint16, 3 int16,
// 4 int32, and the ONNX dtype codes of uint4 (21), int4 (22), uint2 (25), int2 (26), packed;
// QuantizeLinear and DequantizeLinear also take float8 (17-20) and float4e2m1 (23) codes.
// Argument order matches the shim's `launch` calls.
#include "kiln.cuh"
#include "kiln-cuda-std/minifloat.cuh"

__device__ __forceinline__ long long oq_load(const void* p, kiln_u64 i, unsigned code) {
    switch (code) {
    case 0: return ((const unsigned char*)p)[i];
    case 1: return ((const signed char*)p)[i];
    case 2: return ((const unsigned short*)p)[i];
    case 3: return ((const short*)p)[i];
    case 4: return ((const int*)p)[i];
    default:  // 4-bit and 2-bit integers
        return kiln_narrow_int_value(code, kiln_packed_get((const unsigned char*)p, kiln_dtype_bits(code), i));
    }
}

// Whether a code is a float8 or float4 type's.
__device__ __forceinline__ bool oq_is_float(unsigned code) {
    return (code >= KILN_DT_F8E4M3FN && code <= KILN_DT_F8E5M2FNUZ) || code == KILN_DT_F4E2M1;
}

// The range of an integer code.
__device__ __forceinline__ void oq_range(unsigned code, long long* lo, long long* hi) {
    switch (code) {
    case 0: *lo = 0; *hi = 255; break;
    case 1: *lo = -128; *hi = 127; break;
    case 2: *lo = 0; *hi = 65535; break;
    case 3: *lo = -32768; *hi = 32767; break;
    case KILN_DT_U4: *lo = 0; *hi = 15; break;
    case KILN_DT_I4: *lo = -8; *hi = 7; break;
    case KILN_DT_U2: *lo = 0; *hi = 3; break;
    case KILN_DT_I2: *lo = -2; *hi = 1; break;
    default: *lo = -2147483648LL; *hi = 2147483647LL; break;
    }
}

__device__ __forceinline__ void oq_store(void* p, kiln_u64 i, unsigned code, long long v) {
    long long lo, hi;
    oq_range(code, &lo, &hi);
    v = v < lo ? lo : (v > hi ? hi : v);
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

// Element i of QuantizeLinear's y as its code: saturate(rint(x / scale) + zero_point) for an
// integer type (x / scale in f32); for float8, x / scale rounded to nearest even (the zero
// point, 0, ignored), saturated when `saturate`; for float4e2m1, x / scale + zero_point.
template <typename Tag>
__device__ __forceinline__ unsigned long long oq_quantize(const typename Tag::storage* x,
                                                          const typename Tag::storage* scale, const void* zp,
                                                          kiln_u64 i, kiln_u64 p, unsigned flags, unsigned ycode) {
    const bool has_zp = flags & 1;
    const float q = kiln_to_f32(Tag(), x[i]) / kiln_to_f32(Tag(), scale[p]);
    if (oq_is_float(ycode)) {
        // float4e2m1 adds a zero point it is given; a float8 one is ignored (no + 0, which would
        // turn -0 into +0).
        const float v = has_zp && ycode == KILN_DT_F4E2M1
                            ? q + kiln_minifloat_to_f32(ycode, kiln_packed_get((const unsigned char*)zp, 4, p))
                            : q;
        return kiln_minifloat_from_f64(ycode, (double)v, (flags >> 1) & 1);
    }
    const float r = rintf(q);
    const long long z = has_zp ? oq_load(zp, p, ycode) : 0;
    const float rc = fminf(fmaxf(r, -4.0e18f), 4.0e18f);  // NaN and huge values saturate
    long long v = r != r ? z : (long long)rc + z, lo, hi;
    oq_range(ycode, &lo, &hi);
    return (unsigned long long)(v < lo ? lo : (v > hi ? hi : v));
}

// y = QuantizeLinear(x); flags: bit 0 a zero point is given, bit 1 `saturate`. A packed y (4-bit
// and 2-bit integers, float4e2m1) is written a whole byte per thread.
template <typename Tag>
__global__ void kiln_quantize_linear(const typename Tag::storage* x, const typename Tag::storage* scale,
                                     const void* zp, void* y, kiln_u64 n, unsigned flags, unsigned ycode,
                                     unsigned layout, kiln_u64 A, kiln_u64 inner, kiln_u64 block, kiln_u64 SA) {
    const unsigned bits = ycode > 4 ? kiln_dtype_bits(ycode) : 8;
    if (bits < 8) {
        const unsigned per = 8 / bits;
        KILN_FOR(b, (n + per - 1) / per) {
            unsigned byte = 0;
            for (unsigned k = 0; k < per; ++k) {
                const kiln_u64 i = b * per + k;
                if (i >= n) break;
                const kiln_u64 p = oq_param(i, layout, A, inner, block, SA);
                const unsigned v = (unsigned)oq_quantize<Tag>(x, scale, zp, i, p, flags, ycode);
                byte |= (v & ((1u << bits) - 1)) << (k * bits);
            }
            ((unsigned char*)y)[b] = (unsigned char)byte;
        }
        return;
    }
    KILN_FOR(i, n) {
        const kiln_u64 p = oq_param(i, layout, A, inner, block, SA);
        const unsigned long long v = oq_quantize<Tag>(x, scale, zp, i, p, flags, ycode);
        if (oq_is_float(ycode)) ((unsigned char*)y)[i] = (unsigned char)v;
        else oq_store(y, i, ycode, (long long)v);
    }
}

// y = (x − zero_point) · scale, in f32; a float8 or float4 x's zero point is ignored.
template <typename Tag>
__global__ void kiln_dequantize_linear(const void* x, const typename Tag::storage* scale, const void* zp,
                                       typename Tag::storage* y, kiln_u64 n, unsigned flags, unsigned xcode,
                                       unsigned layout, kiln_u64 A, kiln_u64 inner, kiln_u64 block, kiln_u64 SA) {
    const unsigned char* xb = (const unsigned char*)x;
    KILN_FOR(i, n) {
        const kiln_u64 p = oq_param(i, layout, A, inner, block, SA);
        float d;
        if (oq_is_float(xcode)) {
            d = kiln_minifloat_to_f32(xcode, xcode == KILN_DT_F4E2M1 ? kiln_packed_get(xb, 4, i) : xb[i]);
        } else {
            const long long z = (flags & 1) ? oq_load(zp, p, xcode) : 0;
            d = (float)(oq_load(x, i, xcode) - z);
        }
        y[i] = kiln_from_f32(Tag(), d * kiln_to_f32(Tag(), scale[p]));
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

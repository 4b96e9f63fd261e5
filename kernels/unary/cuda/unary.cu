// kiln-unary CUDA kernels: y[i] = op(x[i]) over n contiguous elements, grid-stride loop.
// Compiled by NVRTC for the GPU present; op codes match `Op::code` in shim/src/lib.rs.
#include "kiln.cuh"

enum UnaryOp {
    RELU = 0, LEAKY_RELU, SIGMOID, TANH, EXP, LOG, SQRT, NEG, ABS, ERF, RECIPROCAL,
    COS, SIN, FLOOR, CEIL, GELU, GELU_TANH, SOFTPLUS, HARD_SIGMOID
};

__device__ __forceinline__ float unary_apply(float x, unsigned op, float alpha, float beta) {
    switch (op) {
    case RELU: return x > 0.f ? x : 0.f;
    case LEAKY_RELU: return x >= 0.f ? x : alpha * x;
    case SIGMOID: return 1.f / (1.f + expf(-x));
    case TANH: return tanhf(x);
    case EXP: return expf(x);
    case LOG: return logf(x);
    case SQRT: return sqrtf(x);
    case NEG: return -x;
    case ABS: return fabsf(x);
    case ERF: return erff(x);
    case RECIPROCAL: return 1.f / x;
    case COS: return cosf(x);
    case SIN: return sinf(x);
    case FLOOR: return floorf(x);
    case CEIL: return ceilf(x);
    case GELU: return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
    case GELU_TANH: return 0.5f * x * (1.f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x)));
    case SOFTPLUS: return x > 0.f ? x + log1pf(expf(-x)) : log1pf(expf(x));
    case HARD_SIGMOID: return fminf(1.f, fmaxf(0.f, alpha * x + beta));
    default: return x;
    }
}

template <typename Tag>
__device__ void unary(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 n, unsigned op, float alpha,
                      float beta) {
    KILN_FOR(i, n) { y[i] = kiln_from_f32(Tag(), unary_apply(kiln_to_f32(Tag(), x[i]), op, alpha, beta)); }
}

extern "C" __global__ void kiln_unary_f32(const float* x, float* y, kiln_u64 n, unsigned op, float alpha, float beta) {
    unary<kiln_tag_f32>(x, y, n, op, alpha, beta);
}

extern "C" __global__ void kiln_unary_f16(const kiln_f16* x, kiln_f16* y, kiln_u64 n, unsigned op, float alpha,
                                          float beta) {
    unary<kiln_tag_f16>(x, y, n, op, alpha, beta);
}

extern "C" __global__ void kiln_unary_bf16(const kiln_bf16* x, kiln_bf16* y, kiln_u64 n, unsigned op, float alpha,
                                           float beta) {
    unary<kiln_tag_bf16>(x, y, n, op, alpha, beta);
}

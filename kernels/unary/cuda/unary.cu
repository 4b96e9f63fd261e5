// kiln-unary CUDA kernels: y[i] = op(x[i]) over n contiguous elements, grid-stride loop.
// Compiled by NVRTC for the GPU present; op codes match `Op::code` in shim/src/lib.rs.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

enum UnaryOp {
    RELU = 0, LEAKY_RELU, SIGMOID, TANH, EXP, LOG, SQRT, NEG, ABS, ERF, RECIPROCAL,
    COS, SIN, FLOOR, CEIL, GELU, GELU_TANH, SOFTPLUS, HARD_SIGMOID
};

__device__ __forceinline__ float unary_apply(float x, unsigned op, float alpha, float beta) {
    switch (op) {
    case RELU: return x > 0.f ? x : 0.f;
    case LEAKY_RELU: return x >= 0.f ? x : alpha * x;
    case SIGMOID: return 1.f / (1.f + __expf(-x));
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

template <typename T, typename Load, typename Store>
__device__ void unary_loop(const T* x, T* y, unsigned long long n, unsigned op, float alpha, float beta,
                           Load load, Store store) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < n;
         i += (unsigned long long)gridDim.x * blockDim.x) {
        y[i] = store(unary_apply(load(x[i]), op, alpha, beta));
    }
}

extern "C" __global__ void kiln_unary_f32(const float* x, float* y, unsigned long long n, unsigned op,
                                          float alpha, float beta) {
    unary_loop(x, y, n, op, alpha, beta, [](float v) { return v; }, [](float v) { return v; });
}

extern "C" __global__ void kiln_unary_f16(const __half* x, __half* y, unsigned long long n, unsigned op,
                                          float alpha, float beta) {
    unary_loop(x, y, n, op, alpha, beta, [](__half v) { return __half2float(v); },
               [](float v) { return __float2half(v); });
}

extern "C" __global__ void kiln_unary_bf16(const __nv_bfloat16* x, __nv_bfloat16* y, unsigned long long n,
                                           unsigned op, float alpha, float beta) {
    unary_loop(x, y, n, op, alpha, beta, [](__nv_bfloat16 v) { return __bfloat162float(v); },
               [](float v) { return __float2bfloat16(v); });
}

// bias-gelu: com.example::BiasGelu, y = Gelu(x + bias[i % c]) = 0.5·s·(1 + erf(s / √2)) with
// s = x + bias, in f32. The parameters match the signature in kernel.toml.
#include "kiln.cuh"

extern "C" __global__ void bias_gelu_f32(const float* x, const float* bias, float* y, kiln_u64 n, kiln_u64 c) {
    KILN_FOR(i, n) {
        const float s = x[i] + bias[i % c];
        y[i] = 0.5f * s * (1.f + erff(s * 0.70710678118654752f));
    }
}

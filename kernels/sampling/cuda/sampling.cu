// kiln-sampling CUDA kernels. Argument order matches the shim's `launch` calls exactly.
#include "kiln.cuh"

// AppendAttentionMask: out = mask (copied unless out is mask itself), then column `pos[0]` of
// every row set to 1 when 0 <= pos < L; pos_out[0] = pos[0] + 1. One block: every thread reads
// the position before thread 0 writes it, so pos_out may be pos (bound in place).
template <typename T>
__device__ void append_mask(const T* mask, const long long* pos, T* out, long long* pos_out, kiln_u64 B, kiln_u64 L) {
    const long long p = pos[0];
    if (out != mask)
        for (kiln_u64 i = threadIdx.x; i < B * L; i += blockDim.x) out[i] = mask[i];
    __syncthreads();
    if (p >= 0 && (kiln_u64)p < L)
        for (kiln_u64 b = threadIdx.x; b < B; b += blockDim.x) out[b * L + (kiln_u64)p] = (T)1;
    if (threadIdx.x == 0) pos_out[0] = p + 1;
}

extern "C" __global__ void kiln_append_mask_i64(const long long* mask, const long long* pos, long long* out,
                                                long long* pos_out, kiln_u64 B, kiln_u64 L) {
    append_mask<long long>(mask, pos, out, pos_out, B, L);
}
extern "C" __global__ void kiln_append_mask_i32(const int* mask, const long long* pos, int* out, long long* pos_out,
                                                kiln_u64 B, kiln_u64 L) {
    append_mask<int>(mask, pos, out, pos_out, B, L);
}

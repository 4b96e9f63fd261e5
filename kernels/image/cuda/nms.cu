// kiln-image's NonMaxSuppression kernels (shim/src/nms.rs holds the CPU reference and the
// semantics, onnxruntime's): the greedy selection of one (batch row, class) per thread, in f32.
#include "kiln.cuh"

// [x_min, y_min, x_max, y_max] of a box: corners in either order, or center and size.
__device__ __forceinline__ void nms_corners(const float* b, unsigned center, float* c) {
    if (center) {
        const float hw = b[2] / 2.0f, hh = b[3] / 2.0f;
        c[0] = b[0] - hw; c[1] = b[1] - hh; c[2] = b[0] + hw; c[3] = b[1] + hh;
    } else {
        c[0] = fminf(b[1], b[3]); c[1] = fminf(b[0], b[2]); c[2] = fmaxf(b[1], b[3]); c[3] = fmaxf(b[0], b[2]);
    }
}

__device__ __forceinline__ bool nms_suppresses(const float* a, const float* b, float iou) {
    const float ix0 = fmaxf(a[0], b[0]), iy0 = fmaxf(a[1], b[1]), ix1 = fminf(a[2], b[2]), iy1 = fminf(a[3], b[3]);
    if (ix0 >= ix1 || iy0 >= iy1) return false;
    const float inter = (ix1 - ix0) * (iy1 - iy0);
    const float area_a = (a[2] - a[0]) * (a[3] - a[1]), area_b = (b[2] - b[0]) * (b[3] - b[1]);
    const float uni = area_a + area_b - inter;
    if (inter <= 0.0f || area_a <= 0.0f || area_b <= 0.0f || uni <= 0.0f) return false;
    return inter / uni > iou;
}

// Pair q = (b, c): repeatedly the best remaining candidate (highest score above the threshold,
// the lower index on ties) is taken into chosen[q * cap + k] and suppresses the remaining ones
// it overlaps by more than `iou`; counts[q] = how many were taken (at most cap). `done` holds one
// byte per box of each pair (taken or suppressed).
extern "C" __global__ void kiln_nms_select(const float* boxes, const float* scores, long long* chosen,
                                           long long* counts, unsigned char* done, kiln_u64 batch, kiln_u64 classes,
                                           kiln_u64 spatial, kiln_u64 cap, float iou, float score_threshold,
                                           unsigned has_threshold, unsigned center) {
    KILN_FOR(q, batch * classes) {
        const kiln_u64 b = q / classes;
        const float* s = scores + q * spatial;
        unsigned char* d = done + q * spatial;
        for (kiln_u64 i = 0; i < spatial; ++i) d[i] = has_threshold && !(s[i] > score_threshold);
        kiln_u64 k = 0;
        while (k < cap) {
            long long best = -1;
            for (kiln_u64 i = 0; i < spatial; ++i)
                if (!d[i] && (best < 0 || s[i] > s[best])) best = (long long)i;
            if (best < 0) break;
            d[best] = 1;
            chosen[q * cap + k++] = best;
            float cb[4];
            nms_corners(boxes + (b * spatial + (kiln_u64)best) * 4, center, cb);
            for (kiln_u64 i = 0; i < spatial; ++i) {
                if (d[i]) continue;
                float ci[4];
                nms_corners(boxes + (b * spatial + i) * 4, center, ci);
                if (nms_suppresses(cb, ci, iou)) d[i] = 1;
            }
        }
        counts[q] = (long long)k;
    }
}

// The selections as rows (batch, class, box), pair after pair; writes at most `rows` rows.
extern "C" __global__ void kiln_nms_write(const long long* chosen, const long long* counts, long long* out,
                                          kiln_u64 pairs, kiln_u64 classes, kiln_u64 cap, kiln_u64 rows) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    kiln_u64 r = 0;
    for (kiln_u64 q = 0; q < pairs; ++q)
        for (long long k = 0; k < counts[q] && r < rows; ++k, ++r) {
            out[r * 3 + 0] = (long long)(q / classes);
            out[r * 3 + 1] = (long long)(q % classes);
            out[r * 3 + 2] = chosen[q * cap + k];
        }
}

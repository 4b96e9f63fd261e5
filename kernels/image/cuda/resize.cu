// kiln-image CUDA kernels of Resize and Upsample (shim/src/resize.rs holds the CPU reference and
// the semantics, after ONNX's reference implementation): one pass per resized axis, each a
// 1-D resampling of every line along that axis. Argument order matches the shim's `launch`.
#include "kiln.cuh"

// Modes, coordinate transformations and nearest-pixel rules: the shim's Mode, Coord and
// Nearest enums.
enum { RS_NEAREST = 0, RS_LINEAR = 1, RS_CUBIC = 2 };
enum { RS_HALF_PIXEL = 0, RS_HALF_PIXEL_SYMMETRIC = 1, RS_PYTORCH_HALF_PIXEL = 2, RS_ALIGN_CORNERS = 3,
       RS_ASYMMETRIC = 4, RS_TF_CROP_AND_RESIZE = 5 };
enum { RS_ROUND_PREFER_FLOOR = 0, RS_ROUND_PREFER_CEIL = 1, RS_FLOOR = 2, RS_CEIL = 3, RS_SIMPLE = 4 };

// One axis of a resize pass.
struct rs_axis {
    kiln_u64 in_len, out_len;
    unsigned mode, coord, nearest, antialias, exclude;
    double cubic_a, scale, roi0, roi1;
};

__device__ __forceinline__ double rs_cubic(double x, double A) {
    x = fabs(x);
    if (x <= 1.0) return ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0;
    if (x < 2.0) return ((A * x - 5.0 * A) * x + 8.0 * A) * x - 4.0 * A;
    return 0.0;
}

// The taps of an output position x: `n` input indices from `first`, tap k weighing
// rs_weight(k) (antialias taps then normalised to sum 1 by the caller). Index k sits at
// distance k − n/2 + 1 − ratio from the position.
struct rs_taps {
    long long first;
    int n;
    double ratio, s;  // ratio in (0, 1]; s: the antialias scale min(scale, 1)
};

__device__ __forceinline__ double rs_weight(const rs_axis& a, const rs_taps& t, int k) {
    const double r = t.ratio;
    switch (a.mode) {
    case RS_NEAREST: {
        bool second;
        if (r == 1.0) second = true;
        else if (a.nearest == RS_ROUND_PREFER_FLOOR) second = r > 0.5;
        else if (a.nearest == RS_ROUND_PREFER_CEIL) second = r >= 0.5;
        else if (a.nearest == RS_FLOOR) second = false;
        else if (a.nearest == RS_CEIL) second = true;
        else second = a.scale < 1.0;  // RS_SIMPLE: ceil when downsampling, floor otherwise
        return (k == 1) == second ? 1.0 : 0.0;
    }
    case RS_LINEAR:
        if (!a.antialias) return k == 0 ? 1.0 - r : r;
        return fmin(fmax(1.0 - fabs(((double)(k - t.n / 2 + 1) - r) * t.s), 0.0), 1.0);
    default:
        if (!a.antialias) return rs_cubic((double)(k - 1) - r, a.cubic_a);
        return rs_cubic(t.s * ((double)(k - t.n / 2 + 1) - r), a.cubic_a);
    }
}

// Resamples every line along one axis: src [outer, in_len, inner] → dst [outer, out_len, inner],
// one thread per output element (grid-stride). A position that tf_crop_and_resize maps outside
// the input gets `extrapolation`.
template <typename TagIn, typename TagOut>
__global__ void kiln_resize_axis(const typename TagIn::storage* src, typename TagOut::storage* dst, kiln_u64 outer,
                                 kiln_u64 in_len, kiln_u64 out_len, kiln_u64 inner, unsigned mode, unsigned coord,
                                 unsigned nearest, unsigned antialias, unsigned exclude, double cubic_a,
                                 double extrapolation, double scale, double roi0, double roi1) {
    const rs_axis a{in_len, out_len, mode, coord, nearest, antialias, exclude, cubic_a, scale, roi0, roi1};
    const double w = (double)in_len, ow = scale * w;
    KILN_FOR(i, outer * out_len * inner) {
        const kiln_u64 in_i = i % inner, r = i / inner;
        const kiln_u64 xo = r % out_len, o = r / out_len;
        const double x = (double)xo;
        double xs;
        bool outside = false;
        switch (coord) {
        case RS_ALIGN_CORNERS: xs = ow == 1.0 ? 0.0 : x * (w - 1.0) / (ow - 1.0); break;
        case RS_ASYMMETRIC: xs = x / scale; break;
        case RS_TF_CROP_AND_RESIZE:
            xs = (ow == 1.0 ? (roi1 - roi0) * (w - 1.0) / 2.0 : x * (roi1 - roi0) * (w - 1.0) / (ow - 1.0)) + roi0 * (w - 1.0);
            outside = xs < 0.0 || xs > w - 1.0;
            break;
        case RS_PYTORCH_HALF_PIXEL: xs = ow == 1.0 ? -0.5 : (x + 0.5) / scale - 0.5; break;
        case RS_HALF_PIXEL_SYMMETRIC:
            xs = w / 2.0 * (1.0 - (double)out_len / ow) + (x + 0.5) / scale - 0.5;
            break;
        default: xs = (x + 0.5) / scale - 0.5; break;
        }
        if (outside) {
            dst[i] = kiln_from_f32(TagOut(), (float)extrapolation);
            continue;
        }
        rs_taps t;
        t.ratio = xs == floor(xs) ? 1.0 : xs - floor(xs);
        const long long i0 = (long long)(xs - t.ratio);  // x lies in (i0, i0 + 1]
        t.s = fmin(scale, 1.0);
        if (mode == RS_NEAREST || (mode == RS_LINEAR && !antialias)) t.n = 2;
        else if (mode == RS_LINEAR) t.n = 2 - 2 * (int)(floor(-1.0 / t.s) + 1.0);
        else if (!antialias) t.n = 4;
        else t.n = 2 - 2 * (int)(floor(-2.0 / t.s) + 1.0);
        t.first = i0 - t.n / 2 + 1;
        const typename TagIn::storage* line = src + o * in_len * inner + in_i;
        double sum = 0.0, acc = 0.0;
        for (int k = 0; k < t.n; ++k) {
            const long long idx = t.first + k;
            if (exclude && (idx < 0 || idx >= (long long)in_len)) continue;
            const double c = rs_weight(a, t, k);
            const long long cl = idx < 0 ? 0 : (idx >= (long long)in_len ? (long long)in_len - 1 : idx);
            sum += c;
            acc += c * (double)kiln_to_f32(TagIn(), line[(kiln_u64)cl * inner]);
        }
        // Antialias taps are normalised to sum 1, and so are the taps left after exclude_outside.
        if ((antialias && mode != RS_NEAREST) || exclude) acc /= sum;
        dst[i] = kiln_from_f32(TagOut(), (float)acc);
    }
}

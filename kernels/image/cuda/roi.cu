// kiln-image's RoiAlign kernel (shim/src/roi.rs holds the CPU reference and the semantics): one
// thread per output element (roi, channel, bin row, bin column), coordinates in f64, values
// accumulated in the dtype's accumulator (f32; f64 for float64).
#include "kiln.cuh"
#include "kiln-cuda-std/elem.cuh"

template <typename Tag, typename T = typename Tag::storage, typename E = kiln_elem<Tag>,
          typename A = typename kiln_elem<Tag>::C>
__device__ void roi_align(const T* x, const T* rois, const long long* idx, T* y, kiln_u64 total, kiln_u64 n,
                          kiln_u64 c, kiln_u64 h, kiln_u64 w, kiln_u64 oh, kiln_u64 ow, long long sampling,
                          double scale, unsigned half_pixel, unsigned max_mode, kiln_status* st) {
    KILN_FOR(t, total) {
        const kiln_u64 pw = t % ow, ph = (t / ow) % oh, ch = (t / (ow * oh)) % c, r = t / (ow * oh * c);
        const long long b = idx[r];
        if (b < 0 || (kiln_u64)b >= n) {
            if (ch == 0 && ph == 0 && pw == 0) kiln_fail(st, 1, (long long)r, b, (long long)n);
            y[t] = E::st((A)0);
            continue;
        }
        const double shift = half_pixel ? 0.5 : 0.0;
        const double x1 = (double)E::ld(rois[r * 4 + 0]) * scale - shift, y1 = (double)E::ld(rois[r * 4 + 1]) * scale - shift;
        double rw = (double)E::ld(rois[r * 4 + 2]) * scale - shift - x1;
        double rh = (double)E::ld(rois[r * 4 + 3]) * scale - shift - y1;
        if (!half_pixel) {
            rw = rw > 1.0 ? rw : 1.0;
            rh = rh > 1.0 ? rh : 1.0;
        }
        const double bh = rh / (double)oh, bw = rw / (double)ow;
        const long long gh = sampling > 0 ? sampling : (long long)ceil(rh / (double)oh);
        const long long gw = sampling > 0 ? sampling : (long long)ceil(rw / (double)ow);
        const long long count = gh * gw > 1 ? gh * gw : 1;
        const T* map = x + ((kiln_u64)b * c + ch) * h * w;
        A acc = 0;
        bool any = false;
        for (long long iy = 0; iy < gh; ++iy) {
            const double sy0 = y1 + (double)ph * bh + ((double)iy + 0.5) * bh / (double)gh;
            for (long long ix = 0; ix < gw; ++ix) {
                double sx = x1 + (double)pw * bw + ((double)ix + 0.5) * bw / (double)gw, sy = sy0;
                A v = 0;
                if (!(sy < -1.0 || sy > (double)h || sx < -1.0 || sx > (double)w)) {
                    sy = sy > 0.0 ? sy : 0.0;
                    sx = sx > 0.0 ? sx : 0.0;
                    kiln_u64 y0 = (kiln_u64)sy, x0 = (kiln_u64)sx, yh, xh;
                    double ly, lx;
                    if (y0 >= h - 1) { y0 = yh = h - 1; ly = 0.0; } else { yh = y0 + 1; ly = sy - (double)y0; }
                    if (x0 >= w - 1) { x0 = xh = w - 1; lx = 0.0; } else { xh = x0 + 1; lx = sx - (double)x0; }
                    const double hy = 1.0 - ly, hx = 1.0 - lx;
                    const A v1 = (A)(hy * hx) * (A)E::ld(map[y0 * w + x0]), v2 = (A)(hy * lx) * (A)E::ld(map[y0 * w + xh]);
                    const A v3 = (A)(ly * hx) * (A)E::ld(map[yh * w + x0]), v4 = (A)(ly * lx) * (A)E::ld(map[yh * w + xh]);
                    if (max_mode) {
                        v = v1 > v2 ? v1 : v2;
                        v = v > v3 ? v : v3;
                        v = v > v4 ? v : v4;
                    } else {
                        v = v1 + v2 + v3 + v4;
                    }
                }
                acc = !any ? v : (max_mode ? (acc > v ? acc : v) : acc + v);
                any = true;
            }
        }
        y[t] = E::st(max_mode ? acc : acc / (A)count);
    }
}

template <typename Tag>
__global__ void kiln_roi_align(const typename Tag::storage* x, const typename Tag::storage* rois, const long long* idx,
                               typename Tag::storage* y, kiln_u64 total, kiln_u64 n, kiln_u64 c, kiln_u64 h, kiln_u64 w,
                               kiln_u64 oh, kiln_u64 ow, long long sampling, double scale, unsigned half_pixel,
                               unsigned max_mode, kiln_status* st) {
    roi_align<Tag>(x, rois, idx, y, total, n, c, h, w, oh, ow, sampling, scale, half_pixel, max_mode, st);
}

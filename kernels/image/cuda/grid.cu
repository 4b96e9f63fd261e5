// kiln-image CUDA kernels of GridSample and AffineGrid (shim/src/grid.rs holds the CPU reference
// and the semantics). Argument order matches the shim's `launch` calls.
#include "kiln.cuh"

enum { GS_LINEAR = 0, GS_NEAREST = 1, GS_CUBIC = 2 };
enum { GS_ZEROS = 0, GS_BORDER = 1, GS_REFLECTION = 2 };

__device__ __forceinline__ float gs_reflect(float x, float lo, float hi) {
    const float rng = hi - lo;
    if (x < lo) {
        const float dx = lo - x;
        const long long n = (long long)(dx / rng);
        const float r = dx - (float)n * rng;
        return n % 2 == 0 ? lo + r : hi - r;
    }
    if (x > hi) {
        const float dx = x - hi;
        const long long n = (long long)(dx / rng);
        const float r = dx - (float)n * rng;
        return n % 2 == 0 ? hi - r : lo + r;
    }
    return x;
}

// The index tap i reads on an axis of length d, or −1 (a zero).
__device__ __forceinline__ long long gs_tap(long long i, long long d, unsigned padding, float lo, float hi) {
    if (i >= 0 && i < d) return i;
    if (padding == GS_ZEROS) return -1;
    if (padding == GS_BORDER) return i < 0 ? 0 : d - 1;
    long long r = (long long)gs_reflect((float)i, lo, hi);
    return r < 0 ? 0 : (r >= d ? d - 1 : r);
}

__device__ __forceinline__ void gs_cubic(double t, double* w) {
    const double a = -0.75;
    const auto near = [&](double x) { return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0; };
    const auto far = [&](double x) { return ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a; };
    w[0] = far(t + 1.0);
    w[1] = near(t);
    w[2] = near(1.0 - t);
    w[3] = far(2.0 - t);
}

// Y [N, C, O...] from X [N, C, D...] at grid [N, O..., k] (k ≤ 3 spatial axes; dims right-
// aligned in three slots, 1 before them), one thread per output element (grid-stride).
template <typename Tag>
__global__ void kiln_grid_sample(const typename Tag::storage* x, const typename Tag::storage* grid,
                                 typename Tag::storage* y, kiln_u64 total, kiln_u64 C, unsigned k, kiln_u64 d0,
                                 kiln_u64 d1, kiln_u64 d2, kiln_u64 o0, kiln_u64 o1, kiln_u64 o2, unsigned mode,
                                 unsigned padding, unsigned align) {
    const kiln_u64 din[3] = {d0, d1, d2};
    const kiln_u64 in_n = d0 * d1 * d2, out_n = o0 * o1 * o2;
    KILN_FOR(i, total) {
        const kiln_u64 o = i % out_n, nc = i / out_n, n = nc / C;
        const typename Tag::storage* plane = x + nc * in_n;
        const typename Tag::storage* g = grid + (n * out_n + o) * k;
        long long idx[3][4];
        double w[3][4];
        int taps[3];
        for (int a = 0; a < 3; ++a) {
            taps[a] = 1;
            idx[a][0] = 0;
            w[a][0] = 1.0;
            if (a < 3 - (int)k) continue;  // a slot before the spatial axes
            const int ax = a - (3 - (int)k);  // the spatial axis
            const long long d = (long long)din[a];
            const float gn = kiln_to_f32(Tag(), g[k - 1 - ax]);
            float xf = align ? (gn + 1.f) / 2.f * ((float)d - 1.f) : ((gn + 1.f) * (float)d - 1.f) / 2.f;
            if (mode == GS_NEAREST) xf = rintf(xf);
            const float lo = align ? 0.f : -0.5f, hi = align ? (float)d - 1.f : (float)d - 0.5f;
            if (mode != GS_CUBIC && (xf < lo || xf > hi)) {  // cubic taps are padded one by one
                if (padding == GS_BORDER) xf = fminf(fmaxf(xf, 0.f), (float)d - 1.f);
                else if (padding == GS_REFLECTION) xf = gs_reflect(xf, lo, hi);
            }
            const double xd = (double)xf, x0 = floor(xd), t = xd - x0;
            const long long i0 = (long long)x0;
            if (mode == GS_NEAREST) {
                idx[a][0] = gs_tap((long long)xd, d, padding, lo, hi);
            } else if (mode == GS_LINEAR) {
                taps[a] = 2;
                idx[a][0] = gs_tap(i0, d, padding, lo, hi);
                idx[a][1] = gs_tap(i0 + 1, d, padding, lo, hi);
                w[a][0] = 1.0 - t;
                w[a][1] = t;
            } else {
                taps[a] = 4;
                gs_cubic(t, w[a]);
                for (int j = 0; j < 4; ++j) idx[a][j] = gs_tap(i0 - 1 + j, d, padding, lo, hi);
            }
        }
        bool nan = false;
        for (unsigned a = 0; a < k; ++a) nan |= isnan(kiln_to_f32(Tag(), g[a]));
        if (nan) {  // a NaN coordinate samples nothing (as the CPU reference)
            y[i] = kiln_from_f32(Tag(), __int_as_float(0x7fc00000));
            continue;
        }
        double sum = 0.0;
        for (int p = 0; p < taps[0]; ++p)
            for (int q = 0; q < taps[1]; ++q)
                for (int r = 0; r < taps[2]; ++r) {
                    if (idx[0][p] < 0 || idx[1][q] < 0 || idx[2][r] < 0) continue;
                    const kiln_u64 at = ((kiln_u64)idx[0][p] * d1 + (kiln_u64)idx[1][q]) * d2 + (kiln_u64)idx[2][r];
                    sum += w[0][p] * w[1][q] * w[2][r] * (double)kiln_to_f32(Tag(), plane[at]);
                }
        y[i] = kiln_from_f32(Tag(), (float)sum);
    }
}

// The base grid coordinate of index i on an axis of len positions.
__device__ __forceinline__ double ag_base(kiln_u64 i, kiln_u64 len, unsigned align) {
    if (align) return len == 1 ? -1.0 : -1.0 + (double)i * (2.0 / (double)(len - 1));
    const double step = 2.0 / (double)len;
    return -1.0 + step / 2.0 + (double)i * step;
}

// grid [N, (D,) H, W, k] = θ [N, k, k + 1] · (x, y, (z), 1), one thread per grid position
// (grid-stride); dims (D, H, W) with D = 1 in 2-D.
template <typename Tag>
__global__ void kiln_affine_grid(const typename Tag::storage* theta, typename Tag::storage* grid, kiln_u64 total,
                                 unsigned k, kiln_u64 D, kiln_u64 H, kiln_u64 W, unsigned align) {
    KILN_FOR(i, total) {
        const kiln_u64 w = i % W, h = (i / W) % H, dz = (i / W / H) % D, n = i / (W * H * D);
        const double hom[4] = {ag_base(w, W, align), ag_base(h, H, align), k == 3 ? ag_base(dz, D, align) : 1.0, 1.0};
        const typename Tag::storage* th = theta + n * k * (k + 1);
        for (unsigned r = 0; r < k; ++r) {
            double v = 0.0;
            for (unsigned c = 0; c <= k; ++c) v += (double)kiln_to_f32(Tag(), th[r * (k + 1) + c]) * hom[c];
            grid[i * k + r] = kiln_from_f32(Tag(), (float)v);
        }
    }
}

// kiln-conv CUDA kernels: direct Conv and ConvTranspose (shim/src/lib.rs holds the CPU reference
// and the geometry), one thread per output element, products accumulated in f32 (f64 for
// float64: kiln-cuda-std/elem.cuh's compute type). Up to three spatial axes, right-aligned in
// three slots (1 before them). Argument order matches the shim.
#include "kiln.cuh"
#include "kiln-cuda-std/elem.cuh"

// The geometry both kernels take: per slot the input and output length, kernel size, stride,
// dilation and padding before.
struct cv_geom {
    kiln_u64 in[3], out[3], k[3], s[3], d[3], b[3];
};

#define CV_GEOM_PARAMS                                                                                               \
    kiln_u64 i0, kiln_u64 i1, kiln_u64 i2, kiln_u64 o0, kiln_u64 o1, kiln_u64 o2, kiln_u64 k0, kiln_u64 k1,         \
        kiln_u64 k2, kiln_u64 s0, kiln_u64 s1, kiln_u64 s2, kiln_u64 d0, kiln_u64 d1, kiln_u64 d2, kiln_u64 b0,       \
        kiln_u64 b1, kiln_u64 b2
#define CV_GEOM (cv_geom{{i0, i1, i2}, {o0, o1, o2}, {k0, k1, k2}, {s0, s1, s2}, {d0, d1, d2}, {b0, b1, b2}})

// The epilogue flags of kiln_conv and kiln_conv_transpose: add B[m], add Z (broadcast by its
// element strides over n, m and the three output slots), then max(·, 0).
#define CV_BIAS 1u
#define CV_Z 2u
#define CV_RELU 4u
#define CV_Z_PARAMS kiln_u64 zn, kiln_u64 zm, kiln_u64 z0, kiln_u64 z1, kiln_u64 z2

// The epilogue of output element (n, m, o): Z and relu as `flags` say (B is added first).
template <typename Tag>
__device__ __forceinline__ typename kiln_elem<Tag>::C cv_epilogue(const cv_geom& g, typename kiln_elem<Tag>::C acc,
                                                                  unsigned flags,
                                             const typename Tag::storage* z, kiln_u64 n, kiln_u64 m, kiln_u64 o,
                                             CV_Z_PARAMS) {
    if (flags & CV_Z) {
        const kiln_u64 o2 = o % g.out[2], o1 = (o / g.out[2]) % g.out[1], o0 = o / (g.out[2] * g.out[1]);
        acc += kiln_elem<Tag>::ld(z[n * zn + m * zm + o0 * z0 + o1 * z1 + o2 * z2]);
    }
    // As fmaxf(acc, 0): NaN gives 0.
    return (flags & CV_RELU) ? (acc > 0 ? acc : 0) : acc;
}

// Output position o (row-major over g.out) plus the padding before: the position in the padded
// frame that the transposed gathers (ConvTranspose, Col2Im) start from.
__device__ __forceinline__ void cv_padded(const cv_geom& g, kiln_u64 o, long long* pos) {
    for (int a = 2; a >= 0; --a) {
        pos[a] = (long long)(o % g.out[a]) + (long long)g.b[a];
        o /= g.out[a];
    }
}

// The input position (row-major over g.in) that tap t of padded position `pos` reads in a
// transposed gather — the i with i·s + t·d = pos on every axis — or false when there is none.
__device__ __forceinline__ bool cv_gather_at(const cv_geom& g, const long long* pos, kiln_u64 t, kiln_u64* at) {
    kiln_u64 tr = t, idx = 0;
    bool inside = true;
    for (int a = 0; a < 3; ++a) {
        const kiln_u64 div = a == 0 ? g.k[1] * g.k[2] : (a == 1 ? g.k[2] : 1);
        const long long q = pos[a] - (long long)((tr / div) * g.d[a]);
        tr %= div;
        const long long ip = q >= 0 ? q / (long long)g.s[a] : -1;
        inside &= q >= 0 && q % (long long)g.s[a] == 0 && ip < (long long)g.in[a];
        idx = idx * g.in[a] + (kiln_u64)(ip < 0 ? 0 : ip);
    }
    *at = idx;
    return inside;
}

// Y [N, M, O...] = B + Σ X [N, C, I...] ⋆ W [M, C/group, K...] (Conv): output position o reads
// input o·s − b + t·d for tap t.
template <typename Tag>
__global__ void kiln_conv(const typename Tag::storage* x, const typename Tag::storage* w,
                          const typename Tag::storage* bias, const typename Tag::storage* z,
                          typename Tag::storage* y, kiln_u64 total, kiln_u64 C, kiln_u64 M, kiln_u64 group,
                          unsigned flags, CV_Z_PARAMS, CV_GEOM_PARAMS) {
    const cv_geom g = CV_GEOM;
    const kiln_u64 out_n = g.out[0] * g.out[1] * g.out[2], in_n = g.in[0] * g.in[1] * g.in[2];
    const kiln_u64 taps = g.k[0] * g.k[1] * g.k[2], cg = C / group, mg = M / group;
    KILN_FOR(i, total) {
        const kiln_u64 o = i % out_n, nm = i / out_n, m = nm % M, n = nm / M, grp = m / mg;
        long long start[3];
        kiln_u64 rest = o;
        for (int a = 2; a >= 0; --a) {
            start[a] = (long long)((rest % g.out[a]) * g.s[a]) - (long long)g.b[a];
            rest /= g.out[a];
        }
        typename kiln_elem<Tag>::C acc = (flags & CV_BIAS) ? kiln_elem<Tag>::ld(bias[m]) : 0;
        for (kiln_u64 t = 0; t < taps; ++t) {
            kiln_u64 tr = t, at = 0;
            bool inside = true;
            for (int a = 0; a < 3; ++a) {
                const kiln_u64 div = a == 0 ? g.k[1] * g.k[2] : (a == 1 ? g.k[2] : 1);
                const long long p = start[a] + (long long)((tr / div) * g.d[a]);
                tr %= div;
                inside &= p >= 0 && p < (long long)g.in[a];
                at = at * g.in[a] + (kiln_u64)p;
            }
            if (!inside) continue;
            for (kiln_u64 c = 0; c < cg; ++c)
                acc += kiln_elem<Tag>::ld(x[(n * C + grp * cg + c) * in_n + at]) *
                       kiln_elem<Tag>::ld(w[(m * cg + c) * taps + t]);
        }
        y[i] = kiln_elem<Tag>::st(cv_epilogue<Tag>(g, acc, flags, z, n, m, o, zn, zm, z0, z1, z2));
    }
}

// Y [N, M, O...] = B + ConvTranspose(X [N, C, I...], W [C, M/group, K...]): output position o
// gathers input i where i·s − b + t·d = o for tap t.
template <typename Tag>
__global__ void kiln_conv_transpose(const typename Tag::storage* x, const typename Tag::storage* w,
                                    const typename Tag::storage* bias, const typename Tag::storage* z,
                                    typename Tag::storage* y, kiln_u64 total, kiln_u64 C, kiln_u64 M,
                                    kiln_u64 group, unsigned flags, CV_Z_PARAMS, CV_GEOM_PARAMS) {
    const cv_geom g = CV_GEOM;
    const kiln_u64 out_n = g.out[0] * g.out[1] * g.out[2], in_n = g.in[0] * g.in[1] * g.in[2];
    const kiln_u64 taps = g.k[0] * g.k[1] * g.k[2], cg = C / group, mg = M / group;
    KILN_FOR(i, total) {
        const kiln_u64 o = i % out_n, nm = i / out_n, m = nm % M, n = nm / M, grp = m / mg, mm = m % mg;
        long long pos[3];
        cv_padded(g, o, pos);
        typename kiln_elem<Tag>::C acc = (flags & CV_BIAS) ? kiln_elem<Tag>::ld(bias[m]) : 0;
        for (kiln_u64 t = 0; t < taps; ++t) {
            kiln_u64 at;
            if (!cv_gather_at(g, pos, t, &at)) continue;
            for (kiln_u64 c = 0; c < cg; ++c) {
                const kiln_u64 ci = grp * cg + c;
                acc += kiln_elem<Tag>::ld(x[(n * C + ci) * in_n + at]) * kiln_elem<Tag>::ld(w[(ci * mg + mm) * taps + t]);
            }
        }
        y[i] = kiln_elem<Tag>::st(cv_epilogue<Tag>(g, acc, flags, z, n, m, o, zn, zm, z0, z1, z2));
    }
}

// Col2Im (shim/src/col2im.rs): y [N, C, image…] gathers x [N, C·∏block, L]: image position o takes
// block b's position t where b·s − pad + t·d = o (geometry: `in` the block grid, `out` the image,
// `k` the block). One thread per image element.
template <typename Tag>
__global__ void kiln_col2im(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 total, CV_GEOM_PARAMS) {
    const cv_geom g = CV_GEOM;
    const kiln_u64 img = g.out[0] * g.out[1] * g.out[2], L = g.in[0] * g.in[1] * g.in[2];
    const kiln_u64 taps = g.k[0] * g.k[1] * g.k[2];
    KILN_FOR(i, total) {
        const kiln_u64 o = i % img, nc = i / img;
        long long pos[3];
        cv_padded(g, o, pos);
        typename kiln_elem<Tag>::C acc = 0;
        for (kiln_u64 t = 0; t < taps; ++t) {
            kiln_u64 at;
            if (cv_gather_at(g, pos, t, &at)) acc += kiln_elem<Tag>::ld(x[(nc * taps + t) * L + at]);
        }
        y[i] = kiln_elem<Tag>::st(acc);
    }
}

// ---- ConvInteger and QLinearConv (shim/src/qconv.rs) -----------------------------------------

// dst[i] = src[i] (uint8, or int8 when `is_signed`) less zero[(i / inner) % zero_count] (of the
// same type; none when !has_zero), as f64.
extern "C" __global__ void kiln_qconv_widen(const unsigned char* src, const unsigned char* zero, double* dst,
                                            kiln_u64 n, unsigned is_signed, unsigned has_zero, kiln_u64 zero_count,
                                            kiln_u64 inner) {
    KILN_FOR(i, n) {
        const double v = is_signed ? (double)(signed char)src[i] : (double)src[i];
        double z = 0.0;
        if (has_zero) {
            const unsigned char zb = zero[(i / inner) % zero_count];
            z = is_signed ? (double)(signed char)zb : (double)zb;
        }
        dst[i] = v - z;
    }
}

// Output element i of output channel m = (i / spatial) % channels from the exact f64 sums:
// mode 0 (ConvInteger) the int32 sum; 1 and 2 (QLinearConv, 2 with the int32 bias B[m]) the
// sum times x_scale·w_scale[m % factors] / y_scale (float32, as the CPU reference), plus the
// zero point, saturated to uint8 or int8 (`is_signed`) and rounded half to even.
extern "C" __global__ void kiln_qconv_narrow(const double* sums, const int* bias, const float* x_scale,
                                             const float* w_scale, const float* y_scale, void* y, kiln_u64 n,
                                             kiln_u64 spatial, kiln_u64 channels, kiln_u64 factors, double y_zero,
                                             unsigned mode, unsigned is_signed) {
    KILN_FOR(i, n) {
        const kiln_u64 m = (i / spatial) % channels;
        double v = sums[i];
        if (mode == 0) {
            ((int*)y)[i] = (int)v;
            continue;
        }
        if (mode == 2) v += (double)bias[m];
        const float factor = __fdiv_rn(__fmul_rn(x_scale[0], w_scale[m % factors]), y_scale[0]);
        double r = v * (double)factor + y_zero;
        const double lo = is_signed ? -128.0 : 0.0, hi = is_signed ? 127.0 : 255.0;
        r = r < lo ? lo : (r > hi ? hi : r);
        r = rint(r);
        if (is_signed) ((signed char*)y)[i] = (signed char)r;
        else ((unsigned char*)y)[i] = (unsigned char)r;
    }
}

// ---- DeformConv (shim/src/deform.rs) ---------------------------------------------------------

// Output element t = (n, m, r, q) of [N, M, oH, oW]: Σ over the group's input channels and the
// taps of W · mask · X sampled bilinearly (zero outside) at the tap's offset position. flags bit
// 0: B given; bit 1: mask given.
template <typename Tag>
__global__ void kiln_deform_conv(const typename Tag::storage* x, const typename Tag::storage* w,
                                 const typename Tag::storage* off, const typename Tag::storage* bias,
                                 const typename Tag::storage* mask, typename Tag::storage* y, kiln_u64 total,
                                 unsigned flags, kiln_u64 c, kiln_u64 h, kiln_u64 wd, kiln_u64 m, kiln_u64 group,
                                 kiln_u64 offset_group, kiln_u64 kh, kiln_u64 kw, kiln_u64 oh, kiln_u64 ow,
                                 kiln_u64 sh, kiln_u64 sw, kiln_u64 dh, kiln_u64 dw, long long ph, long long pw) {
    typedef kiln_elem<Tag> E;
    typedef typename E::C A;
    KILN_FOR(t, total) {
        const kiln_u64 q = t % ow, r = (t / ow) % oh, mo = (t / (ow * oh)) % m, b = t / (ow * oh * m);
        const kiln_u64 cg = c / group, g = mo / (m / group), cpo = c / offset_group, taps = kh * kw;
        A acc = (flags & 1u) ? (A)E::ld(bias[mo]) : (A)0;
        for (kiln_u64 ci = 0; ci < cg; ++ci) {
            const kiln_u64 ch = g * cg + ci, og = ch / cpo;
            const typename Tag::storage* map = x + (b * c + ch) * h * wd;
            for (kiln_u64 i = 0; i < kh; ++i)
                for (kiln_u64 j = 0; j < kw; ++j) {
                    const kiln_u64 tap = (og * kh + i) * kw + j, pix = r * ow + q;
                    const A dy = (A)E::ld(off[((b * offset_group * taps * 2) + tap * 2) * oh * ow + pix]);
                    const A dx = (A)E::ld(off[((b * offset_group * taps * 2) + tap * 2 + 1) * oh * ow + pix]);
                    const A sy = (A)((long long)(r * sh) - ph + (long long)(i * dh)) + dy;
                    const A sx = (A)((long long)(q * sw) - pw + (long long)(j * dw)) + dx;
                    const A mk = (flags & 2u) ? (A)E::ld(mask[((b * offset_group * taps) + tap) * oh * ow + pix]) : (A)1;
                    const A y0 = floor(sy), x0 = floor(sx), ly = sy - y0, lx = sx - x0;
                    A v = 0;
                    for (int cy = 0; cy < 2; ++cy)
                        for (int cx = 0; cx < 2; ++cx) {
                            const A yy = y0 + (A)cy, xx = x0 + (A)cx;
                            if (yy < (A)0 || xx < (A)0 || yy >= (A)h || xx >= (A)wd) continue;
                            const A wgt = (cy ? ly : (A)1 - ly) * (cx ? lx : (A)1 - lx);
                            v += wgt * (A)E::ld(map[(kiln_u64)yy * wd + (kiln_u64)xx]);
                        }
                    acc += (A)E::ld(w[((mo * cg + ci) * kh + i) * kw + j]) * mk * v;
                }
        }
        y[t] = E::st(acc);
    }
}

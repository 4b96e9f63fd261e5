// linear.cu — ai.kiln::Linear, ai.kiln::RmsNormLinear and ai.kiln::SwiGluLinear (shim/src/linear.rs):
// Y = A · Wᵀ with W stored [N, K] (K contiguous, as torch.nn.Linear keeps its weight), where A is
// X itself (Linear), RMS-normalised X (+ skip) (RmsNormLinear) or SiLU(gate)·up of a packed
// [gate | up] row (SwiGluLinear). A is rounded to the storage type before the product, as the
// unfused graph stores it (SwiGluLinear rounds after Sigmoid, Mul and Mul, as those three
// ops do); products accumulate in f32.
//
// Decode (few rows): kiln_linear_gemv<Tag, MODE, R>, one kernel. Every block first computes A for its rows
// into shared memory (the prologue; every block does it again, which costs L2 reads of a few
// KiB), then each warp computes LIN_COLS outputs for all those rows (one under the SwiGLU
// epilogue, LIN_OUT_SWIGLU below: its gate and up rows): lanes stream 16-byte runs
// of a weight row (all loads of a pass issued before the first FMA), partial sums meet in warp
// shuffles. The first pass's weight lines are prefetched into L2 before the grid-dependency
// wait, so under programmatic dependent launch they stream in while the previous kernel ends;
// before that wait the kernel reads nothing and writes nothing (every block reaches the wait),
// except a W constant for the session (W_CONST: an initializer, which no kernel writes), whose
// first pass it loads into registers there. It lets the next kernel launch at once
// (griddepcontrol.launch_dependents): a GEMV after it fetches its own weights while this one runs.
//
// Prefill (many rows): the shim writes A with kiln_linear_rmsnorm<Tag> / kiln_linear_swiglu<Tag>
// into scratch and calls cuBLASLt (gemm with transB) for the product.
#include "kiln.cuh"
#include "kiln-cuda-std/elem.cuh"
#include "kiln-cuda-std/mma.cuh"
#include "kiln-cuda-std/reduce.cuh"

// The kernels' MODE template argument: the GEMV's prologue (the shim's `Prologue`) in the low
// two bits, and LIN_OUT_SWIGLU for the SwiGLU epilogue (the shim's `swiglu` attribute): W's rows
// are [gate | up] halves of n / 2 each, and the kernel writes Y [rows, n / 2] = SiLU(gate) · up
// of the product's two halves, each rounded to the storage type first (as the unfused graph stores
// the product) and then as Sigmoid, Mul and Mul round (silu_mul). A warp or tile then holds gate
// row j and up row n / 2 + j together, each output's sum over K in the order the plain kernel
// takes, so the product is the plain kernel's to the bit.
enum { LIN_LINEAR = 0, LIN_RMSNORM = 1, LIN_SWIGLU = 2, LIN_OUT_SWIGLU = 4 };
enum { LIN_RMSNORM_SWIGLU = LIN_RMSNORM | LIN_OUT_SWIGLU };

namespace lin {

// Element type T of the kernels: kiln-cuda-std's kiln_elem<Tag> (storage S, ld / st through
// f32) and the 16-byte packing of VEC values the GEMV loads and stores.
template <typename Tag>
struct Elem;

// Eight 16-bit values in 16 bytes, converted through T::ld / T::st (float16, bfloat16).
template <typename T>
struct Packed16 {
    enum { VEC = 8 };
    static __device__ __forceinline__ void unpack(const uint4& v, float* f) {
        const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            f[2 * i] = T::ld((typename T::S)(w[i] & 0xffffu));
            f[2 * i + 1] = T::ld((typename T::S)(w[i] >> 16));
        }
    }
    static __device__ __forceinline__ uint4 pack(const float* f) {
        unsigned w[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) w[i] = (unsigned)T::st(f[2 * i]) | ((unsigned)T::st(f[2 * i + 1]) << 16);
        return make_uint4(w[0], w[1], w[2], w[3]);
    }
};

template <>
struct Elem<kiln_tag_f32> : kiln_elem<kiln_tag_f32> {
    enum { VEC = 4 };
    static __device__ __forceinline__ void unpack(const uint4& v, float* f) {
        f[0] = __uint_as_float(v.x);
        f[1] = __uint_as_float(v.y);
        f[2] = __uint_as_float(v.z);
        f[3] = __uint_as_float(v.w);
    }
    static __device__ __forceinline__ uint4 pack(const float* f) {
        return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]), __float_as_uint(f[3]));
    }
};
template <>
struct Elem<kiln_tag_f16> : kiln_elem<kiln_tag_f16>, Packed16<Elem<kiln_tag_f16> > {
    typedef kiln_tag_f16 tag;
};
template <>
struct Elem<kiln_tag_bf16> : kiln_elem<kiln_tag_bf16>, Packed16<Elem<kiln_tag_bf16> > {
    typedef kiln_tag_bf16 tag;
};
typedef Elem<kiln_tag_f16> F16;
typedef Elem<kiln_tag_bf16> BF16;

// Flags of the RMS prologue (HAS_SKIP, HAS_SUM) and of the weight: W_CONST, W is constant for the
// session (an initializer no kernel writes: ABI.md §7.7), so its first pass is loaded into
// registers before the grid-dependency wait instead of only prefetched into L2.
enum { HAS_SKIP = 1, HAS_SUM = 2, W_CONST = 4 };

// 8 warps of 6 loads in flight: on an H100 the 30-layer decode step's GEMVs took 51 µs less
// than at 4 warps of 4 (bench/RESULTS.md, 2026-12-06, session 26), the down projection most.
#define LIN_WARPS 8    // warps per block
#define LIN_COLS 2     // outputs (weight rows) per warp
#define LIN_UNROLL 6   // 16-byte weight loads per lane and output in flight
// The same for the quantized GEMV (its unpacking needs the registers): at 2 instead of 4 the
// 4-bit Linear form's code halves (46 → 25 KB of CUBIN text) and an int4 decode step at batch 1
// took 0.578 against 0.615 ms (H100, bench/RESULTS.md, 2026-12-06, session 33); K ≤ 2,048 at 4
// bits is one pass either way.
#define LIN_QUNROLL 2
#define LIN_QWARPS 8   // warps per block of the quantized GEMV (the shim's Q_GEMV_WARPS; 4 and 2 slower)
// Independent partial sums a lane keeps per output, added at the end: LIN_QCHAINS (1, 2 or 4) over
// a 4- or 8-bit chunk's products, LIN_CHAINS (1 or 2) over the 16-bit GEMV's. One keeps the sums
// in K order; more shorten the chain of dependent FMAs (ncu, H100, session 42: the 4-bit Linear
// form's O and down projections issue an instruction every 2.9–3.8 cycles a scheduler with 2
// warps, 65–74 % of cycles with none eligible). Compile-time constants for drop-in A/Bs
// (scripts/make-variant.sh).
#define LIN_QCHAINS 1
#define LIN_CHAINS 1
static_assert(LIN_QCHAINS == 1 || LIN_QCHAINS == 2 || LIN_QCHAINS == 4, "LIN_QCHAINS is 1, 2 or 4");
static_assert(LIN_CHAINS == 1 || LIN_CHAINS == 2, "LIN_CHAINS is 1 or 2");
// Where W is constant, the quantized GEMV loads its first pass's weights before the
// grid-dependency wait. LIN_QPRE 1: its Linear form (MODE LIN_LINEAR: O and down in a decoder
// layer) also unpacks there, after triggering its dependents, each output's first chunk per lane,
// so that the ~3 instructions a value (about 190 of an O projection warp's 651, ncu, session 42)
// overlap the kernel before instead of following the wait; 2: every form does (the RMS and
// SwiGluLinear prologues too); 0: every form unpacks them after the prologue, as every other
// chunk. The cost: the unpacking waits for the weights before the wait, so when the kernel before
// has already finished, the prologue's loads of X start after the weights have come instead of
// beside them. The values stay in registers across the prologue: NVRTC 13.0 gives the 4-bit
// Linear form 128 registers instead of 64 (2 blocks of 256 threads an SM still fit), and at 2 the
// RMS forms 176 instead of 108 (one block an SM: the gate·up projection's 192 blocks and the LM
// head's 264 then take two waves). A compile-time constant for drop-in A/Bs.
#define LIN_QPRE 0
static_assert(LIN_QPRE == 0 || LIN_QPRE == 1 || LIN_QPRE == 2, "LIN_QPRE is 0, 1 or 2");
#define LIN_PRO 4      // 16-byte activation loads per thread in flight in the prologue
#ifndef LIN_PRO_COPY   // the same for Linear's copy (no up operand); -D for bench/layer_probe.cu:
#define LIN_PRO_COPY 4 // 8 would load batch 8's down (8 rows of 1,536) in one round trip instead
#endif                 // of two (its b8-epi-pro8 build; not yet run on a GPU)

// Sigmoid without overflow and without a branch: with e = exp(-|g|), 1 / (1 + e) for g ≥ 0 and
// e / (1 + e) below (kiln-unary's formula, the division as a correctly rounded reciprocal).
__device__ __forceinline__ float sigmoid(float g) {
    const float e = expf(-fabsf(g));
    const float r = __frcp_rn(1.f + e);
    return g >= 0.f ? r : e * r;
}

// SiLU(g)·u as the ONNX ops Sigmoid, Mul, Mul compute it on kiln's GPU: each in f32 and rounded
// to the storage type (the caller rounds the last).
template <typename T>
__device__ __forceinline__ float silu_mul(float g, float u) {
    const float s = T::ld(T::st(sigmoid(g)));
    return T::ld(T::st(g * s)) * u;
}

// A chunk of VEC values of A into shared memory as f32, each rounded to the storage type first
// (A holds what the unfused graph would store), and back.
template <typename T>
__device__ __forceinline__ void store_a(float* dst, const float* f) {
    float4* d = (float4*)dst;
#pragma unroll
    for (int i = 0; i < T::VEC / 4; ++i)
        d[i] = make_float4(T::ld(T::st(f[4 * i])), T::ld(T::st(f[4 * i + 1])), T::ld(T::st(f[4 * i + 2])),
                           T::ld(T::st(f[4 * i + 3])));
}

template <typename T>
__device__ __forceinline__ void load_a(const float* src, float* f) {
    const float4* s = (const float4*)src;
#pragma unroll
    for (int i = 0; i < T::VEC / 4; ++i) {
        const float4 v = s[i];
        f[4 * i] = v.x;
        f[4 * i + 1] = v.y;
        f[4 * i + 2] = v.z;
        f[4 * i + 3] = v.w;
    }
}

// One row of RmsNormLinear's A by `lanes` threads starting at `lane` (`reduce` sums over them),
// scalar accesses (the prefill kernel): s = x + skip, a = s · (1 / rms) · gamma with
// rms = sqrt(mean(s²) + eps); s is written to `sum` when given.
template <typename T, typename Reduce>
__device__ __forceinline__ void rms_row(const typename T::S* x, const typename T::S* skip, const typename T::S* gamma,
                                        typename T::S* a, typename T::S* sum, kiln_u64 row, kiln_u64 k,
                                        kiln_u64 skip_len, unsigned flags, float eps, unsigned lane, unsigned lanes,
                                        Reduce reduce) {
    const kiln_u64 base = row * k;
    float q = 0.f;
    for (kiln_u64 c = lane; c < k; c += lanes) {
        float s = T::ld(x[base + c]);
        if (flags & HAS_SKIP) s += T::ld(skip[(base + c) % skip_len]);
        if (sum) sum[base + c] = T::st(s);
        q += s * s;
    }
    const float inv = 1.f / sqrtf(reduce(q) / (float)k + eps);
    for (kiln_u64 c = lane; c < k; c += lanes) {
        float s = T::ld(x[base + c]);
        if (flags & HAS_SKIP) s += T::ld(skip[(base + c) % skip_len]);
        a[c] = T::st(s * inv * T::ld(gamma[c]));
    }
}

struct WarpSum {
    __device__ __forceinline__ float operator()(float v) const { return kiln_warp_sum(v); }
};

// Block-wide sum (kiln-cuda-std's kiln_block_reduce) over `shared`, 32 floats.
struct BlockSum {
    float* shared;
    __device__ __forceinline__ float operator()(float v) const { return kiln_block_reduce(v, shared, false); }
};

// rms_row for the GEMV prologue: one warp, 16-byte accesses, LIN_PRO loads of each operand in
// flight per lane. `a(c, f)` stores chunk c (VEC values, f32, not yet rounded) of the row into
// shared memory; `sum` is the row of the sum output or null; kc = k / VEC; skip_len is a multiple
// of k. A row of at most 32·LIN_PRO chunks (k ≤ 1,024 for 16-bit types) is loaded once, gamma
// with it, and kept in registers: one round trip to memory instead of two.
template <typename T, typename Store>
__device__ __forceinline__ void rms_row_warp(const typename T::S* x, const typename T::S* skip,
                                             const typename T::S* gamma, Store a, typename T::S* sum,
                                             kiln_u64 row, kiln_u64 k, unsigned kc, kiln_u64 skip_len, unsigned flags,
                                             float eps, unsigned lane) {
    const uint4* xr = (const uint4*)(x + row * k);
    const uint4* sr = (const uint4*)(skip + (row * k) % skip_len);
    const uint4* gr = (const uint4*)gamma;
    uint4* sum_r = (uint4*)sum;
    const bool has_skip = flags & HAS_SKIP;
    float q = 0.f;
    if (kc <= 32 * LIN_PRO) {
        uint4 xv[LIN_PRO], sv[LIN_PRO], gv[LIN_PRO];
#pragma unroll
        for (int u = 0; u < LIN_PRO; ++u) {
            const unsigned c = u * 32 + lane;
            xv[u] = c < kc ? xr[c] : make_uint4(0, 0, 0, 0);
            sv[u] = has_skip && c < kc ? sr[c] : make_uint4(0, 0, 0, 0);
            gv[u] = c < kc ? gr[c] : make_uint4(0, 0, 0, 0);
        }
        float xs[LIN_PRO][T::VEC];
#pragma unroll
        for (int u = 0; u < LIN_PRO; ++u) {
            float sf[T::VEC];
            T::unpack(xv[u], xs[u]);
            T::unpack(sv[u], sf);
#pragma unroll
            for (int e = 0; e < T::VEC; ++e) {
                xs[u][e] += sf[e];
                q += xs[u][e] * xs[u][e];
            }
            const unsigned c = u * 32 + lane;
            if (sum_r && c < kc) sum_r[c] = T::pack(xs[u]);
        }
        const float inv = 1.f / sqrtf(kiln_warp_sum(q) / (float)k + eps);
#pragma unroll
        for (int u = 0; u < LIN_PRO; ++u) {
            float gf[T::VEC];
            T::unpack(gv[u], gf);
#pragma unroll
            for (int e = 0; e < T::VEC; ++e) xs[u][e] = xs[u][e] * inv * gf[e];
            const unsigned c = u * 32 + lane;
            if (c < kc) a(c, xs[u]);
        }
        return;
    }
    for (unsigned c0 = 0; c0 < kc; c0 += 32 * LIN_PRO) {
        uint4 xv[LIN_PRO], sv[LIN_PRO];
#pragma unroll
        for (int u = 0; u < LIN_PRO; ++u) {
            const unsigned c = c0 + u * 32 + lane;
            xv[u] = c < kc ? xr[c] : make_uint4(0, 0, 0, 0);
            sv[u] = has_skip && c < kc ? sr[c] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < LIN_PRO; ++u) {
            float xf[T::VEC], sf[T::VEC];
            T::unpack(xv[u], xf);
            T::unpack(sv[u], sf);
#pragma unroll
            for (int e = 0; e < T::VEC; ++e) {
                xf[e] += sf[e];
                q += xf[e] * xf[e];
            }
            const unsigned c = c0 + u * 32 + lane;
            if (sum_r && c < kc) sum_r[c] = T::pack(xf);
        }
    }
    const float inv = 1.f / sqrtf(kiln_warp_sum(q) / (float)k + eps);
    for (unsigned c0 = 0; c0 < kc; c0 += 32 * LIN_PRO) {
        uint4 xv[LIN_PRO], sv[LIN_PRO], gv[LIN_PRO];
#pragma unroll
        for (int u = 0; u < LIN_PRO; ++u) {
            const unsigned c = c0 + u * 32 + lane;
            xv[u] = c < kc ? xr[c] : make_uint4(0, 0, 0, 0);
            gv[u] = c < kc ? gr[c] : make_uint4(0, 0, 0, 0);
            sv[u] = has_skip && c < kc ? sr[c] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < LIN_PRO; ++u) {
            float xf[T::VEC], sf[T::VEC], gf[T::VEC];
            T::unpack(xv[u], xf);
            T::unpack(sv[u], sf);
            T::unpack(gv[u], gf);
#pragma unroll
            for (int e = 0; e < T::VEC; ++e) xf[e] = (xf[e] + sf[e]) * inv * gf[e];
            const unsigned c = c0 + u * 32 + lane;
            if (c < kc) a(c, xf);
        }
    }
}

// A in shared memory for the CUDA-core GEMV: row r at a + r·k in f32, rounded to the storage type.
template <typename T>
struct RowsF32 {
    float* a;
    kiln_u64 k;
    struct Row {
        float* p;
        __device__ __forceinline__ void operator()(unsigned c, const float* f) const { store_a<T>(p + c * T::VEC, f); }
    };
    __device__ __forceinline__ Row row(unsigned r) const { return Row{a + (kiln_u64)r * k}; }
};

// A's rows row0 .. row0 + rows_here into shared memory through `out` (RowsF32 or RowsMma), by the
// whole block: RMS (one warp per row, `sum` written by the blocks of column block 0 when flags has
// HAS_SUM), SwiGlu (chunk i of A from the gate and up chunks of X's row) or a copy (Linear).
template <typename T, int MODE_, typename Rows>
__device__ __forceinline__ void prologue(const typename T::S* x, const typename T::S* skip,
                                         const typename T::S* gamma, typename T::S* sum, Rows out, kiln_u64 row0,
                                         unsigned rows_here, kiln_u64 k, unsigned kc, kiln_u64 skip_len,
                                         unsigned flags, float eps) {
    typedef typename T::S S;
    enum { MODE = MODE_ & 3 };  // the prologue's bits
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    if (MODE == LIN_RMSNORM) {
        for (unsigned r = warp; r < rows_here; r += warps) {
            S* s = (blockIdx.x == 0 && (flags & HAS_SUM)) ? sum + (row0 + r) * k : (S*)0;
            rms_row_warp<T>(x, skip, gamma, out.row(r), s, row0 + r, k, kc, skip_len, flags, eps, lane);
        }
        return;
    }
    const unsigned total = rows_here * kc;
    enum { PRO = MODE == LIN_SWIGLU ? LIN_PRO : LIN_PRO_COPY };
    for (unsigned i0 = threadIdx.x; i0 < total; i0 += blockDim.x * PRO) {
        uint4 gv[PRO], uv[PRO];
#pragma unroll
        for (int u = 0; u < PRO; ++u) {
            const unsigned i = i0 + u * blockDim.x, r = i / kc, c = i - r * kc;
            const uint4* xr = (const uint4*)(x + (row0 + r) * (MODE == LIN_SWIGLU ? 2 : 1) * k);
            gv[u] = i < total ? xr[c] : make_uint4(0, 0, 0, 0);
            if (MODE == LIN_SWIGLU) uv[u] = i < total ? xr[kc + c] : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < PRO; ++u) {
            const unsigned i = i0 + u * blockDim.x, r = i / kc, c = i - r * kc;
            if (i >= total) continue;
            float f[T::VEC];
            T::unpack(gv[u], f);
            if (MODE == LIN_SWIGLU) {
                float uf[T::VEC];
                T::unpack(uv[u], uf);
#pragma unroll
                for (int e = 0; e < T::VEC; ++e) f[e] = silu_mul<T>(f[e], uf[e]);
            }
            out.row(r)(c, f);
        }
    }
}

// Loads the weight runs of one pass: W rows col + j·stride for j < LIN_COLS (stride 1: outputs
// col .. col + LIN_COLS − 1; n / 2 under LIN_OUT_SWIGLU: gate row col and up row n / 2 + col),
// 16-byte chunks base + u·32 + lane (zeros past the row or past W's n rows).
__device__ __forceinline__ void load_pass(uint4 (&wv)[LIN_COLS][LIN_UNROLL], const uint4* w, kiln_u64 col,
                                          kiln_u64 stride, kiln_u64 n, unsigned kc, unsigned base, unsigned lane) {
#pragma unroll
    for (int j = 0; j < LIN_COLS; ++j) {
        const kiln_u64 row = col + j * stride;
#pragma unroll
        for (int u = 0; u < LIN_UNROLL; ++u) {
            const unsigned c = base + u * 32 + lane;
            wv[j][u] = row < n && c < kc ? __ldg(w + row * kc + c) : make_uint4(0, 0, 0, 0);
        }
    }
}

// prefetch.global.L2 of the lines load_pass(…, base 0, …) reads.
__device__ __forceinline__ void prefetch_pass(const uint4* w, kiln_u64 col, kiln_u64 stride, kiln_u64 n, unsigned kc,
                                              unsigned lane) {
#pragma unroll
    for (int j = 0; j < LIN_COLS; ++j) {
        const kiln_u64 row = col + j * stride;
#pragma unroll
        for (int u = 0; u < LIN_UNROLL; ++u) {
            const unsigned c = u * 32 + lane;
            if (row < n && c < kc) asm volatile("prefetch.global.L2 [%0];" ::"l"(w + row * kc + c));
        }
    }
}

// prefetch.global.L2 of gamma's kc 16-byte chunks, by one warp of the grid (as prefetch_pass,
// safe before the grid-dependency wait for any tensor; every block then finds gamma in L2).
__device__ __forceinline__ void prefetch_gamma(const void* gamma, unsigned kc, unsigned lane) {
    for (unsigned c = lane; c < kc; c += 32) asm volatile("prefetch.global.L2 [%0];" ::"l"((const uint4*)gamma + c));
}

// A warp's outputs col .. col + LIN_COLS − 1 of its rows: each partial sum summed over the lanes
// and written by lane 0 (rows past rows_here and columns past n skipped).
template <typename T, int ROWS>
__device__ __forceinline__ void store_cols(const float (&acc)[ROWS][LIN_COLS], typename T::S* y, kiln_u64 row0,
                                           unsigned rows_here, kiln_u64 n, kiln_u64 col, unsigned lane) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (ROWS == 1 || r < (int)rows_here) {
#pragma unroll
            for (int j = 0; j < LIN_COLS; ++j) {
                const float v = kiln_warp_sum(acc[r][j]);
                if (lane == 0 && col + j < n) y[(row0 + r) * n + col + j] = T::st(v);
            }
        }
    }
}

// Under LIN_OUT_SWIGLU, a warp's output col of its rows from its accumulators of gate row col
// (slot 0) and up row n_out + col (slot 1), written by lane 0 to Y [rows, n_out].
template <typename T, int ROWS>
__device__ __forceinline__ void store_swiglu(const float (&acc)[ROWS][LIN_COLS], typename T::S* y, kiln_u64 row0,
                                             unsigned rows_here, kiln_u64 n_out, kiln_u64 col, unsigned lane) {
    static_assert(LIN_COLS == 2, "the SwiGLU epilogue pairs a warp's two weight rows");
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (ROWS == 1 || r < (int)rows_here) {
            const float g = T::ld(T::st(kiln_warp_sum(acc[r][0]))), u = T::ld(T::st(kiln_warp_sum(acc[r][1])));
            if (lane == 0) y[(row0 + r) * n_out + col] = T::st(silu_mul<T>(g, u));
        }
    }
}

// Y[rows, n] = A · Wᵀ for at most ROWS rows per block (blockIdx.y picks them); see the top.
// MODE is the prologue (and LIN_OUT_SWIGLU: one output per warp, Y [rows, n / 2]); ROWS (1, 2
// or 4) sizes the accumulators, so that a decode step of one row carries no arithmetic for four.
template <typename T, int MODE, int ROWS>
__device__ __forceinline__ void gemv(const typename T::S* x, const typename T::S* skip, const typename T::S* gamma,
                                     const typename T::S* w, typename T::S* y, typename T::S* sum, kiln_u64 rows,
                                     kiln_u64 n, kiln_u64 k, kiln_u64 skip_len, unsigned flags, float eps) {
    typedef typename T::S S;
    extern __shared__ __align__(16) unsigned char lin_shared[];
    float* a = (float*)lin_shared;  // [rows_here, k] in f32: converted once, read by every warp
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const kiln_u64 row0 = (kiln_u64)blockIdx.y * ROWS;
    const unsigned rows_here = (unsigned)min((kiln_u64)ROWS, rows - row0);
    const unsigned kc = (unsigned)(k / T::VEC);
    const uint4* w4 = (const uint4*)w;
    // A warp's LIN_COLS weight rows: outputs col .. col + LIN_COLS − 1, or (SwiGLU) gate row col
    // and up row n / 2 + col for output col.
    const bool epi = MODE & LIN_OUT_SWIGLU;
    const kiln_u64 n_out = epi ? n / 2 : n, stride = epi ? n_out : 1, per_warp = epi ? 1 : LIN_COLS;
    const kiln_u64 col_step = (kiln_u64)gridDim.x * LIN_WARPS * per_warp;
    kiln_u64 col = ((kiln_u64)blockIdx.x * LIN_WARPS + warp) * per_warp;

    // Before the wait, the first pass's weights: loaded into registers when W is constant for the
    // session (W_CONST: an initializer, which no kernel writes), else only prefetched into L2 (W
    // may then be any tensor, and L2 is where every SM's writes meet, so a prefetch cannot bring
    // in a stale copy; the loads come after the wait).
    uint4 wv[LIN_COLS][LIN_UNROLL];
    const bool w_const = flags & W_CONST;
    if (w_const)
        load_pass(wv, w4, col, stride, n, kc, 0, lane);
    else
        prefetch_pass(w4, col, stride, n, kc, lane);
    if ((MODE & 3) == LIN_RMSNORM && blockIdx.x == 0 && blockIdx.y == 0 && warp == 0) prefetch_gamma(gamma, kc, lane);
    kiln_griddep_launch_dependents();
    kiln_griddep_wait();
    if (!w_const) load_pass(wv, w4, col, stride, n, kc, 0, lane);

    // Prologue: A for this block's rows.
    prologue<T, MODE>(x, skip, gamma, sum, RowsF32<T>{a, k}, row0, rows_here, k, kc, skip_len, flags, eps);
    __syncthreads();

    bool loaded = true;
    for (; col < n_out; col += col_step) {
        // LIN_CHAINS independent sums per output (value e of a chunk into sum e % LIN_CHAINS),
        // added at the end.
        float accs[LIN_CHAINS][ROWS][LIN_COLS];
#pragma unroll
        for (int h = 0; h < LIN_CHAINS; ++h)
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
#pragma unroll
                for (int j = 0; j < LIN_COLS; ++j) accs[h][r][j] = 0.f;
        for (unsigned base = 0; base < kc; base += 32 * LIN_UNROLL) {
            if (!loaded) load_pass(wv, w4, col, stride, n, kc, base, lane);
            loaded = false;
#pragma unroll
            for (int u = 0; u < LIN_UNROLL; ++u) {
                const unsigned c = base + u * 32 + lane;
                if (c < kc) {
                    float wf[LIN_COLS][T::VEC];
#pragma unroll
                    for (int j = 0; j < LIN_COLS; ++j) T::unpack(wv[j][u], wf[j]);
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) {
                        if (ROWS == 1 || r < (int)rows_here) {
                            float af[T::VEC];
                            load_a<T>(a + (r * kc + c) * T::VEC, af);
#pragma unroll
                            for (int j = 0; j < LIN_COLS; ++j)
#pragma unroll
                                for (int e = 0; e < T::VEC; ++e)
                                    accs[e % LIN_CHAINS][r][j] = fmaf(af[e], wf[j][e], accs[e % LIN_CHAINS][r][j]);
                        }
                    }
                }
            }
        }
        float acc[ROWS][LIN_COLS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int j = 0; j < LIN_COLS; ++j)
                acc[r][j] = LIN_CHAINS == 2 ? accs[0][r][j] + accs[(LIN_CHAINS - 1)][r][j] : accs[0][r][j];
        if (epi)
            store_swiglu<T, ROWS>(acc, y, row0, rows_here, n_out, col, lane);
        else
            store_cols<T, ROWS>(acc, y, row0, rows_here, n, col, lane);
    }
}

// ---- 4-bit and 8-bit weights (MatMulNBits' layout) ------------------------------------------
//
// W is uint8 [N, kb, block · BITS / 8]: value k of row n is bits (k · BITS) % 8 .. of byte
// k · BITS / 8 of the row (the low nibble first for 4 bits), and dequantizes to
// (q − 2^(BITS − 1)) · scales[n·kb + k / block] (MatMulNBits with its default zero point). A
// 16-byte chunk holds 128 / BITS values (32 or 16) of one block (block a multiple of that), so a
// lane takes whole chunks and one scale per chunk. A sits in shared memory as f32 in groups of 4:
// group g (values 4g .. 4g + 3 of each chunk) of chunk c of row r at float4 (r·G + g)·kc + c with
// G = 128 / BITS / 4 groups per chunk, so the lanes of a warp, on consecutive chunks, read
// consecutive float4s.
#define Q4_VALUES 32  // values per 16-byte chunk of 4-bit weights

// Values and 4-value groups per 16-byte chunk of BITS-bit weights.
template <int BITS>
struct QChunk {
    enum { VALUES = 128 / BITS, GROUPS = 128 / BITS / 4 };
};

// A's rows for the BITS-bit GEMV (see above): the prologue's chunk c of VEC values, rounded to
// the storage type as store_a does.
template <typename T, int BITS>
struct RowsQ {
    typedef QChunk<BITS> Q;
    float4* a;
    unsigned kc;  // weight chunks per row
    struct Row {
        float4* p;
        unsigned kc;
        __device__ __forceinline__ void operator()(unsigned c, const float* f) const {
#pragma unroll
            for (int i = 0; i < T::VEC / 4; ++i) {
                const unsigned v = c * T::VEC + 4 * i, chunk = v / Q::VALUES, g = (v % Q::VALUES) / 4;
                p[g * kc + chunk] = make_float4(T::ld(T::st(f[4 * i])), T::ld(T::st(f[4 * i + 1])),
                                                T::ld(T::st(f[4 * i + 2])), T::ld(T::st(f[4 * i + 3])));
            }
        }
    };
    __device__ __forceinline__ Row row(unsigned r) const { return Row{a + (kiln_u64)r * Q::GROUPS * kc, kc}; }
};

// The values of a chunk as q − 2^(BITS − 1) in f32: each becomes the float 2^23 + q by its bits,
// then q − 2^(BITS − 1) by one subtraction, both exact. Value v is bits (v · BITS) % 32 .. of word
// v · BITS / 32.
template <int BITS>
__device__ __forceinline__ void q_unpack(const uint4& w, float (&q)[QChunk<BITS>::VALUES]) {
    const unsigned words[4] = {w.x, w.y, w.z, w.w};
    const float bias = 8388608.f + (float)(1 << (BITS - 1));
#pragma unroll
    for (int v = 0; v < QChunk<BITS>::VALUES; ++v)
        q[v] = __uint_as_float(0x4B000000u | ((words[v * BITS / 32] >> ((v * BITS) % 32)) & ((1u << BITS) - 1u))) -
               bias;
}

// Σ a·q over the values of chunk c of one row of A (`a`: the row's first float4), q from q_unpack.
template <int BITS>
__device__ __forceinline__ float q_dot(const float (&q)[QChunk<BITS>::VALUES], const float4* a, unsigned c,
                                       unsigned kc) {
    // LIN_QCHAINS independent partial sums (value e of a group into sum e % LIN_QCHAINS), added
    // in a tree at the end.
    float s[LIN_QCHAINS];
#pragma unroll
    for (int i = 0; i < LIN_QCHAINS; ++i) s[i] = 0.f;
#pragma unroll
    for (int g = 0; g < QChunk<BITS>::GROUPS; ++g) {
        const float4 av = a[g * kc + c];
        s[0] = fmaf(av.x, q[4 * g], s[0]);
        s[1 % LIN_QCHAINS] = fmaf(av.y, q[4 * g + 1], s[1 % LIN_QCHAINS]);
        s[2 % LIN_QCHAINS] = fmaf(av.z, q[4 * g + 2], s[2 % LIN_QCHAINS]);
        s[3 % LIN_QCHAINS] = fmaf(av.w, q[4 * g + 3], s[3 % LIN_QCHAINS]);
    }
    if constexpr (LIN_QCHAINS == 4) return (s[0] + s[1 % LIN_QCHAINS]) + (s[2 % LIN_QCHAINS] + s[3 % LIN_QCHAINS]);
    if constexpr (LIN_QCHAINS == 2) return s[0] + s[1 % LIN_QCHAINS];
    return s[0];
}

// The chunks of one pass of the quantized GEMV and their scales: W rows col + j·stride for j <
// LIN_COLS (as load_pass: stride 1, or n / 2 under LIN_OUT_SWIGLU), chunks base + u·32 + lane
// (zeros past the row or past W's n rows); rc chunks per W row, cpb chunks per block.
template <typename T>
__device__ __forceinline__ void q_load(uint4 (&wv)[LIN_COLS][LIN_QUNROLL], float (&sv)[LIN_COLS][LIN_QUNROLL],
                                        const uint4* w, const typename T::S* scales, kiln_u64 col, kiln_u64 stride,
                                        kiln_u64 n, unsigned kc, unsigned rc, unsigned cpb, unsigned kb,
                                        unsigned base, unsigned lane) {
#pragma unroll
    for (int j = 0; j < LIN_COLS; ++j) {
        const kiln_u64 row = col + j * stride;
#pragma unroll
        for (int u = 0; u < LIN_QUNROLL; ++u) {
            const unsigned c = base + u * 32 + lane;
            const bool ok = row < n && c < kc;
            wv[j][u] = ok ? __ldg(w + row * rc + c) : make_uint4(0, 0, 0, 0);
            sv[j][u] = ok ? T::ld(scales[row * kb + c / cpb]) : 0.f;
        }
    }
}

// prefetch.global.L2 of the lines q_load(…, base 0, …) reads, weights and scales.
template <typename T>
__device__ __forceinline__ void q_prefetch(const uint4* w, const typename T::S* scales, kiln_u64 col,
                                            kiln_u64 stride, kiln_u64 n, unsigned kc, unsigned rc, unsigned kb,
                                            unsigned lane) {
#pragma unroll
    for (int j = 0; j < LIN_COLS; ++j) {
        const kiln_u64 row = col + j * stride;
        if (row >= n) break;
#pragma unroll
        for (int u = 0; u < LIN_QUNROLL; ++u) {
            const unsigned c = u * 32 + lane;
            if (c < kc) asm volatile("prefetch.global.L2 [%0];" ::"l"(w + row * rc + c));
        }
        if (lane == 0) asm volatile("prefetch.global.L2 [%0];" ::"l"(scales + row * kb));
    }
}

// Y[rows, n] = A · dequant(W)ᵀ for at most ROWS rows per block, W BITS-bit (see above): gemv's
// structure and PDL contract (the first pass's weights and scales loaded, when constant, or
// prefetched into L2 before the grid-dependency wait), with 128 / BITS values per 16-byte weight
// load: kc = k / (128 / BITS) chunks of A per row, rc = kb·block / (128 / BITS) chunks per W row.
// Under LIN_OUT_SWIGLU a warp holds gate row col and up row n / 2 + col (gemv's epilogue).
template <typename T, int MODE, int ROWS, int BITS>
__device__ __forceinline__ void gemv_q(const typename T::S* x, const typename T::S* skip,
                                        const typename T::S* gamma, const unsigned char* w,
                                        const typename T::S* scales, typename T::S* y, typename T::S* sum,
                                        kiln_u64 rows, kiln_u64 n, kiln_u64 k, kiln_u64 skip_len, unsigned flags,
                                        float eps, unsigned kb, unsigned block) {
    extern __shared__ __align__(16) unsigned char lin_shared[];
    float4* a = (float4*)lin_shared;
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const kiln_u64 row0 = (kiln_u64)blockIdx.y * ROWS;
    const unsigned rows_here = (unsigned)min((kiln_u64)ROWS, rows - row0);
    typedef QChunk<BITS> Q;
    const unsigned kc = (unsigned)(k / Q::VALUES), rc = kb * block / Q::VALUES, cpb = block / Q::VALUES;
    const uint4* w4 = (const uint4*)w;
    const bool epi = MODE & LIN_OUT_SWIGLU;
    const kiln_u64 n_out = epi ? n / 2 : n, stride = epi ? n_out : 1, per_warp = epi ? 1 : LIN_COLS;
    const kiln_u64 col_step = (kiln_u64)gridDim.x * LIN_QWARPS * per_warp;
    kiln_u64 col = ((kiln_u64)blockIdx.x * LIN_QWARPS + warp) * per_warp;

    uint4 wv[LIN_COLS][LIN_QUNROLL];
    float sv[LIN_COLS][LIN_QUNROLL];
    // The values of chunk u = 0 of each output, unpacked (LIN_QPRE: before the wait, when W is
    // constant, for the first pass; then `unpacked` until that pass has used them).
    float q0[LIN_COLS][Q::VALUES];
    const bool w_const = flags & W_CONST;  // W and its scales: initializers
    bool unpacked = false;
    if (w_const)
        q_load<T>(wv, sv, w4, scales, col, stride, n, kc, rc, cpb, kb, 0, lane);
    else
        q_prefetch<T>(w4, scales, col, stride, n, kc, rc, kb, lane);
    if ((MODE & 3) == LIN_RMSNORM && blockIdx.x == 0 && blockIdx.y == 0 && warp == 0)
        prefetch_gamma(gamma, (unsigned)(k / T::VEC), lane);
    kiln_griddep_launch_dependents();
    // After the trigger, which then does not wait for the loads: the unpacking needs their data.
    if constexpr (LIN_QPRE == 2 || (LIN_QPRE == 1 && (MODE & 3) == LIN_LINEAR)) {
        if (w_const) {
#pragma unroll
            for (int j = 0; j < LIN_COLS; ++j) q_unpack<BITS>(wv[j][0], q0[j]);
            unpacked = true;
        }
    }
    kiln_griddep_wait();
    if (!w_const) q_load<T>(wv, sv, w4, scales, col, stride, n, kc, rc, cpb, kb, 0, lane);

    prologue<T, MODE>(x, skip, gamma, sum, RowsQ<T, BITS>{a, kc}, row0, rows_here, k, (unsigned)(k / T::VEC), skip_len,
                      flags, eps);
    __syncthreads();

    bool loaded = true;
    for (; col < n_out; col += col_step) {
        float acc[ROWS][LIN_COLS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int j = 0; j < LIN_COLS; ++j) acc[r][j] = 0.f;
        for (unsigned base = 0; base < kc; base += 32 * LIN_QUNROLL) {
            if (!loaded) q_load<T>(wv, sv, w4, scales, col, stride, n, kc, rc, cpb, kb, base, lane);
            loaded = false;
#pragma unroll
            for (int u = 0; u < LIN_QUNROLL; ++u) {
                const unsigned c = base + u * 32 + lane;
                if (c < kc) {
                    // Each weight chunk unpacked once for all the block's rows (chunk u = 0 into
                    // q0, which may hold it already).
#pragma unroll
                    for (int j = 0; j < LIN_COLS; ++j) {
                        float qu[Q::VALUES];
                        float(&q)[Q::VALUES] = u == 0 ? q0[j] : qu;
                        if (u != 0 || !unpacked) q_unpack<BITS>(wv[j][u], q);
#pragma unroll
                        for (int r = 0; r < ROWS; ++r) {
                            if (ROWS == 1 || r < (int)rows_here)
                                acc[r][j] = fmaf(q_dot<BITS>(q, a + (kiln_u64)r * Q::GROUPS * kc, c, kc), sv[j][u], acc[r][j]);
                        }
                    }
                }
            }
            unpacked = false;
        }
        if (epi)
            store_swiglu<T, ROWS>(acc, y, row0, rows_here, n_out, col, lane);
        else
            store_cols<T, ROWS>(acc, y, row0, rows_here, n, col, lane);
    }
}

// ---- Tensor-core GEMV for 2–16 rows ("swap-AB") ----------------------------------------------
//
// W's rows are the M side of mma.m16n8k16 (16 outputs per tile; under LIN_OUT_SWIGLU the gate
// rows of 8 outputs, then their up rows) and A's rows the N side (8 per
// n-tile, NT n-tiles), so a decode batch of a few rows fills the instruction's narrow side. The
// sum over K does not depend on the order of its terms, so each lane loads its fragments as
// whole 16-byte runs and the K order inside a 32-wide group is permuted alike for W and A: lane
// (g = lane / 4, q = lane % 4) reads W rows m0 + g and m0 + g + 8 (gate row m0 + g and up row
// n / 2 + m0 + g under the epilogue) and A row g, elements
// kb + 8q .. kb + 8q + 7, and feeds elements 8q + 4s + {0, 1} as the fragment's columns 2q, 2q + 1
// and 8q + 4s + {2, 3} as columns 2q + 8, 2q + 9 of mma step s ∈ {0, 1} (PTX ISA, "Matrix
// Fragments for mma.m16n8k16"). A block of MMA_WARPS warps holds MMA_WARPS / ksplit tiles; the
// ksplit warps of a tile take interleaved K groups, and their f32 partial sums meet in
// shared memory in warp order (deterministic). A is in shared memory in the storage type, row r's
// 16-byte chunk c at r·kcp + (c ^ mma_swizzle(r)) (kcp: chunks per row rounded up to 8), so the 8
// rows a quarter-warp reads land in distinct banks; rows and chunks past A's are zeros.
#define MMA_WARPS 8
#define MMA_UNROLL 4  // 32-wide K groups per warp whose weights are in flight at once

__device__ __forceinline__ unsigned mma_swizzle(unsigned r) { return ((r & 1u) << 2) | ((r >> 1) & 3u); }

template <typename T>
struct RowsMma {
    uint4* a;
    unsigned kcp;
    struct Row {
        uint4* p;
        unsigned sw;
        __device__ __forceinline__ void operator()(unsigned c, const float* f) const { p[c ^ sw] = T::pack(f); }
    };
    __device__ __forceinline__ Row row(unsigned r) const { return Row{a + r * kcp, mma_swizzle(r)}; }
};

// The 16-byte weight runs of K groups g0, g0 + ksplit, … (MMA_UNROLL of them) of the tile's W
// rows (MmaTile's row0 at w0, row1 at w1) for lane quarter q; zeros past the row or past N.
__device__ __forceinline__ void mma_load(uint4 (&wa)[MMA_UNROLL], uint4 (&wb)[MMA_UNROLL], const uint4* w0,
                                         const uint4* w1, bool ok0, bool ok1, unsigned g0, unsigned ksplit,
                                         unsigned kc, unsigned q) {
#pragma unroll
    for (unsigned u = 0; u < MMA_UNROLL; ++u) {
        const unsigned c = (g0 + u * ksplit) * 4 + q;
        wa[u] = ok0 && c < kc ? __ldg(w0 + c) : make_uint4(0, 0, 0, 0);
        wb[u] = ok1 && c < kc ? __ldg(w1 + c) : make_uint4(0, 0, 0, 0);
    }
}

// A tile's outputs from gemv_mma / gemv_q4mma's accumulators: with ksplit warps per tile, their
// f32 partial sums meet in shared memory (A's space, after a barrier) and the tile's first warp
// sums them in warp order (deterministic) and writes. Fragment i of n-tile t is output
// m0 + g + 8·(i / 2), row 8t + 2q + i % 2; under SWIGLU (LIN_OUT_SWIGLU) fragments i and i + 2
// (i < 2) are gate and up of output m0 + g, row 8t + 2q + i, and Y is [rows, n].
template <typename T, int NT, bool SWIGLU = false>
__device__ __forceinline__ void mma_store(float (&acc)[NT][4], typename T::S* y, kiln_u64 rows, kiln_u64 n,
                                          kiln_u64 m0, unsigned ksplit) {
    extern __shared__ __align__(16) unsigned char lin_shared[];
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    if (ksplit > 1) {
        float* red = (float*)lin_shared;  // [warp][NT][4][32]
        __syncthreads();
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[((warp * NT + t) * 4 + i) * 32 + lane] = acc[t][i];
        __syncthreads();
        if (warp % ksplit != 0) return;
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float v = acc[t][i];
                for (unsigned s = 1; s < ksplit; ++s) v += red[(((warp + s) * NT + t) * 4 + i) * 32 + lane];
                acc[t][i] = v;
            }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            if (SWIGLU) {
                const kiln_u64 m = m0 + g, r = 8 * t + 2 * q + i;
                if (i < 2 && m < n && r < rows)
                    y[r * n + m] = T::st(silu_mul<T>(T::ld(T::st(acc[t][i])), T::ld(T::st(acc[t][i + 2]))));
            } else {
                const kiln_u64 m = m0 + g + 8 * (i / 2), r = 8 * t + 2 * q + i % 2;
                if (m < n && r < rows) y[r * n + m] = T::st(acc[t][i]);
            }
        }
}

// The two W rows lane group g (lane / 4) of tensor-core tile `tile` holds on the M side, for W of
// n rows: rows m0 + g and m0 + g + 8 (outputs of those indices, Y [rows, n]), or under
// LIN_OUT_SWIGLU gate row m0 + g and up row n / 2 + m0 + g of output m0 + g (Y [rows, n / 2],
// 8 outputs per tile); ok0 / ok1: whether each row exists.
template <int MODE>
struct MmaTile {
    kiln_u64 n_out, m0, row0, row1;
    bool ok0, ok1;
    __device__ __forceinline__ MmaTile(kiln_u64 n, kiln_u64 tile, unsigned g) {
        const bool epi = MODE & LIN_OUT_SWIGLU;
        n_out = epi ? n / 2 : n;
        m0 = tile * (epi ? 8 : 16);
        row0 = m0 + g;
        row1 = epi ? n_out + m0 + g : m0 + g + 8;
        ok0 = epi ? m0 + g < n_out : row0 < n;
        ok1 = epi ? ok0 : row1 < n;
    }
};

// Y[rows, n] = A · Wᵀ for rows ≤ 8·NT on tensor cores; see above. Same PDL contract as gemv:
// before the grid-dependency wait, the first weight groups loaded (a constant W) or prefetched
// into L2. Under LIN_OUT_SWIGLU a tile holds 8 outputs j0 .. j0 + 7: gate rows j0 + g on the M
// side's first 8 rows, up rows n / 2 + j0 + g on its last 8, and Y is [rows, n / 2].
template <typename T, int MODE, int NT>
__device__ __forceinline__ void gemv_mma(const typename T::S* x, const typename T::S* skip,
                                         const typename T::S* gamma, const typename T::S* w, typename T::S* y,
                                         typename T::S* sum, kiln_u64 rows, kiln_u64 n, kiln_u64 k,
                                         kiln_u64 skip_len, unsigned flags, float eps, unsigned ksplit) {
    extern __shared__ __align__(16) unsigned char lin_shared[];
    uint4* as = (uint4*)lin_shared;
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    const unsigned kc = (unsigned)(k / T::VEC), kcp = (kc + 7) & ~7u, groups = kcp / 4;
    const unsigned rows_here = (unsigned)min(rows, (kiln_u64)(8 * NT));
    const unsigned ks = warp % ksplit;
    const MmaTile<MODE> tile(n, (kiln_u64)blockIdx.x * (MMA_WARPS / ksplit) + warp / ksplit, g);
    const bool ok0 = tile.ok0, ok1 = tile.ok1;
    const uint4* w0 = (const uint4*)w + (ok0 ? tile.row0 * kc : 0);
    const uint4* w1 = (const uint4*)w + (ok1 ? tile.row1 * kc : 0);

    uint4 wa[MMA_UNROLL], wb[MMA_UNROLL];
    const bool w_const = flags & W_CONST;
    if (w_const) {
        mma_load(wa, wb, w0, w1, ok0, ok1, ks, ksplit, kc, q);
    } else {
#pragma unroll
        for (unsigned u = 0; u < MMA_UNROLL; ++u) {
            const unsigned c = (ks + u * ksplit) * 4 + q;
            if (c < kc) {
                if (ok0) asm volatile("prefetch.global.L2 [%0];" ::"l"(w0 + c));
                if (ok1) asm volatile("prefetch.global.L2 [%0];" ::"l"(w1 + c));
            }
        }
    }
    if ((MODE & 3) == LIN_RMSNORM && blockIdx.x == 0 && blockIdx.y == 0 && warp == 0) prefetch_gamma(gamma, kc, lane);
    kiln_griddep_launch_dependents();
    kiln_griddep_wait();
    // The first weight groups stream in while the prologue runs (or since before the wait, for
    // a constant W); each pass loads the next.
    if (!w_const) mma_load(wa, wb, w0, w1, ok0, ok1, ks, ksplit, kc, q);

    // Zeros where A has no values (rows past `rows`, chunks past kc), then A itself.
    for (unsigned i = threadIdx.x; i < 8 * NT * kcp; i += blockDim.x) {
        const unsigned r = i / kcp, c = i - r * kcp;
        if (r >= rows_here || c >= kc) as[r * kcp + (c ^ mma_swizzle(r))] = make_uint4(0, 0, 0, 0);
    }
    prologue<T, MODE>(x, skip, gamma, sum, RowsMma<T>{as, kcp}, 0, rows_here, k, kc, skip_len, flags, eps);
    __syncthreads();

    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
    const unsigned sw = mma_swizzle(g);
    for (unsigned g0 = ks; g0 < groups; g0 += MMA_UNROLL * ksplit) {
        uint4 na[MMA_UNROLL], nb[MMA_UNROLL];
        mma_load(na, nb, w0, w1, ok0, ok1, g0 + MMA_UNROLL * ksplit, ksplit, kc, q);
#pragma unroll
        for (unsigned u = 0; u < MMA_UNROLL; ++u) {
            const unsigned gi = g0 + u * ksplit;
            if (gi >= groups) break;  // the same for the whole warp
            const unsigned c = gi * 4 + q;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const uint4 b = as[(t * 8 + g) * kcp + (c ^ sw)];
                kiln_mma16816<typename T::tag>(acc[t], wa[u].x, wb[u].x, wa[u].y, wb[u].y, b.x, b.y);
                kiln_mma16816<typename T::tag>(acc[t], wa[u].z, wb[u].z, wa[u].w, wb[u].w, b.z, b.w);
            }
        }
#pragma unroll
        for (unsigned u = 0; u < MMA_UNROLL; ++u) {
            wa[u] = na[u];
            wb[u] = nb[u];
        }
    }

    mma_store<T, NT, (MODE & LIN_OUT_SWIGLU) != 0>(acc, y, rows, tile.n_out, tile.m0, ksplit);
}

// ---- Tensor-core GEMV over 4-bit weights, 1–16 rows ---------------------------------------------
//
// gemv_mma's swap-AB over MatMulNBits' 4-bit W: 16 outputs per tile on the M side (8 outputs'
// gate and up rows under LIN_OUT_SWIGLU, each with its scales), A's rows on the N side. Each mma's 16 K columns lie in one 32-value chunk of W (one scale), so the products are
// summed exactly in f32 by the mma and scaled once per chunk: acc += (Σ a·(q − 8)) · scale, the
// order the CPU reference sums in up to f32 reassociation. Lane (g, q) takes the 8 values 8q ..
// 8q + 7 of each chunk, word q of its 16 bytes: the quad's four lanes load chunks 4G .. 4G + 3 of
// its rows as whole 16-byte runs and transpose them by three shuffles. Nibble i of word q is value
// 8q + i; nibbles i and i + 4 dequantize together into one register (1024 + q or 128 + q by its
// bits, minus 1032 or 136: exact), which fixes the order A's row is stored in: unit c of a row (8
// values, 16 bytes, c = 4·chunk + q) holds values {0, 4, 1, 5, 2, 6, 3, 7} of those 8, so a lane's
// 16-byte read of A is its B fragments for the chunk's two mma steps. Row r's unit c sits at r·kup +
// (c ^ 4·(r & 1)) (kup: units per row rounded up to 8), so a quarter-warp's two rows read distinct
// banks.
#define Q4MMA_GROUP 4  // 32-value chunks per lane-quad load (one 16-byte run per lane and W row)

template <typename T>
struct RowsQ4Mma {
    uint4* a;
    unsigned kup;
    struct Row {
        uint4* p;
        unsigned sw;
        __device__ __forceinline__ void operator()(unsigned c, const float* f) const {
            const float v[8] = {f[0], f[4], f[1], f[5], f[2], f[6], f[3], f[7]};
            p[c ^ sw] = T::pack(v);
        }
    };
    __device__ __forceinline__ Row row(unsigned r) const { return Row{a + r * kup, (r & 1u) << 2}; }
};

// Nibbles i and i + 4 of word t (i < 4) as the tag's two 16-bit values q − 8, nibble i in the low
// half: on sm_80 and later each nibble becomes 1024 + q (float16) or 128 + q (bfloat16) by its bits
// and one packed fma subtracts 1032 or 136 from both (all exact); before that, through f32.
template <typename Tag>
__device__ __forceinline__ unsigned q4_pair(unsigned t, int i) {
    const unsigned x = (t >> (4 * i)) & 0x000f000fu;
    return kiln_pack2<Tag>((float)(x & 0xfu) - 8.f, (float)(x >> 16) - 8.f);
}
#if __CUDA_ARCH__ >= 800
// BASE: the 16-bit pattern of 1024 (float16) or 128 (bfloat16), whose last mantissa bits are a
// nibble's; ONE: 1.0; BIAS: −(BASE's value + 8).
#define LIN_Q4_PAIR(TAG, PTX, BASE, ONE, BIAS)                                                       \
    template <>                                                                                    \
    __device__ __forceinline__ unsigned q4_pair<TAG>(unsigned t, int i) {                          \
        unsigned r;                                                                                \
        asm("fma.rn." PTX " %0, %1, %2, %3;"                                                       \
            : "=r"(r)                                                                              \
            : "r"(((t >> (4 * i)) & 0x000f000fu) | (BASE * 0x10001u)), "r"(ONE * 0x10001u),        \
              "r"(BIAS * 0x10001u));                                                               \
        return r;                                                                                  \
    }
LIN_Q4_PAIR(kiln_tag_f16, "f16x2", 0x6400u, 0x3c00u, 0xe408u)
LIN_Q4_PAIR(kiln_tag_bf16, "bf16x2", 0x4300u, 0x3f80u, 0xc308u)
#undef LIN_Q4_PAIR
#endif

// Word `sel` of v (sel < 4, the same for no two lanes of a quad).
__device__ __forceinline__ unsigned word_of(const uint4& v, unsigned sel) {
    return sel == 0 ? v.x : sel == 1 ? v.y : sel == 2 ? v.z : v.w;
}

// Within each lane-quad: lane q holds chunk 4G + q of a W row (v); afterwards t[j] is word q of
// chunk 4G + j. Lane q receives from lane q ^ i what that lane sends, its word q: chunk 4G + (q ^ i).
__device__ __forceinline__ void quad_transpose(const uint4& v, unsigned (&t)[Q4MMA_GROUP], unsigned q) {
    const unsigned own = word_of(v, q);
    const unsigned g1 = __shfl_xor_sync(0xffffffffu, word_of(v, q ^ 1u), 1);
    const unsigned g2 = __shfl_xor_sync(0xffffffffu, word_of(v, q ^ 2u), 2);
    const unsigned g3 = __shfl_xor_sync(0xffffffffu, word_of(v, q ^ 3u), 3);
#pragma unroll
    for (unsigned j = 0; j < Q4MMA_GROUP; ++j) {
        const unsigned d = j ^ q;
        t[j] = d == 0 ? own : d == 1 ? g1 : d == 2 ? g2 : g3;
    }
}

// The 16-byte runs of chunk groups G = g0, g0 + ksplit, … (MMA_UNROLL of them) of the tile's W
// rows (MmaTile's row0 at w0, row1 at w1) for lane quarter q, chunk 4G + q of each, and that chunk's scales (zeros
// past the row or past N; their products are skipped).
template <typename T>
__device__ __forceinline__ void q4mma_load(uint4 (&wa)[MMA_UNROLL], uint4 (&wb)[MMA_UNROLL], float (&sa)[MMA_UNROLL],
                                           float (&sb)[MMA_UNROLL], const uint4* w0, const uint4* w1,
                                           const typename T::S* s0, const typename T::S* s1, bool ok0, bool ok1,
                                           unsigned g0, unsigned ksplit, unsigned kc, unsigned cpb, unsigned q) {
#pragma unroll
    for (unsigned u = 0; u < MMA_UNROLL; ++u) {
        const unsigned c = (g0 + u * ksplit) * Q4MMA_GROUP + q;
        wa[u] = ok0 && c < kc ? __ldg(w0 + c) : make_uint4(0, 0, 0, 0);
        wb[u] = ok1 && c < kc ? __ldg(w1 + c) : make_uint4(0, 0, 0, 0);
        sa[u] = ok0 && c < kc ? T::ld(s0[c / cpb]) : 0.f;
        sb[u] = ok1 && c < kc ? T::ld(s1[c / cpb]) : 0.f;
    }
}

// Y[rows, n] = A · dequant(W)ᵀ for rows ≤ 8·NT on tensor cores, W 4-bit (see above): gemv_mma's
// tiles, split over K by chunk groups of 128 values, and its PDL contract (the first groups
// loaded before the grid-dependency wait when W is constant, else prefetched into L2). kc = k /
// 32 chunks of A per row, rc = kb·block / 32 chunks per W row, cpb = block / 32 chunks per scale.
// Under LIN_OUT_SWIGLU a tile holds 8 outputs' gate and up rows, as in gemv_mma (MmaTile).
template <typename T, int MODE, int NT>
__device__ __forceinline__ void gemv_q4mma(const typename T::S* x, const typename T::S* skip,
                                           const typename T::S* gamma, const unsigned char* w,
                                           const typename T::S* scales, typename T::S* y, typename T::S* sum,
                                           kiln_u64 rows, kiln_u64 n, kiln_u64 k, kiln_u64 skip_len, unsigned flags,
                                           float eps, unsigned kb, unsigned block, unsigned ksplit) {
    typedef typename T::tag Tag;
    extern __shared__ __align__(16) unsigned char lin_shared[];
    uint4* as = (uint4*)lin_shared;
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
    const unsigned kc = (unsigned)(k / Q4_VALUES), units = (unsigned)(k / T::VEC), kup = (units + 7) & ~7u;
    const unsigned rc = kb * block / Q4_VALUES, cpb = block / Q4_VALUES;
    const unsigned groups = (kc + Q4MMA_GROUP - 1) / Q4MMA_GROUP;
    const unsigned rows_here = (unsigned)min(rows, (kiln_u64)(8 * NT));
    const unsigned ks = warp % ksplit;
    const MmaTile<MODE> tile(n, (kiln_u64)blockIdx.x * (MMA_WARPS / ksplit) + warp / ksplit, g);
    const bool ok0 = tile.ok0, ok1 = tile.ok1;
    const uint4* w0 = (const uint4*)w + (ok0 ? tile.row0 * rc : 0);
    const uint4* w1 = (const uint4*)w + (ok1 ? tile.row1 * rc : 0);
    const typename T::S* s0 = scales + (ok0 ? tile.row0 * kb : 0);
    const typename T::S* s1 = scales + (ok1 ? tile.row1 * kb : 0);

    uint4 wa[MMA_UNROLL], wb[MMA_UNROLL];
    float sa[MMA_UNROLL], sb[MMA_UNROLL];
    const bool w_const = flags & W_CONST;  // W and its scales: initializers
    if (w_const) {
        q4mma_load<T>(wa, wb, sa, sb, w0, w1, s0, s1, ok0, ok1, ks, ksplit, kc, cpb, q);
    } else {
#pragma unroll
        for (unsigned u = 0; u < MMA_UNROLL; ++u) {
            const unsigned c = (ks + u * ksplit) * Q4MMA_GROUP + q;
            if (c < kc) {
                if (ok0) asm volatile("prefetch.global.L2 [%0];" ::"l"(w0 + c));
                if (ok1) asm volatile("prefetch.global.L2 [%0];" ::"l"(w1 + c));
            }
        }
        if (q == 0 && ok0) asm volatile("prefetch.global.L2 [%0];" ::"l"(s0));
        if (q == 0 && ok1) asm volatile("prefetch.global.L2 [%0];" ::"l"(s1));
    }
    if ((MODE & 3) == LIN_RMSNORM && blockIdx.x == 0 && warp == 0) prefetch_gamma(gamma, units, lane);
    kiln_griddep_launch_dependents();
    kiln_griddep_wait();
    if (!w_const) q4mma_load<T>(wa, wb, sa, sb, w0, w1, s0, s1, ok0, ok1, ks, ksplit, kc, cpb, q);

    // Zeros where A has no values (rows past `rows`, units past k), then A itself.
    for (unsigned i = threadIdx.x; i < 8 * NT * kup; i += blockDim.x) {
        const unsigned r = i / kup, c = i - r * kup;
        if (r >= rows_here || c >= units) as[r * kup + (c ^ ((r & 1u) << 2))] = make_uint4(0, 0, 0, 0);
    }
    prologue<T, MODE>(x, skip, gamma, sum, RowsQ4Mma<T>{as, kup}, 0, rows_here, k, units, skip_len, flags, eps);
    __syncthreads();

    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[t][i] = 0.f;
    const unsigned sw = (g & 1u) << 2;
    for (unsigned g0 = ks; g0 < groups; g0 += MMA_UNROLL * ksplit) {
        uint4 na[MMA_UNROLL], nb[MMA_UNROLL];
        float nsa[MMA_UNROLL], nsb[MMA_UNROLL];
        q4mma_load<T>(na, nb, nsa, nsb, w0, w1, s0, s1, ok0, ok1, g0 + MMA_UNROLL * ksplit, ksplit, kc, cpb, q);
#pragma unroll
        for (unsigned u = 0; u < MMA_UNROLL; ++u) {
            const unsigned gi = g0 + u * ksplit;
            if (gi >= groups) break;  // the same for the whole warp
            unsigned ta[Q4MMA_GROUP], tb[Q4MMA_GROUP];
            quad_transpose(wa[u], ta, q);
            quad_transpose(wb[u], tb, q);
#pragma unroll
            for (unsigned j = 0; j < Q4MMA_GROUP; ++j) {
                const unsigned c = gi * Q4MMA_GROUP + j;  // the chunk
                if (c >= kc) break;                        // the same for the whole warp
                // Its scales, from lane j of the quad; its W values as mma fragments of rows g, g + 8.
                const float sg = __shfl_sync(0xffffffffu, sa[u], (lane & ~3u) | j);
                const float sh = __shfl_sync(0xffffffffu, sb[u], (lane & ~3u) | j);
                unsigned wg[4], wh[4];
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    wg[i] = q4_pair<Tag>(ta[j], i);
                    wh[i] = q4_pair<Tag>(tb[j], i);
                }
#pragma unroll
                for (int t = 0; t < NT; ++t) {
                    const uint4 av = as[(t * 8 + g) * kup + ((c * 4 + q) ^ sw)];
                    float part[4] = {0.f, 0.f, 0.f, 0.f};
                    kiln_mma16816<Tag>(part, wg[0], wh[0], wg[1], wh[1], av.x, av.y);
                    kiln_mma16816<Tag>(part, wg[2], wh[2], wg[3], wh[3], av.z, av.w);
                    acc[t][0] = fmaf(part[0], sg, acc[t][0]);
                    acc[t][1] = fmaf(part[1], sg, acc[t][1]);
                    acc[t][2] = fmaf(part[2], sh, acc[t][2]);
                    acc[t][3] = fmaf(part[3], sh, acc[t][3]);
                }
            }
        }
#pragma unroll
        for (unsigned u = 0; u < MMA_UNROLL; ++u) {
            wa[u] = na[u];
            wb[u] = nb[u];
            sa[u] = nsa[u];
            sb[u] = nsb[u];
        }
    }
    mma_store<T, NT, (MODE & LIN_OUT_SWIGLU) != 0>(acc, y, rows, tile.n_out, tile.m0, ksplit);
}

}  // namespace lin

// The kernels: templates over the prelude's dtype tag (and the prologue's mode and the rows per
// block), instantiated by the name expressions kernel.toml lists (schema 6).

// kiln_linear_gemv<Tag, MODE, R>(const T* x, const T* skip, const T* gamma, const T* w, T* y, T* sum,
//                                u64 rows, u64 n, u64 k, u64 skip_len, u32 flags, float eps)
// MODE LIN_LINEAR: A = X [rows, k]; LIN_RMSNORM: A = RMS(X + skip) · gamma, s = X + skip written to
// sum when flags has HAS_SUM (by the blocks of column block 0); LIN_SWIGLU: A = SiLU(X[:, :k]) ·
// X[:, k:], X [rows, 2k]; LIN_RMSNORM_SWIGLU: LIN_RMSNORM's A and the SwiGLU epilogue (at the top),
// y [rows, n / 2]. R (1, 2, 4) rows per block: grid [column blocks, ceil(rows / R), 1] (a column
// block holds LIN_WARPS · LIN_COLS outputs, LIN_WARPS under the epilogue), block [LIN_WARPS · 32,
// 1, 1], dynamic shared memory min(rows, R) · k · 4 (A in f32). k is a multiple of 16 / sizeof(T);
// every operand 16-byte aligned.
template <typename Tag, int MODE, int R>
__global__ void __launch_bounds__(LIN_WARPS * 32)
    kiln_linear_gemv(const typename Tag::storage* x, const typename Tag::storage* skip,
                     const typename Tag::storage* gamma, const typename Tag::storage* w, typename Tag::storage* y,
                     typename Tag::storage* sum, kiln_u64 rows, kiln_u64 n, kiln_u64 k, kiln_u64 skip_len,
                     unsigned flags, float eps) {
    lin::gemv<lin::Elem<Tag>, MODE, R>(x, skip, gamma, w, y, sum, rows, n, k, skip_len, flags, eps);
}

// kiln_linear_mma<Tag, MODE, NT>(const T* x, const T* skip, const T* gamma, const T* w, T* y, T* sum,
//                                u64 rows, u64 n, u64 k, u64 skip_len, u32 flags, float eps, u32 ksplit)
// The tensor-core GEMV (float16 and bfloat16) for 2 ≤ rows ≤ 8·NT (NT 1 or 2), same operands as
// kiln_linear_gemv: grid [ceil(tiles / (MMA_WARPS / ksplit)), 1, 1] with tiles = ceil(n / 16)
// (ceil(n / 2 / 8) under LIN_RMSNORM_SWIGLU), block [256, 1, 1], ksplit ∈ {1, 2, 4, 8}, dynamic
// shared memory max(8·NT · kcp · 16, MMA_WARPS · NT · 512) with kcp = ceil(k / 64) · 8. k is a
// multiple of 8; every operand 16-byte aligned.
template <typename Tag, int MODE, int NT>
__global__ void __launch_bounds__(MMA_WARPS * 32)
    kiln_linear_mma(const typename Tag::storage* x, const typename Tag::storage* skip,
                    const typename Tag::storage* gamma, const typename Tag::storage* w, typename Tag::storage* y,
                    typename Tag::storage* sum, kiln_u64 rows, kiln_u64 n, kiln_u64 k, kiln_u64 skip_len,
                    unsigned flags, float eps, unsigned ksplit) {
    lin::gemv_mma<lin::Elem<Tag>, MODE, NT>(x, skip, gamma, w, y, sum, rows, n, k, skip_len, flags, eps, ksplit);
}

// kiln_linear_qgemv<Tag, MODE, R, BITS>(const T* x, const T* skip, const T* gamma, const u8* w,
//                                        const T* scales, T* y, T* sum, u64 rows, u64 n, u64 k,
//                                        u64 skip_len, u32 flags, float eps, u32 kb, u32 block)
// kiln_linear_gemv over BITS-bit weights (4 or 8) W uint8 [n, kb, block · BITS / 8] with scales
// [n, kb] (MatMulNBits' layout, default zero point 2^(BITS − 1)): block and k multiples of
// 128 / BITS with kb = ceil(k / block); the same modes (LIN_RMSNORM_SWIGLU: y [rows, n / 2]).
// R (1, 2, 4, 8) rows per block: grid [column blocks, ceil(rows / R), 1] (a column block holds
// LIN_QWARPS · LIN_COLS outputs, LIN_QWARPS under the epilogue), block [LIN_QWARPS · 32, 1, 1],
// dynamic shared memory min(rows, R) · k · 4; W 16-byte aligned.
template <typename Tag, int MODE, int R, int BITS>
__global__ void __launch_bounds__(LIN_QWARPS * 32)
    kiln_linear_qgemv(const typename Tag::storage* x, const typename Tag::storage* skip,
                      const typename Tag::storage* gamma, const unsigned char* w, const typename Tag::storage* scales,
                      typename Tag::storage* y, typename Tag::storage* sum, kiln_u64 rows, kiln_u64 n, kiln_u64 k,
                      kiln_u64 skip_len, unsigned flags, float eps, unsigned kb, unsigned block) {
    lin::gemv_q<lin::Elem<Tag>, MODE, R, BITS>(x, skip, gamma, w, scales, y, sum, rows, n, k, skip_len, flags, eps,
                                               kb, block);
}

// kiln_linear_q4mma<Tag, MODE, NT>(const T* x, const T* skip, const T* gamma, const u8* w, const T* scales,
//                                 T* y, T* sum, u64 rows, u64 n, u64 k, u64 skip_len, u32 flags, float eps,
//                                 u32 kb, u32 block, u32 ksplit)
// The tensor-core GEMV over kiln_linear_qgemv's 4-bit weights (float16 and bfloat16) for rows ≤
// 8·NT (NT 1 or 2): grid [ceil(tiles / (MMA_WARPS / ksplit)), 1, 1] with tiles = ceil(n / 16)
// (ceil(n / 2 / 8) under LIN_RMSNORM_SWIGLU, y [rows, n / 2]), block [256, 1, 1],
// ksplit ∈ {1, 2, 4, 8}, dynamic shared memory max(8·NT · kup · 16, MMA_WARPS · NT · 512) with kup =
// ceil(k / 64) · 8; block a multiple of 32, k a multiple of 32, W 16-byte aligned.
template <typename Tag, int MODE, int NT>
__global__ void __launch_bounds__(MMA_WARPS * 32)
    kiln_linear_q4mma(const typename Tag::storage* x, const typename Tag::storage* skip,
                      const typename Tag::storage* gamma, const unsigned char* w,
                      const typename Tag::storage* scales, typename Tag::storage* y, typename Tag::storage* sum,
                      kiln_u64 rows, kiln_u64 n, kiln_u64 k, kiln_u64 skip_len, unsigned flags, float eps,
                      unsigned kb, unsigned block, unsigned ksplit) {
    lin::gemv_q4mma<lin::Elem<Tag>, MODE, NT>(x, skip, gamma, w, scales, y, sum, rows, n, k, skip_len, flags, eps,
                                              kb, block, ksplit);
}

// kiln_linear_dequant<Tag>(const u8* w, const T* scales, T* out, u64 n, u64 k, u32 kb, u32 block, u32 bits)
// The prefill path's weight: out [n, k] = (q − 2^(bits − 1)) · scale of W uint8 [n, kb, block·bits/8]
// (MatMulNBits' layout, bits 2, 4 or 8, values from the low bits of each byte), rounded to T;
// grid-stride over n · k.
template <typename Tag>
__global__ void kiln_linear_dequant(const unsigned char* w, const typename Tag::storage* scales,
                                    typename Tag::storage* out, kiln_u64 n, kiln_u64 k, unsigned kb, unsigned block,
                                    unsigned bits) {
    typedef lin::Elem<Tag> T;
    kiln_griddep_wait();
    const unsigned per = 8u / bits, mask = (1u << bits) - 1u;
    const kiln_u64 row_bytes = (kiln_u64)kb * block * bits / 8u;
    KILN_FOR(i, n * k) {
        const kiln_u64 r = i / k, c = i - r * k;
        const unsigned q = (w[r * row_bytes + c / per] >> ((c % per) * bits)) & mask;
        out[i] = T::st(((float)q - (float)(1u << (bits - 1))) * T::ld(scales[r * kb + c / block]));
    }
}

// kiln_linear_rmsnorm<Tag>(const T* x, const T* skip, const T* gamma, T* a, T* sum, u64 rows, u64 k,
//                          u64 skip_len, u32 flags, float eps)
// A [rows, k] and (HAS_SUM) s = X + skip for the prefill path; a block per row (grid-stride),
// block [256, 1, 1]. `sum` is ignored without HAS_SUM.
template <typename Tag>
__global__ void kiln_linear_rmsnorm(const typename Tag::storage* x, const typename Tag::storage* skip,
                                    const typename Tag::storage* gamma, typename Tag::storage* a,
                                    typename Tag::storage* sum, kiln_u64 rows, kiln_u64 k, kiln_u64 skip_len,
                                    unsigned flags, float eps) {
    typedef lin::Elem<Tag> T;
    __shared__ float red[32];
    kiln_griddep_wait();
    for (kiln_u64 r = blockIdx.x; r < rows; r += gridDim.x)
        lin::rms_row<T>(x, skip, gamma, a + r * k, (flags & lin::HAS_SUM) ? sum : (typename T::S*)0, r, k, skip_len,
                        flags, eps, threadIdx.x, blockDim.x, lin::BlockSum{red});
}

// kiln_linear_swiglu<Tag>(const T* gu, T* a, u64 rows, u64 k): A[r, c] = SiLU(gu[r, c]) · gu[r, k + c],
// GU [rows, 2k]; grid-stride over rows · k.
template <typename Tag>
__global__ void kiln_linear_swiglu(const typename Tag::storage* gu, typename Tag::storage* a, kiln_u64 rows,
                                   kiln_u64 k) {
    typedef lin::Elem<Tag> T;
    kiln_griddep_wait();
    KILN_FOR(i, rows * k) {
        const kiln_u64 r = i / k, c = i - r * k;
        a[i] = T::st(lin::silu_mul<T>(T::ld(gu[r * 2 * k + c]), T::ld(gu[r * 2 * k + k + c])));
    }
}

// kiln_linear_bias<Tag>(T* y, const T* bias, u64 rows, u64 n): Y[r, c] += bias[c] in place, Y
// [rows, n] (Linear's bias after a decode GEMV; grid-stride over rows · n).
template <typename Tag>
__global__ void kiln_linear_bias(typename Tag::storage* y, const typename Tag::storage* bias, kiln_u64 rows,
                                 kiln_u64 n) {
    typedef lin::Elem<Tag> T;
    kiln_griddep_wait();
    KILN_FOR(i, rows * n) { y[i] = T::st(T::ld(y[i]) + T::ld(bias[i % n])); }
}

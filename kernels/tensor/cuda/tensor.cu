// kiln-tensor CUDA kernels: dtype-agnostic data movement (by element size in bytes) and the
// small generators (Shape/Size values, ConstantOfShape fill, Range). Compiled by NVRTC for the
// GPU present. Every kernel is a grid-stride loop over its work items, so any grid of ≥ 1
// block is correct; the shim sizes grids from a predicted vector width.
//
// Vector widths are chosen at run time from the actual pointer addresses together with the
// sizes and pitches: 16-byte accesses when everything is a multiple of 16, down to bytes.
#include "kiln.cuh"
#include "kiln-cuda-std/vec.cuh"
#include "kiln-cuda-std/elem.cuh"

// A 16-byte unit (kiln-cuda-std's kiln_vec: one 128-bit access, aligned).
typedef kiln_vec<kiln_u64, 2> kt_v16;

__device__ __forceinline__ kiln_u64 kt_addr(const void* p) { return (kiln_u64)p; }

// Largest width in {16, 8, 4, 2, 1} that divides `bits` (the OR of every address and size).
__device__ __forceinline__ unsigned kt_width(kiln_u64 bits) {
    if ((bits & 15) == 0) return 16;
    if ((bits & 7) == 0) return 8;
    if ((bits & 3) == 0) return 4;
    if ((bits & 1) == 0) return 2;
    return 1;
}

// ---------------------------------------------------------------------------------------
// Contiguous copy: dst[0..nbytes) = src[0..nbytes).

template <typename T>
__device__ void kt_copy_units(const char* src, char* dst, kiln_u64 nbytes) {
    const kiln_u64 units = nbytes / sizeof(T);
    const T* s = (const T*)src;
    T* d = (T*)dst;
    KILN_FOR(i, units) { d[i] = s[i]; }
    // Tail bytes (only when the width was chosen from the addresses alone).
    const kiln_u64 done = units * sizeof(T);
    KILN_FOR(i, nbytes - done) { dst[done + i] = src[done + i]; }
}

extern "C" __global__ void kiln_tensor_copy(const char* src, char* dst, kiln_u64 nbytes) {
    // Width from the addresses only; the tail is copied bytewise.
    switch (kt_width(kt_addr(src) | kt_addr(dst))) {
    case 16: kt_copy_units<kt_v16>(src, dst, nbytes); break;
    case 8: kt_copy_units<kiln_u64>(src, dst, nbytes); break;
    case 4: kt_copy_units<unsigned>(src, dst, nbytes); break;
    case 2: kt_copy_units<unsigned short>(src, dst, nbytes); break;
    default: kt_copy_units<unsigned char>(src, dst, nbytes); break;
    }
}

// ---------------------------------------------------------------------------------------
// 2-D copy: rows of row_bytes bytes; row r starts at src + r·src_pitch and dst + r·dst_pitch
// (pitches in bytes, signed). Concat (into an axis offset), Split (out of one), Slice and
// Expand that reduce to rows.

template <typename T, typename I>
__device__ void kt_copy2d_units(const char* src, char* dst, I rows, I upr, long long src_pitch, long long dst_pitch) {
    const I total = rows * upr;
    for (I i = (I)(blockIdx.x * (kiln_u64)blockDim.x + threadIdx.x); i < total; i += (I)(gridDim.x * (kiln_u64)blockDim.x)) {
        const I r = i / upr;
        const I c = i - r * upr;
        const T* s = (const T*)(src + (long long)r * src_pitch);
        T* d = (T*)(dst + (long long)r * dst_pitch);
        d[c] = s[c];
    }
}

template <typename T>
__device__ void kt_copy2d_w(const char* src, char* dst, kiln_u64 rows, kiln_u64 row_bytes, long long src_pitch,
                            long long dst_pitch) {
    const kiln_u64 upr = row_bytes / sizeof(T);
    if (rows * upr <= 0xffffffffull)
        kt_copy2d_units<T, unsigned>(src, dst, (unsigned)rows, (unsigned)upr, src_pitch, dst_pitch);
    else
        kt_copy2d_units<T, kiln_u64>(src, dst, rows, upr, src_pitch, dst_pitch);
}

extern "C" __global__ void kiln_tensor_copy2d(const char* src, char* dst, kiln_u64 rows, kiln_u64 row_bytes,
                                              long long src_pitch, long long dst_pitch) {
    const kiln_u64 bits =
        kt_addr(src) | kt_addr(dst) | row_bytes | (kiln_u64)src_pitch | (kiln_u64)dst_pitch;
    switch (kt_width(bits)) {
    case 16: kt_copy2d_w<kt_v16>(src, dst, rows, row_bytes, src_pitch, dst_pitch); break;
    case 8: kt_copy2d_w<kiln_u64>(src, dst, rows, row_bytes, src_pitch, dst_pitch); break;
    case 4: kt_copy2d_w<unsigned>(src, dst, rows, row_bytes, src_pitch, dst_pitch); break;
    case 2: kt_copy2d_w<unsigned short>(src, dst, rows, row_bytes, src_pitch, dst_pitch); break;
    default: kt_copy2d_w<unsigned char>(src, dst, rows, row_bytes, src_pitch, dst_pitch); break;
    }
}

// ---------------------------------------------------------------------------------------
// Strided gather: dst is n contiguous elements of esize bytes (1, 2, 4, 8 or 16); the output
// element at multi-index (i_{rank-1}, …, i_0) — axis 0 innermost — is the source element
// Σ i_k·s_k (element strides, signed; src already points at the first output element).
// Transpose (permuted strides), Slice (scaled, possibly negative strides), Expand (zero
// strides).

#define KT_RANK 8

template <typename I>
__device__ __forceinline__ long long kt_src_index(I i, unsigned rank, const kiln_u64* d, const long long* s) {
    long long off = 0;
    I rem = i;
#pragma unroll
    for (int k = 0; k < KT_RANK; ++k) {
        if ((unsigned)k + 1 < rank) {
            const I q = rem / (I)d[k];
            off += (long long)(rem - q * (I)d[k]) * s[k];
            rem = q;
        } else if ((unsigned)k + 1 == rank) {
            off += (long long)rem * s[k];
        }
    }
    return off;
}

// One element is K units of T (K > 1 only for the unaligned bytewise fallback).
template <typename T, int K, typename I>
__device__ void kt_strided_run(const T* src, T* dst, I n, unsigned rank, const kiln_u64* d, const long long* s) {
    for (I i = (I)(blockIdx.x * (kiln_u64)blockDim.x + threadIdx.x); i < n; i += (I)(gridDim.x * (kiln_u64)blockDim.x)) {
        const long long o = kt_src_index<I>(i, rank, d, s);
#pragma unroll
        for (int k = 0; k < K; ++k) dst[(kiln_u64)i * K + k] = src[o * K + k];
    }
}

template <typename T, int K>
__device__ void kt_strided_w(const char* src, char* dst, kiln_u64 n, unsigned rank, const kiln_u64* d,
                             const long long* s) {
    if (n <= 0xffffffffull)
        kt_strided_run<T, K, unsigned>((const T*)src, (T*)dst, (unsigned)n, rank, d, s);
    else
        kt_strided_run<T, K, kiln_u64>((const T*)src, (T*)dst, n, rank, d, s);
}

extern "C" __global__ void kiln_tensor_strided(const char* src, char* dst, kiln_u64 n, unsigned esize, unsigned rank,
                                               kiln_u64 d0, kiln_u64 d1, kiln_u64 d2, kiln_u64 d3, kiln_u64 d4,
                                               kiln_u64 d5, kiln_u64 d6, kiln_u64 d7, long long s0, long long s1,
                                               long long s2, long long s3, long long s4, long long s5, long long s6,
                                               long long s7) {
    const kiln_u64 d[KT_RANK] = {d0, d1, d2, d3, d4, d5, d6, d7};
    const long long s[KT_RANK] = {s0, s1, s2, s3, s4, s5, s6, s7};
    const bool aligned = ((kt_addr(src) | kt_addr(dst)) & (esize - 1)) == 0;
    switch (aligned ? esize : esize + 100) {
    case 1: kt_strided_w<unsigned char, 1>(src, dst, n, rank, d, s); break;
    case 2: kt_strided_w<unsigned short, 1>(src, dst, n, rank, d, s); break;
    case 4: kt_strided_w<unsigned, 1>(src, dst, n, rank, d, s); break;
    case 8: kt_strided_w<kiln_u64, 1>(src, dst, n, rank, d, s); break;
    case 16: kt_strided_w<kt_v16, 1>(src, dst, n, rank, d, s); break;
    case 102: kt_strided_w<unsigned char, 2>(src, dst, n, rank, d, s); break;
    case 104: kt_strided_w<unsigned char, 4>(src, dst, n, rank, d, s); break;
    case 108: kt_strided_w<unsigned char, 8>(src, dst, n, rank, d, s); break;
    case 116: kt_strided_w<unsigned char, 16>(src, dst, n, rank, d, s); break;
    default: break;  // esize is checked by the shim
    }
}

// ---------------------------------------------------------------------------------------
// Tiled batched transpose, the strided gather's fast path when the source is contiguous along
// the output's second-to-last axis: dst is nb × nk × nl elements of esize (1, 2, 4, 8) bytes,
// dst[b][k][l] = src[off(b) + k + l·s_l], where off(b) decomposes b over the batch axes
// (bd0 innermost, element strides bs_i, signed). 32×32 tiles through shared memory, so both
// the reads (along k) and the writes (along l) are coalesced. Block 32×8; grid-stride over
// tiles.

#define KT_TILE 32
#define KT_ROWS 8
#define KT_BRANK 6

template <typename T>
__device__ void kt_transpose_run(const T* src, T* dst, kiln_u64 nb, kiln_u64 nk, kiln_u64 nl, long long s_l,
                                 unsigned brank, const kiln_u64* bd, const long long* bs) {
    __shared__ T tile[KT_TILE][KT_TILE + 1];
    const kiln_u64 tk_n = (nk + KT_TILE - 1) / KT_TILE, tl_n = (nl + KT_TILE - 1) / KT_TILE;
    const kiln_u64 tiles = nb * tk_n * tl_n;
    const unsigned tx = threadIdx.x, ty = threadIdx.y;
    for (kiln_u64 t = blockIdx.x; t < tiles; t += gridDim.x) {
        const kiln_u64 tl = t % tl_n;
        const kiln_u64 rest = t / tl_n;
        const kiln_u64 tk = rest % tk_n;
        const kiln_u64 b = rest / tk_n;
        long long off = 0;
        kiln_u64 rem = b;
#pragma unroll
        for (int i = 0; i < KT_BRANK; ++i) {
            if ((unsigned)i < brank) {
                const kiln_u64 q = rem / bd[i];
                off += (long long)(rem - q * bd[i]) * bs[i];
                rem = q;
            }
        }
        const kiln_u64 k0 = tk * KT_TILE, l0 = tl * KT_TILE;
        // Read: consecutive threads take consecutive k (contiguous in the source).
        const kiln_u64 k = k0 + tx;
#pragma unroll
        for (unsigned j = 0; j < KT_TILE; j += KT_ROWS) {
            const kiln_u64 l = l0 + ty + j;
            if (k < nk && l < nl) tile[ty + j][tx] = src[off + (long long)k + (long long)l * s_l];
        }
        __syncthreads();
        // Write: consecutive threads take consecutive l (contiguous in dst).
        const kiln_u64 l = l0 + tx;
        T* out = dst + b * nk * nl;
#pragma unroll
        for (unsigned j = 0; j < KT_TILE; j += KT_ROWS) {
            const kiln_u64 kk = k0 + ty + j;
            if (kk < nk && l < nl) out[kk * nl + l] = tile[tx][ty + j];
        }
        __syncthreads();
    }
}

extern "C" __global__ void kiln_tensor_transpose(const char* src, char* dst, unsigned esize, kiln_u64 nb, kiln_u64 nk,
                                                 kiln_u64 nl, long long s_l, unsigned brank, kiln_u64 bd0,
                                                 kiln_u64 bd1, kiln_u64 bd2, kiln_u64 bd3, kiln_u64 bd4, kiln_u64 bd5,
                                                 long long bs0, long long bs1, long long bs2, long long bs3,
                                                 long long bs4, long long bs5) {
    const kiln_u64 bd[KT_BRANK] = {bd0, bd1, bd2, bd3, bd4, bd5};
    const long long bs[KT_BRANK] = {bs0, bs1, bs2, bs3, bs4, bs5};
    const unsigned e = ((kt_addr(src) | kt_addr(dst)) & (esize - 1)) == 0 ? esize : 0;
    switch (e) {
    case 1: kt_transpose_run<unsigned char>((const unsigned char*)src, (unsigned char*)dst, nb, nk, nl, s_l, brank, bd, bs); break;
    case 2: kt_transpose_run<unsigned short>((const unsigned short*)src, (unsigned short*)dst, nb, nk, nl, s_l, brank, bd, bs); break;
    case 4: kt_transpose_run<unsigned>((const unsigned*)src, (unsigned*)dst, nb, nk, nl, s_l, brank, bd, bs); break;
    case 8: kt_transpose_run<kiln_u64>((const kiln_u64*)src, (kiln_u64*)dst, nb, nk, nl, s_l, brank, bd, bs); break;
    default: {
        // Unaligned pointers (not expected: allocations are aligned): element by element, bytewise.
        const kiln_u64 n = nb * nk * nl;
        const kiln_u64 threads = (kiln_u64)gridDim.x * blockDim.x * blockDim.y;
        for (kiln_u64 i = (kiln_u64)blockIdx.x * blockDim.x * blockDim.y + threadIdx.y * blockDim.x + threadIdx.x; i < n;
             i += threads) {
            const kiln_u64 l = i % nl, r = i / nl, k = r % nk;
            kiln_u64 rem = r / nk;
            long long off = 0;
            for (int j = 0; j < KT_BRANK; ++j) {
                if ((unsigned)j < brank) {
                    const kiln_u64 q = rem / bd[j];
                    off += (long long)(rem - q * bd[j]) * bs[j];
                    rem = q;
                }
            }
            const long long at = (off + (long long)k + (long long)l * s_l) * (long long)esize;
            for (unsigned c = 0; c < esize; ++c) dst[i * esize + c] = src[at + c];
        }
        break;
    }
    }
}

// ---------------------------------------------------------------------------------------
// Gather along an axis: data is outer × dim × inner_bytes, indices n_idx int32 (idx64 = 0)
// or int64 (idx64 = 1); dst is outer × n_idx × inner_bytes. Negative indices wrap once;
// indices still outside 0..dim write zeros (never read out of bounds) and report device error
// 1 (index, dim, axis) through the node's status record.

template <typename T, typename I>
__device__ void kt_gather_run(const T* src, const void* idx, T* dst, I outer, I dim, I n_idx, I upi, unsigned idx64,
                              unsigned axis, kiln_status* st) {
    const I total = outer * n_idx * upi;
    for (I i = (I)(blockIdx.x * (kiln_u64)blockDim.x + threadIdx.x); i < total; i += (I)(gridDim.x * (kiln_u64)blockDim.x)) {
        const I t = i / upi;
        const I c = i - t * upi;
        const I o = t / n_idx;
        const I j = t - o * n_idx;
        const long long given = idx64 ? ((const long long*)idx)[j] : (long long)((const int*)idx)[j];
        const long long k = given < 0 ? given + (long long)dim : given;
        if (k >= 0 && k < (long long)dim) {
            dst[i] = src[((kiln_u64)o * dim + (kiln_u64)k) * upi + c];
        } else {
            dst[i] = T();
            if (o == 0 && c == 0) kiln_fail(st, 1, given, (long long)dim, axis);
        }
    }
}

template <typename T>
__device__ void kt_gather_w(const char* src, const void* idx, char* dst, kiln_u64 outer, kiln_u64 dim, kiln_u64 n_idx,
                            kiln_u64 inner_bytes, unsigned idx64, unsigned axis, kiln_status* st) {
    const kiln_u64 upi = inner_bytes / sizeof(T);
    if (outer * n_idx * upi <= 0xffffffffull && outer * dim * upi <= 0xffffffffull)
        kt_gather_run<T, unsigned>((const T*)src, idx, (T*)dst, (unsigned)outer, (unsigned)dim, (unsigned)n_idx,
                                   (unsigned)upi, idx64, axis, st);
    else
        kt_gather_run<T, kiln_u64>((const T*)src, idx, (T*)dst, outer, dim, n_idx, upi, idx64, axis, st);
}

extern "C" __global__ void kiln_tensor_gather(const char* src, const void* idx, char* dst, kiln_u64 outer, kiln_u64 dim,
                                              kiln_u64 n_idx, kiln_u64 inner_bytes, unsigned idx64, unsigned axis,
                                              kiln_status* st) {
    switch (kt_width(kt_addr(src) | kt_addr(dst) | inner_bytes)) {
    case 16: kt_gather_w<kt_v16>(src, idx, dst, outer, dim, n_idx, inner_bytes, idx64, axis, st); break;
    case 8: kt_gather_w<kiln_u64>(src, idx, dst, outer, dim, n_idx, inner_bytes, idx64, axis, st); break;
    case 4: kt_gather_w<unsigned>(src, idx, dst, outer, dim, n_idx, inner_bytes, idx64, axis, st); break;
    case 2: kt_gather_w<unsigned short>(src, idx, dst, outer, dim, n_idx, inner_bytes, idx64, axis, st); break;
    default: kt_gather_w<unsigned char>(src, idx, dst, outer, dim, n_idx, inner_bytes, idx64, axis, st); break;
    }
}

// ---------------------------------------------------------------------------------------
// Fill: nbytes bytes of a 16-byte pattern (lo, hi little-endian), byte k = pattern[k % 16].
// ConstantOfShape (the value repeated to 16 bytes).

extern "C" __global__ void kiln_tensor_fill(char* dst, kiln_u64 nbytes, kiln_u64 lo, kiln_u64 hi) {
    kiln_u64 done = 0;
    if (kiln_aligned(dst, 16)) {
        const kiln_u64 units = nbytes / 16;
        kt_v16 v;
        v.e[0] = lo;
        v.e[1] = hi;
        kt_v16* d = (kt_v16*)dst;
        KILN_FOR(i, units) { d[i] = v; }
        done = units * 16;
    }
    KILN_FOR(i, nbytes - done) {
        const kiln_u64 k = (done + i) & 15;
        const kiln_u64 w = k < 8 ? lo : hi;
        dst[done + i] = (char)(w >> (8 * (k & 7)));
    }
}

// ---------------------------------------------------------------------------------------
// Up to 8 given 64-bit values: dst[i] = v_i for i < n. Shape and Size (int64 outputs).

extern "C" __global__ void kiln_tensor_values64(char* dst, unsigned n, kiln_u64 v0, kiln_u64 v1, kiln_u64 v2,
                                                kiln_u64 v3, kiln_u64 v4, kiln_u64 v5, kiln_u64 v6, kiln_u64 v7) {
    const kiln_u64 v[8] = {v0, v1, v2, v3, v4, v5, v6, v7};
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n || i >= 8) return;
    if (kiln_aligned(dst, 8)) {
        ((kiln_u64*)dst)[i] = v[i];
    } else {
        for (int b = 0; b < 8; ++b) dst[8 * i + b] = (char)(v[i] >> (8 * b));
    }
}

// ---------------------------------------------------------------------------------------
// Range: dst[i] = start + i·delta.
// Integers: computed in int64 with wraparound, stored as the low esize (2, 4, 8) bytes.
// Floats: computed in double, stored as float (esize 4) or double (esize 8).

extern "C" __global__ void kiln_tensor_range_int(char* dst, kiln_u64 n, long long start, long long delta,
                                                 unsigned esize) {
    KILN_FOR(i, n) {
        const kiln_u64 v = (kiln_u64)start + i * (kiln_u64)delta;
        switch (esize) {
        case 1: ((unsigned char*)dst)[i] = (unsigned char)v; break;
        case 2: ((unsigned short*)dst)[i] = (unsigned short)v; break;
        case 4: ((unsigned*)dst)[i] = (unsigned)v; break;
        default: ((kiln_u64*)dst)[i] = v; break;
        }
    }
}

extern "C" __global__ void kiln_tensor_range_float(char* dst, kiln_u64 n, double start, double delta, unsigned esize) {
    KILN_FOR(i, n) {
        // Rounded as the CPU reference (no fused multiply-add).
        const double v = __dadd_rn(start, __dmul_rn((double)i, delta));
        if (esize == 4)
            ((float*)dst)[i] = (float)v;
        else
            ((double*)dst)[i] = v;
    }
}

// ---------------------------------------------------------------------------------------
// Trilu: element t of n (esize bytes each; matrices [rows, cols] innermost) copied when
// j − i ≥ k (upper) or j − i ≤ k (lower), for (i, j) = ((t / cols) % rows, t % cols), else zero.

extern "C" __global__ void kiln_tensor_trilu(const char* src, char* dst, kiln_u64 n, unsigned esize, kiln_u64 rows,
                                             kiln_u64 cols, long long k, unsigned upper) {
    KILN_FOR(t, n) {
        const kiln_u64 q = t / cols;
        const long long d = (long long)(t - q * cols) - (long long)(q % rows);
        const bool keep = upper ? d >= k : d <= k;
        for (unsigned b = 0; b < esize; ++b) dst[t * esize + b] = keep ? src[t * esize + b] : (char)0;
    }
}

// ---------------------------------------------------------------------------------------
// Ops that move elements by index tensors (shim/src/index.rs): GatherElements, ScatterElements
// (and Scatter), GatherND, ScatterND. Geometry comes as eight dims and eight strides (in
// elements; unused ones 1 and 0). An index outside [-dim, dim) fails the node through its
// status record with the op's device error `code` (values: the index, the dimension, the axis)
// and reads or writes nothing out of bounds: a gather writes zeros, a scatter skips the update.

#define KT_DIMS8(p)                                                                                            \
    kiln_u64 p##0, kiln_u64 p##1, kiln_u64 p##2, kiln_u64 p##3, kiln_u64 p##4, kiln_u64 p##5, kiln_u64 p##6, \
        kiln_u64 p##7
#define KT_ARRAY8(p) {p##0, p##1, p##2, p##3, p##4, p##5, p##6, p##7}

// One element's bytes: dst[0..esize) = src[0..esize), or zeros when src is null.
__device__ __forceinline__ void kt_elem_copy(char* dst, const char* src, unsigned esize) {
    for (unsigned b = 0; b < esize; ++b) dst[b] = src ? src[b] : (char)0;
}

// Element t of an int32 (idx64 = 0) or int64 index tensor.
__device__ __forceinline__ long long kt_index(const void* idx, kiln_u64 t, unsigned idx64) {
    return idx64 ? ((const long long*)idx)[t] : (long long)((const int*)idx)[t];
}

// `i` wrapped into [0, dim), or -1 after reporting (code, i, dim, axis).
__device__ __forceinline__ long long kt_wrap(long long i, kiln_u64 dim, unsigned axis, unsigned code,
                                             kiln_status* st) {
    const long long j = i < 0 ? i + (long long)dim : i;
    if (j < 0 || j >= (long long)dim) {
        kiln_fail(st, code, i, (long long)dim, axis);
        return -1;
    }
    return j;
}

// Data offset (elements) of position t of the index dims d (rank of them), its axis coordinate
// left out (the caller adds index · s[axis]).
__device__ __forceinline__ kiln_u64 kt_base(kiln_u64 t, const kiln_u64* d, const kiln_u64* s, unsigned rank,
                                            unsigned axis) {
    kiln_u64 off = 0;
    for (int k = (int)rank - 1; k >= 0; --k) {
        const kiln_u64 c = t % d[k];
        t /= d[k];
        if (k != (int)axis) off += c * s[k];
    }
    return off;
}

// GatherElements: out[t] = data[t's coordinates in the index dims d with the axis one replaced by
// indices[t]] (data strides s, data's axis dimension axis_dim). One thread per output element.
extern "C" __global__ void kiln_tensor_gather_elements(const char* src, const void* idx, char* dst, kiln_u64 n,
                                                       unsigned esize, unsigned idx64, unsigned rank, unsigned axis,
                                                       kiln_u64 axis_dim, KT_DIMS8(d), KT_DIMS8(s), unsigned code,
                                                       kiln_status* st) {
    const kiln_u64 dims[8] = KT_ARRAY8(d), strides[8] = KT_ARRAY8(s);
    KILN_FOR(t, n) {
        const long long j = kt_wrap(kt_index(idx, t, idx64), axis_dim, axis, code, st);
        const kiln_u64 at = kt_base(t, dims, strides, rank, axis) + (kiln_u64)(j < 0 ? 0 : j) * strides[axis];
        kt_elem_copy(dst + t * esize, j < 0 ? (const char*)0 : src + at * esize, esize);
    }
}

// `old` combined with `v` (reduction 0 none, 1 add, 2 mul, 3 max, 4 min) in kiln_elem's compute
// type, as the CPU reference: floats in f32 (f64 for float64) rounded to the storage type,
// integers wrapping on their 64-bit pattern, max / min by the type's order (signed or not).
template <typename Tag>
__device__ __forceinline__ typename Tag::storage kt_combine(typename Tag::storage old, typename Tag::storage v,
                                                            unsigned reduction) {
    typedef kiln_elem<Tag> E;
    typedef typename E::C C;
    const C a = E::ld(old), b = E::ld(v);
    const bool greater = E::is_float || !E::is_signed ? b > a : (long long)b > (long long)a;
    const bool less = E::is_float || !E::is_signed ? b < a : (long long)b < (long long)a;
    switch (reduction) {
    case 1: return E::st(a + b);
    case 2: return E::st(a * b);
    case 3: return greater ? v : old;
    case 4: return less ? v : old;
    default: return v;
    }
}

// ScatterElements: out (already a copy of data) gets updates[t] at t's coordinates with the axis
// one replaced by indices[t] (index dims d, data strides s). One thread per line along the axis
// (`lines` = index elements / d[axis]), its updates in order.
template <typename Tag>
__global__ void kiln_tensor_scatter_elements(typename Tag::storage* out, const void* idx,
                                             const typename Tag::storage* upd, kiln_u64 lines, unsigned idx64,
                                             unsigned rank, unsigned axis, kiln_u64 axis_dim, unsigned reduction,
                                             KT_DIMS8(d), KT_DIMS8(s), unsigned code, kiln_status* st) {
    const kiln_u64 dims[8] = KT_ARRAY8(d), strides[8] = KT_ARRAY8(s);
    kiln_u64 inner = 1;  // index elements after the axis: the axis' stride in the index dims
    for (unsigned k = axis + 1; k < rank; ++k) inner *= dims[k];
    KILN_FOR(line, lines) {
        const kiln_u64 t0 = (line / inner) * dims[axis] * inner + line % inner;  // the line's first position
        const kiln_u64 base = kt_base(t0, dims, strides, rank, axis);
        for (kiln_u64 q = 0; q < dims[axis]; ++q) {
            const kiln_u64 t = t0 + q * inner;
            const long long j = kt_wrap(kt_index(idx, t, idx64), axis_dim, axis, code, st);
            if (j < 0) continue;
            const kiln_u64 at = base + (kiln_u64)j * strides[axis];
            out[at] = kt_combine<Tag>(out[at], upd[t], reduction);
        }
    }
}

// Data offset (elements) of index tuple q (k int64 indices at idx + q·k) of GatherND / ScatterND:
// its batch (q / per_batch) · batch_stride plus each index (wrapped in dims d) · strides s, or
// -1 after reporting an index out of range (its data axis is batch dims + j).
__device__ __forceinline__ long long kt_tuple(const long long* idx, kiln_u64 q, unsigned k, kiln_u64 per_batch,
                                              kiln_u64 batch_stride, const kiln_u64* d, const kiln_u64* s,
                                              unsigned batch_dims, unsigned code, kiln_status* st) {
    kiln_u64 at = (q / per_batch) * batch_stride;
    for (unsigned j = 0; j < k; ++j) {
        const long long i = kt_wrap(idx[q * k + j], d[j], batch_dims + j, code, st);
        if (i < 0) return -1;
        at += (kiln_u64)i * s[j];
    }
    return (long long)at;
}

// GatherND: out[q·slice + e] = data[tuple q's slice + e]. One thread per output element.
extern "C" __global__ void kiln_tensor_gather_nd(const char* src, const long long* idx, char* dst, kiln_u64 n,
                                                 unsigned esize, unsigned k, unsigned batch_dims, kiln_u64 slice,
                                                 kiln_u64 per_batch,
                                                 kiln_u64 batch_stride, KT_DIMS8(d), KT_DIMS8(s), unsigned code,
                                                 kiln_status* st) {
    const kiln_u64 dims[8] = KT_ARRAY8(d), strides[8] = KT_ARRAY8(s);
    KILN_FOR(t, n) {
        const kiln_u64 q = t / slice, e = t - q * slice;
        const long long at = kt_tuple(idx, q, k, per_batch, batch_stride, dims, strides, batch_dims, code, st);
        kt_elem_copy(dst + t * esize, at < 0 ? (const char*)0 : src + ((kiln_u64)at + e) * esize, esize);
    }
}

// ScatterND: out (already a copy of data) gets, for every tuple q in order, updates[q·slice + e]
// at tuple q's slice + e. One thread per slice element e.
template <typename Tag>
__global__ void kiln_tensor_scatter_nd(typename Tag::storage* out, const long long* idx,
                                       const typename Tag::storage* upd, kiln_u64 tuples, unsigned reduction,
                                       unsigned k, unsigned batch_dims, kiln_u64 slice, kiln_u64 per_batch,
                                       kiln_u64 batch_stride,
                                       KT_DIMS8(d), KT_DIMS8(s), unsigned code, kiln_status* st) {
    const kiln_u64 dims[8] = KT_ARRAY8(d), strides[8] = KT_ARRAY8(s);
    KILN_FOR(e, slice) {
        for (kiln_u64 q = 0; q < tuples; ++q) {
            const long long at = kt_tuple(idx, q, k, per_batch, batch_stride, dims, strides, batch_dims, code, st);
            if (at < 0) continue;
            out[(kiln_u64)at + e] = kt_combine<Tag>(out[(kiln_u64)at + e], upd[q * slice + e], reduction);
        }
    }
}

// OneHot: out[o, h, i] (o over the index dims before the axis, h < depth, i over the `inner`
// index elements after it) = values[1] when index [o, i] (truncated toward zero, a NaN matching
// nothing; a negative one plus depth when `wrap`, OneHot-11) is h, else values[0]. One thread per
// output element.
template <typename Tag>
__global__ void kiln_tensor_onehot(const typename Tag::storage* idx, const char* values, char* dst, kiln_u64 n,
                                   unsigned esize, kiln_u64 depth, kiln_u64 inner, unsigned wrap) {
    typedef kiln_elem<Tag> E;
    KILN_FOR(t, n) {
        const kiln_u64 o = t / (depth * inner), r = t - o * depth * inner, h = r / inner, i = r - h * inner;
        const typename E::C c = E::ld(idx[o * inner + i]);
        long long v;
        if (E::is_float)
            v = c >= 9.2e18 || c <= -9.2e18 || c != c ? -(long long)depth - 1 : (long long)c;
        else
            v = E::is_signed || (kiln_u64)c <= 0x7fffffffffffffffull ? (long long)c : -(long long)depth - 1;
        if (v < 0 && wrap) v += (long long)depth;
        kt_elem_copy(dst + t * esize, values + (v == (long long)h ? esize : 0), esize);
    }
}

// EyeLike: a rows × cols matrix of esize-byte elements, the little-endian pattern `one` where
// column − row = k, zeros elsewhere.
extern "C" __global__ void kiln_tensor_eyelike(char* dst, kiln_u64 rows, kiln_u64 cols, long long k, unsigned esize,
                                               kiln_u64 one) {
    KILN_FOR(t, rows * cols) {
        const kiln_u64 r = t / cols;
        const bool diag = (long long)(t - r * cols) - (long long)r == k;
        for (unsigned b = 0; b < esize; ++b) dst[t * esize + b] = diag ? (char)(one >> (8 * b)) : (char)0;
    }
}

// Pad (shim/src/pad.rs): out[t] = in[the source of each of t's coordinates], or the esize-byte
// little-endian `value` where a coordinate has none (mode 0 constant; 1 edge, 2 reflect, 3 wrap
// always have one, from the window [lo, hi) of the axis that negative pads leave, which the
// shim checks is not empty). in / out dims and the pads before each axis (`b`, negative:
// cropped).
extern "C" __global__ void kiln_tensor_pad(const char* src, char* dst, kiln_u64 n, unsigned esize, unsigned rank,
                                           unsigned mode, KT_DIMS8(i), KT_DIMS8(o), long long b0, long long b1,
                                           long long b2, long long b3, long long b4, long long b5, long long b6,
                                           long long b7, kiln_u64 value) {
    const kiln_u64 in[8] = KT_ARRAY8(i), out[8] = KT_ARRAY8(o);
    const long long begin[8] = {b0, b1, b2, b3, b4, b5, b6, b7};
    KILN_FOR(t, n) {
        kiln_u64 rem = t, at = 0, stride = 1;
        bool inside = true;
        for (int k = (int)rank - 1; k >= 0; --k) {
            const long long n_in = (long long)in[k], end = (long long)out[k] - n_in - begin[k];
            const long long lo = begin[k] < 0 ? -begin[k] : 0, hi = n_in - (end < 0 ? -end : 0), len = hi - lo;
            long long x = (long long)(rem % out[k]) - begin[k];
            rem /= out[k];
            if (x < lo || x >= hi) {
                if (mode == 0) {
                    inside = false;
                } else if (mode == 1) {
                    x = x < lo ? lo : hi - 1;
                } else if (mode == 3) {
                    x = lo + (((x - lo) % len) + len) % len;
                } else if (len == 1) {
                    x = lo;
                } else {
                    const long long period = 2 * (len - 1), r = (((x - lo) % period) + period) % period;
                    x = lo + (r >= len ? period - r : r);
                }
            }
            at += (kiln_u64)(inside ? x : 0) * stride;
            stride *= in[k];
        }
        for (unsigned e = 0; e < esize; ++e)
            dst[t * esize + e] = inside ? src[at * esize + e] : (char)(value >> (8 * e));
    }
}

// HannWindow, HammingWindow, BlackmanWindow: w[n] = a0 − a1·cos(2πn / N) + a2·cos(4πn / N) in
// f64, rounded to the element type (float16 and bfloat16 through float32). One thread per element.
template <typename Tag>
__global__ void kiln_tensor_window(typename Tag::storage* dst, kiln_u64 n, double a0, double a1, double a2, double N) {
    typedef kiln_elem<Tag> E;
    const double pi = 3.14159265358979323846;
    KILN_FOR(i, n) {
        const double x = (double)i;
        dst[i] = E::st((typename E::C)(a0 - a1 * cos(x * (2.0 * pi) / N) + a2 * cos(x * (4.0 * pi) / N)));
    }
}

// ReverseSequence: element (a0, a1, k) of x [A0, A1, inner] (batch and time on axes 0 and 1,
// batch first when `batch_first`) is read from the reversed time position when the time lies
// within its row's length; a length outside 0..=T is reported (code 7) and clamped.
extern "C" __global__ void kiln_tensor_reverse_sequence(const char* src, const void* lens, char* dst, kiln_u64 n,
                                                        unsigned esize, kiln_u64 A0, kiln_u64 A1, kiln_u64 inner,
                                                        unsigned batch_first, unsigned lens64, kiln_status* st) {
    const kiln_u64 T = batch_first ? A1 : A0;
    KILN_FOR(i, n) {
        const kiln_u64 k = i % inner, r = i / inner, a1 = r % A1, a0 = r / A1;
        const kiln_u64 b = batch_first ? a0 : a1, t = batch_first ? a1 : a0;
        long long l = lens64 ? ((const long long*)lens)[b] : ((const int*)lens)[b];
        if (l < 0 || l > (long long)T) {
            if (t == 0 && k == 0) kiln_fail(st, 7, (long long)b, l, (long long)T);
            l = l < 0 ? 0 : (long long)T;
        }
        const kiln_u64 ts = t < (kiln_u64)l ? (kiln_u64)l - 1 - t : t;
        const kiln_u64 s0 = batch_first ? b : ts, s1 = batch_first ? ts : b;
        kt_elem_copy(dst + i * esize, src + ((s0 * A1 + s1) * inner + k) * esize, esize);
    }
}

// ---------------------------------------------------------------------------------------
// NonZero and Compress (shim/src/select.rs).

// Whether one element's bytes are nonzero; a float by magnitude (its top byte's sign bit left
// out), so -0.0 is zero and NaN is not.
__device__ __forceinline__ bool kt_nonzero(const unsigned char* e, unsigned esize, unsigned is_float) {
    unsigned char any = e[esize - 1] & (is_float ? 0x7f : 0xff);
    for (unsigned b = 0; b + 1 < esize; ++b) any |= e[b];
    return any != 0;
}

// The coordinates of x's nonzero elements in row-major order: out[a * nnz + k] is coordinate a
// of the k-th, over dims d0..d{rank-1}. One block, blockDim.x a multiple of 32 (up to 1024),
// walks the elements a block-width at a time: a warp ballot ranks each nonzero in its warp, the
// warps' counts are scanned in shared memory, and `base` carries the count of earlier chunks.
// Writes at most nnz coordinates (the shim counted them from the same values).
extern "C" __global__ void kiln_tensor_nonzero(const unsigned char* x, long long* out, kiln_u64 n, unsigned esize,
                                               unsigned is_float, kiln_u64 nnz, unsigned rank, KT_DIMS8(d)) {
    const kiln_u64 dims[8] = KT_ARRAY8(d);
    __shared__ unsigned warp_before[32];
    __shared__ unsigned chunk_total;
    const unsigned lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    kiln_u64 base = 0;
    for (kiln_u64 c = 0; c < n; c += blockDim.x) {
        const kiln_u64 t = c + threadIdx.x;
        const bool hit = t < n && kt_nonzero(x + t * esize, esize, is_float);
        const unsigned ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_before[warp] = __popc(ballot);
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned acc = 0;
            for (unsigned w = 0; w < warps; ++w) {
                const unsigned v = warp_before[w];
                warp_before[w] = acc;
                acc += v;
            }
            chunk_total = acc;
        }
        __syncthreads();
        if (hit) {
            const kiln_u64 k = base + warp_before[warp] + __popc(ballot & ((1u << lane) - 1u));
            if (k < nnz) {
                kiln_u64 rest = t;
                for (int a = (int)rank - 1; a >= 0; --a) {
                    out[(kiln_u64)a * nnz + k] = (long long)(rest % dims[a]);
                    rest /= dims[a];
                }
            }
        }
        base += chunk_total;
        __syncthreads();
    }
}

// Compress: output element t = (o, j, i) over (outer, count, inner) copies input slice sel[j]
// of outer index o: src[(o * axis_len + sel[j]) * inner + i].
extern "C" __global__ void kiln_tensor_compress(const char* src, const long long* sel, char* dst, kiln_u64 n,
                                                unsigned esize, kiln_u64 inner, kiln_u64 count, kiln_u64 axis_len) {
    KILN_FOR(t, n) {
        const kiln_u64 i = t % inner, j = (t / inner) % count, o = t / (inner * count);
        kt_elem_copy(dst + t * esize, src + ((o * axis_len + (kiln_u64)sel[j]) * inner + i) * esize, esize);
    }
}

// TensorScatter (shim/src/tensor_scatter.rs): output element t = (b, r, j, i) over (batch, rows,
// max_seq, inner) is update row s of (b, r) when j is write_indices[b] + s (mod max_seq when
// circular) for some s < seq, else the past's. A negative index, or a linear write past the
// end, keeps the past and fails the node (device error 8: batch row, index, max_seq).
extern "C" __global__ void kiln_tensor_scatter_seq(const char* past, const char* update, const long long* w, char* dst,
                                                   kiln_u64 n, unsigned esize, kiln_u64 rows, kiln_u64 max_seq,
                                                   kiln_u64 seq, kiln_u64 inner, unsigned circular, unsigned has_w,
                                                   kiln_status* st) {
    KILN_FOR(t, n) {
        const kiln_u64 i = t % inner, j = (t / inner) % max_seq, br = t / (inner * max_seq), b = br / rows;
        const long long start = has_w ? w[b] : 0;
        const char* src = past + t * esize;
        if (start < 0 || (!circular && (kiln_u64)start + seq > max_seq)) {
            if (j == 0 && i == 0 && br % rows == 0) kiln_fail(st, 8, (long long)b, start, (long long)max_seq);
        } else {
            const kiln_u64 s = circular ? (j + max_seq - (kiln_u64)start % max_seq) % max_seq : j - (kiln_u64)start;
            if ((circular || j >= (kiln_u64)start) && s < seq) src = update + ((br * seq + s) * inner + i) * esize;
        }
        kt_elem_copy(dst + t * esize, src, esize);
    }
}

// MelWeightMatrix (shim/src/mel.rs): element (j, i) of [spec_bins, mel_bins], mel bin i's triangle
// over the spectrum bins of mel points i, i + 1, i + 2.
__device__ __forceinline__ long long kt_mel_point(kiln_u64 i, double low, double step, double dft, double rate) {
    const double hz = 700.0 * (pow(10.0, ((double)i * step + low) / 2595.0) - 1.0);
    return (long long)floor((dft + 1.0) * hz / rate);
}

template <typename Tag>
__global__ void kiln_tensor_mel(typename Tag::storage* dst, kiln_u64 spec_bins, kiln_u64 mel_bins, double low,
                                double step, double dft, double rate) {
    typedef kiln_elem<Tag> E;
    KILN_FOR(t, spec_bins * mel_bins) {
        const kiln_u64 i = t % mel_bins;
        const long long j = (long long)(t / mel_bins);
        const long long lo = kt_mel_point(i, low, step, dft, rate), c = kt_mel_point(i + 1, low, step, dft, rate),
                        hi = kt_mel_point(i + 2, low, step, dft, rate);
        double v = 0.0;
        if (lo == c) {
            if (j == c) v = 1.0;
        } else if (lo <= j && j <= c) {
            v = (double)(j - lo) / (double)(c - lo);
        }
        if (hi > c && c <= j && j < hi) v = (double)(hi - j) / (double)(hi - c);
        dst[t] = E::st((typename E::C)v);
    }
}

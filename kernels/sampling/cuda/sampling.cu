// kiln-sampling CUDA kernels. Argument order matches the shim's `launch` calls exactly.
#include "kiln.cuh"
#include "kiln-cuda-std/reduce.cuh"

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

// The kernels: templates over the prelude's dtype tag, instantiated by the name expressions
// kernel.toml lists (schema 6).
template <typename Tag>
__global__ void kiln_append_mask(const typename Tag::storage* mask, const long long* pos, typename Tag::storage* out,
                                 long long* pos_out, kiln_u64 B, kiln_u64 L) {
    append_mask<typename Tag::storage>(mask, pos, out, pos_out, B, L);
}

// Sample: one block of 1024 threads per row chooses the row's next token from the logits of
// its last position, as kernel-abi's sampling.rs (the CPU reference) does:
// repetition penalty over the row's history (columns < position whose mask is set), greedy
// when temperature <= 0, else temperature, the top_k best candidates (radix select on keys that
// order by value then by lower index, all distinct), softmax in f64, top-p, and one Philox draw
// keyed by (seed, stream, position - base). The token goes to ids[b] and to column `position`
// of hist_out (a copy of hist unless bound in place).
//
// Up to KILN_SAMPLE_MAX_CANDIDATES candidates are sorted on chip and their weights summed in
// candidate order, as the reference does. More (top_k 0 over a large vocabulary) never fit on
// chip: the top-p cut and the draw are then each a radix select by mass (sample_mass_select),
// the first key in descending order whose running mass passes the target, so nothing is
// sorted; the sums are the same up to the float64 rounding of their order. A radix bin's mass
// is summed with atomics, so its rounding may vary from run to run: a token can differ only
// when a draw lands within that rounding of a boundary between two candidates.
#define KILN_SAMPLE_THREADS 1024
#define KILN_SAMPLE_MAX_CANDIDATES 1024
#define KILN_SAMPLE_GATHER (2 * KILN_SAMPLE_MAX_CANDIDATES)

__device__ __forceinline__ kiln_u64 sample_key(float v, kiln_u64 i) {
    unsigned bits = __float_as_uint(v);
    unsigned ordered = (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
    return (((kiln_u64)ordered) << 32) | (kiln_u64)(0xFFFFFFFFu - (unsigned)i);
}

__device__ __forceinline__ float sample_key_value(kiln_u64 key) {
    unsigned ordered = (unsigned)(key >> 32);
    return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7FFFFFFFu) : ~ordered);
}

// Whether (va, ia) beats (vb, ib) for argmax: a NaN wins over every number, then the larger
// value, then the lower index (ib < 0: nothing yet).
__device__ __forceinline__ bool argmax_beats(float va, long long ia, float vb, long long ib) {
    if (ia < 0) return false;
    if (ib < 0) return true;
    const bool na = va != va, nb = vb != vb;
    if (na || nb) return na && (!nb || ia < ib);
    return va > vb || (va == vb && ia < ib);
}

// Sorts keys[0, width) in descending order (width a power of two; bitonic, whole block).
__device__ void sample_sort_desc(kiln_u64* keys, unsigned width) {
    for (unsigned size = 2; size <= width; size <<= 1)
        for (unsigned stride = size >> 1; stride > 0; stride >>= 1) {
            for (unsigned j = threadIdx.x; j < width; j += blockDim.x) {
                const unsigned partner = j ^ stride;
                if (partner > j) {
                    const bool descending = (j & size) == 0;
                    const kiln_u64 a = keys[j], c = keys[partner];
                    if ((a < c) == descending) keys[j] = c, keys[partner] = a;
                }
            }
            __syncthreads();
        }
}

// The k-th largest of the V keys key_of(i) (k >= 1): radix select, 8 bits at a time from the
// top, by count. Every thread gets it.
template <typename KeyOf>
__device__ kiln_u64 sample_kth_key(KeyOf key_of, kiln_u64 V, kiln_u64 k, unsigned* bins, kiln_u64* prefix_s,
                                   unsigned* remaining_s) {
    const unsigned tid = threadIdx.x, nt = blockDim.x;
    if (tid == 0) *prefix_s = 0, *remaining_s = (unsigned)k;
    kiln_u64 high = 0;  // the bits of the prefix decided so far
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (unsigned i = tid; i < 256; i += nt) bins[i] = 0u;
        __syncthreads();
        const kiln_u64 prefix = *prefix_s;
        for (kiln_u64 i = tid; i < V; i += nt) {
            const kiln_u64 key = key_of(i);
            if ((key & high) == prefix) atomicAdd(&bins[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            unsigned above = 0, d = 255;
            for (;; --d) {
                if (above + bins[d] >= *remaining_s || d == 0) break;
                above += bins[d];
            }
            *prefix_s = prefix | ((kiln_u64)d << shift);
            *remaining_s -= above;
        }
        high |= (kiln_u64)255u << shift;
        __syncthreads();
    }
    return *prefix_s;
}

// The first key in descending order, among the keys key_of(i) >= floor, whose running mass
// passes `target` (mass > target when `strict`, else >=), where a key's mass is
// exp(value - top) in float64: radix select, 8 bits at a time from the top, by mass. When
// rounding leaves no key passing, the smallest key >= floor (the reference's last candidate).
// Every thread gets it.
template <typename KeyOf>
__device__ kiln_u64 sample_mass_select(KeyOf key_of, kiln_u64 V, kiln_u64 floor, float top, double target, bool strict,
                                       double* mass, unsigned* bins, kiln_u64* prefix_s, double* remaining_s) {
    const unsigned tid = threadIdx.x, nt = blockDim.x;
    if (tid == 0) *prefix_s = 0, *remaining_s = target;
    kiln_u64 high = 0;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (unsigned i = tid; i < 256; i += nt) mass[i] = 0.0, bins[i] = 0u;
        __syncthreads();
        const kiln_u64 prefix = *prefix_s;
        for (kiln_u64 i = tid; i < V; i += nt) {
            const kiln_u64 key = key_of(i);
            if (key >= floor && (key & high) == prefix) {
                const unsigned d = (unsigned)(key >> shift) & 255u;
                atomicAdd(&mass[d], exp((double)(sample_key_value(key) - top)));
                atomicAdd(&bins[d], 1u);
            }
        }
        __syncthreads();
        if (tid == 0) {
            const double rem = *remaining_s;
            double above = 0.0, above_last = 0.0;
            int chosen = -1, last = 0;
            for (int d = 255; d >= 0; --d) {
                if (bins[d] == 0u) continue;
                const double m = above + mass[d];
                if (strict ? m > rem : m >= rem) {
                    chosen = d;
                    break;
                }
                last = d, above_last = above, above = m;
            }
            if (chosen < 0) chosen = last, above = above_last;
            *prefix_s = prefix | ((kiln_u64)chosen << shift);
            *remaining_s = rem - above;
        }
        high |= (kiln_u64)255u << shift;
        __syncthreads();
    }
    return *prefix_s;
}

template <typename Tag>
__device__ void sample_row(const typename Tag::storage* logits, const long long* mask, const long long* hist,
                           const long long* pos, const float* params, const long long* seeds, long long* ids,
                           long long* hist_out, kiln_u64 S, kiln_u64 V, kiln_u64 L, kiln_status* st) {
    extern __shared__ unsigned seen[];  // ceil(V / 32) words: the history's tokens
    __shared__ kiln_u64 keys[KILN_SAMPLE_GATHER];
    __shared__ unsigned bins[256];
    __shared__ kiln_u64 prefix_s;
    __shared__ unsigned remaining_s, count_s;
    __shared__ float warp_v[32];
    __shared__ long long warp_i[32];
    __shared__ long long token_s;

    (void)st;  // every row samples on the device: no input fails it
    const kiln_u64 b = blockIdx.x;
    const unsigned tid = threadIdx.x, nt = blockDim.x;
    const long long p = pos[0];
    const float T = params[b * 4 + 0], top_p = params[b * 4 + 2], rp = params[b * 4 + 3];
    const float top_k = params[b * 4 + 1];
    const typename Tag::storage* row = logits + (b * S + S - 1) * V;
    if (hist_out != hist)
        for (kiln_u64 c = tid; c < L; c += nt) hist_out[b * L + c] = hist[b * L + c];

    const bool pen = rp != 1.0f;
    if (pen) {
        const kiln_u64 words = (V + 31) / 32;
        for (kiln_u64 i = tid; i < words; i += nt) seen[i] = 0u;
        __syncthreads();
        const kiln_u64 cols = p <= 0 ? 0 : ((kiln_u64)p < L ? (kiln_u64)p : L);
        for (kiln_u64 c = tid; c < cols; c += nt) {
            const long long t = hist[b * L + c];
            if (mask[b * L + c] != 0 && t >= 0 && (kiln_u64)t < V) atomicOr(&seen[t >> 5], 1u << (t & 31));
        }
    }
    __syncthreads();
    auto value = [&](kiln_u64 i) {
        float x = kiln_to_f32(Tag(), row[i]);
        if (pen && ((seen[i >> 5] >> (i & 31)) & 1u)) x = x > 0.0f ? x / rp : x * rp;
        return x;
    };

    if (T <= 0.0f || V == 0) {
        float bv = 0.0f;
        long long bi = -1;
        for (kiln_u64 i = tid; i < V; i += nt) {
            const float x = value(i);
            if (argmax_beats(x, (long long)i, bv, bi)) bv = x, bi = (long long)i;
        }
        kiln_warp_reduce_pair(bv, bi, [](float a, long long ia, float b, long long ib) {
            return argmax_beats(a, ia, b, ib);
        });
        if ((tid & 31) == 0) warp_v[tid >> 5] = bv, warp_i[tid >> 5] = bi;
        __syncthreads();
        if (tid == 0) {
            for (unsigned wi = 1; wi < nt / 32; ++wi)
                if (argmax_beats(warp_v[wi], warp_i[wi], bv, bi)) bv = warp_v[wi], bi = warp_i[wi];
            token_s = bi < 0 ? 0 : bi;
        }
    } else {
        const kiln_u64 k = (top_k < 1.0f || (kiln_u64)top_k >= V) ? V : (kiln_u64)top_k;
        const auto key_of = [&](kiln_u64 i) { return sample_key(value(i) / T, i); };
        if (k > KILN_SAMPLE_MAX_CANDIDATES) {
            // The on-chip sort's key buffer is free on this path: it holds the mass bins, the
            // reductions' partials and the mass still to pass.
            double* mass = (double*)keys;                 // [256]
            double* warp_d = (double*)(keys + 256);       // [32]
            kiln_u64* warp_k = keys + 288;                // [32]
            double* remaining_d = (double*)(keys + 320);  // [1]
            // Candidates: the keys at or above the k-th largest (every key when k = V).
            kiln_u64 best = 0;
            for (kiln_u64 i = tid; i < V; i += nt) {
                const kiln_u64 key = key_of(i);
                best = key > best ? key : best;
            }
            const float top = sample_key_value(kiln_block_reduce_by(best, warp_k, kiln_op_max()));
            const kiln_u64 floor = k < V ? sample_kth_key(key_of, V, k, bins, &prefix_s, &remaining_s) : 0ull;
            const auto mass_from = [&](kiln_u64 lo) {
                double part = 0.0;
                for (kiln_u64 i = tid; i < V; i += nt) {
                    const kiln_u64 key = key_of(i);
                    if (key >= lo) part += exp((double)(sample_key_value(key) - top));
                }
                return kiln_block_reduce_by(part, warp_d, kiln_op_sum());
            };
            const double z = mass_from(floor);
            // top-p keeps the candidates down to the first whose running probability reaches
            // top_p; their mass is what the draw renormalizes by.
            kiln_u64 kept = floor;
            double kept_mass = z;
            if (top_p < 1.0f) {
                kept = sample_mass_select(key_of, V, floor, top, (double)top_p * z, false, mass, bins, &prefix_s,
                                          remaining_d);
                kept_mass = mass_from(kept);
            }
            const double r = kiln_philox_uniform((kiln_u64)seeds[b * 3], (unsigned)seeds[b * 3 + 2],
                                                 (kiln_u64)(p - seeds[b * 3 + 1]));
            const kiln_u64 chosen =
                sample_mass_select(key_of, V, kept, top, r * kept_mass, true, mass, bins, &prefix_s, remaining_d);
            if (tid == 0) token_s = (long long)(0xFFFFFFFFu - (unsigned)chosen);
        } else {
            // The k-th largest of the threads' best keys bounds the k-th largest key from below
            // (k threads each hold a key at least that large): gather every key above it, and
            // when they fit, sort them; the first k are the candidates in order.
            kiln_u64 best = 0;
            for (kiln_u64 i = tid; i < V; i += nt) {
                const kiln_u64 key = key_of(i);
                best = key > best ? key : best;
            }
            keys[tid] = best;
            __syncthreads();
            sample_sort_desc(keys, nt);
            const kiln_u64 bound = keys[k - 1];
            if (tid == 0) count_s = 0u;
            __syncthreads();
            for (kiln_u64 i = tid; i < V; i += nt) {
                const kiln_u64 key = key_of(i);
                if (key >= bound) {
                    const unsigned slot = atomicAdd(&count_s, 1u);
                    if (slot < KILN_SAMPLE_GATHER) keys[slot] = key;
                }
            }
            __syncthreads();
            unsigned n = count_s;
            if (n > KILN_SAMPLE_GATHER) {
                // Too many keys above the bound: gather exactly the k keys at or above the k-th
                // largest.
                const kiln_u64 threshold = sample_kth_key(key_of, V, k, bins, &prefix_s, &remaining_s);
                if (tid == 0) count_s = 0u;
                __syncthreads();
                for (kiln_u64 i = tid; i < V; i += nt) {
                    const kiln_u64 key = key_of(i);
                    if (key >= threshold) {
                        const unsigned slot = atomicAdd(&count_s, 1u);
                        if (slot < KILN_SAMPLE_GATHER) keys[slot] = key;
                    }
                }
                __syncthreads();
                n = count_s < KILN_SAMPLE_GATHER ? count_s : KILN_SAMPLE_GATHER;
            }
            unsigned width = 1;
            while (width < n) width <<= 1;
            for (unsigned j = n + tid; j < width; j += nt) keys[j] = 0ull;
            __syncthreads();
            sample_sort_desc(keys, width);
            n = n < (unsigned)k ? n : (unsigned)k;
            // The candidates' weights live past the first KILN_SAMPLE_MAX_CANDIDATES keys.
            double* w = (double*)(keys + KILN_SAMPLE_MAX_CANDIDATES);
            const float top = sample_key_value(keys[0]);
            for (unsigned j = tid; j < n; j += nt) w[j] = exp((double)(sample_key_value(keys[j]) - top));
            __syncthreads();
            if (tid == 0) {
                double sum = 0.0;
                for (unsigned j = 0; j < n; ++j) sum += w[j];
                prefix_s = __double_as_longlong(sum);
            }
            __syncthreads();
            const double sum = __longlong_as_double(prefix_s);
            for (unsigned j = tid; j < n; j += nt) w[j] /= sum;
            __syncthreads();
            if (tid == 0) {
                unsigned kept = n;
                if (top_p < 1.0f) {
                    double acc = 0.0;
                    for (unsigned j = 0; j < n; ++j) {
                        acc += w[j];
                        if (acc >= (double)top_p) {
                            kept = j + 1;
                            break;
                        }
                    }
                    double s = 0.0;
                    for (unsigned j = 0; j < kept; ++j) s += w[j];
                    for (unsigned j = 0; j < kept; ++j) w[j] /= s;
                }
                const double r = kiln_philox_uniform((kiln_u64)seeds[b * 3], (unsigned)seeds[b * 3 + 2],
                                                     (kiln_u64)(p - seeds[b * 3 + 1]));
                double acc = 0.0;
                unsigned chosen = kept - 1;
                for (unsigned j = 0; j < kept; ++j) {
                    acc += w[j];
                    if (r < acc) {
                        chosen = j;
                        break;
                    }
                }
                token_s = (long long)(0xFFFFFFFFu - (unsigned)keys[chosen]);
            }
        }
    }
    __syncthreads();
    if (tid == 0) {
        ids[b] = token_s;
        if (p >= 0 && (kiln_u64)p < L) hist_out[b * L + (kiln_u64)p] = token_s;
    }
}

template <typename Tag>
__global__ void __launch_bounds__(KILN_SAMPLE_THREADS)
    kiln_sample(const typename Tag::storage* logits, const long long* mask, const long long* hist, const long long* pos,
                const float* params, const long long* seeds, long long* ids, long long* hist_out, kiln_u64 S,
                kiln_u64 V, kiln_u64 L, kiln_status* st) {
    sample_row<Tag>(logits, mask, hist, pos, params, seeds, ids, hist_out, S, V, L, st);
}

// kiln-rnn CUDA kernel: ONNX's RNN, GRU and LSTM (shim/src/lib.rs holds the CPU reference and
// the equations). One block per (direction, batch row), every time step inside the block: the
// state in shared memory, each thread the hidden units j = threadIdx.x + k·blockDim.x, sums in
// f32. Argument order matches the shim's `launch`.
#include "kiln.cuh"

enum { RNN_CELL = 0, GRU_CELL = 1, LSTM_CELL = 2 };
enum { ACT_SIGMOID = 0, ACT_TANH = 1, ACT_RELU = 2 };
// flags bits: 0 B, 1 sequence_lens, 2 initial_h, 3 initial_c, 4 P, 5 Y, 6 Y_h, 7 Y_c, 8 layout,
// 9 linear_before_reset, 10 input_forget, 11 + d: direction d runs in reverse.

__device__ __forceinline__ float rnn_act(unsigned a, float x) {
    if (a == ACT_SIGMOID) return 1.f / (1.f + expf(-x));
    if (a == ACT_TANH) return tanhf(x);
    return fmaxf(x, 0.f);
}

template <typename Tag>
__device__ __forceinline__ float rnn_dot(const typename Tag::storage* row, const float* v, unsigned n) {
    float s = 0.f;
    for (unsigned i = 0; i < n; ++i) s += kiln_to_f32(Tag(), row[i]) * v[i];
    return s;
}

template <typename Tag>
__global__ void kiln_rnn(const typename Tag::storage* x, const typename Tag::storage* w,
                         const typename Tag::storage* r, const typename Tag::storage* bias, const int* lens,
                         const typename Tag::storage* h0, const typename Tag::storage* c0,
                         const typename Tag::storage* peep, typename Tag::storage* y, typename Tag::storage* yh,
                         typename Tag::storage* yc, unsigned cell, unsigned S, unsigned B, unsigned I, unsigned H,
                         unsigned D, unsigned act0, unsigned act1, float clip, unsigned flags, kiln_status* st) {
    typedef typename Tag::storage T;
    extern __shared__ float rnn_sm[];
    float *h = rnn_sm, *c = h + H, *hn = c + H, *rh = hn + H;  // 4·H floats
    const unsigned d = blockIdx.x, G = cell == RNN_CELL ? 1 : (cell == GRU_CELL ? 3 : 4), GH = G * H;
    const bool layout = flags >> 8 & 1, lbr = flags >> 9 & 1, coupled = flags >> 10 & 1, rev = flags >> (11 + d) & 1;
    const unsigned acts = d == 0 ? act0 : act1, fa = acts & 15, ga = acts >> 4 & 15, ha = acts >> 8 & 15;
    const T* wd = w + (kiln_u64)d * GH * I;
    const T* rd = r + (kiln_u64)d * GH * H;
    const auto bw = [&](unsigned k) { return flags & 1 ? kiln_to_f32(Tag(), bias[(kiln_u64)d * 2 * GH + k]) : 0.f; };
    const auto br = [&](unsigned k) { return flags & 1 ? kiln_to_f32(Tag(), bias[(kiln_u64)d * 2 * GH + GH + k]) : 0.f; };
    const auto pe = [&](unsigned k, unsigned j) {
        return flags >> 4 & 1 ? kiln_to_f32(Tag(), peep[(kiln_u64)d * 3 * H + k * H + j]) : 0.f;
    };
    const auto cl = [&](float v) { return clip > 0.f ? fminf(fmaxf(v, -clip), clip) : v; };
    const auto y_at = [&](unsigned t, unsigned b) {
        return (layout ? ((kiln_u64)b * S + t) * D + d : ((kiln_u64)t * D + d) * B + b) * H;
    };
    for (unsigned b = blockIdx.y; b < B; b += gridDim.y) {
        const kiln_u64 s0 = (layout ? (kiln_u64)b * D + d : (kiln_u64)d * B + b) * H;
        long long len = flags >> 1 & 1 ? lens[b] : (long long)S;
        if (len < 0 || len > (long long)S) {
            if (threadIdx.x == 0 && d == 0) kiln_fail(st, 1, b, len, S);
            len = len < 0 ? 0 : S;
        }
        for (unsigned j = threadIdx.x; j < H; j += blockDim.x) {
            h[j] = flags >> 2 & 1 ? kiln_to_f32(Tag(), h0[s0 + j]) : 0.f;
            c[j] = flags >> 3 & 1 ? kiln_to_f32(Tag(), c0[s0 + j]) : 0.f;
        }
        __syncthreads();
        for (unsigned step = 0; step < (unsigned)len; ++step) {
            const unsigned t = rev ? (unsigned)len - 1 - step : step;
            const T* xt = x + (layout ? (kiln_u64)b * S + t : (kiln_u64)t * B + b) * I;
            // The gates' input parts, X·Wᵀ + Wb, need X's row: each thread reads it from global memory.
            const auto xw = [&](unsigned k) {
                float s = bw(k);
                const T* row = wd + (kiln_u64)k * I;
                for (unsigned i = 0; i < I; ++i) s += kiln_to_f32(Tag(), row[i]) * kiln_to_f32(Tag(), xt[i]);
                return s;
            };
            const auto hr = [&](unsigned k) { return br(k) + rnn_dot<Tag>(rd + (kiln_u64)k * H, h, H); };
            for (unsigned j = threadIdx.x; j < H; j += blockDim.x) {
                if (cell == RNN_CELL) {
                    hn[j] = rnn_act(fa, cl(xw(j) + hr(j)));
                } else if (cell == LSTM_CELL) {
                    const float i = rnn_act(fa, cl(xw(j) + hr(j) + pe(0, j) * c[j]));
                    const float f = coupled ? 1.f - i : rnn_act(fa, cl(xw(2 * H + j) + hr(2 * H + j) + pe(2, j) * c[j]));
                    const float cc = rnn_act(ga, cl(xw(3 * H + j) + hr(3 * H + j)));
                    c[j] = f * c[j] + i * cc;
                    const float o = rnn_act(fa, cl(xw(H + j) + hr(H + j) + pe(1, j) * c[j]));
                    hn[j] = o * rnn_act(ha, c[j]);
                } else {
                    // GRU, phase 1: z into hn, r ⊙ H (or r, with linear_before_reset) into rh.
                    const float z = rnn_act(fa, cl(xw(j) + hr(j)));
                    const float rg = rnn_act(fa, cl(xw(H + j) + hr(H + j)));
                    hn[j] = z;
                    rh[j] = lbr ? rg : rg * h[j];
                }
            }
            __syncthreads();
            if (cell == GRU_CELL) {
                // Phase 2: h̃ from the whole r ⊙ H, then the new state.
                for (unsigned j = threadIdx.x; j < H; j += blockDim.x) {
                    const unsigned k = 2 * H + j;
                    const float rec = lbr ? rh[j] * hr(k) : br(k) + rnn_dot<Tag>(rd + (kiln_u64)k * H, rh, H);
                    const float ht = rnn_act(ga, cl(xw(k) + rec));
                    const float z = hn[j];
                    hn[j] = (1.f - z) * ht + z * h[j];
                }
                __syncthreads();
            }
            for (unsigned j = threadIdx.x; j < H; j += blockDim.x) {
                h[j] = hn[j];
                if (flags >> 5 & 1) y[y_at(t, b) + j] = kiln_from_f32(Tag(), hn[j]);
            }
            __syncthreads();
        }
        for (unsigned j = threadIdx.x; j < H; j += blockDim.x) {
            if (flags >> 5 & 1)
                for (unsigned t = (unsigned)len; t < S; ++t) y[y_at(t, b) + j] = kiln_from_f32(Tag(), 0.f);
            // A row of no step ends at 0, as onnxruntime gives (and the CPU reference).
            if (flags >> 6 & 1) yh[s0 + j] = kiln_from_f32(Tag(), len > 0 ? h[j] : 0.f);
            if (flags >> 7 & 1) yc[s0 + j] = kiln_from_f32(Tag(), len > 0 ? c[j] : 0.f);
        }
        __syncthreads();
    }
}

// kiln-loss CUDA kernels: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss (shim/src/lib.rs
// gives the semantics). x is [N, C, D] (D = d1 · … · dk), target [N, D]; A is kiln_elem's
// compute type (f32; f64 for float64).
#include "kiln.cuh"
#include "kiln-cuda-std/elem.cuh"
#include "kiln-cuda-std/math.cuh"
#include "kiln-cuda-std/reduce.cuh"

// One thread per position (n, d): the log-softmax over the classes first for
// SoftmaxCrossEntropyLoss (written to log_prob when has_log_prob: each thread its own column),
// then −log_prob[target] · w, written to loss (reduction none) or, with w, to partial
// ([positions] losses, then [positions] weights) for kiln_loss_sum. A target outside [0, C) that
// is not ignore_index fails the node (status code 1, or 2 for SoftmaxCrossEntropyLoss, with the
// target and C).
template <typename Tag>
__global__ void kiln_loss(const typename Tag::storage* x, const void* target, const typename Tag::storage* weight,
                          typename Tag::storage* log_prob, typename Tag::storage* loss,
                          typename kiln_elem<Tag>::C* partial, kiln_u64 N, kiln_u64 C, kiln_u64 D, unsigned softmax,
                          unsigned has_weight, unsigned has_ignore, long long ignore, unsigned has_log_prob,
                          unsigned target64, unsigned reduction, kiln_status* st) {
    typedef kiln_elem<Tag> E;
    typedef typename E::C A;
    const kiln_u64 positions = N * D;
    KILN_FOR(i, positions) {
        const kiln_u64 n = i / D, d = i - n * D;
        const typename Tag::storage* xc = x + n * C * D + d;  // class k at xc[k * D]
        const long long t = target64 ? ((const long long*)target)[i] : (long long)((const int*)target)[i];
        A lse = A(0);
        if (softmax) {
            A m = kiln_neg_inf<A>();
            for (kiln_u64 k = 0; k < C; ++k) m = kiln_max_nan(m, E::ld(xc[k * D]));
            A s = A(0);
            for (kiln_u64 k = 0; k < C; ++k) s += kiln_exp(E::ld(xc[k * D]) - m);
            lse = m + kiln_log(s);
            if (has_log_prob)
                for (kiln_u64 k = 0; k < C; ++k) log_prob[n * C * D + k * D + d] = E::st(E::ld(xc[k * D]) - lse);
        }
        A l = A(0), w = A(0);
        if (!(has_ignore && t == ignore)) {
            if (t < 0 || (kiln_u64)t >= C) {
                kiln_fail(st, softmax ? 2u : 1u, t, (long long)C);
                l = A(0) / A(0);
            } else {
                w = has_weight ? E::ld(weight[t]) : A(1);
                l = -(E::ld(xc[(kiln_u64)t * D]) - lse) * w;
            }
        }
        if (reduction == 0) {
            loss[i] = E::st(l);
        } else {
            partial[i] = l;
            partial[positions + i] = w;
        }
    }
}

// One block of 1024 threads: loss[0] = Σ losses (over Σ weights when mean), in warp order.
template <typename Tag>
__global__ void __launch_bounds__(1024)
    kiln_loss_sum(const typename kiln_elem<Tag>::C* partial, typename Tag::storage* loss, kiln_u64 positions,
                  unsigned mean) {
    typedef kiln_elem<Tag> E;
    typedef typename E::C A;
    __shared__ A red[32];
    A l = A(0), w = A(0);
    for (kiln_u64 i = threadIdx.x; i < positions; i += blockDim.x) {
        l += partial[i];
        w += partial[positions + i];
    }
    l = kiln_block_reduce_by(l, red, kiln_op_sum());
    w = kiln_block_reduce_by(w, red, kiln_op_sum());
    if (threadIdx.x == 0) loss[0] = E::st(mean ? l / w : l);
}

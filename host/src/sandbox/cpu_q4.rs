//! 4-bit weight kernels for the `qgemm` import (AVX2 + FMA, chosen at run time): two values per
//! byte, the low nibble first, so the little-endian u32 at byte 4t of a block holds its values
//! 8t..8t + 8 at bits 0, 4, …, 28. A broadcast, a per-lane shift and a mask unpack eight at once.
//!
//! Each function returns false, computing nothing, where the CPU lacks AVX2 or FMA or a block is
//! not a whole number of 8-value groups; the caller then takes its portable path.

/// One row of A against four weight rows: `x` (kb · block values); per weight row r, its blocks
/// `rows[r]` (kb of block / 2 bytes), `scales[r]` and `zeros[r]` (kb values each).
pub(super) struct Four<'a> {
    pub x: &'a [f32],
    pub rows: [&'a [u8]; 4],
    pub scales: [&'a [f32]; 4],
    pub zeros: [&'a [f32]; 4],
}

/// `dots[r] = Σ_j scale_rj · Σ_t (q_r[j·block + t] − zero_rj) · x[j·block + t]`. The zero
/// point is taken from each value before the product (exact for integer zero points), not from
/// the block's sum after it, which cancels away low bits when the values sit far from zero.
pub(super) fn dots4(f: &Four, block: usize, dots: &mut [f32; 4]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if usable(block) {
        let kb = f.x.len() / block;
        assert!(
            f.rows.iter().all(|r| r.len() >= kb * block / 2) && f.scales.iter().chain(&f.zeros).all(|s| s.len() >= kb)
        );
        // SAFETY: the CPU has AVX2 and FMA (`usable`); the extents were checked above.
        unsafe { avx2::dots4(f, block, dots) };
        return true;
    }
    let _ = (f, block, dots);
    false
}

/// One weight row against up to [`MAX_ROWS`] rows of A: `xs[i]` (kb · block values each); the
/// weight row's blocks `row` (kb of block / 2 bytes), `scales` and `zeros` (kb values each).
pub(super) struct Rows<'a> {
    pub xs: &'a [&'a [f32]],
    pub row: &'a [u8],
    pub scales: &'a [f32],
    pub zeros: &'a [f32],
}

/// `out[i] = Σ_j scale_j · Σ_t (q[j·block + t] − zero_j) · xs[i][j·block + t]` (as [`dots4`]):
/// each group of eight weights is unpacked once for all the rows.
pub(super) fn dots_rows(r: &Rows, block: usize, out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if usable(block) && (1..=MAX_ROWS).contains(&r.xs.len()) {
        let kb = r.scales.len();
        assert!(
            r.row.len() >= kb * block / 2
                && r.zeros.len() >= kb
                && out.len() >= r.xs.len()
                && r.xs.iter().all(|x| x.len() >= kb * block)
        );
        // SAFETY: the CPU has AVX2 and FMA (`usable`); the extents were checked above.
        unsafe {
            match r.xs.len() {
                1 => avx2::rows::<1>(r, block, out),
                2 => avx2::rows::<2>(r, block, out),
                3 => avx2::rows::<3>(r, block, out),
                4 => avx2::rows::<4>(r, block, out),
                5 => avx2::rows::<5>(r, block, out),
                6 => avx2::rows::<6>(r, block, out),
                7 => avx2::rows::<7>(r, block, out),
                _ => avx2::rows::<8>(r, block, out),
            }
        }
        return true;
    }
    let _ = (r, block, out);
    false
}

/// Rows of A [`dots_rows`] takes at once.
pub(super) const MAX_ROWS: usize = 8;

/// One weight row dequantized: `out[j·block + t] = scales[j] · (q[j·block + t] − zeros[j])`
/// (`row`: kb blocks of block / 2 bytes; `scales`, `zeros`: kb values; `out`: kb · block).
pub(super) fn dequantize(row: &[u8], scales: &[f32], zeros: &[f32], block: usize, out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    if usable(block) {
        let kb = out.len() / block;
        assert!(row.len() >= kb * block / 2 && scales.len() >= kb && zeros.len() >= kb);
        // SAFETY: the CPU has AVX2 and FMA (`usable`); the extents were checked above.
        unsafe { avx2::dequantize(row, scales, zeros, block, out) };
        return true;
    }
    let _ = (row, scales, zeros, block, out);
    false
}

/// Whether the AVX2 kernels serve blocks of `block` values on this CPU.
#[cfg(target_arch = "x86_64")]
fn usable(block: usize) -> bool {
    use std::sync::OnceLock;
    static AVX2: OnceLock<bool> = OnceLock::new();
    block.is_multiple_of(8)
        && *AVX2.get_or_init(|| std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"))
}

// The kernels index several register arrays in lockstep (accumulators, rows, scales).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod avx2 {
    use std::arch::x86_64::*;

    /// How many weight rows ahead [`dots4`] prefetches: the weights of a decode step (tens of
    /// MB) come from DRAM, and the hardware prefetcher alone leaves the kernel waiting on them
    /// (1.6× slower over 66 MB on a Sapphire Rapids VM).
    const PREFETCH_ROWS: usize = 8;

    /// Values 8t..8t + 8 of the block at `p` as f32 lanes.
    #[inline(always)]
    unsafe fn eight(p: *const u8, t: usize) -> __m256 {
        let word = (p.add(4 * t) as *const i32).read_unaligned();
        let shifted = _mm256_srlv_epi32(_mm256_set1_epi32(word), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
        _mm256_cvtepi32_ps(_mm256_and_si256(shifted, _mm256_set1_epi32(15)))
    }

    /// [`eight`] less the zero point `zero` (broadcast).
    #[inline(always)]
    unsafe fn centered(p: *const u8, t: usize, zero: __m256) -> __m256 {
        _mm256_sub_ps(eight(p, t), zero)
    }

    /// The sum of the eight lanes.
    #[inline(always)]
    unsafe fn sum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// See [`super::dots4`]; the caller checked the extents and the CPU.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dots4(f: &super::Four, block: usize, dots: &mut [f32; 4]) {
        let kb = f.x.len() / block;
        let mut total = [_mm256_setzero_ps(); 4];
        for j in 0..kb {
            let xb = f.x.as_ptr().add(j * block);
            if (j * block / 2).is_multiple_of(64) {
                // The same line of the weight rows eight rows on: the rows follow one another in
                // B, so the next tasks' weights stream in ahead of their use (a prefetch never
                // faults, wherever it points).
                let ahead = PREFETCH_ROWS * kb * block / 2;
                for r in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(f.rows[r].as_ptr().wrapping_add(j * block / 2 + ahead) as *const i8);
                }
            }
            let mut acc = [_mm256_setzero_ps(); 4];
            let zero = [0, 1, 2, 3].map(|r| _mm256_set1_ps(*f.zeros[r].get_unchecked(j)));
            for t in 0..block / 8 {
                let xv = _mm256_loadu_ps(xb.add(8 * t));
                for r in 0..4 {
                    acc[r] = _mm256_fmadd_ps(centered(f.rows[r].as_ptr().add(j * block / 2), t, zero[r]), xv, acc[r]);
                }
            }
            for r in 0..4 {
                total[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(*f.scales[r].get_unchecked(j)), total[r]);
            }
        }
        for r in 0..4 {
            dots[r] = sum(total[r]);
        }
    }

    /// See [`super::dots_rows`]; `R` is `xs.len()`; the caller checked the extents and the CPU.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rows<const R: usize>(r: &super::Rows, block: usize, out: &mut [f32]) {
        let super::Rows { xs, row, scales, zeros } = *r;
        let kb = scales.len();
        let xp: [*const f32; R] = core::array::from_fn(|i| xs[i].as_ptr());
        let mut total = [_mm256_setzero_ps(); R];
        for j in 0..kb {
            let p = row.as_ptr().add(j * block / 2);
            if (j * block / 2).is_multiple_of(64) {
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_ROWS * kb * block / 2) as *const i8);
            }
            let mut acc = [_mm256_setzero_ps(); R];
            let zero = _mm256_set1_ps(*zeros.get_unchecked(j));
            for t in 0..block / 8 {
                let w = centered(p, t, zero);
                for i in 0..R {
                    acc[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xp[i].add(j * block + 8 * t)), acc[i]);
                }
            }
            let scale = _mm256_set1_ps(*scales.get_unchecked(j));
            for i in 0..R {
                total[i] = _mm256_fmadd_ps(acc[i], scale, total[i]);
            }
        }
        for i in 0..R {
            out[i] = sum(total[i]);
        }
    }

    /// See [`super::dequantize`]; the caller checked the extents and the CPU.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dequantize(row: &[u8], scales: &[f32], zeros: &[f32], block: usize, out: &mut [f32]) {
        let kb = out.len() / block;
        for j in 0..kb {
            let (scale, zero) = (_mm256_set1_ps(*scales.get_unchecked(j)), _mm256_set1_ps(*zeros.get_unchecked(j)));
            let p = row.as_ptr().add(j * block / 2);
            let o = out.as_mut_ptr().add(j * block);
            for t in 0..block / 8 {
                // scale · (q − zero), as the portable path rounds it.
                _mm256_storeu_ps(o.add(8 * t), _mm256_mul_ps(centered(p, t, zero), scale));
            }
        }
    }
}

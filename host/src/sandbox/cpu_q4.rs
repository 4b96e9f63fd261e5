//! 4-bit weight kernels for the `qgemm` import (AVX2 + FMA, and AVX-512 for one row of A, chosen
//! at run time): two values per byte, the low nibble first, so the little-endian u32 at byte 4t
//! of a block holds its values 8t..8t + 8 at bits 0, 4, …, 28. A broadcast, a per-lane shift and
//! a mask unpack eight at once (sixteen with AVX-512: the u64 at byte 8t broadcast, each 32-bit
//! lane shifted by its place).
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
        if wide(block) {
            // SAFETY: the CPU has AVX-512F (`wide`); the extents were checked above.
            unsafe { avx512::dots4(f, block, dots) };
        } else {
            // SAFETY: the CPU has AVX2 and FMA (`usable`); the extents were checked above.
            unsafe { avx2::dots4(f, block, dots) };
        }
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

/// How many weight rows ahead the kernels prefetch (here and in [`super::cpu_q4i8`]): the
/// weights of a decode step (tens of MB) come from DRAM, and the hardware prefetcher alone leaves
/// a kernel waiting on them (1.6× slower over 66 MB on a Sapphire Rapids VM).
pub(super) const PREFETCH_ROWS: usize = 8;

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

/// Whether the AVX-512 kernel serves blocks of `block` values on this CPU (whole 16-value
/// groups). On Intel cores with two 512-bit FMA ports it does twice the AVX2 kernel's work per
/// instruction; AMD's Zen 4 splits each 512-bit operation in two, where it gains little.
#[cfg(target_arch = "x86_64")]
fn wide(block: usize) -> bool {
    use std::sync::OnceLock;
    static AVX512: OnceLock<bool> = OnceLock::new();
    block.is_multiple_of(16)
        && *AVX512.get_or_init(|| {
            std::env::var_os("KILN_CPU_NO_AVX512").is_none() && std::is_x86_feature_detected!("avx512f")
        })
}

// The kernels index several register arrays in lockstep (accumulators, rows, scales).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod avx512 {
    use std::arch::x86_64::*;

    /// 2²³ as f32: its bits OR a value v < 2²³ into the mantissa give 2²³ + v exactly.
    const MAGIC: f32 = 8_388_608.0;

    /// Values 16t..16t + 16 of the block at `p` plus 2²³ as f32 lanes (exact: the value is set
    /// into the mantissa of [`MAGIC`], no conversion), interleaved: lane 2i holds value 16t + i and
    /// lane 2i + 1 value 16t + 8 + i (the u64 at byte 8t broadcast: its low u32 holds the first
    /// eight, its high u32 the last eight, each lane pair shifted by 4i).
    #[inline(always)]
    unsafe fn sixteen_magic(p: *const u8, t: usize) -> __m512 {
        let word = (p.add(8 * t) as *const i64).read_unaligned();
        let shifts = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
        let v = _mm512_srlv_epi32(_mm512_set1_epi64(word), shifts);
        // (v & 15) | bits(2²³) in one instruction.
        let m = _mm512_ternarylogic_epi32::<0xEA>(v, _mm512_set1_epi32(15), _mm512_set1_epi32(MAGIC.to_bits() as i32));
        _mm512_castsi512_ps(m)
    }

    /// See [`super::dots4`]; the caller checked the extents and the CPU. The activations are
    /// loaded sixteen at a time and put in [`sixteen_magic`]'s order once for the four rows. A
    /// weight less its zero point z is (2²³ + q) − (2²³ + z): exact, as q − z is, where z is a
    /// whole number (the 4-bit zero points and the default 8); otherwise (2²³ + q) − 2²³ = q, then
    /// q − z rounded once, as the AVX2 kernel rounds it.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dots4(f: &super::Four, block: usize, dots: &mut [f32; 4]) {
        let kb = f.x.len() / block;
        let order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
        let magic = _mm512_set1_ps(MAGIC);
        let mut total = [_mm512_setzero_ps(); 4];
        for j in 0..kb {
            let xb = f.x.as_ptr().add(j * block);
            if (j * block / 2).is_multiple_of(64) {
                // As the AVX2 kernel: the same line of the weight rows eight rows on.
                let ahead = super::avx2::PREFETCH_ROWS * kb * block / 2;
                for r in 0..4 {
                    _mm_prefetch::<_MM_HINT_T0>(f.rows[r].as_ptr().wrapping_add(j * block / 2 + ahead) as *const i8);
                }
            }
            // Plain loops, not array maps: those stayed calls in this loop.
            let mut acc = [_mm512_setzero_ps(); 4];
            let (mut z, mut p) = ([0f32; 4], [core::ptr::null::<u8>(); 4]);
            let mut whole = true;
            for r in 0..4 {
                z[r] = *f.zeros[r].get_unchecked(j);
                p[r] = f.rows[r].as_ptr().add(j * block / 2);
                whole &= z[r].fract() == 0.0 && z[r].abs() < MAGIC / 2.0;
            }
            if whole {
                let mut shifted = [_mm512_setzero_ps(); 4];
                for r in 0..4 {
                    shifted[r] = _mm512_set1_ps(MAGIC + z[r]);
                }
                for t in 0..block / 16 {
                    let xv = _mm512_permutexvar_ps(order, _mm512_loadu_ps(xb.add(16 * t)));
                    for r in 0..4 {
                        acc[r] = _mm512_fmadd_ps(_mm512_sub_ps(sixteen_magic(p[r], t), shifted[r]), xv, acc[r]);
                    }
                }
            } else {
                let mut zero = [_mm512_setzero_ps(); 4];
                for r in 0..4 {
                    zero[r] = _mm512_set1_ps(z[r]);
                }
                for t in 0..block / 16 {
                    let xv = _mm512_permutexvar_ps(order, _mm512_loadu_ps(xb.add(16 * t)));
                    for r in 0..4 {
                        let q = _mm512_sub_ps(sixteen_magic(p[r], t), magic);
                        acc[r] = _mm512_fmadd_ps(_mm512_sub_ps(q, zero[r]), xv, acc[r]);
                    }
                }
            }
            for r in 0..4 {
                total[r] = _mm512_fmadd_ps(acc[r], _mm512_set1_ps(*f.scales[r].get_unchecked(j)), total[r]);
            }
        }
        for r in 0..4 {
            dots[r] = _mm512_reduce_add_ps(total[r]);
        }
    }
}

// The kernels index several register arrays in lockstep (accumulators, rows, scales).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    pub(super) use super::PREFETCH_ROWS;

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

    /// The sum of the eight lanes (also [`super::super::cpu_q4i8`]'s).
    #[inline(always)]
    pub(in crate::sandbox) unsafe fn sum(v: __m256) -> f32 {
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
            let mut zero = [_mm256_setzero_ps(); 4];
            for r in 0..4 {
                zero[r] = _mm256_set1_ps(*f.zeros[r].get_unchecked(j));
            }
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

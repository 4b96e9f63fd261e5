//! 4-bit weights against int8 activations, for the `qgemm` import at MatMulNBits'
//! `accuracy_level` 4 (ABI.md §6.6), as onnxruntime's CPU provider computes that level
//! (MLAS's `CompInt8`): each block of a row of A (`block` values, a multiple of 32) is quantized
//! to int8 with scale `max|a| / 127` as `round(a · (127 / max|a|))` (ties to even; a block of
//! zeros quantizes to zeros with scale 0), each block's product is an exact integer sum
//! `Σ q_a · q_w`, and the row's result is `Σ_b scale_w · scale_a · (Σ q_a · q_w − zero_w · Σ q_a)`
//! in f32.
//!
//! Kernels, chosen at run time: AVX-512 VNNI (`vpdpbusd`, 64 products an instruction), AVX2
//! (`vpmaddubsw` and `vpmaddwd`), and a portable one. They sum the same integers; only the f32
//! sums of blocks may round differently.
//!
//! Layout: a 32-value chunk of a weight row is 16 bytes, value 2j in the low nibble of byte j
//! and value 2j + 1 in its high nibble. [`QuantizedA`] stores each chunk of A as its 16
//! even-indexed values, then its 16 odd-indexed ones, so that a chunk's low nibbles, then its high
//! ones, line up with it byte for byte.

/// Values of one chunk: a 16-byte load of 4-bit weights.
pub(super) const CHUNK: usize = 32;

/// Rows of A quantized to int8 per block, in the chunk order of the module doc.
pub(super) struct QuantizedA {
    /// Rows × chunks × 32 values, each chunk's even-indexed values then its odd ones.
    q: Vec<i8>,
    /// The scale of each chunk's block, rows × chunks (a block of 64 repeats its scale for its two
    /// chunks).
    chunk_scales: Vec<f32>,
    /// Per row, chunk and group of four values (in the stored order), their sum: rows × chunks ×
    /// 8. The zero points' term `zero · Σ q_a` starts each integer sum at `−zero` times these.
    quad_sums: Vec<i32>,
    /// Rows.
    rows: usize,
    /// Chunks per row (`blocks << shift`).
    chunks: usize,
    /// Blocks per row.
    blocks: usize,
    /// log2 of the chunks a block: chunk c lies in block `c >> shift`.
    shift: u32,
}

/// `v` rounded to the nearest whole number, ties to even, for |v| < 2²² (the default rounding of
/// a sum with 1.5 · 2²³, whose ulp is 1): `round_ties_even` stays a call to `rintf` here.
fn round_even(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    if v.abs() < 4_194_304.0 {
        (v + MAGIC) - MAGIC
    } else {
        v
    }
}

impl QuantizedA {
    /// Quantizes the `m` rows of `a` (m × k) in blocks of `block` values (a power of two, a
    /// multiple of [`CHUNK`]); values past k are zeros. A NaN in a block counts as 0 (its
    /// maximum skips it, and it quantizes to 0), where the f32 product would give NaN.
    pub fn new(a: &[f32], m: usize, k: usize, block: usize) -> QuantizedA {
        assert!(block.is_multiple_of(CHUNK) && block.is_power_of_two() && a.len() >= m * k);
        let blocks = k.div_ceil(block);
        let chunks = blocks * block / CHUNK;
        let mut q = vec![0i8; m * chunks * CHUNK];
        let mut chunk_scales = vec![0f32; m * chunks];
        let mut quad_sums = vec![0i32; m * chunks * CHUNK / 4];
        let mut values = vec![0i8; block];
        for i in 0..m {
            let row = &a[i * k..(i + 1) * k];
            for b in 0..blocks {
                let src = &row[b * block..((b + 1) * block).min(k)];
                let amax = src.iter().fold(0f32, |m, v| m.max(v.abs()));
                let scale = amax / 127.0;
                let inverse = if amax != 0.0 { 127.0 / amax } else { 0.0 };
                values.fill(0);
                for (v, x) in values.iter_mut().zip(src) {
                    // |x · inverse| ≤ 127 up to rounding: the clamp only guards a NaN or an ulp.
                    *v = round_even(x * inverse).clamp(-127.0, 127.0) as i8;
                }
                let per = block / CHUNK;
                for (c, vals) in values.chunks_exact(CHUNK).enumerate() {
                    let chunk = i * chunks + b * per + c;
                    chunk_scales[chunk] = scale;
                    let dst = &mut q[chunk * CHUNK..(chunk + 1) * CHUNK];
                    for j in 0..CHUNK / 2 {
                        dst[j] = vals[2 * j];
                        dst[CHUNK / 2 + j] = vals[2 * j + 1];
                    }
                    for (t, quad) in dst.chunks_exact(4).enumerate() {
                        quad_sums[chunk * CHUNK / 4 + t] = quad.iter().map(|&v| v as i32).sum();
                    }
                }
            }
        }
        QuantizedA { q, chunk_scales, quad_sums, rows: m, chunks, blocks, shift: (block / CHUNK).trailing_zeros() }
    }

    /// Row i's quantized chunks.
    fn row(&self, i: usize) -> &[i8] {
        &self.q[i * self.chunks * CHUNK..(i + 1) * self.chunks * CHUNK]
    }

    /// Row i's chunk scales.
    fn scales(&self, i: usize) -> &[f32] {
        &self.chunk_scales[i * self.chunks..(i + 1) * self.chunks]
    }

    /// Row i's sums of four.
    fn quads(&self, i: usize) -> &[i32] {
        &self.quad_sums[i * self.chunks * CHUNK / 4..(i + 1) * self.chunks * CHUNK / 4]
    }
}

/// Consecutive 4-bit weight rows, row after row: `rows` rows of `chunks · 16` bytes (`chunks` of
/// A), and per row `blocks` scales and whole-number zero points.
#[derive(Clone, Copy)]
pub(super) struct WeightRows<'a> {
    pub bytes: &'a [u8],
    pub scales: &'a [f32],
    pub zeros: &'a [f32],
    pub rows: usize,
    /// Every zero point, where they are all this one (MatMulNBits' default 8): the kernels then
    /// start each pair of chunks' sums once for all rows.
    pub zero: Option<f32>,
}

/// `out[r · rows_a + i]`, for each weight row r of `w` and each row i of A (`a_rows` of
/// `a`, at most 4): the row's product (module doc), in A's blocks.
pub(super) fn dots(a: &QuantizedA, a_rows: std::ops::Range<usize>, w: &WeightRows, out: &mut [f32]) {
    assert!(
        a_rows.len() <= 4
            && a_rows.end <= a.rows
            && a.chunks == a.blocks << a.shift
            && out.len() >= w.rows * a_rows.len()
            && w.bytes.len() >= w.rows * a.chunks * CHUNK / 2
            && w.scales.len() >= w.rows * a.blocks
            && w.zeros.len() >= w.rows * a.blocks
    );
    kernel().run(a, a_rows, w, a.shift, out);
}

/// A kernel of [`dots`]: `out[r · rows_a + i] = Σ_c scale_w · scale_a · Σ q_a · (q_w − zero_w)`
/// over chunks c, chunk c's block `c >> shift`.
#[derive(Clone, Copy)]
enum Kernel {
    Portable,
    #[cfg(target_arch = "x86_64")]
    X86(x86::Simd),
}

impl Kernel {
    fn run(self, a: &QuantizedA, a_rows: std::ops::Range<usize>, w: &WeightRows, shift: u32, out: &mut [f32]) {
        match self {
            Kernel::Portable => portable(a, a_rows, w, shift, out),
            #[cfg(target_arch = "x86_64")]
            Kernel::X86(simd) => x86::dots(simd, a, a_rows, w, shift, out),
        }
    }
}

/// The fastest kernel this CPU runs (`KILN_CPU_NO_AVX512` leaves the AVX-512 one out, as for the
/// f32 kernels).
fn kernel() -> Kernel {
    use std::sync::OnceLock;
    static KERNEL: OnceLock<Kernel> = OnceLock::new();
    *KERNEL.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::env::var_os("KILN_CPU_NO_AVX512").is_none()
                && std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512vnni")
            {
                return Kernel::X86(x86::Simd::Vnni);
            }
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Kernel::X86(x86::Simd::Avx2);
            }
        }
        Kernel::Portable
    })
}

/// The portable kernel: chunk by chunk in i32, then f32.
fn portable(a: &QuantizedA, a_rows: std::ops::Range<usize>, w: &WeightRows, shift: u32, out: &mut [f32]) {
    let n_a = a_rows.len();
    let row_bytes = a.chunks * CHUNK / 2;
    for r in 0..w.rows {
        let (bytes, scales, zeros) = (
            &w.bytes[r * row_bytes..(r + 1) * row_bytes],
            &w.scales[r * a.blocks..(r + 1) * a.blocks],
            &w.zeros[r * a.blocks..(r + 1) * a.blocks],
        );
        for (i, ai) in a_rows.clone().enumerate() {
            let (qa, sa) = (a.row(ai), a.scales(ai));
            let mut total = 0f32;
            for c in 0..a.chunks {
                let bytes = &bytes[c * CHUNK / 2..(c + 1) * CHUNK / 2];
                let q = &qa[c * CHUNK..(c + 1) * CHUNK];
                let zero = zeros[c >> shift] as i32;
                let mut dot = 0i32;
                for j in 0..CHUNK / 2 {
                    dot += ((bytes[j] & 15) as i32 - zero) * q[j] as i32
                        + ((bytes[j] >> 4) as i32 - zero) * q[CHUNK / 2 + j] as i32;
                }
                total += dot as f32 * (scales[c >> shift] * sa[c]);
            }
            out[r * n_a + i] = total;
        }
    }
}

// The kernels index several register arrays in lockstep (rows' pointers, accumulators).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod x86 {
    use std::arch::x86_64::*;

    use super::{QuantizedA, WeightRows, CHUNK};

    /// One of the kernels below: weight rows `first..first + W` against row `ai` of A.
    type RowsKernel = unsafe fn(&QuantizedA, usize, &WeightRows, usize, u32, &mut [f32; 4]);

    /// The x86 kernels, one pair (four weight rows, one) each.
    #[derive(Clone, Copy)]
    pub(super) enum Simd {
        /// AVX-512F and AVX-512 VNNI.
        Vnni,
        /// AVX2 and FMA.
        Avx2,
    }

    /// [`super::Kernel`] through `simd`'s pair, a pair this CPU runs: [`super::kernel`] picks it
    /// by feature detection (the tests after [`available`]).
    pub(super) fn dots(
        simd: Simd,
        a: &QuantizedA,
        a_rows: std::ops::Range<usize>,
        w: &WeightRows,
        shift: u32,
        out: &mut [f32],
    ) {
        let kernels: [RowsKernel; 2] = match simd {
            Simd::Vnni => [vnni::<4>, vnni::<1>],
            Simd::Avx2 => [avx2::<4>, avx2::<1>],
        };
        // SAFETY: the CPU has the pair's features (above); `super::dots` checked the rows'
        // extents against A's chunks and blocks.
        unsafe { each(a, a_rows, w, shift, out, kernels) }
    }

    /// Runs `kernels[0]` (four weight rows) over whole groups of four weight rows, then
    /// `kernels[1]` (one) over the rest, for each row of A, writing `out[r · rows_a + i]`.
    ///
    /// # Safety
    /// The CPU has the kernels' features, and `dots` checked the extents.
    unsafe fn each(
        a: &QuantizedA,
        a_rows: std::ops::Range<usize>,
        w: &WeightRows,
        shift: u32,
        out: &mut [f32],
        kernels: [RowsKernel; 2],
    ) {
        let n_a = a_rows.len();
        for (i, ai) in a_rows.enumerate() {
            let mut r = 0;
            let mut dots = [0f32; 4];
            while r < w.rows {
                let take = if w.rows - r >= 4 { 4 } else { 1 };
                kernels[if take == 4 { 0 } else { 1 }](a, ai, w, r, shift, &mut dots);
                for t in 0..take {
                    out[(r + t) * n_a + i] = dots[t];
                }
                r += take;
            }
        }
    }

    /// Weight rows `first..first + W`: their bytes, scales and zero points.
    #[inline(always)]
    unsafe fn rows<const W: usize>(
        a: &QuantizedA,
        w: &WeightRows,
        first: usize,
    ) -> [(*const u8, *const f32, *const f32); W] {
        std::array::from_fn(|t| {
            let r = first + t;
            (
                w.bytes.as_ptr().add(r * a.chunks * CHUNK / 2),
                w.scales.as_ptr().add(r * a.blocks),
                w.zeros.as_ptr().add(r * a.blocks),
            )
        })
    }

    /// At every 64 bytes of the rows (each fourth chunk c), the same line of each weight row
    /// [`PREFETCH_ROWS`](super::super::cpu_q4::PREFETCH_ROWS) rows on, as the f32 kernels do: a
    /// decode's weights stream from DRAM (a prefetch never faults, wherever it points).
    #[inline(always)]
    unsafe fn prefetch_ahead<const W: usize>(
        rows: &[(*const u8, *const f32, *const f32); W],
        c: usize,
        row_bytes: usize,
    ) {
        if c.is_multiple_of(4) {
            for (bytes, _, _) in rows {
                let ahead = bytes.wrapping_add(c * CHUNK / 2 + super::super::cpu_q4::PREFETCH_ROWS * row_bytes);
                _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
            }
        }
    }

    /// Lanes 0..8 the f32 at `p`, lanes 8..16 the one after it (`shift` 0: chunks c and c + 1
    /// have blocks `b` and `b + 1`), or all lanes the f32 at `p` (`shift` > 0: both chunks of a
    /// pair lie in one block).
    #[inline(always)]
    unsafe fn pair(p: *const f32, shift: u32) -> __m512 {
        if shift == 0 {
            // Two f32 at a 4-byte-aligned address: one unaligned 8-byte read.
            let bits = (p as *const u64).read_unaligned();
            let two = _mm512_castps128_ps512(_mm_castsi128_ps(_mm_cvtsi64_si128(bits as i64)));
            _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), two)
        } else {
            _mm512_set1_ps(*p)
        }
    }

    /// W (1 or 4) weight rows against row `ai` of A, two chunks an iteration: the weights' 32
    /// bytes as 128-bit lanes [chunk c, chunk c, chunk c + 1, chunk c + 1], the odd lanes shifted
    /// down a nibble, masked to 4 bits, against A's 64 bytes of the two chunks. Each i32 sum
    /// starts at `−zero ·` A's sums of four, so it is `Σ q_a · (q_w − zero)`. An odd last chunk
    /// runs alone, the upper half zero.
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn vnni<const W: usize>(
        a: &QuantizedA,
        ai: usize,
        w: &WeightRows,
        first: usize,
        shift: u32,
        out: &mut [f32; 4],
    ) {
        let (qa, sa, quads) = (a.row(ai).as_ptr(), a.scales(ai).as_ptr(), a.quads(ai).as_ptr());
        let rows = rows::<W>(a, w, first);
        let (chunks, row_bytes) = (a.chunks, a.chunks * CHUNK / 2);
        let spread = _mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3);
        let shifts = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
        let nibble = _mm512_set1_epi8(15);
        let minus_zero = w.zero.map(|z| _mm512_set1_epi32(-(z as i32)));
        let mut total = [_mm512_setzero_ps(); W];
        let unpack = |raw: __m256i| {
            _mm512_and_si512(
                _mm512_srlv_epi64(_mm512_permutexvar_epi64(spread, _mm512_castsi256_si512(raw)), shifts),
                nibble,
            )
        };
        let mut c = 0;
        while c + 1 < chunks {
            prefetch_ahead(&rows, c, row_bytes);
            let av = _mm512_loadu_si512(qa.add(c * CHUNK) as *const _);
            let sums = _mm512_loadu_si512(quads.add(c * 8) as *const _);
            let sa2 = pair(sa.add(c), 0);
            let uniform = minus_zero.map(|mz| _mm512_mullo_epi32(mz, sums));
            let b = c >> shift;
            for r in 0..W {
                let (bytes, scales, zeros) = rows[r];
                let q = unpack(_mm256_loadu_si256(bytes.add(c * CHUNK / 2) as *const __m256i));
                let start = match uniform {
                    Some(u) => u,
                    None => _mm512_sub_epi32(
                        _mm512_setzero_si512(),
                        _mm512_mullo_epi32(_mm512_cvttps_epi32(pair(zeros.add(b), shift)), sums),
                    ),
                };
                let d = _mm512_dpbusd_epi32(start, q, av);
                let s = _mm512_mul_ps(pair(scales.add(b), shift), sa2);
                total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, total[r]);
            }
            c += 2;
        }
        if c < chunks {
            let av = _mm512_zextsi256_si512(_mm256_loadu_si256(qa.add(c * CHUNK) as *const __m256i));
            let sums = _mm512_zextsi256_si512(_mm256_loadu_si256(quads.add(c * 8) as *const __m256i));
            let b = c >> shift;
            for r in 0..W {
                let (bytes, scales, zeros) = rows[r];
                let q = unpack(_mm256_zextsi128_si256(_mm_loadu_si128(bytes.add(c * CHUNK / 2) as *const __m128i)));
                let start = _mm512_mullo_epi32(_mm512_set1_epi32(-(*zeros.add(b) as i32)), sums);
                let d = _mm512_dpbusd_epi32(start, q, av);
                let s = _mm512_maskz_mov_ps(0x00FF, _mm512_set1_ps(*scales.add(b) * *sa.add(c)));
                total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, total[r]);
            }
        }
        for r in 0..W {
            out[r] = _mm512_reduce_add_ps(total[r]);
        }
    }

    /// As [`vnni`], one chunk an iteration: the weights' 16 bytes as [low nibbles | high nibbles],
    /// multiplied with A's 32 bytes in pairs to i16 (at most 2 · 15 · 127, no saturation), then in
    /// fours to i32, less `zero ·` A's sums of four.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2<const W: usize>(
        a: &QuantizedA,
        ai: usize,
        w: &WeightRows,
        first: usize,
        shift: u32,
        out: &mut [f32; 4],
    ) {
        let (qa, sa, quads) = (a.row(ai).as_ptr(), a.scales(ai), a.quads(ai).as_ptr());
        let rows = rows::<W>(a, w, first);
        let nibble = _mm256_set1_epi8(15);
        let ones = _mm256_set1_epi16(1);
        let mut total = [_mm256_setzero_ps(); W];
        let row_bytes = a.chunks * CHUNK / 2;
        for c in 0..a.chunks {
            prefetch_ahead(&rows, c, row_bytes);
            let av = _mm256_loadu_si256(qa.add(c * CHUNK) as *const __m256i);
            let sums = _mm256_loadu_si256(quads.add(c * 8) as *const __m256i);
            let (b, sac) = (c >> shift, *sa.get_unchecked(c));
            for r in 0..W {
                let (bytes, scales, zeros) = rows[r];
                let x = _mm_loadu_si128(bytes.add(c * CHUNK / 2) as *const __m128i);
                let q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16::<4>(x), x), nibble);
                let zero = _mm256_set1_epi32(*zeros.add(b) as i32);
                let d = _mm256_sub_epi32(
                    _mm256_madd_epi16(_mm256_maddubs_epi16(q, av), ones),
                    _mm256_mullo_epi32(zero, sums),
                );
                let s = _mm256_set1_ps(*scales.add(b) * sac);
                total[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), s, total[r]);
            }
        }
        for r in 0..W {
            out[r] = super::super::cpu_q4::avx2::sum(total[r]);
        }
    }

    #[cfg(test)]
    pub(super) fn available() -> (bool, bool) {
        (
            std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512vnni"),
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma"),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small xorshift: the tests' random values.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn f(&mut self) -> f32 {
            (self.next() % 20_001) as f32 / 10_000.0 - 1.0
        }
    }

    /// The module doc's product in f64 from A's f32 values: the quantization recomputed as its
    /// doc says, the integer sums exact.
    fn reference(a: &[f32], k: usize, block: usize, w: &WeightRows, r: usize) -> f64 {
        let blocks = k.div_ceil(block);
        let (bytes, scales, zeros) = (
            &w.bytes[r * blocks * block / 2..],
            &w.scales[r * blocks..(r + 1) * blocks],
            &w.zeros[r * blocks..(r + 1) * blocks],
        );
        let mut y = 0f64;
        for b in 0..blocks {
            let src = &a[b * block..((b + 1) * block).min(k)];
            let amax = src.iter().fold(0f32, |m, v| m.max(v.abs()));
            let inverse = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mut dot = 0i64;
            for (t, x) in src.iter().enumerate() {
                let qa = (x * inverse).round_ties_even() as i64;
                let j = b * block + t;
                let qw = (bytes[j / 2] >> (4 * (j % 2))) as i64 & 15;
                dot += qa * (qw - zeros[b] as i64);
            }
            y += scales[b] as f64 * (amax / 127.0) as f64 * dot as f64;
        }
        y
    }

    /// Every kernel this CPU has gives the f64 reference (within f32 sums of blocks), for weight
    /// row counts that are and are not multiples of four (the one-row kernels with per-block zero
    /// points too), 1 to 4 rows of A, odd and even chunk counts, K that ends in a partial block,
    /// blocks of 32, 64 and 128, zero points of 8 and per-block ones, and a block of zeros.
    #[test]
    fn int8_kernels_match_the_integer_reference() {
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut kernels: Vec<(&str, Kernel)> = vec![("portable", Kernel::Portable)];
        #[cfg(target_arch = "x86_64")]
        {
            let (vnni, avx2) = x86::available();
            if vnni {
                kernels.push(("vnni", Kernel::X86(x86::Simd::Vnni)));
            }
            if avx2 {
                kernels.push(("avx2", Kernel::X86(x86::Simd::Avx2)));
            }
        }
        let cases = [
            (32usize, 96usize, 9usize, 1usize),
            (32, 80, 7, 3),
            (64, 200, 5, 4),
            (128, 130, 6, 2),
            (32, 32, 7, 1),
            (32, 64, 9, 2),
            // SmolLM2-135M's K (18 chunks), and more rows of A over longer rows.
            (32, 576, 9, 1),
            (32, 160, 6, 3),
            (32, 128, 5, 4),
            (64, 256, 5, 2),
        ];
        for (case, &(block, k, n, m)) in cases.iter().enumerate() {
            let blocks = k.div_ceil(block);
            let mut a: Vec<f32> = (0..m * k).map(|_| rng.f() * 3.0).collect();
            // Row 0's first block all zeros: scale 0, quantized zeros.
            a[..block.min(k)].fill(0.0);
            let bytes: Vec<u8> = (0..n * blocks * block / 2).map(|_| rng.next() as u8).collect();
            let scales: Vec<f32> = (0..n * blocks).map(|_| rng.f().abs() * 0.1 + 0.001).collect();
            // Per-block zero points for every second case (packed ones), 8 for the others.
            let uniform = case % 2 == 0;
            let zeros: Vec<f32> = (0..n * blocks).map(|i| if uniform { 8.0 } else { ((i * 7) % 16) as f32 }).collect();
            let rows =
                WeightRows { bytes: &bytes, scales: &scales, zeros: &zeros, rows: n, zero: uniform.then_some(8.0) };
            let qa = QuantizedA::new(&a, m, k, block);
            for (name, kern) in &kernels {
                let mut out = vec![0f32; n * m];
                kern.run(&qa, 0..m, &rows, qa.shift, &mut out);
                for r in 0..n {
                    for i in 0..m {
                        let got = out[r * m + i] as f64;
                        let want = reference(&a[i * k..(i + 1) * k], k, block, &rows, r);
                        // Each block's sum is an integer times two f32 scales; the f32 sums of
                        // blocks round at about 1e-6 of the terms.
                        let mag: f64 = 0.2 * 127.0 * 15.0 * k as f64 * 3.0 / 127.0;
                        assert!(
                            (got - want).abs() <= 1e-6 * mag,
                            "{name}: block {block}, k {k}, weight row {r}, A row {i}: {got} vs {want}"
                        );
                    }
                }
            }
            // `dots` (the fastest kernel) over one row of A, the second where there is one.
            let mut out = vec![0f32; n];
            let lo = m.min(2) - 1;
            dots(&qa, lo..lo + 1, &rows, &mut out);
            for (r, got) in out.iter().enumerate() {
                let want = reference(&a[lo * k..(lo + 1) * k], k, block, &rows, r);
                assert!((*got as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "dots row {r}");
            }
        }
    }

    /// The quantization rounds ties to even and scales by max|a| / 127, as onnxruntime's.
    #[test]
    fn blocks_quantize_as_onnxruntime_does() {
        let mut a = vec![0f32; 32];
        a[0] = 127.0; // max: scale 1
        a[2] = 0.5; // → 0 (ties to even)
        a[4] = 1.5; // → 2
        a[6] = 2.5; // → 2
        a[1] = -63.5; // → -64
        let q = QuantizedA::new(&a, 1, 32, 32);
        assert_eq!(q.chunk_scales[0], 1.0);
        // Even-indexed values first, then odd ones.
        assert_eq!(&q.q[..4], &[127, 0, 2, 2]);
        assert_eq!(q.q[16], -64);
        // The first four stored values: 127, 0, 2, 2.
        assert_eq!(q.quad_sums[0], 131);
        assert_eq!(q.quad_sums[4], -64);
    }
}

//! Fast paths of CPU references for float32 elementwise work: loops over the tensor bytes in
//! place, one op per loop (no per-element dispatch), which the compiler vectorizes when shims are
//! built for Wasm SIMD128 (the built-in packages are). Use them only where the f32 result is the
//! one the f64 reference would round to: IEEE 754 +, −, ×, ÷, sqrt, comparisons, sign changes.

/// Applies `f` to every float32 element of `bytes` (little-endian), in place.
#[inline]
pub fn map_f32(bytes: &mut [u8], f: impl Fn(f32) -> f32) {
    for c in bytes.chunks_exact_mut(4) {
        let v = f(f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
        c.copy_from_slice(&v.to_le_bytes());
    }
}

/// `a[i] = f(a[i], b[i])` over float32 elements (little-endian) of two buffers of one length,
/// in place in `a`.
#[inline]
pub fn zip_f32(a: &mut [u8], b: &[u8], f: impl Fn(f32, f32) -> f32) {
    for (x, y) in a.chunks_exact_mut(4).zip(b.chunks_exact(4)) {
        let v = f(f32::from_le_bytes([x[0], x[1], x[2], x[3]]), f32::from_le_bytes([y[0], y[1], y[2], y[3]]));
        x.copy_from_slice(&v.to_le_bytes());
    }
}

/// `a[i] = f(a[i], s)` over float32 elements (little-endian), in place.
#[inline]
pub fn scalar_f32(a: &mut [u8], s: f32, f: impl Fn(f32, f32) -> f32) {
    for x in a.chunks_exact_mut(4) {
        let v = f(f32::from_le_bytes([x[0], x[1], x[2], x[3]]), s);
        x.copy_from_slice(&v.to_le_bytes());
    }
}

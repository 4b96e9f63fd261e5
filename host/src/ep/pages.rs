//! Paged KV caches: one reservation of device addresses (VMM) that holds every layer's keys and
//! values of `rows` sequences, laid out so that each row's memory is mapped as its sequence
//! grows, at addresses that never move (a captured decode graph stays valid).
//!
//! A *page* is [`PAGE_POSITIONS`] consecutive positions of one row, for every cache tensor
//! (each layer's key and value): `[tensors][kv_heads][PAGE_POSITIONS][head_size]`, contiguous.
//! A row is its pages in position order, and its region starts at a multiple of the device's
//! allocation granularity, so the row maps its first pages alone. Cache tensor `i` is then a
//! paged tensor (ABI.md §6.1.1) of shape `[rows, kv_heads, positions, head_size]` whose address is
//! the arena's plus `i` tensors' share of a page: element `(b, j, t, d)` lies at
//!
//! ```text
//! b·row_stride + (t >> shift)·page_stride + j·(PAGE_POSITIONS·head_size) + (t mod PAGE_POSITIONS)·head_size + d
//! ```
//!
//! elements from it. This is vLLM's paged attention with a fixed page table (row `b`'s page
//! `p` at `b·row_stride + p·page_stride`), so kernels need four numbers, not a table.

use std::sync::Arc;

use kiln_kernel_abi::wire::Paged;
use kiln_kernel_abi::DType;

use crate::cuda::{Gpu, VirtualBuffer};
use crate::{Error, Result};

/// Positions per page (a power of two). Kernels address every K/V row through the layout, so
/// any power of two works; 64 keeps a row's last, partly used page small (64 positions of every
/// layer) and each head's run of a page 8 KiB long at head size 64 in float16.
pub const PAGE_POSITIONS: usize = 64;

/// The shape of a paged KV cache: `tensors` cache tensors (each layer's key and value) of
/// `[rows, kv_heads, positions, head_size]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPages {
    pub tensors: usize,
    pub rows: usize,
    pub kv_heads: usize,
    pub positions: usize,
    pub head_size: usize,
}

/// Where a paged KV cache's elements lie (pure arithmetic; see the module docs). Strides are in
/// elements, offsets and sizes in bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageGeometry {
    pub pages: KvPages,
    /// Bytes per element.
    pub elem: u64,
    /// Elements of one cache tensor in one page: `kv_heads × PAGE_POSITIONS × head_size`.
    pub tensor_page: u64,
    /// Elements between a row's consecutive pages: every tensor's share of a page.
    pub page_stride: u64,
    /// Pages per row: `positions` rounded up to whole pages.
    pub row_pages: u64,
    /// Elements between rows: a row's pages, rounded up to the allocation granularity.
    pub row_stride: u64,
}

fn overflow(p: &KvPages) -> Error {
    Error::Input(format!("a paged KV cache of {p:?} overflows 64-bit sizes"))
}

impl PageGeometry {
    /// The geometry of `pages` of `elem`-byte elements on a device whose allocation granularity
    /// is `granularity` bytes. Errors: a zero dimension, sizes that overflow.
    pub fn new(pages: KvPages, elem: u64, granularity: u64) -> Result<PageGeometry> {
        let p = &pages;
        if [p.tensors, p.rows, p.kv_heads, p.positions, p.head_size].contains(&0) || elem == 0 {
            return Err(Error::Input(format!("a paged KV cache needs no zero dimension: {p:?}")));
        }
        let mul = |a: u64, b: u64| a.checked_mul(b).ok_or_else(|| overflow(p));
        let tensor_page = mul(mul(p.kv_heads as u64, PAGE_POSITIONS as u64)?, p.head_size as u64)?;
        let page_stride = mul(tensor_page, p.tensors as u64)?;
        let row_pages = p.positions.div_ceil(PAGE_POSITIONS) as u64;
        let row_bytes = mul(mul(row_pages, page_stride)?, elem)?;
        let g = granularity.max(elem);
        let row_bytes = mul(row_bytes.div_ceil(g), g)?;
        mul(row_bytes, p.rows as u64)?;
        Ok(PageGeometry { pages, elem, tensor_page, page_stride, row_pages, row_stride: row_bytes / elem })
    }

    /// The layout every cache tensor's view has (ABI.md §6.1.1).
    pub fn layout(&self) -> Paged {
        let hs = self.pages.head_size as u64;
        Paged {
            axis: 2,
            shift: PAGE_POSITIONS.trailing_zeros(),
            page_stride: self.page_stride,
            strides: vec![self.row_stride, PAGE_POSITIONS as u64 * hs, hs, 1],
        }
    }

    /// Byte offset of cache tensor `i` from the arena's start.
    pub fn tensor_offset(&self, i: usize) -> u64 {
        i as u64 * self.tensor_page * self.elem
    }

    /// Bytes of a row's region (a multiple of the granularity).
    pub fn row_bytes(&self) -> u64 {
        self.row_stride * self.elem
    }

    /// Byte offset of row `r`'s region.
    pub fn row_offset(&self, r: usize) -> u64 {
        r as u64 * self.row_bytes()
    }

    /// Bytes the arena reserves: every row's region.
    pub fn reserved_bytes(&self) -> u64 {
        self.pages.rows as u64 * self.row_bytes()
    }

    /// Bytes at the start of a row's region that hold its first `positions` positions (whole
    /// pages; at most every page of the row).
    pub fn bytes_for(&self, positions: usize) -> u64 {
        (positions.div_ceil(PAGE_POSITIONS) as u64).min(self.row_pages) * self.page_stride * self.elem
    }

    /// Logical bytes of a cache tensor's view of `rows` rows (as if row-major).
    pub fn view_bytes(&self, rows: usize) -> u64 {
        let p = &self.pages;
        (rows * p.kv_heads * p.positions * p.head_size) as u64 * self.elem
    }
}

/// A paged KV cache's reserved addresses and the mapped start of each row's region.
#[derive(Debug)]
pub(super) struct PagedArena {
    pub buffer: VirtualBuffer,
    pub geometry: PageGeometry,
    pub dtype: DType,
    /// Rows and positions every row below the first has mapped at least (since the last
    /// trim): a step that needs no more returns at once, without a walk over the chunks.
    covered: (usize, usize),
}

impl PagedArena {
    /// Reserves the addresses of `pages` of `dtype` on `gpu`, nothing mapped. Errors: a dtype
    /// without a size, the geometry's, the reservation's.
    pub fn reserve(gpu: &mut Gpu, dtype: DType, pages: KvPages) -> Result<PagedArena> {
        let elem = dtype.size().ok_or_else(|| Error::Unsupported(format!("a paged KV cache of {dtype}")))? as u64;
        let granularity = gpu.granularity()?;
        let geometry = PageGeometry::new(pages, elem, granularity)?;
        let buffer = gpu.reserve(geometry.reserved_bytes())?;
        Ok(PagedArena { buffer, geometry, dtype, covered: (0, 0) })
    }

    /// The view of cache tensor `i` over the first `rows` rows: its address and layout.
    pub fn view(&self, i: usize, rows: usize) -> Result<(u64, Arc<Paged>)> {
        let p = &self.geometry.pages;
        if i >= p.tensors || rows > p.rows {
            return Err(Error::Input(format!(
                "cache tensor {i} of {} over {rows} rows of {} in a paged KV cache",
                p.tensors, p.rows
            )));
        }
        Ok((self.buffer.ptr() + self.geometry.tensor_offset(i), Arc::new(self.geometry.layout())))
    }

    /// Bytes row `r` has mapped from its region's start.
    pub fn mapped(&self, r: usize) -> u64 {
        self.buffer.mapped_at(self.geometry.row_offset(r)).min(self.geometry.row_bytes())
    }

    /// Maps rows `0 .. rows` for their first `positions` positions: a row short of them maps
    /// one chunk of at least `chunk` bytes (per row, within its region), whose new bytes are
    /// zeros. With
    /// `trim`, then unmaps (behind a fence) the rows from `rows` on, and what each other row has
    /// past its positions' bytes and one chunk. Errors: more rows than reserved, the
    /// device-memory limit ([`Error::OutOfMemory`]) or the driver's; the rows mapped before the
    /// failing one keep their growth.
    pub fn map(&mut self, gpu: &mut Gpu, rows: usize, positions: usize, chunk: u64, trim: bool) -> Result<()> {
        let g = &self.geometry;
        if rows > g.pages.rows {
            return Err(Error::Input(format!("{rows} rows of a paged KV cache reserved for {}", g.pages.rows)));
        }
        if !trim && rows <= self.covered.0 && positions <= self.covered.1 {
            return Ok(());
        }
        let (need, limit) = (g.bytes_for(positions), g.row_bytes());
        for r in 0..rows {
            let (start, have) = (g.row_offset(r), self.mapped(r));
            if have >= need {
                continue;
            }
            gpu.map_at(&mut self.buffer, start, need.max(have + chunk), limit)?;
            let now = self.mapped(r);
            gpu.zero(self.buffer.ptr() + start + have, now - have)?;
        }
        if trim {
            self.covered = (0, 0);
            let keep = need.max(chunk);
            for r in 0..g.pages.rows {
                let start = g.row_offset(r);
                self.buffer.unmap_at(start, if r < rows { keep } else { 0 }, limit)?;
            }
        }
        // Beyond what was covered along both axes: the new rectangle. Beyond along one only:
        // only what both rectangles share is known.
        let (r0, p0) = self.covered;
        self.covered = match trim || (rows >= r0 && positions >= p0) {
            true => (rows, positions),
            false => (rows.min(r0), positions.min(p0)),
        };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The SmolLM2-135M architecture's cache: 30 layers (60 tensors), 3 KV heads of 64, float16.
    fn smollm2(rows: usize, positions: usize) -> PageGeometry {
        let pages = KvPages { tensors: 60, rows, kv_heads: 3, positions, head_size: 64 };
        PageGeometry::new(pages, 2, 2 << 20).unwrap()
    }

    #[test]
    fn a_page_holds_every_tensor_and_a_row_starts_at_a_granule() {
        let g = smollm2(4, 2048);
        assert_eq!(g.tensor_page, 3 * 64 * 64, "12,288 elements of one tensor per page");
        assert_eq!(g.page_stride, 60 * 3 * 64 * 64, "1.41 MiB per page of every tensor");
        assert_eq!(g.row_pages, 32);
        // 32 pages of 1,474,560 bytes = 45 MiB, a multiple of 2 MiB already... rounded up to one.
        let used = 32 * g.page_stride * 2;
        assert_eq!(g.row_bytes(), used.div_ceil(2 << 20) * (2 << 20));
        assert_eq!(g.row_bytes() % (2 << 20), 0);
        assert_eq!(g.reserved_bytes(), 4 * g.row_bytes());
        assert_eq!(g.tensor_offset(59) + g.tensor_page * 2, g.page_stride * 2, "the last tensor ends the page");
        // Positions map by whole pages, at most the row's.
        assert_eq!(g.bytes_for(0), 0);
        assert_eq!(g.bytes_for(1), g.page_stride * 2);
        assert_eq!(g.bytes_for(64), g.page_stride * 2);
        assert_eq!(g.bytes_for(65), 2 * g.page_stride * 2);
        assert_eq!(g.bytes_for(10_000), used);
    }

    /// Every element of every cache tensor's view, through the layout the kernels get, lands
    /// in its own place: inside its row's pages, within the bytes its position needs mapped,
    /// and no two elements (of any tensors) in one place.
    #[test]
    fn the_views_tile_the_arena_without_overlap() {
        let pages = KvPages { tensors: 4, rows: 3, kv_heads: 2, positions: 150, head_size: 8 };
        let g = PageGeometry::new(pages, 2, 4096).unwrap();
        let layout = g.layout();
        assert_eq!(layout.page_len(), PAGE_POSITIONS as u64);
        let mut seen = std::collections::HashSet::new();
        for i in 0..4 {
            for b in 0..3u64 {
                for j in 0..2u64 {
                    for t in 0..150u64 {
                        for d in 0..8u64 {
                            let at = g.tensor_offset(i) / g.elem + layout.offset(&[b, j, t, d]).unwrap();
                            let in_row = at * g.elem - g.row_offset(b as usize);
                            assert!(in_row < g.bytes_for(t as usize + 1), "({i}, {b}, {j}, {t}, {d}) past its pages");
                            assert!(seen.insert(at), "({i}, {b}, {j}, {t}, {d}) overlaps");
                        }
                    }
                }
            }
        }
        assert_eq!(seen.len(), 4 * 3 * 2 * 150 * 8);
    }

    #[test]
    fn a_zero_or_overflowing_shape_is_refused() {
        let ok = KvPages { tensors: 2, rows: 1, kv_heads: 1, positions: 1, head_size: 1 };
        assert!(PageGeometry::new(ok, 2, 4096).is_ok());
        let err = PageGeometry::new(KvPages { kv_heads: 0, ..ok }, 2, 4096).unwrap_err().to_string();
        assert!(err.contains("no zero dimension"), "{err}");
        let huge = KvPages { rows: usize::MAX / 2, positions: usize::MAX / 4, ..ok };
        let err = PageGeometry::new(huge, 2, 4096).unwrap_err().to_string();
        assert!(err.contains("overflows"), "{err}");
    }
}

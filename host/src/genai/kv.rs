//! A generation's KV cache: the held past tensors (every layer's key and value), the attention
//! mask and the positions used, and on a GPU the shared cache a continuous batch's rows live
//! in, whose addresses never move (VMM), so each row count's captured decode graph stays valid.
//!
//! A GPU's shared cache is one of two kinds, chosen once per generator:
//! - **paged** (when every node that reads the pasts and writes the presents declares paged
//!   tensors, as kiln-attention's GroupQueryAttention does): one reservation whose rows each
//!   map as their sequences grow, page by page (`crate::ep::Session::reserve_pages`); the cache
//!   tensors are paged views of it (ABI.md §6.1.1);
//! - **by rows**: one reservation per cache tensor (`[rows, kv_heads, limit, head_size]`,
//!   row-major) whose rows map as they join (`crate::ep::Session::reserve`).
//!
//! Either way the cache of `n` rows is views of the first `n` rows, and rows move between
//! caches by device-to-device copies of their filled positions only.

use std::sync::Arc;

use kiln_kernel_abi::DType;

use crate::ep::{DeviceTensor, KvPages, Session};
use crate::{Error, Result};

/// The state of one batch between steps: the held past tensors, the attention mask and the
/// positions used so far (padding included). Give it back with `Generator::free` to keep a
/// shared cache for the next generation of its shape; dropped, its buffers go back to the pool.
pub struct KvCache {
    /// `past_key_values.N.key` then `.value`, for every layer.
    pub(super) past: Vec<DeviceTensor>,
    pub(super) batch: usize,
    /// One shared buffer of `limit` positions, updated in place.
    pub(super) shared: bool,
    /// Most positions (prompt, padding and generated).
    pub(super) limit: usize,
    /// Positions used so far.
    pub(super) total: usize,
    /// `[batch, total]`; `[batch, limit]` with zeros past `total` once a shared cache is past
    /// its prefill.
    pub(super) mask: Vec<i64>,
    /// The paged KV cache whose views `past` are (a GPU's paged shared cache and the caches of
    /// its first rows), shared by them.
    pub(super) pages: Option<Arc<DeviceTensor>>,
}

impl KvCache {
    /// Positions used so far (the padded prompt plus the decode steps).
    pub fn len(&self) -> usize {
        self.total
    }

    pub fn is_empty(&self) -> bool {
        self.total == 0
    }

    /// Whether the cache tensors are paged views (a GPU's paged shared cache).
    pub fn is_paged(&self) -> bool {
        self.pages.is_some()
    }
}

/// The shape of a generator's cache tensors, and whether its GPU caches are paged.
#[derive(Clone, Copy, Debug)]
pub(super) struct KvDims {
    /// Cache tensors: each layer's key and value.
    pub tensors: usize,
    pub kv_heads: usize,
    pub head_size: usize,
    pub dtype: DType,
    pub paged: bool,
}

impl KvDims {
    /// Bytes of one row of every cache tensor at `limit` positions.
    fn row_bytes(&self, limit: usize) -> u64 {
        (self.tensors * self.kv_heads * limit * self.head_size) as u64 * self.dtype.size().unwrap_or(2) as u64
    }
}

/// A new shared cache of `batch` rows and `limit` positions with nothing in it (a continuous
/// batch fills its rows one sequence at a time): on the CPU host tensors of zeros; on a GPU
/// reserved addresses for `batch` rows, the first `mapped` rows mapped (paged: for one
/// position each). [`fit`] maps more or fewer, [`first_rows`] views the first rows. Errors:
/// device memory, the reservation's.
pub(super) fn empty(s: &mut Session, d: &KvDims, batch: usize, limit: usize, mapped: usize) -> Result<KvCache> {
    let on_gpu = s.device() != crate::ep::Device::Cpu;
    let mask = vec![0; batch * limit];
    if on_gpu && d.paged {
        let shape =
            KvPages { tensors: d.tensors, rows: batch, kv_heads: d.kv_heads, positions: limit, head_size: d.head_size };
        let pages = Arc::new(s.reserve_pages(d.dtype, shape)?);
        s.map_pages(&pages, mapped, 1, false)?;
        let past = (0..d.tensors).map(|i| s.page_view(&pages, i, batch)).collect::<Result<Vec<_>>>()?;
        return Ok(KvCache { past, batch, shared: true, limit, total: 0, mask, pages: Some(pages) });
    }
    let shape = vec![batch, d.kv_heads, limit, d.head_size];
    let past = (0..d.tensors)
        .map(|_| match on_gpu {
            true => s.reserve(d.dtype, shape.clone(), mapped),
            false => s.zeros(d.dtype, shape.clone()),
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(KvCache { past, batch, shared: true, limit, total: 0, mask, pages: None })
}

/// The cache of the first `rows` rows of `full` (a GPU's shared cache): views of its tensors,
/// at its addresses, so that writes through either are seen by the other. Its mask is empty
/// and its length 0. Errors: a CPU session, more rows than `full` has (by rows: mapped).
pub(super) fn first_rows(s: &mut Session, d: &KvDims, full: &KvCache, rows: usize) -> Result<KvCache> {
    let past = match &full.pages {
        Some(pages) => (0..full.past.len()).map(|i| s.page_view(pages, i, rows)).collect::<Result<Vec<_>>>()?,
        None => {
            let shape = vec![rows, d.kv_heads, full.limit, d.head_size];
            full.past.iter().map(|t| s.view(t, shape.clone())).collect::<Result<Vec<_>>>()?
        }
    };
    let (limit, pages) = (full.limit, full.pages.clone());
    Ok(KvCache { past, batch: rows, shared: true, limit, total: 0, mask: vec![0; rows * limit], pages })
}

/// Maps `full` (a GPU's cache of [`empty`]) for its first `rows` rows and, paged, their first
/// `positions` positions each, in steps of at least the session's
/// [`crate::ep::SessionOptions::vmm_chunk_bytes`] (by rows: in all, more rows up to `full`'s
/// when one row is smaller than a chunk; paged: per row that is short): growing (`!trim`) maps
/// what is short; trimming unmaps,
/// behind a fence, what lies past them but one chunk (by rows: at most as many as needed;
/// paged: the rows past `rows` and each row's positions past `positions`). Newly used bytes are
/// zeros. Returns the rows mapped now. Errors: views still reading rows being unmapped, the
/// device-memory limit ([`Error::OutOfMemory`]) or the driver's, each of its own kind, named as
/// the KV cache's growth (by rows every tensor keeps the rows it had then, [`Error::Device`]
/// when even that fails).
pub(super) fn fit(
    s: &mut Session,
    d: &KvDims,
    full: &KvCache,
    rows: usize,
    positions: usize,
    trim: bool,
) -> Result<usize> {
    let rows = rows.min(full.batch);
    let Some(pages) = &full.pages else { return fit_rows(s, d, full, rows, !trim) };
    s.map_pages(pages, rows, positions.min(full.limit), trim).map_err(|e| {
        let why = format!(
            "the KV cache cannot {} {rows} rows × {positions} positions (about {:.1} MiB per row, of {} positions \
             reserved): {e}",
            if trim { "shrink to" } else { "grow to" },
            d.row_bytes(positions) as f64 / (1u64 << 20) as f64,
            full.limit
        );
        same_kind(&e, why)
    })?;
    Ok(rows)
}

/// `why` as an error of `e`'s kind: out of memory, bad input, or else the device's.
fn same_kind(e: &Error, why: String) -> Error {
    match e {
        Error::OutOfMemory(_) => Error::OutOfMemory(why),
        Error::Input(_) => Error::Input(why),
        _ => Error::Device(why),
    }
}

/// [`fit`] of a cache reserved by rows: at least (`grow`) or at most (`!grow`) `rows` rows.
fn fit_rows(s: &mut Session, d: &KvDims, full: &KvCache, rows: usize, grow: bool) -> Result<usize> {
    let Some(first) = full.past.first() else { return Ok(rows) };
    let now = s.tensor_type(first)?.1.first().copied().unwrap_or(0);
    let row_bytes = d.row_bytes(full.limit);
    let chunk_rows = s.options().vmm_chunk_bytes.div_ceil(row_bytes.max(1)) as usize;
    let rows = match grow {
        true if rows <= now => return Ok(now),
        true => rows.max(now + chunk_rows),
        false if rows >= now => return Ok(now),
        false => rows.max(chunk_rows).min(now),
    }
    .min(full.batch);
    if rows == now {
        return Ok(now);
    }
    for (i, t) in full.past.iter().enumerate() {
        let Err(e) = s.map_rows(t, rows) else { continue };
        // Back to the rows every tensor had.
        if let Some(undo) = full.past[..i].iter().map(|t| s.map_rows(t, now)).find_map(Result::err) {
            return Err(Error::Device(format!(
                "the KV cache's tensors could not go back to {now} rows after a failed move to {rows} ({e}): {undo}"
            )));
        }
        let mib = |r: usize| r as f64 * row_bytes as f64 / (1u64 << 20) as f64;
        let why = format!(
            "the KV cache cannot {} from {now} to {rows} rows ({:.1} MiB to {:.1} MiB mapped): {e}",
            if grow { "grow" } else { "shrink" },
            mib(now),
            mib(rows)
        );
        return Err(same_kind(&e, why));
    }
    Ok(rows)
}

/// Copies rows of cache `from` into `to` (their limits may differ): for each (source row,
/// destination row, positions), the first `positions` positions of every cache tensor
/// (positions past either cache's limit are not copied). Into a paged cache: from a paged one
/// (itself, or a prefill's) one copy per row (a row's pages are contiguous), from a row-major one
/// strided copies per KV head; the destination rows must have the positions mapped ([`fit`]).
/// Between row-major caches, one copy per KV head. Errors: the copies'.
pub(super) fn copy_rows(
    s: &mut Session,
    d: &KvDims,
    from: &KvCache,
    to: &KvCache,
    moves: &[(usize, usize, usize)],
) -> Result<()> {
    let (lf, lt) = (from.limit, to.limit);
    match (&from.pages, &to.pages) {
        (Some(a), Some(b)) => {
            moves.iter().try_for_each(|&(src, dst, len)| s.copy_pages((a, src), (b, dst), len.min(lf).min(lt)))
        }
        (None, Some(pages)) => {
            for (i, t) in from.past.iter().enumerate() {
                for &(src, dst, len) in moves {
                    s.copy_into_pages((t, src), (pages, i, dst), len.min(lf).min(lt))?;
                }
            }
            Ok(())
        }
        (Some(_), None) => Err(Error::Input("a paged KV cache's rows copy only into a paged one".into())),
        (None, None) => {
            let (heads, size) = (d.kv_heads, d.head_size);
            for (a, b) in from.past.iter().zip(&to.past) {
                for &(src, dst, len) in moves {
                    let n = len.min(lf).min(lt) * size;
                    for h in 0..heads {
                        s.copy_elements(a, (src * heads + h) * lf * size, b, (dst * heads + h) * lt * size, n)?;
                    }
                }
            }
            Ok(())
        }
    }
}

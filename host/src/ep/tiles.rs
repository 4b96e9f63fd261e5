//! A node's CPU work split into tiles over the CPU pool's threads (ABI.md §6.1.2): when the op
//! entry declares `cpu_tiles` (manifest schema 12), a large node runs as several `kiln_cpu`
//! calls on as many shim instances at once, each computing a contiguous share of the outputs
//! into its own window of them, and the windows, in order, are the outputs.

use kiln_kernel_abi::manifest::CpuTiles;
use kiln_kernel_abi::wire::Tile;

use super::infer::OutputTypes;
use crate::sandbox::{cpu_threads, Access};

/// How a session splits a node's CPU work whose package allows it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuSplit {
    /// Most tiles of one node (1: never split). Default: the CPU pool's threads
    /// (`KILN_CPU_THREADS`).
    pub max_tiles: usize,
    /// Least bytes a tile computes or reads (its share of output 0 or of the largest input,
    /// whichever is larger: a pooling or reduction reads far more than it writes): smaller
    /// nodes run whole, since a tile costs a shim call and a thread's wake-up. Default 64 KiB.
    pub min_tile_bytes: u64,
}

impl Default for CpuSplit {
    fn default() -> Self {
        CpuSplit { max_tiles: cpu_threads(), min_tile_bytes: 64 << 10 }
    }
}

/// The tiles of a node whose outputs are `outputs` and whose largest input has `input_bytes`, in
/// `kind` units, or `None` to run it whole: fewer than two tiles would do, or an output's bytes
/// are not a whole number per unit.
pub(super) fn plan(kind: CpuTiles, outputs: &OutputTypes, input_bytes: u64, split: CpuSplit) -> Option<Vec<Tile>> {
    let (dtype, shape) = outputs.first()?.as_ref()?;
    let numel: u64 = shape.iter().map(|&d| d as u64).product();
    let units = match kind {
        CpuTiles::Elements => numel,
        CpuTiles::Rows => numel / (*shape.last()? as u64).max(1),
    };
    let bytes = dtype.storage_bytes(numel)?;
    let fits = |t: &Option<(kiln_kernel_abi::DType, Vec<usize>)>| {
        t.as_ref().is_none_or(|(d, s)| {
            d.storage_bytes(s.iter().map(|&x| x as u64).product()).is_some_and(|b| units > 0 && b % units == 0)
        })
    };
    if units == 0 || !outputs.iter().all(fits) {
        return None;
    }
    let n = (split.max_tiles as u64).min(units).min(bytes.max(input_bytes) / split.min_tile_bytes.max(1));
    if n < 2 {
        return None;
    }
    Some((0..n).map(|i| Tile { start: units * i / n, end: units * (i + 1) / n }).collect())
}

/// The window of `tile` (of `units`) of an output of `nbytes` bytes, zeroed, for the tile's call.
pub(super) fn window(nbytes: u64, units: u64, tile: Tile) -> Access {
    let per = nbytes / units;
    Access::Window { start: tile.start * per, bytes: vec![0; ((tile.end - tile.start) * per) as usize] }
}

/// The number of units `tiles` cover (their last end).
pub(super) fn units(tiles: &[Tile]) -> u64 {
    tiles.last().map_or(0, |t| t.end)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kiln_kernel_abi::DType;

    #[test]
    fn tiles_cover_the_units_in_order_and_small_or_odd_nodes_run_whole() {
        let split = CpuSplit { max_tiles: 3, min_tile_bytes: 1 << 10 };
        let out = |dtype, shape: &[usize]| Some((dtype, shape.to_vec()));
        // 7 rows of 512 float32: 3 tiles of rows.
        let t = plan(CpuTiles::Rows, &vec![out(DType::F32, &[7, 512]), None, out(DType::F32, &[7, 1])], 0, split);
        let t = t.unwrap();
        assert_eq!(t.iter().map(|t| (t.start, t.end)).collect::<Vec<_>>(), [(0, 2), (2, 4), (4, 7)]);
        assert_eq!(units(&t), 7);
        // Too small for two tiles of 1 KiB, unless an input is large enough (a global pooling's
        // 300 planes of 49 values: 57 KiB read, 1.2 KiB written).
        assert!(plan(CpuTiles::Elements, &vec![out(DType::F32, &[300])], 1200, split).is_none());
        let t = plan(CpuTiles::Elements, &vec![out(DType::F32, &[300])], 300 * 49 * 4, split).unwrap();
        assert_eq!(t.iter().map(|t| (t.start, t.end)).collect::<Vec<_>>(), [(0, 100), (100, 200), (200, 300)]);
        // An output whose bytes are not a whole number per row.
        assert!(plan(CpuTiles::Rows, &vec![out(DType::F32, &[7, 512]), out(DType::F32, &[3])], 0, split).is_none());
        let w = window(7 * 2048, 7, Tile { start: 2, end: 4 });
        assert!(matches!(w, Access::Window { start: 4096, ref bytes } if bytes.len() == 4096));
    }
}

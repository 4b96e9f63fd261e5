//! NonMaxSuppression-10/11 (ONNX Operators.md; onnxruntime's kernel defines the details): per
//! batch row and class, the boxes whose score is above `score_threshold` (input 4, optional) are
//! taken greedily by score (the lower box index first on equal scores), each one suppressing the
//! later candidates whose IoU with it exceeds `iou_threshold` (input 3, default 0), until
//! `max_output_boxes_per_class` (input 2, default 0: none) are taken. `boxes` [B, S, 4] are
//! corners `[y1, x1, y2, x2]` in either order (`center_point_box` 0) or `[xc, yc, w, h]` (1);
//! `scores` [B, C, S]. A pair of boxes of no area or no overlap never suppresses. Output:
//! int64 `selected_indices` [n, 3] of (batch, class, box), by batch, class and selection order.
//! Computes in f32, as onnxruntime does. Every input is a value input: the output's length
//! depends on all of them.
//!
//! On the GPU `kiln_nms_select` runs the greedy selection one thread per (batch row, class) into
//! scratch and `kiln_nms_write` lays the selections out in order.

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::{bail, unsupported};

struct Plan {
    batch: usize,
    classes: usize,
    spatial: usize,
    /// Boxes taken per class at most (`max_output_boxes_per_class`, capped at S).
    cap: usize,
    iou: f32,
    score: Option<f32>,
    center: bool,
}

fn scalar_f32(call: &Call, i: usize) -> Result<Option<f32>> {
    let Some(t) = call.input_opt(i) else { return Ok(None) };
    match (t.dtype()?, &t.value_f32s()?[..]) {
        (DType::F32, &[v]) => Ok(Some(v)),
        (d, v) => bail!("NonMaxSuppression: input {i} must be one float32, not {d} of {} values", v.len()),
    }
}

fn plan(call: &Call) -> Result<Plan> {
    let (boxes, scores) = (call.input(0)?, call.input(1)?);
    if boxes.dtype()? != DType::F32 || scores.dtype()? != DType::F32 {
        unsupported!("NonMaxSuppression: boxes and scores of {} (float32 only)", boxes.dtype()?);
    }
    let (bs, ss) = (boxes.shape()?, scores.shape()?);
    let (batch, classes, spatial) = match (&bs[..], &ss[..]) {
        (&[b, s, 4], &[b2, c, s2]) if b == b2 && s == s2 => (b, c, s),
        _ => bail!("NonMaxSuppression: boxes must be [B, S, 4] and scores [B, C, S], not {bs:?} and {ss:?}"),
    };
    let max_out = match call.input_opt(2) {
        None => 0,
        Some(t) => match t.read_i64s()?[..] {
            [v] => v.max(0),
            ref v => bail!("NonMaxSuppression: max_output_boxes_per_class must be one value, not {}", v.len()),
        },
    };
    let center = match call.attr_i("center_point_box", 0)? {
        0 => false,
        1 => true,
        v => bail!("NonMaxSuppression: center_point_box must be 0 or 1, not {v}"),
    };
    Ok(Plan {
        batch,
        classes,
        spatial,
        cap: (max_out as u64).min(spatial as u64) as usize,
        iou: scalar_f32(call, 3)?.unwrap_or(0.0),
        score: scalar_f32(call, 4)?,
        center,
    })
}

/// `[x_min, y_min, x_max, y_max]` of box `b` (4 values).
fn corners(b: &[f32], center: bool) -> [f32; 4] {
    if center {
        let (hw, hh) = (b[2] / 2.0, b[3] / 2.0);
        [b[0] - hw, b[1] - hh, b[0] + hw, b[1] + hh]
    } else {
        [b[1].min(b[3]), b[0].min(b[2]), b[1].max(b[3]), b[0].max(b[2])]
    }
}

/// Whether boxes `a` and `b` overlap by more than `iou` (onnxruntime's SuppressByIOU).
fn suppresses(a: [f32; 4], b: [f32; 4], iou: f32) -> bool {
    let (ix0, iy0, ix1, iy1) = (a[0].max(b[0]), a[1].max(b[1]), a[2].min(b[2]), a[3].min(b[3]));
    if ix0 >= ix1 || iy0 >= iy1 {
        return false;
    }
    let inter = (ix1 - ix0) * (iy1 - iy0);
    let (area_a, area_b) = ((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]));
    let union = area_a + area_b - inter;
    if inter <= 0.0 || area_a <= 0.0 || area_b <= 0.0 || union <= 0.0 {
        return false;
    }
    inter / union > iou
}

impl Plan {
    /// The selections: (batch, class, box) rows in output order.
    fn select(&self, boxes: &[f32], scores: &[f32]) -> Vec<[i64; 3]> {
        let mut out = Vec::new();
        for b in 0..self.batch {
            let bx = |i: usize| corners(&boxes[(b * self.spatial + i) * 4..][..4], self.center);
            for c in 0..self.classes {
                let s = &scores[(b * self.classes + c) * self.spatial..][..self.spatial];
                let mut cand: Vec<usize> = (0..self.spatial).filter(|&i| self.score.is_none_or(|t| s[i] > t)).collect();
                // Highest score first; the lower index first on equal scores.
                cand.sort_by(|&i, &j| s[j].partial_cmp(&s[i]).unwrap_or(core::cmp::Ordering::Equal).then(i.cmp(&j)));
                let mut taken: Vec<usize> = Vec::new();
                for i in cand {
                    if taken.len() >= self.cap {
                        break;
                    }
                    if taken.iter().all(|&t| !suppresses(bx(t), bx(i), self.iou)) {
                        taken.push(i);
                    }
                }
                out.extend(taken.iter().map(|&i| [b as i64, c as i64, i as i64]));
            }
        }
        out
    }
}

fn selections(call: &Call) -> Result<(Plan, Vec<[i64; 3]>)> {
    let p = plan(call)?;
    let boxes = element::decode::<f32>(&call.input(0)?.value_bytes()?);
    let scores = element::decode::<f32>(&call.input(1)?.value_bytes()?);
    let sel = p.select(&boxes, &scores);
    Ok((p, sel))
}

pub fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let (_, sel) = selections(call)?;
    Ok(alloc::vec![TensorType::new(DType::I64, alloc::vec![sel.len(), 3])])
}

pub fn cpu(call: &Call) -> Result<()> {
    let (_, sel) = selections(call)?;
    call.output(0)?.write_vec(&sel.concat())
}

pub fn dispatch(call: &Call) -> Result<()> {
    let (p, sel) = selections(call)?;
    if sel.is_empty() {
        return Ok(());
    }
    let pairs = (p.batch * p.classes) as u64;
    let chosen = scratch(pairs * p.cap as u64 * 8)?;
    let counts = scratch(pairs * 8)?;
    let flags = scratch(pairs * p.spatial as u64)?;
    let t = KernelArg::tensor;
    launch(&Launch {
        kernel: "kiln_nms_select",
        grid: grid_stride(pairs),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            t(call.input(0)?.handle()),
            t(call.input(1)?.handle()),
            t(chosen),
            t(counts),
            t(flags),
            KernelArg::U64(p.batch as u64),
            KernelArg::U64(p.classes as u64),
            KernelArg::U64(p.spatial as u64),
            KernelArg::U64(p.cap as u64),
            KernelArg::F32(p.iou),
            KernelArg::F32(p.score.unwrap_or(0.0)),
            KernelArg::U32(p.score.is_some() as u32),
            KernelArg::U32(p.center as u32),
        ],
    })?;
    launch(&Launch {
        kernel: "kiln_nms_write",
        grid: [1, 1, 1],
        block: [1, 1, 1],
        shared_mem_bytes: 0,
        args: alloc::vec![
            t(chosen),
            t(counts),
            t(call.output(0)?.handle()),
            KernelArg::U64(pairs),
            KernelArg::U64(p.classes as u64),
            KernelArg::U64(p.cap as u64),
            KernelArg::U64(sel.len() as u64),
        ],
    })
}

//! Col2Im-18 (ONNX Operators.md; PyTorch's `col2im`): `input` [N, C·∏block, L] holds, for each
//! of the L sliding blocks (row-major over the block grid) and each block position, a value that
//! adds into the image [N, C, image_shape…] at block·stride − pad_begin + position·dilation
//! (positions outside the image are dropped). `image_shape` and `block_shape` are int64 value
//! inputs; `dilations` (1), `pads` ([begins…, ends…], 0) and `strides` (1) attributes. The grid
//! has (image + pads − dilation·(block − 1) − 1) / stride + 1 blocks per axis, and L must be
//! their product.
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

use crate::{ints_attr, GPU_MAX_SPATIAL};

const OP: &str = "Col2Im";

struct Plan {
    dtype: DType,
    batch: usize,
    channels: usize,
    image: Vec<usize>,
    block: Vec<usize>,
    grid: Vec<usize>,
    strides: Vec<usize>,
    dilations: Vec<usize>,
    begin: Vec<usize>,
}

fn plan(call: &Call) -> Result<Plan> {
    let x = call.input(0)?;
    let dtype = x.dtype()?;
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        unsupported!("{OP}: input has dtype {dtype}; float32, float16 and bfloat16 are supported");
    }
    let xs = x.shape()?;
    let &[batch, ck, l] = &xs[..] else { bail!("{OP}: input must be [N, C·∏block, L], not {xs:?}") };
    let dims = |i: usize, what: &str| -> Result<Vec<usize>> {
        let v = call.input(i)?.read_i64s()?;
        v.iter()
            .map(|&d| match usize::try_from(d) {
                Ok(d) if d > 0 && d <= i32::MAX as usize => Ok(d),
                _ => bail!("{OP}: {what} {v:?} must hold positive lengths"),
            })
            .collect()
    };
    let (image, block) = (dims(1, "image_shape")?, dims(2, "block_shape")?);
    let k = image.len();
    if block.len() != k || k == 0 {
        bail!("{OP}: image_shape {image:?} and block_shape {block:?} must have one length per spatial axis");
    }
    let strides = ints_attr(call, "strides", k, 1, 1)?;
    let dilations = ints_attr(call, "dilations", k, 1, 1)?;
    let pads = ints_attr(call, "pads", 2 * k, 0, 0)?;
    let taps = block.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
    let Some(taps) = taps.filter(|&t| ck % t == 0) else {
        bail!("{OP}: input's {ck} rows are not a multiple of the block's {block:?} positions");
    };
    let mut grid = Vec::with_capacity(k);
    for d in 0..k {
        let span = image[d] as i64 + pads[d] + pads[k + d] - dilations[d] * (block[d] as i64 - 1) - 1;
        if span < 0 {
            bail!(
                "{OP}: a block of {} (dilation {}) does not fit axis {d} of {} padded",
                block[d],
                dilations[d],
                image[d]
            );
        }
        grid.push((span / strides[d]) as usize + 1);
    }
    if grid.iter().try_fold(1usize, |a, &b| a.checked_mul(b)) != Some(l) {
        bail!("{OP}: input has {l} blocks; image_shape {image:?} and block_shape {block:?} make a grid of {grid:?}");
    }
    let mut out = alloc::vec![batch, ck / taps];
    out.extend_from_slice(&image);
    shape::numel(&out)?;
    Ok(Plan {
        dtype,
        batch,
        channels: ck / taps,
        image,
        block,
        grid,
        strides: strides.iter().map(|&v| v as usize).collect(),
        dilations: dilations.iter().map(|&v| v as usize).collect(),
        begin: pads[..k].iter().map(|&v| v as usize).collect(),
    })
}

impl Plan {
    fn out_shape(&self) -> Vec<usize> {
        let mut s = alloc::vec![self.batch, self.channels];
        s.extend_from_slice(&self.image);
        s
    }
}

pub(crate) fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(alloc::vec![TensorType::new(p.dtype, p.out_shape())])
}

pub(crate) fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let x = call.input(0)?.read_vec::<f64>()?;
    let k = p.image.len();
    let (taps, l, img): (usize, usize, usize) =
        (p.block.iter().product(), p.grid.iter().product(), p.image.iter().product());
    let mut y = alloc::vec![0.0; p.batch * p.channels * img];
    for t in 0..taps {
        let tp = crate::Geom::unflat(t, &p.block);
        for b in 0..l {
            let bp = crate::Geom::unflat(b, &p.grid);
            let mut at = 0usize;
            let mut inside = true;
            for a in 0..k {
                let q = (bp[a] * p.strides[a] + tp[a] * p.dilations[a]) as i64 - p.begin[a] as i64;
                inside &= q >= 0 && q < p.image[a] as i64;
                at = at * p.image[a] + q.max(0) as usize;
            }
            if !inside {
                continue;
            }
            for nc in 0..p.batch * p.channels {
                y[nc * img + at] += x[(nc * taps + t) * l + b];
            }
        }
    }
    call.output(0)?.write_vec(&y)
}

pub(crate) fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let k = p.image.len();
    if k > GPU_MAX_SPATIAL {
        unsupported!("{OP}: {k} spatial axes (the CUDA kernels take up to {GPU_MAX_SPATIAL})");
    }
    let Some(tag) = p.dtype.cuda_tag() else { unsupported!("{OP}: no CUDA kernel for {}", p.dtype) };
    let y = call.output(0)?;
    let total = y.numel()? as u64;
    if total == 0 {
        return Ok(());
    }
    let slots = |v: &[usize], pad: u64| -> Vec<KernelArg> {
        (0..GPU_MAX_SPATIAL)
            .map(|i| KernelArg::U64(if i + k < GPU_MAX_SPATIAL { pad } else { v[i + k - GPU_MAX_SPATIAL] as u64 }))
            .collect()
    };
    let mut args = alloc::vec![
        KernelArg::Tensor { handle: call.input(0)?.handle(), offset: 0 },
        KernelArg::Tensor { handle: y.handle(), offset: 0 },
        KernelArg::U64(total),
    ];
    args.extend(slots(&p.grid, 1));
    args.extend(slots(&p.image, 1));
    args.extend(slots(&p.block, 1));
    args.extend(slots(&p.strides, 1));
    args.extend(slots(&p.dilations, 1));
    args.extend(slots(&p.begin, 0));
    launch(&Launch {
        kernel: &kernel_name("kiln_col2im", &[tag]),
        grid: grid_stride(total),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args,
    })
}

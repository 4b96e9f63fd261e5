//! Einsum-12 (ONNX Operators.md, numpy's `einsum`): `equation` names each input's axes by
//! letters (`a`–`z`, `A`–`Z`), with at most one `...` per term for the axes the letters leave
//! (broadcast across the inputs, numpy-style); after `->` the output's axes, or without it the
//! `...` axes then every letter that appears once, in ASCII order. A letter repeated within a
//! term takes the diagonal; a letter not in the output is summed over. Spaces are ignored.
//!
//! The CPU reference sums in f64 and rounds once; the CUDA kernel `kiln_einsum<Tag>` runs one
//! thread per output element over the summed labels (accumulating in f32, f64 for float64), for
//! one or two inputs and up to 8 labels.
use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, unsupported};

const OP: &str = "Einsum";
/// Most labels (letters and `...` axes) and inputs of the CUDA kernel.
const GPU_MAX_LABELS: usize = 8;
const GPU_MAX_INPUTS: usize = 2;

/// A parsed equation over concrete shapes: every label (letters, then the `...` axes) with its
/// size; the output's labels; each input's element stride per label (0 where it broadcasts).
struct Plan {
    dtype: DType,
    sizes: Vec<usize>,
    out: Vec<usize>,
    strides: Vec<Vec<usize>>,
}

/// A term's labels: letters as their ASCII codes, `...` as None (at most once).
fn term(t: &str) -> Result<Vec<Option<u8>>> {
    let mut out = Vec::new();
    let b = t.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            c if c.is_ascii_alphabetic() => out.push(Some(c)),
            b'.' if b[i..].starts_with(b"...") => {
                if out.contains(&None) {
                    bail!("{OP}: term {t:?} has more than one ...");
                }
                out.push(None);
                i += 2;
            }
            c => bail!("{OP}: term {t:?} has {:?}; letters and ... are allowed", c as char),
        }
        i += 1;
    }
    Ok(out)
}

fn plan(call: &Call) -> Result<Plan> {
    let eq: alloc::string::String = call.attr_s("equation", "")?.chars().filter(|c| !c.is_whitespace()).collect();
    let (lhs, rhs) = match eq.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (eq.as_str(), None),
    };
    let terms: Vec<Vec<Option<u8>>> = lhs.split(',').map(term).collect::<Result<_>>()?;
    let inputs = call.inputs();
    if terms.len() != inputs.len() {
        bail!("{OP}: equation {eq:?} has {} input terms for {} inputs", terms.len(), inputs.len());
    }
    let dtype = inputs[0].dtype()?;
    if !dtype.is_float() {
        unsupported!("{OP}: {dtype} inputs; float types are supported");
    }
    // The `...` axes, broadcast across the inputs (right-aligned).
    let mut ell: Vec<usize> = Vec::new();
    let mut shapes = Vec::with_capacity(inputs.len());
    for (t, x) in terms.iter().zip(&inputs) {
        if x.dtype()? != dtype {
            bail!("{OP}: inputs mix {dtype} and {}", x.dtype()?);
        }
        let s = x.shape()?;
        let letters = t.iter().flatten().count();
        let e = match (t.contains(&None), s.len().checked_sub(letters)) {
            (true, Some(e)) => e,
            (false, Some(0)) => 0,
            _ => bail!("{OP}: term {:?} does not fit an input of shape {s:?}", t),
        };
        let start = t.iter().position(|l| l.is_none()).unwrap_or(0);
        let ed = &s[start..start + e];
        ell = match shape::broadcast_shapes(&[&ell, ed]) {
            Ok(b) => b,
            Err(_) => bail!("{OP}: the ... axes {ed:?} do not broadcast with {ell:?}"),
        };
        shapes.push(s);
    }
    // Labels: letters in order of first appearance, then the ... axes.
    let mut letters: Vec<u8> = Vec::new();
    for t in &terms {
        for l in t.iter().flatten() {
            if !letters.contains(l) {
                letters.push(*l);
            }
        }
    }
    let n_letters = letters.len();
    let label = |l: &u8| letters.iter().position(|x| x == l).unwrap_or(0);
    // Each letter's size: equal wherever it appears, or 1 where it broadcasts (numpy, onnxruntime).
    let mut known: Vec<Option<usize>> = alloc::vec![None; n_letters];
    for (t, s) in terms.iter().zip(&shapes) {
        let e = s.len() - t.iter().flatten().count();
        let mut axis = 0;
        for l in t {
            match l {
                Some(c) => {
                    let k = label(c);
                    known[k] = match known[k] {
                        None | Some(1) => Some(s[axis]),
                        Some(d) if s[axis] == 1 || s[axis] == d => Some(d),
                        Some(d) => bail!("{OP}: label {:?} has sizes {d} and {}", *c as char, s[axis]),
                    };
                    axis += 1;
                }
                None => axis += e,
            }
        }
    }
    let mut strides = Vec::with_capacity(inputs.len());
    for (t, s) in terms.iter().zip(&shapes) {
        let st = shape::strides(s);
        let e = s.len() - t.iter().flatten().count();
        let mut per = alloc::vec![0usize; n_letters + ell.len()];
        let mut axis = 0;
        for l in t {
            match l {
                Some(c) => {
                    let k = label(c);
                    // A size-1 axis of a longer label broadcasts (stride 0).
                    if s[axis] != 1 || known[k] == Some(1) {
                        per[k] += st[axis];
                    }
                    axis += 1;
                }
                None => {
                    // This term's ... axes are the last `e` of the broadcast ones.
                    for k in 0..e {
                        if s[axis + k] != 1 {
                            per[n_letters + ell.len() - e + k] += st[axis + k];
                        }
                    }
                    axis += e;
                }
            }
        }
        strides.push(per);
    }
    let mut sizes: Vec<usize> = known.into_iter().map(|d| d.unwrap_or(1)).collect();
    sizes.extend_from_slice(&ell);
    let out: Vec<usize> = match rhs {
        Some(r) => {
            let mut out = Vec::new();
            for l in term(r)? {
                match l {
                    Some(c) if letters.contains(&c) && !out.contains(&label(&c)) => out.push(label(&c)),
                    Some(c) => bail!("{OP}: output label {:?} is not an input label, or repeats", c as char),
                    None => out.extend(n_letters..n_letters + ell.len()),
                }
            }
            if terms.iter().any(|t| t.contains(&None)) && !r.contains("...") {
                bail!("{OP}: the inputs have ... axes but the output {r:?} has no ...");
            }
            out
        }
        None => {
            let mut once: Vec<u8> = letters
                .iter()
                .copied()
                .filter(|c| terms.iter().map(|t| t.iter().filter(|l| **l == Some(*c)).count()).sum::<usize>() == 1)
                .collect();
            once.sort_unstable();
            let mut out: Vec<usize> = (n_letters..n_letters + ell.len()).collect();
            out.extend(once.iter().map(label));
            out
        }
    };
    let out_shape: Vec<usize> = out.iter().map(|&k| sizes[k]).collect();
    shape::numel(&out_shape)?;
    // The terms summed per output element, bounded so that neither the CPU's 32-bit count nor a
    // GPU thread's loop runs away.
    let summed = (0..sizes.len()).filter(|k| !out.contains(k)).try_fold(1u64, |a, k| a.checked_mul(sizes[k] as u64));
    if summed.is_none_or(|n| n > u32::MAX as u64) {
        unsupported!("{OP}: equation {eq:?} sums more than 2^32 terms per output element");
    }
    Ok(Plan { dtype, sizes, out, strides })
}

pub(crate) fn infer(call: &Call) -> Result<Vec<TensorType>> {
    let p = plan(call)?;
    Ok(alloc::vec![TensorType::new(p.dtype, p.out.iter().map(|&k| p.sizes[k]).collect())])
}

pub(crate) fn cpu(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let xs: Vec<Vec<f64>> = call.inputs().iter().map(|t| t.read_vec::<f64>()).collect::<Result<_>>()?;
    let summed: Vec<usize> = (0..p.sizes.len()).filter(|k| !p.out.contains(k)).collect();
    let out_n: usize = p.out.iter().map(|&k| p.sizes[k]).product();
    let sum_n: usize = summed.iter().map(|&k| p.sizes[k]).product();
    let mut idx = alloc::vec![0usize; p.sizes.len()];
    let mut y = Vec::with_capacity(out_n);
    for o in 0..out_n {
        let mut r = o;
        for &k in p.out.iter().rev() {
            idx[k] = r % p.sizes[k];
            r /= p.sizes[k];
        }
        let mut acc = 0.0;
        for s in 0..sum_n {
            let mut r = s;
            for &k in summed.iter().rev() {
                idx[k] = r % p.sizes[k];
                r /= p.sizes[k];
            }
            acc += xs
                .iter()
                .zip(&p.strides)
                .map(|(x, st)| x[idx.iter().zip(st).map(|(i, s)| i * s).sum::<usize>()])
                .product::<f64>();
        }
        y.push(acc);
    }
    call.output(0)?.write_vec(&y)
}

pub(crate) fn dispatch(call: &Call) -> Result<()> {
    let p = plan(call)?;
    let inputs = call.inputs();
    if inputs.len() > GPU_MAX_INPUTS || p.sizes.len() > GPU_MAX_LABELS {
        unsupported!(
            "{OP}: {} inputs and {} labels; the CUDA kernel takes up to {GPU_MAX_INPUTS} and {GPU_MAX_LABELS}",
            inputs.len(),
            p.sizes.len()
        );
    }
    let Some(tag) = p.dtype.cuda_tag() else { unsupported!("{OP}: no CUDA kernel for {}", p.dtype) };
    let y = call.output(0)?;
    let total = y.numel()? as u64;
    if total == 0 {
        return Ok(());
    }
    // Labels reordered: the output's first (in output order), then the summed ones.
    let mut order = p.out.clone();
    order.extend((0..p.sizes.len()).filter(|k| !p.out.contains(k)));
    let slot = |v: &dyn Fn(usize) -> u64| -> Vec<KernelArg> {
        (0..GPU_MAX_LABELS).map(|i| KernelArg::U64(order.get(i).map_or(0, |&k| v(k)))).collect()
    };
    let mut args = alloc::vec![
        KernelArg::Tensor { handle: inputs[0].handle(), offset: 0 },
        KernelArg::Tensor { handle: inputs.get(1).unwrap_or(&inputs[0]).handle(), offset: 0 },
        KernelArg::Tensor { handle: y.handle(), offset: 0 },
        KernelArg::U64(total),
        KernelArg::U32(inputs.len() as u32),
        KernelArg::U32(order.len() as u32),
        KernelArg::U32(p.out.len() as u32),
    ];
    args.extend(slot(&|k| p.sizes[k] as u64));
    args.extend(slot(&|k| p.strides[0][k] as u64));
    args.extend(slot(&|k| p.strides.get(1).map_or(0, |s| s[k]) as u64));
    launch(&Launch {
        kernel: &kernel_name("kiln_einsum", &[tag]),
        grid: grid_stride(total),
        block: [GRID_STRIDE_BLOCK, 1, 1],
        shared_mem_bytes: 0,
        args,
    })
}

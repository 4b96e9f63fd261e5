//! Shim of `kiln-rnn`: ONNX's recurrent ops RNN, GRU and LSTM (7, 14, 22), following ONNX
//! Operators.md and its reference implementation.
//!
//! Inputs: `X` [S, B, I] (`layout` 0) or [B, S, I] (1); `W` [D, G·H, I] and `R` [D, G·H, H]
//! (G gates: RNN 1, GRU 3 in order z, r, h, LSTM 4 in order i, o, f, c); optional `B`
//! [D, 2·G·H] (W's biases, then R's); `sequence_lens` [B] (int32, each in 0..=S); `initial_h`
//! [D, B, H] (layout 1: [B, D, H]); LSTM also `initial_c` like initial_h and peepholes `P`
//! [D, 3·H] (i, o, f). D = 2 for `direction` bidirectional (forward, then reverse), else 1.
//!
//! Per step, with f, g, h the `activations` (defaults: RNN Tanh; GRU Sigmoid, Tanh; LSTM
//! Sigmoid, Tanh, Tanh; here Sigmoid, Tanh and Relu) and `clip` bounding every gate's input:
//! * RNN: H = f(X·Wᵀ + H·Rᵀ + Wb + Rb).
//! * GRU: z = f(X·Wzᵀ + H·Rzᵀ + Wbz + Rbz), r likewise, then
//!   h̃ = g(X·Whᵀ + (r ⊙ H)·Rhᵀ + Rbh + Wbh), or with `linear_before_reset`
//!   h̃ = g(X·Whᵀ + r ⊙ (H·Rhᵀ + Rbh) + Wbh); H = (1 − z) ⊙ h̃ + z ⊙ H.
//! * LSTM: i = f(X·Wiᵀ + H·Riᵀ + Pi ⊙ C + Wbi + Rbi), f likewise with Pf (1 − i with
//!   `input_forget`), c̃ = g(X·Wcᵀ + H·Rcᵀ + Wbc + Rbc), C = f ⊙ C + i ⊙ c̃,
//!   o = f(X·Woᵀ + H·Roᵀ + Po ⊙ C + Wbo + Rbo), H = o ⊙ h(C).
//!
//! A row of batch b runs its first sequence_lens[b] steps (the reverse direction from the
//! last of them back); its outputs past them are 0 and its last state is that of its last step
//! (0 for a row of no step, as onnxruntime gives).
//! Outputs: `Y` [S, D, B, H] (layout 1: [B, S, D, H]), `Y_h` [D, B, H] (layout 1: [B, D, H]),
//! LSTM `Y_c` like Y_h.
//!
//! The CPU reference computes in f64 and rounds once; the CUDA kernel `kiln_rnn<Tag>` runs one
//! block per (direction, batch row), every step inside it, its state in shared memory and its
//! sums in f32.
#![no_std]
extern crate alloc;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{bail, export_shim, unsupported};

struct Rnn;

/// The cell: the CUDA kernel's codes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cell {
    Rnn = 0,
    Gru = 1,
    Lstm = 2,
}

impl Cell {
    fn gates(self) -> usize {
        match self {
            Cell::Rnn => 1,
            Cell::Gru => 3,
            Cell::Lstm => 4,
        }
    }
}

/// An activation: the CUDA kernel's codes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Act {
    Sigmoid = 0,
    Tanh = 1,
    Relu = 2,
}

impl Act {
    fn apply(self, x: f64) -> f64 {
        match self {
            Act::Sigmoid => 1.0 / (1.0 + libm::exp(-x)),
            Act::Tanh => libm::tanh(x),
            Act::Relu => x.max(0.0),
        }
    }
}

/// Largest hidden size of the CUDA kernel (its shared-memory state).
const GPU_MAX_HIDDEN: usize = 2048;

struct Plan {
    cell: Cell,
    dtype: DType,
    seq: usize,
    batch: usize,
    input: usize,
    hidden: usize,
    dirs: usize,
    /// The direction of each of the `dirs` passes: false forward, true reverse.
    reverse: [bool; 2],
    layout: bool,
    /// f, g, h per direction (unused ones repeat the last).
    acts: [[Act; 3]; 2],
    clip: f64,
    linear_before_reset: bool,
    input_forget: bool,
}

fn plan(call: &Call) -> Result<Plan> {
    let op = call.op_type();
    let cell = match op {
        "RNN" => Cell::Rnn,
        "GRU" => Cell::Gru,
        _ => Cell::Lstm,
    };
    let x = call.input(0)?;
    // W and R are required; `check` below takes their shapes.
    call.input(1)?;
    call.input(2)?;
    let dtype = x.dtype()?;
    if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) {
        unsupported!("{op}: X has dtype {dtype}; float32, float16 and bfloat16 are supported");
    }
    let layout = match call.attr_i("layout", 0)? {
        0 => false,
        1 => true,
        l => bail!("{op}: layout must be 0 or 1, not {l}"),
    };
    let xs = x.shape()?;
    let &[a0, a1, input] = &xs[..] else { bail!("{op}: X must be 3-D, not {xs:?}") };
    let (seq, batch) = if layout { (a1, a0) } else { (a0, a1) };
    let (dirs, reverse) = match call.attr_s("direction", "forward")? {
        "forward" => (1, [false, false]),
        "reverse" => (1, [true, true]),
        "bidirectional" => (2, [false, true]),
        d => bail!("{op}: direction must be forward, reverse or bidirectional, not {d:?}"),
    };
    let hidden = call.attr_i("hidden_size", 0)?;
    let hidden = match usize::try_from(hidden) {
        Ok(h) if h > 0 && h <= u32::MAX as usize => h,
        _ => bail!("{op}: hidden_size must be positive, not {hidden}"),
    };
    let g = cell.gates();
    let gh =
        hidden.checked_mul(g).ok_or_else(|| ShimError::Failed(format!("{op}: hidden_size {hidden} is too large")))?;
    let check = |i: usize, what: &str, want: &[usize]| -> Result<bool> {
        let Some(t) = call.input_opt(i) else { return Ok(false) };
        if t.dtype()? != dtype || t.shape()? != want {
            bail!("{op}: {what} must be {dtype} {want:?}, not {} {:?}", t.dtype()?, t.shape()?);
        }
        Ok(true)
    };
    check(1, "W", &[dirs, gh, input])?;
    check(2, "R", &[dirs, gh, hidden])?;
    check(3, "B", &[dirs, 2 * gh])?;
    let state = if layout { [batch, dirs, hidden] } else { [dirs, batch, hidden] };
    check(5, "initial_h", &state)?;
    if cell == Cell::Lstm {
        check(6, "initial_c", &state)?;
        check(7, "P", &[dirs, 3 * hidden])?;
    }
    if let Some(t) = call.input_opt(4) {
        if t.shape()? != [batch] || !matches!(t.dtype()?, DType::I32 | DType::I64) {
            bail!("{op}: sequence_lens must be int32 [{batch}], not {} {:?}", t.dtype()?, t.shape()?);
        }
    }
    let defaults: &[Act] = match cell {
        Cell::Rnn => &[Act::Tanh],
        Cell::Gru => &[Act::Sigmoid, Act::Tanh],
        Cell::Lstm => &[Act::Sigmoid, Act::Tanh, Act::Tanh],
    };
    let per = defaults.len();
    let mut acts = [[defaults[0], *defaults.get(1).unwrap_or(&defaults[0]), *defaults.last().unwrap_or(&Act::Tanh)]; 2];
    if let Some(names) = call.attr("activations") {
        let AttrValue::Strings(names) = names else { bail!("{op}: activations must be a list of strings") };
        if names.len() != per * dirs {
            bail!("{op}: activations has {} entries; {dirs} direction(s) need {}", names.len(), per * dirs);
        }
        if call.attr("activation_alpha").is_some() || call.attr("activation_beta").is_some() {
            unsupported!("{op}: activation_alpha and activation_beta (Sigmoid, Tanh and Relu take none)");
        }
        for (i, n) in names.iter().enumerate() {
            let a = match &**n {
                "Sigmoid" => Act::Sigmoid,
                "Tanh" => Act::Tanh,
                "Relu" => Act::Relu,
                other => unsupported!("{op}: activation {other:?}; Sigmoid, Tanh and Relu are supported"),
            };
            acts[i / per][i % per] = a;
            if dirs == 1 {
                acts[1][i % per] = a;
            }
        }
    }
    let clip = call.attr_f("clip", 0.0)? as f64;
    if clip < 0.0 {
        bail!("{op}: clip must be positive, not {clip}");
    }
    Ok(Plan {
        cell,
        dtype,
        seq,
        batch,
        input,
        hidden,
        dirs,
        reverse,
        layout,
        acts,
        clip,
        linear_before_reset: cell == Cell::Gru && call.attr_i("linear_before_reset", 0)? != 0,
        input_forget: cell == Cell::Lstm && call.attr_i("input_forget", 0)? != 0,
    })
}

impl Plan {
    fn y_shape(&self) -> Vec<usize> {
        if self.layout {
            alloc::vec![self.batch, self.seq, self.dirs, self.hidden]
        } else {
            alloc::vec![self.seq, self.dirs, self.batch, self.hidden]
        }
    }
    fn state_shape(&self) -> Vec<usize> {
        if self.layout {
            alloc::vec![self.batch, self.dirs, self.hidden]
        } else {
            alloc::vec![self.dirs, self.batch, self.hidden]
        }
    }
    fn y_at(&self, t: usize, d: usize, b: usize) -> usize {
        let h = self.hidden;
        if self.layout {
            ((b * self.seq + t) * self.dirs + d) * h
        } else {
            ((t * self.dirs + d) * self.batch + b) * h
        }
    }
    fn state_at(&self, d: usize, b: usize) -> usize {
        if self.layout {
            (b * self.dirs + d) * self.hidden
        } else {
            (d * self.batch + b) * self.hidden
        }
    }
    fn x_at(&self, t: usize, b: usize) -> usize {
        if self.layout {
            (b * self.seq + t) * self.input
        } else {
            (t * self.batch + b) * self.input
        }
    }
    fn clip(&self, v: f64) -> f64 {
        if self.clip > 0.0 {
            v.clamp(-self.clip, self.clip)
        } else {
            v
        }
    }
}

/// Each batch row's step count, checked against S.
fn lengths(call: &Call, p: &Plan) -> Result<Vec<usize>> {
    let Some(t) = call.input_opt(4) else { return Ok(alloc::vec![p.seq; p.batch]) };
    let v = t.read_i64s()?;
    v.iter()
        .map(|&l| match usize::try_from(l) {
            Ok(l) if l <= p.seq => Ok(l),
            _ => bail!("{}: sequence_lens {v:?} must lie in 0..={}", call.op_type(), p.seq),
        })
        .collect()
}

impl Shim for Rnn {
    fn infer(call: &Call) -> Result<Vec<TensorType>> {
        let p = plan(call)?;
        let mut out = alloc::vec![TensorType::new(p.dtype, p.y_shape()), TensorType::new(p.dtype, p.state_shape())];
        if p.cell == Cell::Lstm {
            out.push(TensorType::new(p.dtype, p.state_shape()));
        }
        Ok(out)
    }

    fn cpu(call: &Call) -> Result<()> {
        let p = plan(call)?;
        let lens = lengths(call, &p)?;
        let read = |i: usize| -> Result<Vec<f64>> {
            match call.input_opt(i) {
                Some(t) => t.read_vec::<f64>(),
                None => Ok(Vec::new()),
            }
        };
        let (x, w, r, bias) = (read(0)?, read(1)?, read(2)?, read(3)?);
        let (h0, c0, peep) = (read(5)?, read(6)?, read(7)?);
        let (hs, is, g) = (p.hidden, p.input, p.cell.gates());
        let gh = g * hs;
        let mut y = alloc::vec![0.0; p.y_shape().iter().product()];
        let mut yh = alloc::vec![0.0; p.state_shape().iter().product()];
        let mut yc = yh.clone();
        let mut gates = alloc::vec![0.0; gh];
        for d in 0..p.dirs {
            let (wd, rd) = (&w[d * gh * is..][..gh * is], &r[d * gh * hs..][..gh * hs]);
            let bias_of =
                |k: usize| if bias.is_empty() { (0.0, 0.0) } else { (bias[d * 2 * gh + k], bias[d * 2 * gh + gh + k]) };
            let [fa, ga, ha] = p.acts[d];
            for b in 0..p.batch {
                let s0 = p.state_at(d, b);
                let mut h: Vec<f64> = if h0.is_empty() { alloc::vec![0.0; hs] } else { h0[s0..s0 + hs].to_vec() };
                let mut c: Vec<f64> = if c0.is_empty() { alloc::vec![0.0; hs] } else { c0[s0..s0 + hs].to_vec() };
                for step in 0..lens[b] {
                    let t = if p.reverse[d] { lens[b] - 1 - step } else { step };
                    let xt = &x[p.x_at(t, b)..][..is];
                    // X·Wᵀ + Wb and H·Rᵀ + Rb per gate row.
                    let mut xr = alloc::vec![0.0; gh];
                    for k in 0..gh {
                        let (wb, rb) = bias_of(k);
                        gates[k] = wb + xt.iter().zip(&wd[k * is..(k + 1) * is]).map(|(a, b)| a * b).sum::<f64>();
                        xr[k] = rb + h.iter().zip(&rd[k * hs..(k + 1) * hs]).map(|(a, b)| a * b).sum::<f64>();
                    }
                    match p.cell {
                        Cell::Rnn => {
                            for j in 0..hs {
                                h[j] = fa.apply(p.clip(gates[j] + xr[j]));
                            }
                        }
                        Cell::Gru => {
                            let z: Vec<f64> = (0..hs).map(|j| fa.apply(p.clip(gates[j] + xr[j]))).collect();
                            let rg: Vec<f64> = (0..hs).map(|j| fa.apply(p.clip(gates[hs + j] + xr[hs + j]))).collect();
                            let hn: Vec<f64> = (0..hs)
                                .map(|j| {
                                    let k = 2 * hs + j;
                                    let rec = if p.linear_before_reset {
                                        rg[j] * xr[k]
                                    } else {
                                        // (r ⊙ H)·Rhᵀ + Rbh
                                        bias_of(k).1 + (0..hs).map(|m| rg[m] * h[m] * rd[k * hs + m]).sum::<f64>()
                                    };
                                    ga.apply(p.clip(gates[k] + rec))
                                })
                                .collect();
                            for j in 0..hs {
                                h[j] = (1.0 - z[j]) * hn[j] + z[j] * h[j];
                            }
                        }
                        Cell::Lstm => {
                            let pe =
                                |k: usize, j: usize| if peep.is_empty() { 0.0 } else { peep[d * 3 * hs + k * hs + j] };
                            for j in 0..hs {
                                let pre = |k: usize| gates[k * hs + j] + xr[k * hs + j];
                                let i = fa.apply(p.clip(pre(0) + pe(0, j) * c[j]));
                                let f =
                                    if p.input_forget { 1.0 - i } else { fa.apply(p.clip(pre(2) + pe(2, j) * c[j])) };
                                let cc = ga.apply(p.clip(pre(3)));
                                c[j] = f * c[j] + i * cc;
                                let o = fa.apply(p.clip(pre(1) + pe(1, j) * c[j]));
                                h[j] = o * ha.apply(c[j]);
                            }
                        }
                    }
                    y[p.y_at(t, d, b)..][..hs].copy_from_slice(&h);
                }
                if lens[b] > 0 {
                    yh[s0..s0 + hs].copy_from_slice(&h);
                    yc[s0..s0 + hs].copy_from_slice(&c);
                }
            }
        }
        for (i, v) in [(0, &y), (1, &yh), (2, &yc)] {
            if let Some(t) = call.output_opt(i) {
                t.write_vec(v)?;
            }
        }
        Ok(())
    }

    fn dispatch(call: &Call) -> Result<()> {
        let p = plan(call)?;
        let op = call.op_type();
        let Some(tag) = p.dtype.cuda_tag() else { unsupported!("{op}: no CUDA kernel for {}", p.dtype) };
        if p.hidden > GPU_MAX_HIDDEN {
            unsupported!("{op}: hidden_size {} over the CUDA kernel's {GPU_MAX_HIDDEN}", p.hidden);
        }
        if call.input_opt(4).is_some_and(|t| t.dtype().ok() != Some(DType::I32)) {
            unsupported!("{op}: the CUDA kernel takes int32 sequence_lens");
        }
        if p.batch == 0 {
            return Ok(());
        }
        let x = call.input(0)?;
        let t = KernelArg::tensor;
        let opt = |i: usize| t(call.input_opt(i).map_or(x.handle(), |v| v.handle()));
        let out = |i: usize| call.output_opt(i).map(|v| v.handle());
        // Absent outputs are written nowhere (their flag is 0); any tensor stands in.
        let any = x.handle();
        let u = |v: usize| KernelArg::U32(v as u32);
        let act = |d: usize| u((p.acts[d][0] as usize) | (p.acts[d][1] as usize) << 4 | (p.acts[d][2] as usize) << 8);
        let flags = (call.input_opt(3).is_some() as u32)
            | (call.input_opt(4).is_some() as u32) << 1
            | (call.input_opt(5).is_some() as u32) << 2
            | (call.input_opt(6).is_some() as u32) << 3
            | (call.input_opt(7).is_some() as u32) << 4
            | (out(0).is_some() as u32) << 5
            | (out(1).is_some() as u32) << 6
            | (out(2).is_some() as u32) << 7
            | (p.layout as u32) << 8
            | (p.linear_before_reset as u32) << 9
            | (p.input_forget as u32) << 10
            | (p.reverse[0] as u32) << 11
            | (p.reverse[1] as u32) << 12;
        let threads = (p.hidden.div_ceil(32) * 32).clamp(32, 1024) as u32;
        launch(&Launch {
            kernel: &kernel_name("kiln_rnn", &[tag]),
            grid: [p.dirs as u32, p.batch.min(65535) as u32, 1],
            block: [threads, 1, 1],
            shared_mem_bytes: (4 * p.hidden * 4) as u32,
            args: alloc::vec![
                t(x.handle()),
                t(call.input(1)?.handle()),
                t(call.input(2)?.handle()),
                opt(3),
                opt(4),
                opt(5),
                opt(6),
                opt(7),
                t(out(0).unwrap_or(any)),
                t(out(1).unwrap_or(any)),
                t(out(2).unwrap_or(any)),
                u(p.cell as usize),
                u(p.seq),
                u(p.batch),
                u(p.input),
                u(p.hidden),
                u(p.dirs),
                act(0),
                act(1),
                KernelArg::F32(p.clip as f32),
                KernelArg::U32(flags),
                KernelArg::Status,
            ],
        })
    }
}

export_shim!(Rnn);

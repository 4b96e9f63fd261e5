//! Control flow: ONNX If, Loop, Scan and SequenceMap, run by the executor rather than by a kernel package,
//! as onnxruntime runs them. Each subgraph is a [`Session`] of its own on the session's device,
//! made with it (an op no package runs inside a body fails the model at load, not mid-loop).
//! A control-flow node feeds a body host tensors: its formal inputs, then the outer-scope
//! values the body captures (the node's implicit inputs). The values a node reads to decide
//! (If's condition, Loop's trip count and condition, the state it carries) are host bytes, so
//! on a GPU a control-flow node is a seam: what it reads is downloaded (counted in the report),
//! and a run with one is never a single execution plan.
//!
//! Limits: subgraphs nest at most [`crate::model::MAX_SUBGRAPH_DEPTH`] deep (checked at load);
//! one loop (a Loop node, a Scan over one batch entry, a SequenceMap) runs its body at most
//! [`SessionOptions::max_loop_iterations`] times.

use std::collections::HashMap;
use std::sync::Arc;

use kiln_kernel_abi::DType;

use crate::model::{AttrValue, Dim, Model, Node, Subgraph};
use crate::trace::Report;
use crate::{Error, Result, Tensor};

use super::host_tensor::{slice_axis, stack};
use super::{HostValue, Runtime, Session, SessionOptions};

/// What runs a control-flow node, where a package's id would be (reports, `kiln inspect`).
pub const CONTROL_FLOW: &str = "kiln (executor)";

/// A body: the subgraph and the session that runs it.
struct Body {
    sub: Arc<Subgraph>,
    session: Session,
    /// The attribute that holds it (`body`, `then_branch`, …), for messages.
    attr: String,
}

impl Body {
    /// Runs the body on its formal inputs `formal` and the captured values in `outer` (by
    /// name); returns its outputs in order. Its report's counts move to `report`.
    fn run(
        &mut self,
        formal: Vec<HostValue>,
        outer: &HashMap<String, HostValue>,
        report: &mut Report,
    ) -> Result<Vec<HostValue>> {
        let g = &self.sub.graph;
        if formal.len() != self.sub.formal_inputs {
            return Err(Error::Model(format!(
                "the body declares {} inputs; the node feeds it {}",
                self.sub.formal_inputs,
                formal.len()
            )));
        }
        let mut feeds = Vec::with_capacity(g.inputs.len());
        for (&id, v) in g.inputs[..self.sub.formal_inputs].iter().zip(formal) {
            feeds.push((g.values[id].name.clone(), v));
        }
        for &id in self.sub.captures() {
            let name = &g.values[id].name;
            let v =
                outer.get(name).ok_or_else(|| Error::Model(format!("the body reads {name:?}, which was not fed")))?;
            feeds.push((name.clone(), v.clone()));
        }
        let outs = self.session.run_values(feeds);
        report.absorb(std::mem::take(&mut self.session.report));
        report.control_flow.subgraph_runs += 1;
        let attr = &self.attr;
        Ok(outs.map_err(|e| e.context(&format!("in its subgraph {attr:?}: ")))?.into_iter().map(|(_, v)| v).collect())
    }

    /// Runs the body on tensors and returns tensors (Scan's bodies). Errors: a sequence or
    /// optional output.
    fn run_tensors(
        &mut self,
        formal: Vec<Tensor>,
        outer: &HashMap<String, HostValue>,
        report: &mut Report,
    ) -> Result<Vec<Tensor>> {
        let outs = self.run(formal.into_iter().map(HostValue::Tensor).collect(), outer, report)?;
        outs.into_iter().enumerate().map(|(i, v)| v.into_tensor(&format!("the body's output {i}"))).collect()
    }

    /// The declared dtype and shape of output `k`, when fully known.
    fn declared_output(&self, k: usize) -> Option<(DType, Vec<usize>)> {
        let g = &self.sub.graph;
        let ty = g.values[*g.outputs.get(k)?].ty.as_ref()?;
        let dims: Option<Vec<usize>> =
            ty.dims.as_ref()?.iter().map(|d| if let Dim::Known(n) = d { Some(*n) } else { None }).collect();
        Some((ty.dtype, dims?))
    }
}

/// A control-flow node prepared: its op and its bodies' sessions, by attribute name.
pub(super) struct ControlFlow {
    opset: i64,
    bodies: HashMap<String, Body>,
}

impl ControlFlow {
    /// Prepares node `node` of `model` (opset `opset`): a session for each of its subgraphs,
    /// with `options`. Errors: a subgraph's own (an op no package runs, a malformed body).
    pub fn new(rt: &Arc<Runtime>, model: &Model, node: &Node, opset: i64, options: &SessionOptions) -> Result<Self> {
        let mut bodies = HashMap::new();
        for (name, v) in &node.attributes {
            let AttrValue::Graph(sub) = v else { continue };
            let body = Model {
                path: model.path.clone(),
                ir_version: model.ir_version,
                opsets: model.opsets.clone(),
                producer: model.producer.clone(),
                graph: sub.graph.clone(),
            };
            let session = Session::new(rt.clone(), body, options.clone()).map_err(|e| at_node(e, node, Some(name)))?;
            bodies.insert(name.clone(), Body { sub: sub.clone(), session, attr: name.clone() });
        }
        Ok(ControlFlow { opset, bodies })
    }

    /// Runs `node` on `inputs` (its explicit inputs, then its implicit ones, host values);
    /// returns its outputs. `limit`: most body runs. Errors: a malformed node, a body's error,
    /// the limit reached.
    pub fn run(
        &mut self,
        node: &Node,
        graph: &crate::model::Graph,
        inputs: Vec<Option<HostValue>>,
        limit: u64,
        report: &mut Report,
    ) -> Result<Vec<Option<HostValue>>> {
        let explicit = node.inputs.len() - node.implicit_inputs;
        let mut outer = HashMap::new();
        for (id, t) in node.inputs[explicit..].iter().zip(&inputs[explicit..]) {
            if let (Some(id), Some(t)) = (id, t) {
                outer.insert(graph.values[*id].name.clone(), t.clone());
            }
        }
        let mut args = inputs;
        args.truncate(explicit);
        let ctx = Ctx { node, outer: &outer, limit };
        let tensors = |args: Vec<Option<HostValue>>| -> Result<Vec<Option<Tensor>>> {
            args.into_iter()
                .enumerate()
                .map(|(i, v)| v.map(|v| v.into_tensor(&format!("input {i}"))).transpose())
                .collect()
        };
        let as_values = |ts: Vec<Tensor>| ts.into_iter().map(HostValue::Tensor).collect::<Vec<_>>();
        let outs = match node.op_type.as_str() {
            "If" => self.run_if(&ctx, args, report),
            "Loop" => self.run_loop(&ctx, args, report),
            "SequenceMap" => self.run_sequence_map(&ctx, args, report),
            _ if self.opset < 9 => tensors(args).and_then(|a| self.run_scan8(&ctx, a, report)).map(as_values),
            _ => tensors(args).and_then(|a| self.run_scan(&ctx, a, report)).map(as_values),
        }
        .map_err(|e| at_node(e, node, None))?;
        if outs.len() != node.outputs.len() {
            return Err(Error::Model(format!(
                "node {:?} ({}) has {} outputs, its body gives {}",
                node.name,
                node.op_type,
                node.outputs.len(),
                outs.len()
            )));
        }
        Ok(outs.into_iter().map(Some).collect())
    }

    fn body(&mut self, name: &str) -> Result<&mut Body> {
        self.bodies.get_mut(name).ok_or_else(|| Error::Model(format!("the node has no subgraph attribute {name:?}")))
    }

    /// If: the branch the condition picks, its outputs.
    fn run_if(&mut self, ctx: &Ctx<'_>, args: Vec<Option<HostValue>>, report: &mut Report) -> Result<Vec<HostValue>> {
        let cond = match args.into_iter().next().flatten() {
            Some(v) => truth(Some(&v.into_tensor("cond")?), "cond")?,
            None => truth(None, "cond")?,
        };
        let branch = if cond { "then_branch" } else { "else_branch" };
        self.body(branch)?.run(Vec::new(), ctx.outer, report)
    }

    /// Loop (opset 1 and later): `M` and `cond` optional, then the loop-carried values; outputs
    /// the final carried values, then each scan output stacked along a new first axis.
    fn run_loop(&mut self, ctx: &Ctx<'_>, args: Vec<Option<HostValue>>, report: &mut Report) -> Result<Vec<HostValue>> {
        let mut args = args.into_iter();
        let trip_count = match args.next().flatten() {
            Some(t) => Some(scalar_i64(&t.into_tensor("M")?, "M (the trip count)")?),
            None => None,
        };
        let cond_given = args.next().flatten().map(|c| c.into_tensor("cond")).transpose()?;
        let mut cond = match &cond_given {
            Some(t) => truth(Some(t), "cond")?,
            None => true,
        };
        let mut carried: Vec<HostValue> = args
            .enumerate()
            .map(|(i, t)| t.ok_or_else(|| Error::Model(format!("loop-carried input {i} is left out"))))
            .collect::<Result<_>>()?;
        let n = carried.len();
        let body = self.body("body")?;
        let declared = body.sub.formal_inputs;
        if declared != n + 2 {
            return Err(Error::Model(format!(
                "the body declares {declared} inputs; a Loop with {n} loop-carried values feeds {}",
                n + 2
            )));
        }
        let k = ctx.node.outputs.len().checked_sub(n).ok_or_else(|| {
            Error::Model(format!(
                "the node has {} outputs, fewer than its {n} loop-carried values",
                ctx.node.outputs.len()
            ))
        })?;
        let mut scans: Vec<Vec<Tensor>> = vec![Vec::new(); k];
        let mut i: i64 = 0;
        while cond && trip_count.is_none_or(|m| i < m) {
            ctx.check_limit(i as u64)?;
            let mut formal = vec![
                HostValue::Tensor(scalar(DType::I64, &i.to_le_bytes())),
                HostValue::Tensor(scalar(DType::Bool, &[cond as u8])),
            ];
            formal.append(&mut carried);
            let mut outs = body.run(formal, ctx.outer, report)?.into_iter();
            if outs.len() != 1 + n + k {
                return Err(Error::Model(format!(
                    "the body gives {} outputs; a Loop with {n} loop-carried values and {k} scan outputs needs {}",
                    outs.len(),
                    1 + n + k
                )));
            }
            let cond_out = outs.next();
            if cond_given.is_some() {
                let c = cond_out.map(|c| c.into_tensor("the body's condition output")).transpose()?;
                cond = truth(c.as_ref(), "the body's condition output")?;
            }
            carried = outs.by_ref().take(n).collect();
            for (j, (s, v)) in scans.iter_mut().zip(outs).enumerate() {
                s.push(v.into_tensor(&format!("scan output {j}"))?);
            }
            i += 1;
        }
        report.control_flow.iterations += i as u64;
        let mut outs = carried;
        for (j, parts) in scans.into_iter().enumerate() {
            outs.push(HostValue::Tensor(match parts.is_empty() {
                false => stack(&parts, 0, false)?,
                true => empty_scan(body, 1 + n + j, 0)?,
            }));
        }
        Ok(outs)
    }

    /// SequenceMap-17: the body once per position of the input sequences (each gives its
    /// element there; a tensor among `additional_inputs` is given whole every time); each output
    /// is the sequence of the body's outputs.
    fn run_sequence_map(
        &mut self,
        ctx: &Ctx<'_>,
        args: Vec<Option<HostValue>>,
        report: &mut Report,
    ) -> Result<Vec<HostValue>> {
        let args: Vec<HostValue> = args
            .into_iter()
            .enumerate()
            .map(|(i, v)| v.ok_or_else(|| Error::Model(format!("input {i} is left out"))))
            .collect::<Result<_>>()?;
        let len = match args.first() {
            Some(HostValue::Sequence(s)) => s.len(),
            _ => return Err(Error::Input("input_sequence must be a sequence".into())),
        };
        if let Some(odd) = args.iter().find_map(|a| match a {
            HostValue::Sequence(s) if s.len() != len => Some(s.len()),
            _ => None,
        }) {
            return Err(Error::Input(format!("the input sequences' lengths differ: {len} and {odd}")));
        }
        let k = ctx.node.outputs.len();
        let body = self.body("body")?;
        let mut outs: Vec<Vec<Tensor>> = vec![Vec::with_capacity(len); k];
        for i in 0..len {
            ctx.check_limit(i as u64)?;
            let formal = args
                .iter()
                .map(|a| match a {
                    HostValue::Sequence(s) => Ok(HostValue::Tensor(s[i].clone())),
                    HostValue::Tensor(t) => Ok(HostValue::Tensor(t.clone())),
                    HostValue::Optional(_) => Err(Error::Input("SequenceMap takes sequences and tensors".into())),
                })
                .collect::<Result<Vec<_>>>()?;
            let got = body.run(formal, ctx.outer, report)?;
            if got.len() != k {
                return Err(Error::Model(format!("the body gives {} outputs; the node has {k}", got.len())));
            }
            for (j, (o, v)) in outs.iter_mut().zip(got).enumerate() {
                o.push(v.into_tensor(&format!("the body's output {j}"))?);
            }
        }
        report.control_flow.iterations += len as u64;
        Ok(outs.into_iter().map(HostValue::Sequence).collect())
    }

    /// Scan (opset 9 and later): state variables, then `num_scan_inputs` scan inputs sliced along
    /// `scan_input_axes`; outputs the final state, then scan outputs stacked along
    /// `scan_output_axes` (`*_directions` 1: reverse).
    fn run_scan(&mut self, ctx: &Ctx<'_>, args: Vec<Option<Tensor>>, report: &mut Report) -> Result<Vec<Tensor>> {
        let args: Vec<Tensor> = args
            .into_iter()
            .enumerate()
            .map(|(i, t)| t.ok_or_else(|| Error::Model(format!("input {i} is left out"))))
            .collect::<Result<_>>()?;
        let m = usize::try_from(ctx.int("num_scan_inputs")?.unwrap_or(-1))
            .ok()
            .filter(|m| (1..=args.len()).contains(m))
            .ok_or_else(|| Error::Model(format!("num_scan_inputs must be 1 to {} (the node's inputs)", args.len())))?;
        let n = args.len() - m;
        let (states, xs) = args.split_at(n);
        let in_axes = ctx.axes("scan_input_axes", xs.iter().map(|x| x.shape.len()))?;
        let in_dirs = ctx.directions("scan_input_directions", m)?;
        let len = sequence_length(xs, &in_axes)?;
        let k = ctx.node.outputs.len().checked_sub(n).ok_or_else(|| {
            Error::Model(format!("the node has {} outputs, fewer than its {n} state variables", ctx.node.outputs.len()))
        })?;
        let out_dirs = ctx.directions("scan_output_directions", k)?;
        let body = self.body("body")?;
        let (states, scans) = scan_loop(body, ctx, states.to_vec(), xs, (&in_axes, &in_dirs), len, k, report)?;
        let mut outs = states;
        let ranks: Vec<usize> = match scans.iter().map(|s| s.first().map(|t| t.shape.len() + 1)).collect() {
            Some(r) => r,
            None => (0..k).map(|j| body.declared_output(n + j).map_or(1, |(_, s)| s.len() + 1)).collect(),
        };
        let out_axes = ctx.axes("scan_output_axes", ranks.into_iter())?;
        for (j, parts) in scans.into_iter().enumerate() {
            outs.push(match parts.is_empty() {
                false => stack(&parts, out_axes[j], out_dirs[j] == 1)?,
                true => empty_scan(body, n + j, out_axes[j])?,
            });
        }
        Ok(outs)
    }

    /// Scan-8: an optional `sequence_lens`, then state variables and scan inputs with a batch
    /// axis first (scan inputs scanned along axis 1); each batch entry is scanned on its own.
    fn run_scan8(&mut self, ctx: &Ctx<'_>, args: Vec<Option<Tensor>>, report: &mut Report) -> Result<Vec<Tensor>> {
        let mut args = args.into_iter();
        let lens = args.next().flatten();
        let args: Vec<Tensor> = args
            .enumerate()
            .map(|(i, t)| t.ok_or_else(|| Error::Model(format!("input {} is left out", i + 1))))
            .collect::<Result<_>>()?;
        let m = usize::try_from(ctx.int("num_scan_inputs")?.unwrap_or(-1))
            .ok()
            .filter(|m| (1..=args.len()).contains(m))
            .ok_or_else(|| Error::Model(format!("num_scan_inputs must be 1 to {} (the node's inputs)", args.len())))?;
        let n = args.len() - m;
        // States carry a batch axis, scan inputs a batch and a sequence axis.
        if let Some((i, t)) = args.iter().enumerate().find(|(i, t)| t.shape.len() < if *i < n { 1 } else { 2 }) {
            return Err(Error::Model(format!(
                "Scan-8's input {} has shape {:?}: states need a batch axis, scan inputs a batch and a sequence axis",
                i + 1,
                t.shape
            )));
        }
        let batch = args.iter().map(|t| t.shape.first().copied()).collect::<Option<Vec<_>>>();
        let batch = match batch.as_deref() {
            Some([b, rest @ ..]) if rest.iter().all(|r| r == b) => *b,
            _ => return Err(Error::Model("Scan-8's inputs must share a first (batch) axis".into())),
        };
        let in_dirs = ctx.directions("directions", m)?;
        let k = ctx.node.outputs.len().checked_sub(n).ok_or_else(|| {
            Error::Model(format!("the node has {} outputs, fewer than its {n} state variables", ctx.node.outputs.len()))
        })?;
        let body = self.body("body")?;
        let mut per_output: Vec<Vec<Tensor>> = vec![Vec::new(); n + k];
        for b in 0..batch {
            let entry: Vec<Tensor> = args.iter().map(|t| slice_axis(t, 0, b)).collect::<Result<_>>()?;
            let (states, xs) = entry.split_at(n);
            let in_axes = vec![0; m];
            let len = sequence_length(xs, &in_axes)?;
            if let Some(lens) = &lens {
                let want = lens.to_i64().or_else(|_| to_i64_any(lens))?;
                if want.get(b).is_some_and(|&l| l != len as i64) {
                    return Err(Error::Unsupported(format!(
                        "Scan-8 with sequence_lens {want:?} shorter than the scan inputs' {len} steps"
                    )));
                }
            }
            let (states, scans) = scan_loop(body, ctx, states.to_vec(), xs, (&in_axes, &in_dirs), len, k, report)?;
            for (j, t) in states.into_iter().enumerate() {
                per_output[j].push(t);
            }
            for (j, parts) in scans.into_iter().enumerate() {
                per_output[n + j].push(match parts.is_empty() {
                    false => stack(&parts, 0, false)?,
                    true => empty_scan(body, n + j, 0)?,
                });
            }
        }
        per_output.iter().map(|parts| stack(parts, 0, false)).collect()
    }
}

/// What a control-flow node's run knows: the node, its captured values, the iteration limit.
struct Ctx<'a> {
    node: &'a Node,
    outer: &'a HashMap<String, HostValue>,
    limit: u64,
}

impl Ctx<'_> {
    fn attr(&self, name: &str) -> Option<&AttrValue> {
        self.node.attributes.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }

    fn int(&self, name: &str) -> Result<Option<i64>> {
        match self.attr(name) {
            None => Ok(None),
            Some(AttrValue::Int(v)) => Ok(Some(*v)),
            Some(_) => Err(Error::Model(format!("attribute {name:?} must be an int"))),
        }
    }

    fn ints(&self, name: &str) -> Result<Option<&[i64]>> {
        match self.attr(name) {
            None => Ok(None),
            Some(AttrValue::Ints(v)) => Ok(Some(v)),
            Some(_) => Err(Error::Model(format!("attribute {name:?} must be a list of ints"))),
        }
    }

    /// The axes of attribute `name` (default 0 each), normalized against each tensor's rank.
    fn axes(&self, name: &str, ranks: impl ExactSizeIterator<Item = usize>) -> Result<Vec<usize>> {
        let count = ranks.len();
        let given = self.ints(name)?;
        if given.is_some_and(|g| g.len() != count) {
            return Err(Error::Model(format!("attribute {name:?} must have {count} entries")));
        }
        ranks
            .enumerate()
            .map(|(i, rank)| {
                let a = given.map_or(0, |g| g[i]);
                let r = rank as i64;
                match a {
                    a if (0..r).contains(&a) => Ok(a as usize),
                    a if (-r..0).contains(&a) => Ok((a + r) as usize),
                    a => Err(Error::Model(format!("attribute {name:?}: axis {a} is out of range for rank {rank}"))),
                }
            })
            .collect()
    }

    /// The directions of attribute `name` (default 0 each): 0 forward, 1 reverse.
    fn directions(&self, name: &str, count: usize) -> Result<Vec<i64>> {
        let d = self.ints(name)?.map_or_else(|| vec![0; count], <[i64]>::to_vec);
        if d.len() != count || d.iter().any(|v| !matches!(v, 0 | 1)) {
            return Err(Error::Model(format!("attribute {name:?} must have {count} entries, each 0 or 1")));
        }
        Ok(d)
    }

    /// Errors once `done` body runs reach the limit.
    fn check_limit(&self, done: u64) -> Result<()> {
        if done >= self.limit {
            return Err(Error::Input(format!(
                "the loop needs more than {} iterations, the limit of body runs per loop: raise it with \
                 --max-loop-iterations (SessionOptions::max_loop_iterations)",
                self.limit
            )));
        }
        Ok(())
    }
}

/// The scan loop of Scan: `len` body runs over `states` and slices of `xs`; returns the final
/// states and each scan output's slices in iteration order.
#[allow(clippy::too_many_arguments)]
fn scan_loop(
    body: &mut Body,
    ctx: &Ctx<'_>,
    mut states: Vec<Tensor>,
    xs: &[Tensor],
    (axes, dirs): (&[usize], &[i64]),
    len: usize,
    k: usize,
    report: &mut Report,
) -> Result<(Vec<Tensor>, Vec<Vec<Tensor>>)> {
    let n = states.len();
    if body.sub.formal_inputs != n + xs.len() {
        return Err(Error::Model(format!(
            "the body declares {} inputs; a Scan with {n} state variables and {} scan inputs feeds {}",
            body.sub.formal_inputs,
            xs.len(),
            n + xs.len()
        )));
    }
    let mut scans: Vec<Vec<Tensor>> = vec![Vec::with_capacity(len); k];
    for t in 0..len {
        ctx.check_limit(t as u64)?;
        let mut formal = std::mem::take(&mut states);
        for ((x, &axis), &dir) in xs.iter().zip(axes).zip(dirs) {
            formal.push(slice_axis(x, axis, if dir == 1 { len - 1 - t } else { t })?);
        }
        let outs = body.run_tensors(formal, ctx.outer, report)?;
        if outs.len() != n + k {
            return Err(Error::Model(format!(
                "the body gives {} outputs; a Scan with {n} state variables and {k} scan outputs needs {}",
                outs.len(),
                n + k
            )));
        }
        let mut outs = outs.into_iter();
        states = outs.by_ref().take(n).collect();
        for (s, o) in scans.iter_mut().zip(outs) {
            s.push(o);
        }
    }
    report.control_flow.iterations += len as u64;
    Ok((states, scans))
}

/// The common length of the scan inputs along their scan axes.
fn sequence_length(xs: &[Tensor], axes: &[usize]) -> Result<usize> {
    let lens: Vec<usize> = xs.iter().zip(axes).map(|(x, &a)| x.shape[a]).collect();
    match lens.split_first() {
        Some((first, rest)) if rest.iter().all(|l| l == first) => Ok(*first),
        _ => Err(Error::Model(format!("the scan inputs' lengths along their scan axes differ: {lens:?}"))),
    }
}

/// The value of a single-element condition tensor: bool, or any number (nonzero is true).
fn truth(t: Option<&Tensor>, what: &str) -> Result<bool> {
    let t = t.ok_or_else(|| Error::Model(format!("{what} is left out")))?;
    if t.numel() != 1 {
        return Err(Error::Input(format!("{what} must have one element; it has shape {:?}", t.shape)));
    }
    Ok(t.data.iter().any(|b| *b != 0))
}

/// The value of a single-element int64 (or int32) tensor.
fn scalar_i64(t: &Tensor, what: &str) -> Result<i64> {
    match to_i64_any(t)?.as_slice() {
        [v] => Ok(*v),
        _ => Err(Error::Input(format!("{what} must have one element; it has shape {:?}", t.shape))),
    }
}

/// An int64 or int32 tensor's values.
fn to_i64_any(t: &Tensor) -> Result<Vec<i64>> {
    match t.dtype {
        DType::I32 => Ok(t.data.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64).collect()),
        _ => t.to_i64(),
    }
}

/// A rank-0 tensor of `dtype` holding `bytes`.
fn scalar(dtype: DType, bytes: &[u8]) -> Tensor {
    Tensor { dtype, shape: Vec::new(), data: bytes::Bytes::copy_from_slice(bytes) }
}

/// A scan output of zero iterations: the body's declared type with a 0 inserted at `axis`.
fn empty_scan(body: &Body, output: usize, axis: usize) -> Result<Tensor> {
    let (dtype, mut shape) = body.declared_output(output).ok_or_else(|| {
        Error::Unsupported(format!(
            "the body ran no iteration, and its output {output} declares no full type to give an empty scan output"
        ))
    })?;
    shape.insert(axis.min(shape.len()), 0);
    Tensor::new(dtype, shape, bytes::Bytes::new())
}

/// An error of node `node`'s, its subgraph `attr`'s when given. A node a body's package cannot
/// run is named by its path: `If#0/else_branch/NoSuchOp#0`.
fn at_node(e: Error, node: &Node, attr: Option<&str>) -> Error {
    match (e, attr) {
        (Error::Unresolved { node: inner, detail, others }, Some(a)) => {
            Error::Unresolved { node: format!("{}/{a}/{inner}", node.name), detail, others }
        }
        (e, _) => {
            let sub = attr.map(|a| format!(", subgraph {a:?}")).unwrap_or_default();
            e.context(&format!("node {:?} ({}){sub}: ", node.name, node.op_type))
        }
    }
}

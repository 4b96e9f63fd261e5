//! Ahead-of-run resolution and inference: walks the graph with what is known (declared
//! types, initializers), resolves every node (an op no package provides is an error before
//! any input is read), compiles the packages' shims, and runs shape inference where shapes
//! and value inputs are known, filling the session's inference cache.

use kiln_kernel_abi::DType;
use kiln_registry::NodeQuery;

use crate::model::{Dim, Model};
use crate::{Error, Result};

use super::infer::{Call, InferInput, NodeTypes};
use super::shims::{opset_of, Shims};
use crate::trace::Report;

/// What is known of a value before a run.
#[derive(Clone, Debug, Default)]
pub(super) struct Known {
    pub dtype: Option<DType>,
    /// Fully known shape.
    pub shape: Option<Vec<usize>>,
    /// Bytes, for initializers.
    pub value: Option<bytes::Bytes>,
}

fn known_values(model: &Model) -> Vec<Known> {
    let g = &model.graph;
    let mut known = vec![Known::default(); g.values.len()];
    for (id, v) in g.values.iter().enumerate() {
        if let Some(ty) = v.ty.as_ref().filter(|t| t.kind == crate::model::Kind::Tensor) {
            known[id].dtype = Some(ty.dtype);
            known[id].shape = ty
                .dims
                .as_ref()
                .and_then(|d| d.iter().map(|d| if let Dim::Known(n) = d { Some(*n) } else { None }).collect());
        }
    }
    for (id, t) in &g.initializers {
        known[*id] = Known { dtype: Some(t.dtype), shape: Some(t.shape.clone()), value: Some(t.data.clone()) };
    }
    known
}

/// Resolves every node of `model` and infers what can be known before a run (filling `types`'
/// memo), and folds the nodes whose inputs are all constants into initializers. Returns which
/// nodes were folded. Errors: a node no package runs (with every candidate's reason), or a
/// shim's inference failing on known shapes.
pub(super) fn prepare(
    model: &mut Model,
    types: &mut NodeTypes,
    shims: &mut Shims,
    report: &mut Report,
) -> Result<Vec<bool>> {
    let mut folded = Vec::with_capacity(model.graph.nodes.len());
    let mut known = known_values(model);
    let mut unresolved: Vec<(String, Box<kiln_registry::Unresolved>)> = Vec::new();
    for idx in 0..model.graph.nodes.len() {
        let node = model.graph.nodes[idx].clone();
        folded.push(false);
        if node.is_control_flow() || super::sequence::is_sequence_op(&node) {
            // Run by the executor (`control`, its bodies prepared with their own sessions, and
            // `sequence`).
            continue;
        }
        let ins: Vec<Option<Known>> = node.inputs.iter().map(|i| i.map(|v| known[v].clone())).collect();
        let dtypes: Vec<Option<DType>> = ins.iter().map(|k| k.as_ref().and_then(|k| k.dtype)).collect();
        let rank = ins.iter().flatten().filter_map(|k| k.shape.as_ref().map(Vec::len)).max();
        let opset = opset_of(model, idx)?;
        // Unknown dtypes are not checked here (they are at run time), but the op must exist.
        let q = NodeQuery {
            domain: &node.domain,
            op_type: &node.op_type,
            opset,
            input_dtypes: dtypes,
            max_rank: rank,
            device: types.caps.as_ref(),
        };
        let res = match shims.rt.registry.resolve(&q) {
            Ok(r) => r,
            Err(detail) => {
                // Go on, so that the error names every op the model is missing.
                unresolved.push((node.name.clone(), detail));
                continue;
            }
        };
        shims.rt.module(&res.package)?;
        // Inference needs every dtype and shape, and the bytes of every value input.
        let complete = ins.iter().flatten().all(|k| k.dtype.is_some() && k.shape.is_some())
            && res
                .entry
                .value_inputs
                .iter()
                .all(|&i| ins.get(i).and_then(Option::as_ref).is_none_or(|k| k.value.is_some()));
        if !complete {
            continue;
        }
        // Bytes inline only for the package's value inputs (ABI.md §5): a weight's never are
        // (nor hashed into the inference memo's key).
        let infer_ins: Vec<Option<InferInput>> = ins
            .iter()
            .enumerate()
            .map(|(i, k)| {
                k.as_ref().map(|k| InferInput {
                    dtype: k.dtype.unwrap_or(DType::F32),
                    shape: k.shape.clone().unwrap_or_default(),
                    bytes: k.value.clone().filter(|_| res.entry.value_inputs.contains(&i)),
                })
            })
            .collect();
        let inferred = types.infer(Call { model, shims, report }, idx, &res, &infer_ins)?;
        for (o, inf) in node.outputs.iter().zip(&inferred) {
            if let (Some(v), Some((dtype, shape))) = (o, inf) {
                known[*v].dtype = Some(*dtype);
                known[*v].shape = Some(shape.clone());
            }
        }
        // Constant folding: a node whose every input is a constant runs once, here, through
        // its package's CPU reference; its outputs become initializers.
        if ins.iter().flatten().all(|k| k.value.is_some()) {
            let mut host: Vec<Option<crate::Tensor>> = ins
                .iter()
                .map(|k| k.as_ref().and_then(|k| crate::Tensor::new(k.dtype?, k.shape.clone()?, k.value.clone()?).ok()))
                .collect();
            let outs = shims.run_reference(model, idx, &res, (&mut host, &[]), &inferred, false, report)?;
            for (o, t) in node.outputs.iter().zip(outs) {
                if let (Some(v), Some(t)) = (o, t) {
                    known[*v].value = Some(t.data.clone());
                    model.graph.initializers.insert(*v, t);
                }
            }
            folded[idx] = true;
        }
    }
    unresolved_error(unresolved)?;
    Ok(folded)
}

/// The error for the nodes no package runs (none: `Ok`): the first node's full detail, and
/// every other missing op with its node count and first node.
fn unresolved_error(unresolved: Vec<(String, Box<kiln_registry::Unresolved>)>) -> Result<()> {
    let mut it = unresolved.into_iter();
    let Some((node, detail)) = it.next() else { return Ok(()) };
    let op_name = |d: &kiln_registry::Unresolved| {
        let domain = if d.domain.is_empty() { "ai.onnx" } else { &d.domain };
        format!("{domain}::{}", d.op_type)
    };
    let first = op_name(&detail);
    let mut others: Vec<crate::error::UnresolvedOp> = Vec::new();
    for (n, d) in it {
        let op = op_name(&d);
        if op == first {
            continue;
        }
        match others.iter_mut().find(|o| o.op == op) {
            Some(o) => o.nodes += 1,
            None => others.push(crate::error::UnresolvedOp { op, nodes: 1, first_node: n }),
        }
    }
    Err(Error::Unresolved { node, detail, others })
}

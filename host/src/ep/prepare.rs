//! Ahead-of-run resolution and inference: walks the graph with what is known (declared
//! types, initializers), resolves every node whose input dtypes are known, and runs shape
//! inference where shapes and value inputs are known. Unsupported nodes are found here,
//! before any input is read.

use kiln_kernel_abi::DType;
use kiln_registry::NodeQuery;

use crate::model::{Dim, Model};
use crate::sandbox::{Access, ArgTensor, CallArgs, CallKind};
use crate::{Error, Result};

use super::session::Session;

/// What is known of a value before a run.
#[derive(Clone, Debug, Default)]
pub(super) struct Known {
    pub dtype: Option<DType>,
    /// Fully known shape.
    pub shape: Option<Vec<usize>>,
    /// Bytes, for initializers.
    pub value: Option<bytes::Bytes>,
}

pub(super) fn known_values(model: &Model) -> Vec<Known> {
    let g = &model.graph;
    let mut known = vec![Known::default(); g.values.len()];
    for (id, v) in g.values.iter().enumerate() {
        if let Some(ty) = &v.ty {
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

impl Session {
    /// Resolves and infers what can be known before a run. Errors: a node no package runs
    /// (with every candidate's reason), or a shim's inference failing on known shapes.
    pub(super) fn prepare(&mut self) -> Result<()> {
        let mut known = known_values(&self.model);
        for idx in 0..self.model.graph.nodes.len() {
            let node = self.model.graph.nodes[idx].clone();
            let ins: Vec<Option<&Known>> = node.inputs.iter().map(|i| i.map(|v| &known[v])).collect();
            if ins.iter().flatten().any(|k| k.dtype.is_none()) {
                continue;
            }
            let dtypes: Vec<Option<DType>> = ins.iter().map(|k| k.and_then(|k| k.dtype)).collect();
            let rank = ins.iter().flatten().filter_map(|k| k.shape.as_ref().map(Vec::len)).max();
            let opset = self.opset_of(idx)?;
            let q = NodeQuery {
                domain: &node.domain,
                op_type: &node.op_type,
                opset,
                input_dtypes: dtypes,
                max_rank: rank,
                device: None,
            };
            let res =
                self.rt.registry.resolve(&q).map_err(|detail| Error::Unresolved { node: node.label(idx), detail })?;
            // Compile the shim now rather than during the first run.
            self.rt.module(&res.package)?;
            // Inference needs every shape, and the bytes of every value input.
            let value_ok =
                res.entry.value_inputs.iter().all(|&i| ins.get(i).copied().flatten().is_none_or(|k| k.value.is_some()));
            if !value_ok || ins.iter().flatten().any(|k| k.shape.is_none()) {
                continue;
            }
            let args = CallArgs {
                domain: &node.domain,
                op_type: &node.op_type,
                opset,
                node_name: &node.name,
                attributes: node.wire_attributes(),
                inputs: ins
                    .iter()
                    .enumerate()
                    .map(|(i, k)| {
                        k.map(|k| {
                            let shape = k.shape.clone().unwrap_or_default();
                            ArgTensor {
                                dtype: k.dtype,
                                dims: Some(shape.iter().map(|&d| d as i64).collect()),
                                value: if res.entry.value_inputs.contains(&i) { k.value.as_deref() } else { None },
                                nbytes: 0,
                                access: Access::Opaque,
                            }
                        })
                    })
                    .collect(),
                outputs: node
                    .outputs
                    .iter()
                    .map(|o| {
                        o.map(|_| ArgTensor { dtype: None, dims: None, value: None, nbytes: 0, access: Access::Opaque })
                    })
                    .collect(),
            };
            let outcome = self.call_shim(&res.package, CallKind::Infer, args)?;
            for (o, inf) in node.outputs.iter().zip(outcome.inferred) {
                if let (Some(v), Some((dtype, shape))) = (o, inf) {
                    known[*v].dtype = Some(dtype);
                    known[*v].shape = Some(shape);
                }
            }
        }
        Ok(())
    }
}

//! Resolution and shape inference of a session's nodes, memoized: which package runs a node
//! for its input dtypes and rank (`kiln_registry::OpRegistry::resolve`), and the output types
//! its shim's `kiln_infer` gives for its input types and value inputs (a pure function of
//! them, ABI.md §3).

use std::collections::HashMap;
use std::sync::Arc;

use kiln_kernel_abi::DType;
use kiln_registry::{DeviceCaps, NodeQuery, OpRegistry, Resolution};

use super::shims::{node_call, opset_of, Shims};
use crate::model::Model;
use crate::sandbox::{Access, ArgTensor, CallKind};
use crate::tensor::{byte_size, least_byte_size};
use crate::trace::Report;
use crate::{Error, Result};

/// The memo key of a node's inference and launch plan.
pub(super) fn infer_key(idx: usize, inputs: &[Option<InferInput>]) -> InferKey {
    let mut value_bytes = Vec::new();
    for i in inputs.iter().flatten() {
        if let Some(b) = &i.bytes {
            value_bytes.extend_from_slice(&(b.len() as u64).to_le_bytes());
            value_bytes.extend_from_slice(b);
        }
    }
    (idx, inputs.iter().map(|i| i.as_ref().map(|i| (i.dtype, i.shape.clone()))).collect(), value_bytes)
}

/// Key of a run-time resolution: node, input dtypes, largest rank.
type ResolveKey = (usize, Vec<Option<DType>>, usize);

/// Key of an inference result: node, input dtypes and shapes, value inputs' bytes.
pub(super) type InferKey = (usize, Vec<Option<(DType, Vec<usize>)>>, Vec<u8>);

/// Inferred dtype and shape of each output (`None`: absent).
pub(super) type OutputTypes = Vec<Option<(DType, Vec<usize>)>>;

/// Most inference results kept per session.
pub(super) const INFER_CACHE_ENTRIES: usize = 8192;

/// An input as inference sees it; `bytes` are used only for the package's value inputs.
#[derive(Clone, Debug)]
pub(super) struct InferInput {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Option<bytes::Bytes>,
}

impl InferInput {
    /// The input as a shim sees it in inference and dispatch: dtype, shape, inline value
    /// bytes, no reachable data.
    pub fn opaque_arg(&self) -> ArgTensor<'_> {
        ArgTensor {
            dtype: Some(self.dtype),
            dims: Some(self.shape.iter().map(|&d| d as i64).collect()),
            value: self.bytes.as_deref(),
            nbytes: byte_size(self.dtype, &self.shape).unwrap_or(0),
            access: Access::Opaque,
            paged: None,
            constant: false,
            in_place_of: None,
        }
    }
}

/// A node's resolution and its package id for the report (`NAME@VERSION`, then ` (unsigned)` for
/// a registry's package without a signature, which runs only under `--allow-unsigned`), shared by
/// the memo.
pub(super) struct Resolved {
    pub res: Resolution,
    pub package_id: String,
}

/// What a shim call needs of its session: the model, the shims, the report its calls count in.
pub(super) struct Call<'a> {
    pub model: &'a Model,
    pub shims: &'a mut Shims,
    pub report: &'a mut Report,
}

/// A node's last resolution and inference ([`NodeTypes::last`]).
#[derive(Default)]
struct LastTypes {
    resolved: Option<(ResolveKey, Arc<Resolved>)>,
    inferred: Option<(InferKey, OutputTypes)>,
}

/// The memoized resolutions and inferred types of one session's nodes.
pub(super) struct NodeTypes {
    resolutions: HashMap<ResolveKey, Arc<Resolved>>,
    /// Shims' inference is a pure function of the node and its inputs (ABI.md §3).
    inferred: HashMap<InferKey, OutputTypes>,
    /// Per node, its last resolution and inference: a decode step's nodes see the same inputs as
    /// the step before, found by comparing keys rather than hashing them.
    last: Vec<LastTypes>,
    /// What the session's GPU offers packages (`None` on the CPU, where device requirements do
    /// not apply).
    pub caps: Option<DeviceCaps>,
    /// Largest tensor a node may produce, in bytes.
    max_tensor_bytes: u64,
}

impl NodeTypes {
    pub fn new(caps: Option<DeviceCaps>, max_tensor_bytes: u64) -> NodeTypes {
        NodeTypes { resolutions: HashMap::new(), inferred: HashMap::new(), last: Vec::new(), caps, max_tensor_bytes }
    }

    /// The package that runs node `idx` of `model` with these input dtypes and largest rank
    /// (memoized). Errors: none does, with every candidate's reason.
    pub fn resolve(
        &mut self,
        model: &Model,
        registry: &OpRegistry,
        idx: usize,
        dtypes: Vec<Option<DType>>,
        rank: usize,
    ) -> Result<Arc<Resolved>> {
        let key = (idx, dtypes, rank);
        if let Some((k, r)) = self.last.get(idx).and_then(|l| l.resolved.as_ref()) {
            if *k == key {
                return Ok(r.clone());
            }
        }
        if let Some(r) = self.resolutions.get(&key) {
            let r = r.clone();
            self.last_of(idx).resolved = Some((key, r.clone()));
            return Ok(r);
        }
        let node = &model.graph.nodes[idx];
        let opset = opset_of(model, idx)?;
        let q = NodeQuery {
            domain: &node.domain,
            op_type: &node.op_type,
            opset,
            input_dtypes: key.1.clone(),
            max_rank: Some(rank),
            device: self.caps.as_ref(),
        };
        let res = registry.resolve(&q).map_err(|detail| Error::Unresolved {
            node: node.name.clone(),
            detail,
            others: Vec::new(),
        })?;
        // A registry's package without a signature ran only under --allow-unsigned: the report
        // says so.
        let from_registry = res.precedence > kiln_registry::BUILTIN && res.precedence < kiln_registry::USER;
        let package_id = match (from_registry, &res.package.signer) {
            (true, None) => format!("{} (unsigned)", res.package.id()),
            _ => res.package.id(),
        };
        let r = Arc::new(Resolved { package_id, res });
        self.resolutions.insert(key.clone(), r.clone());
        self.last_of(idx).resolved = Some((key, r.clone()));
        Ok(r)
    }

    /// Node `idx`'s last resolution and inference, made where missing.
    fn last_of(&mut self, idx: usize) -> &mut LastTypes {
        if self.last.len() <= idx {
            self.last.resize_with(idx + 1, LastTypes::default);
        }
        &mut self.last[idx]
    }

    /// Output types of node `idx` for these inputs: from the cache, or from the shim's
    /// `kiln_infer`. Checks the outputs against the package's `max_rank` and the session's
    /// tensor size limit.
    pub fn infer(
        &mut self,
        at: Call<'_>,
        idx: usize,
        res: &Resolution,
        inputs: &[Option<InferInput>],
    ) -> Result<OutputTypes> {
        let key = infer_key(idx, inputs);
        self.infer_keyed(at, idx, res, inputs, key)
    }

    /// [`NodeTypes::infer`] with the memo key already made.
    pub fn infer_keyed(
        &mut self,
        at: Call<'_>,
        idx: usize,
        res: &Resolution,
        inputs: &[Option<InferInput>],
        key: InferKey,
    ) -> Result<OutputTypes> {
        if let Some((k, t)) = self.last.get(idx).and_then(|l| l.inferred.as_ref()) {
            if *k == key {
                return Ok(t.clone());
            }
        }
        if let Some(t) = self.inferred.get(&key) {
            let t = t.clone();
            self.last_of(idx).inferred = Some((key, t.clone()));
            return Ok(t);
        }
        let Call { model, shims, report } = at;
        let opset = opset_of(model, idx)?;
        let node = &model.graph.nodes[idx];
        let args = node_call(
            node,
            opset,
            inputs.iter().map(|i| i.as_ref().map(InferInput::opaque_arg)).collect(),
            node.outputs
                .iter()
                .map(|o| {
                    o.map(|_| ArgTensor {
                        dtype: None,
                        dims: None,
                        value: None,
                        nbytes: 0,
                        access: Access::Opaque,
                        paged: None,
                        constant: false,
                        in_place_of: None,
                    })
                })
                .collect(),
        );
        let inferred = shims.call(&res.package, CallKind::Infer, args, report)?.inferred;
        let mut out = Vec::with_capacity(node.outputs.len());
        for (i, o) in node.outputs.iter().enumerate() {
            out.push(match (o, inferred.get(i).cloned().flatten()) {
                (None, _) => None,
                (Some(_), Some((dtype, shape))) => {
                    if shape.len() > res.entry.max_rank {
                        return Err(Error::Unsupported(format!(
                            "node {:?}: output {i} has rank {}, over {}'s max_rank {}",
                            node.name,
                            shape.len(),
                            res.package.id(),
                            res.entry.max_rank
                        )));
                    }
                    let nbytes = least_byte_size(dtype, &shape).map_err(|_| {
                        Error::Model(format!(
                            "node {:?}: output {i} would be {dtype} {shape:?}, larger than memory can address",
                            node.name
                        ))
                    })?;
                    if nbytes > self.max_tensor_bytes {
                        return Err(Error::Model(format!(
                            "node {:?}: output {i} would be {dtype} {shape:?} ({nbytes} bytes), over the limit of {} bytes per tensor",
                            node.name, self.max_tensor_bytes
                        )));
                    }
                    Some((dtype, shape))
                }
                (Some(_), None) => return Err(Error::Model(format!("node {:?}: output {i} has no inferred type", node.name))),
            });
        }
        if self.inferred.len() >= INFER_CACHE_ENTRIES {
            self.inferred.clear();
        }
        self.inferred.insert(key.clone(), out.clone());
        self.last_of(idx).inferred = Some((key, out.clone()));
        Ok(out)
    }
}

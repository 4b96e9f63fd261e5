//! A model on a device: runs the graph node by node through the packages' shims.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kiln_kernel_abi::DType;
use kiln_registry::{NodeQuery, Package, Resolution};

use crate::model::{Model, ValueId};
use crate::sandbox::{Access, ArgTensor, CallArgs, CallKind, CallOutcome, ShimInstance};
use crate::tensor::byte_size;
use crate::trace::Report;
use crate::{cpu, Error, Result, Tensor};

use super::{Device, Runtime};

/// Options of a session.
#[derive(Clone, Debug)]
pub struct SessionOptions {
    pub device: Device,
    /// Largest tensor a node may produce, in bytes.
    pub max_tensor_bytes: u64,
    /// On the CPU, also run every node's `kiln_dispatch` and validate its launch plan (kernels
    /// declared, launch dimensions and operand extents in bounds) without a GPU. Dispatches a
    /// package does not implement are counted in the report, others fail the node.
    pub check_dispatch: bool,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions { device: Device::Cpu, max_tensor_bytes: crate::model::MAX_TENSOR_BYTES, check_dispatch: false }
    }
}

/// Key of a run-time resolution: node, input dtypes, largest rank.
type ResolveKey = (usize, Vec<Option<DType>>, usize);

/// Key of an inference result: node, input dtypes and shapes, value inputs' bytes.
type InferKey = (usize, Vec<Option<(DType, Vec<usize>)>>, Vec<u8>);

/// Inferred dtype and shape of each output (`None`: absent).
pub(super) type OutputTypes = Vec<Option<(DType, Vec<usize>)>>;

/// Most inference results kept per session.
const INFER_CACHE_ENTRIES: usize = 8192;

/// An input as inference sees it; `bytes` are used only for the package's value inputs.
#[derive(Clone, Debug)]
pub(super) struct InferInput {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Option<bytes::Bytes>,
}

/// One model, prepared for one device.
pub struct Session {
    pub(super) rt: Arc<Runtime>,
    pub(super) model: Model,
    options: SessionOptions,
    instances: HashMap<String, ShimInstance>,
    resolutions: HashMap<ResolveKey, Resolution>,
    /// Shims' inference is a pure function of the node and its inputs (ABI.md §3).
    inferred: HashMap<InferKey, OutputTypes>,
    /// Largest tensor a node may produce, in bytes.
    max_tensor_bytes: u64,
    /// For each value, the index of the last node that reads it (graph outputs: never freed).
    last_use: Vec<Option<usize>>,
    pub report: Report,
}

/// Largest rank among tensors.
pub(super) fn rank_of<'a>(ts: impl Iterator<Item = &'a Tensor>) -> usize {
    ts.map(|t| t.shape.len()).max().unwrap_or(0)
}

impl Session {
    /// Prepares `model`: resolves every node whose dtypes are known and infers shapes
    /// ahead of the run (see `prepare`).
    pub fn new(rt: Arc<Runtime>, model: Model, options: SessionOptions) -> Result<Session> {
        let g = &model.graph;
        let mut last_use = vec![None; g.values.len()];
        for (i, n) in g.nodes.iter().enumerate() {
            for v in n.inputs.iter().flatten() {
                last_use[*v] = Some(i);
            }
        }
        for v in &g.outputs {
            last_use[*v] = Some(usize::MAX);
        }
        let report = Report { device: options.device.to_string(), ..Report::default() };
        // On the CPU a tensor must fit in a shim's linear memory to be computed at all.
        let max_tensor_bytes = match options.device {
            Device::Cpu => options.max_tensor_bytes.min(rt.sandbox.config().memory_limit_bytes as u64),
        };
        let mut s = Session {
            rt,
            model,
            options,
            instances: HashMap::new(),
            resolutions: HashMap::new(),
            inferred: HashMap::new(),
            max_tensor_bytes,
            last_use,
            report,
        };
        s.prepare()?;
        Ok(s)
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    pub(super) fn opset_of(&self, node: usize) -> Result<i64> {
        let n = &self.model.graph.nodes[node];
        self.model.opset(&n.domain).ok_or_else(|| {
            Error::Model(format!(
                "node {:?} uses domain {:?}, which the model does not import (opset_import)",
                n.name.clone(),
                n.domain
            ))
        })
    }

    /// Calls a shim export, instantiating the package's shim on first use and discarding
    /// the instance after a failure.
    pub(super) fn call_shim(&mut self, pkg: &Package, kind: CallKind, args: CallArgs<'_>) -> Result<CallOutcome> {
        let id = pkg.id();
        if !self.instances.contains_key(&id) {
            let inst = self.rt.module(pkg)?.instantiate()?;
            self.report.instances += 1;
            self.instances.insert(id.clone(), inst);
        }
        match kind {
            CallKind::Infer => self.report.wasm_calls.infer += 1,
            CallKind::Cpu => self.report.wasm_calls.cpu += 1,
            CallKind::Dispatch => self.report.wasm_calls.dispatch += 1,
        }
        let inst = self.instances.get_mut(&id).ok_or_else(|| Error::Device("shim instance vanished".into()))?;
        inst.call(kind, args).map_err(|f| {
            self.instances.remove(&id);
            Error::from(f)
        })
    }

    fn resolve(&mut self, idx: usize, inputs: &[Option<&Tensor>]) -> Result<Resolution> {
        let dtypes: Vec<Option<DType>> = inputs.iter().map(|t| t.map(|t| t.dtype)).collect();
        let rank = rank_of(inputs.iter().flatten().copied());
        let key = (idx, dtypes.clone(), rank);
        if let Some(r) = self.resolutions.get(&key) {
            return Ok(r.clone());
        }
        let node = &self.model.graph.nodes[idx];
        let opset = self.opset_of(idx)?;
        let q = NodeQuery {
            domain: &node.domain,
            op_type: &node.op_type,
            opset,
            input_dtypes: dtypes,
            max_rank: Some(rank),
            device: None,
        };
        let r = self.rt.registry.resolve(&q).map_err(|detail| Error::Unresolved { node: node.name.clone(), detail })?;
        self.resolutions.insert(key, r.clone());
        Ok(r)
    }

    /// Runs the graph on `feeds` (graph input name → tensor) and returns the graph outputs
    /// in order. Every graph input must be fed (initializers may be overridden).
    pub fn run(&mut self, feeds: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        let start = Instant::now();
        let g = &self.model.graph;
        let mut values: Vec<Option<Tensor>> = vec![None; g.values.len()];
        for (id, t) in &g.initializers {
            values[*id] = Some(t.clone());
        }
        for (name, t) in feeds {
            let id = g
                .value_id(&name)
                .filter(|id| g.inputs.contains(id) || g.initializers.contains_key(id))
                .ok_or_else(|| {
                    let names: Vec<&str> = g.inputs.iter().map(|i| g.values[*i].name.as_str()).collect();
                    Error::Input(format!("the model has no input {name:?} (its inputs: {names:?})"))
                })?;
            if let Some(ty) = &g.values[id].ty {
                if ty.dtype != t.dtype {
                    return Err(Error::Input(format!("input {name:?} must be {}, not {}", ty.dtype, t.dtype)));
                }
            }
            values[id] = Some(t);
        }
        if let Some(missing) = g.inputs.iter().find(|i| values[**i].is_none()) {
            return Err(Error::Input(format!("input {:?} was not given", g.values[*missing].name)));
        }
        for idx in 0..self.model.graph.nodes.len() {
            let t0 = Instant::now();
            let (op, pkg) = self.run_node(idx, &mut values)?;
            self.report.record_node(&op, &pkg, t0.elapsed());
            // Release intermediates after their last use, and outputs nobody reads at once.
            let node = &self.model.graph.nodes[idx];
            for v in node.inputs.iter().flatten() {
                if self.last_use[*v] == Some(idx) && !self.model.graph.initializers.contains_key(v) {
                    values[*v] = None;
                }
            }
            for v in node.outputs.iter().flatten() {
                if self.last_use[*v].is_none() {
                    values[*v] = None;
                }
            }
        }
        let g = &self.model.graph;
        let mut outs = Vec::with_capacity(g.outputs.len());
        for &o in &g.outputs {
            let t = values[o]
                .clone()
                .ok_or_else(|| Error::Model(format!("graph output {:?} was not computed", g.values[o].name)))?;
            outs.push((g.values[o].name.clone(), t));
        }
        self.report.runs += 1;
        self.report.run_time_us += start.elapsed().as_micros() as u64;
        Ok(outs)
    }

    /// Output types of node `idx` for these inputs: from the cache, or from the shim's
    /// `kiln_infer`. Checks the outputs against the package's `max_rank` and the session's
    /// tensor size limit.
    pub(super) fn infer(&mut self, idx: usize, res: &Resolution, inputs: &[Option<InferInput>]) -> Result<OutputTypes> {
        let mut value_bytes = Vec::new();
        for i in inputs.iter().flatten() {
            if let Some(b) = &i.bytes {
                value_bytes.extend_from_slice(&(b.len() as u64).to_le_bytes());
                value_bytes.extend_from_slice(b);
            }
        }
        let key: InferKey =
            (idx, inputs.iter().map(|i| i.as_ref().map(|i| (i.dtype, i.shape.clone()))).collect(), value_bytes);
        if let Some(t) = self.inferred.get(&key) {
            return Ok(t.clone());
        }
        let opset = self.opset_of(idx)?;
        let node = self.model.graph.nodes[idx].clone();
        let args = CallArgs {
            domain: &node.domain,
            op_type: &node.op_type,
            opset,
            node_name: &node.name,
            attributes: node.wire_attributes(),
            inputs: inputs
                .iter()
                .map(|i| {
                    i.as_ref().map(|i| ArgTensor {
                        dtype: Some(i.dtype),
                        dims: Some(i.shape.iter().map(|&d| d as i64).collect()),
                        value: i.bytes.as_deref(),
                        nbytes: byte_size(i.dtype, &i.shape).unwrap_or(0),
                        access: Access::Opaque,
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
        let inferred = self.call_shim(&res.package, CallKind::Infer, args)?.inferred;
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
                    let nbytes = byte_size(dtype, &shape)?;
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
        self.inferred.insert(key, out.clone());
        Ok(out)
    }

    /// Infers and executes node `idx`; returns (op type, package id).
    fn run_node(&mut self, idx: usize, values: &mut [Option<Tensor>]) -> Result<(String, String)> {
        let model = &self.model;
        let node = &model.graph.nodes[idx];
        let label = node.name.clone();
        let mut inputs: Vec<Option<&Tensor>> = Vec::with_capacity(node.inputs.len());
        for v in &node.inputs {
            inputs.push(match v {
                None => None,
                Some(v) => Some(values[*v].as_ref().ok_or_else(|| {
                    Error::Model(format!(
                        "node {label:?} reads {:?} before it is computed",
                        model.graph.values[*v].name
                    ))
                })?),
            });
        }
        let inputs: Vec<Option<Tensor>> = inputs.into_iter().map(|t| t.cloned()).collect();
        let refs: Vec<Option<&Tensor>> = inputs.iter().map(Option::as_ref).collect();
        let res = self.resolve(idx, &refs)?;
        let opset = self.opset_of(idx)?;
        let node = self.model.graph.nodes[idx].clone();
        let value_inputs = res.entry.value_inputs.clone();
        fn arg<'t>(value_inputs: &[usize], i: usize, t: &'t Tensor, access: Access) -> ArgTensor<'t> {
            ArgTensor {
                dtype: Some(t.dtype),
                dims: Some(t.dims_i64()),
                value: if value_inputs.contains(&i) { Some(&t.data[..]) } else { None },
                nbytes: t.data.len() as u64,
                access,
            }
        }
        let infer_ins: Vec<Option<InferInput>> = refs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.map(|t| InferInput {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    bytes: value_inputs.contains(&i).then(|| t.data.clone()),
                })
            })
            .collect();
        let out_types = self.infer(idx, &res, &infer_ins)?;
        let outputs = match self.options.device {
            Device::Cpu => {
                let args = CallArgs {
                    domain: &node.domain,
                    op_type: &node.op_type,
                    opset,
                    node_name: &node.name,
                    attributes: node.wire_attributes(),
                    inputs: refs
                        .iter()
                        .enumerate()
                        .map(|(i, t)| t.map(|t| arg(&value_inputs, i, t, Access::Read(t.data.clone()))))
                        .collect(),
                    outputs: cpu::output_args(&out_types),
                };
                let n_in = refs.iter().flatten().count();
                let outcome = self.call_shim(&res.package, CallKind::Cpu, args)?;
                let outputs = cpu::collect_outputs(outcome, n_in, &out_types)?;
                if self.options.check_dispatch {
                    let opaque = |t: &Tensor| ArgTensor {
                        dtype: Some(t.dtype),
                        dims: Some(t.dims_i64()),
                        value: None,
                        nbytes: t.data.len() as u64,
                        access: Access::Opaque,
                    };
                    let args = CallArgs {
                        domain: &node.domain,
                        op_type: &node.op_type,
                        opset,
                        node_name: &node.name,
                        attributes: node.wire_attributes(),
                        inputs: refs.iter().enumerate().map(|(i, t)| t.map(|t| ArgTensor { value: value_inputs.contains(&i).then_some(&t.data[..]), ..opaque(t) })).collect(),
                        outputs: outputs.iter().map(|t| t.as_ref().map(opaque)).collect(),
                    };
                    match self.call_shim(&res.package, CallKind::Dispatch, args) {
                        Ok(o) => self.report.dispatch_steps += o.plan.steps.len() as u64,
                        Err(e) if e.is_unsupported() => {
                            *self.report.dispatch_unsupported.entry(node.op_type.clone()).or_default() += 1;
                        }
                        Err(e) => return Err(e),
                    }
                }
                outputs
            }
        };
        for (o, t) in node.outputs.iter().zip(outputs) {
            if let (Some(v), Some(t)) = (o, t) {
                values[*v] = Some(t);
            }
        }
        Ok((node.op_type.clone(), res.package.id()))
    }

    /// Names and declared types of the graph inputs.
    pub fn input_names(&self) -> Vec<String> {
        self.model.graph.inputs.iter().map(|i| self.model.graph.values[*i].name.clone()).collect()
    }

    /// The value ids of the graph outputs.
    pub fn output_ids(&self) -> &[ValueId] {
        &self.model.graph.outputs
    }
}

//! A model on a device: runs the graph node by node through the packages' shims.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kiln_kernel_abi::DType;
use kiln_registry::{NodeQuery, Package, Resolution};

use crate::cuda::{DevBuffer, Gpu};
use crate::model::{Model, ValueId};
use crate::sandbox::{Access, ArgTensor, CallArgs, CallKind, CallOutcome, LaunchPlan, ShimInstance};
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
    /// Most device memory the session may allocate, in bytes (default: all of it).
    pub device_memory_limit: Option<u64>,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            device: Device::Cpu,
            max_tensor_bytes: crate::model::MAX_TENSOR_BYTES,
            check_dispatch: false,
            device_memory_limit: None,
        }
    }
}

/// A value during a run: host bytes, or a device buffer (owned by the value, or resident).
#[derive(Debug)]
pub(super) enum Value {
    Host(Tensor),
    Device {
        dtype: DType,
        shape: Vec<usize>,
        ptr: cudarc::driver::sys::CUdeviceptr,
        /// Logical size in bytes.
        nbytes: u64,
        /// The buffer, when this value owns it (freed to the pool with the value).
        owned: Option<DevBuffer>,
        /// The host bytes, when the value came from the host.
        host: Option<Tensor>,
    },
}

impl Value {
    fn dtype(&self) -> DType {
        match self {
            Value::Host(t) => t.dtype,
            Value::Device { dtype, .. } => *dtype,
        }
    }

    fn shape(&self) -> &[usize] {
        match self {
            Value::Host(t) => &t.shape,
            Value::Device { shape, .. } => shape,
        }
    }

    /// The same value without ownership of its buffer.
    fn clone_ref(&self) -> Value {
        match self {
            Value::Host(t) => Value::Host(t.clone()),
            Value::Device { dtype, shape, ptr, nbytes, host, .. } => Value::Device {
                dtype: *dtype,
                shape: shape.clone(),
                ptr: *ptr,
                nbytes: *nbytes,
                owned: None,
                host: host.clone(),
            },
        }
    }
}

/// The call of `node` with these inputs and outputs.
fn node_call<'a>(
    node: &'a crate::model::Node,
    opset: i64,
    inputs: Vec<Option<ArgTensor<'a>>>,
    outputs: Vec<Option<ArgTensor<'a>>>,
) -> CallArgs<'a> {
    CallArgs {
        domain: &node.domain,
        op_type: &node.op_type,
        opset,
        node_name: &node.name,
        attributes: node.wire_attributes(),
        inputs,
        outputs,
    }
}

/// A host tensor as a call argument, with its bytes inline when it is a value input.
fn tensor_arg(t: &Tensor, value_input: bool, access: Access) -> ArgTensor<'_> {
    ArgTensor {
        dtype: Some(t.dtype),
        dims: Some(t.dims_i64()),
        value: value_input.then_some(&t.data[..]),
        nbytes: t.data.len() as u64,
        access,
    }
}

/// The memo key of a node's inference and launch plan.
fn infer_key(idx: usize, inputs: &[Option<InferInput>]) -> InferKey {
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

impl InferInput {
    /// The input as a shim sees it in inference and dispatch: dtype, shape, inline value
    /// bytes, no reachable data.
    fn opaque_arg(&self) -> ArgTensor<'_> {
        ArgTensor {
            dtype: Some(self.dtype),
            dims: Some(self.shape.iter().map(|&d| d as i64).collect()),
            value: self.bytes.as_deref(),
            nbytes: byte_size(self.dtype, &self.shape).unwrap_or(0),
            access: Access::Opaque,
        }
    }
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
    /// Launch plans, memoized the same way: later runs launch without entering Wasm.
    plans: HashMap<InferKey, LaunchPlan>,
    /// The GPU of a CUDA session.
    gpu: Option<Gpu>,
    /// Device copies of the initializers (resident weights): pointer and size.
    device_values: HashMap<ValueId, (cudarc::driver::sys::CUdeviceptr, u64)>,
    /// The buffers behind `device_values`, freed with the session.
    resident_buffers: Vec<DevBuffer>,
    /// Nodes computed once at preparation (constant folding).
    pub(super) folded: Vec<bool>,
    /// Largest tensor a node may produce, in bytes.
    max_tensor_bytes: u64,
    /// For each value, the index of the last node that reads it (graph outputs: never freed).
    last_use: Vec<Option<usize>>,
    pub report: Report,
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(gpu) = self.gpu.as_mut() {
            for b in self.resident_buffers.drain(..) {
                gpu.alloc.free(b);
            }
        }
    }
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
            Device::Cuda(_) => options.max_tensor_bytes,
        };
        let gpu = match options.device {
            Device::Cpu => None,
            Device::Cuda(ordinal) => Some(Gpu::open(ordinal, options.device_memory_limit)?),
        };
        let folded = vec![false; g.nodes.len()];
        let mut s = Session {
            rt,
            model,
            options,
            instances: HashMap::new(),
            resolutions: HashMap::new(),
            inferred: HashMap::new(),
            plans: HashMap::new(),
            gpu,
            device_values: HashMap::new(),
            resident_buffers: Vec::new(),
            folded,
            max_tensor_bytes,
            last_use,
            report,
        };
        s.prepare()?;
        s.upload_initializers()?;
        Ok(s)
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// What the session's GPU offers packages (`None` on the CPU, where device requirements
    /// do not apply).
    pub(super) fn device_caps(&self) -> Option<kiln_registry::DeviceCaps> {
        self.gpu.as_ref().map(|g| kiln_registry::DeviceCaps {
            compute_capability: g.info.compute_capability,
            features: g.info.features(),
        })
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

    fn resolve(&mut self, idx: usize, dtypes: Vec<Option<DType>>, rank: usize) -> Result<Resolution> {
        let key = (idx, dtypes.clone(), rank);
        if let Some(r) = self.resolutions.get(&key) {
            return Ok(r.clone());
        }
        let node = &self.model.graph.nodes[idx];
        let opset = self.opset_of(idx)?;
        let caps = self.device_caps();
        let q = NodeQuery {
            domain: &node.domain,
            op_type: &node.op_type,
            opset,
            input_dtypes: dtypes,
            max_rank: Some(rank),
            device: caps.as_ref(),
        };
        let r = self.rt.registry.resolve(&q).map_err(|detail| Error::Unresolved { node: node.name.clone(), detail })?;
        self.resolutions.insert(key, r.clone());
        Ok(r)
    }

    /// Runs the graph on `feeds` (graph input name → tensor) and returns the graph outputs
    /// in order. Every graph input must be fed (initializers listed as inputs may be).
    pub fn run(&mut self, feeds: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        let start = Instant::now();
        let g = &self.model.graph;
        let mut values: Vec<Option<Value>> = (0..g.values.len()).map(|_| None).collect();
        for (name, t) in feeds {
            let id = g.value_id(&name).filter(|id| g.inputs.contains(id)).ok_or_else(|| {
                let names: Vec<&str> = g.inputs.iter().map(|i| g.values[*i].name.as_str()).collect();
                Error::Input(format!("the model has no input {name:?} (its inputs: {names:?})"))
            })?;
            if let Some(ty) = &g.values[id].ty {
                if ty.dtype != t.dtype {
                    return Err(Error::Input(format!("input {name:?} must be {}, not {}", ty.dtype, t.dtype)));
                }
                if let Some(dims) = &ty.dims {
                    let fits = dims.len() == t.shape.len()
                        && dims.iter().zip(&t.shape).all(|(d, n)| !matches!(d, crate::model::Dim::Known(k) if k != n));
                    if !fits {
                        return Err(Error::Input(format!(
                            "input {name:?} has shape {:?}; the model declares {dims:?}",
                            t.shape
                        )));
                    }
                }
            }
            values[id] = Some(Value::Host(t));
        }
        if let Some(missing) = g.inputs.iter().find(|i| values[**i].is_none()) {
            return Err(Error::Input(format!("input {:?} was not given", g.values[*missing].name)));
        }
        if self.gpu.is_some() {
            for v in values.iter_mut() {
                if let Some(val @ Value::Host(_)) = v {
                    let d = self.on_device(val)?;
                    *v = Some(d);
                }
            }
        }
        let result = self.run_nodes(&mut values);
        // Return every device buffer of the run to the pool, whatever happened.
        let mut outs = Vec::with_capacity(self.model.graph.outputs.len());
        if result.is_ok() {
            for &o in &self.model.graph.outputs.clone() {
                let name = self.model.graph.values[o].name.clone();
                let v = values[o].take().or_else(|| self.resident(o));
                match v {
                    Some(v) => {
                        let t = self.host_tensor(&v);
                        self.release(v);
                        outs.push((name, t?));
                    }
                    None => return Err(Error::Model(format!("graph output {name:?} was not computed"))),
                }
            }
        }
        for v in values.into_iter().flatten() {
            self.release(v);
        }
        result?;
        self.report.runs += 1;
        self.report.run_time_us += start.elapsed().as_micros() as u64;
        Ok(outs)
    }

    fn run_nodes(&mut self, values: &mut [Option<Value>]) -> Result<()> {
        for idx in 0..self.model.graph.nodes.len() {
            if self.folded[idx] {
                continue;
            }
            let t0 = Instant::now();
            let (op, pkg) = self.run_node(idx, values)?;
            self.report.record_node(&op, &pkg, t0.elapsed());
            // Release intermediates after their last use, and outputs nobody reads at once.
            let node = &self.model.graph.nodes[idx];
            let mut dead: Vec<ValueId> =
                node.inputs.iter().flatten().copied().filter(|v| self.last_use[*v] == Some(idx)).collect();
            dead.extend(node.outputs.iter().flatten().copied().filter(|v| self.last_use[*v].is_none()));
            for v in dead {
                if let Some(val) = values[v].take() {
                    self.release(val);
                }
            }
        }
        Ok(())
    }

    /// Output types of node `idx` for these inputs: from the cache, or from the shim's
    /// `kiln_infer`. Checks the outputs against the package's `max_rank` and the session's
    /// tensor size limit.
    pub(super) fn infer(&mut self, idx: usize, res: &Resolution, inputs: &[Option<InferInput>]) -> Result<OutputTypes> {
        let key = infer_key(idx, inputs);
        if let Some(t) = self.inferred.get(&key) {
            return Ok(t.clone());
        }
        let opset = self.opset_of(idx)?;
        let node = self.model.graph.nodes[idx].clone();
        let args = node_call(
            &node,
            opset,
            inputs.iter().map(|i| i.as_ref().map(InferInput::opaque_arg)).collect(),
            node.outputs
                .iter()
                .map(|o| {
                    o.map(|_| ArgTensor { dtype: None, dims: None, value: None, nbytes: 0, access: Access::Opaque })
                })
                .collect(),
        );
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

    /// Uploads every initializer to the GPU once (resident weights).
    fn upload_initializers(&mut self) -> Result<()> {
        let Some(gpu) = self.gpu.as_mut() else { return Ok(()) };
        for (id, t) in &self.model.graph.initializers {
            let b = gpu.upload(t)?;
            self.device_values.insert(*id, (b.ptr, t.data.len() as u64));
            self.resident_buffers.push(b);
        }
        gpu.synchronize()
    }

    /// The resident value of an initializer (host tensor on the CPU, device buffer on a GPU).
    fn resident(&self, v: ValueId) -> Option<Value> {
        let t = self.model.graph.initializers.get(&v)?;
        Some(match self.device_values.get(&v) {
            Some(&(ptr, nbytes)) => Value::Device {
                dtype: t.dtype,
                shape: t.shape.clone(),
                ptr,
                nbytes,
                owned: None,
                host: Some(t.clone()),
            },
            None => Value::Host(t.clone()),
        })
    }

    /// A value's bytes on the host (downloads device values).
    fn host_tensor(&mut self, v: &Value) -> Result<Tensor> {
        match v {
            Value::Host(t) => Ok(t.clone()),
            Value::Device { host: Some(t), .. } => Ok(t.clone()),
            Value::Device { dtype, shape, ptr, nbytes, .. } => {
                let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("device value without a GPU".into()))?;
                gpu.download(*ptr, *dtype, shape.clone(), *nbytes as usize)
            }
        }
    }

    /// Returns a value's device buffer (if it owns one) to the pool.
    fn release(&mut self, v: Value) {
        if let (Value::Device { owned: Some(b), .. }, Some(gpu)) = (v, self.gpu.as_mut()) {
            gpu.alloc.free(b);
        }
    }

    /// The value on the session's device (uploads host values on a GPU).
    fn on_device(&mut self, v: &Value) -> Result<Value> {
        match (v, self.gpu.as_mut()) {
            (Value::Host(t), Some(gpu)) => {
                let b = gpu.upload(t)?;
                Ok(Value::Device {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    ptr: b.ptr,
                    nbytes: t.data.len() as u64,
                    owned: Some(b),
                    host: Some(t.clone()),
                })
            }
            (other, _) => Ok(other.clone_ref()),
        }
    }

    /// Runs node `idx` through its package's CPU reference on host tensors; with
    /// `check_dispatch`, validates its GPU launch plan as well.
    pub(super) fn execute_cpu(
        &mut self,
        idx: usize,
        res: &Resolution,
        inputs: &[Option<Tensor>],
        out_types: &OutputTypes,
        check_dispatch: bool,
    ) -> Result<Vec<Option<Tensor>>> {
        let opset = self.opset_of(idx)?;
        let node = self.model.graph.nodes[idx].clone();
        let value_inputs = res.entry.value_inputs.clone();
        let args = node_call(
            &node,
            opset,
            inputs
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    t.as_ref().map(|t| tensor_arg(t, value_inputs.contains(&i), Access::Read(t.data.clone())))
                })
                .collect(),
            cpu::output_args(out_types),
        );
        let n_in = inputs.iter().flatten().count();
        let outcome = self.call_shim(&res.package, CallKind::Cpu, args)?;
        let outputs = cpu::collect_outputs(outcome, n_in, out_types)?;
        if check_dispatch {
            let args = node_call(
                &node,
                opset,
                inputs
                    .iter()
                    .enumerate()
                    .map(|(i, t)| t.as_ref().map(|t| tensor_arg(t, value_inputs.contains(&i), Access::Opaque)))
                    .collect(),
                outputs.iter().map(|t| t.as_ref().map(|t| tensor_arg(t, false, Access::Opaque))).collect(),
            );
            match self.call_shim(&res.package, CallKind::Dispatch, args) {
                Ok(o) => self.report.dispatch_steps += o.plan.steps.len() as u64,
                Err(e) if e.is_unsupported() => {
                    *self.report.dispatch_unsupported.entry(node.op_type.clone()).or_default() += 1;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(outputs)
    }

    /// Infers and executes node `idx`; returns (op type, package id).
    fn run_node(&mut self, idx: usize, values: &mut [Option<Value>]) -> Result<(String, String)> {
        let node = self.model.graph.nodes[idx].clone();
        let mut inputs: Vec<Option<Value>> = Vec::with_capacity(node.inputs.len());
        for v in &node.inputs {
            inputs.push(match v {
                None => None,
                Some(v) => Some(match values[*v].as_ref() {
                    Some(val) => val.clone_ref(),
                    None => self.resident(*v).ok_or_else(|| {
                        Error::Model(format!(
                            "node {:?} reads {:?} before it is computed",
                            node.name, self.model.graph.values[*v].name
                        ))
                    })?,
                }),
            });
        }
        let dtypes: Vec<Option<DType>> = inputs.iter().map(|v| v.as_ref().map(Value::dtype)).collect();
        let rank = inputs.iter().flatten().map(|v| v.shape().len()).max().unwrap_or(0);
        let res = self.resolve(idx, dtypes, rank)?;
        let value_inputs = res.entry.value_inputs.clone();
        let mut infer_ins = Vec::with_capacity(inputs.len());
        for (i, v) in inputs.iter().enumerate() {
            infer_ins.push(match v {
                None => None,
                Some(v) => Some(InferInput {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    bytes: if value_inputs.contains(&i) { Some(self.host_tensor(v)?.data) } else { None },
                }),
            });
        }
        let out_types = self.infer(idx, &res, &infer_ins)?;
        let outputs: Vec<Option<Value>> = match self.options.device {
            Device::Cpu => {
                let mut host = Vec::with_capacity(inputs.len());
                for v in &inputs {
                    host.push(match v {
                        None => None,
                        Some(v) => Some(self.host_tensor(v)?),
                    });
                }
                self.execute_cpu(idx, &res, &host, &out_types, self.options.check_dispatch)?
                    .into_iter()
                    .map(|t| t.map(Value::Host))
                    .collect()
            }
            Device::Cuda(_) => self.execute_gpu(idx, &res, &inputs, &infer_ins, &out_types)?,
        };
        for (o, v) in node.outputs.iter().zip(outputs) {
            match (o, v) {
                (Some(id), Some(v)) => values[*id] = Some(v),
                (_, Some(v)) => self.release(v),
                _ => {}
            }
        }
        Ok((node.op_type.clone(), res.package.id()))
    }

    /// Runs node `idx` on the GPU: the launch plan comes from the memo or from the shim's
    /// `kiln_dispatch`; outputs are new device buffers.
    fn execute_gpu(
        &mut self,
        idx: usize,
        res: &Resolution,
        inputs: &[Option<Value>],
        infer_ins: &[Option<InferInput>],
        out_types: &OutputTypes,
    ) -> Result<Vec<Option<Value>>> {
        let key = infer_key(idx, infer_ins);
        let plan = match self.plans.get(&key) {
            Some(p) => {
                self.report.plan_hits += 1;
                p.clone()
            }
            None => {
                let opset = self.opset_of(idx)?;
                let node = self.model.graph.nodes[idx].clone();
                let args = node_call(
                    &node,
                    opset,
                    infer_ins.iter().map(|i| i.as_ref().map(InferInput::opaque_arg)).collect(),
                    out_types
                        .iter()
                        .map(|t| {
                            t.as_ref().map(|(d, s)| ArgTensor {
                                dtype: Some(*d),
                                dims: Some(s.iter().map(|&x| x as i64).collect()),
                                value: None,
                                nbytes: byte_size(*d, s).unwrap_or(0),
                                access: Access::Opaque,
                            })
                        })
                        .collect(),
                );
                let plan = self.call_shim(&res.package, CallKind::Dispatch, args)?.plan;
                if self.plans.len() >= INFER_CACHE_ENTRIES {
                    self.plans.clear();
                }
                self.plans.insert(key, plan.clone());
                plan
            }
        };
        let mut slots = Vec::new();
        let mut uploaded = Vec::new();
        for v in inputs.iter().flatten() {
            let d = self.on_device(v)?;
            if let Value::Device { ptr, nbytes, .. } = &d {
                slots.push((*ptr, *nbytes));
            }
            uploaded.push(d);
        }
        let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        let mut outs = Vec::with_capacity(out_types.len());
        for t in out_types {
            outs.push(match t {
                None => None,
                Some((dtype, shape)) => {
                    let nbytes = byte_size(*dtype, shape)?;
                    let b = gpu.alloc.alloc(nbytes)?;
                    slots.push((b.ptr, nbytes));
                    Some(Value::Device {
                        dtype: *dtype,
                        shape: shape.clone(),
                        ptr: b.ptr,
                        nbytes,
                        owned: Some(b),
                        host: None,
                    })
                }
            });
        }
        let result = gpu.execute(&res.package, &plan, &slots);
        self.report.launches += plan.steps.len() as u64;
        for d in uploaded {
            // Inputs uploaded for this node only (host values) go back to the pool: later work
            // on the stream cannot overtake this node's kernels.
            if let Value::Device { owned: Some(b), .. } = d {
                if let Some(gpu) = self.gpu.as_mut() {
                    gpu.alloc.free(b);
                }
            }
        }
        if let Err(e) = result {
            for v in outs.into_iter().flatten() {
                self.release(v);
            }
            return Err(e);
        }
        Ok(outs)
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

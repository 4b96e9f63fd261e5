//! A model on a device: runs the graph node by node through the packages' shims.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use kiln_kernel_abi::DType;
use kiln_registry::{NodeQuery, Package, Resolution};

use crate::capture::GraphMode;
use crate::cuda::{DevBuffer, Function, Gpu};
use crate::model::{Model, ValueId};
use crate::sandbox::{Access, ArgTensor, CallArgs, CallKind, CallOutcome, LaunchPlan, ShimInstance};
use crate::tensor::byte_size;
use crate::trace::Report;
use crate::{cpu, Error, Result, Tensor};

use super::binding::{Feed, Fetch, Fetched, Held};
use super::plan::{Bindings, ExecutionPlan, RecIn, RecOut, Recorder};
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
    /// On a GPU, compute small integer nodes whose inputs are already on the host (a graph's
    /// shape arithmetic) with the packages' CPU references, as onnxruntime places shape
    /// subgraphs on the CPU (default on). Conformance and `kiln verify` turn it off so that
    /// every node runs the GPU kernels.
    pub small_integer_nodes_on_host: bool,
    /// On a GPU, whether runs with every input fed from a held tensor and every returned
    /// output bound to one are captured into CUDA graphs (see `capture`). Such runs always go
    /// through an execution plan; `Off` runs the plan eagerly.
    pub graphs: GraphMode,
    /// Rewrite the packages' declared fusion patterns at load (`fuse`; default on,
    /// `--no-fuse` turns it off).
    pub fuse: bool,
    /// Programmatic dependent launch of the kernels packages declare PDL-safe (`--pdl`).
    pub pdl: crate::capture::PdlMode,
    /// On a GPU, the least bytes one growth of a reserved KV cache maps, all its tensors
    /// together (a decode batch's rows then grow by at least this much at once, since mapping
    /// costs driver calls per tensor); each tensor maps whole multiples of the device's
    /// granularity. 0: only the granularity. Default [`VMM_CHUNK_BYTES`].
    pub vmm_chunk_bytes: u64,
}

/// The default [`SessionOptions::vmm_chunk_bytes`]: 32 MiB.
pub const VMM_CHUNK_BYTES: u64 = 32 << 20;

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            device: Device::Cpu,
            max_tensor_bytes: crate::model::MAX_TENSOR_BYTES,
            check_dispatch: false,
            device_memory_limit: None,
            small_integer_nodes_on_host: true,
            graphs: GraphMode::Auto,
            fuse: true,
            pdl: crate::capture::PdlMode::Auto,
            vmm_chunk_bytes: VMM_CHUNK_BYTES,
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
    pub(super) fn dtype(&self) -> DType {
        match self {
            Value::Host(t) => t.dtype,
            Value::Device { dtype, .. } => *dtype,
        }
    }

    pub(super) fn shape(&self) -> &[usize] {
        match self {
            Value::Host(t) => &t.shape,
            Value::Device { shape, .. } => shape,
        }
    }

    /// Logical size in bytes.
    pub(super) fn nbytes(&self) -> u64 {
        match self {
            Value::Host(t) => t.data.len() as u64,
            Value::Device { nbytes, .. } => *nbytes,
        }
    }

    pub(super) fn is_device(&self) -> bool {
        matches!(self, Value::Device { .. })
    }

    /// The host bytes, when the value has them without a download.
    pub(super) fn host_bytes(&self) -> Option<&Tensor> {
        match self {
            Value::Host(t) | Value::Device { host: Some(t), .. } => Some(t),
            Value::Device { host: None, .. } => None,
        }
    }

    /// The same value without ownership of its buffer.
    pub(super) fn clone_ref(&self) -> Value {
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

/// A node's resolution and its package id for the report (`NAME@VERSION`, then ` (unsigned)` for
/// a registry's package without a signature, which runs only under `--allow-unsigned`), shared by
/// the memo.
pub(super) struct Resolved {
    pub res: Resolution,
    pub package_id: String,
}

/// Largest inputs (bytes, all together) and outputs of an integer node a GPU session computes
/// on the host when every input already has host bytes (`small_integer_nodes_on_host`): the
/// shape arithmetic of a graph (Shape, Gather of a shape, ReduceSum of an attention mask) then
/// never waits for the device, and value inputs derived from it (GroupQueryAttention's
/// `total_sequence_length`) are known without a download.
const HOST_NODE_MAX_INPUT_BYTES: u64 = 256 << 10;
const HOST_NODE_MAX_OUTPUT_BYTES: u64 = 4 << 10;

/// Most execution plans a session keeps (one per shape signature and output selection).
const MAX_PLANS: usize = 16;

/// What a shape signature of eligible runs got: a plan, or the reason it has none.
enum PlanEntry {
    Plan(Box<ExecutionPlan>),
    Unplanned(String),
}

/// Key of an execution plan: each fed graph input's dtype and shape, and for each graph
/// output the capacity in bytes of the tensor it is bound to (`None`: skipped). Whether an
/// output is written in place depends on that capacity.
type PlanKey = (Vec<(ValueId, DType, Vec<usize>)>, Vec<(ValueId, Option<u64>)>);

/// The nodes a run executes and the values they read, for the outputs it asks for.
pub(super) struct LiveSet {
    nodes: Vec<bool>,
    values: Vec<bool>,
}

/// One model, prepared for one device.
pub struct Session {
    pub(super) rt: Arc<Runtime>,
    pub(super) model: Model,
    options: SessionOptions,
    instances: HashMap<String, ShimInstance>,
    resolutions: HashMap<ResolveKey, Arc<Resolved>>,
    /// Shims' inference is a pure function of the node and its inputs (ABI.md §3).
    inferred: HashMap<InferKey, OutputTypes>,
    /// Launch plans, memoized the same way: later runs launch without entering Wasm.
    plans: HashMap<InferKey, Arc<LaunchPlan>>,
    /// The GPU of a CUDA session.
    pub(super) gpu: Option<Gpu>,
    /// Device copies of the initializers (resident weights): pointer and size.
    device_values: HashMap<ValueId, (cudarc::driver::sys::CUdeviceptr, u64)>,
    /// The buffers behind `device_values`, freed with the session.
    resident_buffers: Vec<DevBuffer>,
    /// Nodes computed once at preparation (constant folding).
    pub(super) folded: Vec<bool>,
    /// Largest tensor a node may produce, in bytes.
    pub(super) max_tensor_bytes: u64,
    /// For each value, the index of the last node that reads it (graph outputs: never freed).
    last_use: Vec<Option<usize>>,
    /// This session's number (held tensors of other sessions are refused).
    pub(super) number: u64,
    /// Tensors held between runs, by id.
    pub(super) held: HashMap<u64, Held>,
    /// Handles of held tensors dropped since the last [`Session::reclaim`].
    pub(super) dropped: super::binding::Dropped,
    pub(super) next_held: u64,
    /// During a run: graph outputs bound to held tensors (value → held id).
    bound: HashMap<ValueId, u64>,
    /// Per node, what its last GPU execution needed: a run with the same input types skips
    /// resolution, inference and the memo lookups (a decode step repeats every shape).
    memo: Vec<Option<Arc<NodeMemo>>>,
    /// Execution plans of eligible runs (see `plan`).
    exec_plans: HashMap<PlanKey, PlanEntry>,
    /// During a dry run: what it records (and no kernel is launched).
    recorder: Option<Recorder>,
    /// The node being run, for messages.
    current_node: usize,
    /// What the current run executes.
    live: Arc<LiveSet>,
    live_cache: HashMap<Vec<bool>, Arc<LiveSet>>,
    /// Per node, `Some(false)` once its CPU reference was seen reading a device value's bytes
    /// (it is then never tried as shape arithmetic again).
    shape_only: Vec<Option<bool>>,
    pub report: Report,
}

/// A GPU node's outputs, with the plan that made them and its loaded functions.
type GpuExecution = (Vec<Option<Value>>, Arc<LaunchPlan>, Vec<Option<Function>>);

/// A GPU node's last execution: its input types (and value inputs' bytes), and what
/// resolution, inference and dispatch gave for them.
pub(super) struct NodeMemo {
    inputs: Vec<Option<(DType, Vec<usize>)>>,
    value_bytes: Vec<Option<bytes::Bytes>>,
    resolved: Arc<Resolved>,
    out_types: OutputTypes,
    plan: Arc<LaunchPlan>,
    functions: Vec<Option<Function>>,
}

impl Drop for Session {
    fn drop(&mut self) {
        let plans: Vec<PlanEntry> = self.exec_plans.drain().map(|(_, e)| e).collect();
        if let Some(gpu) = self.gpu.as_mut() {
            for e in plans {
                if let PlanEntry::Plan(p) = e {
                    p.release(gpu);
                }
            }
        }
        let held: Vec<Held> = self.held.drain().map(|(_, h)| h).collect();
        for h in held {
            self.release(h.value);
        }
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
    pub fn new(rt: Arc<Runtime>, mut model: Model, options: SessionOptions) -> Result<Session> {
        let gpu = match options.device {
            Device::Cpu if options.pdl == crate::capture::PdlMode::On => {
                return Err(Error::Input("--pdl on needs a CUDA GPU (programmatic dependent launch)".into()));
            }
            Device::Cpu => None,
            Device::Cuda(ordinal) => {
                let mut gpu = Gpu::open(ordinal, options.device_memory_limit)?;
                gpu.pdl = match options.pdl {
                    crate::capture::PdlMode::Off => false,
                    crate::capture::PdlMode::Auto => gpu.pdl_supported(),
                    crate::capture::PdlMode::On if gpu.pdl_supported() => true,
                    crate::capture::PdlMode::On => {
                        let (major, minor) = gpu.info.compute_capability;
                        let driver = gpu.info.driver_version;
                        return Err(Error::Unsupported(format!(
                            "--pdl on needs programmatic dependent launch (compute capability 9.0 or later, a CUDA 12.3 or later driver); \
                             this GPU is {major}.{minor} with a CUDA {}.{} driver: use --pdl auto or off",
                            driver / 1000,
                            driver % 1000 / 10
                        )));
                    }
                };
                Some(gpu)
            }
        };
        let started = std::time::Instant::now();
        let fusions = if options.fuse {
            let caps = gpu.as_ref().map(caps_of);
            crate::fuse::Fusions { enabled: true, ..crate::fuse::fuse(&mut model, &rt.registry, caps.as_ref()) }
        } else {
            crate::fuse::Fusions::default()
        };
        tracing::info!(
            applied = fusions.applied.len(),
            rejected = fusions.rejected.len(),
            ms = started.elapsed().as_millis() as u64,
            "fusion{}",
            if options.fuse { "" } else { " off (--no-fuse)" }
        );
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
        let report = Report { device: options.device.to_string(), fusions, ..Report::default() };
        // On the CPU a tensor must fit in a shim's linear memory to be computed at all.
        let max_tensor_bytes = match options.device {
            Device::Cpu => options.max_tensor_bytes.min(rt.sandbox.config().memory_limit_bytes as u64),
            Device::Cuda(_) => options.max_tensor_bytes,
        };
        let folded = vec![false; g.nodes.len()];
        let memo = vec![None; g.nodes.len()];
        let live = Arc::new(LiveSet { nodes: vec![true; g.nodes.len()], values: vec![true; g.values.len()] });
        let shape_only = vec![None; g.nodes.len()];
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
            number: super::binding::session_number(),
            held: HashMap::new(),
            dropped: Default::default(),
            next_held: 1,
            bound: HashMap::new(),
            memo,
            exec_plans: HashMap::new(),
            recorder: None,
            current_node: 0,
            live,
            live_cache: HashMap::new(),
            shape_only,
            report,
        };
        if let Some(gpu) = s.gpu.as_mut() {
            gpu.status_records(s.model.graph.nodes.len())?;
        }
        let started = std::time::Instant::now();
        s.prepare()?;
        tracing::info!(
            nodes = s.model.graph.nodes.len(),
            folded = s.folded.iter().filter(|f| **f).count(),
            ms = started.elapsed().as_millis() as u64,
            "session prepared"
        );
        let started = std::time::Instant::now();
        s.upload_initializers()?;
        if s.gpu.is_some() {
            let bytes: u64 = s.model.graph.initializers.values().map(|t| t.data.len() as u64).sum();
            tracing::info!(bytes, ms = started.elapsed().as_millis() as u64, "weights uploaded");
        }
        Ok(s)
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The device of this session.
    pub fn device(&self) -> Device {
        self.options.device
    }

    /// The options the session was made with.
    pub fn options(&self) -> &SessionOptions {
        &self.options
    }

    /// Whether eligible runs are captured into CUDA graphs (a GPU, graphs not off).
    pub fn captures_graphs(&self) -> bool {
        self.gpu.is_some() && self.options.graphs != GraphMode::Off
    }

    /// The session's `--graph` mode.
    pub fn graph_mode(&self) -> GraphMode {
        self.options.graphs
    }

    /// What the session's GPU offers packages (`None` on the CPU, where device requirements
    /// do not apply).
    pub(super) fn device_caps(&self) -> Option<kiln_registry::DeviceCaps> {
        self.gpu.as_ref().map(caps_of)
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
            let mut inst = self.rt.module(pkg)?.instantiate()?;
            if let Some(gpu) = &self.gpu {
                inst.set_launch_limits(gpu.info.launch_limits);
            }
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

    fn resolve(&mut self, idx: usize, dtypes: Vec<Option<DType>>, rank: usize) -> Result<Arc<Resolved>> {
        let key = (idx, dtypes, rank);
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
            input_dtypes: key.1.clone(),
            max_rank: Some(rank),
            device: caps.as_ref(),
        };
        let res = self.rt.registry.resolve(&q).map_err(|detail| Error::Unresolved {
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
        self.resolutions.insert(key, r.clone());
        Ok(r)
    }

    /// Runs the graph on `feeds` (graph input name → tensor) and returns the graph outputs
    /// in order, on the host. Every graph input must be fed (initializers listed as inputs may be).
    pub fn run(&mut self, feeds: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        let feeds = feeds.into_iter().map(|(n, t)| (n, Feed::Host(t))).collect();
        self.run_with(feeds, &[])?.into_iter().map(|(n, f)| Ok((n, f.into_host()?))).collect()
    }

    /// Runs the graph with bound inputs and outputs (see [`super::binding`]): `feeds` gives
    /// every graph input, `fetches` says where named outputs go (others come back to the
    /// host). Returns every graph output in order. Errors: an unknown or missing input, a
    /// dtype or shape the model does not declare, an output that does not fit its bound
    /// tensor, and whatever a node reports.
    pub fn run_with(
        &mut self,
        feeds: Vec<(String, Feed<'_>)>,
        fetches: &[(&str, Fetch<'_>)],
    ) -> Result<Vec<(String, Fetched)>> {
        self.reclaim();
        let start = Instant::now();
        let g = &self.model.graph;
        let mut fetch_of: HashMap<ValueId, &Fetch<'_>> = HashMap::new();
        for (name, f) in fetches {
            let id = g
                .value_id(name)
                .filter(|id| g.outputs.contains(id))
                .ok_or_else(|| Error::Input(format!("the model has no output {name:?} to fetch")))?;
            fetch_of.insert(id, f);
        }
        let wanted: Vec<bool> = g.outputs.iter().map(|o| !matches!(fetch_of.get(o), Some(Fetch::Skip))).collect();
        self.live = self.live_set(wanted);
        let mut values: Vec<Option<Value>> = (0..self.model.graph.values.len()).map(|_| None).collect();
        for (name, feed) in feeds {
            let g = &self.model.graph;
            let id = g.value_id(&name).filter(|id| g.inputs.contains(id)).ok_or_else(|| {
                let names: Vec<&str> = g.inputs.iter().map(|i| g.values[*i].name.as_str()).collect();
                Error::Input(format!("the model has no input {name:?} (its inputs: {names:?})"))
            })?;
            let v = match feed {
                Feed::Host(t) => Value::Host(t),
                Feed::Device(t) => self.fed_value(t)?,
            };
            check_input(&self.model, id, &name, v.dtype(), v.shape())?;
            values[id] = Some(v);
        }
        let g = &self.model.graph;
        if let Some(missing) = g.inputs.iter().find(|i| values[**i].is_none() && self.live.values[**i]) {
            return Err(Error::Input(format!("input {:?} was not given", g.values[*missing].name)));
        }
        self.bound.clear();
        for (id, f) in &fetch_of {
            if let Fetch::Into(t) = f {
                self.held.get(&t.id).filter(|_| t.session == self.number).ok_or_else(|| {
                    Error::Input("a fetch is bound to a tensor of another session, or a freed one".into())
                })?;
                self.bound.insert(*id, t.id);
            }
        }
        let profiling = self.gpu.as_ref().is_some_and(|g| g.timeline.is_some());
        if profiling {
            *self.report.graphs.unplanned.entry("profiling".into()).or_default() += 1;
        } else if self.gpu.is_some() {
            let planned = self.run_planned(&values, &fetch_of, start);
            if !matches!(planned, Ok(None)) {
                self.bound.clear();
                for v in values.into_iter().flatten() {
                    self.release(v);
                }
                return planned.map(Option::unwrap_or_default);
            }
        }
        let mut uploaded = Ok(());
        if self.gpu.is_some() {
            for v in values.iter_mut() {
                if let Some(val @ Value::Host(_)) = v {
                    match self.on_device(val) {
                        Ok(d) => *v = Some(d),
                        Err(e) => {
                            uploaded = Err(e);
                            break;
                        }
                    }
                }
            }
        }
        let result = uploaded.and_then(|_| self.run_nodes(&mut values));
        self.bound.clear();
        // Return every device buffer of the run to the pool, whatever happened.
        let mut outs = Vec::with_capacity(self.model.graph.outputs.len());
        let mut failed = result.err();
        if failed.is_none() {
            for &o in &self.model.graph.outputs.clone() {
                let fetch = fetch_of.get(&o).copied().unwrap_or(&Fetch::Host);
                if matches!(fetch, Fetch::Skip) {
                    continue;
                }
                let name = self.model.graph.values[o].name.clone();
                let Some(v) = values[o].take().or_else(|| self.resident(o)) else {
                    failed = Some(Error::Model(format!("graph output {name:?} was not computed")));
                    break;
                };
                match self.fetch_output(&name, v, fetch) {
                    Ok(f) => outs.push((name, f)),
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
        }
        for v in values.into_iter().flatten() {
            self.release(v);
        }
        if let Some(e) = failed {
            // Outputs already held go back with their handles.
            drop(outs);
            self.reclaim();
            return Err(e);
        }
        self.report.runs += 1;
        self.report.run_time_us += start.elapsed().as_micros() as u64;
        self.report.device_memory = self.gpu.as_ref().map(|g| memory_of(&g.alloc));
        Ok(outs)
    }

    /// The nodes to run (and values they read) when the graph outputs flagged in `wanted` are
    /// asked for: a reverse walk from those outputs, cached per selection.
    fn live_set(&mut self, wanted: Vec<bool>) -> Arc<LiveSet> {
        if let Some(l) = self.live_cache.get(&wanted) {
            return l.clone();
        }
        let g = &self.model.graph;
        let mut values = vec![false; g.values.len()];
        for (o, w) in g.outputs.iter().zip(&wanted) {
            values[*o] |= *w;
        }
        let mut nodes = vec![false; g.nodes.len()];
        for (i, n) in g.nodes.iter().enumerate().rev() {
            if n.outputs.iter().flatten().any(|v| values[*v]) {
                nodes[i] = true;
                for v in n.inputs.iter().flatten() {
                    values[*v] = true;
                }
            }
        }
        let l = Arc::new(LiveSet { nodes, values });
        self.live_cache.insert(wanted, l.clone());
        l
    }

    /// Runs through an execution plan when the run allows one: a GPU, every graph input fed
    /// from a held tensor, every returned output bound to one (`Fetch::Into`), the others
    /// skipped. The first run of a signature records the plan with a dry run. `Ok(None)`: the
    /// run is not eligible, or its signature has a seam (counted in the report); the caller
    /// runs it node by node. Errors: an output that does not fit its bound tensor, a launch
    /// failure, and with `--graph on` a run that cannot be planned or captured.
    fn run_planned(
        &mut self,
        values: &[Option<Value>],
        fetch_of: &HashMap<ValueId, &Fetch<'_>>,
        start: Instant,
    ) -> Result<Option<Vec<(String, Fetched)>>> {
        let g = &self.model.graph;
        let not_planned = |report: &mut Report, why: &str| {
            *report.graphs.unplanned.entry(why.to_string()).or_default() += 1;
            Ok(None)
        };
        let mut key_feeds = Vec::new();
        let mut feeds = HashMap::new();
        for &i in &g.inputs {
            match values[i].as_ref() {
                Some(Value::Device { dtype, shape, ptr, owned: None, host: None, .. }) => {
                    key_feeds.push((i, *dtype, shape.clone()));
                    feeds.insert(i, *ptr);
                }
                None if !self.live.values[i] => {}
                _ => return not_planned(&mut self.report, "an input fed from the host"),
            }
        }
        let mut key_outs = Vec::new();
        let mut outputs = Vec::new();
        let mut bound = HashMap::new();
        for &o in &g.outputs {
            match fetch_of.get(&o) {
                Some(Fetch::Skip) => key_outs.push((o, None)),
                Some(Fetch::Into(_)) => {
                    let h = self.bound.get(&o).and_then(|h| self.held.get(h));
                    let Some((ptr, capacity)) = h.and_then(|h| h.device_ptr().map(|p| (p, h.capacity))) else {
                        return Ok(None);
                    };
                    bound.insert(o, ptr);
                    key_outs.push((o, Some(capacity)));
                    outputs.push((o, g.values[o].name.clone()));
                }
                _ => return not_planned(&mut self.report, "an output not bound to a held tensor"),
            }
        }
        let key = (key_feeds, key_outs);
        if !self.exec_plans.contains_key(&key) {
            let entry = self.record_plan(values, &outputs)?;
            if self.exec_plans.len() >= MAX_PLANS {
                let old = self.exec_plans.keys().next().cloned();
                if let (Some(PlanEntry::Plan(p)), Some(gpu)) =
                    (old.and_then(|k| self.exec_plans.remove(&k)), self.gpu.as_mut())
                {
                    p.release(gpu);
                }
            }
            self.exec_plans.insert(key.clone(), entry);
        }
        let Session { exec_plans, gpu, report, held, options, bound: bound_ids, model, .. } = self;
        let gpu = gpu.as_mut().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        let plan = match exec_plans.get_mut(&key) {
            Some(PlanEntry::Plan(p)) => p,
            Some(PlanEntry::Unplanned(why)) => {
                *report.graphs.unplanned.entry("seam".into()).or_default() += 1;
                report.graphs.last_fallback = Some(why.clone());
                if options.graphs == GraphMode::On {
                    return Err(Error::Unsupported(format!("--graph on: this run cannot be planned: {why}")));
                }
                return Ok(None);
            }
            None => return Ok(None),
        };
        for (v, dtype, shape, nbytes) in &plan.outputs {
            let h = bound_ids.get(v).and_then(|id| held.get(id));
            if let Some(h) = h.filter(|h| !h.fits(*dtype, *nbytes)) {
                return Err(Error::Input(format!(
                    "output {:?} ({dtype} {shape:?}, {nbytes} bytes) does not fit its bound tensor ({}, {} bytes)",
                    model.graph.values[*v].name,
                    h.value.dtype(),
                    h.capacity
                )));
            }
        }
        let replayed = plan.run(gpu, options.graphs, &Bindings { feeds, bound }, &mut report.graphs)?;
        if !replayed {
            report.launches += plan.launches;
        }
        report.nodes += plan.nodes() as u64;
        for (v, _, shape, nbytes) in &plan.outputs {
            if let Some(Held { value: Value::Device { shape: s, nbytes: n, .. }, .. }) =
                bound_ids.get(v).and_then(|id| held.get_mut(id))
            {
                s.clone_from(shape);
                *n = *nbytes;
            }
        }
        report.runs += 1;
        report.run_time_us += start.elapsed().as_micros() as u64;
        report.device_memory = Some(memory_of(&gpu.alloc));
        Ok(Some(outputs.into_iter().map(|(_, name)| (name, Fetched::Written)).collect()))
    }

    /// Records the execution plan of this run's signature with a dry run (every node resolved,
    /// inferred and dispatched, no kernel launched), or the seam that keeps it from one.
    fn record_plan(&mut self, values: &[Option<Value>], outputs: &[(ValueId, String)]) -> Result<PlanEntry> {
        let mut vals: Vec<Option<Value>> = values.iter().map(|v| v.as_ref().map(Value::clone_ref)).collect();
        self.recorder = Some(Recorder::default());
        let ran = self.run_nodes(&mut vals);
        let rec = self.recorder.take().unwrap_or_default();
        for v in vals.into_iter().flatten() {
            self.release(v);
        }
        if let Err(e) = ran {
            return match rec.seam {
                Some(s) => Ok(PlanEntry::Unplanned(s)),
                None => Err(e),
            };
        }
        let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        Ok(match rec.finish(gpu, outputs)? {
            Ok(plan) => {
                self.report.graphs.plans_built += 1;
                self.report.graphs.arena_bytes += plan.arena_bytes;
                self.report.graphs.plan_launches = plan.launches;
                self.report.graphs.pdl_launches = plan.pdl_launches;
                PlanEntry::Plan(Box::new(plan))
            }
            Err(why) => PlanEntry::Unplanned(why),
        })
    }

    /// Per-op GPU time in the report (CUDA events between nodes; each run then waits for the
    /// device at its end). No effect on the CPU.
    pub fn set_gpu_profiling(&mut self, on: bool) {
        if let Some(gpu) = self.gpu.as_mut() {
            gpu.timeline = on.then(crate::cuda::Timeline::default);
        }
    }

    /// Adds the GPU spans of the nodes just run (in `order`) to the report.
    fn collect_gpu_profile(&mut self, order: &[usize]) -> Result<()> {
        let Some(gpu) = self.gpu.as_mut() else { return Ok(()) };
        let Some(t) = gpu.timeline.as_mut() else { return Ok(()) };
        gpu.stream.synchronize().map_err(|e| Error::Device(format!("cuStreamSynchronize: {e}")))?;
        let spans = t.spans_ms()?;
        for (idx, ms) in order.iter().zip(spans) {
            self.report.record_gpu(&self.model.graph.nodes[*idx].op_type, ms);
        }
        Ok(())
    }

    fn run_nodes(&mut self, values: &mut [Option<Value>]) -> Result<()> {
        let profiling = self.gpu.as_ref().is_some_and(|g| g.timeline.is_some());
        let mut order = Vec::new();
        if profiling {
            if let Some(t) = self.gpu.as_mut().and_then(|g| g.timeline.as_mut()) {
                t.reset();
            }
            self.gpu.as_mut().map_or(Ok(()), Gpu::mark)?;
        }
        let live = self.live.clone();
        for idx in 0..self.model.graph.nodes.len() {
            if self.folded[idx] || !live.nodes[idx] {
                continue;
            }
            self.current_node = idx;
            let t0 = Instant::now();
            let resolved = self.run_node(idx, values)?;
            if profiling {
                self.gpu.as_mut().map_or(Ok(()), Gpu::mark)?;
                order.push(idx);
            }
            if self.recorder.is_none() {
                self.report.record_node(&self.model.graph.nodes[idx].op_type, &resolved.package_id, t0.elapsed());
            }
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
        if profiling {
            self.collect_gpu_profile(&order)?;
        }
        Ok(())
    }

    /// Output types of node `idx` for these inputs: from the cache, or from the shim's
    /// `kiln_infer`. Checks the outputs against the package's `max_rank` and the session's
    /// tensor size limit.
    pub(super) fn infer(&mut self, idx: usize, res: &Resolution, inputs: &[Option<InferInput>]) -> Result<OutputTypes> {
        let key = infer_key(idx, inputs);
        self.infer_keyed(idx, res, inputs, key)
    }

    fn infer_keyed(
        &mut self,
        idx: usize,
        res: &Resolution,
        inputs: &[Option<InferInput>],
        key: InferKey,
    ) -> Result<OutputTypes> {
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
                    let nbytes = byte_size(dtype, &shape).map_err(|_| {
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
    pub(super) fn host_tensor(&mut self, v: &Value) -> Result<Tensor> {
        if let Some(t) = v.host_bytes() {
            return Ok(t.clone());
        }
        if let Some(rec) = self.recorder.as_mut() {
            // A dry run launched nothing: the bytes are not there, and a plan cannot wait for them.
            let node = &self.model.graph.nodes[self.current_node];
            let why = format!("node {:?} ({}) needs a value computed on the GPU on the host", node.name, node.op_type);
            rec.seam(why.clone());
            return Err(Error::Unsupported(why));
        }
        let Value::Device { dtype, shape, ptr, nbytes, .. } = v else {
            return Err(Error::Device("a host value without bytes".into()));
        };
        let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("device value without a GPU".into()))?;
        let t = gpu.download(*ptr, *dtype, shape.clone(), *nbytes as usize)?;
        self.check_device()?;
        Ok(t)
    }

    /// Fails with the first input a kernel found out of range since the last check (ABI.md
    /// §7.5), naming its node, op and package; the records are then clear for the next run.
    /// Call it after a synchronization.
    pub(super) fn check_device(&mut self) -> Result<()> {
        let Some(fault) = self.gpu.as_mut().and_then(Gpu::take_fault) else { return Ok(()) };
        let node = self.model.graph.nodes.get(fault.record);
        let memo = self.memo.get(fault.record).and_then(Option::as_ref);
        let message = memo.and_then(|m| m.resolved.res.package.manifest.device_error(fault.code));
        let reason = match (memo, message) {
            (_, Some(e)) => e.render(&fault.values),
            (Some(_), None) => format!(
                "device error code {} with values {:?}, which the package's [[device_errors]] do not declare",
                fault.code, fault.values
            ),
            (None, None) => format!(
                "device error code {} with values {:?} (this session has no record of the node's package, so the \
                 code's message is unknown)",
                fault.code, fault.values
            ),
        };
        Err(Error::DeviceCheck(Box::new(crate::error::DeviceCheck {
            package: memo.map(|m| m.resolved.package_id.clone()).unwrap_or_default(),
            op: node.map(|n| n.op_type.clone()).unwrap_or_else(|| format!("node #{}", fault.record)),
            node: node.map(|n| n.name.clone()).unwrap_or_default(),
            reason,
        })))
    }

    /// Returns a value's device buffer (if it owns one) to the pool.
    pub(super) fn release(&mut self, v: Value) {
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

    /// Whether a GPU session computes this node on the host: every input has host bytes, no
    /// input or output is a float, and inputs and outputs are small (see
    /// [`HOST_NODE_MAX_INPUT_BYTES`]).
    fn runs_on_host(inputs: &[Option<Value>], out_types: &OutputTypes) -> bool {
        let mut in_bytes = 0;
        for v in inputs.iter().flatten() {
            if v.host_bytes().is_none() || v.dtype().is_float() {
                return false;
            }
            in_bytes += v.nbytes();
        }
        if out_types.iter().flatten().any(|(d, _)| d.is_float()) {
            return false;
        }
        let out_bytes: u64 = out_types.iter().flatten().map(|(d, s)| byte_size(*d, s).unwrap_or(u64::MAX)).sum();
        in_bytes <= HOST_NODE_MAX_INPUT_BYTES && out_bytes <= HOST_NODE_MAX_OUTPUT_BYTES
    }

    /// Infers and executes node `idx`; returns its resolution.
    fn run_node(&mut self, idx: usize, values: &mut [Option<Value>]) -> Result<Arc<Resolved>> {
        if let Some(r) = self.run_node_memoized(idx, values)? {
            return Ok(r);
        }
        let (in_ids, out_ids) = {
            let n = &self.model.graph.nodes[idx];
            (n.inputs.clone(), n.outputs.clone())
        };
        let mut inputs: Vec<Option<Value>> = Vec::with_capacity(in_ids.len());
        for v in &in_ids {
            inputs.push(match v {
                None => None,
                Some(v) => Some(match values[*v].as_ref() {
                    Some(val) => val.clone_ref(),
                    None => self.resident(*v).ok_or_else(|| {
                        let g = &self.model.graph;
                        Error::Model(format!(
                            "node {:?} reads {:?} before it is computed",
                            g.nodes[idx].name, g.values[*v].name
                        ))
                    })?,
                }),
            });
        }
        let dtypes: Vec<Option<DType>> = inputs.iter().map(|v| v.as_ref().map(Value::dtype)).collect();
        let rank = inputs.iter().flatten().map(|v| v.shape().len()).max().unwrap_or(0);
        let resolved = self.resolve(idx, dtypes, rank)?;
        let res = &resolved.res;
        let mut infer_ins = Vec::with_capacity(inputs.len());
        for (i, v) in inputs.iter().enumerate() {
            infer_ins.push(match v {
                None => None,
                Some(v) => Some(InferInput {
                    dtype: v.dtype(),
                    shape: v.shape().to_vec(),
                    bytes: if res.entry.value_inputs.contains(&i) { Some(self.host_tensor(v)?.data) } else { None },
                }),
            });
        }
        let key = infer_key(idx, &infer_ins);
        let out_types = self.infer_keyed(idx, res, &infer_ins, key.clone())?;
        let on_host =
            self.gpu.is_none() || (self.options.small_integer_nodes_on_host && Self::runs_on_host(&inputs, &out_types));
        // Shape arithmetic over device values (Shape of a fed tensor): the CPU reference runs
        // with those inputs opaque, and succeeds only when it never reads their bytes.
        let probed = if !on_host
            && self.options.small_integer_nodes_on_host
            && self.shape_only[idx] != Some(false)
            && Self::small_integer_outputs(&out_types)
        {
            let p = self.probe_shape_only(idx, res, &inputs, &out_types)?;
            if p.is_none() {
                self.shape_only[idx] = Some(false);
            }
            p
        } else {
            None
        };
        let outputs: Vec<Option<Value>> = if let Some(outs) = probed {
            outs.into_iter().map(|t| t.map(Value::Host)).collect()
        } else if on_host {
            let mut host = Vec::with_capacity(inputs.len());
            for v in &inputs {
                host.push(match v {
                    None => None,
                    Some(v) => Some(self.host_tensor(v)?),
                });
            }
            let check = self.options.check_dispatch && self.gpu.is_none();
            self.execute_cpu(idx, res, &host, &out_types, check)?.into_iter().map(|t| t.map(Value::Host)).collect()
        } else {
            // Host values go to the device once, for every later reader too (and for a value
            // this node reads twice, once).
            for (slot, v) in in_ids.iter().enumerate() {
                if let (Some(id), Some(Value::Host(_))) = (v, &inputs[slot]) {
                    let d = match values[*id].as_ref() {
                        Some(on @ Value::Device { .. }) => on.clone_ref(),
                        _ => {
                            let Some(val) = inputs[slot].take() else { continue };
                            let d = self.on_device(&val)?;
                            if let (Some(rec), Value::Host(t)) = (self.recorder.as_mut(), &val) {
                                rec.upload(*id, t);
                            }
                            let r = d.clone_ref();
                            if let Some(old) = values[*id].replace(d) {
                                self.release(old);
                            }
                            r
                        }
                    };
                    inputs[slot] = Some(d);
                }
            }
            let (outs, plan, functions) = self.execute_gpu(idx, res, &inputs, &infer_ins, &out_types, key, &out_ids)?;
            self.memo[idx] = Some(Arc::new(NodeMemo {
                inputs: infer_ins.iter().map(|i| i.as_ref().map(|i| (i.dtype, i.shape.clone()))).collect(),
                value_bytes: infer_ins.iter().map(|i| i.as_ref().and_then(|i| i.bytes.clone())).collect(),
                resolved: resolved.clone(),
                out_types: out_types.clone(),
                plan,
                functions,
            }));
            outs
        };
        for (o, v) in out_ids.iter().zip(outputs) {
            match (o, v) {
                (Some(id), Some(v)) => values[*id] = Some(v),
                (_, Some(v)) => self.release(v),
                _ => {}
            }
        }
        Ok(resolved)
    }

    /// Runs node `idx` on the GPU: the launch plan comes from the memo or from the shim's
    /// `kiln_dispatch`; outputs are new device buffers, or the held tensors they are bound to.
    /// Returns the outputs and the plan.
    #[allow(clippy::too_many_arguments)]
    fn execute_gpu(
        &mut self,
        idx: usize,
        res: &Resolution,
        inputs: &[Option<Value>],
        infer_ins: &[Option<InferInput>],
        out_types: &OutputTypes,
        key: InferKey,
        out_ids: &[Option<ValueId>],
    ) -> Result<GpuExecution> {
        let plan = match self.plans.get(&key) {
            Some(p) => {
                if self.recorder.is_none() {
                    self.report.plan_hits += 1;
                }
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
                let plan = Arc::new(self.call_shim(&res.package, CallKind::Dispatch, args)?.plan);
                if self.plans.len() >= INFER_CACHE_ENTRIES {
                    self.plans.clear();
                }
                self.plans.insert(key, plan.clone());
                plan
            }
        };
        let mut slots = Vec::with_capacity(inputs.len() + out_types.len());
        for v in inputs.iter().flatten() {
            match v {
                Value::Device { ptr, nbytes, .. } => slots.push((*ptr, *nbytes)),
                Value::Host(_) => return Err(Error::Device("a host value reached a GPU node".into())),
            }
        }
        let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        // A kernel that fails to load (or to match its signature) is named with its node; the
        // error keeps its kind.
        let functions = gpu.plan_functions(&res.package, &plan).map_err(|e| {
            let n = &self.model.graph.nodes[idx];
            let at = |m: String| format!("node {:?} ({}): {m}", n.name, n.op_type);
            match e {
                Error::Input(m) => Error::Input(at(m)),
                Error::Device(m) => Error::Device(at(m)),
                other => other,
            }
        })?;
        let outs = self.launch_outputs(idx, &plan, &functions, out_types, out_ids, slots)?;
        Ok((outs, plan, functions))
    }

    /// Allocates the outputs of GPU node `idx` (or takes the held tensors they are bound to),
    /// adds them to the input `slots`, and runs `plan` with its loaded functions. In a dry run
    /// it records the node instead of launching it.
    fn launch_outputs(
        &mut self,
        idx: usize,
        plan: &Arc<LaunchPlan>,
        functions: &[Option<Function>],
        out_types: &OutputTypes,
        out_ids: &[Option<ValueId>],
        mut slots: Vec<(cudarc::driver::sys::CUdeviceptr, u64)>,
    ) -> Result<Vec<Option<Value>>> {
        let n_in = slots.len();
        let mut outs = Vec::with_capacity(out_types.len());
        let mut in_place = Vec::with_capacity(out_types.len());
        for (t, id) in out_types.iter().zip(out_ids) {
            let Some((dtype, shape)) = t else {
                outs.push(None);
                continue;
            };
            let nbytes = byte_size(*dtype, shape)?;
            // A bound output is written into its held tensor when it fits (else copied there
            // after the run, by `fetch_output`).
            let target = id
                .and_then(|id| self.bound.get(&id))
                .and_then(|h| self.held.get(h))
                .filter(|h| h.fits(*dtype, nbytes))
                .and_then(Held::device_ptr);
            let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
            let (ptr, owned) = match target {
                Some(ptr) => (ptr, None),
                None => match gpu.alloc.alloc(nbytes) {
                    Ok(b) => (b.ptr, Some(b)),
                    Err(e) => {
                        for v in outs.into_iter().flatten() {
                            self.release(v);
                        }
                        return Err(e);
                    }
                },
            };
            slots.push((ptr, nbytes));
            in_place.push(target.is_some());
            outs.push(Some(Value::Device { dtype: *dtype, shape: shape.clone(), ptr, nbytes, owned, host: None }));
        }
        if self.recorder.is_some() {
            self.record_node(idx, plan, functions, &slots[..n_in], &outs, out_ids, &in_place);
        }
        let gpu = self.gpu.as_mut().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        let result = if self.recorder.is_some() {
            gpu.prepare_gemms(plan)
        } else {
            self.report.launches += plan.steps.len() as u64;
            gpu.execute_resolved(plan, functions, &slots, idx)
        };
        if let Err(e) = result {
            for v in outs.into_iter().flatten() {
                self.release(v);
            }
            return Err(e);
        }
        Ok(outs)
    }

    /// Records GPU node `idx` of a dry run: where each input comes from (`inputs` are their
    /// pointers and sizes, in order), and each output's value (`in_place`: written into its
    /// bound tensor).
    #[allow(clippy::too_many_arguments)]
    fn record_node(
        &mut self,
        idx: usize,
        plan: &Arc<LaunchPlan>,
        functions: &[Option<Function>],
        inputs: &[(cudarc::driver::sys::CUdeviceptr, u64)],
        outs: &[Option<Value>],
        out_ids: &[Option<ValueId>],
        in_place: &[bool],
    ) {
        let g = &self.model.graph;
        let Some(rec) = self.recorder.as_mut() else { return };
        let mut rec_in = Vec::with_capacity(inputs.len());
        for (v, &(ptr, n)) in g.nodes[idx].inputs.iter().flatten().zip(inputs) {
            let from = if g.inputs.contains(v) {
                RecIn::Feed(*v)
            } else if rec.written(*v) {
                RecIn::Bound(*v)
            } else if rec.produced(*v) {
                RecIn::Produced(*v)
            } else if rec.uploaded_here(*v) {
                RecIn::Uploaded(*v)
            } else if self.device_values.get(v).is_some_and(|d| d.0 == ptr) {
                RecIn::Fixed(ptr)
            } else {
                rec.seam(format!(
                    "node {:?} reads {:?}, which has no fixed place",
                    g.nodes[idx].name, g.values[*v].name
                ));
                RecIn::Fixed(ptr)
            };
            rec_in.push((from, n));
        }
        let mut rec_out = Vec::with_capacity(outs.len());
        let mut placed = in_place.iter();
        for (o, id) in outs.iter().zip(out_ids) {
            let Some(Value::Device { dtype, shape, nbytes, .. }) = o else { continue };
            let out = match (id, placed.next()) {
                (Some(v), Some(true)) => {
                    rec.write_bound(*v, *dtype, shape.clone(), *nbytes);
                    RecOut::Bound(*v)
                }
                (Some(v), _) => RecOut::Value(*v),
                (None, _) => RecOut::Unnamed,
            };
            rec_out.push((out, *nbytes));
        }
        rec.node(idx, plan, functions, rec_in, rec_out);
    }

    /// Whether every output of a node is a small non-float tensor (shape arithmetic).
    fn small_integer_outputs(out_types: &OutputTypes) -> bool {
        !out_types.iter().flatten().any(|(d, _)| d.is_float())
            && out_types.iter().flatten().map(|(d, s)| byte_size(*d, s).unwrap_or(u64::MAX)).sum::<u64>()
                <= HOST_NODE_MAX_OUTPUT_BYTES
    }

    /// Runs node `idx`'s CPU reference with its device inputs opaque. `Some`: the reference
    /// never read their bytes, so the outputs are a function of shapes and host values alone
    /// (Shape, Size, and what follows them). `None`: it tried to read them.
    fn probe_shape_only(
        &mut self,
        idx: usize,
        res: &Resolution,
        inputs: &[Option<Value>],
        out_types: &OutputTypes,
    ) -> Result<Option<Vec<Option<Tensor>>>> {
        let opset = self.opset_of(idx)?;
        let node = self.model.graph.nodes[idx].clone();
        let value_inputs = res.entry.value_inputs.clone();
        let args_in = inputs
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.as_ref().map(|v| match v.host_bytes() {
                    Some(t) => tensor_arg(t, value_inputs.contains(&i), Access::Read(t.data.clone())),
                    None => ArgTensor {
                        dtype: Some(v.dtype()),
                        dims: Some(v.shape().iter().map(|&d| d as i64).collect()),
                        value: None,
                        nbytes: v.nbytes(),
                        access: Access::Opaque,
                    },
                })
            })
            .collect();
        let args = node_call(&node, opset, args_in, cpu::output_args(out_types));
        let n_in = inputs.iter().flatten().count();
        match self.call_shim(&res.package, CallKind::Cpu, args) {
            Ok(outcome) => cpu::collect_outputs(outcome, n_in, out_types).map(Some),
            Err(_) => Ok(None),
        }
    }

    /// Runs GPU node `idx` from its memo when its inputs have the types of the memoized run
    /// (no resolution, inference or memo lookups). `None`: no memo, or other inputs.
    fn run_node_memoized(&mut self, idx: usize, values: &mut [Option<Value>]) -> Result<Option<Arc<Resolved>>> {
        let Some(memo) = self.memo[idx].clone() else { return Ok(None) };
        let node = &self.model.graph.nodes[idx];
        let mut slots = Vec::with_capacity(node.inputs.len() + node.outputs.len());
        for (i, v) in node.inputs.iter().enumerate() {
            let want = memo.inputs.get(i).and_then(Option::as_ref);
            let (id, (dtype, shape)) = match (v, want) {
                (None, None) => continue,
                (Some(id), Some(w)) => (*id, w),
                _ => return Ok(None),
            };
            let (d, s, ptr, nbytes, host) = match values[id].as_ref() {
                Some(Value::Device { dtype, shape, ptr, nbytes, host, .. }) => {
                    (*dtype, &shape[..], *ptr, *nbytes, host.as_ref())
                }
                Some(Value::Host(_)) => return Ok(None),
                None => match (self.device_values.get(&id), self.model.graph.initializers.get(&id)) {
                    (Some(&(ptr, nbytes)), Some(t)) => (t.dtype, &t.shape[..], ptr, nbytes, Some(t)),
                    _ => return Ok(None),
                },
            };
            if d != *dtype || s != &shape[..] {
                return Ok(None);
            }
            if let Some(bytes) = memo.value_bytes.get(i).and_then(Option::as_ref) {
                if host.is_none_or(|t| t.data != *bytes) {
                    return Ok(None);
                }
            }
            slots.push((ptr, nbytes));
        }
        let out_ids = node.outputs.clone();
        if self.recorder.is_none() {
            self.report.plan_hits += 1;
        }
        let outs = self.launch_outputs(idx, &memo.plan, &memo.functions, &memo.out_types, &out_ids, slots)?;
        for (o, v) in out_ids.iter().zip(outs) {
            match (o, v) {
                (Some(id), Some(v)) => values[*id] = Some(v),
                (_, Some(v)) => self.release(v),
                _ => {}
            }
        }
        Ok(Some(memo.resolved.clone()))
    }

    /// Names and declared types of the graph inputs.
    pub fn input_names(&self) -> Vec<String> {
        self.model.graph.inputs.iter().map(|i| self.model.graph.values[*i].name.clone()).collect()
    }

    /// The value ids of the graph outputs.
    pub fn output_ids(&self) -> &[ValueId] {
        &self.model.graph.outputs
    }

    /// Allocator and GEMM-plan counters of a GPU session.
    pub fn gpu_stats(&self) -> Option<(crate::cuda::AllocatorStats, (u64, u64))> {
        self.gpu.as_ref().map(|g| (g.alloc.stats(), g.gemm_plan_stats()))
    }
}

/// The report's view of an allocator.
fn memory_of(a: &crate::cuda::Allocator) -> crate::trace::DeviceMemory {
    let s = a.stats();
    crate::trace::DeviceMemory {
        in_use_bytes: s.in_use_bytes,
        cached_bytes: s.cached_bytes,
        peak_bytes: s.peak_bytes,
        vmm_reserved_bytes: s.vmm_reserved_bytes,
        vmm_mapped_bytes: s.vmm_mapped_bytes,
    }
}

/// What a GPU offers packages (their `[device]` requirements).
fn caps_of(g: &Gpu) -> kiln_registry::DeviceCaps {
    kiln_registry::DeviceCaps { compute_capability: g.info.compute_capability, features: g.info.features() }
}

/// Checks a fed value against the input's declared dtype and shape.
fn check_input(model: &Model, id: ValueId, name: &str, dtype: DType, shape: &[usize]) -> Result<()> {
    let Some(ty) = &model.graph.values[id].ty else { return Ok(()) };
    if ty.dtype != dtype {
        return Err(Error::Input(format!("input {name:?} must be {}, not {dtype}", ty.dtype)));
    }
    if let Some(dims) = &ty.dims {
        let fits = dims.len() == shape.len()
            && dims.iter().zip(shape).all(|(d, n)| !matches!(d, crate::model::Dim::Known(k) if k != n));
        if !fits {
            return Err(Error::Input(format!(
                "input {name:?} has shape {shape:?}; the model declares {}",
                crate::model::format_dims(dims)
            )));
        }
    }
    Ok(())
}

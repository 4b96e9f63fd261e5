//! A model on a device: runs the graph node by node through the packages' shims, or through
//! an execution plan (`plan`) replayed as a CUDA graph.
//!
//! A session is made of parts with one job each: `shims` (its shim instances and calls),
//! `infer` (resolution and inference memos), `binding` (the tensors it holds between runs),
//! `backend` (where values live and how bytes move, CPU or CUDA), `plan` (execution plans).
//! This file holds the session itself: preparing a model, a run's node loop, a GPU node's
//! dispatch and launch, and the public API, which delegates to those parts.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_kernel_abi::wire::Paged;
use kiln_kernel_abi::DType;
use kiln_registry::Resolution;

use crate::capture::GraphMode;
use crate::cuda::{DevBuffer, Function, Gpu};
use crate::model::{Model, ValueId};
use crate::sandbox::{Access, ArgTensor, CallKind, ConvService, LaunchPlan};
use crate::tensor::byte_size;
use crate::trace::Report;
use crate::{cpu, Error, Result, Tensor};

use super::backend::{Backend, CpuBackend};
use super::binding::{DeviceTensor, Feed, Fetch, Fetched, Held, HeldTensors, PendingRead};
use super::control::ControlFlow;
use super::infer::{infer_key, Call, InferInput, InferKey, NodeTypes, OutputTypes, Resolved, INFER_CACHE_ENTRIES};
use super::plan::{Bindings, ExecutionPlan, RecIn, RecOut, Recorder};
use super::shims::{node_call, opset_of, tensor_arg, Shims, IN_PLACE_SHARED_SCHEMA};
use super::value::Value;
use super::{Device, HostValue, Runtime};

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
    /// Tell packages of manifest schema 14 which dispatch inputs are constant for the session
    /// (ABI.md §7.7); default on (`kiln bench decode --constant-inputs off` compares).
    pub constant_inputs: bool,
    /// On a GPU, whether a dispatch's `conv` goes through cuDNN (`--cudnn`); without it the
    /// packages' own convolution kernels run, and the report says why.
    pub cudnn: CudnnMode,
    /// On a GPU, whether an execution plan keeps the values that only its float16 and bfloat16
    /// cuDNN convolutions touch channels-last (`layout`; default on, `--channels-last off`
    /// compares).
    pub channels_last: bool,
    /// On a GPU, the least bytes one growth of a reserved KV cache maps, all its tensors
    /// together (a decode batch's rows then grow by at least this much at once, since mapping
    /// costs driver calls per tensor); each tensor maps whole multiples of the device's
    /// granularity. 0: only the granularity. Default [`VMM_CHUNK_BYTES`].
    pub vmm_chunk_bytes: u64,
    /// Most body runs of one loop (a Loop node, a Scan over one batch entry, a SequenceMap) in a
    /// run (Loop's trip count and condition come from the model's values): past it the run
    /// fails. Default [`MAX_LOOP_ITERATIONS`].
    pub max_loop_iterations: u64,
    /// How a node's CPU work is split over the CPU pool's threads where its package allows it
    /// (manifest `cpu_tiles`, ABI.md §6.1.2).
    pub cpu_split: super::CpuSplit,
}

/// Whether a GPU session's convolutions go through cuDNN (`--cudnn`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CudnnMode {
    /// The packages' own kernels.
    Off,
    /// cuDNN; a GPU session without cuDNN 9 is an error.
    On,
    /// cuDNN where it is found (`KILN_CUDNN_PATH`, the library path, beside the CUDA libraries).
    #[default]
    Auto,
}

/// What a dispatch's `conv` gets in a session on `gpu` with `mode` (ABI.md §4.8). Errors:
/// `--cudnn on` without cuDNN.
fn conv_service(gpu: Option<&Gpu>, mode: CudnnMode, report: &mut Report) -> Result<ConvService> {
    let Some(gpu) = gpu else { return Ok(ConvService::default()) };
    let why = match (mode, crate::cuda::cudnn_library()) {
        (CudnnMode::Off, _) => "turned off (--cudnn off)".to_string(),
        (_, Ok(lib)) => {
            report.convolutions.library = Some(lib.to_string());
            let device = gpu.device.clone();
            return Ok(ConvService::Library {
                takes: Arc::new(move |c| {
                    device
                        .with_dnn(|d| d.prepare(c, crate::cuda::ConvLayout::default()))
                        .map(|_| ())
                        .map_err(|e| e.to_string())
                }),
            });
        }
        (CudnnMode::On, Err(why)) => return Err(Error::Unsupported(format!("--cudnn on: {why}"))),
        (CudnnMode::Auto, Err(why)) => why.to_string(),
    };
    report.convolutions.unavailable = Some(why.clone());
    Ok(ConvService::Unavailable(why.into()))
}

/// The default [`SessionOptions::max_loop_iterations`]: 2^20.
pub const MAX_LOOP_ITERATIONS: u64 = 1 << 20;

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
            constant_inputs: true,
            cudnn: CudnnMode::Auto,
            channels_last: true,
            vmm_chunk_bytes: VMM_CHUNK_BYTES,
            max_loop_iterations: MAX_LOOP_ITERATIONS,
            cpu_split: super::CpuSplit::default(),
        }
    }
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

/// Whether `node` reads only its inputs' shapes (ai.onnx Shape and Size): it takes a paged input
/// as metadata, without its layout.
fn reads_metadata_only(node: &crate::model::Node) -> bool {
    node.domain.is_empty() && matches!(node.op_type.as_str(), "Shape" | "Size")
}

/// Key of an execution plan: each fed graph input's dtype and shape, and for each graph
/// output the capacity in bytes of the tensor it is bound to (`None`: skipped). Whether an
/// output is written in place depends on that capacity.
/// A paged input's or bound output's layout is part of the key (its kernels' arguments follow
/// it), and so is the feed a paged output aliases (it is written in place, checked when the
/// plan is recorded).
type PlanKey = (
    Vec<(ValueId, DType, Vec<usize>, Option<Arc<Paged>>)>,
    Vec<(ValueId, Option<u64>, Option<Arc<Paged>>, Option<ValueId>)>,
);

/// The paged layouts of a node's inputs and of the held tensors its outputs are written into
/// (ABI.md §6.1.1), in slot order; `None`: row-major. A node's launch plan depends on them.
type Layouts = (Vec<Option<Arc<Paged>>>, Vec<Option<Arc<Paged>>>);

/// The nodes a run executes and the values they read, for the outputs it asks for.
pub(super) struct LiveSet {
    nodes: Vec<bool>,
    values: Vec<bool>,
}

/// One model, prepared for one device.
pub struct Session {
    model: Model,
    options: SessionOptions,
    /// The session's shim instances (and the shared runtime).
    shims: Shims,
    /// Resolutions and inferred output types, memoized.
    types: NodeTypes,
    /// Launch plans, memoized as inference is: later runs launch without entering Wasm.
    plans: HashMap<(InferKey, Layouts), Arc<LaunchPlan>>,
    /// Device copies of the initializers (resident weights): pointer and size.
    device_values: HashMap<ValueId, (cudarc::driver::sys::CUdeviceptr, u64)>,
    /// The buffers behind `device_values`, back to the pool with the session.
    resident_buffers: Vec<DevBuffer>,
    /// Nodes computed once at preparation (constant folding).
    folded: Vec<bool>,
    /// Per node, its bodies' sessions when it is control flow (If, Loop, Scan, SequenceMap).
    control: Vec<Option<Box<ControlFlow>>>,
    /// Per node, whether it is a sequence or optional op (run by the executor), known at
    /// preparation so that a run does not look again.
    sequence_ops: Vec<bool>,
    /// During a run: the sequences and optionals (fed, or made by the executor's nodes); tensors
    /// are in the run's value table.
    non_tensors: HashMap<ValueId, HostValue>,
    /// The sequences and optionals `run_values` feeds the run it starts.
    fed_non_tensors: HashMap<ValueId, HostValue>,
    /// Largest tensor a node may produce, in bytes.
    max_tensor_bytes: u64,
    /// For each value, the index of the last node that reads it (graph outputs: never freed).
    last_use: Vec<Option<usize>>,
    /// Tensors held between runs.
    held: HeldTensors,
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
    /// The device: CPU, or the session's GPU. Last, so that every buffer above goes back to
    /// the device's pool before the device can close.
    backend: Box<dyn Backend>,
}

/// A GPU node's outputs, with the plan that made them and its loaded functions.
type GpuExecution = (Vec<Option<Value>>, Arc<LaunchPlan>, Vec<Option<Function>>);

/// A GPU node's last execution: its input types (and value inputs' bytes), and what
/// resolution, inference and dispatch gave for them.
pub(super) struct NodeMemo {
    inputs: Vec<Option<(DType, Vec<usize>)>>,
    value_bytes: Vec<Option<bytes::Bytes>>,
    layouts: Layouts,
    resolved: Arc<Resolved>,
    out_types: OutputTypes,
    plan: Arc<LaunchPlan>,
    functions: Vec<Option<Function>>,
}

impl Drop for Session {
    fn drop(&mut self) {
        let plans: Vec<PlanEntry> = self.exec_plans.drain().map(|(_, e)| e).collect();
        if let Some(gpu) = self.backend.gpu() {
            for e in plans {
                if let PlanEntry::Plan(p) = e {
                    p.release(gpu);
                }
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
                // The process's device (shared with its other sessions), with this session's
                // memory account.
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
        let caps = gpu.as_ref().map(caps_of);
        let launch_limits = gpu.as_ref().map(|g| g.info.launch_limits);
        let backend: Box<dyn Backend> = match gpu {
            Some(gpu) => Box::new(gpu),
            None => Box::new(CpuBackend),
        };
        let started = std::time::Instant::now();
        let fusions = if options.fuse {
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
        let mut report = Report { device: options.device.to_string(), fusions, ..Report::default() };
        let conv = conv_service(backend.gpu_ref(), options.cudnn, &mut report)?;
        // On the CPU a tensor must fit in a shim's linear memory to be computed at all.
        let max_tensor_bytes = match options.device {
            Device::Cpu => options.max_tensor_bytes.min(rt.sandbox.config().memory_limit_bytes as u64),
            Device::Cuda(_) => options.max_tensor_bytes,
        };
        let memo = vec![None; g.nodes.len()];
        let live = Arc::new(LiveSet { nodes: vec![true; g.nodes.len()], values: vec![true; g.values.len()] });
        let shape_only = vec![None; g.nodes.len()];
        let mut shims = Shims::new(rt, launch_limits, conv);
        shims.split = options.cpu_split;
        shims.max_tensor_bytes = max_tensor_bytes;
        let mut types = NodeTypes::new(caps, max_tensor_bytes);
        let started = std::time::Instant::now();
        let folded = super::prepare::prepare(&mut model, &mut types, &mut shims, &mut report)?;
        tracing::info!(
            nodes = model.graph.nodes.len(),
            folded = folded.iter().filter(|f| **f).count(),
            ms = started.elapsed().as_millis() as u64,
            "session prepared"
        );
        let mut control = Vec::with_capacity(model.graph.nodes.len());
        for (idx, node) in model.graph.nodes.iter().enumerate() {
            control.push(match node.is_control_flow() {
                true => {
                    let opset = opset_of(&model, idx)?;
                    Some(Box::new(ControlFlow::new(&shims.rt, &model, node, opset, &options)?))
                }
                false => None,
            });
        }
        let sequence_ops = model.graph.nodes.iter().map(super::sequence::is_sequence_op).collect();
        let mut s = Session {
            control,
            sequence_ops,
            non_tensors: HashMap::new(),
            fed_non_tensors: HashMap::new(),
            model,
            options,
            shims,
            types,
            plans: HashMap::new(),
            device_values: HashMap::new(),
            resident_buffers: Vec::new(),
            folded,
            max_tensor_bytes,
            last_use,
            held: HeldTensors::new(),
            bound: HashMap::new(),
            memo,
            exec_plans: HashMap::new(),
            recorder: None,
            current_node: 0,
            live,
            live_cache: HashMap::new(),
            shape_only,
            report,
            backend,
        };
        if let Some(gpu) = s.backend.gpu() {
            gpu.status_records(s.model.graph.nodes.len())?;
        }
        let started = std::time::Instant::now();
        s.upload_initializers()?;
        if s.backend.gpu_ref().is_some() {
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
        self.backend.device()
    }

    /// The options the session was made with.
    pub fn options(&self) -> &SessionOptions {
        &self.options
    }

    /// Whether eligible runs are captured into CUDA graphs (a GPU, graphs not off).
    pub fn captures_graphs(&self) -> bool {
        self.backend.gpu_ref().is_some() && self.options.graphs != GraphMode::Off
    }

    /// The session's `--graph` mode.
    pub fn graph_mode(&self) -> GraphMode {
        self.options.graphs
    }

    /// Runs the graph on `feeds` (graph input name → tensor) and returns the graph outputs
    /// in order, on the host. Every graph input must be fed (initializers listed as inputs may be).
    pub fn run(&mut self, feeds: Vec<(String, Tensor)>) -> Result<Vec<(String, Tensor)>> {
        let feeds = feeds.into_iter().map(|(n, t)| (n, HostValue::Tensor(t))).collect();
        self.run_values(feeds)?
            .into_iter()
            .map(|(n, v)| {
                let t = v.into_tensor(&format!("output {n:?}")).map_err(|e| {
                    Error::Unsupported(format!("{e}: Session::run returns tensors, run_values any value"))
                })?;
                Ok((n, t))
            })
            .collect()
    }

    /// Runs the graph on host values, sequences and optionals included (graph input name →
    /// value); returns every graph output in order. Errors: those of [`Session::run_with`], and
    /// a value whose kind (tensor, sequence, optional) is not the input's declared one.
    pub fn run_values(&mut self, feeds: Vec<(String, HostValue)>) -> Result<Vec<(String, HostValue)>> {
        let mut tensors = Vec::with_capacity(feeds.len());
        let mut others = HashMap::new();
        for (name, v) in feeds {
            match v {
                HostValue::Tensor(t) => tensors.push((name, Feed::Host(t))),
                other => {
                    let g = &self.model.graph;
                    let id = g
                        .value_id(&name)
                        .filter(|id| g.inputs.contains(id))
                        .ok_or_else(|| Error::Input(format!("the model has no input {name:?}")))?;
                    // An undeclared input (a body's outer-scope value) takes any kind.
                    if let Some(declared) = g.values[id].ty.as_ref().map(|t| &t.kind) {
                        if !other.fits(declared) {
                            return Err(Error::Input(format!(
                                "input {name:?} is declared {declared}; it was fed {}",
                                other.kind()
                            )));
                        }
                    }
                    others.insert(id, other);
                }
            }
        }
        self.fed_non_tensors = others;
        // `run_with` gives the tensor outputs in order, the others stay in `non_tensors`.
        let mut tensors = self.run_with(tensors, &[])?.into_iter();
        let g = &self.model.graph;
        let mut result = Vec::with_capacity(g.outputs.len());
        for &o in &g.outputs {
            let name = g.values[o].name.clone();
            let v = match self.non_tensors.get(&o) {
                Some(v) => v.clone(),
                None => match tensors.next() {
                    Some((_, f)) => HostValue::Tensor(f.into_host()?),
                    None => return Err(Error::Model(format!("graph output {name:?} was not computed"))),
                },
            };
            result.push((name, v));
        }
        self.non_tensors.clear();
        Ok(result)
    }

    /// Runs the graph with bound inputs and outputs (see [`Feed`] and [`Fetch`]): `feeds` gives
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
        // A session may have moved to this thread (it is Send): its CUDA context is made current.
        if let Some(gpu) = self.backend.gpu_ref() {
            gpu.device.ctx.bind_to_thread().map_err(|e| Error::Device(format!("cuCtxSetCurrent: {e}")))?;
        }
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
        self.non_tensors = std::mem::take(&mut self.fed_non_tensors);
        let mut values: Vec<Option<Value>> = (0..self.model.graph.values.len()).map(|_| None).collect();
        for (name, feed) in feeds {
            let g = &self.model.graph;
            let id = g.value_id(&name).filter(|id| g.inputs.contains(id)).ok_or_else(|| {
                let names: Vec<&str> = g.inputs.iter().map(|i| g.values[*i].name.as_str()).collect();
                Error::Input(format!("the model has no input {name:?} (its inputs: {names:?})"))
            })?;
            let v = match feed {
                Feed::Host(t) => Value::Host(t),
                Feed::Device(t) => self.held.get(t)?.value.clone_ref(),
            };
            check_input(&self.model, id, &name, v.dtype(), v.shape())?;
            values[id] = Some(v);
        }
        let g = &self.model.graph;
        if let Some(missing) = g
            .inputs
            .iter()
            .find(|i| values[**i].is_none() && !self.non_tensors.contains_key(i) && self.live.values[**i])
        {
            return Err(Error::Input(format!("input {:?} was not given", g.values[*missing].name)));
        }
        self.bound.clear();
        for (id, f) in &fetch_of {
            if let Fetch::Into(t) = f {
                let held = self.held.id(t).map_err(|_| {
                    Error::Input("a fetch is bound to a tensor of another session, or a freed one".into())
                })?;
                self.bound.insert(*id, held);
            }
        }
        let profiling = self.backend.gpu_ref().is_some_and(|g| g.timeline.is_some());
        if profiling {
            *self.report.graphs.unplanned.entry("profiling".into()).or_default() += 1;
        } else if self.backend.gpu_ref().is_some() {
            let planned = self.run_planned(&values, &fetch_of, start);
            if !matches!(planned, Ok(None)) {
                self.bound.clear();
                for v in values.into_iter().flatten() {
                    drop(v);
                }
                return planned.map(Option::unwrap_or_default);
            }
        }
        let mut uploaded = Ok(());
        if self.backend.gpu_ref().is_some() {
            for v in values.iter_mut() {
                if let Some(val @ Value::Host(_)) = v {
                    match self.backend.place(val) {
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
                if self.non_tensors.contains_key(&o) {
                    // A sequence or optional: `run_values` returns it.
                    continue;
                }
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
            drop(v);
        }
        if let Some(e) = failed {
            // Outputs already held go back with their handles.
            drop(outs);
            self.reclaim();
            return Err(e);
        }
        self.report.runs += 1;
        self.report.run_time_us += start.elapsed().as_micros() as u64;
        self.report.device_memory = self.backend.memory();
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
                Some(Value::Device { dtype, shape, ptr, owned: None, host: None, paged, .. }) => {
                    key_feeds.push((i, *dtype, shape.clone(), paged.clone()));
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
                Some(Fetch::Skip) => key_outs.push((o, None, None, None)),
                Some(Fetch::Into(_)) => {
                    let h = self.bound.get(&o).and_then(|h| self.held.by_id(*h));
                    let Some((ptr, capacity)) = h.and_then(|h| h.device_ptr().map(|p| (p, h.capacity))) else {
                        return Ok(None);
                    };
                    bound.insert(o, ptr);
                    // A paged output's key names the feed it aliases: the plan was recorded (and
                    // checked to write in place) for that binding.
                    let paged = h.and_then(|h| h.value.paged().cloned());
                    let alias = paged.as_ref().and_then(|_| feeds.iter().find(|(_, p)| **p == ptr).map(|(v, _)| *v));
                    key_outs.push((o, Some(capacity), paged, alias));
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
                    (old.and_then(|k| self.exec_plans.remove(&k)), self.backend.gpu())
                {
                    p.release(gpu);
                }
            }
            self.exec_plans.insert(key.clone(), entry);
        }
        let Session { exec_plans, backend, report, held, options, bound: bound_ids, model, .. } = self;
        let gpu = backend.gpu().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
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
            let h = bound_ids.get(v).and_then(|id| held.by_id(*id));
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
            if let Some(id) = bound_ids.get(v) {
                held.set_shape(*id, shape.clone(), *nbytes);
            }
        }
        report.runs += 1;
        report.run_time_us += start.elapsed().as_micros() as u64;
        report.device_memory = backend.memory();
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
            drop(v);
        }
        if let Err(e) = ran {
            return match rec.seam {
                Some(s) => Ok(PlanEntry::Unplanned(s)),
                None => Err(e),
            };
        }
        let gpu = self.backend.gpu().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        Ok(match rec.finish(gpu, outputs, self.options.channels_last)? {
            Ok(plan) => {
                self.report.graphs.plans_built += 1;
                self.report.graphs.arena_bytes += plan.arena_bytes;
                self.report.graphs.plan_launches = plan.launches;
                self.report.graphs.pdl_launches = plan.pdl_launches;
                self.report.convolutions.channels_last = plan.channels_last;
                PlanEntry::Plan(Box::new(plan))
            }
            Err(why) => PlanEntry::Unplanned(why),
        })
    }

    /// Per-op GPU time in the report (CUDA events between nodes on the device's one compute
    /// stream, so another session's kernels enqueued meanwhile count in the spans; each run
    /// then waits for the device at its end). No effect on the CPU.
    pub fn set_gpu_profiling(&mut self, on: bool) {
        if let Some(gpu) = self.backend.gpu() {
            gpu.timeline = on.then(crate::cuda::Timeline::default);
        }
    }

    /// Adds the GPU spans of the nodes just run (in `order`) to the report.
    fn collect_gpu_profile(&mut self, order: &[usize]) -> Result<()> {
        let Some(gpu) = self.backend.gpu() else { return Ok(()) };
        gpu.synchronize()?;
        let Some(t) = gpu.timeline.as_mut() else { return Ok(()) };
        let spans = t.spans_ms()?;
        for (idx, ms) in order.iter().zip(spans) {
            self.report.record_gpu(&self.model.graph.nodes[*idx].op_type, ms);
        }
        Ok(())
    }

    /// Runs the live nodes in order; on the CPU, on a thread of the CPU pool whose other threads
    /// stay hot for the nodes' parallel work (see [`crate::sandbox::on_pool_hot`]).
    fn run_nodes(&mut self, values: &mut [Option<Value>]) -> Result<()> {
        if self.backend.gpu_ref().is_none() {
            return crate::sandbox::on_pool_hot(|| self.run_nodes_here(values));
        }
        self.run_nodes_here(values)
    }

    fn run_nodes_here(&mut self, values: &mut [Option<Value>]) -> Result<()> {
        let profiling = self.backend.gpu_ref().is_some_and(|g| g.timeline.is_some());
        let mut order = Vec::new();
        if profiling {
            if let Some(t) = self.backend.gpu().and_then(|g| g.timeline.as_mut()) {
                t.reset();
            }
            self.backend.gpu().map_or(Ok(()), Gpu::mark)?;
        }
        let live = self.live.clone();
        for idx in 0..self.model.graph.nodes.len() {
            if self.folded[idx] || !live.nodes[idx] {
                continue;
            }
            self.current_node = idx;
            // The node's own kiln_cpu time, not what folding or an earlier node left.
            self.shims.take_cpu_time();
            let t0 = Instant::now();
            if self.runs_on_executor(idx) {
                self.run_on_executor(idx, values)?;
                let op = &self.model.graph.nodes[idx].op_type;
                self.report.record_node(op, super::CONTROL_FLOW, t0.elapsed(), (Duration::ZERO, Duration::ZERO));
                self.release_dead(idx, values);
                continue;
            }
            let resolved = self.run_node(idx, values)?;
            if profiling {
                self.backend.gpu().map_or(Ok(()), Gpu::mark)?;
                order.push(idx);
            }
            if self.recorder.is_none() {
                let cpu = self.shims.take_cpu_time();
                self.report.record_node(&self.model.graph.nodes[idx].op_type, &resolved.package_id, t0.elapsed(), cpu);
            }
            self.release_dead(idx, values);
        }
        if profiling {
            self.collect_gpu_profile(&order)?;
        }
        Ok(())
    }

    /// Releases node `idx`'s inputs after their last use, and its outputs nobody reads.
    fn release_dead(&mut self, idx: usize, values: &mut [Option<Value>]) {
        let node = &self.model.graph.nodes[idx];
        let mut dead: Vec<ValueId> =
            node.inputs.iter().flatten().copied().filter(|v| self.last_use[*v] == Some(idx)).collect();
        dead.extend(node.outputs.iter().flatten().copied().filter(|v| self.last_use[*v].is_none()));
        for v in dead {
            if let Some(val) = values[v].take() {
                drop(val);
            }
            self.non_tensors.remove(&v);
        }
    }

    /// Whether node `idx` runs on the executor rather than a package: control flow, a sequence
    /// or optional op, or a node reading a sequence or optional (Identity passes one through;
    /// any other such node fails there, naming it).
    fn runs_on_executor(&self, idx: usize) -> bool {
        self.control[idx].is_some()
            || self.sequence_ops[idx]
            || (!self.non_tensors.is_empty()
                && self.model.graph.nodes[idx].inputs.iter().flatten().any(|v| self.non_tensors.contains_key(v)))
    }

    /// Runs node `idx` on the executor (see `control` and `sequence`): its inputs on the host (a
    /// GPU's downloaded: a seam), its outputs as host values (tensors uploaded when a GPU node
    /// reads them). In a plan's dry run it is a seam.
    fn run_on_executor(&mut self, idx: usize, values: &mut [Option<Value>]) -> Result<()> {
        let node = self.model.graph.nodes[idx].clone();
        if let Some(rec) = self.recorder.as_mut() {
            let why = format!("node {:?} ({}) runs on the executor, on host values", node.name, node.op_type);
            rec.seam(why.clone());
            return Err(Error::Unsupported(why));
        }
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for v in &node.inputs {
            let Some(v) = v else {
                inputs.push(None);
                continue;
            };
            if let Some(other) = self.non_tensors.get(v) {
                inputs.push(Some(other.clone()));
                continue;
            }
            let val = match values[*v].as_ref() {
                Some(val) => val.clone_ref(),
                None => self.resident(*v).ok_or_else(|| {
                    Error::Model(format!(
                        "node {:?} reads {:?} before it is computed",
                        node.name, self.model.graph.values[*v].name
                    ))
                })?,
            };
            if val.host_bytes().is_none() {
                self.report.control_flow.host_reads += 1;
            }
            let t =
                self.host_tensor(&val).map_err(|e| e.context(&format!("node {:?} ({}): ", node.name, node.op_type)))?;
            inputs.push(Some(HostValue::Tensor(t)));
        }
        let outs = if self.control[idx].is_some() {
            let mut cf = self.control[idx]
                .take()
                .ok_or_else(|| Error::Model(format!("node {:?} lost its bodies", node.name)))?;
            let outs = cf.run(&node, &self.model.graph, inputs, self.options.max_loop_iterations, &mut self.report);
            self.control[idx] = Some(cf);
            outs?
        } else if self.sequence_ops[idx] {
            super::sequence::run(&node, inputs)?
        } else if node.domain.is_empty() && node.op_type == "Identity" {
            inputs
        } else {
            let (i, kind) = inputs
                .iter()
                .enumerate()
                .find_map(|(i, v)| v.as_ref().filter(|v| !matches!(v, HostValue::Tensor(_))).map(|v| (i, v.kind())))
                .unwrap_or((0, crate::model::Kind::Tensor));
            return Err(Error::Unsupported(format!(
                "node {:?} ({}): input {i} is a {kind}; packages take tensors (only the executor's ops, If, Loop, \
                 SequenceMap and Identity take sequences and optionals)",
                node.name, node.op_type
            )));
        };
        for (o, v) in node.outputs.iter().zip(outs) {
            if let Some(HostValue::Tensor(t)) = &v {
                if t.data.len() as u64 > self.max_tensor_bytes {
                    return Err(Error::Input(format!(
                        "node {:?} ({}) made a {} {:?} output of {} bytes, over the session's tensor limit of {}",
                        node.name,
                        node.op_type,
                        t.dtype,
                        t.shape,
                        t.data.len(),
                        self.max_tensor_bytes
                    )));
                }
            }
            match (o, v) {
                (Some(id), Some(HostValue::Tensor(t))) => values[*id] = Some(Value::Host(t)),
                (Some(id), Some(other)) => {
                    self.non_tensors.insert(*id, other);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Uploads every initializer to the GPU once (resident weights).
    fn upload_initializers(&mut self) -> Result<()> {
        let Some(gpu) = self.backend.gpu() else { return Ok(()) };
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
                paged: None,
            },
            None => Value::Host(t.clone()),
        })
    }

    /// A value's bytes on the host (downloads device values).
    fn host_tensor(&mut self, v: &Value) -> Result<Tensor> {
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
        let t = self.backend.read(v, 0, v.dtype(), v.shape().to_vec())?;
        self.check_device()?;
        Ok(t)
    }

    /// Fails with the first input a kernel found out of range since the last check (ABI.md
    /// §7.5), naming its node, op and package; the records are then clear for the next run.
    /// Call it after a synchronization.
    fn check_device(&mut self) -> Result<()> {
        let Some(fault) = self.backend.gpu().and_then(Gpu::take_fault) else { return Ok(()) };
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
        let resolved = self.types.resolve(&self.model, &self.shims.rt.registry, idx, dtypes, rank)?;
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
        let call = Call { model: &self.model, shims: &mut self.shims, report: &mut self.report };
        let out_types = self.types.infer_keyed(call, idx, res, &infer_ins, key.clone())?;
        // String tensors live on the host (ABI.md §6): a node that reads or makes one runs there.
        let strings = inputs.iter().flatten().any(|v| v.dtype() == DType::String)
            || out_types.iter().flatten().any(|(d, _)| *d == DType::String);
        let on_host = self.backend.gpu_ref().is_none()
            || strings
            || (self.options.small_integer_nodes_on_host && Self::runs_on_host(&inputs, &out_types));
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
            let check = self.options.check_dispatch && self.backend.gpu_ref().is_none();
            let in_place = self.cpu_in_place(res, &host, &out_ids, &out_types);
            let lent = self.lend_in_place(idx, res, &in_place, (&in_ids, &out_ids), &mut inputs, values);
            let outs = self.shims.run_reference(
                &self.model,
                idx,
                res,
                (&mut host, &in_place),
                &out_types,
                check,
                &mut self.report,
            );
            self.return_lent(&lent, outs.as_ref().ok(), &host);
            outs?.into_iter().map(|t| t.map(Value::Host)).collect()
        } else {
            // Host values go to the device once, for every later reader too (and for a value
            // this node reads twice, once).
            for (slot, v) in in_ids.iter().enumerate() {
                if let (Some(id), Some(Value::Host(_))) = (v, &inputs[slot]) {
                    let d = match values[*id].as_ref() {
                        Some(on @ Value::Device { .. }) => on.clone_ref(),
                        _ => {
                            let Some(val) = inputs[slot].take() else { continue };
                            let d = self.backend.place(&val)?;
                            if let (Some(rec), Value::Host(t)) = (self.recorder.as_mut(), &val) {
                                rec.upload(*id, t);
                            }
                            let r = d.clone_ref();
                            if let Some(old) = values[*id].replace(d) {
                                drop(old);
                            }
                            r
                        }
                    };
                    inputs[slot] = Some(d);
                }
            }
            let metadata = reads_metadata_only(&self.model.graph.nodes[idx]);
            let layouts = (
                inputs.iter().map(|v| v.as_ref().and_then(|v| v.paged().cloned()).filter(|_| !metadata)).collect(),
                self.bound_layouts(&out_ids, &out_types),
            );
            self.check_paged(idx, &resolved, &layouts)?;
            let in_ptrs: Vec<Option<u64>> = inputs.iter().map(|v| v.as_ref().and_then(Value::device_ptr)).collect();
            self.check_in_place(idx, (&layouts.0, &in_ptrs), &out_ids, &out_types)?;
            let (outs, plan, functions) =
                self.execute_gpu(idx, res, &inputs, &infer_ins, &out_types, (key, layouts.clone()), &out_ids)?;
            self.memo[idx] = Some(Arc::new(NodeMemo {
                inputs: infer_ins.iter().map(|i| i.as_ref().map(|i| (i.dtype, i.shape.clone()))).collect(),
                value_bytes: infer_ins.iter().map(|i| i.as_ref().and_then(|i| i.bytes.clone())).collect(),
                layouts,
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
                (_, Some(v)) => drop(v),
                _ => {}
            }
        }
        Ok(resolved)
    }

    /// For each output of a node that runs through its CPU reference on `host` inputs: the input
    /// whose buffer it is bound in place to (ABI.md §7.8), where the output is bound to a held
    /// host tensor (`Fetch::Into`) whose bytes that input is, of the output's dtype and size.
    /// Told only to packages of manifest schema 16 or later (a shim on an older SDK refuses the
    /// flag); `None` everywhere else.
    fn cpu_in_place(
        &self,
        res: &Resolution,
        host: &[Option<Tensor>],
        out_ids: &[Option<ValueId>],
        out_types: &OutputTypes,
    ) -> Vec<Option<u32>> {
        if self.bound.is_empty() || res.package.manifest.schema < 16 {
            return vec![None; out_types.len()];
        }
        (out_ids.iter().zip(out_types))
            .map(|(id, t)| {
                let t = t.as_ref()?;
                let held = self.bound_target(*id, t)?.value.host_bytes()?;
                let nbytes = byte_size(t.0, &t.1).ok()?;
                let same = |x: &Tensor| {
                    x.dtype == t.0 && x.data.len() as u64 == nbytes && x.data.as_ptr() == held.data.as_ptr()
                };
                host.iter().position(|x| x.as_ref().is_some_and(same)).and_then(|i| u32::try_from(i).ok())
            })
            .collect()
    }

    /// Where node `idx`'s package takes an output bound in place as its input's own buffer
    /// (manifest schema [`IN_PLACE_SHARED_SCHEMA`], ABI.md §7.8), lets go of every other holder of
    /// that input's bytes, so that the output takes the buffer without a copy: the node's own
    /// reference (`inputs`), the input's value where this node reads it last, and the bytes of the
    /// held tensor the output is bound to, lent out until [`Session::return_lent`]. A KV cache's
    /// present then grows in its past's buffer, as on a GPU, instead of a copy of the whole cache
    /// a step. Returns (output index, input index, held id) of each held tensor lent.
    fn lend_in_place(
        &mut self,
        idx: usize,
        res: &Resolution,
        in_place: &[Option<u32>],
        (in_ids, out_ids): (&[Option<ValueId>], &[Option<ValueId>]),
        inputs: &mut [Option<Value>],
        values: &mut [Option<Value>],
    ) -> Vec<(usize, usize, u64)> {
        if res.package.manifest.schema < IN_PLACE_SHARED_SCHEMA {
            return Vec::new();
        }
        let mut lent = Vec::new();
        for (j, i) in in_place.iter().enumerate() {
            let Some(i) = i.map(|i| i as usize) else { continue };
            if let Some(slot) = inputs.get_mut(i) {
                *slot = None;
            }
            if let Some(v) = in_ids.get(i).copied().flatten().filter(|v| self.last_use[*v] == Some(idx)) {
                values[v] = None;
            }
            let Some(h) = out_ids.get(j).copied().flatten().and_then(|o| self.bound.get(&o)).copied() else { continue };
            if let Some(Held { value: Value::Host(t), .. }) = self.held.by_id_mut(h) {
                drop(std::mem::take(&mut t.data));
                lent.push((j, i, h));
            }
        }
        lent
    }

    /// Gives the held tensors [`Session::lend_in_place`] lent their bytes back: the node's output
    /// bound to each (`outs`, what it returned), or where the node failed its input's bytes in
    /// `host`, which the call gave back (the past, and whatever new positions the shim wrote
    /// before it failed), as a failed GPU step leaves its cache. Only where those are missing too
    /// (a host error after the call) does the tensor get zeros of its size.
    fn return_lent(
        &mut self,
        lent: &[(usize, usize, u64)],
        outs: Option<&Vec<Option<Tensor>>>,
        host: &[Option<Tensor>],
    ) {
        for &(j, i, h) in lent {
            let Some(Held { value: Value::Host(t), .. }) = self.held.by_id_mut(h) else { continue };
            let nbytes = byte_size(t.dtype, &t.shape).unwrap_or(0);
            let back = match outs {
                Some(outs) => outs.get(j).and_then(Option::as_ref),
                None => host.get(i).and_then(Option::as_ref),
            };
            t.data = match back {
                Some(x) if x.data.len() as u64 == nbytes => x.data.clone(),
                _ => bytes::Bytes::from(vec![0u8; nbytes as usize]),
            };
        }
    }

    /// The held tensor output `id` of type `t` is written into (bound by `Fetch::Into`, and
    /// fitting it), as `launch_outputs` chooses it.
    fn bound_target(&self, id: Option<ValueId>, t: &(DType, Vec<usize>)) -> Option<&Held> {
        let nbytes = byte_size(t.0, &t.1).ok()?;
        id.and_then(|id| self.bound.get(&id)).and_then(|h| self.held.by_id(*h)).filter(|h| h.fits(t.0, nbytes))
    }

    /// The paged layouts of the held tensors a node's outputs are written into.
    fn bound_layouts(&self, out_ids: &[Option<ValueId>], out_types: &OutputTypes) -> Vec<Option<Arc<Paged>>> {
        (out_ids.iter().zip(out_types)).map(|(id, t)| self.bound_layout(*id, t).cloned()).collect()
    }

    /// The paged layout of the held tensor output `id` of type `t` is written into, if any.
    fn bound_layout(&self, id: Option<ValueId>, t: &Option<(DType, Vec<usize>)>) -> Option<&Arc<Paged>> {
        if self.bound.is_empty() {
            return None;
        }
        t.as_ref().and_then(|t| self.bound_target(id, t)).and_then(|h| h.value.paged())
    }

    /// Errors when node `idx` would read a paged input or write a paged output that its
    /// package does not declare (`paged_inputs`, `paged_outputs`; ABI.md §6.1.1): its kernels
    /// would address the tensor as row-major.
    fn check_paged(&self, idx: usize, resolved: &Resolved, layouts: &Layouts) -> Result<()> {
        let entry = &resolved.res.entry;
        let lists = [("input", &layouts.0, &entry.paged_inputs), ("output", &layouts.1, &entry.paged_outputs)];
        for (what, list, declared) in lists {
            if let Some(i) = (0..list.len()).find(|i| list[*i].is_some() && !declared.contains(i)) {
                let n = &self.model.graph.nodes[idx];
                let field = format!("paged_{what}s");
                return Err(Error::Unsupported(format!(
                    "node {:?} ({}): {what} {i} is a paged tensor (a view of a paged KV cache), which {} does not \
                     declare in {field} (kernel.toml, ABI.md §6.1.1); keep the KV cache row-major \
                     (`Generator::set_paged_kv(false)`, `kiln bench decode --paged-kv off`) or use a package that \
                     declares it",
                    n.name, n.op_type, resolved.package_id
                )));
            }
        }
        Ok(())
    }

    /// Errors when an output of node `idx` is written into a paged tensor that is not one of
    /// its paged inputs (`inputs`: their layouts and addresses): a paged KV cache is written
    /// only in place, where the kernels touch only the positions its rows have mapped.
    fn check_in_place(
        &self,
        idx: usize,
        inputs: (&[Option<Arc<Paged>>], &[Option<u64>]),
        out_ids: &[Option<ValueId>],
        out_types: &OutputTypes,
    ) -> Result<()> {
        if self.bound.is_empty() {
            return Ok(());
        }
        for (i, (id, t)) in out_ids.iter().zip(out_types).enumerate() {
            let Some(h) = t.as_ref().and_then(|t| self.bound_target(*id, t)) else { continue };
            if h.value.paged().is_none() {
                continue;
            }
            let ptr = h.device_ptr();
            if !inputs.0.iter().zip(inputs.1).any(|(l, p)| l.is_some() && *p == ptr) {
                let n = &self.model.graph.nodes[idx];
                return Err(Error::Input(format!(
                    "node {:?} ({}): output {i} is bound to a paged tensor that is not one of its paged inputs; a \
                     paged KV cache is written only in place (bind the present to its past's view)",
                    n.name, n.op_type
                )));
            }
        }
        Ok(())
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
        key: (InferKey, Layouts),
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
                let opset = opset_of(&self.model, idx)?;
                let node = self.model.graph.nodes[idx].clone();
                let (in_paged, out_paged) = &key.1;
                let paged = |l: Option<&Option<Arc<Paged>>>| l.cloned().flatten().map(|p| Paged::clone(&p));
                // Inputs constant for the session (ABI.md §7.7): resident initializers that no feed
                // replaces, told to packages of manifest schema 14 or later.
                let g = &self.model.graph;
                let tells = self.options.constant_inputs && res.package.manifest.schema >= 14;
                let constant = |i: usize| {
                    let v = node.inputs.get(i).copied().flatten();
                    tells && v.is_some_and(|v| g.initializers.contains_key(&v) && !g.inputs.contains(&v))
                };
                let args = node_call(
                    &node,
                    opset,
                    (infer_ins.iter().enumerate())
                        .map(|(i, t)| {
                            t.as_ref().map(|t| ArgTensor {
                                paged: paged(in_paged.get(i)),
                                constant: constant(i),
                                in_place_of: None,
                                ..t.opaque_arg()
                            })
                        })
                        .collect(),
                    (out_types.iter().enumerate())
                        .map(|(i, t)| {
                            t.as_ref().map(|(d, s)| ArgTensor {
                                dtype: Some(*d),
                                dims: Some(s.iter().map(|&x| x as i64).collect()),
                                value: None,
                                nbytes: byte_size(*d, s).unwrap_or(0),
                                access: Access::Opaque,
                                paged: paged(out_paged.get(i)),
                                constant: false,
                                in_place_of: None,
                            })
                        })
                        .collect(),
                );
                let plan = Arc::new(self.shims.call(&res.package, CallKind::Dispatch, args, &mut self.report)?.plan);
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
        let gpu = self.backend.gpu().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
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
        gpu.prepare_counters(idx, &plan)?;
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
            // after the run, by `fetch_output`), in its layout.
            let bound = self.bound_target(*id, &(*dtype, shape.clone()));
            let paged = bound.and_then(|h| h.value.paged().cloned());
            let target = bound.and_then(Held::device_ptr);
            let gpu = self.backend.gpu().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
            let (ptr, owned) = match target {
                Some(ptr) => (ptr, None),
                None => match gpu.alloc.alloc(nbytes) {
                    Ok(b) => (b.ptr, Some(b)),
                    Err(e) => {
                        for v in outs.into_iter().flatten() {
                            drop(v);
                        }
                        return Err(e);
                    }
                },
            };
            slots.push((ptr, nbytes));
            in_place.push(target.is_some());
            outs.push(Some(Value::Device {
                dtype: *dtype,
                shape: shape.clone(),
                ptr,
                nbytes,
                owned,
                host: None,
                paged,
            }));
        }
        if self.recorder.is_some() {
            self.record_node(idx, plan, functions, &slots[..n_in], &outs, out_ids, &in_place);
        }
        let gpu = self.backend.gpu().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        let result = if self.recorder.is_some() {
            gpu.prepare_library_steps(plan)
        } else {
            self.report.launches += plan.steps.len() as u64;
            gpu.execute_resolved(plan, functions, &slots, idx)
        };
        if let Err(e) = result {
            for v in outs.into_iter().flatten() {
                drop(v);
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
        let opset = opset_of(&self.model, idx)?;
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
                        paged: None,
                        constant: false,
                        in_place_of: None,
                    },
                })
            })
            .collect();
        let args = node_call(&node, opset, args_in, cpu::output_args(out_types, self.shims.max_tensor_bytes, vec![]));
        let n_in = inputs.iter().flatten().count();
        match self.shims.call(&res.package, CallKind::Cpu, args, &mut self.report) {
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
        // The memo's layouts, compared without allocating (this runs for every node of an eager
        // step); Shape and Size took theirs as metadata.
        let metadata = reads_metadata_only(node);
        let in_paged = node
            .inputs
            .iter()
            .map(|v| v.and_then(|id| values[id].as_ref()).and_then(Value::paged).filter(|_| !metadata));
        let out_paged = out_ids.iter().zip(&memo.out_types).map(|(id, t)| self.bound_layout(*id, t));
        if !in_paged.eq(memo.layouts.0.iter().map(Option::as_ref))
            || !out_paged.eq(memo.layouts.1.iter().map(Option::as_ref))
        {
            return Ok(None);
        }
        if memo.layouts.1.iter().any(Option::is_some) {
            let ptrs: Vec<Option<u64>> =
                node.inputs.iter().map(|v| v.and_then(|id| values[id].as_ref()).and_then(Value::device_ptr)).collect();
            self.check_in_place(idx, (&memo.layouts.0, &ptrs), &out_ids, &memo.out_types)?;
        }
        if self.recorder.is_none() {
            self.report.plan_hits += 1;
        }
        let outs = self.launch_outputs(idx, &memo.plan, &memo.functions, &memo.out_types, &out_ids, slots)?;
        for (o, v) in out_ids.iter().zip(outs) {
            match (o, v) {
                (Some(id), Some(v)) => values[*id] = Some(v),
                (_, Some(v)) => drop(v),
                _ => {}
            }
        }
        Ok(Some(memo.resolved.clone()))
    }

    /// Finishes one graph output `v` of a run as `fetch` asks.
    fn fetch_output(&mut self, name: &str, v: Value, fetch: &Fetch<'_>) -> Result<Fetched> {
        match fetch {
            Fetch::Host => self.host_tensor(&v).map(Fetched::Host),
            Fetch::Device => {
                let on_device = self.backend.gpu_ref().is_some();
                let v = match v {
                    v @ (Value::Device { owned: Some(_), .. } | Value::Host(_)) if on_device == v.is_device() => v,
                    // An alias (an input or an initializer): the held tensor gets its own copy.
                    other => self.backend.duplicate(&other)?,
                };
                let capacity = v.nbytes();
                Ok(Fetched::Device(self.held.hold(v, capacity)))
            }
            Fetch::Skip => Ok(Fetched::Written),
            Fetch::Into(t) => {
                let (dtype, shape, nbytes) = (v.dtype(), v.shape().to_vec(), v.nbytes());
                let h = self.held.get(t)?;
                if !h.fits(dtype, nbytes) {
                    return Err(Error::Input(format!(
                        "output {name:?} ({dtype} {shape:?}, {nbytes} bytes) does not fit its bound tensor ({}, {} bytes)",
                        h.value.dtype(),
                        h.capacity
                    )));
                }
                if h.value.is_device() {
                    // The bytes go into the held buffer (nothing moves when the producing node
                    // wrote there).
                    let dst = &mut self.held.get_mut(t)?.value;
                    if dst.device_ptr() != v.device_ptr() {
                        self.backend.copy(&v, 0, dst, 0, nbytes as usize)?;
                    }
                    self.held.set_shape(self.held.id(t)?, shape, nbytes);
                } else {
                    // On the CPU the held value is replaced.
                    let host = self.host_tensor(&v)?;
                    self.held.get_mut(t)?.value = Value::Host(host);
                }
                Ok(Fetched::Written)
            }
        }
    }

    /// A view of the first elements of held device tensor `t` as a tensor of `shape` (its
    /// dtype): the same device buffer from its start, so writes through either are seen by the
    /// other, and its address is `t`'s. A KV cache of `[rows, heads, positions, size]` viewed
    /// as `[n, heads, positions, size]` is the cache of its first `n` rows. `t`'s buffer stays
    /// until every view of it is dropped, whenever `t` is. A view of a view views its parent.
    /// Errors: a CPU session (host tensors are not shared), a shape larger than `t`, a freed or
    /// foreign handle.
    pub fn view(&mut self, t: &DeviceTensor, shape: Vec<usize>) -> Result<DeviceTensor> {
        self.held.view(t, shape)
    }

    /// The bytes of a new held tensor of `dtype` and `shape`. Errors: unsupported dtype, size
    /// overflow, over the session's limit per tensor.
    fn new_tensor_bytes(&self, dtype: DType, shape: &[usize]) -> Result<u64> {
        let nbytes = byte_size(dtype, shape)?;
        if nbytes > self.max_tensor_bytes {
            return Err(Error::Input(format!(
                "a {dtype} tensor of shape {shape:?} ({nbytes} bytes) is over the limit of {} bytes per tensor",
                self.max_tensor_bytes
            )));
        }
        Ok(nbytes)
    }

    /// A new held tensor of `dtype` whose addresses are reserved for `shape` (`[rows, ...]`)
    /// and whose first `mapped` rows are mapped, zeros: the tensor has shape `[mapped, ...]`.
    /// [`Session::map_rows`] maps more rows or fewer, at the same address; views of its first
    /// rows ([`Session::view`]) are how work reads it. A KV cache whose rows follow a batch's
    /// load lives so: its address never moves, so each row count's captured graph stays valid,
    /// and only the rows in use hold memory. Errors: a CPU session, `mapped` over the rows,
    /// size overflow, the per-tensor limit, the device-memory limit (nothing is held then).
    pub fn reserve(&mut self, dtype: DType, shape: Vec<usize>, mapped: usize) -> Result<DeviceTensor> {
        self.held.reclaim();
        let nbytes = self.new_tensor_bytes(dtype, &shape)?;
        let gpu = self.backend.gpu().ok_or_else(|| Error::Unsupported("reserved tensors need a GPU session".into()))?;
        self.held.reserve(gpu, dtype, shape, nbytes, mapped)
    }

    /// Maps the first `rows` rows of reserved tensor `t` (growing: the new rows are zeros;
    /// shrinking: the chunks past them are unmapped behind a fence, the device's work so far
    /// finished first), which then has shape `[rows, ...]` at its same address. Growth maps
    /// whole chunks of the device's granularity, so a little more may be mapped than asked.
    /// Errors: not a reserved tensor, more rows than reserved, a view still reading rows past
    /// `rows`, the device-memory limit or the driver's (the tensor stays as it was).
    pub fn map_rows(&mut self, t: &DeviceTensor, rows: usize) -> Result<()> {
        self.held.reclaim();
        let gpu = self.backend.gpu().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        self.held.map_rows(gpu, t, rows)
    }

    /// Whether graph inputs `inputs` and outputs `outputs` (a KV cache's pasts and presents,
    /// of `dtype`) may be paged tensors (ABI.md §6.1.1): every node reading an input resolves, for
    /// `dtype`, to a package that lists the slot in `paged_inputs` (or is ai.onnx `Shape` or
    /// `Size`, which read no bytes), and every node writing an output lists it in
    /// `paged_outputs`. `false` on the CPU, for an unknown name, or a node that resolves to no
    /// package.
    pub fn accepts_paged(&mut self, inputs: &[String], outputs: &[String], dtype: DType) -> bool {
        if self.backend.gpu_ref().is_none() {
            return false;
        }
        let g = &self.model.graph;
        let (Some(ins), Some(outs)) = (
            inputs.iter().map(|n| g.value_id(n).filter(|v| g.inputs.contains(v))).collect::<Option<Vec<_>>>(),
            outputs.iter().map(|n| g.value_id(n).filter(|v| g.outputs.contains(v))).collect::<Option<Vec<_>>>(),
        ) else {
            return false;
        };
        for idx in 0..g.nodes.len() {
            let n = &self.model.graph.nodes[idx];
            let reads: Vec<usize> =
                (0..n.inputs.len()).filter(|&i| n.inputs[i].is_some_and(|v| ins.contains(&v))).collect();
            let writes: Vec<usize> =
                (0..n.outputs.len()).filter(|&i| n.outputs[i].is_some_and(|v| outs.contains(&v))).collect();
            if reads.is_empty() && writes.is_empty() {
                continue;
            }
            if reads_metadata_only(n) && writes.is_empty() {
                continue;
            }
            let dtypes = vec![Some(dtype); n.inputs.len()];
            let Ok(r) = self.types.resolve(&self.model, &self.shims.rt.registry, idx, dtypes, 4) else { return false };
            let e = &r.res.entry;
            if !reads.iter().all(|i| e.paged_inputs.contains(i)) || !writes.iter().all(|i| e.paged_outputs.contains(i))
            {
                return false;
            }
        }
        true
    }

    /// Reserves the addresses of a paged KV cache (see `super::pages`): `pages.tensors` cache
    /// tensors of `[rows, kv_heads, positions, head_size]` of `dtype` in one reservation, each
    /// row's region mapped as its sequence grows ([`Session::map_pages`]), nothing mapped yet.
    /// The handle owns the addresses; [`Session::page_view`] gives the cache tensors as paged
    /// tensors (ABI.md §6.1.1) that ops declaring `paged_inputs` read and write in place. The
    /// addresses never move, so a captured graph that reads them stays valid. Errors: a CPU
    /// session, a zero dimension, sizes that overflow, a dtype without a size, the
    /// reservation's (address space).
    pub fn reserve_pages(&mut self, dtype: DType, pages: super::KvPages) -> Result<DeviceTensor> {
        self.held.reclaim();
        let gpu = self.backend.gpu().ok_or_else(|| Error::Unsupported("paged KV caches need a GPU session".into()))?;
        self.held.reserve_pages(gpu, dtype, pages)
    }

    /// Cache tensor `i` of paged KV cache `pages` over its first `rows` rows: a paged view of
    /// shape `[rows, kv_heads, positions, head_size]` at a fixed address (the cache's addresses
    /// outlive its handle until the views go). Only kernels of ops that declare it read or
    /// write it: a host read, write or copy of it is refused. Errors: not a paged KV cache, `i`
    /// or `rows` past the cache's.
    pub fn page_view(&mut self, pages: &DeviceTensor, i: usize, rows: usize) -> Result<DeviceTensor> {
        self.held.reclaim();
        self.held.page_view(pages, i, rows)
    }

    /// Maps rows `0 .. rows` of paged KV cache `pages` for their first `positions` positions:
    /// a row short of them maps one chunk of at least [`SessionOptions::vmm_chunk_bytes`] (per
    /// row; its new bytes zeros, stream-ordered). With `trim`, it then unmaps, behind a fence (the
    /// device's work so far finished first), the rows from `rows` on and what each other row
    /// maps past its positions and one chunk. Views are not checked (each spans every position,
    /// mapped or not): the caller maps what the work it enqueues reads and writes, as a decode
    /// step's rows read and write only positions below their lengths. Errors: not a paged KV
    /// cache, more rows than reserved, the device-memory limit ([`Error::OutOfMemory`]) or the
    /// driver's (the rows grown before the failure stay so).
    pub fn map_pages(&mut self, pages: &DeviceTensor, rows: usize, positions: usize, trim: bool) -> Result<()> {
        self.held.reclaim();
        let chunk = self.options.vmm_chunk_bytes;
        let gpu = self.backend.gpu().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        self.held.map_pages(gpu, pages, (rows, positions), chunk, trim)
    }

    /// Copies the first `positions` positions of row `src.1` of row-major cache tensor `src.0`
    /// (`[batch, kv_heads, length, head_size]`, a prefill's present) into row `dst.2` of cache
    /// tensor `dst.1` of paged KV cache `dst.0`, stream-ordered: one strided copy per KV head.
    /// Errors: shapes or dtypes that differ, positions past either tensor, a destination row
    /// that has not mapped them, the driver's.
    pub fn copy_into_pages(
        &mut self,
        src: (&DeviceTensor, usize),
        dst: (&DeviceTensor, usize, usize),
        positions: usize,
    ) -> Result<()> {
        let gpu = self.backend.gpu().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        self.held.copy_into_pages(gpu, src, dst, positions)
    }

    /// Copies the first `positions` positions of every cache tensor from row `src.1` of paged KV
    /// cache `src.0` to row `dst.1` of paged KV cache `dst.0` (the same cache, or another of the
    /// same dtype and pages: tensors, heads, head size), stream-ordered: one copy, since a row's
    /// pages are contiguous. Errors: caches of other pages, rows past a cache's, either row
    /// without those positions mapped.
    pub fn copy_pages(
        &mut self,
        src: (&DeviceTensor, usize),
        dst: (&DeviceTensor, usize),
        positions: usize,
    ) -> Result<()> {
        let gpu = self.backend.gpu().ok_or_else(|| Error::Device("no GPU in this session".into()))?;
        self.held.copy_pages(gpu, src, dst, positions)
    }

    /// Gives the buffers of dropped [`DeviceTensor`]s back to the pool now (runs and
    /// allocations do it first anyway).
    pub fn reclaim(&mut self) {
        self.held.reclaim();
    }

    /// How many tensors the session holds (dropped ones not reclaimed yet included).
    pub fn held_tensors(&self) -> usize {
        self.held.len()
    }

    /// A new held tensor of zeros, `dtype` and `shape`. Errors: unsupported dtype, size overflow,
    /// device memory limit.
    pub fn zeros(&mut self, dtype: DType, shape: Vec<usize>) -> Result<DeviceTensor> {
        self.held.reclaim();
        let nbytes = self.new_tensor_bytes(dtype, &shape)?;
        self.held.zeros(self.backend.as_mut(), dtype, shape, nbytes)
    }

    /// The device address of a held tensor (`None` on the CPU): a view's is its parent's, and a
    /// reserved tensor's never moves while it grows. Errors: a freed or foreign handle.
    pub fn device_address(&self, t: &DeviceTensor) -> Result<Option<u64>> {
        Ok(self.held.get(t)?.device_ptr())
    }

    /// Dtype and current shape of a held tensor.
    pub fn tensor_type(&self, t: &DeviceTensor) -> Result<(DType, Vec<usize>)> {
        let h = self.held.get(t)?;
        Ok((h.value.dtype(), h.value.shape().to_vec()))
    }

    /// A copy of a held tensor on the host (waits for the device). Errors: the device's, or an
    /// input a kernel found out of range since the last check (`Error::DeviceCheck`).
    pub fn read_tensor(&mut self, t: &DeviceTensor) -> Result<Tensor> {
        let v = self.held.get(t)?.value.clone_ref();
        self.host_tensor(&v)
    }

    /// Waits for the work enqueued on the session's device so far (on a GPU, every session's
    /// work on its one compute stream). Errors: the device's, or an input a kernel found out of
    /// range meanwhile (as [`Session::read_tensor`]).
    pub fn synchronize(&mut self) -> Result<()> {
        self.backend.synchronize()?;
        self.check_device()
    }

    /// Starts reading a small held tensor (at most [`crate::cuda::READBACK_BYTES`]) back to the
    /// host behind the device's work so far, and returns at once: runs enqueued afterwards may
    /// overwrite the tensor (the copy reads it first), so a decode loop can enqueue its next
    /// step before it waits for this one's tokens. At most two reads may be outstanding.
    /// Errors: a tensor over the limit.
    pub fn read_start(&mut self, t: &DeviceTensor) -> Result<PendingRead> {
        let v = &self.held.get(t)?.value;
        self.backend.read_start(v)
    }

    /// Waits for a read of [`Session::read_start`] and returns the tensor; fails, as
    /// [`Session::read_tensor`] does, when a kernel reported an input out of range meanwhile.
    pub fn read_finish(&mut self, p: PendingRead) -> Result<Tensor> {
        let t = self.backend.read_finish(p)?;
        self.check_device()?;
        Ok(t)
    }

    /// Elements `start .. start + len` of a held tensor, flattened row-major, as a 1-D host
    /// tensor (waits for the device). Errors: a range outside the tensor, and as
    /// [`Session::read_tensor`].
    pub fn read_slice(&mut self, t: &DeviceTensor, start: usize, len: usize) -> Result<Tensor> {
        let t = self.held.read_slice(self.backend.as_mut(), t, start, len)?;
        self.check_device()?;
        Ok(t)
    }

    /// Copies host tensor `t` into held tensor `dst`, which takes `t`'s shape (enqueued on the
    /// GPU's stream: later runs see it). Errors: another dtype, or more bytes than `dst` holds.
    pub fn write_tensor(&mut self, dst: &DeviceTensor, t: &Tensor) -> Result<()> {
        self.held.write_tensor(self.backend.as_mut(), dst, t)
    }

    /// Copies elements `src_start .. src_start + len` of held tensor `src` to elements
    /// `dst_start ..` of held tensor `dst` (both flattened row-major; stream-ordered on a GPU,
    /// like a run). A continuous batch copies a prefilled sequence's KV row into its slot this
    /// way. Errors: different dtypes, the same tensor, or a range outside either tensor.
    pub fn copy_elements(
        &mut self,
        src: &DeviceTensor,
        src_start: usize,
        dst: &DeviceTensor,
        dst_start: usize,
        len: usize,
    ) -> Result<()> {
        self.held.copy_elements(self.backend.as_mut(), src, src_start, dst, dst_start, len)
    }

    /// Writes `values` (a tensor of `dst`'s dtype, any shape) into elements `start ..
    /// start + values.numel()` of held tensor `dst` (flattened row-major). On a GPU the copy
    /// is stream-ordered like a run: work enqueued before it (a decode step in flight) reads
    /// the old elements, work enqueued after it the new ones. A continuous batch sets a joining
    /// sequence's rows of the step buffers this way. Errors: another dtype, or a range outside
    /// `dst`.
    pub fn write_elements(&mut self, dst: &DeviceTensor, start: usize, values: &Tensor) -> Result<()> {
        self.held.write_elements(self.backend.as_mut(), dst, start, values)
    }

    /// Names and declared types of the graph inputs.
    pub fn input_names(&self) -> Vec<String> {
        self.model.graph.inputs.iter().map(|i| self.model.graph.values[*i].name.clone()).collect()
    }

    /// The value ids of the graph outputs.
    pub fn output_ids(&self) -> &[ValueId] {
        &self.model.graph.outputs
    }

    /// The kernel loads this GPU session paid for: NVRTC compiles and on-disk cache hits of the
    /// packages it used first in this process (a package whose kernels the device's module
    /// cache holds, loaded by another session, costs neither). `None` on the CPU.
    pub fn kernel_loads(&self) -> Option<(u64, u64)> {
        self.backend.gpu_ref().map(|g| (g.compiles, g.compile_cache_hits))
    }

    /// Allocator and GEMM-plan counters of a GPU session.
    pub fn gpu_stats(&self) -> Option<(crate::cuda::AllocatorStats, (u64, u64))> {
        self.backend.gpu_ref().map(|g| (g.alloc.stats(), g.gemm_plan_stats()))
    }
}

/// What a GPU offers packages (their `[device]` requirements).
fn caps_of(g: &Gpu) -> kiln_registry::DeviceCaps {
    kiln_registry::DeviceCaps { compute_capability: g.info.compute_capability, features: g.info.features() }
}

/// Checks a fed value against the input's declared dtype and shape.
fn check_input(model: &Model, id: ValueId, name: &str, dtype: DType, shape: &[usize]) -> Result<()> {
    let Some(ty) = &model.graph.values[id].ty else { return Ok(()) };
    if !matches!(&ty.kind, crate::model::Kind::Tensor)
        && ty.kind != crate::model::Kind::Optional(Box::new(crate::model::Kind::Tensor))
    {
        return Err(Error::Input(format!("input {name:?} is declared {}; it was fed a tensor", ty.kind)));
    }
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

//! Execution plans: what one (model, shape signature, output selection) runs on a GPU, built
//! once and then executed eagerly or captured into a CUDA graph (`capture`).
//!
//! A plan is recorded by a *dry* run of the session: every node is resolved, inferred and
//! dispatched as in a real run, but no kernel is launched. The [`Recorder`] keeps, per GPU node,
//! its launch plan, its loaded functions and where each tensor lives:
//! - a graph input's fed tensor ([`Loc::Feed`]) or a graph output's bound tensor
//!   ([`Loc::Bound`]), whose addresses are the run's *bindings*;
//! - a resident initializer ([`Loc::Fixed`]);
//! - a constant computed on the host (shape arithmetic, folded per shape signature) and
//!   uploaded once into the plan ([`Loc::Const`]);
//! - an intermediate or scratch buffer at an offset of the plan's arena ([`Loc::Arena`]).
//!
//! The arena is laid out from value lifetimes (a value lives from the step that writes it to the
//! last step that reads it; scratch lives for its step), so nothing is allocated or freed while
//! the plan runs and every address is fixed: the conditions of a CUDA graph capture.
//!
//! Values that only cuDNN convolutions touch live channels-last (`layout`); their convolutions
//! run with that layout, each reading a channels-last copy of its filter that the session keeps
//! (`Gpu::filter_to_last`).
//!
//! A dry run that needs a device value's bytes on the host (a value input computed on the GPU)
//! or an output not written in place has a *seam*; such a signature is not planned and runs
//! node by node, with the reason counted.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use kiln_kernel_abi::plan::{LaunchPlan, PlanStep};
use kiln_kernel_abi::DType;

use super::layout::{conv_layouts, StepView};
use crate::capture::{CaptureState, Fallback, GraphMode, RECAPTURE_BUDGET};
use crate::cuda::{capture, ConvLayout, DevBuffer, Function, Gpu};
use crate::model::ValueId;
use crate::trace::GraphStats;
use crate::{Error, Result, Tensor};

/// Alignment of arena offsets, in bytes (cudaMalloc's own alignment).
pub const ARENA_ALIGN: u64 = 256;

/// Where a tensor of a planned step lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Loc {
    /// This byte offset of the plan's arena.
    Arena(u64),
    /// The tensor fed to this graph input.
    Feed(ValueId),
    /// The held tensor this graph output is bound to.
    Bound(ValueId),
    /// A resident buffer of the session (an initializer).
    Fixed(CUdeviceptr),
    /// The plan's constant number `i`.
    Const(usize),
}

/// A recorded input of a GPU node, as the session saw it.
pub enum RecIn {
    Feed(ValueId),
    /// Produced by an earlier recorded node.
    Produced(ValueId),
    Fixed(CUdeviceptr),
    /// A host value uploaded for this run (its bytes are a constant of the signature).
    Uploaded(ValueId),
    /// A graph output an earlier node wrote into its bound tensor.
    Bound(ValueId),
}

/// A recorded output of a GPU node.
pub enum RecOut {
    /// Written in place into the held tensor this graph output is bound to.
    Bound(ValueId),
    /// A new buffer for this value.
    Value(ValueId),
    /// An output nobody names (absent in the graph): a buffer for the node's step only.
    Unnamed,
}

struct RecStep {
    node: usize,
    launch: Arc<LaunchPlan>,
    functions: Vec<Option<Function>>,
    /// Inputs then outputs, each with its size in bytes.
    inputs: Vec<(RecIn, u64)>,
    outputs: Vec<(RecOut, u64)>,
}

/// Collects what a dry run does; [`Recorder::finish`] turns it into a plan.
#[derive(Default)]
pub struct Recorder {
    steps: Vec<RecStep>,
    produced: HashSet<ValueId>,
    uploaded: HashMap<ValueId, Tensor>,
    /// Graph outputs written into their bound tensors: dtype, shape and bytes.
    written: HashMap<ValueId, (DType, Vec<usize>, u64)>,
    /// The first reason the run cannot be planned.
    pub seam: Option<String>,
}

impl Recorder {
    /// Whether `v` was produced by a recorded node.
    pub fn produced(&self, v: ValueId) -> bool {
        self.produced.contains(&v)
    }

    /// Whether `v` is a graph output already written into its bound tensor.
    pub fn written(&self, v: ValueId) -> bool {
        self.written.contains_key(&v)
    }

    /// Notes that a node wrote graph output `v` (of this type) into its bound tensor.
    pub fn write_bound(&mut self, v: ValueId, dtype: DType, shape: Vec<usize>, nbytes: u64) {
        self.written.insert(v, (dtype, shape, nbytes));
    }

    /// Whether `v` is a host value uploaded during the recording.
    pub fn uploaded_here(&self, v: ValueId) -> bool {
        self.uploaded.contains_key(&v)
    }

    /// A host value uploaded for a GPU node (its bytes become a constant of the plan).
    pub fn upload(&mut self, v: ValueId, t: &Tensor) {
        self.uploaded.insert(v, t.clone());
    }

    /// Notes the first reason the run cannot be planned.
    pub fn seam(&mut self, why: String) {
        self.seam.get_or_insert(why);
    }

    /// One GPU node: its plan and functions, and its inputs and outputs (present ones, in order).
    pub fn node(
        &mut self,
        node: usize,
        launch: &Arc<LaunchPlan>,
        functions: &[Option<Function>],
        inputs: Vec<(RecIn, u64)>,
        outputs: Vec<(RecOut, u64)>,
    ) {
        for (o, _) in &outputs {
            if let RecOut::Value(v) = o {
                self.produced.insert(*v);
            }
        }
        self.steps.push(RecStep { node, launch: launch.clone(), functions: functions.to_vec(), inputs, outputs });
    }

    /// Lays out the arena and uploads the constants. `outputs` are the graph outputs the run
    /// returns (each must have been written in place into its bound tensor); `channels_last`:
    /// whether convolutions may keep their values channels-last (`layout`). `Ok(Err(seam))`:
    /// the signature cannot be planned, for that reason. Errors: the arena or a constant does
    /// not fit in device memory, cuDNN's (nothing is kept).
    pub fn finish(
        self,
        gpu: &mut Gpu,
        outputs: &[(ValueId, String)],
        channels_last: bool,
    ) -> Result<Result<ExecutionPlan, String>> {
        if let Some(s) = self.seam {
            return Ok(Err(s));
        }
        if let Some((_, name)) = outputs.iter().find(|(v, _)| !self.written.contains_key(v)) {
            return Ok(Err(format!("graph output {name:?} is not written in place into its bound tensor")));
        }
        // Lifetimes: (bytes, first step, last step) per arena buffer.
        let mut intervals: Vec<(u64, usize, usize)> = Vec::new();
        let mut value_interval: HashMap<ValueId, usize> = HashMap::new();
        let mut step_buffers: Vec<Vec<usize>> = Vec::with_capacity(self.steps.len());
        for (i, s) in self.steps.iter().enumerate() {
            for (inp, _) in &s.inputs {
                if let RecIn::Produced(v) = inp {
                    if let Some(&k) = value_interval.get(v) {
                        intervals[k].2 = i;
                    }
                }
            }
            let mut own = Vec::new();
            for (o, n) in &s.outputs {
                match o {
                    RecOut::Value(v) => {
                        value_interval.insert(*v, intervals.len());
                        intervals.push((*n, i, i));
                    }
                    RecOut::Unnamed => {
                        own.push(intervals.len());
                        intervals.push((*n, i, i));
                    }
                    RecOut::Bound(_) => {}
                }
            }
            for &n in &s.launch.scratch_bytes {
                own.push(intervals.len());
                intervals.push((n, i, i));
            }
            step_buffers.push(own);
        }
        let last = if channels_last { channels_last_steps(&self.steps, gpu) } else { Vec::new() };
        let (offsets, arena_bytes) = assign_offsets(&intervals);
        let arena = if arena_bytes > 0 { Some(gpu.alloc.alloc(arena_bytes)?) } else { None };
        let mut plan = ExecutionPlan {
            steps: Vec::with_capacity(self.steps.len()),
            arena,
            arena_bytes,
            consts: Vec::new(),
            outputs: outputs
                .iter()
                .filter_map(|(v, _)| self.written.get(v).map(|(d, s, n)| (*v, *d, s.clone(), *n)))
                .collect(),
            launches: 0,
            pdl_launches: 0,
            channels_last: 0,
            binds: Vec::new(),
            runs: 0,
            capture: CaptureState::default(),
        };
        let mut const_of: HashMap<ValueId, usize> = HashMap::new();
        let (uploaded, steps) = (self.uploaded, self.steps);
        for (i, (s, own)) in steps.into_iter().zip(step_buffers).enumerate() {
            let last = last.get(i).copied().flatten();
            let mut slots = Vec::with_capacity(s.inputs.len() + s.outputs.len() + own.len());
            for (inp, n) in s.inputs {
                let loc = match inp {
                    RecIn::Feed(v) => Loc::Feed(v),
                    RecIn::Bound(v) => Loc::Bound(v),
                    RecIn::Fixed(p) => Loc::Fixed(p),
                    RecIn::Produced(v) => Loc::Arena(offsets[value_interval[&v]]),
                    RecIn::Uploaded(v) => match const_of.get(&v) {
                        Some(&i) => Loc::Const(i),
                        None => {
                            let up = match uploaded.get(&v) {
                                Some(t) => gpu.upload(t),
                                None => Err(Error::Device(format!("execution plan: value {v} was not recorded"))),
                            };
                            plan.consts.push(up?);
                            const_of.insert(v, plan.consts.len() - 1);
                            Loc::Const(plan.consts.len() - 1)
                        }
                    },
                };
                slots.push((loc, n));
            }
            // `own` lists the step's unnamed outputs, then its scratch, in this order.
            let mut own_iter = own.iter();
            for (o, n) in s.outputs {
                let loc = match o {
                    RecOut::Bound(v) => Loc::Bound(v),
                    RecOut::Value(v) => Loc::Arena(offsets[value_interval[&v]]),
                    RecOut::Unnamed => match own_iter.next() {
                        Some(&k) => Loc::Arena(offsets[k]),
                        None => return Err(Error::Device("execution plan: an unnamed output has no buffer".into())),
                    },
                };
                slots.push((loc, n));
            }
            for (&n, &k) in s.launch.scratch_bytes.iter().zip(own_iter) {
                slots.push((Loc::Arena(offsets[k]), n));
            }
            if let Some(l) = last {
                // The filter's channels-last copy in place of the filter.
                if let Some(slot) = slots.get_mut(l.filter_slot) {
                    slot.0 = Loc::Fixed(l.filter);
                }
                plan.channels_last += 1;
            }
            let layout = last.map_or_else(ConvLayout::default, |l| l.layout);
            plan.launches += s.launch.steps.len() as u64;
            plan.pdl_launches += s.functions.iter().flatten().filter(|f| f.pdl).count() as u64;
            plan.steps.push(Step { node: s.node, launch: s.launch, functions: s.functions, slots, layout });
        }
        let mut seen = HashSet::new();
        plan.binds = plan
            .steps
            .iter()
            .flat_map(|s| s.slots.iter().map(|(loc, _)| *loc))
            .filter(|loc| matches!(loc, Loc::Feed(_) | Loc::Bound(_)) && seen.insert(*loc))
            .collect();
        Ok(Ok(plan))
    }
}

/// A recorded step whose convolution computes channels-last: its layout, and its filter's slot
/// with the address of the filter's channels-last copy.
#[derive(Clone, Copy)]
struct ChannelsLastStep {
    layout: ConvLayout,
    filter_slot: usize,
    filter: CUdeviceptr,
}

/// Each recorded step's channels-last convolution (`layout`), its cuDNN plan made and its
/// filter's channels-last copy ready; `None` for every other step. A convolution that cuDNN will
/// not compute channels-last (its plan or its filter's copy fails: a form its NHWC kernels do not
/// take, the memory limit) leaves the choice, which is made again without it (a value's writer
/// and readers must agree), so the others keep theirs. Never inside a capture.
fn channels_last_steps(steps: &[RecStep], gpu: &mut Gpu) -> Vec<Option<ChannelsLastStep>> {
    let views: Vec<StepView<'_>> =
        steps.iter().map(|s| StepView { launch: &s.launch, inputs: &s.inputs, outputs: &s.outputs }).collect();
    let mut refused = vec![false; steps.len()];
    'choose: loop {
        let mut ready = vec![None; steps.len()];
        for (i, (s, layout)) in steps.iter().zip(conv_layouts(&views, &refused)).enumerate() {
            let [PlanStep::Conv(c)] = s.launch.steps.as_slice() else { continue };
            if !layout.computes_last() {
                continue;
            }
            let filter_slot = c.w.handle as usize;
            let copy = match s.inputs.get(filter_slot) {
                Some(&(RecIn::Fixed(src), bytes)) => {
                    gpu.prepare_conv(c, layout).and_then(|()| gpu.filter_to_last(c, src, bytes))
                }
                _ => Err(Error::Device("the filter is not resident".into())),
            };
            match copy {
                Ok(filter) => ready[i] = Some(ChannelsLastStep { layout, filter_slot, filter }),
                Err(e) => {
                    tracing::warn!("node #{}: its convolution stays NCHW in this execution plan: {e}", s.node);
                    refused[i] = true;
                    continue 'choose;
                }
            }
        }
        return ready;
    }
}

/// Offsets for buffers `(bytes, first step, last step)` such that two buffers alive at the same
/// step never overlap; returns them and the arena's size. Largest first, each at the lowest
/// aligned offset free over its lifetime (the greedy-by-size strategy of TFLite's and
/// onnxruntime's memory planners).
pub fn assign_offsets(buffers: &[(u64, usize, usize)]) -> (Vec<u64>, u64) {
    let mut order: Vec<usize> = (0..buffers.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(buffers[i].0), buffers[i].1));
    let mut offsets = vec![0u64; buffers.len()];
    let mut placed: Vec<(u64, u64, usize, usize)> = Vec::new();
    let mut total = 0u64;
    for i in order {
        let (bytes, first, last) = buffers[i];
        let size = bytes.max(1).div_ceil(ARENA_ALIGN) * ARENA_ALIGN;
        let mut live: Vec<(u64, u64)> =
            placed.iter().filter(|p| p.2 <= last && first <= p.3).map(|p| (p.0, p.1)).collect();
        live.sort_unstable();
        let mut at = 0u64;
        for (start, end) in live {
            if start >= at + size {
                break;
            }
            at = at.max(end);
        }
        offsets[i] = at;
        placed.push((at, at + size, first, last));
        total = total.max(at + size);
    }
    (offsets, total)
}

/// One GPU node of a plan.
struct Step {
    node: usize,
    launch: Arc<LaunchPlan>,
    functions: Vec<Option<Function>>,
    /// Inputs, outputs, then scratch, each with its size in bytes.
    slots: Vec<(Loc, u64)>,
    /// Where its convolution's activations live (`layout`).
    layout: ConvLayout,
}

/// The addresses of a run's fed and bound tensors.
pub struct Bindings {
    pub feeds: HashMap<ValueId, CUdeviceptr>,
    pub bound: HashMap<ValueId, CUdeviceptr>,
}

/// A planned execution (see the module docs). Give it back with [`ExecutionPlan::release`].
pub struct ExecutionPlan {
    steps: Vec<Step>,
    arena: Option<DevBuffer>,
    pub arena_bytes: u64,
    consts: Vec<DevBuffer>,
    /// The bound graph outputs: value, dtype, shape and bytes after a run.
    pub outputs: Vec<(ValueId, DType, Vec<usize>, u64)>,
    /// Kernel launches and GEMMs of one eager run.
    pub launches: u64,
    /// Of those, kernels launched with programmatic dependent launch.
    pub pdl_launches: u64,
    /// Convolutions that compute channels-last (`layout`).
    pub channels_last: u64,
    /// The fed and bound values the steps use, each once, in order of first use: what a
    /// captured graph's addresses depend on.
    binds: Vec<Loc>,
    /// Runs so far.
    runs: u64,
    capture: CaptureState,
}

impl ExecutionPlan {
    /// Nodes of one run.
    pub fn nodes(&self) -> usize {
        self.steps.len()
    }

    /// The run's addresses of the plan's fed and bound values, in the plan's fixed order.
    fn binding_vector(&self, b: &Bindings) -> Result<Vec<u64>> {
        self.binds.iter().map(|&loc| self.ptr(loc, b)).collect()
    }

    fn ptr(&self, loc: Loc, b: &Bindings) -> Result<CUdeviceptr> {
        Ok(match loc {
            Loc::Arena(off) => self.arena.as_ref().map(|a| a.ptr + off).ok_or_else(|| missing("arena", 0))?,
            Loc::Feed(v) => *b.feeds.get(&v).ok_or_else(|| missing("input", v))?,
            Loc::Bound(v) => *b.bound.get(&v).ok_or_else(|| missing("output", v))?,
            Loc::Fixed(p) => p,
            Loc::Const(i) => self.consts.get(i).map(|c| c.ptr).ok_or_else(|| missing("constant", i))?,
        })
    }

    /// Enqueues every step on the GPU's stream (no allocation, no synchronization).
    fn enqueue(&self, gpu: &mut Gpu, b: &Bindings) -> Result<()> {
        let mut slots = Vec::new();
        for s in &self.steps {
            slots.clear();
            for &(loc, n) in &s.slots {
                slots.push((self.ptr(loc, b)?, n));
            }
            gpu.run_steps(&s.launch, &s.functions, &slots, s.node, s.layout)
                .map_err(|e| Error::Device(format!("execution plan, node #{}: {e}", s.node)))?;
        }
        Ok(())
    }

    /// Runs the plan: the first run eagerly (it is a real run, and it warms up the kernels that
    /// libraries load lazily, which a capture must not do); later ones replay the graph when the
    /// bindings match, else (by `mode`) capture it anew, update the graph or run eagerly,
    /// counting what happened in `stats`. Returns whether the run was a graph launch. Errors: a
    /// launch or driver failure, or with [`GraphMode::On`] a run that cannot be captured.
    pub fn run(&mut self, gpu: &mut Gpu, mode: GraphMode, b: &Bindings, stats: &mut GraphStats) -> Result<bool> {
        self.runs += 1;
        let why = match (mode, &self.capture.disabled) {
            (GraphMode::Off, _) => Some(Fallback::GraphsOff),
            (_, Some(f)) => Some(f.clone()),
            _ => None,
        };
        if let Some(why) = why {
            return self.eager(gpu, mode, b, stats, why);
        }
        if self.runs == 1 {
            self.enqueue(gpu, b)?;
            stats.first_runs += 1;
            return Ok(false);
        }
        let bindings = self.binding_vector(b)?;
        if self.capture.replayable(&bindings) {
            self.capture.recaptures_in_a_row = 0;
        } else {
            let recapture = self.capture.exec.is_some();
            if recapture {
                self.capture.recaptures_in_a_row += 1;
                if self.capture.recaptures_in_a_row > RECAPTURE_BUDGET {
                    gpu.synchronize()?;
                    self.capture.exec = None;
                    self.capture.disabled = Some(Fallback::RecaptureBudget);
                    return self.eager(gpu, mode, b, stats, Fallback::RecaptureBudget);
                }
            }
            let device = gpu.device.clone();
            let captured = {
                let _gate = device.capturing();
                let stream = device.enqueue().cu_stream();
                capture(stream, || self.enqueue(gpu, b))
            };
            let captured = match captured {
                Ok(c) => c,
                Err(e) => return self.disable(gpu, mode, b, stats, e),
            };
            stats.captures += 1;
            stats.capture_us += captured.capture_time.as_micros() as u64;
            let left = match self.capture.exec.as_mut() {
                Some(exec) => {
                    stats.recaptures += 1;
                    match exec.update(captured)? {
                        Ok(()) => {
                            stats.updates += 1;
                            None
                        }
                        Err((g, _refused)) => Some(g),
                    }
                }
                None => Some(captured),
            };
            if let Some(g) = left {
                let exec = match g.instantiate().and_then(|e| e.upload(device.enqueue().cu_stream()).map(|_| e)) {
                    Ok(e) => e,
                    Err(e) => return self.disable(gpu, mode, b, stats, e),
                };
                stats.instantiate_us += exec.instantiate_time.as_micros() as u64;
                if self.capture.exec.is_some() {
                    // The old executable may still have a launch in flight.
                    gpu.synchronize()?;
                }
                self.capture.exec = Some(exec);
            }
            // This plan's graph, instantiated or updated in place (the same topology).
            if let Some(exec) = &self.capture.exec {
                stats.graph_nodes = exec.nodes as u64;
                stats.graph_kernels = exec.kinds.kernels as u64;
                stats.graph_memsets = exec.kinds.memsets as u64;
                stats.graph_memcpys = exec.kinds.memcpys as u64;
            }
            self.capture.bindings = bindings;
        }
        let exec = self.capture.exec.as_ref().ok_or_else(|| Error::Device("no graph after capture".into()))?;
        exec.launch(gpu.device.enqueue().cu_stream())?;
        stats.replays += 1;
        Ok(true)
    }

    /// Stops capturing this region after a driver refusal, and runs this one eagerly.
    fn disable(
        &mut self,
        gpu: &mut Gpu,
        mode: GraphMode,
        b: &Bindings,
        stats: &mut GraphStats,
        e: Error,
    ) -> Result<bool> {
        let why = Fallback::CaptureFailed(e.to_string());
        self.capture.disabled = Some(why.clone());
        self.eager(gpu, mode, b, stats, why)
    }

    fn eager(
        &mut self,
        gpu: &mut Gpu,
        mode: GraphMode,
        b: &Bindings,
        stats: &mut GraphStats,
        why: Fallback,
    ) -> Result<bool> {
        if mode == GraphMode::On {
            return Err(Error::Unsupported(format!("--graph on: this run cannot be captured: {why}")));
        }
        self.enqueue(gpu, b)?;
        stats.fallback(why.key(), why.to_string());
        Ok(false)
    }

    /// Destroys the graph once no launch of it is in flight; the arena and constants go back
    /// to the pool with their buffers.
    pub fn release(self, gpu: &mut Gpu) {
        let _ = gpu.synchronize();
    }
}

fn missing(what: &str, v: usize) -> Error {
    Error::Device(format!("execution plan: {what} {v} has no buffer in this run"))
}

#[cfg(test)]
mod tests {
    use super::assign_offsets;

    #[test]
    fn buffers_alive_together_never_overlap_and_dead_ones_are_reused() {
        // (bytes, first step, last step)
        let bufs = [(1000, 0, 1), (500, 1, 2), (2000, 2, 3), (700, 3, 3), (300, 0, 3)];
        let (off, total) = assign_offsets(&bufs);
        let size = |b: u64| b.div_ceil(super::ARENA_ALIGN) * super::ARENA_ALIGN;
        for i in 0..bufs.len() {
            assert_eq!(off[i] % super::ARENA_ALIGN, 0);
            assert!(off[i] + size(bufs[i].0) <= total);
            for j in 0..i {
                let together = bufs[i].1 <= bufs[j].2 && bufs[j].1 <= bufs[i].2;
                let apart = off[i] + size(bufs[i].0) <= off[j] || off[j] + size(bufs[j].0) <= off[i];
                assert!(!together || apart, "buffers {i} and {j} overlap while both are alive");
            }
        }
        // Buffer 0 (steps 0–1) and buffer 2 (steps 2–3) can share bytes; the arena is smaller
        // than the sum of all sizes.
        let sum: u64 = bufs.iter().map(|b| size(b.0)).sum();
        assert!(total < sum, "arena {total} B, sum {sum} B");
    }
}

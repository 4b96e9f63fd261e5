//! A session's shim instances and its calls into them (ABI.md §3): inference, CPU references
//! and dispatch. An instance is made on a package's first call from the runtime's compiled
//! module, with the session's device launch limits, and discarded after a failed call.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_kernel_abi::plan::{LaunchLimits, PlanStep};
use kiln_kernel_abi::wire::Tile;
use kiln_registry::{Package, Resolution};

use super::infer::OutputTypes;
use super::tiles::{self, CpuSplit};
use super::Runtime;
use crate::model::Model;
use crate::sandbox::{on_pool, Access, ArgTensor, CallArgs, CallKind, CallOutcome, ConvService, ShimInstance};
use crate::tensor::byte_size;
use crate::trace::Report;
use crate::{cpu, Error, Result, Tensor};

/// The manifest schema from which a CPU output bound in place takes over its input's buffer
/// instead of a copy of its bytes, the input reading through it (ABI.md §7.8).
pub const IN_PLACE_SHARED_SCHEMA: u32 = 18;

/// The call of `node` with these inputs and outputs.
pub(super) fn node_call<'a>(
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
        tile: None,
    }
}

/// A host tensor as a call argument, with its bytes inline when it is a value input.
pub(super) fn tensor_arg(t: &Tensor, value_input: bool, access: Access) -> ArgTensor<'_> {
    ArgTensor {
        dtype: Some(t.dtype),
        dims: Some(t.dims_i64()),
        value: value_input.then_some(&t.data[..]),
        nbytes: t.data.len() as u64,
        access,
        paged: None,
        constant: false,
        in_place_of: None,
    }
}

/// The opset of node `node`'s domain. Errors: a domain the model does not import.
pub(super) fn opset_of(model: &Model, node: usize) -> Result<i64> {
    let n = &model.graph.nodes[node];
    model.opset(&n.domain).ok_or_else(|| {
        Error::Model(format!(
            "node {:?} uses domain {:?}, which the model does not import (opset_import)",
            n.name.clone(),
            n.domain
        ))
    })
}

/// The shim instances of one session.
pub(super) struct Shims {
    pub rt: Arc<Runtime>,
    instances: HashMap<String, ShimInstance>,
    /// More instances per package, for the tiles of a split CPU node (see [`super::tiles`]).
    spares: HashMap<String, Vec<ShimInstance>>,
    /// How CPU nodes are split into tiles.
    pub split: CpuSplit,
    /// The session's largest tensor, in bytes: how far a CPU call's string output may grow.
    pub max_tensor_bytes: u64,
    /// The device's launch limits, which every `launch` of a dispatch is checked against
    /// (`None`: the sandbox's defaults, on the CPU).
    launch_limits: Option<LaunchLimits>,
    /// What a dispatch's `conv` gets on the session's device.
    conv: ConvService,
    /// The buffers of outputs bound in place that the last failed call gave back
    /// ([`ShimInstance::take_returned`]), for [`Shims::run_reference`] to return to its inputs.
    returned: Vec<(usize, Vec<u8>)>,
    /// Time in `kiln_cpu` calls since [`Shims::take_cpu_time`] last took it: the calls' wall
    /// time (a node's tiles: their parallel section's), and the host's products in them.
    cpu_time: (Duration, Duration),
}

/// The inputs of a CPU call as arguments: readable by the CPU reference (one whose buffer an output
/// took over, `shared[i]` its size, reads that output's), opaque to dispatch (`readable` false).
fn input_args<'t>(
    inputs: &'t [Option<Tensor>],
    shared: &[Option<u64>],
    value_inputs: &[usize],
    readable: bool,
) -> Vec<Option<ArgTensor<'t>>> {
    (inputs.iter().enumerate())
        .map(|(i, t)| {
            t.as_ref().map(|t| match shared[i] {
                Some(nbytes) => ArgTensor {
                    nbytes,
                    access: if readable { Access::InPlace } else { Access::Opaque },
                    ..tensor_arg(t, false, Access::Opaque)
                },
                None => {
                    let access = if readable { Access::Read(t.data.clone()) } else { Access::Opaque };
                    tensor_arg(t, value_inputs.contains(&i), access)
                }
            })
        })
        .collect()
}

/// Puts `bytes` back as input `i`'s where its buffer went to an output bound in place
/// (`shared[i]` holds its size) and they are of that size.
fn give_back(inputs: &mut [Option<Tensor>], i: Option<u32>, shared: &[Option<u64>], bytes: bytes::Bytes) {
    let Some(i) = i.map(|i| i as usize) else { return };
    if let (Some(Some(t)), Some(Some(n))) = (inputs.get_mut(i), shared.get(i)) {
        if bytes.len() as u64 == *n {
            t.data = bytes;
        }
    }
}

impl Shims {
    pub fn new(rt: Arc<Runtime>, launch_limits: Option<LaunchLimits>, conv: ConvService) -> Shims {
        Shims {
            rt,
            instances: HashMap::new(),
            spares: HashMap::new(),
            split: CpuSplit::default(),
            max_tensor_bytes: crate::model::MAX_TENSOR_BYTES,
            launch_limits,
            conv,
            returned: Vec::new(),
            cpu_time: (Duration::ZERO, Duration::ZERO),
        }
    }

    /// The time in `kiln_cpu` calls since the last take: (the calls' wall time, a tiled node's as
    /// its parallel section; the host's products in them). The session takes it around each node.
    pub fn take_cpu_time(&mut self) -> (Duration, Duration) {
        std::mem::replace(&mut self.cpu_time, (Duration::ZERO, Duration::ZERO))
    }

    /// A new instance of `pkg`'s shim with the session's launch limits and `conv` service.
    fn instantiate(&self, pkg: &Package, report: &mut Report) -> Result<ShimInstance> {
        let mut inst = self.rt.module(pkg)?.instantiate()?;
        if let Some(limits) = self.launch_limits {
            inst.set_launch_limits(limits);
        }
        inst.set_conv_service(self.conv.clone());
        report.instances += 1;
        Ok(inst)
    }

    /// Calls a shim export, instantiating the package's shim on first use and discarding
    /// the instance after a failure.
    pub fn call(
        &mut self,
        pkg: &Package,
        kind: CallKind,
        args: CallArgs<'_>,
        report: &mut Report,
    ) -> Result<CallOutcome> {
        let id = pkg.id();
        if !self.instances.contains_key(&id) {
            let inst = self.instantiate(pkg, report)?;
            self.instances.insert(id.clone(), inst);
        }
        match kind {
            CallKind::Infer => report.wasm_calls.infer += 1,
            CallKind::Cpu => report.wasm_calls.cpu += 1,
            CallKind::Dispatch => report.wasm_calls.dispatch += 1,
        }
        let inst = self.instances.get_mut(&id).ok_or_else(|| Error::Device("shim instance vanished".into()))?;
        // Timed for the report's CPU split only: a GPU dispatch's path takes no clock reading.
        let t0 = (kind == CallKind::Cpu).then(Instant::now);
        let outcome = match inst.call(kind, args) {
            Ok(o) => {
                if let Some(t0) = t0 {
                    self.cpu_time.0 += t0.elapsed();
                    self.cpu_time.1 += o.host_compute;
                }
                o
            }
            Err(f) => {
                self.returned = inst.take_returned();
                self.instances.remove(&id);
                return Err(f.into());
            }
        };
        let convs = &mut report.convolutions;
        convs.library_dispatches += outcome.plan.steps.iter().filter(|s| matches!(s, PlanStep::Conv(_))).count() as u64;
        for why in &outcome.declined {
            *convs.fallbacks.entry(why.clone()).or_default() += 1;
        }
        Ok(outcome)
    }

    /// Runs node `idx` of `model` through its package's CPU reference on host tensors; with
    /// `check_dispatch`, validates its GPU launch plan as well. `in_place[j]`: the input whose
    /// buffer output j is bound in place to (ABI.md §7.8; empty: none): that output starts as the
    /// input's bytes, and the shim is told so (not in a call of one tile). For a package of
    /// manifest schema [`IN_PLACE_SHARED_SCHEMA`] or later the output takes the input's buffer
    /// itself, which the input then reads through (without a copy where nothing else holds those
    /// bytes: the caller lets go of its own), and `inputs[i]` is left without bytes; for an older
    /// one the output is a copy.
    #[allow(clippy::too_many_arguments)]
    pub fn run_reference(
        &mut self,
        model: &Model,
        idx: usize,
        res: &Resolution,
        (inputs, in_place): (&mut [Option<Tensor>], &[Option<u32>]),
        out_types: &OutputTypes,
        check_dispatch: bool,
        report: &mut Report,
    ) -> Result<Vec<Option<Tensor>>> {
        let opset = opset_of(model, idx)?;
        let node = &model.graph.nodes[idx];
        let value_inputs = &res.entry.value_inputs;
        let n_in = inputs.iter().flatten().count();
        let input_bytes = inputs.iter().flatten().map(|t| t.data.len() as u64).max().unwrap_or(0);
        let tiles = res.entry.cpu_tiles.and_then(|kind| tiles::plan(kind, out_types, input_bytes, self.split));
        // Inputs whose buffer an output bound in place took over (their byte size).
        let mut shared: Vec<Option<u64>> = vec![None; inputs.len()];
        // An output bound in place starts as its input's bytes, which must be of its dtype and size.
        let mut starts = Vec::with_capacity(out_types.len());
        if tiles.is_none() {
            let take = res.package.manifest.schema >= IN_PLACE_SHARED_SCHEMA;
            for (i, t) in in_place.iter().zip(out_types) {
                let i = i.map(|i| i as usize);
                let x = i.and_then(|i| inputs.get_mut(i)).and_then(Option::as_mut);
                starts.push(match (i, t, x) {
                    (Some(i), Some((dtype, shape)), Some(x))
                        if x.dtype == *dtype && byte_size(*dtype, shape).is_ok_and(|n| n == x.data.len() as u64) =>
                    {
                        let at = x.data.as_ptr();
                        let bytes = if take && shared[i].is_none() && !value_inputs.contains(&i) {
                            shared[i] = Some(x.data.len() as u64);
                            // The buffer itself where these bytes are its only holder, else a copy.
                            let bytes = Vec::from(std::mem::take(&mut x.data));
                            report.cpu_in_place_shared += u64::from(bytes.as_ptr() == at);
                            bytes
                        } else {
                            x.data.to_vec()
                        };
                        Some((i as u32, bytes))
                    }
                    _ => None,
                });
            }
        }
        let args_in = |inputs, readable| input_args(inputs, &shared, value_inputs, readable);
        let outputs = match tiles {
            Some(tiles) => {
                self.run_tiles(&res.package, node, opset, &tiles, args_in(inputs, true), out_types, report)?
            }
            None => {
                let outs = cpu::output_args(out_types, self.max_tensor_bytes, starts);
                report.cpu_in_place += outs.iter().flatten().filter(|o| o.in_place_of.is_some()).count() as u64;
                let args = node_call(node, opset, args_in(inputs, true), outs);
                match self.call(&res.package, CallKind::Cpu, args, report) {
                    Ok(outcome) => cpu::collect_outputs(outcome, n_in, out_types)?,
                    Err(e) => {
                        // The inputs get their buffers back from the failed call (the shim wrote
                        // only what it wrote): the caller's cache keeps its past.
                        for (j, bytes) in std::mem::take(&mut self.returned) {
                            give_back(inputs, in_place.get(j).copied().flatten(), &shared, bytes.into());
                        }
                        return Err(e);
                    }
                }
            }
        };
        if check_dispatch {
            let outs = outputs.iter().map(|t| t.as_ref().map(|t| tensor_arg(t, false, Access::Opaque))).collect();
            let args = node_call(node, opset, args_in(inputs, false), outs);
            match self.call(&res.package, CallKind::Dispatch, args, report) {
                Ok(o) => report.dispatch_steps += o.plan.steps.len() as u64,
                Err(e) if e.is_unsupported() => {
                    *report.dispatch_unsupported.entry(node.op_type.clone()).or_default() += 1;
                }
                Err(e) => {
                    for (j, t) in outputs.iter().enumerate() {
                        let i = in_place.get(j).copied().flatten();
                        give_back(inputs, i, &shared, t.as_ref().map(|t| t.data.clone()).unwrap_or_default());
                    }
                    return Err(e);
                }
            }
        }
        Ok(outputs)
    }

    /// Runs `node` on the CPU as `tiles` (ABI.md §6.1.2), each a `kiln_cpu` call on its own
    /// instance of the package's shim, at once on the CPU pool; the outputs are the tiles'
    /// windows joined in order. A failed tile fails the node (its instance is discarded).
    #[allow(clippy::too_many_arguments)]
    fn run_tiles(
        &mut self,
        pkg: &Package,
        node: &crate::model::Node,
        opset: i64,
        tiles: &[Tile],
        inputs: Vec<Option<ArgTensor<'_>>>,
        out_types: &OutputTypes,
        report: &mut Report,
    ) -> Result<Vec<Option<Tensor>>> {
        let id = pkg.id();
        let mut insts = Vec::with_capacity(tiles.len());
        insts.extend(self.instances.remove(&id));
        while insts.len() < tiles.len() {
            match self.spares.get_mut(&id).and_then(Vec::pop) {
                Some(i) => insts.push(i),
                None => insts.push(self.instantiate(pkg, report)?),
            }
        }
        let units = tiles::units(tiles);
        let calls: Vec<CallArgs<'_>> = tiles
            .iter()
            .map(|t| {
                let outputs = out_types
                    .iter()
                    .map(|o| {
                        o.as_ref().map(|(dtype, shape)| {
                            let nbytes = crate::tensor::byte_size(*dtype, shape).unwrap_or(0);
                            ArgTensor {
                                dtype: Some(*dtype),
                                dims: Some(shape.iter().map(|&d| d as i64).collect()),
                                value: None,
                                nbytes,
                                access: tiles::window(nbytes, units, *t),
                                paged: None,
                                constant: false,
                                in_place_of: None,
                            }
                        })
                    })
                    .collect();
                CallArgs { tile: Some(*t), ..node_call(node, opset, inputs.to_vec(), outputs) }
            })
            .collect();
        report.wasm_calls.cpu += tiles.len() as u64;
        report.wasm_calls.cpu_tiles += tiles.len() as u64;
        let t0 = Instant::now();
        let results: Vec<std::result::Result<CallOutcome, crate::sandbox::ShimFailure>> = on_pool(|| {
            use rayon::prelude::*;
            insts.par_iter_mut().zip(calls).map(|(inst, args)| inst.call(CallKind::Cpu, args)).collect()
        });
        self.cpu_time.0 += t0.elapsed();
        self.cpu_time.1 += results.iter().flatten().map(|o| o.host_compute).sum::<Duration>();
        let mut outcomes = Vec::with_capacity(tiles.len());
        let mut failure = None;
        for (inst, r) in insts.into_iter().zip(results) {
            match r {
                Ok(o) => {
                    match self.instances.contains_key(&id) {
                        true => self.spares.entry(id.clone()).or_default().push(inst),
                        false => drop(self.instances.insert(id.clone(), inst)),
                    }
                    outcomes.push(o);
                }
                Err(f) => failure = failure.or(Some(f)),
            }
        }
        if let Some(f) = failure {
            return Err(f.into());
        }
        let n_in = inputs.iter().flatten().count();
        let mut joined: Vec<Option<Vec<u8>>> = out_types
            .iter()
            .map(|o| o.as_ref().map(|(d, s)| Vec::with_capacity(crate::tensor::byte_size(*d, s).unwrap_or(0) as usize)))
            .collect();
        for o in outcomes {
            let mut slots = o.slots.into_iter().skip(n_in);
            for out in joined.iter_mut().flatten() {
                match slots.next().map(|s| s.access) {
                    Some(Access::Window { bytes, .. }) => out.extend_from_slice(&bytes),
                    _ => return Err(Error::Device("a CPU tile's output window went missing".into())),
                }
            }
        }
        joined
            .into_iter()
            .zip(out_types)
            .map(|(bytes, t)| match (bytes, t) {
                (Some(b), Some((dtype, shape))) => Tensor::new(*dtype, shape.clone(), b.into()).map(Some),
                _ => Ok(None),
            })
            .collect()
    }
}

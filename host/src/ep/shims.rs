//! A session's shim instances and its calls into them (ABI.md §3): inference, CPU references
//! and dispatch. An instance is made on a package's first call from the runtime's compiled
//! module, with the session's device launch limits, and discarded after a failed call.

use std::collections::HashMap;
use std::sync::Arc;

use kiln_kernel_abi::plan::{LaunchLimits, PlanStep};
use kiln_registry::{Package, Resolution};

use super::infer::OutputTypes;
use super::Runtime;
use crate::model::Model;
use crate::sandbox::{Access, ArgTensor, CallArgs, CallKind, CallOutcome, ConvService, ShimInstance};
use crate::trace::Report;
use crate::{cpu, Error, Result, Tensor};

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
    /// The device's launch limits, which every `launch` of a dispatch is checked against
    /// (`None`: the sandbox's defaults, on the CPU).
    launch_limits: Option<LaunchLimits>,
    /// What a dispatch's `conv` gets on the session's device.
    conv: ConvService,
}

impl Shims {
    pub fn new(rt: Arc<Runtime>, launch_limits: Option<LaunchLimits>, conv: ConvService) -> Shims {
        Shims { rt, instances: HashMap::new(), launch_limits, conv }
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
            let mut inst = self.rt.module(pkg)?.instantiate()?;
            if let Some(limits) = self.launch_limits {
                inst.set_launch_limits(limits);
            }
            inst.set_conv_service(self.conv.clone());
            report.instances += 1;
            self.instances.insert(id.clone(), inst);
        }
        match kind {
            CallKind::Infer => report.wasm_calls.infer += 1,
            CallKind::Cpu => report.wasm_calls.cpu += 1,
            CallKind::Dispatch => report.wasm_calls.dispatch += 1,
        }
        let inst = self.instances.get_mut(&id).ok_or_else(|| Error::Device("shim instance vanished".into()))?;
        let outcome = inst.call(kind, args).map_err(|f| {
            self.instances.remove(&id);
            Error::from(f)
        })?;
        let convs = &mut report.convolutions;
        convs.library_dispatches += outcome.plan.steps.iter().filter(|s| matches!(s, PlanStep::Conv(_))).count() as u64;
        for why in &outcome.declined {
            *convs.fallbacks.entry(why.clone()).or_default() += 1;
        }
        Ok(outcome)
    }

    /// Runs node `idx` of `model` through its package's CPU reference on host tensors; with
    /// `check_dispatch`, validates its GPU launch plan as well.
    #[allow(clippy::too_many_arguments)]
    pub fn run_reference(
        &mut self,
        model: &Model,
        idx: usize,
        res: &Resolution,
        inputs: &[Option<Tensor>],
        out_types: &OutputTypes,
        check_dispatch: bool,
        report: &mut Report,
    ) -> Result<Vec<Option<Tensor>>> {
        let opset = opset_of(model, idx)?;
        let node = &model.graph.nodes[idx];
        let value_inputs = &res.entry.value_inputs;
        // The inputs as arguments: readable by the CPU reference, opaque to dispatch.
        let args_in = |readable: bool| -> Vec<Option<ArgTensor<'_>>> {
            let access = |t: &Tensor| if readable { Access::Read(t.data.clone()) } else { Access::Opaque };
            (inputs.iter().enumerate())
                .map(|(i, t)| t.as_ref().map(|t| tensor_arg(t, value_inputs.contains(&i), access(t))))
                .collect()
        };
        let args = node_call(node, opset, args_in(true), cpu::output_args(out_types));
        let n_in = inputs.iter().flatten().count();
        let outcome = self.call(&res.package, CallKind::Cpu, args, report)?;
        let outputs = cpu::collect_outputs(outcome, n_in, out_types)?;
        if check_dispatch {
            let outs = outputs.iter().map(|t| t.as_ref().map(|t| tensor_arg(t, false, Access::Opaque))).collect();
            let args = node_call(node, opset, args_in(false), outs);
            match self.call(&res.package, CallKind::Dispatch, args, report) {
                Ok(o) => report.dispatch_steps += o.plan.steps.len() as u64,
                Err(e) if e.is_unsupported() => {
                    *report.dispatch_unsupported.entry(node.op_type.clone()).or_default() += 1;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(outputs)
    }
}

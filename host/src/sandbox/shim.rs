//! Compiled shims and their instances.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use kiln_kernel_abi::manifest::ParamKind;
use kiln_kernel_abi::wire::{Attribute, Conv, NodeCall, TensorDesc, NO_HANDLE};
use kiln_kernel_abi::{exports, imports as imp, status, DType, ABI_VERSION, IMPORT_MODULE};
use wasmtime::{ExternType, Instance, InstancePre, Memory, Store, TypedFunc, ValType};

use super::handles::{self, Access, HandleTable, Slot};
use super::{FailureKind, LaunchLimits, LaunchPlan, Sandbox, ShimFailure};

/// The kind of export call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallKind {
    /// `kiln_infer`: may call `set_output`.
    Infer,
    /// `kiln_cpu`: may call `read`, `write`, `scratch`.
    Cpu,
    /// `kiln_dispatch`: may call `launch`, `gemm`, `conv`, `scratch`.
    Dispatch,
}

impl CallKind {
    fn export(self) -> &'static str {
        match self {
            CallKind::Infer => exports::INFER,
            CallKind::Cpu => exports::CPU,
            CallKind::Dispatch => exports::DISPATCH,
        }
    }
}

/// One tensor given to a call (cloning shares a CPU input's bytes).
#[derive(Clone, Debug)]
pub struct ArgTensor<'a> {
    pub dtype: Option<DType>,
    pub dims: Option<Vec<i64>>,
    /// Inline bytes for value inputs.
    pub value: Option<&'a [u8]>,
    /// Size in bytes (bounds of reads and writes).
    pub nbytes: u64,
    pub access: Access,
    /// The tensor's paged layout (ABI.md §6.1.1), sent for the inputs and outputs the op's
    /// manifest entry declares paged; `None`: row-major.
    pub paged: Option<kiln_kernel_abi::wire::Paged>,
    /// An input constant for the session (an initializer: no kernel writes it), sent as tensor
    /// flag bit 4 to packages of manifest schema 14 or later (ABI.md §7.7).
    pub constant: bool,
    /// An output whose bytes start as input `i`'s (bound in place to its buffer), sent as tensor
    /// flag bit 5 to packages of manifest schema 16 or later, in `kiln_cpu` calls (ABI.md §7.8).
    /// Input `i` given as [`Access::InPlace`] (schema 18) then reads this output's bytes.
    pub in_place_of: Option<u32>,
}

/// A node call, before handles are assigned.
#[derive(Debug)]
pub struct CallArgs<'a> {
    pub domain: &'a str,
    pub op_type: &'a str,
    pub opset: i64,
    pub node_name: &'a str,
    pub attributes: Vec<Attribute<'a>>,
    /// `None` for an absent optional input.
    pub inputs: Vec<Option<ArgTensor<'a>>>,
    /// `None` for an output the node leaves out.
    pub outputs: Vec<Option<ArgTensor<'a>>>,
    /// A CPU call of one tile of the outputs (ABI.md §6.1.2): each output is then an
    /// [`Access::Window`] of the tile's share.
    pub tile: Option<kiln_kernel_abi::wire::Tile>,
}

/// What a successful call produced.
#[derive(Debug, Default)]
pub struct CallOutcome {
    /// Infer: dtype and shape per output (`None` for absent outputs or ones not set).
    pub inferred: Vec<Option<(DType, Vec<usize>)>>,
    /// Every slot of the call: inputs (present ones, in order), outputs (present ones),
    /// scratch. CPU outputs are `Access::Write` buffers.
    pub slots: Vec<Slot>,
    /// Dispatch: the recorded plan.
    pub plan: LaunchPlan,
    /// Dispatch: each `conv` the host did not serve here (`E_UNAVAILABLE`), with the reason;
    /// the shim ran its own kernels for it.
    pub declined: Vec<String>,
    /// CPU: the time the host spent computing the call's `gemm`, `qgemm` and `conv` imports.
    pub host_compute: Duration,
}

/// Store data: the memory limiter and the state of the call in progress.
pub(crate) struct CallState {
    pub limiter: MemoryLimiter,
    pub kind: Option<CallKind>,
    pub table: HandleTable,
    pub n_outputs: usize,
    /// Slot index of each output (None when absent).
    pub output_slots: Vec<Option<usize>>,
    pub failure: Option<String>,
    pub refusal: Option<String>,
    pub inferred: Vec<Option<(DType, Vec<usize>)>>,
    pub plan: LaunchPlan,
    /// The kernels `launch` may name, with their parameters (the manifest's signatures).
    pub kernels: Arc<KernelTable>,
    pub limits: LaunchLimits,
    /// What a dispatch's `conv` gets on the instance's device.
    pub conv: ConvService,
    /// This call's `conv`s answered `E_UNAVAILABLE`, with their reasons.
    pub declined: Vec<String>,
    pub scratch_total: u64,
    pub max_scratch: u64,
    pub max_steps: usize,
    /// Time in the host's products of this call's CPU imports (see [`CallOutcome::host_compute`]).
    pub host_compute: Duration,
}

/// What a dispatch's `conv` import gets on a session's device (ABI.md §4.8).
#[derive(Clone)]
pub enum ConvService {
    /// Never served here, and why (no GPU, no cuDNN, turned off): every `conv` of a dispatch
    /// answers `E_UNAVAILABLE` and the shim runs its own kernels.
    Unavailable(Arc<str>),
    /// Served through the device's library (`PlanStep::Conv`) where `takes` accepts the checked
    /// descriptor (and readies its plan); its error is the reason it does not (then
    /// `E_UNAVAILABLE`).
    Library { takes: ConvTakes },
}

/// The device's answer to one checked convolution descriptor: `Ok` when its library runs it.
pub type ConvTakes = Arc<dyn Fn(&Conv) -> Result<(), String> + Send + Sync>;

impl std::fmt::Debug for ConvService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConvService::Unavailable(why) => write!(f, "Unavailable({why:?})"),
            ConvService::Library { .. } => write!(f, "Library"),
        }
    }
}

impl Default for ConvService {
    fn default() -> Self {
        ConvService::Unavailable("no GPU library serves convolutions here (a CPU session)".into())
    }
}

impl CallState {
    /// Records the first refusal of an import call and returns `code`.
    pub fn refuse(&mut self, code: i32, reason: String) -> i32 {
        if self.refusal.is_none() {
            self.refusal = Some(reason);
        }
        code
    }
}

/// Caps linear memory growth and remembers that it did.
pub(crate) struct MemoryLimiter {
    pub limit: usize,
    pub hit: bool,
}

impl wasmtime::ResourceLimiter for MemoryLimiter {
    fn memory_growing(&mut self, _current: usize, desired: usize, _max: Option<usize>) -> wasmtime::Result<bool> {
        if desired > self.limit {
            self.hit = true;
            return Ok(false);
        }
        Ok(true)
    }

    fn table_growing(&mut self, _current: usize, desired: usize, _max: Option<usize>) -> wasmtime::Result<bool> {
        Ok(desired <= 1 << 16)
    }

    fn memories(&self) -> usize {
        1
    }

    fn tables(&self) -> usize {
        1
    }

    fn instances(&self) -> usize {
        1
    }
}

/// The kernels a package declares, by entry point, with their parameters (ABI.md §7.3).
pub type KernelTable = HashMap<String, Vec<ParamKind>>;

/// A compiled, validated shim: cheap to instantiate.
pub struct ShimModule {
    package: String,
    pre: InstancePre<CallState>,
    kernels: Arc<KernelTable>,
    engine: wasmtime::Engine,
    memory_limit: usize,
    deadline_ticks: u64,
    timeout: std::time::Duration,
    max_scratch: u64,
    max_steps: usize,
    limits: LaunchLimits,
}

impl ShimModule {
    pub(super) fn new(
        sb: &Sandbox,
        package: &str,
        wasm: &[u8],
        kernels: Vec<(String, Vec<ParamKind>)>,
    ) -> Result<ShimModule, ShimFailure> {
        let fail = |reason: String| ShimFailure {
            package: package.to_string(),
            op: String::new(),
            node: String::new(),
            kind: FailureKind::Module,
            reason,
        };
        let module = sb.compile(wasm).map_err(|e| fail(format!("not a valid WebAssembly module: {e}")))?;
        let known = [
            imp::FAIL,
            imp::SET_OUTPUT,
            imp::READ,
            imp::WRITE,
            imp::SCRATCH,
            imp::LAUNCH,
            imp::GEMM,
            imp::CONV,
            imp::QGEMM,
        ];
        for i in module.imports() {
            if i.module() != IMPORT_MODULE || !known.contains(&i.name()) {
                return Err(fail(format!(
                    "imports {}::{}; shims may import only the functions of module \"kiln\" ({})",
                    i.module(),
                    i.name(),
                    known.join(", ")
                )));
            }
        }
        use ValType::I32;
        let funcs: [(&str, &[ValType], &[ValType]); 5] = [
            (exports::ABI_VERSION, &[], &[I32]),
            (exports::ALLOC, &[I32], &[I32]),
            (exports::INFER, &[I32, I32], &[I32]),
            (exports::DISPATCH, &[I32, I32], &[I32]),
            (exports::CPU, &[I32, I32], &[I32]),
        ];
        for (name, params, results) in funcs {
            match module.get_export(name) {
                Some(ExternType::Func(ft)) => {
                    let same = |a: &mut dyn ExactSizeIterator<Item = ValType>, b: &[ValType]| {
                        a.len() == b.len() && a.zip(b).all(|(x, y)| ValType::eq(&x, y))
                    };
                    if !same(&mut ft.params(), params) || !same(&mut ft.results(), results) {
                        return Err(fail(format!(
                            "export {name} has type {ft}, ABI v1 requires {params:?} -> {results:?}"
                        )));
                    }
                }
                Some(_) => return Err(fail(format!("export {name} is not a function"))),
                None => return Err(fail(format!("missing export {name} (ABI v1 requires it)"))),
            }
        }
        if !matches!(module.get_export(exports::MEMORY), Some(ExternType::Memory(_))) {
            return Err(fail("missing export \"memory\" (the shim's linear memory)".into()));
        }
        let pre = sb.linker.instantiate_pre(&module).map_err(|e| fail(format!("cannot link: {e}")))?;
        let this = ShimModule {
            package: package.to_string(),
            pre,
            kernels: Arc::new(kernels.into_iter().collect()),
            engine: sb.engine.clone(),
            memory_limit: sb.config.memory_limit_bytes,
            deadline_ticks: sb.deadline_ticks(),
            timeout: sb.config.call_timeout,
            max_scratch: sb.config.max_scratch_bytes,
            max_steps: sb.config.max_plan_steps,
            limits: sb.config.launch_limits,
        };
        let mut inst = this.instantiate().map_err(|e| fail(e.reason))?;
        inst.store.set_epoch_deadline(this.deadline_ticks);
        let version =
            inst.abi_version.call(&mut inst.store, ()).map_err(|e| fail(format!("kiln_abi_version trapped: {e}")))?;
        if version != ABI_VERSION as i32 {
            return Err(fail(format!(
                "the shim was built for kernel ABI {version}; this kiln speaks ABI {ABI_VERSION}: rebuild the package"
            )));
        }
        Ok(this)
    }

    /// `name@version` of the package.
    pub fn package(&self) -> &str {
        &self.package
    }

    /// A fresh instance with its own store.
    pub fn instantiate(&self) -> Result<ShimInstance, ShimFailure> {
        let state = CallState {
            limiter: MemoryLimiter { limit: self.memory_limit, hit: false },
            kind: None,
            table: HandleTable::default(),
            n_outputs: 0,
            output_slots: Vec::new(),
            failure: None,
            refusal: None,
            inferred: Vec::new(),
            plan: LaunchPlan::default(),
            kernels: self.kernels.clone(),
            limits: self.limits,
            conv: ConvService::default(),
            declined: Vec::new(),
            scratch_total: 0,
            max_scratch: self.max_scratch,
            max_steps: self.max_steps,
            host_compute: Duration::ZERO,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.epoch_deadline_trap();
        store.set_epoch_deadline(self.deadline_ticks);
        let failure = |kind, reason: String| ShimFailure {
            package: self.package.clone(),
            op: String::new(),
            node: String::new(),
            kind,
            reason,
        };
        let instance: Instance = self.pre.instantiate(&mut store).map_err(|e| {
            let kind = if store.data().limiter.hit { FailureKind::MemoryLimit } else { FailureKind::Trap };
            failure(kind, format!("instantiation failed: {e}"))
        })?;
        let func = |store: &mut Store<CallState>, name: &str| {
            instance
                .get_typed_func::<(i32, i32), i32>(&mut *store, name)
                .map_err(|e| failure(FailureKind::Module, e.to_string()))
        };
        let infer = func(&mut store, exports::INFER)?;
        let dispatch = func(&mut store, exports::DISPATCH)?;
        let cpu = func(&mut store, exports::CPU)?;
        let alloc = instance
            .get_typed_func::<i32, i32>(&mut store, exports::ALLOC)
            .map_err(|e| failure(FailureKind::Module, e.to_string()))?;
        let abi_version = instance
            .get_typed_func::<(), i32>(&mut store, exports::ABI_VERSION)
            .map_err(|e| failure(FailureKind::Module, e.to_string()))?;
        let memory = instance
            .get_memory(&mut store, exports::MEMORY)
            .ok_or_else(|| failure(FailureKind::Module, "no memory export".into()))?;
        Ok(ShimInstance {
            package: self.package.clone(),
            deadline_ticks: self.deadline_ticks,
            timeout: self.timeout,
            store,
            memory,
            alloc,
            infer,
            dispatch,
            cpu,
            abi_version,
            generation: 0,
            returned: Vec::new(),
        })
    }
}

/// An instance of a shim: one store, used by one thread, one call at a time.
pub struct ShimInstance {
    package: String,
    deadline_ticks: u64,
    /// The deadline, for messages.
    timeout: std::time::Duration,
    store: Store<CallState>,
    memory: Memory,
    alloc: TypedFunc<i32, i32>,
    infer: TypedFunc<(i32, i32), i32>,
    dispatch: TypedFunc<(i32, i32), i32>,
    cpu: TypedFunc<(i32, i32), i32>,
    abi_version: TypedFunc<(), i32>,
    generation: u16,
    /// [`ShimInstance::take_returned`]'s buffers.
    returned: Vec<(usize, Vec<u8>)>,
}

impl ShimInstance {
    /// The device limits this instance's `launch` calls are checked against (ABI.md §4.6):
    /// those of the GPU the instance dispatches for, in place of the sandbox's defaults.
    pub fn set_launch_limits(&mut self, limits: LaunchLimits) {
        self.store.data_mut().limits = limits;
    }

    /// What this instance's dispatches get from `conv` (ABI.md §4.8); by default nothing
    /// ([`ConvService::Unavailable`]).
    pub fn set_conv_service(&mut self, conv: ConvService) {
        self.store.data_mut().conv = conv;
    }

    /// Runs one export. On any failure the instance must be discarded (the caller gets the
    /// failure and should instantiate anew, after [`ShimInstance::take_returned`]); on success it
    /// may be reused.
    pub fn call(&mut self, kind: CallKind, args: CallArgs<'_>) -> Result<CallOutcome, ShimFailure> {
        let package = self.package.clone();
        let fail = |kind: FailureKind, reason: String| ShimFailure {
            package: package.clone(),
            op: args.op_type.to_string(),
            node: args.node_name.to_string(),
            kind,
            reason,
        };
        // Handle table and the encoded call. A handle's index has 16 bits.
        if args.inputs.len() + args.outputs.len() > handles::MAX_SLOTS / 2 {
            return Err(fail(
                FailureKind::Failed,
                format!(
                    "{} inputs and outputs are more than a node call may have",
                    args.inputs.len() + args.outputs.len()
                ),
            ));
        }
        let mut table = HandleTable::next(self.generation);
        self.generation = table.generation();
        let mut descs_in = Vec::with_capacity(args.inputs.len());
        let mut output_slots = Vec::with_capacity(args.outputs.len());
        let mut descs_out = Vec::with_capacity(args.outputs.len());
        // Slot of each input (None: absent), and (input slot, output slot) of outputs bound in place.
        let mut input_slots = Vec::with_capacity(args.inputs.len());
        let mut in_place = Vec::new();
        for (list, is_out) in [(args.inputs, false), (args.outputs, true)] {
            for t in list {
                let desc = match t {
                    None => {
                        if is_out {
                            output_slots.push(None);
                        } else {
                            input_slots.push(None);
                        }
                        TensorDesc::absent()
                    }
                    Some(t) => {
                        let handle =
                            table.push(Slot { dtype: t.dtype, nbytes: t.nbytes, access: t.access, writable: is_out });
                        if is_out {
                            output_slots.push(Some(table.len() - 1));
                            let input = t.in_place_of.and_then(|i| input_slots.get(i as usize).copied().flatten());
                            in_place.extend(input.map(|i| (i, table.len() - 1)));
                        } else {
                            input_slots.push(Some(table.len() - 1));
                        }
                        TensorDesc {
                            present: true,
                            dtype: t.dtype,
                            dims: t.dims,
                            handle,
                            value: t.value,
                            paged: t.paged,
                            constant: t.constant,
                            in_place_of: t.in_place_of,
                        }
                    }
                };
                if is_out {
                    descs_out.push(desc)
                } else {
                    descs_in.push(desc)
                }
            }
        }
        table.alias_in_place(&in_place);
        let n_outputs = descs_out.len();
        let call = NodeCall {
            abi_version: ABI_VERSION,
            domain: args.domain,
            op_type: args.op_type,
            opset: args.opset,
            node_name: args.node_name,
            inputs: descs_in,
            outputs: descs_out,
            attributes: args.attributes,
            tile: args.tile,
        };
        let blob = call.encode();
        debug_assert!(call.inputs.iter().chain(&call.outputs).all(|d| d.present || d.handle == NO_HANDLE));
        drop(call);
        let len = i32::try_from(blob.len()).map_err(|_| fail(FailureKind::Failed, "node call is over 2 GiB".into()))?;

        {
            let st = self.store.data_mut();
            st.kind = Some(kind);
            st.table = table;
            st.n_outputs = n_outputs;
            st.output_slots = output_slots;
            st.failure = None;
            st.refusal = None;
            st.inferred = vec![None; n_outputs];
            st.plan = LaunchPlan::default();
            st.declined.clear();
            st.scratch_total = 0;
            st.host_compute = Duration::ZERO;
            st.limiter.hit = false;
        }
        self.store.set_epoch_deadline(self.deadline_ticks);
        let result = self.alloc.call(&mut self.store, len).and_then(|ptr| {
            let start = ptr as u32 as usize;
            let data = self.memory.data_mut(&mut self.store);
            match data.get_mut(start..start + blob.len()) {
                Some(dst) => {
                    dst.copy_from_slice(&blob);
                    Ok(ptr)
                }
                None => Err(wasmtime::format_err!(
                    "kiln_alloc returned {ptr:#x}, outside its memory of {} bytes",
                    data.len()
                )),
            }
        });
        let func = match kind {
            CallKind::Infer => self.infer.clone(),
            CallKind::Cpu => self.cpu.clone(),
            CallKind::Dispatch => self.dispatch.clone(),
        };
        let result = result.and_then(|ptr| func.call(&mut self.store, (ptr, len)));
        let st = self.store.data_mut();
        st.kind = None;
        let slots = st.table.take();
        let out_slots = std::mem::take(&mut st.output_slots);
        let verdict = self.verdict(kind, result, &out_slots, &fail);
        match verdict {
            Err(f) => {
                self.returned = returned_in_place(slots, &out_slots);
                Err(f)
            }
            Ok(()) => {
                let st = self.store.data_mut();
                Ok(CallOutcome {
                    inferred: std::mem::take(&mut st.inferred),
                    slots,
                    plan: std::mem::take(&mut st.plan),
                    declined: std::mem::take(&mut st.declined),
                    host_compute: st.host_compute,
                })
            }
        }
    }

    /// The buffers of the outputs bound in place that took over their input's (ABI.md §7.8) in
    /// the last call, when it failed: (output index, bytes), what the input held but for what
    /// the shim wrote, so that the caller can put them back. Empty after a call that succeeded.
    pub fn take_returned(&mut self) -> Vec<(usize, Vec<u8>)> {
        std::mem::take(&mut self.returned)
    }

    /// Whether a finished call succeeded, from its `result` and the state its imports left: its
    /// failure (limit, deadline, refusal, trap, status, an output `kiln_infer` did not set).
    fn verdict(
        &mut self,
        kind: CallKind,
        result: wasmtime::Result<i32>,
        out_slots: &[Option<usize>],
        fail: &dyn Fn(FailureKind, String) -> ShimFailure,
    ) -> Result<(), ShimFailure> {
        let st = self.store.data_mut();
        let failure_msg = st.failure.take();
        let refusal = st.refusal.take();
        match result {
            Err(e) => {
                let (fk, reason) = if st.limiter.hit {
                    (
                        FailureKind::MemoryLimit,
                        format!("linear memory would grow past the limit of {} bytes ({e})", st.limiter.limit),
                    )
                } else if matches!(e.downcast_ref::<wasmtime::Trap>(), Some(wasmtime::Trap::Interrupt)) {
                    (
                        FailureKind::Timeout,
                        format!("{} exceeded its time limit of {:.3} s", kind.export(), self.timeout.as_secs_f64()),
                    )
                } else if let Some(r) = refusal {
                    (FailureKind::Refused, r)
                } else {
                    let trap = e.downcast_ref::<wasmtime::Trap>().map_or_else(|| format!("{e:#}"), |t| t.to_string());
                    let msg = failure_msg.map(|m| format!("{m} ({trap})")).unwrap_or(trap);
                    (FailureKind::Trap, msg)
                };
                Err(fail(fk, reason))
            }
            Ok(code) => {
                if let Some(r) = refusal {
                    return Err(fail(FailureKind::Refused, r));
                }
                let msg = || {
                    failure_msg
                        .clone()
                        .unwrap_or_else(|| format!("{} returned {code} without a message", kind.export()))
                };
                match code {
                    status::OK => {}
                    status::UNSUPPORTED => return Err(fail(FailureKind::Unsupported, msg())),
                    status::FAILED => return Err(fail(FailureKind::Failed, msg())),
                    other => {
                        return Err(fail(
                            FailureKind::Failed,
                            format!("{} returned unknown status {other}: {}", kind.export(), msg()),
                        ))
                    }
                }
                let st = self.store.data_mut();
                if kind == CallKind::Infer {
                    if let Some(i) =
                        out_slots.iter().zip(&st.inferred).position(|(s, inf)| s.is_some() && inf.is_none())
                    {
                        return Err(fail(FailureKind::Failed, format!("kiln_infer did not set output {i}")));
                    }
                }
                Ok(())
            }
        }
    }
}

/// [`ShimInstance::take_returned`]'s buffers from a failed call's `slots`: each output (index in
/// `out_slots`, the slot of each output) whose input reads through it ([`Access::Alias`]).
fn returned_in_place(mut slots: Vec<Slot>, out_slots: &[Option<usize>]) -> Vec<(usize, Vec<u8>)> {
    let shared: Vec<usize> = (slots.iter())
        .filter_map(|s| match s.access {
            Access::Alias(out) => Some(out),
            _ => None,
        })
        .collect();
    let mut returned = Vec::new();
    for out in shared {
        let j = out_slots.iter().position(|s| *s == Some(out));
        if let (Some(j), Some(Access::Write(v))) = (j, slots.get_mut(out).map(|s| &mut s.access)) {
            returned.push((j, std::mem::take(v)));
        }
    }
    returned
}

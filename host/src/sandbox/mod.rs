//! The sandbox: shims run in wasmtime with no WASI, a memory cap per instance, a deadline
//! per call (epoch interruption) and handle tables valid for one call.
//!
//! This module knows handles, limits and the ABI (`kiln-kernel-abi`), not devices: a call
//! gets tensors as [`handles::Access`] (host bytes or opaque), and a dispatch call returns a
//! device-independent [`LaunchPlan`] whose tensor arguments are slot indices.
//!
//! Every failure of a call (a trap, the deadline, the memory cap, a refused import call, the
//! shim's own error) is a [`ShimFailure`] naming package, op, node and reason; the instance is
//! then discarded and the next call gets a fresh one, so the host and other packages go on.

mod cpu_conv;
mod cpu_gemm;
mod cpu_pool;
mod cpu_q4;
mod cpu_q4i8;
mod cpu_qgemm;
mod cpu_share;
pub mod handles;
mod imports;
mod shim;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::native_cache;

pub use cpu_pool::{cpu_threads, on_pool, on_pool_hot};

pub use handles::{Access, HandleTable, Slot};
pub use kiln_kernel_abi::manifest::ParamKind;
pub use shim::{ArgTensor, CallArgs, CallKind, CallOutcome, ConvService, KernelTable, ShimInstance, ShimModule};

pub use kiln_kernel_abi::plan::{LaunchLimits, LaunchPlan, PlanArg, PlanStep};

/// Limits of the sandbox.
#[derive(Clone, Debug)]
pub struct SandboxConfig {
    /// Largest linear memory of one shim instance, in bytes (at most 4 GiB, wasm32's range).
    pub memory_limit_bytes: usize,
    /// Wall-clock budget of one export call. Enforced by epoch interruption with a
    /// [`SandboxConfig::tick`] resolution.
    pub call_timeout: Duration,
    /// Epoch tick: how often the deadline is checked.
    pub tick: Duration,
    /// Largest total scratch of one call, in bytes.
    pub max_scratch_bytes: u64,
    /// Most `launch` + `gemm` calls in one dispatch.
    pub max_plan_steps: usize,
    /// Device limits that `launch` checks.
    pub launch_limits: LaunchLimits,
    /// A folder for compiled shims (`Module::serialize`, sealed entries of `native_cache`),
    /// keyed by the Wasm bytes and the engine's configuration, so that a later process skips
    /// Cranelift. `None`: compile every time. Its files are native code: a folder that is not
    /// this user's, or that others may write, is not used (one warning).
    pub module_cache: Option<std::path::PathBuf>,
}

impl Default for SandboxConfig {
    fn default() -> Self {
        SandboxConfig {
            memory_limit_bytes: 2 << 30,
            call_timeout: Duration::from_secs(120),
            tick: Duration::from_millis(10),
            max_scratch_bytes: 1 << 30,
            max_plan_steps: 4096,
            launch_limits: LaunchLimits::default(),
            module_cache: None,
        }
    }
}

/// How a shim call failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The shim reported the node invalid.
    Failed,
    /// The shim does not support this node.
    Unsupported,
    /// The shim made an import call the host refused (bad handle, bounds, pointer, name…).
    Refused,
    /// The shim trapped (including a panic).
    Trap,
    /// The call ran past its deadline.
    Timeout,
    /// The shim's memory would have grown past the cap.
    MemoryLimit,
    /// The module cannot be used (not wasm, wrong imports/exports, wrong ABI version).
    Module,
}

/// A failed shim call or load, with everything the user needs to act.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShimFailure {
    /// `name@version` of the package.
    pub package: String,
    pub op: String,
    /// The node's name (may be empty).
    pub node: String,
    pub kind: FailureKind,
    pub reason: String,
}

impl std::fmt::Display for ShimFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "package {}", self.package)?;
        if !self.op.is_empty() {
            write!(f, ", op {}", self.op)?;
        }
        if !self.node.is_empty() {
            write!(f, " (node {:?})", self.node)?;
        }
        let what = match self.kind {
            FailureKind::Failed => "failed",
            FailureKind::Unsupported => "unsupported",
            FailureKind::Refused => "refused import call",
            FailureKind::Trap => "trapped",
            FailureKind::Timeout => "timed out",
            FailureKind::MemoryLimit => "memory limit",
            FailureKind::Module => "unusable shim",
        };
        write!(f, ": {what}: {}", self.reason)
    }
}

impl std::error::Error for ShimFailure {}

/// The wasmtime engine, the host imports and the epoch ticker, shared by every shim.
pub struct Sandbox {
    engine: wasmtime::Engine,
    linker: wasmtime::Linker<shim::CallState>,
    config: SandboxConfig,
    /// `config.module_cache` when it may hold native code (`native_cache::private_dir`,
    /// checked once here), else `None`.
    module_cache: Option<std::path::PathBuf>,
    ticker_stop: Arc<AtomicBool>,
    ticker: Option<JoinHandle<()>>,
}

impl Sandbox {
    /// Creates the engine (epoch interruption on, no WASI) and starts the epoch ticker.
    pub fn new(config: SandboxConfig) -> Result<Sandbox, ShimFailure> {
        let fail = |reason: String| ShimFailure {
            package: String::new(),
            op: String::new(),
            node: String::new(),
            kind: FailureKind::Module,
            reason,
        };
        let mut wc = wasmtime::Config::new();
        wc.epoch_interruption(true);
        // ABI v1: one linear memory. With several, the memory cap would apply to each.
        wc.wasm_multi_memory(false);
        let engine = wasmtime::Engine::new(&wc).map_err(|e| fail(format!("cannot create the wasmtime engine: {e}")))?;
        let linker = imports::linker(&engine);
        let ticker_stop = Arc::new(AtomicBool::new(false));
        let (stop, eng, tick) = (ticker_stop.clone(), engine.clone(), config.tick);
        let ticker = std::thread::Builder::new()
            .name("kiln-epoch".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(tick);
                    eng.increment_epoch();
                }
            })
            .map_err(|e| fail(format!("cannot start the epoch ticker (no deadline could be enforced): {e}")))?;
        let module_cache = config.module_cache.clone().filter(|dir| match native_cache::private_dir(dir) {
            Ok(()) => true,
            Err(why) => {
                native_cache::warn_unusable(&why);
                false
            }
        });
        Ok(Sandbox { engine, linker, config, module_cache, ticker_stop, ticker: Some(ticker) })
    }

    pub fn config(&self) -> &SandboxConfig {
        &self.config
    }

    /// The compiled module of `wasm`: from the module cache when it holds a sealed entry made by
    /// this engine configuration (`native_cache`: this user's folder, digest checked), else
    /// compiled by Cranelift and stored there. An entry that is damaged, foreign or refused by
    /// wasmtime is compiled again and replaced; a cache that cannot be used is skipped.
    pub(super) fn compile(&self, wasm: &[u8]) -> Result<wasmtime::Module, wasmtime::Error> {
        let Some(dir) = &self.module_cache else { return wasmtime::Module::from_binary(&self.engine, wasm) };
        let path = dir.join(format!("{}.cwasm", self.cache_key(wasm)));
        match native_cache::read_sealed(&path) {
            Ok(Some(bytes)) => {
                // SAFETY: `read_sealed` returned the payload of a sealed entry in a folder and
                // file that only this user can write, and its digest matched: bytes this host
                // wrote with `Module::serialize` under a name that hashes the Wasm bytes and the
                // engine's compatibility hash. wasmtime also checks the header and refuses
                // another engine version or configuration (then it is compiled again).
                match unsafe { wasmtime::Module::deserialize(&self.engine, &bytes) } {
                    Ok(m) => {
                        tracing::debug!(file = %path.display(), "shim: from the module cache");
                        return Ok(m);
                    }
                    Err(e) => tracing::warn!(file = %path.display(), "shim cache entry refused by wasmtime: {e}"),
                }
            }
            Ok(None) => {}
            Err(why) => tracing::warn!(file = %path.display(), "shim cache entry not used, compiling again: {why}"),
        }
        let started = std::time::Instant::now();
        let module = wasmtime::Module::from_binary(&self.engine, wasm)?;
        tracing::info!(ms = started.elapsed().as_millis() as u64, bytes = wasm.len(), "shim: compiled by Cranelift");
        match module.serialize() {
            Ok(bytes) => {
                if let Err(e) = native_cache::write_sealed(&path, &bytes) {
                    tracing::warn!(file = %path.display(), "shim cache entry not written: {e}");
                }
            }
            Err(e) => tracing::warn!("shim: cannot serialize the compiled module: {e}"),
        }
        Ok(module)
    }

    /// sha256 of the Wasm bytes, the engine's compatibility hash and kiln's version, hex.
    fn cache_key(&self, wasm: &[u8]) -> String {
        use sha2::{Digest, Sha256};
        use std::hash::{Hash, Hasher};
        let mut engine = std::collections::hash_map::DefaultHasher::new();
        self.engine.precompile_compatibility_hash().hash(&mut engine);
        let mut h = Sha256::new();
        h.update(wasm);
        h.update(engine.finish().to_le_bytes());
        h.update(env!("CARGO_PKG_VERSION").as_bytes());
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Compiles and validates a shim. `package` (`name@version`) names it in errors;
    /// `kernels` are the entry points its manifest declares (what `launch` may name) with their
    /// signatures (`Manifest::kernel_signatures`), against which every launch is checked.
    pub fn load(
        &self,
        package: &str,
        wasm: &[u8],
        kernels: Vec<(String, Vec<ParamKind>)>,
    ) -> Result<Arc<ShimModule>, ShimFailure> {
        ShimModule::new(self, package, wasm, kernels).map(Arc::new)
    }

    /// The per-call deadline in ticks.
    fn deadline_ticks(&self) -> u64 {
        (self.config.call_timeout.as_millis() / self.config.tick.as_millis().max(1)).max(1) as u64
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.ticker_stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.ticker.take() {
            let _ = t.join();
        }
    }
}

//! The execution provider: resolves nodes to packages, prepares shims, and executes the
//! graph in topological order on a device backend.
//!
//! [`Runtime`] is shared (sandbox, op registry, compiled shims); a [`Session`] is one model
//! on one device with its own shim instances.

mod backend;
mod binding;
mod control;
mod host_tensor;
mod infer;
mod layout;
mod pages;
mod plan;
mod prepare;
mod sequence;
mod session;
mod shims;
mod tiles;
mod value;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kiln_registry::{OpRegistry, Package};

use crate::sandbox::{Sandbox, SandboxConfig, ShimModule};
use crate::Result;

pub use crate::capture::GraphMode;
pub use crate::HostValue;
pub use binding::{DeviceTensor, Feed, Fetch, Fetched, PendingRead};
pub use control::CONTROL_FLOW;
pub use pages::{KvPages, PageGeometry, PAGE_POSITIONS};
pub use sequence::is_sequence_op as runs_on_executor;
pub use session::{CudnnMode, Session, SessionOptions, MAX_LOOP_ITERATIONS, VMM_CHUNK_BYTES};
pub use tiles::CpuSplit;

/// The device a session runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// Packages' CPU references, run in the sandbox.
    Cpu,
    /// The CUDA device of this ordinal: packages' kernels through launch plans.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

/// Shared state: the sandbox, the op registry and shims compiled once per package.
pub struct Runtime {
    pub sandbox: Sandbox,
    pub registry: OpRegistry,
    modules: Mutex<HashMap<String, Arc<ShimModule>>>,
}

impl Runtime {
    /// A runtime over `registry`, whose packages' dependencies are resolved here
    /// ([`OpRegistry::link`]: one whose dependencies no source meets is left out, with the
    /// reason its nodes then give).
    pub fn new(mut registry: OpRegistry, config: SandboxConfig) -> Result<Arc<Runtime>> {
        registry.link();
        Ok(Arc::new(Runtime { sandbox: Sandbox::new(config)?, registry, modules: Mutex::default() }))
    }

    /// The compiled shim of `pkg` (compiled on first use).
    pub fn module(&self, pkg: &Package) -> Result<Arc<ShimModule>> {
        let id = pkg.id();
        if let Some(m) = self.modules.lock().unwrap_or_else(|p| p.into_inner()).get(&id) {
            return Ok(m.clone());
        }
        let kernels = pkg.manifest.kernel_signatures();
        let module = self.sandbox.load(&id, &pkg.shim, kernels)?;
        self.modules.lock().unwrap_or_else(|p| p.into_inner()).insert(id, module.clone());
        Ok(module)
    }
}

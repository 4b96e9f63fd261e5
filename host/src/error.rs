//! The host's error type.

use std::path::PathBuf;

use kiln_registry::{RegistryError, Unresolved};

use crate::sandbox::{FailureKind, ShimFailure};

/// Everything that can go wrong in the host. Each variant says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A malformed or inconsistent model.
    #[error("invalid model: {0}")]
    Model(String),
    /// A valid model (or input) that uses something kiln does not support.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// No package runs a node. `others`: the other ops of the model that no package runs
    /// (op, node count, first node), so that one error names everything missing.
    #[error("node {node:?}: {detail}{}", also_unresolved(others))]
    Unresolved { node: String, detail: Box<Unresolved>, others: Vec<UnresolvedOp> },
    #[error("{0}")]
    Shim(Box<ShimFailure>),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// A bad input tensor, file or argument.
    #[error("{0}")]
    Input(String),
    /// The requested device is not available, or it failed.
    #[error("{0}")]
    Device(String),
    /// No room on the device for an allocation or a KV cache's growth, within
    /// `--device-memory-limit` or the device's memory: nothing was allocated, and the session
    /// goes on (a server fails only the requests that needed the room).
    #[error("{0}")]
    OutOfMemory(String),
    /// A kernel found an input out of range on the device (ABI.md §7.5): the same input the
    /// CPU reference refuses, found at the step's synchronization.
    #[error("{0}")]
    DeviceCheck(Box<DeviceCheck>),
}

/// A node whose kernel reported an input out of range through its device status record: the
/// package, op and node, and the package's message for the code (ABI.md §7.5).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceCheck {
    /// `name@version` of the package (empty when the node's package is not known).
    pub package: String,
    pub op: String,
    /// The node's name (may be empty).
    pub node: String,
    pub reason: String,
}

impl std::fmt::Display for DeviceCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if !self.package.is_empty() {
            write!(f, "package {}, ", self.package)?;
        }
        write!(f, "op {}", self.op)?;
        if !self.node.is_empty() {
            write!(f, " (node {:?})", self.node)?;
        }
        write!(f, ": failed on the device: {}", self.reason)
    }
}

impl Error {
    /// The same error with `at` (where it happened: "node X's subgraph Y: ") before its message,
    /// for the kinds whose message is text (the others already name their node or file).
    pub fn context(self, at: &str) -> Error {
        match self {
            Error::Model(m) => Error::Model(format!("{at}{m}")),
            Error::Unsupported(m) => Error::Unsupported(format!("{at}{m}")),
            Error::Input(m) => Error::Input(format!("{at}{m}")),
            other => other,
        }
    }

    /// Whether the error means "kiln cannot run this" rather than "this is wrong": an op,
    /// dtype, attribute or feature that no package (or the host) supports.
    pub fn is_unsupported(&self) -> bool {
        match self {
            Error::Unsupported(_) | Error::Unresolved { .. } => true,
            Error::Shim(f) => f.kind == FailureKind::Unsupported,
            _ => false,
        }
    }
}

/// An op of the model that no package runs: `domain::op_type`, how many nodes use it, and
/// the first of them.
#[derive(Clone, Debug, PartialEq)]
pub struct UnresolvedOp {
    pub op: String,
    pub nodes: usize,
    pub first_node: String,
}

fn also_unresolved(others: &[UnresolvedOp]) -> String {
    if others.is_empty() {
        return String::new();
    }
    let list: Vec<String> = others
        .iter()
        .map(|o| {
            format!("{} ({} node{}, first {:?})", o.op, o.nodes, if o.nodes == 1 { "" } else { "s" }, o.first_node)
        })
        .collect();
    format!("\nno package runs these ops of the model either: {}", list.join(", "))
}

impl From<ShimFailure> for Error {
    fn from(f: ShimFailure) -> Self {
        Error::Shim(Box::new(f))
    }
}

/// `Result` with the host's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

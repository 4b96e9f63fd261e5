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
    /// No package runs a node.
    #[error("node {node:?}: {detail}")]
    Unresolved { node: String, detail: Box<Unresolved> },
    #[error("{0}")]
    Shim(Box<ShimFailure>),
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// A bad input tensor, file or argument.
    #[error("{0}")]
    Input(String),
    /// The requested device is not available.
    #[error("{0}")]
    Device(String),
}

impl Error {
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

impl From<ShimFailure> for Error {
    fn from(f: ShimFailure) -> Self {
        Error::Shim(Box::new(f))
    }
}

/// `Result` with the host's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

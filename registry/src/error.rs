//! Errors of package loading.

use std::path::PathBuf;

use kiln_kernel_abi::manifest::ManifestError;

/// Why a package could not be loaded. Every variant names the package source (folder or
/// `builtin:<dir>`) so the user knows which package to fix or remove.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("{origin}: {}: {source}", path.display())]
    Io { origin: String, path: PathBuf, source: std::io::Error },
    #[error("{origin}: {source}")]
    Manifest { origin: String, source: ManifestError },
    #[error("{origin}: kernel ABI {found} is not spoken by this kiln (it speaks {supported:?}); rebuild the package for ABI {}", supported.last().copied().unwrap_or(1))]
    AbiVersion { origin: String, found: u32, supported: Vec<u32> },
    #[error("{origin}: {file} is not listed in [files] of kernel.toml with its sha256")]
    Unlisted { origin: String, file: String },
    #[error("{origin}: {file} listed in [files] is missing from the package")]
    Missing { origin: String, file: String },
    #[error("{origin}: sha256 of {file} is {actual}, but kernel.toml says {expected}: the package is corrupt or was modified")]
    Checksum { origin: String, file: String, expected: String, actual: String },
    #[error("{origin}: {file} is not UTF-8 text")]
    NotText { origin: String, file: String },
    #[error("{origin}: refused archive: {reason}")]
    Archive { origin: String, reason: String },
    #[error("{}: line {line}: {reason}", path.display())]
    Index { path: PathBuf, line: usize, reason: String },
    #[error("{}: sha256 is {actual}, but the registry index says {expected}: the archive is corrupt or was modified", path.display())]
    Tampered { path: PathBuf, expected: String, actual: String },
    #[error("registry {registry}: {id} is already published (a version is published once; publish a new version)")]
    AlreadyPublished { registry: String, id: String },
    #[error("registry {registry}: {id} is not published")]
    NotPublished { registry: String, id: String },
    #[error("registry {registry}: {reason}")]
    Registry { registry: String, reason: String },
    /// A published package of a registry directory that did not load: runs skip it (the
    /// others load), `kiln kernels list` reports it.
    #[error("registry {registry}: {source}")]
    Published { registry: String, source: Box<RegistryError> },
}

impl RegistryError {
    /// Whether this is a registry's published package that failed to load ([`RegistryError::Published`]).
    pub fn is_published(&self) -> bool {
        matches!(self, RegistryError::Published { .. })
    }
}

//! kiln-registry: kernel packages and the op registry.
//!
//! - [`package`]: a package (a folder, or the files of a built-in one) loaded, its manifest
//!   validated and every file checked against the sha256 the manifest gives.
//! - [`archive`]: `.kpkg` archives, a package folder as one file, read as hostile input.
//! - [`directory`]: registry directories (docs/REGISTRY.md): publish, yank, search, load.
//! - [`lock`]: `kiln.lock`, the exact packages a model's runs may use.
//! - [`ops`]: the op registry, which matches a node (domain, op type, opset, dtypes, rank,
//!   device) to the highest compatible package version and explains every rejection.

pub mod archive;
pub mod directory;
pub mod error;
pub mod lock;
pub mod ops;
pub mod package;
pub mod signing;

pub use directory::{parse_index, IndexLine, RegistryDir};
pub use error::RegistryError;
pub use ops::{normalize_domain, DeviceCaps, NodeQuery, OpRegistry, Rejection, Resolution, Unresolved, BUILTIN, USER};
pub use ops::{registry_precedence, Candidate, Requirement, Verdict};
pub use package::Package;
pub use semver::Version;

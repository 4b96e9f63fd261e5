//! kiln-host: the kiln runtime. It loads ONNX models, resolves each node to a kernel package,
//! runs the packages' shims in a wasmtime sandbox and executes the graph on a device backend.
//!
//! Modules, in dependency order (see `docs/ARCHITECTURE.md`):
//! - [`cli`] → [`ep`] → [`model`], [`sandbox`], [`cpu`]
//! - [`sandbox`] depends on `kiln-kernel-abi` only;
//! - [`trace`] is a leaf every module may use; [`tensor`] and [`tensorio`] are data types and
//!   file formats.

pub mod capture;
pub mod cli;
pub mod conformance;
pub mod cpu;
pub mod cuda;
pub mod ep;
pub mod error;
pub mod fuse;
pub mod genai;
pub mod host_value;
pub mod model;
pub mod native_cache;
pub mod packages;
pub mod sandbox;
pub mod serve;
pub mod tensor;
pub mod tensorio;
pub mod trace;

pub use error::{Error, Result};
pub use host_value::HostValue;
pub use tensor::Tensor;

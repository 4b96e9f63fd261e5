//! # kiln kernel ABI v1
//!
//! The contract between the kiln host and a kernel package's WebAssembly shim. The normative
//! text is `kernel-abi/ABI.md`; this crate holds the types that both sides share:
//!
//! - [`DType`]: element types, numbered as ONNX's `TensorProto.DataType`; [`minifloat`]: the
//!   values of the float8, float4 and packed 4-bit/2-bit types; [`strings`]: string tensors'
//!   bytes.
//! - [`wire`]: the little-endian encodings of a node call (host → shim), a kernel launch and a
//!   GEMM descriptor (shim → host).
//! - [`status`]: the return codes of shim exports and host imports.
//! - [`names`]: kernel names, C identifiers or (schema 6) C++ name expressions of templates.
//! - [`plan`]: launch plans, the pure data a dispatch records and a device backend runs.
//! - [`philox`] and [`sampling`]: the counter-based RNG and the token-choice reference that host
//!   and device samplers share.
//! - [`manifest`] (feature `manifest`, std): the `kernel.toml` types; [`fusion`]: its
//!   `[[fusions]]` patterns.
//! - [`guest`] (feature `guest`, no_std + alloc): the SDK shim crates are written with.
//!
//! The crate knows nothing of wasmtime or CUDA: it is the data model, not a runtime.
#![cfg_attr(not(feature = "manifest"), no_std)]

extern crate alloc;

pub mod dtype;
pub mod math;
pub mod minifloat;
pub mod names;
pub mod philox;
pub mod plan;
pub mod sampling;
pub mod status;
pub mod strings;
pub mod wire;

#[cfg(feature = "manifest")]
pub mod fusion;
#[cfg(feature = "manifest")]
pub mod manifest;

#[cfg(feature = "guest")]
pub mod guest;

pub use dtype::DType;

/// The ABI version this crate describes. A shim reports the version it was built against
/// through its `kiln_abi_version` export; the host refuses versions it does not speak.
pub const ABI_VERSION: u32 = 1;

/// The name of the only module a shim may import from.
pub const IMPORT_MODULE: &str = "kiln";

/// Export names every shim must provide (ABI v1).
pub mod exports {
    /// `() -> i32`: the ABI version the shim was built against.
    pub const ABI_VERSION: &str = "kiln_abi_version";
    /// `(size: i32) -> i32`: a pointer to `size` writable bytes (8-byte aligned) in the shim's
    /// memory, valid until the next `kiln_alloc`.
    pub const ALLOC: &str = "kiln_alloc";
    /// `(ptr: i32, len: i32) -> i32`: shape and dtype inference.
    pub const INFER: &str = "kiln_infer";
    /// `(ptr: i32, len: i32) -> i32`: build the launch plan for the GPU.
    pub const DISPATCH: &str = "kiln_dispatch";
    /// `(ptr: i32, len: i32) -> i32`: run the CPU reference.
    pub const CPU: &str = "kiln_cpu";
    /// The linear memory.
    pub const MEMORY: &str = "memory";
}

/// Import names of module `kiln` (ABI v1). Signatures are in `ABI.md`.
pub mod imports {
    pub const FAIL: &str = "fail";
    pub const SET_OUTPUT: &str = "set_output";
    pub const READ: &str = "read";
    pub const WRITE: &str = "write";
    pub const SCRATCH: &str = "scratch";
    pub const LAUNCH: &str = "launch";
    pub const GEMM: &str = "gemm";
    pub const CONV: &str = "conv";
    pub const QGEMM: &str = "qgemm";
}

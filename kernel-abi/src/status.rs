//! Return codes (ABI v1).
//!
//! Shim exports `kiln_infer`, `kiln_dispatch`, `kiln_cpu` return [`OK`], [`FAILED`] or
//! [`UNSUPPORTED`]; before returning a non-zero code the shim should call the `fail` import
//! with a message. Host imports return `0` (or a non-negative value such as a handle) on
//! success and one of the negative `E_*` codes on a refused call; the host also remembers the
//! refusal, so the node fails with the host's reason even if the shim ignores the code.

/// The call succeeded.
pub const OK: i32 = 0;
/// The call failed: the node is invalid for this op (bad attribute, shapes that do not match).
pub const FAILED: i32 = 1;
/// The package does not support this node (an attribute value, dtype or rank it does not
/// implement). The host reports the node as unsupported, not as a wrong result.
pub const UNSUPPORTED: i32 = 2;

/// A handle that is not in the call's handle table (forged, or from another call).
pub const E_HANDLE: i32 = -1;
/// A byte range outside the tensor named by the handle.
pub const E_BOUNDS: i32 = -2;
/// A pointer/length pair outside the shim's linear memory.
pub const E_MEMORY: i32 = -3;
/// An import that this kind of call may not use (for example `write` during `kiln_infer`).
pub const E_CALL: i32 = -4;
/// A malformed argument: bad encoding, unknown dtype, kernel name not declared in the manifest,
/// launch dimensions over the device limits, output index out of range.
pub const E_ARG: i32 = -5;
/// A request over a limit (scratch size, number of launches).
pub const E_LIMIT: i32 = -6;
/// A handle of a tensor that may not be written (an input).
pub const E_READONLY: i32 = -7;
/// The host does not serve this import for this call (ABI.md §4.8: `conv` in a dispatch where the
/// device has no cuDNN, or for a descriptor cuDNN does not take). Not a failure: the host does not
/// remember it, and the shim runs its own kernels instead (manifest schema 10).
pub const E_UNAVAILABLE: i32 = -8;

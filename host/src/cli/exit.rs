//! kiln's exit codes, one per kind of outcome, so scripts can tell a usage mistake from a bad
//! model from a wrong answer (README, "Exit codes").

use std::process::ExitCode;

use crate::sandbox::FailureKind;
use crate::Error;

/// The run did what was asked and every check passed.
pub const OK: u8 = 0;
/// kiln or the device failed: a CUDA error, a misbehaving package shim (trap, refused call,
/// deadline, memory cap).
pub const INTERNAL: u8 = 1;
// 2: the command line is wrong (an unknown flag, a missing argument): clap's own exit code.
/// An input is invalid: the model, a tensor file, a model folder, a package or manifest, a
/// flag's value, an output path.
pub const INVALID_INPUT: u8 = 3;
/// kiln does not support what was asked: an op, dtype or attribute no package covers.
pub const UNSUPPORTED: u8 = 4;
/// The run worked but a check did not pass: an `--expect` mismatch, a failed conformance or
/// verify test.
pub const MISMATCH: u8 = 5;

/// The exit code of an error.
pub fn of(e: &Error) -> u8 {
    if e.is_unsupported() {
        return UNSUPPORTED;
    }
    match e {
        Error::Io { .. } | Error::Model(_) | Error::Input(_) | Error::Registry(_) | Error::DeviceCheck(_) => {
            INVALID_INPUT
        }
        Error::Shim(f) if f.kind == FailureKind::Failed => INVALID_INPUT,
        // A package whose shim is not a valid module (not Wasm, a missing export, another ABI).
        Error::Shim(f) if f.kind == FailureKind::Module && !f.package.is_empty() => INVALID_INPUT,
        _ => INTERNAL,
    }
}

/// [`MISMATCH`] when `failed`, else [`OK`].
pub fn checks(failed: bool) -> ExitCode {
    ExitCode::from(if failed { MISMATCH } else { OK })
}

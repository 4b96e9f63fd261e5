//! Safe wrappers of the host imports (module `kiln`, ABI v1).

use alloc::vec::Vec;

use super::{Result, ShimError};
use crate::wire::{Conv, Gemm, Launch, QGemm};

#[cfg(target_arch = "wasm32")]
mod sys {
    #[link(wasm_import_module = "kiln")]
    extern "C" {
        pub fn fail(ptr: *const u8, len: usize);
        pub fn set_output(index: u32, dtype: i32, rank: u32, dims: *const i64) -> i32;
        pub fn read(handle: u32, offset: u64, dst: *mut u8, len: usize) -> i32;
        pub fn write(handle: u32, offset: u64, src: *const u8, len: usize) -> i32;
        pub fn scratch(nbytes: u64) -> i32;
        pub fn launch(desc: *const u8, len: usize) -> i32;
        pub fn gemm(desc: *const u8, len: usize) -> i32;
        pub fn conv(desc: *const u8, len: usize) -> i32;
        pub fn qgemm(desc: *const u8, len: usize) -> i32;
    }
}

/// Off wasm32 (host-side builds of the SDK, e.g. `cargo doc`) every import refuses.
#[cfg(not(target_arch = "wasm32"))]
#[allow(clippy::missing_safety_doc)]
mod sys {
    use crate::status::E_CALL;
    pub unsafe fn fail(_: *const u8, _: usize) {}
    pub unsafe fn set_output(_: u32, _: i32, _: u32, _: *const i64) -> i32 {
        E_CALL
    }
    pub unsafe fn read(_: u32, _: u64, _: *mut u8, _: usize) -> i32 {
        E_CALL
    }
    pub unsafe fn write(_: u32, _: u64, _: *const u8, _: usize) -> i32 {
        E_CALL
    }
    pub unsafe fn scratch(_: u64) -> i32 {
        E_CALL
    }
    pub unsafe fn launch(_: *const u8, _: usize) -> i32 {
        E_CALL
    }
    pub unsafe fn gemm(_: *const u8, _: usize) -> i32 {
        E_CALL
    }
    pub unsafe fn conv(_: *const u8, _: usize) -> i32 {
        E_CALL
    }
    pub unsafe fn qgemm(_: *const u8, _: usize) -> i32 {
        E_CALL
    }
}

fn check(code: i32) -> core::result::Result<i32, i32> {
    if code < 0 {
        Err(code)
    } else {
        Ok(code)
    }
}

/// Reports a failure message to the host (the `fail` import).
pub fn log_fail(msg: &str) {
    unsafe { sys::fail(msg.as_ptr(), msg.len()) }
}

pub(crate) fn set_output(index: u32, dtype: i32, dims: &[i64]) -> core::result::Result<(), i32> {
    check(unsafe { sys::set_output(index, dtype, dims.len() as u32, dims.as_ptr()) }).map(|_| ())
}

pub(crate) fn read(handle: u32, offset: u64, dst: &mut [u8]) -> core::result::Result<(), i32> {
    check(unsafe { sys::read(handle, offset, dst.as_mut_ptr(), dst.len()) }).map(|_| ())
}

pub(crate) fn write(handle: u32, offset: u64, src: &[u8]) -> core::result::Result<(), i32> {
    check(unsafe { sys::write(handle, offset, src.as_ptr(), src.len()) }).map(|_| ())
}

/// A scratch tensor of `nbytes` bytes for the rest of this call; returns its handle.
pub fn scratch(nbytes: u64) -> Result<u32> {
    check(unsafe { sys::scratch(nbytes) })
        .map(|h| h as u32)
        .map_err(|c| ShimError::Failed(alloc::format!("scratch of {nbytes} bytes refused ({c})")))
}

/// A scratch tensor holding `bytes` (CPU calls, where scratch is host memory the shim may
/// write); returns its handle, which a `gemm` may then read.
pub fn scratch_from(bytes: &[u8]) -> Result<u32> {
    let h = scratch(bytes.len() as u64)?;
    write(h, 0, bytes)
        .map_err(|c| ShimError::Failed(alloc::format!("writing {} bytes of scratch refused ({c})", bytes.len())))?;
    Ok(h)
}

/// Reads `dst.len()` bytes at byte `offset` of the tensor `handle` names (CPU calls: an input,
/// an output or a scratch tensor, such as a `gemm`'s D in scratch).
pub fn read_handle(handle: u32, offset: u64, dst: &mut [u8]) -> Result<()> {
    read(handle, offset, dst).map_err(|c| ShimError::Failed(alloc::format!("read of handle {handle:#x} refused ({c})")))
}

/// Writes `src` at byte `offset` of the output or scratch tensor `handle` names (CPU calls).
pub fn write_handle(handle: u32, offset: u64, src: &[u8]) -> Result<()> {
    write(handle, offset, src)
        .map_err(|c| ShimError::Failed(alloc::format!("write of handle {handle:#x} refused ({c})")))
}

/// Enqueues one launch of a kernel declared in the package manifest (dispatch calls only).
pub fn launch(l: &Launch<'_>) -> Result<()> {
    let bytes: Vec<u8> = l.encode();
    check(unsafe { sys::launch(bytes.as_ptr(), bytes.len()) })
        .map(|_| ())
        .map_err(|c| ShimError::Failed(alloc::format!("launch of {} refused ({c})", l.kernel)))
}

/// One GEMM (ABI.md §4.7): enqueued in a dispatch call; in a CPU call the host computes it at
/// once on the call's host tensors (manifest schema 8, a package that does so declares it).
pub fn gemm(g: &Gemm) -> Result<()> {
    let bytes = g.encode();
    check(unsafe { sys::gemm(bytes.as_ptr(), bytes.len()) })
        .map(|_| ())
        .map_err(|c| ShimError::Failed(alloc::format!("gemm refused ({c})")))
}

/// One convolution (ABI.md §4.8): computed at once by the host in a CPU call (manifest schema 8).
/// In a dispatch use [`device_conv`].
pub fn conv(c: &Conv) -> Result<()> {
    let bytes = c.encode();
    check(unsafe { sys::conv(bytes.as_ptr(), bytes.len()) })
        .map(|_| ())
        .map_err(|code| ShimError::Failed(alloc::format!("conv refused ({code})")))
}

/// One convolution in a dispatch (ABI.md §4.8, manifest schema 10): `Ok(true)` when the host
/// enqueues it through the device's library (cuDNN), `Ok(false)` when it does not serve this
/// descriptor here (`E_UNAVAILABLE`: no cuDNN, turned off, or a form cuDNN does not take), and
/// the shim then launches its own kernels. Errors: a refused descriptor (bounds, dtype, …).
pub fn device_conv(c: &Conv) -> Result<bool> {
    let bytes = c.encode();
    match unsafe { sys::conv(bytes.as_ptr(), bytes.len()) } {
        crate::status::E_UNAVAILABLE => Ok(false),
        code => check(code).map(|_| true).map_err(|code| ShimError::Failed(alloc::format!("conv refused ({code})"))),
    }
}

/// One block-quantized product (ABI.md §4.9, MatMulNBits'): computed at once by the host in a CPU
/// call (manifest schema 8; refused in a dispatch).
pub fn qgemm(q: &QGemm) -> Result<()> {
    let bytes = q.encode();
    check(unsafe { sys::qgemm(bytes.as_ptr(), bytes.len()) })
        .map(|_| ())
        .map_err(|code| ShimError::Failed(alloc::format!("qgemm refused ({code})")))
}

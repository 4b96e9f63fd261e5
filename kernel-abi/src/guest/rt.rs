//! The runtime glue behind [`export_shim!`](crate::export_shim): the call buffer, the entry
//! points' bodies, the global allocator and the panic handler.

use alloc::vec::Vec;
use core::cell::UnsafeCell;

use super::{host, Call, Shim, ShimError};
use crate::status;
use crate::wire::NodeCall;

/// 8-byte words, so that the buffer is 8-byte aligned as ABI.md §3 requires.
struct CallBuffer(UnsafeCell<Vec<u64>>);
// SAFETY: a wasm32-unknown-unknown shim is single-threaded.
unsafe impl Sync for CallBuffer {}
static CALL_BUFFER: CallBuffer = CallBuffer(UnsafeCell::new(Vec::new()));

/// Body of `kiln_alloc`: an 8-byte-aligned buffer of `size` bytes for the host to write a
/// call into, valid until the next `kiln_alloc`.
pub fn alloc_call_buffer(size: i32) -> i32 {
    // SAFETY: single-threaded; the previous call's borrow ended when its export returned.
    let buf = unsafe { &mut *CALL_BUFFER.0.get() };
    buf.clear();
    buf.resize((size.max(0) as usize).div_ceil(8), 0);
    buf.as_mut_ptr() as i32
}

fn with_call(ptr: i32, len: i32, f: impl FnOnce(&Call) -> super::Result<()>) -> i32 {
    // SAFETY: the host wrote `len` bytes at `ptr`, inside the buffer returned by kiln_alloc.
    let bytes = unsafe { core::slice::from_raw_parts(ptr as usize as *const u8, len.max(0) as usize) };
    let node = match NodeCall::decode(bytes) {
        Ok(n) => n,
        Err(e) => {
            host::log_fail(&alloc::format!("shim could not decode the node call: {e}"));
            return status::FAILED;
        }
    };
    match f(&Call { node }) {
        Ok(()) => status::OK,
        Err(ShimError::Failed(msg)) => {
            host::log_fail(&msg);
            status::FAILED
        }
        Err(ShimError::Unsupported(msg)) => {
            host::log_fail(&msg);
            status::UNSUPPORTED
        }
    }
}

/// Body of `kiln_infer`.
pub fn run_infer<S: Shim>(ptr: i32, len: i32) -> i32 {
    with_call(ptr, len, |call| {
        let outs = S::infer(call)?;
        for (i, o) in outs.iter().enumerate() {
            if call.output_opt(i).is_none() {
                continue;
            }
            let dims: Vec<i64> = o.shape.iter().map(|&d| d as i64).collect();
            host::set_output(i as u32, o.dtype.code(), &dims)
                .map_err(|c| ShimError::Failed(alloc::format!("host refused output {i} ({c})")))?;
        }
        Ok(())
    })
}

/// Body of `kiln_dispatch`.
pub fn run_dispatch<S: Shim>(ptr: i32, len: i32) -> i32 {
    with_call(ptr, len, S::dispatch)
}

/// Body of `kiln_cpu`.
pub fn run_cpu<S: Shim>(ptr: i32, len: i32) -> i32 {
    with_call(ptr, len, S::cpu)
}

/// Exports a [`Shim`] implementation as the ABI v1 entry points.
#[macro_export]
macro_rules! export_shim {
    ($shim:ty) => {
        #[no_mangle]
        pub extern "C" fn kiln_abi_version() -> i32 {
            $crate::ABI_VERSION as i32
        }
        #[no_mangle]
        pub extern "C" fn kiln_alloc(size: i32) -> i32 {
            $crate::guest::rt::alloc_call_buffer(size)
        }
        #[no_mangle]
        pub extern "C" fn kiln_infer(ptr: i32, len: i32) -> i32 {
            $crate::guest::rt::run_infer::<$shim>(ptr, len)
        }
        #[no_mangle]
        pub extern "C" fn kiln_dispatch(ptr: i32, len: i32) -> i32 {
            $crate::guest::rt::run_dispatch::<$shim>(ptr, len)
        }
        #[no_mangle]
        pub extern "C" fn kiln_cpu(ptr: i32, len: i32) -> i32 {
            $crate::guest::rt::run_cpu::<$shim>(ptr, len)
        }
    };
}

#[cfg(all(target_arch = "wasm32", not(feature = "manifest")))]
mod wasm_runtime {
    #[global_allocator]
    static ALLOCATOR: dlmalloc::GlobalDlmalloc = dlmalloc::GlobalDlmalloc;

    /// Formats into a fixed buffer: the panic may be an allocation failure.
    struct FixedWriter {
        buf: [u8; 512],
        len: usize,
    }

    impl core::fmt::Write for FixedWriter {
        fn write_str(&mut self, s: &str) -> core::fmt::Result {
            let n = s.len().min(self.buf.len() - self.len);
            self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
            self.len += n;
            Ok(())
        }
    }

    #[panic_handler]
    fn panic(info: &core::panic::PanicInfo) -> ! {
        use core::fmt::Write;
        let mut w = FixedWriter { buf: [0; 512], len: 0 };
        let _ = write!(w, "shim panicked: {}", info.message());
        if let Some(loc) = info.location() {
            let _ = write!(w, " at {}:{}", loc.file(), loc.line());
        }
        // Cut at a char boundary.
        let mut n = w.len;
        while n > 0 && core::str::from_utf8(&w.buf[..n]).is_err() {
            n -= 1;
        }
        super::host::log_fail(core::str::from_utf8(&w.buf[..n]).unwrap_or("shim panicked"));
        core::arch::wasm32::unreachable()
    }
}

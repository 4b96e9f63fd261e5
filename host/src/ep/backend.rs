//! The device backend of a session: where its values live and how their bytes move, behind
//! one trait with a CPU and a CUDA implementation (as candle's `backend.rs` splits its devices).
//! Ops are not the backend's: a node runs its package's CPU reference or launch plan (`session`);
//! the backend places the node's inputs, makes buffers, and moves bytes between the host and
//! the device.
//!
//! - [`CpuBackend`]: values are host tensors; nothing waits.
//! - [`Gpu`]: values are device buffers from the device's pool; copies are stream-ordered on
//!   the device's compute stream, reads wait for the work enqueued before them.

use kiln_kernel_abi::DType;

use super::binding::PendingRead;
use super::value::Value;
use super::Device;
use crate::cuda::Gpu;
use crate::trace::DeviceMemory;
use crate::{Error, Result, Tensor};

/// What a session needs of its device. Byte offsets and counts are the caller's to check
/// against the values (`binding` does).
pub(crate) trait Backend: Send {
    /// The device, for messages and reports.
    fn device(&self) -> Device;

    /// The CUDA side of a GPU backend: execution plans, captures, reserved tensors and status
    /// records are CUDA's alone. `None` on the CPU.
    fn gpu(&mut self) -> Option<&mut Gpu> {
        None
    }

    /// [`Backend::gpu`], shared.
    fn gpu_ref(&self) -> Option<&Gpu> {
        None
    }

    /// `v` where this device's nodes read it: on a GPU a host value is uploaded into a new
    /// buffer that keeps the host bytes too (shape arithmetic still reads them); anything else
    /// is `v` itself, not owning its buffer. Errors: device memory.
    fn place(&mut self, v: &Value) -> Result<Value>;

    /// `v`'s bytes in a new buffer of this device, owned by the result. Errors: device memory;
    /// on the CPU, a device value.
    fn duplicate(&mut self, v: &Value) -> Result<Value>;

    /// A new value of `nbytes` zero bytes, `dtype` and `shape`. Errors: device memory.
    fn zeros(&mut self, dtype: DType, shape: Vec<usize>, nbytes: u64) -> Result<Value>;

    /// `shape`'s bytes of `v` from byte `start`, as a host tensor of `dtype` (on a GPU it waits
    /// for the work enqueued so far). Errors: the driver's; on the CPU, a device value.
    fn read(&mut self, v: &Value, start: usize, dtype: DType, shape: Vec<usize>) -> Result<Tensor>;

    /// Writes host `bytes` into `dst` from byte `at` (on a GPU stream-ordered: work enqueued
    /// before it reads the old bytes). Errors: the driver's, or a value of the other device.
    fn write(&mut self, dst: &mut Value, at: usize, bytes: &[u8]) -> Result<()>;

    /// Copies `n` bytes of `src` from byte `from` into `dst` from byte `to` (stream-ordered on a
    /// GPU; `src` may be a host value there). Errors: the driver's, or a value of the other
    /// device.
    fn copy(&mut self, src: &Value, from: usize, dst: &mut Value, to: usize, n: usize) -> Result<()>;

    /// Starts reading `v` back to the host behind the work so far, without waiting (a host
    /// value is read at once). Errors: more than [`crate::cuda::READBACK_BYTES`] on a GPU.
    fn read_start(&mut self, v: &Value) -> Result<PendingRead>;

    /// Waits for a read of [`Backend::read_start`] and returns its tensor.
    fn read_finish(&mut self, p: PendingRead) -> Result<Tensor>;

    /// Waits for the work enqueued so far.
    fn synchronize(&mut self) -> Result<()>;

    /// The device memory the session holds (`None` on the CPU).
    fn memory(&self) -> Option<DeviceMemory>;
}

/// Overwrites `t`'s bytes from byte `at` with `bytes` (the caller checked the extent); in place
/// when the bytes are not shared with another value (a KV cache's are not).
fn write_bytes(t: &mut Tensor, at: usize, bytes: &[u8]) {
    let data = std::mem::take(&mut t.data);
    let mut b = data.try_into_mut().unwrap_or_else(|shared| bytes::BytesMut::from(&shared[..]));
    b[at..at + bytes.len()].copy_from_slice(bytes);
    t.data = b.freeze();
}

fn host_only(what: &str) -> Error {
    Error::Device(format!("{what}: a device value in a CPU session"))
}

/// The CPU: values are host tensors, run through the packages' CPU references.
pub(crate) struct CpuBackend;

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn place(&mut self, v: &Value) -> Result<Value> {
        Ok(v.clone_ref())
    }

    fn duplicate(&mut self, v: &Value) -> Result<Value> {
        match v {
            Value::Host(t) => Ok(Value::Host(t.clone())),
            Value::Device { host: Some(t), .. } => Ok(Value::Host(t.clone())),
            Value::Device { .. } => Err(host_only("a copy")),
        }
    }

    fn zeros(&mut self, dtype: DType, shape: Vec<usize>, nbytes: u64) -> Result<Value> {
        Ok(Value::Host(Tensor::new(dtype, shape, bytes::Bytes::from(vec![0u8; nbytes as usize]))?))
    }

    fn read(&mut self, v: &Value, start: usize, dtype: DType, shape: Vec<usize>) -> Result<Tensor> {
        let t = v.host_bytes().ok_or_else(|| host_only("a read"))?;
        let n = crate::tensor::byte_size(dtype, &shape)? as usize;
        if start == 0 && n == t.data.len() && dtype == t.dtype && shape == t.shape {
            return Ok(t.clone());
        }
        Tensor::new(dtype, shape, t.data.slice(start..start + n))
    }

    fn write(&mut self, dst: &mut Value, at: usize, bytes: &[u8]) -> Result<()> {
        match dst {
            Value::Host(t) => {
                write_bytes(t, at, bytes);
                Ok(())
            }
            Value::Device { .. } => Err(host_only("a write")),
        }
    }

    fn copy(&mut self, src: &Value, from: usize, dst: &mut Value, to: usize, n: usize) -> Result<()> {
        let bytes = src.host_bytes().ok_or_else(|| host_only("a copy"))?.data.slice(from..from + n);
        self.write(dst, to, &bytes)
    }

    fn read_start(&mut self, v: &Value) -> Result<PendingRead> {
        Ok(PendingRead::Host(v.host_bytes().ok_or_else(|| host_only("a read"))?.clone()))
    }

    fn read_finish(&mut self, p: PendingRead) -> Result<Tensor> {
        match p {
            PendingRead::Host(t) => Ok(t),
            PendingRead::Device { .. } => Err(host_only("a read")),
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }

    fn memory(&self) -> Option<DeviceMemory> {
        None
    }
}

impl Backend for Gpu {
    fn device(&self) -> Device {
        Device::Cuda(self.info.ordinal)
    }

    fn gpu(&mut self) -> Option<&mut Gpu> {
        Some(self)
    }

    fn gpu_ref(&self) -> Option<&Gpu> {
        Some(self)
    }

    fn place(&mut self, v: &Value) -> Result<Value> {
        match v {
            Value::Host(t) => {
                let b = self.upload(t)?;
                Ok(Value::Device {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    ptr: b.ptr,
                    nbytes: t.data.len() as u64,
                    owned: Some(b),
                    host: Some(t.clone()),
                    paged: None,
                })
            }
            other => Ok(other.clone_ref()),
        }
    }

    fn duplicate(&mut self, v: &Value) -> Result<Value> {
        v.check_row_major("a copy")?;
        let b = self.alloc.alloc(v.nbytes())?;
        let mut out = Value::Device {
            dtype: v.dtype(),
            shape: v.shape().to_vec(),
            ptr: b.ptr,
            nbytes: v.nbytes(),
            owned: Some(b),
            host: None,
            paged: None,
        };
        Backend::copy(self, v, 0, &mut out, 0, v.nbytes() as usize)?;
        Ok(out)
    }

    fn zeros(&mut self, dtype: DType, shape: Vec<usize>, nbytes: u64) -> Result<Value> {
        let b = self.zeroed(nbytes)?;
        Ok(Value::Device { dtype, shape, ptr: b.ptr, nbytes, owned: Some(b), host: None, paged: None })
    }

    fn read(&mut self, v: &Value, start: usize, dtype: DType, shape: Vec<usize>) -> Result<Tensor> {
        v.check_row_major("a read")?;
        let n = crate::tensor::byte_size(dtype, &shape)? as usize;
        match v {
            Value::Device { ptr, host: None, .. } => self.download(ptr + start as u64, dtype, shape, n),
            _ => CpuBackend.read(v, start, dtype, shape),
        }
    }

    fn write(&mut self, dst: &mut Value, at: usize, bytes: &[u8]) -> Result<()> {
        dst.check_row_major("a write")?;
        match dst {
            Value::Device { ptr, host, .. } => {
                // The host copy would go stale.
                *host = None;
                self.upload_into(*ptr + at as u64, bytes)
            }
            Value::Host(_) => Err(Error::Device("a write into a host value in a GPU session".into())),
        }
    }

    fn copy(&mut self, src: &Value, from: usize, dst: &mut Value, to: usize, n: usize) -> Result<()> {
        src.check_row_major("a copy")?;
        dst.check_row_major("a copy")?;
        let Value::Device { ptr: dp, host, .. } = dst else {
            return Err(Error::Device("a copy into a host value in a GPU session".into()));
        };
        *host = None;
        let dst = *dp + to as u64;
        match src {
            Value::Device { ptr, .. } => Gpu::copy(self, dst, ptr + from as u64, n as u64),
            Value::Host(t) => self.upload_into(dst, &t.data[from..from + n]),
        }
    }

    fn read_start(&mut self, v: &Value) -> Result<PendingRead> {
        v.check_row_major("a read")?;
        match v {
            Value::Device { ptr, nbytes, dtype, shape, host: None, .. } => Ok(PendingRead::Device {
                download: self.download_start(*ptr, *nbytes as usize)?,
                dtype: *dtype,
                shape: shape.clone(),
            }),
            _ => CpuBackend.read_start(v),
        }
    }

    fn read_finish(&mut self, p: PendingRead) -> Result<Tensor> {
        match p {
            PendingRead::Host(t) => Ok(t),
            PendingRead::Device { download, dtype, shape } => {
                let bytes = self.download_finish(download)?;
                Tensor::new(dtype, shape, bytes.into())
            }
        }
    }

    fn synchronize(&mut self) -> Result<()> {
        Gpu::synchronize(self)
    }

    fn memory(&self) -> Option<DeviceMemory> {
        let s = self.alloc.stats();
        Some(DeviceMemory {
            in_use_bytes: s.in_use_bytes,
            cached_bytes: s.cached_bytes,
            peak_bytes: s.peak_bytes,
            vmm_reserved_bytes: s.vmm_reserved_bytes,
            vmm_mapped_bytes: s.vmm_mapped_bytes,
        })
    }
}

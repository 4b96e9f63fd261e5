//! A value during a run: a tensor's bytes on the host, or a buffer on the device.

use std::sync::Arc;

use kiln_kernel_abi::wire::Paged;
use kiln_kernel_abi::DType;

use crate::cuda::DevBuffer;
use crate::Tensor;

/// A value during a run: host bytes, or a device buffer (owned by the value, or resident).
#[derive(Debug)]
pub(crate) enum Value {
    Host(Tensor),
    Device {
        dtype: DType,
        shape: Vec<usize>,
        ptr: cudarc::driver::sys::CUdeviceptr,
        /// Logical size in bytes.
        nbytes: u64,
        /// The buffer, when this value owns it (freed to the pool with the value).
        owned: Option<DevBuffer>,
        /// The host bytes, when the value came from the host.
        host: Option<Tensor>,
        /// The layout, when the value is paged rather than row-major (a view of a paged KV
        /// cache, ABI.md §6.1.1): only kernels of ops that declare it read or write it, never a
        /// host copy.
        paged: Option<Arc<Paged>>,
    },
}

impl Value {
    pub fn dtype(&self) -> DType {
        match self {
            Value::Host(t) => t.dtype,
            Value::Device { dtype, .. } => *dtype,
        }
    }

    pub fn shape(&self) -> &[usize] {
        match self {
            Value::Host(t) => &t.shape,
            Value::Device { shape, .. } => shape,
        }
    }

    /// Logical size in bytes.
    pub fn nbytes(&self) -> u64 {
        match self {
            Value::Host(t) => t.data.len() as u64,
            Value::Device { nbytes, .. } => *nbytes,
        }
    }

    pub fn is_device(&self) -> bool {
        matches!(self, Value::Device { .. })
    }

    /// The host bytes, when the value has them without a download.
    pub fn host_bytes(&self) -> Option<&Tensor> {
        match self {
            Value::Host(t) | Value::Device { host: Some(t), .. } => Some(t),
            Value::Device { host: None, .. } => None,
        }
    }

    /// The device address (`None`: a host value).
    pub fn device_ptr(&self) -> Option<cudarc::driver::sys::CUdeviceptr> {
        match self {
            Value::Device { ptr, .. } => Some(*ptr),
            Value::Host(_) => None,
        }
    }

    /// The paged layout of a device value (`None`: row-major, or a host value).
    pub fn paged(&self) -> Option<&Arc<Paged>> {
        match self {
            Value::Device { paged, .. } => paged.as_ref(),
            Value::Host(_) => None,
        }
    }

    /// Errors when the value is paged: `what` (a copy, a read) needs row-major bytes.
    pub fn check_row_major(&self, what: &str) -> crate::Result<()> {
        match self.paged() {
            Some(_) => Err(crate::Error::Unsupported(format!(
                "{what} of a paged tensor (a paged KV cache's view): only the kernels of ops that declare it read \
                 or write it"
            ))),
            None => Ok(()),
        }
    }

    /// The same value without ownership of its buffer.
    pub fn clone_ref(&self) -> Value {
        match self {
            Value::Host(t) => Value::Host(t.clone()),
            Value::Device { dtype, shape, ptr, nbytes, host, paged, .. } => Value::Device {
                dtype: *dtype,
                shape: shape.clone(),
                ptr: *ptr,
                nbytes: *nbytes,
                owned: None,
                host: host.clone(),
                paged: paged.clone(),
            },
        }
    }
}

//! Launch plans: what a shim's dispatch asked the device to do, as pure data. The sandbox
//! records them (its `launch`, `gemm` and `conv` imports, checked against [`LaunchLimits`] and the call's
//! tensors); device backends run them. A tensor argument is a *slot* of the call (inputs, then
//! outputs, then scratch, in order) plus a byte offset, never a device pointer: the backend turns
//! slots into pointers at the last moment, so a memoized plan runs with any buffers of the same
//! sizes.

use alloc::string::String;
use alloc::vec::Vec;

use crate::wire::{Conv, Gemm, KernelArg};

/// Device limits of a kernel launch (CUDA: `cudaDeviceProp`); the defaults are those of
/// every GPU since compute capability 3.0 and 48 KiB of shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "manifest", derive(serde::Serialize))]
pub struct LaunchLimits {
    pub max_threads_per_block: u32,
    pub max_block: [u32; 3],
    pub max_grid: [u32; 3],
    /// Dynamic shared memory per block, bytes: the device's opt-in maximum
    /// (`CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`, 227 KiB on compute capability
    /// 9.0), which the kernel's static shared memory shares.
    pub max_shared_mem_bytes: u32,
}

impl Default for LaunchLimits {
    fn default() -> Self {
        LaunchLimits {
            max_threads_per_block: 1024,
            max_block: [1024, 1024, 64],
            max_grid: [i32::MAX as u32, 65535, 65535],
            max_shared_mem_bytes: 48 << 10,
        }
    }
}

/// A kernel argument of a recorded launch: a tensor is a slot of the call (inputs, then
/// outputs, then scratch, in order) plus a byte offset.
#[derive(Clone, Debug, PartialEq)]
pub enum PlanArg {
    Tensor { slot: usize, offset: u64 },
    Scalar(KernelArg),
}

/// One recorded step of a dispatch.
#[derive(Clone, Debug, PartialEq)]
pub enum PlanStep {
    Launch {
        kernel: String,
        grid: [u32; 3],
        block: [u32; 3],
        shared_mem_bytes: u32,
        args: Vec<PlanArg>,
    },
    /// Operand handles are rewritten to slot indices.
    Gemm(Gemm),
    /// One convolution through the device's library (cuDNN), operand handles rewritten to slot
    /// indices; recorded only where the host said it serves the descriptor (ABI.md §4.8).
    Conv(Conv),
}

/// What a dispatch asked for: scratch sizes (slots after the outputs) and steps, in order.
/// A pure function of the node and its shapes, so the host can memoize it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LaunchPlan {
    pub scratch_bytes: Vec<u64>,
    pub steps: Vec<PlanStep>,
}

//! One CUDA device as the process shares it: every session on device `ordinal` holds the same
//! [`Device`] ([`Device::open`]), so they share its context, its compute stream and copy
//! stream, its memory pool, its loaded modules (each package's kernels are compiled and loaded
//! once per process), its cuBLASLt handle and its cuDNN handle. The server and Python hold several sessions; with
//! one stream, a block freed by one session is reused by another only behind the freeing work,
//! as within one session.
//!
//! A capture records everything enqueued on its stream, from any thread. So work reaches the
//! compute stream only through [`Device::enqueue`], which waits while another thread captures
//! ([`Device::capturing`]): a session's capture never takes in another session's launches.
//! Captures are thread-local (`CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`), which ignores other
//! threads' allocations and frees, so those need no gate. An `Enqueue` guard is held for one
//! enqueue, but across a synchronous transfer's wait too (`Gpu::upload`, `Gpu::download`): other
//! sessions' enqueues wait meanwhile; the decode loop's reads (`Readbacks`) wait without it.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::thread::ThreadId;

use cudarc::driver::{CudaContext, CudaStream};

use super::{open_context, Blas, DeviceInfo, Dnn, KernelCache, Pool, Transfers};
use crate::{Error, Result};

/// The devices this process has open, by ordinal; an entry lives while a session holds it.
static OPEN: Mutex<Vec<(usize, Weak<Device>)>> = Mutex::new(Vec::new());

/// A shared CUDA device: context (event tracking off), streams, pool, module cache, cuBLASLt,
/// cuDNN.
pub struct Device {
    pub info: DeviceInfo,
    stream: Arc<CudaStream>,
    /// The thread capturing on `stream`, if any; `capture_ended` wakes the threads it kept
    /// waiting.
    capturer: Mutex<Option<ThreadId>>,
    capture_ended: Condvar,
    pub pool: Arc<Pool>,
    /// Loaded kernels by package (name, version and digest of its sources).
    modules: Mutex<HashMap<String, Arc<KernelCache>>>,
    transfers: Mutex<Transfers>,
    blas: Mutex<Option<Blas>>,
    /// The cuDNN handle and its convolution plans, made on first use.
    dnn: Mutex<Option<Dnn>>,
    /// Dropped last: the pool, the modules and the streams need the context.
    pub ctx: Arc<CudaContext>,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Device({} {}, {})", self.info.ordinal, self.info.name, self.info.arch)
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // Everything enqueued must finish before the pool's memory and the modules go back.
        let _ = self.ctx.bind_to_thread();
        let _ = self.stream.synchronize();
        lock(&self.blas).take();
        lock(&self.dnn).take();
        self.pool.release_cached();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Each lock guards a value that stays consistent across a panic (maps and handles).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The compute stream, held for one enqueue: while it lives no other thread can start a
/// capture, and this thread's launches go into its own capture if it has one open.
pub struct Enqueue<'a> {
    _gate: MutexGuard<'a, Option<ThreadId>>,
    stream: &'a CudaStream,
}

impl std::ops::Deref for Enqueue<'_> {
    type Target = CudaStream;
    fn deref(&self) -> &CudaStream {
        self.stream
    }
}

/// A capture in progress on this thread; dropped, other threads may enqueue again.
pub struct CaptureGate<'a> {
    device: &'a Device,
}

impl Drop for CaptureGate<'_> {
    fn drop(&mut self) {
        *lock(&self.device.capturer) = None;
        self.device.capture_ended.notify_all();
    }
}

impl Device {
    /// The process's device `ordinal`, opened on first use (context with event tracking off,
    /// streams, facts) and current on the calling thread. Errors: no driver, no such device.
    pub fn open(ordinal: usize) -> Result<Arc<Device>> {
        let mut open = lock(&OPEN);
        open.retain(|(_, d)| d.strong_count() > 0);
        if let Some(d) = open.iter().find(|(o, _)| *o == ordinal).and_then(|(_, d)| d.upgrade()) {
            d.ctx.bind_to_thread().map_err(|e| Error::Device(format!("cuCtxSetCurrent: {e}")))?;
            return Ok(d);
        }
        let (ctx, stream, info) = open_context(ordinal)?;
        let copy = ctx.new_stream().map_err(|e| Error::Device(format!("cuStreamCreate: {e}")))?;
        ctx.bind_to_thread().map_err(|e| Error::Device(format!("cuCtxSetCurrent: {e}")))?;
        let transfers = Transfers::new(copy)?;
        let d = Arc::new(Device {
            info,
            stream,
            capturer: Mutex::new(None),
            capture_ended: Condvar::new(),
            pool: Arc::default(),
            modules: Mutex::default(),
            transfers: Mutex::new(transfers),
            blas: Mutex::new(None),
            dnn: Mutex::new(None),
            ctx,
        });
        open.push((ordinal, Arc::downgrade(&d)));
        Ok(d)
    }

    /// The compute stream to enqueue on, once no other thread captures on it.
    pub fn enqueue(&self) -> Enqueue<'_> {
        let me = std::thread::current().id();
        let mut gate = lock(&self.capturer);
        while gate.is_some_and(|t| t != me) {
            gate = self.capture_ended.wait(gate).unwrap_or_else(|p| p.into_inner());
        }
        Enqueue { _gate: gate, stream: &self.stream }
    }

    /// Marks this thread as the compute stream's capturer until the gate drops (other threads'
    /// [`Device::enqueue`] wait), once no other thread captures.
    pub fn capturing(&self) -> CaptureGate<'_> {
        let me = std::thread::current().id();
        let mut gate = lock(&self.capturer);
        while gate.is_some_and(|t| t != me) {
            gate = self.capture_ended.wait(gate).unwrap_or_else(|p| p.into_inner());
        }
        *gate = Some(me);
        CaptureGate { device: self }
    }

    /// Waits for everything enqueued on the compute stream so far (by every session). The wait
    /// is on an event recorded behind that work, not on the stream: another thread may begin a
    /// capture on the stream meanwhile, and a stream that is capturing cannot be synchronized.
    pub fn synchronize(&self) -> Result<()> {
        use cudarc::driver::sys::CUevent_flags;
        let event = self
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| Error::Device(format!("cuEventCreate: {e}")))?;
        event.record(&self.enqueue()).map_err(|e| Error::Device(format!("cuEventRecord: {e}")))?;
        event.synchronize().map_err(|e| Error::Device(format!("cuEventSynchronize: {e}")))
    }

    /// The copy stream and its staging buffers.
    pub fn transfers(&self) -> MutexGuard<'_, Transfers> {
        lock(&self.transfers)
    }

    /// Runs `f` with the cuBLASLt handle, made on first use with its workspace from the pool.
    pub fn with_blas<R>(&self, f: impl FnOnce(&mut Blas) -> Result<R>) -> Result<R> {
        let mut b = lock(&self.blas);
        match b.as_mut() {
            Some(blas) => f(blas),
            None => f(b.insert(Blas::new(&self.pool, self.info.compute_capability.0)?)),
        }
    }

    /// Runs `f` with the cuDNN handle, made on first use. Errors: cuDNN not loaded (the reason),
    /// or what `f` returns.
    pub fn with_dnn<R>(&self, f: impl FnOnce(&mut Dnn) -> Result<R>) -> Result<R> {
        let mut d = lock(&self.dnn);
        match d.as_mut() {
            Some(dnn) => f(dnn),
            None => f(d.insert(Dnn::new()?)),
        }
    }

    /// GEMM plan-cache counters: (hits, heuristic queries).
    pub fn gemm_plan_stats(&self) -> (u64, u64) {
        lock(&self.blas).as_ref().map_or((0, 0), |b| (b.plan_hits, b.heuristic_queries))
    }

    /// The loaded kernels of the package `key` names, loading them with `load` on first use.
    pub fn module(&self, key: &str, load: impl FnOnce() -> Result<KernelCache>) -> Result<Arc<KernelCache>> {
        let mut m = lock(&self.modules);
        if let Some(k) = m.get(key) {
            return Ok(k.clone());
        }
        let k = Arc::new(load()?);
        m.insert(key.to_string(), k.clone());
        Ok(k)
    }
}

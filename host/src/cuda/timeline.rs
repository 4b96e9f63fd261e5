//! GPU time per node, for profiling: CUDA events recorded on the stream between nodes
//! (`cuEventRecord`), read after the run (`cuEventElapsedTime`). A span is the GPU time from
//! the end of the previous node's work to the end of this node's; when the host falls behind,
//! the idle time before a node's first kernel counts in its span.

use cudarc::driver::result::event;
use cudarc::driver::sys::{CUevent, CUevent_flags};
use cudarc::driver::CudaStream;

use crate::{Error, Result};

/// Events recorded in order on one stream; reused from run to run.
#[derive(Default)]
pub struct Timeline {
    events: Vec<CUevent>,
    used: usize,
}

// SAFETY: CUDA event handles are driver objects of the process, usable from any thread with
// their context current (cudarc's own `CudaEvent` is Send for the same reason); a timeline is
// only used through `&mut`, by one thread at a time.
unsafe impl Send for Timeline {}

impl Timeline {
    /// Records the next event on `stream`.
    pub fn mark(&mut self, stream: &CudaStream) -> Result<()> {
        if self.used == self.events.len() {
            let e = event::create(CUevent_flags::CU_EVENT_DEFAULT)
                .map_err(|e| Error::Device(format!("cuEventCreate: {e}")))?;
            self.events.push(e);
        }
        // SAFETY: a live event and stream of the current context.
        unsafe { event::record(self.events[self.used], stream.cu_stream()) }
            .map_err(|e| Error::Device(format!("cuEventRecord: {e}")))?;
        self.used += 1;
        Ok(())
    }

    /// Forgets the marks recorded so far (a run that failed half-way left some).
    pub fn reset(&mut self) {
        self.used = 0;
    }

    /// Milliseconds between consecutive marks (one fewer than the marks); the caller has
    /// synchronized the stream. Starts a new timeline.
    pub fn spans_ms(&mut self) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(self.used.saturating_sub(1));
        for w in self.events[..self.used].windows(2) {
            // SAFETY: both events were recorded and have completed.
            out.push(
                unsafe { event::elapsed(w[0], w[1]) }.map_err(|e| Error::Device(format!("cuEventElapsedTime: {e}")))?,
            );
        }
        self.used = 0;
        Ok(out)
    }
}

impl Drop for Timeline {
    fn drop(&mut self) {
        for e in self.events.drain(..) {
            // SAFETY: created here, destroyed once.
            let _ = unsafe { event::destroy(e) };
        }
    }
}

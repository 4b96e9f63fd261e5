//! The capture manager: when an execution plan is captured into a CUDA graph, replayed, updated
//! or run eagerly instead, and why, as onnxruntime's CUDA EP keeps graphs per annotation id and
//! llama.cpp keeps one per decode shape, but with every fallback counted and its reason kept
//! (never disabled silently).
//!
//! A plan is one *region* (the whole graph between a run's start and its end; a plan with a
//! seam is not captured at all). Its [`CaptureState`] holds the instantiated graph and the
//! buffer addresses it was captured with (the *bindings*: the fed and bound tensors). A run
//! whose bindings match replays; one whose bindings differ re-captures and tries
//! `cuGraphExecUpdate` before instantiating again. When more than [`RECAPTURE_BUDGET`] runs in
//! a row each had to re-capture (no run replaying the graph as it was between them), the region
//! stops capturing and runs eagerly, with that reason reported. Runs that cannot use a plan at
//! all (inputs fed from the host, outputs not bound, a seam, profiling) run node by node and are
//! counted by reason; with `--graph on` a seam is an error.

use serde::Serialize;

use crate::cuda::GraphExec;

/// Whether runs that can be captured are (`--graph`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GraphMode {
    /// Never capture: execution plans run eagerly.
    Off,
    /// Capture; a run that should be captured but cannot is an error naming the reason.
    On,
    /// Capture where possible; otherwise run eagerly and count the reason.
    #[default]
    Auto,
}

/// Whether kernels that packages declare PDL-safe are launched with programmatic dependent
/// launch (`--pdl`): each may then start, and load its weights, while the kernel before it
/// ends. Eager launches and captured graphs alike.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PdlMode {
    /// Plain launches.
    Off,
    /// PDL launches; a device without it (compute capability below 9.0, or a driver before
    /// CUDA 12.3) is an error.
    On,
    /// PDL launches where the device has them.
    #[default]
    Auto,
}

/// Re-captures in a row (bindings changed every run) that a region may make; one more and it
/// runs eagerly.
pub const RECAPTURE_BUDGET: u32 = 4;

/// Why a planned run did not replay a graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// `--graph off`.
    GraphsOff,
    /// The driver refused the capture or the instantiation.
    CaptureFailed(String),
    /// Bindings changed on more than [`RECAPTURE_BUDGET`] runs in a row.
    RecaptureBudget,
}

impl Fallback {
    /// The report's key: the kind of reason, without the driver's text.
    pub fn key(&self) -> &'static str {
        match self {
            Fallback::GraphsOff => "graphs off",
            Fallback::CaptureFailed(_) => "capture failed",
            Fallback::RecaptureBudget => "re-capture budget exhausted",
        }
    }
}

impl std::fmt::Display for Fallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fallback::GraphsOff => f.write_str("graphs are off (--graph off)"),
            Fallback::CaptureFailed(s) => write!(f, "capture failed: {s}"),
            Fallback::RecaptureBudget => write!(
                f,
                "the bindings changed on more than {RECAPTURE_BUDGET} runs in a row; the region runs eagerly from now on"
            ),
        }
    }
}

/// The graph of one region and what it was captured with.
#[derive(Default)]
pub struct CaptureState {
    pub exec: Option<GraphExec>,
    /// Device addresses of the fed and bound tensors at capture.
    pub bindings: Vec<u64>,
    /// Runs in a row that re-captured (reset by a run that replays the graph as it is).
    pub recaptures_in_a_row: u32,
    /// Set once the region stops capturing, with the reason.
    pub disabled: Option<Fallback>,
}

impl CaptureState {
    /// Whether the graph can be replayed with `bindings` as it is.
    pub fn replayable(&self, bindings: &[u64]) -> bool {
        self.exec.is_some() && self.bindings == bindings
    }
}

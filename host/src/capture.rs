//! The capture manager: when an execution plan is captured into a CUDA graph, replayed, updated
//! or run eagerly instead, and why, as onnxruntime's CUDA EP keeps graphs per annotation id and
//! llama.cpp keeps one per decode shape, but with every fallback counted and its reason kept
//! (never disabled silently).
//!
//! A plan is one *region* (the whole graph between a run's start and its end; a plan with a
//! seam is not captured at all). Its [`CaptureState`] holds the instantiated graph and the
//! buffer addresses it was captured with (the *bindings*: the fed and bound tensors). A run
//! whose bindings match replays; one whose bindings differ re-captures and tries
//! `cuGraphExecUpdate` before instantiating again. After [`RECAPTURE_BUDGET`] runs in a row
//! that each had to re-capture (no run replaying the graph as it was between them), the region
//! stops capturing and runs eagerly, with that reason reported.

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

/// Re-captures in a row (bindings changed every run) after which a region runs eagerly.
pub const RECAPTURE_BUDGET: u32 = 4;

/// Why a run that was eligible for a plan did not replay a graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// `--graph off`.
    GraphsOff,
    /// Per-op GPU profiling needs events between nodes.
    Profiling,
    /// The plan has a seam: a node's input had to come back to the host, or an output is not
    /// written in place. The text names the node.
    Seam(String),
    /// The driver refused the capture or the instantiation.
    CaptureFailed(String),
    /// Bindings changed on [`RECAPTURE_BUDGET`] runs in a row.
    RecaptureBudget,
}

impl Fallback {
    /// The report's key: the kind of reason, without the node or driver text.
    pub fn key(&self) -> &'static str {
        match self {
            Fallback::GraphsOff => "graphs off",
            Fallback::Profiling => "profiling",
            Fallback::Seam(_) => "seam",
            Fallback::CaptureFailed(_) => "capture failed",
            Fallback::RecaptureBudget => "re-capture budget exhausted",
        }
    }
}

impl std::fmt::Display for Fallback {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fallback::GraphsOff => f.write_str("graphs are off (--graph off)"),
            Fallback::Profiling => f.write_str("per-op GPU profiling runs every node eagerly"),
            Fallback::Seam(s) => write!(f, "seam: {s}"),
            Fallback::CaptureFailed(s) => write!(f, "capture failed: {s}"),
            Fallback::RecaptureBudget => write!(
                f,
                "the bindings changed on {RECAPTURE_BUDGET} runs in a row; the region runs eagerly from now on"
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

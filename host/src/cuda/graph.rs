//! CUDA graphs as owned values (CUDA driver API, "Graph Management" and "Stream Management"):
//! [`capture`] records what a closure enqueues on a stream into a [`Captured`] graph
//! (`cuStreamBeginCapture` in thread-local mode, `cuStreamEndCapture`), which
//! [`Captured::instantiate`] turns into a launchable [`GraphExec`] (`cuGraphInstantiate`).
//! A `GraphExec` replays with [`GraphExec::launch`] (`cuGraphLaunch`), and takes a newly
//! captured graph of the same topology with [`GraphExec::update`] (`cuGraphExecUpdate`), which
//! costs far less than instantiating again. Dropping either value destroys what it owns, so an
//! error path cannot leak a graph.
//!
//! Nothing may allocate, free or synchronize on the capturing thread while a capture is open:
//! the driver then fails the capture (thread-local mode), and [`capture`] returns that error.

use std::time::{Duration, Instant};

use cudarc::driver::sys::{
    self, CUgraph, CUgraphExec, CUgraphExecUpdateResult, CUgraphExecUpdateResultInfo, CUgraphNode, CUgraphNodeType,
    CUstream, CUstreamCaptureMode,
};

use crate::{Error, Result};

fn check(what: &str, r: sys::CUresult) -> Result<()> {
    r.result().map_err(|e| Error::Device(format!("{what}: {e}")))
}

/// A captured graph (`CUgraph`), destroyed on drop.
pub struct Captured {
    graph: CUgraph,
    /// Wall time of the capture (the closure's enqueueing included).
    pub capture_time: Duration,
}

// SAFETY: a CUgraph is a handle of the context, used only through `&mut`/owned access.
unsafe impl Send for Captured {}

impl Drop for Captured {
    fn drop(&mut self) {
        if !self.graph.is_null() {
            // SAFETY: the graph was created by `cuStreamEndCapture` and is destroyed once.
            let _ = unsafe { sys::cuGraphDestroy(self.graph) };
        }
    }
}

/// Records the work `body` enqueues on `stream` (which must belong to the current context and
/// not be capturing). Returns the graph, or `body`'s error, or the driver's when the capture
/// was invalidated (an allocation, a synchronization or an uncapturable call inside it).
pub(crate) fn capture(stream: CUstream, body: impl FnOnce() -> Result<()>) -> Result<Captured> {
    let t0 = Instant::now();
    // SAFETY: a live stream of the current context; the capture is always ended below.
    check("cuStreamBeginCapture", unsafe {
        sys::cuStreamBeginCapture_v2(stream, CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
    })?;
    let ran = body();
    let mut graph: CUgraph = std::ptr::null_mut();
    // SAFETY: ends the capture begun above; `graph` receives the new graph or stays null.
    let ended = check("cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(stream, &mut graph) });
    let captured = Captured { graph, capture_time: t0.elapsed() };
    ran?;
    ended?;
    if captured.graph.is_null() {
        return Err(Error::Device("cuStreamEndCapture returned no graph".into()));
    }
    Ok(captured)
}

impl Captured {
    /// Number of nodes (kernels, memcpys, memsets, library kernels included).
    pub fn node_count(&self) -> Result<usize> {
        let mut n = 0usize;
        // SAFETY: a live graph; with a null node array the driver only writes the count.
        check("cuGraphGetNodes", unsafe { sys::cuGraphGetNodes(self.graph, std::ptr::null_mut(), &mut n) })?;
        Ok(n)
    }

    /// The graph's nodes by type (`cuGraphGetNodes`, `cuGraphNodeGetType`): a decode step's
    /// kernels per token, library kernels (cuBLASLt's, split-K reductions) included.
    pub fn node_kinds(&self) -> Result<NodeKinds> {
        let mut n = self.node_count()?;
        let mut nodes: Vec<CUgraphNode> = vec![std::ptr::null_mut(); n];
        // SAFETY: a live graph; `nodes` has room for the `n` nodes the driver writes.
        check("cuGraphGetNodes", unsafe { sys::cuGraphGetNodes(self.graph, nodes.as_mut_ptr(), &mut n) })?;
        nodes.truncate(n);
        let mut kinds = NodeKinds::default();
        for node in nodes {
            // Read as a plain u32: a newer driver may return a type this binding's enum lacks.
            let mut t: u32 = u32::MAX;
            // SAFETY: a node of the live graph; the driver writes one 32-bit enumerator.
            check("cuGraphNodeGetType", unsafe {
                sys::cuGraphNodeGetType(node, (&mut t as *mut u32).cast::<CUgraphNodeType>())
            })?;
            match t {
                t if t == CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL as u32 => kinds.kernels += 1,
                t if t == CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMSET as u32 => kinds.memsets += 1,
                t if t == CUgraphNodeType::CU_GRAPH_NODE_TYPE_MEMCPY as u32 => kinds.memcpys += 1,
                _ => kinds.other += 1,
            }
        }
        Ok(kinds)
    }

    /// Instantiates the graph; the returned value owns both the graph and its executable.
    pub fn instantiate(self) -> Result<GraphExec> {
        let nodes = self.node_count()?;
        // Statistics only: a failure to read the types leaves them zero rather than the graph off.
        let kinds = self.node_kinds().unwrap_or_default();
        let t0 = Instant::now();
        let mut exec: CUgraphExec = std::ptr::null_mut();
        // SAFETY: a live graph; `exec` receives the executable (owned by the value returned).
        check("cuGraphInstantiate", unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, self.graph, 0) })?;
        Ok(GraphExec { exec, graph: self, nodes, kinds, instantiate_time: t0.elapsed() })
    }
}

/// Nodes of a graph by type.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct NodeKinds {
    /// Kernel nodes: kiln's packages' kernels and the libraries' (cuBLASLt, cuDNN).
    pub kernels: usize,
    pub memsets: usize,
    pub memcpys: usize,
    /// Every other type (events, empty nodes, child graphs).
    pub other: usize,
}

/// An instantiated graph (`CUgraphExec`) and the graph it came from; both destroyed on drop.
/// The caller keeps the stream's pending launches finished before dropping it.
pub struct GraphExec {
    exec: CUgraphExec,
    graph: Captured,
    /// Nodes of the graph.
    pub nodes: usize,
    /// The nodes by type.
    pub kinds: NodeKinds,
    /// Wall time of the instantiation.
    pub instantiate_time: Duration,
}

// SAFETY: as for `Captured`.
unsafe impl Send for GraphExec {}

impl Drop for GraphExec {
    fn drop(&mut self) {
        // SAFETY: created by cuGraphInstantiate and destroyed once; the graph is destroyed after
        // (by `Captured`'s drop).
        let _ = unsafe { sys::cuGraphExecDestroy(self.exec) };
    }
}

impl GraphExec {
    /// Uploads the executable's resources ahead of the first launch (`cuGraphUpload`).
    pub(crate) fn upload(&self, stream: CUstream) -> Result<()> {
        // SAFETY: live executable and stream.
        check("cuGraphUpload", unsafe { sys::cuGraphUpload(self.exec, stream) })
    }

    /// Enqueues one replay on `stream`.
    pub(crate) fn launch(&self, stream: CUstream) -> Result<()> {
        // SAFETY: live executable and stream.
        check("cuGraphLaunch", unsafe { sys::cuGraphLaunch(self.exec, stream) })
    }

    /// Takes `graph`'s parameters (kernel arguments, copy addresses) into this executable when
    /// the topology is the same (`cuGraphExecUpdate`). `Ok(Ok(()))`: updated, `graph` kept as
    /// this executable's graph. `Ok(Err((graph, reason)))`: the driver refused (the topology or
    /// a node type changed); the executable is unchanged and `graph` is handed back.
    pub fn update(&mut self, graph: Captured) -> Result<std::result::Result<(), (Captured, String)>> {
        let mut info = CUgraphExecUpdateResultInfo {
            result: CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_SUCCESS,
            errorNode: std::ptr::null_mut(),
            errorFromNode: std::ptr::null_mut(),
        };
        // SAFETY: live executable and graph; `info` is written by the driver.
        let r = unsafe { sys::cuGraphExecUpdate_v2(self.exec, graph.graph, &mut info) };
        if r == sys::CUresult::CUDA_SUCCESS && info.result == CUgraphExecUpdateResult::CU_GRAPH_EXEC_UPDATE_SUCCESS {
            self.graph = graph;
            return Ok(Ok(()));
        }
        if r != sys::CUresult::CUDA_SUCCESS && r != sys::CUresult::CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE {
            check("cuGraphExecUpdate", r)?;
        }
        Ok(Err((graph, format!("{:?}", info.result))))
    }
}

//! Run metrics: what `--report` prints and `--report-json` writes.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

/// Time and count of one op type.
#[derive(Clone, Debug, Default, Serialize)]
pub struct OpStat {
    pub nodes: u64,
    /// Wall time in microseconds, shim calls included.
    pub time_us: u64,
    /// GPU time in microseconds, when profiling (see `Session::set_gpu_profiling`).
    pub gpu_us: f64,
    /// Of `time_us`: microseconds inside the package's `kiln_cpu` calls (the call's encoding, the
    /// Wasm code and its imports); the rest is the session's own work around the node
    /// (resolution, shape inference, values).
    pub shim_us: f64,
    /// Of `shim_us`: microseconds in the products the host computes for `kiln_cpu` calls (the
    /// `gemm`, `qgemm` and `conv` imports, on the CPU pool).
    pub host_compute_us: f64,
}

/// Shim export calls, by export.
#[derive(Clone, Debug, Default, Serialize)]
pub struct WasmCalls {
    pub infer: u64,
    pub cpu: u64,
    /// Of `cpu`: calls that computed one tile of a node split over the CPU pool's threads
    /// (ABI.md §6.1.2).
    pub cpu_tiles: u64,
    pub dispatch: u64,
}

/// Counts of one or more runs of a session.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Report {
    pub device: String,
    pub runs: u64,
    /// Nodes executed, over all runs.
    pub nodes: u64,
    pub wasm_calls: WasmCalls,
    /// Nodes run per package (`name@version`).
    pub packages: BTreeMap<String, u64>,
    pub ops: BTreeMap<String, OpStat>,
    /// Shim instances created (a failed call discards its instance).
    pub instances: u64,
    pub run_time_us: u64,
    /// Kernel launches and GEMMs enqueued on a GPU.
    pub launches: u64,
    /// GPU nodes whose launch plan came from the memo (no Wasm call).
    pub plan_hits: u64,
    /// Launch-plan steps recorded by checked dispatches (`SessionOptions::check_dispatch`).
    pub dispatch_steps: u64,
    /// CPU outputs bound in place to an input's buffer that started as its bytes, the shim told
    /// so (ABI.md §7.8: a KV cache's present over its past).
    pub cpu_in_place: u64,
    /// Of those, outputs that took over their input's buffer itself, without a copy (packages of
    /// manifest schema 18, where nothing else held the input's bytes).
    pub cpu_in_place_shared: u64,
    /// Nodes whose package has no GPU dispatch for them, by op.
    pub dispatch_unsupported: BTreeMap<String, u64>,
    /// Execution plans and CUDA graphs.
    pub graphs: GraphStats,
    /// Fusions applied at load, and matches a constraint turned down.
    pub fusions: Fusions,
    /// kiln's device memory after the last run (GPU sessions).
    pub device_memory: Option<DeviceMemory>,
    /// If, Loop and Scan nodes: their bodies' runs (whose nodes count above too).
    pub control_flow: ControlFlowStats,
    /// Convolutions dispatched to the device's library (cuDNN), and those that ran the
    /// package's own kernels, with why (GPU sessions).
    pub convolutions: ConvStats,
}

/// What the `conv` import did in a GPU session's dispatches (ABI.md §4.8). Dispatches are
/// counted once per shape: later runs reuse the recorded plan.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ConvStats {
    /// The library that serves `conv` ("cuDNN 9.x.y"), or `None`.
    pub library: Option<String>,
    /// Why no library serves it (not found, turned off), when none does.
    pub unavailable: Option<String>,
    /// Convolutions recorded as library calls.
    pub library_dispatches: u64,
    /// Of those, convolutions that compute channels-last in the last execution plan built
    /// (`ep::layout`).
    pub channels_last: u64,
    /// Convolutions that ran the package's own kernels, by reason.
    pub fallbacks: BTreeMap<String, u64>,
}

impl ConvStats {
    /// `convolutions: …` lines; empty when no convolution was dispatched.
    pub fn render(&self) -> String {
        let fallbacks: u64 = self.fallbacks.values().sum();
        if self.library_dispatches == 0 && fallbacks == 0 {
            return String::new();
        }
        let lib = match (&self.library, &self.unavailable) {
            (Some(l), _) => l.clone(),
            (None, Some(why)) => format!("no library ({why})"),
            (None, None) => "no library".into(),
        };
        let mut s = format!(
            "convolutions: {} through {lib}, {fallbacks} on the packages' own kernels\n",
            self.library_dispatches
        );
        if self.channels_last > 0 {
            s += &format!(
                "  {} compute channels-last in the execution plan (the values only convolutions read stay NHWC)\n",
                self.channels_last
            );
        }
        for (why, n) in &self.fallbacks {
            s += &format!("  {n} on the package's kernels: {why}\n");
        }
        s
    }
}

/// What control-flow nodes did, over all runs.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ControlFlowStats {
    /// Body runs (an If's branch, one Loop or Scan iteration).
    pub subgraph_runs: u64,
    /// Loop and Scan iterations.
    pub iterations: u64,
    /// Device values control-flow nodes read on the host (a condition, a trip count, a loop's
    /// state): each a seam that waits for the device.
    pub host_reads: u64,
}

/// The device memory of a session, in bytes: the pool blocks it holds, the blocks the device's
/// pool caches for reuse (every session's on that device), and the most it ever held.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DeviceMemory {
    /// The session's pool blocks in use.
    pub in_use_bytes: u64,
    /// Free blocks the device's pool (shared by the process's sessions on it) keeps for reuse.
    pub cached_bytes: u64,
    /// The most the session held at once: its pool blocks and its mapped bytes together.
    pub peak_bytes: u64,
    /// Addresses reserved for KV caches (VMM; no memory behind them until mapped).
    pub vmm_reserved_bytes: u64,
    /// Device memory mapped into those addresses.
    pub vmm_mapped_bytes: u64,
}

/// What the fusion pass did to the model (`fuse`).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Fusions {
    /// Whether fusion ran (`--no-fuse` turns it off).
    pub enabled: bool,
    pub applied: Vec<FusionApplied>,
    pub rejected: Vec<FusionRejected>,
}

/// One rewritten match.
#[derive(Clone, Debug, Serialize)]
pub struct FusionApplied {
    pub fusion: String,
    /// `name@version` of the declaring package.
    pub package: String,
    /// The matched nodes, in pattern order.
    pub nodes: Vec<String>,
}

/// A complete match that was not rewritten, and why.
#[derive(Clone, Debug, Serialize)]
pub struct FusionRejected {
    pub fusion: String,
    pub package: String,
    pub nodes: Vec<String>,
    pub reason: String,
}

impl Fusions {
    /// `fusions: …` lines: each applied fusion with its count and first match, each rejected
    /// match with its reason.
    pub fn render(&self) -> String {
        if !self.enabled {
            return "fusions: off (--no-fuse)\n".into();
        }
        let mut s = format!("fusions: {} applied, {} rejected\n", self.applied.len(), self.rejected.len());
        for (name, n) in self.applied_counts() {
            let a = self.applied.iter().find(|a| a.fusion == name).map(|a| (&a.package, a.nodes.join(" + ")));
            if let Some((pkg, nodes)) = a {
                s += &format!("  {name} ({pkg}) ×{n}; the first one fused {nodes}\n");
            }
        }
        // Rejections grouped by fusion and reason (an LLM repeats one per layer).
        let mut groups: Vec<(&FusionRejected, usize)> = Vec::new();
        for r in &self.rejected {
            let shape = |x: &FusionRejected| x.reason.split(" (").next().unwrap_or("").to_string();
            match groups.iter_mut().find(|(g, _)| g.fusion == r.fusion && shape(g) == shape(r)) {
                Some((_, n)) => *n += 1,
                None => groups.push((r, 1)),
            }
        }
        for (r, n) in groups {
            let more = if n > 1 { format!(" (×{n}, first)") } else { String::new() };
            s += &format!("  rejected {} ({}){more} at {}: {}\n", r.fusion, r.package, r.nodes.join(", "), r.reason);
        }
        s
    }

    /// Applied fusions counted by name, for one-line summaries.
    pub fn applied_counts(&self) -> BTreeMap<&str, usize> {
        let mut m = BTreeMap::new();
        for a in &self.applied {
            *m.entry(a.fusion.as_str()).or_insert(0) += 1;
        }
        m
    }
}

/// Counters of plans and graphs, for `--report`. Times in microseconds.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GraphStats {
    /// Execution plans built (one per shape signature and output selection).
    pub plans_built: u64,
    /// First runs of new plans, run eagerly (they warm up the libraries' lazily loaded
    /// kernels; later runs are captured). Not fallbacks.
    pub first_runs: u64,
    /// Bytes of the plans' arenas (intermediates and scratch), all plans together.
    pub arena_bytes: u64,
    pub captures: u64,
    /// Graph launches.
    pub replays: u64,
    /// Re-captures because the bindings changed, of which `updates` took `cuGraphExecUpdate`.
    pub recaptures: u64,
    pub updates: u64,
    /// Runs of a plan without a graph, by reason (`Fallback::key`).
    pub fallbacks: BTreeMap<String, u64>,
    /// The last fallback's full reason.
    pub last_fallback: Option<String>,
    /// Runs that could not use a plan at all, by reason (host feeds, unbound outputs, a value
    /// read back mid-run): they run node by node.
    pub unplanned: BTreeMap<String, u64>,
    pub capture_us: u64,
    pub instantiate_us: u64,
    /// Nodes of the last instantiated graph.
    pub graph_nodes: u64,
    /// Of those, kernel nodes (kiln's and the libraries' kernels: a decode graph's kernels per
    /// token), memset and memcpy nodes (`cuGraphNodeGetType`).
    pub graph_kernels: u64,
    pub graph_memsets: u64,
    pub graph_memcpys: u64,
    /// Kernel launches and GEMMs of the last plan built.
    pub plan_launches: u64,
    /// Of those, the kernels launched with programmatic dependent launch (`--pdl`).
    pub pdl_launches: u64,
}

impl GraphStats {
    /// "N captured, N replays, N fallbacks".
    pub fn counts(&self) -> String {
        format!(
            "{} captured, {} replays, {} fallbacks",
            self.captures,
            self.replays,
            self.fallbacks.values().sum::<u64>()
        )
    }

    /// Counts one fallback: `key` its kind (the report's key), `reason` the whole text.
    pub fn fallback(&mut self, key: &str, reason: String) {
        *self.fallbacks.entry(key.to_string()).or_default() += 1;
        self.last_fallback = Some(reason);
    }

    /// Lines for `--report`.
    pub fn render(&self) -> String {
        let mut s = format!(
            "graphs: {} plans ({} B arena, {} first runs eager), {} captures, {} replays, {} re-captures ({} by cuGraphExecUpdate), \
             capture {:.3} ms, instantiate {:.3} ms, {} nodes in the last graph ({} kernels, {} memsets, {} memcpys); \
             the last plan launches {} kernels and GEMMs, {} with programmatic dependent launch\n",
            self.plans_built,
            self.arena_bytes,
            self.first_runs,
            self.captures,
            self.replays,
            self.recaptures,
            self.updates,
            self.capture_us as f64 / 1e3,
            self.instantiate_us as f64 / 1e3,
            self.graph_nodes,
            self.graph_kernels,
            self.graph_memsets,
            self.graph_memcpys,
            self.plan_launches,
            self.pdl_launches
        );
        for (k, n) in &self.fallbacks {
            s += &format!("  fallback ({k}): {n} runs\n");
        }
        if let Some(r) = &self.last_fallback {
            s += &format!("  last fallback: {r}\n");
        }
        for (k, n) in &self.unplanned {
            s += &format!("  not planned ({k}): {n} runs\n");
        }
        s
    }
}

impl Report {
    /// Counts one node of `op`, run by `package`, that took `t` on the host, `cpu.0` of it in its
    /// `kiln_cpu` calls (a tiled node's: their parallel section) and `cpu.1` of that in the host's
    /// products.
    pub fn record_node(&mut self, op: &str, package: &str, t: Duration, cpu: (Duration, Duration)) {
        self.nodes += 1;
        match self.packages.get_mut(package) {
            Some(n) => *n += 1,
            None => {
                self.packages.insert(package.to_string(), 1);
            }
        }
        if !self.ops.contains_key(op) {
            self.ops.insert(op.to_string(), OpStat::default());
        }
        if let Some(s) = self.ops.get_mut(op) {
            s.nodes += 1;
            s.time_us += t.as_micros() as u64;
            s.shim_us += cpu.0.as_secs_f64() * 1e6;
            s.host_compute_us += cpu.1.as_secs_f64() * 1e6;
        }
    }

    /// Adds the counts of `other` (a control-flow body's session) to this report's.
    pub fn absorb(&mut self, other: Report) {
        self.nodes += other.nodes;
        self.wasm_calls.infer += other.wasm_calls.infer;
        self.wasm_calls.cpu += other.wasm_calls.cpu;
        self.wasm_calls.cpu_tiles += other.wasm_calls.cpu_tiles;
        self.wasm_calls.dispatch += other.wasm_calls.dispatch;
        for (p, n) in other.packages {
            *self.packages.entry(p).or_default() += n;
        }
        for (op, st) in other.ops {
            let s = self.ops.entry(op).or_default();
            s.nodes += st.nodes;
            s.time_us += st.time_us;
            s.gpu_us += st.gpu_us;
            s.shim_us += st.shim_us;
            s.host_compute_us += st.host_compute_us;
        }
        self.instances += other.instances;
        self.launches += other.launches;
        self.plan_hits += other.plan_hits;
        self.dispatch_steps += other.dispatch_steps;
        for (op, n) in other.dispatch_unsupported {
            *self.dispatch_unsupported.entry(op).or_default() += n;
        }
        self.control_flow.subgraph_runs += other.control_flow.subgraph_runs;
        self.control_flow.iterations += other.control_flow.iterations;
        self.control_flow.host_reads += other.control_flow.host_reads;
    }

    /// Adds GPU time to an op's count.
    pub fn record_gpu(&mut self, op: &str, ms: f32) {
        if let Some(s) = self.ops.get_mut(op) {
            s.gpu_us += ms as f64 * 1e3;
        }
    }

    /// A human-readable table.
    pub fn render(&self) -> String {
        let mut s = format!(
            "device: {}\nruns: {}  node executions: {}  time: {:.3} ms\nwasm calls: infer {}, cpu {} ({} of them tiles), dispatch {}  (instances {})\npackages (node executions):\n",
            self.device,
            self.runs,
            self.nodes,
            self.run_time_us as f64 / 1e3,
            self.wasm_calls.infer,
            self.wasm_calls.cpu,
            self.wasm_calls.cpu_tiles,
            self.wasm_calls.dispatch,
            self.instances
        );
        for (p, n) in &self.packages {
            s += &format!("  {p:<32} {n:>6}\n");
        }
        if self.launches > 0 || self.graphs.plans_built > 0 {
            s += &format!("gpu: {} eager launches, {} plan hits\n", self.launches, self.plan_hits);
            s += &self.graphs.render();
        }
        let cf = &self.control_flow;
        if cf.subgraph_runs > 0 {
            s += &format!(
                "control flow: {} body runs ({} loop iterations), {} device values read on the host\n",
                cf.subgraph_runs, cf.iterations, cf.host_reads
            );
        }
        if let Some(m) = &self.device_memory {
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            s += &format!(
                "device memory: {:.1} MiB in use, {:.1} MiB cached, {:.1} MiB mapped of {:.1} MiB reserved (KV), peak {:.1} MiB\n",
                mib(m.in_use_bytes),
                mib(m.cached_bytes),
                mib(m.vmm_mapped_bytes),
                mib(m.vmm_reserved_bytes),
                mib(m.peak_bytes)
            );
        }
        s += &self.convolutions.render();
        s += &self.fusions.render();
        let profiled = self.ops.values().any(|s| s.gpu_us > 0.0);
        // CPU sessions: the host time split into the shim calls and the host's products in them.
        let split = self.device == "cpu" && self.ops.values().any(|s| s.shim_us > 0.0);
        s += if split {
            "ops (node executions, host time; of it in shim calls; of that in the host's products):\n"
        } else {
            "ops (node executions, host time):\n"
        };
        let mut ops: Vec<_> = self.ops.iter().collect();
        ops.sort_by_key(|(_, s)| std::cmp::Reverse(s.time_us));
        for (op, st) in ops {
            s += &format!("  {op:<34} {:>6} {:>12.3} ms", st.nodes, st.time_us as f64 / 1e3);
            if profiled {
                s += &format!(" {:>12.3} ms GPU", st.gpu_us / 1e3);
            } else if split {
                s += &format!(" {:>10.3} ms shim {:>10.3} ms products", st.shim_us / 1e3, st.host_compute_us / 1e3);
            }
            s += "\n";
        }
        s
    }
}

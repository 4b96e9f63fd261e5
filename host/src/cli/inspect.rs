//! `kiln inspect MODEL`: what a model is and whether kiln runs it here — inputs and outputs
//! with readable shapes, opsets, op counts with the package (name@version) that runs each op
//! on the chosen device, every op no package runs with its reason, all at once, and the
//! fusions that would apply. Nothing is run and no GPU memory is allocated.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use kiln_registry::{DeviceCaps, NodeQuery, OpRegistry};
use serde::Serialize;

use crate::ep::Device;
use crate::model::{self, Dim, Model, ValueId};
use crate::{Error, Result};

use super::{choose_device, model_registry, ResolveArgs};

/// Arguments of `kiln inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// An .onnx file, or an onnxruntime-genai model folder (its model file is inspected).
    pub model: PathBuf,
    /// Also write the inspection as JSON (`-` for stdout; the text then goes to stderr).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub target: ResolveArgs,
}

/// `kiln lock`.
#[derive(clap::Args, Debug)]
pub struct LockArgs {
    /// An .onnx file, or an onnxruntime-genai model folder.
    pub model: PathBuf,
    /// Where to write the lock (default: kiln.lock beside the .onnx file, or in the folder).
    #[arg(short, long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub target: ResolveArgs,
}

/// A graph input or output.
#[derive(Debug, Serialize)]
pub struct Io {
    pub name: String,
    pub dtype: Option<String>,
    /// `batch × 8`; `?` for an unknown dimension, `scalar` for rank 0, `unknown` rank.
    pub shape: String,
    /// The same as a list: numbers, names of symbolic dimensions, `null` for unknown ones;
    /// `None` when the rank is unknown.
    pub dims: Option<Vec<serde_json::Value>>,
}

/// One op of the model, with how many nodes use it and what runs it.
#[derive(Debug, Serialize)]
pub struct OpRow {
    /// `domain::op_type` (`ai.onnx` for the default domain).
    pub op: String,
    pub opset: Option<i64>,
    pub nodes: usize,
    /// `name@version` of the package that runs it here, or `None`.
    pub package: Option<String>,
    /// Why no package runs it (every candidate's reason), when none does.
    pub reason: Option<String>,
    /// The first node that uses it.
    pub first_node: String,
}

/// What `kiln inspect` finds.
#[derive(Debug, Serialize)]
pub struct Inspection {
    pub model: String,
    pub ir_version: i64,
    pub producer: String,
    pub device: String,
    pub opsets: BTreeMap<String, i64>,
    pub inputs: Vec<Io>,
    pub outputs: Vec<Io>,
    pub initializers: usize,
    pub initializer_bytes: u64,
    pub ops: Vec<OpRow>,
    /// Nodes no package runs, by op (the count of `ops` rows without a package).
    pub unsupported_ops: usize,
    pub fusions: crate::trace::Fusions,
}

/// A shape as `batch × 8`.
pub fn format_shape(dims: Option<&[Dim]>) -> String {
    match dims {
        None => "unknown".into(),
        Some([]) => "scalar".into(),
        Some(d) => d.iter().map(Dim::to_string).collect::<Vec<_>>().join(" × "),
    }
}

fn io(m: &Model, id: ValueId) -> Io {
    let v = &m.graph.values[id];
    Io {
        name: v.name.clone(),
        dtype: v.ty.as_ref().map(|t| match &t.kind {
            crate::model::Kind::Tensor => t.dtype.to_string(),
            kind => format!("{kind} of {}", t.dtype),
        }),
        shape: format_shape(v.ty.as_ref().and_then(|t| t.dims.as_deref())),
        dims: v.ty.as_ref().and_then(|t| t.dims.as_ref()).map(|d| {
            d.iter()
                .map(|d| match d {
                    Dim::Known(n) => serde_json::Value::from(*n),
                    Dim::Symbolic(s) => serde_json::Value::from(s.as_str()),
                    Dim::Unknown => serde_json::Value::Null,
                })
                .collect()
        }),
    }
}

/// Inspects `m` for `device` (its caps from `caps`) with the packages of `reg`.
pub fn inspect(mut m: Model, reg: &OpRegistry, device: Device, caps: Option<&DeviceCaps>, fuse: bool) -> Inspection {
    // The file's own opsets (fusion may import a domain for its replacements).
    let file_opsets = m.opsets.clone();
    let fusions = if fuse {
        crate::fuse::Fusions { enabled: true, ..crate::fuse::fuse(&mut m, reg, caps) }
    } else {
        crate::fuse::Fusions::default()
    };
    let mut ops: Vec<OpRow> = Vec::new();
    for (g, n) in m.graph.nodes_with_subgraphs() {
        let domain = if n.domain.is_empty() || n.domain == "ai.onnx" { "ai.onnx" } else { n.domain.as_str() };
        let op = format!("{domain}::{}", n.op_type);
        if let Some(row) = ops.iter_mut().find(|r| r.op == op) {
            row.nodes += 1;
            continue;
        }
        let opset = m.opset(&n.domain);
        let input_dtypes = n.inputs.iter().map(|i| i.and_then(|v| g.declared_dtype(v))).collect();
        let (package, reason) = match opset {
            None => (None, Some(format!("the model does not import domain {domain:?} (opset_import)"))),
            Some(_) if n.is_control_flow() || crate::ep::runs_on_executor(n) => {
                (Some(crate::ep::CONTROL_FLOW.to_string()), None)
            }
            Some(opset) => {
                let q = NodeQuery {
                    domain: &n.domain,
                    op_type: &n.op_type,
                    opset,
                    input_dtypes,
                    max_rank: None,
                    device: caps,
                };
                match reg.resolve(&q) {
                    Ok(r) => (Some(r.package.id()), None),
                    Err(u) => (None, Some(u.to_string())),
                }
            }
        };
        ops.push(OpRow { op, opset, nodes: 1, package, reason, first_node: n.name.clone() });
    }
    ops.sort_by(|a, b| b.nodes.cmp(&a.nodes).then_with(|| a.op.cmp(&b.op)));
    let g = &m.graph;
    Inspection {
        model: m.path.as_ref().map(|p| p.display().to_string()).unwrap_or_default(),
        ir_version: m.ir_version,
        producer: m.producer.clone(),
        device: device.to_string(),
        opsets: file_opsets
            .iter()
            .map(|(d, v)| (if d.is_empty() { "ai.onnx".to_string() } else { d.clone() }, *v))
            .collect(),
        inputs: g.inputs.iter().map(|&i| io(&m, i)).collect(),
        outputs: g.outputs.iter().map(|&i| io(&m, i)).collect(),
        initializers: g.initializers.len(),
        initializer_bytes: g.initializers.values().map(|t| t.data.len() as u64).sum(),
        unsupported_ops: ops.iter().filter(|r| r.package.is_none()).count(),
        ops,
        fusions,
    }
}

impl Inspection {
    /// The human-readable form.
    pub fn render(&self) -> String {
        let mut s = format!("model: {} (IR {}, producer {:?})\n", self.model, self.ir_version, self.producer);
        let opsets: Vec<String> = self.opsets.iter().map(|(d, v)| format!("{d} {v}")).collect();
        s += &format!("opsets: {}\n", opsets.join(", "));
        for (title, list) in [("inputs", &self.inputs), ("outputs", &self.outputs)] {
            s += &format!("{title}:\n");
            let w = list.iter().map(|i| i.name.len()).max().unwrap_or(0);
            for i in list {
                s += &format!("  {:<w$}  {:<8}  {}\n", i.name, i.dtype.as_deref().unwrap_or("?"), i.shape);
            }
        }
        s += &format!(
            "initializers: {} ({:.1} MB)\nops on {} ({} node(s)):\n",
            self.initializers,
            self.initializer_bytes as f64 / 1e6,
            self.device,
            self.ops.iter().map(|r| r.nodes).sum::<usize>()
        );
        let w = self.ops.iter().map(|r| r.op.len()).max().unwrap_or(0);
        for r in &self.ops {
            let runs = r.package.clone().unwrap_or_else(|| "UNSUPPORTED".into());
            s += &format!("  {:<w$}  {:>5} node{}  {runs}\n", r.op, r.nodes, if r.nodes == 1 { " " } else { "s" });
        }
        s += &self.fusions.render();
        if self.unsupported_ops == 0 {
            s += "every node has a package on this device\n";
        } else {
            s += &format!("{} op(s) no package runs on {}:\n", self.unsupported_ops, self.device);
            for r in self.ops.iter().filter(|r| r.package.is_none()) {
                let reason = r.reason.as_deref().unwrap_or("");
                s += &format!("  {} ({} node(s), first {:?}): {}\n", r.op, r.nodes, r.first_node, reason);
            }
        }
        s
    }
}

/// The model file of `path`: the path itself, or a genai folder's model.
/// `path` as the single .onnx file `kiln run` and `kiln bench run` take. Errors: a folder, saying
/// what to give instead (its model.onnx, or `kiln generate` for an onnxruntime-genai folder).
pub fn onnx_file<'p>(path: &'p Path, command: &str) -> Result<&'p Path> {
    if !path.is_dir() {
        return Ok(path);
    }
    let hint = if path.join("genai_config.json").is_file() {
        format!("it is an onnxruntime-genai model folder, which `kiln generate {}` runs", path.display())
    } else if path.join("model.onnx").is_file() {
        format!("give its model file: `kiln {command} {}`", path.join("model.onnx").display())
    } else {
        "give an .onnx file".to_string()
    };
    Err(Error::Input(format!("{} is a folder; {hint}", path.display())))
}

pub fn model_file(path: &Path) -> Result<PathBuf> {
    if !path.is_dir() {
        return Ok(path.to_path_buf());
    }
    if !path.join("genai_config.json").is_file() {
        return Err(Error::Input(format!(
            "{} is a folder without genai_config.json: give an .onnx file or an onnxruntime-genai model folder",
            path.display()
        )));
    }
    Ok(path.join(&crate::genai::GenaiConfig::read(path)?.model.decoder.filename))
}

/// `kiln lock`: resolves the model as `inspect` does and pins the packages its ops resolved to.
/// Errors: an op no package runs (unsupported), as a run would fail.
pub fn lock(a: LockArgs) -> Result<ExitCode> {
    if a.target.packages.locked || a.target.packages.lock.is_some() {
        return Err(Error::Input(
            "kiln lock writes a kiln.lock from what the model resolves to; --lock and --locked read one: drop them"
                .into(),
        ));
    }
    let out = a.output.clone().unwrap_or_else(|| super::beside_model(&a.model, "kiln.lock"));
    super::output::check_path("--output", &Some(out.clone()))?;
    let mut m = model::load(&model_file(&a.model)?)?;
    let device = choose_device(a.target.device)?;
    let caps = super::device_caps(device)?;
    let reg = model_registry(&a.target.packages, &a.model)?;
    if a.model.is_dir() {
        // A model folder's decode appends the device-step ops (greedy tokens chosen on the
        // device): their packages are pinned too.
        let cfg = crate::genai::GenaiConfig::read(&a.model)?;
        crate::genai::device_step::augment(&mut m, &cfg, &reg);
    }
    let ins = inspect(m, &reg, device, caps.as_ref(), !a.target.fuse.no_fuse);
    if ins.unsupported_ops > 0 {
        return Err(Error::Unsupported(format!(
            "{} op(s) of the model have no package here (`kiln inspect` lists them): nothing to lock",
            ins.unsupported_ops
        )));
    }
    let used: std::collections::BTreeSet<&str> = ins.ops.iter().filter_map(|o| o.package.as_deref()).collect();
    let pkgs: Vec<&kiln_registry::Package> =
        reg.packages().filter(|p| used.contains(p.id().as_str())).map(|p| p.as_ref()).collect();
    // With the header packages their CUDA sources include.
    let lock = kiln_registry::lock::Lock::of(reg.with_dependencies(&pkgs));
    std::fs::write(&out, lock.to_toml()).map_err(|source| Error::Io { path: out.clone(), source })?;
    for l in &lock.package {
        println!("{}@{}  ({})", l.name, l.version, l.source);
    }
    println!("wrote {} ({} packages)", out.display(), lock.package.len());
    Ok(ExitCode::SUCCESS)
}

/// `kiln inspect`. Exit code 0 when every op has a package here, `exit::UNSUPPORTED` (4)
/// otherwise.
pub fn run(a: InspectArgs) -> Result<ExitCode> {
    super::output::check_path("--json", &a.json)?;
    let m = model::load(&model_file(&a.model)?)?;
    let device = choose_device(a.target.device)?;
    let caps = super::device_caps(device)?;
    let ins = inspect(m, &model_registry(&a.target.packages, &a.model)?, device, caps.as_ref(), !a.target.fuse.no_fuse);
    let human = super::output::Human::new(&[&a.json]);
    human.print(&ins.render());
    if let Some(p) = &a.json {
        super::output::write_json(p, &ins)?;
    }
    Ok(ExitCode::from(if ins.unsupported_ops == 0 { super::exit::OK } else { super::exit::UNSUPPORTED }))
}

//! `kiln kernels …`.

use std::process::ExitCode;

use clap::Subcommand;

use crate::Result;

use super::PackageArgs;

#[derive(Subcommand, Debug)]
pub enum KernelsCommand {
    /// Compile every package's CUDA sources for the GPU present into the NVRTC cache.
    Warm {
        #[command(flatten)]
        packages: PackageArgs,
    },
    /// List the packages kiln can use: name, version, origin, ops and dtypes.
    List {
        #[command(flatten)]
        packages: PackageArgs,
    },
    /// Which package runs an op, and why each other candidate does not: the chosen one, those
    /// it outranks (drop-in folders > registries in the order given > built-ins, then the
    /// higher version) and those that do not support the node, with the reason.
    Why(WhyArgs),
}

/// `kiln kernels why`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("what").required(true).args(["op", "node"])))]
pub struct WhyArgs {
    /// The op: `OP` (ai.onnx) or `DOMAIN::OP` (`com.microsoft::GroupQueryAttention`).
    pub op: Option<String>,
    /// A node of `--model`, by name: its op, opset and input dtypes come from the model, and a
    /// node that a fusion pattern absorbs is followed into the nodes that replace it.
    #[arg(long, requires = "model", conflicts_with_all = ["op", "opset", "dtype", "rank"])]
    pub node: Option<String>,
    /// The model of `--node`: an .onnx file or an onnxruntime-genai model folder (its
    /// `kiln.toml` requirements and trusted keys apply, as in a run).
    #[arg(long, value_name = "MODEL", requires = "node", conflicts_with = "op")]
    pub model: Option<std::path::PathBuf>,
    /// With `--node`: explain the model's nodes as they are, without fusion.
    #[arg(long = "no-fuse", requires = "node")]
    pub no_fuse: bool,
    /// The model's opset for the op's domain (default: the highest any candidate declares).
    #[arg(long)]
    pub opset: Option<i64>,
    /// The dtype of the node's first input (`float16`, …).
    #[arg(long)]
    pub dtype: Option<String>,
    /// The largest rank of the node's tensors.
    #[arg(long)]
    pub rank: Option<usize>,
    /// The device whose capabilities the packages must meet.
    #[arg(long, value_enum, default_value_t)]
    pub device: super::DeviceArg,
    #[command(flatten)]
    pub packages: PackageArgs,
}

/// Where a package of `precedence` came from, in words.
fn source(precedence: u32) -> String {
    match precedence {
        kiln_registry::BUILTIN => "built-in".into(),
        kiln_registry::USER => "drop-in folder".into(),
        p => format!("registry {}", kiln_registry::USER - p),
    }
}

fn why(a: WhyArgs) -> Result<ExitCode> {
    if let (Some(node), Some(model)) = (&a.node, &a.model) {
        return why_node(&a, model, node);
    }
    let reg = super::registry(&a.packages)?;
    let op = a.op.as_deref().unwrap_or_default();
    let (domain, op_type) = op.rsplit_once("::").unwrap_or(("", op));
    let dtype = match &a.dtype {
        None => None,
        Some(d) => Some(kiln_kernel_abi::DType::from_name(d).ok_or_else(|| {
            crate::Error::Input(format!("--dtype {d:?} is not a dtype (float32, float16, bfloat16, int64, …)"))
        })?),
    };
    let device = super::choose_device(a.device)?;
    let caps = super::device_caps(device)?;
    let declared = || {
        reg.packages().flat_map(|p| p.manifest.ops.iter()).filter(|e| {
            kiln_registry::normalize_domain(&e.domain) == kiln_registry::normalize_domain(domain)
                && e.op_types.iter().any(|t| t == op_type)
        })
    };
    let opset =
        a.opset.unwrap_or_else(|| declared().map(|e| e.until_opset.unwrap_or(e.since_opset)).max().unwrap_or(1));
    let q = kiln_registry::NodeQuery {
        domain,
        op_type,
        opset,
        input_dtypes: vec![dtype],
        max_rank: a.rank,
        device: caps.as_ref(),
    };
    let shown_domain = if domain.is_empty() { "ai.onnx" } else { domain };
    let mut head = format!("{shown_domain}::{op_type} at opset {opset}");
    if let Some(d) = dtype {
        head += &format!(", {d}");
    }
    if let Some(r) = a.rank {
        head += &format!(", rank {r}");
    }
    println!("{head}, on {device}:");
    Ok(ExitCode::from(if explain(&reg, &q) { super::exit::OK } else { super::exit::UNSUPPORTED }))
}

/// Prints every candidate of `q` with its verdict; whether one is chosen.
fn explain(reg: &kiln_registry::OpRegistry, q: &kiln_registry::NodeQuery<'_>) -> bool {
    let (domain, op_type) = (q.domain, q.op_type);
    let shown_domain = if domain.is_empty() { "ai.onnx" } else { domain };
    let candidates = reg.explain(q);
    if candidates.is_empty() {
        // The op under another domain (`why Twice` for ai.example::Twice) is named, as `search`
        // finds it in any domain.
        let mut elsewhere: Vec<String> = reg
            .packages()
            .flat_map(|p| p.manifest.ops.iter())
            .filter(|e| e.op_types.iter().any(|t| t == op_type))
            .map(|e| kiln_registry::normalize_domain(&e.domain).to_string())
            .map(|d| if d.is_empty() { "ai.onnx".to_string() } else { d })
            .collect();
        elsewhere.sort();
        elsewhere.dedup();
        if elsewhere.is_empty() {
            println!("  no package declares {shown_domain}::{op_type}");
        } else {
            let names: Vec<String> = elsewhere.iter().map(|d| format!("{d}::{op_type}")).collect();
            println!("  no package declares {shown_domain}::{op_type}; packages declare {}", names.join(", "));
        }
    }
    for c in &candidates {
        let (what, why) = match &c.verdict {
            kiln_registry::Verdict::Chosen => ("chosen", String::new()),
            kiln_registry::Verdict::Outranked => ("outranked", String::new()),
            kiln_registry::Verdict::Rejected(r) => ("rejected", format!(": {r}")),
        };
        println!("  {what:<10} {:<28} {} ({}){why}", c.package.id(), source(c.precedence), c.package.origin);
    }
    candidates.iter().any(|c| c.verdict == kiln_registry::Verdict::Chosen)
}

/// `kiln kernels why --model M --node NAME`: the node's query from the model (fused as a run
/// fuses it, unless `--no-fuse`), explained; a fused node is followed into its replacements.
fn why_node(a: &WhyArgs, model_path: &std::path::Path, name: &str) -> Result<ExitCode> {
    let reg = super::model_registry(&a.packages, model_path)?;
    let mut m = crate::model::load(&super::inspect::model_file(model_path)?)?;
    let device = super::choose_device(a.device)?;
    let caps = super::device_caps(device)?;
    let op_of = |m: &crate::model::Model, n: &str| {
        m.graph.nodes.iter().find(|x| x.name == n).map(|x| format!("{}::{}", shown(&x.domain), x.op_type))
    };
    let original = op_of(&m, name);
    let names_before: Vec<String> = m.graph.nodes.iter().map(|n| n.name.clone()).collect();
    let mut targets = vec![name.to_string()];
    if !a.no_fuse {
        let fusions = crate::fuse::fuse(&mut m, &reg, caps.as_ref());
        // A node of the model as fused (a replacement's name) is explained as it is.
        if original.is_none() && op_of(&m, name).is_none() {
            return Err(no_node(model_path, name, names_before.iter().chain(m.graph.nodes.iter().map(|n| &n.name))));
        }
        let original = original.clone().unwrap_or_default();
        if let Some(f) = fusions.applied.iter().find(|f| f.nodes.iter().any(|n| n == name)) {
            // Replacement nodes are named after the match's last node and the fusion (fuse::rewrite).
            let base = format!("{}/{}", f.nodes.last().map(String::as_str).unwrap_or_default(), f.fusion);
            targets = m
                .graph
                .nodes
                .iter()
                .filter(|n| n.name == base || n.name.starts_with(&format!("{base}#")))
                .map(|n| n.name.clone())
                .collect();
            if targets.is_empty() {
                return Err(crate::Error::Model(format!(
                    "node {name:?} is fused by {} ({}), but no node named {base:?} replaces it",
                    f.fusion, f.package
                )));
            }
            let into: Vec<String> =
                targets.iter().map(|t| format!("{t} ({})", op_of(&m, t).unwrap_or_default())).collect();
            let others: Vec<String> = f.nodes.iter().filter(|n| *n != name).map(|n| format!("{n:?}")).collect();
            let with = if others.is_empty() { String::new() } else { format!(" with {}", others.join(", ")) };
            println!(
                "node {name:?} ({original}) is fused by {} ({}){with} into {} (--no-fuse keeps it):",
                f.fusion,
                f.package,
                into.join(", ")
            );
        }
    } else if original.is_none() {
        return Err(no_node(model_path, name, names_before.iter()));
    }
    let mut all_chosen = true;
    for t in &targets {
        let Some(n) = m.graph.nodes.iter().find(|x| &x.name == t) else { continue };
        let Some(opset) = m.opset(&n.domain) else {
            println!("node {t:?} ({}): the model does not import domain {:?}", n.op_type, shown(&n.domain));
            all_chosen = false;
            continue;
        };
        let input_dtypes: Vec<_> = n.inputs.iter().map(|i| i.and_then(|v| m.graph.declared_dtype(v))).collect();
        let dtype = input_dtypes.first().copied().flatten();
        let q = kiln_registry::NodeQuery {
            domain: &n.domain,
            op_type: &n.op_type,
            opset,
            input_dtypes,
            max_rank: None,
            device: caps.as_ref(),
        };
        let dt = dtype.map_or(String::new(), |d| format!(", {d}"));
        println!("node {t:?}: {}::{} at opset {opset}{dt}, on {device}:", shown(&n.domain), n.op_type);
        all_chosen &= explain(&reg, &q);
    }
    Ok(ExitCode::from(if all_chosen { super::exit::OK } else { super::exit::UNSUPPORTED }))
}

/// The error for a node name the model does not have: the names that contain its last path
/// segment (case-insensitively), else those under its parent path, else the first few.
fn no_node<'a>(model: &std::path::Path, name: &str, names: impl Iterator<Item = &'a String>) -> crate::Error {
    // Each name once, in the model's order (the names before fusion and after share most).
    let mut seen = std::collections::HashSet::new();
    let names: Vec<&String> = names.filter(|n| seen.insert(*n)).collect();
    let key = name.rsplit('/').find(|s| !s.is_empty()).unwrap_or(name).to_lowercase();
    let mut like: Vec<&str> =
        names.iter().filter(|n| n.to_lowercase().contains(&key)).take(8).map(|n| n.as_str()).collect();
    if like.is_empty() {
        if let Some((parent, _)) = name.rsplit_once('/').filter(|(p, _)| !p.is_empty()) {
            like = names.iter().filter(|n| n.starts_with(&format!("{parent}/"))).take(8).map(|n| n.as_str()).collect();
        }
    }
    let what = if like.is_empty() {
        like = names.iter().take(5).map(|n| n.as_str()).collect();
        "its nodes begin"
    } else {
        "nodes with a similar name"
    };
    crate::Error::Input(format!(
        "--node: {} has no node named {name:?} ({what}: {like:?}; `kiln inspect --json` gives each op's first node)",
        model.display()
    ))
}

/// A domain as `kernels why` prints it (`ai.onnx` for the default one).
fn shown(domain: &str) -> &str {
    if domain.is_empty() || domain == "ai.onnx" {
        "ai.onnx"
    } else {
        domain
    }
}

pub fn run(cmd: KernelsCommand) -> Result<ExitCode> {
    match cmd {
        KernelsCommand::Why(a) => why(a),
        KernelsCommand::Warm { packages } => {
            let ordinal = super::require_gpu("kernels warm")?;
            let reg = super::registry(&packages)?;
            let mut gpu = crate::cuda::Gpu::open(ordinal, None)?;
            let progress = super::progress::Progress::bar(reg.packages().count() as u64, "NVRTC");
            for p in reg.packages() {
                progress.message(&p.id());
                let t0 = std::time::Instant::now();
                let n = gpu.warm(p)?;
                progress.line(&format!("{:<32} {n:>4} kernels  {:>8.1} ms", p.id(), t0.elapsed().as_secs_f64() * 1e3));
                progress.step("");
            }
            drop(progress);
            println!(
                "NVRTC: {} compiled, {} from the cache ({})",
                gpu.compiles,
                gpu.compile_cache_hits,
                crate::native_cache::cache_dir().display()
            );
            Ok(ExitCode::SUCCESS)
        }
        KernelsCommand::List { packages } => {
            let (mut reg, errors) = crate::packages::registry(
                &crate::packages::search_path(&packages.packages),
                &packages.registries.dirs(),
            );
            reg.require(&packages.kernels).map_err(crate::Error::Input)?;
            for (p, precedence) in reg.packages_with_precedence() {
                let m = &p.manifest;
                // Runs leave out a registry package without a trusted signature (--trust).
                let trust = match super::untrusted(p, precedence, &packages.trust) {
                    Some(how) if packages.allow_unsigned => format!("  [{how}: used under --allow-unsigned]"),
                    Some(how) => format!("  [{how}: left out by runs; --trust KEY or --allow-unsigned]"),
                    None => String::new(),
                };
                println!("{} {}  ({}){trust}", m.package.name, m.package.version, p.origin);
                if !m.package.description.is_empty() {
                    println!("  {}", m.package.description);
                }
                for op in &m.ops {
                    let domain = if op.domain.is_empty() { "ai.onnx" } else { &op.domain };
                    let until = op.until_opset.map_or(String::new(), |u| u.to_string());
                    println!(
                        "  {domain} opset {}..{until}: {}\n    dtypes: {}  max rank {}",
                        op.since_opset,
                        op.op_types.join(", "),
                        op.dtypes.join(", "),
                        op.max_rank
                    );
                }
                if !m.headers.is_empty() {
                    let names: Vec<String> = m.headers.iter().map(|h| m.include_name(h)).collect();
                    println!("  headers: {}", names.join(", "));
                }
                if !m.dependencies.is_empty() {
                    let deps: Vec<String> = m.dependencies.iter().map(|(n, r)| format!("{n} {r}")).collect();
                    println!("  depends on: {}", deps.join(", "));
                }
            }
            for (p, why, _) in reg.excluded() {
                println!("{} {}  ({})  [left out: {why}]", p.name(), p.version(), p.origin);
            }
            for e in &errors {
                println!("BROKEN: {e}");
            }
            // A broken package is invalid input; the others are listed and usable.
            Ok(ExitCode::from(if errors.is_empty() { super::exit::OK } else { super::exit::INVALID_INPUT }))
        }
    }
}

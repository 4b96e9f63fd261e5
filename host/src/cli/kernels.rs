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
pub struct WhyArgs {
    /// The op: `OP` (ai.onnx) or `DOMAIN::OP` (`com.microsoft::GroupQueryAttention`).
    pub op: String,
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
    let reg = super::registry(&a.packages)?;
    let (domain, op_type) = a.op.rsplit_once("::").unwrap_or(("", &a.op));
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
    let candidates = reg.explain(&q);
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
    let chosen = candidates.iter().any(|c| c.verdict == kiln_registry::Verdict::Chosen);
    Ok(ExitCode::from(if chosen { super::exit::OK } else { super::exit::UNSUPPORTED }))
}

pub fn run(cmd: KernelsCommand) -> Result<ExitCode> {
    match cmd {
        KernelsCommand::Why(a) => why(a),
        KernelsCommand::Warm { packages } => {
            let ordinal = super::require_gpu("kernels warm")?;
            let reg = super::registry(&packages)?;
            let mut gpu = crate::cuda::Gpu::open(ordinal, None)?;
            for p in reg.packages() {
                let t0 = std::time::Instant::now();
                let n = gpu.warm(p)?;
                println!("{:<32} {n:>4} kernels  {:>8.1} ms", p.id(), t0.elapsed().as_secs_f64() * 1e3);
            }
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
            }
            for e in &errors {
                println!("BROKEN: {e}");
            }
            // A broken package is invalid input; the others are listed and usable.
            Ok(ExitCode::from(if errors.is_empty() { super::exit::OK } else { super::exit::INVALID_INPUT }))
        }
    }
}

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
}

pub fn run(cmd: KernelsCommand) -> Result<ExitCode> {
    match cmd {
        KernelsCommand::Warm { packages } => {
            let ordinal = super::require_gpu("kernels warm")?;
            let reg = super::registry(&packages);
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
                crate::cuda::cache_dir().display()
            );
            Ok(ExitCode::SUCCESS)
        }
        KernelsCommand::List { packages } => {
            let (reg, errors) = crate::packages::registry(
                &crate::packages::search_path(&packages.packages),
                &packages.registries.dirs(),
            );
            for p in reg.packages() {
                let m = &p.manifest;
                println!("{} {}  ({})", m.package.name, m.package.version, p.origin);
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

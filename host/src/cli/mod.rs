//! The `kiln` command line: `run`, `kernels list`, `conformance`.

mod conformance;
mod generate;
mod kernels;
mod run;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use crate::ep::Device;
use crate::{Error, Result};

/// kiln runs ONNX models through sandboxed kernel packages.
#[derive(Parser, Debug)]
#[command(name = "kiln", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run an ONNX model on inputs from .npy or .pb files; write its outputs as .npy.
    Run(run::RunArgs),
    /// Kernel packages.
    Kernels {
        #[command(subcommand)]
        command: kernels::KernelsCommand,
    },
    /// Generate text with an LLM in the onnxruntime-genai model folder format.
    Generate(generate::GenerateArgs),
    /// Run ONNX backend node tests (a folder of test_* folders) and compare with their outputs.
    Conformance(conformance::ConformanceArgs),
}

/// `--device`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    /// The GPU when one is usable, else the CPU (and say so).
    #[default]
    Auto,
    Cpu,
    Cuda,
}

/// Options every command that runs models shares.
#[derive(clap::Args, Debug, Clone)]
pub struct PackageArgs {
    /// Extra kernel package folders (a package, or a folder of packages); also
    /// `KILN_PACKAGE_PATH`. They take part in resolution beside the built-in packages.
    #[arg(long = "packages", value_name = "DIR")]
    pub packages: Vec<PathBuf>,
}

/// Picks the device. This build has the CPU backend only: `auto` says so, `cuda` is refused.
pub fn choose_device(arg: DeviceArg) -> Result<Device> {
    match arg {
        DeviceArg::Cpu => Ok(Device::Cpu),
        DeviceArg::Auto => {
            eprintln!("kiln: no CUDA backend in this build; running on the CPU (package CPU references)");
            Ok(Device::Cpu)
        }
        DeviceArg::Cuda => {
            Err(Error::Device("--device cuda: this kiln has no CUDA backend yet; use --device cpu (or auto)".into()))
        }
    }
}

/// Builds the op registry, printing packages that could not be loaded.
pub fn registry(args: &PackageArgs) -> kiln_registry::OpRegistry {
    let (reg, errors) = crate::packages::registry(&crate::packages::search_path(&args.packages));
    for e in errors {
        eprintln!("kiln: warning: package skipped: {e}");
    }
    reg
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_env("KILN_LOG").unwrap_or_else(|_| "warn".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Kernels { command } => kernels::run(command),
        Command::Conformance(a) => conformance::run(a),
        Command::Generate(a) => generate::run(a),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kiln: error: {e}");
            ExitCode::from(1)
        }
    }
}

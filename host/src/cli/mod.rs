//! The `kiln` command line: `run`, `generate`, `chat`, `serve`, `inspect`, `kernels`, `conformance`, `verify`,
//! `bench`, `devices`, `package`, `publish`, `yank`, `search`.

mod bench;
mod bench_decode;
mod bench_run;
mod chat;
mod conformance;
mod exit;
mod generate;
pub mod inspect;
mod kernels;
mod output;
pub mod progress;
mod registry;
mod run;
mod scaffold;
mod serve;
mod verify;
pub mod verify_fusion;

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
    /// More log output on standard error: -v what kiln does (load, fusion, preparation,
    /// compilation and caches), -vv more. `KILN_LOG` (a tracing filter) overrides it.
    #[arg(short, long, action = clap::ArgAction::Count, global = true)]
    pub verbose: u8,
    /// Only errors, warnings and results: no notes on standard error.
    #[arg(short, long, global = true, conflicts_with = "verbose")]
    pub quiet: bool,
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
    /// Chat with an LLM folder through its chat template: each line on standard input is a
    /// turn and the answer streams. `/reset` clears the history, `/exit` (or `/quit`, or the end
    /// of input) ends, Ctrl-C stops the answer being generated; a line starting with `//` is
    /// sent with one `/` removed.
    Chat(chat::ChatArgs),
    /// Serve an LLM folder over HTTP with the OpenAI API: /v1/completions and
    /// /v1/chat/completions (streaming), /v1/models, /health, /metrics.
    Serve(serve::ServeArgs),
    /// Show a model: inputs and outputs, opsets, ops with the package that runs each here,
    /// every op no package runs with its reason, and the fusions that apply.
    Inspect(inspect::InspectArgs),
    /// Write a `kiln.lock` pinning the packages (name, version, digest) that a model's nodes
    /// resolve to on this device; `--lock FILE` then makes runs use exactly those.
    Lock(inspect::LockArgs),
    /// Run ONNX backend node tests (a folder of test_* folders) and compare with their outputs.
    Conformance(conformance::ConformanceArgs),
    /// Check a package's GPU kernels against its CPU reference and ONNX's node tests.
    Verify(verify::VerifyArgs),
    /// Benchmarks: `kiln bench ops` (GPU kernels), `kiln bench decode MODEL_DIR` (LLM decode).
    Bench {
        #[command(subcommand)]
        command: bench::BenchCommand,
    },
    /// Kernel packages: `kiln package new NAME` scaffolds one, `build DIR` builds its shim and
    /// archive, `pack DIR` archives a built folder as a `.kpkg`.
    Package {
        #[command(subcommand)]
        command: registry::PackageCommand,
    },
    /// Publish a `.kpkg` archive to a registry directory (docs/REGISTRY.md).
    Publish(registry::PublishArgs),
    /// Yank a published version (NAME@VERSION) so that runs no longer choose it; `--undo`
    /// takes it back.
    Yank(registry::YankArgs),
    /// List the published packages that provide an op.
    Search(registry::SearchArgs),
    /// Publisher keys: `kiln key new -o FILE` writes an ed25519 secret key (for `publish
    /// --sign`) and prints its public key (for `--trust`).
    Key {
        #[command(subcommand)]
        command: registry::KeyCommand,
    },
    /// List CUDA devices: name, compute capability, memory, driver, NVRTC and cuBLASLt versions.
    Devices {
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
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
    #[command(flatten)]
    pub registries: registry::RegistryArgs,
    /// Only versions that meet a semver requirement take part: `NAME@REQ`
    /// (`kiln-matmul@^1.1`, `kiln-unary@=1.0.0`); repeatable. A requirement no package meets is
    /// an error that lists the versions there are.
    #[arg(long = "kernels", value_name = "NAME@REQ")]
    pub kernels: Vec<kiln_registry::Requirement>,
    /// Use exactly the packages of this `kiln.lock` (`kiln lock MODEL` writes one): a pinned
    /// package that is missing or differs (another digest) is an error, and no other package
    /// takes part. A pinned version that its registry has yanked is still used.
    #[arg(long = "lock", value_name = "FILE")]
    pub lock: Option<PathBuf>,
    /// Use the `kiln.lock` beside the model (in its folder) as `--lock` does; without one, an
    /// error.
    #[arg(long = "locked", conflicts_with = "lock")]
    pub locked: bool,
    /// Accept a registry's packages published with a signature by this public key
    /// (`ed25519:HEX`, as `kiln key new` prints); repeatable, and `trust = [...]` in the
    /// `kiln.toml` beside a model. A registry package without a trusted signature is left out.
    #[arg(long = "trust", value_name = "KEY")]
    pub trust: Vec<kiln_registry::signing::PublicKey>,
    /// Also accept registry packages without a trusted signature (each is named on stderr); a
    /// signature that does not verify is refused all the same.
    #[arg(long = "allow-unsigned")]
    pub allow_unsigned: bool,
}

/// The file beside a model (a model file's folder, or a model folder itself) where kiln reads
/// the model's package requirements (`kiln.toml`) and lock (`kiln.lock`).
pub(super) fn beside_model(model: &std::path::Path, file: &str) -> PathBuf {
    let dir = if model.is_dir() { model } else { model.parent().unwrap_or(std::path::Path::new(".")) };
    dir.join(file)
}

/// The `kiln.toml` beside `model`, when there is one: `[kernels]` with `NAME = "REQ"` entries
/// (`kiln-matmul = "^1.2"`), as `--kernels NAME@REQ`, and `trust = ["ed25519:…"]`, as `--trust`.
/// Errors: a file that is not such a table, naming it and the entry.
pub fn model_config(model: &std::path::Path) -> Result<ModelConfig> {
    let path = beside_model(model, "kiln.toml");
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(ModelConfig::default()),
        Err(source) => return Err(Error::Io { path, source }),
    };
    let bad = |why: String| Error::Input(format!("{}: {why}", path.display()));
    let doc: toml::Table = toml::from_str(&text).map_err(|e| bad(e.to_string()))?;
    if let Some(k) = doc.keys().find(|k| !matches!(k.as_str(), "kernels" | "trust")) {
        return Err(bad(format!(
            "unknown table or key {k:?}; kiln.toml holds `trust = [KEY, ...]` and [kernels] NAME = \"REQ\" entries"
        )));
    }
    let mut config = ModelConfig::default();
    if let Some(trust) = doc.get("trust") {
        let keys = trust.as_array().ok_or_else(|| bad("`trust` must be a list of public keys".into()))?;
        for k in keys {
            let k = k.as_str().ok_or_else(|| bad("`trust` must be a list of public keys".into()))?;
            config.trust.push(k.parse().map_err(|e: String| bad(format!("trust: {e}")))?);
        }
    }
    let Some(kernels) = doc.get("kernels") else { return Ok(config) };
    let table = kernels.as_table().ok_or_else(|| bad("`kernels` must be a table of NAME = \"REQ\"".into()))?;
    for (name, req) in table {
        let req = req.as_str().ok_or_else(|| bad(format!("kernels.{name} must be a version requirement string")))?;
        config
            .requirements
            .push(format!("{name}@{req}").parse().map_err(|e: String| bad(format!("kernels.{name}: {e}")))?);
    }
    Ok(config)
}

/// What the `kiln.toml` beside a model says.
#[derive(Default)]
pub struct ModelConfig {
    /// `[kernels] NAME = "REQ"`, as `--kernels NAME@REQ`.
    pub requirements: Vec<kiln_registry::Requirement>,
    /// `trust = ["ed25519:…"]`, as `--trust`.
    pub trust: Vec<kiln_registry::signing::PublicKey>,
}

/// [`registry`] for a command that runs `model`: also the requirements of the `kiln.toml` beside
/// it, and with `--locked` the `kiln.lock` beside it.
pub fn model_registry(args: &PackageArgs, model: &std::path::Path) -> Result<kiln_registry::OpRegistry> {
    let mut args = args.clone();
    if args.locked {
        let lock = beside_model(model, "kiln.lock");
        if !lock.is_file() {
            return Err(Error::Input(format!(
                "--locked: no kiln.lock beside the model ({}); `kiln lock {}` writes one",
                lock.display(),
                model.display()
            )));
        }
        args.lock = Some(lock);
    }
    let config = model_config(model)?;
    args.trust.extend(config.trust);
    let mut reg = registry(&args)?;
    let origin = beside_model(model, "kiln.toml").display().to_string();
    reg.require_from(&config.requirements, &origin).map_err(Error::Input)?;
    Ok(reg)
}

/// Which packages run a model's nodes, and where: `--device`, `--packages` (and the registry and
/// lock flags), `--no-fuse`. `kiln inspect` and `kiln lock` take only these.
#[derive(clap::Args, Debug, Clone)]
pub struct ResolveArgs {
    /// The device whose packages run the model (`inspect` and `lock`: whose packages they
    /// resolve): `auto` takes the GPU when one is usable, else the CPU.
    #[arg(long, value_enum, default_value_t)]
    pub device: DeviceArg,
    #[command(flatten)]
    pub packages: PackageArgs,
    #[command(flatten)]
    pub fuse: FuseArgs,
}

/// Where and with what a command runs a model: [`ResolveArgs`], then how the session executes
/// (PDL, cuDNN, device memory, loop and CPU tile limits).
#[derive(clap::Args, Debug, Clone)]
pub struct ModelRunArgs {
    #[command(flatten)]
    pub resolve: ResolveArgs,
    /// Programmatic dependent launch (Hopper and later): kernels that their package declares
    /// PDL-safe start, and load their weights, while the kernel before them ends. `auto` uses it
    /// where the GPU has it, `on` makes a GPU without it an error, `off` launches plainly.
    #[arg(long = "pdl", value_enum, default_value_t)]
    pub pdl: crate::capture::PdlMode,
    /// Convolutions on a GPU through cuDNN 9: `auto` uses it where it is found (the library
    /// path, beside the CUDA libraries, or `KILN_CUDNN_PATH`), `on` makes a missing cuDNN an
    /// error, `off` runs the packages' own kernels. `--report` says which ran, and why.
    #[arg(long = "cudnn", value_enum, default_value_t)]
    pub cudnn: crate::ep::CudnnMode,
    /// On a GPU, float16 and bfloat16 convolutions through cuDNN keep the values only they read
    /// channels-last (NHWC) inside an execution plan, so cuDNN does not transpose each one's input
    /// and output: `auto` (the default) where that applies, `off` keeps every value NCHW.
    /// `--report` counts the channels-last convolutions.
    #[arg(long = "channels-last", value_enum, default_value_t)]
    pub channels_last: ChannelsLast,
    /// Most device memory the model's session may hold on a GPU, in MiB (default: all of the
    /// device's; the CPU ignores it): its tensors and what its KV caches map; the pool's cached
    /// blocks are freed before they would take kiln past it. An allocation past it fails with
    /// an out-of-memory error (in `kiln serve`, only the requests that needed the room).
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..=(u64::MAX >> 20)))]
    pub device_memory_limit: Option<u64>,
    /// The maximum number of iterations of one loop in a run (a Loop node, a Scan over one batch
    /// entry, a SequenceMap; nested loops count each on its own; If does not loop). A Loop's trip
    /// count and condition come from the model's values: past the limit the run fails rather
    /// than hangs.
    #[arg(long, value_name = "N", default_value_t = crate::ep::MAX_LOOP_ITERATIONS)]
    pub max_loop_iterations: u64,
    /// On the CPU, the most tiles one node's work splits into, run at once on the CPU threads,
    /// where its package allows it (manifest `cpu_tiles`: the built-in unary elementwise ops,
    /// SwiGlu, SkipSimplifiedLayerNormalization and the pooling ops) and the node is large enough (64 KiB of
    /// output 0 or of its largest input per tile). Default: the CPU threads
    /// (`KILN_CPU_THREADS`); 1 runs every node whole; at most 1024.
    #[arg(long, value_name = "N")]
    pub cpu_tiles: Option<u64>,
}

/// `--channels-last`: whether GPU convolutions keep their values NHWC between them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ChannelsLast {
    /// Every value NCHW, as ONNX lays it out.
    Off,
    /// Channels-last where only float16 or bfloat16 cuDNN convolutions read a value.
    #[default]
    Auto,
}

/// Most `--cpu-tiles`.
const MAX_CPU_TILES: u64 = 1024;

impl ModelRunArgs {
    /// The session options these flags give on `device` with graph mode `graphs`. Errors: a
    /// `--device-memory-limit` too large to count in bytes, `--cpu-tiles` outside 1..=1024.
    pub fn session_options(
        &self,
        device: Device,
        graphs: crate::capture::GraphMode,
    ) -> Result<crate::ep::SessionOptions> {
        let limit = match self.device_memory_limit {
            Some(m) => Some(m.checked_mul(1 << 20).ok_or_else(|| {
                Error::Input(format!("--device-memory-limit {m}: give MiB, at most {}", u64::MAX >> 20))
            })?),
            None => None,
        };
        Ok(crate::ep::SessionOptions {
            device,
            graphs,
            fuse: !self.resolve.fuse.no_fuse,
            pdl: self.pdl,
            cudnn: self.cudnn,
            channels_last: self.channels_last == ChannelsLast::Auto,
            device_memory_limit: limit,
            max_loop_iterations: self.max_loop_iterations,
            cpu_split: match self.cpu_tiles {
                Some(n @ 1..=MAX_CPU_TILES) => {
                    crate::ep::CpuSplit { max_tiles: n as usize, ..crate::ep::CpuSplit::default() }
                }
                Some(n) => return Err(Error::Input(format!("--cpu-tiles must be in 1..={MAX_CPU_TILES}, got {n}"))),
                None => crate::ep::CpuSplit::default(),
            },
            ..crate::ep::SessionOptions::default()
        })
    }
}

/// `--no-fuse`: whether the packages' fusion patterns rewrite the model at load.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct FuseArgs {
    /// Run the model's nodes as they are: no fusion pattern (the `[[fusions]]` of the packages'
    /// manifests) rewrites the graph at load. `kiln inspect` (and `--report` where a command
    /// has it) lists what fusion applies.
    #[arg(long = "no-fuse")]
    pub no_fuse: bool,
}

/// `--graph`: whether decode steps (and other runs whose inputs and outputs stay on the
/// device) are captured into CUDA graphs.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct GraphArgs {
    /// CUDA graphs: `auto` captures where possible and counts every fallback with its reason,
    /// `on` makes a run (a decode step) that cannot be captured an error (and needs a GPU),
    /// `off` runs the execution plans eagerly.
    #[arg(long = "graph", value_enum, default_value_t)]
    pub graph: crate::capture::GraphMode,
}

impl GraphArgs {
    /// The mode for `device`. Errors: `on` without a GPU.
    pub fn mode(&self, device: Device) -> Result<crate::capture::GraphMode> {
        use crate::capture::GraphMode;
        match (self.graph, device) {
            (GraphMode::On, Device::Cpu) => {
                Err(Error::Input("--graph on needs a CUDA GPU (CUDA graphs); use --graph auto or off".into()))
            }
            (m, _) => Ok(m),
        }
    }
}

/// The sandbox of a command: defaults, with compiled shims cached in `$KILN_CACHE_DIR/shims`
/// (default `~/.cache/kiln/shims`), so that only the first run compiles them.
pub fn sandbox_config() -> crate::sandbox::SandboxConfig {
    crate::sandbox::SandboxConfig {
        module_cache: Some(crate::native_cache::cache_dir().join("shims")),
        ..crate::sandbox::SandboxConfig::default()
    }
}

/// What the op registry checks packages against on `device`: the GPU's compute capability and
/// features, or nothing on the CPU.
pub fn device_caps(device: Device) -> Result<Option<kiln_registry::DeviceCaps>> {
    Ok(match device {
        Device::Cpu => None,
        Device::Cuda(i) => crate::cuda::probe()?
            .into_iter()
            .find(|d| d.ordinal == i)
            .map(|d| kiln_registry::DeviceCaps { compute_capability: d.compute_capability, features: d.features() }),
    })
}

/// Picks the device: `auto` takes GPU 0 when one is usable and otherwise says it runs on the
/// CPU; `cuda` without a GPU is an error.
pub fn choose_device(arg: DeviceArg) -> Result<Device> {
    let gpus = crate::cuda::device_count();
    match arg {
        DeviceArg::Cpu => Ok(Device::Cpu),
        DeviceArg::Auto | DeviceArg::Cuda if gpus > 0 => Ok(Device::Cuda(0)),
        DeviceArg::Auto => {
            output::note!("kiln: {}; using the CPU (package CPU references)", missing());
            Ok(Device::Cpu)
        }
        // A flag's value that cannot be met is invalid input (exit 3), as `--graph on` is.
        DeviceArg::Cuda => Err(Error::Input(format!("--device cuda: {}; use --device cpu (or auto)", missing()))),
    }
}

/// Why no GPU can be used: no driver, or no visible device.
fn missing() -> &'static str {
    if crate::cuda::driver_present() {
        "no CUDA GPU is visible"
    } else {
        "no CUDA driver (libcuda) on this machine"
    }
}

/// GPU 0 for a command that only runs on a GPU (`kernels warm`, `bench ops`: they have no
/// `--device` flag). Errors: no usable GPU, naming the command and the reason.
pub fn require_gpu(command: &str) -> Result<usize> {
    if crate::cuda::device_count() == 0 {
        return Err(Error::Device(format!("kiln {command} needs a CUDA GPU: {}", missing())));
    }
    Ok(0)
}

/// Builds the op registry of the drop-in folders, registries and built-in packages, and applies
/// `--kernels`. Errors: a drop-in or built-in package that does not load, naming each (a run
/// never falls back silently from a package the user added). A registry's published package
/// that does not load is skipped with a warning, as cargo skips a broken crate it does not
/// need: one bad upload must not stop every user of a shared registry (`--kernels NAME@REQ`
/// turns a needed one's absence into an error).
pub fn registry(args: &PackageArgs) -> Result<kiln_registry::OpRegistry> {
    let (mut reg, errors) =
        crate::packages::registry(&crate::packages::search_path(&args.packages), &args.registries.dirs());
    let (published, local): (Vec<_>, Vec<_>) = errors.into_iter().partition(|e| e.is_published());
    for e in &published {
        eprintln!("kiln: warning: package skipped: {e}");
    }
    if !local.is_empty() {
        let list: Vec<String> = local.iter().map(|e| e.to_string()).collect();
        return Err(Error::Input(format!(
            "{} package(s) could not be loaded; fix or remove them (`kiln kernels list` shows every package):\n  {}",
            list.len(),
            list.join("\n  ")
        )));
    }
    let lock = match &args.lock {
        Some(path) => Some((path, kiln_registry::lock::Lock::read(path).map_err(Error::Input)?)),
        None => None,
    };
    if let Some((path, lock)) = &lock {
        // A pinned version that its registry has yanked is loaded for the lock alone (yanked
        // versions are never chosen otherwise); it needs a trusted signature as any other.
        let dirs = args.registries.dirs();
        for l in &lock.package {
            if reg.packages().any(|p| p.name() == l.name && p.version() == &l.version) {
                continue;
            }
            for (i, dir) in dirs.iter().enumerate() {
                match kiln_registry::RegistryDir::new(dir).load_exact(&l.name, &l.version) {
                    Ok(Some(pkg)) => {
                        eprintln!(
                            "kiln: note: {}@{} is yanked in {}; used because the lock pins it",
                            l.name,
                            l.version,
                            dir.display()
                        );
                        reg.add(pkg, kiln_registry::registry_precedence(i));
                        break;
                    }
                    Ok(None) => {}
                    Err(e) => return Err(Error::Input(format!("--lock {}: {e}", path.display()))),
                }
            }
        }
    }
    trust_registry_packages(&mut reg, args);
    reg.require(&args.kernels).map_err(Error::Input)?;
    if let Some((path, lock)) = &lock {
        lock.apply(&mut reg).map_err(|e| Error::Input(format!("--lock {}: {e}", path.display())))?;
    }
    // Again, with what the policies left: a dependency they took out leaves out its dependents.
    reg.link();
    Ok(reg)
}

/// Leaves out the registry directories' packages that no trusted key signed (`--trust`), unless
/// `--allow-unsigned`; names each on stderr either way. Drop-in folders and built-ins are the
/// user's own and need no signature.
/// Why a package of `precedence` lacks a trusted signature (`unsigned`, `signed by K, which is
/// not trusted`), or `None` when it needs none (drop-in folders, built-ins) or has one.
pub fn untrusted(
    p: &kiln_registry::Package,
    precedence: u32,
    trust: &[kiln_registry::signing::PublicKey],
) -> Option<String> {
    let from_registry = precedence > kiln_registry::BUILTIN && precedence < kiln_registry::USER;
    if !from_registry || p.signer.as_ref().is_some_and(|s| trust.iter().any(|k| k.to_string() == *s)) {
        return None;
    }
    Some(match &p.signer {
        Some(k) => format!("signed by {k}, which is not trusted"),
        None => "unsigned".to_string(),
    })
}

fn trust_registry_packages(reg: &mut kiln_registry::OpRegistry, args: &PackageArgs) {
    let untrusted: Vec<(String, String)> = reg
        .packages_with_precedence()
        .filter_map(|(p, prec)| untrusted(p, prec, &args.trust).map(|how| (p.id(), format!("{how}; {}", p.origin))))
        .collect();
    if args.allow_unsigned {
        for (id, what) in &untrusted {
            eprintln!("kiln: note: using {id} ({what}) (--allow-unsigned)");
        }
        return;
    }
    for (id, what) in &untrusted {
        eprintln!(
            "kiln: warning: registry package left out: {id} ({what}); trust its publisher with --trust KEY or accept it with --allow-unsigned"
        );
    }
    reg.exclude(|p| {
        untrusted.iter().find(|(id, _)| *id == p.id()).map(|(_, what)| {
            format!("left out: {what}; trust its publisher with --trust KEY or accept it with --allow-unsigned")
        })
    });
}

fn devices(json: bool) -> Result<ExitCode> {
    if !crate::cuda::driver_present() {
        if json {
            // The same schema as with a driver: the (empty) list of devices.
            println!("[]");
        } else {
            println!("no CUDA driver (libcuda) on this machine: kiln runs on the CPU");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let devs = crate::cuda::probe()?;
    if json {
        output::write_json(std::path::Path::new("-"), &devs)?;
        return Ok(ExitCode::SUCCESS);
    }
    if devs.is_empty() {
        println!("no CUDA GPU is visible: kiln runs on the CPU");
    }
    for d in devs {
        println!(
            "cuda:{}  {}  compute capability {}.{} ({})  memory {:.1} GiB ({:.1} GiB free)\n  driver {}.{}  NVRTC {}.{}  cuBLASLt {}",
            d.ordinal,
            d.name,
            d.compute_capability.0,
            d.compute_capability.1,
            d.arch,
            d.total_memory_bytes as f64 / (1u64 << 30) as f64,
            d.free_memory_bytes as f64 / (1u64 << 30) as f64,
            d.driver_version / 1000,
            d.driver_version % 1000 / 10,
            d.nvrtc_version.0,
            d.nvrtc_version.1,
            d.cublaslt_version.map_or("not found".to_string(), |v| v.to_string()),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Writing to a closed pipe (`kiln … | head`) ends the process quietly, as it does a C tool:
/// SIGPIPE back to its default action. Rust ignores SIGPIPE at start-up, which turns the write
/// into an error and `println!` into a panic with a backtrace.
fn quiet_broken_pipe() {
    #[cfg(unix)]
    // SAFETY: sets one signal's disposition to its default, before any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Entry point of the binary.
pub fn main() -> ExitCode {
    quiet_broken_pipe();
    let cli = Cli::parse();
    output::set_quiet(cli.quiet);
    let level = match (cli.quiet, cli.verbose) {
        (true, _) => "error",
        (_, 0) => "warn",
        (_, 1) => "warn,kiln_host=info",
        _ => "warn,kiln_host=debug",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("KILN_LOG").unwrap_or_else(|_| level.into());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(ansi).try_init();
    let result = match cli.command {
        Command::Run(a) => run::run(a),
        Command::Kernels { command } => kernels::run(command),
        Command::Conformance(a) => conformance::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Chat(a) => chat::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Devices { json } => devices(json),
        Command::Verify(a) => verify::run(a),
        Command::Inspect(a) => inspect::run(a),
        Command::Lock(a) => inspect::lock(a),
        Command::Bench { command } => bench::run(command),
        Command::Package { command } => registry::package(command),
        Command::Publish(a) => registry::publish(a),
        Command::Yank(a) => registry::yank(a),
        Command::Search(a) => registry::search(a),
        Command::Key { command } => registry::key(command),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kiln: error: {e}");
            ExitCode::from(exit::of(&e))
        }
    }
}

//! `kiln package pack`, `kiln publish`, `kiln yank`, `kiln search`: `.kpkg` archives and
//! registry directories (docs/REGISTRY.md, `kiln_registry::directory`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use kiln_registry::{archive, RegistryDir};

use crate::{Error, Result};

use super::output::{self, note, say};

/// Environment variable with registry directories, `:`-separated, after those of `--registry`.
pub const REGISTRY_ENV: &str = "KILN_REGISTRY";

/// `--registry DIR` (repeatable) and `KILN_REGISTRY`.
#[derive(Args, Debug, Clone, Default)]
pub struct RegistryArgs {
    /// A registry directory (docs/REGISTRY.md); repeatable; `KILN_REGISTRY` (`:`-separated)
    /// adds more after these. Runs rank their packages below `--packages` folders and above the
    /// built-in ones, the first registry first; `publish` and `yank` write to the first one.
    #[arg(long = "registry", value_name = "DIR")]
    pub registry: Vec<PathBuf>,
}

impl RegistryArgs {
    /// The directories of `--registry`, then those of `KILN_REGISTRY`.
    pub fn dirs(&self) -> Vec<PathBuf> {
        let mut dirs = self.registry.clone();
        if let Some(v) = std::env::var_os(REGISTRY_ENV) {
            dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
        }
        dirs
    }

    /// The one registry a write goes to: the first of [`RegistryArgs::dirs`]. Errors: none given.
    fn target(&self, command: &str) -> Result<RegistryDir> {
        self.dirs().into_iter().next().map(RegistryDir::new).ok_or_else(|| {
            Error::Input(format!("kiln {command} needs a registry directory: --registry DIR or {REGISTRY_ENV}=DIR"))
        })
    }
}

#[derive(Subcommand, Debug)]
pub enum PackageCommand {
    /// Write a package folder (with its built shim.wasm and `[files]` hashes) as a `.kpkg`
    /// archive, after checking that it loads: its manifest, every file's sha256, and its shim
    /// (a valid module of the kernel ABI with the exports kiln calls).
    Pack {
        /// The package folder (it holds kernel.toml).
        dir: PathBuf,
        /// The archive to write (default: NAME-VERSION.kpkg in the current folder); never a path
        /// inside DIR, nor an existing file that is not a `.kpkg`.
        #[arg(short, long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
    /// Scaffold a package folder NAME that builds and passes its own test: kernel.toml (with its
    /// kernel's signature), cuda/kernel.cu, a shim crate in shim/, and a node test in tests/.
    /// Its op computes Y = 2·X over float32: the place to start from.
    New {
        /// The package name: 1 to 64 characters of a-z, 0-9, '-', '_'.
        name: String,
        /// The op it provides, DOMAIN::OP.
        #[arg(long, default_value = "ai.example::Twice")]
        op: String,
        /// Where to create the folder NAME.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// The kiln-kernel-abi crate the shim depends on (default: the source this kiln was built
        /// from).
        #[arg(long, value_name = "PATH")]
        abi_path: Option<PathBuf>,
    },
    /// Build a package folder: the shim in shim/ for wasm32-unknown-unknown (cargo), written as
    /// shim.wasm; every file's sha256 into kernel.toml's [files]; its CUDA sources compiled with
    /// NVRTC (when the library is present, no GPU needed) and each listed kernel found in them;
    /// the checks of `pack`; then the `.kpkg` archive.
    Build {
        /// The package folder (kernel.toml and shim/Cargo.toml; a header-only package has no
        /// shim).
        dir: PathBuf,
        /// The archive to write (default: NAME-VERSION.kpkg beside the package folder).
        #[arg(short, long, value_name = "FILE")]
        output: Option<PathBuf>,
        /// The GPU architecture to compile the CUDA sources for, `sm_XY` (default: the first
        /// GPU's, else the lowest that NVRTC and the package's min_compute_capability allow).
        /// Given, NVRTC must be present.
        #[arg(long, value_name = "sm_XY")]
        arch: Option<String>,
        /// A folder of packages the package's `[dependencies]` may come from (repeatable;
        /// `KILN_PACKAGE_PATH` adds more), above the registries and the built-in packages.
        #[arg(long = "packages", value_name = "DIR")]
        packages: Vec<PathBuf>,
        #[command(flatten)]
        registries: RegistryArgs,
    },
}

/// `kiln publish`.
#[derive(Args, Debug)]
pub struct PublishArgs {
    /// A `.kpkg` archive (`kiln package pack`).
    pub archive: PathBuf,
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// Sign the index line with this secret key (`kiln key new`): runs that trust its public
    /// key accept the package (docs/REGISTRY.md, "Signatures").
    #[arg(long, value_name = "KEY_FILE")]
    pub sign: Option<PathBuf>,
}

#[derive(Subcommand, Debug)]
pub enum KeyCommand {
    /// Write a new ed25519 secret key to FILE (mode 0600; never over an existing file) and print
    /// its public key.
    New {
        /// The secret-key file to write (keep it private; `publish --sign FILE` reads it).
        #[arg(short, long, value_name = "FILE")]
        output: PathBuf,
    },
    /// Print the public key (for `--trust`) of a secret-key file.
    Public {
        /// A secret-key file (`kiln key new`).
        file: PathBuf,
    },
}

/// `kiln key`.
pub fn key(cmd: KeyCommand) -> Result<ExitCode> {
    match cmd {
        KeyCommand::New { output } => {
            let key = kiln_registry::signing::SecretKey::generate().map_err(Error::Input)?;
            key.write(&output)
                .map_err(|e| Error::Input(format!("kiln key new -o: {e} (kiln never overwrites a key)")))?;
            println!("{}", key.public());
            eprintln!(
                "kiln: secret key written to {}; publish with --sign {0}, trust its public key with --trust",
                output.display()
            );
            Ok(ExitCode::SUCCESS)
        }
        KeyCommand::Public { file } => {
            let key = kiln_registry::signing::SecretKey::read(&file).map_err(Error::Input)?;
            println!("{}", key.public());
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `kiln yank`.
#[derive(Args, Debug)]
pub struct YankArgs {
    /// The version to yank: NAME@VERSION.
    pub package: String,
    /// Un-yank it instead.
    #[arg(long)]
    pub undo: bool,
    #[command(flatten)]
    pub registry: RegistryArgs,
}

/// `kiln search`.
#[derive(Args, Debug)]
pub struct SearchArgs {
    /// An op: `OP` in any domain, or `DOMAIN::OP` (`com.microsoft::GroupQueryAttention`).
    pub op: String,
    #[command(flatten)]
    pub registry: RegistryArgs,
    /// Write the matching index lines as JSON (`-` for standard output).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
}

/// Compiles and validates the package's shim (exports, ABI version), as a run would (a
/// header-only package has none).
fn check_shim(pkg: &kiln_registry::Package) -> Result<()> {
    if pkg.manifest.is_header_only() {
        return Ok(());
    }
    let sandbox = crate::sandbox::Sandbox::new(super::sandbox_config()).map_err(Error::from)?;
    sandbox.load(&pkg.id(), &pkg.shim, pkg.manifest.kernel_signatures()).map_err(Error::from)?;
    Ok(())
}

pub fn package(cmd: PackageCommand) -> Result<ExitCode> {
    match cmd {
        PackageCommand::Pack { dir, output } => {
            pack_to(&dir, |pkg| output.unwrap_or_else(|| PathBuf::from(archive_name(pkg))))?;
            Ok(ExitCode::SUCCESS)
        }
        PackageCommand::New { name, op, dir, abi_path } => super::scaffold::new_package(&name, &op, &dir, abi_path),
        PackageCommand::Build { dir, output, arch, packages, registries } => {
            let sources = (crate::packages::search_path(&packages), registries.dirs());
            super::scaffold::build_package(&dir, output, arch, &sources)
        }
    }
}

/// `NAME-VERSION.kpkg`, the default file name of a package's archive.
pub(super) fn archive_name(pkg: &kiln_registry::Package) -> String {
    format!("{}-{}.kpkg", pkg.name(), pkg.version())
}

/// Archives package folder `dir` as `out(package)` after checking that it loads (manifest,
/// hashes, the shim's exports and ABI version); prints the package and the archive.
pub(super) fn pack_to(dir: &std::path::Path, out: impl FnOnce(&kiln_registry::Package) -> PathBuf) -> Result<()> {
    let bytes = archive::pack(dir)?;
    let pkg = archive::unpack(&dir.display().to_string(), &bytes)?;
    check_shim(&pkg)?;
    let out = out(&pkg);
    let inside = match (std::path::absolute(&out), std::fs::canonicalize(dir)) {
        (Ok(o), Ok(d)) => {
            let parent = o.parent().and_then(|p| std::fs::canonicalize(p).ok()).unwrap_or(o.clone());
            parent.starts_with(&d)
        }
        _ => false,
    };
    if inside {
        return Err(Error::Input(format!(
            "-o {}: the archive must not be written inside the package folder {}",
            out.display(),
            dir.display()
        )));
    }
    if out.exists() && out.extension().is_none_or(|e| e != "kpkg") {
        return Err(Error::Input(format!(
            "-o {}: the file exists and is not a .kpkg archive; not overwriting it",
            out.display()
        )));
    }
    std::fs::write(&out, &bytes).map_err(|source| Error::Io { path: out.clone(), source })?;
    println!("{}: {} ({} bytes)", pkg.id(), out.display(), bytes.len());
    Ok(())
}

pub fn publish(a: PublishArgs) -> Result<ExitCode> {
    let reg = a.registry.target("publish")?;
    if a.archive.is_dir() {
        return Err(Error::Input(format!(
            "{} is a folder: publish takes a .kpkg archive (`kiln package pack {}` makes one)",
            a.archive.display(),
            a.archive.display()
        )));
    }
    let bytes = std::fs::read(&a.archive).map_err(|source| Error::Io { path: a.archive.clone(), source })?;
    check_shim(&archive::unpack(&a.archive.display().to_string(), &bytes)?)?;
    let key = a
        .sign
        .as_deref()
        .map(kiln_registry::signing::SecretKey::read)
        .transpose()
        .map_err(|e| Error::Input(format!("--sign: {e}")))?;
    let line = reg.publish_signed(&a.archive.display().to_string(), &bytes, key.as_ref())?;
    let signed = key.map_or(String::new(), |k| format!(", signed by {}", k.public()));
    println!("published {} to {} (sha256 {}{signed})", line.id(), reg.root.display(), line.cksum);
    Ok(ExitCode::SUCCESS)
}

pub fn yank(a: YankArgs) -> Result<ExitCode> {
    let reg = a.registry.target("yank")?;
    let (name, version) =
        a.package.split_once('@').ok_or_else(|| Error::Input(format!("yank: {:?} is not NAME@VERSION", a.package)))?;
    let version: kiln_registry::Version =
        version.parse().map_err(|e| Error::Input(format!("yank: version {version:?} of {name}: {e}")))?;
    let line = reg.yank(name, &version, !a.undo)?;
    println!("{} {} in {}", line.id(), if line.yanked { "yanked" } else { "un-yanked" }, reg.root.display());
    Ok(ExitCode::SUCCESS)
}

pub fn search(a: SearchArgs) -> Result<ExitCode> {
    let dirs = a.registry.dirs();
    if dirs.is_empty() {
        return Err(Error::Input(format!(
            "kiln search needs a registry directory: --registry DIR or {REGISTRY_ENV}=DIR"
        )));
    }
    output::check_path("--json", &a.json)?;
    let human = output::Human::new(&[&a.json]);
    let mut found = Vec::new();
    for d in dirs {
        let reg = RegistryDir::new(&d);
        for line in reg.search(&a.op)? {
            found.push((d.display().to_string(), line));
        }
    }
    if let Some(p) = &a.json {
        let doc: Vec<serde_json::Value> =
            found.iter().map(|(r, l)| serde_json::json!({ "registry": r, "index": l })).collect();
        output::write_json(p, &doc)?;
    }
    for (r, l) in &found {
        let ops: Vec<String> = l
            .ops
            .iter()
            .filter(|e| !e.op_types.is_empty())
            .map(|e| format!("{} opset {}.. ({})", e.op_types.join(", "), e.since_opset, e.dtypes.join(", ")))
            .collect();
        let yanked = if l.yanked { "  [yanked]" } else { "" };
        say!(human, "{}  ({r}){yanked}\n  {}", l.id(), ops.join("\n  "));
    }
    if found.is_empty() {
        note!("no package in the registries provides {}", a.op);
    }
    Ok(ExitCode::SUCCESS)
}

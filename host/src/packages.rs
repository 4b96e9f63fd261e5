//! Where packages come from: the built-in ones embedded in the binary, drop-in folders
//! (`--packages DIR`, `KILN_PACKAGE_PATH`) and registry directories (`--registry DIR`,
//! `KILN_REGISTRY`). A folder is either one package (it holds `kernel.toml`) or a folder of
//! packages. Precedence (DESIGN.md): drop-in folders, then registries in the order given, then
//! the built-ins; the highest version within one source.

use std::path::{Path, PathBuf};

use kiln_registry::{OpRegistry, Package, RegistryError};

/// Environment variable with extra package folders, `:`-separated.
pub const PACKAGE_PATH_ENV: &str = "KILN_PACKAGE_PATH";

/// The built-in packages, verified like any other.
pub fn builtin() -> Vec<Result<Package, RegistryError>> {
    kiln_builtin_kernels::PACKAGES.iter().map(|p| Package::load_files(&format!("builtin:{}", p.dir), p.files)).collect()
}

/// Package folders under `dir` (itself, when it is a package).
pub fn package_dirs(dir: &Path) -> Result<Vec<PathBuf>, RegistryError> {
    if dir.join("kernel.toml").is_file() {
        return Ok(vec![dir.to_path_buf()]);
    }
    let io = |source| RegistryError::Io { origin: dir.display().to_string(), path: dir.to_path_buf(), source };
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("kernel.toml").is_file())
        .collect();
    dirs.sort();
    Ok(dirs)
}

/// The folders of `--packages` followed by those of `KILN_PACKAGE_PATH`.
pub fn search_path(cli: &[PathBuf]) -> Vec<PathBuf> {
    let mut dirs = cli.to_vec();
    if let Some(v) = std::env::var_os(PACKAGE_PATH_ENV) {
        dirs.extend(std::env::split_paths(&v).filter(|p| !p.as_os_str().is_empty()));
    }
    dirs
}

/// An op registry of the drop-in folders' packages, the registry directories' published
/// versions that are not yanked, and the built-in packages, in that precedence (module docs),
/// linked ([`OpRegistry::link`]: a package whose dependencies no source meets is left out).
/// Packages that fail to load are left out and returned as errors (a registry's published ones
/// as [`RegistryError::Published`]), so one broken package does not stop the others.
pub fn registry(dirs: &[PathBuf], registries: &[PathBuf]) -> (OpRegistry, Vec<RegistryError>) {
    let mut reg = OpRegistry::new();
    let mut errors = Vec::new();
    for dir in dirs {
        match package_dirs(dir) {
            Ok(pkgs) => {
                for p in pkgs {
                    match Package::load_dir(&p) {
                        Ok(pkg) => {
                            reg.add(pkg, kiln_registry::USER);
                        }
                        Err(e) => errors.push(e),
                    }
                }
            }
            Err(e) => errors.push(e),
        }
    }
    // After the drop-in folders (`OpRegistry::add` keeps the first copy of a name@version, so
    // the sources are added in precedence order).
    for (i, dir) in registries.iter().enumerate() {
        for p in kiln_registry::RegistryDir::new(dir).load_all() {
            match p {
                Ok(pkg) => {
                    reg.add(pkg, kiln_registry::registry_precedence(i));
                }
                Err(e) => errors.push(e),
            }
        }
    }
    for p in builtin() {
        match p {
            Ok(pkg) => {
                reg.add(pkg, kiln_registry::BUILTIN);
            }
            Err(e) => errors.push(e),
        }
    }
    // Each package's dependencies resolved into its headers, and the packages whose
    // dependencies cannot be met left out with the reason (`kernels list` shows them); the CLI
    // links again after its policies, and so does `Runtime::new`.
    reg.link();
    (reg, errors)
}

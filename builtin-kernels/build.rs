//! Builds the in-tree kernel packages of `kernels/` and embeds them.
//!
//! 1. `cargo build --release --target wasm32-unknown-unknown` over the `kernels/` workspace,
//!    into `<target>/kiln-kernels` (a target directory of its own, so this nested cargo never
//!    waits on the outer one's lock).
//! 2. Each package `kernels/<dir>/` is assembled into `$OUT_DIR/packages/<dir>/`: its
//!    `kernel.toml` with a `[files]` table of sha256 hashes appended, `cuda/*`, `include/*`
//!    (exported headers), and the shim crate `kernels/<dir>/shim` (named `kiln-<dir>-shim`) as
//!    `shim.wasm` (a header-only package, one without `shim/`, has none).
//! 3. `$OUT_DIR/builtin.rs` lists every file with `include_bytes!`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::{env, fs};

use sha2::{Digest, Sha256};

const TARGET: &str = "wasm32-unknown-unknown";

fn main() {
    let manifest_dir = PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap());
    let root = manifest_dir.parent().unwrap().to_path_buf();
    let kernels = root.join("kernels");
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed={}", root.join("kernel-abi/src").display());
    println!("cargo:rerun-if-changed={}", root.join("kernel-abi/Cargo.toml").display());

    require_wasm_target();
    let target_dir = cargo_target_root(&out_dir).join("kiln-kernels");
    let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let mut cmd = Command::new(cargo);
    cmd.args(["build", "--release", "--target", TARGET, "--manifest-path"])
        .arg(kernels.join("Cargo.toml"))
        .arg("--target-dir")
        .arg(&target_dir);
    for var in [
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_RUSTFLAGS",
        "CARGO_TARGET_DIR",
        "CARGO_BUILD_TARGET",
        "RUSTC_WORKSPACE_WRAPPER",
    ] {
        cmd.env_remove(var);
    }
    // Wasm SIMD128 (which wasmtime compiles to SSE/AVX): the shims' CPU loops vectorize.
    cmd.env("CARGO_ENCODED_RUSTFLAGS", "-Ctarget-feature=+simd128");
    let status = cmd.status().expect("could not run cargo to build the kernel shims");
    if !status.success() {
        panic!("building the kernel shims (kernels/) for {TARGET} failed; see the compiler output above");
    }
    let wasm_dir = target_dir.join(TARGET).join("release");

    let pkg_root = out_dir.join("packages");
    let _ = fs::remove_dir_all(&pkg_root);
    let mut entries = String::new();
    let mut dirs: Vec<_> = fs::read_dir(&kernels)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.join("kernel.toml").is_file())
        .collect();
    dirs.sort();
    for dir in dirs {
        let name = dir.file_name().unwrap().to_string_lossy().into_owned();
        let dest = pkg_root.join(&name);
        let files = assemble(&dir, &dest, &wasm_dir.join(format!("kiln_{}_shim.wasm", name.replace('-', "_"))));
        entries.push_str(&format!("    EmbeddedPackage {{ dir: {name:?}, files: &[\n"));
        for rel in files {
            let abs = dest.join(&rel);
            entries.push_str(&format!("        ({rel:?}, include_bytes!({:?})),\n", abs.display().to_string()));
        }
        entries.push_str("    ] },\n");
    }
    fs::write(out_dir.join("builtin.rs"), format!("pub static PACKAGES: &[EmbeddedPackage] = &[\n{entries}];\n"))
        .unwrap();
}

/// Copies one package into `dest` and writes its manifest with `[files]`; returns the
/// package-relative paths of every file, `kernel.toml` first.
fn assemble(src: &Path, dest: &Path, wasm: &Path) -> Vec<String> {
    fs::create_dir_all(dest).unwrap();
    let manifest = fs::read_to_string(src.join("kernel.toml")).unwrap();
    assert!(!manifest.contains("[files]"), "{}: [files] is written by the build; remove it", src.display());
    let mut files = vec![];
    for sub in ["cuda", "include"] {
        if !src.join(sub).is_dir() {
            continue;
        }
        fs::create_dir_all(dest.join(sub)).unwrap();
        let mut found: Vec<_> = fs::read_dir(src.join(sub)).unwrap().filter_map(|e| e.ok()).map(|e| e.path()).collect();
        found.sort();
        for f in found {
            let rel = format!("{sub}/{}", f.file_name().unwrap().to_string_lossy());
            fs::copy(&f, dest.join(&rel)).unwrap();
            files.push(rel);
        }
    }
    if src.join("shim").is_dir() {
        let bytes = fs::read(wasm).unwrap_or_else(|e| panic!("shim {} was not built: {e}", wasm.display()));
        fs::write(dest.join("shim.wasm"), bytes).unwrap();
        files.push("shim.wasm".into());
    }
    let mut text = manifest;
    text.push_str("\n# Written by the build (builtin-kernels/build.rs).\n[files]\n");
    for rel in &files {
        let hash = hex::encode(Sha256::digest(fs::read(dest.join(rel)).unwrap()));
        text.push_str(&format!("{rel:?} = \"{hash}\"\n"));
    }
    fs::write(dest.join("kernel.toml"), text).unwrap();
    files.insert(0, "kernel.toml".into());
    files
}

/// Stops the build with the command to run when the wasm32 target's standard library is absent.
fn require_wasm_target() {
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let sysroot = Command::new(rustc)
        .args(["--print", "sysroot"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    let present = sysroot.map(|s| Path::new(&s).join("lib/rustlib").join(TARGET).is_dir()).unwrap_or(false);
    if !present {
        panic!("\n\nThe kernel shims are built for {TARGET}, whose standard library is not installed.\nRun:\n\n    rustup target add {TARGET}\n\nthen build again.\n");
    }
}

/// The root of the cargo target directory holding `out_dir` (where cargo writes CACHEDIR.TAG).
fn cargo_target_root(out_dir: &Path) -> PathBuf {
    out_dir
        .ancestors()
        .find(|p| p.join("CACHEDIR.TAG").is_file())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| out_dir.join("kernels-target"))
}

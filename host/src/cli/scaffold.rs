//! `kiln package new` and `kiln package build`: writing a kernel package from scratch.
//!
//! `new` lays out a package that builds and passes its own test as it stands: `kernel.toml`
//! (schema 2, with its kernel's signature), `cuda/kernel.cu`, a `no_std` shim crate in `shim/`
//! and one node test in `tests/` (the ONNX node-test layout: `model.onnx`,
//! `test_data_set_0/{input_0,output_0}.pb`). Its op computes `Y = 2·X` over float32, on the CPU
//! in the shim and on the GPU in the kernel: the place to start from.
//!
//! `build` compiles the shim for `wasm32-unknown-unknown` with cargo, writes it as `shim.wasm`,
//! records every package file's sha256 in `kernel.toml`'s `[files]`, checks the package as a run
//! loads it (manifest, signatures, hashes, the shim's exports and ABI version), and writes the
//! `.kpkg` archive (`kiln_registry::archive`).

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

use onnx_protobuf::{
    tensor_shape_proto, type_proto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto,
};
use protobuf::{Message, MessageField};
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// The kernel-abi crate the scaffold's shim depends on by default: the one this kiln was built
/// from, when its source is still there.
fn default_abi_path() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../kernel-abi");
    p.join("Cargo.toml").is_file().then(|| std::fs::canonicalize(&p).unwrap_or(p))
}

/// `DOMAIN::OP` or `OP` (domain `""`, ai.onnx).
fn split_op(op: &str) -> Result<(String, String)> {
    let (domain, name) = op.rsplit_once("::").unwrap_or(("", op));
    let ident = |s: &str| {
        s.chars().next().is_some_and(|c| c.is_ascii_alphabetic())
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    };
    if !ident(name) || !domain.chars().all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '_' || c == '-') {
        return Err(Error::Input(format!("--op {op:?}: expected DOMAIN::OP such as ai.example::Twice")));
    }
    Ok((domain.to_string(), name.to_string()))
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
    }
    std::fs::write(path, bytes).map_err(|source| Error::Io { path: path.to_path_buf(), source })
}

/// `kiln package new NAME [--op DOMAIN::OP] [--dir PARENT] [--abi-path PATH]`.
pub fn new_package(name: &str, op: &str, parent: &Path, abi_path: Option<PathBuf>) -> Result<ExitCode> {
    // A package name that also makes a C identifier (the kernel) and a cargo crate (the shim).
    if !kiln_kernel_abi::manifest::is_package_name(name) || !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        return Err(Error::Input(format!(
            "package name {name:?}: a letter a-z, then up to 63 characters of a-z, 0-9, '-', '_'"
        )));
    }
    let (domain, op_type) = split_op(op)?;
    let abi = abi_path.or_else(default_abi_path).ok_or_else(|| {
        Error::Input(
            "the kiln-kernel-abi source this kiln was built from is gone: pass --abi-path KILN/kernel-abi".into(),
        )
    })?;
    if !abi.join("Cargo.toml").is_file() {
        return Err(Error::Input(format!(
            "--abi-path {}: no Cargo.toml there (the kernel-abi crate of kiln)",
            abi.display()
        )));
    }
    let dir = parent.join(name);
    if dir.exists() {
        return Err(Error::Input(format!("{} exists; kiln package new writes a new folder", dir.display())));
    }
    let ident = name.replace('-', "_");
    let template = format!("{ident}_twice");
    let kernel = kiln_kernel_abi::names::kernel_name(&template, &["kiln_tag_f32"]);
    let domain_line = if domain.is_empty() { String::new() } else { format!("domain = \"{domain}\"\n") };
    let manifest = format!(
        r#"# {name}: {op_type}, Y = 2·X over float32 (scaffolded by `kiln package new`; make it yours).
# kernel-abi/ABI.md §7 describes every field; `kiln package build {name}` fills [files].
schema = 6
abi = 1
shim = "shim.wasm"

[package]
name = "{name}"
version = "0.1.0"
description = "{op_type}: Y = 2·X"
license = "Apache-2.0"

[device]
min_compute_capability = "7.0"

[[ops]]
{domain_line}op_types = ["{op_type}"]
since_opset = 1
dtypes = ["float32"]
max_rank = 8

[[cuda]]
source = "cuda/kernel.cu"
# The instantiations of cuda/kernel.cu's templates that the shim launches, by their C++ name
# expressions; one per dtype the op takes (ABI.md §7.3).
kernels = ["{kernel}"]
# One parameter kind per C parameter, in order (ABI.md §7.3); `*` stands for any characters.
signatures = [{{ kernels = ["{template}<*>"], params = ["tensor", "tensor", "u64"] }}]
"#
    );
    let cuda = format!(
        r#"// {name}: {op_type}, Y = 2·X. "kiln.cuh" is kiln's prelude (kiln_u64, KILN_FOR, the dtype
// tags kiln_tag_f32 … with their `storage` types, kiln_to_f32 / kiln_from_f32, ...); the
// parameters must match the signature in kernel.toml, which lists the instantiations NVRTC
// compiles ({kernel}: float32; kiln_tag_f16 or kiln_tag_bf16 would work as well).
#include "kiln.cuh"

template <typename Tag>
__global__ void {template}(const typename Tag::storage* x, typename Tag::storage* y, kiln_u64 n) {{
    KILN_FOR(i, n) y[i] = kiln_from_f32(Tag(), 2.f * kiln_to_f32(Tag(), x[i]));
}}
"#
    );
    let cargo = format!(
        r#"[package]
name = "{name}-shim"
version = "0.1.0"
edition = "2021"
publish = false

[lib]
crate-type = ["cdylib"]

[dependencies]
kiln-kernel-abi = {{ path = "{}", default-features = false, features = ["guest"] }}

[profile.release]
panic = "abort"
opt-level = 3

[profile.dev]
panic = "abort"

# A workspace of its own, so that it builds inside another cargo workspace too.
[workspace]
"#,
        abi.display().to_string().replace('\\', "/")
    );
    let shim = format!(
        r#"//! Shim of {name}: {op_type}, Y = 2·X over float32 (kernel-abi/ABI.md; `kiln_kernel_abi::guest`).
//! `infer` gives the output's dtype and shape, `cpu` computes it on the host, `dispatch` records
//! the GPU launch of cuda/kernel.cu.
#![no_std]
extern crate alloc;

use alloc::vec::Vec;
use kiln_kernel_abi::guest::*;
use kiln_kernel_abi::names::kernel_name;
use kiln_kernel_abi::{{export_shim, unsupported}};

struct Op;

impl Shim for Op {{
    fn infer(call: &Call) -> Result<Vec<TensorType>> {{
        let x = call.input(0)?;
        let dtype = x.dtype()?;
        if dtype != DType::F32 {{
            unsupported!("{op_type}: dtype {{dtype}} (this package handles float32)");
        }}
        Ok(vec![TensorType::new(dtype, x.shape()?)])
    }}

    fn cpu(call: &Call) -> Result<()> {{
        let x: Vec<f32> = call.input(0)?.read_vec()?;
        call.output(0)?.write_vec(&x.iter().map(|v| 2.0 * v).collect::<Vec<_>>())
    }}

    fn dispatch(call: &Call) -> Result<()> {{
        let (x, y) = (call.input(0)?, call.output(0)?);
        let n = x.numel()? as u64;
        if n == 0 {{
            return Ok(());
        }}
        // The instantiation for x's dtype, as kernel.toml names it: {kernel}.
        let Some(tag) = x.dtype()?.cuda_tag() else {{
            unsupported!("{op_type}: no CUDA kernel for {{}}", x.dtype()?);
        }};
        launch(&Launch {{
            kernel: &kernel_name("{template}", &[tag]),
            grid: [n.div_ceil(256).min(65535) as u32, 1, 1],
            block: [256, 1, 1],
            shared_mem_bytes: 0,
            args: vec![
                KernelArg::Tensor {{ handle: x.handle(), offset: 0 }},
                KernelArg::Tensor {{ handle: y.handle(), offset: 0 }},
                KernelArg::U64(n),
            ],
        }})
    }}
}}

export_shim!(Op);
"#
    );
    write(&dir.join("kernel.toml"), manifest.as_bytes())?;
    write(&dir.join("cuda/kernel.cu"), cuda.as_bytes())?;
    write(&dir.join("shim/Cargo.toml"), cargo.as_bytes())?;
    write(&dir.join("shim/src/lib.rs"), shim.as_bytes())?;
    write(&dir.join(".gitignore"), b"/shim/target\n")?;
    let test = dir.join(format!("tests/test_{}", op_type.to_lowercase()));
    let x: Vec<f32> = vec![1.0, -2.5, 0.0, 3.25, -0.5, 8.0];
    write(&test.join("model.onnx"), &node_test_model(&domain, &op_type, &[2, 3])?)?;
    write(&test.join("test_data_set_0/input_0.pb"), &tensor_pb("x", &[2, 3], &x)?)?;
    let y: Vec<f32> = x.iter().map(|v| 2.0 * v).collect();
    write(&test.join("test_data_set_0/output_0.pb"), &tensor_pb("y", &[2, 3], &y)?)?;
    println!(
        "{}: package {name} with op {}",
        dir.display(),
        if domain.is_empty() { op_type.clone() } else { format!("{domain}::{op_type}") }
    );
    println!("next: kiln package build {0} && kiln verify {0} --node-tests {0}/tests --device auto", dir.display());
    Ok(ExitCode::SUCCESS)
}

/// A one-node model `y = OP(x)`, x and y float32 of `dims`, opset 1 of `domain` (and 21 of
/// ai.onnx).
fn node_test_model(domain: &str, op_type: &str, dims: &[i64]) -> Result<Vec<u8>> {
    let value = |name: &str| ValueInfoProto {
        name: name.into(),
        type_: MessageField::some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: 1,
                shape: MessageField::some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|&d| tensor_shape_proto::Dimension {
                            value: Some(tensor_shape_proto::dimension::Value::DimValue(d)),
                            ..Default::default()
                        })
                        .collect(),
                    ..Default::default()
                }),
                ..Default::default()
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    let mut opsets = vec![OperatorSetIdProto { domain: String::new(), version: 21, ..Default::default() }];
    if !domain.is_empty() {
        opsets.push(OperatorSetIdProto { domain: domain.into(), version: 1, ..Default::default() });
    }
    let model = ModelProto {
        ir_version: 10,
        opset_import: opsets,
        graph: MessageField::some(GraphProto {
            name: format!("test_{}", op_type.to_lowercase()),
            node: vec![NodeProto {
                op_type: op_type.into(),
                domain: domain.into(),
                input: vec!["x".into()],
                output: vec!["y".into()],
                ..Default::default()
            }],
            input: vec![value("x")],
            output: vec![value("y")],
            ..Default::default()
        }),
        ..Default::default()
    };
    model.write_to_bytes().map_err(|e| Error::Input(format!("cannot write the node test's model: {e}")))
}

/// A float32 `TensorProto` file (`test_data_set_0/*.pb`).
fn tensor_pb(name: &str, dims: &[i64], v: &[f32]) -> Result<Vec<u8>> {
    let t = TensorProto {
        name: name.into(),
        data_type: 1,
        dims: dims.to_vec(),
        float_data: v.to_vec(),
        ..Default::default()
    };
    t.write_to_bytes().map_err(|e| Error::Input(format!("cannot write the node test's data: {e}")))
}

/// Where a package's `[dependencies]` come from when it is built: drop-in folders and registry
/// directories (the built-in packages come last).
pub type DependencySources = (Vec<PathBuf>, Vec<PathBuf>);

/// `kiln package build DIR [-o OUT.kpkg] [--arch sm_XY] [--packages DIR] [--registry DIR]`.
pub fn build_package(
    dir: &Path,
    output: Option<PathBuf>,
    arch: Option<String>,
    sources: &DependencySources,
) -> Result<ExitCode> {
    let shim_crate = dir.join("shim/Cargo.toml");
    let no_manifest = || {
        Error::Input(format!(
            "{}: a package folder to build has kernel.toml and a shim crate in shim/ (kiln package new makes one), \
             or is header-only (schema 4: `headers`, no [[ops]])",
            dir.display()
        ))
    };
    let manifest_text = std::fs::read_to_string(dir.join("kernel.toml")).map_err(|_| no_manifest())?;
    let manifest = kiln_kernel_abi::manifest::Manifest::parse(&manifest_text)
        .map_err(|e| Error::Input(format!("{}: {e}", dir.join("kernel.toml").display())))?;
    if !manifest.is_header_only() && !shim_crate.is_file() {
        return Err(no_manifest());
    }
    // The archive's folder must exist before anything in the package folder is rewritten.
    if let Some(parent) = output.as_deref().and_then(Path::parent).filter(|p| !p.as_os_str().is_empty()) {
        if !parent.is_dir() {
            return Err(Error::Input(format!("-o: folder {} does not exist", parent.display())));
        }
    }
    // 1. The shim, for wasm32-unknown-unknown (a header-only package has none).
    if !manifest.is_header_only() {
        let wasm = build_shim(&shim_crate, &dir.join("shim/target"))?;
        write(&dir.join(&manifest.shim), &wasm)?;
    }
    // 2. [files]: the shim, every CUDA source and header.
    let mut files: Vec<String> = (!manifest.shim.is_empty()).then(|| manifest.shim.clone()).into_iter().collect();
    files.extend(manifest.cuda.iter().map(|c| c.source.clone()));
    files.extend(manifest.headers.iter().cloned());
    files.sort();
    files.dedup();
    let mut table = String::from("[files]\n");
    for rel in &files {
        let bytes = std::fs::read(dir.join(rel)).map_err(|source| Error::Io { path: dir.join(rel), source })?;
        table.push_str(&format!("\"{rel}\" = \"{}\"\n", hex::encode(Sha256::digest(&bytes))));
    }
    write(&dir.join("kernel.toml"), with_files_table(&manifest_text, &table).as_bytes())?;
    // 3. The CUDA sources, through NVRTC as a run will compile them.
    compile_cuda(dir, &manifest, arch, sources)?;
    // 4. Checks and the archive, as `kiln package pack` does them.
    // By default beside the folder (never inside it, which `pack` refuses).
    super::registry::pack_to(dir, |pkg| {
        output.unwrap_or_else(|| {
            let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
            dir.parent().unwrap_or(Path::new(".")).join(super::registry::archive_name(pkg))
        })
    })?;
    Ok(ExitCode::SUCCESS)
}

/// Compiles the package's CUDA sources with NVRTC for `arch` (default: the first GPU's, else
/// the lowest that NVRTC and the manifest's minimum compute capability allow) and checks their
/// kernels ([`crate::cuda::compile_package`]). Without NVRTC it says so and goes on, unless
/// `arch` was asked for. Errors: a bad `--arch`, a source that does not compile, a listed
/// kernel it does not define.
fn compile_cuda(
    dir: &Path,
    manifest: &kiln_kernel_abi::manifest::Manifest,
    arch: Option<String>,
    sources: &DependencySources,
) -> Result<()> {
    if manifest.cuda.is_empty() && manifest.headers.is_empty() {
        return Ok(());
    }
    if let Some(a) = &arch {
        let digits = a.strip_prefix("sm_").filter(|d| d.len() >= 2 && d.chars().all(|c| c.is_ascii_digit()));
        if digits.is_none() {
            return Err(Error::Input(format!("--arch {a}: give a GPU architecture as sm_XY, for example sm_90")));
        }
    }
    let Some((major, minor)) = crate::cuda::nvrtc_version() else {
        if arch.is_some() {
            return Err(Error::Input(
                "--arch: NVRTC (libnvrtc) is not available to compile the CUDA sources: install the CUDA toolkit, \
                 or `pip install nvidia-cuda-nvrtc` and put its lib folder on LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let what = if manifest.cuda.is_empty() { "CUDA headers" } else { "CUDA sources" };
        eprintln!(
            "{what} not compiled: NVRTC (libnvrtc) is not available here; a GPU run compiles them when it loads \
             the package (`--arch sm_XY` with NVRTC present checks them now)"
        );
        return Ok(());
    };
    // Without a GPU: the lowest architecture this NVRTC compiles for that the package allows.
    let lowest = || {
        let min = manifest.device.min_compute_capability.as_deref().and_then(|cc| {
            let (a, b) = cc.split_once('.')?;
            Some(a.parse::<i32>().ok()? * 10 + b.parse::<i32>().ok()?)
        });
        let archs = crate::cuda::nvrtc_archs();
        archs.into_iter().find(|&a| a >= min.unwrap_or(0)).map(|a| format!("sm_{a}"))
    };
    let gpu =
        || (crate::cuda::device_count() > 0).then(|| crate::cuda::open_context(0).ok()).flatten().map(|c| c.2.arch);
    let Some(arch) = arch.or_else(gpu).or_else(lowest) else {
        return Err(Error::Input(format!(
            "NVRTC {major}.{minor} compiles for no architecture that kernel.toml's min_compute_capability allows"
        )));
    };
    let headers = build_includes(dir, manifest, sources)?;
    if manifest.cuda.is_empty() {
        // A header-only package: a source that includes each of its headers.
        let source: String =
            manifest.headers.iter().map(|h| format!("#include \"{}\"\n", manifest.include_name(h))).collect();
        let name = &manifest.package.name;
        crate::cuda::compile_cached(name, "(each header)", &source, &headers, &arch, &[])
            .map_err(|e| Error::Input(e.to_string()))?;
        eprintln!("compiled {} header(s) for {arch} with NVRTC {major}.{minor}", manifest.headers.len());
        return Ok(());
    }
    let n = crate::cuda::compile_package(dir, manifest, &headers, &arch)?;
    eprintln!("compiled {n} CUDA source(s) for {arch} with NVRTC {major}.{minor}: every listed kernel is defined");
    Ok(())
}

/// The headers the package's CUDA sources may include, by include name: its own `headers` (read
/// from `dir`) and its dependencies', resolved against `sources` and the built-in packages as
/// a run resolves them. Errors: a header that cannot be read, a dependency no source meets.
fn build_includes(
    dir: &Path,
    manifest: &kiln_kernel_abi::manifest::Manifest,
    sources: &DependencySources,
) -> Result<std::collections::BTreeMap<String, String>> {
    let mut own = std::collections::BTreeMap::new();
    for h in &manifest.headers {
        let path = dir.join(h);
        let text = std::fs::read_to_string(&path).map_err(|source| Error::Io { path, source })?;
        own.insert(manifest.include_name(h), text);
    }
    if manifest.dependencies.is_empty() {
        return Ok(own);
    }
    let (reg, _) = crate::packages::registry(&sources.0, &sources.1);
    let id = format!("{}@{}", manifest.package.name, manifest.package.version);
    reg.includes_for(&id, &own, &manifest.dependencies).map_err(Error::Input)
}

/// Builds the shim crate `shim_crate` for wasm32-unknown-unknown into `target`; returns the
/// module's bytes. Errors: cargo missing or failing, naming the crate.
fn build_shim(shim_crate: &Path, target: &Path) -> Result<Vec<u8>> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(&cargo)
        .args(["build", "--release", "--target", "wasm32-unknown-unknown", "--manifest-path"])
        .arg(shim_crate)
        .arg("--target-dir")
        .arg(target)
        // The package's own build, not whatever build this kiln runs inside.
        .env_remove("CARGO_TARGET_DIR")
        .env_remove("RUSTFLAGS")
        .env_remove("CARGO_ENCODED_RUSTFLAGS")
        .status()
        .map_err(|e| {
            Error::Input(format!("cannot run cargo ({}): {e}; install Rust from rustup.rs", cargo.to_string_lossy()))
        })?;
    if !status.success() {
        return Err(Error::Input(format!(
            "cargo could not build the shim {} ({status}); `rustup target add wasm32-unknown-unknown` if the target is missing",
            shim_crate.display()
        )));
    }
    let crate_name = shim_crate_name(shim_crate)?;
    let wasm_path =
        target.join("wasm32-unknown-unknown/release").join(format!("{}.wasm", crate_name.replace('-', "_")));
    std::fs::read(&wasm_path).map_err(|source| Error::Io { path: wasm_path.clone(), source })
}

/// The `[package] name` of the shim crate's Cargo.toml.
fn shim_crate_name(cargo_toml: &Path) -> Result<String> {
    let text =
        std::fs::read_to_string(cargo_toml).map_err(|source| Error::Io { path: cargo_toml.to_path_buf(), source })?;
    let doc: toml::Table = toml::from_str(&text).map_err(|e| Error::Input(format!("{}: {e}", cargo_toml.display())))?;
    doc.get("package")
        .and_then(|p| p.get("name"))
        .and_then(|n| n.as_str())
        .map(String::from)
        .ok_or_else(|| Error::Input(format!("{}: no [package] name", cargo_toml.display())))
}

/// `text` with its `[files]` table (up to the next table header, or the end) replaced by
/// `table`, or `table` appended.
fn with_files_table(text: &str, table: &str) -> String {
    let mut out = String::new();
    let mut skipping = false;
    for line in text.lines() {
        let header = line.trim_start().starts_with('[');
        if header {
            skipping = line.trim() == "[files]";
        }
        if !skipping {
            out.push_str(line);
            out.push('\n');
        }
    }
    while out.ends_with("\n\n") {
        out.pop();
    }
    format!("{out}\n{table}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_files_table_is_replaced_or_appended() {
        let t = "a = 1\n[files]\n\"x\" = \"1\"\n[[cuda]]\nsource = \"s\"\n";
        assert_eq!(
            with_files_table(t, "[files]\n\"y\" = \"2\"\n"),
            "a = 1\n[[cuda]]\nsource = \"s\"\n\n[files]\n\"y\" = \"2\"\n"
        );
        assert_eq!(with_files_table("a = 1\n", "[files]\n"), "a = 1\n\n[files]\n");
    }

    #[test]
    fn ops_are_domain_and_name() {
        assert_eq!(split_op("ai.example::Twice").unwrap(), ("ai.example".into(), "Twice".into()));
        assert_eq!(split_op("Twice").unwrap(), (String::new(), "Twice".into()));
        assert!(split_op("ai.example::").is_err() && split_op("a b::C").is_err());
    }
}

//! The `kernel.toml` manifest of a kernel package (ABI v1).
//!
//! ```toml
//! schema = 2                     # the manifest schema (ABI.md §7.2); absent means 1
//! abi = 1
//! shim = "shim.wasm"
//!
//! [package]
//! name = "kiln-unary"            # [a-z0-9_-], 1..=64 characters
//! version = "1.0.0"              # semver
//! description = "Unary elementwise ops"
//! license = "Apache-2.0"
//!
//! [device]                       # what the GPU must offer (ignored by the CPU backend)
//! min_compute_capability = "7.0"
//! features = ["bf16"]
//!
//! [[ops]]
//! domain = ""                    # "" is ai.onnx
//! op_types = ["Relu", "Exp"]
//! since_opset = 6                # the model's opset for `domain` must be in
//! until_opset = 25               #   since_opset..=until_opset (until: optional)
//! dtypes = ["float32", "float16"]  # dtypes accepted for input `dtype_input`
//! dtype_input = 0                # default 0
//! max_rank = 8                   # largest input/output rank handled
//! value_inputs = []              # inputs whose bytes the shim needs for inference
//! paged_inputs = []              # optional (schema 5; ABI.md §6.1.1): inputs and outputs the
//! paged_outputs = []             #   shim accepts paged (a KV cache in pages)
//! declines = []                  # optional (schema 9): attribute or input names whose use the
//!                                #   shim refuses (UNSUPPORTED, naming it), e.g. "training_mode"
//! cpu_tiles = "elements"         # optional (schema 12; ABI.md §6.1.2): CPU calls may compute a
//!                                #   tile of the outputs, in "elements" or "rows" of output 0
//!
//! [[cuda]]
//! source = "cuda/unary.cu"
//! kernels = ["unary_f32"]        # the entry points `launch` may name: extern "C" names, or (schema 6)
//!                                # name expressions of template instantiations, "relu<kiln_tag_f16>"
//! pdl = ["unary_f32"]            # optional: kernels safe under programmatic dependent launch
//!                                # (schema 7: also `*` patterns, as in `signatures`)
//! signatures = [                 # every kernel's parameters, in order (schema 2; ABI.md §7.3)
//!     { kernels = ["unary_*"], params = ["tensor", "tensor", "u64", "u32"] },
//! ]
//!
//! [[device_errors]]              # optional (schema 3; ABI.md §7.5): what a kernel's
//! code = 1                       #   kiln_fail(status, 1, …) means; {0}..{3} are its values
//! message = "index {0} is out of range for dimension {1}"
//!
//! [[fusions]]                    # optional: subgraphs the package's ops replace
//! name = "swiglu"                #   (see `crate::fusion` for every field)
//! match = [ … ]
//! replace = [ … ]
//! outputs = ["y"]
//!
//! headers = ["include/tile.cuh"]  # optional (schema 4): headers other packages' sources
//!                                #   include as "kiln-unary/tile.cuh" (under `include/`)
//!
//! [dependencies]                 # optional (schema 4): packages whose headers this package's
//! kiln-cuda-std = "^1.0"         #   sources include, by semver requirement
//!
//! [files]                        # sha256 of every other file of the package, hex
//! "shim.wasm" = "…"
//! "cuda/unary.cu" = "…"
//! ```
//!
//! Parsing checks types and ranges; [`Manifest::validate`] checks what serde cannot
//! (names, relative paths, hash syntax, opset ranges). Checking the files against their hashes
//! is the loader's job (`kiln-registry`).

use std::collections::BTreeMap;

use semver::Version;
use serde::{Deserialize, Serialize};

use crate::fusion::Fusion;
use crate::names::{is_identifier, is_name_expression};
use crate::wire::{KernelArg, MAX_KERNEL_ARGS};
use crate::DType;

/// Errors in a manifest's text or content.
#[derive(Debug, thiserror::Error)]
pub enum ManifestError {
    #[error("kernel.toml is not valid TOML for a kiln manifest (this kiln reads manifest schema {MANIFEST_SCHEMA}; a field a newer schema added needs a newer kiln, ABI.md §7.2): {0}")]
    Toml(#[from] toml::de::Error),
    #[error("kernel.toml follows manifest schema {found}, newer than this kiln (kiln-kernel-abi {}) reads (up to {MANIFEST_SCHEMA}): upgrade kiln; ABI.md §7.2 lists what each schema added and which kiln reads it", env!("CARGO_PKG_VERSION"))]
    NewerSchema { found: u32 },
    #[error("kernel.toml: {0}")]
    Invalid(String),
}

/// The newest manifest schema this crate reads (ABI.md §7.2). A manifest that names a newer one
/// is refused with [`ManifestError::NewerSchema`] before its fields are read. Schema 2 added
/// kernel signatures (`[[cuda]] signatures`), which every declared kernel must have; schema 3
/// added device status records (the `status` parameter kind and `[[device_errors]]`); schema 4
/// added shared device code (`headers`, `[dependencies]`, header-only packages); schema 5 added
/// paged tensors (`paged_inputs`, `paged_outputs` of `[[ops]]`) and the `counters` parameter kind;
/// schema 6 added kernels named by C++ name expressions (`kiln_cast<kiln_tag_f16>`: an
/// instantiation of a `__global__` function template, lowered by NVRTC; [`is_name_expression`]);
/// schema 7 lets `pdl` list kernels by the signatures' `*` patterns; schema 8 adds no field: it
/// marks a package whose CPU reference calls `gemm` (ABI.md §4.7), which a host before it refuses;
/// schema 9 added `declines` to `[[ops]]`; schema 10 adds no field: the package's dispatch calls
/// `conv` and runs its own kernels where the host answers `E_UNAVAILABLE`; schema 11 added the
/// float8, float4e2m1, 4-bit and 2-bit dtypes ([`DType::since_schema_11`]): a package lists them
/// in `dtypes` from schema 11, and the host passes tensors of them only to such packages;
/// schema 12 added `cpu_tiles` to `[[ops]]` (CPU calls of one tile of the outputs) and string
/// tensors ([`crate::strings`]) in `dtypes` and on the wire; schema 13 added attribute
/// constraints on fusion match nodes ([`crate::fusion::AttrConstraint`]); schema 14 adds no
/// field: the package's shim reads tensor flag bit 4 (an input constant for the session,
/// [`crate::wire::TensorDesc::constant`]), which the host sends only to such packages; schema 15
/// added `values` (scalar constants a fusion pattern needs), `shapes`, `verify_values` and
/// integer-list attribute constraints ([`crate::fusion::AttrConstraint::Ints`]) to `[[fusions]]`;
/// schema 16 adds no field: the package's shim reads tensor flag bit 5 (an output bound in place
/// to an input's buffer, [`crate::wire::TensorDesc::in_place_of`]), which the host sends only to
/// such packages, in `kiln_cpu` calls; schema 17 added attribute variables (`"$NAME"`) to
/// fusion nodes' `attributes` ([`crate::fusion::AttrConstraint::attribute_var`]), and a package of
/// it may send `qgemm` descriptors with `accuracy_level` ([`crate::wire::QGemm`]); schema 18
/// adds no field: in `kiln_cpu` calls an output bound in place takes over its input's buffer, and
/// the input reads the output's bytes (ABI.md §7.8), as on the GPU.
pub const MANIFEST_SCHEMA: u32 = 18;

/// The folder of a package whose files are its exported headers.
pub const HEADER_DIR: &str = "include/";

fn default_schema() -> u32 {
    1
}

/// A parsed `kernel.toml`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The manifest schema the file follows (ABI.md §7.2); absent means 1.
    #[serde(default = "default_schema")]
    pub schema: u32,
    /// The kernel ABI version the package is built for.
    pub abi: u32,
    /// Path of the shim module inside the package; empty (absent) only in a header-only
    /// package (schema 4: no `[[ops]]`, only `headers`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub shim: String,
    pub package: PackageInfo,
    #[serde(default)]
    pub device: DeviceRequirements,
    /// The ops the package runs; empty only in a header-only package.
    #[serde(default)]
    pub ops: Vec<OpEntry>,
    /// CUDA headers the package exports (schema 4): paths under `include/`, which a source of
    /// this package or of one that depends on it includes as `"<package>/<path under
    /// include/>"` (NVRTC gets them in memory).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<String>,
    /// Packages whose headers this package's CUDA sources include, by name, with a semver
    /// requirement (schema 4). The host takes the candidate the op-resolution rule prefers.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub dependencies: BTreeMap<String, semver::VersionReq>,
    #[serde(default)]
    pub cuda: Vec<CudaSource>,
    /// Subgraph patterns the package's ops replace (ABI.md §7.1, [`crate::fusion`]).
    #[serde(default)]
    pub fusions: Vec<Fusion>,
    /// Where the random inputs of `kiln verify` must lie for the package's ops (schema 2,
    /// ABI.md §7.4); inputs no entry names take any value.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub input_domains: Vec<InputDomain>,
    /// What the codes kernels report through their status record mean (schema 3, ABI.md §7.5).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub device_errors: Vec<DeviceError>,
    /// sha256 (lower-case hex) of every file of the package but `kernel.toml`, by relative path.
    #[serde(default)]
    pub files: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackageInfo {
    pub name: String,
    pub version: Version,
    #[serde(default)]
    pub description: String,
    #[serde(default)]
    pub license: String,
}

/// The values some inputs of some ops must take (ABI.md §7.4): what `kiln verify` draws its
/// random inputs from, so that a check exercises the op inside its domain.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputDomain {
    /// `""` (ai.onnx) or another domain, as in `[[ops]]`.
    #[serde(default)]
    pub domain: String,
    pub op_types: Vec<String>,
    /// Input indices; empty means every input.
    #[serde(default)]
    pub inputs: Vec<usize>,
    pub values: ValueDomain,
}

/// A set of input values (floats are drawn from x in [-2, 2], integers from [-5, 5]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ValueDomain {
    /// Any value.
    Any,
    /// |x| + 0.1 (floats) or 1..=5 (integers): `Log`, `Sqrt`, scales.
    Positive,
    /// 0.45·x, inside (-1, 1): `Acos`, `Atanh`.
    Unit,
    /// |x| + 1: `Acosh`.
    AboveOne,
    /// ±(|x| + 0.1) or 1..=5: divisors.
    Nonzero,
    /// Integers 0..=3 (floats: any): exponents.
    Exponent,
    /// |x| / 2, in [0, 1]: probabilities.
    Probability,
    /// Positive when the op's output is an unsigned integer type, else any (`Cast`).
    PositiveIfUnsignedOutput,
    /// The node test's own data, never randomised: indices, positions, sequence lengths.
    Keep,
}

/// The meaning of a code a kernel reports through its status record (ABI.md §7.5): the
/// prelude's `kiln_fail(status, code, v0, v1, v2, v3)` fails the run with `message`, in which
/// `{0}` … `{3}` stand for the four values, as the node's error on the device.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceError {
    /// 1 and up (0 is "no error").
    pub code: u32,
    pub message: String,
}

impl DeviceError {
    /// `message` with `{0}` … `{3}` replaced by `values`.
    pub fn render(&self, values: &[i64; 4]) -> String {
        let mut out = self.message.clone();
        for (i, v) in values.iter().enumerate() {
            out = out.replace(&format!("{{{i}}}"), &v.to_string());
        }
        out
    }
}

/// What the GPU must offer for the package's CUDA kernels.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceRequirements {
    /// `"major.minor"`, e.g. `"7.0"`; absent means any.
    #[serde(default)]
    pub min_compute_capability: Option<String>,
    /// Device features the kernels use: `bf16`, `fp16`, `tf32`.
    #[serde(default)]
    pub features: Vec<String>,
}

/// A group of ops the package provides with one set of constraints.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpEntry {
    /// `""` (ai.onnx) or another domain such as `com.microsoft`.
    #[serde(default)]
    pub domain: String,
    pub op_types: Vec<String>,
    pub since_opset: i64,
    #[serde(default)]
    pub until_opset: Option<i64>,
    /// dtype names ([`DType::name`]) accepted for input `dtype_input`.
    pub dtypes: Vec<String>,
    #[serde(default)]
    pub dtype_input: usize,
    pub max_rank: usize,
    #[serde(default)]
    pub value_inputs: Vec<usize>,
    /// Inputs the shim and its kernels accept in a paged layout ([`crate::wire::Paged`],
    /// ABI.md §6.1.1; schema 5), such as GroupQueryAttention's `past_key` and `past_value` read
    /// from the host's paged KV cache. The host pages no other input.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paged_inputs: Vec<usize>,
    /// Outputs likewise (an output bound in place to a paged tensor, such as `present_key`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paged_outputs: Vec<usize>,
    /// Uses of the op the package knowingly refuses at run time although it claims the op,
    /// opset and dtype (schema 9): each an attribute or input name as ONNX spells it, such as
    /// Dropout's `training_mode` (a random mask; kiln runs inference). The shim's UNSUPPORTED
    /// message names it; `kiln verify` then counts such a node test unsupported rather than a
    /// broken claim.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub declines: Vec<String>,
    /// Whether the CPU reference computes a tile of the outputs when the call names one
    /// ([`crate::wire::Tile`], ABI.md §6.1.2; schema 12), and in which units: the host may then
    /// split a large node's CPU work over its threads, one shim instance per tile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_tiles: Option<CpuTiles>,
}

/// The units a tiled `kiln_cpu` call's [`crate::wire::Tile`] counts (manifest `cpu_tiles`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CpuTiles {
    /// Output 0's elements, in row-major order (elementwise ops).
    Elements,
    /// Output 0's rows: its elements grouped by every dimension but the last (ops that
    /// normalize over the last axis).
    Rows,
}

/// A CUDA C++ source file and the kernels it defines.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CudaSource {
    pub source: String,
    /// The entry points `launch` may name: C identifiers of `extern "C"` kernels, or (schema 6)
    /// name expressions of function-template instantiations (`kiln_cast<kiln_tag_f16>`,
    /// [`crate::names::is_name_expression`]).
    pub kernels: Vec<String>,
    /// Kernels (of `kernels`) that may be launched with programmatic dependent launch (PDL,
    /// Hopper and later): every block calls the prelude's `kiln_griddep_wait()` before it
    /// reads anything an earlier kernel of the stream writes, and writes nothing before it.
    /// Such a kernel may start while its predecessor finishes (ABI.md §7). Entries are kernel
    /// names, or (schema 7) `*` patterns as in `signatures`, each matching at least one of
    /// this source's kernels.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pdl: Vec<String>,
    /// The parameters of every kernel of `kernels` (schema 2): each kernel matches exactly one
    /// entry. `launch` is checked against them before anything reaches the driver.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub signatures: Vec<KernelSignature>,
}

/// The parameters of the kernels that `kernels` names (ABI.md §7.3): exact names or patterns in
/// which `*` stands for any run of characters (`kiln_gemv_*`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KernelSignature {
    pub kernels: Vec<String>,
    /// In order, as the kernel's C signature declares them.
    pub params: Vec<ParamKind>,
}

/// The kind of one kernel parameter, as `launch` passes it ([`KernelArg`]): a device pointer
/// (`tensor`, a handle and a byte offset) or a scalar of a given type and width.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ParamKind {
    /// Any pointer parameter (`const float*`, `T*`): 8 bytes.
    Tensor,
    /// `int`: 4 bytes.
    I32,
    /// `unsigned`: 4 bytes.
    U32,
    /// `long long`: 8 bytes.
    I64,
    /// `unsigned long long`: 8 bytes.
    U64,
    /// `float`: 4 bytes.
    F32,
    /// `double`: 8 bytes.
    F64,
    /// `kiln_status*`: the node's device status record (ABI.md §7.5, schema 3), 8 bytes; the
    /// launch passes [`KernelArg::Status`].
    Status,
    /// `kiln_counter*` (`unsigned int*`): the node's counters (ABI.md §6.3, schema 5), 8 bytes; the launch passes
    /// [`KernelArg::Counters`].
    Counters,
}

impl ParamKind {
    /// The kind of a `launch` argument.
    pub fn of(arg: &KernelArg) -> ParamKind {
        match arg {
            KernelArg::Tensor { .. } => ParamKind::Tensor,
            KernelArg::I32(_) => ParamKind::I32,
            KernelArg::U32(_) => ParamKind::U32,
            KernelArg::I64(_) => ParamKind::I64,
            KernelArg::U64(_) => ParamKind::U64,
            KernelArg::F32(_) => ParamKind::F32,
            KernelArg::F64(_) => ParamKind::F64,
            KernelArg::Status => ParamKind::Status,
            KernelArg::Counters(_) => ParamKind::Counters,
        }
    }

    /// Bytes the parameter takes in the kernel's parameter buffer.
    pub fn size(self) -> usize {
        match self {
            ParamKind::I32 | ParamKind::U32 | ParamKind::F32 => 4,
            _ => 8,
        }
    }

    /// The name used in `kernel.toml`.
    pub fn name(self) -> &'static str {
        match self {
            ParamKind::Tensor => "tensor",
            ParamKind::I32 => "i32",
            ParamKind::U32 => "u32",
            ParamKind::I64 => "i64",
            ParamKind::U64 => "u64",
            ParamKind::F32 => "f32",
            ParamKind::F64 => "f64",
            ParamKind::Status => "status",
            ParamKind::Counters => "counters",
        }
    }
}

/// Whether kernel `name` matches `pattern` (`*` matches any run of characters, also none).
pub fn kernel_pattern_matches(pattern: &str, name: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or("");
    let Some(mut rest) = name.strip_prefix(first) else { return false };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else { return rest.is_empty() };
    for part in middle {
        match rest.find(part) {
            Some(i) => rest = &rest[i + part.len()..],
            None => return false,
        }
    }
    rest.len() >= last.len() && rest.ends_with(last)
}

impl CudaSource {
    /// Whether this source declares `kernel` and lists it in `pdl`, by name or (schema 7) by a
    /// `*` pattern ([`kernel_pattern_matches`]).
    pub fn kernel_pdl(&self, kernel: &str) -> bool {
        self.kernels.iter().any(|k| k == kernel) && self.pdl.iter().any(|p| kernel_pattern_matches(p, kernel))
    }

    /// The parameters of `kernel` when this source declares it and one signature matches it.
    pub fn params(&self, kernel: &str) -> Option<&[ParamKind]> {
        self.signatures
            .iter()
            .find(|s| s.kernels.iter().any(|p| kernel_pattern_matches(p, kernel)))
            .map(|s| s.params.as_slice())
    }

    /// The kernels this source declares by name expressions (schema 6), which NVRTC must
    /// instantiate and lower.
    pub fn name_expressions(&self) -> Vec<&str> {
        self.kernels.iter().map(String::as_str).filter(|k| is_name_expression(k)).collect()
    }
}

impl OpEntry {
    /// Parsed dtypes. Validated manifests only hold known names.
    pub fn dtype_set(&self) -> Vec<DType> {
        self.dtypes.iter().filter_map(|n| DType::from_name(n)).collect()
    }

    /// Whether the model's opset for this domain is in range.
    pub fn covers_opset(&self, opset: i64) -> bool {
        opset >= self.since_opset && self.until_opset.is_none_or(|u| opset <= u)
    }
}

/// Whether `name` is a valid package name: 1 to 64 characters of `a-z`, `0-9`, `-`, `_` (safe
/// as a file name, which registry directories rely on).
pub fn is_package_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
}

impl Manifest {
    /// Parses and validates `kernel.toml` text.
    pub fn parse(text: &str) -> Result<Manifest, ManifestError> {
        // The schema first, so that a newer manifest is refused for what it is rather than for
        // the first field this host does not know.
        let table: toml::Table = toml::from_str(text)?;
        if let Some(v) = table.get("schema") {
            let found = v
                .as_integer()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|n| *n >= 1)
                .ok_or_else(|| ManifestError::Invalid(format!("schema must be a positive integer, not {v}")))?;
            if found > MANIFEST_SCHEMA {
                return Err(ManifestError::NewerSchema { found });
            }
        }
        let m: Manifest = toml::from_str(text)?;
        m.validate()?;
        Ok(m)
    }

    /// Renders the manifest as TOML.
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_default()
    }

    /// Whether the package only exports headers (no shim, no ops).
    pub fn is_header_only(&self) -> bool {
        self.ops.is_empty() && !self.headers.is_empty()
    }

    /// The name a CUDA source includes header `path` (one of `headers`) by:
    /// `<package>/<path under include/>`.
    pub fn include_name(&self, path: &str) -> String {
        format!("{}/{}", self.package.name, path.strip_prefix(HEADER_DIR).unwrap_or(path))
    }

    /// Whether `kernel` is declared safe under programmatic dependent launch: its source's `pdl`
    /// names it, or (schema 7) has a `*` pattern that matches it.
    pub fn kernel_pdl(&self, kernel: &str) -> bool {
        self.cuda.iter().any(|c| c.kernel_pdl(kernel))
    }

    /// Every kernel entry point declared by the `[[cuda]]` sources.
    pub fn kernels(&self) -> impl Iterator<Item = &str> {
        self.cuda.iter().flat_map(|c| c.kernels.iter().map(String::as_str))
    }

    /// The declared domain of input `input` of `op_type` in `domain` (`""` and `ai.onnx` are
    /// the same), [`ValueDomain::Any`] when no entry names it.
    pub fn input_domain(&self, domain: &str, op_type: &str, input: usize) -> ValueDomain {
        self.input_domains
            .iter()
            .find(|e| {
                same_domain(&e.domain, domain)
                    && e.op_types.iter().any(|t| t == op_type)
                    && (e.inputs.is_empty() || e.inputs.contains(&input))
            })
            .map_or(ValueDomain::Any, |e| e.values)
    }

    /// The message of device error `code` (ABI.md §7.5), if the manifest declares it.
    pub fn device_error(&self, code: u32) -> Option<&DeviceError> {
        self.device_errors.iter().find(|e| e.code == code)
    }

    /// Every declared kernel with its parameters (a validated manifest gives every kernel one).
    pub fn kernel_signatures(&self) -> Vec<(String, Vec<ParamKind>)> {
        self.cuda
            .iter()
            .flat_map(|c| c.kernels.iter().map(move |k| (k.clone(), c.params(k).unwrap_or_default().to_vec())))
            .collect()
    }

    /// Checks what the TOML types cannot express.
    pub fn validate(&self) -> Result<(), ManifestError> {
        let bad = |msg: String| Err(ManifestError::Invalid(msg));
        let name = &self.package.name;
        if !is_package_name(name) {
            return bad(format!("package name {name:?} must be 1 to 64 characters of a-z, 0-9, '-', '_'"));
        }
        if let Some(cc) = &self.device.min_compute_capability {
            parse_compute_capability(cc)?;
        }
        self.check_shared_code()?;
        if self.is_header_only() {
            if !self.shim.is_empty() || !self.cuda.is_empty() || !self.fusions.is_empty() {
                return bad("a header-only package (no [[ops]]) has no shim, [[cuda]] or [[fusions]]".into());
            }
        } else if self.ops.is_empty() {
            return bad("[[ops]] is empty: a package must provide at least one op, or (schema 4) only `headers`".into());
        } else {
            if self.shim.is_empty() {
                return bad("`shim` is missing: a package with [[ops]] names its shim module".into());
            }
            check_relative_path(&self.shim)?;
        }
        for (i, op) in self.ops.iter().enumerate() {
            if op.op_types.is_empty() || op.op_types.iter().any(|t| t.is_empty()) {
                return bad(format!("ops[{i}]: op_types must list non-empty op names"));
            }
            if op.since_opset < 1 || op.until_opset.is_some_and(|u| u < op.since_opset) {
                return bad(format!(
                    "ops[{i}]: opset range {}..{:?} is empty or below 1",
                    op.since_opset, op.until_opset
                ));
            }
            if let Some(d) = op.dtypes.iter().find(|d| DType::from_name(d).is_none()) {
                return bad(format!("ops[{i}]: unknown dtype {d:?}"));
            }
            if let Some(d) = op.dtype_set().into_iter().find(|d| d.since_schema() > self.schema) {
                let n = d.since_schema();
                return bad(format!("ops[{i}]: dtype {d} comes with manifest schema {n}: set `schema = {n}`"));
            }
            if op.max_rank > 64 {
                return bad(format!("ops[{i}]: max_rank {} is over 64", op.max_rank));
            }
            let paged = [("paged_inputs", &op.paged_inputs), ("paged_outputs", &op.paged_outputs)];
            for (what, list) in paged {
                if !list.is_empty() && self.schema < 5 {
                    return bad(format!("ops[{i}]: `{what}` come with manifest schema 5: set `schema = 5`"));
                }
                if let Some((k, x)) = list.iter().enumerate().find(|(k, x)| list[..*k].contains(x)) {
                    return bad(format!("ops[{i}]: {what}[{k}] lists index {x} twice"));
                }
            }
            if op.cpu_tiles.is_some() && self.schema < 12 {
                return bad(format!("ops[{i}]: `cpu_tiles` comes with manifest schema 12: set `schema = 12`"));
            }
            if !op.declines.is_empty() && self.schema < 9 {
                return bad(format!("ops[{i}]: `declines` comes with manifest schema 9: set `schema = 9`"));
            }
            if let Some(d) = op.declines.iter().find(|d| d.is_empty() || d.contains(char::is_whitespace)) {
                return bad(format!("ops[{i}]: declines {d:?} is not an attribute or input name"));
            }
        }
        // Launch names are manifest-wide (schema 6: a name declared twice is refused).
        let all: Vec<&str> = self.kernels().collect();
        if let Some((i, k)) = all.iter().enumerate().find(|(i, k)| all[..*i].contains(k)).filter(|_| self.schema >= 6) {
            return bad(format!(
                "kernel {k:?} is declared twice (entry {i} of the [[cuda]] sources' kernels): list it once, under \
                 the source that defines it"
            ));
        }
        for c in &self.cuda {
            check_relative_path(&c.source)?;
            if let Some(k) = c.kernels.iter().find(|k| !is_identifier(k) && !is_name_expression(k)) {
                return bad(format!(
                    "cuda source {}: kernel {k:?} is neither a C identifier (an extern \"C\" kernel) nor a name \
                     expression such as \"kiln_cast<kiln_tag_f16>\" or \"gqa_decode<kiln_tag_f16, 4>\" (a template's \
                     name, then identifiers or integers separated by \", \" in angle brackets; ABI.md §7.3.1)",
                    c.source
                ));
            }
            if let Some(k) = c.kernels.iter().find(|k| is_name_expression(k)).filter(|_| self.schema < 6) {
                return bad(format!(
                    "cuda source {}: kernel {k:?} is a name expression, which comes with manifest schema 6: set \
                     `schema = 6`",
                    c.source
                ));
            }
            if let Some(p) = c.pdl.iter().find(|p| p.contains('*')).filter(|_| self.schema < 7) {
                return bad(format!(
                    "cuda source {}: pdl pattern {p:?} comes with manifest schema 7: set `schema = 7`, or list the \
                     kernels by name",
                    c.source
                ));
            }
            if let Some(p) = c.pdl.iter().find(|p| !c.kernels.iter().any(|k| kernel_pattern_matches(p, k))) {
                return bad(format!("cuda source {}: pdl entry {p:?} matches none of its `kernels`", c.source));
            }
            self.check_signatures(c)?;
        }
        if !self.input_domains.is_empty() && self.schema < 2 {
            return bad("`input_domains` come with manifest schema 2: set `schema = 2`".into());
        }
        for (i, d) in self.input_domains.iter().enumerate() {
            if let Some(t) = d.op_types.iter().find(|t| !self.claims(&d.domain, t)) {
                return bad(format!("input_domains[{i}]: op {t:?} is not one of the package's [[ops]]"));
            }
        }
        if !self.device_errors.is_empty() && self.schema < 3 {
            return bad("`device_errors` come with manifest schema 3: set `schema = 3`".into());
        }
        for (i, e) in self.device_errors.iter().enumerate() {
            if e.code == 0 {
                return bad(format!("device_errors[{i}]: code 0 means \"no error\"; codes start at 1"));
            }
            if self.device_errors[..i].iter().any(|d| d.code == e.code) {
                return bad(format!("device_errors[{i}]: code {} is declared twice", e.code));
            }
            if e.message.trim().is_empty() {
                return bad(format!("device_errors[{i}]: code {} has an empty message", e.code));
            }
        }
        for (i, f) in self.fusions.iter().enumerate() {
            f.validate().map_err(ManifestError::Invalid)?;
            if self.schema < 13 && f.pattern.iter().chain(&f.replace).any(|n| !n.attributes.is_empty()) {
                return bad(format!(
                    "fusion {:?}: `attributes` of match and replacement nodes come with manifest schema 13: set `schema = 13`",
                    f.name
                ));
            }
            let lists = f
                .pattern
                .iter()
                .chain(&f.replace)
                .any(|n| n.attributes.values().any(|c| matches!(c, crate::fusion::AttrConstraint::Ints(_))));
            if self.schema < 15
                && (lists || !f.values.is_empty() || !f.verify_values.is_empty() || !f.shapes.is_empty())
            {
                return bad(format!(
                    "fusion {:?}: `values`, `shapes`, `verify_values` and integer-list `attributes` come with manifest schema 15: set `schema = 15`",
                    f.name
                ));
            }
            let variables =
                f.pattern.iter().chain(&f.replace).any(|n| n.attributes.values().any(|c| c.attribute_var().is_some()));
            if self.schema < 17 && variables {
                return bad(format!(
                    "fusion {:?}: attribute variables (\"$NAME\" in `attributes`) come with manifest schema 17: set `schema = 17`",
                    f.name
                ));
            }
            if self.fusions[..i].iter().any(|g| g.name == f.name) {
                return bad(format!("fusion name {:?} is used twice", f.name));
            }
        }
        for (path, hash) in &self.files {
            check_relative_path(path)?;
            if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
                return bad(format!("files.{path:?}: {hash:?} is not a lower-case hex sha256"));
            }
        }
        Ok(())
    }
}

impl Manifest {
    /// `headers` and `[dependencies]`: schema 4, headers under `include/` with a header's
    /// extension, each once, dependencies by valid names other than the package's own.
    fn check_shared_code(&self) -> Result<(), ManifestError> {
        let bad = |msg: String| Err(ManifestError::Invalid(msg));
        if (!self.headers.is_empty() || !self.dependencies.is_empty()) && self.schema < 4 {
            return bad("`headers` and [dependencies] come with manifest schema 4: set `schema = 4`".into());
        }
        for (i, h) in self.headers.iter().enumerate() {
            check_relative_path(h)?;
            let ext = [".cuh", ".h", ".hpp"].iter().any(|e| h.ends_with(e));
            if !h.starts_with(HEADER_DIR) || !ext {
                return bad(format!("headers[{i}]: {h:?} must be a .cuh, .h or .hpp file under {HEADER_DIR}"));
            }
            if self.headers[..i].contains(h) {
                return bad(format!("headers[{i}]: {h:?} is listed twice"));
            }
        }
        for name in self.dependencies.keys() {
            if !is_package_name(name) {
                return bad(format!("dependencies: {name:?} is not a package name"));
            }
            if name == &self.package.name {
                return bad(format!("dependencies: the package {name:?} depends on itself"));
            }
        }
        Ok(())
    }

    /// Whether some `[[ops]]` entry lists `op_type` in `domain`.
    fn claims(&self, domain: &str, op_type: &str) -> bool {
        self.ops.iter().any(|e| same_domain(&e.domain, domain) && e.op_types.iter().any(|t| t == op_type))
    }

    /// Every kernel of `c` matches exactly one signature, every signature pattern matches one of
    /// its kernels, and signatures come with schema 2.
    fn check_signatures(&self, c: &CudaSource) -> Result<(), ManifestError> {
        let bad = |msg: String| Err(ManifestError::Invalid(format!("cuda source {}: {msg}", c.source)));
        if !c.signatures.is_empty() && self.schema < 2 {
            return bad("`signatures` come with manifest schema 2: set `schema = 2`".into());
        }
        if self.schema < 3 && c.signatures.iter().any(|s| s.params.contains(&ParamKind::Status)) {
            return bad("the `status` parameter kind comes with manifest schema 3: set `schema = 3`".into());
        }
        if self.schema < 5 && c.signatures.iter().any(|s| s.params.contains(&ParamKind::Counters)) {
            return bad("the `counters` parameter kind comes with manifest schema 5: set `schema = 5`".into());
        }
        for k in &c.kernels {
            let hits = c.signatures.iter().filter(|s| s.kernels.iter().any(|p| kernel_pattern_matches(p, k))).count();
            if hits == 0 {
                let schema = if self.schema < 2 { "set `schema = 2` and " } else { "" };
                return bad(format!(
                    "kernel {k:?} has no signature: {schema}add an entry such as \
                     `{{ kernels = [\"{k}\"], params = [\"tensor\", \"u64\"] }}` to its `signatures`, \
                     one parameter kind per C parameter (tensor, i32, u32, i64, u64, f32, f64, status, counters; ABI.md §7.3; \
                     scripts/kernel-signatures.py prints them from the source)"
                ));
            }
            if hits > 1 {
                return bad(format!("kernel {k:?} matches {hits} signatures; it must match exactly one"));
            }
        }
        for s in &c.signatures {
            if let Some(p) = s.kernels.iter().find(|p| !c.kernels.iter().any(|k| kernel_pattern_matches(p, k))) {
                return bad(format!("signature pattern {p:?} matches none of the source's kernels"));
            }
            if s.params.len() > MAX_KERNEL_ARGS {
                return bad(format!("a signature has {} parameters (at most {MAX_KERNEL_ARGS})", s.params.len()));
            }
        }
        Ok(())
    }
}

/// Whether two op domains are the same (`""` and `"ai.onnx"` are).
fn same_domain(a: &str, b: &str) -> bool {
    fn norm(d: &str) -> &str {
        if d == "ai.onnx" {
            ""
        } else {
            d
        }
    }
    norm(a) == norm(b)
}

/// Parses `"major.minor"` into `(major, minor)`.
pub fn parse_compute_capability(s: &str) -> Result<(u32, u32), ManifestError> {
    let err = || ManifestError::Invalid(format!("compute capability {s:?} is not \"major.minor\""));
    let (a, b) = s.split_once('.').ok_or_else(err)?;
    Ok((a.parse().map_err(|_| err())?, b.parse().map_err(|_| err())?))
}

/// A path inside the package: relative, `/`-separated, no `..`, no empty or `.` components.
pub fn check_relative_path(p: &str) -> Result<(), ManifestError> {
    let ok = !p.is_empty()
        && !p.starts_with('/')
        && !p.contains('\\')
        && p.split('/').all(|c| !c.is_empty() && c != "." && c != "..");
    if ok {
        Ok(())
    } else {
        Err(ManifestError::Invalid(format!("path {p:?} must be relative to the package, without '..'")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
schema = 2
abi = 1
shim = "shim.wasm"
[package]
name = "kiln-unary"
version = "1.2.3"
[[ops]]
op_types = ["Relu"]
since_opset = 6
dtypes = ["float32", "float16"]
max_rank = 8
[[cuda]]
source = "cuda/unary.cu"
kernels = ["relu_f32"]
signatures = [{ kernels = ["relu_*"], params = ["tensor", "tensor", "u64"] }]
"#;

    #[test]
    fn a_good_manifest_parses() {
        let m = Manifest::parse(GOOD).unwrap();
        assert_eq!(m.package.version, Version::new(1, 2, 3));
        assert_eq!(m.ops[0].dtype_set(), vec![DType::F32, DType::F16]);
        assert!(m.ops[0].covers_opset(13) && !m.ops[0].covers_opset(5));
        assert_eq!(m.kernels().collect::<Vec<_>>(), vec!["relu_f32"]);
        assert_eq!(
            m.kernel_signatures(),
            vec![("relu_f32".to_string(), vec![ParamKind::Tensor, ParamKind::Tensor, ParamKind::U64])]
        );
        assert_eq!(Manifest::parse(&m.to_toml()).unwrap(), m);
    }

    #[test]
    fn input_domains_name_ops_of_the_package() {
        let good = format!("{GOOD}\n[[input_domains]]\nop_types = [\"Relu\"]\ninputs = [0]\nvalues = \"positive\"\n");
        let m = Manifest::parse(&good).unwrap();
        assert_eq!(m.input_domain("", "Relu", 0), ValueDomain::Positive);
        assert_eq!(m.input_domain("ai.onnx", "Relu", 0), ValueDomain::Positive);
        assert_eq!(m.input_domain("", "Relu", 1), ValueDomain::Any);
        assert_eq!(m.input_domain("com.microsoft", "Relu", 0), ValueDomain::Any);
        let err = Manifest::parse(&good.replace("[\"Relu\"]\ninputs", "[\"Gelu\"]\ninputs")).unwrap_err().to_string();
        assert!(err.contains("op \"Gelu\" is not one of the package's [[ops]]"), "{err}");
        let err = Manifest::parse(&good.replace("\"positive\"", "\"sometimes\"")).unwrap_err().to_string();
        assert!(err.contains("unknown variant `sometimes`"), "{err}");
    }

    #[test]
    fn device_errors_come_with_schema_3_and_render_their_values() {
        let v3 = GOOD.replace("schema = 2", "schema = 3").replace("\"u64\"]", "\"u64\", \"status\"]");
        let good = format!(
            "{v3}\n[[device_errors]]\ncode = 1\nmessage = \"index {{0}} is out of range for dimension {{1}}\"\n"
        );
        let m = Manifest::parse(&good).unwrap();
        assert_eq!(m.kernel_signatures()[0].1.last(), Some(&ParamKind::Status));
        let e = m.device_error(1).unwrap();
        assert_eq!(e.render(&[7, 3, 0, 0]), "index 7 is out of range for dimension 3");
        assert!(m.device_error(2).is_none());
        assert_eq!(Manifest::parse(&m.to_toml()).unwrap(), m);
        for (text, needle) in [
            (
                format!("{GOOD}\n[[device_errors]]\ncode = 1\nmessage = \"m\"\n"),
                "`device_errors` come with manifest schema 3",
            ),
            (v3.replace("schema = 3", "schema = 2"), "`status` parameter kind comes with manifest schema 3"),
            (good.replace("code = 1", "code = 0"), "codes start at 1"),
            (format!("{good}[[device_errors]]\ncode = 1\nmessage = \"again\"\n"), "code 1 is declared twice"),
            (good.replace("message = \"index", "message = \" \"\n#"), "empty message"),
        ] {
            let err = Manifest::parse(&text).unwrap_err().to_string();
            assert!(err.contains(needle), "{err} should mention {needle:?}");
        }
    }

    #[test]
    fn kernel_patterns_match_runs_of_characters() {
        for (p, k, hit) in [
            ("relu_*", "relu_f32", true),
            ("relu_*", "relu_", true),
            ("relu_*", "gelu_f32", false),
            ("*_f32", "relu_f32", true),
            ("a*b*c", "aXXbYYc", true),
            ("a*b*c", "aXXcYYb", false),
            ("ab*ba", "aba", false),
            ("relu_f32", "relu_f32", true),
            ("relu_f32", "relu_f16", false),
        ] {
            assert_eq!(kernel_pattern_matches(p, k), hit, "{p} vs {k}");
        }
    }

    #[test]
    fn every_kernel_needs_exactly_one_signature() {
        let sig = r#"signatures = [{ kernels = ["relu_*"], params = ["tensor", "tensor", "u64"] }]"#;
        let cases = [
            // A manifest of schema 1 has no signatures: it says what to add.
            (GOOD.replace("schema = 2\n", "").replace(sig, ""), "has no signature: set `schema = 2` and add"),
            (GOOD.replace(sig, ""), "kernel \"relu_f32\" has no signature: add an entry such as"),
            (GOOD.replace("schema = 2\n", ""), "`signatures` come with manifest schema 2"),
            (GOOD.replace("[\"relu_*\"]", "[\"relu_*\", \"*_f32\"]"), ""),
            (GOOD.replace("u64\"] }]", "u64\"] }, { kernels = [\"relu_f32\"], params = [] }]"), "matches 2 signatures"),
            (GOOD.replace("[\"relu_*\"]", "[\"relu_*\", \"gelu_*\"]"), "pattern \"gelu_*\" matches none"),
            (GOOD.replace("\"u64\"]", "\"u128\"]"), "unknown variant `u128`"),
        ];
        for (text, needle) in cases {
            match Manifest::parse(&text) {
                Ok(_) if needle.is_empty() => {}
                Ok(_) => panic!("accepted; should mention {needle:?}:\n{text}"),
                Err(e) => {
                    assert!(!needle.is_empty() && e.to_string().contains(needle), "{e} should mention {needle:?}")
                }
            }
        }
    }

    #[test]
    fn a_newer_schema_is_refused_for_what_it_is_and_an_unknown_field_is_named() {
        let newer = format!("schema = {}\n{}\nsurprise = 1\n", MANIFEST_SCHEMA + 1, GOOD.replace("schema = 2\n", ""));
        let err = Manifest::parse(&newer).unwrap_err().to_string();
        assert!(
            err.contains(&format!("manifest schema {}", MANIFEST_SCHEMA + 1)) && err.contains("upgrade kiln"),
            "{err}"
        );
        let m = Manifest::parse(GOOD).unwrap();
        assert_eq!(m.schema, 2);
        let err = Manifest::parse(
            &GOOD.replace("kernels = [\"relu_f32\"]", "pdl_kernels = [\"x\"]\nkernels = [\"relu_f32\"]"),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("unknown field `pdl_kernels`")
                && err.contains(&format!("reads manifest schema {MANIFEST_SCHEMA}")),
            "{err}"
        );
        let err = Manifest::parse(&GOOD.replace("schema = 2", "schema = -1")).unwrap_err().to_string();
        assert!(err.contains("schema must be a positive integer"), "{err}");
    }

    /// Schema 5: an op's paged inputs and outputs, each index once, and the `counters` parameter
    /// kind; with an older schema they are refused naming the schema that brought them.
    #[test]
    fn paged_inputs_and_outputs_come_with_schema_5() {
        let paged = "max_rank = 8\npaged_inputs = [3, 4]\npaged_outputs = [1, 2]\n";
        let v5 = GOOD.replace("schema = 2", "schema = 5").replace("max_rank = 8\n", paged);
        let m = Manifest::parse(&v5).unwrap();
        assert_eq!((m.ops[0].paged_inputs.clone(), m.ops[0].paged_outputs.clone()), (vec![3, 4], vec![1, 2]));
        assert_eq!(Manifest::parse(&m.to_toml()).unwrap(), m, "round trip");
        let counted = v5.replace("\"u64\"]", "\"u64\", \"counters\"]");
        assert_eq!(Manifest::parse(&counted).unwrap().kernel_signatures()[0].1.last(), Some(&ParamKind::Counters));
        let cases = [
            (v5.replace("schema = 5", "schema = 4"), "`paged_inputs` come with manifest schema 5"),
            (
                counted.replace("schema = 5", "schema = 4").replace(paged, "max_rank = 8\n"),
                "`counters` parameter kind comes with manifest schema 5",
            ),
            (v5.replace("[3, 4]", "[3, 3]"), "paged_inputs[1] lists index 3 twice"),
            (v5.replace("[1, 2]", "[2, 2]"), "paged_outputs[1] lists index 2 twice"),
        ];
        for (text, want) in cases {
            let err = Manifest::parse(&text).unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
    }

    /// Schema 9: the uses of an op its package declines, names without spaces; with an older
    /// schema they are refused naming the schema that brought them.
    #[test]
    fn declines_come_with_schema_9() {
        let declines = "max_rank = 8\ndeclines = [\"training_mode\"]\n";
        let v9 = GOOD.replace("schema = 2", "schema = 9").replace("max_rank = 8\n", declines);
        let m = Manifest::parse(&v9).unwrap();
        assert_eq!(m.ops[0].declines, vec!["training_mode".to_string()]);
        assert_eq!(Manifest::parse(&m.to_toml()).unwrap(), m, "round trip");
        let cases = [
            (v9.replace("schema = 9", "schema = 8"), "`declines` comes with manifest schema 9"),
            (v9.replace("\"training_mode\"", "\"training mode\""), "is not an attribute or input name"),
            (v9.replace("\"training_mode\"", "\"\""), "is not an attribute or input name"),
        ];
        for (text, want) in cases {
            let err = Manifest::parse(&text).unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
    }

    /// Schema 13: attribute constraints on fusion match nodes, only in a manifest that says so.
    #[test]
    fn fusion_attribute_constraints_come_with_schema_13() {
        let fusion = r#"
[[fusions]]
name = "relu-of-bits"
match = [{ op = "Relu", inputs = ["x"], outputs = ["y"], attributes = { bits = 4, n = "x.-1", level = "*" } }]
replace = [{ op = "Relu", inputs = ["x"], outputs = ["y"] }]
outputs = ["y"]
"#;
        let v13 = GOOD.replace("schema = 2", "schema = 13") + fusion;
        let m = Manifest::parse(&v13).unwrap();
        let c = &m.fusions[0].pattern[0].attributes;
        assert_eq!(c["bits"], crate::fusion::AttrConstraint::Int(4));
        assert_eq!(c["n"].dim(), Some(("x", -1)));
        assert!(c["level"].is_any());
        assert_eq!(Manifest::parse(&m.to_toml()).unwrap(), m, "round trip");
        let err = Manifest::parse(&v13.replace("schema = 13", "schema = 12")).unwrap_err().to_string();
        assert!(err.contains("`attributes` of match and replacement nodes come with manifest schema 13"), "{err}");
    }

    /// Schema 15: fusion `values` and integer-list attribute constraints, only in a manifest that
    /// says so.
    #[test]
    fn fusion_attribute_variables_come_with_schema_17() {
        let fusion = r#"
[[fusions]]
name = "nbits-linear"
match = [{ domain = "com.microsoft", op = "MatMulNBits", inputs = ["x", "B", "S"], outputs = ["y"], attributes = { accuracy_level = "$acc" } }]
constant = ["B", "S"]
replace = [{ domain = "ai.kiln", op = "Linear", inputs = ["x", "B", "S"], outputs = ["y"], attributes = { accuracy_level = "$acc" } }]
outputs = ["y"]
"#;
        let v17 = GOOD.replace("schema = 2", "schema = 17") + fusion;
        let m = Manifest::parse(&v17).unwrap();
        assert_eq!(m.fusions[0].replace[0].attributes["accuracy_level"].attribute_var(), Some("acc"));
        assert_eq!(Manifest::parse(&m.to_toml()).unwrap(), m, "round trip");
        let err = Manifest::parse(&v17.replace("schema = 17", "schema = 16")).unwrap_err().to_string();
        assert!(err.contains("attribute variables") && err.contains("set `schema = 17`"), "{err}");
    }

    #[test]
    fn fusion_values_and_integer_lists_come_with_schema_15() {
        let fusion = r#"
[[fusions]]
name = "scaled-transpose"
match = [
    { op = "Transpose", inputs = ["x"], outputs = ["t"], attributes = { perm = [0, 2, 1, 3] } },
    { op = "Mul", inputs = ["t", "c"], outputs = ["y"] },
]
constant = ["c"]
values = { c = 0.125 }
replace = [{ op = "Transpose", inputs = ["x"], outputs = ["y"], attributes = { perm = [0, 2, 1, 3] } }]
outputs = ["y"]
"#;
        let v15 = GOOD.replace("schema = 2", "schema = 15") + fusion;
        let m = Manifest::parse(&v15).unwrap();
        assert_eq!(m.fusions[0].values["c"], 0.125);
        assert_eq!(m.fusions[0].pattern[0].attributes["perm"], crate::fusion::AttrConstraint::Ints(vec![0, 2, 1, 3]));
        assert_eq!(Manifest::parse(&m.to_toml()).unwrap(), m, "round trip");
        let err = Manifest::parse(&v15.replace("schema = 15", "schema = 14")).unwrap_err().to_string();
        assert!(err.contains("come with manifest schema 15"), "{err}");
        let no_values = v15.replace("values = { c = 0.125 }\n", "");
        let err = Manifest::parse(&no_values.replace("schema = 15", "schema = 14")).unwrap_err().to_string();
        assert!(err.contains("integer-list `attributes` come with manifest schema 15"), "{err}");
        let verify_only = no_values.replace(
            "replace = [{ op = \"Transpose\"",
            "verify_values = { c = [0.5] }\nreplace = [{ op = \"Transpose\"",
        );
        let verify_only = verify_only.replace(", attributes = { perm = [0, 2, 1, 3] }", "");
        let err = Manifest::parse(&verify_only.replace("schema = 15", "schema = 14")).unwrap_err().to_string();
        assert!(err.contains("`verify_values`"), "{err}");
    }

    /// Schema 12: `cpu_tiles` names its units, and only a manifest that says so has it.
    #[test]
    fn cpu_tiles_come_with_schema_12() {
        let v12 =
            GOOD.replace("schema = 2", "schema = 12").replace("max_rank = 8\n", "max_rank = 8\ncpu_tiles = \"rows\"\n");
        let m = Manifest::parse(&v12).unwrap();
        assert_eq!(m.ops[0].cpu_tiles, Some(CpuTiles::Rows));
        assert_eq!(Manifest::parse(&m.to_toml()).unwrap(), m, "round trip");
        let err = Manifest::parse(&v12.replace("schema = 12", "schema = 11")).unwrap_err().to_string();
        assert!(err.contains("`cpu_tiles` comes with manifest schema 12"), "{err}");
        assert!(Manifest::parse(&v12.replace("\"rows\"", "\"columns\"")).is_err());
    }

    /// Schema 11: the float8, 4-bit and 2-bit dtypes are listed only by a manifest that says so.
    #[test]
    fn narrow_dtypes_come_with_schema_11() {
        let v11 = GOOD
            .replace("schema = 2", "schema = 11")
            .replace("dtypes = [\"float32\"", "dtypes = [\"float32\", \"float8e4m3fn\", \"INT4\"");
        let m = Manifest::parse(&v11).unwrap();
        assert!(m.ops[0].dtype_set().contains(&DType::F8E4M3FN) && m.ops[0].dtype_set().contains(&DType::I4));
        let err = Manifest::parse(&v11.replace("schema = 11", "schema = 10")).unwrap_err().to_string();
        assert!(err.contains("dtype float8e4m3fn comes with manifest schema 11"), "{err}");
    }

    /// Schema 6: kernels named by the name expressions of template instantiations, in their
    /// canonical spelling, matched by signature patterns; with an older schema, or misspelled,
    /// or declared twice, they are refused with the reason.
    #[test]
    fn name_expressions_come_with_schema_6() {
        let expr = crate::names::kernel_name("relu", &["kiln_tag_f16", "4"]);
        assert_eq!(expr, "relu<kiln_tag_f16, 4>");
        let v6 = GOOD
            .replace("schema = 2", "schema = 6")
            .replace("kernels = [\"relu_f32\"]", &format!("kernels = [\"relu_f32\", \"{expr}\"]"))
            .replace("[\"relu_*\"]", "[\"relu_*\", \"relu<*>\"]");
        let m = Manifest::parse(&v6).unwrap();
        assert_eq!(m.cuda[0].name_expressions(), vec![expr.as_str()]);
        assert_eq!(m.cuda[0].params(&expr), Some(&[ParamKind::Tensor, ParamKind::Tensor, ParamKind::U64][..]));
        let cases = [
            (v6.replace("schema = 6", "schema = 5"), "comes with manifest schema 6"),
            (v6.replace(&expr, "relu<kiln_tag_f16,4>"), "neither a C identifier"),
            (v6.replace(&expr, "relu<kiln_tag_f16; asm(\\\"trap;\\\")>"), "neither a C identifier"),
            (v6.replace(&expr, "relu_f32"), "kernel \"relu_f32\" is declared twice"),
        ];
        for (text, want) in cases {
            let err = Manifest::parse(&text).unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
    }

    /// Schema 7: `pdl` may list kernels by `*` pattern; a pattern flags exactly the kernels of
    /// its source that it matches, needs schema 7, and must match one.
    #[test]
    fn pdl_patterns_come_with_schema_7() {
        let v7 = GOOD
            .replace("schema = 2", "schema = 7")
            .replace("kernels = [\"relu_f32\"]", "kernels = [\"relu_f32\", \"relu<kiln_tag_f16>\", \"abs_f32\"]")
            .replace("[\"relu_*\"]", "[\"relu_*\", \"relu<*>\", \"abs_*\"]")
            .replace(
                "kernels = [\"relu_f32\", \"relu<kiln_tag_f16>\", \"abs_f32\"]",
                "kernels = [\"relu_f32\", \"relu<kiln_tag_f16>\", \"abs_f32\"]\npdl = [\"relu*\"]",
            );
        let m = Manifest::parse(&v7).unwrap();
        assert!(m.kernel_pdl("relu_f32") && m.kernel_pdl("relu<kiln_tag_f16>"));
        assert!(!m.kernel_pdl("abs_f32") && !m.kernel_pdl("relu_f16"));
        // Names still work, and flag only themselves.
        let plain = Manifest::parse(&v7.replace("pdl = [\"relu*\"]", "pdl = [\"relu_f32\"]")).unwrap();
        assert!(plain.kernel_pdl("relu_f32") && !plain.kernel_pdl("relu<kiln_tag_f16>"));
        let cases = [
            (v7.replace("schema = 7", "schema = 6"), "pdl pattern \"relu*\" comes with manifest schema 7"),
            (v7.replace("pdl = [\"relu*\"]", "pdl = [\"gelu*\"]"), "pdl entry \"gelu*\" matches none of its `kernels`"),
        ];
        for (text, want) in cases {
            let err = Manifest::parse(&text).unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
    }

    #[test]
    fn name_expressions_have_one_spelling() {
        use crate::names::is_name_expression as ok;
        for good in
            ["kiln_cast<kiln_tag_f16>", "gqa<kiln_tag_bf16, 4>", "k<a, -1, b_2>", "k<_T, 18446744073709551615>", "k<0>"]
        {
            assert!(ok(good), "{good}");
        }
        for bad in [
            "kiln_cast",
            "kiln_cast<>",
            "<kiln_tag_f16>",
            "k<a,b>",
            "k<a , b>",
            "k< a>",
            "k<a>>",
            "k<a<b>>",
            "k<a>x",
            "k<a::b>",
            "k<1a>",
            "k<->",
            "9k<a>",
            "k<123456789012345678901>",
            "k<18446744073709551616>",
            "k<-9223372036854775809>",
            "k<010>",
            "k<-0>",
        ] {
            assert!(!ok(bad), "{bad}");
        }
    }

    /// Schema 4: a header-only package (no shim, no ops), `headers` under `include/` included
    /// as `<package>/<file>`, `[dependencies]` by semver; each misuse named.
    #[test]
    fn headers_and_dependencies_come_with_schema_4() {
        let headers_only =
            "schema = 4\nabi = 1\nheaders = [\"include/a.cuh\"]\n[package]\nname = \"std\"\nversion = \"1.0.0\"\n";
        let m = Manifest::parse(headers_only).unwrap();
        assert!(m.is_header_only() && m.shim.is_empty());
        assert_eq!(m.include_name("include/a.cuh"), "std/a.cuh");
        assert!(!m.to_toml().contains("shim"), "no shim written back: {}", m.to_toml());
        let user = GOOD.replace("schema = 2", "schema = 4") + "[dependencies]\nstd = \"^1.2\"\n";
        let m = Manifest::parse(&user).unwrap();
        assert!(m.dependencies["std"].matches(&"1.3.0".parse().unwrap()));
        assert!(!m.dependencies["std"].matches(&"2.0.0".parse().unwrap()));
        assert_eq!(Manifest::parse(&m.to_toml()).unwrap(), m, "round trip");
        let cases = [
            (headers_only.replace("schema = 4", "schema = 3"), "set `schema = 4`"),
            (GOOD.to_string() + "[dependencies]\nstd = \"^1\"\n", "set `schema = 4`"),
            (headers_only.replace("include/a.cuh", "a.cuh"), "under include/"),
            (headers_only.replace("include/a.cuh", "include/a.cu"), ".cuh, .h or .hpp"),
            (headers_only.replace("\"include/a.cuh\"]", "\"include/a.cuh\", \"include/a.cuh\"]"), "listed twice"),
            (headers_only.replace("abi = 1", "abi = 1\nshim = \"shim.wasm\""), "header-only"),
            (GOOD.replace("schema = 2", "schema = 4").replace("shim = \"shim.wasm\"\n", ""), "`shim` is missing"),
            (user.replace("std = ", "kiln-unary = "), "depends on itself"),
            (user.replace("\"^1.2\"", "\"one\""), "major version number"),
        ];
        for (text, want) in cases {
            let err = Manifest::parse(&text).unwrap_err().to_string();
            assert!(err.contains(want), "{want:?} not in {err}");
        }
    }

    #[test]
    fn bad_manifests_name_the_problem() {
        let cases = [
            (GOOD.replace("1.2.3", "1.2"), "version"),
            (GOOD.replace("kiln-unary", "Kiln Unary"), "package name"),
            (GOOD.replace("\"float16\"", "\"float17\""), "unknown dtype"),
            (GOOD.replace("cuda/unary.cu", "../unary.cu"), "relative"),
            (GOOD.replace("relu_f32", "relu-f32"), "C identifier"),
            (GOOD.replace("since_opset = 6", "since_opset = 0"), "opset"),
            (GOOD.replace("abi = 1", "abi = \"x\""), "abi"),
            (format!("{GOOD}\n[files]\n\"shim.wasm\" = \"zz\""), "sha256"),
            (format!("{GOOD}\nsurprise = 1"), "surprise"),
        ];
        for (text, needle) in cases {
            let err = Manifest::parse(&text).unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} should mention {needle:?}");
        }
    }
}

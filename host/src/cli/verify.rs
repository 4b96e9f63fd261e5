//! `kiln verify PACKAGE`: runs a package's kernels on a device against its own CPU reference
//! on random inputs (the dtypes and shapes of its ONNX node tests, a few seeds, doubled shapes
//! for elementwise ops), reported as max relative error per (op, dtype), plus every ONNX node
//! test whose nodes are all ops the package claims, plus each fusion pattern the package
//! declares, fused against unfused (`verify_fusion`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use kiln_kernel_abi::manifest::{OpEntry, ValueDomain};
use kiln_kernel_abi::minifloat::{self, E8m0Rounding};
use kiln_kernel_abi::DType;
use kiln_registry::ops::normalize_domain;
use kiln_registry::Package;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use serde_json::json;

use crate::conformance::{int_value, run_test, test_dirs, to_f64, Outcome, TestResult};
use crate::ep::{Device, Runtime, Session, SessionOptions};
use crate::model::{self, Model};
use crate::tensorio::read_tensor_file;
use crate::{Error, Result, Tensor};

use super::{choose_device, registry, DeviceArg, PackageArgs};

/// Arguments of `kiln verify`.
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// The package name (e.g. kiln-unary) or folder.
    pub package: String,
    /// The device whose kernels are checked against the CPU reference.
    #[arg(long, value_enum, default_value = "cuda")]
    pub device: DeviceArg,
    /// Folders of node tests (repeatable; relative to the working directory): ONNX's (fetched
    /// by scripts/fetch-onnx-node-tests.sh) and kiln's own for onnxruntime's contrib ops
    /// (tests/contrib-node-tests) and for ONNX's ops beyond ONNX's tests (tests/onnx-node-tests).
    /// Missing folders are skipped, but one must exist.
    #[arg(
        long,
        value_name = "DIR",
        default_values = [".cache/onnx-node-1.20.0/node", "tests/contrib-node-tests", "tests/onnx-node-tests"]
    )]
    pub node_tests: Vec<PathBuf>,
    /// Random inputs per node-test model.
    #[arg(long, default_value_t = 3)]
    pub seeds: u64,
    /// Write the node-test results, the random cases and the counts as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub packages: PackageArgs,
}

/// One run of a node-test model on random inputs, device against CPU reference.
#[derive(Clone, Debug, Serialize)]
pub struct Case {
    pub test: String,
    pub op: String,
    /// The dtype of the first non-value input.
    pub dtype: String,
    pub shapes: Vec<Vec<usize>>,
    pub seed: u64,
    /// Largest |device − cpu| / max(|cpu|, atol/rtol) over the outputs.
    pub max_rel_error: f64,
    /// The relative tolerance of the first output's dtype (0: exact).
    pub tolerance: f64,
    #[serde(flatten)]
    pub outcome: Outcome,
}

/// `kiln verify`.
pub fn run(mut a: VerifyArgs) -> Result<ExitCode> {
    super::output::check_path("--json", &a.json)?;
    let folder = Path::new(&a.package);
    if folder.join("kernel.toml").is_file() {
        let pkg = Package::load_dir(folder)?;
        a.packages.packages.push(folder.to_path_buf());
        a.package = pkg.name().to_string();
    }
    let reg = registry(&a.packages)?;
    let pkg = reg.packages().filter(|p| p.name() == a.package).max_by_key(|p| p.version().clone()).cloned();
    let pkg = pkg.ok_or_else(|| {
        if let Some((p, why, _)) = reg.excluded().find(|(p, ..)| p.name() == a.package) {
            return Error::Input(format!("package {} is left out: {why}", p.id()));
        }
        let mut names: Vec<&str> = reg.packages().map(|p| p.name()).collect();
        names.dedup();
        Error::Input(format!("no package named {:?}; available packages: {}", a.package, names.join(", ")))
    })?;
    let device = choose_device(a.device)?;
    let dirs: Vec<&PathBuf> = a.node_tests.iter().filter(|d| d.is_dir()).collect();
    if dirs.is_empty() {
        let names: Vec<String> = a.node_tests.iter().map(|d| d.display().to_string()).collect();
        return Err(Error::Input(format!(
            "no node tests in {} (relative to the working directory; run kiln verify from the repository root, run scripts/fetch-onnx-node-tests.sh, or pass --node-tests DIR)",
            names.join(", ")
        )));
    }
    let rt = Runtime::new(reg, super::sandbox_config())?;
    let options = SessionOptions { device, small_integer_nodes_on_host: false, ..SessionOptions::default() };
    let (mut tests, mut cases) = (Vec::new(), Vec::new());
    let mut all = Vec::new();
    for d in dirs {
        all.extend(test_dirs(d, None)?);
    }
    let progress = super::progress::Progress::bar(all.len() as u64, &format!("verify {}", pkg.id()));
    for dir in all {
        progress.step(&dir.file_name().unwrap_or_default().to_string_lossy());
        let Ok(m) = model::load(&dir.join("model.onnx")) else { continue };
        if m.graph.nodes.is_empty()
            || !m.graph.nodes.iter().all(|n| entry(&pkg, &n.domain, &n.op_type).is_some())
            || known_unclaimed_dtype(&pkg, &m)
        {
            continue;
        }
        // The manifest promised this (op, opset, dtype), so the package's own shim answering
        // UNSUPPORTED breaks the claim: resolution picked the package because of it (its rank
        // and device checks passed, or the shim would not have been called). Unsupported
        // outcomes from elsewhere (no resolution, the host, the CPU reference) stay unsupported.
        // Random cases only draw claimed dtypes, at the test's opset.
        let claimed = claim(&pkg, &m);
        let declines = declared_declines(&pkg, &m);
        let broken = |o: &mut Outcome, dtype: &str| {
            if let (Outcome::Unsupported(why), Some((c, _))) = (&*o, &claimed) {
                if declined_by(&pkg, why) && !declines.iter().any(|d| names_use(why, d)) {
                    *o =
                        Outcome::Failed(format!("kernel.toml claims {c} for {dtype}, but the package answered: {why}"));
                }
            }
        };
        let mut r = run_test(&rt, &dir, &options);
        let test_dtype = claimed.as_ref().map(|(_, d)| d.to_string()).unwrap_or_default();
        broken(&mut r.outcome, &test_dtype);
        if !matches!(r.outcome, Outcome::Unsupported(_)) {
            let mut more = random_cases(&rt, &pkg, &dir, &r.op, m, device, a.seeds);
            more.iter_mut().for_each(|c| broken(&mut c.outcome, &c.dtype));
            cases.extend(more);
        }
        tests.push(r);
    }
    drop(progress);
    if tests.is_empty() {
        return Err(Error::Input(format!("no node tests of {}'s ops in the --node-tests folders", pkg.id())));
    }
    let fusions = super::verify_fusion::fusion_cases(&rt, &pkg, device, a.seeds);
    let mut counts = [0usize; 3];
    tests
        .iter()
        .map(|t| &t.outcome)
        .chain(cases.iter().map(|c| &c.outcome))
        .chain(fusions.iter().map(|c| &c.outcome))
        .for_each(|o| counts[slot(o)] += 1);
    let human = super::output::Human::new(&[&a.json]);
    human.print(&report(&tests, &cases, device));
    human.print(&super::verify_fusion::render(&fusions, device));
    human.line(&format!("verify {}: {} passed, {} failed, {} unsupported", a.package, counts[0], counts[1], counts[2]));
    if let Some(p) = &a.json {
        let doc = json!({
            "package": pkg.id(), "device": device.to_string(), "seeds": a.seeds,
            "passed": counts[0], "failed": counts[1], "unsupported": counts[2],
            "node_tests": tests, "random": cases, "fusions": fusions,
        });
        super::output::write_json(p, &doc)?;
    }
    Ok(super::exit::checks(counts[1] > 0))
}

/// Whether an unsupported outcome's reason is `pkg`'s own shim declining (a `ShimFailure` of
/// kind unsupported from that package), as opposed to the host or resolution.
fn declined_by(pkg: &Package, why: &str) -> bool {
    why.contains(&format!("package {}, op ", pkg.id())) && why.contains("): unsupported: ")
}

/// Whether `why` names `name` as a whole word (not inside a longer identifier: a declined
/// `mode` does not excuse a refusal about `training_mode`).
fn names_use(why: &str, name: &str) -> bool {
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    why.match_indices(name).any(|(i, _)| {
        let before = why[..i].chars().next_back().is_none_or(|c| !ident(c));
        let after = why[i + name.len()..].chars().next().is_none_or(|c| !ident(c));
        before && after
    })
}

/// The uses `pkg`'s manifest declines (`declines`, schema 9) for `m`'s ops: a refusal that names
/// one is declared, not a broken claim.
fn declared_declines(pkg: &Package, m: &Model) -> Vec<String> {
    m.graph.nodes.iter().filter_map(|n| entry(pkg, &n.domain, &n.op_type)).flat_map(|e| e.declines.clone()).collect()
}

/// What `pkg`'s manifest claims for every node of `m` (`Op at opset O`, joined) and the first
/// node's dtype, when it claims each one's op, the model's opset and the dtype of its
/// `dtype_input`; `None` when a node is not claimed or its input dtype is not known before a run.
fn claim(pkg: &Package, m: &Model) -> Option<(String, DType)> {
    let mut parts = Vec::new();
    let mut first = None;
    for n in &m.graph.nodes {
        let e = entry(pkg, &n.domain, &n.op_type)?;
        let opset = m.opset(&n.domain)?;
        let dtype = m.graph.declared_dtype((*n.inputs.get(e.dtype_input)?)?)?;
        if !e.covers_opset(opset) || !e.dtype_set().contains(&dtype) {
            return None;
        }
        parts.push(format!("{} at opset {opset}", n.op_type));
        first.get_or_insert(dtype);
    }
    Some((parts.join(", "), first?))
}

/// Whether a node of `m` has a `dtype_input` whose dtype the model declares and `pkg` does not
/// claim for its op: another package runs that test (kiln-string's Equal is for strings only,
/// kiln-binary's for numbers).
fn known_unclaimed_dtype(pkg: &Package, m: &Model) -> bool {
    m.graph.nodes.iter().any(|n| {
        let Some(e) = entry(pkg, &n.domain, &n.op_type) else { return false };
        let dtype = n.inputs.get(e.dtype_input).copied().flatten().and_then(|v| m.graph.declared_dtype(v));
        dtype.is_some_and(|d| !e.dtype_set().contains(&d))
    })
}

/// The manifest entry of `pkg` that claims `op_type` in `domain`.
fn entry<'a>(pkg: &'a Package, domain: &str, op_type: &str) -> Option<&'a OpEntry> {
    let d = normalize_domain(domain);
    pkg.manifest.ops.iter().find(|e| normalize_domain(&e.domain) == d && e.op_types.iter().any(|t| t == op_type))
}

/// Where a random input's values lie: the package's declared domain of the input
/// (`[[input_domains]]`, ABI.md §7.4; any when none is declared), with
/// [`ValueDomain::PositiveIfUnsignedOutput`] resolved against the test's outputs.
fn range(pkg: &Package, node: &model::Node, slot: usize, unsigned_out: bool) -> ValueDomain {
    match pkg.manifest.input_domain(&node.domain, &node.op_type, slot) {
        ValueDomain::PositiveIfUnsignedOutput if unsigned_out => ValueDomain::Positive,
        ValueDomain::PositiveIfUnsignedOutput => ValueDomain::Any,
        d => d,
    }
}

/// A random tensor of `dtype` and `shape` within `r` (floats from x in [-2, 2], integers from
/// [-5, 5] or [0, 5] when unsigned, bools random; [`ValueDomain`] says how each domain maps them;
/// `Keep` is drawn as `Any`: the caller keeps the test's data instead).
pub(super) fn random_tensor(rng: &mut StdRng, dtype: DType, shape: &[usize], r: ValueDomain) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let unsigned = matches!(dtype, DType::U8 | DType::U16 | DType::U32 | DType::U64);
    let mut b = Vec::with_capacity(n * dtype.size().unwrap_or(1));
    let mut fields = Vec::new(); // float8, float4, 4-bit and 2-bit elements, packed below
    for _ in 0..n {
        let x: f64 = rng.random_range(-2.0..=2.0);
        let i: i64 = match r {
            ValueDomain::Positive | ValueDomain::Nonzero | ValueDomain::AboveOne => rng.random_range(1..=5),
            ValueDomain::Exponent => rng.random_range(0..=3),
            ValueDomain::Probability => rng.random_range(0..=1),
            _ if unsigned || dtype == DType::Bool => rng.random_range(0..=5),
            _ => rng.random_range(-5..=5),
        };
        let x = match r {
            ValueDomain::Positive => x.abs() + 0.1,
            ValueDomain::Unit => x * 0.45,
            ValueDomain::AboveOne => x.abs() + 1.0,
            ValueDomain::Nonzero => x.signum() * (x.abs() + 0.1),
            ValueDomain::Probability => x.abs() / 2.0,
            _ => x,
        };
        match dtype {
            DType::F32 => b.extend((x as f32).to_le_bytes()),
            DType::F64 => b.extend(x.to_le_bytes()),
            DType::F16 => b.extend(half::f16::from_f64(x).to_le_bytes()),
            DType::BF16 => b.extend(half::bf16::from_f64(x).to_le_bytes()),
            DType::Bool => b.push((i % 2) as u8),
            DType::U8 | DType::I8 => b.push(i as u8),
            DType::I16 | DType::U16 => b.extend((i as i16).to_le_bytes()),
            DType::I32 | DType::U32 => b.extend((i as i32).to_le_bytes()),
            DType::I64 | DType::U64 => b.extend(i.to_le_bytes()),
            DType::String => return Err(Error::Unsupported("random string tensors".into())),
            DType::F8E8M0 => fields.push(minifloat::e8m0_from_f32(x.abs() as f32, true, E8m0Rounding::Up)),
            d if d.is_minifloat() => fields.push(minifloat::from_f64(d, x, true)),
            d => fields.push(minifloat::narrow_int_field(d, if unsigned_narrow(d) { i.abs() } else { i })),
        }
    }
    if !fields.is_empty() {
        b = vec![0; dtype.storage_bytes(n as u64).unwrap_or(0) as usize];
        for (i, f) in fields.into_iter().enumerate() {
            minifloat::packed_set(dtype, &mut b, i, f);
        }
    }
    Tensor::new(dtype, shape.to_vec(), b.into())
}

/// Whether `d` is `uint4` or `uint2`.
fn unsigned_narrow(d: DType) -> bool {
    matches!(d, DType::U4 | DType::U2)
}

/// (rtol, atol) per dtype; integers and bools exactly.
pub(super) fn tolerance(d: DType) -> (f64, f64) {
    match d {
        DType::F32 => (1e-4, 1e-5),
        DType::F16 => (1e-2, 1e-3),
        DType::BF16 => (5e-2, 1e-2),
        DType::F64 => (1e-9, 1e-12),
        // float8 and float4 codes convert exactly on both devices.
        d if d.is_minifloat() => (1e-9, 1e-12),
        _ => (0.0, 0.0),
    }
}

/// What an error is relative to in [`max_rel_error`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Scale {
    /// Each element's own reference value: max |a − e| / max(|e|, atol/rtol).
    Element,
    /// The whole reference's largest magnitude: max |a − e| / max(max |e|, atol/rtol). For a
    /// fused op against the ops it replaces: the same arithmetic with other roundings inside a
    /// reduction, whose error is bounded by the terms' size, not by a cancelled sum's.
    Tensor,
}

/// The largest error of `a` against the reference `e` relative to `scale` (NaN equals NaN; an
/// infinity or NaN on one side only is an infinite error; integers relative to max(|e|, 1)), or
/// why they cannot be compared.
pub(super) fn max_rel_error(a: &Tensor, e: &Tensor, scale: Scale) -> std::result::Result<f64, String> {
    if (a.dtype, &a.shape) != (e.dtype, &e.shape) {
        return Err(format!("{} {:?} != reference {} {:?}", a.dtype, a.shape, e.dtype, e.shape));
    }
    if !e.dtype.is_float() && !e.dtype.is_minifloat() {
        let rel = |i| (int_value(a, i) - int_value(e, i)).abs() as f64 / (int_value(e, i).abs().max(1) as f64);
        return Ok((0..e.numel()).map(rel).fold(0.0, f64::max));
    }
    let (rtol, atol) = tolerance(e.dtype);
    let (a, e) = (to_f64(a), to_f64(e));
    let largest = e.iter().filter(|v| v.is_finite()).fold(0.0f64, |m, v| m.max(v.abs()));
    let err = |(x, y): (&f64, &f64)| match () {
        _ if x.is_nan() && y.is_nan() || x == y => 0.0,
        _ if x.is_nan() || y.is_nan() || x.is_infinite() || y.is_infinite() => f64::INFINITY,
        _ => {
            let of = if scale == Scale::Tensor { largest } else { y.abs() };
            (x - y).abs() / of.max(atol / rtol)
        }
    };
    Ok(a.iter().zip(&e).map(err).fold(0.0, f64::max))
}

/// Random-input cases of one node-test model: `seeds` runs with the test's shapes, and one
/// with every dim doubled when all inputs are float tensors of one shape.
fn random_cases(
    rt: &Arc<Runtime>,
    pkg: &Package,
    dir: &Path,
    op: &str,
    m: Model,
    device: Device,
    seeds: u64,
) -> Vec<Case> {
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let g = &m.graph;
    let mut data = Vec::new();
    for k in 0..g.inputs.len() {
        match read_tensor_file(&dir.join(format!("test_data_set_0/input_{k}.pb"))) {
            Ok((t, _)) => data.push(t),
            Err(_) => return Vec::new(),
        }
    }
    let unsigned_out = g.outputs.iter().any(|&o| {
        g.values[o].ty.as_ref().is_some_and(|t| matches!(t.dtype, DType::U8 | DType::U16 | DType::U32 | DType::U64))
    });
    let ranges: Vec<ValueDomain> = g
        .inputs
        .iter()
        .map(|&id| {
            // Every (node, input slot) that reads this graph input.
            let uses: Vec<_> = g
                .nodes
                .iter()
                .flat_map(|n| n.inputs.iter().enumerate().filter(|(_, i)| **i == Some(id)).map(move |(s, _)| (n, s)))
                .collect();
            let value = |(n, s): &(&model::Node, usize)| {
                entry(pkg, &n.domain, &n.op_type).is_some_and(|e| e.value_inputs.contains(s))
            };
            match uses.first() {
                _ if uses.iter().any(value) => ValueDomain::Keep,
                Some((n, s)) => range(pkg, n, *s, unsigned_out),
                None => ValueDomain::Any,
            }
        })
        .collect();
    let label = data.iter().zip(&ranges).find(|(_, r)| **r != ValueDomain::Keep).or(data.iter().zip(&ranges).next());
    let label = label.map_or("-".to_string(), |(t, _)| t.dtype.to_string());
    let randomized = !data.is_empty() && ranges.iter().all(|r| *r != ValueDomain::Keep);
    let shapes: Vec<Vec<usize>> = data.iter().map(|t| t.shape.clone()).collect();
    let dtypes: Vec<DType> = data.iter().map(|t| t.dtype).collect();
    // The test's shapes and dtypes, one run per seed.
    let mut variants = vec![Variant {
        model: m.clone(),
        dtypes: dtypes.clone(),
        label,
        tol: output_tolerance(&m),
        runs: (0..seeds).map(|s| (s, shapes.clone())).collect(),
    }];
    // Every dim doubled, when all inputs are float tensors of one shape.
    let relaxed = relax(&m, DType::F32, DType::F32);
    if randomized && data.iter().all(|t| t.dtype.is_float() && t.shape == data[0].shape && !t.shape.is_empty()) {
        let doubled = shapes.iter().map(|s| s.iter().map(|d| d * 2).collect()).collect();
        variants.push(Variant { model: relaxed, runs: vec![(seeds, doubled)], ..variants[0].clone() });
    }
    // The other float dtypes the package claims, when the test is all float32.
    let all_f32 = m.graph.initializers.is_empty() && dtypes.iter().all(|d| *d == DType::F32);
    for d in [DType::F16, DType::BF16, DType::F64] {
        let claimed =
            g.nodes.iter().all(|n| entry(pkg, &n.domain, &n.op_type).is_some_and(|e| e.dtype_set().contains(&d)));
        if randomized && all_f32 && claimed {
            let (model, dtypes) = (relax(&m, DType::F32, d), vec![d; data.len()]);
            let (tol, runs) = (output_tolerance(&model), vec![(0, shapes.clone())]);
            variants.push(Variant { model, dtypes, label: d.to_string(), tol, runs });
        }
    }
    let mut cases = Vec::new();
    for v in variants {
        let s = |d| {
            Session::new(
                rt.clone(),
                v.model.clone(),
                SessionOptions { device: d, small_integer_nodes_on_host: false, ..Default::default() },
            )
        };
        let mut sessions = s(Device::Cpu).and_then(|c| Ok((c, s(device)?)));
        for (seed, shapes) in v.runs {
            let mut case = Case {
                test: name.clone(),
                op: op.to_string(),
                dtype: v.label.clone(),
                shapes,
                seed,
                max_rel_error: 0.0,
                tolerance: v.tol,
                outcome: Outcome::Passed,
            };
            let result = match &mut sessions {
                Err(e) => Err(outcome(e, "session")),
                Ok(pair) => compare_run(pair, &data, &ranges, &v.dtypes, &mut case),
            };
            case.outcome = result.err().unwrap_or(Outcome::Passed);
            cases.push(case);
        }
    }
    cases
}

/// A model to run on random inputs: its input dtypes, the table's dtype and tolerance, and
/// the (seed, input shapes) of each run.
#[derive(Clone)]
struct Variant {
    model: Model,
    dtypes: Vec<DType>,
    label: String,
    tol: f64,
    runs: Vec<(u64, Vec<Vec<usize>>)>,
}

/// The relative tolerance of the first output's declared dtype (0: exact).
fn output_tolerance(m: &Model) -> f64 {
    let g = &m.graph;
    g.outputs.first().and_then(|&o| g.values[o].ty.as_ref()).map_or(0.0, |t| tolerance(t.dtype).0)
}

/// `m` with no declared dims (any shape) and every `from` value type made `to`.
fn relax(m: &Model, from: DType, to: DType) -> Model {
    let mut m = m.clone();
    for t in m.graph.values.iter_mut().filter_map(|v| v.ty.as_mut()) {
        t.dims = None;
        if t.dtype == from {
            t.dtype = to;
        }
    }
    m
}

/// Runs one case: the CPU reference (retried with the test's non-float inputs when it rejects
/// random ones: indices, for example), then the device; sets the case's max relative error.
fn compare_run(
    (cpu, dev): &mut (Session, Session),
    data: &[Tensor],
    ranges: &[ValueDomain],
    dtypes: &[DType],
    case: &mut Case,
) -> std::result::Result<(), Outcome> {
    let names = cpu.input_names();
    let feeds = |keep_ints: bool| -> Result<Vec<(String, Tensor)>> {
        let mut rng = StdRng::seed_from_u64(case.seed);
        let mut out = Vec::new();
        for ((((t, r), shape), d), name) in data.iter().zip(ranges).zip(&case.shapes).zip(dtypes).zip(&names) {
            let keep = *r == ValueDomain::Keep || (keep_ints && !d.is_float() && t.shape == *shape);
            out.push((name.clone(), if keep { t.clone() } else { random_tensor(&mut rng, *d, shape, *r)? }));
        }
        Ok(out)
    };
    let run = |s: &mut Session, keep: bool| feeds(keep).and_then(|f| Ok((f.clone(), s.run(f)?)));
    let (feeds, reference) = run(cpu, false)
        .or_else(|_| run(cpu, true))
        .map_err(|e| Outcome::Unsupported(format!("the CPU reference rejects random inputs: {e}")))?;
    let actual = dev.run(feeds).map_err(|e| outcome(&e, "device"))?;
    for ((name, a), (_, e)) in actual.iter().zip(&reference) {
        let err = max_rel_error(a, e, Scale::Element).map_err(|m| Outcome::Failed(format!("output {name:?}: {m}")))?;
        case.max_rel_error = case.max_rel_error.max(err);
        let rtol = tolerance(e.dtype).0;
        if err > rtol {
            return Err(Outcome::Failed(format!("output {name:?}: max relative error {err:.3e} > {rtol:e}")));
        }
    }
    Ok(())
}

/// Index of an outcome in `[passed, failed, unsupported]` counts.
fn slot(o: &Outcome) -> usize {
    match o {
        Outcome::Passed => 0,
        Outcome::Failed(_) => 1,
        Outcome::Unsupported(_) => 2,
    }
}

/// A device or session error as an outcome: unsupported, or failed.
pub(super) fn outcome(e: &Error, what: &str) -> Outcome {
    if e.is_unsupported() {
        Outcome::Unsupported(format!("{what}: {e}"))
    } else {
        Outcome::Failed(format!("{what}: {e}"))
    }
}

type Row = (usize, f64, f64, [usize; 3]);

/// The node tests per op, the random cases per (op, dtype), and every failure.
fn report(tests: &[TestResult], cases: &[Case], device: Device) -> String {
    let mut by_op: BTreeMap<&str, [usize; 3]> = BTreeMap::new();
    tests.iter().for_each(|t| by_op.entry(&t.op).or_default()[slot(&t.outcome)] += 1);
    let mut s =
        format!("ONNX node tests on {device}\n{:<32} {:>7} {:>7} {:>12}\n", "op", "passed", "failed", "unsupported");
    for (op, [p, f, u]) in &by_op {
        s += &format!("{op:<32} {p:>7} {f:>7} {u:>12}\n");
    }
    // (op, dtype) → cases, max relative error, tolerance, [passed, failed, unsupported].
    let mut rows: BTreeMap<(&str, &str), Row> = BTreeMap::new();
    for c in cases {
        let r = rows.entry((&c.op, &c.dtype)).or_insert((0, 0.0, c.tolerance, [0; 3]));
        r.0 += 1;
        r.1 = r.1.max(c.max_rel_error);
        r.2 = r.2.max(c.tolerance);
        r.3[slot(&c.outcome)] += 1;
    }
    s += &format!("\nrandom inputs, {device} against the CPU reference\n");
    if device == Device::Cpu {
        s += "(on the CPU the run is the reference itself: these rows check that every case runs)\n";
    }
    s += &format!("{:<32} {:<9} {:>6} {:>13} {:>10}  status\n", "op", "dtype", "cases", "max rel err", "tolerance");
    for ((op, dtype), (n, err, tol, [_, f, u])) in &rows {
        let status = match (f, u) {
            (0, u) if u == n => "unsupported".to_string(),
            (0, _) => "ok".to_string(),
            (f, _) => format!("FAIL ({f})"),
        };
        let tol = if *tol == 0.0 { "exact".to_string() } else { format!("{tol:.0e}") };
        s += &format!("{op:<32} {dtype:<9} {n:>6} {err:>13.3e} {tol:>10}  {status}\n");
    }
    let failed = tests.iter().map(|t| (&t.name, &t.outcome)).chain(cases.iter().map(|c| (&c.test, &c.outcome)));
    let failed: Vec<_> =
        failed.filter_map(|(n, o)| if let Outcome::Failed(m) = o { Some((n, m)) } else { None }).collect();
    if !failed.is_empty() {
        s += "\nfailed:\n";
        for (n, m) in failed {
            s += &format!("  {n}: {}\n", m.lines().next().unwrap_or(""));
        }
    }
    s + "\n"
}

#[cfg(test)]
mod tests {
    use super::names_use;

    #[test]
    fn a_declined_use_is_named_as_a_whole_word() {
        let why = "unsupported: Dropout: training_mode with ratio 0.5 draws a random mask";
        assert!(names_use(why, "training_mode"));
        assert!(!names_use(why, "mode"));
        assert!(!names_use(why, "training"));
        assert!(names_use("`axis` = 3 is not supported", "axis"));
    }
}

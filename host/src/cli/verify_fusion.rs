//! `kiln verify`'s fusion cases: each `[[fusions]]` pattern of the package is built as a
//! graph of its own (`match` nodes, pattern inputs at the `verify` shapes, constants random),
//! run unfused through the original ops' CPU references and fused on the device, and compared
//! at the dtype's tolerance, each output's error relative to its largest reference value (the
//! fused op rounds differently inside its reductions: an element's error is bounded by the size
//! of the terms, not by a sum that cancels). A pattern that does not match its own graph fails.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use kiln_kernel_abi::fusion::Fusion;
use kiln_kernel_abi::DType;
use kiln_registry::Package;
use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use crate::conformance::Outcome;
use crate::ep::{Device, Runtime, Session, SessionOptions};
use crate::model::{AttrValue, Dim, Graph, Model, Node, Value, ValueType};
use crate::{Result, Tensor};

use super::verify::{max_rel_error, outcome, random_tensor, tolerance, Scale};
use kiln_kernel_abi::manifest::ValueDomain;

/// One run of a fusion pattern on random inputs.
#[derive(Clone, Debug, Serialize)]
pub struct FusionCase {
    pub fusion: String,
    pub dtype: String,
    pub shapes: BTreeMap<String, Vec<usize>>,
    pub seed: u64,
    /// Largest |fused − unfused| / max(|unfused|, atol/rtol) over the outputs.
    pub max_rel_error: f64,
    pub tolerance: f64,
    #[serde(flatten)]
    pub outcome: Outcome,
}

const FLOATS: [DType; 4] = [DType::F32, DType::F16, DType::BF16, DType::F64];

/// The dtypes a pattern is verified in: the float types its dtype constraint allows (that
/// of the first pattern input whose constraint allows a float type, else of any constrained
/// variable), else float32.
fn case_dtypes(f: &Fusion) -> Vec<DType> {
    let floats = |names: &Vec<String>| -> Vec<DType> {
        FLOATS.into_iter().filter(|d| names.iter().any(|n| n == d.name())).collect()
    };
    let constraint = f
        .pattern_inputs()
        .into_iter()
        .filter_map(|v| f.dtypes.get(v))
        .find(|names| !floats(names).is_empty())
        .or_else(|| f.dtypes.values().next());
    match constraint {
        None => vec![DType::F32],
        Some(names) => floats(names),
    }
}

/// The dtype pattern input `v` takes in a case of `dtype`: the case's, unless the input's dtype
/// constraint leaves it out, then the first dtype the constraint allows (MatMulNBits' packed
/// uint8 weights beside float activations).
fn input_dtype(f: &Fusion, v: &str, dtype: DType) -> DType {
    match f.dtypes.get(v) {
        Some(names) if !names.iter().any(|n| n == dtype.name()) => {
            names.iter().find_map(|n| DType::from_name(n)).unwrap_or(dtype)
        }
        _ => dtype,
    }
}

/// The attributes a match node gets in the verify graph: its integer constraints, and its
/// `"VAR.AXIS"` constraints from the verify shapes (`"*"` and unknown dimensions left out).
fn verify_attributes(f: &Fusion, p: &kiln_kernel_abi::fusion::PatternNode) -> Vec<(String, AttrValue)> {
    p.attributes
        .iter()
        .filter_map(|(name, c)| {
            if let kiln_kernel_abi::fusion::AttrConstraint::Ints(v) = c {
                return Some((name.clone(), AttrValue::Ints(v.clone())));
            }
            let shape = |var: &str| f.verify.get(var).map(|s| s.iter().map(|&d| Some(d as i64)).collect());
            c.resolve(shape).map(|v| (name.clone(), AttrValue::Int(v)))
        })
        .collect()
}

/// The pattern as a model: its match nodes, inputs of `dtype` at the `verify` shapes
/// (constants as random initializers from `seed`), its `outputs` as graph outputs.
fn pattern_model(f: &Fusion, dtype: DType, seed: u64) -> Result<Model> {
    let mut g = Graph::default();
    let mut ids: HashMap<String, usize> = HashMap::new();
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut id = |g: &mut Graph, name: &str| -> usize {
        *ids.entry(name.to_string()).or_insert_with(|| {
            g.values.push(Value { name: name.to_string(), ty: None });
            g.values.len() - 1
        })
    };
    for v in f.pattern_inputs() {
        let shape = &f.verify[v];
        let i = id(&mut g, v);
        let dtype = input_dtype(f, v, dtype);
        g.values[i].ty = Some(ValueType {
            dtype,
            dims: Some(shape.iter().map(|&d| Dim::Known(d)).collect()),
            kind: Default::default(),
        });
        if let Some(xs) = f.verify_values.get(v) {
            g.initializers.insert(i, Tensor::from_f64s(dtype, shape.clone(), xs)?);
        } else if let Some(&x) = f.values.get(v) {
            g.initializers.insert(i, Tensor::from_f64s(dtype, shape.clone(), &vec![x; shape.iter().product()])?);
        } else if f.constant.iter().any(|c| c == v) {
            g.initializers.insert(i, random_tensor(&mut rng, dtype, shape, ValueDomain::Any)?);
        } else {
            g.inputs.push(i);
        }
    }
    for (k, p) in f.pattern.iter().enumerate() {
        let inputs = p.inputs.iter().map(|v| (!v.is_empty()).then(|| id(&mut g, v))).collect();
        let outputs = p.outputs.iter().map(|v| (!v.is_empty()).then(|| id(&mut g, v))).collect();
        g.nodes.push(Node {
            name: format!("match[{k}]"),
            op_type: p.op.clone(),
            domain: p.domain.clone(),
            inputs,
            implicit_inputs: 0,
            outputs,
            attributes: verify_attributes(f, p),
        });
    }
    g.outputs = f.outputs.iter().map(|v| id(&mut g, v)).collect();
    let mut opsets: HashMap<String, i64> = HashMap::new();
    for p in &f.pattern {
        let d = if p.domain == "ai.onnx" { String::new() } else { p.domain.clone() };
        let v = if d.is_empty() { 21 } else { 1 };
        opsets.insert(d, v);
    }
    Ok(Model { path: None, ir_version: 10, opsets, producer: "kiln verify".into(), graph: g })
}

/// Every fusion of `pkg`, `seeds` runs per dtype, fused on `device` against unfused on the CPU.
pub fn fusion_cases(rt: &Arc<Runtime>, pkg: &Package, device: Device, seeds: u64) -> Vec<FusionCase> {
    let mut cases = Vec::new();
    for f in &pkg.manifest.fusions {
        let base = FusionCase {
            fusion: f.name.clone(),
            dtype: "-".into(),
            shapes: f.verify.clone(),
            seed: 0,
            max_rel_error: 0.0,
            tolerance: 0.0,
            outcome: Outcome::Passed,
        };
        if f.verify.is_empty() {
            let why = "declares no `verify` shapes for its pattern inputs".to_string();
            cases.push(FusionCase { outcome: Outcome::Unsupported(why), ..base });
            continue;
        }
        let dtypes = case_dtypes(f);
        if dtypes.is_empty() {
            let why = "its dtype constraint allows no float type, the only ones verify draws".to_string();
            cases.push(FusionCase { outcome: Outcome::Unsupported(why), ..base });
            continue;
        }
        for dtype in dtypes {
            for seed in 0..seeds.max(1) {
                let mut case =
                    FusionCase { dtype: dtype.to_string(), seed, tolerance: tolerance(dtype).0, ..base.clone() };
                if let Err(o) = run_case(rt, &pkg.id(), f, dtype, device, &mut case) {
                    case.outcome = o;
                }
                cases.push(case);
            }
        }
    }
    cases
}

fn run_case(
    rt: &Arc<Runtime>,
    pkg_id: &str,
    f: &Fusion,
    dtype: DType,
    device: Device,
    case: &mut FusionCase,
) -> std::result::Result<(), Outcome> {
    let model = pattern_model(f, dtype, case.seed).map_err(|e| outcome(&e, "pattern graph"))?;
    let opts = |device, fuse| SessionOptions { device, fuse, small_integer_nodes_on_host: false, ..Default::default() };
    let mut unfused =
        Session::new(rt.clone(), model.clone(), opts(Device::Cpu, false)).map_err(|e| outcome(&e, "unfused"))?;
    let mut fused = Session::new(rt.clone(), model, opts(device, true)).map_err(|e| outcome(&e, "fused"))?;
    let report = &fused.report.fusions;
    if !report.applied.iter().any(|a| a.fusion == f.name && a.package == pkg_id) {
        let why: Vec<String> = report.rejected.iter().map(|r| format!("{}: {}", r.fusion, r.reason)).collect();
        return Err(Outcome::Failed(format!(
            "the pattern does not match its own verify graph{}",
            if why.is_empty() { String::new() } else { format!(" ({})", why.join("; ")) }
        )));
    }
    let mut rng = StdRng::seed_from_u64(case.seed);
    let mut feeds = Vec::new();
    for v in f.pattern_inputs() {
        if !f.constant.iter().any(|c| c == v) {
            let t: Tensor = random_tensor(&mut rng, input_dtype(f, v, dtype), &f.verify[v], ValueDomain::Any)
                .map_err(|e| outcome(&e, "inputs"))?;
            feeds.push((v.to_string(), t));
        }
    }
    let reference = unfused.run(feeds.clone()).map_err(|e| outcome(&e, "unfused"))?;
    let actual = fused.run(feeds).map_err(|e| outcome(&e, "fused"))?;
    for ((name, a), (_, e)) in actual.iter().zip(&reference) {
        let err = max_rel_error(a, e, Scale::Tensor).map_err(|m| Outcome::Failed(format!("output {name:?}: {m}")))?;
        case.max_rel_error = case.max_rel_error.max(err);
        if err > case.tolerance {
            return Err(Outcome::Failed(format!(
                "output {name:?}: max error relative to the output's largest value {err:.3e} > {:e} (fused against unfused)",
                case.tolerance
            )));
        }
    }
    Ok(())
}

/// The fusion rows of the verify report.
pub fn render(cases: &[FusionCase], device: Device) -> String {
    if cases.is_empty() {
        return String::new();
    }
    let mut s = format!(
        "fusions, fused on {device} against the unfused ops on the CPU (error relative to each output's largest value)\n"
    );
    let w = cases.iter().map(|c| c.fusion.len()).max().unwrap_or(0).max(24);
    s += &format!("{:<w$} {:<9} {:>6} {:>13} {:>10}  status\n", "fusion", "dtype", "cases", "max rel err", "tolerance");
    // (fusion, dtype) → cases, max relative error, tolerance, outcomes.
    type Row<'a> = (usize, f64, f64, Vec<&'a Outcome>);
    let mut rows: BTreeMap<(&str, &str), Row<'_>> = BTreeMap::new();
    for c in cases {
        let r = rows.entry((&c.fusion, &c.dtype)).or_insert((0, 0.0, c.tolerance, Vec::new()));
        r.0 += 1;
        r.1 = r.1.max(c.max_rel_error);
        r.3.push(&c.outcome);
    }
    for ((name, dtype), (n, err, tol, outcomes)) in rows {
        let status = match outcomes.iter().find(|o| !matches!(o, Outcome::Passed)) {
            None => "ok".to_string(),
            Some(Outcome::Failed(m)) => format!("FAIL: {}", m.lines().next().unwrap_or("")),
            Some(Outcome::Unsupported(m)) => format!("unsupported: {m}"),
            Some(Outcome::Passed) => "ok".to_string(),
        };
        s += &format!("{name:<w$} {dtype:<9} {n:>6} {err:>13.3e} {tol:>10.0e}  {status}\n");
    }
    s + "\n"
}

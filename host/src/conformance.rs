//! ONNX backend node tests: each test folder holds `model.onnx` and `test_data_set_*/`
//! with `input_K.pb` / `output_K.pb` (`TensorProto`). Outputs are compared as ONNX's backend
//! runner does: `|actual − expected| ≤ atol + rtol·|expected|` (rtol 1e-3, atol 1e-7),
//! NaN equal to NaN, integers and bools exactly.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use kiln_kernel_abi::{minifloat, DType};
use serde::Serialize;

use crate::ep::{Runtime, Session, SessionOptions};
use crate::host_value::compare_values;
use crate::model;
use crate::tensorio::read_value_file;
use crate::{Error, HostValue, Result, Tensor};

/// ONNX's default tolerances.
pub const RTOL: f64 = 1e-3;
pub const ATOL: f64 = 1e-7;

/// How one test ended.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "status", content = "reason", rename_all = "lowercase")]
pub enum Outcome {
    Passed,
    Failed(String),
    /// An op, dtype, attribute or feature no package (or the host) supports.
    Unsupported(String),
}

/// The result of one test folder.
#[derive(Clone, Debug, Serialize)]
pub struct TestResult {
    pub name: String,
    /// The op the test is about (its single node, or the op its name starts with).
    pub op: String,
    #[serde(flatten)]
    pub outcome: Outcome,
    pub time_ms: f64,
    /// With `check_dispatch`: ops whose package had no GPU dispatch.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub no_dispatch: Vec<String>,
}

/// Whether test `name` contains `filter` or, comma-separated, one of its non-empty parts (a
/// filter without any matches every test).
fn matches_filter(name: &str, filter: &str) -> bool {
    let mut parts = filter.split(',').map(str::trim).filter(|f| !f.is_empty()).peekable();
    parts.peek().is_none() || parts.any(|f| name.contains(f))
}

/// Test folders under `dir` whose names contain `filter` (or, comma-separated, any of its parts),
/// sorted; `dir` itself when it is one test folder (it holds model.onnx). Errors: `dir` cannot be
/// read.
pub fn test_dirs(dir: &Path, filter: Option<&str>) -> Result<Vec<PathBuf>> {
    let io = |source| Error::Io { path: dir.to_path_buf(), source };
    if dir.join("model.onnx").is_file() {
        // One test folder.
        return Ok(vec![dir.to_path_buf()]);
    }
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(io)?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("model.onnx").is_file())
        .filter(|p| filter.is_none_or(|f| p.file_name().is_some_and(|n| matches_filter(&n.to_string_lossy(), f))))
        .collect();
    dirs.sort();
    Ok(dirs)
}

/// Why ONNX 1.20's QLinearMatMul int8 tests are not run.
const QLINEAR_MATMUL_WRAPS: &str = "ONNX 1.20's expected output wraps an out-of-range int8 result instead of \
     saturating it (onnx/onnx#7835; onnx/onnx#7868 regenerated the data): kiln saturates, as the specification and \
     onnxruntime do (tests/quant.rs checks it on this test's data)";

/// Why ONNX 1.20's inverse DFT tests are not run.
const DFT_INVERSE_FLOAT32: &str = "ONNX 1.20's expected output is a float32 inverse FFT, up to 1.5e-6 from the \
     exact transform (of values up to 54): at 10 of its 200 elements, where the exact value is about 0, that is more \
     than the runner's atol of 1e-7; kiln sums in f64 (tests/models.rs checks it against the exact transform)";

/// Node tests whose expected outputs ONNX 1.20 got wrong (or computed less precisely than the
/// runner's tolerance), each with the reason: they are reported unsupported with it, never run
/// against the wrong data (onnxruntime keeps
/// such a list too, `onnx_backend_test_series_filters.jsonc`).
const WRONG_EXPECTED: &[(&str, &str)] = &[
    ("test_qlinearmatmul_2D_int8_float16", QLINEAR_MATMUL_WRAPS),
    ("test_qlinearmatmul_2D_int8_float32", QLINEAR_MATMUL_WRAPS),
    ("test_qlinearmatmul_3D_int8_float16", QLINEAR_MATMUL_WRAPS),
    ("test_qlinearmatmul_3D_int8_float32", QLINEAR_MATMUL_WRAPS),
    ("test_dft_inverse", DFT_INVERSE_FLOAT32),
    ("test_dft_inverse_opset19", DFT_INVERSE_FLOAT32),
];

/// Runs one test folder.
pub fn run_test(rt: &Arc<Runtime>, dir: &Path, options: &SessionOptions) -> TestResult {
    let start = Instant::now();
    let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    if let Some((_, why)) = WRONG_EXPECTED.iter().find(|(t, _)| *t == name) {
        let op = model::load(&dir.join("model.onnx")).map(|m| test_op(&name, &m)).unwrap_or_default();
        return TestResult {
            name,
            op,
            outcome: Outcome::Unsupported(why.to_string()),
            time_ms: start.elapsed().as_secs_f64() * 1e3,
            no_dispatch: Vec::new(),
        };
    }
    let mut no_dispatch = Vec::new();
    let (op, result) = match model::load(&dir.join("model.onnx")) {
        Err(e) => ((if e.is_unsupported() { "(unsupported model)" } else { "(invalid model)" }).to_string(), Err(e)),
        Ok(m) => {
            let op = test_op(&name, &m);
            let result = Session::new(rt.clone(), m, options.clone()).and_then(|mut s| {
                let r = run_data_sets(&mut s, dir);
                no_dispatch = s.report.dispatch_unsupported.keys().cloned().collect();
                r
            });
            (op, result)
        }
    };
    let outcome = match result {
        Ok(None) => Outcome::Passed,
        Ok(Some(mismatch)) => Outcome::Failed(mismatch),
        Err(e) if e.is_unsupported() => Outcome::Unsupported(e.to_string()),
        Err(e) => Outcome::Failed(e.to_string()),
    };
    TestResult { name, op, outcome, time_ms: start.elapsed().as_secs_f64() * 1e3, no_dispatch }
}

/// Runs every data set; `Ok(Some(msg))` describes the first mismatch.
fn run_data_sets(s: &mut Session, dir: &Path) -> Result<Option<String>> {
    let mut sets: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|source| Error::Io { path: dir.to_path_buf(), source })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir() && p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("test_data_set_")))
        .collect();
    sets.sort();
    let g = &s.model().graph;
    let kinds = |ids: &[crate::model::ValueId]| ids.iter().map(|&v| g.kind(v)).collect::<Vec<_>>();
    let (input_kinds, output_kinds) = (kinds(&g.inputs), kinds(&g.outputs));
    let inputs = s.input_names();
    for set in sets {
        // Each file read as the model declares its value: a tensor, a sequence, an optional.
        let files = |prefix: &str, kinds: &[crate::model::Kind]| -> Result<Vec<HostValue>> {
            let mut k = 0;
            let mut out = Vec::new();
            while let Ok(true) = set.join(format!("{prefix}_{k}.pb")).try_exists() {
                let kind = kinds.get(k).cloned().unwrap_or_default();
                out.push(read_value_file(&set.join(format!("{prefix}_{k}.pb")), &kind)?);
                k += 1;
            }
            Ok(out)
        };
        let feeds: Vec<(String, HostValue)> = inputs.iter().cloned().zip(files("input", &input_kinds)?).collect();
        let expected = files("output", &output_kinds)?;
        let actual = s.run_values(feeds)?;
        if actual.len() != expected.len() {
            return Ok(Some(format!("{} outputs, {} expected", actual.len(), expected.len())));
        }
        for ((name, a), e) in actual.iter().zip(&expected) {
            if let Some(msg) = compare_values(a, e, RTOL, ATOL) {
                return Ok(Some(format!(
                    "{}: output {name:?}: {msg}",
                    set.file_name().unwrap_or_default().to_string_lossy()
                )));
            }
        }
    }
    Ok(None)
}

/// Compares `actual` with `expected`; `None` when equal within tolerance, else the first
/// difference (for floating-point tensors also how many elements differ and the largest
/// difference).
pub fn compare(actual: &Tensor, expected: &Tensor, rtol: f64, atol: f64) -> Option<String> {
    if actual.dtype != expected.dtype {
        return Some(format!("dtype {} != expected {}", actual.dtype, expected.dtype));
    }
    if actual.shape != expected.shape {
        return Some(format!("shape {:?} != expected {:?}", actual.shape, expected.shape));
    }
    if actual.dtype == DType::String {
        let (a, e) = (actual.strings().ok()?, expected.strings().ok()?);
        let diff = a.iter().zip(&e).position(|(x, y)| x != y)?;
        let show = |s: &[u8]| format!("{:?}", String::from_utf8_lossy(s));
        return Some(format!("element {diff}: {} != expected {}", show(a[diff]), show(e[diff])));
    }
    if actual.dtype.is_packed() && !actual.dtype.is_minifloat() {
        // 4-bit and 2-bit integers: element by element, exactly (padding bits aside).
        let field = |t: &Tensor, i| minifloat::packed_get(t.dtype, &t.data, i);
        let diff = (0..actual.numel()).position(|i| field(actual, i) != field(expected, i))?;
        return Some(format!("element {diff}: {} != expected {}", int_value(actual, diff), int_value(expected, diff)));
    }
    if !actual.dtype.is_float() && !actual.dtype.is_minifloat() {
        // Integers and bools: exactly, bit for bit.
        let size = actual.dtype.size().unwrap_or(1);
        let diff = actual.data.chunks_exact(size).zip(expected.data.chunks_exact(size)).position(|(x, y)| x != y)?;
        return Some(format!("element {diff}: {} != expected {}", int_value(actual, diff), int_value(expected, diff)));
    }
    let (a, e) = (to_f64(actual), to_f64(expected));
    let close = |x: f64, y: f64| {
        if x.is_nan() || y.is_nan() {
            x.is_nan() && y.is_nan()
        } else if x.is_infinite() || y.is_infinite() {
            x == y
        } else {
            (x - y).abs() <= atol + rtol * y.abs()
        }
    };
    let differ: Vec<usize> = (0..a.len()).filter(|&i| !close(a[i], e[i])).collect();
    let &first = differ.first()?;
    let mut msg = format!("element {first}: {} != expected {} (rtol {rtol}, atol {atol})", a[first], e[first]);
    if differ.len() > 1 {
        msg += &format!("; {} of {} elements differ", differ.len(), a.len());
        // The largest finite difference, the first of equals (a NaN or infinity against a number
        // differs, but has no size).
        let largest = differ
            .iter()
            .map(|&i| (i, (a[i] - e[i]).abs()))
            .filter(|(_, d)| d.is_finite())
            .rev()
            .max_by(|x, y| x.1.total_cmp(&y.1));
        if let Some((i, d)) = largest.filter(|&(i, _)| i != first) {
            msg += &format!(", the most at element {i}: {} != expected {} (|Δ| {d:.3e})", a[i], e[i]);
        }
    }
    Some(msg)
}

/// Element `i` of an integer or bool tensor (4-bit and 2-bit ones included), exactly.
pub fn int_value(t: &Tensor, i: usize) -> i128 {
    if t.dtype.is_narrow_int() {
        return minifloat::narrow_int_value(t.dtype, minifloat::packed_get(t.dtype, &t.data, i)) as i128;
    }
    let size = t.dtype.size().unwrap_or(1);
    let b = &t.data[i * size..(i + 1) * size];
    let mut le = [0u8; 16];
    le[..size].copy_from_slice(b);
    let signed = matches!(t.dtype, DType::I8 | DType::I16 | DType::I32 | DType::I64);
    if signed && b[size - 1] & 0x80 != 0 {
        le[size..].iter_mut().for_each(|x| *x = 0xff);
    }
    i128::from_le_bytes(le)
}

/// Elements as f64 (exact for floats and for integers up to 2^53).
pub fn to_f64(t: &Tensor) -> Vec<f64> {
    to_f64_prefix(t, t.numel())
}

/// The first `n` elements (at most all) as f64.
pub fn to_f64_prefix(t: &Tensor, n: usize) -> Vec<f64> {
    let d = &t.data;
    let n = n.min(t.numel());
    let get = |i: usize, s: usize| &d[i * s..(i + 1) * s];
    (0..n)
        .map(|i| match t.dtype {
            DType::F32 => f32::from_le_bytes(get(i, 4).try_into().unwrap_or_default()) as f64,
            DType::F64 => f64::from_le_bytes(get(i, 8).try_into().unwrap_or_default()),
            DType::F16 => half::f16::from_le_bytes(get(i, 2).try_into().unwrap_or_default()).to_f64(),
            DType::BF16 => half::bf16::from_le_bytes(get(i, 2).try_into().unwrap_or_default()).to_f64(),
            DType::I8 => d[i] as i8 as f64,
            DType::U8 | DType::Bool => d[i] as f64,
            DType::I16 => i16::from_le_bytes(get(i, 2).try_into().unwrap_or_default()) as f64,
            DType::U16 => u16::from_le_bytes(get(i, 2).try_into().unwrap_or_default()) as f64,
            DType::I32 => i32::from_le_bytes(get(i, 4).try_into().unwrap_or_default()) as f64,
            DType::U32 => u32::from_le_bytes(get(i, 4).try_into().unwrap_or_default()) as f64,
            DType::I64 => i64::from_le_bytes(get(i, 8).try_into().unwrap_or_default()) as f64,
            DType::U64 => u64::from_le_bytes(get(i, 8).try_into().unwrap_or_default()) as f64,
            d if d.is_minifloat() => minifloat::to_f32(d, minifloat::packed_get(d, &t.data, i)) as f64,
            d if d.is_narrow_int() => minifloat::narrow_int_value(d, minifloat::packed_get(d, &t.data, i)) as f64,
            _ => f64::NAN, // strings
        })
        .collect()
}

/// The op a test is about: its single node's op, or the longest op type of the graph that
/// the test's name starts with (`test_layer_normalization_…_expanded` → LayerNormalization).
fn test_op(name: &str, m: &model::Model) -> String {
    let nodes = &m.graph.nodes;
    if nodes.len() == 1 {
        return nodes[0].op_type.clone();
    }
    let flat = name.trim_start_matches("test_").replace('_', "").to_lowercase();
    nodes
        .iter()
        .map(|n| &n.op_type)
        .filter(|op| flat.starts_with(&op.to_lowercase()))
        .max_by_key(|op| op.len())
        .cloned()
        .unwrap_or_else(|| "(graph)".into())
}

/// Per-op counts and the closing line.
pub fn summary(results: &[TestResult]) -> String {
    use std::collections::BTreeMap;
    let mut by_op: BTreeMap<&str, [usize; 3]> = BTreeMap::new();
    for r in results {
        let c = by_op.entry(&r.op).or_default();
        match r.outcome {
            Outcome::Passed => c[0] += 1,
            Outcome::Failed(_) => c[1] += 1,
            Outcome::Unsupported(_) => c[2] += 1,
        }
    }
    // The op column is as wide as the longest op (SkipSimplifiedLayerNormalization is 32).
    let w = by_op.keys().map(|op| op.len()).max().unwrap_or(0).max(28);
    let mut s = format!("{:<w$} {:>7} {:>7} {:>12}\n", "op", "passed", "failed", "unsupported");
    for (op, [p, f, u]) in &by_op {
        s += &format!("{op:<w$} {p:>7} {f:>7} {u:>12}\n");
    }
    let failed: Vec<_> = results.iter().filter(|r| matches!(r.outcome, Outcome::Failed(_))).collect();
    if !failed.is_empty() {
        s += "\nfailed:\n";
        for r in &failed {
            if let Outcome::Failed(m) = &r.outcome {
                s += &format!("  {}: {}\n", r.name, first_line(m));
            }
        }
    }
    let unsupported: Vec<_> = results.iter().filter(|r| matches!(r.outcome, Outcome::Unsupported(_))).collect();
    if !unsupported.is_empty() {
        s += "\nunsupported:\n";
        for r in &unsupported {
            if let Outcome::Unsupported(m) = &r.outcome {
                s += &format!("  {}: {}\n", r.name, first_line(m));
            }
        }
    }
    let mut no_dispatch: BTreeMap<&str, usize> = BTreeMap::new();
    for r in results.iter().filter(|r| r.outcome == Outcome::Passed) {
        for op in &r.no_dispatch {
            *no_dispatch.entry(op).or_default() += 1;
        }
    }
    if !no_dispatch.is_empty() {
        s += "\nno GPU dispatch (tests that passed on the CPU):\n";
        for (op, n) in &no_dispatch {
            s += &format!("  {op:<28} {n:>5}\n");
        }
    }
    let count = |f: fn(&Outcome) -> bool| results.iter().filter(|r| f(&r.outcome)).count();
    s += &format!(
        "\nconformance: {} passed, {} failed, {} unsupported\n",
        count(|o| matches!(o, Outcome::Passed)),
        count(|o| matches!(o, Outcome::Failed(_))),
        count(|o| matches!(o, Outcome::Unsupported(_)))
    );
    s
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or("")
}

#[cfg(test)]
mod tests {
    use super::{compare, matches_filter};
    use crate::tensor::Tensor;
    use kiln_kernel_abi::DType;

    fn f32s(v: &[f32]) -> Tensor {
        Tensor::new(DType::F32, vec![v.len()], v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>().into())
            .unwrap()
    }

    #[test]
    fn a_float_mismatch_names_the_first_difference_the_count_and_the_largest() {
        let want = f32s(&[1.0, 2.0, 3.0, 4.0, 5.0]);
        assert_eq!(compare(&want, &want, 1e-3, 1e-7), None);
        let one = f32s(&[1.0, 2.5, 3.0, 4.0, 5.0]);
        assert_eq!(compare(&one, &want, 1e-3, 0.0).unwrap(), "element 1: 2.5 != expected 2 (rtol 0.001, atol 0)");
        let three = f32s(&[1.0, 2.5, f32::NAN, 4.0, 1.0]);
        assert_eq!(
            compare(&three, &want, 1e-3, 0.0).unwrap(),
            "element 1: 2.5 != expected 2 (rtol 0.001, atol 0); 3 of 5 elements differ, the most at element 4: 1 != \
             expected 5 (|Δ| 4.000e0)"
        );
    }

    #[test]
    fn a_filter_matches_any_of_its_comma_separated_parts() {
        assert!(matches_filter("test_lstm_defaults", "test_lstm"));
        assert!(matches_filter("test_gru_seq_length", "test_lstm, test_gru"));
        assert!(!matches_filter("test_rnn_seq_length", "test_lstm,test_gru"));
        assert!(matches_filter("test_abs", ""));
        assert!(matches_filter("test_abs", " , "));
    }
}

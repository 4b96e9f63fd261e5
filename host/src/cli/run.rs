//! `kiln run`.

use super::output::note;
use super::output::say;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use crate::ep::{DeviceTensor, Feed, Fetch, Fetched, Runtime, Session};
use crate::host_value::compare_values;
use crate::tensorio::{read_tensor_file, read_value_file, write_npy};
use crate::{conformance, model, Error, HostValue, Result, Tensor};

use super::{choose_device, model_registry, GraphArgs, ModelRunArgs};

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The ONNX model.
    pub model: PathBuf,
    /// An input: NAME=FILE (.npy or .pb). Repeat for each graph input.
    #[arg(long = "input", value_name = "NAME=FILE", value_parser = name_file)]
    pub inputs: Vec<(String, PathBuf)>,
    /// Check an output against a reference: NAME=FILE, at ONNX's tolerances (rtol 1e-3,
    /// atol 1e-7). Exits with status 5 on a mismatch.
    #[arg(long = "expect", value_name = "NAME=FILE", value_parser = name_file)]
    pub expect: Vec<(String, PathBuf)>,
    /// Where outputs are written as NAME.npy (NumPy lacks some dtypes: bfloat16, float8 and
    /// float4 as float32, int4 and int2 as int8, uint4 and uint2 as uint8; strings as `<U`).
    #[arg(long, value_name = "DIR", default_value = "kiln-out")]
    pub output_dir: PathBuf,
    /// Print nodes, packages, Wasm calls and time per op.
    #[arg(long)]
    pub report: bool,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub report_json: Option<PathBuf>,
    /// Run the model this many times on the same inputs (the outputs are the last run's). On a
    /// GPU the inputs then stay on the device and the outputs are written in place, so from the
    /// third run on each run is one CUDA graph replay (see `--graph`).
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub runs: u32,
    #[command(flatten)]
    pub graph: GraphArgs,
    #[command(flatten)]
    pub target: ModelRunArgs,
}

/// `NAME=FILE` of `--input` and `--expect`, both parts nonempty; anything else is a usage error
/// (exit 2).
fn name_file(arg: &str) -> std::result::Result<(String, PathBuf), String> {
    match arg.split_once('=') {
        Some((n, f)) if !n.is_empty() && !f.is_empty() => Ok((n.to_string(), PathBuf::from(f))),
        _ => Err("expected NAME=FILE".into()),
    }
}

pub fn run(a: RunArgs) -> Result<ExitCode> {
    super::output::check_path("--report-json", &a.report_json)?;
    let human = super::output::Human::new(&[&a.report_json]);
    let device = choose_device(a.target.resolve.device)?;
    let graphs = a.graph.mode(device)?;
    if a.runs == 0 {
        return Err(Error::Input("--runs must be at least 1".into()));
    }
    let mut inputs: Vec<(String, PathBuf)> = Vec::new();
    for (name, file) in a.inputs {
        if inputs.iter().any(|(n, _)| *n == name) {
            return Err(Error::Input(format!("--input {name} is given twice")));
        }
        inputs.push((name, file));
    }
    let expect_files = a.expect;
    let file = super::inspect::onnx_file(&a.model, "run")?;
    std::fs::create_dir_all(&a.output_dir)
        .map_err(|e| Error::Input(format!("--output-dir {}: {e}", a.output_dir.display())))?;
    let t0 = Instant::now();
    let model = model::load(file)?;
    // A .pb file holds what the model declares there: a tensor, or a sequence or optional.
    let kind_of = |name: &str, among: &[model::ValueId]| {
        among.iter().find(|&&v| model.graph.values[v].name == name).map(|&v| model.graph.kind(v))
    };
    let read = |file: &std::path::Path, kind: Option<model::Kind>| -> Result<HostValue> {
        match (kind, file.extension().and_then(|e| e.to_str())) {
            (Some(k), Some("pb")) if k != model::Kind::Tensor => read_value_file(file, &k),
            _ => Ok(HostValue::Tensor(read_tensor_file(file)?.0)),
        }
    };
    let mut feeds: Vec<(String, HostValue)> = Vec::with_capacity(inputs.len());
    // A file that cannot be read is named with the flag and input that gave it.
    let flagged = |flag: &str, name: &str, e: Error| Error::Input(format!("{flag} {name}: {e}"));
    for (name, file) in &inputs {
        let value = read(file, kind_of(name, &model.graph.inputs)).map_err(|e| flagged("--input", name, e))?;
        feeds.push((name.clone(), value));
    }
    let mut expect = Vec::with_capacity(expect_files.len());
    for (name, file) in &expect_files {
        let Some(kind) = kind_of(name, &model.graph.outputs) else {
            return Err(Error::Input(format!("--expect {name}: the model has no output {name:?}")));
        };
        expect.push((name.clone(), read(file, Some(kind)).map_err(|e| flagged("--expect", name, e))?));
    }
    let non_tensors = feeds.iter().any(|(_, v)| !matches!(v, HostValue::Tensor(_)))
        || model.graph.outputs.iter().any(|&o| model.graph.kind(o) != model::Kind::Tensor);
    let rt = Runtime::new(model_registry(&a.target.resolve.packages, &a.model)?, super::sandbox_config())?;
    let options = a.target.session_options(device, graphs)?;
    let loading = super::progress::Progress::spinner("loading the model");
    let mut session = Session::new(rt, model, options)?;
    drop(loading);
    let prepared = t0.elapsed();
    let (outputs, last_ms) = if a.runs > 1 && device != crate::ep::Device::Cpu && !non_tensors {
        let tensors = feeds.into_iter().map(|(n, v)| Ok((n.clone(), v.into_tensor(&format!("input {n:?}"))?)));
        let (out, last) = run_held(&mut session, tensors.collect::<Result<_>>()?, a.runs)?;
        (out.into_iter().map(|(n, t)| (n, HostValue::Tensor(t))).collect(), last)
    } else {
        let mut out = Vec::new();
        let mut last = 0.0;
        for _ in 0..a.runs {
            let t = Instant::now();
            out = session.run_values(feeds.clone())?;
            last = t.elapsed().as_secs_f64() * 1e3;
        }
        (out, last)
    };
    let g = &session.report.graphs;
    let graph_note = if device == crate::ep::Device::Cpu {
        String::new()
    } else {
        format!("; CUDA graphs {}: {}", format!("{graphs:?}").to_lowercase(), g.counts())
    };
    let runs = if a.runs == 1 {
        format!("ran in {:.1} ms", session.report.run_time_us as f64 / 1e3)
    } else {
        format!("{} runs in {:.1} ms, the last {last_ms:.3} ms", a.runs, session.report.run_time_us as f64 / 1e3)
    };
    note!(
        "kiln: {} on {device}: loaded in {:.1} ms, {runs}{graph_note}",
        a.model.display(),
        prepared.as_secs_f64() * 1e3
    );
    for (name, v) in &outputs {
        // A sequence's tensors go to NAME_0.npy, NAME_1.npy, …; an empty optional writes nothing.
        let (tensors, what): (Vec<(String, &Tensor)>, String) = match v {
            HostValue::Tensor(t) => (vec![(sanitize(name), t)], String::new()),
            HostValue::Sequence(ts) => (
                ts.iter().enumerate().map(|(i, t)| (format!("{}_{i}", sanitize(name)), t)).collect(),
                format!("a sequence of {} tensors", ts.len()),
            ),
            HostValue::Optional(None) => (Vec::new(), "an empty optional (nothing written)".into()),
            HostValue::Optional(Some(inner)) => match inner.as_ref() {
                HostValue::Tensor(t) => (vec![(sanitize(name), t)], "an optional holding".into()),
                HostValue::Sequence(ts) => (
                    ts.iter().enumerate().map(|(i, t)| (format!("{}_{i}", sanitize(name)), t)).collect(),
                    format!("an optional holding a sequence of {} tensors", ts.len()),
                ),
                HostValue::Optional(_) => (Vec::new(), "an optional of an optional (not written)".into()),
            },
        };
        if !what.is_empty() {
            say!(human, "{name}: {what}");
        }
        for (stem, t) in tensors {
            let file = a.output_dir.join(format!("{stem}.npy"));
            write_npy(&file, t)?;
            say!(human, "{name}: {} {:?} -> {}", t.dtype, t.shape, file.display());
            say!(human, "  {}", preview(t));
        }
    }
    let mut mismatches = 0;
    for (name, e) in &expect {
        let Some((_, t)) = outputs.iter().find(|(n, _)| n == name) else {
            return Err(Error::Input(format!("--expect {name}: the model has no output {name:?}")));
        };
        match compare_values(t, e, conformance::RTOL, conformance::ATOL) {
            None => say!(human, "{name}: matches the expected output"),
            Some(m) => {
                mismatches += 1;
                say!(human, "{name}: MISMATCH: {m}");
            }
        }
    }
    if a.report {
        human.print(&session.report.render());
    }
    if let Some(p) = &a.report_json {
        super::output::write_json(p, &session.report)?;
    }
    Ok(super::exit::checks(mismatches > 0))
}

/// `runs` runs on a GPU with the inputs held on the device and the outputs written in place
/// after the first run, so that later runs go through an execution plan (a graph replay from
/// the third on, unless `--graph off`). Returns the last run's outputs and its wall time, ms.
fn run_held(session: &mut Session, feeds: Vec<(String, Tensor)>, runs: u32) -> Result<(Vec<(String, Tensor)>, f64)> {
    let mut held = HeldRuns::new(session, feeds)?;
    let mut last = 0.0;
    for _ in 0..runs {
        let t = Instant::now();
        held.run(session)?;
        last = t.elapsed().as_secs_f64() * 1e3;
    }
    Ok((held.outputs(session)?, last))
}

/// Runs of a session on inputs held on the device, each writing its outputs into the first run's
/// device tensors and waiting for the device: from the third run on, one CUDA graph replay where
/// the session's graph mode allows (`kiln run --runs`, `kiln bench run` on a GPU).
pub(super) struct HeldRuns {
    inputs: Vec<(String, DeviceTensor)>,
    outputs: Vec<(String, DeviceTensor)>,
    names: Vec<String>,
}

impl HeldRuns {
    /// Uploads `feeds` into device tensors of the session. Errors: device memory, a transfer.
    pub fn new(session: &mut Session, feeds: Vec<(String, Tensor)>) -> Result<HeldRuns> {
        let mut inputs = Vec::with_capacity(feeds.len());
        for (name, t) in feeds {
            let d = session.zeros(t.dtype, t.shape.clone())?;
            session.write_tensor(&d, &t)?;
            inputs.push((name, d));
        }
        let names = session.output_ids().iter().map(|&o| session.model().graph.values[o].name.clone()).collect();
        Ok(HeldRuns { inputs, outputs: Vec::new(), names })
    }

    /// One run, waited for. Errors: the run's.
    pub fn run(&mut self, session: &mut Session) -> Result<()> {
        let fed: Vec<(String, Feed<'_>)> = self.inputs.iter().map(|(n, d)| (n.clone(), Feed::Device(d))).collect();
        if self.outputs.is_empty() {
            let first: Vec<(&str, Fetch<'_>)> = self.names.iter().map(|n| (n.as_str(), Fetch::Device)).collect();
            for (name, f) in session.run_with(fed, &first)? {
                if let Fetched::Device(d) = f {
                    self.outputs.push((name, d));
                }
            }
        } else {
            let into: Vec<(&str, Fetch<'_>)> = self.outputs.iter().map(|(n, d)| (n.as_str(), Fetch::Into(d))).collect();
            session.run_with(fed, &into)?;
        }
        session.synchronize()
    }

    /// The last run's outputs, on the host.
    pub fn outputs(self, session: &mut Session) -> Result<Vec<(String, Tensor)>> {
        self.outputs.iter().map(|(n, d)| Ok((n.clone(), session.read_tensor(d)?))).collect()
    }
}

/// A file name for an output name (ONNX names may hold '/' or ':').
fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' { c } else { '_' }).collect()
}

/// The first few elements.
fn preview(t: &Tensor) -> String {
    let n = t.numel().min(8);
    let shown: Vec<String> = if let Ok(s) = t.strings() {
        // Each string up to 40 characters, as the elements are up to 8.
        let short = |s: &[u8]| {
            let text = String::from_utf8_lossy(s);
            match text.char_indices().nth(40) {
                Some((cut, _)) => format!("{:?}…", &text[..cut]),
                None => format!("{text:?}"),
            }
        };
        s.iter().take(n).map(|s| short(s)).collect()
    } else if t.dtype == kiln_kernel_abi::DType::Bool {
        t.data.iter().take(n).map(|b| (*b != 0).to_string()).collect()
    } else if t.dtype.is_float() || t.dtype.is_minifloat() {
        conformance::to_f64_prefix(t, n).iter().map(|x| format!("{x:.6}")).collect()
    } else {
        (0..n).map(|i| conformance::int_value(t, i).to_string()).collect()
    };
    format!("[{}{}]", shown.join(", "), if t.numel() > 8 { ", …" } else { "" })
}

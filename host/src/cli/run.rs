//! `kiln run`.

use super::output::note;
use super::output::say;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use crate::ep::{Runtime, Session, SessionOptions};
use crate::tensorio::{read_tensor_file, write_npy};
use crate::{conformance, model, Error, Result, Tensor};

use super::{choose_device, model_registry, ModelRunArgs};

#[derive(clap::Args, Debug)]
pub struct RunArgs {
    /// The ONNX model.
    pub model: PathBuf,
    /// An input: NAME=FILE (.npy or .pb). Repeat for each graph input.
    #[arg(long = "input", value_name = "NAME=FILE")]
    pub inputs: Vec<String>,
    /// Check an output against a reference: NAME=FILE, at ONNX's tolerances (rtol 1e-3,
    /// atol 1e-7). Exits with status 5 on a mismatch.
    #[arg(long = "expect", value_name = "NAME=FILE")]
    pub expect: Vec<String>,
    /// Where outputs are written as NAME.npy (bfloat16 outputs as float32, which NumPy lacks).
    #[arg(long, value_name = "DIR", default_value = "kiln-out")]
    pub output_dir: PathBuf,
    /// Most device memory kiln may allocate, in MiB.
    #[arg(long, value_name = "MIB")]
    pub device_memory_limit: Option<u64>,
    /// Print nodes, packages, Wasm calls and time per op.
    #[arg(long)]
    pub report: bool,
    /// Write the report as JSON.
    #[arg(long, value_name = "FILE")]
    pub report_json: Option<PathBuf>,
    #[command(flatten)]
    pub target: ModelRunArgs,
}

fn name_file(arg: &str, flag: &str) -> Result<(String, PathBuf)> {
    match arg.split_once('=') {
        Some((n, f)) if !n.is_empty() && !f.is_empty() => Ok((n.to_string(), PathBuf::from(f))),
        _ => Err(Error::Input(format!("{flag} {arg:?}: expected NAME=FILE"))),
    }
}

pub fn run(a: RunArgs) -> Result<ExitCode> {
    super::output::check_path("--report-json", &a.report_json)?;
    let human = super::output::Human::new(&[&a.report_json]);
    let device = choose_device(a.target.device)?;
    let mut feeds: Vec<(String, Tensor)> = Vec::new();
    for arg in &a.inputs {
        let (name, file) = name_file(arg, "--input")?;
        if feeds.iter().any(|(n, _)| *n == name) {
            return Err(Error::Input(format!("--input {name} is given twice")));
        }
        feeds.push((name, read_tensor_file(&file)?.0));
    }
    let mut expect = Vec::new();
    for arg in &a.expect {
        let (name, file) = name_file(arg, "--expect")?;
        expect.push((name, read_tensor_file(&file)?.0));
    }
    std::fs::create_dir_all(&a.output_dir).map_err(|source| Error::Io { path: a.output_dir.clone(), source })?;
    let t0 = Instant::now();
    let model = model::load(&a.model)?;
    for (name, _) in &expect {
        if !model.graph.outputs.iter().any(|&o| &model.graph.values[o].name == name) {
            return Err(Error::Input(format!("--expect {name}: the model has no output {name:?}")));
        }
    }
    let rt = Runtime::new(model_registry(&a.target.packages, &a.model)?, super::sandbox_config())?;
    let options = SessionOptions {
        device,
        device_memory_limit: a.device_memory_limit.map(|m| m << 20),
        fuse: !a.target.fuse.no_fuse,
        pdl: a.target.pdl,
        ..SessionOptions::default()
    };
    let mut session = Session::new(rt, model, options)?;
    let prepared = t0.elapsed();
    let outputs = session.run(feeds)?;
    note!(
        "kiln: {} on {device}: loaded in {:.1} ms, ran in {:.1} ms",
        a.model.display(),
        prepared.as_secs_f64() * 1e3,
        session.report.run_time_us as f64 / 1e3
    );
    for (name, t) in &outputs {
        let file = a.output_dir.join(format!("{}.npy", sanitize(name)));
        write_npy(&file, t)?;
        say!(human, "{name}: {} {:?} -> {}", t.dtype, t.shape, file.display());
        say!(human, "  {}", preview(t));
    }
    let mut mismatches = 0;
    for (name, e) in &expect {
        let Some((_, t)) = outputs.iter().find(|(n, _)| n == name) else {
            return Err(Error::Input(format!("--expect {name}: the model has no output {name:?}")));
        };
        match conformance::compare(t, e, conformance::RTOL, conformance::ATOL) {
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

/// A file name for an output name (ONNX names may hold '/' or ':').
fn sanitize(name: &str) -> String {
    name.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.' { c } else { '_' }).collect()
}

/// The first few elements.
fn preview(t: &Tensor) -> String {
    let n = t.numel().min(8);
    let shown: Vec<String> = if t.dtype.is_float() {
        conformance::to_f64_prefix(t, n).iter().map(|x| format!("{x:.6}")).collect()
    } else {
        (0..n).map(|i| conformance::int_value(t, i).to_string()).collect()
    };
    format!("[{}{}]", shown.join(", "), if t.numel() > 8 { ", …" } else { "" })
}

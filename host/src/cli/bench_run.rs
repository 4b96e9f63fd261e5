//! `kiln bench run MODEL`: latency of whole-model runs in the manner of onnxruntime's
//! `onnxruntime_perf_test`: random inputs of the declared shapes (`--shape NAME=DIMS` for
//! named or unknown dimensions; integers 0 or 1, valid as indices and masks), warm-up runs,
//! then timed runs reported as p50 / p90 / p99 / mean / min latency and runs per second. On the
//! CPU, or on a GPU with `--graph off`, each run is `Session::run` with host inputs and outputs
//! (copies included); on a GPU otherwise the inputs stay on the device and each run writes its
//! outputs in place and waits for the device (as PyTorch is timed), so from the third run on a
//! run is one CUDA graph replay where the model allows (the report's capture and fallback counts
//! say).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::SeedableRng;
use serde::Serialize;

use crate::ep::Session;
use crate::model::{self, Dim};
use crate::{Error, Result, Tensor};

use super::verify::random_tensor;
use super::{choose_device, model_registry, ModelRunArgs};
use kiln_kernel_abi::manifest::ValueDomain;

/// Arguments of `kiln bench run`.
#[derive(clap::Args, Debug)]
pub struct BenchRunArgs {
    /// The ONNX model.
    pub model: PathBuf,
    /// The shape of an input whose declared shape has named or unknown dimensions, e.g.
    /// `--shape input_ids=1x128` (repeatable; `x` or `,` between dimensions).
    #[arg(long = "shape", value_name = "NAME=DIMS")]
    pub shapes: Vec<String>,
    /// Untimed runs first.
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// Timed runs.
    #[arg(long, default_value_t = 20)]
    pub runs: usize,
    /// Seed of the random inputs (floats uniform in [-2, 2]; integers 0 or 1, which every index
    /// input (token ids, token types, positions), mask and count takes; bools).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Also write the numbers as JSON (`-` for stdout).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub graph: super::GraphArgs,
    #[command(flatten)]
    pub target: ModelRunArgs,
}

/// What `kiln bench run` measured. Times in milliseconds.
#[derive(Debug, Serialize)]
pub struct RunStats {
    pub model: String,
    pub device: String,
    pub inputs: BTreeMap<String, Vec<usize>>,
    pub warmup: usize,
    pub runs: usize,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub mean_ms: f64,
    pub min_ms: f64,
    pub runs_per_s: f64,
    /// Session creation (load, fusion, preparation, weight upload).
    pub setup_ms: f64,
    /// How runs went: host inputs and outputs, or held on the device with CUDA graphs on, auto
    /// or off, and the captures, replays and fallbacks of the session.
    pub graphs: String,
}

/// `--shape NAME=DIMS` → (name, dims). Errors name the flag's value.
fn parse_shape(s: &str) -> Result<(String, Vec<usize>)> {
    let bad = || Error::Input(format!("--shape {s:?}: expected NAME=DIMS such as input_ids=1x128"));
    let (name, dims) = s.split_once('=').ok_or_else(bad)?;
    if name.is_empty() {
        return Err(bad());
    }
    let dims: Option<Vec<usize>> =
        dims.split(['x', ',']).map(|d| d.trim().parse::<usize>().ok()).collect::<Option<Vec<usize>>>();
    Ok((name.to_string(), dims.ok_or_else(bad)?))
}

/// The `p`-th percentile (0..=100) of sorted `xs`, nearest rank.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `kiln bench run`.
pub fn run(a: BenchRunArgs) -> Result<ExitCode> {
    super::output::check_path("--json", &a.json)?;
    if a.runs == 0 {
        return Err(Error::Input("--runs must be at least 1".into()));
    }
    let mut given: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for s in &a.shapes {
        let (name, dims) = parse_shape(s)?;
        given.insert(name, dims);
    }
    let m = model::load(super::inspect::onnx_file(&a.model, "bench run")?)?;
    let g = &m.graph;
    let names: Vec<String> = g.inputs.iter().map(|&i| g.values[i].name.clone()).collect();
    if let Some(n) = given.keys().find(|n| !names.contains(n)) {
        return Err(Error::Input(format!(
            "--shape {n}: the model has no input {n:?}; its inputs: {}",
            names.join(", ")
        )));
    }
    // Each input's dtype and shape: declared, or from --shape.
    let mut specs = Vec::new();
    for &i in &g.inputs {
        let v = &g.values[i];
        let ty = v.ty.as_ref().ok_or_else(|| Error::Input(format!("input {:?} has no declared type", v.name)))?;
        let shape = match (given.get(&v.name), ty.dims.as_ref()) {
            (Some(s), Some(d)) if s.len() != d.len() => {
                return Err(Error::Input(format!(
                    "--shape {}: {} dimensions, but the input is declared {}",
                    v.name,
                    s.len(),
                    model::format_dims(d)
                )))
            }
            (Some(s), _) => s.clone(),
            (None, Some(d)) => d
                .iter()
                .map(|d| if let Dim::Known(n) = d { Some(*n) } else { None })
                .collect::<Option<Vec<usize>>>()
                .ok_or_else(|| {
                    Error::Input(format!(
                        "input {:?} is declared {}: give its shape with --shape {}=DIMS",
                        v.name,
                        model::format_dims(d),
                        v.name
                    ))
                })?,
            (None, None) => {
                return Err(Error::Input(format!(
                    "input {:?} has no declared shape: give it with --shape {}=DIMS",
                    v.name, v.name
                )))
            }
        };
        specs.push((v.name.clone(), ty.dtype, shape));
    }
    let device = choose_device(a.target.resolve.device)?;
    let human = super::output::Human::new(&[&a.json]);
    let t0 = Instant::now();
    let rt = crate::ep::Runtime::new(model_registry(&a.target.resolve.packages, &a.model)?, super::sandbox_config())?;
    let graph_mode = a.graph.mode(device)?;
    let options = a.target.session_options(device, graph_mode)?;
    let loading = super::progress::Progress::spinner("loading the model");
    let mut session = Session::new(rt, m, options)?;
    drop(loading);
    let setup_ms = t0.elapsed().as_secs_f64() * 1e3;
    let mut rng = StdRng::seed_from_u64(a.seed);
    let mut feeds: Vec<(String, Tensor)> = Vec::new();
    for (name, dtype, shape) in &specs {
        // Integer inputs are mostly indices (token ids and types, positions), masks and counts:
        // 0 and 1 are valid for all of them, where [-5, 5] made an embedding Gather of a 2-row
        // token-type table fail.
        let domain = if dtype.is_float() { ValueDomain::Any } else { ValueDomain::Probability };
        feeds.push((name.clone(), random_tensor(&mut rng, *dtype, shape, domain)?));
    }
    let held = device != crate::ep::Device::Cpu && graph_mode != crate::capture::GraphMode::Off;
    let mut times = Vec::with_capacity(a.runs);
    if held {
        let mut runs = super::run::HeldRuns::new(&mut session, feeds)?;
        for i in 0..a.warmup + a.runs {
            let t = Instant::now();
            runs.run(&mut session)?;
            if i >= a.warmup {
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
        }
    } else {
        for _ in 0..a.warmup {
            session.run(feeds.clone())?;
        }
        for _ in 0..a.runs {
            let t = Instant::now();
            session.run(feeds.clone())?;
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    let g = &session.report.graphs;
    let graphs = if held {
        format!("{} (inputs and outputs held on the device): {}", format!("{graph_mode:?}").to_lowercase(), g.counts())
    } else {
        "off (host inputs and outputs, copies included)".to_string()
    };
    let mean = times.iter().sum::<f64>() / times.len() as f64;
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let stats = RunStats {
        model: a.model.display().to_string(),
        device: device.to_string(),
        inputs: specs.iter().map(|(n, _, s)| (n.clone(), s.clone())).collect(),
        warmup: a.warmup,
        runs: a.runs,
        p50_ms: percentile(&sorted, 50.0),
        p90_ms: percentile(&sorted, 90.0),
        p99_ms: percentile(&sorted, 99.0),
        mean_ms: mean,
        min_ms: sorted[0],
        runs_per_s: 1e3 / mean,
        setup_ms,
        graphs,
    };
    let shapes: Vec<String> = specs
        .iter()
        .map(|(n, d, s)| format!("{n} {d} {}", s.iter().map(usize::to_string).collect::<Vec<_>>().join("×")))
        .collect();
    human.line(&format!(
        "model: {} on {device}; inputs {}; setup {setup_ms:.1} ms; {} warm-up + {} timed runs; graphs {}",
        stats.model,
        shapes.join(", "),
        a.warmup,
        a.runs,
        stats.graphs
    ));
    human.line(&format!(
        "latency ms: p50 {:.3}  p90 {:.3}  p99 {:.3}  mean {:.3}  min {:.3}   throughput {:.1} runs/s",
        stats.p50_ms, stats.p90_ms, stats.p99_ms, stats.mean_ms, stats.min_ms, stats.runs_per_s
    ));
    if let Some(p) = &a.json {
        super::output::write_json(p, &stats)?;
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let xs: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&xs, 50.0), 5.0);
        assert_eq!(percentile(&xs, 90.0), 9.0);
        assert_eq!(percentile(&xs, 99.0), 10.0);
        assert_eq!(percentile(&xs, 0.0), 1.0);
        assert_eq!(percentile(&[3.0], 99.0), 3.0);
    }

    #[test]
    fn shapes_parse_and_bad_ones_name_the_flag() {
        assert_eq!(parse_shape("ids=1x128").unwrap(), ("ids".to_string(), vec![1, 128]));
        assert_eq!(parse_shape("x=2,3,4").unwrap(), ("x".to_string(), vec![2, 3, 4]));
        for bad in ["ids", "=1x2", "ids=1xb", "ids="] {
            assert!(parse_shape(bad).unwrap_err().to_string().contains("--shape"), "{bad}");
        }
    }
}

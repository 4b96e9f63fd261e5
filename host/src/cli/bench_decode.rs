//! `kiln bench decode MODEL_DIR`: LLM decode speed, measured as the PyTorch peer
//! (`fixtures/device/bench_torch_decode.py`) measures it: random prompt ids (seeded), greedy
//! (or sampled with `--temperature`, to time the device sampler), exactly `--new-tokens` tokens per row (EOS ignored). The first token comes from the
//! prefill; decode time is the `new_tokens − 1` decode steps that follow. Each configuration
//! is warmed up once, then timed `--runs` times; medians are reported.
//!
//! It times `Generator::generate`, the path `kiln generate` takes (device sampling, batch
//! buckets and CUDA graphs included), not a loop of its own.
//!
//! The floor printed beside the numbers is the time to read every weight once per step at
//! `--bandwidth-gbps` (the weights of a decode step are streamed from HBM at least once).

use super::output::say;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::ep::Runtime;
use crate::genai::{GenerateOptions, Generator, ModelFolder, SamplingParams};
use crate::{Error, Result};

use super::{choose_device, model_registry, GraphArgs, ModelRunArgs};

#[derive(clap::Args, Debug)]
pub struct DecodeArgs {
    /// An onnxruntime-genai model folder.
    pub model_dir: PathBuf,
    /// Rows per batch; repeat to measure several batch sizes.
    #[arg(long = "batch", default_values_t = [1usize])]
    pub batches: Vec<usize>,
    /// Prompt tokens per row (random ids).
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Tokens generated per row (the first by the prefill).
    #[arg(long, default_value_t = 256)]
    pub new_tokens: usize,
    /// Positions of the KV cache (prompt + generated; default: --prompt-len + --new-tokens).
    /// Give the same value to compare prompt lengths at one cache size.
    #[arg(long)]
    pub max_length: Option<usize>,
    /// Timed runs per batch size (after one warm-up run).
    #[arg(long, default_value_t = 3)]
    pub runs: usize,
    /// Seed of the random prompt ids.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sample at this temperature (> 0) instead of greedy decoding, seeded with --seed.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// With --temperature: the k most likely tokens are the candidates (0: all).
    #[arg(long, default_value_t = 50, requires = "temperature")]
    pub top_k: usize,
    /// With --temperature: the nucleus's probability.
    #[arg(long, default_value_t = 1.0, requires = "temperature")]
    pub top_p: f32,
    /// Penalty for tokens already in the sequence (1.0: none), greedy or sampled.
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Memory bandwidth of the floor, in GB/s (H200: 4500 measured, 4800 spec).
    #[arg(long, default_value_t = 4500.0)]
    pub bandwidth_gbps: f64,
    #[command(flatten)]
    pub graph: GraphArgs,
    /// The KV cache on a GPU: `on` pages it (its rows map as they grow, where the attention
    /// package takes paged caches, as kiln-attention does), `off` takes the pool's row-major
    /// buffers of the whole cache length, to compare the two.
    #[arg(long, value_enum, default_value_t = Switch::On)]
    pub paged_kv: Switch,
    /// Whether packages hear which kernel inputs are constant initializers (ABI.md §7.7), so
    /// that kiln-matmul's decode GEMVs load their weights before the grid-dependency wait: `off`
    /// to compare.
    #[arg(long, value_enum, default_value_t = Switch::On, value_name = "on|off")]
    pub constant_inputs: Switch,
    /// Print the session's report (per-op host time, launches, plan hits) after the runs.
    #[arg(long)]
    pub report: bool,
    /// After the timed runs, one more run with per-op GPU time (CUDA events between nodes);
    /// printed with the report.
    #[arg(long)]
    pub profile: bool,
    /// Write the numbers as JSON.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub target: ModelRunArgs,
}

/// `--paged-kv`, `--constant-inputs`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switch {
    On,
    Off,
}

/// One timed run: prefill and decode wall times, decode steps, and the host time of the decode
/// steps' session runs (enqueueing; the device is not waited for).
struct Run {
    prefill_ms: f64,
    decode_ms: f64,
    steps: usize,
    enqueue_ms: f64,
    bucket: usize,
}

/// Generates `new_tokens` tokens per row of `prompts` (EOS ignored) with a cache of
/// `max_length` positions, through `Generator::generate`.
fn run_once(
    g: &mut Generator,
    prompts: &[Vec<i64>],
    sampling: &SamplingParams,
    new_tokens: usize,
    max_length: usize,
) -> Result<Run> {
    let opts = GenerateOptions {
        max_new_tokens: new_tokens,
        max_length: Some(max_length),
        sampling: sampling.clone(),
        ignore_eos: true,
        stop: None,
    };
    let t = g.generate(prompts, &opts, &mut |_, _| {})?.timings;
    Ok(Run {
        prefill_ms: t.prefill_ms,
        decode_ms: t.decode_ms,
        steps: t.decode_steps,
        enqueue_ms: t.decode_host_ms,
        bucket: t.bucket,
    })
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

pub fn run(a: DecodeArgs) -> Result<ExitCode> {
    let bounds = [
        (
            a.new_tokens < 2,
            format!("--new-tokens must be at least 2 (the prefill makes the first), got {}", a.new_tokens),
        ),
        (a.prompt_len == 0, "--prompt-len must be at least 1".to_string()),
        (a.runs == 0, "--runs must be at least 1".to_string()),
        (a.batches.contains(&0), "--batch must be at least 1".to_string()),
        (
            a.temperature.is_some_and(|t| !(t > 0.0 && t.is_finite())),
            format!("--temperature must be > 0 (leave it out for greedy), got {}", a.temperature.unwrap_or(0.0)),
        ),
        (!(a.top_p > 0.0 && a.top_p <= 1.0), format!("--top-p must be in (0, 1], got {}", a.top_p)),
        (
            !(a.repetition_penalty > 0.0 && a.repetition_penalty.is_finite()),
            format!("--repetition-penalty must be > 0 (1: none), got {}", a.repetition_penalty),
        ),
    ];
    if let Some((_, msg)) = bounds.into_iter().find(|(bad, _)| *bad) {
        return Err(Error::Input(msg));
    }
    super::output::check_path("--json", &a.json)?;
    let human = super::output::Human::new(&[&a.json]);
    let device = choose_device(a.target.resolve.device)?;
    let folder = ModelFolder::open(&a.model_dir)?;
    let vocab = folder.config.model.vocab_size;
    if vocab == 0 {
        return Err(Error::Input(format!("{}: vocab_size is 0", a.model_dir.display())));
    }
    let needed = a.prompt_len.saturating_add(a.new_tokens);
    let max_length = a.max_length.unwrap_or(needed);
    folder.config.checked_max_length(Some(max_length)).map_err(|e| Error::Input(format!("--max-length: {e}")))?;
    if needed > max_length {
        return Err(Error::Input(format!(
            "--prompt-len {} + --new-tokens {} is over --max-length {max_length}",
            a.prompt_len, a.new_tokens
        )));
    }
    if max_length > folder.config.model.context_length {
        return Err(Error::Input(format!(
            "--max-length {max_length} (or --prompt-len + --new-tokens) is over the model's context length {}",
            folder.config.model.context_length
        )));
    }
    let graphs = a.graph.mode(device)?;
    let sampling = SamplingParams {
        do_sample: a.temperature.is_some(),
        temperature: a.temperature.unwrap_or(1.0),
        top_k: a.top_k,
        top_p: a.top_p,
        repetition_penalty: a.repetition_penalty,
        seed: a.seed,
    };
    let weight_bytes: u64 = folder.model.graph.initializers.values().map(|t| t.data.len() as u64).sum();
    let floor_ms = weight_bytes as f64 / (a.bandwidth_gbps * 1e9) * 1e3;
    let rt = Runtime::new(model_registry(&a.target.resolve.packages, &a.model_dir)?, super::sandbox_config())?;
    let t_setup = Instant::now();
    let loading = super::progress::Progress::spinner("loading the model");
    let options = crate::ep::SessionOptions {
        constant_inputs: a.constant_inputs == Switch::On,
        ..a.target.session_options(device, graphs)?
    };
    let mut g = Generator::new(rt, folder, options)?;
    let paged = g.set_paged_kv(a.paged_kv == Switch::On);
    drop(loading);
    let setup_s = t_setup.elapsed().as_secs_f64();
    let penalty = if a.repetition_penalty == 1.0 {
        String::new()
    } else {
        format!(", repetition penalty {}", a.repetition_penalty)
    };
    let sampling_label = match a.temperature {
        Some(t) => format!("sampled (temperature {t}, top-k {}, top-p {}{penalty}, seed {})", a.top_k, a.top_p, a.seed),
        None => format!("greedy{penalty}"),
    };
    say!(
            human,
        "model: {} ({} layers, vocab {vocab}), device {device}; prompt {} tokens, {} new tokens, {sampling_label}, medians over {} timed run(s)",
        a.model_dir.display(),
        g.folder.config.model.decoder.num_hidden_layers,
        a.prompt_len,
        a.new_tokens,
        a.runs
    );
    say!(
        human,
        "weights {:.1} MB: floor {:.1} µs/step at {} GB/s; session setup {setup_s:.2} s; KV cache {}",
        weight_bytes as f64 / 1e6,
        floor_ms * 1e3,
        a.bandwidth_gbps,
        match (paged, g.on_gpu()) {
            (true, _) => "paged",
            (false, true) => "row-major (the pool's)",
            (false, false) => "host tensors",
        }
    );
    let graphs_label = if g.session.captures_graphs() { "on" } else { "off" };
    say!(
        human,
        "| batch (bucket) | graphs | decode ms/step | decode tok/s | prefill ms | × floor | host ms/step | replays/step | kernels/step |"
    );
    say!(human, "|---:|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    let mut rng = StdRng::seed_from_u64(a.seed);
    let progress = super::progress::Progress::bar((a.batches.len() * (a.runs + 1)) as u64, "bench decode");
    for &batch in &a.batches {
        let prompts: Vec<Vec<i64>> =
            (0..batch).map(|_| (0..a.prompt_len).map(|_| rng.random_range(0..vocab as i64)).collect()).collect();
        progress.message(&format!("batch {batch}: warm-up"));
        let t_warm = Instant::now();
        run_once(&mut g, &prompts, &sampling, a.new_tokens, max_length)?;
        let warm_s = t_warm.elapsed().as_secs_f64();
        progress.step(&format!("batch {batch}: timed runs"));
        let report_before = g.session.report.clone();
        let mut runs = Vec::with_capacity(a.runs);
        for _ in 0..a.runs {
            runs.push(run_once(&mut g, &prompts, &sampling, a.new_tokens, max_length)?);
            progress.step(&format!("batch {batch}: timed runs"));
        }
        let per_step = |r: &Run, v: f64| v / r.steps.max(1) as f64;
        let ms_step = median(runs.iter().map(|r| per_step(r, r.decode_ms)).collect());
        let prefill_ms = median(runs.iter().map(|r| r.prefill_ms).collect());
        let enqueue = median(runs.iter().map(|r| per_step(r, r.enqueue_ms)).collect());
        let tok_s = batch as f64 * 1e3 / ms_step;
        let r = &g.session.report;
        let timed_runs = (r.runs - report_before.runs).max(1) as f64;
        let steps_timed: usize = runs.iter().map(|r| r.steps).sum();
        let replays = (r.graphs.replays - report_before.graphs.replays) as f64 / steps_timed.max(1) as f64;
        let bucket = runs.first().map_or(batch, |r| r.bucket);
        // The kernel nodes of the decode step's graph (the last one captured), where steps replay.
        let kernels = (replays > 0.0).then_some(r.graphs.graph_kernels);
        let kernels_cell = kernels.map_or("-".to_string(), |k| k.to_string());
        progress.suspend(|| {
            say!(
                human,
                "| {batch} ({bucket}) | {graphs_label} | {ms_step:.3} | {tok_s:.0} | {prefill_ms:.1} | {:.0} | {enqueue:.3} | {replays:.2} | {kernels_cell} |",
                ms_step / floor_ms
            )
        });
        let fallbacks: u64 =
            r.graphs.fallbacks.values().sum::<u64>() - report_before.graphs.fallbacks.values().sum::<u64>();
        rows.push(json!({
            "batch": batch,
            "bucket": bucket,
            "graphs": graphs_label,
            "paged_kv": paged,
            "graph_replays_per_step": replays,
            "graph_kernel_nodes": kernels,
            "graph_fallbacks_timed": fallbacks,
            "decode_ms_per_step": ms_step,
            "decode_tokens_per_s": tok_s,
            "host_enqueue_ms_per_step": enqueue,
            "prefill_ms": prefill_ms,
            "warmup_s": warm_s,
            "times_floor": ms_step / floor_ms,
            "runs": runs.iter().map(|r| json!({"prefill_ms": r.prefill_ms, "decode_ms": r.decode_ms, "steps": r.steps, "enqueue_ms": r.enqueue_ms})).collect::<Vec<_>>(),
            "per_session_run": {
                "nodes": (r.nodes - report_before.nodes) as f64 / timed_runs,
                "launches": (r.launches - report_before.launches) as f64 / timed_runs,
                "plan_hits": (r.plan_hits - report_before.plan_hits) as f64 / timed_runs,
                "wasm_calls": ((r.wasm_calls.infer + r.wasm_calls.cpu + r.wasm_calls.dispatch)
                    - (report_before.wasm_calls.infer + report_before.wasm_calls.cpu + report_before.wasm_calls.dispatch)) as f64 / timed_runs,
            },
        }));
    }
    drop(progress);
    if a.report {
        say!(human, "session report (warm-up runs included):\n{}", g.session.report.render());
        if let Some((alloc, (hits, queries))) = g.session.gpu_stats() {
            say!(human, "allocator: {alloc:?}\ngemm plans: {hits} hits, {queries} heuristic queries");
        }
    }
    if a.profile {
        g.session.report = crate::trace::Report { device: device.to_string(), ..Default::default() };
        g.session.set_gpu_profiling(true);
        let prompts: Vec<Vec<i64>> = vec![(0..a.prompt_len as i64).map(|i| i % vocab as i64).collect()];
        run_once(&mut g, &prompts, &sampling, a.new_tokens, max_length)?;
        g.session.set_gpu_profiling(false);
        let what = match device {
            crate::ep::Device::Cpu => "host time per op only: GPU time needs a GPU",
            crate::ep::Device::Cuda(_) => "host and GPU time per op",
        };
        say!(
            human,
            "profile (batch 1, one prefill and {} decode steps; {what}):\n{}",
            a.new_tokens - 1,
            g.session.report.render()
        );
    }
    if let Some(path) = &a.json {
        let doc = json!({
            "model": a.model_dir.display().to_string(),
            "device": device.to_string(),
            "prompt_len": a.prompt_len,
            "new_tokens": a.new_tokens,
            "max_length": max_length,
            "graphs": graphs_label,
            "sampling": sampling_label,
            "graph_stats": g.session.report.graphs,
            "weight_bytes": weight_bytes,
            "floor_ms_per_step": floor_ms,
            "setup_s": setup_s,
            "rows": rows,
        });
        super::output::write_json(path, &doc)?;
    }
    Ok(ExitCode::SUCCESS)
}

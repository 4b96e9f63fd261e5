//! `kiln generate`.

use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;

use crate::ep::Runtime;
use crate::genai::{GenerateOptions, Generator, ModelFolder, SamplingParams};
use crate::{Error, Result};

use super::output::note;
use super::{choose_device, model_registry, GraphArgs, ModelRunArgs};

#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("prompt_input").required(true).multiple(true).args(["prompts", "prompt_files"])))]
pub struct GenerateArgs {
    /// An onnxruntime-genai model folder (genai_config.json, model.onnx, tokenizer.json).
    pub model_dir: PathBuf,
    /// A prompt; repeat for a batch (right-padded).
    #[arg(long = "prompt")]
    pub prompts: Vec<String>,
    /// A file whose text is one prompt (`-`: standard input; one trailing newline is dropped);
    /// repeat for a batch. These prompts follow the `--prompt` ones.
    #[arg(long = "prompt-file", value_name = "FILE")]
    pub prompt_files: Vec<PathBuf>,
    /// Apply the folder's chat template (a user message with the generation prompt).
    #[arg(long)]
    pub chat: bool,
    /// Most tokens generated per prompt.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Longest sequence (prompt + generated); overrides genai_config.json's search.max_length.
    #[arg(long)]
    pub max_length: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Write prompt ids, generated ids, text and timings as JSON (`-`: standard output).
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    #[command(flatten)]
    pub graph: GraphArgs,
    /// Print the session's report after the run (nodes, launches, graphs: captures, replays,
    /// fallbacks with their reasons).
    #[arg(long)]
    pub report: bool,
    /// Write the session's report as JSON.
    #[arg(long, value_name = "FILE")]
    pub report_json: Option<PathBuf>,
    #[command(flatten)]
    pub target: ModelRunArgs,
}

/// The sampling flags of `generate` and `chat`.
#[derive(clap::Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Always take the most likely token (the default unless the config says do_sample).
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p", "seed"])]
    pub greedy: bool,
    /// Sample with this temperature (> 0); 0 is greedy.
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f32>,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample from the smallest set of tokens whose probability reaches p.
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f32>,
    /// Seed of the sampler (random when not given; printed whenever the run samples).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Penalty for tokens already in the sequence (1.0: none).
    #[arg(long, allow_negative_numbers = true)]
    pub repetition_penalty: Option<f32>,
}

/// The sampling parameters of a run, explicit about what the flags imply:
/// - `--temperature 0` is greedy (as llama.cpp and OpenAI have it); `--temperature T > 0`
///   samples;
/// - `--top-k`, `--top-p` or `--seed` without `--temperature` sample at the folder's temperature,
///   and a note on stderr says so;
/// - with no flag, the folder's `search.do_sample` decides;
/// - the seed is random unless given, and is printed whenever the run samples.
///
/// Errors name the bad flag and its value.
pub(super) fn sampling(a: &SamplingArgs, folder: &ModelFolder) -> Result<SamplingParams> {
    let s = &folder.config.search;
    let bad = |flag: &str, want: &str, got: f32| Err(Error::Input(format!("{flag} must be {want}, got {got}")));
    // Written so that NaN is refused too.
    if let Some(t) = a.temperature.filter(|t| !(*t >= 0.0 && t.is_finite())) {
        return bad("--temperature", "≥ 0 (0: greedy)", t);
    }
    if let Some(p) = a.top_p.filter(|p| !(*p > 0.0 && *p <= 1.0)) {
        return bad("--top-p", "in (0, 1]", p);
    }
    if let Some(r) = a.repetition_penalty.filter(|r| !(*r > 0.0 && r.is_finite())) {
        return bad("--repetition-penalty", "> 0 (1: none)", r);
    }
    let implied: Vec<&str> =
        [(a.top_k.is_some(), "--top-k"), (a.top_p.is_some(), "--top-p"), (a.seed.is_some(), "--seed")]
            .into_iter()
            .filter_map(|(given, flag)| given.then_some(flag))
            .collect();
    let do_sample = match a.temperature {
        _ if a.greedy => false,
        Some(t) if t == 0.0 && !implied.is_empty() => {
            note!("kiln: note: --temperature 0 is greedy: {} ignored", implied.join(", "));
            false
        }
        Some(t) => t > 0.0,
        None if !implied.is_empty() => {
            note!(
                "kiln: note: {} without --temperature: sampling at the folder's temperature {} (--temperature 0 or \
                 --greedy for greedy)",
                implied.join(", "),
                s.temperature
            );
            true
        }
        None if s.do_sample && s.temperature == 0.0 => {
            note!("kiln: note: the folder's search.temperature is 0: greedy");
            false
        }
        None => s.do_sample,
    };
    let temperature = a.temperature.unwrap_or(s.temperature);
    if do_sample && !(temperature > 0.0 && temperature.is_finite()) {
        return bad("the folder's search.temperature", "> 0 to sample (give --temperature)", temperature);
    }
    let p = SamplingParams {
        do_sample,
        temperature,
        top_k: a.top_k.unwrap_or(s.top_k),
        top_p: a.top_p.unwrap_or(s.top_p),
        repetition_penalty: a.repetition_penalty.unwrap_or(s.repetition_penalty),
        seed: a.seed.unwrap_or_else(rand::random),
    };
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        return bad("the folder's search.top_p", "in (0, 1]", p.top_p);
    }
    if !(p.repetition_penalty > 0.0 && p.repetition_penalty.is_finite()) {
        return bad("the folder's search.repetition_penalty", "> 0", p.repetition_penalty);
    }
    if p.do_sample {
        eprintln!(
            "kiln: sampling: temperature {}, top-k {}, top-p {}, seed {} (--seed {} repeats this run)",
            p.temperature, p.top_k, p.top_p, p.seed, p.seed
        );
    }
    Ok(p)
}

/// The text of each `--prompt-file` (`-`: standard input, read once), a trailing newline
/// dropped. Errors name the file.
fn read_prompt_files(files: &[PathBuf]) -> Result<Vec<String>> {
    if files.iter().filter(|f| f.as_os_str() == "-").count() > 1 {
        return Err(Error::Input("--prompt-file -: standard input can be read only once".into()));
    }
    files
        .iter()
        .map(|f| {
            let text = if f.as_os_str() == "-" {
                let mut s = String::new();
                std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
                    .map_err(|e| Error::Input(format!("--prompt-file -: cannot read standard input as UTF-8: {e}")))?;
                s
            } else {
                std::fs::read_to_string(f).map_err(|e| Error::Input(format!("--prompt-file {}: {e}", f.display())))?
            };
            let text = text.strip_suffix('\n').map(|t| t.strip_suffix('\r').unwrap_or(t)).unwrap_or(&text);
            if text.is_empty() {
                return Err(Error::Input(format!("--prompt-file {}: the prompt is empty", f.display())));
            }
            Ok(text.to_string())
        })
        .collect()
}

pub fn run(mut a: GenerateArgs) -> Result<ExitCode> {
    super::output::check_path("--json", &a.json)?;
    super::output::check_path("--report-json", &a.report_json)?;
    if super::output::json_on_stdout(&[&a.json]) && super::output::json_on_stdout(&[&a.report_json]) {
        return Err(Error::Input("--json - and --report-json -: only one of them can go to standard output".into()));
    }
    let files = read_prompt_files(&a.prompt_files)?;
    a.prompts.extend(files);
    let human = super::output::Human::new(&[&a.json, &a.report_json]);
    let device = choose_device(a.target.resolve.device)?;
    let graphs = a.graph.mode(device)?;
    if a.max_new_tokens == 0 {
        return Err(Error::Input("--max-new-tokens must be at least 1".into()));
    }
    let folder = ModelFolder::open(&a.model_dir)?;
    // Before the session is built: a length over the context fails now, not mid-stream.
    folder.config.checked_max_length(a.max_length).map_err(|e| Error::Input(format!("--max-length: {e}")))?;
    let params = sampling(&a.sampling, &folder)?;
    let mut prompts = Vec::with_capacity(a.prompts.len());
    for p in &a.prompts {
        let text = if a.chat { folder.chat_prompt(p)? } else { p.clone() };
        prompts.push(folder.encode(&text)?);
    }
    let rt = Runtime::new(model_registry(&a.target.resolve.packages, &a.model_dir)?, super::sandbox_config())?;
    let loading = super::progress::Progress::spinner("loading the model");
    let mut generator = Generator::new(rt, folder, a.target.session_options(device, graphs)?)?;
    drop(loading);
    let opts = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        max_length: a.max_length,
        sampling: params,
        ignore_eos: false,
        stop: None,
    };
    // Stream the first (or only) row as its tokens come.
    let stream = prompts.len() == 1;
    let mut text0 = crate::genai::TextStream::new(generator.folder.tokenizer.clone());
    let mut on_token = |row: usize, id: i64| {
        if stream && row == 0 {
            if let Some(piece) = text0.push(id) {
                human.print(&piece);
            }
        }
    };
    let result = generator.generate(&prompts, &opts, &mut on_token)?;
    let folder = &generator.folder;
    let mut rows_json = Vec::new();
    for (i, r) in result.rows.iter().enumerate() {
        let text = folder.decode(&r.generated_ids)?;
        if stream {
            let rest = text0.rest(&text);
            human.line(rest);
        } else {
            // A batch prints each row labelled, its prompt apart from its answer.
            human.line(&format!("[{i}] prompt: {}\n[{i}] output: {text}", a.prompts[i]));
        }
        rows_json.push(json!({
            "prompt": a.prompts[i],
            "prompt_ids": r.prompt_ids,
            "generated_ids": r.generated_ids,
            "text": text,
            "stopped_by": r.stopped_by,
        }));
    }
    let t = &result.timings;
    let g = &generator.session.report.graphs;
    let on_cpu = device == crate::ep::Device::Cpu;
    let graphs_note = match (t.device_sampling, generator.session.captures_graphs()) {
        _ if on_cpu => "on the CPU, no CUDA graphs".to_string(),
        (true, true) => format!("graphs on: {} replays of {} steps, bucket {}", g.replays, t.decode_steps, t.bucket),
        (true, false) => "graphs off, tokens chosen on the GPU".to_string(),
        (false, _) => "graphs off, sampling on the host".to_string(),
    };
    let rows = result.rows.len();
    note!(
        "kiln: {device}, {rows} row{}: time to first token {:.1} ms, prefill {:.1} tokens/s; decode {:.1} tokens/s \
         ({} tokens after each row's first in {:.1} ms; its first step took {:.1} ms, as it builds the step's execution \
         plan for a new shape; {:.1} tokens/s after it); {graphs_note}",
        if rows == 1 { "" } else { "s" },
        t.time_to_first_token_ms,
        t.prefill_tokens_per_s,
        t.decode_tokens_per_s,
        t.decode_tokens,
        t.decode_ms,
        t.first_step_ms,
        t.steady_tokens_per_s
    );
    if a.report {
        eprintln!("{}", generator.session.report.render());
    }
    if let Some(path) = &a.report_json {
        super::output::write_json(path, &generator.session.report)?;
    }
    if let Some(path) = &a.json {
        // One schema for any number of prompts.
        let sampled = &opts.sampling;
        let doc = json!({
            "rows": rows_json,
            "timings": t,
            "device": device.to_string(),
            "sampling": {
                "do_sample": sampled.do_sample, "temperature": sampled.temperature, "top_k": sampled.top_k,
                "top_p": sampled.top_p, "repetition_penalty": sampled.repetition_penalty,
                // A greedy run draws nothing: no seed.
                "seed": (!sampled.is_greedy()).then_some(sampled.seed),
            },
        });
        super::output::write_json(path, &doc)?;
    }
    Ok(ExitCode::SUCCESS)
}

//! `kiln generate`.

use std::path::PathBuf;
use std::process::ExitCode;

use serde_json::json;

use crate::ep::{Runtime, SessionOptions};
use crate::genai::{GenerateOptions, Generator, ModelFolder, SamplingParams};
use crate::sandbox::SandboxConfig;
use crate::{Error, Result};

use super::{choose_device, registry, DeviceArg, GraphArgs, PackageArgs};

#[derive(clap::Args, Debug)]
pub struct GenerateArgs {
    /// An onnxruntime-genai model folder (genai_config.json, model.onnx, tokenizer.json).
    pub model_dir: PathBuf,
    /// A prompt; repeat for a batch (right-padded).
    #[arg(long = "prompt", required = true)]
    pub prompts: Vec<String>,
    /// Apply the folder's chat template (a user message with the generation prompt).
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// Longest sequence (prompt + generated); overrides genai_config.json's search.max_length.
    #[arg(long)]
    pub max_length: Option<usize>,
    /// Always take the most likely token (the default unless the config says do_sample).
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p", "seed"])]
    pub greedy: bool,
    /// Sample with this temperature.
    #[arg(long)]
    pub temperature: Option<f32>,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Sample from the smallest set of tokens whose probability reaches p.
    #[arg(long)]
    pub top_p: Option<f32>,
    /// Seed of the sampler.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Penalty for tokens already in the sequence (1.0: none).
    #[arg(long)]
    pub repetition_penalty: Option<f32>,
    #[arg(long, value_enum, default_value_t)]
    pub device: DeviceArg,
    /// Write prompt ids, generated ids, text and timings as JSON.
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
    pub packages: PackageArgs,
}

fn sampling(a: &GenerateArgs, folder: &ModelFolder) -> Result<SamplingParams> {
    let s = &folder.config.search;
    let sampled = a.temperature.is_some() || a.top_k.is_some() || a.top_p.is_some() || a.seed.is_some();
    let p = SamplingParams {
        do_sample: !a.greedy && (sampled || s.do_sample),
        temperature: a.temperature.unwrap_or(s.temperature),
        top_k: a.top_k.unwrap_or(s.top_k),
        top_p: a.top_p.unwrap_or(s.top_p),
        repetition_penalty: a.repetition_penalty.unwrap_or(s.repetition_penalty),
        seed: a.seed.unwrap_or(0),
    };
    // Written so that NaN is refused too.
    let valid = p.temperature > 0.0 && p.top_p > 0.0 && p.top_p <= 1.0 && p.repetition_penalty > 0.0;
    if !valid {
        return Err(Error::Input("--temperature and --repetition-penalty must be > 0, --top-p in (0, 1]".into()));
    }
    Ok(p)
}

pub fn run(a: GenerateArgs) -> Result<ExitCode> {
    super::output::check_path("--json", &a.json)?;
    super::output::check_path("--report-json", &a.report_json)?;
    if super::output::json_on_stdout(&[&a.json]) && super::output::json_on_stdout(&[&a.report_json]) {
        return Err(Error::Input("--json - and --report-json -: only one of them can go to standard output".into()));
    }
    let human = super::output::Human::new(&[&a.json, &a.report_json]);
    let device = choose_device(a.device)?;
    let graphs = a.graph.mode(device)?;
    if a.max_new_tokens == 0 {
        return Err(Error::Input("--max-new-tokens must be at least 1".into()));
    }
    let folder = ModelFolder::open(&a.model_dir)?;
    let params = sampling(&a, &folder)?;
    let mut prompts = Vec::with_capacity(a.prompts.len());
    for p in &a.prompts {
        let text = if a.chat { folder.chat_prompt(p)? } else { p.clone() };
        prompts.push(folder.encode(&text)?);
    }
    let rt = Runtime::new(registry(&a.packages), SandboxConfig::default())?;
    let mut generator = Generator::new(rt, folder, SessionOptions { device, graphs, ..SessionOptions::default() })?;
    let opts = GenerateOptions {
        max_new_tokens: a.max_new_tokens,
        max_length: a.max_length,
        sampling: params,
        ignore_eos: false,
    };
    // Stream the first (or only) row as its tokens come.
    let stream = prompts.len() == 1;
    let mut shown = String::new();
    let mut ids0: Vec<i64> = Vec::new();
    let tokenizer = generator.folder.tokenizer.clone();
    let mut on_token = |row: usize, id: i64| {
        if !stream || row != 0 {
            return;
        }
        ids0.push(id);
        let ids: Vec<u32> = ids0.iter().map(|&i| i as u32).collect();
        if let Ok(text) = tokenizer.decode(&ids, true) {
            // Hold back an incomplete UTF-8 sequence (decoded as U+FFFD) until it completes.
            if !text.ends_with('\u{FFFD}') && text.len() >= shown.len() && text.starts_with(shown.as_str()) {
                human.print(&text[shown.len()..]);
                shown = text;
            }
        }
    };
    let result = generator.generate(&prompts, &opts, &mut on_token)?;
    let folder = &generator.folder;
    let mut rows_json = Vec::new();
    for (i, r) in result.rows.iter().enumerate() {
        let text = folder.decode(&r.generated_ids)?;
        if stream {
            let rest = text.strip_prefix(shown.as_str()).unwrap_or("");
            human.line(rest);
        } else {
            human.line(&format!("[{i}] {}{text}", a.prompts[i]));
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
    let graphs_note = match (t.device_sampling, generator.session.captures_graphs()) {
        (true, true) => format!("graphs on: {} replays of {} steps, bucket {}", g.replays, t.decode_steps, t.bucket),
        (true, false) => "graphs off, sampling on the device".to_string(),
        (false, _) => "graphs off, sampling on the host".to_string(),
    };
    eprintln!(
        "kiln: {device}: time to first token {:.1} ms, prefill {:.1} tokens/s, decode {:.1} tokens/s ({} tokens in {:.1} ms; {graphs_note})",
        t.time_to_first_token_ms, t.prefill_tokens_per_s, t.decode_tokens_per_s, t.decode_tokens, t.decode_ms
    );
    if a.report {
        eprintln!("{}", generator.session.report.render());
    }
    if let Some(path) = &a.report_json {
        super::output::write_json(path, &generator.session.report)?;
    }
    if let Some(path) = &a.json {
        // One schema for any number of prompts.
        let doc = json!({ "rows": rows_json, "timings": t, "device": device.to_string() });
        super::output::write_json(path, &doc)?;
    }
    Ok(ExitCode::SUCCESS)
}

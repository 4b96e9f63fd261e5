//! The generation loop: prefill, then one token per step, feeding each step's present KV
//! back as the next step's past.
//!
//! KV layout (onnxruntime-genai decoders): `past_key_values.N.key` `[batch, kv_heads,
//! past_len, head_size]`. With `search.past_present_share_buffer` the past is one buffer of
//! the generation's maximum length from the first step, and GroupQueryAttention writes new
//! keys at each row's position (`seqlens_k`, derived in the graph from `attention_mask`);
//! otherwise the past grows by one position per step. Prompts of a batch are right-padded.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use kiln_kernel_abi::DType;
use serde::Serialize;

use super::{GenaiConfig, ModelFolder, Sampler, SamplingParams};
use crate::conformance::to_f64;
use crate::ep::{Runtime, Session, SessionOptions};
use crate::{Error, Result, Tensor};

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// Overrides the config's `search.max_length` (prompt + generated tokens).
    pub max_length: Option<usize>,
    pub sampling: SamplingParams,
}

/// Why a row stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Eos,
    MaxNewTokens,
    MaxLength,
}

/// One prompt's result.
#[derive(Clone, Debug, Serialize)]
pub struct RowResult {
    pub prompt_ids: Vec<i64>,
    pub generated_ids: Vec<i64>,
    pub stopped_by: StopReason,
}

/// Wall-clock timings of one generation (all rows together).
#[derive(Clone, Debug, Default, Serialize)]
pub struct Timings {
    /// From the call to the first token of every row, prefill included.
    pub time_to_first_token_ms: f64,
    pub prefill_ms: f64,
    /// Prompt tokens (all rows, padding excluded).
    pub prefill_tokens: usize,
    pub prefill_tokens_per_s: f64,
    pub decode_ms: f64,
    /// Tokens produced by decode steps (all rows; the first token comes from the prefill).
    pub decode_tokens: usize,
    pub decode_tokens_per_s: f64,
    pub decode_steps: usize,
}

/// Every row's result and the timings.
#[derive(Clone, Debug, Serialize)]
pub struct Generation {
    pub rows: Vec<RowResult>,
    pub timings: Timings,
}

/// A model folder ready to generate.
pub struct Generator {
    pub folder: ModelFolder,
    pub session: Session,
}

impl Generator {
    pub fn new(rt: Arc<Runtime>, folder: ModelFolder, options: SessionOptions) -> Result<Generator> {
        let session = Session::new(rt, folder.model.clone(), options)?;
        Ok(Generator { folder, session })
    }

    fn config(&self) -> &GenaiConfig {
        &self.folder.config
    }

    /// Zeros of the KV dtype, `[batch, kv_heads, len, head_size]`, for every layer's key and value.
    fn empty_past(&self, batch: usize, len: usize) -> Result<Vec<(String, Tensor)>> {
        let d = &self.config().model.decoder;
        let shape = vec![batch, d.num_key_value_heads, len, d.head_size];
        let n = crate::tensor::byte_size(self.folder.kv_dtype, &shape)? as usize;
        let zeros = Bytes::from(vec![0u8; n]);
        let mut out = Vec::with_capacity(2 * d.num_hidden_layers);
        for l in 0..d.num_hidden_layers {
            for tmpl in [&d.inputs.past_key_names, &d.inputs.past_value_names] {
                out.push((
                    GenaiConfig::layer_name(tmpl, l),
                    Tensor::new(self.folder.kv_dtype, shape.clone(), zeros.clone())?,
                ));
            }
        }
        Ok(out)
    }

    /// Runs one step: token ids `[batch, len]`, attention mask `[batch, total]` and the past.
    /// Returns the logits `[batch, len, vocab]` and the presents renamed as the next pasts.
    pub fn step(
        &mut self,
        ids: &[i64],
        batch: usize,
        mask: &[i64],
        past: Vec<(String, Tensor)>,
    ) -> Result<(Tensor, Vec<(String, Tensor)>)> {
        let d = self.config().model.decoder.clone();
        let mut feeds = vec![(d.inputs.input_ids.clone(), i64_tensor(vec![batch, ids.len() / batch], ids)?)];
        if let Some(m) = &d.inputs.attention_mask {
            feeds.push((m.clone(), i64_tensor(vec![batch, mask.len() / batch], mask)?));
        }
        feeds.extend(past);
        let outputs: HashMap<String, Tensor> = self.session.run(feeds)?.into_iter().collect();
        let take = |name: &str| {
            outputs.get(name).cloned().ok_or_else(|| Error::Model(format!("the decoder did not produce {name:?}")))
        };
        let logits = take(&d.outputs.logits)?;
        let mut next = Vec::with_capacity(2 * d.num_hidden_layers);
        for l in 0..d.num_hidden_layers {
            next.push((
                GenaiConfig::layer_name(&d.inputs.past_key_names, l),
                take(&GenaiConfig::layer_name(&d.outputs.present_key_names, l))?,
            ));
            next.push((
                GenaiConfig::layer_name(&d.inputs.past_value_names, l),
                take(&GenaiConfig::layer_name(&d.outputs.present_value_names, l))?,
            ));
        }
        Ok((logits, next))
    }

    /// Generates for `prompts` (token ids; a batch is right-padded). `on_token(row, id)` is
    /// called for every token as it is chosen.
    pub fn generate(
        &mut self,
        prompts: &[Vec<i64>],
        opts: &GenerateOptions,
        on_token: &mut dyn FnMut(usize, i64),
    ) -> Result<Generation> {
        let t0 = Instant::now();
        let batch = prompts.len();
        if batch == 0 || prompts.iter().any(|p| p.is_empty()) {
            return Err(Error::Input("every prompt must have at least one token".into()));
        }
        let cfg = self.config().clone();
        let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        let s = *lens.iter().max().unwrap_or(&1);
        let max_length = opts.max_length.unwrap_or_else(|| cfg.max_length());
        if s >= max_length {
            return Err(Error::Input(format!("the prompt has {s} tokens; max_length is {max_length}")));
        }
        let share = cfg.search.past_present_share_buffer;
        if !share && lens.iter().any(|&l| l != s) {
            return Err(Error::Input(
                "prompts of different lengths in one batch need a model with past_present_share_buffer".into(),
            ));
        }
        // The longest the sequences can get; the shared KV buffer is allocated at that length.
        let limit = max_length.min(s + opts.max_new_tokens);
        let pad = cfg.model.pad_token_id.unwrap_or(0);
        let eos = cfg.model.eos_token_id.to_vec();
        let vocab = cfg.model.vocab_size;

        let mut ids = vec![pad; batch * s];
        let mut mask = vec![0i64; batch * s];
        for (b, p) in prompts.iter().enumerate() {
            ids[b * s..b * s + p.len()].copy_from_slice(p);
            mask[b * s..b * s + p.len()].iter_mut().for_each(|m| *m = 1);
        }
        let past = self.empty_past(batch, if share { limit } else { 0 })?;
        let (logits, mut past) = self.step(&ids, batch, &mask, past)?;
        let mut sampler = Sampler::new(opts.sampling.clone());
        let mut history: Vec<Vec<i64>> = prompts.to_vec();
        let mut generated: Vec<Vec<i64>> = vec![Vec::new(); batch];
        let mut stopped: Vec<Option<StopReason>> = vec![None; batch];
        let mut next = vec![pad; batch];
        let values = to_f64(&logits);
        for b in 0..batch {
            let row = &values[(b * s + lens[b] - 1) * vocab..(b * s + lens[b]) * vocab];
            let row: Vec<f32> = row.iter().map(|&v| v as f32).collect();
            next[b] = sampler.next(&row, &history[b]);
        }
        let prefill = t0.elapsed();
        let mut timings = Timings {
            time_to_first_token_ms: prefill.as_secs_f64() * 1e3,
            prefill_ms: prefill.as_secs_f64() * 1e3,
            prefill_tokens: lens.iter().sum(),
            ..Timings::default()
        };
        timings.prefill_tokens_per_s = timings.prefill_tokens as f64 / prefill.as_secs_f64().max(1e-9);
        let t1 = Instant::now();
        let mut total = s;
        loop {
            for b in 0..batch {
                if stopped[b].is_some() {
                    continue;
                }
                generated[b].push(next[b]);
                history[b].push(next[b]);
                on_token(b, next[b]);
                if eos.contains(&next[b]) {
                    stopped[b] = Some(StopReason::Eos);
                } else if generated[b].len() >= opts.max_new_tokens {
                    stopped[b] = Some(StopReason::MaxNewTokens);
                } else if total + 1 >= max_length {
                    stopped[b] = Some(StopReason::MaxLength);
                }
            }
            if stopped.iter().all(Option::is_some) {
                break;
            }
            // One decode step: every row feeds its last token (finished rows feed padding).
            let step_ids: Vec<i64> = (0..batch).map(|b| if stopped[b].is_some() { pad } else { next[b] }).collect();
            total += 1;
            let mut m = Vec::with_capacity(batch * total);
            for b in 0..batch {
                m.extend_from_slice(&mask[b * (total - 1)..b * (total - 1) + total - 1]);
                m.push(1);
            }
            mask = m;
            let (logits, p) = self.step(&step_ids, batch, &mask, past)?;
            past = p;
            timings.decode_steps += 1;
            let values = to_f64(&logits);
            for b in 0..batch {
                if stopped[b].is_none() {
                    let row: Vec<f32> = values[b * vocab..(b + 1) * vocab].iter().map(|&v| v as f32).collect();
                    next[b] = sampler.next(&row, &history[b]);
                    timings.decode_tokens += 1;
                }
            }
        }
        let decode = t1.elapsed();
        timings.decode_ms = decode.as_secs_f64() * 1e3;
        timings.decode_tokens_per_s = timings.decode_tokens as f64 / decode.as_secs_f64().max(1e-9);
        let rows = prompts
            .iter()
            .zip(generated)
            .zip(stopped)
            .map(|((p, g), s)| RowResult {
                prompt_ids: p.clone(),
                generated_ids: g,
                stopped_by: s.unwrap_or(StopReason::MaxLength),
            })
            .collect();
        Ok(Generation { rows, timings })
    }
}

/// An int64 tensor.
pub fn i64_tensor(shape: Vec<usize>, values: &[i64]) -> Result<Tensor> {
    Tensor::new(DType::I64, shape, Bytes::from(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()))
}

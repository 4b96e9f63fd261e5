//! The generation loop: prefill, then one token per step, with the KV cache held on the
//! session's device between steps (never through the host).
//!
//! KV layout (onnxruntime-genai decoders): `past_key_values.N.key` `[batch, kv_heads,
//! past_len, head_size]`. With `search.past_present_share_buffer` the past is one buffer of
//! the generation's maximum length from the first step, bound as both `past_*` input and
//! `present_*` output, so GroupQueryAttention writes each new key in place at its row's
//! position (`seqlens_k`, derived in the graph from `attention_mask`). Decode steps then feed a
//! mask of that full length, zero past each row's end, as onnxruntime-genai does under CUDA
//! graphs: every step has the same shapes, so every node's launch plan is reused. Without a
//! shared buffer the past grows by one position per step, each step's presents (kept on the
//! device) becoming the next step's pasts. Prompts of a batch are right-padded.
//!
//! Decoding with a shared buffer samples on the device (`device_step`: ArgMax when greedy,
//! else the Sample node with the same choices as the host's sampler): each step feeds
//! and writes the same held buffers (tokens, mask, position, KV), so on a GPU it runs through
//! one execution plan and, from its second step, as one CUDA-graph replay. On a GPU such a
//! batch is padded to a bucket (1, 2, 4, 8, 16, 32, then multiples of 32) with one-token rows
//! whose output is dropped, so every batch size of a bucket shares one plan and graph for one
//! cache length (the plan's key is the bucket and the cache length, at most 16 plans a session).

use std::sync::Arc;
use std::time::Instant;

use kiln_kernel_abi::DType;
use serde::Serialize;

use super::device_step::{self, SampleStart, StepBuffers, StepNames as DeviceNames, StepRow};
use super::kv::{KvCache, KvDims};
use super::{GenaiConfig, ModelFolder, Sampler, SamplingParams};
use crate::ep::{DeviceTensor, Feed, Fetch, Fetched, Runtime, Session, SessionOptions};
use crate::{Error, Result, Tensor};

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// Overrides the config's `search.max_length` (prompt + generated tokens).
    pub max_length: Option<usize>,
    pub sampling: SamplingParams,
    /// Keep generating after an end-of-sequence token (benchmarks: exactly `max_new_tokens`).
    pub ignore_eos: bool,
    /// Once set (from a SIGINT handler, for example), every row stops before the next step
    /// with [`StopReason::Interrupted`]; the tokens so far are kept.
    pub stop: Option<&'static std::sync::atomic::AtomicBool>,
}

/// Why a row stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    Eos,
    MaxNewTokens,
    MaxLength,
    /// `GenerateOptions::stop` was set.
    Interrupted,
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
    /// The first decode step, in milliseconds: it also builds the step's execution plan (and,
    /// pipelined, captures the next step's graph) when the shape is new to the session.
    pub first_step_ms: f64,
    /// Decode tokens per second after the first step: the steady rate that `kiln bench decode`
    /// measures on a warmed session.
    pub steady_tokens_per_s: f64,
    pub decode_steps: usize,
    /// Host time of the decode steps' session runs (enqueueing; a replayed graph is one
    /// launch), in milliseconds.
    pub decode_host_ms: f64,
    /// Whether the decode steps chose their tokens on the device (greedy with a shared KV
    /// buffer), and the batch bucket they ran at (rows, padding included).
    pub device_sampling: bool,
    pub bucket: usize,
}

/// Every row's result and the timings.
#[derive(Clone, Debug, Serialize)]
pub struct Generation {
    pub rows: Vec<RowResult>,
    pub timings: Timings,
}

/// Most device-step buffer sets a generator keeps (one per batch and cache length): as many as
/// the execution plans a session keeps, so that a continuous batch's row counts keep theirs.
const KEPT_STEP_BUFFERS: usize = 16;

/// A model folder ready to generate.
pub struct Generator {
    pub folder: ModelFolder,
    pub session: Session,
    /// The decoder's input and output names, resolved from the config once.
    names: StepNames,
    /// The names of the device-sampling nodes, when the session's graph has them.
    device: Option<DeviceNames>,
    /// The buffers of device-sampled steps, kept for the next steps of the same shape (a
    /// continuous batch moving between row counts, the next generation), most recently used
    /// first, at most [`KEPT_STEP_BUFFERS`]: each shape's captured graph keeps its addresses.
    step_buffers: Vec<StepBuffers>,
    /// A freed shared KV cache, reused by the next prefill of the same shape (its addresses,
    /// and so a captured step's graph, stay valid).
    spare_kv: Option<KvCache>,
    /// Whether a GPU's shared caches are paged ([`super::kv`]): every node reading the pasts
    /// and writing the presents declares paged tensors.
    paged_kv: bool,
}

/// The names a decoder step feeds and fetches (`genai_config.json`'s `decoder.inputs` and
/// `decoder.outputs`, layer templates expanded).
struct StepNames {
    input_ids: String,
    attention_mask: Option<String>,
    logits: String,
    /// Every layer's past key and value, in [`KvCache::past`] order.
    past: Vec<String>,
    /// The matching presents, in the same order.
    present: Vec<String>,
}

impl StepNames {
    fn of(config: &GenaiConfig) -> StepNames {
        let d = &config.model.decoder;
        let layers = |k: &str, v: &str| -> Vec<String> {
            (0..d.num_hidden_layers).flat_map(|l| [k, v].map(|t| GenaiConfig::layer_name(t, l))).collect()
        };
        StepNames {
            input_ids: d.inputs.input_ids.clone(),
            attention_mask: d.inputs.attention_mask.clone(),
            logits: d.outputs.logits.clone(),
            past: layers(&d.inputs.past_key_names, &d.inputs.past_value_names),
            present: layers(&d.outputs.present_key_names, &d.outputs.present_value_names),
        }
    }
}

impl Generator {
    pub fn new(rt: Arc<Runtime>, folder: ModelFolder, options: SessionOptions) -> Result<Generator> {
        let mut model = folder.model.clone();
        let device = device_step::augment(&mut model, &folder.config, &rt.registry);
        let session = Session::new(rt, model, options)?;
        let names = StepNames::of(&folder.config);
        let mut g =
            Generator { folder, session, names, device, step_buffers: Vec::new(), spare_kv: None, paged_kv: false };
        g.set_paged_kv(true);
        Ok(g)
    }

    /// Makes a GPU's shared caches (continuous batches) paged or reserved by rows (see
    /// `genai::kv`); paged only where the session's packages take paged caches. Returns
    /// whether they are paged now. A batch made before keeps its cache.
    pub fn set_paged_kv(&mut self, on: bool) -> bool {
        self.paged_kv = on
            && self.on_gpu()
            && self.session.accepts_paged(&self.names.past, &self.names.present, self.folder.kv_dtype);
        self.paged_kv
    }

    /// The shape of the cache tensors, and whether a GPU's shared caches are paged.
    pub(super) fn kv_dims(&self) -> KvDims {
        let d = &self.folder.config.model.decoder;
        KvDims {
            tensors: self.names.past.len(),
            kv_heads: d.num_key_value_heads,
            head_size: d.head_size,
            dtype: self.folder.kv_dtype,
            paged: self.paged_kv,
        }
    }

    /// Whether greedy decode steps choose their tokens on the device.
    pub fn samples_on_device(&self) -> bool {
        self.device.is_some()
    }

    fn config(&self) -> &GenaiConfig {
        &self.folder.config
    }

    /// Gives a cache back: a shared cache is kept for the next prefill of the same shape (the
    /// one kept before it goes back to the pool); any other cache goes back to the pool, as a
    /// dropped one does.
    pub fn free(&mut self, kv: KvCache) {
        if kv.shared {
            self.spare_kv = Some(kv);
        }
    }

    /// Gives back what the generator keeps between generations (a spare KV cache, the
    /// device-step buffers). The next generation allocates them anew, at new addresses.
    pub fn release_buffers(&mut self) {
        self.spare_kv = None;
        self.step_buffers.clear();
        self.session.reclaim();
    }

    /// Whether the session runs on a GPU.
    pub fn on_gpu(&self) -> bool {
        self.session.device() != crate::ep::Device::Cpu
    }

    /// Whether the decode graph has the Sample node (else device steps take the argmax).
    pub(super) fn has_device_sample(&self) -> bool {
        self.device.as_ref().is_some_and(|d| d.sample.is_some())
    }

    /// Runs the prompts (token ids, right-padded into one batch) with an empty cache of at
    /// most `limit` positions. Returns the cache and each row's logits at its last prompt
    /// token (`vocab` values). A shared cache on a GPU whose packages take paged caches is
    /// paged (`genai::kv`): its addresses are reserved for `limit` positions, and each row maps
    /// its pages as it grows. Errors: an empty prompt, prompts of different lengths without a
    /// shared buffer, a prompt of `limit` tokens or more.
    pub fn prefill(&mut self, prompts: &[Vec<i64>], limit: usize) -> Result<(KvCache, Vec<Vec<f32>>)> {
        self.prefill_into(prompts, limit, (0, 0), true)
    }

    /// [`Generator::prefill`] of a batch of at least `at_least.0` rows (extra rows: one padding
    /// token each) padded to at least `at_least.1` positions (below `limit`), so that prompts
    /// of nearby lengths run the same shapes (and the session's memoized dispatches) on a GPU,
    /// into a row-major cache of the pool's buffers (a continuous batch's join copies its rows
    /// out). Returns the logits of `prompts`' rows only. Padding needs a shared KV buffer;
    /// without one `at_least` is ignored.
    pub fn prefill_padded(
        &mut self,
        prompts: &[Vec<i64>],
        limit: usize,
        at_least: (usize, usize),
    ) -> Result<(KvCache, Vec<Vec<f32>>)> {
        self.prefill_into(prompts, limit, at_least, false)
    }

    /// [`Generator::prefill_padded`] into a paged cache when `paged` and the generator's shared
    /// caches are paged (`Generator::set_paged_kv`: on a GPU whose packages take them).
    fn prefill_into(
        &mut self,
        prompts: &[Vec<i64>],
        limit: usize,
        at_least: (usize, usize),
        paged: bool,
    ) -> Result<(KvCache, Vec<Vec<f32>>)> {
        if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
            return Err(Error::Input("every prompt must have at least one token".into()));
        }
        let lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        let s = lens.iter().copied().max().unwrap_or(1);
        if s >= limit {
            return Err(Error::Input(format!("the prompt has {s} tokens; max_length is {limit}")));
        }
        let shared = self.config().search.past_present_share_buffer;
        if !shared && lens.iter().any(|&l| l != s) {
            return Err(Error::Input(
                "prompts of different lengths in one batch need a model with past_present_share_buffer".into(),
            ));
        }
        let (batch, s) = match shared {
            true => (prompts.len().max(at_least.0), s.max(at_least.1.min(limit - 1))),
            false => (prompts.len(), s),
        };
        let pad = self.config().model.pad_token_id.unwrap_or(0);
        let mut ids = vec![pad; batch * s];
        let mut mask = vec![0i64; batch * s];
        for (b, p) in prompts.iter().enumerate() {
            ids[b * s..b * s + p.len()].copy_from_slice(p);
            mask[b * s..b * s + p.len()].iter_mut().for_each(|m| *m = 1);
        }
        for b in prompts.len()..batch {
            mask[b * s] = 1;
        }
        let d = &self.folder.config.model.decoder;
        let shape = vec![batch, d.num_key_value_heads, if shared { limit } else { 0 }, d.head_size];
        let dims = self.kv_dims();
        let paged = paged && shared && dims.paged;
        // Stale rows past each row's length are never read: GroupQueryAttention reads positions
        // below seqlens_k only, and the prompt overwrites the rest. A spare of another shape is
        // dropped, back to the pool before the new cache is allocated.
        let spare = self.spare_kv.take().filter(|k| {
            k.is_paged() == paged
                && k.batch == batch
                && k.limit == limit
                && k.past.first().and_then(|t| self.session.tensor_type(t).ok()).is_some_and(|t| t.1 == shape)
        });
        let mut kv = match spare {
            Some(k) => KvCache { total: s, mask, ..k },
            None if paged => {
                KvCache { total: s, mask, ..super::kv::empty(&mut self.session, &dims, batch, limit, batch)? }
            }
            None => {
                let past = (0..dims.tensors)
                    .map(|_| self.session.zeros(self.folder.kv_dtype, shape.clone()))
                    .collect::<Result<Vec<_>>>()?;
                KvCache { past, batch, shared, limit, total: s, mask, pages: None }
            }
        };
        if paged {
            super::kv::fit(&mut self.session, &dims, &kv, batch, s, false)?;
        }
        let rows: Vec<usize> = lens.iter().enumerate().map(|(b, &l)| b * s + l - 1).collect();
        match self.run_step(&mut kv, &ids, &rows) {
            Ok(logits) => {
                if kv.shared {
                    // From now on the mask has its full width, zero past each row's end.
                    let mut full = vec![0i64; batch * limit];
                    for b in 0..batch {
                        full[b * limit..b * limit + s].copy_from_slice(&kv.mask[b * s..(b + 1) * s]);
                    }
                    kv.mask = full;
                }
                Ok((kv, logits))
            }
            Err(e) => {
                self.free(kv);
                Err(e)
            }
        }
    }

    /// One decode step: `tokens` holds one token per row. Returns each row's logits.
    /// Errors: a wrong number of tokens, or a cache already `limit` positions long.
    pub fn decode(&mut self, kv: &mut KvCache, tokens: &[i64]) -> Result<Vec<Vec<f32>>> {
        if tokens.len() != kv.batch {
            return Err(Error::Input(format!("{} tokens for a batch of {}", tokens.len(), kv.batch)));
        }
        if kv.total >= kv.limit {
            return Err(Error::Input(format!("the cache is full ({} positions)", kv.limit)));
        }
        self.map_step(kv)?;
        let (b_n, old) = (kv.batch, kv.total);
        let saved_mask = (!kv.shared).then(|| kv.mask.clone());
        kv.total += 1;
        if kv.shared {
            // The mask's sum is what the graph reads (seqlens_k = sum − 1, the new token's
            // position); the 1 goes in column `total`, whatever the row's padding.
            for b in 0..b_n {
                kv.mask[b * kv.limit + old] = 1;
            }
        } else {
            let mut m = Vec::with_capacity(b_n * kv.total);
            for b in 0..b_n {
                m.extend_from_slice(&kv.mask[b * old..(b + 1) * old]);
                m.push(1);
            }
            kv.mask = m;
        }
        let rows: Vec<usize> = (0..b_n).collect();
        let result = self.run_step(kv, tokens, &rows);
        if result.is_err() {
            // The step did not happen: the cache keeps its length (a retry rewrites the row).
            kv.total = old;
            match saved_mask {
                Some(m) => kv.mask = m,
                None => (0..b_n).for_each(|b| kv.mask[b * kv.limit + old] = 0),
            }
        }
        result
    }

    /// Maps what the next step of a paged cache writes: every row's first `total + 1`
    /// positions (a row's position is at most `total`). Errors: as [`super::kv::fit`].
    fn map_step(&mut self, kv: &KvCache) -> Result<()> {
        if kv.pages.is_none() {
            return Ok(());
        }
        let d = self.kv_dims();
        super::kv::fit(&mut self.session, &d, kv, kv.batch, kv.total + 1, false).map(drop)
    }

    /// Runs the decoder on `ids` (`[batch, ids.len() / batch]`) with the cache's mask and past,
    /// updates the past, and returns the logits of the flattened `(row, position)` indices `rows`.
    fn run_step(&mut self, kv: &mut KvCache, ids: &[i64], rows: &[usize]) -> Result<Vec<Vec<f32>>> {
        let vocab = self.folder.config.model.vocab_size;
        let names = &self.names;
        let mut feeds =
            vec![(names.input_ids.clone(), Feed::Host(i64_tensor(vec![kv.batch, ids.len() / kv.batch], ids)?))];
        if let Some(m) = &names.attention_mask {
            let width = kv.mask.len() / kv.batch;
            feeds.push((m.clone(), Feed::Host(i64_tensor(vec![kv.batch, width], &kv.mask)?)));
        }
        feeds.extend(names.past.iter().cloned().zip(kv.past.iter().map(Feed::Device)));
        let mut fetches: Vec<(&str, Fetch<'_>)> = vec![(names.logits.as_str(), Fetch::Device)];
        for (name, t) in names.present.iter().zip(&kv.past) {
            fetches.push((name.as_str(), if kv.shared { Fetch::Into(t) } else { Fetch::Device }));
        }
        if let Some(d) = &self.device {
            fetches.extend(d.outputs().into_iter().map(|n| (n, Fetch::Skip)));
        }
        let outputs = self.session.run_with(feeds, &fetches)?;
        // Held outputs by name: the logits, and (without a shared buffer) the presents.
        let mut logits = None;
        let mut presents: Vec<Option<DeviceTensor>> = (0..names.present.len()).map(|_| None).collect();
        for (name, f) in outputs {
            let Fetched::Device(t) = f else { continue };
            match names.present.iter().position(|p| *p == name) {
                _ if name == names.logits => logits = Some(t),
                Some(slot) => presents[slot] = Some(t),
                None => drop(t),
            }
        }
        let missing = match (&logits, kv.shared) {
            (None, _) => Some(&names.logits),
            (Some(_), false) => names.present.iter().zip(&presents).find(|(_, t)| t.is_none()).map(|(n, _)| n),
            (Some(_), true) => None,
        };
        if let Some(name) = missing {
            let e = Error::Model(format!("the decoder did not produce {name:?}"));
            return Err(e);
        }
        // Without a shared buffer the presents become the pasts; the old pasts go back.
        for (slot, t) in presents.into_iter().enumerate() {
            if let Some(t) = t {
                kv.past[slot] = t;
            }
        }
        let Some(logits) = logits else { return Err(Error::Model("the decoder produced no logits".into())) };
        let contiguous = rows.windows(2).all(|w| w[1] == w[0] + 1);
        let out = match (contiguous, rows.first()) {
            // Decode: every row at once, one download.
            (true, Some(&first)) => self.session.read_slice(&logits, first * vocab, rows.len() * vocab).and_then(|t| {
                let all = t.to_f32()?;
                Ok(all.chunks_exact(vocab).map(<[f32]>::to_vec).collect())
            }),
            _ => rows.iter().map(|&r| self.session.read_slice(&logits, r * vocab, vocab)?.to_f32()).collect(),
        };
        out
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
        if prompts.is_empty() {
            return Err(Error::Input("no prompt to generate for".into()));
        }
        let cfg = self.config().clone();
        let s = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let max_length = cfg.checked_max_length(opts.max_length)?;
        // The longest the sequences can get; a shared KV buffer is allocated at that length.
        let limit = max_length.min(s + opts.max_new_tokens.max(1));
        // On a GPU, device-sampled batches run at their bucket, graphs on or off, so that eager
        // and graph steps of one batch have the same shapes (and the same tokens).
        let on_gpu = self.on_gpu();
        let device = match self.device_sampler(&opts.sampling, on_gpu) {
            Ok(_) if !cfg.search.past_present_share_buffer => Err("the folder has no past_present_share_buffer".into()),
            d => d,
        };
        let on_device = device.is_ok();
        if self.session.graph_mode() == crate::ep::GraphMode::On && on_gpu && !on_device {
            let why = device.err().unwrap_or_default();
            return Err(Error::Input(format!(
                "--graph on: decode steps are captured when they sample on the device, and this generation samples on \
                 the host ({why}): use --graph auto or off"
            )));
        }
        let bucket = if on_device && on_gpu { bucket(prompts.len()) } else { prompts.len() };
        let mut rows = prompts.to_vec();
        rows.resize(bucket, vec![cfg.model.pad_token_id.unwrap_or(0)]);
        let (mut kv, first) = self.prefill(&rows, limit)?;
        let result =
            self.decode_loop(&mut kv, &rows, prompts.len(), first, opts, device.ok(), max_length, t0, on_token);
        self.free(kv);
        let (generated, stopped, mut timings) = result?;
        timings.prefill_tokens = prompts.iter().map(Vec::len).sum();
        timings.device_sampling = on_device;
        timings.bucket = bucket;
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

    /// Samples the first tokens from the prefill's logits, then decodes until every row stops.
    /// Rows from `real` on are padding of the batch bucket: they step, nothing of them is kept.
    /// `device`: how steps choose their tokens on the device (`None`: on the host).
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn decode_loop(
        &mut self,
        kv: &mut KvCache,
        prompts: &[Vec<i64>],
        real: usize,
        first: Vec<Vec<f32>>,
        opts: &GenerateOptions,
        device: Option<DeviceSampler>,
        max_length: usize,
        t0: Instant,
        on_token: &mut dyn FnMut(usize, i64),
    ) -> Result<(Vec<Vec<i64>>, Vec<Option<StopReason>>, Timings)> {
        let batch = prompts.len();
        let pad = self.config().model.pad_token_id.unwrap_or(0);
        let eos = self.config().model.eos_token_id.to_vec();
        let sampler = Sampler::new(opts.sampling.clone());
        let mut history: Vec<Vec<i64>> = prompts.to_vec();
        let mut generated: Vec<Vec<i64>> = vec![Vec::new(); batch];
        let mut stopped: Vec<Option<StopReason>> =
            (0..batch).map(|b| (b >= real).then_some(StopReason::MaxLength)).collect();
        let mut next: Vec<i64> =
            first.iter().zip(&history).enumerate().map(|(b, (row, h))| sampler.next(row, h, b, 0)).collect();
        let on_device = device.is_some();
        if let Some(d) = device {
            let sample = (d == DeviceSampler::Sample).then_some(&opts.sampling);
            self.start_device_steps(kv, &next, prompts, sample)?;
        }
        let prefill = t0.elapsed();
        let prefill_tokens: usize = prompts[..real].iter().map(Vec::len).sum();
        let mut timings = Timings {
            time_to_first_token_ms: prefill.as_secs_f64() * 1e3,
            prefill_ms: prefill.as_secs_f64() * 1e3,
            prefill_tokens_per_s: prefill_tokens as f64 / prefill.as_secs_f64().max(1e-9),
            ..Timings::default()
        };
        let t1 = Instant::now();
        let host_before = self.session.report.run_time_us;
        // Device steps run one ahead: step k + 1 is enqueued before step k's tokens are read, so
        // the device works while the host hands the tokens out (`ahead`: the enqueued step whose
        // tokens are not read yet). A row that stops makes that step's tokens unused.
        let mut ahead: Option<crate::ep::PendingRead> = None;
        // Decode steps any row may still need (its first token came from the prefill).
        let mut steps_left = opts.max_new_tokens.saturating_sub(1);
        // When the first step's tokens were known, and the decode tokens it produced.
        let mut first_step: Option<(std::time::Duration, usize)> = None;
        let result = (|| -> Result<()> {
            loop {
                // The cache length these tokens extend (a step enqueued ahead is not counted).
                let len = kv.len() - ahead.is_some() as usize;
                for b in 0..batch {
                    if stopped[b].is_some() {
                        continue;
                    }
                    generated[b].push(next[b]);
                    history[b].push(next[b]);
                    on_token(b, next[b]);
                    if !opts.ignore_eos && eos.contains(&next[b]) {
                        stopped[b] = Some(StopReason::Eos);
                    } else if generated[b].len() >= opts.max_new_tokens {
                        stopped[b] = Some(StopReason::MaxNewTokens);
                    } else if len + 1 >= max_length {
                        stopped[b] = Some(StopReason::MaxLength);
                    }
                }
                if opts.stop.is_some_and(|s| s.load(std::sync::atomic::Ordering::SeqCst)) {
                    for s in stopped.iter_mut().filter(|s| s.is_none()) {
                        *s = Some(StopReason::Interrupted);
                    }
                }
                if stopped.iter().all(Option::is_some) {
                    break;
                }
                timings.decode_steps += 1;
                if on_device {
                    // Every row steps with the token the device chose for it (finished rows too,
                    // harmlessly); only the ids come back.
                    let this = match ahead.take() {
                        Some(p) => p,
                        None => {
                            steps_left = steps_left.saturating_sub(1);
                            self.enqueue_device_step(kv)?
                        }
                    };
                    if steps_left > 0 && kv.len() + 1 < max_length.min(kv.limit) {
                        steps_left -= 1;
                        ahead = Some(self.enqueue_device_step(kv)?);
                    }
                    let ids = self.session.read_finish(this)?.to_i64()?;
                    let at = t1.elapsed();
                    for b in 0..batch {
                        if stopped[b].is_none() {
                            next[b] = ids[b];
                            timings.decode_tokens += 1;
                        }
                    }
                    first_step.get_or_insert((at, timings.decode_tokens));
                    continue;
                }
                // One decode step: every row feeds its last token (finished rows feed padding).
                let step_ids: Vec<i64> = (0..batch).map(|b| if stopped[b].is_some() { pad } else { next[b] }).collect();
                let logits = self.decode(kv, &step_ids)?;
                let at = t1.elapsed();
                for b in 0..batch {
                    if stopped[b].is_none() {
                        next[b] = sampler.next(&logits[b], &history[b], b, generated[b].len());
                        timings.decode_tokens += 1;
                    }
                }
                first_step.get_or_insert((at, timings.decode_tokens));
            }
            Ok(())
        })();
        // A step enqueued ahead whose tokens no row wants: wait for it (its readback buffer is
        // reused), and report a failure it found.
        if let Some(p) = ahead.take() {
            let done = self.session.read_finish(p);
            result?;
            done?;
        } else {
            result?;
        }
        let decode = t1.elapsed();
        timings.decode_host_ms = (self.session.report.run_time_us - host_before) as f64 / 1e3;
        timings.decode_ms = decode.as_secs_f64() * 1e3;
        timings.decode_tokens_per_s = timings.decode_tokens as f64 / decode.as_secs_f64().max(1e-9);
        if let Some((first, first_tokens)) = first_step {
            timings.first_step_ms = first.as_secs_f64() * 1e3;
            timings.steady_tokens_per_s =
                (timings.decode_tokens - first_tokens) as f64 / (decode - first).as_secs_f64().max(1e-9);
        }
        Ok((generated, stopped, timings))
    }

    /// How decode steps with `params` choose their tokens on the device (`on_gpu`: within the
    /// CUDA sampler's limits), or why they cannot.
    pub(super) fn device_sampler(
        &self,
        params: &SamplingParams,
        on_gpu: bool,
    ) -> std::result::Result<DeviceSampler, String> {
        use kiln_kernel_abi::sampling::DEVICE_MAX_VOCAB;
        let Some(d) = &self.device else {
            return Err("the registry has no device-step packages for this decoder".into());
        };
        if params.is_greedy() && params.repetition_penalty == 1.0 {
            return Ok(DeviceSampler::ArgMax);
        }
        if d.sample.is_none() {
            return Err("no package implements ai.kiln::Sample for these logits".into());
        }
        let vocab = self.folder.config.model.vocab_size;
        if on_gpu && vocab > DEVICE_MAX_VOCAB {
            return Err(format!("a vocabulary of {vocab} is above the GPU sampler's {DEVICE_MAX_VOCAB}"));
        }
        Ok(DeviceSampler::Sample)
    }

    /// Readies device-sampled steps after a prefill: the step buffers of this shape (kept from
    /// an earlier generation, or new), with `tokens` to feed, the cache's mask with the first
    /// step's column set, and the position after it. `sample`: the steps run the Sample node
    /// with these parameters for every row, the `prompts` (the prefill's rows) and `tokens`
    /// being each row's history; `None`: they take the argmax.
    pub fn start_device_steps(
        &mut self,
        kv: &KvCache,
        tokens: &[i64],
        prompts: &[Vec<i64>],
        sample: Option<&SamplingParams>,
    ) -> Result<()> {
        if self.device.is_none() || !kv.shared {
            return Err(Error::Input("this model's decode steps cannot sample on the device".into()));
        }
        if kv.total >= kv.limit {
            return Err(Error::Input(format!("the cache is full ({} positions)", kv.limit)));
        }
        if prompts.len() != kv.batch || prompts.iter().any(|p| p.len() > kv.total) {
            return Err(Error::Input(format!(
                "{} prompts do not match the cache's batch of {}",
                prompts.len(),
                kv.batch
            )));
        }
        let (b_n, l) = (kv.batch, kv.limit);
        let mut mask = kv.mask.clone();
        for b in 0..b_n {
            mask[b * l + kv.total] = 1;
        }
        let vocab = self.folder.config.model.vocab_size;
        let inputs = sample.map(|params| {
            let mut history = vec![0i64; b_n * l];
            for (b, p) in prompts.iter().enumerate() {
                history[b * l..b * l + p.len()].copy_from_slice(p);
                history[b * l + kv.total] = tokens.get(b).copied().unwrap_or(0);
            }
            let row = Sampler::new(params.clone()).device_row(vocab);
            let seeds: Vec<i64> = (0..b_n).flat_map(|b| [params.seed as i64, kv.total as i64, b as i64]).collect();
            (history, row.repeat(b_n), seeds)
        });
        let sample = inputs.as_ref().map(|(history, params, seeds)| SampleStart { history, params, seeds });
        self.load_device_steps(kv, tokens, &mask, sample)
    }

    /// Sets the device-step buffers for `kv` (kept ones when they fit its batch and length, else
    /// new ones): the tokens to feed, the full `[batch, limit]` mask, and the Sample node's
    /// inputs (`None`: ArgMax). The next step's token takes mask column `kv.len() + 1`.
    /// Errors: no device-step nodes, or sizes that do not match the cache.
    pub(super) fn load_device_steps(
        &mut self,
        kv: &KvCache,
        tokens: &[i64],
        mask: &[i64],
        sample: Option<SampleStart<'_>>,
    ) -> Result<()> {
        let Some(d) = &self.device else {
            return Err(Error::Input("this model's decode steps cannot sample on the device".into()));
        };
        let with_sample = d.sample.is_some();
        let kept = self
            .step_buffers
            .iter()
            .position(|b| b.batch == kv.batch && b.limit == kv.limit && b.sample.is_some() == with_sample);
        let buffers = match kept {
            Some(i) => self.step_buffers.remove(i),
            None => {
                // The least recently used set goes back to the pool first.
                self.step_buffers.truncate(KEPT_STEP_BUFFERS - 1);
                StepBuffers::new(&mut self.session, kv.batch, kv.limit, with_sample)?
            }
        };
        self.step_buffers.insert(0, buffers);
        self.step_buffers[0].start(&mut self.session, tokens, mask, kv.total + 1, sample)
    }

    /// Sets single rows of the running device-step buffers of `kv` ([`StepBuffers::write_rows`]),
    /// and with `position` (the next step's position, and every row's seeds) moves the cache's
    /// length forward to `position − 1`. The host's mask of `kv` follows. Errors: as
    /// [`StepBuffers::write_rows`], or buffers of another cache.
    pub(super) fn write_device_step_rows(
        &mut self,
        kv: &mut KvCache,
        rows: &[StepRow<'_>],
        position: Option<(usize, &[i64])>,
    ) -> Result<()> {
        let b =
            self.step_buffers.first_mut().filter(|b| b.batch == kv.batch && b.limit == kv.limit && b.at == kv.total);
        let Some(b) = b else {
            return Err(Error::Input("the device-step buffers are not ready for this cache".into()));
        };
        b.write_rows(&mut self.session, rows, position)?;
        for r in rows {
            kv.mask[r.row * kv.limit..(r.row + 1) * kv.limit].copy_from_slice(r.mask);
        }
        kv.total = b.at;
        Ok(())
    }

    /// Enqueues one decode step that chooses its tokens on the device (after
    /// [`Generator::start_device_steps`]): it feeds the step buffers and the cache, and the
    /// tokens each row chose are already in place as the next step's input. Returns the pending
    /// readback of those tokens ([`crate::ep::Session::read_finish`] gives them), without
    /// waiting: the next step may be enqueued before this one's tokens are read. At most two
    /// steps' reads may be outstanding. Errors: a full cache, no started steps, or the step's own
    /// failure (the step buffers may then be partly written: start again).
    pub fn enqueue_device_step(&mut self, kv: &mut KvCache) -> Result<crate::ep::PendingRead> {
        if kv.total >= kv.limit {
            return Err(Error::Input(format!("the cache is full ({} positions)", kv.limit)));
        }
        self.map_step(kv)?;
        let (Some(d), Some(b)) = (&self.device, self.step_buffers.first()) else {
            return Err(Error::Input("enqueue_device_step before start_device_steps".into()));
        };
        if b.batch != kv.batch || b.limit != kv.limit || b.at != kv.total {
            return Err(Error::Input(
                "the device-step buffers are not ready for this cache (another cache, a host-side step, or a failed \
                 step came between): call start_device_steps again"
                    .into(),
            ));
        }
        let names = &self.names;
        let mut feeds =
            vec![(names.input_ids.clone(), Feed::Device(&b.ids)), (d.position.clone(), Feed::Device(&b.position))];
        if let Some(m) = &names.attention_mask {
            feeds.push((m.clone(), Feed::Device(&b.mask)));
        }
        feeds.extend(names.past.iter().cloned().zip(kv.past.iter().map(Feed::Device)));
        let mut fetches: Vec<(&str, Fetch<'_>)> = vec![
            (names.logits.as_str(), Fetch::Skip),
            (d.next_ids.as_str(), if b.sampling { Fetch::Skip } else { Fetch::Into(&b.ids) }),
            (d.next_mask.as_str(), Fetch::Into(&b.mask)),
            (d.next_position.as_str(), Fetch::Into(&b.position)),
        ];
        // The Sample node runs only when this generation samples: its ids go where ArgMax's
        // would, and the row's history grows in place.
        if let (Some(s), Some([history, params, seeds])) = (&d.sample, &b.sample) {
            if b.sampling {
                feeds.extend([
                    (s.history.clone(), Feed::Device(history)),
                    (s.sampling.clone(), Feed::Device(params)),
                    (s.seeds.clone(), Feed::Device(seeds)),
                ]);
            }
            fetches.push((s.sampled_ids.as_str(), if b.sampling { Fetch::Into(&b.ids) } else { Fetch::Skip }));
            fetches.push((s.next_history.as_str(), if b.sampling { Fetch::Into(history) } else { Fetch::Skip }));
        }
        for (name, t) in names.present.iter().zip(&kv.past) {
            fetches.push((name.as_str(), Fetch::Into(t)));
        }
        let ran = self.session.run_with(feeds, &fetches);
        let Some(b) = self.step_buffers.first_mut() else {
            return Err(Error::Device("step buffers vanished".into()));
        };
        // A failed step may have written part of the buffers: they are not ready until restarted.
        b.at = usize::MAX;
        ran?;
        for row in 0..kv.batch {
            kv.mask[row * kv.limit + kv.total] = 1;
        }
        kv.total += 1;
        b.at = kv.total;
        let ids = &self.step_buffers.first().ok_or_else(|| Error::Device("step buffers vanished".into()))?.ids;
        self.session.read_start(ids)
    }
}

/// How device-sampled decode steps choose their tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum DeviceSampler {
    /// Greedy without a repetition penalty: ArgMax.
    ArgMax,
    /// The Sample node (temperature, top-k, top-p, repetition penalty, per-row parameters).
    Sample,
}

/// The batch bucket of `rows` rows under CUDA graphs: 1, 2, 4, 8, 16, 32, then multiples of 32.
pub fn bucket(rows: usize) -> usize {
    if rows <= 32 {
        rows.max(1).next_power_of_two()
    } else {
        rows.div_ceil(32) * 32
    }
}

/// An int64 tensor.
pub fn i64_tensor(shape: Vec<usize>, values: &[i64]) -> Result<Tensor> {
    Tensor::new(DType::I64, shape, bytes::Bytes::from(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()))
}

/// A float32 tensor.
pub fn f32_tensor(shape: Vec<usize>, values: &[f32]) -> Result<Tensor> {
    Tensor::new(DType::F32, shape, bytes::Bytes::from(values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()))
}

#[cfg(test)]
mod tests {
    use super::bucket;

    #[test]
    fn batches_pad_to_powers_of_two_then_multiples_of_32() {
        let got: Vec<usize> = [1, 2, 3, 5, 8, 9, 17, 32, 33, 64, 65, 100].iter().map(|&n| bucket(n)).collect();
        assert_eq!(got, [1, 2, 4, 8, 8, 16, 32, 32, 64, 64, 96, 128]);
    }
}

//! Decode steps that sample on the device, so that only token ids cross to the host and a step
//! has the same buffers every time (the condition of replaying it as one CUDA graph).
//!
//! [`augment`] appends two nodes to the decoder graph, from packages like every other node:
//! - `ArgMax(logits, axis = -1, keepdims = 0)` → `kiln_next_input_ids` `[batch, 1]` int64: the
//!   greedy token of every row, written into the step's `input_ids` buffer (first index on ties,
//!   as the host's argmax);
//! - `ai.kiln::AppendAttentionMask(attention_mask, kiln_position)` → the mask with the next
//!   column set in every row, and the position advanced: written into the step's own mask and
//!   position buffers, so the next step's `seqlens_k` is computed inside the graph;
//! - when a package has it, `ai.kiln::Sample(logits, attention_mask, kiln_history,
//!   kiln_position, kiln_sampling, kiln_seeds)` → `kiln_sampled_ids` `[batch, 1]` and
//!   `kiln_next_history`: temperature, top-k, top-p and repetition penalty with per-row
//!   parameters in device buffers (`kiln_sampling` float32 `[batch, 4]`, `kiln_seeds` int64
//!   `[batch, 3]`: seed, the position of step 0 and the Philox stream), each row's tokens kept on the device
//!   (`kiln_history` `[batch, limit]`, by mask column) for the penalty. A step fetches either
//!   ArgMax's ids or Sample's, so a greedy step's graph has no sampling node.
//!
//! The host knows only the folder's input and output names (`genai_config.json`), never the
//! model's arithmetic. Prefill runs skip the appended outputs (`Fetch::Skip`), so their nodes
//! do not run there.

use kiln_kernel_abi::DType;
use kiln_registry::{NodeQuery, OpRegistry};

use kiln_kernel_abi::sampling::SEED_WORDS;

use super::GenaiConfig;
use crate::ep::{DeviceTensor, Session};
use crate::model::{AttrValue, Dim, Graph, Model, Node, Value, ValueId, ValueType};
use crate::{Error, Result};

/// Names of the values [`augment`] adds.
#[derive(Clone, Debug)]
pub struct StepNames {
    /// Graph input: int64 `[1]`, the mask column the next step's token takes.
    pub position: String,
    /// Graph outputs.
    pub next_ids: String,
    pub next_mask: String,
    pub next_position: String,
    /// The Sample node's values, when a package has the op.
    pub sample: Option<SampleNames>,
}

/// Names of the Sample node's inputs and outputs.
#[derive(Clone, Debug)]
pub struct SampleNames {
    /// Graph inputs: int64 `[batch, limit]`, float32 `[batch, 4]`, int64 `[batch, 3]`.
    pub history: String,
    pub sampling: String,
    pub seeds: String,
    /// Graph outputs: int64 `[batch, 1]` and `[batch, limit]`.
    pub sampled_ids: String,
    pub next_history: String,
}

impl StepNames {
    /// Every graph output [`augment`] added (a prefill skips them all).
    pub fn outputs(&self) -> Vec<&str> {
        let mut v = vec![self.next_ids.as_str(), self.next_mask.as_str(), self.next_position.as_str()];
        if let Some(s) = &self.sample {
            v.extend([s.sampled_ids.as_str(), s.next_history.as_str()]);
        }
        v
    }
}

/// The domain of kiln's own decode-step ops (package `kiln-sampling`).
pub const KILN_DOMAIN: &str = "ai.kiln";

/// The `ai.kiln` opset of the decode-step nodes: 2, whose Sample takes seeds `[batch, 3]`
/// (seed, step-0 position, stream); opset 1's took `[batch, 2]` (the row as the stream).
pub const KILN_OPSET: i64 = 2;

/// Appends the device-sampling nodes to `model` when its decoder has an attention mask, the
/// KV cache is one shared buffer and `registry` has packages for both ops. `None`: left as is
/// (decode then samples on the host).
pub fn augment(model: &mut Model, cfg: &GenaiConfig, registry: &OpRegistry) -> Option<StepNames> {
    let d = &cfg.model.decoder;
    let mask_name = d.inputs.attention_mask.as_ref()?;
    if !cfg.search.past_present_share_buffer {
        return None;
    }
    let onnx_opset = model.opset("")?;
    let resolves = |domain: &str, op: &str, opset: i64, dtype: DType| {
        registry
            .resolve(&NodeQuery {
                domain,
                op_type: op,
                opset,
                input_dtypes: vec![Some(dtype)],
                max_rank: None,
                device: None,
            })
            .is_ok()
    };
    let g = &model.graph;
    let logits = g.value_id(&d.outputs.logits)?;
    let mask = g.value_id(mask_name)?;
    let logits_dtype = g.values[logits].ty.as_ref()?.dtype;
    if !resolves("", "ArgMax", onnx_opset, logits_dtype)
        || !resolves(KILN_DOMAIN, "AppendAttentionMask", KILN_OPSET, DType::I64)
    {
        return None;
    }
    let sample = resolves(KILN_DOMAIN, "Sample", KILN_OPSET, logits_dtype).then(|| SampleNames {
        history: "kiln_history".into(),
        sampling: "kiln_sampling".into(),
        seeds: "kiln_seeds".into(),
        sampled_ids: "kiln_sampled_ids".into(),
        next_history: "kiln_next_history".into(),
    });
    let names = StepNames {
        position: "kiln_position".into(),
        next_ids: "kiln_next_input_ids".into(),
        next_mask: "kiln_next_attention_mask".into(),
        next_position: "kiln_next_position".into(),
        sample,
    };
    let mut taken = vec![names.position.as_str()];
    taken.extend(names.outputs());
    if let Some(s) = &names.sample {
        taken.extend([s.history.as_str(), s.sampling.as_str(), s.seeds.as_str()]);
    }
    if taken.iter().any(|n| g.value_id(n).is_some()) {
        return None;
    }
    let g = &mut model.graph;
    let sym = |s: &str| Dim::Symbolic(s.to_string());
    let position = add(g, &names.position, DType::I64, vec![Dim::Known(1)]);
    let next_ids = add(g, &names.next_ids, DType::I64, vec![sym("batch_size"), sym("sequence_length")]);
    let next_mask = add(g, &names.next_mask, DType::I64, vec![sym("batch_size"), sym("total_sequence_length")]);
    let next_position = add(g, &names.next_position, DType::I64, vec![Dim::Known(1)]);
    g.nodes.push(Node {
        name: "kiln/ArgMax".into(),
        op_type: "ArgMax".into(),
        domain: String::new(),
        inputs: vec![Some(logits)],
        implicit_inputs: 0,
        outputs: vec![Some(next_ids)],
        attributes: vec![("axis".into(), AttrValue::Int(-1)), ("keepdims".into(), AttrValue::Int(0))],
    });
    g.inputs.push(position);
    g.outputs.extend([next_ids, next_mask, next_position]);
    if let Some(s) = &names.sample {
        let history = add(g, &s.history, DType::I64, vec![sym("batch_size"), sym("total_sequence_length")]);
        let sampling = add(g, &s.sampling, DType::F32, vec![sym("batch_size"), Dim::Known(4)]);
        let seeds = add(g, &s.seeds, DType::I64, vec![sym("batch_size"), Dim::Known(SEED_WORDS)]);
        let sampled = add(g, &s.sampled_ids, DType::I64, vec![sym("batch_size"), Dim::Known(1)]);
        let next_history = add(g, &s.next_history, DType::I64, vec![sym("batch_size"), sym("total_sequence_length")]);
        g.nodes.push(Node {
            name: "kiln/Sample".into(),
            op_type: "Sample".into(),
            domain: KILN_DOMAIN.into(),
            inputs: vec![Some(logits), Some(mask), Some(history), Some(position), Some(sampling), Some(seeds)],
            implicit_inputs: 0,
            outputs: vec![Some(sampled), Some(next_history)],
            attributes: Vec::new(),
        });
        g.inputs.extend([history, sampling, seeds]);
        g.outputs.extend([sampled, next_history]);
    }
    // Last: bound in place, it rewrites the mask and the position that the nodes above read
    // (nodes run in list order).
    g.nodes.push(Node {
        name: "kiln/AppendAttentionMask".into(),
        op_type: "AppendAttentionMask".into(),
        domain: KILN_DOMAIN.into(),
        inputs: vec![Some(mask), Some(position)],
        implicit_inputs: 0,
        outputs: vec![Some(next_mask), Some(next_position)],
        attributes: Vec::new(),
    });
    let opset = model.opsets.entry(KILN_DOMAIN.into()).or_insert(KILN_OPSET);
    *opset = (*opset).max(KILN_OPSET);
    Some(names)
}

/// Appends a typed value to `g`; returns its id.
fn add(g: &mut Graph, name: &str, dtype: DType, dims: Vec<Dim>) -> ValueId {
    g.values.push(Value {
        name: name.to_string(),
        ty: Some(ValueType { dtype, dims: Some(dims), kind: Default::default() }),
    });
    g.values.len() - 1
}

/// The buffers of device-sampled steps for one batch shape: the tokens to feed (`[batch, 1]`
/// int64, rewritten by each step with the tokens it chose), the attention mask (`[batch,
/// limit]` int64), the position (`[1]` int64) and, for the Sample node, each row's tokens by
/// mask column (`[batch, limit]` int64), sampling parameters (`[batch, 4]` float32) and seeds
/// (`[batch, 3]` int64). Kept between generations of the same shape, so their addresses (and
/// a captured step's graph) stay valid.
pub struct StepBuffers {
    pub batch: usize,
    pub limit: usize,
    /// The cache length the buffers are ready for (the next step's `KvCache::len`); a step of
    /// a cache at another length is refused.
    pub at: usize,
    /// Whether the steps since the last [`StepBuffers::start`] sample (the Sample node) rather
    /// than take the argmax.
    pub sampling: bool,
    pub ids: DeviceTensor,
    pub mask: DeviceTensor,
    pub position: DeviceTensor,
    /// `history`, `sampling`, `seeds`, when the graph has a Sample node.
    pub sample: Option<[DeviceTensor; 3]>,
}

/// What the first sampled step needs beyond the greedy step's inputs.
pub struct SampleStart<'a> {
    /// `[batch, limit]`: each row's tokens at their mask columns (the prompt, then the first
    /// generated token); zeros elsewhere.
    pub history: &'a [i64],
    /// `[batch, 4]`: temperature (0: greedy), top_k (0: all), top_p, repetition_penalty.
    pub params: &'a [f32],
    /// `[batch, 3]`: seed, the position whose draw is step 0, and the Philox stream (the row of
    /// a batch of prompts; 0 for every request of a continuous batch).
    pub seeds: &'a [i64],
}

/// A row's first-step inputs for running step buffers: a sequence that joins a continuous batch
/// while steps of the other rows go on.
pub struct StepRow<'a> {
    pub row: usize,
    /// The token the next step feeds (the row's last).
    pub token: i64,
    /// `[limit]`: the row's mask, its length in set columns all below the next step's position.
    pub mask: &'a [i64],
    /// `[limit]`, `[4]`, `[3]`: the row's history, sampling parameters and seeds (seed, step-0
    /// position, stream), when the steps sample.
    pub sample: Option<(&'a [i64], [f32; 4], [i64; SEED_WORDS])>,
}

impl StepBuffers {
    /// New buffers (contents set by [`StepBuffers::start`]); `sample`: with the Sample node's.
    pub fn new(session: &mut Session, batch: usize, limit: usize, sample: bool) -> Result<StepBuffers> {
        let mut shapes = vec![(DType::I64, vec![batch, 1]), (DType::I64, vec![batch, limit]), (DType::I64, vec![1])];
        if sample {
            shapes.extend([
                (DType::I64, vec![batch, limit]),
                (DType::F32, vec![batch, 4]),
                (DType::I64, vec![batch, SEED_WORDS]),
            ]);
        }
        let made = shapes.into_iter().map(|(dtype, shape)| session.zeros(dtype, shape)).collect::<Result<Vec<_>>>()?;
        let mut it = made.into_iter();
        let mut next = || it.next().ok_or_else(|| Error::Device("a step buffer went missing".into()));
        let (ids, mask, position) = (next()?, next()?, next()?);
        let sample = if sample { Some([next()?, next()?, next()?]) } else { None };
        Ok(StepBuffers { batch, limit, at: usize::MAX, sampling: false, ids, mask, position, sample })
    }

    /// Sets the first step's inputs: `tokens` (one per row), the full-width `mask` with the
    /// first step's column already set, and `position`, the column the step after it takes
    /// (the cache is then `position − 1` long); `sample`: the steps sample (else they take
    /// the argmax). Errors: sizes that do not match the buffers, or sampling without the
    /// Sample node's buffers.
    pub fn start(
        &mut self,
        session: &mut Session,
        tokens: &[i64],
        mask: &[i64],
        position: usize,
        sample: Option<SampleStart<'_>>,
    ) -> Result<()> {
        let (b, l) = (self.batch, self.limit);
        let sizes_ok = sample
            .as_ref()
            .is_none_or(|s| s.history.len() == b * l && s.params.len() == b * 4 && s.seeds.len() == b * SEED_WORDS);
        if tokens.len() != b || mask.len() != b * l || !sizes_ok {
            return Err(Error::Input(format!(
                "{} tokens and {} mask entries (or sampling inputs of other sizes) for a batch of {b} and {l} positions",
                tokens.len(),
                mask.len(),
            )));
        }
        self.at = usize::MAX;
        session.write_tensor(&self.ids, &super::i64_tensor(vec![b, 1], tokens)?)?;
        session.write_tensor(&self.mask, &super::i64_tensor(vec![b, l], mask)?)?;
        session.write_tensor(&self.position, &super::i64_tensor(vec![1], &[position as i64])?)?;
        self.sampling = sample.is_some();
        if let Some(s) = sample {
            let Some([history, params, seeds]) = &self.sample else {
                return Err(Error::Input("this model's decode graph has no Sample node".into()));
            };
            session.write_tensor(history, &super::i64_tensor(vec![b, l], s.history)?)?;
            session.write_tensor(params, &super::f32_tensor(vec![b, 4], s.params)?)?;
            session.write_tensor(seeds, &super::i64_tensor(vec![b, SEED_WORDS], s.seeds)?)?;
        }
        self.at = position - 1;
        Ok(())
    }

    /// Rewrites single rows of running buffers (stream-ordered after the steps already
    /// enqueued, which keep the other rows' state on the device), and with `position` moves
    /// the next step's position forward for every row, `seeds` (`[batch, 3]`) then giving every
    /// row's seeds again. Errors: a row or size that does not fit the buffers, a position
    /// behind the current one or at the end, sampling rows for greedy steps, or buffers not started.
    pub fn write_rows(
        &mut self,
        session: &mut Session,
        rows: &[StepRow<'_>],
        position: Option<(usize, &[i64])>,
    ) -> Result<()> {
        let (b, l) = (self.batch, self.limit);
        if self.at == usize::MAX {
            return Err(Error::Input("write_rows on step buffers that are not started".into()));
        }
        if let Some(r) = rows.iter().find(|r| r.row >= b || r.mask.len() != l || r.sample.is_some() != self.sampling) {
            return Err(Error::Input(format!(
                "row {} of {} mask entries ({}) for step buffers of {b} rows × {l} positions{}",
                r.row,
                r.mask.len(),
                if r.sample.is_some() { "sampling" } else { "greedy" },
                if self.sampling { " that sample" } else { "" }
            )));
        }
        if let Some((p, seeds)) = position {
            if p <= self.at + 1 || p >= l || seeds.len() != b * SEED_WORDS {
                return Err(Error::Input(format!(
                    "position {p} with {} seeds for step buffers at {} of {l} positions, {b} rows",
                    seeds.len(),
                    self.at + 1
                )));
            }
        }
        let at = std::mem::replace(&mut self.at, usize::MAX);
        for r in rows {
            session.write_elements(&self.ids, r.row, &super::i64_tensor(vec![1], &[r.token])?)?;
            session.write_elements(&self.mask, r.row * l, &super::i64_tensor(vec![l], r.mask)?)?;
            if let (Some((history, params, seeds)), Some([h, p, s])) = (r.sample, &self.sample) {
                session.write_elements(h, r.row * l, &super::i64_tensor(vec![l], history)?)?;
                session.write_elements(p, r.row * 4, &super::f32_tensor(vec![4], &params)?)?;
                session.write_elements(s, r.row * SEED_WORDS, &super::i64_tensor(vec![SEED_WORDS], &seeds)?)?;
            }
        }
        self.at = match position {
            Some((p, seeds)) => {
                session.write_elements(&self.position, 0, &super::i64_tensor(vec![1], &[p as i64])?)?;
                if let (true, Some([_, _, s])) = (self.sampling, &self.sample) {
                    session.write_elements(s, 0, &super::i64_tensor(vec![b, SEED_WORDS], seeds)?)?;
                }
                p - 1
            }
            None => at,
        };
        Ok(())
    }
}

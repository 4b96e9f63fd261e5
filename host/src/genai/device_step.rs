//! Decode steps that sample on the device, so that only token ids cross to the host and a step
//! has the same buffers every time (the condition of replaying it as one CUDA graph).
//!
//! [`augment`] appends two nodes to the decoder graph, from packages like every other node:
//! - `ArgMax(logits, axis = -1, keepdims = 0)` → `kiln_next_input_ids` `[batch, 1]` int64: the
//!   greedy token of every row, written into the step's `input_ids` buffer (first index on ties,
//!   as the host's argmax);
//! - `ai.kiln::AppendAttentionMask(attention_mask, kiln_position)` → the mask with the next
//!   column set in every row, and the position advanced: written into the step's own mask and
//!   position buffers, so the next step's `seqlens_k` is computed inside the graph.
//!
//! The host knows only the folder's input and output names (`genai_config.json`), never the
//! model's arithmetic. Prefill runs skip the appended outputs (`Fetch::Skip`), so their nodes
//! do not run there.

use kiln_kernel_abi::DType;
use kiln_registry::{NodeQuery, OpRegistry};

use super::GenaiConfig;
use crate::ep::{DeviceTensor, Session};
use crate::model::{AttrValue, Dim, Model, Node, Value, ValueType};
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
}

/// The domain of kiln's own decode-step ops (package `kiln-sampling`).
pub const KILN_DOMAIN: &str = "ai.kiln";

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
    if !resolves("", "ArgMax", onnx_opset, logits_dtype) || !resolves(KILN_DOMAIN, "AppendAttentionMask", 1, DType::I64)
    {
        return None;
    }
    let names = StepNames {
        position: "kiln_position".into(),
        next_ids: "kiln_next_input_ids".into(),
        next_mask: "kiln_next_attention_mask".into(),
        next_position: "kiln_next_position".into(),
    };
    if [&names.position, &names.next_ids, &names.next_mask, &names.next_position]
        .iter()
        .any(|n| g.value_id(n).is_some())
    {
        return None;
    }
    let g = &mut model.graph;
    let mut add = |name: &str, dtype: DType, dims: Vec<Dim>| {
        g.values.push(Value { name: name.to_string(), ty: Some(ValueType { dtype, dims: Some(dims) }) });
        g.values.len() - 1
    };
    let sym = |s: &str| Dim::Symbolic(s.to_string());
    let position = add(&names.position, DType::I64, vec![Dim::Known(1)]);
    let next_ids = add(&names.next_ids, DType::I64, vec![sym("batch_size"), sym("sequence_length")]);
    let next_mask = add(&names.next_mask, DType::I64, vec![sym("batch_size"), sym("total_sequence_length")]);
    let next_position = add(&names.next_position, DType::I64, vec![Dim::Known(1)]);
    g.nodes.push(Node {
        name: "kiln/ArgMax".into(),
        op_type: "ArgMax".into(),
        domain: String::new(),
        inputs: vec![Some(logits)],
        outputs: vec![Some(next_ids)],
        attributes: vec![("axis".into(), AttrValue::Int(-1)), ("keepdims".into(), AttrValue::Int(0))],
    });
    g.nodes.push(Node {
        name: "kiln/AppendAttentionMask".into(),
        op_type: "AppendAttentionMask".into(),
        domain: KILN_DOMAIN.into(),
        inputs: vec![Some(mask), Some(position)],
        outputs: vec![Some(next_mask), Some(next_position)],
        attributes: Vec::new(),
    });
    g.inputs.push(position);
    g.outputs.extend([next_ids, next_mask, next_position]);
    model.opsets.insert(KILN_DOMAIN.into(), 1);
    Some(names)
}

/// The buffers of device-sampled decode steps for one batch shape: the tokens to feed
/// (`[batch, 1]` int64, rewritten by each step with the tokens it chose), the attention mask
/// (`[batch, limit]` int64) and the position (`[1]` int64). Kept between generations of the
/// same shape, so their addresses (and a captured step's graph) stay valid.
pub struct StepBuffers {
    pub batch: usize,
    pub limit: usize,
    /// The cache length the buffers are ready for (the next step's `KvCache::len`); a step of
    /// a cache at another length is refused.
    pub at: usize,
    pub ids: DeviceTensor,
    pub mask: DeviceTensor,
    pub position: DeviceTensor,
}

impl StepBuffers {
    /// New buffers (contents set by [`StepBuffers::start`]).
    pub fn new(session: &mut Session, batch: usize, limit: usize) -> Result<StepBuffers> {
        let ids = session.zeros(DType::I64, vec![batch, 1])?;
        let mask = match session.zeros(DType::I64, vec![batch, limit]) {
            Ok(t) => t,
            Err(e) => {
                session.free_tensor(ids);
                return Err(e);
            }
        };
        let position = match session.zeros(DType::I64, vec![1]) {
            Ok(t) => t,
            Err(e) => {
                session.free_tensor(ids);
                session.free_tensor(mask);
                return Err(e);
            }
        };
        Ok(StepBuffers { batch, limit, at: usize::MAX, ids, mask, position })
    }

    /// Sets the first step's inputs: `tokens` (one per row), the full-width `mask` with the
    /// first step's column already set, and `position`, the column the step after it takes
    /// (the cache is then `position − 1` long).
    pub fn start(&mut self, session: &mut Session, tokens: &[i64], mask: &[i64], position: usize) -> Result<()> {
        if tokens.len() != self.batch || mask.len() != self.batch * self.limit {
            return Err(Error::Input(format!(
                "{} tokens and {} mask entries for a batch of {} and {} positions",
                tokens.len(),
                mask.len(),
                self.batch,
                self.limit
            )));
        }
        self.at = usize::MAX;
        session.write_tensor(&self.ids, &super::i64_tensor(vec![self.batch, 1], tokens)?)?;
        session.write_tensor(&self.mask, &super::i64_tensor(vec![self.batch, self.limit], mask)?)?;
        session.write_tensor(&self.position, &super::i64_tensor(vec![1], &[position as i64])?)?;
        self.at = position - 1;
        Ok(())
    }

    /// Gives the buffers back to the session.
    pub fn free(self, session: &mut Session) {
        session.free_tensor(self.ids);
        session.free_tensor(self.mask);
        session.free_tensor(self.position);
    }
}

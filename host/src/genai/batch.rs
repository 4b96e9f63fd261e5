//! Continuous batching: sequences join and leave one running decode batch between steps, as
//! vLLM and onnxruntime-genai's server loops run them, on the graph buckets.
//!
//! A batch has `capacity` slots (the sequences it may hold at once; a sequence keeps its slot
//! number from join to end) and runs its steps over the running sequences' rows only: the rows
//! follow the load, to the running sequences' bucket on a GPU (1, 2, 4, …) and to their number
//! on the CPU. They grow when a join needs more free rows (or starts an empty batch), and
//! shrink once at most a quarter of them carry a sequence (on a GPU, for
//! [`SHRINK_AFTER_STEPS`] steps in a row; on the CPU as soon as fewer rows would do). With
//! `--batch-invariant` the rows stay at `capacity`, since another row count changes the
//! steps' GEMM shapes.
//!
//! The KV cache is shared by the rows (`[rows, kv_heads, limit, head_size]` per layer). On a
//! GPU the addresses of every slot's cache are reserved once (VMM), `limit` = `max_length`, and
//! the cache of `n` rows is its first `n` rows (views of the same buffers): every row count has
//! the same addresses, so each count's captured graph stays valid. Only the rows run are mapped,
//! so memory follows the load, bounded by `capacity`. Growing maps rows and moves nothing;
//! shrinking compacts the running rows' KV to the front (device-to-device copies of their
//! filled positions), and the rows past them are unmapped [`UNMAP_AFTER_STEPS`] steps later. On the CPU a move is a new cache, and
//! its `limit` follows the sequences too ([`CPU_MIN_LIMIT`]). The generator keeps each row
//! count's device-step buffers; a move rewrites them.
//!
//! Sequences join free rows by a prefill of their prompts (together, or each alone when
//! batch-invariant; on a GPU padded to a few shapes) whose KV rows are copied into the cache
//! (device-to-device copies); each first token is sampled on the host from the prefill's
//! logits. Every step then decodes every row at once, as one device-sampled step (one CUDA
//! graph replay once captured): the tokens come back, finished sequences free their rows and
//! slots, and free rows keep stepping harmlessly on a one-token sequence of padding.
//!
//! Rows are independent in the step's graph: GroupQueryAttention reads each row's own length
//! from its mask (`seqlens_k` = the mask's sum − 1), so a row's mask needs only the right
//! number of set columns, not a column shared with the other rows. A join writes only its own
//! rows of the step buffers (token, mask, history, sampling parameters, seeds), stream-ordered
//! after the step in flight: its mask row has the sequence's length in set columns below the
//! shared next column (`kiln_position`), which moves forward for every row when the joined
//! sequence is longer. When that column reaches the cache's end (or after a failed step or a
//! move), the host rewrites every row compacted: each row's tokens at columns `0 .. len`, and
//! the next column at the longest length (also when a join finds no room to write its rows in
//! place). A sequence's Philox draws stay keyed by (seed, stream 0, tokens generated) across
//! moves and rewrites, whatever its slot or row, as a single prompt's are.
//!
//! On a GPU steps run one ahead, as `Generator::generate`'s do: step k + 1 is enqueued before
//! step k's tokens are read, so the GPU computes while the host hands tokens out. Each enqueued
//! step remembers every row's occupant (an epoch that a join advances), so a token computed for
//! a sequence that has since left its row is dropped, never given to the row's next sequence.
//! A join's prefill, KV copy and row writes are stream-ordered after the step in flight, so
//! steps stay one ahead across joins, except a join that moves the rows: the step in flight is
//! read first, and its tokens come with the next [`ContinuousBatch::step`]. The joins' prefills
//! are padded to a few shapes (rows to a power of two, lengths to a multiple of
//! [`PREFILL_LENGTH_STEP`]), whose node dispatches the session has memoized. On the CPU a step
//! runs when enqueued, so nothing runs ahead.

use kiln_kernel_abi::sampling::SEED_WORDS;

use super::device_step::{SampleStart, StepRow};
use super::kv::{self, KvCache};
use super::{bucket, Generator, Sampler, SamplingParams, StopReason};
use crate::{Error, Result};

/// On the CPU the cache holds as many positions as the running sequences need (twice the
/// longest, rounded up to a power of two, at least this many, at most `max_length`): it grows
/// when the longest sequence outgrows it, and shrinks at a rewrite of every row once it is over
/// four times too long, so its memory follows the sequences (a step appends in the past's own
/// buffer, ABI.md §7.8, and copies none of it). On a GPU the cache is `max_length` long from the
/// start, so its addresses never move (graphs).
pub const CPU_MIN_LIMIT: usize = 128;

/// On a GPU the rows shrink only after this many steps in a row could have run on a quarter of
/// them: a wave of requests ending together and the next wave joining (a server's clients
/// sending their next requests) should not shrink and then grow the rows, each shrink costing
/// its KV copies and each move a rewrite. On the CPU, where a step costs far more than a move,
/// they shrink at once.
const SHRINK_AFTER_STEPS: u32 = 32;

/// On a GPU the KV rows past the running ones stay mapped until the rows have been fewer for
/// this many steps in a row (about two seconds of decode): a wave of requests that regrows the
/// rows finds them mapped, since mapping costs driver calls per cache tensor and unmapping a
/// synchronization of the device.
const UNMAP_AFTER_STEPS: u32 = 2048;

/// Prefill lengths of joining sequences on a GPU are padded to a multiple of this.
pub const PREFILL_LENGTH_STEP: usize = 64;

/// The Philox stream of every sequence's draws (kernel-abi's `philox::uniform` row word): the
/// same for each, so a sequence's draws depend on its seed alone, never on its slot, as a
/// single prompt's do in `Generator::generate`.
const STREAM: usize = 0;

/// One running decode batch of at most [`ContinuousBatch::capacity`] sequences.
pub struct ContinuousBatch {
    /// The cache the steps run over: on a GPU the first `rows` rows of `full` (views of its
    /// buffers); on the CPU its own buffers.
    kv: KvCache,
    /// On a GPU, the cache of every slot, allocated once: each row count's cache is its first
    /// rows, at the same addresses, so the memory is bounded by `capacity` and the captured
    /// graphs of every row count stay valid.
    full: Option<KvCache>,
    /// The cache's rows: a sequence each, or padding.
    rows: Vec<Row>,
    /// Slots: the most sequences at once (the rows at their most).
    capacity: usize,
    /// Whether the rows follow the load (not when batch-invariant).
    follow: bool,
    /// Tokens of a step read early, before the rows moved for a join: the next
    /// [`ContinuousBatch::step`] returns them first.
    drained: Vec<Emitted>,
    /// Steps in a row whose sequences would have fit a quarter of the rows.
    low_steps: u32,
    /// On a GPU, the rows of `full` mapped (at least the rows run; more after a shrink, until
    /// [`UNMAP_AFTER_STEPS`]).
    mapped: usize,
    /// On a GPU with a paged cache, the most positions the rows have mapped for since the last
    /// trim (the steps map every row to the shared column).
    mapped_positions: usize,
    /// Steps in a row with more rows (or, paged, over twice the positions) mapped than run.
    surplus_steps: u32,
    /// The step buffers no longer match the rows (before the first step, after a failed step
    /// or write): rewrite every row before the next step.
    dirty: bool,
    /// Whether steps run the Sample node (every row with its own parameters; greedy rows at
    /// temperature 0) rather than ArgMax (greedy rows only).
    sampling: bool,
    /// Each join prefills alone ([`ContinuousBatch::set_batch_invariant`]).
    invariant: bool,
    /// Most positions of a sequence (prompt and generated), at most the cache's `limit`.
    max_length: usize,
    vocab: usize,
    pad: i64,
    eos: Vec<i64>,
    /// Whether the batch runs on a GPU (a fixed cache, steps one ahead).
    on_gpu: bool,
    stats: BatchStats,
    /// The step enqueued ahead: its token read, and each row's epoch when it was enqueued.
    ahead: Option<(crate::ep::PendingRead, Vec<u64>)>,
}

/// What a batch has done, for reports and `/metrics`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Decode steps (each decodes every row).
    pub steps: u64,
    /// Sequences that joined.
    pub joins: u64,
    /// Rewrites of the step buffers from the host (after joins, failed steps, compactions).
    pub rewrites: u64,
    /// Rewrites because the shared mask column reached the cache's end.
    pub compactions: u64,
    /// Row-count changes (the rows following the load).
    pub transitions: u64,
    /// Joins whose rows were written into the running step buffers (no rewrite of every row).
    pub joined_in_place: u64,
    /// Of those, joins that moved the shared mask column forward (a longer sequence).
    pub moves: u64,
    /// Reallocations of the cache to another length (the CPU's cache follows the sequences).
    pub resizes: u64,
}

/// One row of the cache: a sequence's tokens (the last is the one the next step feeds) and,
/// while a sequence holds it, that sequence's state.
struct Row {
    tokens: Vec<i64>,
    /// Set columns of the row's mask: the sequence's length (a free row's grows too).
    len: usize,
    seq: Option<Sequence>,
    /// Advanced by every join: a step enqueued before it carried another occupant.
    epoch: u64,
    /// The row's step-0 position in the seeds buffer: the draw at mask column `c` is the
    /// sequence's token `c − seed_base`.
    seed_base: i64,
}

impl Row {
    /// A row of padding (one token).
    fn free(pad: i64) -> Row {
        Row { tokens: vec![pad], len: 1, seq: None, epoch: 0, seed_base: 0 }
    }

    /// Sets the row's mask and history rows (`limit` columns, zeros): its tokens at columns
    /// `0 .. len`.
    fn fill_rows(&self, mask: &mut [i64], history: &mut [i64]) {
        mask[..self.len].fill(1);
        history[..self.len].copy_from_slice(&self.tokens);
    }

    /// Keys the row's draws for steps from mask column `next` on: the draw at `next + k` is
    /// its sequence's token `generated + k`.
    fn rebase(&mut self, next: usize) {
        self.seed_base = next as i64 - self.seq.as_ref().map_or(0, |q| q.generated) as i64;
    }

    /// The row's entry of the sampling-parameter buffer (`greedy` for a free row).
    fn device_params(&self, vocab: usize, greedy: [f32; 4]) -> [f32; 4] {
        self.seq.as_ref().map_or(greedy, |q| q.sampler.device_row(vocab))
    }
}

struct Sequence {
    /// Its slot number, from join to end.
    slot: usize,
    generated: usize,
    max_new_tokens: usize,
    ignore_eos: bool,
    sampler: Sampler,
}

/// A token a step (or a join's prefill) chose for the sequence in `slot`; `finished`: the
/// sequence ended with it, and the slot is free again (once this token has been returned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Emitted {
    pub slot: usize,
    pub token: i64,
    pub finished: Option<StopReason>,
}

/// Why a batch cannot take a sequence's sampling parameters: the request field to change (when
/// one is) and what to change it to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub param: Option<&'static str>,
    pub message: String,
}

/// A sequence to add: its prompt (token ids), sampling parameters and limits.
#[derive(Clone, Debug)]
pub struct Join<'a> {
    pub prompt: &'a [i64],
    pub sampling: &'a SamplingParams,
    pub max_new_tokens: usize,
    /// Keep going past an end-of-sequence token.
    pub ignore_eos: bool,
}

impl ContinuousBatch {
    /// An empty batch of `rows` slots (on a GPU, the bucket of `rows`: 1, 2, 4, 8, 16, 32, then
    /// multiples of 32) for sequences of at most `max_length` positions (default: the folder's
    /// `search.max_length`). On a GPU the addresses of every slot's cache are reserved here and
    /// the rows in use are mapped as sequences join (a join that would pass the device-memory
    /// limit fails then, with [`Error::OutOfMemory`]). Errors: a folder without a shared KV
    /// buffer or device-step packages, a length over the model's context, or device memory.
    pub fn new(g: &mut Generator, rows: usize, max_length: Option<usize>) -> Result<ContinuousBatch> {
        let cfg = g.folder.config.clone();
        let max_length = cfg.checked_max_length(max_length)?;
        if !cfg.search.past_present_share_buffer {
            return Err(Error::Unsupported(
                "continuous batching needs a folder with search.past_present_share_buffer".into(),
            ));
        }
        let greedy = SamplingParams::default();
        let on_gpu = g.on_gpu();
        g.device_sampler(&greedy, on_gpu).map_err(|why| Error::Unsupported(format!("continuous batching: {why}")))?;
        // The Sample node, unless the GPU's sampler cannot take this vocabulary (then greedy
        // requests only, through ArgMax).
        let vocab = cfg.model.vocab_size;
        let sampling = g.has_device_sample() && !(on_gpu && vocab > kiln_kernel_abi::sampling::DEVICE_MAX_VOCAB);
        let capacity = if on_gpu { bucket(rows) } else { rows.max(1) };
        let limit = if on_gpu { max_length } else { max_length.min(CPU_MIN_LIMIT) };
        let d = &cfg.model.decoder;
        let row = d.num_key_value_heads * limit * d.head_size;
        // On a GPU the rows start at one (a join moves them to its own) and only the rows in
        // use are mapped; on the CPU they start at every slot's.
        let rows = if on_gpu { 1 } else { capacity };
        let dims = g.kv_dims();
        let kv = kv::empty(&mut g.session, &dims, capacity, limit, rows).map_err(|e| {
            let bytes = 2 * d.num_hidden_layers * capacity * row * g.folder.kv_dtype.size().unwrap_or(2);
            Error::Input(format!(
                "a KV cache of {capacity} rows × {limit} positions ({:.2} GiB) could not be {}: {e}",
                bytes as f64 / (1u64 << 30) as f64,
                if on_gpu { "reserved" } else { "allocated" }
            ))
        })?;
        let pad = cfg.model.pad_token_id.unwrap_or(0);
        let (kv, full) = match on_gpu {
            true => (kv::first_rows(&mut g.session, &dims, &kv, rows)?, Some(kv)),
            false => (kv, None),
        };
        Ok(ContinuousBatch {
            kv,
            full,
            rows: (0..rows).map(|_| Row::free(pad)).collect(),
            capacity,
            follow: true,
            drained: Vec::new(),
            low_steps: 0,
            mapped: rows,
            mapped_positions: 1,
            surplus_steps: 0,
            dirty: true,
            sampling,
            invariant: false,
            max_length,
            vocab,
            pad,
            eos: cfg.model.eos_token_id.to_vec(),
            on_gpu,
            stats: BatchStats::default(),
            ahead: None,
        })
    }

    /// With `on`, a sequence's tokens do not depend on what else is in the batch: each join
    /// prefills alone (at [`ContinuousBatch::prefill_shape`] of one row), rather than with the
    /// sequences joining beside it, whose number would change the prefill's matrix shapes
    /// (and, on a GPU, the GEMM algorithms and their rounding), and the steps keep every slot's
    /// row (the rows do not follow the load, which would change the steps' shapes). Every row's
    /// arithmetic is apart from the others', and each sequence draws from its own seed's
    /// stream. The cost: one prefill per join, and every step at `capacity` rows.
    pub fn set_batch_invariant(&mut self, on: bool) {
        self.invariant = on;
        self.follow = !on;
    }

    /// Slots: the most sequences the batch holds at once.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Rows the steps decode now (on a GPU, their graph bucket).
    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    /// Sequences in the batch.
    pub fn active(&self) -> usize {
        self.rows.iter().filter(|r| r.seq.is_some()).count()
    }

    /// What the batch has done so far.
    pub fn stats(&self) -> BatchStats {
        self.stats
    }

    /// Most positions of one sequence (prompt and generated).
    pub fn max_length(&self) -> usize {
        self.max_length
    }

    /// Adds a sequence to a free slot: prefills its prompt and chooses its first token.
    /// Returns that token, which may already end the sequence (the slot is then free).
    /// Errors: no free slot, an empty prompt or one of `max_length` tokens or more, sampling the
    /// device cannot do (named), or the prefill's failure (the batch's other sequences go on).
    pub fn join(&mut self, g: &mut Generator, join: Join<'_>) -> Result<Emitted> {
        let mut e = self.join_many(g, &[join])?;
        e.pop().ok_or_else(|| Error::Model("the prefill returned no logits".into()))
    }

    /// Adds several sequences at once, to the lowest free slots in order: one prefill of their
    /// prompts together (right-padded, as `Generator::prefill` pads a batch, to
    /// [`ContinuousBatch::prefill_shape`]), or one each when batch-invariant, each KV row copied
    /// into a free row (the rows grow first when too few are free); their rows of the running
    /// step buffers are then written in place. Returns each one's first token, in the order
    /// given. Errors: as [`ContinuousBatch::join`] (the first bad sequence named by its index),
    /// or a device error writing the rows; nothing joins then (the rows may have moved, and a
    /// step in flight may have been read: its tokens come with the next step).
    pub fn join_many(&mut self, g: &mut Generator, joins: &[Join<'_>]) -> Result<Vec<Emitted>> {
        let free_slots = self.free_slots();
        if joins.len() > free_slots.len() {
            return Err(Error::Input(format!(
                "{} sequences for {} free slots of {}",
                joins.len(),
                free_slots.len(),
                self.capacity
            )));
        }
        for (i, j) in joins.iter().enumerate() {
            if j.prompt.is_empty() || j.prompt.len() >= self.max_length {
                return Err(Error::Input(format!(
                    "sequence {i}: the prompt has {} tokens; it needs 1 to {} (max_length {})",
                    j.prompt.len(),
                    self.max_length - 1,
                    self.max_length
                )));
            }
            self.admits(g, j.sampling).map_err(|r| Error::Unsupported(format!("sequence {i}: {}", r.message)))?;
        }
        if joins.is_empty() {
            return Ok(Vec::new());
        }
        // On the CPU an empty batch starts over with a rewrite of every row, at which its cache
        // shrinks back to what the new sequences need.
        if !self.on_gpu && self.active() == 0 {
            self.dirty = true;
        }
        // Too few free rows (whether or not the rows follow the load: a batch made invariant
        // after it shrank grows back to every slot's row), or an empty batch whose rows follow
        // the load (they start at the joins' own): the step in flight is read (its tokens go out
        // with the next step), and the rows move.
        let free_rows = self.rows.iter().filter(|r| r.seq.is_none()).count();
        if joins.len() > free_rows || (self.follow && self.active() == 0) {
            self.drain(g)?;
            let want = match self.follow {
                true => self.rows_for(self.active() + joins.len()),
                false => self.capacity,
            };
            self.transition(g, want)?;
        }
        // The CPU's cache grows first when a prompt needs more room than it has.
        let longest_prompt = joins.iter().map(|j| j.prompt.len()).max().unwrap_or(1);
        if longest_prompt + 1 >= self.kv.limit && self.fit(g, longest_prompt + 1)? {
            self.dirty = true;
        }
        let free: Vec<usize> = (0..self.rows.len()).filter(|&r| self.rows[r].seq.is_none()).collect();
        let prompts: Vec<Vec<i64>> = joins.iter().map(|j| j.prompt.to_vec()).collect();
        let dims = g.kv_dims();
        // The rows a join fills have its prompt's positions mapped (a paged cache maps every row
        // to the shared column, which a longer joined sequence moves forward).
        if let Some(full) = &self.full {
            let positions = (self.kv.total + 1).max(longest_prompt + 1);
            let rows = kv::fit(&mut g.session, &dims, full, self.rows.len(), positions, false)?;
            self.mapped = self.mapped.max(rows);
            self.mapped_positions = self.mapped_positions.max(positions);
        }
        // One prefill of them all, or (batch-invariant) one each, so that a sequence's prefill
        // never depends on who joined with it.
        let group = if self.invariant { 1 } else { prompts.len() };
        let mut logits = Vec::with_capacity(prompts.len());
        for (n, chunk) in prompts.chunks(group).enumerate() {
            let longest = chunk.iter().map(Vec::len).max().unwrap_or(1);
            let at_least = Self::prefill_shape(g.on_gpu(), chunk.len(), longest);
            let (scratch, l) = g.prefill_padded(chunk, self.kv.limit, at_least)?;
            // Each prompt's positions go to its row (the rest of the prefill's are padding).
            let moves: Vec<(usize, usize, usize)> =
                chunk.iter().enumerate().map(|(i, p)| (i, free[n * group + i], p.len())).collect();
            let copied = kv::copy_rows(&mut g.session, &dims, &scratch, &self.kv, &moves);
            g.free(scratch);
            copied?;
            logits.extend(l);
        }
        if logits.len() != joins.len() {
            return Err(Error::Model(format!(
                "the prefill returned {} rows of logits for {}",
                logits.len(),
                joins.len()
            )));
        }
        let mut out = Vec::with_capacity(joins.len());
        for (((j, l), &r), &slot) in joins.iter().zip(&logits).zip(&free).zip(&free_slots) {
            let sampler = Sampler::new(j.sampling.clone());
            let first = sampler.next(l, j.prompt, STREAM, 0);
            let mut tokens = j.prompt.to_vec();
            tokens.push(first);
            let row = &mut self.rows[r];
            row.len = tokens.len();
            row.tokens = tokens;
            row.epoch += 1;
            row.seq = Some(Sequence {
                slot,
                generated: 1,
                max_new_tokens: j.max_new_tokens.max(1),
                ignore_eos: j.ignore_eos,
                sampler,
            });
            self.stats.joins += 1;
            let finished = self.finished(r, first);
            out.push(Emitted { slot, token: first, finished });
        }
        // Sequences that ended on their first token hold no row: nothing to write for them.
        let running: Vec<usize> = free[..joins.len()].iter().copied().filter(|&r| self.rows[r].seq.is_some()).collect();
        if !self.dirty && !running.is_empty() {
            match self.write_joined(g, &running) {
                Ok(()) => {}
                // No room before the cache's end: the next step compacts every row.
                Err(Error::Input(why)) => {
                    tracing::debug!("joined rows not written in place ({why}); the next step rewrites every row");
                    self.dirty = true;
                }
                // A device error: the sequences do not join, and the next step rewrites (or fails).
                Err(e) => {
                    for &r in &running {
                        self.rows[r].seq = None;
                    }
                    self.dirty = true;
                    return Err(e);
                }
            }
        }
        Ok(out)
    }

    /// Slot numbers no sequence holds, lowest first. A slot whose sequence ended in a step read
    /// early stays taken until [`ContinuousBatch::step`] has returned that end.
    fn free_slots(&self) -> Vec<usize> {
        let mut taken = vec![false; self.capacity];
        let held = self.rows.iter().filter_map(|r| r.seq.as_ref().map(|q| q.slot));
        for slot in held.chain(self.drained.iter().filter(|e| e.finished.is_some()).map(|e| e.slot)) {
            if let Some(t) = taken.get_mut(slot) {
                *t = true;
            }
        }
        (0..self.capacity).filter(|&s| !taken[s]).collect()
    }

    /// Rows for `sequences` running sequences: their bucket on a GPU, their number on the CPU,
    /// at most `capacity`.
    fn rows_for(&self, sequences: usize) -> usize {
        let n = sequences.max(1);
        (if self.on_gpu { bucket(n) } else { n }).min(self.capacity)
    }

    /// The row count the next step should run at, when it differs from now: `capacity` when the
    /// rows do not follow the load, else the running sequences' rows once at most a quarter of
    /// the rows have carried one for [`SHRINK_AFTER_STEPS`] steps (on a GPU).
    fn rows_wanted(&self) -> Option<usize> {
        let now = self.rows.len();
        if !self.follow {
            return (self.capacity != now).then_some(self.capacity);
        }
        let want = self.rows_for(self.active());
        let shrink = match self.on_gpu {
            true => 4 * want <= now && self.low_steps >= SHRINK_AFTER_STEPS,
            false => want < now,
        };
        (want != now && shrink).then_some(want)
    }

    /// Reads the step in flight now, its tokens kept for the next [`ContinuousBatch::step`].
    fn drain(&mut self, g: &mut Generator) -> Result<()> {
        let Some((pending, epochs)) = self.ahead.take() else { return Ok(()) };
        match g.session.read_finish(pending).and_then(|t| t.to_i64()) {
            Ok(ids) => {
                let tokens = self.apply(&ids, &epochs);
                self.drained.extend(tokens);
                Ok(())
            }
            Err(e) => {
                self.dirty = true;
                Err(e)
            }
        }
    }

    /// Moves the running sequences to a cache of `n` rows (at least as many as they are), in
    /// row order: on a GPU the first `n` rows of the full cache (growing maps its rows and moves
    /// nothing; shrinking compacts the running rows' KV to the front within it, and the rows
    /// past them are unmapped [`UNMAP_AFTER_STEPS`] later), on the CPU a new cache. The step
    /// buffers are rewritten before the next step. Needs no step in flight. Errors: a step in
    /// flight, the growth's (the device-memory limit), the copies' or (CPU) the allocation's:
    /// the rows stay as they were then.
    fn transition(&mut self, g: &mut Generator, n: usize) -> Result<()> {
        if self.ahead.is_some() {
            return Err(Error::Device("the batch's rows cannot move while a step is in flight".into()));
        }
        let running: Vec<usize> = (0..self.rows.len()).filter(|&r| self.rows[r].seq.is_some()).collect();
        let n = n.max(running.len()).max(1);
        if n == self.rows.len() {
            return Ok(());
        }
        // Growing keeps every row where it is; shrinking compacts the running rows to the front.
        let grow = n > self.rows.len();
        let dims = g.kv_dims();
        let kv = match &self.full {
            Some(full) => {
                if grow {
                    let rows = kv::fit(&mut g.session, &dims, full, n, self.kv.total + 1, false)?;
                    self.mapped = self.mapped.max(rows);
                }
                kv::first_rows(&mut g.session, &dims, full, n)?
            }
            None => kv::empty(&mut g.session, &dims, n, self.kv.limit, n)?,
        };
        let to = |i: usize, r: usize| if grow { r } else { i };
        let moves: Vec<(usize, usize, usize)> =
            running.iter().enumerate().map(|(i, &r)| (r, to(i, r), self.rows[r].len)).collect();
        // Views of one buffer: rows in place stay, and a row never lands on one still to move
        // (compacting, row i < r is free or already moved).
        let moves: Vec<_> = moves.into_iter().filter(|&(r, i, _)| self.full.is_none() || r != i).collect();
        kv::copy_rows(&mut g.session, &dims, &self.kv, &kv, &moves)?;
        self.kv = kv;
        let mut rows: Vec<Row> = match grow {
            true => std::mem::take(&mut self.rows),
            false => running.into_iter().map(|r| std::mem::replace(&mut self.rows[r], Row::free(self.pad))).collect(),
        };
        rows.resize_with(n, || Row::free(self.pad));
        self.rows = rows;
        self.dirty = true;
        self.low_steps = 0;
        self.stats.transitions += 1;
        Ok(())
    }

    /// Whether more is mapped than the rows run need: rows past them, or (paged) over twice the
    /// positions of the shared column.
    fn surplus(&self) -> bool {
        let paged = self.full.as_ref().is_some_and(KvCache::is_paged);
        self.full.is_some()
            && (self.mapped > self.rows.len() || (paged && self.mapped_positions > 2 * (self.kv.total + 1)))
    }

    /// Whether the surplus has stayed mapped long enough to unmap it.
    fn unmap_wanted(&self) -> bool {
        self.surplus() && self.surplus_steps >= UNMAP_AFTER_STEPS
    }

    /// Writes the rows of just-joined `rows` into the running step buffers, stream-ordered
    /// after the step in flight, so that steps go on without a rewrite of every row: each
    /// joined row's mask has its length in set columns below the next step's position, which
    /// moves forward for every row when a joined sequence is longer. Errors: no room before
    /// the cache's end (a rewrite compacts the rows), or the writes'.
    fn write_joined(&mut self, g: &mut Generator, rows: &[usize]) -> Result<()> {
        let l = self.kv.limit;
        let longest = rows.iter().map(|&r| self.rows[r].len).max().unwrap_or(1);
        let mut next = self.kv.total + 1;
        let moved = longest.saturating_sub(next);
        if next + moved >= l {
            return Err(Error::Input(format!("{longest} positions after the shared column {next} of {l}")));
        }
        next += moved;
        for r in &mut self.rows {
            r.seed_base += moved as i64;
        }
        let mut rows_data = Vec::with_capacity(rows.len());
        for &r in rows {
            self.rows[r].rebase(next);
            let (mut mask, mut history) = (vec![0i64; l], vec![0i64; l]);
            self.rows[r].fill_rows(&mut mask, &mut history);
            rows_data.push((mask, history));
        }
        let seeds = self.seeds();
        let greedy = Sampler::new(SamplingParams::default()).device_row(self.vocab);
        let step_rows: Vec<StepRow<'_>> = rows
            .iter()
            .zip(&rows_data)
            .map(|(&r, (mask, history))| {
                let s = &self.rows[r];
                let sample = self.sampling.then(|| {
                    let mut seed = [0; SEED_WORDS];
                    seed.copy_from_slice(&seeds[r * SEED_WORDS..(r + 1) * SEED_WORDS]);
                    (history.as_slice(), s.device_params(self.vocab, greedy), seed)
                });
                StepRow { row: r, token: s.tokens.last().copied().unwrap_or(self.pad), mask, sample }
            })
            .collect();
        g.write_device_step_rows(&mut self.kv, &step_rows, (moved > 0).then_some((next, seeds.as_slice())))?;
        self.stats.joined_in_place += rows.len() as u64;
        self.stats.moves += u64::from(moved > 0);
        Ok(())
    }

    /// Every row's seed, step-0 position and stream (`[rows, 3]`), as the seeds buffer holds
    /// them.
    fn seeds(&self) -> Vec<i64> {
        self.rows
            .iter()
            .flat_map(|r| [r.seq.as_ref().map_or(0, |q| q.sampler.params.seed as i64), r.seed_base, STREAM as i64])
            .collect()
    }

    /// The least (rows, positions) a join's prefill of `rows` prompts, the longest `longest`
    /// tokens, is padded to: on a GPU rows to a power of two and positions to a multiple of
    /// `PREFILL_LENGTH_STEP` (64), so that prefills repeat a few shapes, whose node dispatches the
    /// session has memoized (a new shape costs every node's shim calls, milliseconds); on a CPU
    /// no padding (it would only add arithmetic). A sequence's first token comes from this
    /// padded prefill.
    pub fn prefill_shape(on_gpu: bool, rows: usize, longest: usize) -> (usize, usize) {
        match on_gpu {
            true => (rows.next_power_of_two(), longest.next_multiple_of(PREFILL_LENGTH_STEP)),
            false => (0, 0),
        }
    }

    /// Positions (rows × padded length) a join's prefill of `rows` prompts, the longest
    /// `longest` tokens, runs: what a server's prefill budget counts.
    pub fn prefill_positions(on_gpu: bool, rows: usize, longest: usize) -> usize {
        let (r, l) = Self::prefill_shape(on_gpu, rows, longest);
        r.max(rows) * l.max(longest)
    }

    /// Whether the batch's device sampler can choose tokens with `params`, or why not, in the
    /// request's own terms (the field to change, when one is).
    pub fn admits(&self, g: &Generator, params: &SamplingParams) -> std::result::Result<(), Refusal> {
        let greedy = params.is_greedy() && params.repetition_penalty == 1.0;
        if !self.sampling && !greedy {
            return Err(Refusal {
                param: Some("temperature"),
                message: "this server decodes greedily only (temperature 0, no repetition penalty): its device has \
                          no sampler for this model"
                    .into(),
            });
        }
        g.device_sampler(params, g.on_gpu()).map(|_| ()).map_err(|message| Refusal { param: None, message })
    }

    /// Ends the sequence in `slot` (a client went away, a stop string): the slot is free for
    /// the next [`ContinuousBatch::join`].
    pub fn leave(&mut self, slot: usize) {
        if let Some(r) = self.rows.iter_mut().find(|r| r.seq.as_ref().is_some_and(|q| q.slot == slot)) {
            r.seq = None;
        }
        // Its tokens from a step read early go too: the slot's next sequence must not get them.
        self.drained.retain(|e| e.slot != slot);
    }

    /// Whether a step's tokens are still to come from [`ContinuousBatch::step`] (a step
    /// enqueued and not read yet, or one read early): it returns them even when no sequence is
    /// left.
    pub fn in_flight(&self) -> bool {
        self.ahead.is_some() || !self.drained.is_empty()
    }

    /// One decode step of every row. Returns each sequence's new token, in row order, after
    /// the tokens of a step read early (nothing when the batch is empty). Errors: the step's (a
    /// device error, an input a kernel found out of range); the sequences stay in place and the
    /// next step rewrites the buffers.
    pub fn step(&mut self, g: &mut Generator) -> Result<Vec<Emitted>> {
        let mut out = std::mem::take(&mut self.drained);
        if self.active() == 0 && self.ahead.is_none() {
            return Ok(out);
        }
        let read = self.enqueue_and_read(g);
        let (ids, epochs) = match read {
            Ok(r) => r,
            Err(e) => {
                // The tokens read early stay for the next step (or `leave`).
                self.drained = out;
                self.dirty = true;
                if let Some((p, _)) = self.ahead.take() {
                    let _ = g.session.read_finish(p);
                }
                return Err(e);
            }
        };
        out.extend(self.apply(&ids, &epochs));
        Ok(out)
    }

    /// Gives each row's sequence the token a step chose for it (`ids` by row), unless the row
    /// changed hands since the step was enqueued (`epochs`); returns the tokens, in row order.
    fn apply(&mut self, ids: &[i64], epochs: &[u64]) -> Vec<Emitted> {
        let mut out = Vec::new();
        for (r, &epoch) in epochs.iter().enumerate() {
            let Some(row) = self.rows.get_mut(r) else { continue };
            if row.epoch != epoch {
                // Joined after the step was enqueued: the step computed the row's old occupant.
                continue;
            }
            row.len += 1;
            let Some(seq) = row.seq.as_mut() else { continue };
            let token = ids.get(r).copied().unwrap_or(self.pad);
            row.tokens.push(token);
            seq.generated += 1;
            let slot = seq.slot;
            let finished = self.finished(r, token);
            out.push(Emitted { slot, token, finished });
        }
        out
    }

    /// Takes the step in flight (or moves the rows when the load asks for it, and enqueues a
    /// step), enqueues the next one ahead when the buffers need no rewrite first and the rows
    /// are to stay, and reads the taken step's tokens.
    fn enqueue_and_read(&mut self, g: &mut Generator) -> Result<(Vec<i64>, Vec<u64>)> {
        let this = match self.ahead.take() {
            Some(a) => a,
            None => {
                if let Some(n) = self.rows_wanted() {
                    self.transition(g, n)?;
                }
                if self.unmap_wanted() {
                    if let Some(full) = &self.full {
                        let (positions, dims) = (self.kv.total + 1, g.kv_dims());
                        self.mapped = kv::fit(&mut g.session, &dims, full, self.rows.len(), positions, true)?;
                        self.mapped_positions = positions;
                    }
                    self.surplus_steps = 0;
                }
                let at_end = self.kv.total + 1 >= self.kv.limit;
                if self.dirty || at_end {
                    self.stats.compactions += u64::from(at_end && !self.dirty);
                    self.load(g)?;
                }
                self.enqueue(g)?
            }
        };
        // On the CPU a step runs when enqueued: running ahead would gain nothing, and the cache
        // may be reallocated between steps.
        let stay = self.rows_wanted().is_none() && !self.unmap_wanted();
        if self.on_gpu && stay && !self.dirty && self.active() > 0 && self.kv.total + 1 < self.kv.limit {
            self.ahead = Some(self.enqueue(g)?);
        }
        let (pending, epochs) = this;
        Ok((g.session.read_finish(pending)?.to_i64()?, epochs))
    }

    fn enqueue(&mut self, g: &mut Generator) -> Result<(crate::ep::PendingRead, Vec<u64>)> {
        // A paged cache's step maps every row to the shared column (Generator::enqueue_device_step).
        self.mapped_positions = self.mapped_positions.max(self.kv.total + 1);
        let pending = g.enqueue_device_step(&mut self.kv)?;
        self.stats.steps += 1;
        let low = 4 * self.rows_for(self.active()) <= self.rows.len();
        self.low_steps = if low { self.low_steps.saturating_add(1) } else { 0 };
        self.surplus_steps = if self.surplus() { self.surplus_steps.saturating_add(1) } else { 0 };
        Ok((pending, self.rows.iter().map(|r| r.epoch).collect()))
    }

    /// Whether the sequence in row `r`, which just got `token`, ends there; frees the row if so.
    fn finished(&mut self, r: usize, token: i64) -> Option<StopReason> {
        let row = &mut self.rows[r];
        let seq = row.seq.as_ref()?;
        let why = if !seq.ignore_eos && self.eos.contains(&token) {
            StopReason::Eos
        } else if seq.generated >= seq.max_new_tokens {
            StopReason::MaxNewTokens
        } else if row.tokens.len() >= self.max_length {
            StopReason::MaxLength
        } else {
            return None;
        };
        row.seq = None;
        Some(why)
    }

    /// On the CPU, reallocates the cache when `needed` positions (the longest sequence and the
    /// step after it) do not fit, or when it is over four times longer than they need; returns
    /// whether it did (the step buffers then need a rewrite). Each row's first `len`
    /// positions move to the new cache. A GPU's cache never moves. Errors: allocation.
    fn fit(&mut self, g: &mut Generator, needed: usize) -> Result<bool> {
        let limit = self.kv.limit;
        let want = (2 * needed).next_power_of_two().max(CPU_MIN_LIMIT).min(self.max_length).max(needed);
        if self.on_gpu || want == limit || (needed < limit && 2 * want > limit) {
            return Ok(false);
        }
        let dims = g.kv_dims();
        let kv = kv::empty(&mut g.session, &dims, self.rows.len(), want, self.rows.len())?;
        let moves: Vec<(usize, usize, usize)> = self.rows.iter().enumerate().map(|(b, r)| (b, b, r.len)).collect();
        kv::copy_rows(&mut g.session, &dims, &self.kv, &kv, &moves)?;
        // The old cache goes back to the pool (not kept as the generator's spare).
        self.kv = kv;
        self.stats.resizes += 1;
        Ok(true)
    }

    /// Rewrites the step buffers from the rows, compacted: row `b`'s tokens at mask columns
    /// `0 .. len`, free rows one padding token, the next column at the longest length.
    fn load(&mut self, g: &mut Generator) -> Result<()> {
        for r in self.rows.iter_mut().filter(|r| r.seq.is_none()) {
            r.tokens = vec![self.pad];
            r.len = 1;
        }
        let next = self.rows.iter().map(|r| r.len).max().unwrap_or(1);
        self.fit(g, next + 1)?;
        let (rows, l) = (self.rows.len(), self.kv.limit);
        if next >= l {
            return Err(Error::Input(format!("a sequence of {next} positions does not fit the cache's {l}")));
        }
        let mut mask = vec![0i64; rows * l];
        let mut history = vec![0i64; rows * l];
        let mut params = Vec::with_capacity(rows * 4);
        let greedy = Sampler::new(SamplingParams::default()).device_row(self.vocab);
        for (b, r) in self.rows.iter_mut().enumerate() {
            r.fill_rows(&mut mask[b * l..(b + 1) * l], &mut history[b * l..(b + 1) * l]);
            params.extend(r.device_params(self.vocab, greedy));
            r.rebase(next);
        }
        let seeds = self.seeds();
        let tokens: Vec<i64> = self.rows.iter().map(|r| r.tokens.last().copied().unwrap_or(self.pad)).collect();
        self.kv.total = next - 1;
        let sample = self.sampling.then_some(SampleStart { history: &history, params: &params, seeds: &seeds });
        g.load_device_steps(&self.kv, &tokens, &mask, sample)?;
        self.kv.mask = mask;
        self.dirty = false;
        self.stats.rewrites += 1;
        Ok(())
    }
}

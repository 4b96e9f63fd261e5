//! The generation worker of `kiln serve`: one thread owns the `Generator` (its session, device
//! buffers and graphs) and serves the queued requests in one continuous batch
//! ([`crate::genai::ContinuousBatch`]): a request joins a free slot between decode steps, and
//! leaves it when it ends, when its client goes away, when its HTTP task found a stop string
//! (`Job::cancel`) or when it runs past its timeout. The worker sends token ids only: each
//! request's HTTP task turns them into text (`stop::RequestText`), so detokenization runs on
//! the server's threads beside the step loop. A folder that cannot batch (no shared KV buffer or
//! no device-step packages) is served one request at a time.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use super::api::{ApiError, Ask, Limits, Request};
use crate::genai::{ContinuousBatch, Emitted, GenerateOptions, Generator, Join, StopReason};
use crate::Error;

/// One queued request: its body, which endpoint, where its events go, when it arrived, and the
/// flag its HTTP task sets when a stop string ended the text (the worker then frees its slot).
pub struct Job {
    pub request: Request,
    pub chat: bool,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
    pub cancel: Arc<AtomicBool>,
}

/// What a request hears from the worker, in order: `Rejected`, or `Started` then `Token`s then
/// `Done` (or `Failed`).
#[derive(Debug)]
pub enum Event {
    Rejected(ApiError),
    Started {
        stream: bool,
        prompt_tokens: usize,
        stop: Vec<String>,
    },
    Token(i64),
    /// The sequence ended: `stop` (end-of-sequence token) or `length`.
    Done {
        finish_reason: &'static str,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    Failed(String),
}

/// Counters shared with the HTTP side (`/metrics`, `/health`).
#[derive(Default)]
pub struct Stats {
    /// False once a device error may have poisoned the CUDA context.
    pub unhealthy: AtomicBool,
    pub queued: AtomicU64,
    pub running: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub disconnected: AtomicU64,
    pub timed_out: AtomicU64,
    /// Decode steps of the continuous batch, the tokens they gave requests, and its slots.
    pub batch_steps: AtomicU64,
    pub batch_tokens: AtomicU64,
    /// Wall time of the decode steps (enqueue to tokens back), and of the joins' prefills, in µs.
    pub batch_step_us: AtomicU64,
    pub join_us: AtomicU64,
    pub batch_slots: AtomicU64,
    /// Rows of the batch after its last join or step (they follow the load: on a GPU, the
    /// graph bucket); 1 when requests are served one at a time.
    pub batch_rows: AtomicU64,
    /// Bytes kiln holds on the device (the session's pool blocks in use, the device pool's
    /// cached blocks, and the KV caches' mapped bytes), after the last join or step; 0 on the
    /// CPU.
    pub device_memory: AtomicU64,
    /// Of those, the bytes mapped into the KV caches' reserved addresses.
    pub kv_mapped: AtomicU64,
}

impl Stats {
    /// Records the device memory the generator's session holds now.
    fn note_device_memory(&self, g: &Generator) {
        if let Some((a, _)) = g.session.gpu_stats() {
            self.device_memory.store(a.in_use_bytes + a.cached_bytes + a.vmm_mapped_bytes, Ordering::Relaxed);
            self.kv_mapped.store(a.vmm_mapped_bytes, Ordering::Relaxed);
        }
    }
}

/// Most requests one prefill joins to the batch, and the most positions it runs (rows × the
/// padded length, [`ContinuousBatch::prefill_shape`]): waiting requests join together, as
/// vLLM's scheduler batches prefills under a token budget, so that a wave of arrivals costs a
/// few prefills, not one each. A request alone always joins.
const JOIN_AT_ONCE: usize = 32;
const JOIN_POSITIONS: usize = 8192;

/// How the worker serves.
pub struct WorkerOptions {
    pub limits: Limits,
    /// Sequences decoded together (the continuous batch's slots; on a GPU, its bucket).
    pub batch: usize,
    /// Each request prefills alone, so its tokens do not depend on the others'.
    pub batch_invariant: bool,
    /// Longest a request may take from its arrival; past it, it fails with a clear message.
    pub timeout: Duration,
}

/// The worker's generator and how it serves: one continuous batch, or one request at a time
/// for a folder that cannot batch.
pub struct Worker {
    g: Generator,
    batch: Option<ContinuousBatch>,
    opts: WorkerOptions,
}

impl Worker {
    /// Readies the worker: the continuous batch's KV cache is allocated here, before the server
    /// accepts anything (on a GPU all of it, `--batch` slots of `--max-length` positions; on the
    /// CPU it grows with the sequences). Errors:
    /// the batch's allocation (with the sizes to lower); a folder that cannot batch is served one
    /// request at a time instead, with a warning.
    pub fn new(mut g: Generator, opts: WorkerOptions) -> crate::Result<Worker> {
        let batch = match ContinuousBatch::new(&mut g, opts.batch, Some(opts.limits.max_length)) {
            Ok(mut b) => {
                b.set_batch_invariant(opts.batch_invariant);
                Some(b)
            }
            Err(e) if e.is_unsupported() => {
                tracing::warn!("serving one request at a time: {e}");
                None
            }
            Err(e) => {
                return Err(Error::Input(format!(
                    "--batch {} with --max-length {}: {e} (lower --batch or --max-length)",
                    opts.batch, opts.limits.max_length
                )))
            }
        };
        Ok(Worker { g, batch, opts })
    }

    /// Serves `jobs` until the queue closes or a device error ends it (then `fatal` is called).
    pub fn run(self, jobs: Receiver<Job>, stats: Arc<Stats>, fatal: impl Fn()) {
        let Worker { g, batch, opts } = self;
        let device_error = match batch {
            Some(batch) => {
                stats.batch_slots.store(batch.capacity() as u64, Ordering::Relaxed);
                stats.batch_rows.store(batch.rows() as u64, Ordering::Relaxed);
                let live = (0..batch.capacity()).map(|_| None).collect();
                Batched { g, batch, live, pending: None, opts: &opts, stats: &stats }.run(&jobs)
            }
            None => {
                stats.batch_slots.store(1, Ordering::Relaxed);
                stats.batch_rows.store(1, Ordering::Relaxed);
                one_at_a_time(g, &jobs, &opts, &stats)
            }
        };
        if device_error {
            stats.unhealthy.store(true, Ordering::SeqCst);
            // Whatever still waits hears why.
            while let Ok(job) = jobs.try_recv() {
                stats.queued.fetch_sub(1, Ordering::Relaxed);
                let _ = job.events.send(Event::Failed("the device failed; the server is stopping".into()));
            }
            fatal();
        }
    }
}

/// A taken job checked: its work, or its rejection already sent (a client that already left
/// gets nothing). `batch`: the sampling the batch's device sampler cannot do is a 400.
fn accept(
    g: &Generator,
    batch: Option<&ContinuousBatch>,
    job: Job,
    opts: &WorkerOptions,
    stats: &Stats,
) -> Option<(Ask, Live)> {
    stats.queued.fetch_sub(1, Ordering::Relaxed);
    if job.events.is_closed() {
        stats.disconnected.fetch_add(1, Ordering::Relaxed);
        return None;
    }
    if job.arrived.elapsed() > opts.timeout {
        stats.timed_out.fetch_add(1, Ordering::Relaxed);
        let e = ApiError { status: 503, message: timed_out(opts.timeout, "waiting in the queue"), param: None };
        let _ = job.events.send(Event::Rejected(e));
        return None;
    }
    let folder = &g.folder;
    let checked = job.request.check(job.chat, &opts.limits, |t| folder.encode(t), |m| folder.render_chat(m));
    let checked = checked.and_then(|ask| match batch.map(|b| b.admits(g, &ask.sampling)) {
        Some(Err(r)) => Err(ApiError::bad(r.message, r.param)),
        _ => Ok(ask),
    });
    match checked {
        Ok(ask) => {
            let _ = job.events.send(Event::Started {
                stream: ask.stream,
                prompt_tokens: ask.prompt_ids.len(),
                stop: ask.stop.clone(),
            });
            let live = Live {
                events: job.events,
                cancel: job.cancel,
                tokens: 0,
                prompt_tokens: ask.prompt_ids.len(),
                deadline: job.arrived + opts.timeout,
            };
            Some((ask, live))
        }
        Err(e) => {
            let _ = job.events.send(Event::Rejected(e));
            None
        }
    }
}

/// Why a request past its deadline failed (`while`: where it was), and what to change.
fn timed_out(timeout: Duration, while_: &str) -> String {
    format!(
        "the request ran past the server's --request-timeout of {} s {while_}: ask for fewer max_tokens, or start \
         the server with a longer --request-timeout",
        timeout.as_secs_f64()
    )
}

/// The continuous-batch loop's state.
struct Batched<'a> {
    g: Generator,
    batch: ContinuousBatch,
    /// The request in each slot.
    live: Vec<Option<Live>>,
    /// An accepted request the last prefill had no room for: the next one takes it first.
    pending: Option<(Ask, Live)>,
    opts: &'a WorkerOptions,
    stats: &'a Stats,
}

impl Batched<'_> {
    /// Serves until the queue closes and the batch is empty; returns whether a device error
    /// ended it (every running request then failed).
    fn run(mut self, jobs: &Receiver<Job>) -> bool {
        let mut closed = false;
        loop {
            // Admit waiting requests into free slots, up to JOIN_AT_ONCE (batch-invariant: one,
            // so each first token goes out after its own prefill) and JOIN_POSITIONS per
            // prefill; block only when nothing runs.
            let mut taken: Vec<(Ask, Live)> = self.pending.take().into_iter().collect();
            let at_once = if self.opts.batch_invariant { 1 } else { JOIN_AT_ONCE };
            let on_gpu = self.g.on_gpu();
            while !closed && self.batch.active() + taken.len() < self.batch.capacity() && taken.len() < at_once {
                let job = if self.batch.active() == 0 && taken.is_empty() {
                    match jobs.recv() {
                        Ok(j) => j,
                        Err(_) => return false,
                    }
                } else {
                    match jobs.try_recv() {
                        Ok(j) => j,
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            closed = true;
                            break;
                        }
                    }
                };
                let Some(next) = accept(&self.g, Some(&self.batch), job, self.opts, self.stats) else { continue };
                let longest = taken.iter().chain([&next]).map(|(a, _)| a.prompt_ids.len()).max().unwrap_or(1);
                if !taken.is_empty()
                    && ContinuousBatch::prefill_positions(on_gpu, taken.len() + 1, longest) > JOIN_POSITIONS
                {
                    // Over the budget with it: it waits for the next prefill.
                    self.pending = Some(next);
                    break;
                }
                taken.push(next);
            }
            if !taken.is_empty() && self.admit(taken) {
                return true;
            }
            if self.batch.active() == 0 && !self.batch.in_flight() {
                if closed && self.pending.is_none() {
                    return false;
                }
                continue;
            }
            self.drop_abandoned();
            let t0 = Instant::now();
            let stepped = self.batch.step(&mut self.g);
            self.stats.batch_step_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
            match stepped {
                Ok(tokens) => {
                    self.stats.note_device_memory(&self.g);
                    self.stats.batch_rows.store(self.batch.rows() as u64, Ordering::Relaxed);
                    self.stats.batch_steps.fetch_add(1, Ordering::Relaxed);
                    self.stats.batch_tokens.fetch_add(tokens.len() as u64, Ordering::Relaxed);
                    tokens.into_iter().for_each(|e| self.deliver(e));
                }
                Err(e) => {
                    // A failed step fails the requests it carried; the batch starts over.
                    self.fail_all(&e);
                    if matches!(e, Error::Device(_)) {
                        return true;
                    }
                }
            }
        }
    }

    /// Fails every running request with `e`, freeing its slot.
    fn fail_all(&mut self, e: &Error) {
        for slot in 0..self.live.len() {
            if let Some(l) = self.live[slot].take() {
                self.batch.leave(slot);
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                self.stats.running.fetch_sub(1, Ordering::Relaxed);
                let _ = l.events.send(Event::Failed(e.to_string()));
            }
        }
    }

    /// Joins accepted requests to the batch (one prefill); returns whether a device error
    /// happened (every running request then failed).
    fn admit(&mut self, taken: Vec<(Ask, Live)>) -> bool {
        let joins: Vec<Join<'_>> = taken
            .iter()
            .map(|(ask, _)| Join {
                prompt: &ask.prompt_ids,
                sampling: &ask.sampling,
                max_new_tokens: ask.max_tokens,
                ignore_eos: ask.ignore_eos,
            })
            .collect();
        let t0 = Instant::now();
        let joined = self.batch.join_many(&mut self.g, &joins);
        self.stats.join_us.fetch_add(t0.elapsed().as_micros() as u64, Ordering::Relaxed);
        self.stats.note_device_memory(&self.g);
        self.stats.batch_rows.store(self.batch.rows() as u64, Ordering::Relaxed);
        drop(joins);
        match joined {
            Ok(firsts) => {
                for ((_, live), first) in taken.into_iter().zip(firsts) {
                    self.stats.running.fetch_add(1, Ordering::Relaxed);
                    self.live[first.slot] = Some(live);
                    self.deliver(first);
                }
                false
            }
            Err(e) => {
                for (_, live) in taken {
                    self.stats.failed.fetch_add(1, Ordering::Relaxed);
                    let _ = live.events.send(Event::Failed(e.to_string()));
                }
                let device = matches!(e, Error::Device(_));
                if device {
                    self.fail_all(&e);
                }
                device
            }
        }
    }

    /// Frees the slots of requests whose text ended at a stop string, whose client went away or
    /// whose time ran out.
    fn drop_abandoned(&mut self) {
        let now = Instant::now();
        for slot in 0..self.live.len() {
            let Some(l) = &self.live[slot] else { continue };
            let (stopped, gone, late) = (l.cancel.load(Ordering::SeqCst), l.events.is_closed(), now > l.deadline);
            if !(stopped || gone || late) {
                continue;
            }
            if let Some(l) = self.live[slot].take() {
                self.batch.leave(slot);
                self.stats.running.fetch_sub(1, Ordering::Relaxed);
                if stopped {
                    l.count(self.stats);
                } else if gone {
                    self.stats.disconnected.fetch_add(1, Ordering::Relaxed);
                } else {
                    self.stats.timed_out.fetch_add(1, Ordering::Relaxed);
                    let _ = l.events.send(Event::Failed(timed_out(self.opts.timeout, "while generating")));
                }
            }
        }
    }

    /// Hands a token to its request; ends the request when its sequence is over.
    fn deliver(&mut self, e: Emitted) {
        let Some(live) = self.live.get_mut(e.slot).and_then(Option::as_mut) else { return };
        let sent = live.send_token(e.token);
        if sent && e.finished.is_none() {
            return;
        }
        if e.finished.is_none() {
            self.batch.leave(e.slot);
        }
        let Some(live) = self.live[e.slot].take() else { return };
        // Not running any more before its client hears `Done`.
        self.stats.running.fetch_sub(1, Ordering::Relaxed);
        match (sent, e.finished) {
            (true, Some(why)) => live.finish(why, self.stats),
            _ => {
                self.stats.disconnected.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// One running request, as the worker sees it: where its tokens go, and its counts.
struct Live {
    events: UnboundedSender<Event>,
    /// Set by the request's HTTP task when a stop string ended its text.
    cancel: Arc<AtomicBool>,
    tokens: usize,
    prompt_tokens: usize,
    deadline: Instant,
}

impl Live {
    /// Sends a token; false when the client is gone.
    fn send_token(&mut self, id: i64) -> bool {
        self.tokens += 1;
        self.events.send(Event::Token(id)).is_ok()
    }

    /// Counts a request answered in full.
    fn count(&self, stats: &Stats) {
        stats.prompt_tokens.fetch_add(self.prompt_tokens as u64, Ordering::Relaxed);
        stats.completion_tokens.fetch_add(self.tokens as u64, Ordering::Relaxed);
        stats.completed.fetch_add(1, Ordering::Relaxed);
    }

    /// Ends the request as its sequence ended: `Done` with OpenAI's finish reason.
    fn finish(self, why: StopReason, stats: &Stats) {
        self.count(stats);
        let finish_reason = if why == StopReason::Eos { "stop" } else { "length" };
        let _ = self.events.send(Event::Done {
            finish_reason,
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.tokens,
        });
    }
}

/// Serves one request at a time through [`Generator::generate`]; returns whether a device
/// error ended it.
fn one_at_a_time(mut g: Generator, jobs: &Receiver<Job>, opts: &WorkerOptions, stats: &Stats) -> bool {
    // The generator's interrupt flag: set when a client goes away, a stop string is seen or the
    // time runs out.
    let stop: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
    for job in jobs {
        let Some((ask, mut live)) = accept(&g, None, job, opts, stats) else { continue };
        // The HTTP task sets `cancel` once a stop string ends the text.
        stats.running.fetch_add(1, Ordering::Relaxed);
        stop.store(false, Ordering::SeqCst);
        let gen_opts = GenerateOptions {
            max_new_tokens: ask.max_tokens,
            max_length: Some(opts.limits.max_length),
            sampling: ask.sampling.clone(),
            ignore_eos: ask.ignore_eos,
            stop: Some(stop),
        };
        let mut ended = None;
        let result = g.generate(std::slice::from_ref(&ask.prompt_ids), &gen_opts, &mut |_, id| {
            if ended.is_some() {
                return;
            }
            ended = if !live.send_token(id) {
                Some(Ended::Gone)
            } else if live.cancel.load(Ordering::SeqCst) {
                Some(Ended::StopString)
            } else if Instant::now() > live.deadline {
                Some(Ended::Late)
            } else {
                None
            };
            if ended.is_some() {
                stop.store(true, Ordering::SeqCst);
            }
        });
        stats.running.fetch_sub(1, Ordering::Relaxed);
        stats.note_device_memory(&g);
        match (result, ended) {
            (Err(e), _) => {
                stats.failed.fetch_add(1, Ordering::Relaxed);
                let device = matches!(e, Error::Device(_));
                let _ = live.events.send(Event::Failed(e.to_string()));
                if device {
                    return true;
                }
            }
            (Ok(_), Some(Ended::Gone)) => {
                stats.disconnected.fetch_add(1, Ordering::Relaxed);
            }
            (Ok(_), Some(Ended::Late)) => {
                stats.timed_out.fetch_add(1, Ordering::Relaxed);
                let _ = live.events.send(Event::Failed(timed_out(opts.timeout, "while generating")));
            }
            (Ok(_), Some(Ended::StopString)) => live.count(stats),
            (Ok(mut r), None) => {
                let why = r.rows.pop().map_or(StopReason::MaxLength, |row| row.stopped_by);
                live.finish(why, stats);
            }
        }
    }
    false
}

/// Why a request of [`one_at_a_time`] ended before its sequence did.
enum Ended {
    StopString,
    Gone,
    Late,
}

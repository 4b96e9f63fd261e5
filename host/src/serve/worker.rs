//! The generation worker of `kiln serve`: one thread owns the `Generator` (its session, device
//! buffers and graphs) and serves queued requests one at a time, streaming each one's text
//! back as it is decoded.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Receiver;
use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;

use super::api::{ApiError, Ask, Limits, Request};
use crate::genai::{GenerateOptions, Generator, StopReason, TextStream};
use crate::Error;

/// One queued request: its body, which endpoint, and where its events go.
pub struct Job {
    pub request: Request,
    pub chat: bool,
    pub events: UnboundedSender<Event>,
}

/// What a request hears from the worker, in order: `Rejected`, or `Started` then `Text`s then
/// `Done` (or `Failed`).
#[derive(Debug)]
pub enum Event {
    Rejected(ApiError),
    Started { stream: bool },
    Text(String),
    Done { finish_reason: &'static str, prompt_tokens: usize, completion_tokens: usize },
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
}

/// Serves `jobs` until the queue closes or a device error ends it (then `fatal` is called).
pub fn run(mut generator: Generator, jobs: Receiver<Job>, limits: Limits, stats: Arc<Stats>, fatal: impl Fn()) {
    // The generator's interrupt flag: set when a client goes away or a stop string is seen.
    let stop: &'static AtomicBool = Box::leak(Box::new(AtomicBool::new(false)));
    for job in jobs {
        stats.queued.fetch_sub(1, Ordering::Relaxed);
        let folder = &generator.folder;
        let checked = job.request.check(job.chat, &limits, |t| folder.encode(t), |m| folder.render_chat(m));
        let ask = match checked {
            Ok(ask) => ask,
            Err(e) => {
                let _ = job.events.send(Event::Rejected(e));
                continue;
            }
        };
        stats.running.fetch_add(1, Ordering::Relaxed);
        let device_error = serve_one(&mut generator, ask, &job.events, &limits, &stats, stop);
        stats.running.fetch_sub(1, Ordering::Relaxed);
        if device_error {
            stats.unhealthy.store(true, Ordering::SeqCst);
            fatal();
            return;
        }
    }
}

/// Generates one request's answer; returns whether it failed with a device error.
fn serve_one(
    g: &mut Generator,
    ask: Ask,
    events: &UnboundedSender<Event>,
    limits: &Limits,
    stats: &Stats,
    stop: &'static AtomicBool,
) -> bool {
    stop.store(false, Ordering::SeqCst);
    let _ = events.send(Event::Started { stream: ask.stream });
    let opts = GenerateOptions {
        max_new_tokens: ask.max_tokens,
        max_length: Some(limits.max_length),
        sampling: ask.sampling.clone(),
        ignore_eos: false,
        stop: Some(stop),
    };
    let mut text = TextStream::new(g.folder.tokenizer.clone());
    let mut matcher = StopMatcher::new(ask.stop.clone());
    let (mut hit, mut gone) = (false, false);
    let send = |s: String, gone: &mut bool| {
        if !s.is_empty() && events.send(Event::Text(s)).is_err() {
            *gone = true;
            stop.store(true, Ordering::SeqCst);
        }
    };
    let result = g.generate(std::slice::from_ref(&ask.prompt_ids), &opts, &mut |_, id| {
        if hit || gone {
            return;
        }
        if let Some(piece) = text.push(id) {
            let (out, found) = matcher.push(&piece);
            send(out, &mut gone);
            if found {
                hit = true;
                stop.store(true, Ordering::SeqCst);
            }
        }
    });
    let row = match result {
        Ok(mut r) => r.rows.remove(0),
        Err(e) => {
            stats.failed.fetch_add(1, Ordering::Relaxed);
            let device = matches!(e, Error::Device(_));
            let _ = events.send(Event::Failed(e.to_string()));
            return device;
        }
    };
    if !hit && !gone {
        // The text the stream held back (an unfinished character or word at the end).
        let whole = g.folder.decode(&row.generated_ids).unwrap_or_default();
        let (out, found) = matcher.push(text.rest(&whole));
        hit = found;
        send(out, &mut gone);
        if !hit {
            send(matcher.finish(), &mut gone);
        }
    }
    stats.prompt_tokens.fetch_add(ask.prompt_ids.len() as u64, Ordering::Relaxed);
    stats.completion_tokens.fetch_add(row.generated_ids.len() as u64, Ordering::Relaxed);
    if gone {
        stats.disconnected.fetch_add(1, Ordering::Relaxed);
        return false;
    }
    let finish_reason = match (hit, row.stopped_by) {
        (true, _) | (_, StopReason::Eos) => "stop",
        _ => "length",
    };
    stats.completed.fetch_add(1, Ordering::Relaxed);
    let _ = events.send(Event::Done {
        finish_reason,
        prompt_tokens: ask.prompt_ids.len(),
        completion_tokens: row.generated_ids.len(),
    });
    false
}

/// Finds stop strings in streamed text: text is released once no stop string can begin in it.
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops, pending: String::new() }
    }

    /// Adds `piece`; returns the text safe to send and whether a stop string was found (the
    /// text is then everything before it, and the rest is dropped).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Hold back the longest end of the text that starts a stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| s.char_indices().skip(1).map(|(k, _)| &s[..k]))
            .filter(|prefix| self.pending.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// The text held back, at the end of the answer.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    #[test]
    fn stop_strings_end_the_text_even_across_pieces() {
        let mut m = StopMatcher::new(vec!["\n\n".into(), "END".into()]);
        assert_eq!(m.push("Hello E"), ("Hello ".to_string(), false), "E may start END");
        assert_eq!(m.push("ND of it"), (String::new(), true));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("Eh"), ("Eh".to_string(), false));
        assert_eq!(m.push(" fin"), (" fin".to_string(), false));
        assert_eq!(m.push(" EN"), (" ".to_string(), false));
        assert_eq!(m.finish(), "EN", "held back until the end");
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("café"), ("caf".to_string(), false), "a multi-byte prefix is held whole");
        assert_eq!(m.push("?"), ("é?".to_string(), false));
    }
}

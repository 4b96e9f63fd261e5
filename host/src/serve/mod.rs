//! `kiln serve`: an OpenAI-compatible HTTP server over one model folder.
//!
//! - `POST /v1/completions`, `POST /v1/chat/completions` (`"stream": true`: server-sent events,
//!   `data: {chunk}` lines ending with `data: [DONE]`, as OpenAI streams), `GET /v1/models`,
//!   `GET /health` (503 once a device error may have poisoned the CUDA context) and
//!   `GET /metrics` (Prometheus text format).
//! - Requests wait in a bounded queue (`--queue`); over it they get 429 with `Retry-After`.
//!   Bodies over `--max-body-bytes` get 413, malformed JSON 400, a prompt plus `max_tokens` over
//!   the context 400 with both numbers, OpenAI parameters kiln does not implement (`n > 1`,
//!   `logprobs`, …) 400 naming them; every error is OpenAI's error object.
//! - One worker thread owns the generator ([`worker`]) and decodes the running requests as one
//!   continuous batch of `--batch` slots: a request joins between decode steps and leaves when it
//!   ends, when its client disconnects (its slot is free at the next step) or when it runs past
//!   `--request-timeout`. Requests wait in the queue while every slot is taken.
//! - `--api-key` requires `Authorization: Bearer KEY` on `/v1/*`. SIGTERM or Ctrl-C stops
//!   accepting, lets the running requests finish and exits; a device error fails the running requests,
//!   turns `/health` to 503 and makes the server exit non-zero, for a supervisor to restart it.
//!
//! axum on tokio: the HTTP/1.1 parsing, limits and streaming responses of a well-kept server
//! stack, so kiln's own code is only the API's semantics.

pub mod api;
mod stop;
pub mod worker;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tokio_stream::StreamExt;

use self::api::{ApiError, Limits, Request};
use self::stop::RequestText;
use self::worker::{Event, Job, Stats, Worker, WorkerOptions};
use crate::genai::Generator;
use crate::{Error, Result};

/// How to serve.
pub struct ServeOptions {
    /// Where to listen (port 0: any free port, printed on stderr).
    pub addr: SocketAddr,
    /// Required as `Authorization: Bearer KEY` on `/v1/*` when set.
    pub api_key: Option<String>,
    /// Requests waiting for a slot of the batch; more get 429.
    pub queue: usize,
    /// Largest request body in bytes; larger ones get 413.
    pub max_body_bytes: usize,
    /// The model's id in `/v1/models` and responses.
    pub model_id: String,
    pub limits: Limits,
    /// Sequences decoded together (the continuous batch's slots).
    pub batch: usize,
    /// A request's tokens do not depend on the other requests in the batch
    /// (`ContinuousBatch::set_batch_invariant`).
    pub batch_invariant: bool,
    /// Longest a request may take from its arrival.
    pub timeout: std::time::Duration,
    /// The folder's tokenizer: each request's HTTP task turns its tokens into text.
    pub tokenizer: Arc<tokenizers::Tokenizer>,
}

/// What every handler shares.
struct Shared {
    jobs: SyncSender<Job>,
    tokenizer: Arc<tokenizers::Tokenizer>,
    stats: Arc<Stats>,
    model_id: String,
    api_key: Option<String>,
    next_id: std::sync::atomic::AtomicU64,
}

/// Serves until SIGTERM or Ctrl-C (then `Ok`), or until a device error ends the worker (then
/// `Err`). `make` builds the generator on the worker thread; its error is returned before any
/// request is accepted. `on_listening` gets the bound address.
pub fn serve(
    make: impl FnOnce() -> Result<Generator> + Send + 'static,
    opts: ServeOptions,
    on_listening: impl FnOnce(SocketAddr),
) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        // Each request's task turns its tokens into text: threads for them beside the worker.
        .worker_threads(std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 8)))
        .enable_all()
        .build()
        .map_err(|e| Error::Device(format!("starting the server's runtime: {e}")))?;
    let (jobs, queue) = sync_channel::<Job>(opts.queue);
    let stats = Arc::new(Stats::default());
    let fatal = Arc::new(tokio::sync::Notify::new());
    let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<()>>();
    let worker = {
        let (stats, fatal) = (stats.clone(), fatal.clone());
        let worker_opts = WorkerOptions {
            limits: opts.limits,
            batch: opts.batch,
            batch_invariant: opts.batch_invariant,
            timeout: opts.timeout,
        };
        std::thread::Builder::new()
            .name("kiln-serve-worker".into())
            .spawn(move || {
                let worker = match make().and_then(|g| Worker::new(g, worker_opts)) {
                    Ok(w) => {
                        let _ = ready_tx.send(Ok(()));
                        w
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                worker.run(queue, stats, || fatal.notify_one());
            })
            .map_err(|e| Error::Device(format!("starting the worker thread: {e}")))?
    };
    ready_rx.recv().map_err(|_| Error::Device("the worker thread ended before the model loaded".into()))??;
    let shared = Arc::new(Shared {
        jobs,
        tokenizer: opts.tokenizer,
        stats: stats.clone(),
        model_id: opts.model_id,
        api_key: opts.api_key,
        next_id: 1.into(),
    });
    let app = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .layer(DefaultBodyLimit::max(opts.max_body_bytes))
        .with_state(shared.clone());
    let served = runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(opts.addr)
            .await
            .map_err(|e| Error::Input(format!("--host/--port {}: {e}", opts.addr)))?;
        let addr = listener.local_addr().map_err(|e| Error::Device(format!("the bound address: {e}")))?;
        on_listening(addr);
        let fatal_seen = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let shutdown = {
            let (fatal, fatal_seen) = (fatal.clone(), fatal_seen.clone());
            async move {
                tokio::select! {
                    _ = terminated() => {}
                    _ = fatal.notified() => fatal_seen.store(true, Ordering::SeqCst),
                }
            }
        };
        axum::serve(listener, app)
            .with_graceful_shutdown(shutdown)
            .await
            .map_err(|e| Error::Device(format!("serving: {e}")))?;
        if fatal_seen.load(Ordering::SeqCst) {
            return Err(Error::Device("a device error ended the server (its request failed; /health was 503)".into()));
        }
        Ok(())
    });
    // Closing the queue ends the worker after its request.
    drop(shared);
    let _ = worker.join();
    served
}

/// SIGTERM or Ctrl-C.
async fn terminated() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => {
                let _ = ctrl_c.await;
                return;
            }
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}

fn error_response(e: &ApiError) -> Response {
    let status = StatusCode::from_u16(e.status).unwrap_or(StatusCode::BAD_REQUEST);
    let mut r = (status, axum::Json(e.body())).into_response();
    if e.status == 429 {
        r.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
    }
    r
}

fn authorized(s: &Shared, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(key) = &s.api_key else { return Ok(()) };
    let given =
        headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
    if given == Some(key.as_str()) {
        Ok(())
    } else {
        Err(ApiError {
            status: 401,
            message: "a valid API key is required (Authorization: Bearer KEY)".into(),
            param: None,
        })
    }
}

async fn completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(s, headers, body, false).await
}

async fn chat_completions(State(s): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    generate(s, headers, body, true).await
}

/// Parses, queues and answers one completion request.
async fn generate(s: Arc<Shared>, headers: HeaderMap, body: Bytes, chat: bool) -> Response {
    if let Err(e) = authorized(&s, &headers) {
        return error_response(&e);
    }
    let request: Request = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return error_response(&ApiError::bad(format!("the body is not a valid request: {e}"), None)),
    };
    if s.stats.unhealthy.load(Ordering::SeqCst) {
        return error_response(&ApiError {
            status: 503,
            message: "the device failed; the server is stopping".into(),
            param: None,
        });
    }
    let (events, mut rx) = unbounded_channel();
    let cancel = Arc::new(std::sync::atomic::AtomicBool::new(false));
    s.stats.queued.fetch_add(1, Ordering::Relaxed);
    let job = Job { request, chat, events, arrived: std::time::Instant::now(), cancel: cancel.clone() };
    if let Err(e) = s.jobs.try_send(job) {
        s.stats.queued.fetch_sub(1, Ordering::Relaxed);
        let (status, message) = match e {
            TrySendError::Full(_) => (429, "the queue is full: retry later"),
            TrySendError::Disconnected(_) => (503, "the server is stopping"),
        };
        return error_response(&ApiError { status, message: message.into(), param: None });
    }
    let (stream, prompt_tokens, stop) = match rx.recv().await {
        Some(Event::Rejected(e)) => return error_response(&e),
        Some(Event::Started { stream, prompt_tokens, stop }) => (stream, prompt_tokens, stop),
        Some(Event::Failed(m)) => return error_response(&ApiError { status: 500, message: m, param: None }),
        _ => return error_response(&ApiError { status: 503, message: "the server is stopping".into(), param: None }),
    };
    let id = format!("{}-{}", if chat { "chatcmpl" } else { "cmpl" }, s.next_id.fetch_add(1, Ordering::Relaxed));
    let meta = Meta { id, model: s.model_id.clone(), created: now(), chat };
    let text = Answer { text: RequestText::new(s.tokenizer.clone(), stop), cancel, prompt_tokens };
    if stream {
        sse(meta, text, rx)
    } else {
        whole(meta, text, rx).await
    }
}

/// A request's answer as its HTTP task builds it from the worker's tokens.
struct Answer {
    text: RequestText,
    /// Set when a stop string ends the text, so that the worker frees the request's slot.
    cancel: Arc<std::sync::atomic::AtomicBool>,
    prompt_tokens: usize,
}

/// What one worker event adds to an answer.
enum Step {
    /// Text to send (maybe empty).
    Text(String),
    /// The answer is complete: its last text, finish reason and usage.
    End(String, &'static str, Value),
    Failed(String),
}

impl Answer {
    fn step(&mut self, ev: Event) -> Step {
        match ev {
            Event::Token(id) => {
                let t = self.text.push(id);
                if self.text.stopped {
                    self.cancel.store(true, Ordering::SeqCst);
                    return Step::End(t, "stop", usage(self.prompt_tokens, self.text.tokens()));
                }
                Step::Text(t)
            }
            Event::Done { finish_reason, prompt_tokens, completion_tokens } => {
                let t = self.text.finish();
                let finish = if self.text.stopped { "stop" } else { finish_reason };
                Step::End(t, finish, usage(prompt_tokens, completion_tokens))
            }
            Event::Failed(m) | Event::Rejected(ApiError { message: m, .. }) => Step::Failed(m),
            Event::Started { .. } => Step::Text(String::new()),
        }
    }
}

/// The fields every response and chunk repeats.
#[derive(Clone)]
struct Meta {
    id: String,
    model: String,
    created: u64,
    chat: bool,
}

impl Meta {
    /// One choice: the whole answer (`stream` false) or a chunk of it.
    fn body(&self, text: &str, finish: Option<&str>, stream: bool, first: bool, usage: Option<Value>) -> Value {
        let choice = match (self.chat, stream) {
            (false, _) => json!({"index": 0, "text": text, "logprobs": null, "finish_reason": finish}),
            (true, false) => {
                json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish})
            }
            (true, true) => {
                let delta =
                    if first { json!({"role": "assistant", "content": text}) } else { json!({"content": text}) };
                json!({"index": 0, "delta": delta, "finish_reason": finish})
            }
        };
        let object = match (self.chat, stream) {
            (false, _) => "text_completion",
            (true, false) => "chat.completion",
            (true, true) => "chat.completion.chunk",
        };
        let mut v =
            json!({"id": self.id, "object": object, "created": self.created, "model": self.model, "choices": [choice]});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        v
    }
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// The whole answer as one JSON body.
async fn whole(meta: Meta, mut answer: Answer, mut rx: UnboundedReceiver<Event>) -> Response {
    let mut text = String::new();
    while let Some(ev) = rx.recv().await {
        match answer.step(ev) {
            Step::Text(t) => text.push_str(&t),
            Step::End(t, finish, usage) => {
                text.push_str(&t);
                return axum::Json(meta.body(&text, Some(finish), false, true, Some(usage))).into_response();
            }
            Step::Failed(m) => return error_response(&ApiError { status: 500, message: m, param: None }),
        }
    }
    error_response(&ApiError { status: 503, message: "the server stopped during the request".into(), param: None })
}

/// The answer as server-sent events: one `data:` line per piece of text, then a chunk with
/// the finish reason (and usage), then `data: [DONE]`. A client that goes away drops the
/// stream and with it the receiver, which frees the request's slot.
fn sse(meta: Meta, mut answer: Answer, rx: UnboundedReceiver<Event>) -> Response {
    let mut first = true;
    let mut ended = false;
    // The stream ends when the worker drops its sender (the sequence ended, or the stop string
    // the answer found freed the slot); events after the end are dropped.
    let events = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).filter_map(move |ev| {
        if ended {
            return None;
        }
        let data = match answer.step(ev) {
            Step::Text(t) if t.is_empty() => return None,
            Step::Text(t) => {
                let v = meta.body(&t, None, true, first, None);
                first = false;
                v.to_string()
            }
            Step::End(t, finish, usage) => {
                ended = true;
                let mut out = String::new();
                if !t.is_empty() {
                    out = format!("{}\n\ndata: ", meta.body(&t, None, true, first, None));
                    first = false;
                }
                let v = meta.body("", Some(finish), true, first, Some(usage));
                format!("{out}{v}\n\ndata: [DONE]")
            }
            Step::Failed(m) => {
                ended = true;
                ApiError { status: 500, message: m, param: None }.body().to_string()
            }
        };
        Some(Ok::<_, std::convert::Infallible>(Bytes::from(format!("data: {data}\n\n"))))
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(events))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

async fn models(State(s): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    if let Err(e) = authorized(&s, &headers) {
        return error_response(&e);
    }
    axum::Json(json!({"object": "list", "data": [{"id": s.model_id, "object": "model", "created": now(), "owned_by": "kiln"}]}))
        .into_response()
}

async fn health(State(s): State<Arc<Shared>>) -> Response {
    if s.stats.unhealthy.load(Ordering::SeqCst) {
        (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": "device error"}))).into_response()
    } else {
        axum::Json(json!({"status": "ok"})).into_response()
    }
}

/// Prometheus text exposition format 0.0.4.
async fn metrics(State(s): State<Arc<Shared>>) -> Response {
    let st = &s.stats;
    let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let rows = [
        ("kiln_requests_queued", "gauge", "Requests waiting for the worker.", load(&st.queued)),
        ("kiln_requests_running", "gauge", "Requests being generated.", load(&st.running)),
        ("kiln_requests_completed_total", "counter", "Requests answered in full.", load(&st.completed)),
        ("kiln_requests_failed_total", "counter", "Requests whose generation failed.", load(&st.failed)),
        ("kiln_requests_disconnected_total", "counter", "Requests whose client went away.", load(&st.disconnected)),
        ("kiln_requests_timed_out_total", "counter", "Requests past --request-timeout.", load(&st.timed_out)),
        ("kiln_batch_slots", "gauge", "Sequences the continuous batch holds at most.", load(&st.batch_slots)),
        (
            "kiln_batch_rows",
            "gauge",
            "Rows of the continuous batch after its last join or step (they follow the load; on a GPU, the graph bucket).",
            load(&st.batch_rows),
        ),
        ("kiln_batch_steps_total", "counter", "Decode steps of the continuous batch.", load(&st.batch_steps)),
        (
            "kiln_batch_tokens_total",
            "counter",
            "Tokens the batch's decode steps gave requests.",
            load(&st.batch_tokens),
        ),
        ("kiln_batch_step_microseconds_total", "counter", "Wall time of the decode steps.", load(&st.batch_step_us)),
        ("kiln_join_microseconds_total", "counter", "Wall time of joining requests (prefill).", load(&st.join_us)),
        ("kiln_prompt_tokens_total", "counter", "Prompt tokens processed.", load(&st.prompt_tokens)),
        ("kiln_generation_tokens_total", "counter", "Tokens generated.", load(&st.completion_tokens)),
        (
            "kiln_device_memory_bytes",
            "gauge",
            "Bytes kiln holds on the device: its pool's, in use and cached, and the KV caches' mapped (0 on the CPU).",
            load(&st.device_memory),
        ),
        (
            "kiln_kv_cache_mapped_bytes",
            "gauge",
            "Bytes mapped into the KV caches' reserved addresses (they follow the batch's rows; 0 on the CPU).",
            load(&st.kv_mapped),
        ),
        ("process_resident_memory_bytes", "gauge", "Resident memory size in bytes.", resident_bytes()),
    ];
    let mut text = String::new();
    for (name, kind, help, v) in rows {
        text.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"));
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// The process's resident set in bytes (Linux `/proc/self/statm` pages × the page size; 0
/// elsewhere), as Prometheus' standard process collector reports it.
fn resident_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages = statm.split_whitespace().nth(1).and_then(|p| p.parse::<u64>().ok()).unwrap_or(0);
    // SAFETY: sysconf only reads a system constant.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    pages * u64::try_from(page).unwrap_or(4096)
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

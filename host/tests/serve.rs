//! `kiln serve` end to end on loopback, on the CPU: an OpenAI-style client gets
//! onnxruntime-genai's greedy text; 64 concurrent streaming clients each get their own
//! sequence's text through the continuous batch; malformed, oversize, over-context,
//! unsupported and disconnecting clients leave the server serving; timeouts fail clearly.
//! Plain HTTP/1.1 over `TcpStream` (`Connection: close`), so a client can also misbehave.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use kiln_host::ep::{Runtime, SessionOptions};
use kiln_host::genai::{GenerateOptions, Generator, ModelFolder, SamplingParams};
use serde_json::{json, Value};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn fixtures() -> PathBuf {
    std::env::var_os("KILN_FIXTURES").map(PathBuf::from).unwrap_or_else(|| root().join("../shared/fixtures"))
}

fn tiny_llama() -> PathBuf {
    let dir = fixtures().join("llm/tiny-llama-v512-fp32-cpu");
    assert!(dir.is_dir(), "fixture {} is missing: set KILN_FIXTURES (see ../shared/fixtures/README.md)", dir.display());
    dir
}

/// A running `kiln serve`, killed when dropped.
struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Server {
    /// Starts `kiln serve` on the tiny-llama fixture, any free loopback port, with `extra`
    /// arguments; waits for its "listening on" line.
    fn start(extra: &[&str]) -> Server {
        let dir = tiny_llama();
        let mut args = vec!["serve", dir.to_str().unwrap(), "--port", "0", "--device", "cpu"];
        args.extend_from_slice(extra);
        let mut child = Command::new(env!("CARGO_BIN_EXE_kiln"))
            .args(&args)
            .current_dir(root())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("kiln serve starts");
        let mut err = BufReader::new(child.stderr.take().unwrap());
        let mut line = String::new();
        let addr = loop {
            line.clear();
            assert!(err.read_line(&mut line).unwrap() > 0, "kiln serve ended before listening");
            if let Some(rest) = line.split("listening on http://").nth(1) {
                break rest.split_whitespace().next().unwrap().parse().unwrap();
            }
        };
        // Keep draining stderr so the server never blocks on it.
        std::thread::spawn(move || std::io::copy(&mut err, &mut std::io::sink()));
        Server { child, addr }
    }

    /// Sends raw bytes; returns the status and the body (de-chunked).
    fn raw(&self, request: &[u8]) -> (u16, String) {
        let (status, _, body) = self.raw_with_head(request);
        (status, body)
    }

    /// As [`Server::raw`], with the response's head (status line and headers) too.
    fn raw_with_head(&self, request: &[u8]) -> (u16, String, String) {
        let mut s = TcpStream::connect(self.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
        s.write_all(request).unwrap();
        let mut out = Vec::new();
        s.read_to_end(&mut out).unwrap();
        let head = String::from_utf8_lossy(&out).split("\r\n\r\n").next().unwrap_or("").to_string();
        let (status, body) = parse(&out);
        (status, head, body)
    }

    fn post(&self, path: &str, body: &str) -> (u16, String) {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        self.raw(&[head.as_bytes(), body.as_bytes()].concat())
    }

    fn get(&self, path: &str) -> (u16, String) {
        self.raw(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
    }

    /// A completion's text: the whole body's, or (stream) the SSE chunks' joined.
    fn complete(&self, body: Value) -> String {
        let stream = body["stream"].as_bool().unwrap_or(false);
        let (status, text) = self.post("/v1/completions", &body.to_string());
        assert_eq!(status, 200, "{text}");
        if !stream {
            let v: Value = serde_json::from_str(&text).unwrap();
            return v["choices"][0]["text"].as_str().unwrap().to_string();
        }
        let mut out = String::new();
        let lines: Vec<&str> = text.lines().filter_map(|l| l.strip_prefix("data: ")).collect();
        assert_eq!(lines.last(), Some(&"[DONE]"), "{text}");
        for l in &lines[..lines.len() - 1] {
            let v: Value = serde_json::from_str(l).unwrap();
            out.push_str(v["choices"][0]["text"].as_str().unwrap_or(""));
        }
        out
    }

    /// Opens a streaming completion of `body` and waits for its first bytes; the connection
    /// stays open (a client still reading) until the returned stream is dropped.
    fn open_stream(&self, body: &Value) -> TcpStream {
        let body = body.to_string();
        let mut s = TcpStream::connect(self.addr).unwrap();
        let head = format!(
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(&[head.as_bytes(), body.as_bytes()].concat()).unwrap();
        let mut first = [0u8; 32];
        let n = s.read(&mut first).unwrap();
        let head = String::from_utf8_lossy(&first[..n]);
        assert!(head.starts_with("HTTP/1.1 200"), "{body}: {head}");
        s
    }

    fn metric(&self, name: &str) -> u64 {
        let (_, text) = self.get("/metrics");
        let line = text.lines().find(|l| l.starts_with(&format!("{name} "))).unwrap_or_else(|| panic!("{text}"));
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Status code and body of an HTTP/1.1 response (chunked transfer decoded).
fn parse(bytes: &[u8]) -> (u16, String) {
    let text = String::from_utf8_lossy(bytes).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return (status, body.to_string());
    }
    let (mut out, mut rest) = (String::new(), body);
    while let Some((size, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    (status, out)
}

/// kiln's own greedy text for each prompt, generated alone in this process.
fn greedy_texts(prompts: &[String], max_new_tokens: usize) -> Vec<String> {
    texts(prompts, max_new_tokens, &SamplingParams::default(), false)
}

/// kiln's own text for each prompt with `sampling`, generated alone in this process.
fn texts(prompts: &[String], max_new_tokens: usize, sampling: &SamplingParams, ignore_eos: bool) -> Vec<String> {
    texts_each(prompts, max_new_tokens, |_| (sampling.clone(), ignore_eos))
}

/// kiln's own text for prompt `i` with the sampling parameters and `ignore_eos` that
/// `params(i)` gives, each generated alone in this process.
fn texts_each(
    prompts: &[String],
    max_new_tokens: usize,
    params: impl Fn(usize) -> (SamplingParams, bool),
) -> Vec<String> {
    let (registry, errors) = kiln_host::packages::registry(&[], &[]);
    assert!(errors.is_empty(), "{errors:?}");
    let rt = Runtime::new(registry, Default::default()).unwrap();
    let folder = ModelFolder::open(&tiny_llama()).unwrap();
    let mut g = Generator::new(rt, folder, SessionOptions::default()).unwrap();
    prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (sampling, ignore_eos) = params(i);
            let opts = GenerateOptions { max_new_tokens, max_length: None, sampling, ignore_eos, stop: None };
            let ids = g.folder.encode(p).unwrap();
            let out = g.generate(&[ids], &opts, &mut |_, _| {}).unwrap();
            g.folder.decode(&out.rows[0].generated_ids).unwrap()
        })
        .collect()
}

/// The server's greedy completion is onnxruntime-genai's greedy text, whole and streamed.
#[test]
fn a_completion_is_onnxruntime_genais_greedy_text() {
    let reference: Value = serde_json::from_slice(
        &std::fs::read(fixtures().join("llm/references/tiny-llama-v512-fp32-cpu/genai_greedy.json")).unwrap(),
    )
    .unwrap();
    let run = reference["runs"].as_array().unwrap().iter().find(|r| r["prompt_id"] == "plain_once_upon").unwrap();
    let ids: Vec<i64> =
        run["generated_token_ids"].as_array().unwrap()[..16].iter().map(|v| v.as_i64().unwrap()).collect();
    let expected = ModelFolder::open(&tiny_llama()).unwrap().decode(&ids).unwrap();
    let server = Server::start(&["--batch", "2"]);
    let ask = json!({"model": "m", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0});
    assert_eq!(server.complete(ask.clone()), expected);
    let mut stream = ask;
    stream["stream"] = json!(true);
    assert_eq!(server.complete(stream), expected);
    // A stop string cuts the text before it, whole and streamed, and frees the slot.
    let cut = expected.char_indices().nth(12).map(|(i, _)| i).unwrap();
    let stop: String = expected[cut..].chars().take(3).collect();
    let at = expected.find(&stop).unwrap();
    for stream in [false, true] {
        let body =
            json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "stop": [stop], "stream": stream});
        assert_eq!(server.complete(body), expected[..at], "stop {stop:?}, stream {stream}");
    }
    let (_, body) = server.post(
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 16,
        "temperature": 0, "stop": stop})
        .to_string(),
    );
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{body}");
    // A sampled request: kiln generate's draws for a single prompt with its seed.
    let sampling =
        SamplingParams { do_sample: true, temperature: 0.9, top_k: 40, top_p: 0.9, repetition_penalty: 1.2, seed: 5 };
    let want = texts(&["Once upon a time".into()], 16, &sampling, true)[0].clone();
    let body = json!({"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.9, "top_k": 40, "top_p": 0.9,
        "repetition_penalty": 1.2, "seed": 5, "ignore_eos": true});
    let got = server.complete(body);
    assert_eq!(got, want);
    assert_ne!(got, expected, "sampling left the greedy text");
}

/// 64 concurrent streaming clients, 8 slots, half of them greedy and half sampled with seeds
/// of their own: every one completes with its own prompt's text, the text `kiln generate` gives
/// that prompt alone with that seed (exact on the CPU, whatever slot a request lands in), and
/// the batch decoded them together. Also with `--batch-invariant` (each request prefilled alone).
#[test]
fn sixty_four_concurrent_streaming_clients_each_get_their_own_text() {
    let prompts: Vec<String> = (0..64)
        .map(|i| match i % 4 {
            0 => format!("Once upon a time there were {i} cats"),
            1 => format!("The number {i} is"),
            2 => format!("Tom had {i} apples and"),
            _ => format!("Lily saw {i} birds in the"),
        })
        .collect();
    let sampling = |i: usize| SamplingParams {
        do_sample: true,
        temperature: 0.9,
        top_k: 40,
        top_p: 0.9,
        repetition_penalty: 1.1,
        seed: 100 + i as u64,
    };
    let expected = texts_each(&prompts, 12, |i| match i % 2 {
        0 => (SamplingParams::default(), false),
        _ => (sampling(i), true),
    });
    let distinct: std::collections::HashSet<&String> = expected.iter().collect();
    assert!(distinct.len() > 32 && expected.iter().all(|t| t.len() > 8), "the prompts' answers differ: {expected:?}");
    for invariant in [false, true] {
        let mut args = vec!["--batch", "8", "--queue", "64"];
        if invariant {
            args.push("--batch-invariant");
        }
        let server = Server::start(&args);
        let got: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let server = &server;
                    let body = match i % 2 {
                        0 => json!({"prompt": p, "max_tokens": 12, "temperature": 0, "stream": true}),
                        _ => json!({"prompt": p, "max_tokens": 12, "temperature": 0.9, "top_k": 40, "top_p": 0.9,
                            "repetition_penalty": 1.1, "seed": 100 + i, "ignore_eos": true, "stream": true}),
                    };
                    s.spawn(move || server.complete(body))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g, e, "client {i} ({:?}), --batch-invariant {invariant}", prompts[i]);
        }
        assert_eq!(server.metric("kiln_requests_completed_total"), 64);
        assert_eq!(server.metric("kiln_batch_slots"), 8);
        let steps = server.metric("kiln_batch_steps_total");
        assert!(steps < 64 * 11, "the requests shared decode steps: {steps} steps");
        // A request alone afterwards runs its steps on one row, unless batch-invariant (every
        // slot's), and gets the same text.
        let alone = server.complete(json!({"prompt": prompts[0], "max_tokens": 12, "temperature": 0, "stream": true}));
        assert_eq!(alone, expected[0]);
        assert_eq!(server.metric("kiln_batch_rows"), if invariant { 8 } else { 1 });
    }
}

/// Malformed, oversize, over-context and unsupported requests get their 4xx with a clear
/// message; a client that disconnects mid-stream frees its slot; the server keeps serving.
#[test]
fn bad_and_vanishing_clients_leave_the_server_serving() {
    let server = Server::start(&["--batch", "2", "--max-body-bytes", "4096", "--max-length", "128"]);
    let (status, body) = server.post("/v1/completions", "{not json");
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("invalid_request_error"), "{body}");
    let (status, _) = server.post("/v1/completions", &format!("{{\"prompt\": \"{}\"}}", "a".repeat(8000)));
    assert_eq!(status, 413);
    let (status, body) = server.post("/v1/completions", &json!({"prompt": "Hi", "max_tokens": 500}).to_string());
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("128"), "the limit is named: {body}");
    let (status, body) = server.post("/v1/completions", &json!({"prompt": "Hi", "n": 2}).to_string());
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("\"n\""), "the parameter is named: {body}");
    // A streaming client that reads one chunk and goes away.
    for _ in 0..3 {
        drop(server.open_stream(&json!({"prompt": "Once upon a time", "max_tokens": 100, "stream": true,
            "temperature": 0, "ignore_eos": true})));
    }
    let (status, _) = server.get("/health");
    assert_eq!(status, 200);
    let text = server.complete(json!({"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}));
    assert_eq!(text, greedy_texts(&["Once upon a time".into()], 8)[0]);
    // Every vanished client's slot was freed (none of them ran its 100 tokens to the end).
    assert_eq!(server.metric("kiln_requests_running"), 0);
    assert_eq!(server.metric("kiln_requests_completed_total"), 1, "only the last request completed");
    assert_eq!(server.metric("kiln_requests_disconnected_total"), 3);
}

/// A request that runs past `--request-timeout` fails with a message naming the flag.
#[test]
fn a_request_past_its_timeout_fails_clearly() {
    let server = Server::start(&["--request-timeout", "0.05", "--max-length", "512"]);
    let body = json!({"prompt": "Once upon a time", "max_tokens": 480, "temperature": 0, "ignore_eos": true});
    let (status, text) = server.post("/v1/completions", &body.to_string());
    assert_eq!(status, 500, "{text}");
    assert!(text.contains("--request-timeout"), "{text}");
    assert_eq!(server.metric("kiln_requests_timed_out_total"), 1);
}

/// Over the queue: with one slot busy and one request waiting (`--queue 1`), the next request
/// gets 429 with `Retry-After`; the waiting one is served once the slot frees.
#[test]
fn a_full_queue_answers_429_with_retry_after() {
    let server = Server::start(&["--batch", "1", "--queue", "1", "--max-length", "512"]);
    let long = json!({"prompt": "Once upon a time", "max_tokens": 400, "stream": true, "temperature": 0,
        "ignore_eos": true});
    // A streaming request that holds the only slot until we close it.
    let busy = server.open_stream(&long);
    let long = long.to_string();
    std::thread::scope(|s| {
        let waiting = s.spawn(|| server.complete(json!({"prompt": "Hello", "max_tokens": 4, "temperature": 0})));
        let t0 = std::time::Instant::now();
        while server.metric("kiln_requests_queued") < 1 {
            assert!(t0.elapsed() < Duration::from_secs(60), "the second request never queued");
            std::thread::sleep(Duration::from_millis(5));
        }
        let (status, head, body) = server.raw_with_head(
            format!(
                "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
                long.len(),
                long
            )
            .as_bytes(),
        );
        assert_eq!(status, 429, "{body}");
        assert!(body.contains("queue"), "{body}");
        assert!(head.to_ascii_lowercase().contains("retry-after: 1"), "{head}");
        drop(busy);
        assert_eq!(waiting.join().unwrap(), greedy_texts(&["Hello".into()], 4)[0]);
    });
}

/// SIGTERM stops accepting, lets the running request finish its stream, and exits 0.
#[test]
#[cfg(unix)]
fn sigterm_lets_the_running_request_finish() {
    let mut server = Server::start(&["--batch", "2"]);
    let mut s = server.open_stream(&json!({"prompt": "Once upon a time", "max_tokens": 200, "stream": true,
        "temperature": 0, "ignore_eos": true}));
    let killed = Command::new("kill").args(["-TERM", &server.child.id().to_string()]).status().unwrap();
    assert!(killed.success());
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).unwrap();
    let text = String::from_utf8_lossy(&rest);
    assert!(text.contains("data: [DONE]"), "the stream ends whole: {text}");
    let status = server.child.wait().unwrap();
    assert!(status.success(), "{status:?}");
}

/// A bounded soak: 12 rounds of 16 concurrent requests (some abandoned mid-stream) keep the
/// server's resident memory flat after the first rounds (within 24 MiB), and every completed
/// request's text is right. `/metrics` reports the resident set too. (The device-memory soak of
/// the same batch is tests/gpu.rs `a_continuous_batch_soak_keeps_device_memory_and_rss_flat`.)
#[test]
#[cfg(target_os = "linux")]
fn a_soak_keeps_the_servers_memory_flat() {
    let server = Server::start(&["--batch", "8", "--queue", "64"]);
    let rss = || -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", server.child.id())).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
    };
    let prompts: Vec<String> = (0..16).map(|i| format!("Tom saw {i} dogs and")).collect();
    let expected = greedy_texts(&prompts, 10);
    let mut after_warmup = 0;
    for round in 0..12 {
        std::thread::scope(|s| {
            for (i, p) in prompts.iter().enumerate() {
                let (server, want) = (&server, &expected[i]);
                s.spawn(move || {
                    if i % 5 == 4 {
                        // Abandoned after its first chunk.
                        drop(
                            server.open_stream(
                                &json!({"prompt": p, "max_tokens": 60, "stream": true, "ignore_eos": true}),
                            ),
                        );
                    } else {
                        let got = server
                            .complete(json!({"prompt": p, "max_tokens": 10, "temperature": 0, "stream": i % 2 == 0}));
                        assert_eq!(&got, want, "round {round}, client {i}");
                    }
                });
            }
        });
        if round == 3 {
            after_warmup = rss();
        }
    }
    let end = rss();
    println!("server RSS: {} MiB after warm-up, {} MiB at the end", after_warmup >> 20, end >> 20);
    assert!(end <= after_warmup + (24 << 20), "RSS grew from {after_warmup} to {end} bytes");
    // /metrics reports the same resident set (Prometheus' process gauge), and no device pool.
    let reported = server.metric("process_resident_memory_bytes");
    assert!(reported.abs_diff(end) < 8 << 20, "/metrics says {reported} B resident, /proc {end} B");
    assert_eq!(server.metric("kiln_device_memory_bytes"), 0);
}

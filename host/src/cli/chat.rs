//! `kiln chat MODEL_DIR`: an interactive multi-turn chat through the folder's chat template.
//! Each line on standard input is a user turn; the answer streams to standard output.
//! `/reset` clears the history, `/exit` (or the end of input) ends the chat, and Ctrl-C stops
//! the answer being generated (the chat goes on). The conversation is kept within the
//! context: the oldest turns are dropped, and the chat says so on standard error.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::ep::Runtime;
use crate::genai::{ChatMessage, GenerateOptions, Generator, ModelFolder, StopReason, TextStream};
use crate::{Error, Result};

use super::generate::{sampling, SamplingArgs};
use super::output::note;
use super::{choose_device, model_registry, GraphArgs, ModelRunArgs};

/// Arguments of `kiln chat`.
#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    /// An onnxruntime-genai model folder with a chat_template.jinja.
    pub model_dir: PathBuf,
    /// The system message (the template's own default when not given).
    #[arg(long)]
    pub system: Option<String>,
    /// Most tokens of one answer.
    #[arg(long, default_value_t = 512)]
    pub max_new_tokens: usize,
    /// Longest conversation in tokens (prompt + answer); default and upper bound: the folder's
    /// context. Older turns are dropped to stay within it.
    #[arg(long)]
    pub max_length: Option<usize>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub graph: GraphArgs,
    #[command(flatten)]
    pub target: ModelRunArgs,
}

/// Set by SIGINT while an answer is generated.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

#[cfg(unix)]
extern "C" fn on_sigint(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT stops the answer while this guard lives; afterwards Ctrl-C ends kiln as usual.
struct CatchInterrupt;

impl CatchInterrupt {
    fn new() -> CatchInterrupt {
        INTERRUPTED.store(false, Ordering::SeqCst);
        #[cfg(unix)]
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe {
            libc::signal(libc::SIGINT, on_sigint as *const () as libc::sighandler_t);
        }
        CatchInterrupt
    }
}

impl Drop for CatchInterrupt {
    fn drop(&mut self) {
        #[cfg(unix)]
        // SAFETY: restores the default disposition.
        unsafe {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
        }
    }
}

/// The conversation's prompt ids within `budget` tokens: the system message, then as many of
/// the latest turns as fit (always the current one). Returns the ids and how many of the
/// oldest messages were left out. Errors: the current turn alone does not fit.
fn fit(
    folder: &ModelFolder,
    system: Option<&str>,
    history: &[ChatMessage],
    budget: usize,
) -> Result<(Vec<i64>, usize)> {
    let mut skip = 0;
    loop {
        let mut messages: Vec<ChatMessage> = system.map(|s| ChatMessage::new("system", s)).into_iter().collect();
        messages.extend(history[skip..].iter().cloned());
        let ids = folder.encode(&folder.render_chat(&messages)?)?;
        if ids.len() <= budget {
            return Ok((ids, skip));
        }
        // Drop the oldest user turn and its answer; the current turn is the last message.
        if skip + 2 >= history.len() {
            return Err(Error::Input(format!(
                "with the system prompt it takes {} tokens, and a prompt may take at most {budget} (--max-length less \
                 --max-new-tokens)",
                ids.len()
            )));
        }
        skip += 2;
    }
}

/// `kiln chat`.
pub fn run(a: ChatArgs) -> Result<ExitCode> {
    let device = choose_device(a.target.resolve.device)?;
    let graphs = a.graph.mode(device)?;
    if a.max_new_tokens == 0 {
        return Err(Error::Input("--max-new-tokens must be at least 1".into()));
    }
    let folder = ModelFolder::open(&a.model_dir)?;
    if folder.chat_template.is_none() {
        return Err(Error::Input(format!(
            "{} has no chat_template.jinja: kiln chat needs the folder's chat template (kiln generate runs plain prompts)",
            a.model_dir.display()
        )));
    }
    let max_length =
        folder.config.checked_max_length(a.max_length).map_err(|e| Error::Input(format!("--max-length: {e}")))?;
    if a.max_new_tokens >= max_length {
        return Err(Error::Input(format!(
            "--max-new-tokens {} leaves no room for a prompt in a conversation of at most {max_length} tokens",
            a.max_new_tokens
        )));
    }
    let params = sampling(&a.sampling, &folder)?;
    let rt = Runtime::new(model_registry(&a.target.resolve.packages, &a.model_dir)?, super::sandbox_config())?;
    let options = a.target.session_options(device, graphs)?;
    let loading = super::progress::Progress::spinner("loading the model");
    let mut generator = Generator::new(rt, folder, options)?;
    drop(loading);
    let interactive = std::io::stdin().is_terminal();
    if interactive {
        note!("kiln chat on {device}: type a message; /reset clears the history, /exit ends, Ctrl-C stops an answer");
    }
    let mut history: Vec<ChatMessage> = Vec::new();
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        if interactive {
            eprint!("> ");
            let _ = std::io::stderr().flush();
        }
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|e| Error::Input(format!("reading standard input: {e}")))?;
        let text = line.trim();
        let text = match text {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                history.clear();
                note!("kiln: history cleared");
                continue;
            }
            t if t.starts_with("//") => &t[1..],
            t if t.starts_with('/') => {
                eprintln!(
                    "kiln: unknown command {t}: the commands are /reset and /exit (start a message with // to send a \
                     leading /)"
                );
                continue;
            }
            t => t,
        };
        history.push(ChatMessage::new("user", text));
        let (prompt, dropped) =
            match fit(&generator.folder, a.system.as_deref(), &history, max_length - a.max_new_tokens) {
                Ok(x) => x,
                Err(e) => {
                    history.pop();
                    eprintln!("kiln: turn skipped: {e}");
                    continue;
                }
            };
        if dropped > 0 {
            history.drain(..dropped);
            note!("kiln: dropped the oldest {} message(s) to stay within {max_length} tokens", dropped);
        }
        let opts = GenerateOptions {
            max_new_tokens: a.max_new_tokens,
            max_length: Some(max_length),
            sampling: params.clone(),
            ignore_eos: false,
            stop: Some(&INTERRUPTED),
        };
        let mut stream = TextStream::new(generator.folder.tokenizer.clone());
        let mut out = std::io::stdout();
        let result = {
            let _catch = CatchInterrupt::new();
            generator.generate(&[prompt], &opts, &mut |_, id| {
                if let Some(piece) = stream.push(id) {
                    let _ = write!(out, "{piece}");
                    let _ = out.flush();
                }
            })
        };
        let row = match result {
            Ok(mut g) => g.rows.remove(0),
            Err(e) => {
                history.pop();
                println!();
                eprintln!("kiln: error: {e}");
                continue;
            }
        };
        let answer = generator.folder.decode(&row.generated_ids)?;
        let rest = stream.rest(&answer);
        println!("{rest}");
        match row.stopped_by {
            StopReason::Interrupted => note!("kiln: stopped"),
            StopReason::MaxNewTokens => note!("kiln: the answer reached --max-new-tokens {}", a.max_new_tokens),
            StopReason::MaxLength => note!("kiln: the conversation reached {max_length} tokens"),
            StopReason::Eos => {}
        }
        history.push(ChatMessage::new("assistant", answer.trim()));
    }
    Ok(ExitCode::SUCCESS)
}

//! `kiln serve MODEL_DIR`: the OpenAI-compatible HTTP server of [`crate::serve`].

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::process::ExitCode;

use crate::ep::Runtime;
use crate::genai::{Generator, ModelFolder};
use crate::serve::api::Limits;
use crate::serve::{serve, ServeOptions};
use crate::{Error, Result};

use super::{choose_device, model_registry, GraphArgs, ModelRunArgs};

/// Arguments of `kiln serve`.
#[derive(clap::Args, Debug)]
pub struct ServeArgs {
    /// An onnxruntime-genai model folder.
    pub model_dir: PathBuf,
    /// Address to listen on: loopback unless you choose otherwise.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: IpAddr,
    /// Port to listen on (0: any free port; the address is printed on standard error).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (also `KILN_API_KEY`).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests decoded together: the continuous batch's slots (on a GPU, rounded up to its
    /// graph bucket: 1, 2, 4, 8, 16, 32, then multiples of 32). Each slot holds a KV cache of
    /// --max-length positions.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// A request's output does not depend on what else is in the batch: each request's prompt
    /// is prefilled alone (not with the requests arriving beside it), at a shape fixed by its
    /// own length. Decode steps always are (fixed rows, each row's arithmetic apart, each
    /// request's draws from its own seed). Costs one prefill per request.
    #[arg(long)]
    pub batch_invariant: bool,
    /// Longest a request may take from its arrival, in seconds; past it, it fails with a
    /// message saying so.
    #[arg(long, default_value_t = 600.0)]
    pub request_timeout: f64,
    /// Requests that may wait for a slot; more get 429.
    #[arg(long, default_value_t = 64)]
    pub queue: usize,
    /// Largest request body in bytes; larger ones get 413.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Longest sequence (prompt + max_tokens) a request may ask for; default and upper bound:
    /// the folder's context.
    #[arg(long)]
    pub max_length: Option<usize>,
    /// max_tokens of a request that gives none.
    #[arg(long, default_value_t = 256)]
    pub default_max_tokens: usize,
    #[command(flatten)]
    pub graph: GraphArgs,
    #[command(flatten)]
    pub target: ModelRunArgs,
}

/// `kiln serve`.
pub fn run(a: ServeArgs) -> Result<ExitCode> {
    if a.queue == 0 {
        return Err(Error::Input("--queue must be at least 1".into()));
    }
    if a.batch == 0 {
        return Err(Error::Input("--batch must be at least 1".into()));
    }
    if !(a.request_timeout > 0.0 && a.request_timeout.is_finite()) {
        return Err(Error::Input(format!(
            "--request-timeout must be a positive number of seconds, not {}",
            a.request_timeout
        )));
    }
    if a.default_max_tokens == 0 {
        return Err(Error::Input("--default-max-tokens must be at least 1".into()));
    }
    let device = choose_device(a.target.resolve.device)?;
    let graphs = a.graph.mode(device)?;
    let folder = ModelFolder::open(&a.model_dir)?;
    let max_length =
        folder.config.checked_max_length(a.max_length).map_err(|e| Error::Input(format!("--max-length: {e}")))?;
    let model_id = a
        .model_dir
        .canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
        .unwrap_or_else(|| a.model_dir.display().to_string());
    let limits =
        Limits { max_length, default_max_tokens: a.default_max_tokens, default_top_k: folder.config.search.top_k };
    let rt = Runtime::new(model_registry(&a.target.resolve.packages, &a.model_dir)?, super::sandbox_config())?;
    let options = a.target.session_options(device, graphs)?;
    let opts = ServeOptions {
        addr: SocketAddr::new(a.host, a.port),
        api_key: a.api_key.or_else(|| std::env::var("KILN_API_KEY").ok().filter(|k| !k.is_empty())),
        queue: a.queue,
        max_body_bytes: a.max_body_bytes,
        model_id,
        limits,
        batch: a.batch,
        batch_invariant: a.batch_invariant,
        timeout: std::time::Duration::from_secs_f64(a.request_timeout),
        tokenizer: folder.tokenizer.clone(),
    };
    let loading = super::progress::Progress::spinner("loading the model");
    serve(
        move || Generator::new(rt, folder, options),
        opts,
        |addr| {
            drop(loading);
            eprintln!(
                "kiln serve: listening on http://{addr} ({device}; OpenAI API under /v1; Ctrl-C or SIGTERM stops)"
            );
        },
    )?;
    Ok(ExitCode::SUCCESS)
}

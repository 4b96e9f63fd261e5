//! onnxruntime-genai's generation API over a kiln `Generator`: `Model(path)`,
//! `Tokenizer(model)` with `encode` / `decode` / `create_stream` / `apply_chat_template`,
//! `GeneratorParams(model).set_search_options(...)` and `Generator(model, params)` with
//! `append_tokens`, `generate_next_token`, `get_next_tokens`, `is_done` and `get_sequence`.
//! Decode samples on the host from each step's logits (`kiln_host::genai::Sampler`, the same
//! choices as `kiln generate`).

use std::sync::{Arc, Mutex};

use kiln_host::ep::SessionOptions;
use kiln_host::genai::{
    ChatMessage, Generator as KilnGenerator, KvCache, ModelFolder, Sampler, SamplingParams, TextStream,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::arrays::{ids_array, ids_from};
use crate::errors::{raise, IntoPy, Kind};
use crate::owner::Owner;

/// `kiln.Model(path, providers=None)`: an onnxruntime-genai model folder loaded on the first of
/// `providers` this machine has (as `InferenceSession`).
#[pyclass(module = "kiln", frozen)]
pub struct Model {
    generator: Arc<Owner<KilnGenerator>>,
    folder: ModelFolder,
    on_gpu: bool,
}

#[pymethods]
impl Model {
    #[new]
    #[pyo3(signature = (path, providers=None))]
    fn new(py: Python<'_>, path: std::path::PathBuf, providers: Option<&Bound<'_, PyAny>>) -> PyResult<Model> {
        let (device, _) = crate::providers::device(providers, None)?;
        let folder = py.detach(|| ModelFolder::open(&path)).py_err()?;
        let for_thread = folder.clone();
        let g = py.detach(move || {
            Owner::new("kiln-generator", move || {
                KilnGenerator::new(
                    crate::session::runtime()?,
                    for_thread,
                    SessionOptions { device, ..SessionOptions::default() },
                )
            })
        });
        Ok(Model { generator: Arc::new(g.py_err()?), folder, on_gpu: device != kiln_host::ep::Device::Cpu })
    }

    /// `"cuda"` or `"cpu"`.
    #[getter]
    fn device_type(&self) -> &'static str {
        if self.on_gpu {
            "cuda"
        } else {
            "cpu"
        }
    }
}

/// `kiln.Tokenizer(model)`: the folder's tokenizer (`tokenizer.json`) and chat template.
#[pyclass(module = "kiln", frozen)]
pub struct Tokenizer {
    folder: ModelFolder,
}

#[pymethods]
impl Tokenizer {
    #[new]
    fn new(model: &Model) -> Tokenizer {
        Tokenizer { folder: model.folder.clone() }
    }

    /// Token ids of `text` (numpy int32, as onnxruntime-genai returns them).
    fn encode<'py>(&self, py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
        Ok(ids_array(py, &self.folder.encode(text).py_err()?))
    }

    /// The text of token ids (a numpy array or a list of ints).
    fn decode(&self, ids: &Bound<'_, PyAny>) -> PyResult<String> {
        self.folder.decode(&ids_from("ids", ids)?).py_err()
    }

    /// A stream that turns one token at a time into text.
    fn create_stream(&self) -> TokenizerStream {
        TokenizerStream { stream: Mutex::new(TextStream::new(self.folder.tokenizer.clone())) }
    }

    /// The prompt of a conversation through the folder's chat template: `messages` is a JSON
    /// string (as onnxruntime-genai takes it) or a list of `{"role", "content"}` dicts.
    #[pyo3(signature = (messages, add_generation_prompt=true))]
    fn apply_chat_template(&self, messages: &Bound<'_, PyAny>, add_generation_prompt: bool) -> PyResult<String> {
        if !add_generation_prompt {
            return Err(raise(Kind::Unsupported, "kiln renders chat templates with add_generation_prompt=True only"));
        }
        let list: Vec<(String, String)> = if let Ok(s) = messages.extract::<String>() {
            let v: Vec<std::collections::HashMap<String, String>> = messages_from_json(&s)?;
            v.into_iter()
                .map(|m| (m.get("role").cloned().unwrap_or_default(), m.get("content").cloned().unwrap_or_default()))
                .collect()
        } else {
            let mut out = Vec::new();
            for m in messages.try_iter()? {
                let m = m?;
                let d = m
                    .cast::<PyDict>()
                    .map_err(|_| raise(Kind::InvalidInput, "messages: dicts with role and content"))?;
                let get = |k: &str| -> PyResult<String> {
                    d.get_item(k)?
                        .map(|v| v.extract::<String>())
                        .transpose()?
                        .ok_or_else(|| raise(Kind::InvalidInput, format!("messages: every message needs {k:?}")))
                };
                out.push((get("role")?, get("content")?));
            }
            out
        };
        let msgs: Vec<ChatMessage> = list.into_iter().map(|(role, content)| ChatMessage { role, content }).collect();
        self.folder.render_chat(&msgs).py_err()
    }
}

/// A conversation given as a JSON string (onnxruntime-genai's form), parsed with Python's own
/// `json` module.
fn messages_from_json(s: &str) -> PyResult<Vec<std::collections::HashMap<String, String>>> {
    Python::attach(|py| {
        let v = py.import("json")?.call_method1("loads", (s,))?;
        v.extract().map_err(|_| raise(Kind::InvalidInput, "messages: a JSON list of {\"role\", \"content\"} objects"))
    })
}

/// `tokenizer.create_stream()`: `decode(token)` returns the text that token completes (empty
/// while a character or word is unfinished).
#[pyclass(module = "kiln")]
pub struct TokenizerStream {
    stream: Mutex<TextStream>,
}

#[pymethods]
impl TokenizerStream {
    fn decode(&self, token: i64) -> PyResult<String> {
        let mut s = self.stream.lock().map_err(|_| raise(Kind::Device, "the stream panicked"))?;
        Ok(s.push(token).unwrap_or_default())
    }
}

/// `kiln.GeneratorParams(model)`: search options, defaults from the folder's
/// `genai_config.json`.
#[pyclass(module = "kiln")]
pub struct GeneratorParams {
    max_length: usize,
    sampling: SamplingParams,
}

#[pymethods]
impl GeneratorParams {
    #[new]
    fn new(model: &Model) -> GeneratorParams {
        let s = &model.folder.config.search;
        GeneratorParams {
            max_length: s.max_length,
            sampling: SamplingParams {
                do_sample: s.do_sample,
                temperature: s.temperature,
                top_k: s.top_k,
                top_p: s.top_p,
                repetition_penalty: s.repetition_penalty,
                seed: random_seed(),
            },
        }
    }

    /// onnxruntime-genai's search options: `max_length`, `do_sample`, `temperature`, `top_k`,
    /// `top_p`, `repetition_penalty`, `random_seed`. Others (beam search, …) are refused by name.
    #[pyo3(signature = (**options))]
    fn set_search_options(&mut self, options: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
        let Some(options) = options else { return Ok(()) };
        for (k, v) in options.iter() {
            let key: String = k.extract()?;
            let bad = |e: PyErr| raise(Kind::InvalidInput, format!("search option {key}: {e}"));
            match key.as_str() {
                "max_length" => self.max_length = v.extract().map_err(bad)?,
                "do_sample" => self.sampling.do_sample = v.extract().map_err(bad)?,
                "temperature" => self.sampling.temperature = v.extract().map_err(bad)?,
                "top_k" => self.sampling.top_k = v.extract().map_err(bad)?,
                "top_p" => self.sampling.top_p = v.extract().map_err(bad)?,
                "repetition_penalty" => self.sampling.repetition_penalty = v.extract().map_err(bad)?,
                // onnxruntime-genai's -1: a random seed.
                "random_seed" => {
                    let seed: i64 = v.extract().map_err(bad)?;
                    self.sampling.seed = u64::try_from(seed).unwrap_or_else(|_| random_seed());
                }
                "num_beams" | "num_return_sequences" | "batch_size" if v.extract::<usize>().ok() == Some(1) => {}
                "min_length" if v.extract::<usize>().ok() == Some(0) => {}
                other => {
                    return Err(raise(Kind::Unsupported, format!("search option {other:?} is not supported by kiln")));
                }
            }
        }
        Ok(())
    }
}

/// A random seed (onnxruntime-genai's default `random_seed` is -1, random).
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new().build_hasher().finish()
}

/// `kiln.Generator(model, params)`: one sequence, generated token by token.
#[pyclass(module = "kiln")]
pub struct Generator {
    model: Arc<Owner<KilnGenerator>>,
    eos: Vec<i64>,
    max_length: usize,
    sampler: Sampler,
    kv: Option<KvCache>,
    /// Every token so far (prompt, then generated).
    sequence: Vec<i64>,
    /// Tokens generated.
    generated: usize,
    /// The logits of the next token, when the model has seen the whole sequence.
    logits: Option<Vec<f32>>,
    /// The last generated token, not fed to the model yet (it is, before the next choice or
    /// with the next appended tokens).
    pending: Option<i64>,
    done: bool,
    /// A run that failed left the cache behind the sequence: every later call says so.
    failed: Option<String>,
}

impl Generator {
    /// Feeds `tokens` (after the pending token, if any) to the model; on success the logits of
    /// the next token are ready. A failure ends this generator.
    fn feed(&mut self, py: Python<'_>, mut tokens: Vec<i64>) -> PyResult<()> {
        if let Some(why) = &self.failed {
            return Err(raise(Kind::InvalidInput, format!("this generator failed earlier ({why}): make a new one")));
        }
        tokens.splice(0..0, self.pending.take());
        let (max_length, kv) = (self.max_length, self.kv.take());
        let ran = py.detach(|| {
            self.model.call(move |g: &mut KilnGenerator| match kv {
                None => {
                    let (cache, mut logits) = g.prefill(&[tokens], max_length)?;
                    Ok((cache, logits.pop().unwrap_or_default()))
                }
                Some(mut cache) => {
                    let mut last = Vec::new();
                    for t in &tokens {
                        last = g.decode(&mut cache, &[*t])?.pop().unwrap_or_default();
                    }
                    Ok((cache, last))
                }
            })
        });
        match ran.and_then(|r| r) {
            Ok((cache, logits)) => {
                self.kv = Some(cache);
                self.logits = Some(logits);
                Ok(())
            }
            Err(e) => {
                self.failed = Some(e.to_string());
                Err(crate::errors::to_py(e))
            }
        }
    }
}

#[pymethods]
impl Generator {
    #[new]
    fn new(model: &Model, params: &GeneratorParams) -> PyResult<Generator> {
        let cfg = &model.folder.config;
        let max_length = cfg.checked_max_length(Some(params.max_length)).py_err()?;
        Ok(Generator {
            model: model.generator.clone(),
            eos: cfg.model.eos_token_id.to_vec(),
            max_length,
            sampler: Sampler::new(params.sampling.clone()),
            kv: None,
            sequence: Vec::new(),
            generated: 0,
            logits: None,
            pending: None,
            done: false,
            failed: None,
        })
    }

    /// Feeds tokens (numpy ids or a list): the prompt first; later calls extend the sequence
    /// (a next turn, after the generated tokens). Errors: no tokens, or `max_length` reached.
    fn append_tokens(&mut self, py: Python<'_>, tokens: &Bound<'_, PyAny>) -> PyResult<()> {
        let tokens = ids_from("tokens", tokens)?;
        if tokens.is_empty() {
            return Err(raise(Kind::InvalidInput, "append_tokens: no tokens"));
        }
        let total = self.sequence.len() + tokens.len();
        if total >= self.max_length {
            return Err(raise(
                Kind::InvalidInput,
                format!(
                    "{total} tokens in all would reach max_length {} (set_search_options(max_length=...))",
                    self.max_length
                ),
            ));
        }
        self.feed(py, tokens.clone())?;
        self.sequence.extend(tokens);
        self.done = false;
        Ok(())
    }

    /// Whether the sequence has ended (end-of-sequence token or `max_length`).
    fn is_done(&self) -> bool {
        self.done
    }

    /// Chooses the next token (feeding the one before it first). Errors: nothing appended yet,
    /// a finished sequence, or a failed run.
    fn generate_next_token(&mut self, py: Python<'_>) -> PyResult<()> {
        if self.done {
            return Err(raise(Kind::InvalidInput, "generate_next_token: the sequence is done"));
        }
        if self.pending.is_some() {
            self.feed(py, Vec::new())?;
        }
        let Some(logits) = self.logits.take() else {
            return Err(raise(Kind::InvalidInput, "generate_next_token: append_tokens first"));
        };
        let token = self.sampler.next(&logits, &self.sequence, 0, self.generated);
        self.sequence.push(token);
        self.pending = Some(token);
        self.generated += 1;
        self.done = self.eos.contains(&token) || self.sequence.len() >= self.max_length;
        Ok(())
    }

    /// The last token chosen (numpy int32, one per sequence).
    fn get_next_tokens<'py>(&self, py: Python<'py>) -> Bound<'py, PyAny> {
        ids_array(py, &self.sequence[self.sequence.len().saturating_sub(1)..])
    }

    /// Every token of sequence `index` (only 0): prompt and generated (numpy int32).
    fn get_sequence<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyAny>> {
        if index != 0 {
            return Err(raise(Kind::InvalidInput, format!("sequence {index}: a kiln Generator has one sequence")));
        }
        Ok(ids_array(py, &self.sequence))
    }
}

//! The OpenAI API's request and response bodies that `kiln serve` speaks
//! (<https://platform.openai.com/docs/api-reference/completions> and `chat`): what a request
//! may ask for, checked before it is queued, and the JSON it gets back.

use serde::Deserialize;
use serde_json::{json, Value};

use crate::genai::{ChatMessage, SamplingParams};

/// A request error: the HTTP status and OpenAI's error body (`invalid_request_error`).
#[derive(Debug)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// The request field at fault, when one is.
    pub param: Option<String>,
}

impl ApiError {
    pub fn bad(message: impl Into<String>, param: Option<&str>) -> ApiError {
        ApiError { status: 400, message: message.into(), param: param.map(str::to_string) }
    }

    /// OpenAI's error object.
    pub fn body(&self) -> Value {
        let kind = match self.status {
            401 => "authentication_error",
            429 => "rate_limit_error",
            500..=599 => "server_error",
            _ => "invalid_request_error",
        };
        json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": null}})
    }
}

/// `stop`: one string or up to four.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

/// The fields of `/v1/completions` and `/v1/chat/completions` that kiln reads. Fields kiln does
/// not implement are collected in `rest` and refused by name unless harmless.
#[derive(Debug, Deserialize)]
pub struct Request {
    #[serde(default)]
    pub model: Option<String>,
    /// `/v1/completions`: the prompt text.
    #[serde(default)]
    pub prompt: Option<Value>,
    /// `/v1/chat/completions`: the conversation.
    #[serde(default)]
    pub messages: Option<Vec<Message>>,
    #[serde(default, alias = "max_completion_tokens")]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub temperature: Option<f32>,
    #[serde(default)]
    pub top_p: Option<f32>,
    /// Not OpenAI's; vLLM and llama.cpp's servers take it too.
    #[serde(default)]
    pub top_k: Option<usize>,
    /// Not OpenAI's; vLLM and llama.cpp's servers take it too.
    #[serde(default)]
    pub repetition_penalty: Option<f32>,
    #[serde(default)]
    pub seed: Option<u64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub stream: bool,
    /// Not OpenAI's; vLLM's server takes it: keep generating past the end-of-sequence token
    /// (load benchmarks ask for exactly `max_tokens`).
    #[serde(default)]
    pub ignore_eos: bool,
    #[serde(flatten)]
    pub rest: serde_json::Map<String, Value>,
}

/// A chat message: `content` is text (a list of text parts is joined).
#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Value,
}

/// Fields accepted and ignored because they change nothing here, or only at their default.
fn harmless(name: &str, v: &Value) -> bool {
    match name {
        "user" | "stream_options" | "metadata" | "store" => true,
        "n" | "best_of" => v.as_u64() == Some(1),
        "presence_penalty" | "frequency_penalty" => v.as_f64() == Some(0.0),
        "logprobs" | "echo" => v.as_bool() == Some(false) || v.is_null(),
        "logit_bias" => v.as_object().is_some_and(|m| m.is_empty()) || v.is_null(),
        _ => false,
    }
}

/// What a checked request asks the worker for.
#[derive(Debug)]
pub struct Ask {
    pub prompt_ids: Vec<i64>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub ignore_eos: bool,
}

/// The limits a request is checked against.
pub struct Limits {
    /// Prompt plus generated tokens (the folder's `max_length`, or `--max-length`).
    pub max_length: usize,
    /// `max_tokens` when the request gives none.
    pub default_max_tokens: usize,
    /// The folder's `top_k`, used when the request gives none.
    pub default_top_k: usize,
}

impl Request {
    /// Checks every field and returns the work: the prompt's token ids (from `encode`, or from
    /// `chat` for messages), the sampling parameters (OpenAI's defaults: temperature 1, top_p
    /// 1; temperature 0 is greedy; a random seed unless given) and the stop strings. Errors name
    /// the field: unsupported parameters, values out of range, a prompt and `max_tokens` over
    /// the context.
    pub fn check(
        self,
        chat: bool,
        limits: &Limits,
        encode: impl Fn(&str) -> crate::Result<Vec<i64>>,
        render: impl Fn(&[ChatMessage]) -> crate::Result<String>,
    ) -> Result<Ask, ApiError> {
        let unsupported: Vec<&str> =
            self.rest.iter().filter(|(k, v)| !harmless(k, v)).map(|(k, _)| k.as_str()).collect();
        if !unsupported.is_empty() {
            return Err(ApiError::bad(
                format!(
                    "unsupported parameter(s): {} (kiln serve returns one choice, without logprobs)",
                    unsupported.join(", ")
                ),
                unsupported.first().copied(),
            ));
        }
        let text = if chat {
            if self.prompt.is_some() {
                return Err(ApiError::bad("/v1/chat/completions takes messages, not prompt", Some("prompt")));
            }
            let Some(messages) = self.messages.filter(|m| !m.is_empty()) else {
                return Err(ApiError::bad("messages must be a non-empty list", Some("messages")));
            };
            let mut chat = Vec::with_capacity(messages.len());
            for m in &messages {
                let content = match &m.content {
                    Value::String(s) => s.clone(),
                    Value::Array(parts) => parts
                        .iter()
                        .map(|p| match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                            (Some("text"), Some(t)) => Ok(t),
                            _ => Err(ApiError::bad("only text content parts are supported", Some("messages"))),
                        })
                        .collect::<Result<Vec<_>, _>>()?
                        .concat(),
                    _ => return Err(ApiError::bad("a message's content must be text", Some("messages"))),
                };
                chat.push(ChatMessage::new(&m.role, &content));
            }
            render(&chat).map_err(|e| ApiError::bad(e.to_string(), Some("messages")))?
        } else {
            if self.messages.is_some() {
                return Err(ApiError::bad("/v1/completions takes prompt, not messages", Some("messages")));
            }
            match self.prompt {
                Some(Value::String(s)) => s,
                Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                    a[0].as_str().unwrap_or_default().to_string()
                }
                Some(_) => {
                    return Err(ApiError::bad(
                        "prompt must be one string (kiln serve takes one prompt per request)",
                        Some("prompt"),
                    ))
                }
                None => return Err(ApiError::bad("prompt is required", Some("prompt"))),
            }
        };
        let prompt_ids = encode(&text).map_err(|e| ApiError::bad(e.to_string(), Some("prompt")))?;
        if prompt_ids.is_empty() {
            return Err(ApiError::bad("the prompt has no tokens", Some("prompt")));
        }
        let max_tokens = self
            .max_tokens
            .unwrap_or(limits.default_max_tokens.min(limits.max_length.saturating_sub(prompt_ids.len())));
        if max_tokens == 0 {
            return Err(ApiError::bad("max_tokens must be at least 1", Some("max_tokens")));
        }
        if prompt_ids.len() + max_tokens > limits.max_length {
            return Err(ApiError::bad(
                format!(
                    "the prompt's {} tokens plus max_tokens {max_tokens} are over the server's limit of {} tokens (the \
                     model's context, or kiln serve --max-length)",
                    prompt_ids.len(),
                    limits.max_length
                ),
                Some("max_tokens"),
            ));
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !(temperature >= 0.0 && temperature.is_finite()) {
            return Err(ApiError::bad(format!("temperature must be ≥ 0, got {temperature}"), Some("temperature")));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::bad(format!("top_p must be in (0, 1], got {top_p}"), Some("top_p")));
        }
        let repetition_penalty = self.repetition_penalty.unwrap_or(1.0);
        if !(repetition_penalty > 0.0 && repetition_penalty.is_finite()) {
            return Err(ApiError::bad(
                format!("repetition_penalty must be > 0, got {repetition_penalty}"),
                Some("repetition_penalty"),
            ));
        }
        let stop = match self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s],
            Some(Stop::Many(v)) => v,
        };
        if stop.len() > 4 || stop.iter().any(String::is_empty) {
            return Err(ApiError::bad("stop takes at most 4 non-empty strings", Some("stop")));
        }
        let sampling = SamplingParams {
            do_sample: temperature > 0.0,
            temperature,
            top_k: self.top_k.unwrap_or(limits.default_top_k),
            top_p,
            repetition_penalty,
            seed: self.seed.unwrap_or_else(rand::random),
        };
        Ok(Ask { prompt_ids, max_tokens, sampling, stop, stream: self.stream, ignore_eos: self.ignore_eos })
    }
}

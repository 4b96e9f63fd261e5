//! LLM generation from onnxruntime-genai model folders: `genai_config.json`, the decoder
//! `model.onnx` (+ external data), `tokenizer.json`, and `chat_template.jinja` for chat
//! prompts. Prefill runs the prompt, then one token per step with the KV cache; greedy or
//! sampled; batches of prompts are right-padded as onnxruntime-genai pads them.

mod batch;
pub mod config;
pub(crate) mod device_step;
mod folder;
mod generate;
mod kv;
pub mod sampling;
mod stream;

pub use batch::{BatchStats, ContinuousBatch, Emitted, Join, Refusal, CPU_MIN_LIMIT};
pub use config::GenaiConfig;
pub use device_step::KILN_DOMAIN;
pub use folder::{ChatMessage, ModelFolder};
pub use generate::{
    bucket, f32_tensor, i64_tensor, GenerateOptions, Generation, Generator, RowResult, StopReason, Timings,
};
pub use kv::KvCache;
pub use sampling::{Sampler, SamplingParams};
pub use stream::TextStream;

//! `genai_config.json` of an onnxruntime-genai model folder (the fields kiln uses; others are
//! ignored). Source: onnxruntime-genai `src/config.h` / `config.cpp`.

use serde::Deserialize;

/// The whole file.
#[derive(Clone, Debug, Deserialize)]
pub struct GenaiConfig {
    pub model: ModelConfig,
    #[serde(default)]
    pub search: SearchConfig,
}

/// `model`.
#[derive(Clone, Debug, Deserialize)]
pub struct ModelConfig {
    /// `llama`, `qwen2`, `phi3`, …
    #[serde(rename = "type")]
    pub model_type: String,
    pub context_length: usize,
    pub decoder: DecoderConfig,
    pub eos_token_id: TokenIds,
    #[serde(default)]
    pub bos_token_id: Option<i64>,
    #[serde(default)]
    pub pad_token_id: Option<i64>,
    pub vocab_size: usize,
}

/// One id or a list of ids (`eos_token_id` may be either).
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(i64),
    Many(Vec<i64>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<i64> {
        match self {
            TokenIds::One(i) => vec![*i],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// `model.decoder`.
#[derive(Clone, Debug, Deserialize)]
pub struct DecoderConfig {
    pub filename: String,
    pub head_size: usize,
    pub hidden_size: usize,
    pub num_attention_heads: usize,
    pub num_hidden_layers: usize,
    pub num_key_value_heads: usize,
    pub inputs: DecoderInputs,
    pub outputs: DecoderOutputs,
}

/// Graph input names; `%d` in the KV names is the layer index.
#[derive(Clone, Debug, Deserialize)]
pub struct DecoderInputs {
    pub input_ids: String,
    #[serde(default)]
    pub attention_mask: Option<String>,
    #[serde(default)]
    pub position_ids: Option<String>,
    pub past_key_names: String,
    pub past_value_names: String,
}

/// Graph output names.
#[derive(Clone, Debug, Deserialize)]
pub struct DecoderOutputs {
    pub logits: String,
    pub present_key_names: String,
    pub present_value_names: String,
}

/// `search`: generation defaults.
#[derive(Clone, Debug, Deserialize)]
#[serde(default)]
pub struct SearchConfig {
    pub max_length: usize,
    pub past_present_share_buffer: bool,
    pub do_sample: bool,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub repetition_penalty: f32,
}

impl Default for SearchConfig {
    fn default() -> Self {
        SearchConfig {
            max_length: 0,
            past_present_share_buffer: false,
            do_sample: false,
            temperature: 1.0,
            top_k: 50,
            top_p: 1.0,
            repetition_penalty: 1.0,
        }
    }
}

impl GenaiConfig {
    /// `genai_config.json` of folder `dir`. Errors name the file; a `dir` without one (or not a
    /// folder) is bad input that says what an onnxruntime-genai model folder is.
    pub fn read(dir: &std::path::Path) -> crate::Result<GenaiConfig> {
        let file = dir.join("genai_config.json");
        if dir.exists() && !file.exists() {
            return Err(crate::Error::Input(format!(
                "{} is not an onnxruntime-genai model folder (genai_config.json, the model, tokenizer.json); \
                 `kiln run` takes a single .onnx file",
                dir.display()
            )));
        }
        let text = std::fs::read_to_string(&file).map_err(|source| crate::Error::Io { path: file.clone(), source })?;
        GenaiConfig::parse(&text).map_err(|e| crate::Error::Input(format!("{}: {e}", file.display())))
    }

    /// Parses and checks the config; errors name the field.
    pub fn parse(text: &str) -> Result<GenaiConfig, String> {
        let c: GenaiConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let d = &c.model.decoder;
        if d.num_hidden_layers == 0 || d.num_attention_heads == 0 || d.num_key_value_heads == 0 || d.head_size == 0 {
            return Err("model.decoder: layer, head counts and head_size must be at least 1".into());
        }
        if !d.num_attention_heads.is_multiple_of(d.num_key_value_heads) {
            return Err(format!(
                "model.decoder: num_attention_heads {} is not a multiple of num_key_value_heads {}",
                d.num_attention_heads, d.num_key_value_heads
            ));
        }
        for (field, name) in [
            ("inputs.past_key_names", &d.inputs.past_key_names),
            ("inputs.past_value_names", &d.inputs.past_value_names),
            ("outputs.present_key_names", &d.outputs.present_key_names),
            ("outputs.present_value_names", &d.outputs.present_value_names),
        ] {
            if !name.contains("%d") {
                return Err(format!("model.decoder.{field} {name:?} has no %d for the layer index"));
            }
        }
        if c.model.eos_token_id.to_vec().is_empty() {
            return Err("model.eos_token_id is empty".into());
        }
        Ok(c)
    }

    /// The name of layer `layer`'s tensor from a `%d` template.
    pub fn layer_name(template: &str, layer: usize) -> String {
        template.replacen("%d", &layer.to_string(), 1)
    }

    /// The longest sequence a generation may reach for a requested `max_length` (`None`: the
    /// config's own, as the folder's builder set it). Errors: a request over the model's
    /// `context_length` (the rotary cache and the position embeddings end there), naming both.
    pub fn checked_max_length(&self, requested: Option<usize>) -> Result<usize, crate::Error> {
        let Some(n) = requested else {
            return Ok(self.max_length());
        };
        let context = self.model.context_length;
        if context > 0 && n > context {
            return Err(crate::Error::Input(format!(
                "max_length {n} is over the model's context_length {context} (genai_config.json)"
            )));
        }
        Ok(n)
    }

    /// The longest sequence a generation may reach: `search.max_length`, else the context length.
    pub fn max_length(&self) -> usize {
        match self.search.max_length {
            0 => self.model.context_length,
            n => n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"model": {"type": "llama", "context_length": 64, "vocab_size": 10, "eos_token_id": [2, 3],
      "decoder": {"filename": "model.onnx", "head_size": 4, "hidden_size": 8, "num_attention_heads": 2,
      "num_hidden_layers": 1, "num_key_value_heads": 1,
      "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                 "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
      "outputs": {"logits": "logits", "present_key_names": "present.%d.key", "present_value_names": "present.%d.value"}}},
      "search": {"max_length": 32, "past_present_share_buffer": true}}"#;

    #[test]
    fn a_config_parses_and_bad_ones_name_the_field() {
        let c = GenaiConfig::parse(GOOD).unwrap();
        assert_eq!(c.model.eos_token_id.to_vec(), vec![2, 3]);
        assert_eq!(c.max_length(), 32);
        assert_eq!(GenaiConfig::layer_name(&c.model.decoder.inputs.past_key_names, 7), "past_key_values.7.key");
        assert!(GenaiConfig::parse(&GOOD.replace("\"num_key_value_heads\": 1", "\"num_key_value_heads\": 3"))
            .unwrap_err()
            .contains("multiple"));
        assert!(GenaiConfig::parse(&GOOD.replace("present.%d.key", "present.key"))
            .unwrap_err()
            .contains("present_key_names"));
        assert!(GenaiConfig::parse(&GOOD.replace("\"head_size\": 4,", "")).unwrap_err().contains("head_size"));
        assert!(GenaiConfig::parse("{").is_err());
    }
}

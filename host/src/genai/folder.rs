//! Opening a model folder: every file checked, every error naming the file and the fix.

use std::path::{Path, PathBuf};

use kiln_kernel_abi::DType;
use tokenizers::Tokenizer;

use super::GenaiConfig;
use crate::model::{self, Model};
use crate::{Error, Result};

/// A loaded onnxruntime-genai model folder (cloning shares the weights' bytes).
#[derive(Clone)]
pub struct ModelFolder {
    pub dir: PathBuf,
    pub config: GenaiConfig,
    pub model: Model,
    /// Shared: a stream per request clones the handle, not the vocabulary.
    pub tokenizer: std::sync::Arc<Tokenizer>,
    /// `chat_template.jinja`, when present.
    pub chat_template: Option<String>,
    /// dtype of the KV cache (from the first past key input).
    pub kv_dtype: DType,
}

/// One message of a conversation: `role` is `system`, `user` or `assistant`.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }
}

impl ModelFolder {
    pub fn open(dir: &Path) -> Result<ModelFolder> {
        let file = |name: &str| dir.join(name);
        if !dir.is_dir() {
            return Err(Error::Input(format!(
                "{}: not a folder (an onnxruntime-genai model folder is expected)",
                dir.display()
            )));
        }
        let config = GenaiConfig::read(dir)?;
        let model = model::load(&file(&config.model.decoder.filename))?;
        let tokenizer = Tokenizer::from_file(file("tokenizer.json"))
            .map_err(|e| Error::Input(format!("{}: {e}", file("tokenizer.json").display())))?;
        let chat_template = match std::fs::read_to_string(file("chat_template.jinja")) {
            Ok(t) => Some(t),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(source) => return Err(Error::Io { path: file("chat_template.jinja"), source }),
        };
        let kv_dtype = check_graph(&config, &model).map_err(|e| Error::Input(format!("{}: {e}", dir.display())))?;
        Ok(ModelFolder {
            dir: dir.to_path_buf(),
            config,
            model,
            tokenizer: std::sync::Arc::new(tokenizer),
            chat_template,
            kv_dtype,
        })
    }

    /// Renders a chat prompt (`user` message, generation prompt added) with the folder's template.
    pub fn chat_prompt(&self, user: &str) -> Result<String> {
        self.render_chat(&[ChatMessage::new("user", user)])
    }

    /// The folder's chat template over `messages` (role and content each), with the generation
    /// prompt. Errors: no chat_template.jinja, or the template fails.
    pub fn render_chat(&self, messages: &[ChatMessage]) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::Input(format!("--chat: {} has no chat_template.jinja", self.dir.display())))?;
        let mut env = minijinja::Environment::new();
        env.add_template("chat", template).map_err(|e| Error::Input(format!("chat_template.jinja: {e}")))?;
        let tmpl = env.get_template("chat").map_err(|e| Error::Input(format!("chat_template.jinja: {e}")))?;
        let messages: Vec<minijinja::Value> = messages
            .iter()
            .map(|m| minijinja::context! { role => m.role.as_str(), content => m.content.as_str() })
            .collect();
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => "",
            eos_token => "",
        })
        .map_err(|e| Error::Input(format!("chat_template.jinja: {e}")))
    }

    /// Token ids of `text` (with the tokenizer's own special-token rules).
    pub fn encode(&self, text: &str) -> Result<Vec<i64>> {
        let enc = self.tokenizer.encode(text, true).map_err(|e| Error::Input(format!("tokenizing the prompt: {e}")))?;
        Ok(enc.get_ids().iter().map(|&i| i as i64).collect())
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[i64]) -> Result<String> {
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        self.tokenizer.decode(&ids, true).map_err(|e| Error::Input(format!("decoding tokens: {e}")))
    }
}

/// Checks that the decoder graph has the inputs and outputs the config names; returns the
/// KV cache dtype.
fn check_graph(c: &GenaiConfig, m: &Model) -> std::result::Result<DType, String> {
    let g = &m.graph;
    let d = &c.model.decoder;
    let has_input = |n: &str| g.inputs.iter().any(|&i| g.values[i].name == n);
    let has_output = |n: &str| g.outputs.iter().any(|&i| g.values[i].name == n);
    let mut need_in = vec![d.inputs.input_ids.clone()];
    need_in.extend(d.inputs.attention_mask.clone());
    for l in 0..d.num_hidden_layers {
        need_in.push(GenaiConfig::layer_name(&d.inputs.past_key_names, l));
        need_in.push(GenaiConfig::layer_name(&d.inputs.past_value_names, l));
    }
    if let Some(missing) = need_in.iter().find(|n| !has_input(n)) {
        return Err(format!("the decoder has no input {missing:?}, which genai_config.json names"));
    }
    let mut need_out = vec![d.outputs.logits.clone()];
    for l in 0..d.num_hidden_layers {
        need_out.push(GenaiConfig::layer_name(&d.outputs.present_key_names, l));
        need_out.push(GenaiConfig::layer_name(&d.outputs.present_value_names, l));
    }
    if let Some(missing) = need_out.iter().find(|n| !has_output(n)) {
        return Err(format!("the decoder has no output {missing:?}, which genai_config.json names"));
    }
    if let Some(p) = &d.inputs.position_ids {
        if has_input(p) {
            return Err(format!("decoders with a {p:?} input are not supported yet"));
        }
    }
    let past0 = GenaiConfig::layer_name(&d.inputs.past_key_names, 0);
    let id = g.value_id(&past0).ok_or("no past key input")?;
    g.values[id].ty.as_ref().map(|t| t.dtype).ok_or_else(|| format!("input {past0:?} declares no type"))
}

//! Streaming detokenization: the text of a growing list of token ids, handed out piece by
//! piece as it becomes final.

use tokenizers::Tokenizer;

/// Turns one sequence's tokens into text pieces as they come. A piece is held back while the
/// decoded text ends in an incomplete UTF-8 sequence (decoded as U+FFFD) or while an earlier
/// piece would change (tokenizers that merge across tokens), and released once it is final.
pub struct TextStream {
    tokenizer: Tokenizer,
    ids: Vec<u32>,
    shown: String,
}

impl TextStream {
    pub fn new(tokenizer: Tokenizer) -> TextStream {
        TextStream { tokenizer, ids: Vec::new(), shown: String::new() }
    }

    /// Adds token `id`; returns the new final text, if any (special tokens skipped).
    pub fn push(&mut self, id: i64) -> Option<String> {
        self.ids.push(id as u32);
        let text = self.tokenizer.decode(&self.ids, true).ok()?;
        if text.ends_with('\u{FFFD}') || text.len() < self.shown.len() || !text.starts_with(self.shown.as_str()) {
            return None;
        }
        let piece = text[self.shown.len()..].to_string();
        self.shown = text;
        (!piece.is_empty()).then_some(piece)
    }

    /// The text handed out so far.
    pub fn shown(&self) -> &str {
        &self.shown
    }
}

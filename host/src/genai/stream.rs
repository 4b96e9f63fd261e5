//! Streaming detokenization: the text of a growing list of token ids, handed out piece by
//! piece as it becomes final.

use std::sync::Arc;

use tokenizers::Tokenizer;

/// Turns one sequence's tokens into text pieces as they come, decoding only a short window of
/// the latest tokens per token (as text-generation-inference's incremental decoder does), so a
/// token costs the same at any length. A piece is held back while the window's text ends in an
/// incomplete UTF-8 sequence (decoded as U+FFFD) or does not yet extend the text decoded before
/// (tokenizers that merge across tokens), and released once it is final.
///
/// The window starts at the last released token before the newest piece (`prefix`), so that
/// what a token's decoding depends on (a SentencePiece word boundary, a byte-fallback sequence)
/// stays inside it; the piece is the window's text past the text of its released part.
pub struct TextStream {
    tokenizer: Arc<Tokenizer>,
    ids: Vec<u32>,
    /// Where the decoding window starts.
    prefix: usize,
    /// Tokens up to here have been released as text.
    read: usize,
    shown: String,
}

impl TextStream {
    pub fn new(tokenizer: Arc<Tokenizer>) -> TextStream {
        TextStream { tokenizer, ids: Vec::new(), prefix: 0, read: 0, shown: String::new() }
    }

    /// Adds token `id`; returns the new final text, if any (special tokens skipped).
    pub fn push(&mut self, id: i64) -> Option<String> {
        self.ids.push(id as u32);
        let before = self.tokenizer.decode(&self.ids[self.prefix..self.read], true).ok()?;
        let text = self.tokenizer.decode(&self.ids[self.prefix..], true).ok()?;
        if text.len() <= before.len() || text.ends_with('\u{FFFD}') || !text.starts_with(before.as_str()) {
            return None;
        }
        let piece = text[before.len()..].to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        self.shown.push_str(&piece);
        Some(piece)
    }

    /// The text handed out so far.
    pub fn shown(&self) -> &str {
        &self.shown
    }

    /// What of `whole` (the sequence's full decoding, at its end) is still to be shown: the text
    /// after its longest common prefix with what was shown (all of it past the held-back tail
    /// when the shown text is a prefix, as it is for the tokenizers kiln knows).
    pub fn rest<'a>(&self, whole: &'a str) -> &'a str {
        let common = whole
            .char_indices()
            .zip(self.shown.chars())
            .find(|((_, a), b)| a != b)
            .map_or(whole.len().min(self.shown.len()), |((i, _), _)| i);
        whole.get(common..).unwrap_or("")
    }
}

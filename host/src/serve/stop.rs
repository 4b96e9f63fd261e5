//! Stop strings in streamed text (OpenAI's `stop`): text is released once no stop string can
//! begin in it, so a client never sees part of a stop string.

/// Finds stop strings in streamed text: text is released once no stop string can begin in it.
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> StopMatcher {
        StopMatcher { stops, pending: String::new() }
    }

    /// Adds `piece`; returns the text safe to send and whether a stop string was found (the
    /// text is then everything before it, and the rest is dropped).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        if let Some(at) = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min() {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, true);
        }
        // Hold back the longest end of the text that starts a stop string.
        let keep = self
            .stops
            .iter()
            .flat_map(|s| s.char_indices().skip(1).map(|(k, _)| &s[..k]))
            .filter(|prefix| self.pending.ends_with(prefix))
            .map(str::len)
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, false)
    }

    /// The text held back, at the end of the answer.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

/// One request's text, made on its HTTP task rather than on the generation worker (which only
/// sends token ids, so its step loop does not wait on detokenization): the streamed pieces of
/// the tokens so far, cut at the first stop string.
pub struct RequestText {
    text: crate::genai::TextStream,
    matcher: StopMatcher,
    tokenizer: std::sync::Arc<tokenizers::Tokenizer>,
    ids: Vec<i64>,
    /// A stop string ended the text.
    pub stopped: bool,
}

impl RequestText {
    pub fn new(tokenizer: std::sync::Arc<tokenizers::Tokenizer>, stops: Vec<String>) -> RequestText {
        RequestText {
            text: crate::genai::TextStream::new(tokenizer.clone()),
            matcher: StopMatcher::new(stops),
            tokenizer,
            ids: Vec::new(),
            stopped: false,
        }
    }

    /// Adds a token; returns the text now safe to send (empty while held back). After a stop
    /// string, nothing more.
    pub fn push(&mut self, id: i64) -> String {
        if self.stopped {
            return String::new();
        }
        self.ids.push(id);
        let Some(piece) = self.text.push(id) else { return String::new() };
        let (out, found) = self.matcher.push(&piece);
        self.stopped = found;
        out
    }

    /// The text held back at the end of the sequence (an unfinished character or word, a
    /// possible start of a stop string that did not come).
    pub fn finish(&mut self) -> String {
        if self.stopped {
            return String::new();
        }
        let ids: Vec<u32> = self.ids.iter().map(|&i| i as u32).collect();
        let whole = self.tokenizer.decode(&ids, true).unwrap_or_default();
        let (out, found) = self.matcher.push(self.text.rest(&whole));
        self.stopped = found;
        if found {
            out
        } else {
            out + &self.matcher.finish()
        }
    }

    /// Tokens so far (the usage's `completion_tokens`).
    pub fn tokens(&self) -> usize {
        self.ids.len()
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    #[test]
    fn stop_strings_end_the_text_even_across_pieces() {
        let mut m = StopMatcher::new(vec!["\n\n".into(), "END".into()]);
        assert_eq!(m.push("Hello E"), ("Hello ".to_string(), false), "E may start END");
        assert_eq!(m.push("ND of it"), (String::new(), true));
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("Eh"), ("Eh".to_string(), false));
        assert_eq!(m.push(" fin"), (" fin".to_string(), false));
        assert_eq!(m.push(" EN"), (" ".to_string(), false));
        assert_eq!(m.finish(), "EN", "held back until the end");
        let mut m = StopMatcher::new(vec!["é!".into()]);
        assert_eq!(m.push("café"), ("caf".to_string(), false), "a multi-byte prefix is held whole");
        assert_eq!(m.push("?"), ("é?".to_string(), false));
    }
}

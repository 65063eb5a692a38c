//! One batch row's bookkeeping: its tokens, streamed text, stop strings and
//! finish reason.

use super::{FinishReason, GenerateOptions, RowDelta};
use crate::error::Result;
use crate::text::tokenizer::{Detokenizer, Tokenizer};

pub(crate) struct Row {
    pub prompt_len: usize,
    pub generated: Vec<u32>,
    detok: Detokenizer,
    /// Text not yet returned, held back while it could start a stop string.
    pending_text: String,
    pub finish: Option<FinishReason>,
}

impl Row {
    pub fn new(prompt_len: usize) -> Self {
        Row {
            prompt_len,
            generated: vec![],
            detok: Detokenizer::default(),
            pending_text: String::new(),
            finish: None,
        }
    }

    /// Takes the row's next token (ignored once the row has finished) and
    /// adds what it produced to `delta`.
    pub fn accept(
        &mut self,
        token: u32,
        options: &GenerateOptions,
        eos: &[u32],
        tokenizer: Option<&Tokenizer>,
        delta: &mut RowDelta,
    ) -> Result<()> {
        if self.finish.is_some() {
            return Ok(());
        }
        self.generated.push(token);
        delta.ids.push(token);
        if !options.ignore_eos && eos.contains(&token) {
            self.finish = Some(FinishReason::Eos);
        } else if let Some(tokenizer) = tokenizer {
            self.pending_text
                .push_str(&self.detok.push(tokenizer, token)?);
            if let Some(at) = options
                .stop
                .iter()
                .filter_map(|s| self.pending_text.find(s.as_str()))
                .min()
            {
                self.pending_text.truncate(at);
                self.finish = Some(FinishReason::Stop);
            }
        }
        if self.finish.is_none() {
            if self.generated.len() >= options.max_new_tokens {
                self.finish = Some(FinishReason::Length);
            } else if self.prompt_len + self.generated.len() >= options.max_len {
                self.finish = Some(FinishReason::MaxLen);
            }
        }
        if let (Some(reason), Some(tokenizer)) = (self.finish, tokenizer) {
            if reason != FinishReason::Stop {
                self.pending_text.push_str(&self.detok.flush(tokenizer)?);
            }
        }
        let ready = if self.finish.is_some() {
            self.pending_text.len()
        } else {
            self.pending_text.len() - held_back(&self.pending_text, &options.stop)
        };
        delta.text.push_str(&self.pending_text[..ready]);
        self.pending_text.drain(..ready);
        delta.finish = self.finish;
        Ok(())
    }
}

impl Row {
    /// Ends the row now with `reason`, returning all text still held back.
    pub fn end(
        &mut self,
        reason: FinishReason,
        tokenizer: Option<&Tokenizer>,
        delta: &mut RowDelta,
    ) -> Result<()> {
        if self.finish.is_some() {
            return Ok(());
        }
        self.finish = Some(reason);
        if let Some(tokenizer) = tokenizer {
            self.pending_text.push_str(&self.detok.flush(tokenizer)?);
        }
        delta.text.push_str(&self.pending_text);
        self.pending_text.clear();
        delta.finish = self.finish;
        Ok(())
    }
}

/// Bytes at the end of `text` that could begin one of the stop strings, kept
/// back so a stop string split across tokens is never partly returned.
fn held_back(text: &str, stop: &[String]) -> usize {
    stop.iter()
        .map(|s| {
            (1..s.len().min(text.len() + 1))
                .rev()
                .find(|&n| s.is_char_boundary(n) && text.ends_with(&s[..n]))
                .unwrap_or(0)
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::held_back;

    #[test]
    fn holds_back_a_possible_stop_string_start() {
        let stop = vec!["</end>".to_string(), "ab".to_string()];
        assert_eq!(held_back("text </e", &stop), 3);
        assert_eq!(held_back("text a", &stop), 1);
        assert_eq!(held_back("text", &stop), 0);
        // Never splits a character of a multi-byte stop string.
        assert_eq!(held_back("x\u{e9}", &["\u{e9}t".to_string()]), 2);
    }
}

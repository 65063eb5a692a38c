//! Hugging Face tokenizer (tokenizer.json) plus the chat template from
//! tokenizer_config.json, rendered with minijinja the way transformers does.

use std::path::Path;

use serde_json::Value;

use crate::config::{add_missing, generation_eos_ids};
use crate::error::{read_json, Error, Result};

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_token_ids: Vec<u32>,
    /// Cached: the tokenizers crate rebuilds its whole vocabulary map to count it.
    vocab_size: usize,
}

/// `bos_token` / `eos_token` are strings or `{"content": ...}` objects.
fn special_token(config: &Value, key: &str) -> Option<String> {
    match config.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl Tokenizer {
    /// `path` is a folder holding tokenizer.json (and optionally
    /// tokenizer_config.json and generation_config.json) or tokenizer.json itself.
    pub fn load(path: &Path) -> Result<Self> {
        let (dir, file) = if path.is_dir() {
            (path.to_path_buf(), path.join("tokenizer.json"))
        } else {
            (
                path.parent().unwrap_or(Path::new(".")).to_path_buf(),
                path.to_path_buf(),
            )
        };
        if !file.exists() {
            return Err(Error::io(
                &file,
                std::io::Error::new(std::io::ErrorKind::NotFound, "tokenizer.json not found"),
            ));
        }
        let inner = tokenizers::Tokenizer::from_file(&file)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", file.display())))?;
        let config_path = dir.join("tokenizer_config.json");
        let config = if config_path.exists() {
            read_json(&config_path)?
        } else {
            Value::Null
        };
        let chat_template = match config.get("chat_template") {
            Some(Value::String(t)) => Some(t.clone()),
            // A list of named templates: use the default one.
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string),
            _ => None,
        };
        let eos_token = special_token(&config, "eos_token");
        let mut eos_token_ids: Vec<u32> = eos_token
            .iter()
            .filter_map(|t| inner.token_to_id(t))
            .collect();
        add_missing(&mut eos_token_ids, generation_eos_ids(&dir)?);
        Ok(Tokenizer {
            vocab_size: inner.get_vocab_size(true),
            inner,
            chat_template,
            bos_token: special_token(&config, "bos_token"),
            eos_token,
            eos_token_ids,
        })
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| Error::Tokenizer(e.to_string()))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Ids the tokenizer does not know decode to nothing, as in Hugging
    /// Face's tokenizers: Qwen pads its embedding past the vocabulary, so a
    /// model can emit them.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| Error::Tokenizer(e.to_string()))
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders `messages` (a JSON list of `{"role", "content", ...}` objects).
    pub fn apply_chat_template(
        &self,
        messages: &Value,
        add_generation_prompt: bool,
        enable_thinking: Option<bool>,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_deref()
            .ok_or_else(|| Error::Template("tokenizer_config.json has no chat_template".into()))?;
        let valid = messages.as_array().is_some_and(|list| {
            !list.is_empty()
                && list.iter().all(|m| {
                    m.get("role").is_some_and(Value::is_string)
                        && m.get("content").is_some_and(Value::is_string)
                })
        });
        if !valid {
            return Err(Error::invalid(
                "messages must be a non-empty list of maps with string `role` and `content`",
            ));
        }
        let mut env = minijinja::Environment::new();
        // transformers renders chat templates with these settings and helpers.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        env.add_template("chat", template)
            .map_err(|e| Error::Template(e.to_string()))?;
        let mut context = serde_json::json!({
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token.clone().unwrap_or_default(),
            "eos_token": self.eos_token.clone().unwrap_or_default(),
        });
        if let Some(thinking) = enable_thinking {
            context["enable_thinking"] = Value::Bool(thinking);
        }
        env.get_template("chat")
            .and_then(|t| t.render(minijinja::Value::from_serialize(&context)))
            .map_err(|e| Error::Template(e.to_string()))
    }
}

/// Turns a growing list of token ids into text pieces, never emitting half
/// of a multi-byte character: text is released once decoding the new ids no
/// longer ends in U+FFFD (the byte-level BPE replacement for partial UTF-8).
#[derive(Default)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl Detokenizer {
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tokenizer.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tokenizer.decode(&self.ids[self.prefix..], true)?;
        if now.len() > before.len() && !now.ends_with('\u{FFFD}') && now.starts_with(&before) {
            let piece = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever is still held back (e.g. a sequence that really ends in an
    /// invalid byte), at the end of generation.
    pub fn flush(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let before = tokenizer.decode(&self.ids[self.prefix..self.read], true)?;
        let now = tokenizer.decode(&self.ids[self.prefix..], true)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }
}

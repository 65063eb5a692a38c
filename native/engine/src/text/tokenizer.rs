//! Hugging Face tokenizer (tokenizer.json) plus the chat template from
//! tokenizer_config.json, rendered with minijinja the way transformers does.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use serde_json::Value;

use crate::checkpoint::config::{add_missing, generation_eos_ids};
use crate::error::{read_json, Error, Result};
use crate::text::constraint::ConstraintFactory;

pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_token_ids: Vec<u32>,
    /// Cached: the tokenizers crate rebuilds its whole vocabulary map to count it.
    vocab_size: usize,
    /// Built on first use by a constrained generation.
    constraints: OnceLock<std::result::Result<Arc<ConstraintFactory>, String>>,
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
            constraints: OnceLock::new(),
        })
    }

    /// The grammar machinery for this tokenizer's vocabulary.
    pub fn constraint_factory(&self) -> Result<Arc<ConstraintFactory>> {
        self.constraints
            .get_or_init(|| {
                ConstraintFactory::new(&self.inner, &self.eos_token_ids)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(Error::Unsupported)
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
        self.apply_chat_template_with_tools(messages, None, add_generation_prompt, enable_thinking)
    }

    /// Renders `messages` with the functions in `tools` (a JSON list of
    /// tool definitions, as transformers takes them) offered to the model.
    /// An assistant message may carry `tool_calls` instead of content.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &Value,
        tools: Option<&Value>,
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
                    let content = m.get("content");
                    m.get("role").is_some_and(Value::is_string)
                        && (content.is_some_and(Value::is_string)
                            || (m.get("tool_calls").is_some_and(Value::is_array)
                                && content.is_none_or(Value::is_null)))
                })
        });
        if !valid {
            return Err(Error::invalid(
                "messages must be a non-empty list of maps with string `role` and `content` \
                 (or, for an assistant, a `tool_calls` list)",
            ));
        }
        if tools.is_some_and(|t| !t.as_array().is_some_and(|l| l.iter().all(Value::is_object))) {
            return Err(Error::invalid("tools must be a list of maps"));
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
        env.add_filter("tojson", py_tojson);
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
        if let Some(tools) = tools {
            context["tools"] = tools.clone();
        }
        env.get_template("chat")
            .and_then(|t| t.render(minijinja::Value::from_serialize(&context)))
            .map_err(|e| Error::Template(e.to_string()))
    }
}

/// transformers' `tojson` filter: Python's `json.dumps` with non-ASCII kept
/// and, without `indent`, `", "` and `": "` separators (minijinja's own
/// writes compact, HTML-escaped JSON, which changes the prompt).
fn py_tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    let mut out = String::new();
    write_py_json(&json, indent, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

fn write_py_json(v: &Value, indent: Option<usize>, level: usize, out: &mut String) {
    let (item_sep, newline) = match indent {
        Some(n) => (",", Some(n)),
        None => (", ", None),
    };
    let open = |out: &mut String, level: usize| {
        if let Some(n) = newline {
            out.push('\n');
            out.push_str(&" ".repeat(n * level));
        }
    };
    match v {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                open(out, level + 1);
                write_py_json(item, indent, level + 1, out);
            }
            open(out, level);
            out.push(']');
        }
        Value::Object(map) if !map.is_empty() => {
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                open(out, level + 1);
                write_py_string(key, out);
                out.push_str(": ");
                write_py_json(item, indent, level + 1, out);
            }
            open(out, level);
            out.push('}');
        }
        Value::Array(_) => out.push_str("[]"),
        Value::Object(_) => out.push_str("{}"),
        Value::String(s) => write_py_string(s, out),
        Value::Null => out.push_str("null"),
        other => out.push_str(&other.to_string()),
    }
}

fn write_py_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
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

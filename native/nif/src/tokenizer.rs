//! Tokenizer and chat-template NIFs.

use std::path::Path;
use std::sync::Arc;

use emlx_axon_engine::Tokenizer;
use rustler::{NifMap, ResourceArc};

use crate::error::{guard, NifError, NifResult};

pub struct TokenizerResource {
    pub tokenizer: Arc<Tokenizer>,
}

#[rustler::resource_impl]
impl rustler::Resource for TokenizerResource {}

#[rustler::nif(schedule = "DirtyIo")]
fn tokenizer_load(path: String) -> NifResult<ResourceArc<TokenizerResource>> {
    guard(|| {
        let tokenizer = Tokenizer::load(Path::new(&path))?;
        Ok(ResourceArc::new(TokenizerResource {
            tokenizer: Arc::new(tokenizer),
        }))
    })
}

#[rustler::nif(schedule = "DirtyCpu")]
fn tokenizer_encode(
    tok: ResourceArc<TokenizerResource>,
    text: String,
    add_special_tokens: bool,
) -> NifResult<Vec<u32>> {
    guard(|| Ok(tok.tokenizer.encode(&text, add_special_tokens)?))
}

#[rustler::nif(schedule = "DirtyCpu")]
fn tokenizer_decode(
    tok: ResourceArc<TokenizerResource>,
    ids: Vec<u32>,
    skip_special_tokens: bool,
) -> NifResult<String> {
    guard(|| Ok(tok.tokenizer.decode(&ids, skip_special_tokens)?))
}

/// `messages` and `tools` come as JSON text: messages with tool calls and
/// tool definitions are nested maps of any shape.
#[rustler::nif(schedule = "DirtyCpu")]
fn tokenizer_apply_chat_template(
    tok: ResourceArc<TokenizerResource>,
    messages: String,
    tools: Option<String>,
    add_generation_prompt: bool,
    enable_thinking: Option<bool>,
) -> NifResult<String> {
    guard(|| {
        let parse = |what: &str, text: &str| {
            serde_json::from_str::<serde_json::Value>(text).map_err(|e| {
                NifError::new(
                    "invalid_argument",
                    format!("{what} are not valid JSON: {e}"),
                )
            })
        };
        let messages = parse("messages", &messages)?;
        let tools = tools.map(|t| parse("tools", &t)).transpose()?;
        Ok(tok.tokenizer.apply_chat_template_with_tools(
            &messages,
            tools.as_ref(),
            add_generation_prompt,
            enable_thinking,
        )?)
    })
}

#[derive(NifMap)]
pub struct TokenizerInfo {
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
    has_chat_template: bool,
}

#[rustler::nif]
fn tokenizer_info(tok: ResourceArc<TokenizerResource>) -> NifResult<TokenizerInfo> {
    let t = &tok.tokenizer;
    Ok(TokenizerInfo {
        vocab_size: t.vocab_size(),
        eos_token_ids: t.eos_token_ids().to_vec(),
        has_chat_template: t.has_chat_template(),
    })
}

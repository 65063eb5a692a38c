//! What every request is checked against, and its end-of-sequence ids: one
//! place for `Generation` and the scheduler, so both refuse the same input
//! with the same words.

use crate::checkpoint::config::add_missing;
use crate::error::{Error, Result};
use crate::exec::generate::GenerateOptions;
use crate::model::Model;
use crate::text::tokenizer::Tokenizer;

/// The options' own checks: lengths, stop strings, the sampler.
pub(crate) fn check_options(o: &GenerateOptions, has_tokenizer: bool) -> Result<()> {
    if o.max_new_tokens == 0 {
        return Err(Error::invalid("max_new_tokens must be at least 1"));
    }
    if o.max_len == 0 {
        return Err(Error::invalid("max_len must be at least 1"));
    }
    if !o.stop.is_empty() && !has_tokenizer {
        return Err(Error::invalid("stop strings need a tokenizer"));
    }
    if o.stop.iter().any(String::is_empty) {
        return Err(Error::invalid("stop strings must not be empty"));
    }
    o.sampler.validate()
}

/// A prompt's tokens: at least one, each in the model's vocabulary.
pub(crate) fn check_prompt(model: &Model, prompt: &[u32]) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::invalid("a prompt is empty: give at least one token"));
    }
    let vocab = model.config.vocab_size as u32;
    if let Some(bad) = prompt.iter().find(|&&id| id >= vocab) {
        return Err(Error::invalid(format!(
            "token id {bad} is outside the model's vocabulary (size {vocab})"
        )));
    }
    Ok(())
}

/// A prompt that leaves no room to generate within `max_len` positions.
pub(crate) fn check_length(prompt: &[u32], max_len: usize) -> Result<()> {
    if prompt.len() >= max_len {
        return Err(Error::PromptTooLong {
            len: prompt.len(),
            max_len,
        });
    }
    Ok(())
}

/// A tokenizer with more tokens than the model has rows belongs to another
/// model.
pub(crate) fn check_tokenizer(model: &Model, tokenizer: Option<&Tokenizer>) -> Result<()> {
    if let Some(t) = tokenizer {
        if t.vocab_size() > model.config.vocab_size as usize {
            return Err(Error::invalid(format!(
                "the tokenizer has {} tokens but the model only {}: they belong to different models",
                t.vocab_size(),
                model.config.vocab_size
            )));
        }
    }
    Ok(())
}

/// The ids that end a row: the options', else the model's with the
/// tokenizer's added.
pub(crate) fn eos_ids(
    model: &Model,
    tokenizer: Option<&Tokenizer>,
    o: &GenerateOptions,
) -> Vec<u32> {
    match &o.eos_token_ids {
        Some(ids) => ids.clone(),
        None => {
            let mut ids = model.config.eos_token_ids.clone();
            add_missing(
                &mut ids,
                tokenizer
                    .iter()
                    .flat_map(|t| t.eos_token_ids().iter().copied()),
            );
            ids
        }
    }
}

//! Text in and out: the tokenizer and chat template, and the constraints of
//! structured output over its vocabulary.

pub mod constraint;
pub mod tokenizer;

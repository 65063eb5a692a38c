//! Constraints as Elixir gives them: `{:json_schema | :regex | :grammar,
//! text}`, read the same way for generations and the scheduler.

use emlx_axon_engine::text::constraint::RowConstraint;
use emlx_axon_engine::ConstraintSpec;
use rustler::{Atom, ResourceArc};

use crate::error::{guard, NifError, NifResult};
use crate::tokenizer::TokenizerResource;

mod atoms {
    rustler::atoms! { json_schema, regex, grammar }
}

/// `nil` or `{kind, text}` -> the engine's spec; another kind raises.
pub(crate) fn constraint_spec(
    term: Option<(Atom, String)>,
) -> Result<Option<ConstraintSpec>, rustler::Error> {
    Ok(match term {
        None => None,
        Some((kind, text)) if kind == atoms::json_schema() => {
            Some(ConstraintSpec::JsonSchema(text))
        }
        Some((kind, text)) if kind == atoms::regex() => Some(ConstraintSpec::Regex(text)),
        Some((kind, text)) if kind == atoms::grammar() => Some(ConstraintSpec::Lark(text)),
        Some(_) => {
            return Err(rustler::Error::RaiseTerm(Box::new(
                "a constraint must be {:json_schema | :regex | :grammar, text}",
            )))
        }
    })
}

/// Compiles `constraint` for the tokenizer and drops it: checks that the
/// engine takes a schema, regex or grammar without any model work.
#[rustler::nif(schedule = "DirtyCpu")]
fn constraint_check(
    tok: ResourceArc<TokenizerResource>,
    constraint: (Atom, String),
) -> NifResult<bool> {
    let Ok(Some(spec)) = constraint_spec(Some(constraint)) else {
        return Err(NifError::new(
            "invalid_argument",
            "a constraint must be {:json_schema | :regex | :grammar, text}",
        ));
    };
    guard(|| {
        RowConstraint::new(&*tok.tokenizer.constraint_factory()?, &spec)?;
        Ok(true)
    })
}

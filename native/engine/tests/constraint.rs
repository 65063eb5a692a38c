//! Constrained decoding on a random-weight model: whatever the model
//! prefers, every output matches its JSON Schema, regex or Lark grammar.

mod common;

use std::sync::Arc;

use common::schema::validate;
use common::*;
use emlx_axon_engine::{
    ConstraintSpec, FinishReason, GenerateOptions, Generation, Model, RowOptions, SamplerConfig,
    SamplerKind, Tokenizer,
};
use serde_json::{json, Value};

const FIXTURE: &str = "qwen3-4bit-g64";

fn model() -> Arc<Model> {
    load_f32(FIXTURE)
}

fn sampler(kind: SamplerKind) -> SamplerConfig {
    SamplerConfig {
        kind,
        temperature: 1.0,
        top_p: 0.95,
        seed: Some(1),
        ..SamplerConfig::default()
    }
}

struct Run {
    texts: Vec<String>,
    ids: Vec<Vec<u32>>,
    finish: Vec<Option<FinishReason>>,
}

fn run(
    tokenizer: &Arc<Tokenizer>,
    prompts: &[Vec<u32>],
    rows: Vec<RowOptions>,
    sampler: SamplerConfig,
    max_new_tokens: usize,
) -> Run {
    let options = GenerateOptions {
        max_new_tokens,
        sampler,
        rows,
        ..GenerateOptions::default()
    };
    let mut generation =
        Generation::start(model(), Some(tokenizer.clone()), None, prompts, options).unwrap();
    let mut texts = vec![String::new(); prompts.len()];
    let mut finish = vec![None; prompts.len()];
    while !generation.is_done() {
        for (i, d) in generation.next(8).unwrap().into_iter().enumerate() {
            texts[i].push_str(&d.text);
            finish[i] = d.finish.or(finish[i]);
        }
    }
    Run {
        texts,
        ids: generation.generated(),
        finish,
    }
}

fn seeded(n: usize, spec: &ConstraintSpec) -> Vec<RowOptions> {
    (0..n)
        .map(|i| RowOptions {
            seed: Some(100 + i as u64),
            constraint: Some(spec.clone()),
        })
        .collect()
}

fn schemas() -> Vec<Value> {
    vec![
        // Nested objects, required and optional keys, no extra keys.
        json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string", "minLength": 1, "maxLength": 10},
                        "zip": {"type": "string", "maxLength": 5}
                    },
                    "required": ["city"],
                    "additionalProperties": false
                }
            },
            "required": ["name", "address"],
            "additionalProperties": false
        }),
        // Arrays with bounds, of enums.
        json!({
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"enum": ["red", "green", "blue"]},
                    "minItems": 1,
                    "maxItems": 3
                },
                "level": {"enum": ["low", "mid", "high", 3]}
            },
            "required": ["tags", "level"],
            "additionalProperties": false
        }),
        // Numbers with ranges, booleans, null, arrays of integers.
        json!({
            "type": "object",
            "properties": {
                "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                "count": {"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 9},
                "ok": {"type": "boolean"},
                "none": {"type": "null"},
                "points": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": -5, "maximum": 5},
                    "maxItems": 4
                }
            },
            "required": ["score", "count", "ok", "none", "points"],
            "additionalProperties": false
        }),
        // An array at the top, of small objects.
        json!({
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}},
                "required": ["id"],
                "additionalProperties": false
            },
            "minItems": 2,
            "maxItems": 3
        }),
    ]
}

fn prompt(tokenizer: &Tokenizer) -> Vec<u32> {
    tokenizer.encode("Answer in JSON:", false).unwrap()
}

#[test]
fn sampled_outputs_validate_against_their_schemas() {
    let tokenizer = tokenizer(FIXTURE);
    let kinds = [
        SamplerKind::TopPGpu,
        SamplerKind::TopPCpu,
        SamplerKind::TopPGpu,
        SamplerKind::TopPCpu,
    ];
    let mut distinct = std::collections::HashSet::new();
    for (schema, kind) in schemas().into_iter().zip(kinds) {
        let spec = ConstraintSpec::JsonSchema(schema.to_string());
        let prompts = vec![prompt(&tokenizer); 20];
        let out = run(&tokenizer, &prompts, seeded(20, &spec), sampler(kind), 256);
        for (i, text) in out.texts.iter().enumerate() {
            assert!(
                matches!(out.finish[i], Some(FinishReason::Stop | FinishReason::Eos)),
                "row {i} did not complete ({:?}): {text}",
                out.finish[i]
            );
            let value: Value = serde_json::from_str(text)
                .unwrap_or_else(|e| panic!("row {i} is not JSON ({e}): {text}"));
            validate(&value, &schema, "$")
                .unwrap_or_else(|e| panic!("row {i} breaks its schema: {e}\n{text}"));
        }
        distinct.extend(out.texts);
    }
    // The seeds matter: sampling is not collapsed onto one output a schema.
    assert!(distinct.len() > 8, "too few distinct outputs: {distinct:?}");
}

#[test]
fn greedy_top_k_and_min_p_outputs_validate() {
    let tokenizer = tokenizer(FIXTURE);
    let schema = &schemas()[1];
    let spec = ConstraintSpec::JsonSchema(schema.to_string());
    let configs = [
        SamplerConfig::default(),
        SamplerConfig {
            top_k: 5,
            top_p: 1.0,
            ..sampler(SamplerKind::TopPGpu)
        },
        SamplerConfig {
            min_p: 0.1,
            top_p: 1.0,
            ..sampler(SamplerKind::TopPCpu)
        },
        SamplerConfig {
            temperature: 0.0,
            ..sampler(SamplerKind::TopPGpu)
        },
    ];
    for config in configs {
        let prompts = vec![prompt(&tokenizer); 4];
        let out = run(&tokenizer, &prompts, seeded(4, &spec), config.clone(), 256);
        for text in &out.texts {
            let value: Value = serde_json::from_str(text)
                .unwrap_or_else(|e| panic!("{config:?}: not JSON ({e}): {text}"));
            validate(&value, schema, "$").unwrap();
        }
    }
}

#[test]
fn regex_and_lark_outputs_match() {
    let tokenizer = tokenizer(FIXTURE);
    let prompts = vec![prompt(&tokenizer); 20];
    let rx = r"[0-9]{3}-[a-z]{2,4}";
    let checker = regex::Regex::new(&format!("^{rx}$")).unwrap();
    let out = run(
        &tokenizer,
        &prompts,
        seeded(20, &ConstraintSpec::Regex(rx.into())),
        sampler(SamplerKind::TopPGpu),
        64,
    );
    for text in &out.texts {
        assert!(checker.is_match(text), "{text:?} does not match {rx}");
    }

    let lark = r#"
        start: greeting " " number ("," number)*
        greeting: "hello" | "bye"
        number: /[1-9][0-9]?/
    "#;
    let checker = regex::Regex::new(r"^(hello|bye) [1-9][0-9]?(,[1-9][0-9]?)*$").unwrap();
    let out = run(
        &tokenizer,
        &prompts,
        seeded(20, &ConstraintSpec::Lark(lark.into())),
        sampler(SamplerKind::TopPCpu),
        48,
    );
    for (text, finish) in out.texts.iter().zip(&out.finish) {
        // An open-ended list may run to the token budget; what was produced
        // must still be in the language.
        assert!(
            checker.is_match(text),
            "{text:?} is outside the grammar ({finish:?})"
        );
    }
}

#[test]
fn free_rows_equal_their_unconstrained_runs() {
    let tokenizer = tokenizer(FIXTURE);
    let refs = reference(FIXTURE, "");
    let (a, b) = (refs[0].1.clone(), refs[1].1.clone());
    let spec = ConstraintSpec::JsonSchema(schemas()[1].to_string());
    for config in [
        SamplerConfig::default(),
        sampler(SamplerKind::TopPGpu),
        sampler(SamplerKind::TopPCpu),
    ] {
        let prompts = vec![a.clone(), b.clone(), a.clone(), b.clone()];
        let rows: Vec<RowOptions> = (0..4)
            .map(|i| RowOptions {
                seed: Some(7 + i as u64),
                constraint: (i % 2 == 1).then(|| spec.clone()),
            })
            .collect();
        let free: Vec<RowOptions> = rows
            .iter()
            .map(|r| RowOptions {
                constraint: None,
                ..r.clone()
            })
            .collect();
        let mixed = run(&tokenizer, &prompts, rows, config.clone(), 64);
        let plain = run(&tokenizer, &prompts, free, config.clone(), 64);
        for i in [0, 2] {
            assert_eq!(
                mixed.ids[i], plain.ids[i],
                "{config:?}: free row {i} changed"
            );
        }
        for i in [1, 3] {
            let value: Value = serde_json::from_str(&mixed.texts[i]).unwrap_or_else(|e| {
                panic!("{config:?}: row {i} not JSON ({e}): {}", mixed.texts[i])
            });
            validate(&value, &schemas()[1], "$").unwrap();
        }
    }
}

#[test]
fn grammar_completion_and_eos_are_consistent() {
    let tokenizer = tokenizer(FIXTURE);
    let prompts = vec![prompt(&tokenizer)];
    // Only one output is possible: it ends with `:stop`, without an EOS.
    let out = run(
        &tokenizer,
        &prompts,
        seeded(1, &ConstraintSpec::Regex("yes|no".into())),
        SamplerConfig::default(),
        16,
    );
    assert!(
        out.texts[0] == "yes" || out.texts[0] == "no",
        "{:?}",
        out.texts
    );
    assert_eq!(out.finish[0], Some(FinishReason::Stop));
    let eos = tokenizer.eos_token_ids();
    assert!(!out.ids[0].iter().any(|t| eos.contains(t)));
}

fn start_error(spec: ConstraintSpec, tokenizer: bool) -> emlx_axon_engine::Error {
    let options = GenerateOptions {
        rows: vec![RowOptions {
            seed: None,
            constraint: Some(spec),
        }],
        ..GenerateOptions::default()
    };
    let tokenizer = tokenizer.then(|| common::tokenizer(FIXTURE));
    match Generation::start(model(), tokenizer, None, &[vec![1, 2]], options) {
        Ok(_) => panic!("the generation started"),
        Err(e) => e,
    }
}

#[test]
fn invalid_constraints_are_argument_errors() {
    let cases = [
        (
            ConstraintSpec::JsonSchema("{not json".into()),
            "json_schema is not valid JSON",
        ),
        (
            ConstraintSpec::JsonSchema("[1]".into()),
            "json_schema must be a JSON object",
        ),
        (
            ConstraintSpec::JsonSchema(r#"{"type": "strin"}"#.into()),
            "invalid json_schema",
        ),
        (
            ConstraintSpec::JsonSchema(
                r#"{"type": "object", "dependentSchemas": {"a": {}}}"#.into(),
            ),
            "dependentSchemas",
        ),
        (ConstraintSpec::Regex("(ab".into()), "invalid regex"),
        (ConstraintSpec::Lark("start: foo".into()), "invalid grammar"),
    ];
    for (spec, expected) in cases {
        let e = start_error(spec.clone(), true);
        assert_eq!(e.kind(), "invalid_constraint", "{spec:?}: {e}");
        assert!(e.to_string().contains(expected), "{spec:?}: {e}");
    }
    let e = start_error(ConstraintSpec::Regex("a".into()), false);
    assert!(e.to_string().contains("needs a tokenizer"), "{e}");
}

/// A row's mask as bits (what our GPU kernels read) and as the bias made of
/// them (what the other paths add to the logits) allow the same tokens, two
/// rows of one grammar the same: those that start
/// the regex's text; where it may end, the end-of-sequence tokens too (none
/// with `ignore_eos`); and no bit past the vocabulary.
#[test]
fn mask_bits_and_biases_allow_the_same_tokens() {
    use emlx_axon_engine::text::constraint::{bias_of_mask, RowConstraint};
    let tokenizer = tokenizer(FIXTURE);
    let factory = tokenizer.constraint_factory().unwrap();
    let spec = ConstraintSpec::Regex("(yes|no)!?".into());
    let eos = tokenizer.eos_token_ids().to_vec();
    assert!(!eos.is_empty());
    // A vocabulary past the tokenizer's and not a multiple of 32.
    let vocab = tokenizer.vocab_size() + 37;
    let allowed = |c: &mut RowConstraint, ignore_eos: bool| {
        let mut bits = vec![u32::MAX; vocab.div_ceil(32)];
        assert!(c.write_mask(&eos, ignore_eos, vocab, &mut bits).unwrap());
        assert_eq!(
            bits.last().unwrap() >> (vocab % 32),
            0,
            "bits past the vocabulary"
        );
        (0..vocab as u32)
            .filter(|&i| bits[i as usize / 32] >> (i % 32) & 1 == 1)
            .collect::<Vec<u32>>()
    };
    let texts = |ids: &[u32]| -> Vec<String> {
        ids.iter()
            .filter(|i| !eos.contains(i))
            .map(|&i| tokenizer.decode(&[i], false).unwrap())
            .collect()
    };
    let mut a = RowConstraint::new(&factory, &spec).unwrap();
    let mut b = RowConstraint::new(&factory, &spec).unwrap();
    let ids = allowed(&mut a, false);
    let mut bits = vec![0u32; vocab.div_ceil(32)];
    assert!(b.write_mask(&eos, false, vocab, &mut bits).unwrap());
    let mut bias = vec![1f32; vocab];
    bias_of_mask(&bits, &mut bias);
    for (i, x) in bias.iter().enumerate() {
        assert_eq!(*x == 0.0, ids.contains(&(i as u32)), "token {i}");
        assert!(*x == 0.0 || *x == f32::NEG_INFINITY);
    }
    assert!(
        ids.len() >= 2 && !ids.iter().any(|i| eos.contains(i)),
        "{ids:?}"
    );
    for text in texts(&ids) {
        assert!(
            !text.is_empty() && ("yes!".starts_with(&text) || "no!".starts_with(&text)),
            "{text:?}"
        );
    }
    // After "yes" the text may end: the end-of-sequence tokens join "!".
    for id in tokenizer.encode("yes", false).unwrap() {
        assert!(!a.consume(id).unwrap());
        assert!(!b.consume(id).unwrap());
    }
    let ends = allowed(&mut a, false);
    assert!(eos.iter().all(|e| ends.contains(e)), "{ends:?}");
    let bangs = allowed(&mut b, true);
    assert!(!bangs.iter().any(|i| eos.contains(i)), "{bangs:?}");
    assert_eq!(texts(&ends), texts(&bangs));
    assert!(
        texts(&bangs).iter().all(|t| t == "!"),
        "{:?}",
        texts(&bangs)
    );
}

/// A mask computed over parts of the vocabulary, each by its own copy of
/// the parser on its own thread, is the mask one parser computes, step by
/// step along seeded random paths through JSON Schemas (strings bounded in
/// length, nested objects), a regex and a Lark grammar; so are the forced
/// tokens. The paths cross states where a part allows none of its tokens.
#[test]
fn masks_in_parts_equal_one_parsers_masks() {
    use emlx_axon_engine::text::constraint::{ConstraintFactory, RowConstraint};
    let tokenizer = tokenizer(FIXTURE);
    let inner = tokenizers::Tokenizer::from_file(fixture(FIXTURE).join("tokenizer.json")).unwrap();
    let eos = tokenizer.eos_token_ids().to_vec();
    let one = ConstraintFactory::with_parts(&inner, &eos, 1).unwrap();
    let parted = ConstraintFactory::with_parts(&inner, &eos, 3).unwrap();
    let vocab = tokenizer.vocab_size();
    let list = json!({"type": "object",
        "properties": {"items": {"type": "array",
            "items": {"type": "string", "minLength": 3, "maxLength": 12}, "minItems": 4}},
        "required": ["items"], "additionalProperties": false});
    let specs = [
        ConstraintSpec::JsonSchema(list.to_string()),
        ConstraintSpec::JsonSchema(schemas()[0].to_string()),
        ConstraintSpec::JsonSchema(schemas()[2].to_string()),
        ConstraintSpec::Regex("[a-z]{2,9}( [a-z]{2,9}){0,12}\\.".into()),
        ConstraintSpec::Lark(
            "start: item (\", \" item)*\nitem: /[0-9]{1,4}/ | \"none\" | /\"[a-z ]{0,20}\"/".into(),
        ),
    ];
    let mut state = 7u64;
    let mut narrow = 0;
    for spec in &specs {
        for path in 0..3 {
            let mut a = RowConstraint::new(&one, spec).unwrap();
            let mut b = RowConstraint::new(&parted, spec).unwrap();
            for step in 0..120 {
                assert_eq!(a.forced_tokens().unwrap(), b.forced_tokens().unwrap());
                let mut bits_a = vec![0u32; vocab.div_ceil(32)];
                let mut bits_b = vec![u32::MAX; vocab.div_ceil(32)];
                let more = a.write_mask(&eos, false, vocab, &mut bits_a).unwrap();
                assert_eq!(more, b.write_mask(&eos, false, vocab, &mut bits_b).unwrap());
                assert!(bits_a == bits_b, "{spec:?} path {path} step {step}");
                let allowed: Vec<u32> = (0..vocab as u32)
                    .filter(|&i| bits_a[i as usize / 32] >> (i % 32) & 1 == 1)
                    .filter(|i| !eos.contains(i))
                    .collect();
                if !more || allowed.is_empty() {
                    break;
                }
                if allowed.len() < 500 {
                    narrow += 1;
                }
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let token = allowed[(state >> 33) as usize % allowed.len()];
                let complete = a.consume(token).unwrap();
                assert_eq!(complete, b.consume(token).unwrap());
                if complete {
                    break;
                }
            }
            assert_eq!(b.mask_parts(), 3, "{spec:?} path {path}: a part failed");
        }
    }
    // Narrow masks are the ones most parts have no token of.
    assert!(narrow > 20, "{narrow}");
}

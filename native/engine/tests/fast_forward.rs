//! Fast-forward of grammar-forced tokens: a constrained row takes the tokens
//! its grammar forces without sampling them, a single row feeding them to
//! the model in one forward pass. Every case is compared with the same
//! generation decoded one masked token at a time (`fast_forward: false`),
//! which must give the same tokens.

mod common;

use std::sync::Arc;

use common::*;
use emlx_axon_engine::backend::{Path, Work};
use emlx_axon_engine::{
    ConstraintSpec, FinishReason, GenerateOptions, Generation, Model, RowOptions, SamplerConfig,
    SamplerKind, Stats, Tokenizer,
};
use serde_json::{json, Value};

const FIXTURE: &str = "qwen3-4bit-g64";

struct Run {
    ids: Vec<Vec<u32>>,
    texts: Vec<String>,
    finish: Vec<Option<FinishReason>>,
    stats: Stats,
}

struct Case<'a> {
    model: &'a Arc<Model>,
    tokenizer: &'a Arc<Tokenizer>,
    prompts: Vec<Vec<u32>>,
    constraints: Vec<Option<ConstraintSpec>>,
    sampler: SamplerConfig,
    max_new_tokens: usize,
    stop: Vec<String>,
}

impl Case<'_> {
    fn run(&self, fast_forward: bool) -> Run {
        let options = GenerateOptions {
            max_new_tokens: self.max_new_tokens,
            sampler: self.sampler.clone(),
            stop: self.stop.clone(),
            fast_forward,
            rows: self
                .constraints
                .iter()
                .enumerate()
                .map(|(i, c)| RowOptions {
                    seed: Some(40 + i as u64),
                    constraint: c.clone(),
                })
                .collect(),
            ..GenerateOptions::default()
        };
        let mut generation = Generation::start(
            self.model.clone(),
            Some(self.tokenizer.clone()),
            None,
            &self.prompts,
            options,
        )
        .unwrap();
        let n = self.prompts.len();
        let mut texts = vec![String::new(); n];
        let mut finish = vec![None; n];
        while !generation.is_done() {
            for (i, d) in generation.next(4).unwrap().into_iter().enumerate() {
                texts[i].push_str(&d.text);
                finish[i] = d.finish.or(finish[i]);
            }
        }
        Run {
            ids: generation.generated(),
            texts,
            finish,
            stats: generation.stats(),
        }
    }

    /// Runs with and without fast-forward; the two must agree token for
    /// token, in text and in finish reason.
    fn both(&self) -> (Run, Run) {
        let fast = self.run(true);
        let slow = self.run(false);
        for i in 0..self.prompts.len() {
            assert_eq!(
                fast.ids[i], slow.ids[i],
                "row {i}: fast-forward changed the tokens\nfast: {:?}\nslow: {:?}",
                fast.texts[i], slow.texts[i]
            );
            assert_eq!(fast.texts[i], slow.texts[i], "row {i}");
            assert_eq!(fast.finish[i], slow.finish[i], "row {i}");
            // Fast-forward counts its forced tokens as generated ones.
            assert_eq!(fast.stats.generated_tokens[i], fast.ids[i].len());
        }
        assert!(slow.stats.forced_tokens.iter().all(|&f| f == 0));
        (fast, slow)
    }
}

/// Whether a generation's decode steps were replayed on a GPU: a single row
/// takes its forced tokens one a step there (each step's mask that token
/// alone) instead of running ahead.
fn replayed(stats: &Stats) -> bool {
    stats.paths.main(Work::Decode) == Some(Path::CudaReplay)
}

fn greedy() -> SamplerConfig {
    SamplerConfig::default()
}

fn seeded(kind: SamplerKind) -> SamplerConfig {
    SamplerConfig {
        kind,
        temperature: 1.0,
        top_p: 0.9,
        seed: Some(3),
        ..SamplerConfig::default()
    }
}

fn prompt(tokenizer: &Tokenizer) -> Vec<u32> {
    tokenizer
        .encode("Describe the order in JSON:", false)
        .unwrap()
}

/// Long fixed key names, in a fixed order: most of the output is forced.
fn order_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 999},
            "preferred_communication_channel": {"enum": ["electronic_mail", "telephone"]},
            "delivery_instructions_for_courier": {"type": "string", "maxLength": 6}
        },
        "required": [
            "customer_identification_number",
            "preferred_communication_channel",
            "delivery_instructions_for_courier"
        ],
        "additionalProperties": false
    })
}

fn check_order(text: &str) {
    let value: Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    let object = value.as_object().expect("an object");
    let keys: Vec<&str> = object.keys().map(String::as_str).collect();
    let mut expected = vec![
        "customer_identification_number",
        "preferred_communication_channel",
        "delivery_instructions_for_courier",
    ];
    expected.sort();
    let mut sorted = keys.clone();
    sorted.sort();
    assert_eq!(sorted, expected, "{text}");
    let id = object["customer_identification_number"]
        .as_u64()
        .expect("an integer id");
    assert!(id <= 999, "{text}");
    assert!(
        ["electronic_mail", "telephone"]
            .contains(&object["preferred_communication_channel"].as_str().unwrap()),
        "{text}"
    );
    let note = object["delivery_instructions_for_courier"]
        .as_str()
        .expect("a string");
    assert!(note.chars().count() <= 6, "{text}");
}

#[test]
fn json_schema_forced_keys_take_one_forward_pass() {
    let model = load_f32(FIXTURE);
    let tokenizer = tokenizer(FIXTURE);
    let spec = ConstraintSpec::JsonSchema(order_schema().to_string());
    for sampler in [
        greedy(),
        seeded(SamplerKind::TopPGpu),
        seeded(SamplerKind::TopPCpu),
    ] {
        let case = Case {
            model: &model,
            tokenizer: &tokenizer,
            prompts: vec![prompt(&tokenizer)],
            constraints: vec![Some(spec.clone())],
            sampler: sampler.clone(),
            max_new_tokens: 200,
            stop: vec![],
        };
        let (fast, slow) = case.both();
        assert!(
            matches!(fast.finish[0], Some(FinishReason::Stop | FinishReason::Eos)),
            "{sampler:?}: {:?} {:?}",
            fast.finish[0],
            fast.texts[0]
        );
        check_order(&fast.texts[0]);
        let generated = fast.stats.generated_tokens[0];
        let forced = fast.stats.forced_tokens[0];
        // The key names alone are some twenty tokens.
        assert!(forced >= 15, "{sampler:?}: {forced} forced of {generated}");
        // One pass per sampled token (plus the prompt's), none per forced
        // one; replayed, one a token.
        let most = if replayed(&fast.stats) {
            generated + 1
        } else {
            generated - forced + 1
        };
        assert!(
            fast.stats.forward_passes <= most,
            "{sampler:?}: {} passes for {generated} tokens, {forced} forced",
            fast.stats.forward_passes
        );
        assert!(
            slow.stats.forward_passes >= generated,
            "{sampler:?}: {} passes without fast-forward",
            slow.stats.forward_passes
        );
    }
}

#[test]
fn regex_literal_parts_are_forced() {
    let model = load_f32(FIXTURE);
    let tokenizer = tokenizer(FIXTURE);
    let rx = r"Order number: [0-9]{3}, shipping status: (pending|delivered)\.";
    let checker = regex::Regex::new(&format!("^{rx}$")).unwrap();
    let case = Case {
        model: &model,
        tokenizer: &tokenizer,
        prompts: vec![prompt(&tokenizer)],
        constraints: vec![Some(ConstraintSpec::Regex(rx.into()))],
        sampler: greedy(),
        max_new_tokens: 64,
        stop: vec![],
    };
    let (fast, _) = case.both();
    assert!(checker.is_match(&fast.texts[0]), "{:?}", fast.texts[0]);
    assert_eq!(fast.finish[0], Some(FinishReason::Stop));
    let (generated, forced) = (fast.stats.generated_tokens[0], fast.stats.forced_tokens[0]);
    assert!(forced >= 6, "{forced} forced of {generated}");
    assert!(
        fast.stats.forward_passes < generated || replayed(&fast.stats),
        "{:?}",
        fast.stats
    );
    // The forced opening is spelled as the tokenizer spells it.
    let opening = tokenizer.encode("Order number:", false).unwrap();
    assert_eq!(
        fast.ids[0][..opening.len()],
        opening[..],
        "{:?}",
        fast.ids[0]
    );
}

#[test]
fn limits_and_stop_strings_cut_a_forced_run() {
    let model = load_f32(FIXTURE);
    let tokenizer = tokenizer(FIXTURE);
    let spec = ConstraintSpec::Regex(r"the quick brown fox jumps over the lazy dog [0-9]+".into());
    // max_new_tokens ends the row inside the forced text.
    let short = Case {
        model: &model,
        tokenizer: &tokenizer,
        prompts: vec![prompt(&tokenizer)],
        constraints: vec![Some(spec.clone())],
        sampler: greedy(),
        max_new_tokens: 3,
        stop: vec![],
    };
    let (fast, _) = short.both();
    assert_eq!(fast.ids[0].len(), 3);
    assert_eq!(fast.finish[0], Some(FinishReason::Length));
    assert_eq!(fast.stats.forced_tokens[0], 3);
    // A stop string inside the forced text ends it there.
    let stopped = Case {
        max_new_tokens: 32,
        stop: vec!["over".into()],
        ..short
    };
    let (fast, _) = stopped.both();
    assert_eq!(fast.texts[0], "the quick brown fox jumps ");
    assert_eq!(fast.finish[0], Some(FinishReason::Stop));
}

#[test]
fn batches_force_per_step_and_keep_free_rows_exact() {
    let model = load_f32(FIXTURE);
    let tokenizer = tokenizer(FIXTURE);
    let refs = reference(FIXTURE, "");
    let (free_prompt, free_greedy) = (refs[0].1.clone(), refs[0].2.clone());
    let spec = ConstraintSpec::JsonSchema(order_schema().to_string());
    let case = Case {
        model: &model,
        tokenizer: &tokenizer,
        prompts: vec![prompt(&tokenizer), free_prompt],
        constraints: vec![Some(spec.clone()), None],
        sampler: greedy(),
        max_new_tokens: free_greedy.len(),
        stop: vec![],
    };
    let (fast, _) = case.both();
    // The free row decodes as it does alone (mlx-lm's greedy ids).
    assert_eq!(fast.ids[1], free_greedy);
    assert_eq!(fast.stats.forced_tokens[1], 0);
    assert!(fast.stats.forced_tokens[0] > 0, "{:?}", fast.stats);

    // Sampled rows of a batch take the same tokens too, forced or masked.
    for kind in [SamplerKind::TopPGpu, SamplerKind::TopPCpu] {
        let sampled = Case {
            model: &model,
            tokenizer: &tokenizer,
            prompts: vec![prompt(&tokenizer); 3],
            constraints: vec![Some(spec.clone()), None, Some(spec.clone())],
            sampler: seeded(kind),
            max_new_tokens: 120,
            stop: vec![],
        };
        let (fast, _) = sampled.both();
        check_order(&fast.texts[0]);
        check_order(&fast.texts[2]);
        assert!(fast.stats.forced_tokens[0] > 0 && fast.stats.forced_tokens[2] > 0);
    }

    // The constrained row's tokens, in a batch (one forced token a step)
    // and alone (forced runs in one pass), are the same.
    let long = Case {
        max_new_tokens: 200,
        ..case
    };
    let batched = long.run(true);
    let alone = Case {
        prompts: vec![long.prompts[0].clone()],
        constraints: vec![Some(spec)],
        ..long
    }
    .run(true);
    assert_eq!(batched.ids[0], alone.ids[0], "{:?}", batched.texts[0]);
    check_order(&batched.texts[0]);
    assert_eq!(batched.stats.forced_tokens[0], alone.stats.forced_tokens[0]);
}

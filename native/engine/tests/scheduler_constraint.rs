//! Constrained requests in the continuous-batching scheduler: rows with a
//! JSON Schema, a regex or a Lark grammar share the running batch with free
//! rows, joining at different times; every constrained output is valid and
//! every free row gives the tokens of its solo run.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use common::schema::validate;
use common::*;
use emlx_axon_engine::{
    generate, ConstraintSpec, Error, FinishReason, GenerateOptions, Model, RequestId, RequestStats,
    SamplerConfig, SamplerKind, Scheduler, SchedulerConfig, Tokenizer,
};
use serde_json::{json, Value};

const FIXTURE: &str = "qwen3-4bit-g64";

fn model() -> Arc<Model> {
    load_f32(FIXTURE)
}

fn config(slots: usize) -> SchedulerConfig {
    SchedulerConfig {
        slots,
        capacity: 512,
        prefill_chunk: 8,
        prefix_cache_bytes: 0,
        prefix_min_tokens: 4,
        ..SchedulerConfig::default()
    }
}

fn options(max_new_tokens: usize, sampler: SamplerConfig) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        sampler,
        ..GenerateOptions::default()
    }
}

fn sampled(kind: SamplerKind, seed: u64) -> SamplerConfig {
    SamplerConfig {
        kind,
        temperature: 1.0,
        top_p: 0.95,
        seed: Some(seed),
        ..SamplerConfig::default()
    }
}

/// Nested objects, an array of enums, an enum of mixed types.
fn nested_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 10},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "minLength": 1, "maxLength": 8},
                    "floor": {"type": "integer", "minimum": 0, "maximum": 40}
                },
                "required": ["city", "floor"],
                "additionalProperties": false
            },
            "tags": {
                "type": "array",
                "items": {"enum": ["red", "green", "blue"]},
                "minItems": 1,
                "maxItems": 3
            },
            "level": {"enum": ["low", "high", 3]}
        },
        "required": ["name", "address", "tags", "level"],
        "additionalProperties": false
    })
}

const REGEX: &str = r"[0-9]{3}-[a-z]{2,4}";

/// Every request's tokens, text, finish reason and final stats.
#[derive(Default)]
struct Collected {
    ids: HashMap<RequestId, Vec<u32>>,
    text: HashMap<RequestId, String>,
    finish: HashMap<RequestId, FinishReason>,
    stats: HashMap<RequestId, RequestStats>,
}

impl Collected {
    fn step(&mut self, s: &mut Scheduler, steps: usize) {
        for e in s.step(steps).unwrap() {
            self.ids.entry(e.id).or_default().extend(&e.delta.ids);
            self.text.entry(e.id).or_default().push_str(&e.delta.text);
            if let Some(f) = e.delta.finish {
                assert!(self.finish.insert(e.id, f).is_none(), "finished twice");
                let stats = e.stats.expect("the last event carries stats");
                assert_eq!(stats.generated_tokens, self.ids[&e.id].len());
                self.stats.insert(e.id, stats);
            }
        }
    }

    fn drain(&mut self, s: &mut Scheduler, steps: usize) {
        for _ in 0..10_000 {
            if s.is_idle() {
                return;
            }
            self.step(s, steps);
        }
        panic!("the scheduler did not finish");
    }

    fn check_json(&self, id: RequestId, schema: &Value) {
        let text = &self.text[&id];
        assert!(
            matches!(self.finish[&id], FinishReason::Stop | FinishReason::Eos),
            "request {id} did not complete ({:?}): {text}",
            self.finish[&id]
        );
        let value: Value = serde_json::from_str(text)
            .unwrap_or_else(|e| panic!("request {id} is not JSON ({e}): {text}"));
        validate(&value, schema, "$")
            .unwrap_or_else(|e| panic!("request {id} breaks its schema: {e}\n{text}"));
        assert!(self.stats[&id].constraint_ms > 0.0);
    }

    fn check_regex(&self, id: RequestId) {
        let checker = regex::Regex::new(&format!("^{REGEX}$")).unwrap();
        let text = &self.text[&id];
        assert!(checker.is_match(text), "{text:?} does not match {REGEX}");
        assert!(
            matches!(self.finish[&id], FinishReason::Stop | FinishReason::Eos),
            "{text:?}: {:?}",
            self.finish[&id]
        );
    }
}

fn prompt(tokenizer: &Tokenizer, text: &str) -> Vec<u32> {
    tokenizer.encode(text, false).unwrap()
}

fn json_spec() -> ConstraintSpec {
    ConstraintSpec::JsonSchema(nested_schema().to_string())
}

/// `steps`: decode steps per call (several exercise the pipelined path).
fn mixed_batch(steps: usize) {
    let model = model();
    let tokenizer = tokenizer(FIXTURE);
    let refs = reference(FIXTURE, "");
    let (a, b) = (refs[0].1.clone(), refs[1].1.clone());
    let free = GenerateOptions {
        ignore_eos: true,
        ..options(40, SamplerConfig::default())
    };
    let mut s = Scheduler::new(model.clone(), Some(tokenizer.clone()), config(4)).unwrap();
    let mut c = Collected::default();
    let greedy = || options(200, SamplerConfig::default());

    let free_a = s.admit(a.clone(), free.clone()).unwrap();
    let json = s
        .admit_constrained(prompt(&tokenizer, "A person:"), greedy(), Some(json_spec()))
        .unwrap();
    c.step(&mut s, steps);
    c.step(&mut s, steps);
    let rx = s
        .admit_constrained(
            prompt(&tokenizer, "A code:"),
            greedy(),
            Some(ConstraintSpec::Regex(REGEX.into())),
        )
        .unwrap();
    c.step(&mut s, steps);
    let free_b = s.admit(b.clone(), free.clone()).unwrap();
    c.step(&mut s, steps);
    // Joins once a slot frees up.
    let json_late = s
        .admit_constrained(a.clone(), greedy(), Some(json_spec()))
        .unwrap();
    c.drain(&mut s, steps);

    let solo = |p: &[u32]| generate(model.clone(), None, p, free.clone()).unwrap().ids;
    assert_eq!(c.ids[&free_a], solo(&a), "free row a changed");
    assert_eq!(c.ids[&free_b], solo(&b), "free row b changed");
    assert_eq!(c.stats[&free_a].constraint_ms, 0.0);
    c.check_json(json, &nested_schema());
    c.check_json(json_late, &nested_schema());
    c.check_regex(rx);
}

#[test]
fn constrained_and_free_rows_share_the_batch_one_step_per_call() {
    mixed_batch(1);
}

#[test]
fn constrained_and_free_rows_share_the_batch_pipelined() {
    mixed_batch(4);
}

#[test]
fn sampled_constrained_rows_are_valid_and_free_ones_keep_their_seed() {
    let model = model();
    let tokenizer = tokenizer(FIXTURE);
    let refs = reference(FIXTURE, "");
    let schema = nested_schema();
    let lark = r#"
        start: greeting " " number ("," number)*
        greeting: "hello" | "bye"
        number: /[1-9][0-9]?/
    "#;
    let lark_check = regex::Regex::new(r"^(hello|bye) [1-9][0-9]?(,[1-9][0-9]?)*$").unwrap();
    let mut distinct = std::collections::HashSet::new();
    for kind in [SamplerKind::TopPGpu, SamplerKind::TopPCpu] {
        let mut s = Scheduler::new(model.clone(), Some(tokenizer.clone()), config(8)).unwrap();
        let mut c = Collected::default();
        let free = |seed| GenerateOptions {
            ignore_eos: true,
            ..options(24, sampled(kind, seed))
        };
        let mut jsons = vec![];
        let mut grammars = vec![];
        let mut frees = vec![];
        for round in 0..4u64 {
            let p = prompt(&tokenizer, "Answer in JSON:");
            jsons.push(
                s.admit_constrained(
                    p,
                    options(200, sampled(kind, 10 + round)),
                    Some(ConstraintSpec::JsonSchema(schema.to_string())),
                )
                .unwrap(),
            );
            let p = refs[round as usize % refs.len()].1.clone();
            frees.push((s.admit(p.clone(), free(20 + round)).unwrap(), p, 20 + round));
            if round % 2 == 0 {
                grammars.push(
                    s.admit_constrained(
                        prompt(&tokenizer, "Say:"),
                        options(32, sampled(kind, 30 + round)),
                        Some(ConstraintSpec::Lark(lark.into())),
                    )
                    .unwrap(),
                );
            }
            c.step(&mut s, 3);
            c.step(&mut s, 3);
        }
        c.drain(&mut s, 3);
        for &id in &jsons {
            c.check_json(id, &schema);
            distinct.insert(c.text[&id].clone());
        }
        for &id in &grammars {
            // An open-ended list may run to the token budget; what was
            // produced must still be in the language.
            let text = &c.text[&id];
            assert!(lark_check.is_match(text), "{text:?} is outside the grammar");
        }
        for (id, p, seed) in &frees {
            let alone = generate(model.clone(), None, p, free(*seed)).unwrap().ids;
            assert_eq!(c.ids[id], alone, "{kind:?}: free row seeded {seed} changed");
        }
    }
    // The seeds matter: sampling is not collapsed onto one output. (The
    // random fixture's constrained distributions are peaked, and on a CPU
    // stream both samplers draw the same tokens for a seed.)
    assert!(
        distinct.len() >= 2,
        "too few distinct outputs: {distinct:?}"
    );
}

#[test]
fn a_grammar_complete_at_its_first_token_or_later_ends_with_stop() {
    let model = model();
    let tokenizer = tokenizer(FIXTURE);
    let eos = tokenizer.eos_token_ids().to_vec();
    let mut s = Scheduler::new(model.clone(), Some(tokenizer.clone()), config(2)).unwrap();
    let mut c = Collected::default();
    let p = prompt(&tokenizer, "Answer:");
    let short = s
        .admit_constrained(
            p.clone(),
            options(16, SamplerConfig::default()),
            Some(ConstraintSpec::Regex("yes|no".into())),
        )
        .unwrap();
    let longer = s
        .admit_constrained(
            p,
            options(16, SamplerConfig::default()),
            Some(ConstraintSpec::Regex("(yes|no), (yes|no), (yes|no)".into())),
        )
        .unwrap();
    c.drain(&mut s, 4);
    assert!(matches!(c.text[&short].as_str(), "yes" | "no"));
    let three = regex::Regex::new("^(yes|no), (yes|no), (yes|no)$").unwrap();
    assert!(three.is_match(&c.text[&longer]), "{:?}", c.text[&longer]);
    for id in [short, longer] {
        assert_eq!(c.finish[&id], FinishReason::Stop);
        assert!(!c.ids[&id].iter().any(|t| eos.contains(t)));
    }
}

#[test]
fn bad_constraints_are_refused_before_queueing() {
    let model = model();
    let tokenizer = tokenizer(FIXTURE);
    let mut s = Scheduler::new(model.clone(), Some(tokenizer.clone()), config(1)).unwrap();
    let o = || options(4, SamplerConfig::default());
    for spec in [
        ConstraintSpec::JsonSchema("{not json".into()),
        ConstraintSpec::JsonSchema(r#"{"type": "strin"}"#.into()),
        ConstraintSpec::Regex("(ab".into()),
        ConstraintSpec::Lark("start: missing_rule".into()),
    ] {
        match s.admit_constrained(vec![1, 2], o(), Some(spec.clone())) {
            Err(e @ Error::InvalidConstraint(_)) => assert_eq!(e.kind(), "invalid_constraint"),
            other => panic!("{spec:?}: {other:?}"),
        }
    }
    assert!(s.is_idle(), "nothing was queued");
    let mut bare = Scheduler::new(model, None, config(1)).unwrap();
    let needs = bare.admit_constrained(vec![1, 2], o(), Some(ConstraintSpec::Regex("a".into())));
    assert!(
        matches!(&needs, Err(Error::InvalidConstraint(m)) if m.contains("needs a tokenizer")),
        "{:?}",
        needs.map(|_| ())
    );
    assert!(bare.is_idle());
}

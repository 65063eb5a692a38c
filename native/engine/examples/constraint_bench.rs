//! Decode speed with a JSON Schema constraint, with and without
//! fast-forward of grammar-forced tokens, against unconstrained decoding of
//! the same prompt, at batch sizes 1 and 4; one JSON line per setting.
//!
//! cargo run --release -p emlx_axon_engine --example constraint_bench -- DIR [TOKENS] [RUNS]
//!
//! DIR holds a checkpoint and its tokenizer. Every row samples (top-p on the
//! device, seeded) up to TOKENS tokens. Two schemas: `list`, a long array of
//! short strings (constrained rows decode about as long as free ones; only
//! the separators are forced), and `record`, an object with long fixed key
//! names (mostly forced; a row ends when the object is complete). After an
//! untimed warm-up, settings are interleaved (each once per round, RUNS
//! rounds). Reported, as medians: decode tokens/s of the longest row (tokens
//! after the first step's, over the time from the first step to the last),
//! its inverse in ms per token, the whole generation's wall time (prefill
//! included) per token of the longest row, and the host time for masks and
//! forced tokens per generated token; and the last run's generated and forced
//! tokens and forward passes.

use std::path::PathBuf;
use std::sync::Arc;

use emlx_axon_engine::{
    ConstraintSpec, GenerateOptions, Generation, LoadOptions, Model, RowOptions, SamplerConfig,
    SamplerKind, Tokenizer,
};
use serde_json::json;

const LIST: &str = r#"{"type": "object", "properties": {"items": {"type": "array",
  "items": {"type": "string", "minLength": 3, "maxLength": 12}, "minItems": 200}},
  "required": ["items"], "additionalProperties": false}"#;

const RECORD: &str = r#"{"type": "object", "properties": {
  "customer_identification_number": {"type": "integer", "minimum": 0, "maximum": 99999},
  "preferred_communication_channel": {"enum": ["electronic_mail", "telephone"]},
  "delivery_instructions_for_courier": {"type": "string", "maxLength": 8},
  "requested_delivery_time_window": {"type": "string", "maxLength": 8}},
  "required": ["customer_identification_number", "preferred_communication_channel",
    "delivery_instructions_for_courier", "requested_delivery_time_window"],
  "additionalProperties": false}"#;

#[derive(Clone, Default)]
struct Measured {
    per_s: Vec<f64>,
    ms_per_token: Vec<f64>,
    wall_ms_per_token: Vec<f64>,
    constraint_ms: Vec<f64>,
    last: serde_json::Value,
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(
        args.get(1)
            .ok_or("usage: constraint_bench DIR [TOKENS] [RUNS]")?,
    );
    let tokens: usize = args.get(2).map_or(Ok(64), |t| t.parse())?;
    let runs: usize = args.get(3).map_or(Ok(3), |t| t.parse())?;
    let model = Arc::new(Model::load(&dir, &LoadOptions::default())?);
    let tokenizer = Arc::new(Tokenizer::load(&dir)?);
    let prompt = tokenizer.encode("Write the order as JSON:", false)?;
    let warm_up = GenerateOptions {
        max_new_tokens: 8,
        ..GenerateOptions::default()
    };
    let mut generation = Generation::start(
        model.clone(),
        None,
        None,
        std::slice::from_ref(&prompt),
        warm_up,
    )?;
    while !generation.is_done() {
        generation.next(16)?;
    }
    let settings: [(&str, Option<&str>, bool); 5] = [
        ("none", None, true),
        ("list", Some(LIST), false),
        ("list", Some(LIST), true),
        ("record", Some(RECORD), false),
        ("record", Some(RECORD), true),
    ];
    for batch in [1usize, 4] {
        let mut measured = vec![Measured::default(); settings.len()];
        for run in 0..runs {
            for (&(_, schema, fast_forward), m) in settings.iter().zip(&mut measured) {
                let rows = (0..batch)
                    .map(|i| RowOptions {
                        seed: Some((run * 16 + i) as u64),
                        constraint: schema.map(|s| ConstraintSpec::JsonSchema(s.into())),
                    })
                    .collect();
                let options = GenerateOptions {
                    max_new_tokens: tokens,
                    ignore_eos: true,
                    sampler: SamplerConfig {
                        kind: SamplerKind::TopPGpu,
                        top_p: 0.95,
                        seed: Some(run as u64),
                        ..SamplerConfig::default()
                    },
                    rows,
                    fast_forward,
                    ..GenerateOptions::default()
                };
                let prompts = vec![prompt.clone(); batch];
                let started = std::time::Instant::now();
                let mut generation = Generation::start(
                    model.clone(),
                    Some(tokenizer.clone()),
                    None,
                    &prompts,
                    options,
                )?;
                while !generation.is_done() {
                    generation.next(16)?;
                }
                let wall_ms = started.elapsed().as_secs_f64() * 1e3;
                let stats = generation.stats();
                let longest = stats.generated_tokens.iter().copied().max().unwrap_or(0);
                m.wall_ms_per_token.push(wall_ms / longest.max(1) as f64);
                let generated: usize = stats.generated_tokens.iter().sum();
                m.per_s.push(stats.decode_tokens_per_s);
                m.ms_per_token
                    .push(1e3 / stats.decode_tokens_per_s.max(1e-9));
                m.constraint_ms
                    .push(stats.constraint_ms / generated.max(1) as f64);
                m.last = json!({
                    "generated_tokens": stats.generated_tokens,
                    "forced_tokens": stats.forced_tokens,
                    "forward_passes": stats.forward_passes,
                });
            }
        }
        for (&(name, _, fast_forward), m) in settings.iter().zip(&mut measured) {
            println!(
                "{}",
                json!({
                    "batch": batch,
                    "schema": name,
                    "fast_forward": fast_forward,
                    "decode_tokens_per_s": median(&mut m.per_s),
                    "decode_ms_per_token": median(&mut m.ms_per_token),
                    "wall_ms_per_token": median(&mut m.wall_ms_per_token),
                    "constraint_ms_per_token": median(&mut m.constraint_ms),
                    "decode_tokens_per_s_all": m.per_s,
                    "last_run": m.last,
                    "runs": runs,
                })
            );
        }
    }
    Ok(())
}

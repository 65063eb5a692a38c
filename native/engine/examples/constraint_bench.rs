//! Decode speed with a JSON Schema constraint against unconstrained decoding
//! of the same prompt, at several batch sizes; one JSON line per run.
//!
//! cargo run --release -p emlx_axon_engine --example constraint_bench -- DIR [TOKENS] [RUNS]
//!
//! DIR holds a checkpoint and its tokenizer. Every row samples (top-p on the
//! device, seeded) up to TOKENS tokens; the schema asks for a long array of
//! short strings, so constrained rows decode about as long as free ones.
//! Reported: decode tokens/s per row (steps after the first token), the
//! host time spent on masks per decode step, and the tokens generated.

use std::path::PathBuf;
use std::sync::Arc;

use emlx_axon_engine::{
    ConstraintSpec, GenerateOptions, Generation, LoadOptions, Model, RowOptions, SamplerConfig,
    SamplerKind, Tokenizer,
};
use serde_json::json;

const SCHEMA: &str = r#"{"type": "object", "properties": {"items": {"type": "array",
  "items": {"type": "string", "minLength": 3, "maxLength": 12}, "minItems": 200}},
  "required": ["items"], "additionalProperties": false}"#;

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
    let prompt = tokenizer.encode("Write a JSON list of words:", false)?;
    for batch in [1usize, 4] {
        for constrained in [false, true, false, true] {
            let mut per_s = vec![];
            let mut mask_ms = vec![];
            let mut generated = 0;
            for run in 0..runs {
                let rows = (0..batch)
                    .map(|i| RowOptions {
                        seed: Some((run * 16 + i) as u64),
                        constraint: constrained.then(|| ConstraintSpec::JsonSchema(SCHEMA.into())),
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
                    ..GenerateOptions::default()
                };
                let prompts = vec![prompt.clone(); batch];
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
                let stats = generation.stats();
                let steps = stats.generated_tokens.iter().copied().max().unwrap_or(0);
                generated = stats.generated_tokens.iter().sum();
                per_s.push(stats.decode_tokens_per_s);
                mask_ms.push(stats.constraint_ms / steps.max(1) as f64);
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            println!(
                "{}",
                json!({
                    "batch": batch,
                    "constrained": constrained,
                    "decode_tokens_per_s": median(&mut per_s),
                    "mask_ms_per_step": median(&mut mask_ms),
                    "generated_tokens_last_run": generated,
                    "runs": runs,
                })
            );
        }
    }
    Ok(())
}

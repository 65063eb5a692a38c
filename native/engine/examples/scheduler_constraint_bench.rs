//! The scheduler's decode speed with JSON Schema constrained requests
//! against free ones: BATCH requests admitted together, none, half or all
//! of them constrained; one JSON line per setting.
//!
//! cargo run --release -p emlx_axon_engine --example scheduler_constraint_bench -- DIR [TOKENS] [RUNS] [BATCH] [greedy]
//!
//! DIR holds a checkpoint and its tokenizer. Every request samples (top-p on
//! the device, seeded; or greedily) TOKENS tokens; the schema asks for a long array of
//! short strings, so constrained requests decode as long as free ones.
//! Reported (medians over RUNS): tokens per second of the whole batch, from
//! the first step to the last, and the host time a constrained request spent
//! on its constraint per token.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use emlx_axon_engine::{
    ConstraintSpec, GenerateOptions, LoadOptions, Model, SamplerConfig, SamplerKind, Scheduler,
    SchedulerConfig, Tokenizer,
};
use serde_json::json;

const SCHEMA: &str = r#"{"type": "object", "properties": {"items": {"type": "array",
  "items": {"type": "string", "minLength": 3, "maxLength": 12}, "minItems": 200}},
  "required": ["items"], "additionalProperties": false}"#;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = PathBuf::from(
        args.get(1)
            .ok_or("usage: scheduler_constraint_bench DIR [TOKENS] [RUNS] [BATCH] [greedy]")?,
    );
    let tokens: usize = args.get(2).map_or(Ok(64), |t| t.parse())?;
    let runs: usize = args.get(3).map_or(Ok(3), |t| t.parse())?;
    let batch: usize = args.get(4).map_or(Ok(4), |t| t.parse())?;
    let greedy = args.get(5).is_some_and(|a| a == "greedy");
    let model = Arc::new(Model::load(&dir, &LoadOptions::default())?);
    let tokenizer = Arc::new(Tokenizer::load(&dir)?);
    let prompt = tokenizer.encode("Write a JSON list of words:", false)?;
    let config = SchedulerConfig {
        slots: batch,
        capacity: prompt.len() + tokens + 1,
        prefix_cache_bytes: 0,
        ..SchedulerConfig::default()
    };
    let mut scheduler = Scheduler::new(model, Some(tokenizer), config)?;
    for constrained in [0, batch / 2, batch, 0, batch / 2, batch] {
        let mut per_s = vec![];
        let mut mask_ms = vec![];
        for run in 0..runs {
            for i in 0..batch {
                let options = GenerateOptions {
                    max_new_tokens: tokens,
                    ignore_eos: true,
                    sampler: if greedy {
                        SamplerConfig::default()
                    } else {
                        SamplerConfig {
                            kind: SamplerKind::TopPGpu,
                            top_p: 0.95,
                            seed: Some((run * 16 + i) as u64),
                            ..SamplerConfig::default()
                        }
                    },
                    ..GenerateOptions::default()
                };
                let spec = (i < constrained).then(|| ConstraintSpec::JsonSchema(SCHEMA.into()));
                scheduler.admit_constrained(prompt.clone(), options, spec)?;
            }
            // Prefill every prompt, so the timing below is decode alone.
            let mut generated = 0;
            while scheduler.occupancy().waiting > 0 {
                generated += count(scheduler.step(0)?);
            }
            let started = Instant::now();
            let mut constraint_ms = vec![];
            while !scheduler.is_idle() {
                let events = scheduler.step(4)?;
                for e in &events {
                    if let Some(s) = &e.stats {
                        if s.constraint_ms > 0.0 {
                            constraint_ms.push(s.constraint_ms / s.generated_tokens as f64);
                        }
                    }
                }
                generated += count(events);
            }
            let decoded = generated.saturating_sub(batch);
            per_s.push(decoded as f64 / started.elapsed().as_secs_f64());
            if !constraint_ms.is_empty() {
                mask_ms.push(constraint_ms.iter().sum::<f64>() / constraint_ms.len() as f64);
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v.get(v.len() / 2).copied().unwrap_or(0.0)
        };
        println!(
            "{}",
            json!({
                "batch": batch,
                "constrained_requests": constrained,
                "decode_tokens_per_s": median(&mut per_s),
                "constraint_ms_per_token": median(&mut mask_ms),
                "sampler": if greedy { "greedy" } else { "top_p_gpu" },
                "tokens": tokens,
                "runs": runs,
            })
        );
    }
    Ok(())
}

fn count(events: Vec<emlx_axon_engine::Event>) -> usize {
    events.iter().map(|e| e.delta.ids.len()).sum()
}

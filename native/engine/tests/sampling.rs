//! The sampling filters against mlx-lm's own (`sampler.json`, written by
//! `build_fixtures.py` from `apply_top_p`, `apply_min_p`, `apply_top_k` and
//! `softmax(logits / temperature)`), and sampling against that distribution.

mod common;

use common::*;
use emlx_axon_engine::sample::{filter, Sampler};
use emlx_axon_engine::{SamplerConfig, SamplerKind};
use mlx_rs::Array;
use serde_json::Value;

struct Case {
    name: String,
    logits: Vec<f32>,
    config: SamplerConfig,
    kept: Vec<usize>,
    probs: Vec<f64>,
}

fn cases() -> Vec<Case> {
    let refs = json(fixtures().join("sampler.json"));
    let floats = |v: &Value| -> Vec<f64> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    refs["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let config = SamplerConfig {
                kind: SamplerKind::TopPGpu,
                temperature: c["temperature"].as_f64().unwrap() as f32,
                top_p: c["top_p"].as_f64().unwrap() as f32,
                min_p: c["min_p"].as_f64().unwrap() as f32,
                min_tokens_to_keep: c["min_tokens_to_keep"].as_u64().unwrap() as usize,
                top_k: c["top_k"].as_u64().unwrap() as usize,
                seed: Some(1),
            };
            let logits_name = c["logits"].as_str().unwrap();
            Case {
                name: format!(
                    "{logits_name} t={} top_p={} min_p={} keep={} top_k={}",
                    config.temperature,
                    config.top_p,
                    config.min_p,
                    config.min_tokens_to_keep,
                    config.top_k
                ),
                logits: floats(&refs["logits"][logits_name])
                    .into_iter()
                    .map(|x| x as f32)
                    .collect(),
                config,
                kept: c["kept"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as usize)
                    .collect(),
                probs: floats(&c["probs"]),
            }
        })
        .collect()
}

fn finite(values: impl IntoIterator<Item = f32>) -> Vec<usize> {
    values
        .into_iter()
        .enumerate()
        .filter(|(_, x)| x.is_finite())
        .map(|(i, _)| i)
        .collect()
}

fn assert_close(case: &Case, path: &str, probs: &[f64]) {
    for (i, (a, b)) in probs.iter().zip(&case.probs).enumerate() {
        assert!(
            (a - b).abs() < 1e-5,
            "{} ({path}): p[{i}] = {a}, mlx-lm {b}",
            case.name
        );
    }
}

#[test]
fn host_filters_match_mlx_lm() {
    let cases = cases();
    assert!(cases.len() > 100, "only {} sampler cases", cases.len());
    for case in &cases {
        let kept = finite(filter::filtered_logprobs_host(&case.config, &case.logits));
        assert_eq!(kept, case.kept, "{} (host): kept tokens", case.name);
        assert_close(
            case,
            "host",
            &filter::distribution_host(&case.config, &case.logits),
        );
    }
}

#[test]
fn device_filters_match_mlx_lm() {
    for case in &cases() {
        let logits = Array::from_slice(&case.logits, &[1, case.logits.len() as i32]);
        let lp = filter::filtered_logprobs(&case.config, &logits).unwrap();
        lp.eval().unwrap();
        let kept = finite(lp.as_slice::<f32>().iter().copied());
        assert_eq!(kept, case.kept, "{} (device): kept tokens", case.name);
        let probs = filter::distribution(&case.config, &logits).unwrap();
        probs.eval().unwrap();
        let probs: Vec<f64> = probs.as_slice::<f32>().iter().map(|&p| p as f64).collect();
        assert_close(case, "device", &probs);
    }
}

/// Draws many rows (each its own random stream) from one distribution and
/// checks every token's frequency against mlx-lm's probability.
#[test]
fn sampled_tokens_follow_the_distribution() {
    const DRAWS: usize = 4000;
    let cases = cases();
    let picks = cases.iter().filter(|c| {
        c.logits.len() == 64
            && c.config.temperature > 1.0
            && c.kept.len() >= 5
            && c.kept.len() <= 12
    });
    let mut checked = 0;
    for case in picks.take(2) {
        for kind in [SamplerKind::TopPCpu, SamplerKind::TopPGpu] {
            let config = SamplerConfig {
                kind,
                ..case.config.clone()
            };
            let mut sampler = Sampler::new(config, &vec![None; DRAWS]).unwrap();
            let row = Array::from_slice(&case.logits, &[1, case.logits.len() as i32]);
            let logits =
                mlx_rs::ops::broadcast_to(&row, &[DRAWS as i32, case.logits.len() as i32]).unwrap();
            let ids: Vec<u32> = if kind == SamplerKind::TopPCpu {
                sampler.sample_host(&logits).unwrap()
            } else {
                let ids = sampler.sample_device(&logits).unwrap();
                ids.eval().unwrap();
                ids.as_slice::<u32>().to_vec()
            };
            let mut counts = vec![0usize; case.logits.len()];
            for id in ids {
                counts[id as usize] += 1;
            }
            for (i, (&n, &p)) in counts.iter().zip(&case.probs).enumerate() {
                let freq = n as f64 / DRAWS as f64;
                let bound = 5.0 * (p * (1.0 - p) / DRAWS as f64).sqrt() + 1e-9;
                assert!(
                    (freq - p).abs() <= bound,
                    "{} ({kind:?}): token {i} drawn {freq}, probability {p}",
                    case.name
                );
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 4, "no suitable sampler cases");
}

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

/// The ids a top-k candidate set leaves finite, ascending.
fn candidates_kept(config: &SamplerConfig, logits: &Array) -> Option<Vec<usize>> {
    let (ids, lp) = filter::filtered_candidates(config, logits).unwrap()?;
    mlx_rs::transforms::eval([&ids, &lp]).unwrap();
    let mut kept: Vec<usize> = ids
        .as_slice::<u32>()
        .iter()
        .zip(lp.as_slice::<f32>())
        .filter(|(_, x)| x.is_finite())
        .map(|(&i, _)| i as usize)
        .collect();
    kept.sort_unstable();
    Some(kept)
}

/// With top-k, the device filters work on the `k` most likely tokens only:
/// they keep what mlx-lm keeps.
#[test]
fn device_candidates_match_mlx_lm() {
    let mut checked = 0;
    for case in &cases() {
        let logits = Array::from_slice(&case.logits, &[1, case.logits.len() as i32]);
        if let Some(kept) = candidates_kept(&case.config, &logits) {
            assert_eq!(kept, case.kept, "{} (device candidates)", case.name);
            checked += 1;
        }
    }
    assert!(checked > 20, "only {checked} cases with top-k");
}

/// The host's ranked selection keeps exactly what the device's full sort
/// keeps, at a real vocabulary's size, where the kept tokens are a few of
/// 151,936: filters that settle within the first ranked tokens, and ones
/// (a wide nucleus, a low min-p floor) that make it rank further.
#[test]
fn host_selection_keeps_what_a_full_sort_keeps_at_vocabulary_size() {
    const VOCAB: usize = 151_936;
    // Peaked like a language model's logits: a few large values over noise.
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    };
    let logits: Vec<f32> = (0..VOCAB)
        .map(|i| {
            let noise = (uniform() * 8.0 - 4.0) as f32;
            if i % 9973 == 0 {
                noise + 14.0
            } else {
                noise
            }
        })
        .collect();
    let row = Array::from_slice(&logits, &[1, VOCAB as i32]);
    let configs = [
        (0.95, 0.0, 1, 20),
        (0.95, 0.0, 1, 0),
        (0.999, 0.0, 1, 0),
        (1.0, 0.05, 1, 0),
        (1.0, 0.0001, 1, 0),
        (1.0, 0.5, 300, 0),
        (0.8, 0.02, 1, 50),
        (1.0, 0.0, 1, 1),
        (0.7, 0.0, 1, 4000),
    ];
    for (top_p, min_p, keep, top_k) in configs {
        let config = SamplerConfig {
            kind: SamplerKind::TopPCpu,
            temperature: 0.6,
            top_p,
            min_p,
            min_tokens_to_keep: keep,
            top_k,
            seed: Some(1),
        };
        let host = finite(filter::filtered_logprobs_host(&config, &logits));
        let lp = filter::filtered_logprobs(&config, &row).unwrap();
        lp.eval().unwrap();
        let device = finite(lp.as_slice::<f32>().iter().copied());
        assert!(!host.is_empty());
        let only_host = host
            .iter()
            .filter(|i| device.binary_search(i).is_err())
            .count();
        let only_device = device
            .iter()
            .filter(|i| host.binary_search(i).is_err())
            .count();
        let case = format!("top_p={top_p} min_p={min_p} keep={keep} top_k={top_k}");
        assert_eq!(
            host,
            full_sort(&config, &logits),
            "{case}: against a full sort"
        );
        if let Some(kept) = candidates_kept(&config, &row) {
            assert_eq!(kept, host, "{case}: the device's candidates");
        }
        // A nucleus of a large part of the vocabulary ends where float32 sums
        // of 10^4 tiny masses (MLX's) lose their last tokens' mass.
        if host.len() < 1_000 {
            assert!(
                only_host + only_device == 0,
                "{case}: {only_host} kept by the host only, {only_device} by the device only"
            );
        }
    }
}

/// The kept tokens by the filters' definitions over the whole vocabulary
/// sorted, with the host's arithmetic (its sum of exponentials, the
/// log-sum-exp rounded to float32), which decides the last tokens of a
/// nucleus holding most of the vocabulary.
fn full_sort(c: &SamplerConfig, logits: &[f32]) -> Vec<usize> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum = filter::sum_exp(logits, max);
    let lse = max + (sum as f32).ln();
    let lp: Vec<f32> = logits.iter().map(|&x| x - lse).collect();
    let mut order: Vec<usize> = (0..lp.len()).collect();
    order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    let mut kept = vec![true; lp.len()];
    if c.top_p < 1.0 {
        let total = sum * ((max - lse) as f64).exp();
        let mut above = 0f64;
        let mut threshold = f32::NEG_INFINITY;
        for (j, &i) in order.iter().enumerate() {
            if above >= c.top_p as f64 * total {
                threshold = lp[order[j - 1]];
                break;
            }
            above += lp[i].exp() as f64;
        }
        (0..lp.len()).for_each(|i| kept[i] &= lp[i] >= threshold);
    }
    if c.min_p > 0.0 {
        let floor = lp[order[0]] + c.min_p.ln();
        let alive: Vec<usize> = order.iter().copied().filter(|&i| kept[i]).collect();
        for (rank, &i) in alive.iter().enumerate() {
            kept[i] = rank < c.min_tokens_to_keep || lp[i] >= floor;
        }
    }
    if c.top_k > 0 {
        let alive: Vec<usize> = order.iter().copied().filter(|&i| kept[i]).collect();
        alive.iter().skip(c.top_k).for_each(|&i| kept[i] = false);
    }
    (0..lp.len()).filter(|&i| kept[i]).collect()
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
    // One case drawn among top-k candidates (mapped back to ids), one not.
    let (with_k, without_k): (Vec<&Case>, Vec<&Case>) = picks.partition(|c| c.config.top_k > 0);
    assert!(!with_k.is_empty() && !without_k.is_empty());
    let mut checked = 0;
    for case in [with_k[0], without_k[0]] {
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
            assert_frequencies(case, &format!("{kind:?}"), &ids);
            checked += 1;
        }
    }
    assert_eq!(checked, 4, "no suitable sampler cases");
}

/// On a CPU stream the host's sampler is a node of the graph: queued with
/// the step (`on_device`), and drawing, row by row and step by step, the
/// tokens that reading the logits back and sampling on the host draws.
#[test]
fn host_sampling_as_a_cpu_node_draws_the_hosts_tokens() {
    const ROWS: usize = 40;
    let mut compared = 0;
    mlx_rs::with_stream(&mlx_rs::Stream::cpu(), || {
        for case in cases().iter().filter(|c| c.config.temperature > 0.0) {
            let config = SamplerConfig {
                kind: SamplerKind::TopPCpu,
                seed: Some(11),
                ..case.config.clone()
            };
            let mut node = Sampler::new(config.clone(), &vec![None; ROWS]).unwrap();
            let mut host = Sampler::new(config, &vec![None; ROWS]).unwrap();
            assert!(
                node.on_device(),
                "{}: not queued on a CPU stream",
                case.name
            );
            let row = Array::from_slice(&case.logits, &[1, case.logits.len() as i32]);
            let logits =
                mlx_rs::ops::broadcast_to(&row, &[ROWS as i32, case.logits.len() as i32]).unwrap();
            for step in 0..3 {
                let queued = node.sample_device(&logits).unwrap();
                queued.eval().unwrap();
                let expected = host.sample_host(&logits).unwrap();
                assert_eq!(
                    queued.as_slice::<u32>(),
                    &expected[..],
                    "{} step {step}",
                    case.name
                );
                compared += 1;
            }
        }
    });
    assert!(compared >= 30, "only {compared} cases compared");
}

/// Our CUDA sampling kernel over many rows of one distribution, each row at
/// its own cache position: every token is the host reference's for the same
/// uniform value (or a neighbour where that value is within 1e-5 of a
/// boundary), and the tokens' frequencies follow mlx-lm's probabilities.
#[test]
fn kernel_draws_follow_the_distribution_and_the_host_reference() {
    use emlx_axon_engine::sample::kernel::{agrees, sample_at, uniform};
    const DRAWS: usize = 4000;
    let cases = cases();
    let case = cases
        .iter()
        .find(|c| {
            c.logits.len() == 64
                && c.config.temperature > 1.0
                && (1..64).contains(&c.config.top_k)
                && c.kept.len() >= 5
                && c.kept.len() <= 12
        })
        .expect("a sampler case with top-k");
    let vocab = case.logits.len() as i32;
    let row = Array::from_slice(&case.logits, &[1, vocab]);
    let logits = mlx_rs::ops::broadcast_to(&row, &[DRAWS as i32, vocab])
        .unwrap()
        .contiguous()
        .unwrap();
    let positions: Vec<i32> = (0..DRAWS as i32).map(|p| p * 3 + 11).collect();
    let seeds: Vec<u64> = (0..DRAWS as u64).map(|r| 99 + r % 5).collect();
    let Some(ids) = sample_at(&case.config, &logits, &positions, &seeds).unwrap() else {
        assert!(
            !gpu_kernels_on("EMLX_AXON_GPU_LAYER"),
            "the CUDA kernels run here but the sampling kernel did not: {:?}",
            emlx_axon_engine::backend::notices()
        );
        eprintln!("skipped: the sampling kernel runs only where our CUDA kernels do");
        return;
    };
    for (r, &id) in ids.iter().enumerate() {
        let u = uniform(seeds[r], positions[r]);
        assert!(
            agrees(&case.config, &case.logits, u, id),
            "{}: row {r} drew {id} at u = {u}",
            case.name
        );
    }
    assert_frequencies(case, "kernel", &ids);
}

/// Every token's share of `ids` within five standard errors of mlx-lm's
/// probability for it.
fn assert_frequencies(case: &Case, path: &str, ids: &[u32]) {
    let draws = ids.len() as f64;
    let mut counts = vec![0usize; case.logits.len()];
    for &id in ids {
        counts[id as usize] += 1;
    }
    for (i, (&n, &p)) in counts.iter().zip(&case.probs).enumerate() {
        let freq = n as f64 / draws;
        let bound = 5.0 * (p * (1.0 - p) / draws).sqrt() + 1e-9;
        assert!(
            (freq - p).abs() <= bound,
            "{} ({path}): token {i} drawn {freq}, probability {p}",
            case.name
        );
    }
}

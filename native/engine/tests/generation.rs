//! Batching, sampling, stopping and request validation.

mod common;

use common::*;
use emlx_axon_engine::{
    generate, FinishReason, GenerateOptions, Generation, RowOptions, SamplerConfig, SamplerKind,
};

const FIXTURE: &str = "qwen3-4bit-g64";

fn model() -> std::sync::Arc<emlx_axon_engine::Model> {
    load_f32(FIXTURE)
}

fn sampler(kind: SamplerKind, top_p: f32, top_k: usize, seed: u64) -> SamplerConfig {
    SamplerConfig {
        kind,
        temperature: 1.0,
        top_p,
        top_k,
        seed: Some(seed),
        ..SamplerConfig::default()
    }
}

fn run_batch(prompts: &[Vec<u32>], opts: GenerateOptions) -> Vec<Vec<u32>> {
    let mut generation = Generation::start(model(), None, None, prompts, opts).unwrap();
    while !generation.is_done() {
        generation.next(5).unwrap();
    }
    generation.generated()
}

#[test]
fn batch_rows_equal_their_single_runs() {
    let refs = reference(FIXTURE, "");
    let prompts: Vec<Vec<u32>> = refs.iter().map(|r| r.1.clone()).collect();
    assert_ne!(
        prompts[0].len(),
        prompts[1].len(),
        "rows must differ in length to test padding"
    );
    let mut all = prompts.clone();
    all.push(prompts[0][..3].to_vec());
    let batched = run_batch(&all, options(16, SamplerConfig::default()));
    for (i, prompt) in all.iter().enumerate() {
        let single =
            generate(model(), None, prompt, options(16, SamplerConfig::default())).unwrap();
        assert_eq!(
            batched[i], single.ids,
            "row {i} differs from its single run"
        );
    }
    assert_eq!(batched[0], refs[0].2);
    assert_eq!(batched[1], refs[1].2);
}

#[test]
fn seeded_sampling_is_reproducible_on_both_paths() {
    let prompt = &reference(FIXTURE, "")[0].1;
    for kind in [SamplerKind::TopPCpu, SamplerKind::TopPGpu] {
        let a = generate(
            model(),
            None,
            prompt,
            options(12, sampler(kind, 0.95, 0, 7)),
        )
        .unwrap();
        let b = generate(
            model(),
            None,
            prompt,
            options(12, sampler(kind, 0.95, 0, 7)),
        )
        .unwrap();
        assert_eq!(a.ids, b.ids, "{kind:?}: same seed gave different tokens");
        let c = generate(
            model(),
            None,
            prompt,
            options(12, sampler(kind, 0.95, 0, 8)),
        )
        .unwrap();
        assert_ne!(
            a.ids, c.ids,
            "{kind:?}: different seeds gave the same 12 tokens"
        );
    }
}

/// A seeded row samples the same tokens whatever it is batched with, on
/// both sampling paths (float32: batched rows equal their single runs).
#[test]
fn seeded_rows_equal_their_single_runs() {
    let refs = reference(FIXTURE, "");
    let (a, b) = (refs[0].1.clone(), refs[1].1.clone());
    for kind in [SamplerKind::TopPCpu, SamplerKind::TopPGpu] {
        let config = |seed| SamplerConfig {
            temperature: 1.5,
            ..sampler(kind, 1.0, 0, seed)
        };
        let solo = generate(model(), None, &a, options(12, config(42)))
            .unwrap()
            .ids;
        let batch = |prompts: &[&Vec<u32>], seeds: &[Option<u64>], seed| {
            let prompts: Vec<Vec<u32>> = prompts.iter().map(|p| (*p).clone()).collect();
            let rows = seeds
                .iter()
                .map(|&seed| RowOptions {
                    seed,
                    ..RowOptions::default()
                })
                .collect();
            run_batch(
                &prompts,
                GenerateOptions {
                    rows,
                    ..options(12, config(seed))
                },
            )
        };
        let mixed = batch(&[&b, &a, &a], &[Some(5), Some(42), None], 9);
        assert_eq!(mixed[1], solo, "{kind:?}: seeded second row");
        assert_ne!(
            mixed[2], solo,
            "{kind:?}: an unseeded row drew the seeded row's tokens"
        );
        let first = batch(&[&a, &b], &[Some(42), Some(1)], 9);
        assert_eq!(first[0], solo, "{kind:?}: seeded first row");
        // A row without a seed of its own follows the generation's seed.
        let derived = batch(&[&a, &b], &[None, Some(3)], 42);
        assert_eq!(
            derived[0], solo,
            "{kind:?}: row 0 follows the generation seed"
        );
    }
}

#[test]
fn temperature_zero_is_greedy() {
    let (_, prompt, expected) = reference(FIXTURE, "").remove(0);
    for kind in [SamplerKind::TopPCpu, SamplerKind::TopPGpu] {
        let config = SamplerConfig {
            temperature: 0.0,
            ..sampler(kind, 0.9, 20, 11)
        };
        let out = generate(model(), None, &prompt, options(16, config)).unwrap();
        assert_eq!(out.ids, expected, "{kind:?} at temperature 0");
    }
}

#[test]
fn narrow_nucleus_and_top_k_one_equal_greedy() {
    let (_, prompt, expected) = reference(FIXTURE, "").remove(0);
    for kind in [SamplerKind::TopPCpu, SamplerKind::TopPGpu] {
        let tiny_p = generate(
            model(),
            None,
            &prompt,
            options(16, sampler(kind, 1e-6, 0, 3)),
        )
        .unwrap();
        assert_eq!(tiny_p.ids, expected, "{kind:?} with top_p tiny");
        let top1 = generate(
            model(),
            None,
            &prompt,
            options(16, sampler(kind, 1.0, 1, 3)),
        )
        .unwrap();
        assert_eq!(top1.ids, expected, "{kind:?} with top_k 1");
    }
}

#[test]
fn finish_reasons() {
    let (_, prompt, expected) = reference(FIXTURE, "").remove(0);
    let out = generate(model(), None, &prompt, options(4, SamplerConfig::default())).unwrap();
    assert_eq!((out.ids.len(), out.finish), (4, FinishReason::Length));

    let opts = GenerateOptions {
        max_len: prompt.len() + 3,
        ..options(10, SamplerConfig::default())
    };
    let out = generate(model(), None, &prompt, opts).unwrap();
    assert_eq!((out.ids.len(), out.finish), (3, FinishReason::MaxLen));

    // The third greedy token as EOS stops right there.
    let opts = GenerateOptions {
        eos_token_ids: Some(vec![expected[2]]),
        ignore_eos: false,
        ..options(10, SamplerConfig::default())
    };
    let out = generate(model(), None, &prompt, opts).unwrap();
    assert_eq!(out.finish, FinishReason::Eos);
    assert_eq!(out.ids, expected[..3].to_vec());
}

#[test]
fn stop_strings_end_generation_and_are_not_returned() {
    let tokenizer = tokenizer(FIXTURE);
    let (_, prompt, expected) = reference(FIXTURE, "").remove(1);
    let full = tokenizer.decode(&expected, true).unwrap();
    // A stop string made of the text of tokens 4..5 of the greedy run.
    let prefix = tokenizer.decode(&expected[..4], true).unwrap();
    let stop: String = full[prefix.len()..].chars().take(3).collect();
    assert!(!stop.is_empty() && !prefix.contains(&stop));
    let opts = GenerateOptions {
        stop: vec![stop.clone()],
        ..options(16, SamplerConfig::default())
    };
    let out = generate(model(), Some(tokenizer), &prompt, opts).unwrap();
    assert_eq!(out.finish, FinishReason::Stop);
    assert_eq!(out.text, prefix, "text up to the stop string");
    assert!(out.ids.len() < 16);
}

#[test]
fn streamed_text_concatenates_to_the_decoded_ids() {
    let tokenizer = tokenizer(FIXTURE);
    let (_, prompt, _) = reference(FIXTURE, "").remove(1);
    let mut generation = Generation::start(
        model(),
        Some(tokenizer.clone()),
        None,
        &[prompt],
        options(16, SamplerConfig::default()),
    )
    .unwrap();
    let mut text = String::new();
    while !generation.is_done() {
        text.push_str(&generation.next(1).unwrap()[0].text);
    }
    let ids = generation.generated().remove(0);
    assert_eq!(text, tokenizer.decode(&ids, true).unwrap());
}

#[test]
fn invalid_requests_are_typed_errors() {
    let m = model();
    let start = |prompts: &[Vec<u32>], o: GenerateOptions| {
        Generation::start(m.clone(), None, None, prompts, o)
            .err()
            .unwrap()
    };
    let ok = || options(4, SamplerConfig::default());
    assert_eq!(start(&[], ok()).kind(), "invalid_argument");
    assert_eq!(start(&[vec![]], ok()).kind(), "invalid_argument");
    assert_eq!(
        start(&[vec![1, 2]], options(0, SamplerConfig::default())).kind(),
        "invalid_argument"
    );
    assert_eq!(start(&[vec![999_999]], ok()).kind(), "invalid_argument");
    let long = GenerateOptions { max_len: 3, ..ok() };
    assert_eq!(start(&[vec![1, 2, 3]], long).kind(), "prompt_too_long");
    let bad_temp = options(
        4,
        SamplerConfig {
            temperature: -0.5,
            ..SamplerConfig::default()
        },
    );
    assert_eq!(start(&[vec![1]], bad_temp).kind(), "invalid_argument");
    let bad_p = options(
        4,
        SamplerConfig {
            top_p: 1.5,
            ..SamplerConfig::default()
        },
    );
    assert_eq!(start(&[vec![1]], bad_p).kind(), "invalid_argument");
    let bad_min_p = options(
        4,
        SamplerConfig {
            min_p: 1.5,
            ..SamplerConfig::default()
        },
    );
    assert_eq!(start(&[vec![1]], bad_min_p).kind(), "invalid_argument");
    let rows_mismatch = GenerateOptions {
        rows: vec![RowOptions::default(); 3],
        ..ok()
    };
    assert_eq!(
        start(&[vec![1], vec![2]], rows_mismatch).kind(),
        "invalid_argument"
    );
    let stop_without_tokenizer = GenerateOptions {
        stop: vec!["x".into()],
        ..ok()
    };
    assert_eq!(
        start(&[vec![1]], stop_without_tokenizer).kind(),
        "invalid_argument"
    );
    // A cache length past i32 used to wrap to a few positions, and decoding
    // then stopped early without finishing the row.
    let wrapped = GenerateOptions {
        max_new_tokens: (1 << 32) + 4,
        max_len: (1 << 32) + 9,
        ..ok()
    };
    let err = start(&[vec![1]], wrapped);
    assert_eq!(err.kind(), "invalid_argument", "{err}");
    let overflowing = GenerateOptions {
        max_new_tokens: usize::MAX,
        max_len: usize::MAX,
        ..ok()
    };
    assert_eq!(start(&[vec![1]], overflowing).kind(), "invalid_argument");
    // Hundreds of GB of KV cache: MLX's CPU allocator would hand out a null
    // buffer and the process would segfault.
    let huge = GenerateOptions {
        max_new_tokens: (1 << 31) - 10,
        max_len: (1 << 31) - 5,
        ..ok()
    };
    let err = start(&[vec![1, 2, 3]], huge);
    assert_eq!(err.kind(), "out_of_memory", "{err}");
    assert!(
        // 2147483641 positions, rounded up to whole buckets of 256 keys
        // as far as MLX's i32 shapes allow.
        err.to_string().contains("KV cache of 2147483647 positions"),
        "{err}"
    );
}

#[test]
fn concurrent_generations_share_one_model_and_streams() {
    use emlx_axon_engine::runtime::device::{DeviceKind, MlxStream};
    let m = model();
    let refs = reference(FIXTURE, "");
    // Two CPU streams and one of the default device: on a GPU build the
    // CPU streams read weights the GPU computed at load while GPU work runs.
    let streams: Vec<MlxStream> = [DeviceKind::Cpu, DeviceKind::Cpu, DeviceKind::default_kind()]
        .into_iter()
        .map(|kind| MlxStream::new(kind).unwrap())
        .collect();
    let handles: Vec<_> = (0..9)
        .map(|i| {
            let (m, stream) = (m.clone(), streams[i % 3].clone());
            let (prompt, expected) = (refs[i % 2].1.clone(), refs[i % 2].2.clone());
            std::thread::spawn(move || {
                let mut g = Generation::start(
                    m,
                    None,
                    Some(stream),
                    &[prompt],
                    options(16, SamplerConfig::default()),
                )
                .unwrap();
                while !g.is_done() {
                    g.next(3).unwrap();
                }
                assert_eq!(g.generated()[0], expected, "thread {i}");
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
}

//! A float16 KV cache under a float32 model (`kv_dtype`): one-token steps
//! through the CPU layer nodes (their float16 attention) give the logits of
//! MLX's separate ops over the same float16 cache, teacher-forced at every
//! step; both differ from a float32 cache's by the rounding alone; the
//! option reaches a generation and a scheduler's slots, and is refused
//! where it cannot apply.

mod common;

use common::forced::worst_relative;
use common::*;
use emlx_axon_engine::backend::Work;
use emlx_axon_engine::kv::cache::{KvCache, KvQuant, KvStore};
use emlx_axon_engine::model::AttentionMask;
use emlx_axon_engine::{
    generate, Dtype, GenerateOptions, Model, SamplerConfig, Scheduler, SchedulerConfig,
};
use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

const STEPS: usize = 24;

fn ids(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7919 + seed) % 1000).collect()
}

/// Logits of `STEPS` one-token steps after a 40-token prompt, each step fed
/// a fixed id, with a cache of `dtype`: through the layer nodes (`fused`, no
/// mask) or MLX's separate ops (an all-keys mask of the same content).
fn forced_steps(model: &Model, dtype: Dtype, fused: bool) -> Vec<f32> {
    let shape = model.kv_shape().in_dtype(Some(dtype));
    let prompt = ids(40, 13);
    let mut cache = KvCache::new(&shape, 1, (prompt.len() + STEPS) as i32).unwrap();
    let ids_array = Array::from_slice(&prompt, &[1, prompt.len() as i32]);
    model
        .forward(&ids_array, &mut cache, &AttentionMask::Causal, true, &[])
        .unwrap();
    mlx_rs::transforms::eval(cache.arrays()).unwrap();
    assert_eq!(cache.buffers(0).0.dtype(), dtype);
    let mut all = vec![];
    for (step, &id) in ids(STEPS, 501).iter().enumerate() {
        let keys = cache.offset() + 1;
        let mask = if fused {
            AttentionMask::None
        } else {
            AttentionMask::Array(Array::from_slice(
                &vec![true; keys as usize],
                &[1, 1, 1, keys],
            ))
        };
        let logits = model
            .forward(
                &Array::from_slice(&[id], &[1, 1]),
                &mut cache,
                &mask,
                true,
                &[],
            )
            .unwrap();
        let logits = logits.index((0, 0, ..)).as_dtype(Dtype::Float32).unwrap();
        logits.eval().unwrap();
        all.extend_from_slice(logits.as_slice::<f32>());
        let taken = emlx_axon_engine::backend::take();
        let main = taken.main(Work::Decode).map(|p| p.name());
        if fused {
            assert_eq!(main, Some("cpu_layers"), "step {step}: {taken:?}");
        } else {
            assert_eq!(main, Some("mlx"), "step {step}: {taken:?}");
        }
    }
    all
}

#[test]
fn float16_cache_steps_match_mlx_ops_over_the_same_cache() {
    if !emlx_axon_kernels::enabled() {
        return;
    }
    mlx_rs::with_stream(&mlx_rs::Stream::cpu(), || {
        let model = load_f32("qwen3-wide");
        let vocab = model.config.vocab_size as usize;
        let fused = forced_steps(&model, Dtype::Float16, true);
        let ops = forced_steps(&model, Dtype::Float16, false);
        let worst = worst_relative(&fused, &ops, vocab);
        assert!(
            worst < 1e-5,
            "float16 cache: layer nodes against MLX's ops: {worst}"
        );

        // The float32 cache's steps: the same to rounding (about 6e-4 of
        // the largest logit here), not identical.
        let full = forced_steps(&model, Dtype::Float32, true);
        let rounding = worst_relative(&fused, &full, vocab);
        assert!(
            rounding > 0.0 && rounding < 2e-3,
            "float16 against float32 cache: {rounding}"
        );
    });
}

#[test]
fn a_generation_keeps_its_cache_in_the_asked_dtype() {
    mlx_rs::with_stream(&mlx_rs::Stream::cpu(), || {
        let model = load_f32("qwen3-wide");
        let prompt = ids(30, 7);
        let run = |kv_dtype| {
            let options = GenerateOptions {
                kv_dtype,
                ..options(12, SamplerConfig::default())
            };
            generate(model.clone(), None, &prompt, options).unwrap()
        };
        let half = run(Some(Dtype::Float16));
        let full = run(Some(Dtype::Float32));
        assert_eq!(half.stats.kv_dtype, Some(Dtype::Float16));
        assert_eq!(full.stats.kv_dtype, Some(Dtype::Float32));
        assert_eq!(half.ids.len(), 12);
        if emlx_axon_kernels::enabled() {
            assert_eq!(half.stats.paths.main_name(Work::Decode), "cpu_layers");
            assert!(
                half.stats.paths.fallbacks.is_empty(),
                "{:?}",
                half.stats.paths
            );
        }
        // Greedy ids of a random model agree to within the rounding's
        // near-ties; the first ones do on this fixture.
        assert_eq!(half.ids[..4], full.ids[..4]);
    });
}

#[test]
fn kv_dtype_is_refused_where_it_cannot_apply() {
    let model = load_f32("qwen3-wide");
    let prompt = ids(8, 3);
    let with = |kv_dtype, kv_quant| GenerateOptions {
        kv_dtype: Some(kv_dtype),
        kv_quant,
        ..options(4, SamplerConfig::default())
    };
    let message = |o| {
        generate(model.clone(), None, &prompt, o)
            .unwrap_err()
            .to_string()
    };
    assert!(message(with(Dtype::Int32, None)).contains("kv_dtype must be"));
    let quant = KvQuant {
        group_size: 64,
        bits: 8,
    };
    assert!(message(with(Dtype::Float16, Some(quant))).contains("kv_dtype and kv_bits"));

    let config = SchedulerConfig {
        kv_dtype: Some(Dtype::Float32),
        ..SchedulerConfig::default()
    };
    let mut scheduler = Scheduler::new(model.clone(), None, config).unwrap();
    let refused = scheduler
        .admit(prompt.clone(), with(Dtype::Float16, None))
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("slots keep Float32") && refused.contains("kv_dtype"),
        "{refused}"
    );
    let config = SchedulerConfig {
        kv_dtype: Some(Dtype::Int32),
        ..SchedulerConfig::default()
    };
    let refused = Scheduler::new(model.clone(), None, config).err().unwrap();
    assert!(
        refused.to_string().contains("kv_dtype must be"),
        "{refused}"
    );
}

/// Without `kv_dtype`, a float32 model's growing cache is float16 on the
/// CPU (and the model's dtype on another device); a quantized or rotating
/// cache starts in the model's dtype; a scheduler's slots take the default
/// and its config says which. The default's greedy ids are the float16
/// cache's.
#[test]
fn an_unasked_cache_is_float16_under_a_float32_model_on_the_cpu() {
    let on_cpu = emlx_axon_engine::runtime::device::DeviceKind::default_kind()
        == emlx_axon_engine::runtime::device::DeviceKind::Cpu;
    let model = load_f32("qwen3-wide");
    let prompt = ids(30, 7);
    let run = |o: GenerateOptions| generate(model.clone(), None, &prompt, o).unwrap();
    let default = run(options(12, SamplerConfig::default()));
    let expected = if on_cpu {
        Dtype::Float16
    } else {
        Dtype::Float32
    };
    assert_eq!(default.stats.kv_dtype, Some(expected));
    let asked = run(GenerateOptions {
        kv_dtype: Some(expected),
        ..options(12, SamplerConfig::default())
    });
    assert_eq!(default.ids, asked.ids);

    let quantized = run(GenerateOptions {
        kv_quant: Some(KvQuant {
            group_size: 64,
            bits: 8,
        }),
        ..options(4, SamplerConfig::default())
    });
    let rotating = run(GenerateOptions {
        max_kv_size: Some(64),
        ..options(4, SamplerConfig::default())
    });
    for other in [quantized, rotating] {
        assert_eq!(other.stats.kv_dtype, Some(Dtype::Float32));
    }

    let scheduler = Scheduler::new(model.clone(), None, SchedulerConfig::default()).unwrap();
    assert_eq!(scheduler.config().kv_dtype, Some(expected));
}

/// A scheduler started with float16 slots decodes each request as a
/// generation with a float16 cache of its own does (the same CPU layer
/// nodes, rows at their own positions), whether a request names the dtype
/// or leaves it to the slots.
#[test]
fn float16_slots_decode_as_a_float16_generation_alone() {
    mlx_rs::with_stream(&mlx_rs::Stream::cpu(), || {
        let model = load_f32("qwen3-wide");
        let config = SchedulerConfig {
            slots: 2,
            capacity: 128,
            prefix_cache_bytes: 0,
            kv_dtype: Some(Dtype::Float16),
            ..SchedulerConfig::default()
        };
        let mut scheduler = Scheduler::new(model.clone(), None, config).unwrap();
        let prompts = [ids(20, 5), ids(33, 9)];
        let asked = [Some(Dtype::Float16), None];
        let mut admitted = vec![];
        for (prompt, kv_dtype) in prompts.iter().zip(asked) {
            let options = GenerateOptions {
                kv_dtype,
                ..options(10, SamplerConfig::default())
            };
            admitted.push(scheduler.admit(prompt.clone(), options).unwrap());
        }
        let mut got: std::collections::HashMap<u64, Vec<u32>> = Default::default();
        let mut finished = 0;
        for _ in 0..200 {
            for e in scheduler.step(4).unwrap() {
                got.entry(e.id).or_default().extend(&e.delta.ids);
                // Each finished request reports its slot's dtype.
                if let Some(stats) = e.stats {
                    assert_eq!(stats.kv_dtype, Some(Dtype::Float16), "request {}", e.id);
                    finished += 1;
                }
            }
            if admitted
                .iter()
                .all(|id| got.get(id).is_some_and(|t| t.len() == 10))
            {
                break;
            }
        }
        assert_eq!(finished, admitted.len());
        for (id, prompt) in admitted.iter().zip(&prompts) {
            let alone = GenerateOptions {
                kv_dtype: Some(Dtype::Float16),
                ..options(10, SamplerConfig::default())
            };
            let expected = generate(model.clone(), None, prompt, alone).unwrap().ids;
            assert_eq!(got[id], expected, "request {id}");
        }
    });
}

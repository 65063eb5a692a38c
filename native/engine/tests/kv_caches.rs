//! A quantized KV cache (mlx-lm's `kv_bits` / `kv_group_size` /
//! `quantized_kv_start`) against mlx-lm's `QuantizedKVCache`, and a rotating
//! one (`max_kv_size`) against its `RotatingKVCache`: teacher-forced float32
//! logits, and the greedy ids of a generation asking for them, from
//! `reference_kv{bits}g32.safetensors` and `reference_window16.safetensors`
//! of `test/fixtures/build_rope_moe_fixtures.py`.

mod common;

use common::forced::worst_relative;
use common::*;
use emlx_axon_engine::backend::{Paths, Work};
use emlx_axon_engine::kv::cache::{KvCache, KvQuant, KvStore};
use emlx_axon_engine::model::AttentionMask;
use emlx_axon_engine::runtime::device::on_cpu_stream;
use emlx_axon_engine::{generate, Error, GenerateOptions, SamplerConfig};
use mlx_rs::Array;

const FIXTURE: &str = "qwen3-yarn-4bit";

struct KvReference {
    ids: Vec<u32>,
    prompt: usize,
    greedy: Vec<u32>,
    /// `[ids - prompt + 1, vocab]`: from the prompt's last position on.
    logits: Vec<f32>,
}

/// The window of `reference_window16`.
const WINDOW: i32 = 16;

fn kv_reference(bits: i32) -> KvReference {
    named_reference(&format!("kv{bits}g32"))
}

fn named_reference(name: &str) -> KvReference {
    let path = fixture(FIXTURE).join(format!("reference_{name}.safetensors"));
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{path:?}: {e}: run scripts/setup"));
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let ints = |name: &str| -> Vec<u32> {
        st.tensor(name)
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    };
    KvReference {
        ids: ints("ids"),
        prompt: ints("prompt")[0] as usize,
        greedy: ints("greedy"),
        logits: st
            .tensor("logits")
            .unwrap()
            .data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect(),
    }
}

fn quant(bits: i32) -> KvQuant {
    KvQuant {
        group_size: 32,
        bits,
    }
}

/// Where a quantized cache's one-token steps ran: on a CPU stream with the
/// CPU kernels on, every step through the layer nodes, which read the
/// quantized cache; elsewhere MLX's ops, the fused layers saying why.
fn assert_quantized_steps(paths: &Paths) {
    if emlx_axon_kernels::enabled() && on_cpu_stream() {
        assert_eq!(paths.main_name(Work::Decode), "cpu_layers", "{paths:?}");
        assert!(paths.fallbacks.is_empty(), "{paths:?}");
    } else {
        assert_stepped_aside(&paths.fallbacks, "KV cache is quantized");
    }
}

/// The fused layers said why they did not take the steps.
fn assert_stepped_aside(fallbacks: &[String], why: &str) {
    assert!(
        fallbacks.iter().any(|f| f.contains(why)),
        "no fallback says {why:?}: {fallbacks:?}"
    );
}

/// `ids` through the model into `cache` as a generation feeds them (a
/// window's mask, causal for several, none for one): float32 logits of
/// every position (`last_only`: of the last).
fn forward_logits(
    model: &emlx_axon_engine::Model,
    ids: &[u32],
    cache: &mut KvCache,
    last_only: bool,
) -> Vec<f32> {
    let n = ids.len() as i32;
    let mask = match cache.window_mask(n).unwrap() {
        Some(m) => AttentionMask::Array(m),
        None if n > 1 => AttentionMask::Causal,
        None => AttentionMask::None,
    };
    let input = Array::from_slice(ids, &[1, n]);
    let out = model
        .forward(&input, cache, &mask, last_only, &[])
        .unwrap()
        .as_dtype(mlx_rs::Dtype::Float32)
        .unwrap();
    out.as_slice::<f32>().to_vec()
}

/// Our logits from the prompt's last position on, fed as mlx-lm's
/// generate_step feeds them: the prompt but its last id at once into
/// `cache`, then `between` (the quantization), then one id at a time.
fn fed_as_generate_step(
    model: &emlx_axon_engine::Model,
    mut cache: KvCache,
    r: &KvReference,
    between: impl FnOnce(&mut KvCache),
) -> Vec<f32> {
    forward_logits(model, &r.ids[..r.prompt - 1], &mut cache, true);
    between(&mut cache);
    let mut ours = Vec::new();
    for &id in &r.ids[r.prompt - 1..] {
        ours.extend(forward_logits(model, &[id], &mut cache, true));
    }
    ours
}

#[test]
fn quantized_cache_logits_match_mlx_lm() {
    let model = load_f32(FIXTURE);
    let vocab = model.config.vocab_size as usize;
    for bits in [8, 4] {
        let r = kv_reference(bits);
        let _ = emlx_axon_engine::backend::take();
        let cache = KvCache::new(&model.kv_shape(), 1, r.ids.len() as i32 + 8).unwrap();
        let ours = fed_as_generate_step(&model, cache, &r, |cache| {
            cache.quantize(quant(bits)).unwrap();
            assert_eq!(cache.quantized(), Some(quant(bits)));
        });
        let error = worst_relative(&ours, &r.logits, vocab);
        eprintln!("{bits}-bit keys and values: worst {error:e}");
        assert!(
            error < 1e-4,
            "{bits}-bit: logits differ from mlx-lm by {error}"
        );
        assert_quantized_steps(&emlx_axon_engine::backend::take());
    }
}

/// A cache made to be quantized keeps dense buffers only as long as it
/// needs: 4 positions, grown to a bucket of 256 by the prompt's pass (of
/// a capacity of more), then quantized over its whole capacity. Its logits
/// are mlx-lm's, as a full cache's are.
#[test]
fn a_quantizing_cache_keeps_short_dense_buffers() {
    let model = load_f32(FIXTURE);
    let vocab = model.config.vocab_size as usize;
    let r = kv_reference(8);
    let capacity = r.ids.len() as i32 + 400;
    assert!(r.prompt < 256 && capacity > 256);
    let bytes = |c: &KvCache| -> usize {
        let arrays: Vec<&Array> = c.arrays().collect();
        mlx_rs::transforms::eval(arrays.iter().copied()).unwrap();
        arrays.iter().map(|a| a.nbytes()).sum()
    };
    let full = bytes(&KvCache::new(&model.kv_shape(), 1, capacity).unwrap());
    let cache = KvCache::quantizing(&model.kv_shape(), 1, capacity, 4).unwrap();
    assert_eq!(bytes(&cache) * capacity as usize, full * 4);
    let ours = fed_as_generate_step(&model, cache, &r, |cache| {
        assert_eq!(bytes(cache) * capacity as usize, full * 256);
        cache.quantize(quant(8)).unwrap();
        for layer in 0..model.config.num_layers {
            let (keys, values) = cache.quantized_buffers(layer).unwrap();
            for a in keys.iter().chain(values.iter()) {
                assert_eq!(a.dim(2), capacity);
            }
        }
    });
    let error = worst_relative(&ours, &r.logits, vocab);
    assert!(error < 1e-4, "logits differ from mlx-lm by {error}");
}

/// A prompt's later part over a quantized cache, all at once (on a CPU
/// stream: the dequantized cache through the prompt attention node), gives the logits
/// of the same ids fed one at a time (the quantized products, or the CPU
/// layer nodes), position by position: the part's own keys are quantized
/// as they are stored either way.
#[test]
fn a_prompt_part_over_a_quantized_cache_gives_the_steps_logits() {
    let model = load_f32(FIXTURE);
    let vocab = model.config.vocab_size as usize;
    let r = kv_reference(8);
    let (head, tail) = r.ids.split_at(r.ids.len() / 2);
    let fed = |at_once: bool| -> Vec<f32> {
        let mut cache = KvCache::new(&model.kv_shape(), 1, r.ids.len() as i32 + 8).unwrap();
        forward_logits(&model, head, &mut cache, true);
        cache.quantize(quant(8)).unwrap();
        if at_once {
            forward_logits(&model, tail, &mut cache, false)
        } else {
            let one = |&id: &u32| forward_logits(&model, &[id], &mut cache, false);
            tail.iter().flat_map(one).collect()
        }
    };
    let error = worst_relative(&fed(true), &fed(false), vocab);
    eprintln!("a part at once against one at a time: worst {error:e}");
    assert!(error < 1e-4, "logits differ by {error}");
}

/// The comparison above sees the quantization: the float cache's logits
/// are further from mlx-lm's quantized ones than ours are, at 4 bits.
#[test]
fn the_quantization_matters() {
    let model = load_f32(FIXTURE);
    let r = kv_reference(4);
    let error = full_cache_error(&model, &r);
    eprintln!("a float cache: worst {error:e}");
    assert!(error > 1e-3, "a float cache is as close: {error}");
}

/// How far a float cache keeping every position is from mlx-lm's logits
/// of `r`, from the prompt's last position on (all ids in one pass).
fn full_cache_error(model: &emlx_axon_engine::Model, r: &KvReference) -> f32 {
    let vocab = model.config.vocab_size as usize;
    let mut cache = KvCache::new(&model.kv_shape(), 1, r.ids.len() as i32 + 8).unwrap();
    let all = forward_logits(model, &r.ids, &mut cache, false);
    worst_relative(&all[(r.prompt - 1) * vocab..], &r.logits, vocab)
}

#[test]
fn generation_with_kv_bits_gives_mlx_lm_greedy_ids() {
    let model = load_f32(FIXTURE);
    for bits in [8, 4] {
        let r = kv_reference(bits);
        let options = GenerateOptions {
            kv_quant: Some(quant(bits)),
            quantized_kv_start: 0,
            ..options(r.greedy.len(), SamplerConfig::default())
        };
        let out = generate(model.clone(), None, &r.ids[..r.prompt], options).unwrap();
        assert_eq!(out.ids, r.greedy, "{bits}-bit: greedy ids");
        assert_quantized_steps(&out.stats.paths);
    }
}

/// Below `quantized_kv_start` positions nothing is quantized: the ids are
/// those of a generation without `kv_bits`.
#[test]
fn below_the_start_nothing_is_quantized() {
    let model = load_f32(FIXTURE);
    let r = kv_reference(4);
    let prompt = &r.ids[..r.prompt];
    let plain = generate(
        model.clone(),
        None,
        prompt,
        options(8, SamplerConfig::default()),
    );
    let late = GenerateOptions {
        kv_quant: Some(quant(4)),
        quantized_kv_start: 10_000,
        ..options(8, SamplerConfig::default())
    };
    let late = generate(model.clone(), None, prompt, late);
    assert_eq!(plain.unwrap().ids, late.unwrap().ids);
}

/// 8-bit keys and values with float32 scales and biases per 32 values
/// take `(8 + 2 * 32 / 32) / 32` of the float32 cache's bytes.
#[test]
fn a_quantized_cache_takes_its_share_of_the_memory() {
    let model = load_f32(FIXTURE);
    let mut cache = KvCache::new(&model.kv_shape(), 1, 256).unwrap();
    let bytes = |c: &KvCache| -> usize {
        let arrays: Vec<&Array> = c.arrays().collect();
        mlx_rs::transforms::eval(arrays.iter().copied()).unwrap();
        arrays.iter().map(|a| a.nbytes()).sum()
    };
    let dense = bytes(&cache);
    cache.quantize(quant(8)).unwrap();
    let quantized = bytes(&cache);
    let share = quantized as f64 / dense as f64;
    assert!((share - 10.0 / 32.0).abs() < 1e-3, "share {share}");
}

#[test]
fn bad_kv_settings_are_errors_naming_them() {
    let model = load_f32(FIXTURE);
    let ask = |q: KvQuant| {
        let options = GenerateOptions {
            kv_quant: Some(q),
            ..options(4, SamplerConfig::default())
        };
        match generate(model.clone(), None, &[5, 6, 7], options) {
            Err(Error::InvalidArgument(m)) => m,
            other => panic!("{q:?}: {:?}", other.map(|o| o.ids)),
        }
    };
    assert!(ask(KvQuant {
        group_size: 32,
        bits: 7
    })
    .contains("kv_bits"));
    assert!(ask(KvQuant {
        group_size: 48,
        bits: 8
    })
    .contains("kv_group_size"));
    // The fixture's heads are 32 values wide.
    assert!(ask(KvQuant {
        group_size: 64,
        bits: 8
    })
    .contains("head size"));
}

#[test]
fn rotating_window_logits_match_mlx_lm() {
    let model = load_f32(FIXTURE);
    let vocab = model.config.vocab_size as usize;
    let r = named_reference("window16");
    // The prompt is wider than the window and the steps wrap around it.
    assert!(r.prompt as i32 > WINDOW && r.greedy.len() as i32 > WINDOW);
    let _ = emlx_axon_engine::backend::take();
    let cache = KvCache::rotating(&model.kv_shape(), WINDOW, 4).unwrap();
    let ours = fed_as_generate_step(&model, cache, &r, |_| {});
    let error = worst_relative(&ours, &r.logits, vocab);
    eprintln!("rotating window: worst {error:e}");
    assert!(error < 1e-4, "logits differ from mlx-lm by {error}");
    let paths = emlx_axon_engine::backend::take();
    assert_stepped_aside(&paths.fallbacks, "rotating window");
}

/// The comparison above sees the window: a cache that keeps everything
/// gives logits far from mlx-lm's windowed ones.
#[test]
fn the_window_matters() {
    let model = load_f32(FIXTURE);
    let error = full_cache_error(&model, &named_reference("window16"));
    eprintln!("a cache keeping every position: worst {error:e}");
    assert!(error > 1e-2, "a full cache is as close: {error}");
}

#[test]
fn generation_with_max_kv_size_gives_mlx_lm_greedy_ids() {
    let model = load_f32(FIXTURE);
    let r = named_reference("window16");
    let options = GenerateOptions {
        max_kv_size: Some(WINDOW as usize),
        ..options(r.greedy.len(), SamplerConfig::default())
    };
    let out = generate(model, None, &r.ids[..r.prompt], options).unwrap();
    assert_eq!(out.ids, r.greedy);
    assert_stepped_aside(&out.stats.paths.fallbacks, "rotating window");
}

#[test]
fn bad_window_settings_are_errors_naming_them() {
    let model = load_f32(FIXTURE);
    let ask = |o: GenerateOptions, prompts: &[Vec<u32>]| match emlx_axon_engine::Generation::start(
        model.clone(),
        None,
        None,
        prompts,
        o,
    ) {
        Err(Error::InvalidArgument(m)) => m,
        Err(other) => panic!("{other}"),
        Ok(_) => panic!("accepted"),
    };
    let one = vec![vec![5u32, 6, 7]];
    let with = |size: usize| GenerateOptions {
        max_kv_size: Some(size),
        ..options(4, SamplerConfig::default())
    };
    assert!(ask(with(4), &one).contains("max_kv_size must be more than 4"));
    let both = GenerateOptions {
        kv_quant: Some(quant(8)),
        ..with(64)
    };
    assert!(ask(both, &one).contains("cannot be combined"));
    let ragged = vec![vec![5u32, 6, 7], vec![5u32, 6]];
    assert!(ask(with(64), &ragged).contains("prompts of one length"));
}

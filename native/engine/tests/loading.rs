//! Checkpoint loading: layouts, metadata and every typed error.

mod common;

use std::fs;

use common::*;
use emlx_axon_engine::{Dtype, LoadOptions, Model, QuantSpec};

fn f32() -> LoadOptions {
    LoadOptions {
        dtype: Some(Dtype::Float32),
        quantize: None,
        cpu_parallel: None,
        ..LoadOptions::default()
    }
}

fn kind_of(dir: &std::path::Path) -> String {
    match Model::load(dir, &f32()) {
        Ok(_) => "ok".into(),
        Err(e) => format!("{}: {e}", e.kind()),
    }
}

#[test]
fn reads_config_and_generation_config() {
    let m = load("qwen3-4bit-g64", &f32());
    assert_eq!(m.config.num_layers, 2);
    assert!(m.is_quantized());
    // config.json's 151645 plus generation_config.json's 151643.
    assert_eq!(m.config.eos_token_ids, vec![151645, 151643]);
    let q = m.config.quantization.as_ref().unwrap();
    assert_eq!((q.default.bits, q.default.group_size), (4, 64));
    assert!(m.weight_bytes > 0 && m.load_ms > 0.0);
    let dense = load("qwen3-bf16", &f32());
    assert!(!dense.is_quantized());
    let quantized = load(
        "qwen3-bf16",
        &LoadOptions {
            quantize: Some(QuantSpec::new(4, 128).unwrap()),
            ..f32()
        },
    );
    assert!(quantized.is_quantized());
}

#[test]
fn quantizes_dense_checkpoints_at_every_supported_width() {
    for bits in [2, 3, 4, 6, 8] {
        for group in [32, 64, 128] {
            let options = LoadOptions {
                quantize: Some(QuantSpec::new(bits, group).unwrap()),
                ..f32()
            };
            let m = Model::load(&fixture("qwen3-bf16"), &options).unwrap();
            // Group 128 is as wide as the fixture's rows: on a GPU those
            // products take the dequantized way (see layers.rs).
            let out = emlx_axon_engine::generate(m.into(), None, &[785, 3974], Default::default())
                .unwrap_or_else(|e| panic!("bits {bits} group {group}: {e}"));
            assert!(!out.ids.is_empty(), "bits {bits} group {group}");
        }
    }
    assert_eq!(QuantSpec::new(7, 64).unwrap_err().kind(), "unsupported");
    assert_eq!(QuantSpec::new(4, 48).unwrap_err().kind(), "unsupported");
}

#[test]
fn missing_files_and_bad_json() {
    assert!(kind_of(std::path::Path::new("/nonexistent/model")).starts_with("io"));
    let dir = scratch_copy("qwen3-4bit-g64", "noconfig");
    fs::remove_file(dir.join("config.json")).unwrap();
    assert!(kind_of(&dir).starts_with("io"));
    fs::write(dir.join("config.json"), "{ not json").unwrap();
    assert!(kind_of(&dir).starts_with("json"));
    fs::write(dir.join("config.json"), r#"{"model_type": "llama"}"#).unwrap();
    assert!(kind_of(&dir).starts_with("unsupported"));
    fs::write(
        dir.join("config.json"),
        r#"{"model_type": "qwen3", "hidden_size": "big"}"#,
    )
    .unwrap();
    assert!(kind_of(&dir).starts_with("config"));
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn damaged_safetensors() {
    let dir = scratch_copy("qwen3-4bit-g64", "damaged");
    let weights = dir.join("model.safetensors");
    let bytes = fs::read(&weights).unwrap();

    fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    assert!(
        kind_of(&dir).starts_with("safetensors"),
        "truncated: {}",
        kind_of(&dir)
    );

    let mut corrupt = bytes.clone();
    corrupt[8..24].copy_from_slice(b"#not a header!!!");
    fs::write(&weights, &corrupt).unwrap();
    assert!(
        kind_of(&dir).starts_with("safetensors"),
        "corrupt header: {}",
        kind_of(&dir)
    );

    fs::remove_file(&weights).unwrap();
    assert!(kind_of(&dir).starts_with("io"));
    fs::remove_dir_all(&dir).unwrap();
}

/// Rewrites a checkpoint's tensors through `edit` with the safetensors crate.
fn rewrite(
    dir: &std::path::Path,
    edit: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) {
    let path = dir.join("model.safetensors");
    let bytes = fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<_> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<_> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn small_tensor(name: &str) -> (String, safetensors::Dtype, Vec<usize>, Vec<u8>) {
    (
        name.to_string(),
        safetensors::Dtype::F32,
        vec![2],
        vec![0; 8],
    )
}

#[test]
fn unexpected_tensors_are_refused_unless_not_strict() {
    let dir = scratch_copy("qwen3-4bit-g64", "unexpected");
    rewrite(&dir, |t| {
        t.push(small_tensor("model.layers.0.self_attn.rotary_emb.inv_freq"));
        t.push(small_tensor("model.layers.0.mlp.extra.weight"));
    });
    let err = Model::load(&dir, &f32()).err().unwrap();
    assert_eq!(err.kind(), "unexpected_tensor", "{err}");
    let message = err.to_string();
    assert!(
        message.contains("2 tensor(s)")
            && message.contains("model.layers.0.mlp.extra.weight")
            && message.contains("model.layers.0.self_attn.rotary_emb.inv_freq")
            && message.contains("strict: false"),
        "{message}"
    );
    let lenient = LoadOptions {
        strict: false,
        ..f32()
    };
    assert!(Model::load(&dir, &lenient).is_ok());
    fs::remove_dir_all(dir).unwrap();

    // What mlx-lm's sanitize drops loads strictly: a tied model's stray
    // lm_head.weight, Qwen2's precomputed RoPE frequencies.
    let tied = scratch_copy("qwen3-4bit-g64", "tied-head");
    rewrite(&tied, |t| t.push(small_tensor("lm_head.weight")));
    Model::load(&tied, &f32()).unwrap();
    let qwen2 = scratch_copy("qwen2-4bit-g64", "inv-freq");
    rewrite(&qwen2, |t| {
        t.push(small_tensor("model.layers.1.self_attn.rotary_emb.inv_freq"))
    });
    Model::load(&qwen2, &f32()).unwrap();
    for d in [tied, qwen2] {
        fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn foreign_quantization_config_is_unsupported() {
    let dir = scratch_copy("qwen3-bf16", "gptq");
    let path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_slice(&fs::read(&path).unwrap()).unwrap();
    config["quantization_config"] = serde_json::json!({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": false});
    fs::write(&path, serde_json::to_vec(&config).unwrap()).unwrap();
    let err = Model::load(&dir, &f32()).err().unwrap();
    assert_eq!(err.kind(), "unsupported", "{err}");
    assert!(err.to_string().contains("gptq"), "{err}");
    fs::remove_dir_all(dir).unwrap();
}

#[test]
fn missing_or_misshaped_tensors() {
    let dir = scratch_copy("qwen3-4bit-g64", "tensors");
    rewrite(&dir, |t| {
        t.retain(|(n, ..)| n != "model.layers.1.mlp.up_proj.scales")
    });
    // Without scales the layer reads as dense, and its packed weight has the wrong shape.
    let err = kind_of(&dir);
    assert!(
        err.starts_with("shape_mismatch") && err.contains("model.layers.1.mlp.up_proj.weight"),
        "{err}"
    );

    let dir = scratch_copy("qwen3-4bit-g64", "tensors2");
    rewrite(&dir, |t| t.retain(|(n, ..)| n != "model.norm.weight"));
    assert!(
        kind_of(&dir).starts_with("missing_tensor"),
        "{}",
        kind_of(&dir)
    );

    let dir2 = scratch_copy("qwen3-4bit-g64", "tensors3");
    rewrite(&dir2, |t| {
        let norm = t
            .iter_mut()
            .find(|(n, ..)| n == "model.norm.weight")
            .unwrap();
        norm.2 = vec![norm.2[0] / 2];
        norm.3.truncate(norm.3.len() / 2);
    });
    let err = kind_of(&dir2);
    assert!(
        err.starts_with("shape_mismatch") && err.contains("model.norm.weight"),
        "{err}"
    );

    let dir3 = scratch_copy("qwen3-4bit-g64", "tensors4");
    rewrite(&dir3, |t| {
        let norm = t
            .iter_mut()
            .find(|(n, ..)| n == "model.norm.weight")
            .unwrap();
        norm.1 = safetensors::Dtype::F64;
        norm.3 = vec![0; norm.3.len() * 4];
    });
    assert!(
        kind_of(&dir3).starts_with("safetensors"),
        "{}",
        kind_of(&dir3)
    );
    for d in [dir, dir2, dir3] {
        fs::remove_dir_all(d).unwrap();
    }
}

#[test]
fn sharded_index_naming_a_missing_shard() {
    let dir = scratch_copy("qwen3-4bit-g128", "shards");
    fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let err = kind_of(&dir);
    assert!(
        err.starts_with("io") && err.contains("model-00002-of-00002"),
        "{err}"
    );
    fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn quantize_option_on_a_quantized_checkpoint_is_refused() {
    let options = LoadOptions {
        quantize: Some(QuantSpec::new(4, 64).unwrap()),
        ..f32()
    };
    let err = Model::load(&fixture("qwen3-4bit-g64"), &options)
        .err()
        .unwrap();
    assert_eq!(err.kind(), "invalid_argument");
}

#[test]
fn absurd_layer_counts_fail_on_the_missing_tensor() {
    // Preallocating for config.json's layer count used to abort the process.
    let dir = scratch_copy("qwen3-4bit-g64", "layers");
    let config = fs::read_to_string(dir.join("config.json")).unwrap();
    for layers in ["1099511627776", "9223372036854775807"] {
        let text = config.replace(
            "\"num_hidden_layers\": 2",
            &format!("\"num_hidden_layers\": {layers}"),
        );
        fs::write(dir.join("config.json"), text).unwrap();
        let err = kind_of(&dir);
        assert!(
            err.starts_with("missing_tensor") && err.contains("model.layers.2."),
            "{err}"
        );
    }
    fs::remove_dir_all(&dir).unwrap();
}

/// Logits of every position of a prompt, from a fresh cache.
fn prompt_logits(model: &Model) -> Vec<f32> {
    use emlx_axon_engine::kv::cache::KvCache;
    use emlx_axon_engine::model::AttentionMask;
    let prompt = [785u32, 3974, 13876, 38835, 34208, 916, 279, 15678];
    let mut cache = KvCache::new(&model.kv_shape(), 1, prompt.len() as i32).unwrap();
    let ids = mlx_rs::Array::from_slice(&prompt, &[1, prompt.len() as i32]);
    let out = model
        .forward(&ids, &mut cache, &AttentionMask::Causal, false, &[])
        .unwrap();
    out.as_dtype(Dtype::Float32)
        .unwrap()
        .as_slice::<f32>()
        .to_vec()
}

/// transformers and mlx-lm may write one module's tensors to several
/// shards: here layer 1's gate and up projections keep their `biases` in
/// one shard, and their `weight` and `scales` in two others, and layer 0's
/// q projection sits apart from its k and v projections (members of one
/// stacked weight). The model loads them and gives the unsplit
/// checkpoint's logits.
#[test]
fn shards_that_split_a_module_load_as_the_whole_checkpoint() {
    let dir = scratch_copy("qwen3-4bit-g64", "split-module");
    let whole = dir.join("model.safetensors");
    let bytes = fs::read(&whole).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let shard_of = |name: &str| {
        let layer1 = |m: &str| name.strip_prefix("model.layers.1.mlp.")?.strip_prefix(m);
        if layer1("gate_proj.biases").is_some() || layer1("up_proj.biases").is_some() {
            0
        } else if layer1("up_proj.").is_some()
            || name.starts_with("model.layers.0.self_attn.q_proj.")
        {
            2
        } else {
            1
        }
    };
    let mut shards: [Vec<(String, safetensors::tensor::TensorView)>; 3] = Default::default();
    for (name, view) in st.tensors() {
        shards[shard_of(&name)].push((name, view));
    }
    assert_eq!(shards[0].len(), 2);
    assert!(shards[1]
        .iter()
        .any(|(n, _)| n == "model.layers.1.mlp.gate_proj.weight"));
    let mut weight_map = serde_json::Map::new();
    for (i, shard) in shards.into_iter().enumerate() {
        let file = format!("model-0000{}-of-00003.safetensors", i + 1);
        for (name, _) in &shard {
            weight_map.insert(name.clone(), serde_json::Value::String(file.clone()));
        }
        safetensors::serialize_to_file(shard, None, &dir.join(&file)).unwrap();
    }
    fs::remove_file(&whole).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    fs::write(
        dir.join("model.safetensors.index.json"),
        serde_json::to_string(&index).unwrap(),
    )
    .unwrap();

    let split = Model::load(&dir, &f32()).unwrap_or_else(|e| panic!("split shards: {e}"));
    let unsplit = load("qwen3-4bit-g64", &f32());
    let (a, b) = (prompt_logits(&split), prompt_logits(&unsplit));
    assert_eq!(a.len(), b.len());
    let (lo, hi) = b
        .iter()
        .fold((f32::MAX, f32::MIN), |(lo, hi), v| (lo.min(*v), hi.max(*v)));
    assert!(hi - lo > 1.0, "logits too flat to compare: {lo}..{hi}");
    assert!(a == b, "the split checkpoint's logits differ");
    fs::remove_dir_all(&dir).unwrap();
}

//! `config.json` of Qwen2 / Qwen3 checkpoints, including MLX's `quantization` block.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use crate::error::{read_json, Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Qwen2,
    Qwen3,
    /// Qwen3's attention with routed experts in place of (some) MLPs.
    Qwen3Moe,
}

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Qwen3Moe => "qwen3_moe",
        }
    }

    /// Whether attention normalizes queries and keys per head (Qwen3's
    /// families) rather than adding q/k/v biases (Qwen2).
    pub fn has_qk_norm(self) -> bool {
        !matches!(self, Arch::Qwen2)
    }
}

/// Qwen3-MoE's routed experts, as mlx-lm's qwen3_moe reads them.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: i32,
    /// Experts each token is routed to.
    pub top_k: i32,
    /// Renormalize the chosen experts' probabilities to sum to 1.
    pub norm_topk_prob: bool,
    /// Every this many layers is sparse (layer `i` when `(i + 1) % step == 0`).
    pub decoder_sparse_step: usize,
    /// Layers that keep a dense MLP whatever the step says.
    pub mlp_only_layers: Vec<usize>,
    /// Each expert's hidden width.
    pub moe_intermediate_size: i32,
}

impl MoeConfig {
    /// Whether layer `layer` routes its tokens to experts.
    pub fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && (layer + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

fn moe_config(v: &Value) -> Result<MoeConfig> {
    let num_experts = i32_of(req_int(v, "num_experts")?, "num_experts")?;
    let top_k = i32_of(req_int(v, "num_experts_per_tok")?, "num_experts_per_tok")?;
    if top_k > num_experts {
        return Err(Error::Config(format!(
            "num_experts_per_tok ({top_k}) must not exceed num_experts ({num_experts})"
        )));
    }
    let mlp_only_layers = match get(v, "mlp_only_layers") {
        None => vec![],
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| {
                x.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| {
                        Error::Config(format!(
                            "`mlp_only_layers` must hold layer indices, got {x}"
                        ))
                    })
            })
            .collect::<Result<_>>()?,
        Some(x) => {
            return Err(Error::Config(format!(
                "`mlp_only_layers` must be a list, got {x}"
            )))
        }
    };
    Ok(MoeConfig {
        num_experts,
        top_k,
        norm_topk_prob: boolean(v, "norm_topk_prob")?.unwrap_or(false),
        decoder_sparse_step: int(v, "decoder_sparse_step")?.unwrap_or(1) as usize,
        mlp_only_layers,
        moe_intermediate_size: i32_of(
            req_int(v, "moe_intermediate_size")?,
            "moe_intermediate_size",
        )?,
    })
}

/// Affine group-wise quantization parameters, as MLX's `quantize` takes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantSpec {
    pub bits: i32,
    pub group_size: i32,
}

impl QuantSpec {
    pub const BITS: [i32; 6] = [2, 3, 4, 5, 6, 8];
    pub const GROUP_SIZES: [i32; 3] = [32, 64, 128];

    pub fn new(bits: i32, group_size: i32) -> Result<Self> {
        if !Self::BITS.contains(&bits) {
            return Err(Error::Unsupported(format!(
                "quantization bits {bits} (supported: {:?})",
                Self::BITS
            )));
        }
        if !Self::GROUP_SIZES.contains(&group_size) {
            return Err(Error::Unsupported(format!(
                "quantization group_size {group_size} (supported: {:?})",
                Self::GROUP_SIZES
            )));
        }
        Ok(QuantSpec { bits, group_size })
    }
}

/// The checkpoint's quantization: a default plus per-layer overrides keyed by
/// module path (e.g. `model.layers.0.mlp.down_proj`), as mlx-lm writes them.
#[derive(Debug, Clone, PartialEq)]
pub struct Quantization {
    pub default: QuantSpec,
    pub per_layer: HashMap<String, QuantSpec>,
}

impl Quantization {
    pub fn for_module(&self, path: &str) -> QuantSpec {
        self.per_layer.get(path).copied().unwrap_or(self.default)
    }
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: i32,
    pub num_layers: usize,
    pub intermediate_size: i32,
    pub num_heads: i32,
    pub num_kv_heads: i32,
    pub head_dim: i32,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Position scale for RoPE: 1 / factor for linear scaling, else 1.
    pub rope_scale: f32,
    /// RoPE with frequencies of its own (`rope_scaling` of type `yarn` or
    /// `llama3`); [`RopeScaling::None`] for MLX's rope from `rope_theta`
    /// and `rope_scale`.
    pub rope_scaling: RopeScaling,
    /// RoPE on adjacent pairs of dimensions rather than the two halves.
    pub rope_traditional: bool,
    pub tie_word_embeddings: bool,
    pub vocab_size: i32,
    pub max_position_embeddings: usize,
    pub eos_token_ids: Vec<u32>,
    pub quantization: Option<Quantization>,
    /// Routed experts (Qwen3-MoE only).
    pub moe: Option<MoeConfig>,
}

fn get<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}

fn int(v: &Value, key: &str) -> Result<Option<i64>> {
    match get(v, key) {
        None => Ok(None),
        Some(x) => {
            x.as_i64().filter(|n| *n > 0).map(Some).ok_or_else(|| {
                Error::Config(format!("`{key}` must be a positive integer, got {x}"))
            })
        }
    }
}

fn req_int(v: &Value, key: &str) -> Result<i64> {
    int(v, key)?.ok_or_else(|| Error::Config(format!("missing required key `{key}`")))
}

fn i32_of(n: i64, key: &str) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Config(format!("`{key}` is too large: {n}")))
}

fn float(v: &Value, key: &str) -> Result<Option<f64>> {
    match get(v, key) {
        None => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| Error::Config(format!("`{key}` must be a number, got {x}"))),
    }
}

fn boolean(v: &Value, key: &str) -> Result<Option<bool>> {
    match get(v, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(x) => Err(Error::Config(format!("`{key}` must be a boolean, got {x}"))),
    }
}

/// `eos_token_id` is an int in some checkpoints and a list in others.
pub(crate) fn token_ids(v: Option<&Value>, key: &str) -> Result<Vec<u32>> {
    let as_id = |x: &Value| {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| Error::Config(format!("`{key}` must hold token ids, got {x}")))
    };
    match v {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(items)) => items.iter().map(as_id).collect(),
        Some(x) => Ok(vec![as_id(x)?]),
    }
}

/// The EOS ids of `generation_config.json` in `dir` (none without the
/// file). It may list more than config.json: Qwen3 adds `<|endoftext|>`
/// next to `<|im_end|>`.
pub(crate) fn generation_eos_ids(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    if !path.exists() {
        return Ok(vec![]);
    }
    token_ids(read_json(&path)?.get("eos_token_id"), "eos_token_id")
}

/// Appends the ids of `more` that `ids` lacks, keeping their order.
pub(crate) fn add_missing(ids: &mut Vec<u32>, more: impl IntoIterator<Item = u32>) {
    for id in more {
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
}

fn quant_spec(v: &Value, context: &str) -> Result<QuantSpec> {
    if let Some(mode) = get(v, "mode") {
        if mode.as_str() != Some("affine") {
            return Err(Error::Unsupported(format!(
                "quantization mode {mode} in {context} (only affine)"
            )));
        }
    }
    let bits =
        int(v, "bits")?.ok_or_else(|| Error::Config(format!("{context}: missing `bits`")))?;
    let group = int(v, "group_size")?
        .ok_or_else(|| Error::Config(format!("{context}: missing `group_size`")))?;
    QuantSpec::new(i32_of(bits, "bits")?, i32_of(group, "group_size")?)
}

/// MLX's `quantization` block; else `quantization_config`, which MLX writes
/// as a copy of it but other tools (GPTQ, AWQ, bitsandbytes...) fill with
/// their own schemes, marked by `quant_method`.
fn quantization(v: &Value) -> Result<Option<Quantization>> {
    let q = match (get(v, "quantization"), get(v, "quantization_config")) {
        (Some(q), _) => q,
        (None, Some(q)) => {
            if let Some(method) = get(q, "quant_method") {
                return Err(Error::Unsupported(format!(
                    "quantization_config with quant_method {method}: only MLX's affine \
                     quantization loads (convert the checkpoint with mlx_lm.convert)"
                )));
            }
            q
        }
        (None, None) => return Ok(None),
    };
    let obj = q
        .as_object()
        .ok_or_else(|| Error::Config("`quantization` must be an object".into()))?;
    let default = quant_spec(q, "`quantization`")?;
    let mut per_layer = HashMap::new();
    for (key, value) in obj {
        if value.is_object() {
            per_layer.insert(
                key.clone(),
                quant_spec(value, &format!("`quantization.{key}`"))?,
            );
        }
    }
    Ok(Some(Quantization { default, per_layer }))
}

/// `rope_scaling` types whose frequencies differ from RoPE's own, with
/// their parameters as mlx-lm's `initialize_rope` reads them (defaults
/// included); nn::rope turns them into frequencies and the input scale.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Llama 3's smooth interpolation between scaled and unscaled bands.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
    /// YaRN: interpolated low frequencies, and queries and keys scaled by
    /// `mscale(factor, mscale) / mscale(factor, mscale_all_dim)`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        mscale: f64,
        mscale_all_dim: f64,
    },
}

/// `rope_scaling` (or transformers 5's `rope_parameters`): the position
/// scale of MLX's own rope, and the scaling that brings frequencies of its
/// own. Types mlx-lm's Qwen models would not run, or that this engine does
/// not implement, are refused here rather than ignored.
fn rope_scaling(v: &Value) -> Result<(f32, RopeScaling)> {
    let scaling = get(v, "rope_scaling")
        .or_else(|| get(v, "rope_parameters").filter(|p| get(p, "factor").is_some()));
    let Some(scaling) = scaling else {
        return Ok((1.0, RopeScaling::None));
    };
    if !scaling.is_object() {
        return Err(Error::Config(format!(
            "`rope_scaling` must be an object, got {scaling}"
        )));
    }
    let kind = match get(scaling, "type").or_else(|| get(scaling, "rope_type")) {
        None => "default",
        Some(k) => k.as_str().ok_or_else(|| {
            Error::Config(format!("rope_scaling `type` must be a string, got {k}"))
        })?,
    };
    let number = |key: &str, default: Option<f64>| -> Result<f64> {
        match (float(scaling, key)?, default) {
            (Some(x), _) if x.is_finite() => Ok(x),
            (Some(x), _) => Err(Error::Config(format!(
                "{kind} rope_scaling `{key}` must be finite, got {x}"
            ))),
            (None, Some(d)) => Ok(d),
            (None, None) => Err(Error::Config(format!("{kind} rope_scaling needs `{key}`"))),
        }
    };
    let positive = |key: &str, default: Option<f64>| -> Result<f64> {
        let x = number(key, default)?;
        if x > 0.0 {
            Ok(x)
        } else {
            Err(Error::Config(format!(
                "{kind} rope_scaling `{key}` must be positive, got {x}"
            )))
        }
    };
    match kind {
        "default" => Ok((1.0, RopeScaling::None)),
        "linear" => Ok(((1.0 / positive("factor", None)?) as f32, RopeScaling::None)),
        "llama3" => {
            let low_freq_factor = positive("low_freq_factor", Some(1.0))?;
            let high_freq_factor = positive("high_freq_factor", Some(4.0))?;
            if low_freq_factor == high_freq_factor {
                return Err(Error::Config(
                    "llama3 rope_scaling needs `low_freq_factor` and `high_freq_factor` to differ"
                        .into(),
                ));
            }
            Ok((
                1.0,
                RopeScaling::Llama3 {
                    factor: positive("factor", None)?,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings: positive(
                        "original_max_position_embeddings",
                        Some(8192.0),
                    )?,
                },
            ))
        }
        "yarn" | "deepseek_yarn" | "telechat3-yarn" => Ok((
            1.0,
            RopeScaling::Yarn {
                factor: positive("factor", None)?,
                original_max_position_embeddings: positive(
                    "original_max_position_embeddings",
                    Some(4096.0),
                )?,
                beta_fast: positive("beta_fast", Some(32.0))?,
                beta_slow: positive("beta_slow", Some(1.0))?,
                mscale: number("mscale", Some(1.0))?,
                mscale_all_dim: number("mscale_all_dim", Some(0.0))?,
            },
        )),
        other => Err(Error::Unsupported(format!(
            "rope_scaling type `{other}` (supported: default, linear, llama3, yarn)"
        ))),
    }
}

impl ModelConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        Self::from_json(&read_json(path)?)
    }

    pub fn from_json(v: &Value) -> Result<Self> {
        if !v.is_object() {
            return Err(Error::Config("must be a JSON object".into()));
        }
        let arch = match get(v, "model_type").and_then(Value::as_str) {
            Some("qwen3") => Arch::Qwen3,
            Some("qwen2") => Arch::Qwen2,
            Some("qwen3_moe") => Arch::Qwen3Moe,
            Some(other) => {
                return Err(Error::Unsupported(format!(
                    "model_type `{other}` (supported: qwen3, qwen2, qwen3_moe)"
                )))
            }
            None => return Err(Error::Config("missing required key `model_type`".into())),
        };
        let hidden_size = i32_of(req_int(v, "hidden_size")?, "hidden_size")?;
        let num_heads = i32_of(req_int(v, "num_attention_heads")?, "num_attention_heads")?;
        let num_kv_heads = match int(v, "num_key_value_heads")? {
            Some(n) => i32_of(n, "num_key_value_heads")?,
            None => num_heads,
        };
        if num_heads % num_kv_heads != 0 {
            return Err(Error::Config(format!(
                "num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )));
        }
        let head_dim = match int(v, "head_dim")? {
            Some(n) => i32_of(n, "head_dim")?,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(Error::Config(
                    "hidden_size must be divisible by num_attention_heads".into(),
                ))
            }
        };
        let rope_theta = float(v, "rope_theta")?.or(get(v, "rope_parameters")
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64));
        let rope_theta = match (rope_theta, arch) {
            (Some(t), _) => t,
            (None, Arch::Qwen2) => 1_000_000.0,
            (None, Arch::Qwen3 | Arch::Qwen3Moe) => {
                return Err(Error::Config("missing required key `rope_theta`".into()))
            }
        };
        let (rope_scale, rope_scaling) = rope_scaling(v)?;
        let tie_word_embeddings = boolean(v, "tie_word_embeddings")?.unwrap_or(arch == Arch::Qwen2);
        // As mlx-lm: its qwen2 passes `rope_traditional` to RoPE, its qwen3
        // and qwen3_moe always rotate halves whatever the key says.
        let rope_traditional = match arch {
            Arch::Qwen2 => boolean(v, "rope_traditional")?.unwrap_or(false),
            Arch::Qwen3 | Arch::Qwen3Moe => false,
        };
        let moe = match arch {
            Arch::Qwen3Moe => Some(moe_config(v)?),
            Arch::Qwen2 | Arch::Qwen3 => None,
        };
        Ok(ModelConfig {
            arch,
            hidden_size,
            num_layers: req_int(v, "num_hidden_layers")? as usize,
            intermediate_size: i32_of(req_int(v, "intermediate_size")?, "intermediate_size")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: float(v, "rms_norm_eps")?.unwrap_or(1e-6) as f32,
            rope_theta: rope_theta as f32,
            rope_scale,
            rope_scaling,
            rope_traditional,
            tie_word_embeddings,
            vocab_size: i32_of(req_int(v, "vocab_size")?, "vocab_size")?,
            max_position_embeddings: int(v, "max_position_embeddings")?.unwrap_or(32768) as usize,
            eos_token_ids: token_ids(get(v, "eos_token_id"), "eos_token_id")?,
            quantization: quantization(v)?,
            moe,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 2,
               "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 32, "vocab_size": 1000, "rope_theta": 1e6, "eos_token_id": 7})
    }

    #[test]
    fn parses_minimal_qwen3() {
        let c = ModelConfig::from_json(&base()).unwrap();
        assert_eq!(c.arch, Arch::Qwen3);
        assert_eq!(c.eos_token_ids, vec![7]);
        assert!(!c.tie_word_embeddings);
        assert_eq!(c.rope_scale, 1.0);
    }

    #[test]
    fn per_layer_quantization_and_linear_rope() {
        let mut v = base();
        v["quantization"] = json!({"bits": 4, "group_size": 64, "mode": "affine",
                                   "model.layers.0.mlp.down_proj": {"bits": 8, "group_size": 64}});
        v["rope_scaling"] = json!({"type": "linear", "factor": 4.0});
        v["eos_token_id"] = json!([1, 2]);
        let c = ModelConfig::from_json(&v).unwrap();
        let q = c.quantization.unwrap();
        assert_eq!(q.for_module("model.layers.0.mlp.down_proj").bits, 8);
        assert_eq!(q.for_module("model.layers.1.mlp.down_proj").bits, 4);
        assert_eq!(c.rope_scale, 0.25);
        assert_eq!(c.eos_token_ids, vec![1, 2]);
    }

    #[test]
    fn rope_traditional_as_mlx_lm_reads_it() {
        let mut v = base();
        v["rope_traditional"] = json!(true);
        // mlx-lm's qwen3 ignores the key; its qwen2 passes it to RoPE.
        assert!(!ModelConfig::from_json(&v).unwrap().rope_traditional);
        v["model_type"] = json!("qwen2");
        assert!(ModelConfig::from_json(&v).unwrap().rope_traditional);
        v["rope_traditional"] = json!("yes");
        assert_eq!(ModelConfig::from_json(&v).unwrap_err().kind(), "config");
    }

    #[test]
    fn quantization_config_of_other_tools_is_unsupported() {
        for method in ["gptq", "awq", "bitsandbytes", "fp8"] {
            let mut v = base();
            v["quantization_config"] =
                json!({"quant_method": method, "bits": 4, "group_size": 128});
            let err = ModelConfig::from_json(&v).unwrap_err();
            assert_eq!(err.kind(), "unsupported", "{method}");
            assert!(err.to_string().contains(method), "{err}");
        }
        // MLX writes `quantization_config` as a copy of `quantization`.
        let mut v = base();
        let mlx = json!({"bits": 4, "group_size": 64, "mode": "affine"});
        v["quantization"] = mlx.clone();
        v["quantization_config"] = mlx.clone();
        assert_eq!(
            ModelConfig::from_json(&v)
                .unwrap()
                .quantization
                .unwrap()
                .default,
            QuantSpec::new(4, 64).unwrap()
        );
        let mut v = base();
        v["quantization_config"] = mlx;
        assert!(ModelConfig::from_json(&v).unwrap().quantization.is_some());
    }

    #[test]
    fn typed_errors() {
        let mut v = base();
        v["model_type"] = json!("llama");
        assert_eq!(
            ModelConfig::from_json(&v).unwrap_err().kind(),
            "unsupported"
        );
        let mut v = base();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert!(ModelConfig::from_json(&v)
            .unwrap_err()
            .to_string()
            .contains("hidden_size"));
        let mut v = base();
        v["num_hidden_layers"] = json!("two");
        assert_eq!(ModelConfig::from_json(&v).unwrap_err().kind(), "config");
        let mut v = base();
        v["quantization"] = json!({"bits": 7, "group_size": 64});
        assert_eq!(
            ModelConfig::from_json(&v).unwrap_err().kind(),
            "unsupported"
        );
        for kind in ["dynamic", "longrope", "su", "mrope"] {
            let mut v = base();
            v["rope_scaling"] = json!({"type": kind, "factor": 4.0});
            let err = ModelConfig::from_json(&v).unwrap_err();
            assert_eq!(err.kind(), "unsupported", "{kind}");
            assert!(err.to_string().contains(kind), "{err}");
        }
    }

    /// YaRN and llama3 as mlx-lm's `initialize_rope` reads them, with its
    /// defaults for the keys left out, from `rope_scaling` or transformers
    /// 5's `rope_parameters`; a malformed block is a config error.
    #[test]
    fn yarn_and_llama3_rope_scaling() {
        let mut v = base();
        v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0,
                                   "original_max_position_embeddings": 32768});
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.rope_scale, 1.0);
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Yarn {
                factor: 4.0,
                original_max_position_embeddings: 32768.0,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale: 1.0,
                mscale_all_dim: 0.0,
            }
        );
        let mut v = base();
        v.as_object_mut().unwrap().remove("rope_theta");
        v["rope_parameters"] = json!({"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5});
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.rope_theta, 5e5);
        assert_eq!(
            c.rope_scaling,
            RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192.0,
            }
        );
        for bad in [
            json!({"type": "yarn"}),
            json!({"type": "yarn", "factor": "4"}),
            json!({"type": "yarn", "factor": 4.0, "beta_fast": 0}),
            json!({"type": "linear", "factor": -1.0}),
            json!({"type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0}),
            json!({"type": 3, "factor": 2.0}),
            json!("yarn"),
        ] {
            let mut v = base();
            v["rope_scaling"] = bad.clone();
            let err = ModelConfig::from_json(&v).unwrap_err();
            assert_eq!(err.kind(), "config", "{bad}: {err}");
        }
    }

    /// Qwen3-MoE's keys, with Hugging Face's defaults for those left out,
    /// and which layers are sparse; a config that cannot route is refused.
    #[test]
    fn qwen3_moe_experts() {
        let mut v = base();
        v["model_type"] = json!("qwen3_moe");
        v["num_hidden_layers"] = json!(4);
        v["num_experts"] = json!(8);
        v["num_experts_per_tok"] = json!(2);
        v["moe_intermediate_size"] = json!(64);
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.arch, Arch::Qwen3Moe);
        assert!(c.arch.has_qk_norm() && !c.rope_traditional);
        let moe = c.moe.unwrap();
        assert!(!moe.norm_topk_prob);
        assert!((0..4).all(|i| moe.is_sparse(i)));
        v["decoder_sparse_step"] = json!(2);
        v["mlp_only_layers"] = json!([3]);
        let moe = ModelConfig::from_json(&v).unwrap().moe.unwrap();
        let sparse: Vec<bool> = (0..4).map(|i| moe.is_sparse(i)).collect();
        assert_eq!(sparse, [false, true, false, false]);
        assert!(ModelConfig::from_json(&base()).unwrap().moe.is_none());
        for (key, bad) in [
            ("num_experts_per_tok", json!(9)),
            ("num_experts", json!(0)),
            ("mlp_only_layers", json!([-1])),
            ("mlp_only_layers", json!(3)),
            ("decoder_sparse_step", json!(0)),
            ("norm_topk_prob", json!("yes")),
            ("moe_intermediate_size", json!(null)),
        ] {
            let mut v = v.clone();
            v[key] = bad.clone();
            let err = ModelConfig::from_json(&v).unwrap_err();
            assert_eq!(err.kind(), "config", "{key}: {bad}: {err}");
        }
    }
}

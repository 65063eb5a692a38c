//! Loading models and describing them.

use std::path::Path;
use std::sync::Arc;

use emlx_axon_engine::runtime::device::{gpu_available, mlx_version, on_large_stack, DeviceKind};
use emlx_axon_engine::{Dtype, LoadOptions, Model, QuantSpec};
use rustler::{NifMap, ResourceArc};

use crate::error::{guard, NifError, NifResult};

pub struct ModelResource {
    pub model: Arc<Model>,
}

#[rustler::resource_impl]
impl rustler::Resource for ModelResource {}

#[derive(NifMap)]
pub struct MlxInfo {
    mlx_version: String,
    default_device: rustler::Atom,
    gpu_available: bool,
    /// Each fast path: whether this build and device offer it, and its
    /// check's result once run.
    paths: Vec<PathOffer>,
    /// Every environment switch as the engine read it.
    switches: Vec<(String, String)>,
    /// Kernel checks that failed, replays turned off: each once.
    notices: Vec<String>,
}

#[derive(NifMap)]
pub struct PathOffer {
    name: String,
    offered: bool,
    checked: Option<bool>,
}

mod atoms {
    rustler::atoms! { cpu, gpu }
}

#[rustler::nif(schedule = "DirtyCpu")]
fn mlx_info() -> MlxInfo {
    MlxInfo {
        mlx_version: mlx_version(),
        default_device: match DeviceKind::default_kind() {
            DeviceKind::Cpu => atoms::cpu(),
            DeviceKind::Gpu => atoms::gpu(),
        },
        gpu_available: gpu_available(),
        paths: emlx_axon_engine::backend::offered()
            .into_iter()
            .map(|(name, offered, checked)| PathOffer {
                name: name.into(),
                offered,
                checked,
            })
            .collect(),
        switches: emlx_axon_engine::switches::all()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        notices: emlx_axon_engine::backend::notices(),
    }
}

#[derive(NifMap)]
pub struct ModelLoadOptions {
    dtype: Option<String>,
    quantize_bits: Option<i32>,
    quantize_group_size: Option<i32>,
}

mod option_atoms {
    rustler::atoms! { strict }
}

/// The optional `strict` key (absent or `nil`: strict, unused checkpoint
/// tensors are refused); a bad value raises as a bad field of
/// `ModelLoadOptions` does.
fn strict(options: rustler::Term) -> Result<bool, rustler::Error> {
    match options.map_get(option_atoms::strict()) {
        Ok(term) => term
            .decode::<Option<bool>>()
            .map(|s| s.unwrap_or(true))
            .map_err(|_| {
                rustler::Error::RaiseTerm(Box::new("Could not decode field :strict on %{}"))
            }),
        Err(_) => Ok(true),
    }
}

pub(crate) fn parse_dtype(name: &str) -> NifResult<Dtype> {
    match name {
        "float32" => Ok(Dtype::Float32),
        "bfloat16" => Ok(Dtype::Bfloat16),
        "float16" => Ok(Dtype::Float16),
        other => Err(NifError::new(
            "invalid_argument",
            format!("dtype must be float32, bfloat16 or float16, got {other}"),
        )),
    }
}

pub fn dtype_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Float32 => "float32",
        Dtype::Bfloat16 => "bfloat16",
        Dtype::Float16 => "float16",
        _ => "other",
    }
}

#[rustler::nif(schedule = "DirtyIo")]
fn model_load(
    path: String,
    options: rustler::Term,
) -> Result<NifResult<ResourceArc<ModelResource>>, rustler::Error> {
    let strict = strict(options)?;
    let options: ModelLoadOptions = options.decode()?;
    Ok(guard(|| {
        let quantize = match (options.quantize_bits, options.quantize_group_size) {
            (None, None) => None,
            (Some(bits), Some(group)) => Some(QuantSpec::new(bits, group)?),
            _ => {
                return Err(NifError::new(
                    "invalid_argument",
                    "quantize needs both bits and group_size",
                ))
            }
        };
        let options = LoadOptions {
            dtype: options.dtype.as_deref().map(parse_dtype).transpose()?,
            quantize,
            cpu_parallel: None,
            strict,
        };
        let model = on_large_stack(|| Model::load(Path::new(&path), &options))?;
        Ok(ResourceArc::new(ModelResource {
            model: Arc::new(model),
        }))
    }))
}

#[derive(NifMap)]
pub struct QuantSupport {
    bits: Vec<i32>,
    group_sizes: Vec<i32>,
}

/// The quantization settings the engine loads, for option checks in Elixir.
#[rustler::nif]
fn quantization_support() -> QuantSupport {
    QuantSupport {
        bits: QuantSpec::BITS.to_vec(),
        group_sizes: QuantSpec::GROUP_SIZES.to_vec(),
    }
}

#[derive(NifMap)]
pub struct QuantInfo {
    bits: i32,
    group_size: i32,
}

#[derive(NifMap)]
pub struct ModelInfo {
    model_type: String,
    num_layers: usize,
    hidden_size: i32,
    vocab_size: i32,
    num_heads: i32,
    num_kv_heads: i32,
    head_dim: i32,
    max_position_embeddings: usize,
    eos_token_ids: Vec<u32>,
    dtype: String,
    quantization: Option<QuantInfo>,
    load_ms: f64,
    weight_bytes: usize,
    path: String,
}

#[rustler::nif]
fn model_info(resource: ResourceArc<ModelResource>) -> NifResult<ModelInfo> {
    let m = &resource.model;
    let c = &m.config;
    let quantization = c
        .quantization
        .as_ref()
        .map(|q| q.default)
        .or(m.quantized_at_load)
        .map(|q| QuantInfo {
            bits: q.bits,
            group_size: q.group_size,
        });
    Ok(ModelInfo {
        model_type: c.arch.name().to_string(),
        num_layers: c.num_layers,
        hidden_size: c.hidden_size,
        vocab_size: c.vocab_size,
        num_heads: c.num_heads,
        num_kv_heads: c.num_kv_heads,
        head_dim: c.head_dim,
        max_position_embeddings: c.max_position_embeddings,
        eos_token_ids: c.eos_token_ids.clone(),
        dtype: dtype_name(m.dtype).to_string(),
        quantization,
        load_ms: m.load_ms,
        weight_bytes: m.weight_bytes,
        path: m.path.display().to_string(),
    })
}

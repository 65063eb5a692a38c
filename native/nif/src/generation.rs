//! Chunked generation: start (prefill), next (decode a chunk), stats, free.

use emlx_axon_engine::backend::Work;
use emlx_axon_engine::kv::cache::KvQuant;
use emlx_axon_engine::runtime::device::on_large_stack;
use emlx_axon_engine::{
    Dtype, GenerateOptions, Generation, RowOptions, SamplerConfig, SamplerKind,
};
use rustler::{Atom, NifMap, ResourceArc, Term};

use crate::constraint::constraint_spec;
use crate::error::{guard, NifError, NifResult};
use crate::model::ModelResource;
use crate::slot::Slot;
use crate::stream::StreamResource;
use crate::tokenizer::TokenizerResource;

mod atoms {
    rustler::atoms! { row_seeds, row_constraints, greedy, top_p_cpu, top_p_gpu, cont, done, ok }
}

pub struct GenerationResource {
    generation: Slot<Generation>,
}

#[rustler::resource_impl]
impl rustler::Resource for GenerationResource {}

impl GenerationResource {
    fn with<T>(&self, f: impl FnOnce(&mut Generation) -> NifResult<T>) -> NifResult<T> {
        self.generation.with(f)
    }
}

#[derive(NifMap)]
pub struct StartOptions {
    max_new_tokens: usize,
    max_len: usize,
    sampler: Atom,
    temperature: f64,
    top_p: f64,
    top_k: usize,
    min_p: f64,
    seed: Option<u64>,
    stop: Vec<String>,
    eos_token_ids: Option<Vec<u32>>,
    ignore_eos: bool,
    profile_timing: bool,
    /// `nil` or the bits of a quantized KV cache, its group size and the
    /// positions before it is quantized.
    kv_bits: Option<i32>,
    kv_group_size: i32,
    quantized_kv_start: usize,
    /// `nil` or the positions of a rotating KV cache.
    max_kv_size: Option<usize>,
    /// `nil` (the model's) or the float KV cache's dtype.
    kv_dtype: Option<String>,
}

/// A quantized KV cache of `bits` bits (when given) in groups of
/// `group_size`.
pub(crate) fn kv_quant(bits: Option<i32>, group_size: i32) -> Option<KvQuant> {
    bits.map(|bits| KvQuant { group_size, bits })
}

/// A float KV cache's dtype as Elixir names it (`nil`: the model's).
pub(crate) fn kv_dtype(name: Option<&str>) -> NifResult<Option<Dtype>> {
    name.map(crate::model::parse_dtype).transpose()
}

/// The engine's sampler settings from an Elixir request's options.
pub(crate) fn sampler_config(
    kind: Atom,
    temperature: f64,
    top_p: f64,
    top_k: usize,
    min_p: f64,
    seed: Option<u64>,
) -> NifResult<SamplerConfig> {
    Ok(SamplerConfig {
        kind: sampler_kind(kind)?,
        temperature: temperature as f32,
        top_p: top_p as f32,
        top_k,
        min_p: min_p as f32,
        seed,
        ..SamplerConfig::default()
    })
}

/// The engine's sampler for `:greedy`, `:top_p_cpu` or `:top_p_gpu`.
pub(crate) fn sampler_kind(atom: Atom) -> NifResult<SamplerKind> {
    if atom == atoms::greedy() {
        Ok(SamplerKind::Greedy)
    } else if atom == atoms::top_p_cpu() {
        Ok(SamplerKind::TopPCpu)
    } else if atom == atoms::top_p_gpu() {
        Ok(SamplerKind::TopPGpu)
    } else {
        Err(NifError::new(
            "invalid_argument",
            "sampler must be :greedy, :top_p_cpu or :top_p_gpu",
        ))
    }
}

/// An optional key of the options map, or `None`. Read apart from
/// `StartOptions` so that a map without it still decodes; a bad value
/// raises as a bad field of `StartOptions` does.
fn optional<'a, T: rustler::Decoder<'a>>(
    opts: Term<'a>,
    key: Atom,
    message: &'static str,
) -> Result<Option<T>, rustler::Error> {
    match opts.map_get(key) {
        Ok(term) => term
            .decode()
            .map_err(|_| rustler::Error::RaiseTerm(Box::new(message))),
        Err(_) => Ok(None),
    }
}

/// The optional `row_seeds` key (one entry per prompt, `nil`: derived from
/// `seed`) and `row_constraints` key (one `nil` or `{:json_schema | :regex
/// | :grammar, text}` per prompt).
fn row_options(opts: Term) -> Result<Vec<RowOptions>, rustler::Error> {
    let seeds: Vec<Option<u64>> = optional(
        opts,
        atoms::row_seeds(),
        "Could not decode field :row_seeds on %{}",
    )?
    .unwrap_or_default();
    let constraints: Vec<Option<(Atom, String)>> = optional(
        opts,
        atoms::row_constraints(),
        "Could not decode field :row_constraints on %{}",
    )?
    .unwrap_or_default();
    let rows = seeds.len().max(constraints.len());
    (0..rows)
        .map(|i| {
            Ok(RowOptions {
                seed: seeds.get(i).copied().flatten(),
                constraint: constraint_spec(constraints.get(i).cloned().flatten())?,
            })
        })
        .collect()
}

#[rustler::nif(schedule = "DirtyCpu")]
fn generation_start(
    model: ResourceArc<ModelResource>,
    tokenizer: Option<ResourceArc<TokenizerResource>>,
    stream: Option<ResourceArc<StreamResource>>,
    prompts: Vec<Vec<u32>>,
    opts: Term,
) -> Result<NifResult<ResourceArc<GenerationResource>>, rustler::Error> {
    let o: StartOptions = opts.decode()?;
    let rows = row_options(opts)?;
    Ok(guard(|| {
        let options = GenerateOptions {
            max_new_tokens: o.max_new_tokens,
            max_len: o.max_len,
            sampler: sampler_config(o.sampler, o.temperature, o.top_p, o.top_k, o.min_p, o.seed)?,
            rows,
            eos_token_ids: o.eos_token_ids,
            ignore_eos: o.ignore_eos,
            stop: o.stop,
            profile_timing: o.profile_timing,
            kv_quant: kv_quant(o.kv_bits, o.kv_group_size),
            quantized_kv_start: o.quantized_kv_start,
            max_kv_size: o.max_kv_size,
            kv_dtype: kv_dtype(o.kv_dtype.as_deref())?,
            ..GenerateOptions::default()
        };
        let stream = stream.map(|s| s.get()).transpose()?;
        let generation = on_large_stack(|| {
            Generation::start(
                model.model.clone(),
                tokenizer.map(|t| t.tokenizer.clone()),
                stream,
                &prompts,
                options,
            )
        })?;
        Ok(ResourceArc::new(GenerationResource {
            generation: Slot::new(generation, ("released", "the generation was freed")),
        }))
    }))
}

#[derive(NifMap)]
pub struct RowOut {
    ids: Vec<u32>,
    text: String,
    finish_reason: Option<Atom>,
}

#[rustler::nif(schedule = "DirtyCpu")]
fn generation_next(
    resource: ResourceArc<GenerationResource>,
    max_steps: usize,
) -> NifResult<(Atom, Vec<RowOut>)> {
    guard(|| {
        resource.with(|generation| {
            let deltas = on_large_stack(|| generation.next(max_steps.max(1)))?;
            let rows = deltas
                .into_iter()
                .map(|d| RowOut {
                    ids: d.ids,
                    text: d.text,
                    finish_reason: d.finish.map(crate::scheduler::finish_atom),
                })
                .collect();
            let status = if generation.is_done() {
                atoms::done()
            } else {
                atoms::cont()
            };
            Ok((status, rows))
        })
    })
}

#[derive(NifMap)]
pub struct StatsOut {
    prompt_tokens: Vec<usize>,
    generated_tokens: Vec<usize>,
    prefill_ms: f64,
    decode_ms: f64,
    decode_tokens_per_s: f64,
    time_to_first_token_ms: f64,
    constraint_ms: f64,
    forced_tokens: Vec<usize>,
    decode_path: String,
    prefill_path: String,
    fallbacks: Vec<String>,
    kv_dtype: Option<String>,
}

#[rustler::nif]
fn generation_stats(resource: ResourceArc<GenerationResource>) -> NifResult<StatsOut> {
    resource.with(|generation| {
        let s = generation.stats();
        Ok(StatsOut {
            prompt_tokens: s.prompt_tokens,
            generated_tokens: s.generated_tokens,
            prefill_ms: s.prefill_ms,
            decode_ms: s.decode_ms,
            decode_tokens_per_s: s.decode_tokens_per_s,
            time_to_first_token_ms: s.time_to_first_token_ms,
            constraint_ms: s.constraint_ms,
            forced_tokens: s.forced_tokens,
            decode_path: s.paths.main_name(Work::Decode).into(),
            prefill_path: s.paths.main_name(Work::Prefill).into(),
            fallbacks: s.paths.fallbacks,
            kv_dtype: s.kv_dtype.map(|d| crate::model::dtype_name(d).into()),
        })
    })
}

/// Ends the given rows now (their callers are gone): they take no more
/// tokens, and the generation is done once its other rows are. Dirty: it
/// waits for the generation's lock, which a step may hold.
#[rustler::nif(schedule = "DirtyCpu")]
fn generation_cancel_rows(
    resource: ResourceArc<GenerationResource>,
    rows: Vec<usize>,
) -> NifResult<Atom> {
    resource.with(|generation| {
        for row in rows {
            generation.cancel_row(row)?;
        }
        Ok(atoms::ok())
    })
}

/// Frees the KV cache now rather than when the resource is collected.
#[rustler::nif(schedule = "DirtyCpu")]
fn generation_free(resource: ResourceArc<GenerationResource>) -> Atom {
    resource.generation.free();
    atoms::ok()
}

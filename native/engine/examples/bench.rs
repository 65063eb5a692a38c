//! Speed and memory of the engine on one checkpoint, one JSON object per
//! measurement on stdout (bench/run runs it next to mlx-lm and Elixir).
//!
//! cargo run --release -p emlx_axon_engine --example bench -- --model DIR
//!     (--prompts FILE | --prompt-ids 1,2,3) [--dtype float32|bfloat16|float16]
//!     [--kv-dtype float32|bfloat16|float16] [--kv-bits 4|8] [--kv-start N]
//!     [--tokens N] [--batch-tokens N] [--batch 1,4,8] [--measures decode,prefill,batch,scheduler,profile]
//!     [--warmup K] [--warmup-mode full|light] [--runs R] [--profile-stream own|default] [--chunk C] [--label TEXT]
//!     [--sampler greedy|top_p_cpu|top_p_gpu ...] [--json-schema FILE] [--scheduler-budget-ms MS]
//!
//! --prompts is the JSON written by bench/prompts.py: `decode` (batch-1
//! decode prompt), `prefill` (~512 ids, for prefill speed and time to first
//! token) and `batch` (equal-length prompts, one per row). --prompt-ids uses
//! one list for all three. The dtype defaults to the engine's: float32 on the
//! CPU, bfloat16 on a GPU.
//!
//! --json-schema constrains every row to the schema in FILE (structured
//! output; the checkpoint's tokenizer is loaded for it): a schema whose
//! outputs are longer than --tokens keeps every row decoding to the end.
//!
//! Measures (all wall clock, greedy, EOS ignored so every row decodes exactly
//! --tokens tokens):
//!   load     Model::load
//!   decode   batch 1: (tokens - 1) / (time of last token - time of first)
//!   prefill  prompt tokens / time to first token (start of the call to the
//!            first token on the host)
//!   batch    for each --batch size: rows x (batch tokens - 1) / decode time
//!   scheduler  the batch measure's rows admitted together into a scheduler
//!            of as many slots (continuous batching, the default serving's
//!            path, on its driver's thread as the serving runs it): tokens
//!            after the output holding the last first token / time from
//!            that output to the last
//!   profile  a hand-run decode loop timing graph construction, evaluation
//!            and sampling separately, the same loop queued as Generation
//!            runs it (construction, queuing, waiting), each
//!            decode-shaped kernel alone, and on a CUDA GPU each kernel of
//!            a generation's last replayed decode step alone
//!            (`profile_replay`);
//!            with BENCH_DOT=FILE, one decode step's graph as Graphviz
//! Each measure reports the peak RSS while it ran (VmHWM, reset through
//! /proc/self/clear_refs) and MLX's own peak memory.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use emlx_axon_engine::backend::cuda::layer as cuda_layer;
use emlx_axon_engine::backend::Work;
use emlx_axon_engine::exec::scheduler::{Driver, Output, Pacing};
use emlx_axon_engine::kv::cache::{KvCache, KvQuant};
use emlx_axon_engine::model::AttentionMask;
use emlx_axon_engine::runtime::device::{gpu_available, mlx_version, DeviceKind, Lease};
use emlx_axon_engine::sample::greedy;
use emlx_axon_engine::{
    ConstraintSpec, Dtype, GenerateOptions, Generation, LoadOptions, Model, Paths, RowOptions,
    SamplerConfig, SamplerKind, Scheduler, SchedulerConfig, Tokenizer,
};
use emlx_axon_kernels::QuantWeight;
use mlx_rs::fast::{rms_norm, rope, scaled_dot_product_attention};
use mlx_rs::ops::indexing::argmax_axis;
use mlx_rs::ops::quantized_matmul;
use mlx_rs::{transforms, Array};
use serde_json::{json, Map, Value};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Values per scale and bias of a `--kv-bits` cache.
const KV_GROUP: i32 = 64;

struct Prompts {
    decode: Vec<u32>,
    prefill: Vec<u32>,
    batch: Vec<Vec<u32>>,
    digest: String,
}

struct Args {
    model: PathBuf,
    prompts: Option<Prompts>,
    dtype: Option<Dtype>,
    tokens: usize,
    batch_tokens: Option<usize>,
    batches: Vec<usize>,
    measures: Vec<String>,
    warmup: usize,
    light_warmup: bool,
    default_stream: bool,
    runs: usize,
    chunk: usize,
    /// The scheduler measure's time budget per call (0: none).
    scheduler_budget_ms: u64,
    label: String,
    /// How tokens are chosen (greedy unless `--sampler` says otherwise).
    sampler: SamplerConfig,
    /// A JSON Schema every row's output must match.
    json_schema: Option<String>,
    /// The KV cache's dtype (default: the model's).
    kv_dtype: Option<Dtype>,
    /// Keys and values quantized to this many bits once the prompt is in
    /// (mlx-lm's `kv_bits`, groups of 64, with `quantized_kv_start` the
    /// prompt's length): the steps read a quantized cache.
    kv_bits: Option<i32>,
    /// With `kv_bits`, quantized from this many positions on instead
    /// (mlx-lm's `quantized_kv_start`).
    kv_start: Option<usize>,
}

fn dtype(name: &str, flag: &str) -> AnyResult<Dtype> {
    Ok(match name {
        "float32" | "f32" => Dtype::Float32,
        "bfloat16" | "bf16" => Dtype::Bfloat16,
        "float16" | "f16" => Dtype::Float16,
        other => return Err(format!("{flag}: unknown dtype {other}").into()),
    })
}

fn ids_from(value: &Value, what: &str) -> AnyResult<Vec<u32>> {
    let list = value
        .as_array()
        .ok_or(format!("`{what}` must be a list of ids"))?;
    list.iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| format!("`{what}` holds a non-id: {v}").into())
        })
        .collect()
}

fn read_prompts(path: &str) -> AnyResult<Prompts> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| format!("{path}: {e}"))?;
    let batch = json["batch"]
        .as_array()
        .ok_or("`batch` must be a list of prompts")?
        .iter()
        .map(|p| ids_from(p, "batch"))
        .collect::<AnyResult<Vec<_>>>()?;
    Ok(Prompts {
        decode: ids_from(&json["decode"], "decode")?,
        prefill: ids_from(&json["prefill"], "prefill")?,
        batch,
        digest: json["sha256"].as_str().unwrap_or("").to_string(),
    })
}

fn parse() -> AnyResult<Args> {
    let mut args = Args {
        model: PathBuf::new(),
        prompts: None,
        dtype: None,
        tokens: 128,
        batch_tokens: None,
        batches: vec![1, 4, 8],
        measures: ["decode", "prefill", "batch"].map(String::from).to_vec(),
        warmup: 1,
        light_warmup: false,
        default_stream: false,
        runs: 1,
        chunk: 16,
        scheduler_budget_ms: 20,
        label: "rust".into(),
        sampler: SamplerConfig::default(),
        json_schema: None,
        kv_dtype: None,
        kv_bits: None,
        kv_start: None,
    };
    let float = |s: String, flag: &str| -> AnyResult<f32> {
        s.parse()
            .map_err(|_| format!("{flag} needs a number, got {s}").into())
    };
    let count = |s: String, flag: &str| -> AnyResult<usize> {
        s.parse()
            .map_err(|_| format!("{flag} needs a number, got {s}").into())
    };
    let mut rest = std::env::args().skip(1);
    let v = |r: &mut std::iter::Skip<std::env::Args>, flag: &str| {
        r.next().ok_or_else(|| format!("{flag} needs a value"))
    };
    while let Some(flag) = rest.next() {
        match flag.as_str() {
            "--model" => args.model = v(&mut rest, &flag)?.into(),
            "--prompts" => args.prompts = Some(read_prompts(&v(&mut rest, &flag)?)?),
            "--prompt-ids" => {
                let ids = v(&mut rest, &flag)?
                    .split(',')
                    .map(|x| x.trim().parse::<u32>())
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|_| "--prompt-ids takes comma-separated ids")?;
                args.prompts = Some(Prompts {
                    decode: ids.clone(),
                    prefill: ids.clone(),
                    batch: vec![ids],
                    digest: String::new(),
                });
            }
            "--dtype" => args.dtype = Some(dtype(&v(&mut rest, &flag)?, &flag)?),
            "--kv-dtype" => args.kv_dtype = Some(dtype(&v(&mut rest, &flag)?, &flag)?),
            "--kv-bits" => args.kv_bits = Some(count(v(&mut rest, &flag)?, &flag)? as i32),
            "--kv-start" => args.kv_start = Some(count(v(&mut rest, &flag)?, &flag)?),
            "--tokens" => args.tokens = count(v(&mut rest, &flag)?, &flag)?,
            "--batch-tokens" => args.batch_tokens = Some(count(v(&mut rest, &flag)?, &flag)?),
            "--warmup" => args.warmup = count(v(&mut rest, &flag)?, &flag)?,
            "--warmup-mode" => {
                args.light_warmup = match v(&mut rest, &flag)?.as_str() {
                    "light" => true,
                    "full" => false,
                    other => {
                        return Err(format!("--warmup-mode is full or light, not {other}").into())
                    }
                }
            }
            "--profile-stream" => {
                args.default_stream = match v(&mut rest, &flag)?.as_str() {
                    "default" => true,
                    "own" => false,
                    other => {
                        return Err(
                            format!("--profile-stream is own or default, not {other}").into()
                        )
                    }
                }
            }
            "--runs" => args.runs = count(v(&mut rest, &flag)?, &flag)?.max(1),
            "--chunk" => args.chunk = count(v(&mut rest, &flag)?, &flag)?.max(1),
            "--scheduler-budget-ms" => {
                args.scheduler_budget_ms = count(v(&mut rest, &flag)?, &flag)? as u64
            }
            "--label" => args.label = v(&mut rest, &flag)?,
            "--sampler" => {
                args.sampler.kind = match v(&mut rest, &flag)?.as_str() {
                    "greedy" => SamplerKind::Greedy,
                    "top_p_cpu" => SamplerKind::TopPCpu,
                    "top_p_gpu" => SamplerKind::TopPGpu,
                    other => {
                        return Err(format!(
                            "--sampler takes greedy, top_p_cpu or top_p_gpu, got {other}"
                        )
                        .into())
                    }
                }
            }
            "--json-schema" => {
                let path = v(&mut rest, &flag)?;
                let text = std::fs::read_to_string(&path)
                    .map_err(|e| format!("--json-schema {path}: {e}"))?;
                args.json_schema = Some(text);
            }
            "--temperature" => args.sampler.temperature = float(v(&mut rest, &flag)?, &flag)?,
            "--top-p" => args.sampler.top_p = float(v(&mut rest, &flag)?, &flag)?,
            "--min-p" => args.sampler.min_p = float(v(&mut rest, &flag)?, &flag)?,
            "--top-k" => args.sampler.top_k = count(v(&mut rest, &flag)?, &flag)?,
            "--seed" => args.sampler.seed = Some(count(v(&mut rest, &flag)?, &flag)? as u64),
            "--batch" => {
                args.batches = v(&mut rest, &flag)?
                    .split(',')
                    .map(|b| count(b.trim().to_string(), &flag))
                    .collect::<AnyResult<Vec<_>>>()?
            }
            "--measures" => {
                args.measures = v(&mut rest, &flag)?.split(',').map(String::from).collect();
                for m in &args.measures {
                    if !["decode", "prefill", "batch", "scheduler", "profile"].contains(&m.as_str())
                    {
                        return Err(format!("--measures: unknown measure {m}").into());
                    }
                }
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    if args.model.as_os_str().is_empty() {
        return Err("--model DIR is required".into());
    }
    if args.prompts.is_none() {
        return Err("--prompts FILE or --prompt-ids LIST is required".into());
    }
    args.sampler
        .validate()
        .map_err(|e| format!("sampling options: {e}"))?;
    if args.tokens < 2 || args.batch_tokens.is_some_and(|n| n < 2) {
        return Err("--tokens and --batch-tokens must be at least 2".into());
    }
    Ok(args)
}

/// Memory readings taken around one measurement.
struct Memory;

impl Memory {
    /// Frees MLX's buffer cache and resets both peaks, so the next reading
    /// covers only what runs from now on.
    fn reset() {
        // SAFETY: plain MLX-C calls without arguments.
        unsafe {
            mlx_sys::mlx_clear_cache();
            mlx_sys::mlx_reset_peak_memory();
        }
        // "5" resets the VmHWM high-water mark (Linux 4.0+); elsewhere ignored.
        let _ = std::fs::write("/proc/self/clear_refs", "5");
    }

    fn status_kb(key: &str) -> Option<f64> {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        let line = status.lines().find(|l| l.starts_with(key))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    fn mlx_peak() -> usize {
        let mut peak = 0usize;
        // SAFETY: writes one usize.
        unsafe { mlx_sys::mlx_get_peak_memory(&mut peak) };
        peak
    }

    fn record(out: &mut Map<String, Value>) {
        let mb = |kb: Option<f64>| kb.map(|k| (k / 1024.0 * 10.0).round() / 10.0);
        out.insert("peak_rss_mb".into(), json!(mb(Self::status_kb("VmHWM:"))));
        out.insert("rss_mb".into(), json!(mb(Self::status_kb("VmRSS:"))));
        out.insert(
            "mlx_peak_mb".into(),
            json!((Self::mlx_peak() as f64 / 1048576.0 * 10.0).round() / 10.0),
        );
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}

fn round(x: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    (x * p).round() / p
}

struct Bench {
    model: Arc<Model>,
    /// The checkpoint's tokenizer, where rows are constrained.
    tokenizer: Option<Arc<Tokenizer>>,
    args: Args,
    common: Map<String, Value>,
}

/// One timed generation: prompts in, wall-clock timings out.
struct Timed {
    ttft_ms: f64,
    decode_ms: f64,
    generated: Vec<usize>,
    /// The first row's ids, compared across peers by the report.
    ids: Vec<u32>,
    /// The engine's own split of the time to first token.
    engine_setup_ms: f64,
    engine_prefill_graph_ms: f64,
    engine_prefill_ms: f64,
    engine_decode_tok_s: f64,
    step_replay: bool,
    /// The paths that ran most of the decode steps and of the prompt.
    decode_path: &'static str,
    prefill_path: &'static str,
    fallbacks: Vec<String>,
    /// The dtype the generation's KV cache was made in.
    kv_dtype: Dtype,
}

impl Bench {
    fn emit(&self, measure: &str, run: Option<usize>, fields: Value) {
        let mut out = self.common.clone();
        out.insert("measure".into(), json!(measure));
        if let Some(r) = run {
            out.insert("run".into(), json!(r));
        }
        if let Value::Object(f) = fields {
            out.extend(f);
        }
        println!("{}", Value::Object(out));
    }

    fn options(&self, rows: usize, longest: usize, tokens: usize) -> GenerateOptions {
        let row = RowOptions {
            seed: None,
            constraint: self
                .args
                .json_schema
                .clone()
                .map(ConstraintSpec::JsonSchema),
        };
        GenerateOptions {
            max_new_tokens: tokens,
            max_len: longest + tokens + 1,
            ignore_eos: true,
            profile_timing: true,
            sampler: self.args.sampler.clone(),
            rows: if row.constraint.is_some() {
                vec![row; rows]
            } else {
                vec![]
            },
            kv_dtype: self.args.kv_dtype,
            kv_quant: self.args.kv_bits.map(|bits| KvQuant {
                bits,
                group_size: KV_GROUP,
            }),
            quantized_kv_start: match (self.args.kv_bits, self.args.kv_start) {
                (Some(_), Some(start)) => start,
                (Some(_), None) => longest,
                (None, _) => GenerateOptions::default().quantized_kv_start,
            },
            ..GenerateOptions::default()
        }
    }

    fn generate(&self, prompts: &[Vec<u32>], tokens: usize) -> AnyResult<Timed> {
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        let options = self.options(prompts.len(), longest, tokens);
        let started = Instant::now();
        let mut generation = Generation::start(
            self.model.clone(),
            self.tokenizer.clone(),
            None,
            prompts,
            options,
        )?;
        generation.next(1)?;
        let first = Instant::now();
        while !generation.is_done() {
            generation.next(self.args.chunk)?;
        }
        let last = Instant::now();
        let stats = generation.stats();
        let step_replay = generation.replays_steps();
        let rows = generation.generated();
        let generated: Vec<usize> = rows.iter().map(Vec::len).collect();
        if generated.iter().any(|&n| n != tokens) {
            return Err(format!("expected {tokens} tokens per row, got {generated:?}").into());
        }
        Ok(Timed {
            ttft_ms: (first - started).as_secs_f64() * 1e3,
            decode_ms: (last - first).as_secs_f64() * 1e3,
            generated,
            ids: rows.into_iter().next().unwrap_or_default(),
            engine_setup_ms: stats.setup_ms,
            engine_prefill_graph_ms: stats.prefill_graph_ms,
            engine_prefill_ms: stats.prefill_ms,
            engine_decode_tok_s: stats.decode_tokens_per_s,
            step_replay,
            decode_path: stats.paths.main_name(Work::Decode),
            prefill_path: stats.paths.main_name(Work::Prefill),
            fallbacks: stats.paths.fallbacks.clone(),
            kv_dtype: stats.kv_dtype.unwrap_or(self.model.dtype),
        })
    }

    fn prompts(&self) -> &Prompts {
        self.args.prompts.as_ref().expect("checked in parse")
    }

    fn batch_prompts(&self, batch: usize) -> Vec<Vec<u32>> {
        let rows = &self.prompts().batch;
        (0..batch).map(|i| rows[i % rows.len()].clone()).collect()
    }

    /// Full: every measure once, shortened. Light (for slow CPUs): a 2-token
    /// prompt decoding 2 tokens, then the largest batch likewise; the same
    /// kernels run, at a fraction of the cost.
    fn warm_up(&self) -> AnyResult<()> {
        let p = self.prompts();
        let started = Instant::now();
        let largest = self.args.batches.iter().copied().max().unwrap_or(1);
        for _ in 0..self.args.warmup {
            if self.args.light_warmup {
                let short = |ids: &Vec<u32>| ids[..ids.len().min(2)].to_vec();
                self.generate(&[short(&p.decode)], 2)?;
                if self.wants("batch") && largest > 1 {
                    let rows: Vec<_> = self.batch_prompts(largest).iter().map(short).collect();
                    self.generate(&rows, 2)?;
                }
                continue;
            }
            if self.wants("decode") {
                self.generate(std::slice::from_ref(&p.decode), 4)?;
            }
            if self.wants("prefill") {
                self.generate(std::slice::from_ref(&p.prefill), 2)?;
            }
            if self.wants("batch") {
                for &b in &self.args.batches {
                    self.generate(&self.batch_prompts(b), 2)?;
                }
            }
            if self.wants("scheduler") {
                for &b in &self.args.batches {
                    self.schedule(b, 4)?;
                }
            }
        }
        self.emit(
            "warmup",
            None,
            json!({
                "iterations": self.args.warmup,
                "mode": if self.args.light_warmup { "light" } else { "full" },
                "wall_ms": round(ms(started), 1),
            }),
        );
        Ok(())
    }

    fn wants(&self, measure: &str) -> bool {
        self.args.measures.iter().any(|m| m == measure)
    }

    fn decode(&self, run: usize) -> AnyResult<()> {
        let prompt = self.prompts().decode.clone();
        let n = self.args.tokens;
        Memory::reset();
        let t = self.generate(std::slice::from_ref(&prompt), n)?;
        let mut fields = Map::new();
        fields.insert("batch".into(), json!(1));
        fields.insert("prompt_tokens".into(), json!(prompt.len()));
        fields.insert("tokens".into(), json!(n));
        fields.insert(
            "tok_s".into(),
            json!(round((n - 1) as f64 / (t.decode_ms / 1e3), 3)),
        );
        fields.insert("ttft_ms".into(), json!(round(t.ttft_ms, 2)));
        fields.insert("decode_ms".into(), json!(round(t.decode_ms, 2)));
        fields.insert(
            "engine_decode_tok_s".into(),
            json!(round(t.engine_decode_tok_s, 3)),
        );
        self.kv_fields(&mut fields, &t, 1, prompt.len() + n);
        fields.insert("ids".into(), json!(t.ids));
        fields.insert("decode_path".into(), json!(t.decode_path));
        fields.insert("prefill_path".into(), json!(t.prefill_path));
        fields.insert("fallbacks".into(), json!(t.fallbacks));
        fields.insert("step_replay".into(), json!(t.step_replay));
        // A failed kernel check or a replay turned off, said once a process.
        fields.insert(
            "notices".into(),
            json!(emlx_axon_engine::backend::notices()),
        );
        fields.insert(
            "gpu_layer_kernels".into(),
            json!(emlx_axon_engine::backend::cuda::layer::checked()),
        );
        Memory::record(&mut fields);
        self.emit("decode", Some(run), Value::Object(fields));
        Ok(())
    }

    fn prefill(&self, run: usize) -> AnyResult<()> {
        let prompt = self.prompts().prefill.clone();
        Memory::reset();
        let t = self.generate(std::slice::from_ref(&prompt), 2)?;
        let mut fields = Map::new();
        fields.insert("batch".into(), json!(1));
        fields.insert("prompt_tokens".into(), json!(prompt.len()));
        fields.insert(
            "tok_s".into(),
            json!(round(prompt.len() as f64 / (t.ttft_ms / 1e3), 3)),
        );
        fields.insert("ttft_ms".into(), json!(round(t.ttft_ms, 2)));
        for (name, ms) in [
            ("engine_setup_ms", t.engine_setup_ms),
            ("engine_prefill_graph_ms", t.engine_prefill_graph_ms),
            ("engine_prefill_ms", t.engine_prefill_ms),
        ] {
            fields.insert(name.into(), json!(round(ms, 2)));
        }
        fields.insert(
            "prompt_kernels".into(),
            json!(emlx_axon_engine::backend::cuda::prefill::checked()),
        );
        self.kv_fields(&mut fields, &t, 1, prompt.len() + 2);
        Memory::record(&mut fields);
        self.emit("prefill", Some(run), Value::Object(fields));
        Ok(())
    }

    fn batch(&self, run: usize, batch: usize) -> AnyResult<()> {
        let prompts = self.batch_prompts(batch);
        let n = self.args.batch_tokens.unwrap_or(self.args.tokens);
        Memory::reset();
        let t = self.generate(&prompts, n)?;
        let mut fields = Map::new();
        fields.insert("batch".into(), json!(batch));
        fields.insert("prompt_tokens".into(), json!(prompts[0].len()));
        fields.insert("tokens".into(), json!(n));
        fields.insert("generated".into(), json!(t.generated.iter().sum::<usize>()));
        fields.insert(
            "tok_s".into(),
            json!(round((batch * (n - 1)) as f64 / (t.decode_ms / 1e3), 3)),
        );
        fields.insert("ttft_ms".into(), json!(round(t.ttft_ms, 2)));
        fields.insert("decode_ms".into(), json!(round(t.decode_ms, 2)));
        self.kv_fields(&mut fields, &t, batch, prompts[0].len() + n);
        fields.insert("decode_path".into(), json!(t.decode_path));
        fields.insert("prefill_path".into(), json!(t.prefill_path));
        fields.insert("fallbacks".into(), json!(t.fallbacks));
        fields.insert("step_replay".into(), json!(t.step_replay));
        Memory::record(&mut fields);
        self.emit("batch", Some(run), Value::Object(fields));
        Ok(())
    }

    /// The batch measure's rows through a scheduler of `batch` slots on
    /// its driver's thread, as the Elixir scheduler runs it (up to 64
    /// decode steps and `--scheduler-budget-ms`, default 20, between the
    /// chunks of a prompt being prefilled; 0: no budget). The requests are
    /// admitted together, and the decode time runs from the output that
    /// holds the last request's first token, so the time is decode alone, as
    /// the batch measure's. Returns the tokens after that output, the
    /// prefill and decode times, and the first finished request's paths.
    fn schedule(&self, batch: usize, n: usize) -> AnyResult<(usize, f64, f64, Paths)> {
        let prompts = self.batch_prompts(batch);
        let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
        if self.args.kv_bits.is_some() {
            return Err("--measures scheduler does not take --kv-bits".into());
        }
        let config = SchedulerConfig {
            slots: batch,
            capacity: longest + n + 1,
            prefix_cache_bytes: 0,
            kv_dtype: self.args.kv_dtype,
            ..SchedulerConfig::default()
        };
        let scheduler = Scheduler::new(self.model.clone(), self.tokenizer.clone(), config)?;
        let pacing = Pacing {
            max_steps: 64,
            budget: (self.args.scheduler_budget_ms > 0)
                .then(|| Duration::from_millis(self.args.scheduler_budget_ms)),
        };
        let (tx, outputs) = std::sync::mpsc::channel();
        let driver = Driver::spawn(scheduler, pacing, move |o| {
            tx.send((Instant::now(), o)).is_ok()
        })?;
        let started = Instant::now();
        for (i, prompt) in prompts.iter().enumerate() {
            let mut options = self.options(1, longest, n);
            let constraint = options.rows.pop().and_then(|row| row.constraint);
            options.sampler.seed = options.sampler.seed.map(|s| s + i as u64);
            driver.intake().admit(prompt.clone(), options, constraint)?;
        }
        let mut generated = 0;
        let mut started_rows = std::collections::HashSet::new();
        let mut first: Option<(Instant, usize)> = None;
        let mut finished: Vec<Paths> = vec![];
        let mut end = started;
        while finished.len() < batch {
            let (at, output) = outputs.recv_timeout(Duration::from_secs(600))?;
            let events = match output {
                Output::Events { events, .. } => events,
                Output::Failed(e) => return Err(e.into()),
            };
            for e in events {
                generated += e.delta.ids.len();
                started_rows.insert(e.id);
                finished.extend(e.stats.map(|s| s.paths));
            }
            if first.is_none() && started_rows.len() == batch {
                first = Some((at, generated));
            }
            end = at;
        }
        driver.stop();
        let (first, at_first) = first.ok_or("no request produced a token")?;
        if generated != batch * n {
            return Err(format!("expected {} tokens, got {generated}", batch * n).into());
        }
        let decode_ms = (end - first).as_secs_f64() * 1e3;
        let prefill_ms = (first - started).as_secs_f64() * 1e3;
        let paths = finished.into_iter().next().unwrap_or_default();
        Ok((generated - at_first, prefill_ms, decode_ms, paths))
    }

    fn scheduler(&self, run: usize, batch: usize) -> AnyResult<()> {
        let n = self.args.batch_tokens.unwrap_or(self.args.tokens);
        Memory::reset();
        let (decoded, prefill_ms, decode_ms, paths) = self.schedule(batch, n)?;
        let mut fields = Map::new();
        fields.insert("batch".into(), json!(batch));
        fields.insert(
            "prompt_tokens".into(),
            json!(self.batch_prompts(1)[0].len()),
        );
        fields.insert("tokens".into(), json!(n));
        fields.insert(
            "tok_s".into(),
            json!(round(decoded as f64 / (decode_ms / 1e3), 3)),
        );
        fields.insert("prefill_ms".into(), json!(round(prefill_ms, 2)));
        fields.insert("decode_ms".into(), json!(round(decode_ms, 2)));
        fields.insert("decode_path".into(), json!(paths.main_name(Work::Decode)));
        fields.insert("fallbacks".into(), json!(paths.fallbacks));
        Memory::record(&mut fields);
        self.emit("scheduler", Some(run), Value::Object(fields));
        Ok(())
    }

    /// The dtype `t`'s KV cache was made in, and the bytes of that
    /// preallocated cache for `rows` x `positions`: with `--kv-bits`, its
    /// packed values and a scale and a bias per group in that dtype.
    fn kv_fields(&self, fields: &mut Map<String, Value>, t: &Timed, rows: usize, positions: usize) {
        let c = &self.model.config;
        let item = dtype_bytes(t.kv_dtype);
        let values =
            2 * c.num_layers * rows * c.num_kv_heads as usize * positions * c.head_dim as usize;
        let bytes = match self.args.kv_bits {
            Some(bits) => values * bits as usize / 8 + values / KV_GROUP as usize * 2 * item,
            None => values * item,
        };
        fields.insert("kv_dtype".into(), json!(format!("{:?}", t.kv_dtype)));
        fields.insert("kv_bytes".into(), json!(bytes));
    }

    /// Where a decode step's time goes: a decode loop run by hand, timing
    /// graph construction (`Model::forward`), evaluation and greedy sampling
    /// separately and synchronously; then each decode-shaped kernel alone.
    fn profile(&self) -> AnyResult<()> {
        // As `Generation` does: a stream of its own, plus CPU worker streams
        // when the model splits its projections.
        let own = Lease::new(DeviceKind::default_kind())?;
        let workers = if self.model.parallel_ways > 1 && !gpu_available() {
            Lease::workers(DeviceKind::Cpu, self.model.parallel_ways)?
        } else {
            vec![]
        };
        if self.args.default_stream {
            self.profile_steps(&workers)?;
            self.profile_queued(&workers)?;
        } else {
            own.stream().run(|| self.profile_steps(&workers))?;
            own.stream().run(|| self.profile_queued(&workers))?;
        }
        own.stream()
            .run(|| self.profile_kernels(self.prompts().decode.len() + self.args.tokens / 2))?;
        self.profile_replay()
    }

    /// On a CUDA GPU, where decode steps are replayed: each kernel of the
    /// first decode's last step alone (launched after the one before has
    /// finished, on that step's values),
    /// summed by kernel, against the step's time in a second decode of the
    /// decode prompt (the first one's includes the timing); the difference
    /// is what running them back to back costs or saves.
    fn profile_replay(&self) -> AnyResult<()> {
        use emlx_axon_engine::backend::cuda::replay;
        if !gpu_available() {
            return Ok(());
        }
        replay::time_next();
        let n = self.args.tokens;
        let prompt = std::slice::from_ref(&self.prompts().decode);
        self.generate(prompt, n)?;
        let t = self.generate(prompt, n)?;
        let Some(times) = replay::kernel_times() else {
            self.emit(
                "profile_replay",
                None,
                json!({"skipped": "no replayed step", "notices": emlx_axon_engine::backend::notices()}),
            );
            return Ok(());
        };
        let mut by_kernel: Vec<(String, usize, f64)> = Vec::new();
        for (name, us) in &times {
            match by_kernel.iter_mut().find(|(k, _, _)| k == name) {
                Some(entry) => {
                    entry.1 += 1;
                    entry.2 += f64::from(*us);
                }
                None => by_kernel.push((name.clone(), 1, f64::from(*us))),
            }
        }
        let alone: f64 = times.iter().map(|(_, us)| f64::from(*us)).sum();
        let step_us = t.decode_ms * 1e3 / n.saturating_sub(1).max(1) as f64;
        self.emit(
            "profile_replay",
            None,
            json!({
                "prompt_tokens": self.prompts().decode.len(),
                "tokens": n,
                "launches": times.len(),
                "runs": replay::TIMING_RUNS,
                "kernels_alone_us": round(alone, 1),
                "step_us": round(step_us, 1),
                "kernels": by_kernel
                    .iter()
                    .map(|(k, count, us)| json!({"kernel": k, "launches": count, "us": round(*us, 1)}))
                    .collect::<Vec<_>>(),
                "first_launches": times
                    .iter()
                    .take(12)
                    .map(|(k, us)| json!({"kernel": k, "us": round(f64::from(*us), 1)}))
                    .collect::<Vec<_>>(),
            }),
        );
        Ok(())
    }

    /// A cache for the decode prompt and `tokens` more, the prompt through
    /// the model, and its last logits `[1, vocab]`.
    fn prefilled(&self, workers: &[Lease]) -> AnyResult<(KvCache, Array)> {
        let prompt = &self.prompts().decode;
        let rows = (prompt.len() + self.args.tokens + 1) as i32;
        let mut cache = KvCache::new(&self.model.kv_shape(), 1, rows)?;
        let ids = Array::from_slice(prompt, &[1, prompt.len() as i32]);
        let logits = self
            .model
            .forward(&ids, &mut cache, &AttentionMask::Causal, true, workers)?;
        Ok((cache, logits.reshape(&[1, -1])?))
    }

    fn profile_steps(&self, workers: &[Lease]) -> AnyResult<()> {
        let model = &self.model;
        let n = self.args.tokens;
        let (mut cache, logits) = self.prefilled(workers)?;
        let mut token = argmax_axis(&logits, -1, false)?;
        token.eval()?;
        let (mut build, mut eval, mut sample) = (vec![], vec![], vec![]);
        for _ in 0..n {
            let t0 = Instant::now();
            let input = token.reshape(&[1, 1])?;
            let logits = model.forward(&input, &mut cache, &AttentionMask::None, false, workers)?;
            let t1 = Instant::now();
            logits.eval()?;
            let t2 = Instant::now();
            token = argmax_axis(logits.reshape(&[1, -1])?, -1, false)?;
            token.eval()?;
            let _id: u32 = token.as_slice::<u32>()[0];
            let t3 = Instant::now();
            build.push((t1 - t0).as_secs_f64() * 1e3);
            eval.push((t2 - t1).as_secs_f64() * 1e3);
            sample.push((t3 - t2).as_secs_f64() * 1e3);
        }
        let step: Vec<f64> = (0..n).map(|i| build[i] + eval[i] + sample[i]).collect();
        if let Ok(path) = std::env::var("BENCH_DOT") {
            // One more step's graph, unevaluated (the cache has room for it).
            let input = token.reshape(&[1, 1])?;
            let logits = model.forward(&input, &mut cache, &AttentionMask::None, false, workers)?;
            export_dot(&path, &logits)?;
        }
        self.emit(
            "profile_step",
            None,
            json!({
                "steps": n,
                "worker_streams": workers.len(),
                "stream": if self.args.default_stream { "default" } else { "own" },
                "graph_build_ms": round(median(&build), 3),
                "eval_ms": round(median(&eval), 3),
                "sample_ms": round(median(&sample), 3),
                "step_ms": round(median(&step), 3),
                "sync_tok_s": round(1e3 / median(&step), 3),
            }),
        );
        Ok(())
    }

    /// The decode loop as `Generation` runs it (the next step queued before
    /// this one is read back), timing per step the graph's construction, its
    /// queuing (MLX encodes every node then) and the wait for the previous
    /// step's token: a wait near zero means the host, not the device, sets
    /// the pace.
    fn profile_queued(&self, workers: &[Lease]) -> AnyResult<()> {
        let model = &self.model;
        let n = self.args.tokens;
        let (mut cache, logits) = self.prefilled(workers)?;
        let mut pending = greedy(&logits)?;
        transforms::async_eval([&pending])?;
        let (mut build, mut queue, mut wait) = (vec![], vec![], vec![]);
        let started = Instant::now();
        for _ in 1..n {
            let t0 = Instant::now();
            let input = pending.reshape(&[1, 1])?;
            let logits = model.forward(&input, &mut cache, &AttentionMask::None, false, workers)?;
            let next = greedy(&logits.reshape(&[1, -1])?)?;
            let t1 = Instant::now();
            transforms::async_eval([&next])?;
            let t2 = Instant::now();
            pending.eval()?;
            let _id: u32 = pending.as_slice::<u32>()[0];
            let t3 = Instant::now();
            pending = next;
            build.push((t1 - t0).as_secs_f64() * 1e3);
            queue.push((t2 - t1).as_secs_f64() * 1e3);
            wait.push((t3 - t2).as_secs_f64() * 1e3);
        }
        pending.eval()?;
        let steps = n.saturating_sub(1).max(1);
        self.emit(
            "profile_queued",
            None,
            json!({
                "steps": steps,
                "build_ms": round(median(&build), 3),
                "queue_ms": round(median(&queue), 3),
                "wait_ms": round(median(&wait), 3),
                "step_ms": round(ms(started) / steps as f64, 3),
                "tok_s": round(steps as f64 / (ms(started) / 1e3), 3),
            }),
        );
        Ok(())
    }

    /// Each kernel of a decode step alone, at the checkpoint's shapes, with
    /// random weights (the speed of these kernels does not depend on values),
    /// whole on one stream (one CPU thread), as mlx-lm runs them.
    fn profile_kernels(&self, context: usize) -> AnyResult<()> {
        let c = &self.model.config;
        let Some(q) = c
            .quantization
            .as_ref()
            .map(|q| q.for_module("model.embed_tokens"))
        else {
            self.emit(
                "profile_kernels",
                None,
                json!({"skipped": "dense checkpoint"}),
            );
            return Ok(());
        };
        let (d, hd) = (c.hidden_size, c.head_dim);
        let (heads, kv_heads, inter) = (c.num_heads, c.num_kv_heads, c.intermediate_size);
        let dtype = self.model.dtype;
        let layers = c.num_layers as f64;
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        let mut random_u32 = |len: usize| -> Vec<u32> {
            (0..len)
                .map(|_| {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng as u32
                })
                .collect()
        };
        let x = |dim: i32| -> AnyResult<Array> {
            Ok(Array::from_slice(&vec![0.01f32; dim as usize], &[1, 1, dim]).as_dtype(dtype)?)
        };
        let mut rows = Vec::new();
        let mut per_token = 0.0;
        let mut ours_per_token = 0.0;
        // As a step reads them: q, k and v stacked, gate and up stacked
        // (ours gives SwiGLU of the two halves).
        let shapes = [
            ("qkv_proj", (heads + 2 * kv_heads) * hd, d, layers, false),
            ("o_proj", d, heads * hd, layers, false),
            ("gate_up_proj", 2 * inter, d, layers, true),
            ("down_proj", d, inter, layers, false),
            ("lm_head", c.vocab_size, d, 1.0, false),
        ];
        for (name, out, inp, times, swiglu) in shapes {
            // In usize: an output head's bits overflow an i32 from a
            // hidden size of 4,096 on.
            let (n, k) = (out as usize, inp as usize);
            let groups = n * k / q.group_size as usize;
            let bytes = n * k * q.bits as usize / 8 + 2 * groups * dtype_bytes(dtype);
            // Enough copies that a chain of products reads more than a
            // GPU's L2 cache holds: each product then reads its weight from
            // memory, as a step's do.
            let copies = (256 << 20) / bytes.max(1);
            let copies = copies.clamp(1, 32);
            let mut weights = Vec::new();
            for _ in 0..copies {
                let w = Array::from_slice(
                    &random_u32(n * k * q.bits as usize / 32),
                    &[out, inp * q.bits / 32],
                );
                let scales = Array::from_slice(&vec![0.01f32; groups], &[out, inp / q.group_size])
                    .as_dtype(dtype)?;
                let biases = Array::from_slice(&vec![-0.05f32; groups], &[out, inp / q.group_size])
                    .as_dtype(dtype)?;
                transforms::eval([&w, &scales, &biases])?;
                weights.push((w, scales, biases));
            }
            let input = x(inp)?;
            input.eval()?;
            let chain = copies.max(8);
            let t = time_chain(chain, |i| {
                let (w, s, b) = &weights[i % copies];
                Ok(quantized_matmul(
                    &input,
                    w,
                    s,
                    b,
                    true,
                    q.group_size,
                    q.bits,
                )?)
            })?;
            let ours = time_chain(chain, |i| {
                let (w, scales, biases) = &weights[i % copies];
                let wt = QuantWeight {
                    w,
                    scales,
                    biases,
                    bits: q.bits,
                    group_size: q.group_size,
                };
                cuda_layer::product(&input, &wt, swiglu)?.ok_or_else(|| "no product kernel".into())
            })
            .ok();
            per_token += t * times;
            ours_per_token += ours.unwrap_or(t) * times;
            let gbps = |ms: f64| bytes as f64 / ms / 1e6;
            rows.push(json!({
                "op": name, "shape": [out, inp], "ms": round(t, 4), "per_token": times,
                "gb_per_s": round(gbps(t), 1),
                "ours_ms": ours.map(|o| round(o, 4)), "ours_gb_per_s": ours.map(|o| round(gbps(o), 1)),
            }));
        }
        let h = x(d)?;
        let norm_w = Array::from_slice(&vec![1.0f32; d as usize], &[d]).as_dtype(dtype)?;
        let t = time_op(|| rms_norm(&h, Some(&norm_w), 1e-6))?;
        per_token += t * (2.0 * layers + 1.0);
        ours_per_token += t * (2.0 * layers + 1.0);
        rows.push(json!({"op": "rms_norm", "shape": [d], "ms": round(t, 4), "per_token": 2.0 * layers + 1.0}));
        let qh = Array::from_slice(&vec![0.01f32; (heads * hd) as usize], &[1, heads, 1, hd])
            .as_dtype(dtype)?;
        let t = time_op(|| rope(&qh, hd, false, c.rope_theta, 1.0, context as i32, None))?;
        per_token += t * 2.0 * layers;
        ours_per_token += t * 2.0 * layers;
        rows.push(json!({"op": "rope", "shape": [heads, hd], "ms": round(t, 4), "per_token": 2.0 * layers}));
        let kv_len = (kv_heads as usize) * context * (hd as usize);
        let keys = Array::from_slice(&vec![0.01f32; kv_len], &[1, kv_heads, context as i32, hd])
            .as_dtype(dtype)?;
        let values = keys.clone();
        let scale = (hd as f32).powf(-0.5);
        let t = time_op(|| scaled_dot_product_attention(&qh, &keys, &values, scale, None, None))?;
        per_token += t * layers;
        ours_per_token += t * layers;
        rows.push(json!({"op": "sdpa", "shape": [heads, context, hd], "ms": round(t, 4), "per_token": layers}));
        for r in rows {
            self.emit("profile_kernel", None, r);
        }
        self.emit(
            "profile_kernels",
            None,
            json!({
                "kernels_per_token_ms": round(per_token, 3),
                "ours_kernels_per_token_ms": round(ours_per_token, 3),
                "context": context,
            }),
        );
        Ok(())
    }
}

extern "C" {
    fn fopen(
        path: *const std::os::raw::c_char,
        mode: *const std::os::raw::c_char,
    ) -> *mut mlx_sys::FILE;
    fn fclose(file: *mut mlx_sys::FILE) -> std::os::raw::c_int;
}

/// Writes the graph that computes `output` in Graphviz form (MLX's
/// `export_to_dot`), to compare it node by node with mlx-lm's.
fn export_dot(path: &str, output: &Array) -> AnyResult<()> {
    let c_path = std::ffi::CString::new(path)?;
    // SAFETY: plain C calls on handles created and freed here; `output`
    // outlives the call.
    unsafe {
        let file = fopen(c_path.as_ptr(), c"w".as_ptr());
        if file.is_null() {
            return Err(format!("cannot write {path}").into());
        }
        let outputs = mlx_sys::mlx_vector_array_new_value(output.as_ptr());
        let namer = mlx_sys::mlx_node_namer_new();
        let status = mlx_sys::mlx_export_to_dot(file, namer, outputs);
        mlx_sys::mlx_node_namer_free(namer);
        mlx_sys::mlx_vector_array_free(outputs);
        fclose(file);
        if status != 0 {
            return Err("mlx_export_to_dot failed".into());
        }
    }
    Ok(())
}

/// Median time of one evaluation of `op`'s result, over repeated runs.
fn time_op(op: impl Fn() -> mlx_rs::error::Result<Array>) -> AnyResult<f64> {
    for _ in 0..3 {
        op()?.eval()?;
    }
    let mut times = Vec::new();
    for _ in 0..15 {
        let y = op()?;
        let t = Instant::now();
        y.eval()?;
        times.push(ms(t));
    }
    Ok(median(&times))
}

/// Milliseconds per op of a chain of `count` ops (`op(i)`), built and
/// evaluated together: one op alone would time MLX's launch and wait more
/// than a kernel of a few microseconds. The median of 7, after 2 warm-ups.
fn time_chain(count: usize, op: impl Fn(usize) -> AnyResult<Array>) -> AnyResult<f64> {
    let mut times = Vec::new();
    for run in 0..9 {
        let ys = (0..count).map(&op).collect::<AnyResult<Vec<_>>>()?;
        let t = Instant::now();
        transforms::eval(&ys)?;
        if run >= 2 {
            times.push(ms(t) / count as f64);
        }
    }
    Ok(median(&times))
}

fn dtype_bytes(dtype: Dtype) -> usize {
    match dtype {
        Dtype::Float32 => 4,
        _ => 2,
    }
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn run(args: Args) -> AnyResult<()> {
    // Before MLX's first call: the engine sizes MLX's command graphs.
    emlx_axon_engine::runtime::device::prepare_mlx();
    // mlx-lm's load timer starts after `import mlx.core`, which has set up
    // the device (on CUDA, 200-400 ms of context and library start-up): one
    // tiny evaluation first puts the engine's load on the same footing, and
    // the set-up is reported on its own.
    let device_started = Instant::now();
    Array::from_f32(1.0).add(Array::from_f32(1.0))?.eval()?;
    let device_setup_ms = ms(device_started);
    let baseline = Memory::status_kb("VmRSS:");
    let started = Instant::now();
    let model = Arc::new(Model::load(
        &args.model,
        &LoadOptions {
            dtype: args.dtype,
            quantize: None,
            cpu_parallel: None,
            ..LoadOptions::default()
        },
    )?);
    let load_ms = ms(started);
    let device = if gpu_available() { "gpu" } else { "cpu" };
    let mut common = Map::new();
    common.insert("peer".into(), json!(args.label));
    if let Some(bits) = args.kv_bits {
        common.insert("kv_bits".into(), json!(bits));
    }
    let s = &args.sampler;
    common.insert(
        "sampler".into(),
        json!(if s.is_greedy() {
            "greedy".to_string()
        } else {
            format!(
                "{:?} t={} top_p={} top_k={} min_p={} seed={:?}",
                s.kind, s.temperature, s.top_p, s.top_k, s.min_p, s.seed
            )
        }),
    );
    common.insert(
        "model".into(),
        json!(args
            .model
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())),
    );
    common.insert(
        "dtype".into(),
        json!(format!("{:?}", model.dtype).to_lowercase()),
    );
    common.insert("device".into(), json!(device));
    let digest = args.prompts.as_ref().map(|p| p.digest.clone());
    let tokenizer = match &args.json_schema {
        Some(_) => Some(Arc::new(Tokenizer::load(&args.model)?)),
        None => None,
    };
    let bench = Bench {
        model,
        tokenizer,
        args,
        common,
    };
    let mut load = Map::new();
    load.insert("load_ms".into(), json!(round(load_ms, 1)));
    load.insert("device_setup_ms".into(), json!(round(device_setup_ms, 1)));
    load.insert(
        "engine_load_ms".into(),
        json!(round(bench.model.load_ms, 1)),
    );
    load.insert("weight_bytes".into(), json!(bench.model.weight_bytes));
    load.insert(
        "cpu_worker_streams".into(),
        json!(bench.model.parallel_ways),
    );
    load.insert(
        "rss_before_load_mb".into(),
        json!(baseline.map(|kb| round(kb / 1024.0, 1))),
    );
    load.insert("mlx_version".into(), json!(mlx_version()));
    load.insert("prompts_sha256".into(), json!(digest));
    Memory::record(&mut load);
    bench.emit("load", None, Value::Object(load));

    bench.warm_up()?;
    for run in 0..bench.args.runs {
        if bench.wants("decode") {
            bench.decode(run)?;
        }
        if bench.wants("prefill") {
            bench.prefill(run)?;
        }
        if bench.wants("batch") {
            for &b in &bench.args.batches {
                bench.batch(run, b)?;
            }
        }
        if bench.wants("scheduler") {
            for &b in &bench.args.batches {
                bench.scheduler(run, b)?;
            }
        }
    }
    if bench.wants("profile") {
        bench.profile()?;
    }
    Ok(())
}

fn main() -> ExitCode {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

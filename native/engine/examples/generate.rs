//! Generate text from a checkpoint folder with the engine alone.
//!
//! cargo run --release --example generate -- --model DIR [options]; `--help` lists them.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use emlx_axon_engine::{
    GenerateOptions, Generation, LoadOptions, Model, QuantSpec, SamplerKind, Tokenizer,
};
use serde_json::json;

const USAGE: &str = "\
Usage: generate --model DIR [options]

Options:
  --model DIR              checkpoint folder (config.json, *.safetensors, tokenizer.json)
  --prompt TEXT            the prompt (default: \"The quick brown fox\")
  --prompt-ids 1,2,3       a tokenized prompt, instead of --prompt
  --chat                   render the prompt with the chat template, as a user message
  --max-new-tokens N       tokens to generate (default 32)
  --max-len N              KV cache length per prompt, prompt included (default 2048)
  --sampler NAME           greedy (default), top_p_cpu or top_p_gpu
  --temperature T          sampling temperature
  --top-p P, --top-k K, --min-p P, --seed S
  --ignore-eos             generate past the end-of-sequence token
  --quantize BITS:GROUP    quantize a dense checkpoint while loading, e.g. 4:64
  --json                   print one JSON object (ids, text, finish reason, timings)
  --help                   print this
";

struct Args {
    model: PathBuf,
    prompt: Option<String>,
    prompt_ids: Option<Vec<u32>>,
    chat: bool,
    json: bool,
    quantize: Option<QuantSpec>,
    options: GenerateOptions,
}

fn parse() -> Result<Args, String> {
    let mut args = Args {
        model: PathBuf::new(),
        prompt: None,
        prompt_ids: None,
        chat: false,
        json: false,
        quantize: None,
        options: GenerateOptions {
            max_new_tokens: 32,
            ..GenerateOptions::default()
        },
    };
    let mut it = std::env::args().skip(1);
    let num = |v: Option<String>, name: &str| -> Result<f64, String> {
        v.as_deref()
            .and_then(|s| s.parse().ok())
            .ok_or(format!("{name} needs a number"))
    };
    while let Some(flag) = it.next() {
        let s = &mut args.options.sampler;
        match flag.as_str() {
            "--model" => args.model = it.next().ok_or("--model needs a folder")?.into(),
            "--prompt" => args.prompt = it.next(),
            "--prompt-ids" => {
                let list = it.next().ok_or("--prompt-ids needs ids")?;
                let ids = list
                    .split(',')
                    .map(|x| x.trim().parse::<u32>())
                    .collect::<Result<Vec<_>, _>>();
                args.prompt_ids = Some(ids.map_err(|_| "--prompt-ids takes comma-separated ids")?);
            }
            "--chat" => args.chat = true,
            "--json" => args.json = true,
            "--ignore-eos" => args.options.ignore_eos = true,
            "--help" | "-h" => {
                print!("{USAGE}");
                std::process::exit(0);
            }
            "--max-new-tokens" => args.options.max_new_tokens = num(it.next(), &flag)? as usize,
            "--max-len" => args.options.max_len = num(it.next(), &flag)? as usize,
            "--temperature" => s.temperature = num(it.next(), &flag)? as f32,
            "--top-p" => s.top_p = num(it.next(), &flag)? as f32,
            "--top-k" => s.top_k = num(it.next(), &flag)? as usize,
            "--min-p" => s.min_p = num(it.next(), &flag)? as f32,
            "--seed" => s.seed = Some(num(it.next(), &flag)? as u64),
            "--sampler" => {
                s.kind = match it.next().as_deref() {
                    Some("greedy") => SamplerKind::Greedy,
                    Some("top_p_cpu") => SamplerKind::TopPCpu,
                    Some("top_p_gpu") => SamplerKind::TopPGpu,
                    other => {
                        return Err(format!(
                            "--sampler takes greedy, top_p_cpu or top_p_gpu, got {}",
                            other.unwrap_or("nothing")
                        ))
                    }
                }
            }
            "--quantize" => {
                let spec = it.next().ok_or("--quantize needs BITS:GROUP")?;
                let (b, g) = spec
                    .split_once(':')
                    .ok_or("--quantize takes BITS:GROUP, e.g. 4:128")?;
                let parsed = (b.parse(), g.parse());
                let (Ok(b), Ok(g)) = parsed else {
                    return Err("--quantize takes BITS:GROUP".into());
                };
                args.quantize = Some(QuantSpec::new(b, g).map_err(|e| e.to_string())?);
            }
            other => return Err(format!("unknown flag {other}\n\n{USAGE}")),
        }
    }
    if args.model.as_os_str().is_empty() {
        return Err(format!("--model DIR is required\n\n{USAGE}"));
    }
    Ok(args)
}

fn run(args: Args) -> emlx_axon_engine::Result<()> {
    let model = Arc::new(Model::load(
        &args.model,
        &LoadOptions {
            dtype: None,
            quantize: args.quantize,
            cpu_parallel: None,
            ..LoadOptions::default()
        },
    )?);
    let tokenizer = Arc::new(Tokenizer::load(&args.model)?);
    let prompt_ids = match (&args.prompt_ids, &args.prompt) {
        (Some(ids), _) => ids.clone(),
        (None, prompt) => {
            let text = prompt
                .clone()
                .unwrap_or_else(|| "The quick brown fox".into());
            let text = if args.chat {
                tokenizer.apply_chat_template(
                    &json!([{"role": "user", "content": text}]),
                    true,
                    None,
                )?
            } else {
                text
            };
            tokenizer.encode(&text, false)?
        }
    };
    let mut generation = Generation::start(
        model,
        Some(tokenizer),
        None,
        std::slice::from_ref(&prompt_ids),
        args.options,
    )?;
    let mut text = String::new();
    let mut finish = None;
    while !generation.is_done() {
        let delta = generation.next(1)?.remove(0);
        if !args.json {
            print!("{}", delta.text);
            std::io::stdout().flush().ok();
        }
        text.push_str(&delta.text);
        finish = delta.finish.or(finish);
    }
    let stats = generation.stats();
    let finish = finish.map(|f| f.name()).unwrap_or("length");
    if args.json {
        let out = json!({
            "prompt_ids": prompt_ids,
            "generated_ids": generation.generated()[0],
            "text": text,
            "finish_reason": finish,
            "prefill_ms": stats.prefill_ms,
            "time_to_first_token_ms": stats.time_to_first_token_ms,
            "decode_tokens_per_s": stats.decode_tokens_per_s,
        });
        println!("{out}");
    } else {
        println!(
            "\n[{} tokens, finish {finish}; prefill {:.1} ms, decode {:.1} tokens/s]",
            stats.generated_tokens[0], stats.prefill_ms, stats.decode_tokens_per_s
        );
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
            eprintln!("error ({}): {e}", e.kind());
            ExitCode::FAILURE
        }
    }
}

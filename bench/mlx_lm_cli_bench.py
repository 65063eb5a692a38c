"""The mlx-lm CLI peer of the benchmarks: `python -m mlx_lm generate` as
users run it, one fresh process per prompt and run, its own printed figures
read back, one JSON object per measurement on stdout.

Usage:
    .venv/bin/python bench/mlx_lm_cli_bench.py --model DIR --prompts FILE
        [--tokens N] [--measures decode,prefill] [--runs R] [--label mlx-lm-cli]

The prompt ids go in as their decoded text with --ignore-chat-template; each
row says whether the tokenizer encodes that text back to the same ids. The
CLI has no warm-up, runs the checkpoint's own dtype and cannot ignore EOS (a
row says how many tokens came). Its rates are mlx-lm's: the prompt rate is
prompt tokens / time to the first token, as everywhere here; the generation
rate counts n tokens over the span from the first to the last, so it is
rescaled by (n - 1) / n to the definition the other peers use. This wrapper
imports no MLX itself: the time it adds is a tokenizer load.
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

PROMPT = re.compile(r"^Prompt: (\d+) tokens, ([\d.]+) tokens-per-sec", re.M)
GENERATION = re.compile(r"^Generation: (\d+) tokens, ([\d.]+) tokens-per-sec", re.M)
PEAK = re.compile(r"^Peak memory: ([\d.]+) GB", re.M)


def last(pattern, text):
    """The statistics follow the generated text: the last match is theirs."""
    matches = list(pattern.finditer(text))
    return matches[-1] if matches else None


def generate(args, tokenizer, ids, max_tokens):
    text = tokenizer.decode(ids, skip_special_tokens=False)
    same = tokenizer.encode(text, add_special_tokens=True).ids == list(ids)
    command = [sys.executable, "-m", "mlx_lm", "generate", "--model", args.model, "--prompt", "-",
               "--max-tokens", str(max_tokens), "--ignore-chat-template", "--temp", "0"]
    started = time.perf_counter()
    done = subprocess.run(command, input=text, capture_output=True, text=True)
    wall = time.perf_counter() - started
    p, g, peak = last(PROMPT, done.stdout), last(GENERATION, done.stdout), last(PEAK, done.stdout)
    if done.returncode != 0 or not (p and g):
        sys.stderr.write(done.stderr[-2000:] + done.stdout[-500:])
        raise SystemExit(f"python -m mlx_lm generate failed (exit {done.returncode})")
    prompt_tokens, prompt_tps = int(p.group(1)), float(p.group(2))
    return {
        "prompt_tokens": prompt_tokens,
        "ttft_ms": round(prompt_tokens / prompt_tps * 1e3, 2),
        "prompt_tps": prompt_tps,
        "generated": int(g.group(1)),
        "generation_tps": float(g.group(2)),
        # MLX's peak memory, printed in GB (10^9 bytes), in MiB as the other peers report it.
        "mlx_peak_mb": round(float(peak.group(1)) * 1e9 / 2**20, 1) if peak else None,
        "process_wall_s": round(wall, 3),
        "prompt_ids_match": same,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--measures", default="decode")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--label", default="mlx-lm-cli")
    args = parser.parse_args()
    measures = args.measures.split(",")
    unknown = [m for m in measures if m not in ("decode", "prefill")]
    if unknown or args.tokens < 2:
        raise SystemExit(f"--measures takes decode and/or prefill (not {unknown}); --tokens at least 2")
    prompts = json.loads(Path(args.prompts).read_text())
    tokenizer = Tokenizer.from_file(str(Path(args.model) / "tokenizer.json"))
    common = {"peer": args.label, "model": Path(args.model).name, "path": "python -m mlx_lm generate"}
    keep = ("prompt_tokens", "ttft_ms", "mlx_peak_mb", "process_wall_s", "prompt_ids_match")
    for run in range(args.runs):
        if "decode" in measures:
            r = generate(args, tokenizer, prompts["decode"], args.tokens)
            n = r["generated"]
            row = dict(common, measure="decode", run=run, batch=1, tokens=n,
                       tok_s=round(r["generation_tps"] * (n - 1) / n, 3) if n > 1 else None,
                       mlx_lm_generation_tps=r["generation_tps"], complete=n == args.tokens)
            row.update((k, r[k]) for k in keep)
            print(json.dumps(row), flush=True)
        if "prefill" in measures:
            r = generate(args, tokenizer, prompts["prefill"], 2)
            row = dict(common, measure="prefill", run=run, batch=1, tok_s=r["prompt_tps"])
            row.update((k, r[k]) for k in keep)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""The llama.cpp peer of the CPU benchmarks (through llama-cpp-python): the
same measurements as the engine's `bench` example on a GGUF of the same
weights (bench/make_gguf.py), the same prompt ids, greedy, one JSON object per
measurement on stdout.

Usage:
    .venv/bin/python bench/llama_cpp_bench.py --gguf FILE --prompts FILE
        [--threads N] [--tokens N] [--measures decode,prefill]
        [--warmup K] [--runs R] [--label llama.cpp] [--model NAME]

Definitions (wall clock, identical to the engine's):
    decode   (tokens - 1) / (time of last token - time of first)
    prefill  prompt tokens / time to first token
Generation is Llama.generate with temp 0 (llama.cpp's greedy sampler), fed
token ids; EOS is not looked at, so every run decodes exactly --tokens
tokens. The context is reset before each generation so no KV entry of an
earlier prompt is reused.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from llama_cpp import Llama, __version__ as llama_cpp_version


def status_mb(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def kv_cache(kind):
    """Llama() settings for a KV cache of `kind`: llama.cpp's default f16, or
    q8_0 keys and values (GGML_TYPE_Q8_0), which llama.cpp reads only with
    flash attention."""
    if kind == "f16":
        return {}
    return {"type_k": 8, "type_v": 8, "flash_attn": True}


class Bench:
    def __init__(self, args):
        self.args = args
        prompts = json.loads(Path(args.prompts).read_text())
        self.decode_prompt = prompts["decode"]
        self.prefill_prompt = prompts["prefill"]
        self.digest = prompts.get("sha256")
        self.rss_before_load = status_mb("VmRSS:")
        started = time.perf_counter()
        n_ctx = max(len(self.decode_prompt), len(self.prefill_prompt)) + args.tokens + 16
        self.llm = Llama(
            model_path=str(args.gguf),
            n_ctx=n_ctx,
            n_batch=512,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            verbose=False,
            **kv_cache(args.kv),
        )
        self.load_ms = (time.perf_counter() - started) * 1e3
        self.common = {"peer": args.label, "model": args.model, "dtype": "q4_0", "device": "cpu",
                       "threads": args.threads, "kv_cache": args.kv}

    def emit(self, measure, run=None, **fields):
        out = dict(self.common, measure=measure)
        if run is not None:
            out["run"] = run
        out.update(fields)
        print(json.dumps(out), flush=True)

    def generate(self, prompt, tokens):
        """One generation; returns (ttft_ms, decode_ms, ids)."""
        self.llm.reset()
        started = time.perf_counter()
        first = last = None
        ids = []
        for token in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
            ids.append(int(token))
            if len(ids) == tokens:
                break
        return (first - started) * 1e3, (last - first) * 1e3, ids

    def memory(self):
        return {"peak_rss_mb": status_mb("VmHWM:"), "rss_mb": status_mb("VmRSS:")}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--measures", default="decode,prefill")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--label", default="llama.cpp")
    parser.add_argument("--model", default="")
    parser.add_argument("--kv", choices=["f16", "q8_0"], default="f16",
                        help="the KV cache's type (q8_0 needs flash attention, which it turns on)")
    args = parser.parse_args()
    measures = args.measures.split(",")
    if args.tokens < 2:
        raise SystemExit("--tokens must be at least 2")
    bench = Bench(args)
    bench.emit("load", load_ms=round(bench.load_ms, 1), llama_cpp_python=llama_cpp_version,
               prompts_sha256=bench.digest, rss_before_load_mb=bench.rss_before_load, **bench.memory())
    started = time.perf_counter()
    for _ in range(args.warmup):
        bench.generate(bench.decode_prompt[:2], 2)
    bench.emit("warmup", iterations=args.warmup, mode="light",
               wall_ms=round((time.perf_counter() - started) * 1e3, 1))
    for run in range(args.runs):
        if "decode" in measures:
            reset_peak()
            ttft, decode_ms, ids = bench.generate(bench.decode_prompt, args.tokens)
            bench.emit("decode", run, batch=1, prompt_tokens=len(bench.decode_prompt), tokens=args.tokens,
                       tok_s=round((args.tokens - 1) / (decode_ms / 1e3), 3), ttft_ms=round(ttft, 2),
                       decode_ms=round(decode_ms, 2), ids=ids, **bench.memory())
        if "prefill" in measures:
            reset_peak()
            ttft, _, _ = bench.generate(bench.prefill_prompt, 2)
            bench.emit("prefill", run, batch=1, prompt_tokens=len(bench.prefill_prompt),
                       tok_s=round(len(bench.prefill_prompt) / (ttft / 1e3), 3), ttft_ms=round(ttft, 2),
                       **bench.memory())


if __name__ == "__main__":
    sys.exit(main())

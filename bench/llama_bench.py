"""The llama.cpp peer on a GPU: a prebuilt `llama-bench` (llama.cpp's own
benchmark, built with CUDA) on the Q4_0 GGUF of the same weights, every
layer on the GPU, flash attention on; one JSON object per measurement on
stdout, as the engine's `bench` example writes them.

Usage:
    python3 bench/llama_bench.py --bin PATH --gguf FILE --prompts FILE
        [--tokens N] [--runs R] [--label llama.cpp] [--model NAME]

Definitions (llama-bench's own, per repetition):
    decode   --tokens generated tokens after a context of the decode
             prompt's length (`-n tokens -d decode_len`) / their time
    prefill  the prefill prompt's length in tokens (`-p len`) / its time
llama-bench feeds its own token ids of the same counts and prints no text,
so this peer has no greedy ids and no time to first token; its repetitions
(`-r runs`) are its trials, after its own warmup run.
"""

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--bin", required=True)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--label", default="llama.cpp")
    parser.add_argument("--model", default="")
    args = parser.parse_args()
    prompts = json.loads(Path(args.prompts).read_text())
    decode_len, prefill_len = len(prompts["decode"]), len(prompts["prefill"])
    common = {"peer": args.label, "model": args.model, "dtype": "q4_0", "device": "gpu"}

    def emit(measure, run=None, **fields):
        out = dict(common, measure=measure)
        if run is not None:
            out["run"] = run
        out.update(fields)
        print(json.dumps(out), flush=True)

    def bench(*flags):
        command = [args.bin, "-m", str(args.gguf), "-ngl", "99", "-fa", "1", "-r", str(args.runs),
                   "-o", "json", *flags]
        started = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        return json.loads(done.stdout)[0], (time.perf_counter() - started) * 1e3

    decode, decode_wall = bench("-p", "0", "-n", str(args.tokens), "-d", str(decode_len))
    prefill, _ = bench("-p", str(prefill_len), "-n", "0")
    emit("load", llama_cpp_build=decode.get("build_commit"), gpu_info=decode.get("gpu_info"),
         prompts_sha256=prompts.get("sha256"), process_wall_ms=round(decode_wall, 1))
    for run, ns in enumerate(decode["samples_ns"]):
        emit("decode", run, batch=1, prompt_tokens=decode_len, tokens=args.tokens,
             tok_s=round(args.tokens / (ns / 1e9), 3), decode_ms=round(ns / 1e6, 2))
    for run, ns in enumerate(prefill["samples_ns"]):
        emit("prefill", run, batch=1, prompt_tokens=prefill_len,
             tok_s=round(prefill_len / (ns / 1e9), 3))


if __name__ == "__main__":
    sys.exit(main())

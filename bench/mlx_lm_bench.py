"""The mlx-lm peer of the benchmarks: the same measurements as the engine's
`bench` example, on the same checkpoint folder and the same prompt ids, one
JSON object per measurement on stdout.

Usage:
    .venv/bin/python bench/mlx_lm_bench.py --model DIR --prompts FILE
        [--dtype float32|bfloat16|float16] [--tokens N] [--batch-tokens N]
        [--batch 1,4,8] [--measures decode,prefill,batch,profile]
        [--warmup K] [--warmup-mode full|light] [--runs R] [--label mlx-lm]
        [--path generate_step|stream_generate]

Two ways into mlx-lm (--path; bench/mlx_lm_cli_bench.py runs its CLI):
  generate_step    (default) mlx_lm.generate.generate_step, which yields
                   exactly `max_tokens` tokens and never looks at EOS, with
                   mlx-lm's greedy sampler; batches use
                   mlx_lm.generate.BatchGenerator (the engine of
                   batch_generate) with no stop tokens and a completion
                   batch as large as the batch
  stream_generate  mlx_lm.stream_generate with the checkpoint's tokenizer,
                   as applications call it (detokenizing as it goes), its
                   EOS set emptied as `mlx_lm benchmark` does; decode and
                   prefill only
--runs R repeats every measure R times in the same process (trials).
Definitions (wall clock, identical to the engine's):
    decode   (tokens - 1) / (time of last token - time of first)
    prefill  prompt tokens / time to first token
    batch    rows x (tokens - 1) / (time of last step - time of first)
The model is cast to --dtype (default float32 on the CPU, bfloat16 on a GPU)
with Module.set_dtype, which casts norms, scales and biases and leaves the
packed weights alone, as the engine's loader does.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator, generate_step, stream_generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load_model, load_tokenizer

import mlx_compat

# Qwen3-MoE's quantized experts under this MLX.
mlx_compat.patch()

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def status_mb(key):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def reset_memory():
    """Free MLX's buffer cache and reset both peaks."""
    mx.clear_cache()
    mx.reset_peak_memory()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM (Linux 4.0+)
    except OSError:
        pass


def memory_fields():
    return {
        "peak_rss_mb": status_mb("VmHWM:"),
        "rss_mb": status_mb("VmRSS:"),
        "mlx_peak_mb": round(mx.get_peak_memory() / 2**20, 1),
    }


def median(values):
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


class Bench:
    def __init__(self, args):
        self.args = args
        prompts = json.loads(Path(args.prompts).read_text())
        self.decode_prompt = prompts["decode"]
        self.prefill_prompt = prompts["prefill"]
        self.batch_rows = prompts["batch"]
        self.digest = prompts.get("sha256")
        self.sampler = make_sampler(temp=0.0)  # greedy: argmax
        self.rss_before_load = status_mb("VmRSS:")
        started = time.perf_counter()
        self.model, self.config = load_model(Path(args.model))
        dtype = args.dtype or ("bfloat16" if mx.default_device() == mx.gpu else "float32")
        self.model.set_dtype(DTYPES[dtype])
        mx.eval(self.model.parameters())
        self.load_ms = (time.perf_counter() - started) * 1e3
        self.tokenizer = None
        if args.path == "stream_generate":
            started = time.perf_counter()
            self.tokenizer = load_tokenizer(Path(args.model))
            self.tokenizer._eos_token_ids = set()  # EOS ignored, as in `mlx_lm benchmark`
            self.tokenizer_ms = (time.perf_counter() - started) * 1e3
        self.common = {
            "peer": args.label,
            "model": Path(args.model).name,
            "dtype": dtype,
            "device": "gpu" if mx.default_device() == mx.gpu else "cpu",
        }

    def emit(self, measure, run=None, **fields):
        out = dict(self.common, measure=measure)
        if run is not None:
            out["run"] = run
        out.update(fields)
        print(json.dumps(out), flush=True)

    def wants(self, measure):
        return measure in self.args.measures

    def generate(self, prompt, tokens):
        """One batch-1 generation; returns (ttft_ms, decode_ms, ids)."""
        if self.tokenizer is not None:
            return self.generate_stream(prompt, tokens)
        started = time.perf_counter()
        first = last = None
        ids = []
        for token, _ in generate_step(mx.array(prompt), self.model, max_tokens=tokens, sampler=self.sampler):
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
            ids.append(int(token))
        if len(ids) != tokens:
            raise SystemExit(f"expected {tokens} tokens, got {len(ids)}")
        return (first - started) * 1e3, (last - first) * 1e3, ids

    def generate_stream(self, prompt, tokens):
        """generate(), through stream_generate: each response stamped as it
        arrives, as an application reading the stream sees it."""
        started = time.perf_counter()
        first = last = None
        ids = []
        for response in stream_generate(self.model, self.tokenizer, prompt, max_tokens=tokens, sampler=self.sampler):
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
            ids.append(int(response.token))
        if len(ids) != tokens:
            raise SystemExit(f"expected {tokens} tokens, got {len(ids)}")
        return (first - started) * 1e3, (last - first) * 1e3, ids

    def generate_batch(self, prompts, tokens):
        """One batched generation; returns (ttft_ms, decode_ms, generated)."""
        started = time.perf_counter()
        gen = BatchGenerator(
            self.model,
            max_tokens=tokens,
            stop_tokens=None,
            sampler=self.sampler,
            completion_batch_size=len(prompts),
            prefill_batch_size=len(prompts),
        )
        gen.insert(prompts, max_tokens=[tokens] * len(prompts))
        first = last = None
        counts = [0] * len(prompts)
        uid_index = {}
        done = 0
        while done < len(prompts):
            responses = gen.next_generated()
            if not responses:
                break
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
            for r in responses:
                i = uid_index.setdefault(r.uid, len(uid_index))
                counts[i] += 1
                if r.finish_reason is not None:
                    done += 1
        gen.close()
        if any(c != tokens for c in counts):
            raise SystemExit(f"expected {tokens} tokens per row, got {counts}")
        return (first - started) * 1e3, (last - first) * 1e3, sum(counts)

    def batch_prompts(self, batch):
        return [self.batch_rows[i % len(self.batch_rows)] for i in range(batch)]

    def kv_bytes(self, rows, positions):
        # mlx-lm's KVCache grows in steps of 256 positions.
        c = self.config
        steps = -(-positions // 256) * 256
        item = 4 if self.common["dtype"] == "float32" else 2
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return 2 * c["num_hidden_layers"] * rows * c["num_key_value_heads"] * steps * head_dim * item

    def warm_up(self):
        """Full: every measure once, shortened. Light (for slow CPUs): a 2-token
        prompt decoding 2 tokens, then the largest batch likewise."""
        started = time.perf_counter()
        largest = max(self.args.batch or [1])
        for _ in range(self.args.warmup):
            if self.args.warmup_mode == "light":
                self.generate(self.decode_prompt[:2], 2)
                if self.wants("batch") and largest > 1:
                    self.generate_batch([p[:2] for p in self.batch_prompts(largest)], 2)
                continue
            if self.wants("decode"):
                self.generate(self.decode_prompt, 4)
            if self.wants("prefill"):
                self.generate(self.prefill_prompt, 2)
            if self.wants("batch"):
                for b in self.args.batch:
                    if b > 1:
                        self.generate_batch(self.batch_prompts(b), 2)
                    else:
                        self.generate(self.batch_rows[0], 2)
        self.emit(
            "warmup", iterations=self.args.warmup, mode=self.args.warmup_mode,
            wall_ms=round((time.perf_counter() - started) * 1e3, 1),
        )

    def decode(self, run):
        n = self.args.tokens
        reset_memory()
        ttft, decode_ms, ids = self.generate(self.decode_prompt, n)
        self.emit(
            "decode", run, batch=1, prompt_tokens=len(self.decode_prompt), tokens=n,
            tok_s=round((n - 1) / (decode_ms / 1e3), 3), ttft_ms=round(ttft, 2),
            decode_ms=round(decode_ms, 2), kv_bytes=self.kv_bytes(1, len(self.decode_prompt) + n),
            ids=ids, **memory_fields(),
        )

    def prefill(self, run):
        prompt = self.prefill_prompt
        reset_memory()
        ttft, _, _ = self.generate(prompt, 2)
        self.emit(
            "prefill", run, batch=1, prompt_tokens=len(prompt),
            tok_s=round(len(prompt) / (ttft / 1e3), 3), ttft_ms=round(ttft, 2),
            kv_bytes=self.kv_bytes(1, len(prompt) + 2), **memory_fields(),
        )

    def batch(self, run, batch):
        n = self.args.batch_tokens
        prompts = self.batch_prompts(batch)
        reset_memory()
        if batch == 1:
            # generate_step is mlx-lm's batch-1 path; BatchGenerator is slower there.
            ttft, decode_ms, _ = self.generate(prompts[0], n)
            generated, path = n, "generate_step"
        else:
            ttft, decode_ms, generated = self.generate_batch(prompts, n)
            path = "BatchGenerator"
        self.emit(
            "batch", run, batch=batch, prompt_tokens=len(prompts[0]), tokens=n, generated=generated,
            tok_s=round(batch * (n - 1) / (decode_ms / 1e3), 3), ttft_ms=round(ttft, 2),
            decode_ms=round(decode_ms, 2), path=path,
            kv_bytes=self.kv_bytes(batch, len(prompts[0]) + n), **memory_fields(),
        )

    def profile(self):
        """A decode loop run by hand: graph construction (the model call),
        evaluation and greedy sampling timed separately and synchronously."""
        n = self.args.tokens
        cache = make_prompt_cache(self.model)
        logits = self.model(mx.array(self.decode_prompt)[None], cache=cache)
        y = mx.argmax(logits[:, -1, :], axis=-1)
        mx.eval(y)
        build, evals, sample = [], [], []
        for _ in range(n):
            t0 = time.perf_counter()
            logits = self.model(y[:, None], cache=cache)
            t1 = time.perf_counter()
            mx.eval(logits)
            t2 = time.perf_counter()
            y = mx.argmax(logits[:, -1, :], axis=-1)
            y.item()
            t3 = time.perf_counter()
            build.append((t1 - t0) * 1e3)
            evals.append((t2 - t1) * 1e3)
            sample.append((t3 - t2) * 1e3)
        step = [a + b + c for a, b, c in zip(build, evals, sample)]
        if os.environ.get("BENCH_DOT"):
            # One more step's graph, unevaluated, to compare with the engine's.
            mx.export_to_dot(os.environ["BENCH_DOT"], self.model(y[:, None], cache=cache))
        self.emit(
            "profile_step", steps=n, graph_build_ms=round(median(build), 3), eval_ms=round(median(evals), 3),
            sample_ms=round(median(sample), 3), step_ms=round(median(step), 3),
            sync_tok_s=round(1e3 / median(step), 3),
        )
        # The decode prompt, then the prefill prompt too when extrapolating
        # from the first says its 6 passes take under ~20 s.
        whole_ms = self.profile_prefill(self.decode_prompt)
        scale = len(self.prefill_prompt) / max(len(self.decode_prompt), 1)
        if len(self.prefill_prompt) > len(self.decode_prompt) and whole_ms * scale * 6 < 20_000:
            self.profile_prefill(self.prefill_prompt)

    def profile_prefill(self, prompt, runs=3):
        """Prefill two ways: the whole prompt, then the output projection of
        its last row (the engine's way), against generate_step's way: the
        prompt but its last token with only the KV cache evaluated, then the
        last token."""
        ids = mx.array(prompt)[None]
        tied = self.config.get("tie_word_embeddings", False)
        head = self.model.model.embed_tokens.as_linear if tied else self.model.lm_head

        def whole():
            cache = make_prompt_cache(self.model)
            h = self.model.model(ids, cache=cache)[:, -1:, :]
            mx.eval(mx.argmax(head(h), axis=-1))

        def split():
            cache = make_prompt_cache(self.model)
            self.model(ids[:, :-1], cache=cache)
            mx.eval([c.state for c in cache])
            mx.eval(mx.argmax(self.model(ids[:, -1:], cache=cache)[:, -1, :], axis=-1))

        times = {}
        for name, fn in (("whole", whole), ("split", split)):
            samples = []
            for _ in range(runs):
                t = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t) * 1e3)
            times[name] = median(samples)
        self.emit(
            "profile_prefill", prompt_tokens=len(prompt), runs=runs,
            whole_ms=round(times["whole"], 2), split_ms=round(times["split"], 2),
        )
        return times["whole"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--batch-tokens", type=int)
    parser.add_argument("--batch", default="1,4,8")
    parser.add_argument("--measures", default="decode,prefill,batch")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--warmup-mode", choices=["full", "light"], default="full")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--label", default="mlx-lm")
    parser.add_argument("--path", choices=["generate_step", "stream_generate"], default="generate_step")
    args = parser.parse_args()
    args.batch = [int(b) for b in args.batch.split(",") if b]
    args.measures = args.measures.split(",")
    args.batch_tokens = args.batch_tokens or args.tokens
    if args.tokens < 2 or args.batch_tokens < 2:
        raise SystemExit("--tokens and --batch-tokens must be at least 2")
    if args.path != "generate_step":
        args.measures = [m for m in args.measures if m in ("decode", "prefill")]

    bench = Bench(args)
    extra = {"tokenizer_ms": round(bench.tokenizer_ms, 1)} if bench.tokenizer is not None else {}
    bench.emit(
        "load", **extra, load_ms=round(bench.load_ms, 1), mlx_version=mx.__version__, path=args.path,
        prompts_sha256=bench.digest, resident_param_bytes=sum(v.nbytes for _, v in tree_flatten(bench.model.parameters())),
        rss_before_load_mb=bench.rss_before_load, **memory_fields(),
    )
    bench.warm_up()
    for run in range(args.runs):
        if bench.wants("decode"):
            bench.decode(run)
        if bench.wants("prefill"):
            bench.prefill(run)
        if bench.wants("batch"):
            for b in args.batch:
                bench.batch(run, b)
    if bench.wants("profile"):
        bench.profile()


if __name__ == "__main__":
    sys.exit(main())

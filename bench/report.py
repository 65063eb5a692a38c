"""Collects the JSON lines of one bench/run and writes the report: a table of
medians and ratios on stdout, bench/RESULTS.md and bench/results.png.

Usage (bench/run calls it):
    .venv/bin/python bench/report.py --out-dir DIR [--results bench/RESULTS.md]
        [--plot bench/results.png]

DIR holds one folder per checkpoint, each with REP-PEER.jsonl files (one
per process: repetition REP of PEER; with --trials, one row per measure and
trial, a process's figure being the median of its trials), profile-PEER.jsonl, settings.json
(the run's settings), and DIR/machine.json (machine and versions).
Every figure comes from those files; ratios compare peers of the same run.
"""

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

from make_checkpoint import sparse_layers

ROOT = Path(__file__).resolve().parent.parent

PEER_ORDER = ["rust", "rust-mlx-steps", "rust-mlx-prompt", "rust-sampled", "rust-sampled-device", "rust-structured", "rust-structured-1t", "rust-kv16", "rust-kv32", "rust-kv8", "rust-baseline", "rust-ops", "rust-mlx-products", "rust-1t", "rust-int8", "rust-int8-kv16", "elixir", "elixir-textgen", "mlx-lm", "mlx-lm-stream",
              "mlx-lm-cli", "llama.cpp", "llama.cpp-kv8"]
PEER_NAMES = {
    "rust": "Rust engine",
    "rust-mlx-steps": "Rust engine, decode steps in MLX's graph (step replay off)",
    "rust-mlx-prompt": "Rust engine, prompts through MLX's ops (prompt kernels off)",
    "rust-baseline": "Rust engine, baseline build",
    "rust-sampled": "Rust engine, Qwen3 sampling (host)",
    "rust-sampled-device": "Rust engine, Qwen3 sampling (device)",
    "rust-structured": "Rust engine, structured output (JSON Schema)",
    "rust-structured-1t": "Rust engine, structured output, masks on 1 thread",
    "rust-kv16": "Rust engine, float16 KV cache",
    "rust-kv32": "Rust engine, float32 KV cache",
    "rust-kv8": "Rust engine, 8-bit KV cache",
    "llama.cpp-kv8": "llama.cpp, q8_0 KV cache",
    "rust-ops": "Rust engine, layers from MLX's ops (fused GPU layer kernels off)",
    "rust-mlx-products": "Rust engine, fused GPU layers with MLX's quantized products",
    "mlx-lm-stream": "mlx-lm (stream_generate)",
    "mlx-lm-cli": "mlx-lm (python -m mlx_lm generate)",
    "rust-1t": "Rust engine, 1 thread",
    "rust-int8": "Rust engine, int8 activations (opt-in)",
    "rust-int8-kv16": "Rust engine, int8 activations (opt-in), float16 KV cache",
    "llama.cpp": "llama.cpp (Q4_0 GGUF)",
    "elixir": "Elixir (Generate.generate)",
    "elixir-textgen": "Elixir (TextGeneration.stream)",
    "mlx-lm": "mlx-lm",
}
OURS = ["rust", "rust-mlx-steps", "rust-mlx-prompt", "rust-sampled", "rust-sampled-device", "rust-structured", "rust-structured-1t", "rust-kv16", "rust-kv32", "rust-kv8", "rust-baseline", "rust-ops", "rust-mlx-products", "rust-1t", "rust-int8", "rust-int8-kv16", "elixir", "elixir-textgen"]
MLX_LM = ["mlx-lm", "mlx-lm-stream", "mlx-lm-cli"]
# The engine under its GPU-relevant settings, each set against the mlx-lm paths.
ENGINE_VARIANTS = ["rust", "rust-sampled", "rust-sampled-device", "rust-structured", "rust-structured-1t", "rust-kv16", "rust-kv32", "rust-kv8", "rust-baseline", "rust-mlx-steps", "rust-mlx-prompt", "rust-ops", "rust-mlx-products"]
BEST_MLX = "best mlx-lm path"


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(x, digits=None):
    if x is None:
        return "n/a"
    if isinstance(x, str):
        return x
    if digits is None:
        digits = 2 if abs(x) < 10 else 1 if abs(x) < 1000 else 0
    return f"{x:,.{digits}f}"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_ratio(r):
    return "n/a" if r is None else f"{r:.2f}x"


def load_rows(folder):
    """{peer: {rep: [rows]}} and the profile rows of one checkpoint folder."""
    runs, profiles, errors = {}, {}, {}
    for path in sorted(folder.glob("*.jsonl")):
        m = re.match(r"(\d+|profile)-(.+)\.jsonl$", path.name)
        if not m:
            continue
        rows = []
        for line in path.read_text().splitlines():
            line = line.strip()
            if line.startswith("{"):
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    pass
        if m.group(1) == "profile":
            profiles[m.group(2)] = rows
        else:
            rep = int(m.group(1))
            for row in rows:
                # The Elixir process also reports TextGeneration.run rows.
                peer = row.get("peer", m.group(2))
                runs.setdefault(peer, {}).setdefault(rep, []).append(row)
    clk = load_rows.clk_tck
    for path in sorted(folder.glob("*.time")):
        m = re.match(r"(\d+|profile)-(.+)\.time$", path.name)
        cpu_file = path.with_suffix(".cpu")
        try:
            wall, user, system = map(float, path.read_text().split()[-3:])
            lines = cpu_file.read_text().splitlines()
            before, after = ([int(x) for x in l.split()[1:]] for l in lines[:2])
        except (ValueError, OSError, IndexError):
            continue
        busy = lambda v: sum(v) - v[3] - (v[4] if len(v) > 4 else 0)  # all but idle and iowait
        machine = (busy(after) - busy(before)) / clk
        own = user + system
        usage = {"measure": "cpu", "wall_s": wall, "own_cores": own / wall if wall else None,
                 "other_cores": max(machine - own, 0) / wall if wall else None}
        if m and m.group(1) == "profile":
            profiles.setdefault(m.group(2), []).append(usage)
        elif m:
            runs.setdefault(m.group(2), {}).setdefault(int(m.group(1)), []).append(usage)
    for path in sorted(folder.glob("*.err")):
        text = path.read_text().strip()
        if text:
            errors[path.stem] = text
    return runs, profiles, errors


load_rows.clk_tck = 100


class Metrics:
    """Per-peer, per-metric lists of values (one per repetition)."""

    def __init__(self, runs):
        self.values = {}  # (metric, peer) -> {rep: value (the median of the process's trials)}
        self.trials = {}  # (metric, peer) -> {rep: [value of each trial, in order]}
        self.units = {}
        self.ids = {}  # peer -> {rep: greedy ids of the decode measure}
        for peer, reps in runs.items():
            for rep, rows in reps.items():
                for row in rows:
                    self.add_row(peer, rep, row)

    def put(self, metric, peer, rep, value, unit=""):
        if value is None:
            return
        trials = self.trials.setdefault((metric, peer), {}).setdefault(rep, [])
        trials.append(value)
        self.values.setdefault((metric, peer), {})[rep] = median(trials)
        self.units[metric] = unit

    def add_row(self, peer, rep, row):
        m = row.get("measure")
        if m == "load":
            self.put("load time", peer, rep, row.get("load_ms"), "ms")
            self.put("device set-up before load", peer, rep, row.get("device_setup_ms"), "ms")
            self.put("RSS before load (runtime baseline)", peer, rep, row.get("rss_before_load_mb"), "MB")
            self.put("of which the tokenizer (loaded by the Elixir peer)", peer, rep, row.get("tokenizer_rss_mb"), "MB")
            self.put("of which the tokenizer (Elixir loads it for TextGeneration.run)", peer, rep,
                     row.get("tokenizer_rss_mb"), "MB")
            self.put("peak RSS after load", peer, rep, row.get("peak_rss_mb"), "MB")
            self.dtype = row.get("dtype", getattr(self, "dtype", None))
        elif m == "decode":
            if row.get("ids") is not None:
                self.ids.setdefault(peer, {}).setdefault(rep, list(row["ids"]))
            self.put("decode, batch 1", peer, rep, row.get("tok_s"), "tok/s")
            self.put("time to first token (decode prompt)", peer, rep, row.get("ttft_ms"), "ms")
            self.put("peak RSS during decode", peer, rep, row.get("peak_rss_mb"), "MB")
            self.put("MLX peak memory during decode", peer, rep, row.get("mlx_peak_mb"), "MB")
            self.put("_kv_bytes_decode", peer, rep, row.get("kv_bytes"))
            self.put("call time outside the engine's clock (decode call)", peer, rep, row.get("overhead_ms"), "ms")
            self.put("batch 1", peer, rep, row.get("tok_s"), "tok/s")
        elif m == "prefill":
            self.put("prefill", peer, rep, row.get("tok_s"), "tok/s")
            self.put("time to first token (prefill prompt)", peer, rep, row.get("ttft_ms"), "ms")
        elif m == "cpu":
            self.put("process wall time", peer, rep, row.get("wall_s"), "s")
            self.put("CPU cores busy, this process", peer, rep, row.get("own_cores"), "cores")
            self.put("CPU cores busy, other processes meanwhile", peer, rep, row.get("other_cores"), "cores")
        elif m == "batch":
            b = row.get("batch")
            self.put(f"batch {b}", peer, rep, row.get("tok_s"), "tok/s")
            self.put(f"peak RSS, batch {b}", peer, rep, row.get("peak_rss_mb"), "MB")
        elif m == "scheduler":
            b = row.get("batch")
            self.put(f"scheduler, batch {b}", peer, rep, row.get("tok_s"), "tok/s")

    def get(self, metric, peer):
        return self.values.get((metric, peer), {})

    def med(self, metric, peer):
        if peer == BEST_MLX:
            values = [self.med(metric, p) for p in MLX_LM]
            values = [v for v in values if v is not None]
            if not values:
                return None
            return max(values) if higher_is_better(metric) else min(values)
        return median(self.get(metric, peer).values())

    def best_mlx_peer(self, metric):
        best = self.med(metric, BEST_MLX)
        return next((p for p in MLX_LM if best is not None and self.med(metric, p) == best), None)

    def cell(self, metric, peer, rep):
        """A process's figure, followed by its trials when it ran several."""
        value = self.get(metric, peer).get(rep)
        trials = self.trials.get((metric, peer), {}).get(rep, [])
        if len(trials) > 1:
            return f"{fmt(value)} ({' / '.join(fmt(t) for t in trials)})"
        return fmt(value)


def batch_sizes(metrics, prefix="batch"):
    sizes = set()
    for metric, _ in metrics.values:
        m = re.match(prefix + r" (\d+)$", metric)
        if m:
            sizes.add(int(m.group(1)))
    return sorted(sizes)


def scheduler_pairs(metrics, peers):
    """(peer, rows, scheduler, static batch) medians, where a peer has both."""
    for p in peers:
        for b in batch_sizes(metrics, "scheduler, batch"):
            sched, static = metrics.med(f"scheduler, batch {b}", p), metrics.med(f"batch {b}", p)
            if sched and static:
                yield p, b, sched, static


def scheduler_lines(metrics, peers):
    """Each peer's scheduler against its own static batch of the same size."""
    rows = [[PEER_NAMES.get(p, p), b, fmt(sched), fmt(static), fmt_ratio(ratio(sched, static))]
            for p, b, sched, static in scheduler_pairs(metrics, peers)]
    if not rows:
        return []
    return ["The scheduler (continuous batching) against the static batch of the same rows "
            "(aggregate decode tok/s, medians):", "",
            table(["peer", "rows", "scheduler", "static batch", "scheduler / static"], rows), ""]


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def higher_is_better(metric):
    return ("tok/s" in metric or metric.startswith("batch") or metric.startswith("scheduler")
            or metric.startswith("decode") or metric == "prefill")


def split_states(values, gap=1.2):
    """Splits processes {rep: figure} into (fast, slow) at the largest ratio
    between consecutive sorted figures, when it is at least `gap`; else
    every process is in one state (fast)."""
    items = sorted(values.items(), key=lambda kv: kv[1])
    if len(items) < 2 or items[0][1] <= 0:
        return dict(items), {}
    ratio_at, at = max((items[i + 1][1] / items[i][1], i) for i in range(len(items) - 1))
    if ratio_at < gap:
        return dict(items), {}
    return dict(items[at + 1:]), dict(items[:at + 1])


def states_section(metrics, peers, trials):
    """Fast and slow processes at batch-1 decode, per peer, and ratios taken
    within each state."""
    metric = "decode, batch 1"
    states = {p: split_states(metrics.get(metric, p)) for p in peers if len(metrics.get(metric, p)) > 1}
    if not states:
        return []
    out = ["### Fast and slow processes (decode, batch 1)", "",
           "Each peer's processes split into a fast and a slow state at the largest gap (at least 20%) between "
           "consecutive process figures (a process's figure is the median of its trials); no split means one state. "
           + (f"Within a process, its {trials} trials' spread (max / min) tells whether a process keeps its state." if trials > 1 else ""),
           ""]
    header = ["peer", "fast processes (reps)", "fast median (tok/s)", "slow processes (reps)", "slow median (tok/s)",
              "all (tok/s)", "largest within-process spread"]
    rows = []
    for p, (fast, slow) in states.items():
        spreads = [max(t) / min(t) for t in metrics.trials.get((metric, p), {}).values() if len(t) > 1 and min(t) > 0]
        rows.append([PEER_NAMES.get(p, p), f"{len(fast)} ({', '.join(map(str, sorted(fast)))})", fmt(median(fast.values())),
                     f"{len(slow)} ({', '.join(map(str, sorted(slow)))})" if slow else "0", fmt(median(slow.values())),
                     fmt(metrics.med(metric, p)), f"{max(spreads):.2f}x" if spreads else "n/a"])
    out += [table(header, rows), ""]
    pairs = [(p, q) for p in ENGINE_VARIANTS + ["elixir"] if p in states for q in MLX_LM + ["rust-baseline"]
             if q in states and q != p and not (p == "elixir" and q == "rust-baseline")]
    if pairs:
        header = ["ratio", "fast / fast", "slow / slow", "all / all"]
        rows = []
        for p, q in pairs:
            (pf, ps), (qf, qs) = states[p], states[q]
            rows.append([f"{p} / {q}", fmt_ratio(ratio(median(pf.values()), median(qf.values()))),
                         fmt_ratio(ratio(median(ps.values()), median(qs.values()))),
                         fmt_ratio(ratio(metrics.med(metric, p), metrics.med(metric, q)))])
        out += ["Ratios within a state (when a peer has no slow process, its slow column is n/a):", "",
                table(header, rows), ""]
    return out


def model_section(name, folder, settings):
    runs, profiles, errors = load_rows(folder)
    metrics = Metrics(runs)
    for metric in ("process wall time", "CPU cores busy, this process", "CPU cores busy, other processes meanwhile"):
        if metrics.get(metric, "elixir") and "elixir-textgen" in runs:
            metrics.values[(metric, "elixir-textgen")] = dict(metrics.get(metric, "elixir"))
    peers = [p for p in PEER_ORDER if p in runs] + sorted(p for p in runs if p not in PEER_ORDER)
    wanted = settings.get("peers", [])
    missing = [p for p in wanted if p not in runs and not (p == "elixir-textgen")]
    sizes = batch_sizes(metrics)
    order = (
        ["decode, batch 1", "time to first token (decode prompt)", "prefill", "time to first token (prefill prompt)"]
        + [f"batch {b}" for b in sizes if b != 1]
        + [f"scheduler, batch {b}" for b in batch_sizes(metrics, "scheduler, batch")]
        + ["load time", "RSS before load (runtime baseline)", "of which the tokenizer (loaded by the Elixir peer)",
           "peak RSS after load", "peak RSS during decode", "MLX peak memory during decode"]
        + [f"peak RSS, batch {b}" for b in sizes if b != 1]
        + ["call time outside the engine's clock (decode call)"]
        + ["process wall time", "CPU cores busy, this process", "CPU cores busy, other processes meanwhile"]
    )
    summary = {"name": name, "metrics": metrics, "peers": peers, "sizes": sizes, "profiles": profiles}

    lines = [f"## {name}", ""]
    best_note = [f"{metric}: {PEER_NAMES.get(metrics.best_mlx_peer(metric), '')}" for metric in
                 ("decode, batch 1", "time to first token (decode prompt)", "prefill")
                 if metrics.best_mlx_peer(metric)] if sum(p in peers for p in MLX_LM) > 1 else []
    lines.append(
        f"Checkpoint `{settings.get('model_dir')}` ({fmt(settings.get('checkpoint_bytes', 0) / 2**20, 1)} MiB of "
        f"safetensors); compute dtype {settings.get('dtype') or getattr(metrics, 'dtype', None) or 'default'}; "
        f"{settings.get('reps')} repetitions, peers interleaved "
        f"in rotating order, each repetition a fresh process per peer (load, warm-up, then every measure "
        f"{'once' if (settings.get('trials') or 1) == 1 else str(settings.get('trials')) + ' times'})."
    )
    lines.append(
        f"Decode: {settings.get('decode_len')}-token prompt, {settings.get('tokens')} new tokens; prefill: "
        f"{settings.get('prefill_len')}-token prompt; batches {', '.join(map(str, settings.get('batch', [])))}: "
        f"{settings.get('batch_len')}-token prompts, {settings.get('batch_tokens')} new tokens per row; "
        f"warm-up: {settings.get('warmup_mode')}. Greedy, EOS ignored (every row decodes exactly the asked length). "
        f"Prompt ids sha256 `{settings.get('prompts_sha256')}`."
    )
    if best_note:
        lines.append(f"\"{BEST_MLX}\" is, per metric, the best median of the mlx-lm paths ({'; '.join(best_note)}).")
    # The engine's bench reports which paths decoded and prefilled, where it does.
    paths = {p: sorted({f"{r['decode_path']}/{r.get('prefill_path', '?')}" for reps in runs.get(p, {}).values()
                        for r in reps if "decode_path" in r}) for p in ENGINE_VARIANTS}
    if any(paths.values()):
        lines.append("Paths that ran (decode/prefill), as the engine reported them: " + "; ".join(
            f"{PEER_NAMES.get(p, p)}: {', '.join(v)}" for p, v in paths.items() if v) + ".")
    # And the dtype its KV cache was made in (the default differs by device).
    kv = {p: sorted({r["kv_dtype"] for reps in runs.get(p, {}).values() for r in reps if "kv_dtype" in r})
          for p in ENGINE_VARIANTS}
    if any(kv.values()):
        lines.append("KV cache dtype, as the engine reported it: " + "; ".join(
            f"{PEER_NAMES.get(p, p)}: {', '.join(v)}" for p, v in kv.items() if v) + ".")
    # And whether its fused GPU layer kernels were built and passed their check.
    fused = {p: sorted({str(r["gpu_layer_kernels"]).lower() for reps in runs.get(p, {}).values()
                        for r in reps if "gpu_layer_kernels" in r}) for p in ("rust", "rust-ops", "rust-mlx-products")}
    if any(fused.values()):
        lines.append("Fused GPU layer kernels, as the engine reported them: " + "; ".join(
            f"{PEER_NAMES[p]}: {'/'.join(v) or 'not reported'}" for p, v in fused.items() if p in runs)
            + " (none: not used).")
    # And whether its prompt kernels passed their check (prompts through them).
    prompt = {p: sorted({str(r["prompt_kernels"]).lower() for reps in runs.get(p, {}).values()
                         for r in reps if "prompt_kernels" in r}) for p in ("rust", "rust-mlx-prompt")}
    if any(prompt.values()):
        lines.append("Prompt kernels, as the engine reported them: " + "; ".join(
            f"{PEER_NAMES[p]}: {'/'.join(v) or 'not reported'}" for p, v in prompt.items() if p in runs)
            + " (none: not used).")
    # And whether its decode steps were replayed as one CUDA graph.
    replayed = {p: sorted({str(r["step_replay"]).lower() for reps in runs.get(p, {}).values() for r in reps
                           if "step_replay" in r}) for p in ("rust", "rust-mlx-steps")}
    if any(replayed.values()):
        lines.append("Decode steps replayed as one CUDA graph, as the engine reported it: " + "; ".join(
            f"{PEER_NAMES[p]}: {'/'.join(v) or 'not reported'}" for p, v in replayed.items() if p in runs)
            + " (false: not on a GPU, turned off, refused or differed, and MLX ran the steps).")
    cli = [r for reps in runs.get("mlx-lm-cli", {}).values() for r in reps if r.get("measure") in ("decode", "prefill")]
    if cli:
        short = sum(1 for r in cli if r.get("complete") is False)
        remapped = sum(1 for r in cli if r.get("prompt_ids_match") is False)
        lines.append(
            "mlx-lm (python -m mlx_lm generate) is the CLI, one process per prompt with no warm-up, as users run it; "
            "its figures are mlx-lm's own printed rates (generation rescaled by (tokens - 1) / tokens); it takes "
            "the prompt as text, prints text (so its ids are not compared) and cannot ignore EOS"
            + (f"; {short} of its decode runs stopped at EOS before the asked length" if short else "")
            + (f"; {remapped} of its prompts re-encoded to other ids than the others'" if remapped else
               "; its prompts re-encode to the same ids")
            + "."
        )
    lines.append("")
    for peer in missing:
        reason = errors.get(f"0-{peer}", "no output").splitlines()[-3:]
        lines.append(f"**{PEER_NAMES.get(peer, peer)}: not run** ({' / '.join(reason)[:400]})")
        lines.append("")

    # Medians and ratios.
    header = ["metric"] + [PEER_NAMES.get(p, p) for p in peers]
    ratio_pairs = []
    if "mlx-lm" in peers:
        ratio_pairs += [(p, "mlx-lm") for p in peers if p in OURS]
    if sum(p in peers for p in MLX_LM) > 1:
        ratio_pairs += [(p, BEST_MLX) for p in ENGINE_VARIANTS if p in peers]
    if "rust" in peers and "rust-baseline" in peers:
        ratio_pairs.append(("rust", "rust-baseline"))
    ratio_pairs += [(p, "rust") for p in ("rust-sampled", "rust-sampled-device", "rust-structured", "rust-structured-1t", "rust-kv16", "rust-kv8")
                    if p in peers and "rust" in peers]
    if "rust" in peers:
        ratio_pairs += [(p, "rust") for p in peers if p in ("elixir", "elixir-textgen")]
    if "llama.cpp" in peers and "rust" in peers:
        ratio_pairs.append(("rust", "llama.cpp"))
    if "llama.cpp" in peers and "rust-kv16" in peers:
        ratio_pairs.append(("rust-kv16", "llama.cpp"))
    if "llama.cpp" in peers and "rust-kv8" in peers:
        ratio_pairs.append(("rust-kv8", "llama.cpp"))
    for p in ("rust-int8", "rust-int8-kv16"):
        if "llama.cpp" in peers and p in peers and (p, "llama.cpp") not in ratio_pairs:
            ratio_pairs.append((p, "llama.cpp"))
    if "rust-int8-kv16" in peers and "rust-kv16" in peers:
        ratio_pairs.append(("rust-int8-kv16", "rust-kv16"))
    if "llama.cpp-kv8" in peers and "rust-kv8" in peers:
        ratio_pairs.append(("rust-kv8", "llama.cpp-kv8"))
    header += [f"{p} / {q}" for p, q in ratio_pairs]
    rows = []
    for metric in order:
        if not any(metrics.get(metric, p) for p in peers):
            continue
        unit = metrics.units.get(metric, "")
        label = f"{metric} ({unit})" if unit else metric
        if metric.startswith("batch") or metric.startswith("scheduler"):
            label = f"aggregate decode, {metric} ({unit})"
        row = [label] + [fmt(metrics.med(metric, p)) for p in peers]
        if metric == "CPU cores busy, other processes meanwhile":
            row += ["" for _ in ratio_pairs]  # context, not a comparison
        else:
            row += [fmt_ratio(ratio(metrics.med(metric, p), metrics.med(metric, q))) for p, q in ratio_pairs]
        rows.append(row)
    lines += ["Medians (ratios are of medians; above 1 means more of the metric: faster for tok/s, "
              "slower for ms, more memory for MB):", "", table(header, rows), ""]
    lines += roofline_lines(metrics, peers, settings)
    lines += scheduler_lines(metrics, peers)

    # Every repetition.
    reps = sorted({r for (m, p), v in metrics.values.items() for r in v})
    rep_header = ["metric", "peer"] + [f"rep {r}" for r in reps] + ["median"]
    rep_rows = []
    for metric in order:
        for p in peers:
            values = metrics.get(metric, p)
            if not values:
                continue
            rep_rows.append(
                [metric, p] + [metrics.cell(metric, p, r) for r in reps] + [fmt(median(values.values()))]
            )
    busy = [
        f"{p} rep {r} ({v:.2f} cores)"
        for p in peers
        for r, v in sorted(metrics.get("CPU cores busy, other processes meanwhile", p).items())
        if v > 0.5 and p != "elixir-textgen"
    ]
    if busy:
        lines += [
            "Other processes on this shared machine kept more than half a core busy during: " + ", ".join(busy)
            + ". Those repetitions are slower for that reason; the medians set them aside.",
            "",
        ]
    trials = settings.get("trials", 1) or 1
    if trials > 1:
        lines += [f"Every repetition (one process each; {trials} trials inside each process: the process's median, "
                  "then each trial in order):", "", table(rep_header, rep_rows), ""]
        lines += states_section(metrics, peers, trials)
    else:
        lines += ["<details><summary>Every repetition</summary>", "", table(rep_header, rep_rows), "", "</details>", ""]

    id_lines, summary["ids_mismatch"] = ids_section(metrics, peers, settings.get("dtype") or getattr(metrics, "dtype", None))
    lines += id_lines
    lines += goals_section(summary, settings)
    lines += profile_section(summary, settings)
    return "\n".join(lines), summary


# Peers that run the same MLX weights as the engine: in float32 their greedy
# ids must equal the engine's. llama.cpp runs a Q4_0 requantization of them,
# and bf16 rounding may flip a near tie, so there a divergence is reported
# with its position, not failed.
# Peers that sample rather than decode greedily, or decode under a
# constraint: their ids are not compared.
SAMPLED = ["rust-sampled", "rust-sampled-device", "rust-structured", "rust-structured-1t"]
SAME_WEIGHTS = ["rust-mlx-steps", "rust-mlx-prompt", "rust-baseline", "rust-ops", "rust-mlx-products", "rust-1t", "elixir", "elixir-textgen", "mlx-lm", "mlx-lm-stream"]


def first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def ids_section(metrics, peers, dtype):
    """The decode measure's greedy ids of every peer and repetition against
    the Rust engine's first repetition. Returns (lines, mismatch), mismatch
    being true when a same-weights peer differs in float32."""
    reference = next(iter(sorted(metrics.ids.get("rust", {}).items())), (None, None))[1]
    if reference is None:
        return [], False
    out = ["### Greedy ids across peers", "",
           f"The decode measure's {len(reference)} greedy ids of each peer and repetition, against the Rust "
           f"engine's first repetition (`{' '.join(map(str, reference[:8]))} ...`):", ""]
    mismatch = False
    for peer in peers:
        if peer in SAMPLED:
            continue
        for rep, ids in sorted(metrics.ids.get(peer, {}).items()):
            at = first_divergence(reference, ids)
            if at is None:
                verdict = "identical"
            else:
                verdict = f"first differs at token {at} ({reference[at] if at < len(reference) else '-'} vs " \
                          f"{ids[at] if at < len(ids) else '-'})"
                if peer in SAME_WEIGHTS + ["rust"] and dtype == "float32":
                    mismatch = True
                    verdict += " **(must be identical in float32)**"
            out.append(f"- {PEER_NAMES.get(peer, peer)}, rep {rep}: {verdict}")
    out.append("")
    return out, mismatch


# HBM bandwidth of an NVIDIA H200 (bytes/s).
H200_BANDWIDTH = 4.8e12


def bytes_per_token(settings):
    """Bytes a batch-1 decode step reads at least: every weight the step
    uses (the checkpoint, less the embedding table where the output
    projection is a matrix of its own: a step reads one row of it; of a
    Qwen3-MoE layer's routed experts, the ones a token takes) and the
    bfloat16 keys and values of the mean context over the decode."""
    try:
        config = json.loads((ROOT / settings["model_dir"] / "config.json").read_text())
    except (KeyError, OSError, ValueError):
        return None
    weights = settings.get("checkpoint_bytes") or 0
    q = config.get("quantization") or {}
    d, vocab = config["hidden_size"], config["vocab_size"]
    if not config.get("tie_word_embeddings", True) and q:
        weights -= vocab * d * (q["bits"] / 8 + 4 / q["group_size"])
    sparse = len(sparse_layers(config))
    if sparse and q:
        experts = config["num_experts"]
        stacked = sparse * 3 * experts * config["moe_intermediate_size"] * d * (q["bits"] / 8 + 4 / q["group_size"])
        weights -= stacked * (1 - config["num_experts_per_tok"] / experts)
    head_dim = config.get("head_dim") or d // config["num_attention_heads"]
    context = settings.get("decode_len", 0) + settings.get("tokens", 0) / 2
    kv = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * context * 2
    return weights + kv, kv


def roofline_lines(metrics, peers, settings):
    """Each peer's batch-1 decode as a share of the H200's HBM bandwidth."""
    if settings.get("device") != "gpu":
        return []
    need = bytes_per_token(settings)
    if not need:
        return []
    total, kv = need
    cells = [f"{PEER_NAMES.get(p, p)} {100 * metrics.med('decode, batch 1', p) * total / H200_BANDWIDTH:.1f}%"
             for p in peers if metrics.med("decode, batch 1", p)]
    if not cells:
        return []
    return [f"HBM roofline: a decode step reads at least {total / 1e6:.0f} MB ({kv / 1e6:.0f} MB of it keys and "
            f"values at the mean context); batch-1 decode x that / 4.8 TB/s (an H200's bandwidth): "
            + ", ".join(cells) + ".", ""]


def goals_section(s, settings):
    m = s["metrics"]
    out = ["### Goals", ""]
    per_core = ratio(m.med("decode, batch 1", "rust-1t"), m.med("decode, batch 1", "mlx-lm"))
    if per_core is not None:
        prefill_core = ratio(m.med("prefill", "rust-1t"), m.med("prefill", "mlx-lm"))
        out.append(f"- Per core (engine on 1 thread vs mlx-lm, whose CPU kernels use one): decode "
                   f"{fmt_ratio(per_core)}, prefill {fmt_ratio(prefill_core)}.")
    threads = settings.get("threads")
    on_gpu = settings.get("device") == "gpu"
    # On a GPU both run every layer there: the goal is llama.cpp's speed.
    where = "llama.cpp with every layer on the GPU" if on_gpu else f"llama.cpp, both on {threads} threads"
    goals = (("decode, batch 1", 1.0, "decode"), ("prefill", 1.0, "prefill")) if on_gpu else \
        (("decode, batch 1", 0.8, "decode"), ("prefill", 0.5, "prefill"))
    for metric, goal, what in goals:
        lr = ratio(m.med(metric, "rust"), m.med(metric, "llama.cpp"))
        if lr is None:
            continue
        verdict = "met" if lr >= goal else f"**not met** ({m.med(metric, 'rust'):.1f} vs " \
            f"{m.med(metric, 'llama.cpp'):.1f} tok/s)"
        out.append(f"- Engine {what} >= {goal}x {where} "
                   f"({settings.get('prefill_len') if what == 'prefill' else settings.get('tokens')} tokens): "
                   f"{fmt_ratio(lr)}: {verdict}.")
        li = ratio(m.med(metric, "rust-int8"), m.med(metric, "llama.cpp"))
        if li is not None:
            out.append(f"- The same with the engine's opt-in int8 activations (llama.cpp's Q4_0 technique; "
                       f"greedy ids may differ from float32): {fmt_ratio(li)}: "
                       f"{'met' if li >= goal else '**not met**'}.")
    peak = m.med("peak RSS during decode", "rust")
    ckpt = settings.get("checkpoint_bytes")
    if peak and ckpt and "llama.cpp" in s["peers"]:
        r = peak * 2**20 / ckpt
        out.append(f"- Engine peak RSS while decoding <= 1.3x the checkpoint's bytes: {r:.2f}x "
                   f"({fmt(peak)} MB for {fmt(ckpt / 2**20, 1)} MiB): {'met' if r <= 1.3 else '**not met**'}.")
    rust = m.med("decode, batch 1", "rust")
    mlx = m.med("decode, batch 1", "mlx-lm")
    elixir = m.med("decode, batch 1", "elixir")
    r = ratio(rust, mlx)
    if r is not None:
        verdict = "met" if r >= 2 else f"**not met**: {r:.2f}x, short of 2x by {(2 - r) / 2 * 100:.0f}% " \
            f"(the engine would need {2 * mlx:.2f} tok/s, it decodes {rust:.2f})"
        out.append(f"- Engine decode >= 2x mlx-lm (batch 1): {fmt_ratio(r)}: {verdict}.")
    if sum(p in s["peers"] for p in MLX_LM) > 1:
        for metric, goal, what in (("decode, batch 1", 2.0, "decode (batch 1) >= 2x"),
                                   ("time to first token (decode prompt)", 1.0, "time to first token (decode prompt) <="),
                                   ("prefill", 1.0, "prefill >=")):
            best, path = m.med(metric, BEST_MLX), m.best_mlx_peer(metric)
            ours = m.med(metric, "rust")
            rb = ratio(ours, best)
            if rb is None:
                continue
            ok = rb >= goal if higher_is_better(metric) else rb <= goal
            out.append(f"- Engine {what} the best mlx-lm path ({PEER_NAMES.get(path, path)}, {fmt(best)}): "
                       f"{fmt(ours)}, {fmt_ratio(rb)}: {'met' if ok else '**not met**'}.")
    for peer in ("rust-sampled", "rust-sampled-device"):
        rs = ratio(m.med("decode, batch 1", peer), rust)
        if rs is not None:
            out.append(f"- Qwen3's recommended sampling ({PEER_NAMES[peer]}) >= 0.95x greedy decode at batch 1: "
                       f"{fmt(m.med('decode, batch 1', peer))} vs {fmt(rust)} tok/s, {fmt_ratio(rs)}: "
                       f"{'met' if rs >= 0.95 else '**not met**'}.")
    rs = ratio(m.med("decode, batch 1", "rust-structured"), rust)
    if rs is not None:
        out.append(f"- A structured-output row (JSON Schema) >= 0.9x unconstrained greedy decode at batch 1: "
                   f"{fmt(m.med('decode, batch 1', 'rust-structured'))} vs {fmt(rust)} tok/s, {fmt_ratio(rs)}: "
                   f"{'met' if rs >= 0.9 else '**not met**'}.")
    for peer, b, sched, static in scheduler_pairs(m, ("rust", "rust-sampled", "rust-sampled-device")):
        rs = ratio(sched, static)
        if rs is not None:
            out.append(f"- {b} requests through the scheduler ({PEER_NAMES[peer]}) >= 0.95x the static batch of "
                       f"the same rows: {fmt(sched)} vs {fmt(static)} tok/s, {fmt_ratio(rs)}: "
                       f"{'met' if rs >= 0.95 else '**not met**'}.")
    for metric in ("decode, batch 1", "prefill"):
        cb = ratio(m.med(metric, "rust"), m.med(metric, "rust-baseline"))
        if cb is not None:
            ok = 0.95 <= cb <= 1.05 or cb > 1.05
            out.append(f"- The engine against its baseline build, {metric}: {fmt_ratio(cb)} "
                       f"(within 5% or faster: {'met' if ok else '**not met**'}).")
    lr = ratio(m.med("load time", "rust"), m.med("load time", "mlx-lm"))
    if lr is not None and m.med("load time", "mlx-lm") is not None:
        out.append(f"- Engine load time <= mlx-lm's: {fmt(m.med('load time', 'rust'))} vs "
                   f"{fmt(m.med('load time', 'mlx-lm'))} ms, {fmt_ratio(lr)}: {'met' if lr <= 1 else '**not met**'}.")
    for b in s["sizes"]:
        if b == 1:
            continue
        rb = ratio(m.med(f"batch {b}", "rust"), m.med(f"batch {b}", "mlx-lm"))
        if rb is not None:
            out.append(f"- Engine aggregate decode at batch {b} vs mlx-lm: {fmt_ratio(rb)}.")
    e = ratio(elixir, rust)
    if e is not None:
        gap = (1 - e) * 100
        reps = list(m.get("decode, batch 1", "rust").values())
        spread = (max(reps) - min(reps)) / median(reps) * 100 if len(reps) > 1 else None
        noise = f"; Rust's own repetitions spread {spread:.1f}%" if spread is not None else ""
        if gap <= 3:
            verdict = "met" + (" (Elixir is not slower; it runs the same engine, so the lead is run-to-run variation"
                               f"{noise})" if gap < 0 else "")
        else:
            verdict = f"**not met**: {gap - 3:.1f} points outside the band{noise}"
        out.append(
            f"- Elixir (Generate.generate) decode no more than 3% slower than Rust: {abs(gap):.1f}% "
            f"{'slower' if gap > 0 else 'faster'}: {verdict}."
        )
    t = ratio(m.med("decode, batch 1", "elixir-textgen"), rust)
    if t is not None:
        out.append(
            f"- Elixir TextGeneration.run (detokenizing too) vs Rust decode: {abs(1 - t) * 100:.1f}% "
            f"{'slower' if t < 1 else 'faster'}."
        )
    ckpt = settings.get("checkpoint_bytes")
    for peer in ("rust", "elixir", "mlx-lm"):
        peak = m.med("peak RSS during decode", peer)
        load_peak = m.med("peak RSS after load", peer)
        base = m.med("RSS before load (runtime baseline)", peer)
        kv = median(m.get("_kv_bytes_decode", peer).values()) or median(m.get("_kv_bytes_decode", "rust").values())
        if peak is None or not ckpt or kv is None:
            continue
        bound = (1.3 * ckpt + kv) / 2**20
        name = PEER_NAMES[peer]
        if peer == "mlx-lm":
            above = f" ({fmt(peak - base)} MB above its {fmt(base)} MB Python baseline)" if base else ""
            out.append(
                f"- For reference, mlx-lm: decode peak RSS {fmt(peak)} MB{above}, {fmt(load_peak)} MB at load; "
                f"the same bound would be {fmt(bound)} MB."
            )
            continue
        verdict = "met" if peak <= bound else f"**not met**: {peak / bound:.2f}x the bound"
        line = (
            f"- Peak memory <= 1.3x checkpoint + KV ({name}): decode peak RSS {fmt(peak)} MB vs bound {fmt(bound)} MB "
            f"(checkpoint {fmt(ckpt / 2**20)} MiB, KV {fmt(kv / 2**20)} MiB): {verdict}"
        )
        if base:
            over = peak - base
            tok = m.med("of which the tokenizer (loaded by the Elixir peer)", peer)
            what = f"BEAM plus the {fmt(tok)} MB tokenizer" if tok else "RSS before loading"
            line += (
                f"; above the runtime's own {fmt(base)} MB ({what}) it is {fmt(over)} MB = "
                f"{over / bound:.2f}x the bound"
            )
        if peer == "elixir" and m.med("MLX peak memory during decode", "elixir") is None:
            line += " (MLX's buffer cache could not be cleared from Elixir, so this includes buffers kept from earlier measures)"
        if load_peak:
            line += (
                f". Process peak while loading: {fmt(load_peak)} MB = {load_peak / bound:.2f}x the bound"
                + (
                    f" ({fmt(load_peak - base)} MB above the runtime's own)"
                    if load_peak > bound and base
                    else ""
                )
            )
        out.append(line + ".")
    out.append("")
    return out


def profile_section(s, settings):
    profiles = s["profiles"]
    if not profiles:
        return []
    out = ["### Where the time goes", ""]
    steps = {}
    for peer, rows in profiles.items():
        for row in rows:
            if row.get("measure") == "profile_step":
                steps[peer] = row
    if steps:
        header = ["peer", "graph construction (ms)", "evaluation (ms)", "sampling + read-back (ms)", "step (ms)",
                  "tok/s (synchronous)", "CPU worker streams", "cores busy: this process / others"]
        rows = []
        for p, r in steps.items():
            cpu = next((c for c in profiles[p] if c.get("measure") == "cpu"), {})
            cores = (f"{cpu['own_cores']:.2f} / {cpu['other_cores']:.2f}"
                     if cpu.get("own_cores") is not None else "n/a")
            rows.append([PEER_NAMES.get(p, p), fmt(r["graph_build_ms"], 3), fmt(r["eval_ms"], 3),
                         fmt(r["sample_ms"], 3), fmt(r["step_ms"], 3), fmt(r["sync_tok_s"]),
                         str(r.get("worker_streams") or "none") if p == "rust" else "none", cores])
        out += [
            f"A decode loop run by hand at batch 1 ({next(iter(steps.values()))['steps']} steps, medians), "
            "each phase timed synchronously: building the step's graph (the model call), evaluating it, and "
            "greedy sampling with the id read back to the host:",
            "",
            table(header, rows),
            "",
        ]
    kernels = [r for r in profiles.get("rust", []) if r.get("measure") == "profile_kernel"]
    total = next((r for r in profiles.get("rust", []) if r.get("measure") == "profile_kernels"), None)
    if kernels and total:
        per_token = total["kernels_per_token_ms"]
        header = ["kernel", "shape", "ms each", "times per token", "ms per token", "share"]
        rows = []
        for k in kernels:
            t = k["ms"] * k["per_token"]
            rows.append([k["op"], "x".join(map(str, k["shape"])), fmt(k["ms"], 4), fmt(k["per_token"], 0),
                         fmt(t, 2), f"{t / per_token * 100:.1f}%"])
        out += [
            "Each kernel of a decode step timed alone at the checkpoint's shapes (engine's `bench --measures "
            f"profile`, median of 15, context {total['context']}); one token needs the listed count of each:",
            "",
            table(header, rows),
            "",
        ]
        rust_step = steps.get("rust")
        if rust_step:
            eval_ms = rust_step["eval_ms"]
            layer_q = sum(k["ms"] * k["per_token"] for k in kernels if k["op"].endswith("_proj"))
            head = sum(k["ms"] * k["per_token"] for k in kernels if k["op"] == "lm_head")
            ways = rust_step.get("worker_streams", 1) or 1
            share = f" ({per_token / eval_ms * 100:.0f}%)" if ways <= 1 else ""
            out.append(
                f"The kernels alone, on one thread, add up to {fmt(per_token)} ms per token against {fmt(eval_ms)} ms "
                f"for evaluating the engine's whole step graph{share}: the quantized matrix-vector "
                f"products of the layers take {fmt(layer_q)} ms ({layer_q / per_token * 100:.0f}%) and the tied "
                f"output projection {fmt(head)} ms ({head / per_token * 100:.0f}%). Graph construction is "
                f"{fmt(rust_step['graph_build_ms'], 2)} ms and sampling {fmt(rust_step['sample_ms'], 2)} ms of a "
                f"{fmt(rust_step['step_ms'])} ms step."
            )
            if ways > 1:
                cpu = next((c for c in profiles["rust"] if c.get("measure") == "cpu"), {})
                others = cpu.get("other_cores")
                out.append(
                    f"The engine splits each projection by rows over {ways} CPU worker streams (one thread each): "
                    f"its step evaluated in {fmt(eval_ms)} ms against {fmt(per_token)} ms for the same kernels whole "
                    f"on one thread, a {per_token / eval_ms:.2f}x speed-up"
                    + (f", while other processes kept {others:.2f} of the machine's cores busy" if others is not None else "")
                    + "."
                )
            mlx_step = steps.get("mlx-lm")
            if ways > 1 and mlx_step:
                split = sum(k["ms"] * k["per_token"] for k in kernels if k["op"].endswith("_proj") or k["op"] == "lm_head")
                ideal = split / ways + (per_token - split) + rust_step["graph_build_ms"] + rust_step["sample_ms"]
                ceiling = mlx_step["step_ms"] / ideal
                measured = ratio(s["metrics"].med("decode, batch 1", "rust"), s["metrics"].med("decode, batch 1", "mlx-lm"))
                out.append(
                    f"Ceiling on this machine, estimated from the kernels timed alone (which include a per-call "
                    f"overhead that small kernels feel most): with perfect scaling over {ways} cores the split kernels "
                    f"({fmt(split)} ms) would take {fmt(split / ways)} ms while the rest ({fmt(per_token - split)} ms "
                    f"of norms, RoPE and attention) and the host work stay: about {fmt(ideal)} ms a step, "
                    f"{ceiling:.2f}x mlx-lm's {fmt(mlx_step['step_ms'])} ms step. The engine's step takes "
                    f"{fmt(rust_step['step_ms'])} ms ({ideal / rust_step['step_ms'] * 100:.0f}% of that ideal speed)."
                    + (" So 2x at batch 1 needs more cores or faster kernels than MLX's, not less overhead."
                       if ceiling < 2 and (measured or 0) < 2 else "")
                )
            if mlx_step:
                host = mlx_step["graph_build_ms"] + mlx_step["sample_ms"]
                share = host / mlx_step["step_ms"]
                out.append(
                    f"mlx-lm runs the same MLX kernels: its evaluation takes {fmt(mlx_step['eval_ms'])} ms and its "
                    f"host-side work (Python graph construction {fmt(mlx_step['graph_build_ms'], 2)} ms, sampling and "
                    f"read-back {fmt(mlx_step['sample_ms'], 2)} ms) is {share * 100:.1f}% of its step: removing all "
                    f"of it would make decoding at most {1 / (1 - share):.2f}x faster"
                    + (". A 2x lead over mlx-lm has to come from the kernels' own time (on this CPU, spreading them "
                       "over more cores), not from the host." if rust_step.get("device") == "cpu" else
                       f"; the engine's own evaluation takes {fmt(eval_ms)} ms against mlx-lm's "
                       f"{fmt(mlx_step['eval_ms'])} ms, so its graph, not the host, decides the ratio here.")
                )
            out.append("")
    replay = next((r for r in profiles.get("rust", []) if r.get("measure") == "profile_replay"), None)
    if replay and replay.get("kernels"):
        alone = replay["kernels_alone_us"]
        header = ["kernel", "launches a step", "us a step (each alone)", "share"]
        rows = [[k["kernel"], str(k["launches"]), fmt(k["us"], 1), f"{k['us'] / alone * 100:.1f}%"]
                for k in sorted(replay["kernels"], key=lambda k: -k["us"])]
        out += [
            f"The replayed decode step's kernels ({replay['launches']} launches after a "
            f"{replay['prompt_tokens']}-token prompt), each launched alone after the one before it had finished, "
            f"median of {replay['runs']} runs of each (engine's `bench --measures profile`):",
            "",
            table(header, rows),
            "",
            f"Alone they add up to {fmt(alone)} us; the replayed step took {fmt(replay['step_us'])} us a token in a "
            "decode of the same prompt. Timed alone, each kernel also carries its launch and the device's ramp up "
            "and down, which a graph of back-to-back kernels partly hides.",
            "",
        ]
    for pre in (r for r in profiles.get("mlx-lm", []) if r.get("measure") == "profile_prefill"):
        out.append(
            f"Prefill, {pre['prompt_tokens']}-token prompt, in mlx-lm (median of {pre['runs']}): running the whole "
            f"prompt and projecting its last row, as the engine does, takes {fmt(pre['whole_ms'])} ms; mlx-lm's "
            f"`generate_step` way (the prompt but its last token with only the KV cache evaluated, then the last "
            f"token) takes {fmt(pre['split_ms'])} ms, {abs(1 - pre['split_ms'] / pre['whole_ms']) * 100:.0f}% "
            f"{'less' if pre['split_ms'] < pre['whole_ms'] else 'more'} (noise is a few %). Its first pass skips "
            f"the last layer's attention output and MLP, which nothing reads (about one layer's non-KV work: it "
            f"matters for shallow models such as the 2-layer fixture, little for 28 layers), but costs a second "
            f"pass and a synchronization, which dominate where kernels are fast."
        )
        out.append("")
    return out


def plot(summaries, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(summaries)
    fig, axes = plt.subplots(n, 2, figsize=(12, 4.2 * n), squeeze=False, gridspec_kw={"width_ratios": [3, 1]})
    colors = {"rust": "#c0392b", "rust-mlx-steps": "#641e16", "rust-mlx-prompt": "#a04000", "rust-baseline": "#922b21", "rust-ops": "#ec7063", "rust-mlx-products": "#f5b7b1", "mlx-lm-stream": "#5dade2", "mlx-lm-cli": "#1b4f72",
              "rust-1t": "#e59866", "rust-int8": "#f1c40f", "rust-int8-kv16": "#d4ac0d", "elixir": "#8e44ad", "elixir-textgen": "#bb8fce",
              "mlx-lm": "#2e86c1", "llama.cpp": "#229954"}
    for row, s in enumerate(summaries):
        m, peers, sizes = s["metrics"], s["peers"], s["sizes"] or [1]
        ax = axes[row][0]
        width = 0.8 / max(len(peers), 1)
        for i, p in enumerate(peers):
            xs, ys, errs = [], [], []
            for j, b in enumerate(sizes):
                vals = list(m.get(f"batch {b}", p).values())
                if not vals:
                    continue
                med = median(vals)
                xs.append(j + (i - (len(peers) - 1) / 2) * width)
                ys.append(med)
                errs.append([[med - min(vals)], [max(vals) - med]])
            if xs:
                yerr = [[e[0][0] for e in errs], [e[1][0] for e in errs]]
                bars = ax.bar(xs, ys, width, label=PEER_NAMES.get(p, p), color=colors.get(p), yerr=yerr, capsize=3)
                for x, y in zip(xs, ys):
                    ax.text(x, y, fmt(y), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(sizes)))
        ax.set_xticklabels([f"batch {b}" for b in sizes])
        ax.set_ylabel("decode tokens/s (all rows)")
        title = f"{s['name']}: aggregate decode speed (median, min-max bars)"
        vs_llama = [ratio(m.med(k, "rust"), m.med(k, "llama.cpp")) for k in ("decode, batch 1", "prefill")]
        if vs_llama[0] is not None:
            title += f"\nengine / llama.cpp: decode {fmt_ratio(vs_llama[0])}, prefill {fmt_ratio(vs_llama[1])}"
        ax.set_title(title, fontsize=10)
        # Headroom above the bars for the legend, which would hide them.
        ax.set_ylim(0, ax.get_ylim()[1] * 1.45)
        ax.legend(fontsize=8, loc="upper left", ncol=2)
        ax2 = axes[row][1]
        pre = [(p, m.med("prefill", p)) for p in peers if m.med("prefill", p) is not None]
        if pre:
            ax2.bar(range(len(pre)), [v for _, v in pre], color=[colors.get(p, "#7f8c8d") for p, _ in pre])
            ax2.set_xticks(range(len(pre)))
            ax2.set_xticklabels([p for p, _ in pre], rotation=20, fontsize=8)
            for i, (_, v) in enumerate(pre):
                ax2.text(i, v, fmt(v), ha="center", va="bottom", fontsize=7)
        ax2.set_title("prefill tokens/s (median)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def console_table(summaries):
    for s in summaries:
        m, peers = s["metrics"], s["peers"]
        print(f"\n== {s['name']} (medians) ==")
        metrics = ["decode, batch 1", "prefill"] + [f"batch {b}" for b in s["sizes"] if b != 1] + [
            "time to first token (prefill prompt)", "load time", "peak RSS during decode"]
        head = f"{'metric':40s}" + "".join(f"{p:>16s}" for p in peers)
        if "mlx-lm" in peers:
            head += "".join(f"{p + '/mlx-lm':>22s}" for p in peers if p in OURS)
        print(head)
        for metric in metrics:
            if not any(m.get(metric, p) for p in peers):
                continue
            unit = m.units.get(metric, "")
            line = f"{(metric + ' (' + unit + ')'):40s}" + "".join(f"{fmt(m.med(metric, p)):>16s}" for p in peers)
            if "mlx-lm" in peers:
                line += "".join(
                    f"{fmt_ratio(ratio(m.med(metric, p), m.med(metric, 'mlx-lm'))):>22s}" for p in peers if p in OURS
                )
            print(line)


def extra_paths(summaries):
    """A line on the peers the header's paragraph does not name, where they ran."""
    ran = {p for s in summaries for p in s["peers"]}
    notes = {
        "rust-baseline": "**Rust engine, baseline build** is another build of the engine's bench binary "
                         "(`--baseline-bin`), interleaved with the engine's processes",
        "mlx-lm-stream": "**mlx-lm (stream_generate)** is `bench/mlx_lm_bench.py --path stream_generate` "
                         "(`mlx_lm.stream_generate` with the checkpoint's tokenizer, detokenizing as it goes)",
        "mlx-lm-cli": "**mlx-lm (python -m mlx_lm generate)** is `bench/mlx_lm_cli_bench.py` timing the CLI "
                      "as users run it",
    }
    lines = [text for peer, text in notes.items() if peer in ran]
    return ["; ".join(lines) + ".", ""] if lines else []


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--results", type=Path, default=Path(__file__).parent / "RESULTS.md")
    parser.add_argument("--plot", type=Path, default=Path(__file__).parent / "results.png")
    args = parser.parse_args()

    machine = json.loads((args.out_dir / "machine.json").read_text())
    load_rows.clk_tck = machine.get("clk_tck", 100)
    sections, summaries = [], []
    for folder in sorted(p for p in args.out_dir.iterdir() if p.is_dir()):
        settings = json.loads((folder / "settings.json").read_text())
        text, summary = model_section(settings["name"], folder, settings)
        summary["order"] = settings.get("order", 0)
        sections.append((settings.get("order", 0), text))
        summaries.append(summary)
    sections.sort()
    summaries.sort(key=lambda s: s["order"])

    head = [
        "# Benchmarks: emlx_axon against mlx-lm",
        "",
        f"Generated by `bench/run` on {machine['date']} (wall time of the whole run: {machine.get('wall', 'n/a')}). "
        "Every figure below was measured in this one run; nothing is copied from elsewhere.",
        "",
        f"Command: `{machine.get('command', 'bench/run')}`",
        "",
        "| | |",
        "|---|---|",
        f"| machine | {machine.get('cpu')}, {machine.get('cores')} cores, {machine.get('ram')} RAM; {machine.get('os')} |",
        f"| device | {machine.get('device')} |",
        f"| MLX | {machine.get('mlx')} |",
        f"| mlx-lm | {machine.get('mlx_lm')} |",
        f"| Rust | {machine.get('rustc')} |",
        f"| Elixir / OTP | {machine.get('elixir')} |",
        f"| engine commit | {machine.get('commit')} |",
        "",
        "Paths: **Rust engine** is `native/engine/examples/bench.rs` driving `Generation` directly; **Elixir** is "
        "`bench/elixir_bench.exs` through the NIF (`EMLXAxon.Qwen3.Generate.generate/3` with ids, and "
        "`EMLXAxon.TextGeneration.stream/5`, run/4's path, with `%{input_ids: ...}`); **mlx-lm** is "
        "`bench/mlx_lm_bench.py` (`generate_step` at batch 1, `BatchGenerator` for batches). Speeds are wall clock, "
        "taken by each caller from its call: decode = (tokens - 1) / "
        "(time of the last token - time of the first); aggregate decode = rows x (tokens - 1) / the same span; "
        "prefill = prompt tokens / time to first token. Every peer's greedy ids are checked against the engine's "
        "(\"Greedy ids across peers\"). Peak RSS is the process's VmHWM, reset before each measure.",
        "",
    ] + extra_paths(summaries) + [
        f"![tokens/s by path and batch size]({args.plot.name})",
        "",
    ]
    args.results.write_text("\n".join(head + [t for _, t in sections]) + "\n")
    print(f"[report] wrote {args.results}")
    try:
        plot(summaries, args.plot)
        print(f"[report] wrote {args.plot}")
    except ImportError as e:
        print(f"[report] no plot: {e}")
    console_table(summaries)
    bad = [s["name"] for s in summaries if s.get("ids_mismatch")]
    if bad:
        print(f"[report] greedy ids differ from the engine's in float32 on: {', '.join(bad)}", file=sys.stderr)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

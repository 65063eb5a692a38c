"""Write random-weight Qwen3 checkpoints for the benchmarks, in the exact
layout mlx-lm writes for a 4-bit model (as mlx-community/Qwen3-0.6B-4bit):
the 0.6B shape, and the 4B, 8B, 32B and 30B-A3B shapes (`bench/run
--shape`), whose configurations are Qwen's own with the 0.6B's other fields,
and the 30B-A3B's first 8 layers (`30b-a3b-8l`).
The 30B-A3B's routed experts are stacked per layer as mlx-lm's qwen3_moe
stacks them (`mlp.switch_mlp.{gate,up,down}_proj`, `[experts, out, in]`),
and its routers are 8-bit, as mlx-lm quantizes them.

Usage:
    .venv/bin/python bench/make_checkpoint.py [--out .cache/bench] [--force]
        [--only qwen3-0.6b-4bit-g64,qwen3-8b-4bit-g64,...]

Each folder holds config.json (the real Qwen3-0.6B configuration plus the
`quantization` / `quantization_config` blocks, written by mlx-lm's own
save_config), model.safetensors (packed uint32 weights with bfloat16 scales
and biases; norms in bfloat16; written by MLX's own safetensors writer),
model.safetensors.index.json, generation_config.json and the genuine Qwen3
tokenizer files.

Quantizing a float model with mlx-lm takes a quarter of an hour on two cores,
so the packed weights are drawn directly: every 4-bit code uniformly, and each
group's scale and bias chosen so dequantized weights are roughly uniform in
+-1/sqrt(fan_in). Activations stay finite and the speed is that of a real
checkpoint of the same shapes (the kernels do not depend on the values).

A folder is skipped when its .stamp holds this script's hash. After writing,
each checkpoint is loaded back with mlx_lm.utils.load_model and run forward in
float32; the script fails unless the logits are finite.
"""

import argparse
import hashlib
import json
import math
import shutil
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = ROOT / ".cache" / "tokenizer-qwen3"
SEED = 20250601

# Qwen/Qwen3-0.6B's config.json.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

GENERATION_CONFIG = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}

# What Qwen/Qwen3-4B, -8B and -32B's config.json change of the 0.6B's.
SHAPES = {
    "0.6b": {},
    "4b": {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "max_window_layers": 36},
    "8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
           "num_attention_heads": 32, "num_key_value_heads": 8, "max_window_layers": 36,
           "tie_word_embeddings": False},
    "32b": {"hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
            "num_attention_heads": 64, "num_key_value_heads": 8, "max_window_layers": 64,
            "tie_word_embeddings": False},
    "30b-a3b": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
                "num_attention_heads": 32, "num_key_value_heads": 4, "max_window_layers": 48,
                "tie_word_embeddings": False, "decoder_sparse_step": 1, "mlp_only_layers": [],
                "moe_intermediate_size": 768, "norm_topk_prob": True, "num_experts": 128,
                "num_experts_per_tok": 8, "output_router_logits": False,
                "router_aux_loss_coef": 0.001},
}
# The 30B-A3B's first 8 layers: its layer shapes at a size a small machine
# holds next to llama.cpp's GGUF of it (3 GB).
SHAPES["30b-a3b-8l"] = dict(SHAPES["30b-a3b"], num_hidden_layers=8, max_window_layers=8)

# mlx-lm's qwen3_moe quantizes each router (`mlp.gate`) to 8 bits.
ROUTER_QUANT = {"group_size": 64, "bits": 8}

CHECKPOINTS = {
    "qwen3-0.6b-4bit-g64": {"bits": 4, "group_size": 64, "shape": "0.6b"},
    "qwen3-0.6b-4bit-g128": {"bits": 4, "group_size": 128, "shape": "0.6b"},
    "qwen3-4b-4bit-g64": {"bits": 4, "group_size": 64, "shape": "4b"},
    "qwen3-8b-4bit-g64": {"bits": 4, "group_size": 64, "shape": "8b"},
    "qwen3-32b-4bit-g64": {"bits": 4, "group_size": 64, "shape": "32b"},
    "qwen3-30b-a3b-4bit-g64": {"bits": 4, "group_size": 64, "shape": "30b-a3b"},
    "qwen3-30b-a3b-8l-4bit-g64": {"bits": 4, "group_size": 64, "shape": "30b-a3b-8l"},
}

# Embedding rows dequantize to about +-EMBED_RANGE: with the tied output
# projection, logits then have a std near 1.
EMBED_RANGE = 0.05


def log(message):
    print(f"[make_checkpoint] {message}", file=sys.stderr, flush=True)


def script_hash():
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def to_bf16_bits(x):
    """float32 array -> uint16 bfloat16 bit patterns (round to nearest even)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounding = ((bits >> 16) & 1) + np.uint32(0x7FFF)
    return ((bits + rounding) >> 16).astype(np.uint16)


class Writer:
    """Collects tensors as MLX arrays, named as mlx-lm names them."""

    def __init__(self, rng, bits, group_size):
        import mlx.core as mx

        self.mx = mx
        self.rng = rng
        self.bits = bits
        self.group_size = group_size
        self.tensors = {}
        self.parameters = 0

    def bf16(self, x):
        mx = self.mx
        return mx.array(to_bf16_bits(x)).view(mx.bfloat16)

    def quantized(self, prefix, rows, cols, half_range, experts=None, quant=None):
        """`prefix`.weight (uint32 [rows, cols*bits/32], or [experts, rows,
        ...] stacked), .scales, .biases; `quant` overrides the bits and
        group size."""
        bits, g = (quant["bits"], quant["group_size"]) if quant else (self.bits, self.group_size)
        lead = (experts,) if experts else ()
        levels = (1 << bits) - 1
        packed = self.rng.integers(0, 1 << 32, size=lead + (rows, cols * bits // 32), dtype=np.uint32)
        # Per-group spread around the target range, so groups differ.
        spread = half_range * self.rng.uniform(0.75, 1.25, size=lead + (rows, cols // g)).astype(np.float32)
        scales = 2.0 * spread / levels
        biases = -spread
        self.tensors[f"{prefix}.weight"] = self.mx.array(packed)
        self.tensors[f"{prefix}.scales"] = self.bf16(scales)
        self.tensors[f"{prefix}.biases"] = self.bf16(biases)
        self.parameters += (experts or 1) * rows * cols

    def norm(self, name, dim):
        self.tensors[name] = self.bf16(self.rng.uniform(0.9, 1.1, size=dim).astype(np.float32))
        self.parameters += dim


def sparse_layers(config):
    """The layers with routed experts, as mlx-lm's qwen3_moe picks them
    (also for bench/report.py, from any checkpoint's config.json)."""
    if config.get("model_type") != "qwen3_moe" or not config.get("num_experts"):
        return []
    step = config.get("decoder_sparse_step") or 1
    dense = config.get("mlp_only_layers") or []
    return [i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0]


def build_weights(config, bits, group_size, rng):
    c = config
    w = Writer(rng, bits, group_size)
    d, hd, inter = c["hidden_size"], c["head_dim"], c["intermediate_size"]
    q_out = c["num_attention_heads"] * hd
    kv_out = c["num_key_value_heads"] * hd
    sparse = sparse_layers(c)
    w.quantized("model.embed_tokens", c["vocab_size"], d, EMBED_RANGE)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        for name, rows, cols in (
            ("self_attn.q_proj", q_out, d),
            ("self_attn.k_proj", kv_out, d),
            ("self_attn.v_proj", kv_out, d),
            ("self_attn.o_proj", d, q_out),
        ):
            w.quantized(f"{p}.{name}", rows, cols, 1.0 / math.sqrt(cols))
        if i in sparse:
            experts, mi = c["num_experts"], c["moe_intermediate_size"]
            w.quantized(f"{p}.mlp.gate", experts, d, 1.0 / math.sqrt(d), quant=ROUTER_QUANT)
            for name, rows, cols in (("gate_proj", mi, d), ("up_proj", mi, d), ("down_proj", d, mi)):
                w.quantized(f"{p}.mlp.switch_mlp.{name}", rows, cols, 1.0 / math.sqrt(cols), experts=experts)
        else:
            for name, rows, cols in (("gate_proj", inter, d), ("up_proj", inter, d), ("down_proj", d, inter)):
                w.quantized(f"{p}.mlp.{name}", rows, cols, 1.0 / math.sqrt(cols))
        w.norm(f"{p}.self_attn.q_norm.weight", hd)
        w.norm(f"{p}.self_attn.k_norm.weight", hd)
        w.norm(f"{p}.input_layernorm.weight", d)
        w.norm(f"{p}.post_attention_layernorm.weight", d)
    w.norm("model.norm.weight", d)
    if not c["tie_word_embeddings"]:
        w.quantized("lm_head", c["vocab_size"], d, EMBED_RANGE)
    return w


def write_checkpoint(folder, bits, group_size, shape, seed):
    import mlx.core as mx
    from mlx_lm.utils import save_config

    started = time.time()
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    config = dict(QWEN3_0_6B, **SHAPES[shape])
    w = build_weights(config, bits, group_size, rng)
    tensors = dict(sorted(w.tensors.items()))
    mx.save_safetensors(str(folder / "model.safetensors"), tensors, metadata={"format": "mlx"})
    index = {
        "metadata": {
            "total_size": sum(v.nbytes for v in tensors.values()),
            "total_parameters": w.parameters,
        },
        "weight_map": {k: "model.safetensors" for k in tensors},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    # As mlx_lm.utils.quantize_model records it; save_config copies it into
    # quantization_config.
    config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    for i in sparse_layers(config):
        config["quantization"][f"model.layers.{i}.mlp.gate"] = dict(ROUTER_QUANT)
    save_config(config, config_path=folder / "config.json")
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER_DIR / name, folder / name)
    log(
        f"wrote {folder.name}: {index['metadata']['total_size'] / 2**20:.1f} MiB, "
        f"{w.parameters / 1e6:.1f} M parameters in {time.time() - started:.1f} s"
    )


def check_logits(folder):
    """Loads `folder` with mlx-lm, runs a short float32 forward, checks logits."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    import mlx_compat

    mlx_compat.patch()
    model, config = load_model(folder)
    model.set_dtype(mx.float32)
    ids = mx.array([[785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13]])
    logits = model(ids).astype(mx.float32)
    mx.eval(logits)
    finite = bool(mx.all(mx.isfinite(logits)).item())
    stats = {
        "checkpoint": folder.name,
        "quantization": config.get("quantization"),
        "logits_shape": list(logits.shape),
        "finite": finite,
        "mean": round(logits.mean().item(), 4),
        "std": round(mx.sqrt(mx.var(logits)).item(), 4),
        "max_abs": round(mx.abs(logits).max().item(), 4),
        "greedy_next": mx.argmax(logits[0], axis=-1).tolist(),
    }
    print(f"[make_checkpoint] mlx-lm float32 forward check: {json.dumps(stats)}", flush=True)
    if not finite:
        raise SystemExit(f"{folder}: logits are not finite")
    return stats


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "bench")
    parser.add_argument("--only", default=",".join(CHECKPOINTS), help="comma-separated checkpoint names")
    parser.add_argument("--force", action="store_true", help="rebuild even when the stamp matches")
    args = parser.parse_args()

    if not (TOKENIZER_DIR / "tokenizer.json").exists():
        raise SystemExit(f"{TOKENIZER_DIR} is missing: run scripts/setup first")
    stamp = script_hash()
    for name in (n for n in args.only.split(",") if n):
        if name not in CHECKPOINTS:
            raise SystemExit(f"unknown checkpoint {name}; known: {', '.join(CHECKPOINTS)}")
        folder = args.out / name
        stamp_file = folder / ".stamp"
        if not args.force and stamp_file.exists() and stamp_file.read_text().strip() == stamp:
            log(f"{name}: up to date")
            continue
        spec = CHECKPOINTS[name]
        write_checkpoint(folder, spec["bits"], spec["group_size"], spec["shape"],
                         SEED + list(CHECKPOINTS).index(name))
        check_logits(folder)
        stamp_file.write_text(stamp + "\n")


if __name__ == "__main__":
    main()

"""Write the llama.cpp peer's checkpoint: a GGUF of the SAME weights as an MLX
bench checkpoint, quantized Q4_0 (4.5 bits per weight, like MLX 4-bit g64).

Usage:
    .venv/bin/python bench/make_gguf.py --model .cache/bench/qwen3-0.6b-4bit-g64
        [--out FILE]   (default: <model>/model-q4_0.gguf)

Every MLX weight is dequantized to float32 with MLX itself (so the GGUF holds
the model the engine and mlx-lm run, up to Q4_0's own rounding) and
quantized to Q4_0 by the `gguf` package; norms are stored as float32. A
Qwen3-MoE checkpoint (`qwen3_moe`) becomes llama.cpp's `qwen3moe`: each
layer's stacked experts `[experts, out, in]` Q4_0 and its router float32.
The tokenizer (needed for llama.cpp to load; the benchmark feeds token ids) is
the checkpoint's own tokenizer.json in llama.cpp's BPE form. The file is
skipped when it is newer than the checkpoint.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np

# MLX / Hugging Face name -> llama.cpp name, per layer.
LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
}
DENSE_MLP_NAMES = {
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
# A Qwen3-MoE layer's experts, stacked as mlx-lm's qwen3_moe stacks them.
EXPERT_NAMES = {
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}
ARCHES = {"qwen3": "qwen3", "qwen3_moe": "qwen3moe"}


def load_weights(folder):
    weights = {}
    for path in sorted(folder.glob("model*.safetensors")):
        weights.update(mx.load(str(path)))
    return weights


def dense(weights, prefix, quant):
    """`<prefix>.weight` as float32 numpy, dequantized when packed (with the
    checkpoint's quantization for `prefix`: its own entry, else the default)."""
    w = weights[f"{prefix}.weight"]
    quant = quant.get(prefix) if isinstance(quant.get(prefix), dict) else quant
    if f"{prefix}.scales" in weights:
        w = mx.dequantize(
            w,
            weights[f"{prefix}.scales"],
            weights[f"{prefix}.biases"],
            group_size=quant["group_size"],
            bits=quant["bits"],
        )
    return np.array(w.astype(mx.float32))


def add_tokenizer(writer, folder, vocab_size):
    tok = json.loads((folder / "tokenizer.json").read_text())
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        tokens[i], types[i] = text, gguf.TokenType.NORMAL
    for added in tok["added_tokens"]:
        i = added["id"]
        tokens[i] = added["content"]
        types[i] = gguf.TokenType.CONTROL if added["special"] else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(151645)
    writer.add_bos_token_id(151643)
    writer.add_add_bos_token(False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    folder = args.model
    out = args.out or folder / "model-q4_0.gguf"
    sources = list(folder.glob("model*.safetensors")) + [folder / "config.json"]
    if out.exists() and out.stat().st_mtime > max(p.stat().st_mtime for p in sources):
        print(f"[make_gguf] {out} is up to date", file=sys.stderr)
        return
    started = time.perf_counter()
    config = json.loads((folder / "config.json").read_text())
    arch = ARCHES.get(config.get("model_type"))
    if arch is None:
        raise SystemExit(f"make_gguf: only qwen3 and qwen3_moe checkpoints, not {config.get('model_type')}")
    quant = config.get("quantization") or {}
    weights = load_weights(folder)
    q4_0 = gguf.GGMLQuantizationType.Q4_0
    tmp = out.with_suffix(".gguf.partial")
    writer = gguf.GGUFWriter(str(tmp), arch)
    writer.add_name(folder.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "qwen3moe":
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    add_tokenizer(writer, folder, config["vocab_size"])

    def matrix(name, prefix):
        writer.add_tensor(name, gguf.quants.quantize(dense(weights, prefix, quant), q4_0), raw_dtype=q4_0)

    def vector(name, prefix):
        writer.add_tensor(name, dense(weights, prefix, quant))

    matrix("token_embd.weight", "model.embed_tokens")
    vector("output_norm.weight", "model.norm")
    if not config.get("tie_word_embeddings", False):
        matrix("output.weight", "lm_head")
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        # As mlx-lm's qwen3_moe: a layer has experts where they were written.
        sparse = f"{p}.mlp.gate.weight" in weights
        mlp = EXPERT_NAMES if sparse else DENSE_MLP_NAMES
        for hf, name in {**LAYER_NAMES, **mlp}.items():
            if name.endswith("norm"):
                vector(f"blk.{i}.{name}.weight", f"{p}.{hf}")
            else:
                matrix(f"blk.{i}.{name}.weight", f"{p}.{hf}")
        if sparse:
            vector(f"blk.{i}.ffn_gate_inp.weight", f"{p}.mlp.gate")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.rename(out)
    size = out.stat().st_size / 2**20
    print(f"[make_gguf] wrote {out} ({size:.1f} MiB) in {time.perf_counter() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()

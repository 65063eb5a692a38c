"""Tokenize bench/prompt.txt with the genuine Qwen3 tokenizer into the prompt
ids every peer uses, so all of them run on identical inputs.

Usage:
    .venv/bin/python bench/prompts.py [--out .cache/bench/prompts.json]
        [--decode-len 32] [--prefill-len 512] [--max-batch 8] [--batch-len N]

Writes a JSON object:
    decode   the batch-1 decode prompt (the first --decode-len ids)
    prefill  the prefill / time-to-first-token prompt (--prefill-len ids)
    batch    --max-batch prompts of --batch-len ids each, consecutive
             slices of the text, so rows differ but have equal lengths
    sha256   a digest of the three lists, printed in the results
and the same as an Elixir term next to it (prompts.exs), for the Elixir peer,
which has no JSON library.
"""

import argparse
import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / ".cache" / "bench" / "prompts.json")
    parser.add_argument("--tokenizer", type=Path, default=ROOT / ".cache" / "tokenizer-qwen3" / "tokenizer.json")
    parser.add_argument("--text", type=Path, default=ROOT / "bench" / "prompt.txt")
    parser.add_argument("--decode-len", type=int, default=32)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--batch-len", type=int, help="ids per batch row (default: --decode-len)")
    args = parser.parse_args()
    args.batch_len = args.batch_len or args.decode_len

    tokenizer = Tokenizer.from_file(str(args.tokenizer))
    ids = tokenizer.encode(args.text.read_text(), add_special_tokens=False).ids
    # Repeat the text if a longer prompt is asked for than it gives.
    need = max(args.prefill_len, args.decode_len, args.batch_len * args.max_batch)
    stream = list(ids)
    while len(stream) < need:
        stream += ids
    prompts = {
        "decode": stream[: args.decode_len],
        "prefill": stream[: args.prefill_len],
        "batch": [stream[i * args.batch_len : (i + 1) * args.batch_len] for i in range(args.max_batch)],
        "text_tokens": len(ids),
    }
    digest = hashlib.sha256(
        json.dumps([prompts["decode"], prompts["prefill"], prompts["batch"]]).encode()
    ).hexdigest()[:16]
    prompts["sha256"] = digest
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(prompts) + "\n")
    ints = lambda ids: "[" + ", ".join(map(str, ids)) + "]"
    exs = (
        f"%{{decode: {ints(prompts['decode'])},\n prefill: {ints(prompts['prefill'])},\n"
        f" batch: [{', '.join(ints(b) for b in prompts['batch'])}],\n sha256: {json.dumps(digest)}}}\n"
    )
    args.out.with_suffix(".exs").write_text(exs)
    print(
        f"[prompts] {args.out}: decode {len(prompts['decode'])} ids, prefill {len(prompts['prefill'])} ids, "
        f"batch {args.max_batch} x {args.batch_len} ids (text: {len(ids)} tokens), sha256 {digest}"
    )


if __name__ == "__main__":
    main()

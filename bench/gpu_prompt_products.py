"""A prompt's 4-bit products on a GPU through MLX alone: `quantized_matmul`
against `matmul` of the weight dequantized in the same graph (what the
engine's CUDA prompt path runs from `DEQUANTIZED_WORK` on), and against a
matmul of a weight already dense (the floor), for the products of the Qwen3
shapes (q, k and v, o, gate and up, down; 4-bit, groups of 64, bfloat16) at
512, 1,024 and 2,048 token rows.

Usage (on the GPU machine, with the mlx-cuda wheel):
    python3 bench/gpu_prompt_products.py [8b 0.6b 4b]

Each time is the mean of 20 products queued in one graph, after 3 warm-up
evaluations. The per-layer sums count k and v, and gate and up, twice; the
2,048-token line multiplies a layer by the layers and the chunks a
2,048-token prompt takes at that chunk size. `relerr` is the largest
difference between MLX's quantized product and the dense matmul over the
largest output.
"""

import sys
import time

import mlx.core as mx

SHAPES = {
    "8b": dict(h=4096, q=4096, kv=1024, i=12288, layers=36),
    "0.6b": dict(h=1024, q=2048, kv=1024, i=3072, layers=28),
    "4b": dict(h=2560, q=4096, kv=1024, i=9728, layers=36),
}


def products(s):
    """(name, outputs, inputs, count per layer)."""
    h, q, kv, i = s["h"], s["q"], s["kv"], s["i"]
    return [("q", q, h, 1), ("kv", kv, h, 2), ("o", h, q, 1), ("gate_up", i, h, 2), ("down", h, i, 1)]


def timed(f, reps=20):
    for _ in range(3):
        mx.eval(f())
    mx.synchronize()
    start = time.perf_counter()
    mx.eval([f() for _ in range(reps)])
    mx.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


def main():
    mx.random.seed(0)
    q = dict(group_size=64, bits=4)
    for name in sys.argv[1:] or ["8b", "0.6b"]:
        s = SHAPES[name]
        for m in (512, 1024, 2048):
            total = {"qmm": 0.0, "deq+mm": 0.0, "mm": 0.0, "deq": 0.0}
            for part, n, k, count in products(s):
                w = (mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16)
                wq, scales, biases = mx.quantize(w, **q)
                dense = mx.dequantize(wq, scales, biases, **q)
                x = mx.random.normal((m, k)).astype(mx.bfloat16)
                mx.eval(wq, scales, biases, dense, x)
                t = {
                    "qmm": timed(lambda: mx.quantized_matmul(x, wq, scales, biases, transpose=True, **q)),
                    "deq+mm": timed(lambda: mx.matmul(x, mx.dequantize(wq, scales, biases, **q).T)),
                    "mm": timed(lambda: mx.matmul(x, dense.T)),
                    "deq": timed(lambda: mx.dequantize(wq, scales, biases, **q)),
                }
                theirs = mx.quantized_matmul(x, wq, scales, biases, transpose=True, **q).astype(mx.float32)
                ours = mx.matmul(x, dense.T).astype(mx.float32)
                err = (mx.abs(theirs - ours).max() / mx.abs(ours).max()).item()
                flop = 2 * m * n * k
                print(
                    f"{name} M={m} {part} N={n} K={k}: qmm {t['qmm']:.3f} ms ({flop / t['qmm'] / 1e9:.0f} TF/s) "
                    f"deq+mm {t['deq+mm']:.3f} mm {t['mm']:.3f} ({flop / t['mm'] / 1e9:.0f} TF/s) "
                    f"deq {t['deq']:.3f} relerr {err:.2e}",
                    flush=True,
                )
                for key in total:
                    total[key] += t[key] * count
            chunks = s["layers"] * 2048 / m
            print(
                f"== {name} M={m}: per layer qmm {total['qmm']:.3f} deq+mm {total['deq+mm']:.3f} "
                f"mm {total['mm']:.3f} deq {total['deq']:.3f} ms; 2048-token prompt products: "
                f"qmm {total['qmm'] * chunks:.1f} ms, deq+mm {total['deq+mm'] * chunks:.1f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()

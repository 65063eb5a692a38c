"""mlx-lm 0.32.2 beside MLX 0.32.2: mlx-lm's quantized expert layers pass
`global_scale` (None for affine quantization) to `mx.gather_qmm`, which
MLX 0.32.2 does not take yet. `patch()` drops it when None, which leaves the
call as MLX defines it (the fixture and bench scripts that run Qwen3-MoE
call it before running a model)."""

import mlx.core as mx


def patch():
    if getattr(mx.gather_qmm, "drops_global_scale", False):
        return
    original = mx.gather_qmm

    def gather_qmm(*args, global_scale=None, **kwargs):
        if global_scale is not None:
            raise ValueError("global_scale needs a newer MLX")
        return original(*args, **kwargs)

    gather_qmm.drops_global_scale = True
    mx.gather_qmm = gather_qmm

"""Tuned kernel configurations: written by ``python -m benchmarks.tune`` on the GPU it names.

device kind -> {(QK depth, V depth, dtype, mask kind, long prompts): (block_q, block_kv,
num_warps, num_stages)}. The QK depth is the sum of the logit terms' padded widths (MLA's
128 + 64 is 192); "long" means max_prompt_len > config.LONG_PROMPT. BUILD_NOTES.md, "Tile
sweeps", says where each entry was measured.
"""

TUNED = {
    "NVIDIA H200": {
        (128, 128, "bfloat16", "CausalMask", False): (64, 32, 4, 3),
        (128, 128, "bfloat16", "CausalMask", True): (64, 32, 4, 3),
        (192, 128, "bfloat16", "CausalMask", False): (64, 32, 4, 2),
        (192, 128, "bfloat16", "CausalMask", True): (128, 32, 4, 3),
    },
}

# backend="mosaic_gpu": device kind -> {key as above: (block_q, block_kv, num_stages,
# num_programs, faster than Triton)}; the last field is what backend="auto" follows: on a
# Hopper GPU it runs Mosaic GPU wherever it serves the call except where an entry (the
# mask's own, else the causal one) says False. ``python -m benchmarks.tune --verdicts``
# measures the verdicts: on the H200 (2026-12-01) Mosaic GPU won every measured case (MHA
# depths 64, 128, 256, MLA 192/128, every mask kind, bf16 and f16, short and long
# prompts) but MHA at depth 64 on short prompts (Triton 122 useful TFLOP/s against 111,
# one measurement). For batch invariance (issue 25) neither the tiles nor the backend may
# depend on max_prompt_len: ``config.default_mosaic_config`` takes the long-prompt entry
# (else the short one) at every length, so MLA's short-prompt tiles below are no
# default now, and ``config.prefers_triton`` keeps Triton only where both lengths' entries
# say False, so MHA at depth 64 runs Mosaic GPU on short prompts too.
TUNED_MOSAIC = {
    "NVIDIA H200": {
        (128, 128, "bfloat16", "CausalMask", False): (64, 128, 2, None, True),
        (128, 128, "bfloat16", "CausalMask", True): (64, 128, 2, None, True),
        (192, 128, "bfloat16", "CausalMask", False): (64, 64, 3, None, True),
        (192, 128, "bfloat16", "CausalMask", True): (64, 128, 2, None, True),
        (64, 64, "bfloat16", "CausalMask", False): (64, 128, 2, None, False),
    },
}

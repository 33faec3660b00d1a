"""The anchor workloads (../shared/notes/anchors-h200.md) and the useful-FLOP count."""

from __future__ import annotations

import numpy as np

from pallas_prefill import masks as masks_lib

WORKLOADS = {
    "equal4x4096": [4096] * 4,
    "skew16_16k": [4096, 2048, 1800, 1500, 1200, 1000, 900, 800, 700, 600, 500, 400, 300,
                   200, 100, 37],
    "short64": [int(x) for x in np.random.default_rng(0).integers(16, 512, 64)],
}


def offsets(lengths) -> np.ndarray:
  return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def visible_pairs(q_lens, kv_lens=None, mask=masks_lib.CausalMask()) -> int:
  """(query, key) pairs the mask leaves visible: each mask's visible keys for one query
  form one contiguous range, so ``kv_range`` of a single position counts them."""
  kv_lens = q_lens if kv_lens is None else kv_lens
  total = 0
  for q_len, kv_len in zip(q_lens, kv_lens):
    pos = np.arange(q_len, dtype=np.int64) + (kv_len - q_len)
    lo, hi = mask.kv_range(pos, pos, np.int64(kv_len))
    total += int(np.maximum(np.asarray(hi) - np.asarray(lo), 0).sum())
  return total


def useful_flops(q_lens, num_heads, qk_depth, v_depth, kv_lens=None,
                 mask=masks_lib.CausalMask()) -> float:
  """2 * heads * (d_qk + d_v) * visible pairs: FLOPs of the real tokens only."""
  return 2.0 * num_heads * (qk_depth + v_depth) * visible_pairs(q_lens, kv_lens, mask)

"""The benchmark workloads (../shared/notes/anchors-h200.md, issues 5 and 25) and the
useful-FLOP count."""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_prefill import masks as masks_lib

CAUSAL = masks_lib.CausalMask()

WORKLOADS_LENGTHS = {
    "equal4x4096": [4096] * 4,
    "skew16_16k": [4096, 2048, 1800, 1500, 1200, 1000, 900, 800, 700, 600, 500, 400, 300,
                   200, 100, 37],
    "short64": [int(x) for x in np.random.default_rng(0).integers(16, 512, 64)],
    # One long prompt (issue 25): its target is a fraction of the bf16 matmul rate the
    # same run measures (the report's "of matmul" table).
    "long16384": [16384],
}


@dataclasses.dataclass(frozen=True)
class Workload:
  """One batch: its query lengths, the K/V lengths when they differ (cached prefix), the
  mask, and the page size when the K/V sit in a paged cache."""

  name: str
  q_lens: tuple[int, ...]
  kv_lens: tuple[int, ...] | None = None
  mask: object = CAUSAL
  page_size: int | None = None
  kernels: tuple[str, ...] = ("mha", "mla")

  @property
  def max_len(self) -> int:
    return max(self.q_lens)


WORKLOADS = {
    **{name: Workload(name, tuple(lens)) for name, lens in WORKLOADS_LENGTHS.items()},
    "sliding4x16384_w4096": Workload("sliding4x16384_w4096", (16384,) * 4,
                                     mask=masks_lib.SlidingWindowCausalMask(4096),
                                     kernels=("mha",)),
    "chunked8x512_page64": Workload(
        "chunked8x512_page64", (512,) * 8,
        kv_lens=tuple(c + 512 for c in (0, 1024, 2048, 3072, 4096, 5120, 6144, 8192)),
        page_size=64),
    # Paged caches at other sizes, for the backends' choice on them (not in the default
    # run): 16-row pages (the Mosaic GPU backend gathers them), and short prompts over
    # 512-token cached prefixes.
    "chunked8x512_page16": Workload(
        "chunked8x512_page16", (512,) * 8,
        kv_lens=tuple(c + 512 for c in (0, 1024, 2048, 3072, 4096, 5120, 6144, 8192)),
        page_size=16),
    "short64_prefix512_page64": Workload(
        "short64_prefix512_page64", tuple(WORKLOADS_LENGTHS["short64"]),
        kv_lens=tuple(n + 512 for n in WORKLOADS_LENGTHS["short64"]), page_size=64),
    # A few hundred tokens: the harness's own CPU tests (interpret mode) run these.
    "tiny": Workload("tiny", (37, 1, 100)),
    "tiny_paged": Workload("tiny_paged", (37, 1, 100), kv_lens=(50, 1, 130), page_size=16),
}
SMOKE = ("tiny", "tiny_paged")
EXTRA = ("chunked8x512_page16", "short64_prefix512_page64")  # on request only


def offsets(lengths) -> np.ndarray:
  return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def visible_pairs(q_lens, kv_lens=None, mask=CAUSAL) -> int:
  """(query, key) pairs the mask leaves visible: each mask's visible keys for one query
  form one contiguous range, so ``kv_range`` of a single position counts them."""
  kv_lens = q_lens if kv_lens is None else kv_lens
  total = 0
  for q_len, kv_len in zip(q_lens, kv_lens):
    pos = np.arange(q_len, dtype=np.int64) + (kv_len - q_len)
    lo, hi = mask.kv_range(pos, pos, np.int64(kv_len))
    seen = np.broadcast_to(np.asarray(hi) - np.asarray(lo), pos.shape)  # NullMask: scalar
    total += int(np.maximum(seen, 0).sum())
  return total


def useful_flops(q_lens, num_heads, qk_depth, v_depth, kv_lens=None, mask=CAUSAL) -> float:
  """2 * heads * (d_qk + d_v) * visible pairs: FLOPs of the real tokens only."""
  return 2.0 * num_heads * (qk_depth + v_depth) * visible_pairs(q_lens, kv_lens, mask)

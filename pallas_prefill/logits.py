"""How the entry points hand their operands to a backend: the logits as a sum of ``QkPart``
terms over Q and K operands whose depths are padded to what the kernels run.

MHA forms its logits from one term (``q . k``), MLA from two (``q_nope . k_nope`` and
``q_rope . k_rope``, the rope K shared by every head); softmax, masking, ragged indexing and
tiling are the same code in each backend.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_prefill.constants import LOG2_E
from pallas_prefill.paged import PagedKV


@dataclasses.dataclass(frozen=True)
class QkPart:
  """One term of the logits: ``q[:, h, q_col:q_col+width] . k[:, kv_head, k_col:k_col+width]``.

  ``q_index``/``k_index`` pick among the kernel's Q and K operands; ``shared_k`` means the K
  operand has one head that every query head uses (MLA's rope key). ``width`` is a power of
  two, as every tensor shape in a Triton kernel must be.
  """

  q_index: int
  q_col: int
  k_index: int
  k_col: int
  width: int
  shared_k: bool = False


def padded_depth(depth: int) -> int:
  """The power-of-two depth (at least 16, the smallest matrix-instruction K) a depth runs at."""
  return max(16, 1 << (depth - 1).bit_length())


def pad_depth(x, depth: int):
  """Zero-pads the last axis of x to `depth` (a no-op when it already has that size)."""
  extra = depth - x.shape[-1]
  return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])


def unpage(*operands):
  """The arrays behind K/V operands, plus (block_table, cache_lengths) when they are
  PagedKV (taken from the first: all share one block table) or None."""
  if not isinstance(operands[0], PagedKV):
    return (*operands, None)
  first = operands[0]
  return (*(x.pages for x in operands), (first.block_table, first.cache_lengths))


# Below this |s / cap|, ``soft_capped`` takes tanh's odd series to y**7 (relative error
# under 2e-9 there), where 1 - 2 / (2**(2y log2 e) + 1) would cancel to an absolute error
# of float32's epsilon: times the cap, a logit error that grows with the cap.
TANH_SERIES_BELOW = 0.125


def soft_capped(s, cap):
  """``cap * tanh(s / cap)``, Gemma 2's logit soft cap, as the Triton kernel computes it:
  from ``exp2`` (tanh(y) = 1 - 2 / (2**(2y log2 e) + 1)), and for |y| below
  ``TANH_SERIES_BELOW`` from tanh's series, so that the result is within a few float32
  roundings of s's capped value relative to it, for any cap (a cap far above the logits
  leaves them as they are), and finite for every finite s (2**x overflows to inf, and
  2 / inf is 0). The kernels pass logits already in base 2 with ``cap * log2(e)``: the
  cap commutes with that scaling. (Mosaic GPU takes the hardware's approximate tanh
  instead: ``kernel.attend_tile``.)"""
  y = s * (1.0 / cap)
  wide = 1.0 - 2.0 / (jnp.exp2(y * (2.0 * LOG2_E)) + 1.0)
  y2 = y * y
  series = y + y * y2 * (-1.0 / 3 + y2 * (2.0 / 15 + y2 * (-17.0 / 315)))
  return cap * jnp.where(jnp.abs(y) < TANH_SERIES_BELOW, series, wide)


def kv_rows(kv_offsets):
  """The (starts, ends) K/V row ranges [batch] each of cumulative K/V offsets
  [batch + 1] (the ragged entry points' ``kv_input_row_offsets``), or None for None."""
  if kv_offsets is None:
    return None
  return kv_offsets[:-1], kv_offsets[1:]

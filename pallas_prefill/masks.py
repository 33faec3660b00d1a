"""Attention masks: small frozen dataclasses, hashable, usable as static jit arguments.

Positions are absolute within a sequence: key j sits at position j of its K/V range, and
query i of a sequence with ``q_len`` queries over ``kv_len`` keys sits at position
``start_pos + i`` where ``start_pos = kv_len - q_len`` (a cached prefix makes it positive,
cross-attention with fewer keys than queries makes it negative). The causal masks are thus
aligned at the bottom right.

Every mask answers four questions, each with plain ``jnp`` integer arithmetic so that the
same code runs inside the Pallas kernel, in interpret mode and in the reference:

- ``visible(q_pos, k_pos)``: elementwise, whether the key is visible to the query.
- ``key_range(q_pos)``: elementwise, the half-open range ``[lo, hi)`` of the keys (at
  positions >= 0) a query at ``q_pos`` sees: every mask shows a query one run of keys
  (the Mosaic GPU kernel masks a tile's scores by their column against the row's range).
  A bound that does not depend on the query is an int32 scalar (it broadcasts).
- ``kv_range(q_lo, q_hi, kv_len)``: the half-open key range ``[lo, hi)`` outside which no
  query with a position in ``[q_lo, q_hi]`` sees any key. The kernel skips the KV tiles
  outside it.
- ``full_range(q_lo, q_hi, kv_len)``: the key range that every query in ``[q_lo, q_hi]``
  sees in full. KV tiles inside it are computed without any masking.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax


# NullMask.key_range's end: past every key (positions stay below 2**30).
KEY_RANGE_END = 2**31 - 1

# A window or chunk bound: positions are int32 and can be negative (cross-attention), so
# q_pos - window must not wrap; no sequence comes near 2**30 tokens.
MAX_SPAN = 2**30


def _clip(x, kv_len):
  return jnp.clip(x, 0, kv_len)


def _check_span(mask, field):
  """The mask's ``field`` as a Python int in [1, MAX_SPAN] (NumPy ints accepted)."""
  value = getattr(mask, field)
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not (
      1 <= value <= MAX_SPAN):
    raise ValueError(f"{type(mask).__name__}.{field} must be an int >= 1, got {value!r} "
                     "(and at most 2**30)")
  object.__setattr__(mask, field, int(value))


@dataclasses.dataclass(frozen=True)
class NullMask:
  """No masking: every query sees every key of its sequence."""

  def visible(self, q_pos, k_pos):
    return jnp.full(jnp.broadcast_shapes(jnp.shape(q_pos), jnp.shape(k_pos)), True)

  def key_range(self, q_pos):
    del q_pos
    return jnp.int32(0), jnp.int32(KEY_RANGE_END)

  def kv_range(self, q_lo, q_hi, kv_len):
    del q_lo, q_hi
    return jnp.zeros_like(kv_len), kv_len

  def full_range(self, q_lo, q_hi, kv_len):
    return self.kv_range(q_lo, q_hi, kv_len)


@dataclasses.dataclass(frozen=True)
class CausalMask:
  """Key visible iff ``k_pos <= q_pos``."""

  def visible(self, q_pos, k_pos):
    return k_pos <= q_pos

  def key_range(self, q_pos):
    return jnp.int32(0), q_pos + 1

  def kv_range(self, q_lo, q_hi, kv_len):
    del q_lo
    return jnp.zeros_like(kv_len), _clip(q_hi + 1, kv_len)

  def full_range(self, q_lo, q_hi, kv_len):
    del q_hi
    return jnp.zeros_like(kv_len), _clip(q_lo + 1, kv_len)


@dataclasses.dataclass(frozen=True)
class SlidingWindowCausalMask:
  """Key visible iff ``q_pos - window < k_pos <= q_pos``: each query sees ``window`` keys."""

  window: int

  def __post_init__(self):
    _check_span(self, "window")

  def visible(self, q_pos, k_pos):
    return (k_pos <= q_pos) & (k_pos > q_pos - self.window)

  def key_range(self, q_pos):
    return q_pos - self.window + 1, q_pos + 1

  def kv_range(self, q_lo, q_hi, kv_len):
    return _clip(q_lo - self.window + 1, kv_len), _clip(q_hi + 1, kv_len)

  def full_range(self, q_lo, q_hi, kv_len):
    lo = _clip(q_hi - self.window + 1, kv_len)
    return lo, jnp.maximum(lo, _clip(q_lo + 1, kv_len))


@dataclasses.dataclass(frozen=True)
class ChunkedCausalMask:
  """Causal within fixed chunks: key visible iff ``k_pos <= q_pos`` and
  ``q_pos // chunk == k_pos // chunk`` (Llama 4's chunked local attention)."""

  chunk: int

  def __post_init__(self):
    _check_span(self, "chunk")

  def _chunk_start(self, pos):
    # Keys have positions >= 0, so a query at a negative position sees none of them
    # anyway; clamping first keeps the division on non-negative numbers.
    pos = jnp.maximum(pos, 0)
    return lax.div(pos, jnp.asarray(self.chunk, pos.dtype)) * self.chunk

  def visible(self, q_pos, k_pos):
    same_chunk = jnp.floor_divide(q_pos, self.chunk) == jnp.floor_divide(k_pos, self.chunk)
    return (k_pos <= q_pos) & same_chunk

  def key_range(self, q_pos):
    return self._chunk_start(q_pos), q_pos + 1

  def kv_range(self, q_lo, q_hi, kv_len):
    return _clip(self._chunk_start(q_lo), kv_len), _clip(q_hi + 1, kv_len)

  def full_range(self, q_lo, q_hi, kv_len):
    lo = _clip(self._chunk_start(q_hi), kv_len)
    return lo, jnp.maximum(lo, _clip(q_lo + 1, kv_len))


Mask = NullMask | CausalMask | SlidingWindowCausalMask | ChunkedCausalMask
MASK_TYPES = (NullMask, CausalMask, SlidingWindowCausalMask, ChunkedCausalMask)


def key_range_starts_at_zero(mask) -> bool:
  """Whether ``mask.key_range``'s lower bound is 0 for every query (the null and causal
  masks; tests/test_masks.py checks it against ``visible``): a static fact of the mask's
  type, so that a kernel may leave the bound out."""
  return isinstance(mask, (NullMask, CausalMask))

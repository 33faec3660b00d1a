"""Argument checks shared by the entry points: static ones raise at trace time, data ones
(`validate_offsets`) run whenever the offsets are concrete."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_prefill import masks as masks_lib
from pallas_prefill.config import MhaConfig

MAX_HEAD_DIM = 256
INPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
OFFSET_DTYPES = (jnp.int32, jnp.uint32)


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_array(name, x, rank):
  shape = getattr(x, "shape", None)
  if shape is None or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if len(shape) != rank:
    raise ValueError(f"{name} must have rank {rank}, got shape {tuple(shape)}")


def check_float_dtype(name, x):
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in INPUT_DTYPES]:
    raise TypeError(f"{name} must be bfloat16, float16 or float32, got {x.dtype}")


def check_offsets(name, offsets, batch=None):
  check_array(name, offsets, 1)
  if jnp.dtype(offsets.dtype) not in [jnp.dtype(d) for d in OFFSET_DTYPES]:
    raise TypeError(f"{name} must be int32 or uint32, got {offsets.dtype}")
  if offsets.shape[0] < 2:
    raise ValueError(f"{name} must have length batch + 1 >= 2, got {offsets.shape[0]}")
  if batch is not None and offsets.shape[0] != batch + 1:
    raise ValueError(
        f"{name} must have length batch + 1 = {batch + 1} like input_row_offsets, "
        f"got {offsets.shape[0]}")


def check_head_dim(name, depth):
  if not 1 <= depth <= MAX_HEAD_DIM:
    raise ValueError(f"{name} must be between 1 and {MAX_HEAD_DIM}, got {depth}")


def check_options(*, max_prompt_len, mask, scale, output_dtype, config, interpret):
  if isinstance(max_prompt_len, bool) or not isinstance(max_prompt_len, (int, np.integer)):
    raise TypeError(
        f"max_prompt_len must be a static Python int, got {type(max_prompt_len).__name__}")
  if max_prompt_len <= 0:
    raise ValueError(f"max_prompt_len must be > 0, got {max_prompt_len}")
  if not isinstance(mask, masks_lib.MASK_TYPES):
    raise TypeError(
        "mask must be one of pallas_prefill.masks.CausalMask(), NullMask(), "
        f"SlidingWindowCausalMask(window), ChunkedCausalMask(chunk); got {mask!r}")
  if scale is not None and (
      isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating))
      or not math.isfinite(scale)):
    raise TypeError(f"scale must be a finite Python float or None, got {scale!r}")
  if output_dtype is not None and jnp.dtype(output_dtype) not in [
      jnp.dtype(d) for d in INPUT_DTYPES]:
    raise TypeError(
        f"output_dtype must be bfloat16, float16, float32 or None, got {output_dtype}")
  if config is not None and not isinstance(config, MhaConfig):
    raise TypeError(f"config must be a pallas_prefill.MhaConfig or None, got {config!r}")
  if interpret not in (None, True, False):
    raise TypeError(f"interpret must be None, True or False, got {interpret!r}")


def validate_offsets(input_row_offsets, *, max_prompt_len, total_q,
                     kv_input_row_offsets=None, total_kv=None):
  """Checks concrete row offsets against the arrays they index; raises ValueError.

  Args:
    input_row_offsets: [batch + 1] int32/uint32 query row offsets.
    max_prompt_len: every sequence's query count must be at most this.
    total_q: rows of the packed query array.
    kv_input_row_offsets: optional [batch + 1] K/V row offsets.
    total_kv: rows of the packed K/V arrays (needed with kv_input_row_offsets).

  Raises:
    ValueError: the first offset is not 0, the offsets decrease, the last offset is past
      the array, or a sequence has more than max_prompt_len queries. The message names the
      offending sequence.
  """
  for name, offsets, total in (
      ("input_row_offsets", input_row_offsets, total_q),
      ("kv_input_row_offsets", kv_input_row_offsets, total_kv)):
    if offsets is None:
      continue
    off = np.asarray(offsets).astype(np.int64)
    if off.ndim != 1 or off.shape[0] < 2:
      raise ValueError(f"{name} must be a vector of length batch + 1 >= 2, got {off.shape}")
    if off[0] != 0:
      raise ValueError(f"{name}[0] must be 0, got {off[0]}")
    lengths = np.diff(off)
    if (lengths < 0).any():
      b = int(np.argmax(lengths < 0))
      raise ValueError(f"{name} must be nondecreasing: {name}[{b + 1}] = {off[b + 1]} < "
                       f"{name}[{b}] = {off[b]}")
    if off[-1] > total:
      raise ValueError(f"{name}[-1] = {off[-1]} is past the {total} rows of the array")
    if name == "input_row_offsets" and (lengths > max_prompt_len).any():
      b = int(np.argmax(lengths > max_prompt_len))
      raise ValueError(f"sequence {b} has {lengths[b]} queries, more than "
                       f"max_prompt_len = {max_prompt_len}")

"""The argument checks that need nothing else of the package: an array of a rank, and row
offsets. ``validation`` (the entry points' checks) and ``paged`` (``write_kv``, which
``validation`` imports) both use them."""

from __future__ import annotations

import jax.numpy as jnp

OFFSET_DTYPES = (jnp.int32, jnp.uint32)


def check_array(name, x, rank):
  shape = getattr(x, "shape", None)
  if shape is None or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if len(shape) != rank:
    raise ValueError(f"{name} must have rank {rank}, got shape {tuple(shape)}")


def check_offsets(name, offsets, batch=None):
  check_array(name, offsets, 1)
  if jnp.dtype(offsets.dtype) not in [jnp.dtype(d) for d in OFFSET_DTYPES]:
    raise TypeError(f"{name} must be int32 or uint32, got {offsets.dtype}")
  if offsets.shape[0] < 1:
    raise ValueError(f"{name} must have length batch + 1 >= 1, got {offsets.shape[0]}")
  if batch is not None and offsets.shape[0] != batch + 1:
    raise ValueError(
        f"{name} must have length batch + 1 = {batch + 1} like input_row_offsets, "
        f"got {offsets.shape[0]}")

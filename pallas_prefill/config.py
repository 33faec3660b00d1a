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


# Tuned on an H200 (BUILD_NOTES.md, "Tile sweeps"): device kind -> {(QK depth, V depth,
# input itemsize, long prompts): config}. The QK depth is the sum of the logit terms'
# padded widths (MLA's 128 + 64 is 192); "long" means max_prompt_len > LONG_PROMPT.
LONG_PROMPT = 1024
_TUNED: dict[str, dict[tuple[int, int, int, bool], MhaConfig]] = {
    "NVIDIA H200": {
        (128, 128, 2, False): MhaConfig(block_q=64, block_kv=32, num_warps=4, num_stages=3),
        (128, 128, 2, True): MhaConfig(block_q=64, block_kv=32, num_warps=4, num_stages=3),
        (192, 128, 2, False): MhaConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2),
        (192, 128, 2, True): MhaConfig(block_q=128, block_kv=32, num_warps=4, num_stages=3),
    },
}


def _device_kind() -> str:
  """The device being compiled for: an abstract mesh's device (ahead-of-time lowering for
  another GPU) if one is set, else the default device."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None:
    return abstract.device_kind
  return jax.devices()[0].device_kind


def default_config(qk_depth: int, v_depth: int, dtype, max_prompt_len: int) -> MhaConfig:
  """The configuration ``config=None`` uses for these padded depths, dtype and prompt length.

  Looks up the table tuned for the device; an unknown device or shape gets a safe default:
  64 x 32 tiles, which keep Q, the K/V stages and the accumulator well inside shared
  memory and registers up to depth 256 in float32.
  """
  itemsize = jnp.dtype(dtype).itemsize
  key = (qk_depth, v_depth, itemsize, max_prompt_len > LONG_PROMPT)
  tuned = _TUNED.get(_device_kind(), {}).get(key)
  if tuned is not None:
    return tuned
  wide = max(qk_depth, v_depth) * itemsize > 256  # wider than bf16 at depth 128
  return MhaConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2 if wide else 3)

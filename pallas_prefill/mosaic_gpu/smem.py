"""Shared-memory planning of the Mosaic GPU kernel: its scratch as a named structure
(``Scratch``, what ``kernel`` allocates) and the bytes that allocation takes, from which
the output buffers, the fitted default configs and the refusals follow.

Q, K and V live in 64-column buffers (one per ``layout.CHUNK`` columns) that TMA fills
untiled, from any row of arrays of any row count, and that the matrix products read
through an (8, 64)-tiled view of the same bytes (a ``plgpu.RefUnion``).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_prefill.config import MosaicConfig
from pallas_prefill.fp8 import is_fp8
from pallas_prefill.mosaic_gpu import layout as L

# Pallas Mosaic GPU aligns every scratch buffer to this many bytes; a barrier takes 8.
SMEM_ALIGNMENT = 1024
BARRIER_BYTES = 8


@functools.partial(jax.tree_util.register_dataclass, meta_fields=[], data_fields=[
    "q", "k", "v", "p", "o", "zeros", "lse", "units", "q_loaded", "k_loaded", "v_loaded",
    "k_consumed", "v_consumed", "unit_ready", "unit_used"])
@dataclasses.dataclass(frozen=True)
class Scratch:
  """The kernel's shared memory and barriers, by name: allocation specs before
  ``pl.run_scoped``, refs inside it. A "lane" is one K/V stream of ``num_stages`` slots
  (one, or with split units one per compute warpgroup).

  Attributes:
    q: per 64-column chunk of the logit parts, [wgs, block_q, 64] (untiled, tiled), wgs
      the compute warpgroups (``MosaicConfig.compute_wgs``).
    k: per chunk, [lanes * num_stages, block_kv, 64] (untiled, tiled).
    v: per 64 columns of V, [lanes * num_stages, block_kv, 64] (untiled, tiled); FP8:
      of V transposed, [lanes * num_stages * groups, 64, block_kv / groups] (FP8 matrix
      products read both operands K-major: the keys, P.V's contraction, along a row),
      slot s's keys [128 g, 128 (g + 1)) at s * groups + g, ``layout.vt_groups``: a
      256-key tile's rows of 256 bytes are two buffers (a TMA swizzle spans 128 bytes).
    p: FP8 only (else None, and None where P stays in registers): P quantized,
      [wgs, block_q, block_kv], P.V's A operand from shared memory.
    o: ``out_buffers`` output buffers [wgs, block_q, 64] of the output dtype.
    zeros: [block_q, 64] of the output dtype, zeros that every compute warpgroup writes
      once (the same bytes, so no order among them matters) and the TMA unit copies to
      key-less rows (``MosaicOptions.keyless_units="bulk"``), or None.
    lse: [wgs, block_q] float32, or None without the LSE.
    units: the claimed units' slots [2 * lanes] int32, or None (static deal).
    q_loaded .. v_consumed: per warpgroup (Q) or per K/V slot, the TMA and release
      barriers; unit_ready / unit_used: per unit slot, or None.
  """

  q: list
  k: list
  v: list
  p: object
  o: list
  zeros: object
  lse: object
  units: object
  q_loaded: object
  k_loaded: object
  v_loaded: object
  k_consumed: object
  v_consumed: object
  unit_ready: object
  unit_used: object


def scratch(*, chunks: int, v_chunks: int, dtype, out_dtype, out_buffers: int, has_lse: bool,
            block_q: int, block_kv: int, num_stages: int, split: bool, dynamic: bool,
            pages: int, paged: bool, one_v_copy: bool = False, p_smem: bool = True,
            wgs: int = L.COMPUTE_WGS, zero_buffer: bool = False) -> Scratch:
  """The allocation specs of the kernel's scratch (``Scratch``): ``chunks`` 64-column
  chunks of Q and K, ``v_chunks`` of V; paged K/V tiles come from ``pages`` pages each;
  ``one_v_copy``: a contiguous V tile is one copy per chunk (batch-invariant tiles,
  ``kernel.load_v_tile_invariant``), not two (``primitives.load_rows``); ``p_smem``: FP8's
  P goes through shared memory (False: from registers, no buffer); ``wgs``: the compute
  warpgroups (2 with ``split``); ``zero_buffer``: a buffer of zeros (``Scratch.zeros``)."""
  lanes = wgs if split else 1  # K/V streams, each with num_stages slots
  consumers = 1 if split else wgs  # compute warpgroups reading a stream's tiles
  slots = lanes * num_stages
  fp8 = is_fp8(dtype)

  def swizzle(shape):
    # A row's bytes (at most 128, the largest swizzle: float32, which the kernel refuses,
    # is only counted here).
    return plgpu.SwizzleTransform(min(shape[-1] * jnp.dtype(dtype).itemsize, 128))

  def tiled(shape):
    return plgpu.SMEM(shape, dtype,
                      transforms=(plgpu.TilingTransform((8, shape[-1])), swizzle(shape)))

  def chunk_buffer(shape):
    # Two views of one buffer of rows of 64 (FP8 V^T: block_kv) elements: untiled, which
    # TMA fills from any row of an array of any row count, and tiled by 8 rows, which the
    # matrix products read. With the swizzle a row's bytes (128 for 64 bf16 columns) both
    # are the same bytes.
    return plgpu.RefUnion(plgpu.SMEM(shape, dtype, transforms=(swizzle(shape),)),
                          tiled(shape))

  barrier = plgpu.Barrier
  groups = L.vt_groups(block_kv) if fp8 else 1
  v_shape = ((slots * groups, L.CHUNK, block_kv // groups) if fp8
             else (slots, block_kv, L.CHUNK))
  return Scratch(
      q=[chunk_buffer((wgs, block_q, L.CHUNK)) for _ in range(chunks)],
      k=[chunk_buffer((slots, block_kv, L.CHUNK)) for _ in range(chunks)],
      v=[chunk_buffer(v_shape) for _ in range(v_chunks)],
      p=tiled((wgs, block_q, block_kv)) if fp8 and p_smem else None,
      o=[plgpu.SMEM((wgs, block_q, L.CHUNK), out_dtype) for _ in range(out_buffers)],
      zeros=plgpu.SMEM((block_q, L.CHUNK), out_dtype) if zero_buffer else None,
      lse=plgpu.SMEM((wgs, block_q), jnp.float32) if has_lse else None,
      units=plgpu.SMEM((2 * lanes,), jnp.int32) if dynamic else None,
      q_loaded=barrier(num_arrivals=chunks, num_barriers=wgs),
      k_loaded=barrier(num_arrivals=pages * chunks, num_barriers=slots),
      # Contiguous V: two copies per chunk (``primitives.load_rows``), batch-invariant
      # tiles one; FP8's V^T one per chunk and buffer (``groups``), paged or not; paged
      # V: one per chunk and page. (Each copy is one arrival: a count above the copies
      # never completes, and the kernel hangs.)
      v_loaded=barrier(num_arrivals=(
          groups if fp8 else pages if paged else 1 if one_v_copy else 2) * v_chunks,
                       num_barriers=slots),
      k_consumed=barrier(num_arrivals=consumers, num_barriers=slots),
      v_consumed=barrier(num_arrivals=consumers, num_barriers=slots),
      unit_ready=barrier(num_arrivals=1, num_barriers=2 * lanes) if dynamic else None,
      unit_used=barrier(num_arrivals=consumers, num_barriers=2 * lanes) if dynamic else None,
  )


def allocated_bytes(spec: Scratch) -> int:
  """The shared memory ``spec`` takes once allocated: each buffer rounded up to
  ``SMEM_ALIGNMENT``, plus 8 bytes a barrier (as Pallas Mosaic GPU allocates them; the
  kernel asks for no reduction scratch). ``tests/test_mosaic.py`` checks it against the
  lowered kernel's dynamic shared memory."""
  total = 0
  for leaf in jax.tree.leaves(spec):
    if isinstance(leaf, plgpu.Barrier):
      total += BARRIER_BYTES * math.prod(leaf.num_barriers)
    else:
      aval = leaf.inner_aval
      size = aval.size * jnp.dtype(aval.dtype).itemsize
      total += -(-size // SMEM_ALIGNMENT) * SMEM_ALIGNMENT
  return total


def splits(config: MosaicConfig) -> bool:
  """Whether the kernel runs split units: ``config.split_units``, which needs dynamic
  scheduling (without it the units are shared)."""
  return config.split_units and config.options.dynamic


def _config_bytes(parts, v_depth, dtype, output_dtype, return_lse, config: MosaicConfig,
                  out_buffers: int) -> int:
  # (Depths that are no multiple of 64, which the kernel refuses, count whole chunks.)
  return allocated_bytes(scratch(
      chunks=len(L.column_chunks(parts)), v_chunks=-(-v_depth // L.CHUNK), dtype=dtype,
      out_dtype=output_dtype, out_buffers=out_buffers, has_lse=return_lse,
      block_q=config.block_q, block_kv=config.block_kv, num_stages=config.num_stages,
      split=splits(config), dynamic=config.options.dynamic, pages=1, paged=False,
      p_smem=not config.options.fp8_p_registers, wgs=config.compute_wgs,
      zero_buffer=config.options.keyless_units == "bulk" and not splits(config)))


def _plan(parts, v_depth, dtype, output_dtype, return_lse,
          config: MosaicConfig) -> tuple[int, int]:
  """(output buffers, shared memory bytes) of the kernel for these operands and tiles."""
  full = -(-v_depth // L.CHUNK)
  need = _config_bytes(parts, v_depth, dtype, output_dtype, return_lse, config, full)
  if need <= L.SMEM_BYTES:
    return full, need
  return 1, _config_bytes(parts, v_depth, dtype, output_dtype, return_lse, config, 1)


def output_buffers(parts, v_depth, dtype, output_dtype, return_lse,
                   config: MosaicConfig) -> int:
  """The 64-column output buffers per compute warpgroup: one per accumulator, or where
  shared memory holds no more (MLA's 192 + 128 with 128-row K/V tiles in two stages), one,
  filled and stored a column chunk at a time."""
  return _plan(parts, v_depth, dtype, output_dtype, return_lse, config)[0]


def smem_bytes(parts, v_depth, dtype, output_dtype, return_lse, config: MosaicConfig) -> int:
  """Shared memory the kernel allocates for these operands and tiles."""
  return _plan(parts, v_depth, dtype, output_dtype, return_lse, config)[1]


def fitted(config: MosaicConfig, parts, v_depth, dtype, output_dtype,
           return_lse) -> MosaicConfig:
  """A default config cut down (stages to 2, then K/V tiles halved down to 64 rows) until
  shared memory holds it for these operands (a float32 output takes more of it). Zero
  jobs copied from a buffer of zeros (``MosaicOptions.keyless_units="bulk"``) become
  "spans" first where that buffer would cost output buffers or shared memory that the
  tiles need."""
  if config.options.keyless_units == "bulk":
    spans = dataclasses.replace(config, options=dataclasses.replace(
        config.options, keyless_units="spans"))
    plan = lambda c: _plan(parts, v_depth, dtype, output_dtype, return_lse, c)  # noqa: E731
    (buffers, need), (spans_buffers, _) = plan(config), plan(spans)
    if buffers < spans_buffers or need > L.SMEM_BYTES:
      config = spans
  while smem_bytes(parts, v_depth, dtype, output_dtype, return_lse, config) > L.SMEM_BYTES:
    if config.num_stages > 2:
      config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    elif config.block_kv > 64:
      config = dataclasses.replace(config, block_kv=config.block_kv // 2)
    else:
      break
  return config

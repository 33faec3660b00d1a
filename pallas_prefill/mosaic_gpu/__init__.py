"""The Mosaic GPU backend (``backend="mosaic_gpu"``, and ``"auto"``'s choice on Hopper):
what it serves (``unsupported_reason``), and the call of its kernel on validated operands
(``ragged_attention_mgpu``): operands, work list, then the persistent attention kernel.

The modules, along the kernel's seams: ``layout`` (the work list's columns, the scalars'
lanes), ``work_list`` (the work list in XLA) and ``work_items`` (the same from one small
Mosaic GPU kernel), ``schedule`` (the unit orders and the deal), ``primitives`` (inline
PTX/MLIR), ``operands`` (the work before the kernel), ``smem`` (the scratch and its shared
memory), ``kernel`` (the attention kernel in named stages).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_prefill.config import ZERO_JOB_UNITS, MosaicConfig
from pallas_prefill.constants import EMPTY_ROW_LSE, LOG2_E
from pallas_prefill.fp8 import is_fp8
from pallas_prefill.mosaic_gpu import layout as L
from pallas_prefill.mosaic_gpu.kernel import KernelSpec, attention_kernel, fixed_maximum
from pallas_prefill.mosaic_gpu.layout import CHUNK
from pallas_prefill.mosaic_gpu import operands as prepare  # (not `operands`: the module)
from pallas_prefill.mosaic_gpu.smem import fitted, output_buffers, smem_bytes, splits
from pallas_prefill.mosaic_gpu.work_list import paged_kv_lengths

__all__ = ["CHUNK", "fitted", "paged_config", "ragged_attention_mgpu", "unsupported_reason"]


def unsupported_reason(parts, v_depth, dtype, output_dtype, return_lse, config: MosaicConfig,
                       *, q_dtype=None) -> str | None:
  """Why the Mosaic GPU kernel cannot run this case, or None when it can. Paged caches
  need no check: pages of ``layout.MIN_NATIVE_PAGE`` rows or more are read in place
  (FP8's where ``native_fp8_pages``), smaller ones gathered first
  (``operands.gathered_pages``). FP8
  (``dtype`` K/V's, ``q_dtype`` Q's): e4m3 K and V under an e4m3 Q, or a bf16/f16 Q that
  the call quantizes to e4m3 (``operands.quantized_q``)."""
  if is_fp8(dtype):
    if jnp.dtype(dtype) != jnp.dtype(jnp.float8_e4m3fn):
      return (f"dtype {jnp.dtype(dtype).name}: the FP8 kernel takes float8_e4m3fn "
              "(the Triton kernel serves e5m2; 'auto' picks it)")
    if q_dtype is not None and is_fp8(q_dtype) and jnp.dtype(q_dtype) != jnp.dtype(dtype):
      return (f"q {jnp.dtype(q_dtype).name} over {jnp.dtype(dtype).name} K/V: the FP8 "
              "kernel takes float8_e4m3fn (the Triton kernel serves it; 'auto' picks it)")
  elif jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype).name}: the Hopper matrix instructions take bf16/f16"
  if config.block_kv > 128 and not (is_fp8(dtype) and config.options.fp8_p_registers):
    return (f"block_kv={config.block_kv}: tiles of more than 128 keys are FP8's (e4m3 K/V "
            "with P from registers, MosaicOptions.fp8_p_registers); use 64 or 128")
  for w in [p.width for p in parts] + [v_depth]:
    if w % 64 or w > 256:
      return f"depth {w}: the mosaic_gpu backend needs depths that are multiples of 64 <= 256"
  need = smem_bytes(parts, v_depth, dtype, output_dtype, return_lse, config)
  if need > L.SMEM_BYTES:
    split = (" (split units: a K/V stream per compute warpgroup, twice the buffers; "
             "or shared units)" if config.split_units else "")
    return (f"{need} bytes of shared memory for {config} exceed {L.SMEM_BYTES}; "
            f"use fewer stages or smaller tiles{split}")
  return None


def native_fp8_pages(v_depth: int, config: MosaicConfig) -> bool:
  """Whether FP8 pages (of ``layout.MIN_NATIVE_PAGE`` rows or more) are read in place: K
  tiles from the pages, V^T from ``operands.transposed_v_pages``' kernel, which moves only
  the sequences' keys (``MosaicOptions.fp8_native_pages``, and a V depth that is a power
  of two, as that kernel needs); else they are gathered first
  (``operands.gathered_pages``)."""
  return config.options.fp8_native_pages and v_depth & (v_depth - 1) == 0


def keyless_units(config: MosaicConfig) -> str:
  """The kernel's ``MosaicOptions.keyless_units``: zero jobs ("stores", "spans":
  ``ZERO_JOB_UNITS``) become "first" where the call runs split units."""
  units = config.options.keyless_units
  if units in ZERO_JOB_UNITS and config.split_units:
    return "first"
  return units


def gathered_lse(lse_items, lse_slot, q_offsets, total_q, *, rows, n_keyed=None,
                 sink_weights=None, xp=jnp):
  """The call's LSE [total_q, num_heads] from the kernel's per-item buffer ``lse_items``
  [num_heads, num_items * rows] (``rows`` a work item's), row r's at slot
  ``lse_slot[r]``. Rows past ``q_offsets[-1]`` belong to no sequence: the empty-row value
  (no sink either). With ``n_keyed`` (zero jobs, ``ZERO_JOB_UNITS``: they write no
  LSE), the rows of the items from ``n_keyed`` on (the key-less ones, which the work list
  puts last: ``L.S_KEYED``) take each head's LSE before any key, as a key-less unit
  writes it: its sink's logit (``sink_weights`` [num_heads]), or the empty-row value.
  ``xp``: jnp, or np for the tests' float64 emulation of the kernel."""
  lse = xp.take(lse_items, lse_slot, axis=1).T
  if n_keyed is not None:
    keyless = (EMPTY_ROW_LSE if sink_weights is None
               else xp.asarray(sink_weights).astype(lse.dtype)[None, :])
    lse = xp.where((lse_slot // rows >= n_keyed)[:, None], keyless, lse)
  last = xp.max(xp.clip(xp.asarray(q_offsets)[1:].astype(xp.int32), 0, total_q))
  return xp.where((xp.arange(total_q) < last)[:, None], lse, EMPTY_ROW_LSE)


def paged_config(config: MosaicConfig, page_size: int) -> MosaicConfig:
  """The config for native pages of page_size rows (``layout.MIN_NATIVE_PAGE`` or more):
  its KV tiles span pages (``MosaicOptions.tile_spans_pages``), or are cut to one page."""
  if config.options.tile_spans_pages:
    return config
  return dataclasses.replace(config, block_kv=min(config.block_kv, page_size))


def ragged_attention_mgpu(q_ops, k_ops, v, q_offsets, kv_rows, sink_weights, *, parts,
                          mask, scale, output_dtype, return_lse, config: MosaicConfig,
                          paged=None, soft_cap=None, top_left=False, scales=None):
  """The Mosaic GPU kernel on validated, supported operands (``unsupported_reason`` is
  None); arguments and results as ``dispatch.ragged_attention``'s (V padded). A paged cache
  (``paged``: block table, cache lengths) is read page by page, each KV tile from one page
  or from ``layout.tile_pages`` consecutive ones, when its pages have
  ``layout.MIN_NATIVE_PAGE`` rows or more (FP8's V^T then from
  ``operands.transposed_v_pages``, where ``native_fp8_pages``); smaller pages, and FP8
  pages that are not read in place, are gathered into contiguous K/V first
  (``operands.gathered_pages``). Split units need
  dynamic scheduling (``smem.splits``): without it, the units are shared. FP8
  (``scales``: the logits' and V's dequantization factors, each [batch, num_kv_heads]
  float32): V goes to the kernel transposed (``fp8_operands``), and the factors as they
  are;
  a bf16/f16 Q over FP8 K/V is quantized to e4m3 first, its scale per (sequence, K/V
  head) multiplied into the logits' factor (``quantized_q``)."""
  total_q, num_heads, _ = q_ops[0].shape
  num_kv_heads, v_depth = v.shape[-2:]
  fp8 = is_fp8(v.dtype)
  paged_cache = block_table = page_size = None
  config = dataclasses.replace(config, split_units=splits(config))
  if paged is not None:
    block_table, cache_lengths = paged
    paged_cache = (cache_lengths, block_table.shape[1] * v.shape[1])
    if v.shape[1] >= L.MIN_NATIVE_PAGE and (not fp8 or native_fp8_pages(v_depth, config)):
      page_size = v.shape[1]
      config = paged_config(config, page_size)
    else:
      # (FP8 pages gathered: ``fp8_operands`` makes V^T from contiguous V, given the
      # gathered rows that are the sequences' keys; the work list reads them from
      # ``paged_cache``.)
      gathered, gathered_rows = prepare.gathered_pages([*k_ops, v], block_table,
                                                       cache_lengths, q_offsets, total_q)
      k_ops, v, block_table = gathered[:-1], gathered[-1], None
      kv_rows = gathered_rows if fp8 else kv_rows
  if fp8 and not is_fp8(q_ops[0].dtype):
    q_ops, q_scale = prepare.quantized_q(q_ops, q_offsets, num_kv_heads, v.dtype)
    scales = (scales[0] * q_scale, scales[1])
  rows = config.compute_wgs * config.block_q
  extra = None
  if fp8 and page_size is not None:  # V^T of the sequences' keys, from the pages
    kv_len = paged_kv_lengths(q_offsets, total_q, *paged_cache)
    extra = (prepare.transposed_v_pages(v, block_table, kv_len, block_kv=config.block_kv,
                                        p_order=config.options.fp8_p_registers), *scales)
  elif fp8:
    extra = prepare.fp8_operands(v, q_offsets, kv_rows, scales, block_kv=config.block_kv,
                                 vt_kernel=config.options.fp8_vt_kernel,
                                 p_order=config.options.fp8_p_registers)
  inputs, lse_slot, programs = prepare.operands(q_ops, k_ops, v, q_offsets, kv_rows,
                                                sink_weights, mask=mask,
                                                return_lse=return_lse, config=config,
                                                paged_cache=paged_cache,
                                                block_table=block_table, top_left=top_left,
                                                fp8=extra)
  num_items = inputs[0].shape[0]  # the work list's rows
  capped_bf16 = (soft_cap is not None and config.options.fold_scale
                 and v.dtype == jnp.bfloat16)
  spec = KernelSpec(
      parts=tuple(parts), n_q=len(q_ops), n_k=len(k_ops), dtype=v.dtype, v_depth=v_depth,
      has_sink=sink_weights is not None, has_lse=return_lse, mask=mask,
      scale=scale * LOG2_E, soft_cap=None if soft_cap is None else soft_cap * LOG2_E,
      top_left=top_left, block_q=config.block_q, block_kv=config.block_kv,
      num_stages=config.num_stages, group=num_heads // num_kv_heads, num_heads=num_heads,
      out_dtype=jnp.dtype(output_dtype), page_size=page_size,
      out_buffers=output_buffers(parts, v_depth, v.dtype, output_dtype, return_lse, config),
      dynamic=config.options.dynamic, split=config.split_units,
      fold_scale=config.options.fold_scale, skip_keyless_q=config.options.skip_keyless_q,
      keyless_units=keyless_units(config),
      # (bf16 only: P in float16 would flush the small probabilities of a row whose
      # scores all lie far below the fixed maximum, and Q times scale / cap its small
      # values)
      fixed_max=fixed_maximum(soft_cap * LOG2_E) if (
          capped_bf16 and config.options.soft_cap_fixed_max) else None,
      scaled_q=capped_bf16 and config.options.soft_cap_scaled_q,
      p_registers=fp8 and config.options.fp8_p_registers,
      kv_unit=L.kv_unit(prepare.kv_align(config, is_fp8(v.dtype))), wgs=config.compute_wgs,
      row_sum_first=config.options.row_sum_first, q_per_tile=config.options.q_per_tile,
      column_mask=config.options.column_mask,
      column_lo_static=config.options.column_lo_static,
      narrow_last_tile=config.options.narrow_last_tile)
  kernel = functools.partial(attention_kernel, spec=spec)
  scalars = inputs[1]
  if config.options.dynamic:
    # The kernel counts its claims in the scalars' L.S_NEXT lane: a fresh copy per call
    # (a Ref, which the kernel updates in place), whoever else reads the scalars.
    inputs[1] = jax.new_ref(inputs[1])
  out_type = [jax.ShapeDtypeStruct((total_q, num_heads, v_depth), output_dtype)]
  if return_lse:
    out_type.append(jax.ShapeDtypeStruct((num_heads, num_items * rows), jnp.float32))
  results = plgpu.kernel(
      kernel, out_type=out_type, grid=(programs,),
      grid_names=("cta",),
      # A producer warpgroup per K/V stream (``MosaicConfig.split_units``: one each).
      num_threads=config.compute_wgs + (config.compute_wgs if config.split_units else 1),
      thread_name="wg",
      # No cross-warp reductions (a row's scores lie in one warp): no scratch for them.
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
  )(*inputs)
  if not return_lse:
    return results[0]
  return results[0], gathered_lse(
      results[1], lse_slot, q_offsets, total_q, rows=rows, sink_weights=sink_weights,
      n_keyed=scalars[L.S_KEYED] if spec.zero_stores else None)



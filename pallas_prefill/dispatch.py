"""The choice of backend: ``ragged_attention`` takes the entry points' validated operands
(the logits as ``QkPart`` terms) and runs them on the Triton kernel or the Mosaic GPU one.

This is the only module that imports the backends; they import nothing above them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_prefill import mosaic_gpu
from pallas_prefill import partitioning
from pallas_prefill import triton as triton_backend
from pallas_prefill.config import (MhaConfig, MosaicConfig, default_mosaic_config, is_hopper,
                                   prefers_triton)
from pallas_prefill.constants import EMPTY_ROW_LSE, SINK_MAX
from pallas_prefill.logits import pad_depth, padded_depth

MAX_GRID_DIM = triton_backend.MAX_GRID_DIM


def ragged_attention(q_ops, k_ops, v, q_offsets, kv_rows, sink_weights, *, parts,
                     max_prompt_len, mask, scale, output_dtype, return_lse,
                     config: MhaConfig | MosaicConfig | None, interpret: bool, paged=None,
                     backend: str = "auto", logits_soft_cap=None, top_left=False,
                     scales=None, padded=False):
  """Runs the ragged attention kernel of the chosen backend on validated operands.

  Args:
    q_ops: Q operands, each [total_q, num_heads, depth_i].
    k_ops: K operands, each [total_kv, num_kv_heads or 1, depth_i], or with `paged`
      [num_pages, page_size, num_kv_heads or 1, depth_i].
    v: [total_kv, num_kv_heads, v_depth] (paged: [num_pages, page_size, ...]); a v_depth
      that is not a power of two is padded here and the output sliced back.
    q_offsets: [batch + 1] int32 or uint32: sequence b's queries are rows
      [q_offsets[b], q_offsets[b + 1]) (a sequence without keys is a run of padding rows:
      zeros).
    kv_rows: None (K/V packed like Q, or paged), or (kv_starts, kv_ends), each [batch]
      int32 or uint32: sequence b's keys are rows [kv_starts[b], kv_ends[b]), anywhere in
      the K/V arrays (``logits.kv_rows`` makes them from cumulative offsets).
    paged: None, or (block_table [batch, max_pages] int32, cache_lengths [batch] int32)
      when the K/V operands are pages.
    sink_weights: [num_heads] or None.
    parts: the ``QkPart`` terms whose sum forms the logits; their widths are powers of two.
    config: None picks the tuned default of the backend that runs.
    backend: "auto", "triton" or "mosaic_gpu" (see ``select_backend``).
    logits_soft_cap: None, or the cap c > 0 of ``c * tanh(logits / c)`` (after the scale,
      before the mask).
    top_left: query i of every sequence sits at position i (``jax.nn``'s causal mask)
      instead of kv_len - q_len + i.
    scales: None, or FP8's (qk_scale, v_scale), each [batch, num_kv_heads] float32
      (``fp8.scales``).
    padded: the call is ``dot_product_attention``'s (``config.default_mosaic_config``).

  Returns:
    out [total_q, num_heads, v_depth] in output_dtype, and lse [total_q, num_heads]
    float32 when return_lse.
  """
  total_q, num_heads, _ = q_ops[0].shape
  v_depth = v.shape[-1]
  batch = q_offsets.shape[0] - 1
  if batch > MAX_GRID_DIM:
    raise ValueError(f"batch ({batch}) must be at most {MAX_GRID_DIM}: it is the launch "
                     "grid's z dimension, which CUDA limits")
  if sink_weights is not None:
    # Concrete sinks above SINK_MAX were refused; traced ones are clamped, so that
    # sink * log2(e) stays finite in the kernels (an inf maximum would give NaN rows).
    # Sinks below -SINK_MAX are taken as -SINK_MAX (their weight is 0 in float32 either
    # way): below about -1.65e38, sink * log2(e) falls under the kernels' mask value (or
    # overflows to -inf), and a row that sees no key reported the LSE -1e30 or -inf
    # instead of its sink's.
    sink_weights = jnp.clip(sink_weights.astype(jnp.float32), -SINK_MAX, SINK_MAX)
  if total_q == 0 or v.shape[0] == 0:
    # No query, or no key anywhere: nothing for a kernel to do (and nothing to index).
    return _no_keys(total_q, num_heads, v_depth, q_offsets, sink_weights, output_dtype,
                    return_lse)
  v = pad_depth(v, padded_depth(v_depth))
  mosaic_config = select_backend(backend, parts, v, output_dtype, return_lse, paged, mask,
                                 max_prompt_len, config, interpret, q_dtype=q_ops[0].dtype,
                                 soft_cap=logits_soft_cap is not None, padded=padded)
  kw = dict(mask=mask, scale=scale, output_dtype=output_dtype, return_lse=return_lse,
            paged=paged, soft_cap=logits_soft_cap, top_left=top_left)
  if mosaic_config is not None:
    q_ops, k_ops, parts = mosaic_operands(q_ops, k_ops, parts)
    v = pad_depth(v, mosaic_depth(v.shape[-1]))
    out = mosaic_gpu.ragged_attention_mgpu(q_ops, k_ops, v, q_offsets, kv_rows,
                                           sink_weights, parts=parts, config=mosaic_config,
                                           scales=scales, **kw)
  else:
    out = triton_backend.ragged_attention_triton(
        q_ops, k_ops, v, q_offsets, kv_rows, sink_weights, parts=parts,
        max_prompt_len=max_prompt_len, config=config, interpret=interpret, scales=scales,
        **kw)
  if return_lse:
    return out[0][..., :v_depth], out[1]
  return out[..., :v_depth]


def select_backend(backend, parts, v, output_dtype, return_lse, paged, mask, max_prompt_len,
                   config, interpret, q_dtype=None, soft_cap=False,
                   padded=False) -> MosaicConfig | None:
  """The Mosaic GPU config to run with, or None for the Triton kernel.

  "triton" is None. "mosaic_gpu" is the given MosaicConfig or the default one, and raises
  NotImplementedError when the Mosaic GPU kernel cannot serve the case (the reason says
  why). "auto" (the default) is Mosaic GPU on a Hopper GPU wherever it can serve the case,
  unless the tuned table for the device measured Triton faster there
  (``config.prefers_triton``) or the config is an ``MhaConfig``; a ``MosaicConfig`` picks
  Mosaic GPU as "mosaic_gpu" does (refusing what it cannot serve). Triton otherwise:
  other GPUs, what Mosaic GPU refuses, and interpret mode. ``soft_cap``: whether the
  call caps its logits (``config.default_mosaic_config``'s warpgroups depend on it);
  ``padded``: the call is ``dot_product_attention``'s (its key-less items, the same).
  """
  if backend == "triton":
    return None
  if backend == "auto" and not isinstance(config, MosaicConfig) and (
      interpret or isinstance(config, MhaConfig) or not is_hopper()):
    return None  # Triton, with no Mosaic GPU config to plan (the CPU's tests trace often)
  parts = [dataclasses.replace(p, width=mosaic_depth(p.width)) for p in parts]
  v = jax.ShapeDtypeStruct(v.shape[:-1] + (mosaic_depth(v.shape[-1]),), v.dtype)
  qk = sum(p.width for p in parts)
  if isinstance(config, MosaicConfig):
    mosaic_config = config
  else:
    mosaic_config = mosaic_gpu.fitted(
        default_mosaic_config(qk, v.shape[-1], v.dtype, mask, max_prompt_len, soft_cap,
                              padded),
        parts, v.shape[-1], v.dtype, output_dtype, return_lse)
  reason = mosaic_gpu.unsupported_reason(parts, v.shape[-1], v.dtype, output_dtype,
                                         return_lse, mosaic_config, q_dtype=q_dtype)
  if backend == "mosaic_gpu" or isinstance(config, MosaicConfig):
    # (validation refused interpret mode)
    if reason is not None:
      which = "backend='mosaic_gpu'" if backend == "mosaic_gpu" else "a MosaicConfig"
      raise NotImplementedError(f"{which} cannot run this call: {reason}")
    return mosaic_config
  # "auto" on a Hopper GPU, compiled
  if reason is not None or prefers_triton(qk, v.shape[-1], v.dtype, mask, max_prompt_len,
                                          paged=paged is not None, q_dtype=q_dtype):
    return None
  return mosaic_config


def mosaic_depth(width: int) -> int:
  """The depth a term (or V) of the given width runs at on Mosaic GPU: a multiple of 64
  (``mosaic_gpu.layout.CHUNK``, its buffers' columns); the rest is zero padding."""
  return -(-width // mosaic_gpu.CHUNK) * mosaic_gpu.CHUNK


def mosaic_operands(q_ops, k_ops, parts):
  """The Q and K operands and terms with every term's width a multiple of 64 for Mosaic
  GPU: a term narrower than that (MiniCPM3's rope 32, MHA depths 16 and 32) gets its own
  zero-padded copies of its Q and K columns; the others are read where they are."""
  q_ops, k_ops, new_parts = list(q_ops), list(k_ops), []
  for p in parts:
    width = mosaic_depth(p.width)
    if width == p.width:
      new_parts.append(p)
      continue
    q_ops.append(pad_depth(q_ops[p.q_index][..., p.q_col:p.q_col + p.width], width))
    k_ops.append(pad_depth(k_ops[p.k_index][..., p.k_col:p.k_col + p.width], width))
    new_parts.append(dataclasses.replace(p, q_index=len(q_ops) - 1, q_col=0,
                                         k_index=len(k_ops) - 1, k_col=0, width=width))
  return q_ops, k_ops, new_parts


def _no_keys(total_q, num_heads, v_depth, q_offsets, sink_weights, output_dtype, return_lse):
  """The result when no row sees a key: zeros, and the LSE of the sink alone (the empty
  row value without one, and for rows past the last offset)."""
  out = jnp.zeros((total_q, num_heads, v_depth), output_dtype)
  if not return_lse:
    return out
  lse = jnp.full((total_q, num_heads), EMPTY_ROW_LSE, jnp.float32)
  if sink_weights is not None:
    last = jnp.clip(q_offsets[-1].astype(jnp.int32), 0, total_q)
    in_sequence = jnp.arange(total_q)[:, None] < last
    lse = jnp.where(in_sequence, sink_weights.astype(jnp.float32)[None, :], lse)
  return out, lse


def empty_batch(total_q, num_heads, v_depth, *, output_dtype, return_lse, **_):
  """The result of an entry point's call on an empty batch (offsets [0]: no sequence, so
  every row is past the last offset): zeros, with LSE -1e30 (sinks or not). No kernel
  runs. The other arguments of ``static_options``' dict are ignored."""
  return _no_keys(total_q, num_heads, v_depth, jnp.zeros((1,), jnp.int32), None,
                  output_dtype, return_lse)


# The options an entry point's jitted implementation takes as static arguments.
STATIC_OPTIONS = ("max_prompt_len", "mask", "scale", "output_dtype", "return_lse", "config",
                  "interpret", "backend", "logits_soft_cap")


def static_options(q, *, depth, max_prompt_len, mask, scale, output_dtype, return_lse,
                   config, interpret, operands, backend="auto",
                   logits_soft_cap=None) -> dict:
  """Validated options in the hashable form the jitted implementations take, defaults
  resolved: scale 1/sqrt(depth), output dtype q's, interpret exactly on the CPU backend.
  ``operands``: the call's arrays (pytrees, q among them), for the check of interpret
  mode under a jit with jax_enable_x64 on."""
  if not isinstance(return_lse, (bool, np.bool_)):
    raise TypeError(f"return_lse must be a static bool, got {return_lse!r}")
  interpret = jax.default_backend() == "cpu" if interpret is None else bool(interpret)
  if interpret and jax.config.jax_enable_x64 and partitioning.traced(operands):
    # (``partitioning.implementation`` traces the kernels in 32 bits, but the interpreter
    # runs when the outer jit lowers, outside that; ``jax.eval_shape`` traces as jit
    # does and cannot be told apart here)
    raise NotImplementedError(
        "interpret mode inside jax.jit (or jax.eval_shape) with jax_enable_x64 on: "
        "Pallas' interpreter indexes in int64 there and fails; call the entry point "
        "outside jax.jit, or trace the jit under jax.enable_x64(False) (compiled GPU "
        "calls are not affected)")
  return dict(
      max_prompt_len=int(max_prompt_len), mask=mask,
      scale=float(depth ** -0.5 if scale is None else scale),
      logits_soft_cap=None if logits_soft_cap is None else float(logits_soft_cap),
      output_dtype=jnp.dtype(q.dtype if output_dtype is None else output_dtype),
      return_lse=bool(return_lse), config=config,
      interpret=interpret, backend="auto" if backend is None else backend)

"""Ragged multi-head attention prefill (MHA, GQA, MQA): the public entry point."""

from __future__ import annotations

import functools

import jax

from pallas_prefill import masks as masks_lib
from pallas_prefill import partitioning
from pallas_prefill import dispatch
from pallas_prefill import fp8
from pallas_prefill import logits
from pallas_prefill import validation as val


def mha_prefill(q, k, v, input_row_offsets, *, max_prompt_len, kv_input_row_offsets=None,
                mask=masks_lib.CausalMask(), scale=None, sink_weights=None,
                output_dtype=None, return_lse=False, config=None, interpret=None,
                backend="auto", logits_soft_cap=None, q_scale=None, k_scale=None,
                v_scale=None):
  """Attention prefill over a ragged (packed) batch of prompts.

  Sequence b's queries are rows ``input_row_offsets[b]:input_row_offsets[b+1]`` of ``q``;
  it attends over K/V rows ``kv_input_row_offsets[b]:kv_input_row_offsets[b+1]`` (the same
  rows as its queries when ``kv_input_row_offsets`` is None). Its queries are the last
  ``q_len`` positions of the sequence: query i sits at position ``start_pos + i`` with
  ``start_pos = kv_len - q_len``, so a longer K/V range is a cached prefix and a shorter one
  (cross-attention) leaves the first queries seeing no key, which then output zeros.
  Forward only: no gradient is defined (``jax.grad``, ``jvp`` or ``linearize`` through it
  raises NotImplementedError; inputs under ``jax.lax.stop_gradient`` pass).

  Args:
    q: [total_q, num_heads, head_dim], bfloat16, float16 or float32.
    k: [total_kv, num_kv_heads, head_dim], same dtype; num_heads % num_kv_heads == 0
      (MHA, GQA, MQA). total_kv == total_q when kv_input_row_offsets is None.
    v: [total_kv, num_kv_heads, head_dim_v], same dtype.
      k and v may instead both be ``PagedKV`` over one block table and cache lengths, with
      pages [num_pages, page_size, num_kv_heads, head_dim(_v)]: a paged cache whose new
      rows ``paged.write_kv`` has placed at cache_length onward; then kv_len =
      cache_length + q_len, start_pos = cache_length, and kv_input_row_offsets is None.
    input_row_offsets: [batch + 1] int32 or uint32, nondecreasing from 0. An empty batch
      ([0]) gives zeros and LSE -1e30 for every row, with no kernel run.
    max_prompt_len: static int >= every sequence's query count; sizes the grid, so bucket
      it to limit recompilation.
    kv_input_row_offsets: optional [batch + 1] int32 or uint32 K/V row offsets.
    mask: a ``pallas_prefill.masks`` mask (default causal). KV tiles it hides entirely are
      skipped.
    scale: logit scale, a static float; default 1/sqrt(head_dim).
    logits_soft_cap: None, or a static float cap > 0: the scaled logits become
      ``cap * tanh(logits / cap)`` before the mask (Gemma 2, Grok); the LSE is of the
      capped logits.
    q_scale, k_scale, v_scale: FP8 inputs' dequantization scales (issue 24;
      ``pallas_prefill.fp8``): with float8_e4m3fn / float8_e5m2 k and v (and q, or a
      bf16/f16 q, which takes no q_scale: an FP8 KV cache), float32 scalars,
      [num_kv_heads] or [batch, num_kv_heads]; the real values are the FP8 values times
      their scales (a query head takes its K/V head's). The output defaults to bfloat16
      for an FP8 q. What runs where: on Hopper ``auto`` runs an e4m3 q, k and v on
      Mosaic GPU as FP8 matrix products, FP8 pages included (pages of 64 rows or more
      read in place, V transposed by a small kernel before it; smaller ones gathered
      into contiguous K/V first); e5m2, an FP8 q of the other format than k and v's
      (which share one), and a bf16/f16 q over FP8 k/v on the Triton kernel, which
      widens the FP8 tiles to 16 bits (and uses such a q as given).
      ``backend="mosaic_gpu"`` also serves a bf16/f16 q, which the call then
      quantizes to e4m3 per (sequence, K/V head): divided by the largest finite |q| over
      the sequence's rows and the K/V head's query heads over 448 (1 where that is 0), a
      scale the logits are then multiplied by. That costs accuracy: on the H200, 3.0e-2
      relative error against q as given on normal data and 1.5e-1 with 3 outlier
      channels 30x larger (large logits), against 2e-3 on Triton.
    sink_weights: optional [num_heads] float attention-sink logits: each row's softmax
      denominator gains exp(sink - max); the sink contributes no value. At most 1e38
      (checked when concrete; a traced larger one is taken as 1e38); one below -1e38 is
      taken as -1e38 (the LSE of a row that sees no key is then -1e38).
    output_dtype: dtype of the output; default q.dtype.
    return_lse: also return the float32 natural-log log-sum-exp of each row's logits, sink
      included, for merging chunks (rows that see no key and have no sink: -1e30).
    config: a ``MhaConfig`` (Triton) or ``MosaicConfig`` (Mosaic GPU); None picks the
      tuned default of the backend that runs, for the head dims and device.
    interpret: run the Pallas interpreter; None means exactly when the default backend is
      the CPU.
    backend: "auto" (default, or None): the Pallas Mosaic GPU kernel on a Hopper GPU
      (sm_90) wherever it can serve the call, unless the tuned table for the device
      measured the Triton kernel faster for the case; the Triton kernel on other GPUs, for
      what Mosaic GPU refuses (float32 inputs; MHA at depth 256 with both a float32 output
      and the LSE), in interpret mode (the CPU) and in programs over several devices
      (inside ``shard_map`` or a mesh of several, or inputs sharded over several: the
      Mosaic GPU kernel has not run on more than one GPU yet, so tensor-parallel calls get
      the Triton kernel unless they ask for "mosaic_gpu"). "triton": the Pallas Triton
      kernel, any NVIDIA GPU and interpret mode. "mosaic_gpu": the Mosaic GPU kernel,
      bf16/f16 and e4m3 K/V, depths up to 256 (padded to a multiple of 64), packed, offset
      or paged K/V; NotImplementedError says why a call it cannot serve is refused. A
      ``MhaConfig`` with "auto" picks Triton, a ``MosaicConfig`` Mosaic GPU. Results agree
      to rounding; so do validation and the handling of garbage offsets.

  Head dims 16 to 256 that are powers of two run natively; others (80, 96, 192, ...) are
  zero-padded to the next power of two inside the wrapper. Softmax runs in float32. Output
  rows past ``input_row_offsets[-1]`` belong to no sequence: zeros, with LSE -1e30 (with
  sinks too).

  Returns:
    out [total_q, num_heads, head_dim_v] in output_dtype, or (out, lse) with lse
    [total_q, num_heads] float32 when return_lse.

  Raises:
    NotImplementedError: backend="mosaic_gpu" for a call that kernel cannot serve; an
      operand being differentiated (the kernels are forward only).
    TypeError, ValueError: static problems (ranks, dtypes, head counts or dims, offsets'
      length, rank or dtype, max_prompt_len <= 0, an unknown mask, sink_weights' shape; a
      PagedKV page size that is not a power of two from 16 to 256, a bad block table,
      PagedKV mixed with an array or with kv_input_row_offsets; a scale or soft cap that
      is not finite in float32), and, when the offsets are concrete, the data problems
      ``validate_offsets`` finds (and, for a concrete PagedKV, page ids out of range, a
      cache longer than its pages, or a V whose block table or cache lengths differ from
      K's; concrete sink weights that are not finite or above 1e38; concrete FP8 scales,
      or an FP8 q's q_scale * k_scale, that are not finite or below float32's smallest
      normal, 1.18e-38, which a GPU flushes to zero). Under jit nothing checks these
      values; the kernel clamps every index, so garbage offsets, page ids or cache
      lengths give garbage rows but never an access outside the arrays, nor NaN where
      the arrays (every page included) hold none: garbage ranges may reach rows past the
      last key, which valid calls never read.
  """
  val.check_forward_only("mha_prefill", dict(q=q, k=k, v=v, sink_weights=sink_weights,
                                             q_scale=q_scale, k_scale=k_scale,
                                             v_scale=v_scale))
  val.check_call(q, {"k": k, "v": v}, input_row_offsets, kv_input_row_offsets,
                 max_prompt_len=max_prompt_len, mask=mask, scale=scale,
                 output_dtype=output_dtype, config=config, interpret=interpret,
                 backend=backend, logits_soft_cap=logits_soft_cap)
  num_heads, head_dim = q.shape[1:]
  if k.shape[-1] != head_dim:
    raise ValueError(f"q and k head dims differ: q {q.shape}, k {k.shape}")
  if v.shape[-2] != k.shape[-2]:
    raise ValueError(f"k and v must have the same number of heads: k {k.shape}, v {v.shape}")
  val.check_heads(num_heads, k.shape[-2])
  val.check_head_dim("head_dim", head_dim)
  val.check_head_dim("head_dim_v", v.shape[-1])
  val.check_sink_weights(sink_weights, num_heads)
  val.validate_if_concrete(input_row_offsets, kv_input_row_offsets,
                           max_prompt_len=max_prompt_len, total_q=q.shape[0], k=k)
  kv_arrays = logits.unpage(k, v)
  scales = fp8.scales(q, kv_arrays[0], kv_arrays[1], q_scale, k_scale, v_scale,
                      batch=input_row_offsets.shape[0] - 1, num_kv_heads=k.shape[-2])
  if scales is not None and output_dtype is None:
    output_dtype = fp8.output_dtype_for(q.dtype)
  operands = (q, k, v, input_row_offsets, kv_input_row_offsets, sink_weights, scales)
  impl = partitioning.implementation(jitted_mha_prefill, *operands)
  return impl(
      *operands,
      **dispatch.static_options(
          q, operands=operands, depth=head_dim, max_prompt_len=max_prompt_len, mask=mask,
          scale=scale, output_dtype=output_dtype, return_lse=return_lse, config=config,
          interpret=interpret, backend=backend, logits_soft_cap=logits_soft_cap))


@functools.partial(jax.jit, static_argnames=dispatch.STATIC_OPTIONS)
def jitted_mha_prefill(q, k, v, input_row_offsets, kv_input_row_offsets, sink_weights,
                       scales=None, **static):
  """The entry point under ``jax.jit`` (static options from ``dispatch.static_options``),
  split over head shards where the operands are sharded (``partitioning``); an empty
  batch (offsets [0]) runs no kernel (``dispatch.empty_batch``)."""
  if input_row_offsets.shape[0] == 1:
    return dispatch.empty_batch(q.shape[0], q.shape[1], v.shape[-1], **static)
  kv_starts, kv_ends = logits.kv_rows(kv_input_row_offsets) or (None, None)
  return head_parallel_mha(q, k, v, input_row_offsets, kv_starts, kv_ends, sink_weights,
                           scales, **static)


def head_parallel_mha(q, k, v, q_offsets, kv_starts, kv_ends, sink_weights, scales=None,
                      **static):
  """``mha_on_shards`` split over head shards where the operands are sharded
  (``partitioning``); q [rows, num_heads, depth], k and v [rows, num_kv_heads, depth] (or
  PagedKV), offsets and row ranges replicated."""
  hp = partitioning
  return hp.head_parallel(
      mha_on_shards, (q, k, v, q_offsets, kv_starts, kv_ends, sink_weights, scales),
      roles=(hp.Q_HEADS, hp.KV_HEADS, hp.KV_HEADS, None, None, None, hp.SINK_HEADS,
             hp.SCALE_HEADS),
      out_roles=(hp.Q_HEADS, hp.SINK_HEADS) if static["return_lse"] else (hp.Q_HEADS,),
      num_heads=q.shape[1], num_kv_heads=k.shape[-2], **static)


def mha_on_shards(q, k, v, q_offsets, kv_starts, kv_ends, sink_weights, scales=None, *,
                  max_prompt_len,
                  mask, scale, output_dtype, return_lse, config, interpret, backend,
                  logits_soft_cap, top_left=False, padded=False):
  """One head shard's call (all heads when unsharded): the logits' terms, then
  ``dispatch.ragged_attention``. K/V rows: packed like Q (kv_starts None), or sequence b's
  at [kv_starts[b], kv_ends[b]). ``padded``: ``dot_product_attention``'s call."""
  qk_depth = logits.padded_depth(q.shape[-1])
  k, v, paged = logits.unpage(k, v)
  kv_rows = None if kv_starts is None else (kv_starts, kv_ends)
  return dispatch.ragged_attention(
      [logits.pad_depth(q, qk_depth)], [logits.pad_depth(k, qk_depth)], v,
      q_offsets, kv_rows, sink_weights, paged=paged,
      parts=[logits.QkPart(q_index=0, q_col=0, k_index=0, k_col=0, width=qk_depth)],
      max_prompt_len=max_prompt_len, mask=mask, scale=scale, output_dtype=output_dtype,
      return_lse=return_lse, config=config, interpret=interpret, backend=backend,
      logits_soft_cap=logits_soft_cap, top_left=top_left, scales=scales, padded=padded)

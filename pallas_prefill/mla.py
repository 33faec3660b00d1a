"""Ragged multi-head latent attention prefill (DeepSeek-V2/V3 style): the public entry point.

MLA forms its logits from two products, ``q_nope . k_nope`` against per-head keys and
``q_rope . k_rope`` against a rotary key that one head (or each KV head) holds; everything
else, softmax, masks, offsets, tiling, is the kernel MHA uses, on either backend
(``pallas_prefill.dispatch``).
"""

from __future__ import annotations

import functools

import jax

from pallas_prefill import masks as masks_lib
from pallas_prefill import partitioning
from pallas_prefill import dispatch
from pallas_prefill import fp8
from pallas_prefill import logits
from pallas_prefill import validation as val


def mla_prefill(q, k_nope, k_rope, v, input_row_offsets, *, max_prompt_len,
                kv_input_row_offsets=None, mask=masks_lib.CausalMask(), scale=None,
                output_dtype=None, return_lse=False, config=None, interpret=None,
                backend="auto", logits_soft_cap=None, q_scale=None, k_scale=None,
                v_scale=None):
  """Multi-head latent attention prefill over a ragged (packed) batch.

  logits = (q_nope . k_nope + q_rope . k_rope) * scale, where q_nope and q_rope are the
  first d_nope and last d_rope columns of q. Unlike MAX's ``mla_prefill_v2_ragged``, whose
  rope operand is unused, this computes the rope term (the contract of MAX's older
  ``flare_mla_prefill``). Offsets, positions (start_pos = kv_len - q_len), masks, LSE,
  output_dtype, config, interpret, validation and clamping are exactly as in
  ``mha_prefill``. Forward only, as ``mha_prefill``.

  Args:
    q: [total_q, num_heads, d_nope + d_rope], bfloat16, float16 or float32; nope first.
      With FP8 K/V: float8_e4m3fn / float8_e5m2 (with q_scale), or bf16/f16 (used as
      given on Triton, which ``auto`` picks; quantized by the call on Mosaic GPU: see
      q_scale).
    k_nope: [total_kv, num_kv_heads, d_nope], same dtype; num_heads % num_kv_heads == 0.
    k_rope: [total_kv, 1 or num_kv_heads, d_rope], same dtype as k_nope; 1 head is shared
      by every query head (DeepSeek).
    v: [total_kv, num_kv_heads, d_v], same dtype as k_nope.
      k_nope, k_rope and v may instead all be ``PagedKV`` over one block table and cache
      lengths (pages [num_pages, page_size, heads, depth]), as in ``mha_prefill``.
    input_row_offsets: [batch + 1] int32 or uint32, nondecreasing from 0. An empty batch
      ([0]) gives zeros and LSE -1e30 for every row, with no kernel run.
    max_prompt_len: static int >= every sequence's query count.
    kv_input_row_offsets: optional [batch + 1] K/V row offsets (cached prefix or
      cross-attention); None: K/V packed like Q.
    mask: a ``pallas_prefill.masks`` mask (default causal).
    scale: logit scale, a static float; default 1/sqrt(d_nope + d_rope). Pass a
      YaRN-corrected scale here.
    logits_soft_cap: None, or a static float cap > 0: logits become
      ``cap * tanh(logits / cap)`` after the scale, before the mask, as in ``mha_prefill``.
    q_scale, k_scale, v_scale: FP8 inputs' float32 dequantization scales, as in
      ``mha_prefill`` (issue 24; what runs where is said there: e4m3 on Mosaic GPU,
      FP8 pages included; e5m2 and a bf16/f16 q on Triton under ``auto``): each a scalar,
      [num_kv_heads] or [batch, num_kv_heads], with float8_e4m3fn / float8_e5m2 k_nope,
      k_rope and v (and q, or a bf16/f16 q, which takes no q_scale: on Mosaic GPU the
      call quantizes it to e4m3 as ``mha_prefill`` says, one scale per (sequence, K/V
      head) for its nope and rope columns together, the absmax over both). One q_scale
      covers q's nope and rope columns and one k_scale covers k_nope and k_rope, so
      query head h of K/V head g has the logits (q_nope.k_nope + q_rope.k_rope) *
      q_scale[g] * k_scale[g] * scale: one factor, which the kernel folds into the logit
      scale. A shared (1-head) k_rope
      is read by each K/V head g with k_scale[g]: with a per-head k_scale, quantize it
      for those scales (a scalar k_scale keeps one real k_rope for every head). The
      output defaults to bfloat16 for an FP8 q.
    output_dtype: default q.dtype (bfloat16 for an FP8 q).
    return_lse: also return the float32 natural-log log-sum-exp [total_q, num_heads].
    config: a ``MhaConfig`` (Triton) or ``MosaicConfig`` (Mosaic GPU); None picks the
      tuned default (DeepSeek-V3's 128 heads, 128 + 64, d_v 128 is the tuned case).
    interpret: None means interpret mode exactly when the default backend is the CPU.
    backend: "auto" (default, or None: Mosaic GPU on Hopper where it serves the call,
      Triton in programs over several devices and elsewhere), "triton" or "mosaic_gpu",
      as in ``mha_prefill``.

  Depths up to 256 each; powers of two (>= 16) run natively, others are zero-padded.

  Returns:
    out [total_q, num_heads, d_v] in output_dtype, or (out, lse) when return_lse.

  Raises:
    TypeError, ValueError: as ``mha_prefill``, plus q's depth not d_nope + d_rope, k_rope
      with neither 1 nor num_kv_heads heads, and K/V arrays whose rows differ; for FP8,
      mixed K/V dtypes, an FP8 q over wider K/V, and missing, misshapen or non-float32
      scales (or scales without FP8 inputs).
    NotImplementedError: backend="mosaic_gpu" (or a MosaicConfig) for a call that kernel
      cannot serve (FP8 inputs included, as ``unsupported_reason`` says); an operand
      being differentiated (forward only).
  """
  val.check_forward_only("mla_prefill", dict(q=q, k_nope=k_nope, k_rope=k_rope, v=v,
                                             q_scale=q_scale, k_scale=k_scale,
                                             v_scale=v_scale))
  val.check_call(q, {"k_nope": k_nope, "k_rope": k_rope, "v": v}, input_row_offsets,
                 kv_input_row_offsets, max_prompt_len=max_prompt_len, mask=mask,
                 scale=scale, output_dtype=output_dtype, config=config,
                 interpret=interpret, backend=backend, logits_soft_cap=logits_soft_cap)
  num_heads, depth = q.shape[1:]
  num_kv_heads, d_nope = k_nope.shape[-2:]
  d_rope = k_rope.shape[-1]
  if depth != d_nope + d_rope:
    raise ValueError(f"q's depth ({depth}) must be d_nope + d_rope = {d_nope} + {d_rope} "
                     f"(k_nope {k_nope.shape}, k_rope {k_rope.shape})")
  if k_rope.shape[-2] not in (1, num_kv_heads):
    raise ValueError(f"k_rope must have 1 or num_kv_heads = {num_kv_heads} heads, got "
                     f"{k_rope.shape[-2]}")
  if v.shape[-2] != num_kv_heads:
    raise ValueError(f"v must have num_kv_heads = {num_kv_heads} heads like k_nope, got "
                     f"{v.shape[-2]}")
  val.check_heads(num_heads, num_kv_heads)
  for name, d in (("d_nope", d_nope), ("d_rope", d_rope), ("d_v", v.shape[-1])):
    val.check_head_dim(name, d)
  val.validate_if_concrete(input_row_offsets, kv_input_row_offsets,
                           max_prompt_len=max_prompt_len, total_q=q.shape[0], k=k_nope)
  # k_rope shares k_nope's dtype (check_call) and k_scale.
  scales = fp8.scales(q, k_nope, v, q_scale, k_scale, v_scale,
                      batch=input_row_offsets.shape[0] - 1, num_kv_heads=num_kv_heads,
                      names=("q", "k_nope", "v"))
  if scales is not None and output_dtype is None:
    output_dtype = fp8.output_dtype_for(q.dtype)
  operands = (q, k_nope, k_rope, v, input_row_offsets, kv_input_row_offsets, scales)
  impl = partitioning.implementation(jitted_mla_prefill, *operands)
  return impl(
      *operands,
      **dispatch.static_options(
          q, operands=operands, depth=depth, max_prompt_len=max_prompt_len, mask=mask,
          scale=scale, output_dtype=output_dtype, return_lse=return_lse, config=config,
          interpret=interpret, backend=backend, logits_soft_cap=logits_soft_cap))


@functools.partial(jax.jit, static_argnames=dispatch.STATIC_OPTIONS)
def jitted_mla_prefill(q, k_nope, k_rope, v, input_row_offsets, kv_input_row_offsets,
                       scales=None, **static):
  """The entry point under ``jax.jit`` (static options from ``dispatch.static_options``),
  split over head shards where the operands are sharded (``partitioning``); an empty
  batch (offsets [0]) runs no kernel (``dispatch.empty_batch``)."""
  if input_row_offsets.shape[0] == 1:
    return dispatch.empty_batch(q.shape[0], q.shape[1], v.shape[-1], **static)
  hp = partitioning
  return hp.head_parallel(
      mla_on_shards,
      (q, k_nope, k_rope, v, input_row_offsets, kv_input_row_offsets, scales),
      roles=(hp.Q_HEADS, hp.KV_HEADS, hp.KV_HEADS, hp.KV_HEADS, None, None,
             hp.SCALE_HEADS),
      out_roles=(hp.Q_HEADS, hp.SINK_HEADS) if static["return_lse"] else (hp.Q_HEADS,),
      num_heads=q.shape[1], num_kv_heads=k_nope.shape[-2], **static)


def mla_on_shards(q, k_nope, k_rope, v, input_row_offsets, kv_input_row_offsets,
                  scales=None, *, max_prompt_len, mask, scale, output_dtype, return_lse,
                  config, interpret, backend, logits_soft_cap):
  """One head shard's call (all heads when unsharded): the logits' terms, then
  ``dispatch.ragged_attention``. ``scales``: FP8's (qk_scale, v_scale) or None; qk_scale
  multiplies both terms (one q_scale and one k_scale per K/V head)."""
  k_nope, k_rope, v, paged = logits.unpage(k_nope, k_rope, v)
  d_nope, d_rope = k_nope.shape[-1], k_rope.shape[-1]
  w_nope, w_rope = logits.padded_depth(d_nope), logits.padded_depth(d_rope)
  shared = k_rope.shape[-2] == 1
  if (w_nope, w_rope) == (d_nope, d_rope):
    # Both halves are powers of two: the kernel reads them straight out of q.
    q_ops, rope_part = [q], logits.QkPart(0, d_nope, 1, 0, d_rope, shared_k=shared)
  else:
    q_ops = [logits.pad_depth(q[..., :d_nope], w_nope),
             logits.pad_depth(q[..., d_nope:], w_rope)]
    rope_part = logits.QkPart(1, 0, 1, 0, w_rope, shared_k=shared)
  return dispatch.ragged_attention(
      q_ops, [logits.pad_depth(k_nope, w_nope), logits.pad_depth(k_rope, w_rope)], v,
      input_row_offsets, logits.kv_rows(kv_input_row_offsets), None, paged=paged,
      parts=[logits.QkPart(0, 0, 0, 0, w_nope), rope_part],
      max_prompt_len=max_prompt_len, mask=mask, scale=scale, output_dtype=output_dtype,
      return_lse=return_lse, config=config, interpret=interpret, backend=backend,
      logits_soft_cap=logits_soft_cap, scales=scales)

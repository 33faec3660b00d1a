"""Plain-jnp float32 references: the definition of what the kernels must compute.

Dense over all packed rows (a query sees a key iff both belong to the same sequence and
the mask allows it), processed in blocks of query rows to bound memory. Works with traced
offsets. Paged K/V (``PagedKV``) is first gathered into a contiguous layout. The matrix
products run at HIGHEST precision so that the reference is float32 on the GPU too, not TF32.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from pallas_prefill import fp8
from pallas_prefill import masks as masks_lib
from pallas_prefill.paged import PagedKV
from pallas_prefill.padded import run_starts, window_mask
from pallas_prefill.constants import EMPTY_ROW_LSE, SINK_MAX

_HI = lax.Precision.HIGHEST


def _row_positions(offsets, total):
  """Per row: its sequence, its index within the sequence, and whether it is in one."""
  offsets = offsets.astype(jnp.int32)
  rows = jnp.arange(total, dtype=jnp.int32)
  seq = jnp.searchsorted(offsets, rows, side="right").astype(jnp.int32) - 1
  batch = offsets.shape[0] - 1
  valid = (seq >= 0) & (seq < batch)
  seq = jnp.clip(seq, 0, batch - 1)
  return seq, rows - offsets[seq], valid


def _gather_pages(kv: PagedKV):
  """A paged operand laid out contiguously: [batch * capacity, heads, depth], sequence b's
  position p at row b * capacity + p (capacity = max_pages_per_seq * page_size)."""
  batch, max_pages = kv.block_table.shape
  pos = jnp.arange(max_pages * kv.page_size)
  pages = jnp.clip(kv.block_table[:, pos // kv.page_size], 0, kv.pages.shape[0] - 1)
  return kv.pages[pages, pos % kv.page_size].reshape(-1, *kv.pages.shape[2:])


def _unpage(input_row_offsets, kv_input_row_offsets, *operands):
  """Contiguous K/V operands and each key row's (sequence, position, validity), plus the
  K/V length of each sequence, for arrays with offsets or for PagedKV."""
  q_off = input_row_offsets.astype(jnp.int32)
  if isinstance(operands[0], PagedKV):
    first = operands[0]
    capacity = first.block_table.shape[1] * first.page_size
    kv_lens = first.cache_lengths.astype(jnp.int32) + jnp.diff(q_off)
    rows = jnp.arange(first.block_table.shape[0] * capacity, dtype=jnp.int32)
    k_seq, k_pos = rows // capacity, rows % capacity
    valid = k_pos < kv_lens[k_seq]
    # Slots past a sequence's K/V hold whatever the cache had (NaN, say): zero them.
    contiguous = [jnp.where(valid[:, None, None], _gather_pages(x), 0) for x in operands]
    return contiguous, (k_seq, k_pos, valid), kv_lens
  kv_off = q_off if kv_input_row_offsets is None else kv_input_row_offsets.astype(jnp.int32)
  return list(operands), _row_positions(kv_off, operands[0].shape[0]), jnp.diff(kv_off)


def _dequantized(x, scale, seq, batch, num_kv_heads):
  """FP8 rows x [rows, heads, depth] in float32 times their scale (``fp8.check_scale``'s
  shapes): row r takes its sequence seq[r]'s, a head its K/V head's. A 1-head operand
  among several K/V heads (MLA's shared k_rope) becomes one copy per K/V head, each
  dequantized with that head's scale. Other dtypes are returned as they are."""
  if not fp8.is_fp8(x.dtype):
    return x
  if x.shape[1] == 1 and num_kv_heads > 1:
    x = jnp.broadcast_to(x, (x.shape[0], num_kv_heads, x.shape[2]))
  per_row = fp8.check_scale("scale", scale, batch, num_kv_heads)[seq]  # [rows, kv heads]
  per_row = jnp.repeat(per_row, x.shape[1] // num_kv_heads, axis=1)
  return x.astype(jnp.float32) * per_row[:, :, None]


def _fp8_output_dtype(q, k, output_dtype):
  """The default output dtype: bfloat16 for an FP8 q, else q's (FP8 K/V or not)."""
  if output_dtype is not None:
    return output_dtype
  return fp8.output_dtype_for(q.dtype) if fp8.is_fp8(k.dtype) else q.dtype


def _clamped_sinks(sink_weights):
  """Sink logits in float32 within [-SINK_MAX, SINK_MAX], as the kernels take them
  (``dispatch.ragged_attention``), or None."""
  if sink_weights is None:
    return None
  return jnp.clip(sink_weights.astype(jnp.float32), -SINK_MAX, SINK_MAX)


def _soft_cap(s, cap):
  return s if cap is None else cap * jnp.tanh(s / cap)


def _reference(logits_fn, v, input_row_offsets, keys, kv_lens, *, num_heads, total_q,
               mask, scale, sink_weights, output_dtype, return_lse, logits_soft_cap=None,
               block_rows=256):
  """logits_fn(row_start, rows) -> [rows, num_heads, total_kv] float32 unscaled logits;
  keys = (sequence, position, valid) of each of the total_kv key rows."""
  _, num_kv_heads, v_depth = v.shape
  group = num_heads // num_kv_heads
  q_off = input_row_offsets.astype(jnp.int32)
  q_seq, q_idx, q_valid = _row_positions(q_off, total_q)
  k_seq, k_pos, k_valid = keys
  q_lens = jnp.diff(q_off)
  q_pos = kv_lens[q_seq] - q_lens[q_seq] + q_idx
  v32 = jnp.repeat(v.astype(jnp.float32), group, axis=1)  # [total_kv, num_heads, v_depth]
  sink = _clamped_sinks(sink_weights)

  num_blocks = max(1, -(-total_q // block_rows))  # one (padding) block when no query

  def one_block(i):
    r0 = i * block_rows
    sl = lambda x: lax.dynamic_slice_in_dim(x, r0, block_rows)
    pad = lambda x: jnp.pad(x, (0, num_blocks * block_rows - total_q))
    seq, pos, valid = sl(pad(q_seq)), sl(pad(q_pos)), sl(pad(q_valid))
    s = _soft_cap(logits_fn(r0, block_rows) * scale, logits_soft_cap)  # [rows, heads, kv]
    vis = ((seq[:, None] == k_seq[None, :]) & valid[:, None] & k_valid[None, :]
           & mask.visible(pos[:, None], k_pos[None, :]))[:, None, :]
    s = jnp.where(vis, s, -jnp.inf)
    m = jnp.max(s, axis=-1, initial=-jnp.inf)
    if sink is not None:
      m = jnp.maximum(m, sink[None, :])
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(vis, jnp.exp(s - m_safe[..., None]), 0.0)
    denom = jnp.sum(p, axis=-1)
    if sink is not None:
      denom = denom + jnp.exp(sink[None, :] - m_safe)
    seen = (denom > 0) & valid[:, None]  # rows past the last offset belong to no sequence
    denom_safe = jnp.where(seen, denom, 1.0)
    out = jnp.einsum("rhk,khd->rhd", p, v32, precision=_HI) / denom_safe[..., None]
    lse = jnp.where(seen, m_safe + jnp.log(denom_safe), EMPTY_ROW_LSE)
    return out, lse

  out, lse = lax.map(one_block, jnp.arange(num_blocks))
  out = out.reshape(-1, num_heads, v_depth)[:total_q].astype(output_dtype)
  lse = lse.reshape(-1, num_heads)[:total_q]
  return (out, lse) if return_lse else out


def _q_block(x, r0, rows):
  total = x.shape[0]
  num_blocks = max(1, -(-total // rows))
  x = jnp.pad(x.astype(jnp.float32), [(0, num_blocks * rows - total)] + [(0, 0)] * (x.ndim - 1))
  return lax.dynamic_slice_in_dim(x, r0, rows)


def _heads(x, num_heads):
  return jnp.repeat(x.astype(jnp.float32), num_heads // x.shape[1], axis=1)


def _empty_batch(q, k, v, output_dtype, return_lse):
  """The result on an empty batch (offsets [0]): zeros, with LSE -1e30."""
  out = jnp.zeros((*q.shape[:2], v.shape[-1]),
                  _fp8_output_dtype(q, k, output_dtype) or q.dtype)
  if not return_lse:
    return out
  return out, jnp.full(q.shape[:2], EMPTY_ROW_LSE, jnp.float32)


def mha_prefill_reference(q, k, v, input_row_offsets, *, max_prompt_len,
                          kv_input_row_offsets=None, mask=masks_lib.CausalMask(), scale=None,
                          sink_weights=None, output_dtype=None, return_lse=False,
                          config=None, interpret=None, backend=None, logits_soft_cap=None,
                          q_scale=None, k_scale=None, v_scale=None):
  """Float32 reference for ``mha_prefill``, same signature and semantics (FP8 inputs
  dequantized in float32 with their scales first).

  ``max_prompt_len``, ``config``, ``interpret`` and ``backend`` are accepted and ignored.
  """
  del max_prompt_len, config, interpret, backend
  num_heads = q.shape[1]
  if input_row_offsets.shape[0] == 1:  # an empty batch: every row past the last offset
    return _empty_batch(q, k, v, output_dtype, return_lse)
  (k, v), keys, kv_lens = _unpage(input_row_offsets, kv_input_row_offsets, k, v)
  output_dtype = _fp8_output_dtype(q, k, output_dtype)
  batch, num_kv_heads = input_row_offsets.shape[0] - 1, k.shape[-2]
  q_seq = _row_positions(input_row_offsets.astype(jnp.int32), q.shape[0])[0]
  q = _dequantized(q, q_scale, q_seq, batch, num_kv_heads)
  k, v = (_dequantized(x, s, keys[0], batch, num_kv_heads)
          for x, s in ((k, k_scale), (v, v_scale)))
  k32 = _heads(k, num_heads)
  scale = q.shape[-1] ** -0.5 if scale is None else scale

  def logits(r0, rows):
    return jnp.einsum("rhd,khd->rhk", _q_block(q, r0, rows), k32, precision=_HI)

  return _reference(logits, v, input_row_offsets, keys, kv_lens,
                    num_heads=num_heads, total_q=q.shape[0], mask=mask, scale=scale,
                    sink_weights=sink_weights, output_dtype=output_dtype or q.dtype,
                    return_lse=return_lse, logits_soft_cap=logits_soft_cap)


def mla_prefill_reference(q, k_nope, k_rope, v, input_row_offsets, *, max_prompt_len,
                          kv_input_row_offsets=None, mask=masks_lib.CausalMask(), scale=None,
                          output_dtype=None, return_lse=False, config=None, interpret=None,
                          backend=None, logits_soft_cap=None, q_scale=None, k_scale=None,
                          v_scale=None):
  """Float32 reference for ``mla_prefill``: logits = (q_nope.k_nope + q_rope.k_rope) * scale
  (FP8 inputs dequantized in float32 first: q_scale for all of q, k_scale for k_nope and
  k_rope, a shared k_rope dequantized per K/V head).

  ``max_prompt_len``, ``config``, ``interpret`` and ``backend`` are accepted and ignored.
  """
  del max_prompt_len, config, interpret, backend
  num_heads = q.shape[1]
  if input_row_offsets.shape[0] == 1:  # an empty batch: every row past the last offset
    return _empty_batch(q, k_nope, v, output_dtype, return_lse)
  (k_nope, k_rope, v), keys, kv_lens = _unpage(input_row_offsets, kv_input_row_offsets,
                                               k_nope, k_rope, v)
  output_dtype = _fp8_output_dtype(q, k_nope, output_dtype)
  batch, num_kv_heads = input_row_offsets.shape[0] - 1, k_nope.shape[-2]
  q_seq = _row_positions(input_row_offsets.astype(jnp.int32), q.shape[0])[0]
  q = _dequantized(q, q_scale, q_seq, batch, num_kv_heads)
  k_nope, k_rope, v = (_dequantized(x, s, keys[0], batch, num_kv_heads)
                       for x, s in ((k_nope, k_scale), (k_rope, k_scale), (v, v_scale)))
  d_nope = k_nope.shape[-1]
  kn32, kr32 = _heads(k_nope, num_heads), _heads(k_rope, num_heads)
  scale = q.shape[-1] ** -0.5 if scale is None else scale

  def logits(r0, rows):
    qb = _q_block(q, r0, rows)
    return (jnp.einsum("rhd,khd->rhk", qb[..., :d_nope], kn32, precision=_HI)
            + jnp.einsum("rhd,khd->rhk", qb[..., d_nope:], kr32, precision=_HI))

  return _reference(logits, v, input_row_offsets, keys, kv_lens,
                    num_heads=num_heads, total_q=q.shape[0], mask=mask, scale=scale,
                    sink_weights=None, output_dtype=output_dtype or q.dtype,
                    return_lse=return_lse, logits_soft_cap=logits_soft_cap)


def _token_runs(ids, padding_id):
  """Per token of [batch, seq] segment ids: its run (maximal run of equal ids, -1 for
  padding) and its position within the run."""
  seq = ids.shape[1]
  real, new_run = run_starts(ids, padding_id)
  run = jnp.cumsum(new_run, axis=1) - 1
  t = jnp.arange(seq)[None, :]
  run_start = lax.cummax(jnp.where(new_run, t, 0), axis=1)
  return jnp.where(real, run, -1), t - run_start


def dot_product_attention_reference(query, key, value, *, query_seq_lengths=None,
                                    key_value_seq_lengths=None, is_causal=False,
                                    local_window_size=None, scale=None, sink_weights=None,
                                    logits_soft_cap=None, segment_ids=None,
                                    padding_segment_id=None, max_segments=None,
                                    output_dtype=None, return_lse=False, backend=None,
                                    interpret=None, config=None, q_scale=None,
                                    k_scale=None, v_scale=None):
  """Float32 reference for ``dot_product_attention``, dense over each batch row: query t
  sees key s iff both are real tokens of one sequence (the first L rows, or the k-th runs
  of equal segment ids, runs past ``max_segments`` being padding) and the mask allows it
  at their positions within the sequence; FP8 inputs dequantized in float32 first, with
  batch row b's scales. Same arguments; ``backend``, ``interpret`` and ``config``
  ignored."""
  del backend, interpret, config
  batch, t_len, num_heads, head_dim = query.shape
  s_len, num_kv_heads = key.shape[1:3]
  output_dtype = _fp8_output_dtype(query, key, output_dtype)

  def dequantized(x, scale):  # [batch, seq, heads, depth], row b's scales
    rows = x.reshape(-1, *x.shape[2:])
    seq = jnp.arange(rows.shape[0], dtype=jnp.int32) // x.shape[1]
    return _dequantized(rows, scale, seq, batch, num_kv_heads).reshape(x.shape)

  query, key, value = (dequantized(x, sc) for x, sc in ((query, q_scale), (key, k_scale),
                                                       (value, v_scale)))
  mask = window_mask(is_causal, local_window_size)
  scale = head_dim ** -0.5 if scale is None else scale
  if segment_ids is not None:
    q_ids, kv_ids = (segment_ids if isinstance(segment_ids, (tuple, list))
                     else (segment_ids, segment_ids))
    q_run, q_pos = _token_runs(q_ids, padding_segment_id)
    k_run, k_pos = _token_runs(kv_ids, padding_segment_id)
    bound = max_segments if max_segments is not None else t_len + s_len
    q_run = jnp.where(q_run < bound, q_run, -1)  # padding: -1 and -2, never equal
    k_run = jnp.where((k_run >= 0) & (k_run < bound), k_run, -2)
    same = q_run[:, :, None] == k_run[:, None, :]
  else:
    q_pos = jnp.broadcast_to(jnp.arange(t_len)[None, :], (batch, t_len))
    k_pos = jnp.broadcast_to(jnp.arange(s_len)[None, :], (batch, s_len))
    ql = t_len if query_seq_lengths is None else query_seq_lengths[:, None]
    kl = s_len if key_value_seq_lengths is None else key_value_seq_lengths[:, None]
    same = (q_pos < ql)[:, :, None] & (k_pos < kl)[:, None, :]
  # A real query is a token of a kept run (or within its row's length), whether or not a
  # key run pairs with it: one with none sees no key, and reports its sink's LSE.
  q_real = q_run >= 0 if segment_ids is not None else (
      q_pos < (t_len if query_seq_lengths is None else query_seq_lengths[:, None]))
  vis = same & mask.visible(q_pos[:, :, None], k_pos[:, None, :])  # [b, t, s]
  sink = _clamped_sinks(sink_weights)
  rows = max(1, min(t_len, 256))  # query rows per block: bounded memory at any length
  blocks = max(1, -(-t_len // rows))  # one (padding) block when no query
  pad_t = lambda x: jnp.pad(x, [(0, 0), (0, blocks * rows - t_len)] + [(0, 0)] * (  # noqa: E731
      x.ndim - 2))

  def one_row(args):
    q, k, v, vis_row, real_row = args  # [T, N, H], [S, K, H], [S, K, Hv], [T, S], [T]
    k32, v32 = _heads(k, num_heads), _heads(v, num_heads)

    def one_block(i):
      sl = lambda x: lax.dynamic_slice_in_dim(x, i * rows, rows)  # noqa: E731
      vis = sl(vis_row)[:, None, :]  # [r, 1, S]
      logits = jnp.einsum("rhd,shd->rhs", sl(q).astype(jnp.float32), k32, precision=_HI)
      logits = jnp.where(vis, _soft_cap(logits * scale, logits_soft_cap), -jnp.inf)
      m = jnp.max(logits, axis=-1, initial=-jnp.inf)
      if sink is not None:
        m = jnp.maximum(m, sink[None, :])
      m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
      p = jnp.where(vis, jnp.exp(logits - m_safe[..., None]), 0.0)
      denom = p.sum(-1) + (0.0 if sink is None else jnp.exp(sink[None, :] - m_safe))
      seen = (denom > 0) & sl(real_row)[:, None]
      denom_safe = jnp.where(seen, denom, 1.0)
      out = jnp.einsum("rhs,shd->rhd", p, v32, precision=_HI) / denom_safe[..., None]
      out = jnp.where(sl(real_row)[:, None, None], out, 0.0)
      return out, jnp.where(seen, m_safe + jnp.log(denom_safe), EMPTY_ROW_LSE)

    out, lse = lax.map(one_block, jnp.arange(blocks))
    return out.reshape(blocks * rows, *out.shape[2:]), lse.reshape(blocks * rows, -1)

  out, lse = lax.map(one_row, (pad_t(query), key, value, pad_t(vis), pad_t(q_real)))
  out = out[:, :t_len].astype(output_dtype or query.dtype)
  return (out, lse[:, :t_len]) if return_lse else out

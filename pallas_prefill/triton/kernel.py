"""The ragged attention kernel that MHA and MLA share, lowered by Pallas to Triton (any
NVIDIA GPU, and the Pallas interpreter on the CPU).

One program per (query head, query tile, sequence), as in MAX's ``mha_prefill_v2_ragged``:
grid ``(num_heads, cdiv(max_prompt_len, block_q), batch)``. Each program reads the row
offsets itself, so a packed batch needs no padding and no per-sequence slicing.

The Triton lowering has no scalar prefetch, so the offsets are ordinary kernel inputs
(``pl.no_block_spec``) read at the top of the program and cast to int32 at once (an
unsigned loop bound turns the KV loop into an unpipelined ``scf.while``). Every index
derived from them is clamped into the arrays: garbage offsets under ``jit`` can neither
read nor write outside them nor produce NaN.

MHA and MLA differ only in how the logits are formed: the logits are a sum of
``logits.QkPart`` products, one for MHA, two (nope + rope, the rope K shared by all heads)
for MLA. Softmax, masking, ragged indexing and tiling are the code below, written once.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_prefill import partitioning
from pallas_prefill.config import MhaConfig, default_config
from pallas_prefill.constants import EMPTY_ROW_LSE, LN_2, LOG2_E, MASK_VALUE
from pallas_prefill.logits import soft_capped

MAX_GRID_DIM = 65535  # CUDA's limit on a launch grid's y and z dimensions


def _read_range(off_ref, b, total, *, force_zero_start):
  """Rows [start, end) of sequence b, clamped so that 0 <= start <= end <= total."""
  start = off_ref[b].astype(jnp.int32)
  end = off_ref[b + 1].astype(jnp.int32)
  start = jnp.clip(start, 0, total)
  if force_zero_start:
    # With the first sequence starting at row 0 whatever offsets[0] holds, the programs'
    # row ranges chain without gaps, so every output row is written even for garbage.
    start = jnp.where(b == 0, 0, start)
  end = jnp.clip(end, start, total)
  return start, end


def _zero_rows(o_ref, lse_ref, h, first, end, stride, block):
  """Writes zeros (and the empty-row LSE) to rows first + i*stride + [0, block) below end."""
  trips = lax.div(jnp.maximum(end - first, 0) + stride - 1, stride)
  depth = o_ref.shape[-1]

  def body(i, carry):
    row0 = first + i * stride
    valid = row0 + lax.broadcasted_iota(jnp.int32, (block,), 0) < end
    plt.store(o_ref.at[pl.ds(row0, block), h, :],
              jnp.zeros((block, depth), o_ref.dtype), mask=valid[:, None])
    if lse_ref is not None:
      plt.store(lse_ref.at[pl.ds(row0, block), h],
                jnp.full((block,), EMPTY_ROW_LSE, jnp.float32), mask=valid)
    return carry

  lax.fori_loop(0, trips, body, 0)


@dataclasses.dataclass(frozen=True)
class _Program:
  """One program's view of its sequence: its refs, its query head h (K/V head kv_head),
  its query rows [q_start, q_start + q_len) and their first position start_pos, and its
  keys (kv_len of them, from row kv_start, or in the pages of block table row b)."""

  q_refs: list
  k_refs: list
  v_ref: object
  o_ref: object
  lse_ref: object
  sink_ref: object
  table_ref: object
  h: object
  kv_head: object
  b: object
  q_start: object
  q_len: object
  kv_start: object
  kv_len: object
  start_pos: object
  qk_scale: object = None  # FP8: the logits' dequantization factor, or None
  v_scale: object = None  # FP8: V's, which multiplies the output

  @property
  def wide(self):
    """The dtype FP8 tiles are widened to: Q's when Q is 16-bit (f16 holds every e4m3 and
    e5m2 value too), else bf16."""
    q_dtype = jnp.dtype(self.q_refs[0].dtype)
    return q_dtype if q_dtype.itemsize == 2 else jnp.dtype(jnp.bfloat16)

  def page_of(self, j, block_kv):
    """The page holding KV tile j (block_kv divides page_size: one page per tile)."""
    num_pages, page_size = self.v_ref.shape[:2]
    max_pages = self.table_ref.shape[1]
    slot = jnp.clip(lax.div(j * block_kv, page_size), 0, max_pages - 1)
    return jnp.clip(self.table_ref[self.b, slot].astype(jnp.int32), 0, num_pages - 1)

  def kv_tile(self, j, page, block_kv):
    """The K/V tile j of this sequence (in `page` when paged): (ref, head, cols) -> view."""
    if self.table_ref is None:
      kv_row0 = self.kv_start + j * block_kv
      return lambda ref, head, cols: ref.at[pl.ds(kv_row0, block_kv), head, cols]
    row = lax.rem(j * block_kv, self.v_ref.shape[1])
    return lambda ref, head, cols: ref.at[page, pl.ds(row, block_kv), head, cols]


def _kernel(*refs, parts, n_q, n_k, kv_layout, has_sink, has_lse, has_scales, mask, scale,
            soft_cap, top_left, block_q, block_kv, num_tiles, group):
  refs = list(refs)
  q_off_ref = refs.pop(0)
  kv_start_ref, kv_end_ref = (refs.pop(0), refs.pop(0)) if kv_layout == "ranges" else (
      None, None)
  table_ref, cache_ref = (refs.pop(0), refs.pop(0)) if kv_layout == "paged" else (None, None)
  sink_ref = refs.pop(0) if has_sink else None
  qk_scale_ref, v_scale_ref = (refs.pop(0), refs.pop(0)) if has_scales else (None, None)
  q_refs, refs = refs[:n_q], refs[n_q:]
  k_refs, refs = refs[:n_k], refs[n_k:]
  v_ref, o_ref = refs[0], refs[1]
  lse_ref = refs[2] if has_lse else None

  h = pl.program_id(0)
  tile_id = pl.program_id(1)
  tile = num_tiles - 1 - tile_id  # the heaviest (last) causal tiles start first
  b = pl.program_id(2)
  batch = pl.num_programs(2)
  kv_head = h // group

  total_q = o_ref.shape[0]
  q_start, q_end = _read_range(q_off_ref, b, total_q, force_zero_start=True)
  q_len = q_end - q_start
  if kv_layout == "ranges":
    total_kv = v_ref.shape[0]
    kv_start = jnp.clip(kv_start_ref[b].astype(jnp.int32), 0, total_kv)
    kv_len = jnp.clip(kv_end_ref[b].astype(jnp.int32), kv_start, total_kv) - kv_start
  elif kv_layout == "paged":
    capacity = table_ref.shape[1] * v_ref.shape[1]
    cache_len = jnp.clip(cache_ref[b].astype(jnp.int32), 0, capacity)
    kv_start, kv_len = None, jnp.minimum(cache_len + q_len, capacity)
  else:
    kv_start, kv_len = q_start, q_len
  program = _Program(q_refs=q_refs, k_refs=k_refs, v_ref=v_ref, o_ref=o_ref, lse_ref=lse_ref,
                     sink_ref=sink_ref, table_ref=table_ref, h=h, kv_head=kv_head, b=b,
                     q_start=q_start, q_len=q_len, kv_start=kv_start, kv_len=kv_len,
                     start_pos=jnp.int32(0) if top_left else kv_len - q_len,
                     qk_scale=qk_scale_ref[b, kv_head] if has_scales else None,
                     v_scale=v_scale_ref[b, kv_head] if has_scales else None)

  row0 = tile * block_q
  pl.when(row0 < q_len)(functools.partial(
      _attend, program, row0, parts=parts, mask=mask, scale=scale, soft_cap=soft_cap,
      block_q=block_q, block_kv=block_kv))

  # Rows that no attention program covers get zeros: a sequence's rows past
  # max_prompt_len (only for offsets that break the contract, under jit), and every row
  # past offsets[-1]. For valid offsets that fill the arrays both loops run zero times.
  stride = num_tiles * block_q
  _zero_rows(o_ref, lse_ref, h, q_start + stride + row0, q_end, stride, block_q)

  @pl.when(b == batch - 1)
  def _zero_tail():
    tail = jnp.clip(q_off_ref[batch].astype(jnp.int32), 0, total_q)
    _zero_rows(o_ref, lse_ref, h, tail + tile_id * block_q, total_q, stride, block_q)


def _attend(p: _Program, row0, *, parts, mask, scale, soft_cap, block_q, block_kv):
  """Attention for the query rows [row0, row0 + block_q) of the program's sequence: the
  KV tiles the mask can show, the partial ones masked, then the normalized rows."""
  rows = row0 + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
  row_valid = rows < p.q_len
  q_pos = p.start_pos + rows
  qs = []
  for part in parts:
    q_ref = p.q_refs[part.q_index]
    qs.append(_load(
        q_ref.at[pl.ds(p.q_start + row0, block_q), p.h, pl.ds(part.q_col, part.width)],
        row_valid[:, None], p.wide))
  if p.qk_scale is not None:
    scale = scale * p.qk_scale  # FP8: the dequantization scales of Q and K

  q_lo = p.start_pos + row0
  q_hi = p.start_pos + jnp.minimum(row0 + block_q, p.q_len) - 1
  lo, hi = mask.kv_range(q_lo, q_hi, p.kv_len)
  full_lo, full_hi = mask.full_range(q_lo, q_hi, p.kv_len)
  t_lo = lax.div(lo, block_kv)
  t_hi = jnp.maximum(lax.div(hi + block_kv - 1, block_kv), t_lo)
  u_lo = jnp.clip(lax.div(full_lo + block_kv - 1, block_kv), t_lo, t_hi)
  u_hi = jnp.clip(lax.div(full_hi, block_kv), u_lo, t_hi)

  if p.sink_ref is not None:
    m0 = jnp.full((block_q,), p.sink_ref[p.h].astype(jnp.float32) * LOG2_E, jnp.float32)
    l0 = jnp.ones((block_q,), jnp.float32)
  else:
    m0 = jnp.full((block_q,), MASK_VALUE, jnp.float32)
    l0 = jnp.zeros((block_q,), jnp.float32)
  paged = p.table_ref is not None
  page = p.page_of(t_lo, block_kv) if paged else jnp.int32(0)
  carry = (jnp.zeros((block_q, p.v_ref.shape[-1]), jnp.float32), m0, l0, page)
  step = functools.partial(_kv_step, p, parts, qs, q_pos, mask=mask, scale=scale,
                           soft_cap=soft_cap, block_kv=block_kv)
  masked_step = functools.partial(step, masked=True)
  carry = lax.fori_loop(t_lo, u_lo, masked_step, carry)
  carry = lax.fori_loop(u_lo, u_hi, functools.partial(step, masked=False), carry)
  acc, m, l, _ = lax.fori_loop(u_hi, t_hi, masked_step, carry)

  seen = l > 0
  l_safe = jnp.where(seen, l, 1.0)
  out = acc / l_safe[:, None]
  if p.v_scale is not None:
    out = out * p.v_scale
  plt.store(p.o_ref.at[pl.ds(p.q_start + row0, block_q), p.h, :], out.astype(p.o_ref.dtype),
            mask=row_valid[:, None])
  if p.lse_ref is not None:
    lse = jnp.where(seen, (m + jnp.log2(l_safe)) * LN_2, EMPTY_ROW_LSE)
    plt.store(p.lse_ref.at[pl.ds(p.q_start + row0, block_q), p.h], lse, mask=row_valid)


def _load(view, mask, wide):
  """A tile, zeros where `mask` (None: all rows) is False. FP8 tiles are widened to
  `wide` (bf16 or f16, both exact: every e4m3 and e5m2 value is a value of either) and
  zeroed after the load: Triton has no FP8 fill value, and a masked-off FP8 lane may hold
  a NaN pattern."""
  if jnp.dtype(view.dtype).itemsize != 1:
    return plt.load(view, mask=mask, other=None if mask is None else 0)
  x = plt.load(view, mask=mask).astype(wide)
  return x if mask is None else jnp.where(mask, x, jnp.zeros((), wide))


def _kv_step(p: _Program, parts, qs, q_pos, j, carry, *, masked, mask, scale, soft_cap,
             block_kv):
  """KV tile j of the online softmax (base 2, scale and soft cap including log2(e)): Q.K
  as the sum of the logit parts' products, the soft cap, the mask (on partial tiles), the
  running maximum and sum, and P.V; carry = (acc, m, l, the page of tile j when paged)."""
  acc, m_prev, l_prev, page = carry
  tile_at = p.kv_tile(j, page, block_kv)
  if p.table_ref is not None:
    # The next tile's block-table entry, read one iteration ahead: a K/V address that
    # waits on a table read in its own iteration costs MHA 13 to 22 % on the H200.
    page = p.page_of(j + 1, block_kv)
  cols = j * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
  kv_valid = cols < p.kv_len
  load_mask = kv_valid[:, None] if masked else None
  s = None
  for part, q in zip(parts, qs):
    k_head = jnp.int32(0) if part.shared_k else p.kv_head
    k = _load(tile_at(p.k_refs[part.k_index], k_head, pl.ds(part.k_col, part.width)),
              load_mask, p.wide)
    term = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                           preferred_element_type=jnp.float32)
    s = term if s is None else s + term
  s = s * scale
  if soft_cap is not None:
    s = soft_capped(s, soft_cap)
  if masked:
    visible = mask.visible(q_pos[:, None], cols[None, :]) & kv_valid[None, :]
    s = jnp.where(visible, s, MASK_VALUE)
  m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
  alpha = jnp.exp2(m_prev - m_new)
  p_ = jnp.exp2(s - m_new[:, None])
  if masked:
    p_ = jnp.where(visible, p_, 0.0)
  l_new = l_prev * alpha + jnp.sum(p_, axis=1)
  v = _load(tile_at(p.v_ref, p.kv_head, slice(None)), load_mask, p.wide)
  acc = acc * alpha[:, None] + lax.dot_general(
      p_.astype(v.dtype), v, (((1,), (0,)), ((), ())),
      preferred_element_type=jnp.float32)
  return acc, m_new, l_new, page


def ragged_attention_triton(q_ops, k_ops, v, q_offsets, kv_rows, sink_weights, *, parts,
                            max_prompt_len, mask, scale, output_dtype, return_lse,
                            config: MhaConfig | None, interpret: bool, paged=None,
                            soft_cap=None, top_left=False, scales=None):
  """The Triton kernel on validated operands (``dispatch.ragged_attention``'s, V padded to
  a power-of-two depth): out [total_q, num_heads, v_depth] in output_dtype, and lse
  [total_q, num_heads] float32 when return_lse. config None picks ``default_config`` for
  the summed part widths and v's depth."""
  total_q, num_heads, _ = q_ops[0].shape
  num_kv_heads = v.shape[-2]
  batch = q_offsets.shape[0] - 1
  if config is None:
    config = default_config(sum(p.width for p in parts), v.shape[-1], v.dtype, mask,
                            max_prompt_len, page_size=None if paged is None else v.shape[1])
  if paged is not None and config.block_kv > v.shape[1]:
    # KV tiles follow the page boundaries: no tile spans two pages.
    config = dataclasses.replace(config, block_kv=v.shape[1])
  num_tiles = pl.cdiv(max_prompt_len, config.block_q)
  if num_tiles > MAX_GRID_DIM:
    raise ValueError(f"max_prompt_len ({max_prompt_len}) needs {num_tiles} query tiles of "
                     f"{config.block_q}, more than the grid's limit of {MAX_GRID_DIM}")
  if paged is not None:
    kv_layout = "paged"
  else:
    kv_layout = "packed" if kv_rows is None else "ranges"
  kernel = functools.partial(
      _kernel, parts=tuple(parts), n_q=len(q_ops), n_k=len(k_ops), kv_layout=kv_layout,
      has_sink=sink_weights is not None, has_lse=return_lse,
      has_scales=scales is not None, mask=mask,
      scale=scale * LOG2_E, soft_cap=None if soft_cap is None else soft_cap * LOG2_E,
      top_left=top_left, block_q=config.block_q, block_kv=config.block_kv,
      num_tiles=num_tiles, group=num_heads // num_kv_heads)
  inputs = [q_offsets]
  inputs += list(kv_rows) if kv_rows is not None else []
  inputs += list(paged) if paged is not None else []
  inputs += [sink_weights] if sink_weights is not None else []
  inputs += list(scales) if scales is not None else []
  inputs += [*q_ops, *k_ops, v]
  out_shape = [partitioning.output_struct(inputs, (total_q, num_heads, v.shape[-1]),
                                         output_dtype)]
  if return_lse:
    out_shape.append(partitioning.output_struct(inputs, (total_q, num_heads), jnp.float32))
  out, *lse = pl.pallas_call(
      kernel,
      grid=(num_heads, num_tiles, batch),
      in_specs=[pl.no_block_spec] * len(inputs),
      out_specs=[pl.no_block_spec] * len(out_shape),
      out_shape=out_shape,
      compiler_params=plt.CompilerParams(num_warps=config.num_warps,
                                         num_stages=config.num_stages),
      interpret=interpret,
      name="ragged_prefill_attention",
  )(*inputs)
  return (out, lse[0]) if return_lse else out

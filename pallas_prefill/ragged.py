"""The ragged attention kernel that MHA and MLA share (Pallas GPU, Triton lowering).

One program per (query head, query tile, sequence), as in MAX's ``mha_prefill_v2_ragged``:
grid ``(num_heads, cdiv(max_prompt_len, block_q), batch)``. Each program reads the row
offsets itself, so a packed batch needs no padding and no per-sequence slicing.

The Triton lowering has no scalar prefetch, so the offsets are ordinary kernel inputs
(``pl.no_block_spec``) read at the top of the program and cast to int32 at once (an
unsigned loop bound turns the KV loop into an unpipelined ``scf.while``). Every index
derived from them is clamped into the arrays: garbage offsets under ``jit`` can neither
read nor write outside them nor produce NaN.

MHA and MLA differ only in how the logits are formed: the logits are a sum of
``QkPart`` products, one for MHA, two (nope + rope, the rope K shared by all heads) for
MLA. Softmax, masking, ragged indexing and tiling are the code below, written once.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_prefill import mosaic
from pallas_prefill.config import (MhaConfig, MosaicConfig, default_config,
                                   default_mosaic_config, prefers_mosaic)
from pallas_prefill.paged import PagedKV

# Finite stand-in for -inf: a row that sees no key must come out as zeros, never NaN.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
# The log-sum-exp reported for a row that sees no key and has no sink.
EMPTY_ROW_LSE = -1e30
LOG2_E = math.log2(math.e)
LN_2 = math.log(2.0)
MAX_GRID_DIM = 65535  # CUDA's limit on a launch grid's y and z dimensions


@dataclasses.dataclass(frozen=True)
class QkPart:
  """One term of the logits: ``q[:, h, q_col:q_col+width] . k[:, kv_head, k_col:k_col+width]``.

  ``q_index``/``k_index`` pick among the kernel's Q and K operands; ``shared_k`` means the K
  operand has one head that every query head uses (MLA's rope key). ``width`` is a power of
  two, as every tensor shape in a Triton kernel must be.
  """

  q_index: int
  q_col: int
  k_index: int
  k_col: int
  width: int
  shared_k: bool = False


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


def _kernel(*refs, parts, n_q, n_k, kv_layout, has_sink, has_lse, mask, scale,
            block_q, block_kv, num_tiles, group):
  refs = list(refs)
  q_off_ref = refs.pop(0)
  kv_off_ref = refs.pop(0) if kv_layout == "offsets" else None
  table_ref, cache_ref = (refs.pop(0), refs.pop(0)) if kv_layout == "paged" else (None, None)
  sink_ref = refs.pop(0) if has_sink else None
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
  if kv_layout == "offsets":
    total_kv = v_ref.shape[0]
    kv_start, kv_end = _read_range(kv_off_ref, b, total_kv, force_zero_start=False)
    kv_len = kv_end - kv_start
  elif kv_layout == "paged":
    num_pages, page_size = v_ref.shape[:2]
    max_pages = table_ref.shape[1]
    capacity = max_pages * page_size
    cache_len = jnp.clip(cache_ref[b].astype(jnp.int32), 0, capacity)
    kv_start, kv_len = None, jnp.minimum(cache_len + q_len, capacity)
  else:
    kv_start, kv_len = q_start, q_len
  start_pos = kv_len - q_len

  def page_of(j):
    """The page holding KV tile j (block_kv divides page_size: one page per tile)."""
    slot = jnp.clip(lax.div(j * block_kv, page_size), 0, max_pages - 1)
    return jnp.clip(table_ref[b, slot].astype(jnp.int32), 0, num_pages - 1)

  def kv_tile(j, page):
    """The K/V tile j of this sequence (in `page` when paged): (ref, head, cols) -> view."""
    if kv_layout != "paged":
      kv_row0 = kv_start + j * block_kv
      return lambda ref, head, cols: ref.at[pl.ds(kv_row0, block_kv), head, cols]
    row = lax.rem(j * block_kv, page_size)
    return lambda ref, head, cols: ref.at[page, pl.ds(row, block_kv), head, cols]

  row0 = tile * block_q

  @pl.when(row0 < q_len)
  def _attend():
    rows = row0 + lax.broadcasted_iota(jnp.int32, (block_q,), 0)
    row_valid = rows < q_len
    q_pos = start_pos + rows
    qs = []
    for part in parts:
      q_ref = q_refs[part.q_index]
      qs.append(plt.load(
          q_ref.at[pl.ds(q_start + row0, block_q), h, pl.ds(part.q_col, part.width)],
          mask=row_valid[:, None], other=0))

    q_lo = start_pos + row0
    q_hi = start_pos + jnp.minimum(row0 + block_q, q_len) - 1
    lo, hi = mask.kv_range(q_lo, q_hi, kv_len)
    full_lo, full_hi = mask.full_range(q_lo, q_hi, kv_len)
    t_lo = lax.div(lo, block_kv)
    t_hi = jnp.maximum(lax.div(hi + block_kv - 1, block_kv), t_lo)
    u_lo = jnp.clip(lax.div(full_lo + block_kv - 1, block_kv), t_lo, t_hi)
    u_hi = jnp.clip(lax.div(full_hi, block_kv), u_lo, t_hi)

    def body(j, carry, *, masked):
      acc, m_prev, l_prev, page = carry
      tile_at = kv_tile(j, page)
      if kv_layout == "paged":
        # The next tile's block-table entry, read one iteration ahead: a K/V address that
        # waits on a table read in its own iteration costs MHA 13 to 22 % on the H200.
        page = page_of(j + 1)
      cols = j * block_kv + lax.broadcasted_iota(jnp.int32, (block_kv,), 0)
      kv_valid = cols < kv_len
      load_mask = kv_valid[:, None] if masked else None
      s = None
      for part, q in zip(parts, qs):
        k_head = jnp.int32(0) if part.shared_k else kv_head
        k = plt.load(tile_at(k_refs[part.k_index], k_head, pl.ds(part.k_col, part.width)),
                     mask=load_mask, other=0 if masked else None)
        term = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                               preferred_element_type=jnp.float32)
        s = term if s is None else s + term
      s = s * scale
      if masked:
        visible = mask.visible(q_pos[:, None], cols[None, :]) & kv_valid[None, :]
        s = jnp.where(visible, s, MASK_VALUE)
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1))
      alpha = jnp.exp2(m_prev - m_new)
      p = jnp.exp2(s - m_new[:, None])
      if masked:
        p = jnp.where(visible, p, 0.0)
      l_new = l_prev * alpha + jnp.sum(p, axis=1)
      v = plt.load(tile_at(v_ref, kv_head, slice(None)),
                   mask=load_mask, other=0 if masked else None)
      acc = acc * alpha[:, None] + lax.dot_general(
          p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
          preferred_element_type=jnp.float32)
      return acc, m_new, l_new, page

    if has_sink:
      m0 = jnp.full((block_q,), sink_ref[h].astype(jnp.float32) * LOG2_E, jnp.float32)
      l0 = jnp.ones((block_q,), jnp.float32)
    else:
      m0 = jnp.full((block_q,), MASK_VALUE, jnp.float32)
      l0 = jnp.zeros((block_q,), jnp.float32)
    page = page_of(t_lo) if kv_layout == "paged" else jnp.int32(0)
    carry = (jnp.zeros((block_q, v_ref.shape[-1]), jnp.float32), m0, l0, page)
    masked_body = functools.partial(body, masked=True)
    carry = lax.fori_loop(t_lo, u_lo, masked_body, carry)
    carry = lax.fori_loop(u_lo, u_hi, functools.partial(body, masked=False), carry)
    acc, m, l, _ = lax.fori_loop(u_hi, t_hi, masked_body, carry)

    seen = l > 0
    l_safe = jnp.where(seen, l, 1.0)
    out = acc / l_safe[:, None]
    plt.store(o_ref.at[pl.ds(q_start + row0, block_q), h, :], out.astype(o_ref.dtype),
              mask=row_valid[:, None])
    if has_lse:
      lse = jnp.where(seen, (m + jnp.log2(l_safe)) * LN_2, EMPTY_ROW_LSE)
      plt.store(lse_ref.at[pl.ds(q_start + row0, block_q), h], lse, mask=row_valid)

  # Rows that no attention program covers get zeros: a sequence's rows past
  # max_prompt_len (only for offsets that break the contract, under jit), and every row
  # past offsets[-1]. For valid offsets that fill the arrays both loops run zero times.
  stride = num_tiles * block_q
  _zero_rows(o_ref, lse_ref, h, q_start + stride + row0, q_end, stride, block_q)

  @pl.when(b == batch - 1)
  def _zero_tail():
    tail = jnp.clip(q_off_ref[batch].astype(jnp.int32), 0, total_q)
    _zero_rows(o_ref, lse_ref, h, tail + tile_id * block_q, total_q, stride, block_q)


def ragged_attention(q_ops, k_ops, v, q_offsets, kv_offsets, sink_weights, *, parts,
                     max_prompt_len, mask, scale, output_dtype, return_lse,
                     config: MhaConfig | MosaicConfig | None, interpret: bool, paged=None,
                     backend: str = "triton"):
  """Launches the ragged attention kernel on validated operands.

  Args:
    q_ops: Q operands, each [total_q, num_heads, depth_i].
    k_ops: K operands, each [total_kv, num_kv_heads or 1, depth_i], or with `paged`
      [num_pages, page_size, num_kv_heads or 1, depth_i].
    v: [total_kv, num_kv_heads, v_depth] (paged: [num_pages, page_size, ...]); a v_depth
      that is not a power of two is padded here and the output sliced back.
    q_offsets, kv_offsets: [batch + 1] int32 or uint32; kv_offsets may be None (K/V
      packed like Q, or paged).
    paged: None, or (block_table [batch, max_pages] int32, cache_lengths [batch] int32)
      when the K/V operands are pages.
    sink_weights: [num_heads] or None.
    parts: the QkPart terms whose sum forms the logits; their widths are powers of two.
    config: None picks ``default_config`` for the summed part widths and v's depth.
    backend: "triton", "mosaic_gpu" or "auto" (see ``select_backend``).

  Returns:
    out [total_q, num_heads, v_depth] in output_dtype, and lse [total_q, num_heads]
    float32 when return_lse.
  """
  total_q, num_heads, _ = q_ops[0].shape
  num_kv_heads, v_depth = v.shape[-2], v.shape[-1]
  batch = q_offsets.shape[0] - 1
  if batch > MAX_GRID_DIM:
    raise ValueError(f"batch ({batch}) must be at most {MAX_GRID_DIM}: it is the launch "
                     "grid's z dimension, which CUDA limits")
  if total_q == 0 or v.shape[0] == 0:
    # No query, or no key anywhere: nothing for a kernel to do (and nothing to index).
    return _no_keys(total_q, num_heads, v_depth, q_offsets, sink_weights, output_dtype,
                    return_lse)
  v = pad_depth(v, padded_depth(v_depth))
  mosaic_config = select_backend(backend, parts, v, output_dtype, return_lse, paged, mask,
                                 max_prompt_len, config, interpret)
  if mosaic_config is not None:
    out = mosaic.ragged_attention_mgpu(
        q_ops, k_ops, v, q_offsets, kv_offsets, sink_weights, parts=parts, mask=mask,
        scale=scale, output_dtype=output_dtype, return_lse=return_lse, config=mosaic_config,
        paged=paged)
    if return_lse:
      return out[0][..., :v_depth], out[1]
    return out[..., :v_depth]
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
    kv_layout = "packed" if kv_offsets is None else "offsets"
  kernel = functools.partial(
      _kernel, parts=tuple(parts), n_q=len(q_ops), n_k=len(k_ops), kv_layout=kv_layout,
      has_sink=sink_weights is not None, has_lse=return_lse, mask=mask,
      scale=scale * LOG2_E, block_q=config.block_q, block_kv=config.block_kv,
      num_tiles=num_tiles, group=num_heads // num_kv_heads)
  inputs = [q_offsets]
  inputs += [kv_offsets] if kv_offsets is not None else []
  inputs += list(paged) if paged is not None else []
  inputs += [sink_weights] if sink_weights is not None else []
  inputs += [*q_ops, *k_ops, v]
  # Inside shard_map the outputs vary over the mesh axes any input varies over.
  varying = frozenset().union(*(jax.typeof(x).mat.varying for x in inputs))
  sds = functools.partial(jax.ShapeDtypeStruct,
                          manual_axis_type=jax.sharding.ManualAxisType(varying=varying))
  out_shape = [sds((total_q, num_heads, v.shape[-1]), output_dtype)]
  if return_lse:
    out_shape.append(sds((total_q, num_heads), jnp.float32))
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
  out = out[..., :v_depth]
  return (out, lse[0]) if return_lse else out


def select_backend(backend, parts, v, output_dtype, return_lse, paged, mask, max_prompt_len,
                   config, interpret) -> MosaicConfig | None:
  """The Mosaic GPU config to run with, or None for the Triton kernel.

  "triton" is None. "mosaic_gpu" is the given MosaicConfig or the default one, and raises
  NotImplementedError when the Mosaic GPU kernel cannot serve the case (the reason says
  why). "auto" is Mosaic GPU where the tuned table for the device says it is the faster
  one (on a paged cache: wherever the table has the shape, ``config.prefers_mosaic``) and
  it can serve the case, on the GPU (never in interpret mode); Triton otherwise.
  """
  if backend == "triton":
    return None
  qk = sum(p.width for p in parts)
  if isinstance(config, MosaicConfig):
    mosaic_config = config
  else:
    mosaic_config = mosaic.fitted(
        default_mosaic_config(qk, v.shape[-1], v.dtype, mask, max_prompt_len), parts,
        v.shape[-1], v.dtype, output_dtype, return_lse)
  reason = mosaic.unsupported_reason(parts, v.shape[-1], v.dtype, output_dtype, return_lse,
                                     mosaic_config)
  if backend == "mosaic_gpu":  # validation refused interpret mode
    if reason is not None:
      raise NotImplementedError(f"backend='mosaic_gpu' cannot run this call: {reason}")
    return mosaic_config
  # "auto"
  if interpret or reason is not None or isinstance(config, MhaConfig):
    return None
  if isinstance(config, MosaicConfig) or prefers_mosaic(
      qk, v.shape[-1], v.dtype, mask, max_prompt_len, paged=paged is not None):
    return mosaic_config
  return None


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


# The options an entry point's jitted implementation takes as static arguments.
STATIC_OPTIONS = ("max_prompt_len", "mask", "scale", "output_dtype", "return_lse", "config",
                  "interpret", "backend")


def static_options(q, *, depth, max_prompt_len, mask, scale, output_dtype, return_lse,
                   config, interpret, backend="triton") -> dict:
  """Validated options in the hashable form the jitted implementations take, defaults
  resolved: scale 1/sqrt(depth), output dtype q's, interpret exactly on the CPU backend."""
  return dict(
      max_prompt_len=int(max_prompt_len), mask=mask,
      scale=float(depth ** -0.5 if scale is None else scale),
      output_dtype=jnp.dtype(q.dtype if output_dtype is None else output_dtype),
      return_lse=bool(return_lse), config=config,
      interpret=jax.default_backend() == "cpu" if interpret is None else interpret,
      backend=backend)


def padded_depth(depth: int) -> int:
  """The power-of-two depth (at least 16, the smallest matrix-instruction K) a depth runs at."""
  return max(16, 1 << (depth - 1).bit_length())


def unpage(*operands):
  """The arrays behind K/V operands, plus (block_table, cache_lengths) when they are
  PagedKV (taken from the first: all share one block table) or None."""
  if not isinstance(operands[0], PagedKV):
    return (*operands, None)
  first = operands[0]
  return (*(x.pages for x in operands), (first.block_table, first.cache_lengths))


def pad_depth(x, depth: int):
  """Zero-pads the last axis of x to `depth` (a no-op when it already has that size)."""
  extra = depth - x.shape[-1]
  return x if extra == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, extra)])

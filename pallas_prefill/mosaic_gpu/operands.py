"""The work before the Mosaic GPU kernel: its operands from the entry points' arrays.

The work list and scalars (``work_items``' kernel, or XLA's ``work_list`` with the LSE);
``v_tail``, V's rows around the batch's last key with the rows past that key zeroed (rows
past the last key may hold anything, NaN included, and 0 * NaN would poison P.V): with
batch-invariant tiles the ``2 * block_kv`` rows centred on the end of the keys, from
which the kernel reads every tile that runs past it; with aligned tiles the tile that
ends with the 8-row group of the last key; for a paged cache each sequence's last V tile.
Small pages gathered into contiguous K/V; FP8's V^T (``transposed_v``, and from a paged
cache ``transposed_v_pages``: small Triton-lowered kernels). Q, K and V themselves are
passed as they are (only arrays shorter than one tile are padded to one).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from pallas_prefill import fp8, partitioning
from pallas_prefill.config import MosaicConfig
from pallas_prefill.mosaic_gpu import layout as L
from pallas_prefill.mosaic_gpu import schedule
from pallas_prefill.mosaic_gpu import work_items
from pallas_prefill.mosaic_gpu.work_list import (keyed_items, num_work_items, paged_kv_lengths,
                                                 q_ranges, work_list)


def gathered_pages(pages_ops, block_table, cache_lengths, q_offsets, total_q):
  """Paged K/V operands (each [num_pages, page_size, heads, depth]) gathered into
  contiguous arrays [batch * capacity, heads, depth], capacity = max_pages * page_size:
  sequence b's keys at rows [b * capacity, b * capacity + kv_len[b]), and every row past
  them zeroed (stale cache rows may hold NaN, and 0 * NaN would reach P.V); and those
  rows, (kv_starts, kv_ends) [batch] int32 each, as ``kv_rows`` describes them. Page ids
  are clamped to the pages there are, as the Triton kernel does. One XLA gather per
  operand: the whole block table's capacity is copied, whatever the cache lengths."""
  num_pages, page_size = pages_ops[0].shape[:2]
  batch, max_pages = block_table.shape
  capacity = max_pages * page_size
  ids = jnp.clip(block_table.astype(jnp.int32), 0, num_pages - 1).reshape(-1)
  kv_len = paged_kv_lengths(q_offsets, total_q, cache_lengths, capacity)
  keep = (jnp.arange(capacity, dtype=jnp.int32)[None, :] < kv_len[:, None]).reshape(-1)

  def gather(x):
    g = x[ids].reshape((batch * capacity,) + x.shape[2:])
    return jnp.where(keep[:, None, None], g, jnp.zeros((), x.dtype))

  starts = jnp.arange(batch, dtype=jnp.int32) * capacity
  return [gather(x) for x in pages_ops], (starts, starts + kv_len)


def quantized_q(q_ops, q_offsets, num_kv_heads, dtype):
  """A bf16/f16 Q quantized for the FP8 kernel (over FP8 K/V: an FP8 KV cache): the Q
  operands (each [total_q, num_heads, depth_i], the columns of one q: MLA's nope and
  rope, and any zero-padded copies of them) in ``dtype``, each value divided by its
  (sequence, K/V head)'s scale; and those scales, [batch, num_kv_heads] float32 (which
  multiply the logits' factor). A scale is the absmax over the sequence's rows, the K/V
  head's group of query heads and every operand's columns, over the dtype's largest value
  (``fp8.scale_for_absmax``: 1 for a sequence without rows or with only zeros).

  Sequences are ``work_list.q_ranges``' (offsets clamped and chained, as the kernel reads
  them), so garbage offsets under jit index nothing out of range. Rows past the last
  sequence form a group of their own: they touch no sequence's scale. Non-finite values
  count for no scale (a NaN row stays a NaN row, as in bf16, and its neighbours keep
  their precision)."""
  total_q = q_ops[0].shape[0]
  batch = q_offsets.shape[0] - 1
  _, q_end = q_ranges(q_offsets, total_q)
  # Row r's sequence: how many sequences end at or before it (batch: past them all).
  ends = jnp.zeros((total_q + 1,), jnp.int32).at[q_end].add(1)
  seq = jnp.cumsum(ends)[:total_q]

  def grouped(x):  # [total_q, num_kv_heads, (num_heads // num_kv_heads) * depth] float32
    return x.astype(jnp.float32).reshape(total_q, num_kv_heads, -1)

  def row_absmax(x):
    a = jnp.abs(grouped(x))
    return jnp.max(jnp.where(jnp.isfinite(a), a, 0.0), axis=2)

  top = functools.reduce(jnp.maximum, [row_absmax(x) for x in q_ops])
  top = jnp.zeros((batch + 1, num_kv_heads), jnp.float32).at[seq].max(top)
  scale = fp8.scale_for_absmax(top, dtype)
  per_row = scale[seq][:, :, None]
  q8 = [(grouped(x) / per_row).reshape(x.shape).astype(dtype) for x in q_ops]
  return q8, scale[:batch]


def padded_rows(rows: int, tile: int) -> int:
  """The rows an operand of `rows` rows is given to the kernel with: at least one tile.
  Operands that have them (any longer than a tile) are passed without a copy."""
  return max(rows, tile)


# FP8: KV tiles start at multiples of 16 keys, V^T's TMA needing 16-byte aligned rows.
FP8_KV_ALIGN = 16


def kv_align(config: MosaicConfig, fp8: bool) -> int:
  """The multiple of keys KV tiles start at (``work_list.item_columns``): FP8's 16; else 1
  (a sequence's first key: batch invariant) with ``MosaicOptions.batch_invariant``, or 8."""
  if fp8:
    return FP8_KV_ALIGN
  return 1 if config.options.batch_invariant else 8


VT_KEYS = 128  # keys per program of ``transposed_v``'s kernel (128 bytes of a V^T row)
VT_BATCH_LOOP = 128  # sequences up to which its programs read the offsets themselves


def live_rows(q_offsets, kv_rows, total_kv):
  """[total_kv] bool: whether each K/V row is some sequence's key (rows [start, end) of
  ``kv_rows``, or of the chained query offsets where K/V are packed like Q), clamped."""
  starts, ends = ((q_offsets[:-1], q_offsets[1:]) if kv_rows is None else kv_rows)
  starts = jnp.clip(starts.astype(jnp.int32), 0, total_kv)
  ends = jnp.clip(ends.astype(jnp.int32), starts, total_kv)
  # A +1/-1 count over the rows.
  marks = jnp.zeros((total_kv + 1,), jnp.int32).at[starts].add(1).at[ends].add(-1)
  return jnp.cumsum(marks)[:total_kv] > 0


def _vt_kernel(*refs, batch, total_kv, bounds, p_order):
  """One program: keys [r0, r0 + VT_KEYS) of one K/V head, read as [keys, depth] bytes
  where some sequence's [start, end) holds them (``live_rows``' rule) and zero elsewhere,
  stored as [depth, keys] (``p_order``: in ``key_ordered``'s order). ``bounds``:
  "offsets" (the chained offsets, read here), "ranges" (K/V starts and ends, read here)
  or "live" (``live_rows`` as int32, padded with zeros to the columns)."""
  *ins, v_ref, vt_ref = refs
  r0 = pl.program_id(0) * VT_KEYS
  h = pl.program_id(1)
  keys = r0 + jnp.arange(VT_KEYS, dtype=jnp.int32)

  def seq(b, live):
    start, end = (ins[0][b], ins[1][b]) if bounds == "ranges" else (ins[0][b], ins[0][b + 1])
    start = jnp.clip(start.astype(jnp.int32), 0, total_kv)
    end = jnp.clip(end.astype(jnp.int32), start, total_kv)
    return live | ((keys >= start) & (keys < end))

  if bounds == "live":
    live = plt.load(ins[0].at[pl.ds(r0, VT_KEYS)]) != 0  # False past total_kv
  else:
    live = lax.fori_loop(0, batch, seq, jnp.zeros((VT_KEYS,), jnp.bool_))
  x = plt.load(v_ref.at[pl.ds(r0, VT_KEYS), h, :], mask=live[:, None], other=0)
  vt = jnp.where(live[:, None], x, 0).T
  if p_order:
    vt = key_ordered(vt)
  plt.store(vt_ref.at[h, :, pl.ds(r0, VT_KEYS)], vt)


def key_ordered(vt):
  """V^T [..., cols] (cols a multiple of 16) with each 16 columns in
  ``primitives.fp8_p_key``'s order: column 4q + 2a + b of a 16 takes key 8a + 2q + b (a
  reshape and a transpose, for XLA and inside the Triton-lowered kernel alike)."""
  *lead, cols = vt.shape
  n = len(lead)
  vt = vt.reshape(*lead, cols // 16, 2, 4, 2)
  return vt.transpose(*range(n + 1), n + 2, n + 1, n + 3).reshape(*lead, cols)


def transposed_v(v, q_offsets, kv_rows, cols, *, p_order=False, interpret=False):
  """V^T [num_kv_heads, v_depth, cols] (cols a multiple of ``VT_KEYS``, at least
  v.shape[0]) from V [rows, num_kv_heads, v_depth] (1-byte elements, the depth a power of
  two), its rows that are no sequence's keys (``live_rows``: from ``kv_rows``, or the
  offsets where K/V are packed like Q) and the columns past ``rows`` zeroed: one
  Triton-lowered Pallas kernel, a program per (``VT_KEYS`` keys, K/V head), in place of
  XLA's count of the live rows and transpose of 1-byte elements (several small kernels).
  Up to ``VT_BATCH_LOOP`` sequences each program reads the offsets (or ranges) itself;
  beyond, XLA's ``live_rows`` (a loop over every sequence per program would cost more).
  Bytes move as uint8 (FP8 bit patterns, NaN ones included, pass unchanged; a zeroed row
  is +0.0). ``p_order``: the keys of each 16 columns in ``primitives.fp8_p_key``'s order
  (P's register operand's, ``MosaicOptions.fp8_p_registers``)."""
  total_kv, num_kv_heads, depth = v.shape
  assert cols % VT_KEYS == 0 and cols >= total_kv, (cols, total_kv)
  bits = lax.bitcast_convert_type(v, jnp.uint8)
  if interpret:  # a slice past the end is clamped there, not masked: pad instead
    bits = jnp.pad(bits, [(0, cols - total_kv), (0, 0), (0, 0)])
  batch = q_offsets.shape[0] - 1 if kv_rows is None else kv_rows[0].shape[0]
  if batch > VT_BATCH_LOOP:
    kind = "live"
    ins = [jnp.pad(live_rows(q_offsets, kv_rows, total_kv).astype(jnp.int32),
                   (0, cols - total_kv))]
  else:
    kind = "offsets" if kv_rows is None else "ranges"
    ins = [q_offsets] if kv_rows is None else list(kv_rows)
  out = partitioning.output_struct((*ins, bits), (num_kv_heads, depth, cols), jnp.uint8)
  kernel = functools.partial(_vt_kernel, batch=batch, total_kv=total_kv, bounds=kind,
                             p_order=p_order)
  vt = pl.pallas_call(
      kernel, grid=(cols // VT_KEYS, num_kv_heads),
      in_specs=[pl.no_block_spec] * (len(ins) + 1), out_specs=pl.no_block_spec,
      out_shape=out, compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="fp8_v_transposed",
  )(*ins, bits)
  return lax.bitcast_convert_type(vt, v.dtype)


def vt_page_columns(capacity: int, page_size: int, block_kv: int) -> int:
  """The V^T columns per sequence of ``transposed_v_pages``: the block table's capacity
  (``max_pages * page_size`` keys) rounded up to whole programs of the kernel and whole
  KV tiles, so that every tile the attention kernel reads lies in its sequence's
  columns."""
  step = max(block_kv, min(page_size, VT_KEYS))
  return -(-capacity // step) * step


def _vt_pages_kernel(table_ref, kv_len_ref, v_ref, vt_ref, *, piece, cols, tile, p_order):
  """One program: positions [r0, r0 + piece) of sequence b's keys for one K/V head, all
  in one page (``piece`` divides the page or is all of it), read from the page its block
  table names, the positions past its keys zeroed, stored as [depth, piece] at V^T
  columns b * cols + r0 (``p_order``: in ``key_ordered``'s order). Programs past the
  sequence's last KV tile (``tile`` keys) store nothing: no tile reads those columns."""
  j, b, h = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  num_pages, page_size = v_ref.shape[:2]
  r0 = j * piece
  n = kv_len_ref[b]

  @pl.when(r0 < (n + tile - 1) // tile * tile)
  def _():
    col = jnp.minimum(r0 // page_size, table_ref.shape[1] - 1)
    page = jnp.clip(table_ref[b, col], 0, num_pages - 1)
    live = r0 + jnp.arange(piece, dtype=jnp.int32) < n
    x = plt.load(v_ref.at[page, pl.ds(r0 % page_size, piece), h, :], mask=live[:, None],
                 other=0)
    vt = jnp.where(live[:, None], x, 0).T
    if p_order:
      vt = key_ordered(vt)
    plt.store(vt_ref.at[h, :, pl.ds(b * cols + r0, piece)], vt)


def transposed_v_pages(v_pages, block_table, kv_len, *, block_kv, p_order=False,
                       interpret=False):
  """FP8's V^T from a paged cache, read in place: [num_kv_heads, v_depth, batch * cols]
  (``vt_page_columns``), sequence b's key at position p in column b * cols + p, its
  positions past kv_len[b] zeroed up to its last KV tile's end (stale cache rows may hold
  NaN, and 0 * NaN would reach P.V), the columns past that not written (no tile reads
  them). v_pages [num_pages, page_size, num_kv_heads, v_depth] (1-byte elements, the
  depth a power of two), block_table [batch, max_pages] (ids clamped to the pages there
  are), kv_len [batch] int32 in [0, capacity] (``work_list.paged_kv_lengths``). One
  Triton-lowered Pallas kernel, a program per (piece of a page, sequence, K/V head), so
  that only the keys the sequences have are moved: in place of gathering the whole block
  table's capacity (``gathered_pages``) and transposing that. Its output still spans
  that capacity (batch * cols columns a K/V head: 1.14 GB for MLA's 128 heads over 8
  sequences of up to 8,704 keys), as the gathered copy of V did. ``p_order``: as
  ``transposed_v``'s."""
  num_pages, page_size, num_kv_heads, depth = v_pages.shape
  batch, max_pages = block_table.shape
  piece = min(page_size, VT_KEYS)
  cols = vt_page_columns(max_pages * page_size, page_size, block_kv)
  bits = lax.bitcast_convert_type(v_pages, jnp.uint8)
  ins = (block_table.astype(jnp.int32), kv_len.astype(jnp.int32), bits)
  out = partitioning.output_struct(ins, (num_kv_heads, depth, batch * cols), jnp.uint8)
  kernel = functools.partial(_vt_pages_kernel, piece=piece, cols=cols,
                             tile=max(block_kv, piece), p_order=p_order)
  vt = pl.pallas_call(
      kernel, grid=(cols // piece, batch, num_kv_heads),
      in_specs=[pl.no_block_spec] * 3, out_specs=pl.no_block_spec, out_shape=out,
      compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="fp8_v_transposed",
  )(*ins)
  return lax.bitcast_convert_type(vt, v_pages.dtype)


def fp8_operands(v, q_offsets, kv_rows, scales, *, block_kv, vt_kernel=True,
                 p_order=False):
  """FP8's extra operands: V transposed, [num_kv_heads, v_depth, rows] with rows a
  multiple of 16 (TMA's row stride) and at least a tile, its columns that are no
  sequence's keys zeroed (padding and rows past the batch's last key may hold anything,
  NaN included, and 0 * NaN is NaN); and the scales ([batch, num_kv_heads] float32 each:
  the logits' factor and V's), which the kernel reads by the item's sequence (the
  table's column ``layout.meta_cols(wgs)``). An FP8 matrix product reads its B operand
  K-major (the keys along a row): with ``vt_kernel`` (``MosaicOptions.fp8_vt_kernel``) and
  a depth that is a power of two, ``transposed_v``'s kernel (rows a multiple of
  ``VT_KEYS``), else one XLA transpose. ``p_order``: V^T's keys in ``primitives.fp8_p_key``'s order within each 16
  (P from registers, ``MosaicOptions.fp8_p_registers``)."""
  total_kv, _, depth = v.shape
  if vt_kernel and depth & (depth - 1) == 0:
    cols = -(-max(total_kv, block_kv) // VT_KEYS) * VT_KEYS
    return (transposed_v(v, q_offsets, kv_rows, cols, p_order=p_order), *scales)
  live = live_rows(q_offsets, kv_rows, total_kv)
  vt = jnp.transpose(jnp.where(live[:, None, None], v, jnp.zeros((), v.dtype)), (1, 2, 0))
  rows = max(-(-total_kv // 16) * 16, block_kv)
  vt = jnp.pad(vt, [(0, 0), (0, 0), (0, rows - total_kv)])
  return (key_ordered(vt) if p_order else vt, *scales)


def operands(q_ops, k_ops, v, q_offsets, kv_rows, sink_weights, *, mask, return_lse,
             config: MosaicConfig, paged_cache=None, block_table=None, interpret=False,
             top_left=False, fp8=None):
  """The work before the kernel: its operands (the work list, the scalars, the sink
  weights if any, Q, K, V and ``v_tail``, or FP8's V^T and scales and no ``v_tail``);
  with ``return_lse``, each output row's LSE slot; and the persistent grid's size, which
  the unit order is chosen for. Arguments as ``mosaic_gpu.ragged_attention_mgpu``'s;
  ``fp8``: ``fp8_operands``' (V^T, then the scales); ``interpret`` runs
  ``work_items``' kernel in Mosaic GPU's interpret mode (to call this on the CPU)."""
  total_q, num_heads, _ = q_ops[0].shape
  total_kv = v.shape[0]
  batch = q_offsets.shape[0] - 1
  wgs = config.compute_wgs
  rows = wgs * config.block_q
  num_items = num_work_items(total_q, batch, config.block_q, wgs)
  if num_heads * num_items * rows >= 2**31:
    raise ValueError(f"{num_heads} heads x {num_items} work items of {rows} rows overflow "
                     "the kernel's int32 unit and LSE indices")
  programs = schedule.num_programs(num_heads * num_items, config)
  group = num_heads // v.shape[-2]
  page_tiles = block_table is not None
  align = kv_align(config, fp8 is not None)
  # (FP8 reads its scales by the item's sequence.)
  kw = dict(mask=mask, block_q=config.block_q, block_kv=config.block_kv,
            paged_cache=paged_cache, page_tiles=page_tiles, top_left=top_left,
            kv_align=align, seq_column=fp8 is not None, wgs=wgs)
  tile_bound = work_items.total_kv_tiles_bound(
      total_kv, None if paged_cache is None else paged_cache[1], config.block_kv)
  options = config.options
  keyless_apart = options.keyless_units != "per_head"
  if options.build_work_list and not return_lse and work_items.fits(num_items, batch,
                                                                    tile_bound):
    # One small kernel instead of XLA's ~16 (``work_items``); the LSE's row slots come
    # from XLA's version.
    table, scalars = work_items.build(q_offsets, kv_rows, total_q, total_kv,
                                      num_heads=num_heads, group=group,
                                      num_programs=programs, dynamic=options.dynamic,
                                      interpret=interpret, keyless_apart=keyless_apart,
                                      shuffles=options.work_list_shuffles,
                                      staged_table=options.work_list_staged_table, **kw)
    lse_slot, kv_end = None, scalars[L.S_KV_TAIL]
  else:
    table, lse_slot, kv_end, n_live = work_list(q_offsets, kv_rows, total_q, total_kv, **kw)
    tiles = table[:, L.T_HI] - table[:, L.T_LO]
    n_keyed = keyed_items(tiles, jnp.arange(tiles.shape[0]) < n_live)
    # The order is picked for the (head, item) units: the keyed items' where the
    # key-less ones run apart, a unit each (``schedule.unit_of``).
    n_ordered = n_keyed if keyless_apart else n_live
    order = dict(num_heads=num_heads, group=group, num_programs=programs)
    head_major, deal = (
        schedule.dynamic_schedule(tiles, n_ordered, **order) if options.dynamic
        else (schedule.head_major_order(tiles, n_ordered, **order), 0))
    scalars = jnp.zeros((L.SCALAR_LANES,), jnp.int32)  # L.S_NEXT: 0
    for lane, x in ((L.S_LIVE, n_live), (L.S_TAIL8, -1 if page_tiles else L.floor8(kv_end) // 8),
                    (L.S_HEAD_MAJOR, head_major), (L.S_KV_TAIL, kv_end), (L.S_DEAL, deal),
                    (L.S_KEYED, n_keyed)):
      scalars = scalars.at[lane].set(jnp.asarray(x, jnp.int32))
  if options.dynamic and options.head_major is not None:  # the order forced (A/B runs)
    scalars = scalars.at[L.S_HEAD_MAJOR].set(options.head_major)
  if options.dynamic and options.deal is not None:  # dealt or claimed forced (A/B runs)
    scalars = scalars.at[L.S_DEAL].set(options.deal)
  grow = lambda x, n: x if x.shape[0] == n else jnp.pad(  # noqa: E731
      x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  q_rows = padded_rows(total_q, config.block_q)
  if block_table is not None:
    # The kernel reads the pages, and no key group is special (tail8 = -1): each
    # sequence's last V tile comes from v_last, a copy with the rows past its keys zeroed;
    # FP8's V^T from the pages (``transposed_v_pages``) has those zeros already.
    num_pages, page_size = v.shape[:2]
    ids = jnp.clip(block_table.astype(jnp.int32), 0, num_pages - 1)
    inputs = [table, scalars]
    inputs += [sink_weights.astype(jnp.float32)] if sink_weights is not None else []
    inputs += [grow(x, q_rows) for x in q_ops] + list(k_ops)
    if fp8 is not None:
      inputs += [fp8[0], ids, *fp8[1:]]
    else:
      kv_len = paged_kv_lengths(q_offsets, total_q, *paged_cache)
      pos = (jnp.maximum(kv_len - 1, 0) // config.block_kv * config.block_kv)[:, None] + (
          jnp.arange(config.block_kv, dtype=jnp.int32))
      page = jnp.take_along_axis(ids, jnp.minimum(pos // page_size, ids.shape[1] - 1), 1)
      v_last = jnp.where((pos < kv_len[:, None])[..., None, None], v[page, pos % page_size],
                         jnp.zeros((), v.dtype))
      inputs += [v, v_last, ids]
    return inputs, (lse_slot if return_lse else None), programs
  bkv = config.block_kv
  if fp8 is not None:  # V^T's columns past the last key are zeros already: no v_tail
    v_tail = []
  else:
    if align == 1:
      # Rows [kv_end - bkv, kv_end + bkv): every tile that runs past the last key lies in
      # them (a tile starts before the end of its keys).
      tail_rows = kv_end - bkv + jnp.arange(2 * bkv, dtype=jnp.int32)
    else:
      # The tile ending with the 8-row group that holds the last key, or the tile at row
      # 0 when that group ends before it does.
      tail_rows = jnp.maximum(L.floor8(kv_end) + 8 - bkv, 0) + jnp.arange(bkv, dtype=jnp.int32)
    # Rows past the last key (and before row 0) zeroed.
    v_tail = [jnp.where(((tail_rows >= 0) & (tail_rows < kv_end))[:, None, None],
                        v[jnp.clip(tail_rows, 0, total_kv - 1)], 0).astype(v.dtype)]
  # Q, K and V go to untiled shared-memory buffers (64-column chunks) and the output
  # comes from one, so no operand needs padding beyond a tile's rows.
  kv_rows = padded_rows(total_kv, config.block_kv)
  inputs = [table, scalars]
  inputs += [sink_weights.astype(jnp.float32)] if sink_weights is not None else []
  inputs += [grow(x, q_rows) for x in q_ops] + [grow(x, kv_rows) for x in k_ops]
  inputs += [grow(v, kv_rows) if fp8 is None else fp8[0], *v_tail]  # (FP8: V^T)
  inputs += [] if fp8 is None else list(fp8[1:])
  return inputs, (lse_slot if return_lse else None), programs



"""The Mosaic GPU kernel's work list, computed in XLA: one item per ``compute_wgs`` query
tiles of one sequence (``MosaicConfig.compute_wgs * block_q`` rows: a tile per compute
warpgroup), heaviest first, plus one pseudo-sequence for the rows past ``offsets[-1]``
(written as zeros). Each item's row ranges and KV tile ranges (for the whole item, and per
compute warpgroup: first, first unmasked, end of unmasked, end) are a row of a small int32
table (``layout``'s columns), so that the kernel's warpgroups agree on every trip count,
zero included. ``work_items`` builds the same table on the GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_prefill.mosaic_gpu import layout as L


def q_ranges(q_offsets, total_q):
  """Each sequence's query rows [q_start, q_end): offsets clamped to [0, total_q] and
  chained (sequence b's start where b-1's ends), whatever the offsets hold."""
  q_off = jnp.clip(q_offsets.astype(jnp.int32), 0, total_q)
  q_end = lax.cummax(q_off[1:])
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), q_end[:-1]]), q_end


def paged_kv_lengths(q_offsets, total_q, cache_lengths, capacity):
  """Each sequence's keys in a paged cache: its cached tokens (clamped to [0, capacity])
  plus its new rows, at most the block table's ``capacity`` rows (as the Triton kernel
  reads them)."""
  q_start, q_end = q_ranges(q_offsets, total_q)
  cache = jnp.clip(cache_lengths.astype(jnp.int32), 0, capacity)
  return jnp.minimum(cache + q_end - q_start, capacity)


def item_columns(i_q_start, i_q_len, i_kv_start, i_kv_len, row, *, mask, block_q, block_kv,
                 page_tiles, top_left=False, kv_align=1, wgs=L.COMPUTE_WGS):
  """The per-item table columns up to ``layout.meta_cols(wgs)`` (a list of int32 arrays,
  one value per item; ``wgs`` compute warpgroups of ``block_q`` rows each) from each item's
  sequence (its query start and length, its K/V start and length: zeros for items that
  run nothing) and first row (absolute, a multiple of 8);
  ``top_left``: queries from position 0 (else kv_len - q_len); ``kv_align``: 1, KV tile i
  starts at the sequence's first key plus i * block_kv and is never shifted back (batch
  invariant: the same keys in the same tiles wherever the sequence sits); 8 or 16, at
  its first key rounded down to a multiple of it (FP8's V^T tiles need 16, TMA's 16-byte
  alignment of a row's first key), the last tile shifted back to end in the aligned group
  of the last key. KV rows are stored in units of ``layout.kv_unit(kv_align)``.
  Plain ``jnp`` arithmetic on non-negative numbers, so that ``work_list`` (XLA) and
  ``work_items.build`` (a Mosaic GPU kernel) share it."""
  floor = lambda x: lax.div(x, kv_align) * kv_align  # noqa: E731  (x >= 0)
  unit = L.kv_unit(kv_align)
  kv_first = floor(i_kv_start)
  if page_tiles or kv_align == 1:
    kv_last = jnp.full_like(i_kv_start, L.NO_SHIFT_ROW)
  else:
    # Not below row 0: TMA coordinates into tiled memory are divided unsigned, so a
    # negative start is no out-of-bounds zero fill but a wild row.
    kv_last = jnp.maximum(floor(i_kv_start + i_kv_len + (kv_align - 1)) - block_kv, 0)
  skew = i_kv_start - kv_first  # key j is row j + skew of the aligned tiling
  start_pos = jnp.zeros_like(i_kv_len) if top_left else i_kv_len - i_q_len

  per_wg = []
  for g in range(wgs):
    r0 = jnp.maximum(row + g * block_q - i_q_start, 0)  # within the sequence
    r1 = jnp.minimum(row + (g + 1) * block_q - i_q_start, i_q_len)
    q_lo, q_hi = start_pos + r0, start_pos + r1 - 1
    lo, hi = mask.kv_range(q_lo, q_hi, i_kv_len)
    f_lo, f_hi = mask.full_range(q_lo, q_hi, i_kv_len)
    t_lo = (lo + skew) // block_kv
    t_hi = jnp.maximum((hi + skew + block_kv - 1) // block_kv, t_lo)
    t_hi = jnp.where((r1 > r0) & (hi > lo), t_hi, t_lo)
    u_lo = jnp.clip((f_lo + skew + block_kv - 1) // block_kv, t_lo, t_hi)
    u_hi = jnp.clip((f_hi + skew) // block_kv, u_lo, t_hi)
    per_wg.append((t_lo, u_lo, u_hi, t_hi))
  # The item's tiles: from the first to the last of its warpgroups' with tiles (folded
  # one warpgroup at a time; all empty: [0, the last warpgroup's end), at least 0).
  lo, _, _, hi = per_wg[0]
  none = lo == hi
  for a, _, _, b in per_wg[1:]:
    empty = a == b
    lo = jnp.where(none, a, jnp.where(empty, lo, jnp.minimum(lo, a)))
    hi = jnp.where(none, b, jnp.where(empty, hi, jnp.maximum(hi, b)))
    none = none & empty
  lo = jnp.where(none, 0, lo)
  hi = jnp.maximum(hi, lo)
  cols = [i_q_start, i_q_len, i_kv_start, i_kv_len, row // 8, kv_first // unit,
          kv_last // unit, lo, hi]
  for t_lo, u_lo, u_hi, t_hi in per_wg:
    # A warpgroup with no tiles of its own waits on the item's tiles all the same: give
    # it the empty range at the item's start so that its loops stay in order.
    empty = t_lo == t_hi
    cols += [jnp.where(empty, lo, x) for x in (t_lo, u_lo, u_hi, t_hi)]
  return cols


def work_list(q_offsets, kv_rows, total_q, total_kv, *, mask, block_q, block_kv,
              paged_cache=None, page_tiles=False, top_left=False, kv_align=1,
              seq_column=False, wgs=L.COMPUTE_WGS):
  """The per-item table [num_items, L.meta_cols(wgs)] int32 (plus column
  ``L.meta_cols(wgs)``, the item's sequence, with ``page_tiles`` or ``seq_column``: FP8
  reads its scales by it; items of ``wgs * block_q`` rows, ``wgs`` the compute
  warpgroups); each output row's column in the per-item LSE buffer; the end of the
  batch's last key (the largest K/V end); and the number of items that store rows (the
  kernel runs those: they come first, heaviest first, and the rest of the table, whose
  items store nothing, after them).

  kv_rows: None (K/V packed like Q, or paged) or (kv_starts, kv_ends) [batch] each:
  sequence b's keys are rows [kv_starts[b], kv_ends[b]) (clamped to the arrays).

  Offsets are clamped and chained (sequence b's queries start where b-1's end), so any
  offsets, even garbage under jit, give items whose stored rows cover [0, total_q) once.
  Items start at multiples of 8 rows: a sequence's first item starts at its first row
  rounded down, and the rows before it (its neighbour's) are computed and not stored.
  KV tiles (``item_columns``): with ``kv_align`` 1, tile i of a sequence starts at its
  first key plus i * block_kv (the last may run past the sequence's keys, and past the
  batch's). With ``kv_align`` 8 (or 16), at its first key rounded down to 8 (16) plus
  i * block_kv, except that no tile starts after ``max(ceil8(kv_end) - block_kv, 0)``: the
  last tile ends in the 8-row group of the last key (or, when all keys lie in the first
  block_kv rows, at row block_kv).

  paged_cache: (cache_lengths, capacity) for K/V that ``operands.gathered_pages`` gathered from a
  paged cache: sequence b's keys are then rows [b * capacity, b * capacity + kv_len).
  With ``page_tiles`` the kernel reads the pages themselves instead: every sequence's
  keys are positions [0, kv_len) of its own pages, and KV tile i covers positions
  [i * block_kv, (i + 1) * block_kv), never shifted back (it lies inside one page).
  """
  rows = wgs * block_q
  batch = q_offsets.shape[0] - 1
  q_start, q_end = q_ranges(q_offsets, total_q)
  if paged_cache is not None:
    cache_lengths, capacity = paged_cache
    kv_start = jnp.arange(batch, dtype=jnp.int32) * (0 if page_tiles else capacity)
    kv_end = kv_start + paged_kv_lengths(q_offsets, total_q, cache_lengths, capacity)
  elif kv_rows is None:
    kv_start, kv_end = q_start, q_end
  else:
    kv_start = jnp.clip(kv_rows[0].astype(jnp.int32), 0, total_kv)
    kv_end = jnp.clip(kv_rows[1].astype(jnp.int32), kv_start, total_kv)
  # Rows past the batch's last key may hold anything (``operands``' v_tail has them zeroed).
  kv_tail = jnp.max(kv_end)
  # The rows past offsets[-1]: a pseudo-sequence with no keys, stored as zeros.
  q_start = jnp.concatenate([q_start, q_end[-1:]])
  q_end = jnp.concatenate([q_end, jnp.full((1,), total_q, jnp.int32)])
  kv_start = jnp.concatenate([kv_start, jnp.zeros((1,), jnp.int32)])
  kv_end = jnp.concatenate([kv_end, jnp.zeros((1,), jnp.int32)])
  q_len, kv_len = q_end - q_start, kv_end - kv_start
  q_first = L.floor8(q_start)

  num_items = num_work_items(total_q, batch, block_q, wgs)
  tiles = jnp.where(q_len > 0, (q_end - q_first + rows - 1) // rows, 0)
  first = jnp.cumsum(tiles) - tiles
  item = jnp.arange(num_items, dtype=jnp.int32)
  # No method="scan" (the default): its loop is an XLA while loop, and on a GPU each of
  # its trips waits for the host (up to 0.65 ms a call on the H200, BUILD_NOTES.md).
  seq = jnp.clip(jnp.searchsorted(first + tiles, item, side="right",
                                  method="scan_unrolled"), 0, batch).astype(
      jnp.int32)
  live = item < (first + tiles)[-1]
  take = lambda x: jnp.where(live, x[seq], 0)  # noqa: E731
  i_q_start, i_q_len, i_kv_start, i_kv_len = map(take, (q_start, q_len, kv_start, kv_len))
  row = jnp.where(live, q_first[seq] + (item - first[seq]) * rows, 0)  # absolute, % 8 == 0
  cols = item_columns(i_q_start, i_q_len, i_kv_start, i_kv_len, row, mask=mask,
                      block_q=block_q, block_kv=block_kv, page_tiles=page_tiles,
                      top_left=top_left, kv_align=kv_align, wgs=wgs)
  lo, hi = cols[L.T_LO], cols[L.T_HI]
  if page_tiles or seq_column:
    cols.append(jnp.where(live, seq, 0))
  table = jnp.stack(cols, axis=1).astype(jnp.int32)
  # Item k stores its rows [max(row, q_start), min(row + rows, q_end)), if any.
  first_stored = jnp.maximum(row, i_q_start)
  stores = jnp.minimum(row + rows, i_q_start + i_q_len) > first_stored
  # Heaviest items first (``schedule.program_unit`` deals them out so that every program gets a
  # like share of heavy and light ones), the items that store nothing after all others.
  order = jnp.argsort(jnp.where(stores, -(hi - lo), 1), stable=True)
  table, first_stored, stores = table[order], first_stored[order], stores[order]
  # Each output row's LSE slot: column k * rows + (row - the item's first row).
  t_row = table[:, L.ROW8] * 8
  key = jnp.where(stores, first_stored, total_q)
  by_row = jnp.argsort(key, stable=True)
  r = jnp.arange(total_q, dtype=jnp.int32)
  k = by_row[jnp.clip(jnp.searchsorted(key[by_row], r, side="right", method="scan_unrolled")
                      - 1, 0, num_items - 1)]
  return table, k * rows + (r - t_row[k]), kv_tail, jnp.sum(stores, dtype=jnp.int32)


def num_work_items(total_q, batch, block_q, wgs=L.COMPUTE_WGS):
  """A static bound on the work items (of ``wgs * block_q`` rows): every sequence (and the
  tail) adds at most one item beyond its share of total_q, plus one for the rows its
  8-aligned start adds."""
  return pl.cdiv(total_q + 8 * (batch + 1), wgs * block_q) + batch + 1



def keyed_items(item_tiles, live):
  """How many of the items that run (``live``, as ``schedule.item_costs`` takes it) have
  KV tiles (``item_tiles``: each item's, in table order): they come first, heaviest
  first, and the rest of the items that run store only zeros (``schedule.unit_of``).
  Plain ``jnp``, shared by XLA (``operands``) and ``work_items``' kernel."""
  return jnp.sum(jnp.where(live & (item_tiles > 0), 1, 0))

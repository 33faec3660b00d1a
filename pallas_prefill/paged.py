"""Paged KV caches: K/V held in fixed-size pages addressed by a per-sequence block table.

A serving engine keeps each sequence's keys and values in pages of ``page_size`` rows and
prefills new tokens on top of what is cached (prefix caching, chunked prefill). The
kernels read the pages directly: each KV tile lies inside one page, whose id the kernel
reads from the block table. ``write_kv`` places a prefill's new rows into the pages first.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_prefill.checks import check_array, check_offsets

MIN_PAGE_SIZE, MAX_PAGE_SIZE = 16, 256


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKV:
  """One K or V operand stored in pages (MAX's KV-cache operand).

  Attributes:
    pages: [num_pages, page_size, heads, depth]; page_size a power of two from 16 to 256.
    block_table: [batch, max_pages_per_seq] int32: sequence b's position p is row
      ``p % page_size`` of page ``block_table[b, p // page_size]``.
    cache_lengths: [batch] int32: tokens cached before this prefill. The prefill's new rows
      must already sit at positions cache_length ... cache_length + q_len - 1 (see
      ``write_kv``), so kv_len = cache_length + q_len and start_pos = cache_length.

  K and V (and MLA's k_nope, k_rope, v) are separate PagedKVs over the same block table
  and cache lengths; the kernel reads both from the first K operand.
  """

  pages: jax.Array
  block_table: jax.Array
  cache_lengths: jax.Array

  @property
  def shape(self):
    return self.pages.shape

  @property
  def dtype(self):
    return self.pages.dtype

  @property
  def page_size(self) -> int:
    return self.pages.shape[1]


def write_kv(pages, new_rows, input_row_offsets, block_table, cache_lengths):
  """Places each sequence's new K or V rows into its pages at cache_length onward.

  What a caller runs before the prefill. Jit-friendly; pass ``pages`` as a donated argument
  of the caller's jit to update the cache in place.

  Args:
    pages: [num_pages, page_size, heads, depth], any dtype the kernels read (FP8
      included: an FP8 cache's rows are written as given, already quantized for the
      scales the prefill then takes).
    new_rows: [total_q, heads, depth] packed like the queries, same dtype as pages.
    input_row_offsets: [batch + 1] int32 or uint32 offsets of the new rows (an empty
      batch, [0], writes nothing).
    block_table: [batch, max_pages_per_seq] int32.
    cache_lengths: [batch] int32.

  Returns:
    The updated pages. Rows past input_row_offsets[-1], and rows whose position has no
    page in the table or whose page id is out of range, are dropped.

  Raises:
    TypeError: an argument is not an array, new_rows' dtype is not the pages' (no silent
      cast: rows cast to FP8 without their scale would change value, or overflow to NaN),
      or the offsets, table or lengths are not int32 (offsets: or uint32).
    ValueError: a rank or shape does not fit the others (new_rows' [heads, depth] must be
      the pages'; the table and lengths need one row per sequence), or, when concrete,
      the offsets are not nondecreasing from 0 within new_rows.
  """
  _check_write_args(pages, new_rows, input_row_offsets, block_table, cache_lengths)
  num_pages, page_size = pages.shape[:2]
  total = new_rows.shape[0]
  offsets = input_row_offsets.astype(jnp.int32)
  batch = offsets.shape[0] - 1
  if batch == 0 or block_table.shape[1] == 0:  # no sequence, or no page: nothing to place
    return pages
  rows = jnp.arange(total, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(offsets, rows, side="right", method="scan_unrolled")
                 .astype(jnp.int32) - 1,
                 0, batch - 1)
  in_seq = (rows >= offsets[0]) & (rows < offsets[-1])
  pos = cache_lengths.astype(jnp.int32)[seq] + rows - offsets[seq]
  slot = pos // page_size
  in_table = (pos >= 0) & (slot < block_table.shape[1])
  page = block_table[seq, jnp.clip(slot, 0, block_table.shape[1] - 1)].astype(jnp.int32)
  keep = in_seq & in_table & (page >= 0) & (page < num_pages)
  page = jnp.where(keep, page, num_pages)  # out of range: dropped
  return pages.at[page, pos % page_size].set(new_rows, mode="drop")


def _check_write_args(pages, new_rows, offsets, block_table, cache_lengths):
  """``write_kv``'s checks: the static ones always, the offsets' values when concrete."""
  check_array("pages", pages, 4)
  check_array("new_rows", new_rows, 3)
  if jnp.dtype(new_rows.dtype) != jnp.dtype(pages.dtype):
    raise TypeError(f"new_rows ({new_rows.dtype}) must have the pages' dtype "
                    f"({pages.dtype}); quantize FP8 rows first (pallas_prefill.fp8)")
  if tuple(new_rows.shape[1:]) != tuple(pages.shape[2:]):
    raise ValueError(f"new_rows' [heads, depth] {tuple(new_rows.shape[1:])} must be the "
                     f"pages' {tuple(pages.shape[2:])}")
  check_offsets("input_row_offsets", offsets)
  batch = offsets.shape[0] - 1
  for name, x, rank in (("block_table", block_table, 2), ("cache_lengths", cache_lengths, 1)):
    check_array(name, x, rank)
    if jnp.dtype(x.dtype) != jnp.int32:
      raise TypeError(f"{name} must be int32, got {x.dtype}")
    if x.shape[0] != batch:
      raise ValueError(f"{name} must have batch = {batch} rows (input_row_offsets' length "
                       f"- 1), got {x.shape[0]}")
  if not isinstance(offsets, jax.core.Tracer):
    off = np.asarray(offsets).astype(np.int64)
    if off[0] != 0 or (np.diff(off) < 0).any() or off[-1] > new_rows.shape[0]:
      raise ValueError(f"input_row_offsets must be nondecreasing from 0 to at most the "
                       f"{new_rows.shape[0]} rows of new_rows, got {off.tolist()}")


def check_paged(operands, batch):
  """Static checks of PagedKV operands (a dict name -> PagedKV) for a batch."""
  first_name, first = next(iter(operands.items()))
  for name, kv in operands.items():
    if not (hasattr(kv.pages, "shape") and hasattr(kv.pages, "dtype")):
      raise TypeError(f"{name}.pages must be an array, got {type(kv.pages).__name__}")
    if kv.pages.ndim != 4:
      raise ValueError(f"{name}.pages must be [num_pages, page_size, heads, depth], got "
                       f"shape {tuple(kv.pages.shape)}")
    size = kv.page_size
    if size & (size - 1) or not MIN_PAGE_SIZE <= size <= MAX_PAGE_SIZE:
      raise ValueError(f"{name}'s page size must be a power of two from {MIN_PAGE_SIZE} to "
                       f"{MAX_PAGE_SIZE}, got {size}")
    if kv.pages.shape[:2] != first.pages.shape[:2]:
      raise ValueError(f"{name}.pages and {first_name}.pages must have the same number and "
                       f"size of pages: {tuple(kv.pages.shape)} vs {tuple(first.pages.shape)}")
    for field, rank in (("block_table", 2), ("cache_lengths", 1)):
      x = getattr(kv, field)
      if not hasattr(x, "shape") or x.ndim != rank or jnp.dtype(x.dtype) != jnp.int32:
        raise ValueError(f"{name}.{field} must be a rank-{rank} int32 array, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}"
                         f"{tuple(getattr(x, 'shape', ()))}")
      if x.shape[0] != batch:
        raise ValueError(f"{name}.{field} must have batch = {batch} rows, got "
                         f"{x.shape[0]}")
    if kv.block_table.shape != first.block_table.shape:
      raise ValueError(f"{name} and {first_name} must share one block table, got shapes "
                       f"{tuple(kv.block_table.shape)} and {tuple(first.block_table.shape)}")


def validate_paged(kv: PagedKV, input_row_offsets, name="k"):
  """Data checks of a concrete PagedKV against concrete query offsets (ValueError)."""
  table = np.asarray(kv.block_table)
  cache = np.asarray(kv.cache_lengths).astype(np.int64)
  q_lens = np.diff(np.asarray(input_row_offsets).astype(np.int64))
  if (cache < 0).any():
    b = int(np.argmax(cache < 0))
    raise ValueError(f"{name}.cache_lengths[{b}] = {cache[b]} is negative")
  capacity = table.shape[1] * kv.page_size
  kv_lens = cache + q_lens
  if (kv_lens > capacity).any():
    b = int(np.argmax(kv_lens > capacity))
    raise ValueError(f"sequence {b} needs {kv_lens[b]} K/V positions (cache_lengths "
                     f"{cache[b]} + {q_lens[b]} new), more than its {table.shape[1]} "
                     f"pages of {kv.page_size} hold")
  num_pages = kv.pages.shape[0]
  for b, kv_len in enumerate(kv_lens):
    used = table[b, :-(-int(kv_len) // kv.page_size)]  # the pages holding its K/V
    if ((used < 0) | (used >= num_pages)).any():
      bad = int(used[(used < 0) | (used >= num_pages)][0])
      raise ValueError(f"{name}.block_table[{b}] holds page id {bad}, outside the "
                       f"{num_pages} pages")

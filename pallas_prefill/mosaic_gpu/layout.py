"""The Mosaic GPU kernel's data layout: the per-item table's columns, the scalar operand's
lanes and the constants that the work list, its GPU builder, the schedule and the kernel
share. Query rows are stored divided by 8 (``ROW8``): multiplying them back proves to
Mosaic GPU that they are multiples of 8. KV tile rows (``KV_ROW``, ``KV_LAST``) are stored
in units of ``kv_unit`` rows: 1 where KV tiles start at a sequence's first key (batch
invariant), 8 where they start at multiples of 8 or 16.
"""

from jax import lax

SMEM_BYTES = 227 * 1024  # an H100/H200 block's shared memory limit
# Compute warpgroups per program by default (``MosaicConfig.compute_wgs``: 2 or 3), each
# with block_q query rows of the program's work item.
COMPUTE_WGS = 2
CHUNK = 64  # columns of the Q, K and V buffers (``column_chunks``)
# Keys per FP8 V^T buffer: a row of 128 bytes, the widest TMA swizzle. A wider KV tile
# (``MosaicConfig.block_kv`` 256) holds its V^T in ``vt_groups`` buffers per chunk and
# runs its P.V as one matrix product per buffer.
VT_GROUP = 128


def vt_groups(block_kv: int) -> int:
  """FP8's V^T buffers per 64 columns of V and K/V slot: one per ``VT_GROUP`` keys."""
  return max(block_kv // VT_GROUP, 1)


# Columns of the per-item table (``work_list.work_list``) the kernel reads.
(Q_START, Q_LEN, KV_START, KV_LEN, ROW8, KV_ROW, KV_LAST, T_LO, T_HI) = range(9)
WG_COLS = 9  # then, per warpgroup g: 9 + 4g + (first, first unmasked, unmasked end, end)


def meta_cols(wgs: int = COMPUTE_WGS) -> int:
  """The table's columns for ``wgs`` compute warpgroups; paged (``page_tiles``) and FP8
  tables add one, the item's sequence (its block table row, its scales), at this index."""
  return WG_COLS + 4 * wgs

# The last tile's row (``KV_LAST`` times ``kv_unit``) of items whose KV tiles are never
# shifted back (a paged cache's tiles lie inside pages; batch-invariant tiles): larger than
# any tile's row.
NO_SHIFT_ROW = 2**30

# The kernel's scalar operand: the items to run (those that store rows), the 8-row group
# of the batch's last key (aligned tiles: the one that comes from ``v_tail``), the order
# of the units (1: K/V-head-major, ``schedule.head_major_order``) and the end of the
# batch's keys (the largest end; batch-invariant tiles that run past it read
# ``v_tail``). With dynamic scheduling, the lane the programs claim units from
# (``primitives.claim``): 0 before the call, one more per claim; and the lane that says
# whether the programs take the units the static zigzag deals them instead
# (``schedule.dynamic_schedule``). Then the items that run and have KV tiles (they come
# first: the rest of the items that run store only zeros, ``schedule.unit_of``). The
# operand has ``SCALAR_LANES`` lanes or more.
S_LIVE, S_TAIL8, S_HEAD_MAJOR, S_KV_TAIL, S_NEXT, S_DEAL, S_KEYED = range(7)
SCALAR_LANES = 8

# Native paged K/V (a TMA per tile from its page) needs pages of at least this many rows;
# smaller pages are gathered into contiguous K/V first (``operands.gathered_pages``).
MIN_NATIVE_PAGE = 64


def kv_unit(kv_align: int) -> int:
  """The unit of the table's KV tile rows for tiles that start at multiples of
  ``kv_align`` keys: 1 (rows) for ``kv_align`` 1, else 8."""
  return 1 if kv_align == 1 else 8


def floor8(x):
  return lax.div(x, 8) * 8  # x >= 0


def column_chunks(parts):
  """The (part, first column) of each 64-column chunk of the logit parts: Q and K live in
  shared memory as one buffer per chunk, which TMA fills from any row (``kernel``)."""
  return [(part, col) for part in parts for col in range(0, part.width, CHUNK)]


def tile_pages(block_kv: int, page_size: int) -> int:
  """How many pages a native paged KV tile of block_kv rows reads: block_kv // page_size
  where the tile is larger (``MosaicOptions.tile_spans_pages``), else one (the tile lies
  inside a page: both are powers of two)."""
  return max(1, block_kv // page_size)

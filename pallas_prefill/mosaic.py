"""The ragged attention kernel in Pallas Mosaic GPU (Hopper, sm_90): ``backend="mosaic_gpu"``.

The structure is FlashAttention-3's, as in JAX's dense ``ops/gpu/attention_mgpu.py``: per
program two compute warpgroups, each with ``block_q`` query rows, and one producer
warpgroup that streams K/V tiles through ``num_stages`` shared-memory slots with TMA; the
two compute warpgroups take turns on the tensor cores (two hardware named barriers), so
that one's softmax overlaps the other's matrix products. The kernel is persistent, as
FA3's is: one program per SM runs its share of the (head, work item) units back to back,
the K/V slots and barrier phases carried from one unit to the next, so that the producer
streams the next unit's first tiles and each compute warpgroup loads its next Q while the
last unit is finished and written out. The units are scheduled dynamically
(``DYNAMIC``): each program's producer claims its next unit from a global counter (an
atomic add, ``_claim``) one unit ahead and passes it to the compute warpgroups through
shared memory, so that programs balance whatever the units' real costs. The units come
in K/V-head-major order (``unit_head_item``: the units running together share a K/V
head's rows in L2, heaviest items first within it), or item-major where claiming in
that order would leave the last K/V head's heavy units to the end
(``dynamic_head_major_order``, per call: chunked prefill, few items over long cached
prefixes); there, where the static zigzag balances K/V-head-major, the producer takes the
units it deals instead of claiming (``dynamic_schedule``: MLA's chunked prefill, whose
item-major units miss L2). Behind the flag, the static deal
(``program_unit``): item-major or, where that balances as well (``head_major_order``, per
call), K/V-head-major.

With ``MosaicConfig.split_units`` each compute warpgroup instead runs half-units of its
own (a head and its ``block_q`` rows of an item, the half's own KV tile range), fed by a
producer warpgroup of its own through K/V slots of its own, with no turns: one's stores
and pipeline fill overlap the other's products, at twice the K/V buffers (64-row tiles in
two stages at depth 128; MLA's 192 + 128 then fit with one output buffer and no LSE). On
the H200: +3.7 % on MHA short64, -17 % on skew16_16k and -24 % on equal4x4096
(BUILD_NOTES.md), so it is no default.

The ragged parts, which the dense kernel has none of:

- A work list, computed before the call (``work_list`` in XLA, or the same table from one
  small Mosaic GPU kernel, ``work_items.build``, where it fits and no LSE is asked): one
  item per pair of query tiles of one sequence (``2 * block_q`` rows), heaviest first,
  plus one pseudo-sequence for the rows past ``offsets[-1]`` (written as zeros). Each
  item's row ranges and KV tile ranges (for the whole item, and per warpgroup: first,
  first unmasked, end of unmasked, end) are read by the kernel from a small int32 table,
  so the three warpgroups agree on every trip count, zero included. Only the items that
  store rows run (a scalar operand holds their number); the table's other items, there
  because its size is static, do not.
- TMA into 8-row-tiled shared memory needs row starts that are multiples of 8 and GMEM
  arrays whose row count is one. Q, K and V avoid the second: they live in 64-column
  buffers that TMA fills untiled, from any row of arrays of any row count, and that the
  matrix products read through an (8, 64)-tiled view of the same bytes (a
  ``plgpu.RefUnion``); P.V is one product per 64 columns of V, each into its own
  accumulator. An item starts at its sequence's first row rounded down to 8, and the
  rows before it (a neighbour's) and past the sequence are computed and never stored.
- KV tile i starts at the sequence's first key rounded down to 8, plus i * block_kv, but
  no later than ``max(ceil8(kv_end) - block_kv, 0)``: the last tile is shifted back to end
  in the 8-row group of the last key, so it reads no K/V row past that group. The keys it
  repeats and those before the sequence are masked. (Not before row 0: tiled TMA
  coordinates are unsigned.) Rows past the batch's last key may hold anything, NaN
  included, and 0 * NaN would poison P.V: the group holding that key comes from
  ``v_tail``, a copy of the tile that ends with that group, rows past the key zeroed.
  When all of the batch's keys lie in the first ``block_kv - 8`` rows, every tile is
  the one at row 0, which reaches past that group; it then comes from ``v_tail`` whole
  (``v_tail`` is then rows [0, block_kv), rows past the key zeroed).
- Outputs are stored row-exact with a ladder of TMA stores (block_q, block_q/2, ..., 1
  rows, for each 64-column output buffer), as JAX's ragged_dot does, so no store touches
  a neighbour's rows. The LSE goes to a per-item buffer that XLA gathers back into rows.
  (One output buffer per accumulator, not one buffer written a column slice at a time:
  the sliced stores into the warpgroup's buffer gave a wrong second half on the H200
  that interpret mode does not show, BUILD_NOTES.md. Where shared memory holds only one
  buffer, as for MLA with 128-row K/V tiles in two stages, ``output_buffers``, that one
  is filled and stored a column chunk at a time.)

Supported: bfloat16 and float16 (the matrix instructions' input types), QK parts and V of
depths that are multiples of 64 up to 256 whose buffers fit shared memory, contiguous K/V
(packed or with K/V offsets), every mask, sinks, LSE, GQA/MQA, MLA's two-part logits.
Paged caches with pages of ``MIN_NATIVE_PAGE`` rows or more are read page by page: KV tile
i of a sequence is its positions [i * block_kv, (i + 1) * block_kv), which lie in one page
or span ``tile_pages`` whole pages; the producer reads the page ids from the block table
and TMAs the tile from them, a copy per page; each sequence's last V tile comes from
``v_tail`` (then one tile per sequence, rows past its keys zeroed: stale cache rows may be
NaN). Smaller pages are gathered into contiguous K/V first (``gathered_pages``).
``unsupported_reason`` says why anything else is not; ``backend="auto"`` then runs Triton.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir  # pylint: disable=g-direct-tensorflow-import
from jax._src.lib.mlir.dialects import arith, memref, scf, vector
from jax._src.lib.mlir.dialects import math as mlir_math

from pallas_prefill import ragged  # its numeric constants (ragged imports this module)
from pallas_prefill import work_items  # (it imports this module)
from pallas_prefill.config import MosaicConfig

SMEM_BYTES = 227 * 1024  # an H100/H200 block's shared memory limit
COMPUTE_WGS = 2
# Columns of the per-item table the kernel reads. Row numbers the kernel passes to TMA are
# stored divided by 8: multiplying them back proves to Mosaic GPU that they are multiples
# of 8, which TMA into 8-row-tiled shared memory requires.
(_Q_START, _Q_LEN, _KV_START, _KV_LEN, _ROW8, _KV_ROW8, _KV_LAST8, _T_LO, _T_HI) = range(9)
_WG_COLS = 9  # then, per warpgroup g: 9 + 4g + (first, first unmasked, unmasked end, end)
_META_COLS = _WG_COLS + 4 * COMPUTE_WGS
_SEQ = _META_COLS  # paged (``page_tiles``) only: the item's sequence, its block table row
# ``_KV_LAST8`` of items whose KV tiles are never shifted back (a paged cache's tiles lie
# inside pages): larger than any tile's row / 8.
_NO_SHIFT = 2**27
# Native paged K/V (a TMA per tile from its page) needs pages of at least this many rows;
# smaller pages are gathered into contiguous K/V first (``gathered_pages``).
MIN_NATIVE_PAGE = 64
# Native pages smaller than block_kv: True reads a KV tile from block_kv // page_size
# consecutive pages of the sequence (a TMA copy per page and chunk, ``tile_pages``);
# False cuts block_kv to the page.
TILE_SPANS_PAGES = True
# The kernel's scalar operand: the items to run (those that store rows), the 8-row group
# of the batch's last key (the one that comes from ``v_tail``) and the order of the units
# (1: K/V-head-major, ``head_major_order``).
_S_LIVE, _S_TAIL8, _S_HEAD_MAJOR = range(3)
# With ``DYNAMIC``, the lane the programs claim units from (``_claim``): 0 before the
# call, one more per claim; and the lane that says whether the programs take the units
# the static zigzag deals them instead (``dynamic_schedule``). The operand has
# ``SCALAR_LANES`` lanes or more (``work_items`` uses lane 3).
_S_NEXT, _S_DEAL = 4, 5
SCALAR_LANES = 8
# ``head_major_order``: a unit costs its KV tiles plus about one tile of its own (the Q
# load, the pipeline's fill and the stores), and the K/V-head-major order is taken when
# its busiest program has at most this much more work than the item-major order's.
UNIT_COST_TILES = 1
HEAD_MAJOR_SLACK = 1.05  # as 21/20 (``head_major_wins``)
CHUNK = 64  # columns of the Q, K and V buffers (``column_chunks``)
# The compute warpgroups' turns on the tensor cores: hardware named barriers TURN_BARRIER
# (warpgroup 1 signals 0) and TURN_BARRIER + 1 (0 signals 1). Mosaic GPU itself uses
# barrier 0 and 1 + the warpgroup index.
TURN_BARRIER = 4
# The work list and the unit order from one small Mosaic GPU kernel where it serves the
# sizes and no LSE is asked for (``work_items``); False: always XLA's (``work_list``).
BUILD_WORK_LIST = True
# Dynamic scheduling: each program's producer claims its next unit from a global counter
# (``_claim``), in the order ``dynamic_schedule`` picks, and passes it to the
# compute warpgroups through shared memory; False: the static deal of ``program_unit``.
DYNAMIC = True
# With ``DYNAMIC``, the unit order: None picks it per call (``dynamic_schedule``); 1
# (K/V-head-major) or 0 (item-major) forces it, for A/B runs. DYNAMIC_DEAL likewise forces
# whether the units are dealt (1) or claimed (0).
DYNAMIC_HEAD_MAJOR = None
DYNAMIC_DEAL = None
# The softmax's scale folded into its exponent (``_exp2_fma``: one FFMA per score instead
# of a multiplication and a subtraction), where the scale is positive.
FOLD_SCALE = True
# Each compute warpgroup on units of its own (``MosaicConfig.split_units``): None leaves it
# to the config; True or False forces it (A/B runs; True also takes 64-row K/V tiles in two
# stages, ``split_config``).
SPLIT_UNITS = None
H200_SMS = 132  # the persistent grid's size when no GPU is attached (abstract lowering)


def _smem_bytes(parts, v_depth, dtype, output_dtype, return_lse, config: MosaicConfig,
                out_buffers: int) -> int:
  item = jnp.dtype(dtype).itemsize
  qk = sum(p.width for p in parts)
  q = COMPUTE_WGS * config.block_q * qk * item
  o = COMPUTE_WGS * config.block_q * CHUNK * out_buffers * jnp.dtype(output_dtype).itemsize
  kv = config.num_stages * config.block_kv * (qk + v_depth) * item
  if config.split_units:  # a K/V stream per compute warpgroup
    kv *= COMPUTE_WGS
  lse = COMPUTE_WGS * config.block_q * 4 if return_lse else 0
  # barriers and alignment: 2136 to 2648 bytes seen with Mosaic GPU's 2 KiB of reduction
  # scratch (MLA with 128-row K/V tiles in two stages, without and with the LSE); 1136
  # without it (``reduction_scratch_bytes=0``) and with the claimed units' slots and
  # barriers (MLA, no LSE). The bound is kept, not measured against every config.
  return q + o + kv + lse + 3072


def output_buffers(parts, v_depth, dtype, output_dtype, return_lse,
                   config: MosaicConfig) -> int:
  """The 64-column output buffers per compute warpgroup: one per accumulator, or where
  shared memory holds no more (MLA's 192 + 128 with 128-row K/V tiles in two stages), one,
  filled and stored a column chunk at a time."""
  full = v_depth // CHUNK
  if _smem_bytes(parts, v_depth, dtype, output_dtype, return_lse, config,
                 full) <= SMEM_BYTES:
    return full
  return 1


def smem_bytes(parts, v_depth, dtype, output_dtype, return_lse, config: MosaicConfig) -> int:
  """Shared memory the kernel allocates for these operands and tiles."""
  return _smem_bytes(parts, v_depth, dtype, output_dtype, return_lse, config,
                     output_buffers(parts, v_depth, dtype, output_dtype, return_lse, config))


def fitted(config: MosaicConfig, parts, v_depth, dtype, output_dtype,
           return_lse) -> MosaicConfig:
  """A default config cut down (stages to 2, then 64-row K/V tiles) until shared memory
  holds it for these operands (a float32 output takes more of it)."""
  while smem_bytes(parts, v_depth, dtype, output_dtype, return_lse, config) > SMEM_BYTES:
    if config.num_stages > 2:
      config = dataclasses.replace(config, num_stages=config.num_stages - 1)
    elif config.block_kv > 64:
      config = dataclasses.replace(config, block_kv=64)
    else:
      break
  return config


def unsupported_reason(parts, v_depth, dtype, output_dtype, return_lse,
                       config: MosaicConfig) -> str | None:
  """Why the Mosaic GPU kernel cannot run this case, or None when it can. Paged caches
  need no check: pages of ``MIN_NATIVE_PAGE`` rows or more are read in place, smaller
  ones gathered first (``gathered_pages``)."""
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"dtype {jnp.dtype(dtype).name}: the Hopper matrix instructions take bf16/f16"
  for w in [p.width for p in parts] + [v_depth]:
    if w % 64 or w > 256:
      return f"depth {w}: the mosaic_gpu backend needs depths that are multiples of 64 <= 256"
  need = smem_bytes(parts, v_depth, dtype, output_dtype, return_lse, config)
  if need > SMEM_BYTES:
    split = (" (split units: a K/V stream per compute warpgroup, twice the buffers; "
             "or shared units)" if config.split_units else "")
    return (f"{need} bytes of shared memory for {config} exceed {SMEM_BYTES}; "
            f"use fewer stages or smaller tiles{split}")
  return None


def column_chunks(parts):
  """The (part, first column) of each 64-column chunk of the logit parts: Q and K live in
  shared memory as one buffer per chunk, which TMA fills from any row (``_kernel``)."""
  return [(part, col) for part in parts for col in range(0, part.width, CHUNK)]


def split_config(config: MosaicConfig) -> MosaicConfig:
  """``config`` with ``SPLIT_UNITS`` applied: True takes units per compute warpgroup with
  64-row K/V tiles in two stages (twice the K/V buffers of the shared units fit shared
  memory so for depth 128), False the shared units; None keeps ``config``. Split units
  need dynamic scheduling: without ``DYNAMIC`` they are off."""
  if SPLIT_UNITS is not None:
    config = dataclasses.replace(config, split_units=bool(SPLIT_UNITS))
    if SPLIT_UNITS:
      config = dataclasses.replace(config, block_kv=64, num_stages=2)
  if config.split_units and not DYNAMIC:
    config = dataclasses.replace(config, split_units=False)
  return config


def tile_pages(block_kv: int, page_size: int) -> int:
  """How many pages a native paged KV tile of block_kv rows reads: block_kv // page_size
  where the tile is larger (``paged_config`` keeps it so only with ``TILE_SPANS_PAGES``),
  else one (the tile lies inside a page: both are powers of two)."""
  return max(1, block_kv // page_size)


def paged_config(config: MosaicConfig, page_size: int) -> MosaicConfig:
  """The config for native pages of page_size rows (``MIN_NATIVE_PAGE`` or more): its KV
  tiles span pages (``TILE_SPANS_PAGES``), or are cut to one page."""
  if TILE_SPANS_PAGES:
    return config
  return dataclasses.replace(config, block_kv=min(config.block_kv, page_size))


def _floor8(x):
  return lax.div(x, 8) * 8  # x >= 0


def _q_ranges(q_offsets, total_q):
  """Each sequence's query rows [q_start, q_end): offsets clamped to [0, total_q] and
  chained (sequence b's start where b-1's ends), whatever the offsets hold."""
  q_off = jnp.clip(q_offsets.astype(jnp.int32), 0, total_q)
  q_end = lax.cummax(q_off[1:])
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), q_end[:-1]]), q_end


def paged_kv_lengths(q_offsets, total_q, cache_lengths, capacity):
  """Each sequence's keys in a paged cache: its cached tokens (clamped to [0, capacity])
  plus its new rows, at most the block table's ``capacity`` rows (as the Triton kernel
  reads them)."""
  q_start, q_end = _q_ranges(q_offsets, total_q)
  cache = jnp.clip(cache_lengths.astype(jnp.int32), 0, capacity)
  return jnp.minimum(cache + q_end - q_start, capacity)


def gathered_pages(pages_ops, block_table, cache_lengths, q_offsets, total_q):
  """Paged K/V operands (each [num_pages, page_size, heads, depth]) gathered into
  contiguous arrays [batch * capacity, heads, depth], capacity = max_pages * page_size:
  sequence b's keys at rows [b * capacity, b * capacity + kv_len[b]), and every row past
  them zeroed (stale cache rows may hold NaN, and 0 * NaN would reach P.V). Page ids are
  clamped to the pages there are, as the Triton kernel does. One XLA gather per operand:
  the whole block table's capacity is copied, whatever the cache lengths."""
  num_pages, page_size = pages_ops[0].shape[:2]
  batch, max_pages = block_table.shape
  capacity = max_pages * page_size
  ids = jnp.clip(block_table.astype(jnp.int32), 0, num_pages - 1).reshape(-1)
  kv_len = paged_kv_lengths(q_offsets, total_q, cache_lengths, capacity)
  keep = (jnp.arange(capacity, dtype=jnp.int32)[None, :] < kv_len[:, None]).reshape(-1)

  def gather(x):
    g = x[ids].reshape((batch * capacity,) + x.shape[2:])
    return jnp.where(keep[:, None, None], g, jnp.zeros((), x.dtype))

  return [gather(x) for x in pages_ops], capacity


def item_columns(i_q_start, i_q_len, i_kv_start, i_kv_len, row, *, mask, block_q, block_kv,
                 page_tiles):
  """The per-item table columns up to ``_META_COLS`` (a list of int32 arrays, one value
  per item) from each item's sequence (its query start and length, its K/V start and
  length: zeros for items that run nothing) and first row (absolute, a multiple of 8).
  Plain ``jnp`` arithmetic on non-negative numbers, so that ``work_list`` (XLA) and
  ``work_items.build`` (a Mosaic GPU kernel) share it."""
  kv_first = _floor8(i_kv_start)
  # Not below row 0: TMA coordinates into tiled memory are divided unsigned, so a
  # negative start is no out-of-bounds zero fill but a wild row.
  kv_last = jnp.maximum(_floor8(i_kv_start + i_kv_len + 7) - block_kv, 0)
  if page_tiles:
    kv_last = jnp.full_like(kv_last, _NO_SHIFT * 8)
  skew = i_kv_start - kv_first  # key j is row j + skew of the aligned tiling
  start_pos = i_kv_len - i_q_len

  per_wg = []
  for g in range(COMPUTE_WGS):
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
  (a0, _, _, b0), (a1, _, _, b1) = per_wg
  empty0, empty1 = a0 == b0, a1 == b1
  lo = jnp.where(empty0, a1, jnp.where(empty1, a0, jnp.minimum(a0, a1)))
  hi = jnp.where(empty0, b1, jnp.where(empty1, b0, jnp.maximum(b0, b1)))
  lo = jnp.where(empty0 & empty1, 0, lo)
  hi = jnp.maximum(hi, lo)
  cols = [i_q_start, i_q_len, i_kv_start, i_kv_len, row // 8, kv_first // 8, kv_last // 8,
          lo, hi]
  for t_lo, u_lo, u_hi, t_hi in per_wg:
    # A warpgroup with no tiles of its own waits on the item's tiles all the same: give
    # it the empty range at the item's start so that its loops stay in order.
    empty = t_lo == t_hi
    cols += [jnp.where(empty, lo, x) for x in (t_lo, u_lo, u_hi, t_hi)]
  return cols


def work_list(q_offsets, kv_offsets, total_q, total_kv, *, mask, block_q, block_kv,
              paged_cache=None, page_tiles=False):
  """The per-item table [num_items, _META_COLS] int32; each output row's column in the
  per-item LSE buffer; the end of the last sequence's keys; and the number of items that
  store rows (the kernel runs those: they come first, heaviest first, and the rest of
  the table, whose items store nothing, after them).

  Offsets are clamped and chained (sequence b's queries start where b-1's end), so any
  offsets, even garbage under jit, give items whose stored rows cover [0, total_q) once.
  Items start at multiples of 8 rows: a sequence's first item starts at its first row
  rounded down, and the rows before it (its neighbour's) are computed and not stored.
  KV tile i of a sequence starts at its first key rounded down to 8 plus i * block_kv,
  except that no tile starts after ``max(ceil8(kv_end) - block_kv, 0)``: the last tile
  ends in the 8-row group of the last key (or, when all keys lie in the first block_kv
  rows, at row block_kv).

  paged_cache: (cache_lengths, capacity) for K/V that ``gathered_pages`` gathered from a
  paged cache: sequence b's keys are then rows [b * capacity, b * capacity + kv_len).
  With ``page_tiles`` the kernel reads the pages themselves instead: every sequence's
  keys are positions [0, kv_len) of its own pages, and KV tile i covers positions
  [i * block_kv, (i + 1) * block_kv), never shifted back (it lies inside one page).
  """
  rows = COMPUTE_WGS * block_q
  batch = q_offsets.shape[0] - 1
  q_start, q_end = _q_ranges(q_offsets, total_q)
  if paged_cache is not None:
    cache_lengths, capacity = paged_cache
    kv_start = jnp.arange(batch, dtype=jnp.int32) * (0 if page_tiles else capacity)
    kv_end = kv_start + paged_kv_lengths(q_offsets, total_q, cache_lengths, capacity)
  elif kv_offsets is None:
    kv_start, kv_end = q_start, q_end
  else:
    kv_off = jnp.clip(kv_offsets.astype(jnp.int32), 0, total_kv)
    kv_start = kv_off[:-1]
    kv_end = jnp.maximum(kv_off[1:], kv_start)
  kv_tail = kv_end[-1]
  # The rows past offsets[-1]: a pseudo-sequence with no keys, stored as zeros.
  q_start = jnp.concatenate([q_start, q_end[-1:]])
  q_end = jnp.concatenate([q_end, jnp.full((1,), total_q, jnp.int32)])
  kv_start = jnp.concatenate([kv_start, jnp.zeros((1,), jnp.int32)])
  kv_end = jnp.concatenate([kv_end, jnp.zeros((1,), jnp.int32)])
  q_len, kv_len = q_end - q_start, kv_end - kv_start
  q_first = _floor8(q_start)

  num_items = num_work_items(total_q, batch, block_q)
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
                      block_q=block_q, block_kv=block_kv, page_tiles=page_tiles)
  lo, hi = cols[_T_LO], cols[_T_HI]
  if page_tiles:
    cols.append(jnp.where(live, seq, 0))
  table = jnp.stack(cols, axis=1).astype(jnp.int32)
  # Item k stores its rows [max(row, q_start), min(row + rows, q_end)), if any.
  first_stored = jnp.maximum(row, i_q_start)
  stores = jnp.minimum(row + rows, i_q_start + i_q_len) > first_stored
  # Heaviest items first (``program_unit`` deals them out so that every program gets a
  # like share of heavy and light ones), the items that store nothing after all others.
  order = jnp.argsort(jnp.where(stores, -(hi - lo), 1), stable=True)
  table, first_stored, stores = table[order], first_stored[order], stores[order]
  # Each output row's LSE slot: column k * rows + (row - the item's first row).
  t_row = table[:, _ROW8] * 8
  key = jnp.where(stores, first_stored, total_q)
  by_row = jnp.argsort(key, stable=True)
  r = jnp.arange(total_q, dtype=jnp.int32)
  k = by_row[jnp.clip(jnp.searchsorted(key[by_row], r, side="right", method="scan_unrolled")
                      - 1, 0, num_items - 1)]
  return table, k * rows + (r - t_row[k]), kv_tail, jnp.sum(stores, dtype=jnp.int32)


def num_work_items(total_q, batch, block_q):
  """A static bound on the work items: every sequence (and the tail) adds at most one
  item beyond its share of total_q, plus one for the rows its 8-aligned start adds."""
  return pl.cdiv(total_q + 8 * (batch + 1), COMPUTE_WGS * block_q) + batch + 1


def _load_rows(src, tail, rows, start, dst, barrier, *, tail_group):
  """TMA of rows [start, start + rows) of `src` (a function of a row slice giving a GMEM
  ref view) into `dst`, in two copies that both signal `barrier`: rows - 8 rows, then the
  last 8, which come from `tail` (a view of an 8-row array) when they are the group
  `tail_group` (in units of 8 rows)."""
  head = rows - 8
  plgpu.copy_gmem_to_smem(src(pl.ds(start, head)), dst.at[pl.ds(0, head)], barrier)
  last8 = start // 8 + head // 8

  @pl.when(last8 == tail_group)
  def _():
    plgpu.copy_gmem_to_smem(tail, dst.at[pl.ds(head, 8)], barrier)

  @pl.when(last8 != tail_group)
  def _():
    plgpu.copy_gmem_to_smem(src(pl.ds(last8 * 8, 8)), dst.at[pl.ds(head, 8)], barrier)


def tile_first_row(kv_row8, kv_last8, i, *, block_kv):
  """KV tile i's first row in the K/V arrays, a multiple of 8 (see ``work_list``)."""
  return jnp.minimum(kv_row8 + i * (block_kv // 8), kv_last8) * 8


def visible_keys(mask, q_pos, k_pos, i, kv_row8, kv_start, kv_len, *, block_kv):
  """Which (query, key) pairs of KV tile i a masked step keeps: keys of the sequence
  (0 <= k_pos < kv_len) that the mask shows and that no earlier tile had (a shifted last
  tile repeats some; the first tile starts up to 7 rows before the sequence)."""
  fresh = jnp.maximum(kv_row8 * 8 + i * block_kv - kv_start, 0)
  return mask.visible(q_pos, k_pos) & (k_pos >= fresh) & (k_pos < kv_len)


def _dealt_unit(program, num_programs, k):
  """The unit u that program `program` runs k-th: units are dealt out row by row,
  num_programs to a row, in a zigzag (program p takes unit p of even rows and unit
  num_programs - 1 - p of odd ones)."""
  return k * num_programs + jnp.where(lax.rem(k, 2) == 0, program, num_programs - 1 - program)


def program_unit(program, num_programs, k, *, num_heads, group, n_live, head_major):
  """The (head, item) of program `program`'s k-th unit of work.

  The units, (head, item) pairs over the ``n_live`` items that run, are dealt out in a
  zigzag (``_dealt_unit``) in one of two orders, ``head_major`` (a traced flag,
  ``head_major_order``) picking:

  - item-major, u = item * num_heads + head: an item's heads side by side, so that the
    heads of a K/V group share its rows in L2. Items come heaviest first, so each
    program's pairs of rows add up to about the same work (simulated with ``work_list``'s
    tiles on the harness's workloads: the busiest program 1.00 to 1.02x the mean; plain
    round robin 1.03 to 1.06x).
  - K/V-head-major, u = (kv_head * n_live + item) * group + head of group: the programs
    running together work on many items of a few K/V heads and share their sequences' K/V
    rows in L2, which MLA (a K/V head per query head) needs (+10 % on equal4x4096). Its
    balance depends on how n_live * group falls on the rows, hence the choice per call.
  """
  return unit_head_item(_dealt_unit(program, num_programs, k), num_heads=num_heads,
                        group=group, n_live=n_live, head_major=head_major)


def unit_head_item(unit, *, num_heads, group, n_live, head_major):
  """The (head, item) of unit `unit` in the order ``head_major`` picks (``program_unit``)."""
  heads = jnp.int32(num_heads)
  per_kv_head = jnp.maximum(n_live * group, 1)
  rest = lax.rem(unit, per_kv_head)
  by_kv_head = (lax.div(unit, per_kv_head) * group + lax.rem(rest, jnp.int32(group)),
                lax.div(rest, jnp.int32(group)))
  by_item = (lax.rem(unit, heads), lax.div(unit, heads))
  return tuple(jnp.where(head_major != 0, a, b) for a, b in zip(by_kv_head, by_item))


def program_loads(unit_costs, num_programs):
  """Each program's summed cost of the units (in order u = 0, 1, ...) it is dealt."""
  rows = -(-unit_costs.shape[0] // num_programs)
  costs = jnp.pad(unit_costs, (0, rows * num_programs - unit_costs.shape[0]))
  costs = costs.reshape(rows, num_programs)
  odd = (jnp.arange(rows) % 2 == 1)[:, None]
  return jnp.where(odd, costs[:, ::-1], costs).sum(axis=0)


def item_costs(item_tiles, live):
  """Each item's cost in tiles for the unit orders' estimates: its KV tiles plus
  ``UNIT_COST_TILES``, 0 where ``live`` is False (the items past n_live do not run);
  int32. XLA's estimates and ``work_items``' kernel (a lane per item) share it."""
  return jnp.where(live, item_tiles + UNIT_COST_TILES, 0).astype(jnp.int32)


def head_major_order(item_tiles, n_live, *, num_heads, group, num_programs):
  """Whether the units run K/V-head-major (``program_unit``): 1 when that order's busiest
  program, by the items' KV tiles, has at most ``HEAD_MAJOR_SLACK`` times the work of the
  item-major order's busiest program, else 0 (an int32 scalar, computed in XLA).

  item_tiles: [num_items] KV tiles of each item in table order (items past n_live do not
  run)."""
  items = item_tiles.shape[0]
  cost = item_costs(item_tiles, jnp.arange(items) < n_live)
  by_item = jnp.repeat(cost, num_heads)
  u = jnp.arange(num_heads * items, dtype=jnp.int32)
  rest = u % jnp.maximum(n_live * group, 1)
  by_kv_head = jnp.where(u < n_live * num_heads, cost[rest // group], 0)
  worst = lambda c: program_loads(c, num_programs).max()  # noqa: E731
  return head_major_wins(worst(by_kv_head), worst(by_item)).astype(jnp.int32)


def dynamic_head_major_order(item_tiles, n_live, *, num_heads, group, num_programs):
  """With dynamic scheduling, whether the units run K/V-head-major: 1 when that order's
  estimated end, by the items' KV tiles, is at most ``HEAD_MAJOR_SLACK`` times the
  item-major order's, else 0 (an int32 scalar, computed in XLA; ``work_items`` computes
  the same in its kernel).

  The programs take units in order as they free up, so a unit starts about when the
  units before it, spread over the programs, are done, and the call ends when the latest
  ``start + cost`` does (``claimed_order_end``). Items come heaviest first, so
  item-major ends within about one light unit of the average; K/V-head-major starts the
  last K/V head's heavy items only after the other heads' work, which costs a heavy
  unit's time at the end where the units of one K/V head are few against the programs
  (MHA's chunked prefill: 415 useful TFLOP/s against 497 item-major on the H200).

  item_tiles: [num_items] KV tiles of each item in table order (items past n_live do not
  run)."""
  cost = item_costs(item_tiles, jnp.arange(item_tiles.shape[0]) < n_live)
  ends = claimed_order_end(cost, jnp.cumsum(cost) - cost, num_heads=num_heads,
                           group=group, num_programs=num_programs)
  return head_major_wins(*ends).astype(jnp.int32)


def dynamic_schedule(item_tiles, n_live, *, num_heads, group, num_programs):
  """With dynamic scheduling, the units' order and how the programs take them: (head
  major, deal), int32 scalars (XLA; ``work_items`` computes the same in its kernel).

  - Claimed K/V-head-major (1, 0) where claiming in that order ends in time
    (``dynamic_head_major_order``).
  - Else, where the static zigzag balances the K/V-head-major order
    (``head_major_order``), dealt K/V-head-major (1, 1). The programs then take the units
    ``_dealt_unit`` deals them, with no claim. On MLA's chunked prefill (a K/V head per
    query head) this ran 493 useful TFLOP/s on the H200 against 455 claimed item-major
    (which read K/V from DRAM at 71 % of its bandwidth, L2 hits 14 %; the static
    kernel's deal had 68 %), and claimed K/V-head-major ran 450 (BUILD_NOTES.md).
  - Else claimed item-major (0, 0): MHA's chunked prefill."""
  kw = dict(num_heads=num_heads, group=group, num_programs=num_programs)
  return schedule_of(dynamic_head_major_order(item_tiles, n_live, **kw),
                     head_major_order(item_tiles, n_live, **kw))


def schedule_of(claimed, dealt):
  """``dynamic_schedule``'s (head major, deal) from its two verdicts, int32 scalars 0 or
  1: whether claimed K/V-head-major ends in time (``dynamic_head_major_order``) and
  whether the static zigzag balances K/V-head-major (``head_major_order``). XLA and
  ``work_items``' kernel share it."""
  return jnp.maximum(claimed, dealt), (1 - claimed) * dealt


def claimed_order_end(cost, before, *, num_heads, group, num_programs):
  """The estimated ends (in tiles: K/V-head-major, item-major) of units claimed in order
  by ``num_programs`` programs: the largest over the items of (the work claimed before
  the item's last unit) / num_programs + the item's cost. ``cost``: each item's cost
  (0 past the live items), ``before``: the exclusive prefix sum of ``cost`` (its caller's
  scan: XLA's or ``work_items``' kernel's). int32, the same arithmetic in both: each term
  divided on its own, so that num_heads * (the total cost) stays the largest product; one
  past 2^31 would pick the order wrongly, never the results."""
  p = jnp.int32(num_programs)
  live = cost > 0
  total = jnp.sum(cost)
  # Item-major: the item's num_heads units follow the earlier items' units.
  by_item = lax.div(num_heads * before + (num_heads - 1) * cost, p) + cost
  # K/V-head-major: the last K/V head's units of the item follow all other heads' units
  # and the earlier items' units of that head (its first heads' as well).
  by_kv_head = (lax.div((num_heads - group) * total, p)
                + lax.div(group * before + (group - 1) * cost, p) + cost)
  return (jnp.max(jnp.where(live, by_kv_head, 0)), jnp.max(jnp.where(live, by_item, 0)))


def head_major_wins(worst_kv_head, worst_item):
  """Whether the K/V-head-major order's busiest program, of ``worst_kv_head`` tiles, has
  at most ``HEAD_MAJOR_SLACK`` (21/20) times the item-major order's ``worst_item``
  (int32 scalars: exact in integers, the same in XLA and in ``work_items``)."""
  return 20 * worst_kv_head <= 21 * worst_item


def num_local_units(program, num_programs, num_units):
  """How many of the units [0, num_units) program `program` of `num_programs` runs: one
  per full row, and one of the last row if its zigzag position is there."""
  rows, rest = lax.div(num_units, num_programs), lax.rem(num_units, num_programs)
  pos = jnp.where(lax.rem(rows, 2) == 0, program, num_programs - 1 - program)
  return rows + (pos < rest).astype(rows.dtype)


def num_programs(num_units_bound: int, config: MosaicConfig) -> int:
  """The persistent grid: ``config.num_programs``, else one program per SM of the first
  GPU (an H200's 132 when JAX sees none, as when lowering for an abstract H200); no more
  than there are units."""
  programs = config.num_programs
  if programs is None:
    try:
      programs = jax.devices("gpu")[0].core_count
    except RuntimeError:
      programs = H200_SMS
  return max(1, min(programs, num_units_bound))


def _named_barrier(op: str, barrier_id, threads: int = 2 * 128):
  """PTX ``bar.{op}`` ("arrive" or "sync") on a named barrier whose id is traced."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
  def bar(_, idx):
    mgpu.utils.inline_ptx(f"bar.{op} $0, {threads};", idx.registers[()],
                          has_side_effects=True, convergent=True)

  bar(jnp.asarray(barrier_id, jnp.int32))


def _exp2_fma(s, scale: float, neg_m):
  """exp2(s * scale + neg_m) for scores s [rows, cols] in the WGMMA layout and neg_m
  [rows, cols] (a row vector broadcast): one fused multiply-add and one ``ex2.approx``
  per element (Mosaic GPU emits a multiplication and an addition as two instructions)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
                     return_type=plgpu.ShapeDtypeStruct(s.shape, jnp.float32,
                                                        layout=plgpu.Layout.WGMMA))
  def fma_exp2(_, x, b):
    f32 = ir.F32Type.get()

    def fma(a, c):
      k = arith.constant(f32, scale)
      if isinstance(a.type, ir.VectorType):
        k = vector.broadcast(a.type, k)
      return mlir_math.fma(a, k, c)

    return x._pointwise(fma, b).exp2(approx=True)  # pylint: disable=protected-access

  return fma_exp2(s, neg_m)


def _claim(scalar_ref, unit_smem, slot, dealt):
  """One thread of the warpgroup writes the next unit to ``unit_smem[slot]``: ``dealt``
  where it is not negative, else the one it takes from the global counter (an atomic add
  on ``scalar_ref[_S_NEXT]``); the warpgroup then waits for it (so that all of its
  threads can read the slot)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT,
                                plgpu.Layout.WG_SPLAT))
  def claim(_, counter, units, s, unit):
    index, i32 = ir.IndexType.get(), ir.IntegerType.get_signless(32)
    unit = unit.registers[()]
    with mgpu.utils.single_thread(scope=mgpu.utils.ThreadSubset.WARPGROUP):
      take = arith.cmpi(arith.CmpIPredicate.slt, unit, arith.constant(i32, 0))
      branch = scf.IfOp(take, [i32], has_else=True)
      with ir.InsertionPoint(branch.then_block):
        scf.yield_([memref.atomic_rmw(arith.AtomicRMWKind.addi, arith.constant(i32, 1),
                                      counter, [arith.constant(index, _S_NEXT)])])
      with ir.InsertionPoint(branch.else_block):
        scf.yield_([unit])
      memref.store(branch.result, units, [arith.index_cast(index, s.registers[()])])
    mgpu.utils.warpgroup_barrier()

  claim(scalar_ref, unit_smem, jnp.asarray(slot, jnp.int32), jnp.asarray(dealt, jnp.int32))


def _kernel(meta_ref, scalar_ref, *refs, parts, n_q, n_k, has_sink, has_lse, mask, scale,
            block_q, block_kv, num_stages, group, num_heads, out_dtype, out_buffers,
            dynamic, split=False, page_size=None):
  # page_size: K/V operands are pages [num_pages, page_size, heads, depth] read a tile at
  # a time from the page the block table names; ``v_tail_ref`` then holds each sequence's
  # last V tile with the rows past its keys zeroed, and the block table follows it.
  # split: each compute warpgroup g runs half-units of its own, fed by producer
  # warpgroup COMPUTE_WGS + g through slots of its own (a "lane": g), with no turns.
  assert dynamic or not split
  lanes = COMPUTE_WGS if split else 1  # K/V streams, each with num_stages slots
  consumers = 1 if split else COMPUTE_WGS  # compute warpgroups reading a stream's tiles
  refs = list(refs)
  sink_ref = refs.pop(0) if has_sink else None
  q_refs, refs = refs[:n_q], refs[n_q:]
  k_refs, refs = refs[:n_k], refs[n_k:]
  v_ref, v_tail_ref, *refs = refs
  table_ref = refs.pop(0) if page_size is not None else None
  o_ref = refs[0]
  lse_ref = refs[1] if has_lse else None
  v_depth = v_ref.shape[-1]
  v_chunks = v_depth // CHUNK  # V's 64-column buffers, one accumulator each
  dtype = v_ref.dtype
  chunks = column_chunks(parts)
  # A paged KV tile comes from `pages` consecutive pages, `piece` rows from each.
  pages = 1 if page_size is None else tile_pages(block_kv, page_size)
  piece = block_kv // pages

  tiling = plgpu.TilingTransform((8, 64))
  swizzle = plgpu.SwizzleTransform(128)
  smem = lambda shape, dt: plgpu.SMEM(shape, dt, transforms=(tiling, swizzle))  # noqa: E731

  def chunk_buffer(shape):
    # Two views of one 64-column buffer: untiled, which TMA fills from any row of an
    # array of any row count, and (8, 64)-tiled, which the matrix products read. At 64
    # columns (128 swizzled bytes a row) both are the same bytes.
    return plgpu.RefUnion(plgpu.SMEM(shape, dtype, transforms=(swizzle,)), smem(shape, dtype))

  scratch = [
      [chunk_buffer((COMPUTE_WGS, block_q, CHUNK)) for _ in chunks],
      [chunk_buffer((lanes * num_stages, block_kv, CHUNK)) for _ in chunks],
      [chunk_buffer((lanes * num_stages, block_kv, CHUNK)) for _ in range(v_chunks)],
      # The output: ``out_buffers`` buffers of 64 columns (one per accumulator, or fewer).
      [plgpu.SMEM((COMPUTE_WGS, block_q, CHUNK), out_dtype) for _ in range(out_buffers)],
      plgpu.SMEM((COMPUTE_WGS, block_q), jnp.float32) if has_lse else None,
  ]
  barriers = [
      plgpu.Barrier(num_arrivals=len(chunks), num_barriers=COMPUTE_WGS),  # Q loaded
      plgpu.Barrier(num_arrivals=pages * len(chunks),
                    num_barriers=lanes * num_stages),  # K loaded
      # V loaded: two copies per chunk (``_load_rows``), one per chunk and page from pages
      plgpu.Barrier(num_arrivals=(pages if page_size else 2) * v_chunks,
                    num_barriers=lanes * num_stages),
      plgpu.Barrier(num_arrivals=consumers, num_barriers=lanes * num_stages),  # K consumed
      plgpu.Barrier(num_arrivals=consumers, num_barriers=lanes * num_stages),  # V consumed
  ]
  if dynamic:  # claimed units: two slots a lane, each published by its producer
    scratch.append(plgpu.SMEM((2 * lanes,), jnp.int32))
    barriers += [plgpu.Barrier(num_arrivals=1, num_barriers=2 * lanes),
                 plgpu.Barrier(num_arrivals=consumers, num_barriers=2 * lanes)]

  def body(q_smems, k_smems, v_smems, o_smems, lse_smem2, *rest):
    if dynamic:
      unit_smem, q_bars, k_bars, v_bars, k_used, v_used, unit_ready, unit_used = rest
    else:
      q_bars, k_bars, v_bars, k_used, v_used = rest
    wg = lax.axis_index("wg")
    lane = lax.rem(wg, jnp.int32(COMPUTE_WGS)) if split else 0
    n_live = scalar_ref[_S_LIVE]
    # Split: unit v is half v % 2 (the rows of warpgroup v % 2's share) of shared unit
    # v // 2, so that an item's two halves are claimed one after the other.
    n_units = n_live * num_heads * (COMPUTE_WGS if split else 1)
    # Unit u (claimed, or dealt) in the order ``dynamic_schedule`` picked: (head, item,
    # half), the half 0 for shared units (each warpgroup takes its own rows of them).
    by_order = functools.partial(unit_head_item, num_heads=num_heads, group=group,
                                 n_live=n_live, head_major=scalar_ref[_S_HEAD_MAJOR])

    def claimed(u):
      if split:
        return (*by_order(lax.div(u, jnp.int32(COMPUTE_WGS))),
                lax.rem(u, jnp.int32(COMPUTE_WGS)))
      return (*by_order(u), 0)

    def item_of(hwh):
      """Unit (head, item, half)'s head, item, its table row reader, its KV tile range
      (the item's, or with split units the half's), and whose rows it computes (the
      half, or for shared units the warpgroup's own)."""
      h, w, half = hwh
      meta = lambda col: meta_ref[w, col]  # noqa: E731
      if split:
        return (h, w, meta, meta(_WG_COLS + 4 * half), meta(_WG_COLS + 4 * half + 3), half)
      return h, w, meta, meta(_T_LO), meta(_T_HI), wg

    def take(k):
      """(Dynamic, compute warpgroups) this program's k-th claim: a unit, or n_units or
      more when none is left."""
      s = lane * 2 + lax.rem(k, 2)
      plgpu.barrier_wait(unit_ready.at[s])
      u = unit_smem[s]
      plgpu.barrier_arrive(unit_used.at[s])
      return u

    def publish(k):
      """(Dynamic, producer) claims this program's k-th unit, or takes the one the static
      zigzag deals it (``dynamic_schedule``), and passes it on."""
      s = lane * 2 + lax.rem(k, 2)
      pl.when(k >= 2)(lambda: plgpu.barrier_wait(unit_used.at[s]))
      dealt = _dealt_unit(lax.axis_index("cta"), lax.axis_size("cta"), k)
      if split:  # both lanes of a program take the halves of the units it is dealt
        dealt = dealt * COMPUTE_WGS + lane
      _claim(scalar_ref, unit_smem, s, jnp.where(scalar_ref[_S_DEAL] != 0, dealt, -1))
      u = unit_smem[s]
      plgpu.barrier_arrive(unit_ready.at[s])
      return u

    def for_each_unit(run, first, next_unit):
      """run(hw, base, fetch_next) on each of this program's units in turn; base counts
      the K/V tiles earlier units streamed through the slots. first(hw) runs before the
      loop for the first unit (if any). run calls fetch_next() -> (there is a next unit,
      its hw) once per unit: with dynamic scheduling, that takes the next claim."""
      if not dynamic:  # the units program_unit deals this program (its k-th: units(k))
        units = functools.partial(program_unit, lax.axis_index("cta"), lax.axis_size("cta"),
                                  num_heads=num_heads, group=group, n_live=n_live,
                                  head_major=scalar_ref[_S_HEAD_MAJOR])
        n_local = num_local_units(lax.axis_index("cta"), lax.axis_size("cta"), n_units)
        pl.when(n_local > 0)(lambda: first((*units(0), 0)))

        def static_step(k, base):
          return run((*units(k), 0), base, lambda: (k + 1 < n_local, (*units(k + 1), 0)))

        lax.fori_loop(0, n_local, static_step, jnp.int32(0))
        return
      u0 = next_unit(0)
      pl.when(u0 < n_units)(lambda: first(claimed(u0)))

      def dynamic_step(carry):
        k, base, u = carry
        got = []

        def fetch_next():
          got.append(next_unit(k + 1))
          return got[0] < n_units, claimed(got[0])

        base = run(claimed(u), base, fetch_next)
        return k + 1, base, got[0]

      lax.while_loop(lambda carry: carry[2] < n_units, dynamic_step,
                     (jnp.int32(0), jnp.int32(0), u0))

    def slot_of(i, base, item_lo):
      # base: the tiles this program's (lane's) earlier items streamed through the slots.
      return lane * num_stages + lax.rem(base + i - item_lo, jnp.int32(num_stages))

    # Tensor-core turns on two hardware named barriers. A warpgroup's P.V waits until the
    # other has issued its Q.K, so that the matrix products alternate between the two and
    # one's softmax overlaps the other's products: after issuing Q.K, ``qk_issued``; then
    # ``pv_turn`` around waiting for V. Each item starts with warpgroup 1 one turn behind
    # (``start_turns``), and ends with the two meeting at warpgroup 1's last turn
    # (``end_turns``: warpgroup 0 must not signal twice before warpgroup 1 has taken the
    # first signal).
    # Split units take no turns: the two warpgroups' units are unrelated.
    def qk_issued():
      if not split:
        _named_barrier("arrive", TURN_BARRIER + 1 - wg)

    def pv_turn(wait_v):
      wait_v()
      if not split:
        _named_barrier("sync", TURN_BARRIER + wg)

    def start_turns():
      if not split:
        pl.when(wg == 1)(lambda: _named_barrier("sync", TURN_BARRIER + wg))

    def end_turns():
      if not split:
        pl.when(wg == 0)(lambda: _named_barrier("sync", TURN_BARRIER + 1 - wg))

    @pl.when(wg < COMPUTE_WGS)
    def _compute():
      # Split: four warpgroups, 2 x 224 + 2 x 32 registers a thread (65536 an SM).
      plgpu.set_max_registers(224 if split else 232, action="increase")
      q_fill = [fill.at[wg] for fill, _ in q_smems]
      q_smem = [tiled.at[wg] for _, tiled in q_smems]
      o_smem = [o.at[wg] for o in o_smems]
      lse_smem = lse_smem2.at[wg] if has_lse else None

      def first_row(meta, half):
        """The first Q row of an item's half (a multiple of 8)."""
        return (meta(_ROW8) + half * (block_q // 8)) * 8

      def load_q(hw):
        """TMA of unit hw's Q rows of this warpgroup (the Q buffer must be free)."""
        h, _, meta, _, _, half = item_of(hw)
        row = first_row(meta, half)
        for (part, col), s in zip(chunks, q_fill):
          plgpu.copy_gmem_to_smem(
              q_refs[part.q_index].at[pl.ds(row, block_q), h, pl.ds(part.q_col + col, CHUNK)],
              s, q_bars.at[wg])

      def run_item(hw, base, fetch_next):
        h, w, meta, item_lo, item_hi, half = item_of(hw)
        kv_start, kv_len = meta(_KV_START), meta(_KV_LEN)
        kv_row8, kv_last8 = meta(_KV_ROW8), meta(_KV_LAST8)
        tile_row = functools.partial(tile_first_row, kv_row8, kv_last8, block_kv=block_kv)
        slot = lambda i: slot_of(i, base, item_lo)  # noqa: E731
        q_start, q_len = meta(_Q_START), meta(_Q_LEN)
        col = lambda j: meta(_WG_COLS + 4 * half + j)  # noqa: E731
        t_lo, u_lo, u_hi, t_hi = col(0), col(1), col(2), col(3)
        row = first_row(meta, half)
        first = jnp.clip(q_start - row, 0, block_q)  # rows before it: a neighbour's
        n_rows = jnp.clip(q_start + q_len - row, 0, block_q) - first
        row_pos = kv_len - q_len + row - q_start  # position of the row `row`
        plgpu.barrier_wait(q_bars.at[wg])

        layout = plgpu.Layout.WGMMA
        if has_sink:
          m0, l0 = sink_ref[h] * ragged.LOG2_E, 1.0
        else:
          m0, l0 = ragged.MASK_VALUE, 0.0
        m_i = plgpu.layout_cast(jnp.full((block_q,), m0, jnp.float32), layout.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((block_q,), l0, jnp.float32), layout.reduce(1))
        # One accumulator per 64 columns of V: P.V is one matrix product per V buffer.
        acc = tuple(plgpu.layout_cast(jnp.zeros((block_q, CHUNK), jnp.float32), layout)
                    for _ in v_smems)

        start_turns()

        def skip(i, carry):
          plgpu.barrier_wait(k_bars.at[slot(i)])
          plgpu.barrier_arrive(k_used.at[slot(i)])
          qk_issued()
          pv_turn(lambda: plgpu.barrier_wait(v_bars.at[slot(i)]))
          plgpu.barrier_arrive(v_used.at[slot(i)])
          return carry

        def step(i, carry, *, masked):
          acc, m_i, l_i = carry
          plgpu.barrier_wait(k_bars.at[slot(i)])

          def qk(acc_ref):
            for qs, (_, ks) in zip(q_smem, k_smems):
              plgpu.wgmma(acc_ref, qs, ks.at[slot(i)].transpose((1, 0)))
            qk_issued()
            return acc_ref[...]

          s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
          plgpu.barrier_arrive(k_used.at[slot(i)])
          fold = FOLD_SCALE and scale > 0  # the row maximum commutes with the scale
          if not fold:
            s = s * scale
          if masked:
            iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, (block_q, block_kv),
                                     layout=layout)
            q_pos = row_pos + iota(0)
            k_pos = tile_row(i) - kv_start + iota(1)
            visible = visible_keys(mask, q_pos, k_pos, i, kv_row8, kv_start, kv_len,
                                   block_kv=block_kv)
            s = jnp.where(visible, s, -jnp.inf)
          if fold:
            m_new = jnp.maximum(m_i, s.max(axis=1) * scale)
            p = _exp2_fma(s, scale, lax.broadcast_in_dim(-m_new, s.shape, [0]))
          else:
            m_new = jnp.maximum(m_i, s.max(axis=1))
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
          alpha = jnp.exp2(m_i - m_new)
          acc = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in acc)
          l_i = l_i * alpha
          p16 = p.astype(dtype)
          if v_depth <= 128:
            l_i = l_i + p.sum(axis=1)
            acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
            pv_turn(lambda: plgpu.barrier_wait(v_bars.at[slot(i)]))
          else:
            pv_turn(lambda: plgpu.barrier_wait(v_bars.at[slot(i)]))
            l_i = l_i + p.sum(axis=1)

          def pv(acc_refs):
            for acc_ref, (_, vs) in zip(acc_refs, v_smems):
              plgpu.wgmma(acc_ref, p16, vs.at[slot(i)])

          acc = pl.run_state(pv)(tuple(plgpu.ACC.init(a) for a in acc))
          plgpu.barrier_arrive(v_used.at[slot(i)])
          return acc, m_new, l_i

        masked_step = functools.partial(step, masked=True)
        lax.fori_loop(item_lo, t_lo, skip, None)
        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(t_lo, u_lo, masked_step, carry)
        carry = lax.fori_loop(u_lo, u_hi, functools.partial(step, masked=False), carry)
        acc, m_i, l_i = lax.fori_loop(u_hi, t_hi, masked_step, carry)
        lax.fori_loop(t_hi, item_hi, skip, None)
        end_turns()
        # The matrix products are done with this Q: the next item's loads while this one
        # is written out.
        has_next, next_hw = fetch_next()
        pl.when(has_next)(lambda: load_q(next_hw))

        seen = l_i > 0
        l_safe = jnp.where(seen, l_i, 1.0)
        out = [(a / lax.broadcast_in_dim(l_safe, a.shape, [0])).astype(out_dtype)
               for a in acc]
        # The output buffers take len(o_smem) accumulators at a time: all of them, or one
        # (``output_buffers``), refilled once the previous column chunk's stores read it.
        for g in range(0, len(out), len(o_smem)):
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores read
          for buf, part in zip(o_smem, out[g:]):
            buf[...] = part
          if has_lse and g == 0:
            lse_smem[...] = jnp.where(seen, (m_i + jnp.log2(l_safe)) * ragged.LN_2,
                                      ragged.EMPTY_ROW_LSE)
          plgpu.commit_smem()
          # Row-exact store of rows [first, first + n_rows): one TMA per set bit of n_rows.
          start, size = first, block_q
          while size >= 1:
            take = (n_rows & size) != 0

            @pl.when(take)
            def _store(start=start, size=size, g=g):
              for c, buf in enumerate(o_smem):
                plgpu.copy_smem_to_gmem(
                    buf.at[pl.ds(start, size)],
                    o_ref.at[pl.ds(row + start, size), h, pl.ds((g + c) * CHUNK, CHUNK)])

            start = start + jnp.where(take, size, 0)
            size //= 2
        if has_lse:
          plgpu.copy_smem_to_gmem(
              lse_smem, lse_ref.at[h, pl.ds((w * COMPUTE_WGS + half) * block_q, block_q)])
        return base + item_hi - item_lo

      for_each_unit(run_item, load_q, take)
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg >= COMPUTE_WGS)
    def _produce():
      plgpu.set_max_registers(32 if split else 40, action="decrease")
      tail8 = scalar_ref[_S_TAIL8]

      def load_item(hw, base, fetch_next):
        # The next unit is claimed before this one's tiles are loaded: the compute
        # warpgroups then have it when they finish this one.
        fetch_next()
        h, _, meta, item_lo, item_hi, _ = item_of(hw)
        kv_head = lax.div(h, jnp.int32(group))
        tile_row = functools.partial(tile_first_row, meta(_KV_ROW8), meta(_KV_LAST8),
                                     block_kv=block_kv)
        if page_size is not None:
          seq = meta(_SEQ)
          last_tile = lax.div(jnp.maximum(meta(_KV_LEN) - 1, 0), jnp.int32(block_kv))

        @pl.loop(item_lo, item_hi)
        def _load(i):
          slot = slot_of(i, base, item_lo)
          start = tile_row(i)
          reuse = base + i - item_lo >= num_stages

          @pl.when(reuse)
          def _():
            plgpu.barrier_wait(k_used.at[slot])

          if page_size is not None:
            # Tile i is positions [start, start + block_kv) of the sequence: `pages`
            # pieces of `piece` rows, each inside one page (``tile_pages``). The table's
            # page ids are in range; a piece past the table's last column (only in the
            # sequence's last tile, past its keys) reads that column's page.
            def piece_at(j):
              pos = start + j * piece
              col = jnp.minimum(lax.div(pos, jnp.int32(page_size)), table_ref.shape[1] - 1)
              return table_ref[seq, col], lax.rem(pos, jnp.int32(page_size))

            spots = [piece_at(j) for j in range(pages)]
            copies = lambda x, *idx: [  # noqa: E731
                (x.at[page, pl.ds(row, piece), *idx], pl.ds(j * piece, piece))
                for j, (page, row) in enumerate(spots)]
          else:
            copies = lambda x, *idx: [  # noqa: E731
                (x.at[pl.ds(start, block_kv), *idx], pl.ds(0, block_kv))]
          for (part, col), (ks, _) in zip(chunks, k_smems):
            k_head = 0 if part.shared_k else kv_head
            for src, rows in copies(k_refs[part.k_index], k_head,
                                    pl.ds(part.k_col + col, CHUNK)):
              plgpu.copy_gmem_to_smem(src, ks.at[slot].at[rows], k_bars.at[slot])

          @pl.when(reuse)
          def _():
            plgpu.barrier_wait(v_used.at[slot])

          if page_size is not None:
            # V from the page, but the sequence's last tile from v_tail_ref, whose rows
            # past the sequence's keys are zeros (stale cache rows may be NaN).
            for c, (vs, _) in enumerate(v_smems):
              cols = pl.ds(c * CHUNK, CHUNK)

              @pl.when(i == last_tile)
              def _(cols=cols, vs=vs):
                for j in range(pages):
                  rows = pl.ds(j * piece, piece)
                  plgpu.copy_gmem_to_smem(v_tail_ref.at[seq, rows, kv_head, cols],
                                          vs.at[slot].at[rows], v_bars.at[slot])

              @pl.when(i != last_tile)
              def _(cols=cols, vs=vs):
                for src, rows in copies(v_ref, kv_head, cols):
                  plgpu.copy_gmem_to_smem(src, vs.at[slot].at[rows], v_bars.at[slot])
            return

          # V in two copies per 64 columns: when a tile's last 8 rows are the last key's
          # group, they come from v_tail, whose rows past that key are zeros (0 * NaN is
          # NaN). When the batch's keys end before the last group of the tile at row 0
          # (every tile is that one), the whole tile comes from v_tail.
          head_tile = (start == 0) & (tail8 < block_kv // 8 - 1)
          for c, (vs, _) in enumerate(v_smems):
            cols = pl.ds(c * CHUNK, CHUNK)
            tail = lambda rows, cols=cols: v_tail_ref.at[rows, kv_head, cols]  # noqa: E731

            @pl.when(head_tile)
            def _(vs=vs, tail=tail):
              for rows in (pl.ds(0, block_kv - 8), pl.ds(block_kv - 8, 8)):
                plgpu.copy_gmem_to_smem(tail(rows), vs.at[slot].at[rows], v_bars.at[slot])

            @pl.when(jnp.logical_not(head_tile))
            def _(vs=vs, tail=tail, cols=cols):
              _load_rows(lambda rows: v_ref.at[rows, kv_head, cols],
                         tail(pl.ds(block_kv - 8, 8)), block_kv, start, vs.at[slot],
                         v_bars.at[slot], tail_group=tail8)

        return base + item_hi - item_lo

      for_each_unit(load_item, lambda hw: None, publish)

  pl.run_scoped(body, *scratch, *barriers, collective_axes="wg")


def padded_rows(rows: int, tile: int) -> int:
  """The rows an operand of `rows` rows is given to the kernel with: at least one tile.
  Operands that have them (any longer than a tile) are passed without a copy."""
  return max(rows, tile)


def operands(q_ops, k_ops, v, q_offsets, kv_offsets, sink_weights, *, mask, return_lse,
             config: MosaicConfig, paged_cache=None, block_table=None, interpret=False):
  """The work before the kernel: its operands (the work list, the scalars, the sink
  weights if any, Q, K, V and ``v_tail``); with ``return_lse``, each output row's LSE
  slot; and the persistent grid's size, which the unit order is chosen for. Arguments as
  ``ragged_attention_mgpu``'s; ``interpret`` runs ``work_items``' kernel in Mosaic GPU's
  interpret mode (to call this on the CPU)."""
  total_q, num_heads, _ = q_ops[0].shape
  total_kv = v.shape[0]
  batch = q_offsets.shape[0] - 1
  rows = COMPUTE_WGS * config.block_q
  num_items = num_work_items(total_q, batch, config.block_q)
  if num_heads * num_items * rows >= 2**31:
    raise ValueError(f"{num_heads} heads x {num_items} work items of {rows} rows overflow "
                     "the kernel's int32 unit and LSE indices")
  programs = num_programs(num_heads * num_items, config)
  group = num_heads // v.shape[-2]
  page_tiles = block_table is not None
  kw = dict(mask=mask, block_q=config.block_q, block_kv=config.block_kv,
            paged_cache=paged_cache, page_tiles=page_tiles)
  tile_bound = work_items.total_kv_tiles_bound(
      total_kv, None if paged_cache is None else paged_cache[1], config.block_kv)
  if BUILD_WORK_LIST and not return_lse and work_items.fits(num_items, batch, tile_bound):
    # One small kernel instead of XLA's ~16 (``work_items``); the LSE's row slots come
    # from XLA's version.
    table, scalars = work_items.build(q_offsets, kv_offsets, total_q, total_kv,
                                      num_heads=num_heads, group=group,
                                      num_programs=programs, dynamic=DYNAMIC,
                                      interpret=interpret, **kw)
    lse_slot, kv_end = None, scalars[work_items.S_KV_TAIL]
  else:
    table, lse_slot, kv_end, n_live = work_list(q_offsets, kv_offsets, total_q, total_kv,
                                                **kw)
    tiles = table[:, _T_HI] - table[:, _T_LO]
    order = dict(num_heads=num_heads, group=group, num_programs=programs)
    head_major, deal = (dynamic_schedule(tiles, n_live, **order) if DYNAMIC
                        else (head_major_order(tiles, n_live, **order), 0))
    scalars = jnp.zeros((SCALAR_LANES,), jnp.int32)  # _S_NEXT: 0
    for lane, x in ((_S_LIVE, n_live), (_S_TAIL8, -1 if page_tiles else _floor8(kv_end) // 8),
                    (_S_HEAD_MAJOR, head_major), (_S_DEAL, deal)):
      scalars = scalars.at[lane].set(jnp.asarray(x, jnp.int32))
  if DYNAMIC and DYNAMIC_HEAD_MAJOR is not None:  # the order forced (A/B runs)
    scalars = scalars.at[_S_HEAD_MAJOR].set(DYNAMIC_HEAD_MAJOR)
  if DYNAMIC and DYNAMIC_DEAL is not None:  # dealt or claimed forced (A/B runs)
    scalars = scalars.at[_S_DEAL].set(DYNAMIC_DEAL)
  grow = lambda x, n: x if x.shape[0] == n else jnp.pad(  # noqa: E731
      x, [(0, n - x.shape[0])] + [(0, 0)] * (x.ndim - 1))
  q_rows = padded_rows(total_q, config.block_q)
  if block_table is not None:
    # The kernel reads the pages: each sequence's last V tile comes from v_last, a copy
    # with the rows past its keys zeroed, and no key group is special (tail8 = -1).
    num_pages, page_size = v.shape[:2]
    cache_lengths, capacity = paged_cache
    ids = jnp.clip(block_table.astype(jnp.int32), 0, num_pages - 1)
    kv_len = paged_kv_lengths(q_offsets, total_q, cache_lengths, capacity)
    pos = (jnp.maximum(kv_len - 1, 0) // config.block_kv * config.block_kv)[:, None] + (
        jnp.arange(config.block_kv, dtype=jnp.int32))
    page = jnp.take_along_axis(ids, jnp.minimum(pos // page_size, ids.shape[1] - 1), 1)
    v_last = jnp.where((pos < kv_len[:, None])[..., None, None], v[page, pos % page_size],
                       jnp.zeros((), v.dtype))
    inputs = [table, scalars]
    inputs += [sink_weights.astype(jnp.float32)] if sink_weights is not None else []
    inputs += [grow(x, q_rows) for x in q_ops] + list(k_ops) + [v, v_last, ids]
    return inputs, (lse_slot if return_lse else None), programs
  # The tile ending with the 8-row group that holds the last key, or the tile at row 0
  # when that group ends before it does; rows past the last key zeroed.
  bkv = config.block_kv
  first = jnp.maximum(_floor8(kv_end) + 8 - bkv, 0)
  tail_rows = first + jnp.arange(bkv, dtype=jnp.int32)
  v_tail = jnp.where((tail_rows < kv_end)[:, None, None],
                     v[jnp.clip(tail_rows, 0, total_kv - 1)], 0).astype(v.dtype)
  # Q, K and V go to untiled shared-memory buffers (64-column chunks) and the output
  # comes from one, so no operand needs padding beyond a tile's rows.
  kv_rows = padded_rows(total_kv, config.block_kv)
  inputs = [table, scalars]
  inputs += [sink_weights.astype(jnp.float32)] if sink_weights is not None else []
  inputs += [grow(x, q_rows) for x in q_ops] + [grow(x, kv_rows) for x in k_ops]
  inputs += [grow(v, kv_rows), v_tail]
  return inputs, (lse_slot if return_lse else None), programs


def ragged_attention_mgpu(q_ops, k_ops, v, q_offsets, kv_offsets, sink_weights, *, parts,
                          mask, scale, output_dtype, return_lse, config: MosaicConfig,
                          paged=None):
  """The Mosaic GPU kernel on validated, supported operands (``unsupported_reason`` is
  None); arguments and results as ``ragged.ragged_attention``'s. A paged cache
  (``paged``: block table, cache lengths) is read page by page, each KV tile from one page
  or from ``tile_pages`` consecutive ones, when its pages have ``MIN_NATIVE_PAGE`` rows or
  more; smaller pages are gathered into contiguous K/V first (``gathered_pages``).
  ``SPLIT_UNITS`` applies here (``split_config``), where shared memory holds it."""
  total_q, num_heads, _ = q_ops[0].shape
  paged_cache = block_table = page_size = None
  split = split_config(config)
  if smem_bytes(parts, v.shape[-1], v.dtype, output_dtype, return_lse,
                split) <= SMEM_BYTES:  # (forced split units may not fit: MLA)
    config = split
  if paged is not None:
    block_table, cache_lengths = paged
    paged_cache = (cache_lengths, block_table.shape[1] * v.shape[1])
    if v.shape[1] >= MIN_NATIVE_PAGE:
      page_size = v.shape[1]
      config = paged_config(config, page_size)
    else:
      gathered, _ = gathered_pages([*k_ops, v], block_table, cache_lengths, q_offsets,
                                   total_q)
      k_ops, v, block_table = gathered[:-1], gathered[-1], None
  num_kv_heads, v_depth = v.shape[-2:]
  rows = COMPUTE_WGS * config.block_q
  inputs, lse_slot, programs = operands(q_ops, k_ops, v, q_offsets, kv_offsets,
                                        sink_weights, mask=mask, return_lse=return_lse,
                                        config=config, paged_cache=paged_cache,
                                        block_table=block_table)
  num_items = inputs[0].shape[0]  # the work list's rows
  kernel = functools.partial(
      _kernel, parts=tuple(parts), n_q=len(q_ops), n_k=len(k_ops),
      has_sink=sink_weights is not None, has_lse=return_lse, mask=mask,
      scale=scale * ragged.LOG2_E, block_q=config.block_q, block_kv=config.block_kv,
      num_stages=config.num_stages, group=num_heads // num_kv_heads, num_heads=num_heads,
      out_dtype=jnp.dtype(output_dtype), page_size=page_size,
      out_buffers=output_buffers(parts, v_depth, v.dtype, output_dtype, return_lse, config),
      dynamic=DYNAMIC, split=config.split_units)
  if DYNAMIC:
    # The kernel counts its claims in the scalars' _S_NEXT lane: a fresh copy per call
    # (a Ref, which the kernel updates in place), whoever else reads the scalars.
    inputs[1] = jax.new_ref(inputs[1])
  out_type = [jax.ShapeDtypeStruct((total_q, num_heads, v_depth), output_dtype)]
  if return_lse:
    out_type.append(jax.ShapeDtypeStruct((num_heads, num_items * rows), jnp.float32))
  results = plgpu.kernel(
      kernel, out_type=out_type, grid=(programs,),
      grid_names=("cta",),
      # A producer warpgroup per K/V stream (``MosaicConfig.split_units``: one each).
      num_threads=COMPUTE_WGS + (COMPUTE_WGS if config.split_units else 1),
      thread_name="wg",
      # No cross-warp reductions (a row's scores lie in one warp): no scratch for them.
      compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
  )(*inputs)
  if not return_lse:
    return results[0]
  # Rows past offsets[-1] belong to no sequence: no sink either (the empty-row value).
  last = lax.cummax(jnp.clip(q_offsets[1:].astype(jnp.int32), 0, total_q))[-1]
  lse = jnp.take(results[1], lse_slot, axis=1).T
  return results[0], jnp.where(jnp.arange(total_q)[:, None] < last, lse,
                               ragged.EMPTY_ROW_LSE)

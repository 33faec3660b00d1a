"""The ragged attention kernel in Pallas Mosaic GPU (Hopper, sm_90), in named stages.

The structure is FlashAttention-3's, as in JAX's dense ``ops/gpu/attention_mgpu.py``: per
program two compute warpgroups (``compute_warpgroup``; three with
``MosaicConfig.compute_wgs``), each with ``block_q`` query rows, and one producer
warpgroup (``producer_warpgroup``) that streams K/V tiles through ``num_stages``
shared-memory slots with TMA. Per KV tile a compute warpgroup runs ``qk_scores``,
``mask_scores`` (on the tiles the mask cuts), ``online_softmax`` and ``pv``; they take
turns on the tensor cores (``Turns``: a ring of hardware named barriers), so that one's
softmax overlaps the others' matrix products; ``epilogue`` normalizes and stores.
The kernel is persistent: one program per SM runs its share of the (head, work item)
units back to back (``Units``: the static deal, or claims from a global counter, in the
order ``schedule`` picks), the K/V slots and barrier phases carried from one unit to the
next, so that the producer streams the next unit's first tiles and each compute
warpgroup loads its next Q while the last unit is finished and written out.

The ragged parts, which the dense kernel has none of:

- A work list (``work_list``, or ``work_items`` on the GPU): one item per query tile of
  each compute warpgroup (two or three) of one sequence, heaviest first. Each item's row
  ranges and KV tile ranges are read from a small int32 table (``layout``'s columns), so
  that the warpgroups agree on every trip count, zero included. Only the items that store
  rows run.
- TMA into 8-row-tiled shared memory needs row starts that are multiples of 8 and GMEM
  arrays whose row count is one. Q, K and V avoid the second: they live in 64-column
  buffers that TMA fills untiled, from any row of arrays of any row count, read by the
  matrix products through an (8, 64)-tiled view of the same bytes (``smem.Scratch``); P.V
  is one product per 64 columns of V, each into its own accumulator. An item starts at its
  sequence's first row rounded down to 8; the rows before it (a neighbour's) and past the
  sequence are computed and never stored.
- KV tile i starts at the sequence's first key plus i * block_kv (``tile_first_row``;
  ``MosaicOptions.batch_invariant``, the default): the same keys in the same tiles
  wherever the sequence sits in the packed arrays, so that its output and LSE do not
  depend on its neighbours. The last tile runs past the sequence's keys into the
  neighbour's rows (masked, ``visible_keys``) and past the array's end (TMA fills zeros).
  Rows past the batch's last key may hold anything, NaN included, and 0 * NaN would
  poison P.V: a V tile that runs past that key comes from ``v_tail``, V's rows around it
  with the rows past it zeroed (``operands``). Without the option (and for FP8, whose
  V^T tiles start at multiples of 16 keys) a tile starts at the first key rounded down
  to 8 (16), and no later than ``max(ceil8(kv_end) - block_kv, 0)``: the last tile is
  shifted back to end in the 8-row group of the last key, whose V rows come from
  ``v_tail``; the keys it repeats and those before the sequence are masked.
- Outputs are stored row-exact with a ladder of TMA stores (block_q, block_q/2, ..., 1
  rows, for each 64-column output buffer), as JAX's ragged_dot does, so no store touches
  a neighbour's rows. The LSE goes to a per-item buffer that XLA gathers back into rows.
  (One output buffer per accumulator, not one buffer written a column slice at a time:
  the sliced stores into the warpgroup's buffer gave a wrong second half on the H200 that
  interpret mode does not show, BUILD_NOTES.md. Where shared memory holds only one buffer,
  ``smem.output_buffers``, that one is filled and stored a column chunk at a time.)
- Items without KV tiles (padding rows, rows past the last offset, queries that see no
  key) store only zeros: by default each is one unit for all heads
  (``MosaicOptions.keyless_units``, ``schedule.unit_of``), run before the others, whose
  compute warpgroups write zeros into their output buffers once and store them to every
  head's rows (``store_zeros``), so that those stores drain while other programs compute.
- Paged caches with pages of ``layout.MIN_NATIVE_PAGE`` rows or more are read in place:
  KV tile i of a sequence is its positions [i * block_kv, (i + 1) * block_kv), which lie
  in one page or span ``layout.tile_pages`` whole pages; the producer reads the page ids
  from the block table and TMAs the tile from them, a copy per page; each sequence's last
  V tile comes from ``v_tail`` (rows past its keys zeroed: stale cache rows may be NaN).
  FP8 pages give K the same way and V^T from columns of the sequence's own
  (``vt_page_column``), with those zeros already.

With ``MosaicConfig.split_units`` each compute warpgroup instead runs half-units of its
own (a head and its ``block_q`` rows of an item, the half's own KV tile range), fed by a
producer warpgroup of its own through K/V slots of its own (a "lane"), with no turns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_prefill import masks
from pallas_prefill.config import ZERO_JOB_UNITS
from pallas_prefill.constants import EMPTY_ROW_LSE, LN_2, LOG2_E, MASK_VALUE
from pallas_prefill.fp8 import is_fp8
from pallas_prefill.mosaic_gpu import layout as L
from pallas_prefill.mosaic_gpu import primitives
from pallas_prefill.mosaic_gpu import smem
from pallas_prefill.mosaic_gpu.schedule import (ALL_HEADS, dealt_unit, num_local_units,
                                                num_units, stores_keyless_units, unit_of,
                                                zero_job, zero_jobs)

FP32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32

# FP8: P is quantized as 2**P_BIAS times its value (at most 256 of e4m3's 448), which keeps
# small probabilities out of e4m3's subnormals; the running sum carries the same factor.
P_BIAS = 8

# A soft-capped score (base 2) lies in [-cap, cap]: with a fixed maximum M its exp2 lies in
# [2**(-cap - M), 2**(cap - M)], which must stay a normal float32 (ex2.approx flushes
# subnormals) with room for the sums: at least 2**-FIXED_MAX_FLOOR, at most
# 2**FIXED_MAX_CEIL.
FIXED_MAX_FLOOR = 120
FIXED_MAX_CEIL = 32


def fixed_maximum(soft_cap: float | None) -> float | None:
  """The fixed running maximum (base 2) that replaces the online one where the scores are
  soft-capped (``soft_cap``: the cap times log2(e)), or None where no fixed maximum keeps
  every exp2 in [2**-FIXED_MAX_FLOOR, 2**FIXED_MAX_CEIL] (caps above about 52.7): the cap
  itself up to cap 41.6 (exp2 at most 1, as with the running maximum), above it
  FIXED_MAX_FLOOR - cap."""
  if soft_cap is None:
    return None
  m = min(soft_cap, FIXED_MAX_FLOOR - soft_cap)
  return m if soft_cap - m <= FIXED_MAX_CEIL else None


# The compute warpgroups' turns on the tensor cores (``Turns``): hardware named barrier
# turn_barrier(wgs) + g for compute warpgroup g, which warpgroup g - 1 (mod wgs) signals.
# Mosaic GPU itself uses barrier 0 and 1 + the warpgroup index (wgs + 1 warpgroups).
def turn_barrier(wgs: int) -> int:
  """The first turn barrier: the first past Mosaic GPU's for ``wgs`` compute warpgroups
  and the producer (4 for the default two)."""
  return 2 + wgs


@dataclasses.dataclass(frozen=True)
class KernelSpec:
  """What one compilation of the kernel is for (static).

  parts: the ``logits.QkPart`` terms; n_q, n_k: the Q and K operands; dtype: theirs and
  V's; v_depth: V's (a multiple of 64); scale: the logit
  scale times log2(e); group: query heads per K/V head; out_buffers:
  ``smem.output_buffers``; dynamic: claimed units (``MosaicOptions.dynamic``); split:
  split units; page_size: K/V operands are pages [num_pages, page_size, heads, depth]
  read a tile at a time from the pages the block table names (``v_tail`` then holds each
  sequence's last V tile, and the block table follows it; FP8: V^T by sequence, then the
  block table); fold_scale:
  ``MosaicOptions.fold_scale``; soft_cap: None, or the logit soft cap times log2(e)
  (``scaled_scores``); top_left: queries from position 0 (else kv_len - q_len);
  skip_keyless_q, keyless_units: ``MosaicOptions``'; kv_unit: the unit of the work list's
  KV tile rows, ``layout.kv_unit``: 1 where tiles start at the sequence's first key
  (batch invariant), 8 where at a multiple of 8 or 16; fixed_max: None, or the soft-capped scores' fixed maximum
  (``fixed_maximum``, ``MosaicOptions.soft_cap_fixed_max``): no running maximum, no
  rescale; scaled_q: soft-capped, each unit's Q times scale / cap in shared memory
  (``scale_q``, ``MosaicOptions.soft_cap_scaled_q``), the scores then tanh's argument;
  p_registers: FP8's P.V takes P from registers (``primitives.fp8_a_operand``, V^T's keys
  in its order; ``MosaicOptions.fp8_p_registers``), not from shared memory; wgs: the compute
  warpgroups (``MosaicConfig.compute_wgs``), each with block_q rows of a unit's item;
  row_sum_first, q_per_tile, column_mask: ``MosaicOptions``' (registers for three
  warpgroups); column_lo_static: ``MosaicOptions``' (``column_lo_dropped``);
  narrow_last_tile: ``MosaicOptions``' (``narrow_tiles``).
  """

  parts: tuple
  n_q: int
  n_k: int
  dtype: object
  v_depth: int
  has_sink: bool
  has_lse: bool
  mask: object
  scale: float
  block_q: int
  block_kv: int
  num_stages: int
  group: int
  num_heads: int
  out_dtype: object
  out_buffers: int
  dynamic: bool
  split: bool = False
  page_size: int | None = None
  fold_scale: bool = True
  soft_cap: float | None = None
  top_left: bool = False
  skip_keyless_q: bool = True
  keyless_units: str = "per_head"
  kv_unit: int = 8
  fixed_max: float | None = None
  scaled_q: bool = False
  p_registers: bool = False
  wgs: int = L.COMPUTE_WGS
  row_sum_first: bool = False
  q_per_tile: bool = False
  column_mask: bool = False
  column_lo_static: bool = False
  narrow_last_tile: bool = False

  @property
  def narrow_tiles(self) -> bool:
    """Whether a unit's last KV tile may run as its first half (``narrow_last``):
    ``MosaicOptions.narrow_last_tile``, for bf16 and float16 with 128-key tiles shared
    by the warpgroups' turns (FP8's P.V reads V^T, whose keys are its minor dimension)."""
    return (self.narrow_last_tile and not self.fp8 and not self.split
            and self.block_kv == 2 * L.CHUNK)

  @property
  def column_lo_dropped(self) -> bool:
    """The column mask compares each score with its row's upper bound only
    (``MosaicOptions.column_lo_static``), where no tile shows a row a key before its first
    column (``lo_column_is_first``)."""
    return (self.column_mask and self.column_lo_static
            and lo_column_is_first(self.mask, self.kv_unit))

  @property
  def fold_fp8(self) -> bool:
    """FP8 logits' factor (the item's scales times the softmax scale) folded into the
    exponent's fused multiply-add, as bf16's scale (``MosaicOptions.fold_scale``): where
    the softmax scale is positive and no soft cap needs the scaled logits first."""
    return self.fp8 and self.fold_scale and self.scale > 0 and self.soft_cap is None

  @property
  def keyless_apart(self) -> bool:
    """Key-less items run as units of their own, for all heads (``schedule.unit_of``), or
    as zero jobs of the keyed units (``zero_stores``)."""
    return self.keyless_units != "per_head"

  @property
  def zero_stores(self) -> bool:
    """Key-less items' zeros as jobs of the keyed units, stored without TMA
    (``MosaicOptions.keyless_units`` in ``ZERO_JOB_UNITS``; ``store_zero_jobs``)."""
    return self.keyless_units in ZERO_JOB_UNITS

  @property
  def zero_bulk(self) -> bool:
    """Zero jobs copied by the TMA unit from a buffer of zeros (``keyless_units="bulk"``,
    ``Scratch.zeros``), each a contiguous span of an item's rows as "spans"' are."""
    return self.keyless_units == "bulk"

  @property
  def chunks(self):
    return L.column_chunks(self.parts)

  @property
  def fp8(self) -> bool:
    """FP8 operands: Q.K and P.V as FP8 matrix products (V transposed; P from registers
    with ``p_registers``, else through shared memory), the logits' dequantization
    factor and V's read per item (``Item``)."""
    return is_fp8(self.dtype)

  @property
  def pages(self) -> int:
    """The pages a paged KV tile comes from (``piece`` rows from each)."""
    return 1 if self.page_size is None else L.tile_pages(self.block_kv, self.page_size)

  @property
  def piece(self) -> int:
    return self.block_kv // self.pages


@dataclasses.dataclass(frozen=True)
class Refs:
  """The kernel's operands in global memory, by name (``operands.operands`` makes them):
  the work list (``meta``), the scalars, the sink weights (or None), the Q and K operands,
  V (FP8: transposed, [num_kv_heads, v_depth, rows], or for pages [num_kv_heads, v_depth,
  batch * columns per sequence]), ``v_tail``
  (None for FP8), the block table (paged only, else None), FP8's scales (each [batch,
  num_kv_heads] float32: the logits' factor and V's, else None), the output and the
  per-item LSE (or None)."""

  meta: object
  scalars: object
  sink: object
  q: list
  k: list
  v: object
  v_tail: object
  table: object
  o: object
  lse: object
  qk_scale: object = None
  v_scale: object = None

  @classmethod
  def unpack(cls, meta_ref, scalar_ref, refs, spec: KernelSpec) -> Refs:
    refs = list(refs)
    sink = refs.pop(0) if spec.has_sink else None
    q, refs = refs[:spec.n_q], refs[spec.n_q:]
    k, refs = refs[:spec.n_k], refs[spec.n_k:]
    v = refs.pop(0)
    v_tail = None if spec.fp8 else refs.pop(0)
    table = refs.pop(0) if spec.page_size is not None else None
    qk_scale, v_scale = (refs.pop(0), refs.pop(0)) if spec.fp8 else (None, None)
    return cls(meta=meta_ref, scalars=scalar_ref, sink=sink, q=q, k=k, v=v, v_tail=v_tail,
               table=table, o=refs[0], lse=refs[1] if spec.has_lse else None,
               qk_scale=qk_scale, v_scale=v_scale)


def tile_first_row(kv_row, kv_last, i, *, block_kv, unit):
  """KV tile i's first row in the K/V arrays from the work list's ``KV_ROW`` and
  ``KV_LAST`` (in units of ``unit`` rows, ``layout.kv_unit``; see ``work_list``)."""
  return jnp.minimum(kv_row + i * (block_kv // unit), kv_last) * unit


def first_fresh_key(i, kv_row, kv_start, *, block_kv, unit):
  """The position of KV tile i's first key that no earlier tile had (with aligned
  tiles, a shifted last tile repeats some and the first starts up to 7 rows before the
  sequence): at least 0."""
  return jnp.maximum(kv_row * unit + i * block_kv - kv_start, 0)


def visible_keys(mask, q_pos, k_pos, i, kv_row, kv_start, kv_len, *, block_kv, unit):
  """Which (query, key) pairs of KV tile i a masked step keeps: keys of the sequence
  (0 <= k_pos < kv_len) that the mask shows and that no earlier tile had
  (``first_fresh_key``)."""
  fresh = first_fresh_key(i, kv_row, kv_start, block_kv=block_kv, unit=unit)
  return mask.visible(q_pos, k_pos) & (k_pos >= fresh) & (k_pos < kv_len)


def visible_columns(mask, q_pos, k0, i, kv_row, kv_start, kv_len, *, block_kv, unit):
  """``visible_keys`` as a run of columns [lo, hi) of KV tile i for each query (the
  tile's first key at position k0; ``masks``' ``key_range``): column c is visible iff
  lo <= c < hi, for the columns of keys at positions >= 0."""
  fresh = first_fresh_key(i, kv_row, kv_start, block_kv=block_kv, unit=unit)
  lo, hi = mask.key_range(q_pos)
  return jnp.maximum(lo, fresh) - k0, jnp.minimum(hi, kv_len) - k0


def lo_column_is_first(mask, unit) -> bool:
  """Whether ``visible_columns``' lo is at most 0 on every tile, so that the column mask
  needs no lower bound: the mask's keys start at position 0 for every query
  (``masks.key_range_starts_at_zero``) and KV tiles start at the sequence's first key
  (``unit`` 1: tile i's first key is at position i * block_kv, which no earlier tile
  had, so lo = max(0, fresh) - k0 = 0). tests/test_mosaic.py's emulated schedule
  asserts it on every masked tile where this holds."""
  return unit == 1 and masks.key_range_starts_at_zero(mask)


def scratch_for(spec: KernelSpec) -> smem.Scratch:
  """The allocation specs of the kernel's scratch for `spec`: its barriers count the
  copies that ``load_kv_tile`` makes (tests/test_mosaic.py checks every loader's path)."""
  return smem.scratch(
      # V's 64-column buffers: one accumulator each
      chunks=len(spec.chunks), v_chunks=spec.v_depth // L.CHUNK, dtype=spec.dtype,
      out_dtype=spec.out_dtype, out_buffers=spec.out_buffers, has_lse=spec.has_lse,
      block_q=spec.block_q, block_kv=spec.block_kv, num_stages=spec.num_stages,
      split=spec.split, dynamic=spec.dynamic, pages=spec.pages,
      paged=spec.page_size is not None, one_v_copy=spec.kv_unit == 1,
      p_smem=not spec.p_registers, wgs=spec.wgs, zero_buffer=spec.zero_bulk)


def attention_kernel(meta_ref, scalar_ref, *refs, spec: KernelSpec):
  """The kernel body: allocates the scratch and runs the warpgroups' roles."""
  refs = Refs.unpack(meta_ref, scalar_ref, refs, spec)
  scratch = scratch_for(spec)

  def roles(scratch: smem.Scratch):
    wg = lax.axis_index("wg")
    units = Units(spec, refs, scratch, wg)
    pl.when(wg < spec.wgs)(lambda: compute_warpgroup(spec, refs, scratch, units, wg))
    pl.when(wg >= spec.wgs)(lambda: producer_warpgroup(spec, refs, scratch, units))

  pl.run_scoped(roles, scratch, collective_axes="wg")


# --------------------------------------------------------------------------------------
# Scheduling: this program's units, and the claims that pass them on.

class Units:
  """This program's (head, work item) units, as every warpgroup of it sees them.

  A unit is (head, item, half): half 0 for shared units (each compute warpgroup takes its
  own rows of them); with split units, unit v is half v % 2 (the rows of warpgroup
  v % 2's share) of shared unit v // 2, so that an item's two halves are claimed one
  after the other. Unless ``keyless_units`` is "per_head", an item without KV tiles is
  one unit whose head is ``schedule.ALL_HEADS`` (``schedule.unit_of``); with "stores" only
  where no item has KV tiles, its (head, item) pairs otherwise zero jobs of the keyed
  units (``schedule.zero_jobs``, ``store_zero_jobs``). Dynamic: each
  program's producer claims (or takes as dealt) the next unit one ahead and passes it to
  the compute warpgroups through two shared-memory slots a lane (``publish``, ``take``).
  Static: the zigzag (``schedule.dealt_unit``) deals them.
  """

  def __init__(self, spec: KernelSpec, refs: Refs, scratch: smem.Scratch, wg):
    self.spec, self.refs, self.scratch, self.wg = spec, refs, scratch, wg
    self.lane = lax.rem(wg, jnp.int32(spec.wgs)) if spec.split else 0
    n_live = refs.scalars[L.S_LIVE]
    n_keyed, n_keyless = n_live, None
    if spec.keyless_apart:
      n_keyed = refs.scalars[L.S_KEYED]
      n_keyless = n_live - n_keyed
    self.n_keyed, self.n_keyless = n_keyed, n_keyless
    keyless_units = (stores_keyless_units(n_keyed, n_keyless) if spec.zero_stores
                     else n_keyless)
    self.n_units = (num_units(spec.num_heads, n_keyed, keyless_units)
                    * (spec.wgs if spec.split else 1))
    # Unit u (claimed, or dealt) in the order ``schedule.dynamic_schedule`` picked.
    self.by_order = functools.partial(
        unit_of, num_heads=spec.num_heads, group=spec.group, n_keyed=n_keyed,
        n_keyless=keyless_units, head_major=refs.scalars[L.S_HEAD_MAJOR],
        spread=spec.keyless_units == "spread")

  def claimed(self, u):
    """The (head, item, half) of claimed unit u."""
    if self.spec.split:
      return (*self.by_order(lax.div(u, jnp.int32(self.spec.wgs))),
              lax.rem(u, jnp.int32(self.spec.wgs)))
    return (*self.by_order(u), 0)

  def item_of(self, hwh):
    """Unit (head, item, half)'s head (0 for ``ALL_HEADS``), item, its table row reader,
    its KV tile range (the item's, or with split units the half's), and whose rows it
    computes (the half, or for shared units the warpgroup's own)."""
    h, w, half = hwh
    if self.spec.keyless_apart:
      h = jnp.maximum(h, 0)  # ALL_HEADS
    meta = lambda col: self.refs.meta[w, col]  # noqa: E731
    if self.spec.split:
      return (h, w, meta, meta(L.WG_COLS + 4 * half), meta(L.WG_COLS + 4 * half + 3), half)
    return h, w, meta, meta(L.T_LO), meta(L.T_HI), self.wg

  def take(self, k):
    """(Dynamic, compute warpgroups) this program's k-th claim: a unit, or n_units or
    more when none is left."""
    s = self.lane * 2 + lax.rem(k, 2)
    plgpu.barrier_wait(self.scratch.unit_ready.at[s])
    u = self.scratch.units[s]
    plgpu.barrier_arrive(self.scratch.unit_used.at[s])
    return u

  def publish(self, k):
    """(Dynamic, producer) claims this program's k-th unit, or takes the one the static
    zigzag deals it (``schedule.dynamic_schedule``), and passes it on."""
    scratch, scalars = self.scratch, self.refs.scalars
    s = self.lane * 2 + lax.rem(k, 2)
    pl.when(k >= 2)(lambda: plgpu.barrier_wait(scratch.unit_used.at[s]))
    dealt = dealt_unit(lax.axis_index("cta"), lax.axis_size("cta"), k)
    if self.spec.split:  # both lanes of a program take the halves of the units it is dealt
      dealt = dealt * self.spec.wgs + self.lane
    primitives.claim(scalars, scratch.units, s, jnp.where(scalars[L.S_DEAL] != 0, dealt, -1))
    u = scratch.units[s]
    plgpu.barrier_arrive(scratch.unit_ready.at[s])
    return u

  def for_each_unit(self, run, first, next_unit):
    """run(hw, base, fetch_next, u) on each of this program's units in turn (u: the
    unit's index in the order, claimed or dealt); base counts the K/V tiles earlier
    units streamed through the slots. first(hw) runs before the loop for the first unit
    (if any). run calls fetch_next() -> (there is a next unit, its hw) once per unit:
    with dynamic scheduling, that takes the next claim."""
    spec = self.spec
    if not spec.dynamic:  # the units the zigzag deals this program (its k-th: units(k))
      units = lambda k: self.by_order(  # noqa: E731
          dealt_unit(lax.axis_index("cta"), lax.axis_size("cta"), k))
      n_local = num_local_units(lax.axis_index("cta"), lax.axis_size("cta"), self.n_units)
      pl.when(n_local > 0)(lambda: first((*units(0), 0)))

      def static_step(k, base):
        return run((*units(k), 0), base, lambda: (k + 1 < n_local, (*units(k + 1), 0)),
                   dealt_unit(lax.axis_index("cta"), lax.axis_size("cta"), k))

      lax.fori_loop(0, n_local, static_step, jnp.int32(0))
      return
    u0 = next_unit(0)
    pl.when(u0 < self.n_units)(lambda: first(self.claimed(u0)))

    def dynamic_step(carry):
      k, base, u = carry
      got = []

      def fetch_next():
        got.append(next_unit(k + 1))
        return got[0] < self.n_units, self.claimed(got[0])

      base = run(self.claimed(u), base, fetch_next, u)
      return k + 1, base, got[0]

    lax.while_loop(lambda carry: carry[2] < self.n_units, dynamic_step,
                   (jnp.int32(0), jnp.int32(0), u0))

  def slot_of(self, i, base, item_lo):
    """The K/V slot of tile i; base: the tiles this program's (lane's) earlier items
    streamed through the slots."""
    num_stages = self.spec.num_stages
    return self.lane * num_stages + lax.rem(base + i - item_lo, jnp.int32(num_stages))


class Turns:
  """Tensor-core turns on hardware named barriers, one per compute warpgroup, in a ring.
  Warpgroup g's P.V waits until warpgroup g - 1 (mod wgs) has issued its Q.K, so that the
  matrix products go round the warpgroups and each one's softmax overlaps the others'
  matrix products: after issuing Q.K, ``qk_issued`` (signals warpgroup g + 1); then
  ``pv_turn`` around waiting for V. Each item starts with every warpgroup g > 0 one turn
  behind (``start``: it takes g - 1's first signal before its first Q.K), and ends with
  each warpgroup g < wgs - 1 meeting g + 1 at the latter's last turn (``end``: g must not
  signal twice before g + 1 has taken the first signal). Every warpgroup takes a turn per
  tile of the item, its own or skipped. Split units take no turns: the two warpgroups'
  units are unrelated."""

  def __init__(self, spec: KernelSpec, wg):
    self.split, self.wg, self.wgs = spec.split, wg, spec.wgs
    self.first = turn_barrier(spec.wgs)

  def barrier(self, g):
    return self.first + g

  def next_wg(self):
    # (two warpgroups: 1 - wg, the kernel's instructions as they were before the ring)
    return 1 - self.wg if self.wgs == 2 else lax.rem(self.wg + 1, jnp.int32(self.wgs))

  def qk_issued(self):
    if not self.split:
      primitives.named_barrier("arrive", self.barrier(self.next_wg()))

  def pv_turn(self, wait_v):
    wait_v()
    if not self.split:
      primitives.named_barrier("sync", self.barrier(self.wg))

  def start(self):
    if not self.split:
      pl.when(self.wg > 0)(lambda: primitives.named_barrier("sync", self.barrier(self.wg)))

  def end(self):
    if not self.split:
      pl.when(self.wg < self.wgs - 1)(
          lambda: primitives.named_barrier("sync", self.barrier(self.wg + 1)))


# --------------------------------------------------------------------------------------
# The compute warpgroups: Q.K, masking, the online softmax, P.V and the epilogue.

@dataclasses.dataclass(frozen=True)
class Item:
  """What a compute warpgroup knows of the unit it runs: its head h and item w; its KV
  tiles [item_lo, item_hi) (the K/V slots' stream), of which it computes [t_lo, t_hi),
  masked outside [u_lo, u_hi); its first Q row (a multiple of 8), the rows
  [first, first + n_rows) of it that it stores, and the position of that first row; the
  sequence's K/V start and length and its tiles' alignment (``tile_first_row``); whether
  it is a key-less item's unit for all heads (``MosaicOptions.keyless_units``: h is
  then 0)."""

  h: object
  w: object
  half: object
  item_lo: object
  item_hi: object
  t_lo: object
  u_lo: object
  u_hi: object
  t_hi: object
  row: object
  first: object
  n_rows: object
  row_pos: object
  kv_start: object
  kv_len: object
  kv_row: object
  kv_last: object
  base: object
  all_heads: object = False
  qk_scale: object = None  # FP8: the logit factor (softmax scale and log2(e) included)
  v_scale: object = None  # FP8: V's dequantization scale, which multiplies the output


def first_q_row(meta, half, block_q):
  """The first Q row of an item's half (a multiple of 8)."""
  return (meta(L.ROW8) + half * (block_q // 8)) * 8


def stored_rows(q_start, q_len, row, block_q):
  """(first, n_rows): the rows [row + first, row + first + n_rows) of the block_q rows
  from ``row`` that belong to the sequence of rows [q_start, q_start + q_len) (the rows
  before them are a neighbour's)."""
  first = jnp.clip(q_start - row, 0, block_q)
  return first, jnp.clip(q_start + q_len - row, 0, block_q) - first


def registers(spec: KernelSpec) -> tuple[int, int]:
  """(compute, producer) registers a thread (``setmaxnreg``; an SM has 65536, which the
  warpgroups' shares must not exceed): 232 and 40; split units, four warpgroups, 224 and
  32; three compute warpgroups 160 and 32 (FlashAttention-3's)."""
  if spec.split:
    return 224, 32
  return (160, 32) if spec.wgs == 3 else (232, 40)


def compute_warpgroup(spec: KernelSpec, refs: Refs, scratch: smem.Scratch, units: Units, wg):
  """A compute warpgroup's role: its units' attention, one after another."""
  plgpu.set_max_registers(registers(spec)[0], action="increase")
  q_fill = [fill.at[wg] for fill, _ in scratch.q]
  own = dict(q=[tiled.at[wg] for _, tiled in scratch.q], o=[o.at[wg] for o in scratch.o],
             lse=scratch.lse.at[wg] if spec.has_lse else None,
             p=scratch.p.at[wg] if scratch.p is not None else None)

  skip_keyless = spec.skip_keyless_q or spec.keyless_apart
  zeros = scratch.zeros
  if spec.zero_bulk:  # written once, read by the TMA unit (``store_zero_jobs``)
    primitives.fill_zeros(zeros)
    plgpu.commit_smem()

  def load_q(hw):
    """TMA of unit hw's Q rows of this warpgroup (the Q buffer must be free); none for a
    unit without KV tiles under ``skip_keyless_q`` or ``keyless_apart`` (``run`` then
    waits for none)."""
    h, _, meta, item_lo, item_hi, half = units.item_of(hw)
    row = first_q_row(meta, half, spec.block_q)

    def copies():
      for (part, col), s in zip(spec.chunks, q_fill):
        plgpu.copy_gmem_to_smem(
            refs.q[part.q_index].at[pl.ds(row, spec.block_q), h,
                                    pl.ds(part.q_col + col, L.CHUNK)],
            s, scratch.q_loaded.at[wg])

    if skip_keyless:
      pl.when(item_hi > item_lo)(copies)
    else:
      copies()

  def q_tiles():
    """This warpgroup's Q buffers, for a KV tile's Q.K. With ``KernelSpec.q_per_tile``
    through an index LLVM cannot see through (the warpgroup's, ``primitives.opaque``), so
    that the matrix products' Q descriptors are made again in each tile instead of held
    in 16 registers across the KV loop."""
    if not spec.q_per_tile:
      return own["q"]
    wg_now = primitives.opaque(wg)
    return [tiled.at[wg_now] for _, tiled in scratch.q]

  def run(hw, base, fetch_next, u):
    item = read_item(spec, refs, units, hw, base)
    def wait_q():
      plgpu.barrier_wait(scratch.q_loaded.at[wg])
      if spec.scaled_q:
        scale_q(spec, own["q"])

    if skip_keyless:
      # The barrier's phase lives in shared memory and moves only with a wait: skipping
      # the copy and the wait together keeps the next unit's wait on its own copy.
      pl.when(item.item_hi > item.item_lo)(wait_q)
    else:
      wait_q()
    turns = Turns(spec, wg)
    carry = attend_item(spec, refs, scratch, units, turns, item, q_tiles, own["p"])
    turns.end()
    # The matrix products are done with this Q: the next item's loads while this one is
    # written out.
    has_next, next_hw = fetch_next()
    pl.when(has_next)(lambda: load_q(next_hw))
    epilogue(spec, refs, item, carry, own["o"], own["lse"])
    if spec.zero_stores:
      store_zero_jobs(spec, refs, units, wg, u, zeros)
    return base + item.item_hi - item.item_lo

  units.for_each_unit(run, load_q, units.take)
  plgpu.wait_smem_to_gmem(0)


def scale_q(spec: KernelSpec, q_smem):
  """Soft-capped scores (``KernelSpec.scaled_q``): this warpgroup's Q tile times
  scale / cap in place, rounded to its dtype (bf16) once per unit, so that Q.K is tanh's
  argument (``scaled_scores``); fenced for the matrix products, which read it through
  the async proxy. The unit's loads are done, and the next unit's wait until its
  products are."""
  factor = spec.scale / spec.soft_cap  # (both times log2(e))
  for qs in q_smem:
    qs[...] = (qs[...].astype(jnp.float32) * factor).astype(qs.dtype)
  plgpu.commit_smem()


def read_item(spec: KernelSpec, refs: Refs, units: Units, hw, base) -> Item:
  """The unit's row of the work list, as the compute warpgroup needs it (``Item``); FP8:
  its sequence's scales (the logits' times the softmax scale and log2(e))."""
  h, w, meta, item_lo, item_hi, half = units.item_of(hw)
  kv_start, kv_len = meta(L.KV_START), meta(L.KV_LEN)
  kv_row, kv_last = meta(L.KV_ROW), meta(L.KV_LAST)
  q_start, q_len = meta(L.Q_START), meta(L.Q_LEN)
  col = lambda j: meta(L.WG_COLS + 4 * half + j)  # noqa: E731
  t_lo, u_lo, u_hi, t_hi = col(0), col(1), col(2), col(3)
  row = first_q_row(meta, half, spec.block_q)
  first, n_rows = stored_rows(q_start, q_len, row, spec.block_q)
  start_pos = 0 if spec.top_left else kv_len - q_len
  row_pos = start_pos + row - q_start  # position of the row `row`
  scales = {}
  if spec.fp8:
    kv_head = lax.div(h, jnp.int32(spec.group))
    # (The rows past the last offset are one more "sequence", keyless: clamped.)
    seq = jnp.minimum(meta(L.meta_cols(spec.wgs)), refs.qk_scale.shape[0] - 1)
    qk_scale = refs.qk_scale[seq, kv_head] * spec.scale
    if spec.fold_fp8:
      # Folded into the exponent, the factor must be positive, for the row maximum to
      # commute with it (the call refuses scales <= 0 where they are concrete; a traced
      # one is clamped, as garbage offsets are): a normal float, since -inf (a masked
      # score) times 0 is NaN.
      qk_scale = jnp.maximum(qk_scale, FP32_TINY)
    scales = dict(qk_scale=qk_scale, v_scale=refs.v_scale[seq, kv_head])
  return Item(h=h, w=w, half=half, item_lo=item_lo, item_hi=item_hi, t_lo=t_lo, u_lo=u_lo,
              u_hi=u_hi, t_hi=t_hi, row=row, first=first, n_rows=n_rows, row_pos=row_pos,
              kv_start=kv_start, kv_len=kv_len, kv_row=kv_row, kv_last=kv_last, base=base,
              all_heads=hw[0] == ALL_HEADS, **scales)


def attend_item(spec, refs, scratch, units, turns, item: Item, q_tiles, p_smem):
  """The KV loop of one unit: skipped tiles (the item's, outside this warpgroup's range),
  masked tiles, unmasked ones, masked ones, skipped ones. Returns (acc, m, l); FP8: m is
  the running maximum less P_BIAS, l carries 2**P_BIAS."""
  m_i, l_i = initial_rows(spec, refs, item.h)
  # One accumulator per 64 columns of V: P.V is one matrix product per V buffer.
  acc = tuple(zero_chunk(spec) for _ in scratch.v)
  turns.start()
  slot = lambda i: units.slot_of(i, item.base, item.item_lo)  # noqa: E731

  def skip(i, carry):
    plgpu.barrier_wait(scratch.k_loaded.at[slot(i)])
    plgpu.barrier_arrive(scratch.k_consumed.at[slot(i)])
    turns.qk_issued()
    turns.pv_turn(lambda: plgpu.barrier_wait(scratch.v_loaded.at[slot(i)]))
    plgpu.barrier_arrive(scratch.v_consumed.at[slot(i)])
    return carry

  def step(i, carry, *, masked, width=None):
    return attend_tile(spec, scratch, turns, item, q_tiles(), p_smem, i, slot, carry,
                       masked=masked, width=width)

  masked_step = functools.partial(step, masked=True)
  lax.fori_loop(item.item_lo, item.t_lo, skip, None)
  carry = (acc, m_i, l_i)
  carry = lax.fori_loop(item.t_lo, item.u_lo, masked_step, carry)
  carry = lax.fori_loop(item.u_lo, item.u_hi, functools.partial(step, masked=False), carry)
  end = item.t_hi
  if spec.narrow_tiles:
    # The last masked tile (if there is one) as its first half where that holds every
    # key this warpgroup's rows see there: a loop of zero or one trip after the others,
    # not a branch (one more copy of the tile's code, not two).
    end = item.t_hi - jnp.where((item.u_hi < item.t_hi) & narrow_last(spec, item), 1, 0)
  carry = lax.fori_loop(item.u_hi, end, masked_step, carry)
  if spec.narrow_tiles:
    carry = lax.fori_loop(end, item.t_hi, functools.partial(
        step, masked=True, width=spec.block_kv // 2), carry)
  lax.fori_loop(item.t_hi, item.item_hi, skip, None)
  return carry


def narrow_last(spec, item: Item):
  """Whether the warpgroup's rows see no key in the second half of its last KV tile
  (t_hi - 1): the keys its last row sees end (``masks``' ``key_range``, whose end grows
  with the query's position, so the other rows' end no later) within ``block_kv / 2``
  keys of the tile's first. Rows of a neighbour in the warpgroup's tile are not stored,
  so what they see does not matter. The tile's second half then adds exact zeros to the
  row sums and to P.V, so running its first half alone changes no bit
  (``MosaicOptions.narrow_last_tile``; ``tests/test_mosaic.py``'s emulated schedule
  asserts the hidden half, ``tests/test_gpu.py`` the bits)."""
  unit = dict(block_kv=spec.block_kv, unit=spec.kv_unit)
  k0 = tile_first_row(item.kv_row, item.kv_last, item.t_hi - 1, **unit) - item.kv_start
  _, hi = spec.mask.key_range(item.row_pos + spec.block_q - 1)  # (the last row's)
  return jnp.minimum(hi, item.kv_len) - k0 <= spec.block_kv // 2


def initial_rows(spec, refs, h):
  """The running maximum and sum of head h's rows before any key ([block_q] float32 each):
  the sink's (FP8: with P_BIAS), or none."""
  if spec.has_sink and spec.fp8:
    m0, l0 = refs.sink[h] * LOG2_E - P_BIAS, float(2 ** P_BIAS)
  elif spec.fixed_max is not None and spec.has_sink:
    # The larger of the two: the sink's term at most 1; the keys' terms below
    # 2**-FIXED_MAX_FLOOR that then flush to zero are negligible against it.
    sink = refs.sink[h] * LOG2_E
    m0 = jnp.maximum(sink, spec.fixed_max)
    l0 = jnp.exp2(sink - m0)
  elif spec.fixed_max is not None:
    m0, l0 = spec.fixed_max, 0.0
  elif spec.has_sink:
    m0, l0 = refs.sink[h] * LOG2_E, 1.0
  else:
    m0, l0 = MASK_VALUE, 0.0
  layout = plgpu.Layout.WGMMA.reduce(1)
  return tuple(plgpu.layout_cast(jnp.full((spec.block_q,), x, jnp.float32), layout)
               for x in (m0, l0))


def zero_chunk(spec):
  """A [block_q, 64] float32 accumulator of zeros."""
  return plgpu.layout_cast(jnp.zeros((spec.block_q, L.CHUNK), jnp.float32),
                           plgpu.Layout.WGMMA)


def attend_tile(spec, scratch, turns, item: Item, q_smem, p_smem, i, slot, carry, *,
                masked, width=None):
  """KV tile i of the online softmax: (acc, m, l) -> (acc, m, l); slot(i) is its K/V
  slot. width: the tile's first ``width`` keys only (``narrow_last``), else all."""
  acc, m_i, l_i = carry
  s = qk_scores(spec, scratch, turns, q_smem, i, slot, width=width)
  s, fold = scaled_scores(spec, item, s)
  if masked:
    s = mask_scores(spec, item, i, s)
  acc, l_i, m_new, p = online_softmax(spec, s, acc, m_i, l_i, fold=fold)
  if spec.fp8:
    assert width is None, width  # (``KernelSpec.narrow_tiles``)
    acc, l_i, m_new = pv_fp8(spec, scratch, turns, i, slot, acc, l_i, m_new, p, p_smem)
  else:
    acc, l_i, m_new = pv(spec, scratch, turns, i, slot, acc, l_i, m_new, p, width=width)
  return acc, m_new, l_i


def first_keys(buf, width):
  """A K/V slot's first ``width`` rows (all where width is None)."""
  return buf if width is None else buf.at[pl.ds(0, width)]


def scaled_scores(spec, item: Item, s):
  """The scores of a tile in base-2 logit units, but for one positive factor, ``fold``,
  left to the exponent's fused multiply-add (``online_softmax``; None: none left):
  (scores, fold). The row maximum commutes with a positive factor: the scale where it is
  positive, and with a soft cap the cap itself (tanh(s * scale / cap), then times cap
  in the exponent: one FMUL, one MUFU tanh, one FFMA per score; with
  ``KernelSpec.scaled_q`` Q holds scale / cap already, and the FMUL is gone). FP8's
  factor is the item's (traced: ``Item.qk_scale``), folded where ``KernelSpec.fold_fp8``
  (then clamped positive)."""
  if spec.fold_fp8:
    return s, item.qk_scale
  if spec.fp8:
    s = s * item.qk_scale
  elif spec.scaled_q:  # Q already times scale / cap (``scale_q``)
    return jnp.tanh(s), spec.soft_cap
  elif spec.fold_scale and spec.soft_cap is not None:
    # Mosaic GPU's approx_math makes this one tanh.approx.f32 (relative error ~2^-11): the
    # exact exp2 form (``logits.soft_capped``) costs two more MUFU operations per score,
    # 1.4x the kernel's time on the H200 (BUILD_NOTES.md), where the one exp2 per score
    # already loads that unit to about half the tensor cores' time.
    return jnp.tanh(s * (spec.scale / spec.soft_cap)), spec.soft_cap
  elif spec.fold_scale and spec.scale > 0:
    return s, spec.scale
  else:
    s = s * spec.scale
  if spec.soft_cap is not None:  # FP8, or fold_scale=False
    s = jnp.tanh(s * (1.0 / spec.soft_cap)) * spec.soft_cap
  return s, None


def qk_scores(spec, scratch, turns, q_smem, i, slot, width=None):
  """S = Q.K^T of KV tile i (float32 [block_q, block_kv], or its first ``width``
  columns, unscaled), one matrix product per 64-column chunk; releases its K slot."""
  plgpu.barrier_wait(scratch.k_loaded.at[slot(i)])

  def qk(acc_ref):
    for qs, (_, ks) in zip(q_smem, scratch.k):
      plgpu.wgmma(acc_ref, qs, first_keys(ks.at[slot(i)], width).transpose((1, 0)))
    turns.qk_issued()
    return acc_ref[...]

  s = pl.run_scoped(qk, plgpu.ACC((spec.block_q, width or spec.block_kv), jnp.float32))
  plgpu.barrier_arrive(scratch.k_consumed.at[slot(i)])
  return s


def mask_scores(spec, item: Item, i, s):
  """-inf where the mask hides a (query, key) pair of tile i, or the key is not the
  sequence's or an earlier tile had it (``visible_keys``); with
  ``KernelSpec.column_mask`` by each row's run of visible columns (``visible_columns``,
  ``primitives.mask_columns``)."""
  unit = dict(block_kv=spec.block_kv, unit=spec.kv_unit)
  k0 = tile_first_row(item.kv_row, item.kv_last, i, **unit) - item.kv_start
  if spec.column_mask:
    rows = jax.ShapeDtypeStruct((spec.block_q,), jnp.int32)
    if all(b.shape == () for b in jax.eval_shape(spec.mask.key_range, rows)):
      q_pos = item.row_pos  # (no row iota that nothing reads: layout inference fails)
    else:
      q_pos = item.row_pos + plgpu.broadcasted_iota(
          jnp.int32, (spec.block_q,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
    lo, hi = visible_columns(spec.mask, q_pos, k0, i, item.kv_row, item.kv_start,
                             item.kv_len, **unit)
    return primitives.mask_columns(s, None if spec.column_lo_dropped else lo, hi)
  iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, s.shape,
                           layout=plgpu.Layout.WGMMA)
  visible = visible_keys(spec.mask, item.row_pos + iota(0), k0 + iota(1), i, item.kv_row,
                         item.kv_start, item.kv_len, **unit)
  return jnp.where(visible, s, -jnp.inf)


def online_softmax(spec, s, acc, m_i, l_i, *, fold):
  """The running maximum and the tile's probabilities (base 2; where ``fold`` is not
  None, the scores' last factor ``scaled_scores`` left, folded into the exponent: one
  FFMA per score); the accumulators and the running sum rescaled to the new maximum
  (with ``KernelSpec.fixed_max``, soft-capped scores, the maximum stays m_i: no rescale).
  Returns (acc, l, m_new, p) (p float32). FP8 (its fold the item's traced
  factor): the maximum kept is P_BIAS less, so that P is 2**P_BIAS times its value (at
  most 256)."""
  if spec.fp8 and fold is not None:
    # (the item's factor, clamped to a positive normal float: ``read_item``)
    m_new = jnp.maximum(m_i, s.max(axis=1) * fold - P_BIAS)
    p = primitives.exp2_fma(s, fold, lax.broadcast_in_dim(-m_new, s.shape, [0]))
  elif spec.fp8:
    m_new = jnp.maximum(m_i, s.max(axis=1) - P_BIAS)
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
  elif fold is not None and spec.fixed_max is not None:
    # Soft-capped scores: the maximum is fixed (``fixed_maximum``), so no row maximum,
    # no rescale of the accumulators and the running sum.
    p = primitives.exp2_fma(s, fold, lax.broadcast_in_dim(-m_i, s.shape, [0]))
    return acc, l_i, m_i, p
  elif fold is not None:
    m_new = jnp.maximum(m_i, s.max(axis=1) * fold)
    p = primitives.exp2_fma(s, fold, lax.broadcast_in_dim(-m_new, s.shape, [0]))
  else:
    m_new = jnp.maximum(m_i, s.max(axis=1))
    p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
  alpha = jnp.exp2(m_i - m_new)
  acc = tuple(a * lax.broadcast_in_dim(alpha, a.shape, [0]) for a in acc)
  l_i = l_i * alpha
  return acc, l_i, m_new, p


def pv_fp8(spec, scratch, turns, i, slot, acc, l_i, m_new, p, p_smem):
  """FP8's acc += P.V of KV tile i: P quantized to e4m3, then one product per 64 columns
  of V from V^T, in this warpgroup's turn; releases its V slot. P is the A operand from
  registers with ``KernelSpec.p_registers`` (``primitives.fp8_a_operand``: its columns
  relabelled, V^T's keys in that order), else from this warpgroup's shared-memory buffer
  (the accumulator's layout is not an FP8 A operand's), stored and fenced per tile (the
  previous tile's products are done, their accumulators read: the buffer is free).
  A tile of more than ``layout.VT_GROUP`` keys (P from registers) is one product per
  V^T buffer of that many keys, each with its columns of P. Returns (acc, l, m_new)."""
  l_i = l_i + p.sum(axis=1)
  groups = L.vt_groups(spec.block_kv)
  if spec.p_registers:
    p8 = p.astype(spec.dtype)
    a = [primitives.fp8_a_operand(p8, group=g, groups=groups) for g in range(groups)]
    if groups > 1:
      # Every operand's registers defined before the first product issues: ``plgpu.wgmma``
      # fences its own A operand only, and a later operand's registers defined between
      # two issues serialize every matrix product of the kernel (ptxas C7513).
      a = list(lax.optimization_barrier(tuple(a)))
  else:
    assert groups == 1, spec.block_kv  # (``unsupported_reason``)
    p_smem[...] = p.astype(p_smem.dtype)
    plgpu.commit_smem()
    a = [p_smem]
  turns.pv_turn(lambda: plgpu.barrier_wait(scratch.v_loaded.at[slot(i)]))

  def products(acc_refs):
    for acc_ref, (_, vts) in zip(acc_refs, scratch.v):
      for g, a_g in enumerate(a):
        plgpu.wgmma(acc_ref, a_g, vts.at[slot(i) * groups + g].transpose((1, 0)))

  acc = pl.run_state(products)(tuple(plgpu.ACC.init(a) for a in acc))
  plgpu.barrier_arrive(scratch.v_consumed.at[slot(i)])
  return acc, l_i, m_new


def pv(spec, scratch, turns, i, slot, acc, l_i, m_new, p, width=None):
  """acc += P.V of KV tile i (P float32, converted to the input dtype here), one product
  per 64 columns of V, in this warpgroup's turn; releases its V slot. The row sums join
  the running sum before the turn up to V depth 128 (kept there by an optimization
  barrier, which the new maximum passes through too), after it beyond (register
  pressure); with ``KernelSpec.row_sum_first`` before P's conversion, so that each
  float32 of P dies as it is converted. width: P's columns, V's first rows (``None``:
  the tile's). Returns (acc, l, m_new)."""
  if spec.v_depth <= 128:
    if spec.row_sum_first:
      l_i = l_i + p.sum(axis=1)
      p16 = p.astype(spec.dtype)
    else:
      p16 = p.astype(spec.dtype)
      l_i = l_i + p.sum(axis=1)
    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
    turns.pv_turn(lambda: plgpu.barrier_wait(scratch.v_loaded.at[slot(i)]))
  else:
    p16 = p.astype(spec.dtype)
    turns.pv_turn(lambda: plgpu.barrier_wait(scratch.v_loaded.at[slot(i)]))
    l_i = l_i + p.sum(axis=1)

  def products(acc_refs):
    for acc_ref, (_, vs) in zip(acc_refs, scratch.v):
      plgpu.wgmma(acc_ref, p16, first_keys(vs.at[slot(i)], width))

  acc = pl.run_state(products)(tuple(plgpu.ACC.init(a) for a in acc))
  plgpu.barrier_arrive(scratch.v_consumed.at[slot(i)])
  return acc, l_i, m_new


def epilogue(spec, refs, item: Item, carry, o_smem, lse_smem):
  """Stores the unit's rows: ``store_unit``, or for a key-less item's unit for all heads
  (``KernelSpec.keyless_apart``) ``store_zeros``."""
  if not spec.keyless_apart:
    store_unit(spec, refs, item, carry, o_smem, lse_smem)
    return
  pl.when(item.all_heads)(lambda: store_zeros(spec, refs, item, o_smem, lse_smem))
  pl.when(jnp.logical_not(item.all_heads))(
      lambda: store_unit(spec, refs, item, carry, o_smem, lse_smem))


def row_lse(m_i, l_i):
  """The rows' LSE (natural log) from the base-2 running maximum and sum; the empty-row
  value where the sum is 0 (no key, no sink)."""
  seen = l_i > 0
  return jnp.where(seen, (m_i + jnp.log2(jnp.where(seen, l_i, 1.0))) * LN_2, EMPTY_ROW_LSE)


def lse_slot(spec, refs, item: Item, h):
  """Head h's part of the unit's slot in the per-item LSE buffer."""
  return refs.lse.at[h, pl.ds((item.w * spec.wgs + item.half) * spec.block_q,
                              spec.block_q)]


def store_zeros(spec, refs, item: Item, o_smem, lse_smem):
  """A key-less item's unit for all heads: the LSE of every head's rows (the sink's, or
  the empty-row value), then zeros, written once into the output buffers, stored to
  every head's rows [first, first + n_rows). The stores are left in flight: the next
  unit's epilogue waits for them to have read the buffers."""
  if spec.has_lse:
    @pl.loop(0, spec.num_heads)
    def _lse(h):
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last LSE store read
      lse_smem[...] = row_lse(*initial_rows(spec, refs, h))
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(lse_smem, lse_slot(spec, refs, item, h))

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores read
  zero = zero_chunk(spec).astype(spec.out_dtype)
  for buf in o_smem:
    buf[...] = zero
  plgpu.commit_smem()

  @pl.loop(0, spec.num_heads)
  def _heads(h):
    for g in range(0, spec.v_depth // L.CHUNK, len(o_smem)):
      store_rows(spec, refs, item, o_smem, g, h=h)


def store_zero_jobs(spec, refs, units: Units, wg, u, zeros=None):
  """``KernelSpec.zero_stores``: unit u's zero jobs (``schedule.zero_jobs``; none for a
  key-less unit, which runs only where no unit has KV tiles): for each, zeros into this
  warpgroup's rows of the job's key-less item on the job's head, by plain stores
  (``primitives.store_zero_rows``) that stay in flight while the next unit computes;
  "spans" and "bulk": this warpgroup's span of the item's rows across heads
  (``zero_span``), "bulk" copied by the TMA unit from ``zeros`` (``Scratch.zeros``;
  ``primitives.copy_zero_slices``). (Reading the first four jobs' rows
  before the epilogue, all at once, lost on the H200: BUILD_NOTES.md, thirty-seventh
  session.)"""
  count, stride = zero_jobs(u, num_heads=spec.num_heads, n_keyed=units.n_keyed,
                            n_keyless=units.n_keyless)

  @pl.loop(0, count)
  def _job(m):
    h, w = zero_job(u + m * stride, num_heads=spec.num_heads, n_keyed=units.n_keyed)
    meta = lambda col: refs.meta[w, col]  # noqa: E731
    if spec.keyless_units in ("spans", "bulk"):
      row, first, n = zero_span(meta, h, wg, wgs=spec.wgs, block_q=spec.block_q,
                                num_heads=spec.num_heads, total_rows=refs.o.shape[0])
      if spec.zero_bulk:
        primitives.copy_zero_slices(refs.o, zeros, row, first, n, max_slices=spec.block_q)
      else:
        primitives.store_zero_slices(refs.o, row, first, n, max_slices=spec.block_q)
    else:
      start, n = zero_rows(meta, wg, spec.block_q, refs.o.shape[0])
      primitives.store_zero_rows(refs.o, start, n, h, max_rows=spec.block_q)


def zero_rows(meta, half, block_q, total_rows):
  """(start, n): the rows [start, start + n) that half ``half`` of an item stores
  (``stored_rows``, as ``read_item``), given its work-list row ``meta``, cut at
  ``total_rows`` (a valid table has no row past it; plain stores are not clipped as
  TMA's are)."""
  row = first_q_row(meta, half, block_q)
  first, n_rows = stored_rows(meta(L.Q_START), meta(L.Q_LEN), row, block_q)
  start = row + first
  return start, jnp.clip(jnp.minimum(n_rows, total_rows - start), 0, block_q)


def zero_span(meta, piece, wg, *, wgs, block_q, num_heads, total_rows):
  """``keyless_units="spans"``: (row, first, n): warpgroup wg's part of piece ``piece``
  (0 to num_heads - 1) of a key-less item (work-list row ``meta``), as head slices (one
  head's row, [depth] of the output [rows, heads, depth]) [first, first + n) counted
  from row ``row``'s first. The item's stored rows (``stored_rows`` of its wgs *
  block_q rows, cut at ``total_rows``), all heads, are one contiguous run of slices; it
  is cut into num_heads * wgs parts of block_q slices each (the same count as a head's
  rows of one warpgroup, ``zero_rows``), part piece * wgs + wg is this one's."""
  row0 = first_q_row(meta, 0, block_q)
  first, n_rows = stored_rows(meta(L.Q_START), meta(L.Q_LEN), row0, wgs * block_q)
  row = row0 + first
  n_rows = jnp.clip(jnp.minimum(n_rows, total_rows - row), 0, wgs * block_q)
  lo = (piece * wgs + wg) * block_q
  return row, lo, jnp.clip(n_rows * num_heads - lo, 0, block_q)


def store_unit(spec, refs, item: Item, carry, o_smem, lse_smem):
  """Normalizes the accumulators and stores the unit's rows [first, first + n_rows) of
  the output (and its LSE to the per-item buffer)."""
  acc, m_i, l_i = carry
  seen = l_i > 0
  l_safe = jnp.where(seen, l_i, 1.0)
  # FP8: V's scale multiplies the output (the running sum and m carry P_BIAS, which
  # cancel in the LSE).
  l_out = l_safe / item.v_scale if spec.fp8 else l_safe
  out = [(a / lax.broadcast_in_dim(l_out, a.shape, [0])).astype(spec.out_dtype) for a in acc]
  # The output buffers take len(o_smem) accumulators at a time: all of them, or one
  # (``smem.output_buffers``), refilled once the previous column chunk's stores read it.
  for g in range(0, len(out), len(o_smem)):
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # earlier stores read
    for buf, part in zip(o_smem, out[g:]):
      buf[...] = part
    if spec.has_lse and g == 0:
      lse_smem[...] = row_lse(m_i, l_i)
    plgpu.commit_smem()
    store_rows(spec, refs, item, o_smem, g)
  if spec.has_lse:
    plgpu.copy_smem_to_gmem(lse_smem, lse_slot(spec, refs, item, item.h))


def store_rows(spec, refs, item: Item, o_smem, g, h=None):
  """Row-exact store of rows [first, first + n_rows) of the output buffers (columns
  from chunk g on) to head h's (the item's head by default): one TMA per set bit of
  n_rows, so no store touches a neighbour's rows."""
  h = item.h if h is None else h
  start, size = item.first, spec.block_q
  while size >= 1:
    take = (item.n_rows & size) != 0

    @pl.when(take)
    def _store(start=start, size=size):
      for c, buf in enumerate(o_smem):
        plgpu.copy_smem_to_gmem(
            buf.at[pl.ds(start, size)],
            refs.o.at[pl.ds(item.row + start, size), h, pl.ds((g + c) * L.CHUNK, L.CHUNK)])

    start = start + jnp.where(take, size, 0)
    size //= 2


# --------------------------------------------------------------------------------------
# The producer warpgroup: K and V tiles by TMA into the slots.

def producer_warpgroup(spec: KernelSpec, refs: Refs, scratch: smem.Scratch, units: Units):
  """The producer's role: each unit's K/V tiles into the slots, claiming the next unit
  before it loads this one's tiles (the compute warpgroups then have it when they finish
  this one)."""
  plgpu.set_max_registers(registers(spec)[1], action="decrease")
  tail8, kv_tail = refs.scalars[L.S_TAIL8], refs.scalars[L.S_KV_TAIL]

  def load_item(hw, base, fetch_next, u):
    del u
    fetch_next()
    h, _, meta, item_lo, item_hi, _ = units.item_of(hw)
    kv_head = lax.div(h, jnp.int32(spec.group))
    tile_row = functools.partial(tile_first_row, meta(L.KV_ROW), meta(L.KV_LAST),
                                 block_kv=spec.block_kv, unit=spec.kv_unit)
    paged = None
    if spec.page_size is not None:
      seq = meta(L.meta_cols(spec.wgs))
      paged = (seq, lax.div(jnp.maximum(meta(L.KV_LEN) - 1, 0), jnp.int32(spec.block_kv)))

    slot = lambda i: units.slot_of(i, base, item_lo)  # noqa: E731
    reuse = lambda i: base + i - item_lo >= spec.num_stages  # noqa: E731
    v_free = lambda i: pl.when(reuse(i))(  # noqa: E731
        lambda: plgpu.barrier_wait(scratch.v_consumed.at[slot(i)]))

    @pl.loop(item_lo, item_hi)
    def _load(i):
      pl.when(reuse(i))(lambda: plgpu.barrier_wait(scratch.k_consumed.at[slot(i)]))
      load_kv_tile(spec, refs, scratch, slot(i), tile_row(i), kv_head, i, paged, tail8,
                   kv_tail, before_v=lambda: v_free(i))

    return base + item_hi - item_lo

  units.for_each_unit(load_item, lambda hw: None, units.publish)


def load_kv_tile(spec, refs, scratch, slot, start, kv_head, i, paged, tail8, kv_tail, *,
                 before_v=lambda: None):
  """TMA of KV tile i (first row `start`) into `slot`: K, then (after ``before_v``) V by
  the loader for the layout: FP8's V^T (of the keys' rows, or of a paged sequence's
  positions),
  pages (``paged``: the sequence and its last tile, else None),
  batch-invariant tiles, or aligned ones (``tail8``, ``kv_tail``: the scalars'
  ``S_TAIL8`` and ``S_KV_TAIL``). Each copy is one arrival on the slot's
  ``k_loaded`` / ``v_loaded`` barrier, which ``scratch_for`` sizes to match."""
  copies = (paged_copies(spec, refs, paged[0], start) if paged
            else contiguous_copies(spec, start))
  load_k_tile(spec, refs, scratch, slot, copies, kv_head)
  before_v()
  if spec.fp8:
    # V^T's columns: the keys' rows, or a paged sequence's own (``vt_page_column``)
    col = vt_page_column(refs, paged[0], start) if paged else start
    load_vt_tile(spec, refs, scratch, slot, col, kv_head)
  elif paged:
    load_v_tile_paged(spec, refs, scratch, slot, copies, kv_head, i, *paged)
  elif spec.kv_unit == 1:
    load_v_tile_invariant(spec, refs, scratch, slot, start, kv_head, kv_tail)
  else:
    load_v_tile(spec, refs, scratch, slot, start, kv_head, tail8)


def contiguous_copies(spec, start):
  """copies(x, *idx): the (GMEM view, slot rows) pairs of a contiguous KV tile at row
  `start`: one."""
  return lambda x, *idx: [(x.at[pl.ds(start, spec.block_kv), *idx],  # noqa: E731
                           pl.ds(0, spec.block_kv))]


def paged_copies(spec, refs, seq, start):
  """copies(x, *idx) for a paged KV tile: positions [start, start + block_kv) of sequence
  `seq`, ``spec.pages`` pieces of ``spec.piece`` rows, each inside one page
  (``layout.tile_pages``). The table's page ids are in range; a piece past the table's
  last column (only in the sequence's last tile, past its keys) reads that column's page."""
  def piece_at(j):
    pos = start + j * spec.piece
    col = jnp.minimum(lax.div(pos, jnp.int32(spec.page_size)), refs.table.shape[1] - 1)
    return refs.table[seq, col], lax.rem(pos, jnp.int32(spec.page_size))

  spots = [piece_at(j) for j in range(spec.pages)]
  return lambda x, *idx: [  # noqa: E731
      (x.at[page, pl.ds(row, spec.piece), *idx], pl.ds(j * spec.piece, spec.piece))
      for j, (page, row) in enumerate(spots)]


def load_k_tile(spec, refs, scratch, slot, copies, kv_head):
  """TMA of a K tile into ``slot``: every 64-column chunk of every logit part (a shared
  rope K from its one head)."""
  for (part, col), (ks, _) in zip(spec.chunks, scratch.k):
    k_head = 0 if part.shared_k else kv_head
    for src, rows in copies(refs.k[part.k_index], k_head, pl.ds(part.k_col + col, L.CHUNK)):
      plgpu.copy_gmem_to_smem(src, ks.at[slot].at[rows], scratch.k_loaded.at[slot])


def load_v_tile_paged(spec, refs, scratch, slot, copies, kv_head, i, seq, last_tile):
  """TMA of a paged V tile: from the pages, but the sequence's last tile from ``v_tail``,
  whose rows past the sequence's keys are zeros (stale cache rows may be NaN)."""
  for c, (vs, _) in enumerate(scratch.v):
    cols = pl.ds(c * L.CHUNK, L.CHUNK)

    @pl.when(i == last_tile)
    def _(cols=cols, vs=vs):
      for j in range(spec.pages):
        rows = pl.ds(j * spec.piece, spec.piece)
        plgpu.copy_gmem_to_smem(refs.v_tail.at[seq, rows, kv_head, cols],
                                vs.at[slot].at[rows], scratch.v_loaded.at[slot])

    @pl.when(i != last_tile)
    def _(cols=cols, vs=vs):
      for src, rows in copies(refs.v, kv_head, cols):
        plgpu.copy_gmem_to_smem(src, vs.at[slot].at[rows], scratch.v_loaded.at[slot])


def vt_page_column(refs, seq, start):
  """FP8 pages: the V^T column of position `start` of sequence `seq`, whose keys have
  columns of their own (``operands.transposed_v_pages``: as many per sequence as V^T's
  width over the block table's rows)."""
  return seq * (refs.v.shape[-1] // refs.table.shape[0]) + start


def load_vt_tile(spec, refs, scratch, slot, start, kv_head):
  """FP8: TMA of the V^T tile of keys [start, start + block_kv), one copy per 64 rows of
  V^T (columns of V) and buffer of ``layout.VT_GROUP`` keys (``layout.vt_groups``). V^T's
  columns past the batch's last key are zeros (``operands``)."""
  groups = L.vt_groups(spec.block_kv)
  keys = spec.block_kv // groups
  for c, (fill, _) in enumerate(scratch.v):
    for g in range(groups):
      plgpu.copy_gmem_to_smem(
          refs.v.at[kv_head, pl.ds(c * L.CHUNK, L.CHUNK), pl.ds(start + g * keys, keys)],
          fill.at[slot * groups + g], scratch.v_loaded.at[slot])


def load_v_tile_invariant(spec, refs, scratch, slot, start, kv_head, kv_tail):
  """TMA of a contiguous V tile at row `start` (batch-invariant tiles), one copy per 64
  columns: from V, or, when the tile runs past the batch's last key (row kv_tail - 1),
  from ``v_tail``, rows [kv_tail - block_kv, kv_tail + block_kv) of V with the rows past
  that key zeroed (0 * NaN is NaN), which hold it whole (the tile starts before
  kv_tail)."""
  block_kv = spec.block_kv
  past = start + block_kv > kv_tail
  tail_row = jnp.clip(start - kv_tail + block_kv, 0, block_kv)
  for c, (vs, _) in enumerate(scratch.v):
    cols = pl.ds(c * L.CHUNK, L.CHUNK)

    @pl.when(past)
    def _(vs=vs, cols=cols):
      plgpu.copy_gmem_to_smem(refs.v_tail.at[pl.ds(tail_row, block_kv), kv_head, cols],
                              vs.at[slot], scratch.v_loaded.at[slot])

    @pl.when(jnp.logical_not(past))
    def _(vs=vs, cols=cols):
      plgpu.copy_gmem_to_smem(refs.v.at[pl.ds(start, block_kv), kv_head, cols],
                              vs.at[slot], scratch.v_loaded.at[slot])


def load_v_tile(spec, refs, scratch, slot, start, kv_head, tail8):
  """TMA of a contiguous V tile at row `start`, in two copies per 64 columns: when the
  tile's last 8 rows are the last key's group, they come from ``v_tail``, whose rows past
  that key are zeros (0 * NaN is NaN). When the batch's keys end before the last group of
  the tile at row 0 (every tile is that one), the whole tile comes from ``v_tail``."""
  block_kv = spec.block_kv
  head_tile = (start == 0) & (tail8 < block_kv // 8 - 1)
  for c, (vs, _) in enumerate(scratch.v):
    cols = pl.ds(c * L.CHUNK, L.CHUNK)
    tail = lambda rows, cols=cols: refs.v_tail.at[rows, kv_head, cols]  # noqa: E731

    @pl.when(head_tile)
    def _(vs=vs, tail=tail):
      for rows in (pl.ds(0, block_kv - 8), pl.ds(block_kv - 8, 8)):
        plgpu.copy_gmem_to_smem(tail(rows), vs.at[slot].at[rows], scratch.v_loaded.at[slot])

    @pl.when(jnp.logical_not(head_tile))
    def _(vs=vs, tail=tail, cols=cols):
      primitives.load_rows(lambda rows: refs.v.at[rows, kv_head, cols],
                           tail(pl.ds(block_kv - 8, 8)), block_kv, start, vs.at[slot],
                           scratch.v_loaded.at[slot], tail_group=tail8)

"""The Mosaic GPU backend's work list built on the GPU by one small Mosaic GPU kernel.

``work_list.work_list`` and ``schedule.head_major_order`` compute the per-item table, the
number of items that run and the order of the units in XLA: about 16 small kernels of 2
to 6 us each on the H200, some 50 us a call (MHA short64's whole call is 0.31 ms). This
module computes the same table, bit for bit, and the kernel's scalar operand in one
kernel of one warpgroup (``build``), for the sizes where that is fast (``fits``); XLA's
version stays the reference and serves the rest, where the attention itself takes
milliseconds.

Mosaic GPU's arrays have no gather or scatter, so ``Ops.gather`` and ``Ops.scatter`` index a
shared or global memory ref per element (one load or store per thread and register);
prefix scans are Hillis-Steele rounds through shared memory, and the sort heaviest first
is a bitonic sort of (key, item) packed into one int32 (``MosaicOptions.work_list_shuffles``
moves the exchanges within a thread or a warp out of shared memory: ``Ops``). In
interpret mode (the CPU tests) the same code runs on plain arrays.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir  # pylint: disable=g-direct-tensorflow-import
from jax._src.lib.mlir.dialects import arith, memref, nvvm, vector

from pallas_prefill.mosaic_gpu import layout as L
from pallas_prefill.mosaic_gpu import primitives
from pallas_prefill.mosaic_gpu import schedule
from pallas_prefill.mosaic_gpu import work_list as xla

WARPGROUP = 128
MAX_ITEMS = 1024  # items (rounded up to a power of two) the kernel sorts; beyond, XLA
MAX_SEQS = 1024  # sequences (plus two) the kernel holds; beyond, XLA


def _pow2(n: int) -> int:
  return max(WARPGROUP, 1 << (n - 1).bit_length())


def _round(n: int) -> int:
  return -(-n // WARPGROUP) * WARPGROUP


def sizes(num_items: int, batch: int) -> tuple[int, int]:
  """The kernel's item lanes (a power of two, for the bitonic sort) and sequence lanes."""
  return _pow2(num_items), _round(batch + 2)


def num_columns(seq_column: bool, wgs: int = L.COMPUTE_WGS) -> int:
  """The table's columns: ``layout``'s for ``wgs`` compute warpgroups, plus the item's
  sequence (column ``layout.meta_cols(wgs)``: paged tiles and FP8 read it)."""
  return L.meta_cols(wgs) + (1 if seq_column else 0)


def fits(num_items: int, batch: int, kv_tile_bound: int) -> bool:
  """Whether ``build`` serves a work list of ``num_items`` items over ``batch``
  sequences whose items have at most ``kv_tile_bound`` KV tiles each (the sort packs
  the tile count and the item into one int32)."""
  items, seqs = sizes(num_items, batch)
  return items <= MAX_ITEMS and seqs <= MAX_SEQS and (kv_tile_bound + 2) * items < 2**31


def _layout(n: int):
  return plgpu.Layout.WG_STRIDED((n,), vec_size=1)


def _iota(n: int):
  return plgpu.broadcasted_iota(jnp.int32, (n,), 0, layout=_layout(n))


WARP = 32


def _from_registers(x, regs):
  """A lane array of ``x``'s layout holding the registers ``regs`` (inside ``inline_mgpu``)."""
  return mgpu.FragmentedArray(_registers=np.array(regs).reshape(x.registers.shape),
                              _layout=x.layout, _is_signed=True)


def _map_registers(x, fn):
  """The int32 lanes of ``x`` with each thread's registers (vector<1xi32>, in order)
  replaced by ``fn`` of their list: compiled code that moves values between registers or
  lanes without memory."""
  n = x.shape[0]

  @plgpu.inline_mgpu(arg_types=(_layout(n),),
                     return_type=plgpu.ShapeDtypeStruct((n,), jnp.int32, layout=_layout(n)))
  def mapped(_, a):
    return _from_registers(a, fn(list(a.registers.flat)))

  return mapped(plgpu.layout_cast(x, _layout(n)))


def _each_value(regs, fn):
  """``fn`` of each register's int32 value (inside ``_map_registers``' fn)."""
  return [vector.broadcast(reg.type, fn(vector.extract(reg, [], [0]))) for reg in regs]


class Ops:
  """Per-element memory access and the warpgroup barrier, compiled (``inline_mgpu``) or
  in interpret mode (plain arrays).

  With ``shuffles`` (``MosaicOptions.work_list_shuffles``), exchanges between lanes that
  one thread holds (lanes a multiple of 128 apart: the thread's registers) or one warp
  holds (lanes fewer than 32 apart in one register) skip shared memory and its two
  barriers: the sort's steps become register relabellings and warp butterflies, and the
  scans run in two levels (``_segmented_scan``: warp shuffles, then each warp segment's
  carry from the segments' totals, two barriers in all). Lane i of an ``_layout(n)``
  array is register i // 128 of thread i % 128 (``WG_STRIDED`` with one element a
  register), so a warp's segment is lanes [32 s, 32 s + 32); interpret mode runs the same
  exchanges on that view of the lanes."""

  def __init__(self, interpret: bool, shuffles: bool = False):
    self.interpret = interpret
    self.shuffles = shuffles

  def gather(self, ref, idx):
    """ref[idx] for a 1-D int32 ref (shared or global memory) and int32 indices."""
    if self.interpret:
      return ref[...][idx]
    n = idx.shape[0]
    idx = plgpu.layout_cast(idx, _layout(n))  # (a constant's layout is a splat)

    @plgpu.inline_mgpu(arg_types=(primitives.read_only_ref(), _layout(n)),
                       return_type=plgpu.ShapeDtypeStruct((n,), jnp.int32,
                                                          layout=_layout(n)))
    def load(_, r, ix):
      index = ir.IndexType.get()
      regs = []
      for reg in ix.registers.flat:
        i = arith.index_cast(index, vector.extract(reg, [], [0]))
        x = memref.load(r, [i])
        regs.append(vector.broadcast(ir.VectorType.get((1,), x.type), x))
      return mgpu.FragmentedArray(_registers=np.array(regs).reshape(ix.registers.shape),
                                  _layout=ix.layout, _is_signed=True)

    return load(ref, idx)

  def scatter(self, ref, idx, val):
    """ref[idx] = val; where indices repeat, one of their values lands."""
    if self.interpret:
      ref[...] = ref[...].at[idx].set(val)
      return
    n = idx.shape[0]
    idx, val = (plgpu.layout_cast(x, _layout(n)) for x in (idx, val))

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), _layout(n), _layout(n)))
    def store(_, r, ix, v):
      index = ir.IndexType.get()
      for reg, x in zip(ix.registers.flat, v.registers.flat):
        i = arith.index_cast(index, vector.extract(reg, [], [0]))
        memref.store(vector.extract(x, [], [0]), r, [i])

    store(ref, idx, val)

  def sync(self):
    """All of the warpgroup's shared-memory stores before it visible to its loads after."""
    if self.interpret:
      return

    @plgpu.inline_mgpu()
    def bar(_):
      mgpu.utils.warpgroup_barrier()

    bar()

  def scan(self, x, buf, op, identity):
    """Inclusive prefix scan of x (n lanes) with ``op`` (``jnp.add`` or ``jnp.maximum``);
    ``buf`` holds 2n int32."""
    n = x.shape[0]
    lane = _iota(n)
    if self.shuffles:
      return self._segmented_scan(x, lane, buf, op, identity)
    self.scatter(buf, lane, lane * 0 + identity)
    k = 1
    while k < n:
      self.scatter(buf, lane + n, x)
      self.sync()
      x = op(x, self.gather(buf, lane + n - k))
      self.sync()
      k *= 2
    return x

  def _segmented_scan(self, x, lane, buf, op, identity):
    """``scan`` in two levels: each warp's 32 lanes of a register (a segment) by warp
    shuffles, then each lane combined with the segments before its own, whose totals
    (the segments' last lanes) go through shared memory once: two barriers instead of two
    a doubling round."""
    k = 1
    while k < WARP:  # lane i - k within the segment, else the identity
      x = op(x, jnp.where(lax.rem(lane, WARP) >= k, self._shuffle_up(x, k), identity))
      k *= 2
    segments = x.shape[0] // WARP
    last = lax.rem(lane, WARP) == WARP - 1  # (the other lanes write one spare slot)
    self.scatter(buf, jnp.where(last, lax.div(lane, WARP), segments), x)
    self.sync()
    carry = self._segment_carries(x, buf, segments, op, identity)
    self.sync()
    return op(carry, x)

  def _shuffle_up(self, x, k):
    """Each lane's ``x`` k lanes down its segment (``shfl.sync.up``; the segment's first k
    lanes get their own)."""
    n = x.shape[0]
    if self.interpret:
      seg = x.reshape(n // WARP, WARP)
      return jnp.concatenate([seg[:, :k], seg[:, :WARP - k]], axis=1).reshape(n)

    def up(value):
      i32 = ir.IntegerType.get_signless(32)
      return nvvm.shfl_sync(arith.constant(i32, -1), value, arith.constant(i32, k),
                            arith.constant(i32, 0), nvvm.ShflKind.up)

    return _map_registers(x, lambda regs: _each_value(regs, up))

  def _segment_carries(self, x, buf, segments, op, identity):
    """Each lane's ``op`` of the totals (``buf[:segments]``) of the segments before its
    own (segment i // 32), ``identity`` for the first; ``x`` gives the layout."""
    n = x.shape[0]
    if self.interpret:
      totals = buf[...][:segments]
      before = jnp.concatenate([jnp.full((1,), identity, jnp.int32), totals[:-1]])
      cumulative = (jnp.cumsum(before) if op is jnp.add
                    else lax.cummax(before, axis=0))
      return jnp.repeat(cumulative, WARP)
    x = plgpu.layout_cast(x, _layout(n))
    combine = {id(jnp.add): arith.addi, id(jnp.maximum): arith.maxsi}[id(op)]

    @plgpu.inline_mgpu(arg_types=(primitives.read_only_ref(), _layout(n)),
                       return_type=plgpu.ShapeDtypeStruct((n,), jnp.int32, layout=_layout(n)))
    def carries(_, totals, a):
      # Thread t's register r holds lanes 128 r + t: segment 4 r + w, w = t's warp (0-3).
      i32, index = ir.IntegerType.get_signless(32), ir.IndexType.get()
      warps = WARPGROUP // WARP
      w = arith.remui(mgpu.utils.warp_idx(sync=False), arith.constant(i32, warps))
      running = arith.constant(i32, identity)
      found = [running] * (segments // warps)
      for seg in range(segments):  # every thread reads every total (one address a load)
        r, sw = divmod(seg, warps)
        found[r] = arith.select(arith.cmpi(arith.CmpIPredicate.eq, w,
                                           arith.constant(i32, sw)), running, found[r])
        running = combine(running, memref.load(totals, [arith.constant(index, seg)]))
      return _from_registers(a, [vector.broadcast(reg.type, v)
                                 for reg, v in zip(a.registers.flat, found)])

    return carries(buf, x)

  def in_thread_or_warp(self, j):
    """Whether ``xor`` exchanges lanes j apart without shared memory."""
    return self.shuffles and (j >= WARPGROUP or j < WARP)

  def xor(self, v, j):
    """Each lane i's ``v[i ^ j]``, where ``in_thread_or_warp(j)`` (j a power of two)."""
    if j >= WARPGROUP:
      s = j // WARPGROUP
      return self._registers(v, [r ^ s for r in range(v.shape[0] // WARPGROUP)])
    return self._shuffle_xor(v, j)

  def _registers(self, x, sources):
    """The lanes of ``x`` with each thread's register r replaced by its register
    ``sources[r]``."""
    n = x.shape[0]
    if self.interpret:
      regs = x.reshape(n // WARPGROUP, WARPGROUP)
      return jnp.concatenate([regs[r:r + 1] for r in sources]).reshape(n)
    return _map_registers(x, lambda regs: [regs[r] for r in sources])

  def _shuffle_xor(self, x, j):
    """Each lane i's ``x[i ^ j]`` for j < 32: within the warp (``shfl.sync.bfly``)."""
    n = x.shape[0]
    if self.interpret:  # thread t ^ j: the two halves of each 2j threads swapped
      return jnp.flip(x.reshape(n // WARPGROUP, WARPGROUP // (2 * j), 2, j), 2).reshape(n)
    return _map_registers(
        x, lambda regs: _each_value(regs, lambda value: mgpu.utils.shfl_bfly(value, j)))


def _unit_order(ops, cost, sort_buf, i, n_live, *, n_items, num_heads, group,
                num_programs, skip=0):
  """``schedule.head_major_order`` of the sorted items' costs (``schedule.item_costs``, lane
  i item i): each program's load, one lane per program, a row of dealt units per trip
  (``sort_buf`` is overwritten). Where ``skip`` (an int32 scalar, 0 or 1) is 1, no trip
  runs and the result is 1."""
  ops.scatter(sort_buf, i, cost)
  ops.sync()
  p = _iota(_round(num_programs))
  units = n_live * num_heads
  per_kv_head = jnp.maximum(n_live * group, 1)

  def deal(r, loads):
    by_item, by_kv_head = loads
    # (``schedule.dealt_unit``'s zigzag; arithmetic, as a select on a scalar does not lower)
    u = r * num_programs + p + lax.rem(r, 2) * (num_programs - 1 - 2 * p)
    ok = (p < num_programs) & (u < units)
    u = jnp.where(ok, u, 0)
    item = ops.gather(sort_buf, jnp.clip(lax.div(u, num_heads), 0, n_items - 1))
    head = ops.gather(sort_buf, jnp.clip(lax.div(lax.rem(u, per_kv_head), group), 0,
                                         n_items - 1))
    return by_item + jnp.where(ok, item, 0), by_kv_head + jnp.where(ok, head, 0)

  zero = p * 0
  trips = lax.div(units + num_programs - 1, num_programs) * (1 - skip)
  by_item, by_kv_head = lax.fori_loop(0, trips, deal, (zero, zero))
  worst_item, worst_kv_head = jnp.max(by_item), jnp.max(by_kv_head)
  return jnp.where(schedule.head_major_wins(worst_kv_head, worst_item), 1, 0)


def _dynamic_order(ops, cost, scan_buf, *, num_heads, group, num_programs):
  """``schedule.dynamic_head_major_order`` of the sorted items' costs (one lane per item;
  ``scan_buf`` is overwritten)."""
  before = ops.scan(cost, scan_buf, jnp.add, 0) - cost
  ends = schedule.claimed_order_end(cost, before, num_heads=num_heads, group=group,
                                  num_programs=num_programs)
  return jnp.where(schedule.head_major_wins(*ends), 1, 0)


def _bitonic_sort(ops, v, sort_buf, i, n_items):
  """The lanes' values `v` (one per lane i < n_items, a power of two) sorted ascending
  across lanes, through `sort_buf` (overwritten)."""
  k = 2
  while k <= n_items:
    j = k // 2
    while j >= 1:
      if ops.in_thread_or_warp(j):
        other = ops.xor(v, j)
        low = lax.rem(lax.div(i, j), 2) == 0  # the pair's lower lane
      else:
        ops.scatter(sort_buf, i, v)
        ops.sync()
        low = lax.rem(lax.div(i, j), 2) == 0
        other = ops.gather(sort_buf, jnp.where(low, i + j, i - j))
        ops.sync()
      ascending = lax.rem(lax.div(i, k), 2) == 0
      v = jnp.where(low == ascending, jnp.minimum(v, other), jnp.maximum(v, other))
      j //= 2
    k *= 2
  return v


def _store_table(ops, table_ref, col_bufs, cols, i, *, staged):
  """The table (row i: ``cols``' lane i, lane i item i) into ``table_ref``, row-major. A
  row a lane, a warp's stores touch 32 sectors, a row's width apart; ``staged``
  (``MosaicOptions.work_list_staged_table``): row-major into ``col_bufs`` (shared
  memory, whose columns ``cols`` were read from) first, then copied out in the order of
  its words, lane i storing words c * n + i (n lanes), so that a warp's stores are 32
  consecutive words."""
  n, n_cols = i.shape[0], len(cols)
  if not staged:
    for c, x in enumerate(cols):
      ops.scatter(table_ref, i * n_cols + c, x)
    return
  ops.sync()
  for c, x in enumerate(cols):
    ops.scatter(col_bufs, i * n_cols + c, x)
  ops.sync()
  for c in range(n_cols):
    ops.scatter(table_ref, c * n + i, ops.gather(col_bufs, c * n + i))


def _kernel(*refs, batch, total_q, total_kv, mask, block_q, block_kv, num_items,
            num_heads, group, num_programs, kv_given, paged_cap, page_tiles, dynamic,
            top_left, interpret, kv_align, seq_column, keyless_apart, wgs, shuffles,
            staged_table):
  refs = list(refs)
  q_off_ref = refs.pop(0)
  kv_start_ref, kv_end_ref = (refs.pop(0), refs.pop(0)) if kv_given else (None, None)
  cache_ref = refs.pop(0) if paged_cap is not None else None
  table_ref, scalar_ref = refs
  ops = Ops(interpret, shuffles)
  n_items, n_seqs = sizes(num_items, batch)
  rows = wgs * block_q
  n_cols = num_columns(seq_column, wgs)
  clip = jnp.clip

  def body(seq_bufs, scan_buf, mark, col_bufs, sort_buf):
    # Each sequence's ranges, one lane per sequence b; b == batch is the pseudo-sequence
    # of the rows past offsets[-1] (no keys), lanes past it have no rows.
    b = _iota(n_seqs)
    q_off = lambda i: clip(ops.gather(q_off_ref, clip(i, 0, batch)), 0, total_q)  # noqa: E731
    q_end = ops.scan(q_off(b + 1), scan_buf, jnp.maximum, 0)
    ops.scatter(seq_bufs[0], b, q_end)
    ops.sync()
    q_start = jnp.where(b == 0, 0, ops.gather(seq_bufs[0], clip(b - 1, 0, n_seqs - 1)))
    ops.sync()
    q_start = jnp.where(b > batch, total_q, q_start)
    q_end = jnp.where(b >= batch, total_q, q_end)
    if paged_cap is not None:
      cache = clip(ops.gather(cache_ref, clip(b, 0, batch - 1)), 0, paged_cap)
      kv_start = b * (0 if page_tiles else paged_cap)
      kv_end = kv_start + jnp.minimum(cache + q_end - q_start, paged_cap)
    elif kv_given:
      seq = clip(b, 0, batch - 1)
      kv_start = clip(ops.gather(kv_start_ref, seq), 0, total_kv)
      kv_end = clip(ops.gather(kv_end_ref, seq), kv_start, total_kv)
    else:
      kv_start, kv_end = q_start, q_end
    # The batch's last key: the largest end (a running maximum, read at the last lane).
    kv_max = ops.scan(jnp.where(b < batch, kv_end, 0), scan_buf, jnp.maximum, 0)
    kv_tail = jnp.sum(jnp.where(b == batch - 1, kv_max, 0))
    kv_start = jnp.where(b >= batch, 0, kv_start)
    kv_end = jnp.where(b >= batch, 0, kv_end)
    q_first = L.floor8(q_start)
    tiles = jnp.where(q_end > q_start, lax.div(q_end - q_first + rows - 1, rows), 0)
    first = ops.scan(tiles, scan_buf, jnp.add, 0) - tiles
    n_live_items = jnp.sum(tiles)
    per_seq = (q_start, q_end - q_start, kv_start, kv_end - kv_start, q_first, first)
    for buf, x in zip(seq_bufs, per_seq):
      ops.scatter(buf, b, x)

    # Each item's sequence: the last sequence that starts at or before it (sequences
    # with items start at distinct items), one lane per item.
    i = _iota(n_items)
    ops.scatter(mark, i, i * 0)
    ops.sync()
    ops.scatter(mark, jnp.where(tiles > 0, first, n_items), b)
    ops.sync()
    seq = ops.scan(ops.gather(mark, i), scan_buf, jnp.maximum, 0)
    live = i < n_live_items
    i_q_start, i_q_len, i_kv_start, i_kv_len, i_q_first, i_first = (
        jnp.where(live, ops.gather(buf, seq), 0) for buf in seq_bufs)
    row = jnp.where(live, i_q_first + (i - i_first) * rows, 0)
    cols = xla.item_columns(i_q_start, i_q_len, i_kv_start, i_kv_len, row, mask=mask,
                            block_q=block_q, block_kv=block_kv, page_tiles=page_tiles,
                            top_left=top_left, kv_align=kv_align, wgs=wgs)
    if seq_column:
      cols.append(jnp.where(live, seq, 0))
    lo, hi = cols[L.T_LO], cols[L.T_HI]
    stores = jnp.minimum(row + rows, i_q_start + i_q_len) > jnp.maximum(row, i_q_start)
    n_live = jnp.sum(jnp.where(stores, 1, 0))
    for c, x in enumerate(cols):
      ops.scatter(col_bufs, c * n_items + i, x)

    # Heaviest first, the items that store nothing last, stable: a bitonic sort of
    # (key, item) packed as key * n_items + item, key = bound - tiles or bound + 1.
    bound = total_kv_tiles_bound(total_kv, paged_cap, block_kv)
    v = jnp.where(stores, bound - (hi - lo), bound + 1) * n_items + i
    order = lax.rem(_bitonic_sort(ops, v, sort_buf, i, n_items), n_items)
    ops.sync()
    sorted_cols = [ops.gather(col_bufs, c * n_items + order) for c in range(n_cols)]
    _store_table(ops, table_ref, col_bufs, sorted_cols, i, staged=staged_table)

    order = dict(num_heads=num_heads, group=group, num_programs=num_programs)
    tiles = sorted_cols[L.T_HI] - sorted_cols[L.T_LO]
    n_keyed = xla.keyed_items(tiles, i < n_live)
    # The unit order is picked for the (head, item) units: with ``keyless_apart`` the
    # keyed items' alone (``operands.operands``).
    n_ordered = n_keyed if keyless_apart else n_live
    cost = schedule.item_costs(tiles, i < n_ordered)
    if dynamic:  # ``schedule.dynamic_schedule``: the deal's loop only where claims lose
      claimed = _dynamic_order(ops, cost, scan_buf, **order)
      dealt = _unit_order(ops, cost, sort_buf, i, n_ordered, n_items=n_items, skip=claimed,
                          **order)
      head_major, deal = schedule.schedule_of(claimed, dealt)
    else:
      head_major = _unit_order(ops, cost, sort_buf, i, n_ordered, n_items=n_items, **order)
      deal = 0
    s = _iota(WARPGROUP)
    tail8 = -1 if page_tiles else lax.div(kv_tail, 8)  # as ``operands.operands`` has it
    scalars = s * 0  # the other lanes: 0, L.S_NEXT (the claim count) among them
    lanes = (L.S_LIVE, L.S_TAIL8, L.S_HEAD_MAJOR, L.S_KV_TAIL, L.S_DEAL, L.S_KEYED)
    for lane, x in zip(lanes, (n_live, tail8, head_major, kv_tail, deal, n_keyed)):
      scalars = jnp.where(s == lane, x, scalars)
    ops.scatter(scalar_ref, s, scalars)

  pl.run_scoped(
      body,
      [plgpu.SMEM((n_seqs,), jnp.int32) for _ in range(6)],
      plgpu.SMEM((2 * max(n_seqs, n_items),), jnp.int32),
      plgpu.SMEM((n_items + 1,), jnp.int32),
      plgpu.SMEM((n_cols * n_items,), jnp.int32),
      plgpu.SMEM((n_items,), jnp.int32),
  )


def total_kv_tiles_bound(total_kv: int, paged_cap: int | None, block_kv: int) -> int:
  """More KV tiles than any item can have: a sequence's keys span at most total_kv rows
  (a paged cache's capacity), plus the tile its 8-row alignment adds."""
  keys = total_kv if paged_cap is None else paged_cap
  return keys // block_kv + 2


def build(q_offsets, kv_rows, total_q, total_kv, *, mask, block_q, block_kv, num_heads,
          group, num_programs, paged_cache=None, page_tiles=False, dynamic=False,
          top_left=False, interpret=False, kv_align=1, seq_column=False, keyless_apart=False,
          wgs=L.COMPUTE_WGS, shuffles=False, staged_table=False):
  """``work_list.work_list``'s table and the kernel's scalar operand in one Mosaic GPU
  kernel: (table [items, columns] int32, whose first ``num_work_items`` rows are
  ``work_list``'s and the rest items that run nothing; scalars [128] int32: the items
  that run, the last key's 8-row group, the unit order for ``num_programs`` programs
  (``head_major_order``'s for the static deal; with ``dynamic``, ``dynamic_schedule``'s,
  whose second part goes to lane ``layout.S_DEAL``), and the end of the last sequence's
  keys, and the items that run with KV tiles (``layout.S_KEYED``); the rest zeros).
  ``keyless_apart``: the unit order is picked for the keyed items' units alone (the
  key-less ones run apart: ``MosaicOptions.keyless_units``). ``shuffles``: the sort's and
  scans' exchanges within a thread or a warp without shared memory (``Ops``; the same
  table and scalars). ``staged_table``: the table written row-major into shared memory,
  then out to global memory in the order of its words (coalesced stores; the same
  table). Only where ``fits``; arguments as ``work_list``'s (``wgs``: the
  compute warpgroups)."""
  batch = q_offsets.shape[0] - 1
  num_items = xla.num_work_items(total_q, batch, block_q, wgs)
  n_items, _ = sizes(num_items, batch)
  seq_column = seq_column or page_tiles  # paged tiles read the block table by it
  n_cols = num_columns(seq_column, wgs)
  paged_cap = None
  inputs = [q_offsets.astype(jnp.int32)]
  if paged_cache is not None:
    cache_lengths, paged_cap = paged_cache
    inputs.append(cache_lengths.astype(jnp.int32))
  elif kv_rows is not None:
    inputs += [x.astype(jnp.int32) for x in kv_rows]
  kernel = functools.partial(
      _kernel, batch=batch, total_q=total_q, total_kv=total_kv, mask=mask,
      block_q=block_q, block_kv=block_kv, num_items=num_items, num_heads=num_heads,
      group=group, num_programs=num_programs,
      kv_given=paged_cache is None and kv_rows is not None, paged_cap=paged_cap,
      page_tiles=page_tiles, dynamic=dynamic, top_left=top_left, interpret=interpret,
      kv_align=kv_align, seq_column=seq_column, keyless_apart=keyless_apart, wgs=wgs,
      shuffles=shuffles, staged_table=staged_table)
  # Lane semantics: the arrays are Mosaic GPU's register arrays as they are, which the
  # element-wise loads and stores and the scalar reductions need (under the default
  # warpgroup semantics, the scalars and the loops over them did not compile on the H200).
  kw = dict(interpret=plgpu.InterpretGPUParams()) if interpret else dict(
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Lane))
  table, scalars = plgpu.kernel(
      kernel,
      out_type=(jax.ShapeDtypeStruct((n_items * n_cols,), jnp.int32),
                jax.ShapeDtypeStruct((WARPGROUP,), jnp.int32)),
      **kw)(*inputs)
  return table.reshape(n_items, n_cols), scalars

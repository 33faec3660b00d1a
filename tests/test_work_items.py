"""``work_items.build`` (the Mosaic GPU backend's work list in one small Mosaic GPU kernel)
against XLA's ``xla_work_list.work_list`` and ``schedule.head_major_order``, which the emulator in
tests/test_mosaic.py checks against the attention it schedules: the same table, bit for
bit, and the same scalars. Here in Mosaic GPU's interpret mode (the per-element loads and
stores as array indexing, no barriers); tests/test_gpu.py runs the same cases compiled on
the H200, and test_mosaic.py lowers the kernel for an H200 inside every default config."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_prefill.logits import kv_rows
from pallas_prefill import masks
from pallas_prefill.mosaic_gpu import layout, schedule, work_items
from pallas_prefill.mosaic_gpu import work_list as xla_work_list


@dataclasses.dataclass(frozen=True)
class WorkCase:
  lens: tuple
  kv_lens: tuple | None = None  # K/V offsets of their own
  garbage: bool = False  # offsets drawn at random, not sorted, some out of range
  mask: object = masks.CausalMask()
  block_q: int = 64
  block_kv: int = 128
  heads: int = 32
  group: int = 4
  programs: int = 132
  paged: tuple | None = None  # (cache lengths, capacity, page_tiles)
  extra_rows: int = 9  # query rows past offsets[-1]
  fp8: bool = False  # FP8's table: KV tiles at multiples of 16 keys, the sequence column
  aligned: bool = False  # KV tiles at multiples of 8 (MosaicOptions(batch_invariant=False))
  wgs: int = 2  # compute warpgroups (``MosaicConfig.compute_wgs``): items of wgs * block_q rows

  @property
  def name(self):
    return (f"b{len(self.lens)}-{type(self.mask).__name__}-h{self.heads}g{self.group}"
            f"-bkv{self.block_kv}-p{self.programs}{'-kv' if self.kv_lens else ''}"
            f"{'-garbage' if self.garbage else ''}"
            f"{'-paged' + str(self.paged[2]) if self.paged else ''}"
            f"{'-fp8' if self.fp8 else ''}{'-aligned' if self.aligned else ''}"
            f"{'-wgs' + str(self.wgs) if self.wgs != 2 else ''}")


_RNG = np.random.default_rng(7)
_SHORT = tuple(int(x) for x in _RNG.integers(16, 512, 64))
_CHUNKED_KV = tuple(c + 512 for c in (0, 1024, 2048, 3072, 4096, 5120, 6144, 8192))
WORK_CASES = [
    WorkCase((5, 100, 300, 0, 64)),
    WorkCase(_SHORT),
    WorkCase(_SHORT, heads=128, group=1, block_kv=64),
    WorkCase((4096,) * 4, heads=128, group=1, block_kv=64),
    WorkCase((4096, 2048, 1800, 1500, 1200, 1000, 900, 800, 700, 600, 500, 400, 300, 200,
              100, 50)),
    WorkCase((0, 1, 1000, 2048, 77, 513, 4096), programs=5),
    WorkCase((0, 0, 0), extra_rows=1),
    WorkCase((0, 0, 0), extra_rows=300),
    WorkCase((5, 100, 300, 0, 64), garbage=True),
    WorkCase(_SHORT[:40], garbage=True, heads=8, group=8),
    WorkCase((5, 100, 300, 0, 64), kv_lens=(50, 0, 700, 3, 64)),
    WorkCase((37, 200, 1), mask=masks.ChunkedCausalMask(64), block_q=32),
    WorkCase((37, 200, 1), mask=masks.SlidingWindowCausalMask(100), kv_lens=(300, 40, 9)),
    WorkCase((1000, 2048, 77), mask=masks.NullMask(), heads=16, group=1),
    WorkCase((30, 200, 7), paged=((100, 0, 5000), 512, True), block_kv=64),
    WorkCase((30, 200, 7), paged=((100, 0, 5000), 512, False), block_kv=64),
    WorkCase(tuple(int(x) for x in _RNG.integers(1, 40, 300)), heads=4, group=2),
    # chunked prefill: few items over long cached prefixes; with dynamic scheduling
    # (``schedule.dynamic_schedule``) claimed item-major (MHA's 32 heads in groups of 4),
    # and dealt K/V-head-major (MLA's 128 heads, a K/V head each)
    WorkCase((512,) * 8, kv_lens=_CHUNKED_KV),
    WorkCase((512,) * 8, kv_lens=_CHUNKED_KV, heads=128, group=1, block_kv=64,
             extra_rows=0),
]
# FP8 (issue 24): V^T's TMA needs tiles at multiples of 16 keys; scales by sequence
FP8_WORK_CASES = [
    WorkCase(_SHORT, fp8=True),
    WorkCase((5, 100, 300, 0, 64), kv_lens=(50, 0, 700, 3, 64), fp8=True, block_kv=64),
    WorkCase((37, 200, 1), mask=masks.SlidingWindowCausalMask(100), kv_lens=(300, 40, 9),
             fp8=True),
    WorkCase(_SHORT[:40], garbage=True, heads=8, group=8, fp8=True),
]
# Aligned KV tiles (``MosaicOptions(batch_invariant=False)``): multiples of 8, the last
# one shifted back
ALIGNED_WORK_CASES = [
    dataclasses.replace(WORK_CASES[i], aligned=True) for i in (0, 1, 4, 8, 10, 12, 14, 15)]
# Three compute warpgroups (``MosaicConfig.compute_wgs=3``): items of 192 rows, three
# warpgroups' tile ranges a row
THREE_WGS_WORK_CASES = [
    dataclasses.replace(WORK_CASES[i], wgs=3) for i in (0, 1, 4, 6, 8, 10, 12, 13, 14)] + [
    dataclasses.replace(FP8_WORK_CASES[i], wgs=3) for i in (0, 1)]


def _offsets(lens):
  return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)


def check_work_items(case: WorkCase, interpret: bool, seed: int = 0, dynamic=False,
                     keyless_apart=True, shuffles=False, staged_table=False):
  rng = np.random.default_rng(seed)
  off = _offsets(case.lens)
  total_q = int(off[-1]) + case.extra_rows
  if case.garbage:
    off = rng.integers(-50, total_q + 50, off.shape).astype(np.int32)
  kv_off, total_kv, paged = None, total_q, None
  if case.kv_lens is not None:
    kv_off = _offsets(case.kv_lens)
    total_kv = int(kv_off[-1]) + int(rng.integers(0, 20))
    kv_off = jnp.asarray(kv_off)
  if case.paged is not None:
    cache, cap, _ = case.paged
    paged = (jnp.asarray(cache, jnp.int32), cap)
    total_kv = len(case.lens) * cap
  page_tiles = bool(case.paged and case.paged[2])
  off = jnp.asarray(off)
  kw = dict(mask=case.mask, block_q=case.block_q, block_kv=case.block_kv,
            paged_cache=paged, page_tiles=page_tiles, wgs=case.wgs)
  if case.fp8:
    kw.update(kv_align=16, seq_column=True)
  elif case.aligned:
    kw.update(kv_align=8)
  table, _, kv_end, n_live = xla_work_list.work_list(off, kv_rows(kv_off), total_q, total_kv, **kw)
  if case.fp8:
    check_fp8_tiles(np.asarray(table), case.block_kv, len(case.lens), case.wgs)
  elif not case.aligned:
    check_invariant_tiles(np.asarray(table), page_tiles)
  programs = min(case.programs, case.heads * table.shape[0])
  tiles = table[:, layout.T_HI] - table[:, layout.T_LO]
  n_keyed = xla_work_list.keyed_items(tiles, jnp.arange(tiles.shape[0]) < n_live)
  n_ordered = n_keyed if keyless_apart else n_live  # (``MosaicOptions.keyless_units``)
  order = dict(num_heads=case.heads, group=case.group, num_programs=programs)
  head_major, deal = (schedule.dynamic_schedule(tiles, n_ordered, **order) if dynamic
                      else (schedule.head_major_order(tiles, n_ordered, **order), 0))
  bound = work_items.total_kv_tiles_bound(total_kv, paged and paged[1], case.block_kv)
  assert work_items.fits(table.shape[0], len(case.lens), bound)
  got, scalars = work_items.build(off, kv_rows(kv_off), total_q, total_kv, num_heads=case.heads,
                                  group=case.group, num_programs=programs,
                                  dynamic=dynamic, interpret=interpret,
                                  keyless_apart=keyless_apart, shuffles=shuffles,
                                  staged_table=staged_table, **kw)
  got, scalars, table = np.asarray(got), np.asarray(scalars), np.asarray(table)
  assert got.shape[0] >= table.shape[0] and got.shape[1] == table.shape[1]
  np.testing.assert_array_equal(got[:table.shape[0]], table)
  tail8 = -1 if page_tiles else int(kv_end) // 8
  assert list(scalars[:4]) == [int(n_live), tail8, int(head_major), int(kv_end)]
  assert scalars[layout.S_DEAL] == int(deal)
  assert scalars[layout.S_KEYED] == int(n_keyed)
  # Items [0, n_keyed) have KV tiles, the rest that run have none
  assert (np.asarray(tiles)[:int(n_keyed)] > 0).all()
  assert not np.asarray(tiles)[int(n_keyed):int(n_live)].any()
  rest = np.delete(scalars[4:], [layout.S_DEAL - 4, layout.S_KEYED - 4])
  assert not rest.any()  # layout.S_NEXT among them: the claims start at 0


def check_invariant_tiles(table, page_tiles):
  """Batch-invariant tiles: KV tile i of an item starts at its sequence's first key plus
  i * block_kv (``KV_ROW`` in rows; a paged cache's positions from 0), never shifted back."""
  want = 0 if page_tiles else table[:, layout.KV_START]
  np.testing.assert_array_equal(table[:, layout.KV_ROW], want)
  assert (table[:, layout.KV_LAST] == layout.NO_SHIFT_ROW).all()


def check_fp8_tiles(table, block_kv, batch, wgs=2):
  """FP8's table: every KV tile starts at a multiple of 16 keys, the tiles of an item with
  any cover its sequence's keys, and the sequence column names a sequence (or the rows
  past the last offset, one more: the kernel clamps it)."""
  first = table[:, layout.KV_ROW] * 8
  last = table[:, layout.KV_LAST] * 8
  assert not (first % 16).any() and not (last % 16).any()
  start, length = table[:, layout.KV_START], table[:, layout.KV_LEN]
  has = (table[:, layout.T_HI] > table[:, layout.T_LO]) & (length > 0)
  assert (first[has] <= start[has]).all()
  assert (last[has] + block_kv >= start[has] + length[has]).all()
  seq = layout.meta_cols(wgs)
  assert table.shape[1] == seq + 1
  assert ((table[:, seq] >= 0) & (table[:, seq] <= batch)).all()


@pytest.mark.parametrize("case", WORK_CASES + FP8_WORK_CASES + ALIGNED_WORK_CASES
                         + THREE_WGS_WORK_CASES, ids=lambda c: c.name)
def test_work_items_match_xla_in_interpret_mode(case):
  check_work_items(case, interpret=True)


DYNAMIC_CASES = [*WORK_CASES[:3], WORK_CASES[8], *WORK_CASES[-2:]]

# ``dot_product_attention``'s layout of padded MHA skew16_16k (``padded.ragged_layout``:
# per batch row an empty lead, the run, the padding after it, which has no keys): 565
# item slots, a 1024-lane sort (its steps 128, 256 and 512 lanes apart among them)
_SKEW = (4096, 2048, 1800, 1500, 1200, 1000, 900, 800, 700, 600, 500, 400, 300, 200, 100, 37)
PADDED_SKEW_CASE = WorkCase(tuple(x for n in _SKEW for x in (0, n, 4096 - n)),
                            kv_lens=tuple(x for n in _SKEW for x in (0, n, 0)), extra_rows=0)
# The exchanges without shared memory (``MosaicOptions.work_list_shuffles``): 128 to 1024
# lanes, garbage offsets, FP8's table, three warpgroups, dynamic scheduling
SHUFFLE_CASES = [WORK_CASES[0], WORK_CASES[1], WORK_CASES[3], WORK_CASES[8], WORK_CASES[16],
                 FP8_WORK_CASES[0], THREE_WGS_WORK_CASES[1], PADDED_SKEW_CASE]


@pytest.mark.parametrize("keyless_apart", [True, False])
@pytest.mark.parametrize("case", DYNAMIC_CASES, ids=lambda c: c.name)
def test_work_items_dynamic_order(case, keyless_apart):
  """For dynamic scheduling (``MosaicOptions.dynamic``) the kernel picks the order and whether
  the units are dealt by ``schedule.dynamic_schedule``: the same table, and XLA's choice in
  the scalars' lanes (for the keyed items' units where the key-less ones run apart,
  ``MosaicOptions.keyless_units``; else for all)."""
  check_work_items(case, interpret=True, dynamic=True, keyless_apart=keyless_apart)


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("case", SHUFFLE_CASES, ids=lambda c: c.name)
def test_work_items_with_shuffles(case, dynamic):
  """``work_list_shuffles``' exchanges (each thread's registers relabelled, warp
  butterflies, the scans by warp segments and their carries, on the view of the lanes
  that the compiled kernel's layout has): the same table and scalars as XLA's."""
  check_work_items(case, interpret=True, dynamic=dynamic, shuffles=True)


@pytest.mark.parametrize("shuffles", [False, True])
@pytest.mark.parametrize("case", SHUFFLE_CASES, ids=lambda c: c.name)
def test_work_items_with_a_staged_table(case, shuffles):
  """``work_list_staged_table``: the sorted table written row-major into shared memory,
  then out word by word in order (coalesced stores): the same table and scalars as
  XLA's, over 128 to 1024 lanes (17 to 21 columns)."""
  check_work_items(case, interpret=True, dynamic=True, shuffles=shuffles,
                   staged_table=True)


@pytest.mark.parametrize("broken", ["registers", "butterfly", "shuffle_up", "carries"])
def test_work_items_shuffles_check_can_fail(monkeypatch, broken):
  """The comparison sees each exchange gone wrong: registers not relabelled, warp
  butterflies or shuffles up that return the lane's own value, segments' carries lost."""
  if broken == "registers":
    monkeypatch.setattr(work_items.Ops, "_registers", lambda self, x, sources: x)
  elif broken == "butterfly":
    monkeypatch.setattr(work_items.Ops, "_shuffle_xor", lambda self, x, j: x)
  elif broken == "shuffle_up":
    monkeypatch.setattr(work_items.Ops, "_shuffle_up", lambda self, x, k: x)
  else:
    monkeypatch.setattr(work_items.Ops, "_segment_carries",
                        lambda self, x, buf, segments, op, identity: x * 0 + identity)
  with pytest.raises(AssertionError):
    check_work_items(PADDED_SKEW_CASE, interpret=True, shuffles=True)


def test_dynamic_cases_cover_every_schedule():
  """DYNAMIC_CASES reach each of ``dynamic_schedule``'s three outcomes: claimed
  K/V-head-major, claimed item-major and dealt K/V-head-major."""
  got = set()
  for case in DYNAMIC_CASES:
    off = _offsets(case.lens)
    kv_off = None if case.kv_lens is None else jnp.asarray(_offsets(case.kv_lens))
    total_q = int(off[-1]) + case.extra_rows
    total_kv = total_q if kv_off is None else int(kv_off[-1])
    table, _, _, n_live = xla_work_list.work_list(
        jnp.asarray(off), kv_rows(kv_off), total_q, total_kv, mask=case.mask,
        block_q=case.block_q, block_kv=case.block_kv)
    got.add(tuple(int(x) for x in schedule.dynamic_schedule(
        table[:, layout.T_HI] - table[:, layout.T_LO], n_live, num_heads=case.heads,
        group=case.group, num_programs=min(case.programs, case.heads * table.shape[0]))))
  assert got == {(1, 0), (0, 0), (1, 1)}


def test_work_items_check_can_fail(monkeypatch):
  """The comparison sees a kernel gone wrong: prefix scans that return their input."""
  monkeypatch.setattr(work_items.Ops, "scan", lambda self, x, buf, op, identity: x)
  with pytest.raises(AssertionError):
    check_work_items(WORK_CASES[0], interpret=True)


@pytest.mark.parametrize("num_items,batch,bound,fits", [
    (1024, 1000, 100, True), (1025, 10, 100, False), (100, 1023, 100, False),
    (1024, 10, 2**21, False)])
def test_fits(num_items, batch, bound, fits):
  assert work_items.fits(num_items, batch, bound) == fits

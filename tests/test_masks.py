"""The mask interface the kernel relies on to skip and to leave unmasked whole KV tiles:
exhaustively over small ranges, kv_range covers every visible key and full_range holds
only keys every query of the tile sees."""

import itertools

import numpy as np
import pytest

from pallas_prefill import masks

MASKS = [masks.NullMask(), masks.CausalMask(), masks.SlidingWindowCausalMask(1),
         masks.SlidingWindowCausalMask(5), masks.ChunkedCausalMask(1),
         masks.ChunkedCausalMask(4), masks.ChunkedCausalMask(7)]


@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_tile_ranges_agree_with_visible(mask):
  for kv_len, q_lo in itertools.product(range(0, 14), range(-5, 14)):
    keys = np.arange(kv_len)
    for q_hi in range(q_lo, q_lo + 7):
      queries = np.arange(q_lo, q_hi + 1)
      vis = np.asarray(mask.visible(queries[:, None], keys[None, :])).reshape(
          len(queries), kv_len)
      lo, hi = (int(x) for x in mask.kv_range(np.int32(q_lo), np.int32(q_hi),
                                               np.int32(kv_len)))
      full_lo, full_hi = (int(x) for x in mask.full_range(np.int32(q_lo), np.int32(q_hi),
                                                           np.int32(kv_len)))
      where = f"{mask} kv_len={kv_len} queries {q_lo}..{q_hi}"
      assert 0 <= lo and hi <= kv_len, where
      seen = np.flatnonzero(vis.any(axis=0))
      assert ((seen >= lo) & (seen < hi)).all(), f"kv_range misses keys: {where}"
      if full_hi > full_lo:
        assert 0 <= full_lo and full_hi <= kv_len, where
        assert vis[:, full_lo:full_hi].all(), f"full_range holds hidden keys: {where}"


@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_key_range_agrees_with_visible(mask):
  """Every mask shows a query (at any position, negative ones of cross-attention too) one
  run of the keys at positions >= 0: key_range's [lo, hi)."""
  queries, keys = np.arange(-9, 30), np.arange(0, 40)
  lo, hi = (np.broadcast_to(np.asarray(x), queries.shape)[:, None]
            for x in mask.key_range(queries.astype(np.int32)))
  vis = np.asarray(mask.visible(queries[:, None], keys[None, :]))
  vis = np.broadcast_to(vis, (len(queries), len(keys)))
  np.testing.assert_array_equal((lo <= keys) & (keys < hi), vis, err_msg=repr(mask))


@pytest.mark.parametrize("mask", MASKS, ids=repr)
def test_key_range_starts_at_zero(mask):
  """``key_range_starts_at_zero`` (``MosaicOptions.column_lo_static``'s condition) holds
  exactly where every query, at any position, sees its keys from position 0 on (its
  lowest visible key, if any, is 0) and key_range's lower bound is the scalar 0."""
  queries, keys = np.arange(-9, 30), np.arange(0, 40)
  vis = np.broadcast_to(np.asarray(mask.visible(queries[:, None], keys[None, :])),
                        (len(queries), len(keys)))
  starts_at_zero = all(row[0] for row in vis if row.any())
  assert masks.key_range_starts_at_zero(mask) == starts_at_zero, repr(mask)
  lo, _ = mask.key_range(queries.astype(np.int32))
  assert (np.ndim(lo) == 0 and int(lo) == 0) == starts_at_zero, repr(mask)

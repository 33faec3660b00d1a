"""Paged KV caches: PagedKV in mha_prefill and mla_prefill, and write_kv (interpret mode,
plus lowering for the H200)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_prefill as pp
from pallas_prefill import masks
from pallas_prefill.paged import write_kv
from tests import cases
from tests.test_lowering import KERNEL_NAME, lower_for_h200, triton_calls

MASKS = [masks.CausalMask(), masks.NullMask(), masks.SlidingWindowCausalMask(24),
         masks.ChunkedCausalMask(32)]
CACHED = (5, 1, 90, 100, 64, 50)  # cache + new per sequence: the cache lengths are not 0
NO_CACHE = None


def paged_cases():
  mha = cases.Case(lse=True)
  mla = cases.Case(kind="mla", heads=4, kv_heads=2, head_dim=64, rope_dim=32, lse=True)
  out = []
  for base in (mha, mla):
    for page_size in (16, 128):
      for mask in MASKS:
        out.append(dataclasses.replace(base, page_size=page_size, mask=mask, kv_lens=CACHED))
      out.append(dataclasses.replace(base, page_size=page_size))  # cache lengths all 0
  out.append(dataclasses.replace(mha, page_size=16, kv_lens=CACHED, sink=True))
  out.append(dataclasses.replace(mla, page_size=32, kv_lens=CACHED, shared_rope=False,
                                 config=None))
  return out


PAGED_CASES = paged_cases()


def with_kv_lens(case):
  """Without kv_lens, the K/V of each sequence are its own new rows (cache length 0)."""
  return case if case.kv_lens else dataclasses.replace(case, kv_lens=case.lens)


@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: c.name)
def test_paged_matches_reference(case):
  cases.check_case(with_kv_lens(case), interpret=True)


@pytest.mark.parametrize("case", [c for c in PAGED_CASES if c.mask == masks.CausalMask()],
                         ids=lambda c: c.name)
def test_paged_equals_contiguous(case):
  """The same logical K/V, paged (pages shuffled, NaN in the unused slots) or packed."""
  case = with_kv_lens(case)
  seed = cases.fresh_seed()
  paged_args, kwargs, _ = cases.make_inputs(case, seed)
  packed_args, packed_kwargs, _ = cases.make_inputs(
      dataclasses.replace(case, page_size=None), seed)
  kernel, _ = cases.ENTRY_POINTS[case.kind]
  paged = kernel(*paged_args, config=case.config, **kwargs)
  packed = kernel(*packed_args, config=case.config, **packed_kwargs)
  for x, y in zip(jax.tree.leaves(paged), jax.tree.leaves(packed)):
    x, y = np.asarray(x, np.float32), np.asarray(y, np.float32)
    assert np.isfinite(x).all()
    np.testing.assert_allclose(x, y, rtol=2e-2, atol=2e-2, err_msg=f"seed={seed}")
    assert cases.rel_err(x, y) < 5e-3, f"seed={seed}"


def test_write_kv_places_rows_at_cache_length():
  rng = np.random.default_rng(cases.fresh_seed())
  page_size, heads, depth = 16, 2, 8
  lens, cache = [3, 0, 20], [14, 5, 0]
  table = np.array([[4, 1, 0], [2, 0, 0], [3, 5, 0]], np.int32)
  pages = rng.standard_normal((6, page_size, heads, depth)).astype(np.float32)
  new = rng.standard_normal((sum(lens) + 2, heads, depth)).astype(np.float32)  # 2 extra
  offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  expected = pages.copy()
  for b, (n, c) in enumerate(zip(lens, cache)):
    for i in range(n):
      pos = c + i
      expected[table[b, pos // page_size], pos % page_size] = new[offsets[b] + i]
  got = jax.jit(write_kv)(jnp.asarray(pages), jnp.asarray(new), jnp.asarray(offsets),
                          jnp.asarray(table), jnp.asarray(cache, jnp.int32))
  np.testing.assert_array_equal(np.asarray(got), expected)


def test_write_kv_then_prefill_over_the_cache():
  """The serving flow: cache K/V in pages, write the new rows, prefill on top."""
  rng = np.random.default_rng(cases.fresh_seed())
  page_size, heads, depth = 16, 2, 32
  cache, lens = np.array([30, 0, 7]), np.array([9, 20, 1])
  table = np.array([[0, 3, 6], [1, 4, 7], [2, 5, 8]], np.int32)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  k_pages, v_pages = normal(9, page_size, heads, depth), normal(9, page_size, heads, depth)
  total = int(lens.sum())
  q, k_new, v_new = normal(total, heads, depth), normal(total, heads, depth), normal(
      total, heads, depth)
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  cache_lengths = jnp.asarray(cache, jnp.int32)
  k_pages = write_kv(k_pages, k_new, offsets, jnp.asarray(table), cache_lengths)
  v_pages = write_kv(v_pages, v_new, offsets, jnp.asarray(table), cache_lengths)
  k = pp.PagedKV(k_pages, jnp.asarray(table), cache_lengths)
  v = pp.PagedKV(v_pages, jnp.asarray(table), cache_lengths)
  out = pp.mha_prefill(q, k, v, offsets, max_prompt_len=32)
  # The same by hand: each sequence's cache rows, then its new rows, packed.
  kv_rows = lambda pages, b: pages[table[b]].reshape(-1, heads, depth)[:cache[b] + lens[b]]
  kv_off = jnp.asarray(np.concatenate([[0], np.cumsum(cache + lens)]), jnp.int32)
  ref = pp.reference.mha_prefill_reference(
      q, jnp.concatenate([kv_rows(k_pages, b) for b in range(3)]),
      jnp.concatenate([kv_rows(v_pages, b) for b in range(3)]), offsets, max_prompt_len=32,
      kv_input_row_offsets=kv_off)
  assert cases.rel_err(out, ref) < 1e-2


# ---------------------------------------------------------------------------------------
# Bad input.

def paged_operands(page_size=16, table_dtype=jnp.int32, table_rank=2):
  k = jnp.zeros((6, page_size, 2, 16), jnp.bfloat16)
  table = jnp.zeros((2, 3) if table_rank == 2 else (6,), table_dtype)
  cache = jnp.array([0, 4], jnp.int32)
  q = jnp.zeros((10, 4, 16), jnp.bfloat16)
  return q, pp.PagedKV(k, table, cache), pp.PagedKV(k, table, cache)


OFFSETS = jnp.array([0, 4, 10], jnp.int32)


@pytest.mark.parametrize("page_size", [8, 24, 512])
def test_page_size_must_be_a_power_of_two_from_16_to_256(page_size):
  q, k, v = paged_operands(page_size)
  with pytest.raises(ValueError, match=f"page size must be a power of two from 16 to 256, "
                                       f"got {page_size}"):
    pp.mha_prefill(q, k, v, OFFSETS, max_prompt_len=8)


@pytest.mark.parametrize("kwargs,match", [
    (dict(table_dtype=jnp.uint32), r"k.block_table must be a rank-2 int32 array, got uint32"),
    (dict(table_rank=1), r"k.block_table must be a rank-2 int32 array, got int32\(6,\)"),
])
def test_block_table_rank_and_dtype(kwargs, match):
  q, k, v = paged_operands(**kwargs)
  with pytest.raises(ValueError, match=match):
    pp.mha_prefill(q, k, v, OFFSETS, max_prompt_len=8)


def test_paged_mixed_with_an_array_or_kv_offsets_is_refused():
  q, k, v = paged_operands()
  with pytest.raises(ValueError, match=r"k, v must all be PagedKV or all be arrays; got "
                                       r"PagedKV for k only"):
    pp.mha_prefill(q, k, jnp.zeros((10, 2, 16), jnp.bfloat16), OFFSETS, max_prompt_len=8)
  with pytest.raises(ValueError, match=r"kv_input_row_offsets must be None with PagedKV"):
    pp.mha_prefill(q, k, v, OFFSETS, kv_input_row_offsets=OFFSETS, max_prompt_len=8)


def test_concrete_page_ids_and_cache_lengths_are_validated():
  q, k, v = paged_operands()
  bad_page = dataclasses.replace(k, block_table=jnp.array([[0, 1, 2], [6, 0, 0]], jnp.int32))
  with pytest.raises(ValueError, match=r"k.block_table\[1\] holds page id 6, outside the "
                                       r"6 pages"):
    pp.mha_prefill(q, bad_page, dataclasses.replace(v, block_table=bad_page.block_table),
                   OFFSETS, max_prompt_len=8)
  too_long = dataclasses.replace(k, cache_lengths=jnp.array([0, 43], jnp.int32))
  with pytest.raises(ValueError, match=r"sequence 1 needs 49 K/V positions \(cache_lengths "
                                       r"43 \+ 6 new\), more than its 3 pages of 16 hold"):
    pp.mha_prefill(q, too_long, dataclasses.replace(v, cache_lengths=too_long.cache_lengths),
                   OFFSETS, max_prompt_len=8)


def test_pages_that_are_no_array_are_named():
  q, k, v = paged_operands()
  with pytest.raises(TypeError, match=r"^k.pages must be an array, got NoneType"):
    pp.mha_prefill(q, dataclasses.replace(k, pages=None), v, OFFSETS, max_prompt_len=8)


def test_concrete_tables_and_cache_lengths_must_be_shared():
  """The kernels read the block table and cache lengths of the first K/V operand only: a
  concrete V (or MLA k_rope / v) with other values is refused, not ignored."""
  q, k, v = paged_operands()
  other_table = dataclasses.replace(v, block_table=jnp.array([[1, 2, 3], [4, 5, 0]],
                                                             jnp.int32))
  with pytest.raises(ValueError, match=r"^v.block_table differs from k.block_table: the "
                                       r"K/V operands of a paged cache share one "):
    pp.mha_prefill(q, k, other_table, OFFSETS, max_prompt_len=8)
  other_lengths = dataclasses.replace(v, cache_lengths=jnp.array([0, 3], jnp.int32))
  with pytest.raises(ValueError, match=r"^v.cache_lengths differs from k.cache_lengths"):
    pp.mha_prefill(q, k, other_lengths, OFFSETS, max_prompt_len=8)
  kn = pp.PagedKV(jnp.zeros((6, 16, 2, 16), jnp.bfloat16), k.block_table, k.cache_lengths)
  kr = pp.PagedKV(jnp.zeros((6, 16, 1, 8), jnp.bfloat16), other_table.block_table,
                  k.cache_lengths)
  with pytest.raises(ValueError, match=r"^k_rope.block_table differs from k_nope"):
    pp.mla_prefill(jnp.zeros((10, 2, 24), jnp.bfloat16), kn, kr, kn, OFFSETS,
                   max_prompt_len=8)


@pytest.mark.parametrize("change,error,match", [
    (dict(block_table=np.zeros((2, 3), np.int32)), ValueError,
     r"^block_table must have batch = 3 rows \(input_row_offsets' length - 1\), got 2"),
    (dict(cache_lengths=np.zeros((2,), np.int32)), ValueError,
     r"^cache_lengths must have batch = 3 rows"),
    (dict(block_table=np.zeros((9,), np.int32)), ValueError,
     r"^block_table must have rank 2, got shape \(9,\)"),
    (dict(block_table=np.zeros((3, 3), np.int64)), TypeError,
     r"^block_table must be int32, got int64"),
    (dict(cache_lengths=np.zeros((3,), np.float32)), TypeError,
     r"^cache_lengths must be int32, got float32"),
    (dict(new_rows=np.zeros((5, 1, 8), np.float32)), ValueError,
     r"^new_rows' \[heads, depth\] \(1, 8\) must be the pages' \(2, 8\)"),
    (dict(new_rows=np.zeros((5, 2, 4), np.float32)), ValueError, r"^new_rows' \[heads"),
    (dict(new_rows=np.zeros((5, 2, 8), np.float16)), TypeError,
     r"^new_rows \(float16\) must have the pages' dtype \(float32\)"),
    (dict(pages=np.zeros((6, 16, 16), np.float32)), ValueError,
     r"^pages must have rank 4, got shape \(6, 16, 16\)"),
    (dict(offsets=[0, 2, 4, 5]), TypeError, r"^input_row_offsets must be an array, got list"),
    (dict(offsets=np.array([0, 2, 4, 5], np.float32)), TypeError,
     r"^input_row_offsets must be int32 or uint32, got float32"),
    (dict(offsets=np.array([], np.int32)), ValueError,
     r"^input_row_offsets must have length batch \+ 1 >= 1, got 0"),
    (dict(offsets=np.array([0], np.int32)), ValueError,
     r"^block_table must have batch = 0 rows \(input_row_offsets' length - 1\), got 3"),
    (dict(offsets=np.array([0, 4, 2, 5], np.int32)), ValueError,
     r"^input_row_offsets must be nondecreasing from 0 to at most the 5 rows of new_rows, "
     r"got \[0, 4, 2, 5\]"),
    (dict(offsets=np.array([0, 2, 4, 9], np.int32)), ValueError,
     r"^input_row_offsets must be nondecreasing from 0"),
], ids=lambda x: str(x)[:30])
def test_write_kv_refuses_what_would_write_the_wrong_rows(change, error, match):
  """write_kv's arguments checked as the prefill's are: a table or lengths of another
  batch (which a gather would clamp, writing one sequence into another's pages), rows
  of other heads or depth (which would broadcast), offsets of the wrong type or order."""
  args = dict(pages=np.zeros((6, 16, 2, 8), np.float32), new_rows=np.ones((5, 2, 8),
                                                                          np.float32),
              offsets=np.array([0, 2, 4, 5], np.int32), block_table=np.zeros((3, 3), np.int32),
              cache_lengths=np.zeros((3,), np.int32))
  names = ("pages", "new_rows", "offsets", "block_table", "cache_lengths")
  # As JAX arrays, but lists and int64 (which JAX would make int32) as given.
  ordered = lambda a: [  # noqa: E731
      a[n] if isinstance(a[n], list) or a[n].dtype == np.int64 else jnp.asarray(a[n])
      for n in names]
  write_kv(*ordered(args))  # the baseline is valid
  args.update(change)
  with pytest.raises(error, match=match):
    write_kv(*ordered(args))
  if not any(isinstance(x, list) or x.dtype == np.int64 for x in args.values()):
    # The static checks hold under jit too.
    if "offsets" in change and error is ValueError and change["offsets"].shape[0] == 4:
      jax.jit(write_kv)(*ordered(args))  # values: checked only when concrete
    else:
      with pytest.raises(error, match=match):
        jax.jit(write_kv)(*ordered(args))


def test_garbage_page_ids_and_cache_lengths_under_jit_stay_in_bounds():
  rng = np.random.default_rng(cases.fresh_seed())
  k_pages = jnp.asarray(rng.standard_normal((6, 16, 2, 16)), jnp.bfloat16)
  q = jnp.asarray(rng.standard_normal((10, 4, 16)), jnp.bfloat16)

  @jax.jit
  def run(table, cache):
    k = pp.PagedKV(k_pages, table, cache)
    return pp.mha_prefill(q, k, k, OFFSETS, max_prompt_len=8, return_lse=True)

  for table, cache in (([[-5, 99, 3], [7, 2**30, -1]], [2**30, -7]),
                       ([[0, 1, 2], [3, 4, 5]], [47, 3])):
    out, lse = run(jnp.asarray(table, jnp.int32), jnp.asarray(cache, jnp.int32))
    assert np.isfinite(np.asarray(out, np.float32)).all() and np.isfinite(lse).all()


# ---------------------------------------------------------------------------------------
# Lowering for the H200.

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_paged_lowers_for_h200(kind, page_size):
  bf16 = jnp.bfloat16
  table, cache = S((4, 40), jnp.int32), S((4,), jnp.int32)
  paged = lambda heads, depth: pp.PagedKV(S((160, page_size, heads, depth), bf16), table,
                                          cache)
  if kind == "mha":
    args = (S((2048, 32, 128), bf16), paged(8, 128), paged(8, 128))
    kernel = pp.mha_prefill
  else:
    args = (S((2048, 16, 192), bf16), paged(16, 128), paged(1, 64), paged(16, 128))
    kernel = pp.mla_prefill
  fn = lambda *a: kernel(*a, max_prompt_len=512, interpret=False, backend="triton")
  lowered = lower_for_h200(fn, *args, S((5,), jnp.int32))
  [call] = triton_calls(lowered)
  assert call.name == KERNEL_NAME and call.grid[2] == 4


@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
def test_paged_default_tiles_follow_the_page(page_size):
  """config=None on a paged cache: the KV tile lies inside a page, and for rows up to 256
  bytes wide takes up to 64 of its rows (what hides the block-table read, BUILD_NOTES.md);
  wider rows (MLA's 192, float32 at 128) keep their tile, within the page."""
  from pallas_prefill import config as config_lib
  from tests.test_lowering import H200_MESH, use_abstract_mesh

  causal = masks.CausalMask()
  with use_abstract_mesh(H200_MESH):
    for qk, v, dtype, raised in [(128, 128, jnp.bfloat16, True), (64, 64, jnp.float32, True),
                                 (128, 128, jnp.float32, False), (192, 128, jnp.bfloat16, False),
                                 (128, 256, jnp.float16, False)]:
      for max_len in (512, 4096):
        plain = config_lib.default_config(qk, v, dtype, causal, max_len)
        paged = config_lib.default_config(qk, v, dtype, causal, max_len, page_size)
        block_kv = max(plain.block_kv, 64) if raised else plain.block_kv
        assert paged == dataclasses.replace(plain, block_kv=min(block_kv, page_size))

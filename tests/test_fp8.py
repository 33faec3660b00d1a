"""FP8 inputs (issue 24, work in progress: the Triton backend's dequantizing path) in
``mha_prefill``, ``mla_prefill``, paged caches (``write_kv`` included) and
``dot_product_attention``: against the float32 reference of the dequantized inputs in
interpret mode (and compiled, ``gpu``-marked), the lowering for an H200, and the errors."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_prefill as pp
from pallas_prefill import fp8, masks
from pallas_prefill.constants import EMPTY_ROW_LSE
from tests import cases
from tests import test_padded

E4 = jnp.float8_e4m3fn
TOLERANCE = 5e-2  # relative error against the float32 reference of the same FP8 values


@dataclasses.dataclass(frozen=True)
class Fp8Case:
  kind: str = "mha"  # or "mla": head_dim is then d_nope (and d_v), rope_dim d_rope
  lens: tuple = (0, 1, 37, 100, 64, 19)
  kv_lens: tuple | None = None
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 64
  rope_dim: int = 16
  shared_rope: bool = True  # MLA: k_rope has 1 head (DeepSeek) or num_kv_heads
  dtype: str = "float8_e4m3fn"
  q_dtype: str | None = None  # None: FP8 like K/V; else a wider q (an FP8 KV cache)
  scale_shape: str = "kv_heads"  # "scalar", "kv_heads" or "batch"
  mask: object = masks.CausalMask()
  sink: bool = False
  lse: bool = False
  outliers: bool = False  # a few channels 30x larger
  page_size: int | None = None

  @property
  def name(self) -> str:
    return ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self)
                    if getattr(self, f.name) != f.default) or "base"


_MLA = Fp8Case(kind="mla", lens=(0, 1, 23, 40), head_dim=32)
_MLA_CACHED = (5, 1, 40, 50)
FP8_CASES = [
    Fp8Case(), Fp8Case(scale_shape="scalar"), Fp8Case(scale_shape="batch"),
    Fp8Case(dtype="float8_e5m2"), Fp8Case(q_dtype="bfloat16"),
    Fp8Case(q_dtype="float16", scale_shape="batch"),
    Fp8Case(mask=masks.NullMask(), lse=True), Fp8Case(mask=masks.SlidingWindowCausalMask(24)),
    Fp8Case(mask=masks.ChunkedCausalMask(32), sink=True, lse=True), Fp8Case(kv_heads=1),
    Fp8Case(kv_lens=(5, 1, 90, 100, 64, 50)), Fp8Case(outliers=True),
    Fp8Case(head_dim=128, outliers=True, q_dtype="bfloat16"),
    Fp8Case(page_size=16, kv_lens=(5, 1, 90, 100, 64, 50), scale_shape="batch"),
    # MLA: one q_scale for q's nope and rope columns, one k_scale for k_nope and k_rope.
    _MLA, dataclasses.replace(_MLA, scale_shape="scalar", mask=masks.SlidingWindowCausalMask(24),
                              lse=True),
    dataclasses.replace(_MLA, scale_shape="batch", shared_rope=False, mask=masks.NullMask(),
                        lse=True, outliers=True),
    dataclasses.replace(_MLA, q_dtype="bfloat16", dtype="float8_e5m2", kv_lens=_MLA_CACHED),
    dataclasses.replace(_MLA, head_dim=48, rope_dim=24, q_dtype="float16",
                        scale_shape="batch"),  # depths zero-padded in the wrapper
    dataclasses.replace(_MLA, page_size=16, kv_lens=_MLA_CACHED, scale_shape="batch",
                        lse=True),
]


def seq_of_rows(offsets, rows):
  """Each of `rows` rows' sequence under [batch + 1] offsets (rows past the last offset:
  the last sequence's)."""
  batch = len(offsets) - 1
  return np.clip(np.searchsorted(offsets, np.arange(rows), side="right") - 1, 0, batch - 1)


def fp8_scale(x, kv_heads, dtype, scale_shape, batch, rng):
  """A dequantization scale for x [rows, heads, depth] (its heads grouped under the
  kv_heads; a 1-head x counts for every K/V head) in the case's shape: per K/V head the
  absmax over the FP8 range; "scalar" the largest of them; "batch" each sequence's a
  random multiple (1 to 4) of its head's, so a kernel that takes another sequence's
  scale shows."""
  heads = x.shape[1]
  x = np.abs(np.asarray(x, np.float64))
  if heads < kv_heads:
    top = np.full(kv_heads, x.max())
  else:
    top = x.reshape(x.shape[0], kv_heads, heads // kv_heads, -1).max(axis=(0, 2, 3))
  scale = (np.maximum(top, 1e-3) / fp8.FP8_MAX[jnp.dtype(dtype)]).astype(np.float32)
  if scale_shape == "scalar":
    return np.float32(scale.max())
  if scale_shape == "batch":
    return (scale[None] * rng.uniform(1.0, 4.0, (batch, 1))).astype(np.float32)
  return scale


def quantized(x, scale, seq, kv_heads, dtype):
  """x [rows, heads, depth] divided by each row's scale (its sequence seq[r]'s, a head
  its K/V head's) and cast to the FP8 dtype. A 1-head x under several K/V heads (MLA's
  shared k_rope) is divided by the largest, so that it fits every head's scale."""
  batch = int(seq.max(initial=0)) + 1
  if np.ndim(scale) < 2:
    scale = np.broadcast_to(scale, (batch, kv_heads))
  per_row = scale[seq]  # [rows, kv_heads]
  if x.shape[1] < kv_heads:
    per_row = per_row.max(axis=1, keepdims=True)
  else:
    per_row = np.repeat(per_row, x.shape[1] // kv_heads, axis=1)
  return jnp.asarray(np.asarray(x, np.float64) / per_row[:, :, None], jnp.float32).astype(
      dtype)


def _inputs(case: Fp8Case, seed):
  rng = np.random.default_rng(seed)
  kv_lens = case.lens if case.kv_lens is None else case.kv_lens
  q_off = np.concatenate([[0], np.cumsum(case.lens)]).astype(np.int32)
  kv_off = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
  batch = len(case.lens)
  total_q, total_kv = int(q_off[-1]) + 3, int(kv_off[-1]) + 3
  if case.kv_lens is None:
    total_kv = total_q
  dt = jnp.dtype(case.dtype)

  def normal(rows, heads, depth):
    x = rng.standard_normal((rows, heads, depth))
    if case.outliers:
      x[..., rng.choice(depth, 3, replace=False)] *= 30
    return x

  q_seq, kv_seq = seq_of_rows(q_off, total_q), seq_of_rows(kv_off, total_kv)
  scale_of = lambda x: fp8_scale(x, case.kv_heads, dt, case.scale_shape, batch, rng)  # noqa: E731
  v = normal(total_kv, case.kv_heads, case.head_dim)
  if case.kind == "mha":
    q = normal(total_q, case.heads, case.head_dim)
    ks = [normal(total_kv, case.kv_heads, case.head_dim)]
    k_scale = scale_of(ks[0])
  else:
    q = normal(total_q, case.heads, case.head_dim + case.rope_dim)
    ks = [normal(total_kv, case.kv_heads, case.head_dim),
          normal(total_kv, 1 if case.shared_rope else case.kv_heads, case.rope_dim)]
    k_scale = np.maximum(scale_of(ks[0]), scale_of(ks[1]))  # one scale for both
  v_scale = scale_of(v)
  kw = dict(max_prompt_len=max(max(case.lens), 1), mask=case.mask, return_lse=case.lse,
            k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale))
  if case.q_dtype is None:
    q_scale = scale_of(q)
    q_in = quantized(q, q_scale, q_seq, case.kv_heads, dt)
    kw["q_scale"] = jnp.asarray(q_scale)
  else:
    q_in = jnp.asarray(q, case.q_dtype)
  kv = [quantized(x, k_scale, kv_seq, case.kv_heads, dt) for x in ks]
  kv.append(quantized(v, v_scale, kv_seq, case.kv_heads, dt))
  if case.sink:
    kw["sink_weights"] = jnp.asarray(rng.standard_normal(case.heads), jnp.float32)
  if case.page_size is not None:
    kv = list(cases.to_pages(tuple(kv), kv_off, np.asarray(case.lens), case.page_size, rng))
  elif case.kv_lens is not None:
    kw["kv_input_row_offsets"] = jnp.asarray(kv_off)
  return (q_in, *kv, jnp.asarray(q_off)), kw, int(q_off[-1])


def _expected_dtype(q_dtype):
  return jnp.dtype(jnp.bfloat16) if fp8.is_fp8(q_dtype) else jnp.dtype(q_dtype)


def check_fp8_case(case: Fp8Case, *, interpret, poison=None, config=None):
  """The case on fresh random inputs against the reference of the same FP8 values: the
  output dtype, no NaN (so every row was written), the error, zeros past the last
  offset, and the LSE (the kernel with `config` where given). Returns the relative
  error."""
  seed = cases.fresh_seed()
  tag = f"{case.name} seed={seed}"
  args, kw, last = _inputs(case, seed)
  kernel, reference = cases.ENTRY_POINTS[case.kind]
  expected = reference(*args, **kw)
  if config is not None:
    kernel = functools.partial(kernel, config=config)
  if poison is not None:
    poison()
  result = kernel(*args, interpret=interpret, **kw)
  out, lse = result if case.lse else (result, None)
  ref_out, ref_lse = expected if case.lse else (expected, None)
  out32 = np.asarray(out, np.float32)
  assert out.dtype == _expected_dtype(args[0].dtype) == ref_out.dtype, tag
  assert np.isfinite(out32).all(), tag
  err = cases.rel_err(out32, ref_out)
  assert err < TOLERANCE, f"relative error {err:.2e}: {tag}"
  assert not out32[last:].any(), tag
  if lse is not None:
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-2, atol=5e-2,
                               err_msg=tag)
  return err


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c.name)
def test_fp8_matches_the_dequantized_reference(case):
  check_fp8_case(case, interpret=True)


# ---------------------------------------------------------------------------------------
# A paged FP8 cache: write_kv writes FP8 rows into FP8 pages, then the prefill over it.

def check_write_kv_then_prefill(kind, *, interpret, poison=None):
  """The serving flow on an FP8 cache: cached FP8 pages, the new FP8 rows written by
  ``write_kv`` over NaN (every slot they take must be written; the slots past each
  sequence's keys stay NaN, never to be read), the prefill over the pages, against the
  reference of the same pages. Returns the relative error."""
  seed = cases.fresh_seed()
  rng = np.random.default_rng(seed)
  page_size, heads, kv_heads = 16, 4, 2
  cache, lens = np.array([30, 0, 7]), np.array([9, 20, 1])
  table = np.array([[0, 3, 6], [1, 4, 7], [2, 5, 8]], np.int32)
  offsets = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  cache_lengths = jnp.asarray(cache, jnp.int32)
  total = int(lens.sum())
  depths = [(kv_heads, 32), (kv_heads, 32)] if kind == "mha" else [
      (kv_heads, 32), (1, 16), (kv_heads, 32)]  # (heads, depth) of k or k_nope, k_rope, v
  normal = lambda rows, h, d: np.clip(rng.standard_normal((rows, h, d)), -3, 3)  # noqa: E731
  unit = np.float32(3.0 / fp8.FP8_MAX[jnp.dtype(E4)])  # |x| <= 3 fits the FP8 range
  k_scale = (unit * rng.uniform(1, 2, kv_heads)).astype(np.float32)
  v_scale = np.full(kv_heads, unit, np.float32)
  new_pos = [c + np.arange(n) for c, n in zip(cache, lens)]
  unused_pos = [np.arange(c + n, table.shape[1] * page_size) for c, n in zip(cache, lens)]
  def slot(pos):  # per sequence its positions -> (page ids, rows) in the pages
    pages = [table[b, p // page_size] for b, p in enumerate(pos)]
    return np.concatenate(pages), np.concatenate(pos) % page_size

  paged = []
  for i, (h, d) in enumerate(depths):
    scale = v_scale if i == len(depths) - 1 else k_scale
    pages = np.array(quantized(normal(9 * page_size, h, d), scale, np.zeros(9 * page_size, int),
                               kv_heads, E4)).reshape(9, page_size, h, d)
    pages[slot(new_pos)] = pages[slot(unused_pos)] = np.nan
    new = quantized(normal(total + 2, h, d), scale, np.zeros(total + 2, int), kv_heads, E4)
    written = pp.paged.write_kv(jnp.asarray(pages), new, offsets, jnp.asarray(table),
                                cache_lengths)
    assert written.dtype == E4
    np.testing.assert_array_equal(np.asarray(written)[slot(new_pos)].view(np.uint8),
                                  np.asarray(new)[:total].view(np.uint8))
    paged.append(pp.PagedKV(written, jnp.asarray(table), cache_lengths))
  q_depth = sum(d for _, d in depths[:-1])
  q = quantized(normal(total, heads, q_depth), unit, np.zeros(total, int), kv_heads, E4)
  kw = dict(max_prompt_len=32, return_lse=True, q_scale=jnp.asarray(unit),
            k_scale=jnp.asarray(k_scale), v_scale=jnp.asarray(v_scale))
  kernel, reference = cases.ENTRY_POINTS[kind]
  expected, ref_lse = reference(q, *paged, offsets, **kw)
  if poison is not None:
    poison()
  out, lse = kernel(q, *paged, offsets, interpret=interpret, **kw)
  out32 = np.asarray(out, np.float32)
  assert out.dtype == jnp.bfloat16 and np.isfinite(out32).all(), f"seed={seed}"
  err = cases.rel_err(out32, expected)
  assert err < TOLERANCE, f"{kind} relative error {err:.2e}, seed={seed}"
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-2, atol=5e-2)
  return err


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_fp8_write_kv_then_prefill_over_the_cache(kind):
  check_write_kv_then_prefill(kind, interpret=True)


def test_write_kv_refuses_rows_of_another_dtype():
  pages = jnp.zeros((4, 16, 2, 32), E4)
  args = (jnp.asarray([0, 3], jnp.int32), jnp.zeros((1, 4), jnp.int32),
          jnp.zeros((1,), jnp.int32))
  with pytest.raises(TypeError, match=r"new_rows \(bfloat16\) must have the pages' dtype "
                                      r"\(float8_e4m3fn\)"):
    pp.paged.write_kv(pages, jnp.zeros((3, 2, 32), jnp.bfloat16), *args)
  with pytest.raises(TypeError, match=r"new_rows \(float8_e5m2\) must have the pages'"):
    pp.paged.write_kv(pages, jnp.zeros((3, 2, 32), jnp.float8_e5m2), *args)


# ---------------------------------------------------------------------------------------
# dot_product_attention: padded batches with lengths or segment ids, a scale per batch row.

_PADDED = test_padded.PaddedCase(t=40, q_lens=(40, 17, 0, 1), dtype="float32")
_SEGMENTS = dataclasses.replace(_PADDED, t=48, q_lens=None, kv_lens=None,
                                segments=test_padded.SEG_ROWS[:3], max_segments=4)
DPA_CASES = [  # (the padded case, in float32 before quantization; K/V dtype, q's, scales)
    (_PADDED, "float8_e4m3fn", None, "kv_heads"),
    (dataclasses.replace(_PADDED, sink=True, lse=True, window=(6, 0)), "float8_e5m2",
     "bfloat16", "batch"),
    (dataclasses.replace(_SEGMENTS, lse=True), "float8_e4m3fn", None, "batch"),
    (dataclasses.replace(_SEGMENTS, is_causal=False, kv_heads=1), "float8_e4m3fn",
     "float16", "scalar"),
]


def check_fp8_padded(case, dtype, q_dtype, scale_shape, *, interpret, poison=None):
  """``dot_product_attention`` on FP8 inputs whose padding rows hold NaN (which Triton
  never reads) against the reference of the clean FP8 values; padding rows must be
  zeros (LSE -1e30). Returns the relative error."""
  seed = cases.fresh_seed()
  rng = np.random.default_rng(seed)
  tag = f"{case.name},{dtype},{q_dtype},{scale_shape} seed={seed}"
  dirty, kw, q_real, clean = test_padded.make_inputs(case, seed, poison=np.nan)
  b = case.batch
  flat = lambda x: np.asarray(x).reshape(-1, *x.shape[2:])  # noqa: E731
  seq = lambda x: np.arange(x.shape[0] * x.shape[1]) // x.shape[1]  # noqa: E731
  dirty_in, clean_in = [], []
  for i, (d, c) in enumerate(zip(dirty, clean)):
    if i == 0 and q_dtype is not None:
      dirty_in.append(jnp.asarray(d, q_dtype))
      clean_in.append(jnp.asarray(c, q_dtype))
      continue
    scale = fp8_scale(flat(c), case.kv_heads, dtype, scale_shape, b, rng)
    kw[("q_scale", "k_scale", "v_scale")[i]] = jnp.asarray(scale)
    for src, dst in ((d, dirty_in), (c, clean_in)):
      dst.append(quantized(flat(src), scale, seq(src), case.kv_heads, dtype).reshape(
          src.shape))
  expected = pp.reference.dot_product_attention_reference(*clean_in, **kw)
  if poison is not None:
    poison()
  result = pp.dot_product_attention(*dirty_in, interpret=interpret, **kw)
  out, lse = result if case.lse else (result, None)
  ref_out, ref_lse = expected if case.lse else (expected, None)
  out32 = np.asarray(out, np.float32)
  assert out.dtype == _expected_dtype(dirty_in[0].dtype) == ref_out.dtype, tag
  assert np.isfinite(out32).all(), tag
  assert not out32[~q_real].any(), f"padding rows not zero: {tag}"
  err = cases.rel_err(out32, ref_out)
  assert err < TOLERANCE, f"relative error {err:.2e}: {tag}"
  if lse is not None:
    lse = np.asarray(lse)
    assert (lse[~q_real] == EMPTY_ROW_LSE).all(), tag
    np.testing.assert_allclose(lse, np.asarray(ref_lse), rtol=1e-2, atol=5e-2, err_msg=tag)
  return err


@pytest.mark.parametrize("case,dtype,q_dtype,scale_shape", DPA_CASES,
                         ids=lambda x: getattr(x, "name", str(x)))
def test_fp8_padded_matches_the_dequantized_reference(case, dtype, q_dtype, scale_shape):
  check_fp8_padded(case, dtype, q_dtype, scale_shape, interpret=True)


# ---------------------------------------------------------------------------------------
# Lowering for an H200 of the Triton kernel's FP8 calls, and "auto" on a call Mosaic GPU
# refuses (a paged FP8 cache under a bf16 q), which then lowers the Triton kernel.

S = jax.ShapeDtypeStruct


def _lowers_to_triton(fn, *args):
  from tests.test_lowering import lower_for_h200  # pylint: disable=g-import-not-at-top
  text = lower_for_h200(fn, *args).as_text()
  assert "__gpu$xla.gpu.triton" in text and "custom_call @mosaic_gpu" not in text


def test_fp8_lowers_for_an_h200():
  def fn(q, k, v, off, ks, vs, qs):
    return pp.mha_prefill(q, k, v, off, max_prompt_len=512, q_scale=qs, k_scale=ks,
                          v_scale=vs, interpret=False, backend="triton")

  _lowers_to_triton(fn, S((1000, 8, 128), E4), S((1000, 2, 128), E4), S((1000, 2, 128), E4),
                    S((5,), jnp.int32), S((2,), jnp.float32), S((2,), jnp.float32),
                    S((4, 2), jnp.float32))


@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
def test_fp8_mla_lowers_for_an_h200(paged):
  """DeepSeek-V3's depths (128 + 64 shared rope, v 128) on 16 heads."""
  table, cache = S((4, 40), jnp.int32), S((4,), jnp.int32)

  def kv(heads, depth):
    if paged:
      return pp.PagedKV(S((160, 64, heads, depth), E4), table, cache)
    return S((1500, heads, depth), E4)

  def fn(q, k_nope, k_rope, v, off, qs, ks, vs):
    return pp.mla_prefill(q, k_nope, k_rope, v, off, max_prompt_len=512, q_scale=qs,
                          k_scale=ks, v_scale=vs, return_lse=True, interpret=False,
                          backend="triton",
                          **({} if paged else dict(kv_input_row_offsets=off)))

  _lowers_to_triton(fn, S((1000, 16, 192), E4), kv(16, 128), kv(1, 64), kv(16, 128),
                    S((5,), jnp.int32), S((), jnp.float32), S((16,), jnp.float32),
                    S((4, 16), jnp.float32))


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_fp8_paged_mha_lowers_for_an_h200(backend):
  table, cache = S((4, 40), jnp.int32), S((4,), jnp.int32)
  kv = pp.PagedKV(S((160, 64, 8, 128), E4), table, cache)

  def fn(q, k, v, off, ks, vs):
    return pp.mha_prefill(q, k, v, off, max_prompt_len=512, k_scale=ks, v_scale=vs,
                          interpret=False, backend=backend)

  _lowers_to_triton(fn, S((2048, 32, 128), jnp.bfloat16), kv, kv, S((5,), jnp.int32),
                    S((4, 8), jnp.float32), S((8,), jnp.float32))


def test_fp8_padded_lowers_for_an_h200():
  def fn(q, k, v, lens, qs, ks, vs):
    return pp.dot_product_attention(q, k, v, query_seq_lengths=lens,
                                    key_value_seq_lengths=lens, is_causal=True, q_scale=qs,
                                    k_scale=ks, v_scale=vs, interpret=False,
                                    backend="triton")

  _lowers_to_triton(fn, S((4, 512, 8, 128), E4), S((4, 512, 2, 128), E4),
                    S((4, 512, 2, 128), E4), S((4,), jnp.int32), S((4, 2), jnp.float32),
                    S((2,), jnp.float32), S((), jnp.float32))


# ---------------------------------------------------------------------------------------
# Bad input, for each entry point: one valid FP8 call (1 sequence of 16 rows, 4 heads over
# 2 K/V heads), each case changing one thing.

def _call(kind, *, q_dtype=E4, kv_dtype=E4, **changes):
  scales = dict(q_scale=jnp.float32(1), k_scale=jnp.float32(1), v_scale=jnp.float32(1))
  scales.update(changes)
  q = jnp.ones((16, 4, 48 if kind == "mla" else 32), q_dtype)
  kv = [jnp.ones((16, 2, 32), kv_dtype)] * 2
  if kind == "mla":
    kv.insert(1, jnp.ones((16, 1, 16), kv_dtype))
  if kind == "dpa":
    return pp.dot_product_attention(q[None], *(x[None] for x in kv), **scales)
  kernel = pp.mha_prefill if kind == "mha" else pp.mla_prefill
  return kernel(q, *kv, jnp.asarray([0, 16], jnp.int32), max_prompt_len=16, **scales)


ERRORS = [
    (dict(k_scale=None), ValueError, "k_scale is needed"),
    (dict(v_scale=None), ValueError, "v_scale is needed"),
    (dict(q_scale=None), ValueError, "q_scale is needed"),
    (dict(v_scale=jnp.ones((3,), jnp.float32)), ValueError,
     r"v_scale must be a scalar, \[num_kv_heads\] = \[2\] or \[batch, num_kv_heads\] = "
     r"\[1, 2\], got \(3,\)"),
    (dict(k_scale=jnp.ones((2, 2), jnp.float32)), ValueError, r"k_scale must be a scalar"),
    (dict(q_scale=jnp.ones((2,), jnp.bfloat16)), TypeError, "q_scale must be float32"),
    (dict(k_scale="1"), TypeError, "k_scale must be a float32 array or a Python float"),
    (dict(q_dtype=jnp.bfloat16), ValueError, "q_scale applies to an FP8"),
    (dict(q_dtype=jnp.float32, q_scale=None), TypeError,
     "over FP8 .* must be FP8, bfloat16 or float16, got float32"),
    (dict(kv_dtype=jnp.bfloat16, q_scale=None, k_scale=None, v_scale=None), TypeError,
     "FP8 q(uery)? needs FP8"),
    (dict(q_dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, q_scale=None, v_scale=None),
     ValueError, "k_scale apply to FP8 inputs only"),
]


@pytest.mark.parametrize("kind", ["mha", "mla", "dpa"])
@pytest.mark.parametrize("changes,error,match", ERRORS, ids=lambda x: str(x)[:30])
def test_fp8_bad_input(kind, changes, error, match):
  with pytest.raises(error, match=match):
    _call(kind, **changes)


def test_fp8_mixed_kv_dtypes_are_refused():
  e5 = jnp.float8_e5m2
  off = jnp.asarray([0, 16], jnp.int32)
  x, one = jnp.ones((16, 2, 32), E4), jnp.float32(1)
  with pytest.raises(TypeError, match="k_nope, k_rope, v must share a dtype"):
    pp.mla_prefill(jnp.ones((16, 4, 48), E4), x, jnp.ones((16, 1, 16), e5), x, off,
                   max_prompt_len=16, q_scale=one, k_scale=one, v_scale=one)
  with pytest.raises(TypeError, match="key and value must share an FP8 dtype"):
    pp.dot_product_attention(jnp.ones((1, 16, 4, 32), E4), x[None], x[None].astype(e5),
                             q_scale=one, k_scale=one, v_scale=one)
  with pytest.raises(TypeError, match="key and value must share an FP8 dtype"):
    pp.dot_product_attention(jnp.ones((1, 16, 4, 32), jnp.bfloat16), x[None],
                             x[None].astype(jnp.bfloat16), k_scale=one, v_scale=one)


def test_fp8_refused_where_mosaic_gpu_does_not_serve_it():
  """Mosaic GPU refuses FP8 it cannot run through ``unsupported_reason`` (``auto`` then
  picks Triton): ``backend="mosaic_gpu"`` and a ``MosaicConfig`` say why, for every entry
  point (e5m2 inputs, which only the Triton kernel reads)."""
  e5 = jnp.float8_e5m2
  x = jnp.ones((16, 4, 32), e5)
  off = jnp.asarray([0, 16], jnp.int32)
  one = jnp.float32(1)
  scales = dict(q_scale=one, k_scale=one, v_scale=one)
  calls = [
      lambda **kw: pp.mha_prefill(x, x[:, :2], x[:, :2], off, max_prompt_len=16, **kw),
      lambda **kw: pp.mla_prefill(jnp.ones((16, 4, 48), e5), x[:, :2], x[:, :1, :16],
                                  x[:, :2], off, max_prompt_len=16, **kw),
      lambda **kw: pp.dot_product_attention(x[None], x[None, :, :2], x[None, :, :2], **kw),
  ]
  for call in calls:
    for kw in (dict(backend="mosaic_gpu"), dict(config=pp.MosaicConfig())):
      with pytest.raises(NotImplementedError, match="cannot run this call: dtype float8_e5m2"):
        call(interpret=False, **scales, **kw)


# ---------------------------------------------------------------------------------------
# Compiled on the GPU (``auto``: whichever kernel serves the call), the output memory
# poisoned first.

def _poison():
  from tests.test_gpu import poison_device_memory  # pylint: disable=g-import-not-at-top
  poison_device_memory()


@pytest.mark.gpu
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c.name)
def test_fp8_compiled_matches_the_dequantized_reference(case):
  check_fp8_case(case, interpret=False, poison=_poison)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_fp8_compiled_write_kv_then_prefill(kind):
  check_write_kv_then_prefill(kind, interpret=False, poison=_poison)


@pytest.mark.gpu
@pytest.mark.parametrize("case,dtype,q_dtype,scale_shape", DPA_CASES,
                         ids=lambda x: getattr(x, "name", str(x)))
def test_fp8_compiled_padded_matches_the_dequantized_reference(case, dtype, q_dtype,
                                                               scale_shape):
  check_fp8_padded(case, dtype, q_dtype, scale_shape, interpret=False, poison=_poison)

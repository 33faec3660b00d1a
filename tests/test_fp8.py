"""FP8 inputs (issue 24, work in progress: the Triton backend's dequantizing path):
against the float32 reference of the dequantized inputs in interpret mode, the lowering
for an H200, and the errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_prefill as pp
from pallas_prefill import fp8, masks
from tests import cases


@dataclasses.dataclass(frozen=True)
class Fp8Case:
  lens: tuple = (0, 1, 37, 100, 64, 19)
  kv_lens: tuple | None = None
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 64
  dtype: str = "float8_e4m3fn"
  q_dtype: str | None = None  # None: FP8 like K/V; else a wider q (an FP8 KV cache)
  scale_shape: str = "kv_heads"  # "scalar", "kv_heads" or "batch"
  mask: object = masks.CausalMask()
  sink: bool = False
  lse: bool = False
  outliers: bool = False  # a few channels 30x larger
  page_size: int | None = None


FP8_CASES = [
    Fp8Case(), Fp8Case(scale_shape="scalar"), Fp8Case(scale_shape="batch"),
    Fp8Case(dtype="float8_e5m2"), Fp8Case(q_dtype="bfloat16"),
    Fp8Case(q_dtype="float16", scale_shape="batch"),
    Fp8Case(mask=masks.NullMask(), lse=True), Fp8Case(mask=masks.SlidingWindowCausalMask(24)),
    Fp8Case(mask=masks.ChunkedCausalMask(32), sink=True, lse=True), Fp8Case(kv_heads=1),
    Fp8Case(kv_lens=(5, 1, 90, 100, 64, 50)), Fp8Case(outliers=True),
    Fp8Case(head_dim=128, outliers=True, q_dtype="bfloat16"),
    Fp8Case(page_size=16, kv_lens=(5, 1, 90, 100, 64, 50)),
]


def _inputs(case: Fp8Case, seed):
  rng = np.random.default_rng(seed)
  kv_lens = case.lens if case.kv_lens is None else case.kv_lens
  q_off = np.concatenate([[0], np.cumsum(case.lens)]).astype(np.int32)
  kv_off = np.concatenate([[0], np.cumsum(kv_lens)]).astype(np.int32)
  batch = len(case.lens)
  total_q, total_kv = int(q_off[-1]) + 3, int(kv_off[-1]) + 3
  if case.kv_lens is None:
    total_kv = total_q

  def normal(rows, heads):
    x = rng.standard_normal((rows, heads, case.head_dim))
    if case.outliers:
      x[..., rng.choice(case.head_dim, 3, replace=False)] *= 30
    return x

  q, k, v = normal(total_q, case.heads), normal(total_kv, case.kv_heads), normal(
      total_kv, case.kv_heads)
  dt = jnp.dtype(case.dtype)

  def quantize(x, heads_of_scale):
    """Per-K/V-head absmax (q's heads grouped under theirs), in the case's scale shape."""
    group = x.shape[1] // heads_of_scale
    top = np.abs(x).reshape(x.shape[0], heads_of_scale, group, -1).max(axis=(0, 2, 3))
    scale = (top / fp8.FP8_MAX[dt]).astype(np.float32)
    if case.scale_shape == "scalar":
      scale = np.float32(scale.max())
    x8 = jnp.asarray(x / np.repeat(np.broadcast_to(scale, (heads_of_scale,)), group)[
        None, :, None], jnp.float32).astype(dt)
    s = jnp.asarray(scale)
    if case.scale_shape == "batch":
      s = jnp.broadcast_to(s, (batch, heads_of_scale)) * jnp.asarray(
          rng.uniform(1.0, 1.0, (batch, 1)), jnp.float32)
    return x8, s

  k8, ks = quantize(k, case.kv_heads)
  v8, vs = quantize(v, case.kv_heads)
  kw = dict(max_prompt_len=max(max(case.lens), 1), mask=case.mask, return_lse=case.lse,
            k_scale=ks, v_scale=vs)
  if case.q_dtype is None:
    q_in, kw["q_scale"] = quantize(q, case.kv_heads)
  else:
    q_in = jnp.asarray(q, case.q_dtype)
  if case.sink:
    kw["sink_weights"] = jnp.asarray(rng.standard_normal(case.heads), jnp.float32)
  args = [q_in, k8, v8]
  if case.page_size is not None:
    args = [q_in, *cases.to_pages((k8, v8), kv_off, np.asarray(case.lens), case.page_size,
                                  rng)]
  elif case.kv_lens is not None:
    kw["kv_input_row_offsets"] = jnp.asarray(kv_off)
  return (*args, jnp.asarray(q_off)), kw, int(q_off[-1])


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: repr(c)[7:80])
def test_fp8_matches_the_dequantized_reference(case):
  seed = cases.fresh_seed()
  args, kw, last = _inputs(case, seed)
  expected = pp.reference.mha_prefill_reference(*args, **kw)
  result = pp.mha_prefill(*args, interpret=True, **kw)
  out, lse = result if case.lse else (result, None)
  ref_out, ref_lse = expected if case.lse else (expected, None)
  out32 = np.asarray(out, np.float32)
  assert out.dtype == (jnp.bfloat16 if case.q_dtype is None else jnp.dtype(case.q_dtype))
  assert np.isfinite(out32).all()
  err = cases.rel_err(out32, ref_out)
  assert err < 5e-2, (case, seed, err)
  assert not out32[last:].any()
  if lse is not None:
    np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-2, atol=5e-2)


def test_fp8_lowers_for_an_h200():
  from tests.test_lowering import lower_for_h200  # pylint: disable=g-import-not-at-top
  s = jax.ShapeDtypeStruct
  e4 = jnp.float8_e4m3fn

  def fn(q, k, v, off, ks, vs, qs):
    return pp.mha_prefill(q, k, v, off, max_prompt_len=512, q_scale=qs, k_scale=ks,
                          v_scale=vs, interpret=False)

  text = lower_for_h200(fn, s((1000, 8, 128), e4), s((1000, 2, 128), e4),
                        s((1000, 2, 128), e4), s((5,), jnp.int32), s((2,), jnp.float32),
                        s((2,), jnp.float32), s((4, 2), jnp.float32)).as_text()
  assert "__gpu$xla.gpu.triton" in text  # auto: Triton serves FP8 (Mosaic GPU not yet)


ERRORS = [
    (dict(k_scale=None), ValueError, "k_scale is needed"),
    (dict(v_scale=jnp.ones((3,), jnp.float32)), ValueError, "v_scale must be a scalar"),
    (dict(k_scale=jnp.ones((2,), jnp.bfloat16)), TypeError, "k_scale must be float32"),
    (dict(q_scale=None), ValueError, "q_scale is needed"),
    (dict(q=jnp.ones((16, 4, 32), jnp.bfloat16)), ValueError, "q_scale applies"),
]


@pytest.mark.parametrize("changes,error,match", ERRORS, ids=lambda x: str(x)[:30])
def test_fp8_bad_input(changes, error, match):
  e4 = jnp.float8_e4m3fn
  kw = dict(q=jnp.ones((16, 4, 32), e4), k=jnp.ones((16, 2, 32), e4),
            v=jnp.ones((16, 2, 32), e4), q_scale=jnp.float32(1), k_scale=jnp.float32(1),
            v_scale=jnp.float32(1))
  kw.update(changes)
  q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
  with pytest.raises(error, match=match):
    pp.mha_prefill(q, k, v, jnp.asarray([0, 16], jnp.int32), max_prompt_len=16, **kw)


def test_fp8_q_needs_fp8_kv_and_bf16_needs_no_scales():
  e4 = jnp.float8_e4m3fn
  off = jnp.asarray([0, 16], jnp.int32)
  with pytest.raises(TypeError, match="FP8 q needs FP8 k and v"):
    pp.mha_prefill(jnp.ones((16, 4, 32), e4), jnp.ones((16, 2, 32), jnp.bfloat16),
                   jnp.ones((16, 2, 32), jnp.bfloat16), off, max_prompt_len=16)
  with pytest.raises(ValueError, match="apply to FP8 inputs only"):
    x = jnp.ones((16, 4, 32), jnp.bfloat16)
    pp.mha_prefill(x, x[:, :2], x[:, :2], off, max_prompt_len=16, k_scale=jnp.float32(1))


@pytest.mark.gpu
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: repr(c)[7:80])
def test_fp8_compiled_matches_the_dequantized_reference(case):
  """The same cases compiled on the GPU (``auto``: the Triton kernel serves FP8)."""
  args, kw, last = _inputs(case, cases.fresh_seed())
  expected = pp.reference.mha_prefill_reference(*args, **kw)
  result = pp.mha_prefill(*args, interpret=False, **kw)
  out = result[0] if case.lse else result
  ref = expected[0] if case.lse else expected
  assert np.isfinite(np.asarray(out, np.float32)).all()
  assert cases.rel_err(np.asarray(out, np.float32), ref) < 5e-2
  assert not np.asarray(out, np.float32)[last:].any()


def test_fp8_refused_where_it_is_not_served():
  e4 = jnp.float8_e4m3fn
  x = jnp.ones((16, 4, 32), e4)
  off = jnp.asarray([0, 16], jnp.int32)
  one = jnp.float32(1)
  for kw in (dict(backend="mosaic_gpu"), dict(config=pp.MosaicConfig())):
    with pytest.raises(NotImplementedError, match="FP8 inputs run on the Triton kernel"):
      pp.mha_prefill(x, x[:, :2], x[:, :2], off, max_prompt_len=16, q_scale=one,
                     k_scale=one, v_scale=one, interpret=False, **kw)
  with pytest.raises(TypeError, match="mla_prefill takes no FP8"):
    pp.mla_prefill(jnp.ones((16, 4, 48), e4), x, x[:, :1, :16], x, off, max_prompt_len=16)
  with pytest.raises(TypeError, match="float8"):
    pp.dot_product_attention(x[None], x[None, :, :2], x[None, :, :2])

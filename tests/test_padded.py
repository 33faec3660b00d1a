"""``dot_product_attention``: padded batches with lengths and segment ids, against our
float32 reference and against ``jax.nn.dot_product_attention`` (XLA), in interpret mode;
its lowering for an H200 (both backends) with no copy of Q, K, V or the output around the
kernel; and its errors. ``PADDED_CASES`` run compiled on the H200 in ``test_gpu.py``."""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_prefill as pp
from pallas_prefill import config as config_lib
from pallas_prefill import masks
from pallas_prefill.constants import EMPTY_ROW_LSE, SINK_MAX
from tests import cases as shared


@dataclasses.dataclass(frozen=True)
class PaddedCase:
  """One padded call. q_lens: per batch row (None: no query_seq_lengths); kv_lens: "same"
  (key_value_seq_lengths = q_lens), None (not given) or per row; segments: rows of segment
  ids (then no lengths), kv_segments: the K/V rows' ids for cross-attention."""

  t: int = 64
  s: int | None = None  # None: t
  q_lens: tuple | None = (64, 17, 0, 1, 33)
  kv_lens: tuple | str | None = "same"
  segments: tuple | None = None
  kv_segments: tuple | None = None
  padding_id: int | None = 0
  max_segments: int | None = None
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 64
  head_dim_v: int | None = None
  dtype: str = "bfloat16"
  is_causal: bool = True
  window: object = None
  sink: bool = False
  lse: bool = False
  soft_cap: float | None = None
  output_dtype: str | None = None
  jit: bool = False  # lengths / ids traced under the caller's jit

  @property
  def name(self) -> str:
    def show(name, value):  # segment ids by their first row's runs, not all their ids
      if name in ("segments", "kv_segments"):
        return f"{name}=" + "/".join(f"{a}+{n}" for a, n in _runs(value[:1], self.padding_id)[0])
      return f"{name}={value}"
    fields = [show(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)
              if getattr(self, f.name) != f.default]
    return ",".join(fields) or "base"

  @property
  def batch(self) -> int:
    rows = self.segments if self.segments is not None else self.q_lens
    return len(rows) if rows is not None else 3


def _runs(ids, padding_id):
  """Rows of ids -> per row the list of (start, length) runs."""
  out = []
  for row in ids:
    runs, prev = [], None
    for i, x in enumerate(row):
      if x == padding_id:
        prev = None
        continue
      if x != prev:
        runs.append([i, 0])
      runs[-1][1] += 1
      prev = x
    out.append(runs)
  return out


SEG_ROWS = (  # t = 48: padding in the middle and at the end, leading padding, none, all
    (1,) * 10 + (2,) * 5 + (0,) * 3 + (3,) * 20 + (0,) * 10,
    (0,) * 4 + (7,) * 44,
    (0,) * 48,
    (5,) * 48,
    (1, 1, 2, 2, 2, 3) * 8,
)
KV_SEG_ROWS = (  # s = 40 for the cross-attention pair: the k-th runs pair up
    (4,) * 7 + (0,) * 3 + (5,) * 20 + (6,) * 10,
    (1,) * 40,
    (0,) * 40,
    (2,) * 13 + (0,) * 27,
    (1,) * 10 + (2,) * 10 + (0,) * 20,
)


def _cases():
  base = PaddedCase()
  r = dataclasses.replace
  seg = r(base, t=48, q_lens=None, kv_lens=None, segments=SEG_ROWS, max_segments=32)
  cross = r(base, t=48, s=80, q_lens=(48, 5, 0, 20), kv_lens=(80, 0, 7, 33))
  return [
      base,
      r(base, is_causal=False),
      r(base, t=37, q_lens=(37, 36, 8, 0)),  # T not a multiple of any tile
      r(base, q_lens=None, kv_lens=None),  # every row full
      r(base, kv_lens=None),  # only the queries' lengths: every key is real
      r(base, kv_heads=4), r(base, kv_heads=1), r(base, heads=8, kv_heads=2),
      r(base, window=(5, 0)), r(base, window=(7, 3)), r(base, window=4),
      r(base, window=(4, 0), is_causal=False),
      r(base, sink=True, lse=True), r(base, lse=True, output_dtype="float32"),
      r(base, soft_cap=1.5, lse=True), r(base, soft_cap=30.0, sink=True, lse=True),
      r(base, head_dim=128), r(base, head_dim=96, head_dim_v=32), r(base, head_dim=32),
      r(base, dtype="float16"), r(base, dtype="float32"),
      cross, r(cross, is_causal=False, lse=True), r(cross, sink=True, lse=True),
      r(cross, window=(6, 0)),
      seg, r(seg, is_causal=False, lse=True), r(seg, sink=True, lse=True, window=(5, 0)),
      r(seg, soft_cap=2.0), r(seg, max_segments=None),
      r(seg, segments=tuple(tuple(-1 if x == 0 else x for x in row) for row in SEG_ROWS),
        padding_id=-1),  # Levanter's padding id
      r(seg, segments=SEG_ROWS[3:], padding_id=None),  # no padding id
      r(seg, max_segments=24, segments=SEG_ROWS[4:] + SEG_ROWS[:1]),  # exactly enough
      r(seg, s=40, kv_segments=KV_SEG_ROWS, lse=True),  # cross-attention pair
      r(seg, s=40, kv_segments=KV_SEG_ROWS, is_causal=False),
      r(base, jit=True, lse=True), r(seg, jit=True, sink=True, lse=True),
  ]


PADDED_CASES = _cases()


def random_padded_case(rng, *, large: bool = False) -> PaddedCase:
  """A random padded call, for tests that draw fresh ones each run
  (``cases.check_random_draws``): lengths (0, 1, full, off the tiles) for queries and keys alike, or the keys'
  own over a longer or shorter S (cross-attention), or segment ids (runs of random
  lengths, padding anywhere, MaxText's 0, Levanter's -1 or none); MHA, GQA or MQA,
  causal or not, the windows the masks express, sinks, the LSE, a soft cap, bf16 or
  f16, the lengths or ids traced under jit now and then."""
  b = int(rng.integers(1, 6))
  t = int(rng.choice([1000, 2048, 4096] if large else [16, 37, 64, 129]))
  kv_heads = int(rng.choice([1, 2, 8] if large else [1, 2]))
  causal = bool(rng.random() < 0.7)
  left, right = int(rng.integers(0, t)), int(rng.integers(0, t))
  windows = [None, None, (left, 0)] + ([left, (left, right)] if causal else [])
  fields = dict(
      t=t, heads=kv_heads * int(rng.choice([1, 2, 4])), kv_heads=kv_heads,
      head_dim=int(rng.choice([128, 64] if large else [32, 64, 128])),
      dtype="float16" if rng.random() < 0.2 else "bfloat16", is_causal=causal,
      window=windows[int(rng.integers(len(windows)))], sink=bool(rng.random() < 0.3),
      lse=bool(rng.random() < 0.5), soft_cap=[None, None, 2.0, 30.0][int(rng.integers(4))],
      jit=bool(rng.random() < 0.2))
  lengths = lambda n, size: tuple(  # noqa: E731
      int(rng.choice([0, 1, size, int(rng.integers(0, size + 1))])) for _ in range(n))
  layout = int(rng.integers(3))
  if layout == 0:
    return PaddedCase(q_lens=lengths(b, t), kv_lens="same", **fields)
  if layout == 1:
    s = int(rng.choice([1, t // 2 + 1, 2 * t + 3]))
    return PaddedCase(s=s, q_lens=lengths(b, t),
                      kv_lens=lengths(b, s) if rng.random() < 0.8 else None, **fields)
  padding_id = [0, -1, None][int(rng.integers(3))]
  rows = []
  for _ in range(b):
    row, next_id = [], 1
    while len(row) < t:
      n = int(rng.integers(1, max(2, t // 3)))
      if padding_id is not None and rng.random() < 0.25:
        row += [padding_id] * n
      else:
        row += [next_id] * n
        next_id += 1
    rows.append(tuple(row[:t]))
  most = max(max(len(r) for r in _runs(rows, padding_id)), 1)
  return PaddedCase(q_lens=None, kv_lens=None, segments=tuple(rows), padding_id=padding_id,
                    max_segments=1 << (most - 1).bit_length(), **fields)


def make_inputs(case: PaddedCase, seed: int, *, poison):
  """(args, kwargs, real [b, t] bool, clean args): q, k, v with every padding row set to
  `poison` (NaN where the backend must never read them, a large finite value where it
  may read but must weigh them zero), and the same arrays with zero padding."""
  rng = np.random.default_rng(seed)
  b, t, s = case.batch, case.t, case.s or case.t
  dt = jnp.dtype(case.dtype)
  dv = case.head_dim_v or case.head_dim
  q = rng.standard_normal((b, t, case.heads, case.head_dim))
  k = rng.standard_normal((b, s, case.kv_heads, case.head_dim))
  v = rng.standard_normal((b, s, case.kv_heads, dv))
  kw = dict(is_causal=case.is_causal, local_window_size=case.window,
            logits_soft_cap=case.soft_cap, return_lse=case.lse,
            output_dtype=case.output_dtype)
  if case.sink:
    kw["sink_weights"] = jnp.asarray(rng.standard_normal(case.heads) * 2, jnp.float32)
  if case.segments is not None:
    q_ids = np.asarray(case.segments, np.int32)
    kv_ids = q_ids if case.kv_segments is None else np.asarray(case.kv_segments, np.int32)
    kw.update(segment_ids=jnp.asarray(q_ids) if case.kv_segments is None else (
        jnp.asarray(q_ids), jnp.asarray(kv_ids)), padding_segment_id=case.padding_id,
              max_segments=case.max_segments)
    bound = case.max_segments or 10**9
    q_real = np.zeros((b, t), bool)
    kv_real = np.zeros((b, s), bool)
    for real, ids in ((q_real, q_ids), (kv_real, kv_ids)):
      for row, runs in enumerate(_runs(ids, case.padding_id)):
        for start, n in runs[:bound]:
          real[row, start:start + n] = True
  else:
    q_lens = np.full(b, t) if case.q_lens is None else np.asarray(case.q_lens)
    kv_lens = {"same": case.q_lens, None: None}.get(case.kv_lens, case.kv_lens) if (
        isinstance(case.kv_lens, (str, type(None)))) else case.kv_lens
    kv_lens = np.full(b, s) if kv_lens is None else np.asarray(kv_lens)
    if case.q_lens is not None:
      kw["query_seq_lengths"] = jnp.asarray(q_lens, jnp.int32)
    if case.kv_lens is not None:
      kw["key_value_seq_lengths"] = jnp.asarray(kv_lens, jnp.int32)
    q_real = np.arange(t)[None] < q_lens[:, None]
    kv_real = np.arange(s)[None] < kv_lens[:, None]
  clean = [np.where(real[:, :, None, None], x, 0.0) for x, real in
           ((q, q_real), (k, kv_real), (v, kv_real))]
  dirty = [np.where(real[:, :, None, None], x, poison) for x, real in
           ((q, q_real), (k, kv_real), (v, kv_real))]
  to = lambda xs: tuple(jnp.asarray(x, dt) for x in xs)  # noqa: E731
  return to(dirty), kw, q_real, to(clean)


def _call(case, args, kw, **extra):
  if not case.jit:
    return pp.dot_product_attention(*args, **kw, **extra)
  traced = {n: kw.pop(n) for n in ("query_seq_lengths", "key_value_seq_lengths",
                                   "segment_ids", "sink_weights") if n in kw}
  return jax.jit(lambda a, tr: pp.dot_product_attention(*a, **tr, **kw, **extra))(args,
                                                                                  traced)


_NN_LOGITS = 1 << 27  # jax.nn's XLA path holds a batch row's logits: 512 MiB in float32


def _nn_by_row(clean, nn_kw):
  """``jax.nn.dot_product_attention`` (XLA) one batch row at a time (bounded memory)."""
  rows = []
  for i in range(clean[0].shape[0]):
    kw = {n: (x[i:i + 1] if n.endswith("lengths") else x) for n, x in nn_kw.items()}
    rows.append(np.asarray(jax.nn.dot_product_attention(
        *(x[i:i + 1] for x in clean), implementation="xla", **kw), np.float32))
  return np.concatenate(rows)


def check_padded(case: PaddedCase, *, interpret, backend="triton", config=None):
  """Runs the case on fresh random inputs whose padding rows are poisoned; compares with
  the float32 reference everywhere (padding rows: zeros, LSE -1e30) and, on the rows
  that see a key, with ``jax.nn.dot_product_attention`` where it has the arguments."""
  seed = shared.fresh_seed()
  tag = f"{case.name} seed={seed}"
  poison = np.nan if backend == "triton" else 1e3
  args, kw, q_real, clean = make_inputs(case, seed, poison=poison)
  expected = pp.reference.dot_product_attention_reference(*clean, **kw)
  result = _call(case, args, dict(kw), backend=backend, interpret=interpret, config=config)
  out, lse = result if case.lse else (result, None)
  ref_out, ref_lse = expected if case.lse else (expected, None)
  assert out.shape == ref_out.shape and out.dtype == ref_out.dtype, tag
  out32 = np.asarray(out, np.float32)
  assert np.isfinite(out32).all(), f"non-finite output: {tag}"
  assert not np.any(out32[~q_real]), f"padding rows not zero: {tag}"
  err = shared.rel_err(out32, ref_out)
  assert err < shared.TOLERANCE[case.dtype], f"relative error {err:.2e}: {tag}"
  if lse is not None:
    lse = np.asarray(lse)
    assert lse.shape == out.shape[:3] and lse.dtype == np.float32, tag
    assert (lse[~q_real] == EMPTY_ROW_LSE).all(), tag
    np.testing.assert_allclose(lse, np.asarray(ref_lse), rtol=1e-3, atol=2e-2, err_msg=tag)
  _, t, n = clean[0].shape[:3]
  if not (case.sink or case.soft_cap or case.segments is not None or (
      case.head_dim_v not in (None, case.head_dim)) or (  # what jax.nn has the arguments for
          n * t * clean[1].shape[1] > _NN_LOGITS)):  # and memory for (logits in float32)
    # jax.nn on the clean arrays (its XLA path multiplies padding by zero: NaN would
    # spread); rows that see no key are ours to define (zeros), jax.nn's are undefined.
    nn_kw = {n: kw[n] for n in ("query_seq_lengths", "key_value_seq_lengths",
                                "is_causal", "local_window_size") if n in kw}
    nn = _nn_by_row(clean, nn_kw)
    ones = [jnp.ones_like(x) for x in clean]
    sees = np.asarray(pp.reference.dot_product_attention_reference(*ones, **{
        **kw, "return_lse": False, "sink_weights": None}))[..., 0] > 0
    diff = np.where(sees[..., None], out32 - nn, 0)
    scale = max(float(np.abs(nn[sees]).max(initial=0)), 1.0)
    assert np.abs(diff).max() <= 4 * shared.TOLERANCE[case.dtype] * scale, tag
  return err


@pytest.mark.parametrize("case", PADDED_CASES, ids=lambda c: c.name)
def test_padded_interpret(case):
  check_padded(case, interpret=True)


def test_random_padded_cases_interpret():
  """Fresh random padded calls each run (``random_padded_case``; a failure names the
  draws' seed)."""
  shared.check_random_draws(random_padded_case,
                            lambda case: check_padded(case, interpret=True), 4)


# --------------------------------------------------------------------------------------
# Lowering for an H200: both backends, and nothing copied around the kernel.

def _lower(backend, *, lengths=True, segments=False, b=4, t=512, heads=8, kv_heads=2,
           depth=128, soft_cap=None):
  from tests.test_lowering import lower_for_h200  # pylint: disable=g-import-not-at-top
  s = jax.ShapeDtypeStruct
  q = s((b, t, heads, depth), jnp.bfloat16)
  kv = s((b, t, kv_heads, depth), jnp.bfloat16)
  lens = s((b,), jnp.int32)
  ids = s((b, t), jnp.int32)

  def fn(q, k, v, lens, ids):
    kw = dict(query_seq_lengths=lens, key_value_seq_lengths=lens) if lengths else {}
    if segments:
      kw = dict(segment_ids=ids, padding_segment_id=0, max_segments=4)
    return pp.dot_product_attention(q, k, v, is_causal=True, backend=backend,
                                    interpret=False, logits_soft_cap=soft_cap, **kw)
  return lower_for_h200(fn, q, kv, kv, lens, ids)


def _kernel_call(module):
  """The attention kernel's custom call: the one with the largest operands (Mosaic GPU's
  work-list kernel is another, over the offsets alone)."""
  from tests import lowered  # pylint: disable=g-import-not-at-top
  return max(lowered.custom_calls(module), key=lambda c: sum(
      int(np.prod(o.type.shape)) for o in c.operands if hasattr(o.type, "shape")))


def _producers(value):
  """Op names from `value` back to a block argument (through single-operand ops)."""
  names = []
  while True:
    owner = value.owner
    if not hasattr(owner, "name"):
      return names  # a block argument
    names.append(owner.name)
    if len(owner.operands) != 1:
      return names
    value = owner.operands[0]


@pytest.mark.parametrize("backend", ["triton", "mosaic_gpu"])
@pytest.mark.parametrize("layout", ["lengths", "segments", "full"])
def test_padded_lowers_without_copies(backend, layout):
  """Q, K and V reach the kernel as reshapes of the arguments, and the output leaves it
  through a reshape: no pad, gather, concatenate or transpose of them in between."""
  lowered = _lower(backend, lengths=layout == "lengths", segments=layout == "segments")
  module = lowered.compiler_ir()
  call = _kernel_call(module)
  big = [o for o in call.operands if len(o.type.shape) == 3 and o.type.shape[0] == 4 * 512]
  assert len(big) == 3, [str(o.type) for o in call.operands]
  for operand in big:
    chain = _producers(operand)
    assert set(chain) <= {"stablehlo.reshape"}, chain
  out = call.results[0]
  users = [u.owner.name for u in out.uses]
  assert users and set(users) <= {"stablehlo.reshape", "func.return"}, users


LOWERED_CASES = [c for c in PADDED_CASES if not c.jit and c.dtype == "bfloat16"]


def test_the_keyless_units_options_lower_and_change_the_kernel():
  """The key-less units' options through ``dot_product_attention``'s config: the
  default (a unit per key-less item for all heads, first: ``keyless_units``), those
  units spread among the others, a unit per (head, item) that skips its Q loads, one
  that loads Q like the others (``skip_keyless_q=False``), and zero jobs of the keyed
  units stored without TMA ("stores", and as contiguous runs of rows: "spans"), or
  copied by the TMA unit from a buffer of zeros ("bulk"): each kernel lowers for an
  H200, and no two are the same."""
  from tests import lowered  # pylint: disable=g-import-not-at-top
  texts = []
  for options in (pp.MosaicOptions(), pp.MosaicOptions(keyless_units="spread"),
                  pp.MosaicOptions(keyless_units="per_head"),
                  pp.MosaicOptions(keyless_units="per_head", skip_keyless_q=False),
                  pp.MosaicOptions(keyless_units="stores"),
                  pp.MosaicOptions(keyless_units="spans"),
                  pp.MosaicOptions(keyless_units="bulk")):
    from tests.test_lowering import lower_for_h200  # pylint: disable=g-import-not-at-top
    s = jax.ShapeDtypeStruct
    q = s((4, 512, 8, 128), jnp.bfloat16)
    kv = s((4, 512, 2, 128), jnp.bfloat16)
    config = pp.MosaicConfig(options=options)
    fn = lambda q, k, v, n: pp.dot_product_attention(  # noqa: E731
        q, k, v, query_seq_lengths=n, key_value_seq_lengths=n, is_causal=True,
        config=config, interpret=False)
    module = lower_for_h200(fn, q, kv, kv, s((4,), jnp.int32)).compiler_ir()
    texts.append(lowered.kernel_texts(module)[-1])
  assert len(set(texts)) == 7
  assert all("st.global.cs" in t for t in texts[-3:-1]) and "st.global.cs" not in texts[0]
  bulk = "cp.async.bulk.global.shared::cta.bulk_group"
  assert bulk in texts[-1] and "st.global.cs" not in texts[-1] and bulk not in texts[-2]


# short prompts (two compute warpgroups), long, longest (three)
@pytest.mark.parametrize("max_len", [512, 2048, 9000])
def test_padded_default_stores_zero_jobs(max_len):
  """``config=None`` on ``dot_product_attention``'s layouts gives the padding rows' zeros
  to the keyed units as zero jobs (``default_mosaic_config(padded=True)``): with two
  compute warpgroups at depth 128 copied by the TMA unit (``keyless_units="bulk"``,
  ``cp.async.bulk``), with the LSE too, and as "spans" where a float32 output leaves no
  room for the buffer of zeros (``smem.fitted``); with three (max_len 9000) "stores"
  (plain ``st.global.cs`` stores); at depth 64 "spans" up to
  ``COLUMN_MASK_MAX_PROMPT``, "stores" above; FP8 keeps the key-less units (its zero
  jobs measured mixed), and so do the packed entry point's default and the padded
  call's with a ``MosaicConfig()`` given ("first")."""
  from tests import lowered  # pylint: disable=g-import-not-at-top
  from tests.test_lowering import lower_for_h200  # pylint: disable=g-import-not-at-top
  s = jax.ShapeDtypeStruct
  q, kv, n = (s((2, max_len, 8, 128), jnp.bfloat16), s((2, max_len, 2, 128), jnp.bfloat16),
              s((2,), jnp.int32))

  def zero_jobs(fn, *args):
    """"stores" (plain stores), "bulk" (bulk copies), or None (neither)."""
    text = lowered.kernel_texts(lower_for_h200(fn, *args).compiler_ir())[-1]
    if "st.global.cs" in text:
      return "stores"
    return "bulk" if "cp.async.bulk.global.shared::cta.bulk_group" in text else None

  def padded(**kw):
    return lambda q, k, v, n: pp.dot_product_attention(  # noqa: E731
        q, k, v, query_seq_lengths=n, key_value_seq_lengths=n, is_causal=True,
        backend="mosaic_gpu", interpret=False, **kw)

  two = max_len <= config_lib.THREE_WGS_MIN_PROMPT
  assert zero_jobs(padded(), q, kv, kv, n) == ("bulk" if two else "stores")
  assert zero_jobs(padded(return_lse=True), q, kv, kv, n) == ("bulk" if two else "stores")
  assert zero_jobs(padded(output_dtype=jnp.float32), q, kv, kv, n) == "stores"
  assert zero_jobs(padded(config=pp.MosaicConfig()), q, kv, kv, n) is None
  offsets = s((3,), jnp.int32)
  assert zero_jobs(lambda q, k, v, o: pp.mha_prefill(  # noqa: E731
      q, k, v, o, max_prompt_len=max_len, backend="mosaic_gpu", interpret=False),
      s((2 * max_len, 8, 128), jnp.bfloat16), s((2 * max_len, 2, 128), jnp.bfloat16),
      s((2 * max_len, 2, 128), jnp.bfloat16), offsets) is None
  short = max_len <= config_lib.COLUMN_MASK_MAX_PROMPT
  for dtype in (jnp.bfloat16, jnp.float16):
    config = config_lib.default_mosaic_config(128, 128, dtype, masks.CausalMask(), max_len,
                                              padded=True)
    assert config.compute_wgs == (2 if two else 3)
    assert config.options.keyless_units == ("bulk" if two else "stores")
    config = config_lib.default_mosaic_config(64, 64, dtype, masks.CausalMask(), max_len,
                                              padded=True)
    assert config.options.keyless_units == ("spans" if short else "stores")
  from pallas_prefill import mosaic_gpu  # pylint: disable=g-import-not-at-top
  fitted = mosaic_gpu.fitted(
      config_lib.default_mosaic_config(128, 128, jnp.bfloat16, masks.CausalMask(), 512,
                                       padded=True),
      [types.SimpleNamespace(width=128)], 128, jnp.bfloat16, jnp.float32, False)
  assert fitted.options.keyless_units == "spans"
  fp8 = config_lib.default_mosaic_config(128, 128, jnp.float8_e4m3fn, masks.CausalMask(),
                                         max_len, padded=True)
  assert fp8.options.keyless_units == "first"


@pytest.mark.parametrize("backend", ["triton", "mosaic_gpu"])
@pytest.mark.parametrize("case", LOWERED_CASES, ids=lambda c: c.name)
def test_padded_case_lowers_for_an_h200(case, backend):
  """Every bf16 case of the matrix lowers for an H200 on both backends (the kernels'
  real lowering, no GPU needed): the kernel's custom call, no fallback."""
  from tests.test_lowering import lower_for_h200  # pylint: disable=g-import-not-at-top
  args, kw, _, _ = make_inputs(case, 0, poison=0.0)
  arrays = {n: kw.pop(n) for n in ("query_seq_lengths", "key_value_seq_lengths",
                                   "segment_ids", "sink_weights") if n in kw}
  if case.segments is not None and kw["max_segments"] is None:
    kw["max_segments"] = 8
  fn = lambda a, arr: pp.dot_product_attention(*a, **arr, **kw, backend=backend,  # noqa: E731
                                               interpret=False)
  text = lower_for_h200(fn, args, arrays).as_text()
  target = "custom_call @mosaic_gpu" if backend == "mosaic_gpu" else "__gpu$xla.gpu.triton"
  assert target in text


# --------------------------------------------------------------------------------------
# Errors.

def _args(b=2, t=16, s=None, heads=4, kv_heads=2, depth=32, dtype=jnp.float32):
  s = s or t
  x = jnp.ones((b, t, heads, depth), dtype)
  kv = jnp.ones((b, s, kv_heads, depth), dtype)
  return x, kv, kv


ERRORS = [
    (dict(query=jnp.ones((16, 4, 32))), ValueError, "query must have rank 4"),
    (dict(key=pp.PagedKV(jnp.ones((4, 16, 2, 32)), jnp.zeros((2, 2), jnp.int32),
                         jnp.zeros((2,), jnp.int32))), TypeError,
     r"^key must be a \[batch, seq, heads, depth\] array: a PagedKV cache goes to"),
    (dict(value=jnp.ones((2, 16, 2, 32), jnp.bfloat16)), TypeError, "share a dtype"),
    (dict(key=jnp.ones((3, 16, 2, 32))), ValueError, "batch"),
    (dict(key=jnp.ones((2, 16, 3, 32)), value=jnp.ones((2, 16, 3, 32))), ValueError,
     "multiple of num_kv_heads"),
    (dict(query_seq_lengths=jnp.ones((3,), jnp.int32)), ValueError, "query_seq_lengths"),
    (dict(query_seq_lengths=jnp.ones((2,), jnp.float32)), TypeError, "query_seq_lengths"),
    (dict(query_seq_lengths=jnp.ones((2, 1), jnp.int32)), ValueError, "query_seq_lengths"),
    (dict(query_seq_lengths=jnp.asarray([3, 17], jnp.int32)), ValueError,
     r"query_seq_lengths\[1\] = 17"),
    (dict(key_value_seq_lengths=jnp.asarray([-1, 2], jnp.int32)), ValueError,
     "key_value_seq_lengths"),
    (dict(segment_ids=jnp.ones((2, 15), jnp.int32)), ValueError, "segment_ids"),
    (dict(segment_ids=jnp.ones((2, 16), jnp.float32)), TypeError, "segment_ids"),
    (dict(segment_ids=jnp.ones((2, 16), jnp.int32),
          query_seq_lengths=jnp.ones((2,), jnp.int32)), ValueError, "one or the other"),
    (dict(segment_ids=jnp.asarray([[1, 2] * 8] * 2, jnp.int32), max_segments=4),
     ValueError, "more than max_segments = 4"),
    (dict(segment_ids=jnp.ones((2, 16), jnp.int32), max_segments=0), ValueError,
     "max_segments"),
    (dict(padding_segment_id=0), ValueError, "go with segment_ids"),
    (dict(local_window_size=(3, 2)), ValueError, "cannot express"),
    (dict(local_window_size=(-1, 0), is_causal=True), ValueError, "non-negative"),
    (dict(local_window_size="3"), TypeError, "local_window_size"),
    (dict(is_causal=1), TypeError, "is_causal"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    (dict(logits_soft_cap=-2.0), ValueError, "logits_soft_cap"),
    (dict(sink_weights=jnp.ones((3,))), ValueError, "sink_weights"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(local_window_size=(2**31, 0), is_causal=True), ValueError,
     r"local_window_size must be below 2\*\*30 on each side"),
    (dict(local_window_size=(0, 2**31)), ValueError,
     r"local_window_size must be below 2\*\*30 on each side"),
    (dict(segment_ids=jnp.ones((2, 16), jnp.int32), padding_segment_id=2**40), ValueError,
     "padding_segment_id must fit in int32"),
    (dict(segment_ids=jnp.ones((2, 16), jnp.int8), padding_segment_id=1000), ValueError,
     r"padding_segment_id 1000 is not a value of segment_ids \(queries\)'s dtype int8"),
    (dict(segment_ids=jnp.ones((2, 16), jnp.uint32), padding_segment_id=-1), ValueError,
     "padding_segment_id -1 is not a value of .* uint32"),
    # NumPy int64 ids become int32 in JAX (jax_enable_x64 off), 2**32 + 1 becoming 1: runs
    # merged silently once (and 2**32 with padding id 0 became padding).
    (dict(segment_ids=np.asarray([[2**32 + 1] * 8 + [1] * 8] * 2)), ValueError,
     r"segment_ids \(queries\)\[0, 0\] = 4294967297 does not fit in int32"),
    (dict(segment_ids=(np.ones((2, 16), np.int32), np.asarray([[1] * 15 + [-2**40]] * 2))),
     ValueError, r"segment_ids \(keys/values\)\[0, 15\] = -1099511627776 does not fit"),
    (dict(segment_ids=jnp.ones((2, 16), jnp.int32), max_segments=20_000), ValueError,
     r"batch \(2\) x 40001 ragged sequences per row \(max_segments = 20000\) must be at "
     r"most 65535"),
]


@pytest.mark.parametrize("changes,error,match", ERRORS, ids=lambda x: str(x)[:40])
def test_bad_input_raises(changes, error, match):
  q, k, v = _args()
  changes = dict(changes)
  q, k, v = (changes.pop(n, x) for n, x in (("query", q), ("key", k), ("value", v)))
  with pytest.raises(error, match=match):
    pp.dot_product_attention(q, k, v, **changes)


def test_batch_too_large_for_the_grid_names_the_layout():
  q, k, v = _args(b=21_846, t=1, depth=16)
  with pytest.raises(ValueError, match=r"batch \(21846\) x 3 ragged sequences per row "
                                       r"\(one sequence per row\) must be at most 65535"):
    pp.dot_product_attention(q, k, v)


def test_counted_max_segments_rounds_up_only_within_the_grid():
  """max_segments=None counts the runs and rounds up to a power of two, except where the
  rounded count would pass the launch grid's limit and the count itself does not: 8000
  rows of 3 runs fit (8000 x 7 sequences) but 4 runs would not (8000 x 9 > 65535), and
  such a call raised "lower max_segments" once though it passed none. Traced only
  (eval_shape): the checks are static."""
  ids = np.tile(np.asarray([[1, 1, 2, 2, 3, 3]], np.int32), (8000, 1))
  x = jax.ShapeDtypeStruct((8000, 6, 2, 16), jnp.float32)
  call = lambda **kw: jax.eval_shape(  # noqa: E731
      lambda q, k, v: pp.dot_product_attention(q, k, v, segment_ids=ids, **kw), x, x, x)
  assert call().shape == call(max_segments=3).shape == (8000, 6, 2, 16)
  with pytest.raises(ValueError, match=r"batch \(8000\) x 9 ragged sequences per row "
                                       r"\(max_segments = 4\)"):
    call(max_segments=4)
  q, k, v = (jnp.asarray(np.random.default_rng(shared.fresh_seed()).standard_normal(
      (2, 6, h, 16)), jnp.float32) for h in (2, 1, 1))
  small = ids[:2]  # a small batch still rounds 3 runs up to 4: the same program as 4's
  np.testing.assert_array_equal(
      np.asarray(pp.dot_product_attention(q, k, v, segment_ids=small, interpret=True)),
      np.asarray(pp.dot_product_attention(q, k, v, segment_ids=small, max_segments=4,
                                          interpret=True)))


@pytest.mark.parametrize("b,t,s", [(2, 0, 5), (0, 4, 4), (2, 3, 0)])
def test_empty_axes_give_empty_or_zero_outputs(b, t, s):
  """No query rows, no batch rows, or no keys: the shapes jax.nn gives, rows that see no
  key zero (as ``mha_prefill`` does), and the LSE's empty-row value."""
  q, k, v = (jax.random.normal(jax.random.PRNGKey(i), shape) for i, shape in enumerate(
      [(b, t, 4, 16), (b, s, 2, 16), (b, s, 2, 16)]))
  out, lse = pp.dot_product_attention(q, k, v, return_lse=True)
  assert out.shape == (b, t, 4, 16) and lse.shape == (b, t, 4)
  assert not np.asarray(out).any()
  ref_out, ref_lse = pp.reference.dot_product_attention_reference(q, k, v, return_lse=True)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))


def test_a_query_run_without_a_key_run_reports_its_sink():
  """Cross-attention segment ids where the last query run has no key run to pair with:
  its queries are real, see no key, output zeros and report the sink's LSE, in the
  kernel and the reference alike (the reference took them for padding once)."""
  q, k, v = (jax.random.normal(jax.random.PRNGKey(shared.fresh_seed() + i), shape)
             for i, shape in enumerate([(1, 6, 2, 16), (1, 4, 1, 16), (1, 4, 1, 16)]))
  sink = jnp.asarray([0.5, -1.5], jnp.float32)
  kw = dict(segment_ids=(jnp.asarray([[1, 1, 2, 2, 3, 3]], jnp.int32),
                         jnp.asarray([[1, 1, 2, 2]], jnp.int32)),
            padding_segment_id=0, sink_weights=sink, return_lse=True, is_causal=True)
  out, lse = pp.dot_product_attention(q, k, v, **kw)
  ref_out, ref_lse = pp.reference.dot_product_attention_reference(q, k, v, **kw)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref_out), rtol=1e-4, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(lse[0, 4:]), np.tile(np.asarray(sink), (2, 1)))
  assert not np.asarray(out[0, 4:]).any() and np.asarray(out[0, :4]).any()


def test_a_causal_window_may_have_any_right_side():
  """Under is_causal the window's right side is hidden: (5, 2**31) is (5, 0)."""
  q, k, v = (jax.random.normal(jax.random.PRNGKey(shared.fresh_seed() + i), shape)
             for i, shape in enumerate([(2, 12, 2, 16), (2, 12, 1, 16), (2, 12, 1, 16)]))
  call = functools.partial(pp.dot_product_attention, q, k, v, is_causal=True,
                           interpret=True)
  wide = np.asarray(call(local_window_size=(5, 2**31)))
  np.testing.assert_array_equal(wide, np.asarray(call(local_window_size=(5, 0))))
  ref = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=(5, 0),
                                     implementation="xla")
  np.testing.assert_allclose(wide, np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_traced_sinks_past_the_limit_are_clamped():
  """A traced sink weight above SINK_MAX (concrete ones raise) is taken as SINK_MAX:
  finite rows that it drowns, its head's LSE SINK_MAX; sink * log2(e) overflowed to inf
  and gave NaN rows once."""
  q, k, v = (jax.random.normal(jax.random.PRNGKey(shared.fresh_seed() + i), shape)
             for i, shape in enumerate([(1, 8, 2, 16), (1, 8, 1, 16), (1, 8, 1, 16)]))
  sinks = jnp.asarray([3.0e38, 0.5], jnp.float32)
  out, lse = jax.jit(lambda w: pp.dot_product_attention(
      q, k, v, sink_weights=w, is_causal=True, return_lse=True, interpret=True))(sinks)
  out, lse = np.asarray(out), np.asarray(lse)
  assert np.isfinite(out).all() and np.isfinite(lse).all()
  np.testing.assert_array_equal(out[..., 0, :], 0.0)
  np.testing.assert_allclose(lse[..., 0], SINK_MAX, rtol=1e-6)
  ref_out, ref_lse = pp.reference.dot_product_attention_reference(
      q, k, v, sink_weights=sinks, is_causal=True, return_lse=True)
  np.testing.assert_allclose(out[..., 1, :], np.asarray(ref_out)[..., 1, :], rtol=1e-4,
                             atol=1e-5)
  np.testing.assert_allclose(lse[..., 1], np.asarray(ref_lse)[..., 1], rtol=1e-5, atol=1e-5)


def test_one_segment_array_needs_equal_lengths():
  q, k, v = _args(s=24)
  with pytest.raises(ValueError, match="pair"):
    pp.dot_product_attention(q, k, v, segment_ids=jnp.ones((2, 16), jnp.int32))


def test_traced_segment_ids_need_max_segments():
  q, k, v = _args()
  with pytest.raises(ValueError, match="max_segments"):
    jax.jit(lambda ids: pp.dot_product_attention(q, k, v, segment_ids=ids))(
        jnp.ones((2, 16), jnp.int32))


def test_garbage_under_jit_gives_finite_rows():
  """Traced lengths past the arrays and ids with more runs than max_segments are clamped:
  finite outputs, no access outside the arrays."""
  q, k, v = _args()
  q = jax.random.normal(jax.random.PRNGKey(1), q.shape)
  lens = jnp.asarray([2**30, -5], jnp.int32)
  out = jax.jit(lambda n: pp.dot_product_attention(
      q, k, v, query_seq_lengths=n, key_value_seq_lengths=n, is_causal=True))(lens)
  assert np.isfinite(np.asarray(out)).all()
  ids = jnp.asarray(np.random.default_rng(0).integers(-3, 3, (2, 16)), jnp.int32)
  out = jax.jit(lambda i: pp.dot_product_attention(
      q, k, v, segment_ids=i, padding_segment_id=0, max_segments=2))(ids)
  assert np.isfinite(np.asarray(out)).all()


def test_concrete_segment_ids_inside_a_jit():
  """Concrete (NumPy) segment ids that a jitted function closes over, ``max_segments``
  left to the call: their runs are counted in NumPy (jnp would stage them, and the count
  failed with a TracerArrayConversionError), and the output is the eager call's."""
  rng = np.random.default_rng(shared.fresh_seed())
  ids = np.array([[1, 1, 2, 2, 0, 0, 3, 3, 3], [5, 5, 5, 0, 0, 6, 6, 0, 0]], np.int32)
  q, k, v = (jnp.asarray(rng.standard_normal((2, 9, h, 32)), jnp.float32) for h in (4, 2, 2))
  call = functools.partial(pp.dot_product_attention, segment_ids=ids, padding_segment_id=0,
                           is_causal=True, interpret=True)
  eager = np.asarray(call(q, k, v))
  jitted = np.asarray(jax.jit(call)(q, k, v))
  np.testing.assert_array_equal(jitted, eager)
  assert np.abs(eager[ids != 0]).min() > 0 and not eager[ids == 0].any()

"""mha_prefill against the float32 reference in interpret mode (CI runs these on the CPU)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_prefill as pp
from pallas_prefill import masks
from tests import cases


@pytest.mark.parametrize("case", cases.CASES, ids=lambda c: c.name)
def test_matches_reference(case):
  cases.check_case(case, interpret=True)


def test_random_cases_match_reference():
  """Fresh random calls each run (``cases.random_case``; a failure names the draws'
  seed): MHA and MLA, packed, prefixed, cross and paged, every mask."""
  cases.check_random_draws(cases.random_case,
                           lambda case: cases.check_case(case, interpret=True), 4)


def test_under_user_jit_with_traced_offsets():
  import jax

  case = cases.Case(lse=True)
  seed = cases.fresh_seed()
  (q, k, v, off), kwargs, last_row = cases.make_inputs(case, seed)
  mpl = kwargs.pop("max_prompt_len")

  @jax.jit
  def model(q, k, v, off):
    out, lse = pp.mha_prefill(q, k, v, off, max_prompt_len=mpl, config=case.config, **kwargs)
    return out * 2, lse

  out, lse = model(q, k, v, off)
  ref, ref_lse = pp.reference.mha_prefill_reference(q, k, v, off, max_prompt_len=mpl, **kwargs)
  cases.check_outputs(case, (out / 2, lse), (ref, ref_lse), last_row, seed)


def test_default_scale_and_custom_scale_differ():
  case = cases.Case()
  seed = cases.fresh_seed()
  args, kwargs, _ = cases.make_inputs(case, seed)
  del kwargs["scale"]
  out = pp.mha_prefill(*args, scale=0.3, config=case.config, **kwargs)
  ref = pp.reference.mha_prefill_reference(*args, scale=0.3, **kwargs)
  default = pp.reference.mha_prefill_reference(*args, **kwargs)
  assert cases.rel_err(out, ref) < 1e-2
  assert cases.rel_err(out, default) > 5e-2  # the scale really reached the kernel


def test_garbage_offsets_under_jit_stay_in_bounds_and_finite():
  """Offsets that break every rule: the kernel clamps, nothing is NaN, no crash."""
  import jax

  case = cases.Case(lse=True)
  (q, k, v, _), kwargs, _ = cases.make_inputs(case, cases.fresh_seed())
  total = q.shape[0]
  bad = [np.array([7, 300, 2, 100, total + 50, -3, 40], np.int32),
         np.array([0, total, 0, total, 5, 5, total * 4], np.int32)]
  fn = jax.jit(lambda off: pp.mha_prefill(q, k, v, off, max_prompt_len=64,
                                          config=case.config, return_lse=True))
  for off in bad:
    out, lse = fn(jnp.asarray(off))
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert np.isfinite(np.asarray(lse)).all()


def test_max_prompt_len_exceeded_under_jit_writes_zeros_not_garbage():
  import jax

  case = cases.Case(lens=(100, 30), extra_rows=0)
  (q, k, v, off), _, _ = cases.make_inputs(case, cases.fresh_seed())
  out = jax.jit(lambda off: pp.mha_prefill(q, k, v, off, max_prompt_len=40,
                                           config=case.config))(off)
  out = np.asarray(out, np.float32)
  assert np.isfinite(out).all()
  assert not out[64:100].any()  # rows past max_prompt_len's tiles are zeros


@pytest.mark.parametrize("sink", [False, True])
def test_no_rows_at_all(sink):
  """An empty Q, or K/V with no rows: zeros, and the sink alone in the LSE."""
  rng = np.random.default_rng(cases.fresh_seed())
  x = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  sink_weights = jnp.asarray(rng.standard_normal(2), jnp.float32) if sink else None
  out, lse = pp.mha_prefill(x(0, 2, 16), x(0, 2, 16), x(0, 2, 16),
                            jnp.array([0, 0], jnp.int32), max_prompt_len=8,
                            sink_weights=sink_weights, return_lse=True)
  assert out.shape == (0, 2, 16) and lse.shape == (0, 2)
  kv_off = jnp.array([0, 0, 0], jnp.int32)
  args = (x(9, 2, 16), x(0, 2, 16), x(0, 2, 8), jnp.array([0, 3, 8], jnp.int32))
  kwargs = dict(max_prompt_len=8, kv_input_row_offsets=kv_off, sink_weights=sink_weights,
                mask=pp.masks.NullMask(), return_lse=True)
  out, lse = pp.mha_prefill(*args, **kwargs)
  ref, ref_lse = pp.reference.mha_prefill_reference(*args, **kwargs)
  assert out.shape == (9, 2, 8) and not np.asarray(out, np.float32).any()
  np.testing.assert_allclose(np.asarray(lse), np.asarray(ref_lse), rtol=1e-6)


@pytest.mark.parametrize("sink", [-2e38, float(np.finfo(np.float32).min)])
@pytest.mark.parametrize("kv_lens", [(5, 5), (0, 4)], ids=["cross", "empty_kv"])
def test_a_sink_below_minus_1e38_on_rows_that_see_no_key(sink, kv_lens):
  """A sink far below any logit (finfo.min as "no sink"): rows that see no key report
  its LSE (taken as -1e38), not the empty-row -1e30 (a masked tile's maximum above
  sink * log2(e)) nor -inf (sink * log2(e) overflowed); the other rows are unchanged."""
  rng = np.random.default_rng(cases.fresh_seed())
  x = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
  q_off = jnp.array([0, 20, 24], jnp.int32)
  kv_off = jnp.asarray(np.cumsum((0,) + kv_lens), jnp.int32)
  q, k, v = x(24, 2, 16), x(sum(kv_lens), 1, 16), x(sum(kv_lens), 1, 16)
  sinks = jnp.array([sink, 0.5], jnp.float32)
  kw = dict(max_prompt_len=20, kv_input_row_offsets=kv_off, sink_weights=sinks,
            return_lse=True)
  out, lse = pp.mha_prefill(q, k, v, q_off, config=pp.MhaConfig(16, 16), interpret=True,
                            **kw)
  ref, ref_lse = pp.reference.mha_prefill_reference(q, k, v, q_off, **kw)
  keyless = np.arange(20) < 20 - kv_lens[0]  # sequence 0's first queries see no key
  lse = np.asarray(lse)
  assert np.isfinite(lse).all() and np.isfinite(np.asarray(out)).all()
  np.testing.assert_array_equal(lse[:20][keyless, 0], np.float32(-1e38))
  np.testing.assert_array_equal(lse[:20][keyless, 1], np.float32(0.5))
  assert not np.asarray(out)[:20][keyless].any()
  np.testing.assert_allclose(lse, ref_lse, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["mha", "kv_offsets", "paged", "fp8", "mla"])
@pytest.mark.parametrize("total_q", [0, 7])
def test_an_empty_batch_gives_zeros(kind, total_q):
  """Offsets [0] (batch 0, no sequence): every row is past the last offset, so zeros
  with LSE -1e30 (sinks or not), eagerly and under jit, as the reference gives them; no
  kernel runs. ``write_kv`` leaves the pages as they are."""
  rng = np.random.default_rng(cases.fresh_seed())
  x = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
  off = jnp.zeros((1,), jnp.int32)
  kw = dict(max_prompt_len=16, return_lse=True)
  kv_rows = 5 if kind == "kv_offsets" else total_q  # (else packed like Q)
  q, k, v = x(total_q, 4, 32), x(kv_rows, 2, 32), x(kv_rows, 2, 16)
  if kind == "mla":
    args = (x(total_q, 4, 48), x(kv_rows, 4, 32), x(kv_rows, 1, 16), x(kv_rows, 4, 16))
    entry, reference = pp.mla_prefill, pp.reference.mla_prefill_reference
  else:
    entry, reference = pp.mha_prefill, pp.reference.mha_prefill_reference
    kw["sink_weights"] = jnp.asarray(rng.standard_normal(4), jnp.float32)
    args = (q, k, v)
  if kind == "kv_offsets":
    kw["kv_input_row_offsets"] = off
  elif kind == "paged":
    pages = x(3, 16, 2, 32)
    table, lengths = jnp.zeros((0, 2), jnp.int32), jnp.zeros((0,), jnp.int32)
    assert pp.paged.write_kv(pages, k, off, table, lengths) is pages
    args = (q, pp.PagedKV(pages, table, lengths), pp.PagedKV(x(3, 16, 2, 16), table, lengths))
  elif kind == "fp8":
    e4 = jnp.float8_e4m3fn
    args = tuple(a.astype(e4) for a in args)
    kw.update(q_scale=jnp.float32(0.5), k_scale=jnp.ones((0, 2), jnp.float32),
              v_scale=jnp.ones((2,), jnp.float32))
  want_out, want_lse = reference(*args, off, **kw)
  for fn in (entry, jax.jit(lambda *a: entry(*a, **kw))):
    out, lse = fn(*args, off, **kw) if fn is entry else fn(*args, off)
    assert out.shape == (total_q, 4, 16) and lse.shape == (total_q, 4)
    assert out.dtype == (jnp.bfloat16 if kind == "fp8" else args[0].dtype) == want_out.dtype
    assert not np.asarray(out, np.float32).any() and not np.asarray(want_out, np.float32).any()
    np.testing.assert_array_equal(np.asarray(lse), np.full((total_q, 4), -1e30, np.float32))
    np.testing.assert_array_equal(np.asarray(want_lse), np.asarray(lse))


@pytest.mark.parametrize("entry", ["mha", "mla", "padded"])
def test_differentiating_an_entry_point_says_it_is_forward_only(entry):
  """jax.grad (eager and under jit), jvp and a gradient through sinks alone raise a
  NotImplementedError that says why; inputs under stop_gradient pass, and the call then
  gives the same output as without differentiation."""
  rng = np.random.default_rng(cases.fresh_seed())
  x = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
  off = jnp.asarray([0, 7, 20], jnp.int32)
  if entry == "mha":
    k, v = x(20, 2, 16), x(20, 2, 16)
    q = x(20, 4, 16)
    call = lambda q, s=None: pp.mha_prefill(q, k, v, off, max_prompt_len=16,  # noqa: E731
                                            sink_weights=s)
  elif entry == "mla":
    kn, kr, v = x(20, 4, 16), x(20, 1, 8), x(20, 4, 16)
    q = x(20, 4, 24)
    call = lambda q, s=None: pp.mla_prefill(  # noqa: E731
        q, kn, kr, v, off, max_prompt_len=16)
  else:
    k, v = x(2, 10, 2, 16), x(2, 10, 2, 16)
    q, n = x(2, 10, 4, 16), jnp.asarray([10, 3], jnp.int32)
    call = lambda q, s=None: pp.dot_product_attention(  # noqa: E731
        q, k, v, query_seq_lengths=n, key_value_seq_lengths=n, is_causal=True,
        sink_weights=s)
  name = {"mha": "mha_prefill", "mla": "mla_prefill", "padded": "dot_product_attention"}
  match = rf"^{name[entry]} is forward only .* (q|query) is being differentiated"
  loss = lambda q: call(q).sum()  # noqa: E731
  for differentiate in (jax.grad(loss), jax.jit(jax.grad(loss)),
                        lambda q: jax.jvp(loss, (q,), (q,))):
    with pytest.raises(NotImplementedError, match=match):
      differentiate(q)
  if entry != "mla":
    with pytest.raises(NotImplementedError, match=r"sink_weights is being differentiated"):
      jax.grad(lambda s: call(q, s).sum())(x(4))
  out = call(q)
  got, grad = jax.value_and_grad(
      lambda q: (call(jax.lax.stop_gradient(q)) ** 2).sum() + q.sum())(q)
  np.testing.assert_allclose(float(got), float((out ** 2).sum() + q.sum()), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(grad), np.ones(q.shape, np.float32))


def test_batch_beyond_the_launch_grid_is_refused():
  total = 65536
  q = jnp.zeros((total, 1, 16), jnp.bfloat16)
  off = jnp.arange(total + 1, dtype=jnp.int32)
  with pytest.raises(ValueError, match=r"batch \(65536\) must be at most 65535"):
    pp.mha_prefill(q, q, q, off, max_prompt_len=1)


@pytest.mark.parametrize("case", [
    cases.Case(lens=(70, 5, 33), sink=True, lse=True),
    cases.Case(lens=(70, 5, 33), kv_lens=(90, 5, 40), page_size=16, lse=True,
               mask=masks.SlidingWindowCausalMask(24)),
    cases.Case(kind="mla", lens=(70, 5), heads=4, kv_heads=4, head_dim=64, rope_dim=32,
               lse=True),
], ids=lambda c: c.name)
def test_triton_is_batch_invariant_in_interpret_mode(case):
  """The Triton kernel's KV tiles start at each sequence's first key: its rows are bitwise
  the same behind neighbours of several lengths (``cases.placed_inputs``; shuffled pages
  each time). tests/test_gpu.py holds the compiled kernel to this on the H200."""
  entry, reference = cases.ENTRY_POINTS[case.kind]
  seed, leads = cases.fresh_seed(), (0, 1, 3, 8, 45)
  got = []
  for lead in leads:
    args, kwargs, rows = cases.placed_inputs(case, seed, lead, max(leads))
    result = entry(*args, config=case.config, interpret=True, backend="triton", **kwargs)
    if not got:  # the rows compared are right, not only equal
      cases.check_outputs(case, result, reference(*args, **kwargs),
                          int(np.asarray(args[-1])[-1]), seed)
    got.append(cases.rows_bits(result, rows))
  for lead, bits in zip(leads[1:], got[1:]):
    for a, b, what in zip(bits, got[0], ("output", "LSE")):
      np.testing.assert_array_equal(a, b, err_msg=f"{what}, lead {lead} seed={seed}")


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_no_query_rows_in_kernel_and_reference(kind):
  """total_q = 0 over keys (a cached prefix with nothing new): an empty output from the
  kernel and from the float32 reference alike (the reference's row blocks once failed
  to slice an empty array)."""
  kv = jnp.ones((5, 2, 16), jnp.float32)
  off, kv_off = jnp.asarray([0, 0], jnp.int32), jnp.asarray([0, 5], jnp.int32)
  kw = dict(max_prompt_len=4, kv_input_row_offsets=kv_off, return_lse=True)
  if kind == "mha":
    args = (jnp.ones((0, 2, 16), jnp.float32), kv, kv)
    kernel, reference = pp.mha_prefill, pp.reference.mha_prefill_reference
  else:
    args = (jnp.ones((0, 2, 24), jnp.float32), kv, jnp.ones((5, 1, 8), jnp.float32), kv)
    kernel, reference = pp.mla_prefill, pp.reference.mla_prefill_reference
  for fn in (kernel, reference):
    out, lse = fn(*args, off, **kw)
    assert out.shape == (0, 2, 16) and lse.shape == (0, 2)


def test_soft_capped_is_accurate_for_any_cap():
  """``logits.soft_capped`` (the Triton kernel's cap) against float64's cap * tanh(s / cap):
  within a few float32 roundings of the result, from caps near the logits to caps far
  above them (where 1 - 2 / (2**(2y log2 e) + 1) alone cancels to an error that grows
  with the cap)."""
  from pallas_prefill import logits  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(cases.fresh_seed())
  s = np.concatenate([rng.standard_normal(20_000) * 10, rng.standard_normal(2_000) * 1e4,
                      [0.0, 1e-30, -3.0, 88.0]]).astype(np.float32)
  for cap in (0.5, 30.0, 1e3, 1e6, 1e9):
    got = np.asarray(logits.soft_capped(jnp.asarray(s), cap), np.float64)
    want = cap * np.tanh(s.astype(np.float64) / cap)
    rel = np.abs(got - want) / np.maximum(np.abs(want), 1e-6)  # (1e-30 may flush to 0)
    assert rel.max() < 2e-6, (cap, rel.max(), s[np.argmax(rel)])
    assert np.isfinite(got).all()


def test_a_cap_far_above_the_logits_leaves_them_as_they_are():
  """float32 in interpret mode: caps of 1e4 and 1e7 match the reference (and the uncapped
  call) to float32 rounding; the exp2 form alone was off by 3e-4 and 0.34."""
  rng = np.random.default_rng(cases.fresh_seed())
  off = jnp.asarray([0, 37, 57], jnp.int32)
  q, k, v = (jnp.asarray(rng.standard_normal((57, 2, 64)), jnp.float32) for _ in range(3))
  plain = pp.reference.mha_prefill_reference(q, k, v, off, max_prompt_len=40)
  for cap in (1e4, 1e7):
    out = pp.mha_prefill(q, k, v, off, max_prompt_len=40, logits_soft_cap=cap)
    ref = pp.reference.mha_prefill_reference(q, k, v, off, max_prompt_len=40,
                                             logits_soft_cap=cap)
    assert cases.rel_err(out, ref) < 1e-5 and cases.rel_err(out, plain) < 1e-5


@pytest.mark.parametrize("entry", ["mha", "mla", "padded"])
def test_entry_points_under_jax_enable_x64(entry):
  """With ``jax_enable_x64`` on, the entry points give what they give without it (their
  kernels are traced in 32 bits: ``partitioning.implementation``), on float32 and bf16
  inputs with a float64 NumPy sink and scale, and lower for an H200 under an outer jit
  on both backends; interpret mode inside a jit (Pallas' interpreter, which x64 breaks
  when the outer jit lowers) raises a NotImplementedError that says so."""
  from tests.test_lowering import lower_for_h200  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(cases.fresh_seed())
  x = lambda *shape: np.asarray(rng.standard_normal(shape), np.float32)  # noqa: E731
  off = np.asarray([0, 7, 20], np.int32)
  sink, scale = np.float64(0.5) + x(4).astype(np.float64), np.float64(0.3)
  if entry == "mha":
    args = (x(20, 4, 16), x(20, 2, 16), x(20, 2, 16), off)
    call = lambda q, k, v, o, **kw: pp.mha_prefill(  # noqa: E731
        q, k, v, o, max_prompt_len=16, sink_weights=sink, scale=scale, **kw)
  elif entry == "mla":
    args = (x(20, 4, 24), x(20, 4, 16), x(20, 1, 8), x(20, 4, 16), off)
    call = lambda q, a, b, v, o, **kw: pp.mla_prefill(  # noqa: E731
        q, a, b, v, o, max_prompt_len=16, scale=scale, **kw)
  else:
    n = np.asarray([10, 3], np.int32)
    args = (x(2, 10, 4, 16), x(2, 10, 2, 16), x(2, 10, 2, 16), n)
    call = lambda q, k, v, n, **kw: pp.dot_product_attention(  # noqa: E731
        q, k, v, query_seq_lengths=n, key_value_seq_lengths=n, is_causal=True,
        sink_weights=sink, scale=scale, **kw)
  for dtype in (jnp.float32, jnp.bfloat16):
    arrays = [jnp.asarray(a, dtype) if a.dtype == np.float32 else jnp.asarray(a)
              for a in args]
    want = call(*arrays, interpret=True)
    with jax.enable_x64(True):
      got = call(*arrays, interpret=True)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    with jax.enable_x64(True), pytest.raises(NotImplementedError, match="jax_enable_x64"):
      jax.jit(lambda *a: call(*a, interpret=True))(*arrays)
    # also where the jit's values reach the call through jax.vmap, or only its offsets
    # or lengths are traced
    stacked = [jnp.stack([a, a]) for a in arrays]
    with jax.enable_x64(True):  # an eager vmap runs (the interpreter in 32 bits)
      got = jax.vmap(lambda *a: call(*a, interpret=True))(*stacked)
    np.testing.assert_array_equal(np.asarray(got[1], np.float32), np.asarray(want, np.float32))
    with jax.enable_x64(True), pytest.raises(NotImplementedError, match="jax_enable_x64"):
      jax.jit(jax.vmap(lambda *a: call(*a, interpret=True)))(*stacked)
    with jax.enable_x64(True), pytest.raises(NotImplementedError, match="jax_enable_x64"):
      jax.jit(lambda o: call(*arrays[:-1], o, interpret=True))(arrays[-1])
  abstract = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16 if a.dtype == np.float32 else
                                   a.dtype) for a in args]
  with jax.enable_x64(True):
    for backend in ("triton", "mosaic_gpu"):
      lower_for_h200(lambda *a, b=backend: call(*a, backend=b, interpret=False), *abstract)

"""Tensor-parallel heads: the kernels inside shard_map and under jit with head-sharded
inputs, on several host devices in interpret mode (conftest.py asks XLA for 4)."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import pallas_prefill as pp
from tests import cases

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices")

CONFIG = pp.MhaConfig(block_q=32, block_kv=16, num_warps=4, num_stages=2)
HEAD = P(None, "x", None)  # [tokens, heads, depth] split along heads
COLLECTIVE = re.compile(r"all-gather|all-to-all|all-reduce|collective-permute|reduce-scatter")


def mesh(n, explicit=False):
  """n devices on axis "x": Auto axes (``Mesh``'s default), or Explicit ones
  (``jax.make_mesh``'s default: the shardings are part of the arrays' types)."""
  if explicit:
    return jax.make_mesh((n,), ("x",), devices=jax.devices()[:n],
                         axis_types=(AxisType.Explicit,))
  return Mesh(np.array(jax.devices()[:n]), ("x",))


def inputs(case):
  args, kwargs, _ = cases.make_inputs(case, cases.fresh_seed())
  kwargs.pop("scale")
  return args, kwargs


def put(mesh_, x, spec):
  if isinstance(x, pp.PagedKV):
    return pp.PagedKV(put(mesh_, x.pages, P(None, None, "x", None)),
                      put(mesh_, x.block_table, P()), put(mesh_, x.cache_lengths, P()))
  return jax.device_put(x, NamedSharding(mesh_, spec))


def assert_same(x, y, err_msg=""):
  for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y)):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-5, atol=1e-5, err_msg=err_msg)


MHA = cases.Case(heads=8, kv_heads=4, lse=True, sink=True)
MLA = cases.Case(kind="mla", heads=8, kv_heads=4, head_dim=32, rope_dim=16, lse=True)


def specs(case, args, kwargs):
  """Head-sharded specs for the operands of a case (MLA's shared rope key replicated)."""
  n_kv = 2 if case.kind == "mha" else 3
  arg_specs = [HEAD] * (1 + n_kv) + [P()]
  if case.kind == "mla" and case.shared_rope:
    arg_specs[2] = P()
  kw_specs = {"sink_weights": P("x")} if "sink_weights" in kwargs else {}
  return arg_specs, kw_specs


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", [MHA, MLA], ids=["mha", "mla"])
def test_inside_shard_map_equals_single_device(case, n):
  args, kwargs = inputs(case)
  kernel, _ = cases.ENTRY_POINTS[case.kind]
  static = {k: v for k, v in kwargs.items() if k != "sink_weights"}
  single = kernel(*args, config=CONFIG, **kwargs)
  arg_specs, kw_specs = specs(case, args, kwargs)
  out_specs = (HEAD, P(None, "x")) if case.lse else HEAD

  def per_device(*a):
    *arrays, sinks = a if kw_specs else (*a, None)
    extra = {"sink_weights": sinks} if kw_specs else {}
    return kernel(*arrays, config=CONFIG, **static, **extra)

  m = mesh(n)
  sharded = jax.jit(jax.shard_map(
      per_device, mesh=m, in_specs=tuple(arg_specs) + tuple(kw_specs.values()),
      out_specs=out_specs))(*args, *[kwargs[k] for k in kw_specs])
  assert_same(sharded, single)


@pytest.mark.parametrize("case", [
    MHA, cases.Case(heads=8, kv_heads=1, lse=True),  # MQA: K/V replicated
    MLA, cases.Case(kind="mla", heads=8, kv_heads=4, head_dim=32, rope_dim=16,
                    shared_rope=False),
    cases.Case(heads=8, kv_heads=4, kv_lens=(5, 1, 90, 100, 64, 50), page_size=16, lse=True),
], ids=["mha_gqa_sinks", "mha_mqa", "mla_shared_rope", "mla_per_head_rope", "mha_paged"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
def test_jit_over_head_sharded_inputs_partitions_along_heads(case, explicit):
  """Head-sharded inputs under jit: each device computes its heads (no collective), the
  output keeps the split. Over Explicit mesh axes the call runs per device in shard_map
  (``partitioning._on_explicit_mesh``: custom_partitioning cannot take sharded types)."""
  args, kwargs = inputs(case)
  kernel, _ = cases.ENTRY_POINTS[case.kind]
  single = kernel(*args, config=CONFIG, **kwargs)
  m = mesh(4, explicit)
  arg_specs, kw_specs = specs(case, args, kwargs)
  if case.kv_heads == 1:
    arg_specs[1:3] = [P(), P()]
  sharded_args = [put(m, x, s) for x, s in zip(args, arg_specs)]
  sharded_kwargs = {k: put(m, kwargs[k], s) for k, s in kw_specs.items()}
  static = {k: v for k, v in kwargs.items() if k not in kw_specs}
  fn = jax.jit(lambda *a, **kw: kernel(*a, config=CONFIG, **static, **kw))
  out = fn(*sharded_args, **sharded_kwargs)
  assert_same(out, single)
  first = jax.tree.leaves(out)[0]
  assert first.sharding.spec[1] == "x", first.sharding  # the output keeps the head split
  hlo = fn.lower(*sharded_args, **sharded_kwargs).compile().as_text()
  assert not COLLECTIVE.search(hlo), COLLECTIVE.search(hlo).group(0)


@pytest.mark.parametrize("spec", [P("x", None, None), P(), P(None, None, "x")],
                         ids=["tokens", "replicated", "depth"])
@pytest.mark.parametrize("explicit", [False, True], ids=["auto_axes", "explicit_axes"])
def test_other_shardings_give_the_right_answer(spec, explicit):
  case = cases.Case(heads=8, kv_heads=4, lse=True, lens=(40, 1, 23), extra_rows=0)  # 64 rows
  args, kwargs = inputs(case)
  single = pp.mha_prefill(*args, config=CONFIG, **kwargs)
  m = mesh(4, explicit)
  q, k, v, off = args
  sharded = [put(m, x, spec) for x in (q, k, v)] + [put(m, off, P())]
  fn = jax.jit(lambda *a: pp.mha_prefill(*a, config=CONFIG, **kwargs))
  assert_same(fn(*sharded), single)
  if spec != P():
    # The kernel needs whole tokens and depths: these are gathered, which also shows that
    # the collective check above can see a collective.
    assert COLLECTIVE.search(fn.lower(*sharded).compile().as_text())


@pytest.mark.parametrize("entry", ["mha", "mla", "padded"])
def test_vmap_on_a_host_of_several_devices(entry):
  """``jax.vmap`` over an entry point (custom_partitioning has no batching rule, so a
  batched call runs unpartitioned: ``partitioning.batched``) on this host of 4 devices:
  each batch element equals the call on it alone, with the offsets or lengths shared
  (mha, mla) or batched too (padded)."""
  rng = np.random.default_rng(cases.fresh_seed())
  x = lambda *shape: jax.numpy.asarray(rng.standard_normal(shape), "float32")  # noqa: E731
  kw = dict(interpret=True, backend="triton", config=CONFIG)
  if entry == "padded":
    q, k, v = x(2, 2, 24, 4, 16), x(2, 2, 24, 2, 16), x(2, 2, 24, 2, 16)
    lengths = jax.numpy.asarray([[24, 5], [17, 0]], "int32")
    def fn(q, k, v, n):
      return pp.dot_product_attention(q, k, v, query_seq_lengths=n,
                                      key_value_seq_lengths=n, is_causal=True, **kw)
    batched, single = jax.vmap(fn)(q, k, v, lengths), [fn(q[i], k[i], v[i], lengths[i])
                                                        for i in range(2)]
  else:
    off = jax.numpy.asarray([0, 7, 20], "int32")
    if entry == "mha":
      ops = (x(2, 20, 4, 16), x(2, 20, 2, 16), x(2, 20, 2, 16))
      fn = lambda *a: pp.mha_prefill(*a, off, max_prompt_len=16, **kw)  # noqa: E731
    else:
      ops = (x(2, 20, 4, 24), x(2, 20, 4, 16), x(2, 20, 1, 8), x(2, 20, 4, 16))
      fn = lambda *a: pp.mla_prefill(*a, off, max_prompt_len=16, **kw)  # noqa: E731
    batched, single = jax.vmap(fn)(*ops), [fn(*(o[i] for o in ops)) for i in range(2)]
  for i in range(2):
    np.testing.assert_allclose(np.asarray(batched[i]), np.asarray(single[i]), rtol=1e-5,
                               atol=1e-5)


def _fp8_mha(rng):
  """An FP8 MHA call's operands (8 query heads over 4 K/V heads, e4m3 K/V)."""
  x = lambda *shape: jax.numpy.asarray(rng.standard_normal(shape), "float32")  # noqa: E731
  e4m3 = jax.numpy.float8_e4m3fn
  return (x(24, 8, 16).astype("bfloat16"), x(24, 4, 16).astype(e4m3),
          x(24, 4, 16).astype(e4m3), jax.numpy.asarray([0, 10, 24], "int32"))


def test_vmap_over_fp8_scales_alone_on_a_host_of_several_devices():
  """``jax.vmap`` over the FP8 scales only (q, K, V and offsets shared) on 4 devices: the
  scales count among the operands that make a call batched (``partitioning.batched``),
  so it runs unpartitioned (custom_partitioning has no batching rule) and each lane
  equals the call with its scales."""
  q, k, v, off = _fp8_mha(np.random.default_rng(cases.fresh_seed()))
  scales = jax.numpy.asarray([[0.5, 1.0, 2.0, 0.25], [1.5, 0.75, 1.0, 3.0]], "float32")
  fn = lambda s: pp.mha_prefill(q, k, v, off, max_prompt_len=16, k_scale=s,  # noqa: E731
                                v_scale=0.5, config=CONFIG)
  batched = jax.vmap(fn)(scales)
  for i in range(2):
    want = pp.reference.mha_prefill_reference(q, k, v, off, max_prompt_len=16,
                                              k_scale=scales[i], v_scale=0.5)
    np.testing.assert_allclose(np.asarray(batched[i], np.float32),
                               np.asarray(fn(scales[i]), np.float32), rtol=1e-5, atol=1e-5)
    err = np.max(np.abs(np.asarray(batched[i], np.float32) - np.asarray(want, np.float32)))
    assert err <= 2e-2 * np.max(np.abs(np.asarray(want, np.float32))), err


def test_fp8_over_explicit_mesh_axes():
  """An FP8 call over head-sharded operands on a mesh with Explicit axes runs per device
  in ``partitioning._on_explicit_mesh``'s shard_map, its scales split with the K/V heads
  (Pallas' interpreter reads them at program-id indices: that shard_map does not check
  varying axes), and equals the single-device call, eager and under jit."""
  q, k, v, off = _fp8_mha(np.random.default_rng(cases.fresh_seed()))
  kw = dict(max_prompt_len=16, k_scale=jax.numpy.asarray([0.5, 1.0, 2.0, 0.25]),
            v_scale=2.0, config=CONFIG)
  single = pp.mha_prefill(q, k, v, off, **kw)
  m = mesh(4, explicit=True)
  sharded = [put(m, x, HEAD) for x in (q, k, v)]
  eager = pp.mha_prefill(*sharded, off, **kw)
  jitted = jax.jit(lambda *a: pp.mha_prefill(*a, off, **kw))(*sharded)
  for out in (eager, jitted):
    assert_same(out, single)
    assert out.sharding.spec[1] == "x", out.sharding

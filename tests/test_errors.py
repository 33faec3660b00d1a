"""Bad arguments: each raises the documented exception type, with a message that names the
argument, before anything is traced into the kernel.

Static problems (shapes, dtypes, options) raise eagerly and at trace time under jit. Data
problems in the offsets raise when the offsets are concrete (``validate_offsets``, which
``mha_prefill`` calls); under jit nothing checks them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_prefill as pp
from pallas_prefill import masks
from pallas_prefill import mha as mha_lib
from pallas_prefill import dispatch


class KernelReached(Exception):
  """Raised in place of the kernel: the arguments got past every check."""


@pytest.fixture(autouse=True)
def no_kernel(monkeypatch):
  """Nothing runs: reaching the jitted implementation or the kernel launcher raises
  KernelReached, so an error a test expects must come from the argument checks."""

  def reached(*args, **kwargs):
    raise KernelReached

  monkeypatch.setattr(mha_lib, "jitted_mha_prefill", reached)
  monkeypatch.setattr(dispatch, "ragged_attention", reached)


# ---------------------------------------------------------------------------------------
# A valid call: 4 sequences (one empty) in 27 query rows (3 past the last offset), 4 query
# heads over 2 K/V heads, head dim 32, max_prompt_len 16. Each bad case changes one thing.

LENS = (5, 0, 12, 7)
OFFSETS = (0, 5, 5, 17, 24)
ROWS = 27
HEADS, KV_HEADS, DIM = 4, 2, 32
MAX_PROMPT_LEN = 16
# K/V with their own offsets: a cached prefix, sequences longer than max_prompt_len.
KV_OFFSETS = (0, 9, 9, 30, 38)
KV_ROWS = 40


def arr(shape, dtype="bfloat16"):
  return jnp.zeros(shape, dtype)


def valid(**changes):
  kwargs = dict(
      q=arr((ROWS, HEADS, DIM)), k=arr((ROWS, KV_HEADS, DIM)), v=arr((ROWS, KV_HEADS, DIM)),
      input_row_offsets=jnp.asarray(OFFSETS, jnp.int32), max_prompt_len=MAX_PROMPT_LEN)
  kwargs.update(changes)
  return kwargs


def with_kv_offsets(**changes):
  return valid(**{"k": arr((KV_ROWS, KV_HEADS, DIM)), "v": arr((KV_ROWS, KV_HEADS, DIM)),
                  "kv_input_row_offsets": jnp.asarray(KV_OFFSETS, jnp.int32), **changes})


def call_eager(kwargs):
  return pp.mha_prefill(**kwargs)


def call_under_jit(kwargs):
  """Traces mha_prefill under a user's jit, every array argument (offsets included) a
  tracer, the rest static."""
  names = ("q", "k", "v", "input_row_offsets", "kv_input_row_offsets", "sink_weights")
  arrays = {n: kwargs[n] for n in names if n in kwargs}
  static = {n: x for n, x in kwargs.items() if n not in names}
  return jax.jit(lambda arrays: pp.mha_prefill(**arrays, **static)).trace(arrays)


CALLS = [pytest.param(call_eager, id="eager"), pytest.param(call_under_jit, id="jit")]


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("kwargs", [
    pytest.param(valid(), id="base"),
    pytest.param(with_kv_offsets(), id="kv_offsets"),
    pytest.param(valid(input_row_offsets=jnp.asarray(OFFSETS, jnp.uint32)), id="uint32"),
    pytest.param(valid(input_row_offsets=np.asarray(OFFSETS, np.int32)), id="numpy_offsets"),
    pytest.param(valid(sink_weights=arr((HEADS,), "float32"), return_lse=True,
                       output_dtype=jnp.float32, scale=0.25, interpret=True,
                       mask=masks.ChunkedCausalMask(8), config=pp.MhaConfig()), id="options"),
    pytest.param(valid(max_prompt_len=np.int32(MAX_PROMPT_LEN)), id="numpy_int_max_len"),
    pytest.param(valid(scale=np.int32(1), logits_soft_cap=np.int64(30),
                       interpret=np.bool_(True)), id="numpy_scalars"),
    pytest.param(valid(backend=None), id="backend_none"),
    pytest.param(valid(q=arr((ROWS, 8, 256)), k=arr((ROWS, 1, 256)), v=arr((ROWS, 1, 1))),
                 id="mqa_extreme_dims"),
])
def test_valid_arguments_reach_the_kernel(kwargs, call):
  """The baseline every bad case departs from passes every check (so each bad case fails
  for its one change), and the fixture really stops the kernel."""
  with pytest.raises(KernelReached):
    call(kwargs)


# ---------------------------------------------------------------------------------------
# Static problems: raised eagerly and under jit alike.

def case(id_, kwargs, exc, match, *, eager_only=False):
  return pytest.param(kwargs, exc, match, eager_only, id=id_)


STATIC_CASES = [
    # Ranks and array-ness.
    case("q_rank2", valid(q=arr((ROWS, HEADS * DIM))), ValueError,
         r"^q must have rank 3, got shape \(27, 128\)"),
    case("k_rank4", valid(k=arr((ROWS, KV_HEADS, DIM, 1))), ValueError,
         r"^k must have rank 3, got shape \(27, 2, 32, 1\)"),
    case("v_rank2", valid(v=arr((ROWS, KV_HEADS * DIM))), ValueError, r"^v must have rank 3"),
    case("q_not_an_array", valid(q=[1.0, 2.0]), TypeError, r"^q must be an array, got list"),
    # Dtypes.
    case("k_float16", valid(k=arr((ROWS, KV_HEADS, DIM), "float16")), TypeError,
         r"^q, k,? (and )?v must share a dtype, got bfloat16, float16, bfloat16"),
    case("v_float32", valid(v=arr((ROWS, KV_HEADS, DIM), "float32")), TypeError,
         r"^q, k,? (and )?v must share a dtype, got bfloat16, bfloat16, float32"),
    case("all_float16_but_q", valid(k=arr((ROWS, KV_HEADS, DIM), "float16"),
                                    v=arr((ROWS, KV_HEADS, DIM), "float16")), TypeError,
         r"^q, k,? (and )?v must share a dtype, got bfloat16, float16, float16"),
    case("q_int32", valid(q=arr((ROWS, HEADS, DIM), "int32")), TypeError,
         r"^q must be bfloat16, float16, float32, float8_e4m3fn or float8_e5m2, got int32"),
    case("k_int8", valid(k=arr((ROWS, KV_HEADS, DIM), "int8")), TypeError,
         r"^k must be bfloat16, float16, float32, float8_e4m3fn or float8_e5m2, got int8"),
    case("all_int32", valid(q=arr((ROWS, HEADS, DIM), "int32"),
                            k=arr((ROWS, KV_HEADS, DIM), "int32"),
                            v=arr((ROWS, KV_HEADS, DIM), "int32")), TypeError,
         r"^q must be bfloat16, float16, float32, float8_e4m3fn or float8_e5m2, got int32"),
    case("v_numpy_float64", valid(v=np.zeros((ROWS, KV_HEADS, DIM))), TypeError,
         r"^v must be bfloat16, float16, float32, float8_e4m3fn or float8_e5m2, got float64", eager_only=True),
    # Heads.
    case("kv_heads_3", valid(k=arr((ROWS, 3, DIM)), v=arr((ROWS, 3, DIM))), ValueError,
         r"^num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    case("kv_heads_8_over_4", valid(k=arr((ROWS, 8, DIM)), v=arr((ROWS, 8, DIM))),
         ValueError, r"^num_heads \(4\) must be a multiple of num_kv_heads \(8\)"),
    case("kv_heads_0", valid(k=arr((ROWS, 0, DIM)), v=arr((ROWS, 0, DIM))), ValueError,
         r"^num_heads \(4\) must be a multiple of num_kv_heads \(0\)"),
    # Head dims and K/V agreement.
    case("qk_dims_differ", valid(k=arr((ROWS, KV_HEADS, 16))), ValueError,
         r"^q and k head dims differ: q \(27, 4, 32\), k \(27, 2, 16\)"),
    case("kv_rows_differ", valid(v=arr((ROWS - 1, KV_HEADS, DIM))), ValueError,
         r"K/V arrays must have the same number of rows, got \{'k': 27, 'v': 26\}"),
    case("kv_heads_differ", valid(v=arr((ROWS, 1, DIM))), ValueError,
         r"^k and v must have the same number of heads: k \(27, 2, 32\), v \(27, 1, 32\)"),
    case("head_dim_512", valid(q=arr((ROWS, HEADS, 512)), k=arr((ROWS, KV_HEADS, 512))),
         ValueError, r"^head_dim must be between 1 and 256, got 512"),
    case("head_dim_257", valid(q=arr((ROWS, HEADS, 257)), k=arr((ROWS, KV_HEADS, 257))),
         ValueError, r"^head_dim must be between 1 and 256, got 257"),
    case("head_dim_0", valid(q=arr((ROWS, HEADS, 0)), k=arr((ROWS, KV_HEADS, 0))),
         ValueError, r"^head_dim must be between 1 and 256, got 0"),
    case("head_dim_v_320", valid(v=arr((ROWS, KV_HEADS, 320))), ValueError,
         r"^head_dim_v must be between 1 and 256, got 320"),
    case("head_dim_v_0", valid(v=arr((ROWS, KV_HEADS, 0))), ValueError,
         r"^head_dim_v must be between 1 and 256, got 0"),
    # Offsets: rank, dtype, length.
    case("offsets_rank2", valid(input_row_offsets=jnp.zeros((1, 5), jnp.int32)), ValueError,
         r"^input_row_offsets must have rank 1, got shape \(1, 5\)"),
    case("offsets_scalar", valid(input_row_offsets=jnp.int32(0)), ValueError,
         r"^input_row_offsets must have rank 1, got shape \(\)"),
    case("offsets_float32", valid(input_row_offsets=jnp.asarray(OFFSETS, jnp.float32)),
         TypeError, r"^input_row_offsets must be int32 or uint32, got float32"),
    case("offsets_int16", valid(input_row_offsets=jnp.asarray(OFFSETS, jnp.int16)),
         TypeError, r"^input_row_offsets must be int32 or uint32, got int16"),
    case("offsets_numpy_int64", valid(input_row_offsets=np.asarray(OFFSETS, np.int64)),
         TypeError, r"^input_row_offsets must be int32 or uint32, got int64", eager_only=True),
    case("offsets_length0", valid(input_row_offsets=jnp.zeros((0,), jnp.int32)), ValueError,
         r"^input_row_offsets must have length batch \+ 1 >= 1, got 0"),
    case("kv_offsets_longer",
         with_kv_offsets(kv_input_row_offsets=jnp.asarray(KV_OFFSETS + (40,), jnp.int32)),
         ValueError, r"^kv_input_row_offsets must have length batch \+ 1 = 5 like "
         r"input_row_offsets, got 6"),
    case("kv_offsets_shorter",
         with_kv_offsets(kv_input_row_offsets=jnp.asarray(KV_OFFSETS[:-1], jnp.int32)),
         ValueError, r"^kv_input_row_offsets must have length batch \+ 1 = 5 like "
         r"input_row_offsets, got 4"),
    case("kv_offsets_length1",
         with_kv_offsets(kv_input_row_offsets=jnp.zeros((1,), jnp.int32)),
         ValueError, r"^kv_input_row_offsets must have length batch \+ 1 = 5 like "
         r"input_row_offsets, got 1"),
    case("kv_offsets_float32",
         with_kv_offsets(kv_input_row_offsets=jnp.asarray(KV_OFFSETS, jnp.float32)),
         TypeError, r"^kv_input_row_offsets must be int32 or uint32, got float32"),
    case("kv_offsets_rank2",
         with_kv_offsets(kv_input_row_offsets=jnp.zeros((5, 1), jnp.int32)),
         ValueError, r"^kv_input_row_offsets must have rank 1, got shape \(5, 1\)"),
    case("k_rows_without_kv_offsets",
         valid(k=arr((ROWS + 3, KV_HEADS, DIM)), v=arr((ROWS + 3, KV_HEADS, DIM))),
         ValueError, r"^without kv_input_row_offsets .*must have total_q = 27 rows, got 30"),
    # max_prompt_len.
    case("max_prompt_len_0", valid(max_prompt_len=0), ValueError,
         r"^max_prompt_len must be > 0, got 0"),
    case("max_prompt_len_negative", valid(max_prompt_len=-16), ValueError,
         r"^max_prompt_len must be > 0, got -16"),
    case("max_prompt_len_float", valid(max_prompt_len=16.0), TypeError,
         r"^max_prompt_len must be a static Python int, got float"),
    case("max_prompt_len_bool", valid(max_prompt_len=True), TypeError,
         r"^max_prompt_len must be a static Python int, got bool"),
    case("max_prompt_len_none", valid(max_prompt_len=None), TypeError,
         r"^max_prompt_len must be a static Python int, got NoneType"),
    case("max_prompt_len_jax_array", valid(max_prompt_len=jnp.int32(16)), TypeError,
         r"^max_prompt_len must be a static Python int, got \w*Array"),
    # The mask.
    case("mask_string", valid(mask="causal"), TypeError,
         r"^mask must be one of pallas_prefill\.masks\.CausalMask\(\).*; got 'causal'"),
    case("mask_object", valid(mask=object()), TypeError,
         r"^mask must be one of .*; got <object object"),
    case("mask_class_not_instance", valid(mask=masks.CausalMask), TypeError,
         r"^mask must be one of .*; got <class '.*CausalMask'>"),
    case("mask_none", valid(mask=None), TypeError, r"^mask must be one of .*; got None"),
    # Scale.
    case("scale_string", valid(scale="0.1"), TypeError,
         r"^scale must be a finite Python float or None, got '0.1'"),
    case("scale_nan", valid(scale=float("nan")), ValueError,
         r"^scale must be a finite Python float or None, got nan"),
    case("scale_inf", valid(scale=float("inf")), ValueError,
         r"^scale must be a finite Python float or None, got inf"),
    case("scale_bool", valid(scale=True), TypeError,
         r"^scale must be a finite Python float or None, got True"),
    case("scale_overflows_float32", valid(scale=1e39), ValueError,
         r"^scale must be a finite Python float or None, got 1e\+39 \(it must be finite in "
         r"float32"),
    case("scale_huge_int", valid(scale=10**400), ValueError,
         r"^scale must be a finite Python float or None, got 1000"),
    # The soft cap: finite and normal in float32 (a cap that rounds to 0 or inf gives NaN).
    *[case(f"soft_cap_{name}", valid(logits_soft_cap=cap), ValueError,
           r"^logits_soft_cap must be a float > 0, finite and normal in float32")
      for name, cap in (("zero", 0.0), ("negative", -5.0), ("nan", float("nan")),
                        ("overflows_float32", 1e39), ("underflows_float32", 1e-50),
                        ("huge_int", 10**400))],
    case("return_lse_string", valid(return_lse="no"), TypeError,
         r"^return_lse must be a static bool, got 'no'"),
    case("no_query_heads", valid(q=arr((ROWS, 0, DIM))), ValueError,
         r"^num_heads \(0\) must be a multiple of num_kv_heads \(2\), both >= 1"),
    # Sink weights.
    case("sink_length3", valid(sink_weights=arr((3,), "float32")), ValueError,
         r"^sink_weights must be a float vector of num_heads = 4, got float32\(3,\)"),
    case("sink_per_kv_head", valid(sink_weights=arr((KV_HEADS,), "float32")), ValueError,
         r"^sink_weights must be a float vector of num_heads = 4, got float32\(2,\)"),
    case("sink_rank2", valid(sink_weights=arr((1, HEADS), "float32")), ValueError,
         r"^sink_weights must have rank 1, got shape \(1, 4\)"),
    case("sink_rank0", valid(sink_weights=jnp.float32(0)), ValueError,
         r"^sink_weights must have rank 1, got shape \(\)"),
    case("sink_int32", valid(sink_weights=arr((HEADS,), "int32")), ValueError,
         r"^sink_weights must be a float vector of num_heads = 4, got int32\(4,\)"),
    # Output dtype.
    case("output_dtype_int32", valid(output_dtype=jnp.int32), TypeError,
         r"^output_dtype must be bfloat16, float16, float32 or None, got .*\bint32\b"),
    case("output_dtype_int32_string", valid(output_dtype="int32"), TypeError,
         r"^output_dtype must be bfloat16, float16, float32 or None, got int32"),
    case("output_dtype_bool", valid(output_dtype=np.dtype(bool)), TypeError,
         r"^output_dtype must be bfloat16, float16, float32 or None, got bool"),
    case("output_dtype_unknown_name", valid(output_dtype="bogus"), TypeError,
         r"^output_dtype must be bfloat16, float16, float32 or None, got bogus"),
    case("output_dtype_float64", valid(output_dtype=np.float64), TypeError,
         r"^output_dtype must be bfloat16, float16, float32 or None, got .*\bfloat64\b"),
    # Config and interpret.
    case("config_dict", valid(config=dict(block_q=64)), TypeError,
         r"^config must be a pallas_prefill\.MhaConfig \(Triton\) or MosaicConfig \(Mosaic "
         r"GPU\) or None for backend='auto', got \{'block_q': 64\}"),
    case("config_string", valid(config="default"), TypeError,
         r"^config must be a pallas_prefill\.MhaConfig \(Triton\) or MosaicConfig \(Mosaic "
         r"GPU\) or None for backend='auto', got 'default'"),
    case("interpret_string", valid(interpret="yes"), TypeError,
         r"^interpret must be None, True or False, got 'yes'"),
    case("interpret_float", valid(interpret=1.0), TypeError,
         r"^interpret must be None, True or False, got 1.0"),
    case("interpret_array", valid(interpret=np.array(True)), TypeError,
         r"^interpret must be None, True or False, got array\(True\)"),
]


@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("kwargs,exc,match,eager_only", STATIC_CASES)
def test_static_problem_raises(kwargs, exc, match, eager_only, call):
  if eager_only and call is call_under_jit:
    pytest.skip("jit converts 64-bit numpy arrays to 32 bits before mha_prefill sees them")
  with pytest.raises(exc, match=match):
    call(kwargs)


# ---------------------------------------------------------------------------------------
# Masks and configs check themselves when built.

@pytest.mark.parametrize("make,match", [
    (lambda: masks.SlidingWindowCausalMask(0),
     r"^SlidingWindowCausalMask\.window must be an int >= 1, got 0"),
    (lambda: masks.SlidingWindowCausalMask(-8),
     r"^SlidingWindowCausalMask\.window must be an int >= 1, got -8"),
    (lambda: masks.SlidingWindowCausalMask(2.5),
     r"^SlidingWindowCausalMask\.window must be an int >= 1, got 2\.5"),
    (lambda: masks.SlidingWindowCausalMask(True),
     r"^SlidingWindowCausalMask\.window must be an int >= 1, got True"),
    (lambda: masks.ChunkedCausalMask(0),
     r"^ChunkedCausalMask\.chunk must be an int >= 1, got 0"),
    (lambda: masks.ChunkedCausalMask(-1),
     r"^ChunkedCausalMask\.chunk must be an int >= 1, got -1"),
    (lambda: masks.ChunkedCausalMask("256"),
     r"^ChunkedCausalMask\.chunk must be an int >= 1, got '256'"),
    (lambda: pp.MhaConfig(block_q=48),
     r"^MhaConfig\.block_q must be a power of two >= 16, got 48"),
    (lambda: pp.MhaConfig(block_q=8),
     r"^MhaConfig\.block_q must be a power of two >= 16, got 8"),
    (lambda: pp.MhaConfig(block_q=64.0),
     r"^MhaConfig\.block_q must be a power of two >= 16, got 64\.0"),
    (lambda: pp.MhaConfig(block_kv=96),
     r"^MhaConfig\.block_kv must be a power of two >= 16, got 96"),
    (lambda: pp.MhaConfig(block_kv=0),
     r"^MhaConfig\.block_kv must be a power of two >= 16, got 0"),
    (lambda: pp.MhaConfig(num_warps=3),
     r"^MhaConfig\.num_warps must be 1, 2, 4, 8 or 16, got 3"),
    (lambda: pp.MhaConfig(num_warps=32),
     r"^MhaConfig\.num_warps must be 1, 2, 4, 8 or 16, got 32"),
    (lambda: pp.MhaConfig(num_warps=True),
     r"^MhaConfig\.num_warps must be 1, 2, 4, 8 or 16, got True"),
    (lambda: pp.MhaConfig(num_stages=0),
     r"^MhaConfig\.num_stages must be an int >= 1, got 0"),
    (lambda: pp.MhaConfig(num_stages=2.0),
     r"^MhaConfig\.num_stages must be an int >= 1, got 2\.0"),
], ids=["window_0", "window_negative", "window_float", "window_bool", "chunk_0",
        "chunk_negative", "chunk_string", "block_q_48", "block_q_8", "block_q_float",
        "block_kv_96", "block_kv_0", "num_warps_3", "num_warps_32", "num_warps_bool",
        "num_stages_0", "num_stages_float"])
def test_bad_mask_or_config_raises_when_built(make, match):
  with pytest.raises(ValueError, match=match):
    make()


@pytest.mark.parametrize("make,match", [
    (lambda: masks.SlidingWindowCausalMask(2**31),
     r"^SlidingWindowCausalMask\.window must be an int >= 1, got 2147483648 \(and at most "
     r"2\*\*30\)"),
    (lambda: masks.ChunkedCausalMask(2**30 + 1),
     r"^ChunkedCausalMask\.chunk must be an int >= 1, got 1073741825 \(and at most"),
    (lambda: pp.MhaConfig(num_warps=4.0),
     r"^MhaConfig\.num_warps must be 1, 2, 4, 8 or 16, got 4\.0"),
    (lambda: pp.MosaicConfig(block_kv=128.0),
     r"^MosaicConfig\.block_kv must be 64, 128 or \(FP8 only\) 256, got 128\.0"),
    (lambda: pp.MosaicConfig(block_kv=512),
     r"^MosaicConfig\.block_kv must be 64, 128 or \(FP8 only\) 256, got 512"),
    (lambda: pp.MosaicConfig(block_q=64.0), r"^MosaicConfig\.block_q must be 64"),
    (lambda: pp.MosaicOptions(head_major=1.0),
     r"^MosaicOptions\.head_major must be None, 0 or 1, got 1\.0"),
], ids=["window_2_31", "chunk_past_2_30", "num_warps_float", "mosaic_block_kv_float",
        "mosaic_block_kv_512",
        "mosaic_block_q_float", "head_major_float"])
def test_out_of_range_or_float_masks_and_configs_raise(make, match):
  """Spans that would overflow int32 positions (which can be negative), and floats where
  an int is meant (they used to pass the ``in (...)`` checks)."""
  with pytest.raises(ValueError, match=match):
    make()


def test_numpy_int_spans_are_python_ints():
  """A NumPy int window or chunk is taken, as a Python int (the mask is a jit key)."""
  for mask, field in ((masks.SlidingWindowCausalMask(np.int64(4)), "window"),
                      (masks.ChunkedCausalMask(np.int32(8)), "chunk")):
    assert type(getattr(mask, field)) is int
  assert masks.SlidingWindowCausalMask(np.int64(4)) == masks.SlidingWindowCausalMask(4)


def test_edge_masks_and_configs_are_valid():
  masks.SlidingWindowCausalMask(1)
  masks.ChunkedCausalMask(1)
  masks.SlidingWindowCausalMask(2**30)
  pp.MhaConfig(block_q=16, block_kv=16, num_warps=1, num_stages=1)
  pp.MhaConfig(block_q=256, block_kv=256, num_warps=16, num_stages=8)


# ---------------------------------------------------------------------------------------
# Data problems in concrete offsets: ValueError from validate_offsets, naming the offsets
# and the offending entry or sequence.

def q_data(offsets, match):
  """A bad input_row_offsets (27 rows of Q and K/V, max_prompt_len 16)."""
  return pytest.param(dict(input_row_offsets=offsets), match)


def kv_data(kv_offsets, match):
  """A bad kv_input_row_offsets (valid Q offsets, 40 rows of K/V)."""
  return pytest.param(dict(kv_input_row_offsets=kv_offsets), match)


DATA_CASES = {
    "first_not_0": q_data((2, 5, 5, 17, 24), r"^input_row_offsets\[0\] must be 0, got 2"),
    "decreasing": q_data((0, 5, 4, 17, 24),
                         r"^input_row_offsets must be nondecreasing: input_row_offsets\[2\] "
                         r"= 4 < input_row_offsets\[1\] = 5"),
    "last_past_rows": q_data((0, 5, 5, 17, 28),
                             r"^input_row_offsets\[-1\] = 28 is past the 27 rows"),
    "middle_past_rows_then_back": q_data((0, 5, 30, 17, 24),
                                         r"^input_row_offsets must be nondecreasing: "
                                         r"input_row_offsets\[3\] = 17 < "
                                         r"input_row_offsets\[2\] = 30"),
    "longer_than_max_prompt_len": q_data((0, 5, 5, 22, 24),
                                         r"^sequence 2 has 17 queries, more than "
                                         r"max_prompt_len = 16"),
    "first_longer_than_max_prompt_len": q_data((0, 20, 20, 22, 24),
                                               r"^sequence 0 has 20 queries, more than "
                                               r"max_prompt_len = 16"),
    "kv_first_not_0": kv_data((1, 9, 9, 30, 38),
                              r"^kv_input_row_offsets\[0\] must be 0, got 1"),
    "kv_decreasing": kv_data((0, 9, 9, 8, 38),
                             r"^kv_input_row_offsets must be nondecreasing: "
                             r"kv_input_row_offsets\[3\] = 8 < kv_input_row_offsets\[2\] = 9"),
    "kv_last_past_rows": kv_data((0, 9, 9, 30, 41),
                                 r"^kv_input_row_offsets\[-1\] = 41 is past the 40 rows"),
}


def as_offsets(values, dtype, container):
  return np.asarray(values, dtype) if container == "numpy" else jnp.asarray(values, dtype)


def bad_data_kwargs(bad, dtype, container):
  kwargs = with_kv_offsets() if "kv_input_row_offsets" in bad else valid()
  for name in ("input_row_offsets", "kv_input_row_offsets"):
    if name in kwargs:
      kwargs[name] = as_offsets(bad.get(name, kwargs[name]), dtype, container)
  return kwargs


@pytest.mark.parametrize("container", ["jax", "numpy"])
@pytest.mark.parametrize("dtype", ["int32", "uint32"])
@pytest.mark.parametrize("bad,match", DATA_CASES.values(), ids=DATA_CASES.keys())
def test_mha_prefill_rejects_bad_concrete_offsets(bad, match, dtype, container):
  kwargs = bad_data_kwargs(bad, dtype, container)
  with pytest.raises(ValueError, match=match):
    pp.mha_prefill(**kwargs)


@pytest.mark.parametrize("dtype", ["int32", "uint32"])
@pytest.mark.parametrize("bad,match", DATA_CASES.values(), ids=DATA_CASES.keys())
def test_validate_offsets_rejects(bad, match, dtype):
  kwargs = bad_data_kwargs(bad, dtype, "jax")
  kv = kwargs.get("kv_input_row_offsets")
  with pytest.raises(ValueError, match=match):
    pp.validate_offsets(kwargs["input_row_offsets"], max_prompt_len=MAX_PROMPT_LEN,
                        total_q=ROWS, kv_input_row_offsets=kv,
                        total_kv=None if kv is None else KV_ROWS)


@pytest.mark.parametrize("bad,match", DATA_CASES.values(), ids=DATA_CASES.keys())
def test_bad_offsets_are_not_checked_under_jit(bad, match):
  """Under jit the offsets' values are unknown: the call reaches the kernel (which clamps
  every index; see test_mha's garbage-offsets test)."""
  del match
  with pytest.raises(KernelReached):
    call_under_jit(bad_data_kwargs(bad, "int32", "jax"))


def test_uint32_wraparound_is_past_the_rows():
  """-1 stored as uint32 is 4294967295, not -1: past the rows, not decreasing."""
  offsets = jnp.asarray(np.array([0, 5, 5, 17, -1], np.int64).astype(np.uint32))
  with pytest.raises(ValueError, match=r"^input_row_offsets\[-1\] = 4294967295 is past "
                     r"the 27 rows"):
    pp.mha_prefill(**valid(input_row_offsets=offsets))


@pytest.mark.parametrize("dtype", ["int32", "uint32"])
@pytest.mark.parametrize("offsets,kv_offsets", [
    pytest.param(OFFSETS, None, id="base"),
    pytest.param((0, 16, 16, 27), None, id="exactly_max_prompt_len_and_all_rows"),
    pytest.param((0, 0), None, id="one_empty_sequence"),
    pytest.param((0, 0, 0, 0), None, id="all_empty"),
    pytest.param(OFFSETS, KV_OFFSETS, id="kv_longer_than_max_prompt_len"),
    pytest.param(OFFSETS, (0, 0, 0, 0, 0), id="no_keys_at_all"),
    pytest.param(OFFSETS, (0, 1, 2, 3, 40), id="kv_all_rows"),
])
def test_validate_offsets_accepts(offsets, kv_offsets, dtype):
  kv = None if kv_offsets is None else jnp.asarray(kv_offsets, dtype)
  result = pp.validate_offsets(jnp.asarray(offsets, dtype), max_prompt_len=MAX_PROMPT_LEN,
                               total_q=ROWS, kv_input_row_offsets=kv,
                               total_kv=None if kv is None else KV_ROWS)
  assert result is None


def test_validate_offsets_needs_total_kv_for_kv_offsets():
  with pytest.raises(TypeError, match=r"^validate_offsets needs total_kv"):
    pp.validate_offsets(np.asarray(OFFSETS, np.int32), max_prompt_len=MAX_PROMPT_LEN,
                        total_q=ROWS, kv_input_row_offsets=np.asarray(KV_OFFSETS, np.int32))


@pytest.mark.parametrize("change,error,match", [
    (dict(input_row_offsets=np.array([0, 1.5, 3.9])), TypeError,
     r"^input_row_offsets must hold integers, got float64"),
    (dict(input_row_offsets=np.array([False, True])), TypeError,
     r"^input_row_offsets must hold integers, got bool"),
    (dict(kv_input_row_offsets=np.array([0, 2.0])), TypeError,
     r"^kv_input_row_offsets must hold integers, got float64"),
    (dict(kv_input_row_offsets=np.asarray(KV_OFFSETS[:-1], np.int32)), ValueError,
     r"^kv_input_row_offsets must have input_row_offsets' length, batch \+ 1 = 5, got 4"),
    (dict(max_prompt_len=None), TypeError, r"^validate_offsets' max_prompt_len must be an"),
    (dict(max_prompt_len=2.5), TypeError, r"^validate_offsets' max_prompt_len must be an"),
    (dict(max_prompt_len=0), ValueError, r"^max_prompt_len must be > 0, got 0"),
    (dict(total_q=None), TypeError, r"^validate_offsets' total_q must be an int, got None"),
    (dict(total_kv=float(ROWS)), TypeError, r"^validate_offsets' total_kv must be an int"),
], ids=lambda x: str(x)[:40])
def test_validate_offsets_checks_its_own_arguments(change, error, match):
  """``validate_offsets`` called on its own holds its arguments to what the entry points
  do: integer offsets of one batch, integer sizes."""
  kwargs = dict(input_row_offsets=np.asarray(OFFSETS, np.int32),
                max_prompt_len=MAX_PROMPT_LEN, total_q=ROWS,
                kv_input_row_offsets=np.asarray(KV_OFFSETS, np.int32), total_kv=40)
  pp.validate_offsets(**kwargs)
  with pytest.raises(error, match=match):
    pp.validate_offsets(**{**kwargs, **change})


def test_concrete_q_offsets_are_checked_beside_traced_kv_offsets():
  bad = jnp.asarray((0, 5, 5, 17, 28), jnp.int32)  # past the 27 rows

  @jax.jit
  def call(kv_offsets):
    return pp.mha_prefill(**valid(input_row_offsets=bad, k=arr((KV_ROWS, KV_HEADS, DIM)),
                                  v=arr((KV_ROWS, KV_HEADS, DIM)),
                                  kv_input_row_offsets=kv_offsets))

  with pytest.raises(ValueError, match=r"^input_row_offsets\[-1\] = 28 is past the 27 rows"):
    call(jnp.asarray(KV_OFFSETS, jnp.int32))


# ---------------------------------------------------------------------------------------
# Data problems in other concrete arguments: sink weights, FP8 scales (ValueError); under
# jit nothing checks them.

@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 2.4e38])
def test_concrete_non_finite_sink_weights_raise(bad):
  sinks = np.zeros(HEADS, np.float32)
  sinks[2] = bad
  with pytest.raises(ValueError, match=r"^sink_weights must be finite and at most 1e\+38 "
                     r"\(the kernels take sink \* log2\(e\) in float32\), got "
                     r"sink_weights\[2\] = (nan|inf|-inf|2.4e\+38)"):
    call_eager(valid(sink_weights=jnp.asarray(sinks)))
  with pytest.raises(KernelReached):
    call_under_jit(valid(sink_weights=jnp.asarray(sinks)))


@pytest.mark.parametrize("name", ["q_scale", "k_scale", "v_scale"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, 0.0, -1.0, 1e-39])
def test_concrete_fp8_scales_must_be_finite_and_positive(name, bad):
  fp8_kwargs = dict(q=arr((ROWS, HEADS, DIM), "float8_e4m3fn"),
                    k=arr((ROWS, KV_HEADS, DIM), "float8_e4m3fn"),
                    v=arr((ROWS, KV_HEADS, DIM), "float8_e4m3fn"),
                    q_scale=1.0, k_scale=jnp.ones((KV_HEADS,), jnp.float32), v_scale=0.5)
  good = valid(**fp8_kwargs)
  with pytest.raises(KernelReached):
    call_eager(good)
  with pytest.raises(ValueError, match=rf"^{name} must be finite and at least float32's "
                     r"smallest normal 1.175e-38 \(a dequantization scale; a GPU flushes "
                     r"smaller ones to zero\), got"):
    call_eager({**good, name: jnp.full((KV_HEADS,), bad, jnp.float32)})


@pytest.mark.parametrize("q_scale,k_scale", [(1e30, 1e10), (1e-30, 1e-10)])
def test_concrete_fp8_scale_products_must_be_normal(q_scale, k_scale):
  """q_scale and k_scale, each valid, whose float32 product (which the kernels apply to
  the logits) overflows to inf (NaN outputs) or flushes to zero (uniform attention)."""
  fp8_kwargs = dict(q=arr((ROWS, HEADS, DIM), "float8_e4m3fn"),
                    k=arr((ROWS, KV_HEADS, DIM), "float8_e4m3fn"),
                    v=arr((ROWS, KV_HEADS, DIM), "float8_e4m3fn"), v_scale=0.5)
  with pytest.raises(ValueError, match=r"^q_scale \* k_scale must be finite and at least "
                     r"float32's smallest normal"):
    call_eager(valid(**fp8_kwargs, q_scale=q_scale, k_scale=k_scale))

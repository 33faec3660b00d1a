"""mla_prefill: the shared case matrix against the float32 reference in interpret mode,
bad input, and lowering for the H200 (CI runs these on the CPU)."""

import jax
import jax.numpy as jnp
import pytest

import pallas_prefill as pp
from pallas_prefill import masks
from pallas_prefill import mla as mla_lib
from tests import cases
from tests.test_lowering import KERNEL_NAME, lower_for_h200, triton_calls


@pytest.mark.parametrize("case", cases.MLA_CASES, ids=lambda c: c.name)
def test_matches_reference(case):
  cases.check_case(case, interpret=True)


# ---------------------------------------------------------------------------------------
# Bad input: 2 sequences in 30 rows, 4 heads over 2 latent K/V heads, 32 nope + 16 rope.

ROWS, HEADS, KV_HEADS, NOPE, ROPE, DV = 30, 4, 2, 32, 16, 32


def operands(**changes):
  z = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
  kwargs = dict(q=z(ROWS, HEADS, NOPE + ROPE), k_nope=z(ROWS, KV_HEADS, NOPE),
                k_rope=z(ROWS, 1, ROPE), v=z(ROWS, KV_HEADS, DV),
                input_row_offsets=jnp.array([0, 10, 30], jnp.int32), max_prompt_len=20)
  kwargs.update(changes)
  return kwargs


@pytest.mark.parametrize("changes,exc,match", [
    (dict(q=jnp.zeros((ROWS, HEADS, NOPE + ROPE + 1), jnp.bfloat16)), ValueError,
     r"^q's depth \(49\) must be d_nope \+ d_rope = 32 \+ 16"),
    (dict(k_rope=jnp.zeros((ROWS, 3, ROPE), jnp.bfloat16)), ValueError,
     r"^k_rope must have 1 or num_kv_heads = 2 heads, got 3"),
    (dict(k_rope=jnp.zeros((ROWS - 1, 1, ROPE), jnp.bfloat16)), ValueError,
     r"^the K/V arrays must have the same number of rows.*'k_rope': 29"),
    (dict(v=jnp.zeros((ROWS + 2, KV_HEADS, DV), jnp.bfloat16)), ValueError,
     r"^the K/V arrays must have the same number of rows.*'v': 32"),
    (dict(v=jnp.zeros((ROWS, 1, DV), jnp.bfloat16)), ValueError,
     r"^v must have num_kv_heads = 2 heads like k_nope, got 1"),
    (dict(k_nope=jnp.zeros((ROWS, 3, NOPE), jnp.bfloat16),
          v=jnp.zeros((ROWS, 3, DV), jnp.bfloat16)), ValueError,
     r"^num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
    (dict(k_rope=jnp.zeros((ROWS, 1, ROPE), jnp.float16)), TypeError, r"^q, k_nope, k_rope, v "
     r"must share a dtype"),
    (dict(v=jnp.zeros((ROWS, KV_HEADS, 300), jnp.bfloat16)), ValueError,
     r"^d_v must be between 1 and 256, got 300"),
    (dict(input_row_offsets=jnp.array([0, 10, 31], jnp.int32)), ValueError,
     r"^input_row_offsets\[-1\] = 31 is past the 30 rows"),
    (dict(max_prompt_len=0), ValueError, r"^max_prompt_len must be > 0"),
    (dict(mask="causal"), TypeError, r"^mask must be one of"),
])
def test_bad_input_raises_before_the_kernel(monkeypatch, changes, exc, match):
  def reached(*args, **kwargs):
    raise AssertionError("the kernel was reached")

  monkeypatch.setattr(mla_lib, "jitted_mla_prefill", reached)
  with pytest.raises(exc, match=match):
    pp.mla_prefill(**operands(**changes))


# ---------------------------------------------------------------------------------------
# Lowering for the H200: DeepSeek-V3's shape (128 heads, 128 + 64 shared rope, v 128) and a
# small one with per-head rope and padded depths, under every mask.

S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("mask", [masks.CausalMask(), masks.NullMask(),
                                  masks.SlidingWindowCausalMask(128),
                                  masks.ChunkedCausalMask(256)], ids=repr)
@pytest.mark.parametrize("shape", [(128, 128, 128, 64, 1, 128, 4096),
                                   (8, 2, 48, 24, 2, 40, 300)],
                         ids=["deepseek_v3", "small_padded"])
def test_lowers_for_h200(shape, mask):
  heads, kv_heads, nope, rope, rope_heads, dv, max_len = shape
  bf16 = jnp.bfloat16
  args = (S((1000, heads, nope + rope), bf16), S((1500, kv_heads, nope), bf16),
          S((1500, rope_heads, rope), bf16), S((1500, kv_heads, dv), bf16),
          S((5,), jnp.int32), S((5,), jnp.uint32))

  def fn(q, k_nope, k_rope, v, offsets, kv_offsets):
    return pp.mla_prefill(q, k_nope, k_rope, v, offsets, kv_input_row_offsets=kv_offsets,
                          max_prompt_len=max_len, mask=mask, return_lse=True,
                          interpret=False, backend="triton")

  lowered = lower_for_h200(fn, *args)
  [call] = triton_calls(lowered)
  assert call.name == KERNEL_NAME and call.grid[0] == heads and call.grid[2] == 4
  out, lse = lowered.out_info
  assert out.shape == (1000, heads, dv) and out.dtype == bf16
  assert lse.shape == (1000, heads) and lse.dtype == jnp.float32

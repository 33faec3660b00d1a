"""Lowering of the GPU (Triton) path for an abstract H200, on any machine, GPU or not.

Interpret mode runs the kernel body as ordinary JAX ops on the CPU, so it accepts what the
Triton lowering rejects: a tensor shape that is not a power of two, scalar prefetch, a
primitive with no Triton lowering rule. Lowering for an abstract NVIDIA H200 runs the real
Pallas -> Triton lowering (everything short of the Triton compiler itself) and catches those
here, in seconds, with no GPU.
"""

from __future__ import annotations

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt
from jax.extend.mlir import ir
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

import pallas_prefill as pp
from pallas_prefill import config as config_lib
from pallas_prefill import masks
from tests import lowered as lowered_lib

H200 = "NVIDIA H200"
TRITON_CALL_TARGET = plt.CUSTOM_CALL_TARGET_NAME  # "__gpu$xla.gpu.triton"
KERNEL_NAME = "ragged_prefill_attention"



H200_MESH = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind=H200, num_cores=None, platform="gpu"))


def lower_for_h200(fn, *args):
  """``jax.jit(fn)`` traced on ``args`` and lowered for CUDA on an abstract NVIDIA H200.

  ``args`` are ``jax.ShapeDtypeStruct``s (or arrays). No GPU is needed: the Pallas Triton
  lowering reads the GPU it targets from the abstract mesh, and so does ``config=None``,
  so the defaults lowered are the ones that run on an H200. Returns the
  ``jax.stages.Lowered``; its ``as_text()`` holds the Triton custom call.
  """
  with use_abstract_mesh(H200_MESH):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


@dataclasses.dataclass(frozen=True)
class TritonCall:
  """One Triton custom call of a lowered module, from its backend config."""

  name: str
  num_warps: int
  num_stages: int
  grid: tuple[int, int, int]
  ir_bytecode: bytes


def triton_calls(lowered) -> list[TritonCall]:
  """The Triton custom calls of a lowered module, in program order."""
  calls = []
  for call in lowered_lib.custom_calls(lowered.compiler_ir("stablehlo")):
    if ir.StringAttr(call.attributes["call_target_name"]).value != TRITON_CALL_TARGET:
      continue
    cfg = call.attributes["mhlo.backend_config"]
    i32 = lambda key: ir.IntegerAttr(cfg[key]).value  # noqa: E731
    calls.append(TritonCall(
        name=ir.StringAttr(cfg["name"]).value, num_warps=i32("num_warps"),
        num_stages=i32("num_stages"), grid=(i32("grid_x"), i32("grid_y"), i32("grid_z")),
        ir_bytecode=ir.StringAttr(cfg["ir"]).value_bytes))
  return calls


def triton_ir_text(call: TritonCall) -> str:
  """The Triton (tt/scf/arith) module of a call as text; skips the test where this JAX
  keeps the Triton dialect somewhere else."""
  try:
    from jax._src.pallas.triton import lowering as triton_lowering
    new_context = triton_lowering._new_ir_context  # pylint: disable=protected-access
  except (ImportError, AttributeError):
    pytest.skip("this JAX has no jax._src.pallas.triton.lowering._new_ir_context")
  with new_context():
    return ir.Module.parse(call.ir_bytecode).operation.get_asm()


# ---------------------------------------------------------------------------------------
# The problem: a ragged batch of 7 prompts, 1000 query rows (not a power of two), GQA 4.

S = jax.ShapeDtypeStruct
TOTAL_Q = 1000
TOTAL_KV = 1500
BATCH = 7
MAX_PROMPT_LEN = 600

MASKS = [masks.CausalMask(), masks.NullMask(), masks.SlidingWindowCausalMask(128),
         masks.ChunkedCausalMask(256)]
HEAD_DIMS = [(64, 64), (96, 96), (128, 128), (256, 256), (80, 48)]
DTYPES = ["bfloat16", "float16", "float32"]


def mask_id(mask):
  return repr(mask).replace("Mask", "").replace("(", "").replace(")", "").replace(
      "window=", "").replace("chunk=", "")


@dataclasses.dataclass(frozen=True)
class Problem:
  heads: int = 8
  kv_heads: int = 2
  head_dim: int = 128
  head_dim_v: int = 128
  dtype: str = "bfloat16"
  mask: object = masks.CausalMask()
  kv_offsets: bool = False  # K/V has its own rows and offsets (a cached prefix)
  offsets_dtype: str = "int32"
  sink: bool = False
  lse: bool = False
  output_dtype: str | None = None
  max_prompt_len: int = MAX_PROMPT_LEN
  config: pp.MhaConfig | None = None

  def args(self):
    total_kv = TOTAL_KV if self.kv_offsets else TOTAL_Q
    dt = jnp.dtype(self.dtype)
    args = [S((TOTAL_Q, self.heads, self.head_dim), dt),
            S((total_kv, self.kv_heads, self.head_dim), dt),
            S((total_kv, self.kv_heads, self.head_dim_v), dt),
            S((BATCH + 1,), jnp.dtype(self.offsets_dtype))]
    args.append(S((BATCH + 1,), jnp.dtype(self.offsets_dtype)) if self.kv_offsets else None)
    args.append(S((self.heads,), jnp.float32) if self.sink else None)
    return args

  def fn(self):
    def attention(q, k, v, offsets, kv_offsets, sink_weights):
      return pp.mha_prefill(
          q, k, v, offsets, kv_input_row_offsets=kv_offsets, sink_weights=sink_weights,
          max_prompt_len=self.max_prompt_len, mask=self.mask, return_lse=self.lse,
          output_dtype=self.output_dtype, config=self.config, interpret=False,
          backend="triton")
    return attention

  def lower(self):
    return lower_for_h200(self.fn(), *self.args())


def check_lowered(problem: Problem, lowered, config: pp.MhaConfig | None = None):
  """The module calls the Triton kernel once, with the grid and tiling of `config` (when
  given), and returns the documented shapes and dtypes."""
  text = lowered.as_text()
  assert f"stablehlo.custom_call @{TRITON_CALL_TARGET}(" in text
  assert KERNEL_NAME in text
  [call] = triton_calls(lowered)
  assert call.name == KERNEL_NAME
  heads, tiles, batch = call.grid
  assert (heads, batch) == (problem.heads, BATCH)
  if config is not None:
    assert tiles == math.ceil(problem.max_prompt_len / config.block_q)
    assert (call.num_warps, call.num_stages) == (config.num_warps, config.num_stages)

  out_dtype = jnp.dtype(problem.output_dtype or problem.dtype)
  out_info = lowered.out_info
  out = out_info[0] if problem.lse else out_info
  assert out.shape == (TOTAL_Q, problem.heads, problem.head_dim_v)
  assert out.dtype == out_dtype
  if problem.lse:
    assert out_info[1].shape == (TOTAL_Q, problem.heads)
    assert out_info[1].dtype == jnp.float32
  return call


def padded(depth):
  return max(16, 1 << (depth - 1).bit_length())


def expected_default(problem: Problem) -> pp.MhaConfig:
  """What config=None picks on an H200 for this problem."""
  with use_abstract_mesh(H200_MESH):
    return config_lib.default_config(padded(problem.head_dim), padded(problem.head_dim_v),
                                     jnp.dtype(problem.dtype), problem.mask,
                                     problem.max_prompt_len)


# ---------------------------------------------------------------------------------------
# The default configuration: every mask x head dim x dtype.

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dims", HEAD_DIMS, ids=lambda d: f"d{d[0]}v{d[1]}")
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
def test_default_config_lowers(mask, head_dims, dtype):
  problem = Problem(head_dim=head_dims[0], head_dim_v=head_dims[1], dtype=dtype, mask=mask)
  check_lowered(problem, problem.lower(), expected_default(problem))


@pytest.mark.parametrize("head_dims", [(1, 1), (16, 16), (32, 32), (72, 72), (192, 128),
                                       (200, 256), (256, 16)],
                         ids=lambda d: f"d{d[0]}v{d[1]}")
def test_odd_and_small_head_dims_lower(head_dims):
  problem = Problem(head_dim=head_dims[0], head_dim_v=head_dims[1],
                    mask=masks.SlidingWindowCausalMask(100))
  check_lowered(problem, problem.lower(), expected_default(problem))


def test_default_config_sees_an_h200():
  """lower_for_h200 makes config=None resolve as on an H200, not as on this host."""
  seen = []

  def fn(x):
    seen.append(config_lib.device_kind())
    return x

  lower_for_h200(fn, S((16,), jnp.float32))
  assert seen == [H200]


# ---------------------------------------------------------------------------------------
# Features, each under every mask.

FEATURES = {
    "sink": dict(sink=True),
    "lse": dict(lse=True),
    "lse_f32_out": dict(lse=True, output_dtype="float32"),
    "f32_in_bf16_out": dict(dtype="float32", output_dtype="bfloat16"),
    "kv_offsets": dict(kv_offsets=True),
    "uint32_offsets": dict(offsets_dtype="uint32"),
    "uint32_kv_offsets": dict(kv_offsets=True, offsets_dtype="uint32"),
    "gqa_32_8": dict(heads=32, kv_heads=8),
    "mqa": dict(heads=16, kv_heads=1),
    "mha": dict(heads=8, kv_heads=8),
    "everything": dict(sink=True, lse=True, kv_offsets=True, offsets_dtype="uint32",
                       heads=32, kv_heads=8, head_dim=80, head_dim_v=48),
}


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("mask", MASKS, ids=mask_id)
def test_feature_lowers(mask, feature):
  problem = Problem(mask=mask, **FEATURES[feature])
  check_lowered(problem, problem.lower(), expected_default(problem))


# ---------------------------------------------------------------------------------------
# Explicit configurations reach the kernel: grid, warps and stages.

CONFIGS = [
    pp.MhaConfig(block_q=16, block_kv=16, num_warps=1, num_stages=1),  # the smallest
    pp.MhaConfig(block_q=32, block_kv=16, num_warps=4, num_stages=2),  # the case matrix's
    pp.MhaConfig(block_q=64, block_kv=128, num_warps=4, num_stages=3),
    pp.MhaConfig(block_q=128, block_kv=64, num_warps=8, num_stages=4),
    pp.MhaConfig(block_q=256, block_kv=32, num_warps=16, num_stages=2),
]


def config_id(c):
  return f"q{c.block_q}kv{c.block_kv}w{c.num_warps}s{c.num_stages}"


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_explicit_config_lowers(config):
  problem = Problem(config=config, lse=True, sink=True, max_prompt_len=333)
  check_lowered(problem, problem.lower(), config)


@pytest.mark.parametrize("max_prompt_len", [1, 15, 16, 17, 4097])
def test_max_prompt_len_sizes_the_grid(max_prompt_len):
  config = pp.MhaConfig(block_q=16, block_kv=32, num_warps=4, num_stages=2)
  problem = Problem(config=config, max_prompt_len=max_prompt_len)
  call = check_lowered(problem, problem.lower(), config)
  assert call.grid[1] == -(-max_prompt_len // 16)


def test_user_jit_around_the_kernel_lowers():
  """mha_prefill inside a larger jitted model, offsets traced, two layers."""
  problem = Problem(lse=True)

  def model(q, k, v, offsets, kv_offsets, sink_weights):
    del kv_offsets, sink_weights
    out, lse = problem.fn()(q, k, v, offsets, None, None)
    out2 = problem.fn()(out.astype(q.dtype), k, v, offsets, None, None)[0]
    return out2 * 2, lse

  lowered = lower_for_h200(model, *problem.args())
  calls = triton_calls(lowered)
  assert [c.name for c in calls] == [KERNEL_NAME] * 2


# ---------------------------------------------------------------------------------------
# The Triton IR: the KV loops are scf.for loops with i32 bounds (an unsigned bound makes
# Triton emit an unpipelined scf.while), carrying a [block_q, padded v depth] accumulator.

@pytest.mark.parametrize("kv_offsets", [False, True], ids=["packed_kv", "kv_offsets"])
@pytest.mark.parametrize("offsets_dtype", ["int32", "uint32"])
def test_kv_loops_are_scf_for_with_i32_bounds(offsets_dtype, kv_offsets):
  config = pp.MhaConfig(block_q=64, block_kv=32, num_warps=4, num_stages=3)
  problem = Problem(offsets_dtype=offsets_dtype, kv_offsets=kv_offsets, head_dim_v=80,
                    mask=masks.SlidingWindowCausalMask(128), config=config)
  [call] = triton_calls(problem.lower())
  asm = triton_ir_text(call)
  assert "scf.while" not in asm
  loops = [line.strip() for line in asm.splitlines() if re.search(r"\bscf\.for\b", line)]
  assert loops and all(line.endswith(": i32 {") for line in loops), loops
  # The three KV loops (masked, unmasked, masked) carry (acc, m, l).
  kv_loops = [line for line in loops if "iter_args" in line]
  assert len(kv_loops) == 3, loops
  for line in kv_loops:
    assert "-> (tensor<64x128xf32>, tensor<64xf32>, tensor<64xf32>)" in line, line


def test_uint32_loop_bound_would_be_scf_while():
  """The check above can fail: a toy kernel looping up to an unsigned bound read from an
  input gets an scf.while."""

  def lowered_ir(dtype):
    def kernel(n_ref, o_ref):
      n = n_ref[0]
      o_ref[...] = jax.lax.fori_loop(jnp.zeros((), n.dtype), n, lambda i, acc: acc + 1.0,
                                     jnp.zeros((16,), jnp.float32))

    fn = pl.pallas_call(kernel, out_shape=S((16,), jnp.float32), in_specs=[pl.no_block_spec])
    [call] = triton_calls(lower_for_h200(fn, S((1,), dtype)))
    return triton_ir_text(call)

  assert "scf.for" in lowered_ir(jnp.int32) and "scf.while" not in lowered_ir(jnp.int32)
  assert "scf.while" in lowered_ir(jnp.uint32)


# ---------------------------------------------------------------------------------------
# The point of all this: the helper really runs the GPU lowering, which rejects what
# interpret mode accepts.

def _add_one(n, interpret=False):
  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1
  return pl.pallas_call(kernel, out_shape=S((n,), jnp.float32), interpret=interpret)


def test_non_power_of_two_block_fails_gpu_lowering_but_not_interpret_mode():
  np.testing.assert_array_equal(_add_one(48, interpret=True)(jnp.zeros(48)), np.ones(48))
  assert TRITON_CALL_TARGET in lower_for_h200(_add_one(64), S((64,), jnp.float32)).as_text()
  with pytest.raises(ValueError, match=r"power of 2.*\(48,\)"):
    lower_for_h200(_add_one(48), S((48,), jnp.float32))

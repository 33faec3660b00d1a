"""The model blocks in examples/ (Flax NNX) against their dense float32 references: tiny
sizes in interpret mode on the CPU, and Llama 3 8B's and DeepSeek-V3's attention on a GPU
with the default backend."""

import importlib.util
import pathlib
import types

import jax.numpy as jnp
import numpy as np
import pytest

from tests.cases import fresh_seed

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
# Max abs error over the reference's largest value; the blocks run in bfloat16 (measured
# about 4e-3 on the CPU sizes).
TOLERANCE = 2e-2


def load(name):
  """A fresh copy of examples/<name>.py (they are scripts, not a package), with its own
  jit caches."""
  spec = importlib.util.spec_from_file_location(f"examples_{name}", EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def assert_small(err, seed):
  assert np.isfinite(err) and err < TOLERANCE, f"max error {err:.3e}, seed={seed}"


def test_llama_attention_matches_reference():
  """Two chunks over a paged cache: prefixes of 0, 24, 5 and 0 tokens, then the rest."""
  seed = fresh_seed()
  assert_small(load("llama_attention").run(seed=seed), seed)


def test_deepseek_mla_matches_reference():
  seed = fresh_seed()
  assert_small(load("deepseek_mla").run(seed=seed), seed)


def nan_attention(q, *args, **kwargs):
  """Stands in for mha_prefill / mla_prefill: NaN of the output's shape."""
  v = args[2] if len(args) > 3 else args[1]  # mla: (k_nope, k_rope, v, offsets)
  return jnp.full((*q.shape[:2], v.shape[-1]), jnp.nan, q.dtype)


@pytest.mark.parametrize("name", ["llama_attention", "deepseek_mla"])
def test_nan_output_fails_the_check(name, monkeypatch):
  example = load(name)
  fake = types.SimpleNamespace(**vars(example.pp))
  fake.mha_prefill = fake.mla_prefill = nan_attention
  monkeypatch.setattr(example, "pp", fake)
  kwargs = dict(lens=(3, 9), cached=(0, 4)) if name == "llama_attention" else dict(lens=(3, 9))
  err = example.run(seed=fresh_seed(), **kwargs)
  assert np.isnan(err)
  with pytest.raises(AssertionError):
    assert_small(err, None)


LLAMA3_8B = dict(hidden=4096, num_heads=32, num_kv_heads=8, head_dim=128, page_size=64,
                 lens=(3000, 2048, 77, 513, 1), cached=(0, 1536, 50, 0, 0))
DEEPSEEK_V3 = dict(hidden=7168, num_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                   d_nope=128, d_rope=64, d_v=128, lens=(1000, 2048, 77, 513, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("name,sizes", [("llama_attention", LLAMA3_8B),
                                        ("deepseek_mla", DEEPSEEK_V3)],
                         ids=["llama3_8b", "deepseek_v3"])
def test_examples_at_real_sizes(name, sizes):
  """backend="auto": the Mosaic GPU kernel on Hopper, Triton on other GPUs."""
  seed = fresh_seed()
  assert_small(load(name).run(seed=seed, **sizes), seed)

"""A DeepSeek-V2/V3 multi-head latent attention (MLA) block on Flax NNX, prefilling a ragged batch.

Keys and values come from a compressed latent: each token is projected down to a latent of
``kv_lora_rank`` (RMS-normalized) plus one rotary key of ``d_rope`` shared by every head,
and the latent is projected up to per-head ``k_nope`` and ``v``. Queries (optionally
low-rank, ``q_lora_rank``) have a nope part and a rope part; RoPE rotates the rope parts at
each token's position in its prompt, and ``pallas_prefill.mla_prefill`` computes
``softmax((q_nope . k_nope + q_rope . k_rope) * scale) v`` causally over the packed batch.
``run`` checks the block against a dense float32 version written below, prompt by prompt.

    python examples/deepseek_mla.py                  # tiny, on the CPU (interpreter)
    python examples/deepseek_mla.py --hidden 7168 --heads 128 --q-lora-rank 1536 \
        --kv-lora-rank 512 --lens 1000 2048 77 513 1   # DeepSeek-V3's attention, on a GPU
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_prefill as pp

HIGHEST = jax.lax.Precision.HIGHEST


def apply_rope(x, positions, theta):
  """Rotary embedding on interleaved pairs (x[2i], x[2i+1]), as DeepSeek's reference code.

  x: [tokens, heads, d_rope], any float dtype; positions: [tokens] int32.
  Returns x's shape and dtype; the rotation runs in float32.
  """
  half = x.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[:, None, None] * inv_freq  # [tokens, 1, half]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], half, 2)
  a, b = pairs[..., 0], pairs[..., 1]
  return jnp.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(x.shape).astype(x.dtype)


def token_positions(input_row_offsets, total):
  """Each packed row's index in its prompt: input_row_offsets [batch + 1] int32 -> [total]."""
  rows = jnp.arange(total, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(input_row_offsets, rows, side="right") - 1,
                 0, input_row_offsets.shape[0] - 2)
  return rows - input_row_offsets[seq]


class MLA(nnx.Module):
  """DeepSeek MLA: low-rank KV latent + a shared rotary key, per-head nope/rope queries.

  Serving code would cache the latent and k_rope (kv_lora_rank + d_rope per token); this
  prefill decompresses them into per-head k_nope and v for ``mla_prefill``. YaRN's context
  extension (DeepSeek-V3's rope scaling and its softmax-scale correction) is left out.
  """

  def __init__(self, hidden, num_heads, *, q_lora_rank=None, kv_lora_rank=512, d_nope=128,
               d_rope=64, d_v=128, rope_theta=10000.0, dtype=jnp.bfloat16, rngs: nnx.Rngs):
    self.num_heads, self.d_nope, self.d_rope, self.d_v = num_heads, d_nope, d_rope, d_v
    self.kv_lora_rank, self.rope_theta = kv_lora_rank, rope_theta
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype,
                                     rngs=rngs)
    norm = lambda n: nnx.RMSNorm(n, epsilon=1e-6, dtype=dtype, param_dtype=dtype, rngs=rngs)
    q_out = num_heads * (d_nope + d_rope)
    if q_lora_rank is None:  # DeepSeek-V2-Lite: one full-rank query projection
      self.q_a_proj = self.q_a_norm = None
      self.q_proj = linear(hidden, q_out)
    else:
      self.q_a_proj, self.q_a_norm = linear(hidden, q_lora_rank), norm(q_lora_rank)
      self.q_proj = linear(q_lora_rank, q_out)  # DeepSeek's q_b_proj
    self.kv_a_proj = linear(hidden, kv_lora_rank + d_rope)  # latent and the rotary key
    self.kv_a_norm = norm(kv_lora_rank)
    self.kv_b_proj = linear(kv_lora_rank, num_heads * (d_nope + d_v))
    self.o_proj = linear(num_heads * d_v, hidden)

  def __call__(self, x, input_row_offsets, *, max_prompt_len, backend="auto"):
    """Causal MLA over a ragged batch of whole prompts.

    Args:
      x: [total, hidden] in the model dtype: the prompts' tokens, packed.
      input_row_offsets: [batch + 1] int32: prompt b is rows
        input_row_offsets[b]:input_row_offsets[b+1].
      max_prompt_len: static int >= every prompt's length (bucket it).
      backend: passed to ``mla_prefill``; "auto" is Mosaic GPU on Hopper.

    Returns:
      [total, hidden] in the model dtype.
    """
    total, h = x.shape[0], self.num_heads
    positions = token_positions(input_row_offsets, total)
    q_in = x if self.q_a_proj is None else self.q_a_norm(self.q_a_proj(x))
    q = self.q_proj(q_in).reshape(total, h, self.d_nope + self.d_rope)
    latent, k_rope = jnp.split(self.kv_a_proj(x), [self.kv_lora_rank], axis=-1)
    kv = self.kv_b_proj(self.kv_a_norm(latent)).reshape(total, h, self.d_nope + self.d_v)
    k_nope, v = jnp.split(kv, [self.d_nope], axis=-1)
    k_rope = apply_rope(k_rope[:, None, :], positions, self.rope_theta)  # [total, 1, d_rope]
    q_rope = apply_rope(q[..., self.d_nope:], positions, self.rope_theta)
    q = jnp.concatenate([q[..., :self.d_nope], q_rope], axis=-1)
    out = pp.mla_prefill(q, k_nope, k_rope, v, input_row_offsets,
                         max_prompt_len=max_prompt_len, backend=backend)
    return self.o_proj(out.reshape(total, h * self.d_v))


@nnx.jit(static_argnames=("max_prompt_len", "backend"))
def prefill(block: MLA, x, input_row_offsets, *, max_prompt_len, backend="auto"):
  """``block(...)`` compiled as one program."""
  return block(x, input_row_offsets, max_prompt_len=max_prompt_len, backend=backend)


@nnx.jit
def reference(block: MLA, x):
  """The block on one prompt, dense and in float32: x [len, hidden] -> [len, hidden]."""
  n, h, d_nope = x.shape[0], block.num_heads, block.d_nope
  dense = lambda lin, y: jnp.dot(y, lin.kernel[...].astype(jnp.float32), precision=HIGHEST)

  def rms_norm(norm, y):
    y = y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + norm.epsilon)
    return y * norm.scale[...].astype(jnp.float32)

  x, pos = x.astype(jnp.float32), jnp.arange(n)
  q_in = x if block.q_a_proj is None else rms_norm(block.q_a_norm, dense(block.q_a_proj, x))
  q = dense(block.q_proj, q_in).reshape(n, h, -1)
  latent, k_rope = jnp.split(dense(block.kv_a_proj, x), [block.kv_lora_rank], axis=-1)
  kv = dense(block.kv_b_proj, rms_norm(block.kv_a_norm, latent)).reshape(n, h, -1)
  k_rope = apply_rope(k_rope[:, None, :], pos, block.rope_theta)[:, 0]
  q_rope = apply_rope(q[..., d_nope:], pos, block.rope_theta)
  s = (jnp.einsum("qhd,khd->hqk", q[..., :d_nope], kv[..., :d_nope], precision=HIGHEST)
       + jnp.einsum("qhd,kd->hqk", q_rope, k_rope, precision=HIGHEST))
  s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s * q.shape[-1] ** -0.5, -jnp.inf)
  o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), kv[..., d_nope:],
                 precision=HIGHEST)
  return dense(block.o_proj, o.reshape(n, h * block.d_v))


def run(*, hidden=64, num_heads=2, q_lora_rank=48, kv_lora_rank=32, d_nope=128, d_rope=64,
        d_v=128, lens=(13, 40, 1, 7), seed=0, backend="auto"):
  """Builds the block, prefills the ragged batch of prompts of ``lens`` tokens and compares
  it with ``reference`` on each prompt.

  Returns the max absolute error divided by the reference's largest magnitude (NaN if the
  output holds NaN).
  """
  block = MLA(hidden, num_heads, q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank,
              d_nope=d_nope, d_rope=d_rope, d_v=d_v, rngs=nnx.Rngs(seed))
  keys = jax.random.split(jax.random.key(seed + 1), len(lens))
  prompts = [jax.random.normal(key, (n, hidden), jnp.bfloat16) for key, n in zip(keys, lens)]
  offsets = jnp.asarray(np.cumsum([0, *lens]), jnp.int32)
  out = prefill(block, jnp.concatenate(prompts), offsets, max_prompt_len=max(lens),
                backend=backend)
  # Prompts padded to one length compile the reference once; causal, it ignores the pad.
  pad = lambda p: jnp.pad(p, ((0, max(lens) - p.shape[0]), (0, 0)))
  ref = jnp.concatenate([reference(block, pad(p))[:n] for p, n in zip(prompts, lens)])
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--heads", type=int, default=2)
  parser.add_argument("--q-lora-rank", type=int, default=48, help="0: full-rank q_proj")
  parser.add_argument("--kv-lora-rank", type=int, default=32)
  parser.add_argument("--d-nope", type=int, default=128)
  parser.add_argument("--d-rope", type=int, default=64)
  parser.add_argument("--d-v", type=int, default=128)
  parser.add_argument("--lens", type=int, nargs="+", default=[13, 40, 1, 7],
                      help="prompt lengths")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--backend", default="auto", choices=["auto", "triton", "mosaic_gpu"])
  a = parser.parse_args(argv)
  err = run(hidden=a.hidden, num_heads=a.heads, q_lora_rank=a.q_lora_rank or None,
            kv_lora_rank=a.kv_lora_rank, d_nope=a.d_nope, d_rope=a.d_rope, d_v=a.d_v,
            lens=tuple(a.lens), seed=a.seed, backend=a.backend)
  print(f"deepseek MLA on {jax.default_backend()}: {a.heads} heads, lens {a.lens}: "
        f"max error {err:.2e} (relative to the float32 reference's largest value)")
  return err


if __name__ == "__main__":
  main()

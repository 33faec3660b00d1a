"""A Llama-style GQA attention block on Flax NNX, prefilling a ragged batch into a paged cache.

The block projects packed tokens to queries, keys and values, rotates them (RoPE) at each
token's position in its sequence, writes the new K/V rows into a paged cache with
``pallas_prefill.paged.write_kv`` and attends with ``pallas_prefill.mha_prefill`` over
``PagedKV`` operands (causal), so each prompt sees its cached prefix and its own new tokens.
``run`` prefills each prompt in two chunks (the cached prefix, then the rest) and checks the
second chunk against a dense float32 attention over the whole prompt written below.

    python examples/llama_attention.py                      # tiny, on the CPU (interpreter)
    python examples/llama_attention.py --hidden 4096 --heads 32 --kv-heads 8 --head-dim 128 \
        --lens 3000 2048 77 513 --cached 0 1536 50 0 --page-size 64   # Llama 3 8B, on a GPU
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import pallas_prefill as pp

HIGHEST = jax.lax.Precision.HIGHEST


def apply_rope(x, positions, theta):
  """Rotary embedding, rotate-half convention (Llama as Hugging Face stores it).

  x: [tokens, heads, head_dim], any float dtype; positions: [tokens] int32.
  Returns x's shape and dtype; the rotation runs in float32.
  """
  half = x.shape[-1] // 2
  inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angles = positions.astype(jnp.float32)[:, None, None] * inv_freq  # [tokens, 1, half]
  cos, sin = jnp.cos(angles), jnp.sin(angles)
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def token_positions(input_row_offsets, cache_lengths, total):
  """Each packed row's position in its sequence: cache_lengths[b] + its index among the new
  rows. input_row_offsets: [batch + 1] int32; cache_lengths: [batch] int32 -> [total] int32."""
  rows = jnp.arange(total, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(input_row_offsets, rows, side="right") - 1,
                 0, cache_lengths.shape[0] - 1)
  return cache_lengths[seq] + rows - input_row_offsets[seq]


class PagedCache(NamedTuple):
  """One layer's paged K/V cache (a pytree, so it passes through jit).

  k_pages, v_pages: [num_pages, page_size, num_kv_heads, head_dim] in the model dtype.
  block_table: [batch, max_pages_per_seq] int32; cache_lengths: [batch] int32, the tokens
  each sequence already holds.
  """
  k_pages: jax.Array
  v_pages: jax.Array
  block_table: jax.Array
  cache_lengths: jax.Array


def empty_cache(batch, max_len, page_size, num_kv_heads, head_dim, dtype, seed=0):
  """A cache with room for max_len tokens per sequence, on shuffled pages. Unused slots
  hold NaN, as stale pages may hold anything: the kernel must not read them."""
  pages_per_seq = -(-max_len // page_size)
  table = np.random.default_rng(seed).permutation(batch * pages_per_seq)
  shape = (batch * pages_per_seq, page_size, num_kv_heads, head_dim)
  return PagedCache(jnp.full(shape, jnp.nan, dtype), jnp.full(shape, jnp.nan, dtype),
                    jnp.asarray(table.reshape(batch, pages_per_seq), jnp.int32),
                    jnp.zeros(batch, jnp.int32))


class LlamaAttention(nnx.Module):
  """Grouped-query attention with RoPE over a paged KV cache (Llama 2/3; no bias)."""

  def __init__(self, hidden, num_heads, num_kv_heads, head_dim, *, rope_theta=500000.0,
               dtype=jnp.bfloat16, rngs: nnx.Rngs):
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.rope_theta = rope_theta
    linear = lambda i, o: nnx.Linear(i, o, use_bias=False, dtype=dtype, param_dtype=dtype,
                                     rngs=rngs)
    self.q_proj = linear(hidden, num_heads * head_dim)
    self.k_proj = linear(hidden, num_kv_heads * head_dim)
    self.v_proj = linear(hidden, num_kv_heads * head_dim)
    self.o_proj = linear(num_heads * head_dim, hidden)

  def __call__(self, x, input_row_offsets, cache: PagedCache, *, max_prompt_len,
               backend="auto"):
    """Prefills a ragged batch of new tokens on top of the cache.

    Args:
      x: [total, hidden] in the model dtype: the new tokens, packed.
      input_row_offsets: [batch + 1] int32: sequence b's new tokens are rows
        input_row_offsets[b]:input_row_offsets[b+1] (0 of them is fine).
      cache: the layer's PagedCache, with room for cache_lengths + the new tokens.
      max_prompt_len: static int >= every sequence's new-token count (bucket it).
      backend: passed to ``mha_prefill``; "auto" is Mosaic GPU on Hopper.

    Returns:
      (out [total, hidden] in the model dtype, the cache with the new K/V rows written
      and cache_lengths advanced).
    """
    total = x.shape[0]
    positions = token_positions(input_row_offsets, cache.cache_lengths, total)
    q = self.q_proj(x).reshape(total, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(total, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(total, self.num_kv_heads, self.head_dim)
    q, k = apply_rope(q, positions, self.rope_theta), apply_rope(k, positions, self.rope_theta)
    table, lengths = cache.block_table, cache.cache_lengths
    k_pages = pp.paged.write_kv(cache.k_pages, k, input_row_offsets, table, lengths)
    v_pages = pp.paged.write_kv(cache.v_pages, v, input_row_offsets, table, lengths)
    out = pp.mha_prefill(q, pp.PagedKV(k_pages, table, lengths),
                         pp.PagedKV(v_pages, table, lengths), input_row_offsets,
                         max_prompt_len=max_prompt_len, mask=pp.masks.CausalMask(),
                         backend=backend)
    new_lengths = lengths + jnp.diff(input_row_offsets)
    out = self.o_proj(out.reshape(total, self.num_heads * self.head_dim))
    return out, PagedCache(k_pages, v_pages, table, new_lengths)


@nnx.jit(static_argnames=("max_prompt_len", "backend"))
def prefill(block: LlamaAttention, x, input_row_offsets, cache, *, max_prompt_len,
            backend="auto"):
  """``block(...)`` compiled as one program; serving code would donate the cache too."""
  return block(x, input_row_offsets, cache, max_prompt_len=max_prompt_len, backend=backend)


@nnx.jit
def reference(block: LlamaAttention, x):
  """The block on one whole prompt, dense and in float32: x [len, hidden] -> [len, hidden]."""
  n, h, kv, d = x.shape[0], block.num_heads, block.num_kv_heads, block.head_dim
  dense = lambda lin, y: jnp.dot(y, lin.kernel[...].astype(jnp.float32), precision=HIGHEST)
  x, pos = x.astype(jnp.float32), jnp.arange(n)
  q = apply_rope(dense(block.q_proj, x).reshape(n, h, d), pos, block.rope_theta)
  k = apply_rope(dense(block.k_proj, x).reshape(n, kv, d), pos, block.rope_theta)
  k = jnp.repeat(k, h // kv, axis=1)
  v = jnp.repeat(dense(block.v_proj, x).reshape(n, kv, d), h // kv, axis=1)
  s = jnp.einsum("qhd,khd->hqk", q, k, precision=HIGHEST) * d ** -0.5
  s = jnp.where(jnp.tril(jnp.ones((n, n), bool)), s, -jnp.inf)
  o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v, precision=HIGHEST)
  return dense(block.o_proj, o.reshape(n, h * d))


def run(*, hidden=64, num_heads=4, num_kv_heads=2, head_dim=32, lens=(13, 40, 7, 1),
        cached=(0, 24, 5, 0), page_size=16, seed=0, backend="auto"):
  """Builds the block, prefills each prompt's cached[b] tokens, then the rest of the ragged
  batch, and compares the second chunk's output with ``reference`` on the whole prompts.

  Returns the max absolute error divided by the reference's largest magnitude (NaN if the
  output holds NaN).
  """
  block = LlamaAttention(hidden, num_heads, num_kv_heads, head_dim, rngs=nnx.Rngs(seed))
  keys = jax.random.split(jax.random.key(seed + 1), len(lens))
  prompts = [jax.random.normal(key, (n, hidden), jnp.bfloat16) for key, n in zip(keys, lens)]
  cache = empty_cache(len(lens), max(lens), page_size, num_kv_heads, head_dim,
                      jnp.bfloat16, seed)
  offsets = lambda counts: jnp.asarray(np.cumsum([0, *counts]), jnp.int32)
  rest = [n - c for n, c in zip(lens, cached)]
  if sum(cached):  # the first chunk: each prompt's prefix, whose K/V then stay cached
    _, cache = prefill(block, jnp.concatenate([p[:c] for p, c in zip(prompts, cached)]),
                       offsets(cached), cache, max_prompt_len=max(cached), backend=backend)
  out, _ = prefill(block, jnp.concatenate([p[c:] for p, c in zip(prompts, cached)]),
                   offsets(rest), cache, max_prompt_len=max(rest), backend=backend)
  # Prompts padded to one length compile the reference once; causal, it ignores the pad.
  pad = lambda p: jnp.pad(p, ((0, max(lens) - p.shape[0]), (0, 0)))
  ref = jnp.concatenate([reference(block, pad(p))[c:n]
                         for p, n, c in zip(prompts, lens, cached)])
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--hidden", type=int, default=64)
  parser.add_argument("--heads", type=int, default=4)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--head-dim", type=int, default=32)
  parser.add_argument("--lens", type=int, nargs="+", default=[13, 40, 7, 1],
                      help="prompt lengths")
  parser.add_argument("--cached", type=int, nargs="+", default=[0, 24, 5, 0],
                      help="tokens of each prompt prefilled first, then cached")
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--backend", default="auto", choices=["auto", "triton", "mosaic_gpu"])
  a = parser.parse_args(argv)
  err = run(hidden=a.hidden, num_heads=a.heads, num_kv_heads=a.kv_heads,
            head_dim=a.head_dim, lens=tuple(a.lens), cached=tuple(a.cached),
            page_size=a.page_size, seed=a.seed, backend=a.backend)
  print(f"llama attention on {jax.default_backend()}: lens {a.lens}, cached {a.cached}: "
        f"max error {err:.2e} (relative to the float32 reference's largest value)")
  return err


if __name__ == "__main__":
  main()

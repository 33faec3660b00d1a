"""Hashes of the default calls' Mosaic GPU kernels as lowered for an H200, on the CPU: a
change that should leave the defaults alone (a new option, off) can show it did, by
running this at both commits and comparing (the thirty-seventh session's check):

    PYTHONPATH=. python -m benchmarks.experiments.lowered_hashes > new.txt
    git worktree add /tmp/old OLD && (cd /tmp/old && PYTHONPATH=/tmp/old \\
        python -m benchmarks.experiments.lowered_hashes > /tmp/old.txt)
    diff /tmp/old.txt new.txt

Each line: the call, and the first 12 hex digits of the SHA-1 of the attention kernel's
lowered module text (``tests/lowered.py``'s ``kernel_texts``). The calls: MHA 32/8 at
depth 128 at max_prompt_len 512, 4096 and 16384 (the defaults' three regimes), with and
without the LSE; a sliding window; a soft cap; MLA 192/128; ``dot_product_attention`` on
padded batches of short and long prompts; FP8 MHA (short and long, a bf16 q, paged) and
MLA. The hash covers every kernel of the call (the work list's, V^T's, the attention
kernel).
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp

import pallas_prefill as pp
from pallas_prefill import masks
from tests import lowered
from tests.test_lowering import lower_for_h200


def kernel_hash(fn, *args) -> str:
  module = lower_for_h200(fn, *args).compiler_ir()
  text = "\n".join(lowered.kernel_texts(module))  # every kernel of the call
  return hashlib.sha1(text.encode()).hexdigest()[:12]


def calls():
  """(name, fn, abstract args) of each default call."""
  s = jax.ShapeDtypeStruct
  mosaic = dict(backend="mosaic_gpu", interpret=False)
  q, kv = s((4096, 32, 128), jnp.bfloat16), s((4096, 8, 128), jnp.bfloat16)
  off = s((9,), jnp.int32)
  for max_len in (512, 4096, 16384):
    for lse in (False, True):
      yield (f"mha max_prompt_len={max_len} lse={lse}",
             lambda q, k, v, o, m=max_len, l=lse: pp.mha_prefill(
                 q, k, v, o, max_prompt_len=m, return_lse=l, **mosaic), (q, kv, kv, off))
  yield ("mha sliding 512", lambda q, k, v, o: pp.mha_prefill(
      q, k, v, o, max_prompt_len=4096, mask=masks.SlidingWindowCausalMask(512), **mosaic),
         (q, kv, kv, off))
  mla = (s((2048, 16, 192), jnp.bfloat16), s((2048, 16, 128), jnp.bfloat16),
         s((2048, 1, 64), jnp.bfloat16), s((2048, 16, 128), jnp.bfloat16), off)
  yield ("mla", lambda q, a, b, v, o: pp.mla_prefill(q, a, b, v, o, max_prompt_len=2048,
                                                     **mosaic), mla)
  for t in (512, 2048):
    qp, kp = s((4, t, 8, 128), jnp.bfloat16), s((4, t, 2, 128), jnp.bfloat16)
    yield (f"padded T={t}", lambda q, k, v, n: pp.dot_product_attention(
        q, k, v, query_seq_lengths=n, key_value_seq_lengths=n, is_causal=True, **mosaic),
           (qp, kp, kp, s((4,), jnp.int32)))
  yield ("mha soft cap 4096", lambda q, k, v, o: pp.mha_prefill(
      q, k, v, o, max_prompt_len=4096, logits_soft_cap=30.0, **mosaic), (q, kv, kv, off))
  # FP8 (e4m3, per-tensor scales): packed at both lengths, a bf16 q over FP8 K/V, paged
  # (64-row pages, read in place), MLA
  f8, sc = jnp.float8_e4m3fn, s((), jnp.float32)
  q8, kv8 = s((4096, 32, 128), f8), s((4096, 8, 128), f8)
  for max_len in (512, 4096):
    yield (f"fp8 mha max_prompt_len={max_len}", lambda q, k, v, o, a, m=max_len: (
        pp.mha_prefill(q, k, v, o, max_prompt_len=m, q_scale=a, k_scale=a, v_scale=a,
                       **mosaic)), (q8, kv8, kv8, off, sc))
  yield ("fp8 kv bf16 q", lambda q, k, v, o, a: pp.mha_prefill(
      q, k, v, o, max_prompt_len=4096, k_scale=a, v_scale=a, **mosaic),
         (q, kv8, kv8, off, sc))
  pages, table, lens = s((256, 64, 8, 128), f8), s((8, 32), jnp.int32), s((8,), jnp.int32)
  yield ("fp8 paged", lambda q, kp, vp, t, c, o, a: pp.mha_prefill(
      q, pp.PagedKV(kp, t, c), pp.PagedKV(vp, t, c), o, max_prompt_len=512, q_scale=a,
      k_scale=a, v_scale=a, **mosaic), (q8, pages, pages, table, lens, off, sc))
  mla8 = (s((2048, 16, 192), f8), s((2048, 16, 128), f8), s((2048, 1, 64), f8),
          s((2048, 16, 128), f8), off, sc)
  yield ("fp8 mla", lambda q, a, b, v, o, c: pp.mla_prefill(
      q, a, b, v, o, max_prompt_len=2048, q_scale=c, k_scale=c, v_scale=c, **mosaic), mla8)


def main():
  for name, fn, args in calls():
    print(name, kernel_hash(fn, *args), flush=True)


if __name__ == "__main__":
  main()

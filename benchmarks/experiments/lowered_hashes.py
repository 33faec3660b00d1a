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
without the LSE; a sliding window; MLA 192/128; ``dot_product_attention`` on a padded
batch.
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
  text = lowered.kernel_texts(module)[-1]
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
  qp, kp = s((4, 512, 8, 128), jnp.bfloat16), s((4, 512, 2, 128), jnp.bfloat16)
  yield ("padded", lambda q, k, v, n: pp.dot_product_attention(
      q, k, v, query_seq_lengths=n, key_value_seq_lengths=n, is_causal=True, **mosaic),
         (qp, kp, kp, s((4,), jnp.int32)))


def main():
  for name, fn, args in calls():
    print(name, kernel_hash(fn, *args), flush=True)


if __name__ == "__main__":
  main()

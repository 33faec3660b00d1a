"""Correctness and speed of pallas_prefill on the anchor workloads, on the GPU.

    python -m benchmarks.h200 [--workloads equal4x4096 ...]
        [--kernels mha mla] [--sweep mla] [--no-chunked] [--out results.json]

Every figure is the median per-call time of 5 rounds of 20 calls after warm-up, the calls
rotating over 3 input sets, with useful TFLOP/s counted as in anchors-h200.md. Every
output is compared with the float32 reference computed on the GPU; a figure counts only
when that error is under 2e-2. cuDNN through jax.nn.dot_product_attention on the padded
batch is timed in the same run as an anchor, and the bf16 matmul rate as the ceiling.
The chunked-prefill workload (8 x 512 new tokens over 0 to 8k cached, pages of 64) times
the paged cache against the same K/V packed contiguously.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import pallas_prefill as pp
from benchmarks import workloads as wl

warnings.filterwarnings("ignore", category=DeprecationWarning)

MHA_SHAPE = dict(heads=32, kv_heads=8, head_dim=128)  # GQA 32/8
MLA_SHAPE = dict(heads=128, d_nope=128, d_rope=64, d_v=128)  # DeepSeek-V3, shared rope


def bench(fn, arg_sets, rounds=5, reps=20) -> float:
  """Median seconds per call; calls rotate over arg_sets."""
  for args in arg_sets:
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for i in range(reps):
      out = fn(*arg_sets[i % len(arg_sets)])
    jax.block_until_ready(out)
    times.append((time.perf_counter() - t0) / reps)
  return statistics.median(times)


def rel_err(x, ref) -> float:
  x = jnp.asarray(x, jnp.float32)
  ref = jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def matmul_tflops() -> float:
  a = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (8192, 8192), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  return 2 * 8192**3 / bench(f, [(a, b)]) / 1e12


def inputs(kind, lengths, seed):
  """Fresh random bf16 operands of the anchor shape for `kind`, plus int32 offsets."""
  total = int(sum(lengths))
  keys = iter(jax.random.split(jax.random.key(seed), 4))
  normal = lambda *shape: jax.random.normal(next(keys), shape, jnp.bfloat16)
  if kind == "mha":
    h, hkv, d = MHA_SHAPE["heads"], MHA_SHAPE["kv_heads"], MHA_SHAPE["head_dim"]
    arrays = (normal(total, h, d), normal(total, hkv, d), normal(total, hkv, d))
  else:
    h, dn, dr, dv = (MLA_SHAPE[n] for n in ("heads", "d_nope", "d_rope", "d_v"))
    arrays = (normal(total, h, dn + dr), normal(total, h, dn), normal(total, 1, dr),
              normal(total, h, dv))
  return (*arrays, jnp.asarray(wl.offsets(lengths)))


def useful_flops(kind, lengths):
  if kind == "mha":
    return wl.useful_flops(lengths, MHA_SHAPE["heads"], MHA_SHAPE["head_dim"],
                           MHA_SHAPE["head_dim"])
  return wl.useful_flops(lengths, MLA_SHAPE["heads"], MLA_SHAPE["d_nope"] + MLA_SHAPE["d_rope"],
                         MLA_SHAPE["d_v"])


def pad_batch(x, lengths, max_len):
  """Packed [total, ...] -> padded [batch, max_len, ...]."""
  off = wl.offsets(lengths)
  return jnp.stack([jnp.pad(x[off[b]:off[b + 1]],
                            [(0, max_len - lengths[b])] + [(0, 0)] * (x.ndim - 1))
                    for b in range(len(lengths))])


def unpad_batch(x, lengths):
  return jnp.concatenate([x[b, :n] for b, n in enumerate(lengths)])


ENTRY = {"mha": (pp.mha_prefill, pp.reference.mha_prefill_reference),
         "mla": (pp.mla_prefill, pp.reference.mla_prefill_reference)}


def cudnn_padded_operands(kind, arrays, lengths, max_len):
  """What a JAX user hands cuDNN: padded [batch, max_len, heads, depth] operands; for MLA
  the rope key broadcast to every head and V zero-padded to the QK depth."""
  if kind == "mha":
    q, k, v = arrays
  else:
    q, k_nope, k_rope, v = arrays
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:2] + k_rope.shape[2:])],
                        axis=-1)
    v = jnp.pad(v, [(0, 0), (0, 0), (0, q.shape[-1] - v.shape[-1])])
  return tuple(pad_batch(x, lengths, max_len) for x in (q, k, v))


def run_workload(kind, name, lengths, configs, rows):
  max_len = max(lengths)
  sets = [inputs(kind, lengths, s) for s in range(3)]
  flops = useful_flops(kind, lengths)
  kernel, reference = ENTRY[kind]
  ref = reference(*sets[0], max_prompt_len=max_len)

  def record(system, config, fn, arg_sets, out):
    err = rel_err(out, ref)
    sec = bench(fn, arg_sets)
    row = dict(kernel=kind, workload=name, system=system, config=config,
               ms=sec * 1e3, tflops=flops / sec / 1e12, relerr=err, correct=err < 2e-2)
    rows.append(row)
    print(f"  {kind} {name:12s} {system:16s} {str(config):20s} {row['ms']:8.3f} ms "
          f"{row['tflops']:6.1f} TFLOP/s  err {err:.1e}", flush=True)

  for cfg in configs:
    fn = jax.jit(lambda *a, cfg=cfg: kernel(*a, max_prompt_len=max_len, config=cfg))
    try:
      out = fn(*sets[0])
    except Exception as e:  # a config that does not fit (shared memory) is skipped
      print(f"  {kind} {name:12s} config {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
      continue
    record("pallas_prefill", cfg and dataclass_tuple(cfg), fn, sets, out)

  lens = jnp.asarray(lengths, jnp.int32)
  padded = [cudnn_padded_operands(kind, s[:-1], lengths, max_len) + (lens,) for s in sets]
  d_v = sets[0][-2].shape[-1]
  cudnn = jax.jit(lambda q, k, v, lens: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, query_seq_lengths=lens, key_value_seq_lengths=lens,
      implementation="cudnn")[..., :d_v])
  record("cudnn_padded", None, cudnn, padded, unpad_batch(cudnn(*padded[0]), lengths))
  del sets, padded, ref


CHUNKED_NEW = [512] * 8
CHUNKED_CACHE = [0, 1024, 2048, 3072, 4096, 5120, 6144, 8192]
PAGE_SIZE = 64


def chunked_inputs(kind, seed):
  """Chunked prefill: 8 x 512 new tokens over 0 to 8k cached, K/V in shuffled pages of 64.
  Returns the paged operands and the same K/V packed contiguously with kv offsets."""
  q_lens, cache = np.array(CHUNKED_NEW), np.array(CHUNKED_CACHE)
  kv_lens = cache + q_lens
  pages_per_seq = -(-kv_lens // PAGE_SIZE)
  max_pages, num_pages = int(pages_per_seq.max()), int(pages_per_seq.sum())
  rng = np.random.default_rng(seed)
  order = iter(rng.permutation(num_pages))
  table = np.zeros((len(q_lens), max_pages), np.int32)
  for b, n in enumerate(pages_per_seq):
    table[b, :n] = [next(order) for _ in range(n)]
  q, *kv, _ = inputs(kind, [num_pages * PAGE_SIZE], seed)  # K/V rows become the pages
  q = q[:int(q_lens.sum())]
  pages = [x.reshape(num_pages, PAGE_SIZE, *x.shape[1:]) for x in kv]
  table_j, cache_j = jnp.asarray(table), jnp.asarray(cache, jnp.int32)
  paged = [pp.PagedKV(p, table_j, cache_j) for p in pages]
  rows = np.concatenate([table[b, np.arange(n) // PAGE_SIZE] * PAGE_SIZE + np.arange(n) %
                         PAGE_SIZE for b, n in enumerate(kv_lens)])
  packed = [x[rows] for x in kv]
  q_off, kv_off = jnp.asarray(wl.offsets(q_lens)), jnp.asarray(wl.offsets(kv_lens))
  return (q, *paged, q_off), (q, *packed, q_off, kv_off)


def run_chunked(kind, rows):
  """Paged against contiguous on the same logical K/V, one run."""
  sets = [chunked_inputs(kind, s) for s in range(3)]
  kv_lens = list(np.array(CHUNKED_CACHE) + CHUNKED_NEW)
  if kind == "mha":
    flops = wl.useful_flops(CHUNKED_NEW, MHA_SHAPE["heads"], MHA_SHAPE["head_dim"],
                            MHA_SHAPE["head_dim"], kv_lens=kv_lens)
  else:
    flops = wl.useful_flops(CHUNKED_NEW, MLA_SHAPE["heads"],
                            MLA_SHAPE["d_nope"] + MLA_SHAPE["d_rope"], MLA_SHAPE["d_v"],
                            kv_lens=kv_lens)
  kernel, reference = ENTRY[kind]
  max_len = max(CHUNKED_NEW)
  *packed_args, kv_off = sets[0][1]
  ref = reference(*packed_args, max_prompt_len=max_len, kv_input_row_offsets=kv_off)
  paged_fn = jax.jit(lambda *a: kernel(*a, max_prompt_len=max_len))
  packed_fn = jax.jit(lambda *a: kernel(*a[:-1], max_prompt_len=max_len,
                                        kv_input_row_offsets=a[-1]))
  for system, fn, args in (("pallas_prefill_paged", paged_fn, [s[0] for s in sets]),
                           ("pallas_prefill", packed_fn, [s[1] for s in sets])):
    err = rel_err(fn(*args[0]), ref)
    sec = bench(fn, args)
    row = dict(kernel=kind, workload="chunked8x512_page64", system=system, config=None,
               ms=sec * 1e3, tflops=flops / sec / 1e12, relerr=err, correct=err < 2e-2)
    rows.append(row)
    print(f"  {kind} chunked8x512  {system:20s} {row['ms']:8.3f} ms {row['tflops']:6.1f} "
          f"TFLOP/s  err {err:.1e}", flush=True)


def dataclass_tuple(cfg):
  return (cfg.block_q, cfg.block_kv, cfg.num_warps, cfg.num_stages)


SWEEP = [pp.MhaConfig(bq, bk, w, s) for bq, bk, w, s in itertools.product(
    (64, 128), (32, 64), (4, 8), (2, 3))]


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernels", nargs="*", default=["mha", "mla"], choices=["mha", "mla"])
  parser.add_argument("--workloads", nargs="*", default=list(wl.WORKLOADS))
  parser.add_argument("--sweep", nargs="*", default=[], choices=["mha", "mla"],
                      help="kernels for which to time every config in SWEEP too")
  parser.add_argument("--out", default=None, help="write the rows as JSON here")
  parser.add_argument("--no-chunked", dest="chunked", action="store_false",
                      help="skip the chunked-prefill workload (paged against contiguous)")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    sys.exit("benchmarks.h200 needs a GPU")
  meta = dict(date=time.strftime("%Y-%m-%d"), jax=jax.__version__,
              gpu=jax.devices()[0].device_kind, matmul_tflops=matmul_tflops())
  print(f"{meta}", flush=True)
  rows = []
  for kind in args.kernels:
    configs = [None] + (SWEEP if kind in args.sweep else [])
    for name in args.workloads:
      run_workload(kind, name, wl.WORKLOADS[name], configs, rows)
    if args.chunked:
      run_chunked(kind, rows)
  print("\n| kernel | workload | system | config | ms | useful TFLOP/s | rel. error |")
  print("|---|---|---|---|---|---|---|")
  best = {}
  for r in rows:
    key = (r["kernel"], r["workload"], r["system"])
    if r["correct"] and (key not in best or r["tflops"] > best[key]["tflops"]):
      best[key] = r
  for r in rows:
    if r["config"] is None or best.get((r["kernel"], r["workload"], r["system"])) is r:
      print(f"| {r['kernel']} | {r['workload']} | {r['system']} | {r['config']} | {r['ms']:.3f} | "
            f"{r['tflops']:.1f} | {r['relerr']:.1e} |")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
  main()

"""Short prompts padded to a long T: the kernel picked at run time against T's (issue 23).

    python -m benchmarks.experiments.padded_buckets [--workloads short64] [--ts 0 2048 9000]
        [--rounds 3] [--out DIR]

``dot_product_attention`` knows only the padded length T statically. Above
``config.LONG_PROMPT`` it compiles a second kernel, for LONG_PROMPT, and runs it when
every real prompt fits (``padded.short_prompt_bucket``): on Mosaic GPU the short-prompt
defaults (the column mask, narrow last tiles, two compute warpgroups) instead of T's. This
times, on the harness's MHA workloads padded to each T (0: the workload's longest prompt),
the default call ("picked") against the same call with T's default config given as a
``MosaicConfig`` (one kernel: the behaviour before), in one process, rounds in turns,
medians, useful TFLOP/s of the real tokens, and each arm's first call (caches cleared:
trace, compile, run); and checks that both give the same bits.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import pallas_prefill as pp
from pallas_prefill import config as config_lib
from pallas_prefill import masks
from benchmarks import run as harness
from benchmarks import workloads as wl


def main(argv=None):
  parser = argparse.ArgumentParser()
  parser.add_argument("--workloads", nargs="+", default=["short64"])
  parser.add_argument("--ts", nargs="+", type=int, default=[0, 2048, 9000])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  heads, kv_heads, depth = 32, 8, 128
  rows = []
  for name in args.workloads:
    w = wl.WORKLOADS[name]
    lens = np.asarray(w.q_lens, np.int32)
    flops = wl.useful_flops(w.q_lens, heads, depth, depth)
    for t in args.ts:
      t = t or w.max_len
      rng = np.random.default_rng(0)
      mk = lambda h: jnp.asarray(  # noqa: E731
          rng.standard_normal((len(lens), t, h, depth), np.float32), jnp.bfloat16)
      q, k, v = mk(heads), mk(kv_heads), mk(kv_heads)
      n = jnp.asarray(lens)
      single = config_lib.default_mosaic_config(depth, depth, jnp.bfloat16,
                                                masks.CausalMask(), t, padded=True)
      arms = {}
      for arm, config in (("picked", None), ("T's kernel", single)):
        arms[arm] = jax.jit(lambda q, k, v, n, config=config: pp.dot_product_attention(
            q, k, v, query_seq_lengths=n, key_value_seq_lengths=n, is_causal=True,
            config=config))
      outs, first = {}, {}
      for arm, fn in arms.items():  # the first call: trace, compile (caches cleared), run
        jax.clear_caches()
        t0 = time.perf_counter()
        outs[arm] = np.asarray(fn(q, k, v, n), np.float32)
        first[arm] = time.perf_counter() - t0
      same = bool(np.array_equal(*outs.values()))
      times = {arm: [] for arm in arms}
      for _ in range(args.rounds):
        for arm, fn in arms.items():
          times[arm].append(harness.bench_jax(fn, [(q, k, v, n)], rounds=1))
      for arm in arms:
        secs = float(np.median(times[arm]))
        rows.append(dict(workload=name, t=t, arm=arm, secs=secs,
                         tflops=flops / secs / 1e12, same_bits=same,
                         first_call_s=first[arm]))
      del q, k, v, outs
  print(f"{jax.devices()[0].device_kind}, commit {harness.commit()}")
  print("| workload | T | picked | T's kernel | T's time / picked's | same bits | "
        "first call s (picked / T's) |")
  print("|---|---|---|---|---|---|---|")
  for i in range(0, len(rows), 2):
    a, b = rows[i], rows[i + 1]
    print(f"| {a['workload']} | {a['t']} | {a['tflops']:.1f} | {b['tflops']:.1f} | "
          f"{b['secs'] / a['secs']:.3f}x | {a['same_bits']} | "
          f"{a['first_call_s']:.1f} / {b['first_call_s']:.1f} |")
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "padded-buckets.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, commit=harness.commit(),
                     rows=rows), f, indent=1)


if __name__ == "__main__":
  main()

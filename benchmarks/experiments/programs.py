"""Persistent against one-unit-per-program schedules of the Mosaic GPU kernel, per workload:

    python -m benchmarks.experiments.programs [--kernels mha mla] [--workloads ...]

Times MosaicConfig(num_programs=None) (one program per SM) and
num_programs=ONE_UNIT_EACH (every (head, item) unit its own program) with each kernel's
default tiles, like the harness (three input sets, medians), and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import jax.numpy as jnp

import pallas_prefill as pp
from benchmarks import tune
from pallas_prefill import config as config_lib


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernels", nargs="*", default=["mha", "mla"], choices=["mha", "mla"])
  parser.add_argument("--workloads", nargs="*",
                      default=["equal4x4096", "skew16_16k", "short64"])
  args = parser.parse_args(argv)
  rows = []
  for kind in args.kernels:
    qk, v = tune.DEPTHS[kind]
    for name in args.workloads:
      long = name != "short64"
      base = config_lib.default_mosaic_config(
          qk, v, jnp.bfloat16, pp.masks.CausalMask(),
          config_lib.LONG_PROMPT + 1 if long else 1)
      got = [tune.candidate_tflops(kind, (name,), dataclasses.replace(base, num_programs=n),
                                   "mosaic_gpu") for n in (None, tune.ONE_UNIT_EACH)]
      rows.append((kind, name, base, *got))
  print(f"{'kernel':6s} {'workload':14s} {'persistent':>10s} {'one each':>10s}  tiles")
  for kind, name, base, a, b in rows:
    fmt = lambda x: "failed" if x is None else f"{x:.1f}"  # noqa: E731
    print(f"{kind:6s} {name:14s} {fmt(a):>10s} {fmt(b):>10s}  "
          f"{base.block_q}x{base.block_kv}x{base.num_stages}")
  return 0


if __name__ == "__main__":
  sys.exit(main())

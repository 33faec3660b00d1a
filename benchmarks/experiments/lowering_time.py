"""Where a first call's host time goes: tracing and lowering (no GPU), or on a GPU every step.

    python -m benchmarks.experiments.lowering_time [--kernel mha] [--total-q 16384]
        [--max-prompt-len 4096] [--repeats 2] [--profile 30] [--device]

Issue 25 asks for the first-call seconds of a new shape against cuDNN's; the harness's
``first_call_s`` (JAX's caches cleared, trace, lowering, compilation and the run) gave
ours 5-7 s on the H200 against cuDNN packed's 0.4-1.4 s (BUILD_NOTES.md, eighteenth
session). This splits off the part that is Python on the host: each backend's call
(``scripts/lowered_ir.py``'s MHA and MLA calls, bf16, causal) traced and lowered for an
abstract H200 as the lowering tests do, caches cleared before each repeat, and prints the
seconds of each step. With ``--profile N`` it prints the N entries of a cProfile of the
Mosaic GPU lowering with the largest cumulative time. The rest of a first call (XLA's
compilation, Mosaic GPU's and Triton's PTX to SASS, the run) needs the GPU: with
``--device`` (on one) each step of a first call is timed on the device's own arrays
(random, the offsets five equal sequences): trace, lower, ``compile()``, the first run
and a second one (the compiled call's own time), caches cleared before each repeat.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import use_abstract_mesh

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "scripts"))
import lowered_ir  # noqa: E402  (scripts/ is no package)


def call(kernel, backend, total_q, max_prompt_len):
  """(fn, abstract args) of one of our calls at the harness's shapes."""
  if kernel == "mha":
    return lowered_ir.mha_call(backend, total_q=total_q, heads=32, kv_heads=8,
                               max_prompt_len=max_prompt_len)
  return lowered_ir.mla_call(backend, total_q=total_q, heads=128,
                             max_prompt_len=max_prompt_len)


def trace_and_lower(fn, args):
  """Seconds to trace and to lower ``fn`` for the abstract H200, caches cleared first."""
  jax.clear_caches()
  with use_abstract_mesh(lowered_ir.H200_MESH):
    t0 = time.perf_counter()
    traced = jax.jit(fn).trace(*args)
    t1 = time.perf_counter()
    traced.lower(lowering_platforms=("cuda",))
    t2 = time.perf_counter()
  return t1 - t0, t2 - t1


def first_call_steps(fn, args, total_q):
  """Seconds to trace, lower, compile, run once and run again ``fn`` on the default device
  (``args`` abstract: arrays made for them, the offsets over ``total_q`` rows), caches
  cleared first."""
  rng = np.random.default_rng(0)

  def make(spec):
    if spec is None:
      return None
    if jnp.issubdtype(spec.dtype, jnp.integer):  # offsets: five equal sequences
      return jnp.asarray(np.linspace(0, total_q, spec.shape[0]).astype(np.int32))
    return jnp.asarray(rng.standard_normal(spec.shape), spec.dtype)

  arrays = [make(x) for x in args]
  jax.block_until_ready([x for x in arrays if x is not None])
  jax.clear_caches()
  marks = [time.perf_counter()]
  traced = jax.jit(fn).trace(*arrays)
  marks.append(time.perf_counter())
  lowered = traced.lower()
  marks.append(time.perf_counter())
  compiled = lowered.compile()
  marks.append(time.perf_counter())
  for _ in range(2):
    jax.block_until_ready(compiled(*arrays))
    marks.append(time.perf_counter())
  return [b - a for a, b in zip(marks, marks[1:])]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernel", default="mha", choices=["mha", "mla"])
  parser.add_argument("--total-q", type=int, default=16384)
  parser.add_argument("--max-prompt-len", type=int, default=4096)
  parser.add_argument("--repeats", type=int, default=2)
  parser.add_argument("--profile", type=int, default=0, metavar="N")
  parser.add_argument("--device", action="store_true",
                      help="time every step of a first call on the default device (a GPU)")
  a = parser.parse_args(argv)
  if a.device:
    print("| backend | repeat | trace s | lower s | compile s | first run s | second run s |\n"
          "|---|---|---|---|---|---|---|")
    for backend in ("mosaic_gpu", "triton"):
      fn, args = call(a.kernel, backend, a.total_q, a.max_prompt_len)
      for r in range(a.repeats):
        steps = first_call_steps(fn, args, a.total_q)
        print(f"| {backend} | {r} | " + " | ".join(f"{x:.3f}" for x in steps) + " |",
              flush=True)
    return 0
  print("| backend | repeat | trace s | lower s |\n|---|---|---|---|")
  for backend in ("mosaic_gpu", "triton"):
    fn, args = call(a.kernel, backend, a.total_q, a.max_prompt_len)
    for r in range(a.repeats):
      t, low = trace_and_lower(fn, args)
      print(f"| {backend} | {r} | {t:.2f} | {low:.2f} |", flush=True)
  if a.profile:
    fn, args = call(a.kernel, "mosaic_gpu", a.total_q, a.max_prompt_len)
    profile = cProfile.Profile()
    profile.runcall(trace_and_lower, fn, args)
    pstats.Stats(profile).sort_stats("cumulative").print_stats(a.profile)
  return 0


if __name__ == "__main__":
  sys.exit(main())

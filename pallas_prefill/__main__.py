"""`python -m pallas_prefill`: runs each kernel on a built-in ragged batch with fresh random
inputs, checks it against the float32 reference and times it.

Compiled on a GPU, in the Pallas interpreter on the CPU (sizes are kept small for that).
Exits 1 if any example's error is over the tolerance.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np

import pallas_prefill as pp
from pallas_prefill import config as config_lib

# The Pallas Triton backend is deprecated in favour of Mosaic GPU (JAX 0.11); its warnings
# are expected here.
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"jax\..*")

TOLERANCE = 2e-2  # relative Frobenius error of a bfloat16 output


def _rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def _median_seconds(fn, calls: int) -> float:
  jax.block_until_ready(fn())  # warm-up: compiles
  times = []
  for _ in range(calls):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _check_and_time(name, kernel, reference, args, kwargs, calls, what) -> float:
  """Runs one example eagerly (validating the offsets), compares it with the reference,
  times it under jit as a model calls it (no host-side offset check per call); returns
  the error."""
  out = kernel(*args, **kwargs)
  err = _rel_err(out, reference(*args, **kwargs))
  jitted = jax.jit(functools.partial(kernel, **kwargs))
  seconds = _median_seconds(lambda: jitted(*args), calls)
  print(f"{name}  {what}")
  print(f"  out{tuple(out.shape)} {out.dtype}  rel err {err:.2e} (tol {TOLERANCE:.0e})  "
        f"{seconds * 1e3:.3f} ms/call (median of {calls})")
  return err


LENS = [1, 17, 200, 64, 0, 333]  # six prompts, one empty, one of a single token


def _ragged_normal(rng, lens, *shapes):
  total = sum(lens)
  return [jnp.asarray(rng.standard_normal((total, *shape)), jnp.bfloat16) for shape in shapes]


def _offsets(lens):
  return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


def _mha_example(rng, calls: int) -> float:
  """Causal GQA, 8 query heads over 2 KV heads, head dim 128."""
  q, k, v = _ragged_normal(rng, LENS, (8, 128), (2, 128), (2, 128))
  return _check_and_time(
      "mha_prefill", pp.mha_prefill, pp.reference.mha_prefill_reference,
      (q, k, v, _offsets(LENS)), dict(max_prompt_len=max(LENS)), calls,
      f"lens={LENS} q{tuple(q.shape)} k/v{tuple(k.shape)} bfloat16 causal")


def _mla_example(rng, calls: int) -> float:
  """Causal DeepSeek-V3 depths (128 nope + 64 rope shared by all heads, v 128), 16 heads."""
  q, k_nope, k_rope, v = _ragged_normal(rng, LENS, (16, 192), (16, 128), (1, 64), (16, 128))
  return _check_and_time(
      "mla_prefill", pp.mla_prefill, pp.reference.mla_prefill_reference,
      (q, k_nope, k_rope, v, _offsets(LENS)), dict(max_prompt_len=max(LENS)), calls,
      f"lens={LENS} q{tuple(q.shape)} k_nope{tuple(k_nope.shape)} "
      f"k_rope{tuple(k_rope.shape)} v{tuple(v.shape)} bfloat16 causal")


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(
      prog="python -m pallas_prefill",
      description="Runs mha_prefill and mla_prefill on a built-in ragged batch with fresh "
      "random inputs, checks each against the float32 reference and times it: compiled "
      "on a GPU, in the Pallas interpreter on the CPU.",
      epilog=f"Exits 1 if an example's relative error is at or over {TOLERANCE:g}.")
  parser.add_argument("--seed", type=int, default=None,
                      help="seed of the random inputs (default: a fresh one, printed)")
  parser.add_argument("--calls", type=int, default=None,
                      help="timed calls per example (default 5 in the interpreter, 20 "
                      "compiled)")
  args = parser.parse_args(argv)
  if args.calls is not None and args.calls < 1:
    parser.error(f"--calls must be at least 1, got {args.calls}")
  seed = int.from_bytes(os.urandom(4), "little") if args.seed is None else args.seed
  rng = np.random.default_rng(seed)
  interpret = jax.default_backend() == "cpu"  # what mha_prefill's interpret=None picks
  if interpret:
    mode = "the Pallas interpreter (Triton kernel)"
  else:  # what backend="auto" picks for bf16 at these depths
    mode = "compiled, " + ("Mosaic GPU" if config_lib.is_hopper() else "Triton") + " kernel"
  print(f"jax {jax.__version__}, backend {jax.default_backend()} ({jax.devices()[0]}), "
        f"{mode}, seed {seed}")
  calls = args.calls or (5 if interpret else 20)
  errors = [_mha_example(rng, calls), _mla_example(rng, calls)]
  if max(errors) >= TOLERANCE:
    print("FAILED: error over tolerance", file=sys.stderr)
    return 1
  print("OK")
  return 0


if __name__ == "__main__":
  sys.exit(main())

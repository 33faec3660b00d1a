"""Does the timing method move a figure? Each system timed three ways, with the SM clock.

    python -m benchmarks.experiments.timers [--kernel mha]
        [--workloads equal4x4096 short64]
        [--systems pallas_prefill_mosaic cudnn_packed torch_sdpa_cudnn] [--rest 2]
        [--rounds 2] [--out DIR]

The harness times JAX systems back to back (``run.bench_jax``: 5 rounds of 20 calls,
wall clock, one wait at the end of each round) and torch systems with
``triton.testing.do_bench`` (CUDA events around each call, with a 256 MB write between
calls to empty the L2, so the tensor cores rest while it runs). A kernel held back by
the power limit runs faster with rests in between. This times every system:

- ``stream``: back to back, as ``run.bench_jax`` (torch: a ``torch.cuda.synchronize``
  ends each round);
- ``stream_x4``: (JAX systems) four calls in one jitted function, back to back: what the
  host's dispatch and the launch gaps between one call's kernels add, once per four;
- ``do_bench``: (torch systems) ``run.bench_torch``, as the harness times them;

and samples ``nvidia-smi``'s SM clock and power draw every 50 ms over each (its
samples lag: read them as a hint). Each measurement starts after ``--rest`` seconds with
the GPU idle, so that every system starts from the same power state (a GPU that has just
run flat out runs the next ~100 ms at lower clocks than one that has rested), and the
systems and methods take turns for ``--rounds`` rounds. Writes DIR/timers.json, prints
a table.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import subprocess
import sys
import threading
import time

import jax

from benchmarks import run
from benchmarks import systems as sy
from benchmarks import workloads as wl


class ClockSampler:
  """nvidia-smi's SM clock (MHz) and power (W) every 50 ms, on a thread; ``window(t0,
  t1)`` gives the medians of the samples taken between two host times."""

  def __init__(self):
    self.samples = []  # (host time, MHz, W)
    try:
      self.proc = subprocess.Popen(
          ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
           "-lms", "50"], stdout=subprocess.PIPE, text=True)
    except OSError:
      self.proc = None
      return
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self):
    for line in self.proc.stdout:
      try:
        mhz, watts = (float(x) for x in line.split(","))
      except ValueError:
        continue
      self.samples.append((time.time(), mhz, watts))

  def window(self, t0, t1):
    inside = [(m, w) for t, m, w in self.samples if t0 <= t <= t1]
    if not inside:
      return None, None
    return (statistics.median(m for m, _ in inside), statistics.median(w for _, w in inside))

  def close(self):
    if self.proc is not None:
      self.proc.terminate()


def stream_x4(fn, arg_sets):
  """A timer of four calls (rotating over the input sets) in one jit, per call."""
  sets = [arg_sets[i % len(arg_sets)] for i in range(4)]
  n = len(sets[0])
  four = jax.jit(lambda *a: [fn(*a[i * n:(i + 1) * n]) for i in range(4)])
  flat = [x for s in sets for x in s]
  return lambda _fn, _arg_sets, rounds=5, reps=5: run.bench_jax(  # noqa: E731
      four, [flat], rounds=rounds, reps=reps) / 4


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernel", default="mha", choices=["mha", "mla"])
  parser.add_argument("--workloads", nargs="*", default=["equal4x4096", "short64"],
                      choices=list(wl.WORKLOADS))
  parser.add_argument("--systems", nargs="*",
                      default=["pallas_prefill_mosaic", "cudnn_packed", "torch_sdpa_cudnn"],
                      choices=list(sy.SYSTEMS))
  parser.add_argument("--rest", type=float, default=2.0,
                      help="seconds the GPU rests before each measurement")
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--out", default="bench-out")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  clock = ClockSampler()
  rows = []
  try:
    for name in args.workloads:
      problems = [sy.make_problem(args.kernel, wl.WORKLOADS[name], seed) for seed in range(3)]
      flops = sy.useful_flops(problems[0])
      turns = []  # (system, method, prepared, bench), compiled and warm
      for system in args.systems:
        try:
          prepared = sy.SYSTEMS[system](problems)
        except sy.Unavailable as e:
          print(f"{name} {system}: n/a: {e}", flush=True)
          continue
        if prepared.timer == "torch":
          methods = {"stream": functools.partial(run.bench_jax, wait=prepared.wait),
                     "do_bench": run.bench_torch}
        else:
          methods = {"stream": run.bench_jax,
                     "stream_x4": stream_x4(prepared.fn, prepared.arg_sets)}
        for method, bench in methods.items():
          if method != "do_bench":  # compiled and warm (do_bench warms up itself)
            bench(prepared.fn, prepared.arg_sets, rounds=1, reps=2)
          turns.append((system, method, prepared, bench))
      for r in range(args.rounds):
        for system, method, prepared, bench in turns:
          time.sleep(args.rest)
          t0 = time.time()
          sec = bench(prepared.fn, prepared.arg_sets)
          mhz, watts = clock.window(t0, time.time())
          row = dict(kernel=args.kernel, workload=name, system=system, method=method,
                     round=r, ms=sec * 1e3, tflops=flops / sec / 1e12, sm_mhz=mhz,
                     watts=watts)
          rows.append(row)
          print(row, flush=True)
  finally:
    clock.close()
  run.report(os.path.join(args.out, "timers.json"), rows,
             [("workload", lambda r: r["workload"]), ("system", lambda r: r["system"]),
              ("method", lambda r: r["method"]), ("round", lambda r: str(r["round"])),
              ("ms", lambda r: f"{r['ms']:.3f}"),
              ("TFLOP/s", lambda r: f"{r['tflops']:.1f}"),
              ("SM MHz", lambda r: f"{r['sm_mhz'] or float('nan'):.0f}"),
              ("W", lambda r: f"{r['watts'] or float('nan'):.0f}")])
  return 0


if __name__ == "__main__":
  sys.exit(main())

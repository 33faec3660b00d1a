"""Does a model pay the per-call XLA work once per batch? L layers' calls under one jit.

    python -m benchmarks.experiments.layers [--kernels mha mla] [--workloads NAME ...]
        [--layers 8] [--backend mosaic_gpu] [--out DIR]

A model calls the kernel once per layer, every layer with the same offsets. The Mosaic
GPU backend's work list (``mosaic_gpu.work_list``: the per-item table and the unit order,
about 50 us on MHA short64) depends only on the offsets, the mask and the shapes, so XLA
could compute it once for all layers (common-subexpression elimination over the layers'
calls). This times, per workload, one call in its own jit against L calls (L input sets,
one offsets array) in one jit, and counts the kernels (the entry computation's
instructions other than parameters, constants, tuples and bitcasts) of both compiled
programs. If the work list is shared, a layer beyond the first adds fewer kernels than
one call has and the per-layer time drops below the single call's by up to the work
list's cost. Writes DIR/layers.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax

from benchmarks import run
from benchmarks import systems as sy
from benchmarks import workloads as wl

DEFAULT = ["equal4x4096", "skew16_16k", "short64"]
# Entry-computation instructions that launch nothing.
_NOT_KERNELS = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast",
                "after-all", "opt-barrier"}


def count_kernels(hlo_text: str) -> int:
  """The instructions of an optimized HLO module's entry computation that run on the
  device (fusions, custom calls, sorts, copies, ...)."""
  lines = hlo_text.splitlines()
  start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
  count = 0
  for line in lines[start + 1:]:
    if line.startswith("}"):
      break
    rhs = line.split("=", 1)[1] if "=" in line else ""
    opcode = re.search(r"([a-z][a-z0-9\-]*)\(", rhs)
    if opcode and opcode.group(1) not in _NOT_KERNELS:
      count += 1
  return count


def measure(kind: str, workload: wl.Workload, num_layers: int, backend: str) -> dict:
  problems = [sy.make_problem(kind, workload, seed) for seed in range(num_layers)]
  system = sy.pallas_prefill_mosaic if backend == "mosaic_gpu" else sy.pallas_prefill
  prepared = system(problems)
  fn = prepared.fn
  # Every layer's own Q and K/V, the first layer's offsets for all: one array, as a
  # model passes it.
  _, _, q_off, kv_off = prepared.arg_sets[0]
  qs = [a[0] for a in prepared.arg_sets]
  kvs = [a[1] for a in prepared.arg_sets]

  @jax.jit
  def layers(qs, kvs, q_off, kv_off):
    return [fn(q, kv, q_off, kv_off) for q, kv in zip(qs, kvs)]

  one_args = (qs[0], kvs[0], q_off, kv_off)
  all_args = (qs, kvs, q_off, kv_off)
  # Compiled once each: timed, and their kernels counted.
  one = fn.lower(*one_args).compile()
  many = layers.lower(*all_args).compile()
  one_s = run.bench_jax(one, [one_args])
  layers_s = run.bench_jax(many, [all_args])
  kernels_one = count_kernels(one.as_text())
  kernels_all = count_kernels(many.as_text())
  # The layers' outputs against the single calls': the same program, so the same values.
  outs = many(*all_args)
  same = all(bool((o == one(q, kv, q_off, kv_off)).all())
             for o, q, kv in zip(outs, qs, kvs))
  return dict(kernel=kind, workload=workload.name, backend=backend, layers=num_layers,
              one_call_ms=one_s * 1e3, per_layer_ms=layers_s / num_layers * 1e3,
              kernels_one_call=kernels_one, kernels_all_layers=kernels_all,
              kernels_per_extra_layer=(kernels_all - kernels_one) / max(num_layers - 1, 1),
              same_outputs=same)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernels", nargs="*", default=["mha", "mla"], choices=["mha", "mla"])
  parser.add_argument("--workloads", nargs="*", default=DEFAULT, choices=list(wl.WORKLOADS))
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--backend", default="mosaic_gpu", choices=["mosaic_gpu", "triton"])
  parser.add_argument("--out", default="bench-out")
  args = parser.parse_args(argv)
  if args.layers < 2:
    parser.error("--layers must be at least 2")
  os.makedirs(args.out, exist_ok=True)
  rows = []
  for kind in args.kernels:
    for name in args.workloads:
      if kind in wl.WORKLOADS[name].kernels:
        rows.append(measure(kind, wl.WORKLOADS[name], args.layers, args.backend))
        print(rows[-1], flush=True)
  run.report(os.path.join(args.out, "layers.json"), rows, [
      ("kernel", lambda r: r["kernel"]), ("workload", lambda r: r["workload"]),
      ("backend", lambda r: r["backend"]),
      ("one call ms", lambda r: f"{r['one_call_ms']:.3f}"),
      ("per layer ms (of L)", lambda r: f"{r['per_layer_ms']:.3f} ({r['layers']})"),
      ("kernels: one call", lambda r: str(r["kernels_one_call"])),
      ("per extra layer", lambda r: f"{r['kernels_per_extra_layer']:.1f}"),
      ("same outputs", lambda r: str(r["same_outputs"]))])
  return 0


if __name__ == "__main__":
  sys.exit(main())

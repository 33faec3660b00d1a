"""Does a polynomial exp2 on the FMA pipes pay? ``MosaicOptions.poly_exp2`` arms in one process.

    python -m benchmarks.experiments.poly_exp2 [--kernels mha mla]
        [--workloads equal4x4096 skew16_16k] [--eighths 0 2 4 6] [--caps none 30]
        [--fp8] [--rounds 3] [--rest 0.5] [--out DIR]

Each (cap, eighths) arm is our default call (no backend argument) with a Mosaic GPU config
whose ``poly_exp2`` is that many eighths of the exp2s (``mosaic_config``); with ``--fp8``
also the FP8 system (``pallas_prefill_fp8``) at each eighths. Every arm is checked against
its reference first (the capped one under a cap; FP8: the dequantized inputs'), then all
arms are timed in turns over ``--rounds`` rounds, each after ``--rest`` seconds idle
(``run.bench_jax``), so that they share the GPU's power states. Prints useful TFLOP/s
(medians), each arm against eighths 0 with the same cap, and a capped arm's time against
the uncapped default's (no cap, eighths 0); writes DIR/poly_exp2.json. (One process and one compilation per arm:
quicker than ``benchmarks.ab``'s process per arm, for a first look.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks import run
from benchmarks import systems as sy
from benchmarks import workloads as wl


def arms(problems, eighths, caps, fp8):
  """[(name, cap, eighths, prepared, reference)] for the problems."""
  p0 = problems[0]
  out = []
  for cap in caps:
    for e in eighths:
      prepared = sy._pallas(problems, paged=False, backend=None, logits_soft_cap=cap,  # pylint: disable=protected-access
                            config=sy.mosaic_config({"poly_exp2": e}, p0))
      ref = lambda cap=cap: sy.reference(p0, logits_soft_cap=cap)  # noqa: E731
      out.append((f"cap={cap} poly={e}", cap, e, prepared, ref))
  if fp8:
    for e in eighths:
      prepared = sy.pallas_prefill_fp8(problems, mosaic_options={"poly_exp2": e})
      out.append((f"fp8 poly={e}", "fp8", e, prepared, prepared.reference))
  return out


def run_workload(kind, workload, args):
  problems = [sy.make_problem(kind, workload, seed) for seed in range(3)]
  flops = sy.useful_flops(problems[0])
  rows = []
  for name, cap, e, prepared, ref in arms(problems, args.eighths, args.caps, args.fp8):
    out = prepared.fn(*prepared.arg_sets[0])
    err = run.rel_err(prepared.to_packed(out), ref())
    rows.append(dict(kernel=kind, workload=workload.name, arm=name, cap=cap, eighths=e,
                     err=err, secs=[], prepared=prepared))
    print(f"{kind} {workload.name} {name}: rel. error {err:.2e}", flush=True)
  for _ in range(args.rounds):
    for row in rows:
      time.sleep(args.rest)
      row["secs"].append(run.bench_jax(row["prepared"].fn, row["prepared"].arg_sets))
  for row in rows:
    del row["prepared"]
    row["tflops"] = flops / statistics.median(row["secs"]) / 1e12
  return rows


def table(rows) -> str:
  by = {(r["kernel"], r["workload"], r["cap"], r["eighths"]): r for r in rows}
  lines = ["| kernel | workload | arm | TFLOP/s | vs poly 0 | vs no cap | error |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    base = by.get((r["kernel"], r["workload"], r["cap"], 0))
    nocap = by.get((r["kernel"], r["workload"], None, 0))  # the default call
    vs0 = f"{r['tflops'] / base['tflops']:.3f}x" if base else "-"
    vsn = (f"{nocap['tflops'] / r['tflops']:.3f}x the time"
           if nocap and r["cap"] not in (None, "fp8") else "-")
    lines.append(f"| {r['kernel']} | {r['workload']} | {r['arm']} | {r['tflops']:.1f} | "
                 f"{vs0} | {vsn} | {r['err']:.2e} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernels", nargs="+", default=["mha"], choices=["mha", "mla"])
  parser.add_argument("--workloads", nargs="+", default=["equal4x4096", "skew16_16k"],
                      choices=list(wl.WORKLOADS))
  parser.add_argument("--eighths", nargs="+", type=int, default=[0, 2, 4, 6])
  parser.add_argument("--caps", nargs="+", default=["none", "30"])
  parser.add_argument("--fp8", action="store_true", help="also the FP8 system's arms")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--rest", type=float, default=0.5)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if 0 not in args.eighths:
    parser.error("--eighths must include 0, the arm the others are compared with")
  args.caps = [None if c == "none" else float(c) for c in args.caps]
  rows = []
  for kind in args.kernels:
    for name in args.workloads:
      rows += run_workload(kind, wl.WORKLOADS[name], args)
  text = table(rows)
  print(text)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "poly_exp2.json"), "w") as f:
      json.dump(dict(commit=run.commit(), args=vars(args), rows=rows), f, indent=1)
  return rows


if __name__ == "__main__":
  main()

"""Does a polynomial exp2 on the FMA pipes pay? ``MosaicOptions.poly_exp2`` arms in one process.

    python -m benchmarks.experiments.poly_exp2 [--kernels mha mla]
        [--workloads equal4x4096 skew16_16k] [--eighths 0 2 4 6]
        [--systems pallas_prefill_mosaic pallas_prefill_softcap pallas_prefill_fp8]
        [--rounds 3] [--rest 0.5] [--out DIR]

Each arm is one of the harness's Mosaic GPU systems (``systems.MOSAIC_SYSTEMS``: ours
uncapped, with the soft cap ``systems.SOFT_CAP``, in FP8, ...) with ``poly_exp2`` set to
that many eighths of the exp2s (its ``mosaic_options``). Every arm is checked against its
reference first (the capped one under the cap; FP8: the dequantized inputs'), then all arms
are timed in turns over ``--rounds`` rounds, each after ``--rest`` seconds idle
(``run.bench_jax``), so that they share the GPU's power states. Prints useful TFLOP/s
(medians), each arm against eighths 0 of its system, and the soft cap's time against the
uncapped default (pallas_prefill_mosaic at eighths 0); writes DIR/poly_exp2.json. (One
process and one compilation per arm: quicker than ``benchmarks.ab``'s process per arm, for
a first look.)
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks import run
from benchmarks import systems as sy
from benchmarks import workloads as wl
from benchmarks.experiments import arms

UNCAPPED, CAPPED = "pallas_prefill_mosaic", "pallas_prefill_softcap"


def run_workload(kind, workload, args):
  """The workload's arms, checked, then timed in turns (``arms.run_workload``); a row
  each, with its ``eighths``."""
  options = {f"poly={e}": {"poly_exp2": e} for e in args.eighths}
  rows = arms.run_workload(kind, workload, options, args)
  for row in rows:
    row["eighths"] = options[row["arm"]]["poly_exp2"]
  return rows


def table(rows) -> str:
  by = {(r["kernel"], r["workload"], r["system"], r["eighths"]): r for r in rows}
  lines = ["| kernel | workload | system | eighths | TFLOP/s | vs eighths 0 | capped / uncapped "
           "default | error |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    base = by.get((r["kernel"], r["workload"], r["system"], 0))
    default = by.get((r["kernel"], r["workload"], UNCAPPED, 0))
    vs0 = f"{r['tflops'] / base['tflops']:.3f}x" if base else "-"
    cap = (f"{default['tflops'] / r['tflops']:.3f}x the time"
           if default and r["system"] == CAPPED else "-")
    lines.append(f"| {r['kernel']} | {r['workload']} | {r['system']} | {r['eighths']} | "
                 f"{r['tflops']:.1f} | {vs0} | {cap} | {r['err']:.2e} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernels", nargs="+", default=["mha"], choices=["mha", "mla"])
  parser.add_argument("--workloads", nargs="+", default=["equal4x4096", "skew16_16k"],
                      choices=list(wl.WORKLOADS))
  parser.add_argument("--eighths", nargs="+", type=int, default=[0, 2, 4, 6])
  parser.add_argument("--systems", nargs="+", choices=sy.MOSAIC_SYSTEMS,
                      default=[UNCAPPED, CAPPED])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--rest", type=float, default=0.5)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  if 0 not in args.eighths:
    parser.error("--eighths must include 0, the arm the others are compared with")
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

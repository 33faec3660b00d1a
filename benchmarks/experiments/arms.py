"""Arms of Mosaic GPU options in one process, timed in turns: a quicker ``benchmarks.ab``.

    python -m benchmarks.experiments.arms --arm NAME [OPTION=VALUE ...] --arm NAME ...
        [--kernels mha] [--workloads skew16_16k short64 equal4x4096]
        [--systems pallas_prefill_mosaic pallas_prefill_padded] [--rounds 3] [--rest 0.5]
        [--out DIR]

An arm is a name and options as ``benchmarks.ab``'s (``systems.parse_mosaic_options``;
none: the default call), applied to each of ``--systems`` (the harness's Mosaic GPU
systems, ``systems.MOSAIC_SYSTEMS``). Options are part of the jit key, so the arms share
one process and compile once each. Per workload every (system, arm) is checked against
its reference, then all are timed in turns over ``--rounds`` rounds, each after
``--rest`` seconds idle (``run.bench_jax``), so that they share the GPU's power states.
Prints useful TFLOP/s (medians) and each arm against the first arm of its system, and
the padded system's time against the packed one's (``pallas_prefill_mosaic``) in the same
arm; writes DIR/arms.json. ``benchmarks.ab`` (a process per arm, as a harness run starts)
is the check before a default changes. Rounds do not cover what is fixed per compiled
call: MHA equal4x4096 runs at one of two speeds about 7 % apart per compiled arm
(BUILD_NOTES, facts), so an arm's lead there under 7 % wants ``benchmarks.ab``, whose
rounds are new processes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from benchmarks import ab
from benchmarks import run
from benchmarks import systems as sy
from benchmarks import workloads as wl

PACKED, PADDED = "pallas_prefill_mosaic", "pallas_prefill_padded"


def run_workload(kind, workload, arms, args):
  """The workload's (system, arm) pairs (``args.systems``, ``arms``: {name: options}),
  checked, then timed in turns over ``args.rounds`` after ``args.rest`` seconds each; a
  row each, in that order."""
  problems = [sy.make_problem(kind, workload, seed) for seed in range(3)]
  flops = sy.useful_flops(problems[0])
  rows, held = [], []
  for system in args.systems:
    for name, options in arms.items():
      prepared = sy.prepare(system, problems, options)
      ref = prepared.reference() if prepared.reference else sy.reference(problems[0])
      err = run.rel_err(prepared.to_packed(prepared.fn(*prepared.arg_sets[0])), ref)
      rows.append(dict(kernel=kind, workload=workload.name, system=system, arm=name,
                       err=err, secs=[]))
      held.append(prepared)
      print(f"{kind} {workload.name} {system} {name}: rel. error {err:.2e}", flush=True)
  for _ in range(args.rounds):
    for row, prepared in zip(rows, held):
      time.sleep(args.rest)
      row["secs"].append(run.bench_jax(prepared.fn, prepared.arg_sets))
  for row in rows:
    row["tflops"] = flops / statistics.median(row["secs"]) / 1e12
  return rows


def table(rows, first) -> str:
  by = {(r["kernel"], r["workload"], r["system"], r["arm"]): r for r in rows}
  lines = ["| kernel | workload | system | arm | TFLOP/s | vs the first arm | "
           "time vs packed, same arm | error |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    base = by[(r["kernel"], r["workload"], r["system"], first)]
    packed = by.get((r["kernel"], r["workload"], PACKED, r["arm"]))
    vs_packed = (f"{packed['tflops'] / r['tflops']:.3f}x"
                 if packed and r["system"] == PADDED else "-")
    lines.append(f"| {r['kernel']} | {r['workload']} | {r['system']} | {r['arm']} | "
                 f"{r['tflops']:.1f} | {r['tflops'] / base['tflops']:.3f}x | {vs_packed} | "
                 f"{r['err']:.2e} |")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--arm", nargs="+", action="append", required=True,
                      metavar="NAME OPTION=VALUE", help="an arm's name and its options")
  parser.add_argument("--kernels", nargs="+", default=["mha"], choices=["mha", "mla"])
  parser.add_argument("--workloads", nargs="+", default=["skew16_16k", "short64"],
                      choices=list(wl.WORKLOADS))
  parser.add_argument("--systems", nargs="+", choices=sy.MOSAIC_SYSTEMS,
                      default=[PACKED, PADDED])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--rest", type=float, default=0.5)
  parser.add_argument("--out", default=None)
  args = parser.parse_args(argv)
  arms = ab.parse_arms(parser, args.arm)
  rows = []
  for kind in args.kernels:
    for name in args.workloads:
      done = run_workload(kind, wl.WORKLOADS[name], arms, args)
      rows += done
      # (each workload's rows as they come: a call cut short keeps the ones done)
      print(table(done, next(iter(arms))), flush=True)
  text = table(rows, next(iter(arms)))
  print(text)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "arms.json"), "w") as f:
      json.dump(dict(commit=run.commit(), args=vars(args), arms=arms, rows=rows), f,
                indent=1)
  return rows


if __name__ == "__main__":
  main()

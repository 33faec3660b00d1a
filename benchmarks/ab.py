"""A/B runs of the Mosaic GPU backend's options: each arm in its own process, in turn.

    python -m benchmarks.ab --arm NAME [OPTION=VALUE ...] --arm NAME ... \\
        [--rounds 2] [--out DIR] [-- HARNESS ARGS]

For example, dynamic scheduling against the static deal on MHA's equal prompts:

    python -m benchmarks.ab --arm dynamic dynamic=True --arm static dynamic=False \\
        --out $OUT -- --kernels mha --workloads equal4x4096

The options are those of ``benchmarks.run --mosaic-options`` (``systems.parse_mosaic_options``:
fields of ``pallas_prefill.MosaicOptions`` and ``split_units``, ``block_kv``, ``num_stages``,
``num_programs`` of ``MosaicConfig``, values Python literals); an arm without any runs the
default call (``config=None``). They are part of the jit key, so arms could share a process;
each runs in one of its own all the same (``python -m benchmarks.run --mosaic-options
...``), so that every arm starts as a harness run does. The arms run in turn, ``--rounds``
times (A B A B ...), so that a machine that warms up over the run does not favour the later
arm. The harness arguments after ``--`` go to every arm (default: our Mosaic GPU system
alone). Each arm's rows land in DIR/NAME-rROUND/; DIR/ab.json holds each arm's options and
the medians over rounds; prints a table of them and of each arm's ratio to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks import run
from benchmarks import systems as sy

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_arm(options, harness_args, out) -> None:
  """One arm's harness run in its own process, with ``options`` ({"name": value}, as
  ``systems.parse_mosaic_options`` gives them) as its ``--mosaic-options`` (replaced in the
  tests)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
  settings = [f"{name}={value!r}" for name, value in options.items()]
  subprocess.run([sys.executable, "-m", "benchmarks.run", *harness_args,
                  *(["--mosaic-options", *settings] if settings else []), "--out", out],
                 env=env, check=True)


def parse_arms(parser, arm_args) -> dict:
  """{name: options} from ``--arm NAME OPTION=VALUE ...`` lists (``parse_mosaic_options``);
  a bad arm is the parser's error. Shared with ``benchmarks.experiments.arms``."""
  arms = {}
  for name, *settings in arm_args:
    if name in arms or "=" in name:
      parser.error(f"arm names must be unique and come first: {name!r}")
    try:
      arms[name] = sy.parse_mosaic_options(settings)
    except ValueError as e:
      parser.error(f"arm {name}: {e}")
  return arms


def medians(arms, rounds, out):
  """One row per (kernel, workload, system): each arm's median TFLOP/s over its rounds
  (``tflops``) and whether all of its rounds were correct (``correct``)."""
  per_case = {}
  for name in arms:
    for r in range(rounds):
      with open(os.path.join(out, f"{name}-r{r}", "results.json")) as f:
        for row in json.load(f)["rows"]:
          key = (row["kernel"], row["workload"], row["system"])
          per_case.setdefault(key, {}).setdefault(name, []).append(row)
  return [dict(kernel=k, workload=w, system=s,
               tflops={a: statistics.median(x["tflops"] for x in rs)
                       for a, rs in by_arm.items()},
               correct={a: all(x["correct"] for x in rs) for a, rs in by_arm.items()})
          for (k, w, s), by_arm in per_case.items()]


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  harness_args = ["--systems", "pallas_prefill_mosaic"]
  if "--" in argv:
    cut = argv.index("--")
    argv, harness_args = argv[:cut], argv[cut + 1:]
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--arm", nargs="+", action="append", required=True,
                      metavar="NAME OPTION=VALUE", help="an arm's name and its options")
  parser.add_argument("--rounds", type=int, default=2, help="A B A B ... this many times")
  parser.add_argument("--out", default="ab-out", help="folder for the results")
  args = parser.parse_args(argv)
  for option in ("--out", "--mosaic-options"):
    if option in harness_args:
      parser.error(f"{option} is ab's (or its arms'), not the harness's: give it before --")
  arms = parse_arms(parser, args.arm)
  os.makedirs(args.out, exist_ok=True)
  for r in range(args.rounds):
    for name, options in arms.items():
      print(f"== round {r}, arm {name}: {options}", flush=True)
      run_arm(options, harness_args, os.path.join(args.out, f"{name}-r{r}"))
  first, rest = list(arms)[0], list(arms)[1:]

  def cell(arm):
    return lambda r: (f"{r['tflops'][arm]:.1f}" + ("" if r["correct"][arm] else " (wrong)")
                      if arm in r["tflops"] else "-")

  def ratio(arm):
    return lambda r: (f"{r['tflops'][arm] / r['tflops'][first]:.3f}"
                      if arm in r["tflops"] and r["tflops"].get(first) else "-")

  run.report(os.path.join(args.out, "ab.json"), medians(arms, args.rounds, args.out),
             [(h, (lambda r, h=h: r[h])) for h in ("kernel", "workload", "system")]
             + [(a, cell(a)) for a in arms] + [(f"{a} / {first}", ratio(a)) for a in rest],
             arms=arms, rounds=args.rounds, harness_args=harness_args)
  return 0


if __name__ == "__main__":
  sys.exit(main())

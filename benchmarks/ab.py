"""A/B runs of the Mosaic GPU backend's module flags: each arm in its own process, in turn.

    python -m benchmarks.ab --arm NAME FLAG=VALUE [FLAG=VALUE ...] --arm NAME ... \\
        [--rounds 2] [--out DIR] [-- HARNESS ARGS]

For example, dynamic scheduling against the static deal on MHA's equal prompts:

    python -m benchmarks.ab --arm dynamic DYNAMIC=True --arm static DYNAMIC=False \\
        --out $OUT -- --kernels mha --workloads equal4x4096

The flags are ``pallas_prefill.mosaic``'s module constants (``DYNAMIC``, ``FOLD_SCALE``,
``BUILD_WORK_LIST``, ...), values Python literals. A jitted call's trace does not key on
them, so each arm needs a process of its own (``python -m benchmarks.run`` with the flags
set first). The arms run in turn, ``--rounds`` times (A B A B ...), so that a machine
that warms up over the run does not favour the later arm. The harness arguments after
``--`` go to every arm (default: our Mosaic GPU system alone). Each arm's rows land in
DIR/NAME-rROUND/; DIR/ab.json holds the medians over rounds; prints a table of them and
of each arm's ratio to the first.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys

from benchmarks import run
from pallas_prefill import mosaic

# The child process: the flags (JSON) first, then the harness's arguments.
_CHILD = ("import json, sys; from benchmarks import ab, run; "
          "ab.apply_flags(json.loads(sys.argv[1])); sys.exit(run.main(sys.argv[2:]))")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def apply_flags(flags) -> None:
  """Sets ``pallas_prefill.mosaic``'s constants to ``flags`` ({"NAME": value}, as
  ``parse_flags`` gives) and says so. Before the first trace: a jitted call's trace does
  not key on them."""
  for name, value in flags.items():
    setattr(mosaic, name, value)
  print("mosaic flags set:", {name: getattr(mosaic, name) for name in flags}, flush=True)


def parse_flags(settings):
  """{"NAME": value} from ["NAME=VALUE", ...]: upper-case constants that
  ``pallas_prefill.mosaic`` has, values Python literals of the constant's type (any
  literal for a constant that is None, such as ``DYNAMIC_HEAD_MAJOR``)."""
  flags = {}
  for setting in settings:
    name, sep, text = setting.partition("=")
    if not sep or not name.isupper() or not hasattr(mosaic, name):
      raise ValueError(f"{setting!r} is not FLAG=VALUE for a constant of "
                       "pallas_prefill.mosaic (e.g. DYNAMIC=False)")
    value = ast.literal_eval(text)
    current = getattr(mosaic, name)
    if current is not None and type(value) is not type(current):
      raise ValueError(f"{name} is a {type(current).__name__}, got {text!r}")
    flags[name] = value
  return flags


def run_arm(flags, harness_args, out) -> None:
  """One arm's harness run in its own process (replaced in the tests)."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
  subprocess.run([sys.executable, "-c", _CHILD, json.dumps(flags), *harness_args,
                  "--out", out], env=env, check=True)


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
                      metavar="NAME FLAG=VALUE", help="an arm's name and its flags")
  parser.add_argument("--rounds", type=int, default=2, help="A B A B ... this many times")
  parser.add_argument("--out", default="ab-out", help="folder for the results")
  args = parser.parse_args(argv)
  if "--out" in harness_args:
    parser.error("give --out before the --, not to the harness")
  arms = {}
  for name, *settings in args.arm:
    if name in arms or "=" in name:
      parser.error(f"arm names must be unique and come first: {name!r}")
    try:
      arms[name] = parse_flags(settings)
    except (ValueError, SyntaxError) as e:
      parser.error(str(e))
  os.makedirs(args.out, exist_ok=True)
  for r in range(args.rounds):
    for name, flags in arms.items():
      print(f"== round {r}, arm {name}: {flags}", flush=True)
      run_arm(flags, harness_args, os.path.join(args.out, f"{name}-r{r}"))
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

"""The benchmark harness: pallas_prefill beside every alternative the machine has.

    python -m benchmarks.run [--kernels mha mla] [--workloads NAME ...]
        [--systems NAME ...] [--rounds N] [--rest SECONDS]
        [--mosaic-options NAME=VALUE ...] [--out DIR]

In one process and one run: for each kernel and workload (benchmarks/workloads.py), every
system (benchmarks/systems.py) that can serve it is timed (median per call of 5 rounds of
20 calls after warm-up, rotating over 3 input sets; torch systems with
triton.testing.do_bench's median), its output compared with the float32 reference on the
same inputs, and a line printed as it goes. A figure counts only when its relative error
is under 2e-2 (``TOLERANCE``). Useful TFLOP/s count the real tokens' FLOPs only
(anchors-h200.md).
FP8 (issue 24) needs no run-wide dtype: the systems named ``*_fp8`` (``pallas_prefill_fp8``,
``cudnn_fp8``, ``cudnn_fp8_kv_repeated``) quantize each workload's bf16 inputs to
float8_e4m3fn themselves, so one run compares them with the bf16 rows on the same data:
``--systems pallas_prefill_default pallas_prefill_fp8 cudnn_fp8 cudnn_padded``. Their
error is against the float32 reference of the dequantized inputs and counts under
``systems.FP8_TOLERANCE`` (5e-2; the row's ``tolerance``); their FLOPs are the bf16 rows'.
With ``--rounds N`` the systems of a workload are timed N times in turns (A B C A B C ...),
each after ``--rest`` seconds with the GPU idle, and a row's time is the median of its
rounds (``ms_rounds`` lists them): the H200's power state moves a single measurement by
10-15 % (BUILD_NOTES.md), so that systems within that of each other need rounds to be
told apart.
``--mosaic-options`` (``dynamic=False``, ``block_kv=64``, ...: fields of
``pallas_prefill.MosaicOptions`` and ``split_units``, ``block_kv``, ``num_stages``,
``num_programs`` of ``MosaicConfig``, values Python literals) set the config of our Mosaic
GPU system (``systems.mosaic_config``); without them it passes ``config=None``, as a user's
call does. ``benchmarks.ab`` runs its arms this way.
Writes DIR/results.json ({"meta": {...}, "rows": [...]}), DIR/results.md and, when
matplotlib is importable, DIR/results.png. results.md ends with ratios of time per
workload (``comparisons``): ours on padded arrays (``pallas_prefill_padded``, through
``dot_product_attention``) over our packed call (``pallas_prefill_default``), our
soft-capped call (``pallas_prefill_softcap``) over the uncapped one, ours in FP8 over ours
in bf16, cuDNN's FP8 over ours in FP8, and the fastest padded anchor over ours padded.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp

from benchmarks import systems as sy
from benchmarks import workloads as wl

warnings.filterwarnings("ignore", category=DeprecationWarning)

TOLERANCE = 2e-2
DEFAULT_WORKLOADS = [n for n in wl.WORKLOADS if n not in wl.SMOKE + wl.EXTRA]


def bench_jax(fn, arg_sets, rounds=5, reps=20, wait=jax.block_until_ready) -> float:
  """Median seconds per call; calls rotate over arg_sets; ``wait(output)`` ends each
  round (``Prepared.wait`` times a torch system the same way)."""
  for args in arg_sets:
    wait(fn(*args))
  times = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for i in range(reps):
      out = fn(*arg_sets[i % len(arg_sets)])
    wait(out)
    times.append((time.perf_counter() - t0) / reps)
  return statistics.median(times)


def bench_torch(fn, arg_sets) -> float:
  import triton.testing  # pylint: disable=g-import-not-at-top
  calls = iter(range(10**9))
  ms = triton.testing.do_bench(lambda: fn(*arg_sets[next(calls) % len(arg_sets)]),
                               return_mode="median")
  return ms / 1e3


def rel_err(x, ref) -> float:
  x, ref = jnp.asarray(x, jnp.float32), jnp.asarray(ref, jnp.float32)
  return float(jnp.linalg.norm(x - ref) / jnp.linalg.norm(ref))


def matmul_tflops() -> float:
  n = 8192 if jax.default_backend() == "gpu" else 512
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
  return 2 * n**3 / bench_jax(jax.jit(jnp.matmul), [(a, b)]) / 1e12


def commit() -> str:
  """The commit measured: $PALLAS_PREFILL_COMMIT when set (the device tool's copy of the
  working tree may carry a stale .git), else git's HEAD."""
  if os.environ.get("PALLAS_PREFILL_COMMIT"):
    return os.environ["PALLAS_PREFILL_COMMIT"]
  try:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
  except (OSError, subprocess.CalledProcessError):
    return "unknown"


def run_case(kind, workload, system_names, rows, progress, rounds=1, rest=0.0,
             mosaic_options=None):
  problems = [sy.make_problem(kind, workload, seed) for seed in range(3)]
  ref = sy.reference(problems[0])
  flops = sy.useful_flops(problems[0])
  timed = []  # (tag, name, prepared, bench, err, [seconds per round])
  for name in system_names:
    progress[0] += 1
    tag = f"[{progress[0]}/{progress[1]}] {kind} {workload.name:22s} {name:26s}"
    try:
      prepared = sy.prepare(name, problems, mosaic_options)
      out = prepared.to_packed(prepared.fn(*prepared.arg_sets[0]))
      err = rel_err(out, ref if prepared.reference is None else prepared.reference())
      bench = bench_torch if prepared.timer == "torch" else bench_jax
      time.sleep(rest)
      timed.append((tag, name, prepared, bench, err, [bench(prepared.fn, prepared.arg_sets)]))
    except sy.Unavailable as e:
      print(f"{tag} n/a: {e}", flush=True)
      continue
    except Exception as e:  # pylint: disable=broad-except
      print(f"{tag} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    if rounds == 1:  # reported now, nothing held: the next system's inputs take the memory
      tag, name, prepared, _, err, secs = timed.pop()
      report_row(rows, kind, workload, flops, tag, name, err, secs, prepared.backend,
                 prepared.tolerance)
  for _ in range(rounds - 1):
    for tag, name, prepared, bench, err, secs in timed:
      time.sleep(rest)
      secs.append(bench(prepared.fn, prepared.arg_sets))
  for tag, name, prepared, _, err, secs in timed:
    report_row(rows, kind, workload, flops, tag, name, err, secs, prepared.backend,
               prepared.tolerance)


def report_row(rows, kind, workload, flops, tag, name, err, secs, backend=None,
               tolerance=None):
  """Appends the row of one system's timings (seconds per round) and prints it; backend:
  the one the system's call ran, where it picks one (else ``systems.BACKENDS``');
  tolerance: the system's bound on the relative error where it is not ``TOLERANCE`` (the
  FP8 systems'), recorded in the row."""
  sec = statistics.median(secs)
  row = dict(kernel=kind, workload=workload.name, system=name,
             backend=backend or sy.BACKENDS.get(name, ""), ms=sec * 1e3,
             tflops=flops / sec / 1e12, relerr=err,
             correct=bool(err < (tolerance or TOLERANCE)))
  if tolerance is not None:
    row["tolerance"] = tolerance
  if len(secs) > 1:
    row["ms_rounds"] = [s * 1e3 for s in secs]
  rows.append(row)
  print(f"{tag} {row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s  err {err:.1e}"
        f"{'' if row['correct'] else '  WRONG'}"
        f"{'' if len(secs) == 1 else ' (median of %d rounds)' % len(secs)}", flush=True)


def comparisons(rows) -> list[dict]:
  """The ratios of time the report adds below its rows, per kernel and workload, from
  correct rows only (None where a side is missing):
  ``padded_vs_packed``: pallas_prefill_padded's ms over pallas_prefill_default's (ours on
  padded arrays against our packed call; under 1.05 is "loses under 5 %");
  ``softcap_vs_nocap``: pallas_prefill_softcap's over pallas_prefill_default's;
  ``fp8_vs_bf16``: pallas_prefill_fp8's over pallas_prefill_default's (under 1: FP8
  faster); ``cudnn_fp8_vs_fp8``: cudnn_fp8's over pallas_prefill_fp8's (above 1: ours
  faster);
  ``anchor_vs_padded``: (system, ratio) of the fastest padded anchor
  (``systems.PADDED_ANCHORS``), its ms over pallas_prefill_padded's (our speedup on the
  same padded arrays)."""
  out = []
  for kernel, workload in dict.fromkeys((r["kernel"], r["workload"]) for r in rows):
    ms = {r["system"]: r["ms"] for r in rows
          if (r["kernel"], r["workload"]) == (kernel, workload) and r["correct"]}
    ratio = lambda a, b: ms[a] / ms[b] if a in ms and b in ms else None  # noqa: E731
    anchors = [(ms[n], n) for n in sy.PADDED_ANCHORS if n in ms]
    best = None
    if anchors and "pallas_prefill_padded" in ms:
      best_ms, name = min(anchors)
      best = (name, best_ms / ms["pallas_prefill_padded"])
    c = dict(kernel=kernel, workload=workload,
             padded_vs_packed=ratio("pallas_prefill_padded", "pallas_prefill_default"),
             softcap_vs_nocap=ratio("pallas_prefill_softcap", "pallas_prefill_default"),
             fp8_vs_bf16=ratio("pallas_prefill_fp8", "pallas_prefill_default"),
             cudnn_fp8_vs_fp8=ratio("cudnn_fp8", "pallas_prefill_fp8"),
             anchor_vs_padded=best)
    if any(v is not None for k, v in c.items() if k not in ("kernel", "workload")):
      out.append(c)
  return out


def markdown(rows) -> str:
  lines = ["| kernel | workload | system | backend | ms | useful TFLOP/s | rel. error | "
           "correct |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['kernel']} | {r['workload']} | {r['system']} | "
                 f"{r.get('backend', '')} | {r['ms']:.3f} | "
                 f"{r['tflops']:.1f} | {r['relerr']:.1e} | {'yes' if r['correct'] else 'NO'} |")
  ratios = comparisons(rows)
  if ratios:
    fmt = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    lines += ["", "Ratios of time (`run.comparisons`, correct rows only): ours padded "
              "(pallas_prefill_padded) over ours packed (pallas_prefill_default) and soft cap "
              "(pallas_prefill_softcap) over none (under 1.05: within 5 %), ours in FP8 "
              "(pallas_prefill_fp8) over ours in bf16 (under 1: FP8 faster), cuDNN's FP8 "
              "(cudnn_fp8) over ours in FP8, and the fastest padded anchor over ours padded "
              "(above 1: ours faster on the same arrays).", "",
              "| kernel | workload | padded / packed | soft cap / no cap | FP8 / bf16 | "
              "cuDNN FP8 / ours FP8 | fastest padded anchor / ours padded |",
              "|---|---|---|---|---|---|---|"]
    for c in ratios:
      best = c["anchor_vs_padded"]
      best = "-" if best is None else f"{best[1]:.2f}x ({best[0]})"
      lines.append(f"| {c['kernel']} | {c['workload']} | {fmt(c['padded_vs_packed'])} | "
                   f"{fmt(c['softcap_vs_nocap'])} | {fmt(c['fp8_vs_bf16'])} | "
                   f"{fmt(c['cudnn_fp8_vs_fp8'])} | {best} |")
  return "\n".join(lines)


def chart(rows, path) -> bool:
  """A bar chart of useful TFLOP/s per workload and system (correct figures only)."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  good = [r for r in rows if r["correct"]]
  groups = list(dict.fromkeys((r["kernel"], r["workload"]) for r in good))
  names = list(dict.fromkeys(r["system"] for r in good))
  fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 5))
  width = 0.8 / max(len(names), 1)
  for i, name in enumerate(names):
    values = [next((r["tflops"] for r in good if (r["kernel"], r["workload"]) == g
                    and r["system"] == name), 0) for g in groups]
    ax.bar([x + i * width for x in range(len(groups))], values, width, label=name)
  ax.set_xticks([x + 0.4 - width / 2 for x in range(len(groups))])
  ax.set_xticklabels([f"{k}\n{w}" for k, w in groups], fontsize=8)
  ax.set_ylabel("useful TFLOP/s")
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  return True


def report(path, rows, columns, **meta) -> None:
  """A measuring tool's results: ``rows`` with the commit, the jax version and ``meta``
  to ``path`` (JSON), and a Markdown table of ``columns``, (header, row -> cell text)
  pairs."""
  with open(path, "w") as f:
    json.dump(dict(commit=commit(), jax=jax.__version__, **meta, rows=rows), f, indent=1)
  print("| " + " | ".join(h for h, _ in columns) + " |")
  print("|" + "---|" * len(columns))
  for r in rows:
    print("| " + " | ".join(cell(r) for _, cell in columns) + " |")


def save(out, meta, rows) -> str:
  """Writes results.json and results.md under `out`; returns the Markdown table."""
  table = markdown(rows)
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(dict(meta=meta, rows=rows), f, indent=1)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(table + "\n")
  return table


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernels", nargs="*", default=["mha", "mla"], choices=["mha", "mla"])
  parser.add_argument("--workloads", nargs="*", default=DEFAULT_WORKLOADS,
                      choices=list(wl.WORKLOADS))
  parser.add_argument("--systems", nargs="*", default=list(sy.SYSTEMS),
                      choices=list(sy.SYSTEMS))
  parser.add_argument("--rounds", type=int, default=1,
                      help="time each workload's systems this many times, in turns")
  parser.add_argument("--rest", type=float, default=0.0,
                      help="seconds the GPU rests before each timing")
  parser.add_argument("--mosaic-options", nargs="+", default=[], metavar="NAME=VALUE",
                      help="MosaicOptions or MosaicConfig fields for the Mosaic GPU system")
  parser.add_argument("--out", default="bench-out", help="folder for the results")
  args = parser.parse_args(argv)
  if args.rounds < 1 or args.rest < 0:
    parser.error("--rounds must be >= 1 and --rest >= 0")
  try:
    mosaic_options = sy.parse_mosaic_options(args.mosaic_options)
  except ValueError as e:
    parser.error(f"--mosaic-options: {e}")
  if mosaic_options and not set(sy.MOSAIC_SYSTEMS) & set(args.systems):
    print(f"note: --mosaic-options apply to {', '.join(sy.MOSAIC_SYSTEMS)}, not timed here",
          flush=True)
  os.makedirs(args.out, exist_ok=True)
  device = jax.devices()[0]
  meta = dict(date=time.strftime("%Y-%m-%d"), commit=commit(), jax=jax.__version__,
              gpu=device.device_kind if device.platform == "gpu" else None,
              backend=jax.default_backend(), matmul_tflops=matmul_tflops(),
              rounds=args.rounds, rest_s=args.rest, mosaic_options=mosaic_options)
  print(meta, flush=True)
  cases = [(k, wl.WORKLOADS[n]) for k in args.kernels for n in args.workloads
           if k in wl.WORKLOADS[n].kernels]
  rows, progress = [], [0, len(cases) * len(args.systems)]
  for kind, workload in cases:
    run_case(kind, workload, args.systems, rows, progress, args.rounds, args.rest,
             mosaic_options)
    save(args.out, meta, rows)  # after every workload: a run cut short keeps its rows
  print("\n" + save(args.out, meta, rows))
  chart(rows, os.path.join(args.out, "results.png"))
  return 0


if __name__ == "__main__":
  sys.exit(main())

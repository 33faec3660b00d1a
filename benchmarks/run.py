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
(anchors-h200.md). Before the timed calls each system's first call on a new shape is timed
too (``first_call``: JAX's caches cleared, then trace, lowering, compilation and the run,
waited for; torch systems' the same way, torch.compile's work included): the compile time
a server pays per new shape. The default workloads include ``long16384`` (issue 25), one
causal prompt of 16384 tokens for MHA and MLA.
FP8 (issue 24) needs no run-wide dtype: the systems named ``*_fp8`` (``pallas_prefill_fp8``,
``pallas_prefill_padded_fp8``, ``cudnn_fp8``, ``cudnn_fp8_kv_repeated``) quantize each
workload's bf16 inputs to float8_e4m3fn themselves, so one run compares them with the
bf16 rows on the same data:
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
``num_programs``, ``compute_wgs`` of ``MosaicConfig``, values Python literals) set the
config of our Mosaic GPU system (``systems.mosaic_config``); without them it passes
``config=None``, as a user's call does. ``benchmarks.ab`` runs its arms this way.
Writes DIR/results.json ({"meta": {...}, "rows": [...]}), DIR/results.md and, when
matplotlib is importable, DIR/results.png. A row (``report_row``): kernel, workload,
system, backend, ms (median per call), tflops (useful), first_call_s (seconds), relerr,
correct, and tolerance and ms_rounds where they apply; meta holds among others
``matmul_tflops``, the bf16 matmul rate measured at the start of the run, and
``compilation_cache_dir``, JAX's persistent compilation cache (None: none; with one, a
first call may load its program instead of compiling it).
results.md's table has one line per row (kernel | workload | system | backend | ms |
useful TFLOP/s | first call s | rel. error | correct), then ratios per workload
(``comparisons``): ours on padded arrays (``pallas_prefill_padded``, through
``dot_product_attention``) over our packed call (``pallas_prefill_default``), our
soft-capped call (``pallas_prefill_softcap``) over the uncapped one, ours in FP8 over ours
in bf16, cuDNN's FP8 over ours in FP8, the fastest padded anchor over ours padded, and the
first call of our packed call over cuDNN's packed and padded ones (``cudnn_packed``,
``cudnn_padded``); last, each of our rows' useful TFLOP/s as a fraction of the run's
``matmul_tflops`` (issue 25's target for ``long16384`` is stated that way).
With ``--rounds N`` above 1, each JAX system but a workload's last compiles once more,
untimed, in the second round's warm-up: the first calls after it cleared JAX's caches.
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


def first_call(prepared: sy.Prepared) -> tuple:
  """(output, seconds) of ``prepared``'s first call, on its first input set and waited for
  (``Prepared.wait``): what a new shape costs before its first result, tracing, lowering,
  compilation and the run. JAX's caches are cleared first: a system's ``prepare`` may have
  lowered the call already (``pallas_prefill_fp8``'s check that the call takes FP8), and
  an earlier system may have traced functions the call shares. Caches outside JAX's stay
  (torch's compiled graphs and Inductor's on-disk cache, kernel binaries a runtime keeps,
  XLA's persistent cache where one is configured: meta's ``compilation_cache_dir``)."""
  jax.clear_caches()
  t0 = time.perf_counter()
  out = prepared.fn(*prepared.arg_sets[0])
  prepared.wait(out)
  return out, time.perf_counter() - t0


def run_case(kind, workload, system_names, rows, progress, rounds=1, rest=0.0,
             mosaic_options=None):
  problems = [sy.make_problem(kind, workload, seed) for seed in range(3)]
  ref = sy.reference(problems[0])
  flops = sy.useful_flops(problems[0])
  timed = []  # (tag, name, prepared, bench, err, first-call seconds, [seconds per round])
  for name in system_names:
    progress[0] += 1
    tag = f"[{progress[0]}/{progress[1]}] {kind} {workload.name:22s} {name:26s}"
    try:
      prepared = sy.prepare(name, problems, mosaic_options)
      out, first_s = first_call(prepared)
      prepared = prepared.read_backend()
      err = rel_err(prepared.to_packed(out),
                    ref if prepared.reference is None else prepared.reference())
      bench = bench_torch if prepared.timer == "torch" else bench_jax
      time.sleep(rest)
      timed.append((tag, name, prepared, bench, err, first_s,
                    [bench(prepared.fn, prepared.arg_sets)]))
    except sy.Unavailable as e:
      print(f"{tag} n/a: {e}", flush=True)
      continue
    except Exception as e:  # pylint: disable=broad-except
      print(f"{tag} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
      continue
    if rounds == 1:  # reported now, nothing held: the next system's inputs take the memory
      tag, name, prepared, _, err, first_s, secs = timed.pop()
      report_row(rows, kind, workload, flops, tag, name, err, secs, prepared.backend,
                 prepared.tolerance, first_s)
  # The later systems' first calls cleared JAX's caches: each held JAX system compiles
  # again in the second round's warm-up (untimed; ``bench_jax`` warms up every round).
  for _ in range(rounds - 1):
    for tag, name, prepared, bench, err, first_s, secs in timed:
      time.sleep(rest)
      secs.append(bench(prepared.fn, prepared.arg_sets))
  for tag, name, prepared, _, err, first_s, secs in timed:
    report_row(rows, kind, workload, flops, tag, name, err, secs, prepared.backend,
               prepared.tolerance, first_s)


def report_row(rows, kind, workload, flops, tag, name, err, secs, backend=None,
               tolerance=None, first_call_s=None):
  """Appends the row of one system's timings (seconds per round) and prints it; backend:
  the one the system's call ran, where it picks one (else ``systems.BACKENDS``');
  tolerance: the system's bound on the relative error where it is not ``TOLERANCE`` (the
  FP8 systems'), recorded in the row; first_call_s: seconds of its first call
  (``first_call``), None where not measured."""
  sec = statistics.median(secs)
  row = dict(kernel=kind, workload=workload.name, system=name,
             backend=backend or sy.BACKENDS.get(name, ""), ms=sec * 1e3,
             tflops=flops / sec / 1e12, first_call_s=first_call_s, relerr=err,
             correct=bool(err < (tolerance or TOLERANCE)))
  if tolerance is not None:
    row["tolerance"] = tolerance
  if len(secs) > 1:
    row["ms_rounds"] = [s * 1e3 for s in secs]
  rows.append(row)
  first = "" if first_call_s is None else f"  first call {first_call_s:6.2f} s"
  print(f"{tag} {row['ms']:9.3f} ms {row['tflops']:7.1f} TFLOP/s{first}  err {err:.1e}"
        f"{'' if row['correct'] else '  WRONG'}"
        f"{'' if len(secs) == 1 else ' (median of %d rounds)' % len(secs)}", flush=True)


def comparisons(rows, matmul_tflops=None) -> list[dict]:
  """The ratios the report adds below its rows, per kernel and workload, from correct rows
  only (None where a side is missing):
  ``padded_vs_packed``: pallas_prefill_padded's ms over pallas_prefill_default's (ours on
  padded arrays against our packed call; under 1.05 is "loses under 5 %");
  ``softcap_vs_nocap``: pallas_prefill_softcap's over pallas_prefill_default's;
  ``fp8_vs_bf16``: pallas_prefill_fp8's over pallas_prefill_default's (under 1: FP8
  faster); ``cudnn_fp8_vs_fp8``: cudnn_fp8's over pallas_prefill_fp8's (above 1: ours
  faster);
  ``anchor_vs_padded``: (system, ratio) of the fastest padded anchor
  (``systems.PADDED_ANCHORS``), its ms over pallas_prefill_padded's (our speedup on the
  same padded arrays);
  ``first_call_vs_cudnn_packed``, ``first_call_vs_cudnn_padded``: pallas_prefill_default's
  ``first_call_s`` over cudnn_packed's and cudnn_padded's (above 1: ours takes longer to
  its first result of a new shape);
  ``of_matmul``: {system: its useful TFLOP/s over ``matmul_tflops``} for each of our rows
  (``systems.OURS``), the fraction of the bf16 matmul rate measured in the same run (meta's
  ``matmul_tflops``; None without it)."""
  out = []
  for kernel, workload in dict.fromkeys((r["kernel"], r["workload"]) for r in rows):
    good = {r["system"]: r for r in rows
            if (r["kernel"], r["workload"]) == (kernel, workload) and r["correct"]}
    ms = {name: r["ms"] for name, r in good.items()}
    ratio = lambda a, b: ms[a] / ms[b] if a in ms and b in ms else None  # noqa: E731
    first = {name: r["first_call_s"] for name, r in good.items()
             if r.get("first_call_s") is not None}
    first_ratio = lambda anchor: (  # noqa: E731
        first["pallas_prefill_default"] / first[anchor]
        if "pallas_prefill_default" in first and anchor in first else None)
    of_matmul = None
    if matmul_tflops:
      of_matmul = {name: r["tflops"] / matmul_tflops for name, r in good.items()
                   if name in sy.OURS} or None
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
             anchor_vs_padded=best,
             first_call_vs_cudnn_packed=first_ratio("cudnn_packed"),
             first_call_vs_cudnn_padded=first_ratio("cudnn_padded"),
             of_matmul=of_matmul)
    if any(v is not None for k, v in c.items() if k not in ("kernel", "workload")):
      out.append(c)
  return out


def markdown(rows, matmul_tflops=None) -> str:
  """The report: a table of ``rows``, then ``comparisons``' ratios and, with
  ``matmul_tflops`` (meta's), our rows' fractions of it."""
  fmt = lambda x, spec=".3f": "-" if x is None else format(x, spec)  # noqa: E731
  lines = ["| kernel | workload | system | backend | ms | useful TFLOP/s | first call s | "
           "rel. error | correct |", "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {r['kernel']} | {r['workload']} | {r['system']} | "
                 f"{r.get('backend', '')} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                 f"{fmt(r.get('first_call_s'))} | {r['relerr']:.1e} | "
                 f"{'yes' if r['correct'] else 'NO'} |")
  compared = comparisons(rows, matmul_tflops)
  ratios = [c for c in compared if any(v is not None for k, v in c.items()
                                       if k not in ("kernel", "workload", "of_matmul"))]
  if ratios:
    lines += ["", "Ratios of time (`run.comparisons`, correct rows only): ours padded "
              "(pallas_prefill_padded) over ours packed (pallas_prefill_default) and soft cap "
              "(pallas_prefill_softcap) over none (under 1.05: within 5 %), ours in FP8 "
              "(pallas_prefill_fp8) over ours in bf16 (under 1: FP8 faster), cuDNN's FP8 "
              "(cudnn_fp8) over ours in FP8, the fastest padded anchor over ours padded "
              "(above 1: ours faster on the same arrays), and the first call of a new shape "
              "(`first_call_s`: trace, compile, run) of ours packed over cuDNN's packed "
              "(cudnn_packed) and padded (cudnn_padded) calls (above 1: ours slower to its "
              "first result).", "",
              "| kernel | workload | padded / packed | soft cap / no cap | FP8 / bf16 | "
              "cuDNN FP8 / ours FP8 | fastest padded anchor / ours padded | "
              "first call: ours / cuDNN packed | first call: ours / cuDNN padded |",
              "|---|---|---|---|---|---|---|---|---|"]
    for c in ratios:
      best = c["anchor_vs_padded"]
      best = "-" if best is None else f"{best[1]:.2f}x ({best[0]})"
      lines.append(f"| {c['kernel']} | {c['workload']} | {fmt(c['padded_vs_packed'])} | "
                   f"{fmt(c['softcap_vs_nocap'])} | {fmt(c['fp8_vs_bf16'])} | "
                   f"{fmt(c['cudnn_fp8_vs_fp8'])} | {best} | "
                   f"{fmt(c['first_call_vs_cudnn_packed'])} | "
                   f"{fmt(c['first_call_vs_cudnn_padded'])} |")
  fractions = [(c, name, f) for c in compared for name, f in (c["of_matmul"] or {}).items()]
  if fractions:
    lines += ["", f"Ours against the bf16 matmul rate this run measured (meta's "
              f"`matmul_tflops`: {matmul_tflops:.1f} TFLOP/s; `run.comparisons`' "
              "`of_matmul`, correct rows only): useful TFLOP/s over it.", "",
              "| kernel | workload | system | useful TFLOP/s | of matmul |",
              "|---|---|---|---|---|"]
    for c, name, f in fractions:
      lines.append(f"| {c['kernel']} | {c['workload']} | {name} | {f * matmul_tflops:.1f} | "
                   f"{f:.3f} |")
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
  table = markdown(rows, meta.get("matmul_tflops"))
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
              compilation_cache_dir=jax.config.jax_compilation_cache_dir,
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

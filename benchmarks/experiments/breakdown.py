"""Where a Mosaic GPU call's time goes: the whole call beside its XLA parts.

    python -m benchmarks.experiments.breakdown [--kernels mha mla] [--workloads NAME ...]
        [--out DIR]

For each kernel and workload, on the first input set of the harness (benchmarks/run.py's
timing): the whole ``backend="mosaic_gpu"`` call; XLA's work list alone
(``mosaic_gpu.work_list.work_list``); all the work before the attention kernel
(``mosaic_gpu.operands.operands``: the work list and the unit order, from the
``work_items`` kernel where it serves, and ``v_tail``; no operand is copied unless it is
shorter than a tile); and the Triton call for scale. The kernel's own share is the whole
call less the XLA work (the kernel waits for it). The XLA columns are bounded by host
dispatch (BUILD_NOTES.md, facts): ncu's per-kernel durations are the device time. Writes
DIR/breakdown.json and prints a table.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

from pallas_prefill.logits import kv_rows
import pallas_prefill as pp
from benchmarks import run
from benchmarks import systems as sy
from benchmarks import workloads as wl
from pallas_prefill import config as config_lib

DEFAULT = ["equal4x4096", "skew16_16k", "short64", "sliding4x16384_w4096"]


def xla_parts(problem: sy.Problem, config: pp.MosaicConfig):
  """The XLA work before the kernel, as the harness's call (no LSE) runs it: the work list
  alone, and all of it (``operands.operands``: the work list, the unit order and
  ``v_tail``); jitted functions of the problem's arrays. The backend's internals are
  imported here, not at the top, so that the module imports without them (the tests)."""
  from pallas_prefill.mosaic_gpu import operands, work_list  # pylint: disable=g-import-not-at-top

  w = problem.workload
  total_q, total_kv = problem.q.shape[0], problem.kv[-1].shape[0]

  @jax.jit
  def work_list_alone(q, kv, q_off, kv_off):
    del q, kv
    table, _, _, n_live = work_list.work_list(
        q_off, kv_rows(kv_off), total_q, total_kv, mask=w.mask, block_q=config.block_q,
        block_kv=config.block_kv)
    return table, n_live

  @jax.jit
  def all_xla_work(q, kv, q_off, kv_off):
    inputs = operands.operands([q], list(kv[:-1]), kv[-1], q_off, kv_rows(kv_off), None, mask=w.mask,
                               return_lse=False, config=config)[0]
    # Not the operands passed through unchanged: a jit returning its argument copies it.
    return [x for x in inputs if all(x is not y for y in (q, *kv))]

  return work_list_alone, all_xla_work


def measure(kind, name):
  workload = wl.WORKLOADS[name]
  problem = sy.make_problem(kind, workload, 0)
  shape = problem.shape
  config = config_lib.default_mosaic_config(
      shape["qk"], shape["v"], jnp.bfloat16, workload.mask, workload.max_len)
  flops = sy.useful_flops(problem)
  row = dict(kernel=kind, workload=name, config=str(config))
  systems = (("mosaic_ms", sy.pallas_prefill_mosaic), ("triton_ms", sy.pallas_prefill))
  for label, system in systems:
    prepared = system([problem])
    row[label] = run.bench_jax(prepared.fn, prepared.arg_sets) * 1e3
  args = [(problem.q, problem.kv, problem.q_offsets, problem.kv_offsets)]
  work_list, operands = xla_parts(problem, config)
  row["work_list_ms"] = run.bench_jax(work_list, args) * 1e3
  row["xla_ms"] = run.bench_jax(operands, args) * 1e3
  row["kernel_ms"] = row["mosaic_ms"] - row["xla_ms"]
  for key in ("mosaic", "triton", "kernel"):
    row[f"{key}_tflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
  return row


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernels", nargs="*", default=["mha", "mla"], choices=["mha", "mla"])
  parser.add_argument("--workloads", nargs="*", default=DEFAULT, choices=list(wl.WORKLOADS))
  parser.add_argument("--out", default="bench-out")
  args = parser.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  rows = []
  for kind in args.kernels:
    for name in args.workloads:
      if kind in wl.WORKLOADS[name].kernels and not wl.WORKLOADS[name].page_size:
        rows.append(measure(kind, name))
        print(rows[-1], flush=True)
  run.report(os.path.join(args.out, "breakdown.json"), rows, [
      ("kernel", lambda r: r["kernel"]), ("workload", lambda r: r["workload"]),
      ("mosaic ms", lambda r: f"{r['mosaic_ms']:.3f}"),
      ("work list ms", lambda r: f"{r['work_list_ms']:.3f}"),
      ("all XLA ms", lambda r: f"{r['xla_ms']:.3f}"),
      ("kernel ms", lambda r: f"{r['kernel_ms']:.3f}"),
      ("mosaic TFLOP/s", lambda r: f"{r['mosaic_tflops']:.0f}"),
      ("kernel TFLOP/s", lambda r: f"{r['kernel_tflops']:.0f}"),
      ("triton TFLOP/s", lambda r: f"{r['triton_tflops']:.0f}")])
  return 0


if __name__ == "__main__":
  sys.exit(main())

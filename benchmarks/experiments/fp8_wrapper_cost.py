"""What the FP8 Mosaic GPU path costs around its kernel (issue 24), on the H200.

    python -m benchmarks.experiments.fp8_wrapper_cost [--workloads skew16_16k short64]

Per MHA workload: the whole FP8 call (``mha_prefill`` with per-head scales, the default
backend), the same call in bf16, and the FP8 wrapper's V^T operand alone
(``operands.fp8_operands``: V's non-key rows zeroed and V transposed), by its Triton-lowered
kernel (``transposed_v``, the default) and by XLA's transpose (``vt_kernel=False``), each
the median of the harness's rounds (``run.bench_jax``). Prints a table. The V^T operand
timed alone is a small jitted call, whose time on the H200 is mostly the host's dispatch
(0.035-0.068 ms, against the kernel's 0.011-0.017 ms under ncu inside the FP8 call:
BUILD_NOTES.md, twenty-second session); compare whole calls (``benchmarks.experiments.arms``
with ``fp8_vt_kernel=False``) for what V^T costs.
"""

from __future__ import annotations

import argparse

import jax

import pallas_prefill as pp
from benchmarks import run
from benchmarks import systems as sy
from benchmarks import workloads as wl
from pallas_prefill.mosaic_gpu import operands


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--workloads", nargs="+", default=["equal4x4096", "skew16_16k", "short64"])
  args = parser.parse_args()
  print("| workload | bf16 call ms | FP8 call ms | V^T kernel ms | V^T by XLA ms |")
  print("|---|---|---|---|---|")
  for name in args.workloads:
    problem = sy.make_problem("mha", wl.WORKLOADS[name], 0)
    f8 = sy.quantize_problem(problem)
    p8, sc = f8.problem, f8.scales
    mpl = problem.workload.max_len

    def call(q, k, v, off, scales=None):
      return pp.mha_prefill(q, k, v, off, max_prompt_len=mpl, **(scales or {}))

    bf16 = run.bench_jax(jax.jit(call), [(problem.q, *problem.kv, problem.q_offsets)])
    fp8 = run.bench_jax(jax.jit(call), [(p8.q, *p8.kv, p8.q_offsets, sc)])
    scales = (sc["k_scale"], sc["v_scale"])
    vt = [run.bench_jax(jax.jit(lambda v, off, s, k=k: operands.fp8_operands(
        v, off, None, s, block_kv=128, vt_kernel=k)[0]), [(p8.kv[1], p8.q_offsets, scales)])
          for k in (True, False)]
    print(f"| {name} | {bf16 * 1e3:.3f} | {fp8 * 1e3:.3f} | {vt[0] * 1e3:.3f} | "
          f"{vt[1] * 1e3:.3f} |")


if __name__ == "__main__":
  main()

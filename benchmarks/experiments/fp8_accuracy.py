"""How accurate is attention on FP8 inputs? Ours and cuDNN's on the same FP8 data.

    python -m benchmarks.experiments.fp8_accuracy [--lens 4096 4096 4096 4096]
        [--heads 32] [--kv-heads 8] [--head-dim 128] [--backend auto] [--interpret]
        [--outlier-channels 3] [--outlier-factor 30] [--seed 0] [--out DIR]

Two kinds of data, float32, causal: ``normal`` (standard normal q, k, v) and ``outliers``
(the same with ``--outlier-channels`` channels of the head dim, the same ones in q, k and
v, ``--outlier-factor`` times larger, as LLM keys and queries have). Each batch is
quantized to float8_e4m3fn twice with absmax scales (``systems.quantize_problem``):
``per_head`` (K, V one scale per K/V head, Q one per K/V head's group of query heads:
what ``pallas_prefill_fp8`` passes) and ``per_tensor`` (one scale each: all cuDNN takes).
Ours (``mha_prefill`` with q_scale/k_scale/v_scale, ``--backend``) runs on both, and
per head also with q in bf16 over the FP8 K/V (an FP8 KV cache; Mosaic GPU quantizes
that q itself, its "dequantized" reference has q as given); cuDNN's
FP8 attention (``systems.cudnn_fp8_attention``, FP8 output) on the per-tensor inputs,
where there is a GPU and the lengths are equal (else skipped, and said); and ours on the
data in bf16, for context. Each output's relative (Frobenius) error is taken against the
float32 reference of the dequantized inputs it ran on (``err_dequantized``: the kernel's
own error, what the harness's FP8 rows check) and against the float32 reference of the
original data (``err_original``: the kernel's and the quantization's); ``inputs_err`` is
the largest relative error of the dequantized q, k, v. Writes DIR/fp8_accuracy.json and
prints a table. On the CPU, small and interpreted:
``--interpret --lens 64 40 --heads 4 --kv-heads 2 --head-dim 64``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import pallas_prefill as pp
from benchmarks import run
from benchmarks import systems as sy
from benchmarks import workloads as wl

DATA = ("normal", "outliers")
QUANTIZATIONS = ("per_head", "per_tensor")


def make_problem(data, lens, heads, kv_heads, head_dim, *, outlier_channels=3,
                 outlier_factor=30.0, seed=0) -> sy.Problem:
  """One packed self-attention batch of ``data`` ("normal" or "outliers"), float32."""
  rng = np.random.default_rng(seed)
  total = sum(lens)
  channels = rng.choice(head_dim, outlier_channels, replace=False)

  def normal(num_heads):
    x = rng.standard_normal((total, num_heads, head_dim)).astype(np.float32)
    if data == "outliers":
      x[..., channels] *= outlier_factor
    return jnp.asarray(x)

  workload = wl.Workload(data, tuple(lens), kernels=("mha",))
  return sy.Problem("mha", workload, normal(heads), (normal(kv_heads), normal(kv_heads)),
                    jnp.asarray(wl.offsets(lens)), None, None)


def ours(problem: sy.Problem, scales, backend, interpret):
  """(output, backend) of mha_prefill on the problem's arrays (FP8 with ``scales``, or
  bf16 with none); with ``"auto"`` the backend says which kernel it picked."""
  w = problem.workload
  fn = jax.jit(lambda q, kv, offsets, scales: pp.mha_prefill(
      q, *kv, offsets, max_prompt_len=w.max_len, mask=w.mask, backend=backend,
      interpret=interpret, **scales))
  args = (problem.q, problem.kv, problem.q_offsets, scales)
  ran = f"auto: {sy.backend_ran(fn, *args)}" if backend == "auto" else backend
  return fn(*args), ran


def cudnn(quantized: sy.Fp8Problem):
  """cuDNN's FP8 attention on per-tensor quantized equal-length prompts, its output
  dequantized and packed; None (with the reason printed) where it cannot run."""
  lens = quantized.problem.workload.q_lens
  if jax.default_backend() != "gpu":
    print("cudnn: skipped (needs a GPU)", flush=True)
    return None
  if len(set(lens)) != 1:
    print("cudnn: skipped (FP8 needs equal lengths: a dense batch)", flush=True)
    return None
  out = jax.jit(lambda q, k, v, params: sy.cudnn_fp8_attention(q, k, v, params, causal=True))(
      *sy.cudnn_fp8_inputs(quantized))
  return sy.from_fp8(out.reshape(-1, *out.shape[2:]), quantized.scales["v_scale"])


def measure(problem: sy.Problem, backend="auto", interpret=None) -> list[dict]:
  """The rows of one batch: ours in bf16, then per quantization ours and (per tensor)
  cuDNN, each with its errors; a call refused (an FP8 backend not yet served) gives a row
  with ``error`` instead."""
  data = problem.workload.name
  original = sy.reference(problem)
  bf16 = dataclasses.replace(problem, q=problem.q.astype(jnp.bfloat16),
                             kv=tuple(x.astype(jnp.bfloat16) for x in problem.kv))
  out, ran = ours(bf16, {}, backend, interpret)
  rows = [dict(data=data, quantization="none (bf16)", system="pallas_prefill", backend=ran,
               err_dequantized=None, err_original=run.rel_err(out, original),
               inputs_err=_inputs_err(bf16, problem))]
  for quantization in QUANTIZATIONS:
    quantized = sy.quantize_problem(problem, per_tensor=quantization == "per_tensor")
    dequantized = quantized.dequantized()
    reference = sy.reference(dequantized)
    # system -> (output or the reason it did not run, backend, its inputs as the
    # kernel was given them (the reference of those is "dequantized"))
    outputs = {}
    calls = {"pallas_prefill": (quantized.problem, quantized.scales, dequantized)}
    if quantization == "per_head":
      # An FP8 KV cache under a bf16 q (which Mosaic GPU quantizes itself)
      q16 = problem.q.astype(jnp.bfloat16)
      calls["pallas_prefill bf16 q"] = (
          dataclasses.replace(quantized.problem, q=q16),
          {n: x for n, x in quantized.scales.items() if n != "q_scale"},
          dataclasses.replace(dequantized, q=q16.astype(jnp.float32)))
    for system, (given, scales, inputs) in calls.items():
      try:
        outputs[system] = (*ours(given, scales, backend, interpret), inputs)
      except (TypeError, ValueError, NotImplementedError) as e:
        outputs[system] = f"{type(e).__name__}: {str(e)[:200]}", backend, inputs
    if quantization == "per_tensor" and (out := cudnn(quantized)) is not None:
      outputs["cudnn"] = out, "cudnn", dequantized
    for system, (out, ran, inputs) in outputs.items():
      row = dict(data=data, quantization=quantization, system=system, backend=ran,
                 inputs_err=_inputs_err(inputs, problem))
      if isinstance(out, str):
        row["error"] = out
      else:
        ref = reference if inputs is dequantized else sy.reference(inputs)
        row.update(err_dequantized=run.rel_err(out, ref),
                   err_original=run.rel_err(out, original))
      rows.append(row)
  return rows


def _inputs_err(approx: sy.Problem, problem: sy.Problem) -> float:
  return max(run.rel_err(a, x) for a, x in zip((approx.q, *approx.kv),
                                               (problem.q, *problem.kv)))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lens", nargs="+", type=int, default=[4096] * 4)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--kv-heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--backend", default="auto", choices=["auto", "triton", "mosaic_gpu"])
  parser.add_argument("--interpret", action="store_true",
                      help="run ours in the Pallas interpreter (the CPU; small sizes)")
  parser.add_argument("--outlier-channels", type=int, default=3)
  parser.add_argument("--outlier-factor", type=float, default=30.0)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", default="bench-out")
  args = parser.parse_args(argv)
  if args.heads % args.kv_heads or min(args.lens) < 1:
    parser.error("--heads must be a multiple of --kv-heads, and every length >= 1")
  os.makedirs(args.out, exist_ok=True)
  rows = []
  for data in DATA:
    problem = make_problem(data, args.lens, args.heads, args.kv_heads, args.head_dim,
                           outlier_channels=args.outlier_channels,
                           outlier_factor=args.outlier_factor, seed=args.seed)
    rows += measure(problem, args.backend, True if args.interpret else None)
  fmt = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
  run.report(os.path.join(args.out, "fp8_accuracy.json"), rows, [
      ("data", lambda r: r["data"]), ("quantization", lambda r: r["quantization"]),
      ("system", lambda r: r["system"]), ("backend", lambda r: r["backend"]),
      ("inputs err", lambda r: fmt(r["inputs_err"])),
      ("err vs dequantized ref", lambda r: r.get("error") or fmt(r.get("err_dequantized"))),
      ("err vs original ref", lambda r: fmt(r.get("err_original")))],
      lens=args.lens, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
      backend=args.backend, interpret=args.interpret,
      outlier_channels=args.outlier_channels, outlier_factor=args.outlier_factor,
      seed=args.seed, device=jax.devices()[0].device_kind)
  return 0


if __name__ == "__main__":
  sys.exit(main())

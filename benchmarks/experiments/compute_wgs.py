"""Does a third compute warpgroup make attention faster at depth 128 on the H200?

The lead that issues 23 (the soft cap), 24 (FP8) and 25 (bf16) share, asked apart from the
library's kernel. The ncu profiles of that kernel (BUILD_NOTES, twenty-second session) show
each compute warp waiting on its own dependency chain, two compute warps per scheduler, the
issue slots 40-50 % used and no pipe saturated. A third compute warpgroup puts three warps
on each scheduler, but leaves a compute thread at most 160 registers (setmaxnreg's pool of
64K: 3 x 128 x 160 + 128 x 32), against the 232 it has now.

This script times a dense, non-causal attention forward written for the question (not the
library's kernel) with the same structure: a producer warpgroup that loads K/V tiles by TMA
into ``stages`` slots; compute warpgroups of 64 query rows each, the online softmax in base
2 with the scale folded into the exponent's FMA; the tensor cores taken in turns through a
ring of hardware named barriers (warpgroup g's P.V waits until warpgroup g - 1 has issued
its Q.K), or no turns. In bf16 and in FP8 (e4m3 Q, K, V; P quantized with the library's
``P_BIAS`` and passed from registers by ``primitives.fp8_a_operand``; V^T given, its keys
in that operand's order). The library's own call on the same shapes and mask runs beside
it, with two and with three compute warpgroups (``MosaicConfig.compute_wgs``). Each arm is
checked against a float32 reference on four query heads first.

    python3 -m benchmarks.experiments.compute_wgs [--rounds 3] [--rest 0.3] [--out DIR]
        [--arms NAME ...] [--library bf16 fp8] [--library-options NAME=VALUE ...]
    python3 -m benchmarks.experiments.compute_wgs --lower   # anywhere: lowers every arm

``MOSAIC_GPU_DUMP_PTXAS=1`` prints ptxas's registers and spills of each arm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

import pallas_prefill as pp
from benchmarks import run
from pallas_prefill.mosaic_gpu import primitives

F8 = jnp.float8_e4m3fn
TURN = 8  # the ring's first named barrier (Mosaic GPU uses 0 and 1 + the warpgroup)
P_BIAS = 8.0  # FP8's P is 2**P_BIAS times the probability (at most 256), as the kernel's


@dataclasses.dataclass(frozen=True)
class Arm:
  name: str
  dtype: str  # "bf16" or "fp8"
  wgs: int = 2  # compute warpgroups
  block_kv: int = 128
  stages: int = 2
  turns: bool = True
  regs: tuple[int, int] = (232, 40)  # setmaxnreg: compute, producer


ARMS = [
    Arm("bf16_w2_kv128", "bf16"),
    Arm("bf16_w2_kv128_free", "bf16", turns=False),
    Arm("bf16_w2_kv64", "bf16", block_kv=64),
    Arm("bf16_w3_kv64", "bf16", wgs=3, block_kv=64, regs=(160, 32)),
    Arm("bf16_w3_kv64_free", "bf16", wgs=3, block_kv=64, turns=False, regs=(160, 32)),
    Arm("bf16_w3_kv128", "bf16", wgs=3, regs=(160, 32)),
    Arm("fp8_w2_kv128", "fp8"),
    Arm("fp8_w2_kv128_free", "fp8", turns=False),
    Arm("fp8_w3_kv64", "fp8", wgs=3, block_kv=64, regs=(160, 32)),
    Arm("fp8_w3_kv128", "fp8", wgs=3, regs=(160, 32)),
    Arm("fp8_w3_kv128_free", "fp8", wgs=3, turns=False, regs=(160, 32)),
    Arm("fp8_w3_kv128_s3", "fp8", wgs=3, stages=3, regs=(160, 32)),
]


def bcast(x, shape):
  return lax.broadcast_in_dim(x, shape, [0])


def attention(q, k, v, *, arm: Arm):
  """q [B, T, N, D]; k [B, S, K, D]; v [B, S, K, D] (bf16) or V^T [B, K, D, S] (FP8, its
  keys in ``fp8_a_operand``'s order). Non-causal; T a multiple of 64 * wgs, S of
  block_kv. Returns [B, T, N, D] bfloat16."""
  fp8 = arm.dtype == "fp8"
  batch, t, heads, d = q.shape
  s_len, kv_heads = k.shape[1], k.shape[2]
  wgs, bkv, stages = arm.wgs, arm.block_kv, arm.stages
  rows, steps, group = 64 * wgs, s_len // bkv, heads // kv_heads
  assert t % rows == 0 and s_len % bkv == 0 and steps >= stages and d == 128
  c = math.log2(math.e) / math.sqrt(d)
  bias = P_BIAS if fp8 else 0.0

  def kernel(q_ref, k_ref, v_ref, o_ref, q_smem, k_smem, v_smem, o_smem, q_bar, k_bar,
             v_bar, k_free, v_free):
    wg = lax.axis_index("wg")
    h, b = lax.axis_index("heads"), lax.axis_index("batch")
    kvh = lax.div(h, jnp.int32(group))
    row0 = lax.axis_index("q_tiles") * rows + wg * 64

    @pl.when(wg < wgs)
    def _compute():
      plgpu.set_max_registers(arm.regs[0], action="increase")
      plgpu.copy_gmem_to_smem(q_ref.at[b, pl.ds(row0, 64), h], q_smem.at[wg], q_bar.at[wg])
      plgpu.barrier_wait(q_bar.at[wg])
      layout = plgpu.Layout.WGMMA
      m = plgpu.layout_cast(jnp.full((64,), -jnp.inf, jnp.float32), layout.reduce(1))
      l = plgpu.layout_cast(jnp.zeros((64,), jnp.float32), layout.reduce(1))
      acc = plgpu.layout_cast(jnp.zeros((64, d), jnp.float32), layout)
      plgpu.barrier_wait(k_bar.at[0])
      if arm.turns:
        pl.when(wg > 0)(lambda: primitives.named_barrier("sync", TURN + wg))

      def body(i, carry):
        acc, m, l = carry
        slot = lax.rem(i, jnp.int32(stages))

        def qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem.at[wg], k_smem.at[slot].transpose((1, 0)))
          if arm.turns:
            primitives.named_barrier("arrive", TURN + lax.rem(wg + 1, jnp.int32(wgs)))
          return acc_ref[...]

        s = pl.run_scoped(qk, plgpu.ACC((64, bkv), jnp.float32))
        plgpu.barrier_arrive(k_free.at[slot])
        m_new = jnp.maximum(m, s.max(axis=1) * c - bias)
        p = jnp.exp2(s * c - bcast(m_new, s.shape))
        alpha = jnp.exp2(m - m_new)
        acc = acc * bcast(alpha, acc.shape)
        l = l * alpha + p.sum(axis=1)
        a = primitives.fp8_a_operand(p.astype(F8)) if fp8 else p.astype(jnp.bfloat16)
        acc, l, m_new, a = lax.optimization_barrier((acc, l, m_new, a))
        plgpu.barrier_wait(v_bar.at[slot])
        if arm.turns:
          primitives.named_barrier("sync", TURN + wg)

        def pv(acc_ref):
          plgpu.wgmma(acc_ref, a, v_smem.at[slot].transpose((1, 0)) if fp8 else
                      v_smem.at[slot])
          nxt = i + 1

          @pl.when(nxt < steps)
          def _():
            plgpu.barrier_wait(k_bar.at[lax.rem(nxt, jnp.int32(stages))])

        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l

      acc, m, l = lax.fori_loop(0, steps, body, (acc, m, l))
      if arm.turns:  # the one signal each later warpgroup's start took
        pl.when(wg < wgs - 1)(lambda: primitives.named_barrier("arrive", TURN + wg + 1))
      out = o_smem.at[wg]
      out[...] = (acc / bcast(l, acc.shape)).astype(jnp.bfloat16)
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out, o_ref.at[b, pl.ds(row0, 64), h])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == wgs)
    def _producer():
      plgpu.set_max_registers(arm.regs[1], action="decrease")

      def load_k(step, slot):
        plgpu.copy_gmem_to_smem(k_ref.at[b, pl.ds(step * bkv, bkv), kvh], k_smem.at[slot],
                                k_bar.at[slot])

      def load_v(step, slot):
        src = (v_ref.at[b, kvh, :, pl.ds(step * bkv, bkv)] if fp8 else
               v_ref.at[b, pl.ds(step * bkv, bkv), kvh])
        plgpu.copy_gmem_to_smem(src, v_smem.at[slot], v_bar.at[slot])

      for st in range(stages):
        load_k(st, st)
        load_v(st, st)

      @pl.loop(0, steps - stages)
      def _(i):
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(k_free.at[slot])
        load_k(i + stages, slot)
        plgpu.barrier_wait(v_free.at[slot])
        load_v(i + stages, slot)

  def swizzled(shape, dtype, row_bytes):
    cols = row_bytes // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, cols)),
                                                plgpu.SwizzleTransform(row_bytes)))

  in_dt = F8 if fp8 else jnp.bfloat16
  row = 128  # D = 128: 128 bytes of FP8 a row, 64 bf16 columns (the swizzle's width)
  q_smem = swizzled((wgs, 64, d), in_dt, row)
  k_smem = swizzled((stages, bkv, d), in_dt, row)
  v_smem = (swizzled((stages, d, bkv), F8, min(bkv, 128)) if fp8 else
            swizzled((stages, bkv, d), jnp.bfloat16, row))
  o_smem = swizzled((wgs, 64, d), jnp.bfloat16, row)
  bar = plgpu.Barrier
  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((batch, t, heads, d), jnp.bfloat16),
      grid=(heads, t // rows, batch), grid_names=("heads", "q_tiles", "batch"),
      num_threads=wgs + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      scratch_types=[q_smem, k_smem, v_smem, o_smem, bar(num_barriers=wgs),
                      bar(num_barriers=stages), bar(num_barriers=stages),
                      bar(num_arrivals=wgs, num_barriers=stages),
                      bar(num_arrivals=wgs, num_barriers=stages)],
  )(q, k, v)


def p_order_vt(v):
  """V [B, S, K, D] -> V^T [B, K, D, S] with key column c holding key fp8_p_key(c)."""
  keys = primitives.fp8_p_key(np.arange(v.shape[1]))
  return jnp.transpose(v[:, keys], (0, 2, 3, 1))


def reference(q, k, v, heads=4):
  """float32 attention of the first ``heads`` query heads: [B, T, heads, D]."""
  group = q.shape[2] // k.shape[2]
  q32 = q[:, :, :heads].astype(jnp.float32)
  k32 = jnp.repeat(k.astype(jnp.float32), group, axis=2)[:, :, :heads]
  v32 = jnp.repeat(v.astype(jnp.float32), group, axis=2)[:, :, :heads]
  s = jnp.einsum("bthd,bshd->bhts", q32, k32) / math.sqrt(q.shape[-1])
  return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v32)


def library_call(dtype, wgs=2, causal=False, options=None):
  """The library's Mosaic GPU call on the same arrays (packed), with ``wgs`` compute
  warpgroups (``MosaicConfig.compute_wgs``) and ``options`` ({MosaicOptions field:
  value}, else the defaults)."""
  config = pp.MosaicConfig(compute_wgs=wgs, options=pp.MosaicOptions(**(options or {})))
  mask = pp.masks.CausalMask() if causal else pp.masks.NullMask()

  def fn(q, k, v):
    b, t, n, d = q.shape
    offsets = jnp.arange(b + 1, dtype=jnp.int32) * t
    extra = {}
    if dtype == "fp8":
      one = jnp.float32(1.0)
      extra = dict(q_scale=one, k_scale=one, v_scale=one)
    out = pp.mha_prefill(q.reshape(b * t, n, d), k.reshape(b * t, -1, d),
                         v.reshape(b * t, -1, d), offsets, max_prompt_len=t,
                         mask=mask, backend="mosaic_gpu", config=config, **extra)
    return out.reshape(b, t, n, d)

  return fn


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--lower", action="store_true")
  ap.add_argument("--arms", nargs="*", default=None)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--rest", type=float, default=0.3)
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seq", type=int, default=6144)
  ap.add_argument("--library", nargs="*", default=["bf16", "fp8"],
                  help="dtypes of the library's call, with 2 and 3 compute warpgroups")
  ap.add_argument("--library-options", nargs="*", default=[], metavar="NAME=VALUE",
                  help="MosaicOptions of the library's calls (benchmarks.run's syntax)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  sys.path.insert(0, ".")
  arms = [a for a in ARMS if args.arms is None or a.name in args.arms]
  b, t, n, kh, d = args.batch, args.seq, 32, 8, 128
  shapes = {"bf16": (jnp.bfloat16, (b, t, kh, d)), "fp8": (F8, (b, kh, d, t))}
  if args.lower:
    from tests.test_lowering import lower_for_h200  # pylint: disable=g-import-not-at-top
    for arm in arms:
      dt, v_shape = shapes[arm.dtype]
      sd = jax.ShapeDtypeStruct
      text = lower_for_h200(lambda q, k, v, arm=arm: attention(q, k, v, arm=arm),
                            sd((b, t, n, d), dt), sd((b, t, kh, d), dt),
                            sd(v_shape, dt)).as_text()
      print(f"{arm.name}: lowered, {len(text)} chars")
    return

  rng = np.random.default_rng(0)
  qf, kf, vf = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
                for h in (n, kh, kh))
  inputs = {"bf16": tuple(x.astype(jnp.bfloat16) for x in (qf, kf, vf)),
            "fp8": tuple(x.astype(F8) for x in (qf, kf, vf))}
  refs = {dt: reference(*xs) for dt, xs in inputs.items()}
  calls = {}
  for arm in arms:
    q, k, v = inputs[arm.dtype]
    calls[arm.name] = (jax.jit(lambda q, k, v, arm=arm: attention(q, k, v, arm=arm)),
                       (q, k, p_order_vt(v) if arm.dtype == "fp8" else v), arm.dtype)
  from benchmarks import systems  # pylint: disable=g-import-not-at-top
  options = systems.parse_mosaic_options(args.library_options)
  for dt in args.library:
    for wgs in (2, 3):
      calls[f"library_{dt}_w{wgs}"] = (
          jax.jit(library_call(dt, wgs, options=options)), inputs[dt], dt)
  flops = 4.0 * b * n * t * t * d
  results = {}
  for name, (fn, xs, dt) in calls.items():
    print("arm", name, flush=True)  # (ptxas's report of its kernel follows, if asked)
    try:
      out = jax.block_until_ready(fn(*xs))
      got = out[:, :, :4].astype(jnp.float32)
      err = float(jnp.linalg.norm(got - refs[dt]) / jnp.linalg.norm(refs[dt]))
      results[name] = dict(err=err, finite=bool(jnp.isfinite(out).all()), times=[])
      print(f"  err {err:.2e}", flush=True)
    except Exception as e:  # pylint: disable=broad-except
      results[name] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
      print(name, "failed:", results[name]["error"], flush=True)
  for _ in range(args.rounds):
    for name, (fn, xs, _) in calls.items():
      if "error" in results[name]:
        continue
      time.sleep(args.rest)
      results[name]["times"].append(run.bench_jax(fn, [xs]))
  rows = []
  for name, r in results.items():
    if "error" in r:
      rows.append(f"{name:22s} FAILED")
      continue
    r["seconds"] = statistics.median(r["times"])
    r["tflops"] = flops / r["seconds"] / 1e12
    rows.append(f"{name:22s} {r['tflops']:7.1f} TFLOP/s  err {r['err']:.2e}"
                f"  finite {r['finite']}")
  meta = dict(batch=b, seq=t, heads=n, kv_heads=kh, depth=d, rounds=args.rounds,
              commit=os.environ.get("PALLAS_PREFILL_COMMIT"), jax=jax.__version__,
              arms=[dataclasses.asdict(a) for a in arms], library_options=options)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compute_wgs.json"), "w") as f:
      json.dump(dict(meta=meta, results=results), f, indent=1)
  print("\n".join(rows))


if __name__ == "__main__":
  main()

"""Probe (issue 24): does Pallas Mosaic GPU run one FP8 attention tile on the H200?

Q [64, 128] and K [128, 128] in float8_e4m3fn (64-column chunks, swizzle 64), S = Q.K^T by
FP8 wgmma (K-major: K's rows hold the contraction), P = 256 * exp2(S - max) quantized to
e4m3 and stored to shared memory (swizzle 128), then P.V by FP8 wgmma with V transposed
(V^T [128 depth, 128 keys], K-major again), one 64-column accumulator per half of V.

    python -m benchmarks.experiments.fp8_wgmma_probe          # on the H200: runs, checks
    python -m benchmarks.experiments.fp8_wgmma_probe --lower  # anywhere: lowers only
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

F8 = jnp.float8_e4m3fn
BQ, BK, D = 64, 128, 128


def tile_kernel(q_ref, k_ref, vt_ref, o_ref, q_smem, k_smem, vt_smem, p_smem, o_smem, bar):
  for c in range(2):
    plgpu.copy_gmem_to_smem(q_ref.at[:, pl.ds(c * 64, 64)], q_smem.at[c], bar)
    plgpu.copy_gmem_to_smem(k_ref.at[:, pl.ds(c * 64, 64)], k_smem.at[c], bar)
    plgpu.copy_gmem_to_smem(vt_ref.at[pl.ds(c * 64, 64), :], vt_smem.at[c], bar)
  plgpu.barrier_wait(bar)

  def qk(acc_ref):
    for c in range(2):
      plgpu.wgmma(acc_ref, q_smem.at[c], k_smem.at[c].T)
    return acc_ref[...]

  s = pl.run_scoped(qk, plgpu.ACC((BQ, BK), jnp.float32))
  m = s.max(axis=1)
  p = jnp.exp2(s - lax_bcast(m - 8.0, s.shape))
  l = p.sum(axis=1)
  p_smem[...] = p.astype(F8)
  plgpu.commit_smem()

  def products(acc_refs):
    for c, acc_ref in enumerate(acc_refs):
      plgpu.wgmma(acc_ref, p_smem, vt_smem.at[c].T)

  layout = plgpu.Layout.WGMMA
  acc = pl.run_state(products)(tuple(
      plgpu.ACC.init(plgpu.layout_cast(jnp.zeros((BQ, 64), jnp.float32), layout))
      for _ in range(2)))
  for c in range(2):
    o_smem.at[c][...] = (acc[c] / lax_bcast(l, acc[c].shape)).astype(jnp.bfloat16)
  plgpu.commit_smem()
  for c in range(2):
    plgpu.copy_smem_to_gmem(o_smem.at[c], o_ref.at[:, pl.ds(c * 64, 64)])
  plgpu.wait_smem_to_gmem(0)


def lax_bcast(x, shape):
  return jax.lax.broadcast_in_dim(x, shape, [0])


def call(q, k, vt):
  sw64 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
  sw128 = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
  return plgpu.kernel(
      tile_kernel, out_type=jax.ShapeDtypeStruct((BQ, D), jnp.bfloat16),
      scratch_types=[
          plgpu.SMEM((2, BQ, 64), F8, transforms=sw64),
          plgpu.SMEM((2, BK, 64), F8, transforms=sw64),
          plgpu.SMEM((2, 64, BK), F8, transforms=sw128),
          plgpu.SMEM((BQ, BK), F8, transforms=sw128),
          plgpu.SMEM((2, BQ, 64), jnp.bfloat16),
          plgpu.Barrier(num_arrivals=6),
      ])(q, k, vt)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--lower", action="store_true")
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((BQ, D)) * 4, F8)
  k = jnp.asarray(rng.standard_normal((BK, D)) * 4, F8)
  v = jnp.asarray(rng.standard_normal((BK, D)) * 4, F8)
  if args.lower:
    import sys  # pylint: disable=g-import-not-at-top
    sys.path.insert(0, ".")
    from tests.test_lowering import lower_for_h200  # pylint: disable=g-import-not-at-top
    s = jax.ShapeDtypeStruct
    text = lower_for_h200(call, s((BQ, D), F8), s((BK, D), F8), s((D, BK), F8)).as_text()
    print("lowered:", len(text), "chars")
    return
  out = np.asarray(jax.jit(call)(q, k, v.T), np.float32)
  q32, k32, v32 = (np.asarray(x, np.float32) for x in (q, k, v))
  s = q32 @ k32.T
  p = np.exp2(s - s.max(1, keepdims=True))
  ref = (p / p.sum(1, keepdims=True)) @ v32
  err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
  print(f"fp8 tile: rel err {err:.3e}, finite {np.isfinite(out).all()}")


if __name__ == "__main__":
  main()

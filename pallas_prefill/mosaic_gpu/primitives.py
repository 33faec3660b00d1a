"""Mosaic GPU primitives the kernel needs that Pallas does not expose: PTX named barriers
with a traced id, a fused multiply-add before ``ex2.approx``, the atomic claim of the next
unit, and the two-copy TMA of a row range whose last 8 rows may come from elsewhere."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir  # pylint: disable=g-direct-tensorflow-import
from jax._src.lib.mlir.dialects import arith, memref, scf, vector
from jax._src.lib.mlir.dialects import math as mlir_math

from pallas_prefill.mosaic_gpu import layout as L


def named_barrier(op: str, barrier_id, threads: int = 2 * 128):
  """PTX ``bar.{op}`` ("arrive" or "sync") on a named barrier whose id is traced."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
  def bar(_, idx):
    mgpu.utils.inline_ptx(f"bar.{op} $0, {threads};", idx.registers[()],
                          has_side_effects=True, convergent=True)

  bar(jnp.asarray(barrier_id, jnp.int32))


def exp2_fma(s, scale: float, neg_m):
  """exp2(s * scale + neg_m) for scores s [rows, cols] in the WGMMA layout and neg_m
  [rows, cols] (a row vector broadcast): one fused multiply-add and one ``ex2.approx``
  per element (Mosaic GPU emits a multiplication and an addition as two instructions)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA),
                     return_type=plgpu.ShapeDtypeStruct(s.shape, jnp.float32,
                                                        layout=plgpu.Layout.WGMMA))
  def fma_exp2(_, x, b):
    f32 = ir.F32Type.get()

    def fma(a, c):
      k = arith.constant(f32, scale)
      if isinstance(a.type, ir.VectorType):
        k = vector.broadcast(a.type, k)
      return mlir_math.fma(a, k, c)

    return x._pointwise(fma, b).exp2(approx=True)  # pylint: disable=protected-access

  return fma_exp2(s, neg_m)


def claim(scalar_ref, unit_smem, slot, dealt):
  """One thread of the warpgroup writes the next unit to ``unit_smem[slot]``: ``dealt``
  where it is not negative, else the one it takes from the global counter (an atomic add
  on ``scalar_ref[L.S_NEXT]``); the warpgroup then waits for it (so that all of its
  threads can read the slot)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT,
                                plgpu.Layout.WG_SPLAT))
  def claim_or_take(_, counter, units, s, unit):
    index, i32 = ir.IndexType.get(), ir.IntegerType.get_signless(32)
    unit = unit.registers[()]
    with mgpu.utils.single_thread(scope=mgpu.utils.ThreadSubset.WARPGROUP):
      take = arith.cmpi(arith.CmpIPredicate.slt, unit, arith.constant(i32, 0))
      branch = scf.IfOp(take, [i32], has_else=True)
      with ir.InsertionPoint(branch.then_block):
        scf.yield_([memref.atomic_rmw(arith.AtomicRMWKind.addi, arith.constant(i32, 1),
                                      counter, [arith.constant(index, L.S_NEXT)])])
      with ir.InsertionPoint(branch.else_block):
        scf.yield_([unit])
      memref.store(branch.result, units, [arith.index_cast(index, s.registers[()])])
    mgpu.utils.warpgroup_barrier()

  claim_or_take(scalar_ref, unit_smem, jnp.asarray(slot, jnp.int32),
                jnp.asarray(dealt, jnp.int32))


def load_rows(src, tail, rows, start, dst, barrier, *, tail_group):
  """TMA of rows [start, start + rows) of `src` (a function of a row slice giving a GMEM
  ref view) into `dst`, in two copies that both signal `barrier`: rows - 8 rows, then the
  last 8, which come from `tail` (a view of an 8-row array) when they are the group
  `tail_group` (in units of 8 rows)."""
  head = rows - 8
  plgpu.copy_gmem_to_smem(src(pl.ds(start, head)), dst.at[pl.ds(0, head)], barrier)
  last8 = start // 8 + head // 8

  @pl.when(last8 == tail_group)
  def _():
    plgpu.copy_gmem_to_smem(tail, dst.at[pl.ds(head, 8)], barrier)

  @pl.when(last8 != tail_group)
  def _():
    plgpu.copy_gmem_to_smem(src(pl.ds(last8 * 8, 8)), dst.at[pl.ds(head, 8)], barrier)



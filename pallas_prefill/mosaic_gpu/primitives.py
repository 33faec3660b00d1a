"""Mosaic GPU primitives the kernel needs that Pallas does not expose: PTX named barriers
with a traced id, a fused multiply-add before ``ex2.approx`` (or before a polynomial exp2
on the FMA pipes), the atomic claim of the next unit, and the two-copy TMA of a row range
whose last 8 rows may come from elsewhere."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax._src.lib.mlir import ir  # pylint: disable=g-direct-tensorflow-import
from jax._src.lib.mlir.dialects import arith, llvm, memref, scf, vector
from jax._src.lib.mlir.dialects import math as mlir_math

from pallas_prefill.mosaic_gpu import layout as L


def named_barrier(op: str, barrier_id, threads: int = 2 * 128):
  """PTX ``bar.{op}`` ("arrive" or "sync") on a named barrier whose id is traced."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
  def bar(_, idx):
    mgpu.utils.inline_ptx(f"bar.{op} $0, {threads};", idx.registers[()],
                          has_side_effects=True, convergent=True)

  bar(jnp.asarray(barrier_id, jnp.int32))


# exp2 on the FMA pipes (FlashAttention-4's trick, for Hopper's 16 MUFU operations per
# clock and SM): 2**x = 2**j * 2**f with j = round(x) by the 1.5 * 2**23 addition (FADD,
# not the conversion unit), f = x - j in [-0.5, 0.5], 2**f = 1 + f (c1 + f (c2 + f c3))
# (relative error 1.0e-4, below bf16's 2**-9 rounding of P; the constant term is exactly 1),
# and j added to the exponent bits. x is clamped to -127 first, where f = 0 and the sum of
# the bits is exactly +0.0: a masked score (-inf) gives 0 as ex2.approx does; x in
# (-127, -126) gives a subnormal. ``poly_exp2_model`` is the same steps in NumPy.
POLY_EXP2_COEFFS = (0.6932829022407532, 0.2422109693288803, 0.05500892922282219)
POLY_EXP2_CLAMP = -127.0
_ROUND_MAGIC = 12582912.0  # 1.5 * 2**23: x + it has round(x) in its low mantissa bits


def _f32_hex(value: float) -> str:
  return f"0f{int(np.float32(value).view(np.uint32)):08X}"


_POLY_EXP2_PTX = "\n".join([
    "{",
    ".reg .f32 x, t, j, f, p;",
    ".reg .b32 e, r;",
    f"max.f32 x, $1, {_f32_hex(POLY_EXP2_CLAMP)};",
    f"add.rn.f32 t, x, {_f32_hex(_ROUND_MAGIC)};",
    f"sub.rn.f32 j, t, {_f32_hex(_ROUND_MAGIC)};",
    "sub.rn.f32 f, x, j;",
    f"fma.rn.f32 p, f, {_f32_hex(POLY_EXP2_COEFFS[2])}, {_f32_hex(POLY_EXP2_COEFFS[1])};",
    f"fma.rn.f32 p, p, f, {_f32_hex(POLY_EXP2_COEFFS[0])};",
    f"fma.rn.f32 p, p, f, {_f32_hex(1.0)};",
    "shl.b32 e, t, 23;",
    "mov.b32 r, p;",
    "add.s32 r, r, e;",
    "mov.b32 $0, r;",
    "}",
])


def poly_exp2_model(x):
  """``exp2_fma``'s polynomial exp2 in NumPy float32, step for step (the FMAs rounded
  once each): what the tests hold the PTX's error and its zeros to."""
  x = np.maximum(np.asarray(x, np.float32), np.float32(POLY_EXP2_CLAMP))
  magic = np.float32(_ROUND_MAGIC)
  t = x + magic
  f = x - (t - magic)
  c1, c2, c3 = (np.float64(np.float32(c)) for c in POLY_EXP2_COEFFS)
  f64 = f.astype(np.float64)
  p = np.float32(f64 * c3 + c2)
  p = np.float32(p.astype(np.float64) * f64 + c1)
  p = np.float32(p.astype(np.float64) * f64 + 1.0)
  return (p.view(np.int32) + (t.view(np.int32) << 23)).view(np.float32)


def _per_element(fn, reg):
  """fn on each f32 of a register (an f32 or a vector of them)."""
  if not isinstance(reg.type, ir.VectorType):
    return fn(reg)
  result = llvm.mlir_undef(reg.type)
  for i in range(ir.VectorType(reg.type).shape[0]):
    pos = ir.DenseI64ArrayAttr.get([i])
    elem = vector.extract(reg, dynamic_position=[], static_position=pos)
    result = vector.insert(fn(elem), result, dynamic_position=[], static_position=pos)
  return result


def exp2_fma(s, scale, neg_m, *, poly_eighths: int = 0):
  """exp2(s * scale + neg_m) for scores s [rows, cols] in the WGMMA layout, a scale (a
  Python float, or a traced float32 scalar: FP8's per-item factor) and neg_m [rows, cols]
  (a row vector broadcast): one fused multiply-add and one ``ex2.approx``
  per element (Mosaic GPU emits a multiplication and an addition as two instructions).
  ``poly_eighths`` of every 8 of a thread's registers (each 2 scores) take the polynomial
  exp2 on the FMA pipes instead (``POLY_EXP2_COEFFS``), which relieves the MUFU unit
  where it, not the tensor cores, is the limit (a soft cap's tanh); 0 to 8, as
  ``MosaicOptions.poly_exp2`` checks it."""

  traced = not isinstance(scale, (int, float))

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA, plgpu.Layout.WGMMA)
                     + ((plgpu.Layout.WG_SPLAT,) if traced else ()),
                     return_type=plgpu.ShapeDtypeStruct(s.shape, jnp.float32,
                                                        layout=plgpu.Layout.WGMMA))
  def fma_exp2(_, x, b, *factor):
    f32 = ir.F32Type.get()

    def fma(a, c):
      k = factor[0].registers[()] if traced else arith.constant(f32, float(scale))
      if isinstance(a.type, ir.VectorType):
        k = vector.broadcast(a.type, k)
      return mlir_math.fma(a, k, c)

    y = x._pointwise(fma, b)  # pylint: disable=protected-access
    if not poly_eighths:
      return y.exp2(approx=True)
    asm = lambda ptx: functools.partial(  # noqa: E731
        _per_element, lambda e: llvm.inline_asm(f32, [e], ptx, "=f,f"))
    exact, poly = asm("ex2.approx.ftz.f32 $0, $1;"), asm(_POLY_EXP2_PTX)
    regs = np.empty_like(y.registers)
    for n, (idx, reg) in enumerate(np.ndenumerate(y.registers)):
      regs[idx] = poly(reg) if n % 8 < poly_eighths else exact(reg)
    return mgpu.FragmentedArray(_registers=regs, _layout=y.layout, _is_signed=None)

  return fma_exp2(s, neg_m, *([jnp.asarray(scale, jnp.float32)] if traced else []))


def fp8_p_key(c):
  """The key that column c (int32, any shape; NumPy or traced) of ``fp8_a_operand``'s P
  holds, and so V^T's column c (``operands.transposed_v(..., p_order=True)``): column
  4q + 2a + b of each 16 holds key 8a + 2q + b of those 16. Arithmetic only: a Pallas
  kernel captures no array constants."""
  q, a, b = (c % 16) // 4, (c % 4) // 2, c % 2
  return c - c % 16 + 8 * a + 2 * q + b


def fp8_a_operand(p8, *, group: int = 0, groups: int = 1):
  """P [64, cols] FP8 in the WGMMA (accumulator) layout as an FP8 matrix product's A
  operand in registers (``WGMMA_LAYOUT_8BIT``: each thread holds 4 consecutive columns of
  each 16), with no data movement: in each 16-column group a thread's 2 columns at 2q and
  its 2 at 8 + 2q become its 4 at 4q, so that column c holds key ``fp8_p_key(c)``. P.V
  sums over the keys, so V^T's columns in that order (``operands.transposed_v(...,
  p_order=True)``) give the same product. FlashAttention-3 moves the bytes instead (a
  shuffle between threads and a byte permute). With ``groups`` > 1, the operand of P's
  columns [group * cols / groups, (group + 1) * cols / groups) only, [64, cols / groups]
  (a 256-key tile's P.V is two products of 128 keys: ``kernel.pv_fp8``)."""
  rows, cols = p8.shape
  width = cols // groups
  assert rows == 64 and width % 16 == 0 and 0 <= group < groups, (p8.shape, group, groups)

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct((rows, width), p8.dtype,
                                                        layout=plgpu.Layout.WGMMA_8BIT))
  def relabel(_, x):
    src = x.registers  # vector<2 x f8> each
    dst = np.empty(mgpu.WGMMA_LAYOUT_8BIT.registers_shape((rows, width)), dtype=object)
    for d, (a, b) in fp8_operand_pairs(cols, group=group, groups=groups):
      dst[d] = vector.shuffle(src[a], src[b], [0, 1, 2, 3])
    return mgpu.FragmentedArray(_registers=dst, _layout=mgpu.WGMMA_LAYOUT_8BIT,
                                _is_signed=None)

  return relabel(p8)


def fp8_operand_pairs(cols: int, *, group: int = 0, groups: int = 1):
  """``fp8_a_operand``'s registers for P [64, cols] (its columns' group ``group`` of
  ``groups``, [64, cols / groups]): (index of a ``WGMMA_LAYOUT_8BIT`` register of the
  operand, (indices of the two ``WGMMA_LAYOUT`` registers of P it concatenates)), each
  index into its layout's ``registers_shape``. Both are [1, column groups, 1, 1, 2 row
  halves, 1, 1, 1, 1] (groups of 8 columns, of 16 in the 8-bit layout): 8-bit register
  (g, h) is registers (2g + s, h) and (2g + 1 + s, h), s = cols / 8 / groups * group.
  tests/test_mosaic.py checks what that means element by element against the installed
  jax's layouts."""
  width = cols // groups
  src_shape = mgpu.WGMMA_LAYOUT.registers_shape((64, cols))
  dst_shape = mgpu.WGMMA_LAYOUT_8BIT.registers_shape((64, width))
  assert src_shape == (1, cols // 8, 1, 1, 2, 1, 1, 1, 1), src_shape
  assert dst_shape == (1, width // 16, 1, 1, 2, 1, 1, 1, 1), dst_shape
  at = lambda g, h: (0, g, 0, 0, h, 0, 0, 0, 0)  # noqa: E731
  shift = width // 8 * group  # P's 8-column register groups before the group's
  return [(at(g, h), (at(2 * g + shift, h), at(2 * g + 1 + shift, h)))
          for g in range(width // 16) for h in range(2)]


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



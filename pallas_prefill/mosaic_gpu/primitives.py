"""Mosaic GPU primitives the kernel needs that Pallas does not expose: PTX named barriers
with a traced id, a fused multiply-add before ``ex2.approx`` (or before a polynomial exp2
on the FMA pipes), the atomic claim of the next unit, the two-copy TMA of a row range
whose last 8 rows may come from elsewhere, zeros stored without TMA
(``store_zero_rows``), and FP8's V tile transposed in shared memory
(``transpose_v_tile``)."""

from __future__ import annotations

import functools
import types

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


def opaque(x):
  """x (an int32 scalar) through an empty inline PTX statement with side effects, which
  LLVM can neither see through nor move: a value derived from it in a loop's body is
  computed there, not hoisted out of the loop and held in registers across it
  (``kernel``'s Q descriptors with ``KernelSpec.q_per_tile``)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,),
                     return_type=plgpu.ShapeDtypeStruct((), jnp.int32,
                                                        layout=plgpu.Layout.WG_SPLAT))
  def same(_, v):
    i32 = ir.IntegerType.get_signless(32)
    out = llvm.inline_asm(i32, [v.registers[()]], "mov.b32 $0, $1;", "=r,r",
                          has_side_effects=True)
    return mgpu.FragmentedArray.splat(out, (), is_signed=True)

  return same(jnp.asarray(x, jnp.int32))


def mask_columns(s, lo, hi):
  """s [64, cols] float32 in the WGMMA layout, -inf outside each row's columns [lo, hi)
  (lo, hi: int32, [64] in its row layout, ``Layout.WGMMA.reduce(1)``, or a scalar, the
  same for every row; lo None: no lower bound, as lo <= 0), as ``jnp.where((lo <= c) &
  (c < hi), s, -inf)`` with c the column iota computes. The thread's first column is
  subtracted from its two rows' bounds once, so that each score is compared with its
  constant column offset (an immediate): no column index is held in a register, where
  LLVM hoists an iota's (one register per two columns, 64 for 128 columns, held across
  the KV loop)."""
  rows, cols = s.shape
  assert rows == 64 and cols % 8 == 0, s.shape
  layout = plgpu.Layout.WGMMA
  # A row-independent bound (NullMask's, CausalMask's lo) goes as a scalar, one register.
  bounds_in = tuple(jnp.asarray(x, jnp.int32) for x in (lo, hi) if x is not None)
  kinds = tuple(plgpu.Layout.WG_SPLAT if x.ndim == 0 else layout.reduce(1)
                for x in bounds_in)
  bounds_in = tuple(x if x.ndim == 0 else plgpu.layout_cast(x, k)
                    for x, k in zip(bounds_in, kinds))

  @plgpu.inline_mgpu(arg_types=(layout, *kinds),
                     return_type=plgpu.ShapeDtypeStruct(s.shape, jnp.float32, layout=layout))
  def masked(_, s, *bounds_regs):
    i32, f32 = ir.IntegerType.get_signless(32), ir.F32Type.get()
    # WGMMA_LAYOUT: register (0, j, 0, 0, h, 0, 0, 0, 0), a vector of 2, holds rows
    # r + 8h and columns c + 8j, c + 8j + 1 of the thread's (r, c): register 0's.
    assert s.layout == mgpu.WGMMA_LAYOUT and s.registers.shape == (
        1, cols // 8, 1, 1, 2, 1, 1, 1, 1), (s.layout, s.registers.shape)
    _, col0 = next(iter(mgpu.WGMMA_LAYOUT.thread_idxs(s.shape)))
    col0 = arith.index_cast(i32, col0)

    def bounds(x):
      if not x.registers.shape:
        return [arith.subi(x.registers[()], col0)] * 2
      assert x.registers.shape == (1, 1, 2, 1, 1), x.registers.shape
      regs = [x.registers[0, 0, h, 0, 0] for h in range(2)]
      regs = [vector.extract(r, dynamic_position=[], static_position=[0])
              if isinstance(r.type, ir.VectorType) else r for r in regs]
      return [arith.subi(r, col0) for r in regs]

    *lo_h, hi_h = [bounds(x) for x in bounds_regs]
    lo_h = lo_h[0] if lo_h else None
    hidden = arith.constant(f32, float("-inf"))
    out = np.empty(s.registers.shape, dtype=object)
    for idx in np.ndindex(s.registers.shape):
      j, h = idx[1], idx[4]
      reg = s.registers[idx]
      for e in range(2):
        k = arith.constant(i32, 8 * j + e)
        above = None if lo_h is None else arith.cmpi(arith.CmpIPredicate.sle, lo_h[h], k)
        below = arith.cmpi(arith.CmpIPredicate.sgt, hi_h[h], k)
        seen = below if above is None else arith.andi(above, below)
        x = vector.extract(reg, dynamic_position=[], static_position=[e])
        reg = vector.insert(arith.select(seen, x, hidden), reg, dynamic_position=[],
                            static_position=[e])
      out[idx] = reg
    return mgpu.FragmentedArray(_registers=out, _layout=mgpu.WGMMA_LAYOUT, _is_signed=None)

  return masked(s, *bounds_in)


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


def read_only_ref() -> plgpu.RefType:
  """``inline_mgpu``'s type of a ref argument that the inlined code only reads. jax 0.12.1
  refuses a kernel whose inlined code may write to an input passed as an array, and
  ``RefType()`` says it may; ``RefType(write=False)`` says it does not. jax 0.11's
  ``RefType`` has no such field (and no such check): there the plain one."""
  fields = getattr(plgpu.RefType, "__dataclass_fields__", {})
  return plgpu.RefType(write=False) if "write" in fields else plgpu.RefType()


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


# ``store_zero_rows``' store: 16 bytes of zeros at a global address when a row index is
# below the row count, streaming (``.cs``: evict first from L2, as nothing reads them).
_ZERO_STORE_PTX = """{
  .reg .pred p;
  .reg .b64 a;
  setp.lt.s32 p, $1, $2;
  cvta.to.global.u64 a, $0;
  @p st.global.cs.v4.b32 [a], {$3, $3, $3, $3};
}"""


def _store_zeros(o_ref, values, *, max_rows: int, addresses, name: str):
  """Zeros from the warpgroup's 128 threads into ``o_ref`` (the output, [rows, heads,
  depth] in global memory) with plain 16-byte vector stores (``_ZERO_STORE_PTX``), not
  TMA, left in flight (the kernel's end makes them visible): thread t's m-th store is
  16-byte chunk c = t + 128 m of at most max_rows head rows' worth, at the address
  ``addresses`` gives. ``addresses(base, values, k)`` (base: o's address as an i64,
  ``values``: the int32 scalars as registers, ``k``: the constants below) returns a
  function of c giving (address, index, count): the store happens when index < count.
  A head row's depth * itemsize bytes must be a multiple of 16."""
  _, heads, depth = o_ref.shape
  row_bytes = depth * jnp.dtype(o_ref.dtype).itemsize
  if row_bytes % 16:
    raise ValueError(f"{name}: a row of {row_bytes} bytes is not whole 16-byte stores")
  per_row = row_bytes // 16
  per_thread = -(-max_rows * per_row // 128)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),) + (plgpu.Layout.WG_SPLAT,) * len(values))
  def zeros(_, o, *values):
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    values = [x.registers[()] for x in values]
    const = lambda v, t=i32: arith.constant(t, v)  # noqa: E731
    tid = arith.remui(mgpu.utils.thread_idx(), const(128))
    base = llvm.ptrtoint(i64, mgpu.utils.memref_ptr(o))
    k = types.SimpleNamespace(const=const, i64=i64, heads=heads, row_bytes=row_bytes,
                              per_row=per_row)
    at = addresses(base, values, k)
    zero = const(0)
    void = ir.Type.parse("!llvm.void")
    for m in range(per_thread):
      address, index, count = at(arith.addi(tid, const(128 * m)))
      llvm.inline_asm(void, [address, index, count, zero], _ZERO_STORE_PTX, "l,r,r,r",
                      has_side_effects=True)

  zeros(o_ref, *(jnp.asarray(v, jnp.int32) for v in values))


def store_zero_rows(o_ref, start, n, h, *, max_rows: int):
  """Zeros into rows [start, start + n) of head h of ``o_ref`` (the output, [rows, heads,
  depth] in global memory; 0 <= n <= max_rows, rows within the array) by the
  warpgroup's 128 threads (``_store_zeros``)."""

  def addresses(base, values, k):
    start, n, h = values

    def at(c):
      r = arith.divui(c, k.const(k.per_row))
      col = arith.remui(c, k.const(k.per_row))
      row_head = arith.addi(arith.muli(arith.addi(start, r), k.const(k.heads)), h)
      offset = arith.addi(
          arith.muli(arith.extsi(k.i64, row_head), k.const(k.row_bytes, k.i64)),
          arith.muli(arith.extui(k.i64, col), k.const(16, k.i64)))
      return arith.addi(base, offset), r, n
    return at

  _store_zeros(o_ref, (start, n, h), max_rows=max_rows, addresses=addresses,
               name="store_zero_rows")


def store_zero_slices(o_ref, row, first, n, *, max_slices: int):
  """Zeros into head slices [first, first + n) counted from row ``row``'s first of
  ``o_ref`` (the output, [rows, heads, depth] in global memory: slice i is head i % heads
  of row row + i // heads; 0 <= n <= max_slices, within the array) by the warpgroup's 128
  threads (``_store_zeros``), one contiguous run of bytes
  (``MosaicOptions.keyless_units="spans"``)."""

  def addresses(base, values, k):
    row, first, n = values
    start = arith.addi(
        base, arith.addi(
            arith.muli(arith.extsi(k.i64, row), k.const(k.heads * k.row_bytes, k.i64)),
            arith.muli(arith.extsi(k.i64, first), k.const(k.row_bytes, k.i64))))
    n_chunks = arith.muli(n, k.const(k.per_row))
    return lambda c: (arith.addi(start, arith.muli(arith.extui(k.i64, c),
                                                   k.const(16, k.i64))), c, n_chunks)

  _store_zeros(o_ref, (row, first, n), max_rows=max_slices, addresses=addresses,
               name="store_zero_slices")


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


# FP8's V^T from V in the kernel (``MosaicOptions.fp8_vt_in_kernel``): the producer
# warpgroup transposes each V tile in shared memory, FlashAttention-3's way (4-byte loads,
# byte permutes, 4-byte stores). A V^T buffer is 64 rows (V's columns) of ``VT_GROUP`` keys,
# 128 bytes a row with TMA's 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)),
# the matrix products' B operand. A thread's unit is 4 of V's columns x 4 keys: 4 loads
# (one key's 4 columns each) from the untiled V tile (64-byte rows), 8 permutes, 4 stores
# (one column's 4 keys each); 512 units a buffer, 4 a thread.
VT_UNITS = 4  # units a thread per V^T buffer (512 / 128 threads)
_PRMT_SWAP = 0x4444  # turns a permute's selector into the one with its operands swapped


def vt_unit(lane, warp, j, *, p_order: bool):
  """Unit j of a producer thread (``lane`` 0..31 of warp ``warp`` 0..3 of the warpgroup),
  in the compact form ``_vt_unit_ptx`` takes (few live registers: the producer has 40):
  (a, b, dq, dst, swz, sel, byte_keys). Its 4 loads are keys a, b, a + step, b + step
  (``vt_unit_step``; byte 64 * key + 4 * dq of the V tile), its 4 stores (V^T row
  4 dq + r, r = 0..3) at byte dst + 128 r + (swz ^ 16 r) of the swizzled V^T buffer;
  ``sel`` is its first permutes' selector (the second's is sel ^ 0x2222), ``byte_keys``
  the keys of each stored word's bytes (V^T's columns 4 * lane + 0..3). Plain integer
  arithmetic (+, -, *, &, ^, <<, >>), so that the kernel runs it on MLIR values
  (``_I32``) and the tests on NumPy arrays (``vt_unit_addresses``), and check there:
  every (column, key) pair stored once, and no shared-memory bank conflict at any load
  or store (lanes 16-31 load their keys in swapped pairs, so that a warp's 32 loads fall
  on rows of both parities; their permutes swap back).

  The keys of a thread's stored bytes are in ``fp8_p_key``'s order with ``p_order``
  (16G + 2q + (0, 1, 8, 9), G = lane / 4, q = lane % 4), else consecutive."""
  half = lane >> 4
  dq = (lane + 4 * warp + j) & 15  # the unit's columns of V: 4dq .. 4dq + 3
  g16, q = lane >> 2, lane & 3
  base = 16 * g16 + 2 * q if p_order else 16 * g16 + 4 * q
  step = vt_unit_step(p_order)
  byte_keys = [base, base + 1, base + step, base + step + 1]
  # Row 4dq + r's 16-byte chunk: G ^ ((4dq + r) % 8) = (G ^ 4 (dq % 2)) ^ r (r < 4)
  swz = (g16 ^ (4 * (dq & 1))) << 4
  dst = 4 * L.VT_GROUP * dq + 4 * q
  a = base + half  # lanes 16-31: keys base + 1, base first
  return a, base + 1 - half, dq, dst, swz, 0x5140 ^ (half * _PRMT_SWAP), byte_keys


def vt_unit_step(p_order: bool) -> int:
  """The keys between a unit's two pairs (``vt_unit``)."""
  return 8 if p_order else 2


def vt_unit_addresses(unit, *, p_order: bool):
  """``vt_unit``'s unit expanded as ``_vt_unit_ptx`` does: (keys in load order, byte
  offsets of the 4 stores, r = 0..3)."""
  a, b, _, dst, swz, _, _ = unit
  step = vt_unit_step(p_order)
  return ([a, b, a + step, b + step],
          [dst + L.VT_GROUP * r + (swz ^ (16 * r)) for r in range(4)])


def _vt_unit_ptx(step_bytes: int) -> str:
  """One unit (``vt_unit``): $0 and $1 the load addresses of keys a and b, the other two
  ``step_bytes`` on; $2 the store base (dst), $3 the swizzle bits (swz), $4 the first
  permutes' selector, $5 the mask of the keys that are the sequence's (0xFF a byte)."""
  lines = ["{", ".reg .b32 w0, w1, w2, w3, t0, t1, t2, t3, o, s, a;",
           "ld.shared.b32 w0, [$0];", "ld.shared.b32 w1, [$1];",
           f"ld.shared.b32 w2, [$0+{step_bytes}];", f"ld.shared.b32 w3, [$1+{step_bytes}];",
           "xor.b32 s, $4, 0x2222;",
           "prmt.b32 t0, w0, w1, $4;", "prmt.b32 t1, w0, w1, s;",
           "prmt.b32 t2, w2, w3, $4;", "prmt.b32 t3, w2, w3, s;"]
  for r, (x, y, sel) in enumerate([("t0", "t2", "0x5410"), ("t0", "t2", "0x7632"),
                                   ("t1", "t3", "0x5410"), ("t1", "t3", "0x7632")]):
    lines += [f"prmt.b32 o, {x}, {y}, {sel};", "and.b32 o, o, $5;",
              f"xor.b32 a, $3, {16 * r};", "add.u32 a, a, $2;",
              f"st.shared.b32 [a+{L.VT_GROUP * r}], o;"]
  return "\n".join(lines + ["}"])


def prmt_model(a, b, selector):
  """PTX ``prmt.b32`` (default mode) in NumPy: byte i of the result is byte
  (selector >> 4i) & 7 of the 8 bytes b:a (a's are 0-3)."""
  a, b, selector = (np.asarray(x, np.uint64) for x in (a, b, selector))
  both = a | (b << np.uint64(32))
  out = np.zeros(np.broadcast(a, b, selector).shape, np.uint64)
  for i in range(4):
    pick = (selector >> np.uint64(4 * i)) & np.uint64(7)
    out |= ((both >> (pick * np.uint64(8))) & np.uint64(0xFF)) << np.uint64(8 * i)
  return out.astype(np.uint32)


def vt_unit_model(words, selectors):
  """``_vt_unit_ptx``'s permutes in NumPy: the 4 loaded words (any shape each) and the
  first permutes' selectors -> the 4 stored words (before the mask)."""
  w0, w1, w2, w3 = words
  lo, hi = selectors
  t0, t1 = prmt_model(w0, w1, lo), prmt_model(w0, w1, hi)
  t2, t3 = prmt_model(w2, w3, lo), prmt_model(w2, w3, hi)
  return [prmt_model(t0, t2, 0x5410), prmt_model(t0, t2, 0x7632),
          prmt_model(t1, t3, 0x5410), prmt_model(t1, t3, 0x7632)]


class _I32:
  """An i32 MLIR value with the integer operators ``vt_unit`` uses."""

  def __init__(self, value):
    self.v = value

  @staticmethod
  def of(x):
    if isinstance(x, _I32):
      return x.v
    return arith.constant(ir.IntegerType.get_signless(32), int(x))

  def _op(self, op, other, swap=False):
    a, b = self.v, _I32.of(other)
    return _I32(op(b, a) if swap else op(a, b))

  __add__ = lambda s, o: s._op(arith.addi, o)  # noqa: E731
  __sub__ = lambda s, o: s._op(arith.subi, o)  # noqa: E731
  __radd__ = lambda s, o: s._op(arith.addi, o, True)  # noqa: E731
  __mul__ = lambda s, o: s._op(arith.muli, o)  # noqa: E731
  __rmul__ = lambda s, o: s._op(arith.muli, o, True)  # noqa: E731
  __and__ = lambda s, o: s._op(arith.andi, o)  # noqa: E731
  __xor__ = lambda s, o: s._op(arith.xori, o)  # noqa: E731
  __rxor__ = lambda s, o: s._op(arith.xori, o, True)  # noqa: E731
  __rshift__ = lambda s, o: s._op(arith.shrui, o)  # noqa: E731
  __lshift__ = lambda s, o: s._op(arith.shli, o)  # noqa: E731


def _smem_address(ref):
  """The 32-bit shared-memory address of a shared-memory memref's first element."""
  try:  # jax 0.11: the address space is an argument
    ptr = mgpu.utils.memref_ptr(ref, memory_space=3)
  except TypeError:  # later: read from the memref's type
    ptr = mgpu.utils.memref_ptr(ref)
  return llvm.ptrtoint(ir.IntegerType.get_signless(32), ptr)


def transpose_v_tile(raw, vt, slot, lo, hi, *, groups: int, p_order: bool):
  """FP8: V^T of K/V slot ``slot`` from its V tile, by the producer warpgroup (all of its
  threads; ``vt_unit``). ``raw``: one 64-column chunk of V tiles, [slots, block_kv, 64]
  untiled, as TMA filled it; ``vt``: that chunk's V^T buffers, [slots * groups, 64,
  L.VT_GROUP], an untransformed view of the swizzled bytes the matrix products read.
  The tile's keys outside [lo, hi) (traced int32, tile rows) are stored as zeros: a
  neighbour's, padding or stale cache rows may hold NaN, and 0 * NaN would reach P.V. The
  caller fences the stores for the matrix products (``plgpu.commit_smem``)."""

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(), plgpu.Layout.WG_SPLAT,
                                plgpu.Layout.WG_SPLAT, plgpu.Layout.WG_SPLAT))
  def transpose(_, raw_ref, vt_ref, s, a, b):
    i32 = ir.IntegerType.get_signless(32)
    s, a, b = (x.registers[()] for x in (s, a, b))
    tid = _I32(arith.remui(mgpu.utils.thread_idx(), arith.constant(i32, 128)))
    lane, warp = tid & 31, tid >> 5
    block_kv = ir.MemRefType(raw_ref.type).shape[1]
    raw_base = _I32(_smem_address(raw_ref)) + _I32(s) * (block_kv * 64)
    vt_base = _I32(_smem_address(vt_ref)) + _I32(s) * (groups * 64 * L.VT_GROUP)
    void = ir.Type.parse("!llvm.void")
    step_bytes = 64 * vt_unit_step(p_order)
    for g in range(groups):
      mask = None
      for j in range(VT_UNITS):
        a_key, b_key, dq, dst, swz, sel, byte_keys = vt_unit(lane, warp, j, p_order=p_order)
        if mask is None:  # (the keys depend on the lane only)
          mask = _I32(arith.constant(i32, 0))
          for i, key in enumerate(byte_keys):
            k = (key + g * L.VT_GROUP).v
            live = arith.andi(arith.cmpi(arith.CmpIPredicate.sge, k, a),
                              arith.cmpi(arith.CmpIPredicate.slt, k, b))
            byte = arith.select(live, arith.constant(i32, 0xFF << (8 * i)),
                                arith.constant(i32, 0))
            mask = _I32(arith.ori(mask.v, byte))
        src = [(raw_base + (key + g * L.VT_GROUP) * 64 + 4 * dq).v for key in (a_key, b_key)]
        llvm.inline_asm(void, [*src, (vt_base + g * 64 * L.VT_GROUP + dst).v, swz.v, sel.v,
                               mask.v], _vt_unit_ptx(step_bytes), ",".join(["r"] * 6),
                        has_side_effects=True)

  transpose(raw, vt, jnp.asarray(slot, jnp.int32), jnp.asarray(lo, jnp.int32),
            jnp.asarray(hi, jnp.int32))

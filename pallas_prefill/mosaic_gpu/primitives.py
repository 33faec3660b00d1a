"""Mosaic GPU primitives the kernel needs that Pallas does not expose: PTX named barriers
with a traced id, a fused multiply-add before ``ex2.approx``, the atomic claim of the next
unit, the two-copy TMA of a row range whose last 8 rows may come from elsewhere, zeros
stored without TMA (``store_zero_rows``) and zeros copied by the TMA unit from a buffer
of zeros without a tensor map (``copy_zero_slices``)."""

from __future__ import annotations

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


def exp2_fma(s, scale, neg_m):
  """exp2(s * scale + neg_m) for scores s [rows, cols] in the WGMMA layout, a scale (a
  Python float, or a traced float32 scalar: FP8's per-item factor) and neg_m [rows, cols]
  (a row vector broadcast): one fused multiply-add and one ``ex2.approx``
  per element (Mosaic GPU emits a multiplication and an addition as two instructions).
  (Part of the exp2s as a polynomial on the FMA pipes, FlashAttention-4's trick, lost on
  the H200 at every fraction: BUILD_NOTES.md, nineteenth session;
  ``benchmarks/results/archive/wip-poly-exp2-fp8-vt-in-kernel.patch``.)"""

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
    return y.exp2(approx=True)

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


# ``copy_zero_slices``' copy: $2 bytes (a multiple of 16, none where not positive) from
# shared address $1 to global address $0 (both 16-byte aligned) by the TMA unit, in the
# thread's current bulk group.
_ZERO_BULK_PTX = """{
  .reg .pred p;
  .reg .b64 a;
  setp.gt.s32 p, $2, 0;
  cvta.to.global.u64 a, $0;
  @p cp.async.bulk.global.shared::cta.bulk_group [a], [$1], $2;
}"""


def fill_zeros(smem_ref):
  """Zeros into ``smem_ref`` (shared memory, untransformed, a multiple of 2 KB) by the
  warpgroup's 128 threads, 16 bytes a store; ``plgpu.commit_smem()`` after it makes them
  visible to the TMA unit (``copy_zero_slices``)."""
  size = int(np.prod(smem_ref.shape)) * jnp.dtype(smem_ref.dtype).itemsize
  if size % (16 * 128):
    raise ValueError(f"fill_zeros: {size} bytes are not whole 16-byte stores per thread")

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),))
  def fill(_, z):
    i32 = ir.IntegerType.get_signless(32)
    tid = arith.remui(mgpu.utils.thread_idx(), arith.constant(i32, 128))
    base = arith.addi(llvm.ptrtoint(i32, mgpu.utils.memref_ptr(z)),
                      arith.muli(tid, arith.constant(i32, 16)))
    zero = arith.constant(i32, 0)
    void = ir.Type.parse("!llvm.void")
    for m in range(size // (16 * 128)):
      llvm.inline_asm(void, [arith.addi(base, arith.constant(i32, 16 * 128 * m)), zero],
                      "st.shared.v4.b32 [$0], {$1, $1, $1, $1};", "r,r",
                      has_side_effects=True)

  fill(smem_ref)


def copy_zero_slices(o_ref, zeros_smem, row, first, n, *, max_slices: int):
  """``store_zero_slices``' zeros (head slices [first, first + n) from row ``row``'s first
  of ``o_ref``, one contiguous run of bytes; 0 <= n <= max_slices) copied by the TMA unit
  from ``zeros_smem`` (zeros in shared memory, fenced for the async proxy: any shape),
  one ``cp.async.bulk`` of at most its size at a time, issued by one thread of the
  warpgroup and committed as one bulk group (``MosaicOptions.keyless_units="bulk"``).
  Nothing waits for them here: the buffer never changes, and the kernel's last
  ``wait_smem_to_gmem`` waits for every group before the block ends."""
  _, heads, depth = o_ref.shape
  row_bytes = depth * jnp.dtype(o_ref.dtype).itemsize
  zero_bytes = int(np.prod(zeros_smem.shape)) * jnp.dtype(zeros_smem.dtype).itemsize
  if row_bytes % 16 or zero_bytes % 16:
    raise ValueError(f"copy_zero_slices: rows of {row_bytes} bytes or a buffer of "
                     f"{zero_bytes} bytes are not whole 16-byte pieces")
  copies = -(-max_slices * row_bytes // zero_bytes)

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType())
                     + (plgpu.Layout.WG_SPLAT,) * 3)
  def zeros(_, o, z, row, first, n):
    i32, i64 = ir.IntegerType.get_signless(32), ir.IntegerType.get_signless(64)
    row, first, n = (x.registers[()] for x in (row, first, n))
    void = ir.Type.parse("!llvm.void")
    with mgpu.utils.single_thread(scope=mgpu.utils.ThreadSubset.WARPGROUP):
      src = llvm.ptrtoint(i32, mgpu.utils.memref_ptr(z))
      start = arith.addi(
          llvm.ptrtoint(i64, mgpu.utils.memref_ptr(o)),
          arith.muli(arith.extsi(i64, arith.addi(
              arith.muli(row, arith.constant(i32, heads)), first)),
                     arith.constant(i64, row_bytes)))
      total = arith.muli(n, arith.constant(i32, row_bytes))
      for c in range(copies):
        offset = c * zero_bytes
        size = arith.minsi(arith.subi(total, arith.constant(i32, offset)),
                           arith.constant(i32, zero_bytes))
        llvm.inline_asm(void, [arith.addi(start, arith.constant(i64, offset)), src, size],
                        _ZERO_BULK_PTX, "l,r,r", has_side_effects=True)
      llvm.inline_asm(void, [], "cp.async.bulk.commit_group;", "", has_side_effects=True)

  zeros(o_ref, zeros_smem, *(jnp.asarray(v, jnp.int32) for v in (row, first, n)))


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

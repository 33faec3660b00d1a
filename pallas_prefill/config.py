"""Kernel tiling configuration and the per-device defaults that ``config=None`` picks."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_prefill.fp8 import is_fp8
from pallas_prefill.tuned import TUNED, TUNED_MOSAIC


def _is_int(x) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def _is_pow2(x) -> bool:
  return _is_int(x) and x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class MhaConfig:
  """Tiling of the ragged attention kernels (MHA and MLA).

  Attributes:
    block_q: query rows per program; a power of two, at least 16.
    block_kv: key/value rows per inner-loop step; a power of two, at least 16.
    num_warps: warps per program (1, 2, 4, 8 or 16).
    num_stages: software-pipelining depth of the KV loop on the GPU (>= 1).
  """

  block_q: int = 64
  block_kv: int = 64
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    for name in ("block_q", "block_kv"):
      value = getattr(self, name)
      if not _is_pow2(value) or value < 16:
        raise ValueError(f"MhaConfig.{name} must be a power of two >= 16, got {value!r}")
    if not _is_int(self.num_warps) or self.num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"MhaConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps!r}")
    if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or (
        self.num_stages < 1):
      raise ValueError(f"MhaConfig.num_stages must be an int >= 1, got {self.num_stages!r}")


# ``MosaicOptions.keyless_units``, and those whose key-less items are zero jobs of the
# keyed units (no units of their own where any item is keyed; the wrapper fills in their
# rows' LSE)
KEYLESS_UNITS = ("first", "spread", "per_head", "stores", "spans", "bulk")
ZERO_JOB_UNITS = ("stores", "spans", "bulk")


@dataclasses.dataclass(frozen=True)
class MosaicOptions:
  """Program choices of the Mosaic GPU kernel that A/B runs compare; the defaults are the
  measured winners (BUILD_NOTES.md). Static and hashable: part of ``MosaicConfig`` and so
  of the jit key, so arms of an A/B run can share one process.

  Attributes:
    dynamic: each program claims its next (head, work item) unit from a global counter
      (or takes the one the static zigzag deals it, where that balances better); False:
      the static deal alone.
    head_major: None picks the unit order per call; 1 forces K/V-head-major, 0
      item-major (with ``dynamic``).
    deal: None picks per call whether the units are dealt or claimed; 1 forces dealt, 0
      claimed (with ``dynamic``).
    build_work_list: the work list from one small Mosaic GPU kernel where it serves the
      sizes and no LSE is asked for; False: always XLA's.
    fold_scale: the softmax scale folded into its exponent (one FFMA per score) where the
      scale is positive, and with a soft cap the cap (the scale then goes into tanh's
      argument); in FP8 the logits' factor (the item's scales times a positive softmax
      scale, without a soft cap: 1.05x-1.10x the FP8 call on the H200, twenty-third
      session); False: separate multiplications.
    tile_spans_pages: native paged KV tiles larger than a page read consecutive pages (a
      TMA copy from each); False cuts ``block_kv`` to the page.
    skip_keyless_q: a unit with no KV tile (the padding rows of ``dot_product_attention``,
      rows past the last offset, queries that see no key) loads no Q tile and waits for
      none: it only stores its zeros (issue 23; padded skew16_16k 1.07x-1.09x on the
      H200, BUILD_NOTES.md). False: every unit loads its Q tile.
    keyless_units: how the work items with no KV tile (padding rows, rows past the last
      offset, queries that see no key) run. "first": one unit per item for all heads
      (a compute warpgroup fills its output buffers with zeros once and stores them to
      every head's rows), those units before the others, so that their stores overlap
      the other programs' matrix products instead of ending the call (issue 23,
      ``schedule.unit_of``); "spread": the same units dealt evenly among the others;
      "per_head": a unit per (head, item), after the others, each storing its own zeros
      (the kernel before the twentieth session); "stores": no units of their own where
      any item has KV tiles: each (head, key-less item) is a zero job, which the compute
      warpgroups of the keyed unit the job falls to (``schedule.zero_jobs``) do after
      that unit's epilogue with plain vector stores (``primitives.store_zero_rows``, no
      TMA: the SM's TMA unit keeps loading K/V), so that the zeros spread thinly over
      the whole call (with the LSE, the wrapper fills in the key-less rows' LSE:
      ``mosaic_gpu.gathered_lse``); "first" with split units, or at run time when no
      item has a KV tile (issue 23, thirty-seventh and forty-first sessions). "spans":
      "stores" with each job a contiguous span of the item's rows across all heads
      (``kernel.zero_span``: 16 KB a warpgroup in one piece) instead of one head's rows
      (256-byte pieces a row's heads apart): on the H100 1.020x-1.033x "stores" on
      padded MHA short64, 0.96x-1.00x on skew16_16k (forty-fifth and forty-sixth
      sessions). "bulk": the jobs of "spans", each copied by the TMA unit from a
      buffer of zeros in shared memory (``primitives.copy_zero_slices``: one
      ``cp.async.bulk`` per 8 KB from one thread, instead of 128 threads' vector stores),
      so that the compute warpgroups issue a few instructions a job and wait for none:
      on the H100 1.065x-1.068x "stores" on padded MHA skew16_16k, 1.024x "spans" on
      short64 (forty-seventh session). "first" in a ``MosaicOptions()`` made by hand;
      ``config=None`` picks, for ``dot_product_attention``, "bulk" with two compute
      warpgroups at depth 128, else "spans" up to ``COLUMN_MASK_MAX_PROMPT`` and
      "stores" above (``default_mosaic_config``'s ``padded``).
    batch_invariant: KV tile i of a sequence starts at its first key plus i * block_kv,
      wherever the sequence sits in the packed arrays, so that a sequence's output and LSE
      are bitwise the same whatever its neighbours (the online softmax then sums the
      same keys in the same tiles); False: tiles start at the first key rounded down to
      8 rows, the last one shifted back to end in the 8-row group of the last key (the
      kernel before issue 25). FP8 keeps aligned tiles (its V^T tiles start at multiples
      of 16 keys, TMA's alignment) and so is not batch invariant.
    fp8_vt_kernel: FP8's V^T (P.V reads V K-major) made by one small Triton-lowered
      Pallas kernel (``operands.transposed_v``: V read once, the rows outside every
      sequence zeroed, written transposed) where V's depth is a power of two; False:
      XLA's transpose (0.06 ms a call on the H200 for 16 MB of V, the fifteenth
      session's entry in BUILD_NOTES.md).
    soft_cap_fixed_max: soft-capped scores lie in [-cap, cap], so the softmax takes a
      fixed maximum (the cap, or less for caps above 41.6: ``kernel.fixed_maximum``)
      instead of the running one: no row maximum, no rescale of the accumulators, per KV
      tile (bf16 with the folded scale, caps up to about 52.7; float16, whose P would
      flush small probabilities, FP8 and larger caps keep the running maximum). False:
      the running maximum.
    soft_cap_scaled_q: with a soft cap, each unit's Q tile is multiplied by scale / cap
      in shared memory once, before its first Q.K (rounded to bf16 there), so that the
      scores go straight into tanh: one FMUL less per score (bf16 with the folded scale;
      float16, whose small values would go subnormal, and FP8 keep the multiplication
      per score): on the H200 1.028x / 1.005x the capped call (MHA equal4x4096 /
      skew16_16k; BUILD_NOTES.md, twenty-third session), relative error 3.1e-3 against
      2.5e-3. False: the multiplication per score.
    fp8_native_pages: FP8 pages of ``layout.MIN_NATIVE_PAGE`` rows or more (and a V depth
      that is a power of two) are read in place, as bf16 pages are: K tiles by TMA from
      the pages the block table names, V^T from one small Triton-lowered kernel that
      moves only the sequences' keys (``operands.transposed_v_pages``). False: the whole
      block table's capacity gathered into contiguous K/V first, then V^T from that
      (``operands.gathered_pages``; smaller pages always are).
    fp8_p_registers: FP8's P.V takes P as its A operand from registers
      (``primitives.fp8_a_operand``: each thread's quantized P relabelled in place into
      the FP8 operand layout, and V^T's keys stored in that order by
      ``operands.transposed_v``), instead of storing P to shared memory and fencing it
      per KV tile: 1.085x the FP8 call on the H200 (MHA equal4x4096, skew16_16k,
      short64; MLA 1.085x-1.087x; BUILD_NOTES.md, twenty-third session). False: P
      through shared memory.
    row_sum_first: bf16/float16 P's row sums taken before its conversion to the input
      dtype (each float32 of P then dies as it is converted), not after: fewer live
      registers where P meets the accumulators, for three compute warpgroups' 160.
    q_per_tile: the Q buffers' matrix-product descriptors made again in each KV tile
      (through an index LLVM cannot see, ``primitives.opaque``) instead of hoisted out
      of the KV loop into 16 registers held across it: a few instructions a tile for
      fewer live registers, for three compute warpgroups' 160.
    column_mask: a masked KV tile's scores hidden by each row's run of visible columns
      (``masks``' ``key_range``; ``primitives.mask_columns``: each score compared with
      an immediate) instead of the mask's test on position iotas, whose column indices
      LLVM hoists out of the KV loop (31 registers held across it). The same scores
      hidden, so the same output bits. Off in a ``MosaicOptions()`` made by hand;
      ``config=None`` turns it on for prompts up to ``COLUMN_MASK_MAX_PROMPT`` (on the
      H200 1.04x-1.09x on short64, MHA, MLA and FP8; 0.97x-0.99x on MHA's long prompts,
      where ptxas schedules the unmasked tiles' loop a little worse: BUILD_NOTES.md).
    column_lo_static: with ``column_mask``, where the mask's visible keys start at
      position 0 for every query (``masks.key_range_starts_at_zero``: the null and causal
      masks) and KV tiles start at the sequence's first key (``batch_invariant``, bf16
      and float16), no tile shows a row a key before its first column, so each score is
      compared with the row's upper bound only: one compare and one AND fewer per masked
      score (about 64 of a masked tile's 294 instructions between the Q.K wait and the
      first exp2 on the H200's MHA kernel). The same scores hidden, so the same bits.
      Off in ``MosaicOptions()``; ``config=None`` turns it on with the short prompts'
      column mask (on the H100 1.024x on MHA short64, 1.013x on MLA's, 1.002x on MHA
      chunked8x512_page64: BUILD_NOTES.md, thirty-fourth session).
    narrow_last_tile: a warpgroup's last KV tile of a unit, where its rows see none of
      the tile's second half (the first warpgroup's causal diagonal tile, a sequence's
      last keys), runs as a 64-key tile: Q.K, the softmax and P.V on the tile's first
      half only (``kernel.narrow_last``). The hidden half adds exact zeros, so the same
      output bits. bf16 and float16 with 128-key tiles (not FP8, not split units). Off
      in ``MosaicOptions()``; ``config=None`` turns it on with the short prompts' column
      mask at depth 128 (on the H100 1.014x-1.026x on MHA short64, 1.012x-1.018x on
      skew16_16k, MLA short64 level, MHA long16384 with three warpgroups 0.946x:
      BUILD_NOTES.md, thirty-fifth session).
    work_list_shuffles: the work list's kernel (``build_work_list``) exchanges lanes that
      one thread or one warp holds without shared memory (``work_items.Ops``): its
      bitonic sort's steps between lanes 128 or more apart as a relabelling of each
      thread's registers, those fewer than 32 apart as warp butterflies, and its prefix
      scans in two levels (warp shuffles, then each warp's carry from the others' totals
      through shared memory once). The same table and scalars. Each exchange through
      shared memory costs two warpgroup barriers: a 512-lane work list's kernel goes from
      168 to 40 (``test_work_list_shuffles_leave_shared_memory``). The padded calls' lists
      are the long ones (padded MHA skew16_16k's is 1024 lanes, against the packed
      call's 256). On: ncu put the kernel 0.9-1.4 us faster on each of packed and padded
      MHA skew16_16k and short64 (an H100: 10.2 -> 9.4, 26.0 -> 24.6, 10.0 -> 8.9, 14.9
      -> 13.8 us), not the 5-10 us predicted: the barriers were not the kernel's time
      (BUILD_NOTES.md, forty-ninth session).
    work_list_staged_table: the work list's kernel writes its table (items x columns,
      row-major) into shared memory first and then out in the order of its words, so
      that each warp's global stores are 32 consecutive words; without it each store
      instruction writes one column of 32 items, 32 sectors 17 words apart (17 lines).
      The same table. The table's stores are 137 of the padded MHA skew16_16k kernel's
      4972 instructions a warp (17 columns x 8 registers). Off: not yet run on a GPU
      (forty-ninth session).
  """

  dynamic: bool = True
  head_major: int | None = None
  deal: int | None = None
  build_work_list: bool = True
  fold_scale: bool = True
  tile_spans_pages: bool = True
  skip_keyless_q: bool = True
  keyless_units: str = "first"
  batch_invariant: bool = True
  fp8_vt_kernel: bool = True
  soft_cap_fixed_max: bool = True
  soft_cap_scaled_q: bool = True
  fp8_p_registers: bool = True
  fp8_native_pages: bool = True
  row_sum_first: bool = False
  q_per_tile: bool = False
  column_mask: bool = False
  column_lo_static: bool = False
  narrow_last_tile: bool = False
  work_list_shuffles: bool = True
  work_list_staged_table: bool = False

  def __post_init__(self):
    for name in ("dynamic", "build_work_list", "fold_scale", "tile_spans_pages",
                 "skip_keyless_q", "batch_invariant", "fp8_vt_kernel", "soft_cap_fixed_max",
                 "soft_cap_scaled_q", "fp8_p_registers", "fp8_native_pages",
                 "row_sum_first", "q_per_tile", "column_mask",
                 "column_lo_static", "narrow_last_tile", "work_list_shuffles",
                 "work_list_staged_table"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"MosaicOptions.{name} must be a bool, got {getattr(self, name)!r}")
    for name in ("head_major", "deal"):
      value = getattr(self, name)
      if value is not None and (not _is_int(value) or value not in (0, 1)):
        raise ValueError(f"MosaicOptions.{name} must be None, 0 or 1, got {value!r}")
    if self.keyless_units not in KEYLESS_UNITS:
      raise ValueError(f"MosaicOptions.keyless_units must be one of {KEYLESS_UNITS}, got "
                       f"{self.keyless_units!r}")


# FP8's widest K/V tile (``MosaicConfig.block_kv``): FP8 matrix products take twice bf16's
# keys per byte, so a tile of 256 keys costs the shared memory of bf16's 128.
FP8_WIDE_BLOCK_KV = 256


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
  """Tiling of the Mosaic GPU (Hopper) kernels, ``backend="mosaic_gpu"``.

  Attributes:
    block_q: query rows per compute warpgroup (``compute_wgs`` of them a program): 64.
    block_kv: key/value rows per pipeline stage: 64 or 128; or 256 for FP8 (e4m3) with P
      from registers (``MosaicOptions.fp8_p_registers``, the default), whose P.V then runs
      as two products of 128 keys each (a 256-key tile fits shared memory in two stages).
      256 measured 0.82x-0.99x the speed of 128 on the H200 (its scores spill registers:
      BUILD_NOTES.md); the default stays 128.
    num_stages: K/V shared-memory slots the producer warpgroup fills ahead (>= 2).
    num_programs: the persistent kernel's programs (each runs a share of the (head, work
      item) units, one after another); None: one per SM of the GPU. As many as there are
      units (any larger number) gives each program one unit and leaves the scheduling
      to the GPU, as the kernel did before it was persistent.
    split_units: each compute warpgroup runs units of its own (a head and ``block_q``
      query rows, its own K/V stream with ``num_stages`` slots and a producer warpgroup
      of its own) instead of the two sharing one unit of ``2 * block_q`` rows: one's
      stores and pipeline fill then overlap the other's matrix products, which pays on
      short prompts. Twice the K/V buffers: with ``block_kv=64`` and two stages for depth
      128. Opt-in (on the H200 +4 % on short prompts, slower on long ones); needs dynamic
      scheduling (``options.dynamic``, the default), without which the units are shared.
    options: ``MosaicOptions``, the program choices A/B runs compare.
    compute_wgs: compute warpgroups per program, 2 or 3, each with ``block_q`` query
      rows of the program's work item (``compute_wgs * block_q`` rows). Three put three
      softmax chains on each warp scheduler instead of two, for 160 registers a compute
      thread instead of 232 (and 32 for the producer: the 64K of an SM); not with
      ``split_units``. ``config=None`` picks 3 at depth 128 for FP8 and for bf16/float16's
      long prompts (``default_mosaic_config``). Three want ``MosaicOptions``' register
      cuts (``row_sum_first``, ``q_per_tile``, ``column_mask``) in bf16, whose kernel
      otherwise spills registers at 160 (0.5x two).
  """

  block_q: int = 64
  block_kv: int = 128
  num_stages: int = 2
  num_programs: int | None = None
  split_units: bool = False
  options: MosaicOptions = MosaicOptions()
  compute_wgs: int = 2

  def __post_init__(self):
    if not isinstance(self.options, MosaicOptions):
      raise ValueError(f"MosaicConfig.options must be a MosaicOptions, got {self.options!r}")
    if not _is_int(self.block_q) or self.block_q != 64:
      raise ValueError(f"MosaicConfig.block_q must be 64 (one warpgroup's matrix "
                       f"instruction rows), got {self.block_q!r}")
    if not _is_int(self.block_kv) or self.block_kv not in (64, 128, FP8_WIDE_BLOCK_KV):
      raise ValueError(f"MosaicConfig.block_kv must be 64, 128 or (FP8 only) "
                       f"{FP8_WIDE_BLOCK_KV}, got {self.block_kv!r}")
    if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or (
        self.num_stages < 2):
      raise ValueError(f"MosaicConfig.num_stages must be an int >= 2, got "
                       f"{self.num_stages!r}")
    if self.num_programs is not None and (
        isinstance(self.num_programs, bool) or not isinstance(self.num_programs, int)
        or self.num_programs < 1):
      raise ValueError(f"MosaicConfig.num_programs must be None or an int >= 1, got "
                       f"{self.num_programs!r}")
    if not isinstance(self.split_units, bool):
      raise ValueError(f"MosaicConfig.split_units must be a bool, got {self.split_units!r}")
    if not _is_int(self.compute_wgs) or self.compute_wgs not in (2, 3):
      raise ValueError(f"MosaicConfig.compute_wgs must be 2 or 3, got {self.compute_wgs!r}")
    if self.compute_wgs != 2 and self.split_units:
      raise ValueError("MosaicConfig.split_units runs two compute warpgroups (a K/V stream "
                       f"each): compute_wgs must be 2, got {self.compute_wgs}")


LONG_PROMPT = 1024  # max_prompt_len above this picks the "long" tuned entry


def device_kind() -> str:
  """The device being compiled for: an abstract mesh's device (ahead-of-time lowering for
  another GPU) if one is set, else the default device."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None:
    return abstract.device_kind
  return jax.devices()[0].device_kind


def tuned_key(qk_depth, v_depth, dtype, mask, max_prompt_len) -> tuple:
  """The key of ``pallas_prefill.tuned.TUNED`` for a call."""
  return (qk_depth, v_depth, jnp.dtype(dtype).name, type(mask).__name__,
          max_prompt_len > LONG_PROMPT)


def _tuned_entry(tables, qk_depth, v_depth, dtype, mask, max_prompt_len):
  """The entry of `tables` (device kind -> {tuned_key: tuple}) for the device and call: the
  mask's own, else the causal one, else None."""
  table = tables.get(device_kind(), {})
  key = tuned_key(qk_depth, v_depth, dtype, mask, max_prompt_len)
  return table.get(key, table.get(key[:3] + ("CausalMask",) + key[4:]))


# On a paged cache each KV tile costs a block-table read; KV tiles of at least this many
# rows (when the page has them) hide it (measured for bf16 at depth 128, BUILD_NOTES.md).
PAGED_MIN_BLOCK_KV = 64


def _length_free_entry(tables, qk_depth, v_depth, dtype, mask):
  """The tuned entry for the long prompts, else the short prompts' (or None): one for
  every max_prompt_len. The KV tiles decide how a sequence's keys are summed, and so its
  output's bits, which must not depend on the batch's longest prompt
  (``MosaicOptions.batch_invariant``)."""
  entry = functools.partial(_tuned_entry, tables, qk_depth, v_depth, dtype, mask)
  long = entry(LONG_PROMPT + 1)
  return long if long is not None else entry(1)


def default_mosaic_config(qk_depth: int, v_depth: int, dtype, mask,
                          max_prompt_len: int, soft_cap: bool = False,
                          padded: bool = False) -> MosaicConfig:
  """The Mosaic GPU configuration ``config=None`` uses. Its tiles are the same for every
  ``max_prompt_len`` (batch invariance: ``_length_free_entry``): the tuned entry for the
  device, else 128-row K/V tiles in two stages, or 64-row tiles in three where 128 rows
  of K and V would not fit shared memory twice over (MLA's 192 + 128).

  Compute warpgroups (``MosaicConfig.compute_wgs``): FP8 (e4m3) at depth 128 (MHA's)
  runs three (on the H200 1.02x-1.07x two on the harness's MHA workloads). bf16/float16
  at depth 128 runs three, with ``MosaicOptions``' register cuts, for long prompts
  (``max_prompt_len > THREE_WGS_MIN_PROMPT``: 1.03x two on MHA long16384 on the H200
  and the H100), and with a soft cap (``soft_cap``, a call's ``logits_soft_cap``) above
  ``COLUMN_MASK_MAX_PROMPT`` (1.07x-1.09x on MHA equal4x4096 on the H100, level on
  skew16_16k), where a third softmax chain per warp scheduler hides more of the cap's
  tanh; two elsewhere (three lose on short prompts: 0.85x-0.93x). Both counts sum a
  row's scores the same way (``MosaicOptions.row_sum_first``, on at every length there),
  so a row's output bits do not depend on the batch's longest prompt (``tests/test_gpu.py``).
  MLA's 192 + 128 keeps two (0.95x-1.00x in FP8).

  Short prompts (``max_prompt_len <= COLUMN_MASK_MAX_PROMPT``) mask their tiles by
  columns (``MosaicOptions.column_mask``), which hides the same scores as the position
  test and so changes no output bit (``tests/test_gpu.py``): on the H200 1.05x on MHA
  short64, where most tiles are masked, 1.04x on MLA's and 1.09x on FP8's, against
  0.97x-0.99x on MHA's long prompts (BUILD_NOTES.md, thirty-first session); with the
  lower compare dropped where the mask allows (``MosaicOptions.column_lo_static``, the
  same bits again: 1.02x more on MHA short64 on the H100), and at depth 128 (MHA) a
  warpgroup's last tile as its first 64 keys where that holds its keys
  (``MosaicOptions.narrow_last_tile``, the same bits: 1.014x-1.026x on MHA short64 on
  the H100; 0.95x with three warpgroups on long16384, so short prompts only).

  ``padded``: the call is ``dot_product_attention``'s, whose padding rows are work items
  without keys: in bf16/float16 their zeros go as zero jobs to the keyed units
  (``MosaicOptions.keyless_units="stores"``): with two compute warpgroups, on the H100
  1.079x "first" on padded MHA skew16_16k, 1.039x on short64, 1.026x on equal4x4096 (no
  padding row), on the H200 1.031x and 1.007x; with three, on the H100 1.097x, 1.233x
  and 1.022x. Up to ``COLUMN_MASK_MAX_PROMPT`` the jobs are contiguous spans of an item's
  rows across heads (``keyless_units="spans"``): on the H100 1.020x-1.033x "stores" on
  padded MHA short64 in three runs, but 0.96x-1.00x on skew16_16k, so short prompts
  only. With two compute warpgroups at depth 128 (MHA's) the jobs are those spans copied
  by the TMA unit from a buffer of zeros (``keyless_units="bulk"``): on the H100 1.065x /
  1.068x "stores" on padded MHA skew16_16k in two processes (1.11x the packed time
  against 1.17x-1.19x) and 1.024x "spans" on short64. FP8 keeps "first" (on the H100
  "stores" 1.073x on skew16_16k but 0.976x on short64 and 0.973x on equal4x4096).
  (BUILD_NOTES.md, thirty-seventh, fortieth, forty-first, forty-sixth and forty-seventh
  sessions.) The packed entry points keep "first": their
  calls rarely have key-less items, and "stores" costs them 1-3 %."""
  config = _default_tiles(qk_depth, v_depth, dtype, mask)
  if _three_wgs_serve(qk_depth, v_depth, dtype, config):
    # Two warpgroups and three give a row the same bits only with the sums first in both.
    config = dataclasses.replace(config, options=dataclasses.replace(
        config.options, row_sum_first=True))
    if max_prompt_len > (COLUMN_MASK_MAX_PROMPT if soft_cap else THREE_WGS_MIN_PROMPT):
      config = dataclasses.replace(config, compute_wgs=3, options=dataclasses.replace(
          config.options, q_per_tile=True, column_mask=True))
  if max_prompt_len <= COLUMN_MASK_MAX_PROMPT:
    # (narrow last tiles measured at MHA's depth 128 only; they lose with three
    # warpgroups on long prompts)
    narrow = not is_fp8(dtype) and qk_depth == v_depth == 128 and config.block_kv == 128
    config = dataclasses.replace(config, options=dataclasses.replace(
        config.options, column_mask=True, column_lo_static=True, narrow_last_tile=narrow))
  if padded and not is_fp8(dtype):  # (FP8's zero jobs measured mixed)
    # zero jobs: with two compute warpgroups at depth 128 copied by the TMA unit
    # ("bulk", which ``smem.fitted`` turns into "spans" where its buffer does not fit
    # beside the output buffers); elsewhere stored, for short prompts as contiguous spans
    # of an item's rows across heads
    if config.compute_wgs == 2 and qk_depth == v_depth == 128:
      units = "bulk"
    else:
      units = "spans" if max_prompt_len <= COLUMN_MASK_MAX_PROMPT else "stores"
    config = dataclasses.replace(config, options=dataclasses.replace(
        config.options, keyless_units=units))
  return config


# ``default_mosaic_config`` masks by columns up to this max_prompt_len.
COLUMN_MASK_MAX_PROMPT = LONG_PROMPT

# ``default_mosaic_config`` runs bf16/float16 at depth 128 on three compute warpgroups
# above this max_prompt_len (with a soft cap, above ``COLUMN_MASK_MAX_PROMPT``).
THREE_WGS_MIN_PROMPT = 8192


def _three_wgs_serve(qk_depth: int, v_depth: int, dtype, config: MosaicConfig) -> bool:
  """Whether ``default_mosaic_config`` may run three compute warpgroups (for long or
  soft-capped prompts): bf16/float16 at depth 128 on 128-key tiles in two stages (the shared memory three fit
  in), where the register cuts leave the tile loops spill-free."""
  return (not is_fp8(dtype) and qk_depth == v_depth == 128 and config.compute_wgs == 2
          and config.block_kv == 128 and config.num_stages == 2 and not config.split_units)


def _default_tiles(qk_depth: int, v_depth: int, dtype, mask) -> MosaicConfig:
  """``default_mosaic_config``'s tiles, warpgroups and stages, with the default options."""
  if is_fp8(dtype) and qk_depth == v_depth == 128:
    return MosaicConfig(block_kv=128, num_stages=2, compute_wgs=3)
  tuned = _length_free_entry(TUNED_MOSAIC, qk_depth, v_depth, dtype, mask)
  if tuned is not None:
    return MosaicConfig(*tuned[:4])
  if (qk_depth + v_depth) * jnp.dtype(dtype).itemsize * 128 * 2 > 128 * 1024:
    return MosaicConfig(block_kv=64, num_stages=3)
  return MosaicConfig(block_kv=128, num_stages=2)


def is_hopper() -> bool:
  """Whether the device compiled for is a Hopper GPU (sm_90: H100, H200, H800, H20, GH200),
  which the Mosaic GPU kernel targets: an abstract mesh's device kind (ahead-of-time
  lowering), else the default device's compute capability."""
  abstract = jax.sharding.get_abstract_mesh().abstract_device
  if abstract is not None:
    return abstract.platform == "gpu" and any(
        name in abstract.device_kind for name in HOPPER_KINDS)
  device = jax.devices()[0]
  if device.platform != "gpu":
    return False
  capability = getattr(device, "compute_capability", None)
  if capability is not None:
    return str(capability).split(".")[0] == "9"
  return any(name in device.device_kind for name in HOPPER_KINDS)


HOPPER_KINDS = ("H100", "H200", "H800", "H20", "GH200")


def prefers_triton(qk_depth: int, v_depth: int, dtype, mask, max_prompt_len: int,
                   paged: bool = False, q_dtype=None) -> bool:
  """Whether ``backend="auto"`` keeps the Triton kernel on a Hopper GPU for a call that
  Mosaic GPU can serve: where the tuned table for the device measured Triton faster for
  both short and long prompts (entries whose last field is False), so that the backend,
  and with it a sequence's output bits, does not depend on the batch's longest prompt
  (``max_prompt_len``, kept for the signature). Never on a paged cache: bf16/f16 (Mosaic
  GPU measured 1.36x to 2.0x Triton on every paged workload of the harness, short
  prompts included: BUILD_NOTES.md) or FP8 under an FP8 q (pages read in place, V^T of
  the sequences' keys from a small kernel: 3.2x Triton's FP8 call on MHA and MLA
  chunked8x512_page64 in ncu's device time, twenty-sixth session; gathered first, as
  it does pages under 64 rows, 2.6x / 1.8x there). Always on a bf16/f16 q
  (``q_dtype``) over FP8 K/V, which Mosaic GPU quantizes to e4m3 (relative error 1.5e-1
  against q as given with outlier channels, over issue 24's 5e-2; Triton uses q as
  given). A case the table lacks runs Mosaic GPU."""
  del max_prompt_len
  if is_fp8(dtype) and q_dtype is not None and not is_fp8(q_dtype):
    return True
  if paged:
    return False
  tuned = [_tuned_entry(TUNED_MOSAIC, qk_depth, v_depth, dtype, mask, n)
           for n in (1, LONG_PROMPT + 1)]
  return all(t is not None and not t[4] for t in tuned)


def default_config(qk_depth: int, v_depth: int, dtype, mask, max_prompt_len: int,
                   page_size: int | None = None) -> MhaConfig:
  """The configuration ``config=None`` uses for these padded depths, dtype, mask and length.

  Looks up the table ``python -m benchmarks.tune`` wrote for the device (the mask's own
  entry, else the causal one); an unknown device or shape gets a safe default: 64 x 32
  tiles, which keep Q, the K/V stages and the accumulator well inside shared memory and
  registers up to depth 256 in float32. With a paged cache (``page_size``) the KV tile
  lies inside one page, and for rows up to 256 bytes wide (bf16 at depth 128) it takes up
  to ``PAGED_MIN_BLOCK_KV`` rows of it.
  """
  tuned = _tuned_entry(TUNED, qk_depth, v_depth, dtype, mask, max_prompt_len)
  wide = max(qk_depth, v_depth) * jnp.dtype(dtype).itemsize > 256  # wider than bf16 d128
  if tuned is not None:
    config = MhaConfig(*tuned)
  else:
    config = MhaConfig(block_q=64, block_kv=32, num_warps=4, num_stages=2 if wide else 3)
  if page_size is not None:
    block_kv = config.block_kv if wide else max(config.block_kv, PAGED_MIN_BLOCK_KV)
    config = dataclasses.replace(config, block_kv=min(block_kv, page_size))
  return config

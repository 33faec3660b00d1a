"""What the harness times: pallas_prefill and every alternative a JAX user could pick.

Each system prepares, from the packed problem (``make_problem``), a callable, its rotated
input sets, and a function turning its output back into the packed [total_q, heads, d_v]
layout for the correctness check. A system that cannot serve a workload (no GPU, torch or
tokamax missing, a mask or a cached prefix it does not support) raises ``Unavailable``.
``prepare`` hands the Mosaic GPU system the options of an A/B run (``--mosaic-options``,
``parse_mosaic_options``), which become the ``MosaicConfig`` it passes.

FP8 (issue 24) is a property of a system, not of the run: the systems named ``*_fp8``
quantize the workload's bf16 inputs themselves to float8_e4m3fn (``quantize_problem``:
absmax scales, per K/V head for ours, per tensor for cuDNN), so that one run times
``pallas_prefill_default`` beside ``pallas_prefill_fp8`` and ``cudnn_fp8`` on the same
data. Their outputs are checked against the float32 reference of the dequantized inputs
(what the FP8 values mean), within ``FP8_TOLERANCE``; the useful FLOPs are the bf16 rows'.

Every system here ran on the H200 on 2026-11-29 (benchmarks/results/h200.json), except
pallas_prefill_padded and pallas_prefill_softcap (added later); tokamax needs its wheels
carried there (BUILD_NOTES.md). tokamax's two systems are its padded anchors: its
``dot_product_attention`` takes jax.nn's lengths, and they pass them.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.machinery
import importlib.util
import sys
import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_prefill as pp
from benchmarks import workloads as wl
from pallas_prefill import config as config_lib
from pallas_prefill import fp8
from pallas_prefill import masks

MHA_SHAPE = dict(heads=32, kv_heads=8, qk=128, v=128)  # GQA 32/8, head dim 128
MLA_SHAPE = dict(heads=128, kv_heads=128, qk=192, nope=128, rope=64, v=128)  # DeepSeek-V3


class Unavailable(Exception):
  """This system cannot run this workload here; the message says why."""


@dataclasses.dataclass
class Problem:
  """One input set of a workload, packed as serving code holds it (and paged if asked)."""

  kind: str
  workload: wl.Workload
  q: jax.Array
  kv: tuple  # MHA (k, v); MLA (k_nope, k_rope, v); packed [total_kv, heads, depth]
  q_offsets: jax.Array
  kv_offsets: jax.Array | None  # None: K/V packed like Q
  paged: tuple | None  # the same K/V as PagedKVs, when the workload has a page size

  @property
  def shape(self):
    return MHA_SHAPE if self.kind == "mha" else MLA_SHAPE

  @property
  def kv_lens(self):
    return self.workload.kv_lens or self.workload.q_lens


def make_problem(kind, workload, seed) -> Problem:
  shape = MHA_SHAPE if kind == "mha" else MLA_SHAPE
  q_lens = workload.q_lens
  kv_lens = workload.kv_lens or q_lens
  keys = iter(jax.random.split(jax.random.key(seed), 5))
  normal = lambda *s: jax.random.normal(next(keys), s, jnp.bfloat16)
  tq, tkv = sum(q_lens), sum(kv_lens)
  q = normal(tq, shape["heads"], shape["qk"])
  if kind == "mha":
    kv = (normal(tkv, shape["kv_heads"], shape["qk"]), normal(tkv, shape["kv_heads"], shape["v"]))
  else:
    kv = (normal(tkv, shape["kv_heads"], shape["nope"]), normal(tkv, 1, shape["rope"]),
          normal(tkv, shape["kv_heads"], shape["v"]))
  kv_off = None if workload.kv_lens is None else jnp.asarray(wl.offsets(kv_lens))
  paged = None
  if workload.page_size:
    paged = _to_pages(kv, kv_lens, q_lens, workload.page_size, np.random.default_rng(seed))
  return Problem(kind, workload, q, kv, jnp.asarray(wl.offsets(q_lens)), kv_off, paged)


def _to_pages(kv, kv_lens, q_lens, page_size, rng):
  """Packed K/V -> PagedKVs over one shuffled block table (cache then new rows)."""
  kv_lens = np.asarray(kv_lens)
  per_seq = -(-kv_lens // page_size)
  num_pages, max_pages = int(per_seq.sum()), int(per_seq.max())
  order = iter(rng.permutation(num_pages))
  table = np.zeros((len(kv_lens), max_pages), np.int32)
  for b, n in enumerate(per_seq):
    table[b, :n] = [next(order) for _ in range(n)]
  # Row r of sequence b goes to page table[b, r // page_size], slot r % page_size.
  dest = np.concatenate([table[b, np.arange(n) // page_size] * page_size
                         + np.arange(n) % page_size for b, n in enumerate(kv_lens)])
  cache = jnp.asarray(kv_lens - np.asarray(q_lens), jnp.int32)
  out = []
  for x in kv:
    flat = jnp.zeros((num_pages * page_size,) + x.shape[1:], x.dtype).at[dest].set(x)
    out.append(pp.PagedKV(flat.reshape(num_pages, page_size, *x.shape[1:]),
                          jnp.asarray(table), cache))
  return tuple(out)


def reference(problem: Problem, logits_soft_cap=None):
  """The float32 reference output, packed; with ``logits_soft_cap``, of the capped logits."""
  fn = (pp.reference.mha_prefill_reference if problem.kind == "mha"
        else pp.reference.mla_prefill_reference)
  return fn(problem.q, *problem.kv, problem.q_offsets, max_prompt_len=problem.workload.max_len,
            kv_input_row_offsets=problem.kv_offsets, mask=problem.workload.mask,
            logits_soft_cap=logits_soft_cap)


def useful_flops(problem: Problem) -> float:
  s = problem.shape
  w = problem.workload
  return wl.useful_flops(w.q_lens, s["heads"], s["qk"], s["v"], kv_lens=w.kv_lens, mask=w.mask)


@dataclasses.dataclass
class Prepared:
  fn: Callable  # fn(*args) -> output in the system's own layout
  arg_sets: list  # one args tuple per input set, rotated while timing
  to_packed: Callable[[Any], Any]  # output -> packed [total_q, heads, d_v]
  timer: str = "jax"  # "jax" or "torch"
  backend: str | None = None  # the pallas_prefill backend the call ran, where it picks one
  # () -> the float32 reference the output is checked against, where it is not the
  # workload's own (``reference(problem)``): the soft-capped system's, the FP8 systems'.
  reference: Callable[[], Any] | None = None
  # The relative error under which the output counts as correct; None: the harness's
  # (``run.TOLERANCE``). The FP8 systems': ``FP8_TOLERANCE``.
  tolerance: float | None = None
  # The call picks its backend ("auto"): ``read_backend`` fills in ``backend`` once the
  # harness has timed the first call (which a lowering beforehand would have traced).
  auto_backend: bool = False

  def read_backend(self) -> Prepared:
    """This system with ``backend`` "auto: " and the backend its call runs, read from the
    lowered program (``backend_ran``), where it picks one (``auto_backend``); else itself.
    After the first call the lowering comes from JAX's caches."""
    if not self.auto_backend:
      return self
    ran = backend_ran(self.fn, *self.arg_sets[0])
    return dataclasses.replace(self, backend=f"auto: {ran}", auto_backend=False)

  def wait(self, out=None):
    """Waits for ``out`` (JAX: its arrays) or for the device (torch: its stream)."""
    if self.timer == "torch":
      _torch().cuda.synchronize()
    else:
      jax.block_until_ready(out)


# --------------------------------------------------------------------------------------
# pallas_prefill


# The MosaicConfig fields that --mosaic-options may set beside MosaicOptions' own.
MOSAIC_CONFIG_FIELDS = ("split_units", "block_kv", "num_stages", "num_programs", "compute_wgs")


def _split_mosaic_options(options):
  """(MosaicConfig fields, MosaicOptions fields) of parsed ``options``; the dataclasses' own
  checks raise ValueError for a value of the wrong type or range."""
  config_fields = {k: v for k, v in options.items() if k in MOSAIC_CONFIG_FIELDS}
  option_fields = {k: v for k, v in options.items() if k not in MOSAIC_CONFIG_FIELDS}
  pp.MosaicConfig(**config_fields)  # each field checked against the defaults of the others
  pp.MosaicOptions(**option_fields)
  return config_fields, option_fields


def parse_mosaic_options(settings) -> dict:
  """{"name": value} from ["name=VALUE", ...]: ``--mosaic-options`` of benchmarks.run and
  benchmarks.profile, and the settings of benchmarks.ab's arms (one parser for all three).

  Names are fields of ``pp.MosaicOptions`` (``dynamic``, ``head_major``, ...) or the
  ``MosaicConfig`` fields in ``MOSAIC_CONFIG_FIELDS``; values are Python literals. Raises
  ValueError for a setting without "=", an unknown name, a value that is not a literal, and
  a value the dataclasses refuse (``dynamic=1``: not a bool; ``block_kv=32``).
  """
  names = [f.name for f in dataclasses.fields(pp.MosaicOptions)] + list(MOSAIC_CONFIG_FIELDS)
  options = {}
  for setting in settings:
    name, sep, text = setting.partition("=")
    if not sep or name not in names:
      raise ValueError(f"{setting!r} is not NAME=VALUE with NAME one of {', '.join(names)}")
    try:
      options[name] = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      raise ValueError(f"{setting!r}: {text!r} is not a Python literal") from None
  _split_mosaic_options(options)
  return options


def mosaic_config(options, problem: Problem, soft_cap=False,
                  padded=False) -> pp.MosaicConfig | None:
  """The config the Mosaic GPU system passes for ``options`` (``parse_mosaic_options``):
  None, the entry point's own default, when there are none; else the default for the call
  (``default_mosaic_config`` of q's and V's depths, dtype, mask, longest prompt and
  whether the call caps its logits (``soft_cap``) and is ``dot_product_attention``'s
  (``padded``); the
  harness's depths are powers of two, so q's is its padded one: MLA's 128 + 64 = 192) with
  the given fields of it and of its options replaced (the others as the default call has
  them: ``column_mask`` is on for short prompts)."""
  if not options:
    return None
  config_fields, option_fields = _split_mosaic_options(options)
  w = problem.workload
  base = config_lib.default_mosaic_config(problem.q.shape[-1], problem.kv[-1].shape[-1],
                                          problem.q.dtype, w.mask, w.max_len, soft_cap,
                                          padded)
  return dataclasses.replace(base, **config_fields,
                             options=dataclasses.replace(base.options, **option_fields))


def _pallas(problems, *, paged, backend="triton", config=None, logits_soft_cap=None,
            fp8_scales=None):
  """Our entry point on the problems; backend None: the call without the argument.
  ``fp8_scales``: per problem, the FP8 inputs' {q_scale, k_scale, v_scale}, passed as a
  fifth argument (``quantize_problem``)."""
  p0 = problems[0]
  kernel = pp.mha_prefill if p0.kind == "mha" else pp.mla_prefill
  if paged and p0.paged is None:
    raise Unavailable("no paged cache in this workload")
  w = p0.workload

  chosen = {} if backend is None else dict(backend=backend)
  if logits_soft_cap is not None:
    chosen["logits_soft_cap"] = logits_soft_cap

  @jax.jit
  def fn(q, kv, q_off, kv_off, scales=None):
    return kernel(q, *kv, q_off, kv_input_row_offsets=kv_off, max_prompt_len=w.max_len,
                  mask=w.mask, config=config, **chosen, **(scales or {}))

  args = [(p.q, p.paged if paged else p.kv, p.q_offsets, None if paged else p.kv_offsets)
          for p in problems]
  if fp8_scales is not None:
    args = [a + (scales,) for a, scales in zip(args, fp8_scales)]
  return Prepared(fn, args, lambda out: out)


def pallas_prefill(problems):
  """Ours: packed, or on the paged cache when the workload has one."""
  return _pallas(problems, paged=problems[0].paged is not None)


def pallas_prefill_default(problems):
  """Ours as the README calls it, with no backend argument and no config (``"auto"``):
  the backend column says which kernel the call ran, read from its lowered program
  (``Prepared.read_backend``)."""
  prepared = _pallas(problems, paged=problems[0].paged is not None, backend=None)
  return dataclasses.replace(prepared, auto_backend=True)


# The cap of pallas_prefill_softcap (Grok-1's attention cap; Gemma 2's is 50). On the
# harness's normal inputs the scaled logits stay within about 6, which 30 tanh(x / 30)
# moves by 1 % at most: the figure is the cap's cost, and an uncapped output would still
# pass the 2e-2 check against the capped reference (capped and uncapped outputs differ by
# about 3e-3 on ``tiny``; the CPU tests set a cap of 1, where they differ past it).
SOFT_CAP = 30.0


def pallas_prefill_softcap(problems, mosaic_options=None):
  """Ours as pallas_prefill_default calls it (packed, no backend argument) with
  ``logits_soft_cap=SOFT_CAP``: what the cap costs against that system; checked against
  the reference with the same cap. With ``mosaic_options``, their Mosaic GPU config
  (``mosaic_config``) instead of auto's."""
  p0 = problems[0]
  _unpaged_self_attention(problems, "the soft-cap comparison")
  cap = SOFT_CAP
  prepared = _pallas(problems, paged=False, backend=None, logits_soft_cap=cap,
                     config=mosaic_config(mosaic_options, p0, soft_cap=True))
  return dataclasses.replace(prepared, auto_backend=True,
                             reference=lambda: reference(p0, logits_soft_cap=cap))


def _unpaged_self_attention(problems, what):
  """The batches the soft-cap comparison runs on (equal, skewed, short, the sliding
  window; the smoke ``tiny``; pallas_prefill_padded's too, by ``_self_attention_only``):
  each query attends over its own prompt, no cache. The soft cap skips the paged
  workloads to keep the default run inside the device's time limit."""
  if problems[0].workload.kv_lens is not None or problems[0].paged is not None:
    raise Unavailable(f"{what} runs on self-attention batches without a cache")


def backend_ran(fn, *args) -> str:
  """Which of our kernels the jitted ``fn`` runs on ``args``: "mosaic_gpu" where its
  lowered program calls a Mosaic GPU kernel, else "triton"."""
  return "mosaic_gpu" if "custom_call @mosaic_gpu" in fn.lower(*args).as_text() else "triton"


def pallas_prefill_mosaic(problems, mosaic_options=None):
  """Ours, backend="mosaic_gpu" (Hopper): packed K/V, or on the paged cache when the
  workload has one; with ``mosaic_options`` (``parse_mosaic_options``) their config."""
  return _pallas(problems, paged=problems[0].paged is not None, backend="mosaic_gpu",
                 config=mosaic_config(mosaic_options, problems[0]))


def pallas_prefill_contiguous(problems):
  """Ours on a paged workload's K/V packed contiguously: what paging costs."""
  if problems[0].paged is None:
    raise Unavailable("only for paged workloads")
  return _pallas(problems, paged=False)


# --------------------------------------------------------------------------------------
# FP8 inputs (issue 24): the workload's data quantized, for the ``*_fp8`` systems

FP8_DTYPE = jnp.float8_e4m3fn
# FP8 rows count as correct under this relative error against the float32 reference of the
# dequantized inputs (bf16 rows: ``run.TOLERANCE``): tests/test_fp8.py's bound. cuDNN's
# FP8 output alone (3 mantissa bits) costs about 3e-2 (anchors-h200.md: 3.4e-2).
FP8_TOLERANCE = 5e-2


def fp8_scale(x, groups):
  """``pp.fp8.absmax_scale`` of x [rows, heads, depth] for FP8_DTYPE, one per group of
  heads // groups consecutive heads: float32 [groups], a scalar when groups is 1."""
  return fp8.absmax_scale(x, groups, FP8_DTYPE).reshape(() if groups == 1 else (groups,))


def _per_head(scale, heads):
  """A scalar or per-group scale as [1, heads, 1], each group's for its heads."""
  scale = jnp.atleast_1d(scale)
  return jnp.repeat(scale, heads // scale.shape[0])[None, :, None]


def to_fp8(x, scale):
  """x [rows, heads, depth] / scale in FP8_DTYPE; scale a scalar or one per group of
  consecutive heads."""
  return (x.astype(jnp.float32) / _per_head(scale, x.shape[1])).astype(FP8_DTYPE)


def from_fp8(x8, scale):
  """The float32 values of x8 [rows, heads, depth] quantized with ``scale``."""
  return x8.astype(jnp.float32) * _per_head(scale, x8.shape[1])


@dataclasses.dataclass
class Fp8Problem:
  """A problem's batch in FP8_DTYPE: ``problem`` holds the FP8 q and K/V (packed, and
  paged where the workload is), ``scales`` their {q_scale, k_scale, v_scale}, float32
  scalars or [num_kv_heads], as ``mha_prefill`` takes them."""

  problem: Problem
  scales: dict

  def dequantized(self) -> Problem:
    """The batch of the FP8 values times their scales, float32, packed: the inputs of the
    reference FP8 outputs are checked against."""
    p, s = self.problem, self.scales
    kv_scales = (s["k_scale"],) * (len(p.kv) - 1) + (s["v_scale"],)
    return dataclasses.replace(p, q=from_fp8(p.q, s["q_scale"]), paged=None,
                               kv=tuple(from_fp8(x, c) for x, c in zip(p.kv, kv_scales)))


def quantize_problem(problem: Problem, per_tensor=False) -> Fp8Problem:
  """``problem`` quantized with absmax scales: K and V one per K/V head, Q one per K/V
  head's group of query heads (a query head takes its K/V head's scale); with
  ``per_tensor``, one scale each (what cuDNN takes). MLA's k_nope and k_rope share one
  per-tensor k_scale: their logits add before the one factor q_scale * k_scale, and the
  single rope head serves every K/V head."""
  groups = 1 if per_tensor else problem.kv[0].shape[1]
  q_scale = fp8_scale(problem.q, groups)
  if problem.kind == "mha":
    k_scale = fp8_scale(problem.kv[0], groups)
  else:
    k_scale = jnp.maximum(fp8_scale(problem.kv[0], 1), fp8_scale(problem.kv[1], 1))
  v_scale = fp8_scale(problem.kv[-1], groups)
  kv_scales = (k_scale,) * (len(problem.kv) - 1) + (v_scale,)
  paged = None
  if problem.paged is not None:
    paged = tuple(dataclasses.replace(
        x, pages=to_fp8(x.pages.reshape(-1, *x.shape[2:]), c).reshape(x.shape))
                  for x, c in zip(problem.paged, kv_scales))
  quantized = dataclasses.replace(
      problem, q=to_fp8(problem.q, q_scale), paged=paged,
      kv=tuple(to_fp8(x, c) for x, c in zip(problem.kv, kv_scales)))
  return Fp8Problem(quantized, dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale))


def pallas_prefill_fp8(problems, mosaic_options=None):
  """Ours as pallas_prefill_default calls it (packed, or on the paged cache; no backend
  argument, ``"auto"``) on the batch in float8_e4m3fn with per-K/V-head scales
  (``quantize_problem``), bf16 output: what FP8 inputs gain over pallas_prefill_default.
  Checked against the float32 reference of the dequantized inputs, within FP8_TOLERANCE.
  MLA passes one k_scale for k_nope and k_rope (per tensor: the one rope head serves
  every K/V head); where ``mla_prefill`` refuses FP8 (TypeError, ValueError,
  NotImplementedError) the row is not run, with the reason. With ``mosaic_options``, their
  Mosaic GPU config (``mosaic_config``) instead of auto's."""
  quantized = [quantize_problem(p) for p in problems]
  p0 = quantized[0].problem
  prepared = _pallas([f.problem for f in quantized], paged=p0.paged is not None,
                     backend=None, fp8_scales=[f.scales for f in quantized],
                     config=mosaic_config(mosaic_options, p0))
  try:  # lowered here, not after the first call: a refusal is "not run", not a failure
    ran = backend_ran(prepared.fn, *prepared.arg_sets[0])
  except (TypeError, ValueError, NotImplementedError) as e:
    if p0.kind == "mha":
      raise
    raise Unavailable(f"mla_prefill refuses FP8 inputs: {type(e).__name__}: "
                      f"{str(e)[:200]}") from None
  return dataclasses.replace(prepared, backend=f"auto: {ran}", tolerance=FP8_TOLERANCE,
                             reference=lambda: reference(quantized[0].dequantized()))


# --------------------------------------------------------------------------------------
# Padded layouts (what a JAX user without a ragged kernel does)


def _pad(x, lengths, max_len):
  off = wl.offsets(lengths)
  return jnp.stack([jnp.pad(x[off[b]:off[b + 1]], [(0, max_len - n)] + [(0, 0)] * (x.ndim - 1))
                    for b, n in enumerate(lengths)])


def _unpad(x, lengths):
  return jnp.concatenate([x[b, :n] for b, n in enumerate(lengths)])


def _padded_qkv(problems, v_as_deep_as_q=False):
  """Per problem (q, k, v, lengths): ``_dense_qkv``'s arrays padded to [B, max_len, heads,
  depth] with zeros, and the [B] int32 lengths (K/V's equal Q's: self-attention only).
  ``v_as_deep_as_q``: V zero-padded to Q's depth (cuDNN)."""
  w = problems[0].workload
  lens = jnp.asarray(w.q_lens, jnp.int32)
  args = []
  for p in problems:
    q, k, v = _dense_qkv(p)
    if v_as_deep_as_q:
      v = jnp.pad(v, [(0, 0), (0, 0), (0, q.shape[-1] - v.shape[-1])])
    args.append(tuple(_pad(x, w.q_lens, w.max_len) for x in (q, k, v)) + (lens,))
  return args


def _dense_qkv(problem):
  """q, k, v with one K per query-head group's depth: MLA's rope key broadcast to every
  head and joined to k_nope (V keeps its own depth)."""
  if problem.kind == "mha":
    return (problem.q, *problem.kv)
  k_nope, k_rope, v = problem.kv
  k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, k_nope.shape[:2] + k_rope.shape[2:])],
                      axis=-1)
  return problem.q, k, v


def _self_attention_only(problems, what):
  if problems[0].workload.kv_lens is not None:
    raise Unavailable(f"{what}: its causal mask is aligned top-left, no cached prefix")


def _window(mask):
  if isinstance(mask, masks.CausalMask):
    return None
  if isinstance(mask, masks.SlidingWindowCausalMask):
    return mask.window
  raise Unavailable(f"mask {mask!r} not supported")


def _jax_nn(problems, implementation):
  _self_attention_only(problems, "jax.nn.dot_product_attention")
  w = problems[0].workload
  window = _window(w.mask)
  max_len = w.max_len
  if implementation == "xla":
    s = problems[0].shape
    if len(w.q_lens) * s["heads"] * max_len * max_len * 4 > 16 * 2**30:
      raise Unavailable("the padded logits would not fit in 16 GiB")
  dv = problems[0].kv[-1].shape[-1]
  args = _padded_qkv(problems, v_as_deep_as_q=True)  # cuDNN: V as deep as Q/K

  @jax.jit
  def fn(q, k, v, lens):
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=lens, key_value_seq_lengths=lens,
        local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation)[..., :dv]

  return Prepared(fn, args, lambda out: _unpad(out, w.q_lens))


def pallas_prefill_padded(problems, mosaic_options=None, fp8_scales=None):
  """Ours on the padded batch with lengths: ``pp.dot_product_attention`` on the arrays and
  lengths cuDNN's padded system gets (V keeps its depth: MHA's equals Q's), its mask from
  the workload's as ``_jax_nn`` maps it, no backend argument (``"auto"``). MHA only (MLA
  has no padded entry point). Against pallas_prefill_default: what the padded layout costs
  ours; against the padded anchors: what computing only the real tokens gains. With
  ``mosaic_options``, their Mosaic GPU config (``mosaic_config``) instead of auto's.
  ``fp8_scales``: per problem, the FP8 inputs' {q_scale, k_scale, v_scale}, passed as a
  fifth argument (pallas_prefill_padded_fp8)."""
  if problems[0].kind != "mha":
    raise Unavailable("MHA only: MLA has no padded entry point")
  _self_attention_only(problems, "dot_product_attention")
  w = problems[0].workload
  window = _window(w.mask)
  config = mosaic_config(mosaic_options, problems[0], padded=True)

  @jax.jit
  def fn(q, k, v, lens, scales=None):
    return pp.dot_product_attention(
        q, k, v, query_seq_lengths=lens, key_value_seq_lengths=lens, is_causal=True,
        local_window_size=None if window is None else (window - 1, 0), config=config,
        **(scales or {}))

  args = _padded_qkv(problems)
  if fp8_scales is not None:
    args = [a + (scales,) for a, scales in zip(args, fp8_scales)]
  return Prepared(fn, args, lambda out: _unpad(out, w.q_lens), auto_backend=True)


def pallas_prefill_padded_fp8(problems, mosaic_options=None):
  """Ours in FP8 on the padded batch: pallas_prefill_padded's call on pallas_prefill_fp8's
  inputs (float8_e4m3fn, per-K/V-head scales, ``quantize_problem``), bf16 output: what
  the padded layout costs ours in FP8 (against pallas_prefill_fp8). Checked against the
  float32 reference of the dequantized inputs, within FP8_TOLERANCE. MHA only. With
  ``mosaic_options``, their Mosaic GPU config (``mosaic_config``) instead of auto's."""
  quantized = [quantize_problem(p) for p in problems]
  prepared = pallas_prefill_padded([f.problem for f in quantized], mosaic_options,
                                   fp8_scales=[f.scales for f in quantized])
  return dataclasses.replace(prepared, tolerance=FP8_TOLERANCE,
                             reference=lambda: reference(quantized[0].dequantized()))


def cudnn_padded(problems):
  """cuDNN through jax.nn.dot_product_attention on the padded batch, with lengths."""
  if jax.default_backend() != "gpu":
    raise Unavailable("needs a GPU")
  return _jax_nn(problems, "cudnn")


def xla_padded(problems):
  """Plain XLA attention (jax.nn.dot_product_attention, implementation='xla'), padded."""
  return _jax_nn(problems, "xla")


def cudnn_packed(problems):
  """cuDNN's packed layout through JAX's private fused_attention_stablehlo (q_offsets).
  MHA only: on MLA's 192/128 depths it returns wrong results (pallas-triton.md)."""
  if jax.default_backend() != "gpu":
    raise Unavailable("needs a GPU")
  p0 = problems[0]
  if p0.kind != "mha":
    raise Unavailable("wrong results on MLA depths")
  _self_attention_only(problems, "cuDNN packed")
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top

  w = p0.workload
  window = _window(w.mask)
  seqlen = jnp.asarray(w.q_lens, jnp.int32)[None]
  offsets = p0.q_offsets[None]

  @jax.jit
  def fn(q, k, v):
    return fa.dot_product_attention(
        q[None], k[None], v[None], q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
        kv_offsets=offsets, scale=q.shape[-1] ** -0.5, mask_type=fa.MaskType.CAUSAL,
        qkv_layout="BTNH", sliding_window_length=window)[0]

  return Prepared(fn, [(p.q, *p.kv) for p in problems], lambda out: out)


# cuDNN's FP8 attention quantizes the probabilities P (in [0, 1]) by this factor before
# P.V: [0, 256] sits inside e4m3's 448 (the setting of the 2026-12-01 run, anchors-h200.md).
CUDNN_FP8_SCALE_S = 256.0


def cudnn_fp8_params(scales) -> dict:
  """The ``fp8_params`` of JAX's private cuDNN FP8 attention for per-tensor ``scales``
  ({q_scale, k_scale, v_scale} scalars): every key of ``fp8_params_keys`` as a
  [1, 1, 1, 1] float32 (it checks them all; the forward reads descale_q/k/v, descale_s,
  scale_s and scale_o, the rest are the backward's), descale_x = x's dequantization scale,
  scale_o = 1 / v_scale (an output row averages V's rows: |out| <= max |v|, no overflow)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top

  one = lambda x: jnp.reshape(jnp.asarray(x, jnp.float32), (1, 1, 1, 1))  # noqa: E731
  params = {key: one(1.0) for key in fa.fp8_params_keys}
  params.update(descale_q=one(scales["q_scale"]), descale_k=one(scales["k_scale"]),
                descale_v=one(scales["v_scale"]), descale_s=one(1 / CUDNN_FP8_SCALE_S),
                scale_s=one(CUDNN_FP8_SCALE_S), scale_o=one(1 / scales["v_scale"]))
  return params


def cudnn_fp8_attention(q, k, v, fp8_params, *, causal):
  """cuDNN's FP8 flash attention forward, ``fused_attention_stablehlo.
  dot_product_attention(..., use_fp8=True)`` (jax 0.11.2 and 0.12): q [batch, len,
  heads, d], k and v [batch, len, kv_heads, d], float8_e4m3fn, dense (it takes no lengths
  or offsets), causal or no mask; returns the output [batch, len, heads, d] in q's FP8
  dtype, scaled by fp8_params' scale_o (its amax outputs dropped)."""
  from jax._src.cudnn import fused_attention_stablehlo as fa  # pylint: disable=g-import-not-at-top

  out, _, _ = fa.dot_product_attention(
      q, k, v, fp8_params=fp8_params, scale=q.shape[-1] ** -0.5,
      mask_type=fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK, qkv_layout="BTNH",
      use_fp8=True)
  return out


def cudnn_fp8_inputs(quantized: Fp8Problem, repeat_kv=False) -> tuple:
  """(q, k, v, fp8_params) of ``cudnn_fp8_attention`` for a per-tensor quantized batch of
  equal-length self-attention prompts: the packed rows as [batch, len, heads, d]; with
  ``repeat_kv``, K/V repeated to every query head."""
  p = quantized.problem
  batch, length = len(p.workload.q_lens), p.workload.q_lens[0]
  q, k, v = (x.reshape(batch, length, *x.shape[1:]) for x in (p.q, *p.kv))
  if repeat_kv:
    k, v = (jnp.repeat(x, q.shape[2] // x.shape[2], axis=2) for x in (k, v))
  return q, k, v, cudnn_fp8_params(quantized.scales)


def cudnn_fp8(problems):
  """cuDNN's FP8 attention (``cudnn_fp8_attention``) on the batch as a dense
  [batch, len, heads, 128] float8_e4m3fn array with per-tensor absmax scales (the only
  ones it takes), GQA's K/V heads as they are (its layout check allows fewer K/V heads
  than query heads; 32/8 ran correct on the H200, h200-74ff108-fp8.json). Its output is FP8 too (half our bf16 output's bytes), dequantized
  after the timed call; checked against the float32 reference of the dequantized inputs,
  within FP8_TOLERANCE. Equal-length self-attention batches only (``equal4x4096``),
  causal or no mask, MHA (``_cudnn_fp8_case`` says why others are not applicable)."""
  return _cudnn_fp8(problems, repeat_kv=False)


def cudnn_fp8_kv_repeated(problems):
  """cudnn_fp8 with K/V repeated to every query head before the timed call (32/32 heads):
  the fallback should cuDNN refuse or mis-serve GQA in FP8, and what GQA saves it."""
  return _cudnn_fp8(problems, repeat_kv=True)


def _cudnn_fp8_case(p0):
  """Raises Unavailable where cuDNN's FP8 attention cannot express the workload (checked
  before the GPU, so that the CPU tests see the reason)."""
  w = p0.workload
  if p0.kind != "mha":
    raise Unavailable("MHA only: its output takes Q's shape (V as deep as Q), and cuDNN's "
                      "FP8 fails at MLA's 192/128 depths (anchors-h200.md)")
  if w.kv_lens is not None or p0.paged is not None:
    raise Unavailable("self-attention only: FP8 takes no cached prefix or paged cache")
  if len(set(w.q_lens)) != 1:
    raise Unavailable("equal lengths only: FP8 takes no sequence lengths or offsets "
                      "(a dense batch)")
  if not isinstance(w.mask, (masks.CausalMask, masks.NullMask)):
    raise Unavailable(f"causal or no mask only, not {w.mask!r}")
  if jax.default_backend() != "gpu":
    raise Unavailable("needs a GPU")


def _cudnn_fp8(problems, repeat_kv):
  _cudnn_fp8_case(problems[0])
  quantized = [quantize_problem(p, per_tensor=True) for p in problems]
  causal = isinstance(problems[0].workload.mask, masks.CausalMask)
  fn = jax.jit(lambda q, k, v, params: cudnn_fp8_attention(q, k, v, params, causal=causal))
  v_scale = quantized[0].scales["v_scale"]

  def to_packed(out):  # the first input set's output, its scale_o undone
    return from_fp8(out.reshape(-1, *out.shape[2:]), v_scale)

  return Prepared(fn, [cudnn_fp8_inputs(f, repeat_kv) for f in quantized], to_packed,
                  tolerance=FP8_TOLERANCE,
                  reference=lambda: reference(quantized[0].dequantized()))


def jax_pallas_mha(problems):
  """JAX's own Pallas Triton attention (ops/gpu/attention.mha) on the padded batch, K/V
  repeated to every query head, the length padded to a multiple of its 128 blocks."""
  if jax.default_backend() != "gpu":
    raise Unavailable("needs a GPU")
  p0 = problems[0]
  if p0.kind != "mha" or not isinstance(p0.workload.mask, masks.CausalMask):
    raise Unavailable("MHA with a causal mask only")
  _self_attention_only(problems, "ops.gpu.attention.mha")
  from jax.experimental.pallas.ops.gpu import attention  # pylint: disable=g-import-not-at-top

  w = p0.workload
  max_len = -(-w.max_len // 128) * 128
  group = p0.shape["heads"] // p0.shape["kv_heads"]
  args = [tuple(_pad(x, w.q_lens, max_len) for x in
                (p.q, jnp.repeat(p.kv[0], group, 1), jnp.repeat(p.kv[1], group, 1)))
          for p in problems]
  fn = jax.jit(lambda q, k, v: attention.mha(q, k, v, None, sm_scale=q.shape[-1] ** -0.5,
                                             causal=True))
  return Prepared(fn, args, lambda out: _unpad(out, w.q_lens))


def tokamax_mosaic(problems):
  return _tokamax(problems, "mosaic")


def tokamax_triton(problems):
  return _tokamax(problems, "triton")


def _import_tokamax():
  """tokamax 0.0.17 imports xprof's kernel-stats tool, which only its autotuner's profiling
  uses; where xprof is absent (the H200 image) an empty stand-in module lets it import."""
  if "tokamax" not in sys.modules:
    if importlib.util.find_spec("tokamax") is None:
      raise Unavailable("tokamax not importable (carry its wheels: BUILD_NOTES.md)")
    if importlib.util.find_spec("xprof") is None:
      for name in ("xprof", "xprof.cli", "xprof.cli.tools",
                   "xprof.cli.tools.get_kernel_stats_tool"):
        stub = types.ModuleType(name)
        stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        sys.modules.setdefault(name, stub)
  try:
    import tokamax  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise Unavailable(f"tokamax not importable: {e}") from None
  return tokamax


def _tokamax(problems, implementation):
  """tokamax's dot_product_attention on the padded batch with lengths (V keeps its depth)."""
  tokamax = _import_tokamax()
  _self_attention_only(problems, "tokamax")
  w = problems[0].workload
  window = _window(w.mask)
  args = _padded_qkv(problems)

  @jax.jit
  def fn(q, k, v, lens):
    return tokamax.dot_product_attention(
        q, k, v, is_causal=True, query_seq_lengths=lens, key_value_seq_lengths=lens,
        local_window_size=None if window is None else (window - 1, 0),
        implementation=implementation)

  return Prepared(fn, args, lambda out: _unpad(out, w.q_lens))


# --------------------------------------------------------------------------------------
# torch (on the H200 image), fed the same data through DLPack


def _torch():
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise Unavailable(f"torch not importable: {e}") from None
  if not torch.cuda.is_available():
    raise Unavailable("torch sees no GPU")
  return torch


def torch_sdpa_cudnn(problems):
  """torch's scaled_dot_product_attention, cuDNN backend, padded [B, heads, L, D]."""
  torch = _torch()
  from torch.nn.attention import SDPBackend, sdpa_kernel  # pylint: disable=g-import-not-at-top

  _self_attention_only(problems, "torch SDPA")
  w = problems[0].workload
  if not isinstance(w.mask, masks.CausalMask):
    raise Unavailable("causal only (is_causal)")
  args = []
  for p in problems:
    q, k, v = _dense_qkv(p)
    dv = v.shape[-1]
    v = jnp.pad(v, [(0, 0), (0, 0), (0, q.shape[-1] - dv)])
    args.append(tuple(torch.from_dlpack(_pad(x, w.q_lens, w.max_len)).transpose(1, 2)
                      for x in (q, k, v)))

  def fn(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
      return torch.nn.functional.scaled_dot_product_attention(
          q, k, v, is_causal=True, enable_gqa=True)[..., :dv]

  def to_packed(out):
    return _unpad(jnp.asarray(out.transpose(1, 2).float().cpu().numpy()), w.q_lens)

  return Prepared(fn, args, to_packed, timer="torch")


def torch_flex(problems):
  """torch FlexAttention, packed [1, heads, total, D], with a document mask that keeps
  each sequence's (bottom-right aligned) causal or window pattern."""
  torch = _torch()
  from torch.nn.attention import flex_attention as fa  # pylint: disable=g-import-not-at-top

  p0 = problems[0]
  w = p0.workload
  if p0.paged is not None:
    raise Unavailable("no paged cache")
  window = _window(w.mask)
  kv_lens = np.asarray(p0.kv_lens)
  q_lens = np.asarray(w.q_lens)
  dev = "cuda"
  q_doc = torch.as_tensor(np.repeat(np.arange(len(q_lens)), q_lens), device=dev)
  kv_doc = torch.as_tensor(np.repeat(np.arange(len(kv_lens)), kv_lens), device=dev)
  q_pos = torch.as_tensor(np.concatenate([np.arange(n) + (kv_lens[b] - n)
                                          for b, n in enumerate(q_lens)]), device=dev)
  kv_pos = torch.as_tensor(np.concatenate([np.arange(n) for n in kv_lens]), device=dev)

  def mask_mod(b, h, qi, ki):
    del b, h
    keep = (q_doc[qi] == kv_doc[ki]) & (kv_pos[ki] <= q_pos[qi])
    if window is not None:
      keep = keep & (kv_pos[ki] > q_pos[qi] - window)
    return keep

  block_mask = fa.create_block_mask(mask_mod, None, None, int(q_lens.sum()),
                                    int(kv_lens.sum()), device=dev)
  flex = torch.compile(fa.flex_attention)
  args = [tuple(torch.from_dlpack(x)[None].transpose(1, 2) for x in _dense_qkv(p))
          for p in problems]

  def fn(q, k, v):
    return flex(q, k, v, block_mask=block_mask, enable_gqa=True)

  def to_packed(out):
    return jnp.asarray(out[0].transpose(0, 1).float().cpu().numpy())

  return Prepared(fn, args, to_packed, timer="torch")


# The pallas_prefill backend each of our systems runs (the harness's backend column).
BACKENDS = {"pallas_prefill": "triton", "pallas_prefill_mosaic": "mosaic_gpu",
            "pallas_prefill_contiguous": "triton"}

# The anchors on padded arrays (what ours on padded arrays, pallas_prefill_padded, is
# compared with in the report).
PADDED_ANCHORS = ("cudnn_padded", "xla_padded", "tokamax_mosaic", "tokamax_triton",
                  "torch_sdpa_cudnn", "jax_pallas_mha")

# The systems that take ``--mosaic-options``: the Mosaic GPU backend's, ours padded, ours
# soft-capped and ours in FP8 (packed and padded).
MOSAIC_SYSTEMS = tuple(name for name, backend in BACKENDS.items() if backend == "mosaic_gpu"
                       ) + ("pallas_prefill_padded", "pallas_prefill_softcap",
                            "pallas_prefill_fp8", "pallas_prefill_padded_fp8")

SYSTEMS = {
    "pallas_prefill": pallas_prefill,
    "pallas_prefill_default": pallas_prefill_default,
    "pallas_prefill_mosaic": pallas_prefill_mosaic,
    "pallas_prefill_contiguous": pallas_prefill_contiguous,
    "pallas_prefill_padded": pallas_prefill_padded,
    "pallas_prefill_softcap": pallas_prefill_softcap,
    "pallas_prefill_fp8": pallas_prefill_fp8,
    "pallas_prefill_padded_fp8": pallas_prefill_padded_fp8,
    "cudnn_padded": cudnn_padded,
    "cudnn_packed": cudnn_packed,
    "cudnn_fp8": cudnn_fp8,
    "cudnn_fp8_kv_repeated": cudnn_fp8_kv_repeated,
    "jax_pallas_mha": jax_pallas_mha,
    "xla_padded": xla_padded,
    "tokamax_mosaic": tokamax_mosaic,
    "tokamax_triton": tokamax_triton,
    "torch_sdpa_cudnn": torch_sdpa_cudnn,
    "torch_flex": torch_flex,
}

# Ours: the systems whose useful TFLOP/s the report gives as a fraction of the bf16 matmul
# rate measured in the same run (issue 25 states its long-context target that way).
OURS = tuple(name for name in SYSTEMS if name.startswith("pallas_prefill"))


def prepare(name, problems, mosaic_options=None) -> Prepared:
  """System ``name`` prepared for ``problems``; ``mosaic_options`` go to the systems that
  run the Mosaic GPU backend (``MOSAIC_SYSTEMS``) and to no other."""
  if name in MOSAIC_SYSTEMS:
    return SYSTEMS[name](problems, mosaic_options=mosaic_options)
  return SYSTEMS[name](problems)

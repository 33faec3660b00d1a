"""Argument checks shared by the entry points: static ones raise at trace time, data ones
(`validate_offsets`) run whenever the offsets are concrete."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_prefill import fp8
from pallas_prefill import masks as masks_lib
from pallas_prefill.checks import check_array, check_offsets
from pallas_prefill.config import MhaConfig, MosaicConfig
from pallas_prefill.constants import SINK_MAX
from pallas_prefill.paged import PagedKV, check_paged, validate_paged

MAX_HEAD_DIM = 256
INPUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_shared_tables(kv_operands):
  """Concrete PagedKV operands (K and V, MLA's three) must hold one block table and one
  set of cache lengths: the kernels read them from the first operand only, so a
  different one elsewhere would be ignored without a word."""
  (first_name, first), *rest = kv_operands.items()
  for name, kv in rest:
    for field in ("block_table", "cache_lengths"):
      a, b = getattr(first, field), getattr(kv, field)
      if a is b or not (is_concrete(a) and is_concrete(b)):
        continue
      if not np.array_equal(np.asarray(a), np.asarray(b)):
        raise ValueError(f"{name}.{field} differs from {first_name}.{field}: the K/V "
                         f"operands of a paged cache share one {field}")


def check_float_dtype(name, x, fp8_ok=False):
  allowed = INPUT_DTYPES + (fp8.FP8_DTYPES if fp8_ok else ())
  if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in allowed]:
    extra = ", float8_e4m3fn or float8_e5m2" if fp8_ok else ""
    raise TypeError(f"{name} must be bfloat16, float16, float32{extra}, got {x.dtype}")


def check_head_dim(name, depth):
  if not 1 <= depth <= MAX_HEAD_DIM:
    raise ValueError(f"{name} must be between 1 and {MAX_HEAD_DIM}, got {depth}")


BACKENDS = ("triton", "mosaic_gpu", "auto")


F32 = np.finfo(np.float32)


def as_float32(x) -> float:
  """x as the float32 the kernels compute with, or NaN where float32 has no value for it
  (a Python int too large for a float included): float32 overflow gives inf."""
  try:
    with np.errstate(over="ignore"):
      return float(np.float32(float(x)))
  except OverflowError:
    return math.nan


def check_soft_cap(logits_soft_cap):
  if logits_soft_cap is None:
    return
  if isinstance(logits_soft_cap, (bool, np.bool_)) or not isinstance(
      logits_soft_cap, (int, float, np.integer, np.floating)):
    raise TypeError("logits_soft_cap must be a static Python float or None, got "
                    f"{type(logits_soft_cap).__name__}")
  cap = as_float32(logits_soft_cap)
  if not (math.isfinite(cap) and cap >= F32.tiny):
    raise ValueError(f"logits_soft_cap must be a float > 0, finite and normal in float32 "
                     f"(logits become cap * tanh(logits / cap)), got {logits_soft_cap!r}")


def check_forward_only(entry: str, operands: dict):
  """NotImplementedError where ``jax.grad``, ``jvp`` or ``linearize`` differentiates an
  operand ({name: array, PagedKV or None}; their tracers carry a ``tangent``): the
  kernels define no gradient, and Pallas' own error there says nothing of why."""
  for name, x in operands.items():
    if any(getattr(leaf, "tangent", None) is not None for leaf in jax.tree.leaves(x)):
      raise NotImplementedError(
          f"{entry} is forward only (inference prefill): it defines no gradient, and "
          f"{name} is being differentiated (jax.grad, jvp or linearize); pass "
          "jax.lax.stop_gradient of the inputs where no gradient should flow through it")


def check_options(*, max_prompt_len, mask, scale, output_dtype, config, interpret,
                  backend="auto", logits_soft_cap=None):
  if isinstance(max_prompt_len, bool) or not isinstance(max_prompt_len, (int, np.integer)):
    raise TypeError(
        f"max_prompt_len must be a static Python int, got {type(max_prompt_len).__name__}")
  if max_prompt_len <= 0:
    raise ValueError(f"max_prompt_len must be > 0, got {max_prompt_len}")
  if not isinstance(mask, masks_lib.MASK_TYPES):
    raise TypeError(
        "mask must be one of pallas_prefill.masks.CausalMask(), NullMask(), "
        f"SlidingWindowCausalMask(window), ChunkedCausalMask(chunk); got {mask!r}")
  if scale is not None and (isinstance(scale, (bool, np.bool_)) or not isinstance(
      scale, (int, float, np.integer, np.floating))):
    raise TypeError(f"scale must be a finite Python float or None, got {scale!r}")
  if scale is not None and not math.isfinite(as_float32(scale)):
    raise ValueError(f"scale must be a finite Python float or None, got {scale!r} (it must "
                     "be finite in float32, the softmax's dtype, too)")
  if output_dtype is not None:
    try:
      ok = jnp.dtype(output_dtype) in [jnp.dtype(d) for d in INPUT_DTYPES]
    except TypeError:
      ok = False
    if not ok:
      raise TypeError("output_dtype must be bfloat16, float16, float32 or None, got "
                      f"{getattr(output_dtype, '__name__', output_dtype)}")
  check_soft_cap(logits_soft_cap)
  backend = "auto" if backend is None else backend  # (None: "auto", as static_options)
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, got "
                     f"{backend!r}")
  config_type = {"triton": MhaConfig, "mosaic_gpu": MosaicConfig}.get(backend)
  if config is not None and not isinstance(config, config_type or (MhaConfig, MosaicConfig)):
    want = {MhaConfig: "a pallas_prefill.MhaConfig", MosaicConfig:
            "a pallas_prefill.MosaicConfig"}.get(config_type,
                                                   "a pallas_prefill.MhaConfig (Triton) or "
                                                   "MosaicConfig (Mosaic GPU)")
    raise TypeError(f"config must be {want} or None for backend={backend!r}, got "
                    f"{config!r}")
  if interpret is not None and not isinstance(interpret, (bool, np.bool_)):
    raise TypeError(f"interpret must be None, True or False, got {interpret!r}")
  # interpret=None means interpret mode exactly on the CPU backend (dispatch.static_options).
  # A MosaicConfig picks the Mosaic GPU kernel under "auto" as well.
  mosaic = backend == "mosaic_gpu" or isinstance(config, MosaicConfig)
  if mosaic and (jax.default_backend() == "cpu" if interpret is None else interpret):
    which = ("backend='mosaic_gpu'" if backend == "mosaic_gpu" else
             "a MosaicConfig (the Mosaic GPU kernel)")
    raise ValueError(f"{which} has no interpret mode (Mosaic GPU's interpreter cannot run "
                     "its register-operand matrix products), which interpret="
                     f"{interpret} picks here: run it on a Hopper GPU, or use "
                     "backend='triton' or 'auto' without a MosaicConfig for interpret mode")


def check_call(q, kv_operands, input_row_offsets, kv_input_row_offsets, *, max_prompt_len,
               mask, scale, output_dtype, config, interpret, backend="auto",
               logits_soft_cap=None):
  """The static checks MHA and MLA share (each then checks its own depths and heads).

  q is [total_q, num_heads, depth]; kv_operands maps each K/V argument's name to its
  operand: all arrays [total_kv, heads, depth], or all ``PagedKV``.
  """
  check_array("q", q, 3)
  check_float_dtype("q", q, fp8_ok=True)
  check_offsets("input_row_offsets", input_row_offsets)
  batch = input_row_offsets.shape[0] - 1
  paged = [name for name, x in kv_operands.items() if isinstance(x, PagedKV)]
  if paged and len(paged) != len(kv_operands):
    raise ValueError(f"{', '.join(kv_operands)} must all be PagedKV or all be arrays; got "
                     f"PagedKV for {', '.join(paged)} only")
  if paged:
    if kv_input_row_offsets is not None:
      raise ValueError("kv_input_row_offsets must be None with PagedKV operands: the "
                       "cache lengths and query counts give each sequence's K/V")
    check_paged(kv_operands, batch)
    check_shared_tables(kv_operands)
  for name, x in kv_operands.items():
    if not paged:
      check_array(name, x, 3)
    check_float_dtype(name, x, fp8_ok=True)
  operands = {"q": q, **kv_operands}
  if any(fp8.is_fp8(x.dtype) for x in operands.values()):
    operands = dict(kv_operands)  # FP8: q may be wider (``fp8.scales`` checks the rest)
  if len({jnp.dtype(x.dtype) for x in operands.values()}) > 1:
    raise TypeError(", ".join(operands) + " must share a dtype, got "
                    + ", ".join(str(x.dtype) for x in operands.values()))
  if not paged:
    rows = {name: x.shape[0] for name, x in kv_operands.items()}
    if len(set(rows.values())) > 1:
      raise ValueError(f"the K/V arrays must have the same number of rows, got {rows}")
    total_q, total_kv = q.shape[0], next(iter(rows.values()))
    if kv_input_row_offsets is None:
      if total_kv != total_q:
        raise ValueError(
            f"without kv_input_row_offsets K/V are packed like Q, so the K/V arrays must "
            f"have total_q = {total_q} rows, got {total_kv}")
    else:
      check_offsets("kv_input_row_offsets", kv_input_row_offsets, batch)
  check_options(max_prompt_len=max_prompt_len, mask=mask, scale=scale,
                output_dtype=output_dtype, config=config, interpret=interpret,
                backend=backend, logits_soft_cap=logits_soft_cap)


def validate_if_concrete(input_row_offsets, kv_input_row_offsets, *, max_prompt_len,
                         total_q, k):
  """validate_offsets on whichever offsets are concrete, and a concrete paged cache's
  block table and cache lengths (under jit they are not checked)."""
  if is_concrete(input_row_offsets):
    _validate_one("input_row_offsets", input_row_offsets, total_q, max_prompt_len)
    if isinstance(k, PagedKV) and is_concrete(k.block_table) and is_concrete(
        k.cache_lengths):
      validate_paged(k, input_row_offsets)
  total_kv = None if isinstance(k, PagedKV) else k.shape[0]
  if kv_input_row_offsets is not None and is_concrete(kv_input_row_offsets):
    _validate_one("kv_input_row_offsets", kv_input_row_offsets, total_kv)


def check_sink_weights(sink_weights, num_heads):
  """None, or a float vector [num_heads]."""
  if sink_weights is None:
    return
  check_array("sink_weights", sink_weights, 1)
  if sink_weights.shape[0] != num_heads or not jnp.issubdtype(sink_weights.dtype,
                                                              jnp.floating):
    raise ValueError(f"sink_weights must be a float vector of num_heads = {num_heads}, "
                     f"got {sink_weights.dtype}{tuple(sink_weights.shape)}")
  if is_concrete(sink_weights):
    w = np.asarray(sink_weights, np.float32)
    bad = np.flatnonzero(~(np.isfinite(w) & (w <= SINK_MAX)))
    if bad.size:
      raise ValueError(f"sink_weights must be finite and at most {SINK_MAX:g} (the kernels "
                       f"take sink * log2(e) in float32), got sink_weights[{bad[0]}] = "
                       f"{w[bad[0]]:g} (a head without a sink: pass a large negative logit)")


def check_heads(num_heads, num_kv_heads):
  if num_heads < 1 or num_kv_heads < 1 or num_heads % num_kv_heads:
    raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                     f"({num_kv_heads}), both >= 1")


def validate_offsets(input_row_offsets, *, max_prompt_len, total_q,
                     kv_input_row_offsets=None, total_kv=None):
  """Checks concrete row offsets against the arrays they index; raises ValueError.

  Args:
    input_row_offsets: [batch + 1] int32/uint32 query row offsets.
    max_prompt_len: every sequence's query count must be at most this.
    total_q: rows of the packed query array.
    kv_input_row_offsets: optional [batch + 1] K/V row offsets.
    total_kv: rows of the packed K/V arrays (needed with kv_input_row_offsets).

  Raises:
    ValueError: the first offset is not 0, the offsets decrease, the last offset is past
      the array, a sequence has more than max_prompt_len queries (the message names the
      offending sequence), or the two offsets' lengths differ.
    TypeError: offsets that are not integers, or max_prompt_len, total_q or total_kv
      that is not an int (total_kv missing with kv_input_row_offsets).
  """
  for name, value in (("max_prompt_len", max_prompt_len), ("total_q", total_q)):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
      raise TypeError(f"validate_offsets' {name} must be an int, got {value!r}")
  if max_prompt_len <= 0:
    raise ValueError(f"max_prompt_len must be > 0, got {max_prompt_len}")
  _integer_offsets("input_row_offsets", input_row_offsets)
  _validate_one("input_row_offsets", input_row_offsets, total_q, max_prompt_len)
  if kv_input_row_offsets is not None:
    if total_kv is None:
      raise TypeError("validate_offsets needs total_kv, the rows of the K/V arrays, "
                      "to check kv_input_row_offsets")
    if isinstance(total_kv, (bool, np.bool_)) or not isinstance(total_kv,
                                                                (int, np.integer)):
      raise TypeError(f"validate_offsets' total_kv must be an int, got {total_kv!r}")
    _integer_offsets("kv_input_row_offsets", kv_input_row_offsets)
    _validate_one("kv_input_row_offsets", kv_input_row_offsets, total_kv)
    if np.shape(kv_input_row_offsets) != np.shape(input_row_offsets):
      raise ValueError(f"kv_input_row_offsets must have input_row_offsets' length, batch + "
                       f"1 = {np.shape(input_row_offsets)[0]}, got "
                       f"{np.shape(kv_input_row_offsets)[0]}")


def _integer_offsets(name, offsets):
  dtype = np.asarray(offsets).dtype
  if dtype == np.bool_ or not np.issubdtype(dtype, np.integer):
    raise TypeError(f"{name} must hold integers, got {dtype}")


def _validate_one(name, offsets, total, max_len=None):
  off = np.asarray(offsets).astype(np.int64)
  if off.ndim != 1 or off.shape[0] < 1:
    raise ValueError(f"{name} must be a vector of length batch + 1 >= 1, got {off.shape}")
  if off[0] != 0:
    raise ValueError(f"{name}[0] must be 0, got {off[0]}")
  lengths = np.diff(off)
  if (lengths < 0).any():
    b = int(np.argmax(lengths < 0))
    raise ValueError(f"{name} must be nondecreasing: {name}[{b + 1}] = {off[b + 1]} < "
                     f"{name}[{b}] = {off[b]}")
  if off[-1] > total:
    raise ValueError(f"{name}[-1] = {off[-1]} is past the {total} rows of the array")
  if max_len is not None and (lengths > max_len).any():
    b = int(np.argmax(lengths > max_len))
    raise ValueError(f"sequence {b} has {lengths[b]} queries, more than "
                     f"max_prompt_len = {max_len}")

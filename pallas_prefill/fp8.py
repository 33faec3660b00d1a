"""FP8 inputs (issue 24, work in progress): e4m3 / e5m2 Q, K, V with dequantization
scales, for ``mha_prefill``, ``mla_prefill`` (one ``q_scale`` for q's nope and rope
columns, one ``k_scale`` for k_nope and k_rope), ``dot_product_attention`` and paged
caches. The real values are the FP8 values times their scales; a scale is a float32
scalar, ``[num_kv_heads]`` or ``[batch, num_kv_heads]`` (FlashAttention-3's descale
shape; a query head uses its K/V head's). Q may instead be bf16/f16 over FP8 K/V (an FP8
KV cache); it then needs no scale (``backend="mosaic_gpu"`` quantizes it to e4m3 itself,
``mosaic_gpu.operands.quantized_q``).

``scales`` turns the three arguments into the two ``[batch, num_kv_heads]`` float32
arrays the kernels read: the logits' factor ``q_scale * k_scale`` (which multiplies the
softmax scale) and V's, which multiplies the output. ``quantize`` is the per-head absmax
quantization the tests (and users) start from.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_prefill.checks import check_array

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
FP8_MAX = {jnp.dtype(jnp.float8_e4m3fn): 448.0, jnp.dtype(jnp.float8_e5m2): 57344.0}


def is_fp8(dtype) -> bool:
  return jnp.dtype(dtype) in [jnp.dtype(d) for d in FP8_DTYPES]


def check_scale(name, scale, batch, num_kv_heads):
  """A validated scale as [batch, num_kv_heads] float32 (broadcast from a scalar or
  [num_kv_heads])."""
  if scale is None:
    raise ValueError(f"{name} is needed with FP8 inputs (the dequantization scale)")
  if isinstance(scale, (int, float)) and not isinstance(scale, bool):
    scale = jnp.float32(scale)
  shape = getattr(scale, "shape", None)
  if shape is None or not hasattr(scale, "dtype"):
    raise TypeError(f"{name} must be a float32 array or a Python float, got "
                    f"{type(scale).__name__}")
  if jnp.dtype(scale.dtype) != jnp.dtype(jnp.float32):
    raise TypeError(f"{name} must be float32, got {scale.dtype}")
  if tuple(shape) not in ((), (num_kv_heads,), (batch, num_kv_heads)):
    raise ValueError(f"{name} must be a scalar, [num_kv_heads] = [{num_kv_heads}] or "
                     f"[batch, num_kv_heads] = [{batch}, {num_kv_heads}], got {tuple(shape)}")
  if not isinstance(scale, jax.core.Tracer):
    _check_normal(name, np.asarray(scale, np.float32))
  return jnp.broadcast_to(scale, (batch, num_kv_heads))


def _check_normal(name, values):
  """Raises unless every float32 value is finite and at least float32's smallest normal
  (a GPU flushes a subnormal scale to zero, which would zero the values it scales)."""
  good = np.isfinite(values) & (values >= np.finfo(np.float32).tiny)
  if not good.all():
    raise ValueError(f"{name} must be finite and at least float32's smallest normal "
                     f"{np.finfo(np.float32).tiny:.4g} (a dequantization scale; a GPU "
                     f"flushes smaller ones to zero), got {values[~good].flat[0]}")


def scales(q, k, v, q_scale, k_scale, v_scale, *, batch, num_kv_heads,
           names=("q", "k", "v")):
  """None for inputs without FP8, else (qk_scale, v_scale), each [batch, num_kv_heads]
  float32. Raises for FP8 mixed with wider K/V, a float32 q over FP8 K/V, missing scales,
  and scales where no input is FP8. ``names`` are the entry point's for q, k and v."""
  q_name, k_name, v_name = names
  fp8 = {name: is_fp8(x.dtype) for name, x in (("q", q), ("k", k), ("v", v))}
  if not fp8["k"] and not fp8["v"]:
    if fp8["q"]:
      raise TypeError(f"FP8 {q_name} needs FP8 {k_name} and {v_name}, got {k_name} "
                      f"{k.dtype}, {v_name} {v.dtype}")
    given = [n for n, s in (("q_scale", q_scale), ("k_scale", k_scale),
                            ("v_scale", v_scale)) if s is not None]
    if given:
      verb = "applies" if len(given) == 1 else "apply"
      raise ValueError(f"{', '.join(given)} {verb} to FP8 inputs only; {q_name}, {k_name}, "
                       f"{v_name} are {q.dtype}")
    return None
  if jnp.dtype(k.dtype) != jnp.dtype(v.dtype):
    raise TypeError(f"{k_name} and {v_name} must share an FP8 dtype, got {k.dtype} and "
                    f"{v.dtype}")
  qk = check_scale("k_scale", k_scale, batch, num_kv_heads)
  if fp8["q"]:
    qk = qk * check_scale("q_scale", q_scale, batch, num_kv_heads)
    if not isinstance(qk, jax.core.Tracer):  # the kernels apply the product, in float32
      _check_normal("q_scale * k_scale", np.asarray(qk, np.float32))
  elif jnp.dtype(q.dtype).itemsize != 2:
    raise TypeError(f"{q_name} over FP8 {k_name}/{v_name} must be FP8, bfloat16 or "
                    f"float16, got {q.dtype}")
  elif q_scale is not None:
    raise ValueError(f"q_scale applies to an FP8 {q_name}; {q_name} is {q.dtype} (used as "
                     "given)")
  return qk, check_scale("v_scale", v_scale, batch, num_kv_heads)


def output_dtype_for(q_dtype):
  """The default output dtype of a call with FP8 inputs: bf16 for an FP8 q, else q's."""
  return jnp.dtype(jnp.bfloat16) if is_fp8(q_dtype) else jnp.dtype(q_dtype)


def absmax_scale(x, groups=None, dtype=jnp.float8_e4m3fn):
  """The absmax dequantization scale of x [rows, heads, depth], float32 [groups]: one per
  group of heads // groups consecutive heads (None: one per head), the largest magnitude
  of the group's finite values over the dtype's largest value (1 for a group without a
  finite nonzero value, no rows included). NaN and inf do not count, so that one of
  them leaves the rest of its group's scale as it would be."""
  groups = x.shape[1] if groups is None else groups
  magnitude = jnp.abs(x.astype(jnp.float32))
  magnitude = jnp.where(jnp.isfinite(magnitude), magnitude, 0.0)
  per_group = (x.shape[1] // groups) * x.shape[2]
  top = jnp.max(magnitude.reshape(x.shape[0], groups, per_group), axis=(0, 2), initial=0.0)
  return scale_for_absmax(top, dtype)


def scale_for_absmax(top, dtype=jnp.float8_e4m3fn):
  """The dequantization scale (float32, top's shape) that puts values of largest magnitude
  ``top`` (float32, >= 0) at the dtype's largest value: top / FP8_MAX, at least float32's
  smallest normal (a GPU flushes a subnormal scale to zero, and x / 0 is no FP8 value);
  1 where top is 0."""
  scale = jnp.maximum(top / FP8_MAX[jnp.dtype(dtype)], jnp.finfo(jnp.float32).tiny)
  return jnp.where(top > 0, scale, 1.0).astype(jnp.float32)


def quantize(x, dtype=jnp.float8_e4m3fn):
  """Per-head absmax quantization of x [rows, heads, depth]: (x8, scale [heads] float32)
  with x ~= x8 * scale and each head's largest finite magnitude at the dtype's largest
  value (``absmax_scale``). NaN stays NaN; inf becomes e5m2's inf, and NaN in e4m3fn,
  which has no inf. Raises ValueError for another rank, TypeError for a dtype that is
  not float8_e4m3fn or float8_e5m2."""
  check_array("x", x, 3)
  if not is_fp8(dtype):
    raise TypeError(f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype!r}")
  scale = absmax_scale(x, dtype=dtype)
  return (x.astype(jnp.float32) / scale[None, :, None]).astype(dtype), scale

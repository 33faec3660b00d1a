"""``dot_product_attention``: the prefill kernels on the layouts JAX model code holds,
padded batches ``[batch, seq, heads, depth]`` with per-row lengths (``jax.nn``'s
``query_seq_lengths`` / ``key_value_seq_lengths``) or packed rows with segment ids
(MaxText's ``decoder_segment_ids``, Levanter's and splash attention's ``segment_ids``).

Nothing is repacked. The arrays are viewed as ``[batch * seq, heads, depth]`` (a reshape,
no copy), and each batch row becomes a run of ragged sequences over those rows: its
sequences (the first L rows, or each maximal run of equal segment ids) with their keys,
and between them the padding rows as sequences without keys, which the kernels write as
zeros. Row r of batch row b is row ``b * seq + r`` of the view, so the kernels read every
token where it already is; K/V rows are given as a start and an end per sequence
(``dispatch.ragged_attention``'s ``kv_rows``), as FlashAttention-3's ``seqused_k``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_prefill import dispatch
from pallas_prefill import fp8
from pallas_prefill import masks as masks_lib
from pallas_prefill import mha
from pallas_prefill import partitioning
from pallas_prefill import validation as val
from pallas_prefill.constants import EMPTY_ROW_LSE
from pallas_prefill.paged import PagedKV

LENGTH_DTYPES = (jnp.int32, jnp.uint32)


def run_starts(ids, padding_id, xp=jnp):
  """(real, new_run), each [batch, seq] bool, for segment ids [batch, seq] (concrete or
  traced): which tokens are not ``padding_id`` (None: all), and which of those start a
  run, a maximal stretch of equal ids without padding. The one definition of a run that
  ``segment_runs``, the concrete checks and the reference share. ``xp``: jnp, or np for
  concrete ids inside a jit (where jnp would stage them)."""
  real = xp.ones(ids.shape, bool) if padding_id is None else ids != padding_id
  prev_real = xp.pad(real[:, :-1], ((0, 0), (1, 0)))
  prev_id = xp.pad(ids[:, :-1], ((0, 0), (1, 0)))
  return real, real & (~prev_real | (ids != prev_id))


def segment_runs(ids, padding_id, max_segments):
  """Each batch row's sequences in segment ids ``[batch, seq]``: every maximal run of
  equal ids that are not ``padding_id`` (None: no padding) is one. Returns (starts,
  lengths), each ``[batch, max_segments]`` int32: run k of row b is tokens
  ``[starts[b, k], starts[b, k] + lengths[b, k])``; rows with fewer runs end with empty
  runs at ``seq``; runs past ``max_segments`` are dropped (their tokens count as padding).
  Plain jnp, traced ids welcome."""
  batch, seq = ids.shape
  real, new_run = run_starts(ids, padding_id)
  run = jnp.cumsum(new_run, axis=1, dtype=jnp.int32) - 1  # each real token's run
  keep = real & (run < max_segments)
  rows = jnp.broadcast_to(jnp.arange(batch, dtype=jnp.int32)[:, None], ids.shape)
  slot = jnp.where(keep, run, max_segments)  # max_segments: dropped
  tokens = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32)[None, :], ids.shape)
  starts = jnp.full((batch, max_segments), seq, jnp.int32).at[rows, slot].min(
      tokens, mode="drop")
  lengths = jnp.zeros((batch, max_segments), jnp.int32).at[rows, slot].add(
      keep.astype(jnp.int32), mode="drop")
  return starts, lengths


def sequences_per_row(runs: int) -> int:
  """The ragged sequences ``ragged_layout`` makes of a batch row of ``runs`` runs."""
  return 2 * runs + 1


def ragged_layout(q_runs, kv_runs, q_seq, kv_seq):
  """The ragged description of padded rows: q_runs and kv_runs are (starts, lengths)
  ``[batch, m]`` within each batch row (query run k attends over K/V run k). Returns
  (q_offsets ``[batch * (2m + 1) + 1]``, kv_starts, kv_ends ``[batch * (2m + 1)]``) over
  the ``[batch * seq, ...]`` views: per batch row the padding before its first run, then
  each run followed by the padding after it; padding sequences have no keys."""
  (qs, ql), (ks, kl) = q_runs, kv_runs
  batch, m = qs.shape
  qs = jnp.clip(qs, 0, q_seq)
  qe = jnp.clip(qs + jnp.clip(ql, 0, None), qs, q_seq)
  # A run cannot start before the previous one ends: the offsets must not decrease.
  qe = jax.lax.cummax(qe, axis=1)
  qs = jnp.minimum(qs, qe)
  base = jnp.arange(batch, dtype=jnp.int32)[:, None] * q_seq
  bounds = jnp.stack([qs, qe], axis=2).reshape(batch, 2 * m) + base
  q_offsets = jnp.concatenate(
      [jnp.concatenate([base, bounds], axis=1).reshape(-1),
       jnp.full((1,), batch * q_seq, jnp.int32)])
  kv_base = jnp.arange(batch, dtype=jnp.int32)[:, None] * kv_seq
  ks = jnp.clip(ks, 0, kv_seq)
  ke = jnp.clip(ks + jnp.clip(kl, 0, None), ks, kv_seq)
  zeros = jnp.zeros((batch, m), jnp.int32)
  # Per row: [lead gap, (run, gap) * m]; a gap's keys are the empty range [0, 0).
  def per_seq(run_value):
    pairs = jnp.stack([run_value, zeros], axis=2).reshape(batch, 2 * m)
    return jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), pairs], axis=1).reshape(-1)
  kv_starts = per_seq(jnp.where(ke > ks, ks + kv_base, 0))
  kv_ends = per_seq(jnp.where(ke > ks, ke + kv_base, 0))
  return q_offsets.astype(jnp.int32), kv_starts, kv_ends


def window_mask(is_causal, local_window_size):
  """The ``pallas_prefill.masks`` mask for jax.nn's ``is_causal`` and
  ``local_window_size`` (an int w means (w, w): query i sees keys [i - left, i + right])."""
  if not isinstance(is_causal, (bool, np.bool_)):
    raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
  if local_window_size is None:
    return masks_lib.CausalMask() if is_causal else masks_lib.NullMask()
  window = local_window_size
  if isinstance(window, (int, np.integer)) and not isinstance(window, bool):
    window = (int(window), int(window))
  if (not isinstance(window, (tuple, list)) or len(window) != 2 or any(
      isinstance(w, bool) or not isinstance(w, (int, np.integer)) for w in window)):
    raise TypeError("local_window_size must be None, an int or a (left, right) pair of "
                    f"ints, got {local_window_size!r}")
  left, right = (int(w) for w in window)
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size must be non-negative, got {local_window_size!r}")
  if left >= masks_lib.MAX_SPAN or (right >= masks_lib.MAX_SPAN and not is_causal):
    raise ValueError(f"local_window_size must be below 2**30 on each side (the right one "
                     f"is hidden by is_causal), got {local_window_size!r}")
  if right > 0 and not is_causal:
    raise ValueError(
        f"local_window_size={local_window_size!r} without is_causal lets queries see "
        f"{right} keys to their right, which the masks cannot express: they support "
        "(left, 0), with or without is_causal, and any window with is_causal=True (which "
        "hides the right side)")
  return masks_lib.SlidingWindowCausalMask(left + 1)


def _check_lengths(name, lengths, batch, size):
  if lengths is None:
    return
  val.check_array(name, lengths, 1)
  if jnp.dtype(lengths.dtype) not in [jnp.dtype(d) for d in LENGTH_DTYPES]:
    raise TypeError(f"{name} must be int32 (or uint32), got {lengths.dtype}")
  if lengths.shape[0] != batch:
    raise ValueError(f"{name} must have shape [batch] = [{batch}], got "
                     f"{tuple(lengths.shape)}")
  if val.is_concrete(lengths):
    arr = np.asarray(lengths).astype(np.int64)
    bad = np.flatnonzero((arr < 0) | (arr > size))
    if bad.size:
      raise ValueError(f"{name}[{bad[0]}] = {arr[bad[0]]} is outside [0, {size}], the "
                       "padded length of its axis")


def _check_ids(name, ids, batch, size):
  val.check_array(name, ids, 2)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array (int32), got {ids.dtype}")
  if tuple(ids.shape) != (batch, size):
    raise ValueError(f"{name} must have shape [batch, seq] = [{batch}, {size}], got "
                     f"{tuple(ids.shape)}")


def _check_ids_fit(name, ids):
  """Concrete ids of a dtype JAX narrows (NumPy int64 / uint64 without jax_enable_x64)
  must fit in the narrower one: JAX wraps them silently (2**32 + 1 becomes 1), which
  would merge runs, or make tokens padding, that the ids keep apart."""
  stored = jax.dtypes.canonicalize_dtype(ids.dtype)
  if stored == jnp.dtype(ids.dtype) or not val.is_concrete(ids):
    return
  info, arr = np.iinfo(stored), np.asarray(ids)
  bad = np.argwhere((arr < info.min) | (arr > info.max))
  if bad.size:
    b, i = (int(x) for x in bad[0])
    raise ValueError(f"{name}[{b}, {i}] = {arr[b, i]} does not fit in {stored}, the dtype "
                     f"JAX holds {ids.dtype} in (jax_enable_x64 is off): distinct ids "
                     f"would wrap to equal ones; pass {stored} ids")


def _runs_needed(ids, padding_id) -> int:
  """The most sequences any row of concrete segment ids holds (counted in NumPy: inside a
  jit, jnp would stage even concrete ids)."""
  _, new_run = run_starts(np.asarray(ids), padding_id, xp=np)
  return int(new_run.sum(axis=1).max(initial=0))


def _segment_pair(segment_ids, padding_segment_id, max_segments, batch, t, s):
  """Validated (q_ids, kv_ids, max_segments) for the segment-id layout."""
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError("segment_ids must be one [batch, seq] array or a (q_ids, kv_ids) "
                       f"pair, got a sequence of {len(segment_ids)}")
    q_ids, kv_ids = segment_ids
  else:
    if s != t:
      raise ValueError(f"one segment_ids array needs query and key/value of one length; "
                       f"got {t} and {s}: pass a (q_ids, kv_ids) pair")
    q_ids = kv_ids = segment_ids
  names = ("segment_ids (queries)", "segment_ids (keys/values)")
  _check_ids(names[0], q_ids, batch, t)
  _check_ids(names[1], kv_ids, batch, s)
  if padding_segment_id is not None and (
      isinstance(padding_segment_id, bool)
      or not isinstance(padding_segment_id, (int, np.integer))):
    raise TypeError(f"padding_segment_id must be a static int or None, got "
                    f"{padding_segment_id!r}")
  if padding_segment_id is not None and not -2**31 <= padding_segment_id < 2**31:
    raise ValueError(f"padding_segment_id must fit in int32, got {padding_segment_id!r}")
  for name, ids in zip(names, (q_ids, kv_ids)):
    info = np.iinfo(ids.dtype)
    if padding_segment_id is not None and not info.min <= padding_segment_id <= info.max:
      raise ValueError(f"padding_segment_id {padding_segment_id} is not a value of {name}'s "
                       f"dtype {ids.dtype} ([{info.min}, {info.max}]): no token would be "
                       "padding")
  for name, ids in zip(names, (q_ids, kv_ids)):
    _check_ids_fit(name, ids)
  concrete = val.is_concrete(q_ids) and val.is_concrete(kv_ids)
  needed = {name: _runs_needed(ids, padding_segment_id)  # counted once, used twice
            for name, ids in zip(names, (q_ids, kv_ids))} if concrete else {}
  if max_segments is None:
    if not concrete:
      raise ValueError("max_segments (a static int bounding the sequences per batch row) "
                       "is needed with traced segment_ids")
    exact = max(1, *needed.values())
    max_segments = 1 << (exact - 1).bit_length()  # fewer recompilations
    if batch * sequences_per_row(max_segments) > dispatch.MAX_GRID_DIM:
      max_segments = exact  # not past the launch grid's limit where the count fits it
  if isinstance(max_segments, bool) or not isinstance(max_segments, (int, np.integer)) or (
      max_segments < 1):
    raise ValueError(f"max_segments must be a static int >= 1, got {max_segments!r}")
  for name, need in needed.items():
    if need > max_segments:
      raise ValueError(f"{name} hold {need} sequences in one batch row, more than "
                       f"max_segments = {max_segments}")
  return q_ids, kv_ids, int(max_segments)


def dot_product_attention(query, key, value, *, query_seq_lengths=None,
                          key_value_seq_lengths=None, is_causal=False,
                          local_window_size=None, scale=None, sink_weights=None,
                          logits_soft_cap=None, segment_ids=None, padding_segment_id=None,
                          max_segments=None, output_dtype=None, return_lse=False,
                          backend=None, interpret=None, config=None, q_scale=None,
                          k_scale=None, v_scale=None):
  """Attention over a padded batch, with ``jax.nn.dot_product_attention``'s layout and
  meaning, computing only the real tokens. Forward only, as ``mha_prefill``.

  Args:
    query: [batch, T, num_heads, head_dim], bfloat16, float16 or float32; with FP8 key
      and value also float8_e4m3fn / float8_e5m2 (with q_scale).
    key: [batch, S, num_kv_heads, head_dim], same dtype (or FP8 under a bf16/f16 query);
      num_heads % num_kv_heads == 0.
    value: [batch, S, num_kv_heads, head_dim_v], key's dtype.
    query_seq_lengths: optional [batch] int32: the first L rows of each batch row are
      real queries (default T); the others output zeros.
    key_value_seq_lengths: optional [batch] int32: the first L rows of each batch row are
      real keys (default S).
    is_causal: as in ``jax.nn``: query i sees keys j <= i of its row (or segment); the
      positions start at 0 for queries and keys alike (top-left), also when T != S.
    local_window_size: None, an int w (the window (w, w)) or (left, right): query i sees
      keys [i - left, i + right]. Supported: right == 0, or any window with is_causal
      (which hides the right side); other windows raise ValueError.
    scale: the logit scale, a static float; default 1/sqrt(head_dim).
    sink_weights: optional [num_heads] float attention-sink logits (``mha_prefill``'s).
    logits_soft_cap: None, or a static float cap > 0: logits become
      ``cap * tanh(logits / cap)`` after the scale, before the mask.
    segment_ids: optional [batch, T] integer ids shared by queries and keys (T == S), or a
      pair (q_ids [batch, T], kv_ids [batch, S]) for cross-attention: each maximal run of
      equal ids in a row is one sequence (the k-th query run attends over the k-th key
      run), positions restart at each run, and tokens whose id is
      ``padding_segment_id`` are padding. Not together with the lengths. Unlike the
      id-equality masks of MaxText or splash attention, an id repeated in separate runs
      of a row (e.g. [1, 1, 2, 2, 1, 1]) makes separate sequences.
    padding_segment_id: the static int id of padding tokens (MaxText: 0, Levanter: -1);
      None: every token belongs to a sequence.
    max_segments: static int bound on the sequences per batch row; None: counted from
      concrete segment ids (rounded up to a power of two, unless that would exceed the
      launch grid's limit below where the count itself does not), required under jit.
    q_scale, k_scale, v_scale: FP8 inputs' float32 dequantization scales, as in
      ``mha_prefill`` (issue 24; what runs where is said there: e4m3 on Mosaic GPU,
      e5m2 and a bf16/f16 query on Triton under ``auto``): each a scalar, [num_kv_heads]
      or [batch, num_kv_heads], batch being the padded batch's rows (every sequence of a
      row, segments included, takes its row's scale); the real values are the FP8 values
      times the scales. q_scale
      only with an FP8 query. A bf16/f16 query over FP8 key and value is quantized to
      e4m3 on Mosaic GPU (``backend="mosaic_gpu"``) as ``mha_prefill`` says, one scale
      per (sequence: a row's real queries or a segment run, K/V head), and used as given
      on Triton.
    output_dtype: default query's dtype (bfloat16 for an FP8 query).
    return_lse: also return the float32 natural-log log-sum-exp [batch, T, num_heads]
      (padding rows: -1e30).
    backend: None or "auto" (Mosaic GPU on Hopper where it serves, Triton in programs
      over several devices and elsewhere), "triton" or "mosaic_gpu", as in ``mha_prefill``.
    interpret: the Pallas interpreter; None: exactly on the CPU.
    config: None (the tuned default), or an ``MhaConfig`` / ``MosaicConfig`` as in
      ``mha_prefill``.

  Padding rows of key and value are never used, but on Mosaic GPU they must be finite
  (rows next to a sequence's keys enter its matrix products with weight zero, and
  0 * NaN is NaN, as in ``jax.nn``'s XLA implementation); Triton reads none of them.

  Returns:
    out [batch, T, num_heads, head_dim_v] in output_dtype (rows past a query length, or
    of padding tokens, are zeros), or (out, lse) when return_lse. On the real rows it
    equals ``jax.nn.dot_product_attention(..., implementation="xla")`` with the same
    arguments to rounding (queries that see no key output zeros).

  Raises:
    TypeError, ValueError: static problems naming the argument (ranks, shapes, dtypes,
      head counts, FP8 scales missing, misshapen, not float32 or without FP8 inputs, an
      FP8 query over wider key and value, lengths or segment ids of the wrong shape or
      dtype, lengths with segment ids, a window the masks cannot express,
      logits_soft_cap <= 0), concrete lengths outside [0, T] or [0, S], concrete
      segment ids with more sequences in a row than max_segments, concrete 64-bit
      segment ids (NumPy int64 / uint64) that do not fit in the int32 / uint32 JAX holds
      them in without jax_enable_x64, concrete sink weights
      that are not finite or above 1e38 and concrete FP8 scales (or an FP8 query's
      q_scale * k_scale) that are not finite or below float32's smallest normal; more
      than 65535 sequences in all (batch * (2 * max_segments + 1), a launch grid's
      limit). Under jit nothing checks values: lengths and runs are clamped, so garbage
      gives garbage rows but no access outside the arrays or NaN.
    NotImplementedError: backend="mosaic_gpu" for a call that kernel cannot serve; an
      operand being differentiated (the kernels are forward only).
  """
  val.check_forward_only("dot_product_attention", dict(
      query=query, key=key, value=value, sink_weights=sink_weights, q_scale=q_scale,
      k_scale=k_scale, v_scale=v_scale))
  batch, t, s, num_heads, num_kv_heads, head_dim = _check_arrays(query, key, value)
  scales = fp8.scales(query, key, value, q_scale, k_scale, v_scale, batch=batch,
                      num_kv_heads=num_kv_heads, names=("query", "key", "value"))
  if scales is not None and output_dtype is None:
    output_dtype = fp8.output_dtype_for(query.dtype)
  mask = window_mask(is_causal, local_window_size)
  val.check_sink_weights(sink_weights, num_heads)
  layout, max_segments = _sequences(
      query_seq_lengths, key_value_seq_lengths, segment_ids, padding_segment_id,
      max_segments, batch, t, s)
  per_row = sequences_per_row(max_segments or 1)  # lengths: one run per row
  if batch * per_row > dispatch.MAX_GRID_DIM:
    what = (f"max_segments = {max_segments}" if layout[0] == "segments"
            else "one sequence per row")
    raise ValueError(f"batch ({batch}) x {per_row} ragged sequences per row ({what}) must "
                     f"be at most {dispatch.MAX_GRID_DIM} (a launch grid's limit): split the "
                     "batch, or lower max_segments")
  val.check_options(max_prompt_len=max(t, 1), mask=mask, scale=scale,
                    output_dtype=output_dtype, config=config, interpret=interpret,
                    backend=backend, logits_soft_cap=logits_soft_cap)
  operands = (query, key, value, *layout[1:], sink_weights, scales)
  static = dispatch.static_options(
      query, operands=operands, depth=head_dim, max_prompt_len=max(t, 1), mask=mask,
      scale=scale, output_dtype=output_dtype, return_lse=return_lse, config=config,
      interpret=interpret, backend=backend, logits_soft_cap=logits_soft_cap)
  impl = partitioning.implementation(_padded_attention, *operands)
  return impl(*operands,
              segments=layout[0] == "segments", padding_segment_id=padding_segment_id,
              max_segments=max_segments, **static)


def _check_arrays(query, key, value):
  """``dot_product_attention``'s static checks of its three arrays (ranks, dtypes, batch,
  lengths, heads and depths); returns (batch, T, S, num_heads, num_kv_heads, head_dim)."""
  for name, x in (("query", query), ("key", key), ("value", value)):
    if isinstance(x, PagedKV):
      raise TypeError(f"{name} must be a [batch, seq, heads, depth] array: a PagedKV "
                      "cache goes to mha_prefill or mla_prefill")
    val.check_array(name, x, 4)
    val.check_float_dtype(name, x, fp8_ok=True)
  has_fp8 = any(fp8.is_fp8(x.dtype) for x in (query, key, value))
  if not has_fp8 and len({jnp.dtype(x.dtype) for x in (query, key, value)}) > 1:
    raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, "
                    f"{key.dtype}, {value.dtype}")
  batch, t, num_heads, head_dim = query.shape
  if key.shape[0] != batch or value.shape[0] != batch:
    raise ValueError(f"query, key and value must share the batch size, got {query.shape}, "
                     f"{key.shape}, {value.shape}")
  if key.shape[:3] != value.shape[:3]:
    raise ValueError(f"key and value must agree in batch, length and heads: key "
                     f"{key.shape}, value {value.shape}")
  if key.shape[-1] != head_dim:
    raise ValueError(f"query and key head dims differ: query {query.shape}, key {key.shape}")
  s, num_kv_heads = key.shape[1:3]
  val.check_heads(num_heads, num_kv_heads)
  val.check_head_dim("head_dim", head_dim)
  val.check_head_dim("head_dim_v", value.shape[-1])
  return batch, t, s, num_heads, num_kv_heads, head_dim


def _sequences(query_seq_lengths, key_value_seq_lengths, segment_ids, padding_segment_id,
               max_segments, batch, t, s):
  """How ``dot_product_attention``'s caller describes the sequences, checked: (("lengths",
  q_lengths, kv_lengths) or ("segments", q_ids, kv_ids), max_segments)."""
  if segment_ids is not None:
    if query_seq_lengths is not None or key_value_seq_lengths is not None:
      raise ValueError("segment_ids and query_seq_lengths/key_value_seq_lengths describe "
                       "the sequences twice: pass one or the other")
    q_ids, kv_ids, max_segments = _segment_pair(segment_ids, padding_segment_id,
                                                max_segments, batch, t, s)
    return ("segments", q_ids, kv_ids), max_segments
  if padding_segment_id is not None or max_segments is not None:
    raise ValueError("padding_segment_id and max_segments go with segment_ids")
  _check_lengths("query_seq_lengths", query_seq_lengths, batch, t)
  _check_lengths("key_value_seq_lengths", key_value_seq_lengths, batch, s)
  return ("lengths", query_seq_lengths, key_value_seq_lengths), max_segments


@functools.partial(jax.jit, static_argnames=dispatch.STATIC_OPTIONS + (
    "segments", "padding_segment_id", "max_segments"))
def _padded_attention(query, key, value, q_info, kv_info, sink_weights, scales, *,
                      segments, padding_segment_id, max_segments, **static):
  """The padded layout under jit: the ragged description (``ragged_layout``), the kernel
  on the ``[batch * seq, heads, depth]`` views, the outputs viewed back. FP8 ``scales``
  ([batch, num_kv_heads] each) are repeated for each batch row's ragged sequences."""
  batch, t, num_heads, _ = query.shape
  s = key.shape[1]
  if segments:
    q_runs = segment_runs(q_info, padding_segment_id, max_segments)
    kv_runs = segment_runs(kv_info, padding_segment_id, max_segments)
  else:
    def whole(lengths, size):
      lengths = (jnp.full((batch,), size, jnp.int32) if lengths is None
                 else jnp.clip(lengths.astype(jnp.int32), 0, size))
      return jnp.zeros((batch, 1), jnp.int32), lengths[:, None]
    q_runs, kv_runs = whole(q_info, t), whole(kv_info, s)
  q_offsets, kv_starts, kv_ends = ragged_layout(q_runs, kv_runs, t, s)
  if scales is not None:
    per_row = sequences_per_row(q_runs[0].shape[1])
    scales = tuple(jnp.repeat(x, per_row, axis=0) for x in scales)
  flat = lambda x: x.reshape((-1,) + x.shape[2:])  # noqa: E731  (a view: no copy)
  out = mha.head_parallel_mha(flat(query), flat(key), flat(value), q_offsets, kv_starts,
                              kv_ends, sink_weights, scales, top_left=True, padded=True,
                              **static)
  if not static["return_lse"]:
    return out.reshape(batch, t, num_heads, value.shape[-1])
  out, lse = out
  if sink_weights is not None:
    # Padding rows see no key but would report the sink's LSE: they are no query's.
    starts, lengths = q_runs
    r = jnp.arange(t, dtype=jnp.int32)[None, :, None]
    real = ((r >= starts[:, None, :]) & (r < starts[:, None, :] + lengths[:, None, :])).any(
        axis=2)
    lse = jnp.where(real.reshape(-1)[:, None], lse, EMPTY_ROW_LSE)
  return out.reshape(batch, t, num_heads, value.shape[-1]), lse.reshape(batch, t, num_heads)


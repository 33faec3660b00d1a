"""The case matrix every backend is held to: interpret mode on the CPU and compiled on the
GPU run the same cases through `check_case`."""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

import pallas_prefill as pp
from pallas_prefill import masks

CAUSAL = masks.CausalMask()


@dataclasses.dataclass(frozen=True)
class Case:
  kind: str = "mha"  # or "mla": head_dim is then d_nope, and rope_dim is d_rope
  rope_dim: int = 32
  shared_rope: bool = True  # MLA: k_rope has 1 head (DeepSeek) or num_kv_heads
  scale: float | None = None
  lens: tuple[int, ...] = (0, 1, 37, 100, 64, 19)  # a 0- and a 1-length sequence
  kv_lens: tuple[int, ...] | None = None  # None: K/V packed like Q
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 64
  head_dim_v: int | None = None
  dtype: str = "bfloat16"
  mask: object = CAUSAL
  sink: bool = False
  lse: bool = False
  output_dtype: str | None = None
  offsets_dtype: str = "int32"
  page_size: int | None = None  # K/V in a shuffled paged cache (kv_lens give cache + new)
  soft_cap: float | None = None  # logits_soft_cap
  extra_prompt_len: int = 9  # max_prompt_len beyond the longest sequence
  extra_rows: int = 5  # rows past offsets[-1], which must come out zero
  config: pp.MhaConfig | None = pp.MhaConfig(block_q=32, block_kv=16, num_warps=4,
                                              num_stages=2)

  @property
  def name(self) -> str:
    """The fields that differ from the defaults, a config by its own such fields (so
    that ``pytest -k`` on an option's name selects the cases that set it)."""
    fields = []
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if value != f.default:
        fields.append(f"{f.name}={_short(value)}")
    return ",".join(fields) or "base"


def _short(value) -> str:
  """A dataclass instance (``MosaicConfig``, its ``MosaicOptions``) as its type and the
  fields that differ from their defaults (or have none); anything else as ``str``."""
  if not dataclasses.is_dataclass(value) or isinstance(value, type):
    return str(value)
  changed = [f"{f.name}={_short(getattr(value, f.name))}" for f in dataclasses.fields(value)
             if f.default is dataclasses.MISSING or getattr(value, f.name) != f.default]
  return f"{type(value).__name__}({','.join(changed)})"


def _cases():
  base = Case()
  r = dataclasses.replace
  return [
      base,
      r(base, config=None),  # the defaults
      r(base, lens=(128, 64, 5), extra_prompt_len=0, extra_rows=0),  # block multiples
      r(base, kv_heads=4),  # MHA
      r(base, kv_heads=1),  # MQA
      r(base, heads=8, kv_heads=2),  # GQA 4
      r(base, mask=masks.NullMask()),
      r(base, mask=masks.SlidingWindowCausalMask(24)),
      r(base, mask=masks.SlidingWindowCausalMask(1)),
      r(base, mask=masks.ChunkedCausalMask(32)),
      r(base, mask=masks.ChunkedCausalMask(20)),
      r(base, sink=True),
      r(base, sink=True, lse=True, mask=masks.SlidingWindowCausalMask(24)),
      r(base, lse=True),
      r(base, lse=True, output_dtype="float32"),
      r(base, offsets_dtype="uint32"),
      r(base, head_dim=96),
      r(base, head_dim=128),
      r(base, head_dim=256, config=None),
      r(base, head_dim=80, head_dim_v=48),
      r(base, dtype="float16"),
      r(base, dtype="float32"),
      r(base, dtype="float32", output_dtype="bfloat16", lse=True),
      # A cached prefix: K/V longer than the queries (chunked prefill).
      r(base, kv_lens=(5, 1, 90, 100, 64, 50)),
      r(base, kv_lens=(5, 1, 90, 100, 64, 50), mask=masks.SlidingWindowCausalMask(24)),
      r(base, kv_lens=(5, 1, 90, 100, 64, 50), mask=masks.ChunkedCausalMask(32), lse=True),
      # Cross-attention: fewer keys than queries, some queries see none.
      r(base, kv_lens=(3, 0, 10, 60, 64, 0), mask=masks.NullMask(), lse=True),
      r(base, kv_lens=(3, 0, 10, 60, 64, 0), mask=CAUSAL, lse=True),
      r(base, kv_lens=(3, 0, 10, 60, 64, 0), mask=CAUSAL, sink=True, lse=True),
      r(base, soft_cap=1.5),  # a cap that bends most logits
      r(base, soft_cap=30.0, sink=True, lse=True, mask=masks.SlidingWindowCausalMask(24)),
      r(base, soft_cap=2.0, kv_lens=(3, 0, 10, 60, 64, 0), lse=True),
      # A negative scale: no folding into exp2 without a cap (the row maximum would not
      # commute with it), the cap folded with one (Mosaic GPU's ``scaled_scores``).
      r(base, scale=-0.3),
      r(base, scale=-0.3, soft_cap=2.0, lse=True),
      r(base, head_dim=32),  # Mosaic GPU pads it to 64
      r(base, lens=(0,), extra_prompt_len=16, extra_rows=3),  # nothing to attend
      r(base, lens=(200,), kv_heads=1, mask=masks.SlidingWindowCausalMask(40),
        extra_prompt_len=0),
  ]


def _mla_cases():
  base = Case(kind="mla", heads=4, kv_heads=4, head_dim=64, rope_dim=32)
  r = dataclasses.replace
  return [
      base,
      r(base, shared_rope=False),
      r(base, kv_heads=2),  # GQA latent
      r(base, kv_heads=2, shared_rope=False, lse=True),
      r(base, head_dim=128, rope_dim=64, config=None),  # DeepSeek's depths, fewer heads
      r(base, mask=masks.NullMask()),
      r(base, mask=masks.SlidingWindowCausalMask(24)),
      r(base, mask=masks.ChunkedCausalMask(32), lse=True),
      r(base, lse=True, output_dtype="float32"),
      r(base, scale=0.05),
      r(base, kv_lens=(5, 1, 90, 100, 64, 50), lse=True),
      r(base, kv_lens=(3, 0, 10, 60, 64, 0), mask=masks.NullMask(), lse=True),
      r(base, kv_lens=(3, 0, 10, 60, 64, 0), lse=True),
      r(base, head_dim=48, rope_dim=24, head_dim_v=40),  # padded depths
      r(base, dtype="float16", offsets_dtype="uint32"),
      r(base, soft_cap=1.5, lse=True),
      r(base, head_dim=64, rope_dim=32, head_dim_v=64, shared_rope=True),  # MiniCPM3
      r(base, dtype="float32"),
  ]


CASES = _cases()
MLA_CASES = _mla_cases()


def random_case(rng, *, large: bool = False) -> Case:
  """A random call of the matrix's kinds, for tests that draw fresh ones each run
  (``check_random_draws``): MHA (MHA, GQA, MQA) or MLA (its rope
  shared or per head, rope depth 64 or 32), lengths from empty through the tile edges
  (to a few thousand when ``large``), K/V packed like Q, longer (cached prefixes),
  shorter (cross-attention) or in a shuffled paged cache, every mask, sinks, the LSE, a
  soft cap, bf16 or f16, a negative scale now and then, the default config."""
  kind = "mla" if rng.random() < 0.25 else "mha"
  batch = int(rng.integers(1, 9 if large else 5))
  edges = [0, 1, 7, 63, 64, 65, 127, 128, 129, 200] + ([1000, 2047, 4096] if large else [])
  lens = tuple(int(x) for x in rng.choice(edges, size=batch))
  page_size = int(rng.choice([16, 64])) if rng.random() < 0.25 else None
  kv_lens = None
  if page_size is not None or rng.random() < 0.4:  # pages: a cache before the new rows
    lo = 0 if page_size is not None else -80
    kv_lens = tuple(max(q + int(rng.integers(lo, 1500 if large else 300)), 0) for q in lens)
  span = 2000 if large else 300
  mask = [CAUSAL, masks.NullMask(), masks.SlidingWindowCausalMask(int(rng.integers(1, span))),
          masks.ChunkedCausalMask(int(rng.choice([16, 64, 100, 256, 1024])))][
              int(rng.integers(4))]
  if kind == "mha":
    kv_heads = int(rng.choice([1, 2, 8] if large else [1, 2]))
    heads = kv_heads * int(rng.choice([1, 2, 4]))
    head_dim = int(rng.choice([128, 128, 64, 256, 96] if large else [64, 128, 32]))
    fields = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                  sink=bool(rng.random() < 0.3))
  else:
    heads = int(rng.choice([2, 16] if large else [2]))
    fields = dict(heads=heads, kv_heads=heads, head_dim=128 if large else 64,
                  rope_dim=int(rng.choice([64, 32])), shared_rope=bool(rng.random() < 0.7))
  soft_cap = [None, None, None, 2.0, 30.0][int(rng.integers(5))]
  return Case(kind=kind, lens=lens, kv_lens=kv_lens, mask=mask, page_size=page_size,
              soft_cap=soft_cap, lse=bool(rng.random() < 0.5),
              dtype="float16" if rng.random() < 0.2 else "bfloat16",
              scale=-0.1 if rng.random() < 0.1 else None,
              extra_rows=int(rng.integers(0, 20)), config=None, **fields)


def check_random_draws(draw, check, n: int):
  """check(draw(rng)) on n fresh random cases (``random_case``, the padded tests'
  ``random_padded_case``); a failure carries the draws' seed and the case's index, which
  give the case again: ``draw`` n times from ``np.random.default_rng(seed)``."""
  seed = fresh_seed()
  rng = np.random.default_rng(seed)
  for i in range(n):
    try:
      check(draw(rng))
    except Exception as e:
      e.add_note(f"random case {i} of draw seed {seed}")
      raise


TOLERANCE = {"bfloat16": 1e-2, "float16": 3e-3, "float32": 5e-3}


def fresh_seed() -> int:
  return int.from_bytes(os.urandom(4), "little")


def make_inputs(case: Case, seed: int):
  rng = np.random.default_rng(seed)
  kv_lens = case.lens if case.kv_lens is None else case.kv_lens
  q_off = np.concatenate([[0], np.cumsum(case.lens)])
  kv_off = np.concatenate([[0], np.cumsum(kv_lens)])
  total_q = int(q_off[-1]) + case.extra_rows
  total_kv = total_q if case.kv_lens is None else int(kv_off[-1]) + 3
  dv = case.head_dim_v or case.head_dim
  dt = jnp.dtype(case.dtype)
  normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), dt)
  v = normal(total_kv, case.kv_heads, dv)
  if case.kind == "mha":
    arrays = (normal(total_q, case.heads, case.head_dim),
              normal(total_kv, case.kv_heads, case.head_dim), v)
  else:
    rope_heads = 1 if case.shared_rope else case.kv_heads
    arrays = (normal(total_q, case.heads, case.head_dim + case.rope_dim),
              normal(total_kv, case.kv_heads, case.head_dim),
              normal(total_kv, rope_heads, case.rope_dim), v)
  kwargs = dict(max_prompt_len=max(max(case.lens), 1) + case.extra_prompt_len,
                mask=case.mask, return_lse=case.lse, output_dtype=case.output_dtype,
                scale=case.scale)
  if case.soft_cap is not None:
    kwargs["logits_soft_cap"] = case.soft_cap
  if case.sink:
    kwargs["sink_weights"] = jnp.asarray(rng.standard_normal(case.heads) * 2, jnp.float32)
  if case.page_size is not None:
    arrays = arrays[:1] + to_pages(arrays[1:], kv_off, np.asarray(case.lens), case.page_size,
                                   rng)
  elif case.kv_lens is not None:
    kwargs["kv_input_row_offsets"] = jnp.asarray(kv_off, case.offsets_dtype)
  return (*arrays, jnp.asarray(q_off, case.offsets_dtype)), kwargs, int(q_off[-1])


def to_pages(operands, kv_off, q_lens, page_size, rng, num_pages=None, max_pages=None):
  """Packed K/V operands -> PagedKVs over one shuffled block table. Sequence b's K/V rows
  kv_off[b]:kv_off[b+1] are its cache followed by its q_lens[b] new rows. Unused slots
  hold NaN and unused table entries out-of-range page ids: neither may be read. The pool
  has ``num_pages`` pages and the table ``max_pages`` columns (None: 3 and 1 more than
  needed)."""
  kv_lens = np.diff(kv_off)
  pages_per_seq = -(-kv_lens // page_size)
  num_pages = int(pages_per_seq.sum()) + 3 if num_pages is None else num_pages
  max_pages = int(pages_per_seq.max()) + 1 if max_pages is None else max_pages
  order = iter(rng.permutation(num_pages))
  table = np.full((len(kv_lens), max_pages), 10**6, np.int32)
  placed = []  # (page id, sequence, first row)
  for b, n in enumerate(pages_per_seq):
    for p in range(n):
      table[b, p] = next(order)
      placed.append((table[b, p], b, p * page_size))
  result = []
  for x in operands:
    x = np.asarray(x.astype(jnp.float32))
    pages = np.full((num_pages, page_size) + x.shape[1:], np.nan, np.float32)
    for page, b, row in placed:
      rows = x[kv_off[b] + row:min(kv_off[b] + row + page_size, kv_off[b + 1])]
      pages[page, :len(rows)] = rows
    result.append(pp.PagedKV(jnp.asarray(pages, operands[0].dtype), jnp.asarray(table),
                             jnp.asarray(kv_lens - q_lens, jnp.int32)))
  return tuple(result)


def rel_err(x, ref) -> float:
  x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def check_outputs(case, result, expected, last_row, seed):
  """Asserts `result` matches the reference `expected`: no NaN anywhere (so every row was
  written, given poisoned outputs), error under the dtype's tolerance, zeros past the last
  offset, and the log-sum-exp."""
  tag = f"{case.name} seed={seed}"
  out, lse = result if case.lse else (result, None)
  ref_out, ref_lse = expected if case.lse else (expected, None)
  assert out.shape == ref_out.shape and out.dtype == ref_out.dtype, tag
  out32 = np.asarray(out, np.float32)
  assert np.isfinite(out32).all(), f"non-finite output: {tag}"
  err = rel_err(out32, ref_out)
  assert err < TOLERANCE[case.dtype], f"relative error {err:.2e}: {tag}"
  assert not np.any(out32[last_row:]), f"rows past offsets[-1] not zero: {tag}"
  if lse is not None:
    lse = np.asarray(lse)
    assert lse.dtype == np.float32 and lse.shape == ref_lse.shape, tag
    assert np.isfinite(lse).all(), f"non-finite lse: {tag}"
    np.testing.assert_allclose(lse, np.asarray(ref_lse), rtol=1e-3, atol=2e-2, err_msg=tag)
  return err


def nan_past_last_key(args, kwargs):
  """The case's operands with every K/V row past the batch's last key set to NaN (the
  queries and offsets unchanged); asserts there are such rows to poison."""
  kv_off = kwargs.get("kv_input_row_offsets")
  kv_end = int(args[-1][-1] if kv_off is None else kv_off[-1])
  poisoned = (args[0], *[x.at[kv_end:].set(jnp.nan) for x in args[1:-1]], args[-1])
  assert poisoned[-2].shape[0] > kv_end, "no rows past the last key to poison"
  return poisoned


ENTRY_POINTS = {
    "mha": (pp.mha_prefill, pp.reference.mha_prefill_reference),
    "mla": (pp.mla_prefill, pp.reference.mla_prefill_reference),
}


def check_case(case: Case, *, interpret: bool, poison=None, backend="triton"):
  """Runs `case` on fresh random inputs and compares it with the float32 reference.

  `poison`, if given, is called before the kernel runs (on the GPU it fills the memory
  the output is about to get with NaN, so unwritten rows show).
  """
  seed = fresh_seed()
  args, kwargs, last_row = make_inputs(case, seed)
  kernel, reference = ENTRY_POINTS[case.kind]
  expected = reference(*args, **kwargs)
  if poison is not None:
    poison()
  result = kernel(*args, config=case.config, interpret=interpret, backend=backend,
                  **kwargs)
  jax.block_until_ready(result)
  return check_outputs(case, result, expected, last_row, seed)


def mosaic_variant(case: Case) -> Case:
  """The case as the Mosaic GPU backend's tests run it: its default tiles (every depth,
  MLA's rope 32 included, is padded to a multiple of 64 inside the wrapper)."""
  return dataclasses.replace(case, config=None)


def mosaic_serves(case: Case) -> bool:
  """Whether backend="mosaic_gpu" takes the case (else it must refuse it with
  NotImplementedError): bf16/f16 at any depth up to 256 (zero-padded to a multiple of 64;
  the default tiles then fit shared memory, MHA at depth 256 with both the LSE and a
  float32 output included); contiguous or paged K/V."""
  return case.dtype in ("bfloat16", "float16")


# Where a batch sits for the batch-invariance checks: behind a neighbour sequence of this
# many query rows and keys (0 to 8: every alignment of its first row; 1003: a whole
# prompt), in arrays of one size whatever the lead (one compilation).
INVARIANCE_LEADS = (0, 1, 2, 3, 4, 5, 6, 7, 8, 1003)


def rows_bits(result, rows):
  """The rows `rows` of a call's (output, LSE) as their raw bits: equal bits are the
  same values, NaN and signed zeros included."""
  return [np.asarray(x[rows]).view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)
          for x in result]


def placed_inputs(case: Case, seed: int, lead: int, max_lead: int = max(INVARIANCE_LEADS)):
  """The inputs of `case` (its data drawn from `seed`, as ``make_inputs`` draws them)
  behind a neighbour sequence of `lead` query rows and `lead` keys of fresh data, with
  fresh rows after them up to the size that ``max_lead`` needs; a paged cache over a pool
  of one size whose pages are shuffled afresh for each lead. Returns (args, kwargs,
  rows): the case's query rows are ``rows`` (a slice) of the outputs."""
  base = dataclasses.replace(case, page_size=None)
  args, kwargs, last_row = make_inputs(base, seed)
  rng = np.random.default_rng([seed, lead])
  *arrays, q_off = args
  q_off = np.asarray(q_off).astype(np.int64)
  kv_off = kwargs.pop("kv_input_row_offsets", None)
  total_q = arrays[0].shape[0]

  def around(x):  # fresh rows: `lead` before, max_lead - lead after
    fresh = lambda n: jnp.asarray(rng.standard_normal((n,) + x.shape[1:]), x.dtype)  # noqa: E731
    return jnp.concatenate([fresh(lead), x, fresh(max_lead - lead)])

  arrays = [around(x) for x in arrays]
  new_q_off = np.concatenate([[0], q_off + lead])
  kwargs["max_prompt_len"] = max(kwargs["max_prompt_len"], max_lead)
  if kv_off is not None:
    kv_off = np.concatenate([[0], np.asarray(kv_off).astype(np.int64) + lead])
  if case.page_size is not None:
    kv_off = kv_off if kv_off is not None else new_q_off
    ps = case.page_size
    base_pages = -(-np.diff(kv_off)[1:] // ps)
    num_pages = int(base_pages.sum()) + -(-max_lead // ps) + 3
    max_pages = int(max(base_pages.max(), -(-max_lead // ps))) + 1
    arrays = arrays[:1] + list(to_pages(arrays[1:], kv_off, np.diff(new_q_off), ps, rng,
                                        num_pages=num_pages, max_pages=max_pages))
  elif kv_off is not None:
    kwargs["kv_input_row_offsets"] = jnp.asarray(kv_off, case.offsets_dtype)
  q_off = jnp.asarray(new_q_off, case.offsets_dtype)
  return (*arrays, q_off), kwargs, slice(lead, lead + min(last_row, total_q))

"""The tile tuner: sweeps MhaConfig per (kernel, depths, dtype, mask kind, prompt length
class) on the GPU and writes the winners into pallas_prefill/tuned.py, which config=None
reads (keyed by the device kind).

    python -m benchmarks.tune [--kernels mha mla] [--backend triton|mosaic_gpu] [--write]
                              [--mosaic-configs 128x2 64x3 ...]

With --backend mosaic_gpu it sweeps MosaicConfig instead and records, per entry, whether
the winner beat the Triton kernel's tuned default on the same workloads (what
backend="auto" follows). ``--verdicts OUT.json`` measures both backends' defaults over
depths 64 to 256, every mask kind, bf16 and f16, short and long prompts (``VERDICT_CASES``):
where Triton wins, that case's entry gets False.

Each candidate is timed like the harness (benchmarks/run.py) on the workloads of its
length class (short: short64; long: equal4x4096 and skew16_16k) and must pass the
correctness check; the winner has the best geometric mean of useful TFLOP/s.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import pprint
import sys

import jax
import jax.numpy as jnp

import pallas_prefill as pp
from benchmarks import run, systems as sy, workloads as wl
from pallas_prefill import config as config_lib
from pallas_prefill import tuned

SWEEP = [pp.MhaConfig(bq, bk, w, s) for bq, bk, w, s in itertools.product(
    (64, 128), (32, 64), (4, 8), (2, 3))]
# 32-row query tiles waste fewer rows at the end of short prompts (short64 wastes about
# 12 % of its rows in 64-row tiles); not measured yet.
SWEEP += [pp.MhaConfig(32, bk, 4, s) for bk, s in itertools.product((32, 64), (2, 3))]
# num_programs: None is the persistent kernel (one program per SM); ONE_UNIT_EACH gives
# every (head, item) unit its own program, scheduled by the GPU.
ONE_UNIT_EACH = 2**31 - 1
MOSAIC_SWEEP = [pp.MosaicConfig(64, bk, s, n) for bk, s in ((128, 2), (64, 2), (64, 3), (64, 4))
                for n in (None, ONE_UNIT_EACH)]
CLASSES = {False: ("short64",), True: ("equal4x4096", "skew16_16k")}  # long prompts?
DEPTHS = {"mha": (sy.MHA_SHAPE["qk"], sy.MHA_SHAPE["v"]),
          "mla": (sy.MLA_SHAPE["nope"] + sy.MLA_SHAPE["rope"], sy.MLA_SHAPE["v"])}


def mosaic_config(text: str) -> pp.MosaicConfig:
  """"128x2" -> MosaicConfig(block_kv=128, num_stages=2) (``--mosaic-configs``)."""
  block_kv, stages = text.lower().split("x")
  return pp.MosaicConfig(block_kv=int(block_kv), num_stages=int(stages))


def candidate_tflops(kind, workload_names, cfg, backend="triton") -> float | None:
  """Geometric mean of useful TFLOP/s over the workloads, None if any run fails or errs."""
  scores = []
  for name in workload_names:
    problems = [sy.make_problem(kind, wl.WORKLOADS[name], seed) for seed in range(3)]
    prepared = sy.pallas_prefill(problems)
    fn = jax.jit(lambda q, kv, off, kv_off, cfg=cfg, w=problems[0].workload: (
        pp.mha_prefill if kind == "mha" else pp.mla_prefill)(
            q, *kv, off, kv_input_row_offsets=kv_off, max_prompt_len=w.max_len, mask=w.mask,
            config=cfg, backend=backend))
    try:
      out = fn(*prepared.arg_sets[0])
    except Exception as e:  # pylint: disable=broad-except  (e.g. shared memory exceeded)
      print(f"  {kind} {name} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
      return None
    if run.rel_err(out, sy.reference(problems[0])) >= run.TOLERANCE:
      return None
    tflops = sy.useful_flops(problems[0]) / run.bench_jax(fn, prepared.arg_sets) / 1e12
    print(f"  {kind} {name:12s} {cfg}: {tflops:.1f} TFLOP/s", flush=True)
    scores.append(tflops)
  return math.exp(sum(map(math.log, scores)) / len(scores))


HEADER = '''"""Tuned kernel configurations: written by ``python -m benchmarks.tune`` on the GPU it names.

device kind -> {(QK depth, V depth, dtype, mask kind, long prompts): (block_q, block_kv,
num_warps, num_stages)}. The QK depth is the sum of the logit terms' padded widths (MLA's
128 + 64 is 192); "long" means max_prompt_len > config.LONG_PROMPT. BUILD_NOTES.md, "Tile
sweeps", says where each entry was measured.
"""
'''


MOSAIC_HEADER = '''
# backend="mosaic_gpu": device kind -> {key as above: (block_q, block_kv, num_stages,
# num_programs, faster than Triton)}; the last field is what backend="auto" follows: on a
# Hopper GPU it runs Mosaic GPU wherever it serves the call except where an entry (the
# mask's own, else the causal one) says False. ``python -m benchmarks.tune --verdicts``
# measures the verdicts: on the H200 (2026-12-01) Mosaic GPU won every measured case (MHA
# depths 64, 128, 256, MLA 192/128, every mask kind, bf16 and f16, short and long
# prompts) but MHA at depth 64 on short prompts (Triton 122 useful TFLOP/s against 111,
# one measurement).'''


def _table_lines(name, table):
  lines = [f"{name} = {{"]
  for device in sorted(table):
    lines.append(f"    {device!r}: {{".replace("'", '"'))
    for key in sorted(table[device], key=repr):
      lines.append(f"        {key!r}: {table[device][key]!r},".replace("'", '"'))
    lines.append("    },")
  return lines + ["}"]


def write_table(path, table, mosaic_table=None) -> None:
  """Writes pallas_prefill/tuned.py holding `table` (device kind -> {key: tuple}) and the
  Mosaic GPU table (kept as it is when None)."""
  mosaic_table = tuned.TUNED_MOSAIC if mosaic_table is None else mosaic_table
  lines = [HEADER] + _table_lines("TUNED", table) + [MOSAIC_HEADER]
  lines += _table_lines("TUNED_MOSAIC", mosaic_table)
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


# ``--verdicts``: the cases whose backend="auto" choice is measured (default configs of
# both backends): (kind, qk depth, v depth, dtype, mask).
VERDICT_MASKS = (pp.masks.CausalMask(), pp.masks.NullMask(),
                 pp.masks.SlidingWindowCausalMask(1024), pp.masks.ChunkedCausalMask(1024))
VERDICT_CASES = (
    [("mha", 128, 128, "bfloat16", m) for m in VERDICT_MASKS]
    + [("mla", 192, 128, "bfloat16", m) for m in VERDICT_MASKS]
    + [("mha", d, d, "bfloat16", m) for d in (64, 256) for m in VERDICT_MASKS[::2]]
    + [("mha", 128, 128, "float16", VERDICT_MASKS[0]), ("mla", 192, 128, "float16",
                                                         VERDICT_MASKS[0])])
VERDICT_LENGTHS = {False: wl.WORKLOADS["short64"].q_lens, True: (4096,) * 4}  # long?


def _verdict_problem(kind, qk, v, dtype, lens, seed):
  """A ragged batch of `lens` at these depths and dtype (MHA 32/8 heads; MLA 128 + 64
  rope over 16 heads, so that short and long cases compile and run in seconds)."""
  keys = iter(jax.random.split(jax.random.key(seed), 5))
  total = sum(lens)
  normal = lambda *shape: jax.random.normal(next(keys), shape, dtype)  # noqa: E731
  if kind == "mha":
    return (normal(total, 32, qk), normal(total, 8, qk), normal(total, 8, v))
  return (normal(total, 16, qk), normal(total, 16, qk - 64), normal(total, 1, 64),
          normal(total, 16, v))


def verdicts(cases=VERDICT_CASES, lengths=VERDICT_LENGTHS) -> list[dict]:
  """Each case's useful TFLOP/s on both backends' default configs (correct against the
  float32 reference), and whether Mosaic GPU won: what ``TUNED_MOSAIC``'s last field
  records and ``backend="auto"`` follows."""
  rows = []
  for (kind, qk, v, dtype, mask), (long, lens) in itertools.product(cases, lengths.items()):
    ops = _verdict_problem(kind, qk, v, jnp.dtype(dtype), lens, seed=len(rows))
    off = jnp.asarray(wl.offsets(lens), jnp.int32)
    entry = pp.mha_prefill if kind == "mha" else pp.mla_prefill
    ref_fn = pp.reference.mha_prefill_reference if kind == "mha" else (
        pp.reference.mla_prefill_reference)
    kw = dict(max_prompt_len=max(lens), mask=mask)
    ref = ref_fn(*[x.astype(jnp.float32) for x in ops], off, **kw)
    flops = wl.useful_flops(lens, ops[0].shape[1], qk, v, mask=mask)
    row = dict(kind=kind, qk=qk, v=v, dtype=dtype, mask=repr(mask), long=long)
    for backend in ("triton", "mosaic_gpu"):
      fn = jax.jit(lambda *a, backend=backend: entry(*a, off, backend=backend, **kw))
      try:
        out = fn(*ops)
        err = run.rel_err(out, ref)
        sec = run.bench_jax(fn, [ops], rounds=3, reps=10)
        row[backend] = flops / sec / 1e12 if err < run.TOLERANCE else 0.0
        row[backend + "_err"] = float(err)
      except Exception as e:  # pylint: disable=broad-except
        print(f"  {row} {backend}: {type(e).__name__}: {str(e)[:200]}", flush=True)
        row[backend] = 0.0
    row["mosaic_faster"] = row["mosaic_gpu"] > row["triton"]
    row["auto"] = sy.backend_ran(jax.jit(lambda *a: entry(*a, off, **kw)), *ops)
    print(row, flush=True)
    rows.append(row)
  return rows


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--kernels", nargs="*", default=["mha", "mla"], choices=["mha", "mla"])
  parser.add_argument("--backend", default="triton", choices=["triton", "mosaic_gpu"])
  parser.add_argument("--write", action="store_true", help="update pallas_prefill/tuned.py")
  parser.add_argument("--mosaic-configs", nargs="*", type=mosaic_config, default=MOSAIC_SWEEP,
                      metavar="BKVxSTAGES",
                      help="the MosaicConfigs to sweep (block_kv x num_stages, persistent)")
  parser.add_argument("--verdicts", metavar="JSON", help="measure both backends' defaults "
                      "on VERDICT_CASES (what backend='auto' picks) and write the rows here")
  args = parser.parse_args(argv)
  if args.verdicts:
    rows = verdicts()
    with open(args.verdicts, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), f, indent=1)
    print("| kind | qk/v | dtype | mask | long | Triton | Mosaic GPU | auto runs |")
    for r in rows:
      print(f"| {r['kind']} | {r['qk']}/{r['v']} | {r['dtype']} | {r['mask']} | {r['long']} "
            f"| {r['triton']:.0f} | {r['mosaic_gpu']:.0f} | {r['auto']} |")
    return 0
  mosaic = args.backend == "mosaic_gpu"
  device = jax.devices()[0].device_kind
  table = {k: dict(v) for k, v in (tuned.TUNED_MOSAIC if mosaic else tuned.TUNED).items()}
  for kind in args.kernels:
    qk, v = DEPTHS[kind]
    for long, names in CLASSES.items():
      scored = [(candidate_tflops(kind, names, cfg, args.backend), cfg)
                for cfg in (args.mosaic_configs if mosaic else SWEEP)]
      scored = [(s, cfg) for s, cfg in scored if s is not None]
      if not scored:
        print(f"{kind} long={long}: no candidate passed", flush=True)
        continue
      best, cfg = max(scored, key=lambda x: x[0])
      key = config_lib.tuned_key(qk, v, jnp.bfloat16, pp.masks.CausalMask(),
                                 config_lib.LONG_PROMPT + 1 if long else 1)
      if mosaic:  # the entry also says whether it beat the Triton default ("auto")
        triton = candidate_tflops(kind, names, None, "triton") or 0.0
        entry = (cfg.block_q, cfg.block_kv, cfg.num_stages, cfg.num_programs, best > triton)
        versus = f", Triton default {triton:.1f}"
      else:
        entry, versus = (cfg.block_q, cfg.block_kv, cfg.num_warps, cfg.num_stages), ""
      table.setdefault(device, {})[key] = entry
      print(f"{kind} long={long}: best {cfg} at {best:.1f} TFLOP/s (geomean){versus}",
            flush=True)
  if args.write:
    if mosaic:
      write_table(tuned.__file__, tuned.TUNED, table)
    else:
      write_table(tuned.__file__, table)
  pprint.pprint(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())

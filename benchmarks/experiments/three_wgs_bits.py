"""Are a row's bits the same with two and with three compute warpgroups? (issue 25)

The thirty-first session's lead (BUILD_NOTES): bf16 with three compute warpgroups and the
register cuts runs the 16k prompt 1.036x faster than two, and loses on short and skewed
batches, so ``config=None`` could pick three for long prompts only. Batch invariance
allows that only if the choice changes no output bit. It should not: items start at a
sequence's first query row and warpgroups take 64 rows of them either way, so each
warpgroup has the same rows, the same KV tiles and the same operations (with
``row_sum_first`` on for both), and a tile that shows a row no key adds exactly nothing.
This script checks it on the H200 before any default changes:

    python3 -m benchmarks.experiments.three_wgs_bits [--out DIR]
    python3 -m benchmarks.experiments.three_wgs_bits --lower   # anywhere: lowers each arm

For each case (MHA at depth 128, the depth three warpgroups fit with 128-key tiles: every
mask, GQA, cached prefixes, a paged cache read in place, LSE and sinks, a soft cap,
float16), the same inputs run with ``MosaicConfig(compute_wgs=2)`` and ``compute_wgs=3``,
both with ``row_sum_first``, ``q_per_tile`` and ``column_mask`` on; both are checked
against the float32 reference (``tests.cases.check_outputs``) and compared bit for bit. Prints a
line per case, exits 1 if any case differs or fails; DIR/three_wgs_bits.json has the
lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import jax
import numpy as np

CUTS = dict(row_sum_first=True, q_per_tile=True, column_mask=True)


def case_list():
  from pallas_prefill import masks  # pylint: disable=g-import-not-at-top
  from tests import cases  # pylint: disable=g-import-not-at-top
  long = cases.Case(lens=(4096, 1500, 37, 600, 1, 2049), heads=32, kv_heads=8,
                    head_dim=128, config=None, lse=True, extra_rows=7)
  r = dataclasses.replace
  return [
      long,
      r(long, lens=(16384,), extra_rows=0, lse=False),
      r(long, sink=True, mask=masks.SlidingWindowCausalMask(700)),
      r(long, mask=masks.ChunkedCausalMask(512)),
      r(long, mask=masks.NullMask(), kv_lens=(3000, 5, 0, 1300, 77, 2049)),
      r(long, kv_lens=(5000, 1500, 900, 4000, 129, 2049)),  # cached prefixes
      r(long, kv_lens=(5000, 1500, 900, 4000, 129, 2049), page_size=64),
      r(long, heads=8, kv_heads=1),  # MQA
      r(long, soft_cap=30.0, sink=True),
      r(long, dtype="float16"),
  ]


def configs():
  import pallas_prefill as pp  # pylint: disable=g-import-not-at-top
  options = pp.MosaicOptions(**CUTS)
  return {wgs: pp.MosaicConfig(compute_wgs=wgs, options=options) for wgs in (2, 3)}


def lower_all():
  """Lowers each case's two calls for an abstract H200 (the CPU's check of the script)."""
  from tests import cases  # pylint: disable=g-import-not-at-top
  from tests.test_lowering import lower_for_h200  # pylint: disable=g-import-not-at-top
  for case in case_list():
    args, kwargs, _ = cases.make_inputs(case, 0)
    entry, _ = cases.ENTRY_POINTS[case.kind]
    for wgs, config in configs().items():
      fn = lambda *a, config=config: entry(*a, interpret=False, backend="mosaic_gpu",
                                           config=config, **kwargs)
      specs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
      text = lower_for_h200(fn, *specs).as_text()
      print(f"{case.name} w{wgs}: lowered, {len(text)} chars", flush=True)


def compare_all(skip=0):
  """Runs each case (but the first ``skip``) with two and three warpgroups on the GPU;
  returns the report lines and whether every case matched."""
  from tests import cases  # pylint: disable=g-import-not-at-top
  from tests.test_gpu import poison_device_memory  # pylint: disable=g-import-not-at-top
  lines, ok = [], True
  for case in case_list()[skip:]:
    seed = cases.fresh_seed()
    args, kwargs, last_row = cases.make_inputs(case, seed)
    entry, reference = cases.ENTRY_POINTS[case.kind]
    expected = reference(*args, **kwargs)
    bits = {}
    try:
      for wgs, config in configs().items():
        poison_device_memory()
        result = entry(*args, interpret=False, backend="mosaic_gpu", config=config,
                       **kwargs)
        cases.check_outputs(case, result, expected, last_row, seed)
        bits[wgs] = cases.rows_bits(result if case.lse else (result,), slice(0, last_row))
      differ = [int(np.sum(a != b)) for a, b in zip(bits[2], bits[3])]
      same = not any(differ)
      line = f"{case.name} seed={seed}: " + (
          "bitwise the same" if same else f"elements that differ {differ}")
    except Exception as e:  # pylint: disable=broad-except
      same, line = False, f"{case.name} seed={seed}: FAILED {type(e).__name__}: {e}"[:600]
    ok &= same
    lines.append(line)
    print(line, flush=True)
  return lines, ok


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--lower", action="store_true")
  parser.add_argument("--out", default=None)
  parser.add_argument("--skip", type=int, default=0, help="cases to leave out, first")
  args = parser.parse_args(argv)
  sys.path.insert(0, ".")
  if args.lower:
    lower_all()
    return 0
  lines, ok = compare_all(args.skip)
  if args.out:
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "three_wgs_bits.json"), "w") as f:
      json.dump(dict(commit=os.environ.get("PALLAS_PREFILL_COMMIT"),
                     jax=jax.__version__, cuts=CUTS, lines=lines, ok=ok), f, indent=1)
  print("all bitwise the same" if ok else "SOME DIFFER OR FAILED")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())

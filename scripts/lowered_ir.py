"""The lowered kernels of a fixed set of calls, for an abstract NVIDIA H200, debug locations
stripped: a refactoring that means to change no kernel shows it by identical output.

    .venv/bin/python scripts/lowered_ir.py DIR            # writes DIR/*.txt.gz, DIR/hashes.json
    .venv/bin/python scripts/lowered_ir.py --compare A B  # the cases whose lowering differs

Each case is a public entry point call (``mha_prefill`` / ``mla_prefill`` with an explicit
backend) lowered for CUDA as ``tests/test_lowering.py`` does, no GPU needed. The text is the
StableHLO module with every kernel's embedded module (Triton IR, Mosaic GPU MLIR) parsed
and printed without locations in place of its bytes (and of the kernel hash, which covers
the locations).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import re
import sys

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pallas_prefill as pp  # noqa: E402
from pallas_prefill import masks  # noqa: E402
from tests import lowered as lowered_lib  # noqa: E402

H200_MESH = AbstractMesh((1,), ("x",), abstract_device=AbstractDevice(
    device_kind="NVIDIA H200", num_cores=None, platform="gpu"))
S = jax.ShapeDtypeStruct
I32 = jnp.int32


def mha_call(backend, *, total_q=1000, total_kv=None, heads=8, kv_heads=2, d=128, dv=128,
             dtype=jnp.bfloat16, sink=False, paged=None, **kw):
  """(fn, args) of an ``mha_prefill`` call; paged = (page_size, num_pages, max_pages)."""
  kv_rows = total_kv or total_q
  args = [S((total_q, heads, d), dtype)]
  if paged:
    page, pages, max_pages = paged
    args += [S((pages, page, kv_heads, d), dtype), S((pages, page, kv_heads, dv), dtype),
             S((6,), I32), S((5, max_pages), I32), S((5,), I32)]

    def fn(q, kp, vp, off, table, cache):
      return pp.mha_prefill(q, pp.PagedKV(kp, table, cache), pp.PagedKV(vp, table, cache),
                            off, backend=backend, interpret=False, **kw)
    return fn, args
  args += [S((kv_rows, kv_heads, d), dtype), S((kv_rows, kv_heads, dv), dtype), S((6,), I32),
           S((6,), I32) if total_kv else None, S((heads,), jnp.float32) if sink else None]

  def fn(q, k, v, off, kv_off, sw):
    return pp.mha_prefill(q, k, v, off, kv_input_row_offsets=kv_off, sink_weights=sw,
                          backend=backend, interpret=False, **kw)
  return fn, args


def mla_call(backend, *, total_q=1000, heads=16, d=128, rope=64, dv=128, paged=None, **kw):
  bf = jnp.bfloat16
  q = S((total_q, heads, d + rope), bf)
  if paged:
    page, pages, max_pages = paged
    args = [q, S((pages, page, heads, d), bf), S((pages, page, 1, rope), bf),
            S((pages, page, heads, dv), bf), S((6,), I32), S((5, max_pages), I32), S((5,), I32)]

    def fn(q, kn, kr, v, off, table, cache):
      p = lambda x: pp.PagedKV(x, table, cache)  # noqa: E731
      return pp.mla_prefill(q, p(kn), p(kr), p(v), off, backend=backend, interpret=False,
                            **kw)
    return fn, args
  args = [q, S((total_q, heads, d), bf), S((total_q, 1, rope), bf), S((total_q, heads, dv), bf),
          S((6,), I32)]

  def fn(q, kn, kr, v, off):
    return pp.mla_prefill(q, kn, kr, v, off, backend=backend, interpret=False, **kw)
  return fn, args


MASKS = {"causal": masks.CausalMask(), "null": masks.NullMask(),
         "sliding128": masks.SlidingWindowCausalMask(128),
         "chunked256": masks.ChunkedCausalMask(256)}


def cases():
  """name -> (fn, args): the calls whose lowering is compared."""
  out = {}
  for backend in ("triton", "mosaic_gpu"):
    b = backend
    for name, mask in MASKS.items():
      out[f"{b}-mha-{name}"] = mha_call(b, mask=mask, max_prompt_len=512)
      out[f"{b}-mla-{name}"] = mla_call(b, mask=mask, max_prompt_len=512)
    out[f"{b}-mha-d64"] = mha_call(b, d=64, dv=64, heads=16, kv_heads=16, max_prompt_len=512)
    out[f"{b}-mha-d80v48"] = mha_call(b, d=80, dv=48, max_prompt_len=512)
    out[f"{b}-mha-d256-sink-lse"] = mha_call(b, d=256, dv=256, kv_heads=1, sink=True,
                                             return_lse=True, max_prompt_len=512)
    out[f"{b}-mha-mqa-sink-lse"] = mha_call(b, kv_heads=1, sink=True, return_lse=True,
                                            max_prompt_len=512)
    out[f"{b}-mha-kvoff-lse"] = mha_call(b, total_q=1001, total_kv=1503, return_lse=True,
                                         max_prompt_len=512)
    out[f"{b}-mha-short-arrays"] = mha_call(b, total_q=40, total_kv=50, max_prompt_len=64)
    out[f"{b}-mha-f16-f32out-lse"] = mha_call(b, dtype=jnp.float16, output_dtype=jnp.float32,
                                              return_lse=True, max_prompt_len=512)
    out[f"{b}-mha-long"] = mha_call(b, max_prompt_len=4096, sink=True, return_lse=True)
    out[f"{b}-mla-long"] = mla_call(b, total_q=1001, max_prompt_len=4096)
    out[f"{b}-mla-long-lse"] = mla_call(b, return_lse=True, max_prompt_len=4096)
    out[f"{b}-mla-f32out-lse-sliding"] = mla_call(
        b, total_q=1001, output_dtype=jnp.float32, return_lse=True,
        mask=masks.SlidingWindowCausalMask(300), max_prompt_len=512)
    # The soft cap (Mosaic GPU folds it into exp2, for a scale of either sign)
    out[f"{b}-mha-softcap-lse"] = mha_call(b, logits_soft_cap=30.0, return_lse=True,
                                           max_prompt_len=512)
    out[f"{b}-mha-negscale-softcap"] = mha_call(b, scale=-0.1, logits_soft_cap=5.0,
                                                max_prompt_len=512)
    out[f"{b}-mla-softcap"] = mla_call(b, logits_soft_cap=50.0, max_prompt_len=512)
    out[f"{b}-mla-rope32"] = mla_call(b, d=64, rope=32, dv=64, max_prompt_len=512) if (
        b == "triton") else None
    for page in (16, 64, 128):
      out[f"{b}-mha-paged{page}"] = mha_call(b, paged=(page, 40 * 64 // page, 12 * 64 // page),
                                             max_prompt_len=512)
    out[f"{b}-mha-paged64-lse-sliding"] = mha_call(
        b, paged=(64, 40, 12), return_lse=True, mask=masks.SlidingWindowCausalMask(200),
        max_prompt_len=512)
    out[f"{b}-mla-paged128"] = mla_call(b, paged=(128, 40, 12), max_prompt_len=512)
    out[f"{b}-mla-paged64-long"] = mla_call(b, paged=(64, 80, 24), max_prompt_len=4096)
  c = pp.MosaicConfig
  m = "mosaic_gpu"
  out["mosaic_gpu-mha-one-program"] = mha_call(m, sink=True, return_lse=True,
                                               config=c(num_programs=1), max_prompt_len=512)
  out["mosaic_gpu-mha-unit-per-program"] = mha_call(
      m, config=c(block_kv=64, num_stages=3, num_programs=2**31 - 1), max_prompt_len=512)
  out["mosaic_gpu-mla-one-buffer"] = mla_call(m, total_q=1001, config=c(block_kv=128, num_stages=2),
                                              max_prompt_len=512)
  split = c(block_kv=64, num_stages=2, split_units=True)
  out["mosaic_gpu-mha-split"] = mha_call(m, config=split, max_prompt_len=512)
  out["mosaic_gpu-mha-split-lse-sink"] = mha_call(m, config=split, sink=True, return_lse=True,
                                                  max_prompt_len=512)
  out["mosaic_gpu-mha-split-paged64"] = mha_call(m, config=split, paged=(64, 40, 12),
                                                 max_prompt_len=512)
  out["mosaic_gpu-mla-split"] = mla_call(m, config=split, max_prompt_len=512)
  out["triton-mha-config"] = mha_call("triton", config=pp.MhaConfig(128, 64, 8, 2),
                                      max_prompt_len=512)
  return {k: v for k, v in out.items() if v is not None}


_EMBEDDED = re.compile(r'(kernel_hash|module|ir) = "(?:[^"\\]|\\.)*"')


def canonical_text(fn, args) -> str:
  with use_abstract_mesh(H200_MESH):
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  module = lowered.compiler_ir("stablehlo")
  parts = [_EMBEDDED.sub(r'\1 = "<embedded>"',
                         module.operation.get_asm(enable_debug_info=False))]
  parts += lowered_lib.kernel_texts(module)
  return "\n// ---- embedded kernel module ----\n".join(parts)


def write(out_dir: str, only=None) -> dict:
  os.makedirs(out_dir, exist_ok=True)
  hashes = {}
  for name, (fn, args) in cases().items():
    if only and not any(o in name for o in only):
      continue
    text = canonical_text(fn, args)
    hashes[name] = hashlib.sha256(text.encode()).hexdigest()
    with gzip.open(os.path.join(out_dir, name + ".txt.gz"), "wt") as f:
      f.write(text)
    print(name, hashes[name][:16], flush=True)
  with open(os.path.join(out_dir, "hashes.json"), "w") as f:
    json.dump(hashes, f, indent=1, sort_keys=True)
  return hashes


def compare(a: str, b: str) -> int:
  load = lambda d: json.load(open(os.path.join(d, "hashes.json")))  # noqa: E731
  ha, hb = load(a), load(b)
  differ = sorted(k for k in ha.keys() & hb.keys() if ha[k] != hb[k])
  missing = sorted(ha.keys() ^ hb.keys())
  print(f"{len(ha.keys() & hb.keys())} cases compared, {len(differ)} differ:", *differ)
  if missing:
    print("in only one of them:", *missing)
  return 1 if differ or missing else 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("dirs", nargs="+")
  parser.add_argument("--compare", action="store_true")
  parser.add_argument("--only", nargs="*", help="substrings of the case names to lower")
  a = parser.parse_args(argv)
  if a.compare:
    return compare(*a.dirs)
  write(a.dirs[0], a.only)
  return 0


if __name__ == "__main__":
  sys.exit(main())

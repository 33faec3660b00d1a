"""Head-parallel scaling (issue 6): one device against a head-sharded mesh of several.

    python -m benchmarks.scaling [--devices 2] [--kernels mha mla]
        [--workloads equal4x4096 skew16_16k] [--out DIR]

For each kernel and workload: the entry point under ``jax.jit`` on one device, then the
same jitted call with q, K and V sharded along their head axis over a mesh of N devices
(offsets and MLA's shared rope key replicated), which the entry points partition by
themselves (pallas_prefill/partitioning.py). Both are timed like the harness (median per
call, rotating input sets), both outputs are compared with the float32 reference, the
sharded output must keep the head sharding, and its compiled program must hold no
collective. Writes DIR/scaling.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from benchmarks import run, systems as sy, workloads as wl

COLLECTIVES = re.compile(r"all-gather|all-to-all|all-reduce|collective-permute|reduce-scatter")


def _shard(args, mesh):
  """The harness's (q, kv, q_offsets, kv_offsets) with q and K/V split along their head
  axis (a one-head K, MLA's shared rope key, replicated) and the offsets replicated."""
  heads = NamedSharding(mesh, P(None, "heads", None))
  replicated = NamedSharding(mesh, P())
  q, kv, q_off, kv_off = args
  kv = tuple(jax.device_put(x, heads if x.shape[1] > 1 else replicated) for x in kv)
  offsets = [None if o is None else jax.device_put(o, replicated) for o in (q_off, kv_off)]
  return (jax.device_put(q, heads), kv, *offsets)


def measure(kind, workload, n_devices):
  if workload.page_size:
    raise ValueError(f"{workload.name}: the scaling run takes packed K/V, not a paged cache")
  problems = [sy.make_problem(kind, workload, seed) for seed in range(3)]
  ref = sy.reference(problems[0])
  flops = sy.useful_flops(problems[0])
  prepared = sy.pallas_prefill(problems)  # the harness's jitted call and its input sets
  fn, one = prepared.fn, prepared.arg_sets
  err_one = run.rel_err(fn(*one[0]), ref)
  sec_one = run.bench_jax(fn, one)

  mesh = Mesh(np.asarray(jax.devices()[:n_devices]), ("heads",))
  many = [_shard(args, mesh) for args in one]
  out = fn(*many[0])
  err_many = run.rel_err(out, ref)
  spec = out.sharding.spec if isinstance(out.sharding, NamedSharding) else out.sharding
  hlo = fn.lower(*many[0]).compile().as_text()
  collectives = sorted(set(COLLECTIVES.findall(hlo)))
  sec_many = run.bench_jax(fn, many)
  return dict(kernel=kind, workload=workload.name, devices=n_devices,
              ms_one=sec_one * 1e3, ms_sharded=sec_many * 1e3,
              tflops_one=flops / sec_one / 1e12, tflops_sharded=flops / sec_many / 1e12,
              speedup=sec_one / sec_many, relerr_one=err_one, relerr_sharded=err_many,
              out_sharding=str(spec), collectives=collectives,
              correct=bool(err_one < run.TOLERANCE and err_many < run.TOLERANCE))


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--devices", type=int, default=2)
  parser.add_argument("--kernels", nargs="*", default=["mha", "mla"], choices=["mha", "mla"])
  parser.add_argument("--workloads", nargs="*", default=["equal4x4096", "skew16_16k"],
                      choices=list(wl.WORKLOADS))
  parser.add_argument("--out", default="bench-out")
  args = parser.parse_args(argv)
  if len(jax.devices()) < args.devices:
    print(f"needs {args.devices} devices, found {len(jax.devices())}", file=sys.stderr)
    return 2
  os.makedirs(args.out, exist_ok=True)
  meta = dict(date=time.strftime("%Y-%m-%d"), commit=run.commit(), jax=jax.__version__,
              gpu=jax.devices()[0].device_kind, devices=args.devices)
  rows = []
  for kind in args.kernels:
    for name in args.workloads:
      row = measure(kind, wl.WORKLOADS[name], args.devices)
      rows.append(row)
      print(f"{kind} {name:12s} 1 device {row['ms_one']:8.3f} ms, {args.devices} devices "
            f"{row['ms_sharded']:8.3f} ms: {row['speedup']:.2f}x  err {row['relerr_one']:.1e}"
            f"/{row['relerr_sharded']:.1e}  out {row['out_sharding']}  collectives "
            f"{row['collectives'] or 'none'}", flush=True)
  with open(os.path.join(args.out, "scaling.json"), "w") as f:
    json.dump(dict(meta=meta, rows=rows), f, indent=1)
  return 0 if all(r["correct"] and not r["collectives"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())

"""One call of one harness system, alone between cudaProfilerStart and cudaProfilerStop.

    ncu --profile-from-start off --clock-control none [--section ...] \\
        python -m benchmarks.profile --kernel mha --workload equal4x4096 \\
        [--system pallas_prefill_mosaic] [--mosaic-options dynamic=False ...]

For Nsight Compute (or Nsight Systems with ``--capture-range=cudaProfilerApi``): the
system is prepared as the harness prepares it (benchmarks/run.py, the first input set),
called three times to compile and warm up, and then called once more with the profiler
on, so that the report holds that call's kernels and nothing else. ``--clock-control
none`` keeps the GPU's own clocks, as the harness runs under. ``--mosaic-options`` set the
Mosaic GPU system's config as ``benchmarks.run``'s option of that name and
``benchmarks.ab``'s arms do (the static deal: ``--mosaic-options dynamic=False``).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import pathlib
import sys

from benchmarks import systems as sy
from benchmarks import workloads as wl


def _cudart():
  """The CUDA runtime torch or the CUDA plugin loaded (cudaProfilerStart/Stop act on the
  process's context, whichever library calls them), or None where there is none (the
  CPU: the call then runs unprofiled)."""
  found = [str(f) for d in sys.path if d and os.path.isdir(os.path.join(d, "nvidia"))
           for f in sorted(pathlib.Path(d, "nvidia").glob("*/lib/libcudart.so*"))]
  for name in ("libcudart.so.13", "libcudart.so.12", ctypes.util.find_library("cudart"),
               *found):
    if name:
      try:
        return ctypes.CDLL(name)
      except OSError:
        continue
  return None


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--kernel", choices=["mha", "mla"], default="mha")
  parser.add_argument("--workload", default="equal4x4096", choices=sorted(wl.WORKLOADS))
  parser.add_argument("--system", default="pallas_prefill_mosaic", choices=sorted(sy.SYSTEMS))
  parser.add_argument("--mosaic-options", nargs="+", default=[], metavar="NAME=VALUE",
                      help="MosaicOptions or MosaicConfig fields for the Mosaic GPU system")
  args = parser.parse_args(argv)
  try:
    mosaic_options = sy.parse_mosaic_options(args.mosaic_options)
  except ValueError as e:
    parser.error(f"--mosaic-options: {e}")
  problem = sy.make_problem(args.kernel, wl.WORKLOADS[args.workload], 0)
  prepared = sy.prepare(args.system, [problem], mosaic_options)
  call_args = prepared.arg_sets[0]
  for _ in range(3):
    prepared.wait(prepared.fn(*call_args))
  cudart = _cudart()
  if cudart is not None:
    cudart.cudaProfilerStart()
  prepared.wait(prepared.fn(*call_args))
  if cudart is not None:
    cudart.cudaProfilerStop()
  print(f"{'profiled' if cudart is not None else 'ran (no CUDA runtime: unprofiled)'} one "
        f"call: {args.kernel} {args.workload} {args.system}"
        f"{f' {mosaic_options}' if mosaic_options else ''}")


if __name__ == "__main__":
  main()

#!/usr/bin/env bash
# On the H200 (the device tool runs this from the repo root): the GPU tests (4 processes
# compile in parallel), then the workloads; arguments go to benchmarks.h200. Results land
# in $OUT (or ./h200-out): gpu-tests.log, bench.log and results.json.
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -m gpu tests -p no:cacheprovider \
  -n 4 2>&1 | tee "$out/gpu-tests.log" | tail -25
python3 -m benchmarks.h200 --out "$out/results.json" "$@" 2>&1 | tee "$out/bench.log"

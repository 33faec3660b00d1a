#!/usr/bin/env bash
# On the H200 (the device tool runs this from the repo root): the GPU tests (4 processes
# compile in parallel), then the harness; arguments go to benchmarks.run. Results land in
# $OUT (or ./h200-out): gpu-tests.log, bench.log, results.json, results.md, results.png.
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -m gpu tests -p no:cacheprovider \
  -p no:benchmark -n 4 2>&1 | tee "$out/gpu-tests.log" | tail -25
python3 -m benchmarks.run --out "$out" "$@" 2>&1 | tee "$out/bench.log"

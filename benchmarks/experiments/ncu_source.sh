#!/usr/bin/env bash
# On the H200 (the device tool runs it from the repo root; the thirty-seventh session):
# ncu's per-SASS-instruction warp stall samples (SourceCounters) of one MHA skew16_16k
# call, packed and padded (key-less units, "first", and zero jobs, "stores", the padded
# default since the fortieth session), to see which instructions the padded call's extra
# long-scoreboard stalls sit on (issue 23's padded cost). Results, gzipped CSV (a row per
# SASS instruction with its stall samples by reason), in $OUT (or ./h200-out).
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
N=/usr/local/cuda/bin/ncu
A="--profile-from-start off --clock-control none --section WarpStateStats --section
  SourceCounters --page source --print-source sass --csv"
P="python3 -m benchmarks.profile --kernel mha --workload ${WORKLOAD:-skew16_16k}"
# shellcheck disable=SC2086
timeout 120 $N $A $P --system pallas_prefill_mosaic 2>&1 | gzip > "$out/src-packed.csv.gz"
# shellcheck disable=SC2086
timeout 120 $N $A $P --system pallas_prefill_padded --mosaic-options "keyless_units='first'" \
  2>&1 | gzip > "$out/src-first.csv.gz"
# shellcheck disable=SC2086
timeout 120 $N $A $P --system pallas_prefill_padded --mosaic-options "keyless_units='stores'" \
  2>&1 | gzip > "$out/src-stores.csv.gz"
ls -la "$out"

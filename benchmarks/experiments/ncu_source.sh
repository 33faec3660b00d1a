#!/usr/bin/env bash
# On the H200 (the device tool runs it from the repo root; the thirty-seventh session,
# arms as arguments since the forty-eighth): ncu's per-SASS-instruction warp stall samples
# (SourceCounters) of one MHA call per arm, to see which instructions a padded call's
# extra stalls sit on (issue 23's padded cost):
#
#   bash benchmarks/experiments/ncu_source.sh [ARM ...]
#
# Each ARM is "packed" (the packed call, `pallas_prefill_mosaic`) or a `keyless_units`
# value ("first", "stores", "spans", "bulk"), run as `pallas_prefill_padded` with that
# option; the default is "packed bulk" (the forty-seventh session's lead: where the
# padded default's last 1.10x of the packed time goes). WORKLOAD picks the workload
# (skew16_16k by default). Results, gzipped CSV (a row per SASS instruction with its
# stall samples by reason), in $OUT (or ./h200-out) as src-ARM.csv.gz; read them with
# `python -m benchmarks.experiments.ncu_source_summary FILE...` (`--kernel 0`: the work
# list's kernel instead of the attention kernel).
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
N=/usr/local/cuda/bin/ncu
A="--profile-from-start off --clock-control none --section WarpStateStats --section
  SourceCounters --page source --print-source sass --csv"
P="python3 -m benchmarks.profile --kernel mha --workload ${WORKLOAD:-skew16_16k}"
(($#)) || set -- packed bulk
for arm in "$@"; do
  if [ "$arm" = packed ]; then
    # shellcheck disable=SC2086
    timeout 120 $N $A $P --system pallas_prefill_mosaic 2>&1 | gzip > "$out/src-$arm.csv.gz"
  else
    # shellcheck disable=SC2086
    timeout 120 $N $A $P --system pallas_prefill_padded \
      --mosaic-options "keyless_units='$arm'" 2>&1 | gzip > "$out/src-$arm.csv.gz"
  fi
done
ls -la "$out"

#!/usr/bin/env bash
# On the H200 (the device tool runs it from the repo root; the thirty-seventh session),
# one device call for MosaicOptions.unit_row_smem (each unit's work-list row in shared
# memory, the hypothesis of that session's ncu profile): its arms first, one process, 3
# rounds in turns, on the packed and padded MHA short64 and skew16_16k ("rows" against
# the default; "rows_stores" with keyless_units="stores" too), then its GPU tests
# (`-k row_smem`, 30) as far as the call's time allows. Results in $OUT (or ./h200-out).
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name --format=csv,noheader
timeout "${ARMS_S:-160}" python3 -m benchmarks.experiments.arms --rounds 3 --rest 0.3 \
  --out "$out/arms" --arm default --arm rows unit_row_smem=True \
  --arm rows_stores unit_row_smem=True "keyless_units='stores'" --kernels mha \
  --systems pallas_prefill_mosaic pallas_prefill_padded --workloads short64 skew16_16k \
  > "$out/arms.log" 2>&1
echo "== arms (rc $?)"; grep -v "rel. error" "$out/arms.log" | tail -14
grep "rel. error" "$out/arms.log" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/max error /'
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu \
  tests/test_gpu.py tests/test_fp8.py -p no:cacheprovider -n 8 -k row_smem \
  > "$out/gpu-tests.log" 2>&1
echo "== GPU tests (rc $?)"; tail -4 "$out/gpu-tests.log" | cut -c1-300

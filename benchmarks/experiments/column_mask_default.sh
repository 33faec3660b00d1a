#!/usr/bin/env bash
# On the H200 (the device tool runs it from the repo root; the thirty-first session's run
# 1): MosaicOptions.column_mask as config=None's for short prompts. First the GPU tests
# that call it (its bits against the position test's on every mask, rows across
# max_prompt_len, FP8 and padded calls that now take it), then option arms in one process
# (benchmarks.experiments.arms, 3 rounds in turns): column mask on against off on MHA and
# MLA bf16 and MHA FP8, short and long workloads. Results in $OUT (or ./h200-out).
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "${TEST_S:-200}" python3 -m pytest -q -m gpu \
  tests/test_gpu.py tests/test_fp8.py -p no:cacheprovider -p no:benchmark -n 8 \
  -k "column_mask_changes_no_bit or max_prompt_len or compiled_matches_the_dequantized or kv_cache_and_pages or compiled_mosaic_gpu_padded" \
  > "$out/gpu-tests.log" 2>&1
tail -4 "$out/gpu-tests.log"
arms() {  # NAME, then arms.py's arguments after the arms
  local name=$1; shift
  timeout "${ARMS_S:-150}" python3 -m benchmarks.experiments.arms --arm cm column_mask=True \
    --arm pos column_mask=False --rounds 3 --rest 0.5 --out "$out/$name" "$@" \
    > "$out/$name.log" 2>&1
  echo "== $name (rc $?)"; tail -14 "$out/$name.log"
}
arms mha --kernels mha --systems pallas_prefill_mosaic \
  --workloads short64 chunked8x512_page64 equal4x4096 long16384
arms mla --kernels mla --systems pallas_prefill_mosaic \
  --workloads short64 chunked8x512_page64 equal4x4096
arms fp8 --kernels mha --systems pallas_prefill_fp8 --workloads short64 chunked8x512_page64

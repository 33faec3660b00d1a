#!/usr/bin/env bash
# On the H200 (the device tool runs it from the repo root; the thirty-third session).
# PART=a: are a row's bits the same with two and three compute warpgroups
# (experiments.three_wgs_bits); then option arms in one process, 3 rounds in turns: three
# compute warpgroups (with the register cuts) against two, and two with row_sum_first, on
# the long-prompt workloads, and row_sum_first's cost on two warpgroups on the short,
# skewed and equal ones. PART=b: the GPU tests of the column mask (MosaicOptions.
# column_lo_static among their arms) and of the default's warpgroups across
# max_prompt_len, then column_lo_static on against off on MHA and MLA short64 and MHA
# chunked8x512_page64, where the column mask is the default; a first call's steps
# (experiments.lowering_time --device). PART=c (the thirty-fourth session): three
# compute warpgroups against two on the soft-capped call and the uncapped one in the same
# process: if the cap's cost is the MUFU's latency on each warp's chain (BUILD_NOTES,
# issue 23), a third warpgroup hides more of it on the capped call. Results in $OUT (or
# ./h200-out).
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
arms() {  # NAME, SECONDS, then arms.py's arguments
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m benchmarks.experiments.arms --rounds 3 --rest 0.5 \
    --out "$out/$name" "$@" > "$out/$name.log" 2>&1
  echo "== $name (rc $?)"; grep -v "rel. error" "$out/$name.log" | tail -12
  grep "rel. error" "$out/$name.log" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/max error /'
}
if [ "${PART:-a}" = a ]; then
  timeout 200 python3 -m benchmarks.experiments.three_wgs_bits --out "$out" \
    > "$out/three_wgs_bits.log" 2>&1
  echo "== three_wgs_bits (rc $?)"; grep -E "seed=|all bitwise|SOME" "$out/three_wgs_bits.log"
  arms long 200 --arm w2 --arm w2rs row_sum_first=True --arm w3 compute_wgs=3 \
    row_sum_first=True q_per_tile=True column_mask=True --kernels mha \
    --systems pallas_prefill_mosaic --workloads long16384 sliding4x16384_w4096
  arms rs 170 --arm w2 --arm w2rs row_sum_first=True --kernels mha \
    --systems pallas_prefill_mosaic --workloads short64 skew16_16k equal4x4096
elif [ "$PART" = c ]; then
  arms cap 300 --arm w2 --arm w3 compute_wgs=3 row_sum_first=True q_per_tile=True \
    column_mask=True --kernels mha --systems pallas_prefill_mosaic pallas_prefill_softcap \
    --workloads equal4x4096 skew16_16k
else
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py \
    -p no:cacheprovider -p no:benchmark -n 8 \
    -k "column_mask_changes_no_bit or three_wgs_change_no_bit or max_prompt_len" \
    > "$out/gpu-tests.log" 2>&1
  echo "== gpu tests (rc $?)"; tail -3 "$out/gpu-tests.log"
  arms lo_mha 120 --arm lo column_lo_static=True --arm base column_lo_static=False \
    --kernels mha --systems pallas_prefill_mosaic --workloads short64 chunked8x512_page64
  arms lo_mla 70 --arm lo column_lo_static=True --arm base column_lo_static=False \
    --kernels mla --systems pallas_prefill_mosaic --workloads short64
  timeout 90 python3 -m benchmarks.experiments.lowering_time --device --repeats 2 \
    > "$out/first_call.log" 2>&1
  echo "== first call's steps (rc $?)"; grep "^|" "$out/first_call.log"
fi

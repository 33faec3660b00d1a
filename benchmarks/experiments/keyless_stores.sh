#!/usr/bin/env bash
# On the H200 (the device tool runs it from the repo root; the thirty-seventh session),
# one device call for MosaicOptions.keyless_units="stores" (issue 23's padded cost): its
# GPU tests (the key-less units' cases and the padded layouts, stores against the
# reference with poisoned memory), then its arms in one process, 3 rounds in turns, on
# the padded and packed MHA skew16_16k and short64 (the padded call's time against the
# packed one per arm: "first", the packed default, against "stores" and "spread"). Results in
# $OUT (or ./h200-out). SKIP_TESTS=1 leaves the tests out; WORKLOADS replaces the two;
# KEYLESS replaces the arms' placements ("first stores spread") and SYSTEMS their
# systems; TESTS_S and ARMS_S bound the two parts' seconds (200, 300); TESTS_K replaces
# the tests' -k and TEST_FILES their files (tests/test_gpu.py); LOCALITY=1 first times
# zeros written contiguously and head by head
# (benchmarks/experiments/zero_write_locality.py). The fortieth session ran
# `KEYLESS="first stores" WORKLOADS="skew16_16k short64 equal4x4096" TESTS_S=170
# ARMS_S=380 TESTS_K="test_padded_keyless_stores or (test_mosaic_keyless_units and
# stores)"` at bf29b0c (with an arm for the zero jobs pipelined, since removed); the
# forty-second session's call for "spans" is in BUILD_NOTES.md (it got no device).
# Since the fortieth session "stores" is the padded call's default, so the "first" arm
# sets it.
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
if [ -n "${LOCALITY:-}" ]; then
  echo "== zeros written contiguously and head by head"
  timeout 60 python3 -m benchmarks.experiments.zero_write_locality 2>&1 | tee "$out/zero-write-locality.log"
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "${TESTS_S:-200}" python3 -m pytest -q -m gpu \
    ${TEST_FILES:-tests/test_gpu.py} -p no:cacheprovider -n 8 \
    -k "${TESTS_K:-test_mosaic_keyless_units or test_padded_keyless_stores}" > "$out/gpu-tests.log" 2>&1
  echo "== GPU tests (rc $?)"; tail -4 "$out/gpu-tests.log" | cut -c1-300
fi
arms=()
for placement in ${KEYLESS:-first stores spread}; do
  arms+=(--arm "$placement" "keyless_units='$placement'")
done
# shellcheck disable=SC2086
timeout "${ARMS_S:-300}" python3 -m benchmarks.experiments.arms --rounds 3 --rest 0.3 --out "$out/arms" \
  "${arms[@]}" \
  --kernels mha --systems ${SYSTEMS:-pallas_prefill_mosaic pallas_prefill_padded} \
  --workloads ${WORKLOADS:-skew16_16k short64} > "$out/arms.log" 2>&1
echo "== arms (rc $?)"; grep -v "rel. error" "$out/arms.log" | tail -20
grep "rel. error" "$out/arms.log" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/max error /'

#!/usr/bin/env bash
# On the H200 (the device tool runs it from the repo root; the forty-fourth session), one
# device call for MosaicOptions.keyless_units="apart" (issue 23's padded cost: the
# key-less units claimed from a counter of their own, first on a few programs) and the
# forty-second session's "spans": (1) zeros written by a few programs alone
# (benchmarks/experiments/zero_write_locality.py: the rate a program sets apart for them
# reaches), (2) their arms against the padded default ("stores") in one process, 3
# rounds in turns, on the padded and packed MHA skew16_16k and short64, (3) the GPU
# tests of both placements (last: the arms decide whether they matter). Results in $OUT (or ./h200-out). SKIP_TESTS=1 leaves the tests
# out; TESTS_S and ARMS_S bound the two parts' seconds (150, 300); ZERO_PROGRAMS replaces
# the "apart" arms' program counts ("4 8 16"), PLACEMENTS the other arms ("stores spans":
# the first is the baseline) and WORKLOADS the two workloads.
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
echo "== zeros written by all programs and by a few"
timeout 60 python3 -m benchmarks.experiments.zero_write_locality 2>&1 | tee "$out/zero-write-locality.log"
arms=()
for placement in ${PLACEMENTS:-stores spans}; do
  arms+=(--arm "$placement" "keyless_units='$placement'")
done
for n in ${ZERO_PROGRAMS:-4 8 16}; do
  arms+=(--arm "apart$n" "keyless_units='apart'" "zero_programs=$n")
done
# shellcheck disable=SC2086
timeout "${ARMS_S:-300}" python3 -m benchmarks.experiments.arms --rounds 3 --rest 0.3 \
  --out "$out/arms" "${arms[@]}" --kernels mha \
  --systems pallas_prefill_mosaic pallas_prefill_padded \
  --workloads ${WORKLOADS:-skew16_16k short64} > "$out/arms.log" 2>&1
echo "== arms (rc $?)"; grep -v "rel. error" "$out/arms.log" | tail -24
grep "rel. error" "$out/arms.log" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/max error /'
if [ -z "${SKIP_TESTS:-}" ]; then
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "${TESTS_S:-150}" python3 -m pytest -q -m gpu \
    tests/test_gpu.py -p no:cacheprovider -n 8 -k "apart or spans" > "$out/gpu-tests.log" 2>&1
  echo "== GPU tests (rc $?)"; tail -4 "$out/gpu-tests.log" | cut -c1-300
fi

#!/usr/bin/env bash
# On the H200 (the device tool runs this from the repo root): the GPU tests (8 processes
# compile in parallel), then the harness; arguments go to benchmarks.run. Results land in
# $OUT (or ./h200-out): gpu-tests.log, bench.log, results.json, results.md.
# H200_PART=tests or H200_PART=bench runs one of the two; H200_TEST_ARGS adds pytest
# arguments, split on spaces (e.g. "-k mosaic"; an expression with spaces needs a direct
# pytest call). H200_SPLIT=i/n runs only part i (0 to n - 1) of the GPU tests, every n-th
# of their collected ids from the i-th on (so heavy parametrizations spread over the
# parts): the whole suite takes more than one 10-minute device call, so run it as
# H200_SPLIT=0/4 .. 3/4 in four (or 0/3 .. 2/3 with H200_JOBS=14). H200_JOBS sets the
# number of test processes (8 by default; the machine has 16 cores). Wheels carried in
# .whl (tokamax and its dependencies, BUILD_NOTES.md) are installed first.
set -uo pipefail
out=${OUT:-h200-out}
part=${H200_PART:-all}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
# JAX allocates on demand: torch's anchors share the GPU in the same process.
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
if [ "$part" != bench ]; then
  selected=(tests)
  if [ -n "${H200_SPLIT:-}" ]; then
    i=${H200_SPLIT%/*} n=${H200_SPLIT#*/}
    # shellcheck disable=SC2086
    python3 -m pytest -q -m gpu tests -p no:cacheprovider --co ${H200_TEST_ARGS:-} \
      2>/dev/null | grep '::' > "$out/gpu-test-ids.txt"
    mapfile -t selected < <(awk -v i="$i" -v n="$n" '(NR - 1) % n == i' "$out/gpu-test-ids.txt")
    echo "part $H200_SPLIT: ${#selected[@]} of $(wc -l < "$out/gpu-test-ids.txt") GPU tests"
  fi
  # The test processes (eight by default) share the GPU: each frees what it no longer uses
  # (the platform allocator), so that one's cached blocks do not run another out of memory.
  # shellcheck disable=SC2086
  XLA_PYTHON_CLIENT_ALLOCATOR=platform python3 -m pytest -q -m gpu "${selected[@]}" \
    -p no:cacheprovider -p no:benchmark -n "${H200_JOBS:-8}" ${H200_TEST_ARGS:-} 2>&1 \
    | tee "$out/gpu-tests.log" | tail -25
fi
if [ "$part" != tests ]; then
  python3 -m benchmarks.run --out "$out" "$@" 2>&1 | tee "$out/bench.log"
fi

#!/usr/bin/env bash
# On the H200 (the device tool runs it from the repo root; written in the forty-eighth
# session, not yet run): whether JAX's persistent compilation cache takes our first call
# of a new shape (issue 25's compile time: ours 5.1-7.4 s on the H200, cuDNN packed's
# 0.4-1.4 s; the thirty-fifth session's split on an H100: trace 0.4-0.6 s, Pallas' Mosaic
# GPU lowering 2.2-2.3 s, `compile()` 3.1-3.6 s) down to its host work: every step of a
# first call (`lowering_time --device`: trace, lower, compile, first and second run, JAX's
# in-memory caches cleared before each repeat) with the cache on, in a process that fills
# it (repeat 0 cold, repeat 1 from the cache) and in a second process that only reads
# it. The question for the README: does a serving process that restarts pay the compile
# again (the Mosaic GPU kernel's PTX to SASS may happen when the executable loads, which
# the cache would not hold)? Prediction: compile() 3.1-3.6 s -> under 0.5 s from the
# cache; trace and lowering unchanged (the cache keys on the lowered module). Results in
# $OUT (or ./h200-out).
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export JAX_COMPILATION_CACHE_DIR=/tmp/pallas-prefill-jax-cache
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=0
rm -rf "$JAX_COMPILATION_CACHE_DIR"
for kernel in mha mla; do
  timeout 200 python3 -m benchmarks.experiments.lowering_time --device --kernel $kernel \
    --repeats 2 > "$out/cache-$kernel-fill.log" 2>&1
  echo "== $kernel, the process that fills the cache (rc $?)"; tail -6 "$out/cache-$kernel-fill.log"
  timeout 120 python3 -m benchmarks.experiments.lowering_time --device --kernel $kernel \
    --repeats 1 > "$out/cache-$kernel-read.log" 2>&1
  echo "== $kernel, a second process (rc $?)"; tail -4 "$out/cache-$kernel-read.log"
done
du -sh "$JAX_COMPILATION_CACHE_DIR"

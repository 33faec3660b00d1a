#!/usr/bin/env bash
# On the H200 (the device tool runs it from the repo root; written in the forty-eighth
# session, not yet run), one device call for MosaicOptions.work_list_shuffles (the work
# list kernel's sort steps and scans within a thread or a warp without shared memory: 216
# warpgroup barriers -> 52 on padded skew16_16k's 1024 lanes, 170 -> 44 on a packed
# call's 256): its GPU tests (the compiled kernel's table and scalars against XLA's, bit
# for bit, with and without the option); ncu's duration of each kernel of one MHA call,
# packed and padded (`dot_product_attention`) on skew16_16k and short64, off and on
# (prediction: padded skew16_16k's work list kernel 27.6 us -> 18-22 us, a packed one's
# 9.2 -> 5-7 us); then the option's arms in one process, 3 rounds in turns (prediction:
# padded skew16_16k 1.010x-1.017x, short64 1.01x-1.015x, packed skew16_16k 1.003x-1.007x).
# Results in $OUT (or ./h200-out). SKIP_TESTS=1 / SKIP_NCU=1 leave those parts out.
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 200 python3 -m pytest -q -m gpu \
    tests/test_gpu.py -p no:cacheprovider -n 8 -k "work_items" > "$out/gpu-tests.log" 2>&1
  echo "== GPU tests (rc $?)"; tail -4 "$out/gpu-tests.log" | cut -c1-300
fi
if [ -z "${SKIP_NCU:-}" ]; then
  N="/usr/local/cuda/bin/ncu --profile-from-start off --clock-control none --metrics
    gpu__time_duration.sum --csv"
  for workload in skew16_16k short64; do
    for system in pallas_prefill_mosaic pallas_prefill_padded; do
      for on in False True; do
        name=$workload-$system-$on
        # shellcheck disable=SC2086
        timeout 90 $N python3 -m benchmarks.profile --kernel mha --workload $workload \
          --system $system --mosaic-options work_list_shuffles=$on > "$out/ncu-$name.csv" 2>&1
        echo "== $name: $(grep -c '"gpu__time_duration.sum"' "$out/ncu-$name.csv") kernels;" \
          "ns: $(grep '"gpu__time_duration.sum"' "$out/ncu-$name.csv" \
          | awk -F'","' '{gsub(/[",]/, "", $NF); printf "%s ", $NF}')"
      done
    done
  done
fi
timeout 240 python3 -m benchmarks.experiments.arms --rounds 3 --rest 0.3 --out "$out/arms" \
  --arm off --arm shuffles work_list_shuffles=True --kernels mha \
  --systems pallas_prefill_mosaic pallas_prefill_padded --workloads skew16_16k short64 \
  > "$out/arms.log" 2>&1
echo "== arms (rc $?)"; grep -v "rel. error" "$out/arms.log" | tail -10
grep "rel. error" "$out/arms.log" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/max error /'

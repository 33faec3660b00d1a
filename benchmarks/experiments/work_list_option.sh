#!/usr/bin/env bash
# On the H200 (the device tool runs it from the repo root), one device call for a
# boolean option of the work list's kernel, OPTION (`MosaicOptions` field; by default
# work_list_shuffles, for which it was written in the forty-eighth session and run in the
# forty-ninth: the sort's and scans' exchanges within a thread or a warp without shared
# memory; OPTION=work_list_staged_table: the table through shared memory, then coalesced
# stores): the work list's GPU tests (the compiled kernel's table and scalars against
# XLA's, bit for bit, every option); ncu's duration of each kernel of one MHA call,
# packed and padded (`dot_product_attention`) on skew16_16k and short64, the option off
# and on; then the option's arms in one process, 3 rounds in turns.
# Results in $OUT (or ./h200-out). SKIP_TESTS=1 / SKIP_NCU=1 leave those parts out.
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
option=${OPTION:-work_list_shuffles}
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
          --system $system --mosaic-options $option=$on > "/tmp/ncu-$name.csv" 2>&1
        echo "== $name: $(grep -c '"gpu__time_duration.sum"' "/tmp/ncu-$name.csv") kernels;" \
          "ns: $(grep '"gpu__time_duration.sum"' "/tmp/ncu-$name.csv" \
          | awk -F'","' '{gsub(/[",]/, "", $NF); printf "%s ", $NF}')" | tee -a "$out/ncu.txt"
        cat "/tmp/ncu-$name.csv" >> "$out/ncu.txt"  # (one file: the device returns 8)
      done
    done
  done
fi
timeout 240 python3 -m benchmarks.experiments.arms --rounds 3 --rest 0.3 --out "$out/arms" \
  --arm off "$option=False" --arm on "$option=True" --kernels mha \
  --systems pallas_prefill_mosaic pallas_prefill_padded --workloads skew16_16k short64 \
  > "$out/arms.log" 2>&1
echo "== arms (rc $?)"; grep -v "rel. error" "$out/arms.log" | tail -10
grep "rel. error" "$out/arms.log" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/max error /'

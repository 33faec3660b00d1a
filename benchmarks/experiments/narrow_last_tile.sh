#!/usr/bin/env bash
# On the H200 (the device tool runs it from the repo root; the thirty-fifth session), one
# device call: the GPU tests of MosaicOptions.narrow_last_tile (off against on, bitwise)
# and of the default's warpgroups across max_prompt_len; the option's arms in one
# process, 3 rounds in turns, on MHA short64, skew16_16k and equal4x4096 (add MLA short64
# with MLA=1); then the harness on long16384 with cuDNN and torch's SDPA (issue 25's
# 0.83-of-matmul target, three warpgroups since the thirty-fourth session). Results in
# $OUT (or ./h200-out). SKIP_TESTS=1 / SKIP_HARNESS=1 leave those parts out.
set -uo pipefail
out=${OUT:-h200-out}
mkdir -p "$out"
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,clocks.sm,power.draw --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout 240 python3 -m pytest -q -m gpu \
    tests/test_gpu.py -p no:cacheprovider -n 8 -k "test_mosaic_narrow_last_tile_changes_no_bit \
    or test_mosaic_three_wgs_change_no_bit or test_rows_do_not_depend_on_max_prompt_len" \
    > "$out/gpu-tests.log" 2>&1
  echo "== GPU tests (rc $?)"; tail -4 "$out/gpu-tests.log" | cut -c1-300
fi
timeout 200 python3 -m benchmarks.experiments.arms --rounds 3 --rest 0.3 --out "$out/arms" \
  --arm off --arm narrow narrow_last_tile=True --kernels mha \
  --systems pallas_prefill_mosaic --workloads short64 skew16_16k equal4x4096 \
  > "$out/arms.log" 2>&1
echo "== arms (rc $?)"; grep -v "rel. error" "$out/arms.log" | tail -10
grep "rel. error" "$out/arms.log" | awk '{print $NF}' | sort -g | tail -1 | sed 's/^/max error /'
if [ -n "${MLA:-}" ]; then
  timeout 120 python3 -m benchmarks.experiments.arms --rounds 3 --rest 0.3 \
    --out "$out/arms-mla" --arm off --arm narrow narrow_last_tile=True --kernels mla \
    --systems pallas_prefill_mosaic --workloads short64 > "$out/arms-mla.log" 2>&1
  echo "== arms MLA (rc $?)"; grep -v "rel. error" "$out/arms-mla.log" | tail -4
fi
if [ -z "${SKIP_HARNESS:-}" ]; then
  timeout 150 python3 -m benchmarks.run --out "$out/harness" --kernels mha --rounds 3 \
    --rest 0.5 --workloads long16384 --systems pallas_prefill_default cudnn_packed \
    torch_sdpa_cudnn > "$out/harness.log" 2>&1
  echo "== harness (rc $?)"; tail -14 "$out/harness.log"
fi

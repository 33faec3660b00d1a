#!/usr/bin/env bash
# PTX and ptxas's report of the library's Mosaic GPU kernels, one harness call per arm, on
# the H200 (the twenty-ninth session's register work; read them on the CPU with ptxas and
# benchmarks/experiments/ptx_pressure.py):
#
#   bash benchmarks/experiments/ptx_dumps.sh OUT KERNEL WORKLOAD SYSTEM NAME "OPT=V ..." ...
#
# For each NAME and its options (``benchmarks.profile --mosaic-options``; "" for none):
# OUT/NAME.txt.gz (everything the call printed with MOSAIC_GPU_DUMP_PTX and _PTXAS: the
# work list's kernel's PTX, then the attention kernel's, each followed by ptxas's report)
# and ptxas's lines on stdout (registers, spills, C7512).
set -euo pipefail
out=$1 kernel=$2 workload=$3 system=$4
shift 4
mkdir -p "$out"
while (($# >= 2)); do
  name=$1 opts=$2
  shift 2
  # shellcheck disable=SC2086
  MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 python3 -m benchmarks.profile \
    --kernel "$kernel" --workload "$workload" --system "$system" \
    ${opts:+--mosaic-options $opts} > "$out/$name.txt" 2>&1
  echo "## $name ($opts)"
  grep -E "spill|Used [0-9]+ registers|C75" "$out/$name.txt" | sort | uniq -c || true
  gzip -f "$out/$name.txt"
done

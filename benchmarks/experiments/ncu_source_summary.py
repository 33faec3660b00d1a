"""A short summary of Nsight Compute's source page (a row per SASS instruction with its
warp stall samples), as ``benchmarks/experiments/ncu_source.sh`` writes it (gzipped):
for one Mosaic GPU kernel of the call, its stall samples in all and by reason, by
opcode, and the instructions with the most samples. ``--kernel`` picks it among the
call's Mosaic GPU kernels in launch order: -1 (the default) the attention kernel, the
last; 0 the work list's kernel, the first where the call builds its list on the GPU.

    python -m benchmarks.experiments.ncu_source_summary A.csv.gz B.csv.gz ... [--top 12]
        [--kernel -1]

The thirty-eighth session's reading of MHA skew16_16k (BUILD_NOTES.md): the padded
call's extra samples sit on the zeros' stores (TMA store issue under "first", the zero
jobs' work-list reads under "stores") and on the producer's barrier waits, not on the
matrix products.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io

from benchmarks.experiments.ncu_summary import number

ALL = "Warp Stall Sampling (All Samples)"


def kernels(path):
  """[(kernel name, header, rows)] of a source-page CSV (plain or gzipped), one per
  profiled kernel, in launch order."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", encoding="utf-8", errors="replace") as f:
    lines = f.read().splitlines()
  found, name, body = [], None, []
  for line in lines + ['"Kernel Name",""']:  # (a sentinel closes the last kernel)
    if line.startswith('"Kernel Name"'):
      if name is not None and body:
        table = list(csv.reader(io.StringIO("\n".join(body))))
        header = table[0]
        found.append((name, header, [r for r in table[1:] if len(r) >= len(header)]))
      name, body = next(csv.reader([line]))[1], []
    elif name is not None:
      body.append(line)
  return found


def opcode(sass: str) -> str:
  """The SASS instruction's opcode without modifiers or predicate (``@!P2 BRA`` -> BRA)."""
  words = sass.split()
  words = words[1:] if words and words[0].startswith("@") else words
  return words[0].split(".")[0] if words else ""


def summary(path: str, top: int, kernel: int = -1) -> str:
  mosaic = [k for k in kernels(path) if k[0].startswith("anonymous_mosaic_gpu_kernel")]
  if not -len(mosaic) <= kernel < len(mosaic):
    return f"{path}: {len(mosaic)} Mosaic GPU kernels, no kernel {kernel}"
  _, header, rows = mosaic[kernel]
  col = {h: i for i, h in enumerate(header)}
  value = lambda r, name: number(r[col[name]]) or 0.0  # noqa: E731  (blank: none)
  reasons = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
  total = sum(value(r, ALL) for r in rows)
  by_reason = collections.Counter({h[len("stall_"):]: sum(value(r, h) for r in rows)
                                   for h in reasons})
  by_op = collections.Counter()
  for r in rows:
    by_op[opcode(r[col["Source"]])] += value(r, ALL)
  lines = [f"{path}, Mosaic GPU kernel {kernel} of {len(mosaic)}: {total:.0f} samples, "
           f"{len(rows)} instructions",
           "  by reason: " + ", ".join(f"{k} {v:.0f}" for k, v in by_reason.most_common(8)),
           "  by opcode: " + ", ".join(f"{k} {v:.0f}" for k, v in by_op.most_common(12))]
  for r in sorted(rows, key=lambda r: -value(r, ALL))[:top]:
    lines.append(f"  {r[col['Address']][-5:]} {value(r, ALL):6.0f} samples, long_sb "
                 f"{value(r, 'stall_long_sb'):5.0f}, executed "
                 f"{value(r, 'Instructions Executed'):8.0f}: {r[col['Source']][:70]}")
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("files", nargs="+")
  parser.add_argument("--top", type=int, default=12)
  parser.add_argument("--kernel", type=int, default=-1,
                      help="which Mosaic GPU kernel of the call, in launch order (-1: the "
                           "last, the attention kernel; 0: the work list's)")
  args = parser.parse_args(argv)
  print("\n".join(summary(f, args.top, args.kernel) for f in args.files))


if __name__ == "__main__":
  main()

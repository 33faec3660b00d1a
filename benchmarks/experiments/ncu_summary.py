"""A short table from Nsight Compute's raw CSV pages: per profiled call, each kernel's
duration, and for its longest kernel the issue, pipe and stall metrics.

    ncu --profile-from-start off --clock-control none --csv --page raw \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        --section InstructionStats python -m benchmarks.profile ... > A.csv
    python -m benchmarks.experiments.ncu_summary A.csv B.csv ...

Columns are matched by substring (``--metric``, repeatable); the defaults are the
duration, instructions, issue-slot use, the MUFU (xu), FMA, ALU and tensor pipes, and
the per-issue stall reasons.
"""

from __future__ import annotations

import argparse
import csv
import io

DEFAULT_METRICS = ("gpu__time_duration.sum", "inst_executed.sum", "issue_active",
                   "inst_executed_pipe_xu", "inst_executed_pipe_fma",
                   "inst_executed_pipe_alu", "pipe_tensor", "issue_stalled")


def rows(path):
  """The kernel rows of a raw-page CSV (ncu's own lines before the header skipped)."""
  with open(path, encoding="utf-8", errors="replace") as f:
    text = f.read()
  start = text.find('"ID"')
  if start < 0:
    return [], []
  table = list(csv.reader(io.StringIO(text[start:])))
  header, body = table[0], table[1:]
  # (the row after the header holds the units: no kernel ID)
  body = [r for r in body if r and r[0].isdigit()]
  return header, body


def number(x):
  try:
    return float(x.replace(",", ""))
  except ValueError:
    return None


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("files", nargs="+")
  parser.add_argument("--metric", action="append", default=None)
  args = parser.parse_args(argv)
  wanted = args.metric or DEFAULT_METRICS
  for path in args.files:
    header, body = rows(path)
    if not body:
      print(f"## {path}: no kernel rows")
      continue
    name, dur = header.index("Kernel Name"), header.index("gpu__time_duration.sum")
    print(f"## {path}")
    for r in body:
      print(f"- {r[name][:60]}: {r[dur]}")
    longest = max(body, key=lambda r: number(r[dur]) or 0.0)
    print(f"longest: {longest[name][:60]}")
    for i, col in enumerate(header):
      value = number(longest[i]) if i < len(longest) else None
      if value is not None and any(w in col for w in wanted) and value != 0.0:
        print(f"  {col} = {longest[i]}")


if __name__ == "__main__":
  main()

"""How fast the GPU writes zeros in the padded call's two store patterns (issue 23).

    python -m benchmarks.experiments.zero_write_locality [--rows 65536] [--heads 32]

The padded call writes the zeros of its padding rows, [rows, heads, 128] bf16. Its zero
jobs (``keyless_units="stores"``) each write one head's rows: 256-byte pieces 8 KB apart
(heads x 256 bytes), where a whole row of all heads would be 8 KB contiguous. This times,
with torch on the GPU (CUDA events, medians of 20): the array zeroed at once
(contiguous), head by head (one strided fill per head: 256-byte pieces at the row
stride), and in row blocks (contiguous slabs of the same size as a head's pieces), each
as bytes per second. If the strided fill is much slower than the contiguous one, the
zero jobs' layout, not their count, is what DRAM pays for.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def timed(fn, reps=20):
  start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  fn()
  torch.cuda.synchronize()
  out = []
  for _ in range(reps):
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    out.append(start.elapsed_time(end) / 1e3)
  return statistics.median(out)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--rows", type=int, default=65536)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--depth", type=int, default=128)
  args = parser.parse_args()
  o = torch.empty(args.rows, args.heads, args.depth, dtype=torch.bfloat16, device="cuda")
  nbytes = o.numel() * o.element_size()
  flat = o.view(args.heads, -1)  # row blocks: heads slabs of rows / heads rows each

  def per_head():
    for h in range(args.heads):
      o[:, h, :].zero_()

  def per_block():
    for h in range(args.heads):
      flat[h].zero_()

  arms = {"contiguous": lambda: o.zero_(), "per head (strided)": per_head,
          "per row block (contiguous slabs)": per_block}
  print(f"{torch.cuda.get_device_name()}: [{args.rows}, {args.heads}, {args.depth}] bf16, "
        f"{nbytes / 1e6:.0f} MB")
  for name, fn in arms.items():
    secs = timed(fn)
    print(f"  {name:34s} {secs * 1e6:9.1f} us  {nbytes / secs / 1e12:6.2f} TB/s")


if __name__ == "__main__":
  main()

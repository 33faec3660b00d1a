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

Then (the forty-fourth session) the same bytes written by a few programs only (a Triton
kernel whose P programs each store a contiguous 1/P of the array in 16 KB blocks, P from
1 to 132): the rate a few programs set apart for the zeros would reach while the others
compute. The padded skew16_16k call writes 0.4 GB of zeros beside a 0.55 ms packed call,
so P programs hide them where P of them write 0.73 TB/s or more.
"""

from __future__ import annotations

import argparse
import statistics

import torch

try:
  import triton
  import triton.language as tl
except ImportError:  # (the device image has it; the report says when it is missing)
  triton = None

if triton is not None:

  @triton.jit
  def _zero_chunks(o_ptr, n_blocks_per_program, BLOCK: tl.constexpr):
    """Program p stores zeros to blocks [p * n, (p + 1) * n) of BLOCK bf16 each."""
    p = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    zeros = tl.zeros((BLOCK,), tl.bfloat16)
    base = p.to(tl.int64) * n_blocks_per_program * BLOCK
    for i in range(n_blocks_per_program):
      tl.store(o_ptr + base + i * BLOCK + offs, zeros)


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
  if triton is None:
    print("  (no triton: the few-program arms not run)")
    return
  block = 8192  # bf16: 16 KB a store of the program's
  flat1 = o.view(-1)
  blocks = flat1.numel() // block
  for programs in (1, 2, 4, 8, 16, 32, 66, 132):
    per = blocks // programs
    secs = timed(lambda: _zero_chunks[(programs,)](flat1, per, BLOCK=block, num_warps=4))
    written = per * programs * block * o.element_size()
    print(f"  {programs:3d} programs (st.global)          {secs * 1e6:9.1f} us  "
          f"{written / secs / 1e12:6.2f} TB/s  {written / secs / programs / 1e9:6.1f} GB/s each")


if __name__ == "__main__":
  main()

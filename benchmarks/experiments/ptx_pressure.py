"""Where a Mosaic GPU kernel's registers go: its loops' live-in values and an estimate of
their register pressure from the PTX, and its loops' spills from the SASS, on the CPU.

The twenty-eighth session's question (BUILD_NOTES.md): three compute warpgroups leave 160
registers a compute thread, and the library's bf16 kernel then spills. Get the kernel's
PTX on the H200 (one short device call; the first module printed is the work list's
kernel, the attention kernel follows):

    MOSAIC_GPU_DUMP_PTX=1 python3 SCRIPT > ptx.txt   # any script that runs the call

then, here, with ptxas and nvdisasm from PyPI's wheels (``pip download
nvidia-cuda-nvcc nvidia-cuda-nvdisasm``; the device has no nvdisasm):

    ptxas -arch=sm_90a -O3 -v kernel.ptx -o kernel.cubin   # spills, C7512
    nvdisasm -c -g kernel.cubin > kernel.sass
    python -m benchmarks.experiments.ptx_pressure kernel.ptx [--loop K] [--sass kernel.sass]

For each loop of the PTX (a branch back to an earlier label) it prints the values live
into it (defined outside it and used inside: loop-carried or invariant), in 32-bit
registers, and the peak of a linear estimate of its pressure (the live-ins all through,
each value defined inside from its first definition to its last use in the loop); with
``--loop K`` the live-in values that are 64-bit or loop-invariant 32-bit with their
definitions (the wgmma descriptors LLVM hoisted, for one) and the pressure along the
loop. With ``--sass``, each SASS loop's instructions, matrix instructions (HGMMA, FP8's
QGMMA), MUFU.EX2 and spill stores and loads (STL, LDL). The estimate is PTX's virtual
registers, not ptxas's allocation: read it for where the peak is and what is live, not
as the count ptxas will use.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import re

WIDTH = {"r": 1, "f": 1, "b": 1, "rd": 2, "fd": 2, "rs": 0.5, "h": 0.5, "hh": 1, "p": 0}
_REG = re.compile(r"%(rd|fd|rs|hh|r|f|b|h|p)(\d+)\b")
_NO_DEST = ("st.", "bar", "bra", "wgmma", "mbarrier", "cp.", "fence", "red.", "setmaxnreg",
            "ret", "@")


@dataclasses.dataclass
class Loop:
  first: int  # line of its label
  last: int  # line of the branch back
  live_in: list  # (kind, number) of the values live into it
  peak: float  # 32-bit registers
  peak_line: int
  curve: list  # (line, 32-bit registers)


def registers(text: str) -> list:
  return _REG.findall(text)


def _definitions(lines):
  """{register: [lines that define it]}: an instruction's first operand (or the braced
  list of them), for opcodes that write one."""
  defs = collections.defaultdict(list)
  for i, line in enumerate(lines):
    s = line.strip()
    if not s or s[0] in "/.$}{" or s.startswith(_NO_DEST):
      continue
    m = re.match(r"([\w.]+)\s+(.*);", s)
    if not m:
      continue
    ops = m.group(2)
    dest = ops[1:ops.index("}")] if ops.startswith("{") else ops.split(",")[0]
    for reg in registers(dest):
      defs[reg].append(i)
  return defs


def ptx_loops(text: str) -> list[Loop]:
  """The PTX's loops with their live-in values and pressure estimate (module docstring)."""
  lines = text.splitlines()
  labels = {}
  for i, line in enumerate(lines):
    m = re.match(r"^(\$L__BB\d+_\d+):", line.strip())
    if m:
      labels[m.group(1)] = i
  defs = _definitions(lines)
  loops = []
  for i, line in enumerate(lines):
    m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
    if not m or labels.get(m.group(1), i) >= i:
      continue
    a, b = labels[m.group(1)], i
    first_def, last_use = {}, {}
    for j in range(a, b + 1):
      for reg in registers(lines[j]):
        last_use[reg] = j
        inside = [d for d in defs.get(reg, []) if a <= d <= b]
        if inside:
          first_def.setdefault(reg, min(inside))
    live_in = sorted(r for r in last_use if any(d < a or d > b for d in defs.get(r, [])))
    base = sum(WIDTH[r[0]] for r in live_in)
    inner = [(first_def[r], last_use[r], WIDTH[r[0]]) for r in first_def if r not in live_in]
    delta = collections.Counter()
    for d, u, w in inner:
      delta[d] += w
      delta[u + 1] -= w
    curve, live = [], base
    for j in range(a, b + 1):
      live += delta[j]
      curve.append((j, live))
    peak, peak_line = max((v, j) for j, v in curve)
    loops.append(Loop(a, b, live_in, peak, peak_line, curve))
  return loops


def invariant_live_ins(text: str, loop: Loop) -> list:
  """(register, its last definition before the loop) of the loop's live-in values that
  are 64-bit, or 32-bit and never written inside it."""
  lines = text.splitlines()
  defs = _definitions(lines)
  out = []
  for reg in loop.live_in:
    inside = any(loop.first <= d <= loop.last for d in defs.get(reg, []))
    before = [d for d in defs.get(reg, []) if d < loop.first]
    if reg[0] == "rd" or (reg[0] in ("r", "b", "f") and not inside):
      out.append((reg, lines[before[-1]].strip() if before else "?"))
  return out


def sass_loops(text: str) -> list[dict]:
  """Each SASS loop (a branch back to an earlier label): its address range and counts of
  instructions, matrix instructions, MUFU.EX2, STL and LDL."""
  instructions, labels, pending = [], {}, []
  for line in text.splitlines():
    s = line.strip()
    m = re.match(r"\.L_x_(\d+):", s)
    if m:
      pending.append(int(m.group(1)))
      continue
    m = re.match(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", s)
    if m:
      address = int(m.group(1), 16)
      labels.update((p, address) for p in pending)
      pending = []
      instructions.append((address, m.group(2)))
  loops = []
  for address, ins in instructions:
    m = re.search(r"\bBRA\b.*\.L_x_(\d+)", ins)
    if not m or labels.get(int(m.group(1)), address) >= address:
      continue
    start = labels[int(m.group(1))]
    body = [t for x, t in instructions if start <= x <= address]
    count = lambda pat, body=body: sum(1 for t in body if re.search(pat, t))  # noqa: E731
    loops.append(dict(start=start, end=address, instructions=len(body),
                      gmma=count(r"\b[HQ]GMMA\b"), ex2=count(r"MUFU\.EX2"),
                      stl=count(r"\bSTL\b"), ldl=count(r"\bLDL\b")))
  return loops


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("ptx")
  ap.add_argument("--loop", type=int, default=None, help="the loop to show in detail")
  ap.add_argument("--sass", default=None, help="the kernel's SASS (nvdisasm -c -g)")
  args = ap.parse_args(argv)
  text = open(args.ptx).read()
  loops = ptx_loops(text)
  for k, loop in enumerate(loops):
    print(f"loop {k}: PTX lines {loop.first}-{loop.last}, live-in "
          f"{sum(WIDTH[r[0]] for r in loop.live_in):.0f} registers, peak about "
          f"{loop.peak:.0f} at line {loop.peak_line}")
  if args.loop is not None:
    loop = loops[args.loop]
    lines = text.splitlines()
    print(f"\nloop {args.loop}'s 64-bit and invariant live-ins:")
    for reg, definition in invariant_live_ins(text, loop):
      print(f"  %{reg[0]}{reg[1]}: {definition}")
    print(f"\nloop {args.loop}'s pressure along it:")
    step = max(1, len(loop.curve) // 25)
    for line, live in loop.curve[::step]:
      print(f"  {line:6d} {live:6.0f}  {lines[line].strip()[:70]}")
  if args.sass:
    print("\nSASS loops: instructions, matrix instructions, MUFU.EX2, STL, LDL")
    for loop in sass_loops(open(args.sass).read()):
      print(f"  {loop['start']:#07x}-{loop['end']:#07x}: {loop['instructions']:5d} "
            f"{loop['gmma']:4d} {loop['ex2']:4d} {loop['stl']:4d} {loop['ldl']:4d}")


if __name__ == "__main__":
  main()

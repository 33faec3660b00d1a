"""README.md's Python examples run as written, in the order a reader meets them.

The examples run one after another in one namespace (the later ones reuse the first
one's batch, as a reader pasting them in turn would), on the CPU in interpret mode; each
one's ``out`` must be finite, with the shape its last ``# (rows, heads, depth)`` comment
gives where it gives one. The signature blocks (no ``pp.`` call) are not examples. The
sharding example takes two of the four host devices that tests/conftest.py makes.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def examples() -> list[str]:
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  return [b for b in blocks if "pp." in b]


def run(block: str, index: int, namespace: dict) -> None:
  exec(compile(block, f"README.md, example {index}", "exec"), namespace)  # noqa: S102


def test_readme_has_its_examples():
  # the MHA, MLA, backend, paged and sharding examples
  assert len(examples()) >= 5


def test_readme_examples_run_in_order():
  namespace: dict = {}
  for index, block in enumerate(examples()):
    namespace.pop("out", None)
    run(block, index, namespace)
    out = np.asarray(namespace["out"], np.float32)
    assert np.isfinite(out).all(), f"example {index}: out is not finite"
    shapes = re.findall(r"# \((\d+(?:, \d+)*)\)", block)
    if shapes:
      expected = tuple(int(x) for x in shapes[-1].split(", "))
      assert out.shape == expected, f"example {index}: out {out.shape}, not {expected}"

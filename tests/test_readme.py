"""README.md's Python examples run as written, in the order a reader meets them.

Each example runs after the first one (the MHA example, whose batch the later ones reuse),
on the CPU in interpret mode; its ``out`` must be finite, with the shape its last
``# (rows, heads, depth)`` comment gives where it gives one. The signature blocks (no
``pp.`` call) are not examples. The sharding example takes two of the four host devices
that tests/conftest.py makes.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def examples() -> list[str]:
  blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
  return [b for b in blocks if "pp." in b]


def run(block: str, index: int, namespace: dict) -> None:
  exec(compile(block, f"README.md, example {index}", "exec"), namespace)  # noqa: S102


def test_readme_has_its_examples():
  # the MHA, MLA, backend, paged and sharding examples
  assert len(examples()) >= 5


@pytest.mark.parametrize("index", range(len(examples())))
def test_readme_example_runs(index):
  blocks = examples()
  namespace: dict = {}
  run(blocks[0], 0, namespace)
  if index:
    namespace.pop("out")
    run(blocks[index], index, namespace)
  out = np.asarray(namespace["out"], np.float32)
  assert np.isfinite(out).all()
  shapes = re.findall(r"# \((\d+(?:, \d+)*)\)", blocks[index])
  if shapes:
    assert out.shape == tuple(int(x) for x in shapes[-1].split(", "))

import jax
import pytest


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run benchmarks/h200.sh on the H200)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)

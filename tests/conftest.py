import warnings

import jax
import pytest

# The Pallas Triton backend is deprecated in favour of Mosaic GPU (JAX 0.11); its warnings
# are expected here.
warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"jax\..*")


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU; skipped on the CPU")


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run benchmarks/h200.sh on the H200)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)

import os

# Several host devices, so that tests/test_sharding.py can shard over a mesh on a CPU-only
# machine; set before JAX starts. Every other test runs on the first device as usual.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=4").strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run benchmarks/h200.sh on the H200)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)

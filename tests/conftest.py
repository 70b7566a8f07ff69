"""Shared test set-up.

* 8 virtual CPU devices (for the sharding tests); must be set before jax starts.
* `@pytest.mark.gpu`: needs a CUDA GPU (Hopper or newer for the Pallas kernels);
  skipped elsewhere. Run them with `pytest -m gpu` on a GPU machine.
"""

import os

os.environ.setdefault("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
  os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def has_gpu() -> bool:
  try:
    return jax.devices()[0].platform == "gpu"
  except RuntimeError:
    return False


def pytest_configure(config):
  config.addinivalue_line("markers", "gpu: needs a CUDA GPU (sm_90+); run with -m gpu")
  config.addinivalue_line("markers", "slow: slow on CPU (interpret mode)")


def pytest_collection_modifyitems(config, items):
  if has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on one)")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)


@pytest.fixture
def rng():
  return np.random.default_rng(0)

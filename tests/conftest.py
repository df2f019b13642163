"""Tests marked `gpu` run only where a CUDA GPU, CuPy and PyTorch are present; elsewhere they skip."""

import pytest
from hypothesis import Phase, settings

# `pytest --hypothesis-profile=no-shrink`: a failing example reported as found, not shrunk (shrinking
# a slow GPU property's example can take longer than a device call; rerun with its seed)
settings.register_profile("no-shrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])


def _gpu() -> bool:
    from ssmc.backends.cuda.runner import available

    return available()


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy and PyTorch")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture
def fresh_runners():
    """CUDA runners built anew (their decisions are cached per shape and overrides, not per module
    constant such as `runner.LANES_FILL`), before the test and after it."""
    from ssmc.backends.cuda import fused_backward, runner

    runner._RUNNERS.clear()
    fused_backward._RUNNERS.clear()
    yield
    runner._RUNNERS.clear()
    fused_backward._RUNNERS.clear()


@pytest.fixture
def emulated_cuda(monkeypatch):
    """The CUDA backend emulated on the CPU (``SSMC_CUDA_EMULATE=1``) for the test's duration."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    return monkeypatch

"""Tests marked `gpu` run only where a CUDA GPU, CuPy and PyTorch are present; elsewhere they skip."""

import pytest
from hypothesis import settings
from profiles import select_profile

# the shared checks' asserts explained as the tests' own are (imported by the test modules after this)
pytest.register_assert_rewrite("persistent_helpers")

# Hypothesis' profile (tests/profiles.py: ci where CI is set, nightly where SSMC_PROPERTY_EXAMPLES is,
# no-shrink on request), loaded before any test module reads it; `--hypothesis-profile=NAME` overrides
settings.load_profile(select_profile())


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"hypothesis profile {settings.get_current_profile_name()!r} (tests/profiles.py)")


def _gpu() -> bool:
    from ssmc.backends.cuda.arrays import available

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
    constant such as `kernels.lanes.LANES_FILL`), before the test and after it."""
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


@pytest.fixture
def launched(monkeypatch):
    """Names of the programs the persistent kernel ran during the test (a launch, not the step loop's fallback);
    `.blocks`: each launch's blocks (tests/persistent_helpers.py)."""
    from persistent_helpers import launched_programs

    return launched_programs(monkeypatch)

"""Tests marked `gpu` run only where a CUDA GPU, CuPy and PyTorch are present; elsewhere they skip."""

import pytest


def _gpu() -> bool:
    from ssmc.backends.cuda.runner import available

    return available()


def pytest_collection_modifyitems(config, items):
    if any("gpu" in item.keywords for item in items) and not _gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU with CuPy and PyTorch")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)

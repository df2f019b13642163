"""Host-side pieces of the CUDA backend that need no GPU: allocation layouts and call keys."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssmc.backends.cuda.runner import Allocation, call_key  # noqa: E402


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (1, 3, 1, 5), (7, 1)])
def test_allocation_strides_are_those_of_the_tensor_it_allocates(shape):
    """A prepared launch keys its kernel by the strides `Allocation.strides` computes without
    allocating: they must be the allocated tensor's (time moved from innermost to its place)."""
    for time_last in (-1, *range(len(shape))):
        t = torch.empty(shape)
        t = t if time_last < 0 else t.movedim(-1, time_last)
        assert Allocation("x", shape, torch.float32, time_last).strides() == tuple(t.stride())


def test_calls_without_cuda_tensors_have_no_key():
    """Only calls whose every argument is a torch CUDA tensor of a float dtype take a prepared run."""
    x = torch.zeros(2, 3)
    assert call_key((x,), {}) is None
    assert call_key((np.zeros((2, 3)),), {}) is None
    assert call_key((), {"x": [1.0, 2.0]}) is None

"""Host-side pieces of the CUDA backend that need no GPU: allocation layouts, call keys, and the error
where there is no GPU."""

from __future__ import annotations

import re
from pathlib import Path

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


def test_the_cuda_backend_without_a_gpu_says_so_before_any_work():
    """A call on backend "cuda" where there is no GPU (or no CuPy) is a ValueError that says what is
    missing, for a forward and a gradient."""
    import ssmc
    from ssmc.backends.cuda.runner import missing
    from ssmc.examples import hgrn

    if missing() is None:
        pytest.skip("this machine runs the cuda backend")
    inputs = hgrn.make_inputs(np.random.default_rng(0), 7)
    for run in (ssmc.compile(hgrn.SPEC, "cuda"), ssmc.grad(hgrn.SPEC, "cuda")):
        with pytest.raises(ValueError, match=re.escape(f"backend 'cuda' needs a CUDA GPU with CuPy and PyTorch: "
                                                       f"{missing()}; backend 'numba' runs on the CPU")):
            run(**inputs)


def test_the_cuda_backend_without_a_gpu_is_one_line_on_the_command_line(capsys):
    from ssmc.backends.cuda.runner import missing
    from ssmc.cli import main

    if missing() is None:
        pytest.skip("this machine runs the cuda backend")
    hgrn = str(Path(__file__).resolve().parents[1] / "examples" / "hgrn.py")
    for argv in (["demo", "--backend", "cuda"], ["bench", hgrn, "--backend", "cuda"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: backend 'cuda' needs a CUDA GPU") and err.count("\n") == 1, err

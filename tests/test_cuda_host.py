"""Host-side pieces of the CUDA backend that need no GPU: allocation layouts, call keys, and the error
where there is no GPU."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ssmc.backends.cuda.arrays import call_key  # noqa: E402
from ssmc.backends.cuda.runner import Allocation  # noqa: E402


@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 3, 4), (1, 3, 1, 5), (7, 1)])
def test_allocation_strides_are_those_of_the_tensor_it_allocates(shape):
    """A prepared launch keys its kernel by the strides `Allocation.strides` computes without
    allocating: they must be the allocated tensor's (time moved from its place in memory, innermost
    for "b d t" or second for "b t ...", to its place in the caller's view)."""
    assert Allocation("x", shape, torch.float32).strides() == tuple(torch.empty(shape).stride())
    for time_at in range(len(shape)):
        for time_index in range(len(shape)):
            t = torch.empty(shape).movedim(time_at, time_index)
            assert Allocation("x", shape, torch.float32, time_at, time_index).strides() == tuple(t.stride())


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
    from ssmc.backends.cuda.arrays import missing
    from ssmc.examples import hgrn

    if missing() is None:
        pytest.skip("this machine runs the cuda backend")
    inputs = hgrn.make_inputs(np.random.default_rng(0), 7)
    for run in (ssmc.compile(hgrn.SPEC, "cuda"), ssmc.grad(hgrn.SPEC, "cuda")):
        with pytest.raises(ValueError, match=re.escape(f"backend 'cuda' needs a CUDA GPU with CuPy and PyTorch: "
                                                       f"{missing()}; backend 'numba' runs on the CPU")):
            run(**inputs)


def test_the_cuda_backend_without_a_gpu_is_one_line_on_the_command_line(capsys):
    from ssmc.backends.cuda.arrays import missing
    from ssmc.cli import main

    if missing() is None:
        pytest.skip("this machine runs the cuda backend")
    hgrn = str(Path(__file__).resolve().parents[1] / "examples" / "hgrn.py")
    for argv in (["demo", "--backend", "cuda"], ["bench", hgrn, "--backend", "cuda"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: backend 'cuda' needs a CUDA GPU") and err.count("\n") == 1, err


# -- launches through the driver (backends/cuda/launch.py) --------------------------------------------
class _Function:
    """Stands for CuPy's kernel: the CUfunction handle, and the launch the fallback makes."""

    ptr = 0xF00

    def __init__(self):
        self.calls = []

    def __call__(self, grid, block, args, stream=None, shared_mem=0):
        self.calls.append((grid, block, [int(a) for a in args], stream))


def _fake_driver(seen: list, result: int = 0):
    import ctypes

    def cu_launch_kernel(handle, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        slots = ctypes.cast(params, ctypes.POINTER(ctypes.c_void_p))
        ints = [ctypes.cast(slots[i], ctypes.POINTER(ctypes.c_int32))[0] for i in (0, 1)]
        pointers = [ctypes.cast(slots[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(2, len(params))]
        seen.append((handle, (gx, gy, gz), (bx, by, bz), shared, stream, ints, pointers, extra))
        return result
    return cu_launch_kernel


def test_a_driver_launch_passes_the_two_ints_and_every_pointer(monkeypatch):
    """The kernel reads `int length, int nblk` then one pointer per array from the argument slots."""
    from ssmc.backends.cuda import launch

    seen: list = []
    monkeypatch.setattr(launch, "_driver", _fake_driver(seen))
    monkeypatch.setattr(launch, "current_stream", lambda: 0x5EA)
    pointers = [2**40 + 256, 2**33, 7 * 2**20]
    launch.launch_kernel(_Function(), (13, 128), 180, np.int32(3), pointers)
    assert seen == [(0xF00, (13, 1, 1), (128, 1, 1), 0, 0x5EA, [180, 3], pointers, None)]


def test_a_launch_past_48_kib_of_shared_memory_allows_it_first(monkeypatch):
    """Dynamic shared memory past 48 KiB: the kernel is allowed it once (CuPy's attribute, which sets
    the driver's), and the launch asks for it; a device with less is a ValueError naming the kernel."""
    from ssmc.backends.cuda import launch

    seen: list = []
    allowed: list = []
    monkeypatch.setattr(launch, "_driver", _fake_driver(seen))
    monkeypatch.setattr(launch, "_set_attribute", lambda handle, attribute, n: allowed.append((handle, attribute, n))
                        or (0 if n <= 227 * 1024 else 1))
    monkeypatch.setattr(launch, "current_stream", lambda: 0)
    fn = _Function()
    for _ in range(2):
        launch.launch_kernel(fn, (4, 128), 7, 1, [16], shared=96 * 1024)
    assert allowed == [(0xF00, 8, 96 * 1024)]  # once: CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert [call[3] for call in seen] == [96 * 1024, 96 * 1024]

    class Big(_Function):
        name = "big_tiles"
    with pytest.raises(ValueError, match="big_tiles asks for 300000 bytes"):
        launch.launch_kernel(Big(), (4, 128), 7, 1, [16], shared=300000)


def test_a_failed_driver_launch_goes_through_cupy(monkeypatch):
    """A launch the driver refuses (no context current on this thread, say) is made by CuPy instead,
    with the same arguments on the same stream."""
    from ssmc.backends.cuda import launch

    seen: list = []
    monkeypatch.setattr(launch, "_driver", _fake_driver(seen, result=201))
    monkeypatch.setattr(launch, "current_stream", lambda: 0x5EA)
    monkeypatch.setattr(launch, "_cupy_stream", lambda pointer: ("cupy stream", pointer))
    fn = _Function()
    launch.launch_kernel(fn, (2, 64), 7, 1, [16, 32])
    assert len(seen) == 1
    assert fn.calls == [((2,), (64,), [7, 1, 16, 32], ("cupy stream", 0x5EA))]


def test_options_follow_the_environment(monkeypatch):
    """The options see a variable set or removed between calls, and name a malformed one."""
    from ssmc.backends.cuda.options import CudaOptions, options

    monkeypatch.delenv("SSMC_CUDA_STRATEGY", raising=False)
    before = options()
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "warp")
    monkeypatch.setenv("SSMC_CUDA_TIME_BLOCKS", "0")
    after = options()
    assert after.strategy == "warp" and after.time_blocks == 0 and before.strategy is None
    assert after.key != before.key and hash(after) != hash(before)
    monkeypatch.delenv("SSMC_CUDA_STRATEGY")
    monkeypatch.delenv("SSMC_CUDA_TIME_BLOCKS")
    assert options() == before == CudaOptions()
    for name, value in [("SSMC_CUDA_STRATEGY", "sideways"), ("SSMC_CUDA_ROW_GROUPS", "3"),
                        ("SSMC_CUDA_FUSED_BACKWARD", "yes"), ("SSMC_CUDA_STEPS_PER_LANE", "four")]:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=name):
            options()
        monkeypatch.delenv(name)


def test_the_backward_takes_half_rounds_where_the_last_one_would_be_mostly_padding(monkeypatch):
    """Mamba-1's state-major backward: 2 steps a lane at L 180 (192 padded steps against 256), the
    forward's 4 where the lengths fill whole rounds; rounds always hold whole forward lanes."""
    from ssmc.backends.cuda.fused_backward import fused_backward_runner
    from ssmc.examples import mamba1
    from ssmc.passes.autodiff import derive_backward

    monkeypatch.delenv("SSMC_CUDA_BACKWARD_STEPS_PER_LANE", raising=False)
    monkeypatch.delenv("SSMC_CUDA_STATE_MAJOR_BACKWARD", raising=False)
    runner = fused_backward_runner(derive_backward(mamba1.SPEC.program, 64))
    assert runner.forward_steps() == 4
    assert [runner.backward_steps(n) for n in (180, 192, 1000, 2048, 4097)] == [2, 2, 4, 4, 4]
    for n in (1, 7, 40, 100, 180, 1000, 4097):
        assert runner.round_steps(n) % runner.forward_steps() == 0


def test_a_runner_s_plans_stay_bounded_over_ever_new_lengths():
    """Variable-length batches plan once per length: the plans kept start over at MAX_PLANS."""
    from ssmc.backends.cuda.runner import MAX_PLANS, runner_for
    from ssmc.examples import hgrn

    runner = runner_for(hgrn.SPEC.program)
    runner.plans.clear()
    for length in range(1, MAX_PLANS + 10):
        assert runner.planned("probe", lambda n=length: n * 2, length) == 2 * length
    assert len(runner.plans) <= MAX_PLANS
    assert runner.planned("probe", lambda: -1, MAX_PLANS + 9) == 2 * (MAX_PLANS + 9)  # the newest are kept


def test_any_layout_makes_a_cache_key():
    """The prepared paths key calls by their layout before checking it: a bad layout (a list where a
    template belongs) is a key too, so the check that binds the call names it (ValueError)."""
    from ssmc.runtime.binding import hashable_layout

    good = {"x": "b t ...", "y": "t ..."}
    assert hashable_layout(good) == hashable_layout(dict(reversed(good.items())))
    assert hashable_layout(good) != hashable_layout({"x": "t ...", "y": "t ..."})
    for bad in ({"x": ["b", "t"]}, ["b", "t"]):
        hash(hashable_layout(bad))
    assert hashable_layout("b t ...") == "b t ..." and hashable_layout(None) is None

"""Calls run on the GPU that holds their arrays.

torch allocates ``device="cuda"`` tensors on the current device, CuPy loads a module into the current
device's context, and ``cuLaunchKernel`` launches into the current context. A call whose tensors are
on another GPU than the current one (``cuda:1`` from a process whose current device is 0) therefore
switches to their device for its duration (`on_arrays_device`); everything the backend builds per
device (modules, functions, launch plans) is keyed by the device it was built on (`current_device`).
Arguments on two GPUs are an error naming the argument (`check_one_device`). A call given CuPy arrays
runs on CuPy's current stream (torch's current stream for its duration), as CuPy's own kernels on those
arrays would: launched on torch's, a non-blocking CuPy stream's work could race with it.

With ``SSMC_CUDA_EMULATE=1`` the backend runs its kernels on the CPU instead (`emulating`;
backends/cuda/emulator.py): torch CPU tensors stand for device memory, the device is -1.
"""

from __future__ import annotations

import contextlib
import functools
import sys

# whether the backend runs its kernels emulated on the CPU (``SSMC_CUDA_EMULATE=1``): for tests of
# the kernels' logic at tiny sizes on machines without a GPU
from .settings import emulate as emulating

_getter = None  # torch's raw current-device getter, once torch is imported


def device_name() -> str:
    """Where the backend's tensors live: "cuda", or "cpu" where it is `emulating`."""
    return "cpu" if emulating() else "cuda"


def on_backend_device(t) -> bool:
    """Whether torch tensor `t` is where the backend's tensors live: on a GPU, or (`emulating`) the CPU."""
    return t.device.type == "cpu" if emulating() else t.is_cuda


def current_device() -> int:
    """The current CUDA device's index (torch's raw getter: `torch.cuda.current_device` checks its
    lazy initialisation on every call, host time a small call pays per launch); -1 where emulating
    (keys of what is built per device then never meet a GPU's)."""
    global _getter
    if emulating():
        return -1
    if _getter is None:
        import torch

        _getter = getattr(torch._C, "_cuda_getDevice", None) or torch.cuda.current_device
    return _getter()


def arrays_device(values) -> tuple[int | None, object]:
    """(device index, first CuPy array) of a call's `values` (arrays, or dicts of them, looked into one
    level), in one pass: the device of the first torch CUDA tensor, else of the first CuPy array, None
    where there is neither; the first CuPy array, None where there is none. The first one decides
    (arguments on the CPU are copied to it): `check_one_device` makes sure of the rest where a call is
    bound."""
    torch, cupy = sys.modules.get("torch"), sys.modules.get("cupy")
    tensor = torch.Tensor if torch is not None else ()
    ndarray = cupy.ndarray if cupy is not None else ()
    device = first_cupy = None
    for v in values:
        for x in (v.values() if isinstance(v, dict) else (v,)):
            if device is None and isinstance(x, tensor) and x.is_cuda:
                device = x.get_device()
            elif first_cupy is None and isinstance(x, ndarray):
                first_cupy = x
    if device is None and first_cupy is not None:
        device = first_cupy.device.id
    return device, first_cupy


def device_of(values) -> int | None:
    """The device index of `values`' first CUDA array (`arrays_device`), None where there is none."""
    return arrays_device(values)[0]


def cupy_current_stream():
    """CuPy's current stream on the current device as a torch stream (one wrapper per stream)."""
    import cupy
    import torch

    pointer = cupy.cuda.get_current_stream().ptr
    key = (current_device(), pointer)
    stream = _torch_streams.get(key)
    if stream is None:
        stream = _torch_streams[key] = torch.cuda.ExternalStream(pointer)
    return stream


_torch_streams: dict = {}  # (device, CuPy stream pointer) -> torch's view of it


def on_arrays_device(arrays_of):
    """Decorator of a method of an object with a `backend`: where it is "cuda" and the arrays
    ``arrays_of(args, kwargs)`` of a call (the method's own arguments) are on another device than
    the current one, the call runs with theirs current; where they include CuPy arrays, on CuPy's
    current stream of that device."""
    def decorate(method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            if self.backend != "cuda" or emulating():
                return method(self, *args, **kwargs)
            device, cupy_array = arrays_device(arrays_of(args, kwargs))
            switch = device is not None and device != current_device()
            if not switch and cupy_array is None:
                return method(self, *args, **kwargs)
            import torch

            with contextlib.ExitStack() as stack:
                if switch:
                    stack.enter_context(torch.cuda.device(device))
                if cupy_array is not None:
                    stack.enter_context(cupy_array.device)
                    stack.enter_context(torch.cuda.stream(cupy_current_stream()))
                return method(self, *args, **kwargs)
        return call
    return decorate


def check_one_device(arrays: dict) -> None:
    """ValueError naming the first of `arrays` (name -> torch tensor) on another GPU than the first."""
    first = None
    for name, t in arrays.items():
        if first is None:
            first = (name, t.device)
        elif t.device != first[1]:
            raise ValueError(f"argument {name!r} is on {t.device}, argument {first[0]!r} on {first[1]}: "
                             "a call's arrays must be on one GPU")

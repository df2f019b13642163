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

import functools
import sys

# whether the backend runs its kernels emulated on the CPU (``SSMC_CUDA_EMULATE=1``): for tests of
# the kernels' logic at tiny sizes on machines without a GPU
from .options import emulating  # whether the kernels run on the CPU (SSMC_CUDA_EMULATE=1)

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


def device_of(values) -> int | None:
    """The device index of the first torch CUDA tensor among `values` (tensors, or dicts of them,
    looked into one level); None where there is none. The first one decides (arguments on the CPU
    are copied to it): `check_one_device` makes sure of the rest where a call is bound."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    tensor = torch.Tensor
    for v in values:
        for x in (v.values() if isinstance(v, dict) else (v,)):
            if isinstance(x, tensor) and x.is_cuda:
                return x.get_device()
    return None


def first_cupy_array(values):
    """The first CuPy array among `values` (arrays, or dicts of them, looked into one level), or None."""
    cupy = sys.modules.get("cupy")
    if cupy is None:
        return None
    for v in values:
        for x in (v.values() if isinstance(v, dict) else (v,)):
            if isinstance(x, cupy.ndarray):
                return x
    return None


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
            if self.backend == "cuda" and not emulating():
                values = arrays_of(args, kwargs)
                device = device_of(values)
                cupy_array = first_cupy_array(values)
                if device is None and cupy_array is not None:
                    device = cupy_array.device.id
                if cupy_array is not None or (device is not None and device != current_device()):
                    import torch

                    with torch.cuda.device(device if device is not None else current_device()):
                        if cupy_array is None:
                            return method(self, *args, **kwargs)
                        with cupy_array.device, torch.cuda.stream(cupy_current_stream()):
                            return method(self, *args, **kwargs)
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

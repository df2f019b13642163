"""The CUDA backend's side of a call's arguments: whether the backend can run here (`missing`,
`require_gpu`), the arrays it takes (`to_device`: torch tensors on the GPU, or on the CPU where the
kernels are emulated), zeros for initial states not given, and the key of a call a prepared run
serves (`call_key`)."""

from __future__ import annotations

import sys
from functools import cache

from ...runtime.binding import numeric_array
from .devices import current_device, device_name, emulating, on_backend_device
from .options import options

TORCH_DTYPES = {"torch.float32": "float32", "torch.float64": "float64", "torch.float16": "float16",
           "torch.bfloat16": "bfloat16"}


def available() -> bool:
    return missing() is None


def missing() -> str | None:
    """Why the cuda backend cannot run here (no CuPy, no PyTorch, no GPU), or None where it can."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if emulating():  # SSMC_CUDA_EMULATE=1: the kernels run on the CPU
        from .emulator import available

        return None if available() else "no C++ compiler for the emulated kernels (SSMC_CUDA_EMULATE=1)"
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install cupy-cuda12x or cupy-cuda13x)"
    try:
        if not torch.cuda.is_available():
            return "PyTorch sees no CUDA GPU"
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "CuPy sees no CUDA GPU"
    except Exception as err:  # a driver that does not load, say
        return f"{type(err).__name__}: {err}"
    return None


_GPU_FOUND = False  # set once the first call found one: later calls skip the look


def require_gpu() -> None:
    """ValueError naming what is missing where the cuda backend cannot run (before any array moves)."""
    global _GPU_FOUND
    if _GPU_FOUND:
        return
    reason = missing()
    if reason is not None:
        raise ValueError(f"backend 'cuda' needs a CUDA GPU with CuPy and PyTorch: {reason}; "
                         "backend 'numba' runs on the CPU")
    _GPU_FOUND = not emulating()  # the emulator is looked for again: the setting may change


def to_device(x, name: str):
    """A torch CUDA tensor for an argument (torch / CuPy zero-copy; NumPy and lists copied); a CPU
    tensor where the backend is emulated (`devices.emulating`). A torch tensor elsewhere (on the CPU,
    or a meta tensor) is a ValueError naming the argument: copying it would hide a host transfer and a
    synchronisation in every call."""
    import torch

    device = device_name()
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.device.type != device:
            where = "a GPU" if device == "cuda" else "the CPU (emulated)"
            raise ValueError(f"argument {name!r} is a tensor on {t.device}; the cuda backend takes tensors on "
                             f"{where} (NumPy arrays and lists are copied there)")
    elif hasattr(x, "__cuda_array_interface__"):
        t = torch.as_tensor(x, device=device)
    else:
        t = torch.as_tensor(numeric_array(x, name), device=device)
    if str(t.dtype) not in TORCH_DTYPES:
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"argument {name!r} has dtype {t.dtype}; the cuda backend takes float32, float64, "
                             "float16 and bfloat16")
        t = t.to(torch.float32)
    return t


def device_zeros(shape):
    import torch

    return torch.zeros(shape, device=device_name(), dtype=torch.float32)


def shared_device_zeros(shape):
    """Zeros for an initial state not given to a forward: its kernels only read initial states
    (``init_*``) and its final states are new tensors, so one tensor per shape and device is shared
    by every call (a fill kernel and host time saved)."""
    import torch

    key = (tuple(shape), current_device())
    zeros = _ZEROS.get(key)
    if zeros is None:
        zeros = _ZEROS[key] = torch.zeros(shape, device=device_name(), dtype=torch.float32)
    return zeros


_ZEROS: dict = {}


def as_1d(t):
    return t.reshape(1) if t.dim() == 0 else t


def call_key(args: tuple, kwargs: dict) -> tuple | None:
    """What binding and running a call depend on besides its layout (shapes, strides, dtypes and
    devices of the arrays, the overrides), where every argument is a torch CUDA tensor of a dtype the
    kernels read in place; else None. Calls with equal keys bind alike, so a prepared run serves them
    (`api.Compiled.run`)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    tensor, floats = torch.Tensor, _torch_floats(torch)
    parts = []
    for name, x in (*enumerate(args), *kwargs.items()):
        if not isinstance(x, tensor) or not on_backend_device(x) or x.dtype not in floats:
            return None
        parts.append((name, x.shape, x.stride(), x.dtype, x.device))
    return (*parts, *options().key)


@cache
def _torch_floats(torch) -> frozenset:
    return frozenset((torch.float32, torch.float64, torch.float16, torch.bfloat16))



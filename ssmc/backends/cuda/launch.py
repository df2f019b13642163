"""Kernel launches on torch's current stream, through the CUDA driver's ``cuLaunchKernel`` (ctypes).

Every kernel ssmc generates takes ``(int length, int nblk, T* array...)``. CuPy's launch works out
each argument's C type on every call, and its stream must be wrapped per torch stream; at a small
shape (Mamba-1 B32 D512 L180, whose kernels are short) that host time bounded the call
(bench/host_profile.py). Here the arguments are one array of 8-byte slots (the two ints in the low
half of theirs: little-endian hosts, as CUDA's are), and that step took less host time than through
CuPy (see bench/results/2026-11-27-from-code-comments.md). Where the driver cannot be loaded, or a
launch through it fails (no context current on this thread, say), the same launch goes through
CuPy, which sets the context up or raises its own error.
"""

from __future__ import annotations

import ctypes
import sys
import threading

from .devices import current_device, emulating

_UNLOADED = object()
_driver = _UNLOADED
_memset = _UNLOADED        # the driver's cuMemsetD32Async, or None
_handles: dict = {}        # CuPy function -> its CUfunction
_cupy_streams: dict = {}   # torch stream pointer -> CuPy's view of it
_raw_stream = _UNLOADED    # torch's raw getter of a device's current stream pointer, where it has one
_slots = threading.local() # per thread: argument count -> (values, pointers to them), filled per launch
use_driver = True          # False: every launch through CuPy (bench/host_profile.py compares the two)


def _load_driver():
    """libcuda's cuLaunchKernel with its argument types, or None where there is no driver library."""
    global _driver
    if _driver is _UNLOADED:
        try:
            lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
            fn = lib.cuLaunchKernel
        except (OSError, AttributeError):
            fn = None
        else:
            u = ctypes.c_uint
            fn.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
            fn.restype = ctypes.c_int
        _driver = fn
    return _driver


def _load_memset():
    """libcuda's cuMemsetD32Async with its argument types, or None."""
    global _memset
    if _memset is _UNLOADED:
        _memset = None
        if _load_driver() is not None:
            try:
                fn = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1").cuMemsetD32Async
            except (OSError, AttributeError):
                pass
            else:
                fn.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
                fn.restype = ctypes.c_int
                _memset = fn
    return _memset


def zero_bytes(pointer: int, nbytes: int, fallback) -> None:
    """Zero `nbytes` (a multiple of 4) of device memory at `pointer` on torch's current stream: one
    driver call where the driver is loaded (a torch ``zeros`` or ``zero_`` costs more host time),
    else ``fallback()``."""
    memset = _load_memset() if use_driver and not emulating() else None
    if memset is None or memset(pointer, 0, nbytes // 4, current_stream()) != 0:
        fallback()


def _handle(function) -> int:
    """The CUfunction of a CuPy kernel (`RawModule.get_function`'s result, or its `kernel`)."""
    handle = _handles.get(function)
    if handle is None:
        inner = getattr(function, "kernel", function)
        handle = _handles[function] = int(inner.ptr)
    return handle


def current_stream() -> int:
    """torch's current stream on the current device, as the driver's pointer (0: the legacy default).
    Through torch's raw getters where it has them: `torch.cuda.current_stream` builds a Stream object
    each call, a visible part of a small forward's host time (see
    bench/results/2026-11-27-from-code-comments.md)."""
    global _raw_stream
    if _raw_stream is _UNLOADED:
        import torch

        _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if _raw_stream is not None:
        return _raw_stream(current_device())
    import torch

    return torch.cuda.current_stream(current_device()).cuda_stream


def _argument_slots(n: int):
    """This thread's `n` 8-byte argument slots and the array of their addresses that cuLaunchKernel
    reads (it copies the values at the call, so one pair serves every launch of `n` arguments; per
    thread, since the call releases the GIL)."""
    table = getattr(_slots, "table", None)
    if table is None:
        table = _slots.table = {}
    slots = table.get(n)
    if slots is None:
        values = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(values)
        slots = table[n] = (values, (ctypes.c_void_p * n)(*range(base, base + 8 * n, 8)))
    return slots


def _cupy_stream(pointer: int):
    stream = _cupy_streams.get(pointer)
    if stream is None:
        import cupy

        stream = _cupy_streams[pointer] = cupy.cuda.ExternalStream(pointer)
    return stream


def launch_kernel(function, grid: tuple[int, int], length: int, nblk: int, pointers, shared: int = 0) -> None:
    """Launch `function` with `grid` = (blocks, threads a block) on torch's current stream, with the
    arguments (length, nblk, *pointers): two ints, then one device address per array (host addresses,
    and run to completion, where `function` is emulated: backends/cuda/emulator.py). `shared`: bytes of
    dynamic shared memory (``extern __shared__``), past the 48 KiB a kernel gets without asking too."""
    if getattr(function, "emulated", False):
        function(grid, length, nblk, pointers)
        return
    if shared > _DEFAULT_SHARED:
        _allow_shared(function, shared)
    stream = current_stream()
    driver = _load_driver() if use_driver else None
    if driver is not None:
        values, params = _argument_slots(2 + len(pointers))
        values[:] = (length, nblk, *pointers)
        if driver(_handle(function), grid[0], 1, 1, grid[1], 1, 1, shared, stream, params, None) == 0:
            return
    import numpy as np

    function((grid[0],), (grid[1],), (np.int32(length), np.int32(nblk), *(np.uint64(p) for p in pointers)),
             stream=_cupy_stream(stream), shared_mem=shared)


_DEFAULT_SHARED = 48 * 1024
_allowed: dict = {}  # CuPy function -> the dynamic shared memory it has been allowed


def _allow_shared(function, nbytes: int) -> None:
    """Let `function` take `nbytes` of dynamic shared memory (CUDA asks for an opt-in past 48 KiB),
    once per function and size; raises ValueError naming the kernel where the device has less."""
    if _allowed.get(function, 0) >= nbytes:
        return
    name = getattr(function, "name", None) or getattr(getattr(function, "kernel", None), "name", function)
    attribute = _load_set_attribute()
    if attribute is not None:  # the driver's cuFuncSetAttribute on the CUfunction the launch uses
        status = attribute(_handle(function), _MAX_DYNAMIC_SHARED, nbytes)
        error = None if status == 0 else f"CUresult {status}"
    else:  # CuPy's RawKernel attribute (its Function objects have none)
        try:
            function.max_dynamic_shared_size_bytes = nbytes
            error = None
        except Exception as err:  # CuPy's CUDADriverError: the device's limit is lower
            error = str(err)
    if error is not None:
        raise ValueError(f"kernel {name} asks for {nbytes} bytes of dynamic shared memory, more than this GPU"
                         f" allows a block ({error})")
    _allowed[function] = nbytes


_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_set_attribute = _UNLOADED


def _load_set_attribute():
    """libcuda's cuFuncSetAttribute with its argument types, or None."""
    global _set_attribute
    if _set_attribute is _UNLOADED:
        _set_attribute = None
        if _load_driver() is not None and use_driver:
            try:
                fn = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1").cuFuncSetAttribute
            except (OSError, AttributeError):
                pass
            else:
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
                fn.restype = ctypes.c_int
                _set_attribute = fn
    return _set_attribute

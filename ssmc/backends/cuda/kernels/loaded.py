"""Kernels of the modules a kernel unit renders whole (kernels/flash), loaded once per device and source."""

from __future__ import annotations

import threading

_functions: dict = {}
_compiling = threading.Lock()


def loaded_function(text: str, name: str, device):
    """Kernel `name` of the CUDA source `text` on `device` (a torch device), compiled once per device
    and source: by NVRTC through CuPy on a GPU, by the CPU emulator where `device` is the CPU
    (``SSMC_CUDA_EMULATE=1``). For the kernels that render whole modules themselves (kernels/flash)."""
    key = (device.type, device.index, text, name)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    if device.type == "cpu":
        from ..emulator import emulated

        fn = emulated(text, name)
    else:
        import cupy

        from ..source import compile_options

        with _compiling, cupy.cuda.Device(device.index or 0):
            module = cupy.RawModule(code=text, options=compile_options(text))
            module.compile()
            fn = module.get_function(name)
    _functions[key] = fn
    return fn

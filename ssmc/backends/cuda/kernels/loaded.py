"""Kernels of the modules a kernel unit renders whole (kernels/flash), loaded once per device and source."""

from __future__ import annotations

import threading

_functions: dict = {}
_compiling = threading.Lock()


def loaded_function(text: str, name: str, device, arch: str | None = None):
    """Kernel `name` of the CUDA source `text` on `device` (a torch device), compiled once per device
    and source: by NVRTC through CuPy on a GPU (for `arch`, e.g. ``sm_90a`` for wgmma, where given; else
    the device's own), by the CPU emulator where `device` is the CPU (``SSMC_CUDA_EMULATE=1``). For the
    kernels that render whole modules themselves (kernels/flash)."""
    key = (device.type, device.index, text, name, arch)
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
            if arch is None:
                module = cupy.RawModule(code=text, options=compile_options(text))
                module.compile()
            else:  # CuPy's RawModule picks the device's architecture itself: build the CUBIN here
                module = cupy.cuda.function.Module()
                module.load(_cubin(text, name, arch, compile_options(text)))
            fn = module.get_function(name)
    _functions[key] = fn
    return fn


def _cubin(text: str, name: str, arch: str, options: tuple[str, ...]) -> bytes:
    """`text` compiled to a CUBIN for `arch` by NVRTC: CuPy's own bindings (on every CuPy machine), else
    cuda-bindings'."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError:
        nvrtc = None
    if nvrtc is None or not hasattr(nvrtc, "getCUBIN"):
        from ..nvrtc import compile_source

        return compile_source(text, arch=arch, options=options, name=f"{name}.cu").cubin
    prog = nvrtc.createProgram(text, f"{name}.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, [f"-arch={arch}", *options])
        except Exception as err:
            log = nvrtc.getProgramLog(prog)
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}: {err}\n{log}") from err
        return nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)

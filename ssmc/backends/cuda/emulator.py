"""Generated CUDA kernels run on the CPU, for tests at tiny sizes on machines without a GPU.

The kernel's source is compiled by the host C++ compiler after ``templates/cuda_emulator.h``, which
emulates a launch: a block at a time, its threads as fibers on the calling OS thread, switched at
``__syncthreads`` / ``__syncwarp`` and the shuffles (the header says how). What it checks is the
kernel's logic: its indexing, which thread does what, its barriers and shuffles, its partial rounds and
chunks; not timing, not races the hardware would lose, and not the sm_80 / sm_90 assembly paths
(cp.async, vector atomic adds), whose portable fallbacks run instead. A bug of the first kind (the fused
backward's block sums lost the vectors past a block's threads) needed a GPU to show before.

    kernel = emulated(source, "mamba1_fused_backward")       # compiled once per source (cached)
    kernel((blocks, threads), length, nblk, [a.ctypes.data for a in arrays])   # NumPy arrays

A block whose threads all wait at barriers that not all of them reach raises `EmulatedHang` at once; so
does one still running after ``$SSMC_EMULATE_TIMEOUT`` seconds (default 600: a loop through barriers
that never ends). The fibers need no OS threads, so test workers side by side meet no limit on them.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
from importlib import resources

from ...runtime.cache import cache_dir, content_key
from .options import environment_variable

launched = 0  # emulated launches so far, every kernel: tests count a call's kernels by the difference

_SIGNATURE = re.compile(r'extern "C" __global__ void (?:__launch_bounds__\([^)]*\) )?(\w+)\(([^)]*)\)')


class EmulatorUnavailable(RuntimeError):
    """No C++20 compiler to build emulated kernels with."""


class EmulatedHang(RuntimeError):
    """An emulated block whose threads did not all finish: some wait at a barrier or a shuffle that
    others of the block (or warp) never reach."""


def compiler() -> str | None:
    """The host C++ compiler (``$CXX``, else g++ or clang++), or None."""
    return environment_variable("CXX") or shutil.which("g++") or shutil.which("clang++")


def available() -> bool:
    return compiler() is not None


def emulated(source: str, name: str):
    """Kernel `name` of the generated `source`, compiled for the CPU (cached by source): a function
    ``(grid, length, nblk, pointers)`` running the launch to completion, `grid` = (blocks, threads a
    block), `pointers` the host addresses of the kernel's arrays in order."""
    params = _params(source, name)
    wrapper = _wrapper(name, params)
    header = resources.files("ssmc").joinpath("templates/cuda_emulator.h").read_text()
    text = f"{header}\n// ---- the generated source ----\n{source}\n{wrapper}"
    lib = ctypes.CDLL(str(_build(text)))
    fn = lib.ssmc_emulate
    fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_double, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    fn.restype = ctypes.c_long
    count = len(params) - 2

    def launch(grid: tuple[int, int], length: int, nblk: int, pointers) -> None:
        if len(pointers) != count:
            raise ValueError(f"{name} takes {count} arrays; got {len(pointers)}")
        global launched
        launched += 1
        table = (ctypes.c_void_p * max(1, count))(*pointers)
        timeout = float(environment_variable("SSMC_EMULATE_TIMEOUT", "600"))
        stuck = fn(grid[0], grid[1], timeout, length, nblk, table)
        if stuck == -2:
            raise MemoryError(f"{name}: the stacks of {grid[1]} emulated threads could not be mapped")
        if stuck >= 0:
            raise EmulatedHang(f"{name}: block {stuck} of {grid[0]} ({grid[1]} threads) did not finish: its threads "
                               f"wait at barriers or shuffles not all of them reach (or it ran past {timeout:g} s)")

    launch.emulated = True  # launch.launch_kernel calls it in place of the driver
    return launch


def _params(source: str, name: str) -> list[str]:
    """The C types of kernel `name`'s parameters, in order (two ints, then the arrays' pointers)."""
    for found, params in _SIGNATURE.findall(source):
        if found == name:
            types = [p.rsplit(None, 1)[0].replace("__restrict__", "").strip() for p in params.split(",")]
            if types[:2] != ["int", "int"]:
                raise ValueError(f"{name}: expected (int length, int nblk, arrays...), got {params}")
            return types
    raise ValueError(f"no kernel {name} in the source")


def _wrapper(name: str, params: list[str]) -> str:
    args = ", ".join(["length", "nblk", *(f"({t})arrays[{i}]" for i, t in enumerate(params[2:]))])
    return (f'extern "C" long ssmc_emulate(unsigned blocks, unsigned threads, double timeout, int length, int nblk, '
            f"void** arrays)\n{{\n    return ssmc_emu::run(blocks, threads, timeout, [&] {{ {name}({args}); }});\n}}\n")


def _build(text: str):
    """The shared library of `text` (C++), built once per content in the cache (``emulator``)."""
    cxx = compiler()
    if cxx is None:
        raise EmulatorUnavailable("no C++ compiler (set CXX, or install g++ or clang++)")
    folder = cache_dir("emulator")
    key = content_key(text + cxx)
    lib = folder / f"k_{key}.so"
    if lib.exists():
        return lib
    src = folder / f"k_{key}.{os.getpid()}.cpp"  # per process: test workers may build one source at once
    src.write_text(text)
    tmp = folder / f"k_{key}.{os.getpid()}.so"
    # -fno-strict-aliasing: the kernels read float arrays as float4 vectors; -w: the generated code's
    # pragmas and unused values are not this compiler's business
    cmd = [cxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-fno-strict-aliasing", "-w",
           str(src), "-o", str(tmp)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"the emulated kernel did not compile ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    os.replace(tmp, lib)
    src.unlink(missing_ok=True)
    return lib

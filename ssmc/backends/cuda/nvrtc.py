"""CUDA C to CUBIN through NVRTC, on any machine (no GPU or driver needed), with per-kernel resource usage.

NVRTC comes from PyPI: ``cuda-bindings`` (the module ``cuda.bindings.nvrtc``) calls ``libnvrtc.so``, which
the ``nvidia-cuda-nvrtc`` wheel ships; ``cuda.pathfinder`` (a dependency of cuda-bindings) finds that library
in site-packages, a conda environment or a system CUDA (``CUDA_HOME``/``CUDA_PATH``), so no variable needs
setting.

``compile_source`` builds real machine code for one architecture (``-arch=sm_90``: a CUBIN, not PTX) with
ptxas's verbose report on, and ``resource_usage`` reads that report: per kernel, the registers, static shared
memory, stack frame, spill stores and loads that ptxas chose, the numbers that decide occupancy and tell a
kernel that spills from one that does not.

NVRTC has no system headers (not even ``<cstdint>`` or ``<cuda_fp16.h>``): sources must be self-contained or
bring their headers in ``headers``. Device math (``expf``, ``__expf``, ``tanhf``, ``__shfl_xor_sync``...) is
built in.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from .options import environment_variable

__all__ = [
    "Compiled",
    "KernelResources",
    "NvrtcError",
    "available",
    "compile_source",
    "nvcc_command",
    "resource_usage",
    "supported_archs",
    "unavailable_reason",
    "version",
]

_ARCH = re.compile(r"sm_\d+[af]?")
# NVRTC options that nvcc does not take: left out of the nvcc command that reproduces a failed compile.
_NVRTC_ONLY = (
    "-default-device",
    "--device-as-default-execution-space",
    "-builtin-",
    "--builtin-",
    "-pch",
    "--pch",
    "-no-pch",
    "--no-pch",
    "-create-pch",
    "--create-pch",
    "-use-pch",
    "--use-pch",
    "-minimal",
    "--minimal",
    "-no-source-include",
    "--no-source-include",
)


class NvrtcError(RuntimeError):
    """A compile that NVRTC refused: the source, an option or ptxas.

    ``log`` is NVRTC's whole log, ``options`` the exact options it was given, ``nvcc_command`` one shell line
    that redoes the compile with nvcc (on a machine with the CUDA toolkit), ``source_path`` where the failing
    source was saved for that command (``None`` if it could not be written).
    """

    def __init__(self, message: str, *, log: str, options: tuple[str, ...], name: str, result: str,
                 nvcc_command: str, source_path: str | None):
        self.log = log
        self.options = options
        self.name = name
        self.result = result
        self.nvcc_command = nvcc_command
        self.source_path = source_path
        text = f"{message}\n  options: {shlex.join(options)}\n  reproduce: {nvcc_command}"
        if log.strip():
            text += "\n  log:\n" + "\n".join("    " + line for line in log.rstrip().splitlines())
        super().__init__(text)


@dataclass(frozen=True)
class KernelResources:
    """What ptxas reported for one entry function (kernel).

    ``name`` is the symbol in the CUBIN (what ``cuModuleGetFunction`` takes): the plain name of an
    ``extern "C"`` kernel, the mangled one otherwise. Sizes are bytes per thread except ``shared_bytes``
    (static ``__shared__`` per block; dynamic shared memory is not known at compile time).
    ``constant_banks`` maps a constant bank to its bytes (``cmem[0]`` holds the parameters); ptxas
    prints none for sm_90 and later, so it is empty there.
    """

    name: str
    arch: str
    registers: int
    shared_bytes: int = 0
    stack_frame_bytes: int = 0
    spill_store_bytes: int = 0
    spill_load_bytes: int = 0
    barriers: int = 0
    cumulative_stack_bytes: int = 0
    constant_banks: Mapping[int, int] = field(default_factory=dict)

    @property
    def constant_bytes(self) -> int:
        return sum(self.constant_banks.values())

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0

    def summary(self) -> str:
        """One line, as a person would want it in a report."""
        text = (f"{self.name} ({self.arch}): {self.registers} registers, {self.shared_bytes} B smem, "
                f"{self.stack_frame_bytes} B stack, {self.spill_store_bytes} B spill stores, "
                f"{self.spill_load_bytes} B spill loads")
        if self.constant_banks:
            text += ", " + ", ".join(f"{b} B cmem[{k}]" for k, b in sorted(self.constant_banks.items()))
        return text


@dataclass(frozen=True)
class Compiled:
    """The result of `compile_source`."""

    cubin: bytes
    log: str  # NVRTC's log: front-end warnings, then ptxas's report
    arch: str
    options: tuple[str, ...]  # exactly what NVRTC was given
    name: str
    lowered_names: Mapping[str, str]  # name expression (``"scan<4>"``) -> symbol in the CUBIN
    seconds: float  # wall time of the compile (front end and ptxas)

    @property
    def resources(self) -> dict[str, KernelResources]:
        """`resource_usage` of the log, by CUBIN symbol and also by each name expression that was asked for."""
        found = resource_usage(self.log)
        for expr, symbol in self.lowered_names.items():
            if symbol in found:
                found.setdefault(expr, found[symbol])
        return found


# -- the library ---------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _probe() -> tuple[object | None, str]:
    """(the module ``cuda.bindings.nvrtc``, "") when NVRTC can be called, else (None, why not)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as err:
        return None, f"cuda-bindings is not installed ({err}); pip install 'cuda-bindings' 'nvidia-cuda-nvrtc'"
    try:  # cuda-bindings asks cuda.pathfinder itself; asking first gives the clearer message when it fails
        from cuda.pathfinder import load_nvidia_dynamic_lib

        load_nvidia_dynamic_lib("nvrtc")
    except ImportError:
        pass
    except Exception as err:
        return None, f"libnvrtc was not found ({type(err).__name__}: {err}); pip install 'nvidia-cuda-nvrtc'"
    try:
        result = nvrtc.nvrtcVersion()[0]
    except Exception as err:  # RuntimeError from the loader, in cuda-bindings without cuda.pathfinder
        return None, f"libnvrtc could not be loaded ({type(err).__name__}: {err})"
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return None, f"nvrtcVersion failed: {result.name}"
    return nvrtc, ""


def available() -> bool:
    """Whether NVRTC can be called here (no GPU needed)."""
    return _probe()[0] is not None


def unavailable_reason() -> str:
    """Why `available()` is False ("" when it is True)."""
    return _probe()[1]


def _nvrtc():
    module, why = _probe()
    if module is None:
        raise RuntimeError(f"NVRTC is not available: {why}")
    return module


def version() -> tuple[int, int]:
    """NVRTC's (major, minor) version, e.g. (13, 5)."""
    nvrtc = _nvrtc()
    _, major, minor = nvrtc.nvrtcVersion()
    return int(major), int(minor)


def supported_archs() -> tuple[str, ...]:
    """The ``sm_XX`` values this NVRTC builds for (``a``/``f`` variants of those are accepted too)."""
    nvrtc = _nvrtc()
    result, archs = nvrtc.nvrtcGetSupportedArchs()
    _check(nvrtc, result, "nvrtcGetSupportedArchs")
    return tuple(f"sm_{a}" for a in archs)


def _check(nvrtc, result, what: str) -> None:
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {result.name}")


# -- compiling ---------------------------------------------------------------------------------------------------


@functools.cache
def toolkit_include() -> str | None:
    """A CUDA toolkit's header directory on this machine (the one with ``cuda_fp16.h``), or None:
    ``$CUDA_HOME`` / ``$CUDA_PATH``, then ``/usr/local/cuda`` and ``/usr/local/cuda-*`` (newest first).
    NVRTC itself has no headers; kernels over half types include these."""
    roots = [environment_variable("CUDA_HOME"), environment_variable("CUDA_PATH"), "/usr/local/cuda"]
    if os.path.isdir("/usr/local"):
        roots += sorted((os.path.join("/usr/local", d) for d in os.listdir("/usr/local") if d.startswith("cuda-")),
                        reverse=True)
    for root in filter(None, roots):
        include = os.path.join(root, "include")
        if os.path.isfile(os.path.join(include, "cuda_fp16.h")):
            return include
    return None


def compile_source(source: str, arch: str = "sm_90", options: tuple[str, ...] = (), name: str = "kernel.cu",
                   headers: Mapping[str, str] | None = None,
                   name_expressions: tuple[str, ...] = ()) -> Compiled:
    """Compile CUDA C++ `source` to a CUBIN for `arch` (``sm_90``, ``sm_90a``, ``sm_80``...).

    `options` are passed on after ``-arch=<arch> --ptxas-options=-v`` (e.g. ``("-maxrregcount=32",
    "--use_fast_math", "-lineinfo")``; NVRTC wants one ptxas option per ``-Xptxas``, not a comma list).
    `headers` maps include names to their text (NVRTC has no file system headers). `name_expressions` are
    C++ names of kernels (``"scan<float, 4>"``) whose CUBIN symbols come back in ``lowered_names``.
    Raises `NvrtcError` when NVRTC or ptxas fails, ValueError for an `arch` that is not ``sm_XX``.
    """
    if not _ARCH.fullmatch(arch):
        raise ValueError(f"arch must be a real architecture like 'sm_90' (a CUBIN, not PTX), not {arch!r}")
    for opt in options:
        if opt.startswith(("-arch", "--gpu-architecture")):
            raise ValueError(f"give the architecture as arch=, not in options ({opt!r})")
    nvrtc = _nvrtc()
    headers = dict(headers or {})
    all_options = (f"-arch={arch}", "--ptxas-options=-v", *options)

    result, prog = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), len(headers),
                                            [text.encode() for text in headers.values()],
                                            [inc.encode() for inc in headers])
    _check(nvrtc, result, "nvrtcCreateProgram")
    try:
        for expr in name_expressions:
            _check(nvrtc, nvrtc.nvrtcAddNameExpression(prog, expr.encode())[0], f"nvrtcAddNameExpression({expr!r})")
        start = time.perf_counter()
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(all_options), [o.encode() for o in all_options])
        seconds = time.perf_counter() - start
        log = _log(nvrtc, prog)
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise _error(result.name, log, all_options, name, source, headers, arch)
        lowered = {}
        for expr in name_expressions:
            res, symbol = nvrtc.nvrtcGetLoweredName(prog, expr.encode())
            _check(nvrtc, res, f"nvrtcGetLoweredName({expr!r})")
            lowered[expr] = symbol.decode()
        res, size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(nvrtc, res, "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin)[0], "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return Compiled(cubin=bytes(cubin), log=log, arch=arch, options=all_options, name=name,
                    lowered_names=lowered, seconds=seconds)


def _log(nvrtc, prog) -> str:
    result, size = nvrtc.nvrtcGetProgramLogSize(prog)
    _check(nvrtc, result, "nvrtcGetProgramLogSize")
    buf = bytearray(size)
    if size:
        _check(nvrtc, nvrtc.nvrtcGetProgramLog(prog, buf)[0], "nvrtcGetProgramLog")
    return buf.decode(errors="replace").rstrip("\0")


def _first_error(log: str) -> str:
    for line in log.splitlines():
        if re.search(r"\b(error|fatal)\b", line):
            return line.strip()
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    return lines[0] if lines else "no log"


def _save_failed(source: str, name: str, headers: Mapping[str, str]) -> str | None:
    """Write the failing source (and its headers) where the nvcc command can find them; None if we can't."""
    from ...runtime.cache import cache_dir, content_key

    try:
        folder = cache_dir("nvrtc") / f"k_{content_key(source + ''.join(f'{k}{v}' for k, v in headers.items()))}"
        for rel, text in {name: source, **headers}.items():
            path = folder / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return str(folder / name)
    except (OSError, ValueError):
        return None


def nvcc_command(source_path: str, options: tuple[str, ...], include_dir: str | None = None) -> str:
    """One shell line that compiles `source_path` with nvcc as NVRTC did with `options` (-arch included)."""
    kept = [o for o in options if not o.startswith(_NVRTC_ONLY)]
    include = [f"-I{include_dir}"] if include_dir else []
    stem = os.path.splitext(os.path.basename(source_path))[0] or "kernel"
    return shlex.join(["nvcc", "-cubin", *kept, *include, "-o", f"{stem}.cubin", source_path])


def _error(result: str, log: str, options: tuple[str, ...], name: str, source: str,
           headers: Mapping[str, str], arch: str) -> NvrtcError:
    path = _save_failed(source, name, headers)
    include_dir = os.path.dirname(path) if path and headers else None
    command = nvcc_command(path or name, options, include_dir)
    return NvrtcError(f"NVRTC could not compile {name} for {arch} ({result}): {_first_error(log)}",
                      log=log, options=options, name=name, result=result, nvcc_command=command, source_path=path)


# -- reading ptxas's report ----------------------------------------------------------------------------------------

_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")
_PROPERTIES = re.compile(r"Function properties for (\S+)")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"\bUsed (\d+) registers\b(.*)")
_BARRIERS = re.compile(r"used (\d+) barriers")
_SMEM = re.compile(r"(\d+)(?:\+(\d+))? bytes smem")
_CMEM = re.compile(r"(\d+) bytes cmem\[(\d+)\]")
_CUMULATIVE = re.compile(r"(\d+) bytes cumulative stack size")


def resource_usage(log: str) -> dict[str, KernelResources]:
    """Per kernel (entry function), what ptxas's verbose report in `log` says it uses.

    Reads the log of `compile_source` (NVRTC with ``--ptxas-options=-v``) and the same report from
    ``nvcc -Xptxas -v``. Device functions that were not inlined have a stack line but are no kernels: they
    are left out. Kernels are in the order ptxas compiled them.
    """
    frames: dict[str, tuple[int, int, int]] = {}
    used: dict[str, dict] = {}
    arch_of: dict[str, str] = {}
    entry = None  # the kernel being compiled: its "Used" line comes after its "Compiling entry" line
    props = None  # the function whose stack line comes next
    for line in log.splitlines():
        if m := _ENTRY.search(line):
            entry, props = m.group(1), m.group(1)
            arch_of[entry] = m.group(2)
            used.setdefault(entry, {"registers": 0})
        elif m := _PROPERTIES.search(line):
            props = m.group(1)
        elif m := _FRAME.search(line):
            if props is not None:
                frames[props] = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _USED.search(line)) and entry is not None:
            rest = m.group(2)
            info = {"registers": int(m.group(1)), "constant_banks": {}}
            if b := _BARRIERS.search(rest):
                info["barriers"] = int(b.group(1))
            if s := _SMEM.search(rest):
                info["shared_bytes"] = int(s.group(1)) + int(s.group(2) or 0)
            if c := _CUMULATIVE.search(rest):
                info["cumulative_stack_bytes"] = int(c.group(1))
            for c in _CMEM.finditer(rest):
                info["constant_banks"][int(c.group(2))] = int(c.group(1))
            used[entry] = info
            entry = None
    out = {}
    for kernel, info in used.items():
        stack, spill_stores, spill_loads = frames.get(kernel, (0, 0, 0))
        out[kernel] = KernelResources(name=kernel, arch=arch_of[kernel], stack_frame_bytes=stack,
                                      spill_store_bytes=spill_stores, spill_load_bytes=spill_loads, **info)
    return out

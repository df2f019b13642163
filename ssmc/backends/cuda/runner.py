"""Running lowered programs on the GPU: NVRTC through CuPy, memory as PyTorch CUDA tensors.

Inside the backend every device array is a torch tensor (CuPy arrays come in zero-copy through
``__cuda_array_interface__``), because torch has bf16 and the slicing / zeros / concatenation the
gradient driver needs; CuPy compiles (`RawModule`, NVRTC, with CuPy's on-disk cache under
``$SSMC_CACHE_DIR/cupy``) and launches on torch's current stream. `CudaRunner.run` has the
interpreter's contract: time-first arrays (any strides; nothing is copied), name -> array dicts.
"""

from __future__ import annotations

import os

import numpy as np

from ...lowering.plan import Kernel, Lowered, lower
from ...runtime.cache import cache_dir
from ...runtime.progress import progress
from .codegen import BLOCK, ArraySpec, module_source

_DTYPES = {"torch.float32": "float32", "torch.float64": "float64", "torch.float16": "float16",
           "torch.bfloat16": "bfloat16"}


def available() -> bool:
    try:
        import cupy
        import torch

        return torch.cuda.is_available() and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def to_device(x, name: str):
    """A torch CUDA tensor for an argument (torch / CuPy zero-copy; NumPy and lists copied)."""
    import torch

    if isinstance(x, torch.Tensor):
        t = x.detach()
        if not t.is_cuda:
            t = t.cuda()
    elif hasattr(x, "__cuda_array_interface__"):
        t = torch.as_tensor(x, device="cuda")
    else:
        t = torch.as_tensor(np.asarray(x), device="cuda")
    if str(t.dtype) not in _DTYPES:
        if t.is_floating_point() or t.is_complex():
            raise ValueError(f"argument {name!r} has dtype {t.dtype}; the cuda backend takes float32, float64, "
                             "float16 and bfloat16")
        t = t.to(torch.float32)
    return t


def device_zeros(shape):
    import torch

    return torch.zeros(shape, device="cuda", dtype=torch.float32)


def _as_1d(t):
    return t.reshape(1) if t.dim() == 0 else t


class CudaRunner:
    """A lowered program whose kernels are built per shape (sizes, strides, dtypes) and cached."""

    def __init__(self, program, compute: str = "float32"):
        self.program = program
        self.compute = compute                          # float32 | float64
        self.lowered: Lowered = lower(program)
        self.modules: dict[str, object] = {}
        os.environ.setdefault("CUPY_CACHE_DIR", str(cache_dir("cupy")))

    # -- building ----------------------------------------------------------------------------
    def source_for(self, k: Kernel, specs: dict[str, ArraySpec], sizes: dict[str, int]) -> str:
        ctype = "double" if self.compute == "float64" else "float"
        return module_source(self.lowered, ctype, [(k, specs)], sizes)

    def _function(self, source: str, name: str):
        module = self.modules.get(source)
        if module is None:
            import cupy

            with progress(f"compiling {self.lowered.program.name} for CUDA (NVRTC)"):
                module = cupy.RawModule(code=source, options=("--std=c++17",))
                module.compile()
            self.modules[source] = module
        return module.get_function(name)

    # -- running -----------------------------------------------------------------------------
    def _launch(self, k: Kernel, arrays: dict, sizes: dict[str, int], length: int, nblk: int = 1,
                out_dtype=None) -> dict:
        import cupy
        import torch

        made = {}
        tensors = []
        for a in k.arrays:
            if a.role in ("seq", "param", "init"):
                t = _as_1d(arrays[a.name])
            else:
                shape = [length if ax == "t" else nblk if ax == "block" else sizes[ax] for ax in a.axes]
                state_dtype = torch.float64 if self.compute == "float64" else torch.float32
                dtype = out_dtype if a.role == "out" and out_dtype is not None else state_dtype
                made[a.name] = torch.empty(shape, device="cuda", dtype=dtype)
                t = _as_1d(made[a.name])
            tensors.append((a, t))
        specs = {a.name: ArraySpec(_DTYPES[str(t.dtype)], tuple(t.stride())) for a, t in tensors}
        source = self.source_for(k, specs, sizes)
        fn = self._function(source, k.name)
        total = int(np.prod([sizes[a] for a in k.parallel], dtype=np.int64)) * nblk
        grid = (max(1, (total + BLOCK - 1) // BLOCK),)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        args = (np.int32(length), np.int32(nblk), *(np.uint64(t.data_ptr()) for _, t in tensors))
        fn(grid, (BLOCK,), args, stream=stream)
        return made

    def run(self, seqs, params, initial, sizes, length, out_dtype=None):
        """Same contract as `interpreter.run_recurrence` (torch CUDA tensors in and out)."""

        low, p = self.lowered, self.program
        if low.strategy == "fused":
            (k,) = low.kernels
            made = self._launch(k, {**seqs, **params, **{f"init_{s}": v for s, v in initial.items()}}, sizes,
                                length, out_dtype=out_dtype)
            outs = {n: made[f"out_{n}"] for n, _ in p.outputs}
            finals = {s.name: made[f"final_{s.name}"].reshape([sizes[a] for a in s.axes]) for s in p.states}
            return outs, finals
        finals, prev = {}, {}
        kernels = list(low.kernels)
        if low.core_states:
            core = kernels.pop(0)
            made = self._launch(core, {**seqs, **params, **{f"init_{s}": initial[s] for s in low.core_states}},
                                sizes, length)
            for s in low.core_states:
                prev[s] = made[f"prev_{s}"]
                finals[s] = made[f"final_{s}"].reshape([sizes[a] for a in p.decl(s).axes])
        (epi,) = kernels
        nblk = max(1, length)  # one thread per step (and per accumulator block of one step)
        inputs = {**seqs, **params, **prev, **{f"init_{s}": initial[s] for s in low.accumulators}}
        made = self._launch(epi, inputs, sizes, length, nblk, out_dtype=out_dtype)
        for s in low.accumulators:
            shape = [sizes[a] for a in p.decl(s).axes]
            finals[s] = initial[s].to(made[f"final_{s}"].dtype) + made[f"final_{s}"].reshape([nblk, *shape]).sum(0)
        outs = {n: made[f"out_{n}"] for n, _ in p.outputs}
        return outs, {s.name: finals[s.name] for s in p.states}


_RUNNERS: dict[tuple, CudaRunner] = {}


def runner_for(program, compute: str = "float32") -> CudaRunner:
    key = (program, compute)
    if key not in _RUNNERS:
        _RUNNERS[key] = CudaRunner(program, compute)
    return _RUNNERS[key]

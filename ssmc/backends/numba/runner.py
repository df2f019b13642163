"""Running a lowered program through Numba, with the interpreter's calling contract.

`NumbaRunner.run` takes and returns what `interpreter.run_recurrence` does (time-first arrays,
name -> array dicts), in float32 or float64.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import replace

import numpy as np

from ...lowering.hoist import Hoisted, compute_params, compute_post, compute_pre, hoist, in_original_order
from ...lowering.kernel import Kernel, Lowered
from ...lowering.plan import lower, sum_of_output
from ...runtime.cache import store
from ...runtime.progress import progress
from .codegen import module_source
from .gemm import matmul
from .strategy import narrow, use_narrow


def _load(path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # numba's cache locates functions through their module
    spec.loader.exec_module(module)
    return module


def _flat(arr: np.ndarray) -> np.ndarray:
    """Axis-less arrays travel as one-element vectors (kernels index them with [0])."""
    return arr.reshape(1) if arr.ndim == 0 else arr


class NumbaRunner:
    def __init__(self, program, dtype: str = "float64", lowered: Lowered | None = None):
        self.program = program
        self.dtype = np.dtype(dtype)
        # a given lowering (of `program` itself) runs as it is: no hoisting, no narrower variant
        self.hoisted: Hoisted = Hoisted(program, program) if lowered else hoist(program)
        self.lowered: Lowered = lowered or lower(self.hoisted.program)
        self.narrow: Lowered | None = None if lowered else narrow(self.lowered)  # fewer parallel axes
        kernels = self.lowered.kernels + ([k for k in self.narrow.kernels if k not in self.lowered.kernels]
                                          if self.narrow else [])
        self.source = module_source(replace(self.lowered, kernels=kernels), self.dtype.name)
        self.path = store("numba", self.source, ".py")
        self.module = _load(self.path, f"ssmc_numba_{self.path.stem}")
        self.compiled: set[str] = set()
        # a written factor the post products read in another axis order is allocated in that
        # order (the kernel writes it through a transposed view): no reordering copy after
        factors = dict(self.hoisted.factors)
        self.out_orders = {f"out_{name}": ("t", *order) for name, order in self.hoisted.product_orders.items()
                           if order != factors[name].axes}

    def _call(self, k: Kernel, arrays: dict[str, np.ndarray], sizes: dict[str, int], length: int,
              nblk: int = 1) -> dict[str, np.ndarray]:
        """Run kernel `k`; allocates its outputs (final / out / prev) and returns them by name."""
        dt = self.dtype
        args = []
        made = {}
        for a in k.arrays:
            if a.role in ("seq", "param", "init"):
                arr = np.asarray(arrays[a.name], dtype=dt)  # strided views stay views ...
                if _wants_contiguous(k, a, arr):
                    arr = np.ascontiguousarray(arr)
                args.append(_flat(arr))
                continue
            order = self.out_orders.get(a.name, a.axes)
            shape = [length if ax == "t" else nblk if ax == "block" else sizes[ax] for ax in order]
            made[a.name] = np.empty(shape, dtype=dt).transpose([order.index(ax) for ax in a.axes])
            args.append(_flat(made[a.name]))
        fn = getattr(self.module, k.name)
        if k.name not in self.compiled:
            with progress(f"compiling {k.name} with Numba"):
                fn(length, nblk, _threads(), *(sizes[a] for a in k.sizes), *args)
            self.compiled.add(k.name)
        else:
            fn(length, nblk, _threads(), *(sizes[a] for a in k.sizes), *args)
        return made

    def run(self, seqs, params, initial, sizes, length, products: dict | None = None):
        """Same contract as `interpreter.run_recurrence`.

        Contractions hoisted out of the time loop (`lowering/hoist.py`) run as matrix products
        (`gemm.py`, on Numba's threads) in the run's dtype before (new sequences) and after
        (outputs, accumulators) the kernels. `products`: as in `hoist.compute_pre`."""
        h = self.hoisted
        if not h.changed:
            return self._run_lowered(seqs, params, initial, sizes, length)
        dt = self.dtype
        seqs = {k: np.asarray(v).astype(dt, copy=False) for k, v in seqs.items()}
        params = {k: np.asarray(v).astype(dt, copy=False) for k, v in params.items()}
        initial = {k: np.asarray(v).astype(dt, copy=False) for k, v in initial.items()}
        seqs.update(compute_pre(h, seqs, params, matmul, products))
        outs, finals = self._run_lowered(seqs, {**params, **compute_params(h, params)}, initial, sizes, length)
        outs = in_original_order(h, outs)
        post_outs, post_finals = compute_post(h, seqs, params, outs, initial, matmul)
        outs = {n: post_outs[n] if n in post_outs else outs[n] for n, _ in self.program.outputs}
        finals = {s.name: post_finals[s.name] if s.name in post_finals else finals[s.name]
                  for s in self.program.states}
        return outs, finals

    def _run_lowered(self, seqs, params, initial, sizes, length):
        """`run` of the hoisted program through its kernels."""
        low = self.lowered
        if self.narrow is not None and use_narrow(self.narrow, sizes, _threads()):
            low = self.narrow
        p = self.hoisted.program
        if low.strategy == "fused":
            (k,) = low.kernels
            made = self._call(k, {**seqs, **params, **{f"init_{s}": v for s, v in initial.items()}}, sizes, length)
            outs = {n: made[f"out_{n}"] for n, _ in p.outputs}
            finals = {s.name: made[f"final_{s.name}"].reshape([sizes[a] for a in s.axes]) for s in p.states}
            return outs, finals
        finals = {}
        prev = {}
        kernels = list(low.kernels)
        if low.core_states:
            core = kernels.pop(0)
            made = self._call(core, {**seqs, **params, **{f"init_{s}": initial[s] for s in low.core_states}},
                              sizes, length)
            for s in low.core_states:
                prev[s] = made[f"prev_{s}"]
                finals[s] = made[f"final_{s}"].reshape([sizes[a] for a in p.decl(s).axes])
        inputs = {**seqs, **params, **prev, **{f"init_{s}": initial[s] for s in low.accumulators}}
        outs = {}
        for epi in kernels:  # one epilogue, or one per root (`lower(map_reduce=True)`)
            nblk = max(1, min(length, 4 * _threads()))
            made = self._call(epi, inputs, sizes, length, nblk)
            for s in epi.program.states:
                shape = [sizes[a] for a in s.axes]
                finals[s.name] = initial[s.name] + made[f"final_{s.name}"].reshape([nblk, *shape]).sum(axis=0)
            outs.update({n: made[f"out_{n}"] for n, _ in epi.program.outputs})
        for s, name, axes in low.from_outputs:  # accumulators that are sums of an output
            dims, perm = sum_of_output(p, s, name, axes)
            finals[s] = initial[s] + outs[name].sum(axis=dims).transpose(perm)
        outs = {n: outs[n] for n, _ in p.outputs}
        return outs, {s.name: finals[s.name] for s in p.states}


def _wants_contiguous(k: Kernel, a, arr: np.ndarray) -> bool:
    """... except a sequence whose last axis the step loops over (not a parallel axis) and that is
    strided along it: Mamba-1's B [b n t] in the layout "b d t". Its values for one step are read by
    a vector loop over n, which would gather them 4 KB apart; one copy (no d axis: small next to the
    kernel's reads, which repeat for every d) makes them adjacent. With the copy Mamba-1's fp32
    forward ran faster on two cores; see bench/results/2026-11-27-from-code-comments.md."""
    return (a.role == "seq" and arr.ndim > 1 and a.axes[-1] not in k.parallel
            and arr.strides[-1] != arr.itemsize)


def _threads() -> int:
    import numba

    return numba.get_num_threads()


_RUNNERS: dict[tuple, NumbaRunner] = {}


def runner_for(program, dtype: str) -> NumbaRunner:
    key = (program, np.dtype(dtype).name)
    if key not in _RUNNERS:
        _RUNNERS[key] = NumbaRunner(program, dtype)
    return _RUNNERS[key]

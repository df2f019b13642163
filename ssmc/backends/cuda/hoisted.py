"""Contractions hoisted out of the time loop, on the GPU: matrix products through torch (cuBLAS).

`lowering/hoist.py` finds the contractions of a step that need no sequential loop: a minGRU's
``x_t Wz`` and ``x_t Wh``, an LSTM's ``x_t W`` (state-free: "pre"), an adjoint's ``grad_W += x_t^T g_t``
(a value the loop computes times sequences: "post"). Kernels that compute them per step and thread
read the same rows of x and W again for every output, which made minGRU's training step slow at its
benchmark shape (see bench/results/2026-11-27-from-code-comments.md). Here they run for all steps at
once:

    for t: hz[t] = x[t] @ Wz                         # pre:  one matrix product over (t, b), before
    outs, finals = kernels of the rest (hz read as a sequence; the loop writes hf[t] = g[t])
    grad_W = init + sum over t, b of x[t, b]^T hf[t, b]  # post: one matrix product, after

`HoistedRunner.run` has the runner contract (time-first torch CUDA tensors in and out). The products
are computed in the compute dtype (float32 or float64; torch's default keeps TF32 off, so a float32
product is a float32 one), whatever the dtype of the sequences the kernels read in place.
"""

from __future__ import annotations

import math
from functools import reduce

from ...lowering.hoist import Hoisted, compute_params, compute_post, compute_pre, hoist, in_original_order
from ...runtime.precision import half_inputs, half_of
from .kernels.step_loop import step_loop
from .options import options
from .runner import batch_outer, output_dtype, runner_for, time_contiguous


class TorchArrays:
    """`hoist.NumPyArrays` for torch tensors: what evaluating the hoisted parts asks of them. `half`: a
    16-bit dtype the products of two or more arrays read their operands in (fp32 accumulation on tensor
    cores, the result in that dtype), or None. Sums of one array (an adjoint's bias gradient: the sum of a
    16-bit dz over time and batch) accumulate in fp32 and come out in fp32 whatever its dtype."""

    def __init__(self, half=None):
        self.half = half

    @staticmethod
    def take(arr, index: int, axis: int):
        return arr.select(axis, index)

    def einsum(self, spec: str, *arrays):
        """`torch.einsum`, its operands cast as `pair` casts them (to `half` where set, else to one dtype:
        a batched product of a 16-bit dz and an fp32 sequence, a head's grad_U, would mix them); one
        16-bit operand summed over some of its axes: the sum in fp32 (`_sum32`)."""
        import torch

        if len(arrays) == 1 and arrays[0].dtype in (torch.bfloat16, torch.float16):
            return _sum32(spec, arrays[0])
        dtypes = {a.dtype for a in arrays}
        if len(arrays) > 1 and self.half is not None and dtypes != {self.half}:
            arrays = tuple(a.to(self.half) for a in arrays)
        elif len(dtypes) > 1:
            common = reduce(torch.promote_types, dtypes)
            arrays = tuple(a.to(common) for a in arrays)
        return torch.einsum(spec, *arrays)

    @staticmethod
    def sum(arr, axes: tuple[int, ...]):
        """The sum over `axes`, in fp32 for a 16-bit `arr` (accumulated so, and kept so)."""
        import torch

        if arr.dtype in (torch.bfloat16, torch.float16):
            return arr.sum(dim=axes, dtype=torch.float32)
        return arr.sum(dim=axes)

    @staticmethod
    def permute(arr, perm: list[int]):
        return arr.permute(*perm)

    @staticmethod
    def contiguous(arr, dtype=None):
        """`arr` in `dtype`, copied only where it is not dense (a permuted view of a contiguous array
        stays as it lies: the kernels and matrix products read any strides)."""
        arr = arr if dtype is None or arr.dtype == dtype else arr.to(dtype)
        by_stride = sorted(range(arr.dim()), key=lambda i: -arr.stride(i))  # a permutation of a contiguous array?
        return arr if arr.permute(*by_stride).is_contiguous() else arr.contiguous()

    def dtype_of(self, *arrays):
        """The dtype of a hoisted product of `arrays` (`half` where set: the kernels read it so)."""
        import torch

        return self.half or reduce(torch.promote_types, (a.dtype for a in arrays))

    def pair(self, a, la: tuple[str, ...], b, lb: tuple[str, ...], out: tuple[str, ...]):
        """``sum over the shared axes of a * b`` as one `torch.matmul`, (array, labels); None where an
        axis both have is kept (a batched product: einsum's). Every axis group in the order its
        operand lies in memory (largest stride first), so the 2-D views need no copy where the
        memory allows: minGRU's x [t b i] in the layout "b t ..." is read as [(b t), i], its product
        comes out [b t d], as the kernels' other sequences lie. (torch.einsum spent host time planning
        each of these on every call, and copied its operands; see
        bench/results/2026-11-27-from-code-comments.md.)"""
        import torch

        for axis in [x for x in la if x not in lb and x not in out]:  # summed in one operand only
            a, la = a.sum(la.index(axis)), tuple(x for x in la if x != axis)
        for axis in [x for x in lb if x not in la and x not in out]:
            b, lb = b.sum(lb.index(axis)), tuple(x for x in lb if x != axis)
        shared = [x for x in la if x in lb]
        if any(x in out for x in shared):
            return None
        size = dict(zip(la, a.shape)) | dict(zip(lb, b.shape))

        def in_memory(arr, labels, axes):
            return sorted(axes, key=lambda x: -arr.stride(labels.index(x)))

        fa = in_memory(a, la, [x for x in la if x not in lb])
        fb = in_memory(b, lb, [x for x in lb if x not in la])
        shared = in_memory(a, la, shared)
        rows, inner, cols = (math.prod(size[x] for x in axes) for axes in (fa, shared, fb))
        a2 = a.permute(*[la.index(x) for x in fa + shared]).reshape(rows, inner)
        b2 = b.permute(*[lb.index(x) for x in shared + fb]).reshape(inner, cols)
        if self.half is not None and (a2.dtype != self.half or b2.dtype != self.half):
            a2, b2 = a2.to(self.half), b2.to(self.half)
        return torch.matmul(a2, b2).reshape([size[x] for x in fa + fb]), tuple(fa + fb)


def _sum32(spec: str, arr):
    """``einsum(spec, arr)`` of one 16-bit array: a sum over the axes the result lacks (accumulated and
    returned in fp32), then the result's axis order (nothing summed: a permuted view, still 16-bit); a
    repeated label (a diagonal) through an fp32 einsum."""
    import torch

    given, out = spec.split("->")
    if len(set(given)) != len(given):
        return torch.einsum(spec, arr.float())
    summed = [i for i, a in enumerate(given) if a not in out]
    kept = [a for a in given if a in out]
    if summed:
        arr = arr.sum(dim=summed, dtype=torch.float32)
    return arr.permute(*[kept.index(a) for a in out])


TORCH = TorchArrays()


class HoistedRunner:
    """A program whose contractions `hoist` takes out of the time loop: the products around the kernels
    of the hoisted program (module docstring)."""

    def __init__(self, program, compute: str = "float32"):
        self.program = program
        self.compute = compute
        self.hoisted: Hoisted = hoist(program, transpose=False)
        self.kernels = runner_for(self.hoisted.program, compute)

    @property
    def loop(self):
        """What is left as a loop over steps, where it reads its states through a recurrent product
        (kernels/step_loop.py, which SSMC_CUDA_STEP_LOOP=0 turns off), else None: its kernels run it."""
        return step_loop(self.hoisted.program, self.compute)

    def describe(self) -> str:
        """The products around the kernels, for `ssmc inspect`: "matrix products: hz0 hz1 before, ..."."""
        h = self.hoisted
        after = [n for n, _ in h.post_outputs + h.post_accumulators]
        return "matrix products: " + "; ".join(
            part for part in (" ".join(n for n, _ in h.pre) + " before" if h.pre else "",
                              " ".join(after) + " after" if after else "") if part)

    def run(self, seqs, params, initial, sizes, length, out_dtype=None, products: dict | None = None):
        """The runner contract. `products`: as in `hoist.compute_pre` (a recording forward's ``x W``
        for its adjoint to reuse)."""
        import torch

        h = self.hoisted
        compute = torch.float64 if self.compute == "float64" else torch.float32
        inner = self.loop or self.kernels
        # 16-bit inputs (as given, or cast by a gradient's path: runtime/precision.py) of a loop with a
        # 16-bit form (the persistent kernel's `reads_half`): the products in them, accumulated in fp32
        # (a float32 product of those shapes takes 10 x longer); the sequences given in it stay so
        half = None
        if compute == torch.float32 and getattr(inner, "reads_half", False):
            half = half_of([*seqs.values(), *params.values()]) or half_inputs()
        xp = TORCH if half is None else TorchArrays(half)
        cast = {n: TORCH.contiguous(v, compute) if v.dtype not in (compute, half) else v for n, v in seqs.items()}
        cast_params = {n: v if v.dtype == compute else v.to(compute) for n, v in params.items()}
        pre = compute_pre(h, cast, cast_params, products=products, xp=xp)
        if time_contiguous(seqs):  # the kernels take every sequence with time contiguous, or none
            pre = {n: v.movedim(0, -1).contiguous().movedim(-1, 0) for n, v in pre.items()}
        elif batch_outer(list(seqs.values())):  # "b t ...": the outputs are then allocated so too
            pre = {n: v.movedim(0, 1).contiguous().movedim(1, 0) if v.dim() > 2 else v for n, v in pre.items()}
        # the persistent kernel writes the per-step values the post products read in their order, and
        # a forward's recurrent product of every step into `products` (an adjoint's pre product)
        extra = {"orders": h.product_orders, "products": products} if getattr(inner, "writes_in_order", False) else {}
        outs, finals = inner.run({**seqs, **pre}, {**params, **compute_params(h, cast_params, xp=TORCH)},
                                 initial, sizes, length, **extra)
        outs = in_original_order(h, outs, xp=TORCH)
        # (the post outputs in the compute dtype where the loop wrote the values they read in 16 bits: the
        # tensor-core form's dz)
        post_outs, post_finals = compute_post(h, {**cast, **pre}, cast_params, outs, initial, xp=xp,
                                              dtype=None if half is None else compute)
        outs.update(post_outs)
        finals.update(post_finals)
        wanted = {n: output_dtype(out_dtype, n) for n, _ in self.program.outputs}
        outs = {n: outs[n] if wanted[n] is None else outs[n].to(wanted[n]) for n in wanted}
        return outs, {s.name: finals[s.name] for s in self.program.states}


_RUNNERS: dict[tuple, HoistedRunner] = {}


def hoisted_runner(program, compute: str = "float32") -> HoistedRunner | None:
    """The runner of `program` with its contractions hoisted, or None where `hoist` finds none (or
    `SSMC_CUDA_HOIST=0`: every contraction in the kernels, as before; bench/hoisted_products.py)."""
    if not options().hoist:
        return None
    key = (program, compute)
    if key not in _RUNNERS:
        runner = HoistedRunner(program, compute)
        h = runner.hoisted
        _RUNNERS[key] = runner if h.pre or h.factors or h.post_accumulators else None
    return _RUNNERS[key]

"""A CUDA training step run on the CPU through the kernel emulator (backends/cuda/emulator.py).

`fused_step` runs the fused backward's two kernels as `ssmc inspect` reports them (`FusedBackwardRunner
.sources`: sequences with time contiguous, arrays laid out as the runner allocates them) on NumPy
arrays: the forward saving the round carries, then the backward. Its gradients are compared with
the interpreter's by the tests, so the kernels' logic is checked without a GPU at tiny sizes.
"""

from __future__ import annotations

import numpy as np

from ssmc.backends.cuda.backward_launch import array_layout
from ssmc.backends.cuda.emulator import emulated
from ssmc.backends.cuda.fused_backward import fused_backward_runner
from ssmc.passes.autodiff import GRAD, derive_backward


def _sizes(program, inputs: dict) -> tuple[dict[str, int], int]:
    """Axis sizes and length of `inputs` (sequences time last, as the layout "... t")."""
    sizes, length = {}, None
    for d in program.inputs:
        shape = inputs[d.name].shape
        if d.name in {s.name for s in program.seqs}:
            length = shape[-1]
            shape = shape[:-1]
        sizes.update(zip(d.axes, shape))
    for s in program.states:
        if s.name in inputs:
            sizes.update(zip(s.axes, inputs[s.name].shape))
    return sizes, length


class _Arrays:
    """The arrays of one launch, by name: NumPy buffers laid out as the runner allocates them
    (`fused_backward.array_layout`), with views of each in its canonical order ([t, *axes] or
    [round, *axes])."""

    def __init__(self, kernel, sizes: dict[str, int], length: int, rounds: int, dtype):
        self.buffers, self.views = {}, {}
        for a in kernel.arrays:
            shape, strides, size = array_layout(a, sizes, length, rounds)
            buffer = np.zeros(max(1, size), dtype)
            itemsize = buffer.itemsize
            self.buffers[a.name] = buffer
            self.views[a.name] = np.lib.stride_tricks.as_strided(
                buffer, shape, [s * itemsize for s in strides]) if shape else buffer[:1].reshape(())

    def pointers(self, kernel) -> list[int]:
        return [self.buffers[a.name].ctypes.data for a in kernel.arrays]


def fused_step(spec, inputs: dict, cotangents: dict, dtype=np.float32) -> tuple[dict, dict]:
    """(outputs, gradients) of `spec` through the fused backward's kernels emulated on the CPU:
    outputs (time last) and final states by name, and the gradients of its inputs (sequences time
    last, as given) for the cotangents of its outputs (time last); initial states among `inputs` or
    zero. Raises where the fused backward does not apply at these sizes."""
    program = spec.program
    compute = "float64" if dtype == np.float64 else "float32"
    fused = fused_backward_runner(derive_backward(program), compute)
    sizes, length = _sizes(program, inputs)
    if fused is None or not fused.applies_at(sizes, length, True):
        raise ValueError(f"{program.name}: the fused backward does not run at {sizes}, L = {length}")
    rounds = -(-length // fused.round_steps(length, fused.backward_lanes(sizes, length, True)))
    (fwd_launch, fwd_source), (bwd_launch, bwd_source), *_ = fused.sources(sizes, length)
    seqs = {d.name for d in program.seqs}

    def canonical(name: str, value) -> np.ndarray:  # time last -> [t, *axes]
        value = np.asarray(value, np.float64)
        return np.moveaxis(value, -1, 0) if name in seqs or name.startswith(GRAD) else value

    forward = _Arrays(fwd_launch.kernel, sizes, length, rounds, dtype)
    given = {d.name: inputs[d.name] for d in program.inputs}
    given.update({f"init_{s.name}": inputs.get(s.name, np.zeros([sizes[a] for a in s.axes])) for s in program.states})
    for name, value in given.items():
        forward.views[name][...] = canonical(name.removeprefix("init_"), value)
    emulated(fwd_source, fwd_launch.kernel.name)(fwd_launch.grid, length, 1, forward.pointers(fwd_launch.kernel))

    plan = fused.plan
    backward = _Arrays(plan, sizes, length, rounds, dtype)
    for a in plan.arrays:
        if a.name in given and not a.name.startswith("init_"):
            backward.views[a.name][...] = canonical(a.name, given[a.name])
        elif a.name.startswith("rounds_"):
            backward.views[a.name][...] = forward.views[a.name]
        elif a.name.startswith(GRAD) and a.name[len(GRAD):] in cotangents:
            backward.views[a.name][...] = canonical(a.name, cotangents[a.name[len(GRAD):]])
    emulated(bwd_source, plan.name)(bwd_launch.grid, length, 1, backward.pointers(plan))

    grads = {}
    for d in program.inputs:
        if f"out_{GRAD}{d.name}" in backward.views:  # a sequence's: [t, *axes] -> time last
            grads[d.name] = np.moveaxis(backward.views[f"out_{GRAD}{d.name}"].astype(np.float64), 0, -1)
        else:
            grads[d.name] = backward.views[f"final_{GRAD}{d.name}"].astype(np.float64)
    for s in program.states:
        grads[s.name] = backward.views[f"final_{GRAD}{s.name}"].astype(np.float64)
    outputs = {n: np.moveaxis(forward.views[f"out_{n}"].astype(np.float64), 0, -1) for n, _ in program.outputs}
    outputs.update((s.name, forward.views[f"final_{s.name}"].astype(np.float64)) for s in program.states)
    return outputs, grads

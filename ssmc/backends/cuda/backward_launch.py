"""The fused backward's launches worked out once per call signature: the arrays each kernel writes
laid out in one buffer (`BackwardLaunch`), the kernel transforms the training step needs (round
carries written, outputs dropped, unread values dropped), and the layouts of a round's arrays."""


from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ...lowering.kernel import Array, Kernel
from ...lowering.loops import Assign, Load, Loop, drop_unread, reads_of_scalars
from .devices import device_name
from .launch import launch_kernel, zero_bytes
from .printer import contiguous_strides

ALIGN = 64  # elements: every array a launch allocates starts 256 bytes into its buffer (vector adds, loads)


@dataclass(frozen=True)
class PreparedLaunch:
    """`prepare_forward`'s or `prepare_backward`'s result: called as the run it prepared; `launch` and
    `length` for callers that launch it themselves (grad_prepared.LeanStep)."""

    call: object
    launch: BackwardLaunch
    length: int

    def __call__(self, *arrays):
        return self.call(*arrays)


@dataclass(frozen=True)
class BufferAllocation:
    """An array a launch allocates: a view of `shape` and `strides` at `offset` of its buffer."""

    name: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    zeroed: bool


@dataclass(frozen=True)
class BackwardLaunch:
    """A launch of the fused backward's forward or backward kernel worked out but for its arrays: the
    arrays it allocates are views of one buffer, whose tail (`zeroed` elements) one memset clears."""

    function: object
    grid: tuple[int, int]
    names: tuple[str, ...]              # the kernel's arrays, in order
    allocations: tuple[BufferAllocation, ...]
    kept: tuple[str, ...]               # given arrays it adds into (returned with the allocated ones)
    plain: int                          # elements of the buffer left as allocated
    zeroed: int                         # elements after them, zeroed
    dtype: object

    def buffer(self):
        """One launch's buffer: one allocation and at most one memset (each torch call adds to a small
        step's host time, bench/host_profile.py)."""
        import torch

        buffer = torch.empty(self.plain + self.zeroed, device=device_name(), dtype=self.dtype)
        if self.zeroed:
            size = buffer.element_size()
            zero_bytes(buffer.data_ptr() + self.plain * size, self.zeroed * size, lambda: buffer[self.plain:].zero_())
        return buffer

    def allocate(self) -> dict:
        """The allocated arrays by name, views of one `buffer`."""
        import torch

        buffer = self.buffer()
        return {a.name: torch.as_strided(buffer, a.shape, a.strides, a.offset) for a in self.allocations}

    def reshaped(self, name: str, shape) -> tuple[int, ...] | None:
        """`shape` where array `name` must be reshaped to it, None where it is allocated in that shape
        (a reshape is a torch call per launch)."""
        shape = tuple(shape)
        same = any(a.name == name and a.shape == shape for a in self.allocations)
        return None if same else shape

    def launch_pointers(self, pointers: list[int], length: int) -> None:
        """Launch over device addresses of the kernel's arrays, in order (`names`)."""
        launch_kernel(self.function, self.grid, length, 1, pointers)

    def run(self, given: dict, length: int) -> dict:
        """Launch over the arrays `given` (by name) and those `allocate` makes; returns the allocated
        ones and the given ones the kernel adds into, by name."""
        made = self.allocate()
        made.update((name, given[name]) for name in self.kept)
        launch_kernel(self.function, self.grid, length, 1,
                      [(given[name] if name in given else made[name]).data_ptr() for name in self.names])
        return made


def shaped(x, shape):
    return x if shape is None else x.reshape(shape)


def forward_arrays(seqs: dict, params: dict, initial: dict) -> dict:
    """The forward kernel's inputs by its names for them."""
    return {**seqs, **params, **{f"init_{s}": v for s, v in initial.items()}}


def backward_arrays(seqs, params, rounds, cotangents, grad_states, grad_params) -> dict:
    """The backward kernel's inputs by its names for them (the param gradients given are added into)."""
    given = {**seqs, **params, **cotangents}
    given.update({f"rounds_{s}": v for s, v in rounds.items()})
    given.update({f"init_{n}": v for n, v in grad_states.items()})
    given.update({f"final_{n}": v for n, v in grad_params.items()})
    return given


def with_rounds(k: Kernel) -> Kernel:
    """`k` with an array ``rounds_<state>`` per state: the carry into each round of the backward."""
    k.arrays += [Array(f"rounds_{s.name}", "rounds", ("round", *s.axes)) for s in k.program.states]
    return k


def without_outputs(k: Kernel) -> Kernel:
    """`k` without its per-step outputs: their arrays and the statements that store into them."""
    outputs = {a.name for a in k.arrays if a.role == "out"}

    def kept(stmts: list) -> list:
        out = []
        for s in stmts:
            if isinstance(s, Assign) and isinstance(s.target, Load) and s.target.array in outputs:
                continue
            out.append(replace(s, body=kept(s.body)) if isinstance(s, Loop) else s)
        return out

    return replace(k, arrays=[a for a in k.arrays if a.name not in outputs], setup=kept(k.setup), step=kept(k.step),
                   finish=kept(k.finish))


def without_unread(k: Kernel) -> Kernel:
    """`k` without the assignments of scalars that no statement reads (and loops left empty), until
    none is left: what only the outputs `without_outputs` dropped read. Names in index expressions
    count as read."""
    while True:
        read = reads_of_scalars(k.setup + k.step + k.finish)
        pruned = replace(k, setup=drop_unread(k.setup, read), step=drop_unread(k.step, read),
                         finish=drop_unread(k.finish, read))
        if pruned == k:
            return k
        k = pruned


def array_layout(a: Array, sizes: dict[str, int], length: int, rounds: int) -> tuple[tuple, tuple, int]:
    """(shape, element strides, elements) of an array that a launch of the fused backward's kernels
    allocates: its axes' sizes (``t``: `length`, ``round``: `rounds`); per-step arrays with time
    innermost, since lanes touch neighbouring steps (rows of atomic arrays padded, `_row`); others
    contiguous (a 0-d one: no strides, one element)."""
    shape = tuple(length if ax == "t" else rounds if ax == "round" else sizes[ax] for ax in a.axes)
    if a.axes[:1] == ("t",) and len(shape) > 1:
        inner = contiguous_strides([*shape[1:], _row(shape[0], a.role)])
        return shape, (inner[-1], *inner[:-1]), inner[0] * shape[1]
    return shape, contiguous_strides(shape) if shape else (), math.prod(shape)


def in_memory_order_of(like, shape: tuple) -> tuple[int, ...]:
    """Element strides laying out an array of `shape` contiguously in the memory order of the tensor
    `like` (its axes by decreasing stride). The lanes backward writes a sequence's gradient so, where
    that sequence has time strided ("b t d"), rather than time innermost: its views in the caller's
    layout are then contiguous as they come (`_in_layouts`), where torch's copies took a large share
    of Mamba-1's step at B8 D1536 L2048 (see bench/results/2026-11-27-from-code-comments.md); its
    stores are scalar, eight rows of a warp's 32 bytes at a time. The lanes forward's outputs too (its
    post phase then runs along the rows, as the plain forward's does there): the op returns them
    contiguous without a copy."""
    order = sorted(range(len(shape)), key=lambda i: (like.stride(i), -i), reverse=True)
    strides, step = [0] * len(shape), 1
    for i in reversed(order):
        strides[i] = step
        step *= shape[i]
    return tuple(strides)


def _row(length: int, role: str) -> int:
    """The row length, time innermost, of an array of `role` the backward allocates: an array added
    into atomically gets rows of a multiple of 4 steps, so that a lane's 4 steps are one aligned
    vector (`add_steps`) at any length."""
    return -(-length // 4) * 4 if role == "atomic" else length

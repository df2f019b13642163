"""How many independent axes a CPU kernel runs in parallel (the Numba backend's choice).

`plan.lower` makes every independent axis parallel (right for a GPU: one thread per recurrence).
On a CPU with a few cores that over-splits: Mamba-1's carries and adjoint core are independent
over [b d n], and one prange iteration per state element recomputes the per-(b, d) work n
times and writes its per-step carry 4 bytes at a time into lines other threads write too.

The heuristic: keep at most `MAX_PARALLEL_AXES` (2) outermost parallel axes; the others become
loops inside each iteration (innermost, contiguous, vectorisable). Sizes are known only when a
program runs, so both variants are built and `use_narrow` picks the narrow one when its parallel
axes still give every thread at least `MIN_ITERATIONS_PER_THREAD` iterations. On two cores the
narrow variant ran Mamba-1's carries and its adjoint core several times faster than the fully
parallel one; see bench/results/2026-11-27-from-code-comments.md.
"""

from __future__ import annotations

from dataclasses import replace

from ...lowering.kernel import Lowered
from ...lowering.plan import build_kernel

MAX_PARALLEL_AXES = 2
MIN_ITERATIONS_PER_THREAD = 4
SUFFIX = "_narrow"


def narrow(lowered: Lowered) -> Lowered | None:
    """`lowered` with kernels parallel over at most MAX_PARALLEL_AXES axes; None when none has more."""
    if not any(len(k.parallel) > MAX_PARALLEL_AXES for k in lowered.kernels):
        return None
    kernels = [build_kernel(k.name + SUFFIX, k.program, k.parallel[:MAX_PARALLEL_AXES], time_blocks=k.time_blocks,
                            store_prev=k.store_prev, blocked_init=k.blocked_init)
               if len(k.parallel) > MAX_PARALLEL_AXES else k for k in lowered.kernels]
    return replace(lowered, kernels=kernels)


def use_narrow(narrowed: Lowered, sizes: dict[str, int], threads: int) -> bool:
    """Whether the narrowed kernels still have enough parallel iterations for `threads` threads."""
    for k in narrowed.kernels:
        if k.name.endswith(SUFFIX):
            iterations = 1
            for a in k.parallel:
                iterations *= sizes[a]
            if iterations < MIN_ITERATIONS_PER_THREAD * threads:
                return False
    return True

"""Rows of a recurrence (lowering/split_sum.py, `recurrence_row_axis`; template ``rows.cu.j2``): a
recurrence whose step takes a row statistic (a norm over d) runs a block of G threads per row (b),
each owning every G-th index of the row for the whole sequence, the statistic combined by shuffles
and shared memory (`runner.CudaRunner.row_threads`)."""

from __future__ import annotations

from .base import Launch, Shape, Verdict, threads
from .thread import PerIndex


class Rows(PerIndex):
    """A recurrence with a row statistic a block of threads can share: before any other strategy,
    since a thread per recurrence would walk the whole row alone every step."""

    name = "rows"

    def consider(self, runner, shape: Shape, forced: str | None) -> Verdict:
        can = runner.row_threads(shape.sizes) is not None
        if forced == self.name:
            if not can:
                raise ValueError(f"SSMC_CUDA_STRATEGY=rows: {runner.program.name} has no row statistic a block "
                                 "of threads can share (lowering/split_sum.py)")
            return self.taken(f"forced by SSMC_CUDA_STRATEGY={forced}")
        if forced:
            return self.refused(f"SSMC_CUDA_STRATEGY={forced}")
        if can:
            return self.taken(f"a row statistic over {runner.row_axis} that a block of threads shares")
        return self.refused("no row statistic a block of threads can share")

    def launches(self, runner, shape: Shape) -> list[Launch]:
        k, mapping = runner.lowered.kernels[0], runner.row_threads(shape.sizes)
        return [Launch(k, shape.length, 1, threads(k, shape.sizes) * mapping.groups, mapping, self.name)]


ROWS = Rows()

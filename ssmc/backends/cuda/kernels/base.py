"""What every CUDA strategy is: a rule saying whether it takes a program at a shape (and why), and
the launches it then makes. `select.py` asks the strategies in order; `runner.CudaRunner` builds,
plans and launches what the chosen one says.

    class Strategy:                    # one per module of kernels/
        name = "mine"
        def consider(self, runner, shape, forced) -> Verdict: ...   # taken, and why (or why not)
        def launches(self, runner, shape) -> list[Launch]: ...     # in order; `runner.launches` caches them
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..hardware import WARP
from ..printer import BLOCK, ONE_GROUP, Threads


@dataclass(frozen=True)
class Shape:
    """What a strategy is chosen for: the sizes of the axes, the steps, whether every sequence has
    time contiguous (layouts like "b d t"), whether the lanes kernel may run (the fused backward
    asks without it), and whether a call of one step may take it for its step form (kernels/lanes/step.py:
    not a training step's forward, which saves round carries; the fused backward asks without it)."""

    sizes: dict[str, int]
    length: int
    time_contiguous: bool = False
    lanes: bool = True
    step: bool = True


@dataclass(frozen=True)
class Verdict:
    """A strategy's answer for one shape: taken or not, and the reason `ssmc inspect` prints."""

    strategy: str
    taken: bool
    reason: str


@dataclass(frozen=True)
class Launch:
    """One kernel launch of a run: the kernel, its steps, blocks of time and threads in all (and, for
    the epilogue's kernels, their thread mapping: printer.Threads)."""

    kernel: object
    length: int
    nblk: int
    threads: int
    mapping: Threads = ONE_GROUP
    strategy: str = ""  # the strategy whose `source` prints the kernel ("": the thread-per-index default)

    @property
    def grid(self) -> tuple[int, int]:
        """(blocks, threads per block); a row kernel's blocks hold whole rows, a warp kernel's whose
        warps share a recurrence one recurrence."""
        if self.mapping.lanes:
            return self.threads // self.mapping.block, self.mapping.block
        if self.mapping.warps > 1:
            per = WARP * self.mapping.warps
            return max(1, self.threads // per), per
        if self.mapping.row:
            per = self.mapping.rows_per_block
            rows = self.threads // self.mapping.groups
            return max(1, -(-rows // per)), per * self.mapping.groups
        return max(1, -(-self.threads // BLOCK)), BLOCK


class Strategy:
    """A way of running a program's forward on the GPU (subclasses: kernels/*)."""

    name: str = ""
    prepared = True  # its runs are worked out once per call signature (`prepare`)

    def consider(self, runner, shape: Shape, forced: str | None) -> Verdict:
        """Whether this strategy runs `runner`'s program at `shape`, and why; `forced` is the
        strategy SSMC_CUDA_STRATEGY names (None: the table decides). Raises ValueError where forced
        to run and it cannot."""
        raise NotImplementedError

    def launches(self, runner, shape: Shape) -> list[Launch]:
        """The launches a run makes, in order: by default one per kernel of the lowering, a thread
        per parallel index (an epilogue kernel over blocks of time: `runner.epilogue_launch`)."""
        sizes, length = shape.sizes, shape.length
        return [runner.epilogue_launch(k, sizes, length, shape.time_contiguous) if k.time_blocks
                else Launch(k, length, 1, threads(k, sizes)) for k in runner.lowered.kernels]

    def source(self, runner, k, specs: dict, sizes: dict[str, int], mapping: Threads, length: int | None) -> str:
        """`k`'s module source for these array layouts (`specs`) and thread mapping; `length` (None:
        any) where the source depends on it."""
        raise NotImplementedError

    def prepare(self, runner, seqs, params, initial, sizes: dict[str, int], length: int, out_dtype,
                contiguous: bool):
        """A run for calls like this one (`runner.CudaRunner.prepare`): by default one launch of one
        kernel; None where the runner's general path runs each launch."""
        return runner.prepare_one_launch(seqs, params, initial, sizes, length, out_dtype, contiguous)

    def forced_verdict(self, forced: str) -> Verdict:
        """The verdict where SSMC_CUDA_STRATEGY names `forced`: taken if it names this strategy."""
        if forced == self.name:
            return self.taken(f"forced by SSMC_CUDA_STRATEGY={forced}")
        return self.refused(f"SSMC_CUDA_STRATEGY={forced}")

    def taken(self, reason: str) -> Verdict:
        return Verdict(self.name, True, reason)

    def refused(self, reason: str) -> Verdict:
        return Verdict(self.name, False, reason)


def threads(k, sizes: dict[str, int]) -> int:
    """Threads of a kernel with one per index of its parallel axes."""
    return math.prod(sizes[a] for a in k.parallel)

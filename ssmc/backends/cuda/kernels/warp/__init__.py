"""The warp strategy: a diagonal-linear scan with a warp per recurrence, each lane a block of
consecutive steps whose summaries the lanes combine by shuffles; its fused backward recomputes the
forward's carries round by round from the last.

    analysis.py           the step split into per-step values and a state-major loop (`StateMajor`)
    forward.py            the forward's template context and source (forward.cu.j2)
    backward_analysis.py  the fused backward's plan from the adjoint (`FusedBackward`)
    backward.py           the fused backward's template context and source (backward.cu.j2)
"""

from __future__ import annotations

from .....lowering.time_blocks import TimeBlocks
from ...hardware import WARP
from ...options import options
from ...printer import Threads
from ..base import Launch, Shape, Strategy, Verdict, threads
from .analysis import warp_state_major
from .forward import recurrence_warps_fit, shares_recurrence, warp_source

# The warp kernel's consecutive steps per lane (SSMC_CUDA_STEPS_PER_LANE overrides): 4, or 2 where a
# step reads a sequence along a state's own axis (Mamba-1's B[t, n] for each n): there a warp's load
# of one n touches values K apart, and the kernel is bound by those L1 wavefronts. A state-major warp
# kernel (analysis.py) reads its steps of B[:, n] as one vector and scans each state value across the
# lanes once per round: 4 steps a lane (more spill registers, fewer blocks an SM).
STEPS_PER_LANE = 4
WIDE_STEPS_PER_LANE = 2
STATE_MAJOR_STEPS_PER_LANE = 4
MAX_RECURRENCE_WARPS = 8  # warps of a block sharing one recurrence (`recurrence_warps`)


def lane_steps(tb: TimeBlocks | None) -> int:
    """The warp kernel's steps per lane for the program of the time blocks `tb` (see above)."""
    if tb is None:
        return STEPS_PER_LANE
    if warp_state_major(tb.lane_summary, tb.lane_rescan) is not None:
        return STATE_MAJOR_STEPS_PER_LANE
    return WIDE_STEPS_PER_LANE if reads_along_state_axes(tb.lane_rescan) else STEPS_PER_LANE


def steps_per_lane(default: int = STEPS_PER_LANE) -> int:
    """`default` (a runner's `lane_steps`) unless SSMC_CUDA_STEPS_PER_LANE overrides it."""
    forced = options().steps_per_lane
    return max(1, forced) if forced is not None else default


def ragged(length: int | None, steps: int) -> bool:
    """Whether a warp kernel's last round of 32 x `steps` steps may be partial at `length` (None: any)."""
    return length is None or length % (WARP * steps) != 0


def reads_along_state_axes(k) -> bool:
    """Whether the step `k` reads a sequence along an axis that is not one of its parallel axes."""
    return any(a.role == "seq" and any(ax != "t" and ax not in k.parallel for ax in a.axes) for a in k.arrays)


def recurrence_warps(runner, length: int) -> int:
    """Warps of a block sharing one recurrence in `runner`'s warp kernel at `length` steps: where its
    states are scalars (`forward.shares_recurrence`), as many as the sequence has rounds of one
    warp, a power of two up to `MAX_RECURRENCE_WARPS`; `SSMC_CUDA_RECURRENCE_WARPS` forces it. A
    block's rounds then read `warps` times as many neighbouring steps at once."""
    tb = runner.time_blocks
    if tb is None or not shares_recurrence(tb.lane_rescan, tb.lane_summary):
        return 1
    steps = steps_per_lane(runner.lane_steps)
    fit = recurrence_warps_fit(tb.lane_rescan, tb.lane_summary, steps, 8 if runner.compute == "float64" else 4)
    forced = options().recurrence_warps
    if forced is not None:
        return max(1, min(fit, forced))
    rounds = -(-length // (WARP * steps))
    warps = 1
    while warps * 2 <= min(MAX_RECURRENCE_WARPS, rounds, fit):
        warps *= 2
    return warps


class Warp(Strategy):
    """A diagonal-linear scan whose sequences have time contiguous: whatever the count of
    recurrences, a thread per recurrence would read a line per thread and step, where a warp's lanes
    read neighbouring steps."""

    name = "warp"

    def consider(self, runner, shape: Shape, forced: str | None) -> Verdict:
        if forced:
            return self.forced_verdict(forced)
        if not shape.time_contiguous:
            return self.refused("the sequences do not have time contiguous")
        if shape.length < 2 * WARP:
            return self.refused(f"{shape.length} steps, fewer than two rounds of a warp")
        total = threads(runner.time_blocks.summary, shape.sizes)
        return self.taken(f"a diagonal-linear scan with time contiguous: a warp shares each of the {total} "
                          "recurrences")

    def launches(self, runner, shape: Shape) -> list[Launch]:
        k = runner.time_blocks.lane_rescan
        warps = recurrence_warps(runner, shape.length)
        return [Launch(k, shape.length, 1, threads(k, shape.sizes) * WARP * warps, Threads(warps=warps), self.name)]

    def source(self, runner, k, specs: dict, sizes: dict[str, int], mapping: Threads, length: int | None) -> str:
        steps = steps_per_lane(runner.lane_steps)
        return warp_source(runner.lowered, runner.ctype, k, specs, sizes, runner.time_blocks.lane_summary, steps,
                           mapping, ragged=ragged(length, steps))


WARP_STRATEGY = Warp()

"""The lanes strategy: a recurrence whose states have an axis of their own (Mamba-1's n) split among
the lanes of a group, the per-step sums reduced across them; chunks of steps staged in shared memory.

    analysis.py           which states and sums the lanes split (`StateLanes`)
    forward.py            the forward's template context, block shape and source (forward.cu.j2)
    step.py               the forward's step form for calls of one step: nothing staged (step.cu.j2)
    backward_analysis.py  the lanes backward's plan (`LanesBackward`)
    backward.py           the backward's template context, block shape and source (backward.cu.j2)
"""

from __future__ import annotations

from ...options import options
from ..base import Launch, Shape, Strategy, Verdict, threads
from .forward import CHUNK, lane_blocks, lanes_chunk, lanes_source
from .step import lanes_step_source, step_supported

# The lanes kernel runs where rows x lanes give at least LANES_FILL threads; fewer recurrences want
# the time-parallel warp kernel (bench/results/ has the measurements).
LANES_FILL = 1 << 15


class Lanes(Strategy):
    """A recurrence whose states' own axis its lanes split, with rows x lanes enough to fill the GPU."""

    name = "lanes"

    def consider(self, runner, shape: Shape, forced: str | None) -> Verdict:
        mapping = runner.lane_threads(shape.sizes) if shape.lanes or forced == self.name else None
        if forced == self.name and mapping is None:
            raise ValueError(f"SSMC_CUDA_STRATEGY=lanes: {runner.program.name} has no state axis its lanes can "
                             "split (lanes/analysis.py), or its chunks do not fit shared memory or its step the "
                             "registers (lanes.lanes_block)")
        if not shape.lanes:
            return self.refused("not asked for (the fused backward's choice without the lanes kernel)")
        if forced:
            return self.forced_verdict(forced)
        if mapping is None:
            return self.refused("no state axis the lanes can split, or its chunks do not fit a block")
        chunk = lanes_chunk(runner.state_lanes, shape.sizes, mapping.lanes, 8 if runner.compute == "float64" else 4)
        if chunk < CHUNK and shape.length > chunk:
            # short chunks (a long state axis) for a call of one chunk (a decode step), where the kernel the
            # table gives otherwise keeps a row's states a thread: longer calls keep the scan strategies
            return self.refused(f"chunks of {CHUNK} steps do not fit a block at {runner.state_lanes.axis} = "
                                f"{shape.sizes[runner.state_lanes.axis]}; chunks of {chunk} take calls of at most "
                                f"{chunk} steps")
        total = threads(runner.lowered.kernels[0], shape.sizes) * mapping.lanes
        if shape.step and shape.length == 1 and step_form(runner.lowered.kernels[0]):
            # one step: no time to split, and a thread per recurrence walks its whole state axis alone
            return self.taken(f"one step, the states' axis {runner.state_lanes.axis} split among lanes "
                              f"(the step form, kernels/lanes/step.py): {total} threads")
        if total >= LANES_FILL:
            return self.taken(f"the states' axis {runner.state_lanes.axis} split among lanes: "
                              f"{total} threads (at least {LANES_FILL})")
        return self.refused(f"the states' axis {runner.state_lanes.axis} split among lanes gives {total} threads, "
                            f"fewer than {LANES_FILL}")

    def launches(self, runner, shape: Shape) -> list[Launch]:
        k, mapping = runner.lowered.kernels[0], runner.lane_threads(shape.sizes)
        blocks = lane_blocks(k, shape.sizes, mapping.lanes, mapping.block)
        return [Launch(k, shape.length, 1, blocks * mapping.block, mapping, self.name)]

    def prepare(self, runner, seqs, params, initial, sizes: dict[str, int], length: int, out_dtype,
                contiguous: bool):
        # the lanes kernel writes its outputs along time where the sequences have it contiguous
        return runner.prepare_one_launch(seqs, params, initial, sizes, length, out_dtype, contiguous,
                                         outputs_along_time=True)

    def source(self, runner, k, specs: dict, sizes: dict[str, int], mapping, length: int | None) -> str:
        if length == 1 and step_form(k):  # correct at any length, should another reuse it
            return lanes_step_source(runner.lowered, runner.state_lanes, k, specs, sizes, mapping, runner.ctype)
        return lanes_source(runner.lowered, runner.state_lanes, k, specs, sizes, mapping, runner.ctype)


def step_form(k) -> bool:
    """Whether a call of one step of `k` runs the lanes kernel's step form (kernels/lanes/step.py), no staged
    chunks: unless ``SSMC_CUDA_LANES_STEP=0``, or `k` saves round carries (a training step's forward)."""
    return options().lanes_step is not False and step_supported(k)


LANES = Lanes()

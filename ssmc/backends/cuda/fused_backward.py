"""The fused backward on the GPU (kernels/warp/backward_analysis.py): two launches for a training step.

`forward` runs the forward as the plain forward would (the lanes kernel where `CudaRunner.strategy`
picks it, else the warp kernel), which also writes the carry into every round of the backward
kernel, 32 K' steps (``rounds_<h>``, states × L / (32 K') values: the tape; K' the backward's steps
per lane, `backward_steps_per_lane`); `backward` runs the one kernel that recomputes each round's
carries in registers and runs the adjoint over it, the rounds last first. It applies where the
forward would run as the warp kernel without the lanes kernel (`CudaRunner.strategy`: sequences with
time contiguous, too few recurrences to fill the GPU; `FusedBackwardRunner.applies_at`). A step that
wants only the gradients (`ssmc.grad`'s call) runs the warp kernel without outputs: it reads the
sequences and writes the round carries, so a scan's step moves 7 arrays of its length (a, x; a, x,
the cotangent, grad a, grad x), where the unfused one moves 8. For Mamba-1 at B8 D1536 L2048 N16 the
warp kernel saving rounds ran much slower than the lanes kernel without them, and the backward took
longer still; see bench/results/2026-11-27-from-code-comments.md.

Where the training forward runs as the lanes kernel and the warp kernel's backward does not apply
(sequences with time strided), the backward runs as lanes too (kernels/lanes/backward.py, `backward_lanes`):
the forward saves its carry into every chunk of its steps, the backward is one kernel over the
chunks, last first. A step that wants only the gradients runs that lanes kernel without its outputs
and what only they read (`lanes_summary_kernel`: Mamba-1's sum over n of h C and its post phase go,
C and z are not read), which made that forward faster at B8 D1536 L2048 and at B32 D512 L180; see
bench/results/2026-11-27-from-code-comments.md.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from ...lowering.kernel import Array, Kernel
from ...lowering.plan import build_kernel
from ...lowering.stages import fuse
from ...passes.autodiff import GRAD, Backward
from .arrays import TORCH_DTYPES, as_1d
from .backward_launch import (
    ALIGN,
    BackwardLaunch,
    BufferAllocation,
    PreparedLaunch,
    array_layout,
    backward_arrays,
    forward_arrays,
    in_memory_order_of,
    shaped,
    with_rounds,
    without_outputs,
    without_unread,
)
from .devices import current_device
from .hardware import STATIC_SHARED, WARP
from .kernels.base import Launch
from .kernels.lanes.analysis import StateLanes, state_lanes
from .kernels.lanes.backward import lanes_backward_shape, lanes_backward_source
from .kernels.lanes.backward_analysis import lanes_backward
from .kernels.lanes.forward import lane_groups, lanes_source
from .kernels.warp import ragged, steps_per_lane
from .kernels.warp.analysis import fused_state_major, warp_state_major
from .kernels.warp.backward import fused_backward_shared_bytes, fused_backward_source
from .kernels.warp.backward_analysis import FusedBackward, fused_backward
from .kernels.warp.forward import warp_source
from .options import options
from .printer import BLOCK, ArraySpec, Threads
from .runner import MAX_PLANS, _sizes_key, lane_block_count, runner_for, time_contiguous

# The backward kernel's consecutive steps per lane where the adjoint adds per-step terms atomically
# and runs step-major (SSMC_CUDA_BACKWARD_STEPS_PER_LANE overrides): one, where the forward takes 4,
# so a warp's atomic adds go to neighbouring steps (one line), and fewer registers (168 against 254
# for Mamba-1). One step a lane beat 2 and 4 for Mamba-1 at B8 D1536 L2048 N16 (see
# bench/results/2026-11-27-from-code-comments.md).
# Without atomic adds (a scan), or state-major (a lane's steps added as one vector), the forward's.
ATOMIC_STEPS_PER_LANE = 1

# The state-major backward's time per step relative to the step-major one's, measured for Mamba-1 N16
# at B8 D1536 L2048 and, per step of the padded lengths, at B32 D512 L180 (two rounds of 128 steps, the
# second 52 steps, against six of 32); see bench/results/2026-11-27-from-code-comments.md.
# Its rounds are 4 times longer where the step-major kernel takes one step per lane, so a
# short sequence wastes more of its last round: it runs where its padded length, at this cost, is
# at most the step-major kernel's.
STATE_MAJOR_STEP_COST = 0.65
# The state-major backward with half the forward's steps per lane (rounds half as long) costs this
# much more per step; it runs where its padded length, at this cost, is less than the full rounds'.
# Measured with bench/host_profile.py on Mamba-1 B32 D512 L180 N16, 2 steps a lane (192 padded steps)
# against 4 (256), per padded step; see bench/results/2026-11-27-from-code-comments.md.
HALF_ROUND_STEP_COST = 1.12


# The lanes backward (kernels/lanes/backward.py) runs wherever the training forward runs as the lanes kernel
# (at least kernels.lanes.LANES_FILL threads: 8192 rows of Mamba-1's 4 lanes), in place of the warp kernel's
# fused backward ("b d t") or the unfused backward's kernels ("b t d"). For Mamba-1 N16 fp32 "b d t"
# the training step (`ssmc.grad`) with the lanes backward beat the one with the warp kernel's fused
# backward at every shape bench/lanes_backward.py measured, B2 to B64 and L180 to L2048. (Before its
# bounded kernel of 16-step chunks, with rows fewer than 16384, the warp kernel's was ahead from L256.)
# See bench/results/2026-11-27-from-code-comments.md.

# An adjoint without sums over the recurrences (a scan's: h = a h + x) takes the fused backward where
# there are at least this many recurrences and steps; elsewhere the unfused backward's two warp
# kernels, which share a recurrence among up to 8 warps, are faster. The step moves an array less:
# through the op (outputs wanted) the forward writes no carries; through `ssmc.grad` (gradients only)
# its forward writes nothing per step (`summary_kernel`). `ssmc.grad`'s step of the scan, "b d t",
# fp32, was faster fused than unfused at B8 D2048 L4096, B16 D1024 L2048, B2 D2048 L4096, B8 D512
# L1024 and B4 D2048 L4096; slower at B32 D512 L180 (on both machines measured) and at B2 D512 L4096
# (1024 recurrences; not settled: the machine that had it slower had a slow host, the other had it faster).
# Through the op at B8 D2048 L4096 fused was faster too. See bench/results/2026-11-27-from-code-comments.md.
FUSED_SCAN_RECURRENCES = 4096
FUSED_SCAN_LENGTH = 1024


def backward_steps_per_lane(plan: FusedBackward, forward_steps: int, state_major: bool,
                            length: int | None = None, fits=None) -> int:
    """The backward kernel's steps per lane; `forward_steps`: the forward warp kernel's. State-major
    at `length`, half of them where the shorter rounds waste less of the last one, or where `fits`
    (steps -> whether the kernel's shared memory fits, `FusedBackwardRunner.fits`) says the full
    rounds do not fit."""
    forced = options().backward_steps_per_lane
    if forced is not None:
        return max(1, forced)
    if not state_major:
        return forward_steps if not plan.partials.atomic else ATOMIC_STEPS_PER_LANE
    half = forward_steps // 2  # at least 2 (one step a lane state-major is unmeasured)
    if half >= 2 and ((length is not None and padded(length, half) * HALF_ROUND_STEP_COST
                       < padded(length, forward_steps)) or (fits is not None and not fits(forward_steps))):
        return half
    return forward_steps


def padded(length: int, steps: int) -> int:
    """`length` padded to whole rounds of the backward kernel at `steps` per lane."""
    return -(-length // (WARP * steps)) * WARP * steps


class FusedBackwardRunner:
    """The fused backward of one derived backward, built per shape and cached (`runner_for`)."""

    def __init__(self, bw: Backward, plan: FusedBackward, compute: str):
        self.bw = bw
        self.plan = plan
        self.compute = compute
        self.forward_runner = runner_for(bw.forward, compute)
        fwd = bw.forward
        self.forward_kernel = with_rounds(build_kernel(f"{fwd.name}_warp_rounds", fwd, plan.parallel))
        # the same without the outputs, for a step that wants the gradients only (`ssmc.grad`'s call):
        # it reads the sequences and writes the round carries and final states, nothing per step.
        # Built from the same program, its stores of the outputs dropped, so that its values keep the
        # names the forward's summary gives them (the compiler drops what only the outputs read);
        # only where the warp kernel is not state-major.
        summary = with_rounds(without_outputs(build_kernel(f"{fwd.name}_warp_summary_rounds", fwd,
                                                             plan.parallel)))
        tb = self.forward_runner.time_blocks
        scalar = tb is not None and warp_state_major(tb.lane_summary, summary) is None
        self.summary_kernel: Kernel | None = summary if scalar else None
        # the same forward as the lanes kernel (lanes.py), where the plain forward runs so
        self.lanes_kernel = with_rounds(build_kernel(f"{fwd.name}_lanes_rounds", fwd, plan.parallel))
        self.lanes: StateLanes | None = state_lanes(self.lanes_kernel)
        # the lanes kernel without the outputs, for a step that wants the gradients only: the values
        # only the outputs read go too (Mamba-1's sum over n of h C, its post phase; C and z unread)
        self.lanes_summary_kernel: Kernel | None = None if self.lanes is None else with_rounds(without_unread(
            without_outputs(build_kernel(f"{fwd.name}_lanes_summary_rounds", fwd, plan.parallel))))
        self.lanes_summary: StateLanes | None = (None if self.lanes_summary_kernel is None
                                                 else state_lanes(self.lanes_summary_kernel))
        # the backward as lanes too (kernels/lanes/backward_analysis.py), where the forward runs as the lanes kernel
        self.lanes_backward = None if self.lanes is None else lanes_backward(plan, self.lanes)
        self._plans: dict[tuple, BackwardLaunch] = {}  # launches by kernel, sizes, layouts and overrides
        self._decisions: dict[tuple, object] = {}  # applies_at, forward_lanes by shape and overrides
        self.can_run_state_major = fused_state_major(plan) is not None
        self._shared: dict[tuple[int, bool], int] = {}  # (steps a lane, state-major) -> the kernel's shared bytes

    def applies(self, seqs: dict, sizes: dict[str, int], length: int) -> bool:
        """Whether the forward runs as the warp kernel for these sequences (module docstring)."""
        return self.applies_at(sizes, length, time_contiguous(seqs))

    def applies_at(self, sizes: dict[str, int], length: int, time_contiguous: bool) -> bool:
        """See the module docstring: where the forward is the warp kernel, or where the lanes backward
        runs (`backward_lanes`); `SSMC_CUDA_FUSED_BACKWARD` = 0 / 1 turns it off / on wherever it can
        run. An adjoint without sums over the recurrences (a scan's) takes the warp kernel's where a
        warp per recurrence fills the GPU over a long sequence (`FUSED_SCAN_RECURRENCES`,
        `FUSED_SCAN_LENGTH`)."""
        return self._decided("applies", lambda: self._applies_at(sizes, length, time_contiguous), sizes, length,
                             time_contiguous)

    def _decided(self, what: str, decide, sizes: dict[str, int], length: int, time_contiguous: bool):
        """`decide()` once per shape and setting of the overrides (asked on every training step)."""
        key = (what, _sizes_key(sizes), length, time_contiguous, *options().key)
        if key not in self._decisions:
            if len(self._decisions) >= MAX_PLANS:  # ever new lengths or shapes: start over
                self._decisions.clear()
            self._decisions[key] = decide()
        return self._decisions[key]

    def _applies_at(self, sizes: dict[str, int], length: int, time_contiguous: bool) -> bool:
        if options().fused_backward is False:
            return False
        return (self._warp_applies_at(sizes, length, time_contiguous)
                or self.backward_lanes(sizes, length, time_contiguous) is not None)

    def _warp_applies_at(self, sizes: dict[str, int], length: int, time_contiguous: bool) -> bool:
        """Whether the warp kernel's fused backward runs at this shape (`applies_at`, the lanes backward aside)."""
        forced = options().fused_backward
        if self.round_steps(length) % self.forward_steps() or not self.fits(length):
            return False  # a forward lane's steps would straddle two rounds, or too big a block
        partials = self.plan.partials
        if forced is not True and not (partials.atomic or partials.accumulators) and (
                math.prod(sizes[a] for a in self.plan.parallel) < FUSED_SCAN_RECURRENCES
                or length < FUSED_SCAN_LENGTH):
            return False
        # the warp kernel's layouts and lengths (the training forward may run as the lanes kernel)
        return self.forward_runner.strategy(sizes, length, time_contiguous, lanes=False) == "warp"

    def forward_lanes(self, sizes: dict[str, int], length: int, time_contiguous: bool) -> Threads | None:
        """The lanes kernel's threads where a training step's forward runs as it: where the plain
        forward does (`CudaRunner.strategy`), the lanes kernel's step form aside (a call of one step takes
        it wherever the lanes run; the training forward saves round carries, which it does not);
        None where the forward runs as the warp kernel."""
        def decide():
            fr = self.forward_runner
            if self.lanes is None or fr.strategy(sizes, length, time_contiguous, step=False) != "lanes":
                return None
            return fr.lane_threads(sizes)
        return self._decided("lanes", decide, sizes, length, time_contiguous)

    def backward_lanes(self, sizes: dict[str, int], length: int, time_contiguous: bool) -> Threads | None:
        """The lanes backward's threads (kernels/lanes/backward.py: its lanes, block and chunk) where
        it runs at this shape: the training forward runs as the lanes kernel (`forward_lanes`), the
        backward splits so and its block's shared memory fits; SSMC_CUDA_LANES_BACKWARD = 0 turns it
        off (the warp kernel's fused backward, or the unfused backward, runs instead). None elsewhere."""
        def decide():

            lanes = self.forward_lanes(sizes, length, time_contiguous)
            if lanes is None or self.lanes_backward is None or options().lanes_backward is False:
                return None
            rows = math.prod(sizes[a] for a in self.plan.parallel)
            value_bytes = 8 if self.compute == "float64" else 4
            shape = lanes_backward_shape(self.lanes_backward, sizes, self.lanes.axis, value_bytes, rows)
            if shape is None:
                return None
            block, chunk = shape
            return Threads(lanes=lane_groups(sizes[self.lanes.axis]), block=block, chunk=chunk)
        return self._decided("lanes backward", decide, sizes, length, time_contiguous)

    def sources(self, sizes: dict[str, int], length: int, time_contiguous: bool = True) -> list[tuple[Launch, str]]:
        """The two kernels' launches and sources at these sizes, chosen as for sequences with time
        contiguous or not, arrays laid out as the runs allocate them (what `ssmc inspect` reports)."""
        back = self.backward_lanes(sizes, length, time_contiguous)
        rounds = -(-length // self.round_steps(length, back))
        threads = int(np.prod([sizes[a] for a in self.plan.parallel])) * WARP
        lanes = self.forward_lanes(sizes, length, time_contiguous)
        out = []
        forward = (self.forward_kernel, self._forward_source) if lanes is None else (
            self.lanes_kernel, lambda specs, sizes, length: self._lanes_source(specs, sizes, length, lanes,
                                                                               back))
        backward = (self.plan, self._backward_source) if back is None else (
            self.plan, lambda specs, sizes, length: self._lanes_backward_source(specs, sizes, back))
        kernels = [forward, backward]
        if lanes is None and self.summary_kernel is not None:  # a step that wants the gradients only
            kernels.append((self.summary_kernel, self._summary_source))
        elif lanes is not None and self.lanes_summary is not None:
            kernels.append((self.lanes_summary_kernel, lambda specs, sizes, length: self._lanes_source(
                specs, sizes, length, lanes, back, summary=True)))
        for k, source in kernels:
            specs = {a.name: ArraySpec(self.compute, array_layout(a, sizes, length, rounds)[1] or (1,))
                     for a in k.arrays}
            if k is self.lanes_kernel or k is self.lanes_summary_kernel:
                launch = Launch(k, length, 1, lane_block_count(k, sizes, lanes) * lanes.block, lanes)
            elif k is self.plan and back is not None:
                launch = Launch(k, length, 1, lane_block_count(self.lanes_kernel, sizes, back) * back.block, back)
            else:
                launch = Launch(k, length, 1, threads)
            out.append((launch, source(specs, sizes, length)))
        return out

    def state_major(self, length: int) -> bool:
        """Whether the backward kernel runs state-major (kernels/warp/analysis.py, `FusedStateMajor`) at
        `length`: where it can and its rounds cost less (`STATE_MAJOR_STEP_COST`);
        SSMC_CUDA_STATE_MAJOR_BACKWARD = 0 / 1 turns it off / on wherever it can run."""
        forced = options().state_major_backward
        if not self.can_run_state_major or forced is False:
            return False
        step_major = backward_steps_per_lane(self.plan, self.forward_steps(), False)
        steps = backward_steps_per_lane(self.plan, self.forward_steps(), True, length, self.fits_state_major)
        if forced is not True and not self.fits_state_major(steps):
            return False  # its rounds' staging and block sums take more shared memory than a block has
        cost = STATE_MAJOR_STEP_COST * (HALF_ROUND_STEP_COST if steps < self.forward_steps() else 1.0)
        return forced is True or padded(length, steps) * cost <= padded(length, step_major)

    def backward_steps(self, length: int, major: bool | None = None) -> int:
        """The backward kernel's steps per lane at `length` (`major`: `state_major(length)`, if known)."""
        major = self.state_major(length) if major is None else major
        return backward_steps_per_lane(self.plan, self.forward_steps(), major, length,
                                       self.fits_state_major if major else None)

    def fits(self, length: int) -> bool:
        """Whether the backward kernel chosen at `length` fits a block's static shared memory: a program
        with many sequences per step or summed arrays may not (it would not compile)."""
        major = self.state_major(length)
        return self._fits(self.backward_steps(length, major), major)

    def fits_state_major(self, steps: int) -> bool:
        return self._fits(steps, True)

    def _fits(self, steps: int, state_major: bool) -> bool:
        key = (steps, state_major)
        if key not in self._shared:
            value_bytes = 8 if self.compute == "float64" else 4
            self._shared[key] = fused_backward_shared_bytes(self.plan, value_bytes, steps, state_major)
        return self._shared[key] <= STATIC_SHARED

    def round_steps(self, length: int, back: Threads | None = None) -> int:
        """Steps per round of the backward kernel: the forward saves its carry every so many steps (a
        chunk of the lanes backward's, where `back`, its threads, says it runs)."""
        return back.chunk if back is not None else WARP * self.backward_steps(length)

    def forward_steps(self) -> int:
        """The forward warp kernel's steps per lane."""
        return steps_per_lane(self.forward_runner.lane_steps)

    # -- the two launches ----------------------------------------------------------------------
    def forward(self, seqs, params, initial, sizes, length, outputs: bool = True):
        """(outputs, finals, rounds): the forward's results (time first, time contiguous) and the
        carry into each round, ``rounds[<h>]`` with the round first. Without `outputs` the warp
        kernel writes none where it can (`summary_kernel`: empty outputs; else it, or the lanes
        kernel, writes them anyway)."""
        return self.prepare_forward(seqs, params, initial, sizes, length, outputs)(seqs, params, initial)

    def prepare_forward(self, seqs, params, initial, sizes, length, outputs: bool = True):
        """`forward` worked out for calls like this one (arrays of the same dtypes and strides):
        ``call(seqs, params, initial) -> (outputs, finals, rounds)`` that only allocates and launches."""
        given = forward_arrays(seqs, params, initial)
        lanes = self.forward_lanes(sizes, length, time_contiguous(seqs))
        back = self.backward_lanes(sizes, length, time_contiguous(seqs))
        summary = not outputs and (self.summary_kernel if lanes is None else self.lanes_summary) is not None
        if lanes is None:
            k = self.summary_kernel if summary else self.forward_kernel
            plan = self._planned(k, given, sizes, length, self._summary_source if summary else self._forward_source)
        else:
            k = self.lanes_summary_kernel if summary else self.lanes_kernel
            plan = self._planned(k, given, sizes, length, lambda specs, sizes, length: self._lanes_source(
                specs, sizes, length, lanes, back, summary), (lane_block_count(k, sizes, lanes), lanes.block), back)
        p = self.bw.forward
        outs = [] if summary else [(n, f"out_{n}") for n, _ in p.outputs]
        finals = [(s.name, f"final_{s.name}", plan.reshaped(f"final_{s.name}", [sizes[a] for a in s.axes]))
                  for s in p.states]
        rounds = [(s.name, f"rounds_{s.name}") for s in p.states]

        def call(seqs, params, initial):
            made = plan.run(forward_arrays(seqs, params, initial), length)
            return ({n: made[a] for n, a in outs}, {n: shaped(made[a], shape) for n, a, shape in finals},
                    {n: made[a] for n, a in rounds})
        return PreparedLaunch(call, plan, length)

    def backward(self, seqs, params, rounds, cotangents, grad_states, grad_params, sizes, length):
        """(gradients of the sequences [t, ...], final adjoint states): `grad_states` is the cotangent
        of the forward's final states (grad_<h>), `grad_params` what the param gradients start from
        (added into, in place; zeros allocated for those not given)."""
        return self.prepare_backward(seqs, params, rounds, cotangents, grad_states, grad_params, sizes, length)(
            seqs, params, rounds, cotangents, grad_states, grad_params)

    def prepare_backward(self, seqs, params, rounds, cotangents, grad_states, grad_params, sizes, length):
        """`backward` worked out for calls like this one: ``call(seqs, params, rounds, cotangents,
        grad_states, grad_params) -> (gradients, finals)`` that only allocates and launches."""
        plan = self.plan
        given = backward_arrays(seqs, params, rounds, cotangents, grad_states, grad_params)
        back = self.backward_lanes(sizes, length, time_contiguous(seqs))
        if back is None:
            launch = self._planned(plan, given, sizes, length, self._backward_source)
        else:
            launch = self._planned(plan, given, sizes, length,
                                   lambda specs, sizes, length: self._lanes_backward_source(specs, sizes, back),
                                   (lane_block_count(self.lanes_kernel, sizes, back), back.block), back)
        adjoint = plan.adjoint.program
        outs = [(n, f"out_{n}") for n, _ in adjoint.outputs]
        core = [(n, f"final_{n}", launch.reshaped(f"final_{n}", [sizes[a] for a in adjoint.decl(n).axes]))
                for n in plan.core]
        accumulators = [(n, f"final_{n}") for n in plan.partials.accumulators]

        def call(seqs, params, rounds, cotangents, grad_states, grad_params):
            made = launch.run(backward_arrays(seqs, params, rounds, cotangents, grad_states, grad_params), length)
            finals = {n: shaped(made[a], shape) for n, a, shape in core}
            finals.update((n, made[a]) for n, a in accumulators)
            return {n: made[a] for n, a in outs}, finals
        return PreparedLaunch(call, launch, length)

    # -- building and launching ----------------------------------------------------------------
    def _forward_source(self, specs: dict[str, ArraySpec], sizes: dict[str, int], length: int,
                        kernel: Kernel | None = None) -> str:
        ctype = "double" if self.compute == "float64" else "float"
        fr = self.forward_runner
        return warp_source(fr.lowered, ctype, kernel or self.forward_kernel, specs, sizes, fr.time_blocks.lane_summary,
                           self.forward_steps(), round_steps=self.round_steps(length),
                           ragged=ragged(length, self.forward_steps()))

    def _summary_source(self, specs: dict[str, ArraySpec], sizes: dict[str, int], length: int) -> str:
        return self._forward_source(specs, sizes, length, self.summary_kernel)

    def _lanes_source(self, specs: dict[str, ArraySpec], sizes: dict[str, int], length: int,
                      lanes: Threads, back: Threads | None, summary: bool = False) -> str:
        """The lanes kernel's source (`summary`: the one without outputs, `lanes_summary_kernel`)."""
        ctype = "double" if self.compute == "float64" else "float"
        split, k = (self.lanes_summary, self.lanes_summary_kernel) if summary else (self.lanes, self.lanes_kernel)
        return lanes_source(self.forward_runner.lowered, split, k, specs, sizes, lanes, ctype,
                            self.round_steps(length, back))

    def _lanes_backward_source(self, specs: dict[str, ArraySpec], sizes: dict[str, int], threads: Threads) -> str:
        ctype = "double" if self.compute == "float64" else "float"
        return lanes_backward_source(self.plan, self.lanes_backward, self.lanes, specs, sizes, threads.block, ctype,
                                     threads.chunk)

    def _backward_source(self, specs: dict[str, ArraySpec], sizes: dict[str, int], length: int) -> str:
        ctype = "double" if self.compute == "float64" else "float"
        return fused_backward_source(self.plan, ctype, specs, sizes, self.backward_steps(length),
                                     self.state_major(length))

    def _planned(self, k, given: dict, sizes: dict[str, int], length: int, source,
                 grid: tuple[int, int] | None = None, back: Threads | None = None) -> BackwardLaunch:
        """The launch of kernel `k` (a `Kernel` or the `FusedBackward`) over its arrays: those in
        `given` as they are, the others allocated (per-step ones with time contiguous; ``atomic``
        ones and accumulators not given zeroed). `grid`: (blocks, threads a block); by default a
        warp per recurrence. `back`: the lanes backward's threads where it runs (its chunks are the
        forward's rounds). Worked out once per kernel, sizes, length, layouts of the given arrays,
        overrides and device (`_plan_launch`; its function is loaded there)."""
        key = (k.name, back, _sizes_key(sizes), length,
               tuple(None if t is None else (t.dtype, t.stride()) for t in (given.get(a.name) for a in k.arrays)),
               current_device(), *options().key)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= MAX_PLANS:
                self._plans.clear()
            plan = self._plans[key] = self._plan_launch(k, given, sizes, length, source, grid, back)
        return plan

    def _plan_launch(self, k, given: dict, sizes: dict[str, int], length: int, source,
                     grid: tuple[int, int] | None, back: Threads | None) -> BackwardLaunch:
        import torch

        state = torch.float64 if self.compute == "float64" else torch.float32
        rounds = -(-length // self.round_steps(length, back))
        allocations, kept, specs = [], [], {}
        offset = {False: 0, True: 0}  # elements of the buffers allocated so far: plain, zeroed
        for a in k.arrays:
            if a.name in given:
                t = given[a.name]
                if a.role in ("accumulate", "final"):
                    kept.append(a.name)
                specs[a.name] = ArraySpec(TORCH_DTYPES[str(t.dtype)], tuple(as_1d(t).stride()))
                continue
            shape, strides, size = array_layout(a, sizes, length, rounds)
            like = self._laid_out_like(k, a, given, back)
            if like is not None and like.dim() == len(shape) and like.stride(0) != 1:
                strides = in_memory_order_of(like, shape)  # written where the caller wants it (below)
            zeroed = a.role in ("atomic", "accumulate")
            allocations.append(BufferAllocation(a.name, tuple(shape), strides, offset[zeroed], zeroed))
            offset[zeroed] += -(-size // ALIGN) * ALIGN
            specs[a.name] = ArraySpec(TORCH_DTYPES[str(state)], tuple(strides) or (1,))
        fn = self.forward_runner.function(source(specs, sizes, length), k.name)
        if grid is None:
            threads = math.prod(sizes[a] for a in self.plan.parallel) * WARP
            grid = (max(1, -(-threads // BLOCK)), BLOCK)
        # one buffer: the plain arrays, then the zeroed ones
        allocations = [replace(a, offset=a.offset + offset[False]) if a.zeroed else a for a in allocations]
        return BackwardLaunch(fn, grid, tuple(a.name for a in k.arrays), tuple(allocations), tuple(kept),
                               offset[False], offset[True], state)


    def _laid_out_like(self, k, a: Array, given: dict, back: Threads | None):
        """The given sequence in whose memory order array `a` of kernel `k` is allocated where that
        sequence has time strided (`in_memory_order_of`), or None: a sequence's gradient from the lanes
        backward, the sequence itself; an output of the lanes forward (with outputs), a sequence of the
        same axes."""
        if a.role != "out":
            return None
        if k is self.plan and back is not None:
            return given.get(a.name[len("out_" + GRAD):])
        if k is self.lanes_kernel:
            return next((given[b.name] for b in k.arrays if b.role == "seq" and b.axes == a.axes), None)
        return None


_RUNNERS: dict[tuple, FusedBackwardRunner | None] = {}


def fused_backward_runner(bw: Backward, compute: str = "float32") -> FusedBackwardRunner | None:
    """The fused backward of `bw`, or None where it does not apply: a forward run in fusion stages
    (lowering/stages.py), or one that kernels/warp/backward_analysis.py cannot fuse."""
    key = (bw.forward, bw.adjoint, compute)
    if key not in _RUNNERS:
        plan = None if fuse(bw.forward).staged or fuse(bw.adjoint).staged else fused_backward(bw)
        _RUNNERS[key] = None if plan is None else FusedBackwardRunner(bw, plan, compute)
    return _RUNNERS[key]


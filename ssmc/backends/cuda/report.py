"""What the CUDA backend generates for a program at given sizes: kernels, launches, ptxas resources.

Used by ``ssmc inspect`` and ``ssmc show --stage cuda``; needs no GPU. Every kernel the forward and
the gradient (`ssmc.grad`'s recompute and adjoint programs, or its fused backward; per fusion stage
of a staged layer) launch, through their fusion stages (`lowering/stages.py`), is rendered with
contiguous arrays (the layout "t ...") in the given input dtype, written to the source cache, and
compiled by NVRTC for `arch` when `nvrtc.available()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...autograd import default_chunk
from ...passes.autodiff import derive_backward
from ...runtime.cache import store
from ...runtime.random_inputs import default_sizes
from . import nvrtc
from .fused_backward import fused_backward_runner
from .hoisted import hoisted_runner
from .kernels.base import Launch
from .kernels.chunk import chunk_size, chunked_core
from .kernels.step_loop import step_loop
from .options import options
from .printer import ArraySpec, contiguous_strides
from .runner import MAX_LOCAL_BYTES, CudaRunner, one_kernel
from .source import compile_options


@dataclass
class KernelReport:
    """One generated kernel: where it comes from, how it is launched, what ptxas said."""

    program: str              # forward | recompute | adjoint; or forward (training) | backward (fused)
    strategy: str             # fused | split | map | time blocks | warp; "post: map" in a fusion stage
    launch: Launch
    source: str
    path: str                 # the source file in the cache
    resources: nvrtc.KernelResources | None = None
    error: str = ""           # why `resources` is missing
    reason: str = ""          # why the strategy was chosen

    @property
    def name(self) -> str:
        return self.launch.kernel.name


DEFAULT_LENGTH = 1024


def _specs(launch: Launch, sizes: dict[str, int], dtype: str, compute: str,
           time_contiguous: bool = False) -> dict[str, ArraySpec]:
    """The layouts `CudaRunner.run` gives the kernel's arrays: time outermost, or (`time_contiguous`)
    time innermost for sequences and per-step results; split-K partials one copy per group."""
    specs = {}
    groups = launch.mapping.groups
    for a in launch.kernel.arrays:
        shape = [launch.length if ax == "t" else launch.nblk if ax == "block" else sizes[ax] for ax in a.axes]
        io = a.role in ("seq", "param", "init", "out")
        partial = groups > 1 and not launch.mapping.row and a.role in ("out", "final")
        if time_contiguous and a.role in ("seq", "out", "prev") and len(shape) > 1:
            inner = contiguous_strides([*shape[1:], shape[0]])
            strides = (inner[-1], *inner[:-1])
        else:
            strides = contiguous_strides(shape or [1])
        group_stride = int(np.prod(shape)) if partial else 0
        specs[a.name] = ArraySpec(compute if partial or not io else dtype, strides, group_stride)
    return specs


def kernel_reports(program, sizes: dict[str, int], length: int, dtype: str = "float32", arch: str = "sm_90",
                   backward: bool = True, compile_kernels: bool = True,
                   time_contiguous: bool = False) -> list[KernelReport]:
    """Reports for the kernels of `program`'s forward (and gradient) at `sizes` and `length` steps,
    for sequences with time outermost, or contiguous (`time_contiguous`: layouts like "b d t").

    The gradient's kernels are those `ssmc.grad` runs: of a staged program, each stage's gradient
    (`grad_stages.py`), labelled with the stage's kind."""
    compute = "float64" if dtype == "float64" else "float32"
    common = (sizes, time_contiguous, dtype, compute, arch, compile_kernels)
    reports = _program_reports("forward", program, length, "", *common)
    if backward and one_kernel(_stages(program), compute, sizes, length, time_contiguous):
        # a training step's forward runs the stages: each stage's backward reads its own tape
        reports += _program_reports("forward (training)", program, length, "", *common, whole=False)
    if backward:
        stages = _stages(program).stages
        for stage in stages:
            if _torch_path(stage.program, compute):  # its gradient's programs run so too (path_notes)
                continue
            kind = f"{stage.kind}: " if len(stages) > 1 else ""
            reports += _gradient_reports(stage.program, kind, length, *common)
    return reports


def _stages(program):
    """The programs the CUDA backend runs `program` as (`CudaBackend.stages`)."""
    from .backend import cuda_stages

    return cuda_stages(program)


def _step_loop(program, compute: str):
    """The step loop `program` runs as (after its hoisted products, where it has any), or None."""
    hoisted = hoisted_runner(program, compute)
    return step_loop(program, compute) if hoisted is None else hoisted.loop


def _torch_path(program, compute: str) -> bool:
    """Whether `program` runs as torch matrix products (kernels/chunk/, kernels/step_loop.py), not as
    generated kernels."""
    return chunked_core(program, compute) is not None or _step_loop(program, compute) is not None


def _chunk_choice(ml, sizes: dict[str, int], length: int, dtype, gpu) -> str:
    """How the kernels' chunk was chosen, for `path_notes`: the times of the candidates where tuned on `gpu`."""
    from .kernels.chunk import tune
    from .options import options

    if options().chunk is not None:
        return " (SSMC_CUDA_CHUNK)"
    heads = int(np.prod([sizes[h] for h in ml.heads]))
    found = None if gpu is None else tune.tuned(length, heads, sizes[ml.key], sizes[ml.value], dtype, gpu)
    if found is not None:
        return " (autotuned: " + ", ".join(f"{c} {ms:.3f} ms" for c, ms in sorted(found[1].items())) + ")"
    choices = tune.candidates(length)
    if len(choices) == 1:
        return ""
    return f" (the rule's; SSMC_CUDA_CHUNK_TUNE=1 times {', '.join(map(str, choices))} on a GPU at first use)"


def path_notes(program, sizes: dict[str, int], length: int, dtype: str = "float32") -> list[str]:
    """How the parts of `program` that run as torch matrix products run (the chunked matrix-linear core,
    the step loop of a recurrent product), one line each; [] where none does."""
    compute = "float64" if dtype == "float64" else "float32"
    lines = []
    for stage in _stages(program).stages:
        core = chunked_core(stage.program, compute)
        if core is not None:
            import torch

            half = getattr(torch, dtype) if dtype in ("bfloat16", "float16") else None
            ml = core.ml
            kernels = half is not None and core.kernels_wanted(half, sizes)
            gpu = torch.device("cuda") if kernels and torch.cuda.is_available() else None
            c = chunk_size(ml, sizes, length, half, gpu)  # (on a GPU: tuned here where not yet)
            chosen = _chunk_choice(ml, sizes, length, half, gpu) if kernels and not ml.per_key else ""
            if kernels and ml.per_key:
                how = ("its forward and its VJP as the per-key tensor-core kernels (SSMC_CUDA_CHUNK_PER_KEY=0: torch; "
                       "SSMC_CUDA_CHUNK_BACKWARD=0: the VJP as torch)")
            elif kernels:
                how = ("its forward and its VJP as tensor-core kernels (SSMC_CUDA_CHUNK_KERNELS=0: torch; "
                       "SSMC_CUDA_CHUNK_BACKWARD=0: the VJP as torch)")
            else:
                how = "as batched torch matrix products (forward and VJP)"
            heads = int(np.prod([sizes[h] for h in ml.heads]))
            lines.append(f"chunked: {stage.program.name} ({ml.describe()}) runs as chunks of {c} steps{chosen}: "
                         f"{heads} heads x {-(-length // c)} chunks, state {sizes[ml.key]} x {sizes[ml.value]}, {how}; "
                         "the table lists the kernels of the stages around it (SSMC_CUDA_CHUNKED=0: the element-wise "
                         "scan)")
        loop = _step_loop(stage.program, compute)
        if loop is not None:
            hoisted = hoisted_runner(stage.program, compute)
            around = f" ({hoisted.describe()})" if hoisted is not None else ""
            lines.append(f"step loop: {stage.program.name}: {loop.describe}{around}; {length} steps, its gradient's"
                         " programs the same way (SSMC_CUDA_STEP_LOOP=0: the kernels)")
            # the adjoint as it runs: its own stages' (a LayerNorm's statistics of state-free values before it)
            adjoint = next((found for part in _stages(derive_backward(stage.program).adjoint).stages
                            if (found := _step_loop(part.program, compute)) is not None), None)
            for role, runs in (("forward", loop), ("adjoint", adjoint)):
                if hasattr(runs, "plan_for"):  # a persistent runner: its split of these sizes, or why none
                    chosen = runs.plan_for({**dict(runs.program.sizes), **sizes}, dtype in ("bfloat16", "float16"))
                    what = f"refused ({chosen}): the step loop" if isinstance(chosen, str) else chosen.describe()
                    lines.append(f"persistent {role}: {runs.program.name}: {what}")
    return lines


def _gradient_reports(program, kind: str, length: int, sizes, time_contiguous: bool, dtype: str, compute: str,
                      arch: str, compile_kernels: bool) -> list[KernelReport]:
    """The kernels of one (unstaged) program's gradient: the fused backward's two where it applies,
    else the recompute and the adjoint over the chunks `ssmc.grad` takes on the GPU."""
    bw = derive_backward(program)
    fused = fused_backward_runner(bw, compute)
    if fused is not None and fused.applies_at(sizes, length, time_contiguous):
        # a training step's kernels: the forward saving round carries, the fused backward, and (a scan's)
        # the forward without outputs that a step wanting only gradients runs
        roles = ("forward (training)", "backward", "forward (gradients only)")
        why = ("the forward, saving the carry into each round of the fused backward",
               "a diagonal-linear adjoint whose sums over the recurrences each thread adds atomically: one kernel "
               "walks the rounds backward, recomputing the forward's carries from those saved per round",
               "the forward without outputs, saving the round carries, for a step that wants gradients only")
        return [_report(role, kind + _fused_label(role, launch, fused, length), launch, source, arch, compile_kernels,
                        reason) for (launch, source), role, reason in zip(fused.sources(sizes, length, time_contiguous),
                                                                           roles, why)]
    chunk = min(length, default_chunk("cuda", length, program, sizes))
    common = (sizes, time_contiguous, dtype, compute, arch, compile_kernels)
    return (_program_reports("recompute", bw.carries, chunk, kind, *common)
            + _program_reports("adjoint", bw.adjoint, chunk, kind, *common))


def _fused_label(role: str, launch, fused, length: int) -> str:
    """The strategy a fused backward's kernel is reported under: the lanes backward, or the warp kernel's
    with its steps per lane (and whether state-major: chosen to fit the block's shared memory too); its
    forward, the lanes kernel or the warp kernel, each saving the round carries."""
    if role == "backward" and launch.mapping.lanes:
        return f"lanes backward, {launch.mapping.describe()}"
    if role == "backward":
        major = ", state-major" if fused.state_major(length) else ""
        return f"fused backward, {fused.backward_steps(length)} steps a lane{major}"
    return f"lanes, {launch.mapping.describe()}" if launch.mapping.lanes else "warp"


def _program_reports(role: str, program, steps: int, kind: str, sizes, time_contiguous: bool, dtype: str,
                     compute: str, arch: str, compile_kernels: bool, whole: bool = True) -> list[KernelReport]:
    """The kernels of `program` run through its fusion stages (`lowering/stages.py`), or (`whole`)
    as one kernel where the CUDA runner takes it so (`runner.one_kernel`)."""
    reports = []
    fused = _stages(program)
    if whole and one_kernel(fused, compute, sizes, steps, time_contiguous):  # a block owns each row
        return _reports(CudaRunner(program, compute), role, kind + "rows (the layer in one kernel)", sizes, steps,
                        time_contiguous, dtype, compute, arch, compile_kernels,
                        "a row statistic of the whole layer: a block owns each row, scan and norm in one kernel")
    for stage in fused.stages:
        if _torch_path(stage.program, compute):  # matrix products, no generated kernel (path_notes)
            continue
        hoisted = hoisted_runner(stage.program, compute)  # the kernels that run between its matrix products
        runner = CudaRunner(stage.program, compute) if hoisted is None else hoisted.kernels
        selection = runner.selection(sizes, steps, time_contiguous)
        strategy, reason = selection.strategy, selection.reason
        if selection.refusals():  # the table's strategies before it, and why each passed
            reason += "; passed over: " + "; ".join(selection.refusals())
        if hoisted is not None:
            strategy += f" (+ {hoisted.describe()})"
        if fused.staged:  # which fusion stage the kernel belongs to
            strategy = f"{stage.kind}: {strategy}"
        reports += _reports(runner, role, kind + strategy, sizes, steps, time_contiguous, dtype, compute, arch,
                            compile_kernels, reason)
    return reports


def _reports(runner: CudaRunner, role: str, strategy: str, sizes, steps: int, time_contiguous: bool, dtype: str,
             compute: str, arch: str, compile_kernels: bool, reason: str) -> list[KernelReport]:
    reports = []
    for launch in runner.launches(sizes, steps, time_contiguous):
        specs = _specs(launch, sizes, dtype, compute, time_contiguous)
        source = runner.source_for(launch.kernel, specs, sizes, launch.mapping, launch.length, launch.strategy)
        label = f"{strategy}, {launch.mapping.describe()}" if launch.mapping.describe() else strategy
        reports.append(_report(role, label, launch, source, arch, compile_kernels, reason))
    return reports


def _report(role: str, label: str, launch: Launch, source: str, arch: str, compile_kernels: bool,
            reason: str) -> KernelReport:
    """One kernel's report: its source stored, and compiled by NVRTC where asked and possible."""
    report = KernelReport(role, label, launch, source, str(store("cuda", source, ".cu")), reason=reason)
    if compile_kernels and nvrtc.available():
        try:
            # half types include the toolkit's cuda_fp16.h / cuda_bf16.h, which NVRTC does not have
            half = "#define SSMC_HALF" in source
            include = nvrtc.toolkit_include() if half else None
            built = nvrtc.compile_source(source, arch=arch, name=f"{launch.kernel.name}.cu",
                                         options=((f"-I{include}",) if include else ()) + compile_options(source))
            report.resources = built.resources[launch.kernel.name]
        except nvrtc.NvrtcError as err:
            report.error = str(err).splitlines()[0]
            if half and include is None:
                report.error += " (half-type kernels need a CUDA toolkit's headers: set CUDA_HOME)"
    elif compile_kernels:
        report.error = nvrtc.unavailable_reason()
    return report


def format_reports(reports: list[KernelReport]) -> str:
    """A table: one row per kernel, then the source paths."""
    rows = [["program", "strategy", "kernel", "grid x block", "time blocks", "regs", "smem B", "spills B"]]
    for r in reports:
        blocks, threads = r.launch.grid
        res = r.resources
        usage = ([str(res.registers), str(res.shared_bytes), str(res.spill_store_bytes + res.spill_load_bytes)]
                 if res else ["-", "-", "-"])
        rows.append([r.program, r.strategy, r.name, f"{blocks} x {threads}", str(r.launch.nblk), *usage])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"{r.name}: {r.path}" for r in reports]
    why = dict.fromkeys((r.program, r.strategy.split(" (+")[0].split(", ")[0], r.reason) for r in reports if r.reason)
    lines += [f"why {program} is {strategy}: {reason}" for program, strategy, reason in why]
    sms = options().sm_count
    lines += [f"warning: {r.name} launches {r.launch.grid[0]} block{'s' * (r.launch.grid[0] > 1)} of "
              f"{r.launch.grid[1]} threads, fewer than the {sms} SMs of the GPU: it cannot fill it"
              for r in reports if r.launch.grid[0] < sms]
    errors = sorted({r.error for r in reports if r.error})
    lines += [f"note: {e}" for e in errors]
    lines += [f"note: {r.name} needs {r.resources.stack_frame_bytes} bytes of local memory a thread, more than "
              f"the {MAX_LOCAL_BYTES} CUDA allows: it will not run on the GPU at these sizes"
              for r in reports if r.resources and r.resources.stack_frame_bytes > MAX_LOCAL_BYTES]
    return "\n".join(lines)


def forward_source(program, sizes: dict[str, int] | None = None, length: int = DEFAULT_LENGTH) -> str:
    """The CUDA source of the forward's kernels at `sizes` (default: `default_sizes`), for reading."""
    sizes = sizes or default_sizes(program)
    reports = kernel_reports(program, sizes, length, backward=False, compile_kernels=False)
    shape = " ".join(f"{a}={n}" for a, n in sizes.items())
    head = f"// {program.name} at {shape} L={length}, float32 (`ssmc inspect --sizes` for others)"
    return "\n\n".join([head] + [f"// ---- {r.name} ({r.path})\n{r.source}" for r in reports])

"""What `ssmc inspect` says of an attention spec's flash kernels: which kernels a call at given sizes launches,
in which config, on what grid, and what NVRTC's ptxas reports for each (registers, shared memory, spills).

    rows = flash_reports(program, sizes, lq, lk, "bfloat16", "sm_90")   # [FlashReport], forward then backward
    print(format_flash_reports(rows, sm_count=132))

The configs are the ones a call on a GPU of `arch` takes where no ``SSMC_CUDA_FLASH_*`` variable names one:
on sm_90 the wgmma kernels (built for sm_90a), elsewhere the mma.sync ones; the forward's staggered config
falls back to the plain one on short spans as at run time. The backward is the one a call whose params need
a gradient runs (with fixed params the wgmma configs take their pipelined loop: `backward._pipelines`); the
grids are those of a call whose k and v have q's heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .....ir.program import Attention
from ... import nvrtc
from . import backward as bwd
from . import forward as fwd


@dataclass
class FlashReport:
    """One flash kernel of a call: its role, config, grid and ptxas' resources (or why none)."""

    program: str                # forward | backward
    config: str
    name: str
    grid: tuple[int, int]       # (blocks, threads a block)
    dynamic_shared: int         # bytes a block, beside ptxas' static count
    resources: nvrtc.KernelResources | None = None
    error: str = ""


def _hopper(arch: str) -> bool:
    return arch.startswith("sm_90")


def flash_reports(program: Attention, sizes: dict[str, int], lq: int, lk: int, dtype: str, arch: str,
                  backward: bool = True, compile_kernels: bool = True) -> list[FlashReport]:
    """The flash kernels a call of `program` at `sizes` (batch axes, head and value dims) and lengths `lq`, `lk`
    launches on a GPU of `arch` with `dtype` q, k, v (bfloat16 or float16), forward then (`backward`) the
    backward's delta, key-block and (with ``SSMC_CUDA_FLASH_DQ=kernel``) dQ kernels; compiled by NVRTC where
    `compile_kernels` and NVRTC is here."""
    d, bf16 = sizes[program.head_dim], dtype == "bfloat16"
    bh = math.prod(sizes[a] for a in program.batch_axes)
    cfg = fwd.CONFIGS[(fwd.HOPPER_CONFIG if _hopper(arch) else fwd.DEFAULT_CONFIG)[d]][d]
    if cfg.stagger:
        spans = fwd.block_spans(program.mask, lq, lk, sizes, cfg.bm, cfg.bn)
        tiles = sum(-(-(hi - lo) // cfg.bn) for lo, hi, _, _ in spans if hi > lo) / max(1, len(spans))
        if tiles < fwd.STAGGER_MIN_TILES:
            cfg = fwd.CONFIGS["wg128"][d]
    name, text = fwd.kernel_source(program, d, bf16, cfg.name)
    rows = [(FlashReport("forward", cfg.name, name, (-(-lq // cfg.bm) * bh, cfg.threads), cfg.shared(d)), text,
             cfg.arch)]
    if backward:
        atomic = bwd.atomic_dq(d)
        bcfg = bwd.CONFIGS[(bwd.HOPPER_CONFIG if _hopper(arch) else bwd.DEFAULT_CONFIG)[d]][d]
        name, text = bwd.delta_source(d, bf16, bool(program.params))
        rows.append((FlashReport("backward", "delta", name, (-(-bh * lq // 4), 128), 0), text, None))
        name, text = bwd.kernel_source(program, d, bf16, atomic_dq=atomic, config_name=bcfg.name)
        rows.append((FlashReport("backward", bcfg.name, name, (-(-lk // bcfg.bn) * bh, bcfg.threads),
                                 bcfg.shared(d, atomic)), text, bcfg.arch))
        if not atomic:
            name, text = bwd.dq_source(program, d, bf16)
            rows.append((FlashReport("backward", "dq kernel", name, (-(-lq // fwd.BM) * bh, fwd.THREADS), 0), text,
                         None))
    reports = []
    for report, text, build in rows:
        if compile_kernels and nvrtc.available():
            from ...source import compile_options

            try:
                built = nvrtc.compile_source(text, arch=build or arch, options=compile_options(text),
                                             name=f"{report.name}.cu")
                report.resources = built.resources[report.name]
            except nvrtc.NvrtcError as err:
                report.error = str(err).splitlines()[0]
        elif compile_kernels:
            report.error = nvrtc.unavailable_reason()
        reports.append(report)
    return reports


def format_flash_reports(reports: list[FlashReport], sm_count: int) -> str:
    """A table, one row a kernel, then a warning for a grid of fewer blocks than the GPU's `sm_count` SMs and
    a note for each error."""
    rows = [["program", "config", "kernel", "grid x block", "regs", "smem B (static + dynamic)", "spills B"]]
    for r in reports:
        res = r.resources
        usage = ([str(res.registers), f"{res.shared_bytes} + {r.dynamic_shared}",
                  str(res.spill_store_bytes + res.spill_load_bytes)] if res else ["-", f"- + {r.dynamic_shared}", "-"])
        rows.append([r.program, r.config, r.name, f"{r.grid[0]} x {r.grid[1]}", *usage])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"warning: {r.name} launches {r.grid[0]} block{'s' * (r.grid[0] > 1)} of {r.grid[1]} threads, fewer "
              f"than the {sm_count} SMs of the GPU: it cannot fill it" for r in reports if r.grid[0] < sm_count]
    lines += [f"note: {e}" for e in sorted({r.error for r in reports if r.error})]
    return "\n".join(lines)

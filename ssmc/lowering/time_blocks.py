"""Time-parallel lowering of diagonal-linear programs: summarise blocks of time, combine, rescan.

When every state is updated as ``h_t = a_t ⊙ h_{t-1} + b_t`` with `a`, `b` free of the carry
(classification's diagonal- and matrix-linear families), the time axis splits into `nblk` blocks
that run in parallel, as three plain loops:

    # 1. summary: each block run from h = 0, with the product of its coefficients
    for k in parallel(nblk):  P[k], H[k] = 1, 0;  for t in block k: P = a_t P;  H = a_t H + b_t
    # 2. combine: the carry into each block (a recurrence of nblk steps)
    c = h0;  for k in range(nblk): carry_in[k] = c;  c = P[k] c + H[k]          # c: final state
    # 3. rescan: the program itself, each block from its own carry (outputs written)
    for k in parallel(nblk):  h = carry_in[k];  for t in block k: step(h, t)

(for reverse programs blocks and steps run from the end). Each phase is an ordinary `Kernel`
from `build_kernel`, so it prints for every backend; the CUDA backend uses it when the
independent recurrences alone are too few to fill the GPU (a long scan over few channels).

The same summary and rescan steps also make one *warp* kernel (`lane_summary`, `lane_rescan`):
a warp per recurrence, its 32 lanes taking consecutive blocks of K steps, the combine done by a
scan of the (product, partial) pairs across lanes (`__shfl_up_sync`), round after round of 32 K
steps. Lanes then read neighbouring steps: what a layout with time contiguous needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import build
from ..ir.node import Node
from ..ir.ops import Op
from ..ir.program import Decl, Recurrence, Role
from .kernel import Kernel, independent_axes
from .plan import build_kernel
from .summary import (
    complex_pairs,
    complex_product,
    identity_product,
    partial_name,
    product_name,
    summary_names,
    summary_program,
)


@dataclass
class TimeBlocks:
    """The three kernels of the time-parallel scan (module docstring), for one program."""

    program: Recurrence
    summary: Kernel      # init: product 1 / partial 0 per block; finals: [nblk, ...] summaries
    combine: Kernel      # sequences: the summaries; prev_<state>: the carry into each block
    rescan: Kernel       # init_<state>[blk]: the carry into block blk; writes the outputs
    lane_summary: Kernel  # the summary's step for the warp kernel (no carry loaded; names "s_...")
    lane_rescan: Kernel   # the program's step for the warp kernel (one carry per recurrence)


def time_blocks(program: Recurrence) -> TimeBlocks | None:
    """The time-parallel kernels for `program`, or None where it does not apply."""
    parallel = independent_axes(program)
    if not program.states or (not parallel and program.states[0].axes):
        return None
    summary = summary_program(program)
    if summary is None:
        return None
    decls, updates = [], []
    pairs = complex_pairs(program)
    imag = {im: re for re, im in pairs.items()}

    def leaf(name, axes):
        return Node.make(Op.INPUT, (), name, axes)

    for s in program.states:
        carry, prod, part = (leaf(n, s.axes) for n in (s.name, product_name(s.name), partial_name(s.name)))
        decls += [Decl(prod.arg, Role.SEQ, s.axes, s.loc), Decl(part.arg, Role.SEQ, s.axes, s.loc)]
        if s.name in pairs or s.name in imag:  # a complex pair: the carry times the complex product
            re, im = (s.name, pairs[s.name]) if s.name in pairs else (imag[s.name], s.name)
            z = complex_product(leaf(product_name(re), s.axes), leaf(product_name(im), s.axes),
                                leaf(re, s.axes), leaf(im, s.axes))
            updates.append(build.add(z[0 if s.name in pairs else 1], part))
            continue
        updates.append(build.add(build.mul(prod, carry), part))
    combine = Recurrence(f"{program.name}_combine", tuple(decls) + program.states, tuple(updates), (),
                         program.sizes, program.reverse, program.loc)
    names = tuple(s.name for s in program.states)
    return TimeBlocks(
        program,
        summary=build_kernel(summary.name, summary, parallel, time_blocks=True, blocked_init=True),
        combine=build_kernel(combine.name, combine, parallel, store_prev=names),
        rescan=build_kernel(f"{program.name}_rescan", program, parallel, time_blocks=True, blocked_init=True),
        lane_summary=build_kernel(summary.name, summary, parallel, prefix="s_", load_init=False),
        lane_rescan=build_kernel(f"{program.name}_warp", program, parallel),
    )


def summary_inits(program, sizes: dict[str, int], nblk: int, full) -> dict:
    """The summary kernel's initial states, one per block of time: products 1, partials 0, made by
    `full(shape, value)` (a broadcast view is enough: they are only read); a complex pair's
    products start at 1 + 0i."""
    init = {}
    for s in program.states:
        shape = (nblk, *(sizes[a] for a in s.axes))
        init[f"init_{product_name(s.name)}"] = full(shape, identity_product(program, s.name))
        init[f"init_{partial_name(s.name)}"] = full(shape, 0.0)
    return init


def run_time_blocks(tb: TimeBlocks, launch, full, seqs, params, initial, sizes, length: int, nblk: int):
    """Runs the three phases; same contract as `interpreter.run_recurrence`.

    `launch(kernel, arrays, length, nblk) -> {name: array}` runs one kernel (the backend's), and
    `full(shape, value)` makes a filled array (`summary_inits`).
    """
    p = tb.program
    init = summary_inits(p, sizes, nblk, full)
    made = launch(tb.summary, {**seqs, **params, **init}, length, nblk)
    summaries = {name: made[f"final_{name}"] for name in summary_names(p)}
    carries = launch(tb.combine, {**summaries, **{f"init_{s}": v for s, v in initial.items()}}, nblk, 1)
    made = launch(tb.rescan, {**seqs, **params, **{f"init_{s.name}": carries[f"prev_{s.name}"] for s in p.states}},
                  length, nblk)
    outs = {n: made[f"out_{n}"] for n, _ in p.outputs}
    finals = {s.name: carries[f"final_{s.name}"].reshape([sizes[a] for a in s.axes]) for s in p.states}
    return outs, finals

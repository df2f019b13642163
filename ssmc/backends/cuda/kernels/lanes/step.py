"""CUDA C of the lanes kernel's step form: the layout of the lanes kernel (G lanes a row of the parallel axes,
lane g owning the states' own indices n = g, g + G, ...; R = threads / G rows a block, the same grid) without
its chunks staged in shared memory, for calls of one step (a decode step, `ssmc.step`).

The chunked kernel (forward.py) pays at one step for what only many steps amortise: each chunk's copies into
shared memory, three barriers, per-step arrays of G steps in registers (Mamba-1's N = 128 step took 168
registers and spilled: three blocks of four warps an SM, little of the state in flight). Here each lane, per
step:

    pre   its row's per-step values (dt, dt u) in registers, computed by every lane of the row
    body  per state value it owns: its update, sequences along the states' axis (B, C) read from global
          memory (the same for the block's rows: cache hits), the sums over the axis into one register each
    sums  across the row's G lanes by shuffles (a butterfly: every lane gets the sum)
    post  the row's outputs, stored by its lane 0

The states are loaded before the first step and stored after the last, as in the chunked kernel (lane g's
loads of h[b, d, g + j G] for j = 0 .. S - 1: the G lanes of a row read G consecutive values an instruction).
A call of L steps walks them in order, correct at any L; the strategy uses this form at L = 1 only
(`Lanes.source`, ``SSMC_CUDA_LANES_STEP=0`` keeps the chunked kernel).
"""

from __future__ import annotations

from .....lowering.kernel import Kernel, Lowered
from .....lowering.plan import size_var
from ...printer import C_TYPES, ArraySpec, CPrinter, Threads, _scalar_names, c_array, with_free_array_names
from ...source import exact_products, has_half, render
from .. import template
from ..thread import _unflatten
from ..warp.analysis import scalar_name
from .analysis import StateLanes
from .forward import _lane_loops, _lane_params

# 4-byte registers a thread may take: the blocks an SM holds at once (`__launch_bounds__`) are the most whose
# threads fit the register file at this many each; the step only streams its states, so occupancy is its
# latency hiding (a lane's S state values and params are most of its registers)
STEP_REGISTERS = 64
REGISTER_FILE = 65536


def step_min_blocks(lanes: StateLanes, sizes: dict[str, int], groups: int, block: int, ctype: str) -> int:
    """Blocks an SM must hold at once (`__launch_bounds__`): those STEP_REGISTERS a thread allow, where a lane's
    own values (S of each state and lane param, twice in float64) take at most half of them, else 1. (Mamba-1's
    N = 128 step, 16 values of h and of A a lane: 93 registers unbounded, 64 bounded so, unspilled; 48 spilled.)"""
    per_lane = -(-sizes[lanes.axis] // groups)
    values = per_lane * (len(lanes.carried) + len(lanes.lane_params)) * (2 if ctype == "double" else 1)
    if values > STEP_REGISTERS // 2:
        return 1
    return max(1, REGISTER_FILE // (block * STEP_REGISTERS))


def step_supported(k: Kernel) -> bool:
    """Whether the step form prints `k`: not a training step's forward (its round carries: the chunked kernel)."""
    return not any(a.role == "rounds" for a in k.arrays)


def lanes_step_source(lowered: Lowered, lanes: StateLanes, k: Kernel, arrays: dict[str, ArraySpec],
                      sizes: dict[str, int], mapping: Threads, ctype: str) -> str:
    """CUDA C of the step form of the lanes kernel of `k` (module docstring) for these layouts."""
    def build():
        context = lanes_step_context(k, lanes, arrays, sizes, mapping.lanes, mapping.block, ctype)
        return render(lowered.program.name, lowered.strategy, ctype, [context], has_half(arrays),
                      exact_products(lowered.program))
    return with_free_array_names(set(arrays), build)


def lanes_step_context(k: Kernel, lanes: StateLanes, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                       groups: int, block: int, ctype: str) -> dict:
    """The step template's context (step.cu.j2): the forward's setup, finish and lane params as the chunked
    kernel prints them (`_lane_loops`, `_lane_params`), the step's parts with the per-step values as scalars
    (``pv_<name>``) and every sequence and row param read from global memory."""
    axis, row = lanes.axis, lanes.row_axis
    n, var = size_var(axis), lanes.var
    rows = block // groups
    per_lane = -(-sizes[axis] // groups)
    major = lanes.major
    per_step = {name: (lambda e: f"pv_{e.array}") for name in major.per_step}
    own = {name: (lambda e: f"{e.array}[j]") for name in lanes.lane_buffers}
    own |= {name: (lambda e: f"rp_{e.array}[j]") for name in lanes.lane_params}
    own_printer = CPrinter(k, arrays, sizes, views=own)
    rowwise = CPrinter(k, arrays, sizes, views=per_step)
    body_printer = CPrinter(k, arrays, sizes, views={**own, **per_step})
    carried = {scalar_name(b): b for b in lanes.carried}
    body_scalars = [name for name in _scalar_names(major.body) if name not in carried]

    step = [f"F pv_{name};" for name in major.per_step]
    step += rowwise.stmts(major.pre, 0)  # the sums' starts (their identities) among them
    step += ["#pragma unroll", "for (int j = 0; j < S; ++j) {  // this lane's state values",
             f"    const int {var} = g + j * G;"]
    guard = sizes[axis] % groups != 0
    inner = "        " if guard else "    "
    if guard:
        step.append(f"    if ({var} < {n}) {{")
    step += [f"{inner}F {scalar} = {buffer}[j];" for scalar, buffer in carried.items()]
    step += [f"{inner}F {name};" for name in body_scalars]
    step += body_printer.stmts(major.body, len(inner) // 4)
    step += [f"{inner}{buffer}[j] = {scalar};" for scalar, buffer in carried.items()]
    if guard:
        step.append("    }")
    step.append("}")
    for name, op in lanes.sums:
        fn = "SumOp" if op == "+=" else "MaxOp"
        step += ["#pragma unroll", f"for (int w = G / 2; w >= 1; w /= 2) {{  // {name} over the row's lanes",
                 f"    pv_{name} = {fn}()(pv_{name}, __shfl_xor_sync(0xffffffffu, pv_{name}, w));", "}"]
    if major.post:
        step += ["if (valid && g == 0) {  // the row's outputs", *rowwise.stmts(major.post, 1), "}"]
    return {
        "template": template("lanes/step.cu.j2"),
        "name": k.name,
        "block": block,
        "min_blocks": step_min_blocks(lanes, sizes, groups, block, ctype),
        "lanes": True,
        "comment": (f"{k.program.name}, a step at a time: {groups} lanes per [{' '.join(k.parallel)}], each owning "
                    f"{per_lane} {axis}; {rows} rows per block, nothing staged"),
        "params": [("const " if a.role in ("seq", "param", "init") else "") + f"{C_TYPES[arrays[a.name].dtype]}* "
                   f"__restrict__ {c_array(a.name)}" for a in k.arrays],
        "constants": [f"constexpr int {size_var(a)} = {sizes[a]};" for a in k.sizes]
        + [f"constexpr int G = {groups}, S = {per_lane}, R = {rows};  // lanes a row, values a lane, rows a block"],
        "row_size": size_var(row),
        "unflatten": _unflatten(k.parallel),
        "declarations": [f"F {name} = F(0);" for name in _scalar_names(k.setup + major.pre + major.post)]
        + [f"F {name}[S];" for name in lanes.lane_buffers]
        + [f"F rp_{name}[S];" for name in lanes.lane_params],
        "params_once": _lane_params(lanes, own_printer),
        "setup": _lane_loops(k.setup, lanes, own_printer, False),
        "step": step,
        "finish": _lane_loops(k.finish, lanes, own_printer, True),
    }

"""The fused backward as lanes (the forward's lanes kernel, analysis.py, run backwards in time).

The fused backward (kernels/warp/backward_analysis.py) runs a recurrence per warp with time across its lanes, so each
round pays scans across the lanes. Where the forward runs as lanes (G lanes a row [b d], each owning
S values of the states' own axis n for the whole sequence), the backward can too: the chunks of T
steps go last first, and per chunk, as plain loops (the forward saved its carry into every chunk):

    for (r, tt) in rows x steps:  pre(r, tt)                  # dt, dt u, grad_y silu(z): per row and step
    for each lane, its S state values n:                      # the chunk's forward, from the saved carry,
        for tt in the chunk:  carries(n, tt)                  # its state kept every G steps
    for each G steps of the chunk, last first, in every lane:
        for its S state values n:
            for tt in those G steps:  carries(n, tt)          # the carry before each step, again
            for tt in those G steps, backwards:  adjoint(n, tt)
                                                              # the adjoint's chain; its sums over n into a
                                                              # register a step; its terms of the sums over
                                                              # the rows (grad_B[b, n, t]) into registers
            those terms summed over the warp's rows (a reduce-scatter) and the block's warps (shared memory)
        the sums over n across the row's G lanes (a reduce-scatter)
    for (r, tt) in rows x steps:  post(r, tt)                 # grad_u, grad_delta, grad_z
    the chunk's sums over the rows added into memory, one atomic add per block and value

`carries` is the forward summary's body (the values it shares with the later steps: exp(dt A[n])) and
the forward carries' (`state_major.FusedStateMajor`), `adjoint` the adjoint's: the same statements as
the warp kernel's state-major round, without its summaries and scans. Per-step values that the four
steps compute alike (dt in the summary's and the carries' pre) are computed once.

`lanes_backward(fb, lanes)` says how the fused backward `fb` splits so, or None where it does not: the
CUDA backend (kernels/lanes/backward.py) prints the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

from .....lowering.loops import Assign, Load, Loop, Num, Var, accesses, map_children
from ..warp.analysis import STEP, fused_state_major, scalar_name
from ..warp.backward_analysis import FusedBackward
from .analysis import StateLanes, exp2_of_params, staged_arrays


@dataclass(frozen=True)
class LanesBackward:
    """The fused backward's statements for the lanes kernel (module docstring). Per-step values are
    ``Load(name, ("tt",))`` (`per_step`, computed by `pre`, or summed over the states' axis by
    `adjoint`: `sums`); values of one state index and step are ``Load(name, ("tt",))`` too
    (`step_registers`: the carry before the step, exp(dt A[n])); `atomic` are the adjoint's terms
    of the sums over the rows, ``Load(array, index)`` targets of "atomic+=" (index: t, the block's
    other parallel axes, the states' axis)."""

    pre: list                           # per row and step: the four steps' pre, duplicates dropped
    carries: list                       # per state index and step, in order
    adjoint: list                       # per state index and step, backwards
    post: list                          # per row and step, after the adjoint
    per_step: tuple[str, ...]           # values per row and step kept in shared memory (sums included)
    sums: tuple[tuple[str, str], ...]   # per-step values the adjoint sums over the states' axis, and how
    step_registers: tuple[str, ...]     # values per state index and step (registers of G steps)
    forward_state: str                  # the forward's carried scalar (v_st_h) and its lanes' buffer (st_h)
    adjoint_states: tuple[str, ...]     # the adjoint's carried buffers (st_grad_h, st_grad_A): S values a lane
    accumulators: tuple[str, ...]       # adjoint accumulators along the states' axis (grad_A)
    thread_accumulators: tuple[str, ...]  # adjoint accumulators without it (grad_D): a scalar per thread
    atomic: tuple[tuple[str, tuple[str, ...]], ...]  # (array, index) the adjoint adds its terms into
    row_seqs: tuple[str, ...]
    state_seqs: tuple[str, ...]
    lane_params: tuple[str, ...]        # params read along the states' axis: S values a lane, loaded once
    scalars: tuple[str, ...]            # every scalar the statements assign
    log2e_params: tuple[str, ...] = ()  # lane params P read in exp(x * P): the carries and adjoint read
                                        # exp2(x * log2e_P) there, a copy of P loaded times log2 e


LOG2E = "log2e_"  # the name of a lane param's copy scaled by log2 e (`log2e_params`)


def lanes_backward(fb: FusedBackward, lanes: StateLanes) -> LanesBackward | None:
    """`fb` as the lanes backward (module docstring), its rows and states' axis as the forward's
    `lanes`; None where it does not split so: not state-major (`fused_state_major`), several
    forward states or states' axes, a sum over the rows into an array indexed otherwise than by
    t, the block's other parallel indices and the states' axis, an accumulator without that axis
    but along another, or a sequence along the row axis and the states' axis both.

    One function although long: each check refuses a shape the kernel cannot run with its own
    reason, in the order the plan is built, and the plan's parts are built from the same maps."""
    major = fused_state_major(fb)
    if major is None or len(major.local) != 1 or major.local[0] != lanes.var:
        return None
    parallel = fb.parallel
    if parallel[-1] != lanes.row_axis or len(fb.backward.forward.states) != 1 or len(fb.carried) != 1:
        return None
    var = lanes.var
    roles = {a.name: a for a in fb.arrays}
    fs, fc, _, ad = major.steps()

    # the forward summary's outputs (dt, exp(dt A[n])) and the carries: per-step values, or registers
    # of one state index's G steps
    step_registers, per_step_arrays = [], {}
    for v in fb.shared:
        axes = next(a.axes for a in fb.forward_summary.arrays if a.name == f"out_{v}")
        if any(ax not in parallel and ax != "t" for ax in axes):
            step_registers.append(v)
        else:
            per_step_arrays[v] = v
    (carried,) = fb.carried
    registers = {f"prev_{carried}": carried, carried: carried, **{f"out_{v}": v for v in step_registers},
                 **{v: v for v in step_registers}}
    per_step_arrays |= {f"out_{v}": v for v in list(per_step_arrays)}

    def rename(e):
        if isinstance(e, Load) and e.array in registers:
            return Load(registers[e.array], (STEP,))
        if isinstance(e, Load) and e.array in per_step_arrays and "t" in e.index:
            return Load(per_step_arrays[e.array], (STEP,))
        return map_children(e, rename)

    def renamed(stmts):
        return [Assign(rename(s.target), rename(s.value), s.op) for s in stmts]

    # the pre statements, a per-step value computed twice (dt in two steps' pre) computed once
    alias: dict[str, Load] = {}

    def aliased(e):
        if isinstance(e, Load) and e.index == (STEP,) and e.array in alias:
            return alias[e.array]
        return map_children(e, aliased)

    sums = {s.target.array: s.op for s in ad.body if isinstance(s.target, Load) and s.target.index == (STEP,)
            and s.op in ("+=", "max=")}
    pre, computed = [], {}
    for s in renamed(fs.pre + fc.pre + ad.pre):
        s = Assign(aliased(s.target), aliased(s.value), s.op)
        per_step_target = isinstance(s.target, Load) and s.target.index == (STEP,)
        if per_step_target and s.target.array in sums:
            if s.value != Num(0.0 if sums[s.target.array] == "+=" else float("-inf")):
                return None  # a sum that starts from something else than its identity
            continue  # a sum starts in the adjoint (a register a step), from its identity there
        if per_step_target and s.op == "=":
            value = s.value
            if isinstance(value, Load) and value.index == (STEP,):
                alias[s.target.array] = value
                continue
            if value in computed:
                alias[s.target.array] = computed[value]
                continue
            computed[value] = s.target
        pre.append(s)

    def final(stmts):
        return [Assign(aliased(s.target), aliased(s.value), s.op) for s in renamed(stmts)]

    carries, adjoint, post = final(fs.body + fc.body), final(ad.body), final(ad.post)
    per_step = []
    for s in pre + carries + adjoint + post:
        for e in accesses(s):
            if e.index == (STEP,) and e.array not in step_registers and e.array != carried and e.array not in per_step:
                per_step.append(e.array)
    if any(isinstance(s.target, Load) and s.target.index == (STEP,) and s.target.array in per_step
           and s.target.array not in sums for s in carries + adjoint):
        return None  # a per-step value set per state index: only sums are

    others = tuple(f"p_{a}" for a in parallel[:-1])
    atomic = []
    for s in adjoint:
        if s.op == "atomic+=":
            e = s.target
            if (e.index[0] != "t" or sorted(e.index[1:]) != sorted((*others, var))
                    or lanes.row_axis in roles[e.array].axes):
                return None
            if (e.array, e.index) in atomic:
                return None
            atomic.append((e.array, e.index))
    if any(s.op == "atomic+=" for s in pre + post + carries):
        return None
    accumulators = tuple(major.accumulators)
    thread_acc = tuple(n for n in fb.partials.accumulators if n not in accumulators)
    if any(not set(fb.partials.accumulators[n]) <= set(parallel) for n in thread_acc):
        return None
    stmts = pre + carries + adjoint + post
    staged = staged_arrays(stmts, roles, var, lanes.row_axis)
    if staged is None:
        return None
    row_seqs, state_seqs, lane_params = staged
    for e in (e for s in stmts for e in accesses(s) if e.array in roles):  # and what the kernel prints
        role = roles[e.array].role
        if role == "seq" and e.index[0] != "t":
            return None  # time first: the staging's index
        if role == "param" and e.array in lane_params and not all(i == var or i.startswith("p_") for i in e.index):
            return None  # at the lane's own indices: loaded once per lane
        if role not in ("seq", "param", "out", "atomic"):
            return None
    adjoint_states = tuple(f"st_{s.name}" for s in fb.adjoint.program.states
                           if scalar_name(f"st_{s.name}") in ad.scalars)
    for s in fb.adjoint.setup + fb.adjoint.finish:  # loops over the states' axis, at the states' buffers only
        if isinstance(s, Loop) and not _lane_loop(s, var, set(adjoint_states), setup=s in fb.adjoint.setup):
            return None
    scalars = []
    for s in stmts:
        if isinstance(s.target, Var) and s.target.name not in scalars:
            scalars.append(s.target.name)
    # exp(dt A[n]) as exp2(dt A'[n]); the adjoint reads A itself too (m3 A[n]), so A' is a copy
    carries, log2e = exp2_of_params(carries, lane_params, lambda p: LOG2E + p)
    adjoint, log2e_adjoint = exp2_of_params(adjoint, lane_params, lambda p: LOG2E + p)
    return LanesBackward(pre=pre, carries=carries, adjoint=adjoint, post=post, per_step=tuple(per_step),
                         sums=tuple(sums.items()), step_registers=tuple(step_registers),
                         forward_state=f"st_{carried}", adjoint_states=adjoint_states, accumulators=accumulators,
                         thread_accumulators=thread_acc, atomic=tuple(atomic), row_seqs=tuple(sorted(row_seqs)),
                         state_seqs=tuple(sorted(state_seqs)), lane_params=tuple(sorted(lane_params)),
                         scalars=tuple(scalars), log2e_params=tuple(sorted(set(log2e) | set(log2e_adjoint))))


def _lane_loop(loop: Loop, var: str, buffers: set[str], setup: bool) -> bool:
    """Whether `loop` (of the adjoint's setup or finish) runs over `var`, each iteration assigning a
    lane buffer (setup) or reading them (finish) at `var` only."""
    if loop.var != var or not all(isinstance(b, Assign) for b in loop.body):
        return False
    for b in loop.body:
        if setup and not (isinstance(b.target, Load) and b.target.array in buffers):
            return False
        named = [e for e in accesses(b) if e.array.startswith("st_") or e.array in buffers]
        if any(e.array not in buffers or e.index != (var,) for e in named):
            return False
    return True

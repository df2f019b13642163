"""Lanes along the states' own axis: recurrences run one step after another, a row's state split among lanes.

The warp kernel (time_blocks.py, warp/analysis.py) runs a recurrence's steps in parallel across a warp and
pays, per state value and round of 32 K steps, a scan across the lanes. A program whose states have an
axis of their own (Mamba-1's h[b, d, n]) often has recurrences enough to fill the GPU without that:
B x D x N = 196608 at Mamba-1's B8 D1536 N16. Then G lanes share a *row* (one index of the parallel
axes, [b d]), each owning S = N / G values of the state axis (n = g, g + G, ...) for the whole
sequence, which it runs in order: no scan at all. Steps go in chunks of T, as plain loops:

    for each chunk of T steps (its sequences copied to shared memory while the chunk before computes):
        for (r, tt) in rows x steps, shared by the block's threads:  pre(r, tt)   # dt, dt u: once per row and step
        for each G steps of the chunk, in every lane:
            for its S state values n:  for tt in those G steps:  body(n, tt)      # h[n]'s chain; the sums over n
                                                                                  # add into one register per step
            sums across the row's G lanes: lane g gets step g's (a reduce-scatter, G - 1 shuffles)
        for (r, tt) in rows x steps:  post(r, tt)                                 # y = (sum_n h C + D u) silu(z)

`pre` / `body` / `post` are the step's interchanged parts (`state_major.state_major`), per-step values
live in shared memory between them. `state_lanes(k)` says how the fused kernel `k` (plan.py) splits so,
or None where it does not: the CUDA backend (`kernels/lanes/forward.state_lanes_context`) prints the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .....lowering.kernel import Kernel
from .....lowering.loops import (
    Assign,
    Bin,
    Buffer,
    Call,
    Load,
    Loop,
    Num,
    Var,
    accesses,
    map_children,
    scalars_read,
    subexpressions,
    walk,
)
from .....lowering.plan import size_var
from ..warp.analysis import StateMajor, buffer_names, state_major


@dataclass(frozen=True)
class StateLanes:
    """How the fused kernel's step runs with lanes along the states' own `axis` (module docstring)."""

    major: StateMajor                  # the step's pre / body / post
    axis: str                          # the states' own axis (one), split among a row's lanes
    row_axis: str                      # the last parallel axis: a block's rows are consecutive indices of it
    row_seqs: tuple[str, ...]          # sequences without `axis`: staged per row and step
    state_seqs: tuple[str, ...]        # sequences along `axis`: staged per index of it and step, shared by
                                       # the block's rows (they do not depend on `row_axis`)
    sums: tuple[tuple[str, str], ...]  # per-step values the body accumulates over `axis`, and how (+= / max=)
    lane_buffers: tuple[str, ...]      # the setup's buffers along `axis` (the states'): S values per lane
    carried: tuple[str, ...]           # the states' buffers (st_<state>): their scalars carry from step to step
    lane_params: tuple[str, ...]       # params the body reads along `axis`: S values per lane, loaded once
    log2e_params: tuple[str, ...] = ()  # lane params only the body reads, only as exp(x * P), now exp2(x * P):
                                        # loaded times log2 e (ex2 takes base 2: a multiply per step saved)

    @property
    def var(self) -> str:
        return f"i_{self.axis}"


def state_lanes(k: Kernel) -> StateLanes | None:
    """`k`'s step as lanes along its states' own axis, or None: a reversed or time-blocked kernel;
    states without exactly one axis of their own, or with different ones; a step `state_major` does
    not take; a body that stores to global memory or reads a sequence along the row axis and the
    states' axis both; setup or finish statements other than scalars and loops over the states' axis
    between its buffers and the kernel's arrays; `pre` or `post` reading what the setup computed
    (they run for other rows than the lane's own)."""
    if k.reverse or k.time_blocks or not k.parallel or not k.program.states:
        return None
    parallel = set(k.parallel)
    own = {tuple(a for a in s.axes if a not in parallel) for s in k.program.states}
    if len(own) != 1 or len(next(iter(own))) != 1:
        return None
    (axis,), = own
    var, row_axis = f"i_{axis}", k.parallel[-1]
    buffers = buffer_names(k.setup)
    carried = {f"st_{s.name}" for s in k.program.states}
    if not carried <= buffers or not _lane_loops(k.setup, var, buffers) or not _lane_loops(k.finish, var, buffers):
        return None
    if any(isinstance(s, Buffer) and s.shape != (size_var(axis),) for s in k.setup):
        return None
    major = state_major(k.step, (var,), buffers, carried)
    if major is None:
        return None
    roles = {a.name: a for a in k.arrays}
    per_step = set(major.per_step)
    sums: dict[str, str] = {}
    for s in major.body:
        if isinstance(s.target, Load):
            if s.target.array not in per_step or s.op == "=":
                return None  # a store to memory, or a per-step value set along the states' axis
            sums[s.target.array] = s.op
    for name, op in sums.items():
        start = [s for s in major.pre if isinstance(s.target, Load) and s.target.array == name]
        identity = 0.0 if op == "+=" else float("-inf")
        if len(start) != 1 or start[0].value != Num(identity):
            return None  # a sum that starts from something else than its identity
    staged = staged_arrays(major.pre + major.body + major.post, roles, var, row_axis)
    if staged is None:
        return None
    row_seqs, state_seqs, lane_params = staged
    # pre and post run for the block's rows, not the lane's own: nothing from the setup
    setup_scalars = {s.target.name for s in k.setup if isinstance(s, Assign)}
    for s in major.pre + major.post:
        if any(e.array in buffers for e in accesses(s)) or scalars_read(s) & setup_scalars:
            return None
    lane_buffers = tuple(sorted(buffers))
    # the setup and finish read lane params as the body's registers do (rp_<P>): one scaled by log2 e
    # for the body's exp2 would be wrong there (a hoisted tanh(A), say), so such params stay unscaled
    elsewhere = {e.array for s in walk(k.setup + k.finish) if isinstance(s, Assign) for e in accesses(s)}
    body, log2e = _exp2_of_params(major.body, lane_params - elsewhere)
    return StateLanes(replace(major, body=body), axis, row_axis, tuple(sorted(row_seqs)), tuple(sorted(state_seqs)),
                      tuple(sorted(sums.items())), lane_buffers, tuple(sorted(carried)), tuple(sorted(lane_params)),
                      log2e)


def staged_arrays(stmts: list, roles: dict, var: str, row_axis: str) -> tuple[set, set, set] | None:
    """(row sequences, sequences along the states' axis, params along it) that `stmts` read, by the
    roles of the kernel's arrays (`roles`: name -> Array); None where a sequence is read along the
    row axis and the states' axis `var` both, at another index than t first, or both ways."""
    row_seqs, state_seqs, lane_params = set(), set(), set()
    for e in (e for s in stmts for e in accesses(s)):
        a = roles.get(e.array)
        if a is None:
            continue
        if a.role == "seq":
            if var in e.index:
                if f"p_{row_axis}" in e.index or e.index[0] != "t":
                    return None
                state_seqs.add(a.name)
            elif not all(i == "t" or i.startswith("p_") for i in e.index):
                return None
            else:
                row_seqs.add(a.name)
        elif a.role == "param" and var in e.index:
            lane_params.add(a.name)
    return None if row_seqs & state_seqs else (row_seqs, state_seqs, lane_params)


def _exp_factor(e, params: set[str]) -> str | None:
    """P where `e` is ``exp(x * P)`` or ``exp(P * x)`` for a param P of `params`, else None."""
    if isinstance(e, Call) and e.fn == "exp" and isinstance(e.args[0], Bin) and e.args[0].op == "*":
        for side in (e.args[0].a, e.args[0].b):
            if isinstance(side, Load) and side.array in params:
                return side.array
    return None


def exp2_of_params(stmts: list, params: set[str], scaled_name=None) -> tuple[list, tuple[str, ...]]:
    """`stmts` (assignments) with ``exp(x * P)`` as ``exp2(x * P')`` for the params P of `params` it
    reads so (Mamba-1's ``exp(dt * A[n])``: exp2 is one instruction, exp a multiply more), and those
    params. P' is the array the kernel loads as P times log2 e: P itself (the default, for a param
    read only so) or ``scaled_name(P)``, a copy beside P (one read otherwise too)."""
    found = set()

    def rewrite(e):
        e = map_children(e, rewrite)
        p = _exp_factor(e, params)
        if p is None:
            return e
        found.add(p)
        if scaled_name is None:
            return Call("exp2", e.args)
        sides = (e.args[0].a, e.args[0].b)
        return Call("exp2", (Bin("*", *(Load(scaled_name(p), x.index) if isinstance(x, Load) and x.array == p else x
                                        for x in sides)),))

    return [replace(s, value=rewrite(s.value)) for s in stmts], tuple(sorted(found))


def _exp2_of_params(body: list, params: set[str]) -> tuple[list, tuple[str, ...]]:
    """`body` with ``exp(x * P)`` as ``exp2(x * P)`` for each param P it reads only so, and those
    params, which the kernel then loads times log2 e (`exp2_of_params`)."""
    values = [e for s in body for e in subexpressions(s.value)]
    in_exp = {_exp_factor(e, params) for e in values} - {None}
    scaled = {p for p in in_exp if sum(_exp_factor(e, params) == p for e in values)
              == sum(e.array == p for s in body for e in accesses(s))}
    return exp2_of_params(body, scaled)


def _lane_loops(stmts: list, var: str, buffers: set[str]) -> bool:
    """Whether `stmts` (a setup or finish) are buffers, scalars and loops over `var` of assignments to
    buffers only, every index of a buffer `var` itself (each lane then runs them for its own indices)."""
    for s in stmts:
        if isinstance(s, Buffer) or (isinstance(s, Assign) and isinstance(s.target, Var)
                                     and not any(e.array in buffers for e in accesses(s))):
            continue
        if not isinstance(s, Loop) or s.var != var or not all(isinstance(b, Assign) for b in s.body):
            return False
        for b in s.body:
            if isinstance(b.target, Var):
                return False
            if any(e.array in buffers and e.index != (var,) for e in accesses(b)):
                return False
    return True



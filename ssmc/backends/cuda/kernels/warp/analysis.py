"""State-major steps for the warp kernel: the loop over the states' own axes outside, a lane's steps inside.

A lane of the warp kernel (time_blocks.py) runs K consecutive steps of one recurrence. A step of a
diagonal-linear program with a state axis of its own (Mamba-1's h[n]) is a few values of the step
(dt = softplus(delta + bias)), then loops over n whose iterations touch h[n] only, and sums over n
(y = sum_n h[n] C[t, n]) read after those loops. Run step by step, the lane keeps all N state
values (and their summaries) live across its K steps and reads B[t, n] / C[t, n] once per step and
n. Interchanged, as three plain loops:

    for tt in lane steps:  pre(tt)                   # values of the step, one register per step
    for n in state axes:
        for tt in lane steps:  body(n, tt)           # h[n]'s chain over the lane's steps;
                                                     # sums over n add into one register per step
    for tt in lane steps:  post(tt)                  # what reads the sums (the outputs)

the lane holds one state value at a time, the summary's and the step's exp(dt A[n]) and B[t, n] of
one (n, step) are the same expressions in one basic block (computed once), and a lane's reads of
B[:, n] are K consecutive words. The CUDA backend scans the (product, partial) pairs across the lanes
per n, between the summary's chain and the step's (kernels/warp/forward.warp_kernel_context).

`state_major` rewrites one step's statements into (pre, body, post), or says it does not apply.
"""

from __future__ import annotations

from dataclasses import dataclass

from .....lowering.loops import (
    Assign,
    Bin,
    Buffer,
    Call,
    Load,
    Loop,
    Var,
    accesses,
    loads,
    map_children,
    scalars_read,
    subexpressions,
)
from .....lowering.summary import partial_name, product_name

STEP = "tt"  # the index of a lane's step in the printed loops


@dataclass
class StateMajor:
    """One step's statements split for the interchanged loops (module docstring). Scalars kept per
    step (`per_step`) are ``Load(name, ("tt",))``: register arrays of K; a buffer read at the state
    loop's own index is the scalar ``v_<buffer>`` in `body` (`scalars` lists those and the body's
    own scalars)."""

    pre: list
    body: list
    post: list
    per_step: tuple[str, ...]
    scalars: tuple[str, ...]


def scalar_name(buffer: str) -> str:
    """The scalar standing for `buffer` at the state loop's index, inside the body."""
    return f"v_{buffer}"


def state_major(step: list, local: tuple[str, ...], buffers: set[str], carried: set[str]) -> StateMajor | None:
    """`step` (one step's statements) as pre / body / post around loops over the loop variables
    `local` (the states' own axes, outermost first), or None where the interchange would change
    what it computes: a loop that is not a perfect nest over `local`; a buffer (names in `buffers`)
    the loops write that is accessed at another index or outside the loops, or read before it is
    written unless it is `carried` (a state: its value from the step before, of the same index);
    a sum read inside the loops, a loop's scalar read outside it, a scalar assigned twice. Buffers
    the loops only read (values hoisted before time) stay arrays."""
    bodies: list[list[Assign]] = []
    top: list[Assign] = []
    for s in step:
        if isinstance(s, Loop):
            inner = _perfect_nest(s, local)
            if inner is None:
                return None
            bodies.append(inner)
        elif isinstance(s, Assign):
            top.append(s)
        else:
            return None
    if not bodies:
        return None
    at_index = tuple(local)
    flat = [s for body in bodies for s in body]
    written = {s.target.array for s in flat if isinstance(s.target, Load) and s.target.array in buffers}
    seen = set()
    for s in flat:
        for e in accesses(s):
            if e.array in written and e.index != at_index:
                return None
        if any(e.array in written - seen - carried for e in loads(s.value)):
            return None  # a value of the step before, at this index: another index's, interchanged
        if isinstance(s.target, Load):
            seen.add(s.target.array)
    sums, own = set(), []
    for body in bodies:
        names = set()
        for s in body:
            if isinstance(s.target, Var):
                (names if s.op == "=" else sums).add(s.target.name)
        own.append(names)
    body_scalars = set().union(*own)
    if body_scalars & sums:
        return None
    # each loop's scalars are its iteration's values: read nowhere else (fused, another loop would
    # see this iteration's value instead of the last one's)
    for i, names in enumerate(own):
        if any(names & _reads(other) for j, other in enumerate(bodies) if j != i):
            return None
    if any(sums & scalars_read(s) for s in flat):
        return None  # a partial sum read inside the loops
    assigned = [s.target.name for s in top if isinstance(s.target, Var)]
    if len(assigned) != len(set(assigned)):
        return None
    pre, post, late = [], [], set(sums)
    for s in top:
        read = _reads([s])
        if read & body_scalars or any(e.array in written for e in accesses(s)):
            return None
        if read & late:
            post.append(s)
            if isinstance(s.target, Var):
                late.add(s.target.name)
        else:
            pre.append(s)
    pre_targets = {s.target.name for s in pre if isinstance(s.target, Var)}
    if not sums <= pre_targets:
        return None  # a sum that does not start from a value of its step
    if any(_reads([s]) & (late - sums) for s in flat):
        return None
    used_later = _reads(flat + post)
    per_step = tuple(sorted((pre_targets & used_later) | sums))
    if _read_before_assigned(pre) & set(per_step):
        return None  # a scalar carried from the step before (a chain): one register per step would break it
    rename = {name: Load(name, (STEP,)) for name in per_step}
    scalars = {scalar_name(name) for name in written} | body_scalars
    return StateMajor(pre=[_rewrite(s, rename, written, at_index) for s in pre],
                      body=[_rewrite(s, rename, written, at_index) for s in flat],
                      post=[_rewrite(s, rename, written, at_index) for s in post],
                      per_step=per_step, scalars=tuple(sorted(scalars)))


def _read_before_assigned(stmts: list[Assign]) -> set[str]:
    """The scalars `stmts` read (in order) before they assign them: values of the step before."""
    assigned, early = set(), set()
    for s in stmts:
        early |= _reads([s]) - assigned
        if isinstance(s.target, Var):
            assigned.add(s.target.name)
    return early & assigned


def _perfect_nest(loop: Loop, local: tuple[str, ...]) -> list[Assign] | None:
    """The innermost statements of `loop` if it is a nest of loops over exactly `local`, in order."""
    s = loop
    for var in local:
        if not isinstance(s, Loop) or s.var != var or s.reverse:
            return None
        if var != local[-1]:
            if len(s.body) != 1:
                return None
            s = s.body[0]
    if not all(isinstance(x, Assign) for x in s.body):
        return None
    return list(s.body)


def _reads(stmts) -> set[str]:
    """The scalar names `stmts` read (an accumulation reads its target too)."""
    out = set()
    for s in stmts:
        out |= scalars_read(s)
        if s.op != "=" and isinstance(s.target, Var):
            out.add(s.target.name)
    return out


def _rewrite(s: Assign, rename: dict[str, Load], buffers: set[str], at_index: tuple[str, ...]) -> Assign:
    def expr(e):
        if isinstance(e, Var):
            return rename.get(e.name, e)
        if isinstance(e, Load):
            return Var(scalar_name(e.array)) if e.array in buffers and e.index == at_index else e
        return map_children(e, expr)
    return Assign(expr(s.target), expr(s.value), s.op)


def buffer_names(stmts) -> set[str]:
    """The names of the `Buffer`s among `stmts` (a kernel's setup)."""
    return {s.name for s in stmts if isinstance(s, Buffer)}


def warp_state_major(summary, step) -> tuple[StateMajor, StateMajor] | None:
    """The summary's and the step's `StateMajor` for the warp kernel of `step` (a `plan.Kernel`;
    `summary` its time_blocks.py summary), or None: states without axes of their own (nothing to
    interchange), states with different own axes, or steps `state_major` does not take."""
    parallel = set(step.parallel)
    own = {tuple(a for a in s.axes if a not in parallel) for s in step.program.states}
    if len(own) != 1:
        return None
    (axes,) = own
    if not axes:
        return None
    local = tuple(f"i_{a}" for a in axes)
    names = [s.name for s in step.program.states]
    carried = {f"st_{n}" for n in names} | {f"st_{f(n)}" for n in names for f in (product_name, partial_name)}
    first = state_major(summary.step, local, buffer_names(summary.setup), carried)
    second = state_major(step.step, local, buffer_names(step.setup), carried)
    if first is None or second is None or first.post:
        return None
    return first, second


SHARED = "sh"  # per-step registers holding what the summary's body and the step's both compute


def share(first: StateMajor, second: StateMajor) -> tuple[StateMajor, StateMajor]:
    """`first` (the summary's) and `second` (the step's) computing what they have in common once.

    A per-step value of `first`'s pre equal to one of `second`'s pre is that one (its statement
    dropped); then each largest subexpression of `second`'s body that `first`'s body computes too,
    from per-step values, params and loads only (Mamba-1's exp(dt A[n]) and dt u B[t, n]), becomes
    the per-step register ``sh<j>``, set by `first`'s body and read by `second`'s. The two bodies
    run over the same steps of one state index, the summary's first (module docstring)."""
    alias: dict[str, Load] = {}
    defined = {s.value: s.target for s in second.pre if _per_step_target(s)}
    pre = []
    for s in first.pre:
        s = _substitute(s, alias)
        if _per_step_target(s) and s.value in defined:
            alias[s.target.array] = defined[s.value]
        else:
            pre.append(s)
    body = [_substitute(s, alias) for s in first.body]
    local = set(first.scalars)
    candidates = {e for s in body for e in subexpressions(s.value) if _shareable(e, local)}
    found: dict = {}

    def replace(e):
        if e in candidates:
            if e not in found:
                found[e] = Load(f"{SHARED}{len(found)}", (STEP,))
            return found[e]
        return map_children(e, replace)

    second_body = [Assign(s.target, replace(s.value), s.op) for s in second.body]
    candidates = set(found)  # the first body computes what the second reads, in terms of registers
    first_body = [Assign(reg, e) for e, reg in found.items()]
    first_body += [Assign(s.target, replace(s.value), s.op) for s in body]
    names = tuple(r.array for r in found.values())
    kept = {s.target.array for s in pre if _per_step_target(s)}
    per_step = tuple(n for n in first.per_step if n not in alias or n in kept) + names
    return (StateMajor(pre, first_body, first.post, per_step, first.scalars),
            StateMajor(second.pre, second_body, second.post, second.per_step, second.scalars))


def _per_step_target(s: Assign) -> bool:
    return isinstance(s.target, Load) and s.target.index == (STEP,)


def _shareable(e, local: set[str]) -> bool:
    """A value worth one register per step: computed (or loaded along the state loop), and free of
    the body's own scalars (a carry differs between the two bodies)."""
    if isinstance(e, Load):
        return any(i.startswith("i_") for i in e.index) and e.index != (STEP,)
    if not isinstance(e, (Call, Bin)):
        return False
    return not any(isinstance(x, Var) and x.name in local for x in subexpressions(e))


def _substitute(s: Assign, alias: dict[str, Load]) -> Assign:
    def expr(e):
        if isinstance(e, Load) and e.index == (STEP,) and e.array in alias:
            return alias[e.array]
        return map_children(e, expr)
    return Assign(s.target, expr(s.value), s.op)


@dataclass
class FusedStateMajor:
    """The four steps of the fused backward (kernels/warp/backward_analysis.py) state-major: per round, the steps'
    values (`pre`, the forward's steps in order, then the adjoint's last first), then per index of
    the states' own axes the forward summary's chain, a scan across the lanes, the forward's
    carries' chain (the carry before each step, one register per step), the adjoint summary's
    chain backwards, a reverse scan, the adjoint's chain backwards; then the adjoint's `post`."""

    forward_summary: StateMajor
    forward_carries: StateMajor
    adjoint_summary: StateMajor
    adjoint: StateMajor
    local: tuple[str, ...]      # the states' own axes (loop variables i_<axis>)
    accumulators: tuple[str, ...]  # the adjoint's sums over time along those axes (st_grad_A): kept per index

    def steps(self) -> tuple[StateMajor, ...]:
        return self.forward_summary, self.forward_carries, self.adjoint_summary, self.adjoint


def fused_state_major(fb) -> FusedStateMajor | None:
    """`FusedStateMajor` of the fused backward `fb` (a reverse_warp.FusedBackward), or None: states
    of the four steps with different own axes (those without own axes, the adjoint's scalar
    accumulators, aside), forward states without own axes, a step `state_major` does not take, or
    one but the adjoint that has statements after its loops."""
    kernels = (fb.forward_summary, fb.forward_carries, fb.adjoint_summary, fb.adjoint)
    parallel = set(fb.parallel)
    own = {tuple(a for a in s.axes if a not in parallel) for k in kernels for s in k.program.states}
    own.discard(())
    forward_own = {tuple(a for a in s.axes if a not in parallel) for s in fb.backward.forward.states}
    if len(own) != 1 or forward_own != own:
        return None
    (axes,) = own
    local = tuple(f"i_{a}" for a in axes)
    steps = []
    for k in kernels:
        carried = {f"st_{s.name}" for s in k.program.states}
        sm = state_major(k.step, local, buffer_names(k.setup), carried)
        if sm is None or (sm.post and k is not fb.adjoint):
            return None
        steps.append(sm)
    accumulators = tuple(n for n in fb.partials.accumulators
                         if scalar_name(f"st_{n}") in steps[-1].scalars)
    return FusedStateMajor(*steps, local=local, accumulators=accumulators)

"""The fused backward of a diagonal-linear program: one warp kernel, no carry ever in memory.

For a forward whose every state is ``h_t = a_t ⊙ h_{t-1} + b_t`` (a, b free of the carry), the
forward's warp kernel (time_blocks.py: a warp per recurrence, lane j on steps K j ... K j + K - 1
of each round of 32 K steps) also writes the carry into each round, ``rounds_<h>[r]``: the memory
plan with a chunk of one round, states × L / (32 K) values. The backward is then one kernel, a warp
per recurrence, its rounds from last to first; in each, as plain loops for lane j:

    # the carries of its steps, recomputed in registers from the saved round carry
    h = prefix scan across lanes of the forward summaries (P_j, H_j), from rounds_h[r]
    for t in its steps:          hs[t] = h;  h = a_t h + b_t
    # the adjoint's carry into its steps, from the later side
    g = suffix scan across lanes of the adjoint summaries, from the next round's carry
    for t in its steps, last first:   the adjoint's step at t, reading the carry hs[t]

Sums over the recurrences (Mamba-1's ``grad_B = sum_d ...``, the param gradients' ``sum_b ...``) are
left to each thread as its own term (`partial_adjoint`): an output is added into its array
atomically (``atomic+=``), an accumulator summed in registers over the thread's steps, across the
warp by shuffles and into its result atomically.
"""

from __future__ import annotations

from dataclasses import dataclass

from .....ir import build
from .....ir.node import Node, substitute, toposort
from .....ir.ops import Op
from .....ir.program import Decl, Recurrence, Role
from .....lowering.kernel import Array, Kernel, independent_axes
from .....lowering.loops import Assign, Load, Num, walk
from .....lowering.plan import build_kernel
from .....lowering.summary import summary_program
from .....passes.autodiff import Backward
from .....passes.classify import classify


@dataclass
class Partials:
    """An adjoint whose sums over the recurrences (`parallel` axes) are left to each thread.

    `program`'s outputs in `atomic` are one thread's term of the output (its axes: the output's plus
    the summed parallel axes); the threads' terms add up to the output, whose axes are
    ``atomic[name]``. Its accumulators (sums over time) have the axes of their per-thread
    increment; `accumulators[name]` is the axes of the gradient they add up to."""

    program: Recurrence
    atomic: dict[str, tuple[str, ...]]
    accumulators: dict[str, tuple[str, ...]]


def _split_sums(node: Node, parallel: set[str]) -> tuple[Node, frozenset[str]] | None:
    """(x, S) with `node` = the sum of x over the parallel axes S (S may be empty); through sums,
    negations and sums of equally summed terms. None where the parts are summed differently."""
    if node.op is Op.SUM:
        inner = _split_sums(node.args[0], parallel)
        if inner is None:
            return None
        x, summed = inner
        if node.arg in parallel:
            return x, summed | {node.arg}
        return build.reduce_sum(x, node.arg), summed
    if node.op is Op.NEG:
        inner = _split_sums(node.args[0], parallel)
        return None if inner is None else (build.neg(inner[0]), inner[1])
    if node.op in (Op.ADD, Op.SUB):
        parts = [_split_sums(a, parallel) for a in node.args]
        if parts[0] is None or parts[1] is None or parts[0][1] != parts[1][1]:
            return None
        return Node.make(node.op, (parts[0][0], parts[1][0])), parts[0][1]
    return node, frozenset()


def partial_adjoint(adjoint: Recurrence, parallel: tuple[str, ...]) -> Partials | None:
    """`adjoint` with its sums over `parallel` left to the threads (`Partials`), or None where a
    root lacks a parallel axis other than through such sums."""
    par = set(parallel)
    families = {c.state: c for c in classify(adjoint).states}
    outputs, atomic = [], {}
    for name, y in adjoint.outputs:
        split = _split_sums(y, par)
        if split is None or not par | set(y.axes) <= set(split[0].axes):
            return None  # a root without a recurrence axis, or broadcast along an axis of its own
        outputs.append((name, split[0]))
        if split[1]:
            atomic[name] = y.axes
    decls, updates, accumulators = list(adjoint.decls), [], {}
    for s, u in zip(adjoint.states, adjoint.updates):
        c = families[s.name]
        if c.family != "accumulator":
            if not par <= set(s.axes):
                return None
            updates.append(u)
            continue
        split = _split_sums(c.b, par)
        if split is None or not par | set(s.axes) <= set(split[0].axes):
            return None
        inc = split[0]
        carry = Node.make(Op.INPUT, (), s.name, inc.axes)
        updates.append(build.expand(build.add(carry, inc), inc.axes))
        decls[decls.index(s)] = Decl(s.name, Role.STATE, inc.axes, s.loc)
        accumulators[s.name] = s.axes
    program = Recurrence(f"{adjoint.name}_partial", tuple(decls), tuple(updates), tuple(outputs), adjoint.sizes,
                         adjoint.reverse, adjoint.loc)
    if not par <= set(independent_axes(program)):
        return None
    return Partials(program, atomic, accumulators)


@dataclass
class FusedBackward:
    """The kernels (loop nests) spliced into the fused backward warp kernel (module docstring)."""

    backward: Backward
    parallel: tuple[str, ...]
    partials: Partials
    forward_summary: Kernel     # the forward's summary step (names "fs_...")
    forward_carries: Kernel     # the forward's states (no outputs), prev_<h> written before each step ("f_...")
    adjoint_summary: Kernel     # the adjoint recurrences' summary step ("as_...")
    adjoint: Kernel             # the partial adjoint's step: outputs (atomic+= where summed), accumulators
    core: tuple[str, ...]       # the adjoint's recurrences (grad_h), carried across lanes and rounds
    arrays: list[Array]         # the fused kernel's arguments, in order
    shared: tuple[str, ...] = ()  # values the forward's summary writes (out_sv<k>), the others read (sv<k>)

    @property
    def name(self) -> str:
        return f"{self.backward.forward.name}_fused_backward"

    @property
    def carried(self) -> tuple[str, ...]:
        """The forward's states: the adjoint's sequences read from registers."""
        return tuple(s.name for s in self.backward.forward.states)


def fused_backward(bw: Backward) -> FusedBackward | None:
    """The fused backward of `bw`, or None where it does not apply: a forward that is not diagonal
    linear in every state, an adjoint root that needs more than per-thread terms, or terms along
    an axis the thread's state lacks."""
    fwd = bw.forward
    parallel = independent_axes(fwd)
    if not parallel or fwd.reverse:
        return None
    f_summary = summary_program(fwd)
    partials = partial_adjoint(bw.adjoint, parallel)
    if f_summary is None or partials is None:
        return None
    adj = partials.program
    # a thread's terms span only axes its own state has (Mamba-1's grad_B and grad_A terms: [n], as
    # h): a minGRU's weight gradients [i d] would hold a row of i per thread, its grad_x add i terms
    # per step; the unfused backward's epilogue kernels suit those better
    spans = [set(s.axes) for s in fwd.states]
    partial_roots = [y for n, y in adj.outputs if n in partials.atomic]
    partial_roots += [adj.decl(n) for n in partials.accumulators]
    if any(not any(set(r.axes) <= span for span in spans) for r in partial_roots):
        return None
    core = tuple(s.name for s in adj.states if s.name not in partials.accumulators)
    core_program = adj.with_roots(tuple(u for s, u in zip(adj.states, adj.updates) if s.name in core), (),
                                  states=core, name=f"{adj.name}_core")
    a_summary = summary_program(core_program) if core else None
    if a_summary is None:
        return None
    states = tuple(s.name for s in fwd.states)
    carries = fwd.with_roots(fwd.updates, (), name=f"{fwd.name}_carries")
    shared = _shared_values(f_summary, [carries, a_summary, adj], fwd, spans)
    if shared:  # computed by the forward's summary, read from registers by the three later steps
        f_summary = f_summary.with_roots(f_summary.updates, tuple(shared.items()))
        carries, a_summary, adj = (_reading(p, shared) for p in (carries, a_summary, adj))
    adjoint = build_kernel(adj.name, adj, parallel)
    _leave_to_threads(adjoint, partials)
    kernels = dict(
        forward_summary=build_kernel(f_summary.name, f_summary, parallel, prefix="fs_", load_init=False),
        forward_carries=build_kernel(carries.name, carries, parallel, store_prev=states, prefix="f_", load_init=False),
        adjoint_summary=build_kernel(a_summary.name, a_summary, parallel, prefix="as_", load_init=False),
        adjoint=adjoint,
    )
    arrays = _arguments(list(kernels.values()), fwd, partials, set(states) | set(shared))
    return FusedBackward(bw, parallel, partials, core=core, arrays=arrays, shared=tuple(shared), **kernels)


_COSTLY = {Op.EXP, Op.LOG, Op.SOFTPLUS, Op.SIGMOID, Op.TANH, Op.SILU, Op.GELU, Op.ERF, Op.SQRT, Op.RSQRT,
           Op.POW, Op.DIV, Op.SIN, Op.COS, Op.TAN, Op.LOG1P, Op.EXPM1, Op.ATAN2}


def _shared_values(first: Recurrence, later: list[Recurrence], fwd: Recurrence, spans) -> dict[str, Node]:
    """Values of a step that the forward's summary computes and a later step computes again (Mamba-1's
    ``exp(softplus(delta + bias) A)``, four times a step otherwise): those that read only the
    forward's sequences and params, are a transcendental or a division, span only axes of a state
    (a lane keeps one per step in registers), and are not only ever used inside another such value.
    By name ``sv<k>``, in the order the summary computes them."""
    free = {d.name for d in fwd.decls if d.role is not Role.STATE}
    nodes = toposort(first.roots)
    later_nodes = set().union(*(toposort(p.roots) for p in later))
    reads: dict[Node, frozenset[str]] = {}
    for n in nodes:
        reads[n] = frozenset({n.arg}) if n.op is Op.INPUT else frozenset().union(*(reads[a] for a in n.args))
    candidates = [n for n in nodes if n.op in _COSTLY
                  and reads[n] <= free and n in later_nodes and any(set(n.axes) <= span for span in spans)]
    users: dict[Node, set[Node]] = {}
    for n in set(nodes) | later_nodes:
        for a in n.args:
            users.setdefault(a, set()).add(n)
    chosen = set(candidates)
    for n in reversed(candidates):  # consumers first: a value read only by chosen ones is not kept
        if users.get(n, set()) <= chosen - {n}:
            chosen.discard(n)
    return {f"sv{i}": n for i, n in enumerate(n for n in candidates if n in chosen)}


def _reading(program: Recurrence, shared: dict[str, Node]) -> Recurrence:
    """`program` with the shared values read as sequences ``sv<k>`` (the lane's registers)."""
    leaves = {n: Node.make(Op.INPUT, (), name, n.axes) for name, n in shared.items()}
    roots = substitute(program.roots, leaves)
    updates, outputs = roots[:len(program.updates)], roots[len(program.updates):]
    new = program.with_roots(updates, tuple(zip((n for n, _ in program.outputs), outputs)),
                             new_seqs=[(name, n.axes) for name, n in shared.items()
                                       if any(x is leaves[n] for x in toposort(roots))])
    return new


def _leave_to_threads(k: Kernel, partials: Partials) -> None:
    """In the partial adjoint's kernel: accumulators start from zero in each thread (the runner
    starts the results from the initial values), and a summed output's store becomes an atomic
    add at the output's own indices."""
    for s in walk(k.setup):
        if isinstance(s, Assign) and isinstance(s.value, Load) and s.value.array.startswith("init_") \
                and s.value.array[len("init_"):] in partials.accumulators:
            s.value = Num(0.0)
    axes_of = {a.name: a.axes for a in k.arrays}
    for s in walk(k.step):
        if isinstance(s, Assign) and isinstance(s.target, Load) and s.target.array.startswith("out_"):
            name = s.target.array[len("out_"):]
            if name in partials.atomic:
                at = dict(zip(axes_of[s.target.array], s.target.index))
                s.target = Load(s.target.array, ("t", *(at[a] for a in partials.atomic[name])))
                s.op = "atomic+="
    finals = {f"final_{n}" for n in partials.accumulators}  # summed across the warp by the backend instead
    k.finish = [s for s in k.finish
                if not any(isinstance(x, Assign) and isinstance(x.target, Load) and x.target.array in finals
                           for x in walk([s]))]


def _arguments(kernels: list[Kernel], fwd: Recurrence, partials: Partials, carried: set[str]) -> list[Array]:
    """The fused kernel's arrays: sequences and params of its four steps (but the forward's
    carries, which are registers), the saved round carries, the adjoint's initial and final
    recurrences, its accumulators' results (added into), and its outputs."""
    out: list[Array] = []
    seen: set[str] = set()
    for role in ("seq", "param"):
        for k in kernels:
            for a in k.arrays:
                if a.role == role and a.name not in seen and a.name not in carried:
                    seen.add(a.name)
                    out.append(a)
    out += [Array(f"rounds_{s.name}", "rounds", ("round", *s.axes)) for s in fwd.states]
    adjoint = kernels[-1]
    out += [a for a in adjoint.arrays
            if a.role in ("init", "final") and a.name.split("_", 1)[1] not in partials.accumulators]
    out += [Array(f"final_{n}", "accumulate", axes) for n, axes in partials.accumulators.items()]
    for a in adjoint.arrays:
        if a.role == "out":
            name = a.name[len("out_"):]
            out.append(Array(a.name, "atomic", ("t", *partials.atomic[name])) if name in partials.atomic else a)
    return out

"""Autodiff: the adjoint of a recurrence, as another recurrence that runs backward in time.

For a forward step  ``h_t = F(h_{t-1}, x_t; θ)``,  ``y_t = G(h_{t-1}, x_t; θ)``  and cotangents
``ȳ_t`` (per-step outputs) and ``h̄_L`` (final states), the adjoint is the reverse scan

    λ = h̄_L;  θ̄ = 0
    for t in reversed(range(L)):
        λ, x̄_t, θ̄_t = vjp(step at (h_{t-1}, x_t, θ))(λ, ȳ_t)     # λ: dL/dh_{t-1} afterwards
        θ̄ += θ̄_t
    h̄_0 = λ

It is built here as an ordinary `Recurrence` (``reverse=True``): states are the adjoints ``grad_h``
and accumulators ``grad_θ`` for params; sequences are the forward carries before each step
(named like the states), the forward sequences and the output cotangents ``grad_y``; outputs are
the per-step ``grad_x``. The VJP of the step graph is reverse-mode over its DAG: elementwise
local derivatives come from SymPy (`derivatives.partials`); reductions, renames, unbind and split
have structural rules (the table `STRUCTURAL` below), broadcasting transposes to a sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import SpecError
from ..ir import build
from ..ir.node import BOOL, Node, toposort
from ..ir.ops import ELEMENTWISE, LEAVES, Op
from ..ir.program import Decl, Recurrence, Role
from ..ir.verify import verify
from .derivatives import partials

GRAD = "grad_"


# -- VJP rules: (node, cotangent of node) -> [(argument index, cotangent of that argument)] ----------

def _elementwise(node: Node, g: Node) -> list[tuple[int, Node]]:
    out = []
    try:
        ds = partials(node)
    except TypeError as err:  # a derivative SymPy gave that the IR cannot express
        raise SpecError(f"cannot differentiate {node.op.value}: {err}", node.loc) from None
    for i, (arg, d) in enumerate(zip(node.args, ds)):
        if d is not None and arg.dtype != BOOL:
            out.append((i, build.sum_to(build.mul(g, d), node.axes, arg.axes)))
    return out


def _where(node: Node, g: Node) -> list[tuple[int, Node]]:
    cond, a, b = node.args
    return [(1, build.sum_to(build.where(cond, g, build.ZERO), node.axes, a.axes)),
            (2, build.sum_to(build.where(cond, build.ZERO, g), node.axes, b.axes))]


def _reduce_max(node: Node, g: Node) -> list[tuple[int, Node]]:
    (x,) = node.args
    hit = Node.make(Op.EQ, (x, node))  # ties share the gradient evenly
    count = build.reduce_sum(build.where(hit, build.ONE, build.ZERO), node.arg)
    return [(0, build.where(hit, build.div(g, count), build.ZERO))]


def _rename(node: Node, g: Node) -> list[tuple[int, Node]]:
    back = {new: old for old, new in node.arg if new in g.axes}
    return [(0, Node.make(Op.RENAME, (g,), tuple(sorted(back.items()))) if back else g)]


def _select(node: Node, g: Node) -> list[tuple[int, Node]]:
    axis, index = node.arg
    at = Node.make(Op.EQ, (build.iota(axis), build.const(index)))
    return [(0, build.where(at, g, build.ZERO))]


def _slice(node: Node, g: Node) -> list[tuple[int, Node]]:
    new_axis = node.arg[1]
    return [(0, Node.make(Op.PAD, (build.with_axis(g, new_axis),), node.arg))]


def _pad(node: Node, g: Node) -> list[tuple[int, Node]]:
    axis = node.arg[0]
    return [(0, Node.make(Op.SLICE, (build.with_axis(g, axis),), node.arg))]


def _gather(node: Node, g: Node) -> list[tuple[int, Node]]:
    """The transpose of reading entry clamp(index) along the axis: g spread one-hot along it, the sum over
    the positions that read an entry left to the consumer (attention sums the (i, j) in a fixed order)."""
    index = node.args[1]
    axis = node.arg
    last = build.sub(build.size(axis), build.ONE)
    at = Node.make(Op.MIN, (Node.make(Op.MAX, (index, build.ZERO)), last))
    hit = Node.make(Op.EQ, (build.iota(axis), at))
    return [(0, build.where(hit, g, build.ZERO))]  # the index is a whole number: no gradient


STRUCTURAL: dict[Op, Callable[[Node, Node], list[tuple[int, Node]]]] = {
    Op.SUM: lambda n, g: [(0, g)],                               # broadcast back over the axis
    Op.REDUCE_MAX: _reduce_max,
    Op.RENAME: _rename,
    Op.SELECT: _select,                                          # one-hot along the axis
    Op.SLICE: _slice,                                            # zero-pad back into the axis
    Op.PAD: _pad,
    Op.EXPAND: lambda n, g: [(0, build.sum_to(g, n.axes, n.args[0].axes))],
    Op.WHERE: _where,
    Op.GATHER: _gather,
}


def vjp(roots: tuple[Node, ...], cotangents: tuple[Node | None, ...]) -> dict[Node, Node]:
    """Reverse mode over the DAG of `roots`: the cotangent of every node the seeds reach.

    A cotangent may lack some of its node's axes; it is then constant along them (broadcast).
    """
    adj: dict[Node, Node] = {}
    for r, ct in zip(roots, cotangents):
        if ct is not None:
            adj[r] = build.add(adj.get(r), ct)
    for node in reversed(toposort(roots)):
        g = adj.get(node)
        if g is None or node.op in LEAVES or node.dtype == BOOL:
            continue
        rule = STRUCTURAL.get(node.op) or (_elementwise if node.op in ELEMENTWISE else None)
        if rule is None:  # pragma: no cover - every op has a rule
            raise SpecError(f"no derivative rule for {node.op.value}", node.loc)
        for i, contribution in rule(node, g):
            arg = node.args[i]
            adj[arg] = build.add(adj.get(arg), contribution)
    return adj


# -- the adjoint recurrence ---------------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryPlan:
    """What the backward keeps from the forward: the carry every `chunk` steps (saved), and,
    per chunk while it is differentiated, the carries inside it (recomputed from the saved one).

    Extra memory: states × (L / chunk + chunk) values instead of states × L.
    """

    chunk: int
    saved: tuple[str, ...]
    recomputed: tuple[str, ...]

    def describe(self) -> str:
        return (f"memory plan: save {', '.join(self.saved)} every {self.chunk} steps (chunk boundaries); "
                f"recompute {', '.join(self.recomputed)} inside a chunk from its boundary; "
                f"extra memory O(states x (L/{self.chunk} + {self.chunk})) instead of O(states x L)")


@dataclass(frozen=True)
class Backward:
    """The derived backward of a recurrence and how its values map to gradients.

    `carries` is the forward with the carry before each step as outputs (to recompute a chunk);
    `recording` is the forward with its outputs and those carries (a forward that keeps what the
    backward needs, when one chunk covers the sequence); `adjoint` runs in reverse. After it ran:
    ``grad_x`` outputs are the sequence gradients, final ``grad_θ`` states the param gradients,
    final ``grad_h`` states the initial-state gradients.
    """

    forward: Recurrence
    carries: Recurrence
    adjoint: Recurrence
    plan: MemoryPlan = field(compare=False)
    recording: Recurrence | None = field(default=None, compare=False)

    def grad_name(self, name: str) -> str:
        return GRAD + name


DEFAULT_CHUNK = 64


def derive_backward(program: Recurrence, chunk: int = DEFAULT_CHUNK) -> Backward:
    """Derive the adjoint recurrence of `program` (see the module docstring)."""
    names = {d.name for d in program.decls} | {n for n, _ in program.outputs}
    for n in names:
        if GRAD + n in names:
            raise SpecError(f"cannot derive the backward: the names {n!r} and {GRAD + n!r} would clash "
                            "(rename the input or output)", program.loc)
    states, seqs, params = program.states, program.seqs, program.params
    leaf = {d.name: Node.make(Op.INPUT, (), d.name, d.axes) for d in program.decls}

    def new_input(name: str, axes: tuple[str, ...]) -> Node:
        return Node.make(Op.INPUT, (), name, axes)

    out_cts = [new_input(GRAD + n, y.axes) for n, y in program.outputs]
    state_cts = [new_input(GRAD + s.name, s.axes) for s in states]
    param_acc = [new_input(GRAD + p.name, p.axes) for p in params]
    adj = vjp(program.roots, (*state_cts, *out_cts))

    def grad_of(d: Decl) -> Node:
        g = adj.get(leaf[d.name])
        return build.expand(build.ZERO if g is None else g, d.axes)

    updates = [grad_of(s) for s in states]
    updates += [build.expand(build.add(acc, adj.get(leaf[p.name])), p.axes) for acc, p in zip(param_acc, params)]
    outputs = tuple((GRAD + x.name, grad_of(x)) for x in seqs)
    decls = (
        *(Decl(GRAD + s.name, Role.STATE, s.axes, s.loc) for s in states),
        *(Decl(GRAD + p.name, Role.STATE, p.axes, p.loc) for p in params),
        *(Decl(s.name, Role.SEQ, s.axes, s.loc) for s in states),
        *seqs,
        *(Decl(GRAD + n, Role.SEQ, y.axes, y.loc) for n, y in program.outputs),
        *params,
    )
    adjoint = Recurrence(name=f"{program.name}_backward", decls=decls, updates=tuple(updates), outputs=outputs,
                         sizes=program.sizes, reverse=not program.reverse, loc=program.loc)
    verify(adjoint)
    carries = Recurrence(name=f"{program.name}_carries", decls=program.decls, updates=program.updates,
                         outputs=tuple((f"prev_{s.name}", leaf[s.name]) for s in states), sizes=program.sizes,
                         reverse=program.reverse, loc=program.loc)
    clash = {n for n, _ in program.outputs} & {n for n, _ in carries.outputs}
    recording = None if clash else Recurrence(
        name=f"{program.name}_recording", decls=program.decls, updates=program.updates,
        outputs=program.outputs + carries.outputs, sizes=program.sizes, reverse=program.reverse, loc=program.loc)
    plan = MemoryPlan(chunk, saved=tuple(s.name for s in states),
                      recomputed=(*(f"{s.name}[t]" for s in states), "every intermediate of the step"))
    return Backward(program, carries, adjoint, plan, recording)

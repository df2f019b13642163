"""The readout cut: an output that reads the states only through a matrix-product-like contraction
with state-free operands is computed after the recurrence, for every step at once.

An LRU's ``y[b, d] = Re(sum_n C[d, n] h[b, n]) + D[d] x[b, d]`` (a complex h, traced as the pair
h_re, h_im) written in the step makes every step of the recurrence contract its whole state with
C: the recurrence is then parallel along b alone (the output lacks n) and each step does
O(n x d) work per b. Cut instead:

    core  the recurrence, writing the state-dependent factors ``f`` of the contractions as extra
          outputs ``cut<k>`` [t, f's axes] (here the new h_re, h_im: [t b n]); it is independent
          along every axis of its states again (a thread or scan per (b, n))
    post  a state-free program: the outputs with ``f`` read from ``cut<k>``, each contraction
          distributed over the sum it contracts, one product per term
          (``sum_n C_re cut0 - sum_n C_im cut1 + D x``), so that the hoisting pass
          (`lowering/hoist.py`) takes each term out as one matrix product over (t, b)

As a plain loop the staged program is the original: the recurrence over t (recording f), then
for every t the outputs from f. The post stage's gradient gives the cotangents of ``cut<k>``
(``C^T dy_t``), which the core's adjoint reads as a per-step injection into the state's adjoint;
`autograd/stages.py` chains the two.

A contraction is taken when every term of its operand, written as a sum of products, has at most
one state-dependent factor (a product of such factors is one factor) and, where it has one, that
factor and the state-free ones each have an axis the others lack and the contraction sums
something (`hoist.gemm_like`): then the product after the loop is a real matrix product. A
contraction with no such axis (Mamba-1's ``sum_n h[b, d, n] C[b, n]``, a batched vector product)
costs the loop no more than the product after it, and would store the whole state every step:
not taken. Only forward programs whose every moved output reads no state besides the taken
contractions are cut; row statistics are left to `stages.fuse`.
"""

from __future__ import annotations

from functools import lru_cache

from ..ir import build
from ..ir.node import Node, depending_on, input_names, substitute, toposort
from ..ir.ops import Op
from ..ir.program import Recurrence
from .hoist import gemm_like
from .stages import Fused, Stage, _fresh, fuse

_MAX_TERMS = 16   # a product of sums distributes into the product of their term counts: a bound


def _terms(node: Node, stateful: set[Node], state_axes: set[str]) -> list[tuple[bool, list[Node]]] | None:
    """`node` as a sum of signed products: [(negated, factors)]. A state-free value, or a state-dependent
    one within the states' axes (the new h: what is cut), is one factor; sums, differences and products
    with other axes (``C_re h_re - C_im h_im`` over [d n b]) are distributed. None past `_MAX_TERMS`."""
    if node not in stateful or set(node.axes) <= state_axes:
        return [(False, [node])]
    if node.op in (Op.ADD, Op.SUB):
        a, b = (_terms(x, stateful, state_axes) for x in node.args)
        if a is None or b is None:
            return None
        if node.op is Op.SUB:
            b = [(not neg, fs) for neg, fs in b]
        out = a + b
    elif node.op is Op.NEG:
        a = _terms(node.args[0], stateful, state_axes)
        out = None if a is None else [(not neg, fs) for neg, fs in a]
    elif node.op is Op.MUL:
        a, b = (_terms(x, stateful, state_axes) for x in node.args)
        if a is None or b is None:
            return None
        out = [(na != nb, fa + fb) for na, fa in a for nb, fb in b]
    else:
        out = [(False, [node])]  # another op over an output axis: a factor the cut then refuses
    return out if out is not None and len(out) <= _MAX_TERMS else None


def _readout(node: Node, stateful: set[Node], state_axes: set[str]):
    """(summed axes, [(negated, state-dependent factor or None, state-free factors)]) where `node`
    is a contraction the cut takes (module docstring), else None. A factor with an axis no state
    has (a state broadcast along an output axis) is not cut: it would be stored per step."""
    summed = []
    inner = node
    while inner.op is Op.SUM:
        summed.append(inner.arg)
        inner = inner.args[0]
    if not summed or inner not in stateful:
        return None
    terms = _terms(inner, stateful, state_axes)
    if terms is None:
        return None
    out = []
    for neg, factors in terms:
        dependent = [f for f in factors if f in stateful]
        free = [f for f in factors if f not in stateful]
        f = None
        if dependent:
            f = dependent[0]
            for g in dependent[1:]:
                f = build.mul(f, g)
            if not set(f.axes) <= state_axes or not gemm_like(tuple(summed), (f, *free)):
                return None
        out.append((neg, f, free))
    return tuple(summed), out


def _rebuild(summed: tuple[str, ...], terms, cut_inputs: dict[Node, Node]) -> Node:
    """The contraction as a sum of one contraction per term, ``f`` read from its cut input."""
    total = None
    for neg, f, free in terms:
        prod = build.ONE if f is None else cut_inputs[f]
        for g in free:
            prod = build.mul(prod, g)
        for a in summed:  # innermost first, as written; a term that lacks the axis is constant along it
            prod = build.reduce_sum(prod, a) if a in prod.axes else build.mul(prod, build.size(a))
        total = build.neg(prod) if total is None and neg else (
            prod if total is None else build.sub(total, prod) if neg else build.add(total, prod))
    return total


def _in_state_order(f: Node, program: Recurrence) -> Node:
    """`f` with its axes in the order of the first state that has them all (`f` where none has)."""
    for s in program.states:
        if set(f.axes) <= set(s.axes):
            return build.expand(f, tuple(a for a in s.axes if a in f.axes))
    return f


@lru_cache(maxsize=256)
def readout_stages(program: Recurrence) -> Fused | None:
    """`program` as a core recurrence and a state-free post program computing the outputs that read
    the states through contractions after it (module docstring); None where nothing is taken."""
    if program.reverse or not program.states or fuse(program).staged:
        return None
    state_names = {s.name for s in program.states}
    state_axes = {a for s in program.states for a in s.axes}
    nodes = toposort(program.roots)
    stateful = depending_on(nodes, state_names)
    in_updates = set(toposort(program.updates))
    out_nodes = toposort(y for _, y in program.outputs)
    summed_again = {n.args[0] for n in out_nodes if n.op is Op.SUM}
    found = {}
    for n in out_nodes:
        if n.op is Op.SUM and n not in summed_again and n in stateful and n not in in_updates:
            r = _readout(n, stateful, state_axes)
            if r is not None:
                found[n] = r
    if not found:
        return None
    moved = [(name, y) for name, y in program.outputs if any(x in found for x in toposort([y]))]
    kept = [(name, y) for name, y in program.outputs if (name, y) not in moved]
    cuts: list[Node] = []
    for _, terms in found.values():
        cuts += [f for _, f, _ in terms if f is not None and f not in cuts]
    taken = {d.name for d in program.decls} | {n for n, _ in program.outputs}
    cut_names = _fresh("cut", len(cuts), taken)
    # a cut laid out as a state is (h_re's [b n], not the product's [n b]): the scan's threads, consecutive
    # along the state's last axis, then write it (and its adjoint read its cotangent) coalesced
    cuts = [_in_state_order(f, program) for f in cuts]
    cut_inputs = {f: Node.make(Op.INPUT, (), name, f.axes) for f, name in zip(cuts, cut_names)}
    ordered = {f: cut_inputs[_in_state_order(f, program)] for f in {f for _, ts in found.values() for _, f, _ in ts}
               if f is not None}
    forms = {n: _rebuild(summed, terms, ordered) for n, (summed, terms) in found.items()}
    post_roots = substitute(tuple(y for _, y in moved), forms)
    # each output's axes in their order as written (the callers lay the arrays out by them)
    post_roots = tuple(build.expand(r, y.axes) for r, (_, y) in zip(post_roots, moved))
    if input_names(post_roots) & state_names:  # a moved output reads the state otherwise too
        return None
    core = program.with_roots(program.updates, kept + list(zip(cut_names, cuts)))
    read = input_names(post_roots)
    post = program.with_roots((), list(zip((n for n, _ in moved), post_roots)),
                              [(name, f.axes) for f, name in zip(cuts, cut_names) if name in read],
                              states=(), name=f"{program.name}_post")
    return Fused(program, (Stage("core", core, tuple(cut_names)), Stage("post", post)))

"""The summary of a linear scan's step (time_blocks.py): each state's step as a (product, partial)
pair, so that blocks of time can be summarised alone and combined; whether a program splits in time
so (`splits_in_time`), asked by the lowering before any kernel is built."""

from __future__ import annotations

from ..ir import build
from ..ir.node import Node, toposort
from ..ir.ops import Op
from ..ir.program import Decl, Recurrence, Role
from ..passes.classify import classify
from .kernel import independent_axes

_LINEAR = ("diagonal linear", "matrix linear")


def product_name(state: str) -> str:
    return f"blockprod_{state}"


def partial_name(state: str) -> str:
    return f"blockpart_{state}"


def complex_pairs(program: Recurrence) -> dict[str, str]:
    """`program`'s complex diagonal states (passes/classify.py): real part's state -> imaginary part's."""
    return classify(program).pairs()


def identity_product(program: Recurrence, state: str) -> float:
    """The value a block's product of coefficients starts from for `state`: 1, or 0 for the imaginary
    part of a complex diagonal state (the complex product starts at 1 + 0i)."""
    return 0.0 if state in complex_pairs(program).values() else 1.0


def complex_product(ar: Node, ai: Node, zr: Node, zi: Node) -> tuple[Node, Node]:
    """(re, im) of (ar + i ai) (zr + i zi), as IR."""
    return (build.sub(build.mul(ar, zr), build.mul(ai, zi)), build.add(build.mul(ai, zr), build.mul(ar, zi)))


def summary_program(program: Recurrence) -> Recurrence | None:
    """The summary of `program`'s steps (module docstring, phase 1): per state, the product of the
    coefficients `blockprod_<s>` and the partial `blockpart_<s>`, as a recurrence over the same
    steps; None unless every state is ``h = a ⊙ h + b`` with `a`, `b` free of the carry. A complex
    diagonal pair's products and partials are complex too, their updates complex products (the
    real part's names hold the real parts)."""
    if not program.states:
        return None
    states = {s.name for s in program.states}
    classes = classify(program).states
    for c in classes:
        if c.family not in _LINEAR or c.a is None or c.b is None:
            return None
        if any(n.op is Op.INPUT and n.arg in states for n in toposort([c.a, c.b] + ([c.a_im] if c.a_im else []))):
            return None
    by_name = {c.state: c for c in classes}
    decls: list[Decl] = []
    updates: list[Node] = []

    def leaf(name, axes):
        return Node.make(Op.INPUT, (), name, axes)

    for s, c in zip(program.states, classes):
        prod, part = leaf(product_name(s.name), s.axes), leaf(partial_name(s.name), s.axes)
        decls += [Decl(prod.arg, Role.STATE, s.axes, s.loc), Decl(part.arg, Role.STATE, s.axes, s.loc)]
        if c.partner is None:
            updates += [build.expand(build.mul(c.a, prod), s.axes),
                        build.expand(build.add(build.mul(c.a, part), c.b), s.axes)]
            continue
        re, im = (c.partner, s.name) if c.imag else (s.name, c.partner)
        pr, pi = (leaf(product_name(n), s.axes) for n in (re, im))
        hr, hi = (leaf(partial_name(n), s.axes) for n in (re, im))
        k = 1 if c.imag else 0
        new_prod = complex_product(c.a, c.a_im, pr, pi)[k]
        new_part = build.add(complex_product(c.a, c.a_im, hr, hi)[k], by_name[s.name].b)
        updates += [build.expand(new_prod, s.axes), build.expand(new_part, s.axes)]
    used = {n.arg for n in toposort(updates) if n.op is Op.INPUT}
    inputs = tuple(d for d in program.decls if d.role is not Role.STATE and d.name in used)
    return Recurrence(f"{program.name}_summary", inputs + tuple(decls), tuple(updates), (), program.sizes,
                      program.reverse, program.loc)


def summary_names(program) -> list[str]:
    """The summary kernel's states: each state's product and partial, in state order."""
    return [n for s in program.states for n in (product_name(s.name), partial_name(s.name))]


def splits_in_time(program: Recurrence) -> bool:
    """Whether a time-parallel scan (time_blocks.py) applies to `program`: states along its
    independent axes, each step a (product, partial) pair (`summary_program`)."""
    parallel = independent_axes(program)
    if not program.states or (not parallel and program.states[0].axes):
        return False
    return summary_program(program) is not None

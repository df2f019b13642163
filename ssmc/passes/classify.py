"""Classification: which family a recurrence belongs to, which decides how it is lowered.

For each state update ``h_t = U(carry, inputs)``:

- **nonlinear** unless U is affine in the carry: every second derivative of U with respect to the
  states (and to linear maps of them: sums, renames, unbind, split) is zero. SymPy decides this on
  the elementwise region of U; the structural ops in between are linear by construction.
- **general linear**: affine, but U mixes elements (a contraction, a rename) or other states.
- **diagonal linear**: ``h_t = a ⊙ h_{t-1} + b`` with `a`, `b` free of the carry; `a` and `b`
  are returned as IR, ready for a parallel scan over (a, b) pairs.
- **matrix linear**: diagonal linear where `b` is an outer product ``k ⊗ v`` over two state axes
  and `a` is constant along at least one of them (Mamba-2/SSD, RetNet, GLA, linear attention):
  the chunked, matmul-based form applies.

- **complex diagonal** (a kind of diagonal linear): two states of the same axes that are the real and
  imaginary parts of one complex ``z_t = λ ⊙ z_{t-1} + β`` (``z = p + i q``), as a complex state
  traces (frontend/complex.py): ``p_t = a p - c q + b_p``, ``q_t = c p + a q + b_q`` with `a`, `c`,
  `b_p`, `b_q` free of the carry. Found from the derivatives (dp'/dp = dq'/dq, dp'/dq = -dq'/dp), not
  from names; the first state in program order is the real part. Each state's class keeps λ's real
  part as `a` (the same for both), its imaginary part as `a_im`, its own part of β as `b`, and the
  other state as `partner`; scans combine the pairs with complex products.

- **accumulator**: ``h_t = h_{t-1} + b`` where `b` may read other states but nothing reads `h`
  except its own update: a sum over time (the param gradients of an adjoint). It is lowered as a
  reduction of a per-step value and does not count towards the family.

The program's family is the most general of its states' (diagonal < matrix < general < nonlinear).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

import sympy as sp

from ..ir import build
from ..ir.axes import format_axes
from ..ir.node import Node, toposort
from ..ir.ops import ELEMENTWISE, LEAVES, REDUCTIONS, Op
from ..ir.program import Recurrence
from .symbolic import from_sympy, to_sympy

FAMILIES = ("diagonal linear", "matrix linear", "general linear", "nonlinear")
_POINTWISE = ELEMENTWISE | {Op.EXPAND}  # broadcasting mixes no elements
_LINEAR_MAPS = {Op.SUM, Op.RENAME, Op.SELECT, Op.SLICE, Op.PAD, Op.EXPAND}
_SIMPLIFY_LIMIT = 200  # ops; beyond this a non-zero second derivative is taken at its word


@dataclass(frozen=True)
class StateClass:
    """How one state is updated. `a` and `b` are set for (diagonal / matrix) linear states."""

    state: str
    family: str
    coefficient: str = "-"           # "one", "diagonal", "shared over [..]", "-" when not diagonal
    a: Node | None = None
    b: Node | None = None
    partner: str | None = None       # complex diagonal: the other part's state
    a_im: Node | None = None         # complex diagonal: the coefficient's imaginary part
    imag: bool = False               # complex diagonal: this state is the imaginary part

    def describe(self) -> str:
        coef = f", coefficient {self.coefficient}" if self.a is not None else ""
        if self.partner is not None:
            part = "imaginary" if self.imag else "real"
            coef += f", complex: the {part} part, with {self.partner}"
        return f"{self.state}: {self.family}{coef}"


@dataclass(frozen=True)
class Classification:
    family: str
    reverse: bool
    states: tuple[StateClass, ...]

    def pairs(self) -> dict[str, str]:
        """The complex diagonal states (module docstring): real part's state -> imaginary part's."""
        return {c.state: c.partner for c in self.states if c.partner is not None and not c.imag}

    @property
    def label(self) -> str:
        return self.family + (" (reverse)" if self.reverse else "")

    def describe(self) -> str:
        return "\n".join([f"family: {self.label}", *(f"  {s.describe()}" for s in self.states)])


class _Regions:
    """SymPy views of the carry-dependent part of a program's graph."""

    def __init__(self, program: Recurrence):
        state_names = {s.name for s in program.states}
        self.dependent: set[Node] = set()
        for n in toposort(program.updates):
            if (n.op is Op.INPUT and n.arg in state_names) or any(a in self.dependent for a in n.args):
                self.dependent.add(n)
        self.symbols: dict[sp.Symbol, Node] = {}
        self._by_node: dict[Node, sp.Symbol] = {}
        self._affine: dict[Node, bool] = {}

    def symbol(self, node: Node) -> sp.Symbol:
        sym = self._by_node.get(node)
        if sym is None:
            if node.op is Op.INPUT:
                name = node.arg
            else:
                name = f"v{len(self._by_node)}"
            sym = sp.Symbol(name, real=True)
            self._by_node[node] = sym
            self.symbols[sym] = node
        return sym

    def variables(self) -> dict[sp.Symbol, Node]:
        """Symbols that stand for carry-dependent nodes (states and linear maps of them)."""
        return {s: n for s, n in self.symbols.items() if n in self.dependent}

    def leaf(self, node: Node) -> sp.Symbol | None:
        """Region boundary: carry-free subtrees and carry-dependent non-elementwise nodes."""
        if node not in self.dependent or node.op in LEAVES or node.op not in _POINTWISE:
            return self.symbol(node)
        return None

    def expr(self, node: Node) -> sp.Basic:
        return to_sympy([node], self.leaf)[0]

    def affine(self, node: Node) -> bool:
        """Is `node` an affine function of the carry?"""
        hit = self._affine.get(node)
        if hit is None:
            hit = self._affine[node] = self._check_affine(node)
        return hit

    def _check_affine(self, node: Node) -> bool:
        if node not in self.dependent or node.op is Op.INPUT:
            return True
        if node.op in REDUCTIONS and node.op is not Op.SUM:
            return False
        if node.op in _LINEAR_MAPS:
            return self.affine(node.args[0])
        expr = self.expr(node)
        variables = [s for s in expr.free_symbols if self.symbols.get(s) in self.dependent]
        if not all(self.affine(self.symbols[v]) for v in variables):
            return False
        for v, w in combinations(variables + variables, 2):
            if v == w and variables.count(v) == 1 and (v, w) != (v, v):
                continue
            if not _is_zero(sp.diff(expr, v, w)):
                return False
        return True


def _is_zero(e: sp.Basic) -> bool:
    if e == 0:
        return True
    if sp.count_ops(e) > _SIMPLIFY_LIMIT or _nonzero_somewhere(e):
        return False
    if e.has(sp.Max, sp.Min, sp.Piecewise, sp.Heaviside):
        return False  # simplify can run for many minutes on these (seen in CI): not shown zero
    try:
        return sp.simplify(e) == 0
    except (ValueError, TypeError):  # SymPy cannot order some terms (Max of exp(-softplus(0))): not shown zero
        return False


_PROBES = (0.3710, -1.2130, 0.8290, -0.4470, 1.6810, -0.0930, 1.1070)  # fixed: classification is deterministic


def _nonzero_somewhere(e: sp.Basic) -> bool:
    """A cheap disproof before `simplify` (which can take minutes on some Max / Min expressions):
    `e` at three fixed points, evaluated to 30 digits, is clearly nonzero at one of them."""
    symbols = sorted(e.free_symbols, key=str)
    for shift in range(3):
        point = {s: sp.Float(_PROBES[(i + 2 * shift) % len(_PROBES)] * (1 + shift), 30) for i, s in enumerate(symbols)}
        try:
            value = complex(e.xreplace(point).evalf(30))
        except (TypeError, ValueError, ZeroDivisionError):
            continue
        if value == value and abs(value) != float("inf") and abs(value) > 1e-12:
            return True
    return False


def _factors(node: Node) -> list[Node]:
    """`node` as a product: the factors of its (nested) multiplications."""
    if node.op is Op.MUL:
        return _factors(node.args[0]) + _factors(node.args[1])
    if node.op is Op.NEG:
        return _factors(node.args[0])
    return [node]


def _outer_product(b: Node, axes: tuple[str, ...], outer: tuple[str, ...]) -> bool:
    """Can `b` be written F1 * F2 with an axis of `axes` only in F1 and another only in F2, one of the two
    in `outer` (the decay constant along it: a per-key decay varies along the other)?"""
    factors = [f.axes for f in _factors(b)]
    for r in range(1, len(factors)):
        for left in combinations(range(len(factors)), r):
            ax1 = {a for i in left for a in factors[i]}
            ax2 = {a for i in range(len(factors)) if i not in left for a in factors[i]}
            only1 = {a for a in axes if a in ax1 and a not in ax2}
            only2 = {a for a in axes if a in ax2 and a not in ax1}
            if only1 and only2 and (only1 | only2) & set(outer):
                return True
    return False


def classify_state(program: Recurrence, regions: _Regions, index: int) -> StateClass:
    state, update = program.states[index], program.updates[index]
    if not regions.affine(update):
        return StateClass(state.name, "nonlinear")
    leaf = Node.make(Op.INPUT, (), state.name, state.axes)
    own = regions.symbol(leaf)
    expr = regions.expr(update)
    others = [v for v in expr.free_symbols if v != own and regions.symbols.get(v) in regions.dependent]
    a_expr, b_expr = sp.diff(expr, own), expr.subs(own, 0)
    if a_expr == 1 and index in _write_only(program):
        b = from_sympy(b_expr, regions.symbols) if b_expr.free_symbols else build.const(float(b_expr))
        return StateClass(state.name, "accumulator", "one", build.ONE, b)
    if others:  # mixes elements (a contraction / rename) or other states
        return StateClass(state.name, "general linear")
    a = from_sympy(a_expr, regions.symbols) if a_expr.free_symbols else build.const(float(a_expr))
    b = from_sympy(b_expr, regions.symbols) if b_expr.free_symbols else build.const(float(b_expr))
    outer = tuple(x for x in state.axes if x not in a.axes)
    if build.is_const(a, 1.0):
        coefficient = "one"
    elif not outer:
        coefficient = "diagonal"
    else:
        coefficient = f"shared over {format_axes(outer)}"
    family = "matrix linear" if outer and _outer_product(b, state.axes, outer) else "diagonal linear"
    return StateClass(state.name, family, coefficient, a, b)


def _write_only(program: Recurrence) -> set[int]:
    """States read by no other state's update and by no output (sums over time, like θ̄ += ...)."""
    out = set()
    for i, s in enumerate(program.states):
        leaf = Node.make(Op.INPUT, (), s.name, s.axes)
        readers = [u for j, u in enumerate(program.updates) if j != i] + [y for _, y in program.outputs]
        if leaf not in set(toposort(readers)):
            out.add(i)
    return out


def _classify_state_or_general(program: Recurrence, regions: _Regions, index: int) -> StateClass:
    """`classify_state`, or "general linear" / "nonlinear" when a coefficient has no IR form."""
    try:
        return classify_state(program, regions, index)
    except TypeError:  # SymPy gave a form `from_sympy` cannot translate: claim nothing diagonal
        family = "general linear" if regions.affine(program.updates[index]) else "nonlinear"
        return StateClass(program.states[index].name, family)


def _node(e: sp.Basic, symbols: dict) -> Node:
    return from_sympy(e, symbols) if e.free_symbols else build.const(float(e))


def _complex_pair(program: Recurrence, regions: _Regions, i: int, j: int) -> tuple[StateClass, StateClass] | None:
    """States i (real part) and j (imaginary part) as one complex diagonal recurrence (module
    docstring), or None where their updates are not of that form."""
    si, sj = program.states[i], program.states[j]
    ui, uj = program.updates[i], program.updates[j]
    if si.axes != sj.axes or not (regions.affine(ui) and regions.affine(uj)):
        return None
    p = regions.symbol(Node.make(Op.INPUT, (), si.name, si.axes))
    q = regions.symbol(Node.make(Op.INPUT, (), sj.name, sj.axes))
    ei, ej = regions.expr(ui), regions.expr(uj)
    for e in (ei, ej):
        if any(v not in (p, q) and regions.symbols.get(v) in regions.dependent for v in e.free_symbols):
            return None
    app, apq, aqp, aqq = sp.diff(ei, p), sp.diff(ei, q), sp.diff(ej, p), sp.diff(ej, q)
    if apq == 0 or not (_is_zero(app - aqq) and _is_zero(apq + aqp)):
        return None
    bp, bq = ei.subs({p: 0, q: 0}), ej.subs({p: 0, q: 0})
    try:
        a, a_im = _node(app, regions.symbols), _node(aqp, regions.symbols)
        b_p, b_q = _node(bp, regions.symbols), _node(bq, regions.symbols)
    except TypeError:  # a form from_sympy cannot translate: no pair claimed
        return None
    coef_axes = set(a.axes) | set(a_im.axes)
    if not coef_axes <= set(si.axes):
        return None
    outer = tuple(x for x in si.axes if x not in coef_axes)
    coefficient = f"shared over {format_axes(outer)}" if outer else "diagonal"
    return (StateClass(si.name, "diagonal linear", coefficient, a, b_p, sj.name, a_im, False),
            StateClass(sj.name, "diagonal linear", coefficient, a, b_q, si.name, a_im, True))


def _complex_pairs(program: Recurrence, regions: _Regions, states: list[StateClass]) -> None:
    """Replaces, in `states`, the general-linear states that pair up as complex diagonal ones."""
    open_ = [i for i, c in enumerate(states) if c.family == "general linear"]
    for i in open_:
        for j in open_:
            if j <= i or states[i].family != "general linear" or states[j].family != "general linear":
                continue
            pair = _complex_pair(program, regions, i, j)
            if pair is not None:
                states[i], states[j] = pair


def classify(program: Recurrence) -> Classification:
    regions = _Regions(program)
    states = [_classify_state_or_general(program, regions, i) for i in range(len(program.states))]
    _complex_pairs(program, regions, states)
    states = tuple(states)
    ranked = [s.family for s in states if s.family in FAMILIES] or ["diagonal linear"]
    family = max(ranked, key=FAMILIES.index)
    return Classification(family, program.reverse, states)

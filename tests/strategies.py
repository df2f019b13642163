"""Hypothesis strategies for random well-formed recurrences, and random inputs for them.

`recurrences()` writes the source of a random step function (states, sequences and params over
random subsets of a few named axes; an elementwise expression tree of depth <= 4 with reductions
and dots), saves it to a file and hands it to `ssmc.recurrence`, so a failing example prints as
readable source and SpecError locations point at real lines. `diagonal_linear_recurrences()`
restricts every update to ``h = a(x) * h + b(x)`` with a, b free of any state. Both draw the
elementary ops (sin, cos, tan, atan2, log1p, expm1, clamp), reductions over two axes at once and
LayerNorm / RMSNorm / softmax over one or two axes; `recurrences()` also values from earlier steps,
``x.shift(k)`` (see `FREE_EXTRA`, `ALL_EXTRA`).

The specs are numerically safe by construction: every operand is bounded (exp only of bounded
arguments, division only by ``1 + softplus(.)``, sqrt only of softplus), and the state update is
non-expansive in the states (sup norm), so float64 rounding cannot grow along a long sequence:
each generated value carries a bound on its magnitude and on its Lipschitz constant with respect
to the states, and the state-dependent part of an update is scaled to keep that constant < 1.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field

import numpy as np
from hypothesis import note
from hypothesis import strategies as st

import ssmc
from ssmc.ir.ops import Op
from ssmc.runtime.random_inputs import random_recurrence_inputs

AXES = ("b", "d", "n", "k")
MAX_SIZE = 5          # axis sizes of `draw_inputs` are 2..5 (ssmc.runtime.random_inputs.axis_sizes)
INPUT_BOUND = 3.0     # inputs are 0.5 * standard normal: |x| < 3 in practice
STATE_BOUND = 3.0     # initial states likewise; updates keep states within max(3, their input bound)
LINEAR_BOUND = 1e6    # a stand-in bound for states of a diagonal linear recurrence (read by outputs only)

_DIR = tempfile.mkdtemp(prefix="ssmc_generated_specs_")
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)


@dataclass(frozen=True)
class Expr:
    """A generated value: its source text, axes, |value| bound and Lipschitz constant in the states."""

    code: str
    axes: frozenset[str]
    bound: float
    lip: float = 0.0
    number: bool = False  # a Python number at trace time (constants folded by Python), not a tensor


@dataclass
class Source:
    """The body of the step function being generated: one assignment per interior value."""

    lines: list[str] = field(default_factory=list)

    def emit(self, code: str, axes, bound: float, lip: float, number: bool = False) -> Expr:
        name = f"v{len(self.lines)}"
        self.lines.append(f"    {name} = {code}")
        return Expr(name, frozenset(axes), min(bound, 1e300), min(lip, 1e300), number)


# (template, bound of the result given the operand's bound B, Lipschitz factor)
UNARY = (
    ("ssmc.tanh({0})", lambda b: min(b, 1.0), 1.0),
    ("np.tanh({0})", lambda b: min(b, 1.0), 1.0),
    ("ssmc.sigmoid({0})", lambda b: 1.0, 0.25),
    ("ssmc.softplus({0})", lambda b: b + math.log(2.0), 1.0),
    ("ssmc.silu({0})", lambda b: b, 1.1),
    ("ssmc.gelu({0})", lambda b: b, 1.13),
    ("ssmc.relu({0})", lambda b: b, 1.0),
    ("-{0}", lambda b: b, 1.0),
    ("ssmc.exp(-ssmc.softplus({0}))", lambda b: 1.0, 1.0),
    ("ssmc.exp(ssmc.tanh({0}))", lambda b: math.e, math.e),
    ("ssmc.sqrt(ssmc.softplus({0}))", lambda b: math.sqrt(b + math.log(2.0)), 0.5),
    ("ssmc.sin({0})", lambda b: min(b, 1.0), 1.0),
    ("np.cos({0})", lambda b: 1.0, 1.0),
    # |d/dx tan(0.5 tanh x)| <= 0.5 (1 + tan(0.5)**2) < 0.65
    ("ssmc.tan(0.5 * ssmc.tanh({0}))", lambda b: math.tan(0.5), 0.65),
    ("ssmc.log1p(ssmc.softplus({0}))", lambda b: math.log1p(b + math.log(2.0)), 1.0),
    ("ssmc.expm1(-ssmc.softplus({0}))", lambda b: 1.0, 1.0),
    ("ssmc.clamp({0}, -1.0, 2.0)", lambda b: min(b, 2.0), 1.0),
)

# (template, bound from (B0, B1), Lipschitz from (B0, L0, B1, L1))
BINARY = (
    ("{0} + {1}", lambda b0, b1: b0 + b1, lambda b0, l0, b1, l1: l0 + l1),
    ("{0} - {1}", lambda b0, b1: b0 + b1, lambda b0, l0, b1, l1: l0 + l1),
    ("{0} * {1}", lambda b0, b1: b0 * b1, lambda b0, l0, b1, l1: l0 * b1 + l1 * b0),
    # d/dy 1 / (1 + softplus(y)) = -sigmoid(y) / (1 + softplus(y))**2, at most 1 in size
    ("{0} / (1 + ssmc.softplus({1}))", lambda b0, b1: b0, lambda b0, l0, b1, l1: l0 + b0 * l1),
    ("ssmc.maximum({0}, {1})", max, lambda b0, l0, b1, l1: max(l0, l1)),
    ("ssmc.minimum({0}, {1})", max, lambda b0, l0, b1, l1: max(l0, l1)),
    # atan2(y, x) with x >= 1: |d/dy| <= 1, |d/dx| <= 1/2
    ("ssmc.atan2({0}, 1 + ssmc.softplus({1}))", lambda b0, b1: min(b0, math.pi / 2),
     lambda b0, l0, b1, l1: l0 + 0.5 * l1),
)

# (template, bound factor, Lipschitz factor) of a reduction over one axis of size <= MAX_SIZE (over several
# axes at once, the factors to the power of their number)
REDUCTIONS = (
    ("{0}.sum({axis!r})", MAX_SIZE, MAX_SIZE),
    ("ssmc.sum({0}, {axis!r})", MAX_SIZE, MAX_SIZE),
    ("{0}.mean({axis!r})", 1.0, 1.0),
    ("{0}.max({axis!r})", 1.0, 1.0),
)

# (template, bound, Lipschitz factor) of a norm over one or two axes (at most MAX_SIZE**2 elements n). With
# eps = 1 a LayerNorm's output is at most sqrt(n) <= MAX_SIZE in size and its sup-norm Lipschitz constant
# at most 2 + sqrt(n) max_v v / (v + 1)**1.5 < 4 (3 for RMSNorm); softmax's Jacobian diag(p) - p p^T has
# rows summing to at most 2 p (1 - p) <= 1/2
NORMS = (
    ("ssmc.layernorm({0}, over={axes!r}, eps=1.0)", MAX_SIZE, 4.0),
    ("ssmc.rmsnorm({0}, over={axes!r}, eps=1.0)", MAX_SIZE, 3.0),
    ("ssmc.softmax({0}, over={axes!r})", 1.0, 0.5),
)

GATES = ("ssmc.sigmoid({0})", "ssmc.exp(-ssmc.softplus({0}))")  # into (0, 1)

# Kinds of expression a generator may add to the base ones (`expression`'s `extra`): "multi",
# reductions over two axes at once; "norm", a LayerNorm / RMSNorm / softmax over one or two axes;
# "shift", a value from 1-3 steps earlier (x.shift(k): states the trace adds). Multi-axis reductions and
# norms of the inputs keep a diagonal recurrence diagonal; a shift makes it read states.
FREE_EXTRA = ("multi", "norm")
ALL_EXTRA = ("multi", "norm", "shift")


def _const(draw) -> Expr:
    value = draw(st.sampled_from((0.5, -1.0, 2.0, 0.25, 1.5, -0.75, 3.0, -2.5)))
    return Expr(f"({value!r})", frozenset(), abs(value), number=True)


def expression(draw, src: Source, leaves: list[Expr], depth: int, over: frozenset[str] | None = None,
               extra: tuple[str, ...] = ()) -> Expr:
    """A random expression over `leaves` (and constants), at most `depth` ops deep; reductions, dots and
    norms over the axes `over` only, where given; the kinds `extra` (FREE_EXTRA, ALL_EXTRA) too."""
    ops = [k for k in extra if k != "multi"]
    kinds = ("leaf", "unary", "binary", "binary", "where", "reduce", "dot", *(("extra",) if ops else ()))
    kind = draw(st.sampled_from(kinds)) if depth > 0 else "leaf"
    if kind == "extra":  # one kind among the base ones' seven, so most specs keep a plain core
        kind = draw(st.sampled_from(ops))
    if kind == "leaf":
        return draw(st.sampled_from(leaves)) if draw(st.integers(0, 5)) else _const(draw)

    def sub() -> Expr:
        return expression(draw, src, leaves, depth - 1, over, extra)

    if kind == "shift":
        x = sub()
        if x.number:
            return x
        k = draw(st.integers(1, 3))
        # a shift state holds the value of k steps before: as large, and as sensitive to the states then
        return src.emit(f"({x.code}).shift({k})", x.axes, x.bound, x.lip)
    if kind == "norm":
        x = sub()
        axes = sorted(x.axes if over is None else x.axes & over)
        if not axes:
            return x
        chosen = draw(st.lists(st.sampled_from(axes), min_size=1, max_size=2, unique=True))
        template, bound, lip = draw(st.sampled_from(NORMS))
        return src.emit(template.format(x.code, axes=" ".join(chosen)), x.axes, bound, lip * x.lip)
    if kind == "unary":
        x = sub()
        if x.number and draw(st.integers(0, 3)):  # a function of a constant now and then
            return x
        template, bound, lip = draw(st.sampled_from(UNARY))
        number = x.number and not template.startswith("ssmc.")  # -c and np.tanh(c) stay numbers
        return src.emit(template.format(x.code), x.axes, bound(x.bound), lip * x.lip, number)
    if kind == "reduce":
        x = sub()
        axes = x.axes if over is None else x.axes & over
        if not axes:
            return x
        if "multi" in extra and len(axes) > 1 and draw(st.booleans()):
            return reduce_axis(draw, src, x, " ".join(draw(st.lists(st.sampled_from(sorted(axes)), min_size=2,
                                                                     max_size=2, unique=True))))
        return reduce_axis(draw, src, x, draw(st.sampled_from(sorted(axes))))
    a = sub()
    b = sub()
    shared = a.axes & b.axes if over is None else a.axes & b.axes & over
    if kind == "dot" and shared:
        axis = draw(st.sampled_from(sorted(shared)))
        return src.emit(f"ssmc.dot({a.code}, {b.code}, over={axis!r})", (a.axes | b.axes) - {axis},
                        MAX_SIZE * a.bound * b.bound, MAX_SIZE * (a.lip * b.bound + b.lip * a.bound))
    if kind == "where":
        c0 = sub()
        # a branch on the states is ill-conditioned: where the recurrence settles at the threshold (a fixed
        # point on it, or a state clamped to it by maximum), roundoff picks the branch at every step and a
        # float32 or GPU run parts from the float64 reference (h0 >= maximum(x1, p0), h0 >= v4 + c): the
        # condition compares values free of the states
        free = [x for x in leaves if not x.lip]
        if a.lip:
            a = draw(st.sampled_from(free)) if free else _const(draw)
        if c0.lip:
            c0 = draw(st.sampled_from(free)) if free else _const(draw)
        if a.number and c0.number:  # Python would compare the numbers: compare with a tensor
            c0 = draw(st.sampled_from(free or leaves))
        cmp = draw(st.sampled_from((">", "<", ">=", "<=")))
        cond = f"{a.code} {cmp} {c0.code}"
        x, y = b, sub()
        return src.emit(f"ssmc.where({cond}, {x.code}, {y.code})", a.axes | c0.axes | x.axes | y.axes,
                        max(x.bound, y.bound), max(x.lip, y.lip))
    template, bound, lip = draw(st.sampled_from(BINARY))
    number = a.number and b.number and "ssmc." not in template
    return src.emit(template.format(a.code, b.code), a.axes | b.axes, bound(a.bound, b.bound),
                    lip(a.bound, a.lip, b.bound, b.lip), number)


def reduce_axis(draw, src: Source, x: Expr, axis: str) -> Expr:
    """`x` reduced over `axis` (one name, or several separated by spaces)."""
    template, bound, lip = draw(st.sampled_from(REDUCTIONS))
    names = axis.split()
    return src.emit(template.format(x.code, axis=axis), x.axes - set(names), bound ** len(names) * x.bound,
                    lip ** len(names) * x.lip)


def reduce_to(draw, src: Source, x: Expr, axes) -> Expr:
    """Reduce away every axis of `x` outside `axes` (so it broadcasts to a state)."""
    for axis in sorted(x.axes - set(axes)):
        x = reduce_axis(draw, src, x, axis)
    return x


def _scaled(src: Source, x: Expr, target: float = 0.9) -> Expr:
    """`x` times a constant that brings its Lipschitz constant in the states to at most `target`."""
    if x.lip <= target:
        return x
    c = float(f"{target / x.lip:.3g}")
    return src.emit(f"{c!r} * {x.code}", x.axes, c * x.bound, c * x.lip)


@dataclass
class Signature:
    states: list[tuple[str, tuple[str, ...]]]
    seqs: list[tuple[str, tuple[str, ...]]]
    params: list[tuple[str, tuple[str, ...]]]

    def text(self) -> str:
        roles = [("State", self.states), ("Seq", self.seqs), ("Param", self.params)]
        return ", ".join(f"{name}: ssmc.{role}[{' '.join(axes)!r}]"
                         for role, group in roles for name, axes in group)

    def free_leaves(self) -> list[Expr]:
        return [Expr(name, frozenset(axes), INPUT_BOUND) for name, axes in self.seqs + self.params]


@st.composite
def signatures(draw) -> Signature:
    names = draw(st.lists(st.sampled_from(AXES), min_size=1, max_size=len(AXES), unique=True))

    def axes(min_size=0):
        return tuple(draw(st.lists(st.sampled_from(names), min_size=min_size, max_size=len(names),
                                   unique=True)))

    def state_axes():  # a scalar state now and then
        return axes(min_size=0 if draw(st.integers(0, 4)) == 0 else 1)

    return Signature(states=[(f"h{i}", state_axes()) for i in range(draw(st.integers(1, 2)))],
                     seqs=[(f"x{i}", axes()) for i in range(draw(st.integers(1, 3)))],
                     params=[(f"p{i}", axes()) for i in range(draw(st.integers(0, 2)))])


def _gate(draw, src: Source, free: list[Expr], axes, depth: int, over: frozenset[str] | None = None,
          extra: tuple[str, ...] = ()) -> Expr:
    g = reduce_to(draw, src, expression(draw, src, free, depth, over, extra), axes)
    return src.emit(draw(st.sampled_from(GATES)).format(g.code), g.axes, 1.0, 0.0)


def _outputs(draw, src: Source, states: list[Expr], free: list[Expr], new_states: list[Expr]) -> list[Expr]:
    """1-2 outputs: a new state, an old state, or an expression of new / old states and inputs."""
    outs = []
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(("new", "old", "expr", "expr")))
        if kind == "new":
            outs.append(draw(st.sampled_from(new_states)))
        elif kind == "old":
            outs.append(draw(st.sampled_from(states)))
        else:
            outs.append(expression(draw, src, states + free + new_states, 2))
    return outs


def run_source(text: str, stem: str, module: str) -> dict:
    """The namespace of `text` run as module `module`, from a file of its own (`stem`_<hash of text>.py, so a
    failing example's traceback shows its lines); `text` noted to Hypothesis where inside a test."""
    path = os.path.join(_DIR, f"{stem}_{hashlib.sha1(text.encode()).hexdigest()[:16]}.py")
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(text)
    namespace: dict = {"__name__": module}
    exec(compile(text, path, "exec"), namespace)
    with contextlib.suppress(Exception):  # not inside a Hypothesis test (e.g. `.example()`)
        note(text)
    return namespace


def build_spec(sig: Signature, src: Source, updates: list[Expr], outputs: list[Expr]):
    """Write the step function to a file, trace it with `ssmc.recurrence`; `.source` holds the text."""
    carry = updates[0].code if len(updates) == 1 else "(" + ", ".join(u.code for u in updates) + ")"
    ys = outputs[0].code if len(outputs) == 1 else "(" + ", ".join(y.code for y in outputs) + ")"
    text = "\n".join(["import numpy as np", "", "import ssmc", "", "",
                      f"def step({sig.text()}):", *src.lines, f"    return {carry}, {ys}", ""])
    spec = ssmc.recurrence(run_source(text, "spec", "ssmc_generated_spec")["step"])
    spec.source = text
    return spec


@st.composite
def recurrences(draw, max_depth: int = 4):
    """A random well-formed recurrence (see the module docstring) as an `ssmc.recurrence` spec.

    Each state's update is one of: ``a * h + (1 - a) * tanh(c * E)`` (a gate in (0, 1) free of
    states, E any expression of states and inputs), ``tanh(c * E)``, or ``a * h + (1 - a) * b``
    (b free of states); c keeps the update non-expansive in the states.
    """
    sig = draw(signatures())
    src = Source()
    free = sig.free_leaves()
    kinds = [draw(st.sampled_from(("gated", "tanh", "linear"))) for _ in sig.states]
    bounds = [STATE_BOUND] * len(sig.states)
    linear = {}
    for i, ((_, axes), kind) in enumerate(zip(sig.states, kinds)):
        if kind == "linear":  # b first: it bounds the state, which the other updates read
            b = reduce_to(draw, src, expression(draw, src, free, max_depth - 1, extra=ALL_EXTRA), axes)
            linear[i] = b
            bounds[i] = max(STATE_BOUND, b.bound)
    states = [Expr(name, frozenset(axes), bound, 1.0) for (name, axes), bound in zip(sig.states, bounds)]
    leaves = states + free
    updates = []
    for i, ((name, axes), kind) in enumerate(zip(sig.states, kinds)):
        if kind == "linear":
            a = _gate(draw, src, free, axes, max_depth - 1, extra=ALL_EXTRA)
            code = f"{a.code} * {name} + (1 - {a.code}) * {linear[i].code}"
        else:
            e = _scaled(src, reduce_to(draw, src, expression(draw, src, leaves, max_depth, extra=ALL_EXTRA), axes))
            t = src.emit(f"ssmc.tanh({e.code})", e.axes, 1.0, e.lip)
            if kind == "tanh":
                if t.axes != set(axes):  # a new state value has all its state's axes: broadcast on purpose
                    t = src.emit(f"{t.code}.broadcast({' '.join(axes)!r})", set(axes), 1.0, t.lip)
                updates.append(t)
                continue
            a = _gate(draw, src, free, axes, max_depth - 1, extra=ALL_EXTRA)
            code = f"{a.code} * {name} + (1 - {a.code}) * {t.code}"
        updates.append(src.emit(code, set(axes), bounds[i], 1.0))
    new_states = [Expr(u.code, u.axes, b, 1.0) for u, b in zip(updates, bounds)]
    return build_spec(sig, src, updates, _outputs(draw, src, states, free, new_states))


@st.composite
def diagonal_linear_recurrences(draw, max_depth: int = 3):
    """A random recurrence whose every update is ``h = a(x) * h + b(x)``, a and b free of states.

    a is a gate in (0, 1) or a tanh in (-1, 1), over any subset of the state's axes; b is any
    expression of the inputs, sometimes scaled by (1 - a).
    """
    sig = draw(signatures())
    src = Source()
    free = sig.free_leaves()
    updates = []
    for name, axes in sig.states:
        if draw(st.booleans()):
            a = _gate(draw, src, free, axes, max_depth, extra=FREE_EXTRA)
        else:
            g = reduce_to(draw, src, expression(draw, src, free, max_depth, extra=FREE_EXTRA), axes)
            a = src.emit(f"ssmc.tanh({g.code})", g.axes, 1.0, 0.0)
        b = reduce_to(draw, src, expression(draw, src, free, max_depth, extra=FREE_EXTRA), axes)
        if draw(st.booleans()):
            b = src.emit(f"(1 - {a.code}) * {b.code}", a.axes | b.axes, 2 * b.bound, 0.0)
        updates.append(src.emit(f"{a.code} * {name} + {b.code}", set(axes), LINEAR_BOUND, 1.0))
    states = [Expr(name, frozenset(axes), LINEAR_BOUND, 1.0) for name, axes in sig.states]
    return build_spec(sig, src, updates, _outputs(draw, src, states, free, updates))


def draw_inputs(spec, length: int, seed: int, sizes: dict[str, int] | None = None) -> dict[str, np.ndarray]:
    """Keyword arguments (layout "t ...") for `spec`: sequences, params and initial states, float64."""
    program = getattr(spec, "program", spec)
    return random_recurrence_inputs(program, length, np.random.default_rng(seed), sizes=sizes)


def time_last(spec, arrays: dict) -> dict:
    """`arrays` (layout "t ...") with each sequence's time axis moved last (layout "... t")."""
    seqs = {d.name for d in spec.program.seqs}
    return {k: np.ascontiguousarray(np.moveaxis(v, 0, -1)) if k in seqs else v for k, v in arrays.items()}


@st.composite
def layers(draw):
    """A random layer (an `ssmc.recurrence`): a scan over [b d] or [b d n] (linear, gated or tanh),
    the D skip, an optional gate, an RMSNorm or LayerNorm over d (optional weight and bias), an
    optional residual add; sometimes the un-normalised value as a second output."""
    with_n = draw(st.booleans())
    kind = draw(st.sampled_from(["linear", "gated", "tanh"]))
    norm = draw(st.sampled_from(["rmsnorm", "layernorm"]))
    gate = draw(st.sampled_from([None, "silu", "sigmoid", "gelu"]))
    residual, weight, raw_too = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    bias = norm == "layernorm" and draw(st.booleans())
    state = "b d n" if with_n else "b d"
    args = [f"h: ssmc.State[{state!r}]", "x: ssmc.Seq['b d']", "a: ssmc.Seq['b d']", "D: ssmc.Param['d']"]
    args += ["C: ssmc.Seq['b n']"] * with_n + ["z: ssmc.Seq['b d']"] * bool(gate)
    args += ["res: ssmc.Seq['b d']"] * residual + ["w: ssmc.Param['d']"] * weight + ["beta: ssmc.Param['d']"] * bias
    update = {"linear": "decay * h + x",
              "gated": "decay * h + (1 - decay) * ssmc.tanh(x + 0.5 * h)",
              "tanh": "ssmc.tanh(0.5 * h + x)"}[kind]
    body = ["    decay = ssmc.sigmoid(a)", f"    h = {update}",
            "    y = " + ("ssmc.dot(h, C, over='n')" if with_n else "h") + " + D * x"]
    if gate:
        body.append(f"    y = y * ssmc.{gate}(z)")
    extra = ", weight=w" * weight + ", bias=beta" * bias
    body.append(f"    out = ssmc.{norm}(y, over='d'{extra})")
    if residual:
        body.append("    out = out + res")
    body.append("    return h, (out, y)" if raw_too else "    return h, out")
    text = "\n".join(["import ssmc", "", "", f"def step({', '.join(args)}):", *body, ""])
    return ssmc.recurrence(run_source(text, "layer", "ssmc_generated_spec")["step"])


@st.composite
def state_axis_recurrences(draw, max_depth: int = 2):
    """A random recurrence shaped like Mamba-1's: states over [b d n], sequences over [b d] and [b n],
    params over [d n] (and [d]). Each update is ``a * h + (1 - a) * b`` (a a gate in (0, 1), b free of
    states: diagonal linear) or ``a * h + (1 - a) * tanh(c * (w * h + b))`` (nonlinear); each output
    a reduction over n of a new state times an expression of the inputs, sometimes plus one of the
    inputs alone. Expressions of the inputs reduce over n only, so every row [b d] is a recurrence of
    its own."""
    extra_seqs = draw(st.sampled_from([[], [("x1", ("b", "d"))], [("s1", ("b", "n"))]]))
    sig = Signature(states=[(f"h{i}", ("b", "d", "n")) for i in range(draw(st.integers(1, 2)))],
                    seqs=[("x0", ("b", "d")), ("s0", ("b", "n")), *extra_seqs],
                    params=[("p0", ("d", "n")), *draw(st.sampled_from([[], [("p1", ("d",))]]))])
    src = Source()
    free = sig.free_leaves()
    only_n = frozenset("n")  # reductions over n only: every row [b d] stays its own recurrence

    def inputs(axes) -> Expr:
        return reduce_to(draw, src, expression(draw, src, free, max_depth, only_n), axes)

    def gate(axes) -> Expr:
        return _gate(draw, src, free, axes, max_depth, only_n)

    updates = []
    for name, axes in sig.states:
        a = gate(axes)
        b = inputs(axes)
        if draw(st.booleans()):
            updates.append(src.emit(f"{a.code} * {name} + (1 - {a.code}) * {b.code}", set(axes),
                                    max(STATE_BOUND, b.bound), 1.0))
        else:
            w = gate(axes)
            c = float(f"{0.9 / (1.0 + b.bound):.3g}")
            t = src.emit(f"ssmc.tanh({c!r} * ({w.code} * {name} + {b.code}))", set(axes), 1.0, c)
            updates.append(src.emit(f"{a.code} * {name} + (1 - {a.code}) * {t.code}", set(axes), STATE_BOUND, 1.0))
    outputs = []
    for _ in range(draw(st.integers(1, 2))):
        new = draw(st.sampled_from(updates))
        e = inputs(("b", "d", "n"))
        y = reduce_axis(draw, src, src.emit(f"{new.code} * {e.code}", set(new.axes), new.bound * e.bound, 0.0), "n")
        if draw(st.booleans()):
            x = inputs(("b", "d"))
            y = src.emit(f"{y.code} + {x.code}", y.axes | x.axes, y.bound + x.bound, 0.0)
        outputs.append(y)
    return build_spec(sig, src, updates, outputs)


@ssmc.recurrence
def param_in_setup(h: ssmc.State["b d n"], u: ssmc.Seq["b d"], delta: ssmc.Seq["b d"], A: ssmc.Param["d n"],
                   B: ssmc.Seq["b n"], C: ssmc.Seq["b n"]):
    """Mamba-shaped, A read as exp(dt A) and as tanh(A), which the lanes kernel hoists into its setup:
    the body's exp(dt A) as exp2 of A loaded times log2 e must leave the setup's A as it is."""
    dt = ssmc.softplus(delta)
    h = ssmc.exp(dt * A) * h + ssmc.tanh(A) * u * B
    return h, ssmc.dot(h, C, over="n")


@ssmc.recurrence
def summed_over_batch(h: ssmc.State["b d k"], x: ssmc.Seq["b"], w: ssmc.Seq["b d k"]):
    """A random spec's shape (test_warps_sharing_a_recurrence, 2026-11-26): a decay per b, a state with
    axes of its own (d k) and an output summed over the batch. Its staged core's adjoint runs, time
    contiguous and L >= 64, as the reverse state-major warp kernel, whose steps were read at
    L - 1 - t0 + tt instead of L - 1 - (t0 + tt): gradients silently wrong."""
    f = ssmc.exp(-ssmc.softplus(x))
    h = f * h + (1 - f) * x
    s = ssmc.dot(w, h, over="k")
    return h, ssmc.dot(s, x / (1 + ssmc.softplus(w)), over="b")


@ssmc.recurrence
def many_sequences(h: ssmc.State["b d"], a: ssmc.Seq["b d"], x1: ssmc.Seq["b d"], x2: ssmc.Seq["b d"],
                   x3: ssmc.Seq["b d"], x4: ssmc.Seq["b d"], x5: ssmc.Seq["b d"], x6: ssmc.Seq["b d"],
                   x7: ssmc.Seq["b d"], x8: ssmc.Seq["b d"], x9: ssmc.Seq["b d"], x10: ssmc.Seq["b d"],
                   x11: ssmc.Seq["b d"]):
    """A scan of twelve sequences (2026-11-26): in float64, time contiguous, its adjoint's warp kernel
    staged 26 per-step arrays of 5 KiB in shared memory and did not compile (ptxas: 133 KB, 48 KB
    max); it now stages those that fit and reads the others in place."""
    h = a * h + x1 * x2 + x3 * x4 + x5 * x6 + x7 * x8 + x9 * x10 + x11
    return h, h * x1


@st.composite
def coupled_recurrences(draw):
    """A random recurrence whose states feed each other: 2-4 states over [b k] (a [b] one now and
    then), each updated as one of

    - ``shift``: another state's old value (a shift register, or two states swapped), or its own;
    - ``rotate`` (two states): a complex state as a real pair, ``(re, im) <- lam * (re, im) + x`` with
      ``lam = lr + i li``, ``|lam| < 0.85`` from two params;
    - ``cell``: an LSTM-like cell, ``z = dot(s.rename(k="j"), U, over="j") + dot(x1, W, over="i")`` over
      a gate axis ``g`` of static size, unbound into its gates, with a norm inside the update (a
      layernorm or rmsnorm over k, a mean over the two axes "g k", or another state's sum over k
      subtracted) and a sigmoid gate mixing the own state with ``tanh`` of the rest;
    - ``linear``: ``a * h + (1 - a) * x0``, a gate of the inputs.

    Params of rank 2 (U [j g k], W [i g k]) and 1 (the rotation's [k]). The coefficients keep each
    step close to non-expansive in the states (|U|, |W| < 3 on the inputs drawn), so float64 rounding
    stays small over a few hundred steps.
    """
    gates = draw(st.sampled_from((1, 2, 4)))
    count = draw(st.integers(2, 4))
    scalar = draw(st.integers(0, 4)) == 0  # the last state over [b] alone
    states = [(f"h{i}", ("b",) if scalar and i == count - 1 else ("b", "k")) for i in range(count)]
    seqs = [("x0", ("b", "k")), ("x1", ("b", "i"))]
    params = [("U", ("j", f"g={gates}", "k")), ("W", ("i", f"g={gates}", "k")), ("lr", ("k",)), ("li", ("k",))]
    sig = Signature(states, seqs, params)
    src = Source()
    names = [n for n, _ in states]
    full = [n for n, axes in states if axes == ("b", "k")]
    updates: list[str | None] = [None] * count
    i = 0
    while i < count:
        kinds = ["shift", "cell", "linear"] + ["rotate"] * (i + 1 < count and states[i + 1][1] == states[i][1])
        kind = draw(st.sampled_from(kinds))
        name, axes = states[i]
        if kind == "rotate":
            re, im = name, names[i + 1]
            src.lines += [f"    lam_r{i} = 0.6 * ssmc.tanh(lr)", f"    lam_i{i} = 0.6 * ssmc.tanh(li)"]
            updates[i] = f"lam_r{i} * {re} - lam_i{i} * {im} + x0"
            updates[i + 1] = f"lam_r{i} * {im} + lam_i{i} * {re}"
            i += 2
            continue
        if kind == "shift":
            same = [n for n, a in states if a == axes]
            updates[i] = draw(st.sampled_from(same))
        elif kind == "linear":
            x = "x0.mean('k')" if axes == ("b",) else "x0"
            src.lines.append(f"    a{i} = ssmc.sigmoid({x})")
            updates[i] = f"a{i} * {name} + (1 - a{i}) * 0.5 * {x}"
        else:
            s = draw(st.sampled_from(full))
            norm = draw(st.sampled_from(("layernorm", "rmsnorm", "mean2", "subsum", "none")))
            src.lines.append(f"    z{i} = 0.1 * ssmc.dot({s}.rename(k='j'), U, over='j') "
                             "+ 0.2 * ssmc.dot(x1, W, over='i')")
            if norm == "mean2":
                src.lines.append(f"    z{i} = z{i} - z{i}.mean('g k')")
            parts = [f"z{i}_{g}" for g in range(gates)]
            src.lines.append(f"    {', '.join(parts)}{',' if gates == 1 else ''} = z{i}.unbind('g')")
            c = f"ssmc.tanh({parts[-1]} + 0.5 * x0)"
            if norm in ("layernorm", "rmsnorm"):
                c = f"ssmc.tanh(0.5 * ssmc.{norm}({parts[-1]} + 0.5 * x0, over='k'))"
            elif norm == "subsum":
                other = draw(st.sampled_from(full))
                c = f"ssmc.tanh({parts[-1]} + 0.1 * ({other} - {other}.sum('k')))"
            src.lines.append(f"    c{i} = {c}")
            gate = f"ssmc.sigmoid({parts[0]})"
            if axes == ("b",):
                src.lines.append(f"    c{i} = c{i}.mean('k')")
                gate = f"ssmc.sigmoid({parts[0]}.sum('k'))"
            src.lines.append(f"    f{i} = {gate}")
            updates[i] = f"f{i} * {name} + (1 - f{i}) * c{i}"
        i += 1
    bounds = [STATE_BOUND] * count
    new = [Expr(u, frozenset(axes), b, 1.0) for u, (_, axes), b in zip(updates, states, bounds)]
    for j, u in enumerate(new):  # every update a name of its own, so outputs can read it
        src.lines.append(f"    n{j} = {u.code}")
        new[j] = Expr(f"n{j}", u.axes, u.bound, 1.0)
    old = [Expr(n, frozenset(axes), STATE_BOUND, 1.0) for n, axes in states]
    outputs = []
    for _ in range(draw(st.integers(1, 2))):
        kind = draw(st.sampled_from(("new", "old", "sum")))
        if kind == "sum":
            a, b = draw(st.sampled_from(new)), draw(st.sampled_from(old))
            outputs.append(src.emit(f"{a.code} * 0.5 + {b.code}", a.axes | b.axes, 4.5, 0.0))
        else:
            outputs.append(draw(st.sampled_from(new if kind == "new" else old)))
    return build_spec(sig, src, new, outputs)


# Ops whose value or gradient jumps where two of their operands meet: a max's gradient goes to its
# argmax, a comparison flips. Near such a point a backend whose rounding differs from the interpreter's
# in the last bits (a GPU's tanh, a sum's order) may take the other side: both are right for their own
# values, and no tolerance on the gradient can tell them apart.
_KINKS = {Op.REDUCE_MAX, Op.MAX, Op.MIN, Op.LT, Op.LE, Op.GT, Op.GE}


def near_ties(spec, inputs: dict[str, np.ndarray], layout: str = "t ...", rel: float = 1e-7) -> bool:
    """Whether the interpreter's run of `spec` on `inputs` passes within `rel` (relative) of a kink:
    a max over an axis whose two largest entries (ties included) are that close, or a pointwise
    max / min / comparison of two values that close. Tests comparing a backend's gradients (or
    comparisons) with the interpreter's skip such draws (hypothesis.assume)."""
    from ssmc.backends.interpreter import _loop_axes, align, observing

    def margin(node, args) -> float:
        if node.op is Op.REDUCE_MAX:
            arr, axes = args[0]
            top = np.sort(np.moveaxis(np.asarray(arr), axes.index(node.arg), -1), axis=-1)
            if top.shape[-1] < 2:
                return np.inf
            gap = top[..., -1] - top[..., -2]
            return float(np.min(gap / np.maximum(1.0, np.abs(top[..., -1])), initial=np.inf))
        axes = _loop_axes(args) + node.axes
        a, b = (np.asarray(align(v, axes)) for v in args)
        return float(np.min(np.abs(a - b) / np.maximum(1.0, np.maximum(np.abs(a), np.abs(b))), initial=np.inf))

    closest = [np.inf]

    def watch(node, args):  # each kink's margin, as the interpreter evaluates it
        constant = (all(a.op in (Op.CONST, Op.IOTA, Op.SIZE) for a in node.args)
                    or (len(node.args) == 2 and node.args[0] is node.args[1]))
        if node.op in _KINKS and not constant:
            closest[0] = min(closest[0], margin(node, args))

    with observing(watch):
        ssmc.compile(spec, "interpreter", layout=layout).run(**inputs)
    return closest[0] <= rel


# -- matrix-linear specs (the chunked path) ------------------------------------------------------------------

@dataclass(frozen=True)
class MatrixLinearCase:
    """A generated matrix-linear spec, with what its inputs need to keep it well conditioned.

    `spec` is ``S[b H κ ν] = a ⊙ S + β k ⊗ v``, ``y = post(Σ_κ S ⊙ q, inputs)`` over head axes H ("h", or
    "h r": r heads per group h, q and k shared by a group's heads); every sequence's axes begin with
    "b h", so that both layouts ``"b t ..."`` and ``"b h t ..."`` apply. `draws` maps each input (and the
    state) to how its values are drawn (`MatrixLinearCase.inputs`): "normal", "key" (normal / sqrt(K)),
    "log_decay" (log of uniform(0.5, 1): ≤ 0), "decay" (uniform(0.5, 1)), "gate" (normal + 2: a sigmoid
    near 1), "small" (0.5 normal), "log_rate" (uniform(-1, 1)). `sizes` are the axes' sizes; `kind`
    a short description ("decay per head, β, skip, gate") for the test's events."""

    spec: object
    sizes: dict
    draws: dict
    decay: str                  # "none", "head" or "key"
    kind: str
    decay_inputs: frozenset     # the inputs the decay or β reads (their gradients sum over steps)

    def inputs(self, rng: np.random.Generator, length: int, layout: str = "b t ...") -> dict[str, np.ndarray]:
        """Keyword arguments in `layout` ("b t ..." or "b h t ..."), float64, the initial state included."""
        program = self.spec.program
        out = {}
        key = self.sizes[_KEY_AXIS[program.name]] if program.name in _KEY_AXIS else 1
        for d in (*program.inputs, *program.states):
            shape = [self.sizes[a.split("=")[0]] for a in d.axes]
            seq = d in program.seqs
            if seq:  # time after "b" or after "b h" (every sequence's axes begin with them)
                shape.insert(1 if layout == "b t ..." else 2, length)
            how = self.draws[d.name]
            if how == "log_decay":
                x = np.log(rng.uniform(0.5, 1.0, shape))
            elif how == "decay":
                x = rng.uniform(0.5, 1.0, shape)
            elif how == "log_rate":
                x = rng.uniform(-1.0, 1.0, shape)
            else:
                x = rng.standard_normal(shape)
                x = {"key": x / math.sqrt(key), "gate": x + 2.0, "small": 0.5 * x}.get(how, x)
            out[d.name] = x
        return out


_KEY_AXIS: dict[str, str] = {}  # spec name -> its key axis (for the "key" draw's scale)

# decays per head: (source with {h} for the head axes' argument list, the inputs it declares, their draws)
_HEAD_DECAYS = (
    # Mamba-2's: dt a sequence, A = -exp(A_log) a param
    ("ssmc.exp(-ssmc.softplus(dt) * ssmc.exp(A_log))", (("dt", "Seq", "H"), ("A_log", "Param", "P")),
     {"dt": "normal", "A_log": "log_rate"}),
    ("ssmc.sigmoid(f)", (("f", "Seq", "H"),), {"f": "gate"}),                   # a gate, kept as is
    ("ssmc.exp(g)", (("g", "Seq", "H"),), {"g": "log_decay"}),                  # simple GLA's
    ("ssmc.exp(-ssmc.softplus(g))", (("g", "Seq", "H"),), {"g": "normal"}),
    ("gamma", (("gamma", "Param", "P"),), {"gamma": "decay"}),                  # RetNet's, given as is
    ("ssmc.sigmoid(w)", (("w", "Param", "P"),), {"w": "gate"}),
    ("0.9", (), {}),
)
# decays per key (along κ): the same with the key axis
_KEY_DECAYS = (
    ("ssmc.exp(g)", (("g", "Seq", "HK"),), {"g": "log_decay"}),                 # GLA's
    ("ssmc.sigmoid(f)", (("f", "Seq", "HK"),), {"f": "gate"}),
    ("ssmc.exp(-ssmc.softplus(g) * 0.0625)", (("g", "Seq", "HK"),), {"g": "normal"}),
    ("ssmc.exp(w)", (("w", "Param", "PK"),), {"w": "log_decay"}),
)
# β, a scalar per head and step (or a constant)
_BETAS = (
    ("ssmc.softplus(dt)", (("dt", "Seq", "H"),), {"dt": "normal"}),             # SSD's
    ("ssmc.sigmoid(bt)", (("bt", "Seq", "H"),), {"bt": "normal"}),              # DeltaNet-like
    ("bw", (("bw", "Param", "P"),), {"bw": "normal"}),
    ("2.0", (), {}),
    ("-1", (), {}),
)


@st.composite
def matrix_linear_specs(draw, sizes=None) -> MatrixLinearCase:
    """A random matrix-linear spec as a user would write one (`MatrixLinearCase`): a decay per head
    (Mamba-2's exp(-softplus(dt) exp(A_log)), a sigmoid gate, exp of a log decay, a param, a constant),
    per key (GLA's) or none; the injection ``k ⊗ v``, sometimes times a per-step β (softplus(dt), a
    sigmoid, a param, a constant, a sign) and feature maps on q and k; the output ``Σ_κ S ⊙ q`` (written
    as a dot either way round or a sum of a product), sometimes with a skip ``D ⊙ v`` (or ``+ v``) and a
    gate ``silu(z)`` or ``sigmoid(z)``. The state's axes in either order (κ before ν or after).

    `sizes`: a strategy of (batch, heads, heads per group, key, value) sizes; by default small ones (1-2
    batch, heads and heads per group, key and value 2-5)."""
    names = draw(st.sampled_from((("q", "k", "v", "k", "v"), ("C", "B", "x", "n", "p"))))
    qn, kn, vn, key, value = names
    grouped = draw(st.booleans())
    heads = ("h", "r") if grouped else ("h",)
    qk_heads = ("h",) if grouped else heads
    # a head axis r along which nothing but v varies reads as a second value axis (S[κ, (r, ν)]: the same
    # recurrence, refused as "2 value axes"): grouped heads take a decay that varies along r
    decay = draw(st.sampled_from(("head", "head", "key") if grouped else ("none", "head", "head", "key")))
    draws, lines = {}, []
    declared: dict[str, tuple] = {}  # name -> (role, axes), in the order of the step's arguments

    def declare(name, role, axes_code):
        axes = {"H": ("b", *heads), "P": heads, "HK": ("b", *heads, key), "PK": (*heads, key)}[axes_code]
        declared.setdefault(name, (role, axes))  # SSD's dt: the decay's and β's

    decay_inputs = set()
    a = None
    if decay != "none":
        choices = _HEAD_DECAYS if decay == "head" else _KEY_DECAYS
        code, inputs, how = draw(st.sampled_from([c for c in choices if c[1] or not grouped]))
        for name, role, axes_code in inputs:
            declare(name, role, axes_code)
            decay_inputs.add(name)
        draws.update(how)
        a = code
        if len(code) > 12:
            lines.append(f"    a = {code}")
            a = "a"
    beta = None
    if draw(st.booleans()):
        code, inputs, how = draw(st.sampled_from(_BETAS))
        for name, role, axes_code in inputs:
            declare(name, role, axes_code)
            decay_inputs.add(name)
        draws.update({k: v for k, v in how.items() if k not in draws})
        beta = code
    for name, axes in ((qn, ("b", *qk_heads, key)), (kn, ("b", *qk_heads, key)), (vn, ("b", *heads, value))):
        declared[name] = ("Seq", axes)
    draws.update({qn: "normal", kn: "key", vn: "normal"})
    q_map = draw(st.sampled_from(("{0}", "{0}", "ssmc.silu({0})", "0.5 * {0}")))
    k_map = draw(st.sampled_from(("{0}", "{0}", "ssmc.silu({0})", "{0} * 0.5")))
    kq, kk = q_map.format(qn), k_map.format(kn)
    injection = draw(st.sampled_from(("{k} * {v}", "{v} * {k}")))
    inj = injection.format(k=kk if k_map == "{0}" else f"({kk})", v=vn)
    if beta is not None:
        inj = draw(st.sampled_from(("{b} * {i}", "{i} * {b}"))).format(b=beta if len(beta) < 6 else f"({beta})",
                                                                         i=inj)
        if beta == "-1":
            inj = f"-({kk} * {vn})" if k_map == "{0}" else f"-(({kk}) * {vn})"
    lines.append(f"    S = {a} * S + {inj}" if a is not None else f"    S = S + {inj}")
    qq = qn if q_map == "{0}" else "qf"
    if q_map != "{0}":
        lines.append(f"    qf = {kq}")
    read = draw(st.sampled_from((f"ssmc.dot(S, {qq}, over={key!r})", f"ssmc.dot({qq}, S, over={key!r})",
                                 f"(S * {qq}).sum({key!r})")))
    lines.append(f"    o = {read}")
    skip = draw(st.sampled_from((None, None, "D", "one")))
    gate = draw(st.sampled_from((None, None, "ssmc.silu(z)", "ssmc.sigmoid(z)")))
    y = "o"
    if skip == "D":
        declared["D"] = ("Param", heads)
        draws["D"] = "normal"
        y = f"o + D * {vn}"
    elif skip == "one":
        y = f"o + {vn}"
    if gate is not None:
        declared["z"] = ("Seq", ("b", *heads, value))
        draws["z"] = "normal"
        y = f"({y}) * {gate}" if draw(st.booleans()) or skip is None else f"{y[:1]} * {gate}{y[1:]}"
    lines.append(f"    y = {y}")
    state_axes = ("b", *heads, *draw(st.sampled_from(((key, value), (value, key)))))
    draws["S"] = "small"
    order = [qn, kn, vn, *(n for n in declared if n not in (qn, kn, vn))]
    args = [f"S: ssmc.State[{' '.join(state_axes)!r}]"]
    args += [f"{n}: ssmc.{declared[n][0]}[{' '.join(declared[n][1])!r}]" for n in order]
    text = "\n".join(["import ssmc", "", "", f"def step({', '.join(args)}):", *lines, "    return S, y", ""])
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    name = f"ml_{digest}"
    text = text.replace("def step(", f"def {name}(")
    spec = ssmc.recurrence(run_source(text, "ml", "ssmc_generated_spec")[name])
    spec.source = text
    _KEY_AXIS[name] = key
    if sizes is None:
        sizes = st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 2), st.integers(2, 5),
                          st.integers(2, 5))
    b, h, r, kd, vd = draw(sizes)
    dims = {"b": b, "h": h, "r": r if grouped else 1, key: kd, value: vd}
    kind = ", ".join(filter(None, (f"decay {decay}", "grouped" if grouped else None, beta and "β",
                                   skip and "skip", gate and "gate")))
    return MatrixLinearCase(spec, dims, draws, decay, kind, frozenset(decay_inputs))

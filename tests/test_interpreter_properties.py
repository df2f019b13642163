"""Properties of the reference interpreter on random recurrences (see tests/strategies.py).

(a) it matches `naive_run` below, an independent evaluator: the IR nodes evaluated recursively,
    one time step at a time, nothing hoisted out of the loop;
(b) running [0, k) then [k, L), carrying the final states, equals running [0, L);
(c) the layouts "t ...", "b t ..." and "... t" give the same values once transposed;
(d) a reverse-time program equals the forward one on time-reversed inputs, reversed back.

Errors are normwise relative: max |got - want| / max |want| (with a floor of 1e-30).
"""

import dataclasses
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strategies import diagonal_linear_recurrences, draw_inputs, recurrences

import ssmc
from ssmc.ir.node import toposort
from ssmc.ir.ops import Op
from ssmc.ir.program import Role

NAIVE_RTOL = 1e-12   # interpreter vs naive evaluator (different formulas for sigmoid, softplus, ...)
SAME_RTOL = 1e-13    # the same computation regrouped (split, layout, reverse): only summation order differs

# derandomized: the same examples every run. The naive evaluator rounds differently (its own
# sigmoid, softplus, per-step math), so a random spec whose `where` compares a state with the value
# it converges to (h > p where h -> p) flips a branch at the tie in one evaluator only: a relative
# error of 1.5 that says nothing of either (found 2026-11-26, replayed from a local example database).
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
                derandomize=True)
SHORT = st.sampled_from([1, 7, 180])
ANY = st.one_of(recurrences(), diagonal_linear_recurrences())


def rel_err(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.size == 0:
        return 0.0
    assert np.all(np.isfinite(want)), "non-finite reference values: the strategy is not safe"
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def assert_close(got: dict, want: dict, rtol: float, what: str):
    assert got.keys() == want.keys()
    for name in want:
        err = rel_err(got[name], want[name])
        assert err <= rtol, f"{what} {name!r}: relative error {err:.3g} > {rtol:g}"


# -- the independent evaluator -------------------------------------------------------------------

def _erf(x):
    return np.vectorize(math.erf, otypes=[np.float64])(x)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


NAIVE_OPS = {
    Op.NEG: lambda x: -x, Op.EXP: np.exp, Op.LOG: np.log, Op.SQRT: np.sqrt, Op.RSQRT: lambda x: x ** -0.5,
    Op.ABS: np.abs, Op.SIGMOID: _sigmoid, Op.TANH: np.tanh,
    Op.SOFTPLUS: lambda x: np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x))),
    Op.SILU: lambda x: x * _sigmoid(x), Op.GELU: lambda x: 0.5 * x * (1.0 + _erf(x / np.sqrt(2.0))),
    Op.RELU: lambda x: np.where(x > 0, x, 0.0), Op.ERF: _erf, Op.NOT: lambda x: ~x,
    Op.SIN: np.sin, Op.COS: np.cos, Op.TAN: np.tan, Op.LOG1P: np.log1p, Op.EXPM1: np.expm1, Op.SIGN: np.sign,
    Op.ATAN2: np.arctan2,
    Op.ADD: lambda x, y: x + y, Op.SUB: lambda x, y: x - y, Op.MUL: lambda x, y: x * y,
    Op.DIV: lambda x, y: x / y, Op.POW: lambda x, y: x ** y, Op.MAX: np.maximum, Op.MIN: np.minimum,
    Op.LT: lambda x, y: x < y, Op.LE: lambda x, y: x <= y, Op.GT: lambda x, y: x > y,
    Op.GE: lambda x, y: x >= y, Op.EQ: lambda x, y: x == y, Op.NE: lambda x, y: x != y,
    Op.AND: lambda x, y: x & y, Op.OR: lambda x, y: x | y, Op.WHERE: lambda c, x, y: np.where(c, x, y),
}


def arrange(value, target, sizes):
    """A value (array, axes) as a full array over `target` axes, in that order."""
    arr, axes = value
    arr = np.asarray(arr).transpose([axes.index(a) for a in target if a in axes])
    arr = arr.reshape([sizes[a] if a in axes else 1 for a in target])
    return np.broadcast_to(arr, [sizes[a] for a in target])


def _block(sizes, parts, index):
    start = sum(sizes[p] for p in parts[:index])
    return slice(start, start + sizes[parts[index]])


def naive_eval(node, env, sizes, memo):
    """The value (array, axes) of `node`, its axes in `node.axes` order."""
    if node in memo:
        return memo[node]
    op, axes = node.op, node.axes
    args = [naive_eval(a, env, sizes, memo) for a in node.args]
    if op is Op.INPUT:
        out = arrange(env[node.arg], axes, sizes)
    elif op is Op.CONST:
        out = np.float64(node.arg)
    elif op is Op.IOTA:
        out = np.arange(sizes[node.arg], dtype=np.float64)
    elif op is Op.SIZE:
        out = np.float64(sizes[node.arg])
    elif op in NAIVE_OPS:
        out = NAIVE_OPS[op](*(arrange(a, axes, sizes) for a in args))
    elif op in (Op.SUM, Op.REDUCE_MAX):
        arr, arg_axes = args[0]
        out = (np.sum if op is Op.SUM else np.max)(arr, axis=arg_axes.index(node.arg))
        out = arrange((out, tuple(a for a in arg_axes if a != node.arg)), axes, sizes)
    elif op is Op.RENAME:
        arr, arg_axes = args[0]
        renamed = dict(node.arg)
        out = arrange((arr, tuple(renamed.get(a, a) for a in arg_axes)), axes, sizes)
    elif op is Op.SELECT:
        arr, arg_axes = args[0]
        axis, index = node.arg
        out = arrange((np.take(arr, index, axis=arg_axes.index(axis)), axes), axes, sizes)
    elif op is Op.SLICE:
        arr, arg_axes = args[0]
        axis, new, parts, index = node.arg
        i = arg_axes.index(axis)
        out = arr[(slice(None),) * i + (_block(sizes, parts, index),)]
        out = arrange((out, tuple(new if a == axis else a for a in arg_axes)), axes, sizes)
    elif op is Op.PAD:
        arr, arg_axes = args[0]
        axis, new, parts, index = node.arg
        i = arg_axes.index(new)
        full = np.zeros((*arr.shape[:i], sizes[axis], *arr.shape[i + 1:]), dtype=arr.dtype)
        full[(slice(None),) * i + (_block(sizes, parts, index),)] = arr
        out = arrange((full, tuple(axis if a == new else a for a in arg_axes)), axes, sizes)
    elif op is Op.EXPAND:
        out = arrange(args[0], axes, sizes)
    else:
        raise NotImplementedError(op)
    memo[node] = (np.asarray(out), axes)
    return memo[node]


def sizes_of(program, inputs) -> dict[str, int]:
    sizes = dict(program.static_sizes)
    for d in program.decls:
        shape = np.shape(inputs[d.name])[1:] if d.role is Role.SEQ else np.shape(inputs[d.name])
        sizes.update(zip(d.axes, shape))
    return sizes


def naive_run(program, inputs):
    """The plain loop of `Recurrence`'s docstring; inputs in layout "t ...", initial states given."""
    sizes = sizes_of(program, inputs)
    length = len(inputs[program.seqs[0].name])
    carry = {s.name: (inputs[s.name], s.axes) for s in program.states}
    outs = {name: np.empty((length, *(sizes[a] for a in y.axes))) for name, y in program.outputs}
    steps = range(length - 1, -1, -1) if program.reverse else range(length)
    with np.errstate(all="ignore"):
        for t in steps:
            env = dict(carry)
            env.update({d.name: (inputs[d.name][t], d.axes) for d in program.seqs})
            env.update({d.name: (inputs[d.name], d.axes) for d in program.params})
            memo = {}
            new = [naive_eval(u, env, sizes, memo) for u in program.updates]
            for name, y in program.outputs:
                outs[name][t] = naive_eval(y, env, sizes, memo)[0]
            carry = {s.name: (arrange(v, s.axes, sizes), s.axes) for s, v in zip(program.states, new)}
    return outs, {name: np.array(v[0]) for name, v in carry.items()}


def interpret(program_or_spec, inputs, layout="t ..."):
    program = getattr(program_or_spec, "program", program_or_spec)
    return ssmc.compile(program, backend="interpreter", layout=layout).run(**inputs)


# -- axis-less (scalar) states and params ---------------------------------------------------------

@ssmc.recurrence
def _scalar_state(h: ssmc.State[""], x: ssmc.Seq[""]):
    h = 0.5 * h + x
    return h, ssmc.tanh(h)


def test_scalar_state():
    x = np.array([1.0, -2.0, 0.5])
    ys, h = ssmc.compile(_scalar_state, backend="interpreter")(x, h=np.array(0.25), return_final_states=True)
    want = [0.5 * 0.25 + 1.0]
    for v in x[1:]:
        want.append(0.5 * want[-1] + v)
    np.testing.assert_allclose(ys, np.tanh(want), rtol=1e-15)
    assert h.shape == () and h == want[-1]


@ssmc.recurrence
def _scalar_decay(h: ssmc.State["b"], x: ssmc.Seq["b"], a: ssmc.Param[""]):
    return ssmc.exp(-ssmc.softplus(a)) * h + x, h


def test_scalar_param_chain():
    """exp(-softplus(a)) of a scalar param: 0-d values stay 0-d through chained ops."""
    x = np.ones((3, 2))
    _, h = ssmc.compile(_scalar_decay, backend="interpreter")(x, np.array(0.0), return_final_states=True)
    np.testing.assert_allclose(h, (1 + 0.5 + 0.25) * np.ones(2), rtol=1e-15)


# -- the strategies make what they promise ---------------------------------------------------------

def _state_free(node, states) -> bool:
    return not any(n.op is Op.INPUT and n.arg in states for n in toposort([node]))


@settings(max_examples=40, **SETTINGS)
@given(spec=diagonal_linear_recurrences())
def test_diagonal_linear_form(spec):
    program = spec.program
    states = {s.name for s in program.states}
    for state, update in zip(program.states, program.updates):
        assert update.op is Op.ADD
        (ah, b) = update.args
        assert ah.op is Op.MUL and ah.args[1].op is Op.INPUT and ah.args[1].arg == state.name
        assert _state_free(ah.args[0], states) and _state_free(b, states)


# -- (a) interpreter == naive evaluator ------------------------------------------------------------

def _check_against_naive(spec, length, seed):
    inputs = draw_inputs(spec, length, seed)
    outs, finals = interpret(spec, inputs)
    ref_outs, ref_finals = naive_run(spec.program, inputs)
    assert_close(outs, ref_outs, NAIVE_RTOL, "output")
    assert_close(finals, ref_finals, NAIVE_RTOL, "final state")


@settings(max_examples=120, **SETTINGS)
@given(spec=recurrences(), length=SHORT, seed=st.integers(0, 2**16))
def test_matches_naive_evaluator(spec, length, seed):
    _check_against_naive(spec, length, seed)


@settings(max_examples=60, **SETTINGS)
@given(spec=diagonal_linear_recurrences(), length=SHORT, seed=st.integers(0, 2**16))
def test_matches_naive_evaluator_diagonal_linear(spec, length, seed):
    _check_against_naive(spec, length, seed)


@settings(max_examples=8, **SETTINGS)
@given(spec=ANY, seed=st.integers(0, 2**16))
def test_matches_naive_evaluator_long(spec, seed):
    _check_against_naive(spec, 1000, seed)


# -- (b) splitting the sequence ----------------------------------------------------------------------

def _split(inputs, program, start, stop, initial=None):
    part = {d.name: inputs[d.name][start:stop] if d.role is Role.SEQ else inputs[d.name]
            for d in program.decls}
    if initial is not None:
        part.update(initial)
    return part


@settings(max_examples=60, **SETTINGS)
@given(spec=ANY, length=st.sampled_from([2, 7, 180, 1000]), cut=st.floats(0.0, 1.0),
       seed=st.integers(0, 2**16))
def test_split_sequence(spec, length, cut, seed):
    if length == 1000 and seed % 8:  # few long cases
        length = 180
    program = spec.program
    k = min(max(1, int(cut * length)), length - 1)
    inputs = draw_inputs(spec, length, seed)
    outs, finals = interpret(spec, inputs)
    outs1, mid = interpret(spec, _split(inputs, program, 0, k))
    outs2, finals2 = interpret(spec, _split(inputs, program, k, length, mid))
    joined = {name: np.concatenate([outs1[name], outs2[name]]) for name in outs}
    assert_close(joined, outs, SAME_RTOL, "output")
    assert_close(finals2, finals, SAME_RTOL, "final state")


# -- (c) layout invariance -----------------------------------------------------------------------------

def layout_order(template: str, axes: tuple[str, ...]) -> tuple[str, ...]:
    """Axis order of an array with `axes` (plus time "t") for the three templates tested here."""
    if template == "t ...":
        return ("t", *axes)
    if template == "... t":
        return (*axes, "t")
    assert template == "b t ..."
    return ("b", "t", *(a for a in axes if a != "b")) if "b" in axes else ("t", *axes)


def to_layout(arr, axes, template):
    canonical = ("t", *axes)
    return np.ascontiguousarray(arr.transpose([canonical.index(a) for a in layout_order(template, axes)]))


@settings(max_examples=60, **SETTINGS)
@given(spec=ANY, length=SHORT, seed=st.integers(0, 2**16),
       template=st.sampled_from(["b t ...", "... t"]))
def test_layout_invariance(spec, length, seed, template):
    program = spec.program
    inputs = draw_inputs(spec, length, seed)
    want = ssmc.compile(spec, backend="interpreter")(**inputs, return_final_states=True)
    moved = {d.name: to_layout(inputs[d.name], d.axes, template) if d.role is Role.SEQ else inputs[d.name]
             for d in program.decls}
    got = ssmc.compile(spec, backend="interpreter", layout=template)(**moved, return_final_states=True)
    ys, hs = (want[0] if len(program.outputs) > 1 else (want[0],)), want[1]
    got_ys, got_hs = (got[0] if len(program.outputs) > 1 else (got[0],)), got[1]
    for (name, y), w, g in zip(program.outputs, ys, got_ys):
        assert rel_err(g, to_layout(w, y.axes, template)) <= SAME_RTOL, name
    hs, got_hs = (hs, got_hs) if len(program.states) > 1 else ((hs,), (got_hs,))
    for w, g in zip(hs, got_hs):
        assert rel_err(g, w) <= SAME_RTOL


# -- (d) reverse time ------------------------------------------------------------------------------------

@settings(max_examples=60, **SETTINGS)
@given(spec=ANY, length=SHORT, seed=st.integers(0, 2**16))
def test_reverse_time(spec, length, seed):
    program = spec.program
    backward = dataclasses.replace(program, reverse=True)
    inputs = draw_inputs(spec, length, seed)
    flipped = {d.name: inputs[d.name][::-1] if d.role is Role.SEQ else inputs[d.name] for d in program.decls}
    outs, finals = interpret(backward, inputs)
    ref_outs, ref_finals = interpret(program, flipped)
    assert_close(outs, {name: y[::-1] for name, y in ref_outs.items()}, SAME_RTOL, "output")
    assert_close(finals, ref_finals, SAME_RTOL, "final state")
    # and the naive evaluator agrees on the reverse program too
    naive_outs, naive_finals = naive_run(backward, inputs)
    assert_close(outs, naive_outs, NAIVE_RTOL, "output")
    assert_close(finals, naive_finals, NAIVE_RTOL, "final state")

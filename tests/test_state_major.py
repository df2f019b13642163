"""The state-major interchange of the warp kernel's steps (kernels/warp/analysis.py).

The rewritten statements are run here by a small evaluator of the loop IR, one lane's K steps from a
given carry, against the statements as lowered (step after step): the outputs, the summaries
(product, partial) and the state past the steps must agree; likewise the fused backward's four
steps (`fused_state_major`). The GPU tests run the CUDA kernels.
"""

from __future__ import annotations

import importlib
import math
import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from profiles import examples
from strategies import diagonal_linear_recurrences

import ssmc
from ssmc.backends.cuda.kernels.warp.analysis import (
    STEP,
    StateMajor,
    fused_state_major,
    scalar_name,
    share,
    state_major,
    warp_state_major,
)
from ssmc.backends.cuda.kernels.warp.backward import fused_backward_source
from ssmc.backends.cuda.kernels.warp.backward_analysis import fused_backward
from ssmc.backends.cuda.printer import ArraySpec, contiguous_strides
from ssmc.backends.cuda.report import kernel_reports
from ssmc.lowering.loops import Assign, Bin, Buffer, Call, InRange, Load, Loop, Num, Select, Var, map_children
from ssmc.lowering.summary import partial_name, product_name
from ssmc.lowering.time_blocks import time_blocks
from ssmc.passes.autodiff import derive_backward

K = 3     # a lane's steps
SIZE = 3  # every axis
TOL = 1e-12


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


FUNCS = {"exp": math.exp, "log": math.log, "sqrt": math.sqrt, "tanh": math.tanh, "abs": abs, "sigmoid": _sigmoid,
         "softplus": lambda x: max(x, 0.0) + math.log1p(math.exp(-abs(x))), "silu": lambda x: x * _sigmoid(x),
         "relu": lambda x: max(x, 0.0), "neg": lambda x: -x, "max": max, "min": min, "rsqrt": lambda x: x ** -0.5,
         "erf": math.erf, "gelu": lambda x: 0.5 * x * (1.0 + math.erf(x / math.sqrt(2.0))),
         "sin": math.sin, "cos": math.cos, "tan": math.tan, "log1p": math.log1p, "expm1": math.expm1,
         "atan2": math.atan2, "sign": lambda x: float((x > 0) - (x < 0)), "pow": lambda a, b: a ** b}
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "/": lambda a, b: a / b,
       "<": lambda a, b: a < b, "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b,
       "==": lambda a, b: a == b, "!=": lambda a, b: a != b, "and": lambda a, b: a and b, "or": lambda a, b: a or b}


class Indices(dict):
    """Loop variables and step; a parallel index p_<axis> is 1, a size n_<axis> is SIZE."""

    def __missing__(self, name: str) -> int:
        if name.startswith(("p_", "n_")):
            return 1 if name.startswith("p_") else SIZE
        raise KeyError(name)


def fixed(seed: int, key) -> float:
    """A random value that depends on `key` only (not on the order of the reads)."""
    return random.Random(repr((seed, key))).uniform(0.1, 0.9)


class Machine:
    """Runs loop-IR statements: scalars and buffers in `env`, global arrays read as a fixed random
    value per (array, index), stores kept in `stored`."""

    def __init__(self, seed: int, buffers: set[str]):
        self.seed = seed
        self.stored: dict = {}
        self.env: dict = {}
        self.ints = Indices()
        self.buffers = buffers

    def index(self, i: str) -> int:
        return int(eval(i, {}, self.ints))  # index expressions are Python too (lowering/loops.py)

    def load(self, e: Load):
        at = tuple(self.index(i) for i in e.index)
        if e.array in self.buffers:
            return self.env.setdefault((e.array, at), 0.0)
        return fixed(self.seed, (e.array, at))

    def value(self, e):
        if isinstance(e, Num):
            return e.value
        if isinstance(e, Var):
            if e.name in self.env:
                return self.env[e.name]
            return self.ints[e.name]
        if isinstance(e, Load):
            return self.load(e)
        if isinstance(e, Call):
            if e.fn == "not":
                return not self.value(e.args[0])
            return FUNCS[e.fn](*(self.value(a) for a in e.args))
        if isinstance(e, Bin):
            return OPS[e.op](self.value(e.a), self.value(e.b))
        if isinstance(e, Select):
            return self.value(e.a) if self.value(e.cond) else self.value(e.b)
        if isinstance(e, InRange):
            return self.index(e.lo) <= self.index(e.index) < self.index(e.hi)
        raise TypeError(e)

    def run(self, stmts):
        for s in stmts:
            if isinstance(s, Loop):
                for i in range(SIZE):
                    self.ints[s.var] = i
                    self.run(s.body)
                continue
            assert isinstance(s, Assign)
            v = self.value(s.value)
            if isinstance(s.target, Var):
                key = s.target.name
            else:
                key = (s.target.array, tuple(self.index(i) for i in s.target.index))
            if isinstance(s.target, Load) and s.target.array not in self.buffers:
                self.stored[key] = v
                continue
            old = self.env.get(key, 0.0)
            self.env[key] = v if s.op == "=" else old + v if s.op == "+=" else max(old, v)


def lane_step_major(tb, seed: int):
    """The lane's K steps as lowered: the summary over them from (1, 0), then the step from the carry."""
    summary, step = tb.lane_summary, tb.lane_rescan
    m = Machine(seed, {s.name for s in summary.setup + step.setup if isinstance(s, Buffer)})
    m.run(setup(tb))
    for s in step.program.states:
        for idx in np.ndindex(*(SIZE,) * _own(s, step)):
            m.env[f"st_{product_name(s.name)}", idx] = 1.0
            m.env[f"st_{partial_name(s.name)}", idx] = 0.0
            m.env[f"st_{s.name}", idx] = fixed(seed, ("carry", s.name, idx))
    for tt in range(K):
        m.ints["t"] = tt
        m.run(summary.step)
    for tt in range(K):
        m.ints["t"] = tt
        m.run(step.step)
    return m


def lane_state_major(tb, seed: int):
    """The same K steps state-major, as the CUDA kernel runs them (kernels/warp/forward._state_major_round)."""
    first, second = share(*warp_state_major(tb.lane_summary, tb.lane_rescan))
    step = tb.lane_rescan
    buffers = {s.name for s in tb.lane_summary.setup + step.setup if isinstance(s, Buffer)}
    m = Machine(seed, buffers | set(first.per_step) | set(second.per_step))
    m.run(setup(tb))  # values hoisted out of the steps
    own = [a for a in step.program.states[0].axes if a not in step.parallel]
    carries = {(s.name, idx): fixed(seed, ("carry", s.name, idx))
               for s in step.program.states for idx in np.ndindex(*(SIZE,) * len(own))}
    for tt in range(K):
        m.ints["t"] = m.ints[STEP] = tt
        m.run(second.pre + first.pre)
    results = {}
    for idx in np.ndindex(*(SIZE,) * len(own)):
        m.ints.update({f"i_{a}": i for a, i in zip(own, idx)})
        for s in step.program.states:
            m.env[scalar_name(f"st_{product_name(s.name)}")] = 1.0
            m.env[scalar_name(f"st_{partial_name(s.name)}")] = 0.0
        for tt in range(K):
            m.ints["t"] = m.ints[STEP] = tt
            m.run(first.body)
        for s in step.program.states:
            results[f"st_{product_name(s.name)}", idx] = m.env[scalar_name(f"st_{product_name(s.name)}")]
            results[f"st_{partial_name(s.name)}", idx] = m.env[scalar_name(f"st_{partial_name(s.name)}")]
            m.env[scalar_name(f"st_{s.name}")] = carries[s.name, idx]
        for tt in range(K):
            m.ints["t"] = m.ints[STEP] = tt
            m.run(second.body)
        for s in step.program.states:
            results[f"st_{s.name}", idx] = m.env[scalar_name(f"st_{s.name}")]
    for tt in range(K):
        m.ints["t"] = m.ints[STEP] = tt
        m.run(second.post)
    return m, results


def setup(tb) -> list:
    """The statements both kernels run before time (buffers aside)."""
    return [s for s in tb.lane_summary.setup + tb.lane_rescan.setup if not isinstance(s, Buffer)]


def _own(s, k) -> int:
    return sum(a not in k.parallel for a in s.axes)


def _assert_agree(before: Machine, after: Machine, results: dict):
    """The same stores, and the state-major `results` (name, index) equal to the step-major values."""
    assert before.stored.keys() == after.stored.keys() and before.stored
    for key, want in before.stored.items():
        assert abs(after.stored[key] - want) <= TOL * max(1.0, abs(want)), key
    for (name, idx), got in results.items():
        want = before.env[name, idx]
        assert abs(got - want) <= TOL * max(1.0, abs(want)), (name, idx)


def check_same(tb, seed: int = 0):
    before = lane_step_major(tb, seed)
    after, results = lane_state_major(tb, seed)
    _assert_agree(before, after, results)


def test_mamba1_is_state_major_with_one_exp_and_one_load_of_b_per_state_and_step():
    """Mamba-1: the step's values (dt, dt u) once per step, exp(dt A[n]) and dt u B[t, n] shared by
    the summary's body and the step's (sh0, sh1), the sum over n one register per step."""
    tb = time_blocks(importlib.import_module("ssmc.examples.mamba1").SPEC.program)
    first, second = share(*warp_state_major(tb.lane_summary, tb.lane_rescan))
    assert first.pre == [] and first.post == [] and set(second.per_step) == {"m0", "m1", "acc_m3"}
    assert first.per_step == ("sh0", "sh1")
    text = repr(first.body)
    assert text.count("'exp'") == 1 and text.count("array='B'") == 1
    assert "'exp'" not in repr(second.body) and "array='B'" not in repr(second.body)
    check_same(tb)


@pytest.mark.parametrize("name", ["hgrn", "mingru"])
def test_states_without_axes_of_their_own_stay_step_major(name):
    tb = time_blocks(importlib.import_module(f"ssmc.examples.{name}").SPEC.program)
    assert warp_state_major(tb.lane_summary, tb.lane_rescan) is None


def test_a_sum_read_inside_the_state_loop_is_not_interchanged():
    """y[n] = x[n] * sum_n x: the second loop needs the whole sum first."""
    x = Load("x", ("t", "i_n"))
    step = [Assign(Var("acc"), Num(0.0)), Loop("i_n", "n_n", [Assign(Var("acc"), x, "+=")]),
            Loop("i_n", "n_n", [Assign(Load("st_h", ("i_n",)), Bin("*", x, Var("acc")))])]
    assert state_major(step, ("i_n",), {"st_h"}, {"st_h"}) is None


def test_a_buffer_read_at_another_index_is_not_interchanged():
    step = [Loop("i_n", "n_n", [Assign(Load("st_h", ("i_n",)), Load("st_h", ("0",)))])]
    assert state_major(step, ("i_n",), {"st_h"}, {"st_h"}) is None
    ok = [Loop("i_n", "n_n", [Assign(Load("st_h", ("i_n",)), Bin("*", Load("st_h", ("i_n",)), Num(0.5)))])]
    assert state_major(ok, ("i_n",), {"st_h"}, {"st_h"}) is not None
    # not a state: its value from the step before would be another index's, interchanged
    assert state_major(ok, ("i_n",), {"st_h"}, set()) is None


def test_a_buffer_the_loops_only_read_stays_an_array():
    """tanh(p[n]), hoisted before time: read inside the loop at its index, it is not a scalar."""
    step = [Loop("i_n", "n_n", [Assign(Load("st_h", ("i_n",)), Bin("*", Load("g", ("i_n",)), Load("st_h", ("i_n",))))])]
    major = state_major(step, ("i_n",), {"st_h", "g"}, {"st_h"})
    assert major.body == [Assign(Var("v_st_h"), Bin("*", Load("g", ("i_n",)), Var("v_st_h")))]


def test_a_loop_scalar_read_by_another_loop_is_not_interchanged():
    """Lowered, the second loop sees the first loop's last value of v; interchanged, its own."""
    step = [Loop("i_n", "n_n", [Assign(Var("v"), Load("x", ("t", "i_n")))]),
            Loop("i_n", "n_n", [Assign(Load("st_h", ("i_n",)), Var("v"))])]
    assert state_major(step, ("i_n",), {"st_h"}, {"st_h"}) is None


def test_a_chain_over_the_steps_read_in_the_loops_is_not_interchanged():
    """acc sums over the steps before the loops read it: one register per step would lose the chain."""
    x = Load("x", ("t",))
    step = [Assign(Var("nx"), Bin("+", Var("acc"), x)), Assign(Var("acc"), Var("nx")),
            Loop("i_n", "n_n", [Assign(Load("st_h", ("i_n",)), Bin("*", Load("st_h", ("i_n",)), Var("acc")))])]
    assert state_major(step, ("i_n",), {"st_h"}, {"st_h"}) is None


# an example renders a random spec's kernels and runs its steps both ways in Python (~1.5 s on CI's 2 cores)
@settings(max_examples=examples(40, ci=12), deadline=None, suppress_health_check=list(HealthCheck))
@given(spec=diagonal_linear_recurrences())
def test_random_diagonal_linear_steps_compute_the_same_state_major(spec):
    """Where the interchange applies to a random diagonal-linear spec, one lane's K steps give the
    same outputs, summaries and states as the steps run one after another."""
    tb = time_blocks(spec.program)
    assume(tb is not None and warp_state_major(tb.lane_summary, tb.lane_rescan) is not None)
    # the CUDA sources render (a rendering error was seen only on the GPU: a hoisted buffer of the
    # summary printed as a global array), the warp kernels state-major, with a partial last round
    sizes = {a: 5 for s in spec.program.decls for a in s.axes}
    reports = kernel_reports(spec.program, sizes, 100, time_contiguous=True, backward=False, compile_kernels=False)
    assert [r.strategy for r in reports] == ["warp"] and "one state value at a time" in reports[0].source
    try:
        check_same(tb, seed=1)
    except (OverflowError, ValueError, ZeroDivisionError):  # math domain of a random expression at random values
        assume(False)


# -- the fused backward (kernels/warp/backward_analysis.py), state-major ------------------------------------

def _aliased(stmts, alias: dict[str, str]):
    """`stmts` with arrays renamed by `alias`: the fused kernel's registers written under one name
    (prev_h, out_sv0) and read under another (h, sv0)."""
    def expr(e):
        if isinstance(e, Load) and e.array in alias:
            return Load(alias[e.array], e.index)
        return map_children(e, expr)
    out = []
    for s in stmts:
        if isinstance(s, Loop):
            out.append(Loop(s.var, s.extent, _aliased(s.body, alias), s.reverse))
        elif isinstance(s, Assign):
            out.append(Assign(expr(s.target), expr(s.value), s.op))
        else:
            out.append(s)
    return out


def _indices(fb):
    """Every index of the states' own axes (SIZE each)."""
    return list(np.ndindex(*(SIZE,) * len(fused_state_major(fb).local)))


def _fused_machine(fb, seed: int, extra=()):
    """A machine after the four steps' setups, the registers aliased; the given carries into the
    lane's steps and the sums so far, by (name, index)."""
    kernels = (fb.forward_summary, fb.forward_carries, fb.adjoint_summary, fb.adjoint)
    registers = {f"prev_{s}": s for s in fb.carried} | {f"out_{v}": v for v in fb.shared}
    buffers = {s.name for k in kernels for s in k.setup if isinstance(s, Buffer)}
    m = Machine(seed, buffers | set(registers.values()) | set(extra))
    m.run(_aliased([s for k in kernels for s in k.setup if not isinstance(s, Buffer)], registers))
    start = {}
    for s in fb.backward.forward.states + tuple(s for s in fb.adjoint.program.states if s.name in fb.core):
        for idx in _indices(fb):
            start[s.name, idx] = fixed(seed, ("carry", s.name, idx))
    for name in fb.partials.accumulators:
        for idx in _indices(fb):
            start[name, idx] = fixed(seed, ("sum", name, idx))
        m.env[f"st_{name}"] = fixed(seed, ("sum", name))
    return m, registers, start


def fused_step_major(fb, seed: int):
    """The lane's K steps as the step-major fused kernel runs them: the forward summary over them
    from (1, 0), the forward's carries from a given carry, the adjoint's summary backwards from
    (1, 0), the adjoint backwards from a given carry."""
    m, registers, start = _fused_machine(fb, seed)
    steps = [_aliased(k.step, registers) for k in (fb.forward_summary, fb.forward_carries, fb.adjoint_summary,
                                                   fb.adjoint)]
    for (name, idx), v in start.items():
        m.env[f"st_{name}", idx] = v
    for s in fb.backward.forward.states + tuple(s for s in fb.adjoint.program.states if s.name in fb.core):
        for idx in _indices(fb):
            m.env[f"st_{product_name(s.name)}", idx] = 1.0
            m.env[f"st_{partial_name(s.name)}", idx] = 0.0
    for step, order in zip(steps, (range(K), range(K), reversed(range(K)), reversed(range(K)))):
        for tt in order:
            m.ints["t"] = tt
            m.run(step)
    return m


def fused_state_major_run(fb, seed: int):
    """The same K steps state-major, as kernels/warp/backward._fused_state_major_round runs them."""
    major = fused_state_major(fb)
    registers = {f"prev_{s}": s for s in fb.carried} | {f"out_{v}": v for v in fb.shared}

    def aliased(sm: StateMajor) -> StateMajor:
        return StateMajor(_aliased(sm.pre, registers), _aliased(sm.body, registers), _aliased(sm.post, registers),
                          sm.per_step, sm.scalars)

    fs, fc, as_, ad = (aliased(sm) for sm in major.steps())
    per_step = {n for sm in major.steps() for n in sm.per_step}
    m, _, start = _fused_machine(fb, seed, per_step)
    forward = fb.backward.forward.states
    core = tuple(s for s in fb.adjoint.program.states if s.name in fb.core)
    for tt in range(K):
        m.ints["t"] = m.ints[STEP] = tt
        m.run(fs.pre + fc.pre)
    for tt in reversed(range(K)):
        m.ints["t"] = m.ints[STEP] = tt
        m.run(as_.pre + ad.pre)
    results = {}
    for idx in _indices(fb):
        m.ints.update(dict(zip(major.local, idx)))
        for states, first, second, carried, order in ((forward, fs, fc, (), range(K)),
                                                      (core, as_, ad, major.accumulators, range(K)[::-1])):
            for s in states:
                m.env[scalar_name(f"st_{product_name(s.name)}")] = 1.0
                m.env[scalar_name(f"st_{partial_name(s.name)}")] = 0.0
            for tt in order:
                m.ints["t"] = m.ints[STEP] = tt
                m.run(first.body)
            for s in states:
                for name in (product_name(s.name), partial_name(s.name)):
                    results[f"st_{name}", idx] = m.env[scalar_name(f"st_{name}")]
                m.env[scalar_name(f"st_{s.name}")] = start[s.name, idx]
            for n in carried:
                m.env[scalar_name(f"st_{n}")] = start[n, idx]
            for tt in order:
                m.ints["t"] = m.ints[STEP] = tt
                m.run(second.body)
            for n in [s.name for s in states] + list(carried):
                results[f"st_{n}", idx] = m.env[scalar_name(f"st_{n}")]
    for tt in reversed(range(K)):
        m.ints["t"] = m.ints[STEP] = tt
        m.run(ad.post)
    return m, results


def check_fused_same(fb, seed: int = 0):
    before = fused_step_major(fb, seed)
    after, results = fused_state_major_run(fb, seed)
    _assert_agree(before, after, results)
    for name in fb.partials.accumulators:  # the scalar ones, summed in the steps' own loops
        if f"st_{name}" in before.env:
            want = before.env[f"st_{name}"]
            assert abs(after.env[f"st_{name}"] - want) <= TOL * max(1.0, abs(want)), name


def test_mamba1_fused_backward_is_state_major():
    """Mamba-1's fused backward: the four steps interchange; grad_A (along n) is kept per state index,
    grad_D and grad_delta_bias (no n) summed in the steps' own loops; one lane's K steps give the
    same adjoint, atomic terms, outputs, summaries and sums as the steps run one after another."""
    fb = fused_backward(derive_backward(importlib.import_module("ssmc.examples.mamba1").SPEC.program))
    major = fused_state_major(fb)
    assert major.local == ("i_n",) and major.accumulators == ("grad_A",)
    assert not major.forward_summary.post and major.adjoint.post
    check_fused_same(fb)


@ssmc.recurrence
def _gated(h: ssmc.State["b d n"], x: ssmc.Seq["b d"], g: ssmc.Seq["b n"], w: ssmc.Param["d n"],
           q: ssmc.Seq["b n"]):
    """Decay per state index from a gate and a param; the output a sum over n, gated."""
    a = ssmc.sigmoid(g + w)
    h = a * h + (1.0 - a) * x
    y = ssmc.dot(h, q, over="n") * ssmc.tanh(x)
    return h, y


@ssmc.recurrence
def _squashed(h: ssmc.State["b d n"], x: ssmc.Seq["b d"], g: ssmc.Seq["b n"], w: ssmc.Param["d n"],
              q: ssmc.Seq["b n"]):
    """The sum over n through a tanh: its adjoint needs the whole sum before any n's step."""
    a = ssmc.sigmoid(g + w)
    h = a * h + (1.0 - a) * x
    y = ssmc.tanh(ssmc.dot(h, q, over="n")) * x
    return h, y


@ssmc.recurrence
def _per_channel(h: ssmc.State["b d n"], x: ssmc.Seq["b d"], k: ssmc.Seq["b d"],
                 A: ssmc.Param["d n"], c: ssmc.Param["n"]):
    """B and C per channel: no sums over the recurrences but the params' gradients."""
    h = ssmc.exp(A * ssmc.softplus(k)) * h + x
    y = ssmc.dot(h, c, over="n")
    return h, y


@pytest.mark.parametrize("spec", [_gated, _per_channel], ids=["gated", "per_channel"])
def test_other_fused_backwards_compute_the_same_state_major(spec):
    """Other diagonal-linear programs with states along n: the same lane's steps agree with the
    step-major kernel's, and the CUDA source renders (both rounds)."""
    fb = fused_backward(derive_backward(spec.program))
    assert fb is not None and fused_state_major(fb) is not None
    sizes = {a: 5 for s in spec.program.decls for a in s.axes}
    arrays = {a.name: ArraySpec("float32", contiguous_strides([5] * len(a.axes))) for a in fb.arrays}
    source = fused_backward_source(fb, "float", arrays, sizes, 4, state_major=True)
    assert source.count("one state value at a time") == 2
    check_fused_same(fb, seed=1)


def test_a_fused_backward_that_needs_a_whole_sum_first_stays_step_major():
    fb = fused_backward(derive_backward(_squashed.program))
    assert fb is not None and fused_state_major(fb) is None

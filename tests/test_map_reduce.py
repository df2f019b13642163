"""The map/reduce epilogue (`lower(program, map_reduce=True)`: one kernel per output and per
accumulator, the CUDA backend's) against the interpreter, run through Numba on the CPU."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples, in_ci
from strategies import diagonal_linear_recurrences, draw_inputs

import ssmc
from ssmc.backends.numba.runner import NumbaRunner
from ssmc.lowering.plan import lower
from ssmc.passes.autodiff import derive_backward
from ssmc.runtime.binding import bind_arrays
from ssmc.runtime.random_inputs import random_recurrence_inputs

TOL = 1e-10  # float64, relative to the largest magnitude of the reference


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) if a.size else 0.0


def check(program, kwargs, layout="t ..."):
    low = lower(program, map_reduce=True)
    assert low.strategy == "split"
    bound = bind_arrays(program.inputs, program.states, (), kwargs, layout, program.static_sizes, program.name,
                        program.roots)
    seqs = {d.name: bound.arrays[d.name] for d in program.seqs}
    params = {d.name: bound.arrays[d.name] for d in program.params}
    got_y, got_h = NumbaRunner(program, "float64", low).run(seqs, params, bound.initial, bound.sizes, bound.length)
    want_y, want_h = ssmc.compile(program, "interpreter", layout=layout).run(**kwargs)
    for name in want_y:
        assert rel_err(got_y[name], want_y[name]) <= TOL, name
    for name in want_h:
        assert rel_err(got_h[name], want_h[name]) <= TOL, name


# Numba compiles an example's adjoint once per process, about 3 minutes for the LSTM's or the GRU's on CI's
# 2 cores: CI runs the LSTM's (the GRU's adjoint has the same map/reduce shape); local and nightly runs all
@pytest.mark.parametrize("length", [1, 7, 180])
@pytest.mark.parametrize("name", ["mamba1", "lstm", pytest.param("gru", marks=pytest.mark.skipif(
    in_ci(), reason="CI runs the LSTM's adjoint, the same map/reduce shape (compile time)"))])
def test_example_adjoints(name, length):
    m = importlib.import_module(f"ssmc.examples.{name}")
    adjoint = derive_backward(m.SPEC.program).adjoint
    low = lower(adjoint, map_reduce=True)
    # one kernel per output and per accumulator after the core, but for accumulators that are sums
    # of an output (Mamba-1's grad_delta_bias = sum over b and t of grad_delta)
    assert len(low.kernels) == (bool(low.core_states) + len(low.accumulators) - len(low.from_outputs)
                                + len(adjoint.outputs))
    assert low.from_outputs == ((("grad_delta_bias", "grad_delta", ("b",)),) if name == "mamba1" else ())
    check(adjoint, random_recurrence_inputs(adjoint, length, np.random.default_rng(length)))


# each example compiles a random spec's numba kernels, about 2 minutes on CI's 2 cores (13 min for 6):
# 2 in CI (tests/profiles.py), 4 locally
@settings(max_examples=examples(4, ci=2), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=diagonal_linear_recurrences(), length=st.sampled_from([1, 7, 180]), seed=st.integers(0, 2**16))
def test_random_gradients_through_the_map_reduce_epilogue(spec, length, seed):
    """Whole gradients of random specs with the numba runner lowered map/reduce, vs the interpreter."""
    from ssmc.backends.numba import runner as numba_runner

    inputs = draw_inputs(spec, length, seed)
    outs, _ = ssmc.compile(spec, "interpreter").run(**inputs)
    rng = np.random.default_rng(seed)
    cot = {n: rng.standard_normal(v.shape) for n, v in outs.items()}
    want = ssmc.grad(spec, "interpreter", chunk=64)(**inputs, grad_outputs=cot)
    saved = dict(numba_runner._RUNNERS)
    try:
        program = derive_backward(spec.program, 64).adjoint
        numba_runner._RUNNERS[(program, "float64")] = NumbaRunner(program, "float64", lower(program, map_reduce=True))
        got = ssmc.grad(spec, "numba", chunk=64)(**inputs, grad_outputs=cot)
    finally:
        numba_runner._RUNNERS.clear()
        numba_runner._RUNNERS.update(saved)
    for key in want:
        assert rel_err(got[key], want[key]) <= 1e-9, key


def _mamba1_epilogue():
    from ssmc.examples import mamba1

    low = lower(derive_backward(mamba1.SPEC.program).adjoint, map_reduce=True)
    return {k.name.rsplit("_epilogue_", 1)[-1]: k for k in low.kernels if k.time_blocks}


def test_values_used_twice_in_a_sum_are_scalars_of_its_loop():
    """grad_C = sum_d f(s[d]) g(s[d]) with s = softplus(delta + bias): s is computed per iteration of
    the loop over d, not into a buffer as long as d (local memory on a GPU)."""
    from ssmc.lowering.loops import Buffer, walk

    k = _mamba1_epilogue()["grad_C"]
    assert not [s for s in walk(k.setup + k.step) if isinstance(s, Buffer)]
    # grad_delta: m1[b, n] is read by two sums over n into [b]; they share one nest, m1 is a let
    k = _mamba1_epilogue()["grad_delta"]
    assert all(len(s.shape) < 2 for s in walk(k.setup + k.step) if isinstance(s, Buffer))


def test_split_axis_of_the_epilogue_sums():
    """Only a sum that nothing else reads along its axis, over a long axis, is split across threads."""
    from ssmc.lowering.split_sum import split_axis

    sizes = {"b": 8, "d": 1536, "n": 16}
    got = {name: split_axis(k, sizes) for name, k in _mamba1_epilogue().items()}
    assert got == {"grad_A": None, "grad_D": None, "grad_u": None, "grad_delta": None,
                   "grad_B": "d", "grad_C": "d", "grad_z": None}
    assert split_axis(_mamba1_epilogue()["grad_C"], {**sizes, "d": 64}) is None  # short: stays in one thread

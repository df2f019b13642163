"""Per-step products with a param as register-tiled calls (`backends/numba/tiles.py`): results
against the interpreter at sizes that use every micro-kernel and a partial panel (that the LSTM's
products become such calls: `test_hoist.py`)."""

from __future__ import annotations

import importlib

import numba
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ssmc

lstm = importlib.import_module("ssmc.examples.lstm")
TOL = {"float64": 1e-10, "float32": 2e-4}  # relative to the largest magnitude of the reference


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


@pytest.fixture(params=[1, 2], ids=["1 thread", "2 threads"])
def threads(request):
    """13 rows in blocks of 8 and 5 (= 4 + 1) at 1 thread: every micro-kernel; 7 and 6 at 2."""
    before = numba.get_num_threads()
    numba.set_num_threads(min(request.param, numba.config.NUMBA_NUM_THREADS))
    yield request.param
    numba.set_num_threads(before)


def _inputs(dtype: str, length: int = 7, batch: int = 13, inp: int = 5, hidden: int = 37, seed: int = 5):
    # H = 37: the forward's 4 H = 148 columns are 4 whole panels of 32 (fp32) and a partial one
    inputs = lstm.make_inputs(np.random.default_rng(seed), length, batch=batch, inp=inp, hidden=hidden)
    return {k: v.astype(dtype) for k, v in inputs.items()}


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("length", [1, 7, 180])
def test_tiled_lstm_forward_matches_the_interpreter(length, dtype, threads):
    _check_forward(_inputs(dtype, length), dtype)


def _check_forward(inputs, dtype):
    got = ssmc.compile(lstm.SPEC, "numba", layout=lstm.LAYOUT)(**inputs, return_final_states=True)
    want = ssmc.compile(lstm.SPEC, "interpreter", layout=lstm.LAYOUT)(**inputs, return_final_states=True)
    for g, w in zip([got[0], *got[1]], [want[0], *want[1]]):
        assert g.dtype == np.dtype(dtype) and g.shape == w.shape
        assert rel_err(g, w) <= TOL[dtype]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("length", [1, 180])
def test_tiled_lstm_gradients_match_the_interpreter(length, dtype, threads):
    _check_gradients(_inputs(dtype, length), dtype)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 19), inp=st.integers(1, 6), hidden=st.integers(1, 41),
       length=st.sampled_from([1, 7, 180]), dtype=st.sampled_from(["float64", "float32"]),
       seed=st.integers(0, 2**16))
def test_tiled_lstm_at_random_sizes(batch, inp, hidden, length, dtype, seed):
    """Any rows per block (1 to 8: every micro-kernel and mix of them), any columns (whole and partial
    panels, fewer than one panel), forward and every gradient."""
    inputs = _inputs(dtype, length, batch, inp, hidden, seed)
    _check_forward(inputs, dtype)
    _check_gradients(inputs, dtype)


def _check_gradients(inputs, dtype):
    outs = ssmc.compile(lstm.SPEC, "interpreter", layout=lstm.LAYOUT)(**inputs)
    cot = np.random.default_rng(6).standard_normal(outs.shape).astype(dtype)
    got = ssmc.grad(lstm.SPEC, "numba", layout=lstm.LAYOUT)(**inputs, grad_outputs=cot)
    want = ssmc.grad(lstm.SPEC, "interpreter", layout=lstm.LAYOUT)(**inputs, grad_outputs=cot)
    assert set(got) == set(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        assert rel_err(got[key], want[key]) <= TOL[dtype] * (10 if dtype == "float32" else 1), key

"""Every compiled backend against the interpreter on random recurrences whose states feed each other
(tests/strategies.py `coupled_recurrences`: shift registers and swaps, complex states as real pairs,
LSTM-like cells with gate axes, norms and sums inside the update), forward and every gradient, and
the regressions that such specs found.

CI runs a few examples of each property, derandomized; ``SSMC_PROPERTY_EXAMPLES=10000`` runs the nightly
count, random draws (tests/profiles.py; docs/performance.md, "Reliability").
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples, nightly
from strategies import coupled_recurrences

import ssmc
from ssmc.backends.cuda import emulator
from ssmc.runtime.benchmark import check
from ssmc.runtime.random_inputs import axis_sizes

SETTINGS = {"deadline": None, "derandomize": not nightly(),
            "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.function_scoped_fixture]}
TOL = 1e-8  # float64, relative to the largest magnitude of each array


def _worst(spec, backend: str, length: int, seed: int, layout: str = "b t ...") -> tuple[float, str]:
    """The largest relative error of `backend` against the interpreter over outputs, final states and
    every gradient, on random float64 inputs at random axis sizes 1..5."""
    sizes = axis_sizes(spec.program, np.random.default_rng(seed), 1, 5)
    return check(spec, backend, layout, "float64", sizes, length, seed, with_grad=True)


@settings(max_examples=examples(3), **SETTINGS)
@given(spec=coupled_recurrences(), length=st.sampled_from([1, 7, 180]), seed=st.integers(0, 2**16),
       layout=st.sampled_from(["b t ...", "t ...", "b d t"]))
def test_coupled_specs_on_numba(spec, length, seed, layout):
    err, where = _worst(spec, "numba", length, seed, layout)
    assert err <= TOL, f"{where}: {err:.2e}"


@pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")
@settings(max_examples=examples(3), **SETTINGS)
@given(spec=coupled_recurrences(), length=st.sampled_from([1, 7, 40]), seed=st.integers(0, 2**16))
def test_coupled_specs_on_emulated_cuda(spec, length, seed, emulated_cuda):
    err, where = _worst(spec, "cuda", length, seed)
    assert err <= TOL, f"{where}: {err:.2e}"


# -- regressions ------------------------------------------------------------------------------------


@ssmc.recurrence
def swap(a: ssmc.State["d"], b: ssmc.State["d"], x: ssmc.Seq["d"]):
    return (b, a), a + 0 * x


@ssmc.recurrence
def second_order(h: ssmc.State["b d"], h1: ssmc.State["b d"], x: ssmc.Seq["b d"], a1: ssmc.Param["d"],
                 a2: ssmc.Param["d"]):
    """h_t = a1 h_{t-1} + a2 h_{t-2} + x_t, with h1 the previous h: a state whose new value is another's old."""
    h_new = 0.5 * ssmc.tanh(a1) * h + 0.4 * ssmc.tanh(a2) * h1 + x
    return (h_new, h), h_new


@ssmc.recurrence
def layernorm_lstm(h: ssmc.State["b k"], c: ssmc.State["b k"], x: ssmc.Seq["b i"], W: ssmc.Param["i g=4 k"],
                   U: ssmc.Param["j g=4 k"], bias: ssmc.Param["g k"]):
    """The cell state normalised over k after an unbind of the gate axis: its backward's pre-kernel
    read the pre-activations z[g, k] as one scalar a sum's loop body shared, at no index of g."""
    z = ssmc.dot(x, W, over="i") + ssmc.dot(h.rename(k="j"), U, over="j") + bias
    i, f, g, o = z.unbind("g")
    c = ssmc.layernorm(ssmc.sigmoid(f) * c + ssmc.sigmoid(i) * ssmc.tanh(g), over="k")
    h = ssmc.sigmoid(o) * ssmc.tanh(c)
    return (h, c), h


BACKENDS = ["numba", pytest.param("cuda", marks=pytest.mark.skipif(
    not emulator.available(), reason="no C++ compiler for the CUDA emulator"))]


@pytest.mark.parametrize("backend", BACKENDS)
def test_swapped_states_are_assigned_in_parallel(backend, emulated_cuda):
    f = ssmc.compile(swap, backend)
    _, (a, b) = f(np.zeros((3, 2)), a=np.ones(2), b=np.full(2, 2.0), return_final_states=True)
    # three swaps: a ends as b0, b as a0
    np.testing.assert_array_equal(np.asarray(a), [2.0, 2.0])
    np.testing.assert_array_equal(np.asarray(b), [1.0, 1.0])


@pytest.mark.parametrize("length", [1, 7, 180, 1000])
@pytest.mark.parametrize("backend", BACKENDS)
def test_second_order_recurrence_matches_the_interpreter(backend, length, emulated_cuda):
    err, where = _worst(second_order, backend, length, seed=length)
    assert err <= TOL, f"{where}: {err:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_layernorm_lstm_gradients(backend, emulated_cuda):
    sizes = {"b": 2, "k": 5, "j": 5, "i": 3, "g": 4}
    err, where = check(layernorm_lstm, backend, "b t ...", "float64", sizes, 7, 0, with_grad=True)
    assert err <= TOL, f"{where}: {err:.2e}"


@ssmc.recurrence
def projected_gate(h: ssmc.State["b d"], x: ssmc.Seq["b d"], a: ssmc.Seq["b d"], Wx: ssmc.Param["e d"]):
    """An input projection inside a gate, read again beside it: the gradient of Wx is a matrix product
    of a written value (g x) with x (lowering/hoist.py), not a kernel holding a row of Wx a thread."""
    f = ssmc.sigmoid(a)
    h = f * h + (1 - f) * ssmc.silu(ssmc.dot(x.rename(d="e"), Wx, over="e")) * x
    return h, ssmc.rmsnorm(h, over="d")


@pytest.mark.parametrize("length", [1, 7, 180])
@pytest.mark.parametrize("backend", BACKENDS)
def test_projected_gate_gradients(backend, length, emulated_cuda):
    sizes = {"b": 3, "d": 5, "e": 5}
    err, where = check(projected_gate, backend, "b t ...", "float64", sizes, length, length, with_grad=True)
    assert err <= TOL, f"{where}: {err:.2e}"


# -- on the GPU ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 7, 180, 1000, 4097])
@pytest.mark.parametrize("spec", [second_order, layernorm_lstm, projected_gate], ids=lambda s: s.program.name)
def test_regressions_on_the_gpu(spec, length):
    sizes = axis_sizes(spec.program, np.random.default_rng(length), 3, 6)
    err, where = check(spec, "cuda", "b t ...", "float64", sizes, length, length, with_grad=True)
    assert err <= TOL, f"{where}: {err:.2e}"


@pytest.mark.gpu
@settings(max_examples=examples(12), **SETTINGS)
@given(spec=coupled_recurrences(), length=st.sampled_from([1, 7, 180, 1000]), seed=st.integers(0, 2**16),
       layout=st.sampled_from(["b t ...", "b d t"]))
def test_coupled_specs_on_the_gpu(spec, length, seed, layout):
    err, where = _worst(spec, "cuda", length, seed, layout)
    assert err <= TOL, f"{where}: {err:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("name, sizes", [("mamba2", {"batch": 2, "groups": 1, "heads": 8, "headdim": 64, "state": 64}),
                                         ("retnet", {"batch": 2, "heads": 4, "dk": 64, "dv": 64})])
def test_matrix_state_backward_runs_at_real_head_sizes(name, sizes):
    """The adjoints that asked more local memory a thread than CUDA allows (Mamba-2 at P64 N64: 0.8 MB):
    split, they run, in float32, every gradient against the float64 interpreter's."""
    import torch

    m = importlib.import_module(f"ssmc.examples.{name}")
    rng = np.random.default_rng(0)
    inputs = m.make_inputs(rng, 256, **sizes)
    want_y = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs)
    cot = rng.standard_normal(want_y.shape)
    want = ssmc.grad(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, grad_outputs=cot)
    on_gpu = {k: torch.tensor(v, dtype=torch.float32, device="cuda") for k, v in inputs.items()}
    got = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)(**on_gpu, grad_outputs=torch.tensor(cot, device="cuda"))
    for key, w in want.items():
        g = got[key].double().cpu().numpy()
        assert np.abs(g - w).max() <= 2e-3 * np.abs(w).max(), key

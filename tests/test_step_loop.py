"""The step loop of recurrences with a recurrent product (backends/cuda/kernels/step_loop.py): which
programs take it, and the forward and every gradient against the interpreter (float64; the CUDA
backend emulated on the CPU, so the loop's torch operations run on CPU tensors), at L = 1, 7, 180; a
cell written here; float32; the switch back to the kernels; LSTM and GRU on a GPU."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ssmc
from ssmc.backends.cuda.kernels import step_loop as loop_module
from ssmc.backends.cuda.kernels.step_loop import applies, recurrent_products
from ssmc.examples import gru, hgrn, layernorm_lstm, lstm, mamba1, mamba2, mingru, retnet
from tests.profiles import examples

pytest.importorskip("torch")


@ssmc.recurrence
def elman(h: ssmc.State["b k"], x: ssmc.Seq["b k"], U: ssmc.Param["j k"], V: ssmc.Param["k o"]):
    """A vanilla RNN with a second product on the way out: h = tanh(x + h U), y = h V."""
    h = ssmc.tanh(x + ssmc.dot(h.rename(k="j"), U, over="j"))
    y = ssmc.dot(h, V, over="k")
    return h, y


def _elman_inputs(rng, length: int) -> dict:
    return {"x": rng.standard_normal((2, length, 5)), "U": 0.4 * rng.standard_normal((5, 5)),
            "V": rng.standard_normal((5, 3)), "h": 0.5 * rng.standard_normal((2, 5))}


@ssmc.recurrence
def swap(h: ssmc.State["b k"], c: ssmc.State["b k"], x: ssmc.Seq["b k"], U: ssmc.Param["j k"]):
    """States that trade places and an output that is the old carry: the CUDA graph's copies of the new
    carry must not overwrite values the step still returns."""
    new_h = ssmc.tanh(x + ssmc.dot(c.rename(k="j"), U, over="j"))
    return (c, new_h), h


def _swap_inputs(rng, length: int) -> dict:
    return {"x": rng.standard_normal((2, length, 4)), "U": 0.4 * rng.standard_normal((4, 4)),
            "h": rng.standard_normal((2, 4)), "c": rng.standard_normal((2, 4))}


@ssmc.recurrence
def scalar_state(h: ssmc.State["b k"], s: ssmc.State[""], x: ssmc.Seq["b k"], U: ssmc.Param["j k"]):
    """A state with no axes beside the recurrent product's (its new value expanded to no shape)."""
    h = ssmc.tanh(x + s * ssmc.dot(h.rename(k="j"), U, over="j"))
    return (h, 0.5 * s + 0.25), h


def _scalar_state_inputs(rng, length: int) -> dict:
    return {"x": rng.standard_normal((2, length, 4)), "U": 0.4 * rng.standard_normal((4, 4)),
            "h": rng.standard_normal((2, 4)), "s": np.array(1.0)}


CASES = {
    "lstm": (lstm.SPEC, lstm.LAYOUT, lambda rng, L: lstm.make_inputs(rng, L)),
    "gru": (gru.SPEC, gru.LAYOUT, lambda rng, L: gru.make_inputs(rng, L)),
    "layernorm_lstm": (layernorm_lstm.SPEC, layernorm_lstm.LAYOUT, lambda rng, L: layernorm_lstm.make_inputs(rng, L)),
    "elman": (elman, "b t ...", _elman_inputs),
    "swap": (swap, "b t ...", _swap_inputs),
    "scalar_state": (scalar_state, "b t ...", _scalar_state_inputs),
}


def test_which_programs_take_the_step_loop():
    for spec in (lstm.SPEC, gru.SPEC, elman):
        assert applies(spec.program) and recurrent_products(spec.program)
    for spec in (hgrn.SPEC, mamba1.SPEC, mamba2.SPEC, mingru.SPEC, retnet.SPEC):  # their scans
        assert applies(spec.program) is None
    assert "sum over j" in applies(lstm.SPEC.program)


def _flat(x) -> list:
    if isinstance(x, dict):
        return [np.asarray(v) for v in x.values()]
    if isinstance(x, (tuple, list)):
        return [a for v in x for a in _flat(v)]
    return [np.asarray(x.detach().cpu() if hasattr(x, "detach") else x, dtype=np.float64)]


def _relative(a, b) -> float:
    a = np.asarray(a.detach().cpu() if hasattr(a, "detach") else a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _check(name: str, length: int, dtype: str, tol: float, seed: int = 0):
    spec, layout, make = CASES[name]
    rng = np.random.default_rng(seed)
    inputs = make(rng, length)
    ref = ssmc.compile(spec, layout=layout, backend="interpreter")(**inputs, return_final_states=True)
    got = ssmc.compile(spec, layout=layout, backend="cuda", dtype=dtype)(**inputs, return_final_states=True)
    for a, b in zip(_flat(got), _flat(ref)):
        assert _relative(a, b) < tol
    outs = ref[0]
    cot = ({k: rng.standard_normal(np.shape(v)) for k, v in outs.items()} if isinstance(outs, dict)
           else rng.standard_normal(np.shape(outs)))
    want = ssmc.grad(spec, backend="interpreter", layout=layout)(**inputs, grad_outputs=cot)
    grads = ssmc.grad(spec, backend="cuda", layout=layout, dtype=dtype)(**inputs, grad_outputs=cot)
    assert set(grads) == set(want)
    for k in want:
        assert _relative(grads[k], want[k]) < tol, (name, length, k)


@pytest.fixture
def counted(monkeypatch):
    """The programs the step loop ran."""
    ran = []
    original = loop_module.StepLoop.run

    def run(self, *a, **k):
        ran.append(self.program.name)
        return original(self, *a, **k)
    monkeypatch.setattr(loop_module.StepLoop, "run", run)
    return ran


@settings(max_examples=examples(8, ci=3), deadline=None)
@given(name=st.sampled_from(sorted(CASES)), length=st.sampled_from([1, 7, 180]))
def test_step_loop_matches_the_interpreter(name, length):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSMC_CUDA_EMULATE", "1")
        _check(name, length, "float64", 1e-10)


def test_a_state_with_no_axes(emulated_cuda):
    _check("scalar_state", 7, "float64", 1e-10)


def test_every_program_of_a_training_step_runs_as_the_loop(emulated_cuda, counted):
    _check("lstm", 7, "float64", 1e-10)
    assert {"lstm", "lstm_carries", "lstm_backward"} <= set(counted)


def test_float32(emulated_cuda):
    _check("gru", 40, "float32", 1e-4)


def test_step_loop_off_runs_the_kernels(emulated_cuda, counted):
    emulated_cuda.setenv("SSMC_CUDA_STEP_LOOP", "0")
    _check("elman", 5, "float64", 1e-10)
    assert counted == []


@pytest.mark.gpu
@pytest.mark.parametrize("graphs", ["0", None])
@pytest.mark.parametrize("name", ["lstm", "gru", "elman", "swap"])
@pytest.mark.parametrize("length", [1, 180])
def test_gpu(name, length, graphs, monkeypatch):
    """On the GPU: op by op ("0"), and by default, where a loop of 8 steps or more replays a CUDA graph
    of the whole call from its signature's second call on: two calls of each signature with other
    values (seeds), the second replaying the graphs of the forward, the recompute and the adjoint."""
    if graphs is not None:
        monkeypatch.setenv("SSMC_CUDA_STEP_GRAPHS", graphs)
    for seed in (0, 1):
        _check(name, length, "float32", 1e-4, seed)
        _check(name, length, "float64", 1e-10, seed)


@pytest.mark.gpu
def test_gpu_replays_a_captured_loop(monkeypatch):
    """The second call of a signature runs as a CUDA graph (not op by op again), and a third call with
    other values gets its own values back (the graph reads the copies of the call's inputs)."""
    captured = []
    original = loop_module.CapturedLoop.capture.__func__

    def capture(cls, *a, **k):
        result = original(cls, *a, **k)
        captured.append(result)
        return result
    monkeypatch.setattr(loop_module.CapturedLoop, "capture", classmethod(capture))
    monkeypatch.setenv("SSMC_CUDA_PERSISTENT", "0")  # else the LSTM runs on the persistent kernel, not the loop
    for seed in (2, 3, 4):
        _check("lstm", 180, "float32", 1e-4, seed)
    assert captured and all(captured), captured

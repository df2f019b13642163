"""The Numba backend's float32 math (vectorisable exp, sigmoid, tanh, softplus) and the split of a
step's state-free work ahead of the time loop (`backends/numba/ahead.py`)."""

from __future__ import annotations

from unittest import mock

import numba
import numpy as np
import pytest

import ssmc
from ssmc.backends.numba import ahead, codegen
from ssmc.backends.numba.runner import NumbaRunner
from ssmc.examples import lstm, mamba1
from ssmc.lowering.plan import lower

F32 = np.float32


def _sigmoid(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


REFERENCE = {  # float64
    "exp": np.exp,
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
    "softplus": lambda x: np.logaddexp(0.0, x),
    "silu": lambda x: x * _sigmoid(x),
}
MAX_ULP = {"exp": 1.0, "sigmoid": 2.5, "tanh": 3.0, "softplus": 1.0, "silu": 3.0}  # measured: 0.97 2.2 2.6 0.5 2.7


@pytest.fixture(scope="module")
def f32_module():
    return NumbaRunner(mamba1.SPEC.program, "float32").module


def _elementwise(fn):
    @numba.njit(fastmath=False, error_model="numpy")
    def run(x, out):
        for i in range(x.shape[0]):
            out[i] = fn(x[i])

    return run


def _apply(module, name, x):
    out = np.empty_like(x)
    _elementwise(getattr(module, name))(x, out)
    return out


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_float32_math_is_within_a_few_ulp_of_float64(f32_module, name):
    tiny_args = np.geomspace(1e-30, 1e-4, 2001)
    x = np.concatenate([np.linspace(-100, 100, 400_001), np.linspace(-1, 1, 200_001),
                        np.linspace(-1e-3, 1e-3, 20_001), tiny_args, -tiny_args]).astype(F32)
    got = _apply(f32_module, name, x).astype(np.float64)
    want = REFERENCE[name](x.astype(np.float64))
    tiny, big = np.finfo(F32).tiny, np.finfo(F32).max
    normal = (np.abs(want) >= tiny) & (np.abs(want) <= big)  # results below the smallest normal may flush to 0
    if name == "silu":
        normal &= x > -80  # x * sigmoid(x), sigmoid(x) subnormal in float32 below -87
    ulp = np.spacing(np.abs(want[normal]).astype(F32)).astype(np.float64)
    assert (np.abs(got[normal] - want[normal]) / ulp).max() <= MAX_ULP[name]
    assert np.all(np.abs(got[~normal & (np.abs(want) < tiny)]) < tiny)


def test_float32_math_special_values(f32_module):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 88.72, 88.73, -87.33, -87.34, -200.0, 200.0], dtype=F32)
    exp = _apply(f32_module, "exp", x)
    assert np.isnan(exp[0]) and exp[1] == np.inf and exp[2] == 0.0 and exp[3] == exp[4] == 1.0
    assert np.isfinite(exp[5]) and exp[6] == np.inf and exp[7] > 0 and exp[8] == 0.0 and exp[9] == 0.0
    sig = _apply(f32_module, "sigmoid", x)
    assert np.isnan(sig[0]) and sig[1] == 1.0 and sig[2] == 0.0 and sig[3] == 0.5 and sig[10] == 1.0
    th = _apply(f32_module, "tanh", x)
    assert np.isnan(th[0]) and th[1] == 1.0 and th[2] == -1.0 and th[3] == 0.0 and np.signbit(th[4])
    sp = _apply(f32_module, "softplus", x)
    assert np.isnan(sp[0]) and sp[1] == np.inf and sp[2] == 0.0 and sp[10] == 200.0
    assert sp[3] == F32(np.log(2.0))


def test_mambas_state_free_work_moves_ahead():
    k = lower(mamba1.SPEC.program).kernels[0]
    split = ahead.split_ahead(k)
    assert split is not None
    moved = {s.target.name for s in split.ahead if hasattr(s.target, "name")}
    assert {"m0", "m1"} <= moved                                     # softplus(delta + bias), dt * u
    assert any(s.value.fn == "silu" for s in split.ahead if hasattr(s.value, "fn"))  # silu(z), out of y's line
    assert not any(name.startswith("acc") for name in moved)         # a sum's accumulator stays in the step
    assert "ah_m0" in NumbaRunner(mamba1.SPEC.program, "float32").source


def test_nothing_moves_where_every_call_reads_the_state():
    # the LSTM's gates all read h (x W is hoisted out of the kernel before lowering)
    runner = NumbaRunner(lstm.SPEC.program, "float64")
    assert all(ahead.split_ahead(k) is None for k in runner.lowered.kernels)
    assert "ah_" not in runner.source


@ssmc.recurrence
def gated(h: ssmc.State["b d"], x: ssmc.Seq["b d"], g: ssmc.Seq["b d"]):
    h = ssmc.sigmoid(g) * h + ssmc.tanh(x)
    return h, h * ssmc.silu(x)


@pytest.mark.parametrize("length", [1, 7, 64, 65, 180, 1000])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_moving_work_ahead_changes_no_bit(length, dtype):
    """Forward and every gradient with and without the split: equal, bit for bit (tiles of 64 steps,
    partial last tiles, forward and reverse kernels)."""
    rng = np.random.default_rng(length)
    inputs = {name: rng.standard_normal((length, 2, 5)).astype(dtype) for name in ("x", "g")}
    h0 = rng.standard_normal((2, 5)).astype(dtype)
    dy = rng.standard_normal((length, 2, 5)).astype(dtype)

    def run():
        y, hT = ssmc.compile(gated, backend="numba")(**inputs, h=h0, return_final_states=True)
        grads = ssmc.grad(gated, backend="numba", chunk=50)(**inputs, h=h0, grad_outputs=dy)
        return [y, hT, *(grads[k] for k in sorted(grads))]

    with_split = run()
    from ssmc.backends.numba import runner

    runner._RUNNERS.clear()
    with mock.patch.object(codegen, "split_ahead", lambda k: None):
        without = run()
    runner._RUNNERS.clear()
    for a, b in zip(with_split, without):
        np.testing.assert_array_equal(a, b)


def test_simd_vectors_load_store_splat_and_fma():
    """`backends/numba/simd.py`: 64-byte vectors (16 float32 / 8 float64 lanes) as Numba values."""
    import numba

    from ssmc.backends.numba import simd

    @numba.njit
    def axpy(a, x, y, out, lanes):  # out = a * x + y, one vector at a time
        for i in range(0, x.size, lanes):
            simd.store(out, i, simd.fma(simd.splat(a), simd.load(x, i), simd.load(y, i)))
        simd.store(out, x.size, simd.zeros(out))

    for dtype, lanes in (("float32", 16), ("float64", 8)):
        assert simd.lanes(np.dtype(dtype)) == lanes
        rng = np.random.default_rng(0)
        x, y = rng.standard_normal(2 * lanes).astype(dtype), rng.standard_normal(2 * lanes).astype(dtype)
        out = np.ones(3 * lanes, dtype)
        axpy(x.dtype.type(1.5), x, y, out, lanes)
        assert not out[2 * lanes:].any()
        if dtype == "float32":  # one rounding: the exact float64 result rounded once
            assert np.array_equal(out[:2 * lanes], (1.5 * x.astype(np.float64) + y).astype(dtype))
        else:
            assert np.allclose(out[:2 * lanes], 1.5 * x + y, rtol=1e-15, atol=0)

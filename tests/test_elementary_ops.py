"""Every pointwise function of the spec language (the elementary ops of issue #44 and the unary ops
before them) in one recurrence: a state a function, ``h = a * h + f(x)``, and an output that applies
it again, ``y = f(g(h))`` (`g` keeps the argument in the function's domain). Its inputs sit on the
functions' edge cases (0, -0, tiny, large |x|, atan2's quadrants and axes, clamp's bounds). The
interpreter against a NumPy loop (float64, L = 1, 7, 180, 1000); Numba and the emulated CUDA backend
against the interpreter, outputs and gradients, in float64 and float32 (the interpreter on the inputs
rounded to float32; tolerances `TOL`, `GRAD_TOL`) at L = 1, 7, 180, 1000 (`grid`: the full grid nightly);
``ssmc.grad``'s gradients on the interpreter and Numba against central finite differences (float64,
L = 1 and 7), in smooth regions; the CUDA kernels under NVRTC. One spec for all, so each backend
compiles once a dtype."""

from __future__ import annotations

import math

import numpy as np
import pytest
from profiles import nightly

import ssmc
from ssmc.backends.cuda import emulator, nvrtc
from ssmc.backends.cuda.report import kernel_reports

_erf = np.vectorize(math.erf, otypes=[np.float64])


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _clamp(x, lo, hi):
    return np.minimum(np.maximum(x, lo), hi)


# name: (the state's input term f(x, w), the output g(h, w), edge values of x, of w (atan2's x))
# in NumPy; `vocabulary` below is the same in the spec language
OPS = {
    "neg": (lambda x, w: -x, lambda h, w: -h, [0.0, -0.0, 1e-8, -1e-8, 3.0, -1e6]),
    "exp": (lambda x, w: np.exp(x), lambda h, w: np.exp(h), [0.0, 1e-8, -1e-8, -50.0, 3.0, -700.0]),
    "log": (lambda x, w: np.log(x), lambda h, w: np.log(h * h + 0.25), [1e-300, 1e-8, 1.0, 1e12, 0.5, 2.0]),
    "sqrt": (lambda x, w: np.sqrt(x), lambda h, w: np.sqrt(h * h + 0.25), [0.0, 1e-300, 1e-8, 1.0, 1e12, 2.0]),
    "rsqrt": (lambda x, w: 1 / np.sqrt(x), lambda h, w: 1 / np.sqrt(h * h + 0.25), [1e-12, 1.0, 1e12, 0.25, 3.0]),
    "abs": (lambda x, w: np.abs(x), lambda h, w: np.abs(h), [0.0, -0.0, 1e-8, -1e-8, -3.0, 5.0]),
    "sigmoid": (lambda x, w: _sigmoid(x), lambda h, w: _sigmoid(h), [0.0, 1e-8, -1e-8, -800.0, 800.0, 40.0, -40.0]),
    "tanh": (lambda x, w: np.tanh(x), lambda h, w: np.tanh(h), [0.0, 1e-8, -1e-8, -30.0, 30.0, 0.5, 20.0]),
    "softplus": (lambda x, w: np.logaddexp(0.0, x), lambda h, w: np.logaddexp(0.0, h),
                 [0.0, 1e-8, -1e-8, -800.0, 800.0, 30.0, -30.0]),
    "silu": (lambda x, w: x * _sigmoid(x), lambda h, w: h * _sigmoid(h),
             [0.0, 1e-8, -1e-8, -800.0, 800.0, 30.0, -30.0]),
    "gelu": (lambda x, w: 0.5 * x * (1 + _erf(x / math.sqrt(2))), lambda h, w: 0.5 * h * (1 + _erf(h / math.sqrt(2))),
             [0.0, 1e-8, -1e-8, -40.0, 40.0, 1.0, -1.0]),
    "relu": (lambda x, w: np.maximum(x, 0.0), lambda h, w: np.maximum(h, 0.0), [0.0, -0.0, 1e-8, -1e-8, -3.0, 3.0]),
    "erf": (lambda x, w: _erf(x), lambda h, w: _erf(h), [0.0, 1e-8, -1e-8, -6.0, 6.0, 0.5, 30.0]),
    "sin": (lambda x, w: np.sin(x), lambda h, w: np.sin(h), [0.0, -0.0, 1e-8, -1e-8, 3.0, -40.0, 1e4]),
    "cos": (lambda x, w: np.cos(x), lambda h, w: np.cos(h), [0.0, -0.0, 1e-8, -1e-8, 3.0, -40.0, 1e4]),
    "tan": (lambda x, w: np.tan(x), lambda h, w: np.tan(np.sin(h)), [0.0, 1e-8, -1e-8, 0.7, -1.5, 1.4, 3.0]),
    "atan2": (lambda x, w: np.arctan2(x, w), lambda h, w: np.arctan2(h, w),
              [1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 0.0, 0.0, -0.0, 0.0, 1e-300],
              [1.0, -1.0, -1.0, 1.0, 0.0, 0.0, 1.0, -1.0, -1.0, 0.0, -1.0]),
    "log1p": (lambda x, w: np.log1p(x), lambda h, w: np.log1p(h * h), [0.0, -0.0, 1e-10, -1e-10, -0.999999, 1e12, 3.0]),
    "expm1": (lambda x, w: np.expm1(x), lambda h, w: np.expm1(h), [0.0, -0.0, 1e-10, -1e-10, -40.0, 2.0, -1e-3]),
    "clamp": (lambda x, w: _clamp(x, -1.0, 2.0), lambda h, w: _clamp(h, -0.5, 0.5),
              [-3.0, -1.0, -0.999, 0.0, 1.999, 2.0, 5.0, -1.0000001]),
    "sign": (lambda x, w: np.sign(x) + 0.5 * x, lambda h, w: np.sign(h - 0.3) * h,
             [0.0, -0.0, 1e-300, -1e-300, -2.0, 3.0]),
}
# where the gradient is checked: inside each function's domain, away from its kinks (x = 0 for
# abs / relu / sign, clamp's bounds, atan2's cut and origin), as (low, high) of uniform draws
GRAD_RANGES = {"log": (0.1, 3.0), "sqrt": (0.1, 3.0), "rsqrt": (0.1, 3.0), "tan": (-1.2, 1.2),
               "log1p": (-0.9, 3.0), "clamp": (-3.0, 4.0)}


@ssmc.recurrence
def vocabulary(h_neg: ssmc.State["d"], h_exp: ssmc.State["d"], h_log: ssmc.State["d"], h_sqrt: ssmc.State["d"],
               h_rsqrt: ssmc.State["d"], h_abs: ssmc.State["d"], h_sigmoid: ssmc.State["d"],
               h_tanh: ssmc.State["d"], h_softplus: ssmc.State["d"], h_silu: ssmc.State["d"],
               h_gelu: ssmc.State["d"], h_relu: ssmc.State["d"], h_erf: ssmc.State["d"], h_sin: ssmc.State["d"],
               h_cos: ssmc.State["d"], h_tan: ssmc.State["d"], h_atan2: ssmc.State["d"],
               h_log1p: ssmc.State["d"], h_expm1: ssmc.State["d"], h_clamp: ssmc.State["d"],
               h_sign: ssmc.State["d"],
               x_neg: ssmc.Seq["d"], x_exp: ssmc.Seq["d"], x_log: ssmc.Seq["d"], x_sqrt: ssmc.Seq["d"],
               x_rsqrt: ssmc.Seq["d"], x_abs: ssmc.Seq["d"], x_sigmoid: ssmc.Seq["d"], x_tanh: ssmc.Seq["d"],
               x_softplus: ssmc.Seq["d"], x_silu: ssmc.Seq["d"], x_gelu: ssmc.Seq["d"], x_relu: ssmc.Seq["d"],
               x_erf: ssmc.Seq["d"], x_sin: ssmc.Seq["d"], x_cos: ssmc.Seq["d"], x_tan: ssmc.Seq["d"],
               x_atan2: ssmc.Seq["d"], w_atan2: ssmc.Seq["d"], x_log1p: ssmc.Seq["d"], x_expm1: ssmc.Seq["d"],
               x_clamp: ssmc.Seq["d"], x_sign: ssmc.Seq["d"], a: ssmc.Param["d"]):
    new = {
        "neg": a * h_neg + -x_neg,
        "exp": a * h_exp + ssmc.exp(x_exp),
        "log": a * h_log + ssmc.log(x_log),
        "sqrt": a * h_sqrt + ssmc.sqrt(x_sqrt),
        "rsqrt": a * h_rsqrt + ssmc.rsqrt(x_rsqrt),
        "abs": a * h_abs + ssmc.abs(x_abs),
        "sigmoid": a * h_sigmoid + ssmc.sigmoid(x_sigmoid),
        "tanh": a * h_tanh + ssmc.tanh(x_tanh),
        "softplus": a * h_softplus + ssmc.softplus(x_softplus),
        "silu": a * h_silu + ssmc.silu(x_silu),
        "gelu": a * h_gelu + ssmc.gelu(x_gelu),
        "relu": a * h_relu + ssmc.relu(x_relu),
        "erf": a * h_erf + ssmc.erf(x_erf),
        "sin": a * h_sin + ssmc.sin(x_sin),
        "cos": a * h_cos + ssmc.cos(x_cos),
        "tan": a * h_tan + ssmc.tan(x_tan),
        "atan2": a * h_atan2 + ssmc.atan2(x_atan2, w_atan2),
        "log1p": a * h_log1p + ssmc.log1p(x_log1p),
        "expm1": a * h_expm1 + ssmc.expm1(x_expm1),
        "clamp": a * h_clamp + ssmc.clamp(x_clamp, -1, 2),
        "sign": a * h_sign + ssmc.sign(x_sign) + 0.5 * x_sign,
    }
    out = {
        "neg": -new["neg"],
        "exp": ssmc.exp(new["exp"]),
        "log": ssmc.log(new["log"] * new["log"] + 0.25),
        "sqrt": ssmc.sqrt(new["sqrt"] * new["sqrt"] + 0.25),
        "rsqrt": ssmc.rsqrt(new["rsqrt"] * new["rsqrt"] + 0.25),
        "abs": ssmc.abs(new["abs"]),
        "sigmoid": ssmc.sigmoid(new["sigmoid"]),
        "tanh": ssmc.tanh(new["tanh"]),
        "softplus": ssmc.softplus(new["softplus"]),
        "silu": ssmc.silu(new["silu"]),
        "gelu": ssmc.gelu(new["gelu"]),
        "relu": ssmc.relu(new["relu"]),
        "erf": ssmc.erf(new["erf"]),
        "sin": ssmc.sin(new["sin"]),
        "cos": ssmc.cos(new["cos"]),
        "tan": ssmc.tan(ssmc.sin(new["tan"])),
        "atan2": ssmc.atan2(new["atan2"], w_atan2),
        "log1p": ssmc.log1p(new["log1p"] * new["log1p"]),
        "expm1": ssmc.expm1(new["expm1"]),
        "clamp": ssmc.clamp(new["clamp"], -0.5, 0.5),
        "sign": ssmc.sign(new["sign"] - 0.3) * new["sign"],
    }
    return tuple(new.values()), {f"y_{k}": v for k, v in out.items()}


D = max(len(v) for spec in OPS.values() for v in spec[2:])

LENGTHS = [1, 7, 180, 1000]
# A backend's outputs (gradients) against the interpreter's, which computes in float64 on the inputs
# rounded to the dtype, relative to the largest magnitude of each. float64: roundings only. float32: a
# step's rounding (2**-24 of the state's scale) is carried on at a decay of at most 0.6, so the state's
# relative error stays a few ulp at any length, and the outputs amplify it by their condition number
# (exp(h) by |h|, up to about 50 here); 1e-4 is some 30 times what is seen, 1e-3 for the gradients
# (sums over time of products of such values) as elsewhere in the suite (test_cuda.py).
TOL = {"float64": 1e-10, "float32": 1e-4}
GRAD_TOL = {"float64": 1e-10, "float32": 1e-3}


def grid(ci_long: tuple[int, str]) -> list[tuple[int, str]]:
    """(length, dtype) cases of a backend: every length of LENGTHS in float64 and float32 nightly
    (SSMC_PROPERTY_EXAMPLES set); otherwise, CI and a local run alike: float64 at L = 1 and 7 and the one long
    case `ci_long` (a dtype compiles the backend's kernels again, and the emulated CUDA kernels run a thread at
    a time)."""
    if not nightly():  # the full grid's float32 modules cost minutes of compiles
        return [(1, "float64"), (7, "float64"), ci_long]
    return [(length, dtype) for dtype in ("float64", "float32") for length in LENGTHS]


def _seq_names(name: str) -> list[str]:
    return [f"x_{name}", f"w_{name}"] if len(OPS[name]) == 4 else [f"x_{name}"]


def edge_inputs(length: int, seed: int, dtype: str = "float64") -> dict[str, np.ndarray]:
    """Each function's edge values along d (repeated to D), rotated by one place a step; random
    initial states and decays; in `dtype`. In float32 the tiny values (1e-300, zero there: log's
    input) are +-1e-30."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (_, _, *values) in OPS.items():
        for seq, vals in zip(_seq_names(name), values):
            row = np.resize(np.asarray(vals, dtype=np.float64), D)
            if dtype == "float32":
                row = np.where((row != 0) & (np.abs(row) < 1e-30), np.copysign(1e-30, row), row)
            out[seq] = np.stack([np.roll(row, t) for t in range(length)])
        out[f"h_{name}"] = rng.uniform(-1.0, 1.0, D)
    out["a"] = rng.uniform(0.1, 0.6, D)
    return {k: v.astype(dtype) for k, v in out.items()}


def smooth_inputs(length: int, seed: int, d: int = 3, dtype: str = "float64") -> dict[str, np.ndarray]:
    """Random inputs inside each function's smooth region (`GRAD_RANGES`, else [-2, 2]), in `dtype`."""
    rng = np.random.default_rng(seed)
    out = {}
    for name in OPS:
        lo, hi = GRAD_RANGES.get(name, (-2.0, 2.0))
        for seq in _seq_names(name):
            out[seq] = rng.uniform(lo, hi, (length, d))
        out[f"h_{name}"] = rng.uniform(-1.0, 1.0, d)
    out["a"] = rng.uniform(0.1, 0.6, d)
    return {k: v.astype(dtype) for k, v in out.items()}


def _float64(values: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}


def reference(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The plain loop in NumPy: every output [t d]."""
    out = {}
    for name, (term, output, *_) in OPS.items():
        h = inputs[f"h_{name}"]
        ys = []
        for t in range(len(inputs[f"x_{name}"])):
            x = inputs[f"x_{name}"][t]
            w = inputs[f"w_{name}"][t] if f"w_{name}" in inputs else None
            h = inputs["a"] * h + term(x, w)
            ys.append(output(h, w))
        out[f"y_{name}"] = np.stack(ys)
    return out


NAMES = [n for n, _ in vocabulary.program.outputs]


def _outputs(f, inputs) -> dict[str, np.ndarray]:
    return {n: np.asarray(v.cpu() if hasattr(v, "cpu") else v, dtype=np.float64) for n, v in zip(NAMES, f(**inputs))}


def _assert_close(got: dict, want: dict, tol: float):
    for n, w in want.items():
        assert np.all(np.isfinite(w)), n
        err = np.abs(got[n] - w).max() / max(np.abs(w).max(), 1e-300)
        assert err <= tol, f"{n}: relative error {err:.2e}"


@pytest.mark.parametrize("length", LENGTHS)
def test_interpreter_matches_numpy(length):
    inputs = edge_inputs(length, length)
    _assert_close(_outputs(ssmc.compile(vocabulary, "interpreter"), inputs), reference(inputs), 1e-13)


def _backend(name: str):
    if name == "cuda":
        if not emulator.available():
            pytest.skip("no C++ compiler for the CUDA emulator")
        pytest.importorskip("torch")


# the one long case of each backend in CI, in float64, whose kernels L = 1 and 7 compile already (a float32
# module is one more compile of the forward and the backward: minutes of CI's CPU; float32 runs nightly): Numba
# at the longest length, the emulated CUDA kernels (a thread at a time) at 180
CI_LONG = {"numba": (1000, "float64"), "cuda": (180, "float64")}


@pytest.mark.parametrize("backend, length, dtype", [(b, *case) for b in ("numba", "cuda") for case in grid(CI_LONG[b])])
def test_backends_match_the_interpreter(backend, length, dtype, emulated_cuda):
    """Outputs on the edge inputs in `dtype` against the interpreter's on the same (rounded) values."""
    _backend(backend)
    inputs = edge_inputs(length, length, dtype)
    want = _outputs(ssmc.compile(vocabulary, "interpreter"), _float64(inputs))
    _assert_close(_outputs(ssmc.compile(vocabulary, backend), inputs), want, TOL[dtype])


@pytest.mark.parametrize("backend, length, dtype", [(b, *case) for b in ("numba", "cuda") for case in grid(CI_LONG[b])])
def test_backend_gradients_match_the_interpreter(backend, length, dtype, emulated_cuda):
    """Every gradient on smooth inputs in `dtype` against the interpreter's on the same (rounded) values
    and cotangents."""
    _backend(backend)
    inputs = smooth_inputs(length, 20 + length, dtype=dtype)
    rng = np.random.default_rng(length)
    cot = {n: rng.standard_normal((length, 3)).astype(dtype) for n in NAMES}
    want = ssmc.grad(vocabulary, "interpreter")(**_float64(inputs), grad_outputs=_float64(cot))
    got = ssmc.grad(vocabulary, backend)(**inputs, grad_outputs=cot)
    assert set(got) == set(want)
    for key, w in want.items():
        g = np.asarray(got[key].cpu() if hasattr(got[key], "cpu") else got[key], dtype=np.float64)
        err = np.abs(g - w).max() / max(np.abs(w).max(), 1e-30)
        assert err <= GRAD_TOL[dtype], f"{key}: relative error {err:.2e}"


@pytest.mark.skipif(not nvrtc.available(), reason=nvrtc.unavailable_reason())
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_cuda_kernels_compile_with_nvrtc(dtype):
    """The device functions (ssmc_math.cuh's float and double overloads) under the real compiler."""
    reports = kernel_reports(vocabulary.program, {"d": 8}, 16, dtype, "sm_90")
    assert {"forward", "recompute", "adjoint"} <= {r.program for r in reports}
    for r in reports:
        assert r.resources is not None, r.error


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
@pytest.mark.parametrize("length", [1, 7])
def test_gradients_match_finite_differences(backend, length):
    """d loss / d input along a random direction per input, loss = sum of cotangent * output, against
    the central difference of the interpreter's loss (float64, step 1e-6)."""
    inputs = smooth_inputs(length, 10 + length)
    rng = np.random.default_rng(length)
    f = ssmc.compile(vocabulary, "interpreter")
    cot = {n: rng.standard_normal(v.shape) for n, v in _outputs(f, inputs).items()}

    def loss(values):
        return sum(float(np.sum(cot[n] * v)) for n, v in _outputs(f, values).items())

    grads = ssmc.grad(vocabulary, backend)(**inputs, grad_outputs=cot)
    eps = 1e-6
    for key, value in inputs.items():
        v = rng.standard_normal(value.shape)
        fd = (loss({**inputs, key: value + eps * v}) - loss({**inputs, key: value - eps * v})) / (2 * eps)
        g = np.asarray(grads[key])
        got = float(np.sum(g * v))
        assert np.all(np.isfinite(g)), key
        assert abs(got - fd) <= 1e-6 * max(float(np.sum(np.abs(g * v))), 1.0), f"{key}: {got} against {fd}"


@ssmc.recurrence
def named_like_the_functions(h: ssmc.State["d"], sin: ssmc.Seq["d"], sign: ssmc.Seq["d"], atan2: ssmc.Param["d"]):
    return 0.5 * ssmc.sin(sin) * h + ssmc.sign(sign) + atan2, ssmc.atan2(sin, sign) * h


@pytest.mark.parametrize("backend", ["numba", "cuda"])
def test_arrays_named_like_the_functions_they_call(backend, emulated_cuda):
    """The modules define the elementary functions only where they call one; the arrays are then
    printed by free names (numba/codegen.py's array_names, the CUDA printer's free names)."""
    if backend == "cuda":
        if not emulator.available():
            pytest.skip("no C++ compiler for the CUDA emulator")
        pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x, s = rng.standard_normal((2, 7, 3))
    p = rng.standard_normal(3)
    want = ssmc.compile(named_like_the_functions, "interpreter")(x, s, p)
    got = ssmc.compile(named_like_the_functions, backend)(x, s, p)
    got = np.asarray(got.cpu() if hasattr(got, "cpu") else got)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_sign_and_clamp_have_the_gradients_torch_gives():
    """sign' = 0 everywhere; clamp' = 1 inside [lo, hi] (bounds included), 0 outside."""

    @ssmc.recurrence
    def step(h: ssmc.State["d"], x: ssmc.Seq["d"]):
        return h, {"s": ssmc.sign(x), "c": ssmc.clamp(x, -1.0, 2.0)}

    x = np.array([[-3.0, -1.0, 0.0, -0.0, 2.0, 5.0, 1e-300]])
    one = np.ones_like(x)
    g = ssmc.grad(step, "interpreter")
    np.testing.assert_array_equal(g(x, grad_outputs={"s": one, "c": 0 * one})["x"], 0 * x)
    np.testing.assert_array_equal(g(x, grad_outputs={"s": 0 * one, "c": one})["x"], [[0, 1, 1, 1, 1, 0, 1]])


def test_numpy_ufuncs_on_tensors():
    @ssmc.recurrence
    def step(h: ssmc.State["d"], x: ssmc.Seq["d"], w: ssmc.Seq["d"]):
        return h, (np.sin(x) + np.cos(x) + np.tan(x) + np.arctan2(x, w) + np.log1p(w * w) + np.expm1(x)
                   + np.sign(w))

    x, w = np.linspace(-1, 1, 6).reshape(2, 3), np.linspace(-2, 1, 6).reshape(2, 3)
    want = np.sin(x) + np.cos(x) + np.tan(x) + np.arctan2(x, w) + np.log1p(w * w) + np.expm1(x) + np.sign(w)
    np.testing.assert_allclose(ssmc.compile(step, "interpreter")(x, w), want, rtol=1e-14)


@pytest.mark.parametrize("lo, hi, message", [
    (2.0, 1.0, "clamp with lo = 2.0 above hi = 1.0"),
    (float("nan"), 1.0, "clamp's lo must be a real number"),
    (0.0, "1", "clamp's hi must be a real number"),
    (True, 1.0, "clamp's lo must be a real number"),
])
def test_clamp_misuse_is_a_spec_error_at_the_users_line(lo, hi, message):
    with pytest.raises(ssmc.SpecError, match=message) as err:
        @ssmc.recurrence
        def step(h: ssmc.State["d"], x: ssmc.Seq["d"]):
            return h, ssmc.clamp(x, lo, hi)
    assert "test_elementary_ops.py" in str(err.value) and "ssmc.clamp(x, lo, hi)" in str(err.value)


def test_clamp_bounds_must_be_numbers_not_tensors():
    with pytest.raises(ssmc.SpecError, match="clamp's lo must be a real number, not Tensor"):
        @ssmc.recurrence
        def step(h: ssmc.State["d"], x: ssmc.Seq["d"], lo: ssmc.Param["d"]):
            return h, ssmc.clamp(x, lo, 1.0)

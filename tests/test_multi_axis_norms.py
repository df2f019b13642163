"""Norms, softmax and reductions over several axes at once (issue #44): ``ssmc.layernorm(x, over="g k")``,
``ssmc.rmsnorm``, ``ssmc.softmax`` and ``x.sum / mean / max("g k")``. A statistic over several axes is
a chain of one-axis reductions in the IR, so the derived backward and every backend see plain sums and
maxima. One spec (a gated scan over [b g k], then every norm of it over both axes in both orders,
and a norm over both axes inside a second state's update) checked against NumPy at L = 1, 7, 180, 1000;
on Numba and the emulated CUDA backend against the interpreter (outputs and every gradient, float64 and
float32, L = 1, 7, 180, 1000: `grid`, the full grid nightly); its gradients against central finite differences;
LayerNorm over two axes against torch; misuse as SpecErrors at the user's line."""

from __future__ import annotations

import numpy as np
import pytest
from profiles import nightly

import ssmc
from ssmc.backends.cuda import emulator

EPS = 1e-5
LENGTHS = [1, 7, 180, 1000]
# A backend's outputs (gradients) against the interpreter's, which computes in float64 on the inputs
# rounded to the dtype, relative to the largest magnitude of each. float64: roundings only. float32: the
# gated states are averages (decay below 1), so a step's rounding does not grow with the length; the norms
# divide by a standard deviation over 12 values (O(1) here) and the reductions add 12: a few ulp of the
# output's scale. 1e-4 forward and 1e-3 for the gradients (sums over time), as elsewhere in the suite
# (test_cuda.py), well above what is seen.
TOL = {"float64": 1e-10, "float32": 1e-4}
GRAD_TOL = {"float64": 1e-9, "float32": 1e-3}
# the one long case of each backend in CI, in float64, whose kernels L = 1 and 7 compile already (a float32
# module is one more compile of the forward and the backward: minutes of CI's CPU; float32 runs nightly): Numba
# at the longest length, the emulated CUDA kernels (a thread at a time) at 180
CI_LONG = {"numba": (1000, "float64"), "cuda": (180, "float64")}


def grid(backend: str) -> list[tuple[int, str]]:
    """(length, dtype) cases of a backend: every length of LENGTHS in float64 and float32 nightly
    (SSMC_PROPERTY_EXAMPLES set); otherwise, CI and a local run alike: float64 at L = 1 and 7 and the one long
    case CI_LONG[backend] (a dtype compiles the backend's kernels again)."""
    if not nightly():  # the full grid's float32 modules cost minutes of compiles
        return [(1, "float64"), (7, "float64"), CI_LONG[backend]]
    return [(length, dtype) for dtype in ("float64", "float32") for length in LENGTHS]


@ssmc.recurrence
def norms(h: ssmc.State["b g k"], r: ssmc.State["b g k"], x: ssmc.Seq["b g k"], a: ssmc.Seq["b g k"],
          w: ssmc.Param["g k"], wk: ssmc.Param["k"], beta: ssmc.Param["k g"]):
    f = ssmc.sigmoid(a)
    h = f * h + (1 - f) * x
    r = f * r + (1 - f) * ssmc.tanh(ssmc.layernorm(x + 0.5 * r, over="g k", weight=w, eps=EPS))
    return (h, r), {
        "ln": ssmc.layernorm(h, over="k g", weight=wk, bias=beta, eps=EPS),
        "rms": ssmc.rmsnorm(h, over="g k", weight=w, eps=EPS),
        "sm": ssmc.softmax(h, over="g k"),
        "red": h.sum("g k") + h.max("k g") - 2.0 * ssmc.mean(h, "g k"),
        "y_r": r,
    }


NAMES = [n for n, _ in norms.program.outputs]
SIZES = {"b": 2, "g": 3, "k": 4}


def inputs(length: int, seed: int, dtype: str = "float64") -> dict[str, np.ndarray]:
    """Layout "t ...": x, a [t b g k]; w [g k], wk [k], beta [k g]; initial states [b g k]; in `dtype`."""
    rng = np.random.default_rng(seed)
    b, g, k = SIZES.values()
    values = {"x": rng.standard_normal((length, b, g, k)), "a": rng.standard_normal((length, b, g, k)),
              "w": rng.uniform(0.5, 1.5, (g, k)), "wk": rng.uniform(0.5, 1.5, k),
              "beta": rng.uniform(-0.5, 0.5, (k, g)), "h": rng.standard_normal((b, g, k)),
              "r": rng.standard_normal((b, g, k))}
    return {n: v.astype(dtype) for n, v in values.items()}


def _float64(values: dict) -> dict[str, np.ndarray]:
    return {k: np.asarray(v, dtype=np.float64) for k, v in values.items()}


def _ln(v, eps=EPS):
    mu = v.mean(axis=(-2, -1), keepdims=True)
    var = ((v - mu) ** 2).mean(axis=(-2, -1), keepdims=True)
    return (v - mu) / np.sqrt(var + eps)


def reference(x, a, w, wk, beta, h, r) -> dict[str, np.ndarray]:
    """The plain loop in NumPy, the statistics over the last two dimensions (g, k) of [b g k]."""
    out = {n: [] for n in NAMES}
    for t in range(len(x)):
        f = 1 / (1 + np.exp(-a[t]))
        h = f * h + (1 - f) * x[t]
        r = f * r + (1 - f) * np.tanh(_ln(x[t] + 0.5 * r) * w)
        out["ln"].append(_ln(h) * wk[None, :] + beta.T)
        out["rms"].append(h / np.sqrt((h * h).mean(axis=(1, 2), keepdims=True) + EPS) * w)
        e = np.exp(h - h.max(axis=(1, 2), keepdims=True))
        out["sm"].append(e / e.sum(axis=(1, 2), keepdims=True))
        out["red"].append(h.sum(axis=(1, 2)) + h.max(axis=(1, 2)) - 2.0 * h.mean(axis=(1, 2)))
        out["y_r"].append(r)
    return {n: np.stack(v) for n, v in out.items()}


def _outputs(f, values) -> dict[str, np.ndarray]:
    return {n: np.asarray(v.cpu() if hasattr(v, "cpu") else v, dtype=np.float64) for n, v in zip(NAMES, f(**values))}


def _assert_close(got: dict, want: dict, tol: float):
    for n, w in want.items():
        assert got[n].shape == w.shape, n
        err = np.abs(got[n] - w).max() / max(np.abs(w).max(), 1e-300)
        assert err <= tol, f"{n}: relative error {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("length", LENGTHS)
def test_interpreter_matches_numpy(length):
    values = inputs(length, length)
    _assert_close(_outputs(ssmc.compile(norms, "interpreter"), values), reference(**values), 1e-12)


def _backend(name: str):
    if name == "cuda":
        if not emulator.available():
            pytest.skip("no C++ compiler for the CUDA emulator")
        pytest.importorskip("torch")
    return name


@pytest.mark.parametrize("backend, length, dtype", [(b, *case) for b in ("numba", "cuda") for case in grid(b)])
def test_backends_match_the_interpreter(backend, length, dtype, emulated_cuda):
    """Forward outputs and every gradient in `dtype` against the interpreter's on the same (rounded)
    inputs and cotangents."""
    _backend(backend)
    values = inputs(length, 100 + length, dtype)
    exact = _float64(values)
    want = _outputs(ssmc.compile(norms, "interpreter"), exact)
    _assert_close(_outputs(ssmc.compile(norms, backend), values), want, TOL[dtype])
    rng = np.random.default_rng(length)
    cot = {n: rng.standard_normal(v.shape).astype(dtype) for n, v in want.items()}
    want_g = ssmc.grad(norms, "interpreter")(**exact, grad_outputs=_float64(cot))
    got_g = ssmc.grad(norms, backend)(**values, grad_outputs=cot)
    assert set(got_g) == set(want_g)
    for key, wg in want_g.items():
        g = np.asarray(got_g[key].cpu() if hasattr(got_g[key], "cpu") else got_g[key], dtype=np.float64)
        err = np.abs(g - wg).max() / max(np.abs(wg).max(), 1e-30)
        assert err <= GRAD_TOL[dtype], f"{key}: relative error {err:.2e} > {GRAD_TOL[dtype]:.0e}"


@pytest.mark.parametrize("length", [1, 7])
def test_gradients_match_finite_differences(length):
    """d loss / d input along a random direction per input (loss = sum of cotangent * output), against
    the central difference of the interpreter's loss (float64, step 1e-6). Ties of the max have
    probability zero with these inputs."""
    values = inputs(length, 10 + length)
    rng = np.random.default_rng(length)
    f = ssmc.compile(norms, "interpreter")
    cot = {n: rng.standard_normal(v.shape) for n, v in _outputs(f, values).items()}

    def loss(vals):
        return sum(float(np.sum(cot[n] * v)) for n, v in _outputs(f, vals).items())

    grads = ssmc.grad(norms, "interpreter")(**values, grad_outputs=cot)
    eps = 1e-6
    for key, value in values.items():
        v = rng.standard_normal(value.shape)
        fd = (loss({**values, key: value + eps * v}) - loss({**values, key: value - eps * v})) / (2 * eps)
        got = float(np.sum(grads[key] * v))
        assert abs(got - fd) <= 1e-6 * max(float(np.sum(np.abs(grads[key] * v))), 1.0), f"{key}: {got} against {fd}"


def test_layernorm_over_two_axes_matches_torch():
    torch = pytest.importorskip("torch")
    F = torch.nn.functional

    @ssmc.recurrence
    def step(h: ssmc.State["b g k"], x: ssmc.Seq["b g k"], w: ssmc.Param["g k"], beta: ssmc.Param["g k"]):
        return h + x, (ssmc.layernorm(h + x, over="g k", weight=w, bias=beta), ssmc.rmsnorm(h + x, over="g k"),
                       ssmc.softmax(h + x, over="g k"))

    rng = np.random.default_rng(3)
    x, w, beta = rng.standard_normal((5, 2, 3, 4)), rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    ln, rms, sm = ssmc.compile(step, "interpreter")(x, w, beta)
    h = torch.from_numpy(np.cumsum(x, axis=0))
    want_ln = F.layer_norm(h, (3, 4), torch.from_numpy(w), torch.from_numpy(beta), eps=1e-5).numpy()
    want_rms = (h * torch.rsqrt(h.pow(2).mean((-2, -1), keepdim=True) + 1e-6)).numpy()
    want_sm = torch.softmax(h.reshape(5, 2, 12), -1).reshape(5, 2, 3, 4).numpy()
    for got, want in ((ln, want_ln), (rms, want_rms), (sm, want_sm)):
        assert np.abs(got - want).max() <= 1e-12 * np.abs(want).max()


@pytest.mark.parametrize("call, message", [
    ('ssmc.layernorm(x, over="g z")', r"layernorm over axis 'z': the value has axes \['b', 'g', 'k'\]"),
    ('ssmc.rmsnorm(x, over="k k")', r"rmsnorm over 'k k': an axis is named twice"),
    ('ssmc.softmax(x, over="")', r"softmax needs the axes to normalise over"),
    ('ssmc.layernorm(x, over="g k", weight=v)', r"layernorm: weight must be a param over the normalised "
                                                 r"axes \[g k\] \(all or some of them\), got axes \['b'\]"),
    ('ssmc.rmsnorm(x, over="k", weight=w)', r"rmsnorm: weight must be a param over the normalised axis \[k\], "
                                             r"got axes \['g', 'k'\]"),
    ('x.sum("g z")', r"cannot reduce over axis 'z'"),
])
def test_misuse_is_a_spec_error_at_the_users_line(call, message, tmp_path):
    path = tmp_path / "spec_with_a_bad_norm.py"
    path.write_text("import ssmc\n\n\n"
                    "def step(h: ssmc.State['b'], x: ssmc.Seq['b g k'], w: ssmc.Param['g k'], v: ssmc.Param['b']):\n"
                    f"    y = {call}\n"
                    "    return h, y\n")
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    with pytest.raises(ssmc.SpecError, match=message) as err:
        ssmc.recurrence(namespace["step"])
    assert "spec_with_a_bad_norm.py:5:" in str(err.value) and call in str(err.value)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_on_a_gpu_against_the_interpreter(dtype):
    """As test_backends_match_the_interpreter on CUDA tensors, against the interpreter on the inputs
    rounded to `dtype`."""
    import torch

    tol, grad_tol = (1e-10, 1e-9) if dtype == "float64" else (1e-4, 1e-3)
    for length in [1, 7, 180, 1000]:
        gpu = {k: torch.tensor(v, device="cuda").to(getattr(torch, dtype)) for k, v in inputs(length, length).items()}
        exact = {k: v.double().cpu().numpy() for k, v in gpu.items()}
        want = _outputs(ssmc.compile(norms, "interpreter"), exact)
        _assert_close(_outputs(ssmc.compile(norms, "cuda"), gpu), want, tol)
        rng = np.random.default_rng(length)
        cot = {n: rng.standard_normal(v.shape) for n, v in want.items()}
        want_g = ssmc.grad(norms, "interpreter")(**exact, grad_outputs=cot)
        got_g = ssmc.grad(norms, "cuda")(**gpu, grad_outputs={
            n: torch.tensor(c, device="cuda").to(getattr(torch, dtype)) for n, c in cot.items()})
        for key, wg in want_g.items():
            g = got_g[key].double().cpu().numpy()
            assert np.abs(g - wg).max() <= grad_tol * max(np.abs(wg).max(), 1e-30), (length, key)

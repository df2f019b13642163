"""Complex values in a spec (issue #44): traced as pairs of real values (frontend/complex.py), split
and joined at the call (complex_io.py, ssmc.torch.ComplexFunction).

- The LRU example (a complex diagonal, complex params B and C) on the interpreter, Numba and the
  emulated CUDA backend against its NumPy complex128 loop at L = 1, 7, 180: outputs, the complex
  final state, and every gradient against torch autograd of the same loop written in torch
  (complex128: 1e-10 relative; complex64 inputs on Numba: 1e-4); its gradients against central
  finite differences along the real and the imaginary parts.
- A Hypothesis property: random small complex elementwise / diagonal step bodies (complex and real
  states, sequences and params, + - * /, conj, exp, abs, real, imag, complex, powers, sums over an
  axis; sin, cos, expm1, atan2, clamp, log1p of their parts), the same body run by ssmc, by a NumPy
  loop and by a torch loop (gradients), on the interpreter and Numba.
- ``ssmc.torch.function`` on complex tensors against torch autograd of a torch loop (torch's
  convention for complex gradients: dL/d(re) + i dL/d(im)).
- Misuse: SpecErrors at the user's line, ValueErrors naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from profiles import examples

import ssmc
import ssmc.torch
from ssmc.backends.cuda import emulator
from ssmc.examples import lru

torch = pytest.importorskip("torch")

LENGTHS = [1, 7, 180]
TOL = {np.complex128: 1e-10, np.complex64: 1e-4}
LRU_INPUTS = ["x", "nu_log", "theta_log", "gamma_log", "B", "C", "D", "h"]


def rel_err(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1e-30))


def _numpy(x):
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


# -- the LRU example ------------------------------------------------------------------------------

def lru_torch(x, nu_log, theta_log, gamma_log, B, C, D, h):
    """examples/lru.py's loop in torch (complex128 autograd: the gradients' reference)."""
    lam = torch.exp(-torch.exp(nu_log) + 1j * torch.exp(theta_log))
    gamma = torch.exp(gamma_log)
    ys = []
    for t in range(x.shape[1]):
        h = lam * h + gamma * (x[:, t, :].to(B.dtype) @ B.T)
        ys.append((h @ C.T).real + D * x[:, t, :])
    return torch.stack(ys, 1), h


def lru_reference_grads(inputs: dict, gy, gh) -> dict:
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in inputs.items()}
    y, h = lru_torch(*(leaves[k] for k in LRU_INPUTS))
    grads = torch.autograd.grad([y, h], [leaves[k] for k in LRU_INPUTS], [torch.tensor(gy), torch.tensor(gh)])
    return {k: g.numpy() for k, g in zip(LRU_INPUTS, grads)}


def _backend(name: str, monkeypatch):
    if name == "cuda":
        if not emulator.available():
            pytest.skip("no C++ compiler for the CUDA emulator")
        monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")


@pytest.mark.parametrize("backend", ["interpreter", "numba", "cuda"])
def test_lru_matches_numpy_and_torch_gradients(backend, monkeypatch):
    """Outputs and the complex final state against the NumPy loop, every gradient (complex ones for
    B, C, h) against torch autograd, complex128, at L = 1, 7, 180."""
    _backend(backend, monkeypatch)
    f = ssmc.compile(lru.SPEC, backend, layout=lru.LAYOUT)
    g = ssmc.grad(lru.SPEC, backend, layout=lru.LAYOUT)
    for length in LENGTHS:
        rng = np.random.default_rng(length)
        inputs = lru.make_inputs(rng, length)
        y, h = f(**inputs, return_final_states=True)
        y_ref, h_ref = lru.reference(**inputs)
        assert _numpy(h).dtype == np.complex128
        assert rel_err(_numpy(y), y_ref) <= TOL[np.complex128], length
        assert rel_err(_numpy(h), h_ref) <= TOL[np.complex128], length
        gy = rng.standard_normal(y_ref.shape)
        gh = rng.standard_normal(h_ref.shape) + 1j * rng.standard_normal(h_ref.shape)
        got = g(**inputs, grad_outputs=gy, grad_final_states=gh)
        want = lru_reference_grads(inputs, gy, gh)
        assert set(got) == set(want)
        for k, w in want.items():
            assert _numpy(got[k]).dtype == w.dtype, k
            assert rel_err(_numpy(got[k]), w) <= TOL[np.complex128], (length, k)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.complex128, np.complex64])
def test_gpu_lru_matches_numpy_and_torch_gradients(dtype):
    """On a GPU: `ssmc.compile` and `ssmc.grad` of the LRU on CUDA tensors (complex128 and complex64, the
    real inputs in float64 / float32) against the NumPy loop and torch autograd in complex128, at
    L = 1, 7, 180, 1000."""
    real = np.float64 if dtype == np.complex128 else np.float32
    tol = TOL[dtype] * (10 if dtype == np.complex64 else 1)  # float32 over 1000 steps
    f = ssmc.compile(lru.SPEC, "cuda", layout=lru.LAYOUT)
    g = ssmc.grad(lru.SPEC, "cuda", layout=lru.LAYOUT)
    for length in [*LENGTHS, 1000]:
        rng = np.random.default_rng(length)
        inputs = {k: v.astype(dtype if np.iscomplexobj(v) else real) for k, v in lru.make_inputs(rng, length).items()}
        wide = {k: v.astype(np.complex128 if np.iscomplexobj(v) else np.float64) for k, v in inputs.items()}
        on_gpu = {k: torch.tensor(v, device="cuda") for k, v in inputs.items()}
        y, h = f(**on_gpu, return_final_states=True)
        y_ref, h_ref = lru.reference(**wide)
        assert h.dtype == torch.tensor(np.zeros(1, dtype)).dtype and h.is_cuda
        assert rel_err(_numpy(y), y_ref) <= tol, length
        assert rel_err(_numpy(h), h_ref) <= tol, length
        gy = rng.standard_normal(y_ref.shape)
        gh = rng.standard_normal(h_ref.shape) + 1j * rng.standard_normal(h_ref.shape)
        got = g(**on_gpu, grad_outputs=torch.tensor(gy.astype(real), device="cuda"),
                grad_final_states=torch.tensor(gh.astype(dtype), device="cuda"))
        want = lru_reference_grads(wide, gy.astype(real).astype(np.float64), gh.astype(dtype).astype(np.complex128))
        for k, w in want.items():
            assert rel_err(_numpy(got[k]), w) <= tol, (length, k)


def test_lru_complex64_on_numba():
    """complex64 inputs (float32 parts): Numba computes in float32 and returns complex64."""
    rng = np.random.default_rng(3)
    inputs = lru.make_inputs(rng, 180)
    single = {k: v.astype(np.complex64 if np.iscomplexobj(v) else np.float32) for k, v in inputs.items()}
    y, h = ssmc.compile(lru.SPEC, "numba", layout=lru.LAYOUT)(**single, return_final_states=True)
    assert y.dtype == np.float32 and h.dtype == np.complex64
    y_ref, h_ref = lru.reference(**{k: v.astype(np.complex128 if np.iscomplexobj(v) else np.float64)
                                    for k, v in single.items()})
    assert rel_err(y, y_ref) <= TOL[np.complex64]
    assert rel_err(h, h_ref) <= TOL[np.complex64]
    gy = rng.standard_normal(y_ref.shape)
    got = ssmc.grad(lru.SPEC, "numba", layout=lru.LAYOUT)(**single, grad_outputs=gy.astype(np.float32))
    want = lru_reference_grads({k: v.astype(np.complex128 if np.iscomplexobj(v) else np.float64)
                                for k, v in single.items()}, gy, np.zeros_like(h_ref))
    for k, w in want.items():
        assert got[k].dtype == (np.complex64 if np.iscomplexobj(w) else np.float32), k
        assert rel_err(got[k], w) <= TOL[np.complex64], k


@pytest.mark.parametrize("length", [1, 7])
def test_lru_gradients_match_finite_differences(length):
    """For loss = Re(sum conj(g) * outputs) + ..., the gradient of a complex input z = a + ib is
    dL/da + i dL/db: checked along random directions of the real and of the imaginary part."""
    rng = np.random.default_rng(10 + length)
    inputs = lru.make_inputs(rng, length)
    f = ssmc.compile(lru.SPEC, "interpreter", layout=lru.LAYOUT)
    y, h = f(**inputs, return_final_states=True)
    gy = rng.standard_normal(y.shape)
    gh = rng.standard_normal(h.shape) + 1j * rng.standard_normal(h.shape)

    def loss(vals):
        yv, hv = f(**vals, return_final_states=True)
        return float(np.sum(gy * yv) + np.sum((np.conj(gh) * hv).real))

    grads = ssmc.grad(lru.SPEC, "interpreter", layout=lru.LAYOUT)(**inputs, grad_outputs=gy, grad_final_states=gh)
    eps = 1e-6
    for key, value in inputs.items():
        for unit in ((1.0, 1j) if np.iscomplexobj(value) else (1.0,)):
            v = unit * rng.standard_normal(value.shape)
            fd = (loss({**inputs, key: value + eps * v}) - loss({**inputs, key: value - eps * v})) / (2 * eps)
            got = float(np.sum((np.conj(grads[key]) * v).real))   # <grad, v> over the real pairs
            assert abs(got - fd) <= 1e-6 * max(abs(fd), 1.0), (key, unit, got, fd)


def test_lru_torch_function_matches_torch_autograd():
    """ssmc.torch.function on complex tensors (B, C, h complex128) against autograd of the torch loop:
    the forward, the final state, and every gradient (torch's complex convention)."""
    inputs = lru.make_inputs(np.random.default_rng(5), 7)
    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in inputs.items()}
    f = ssmc.torch.function(lru.SPEC, "numba", layout=lru.LAYOUT, return_final_states=True)
    y, h = f(*(leaves[k] for k in LRU_INPUTS[:-1]), h=leaves["h"])
    assert h.dtype == torch.complex128 and y.dtype == torch.float64
    y_ref, h_ref = lru_torch(*(leaves[k] for k in LRU_INPUTS))
    assert rel_err(_numpy(y), _numpy(y_ref)) <= 1e-10 and rel_err(_numpy(h), _numpy(h_ref)) <= 1e-10
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    got = torch.autograd.grad([y, h], list(leaves.values()), [gy, gh])
    want = torch.autograd.grad([y_ref, h_ref], list(leaves.values()), [gy, gh])
    for k, a, b in zip(leaves, got, want):
        assert a.dtype == b.dtype and rel_err(_numpy(a), _numpy(b)) <= 1e-10, k


def test_lru_runs_in_pieces():
    """The complex final state fed back as the initial state continues the sequence."""
    inputs = lru.make_inputs(np.random.default_rng(8), 9)
    f = ssmc.compile(lru.SPEC, "interpreter", layout=lru.LAYOUT)
    whole, h = f(**inputs, return_final_states=True)
    y1, h1 = f(**{**inputs, "x": inputs["x"][:, :4]}, return_final_states=True)
    y2, h2 = f(**{**inputs, "x": inputs["x"][:, 4:], "h": h1}, return_final_states=True)
    assert rel_err(np.concatenate([y1, y2], 1), whole) <= 1e-13 and rel_err(h2, h) <= 1e-13


# -- random complex step bodies --------------------------------------------------------------------
# One body, three namespaces `S`: ssmc (the spec), NumPy (the forward's reference) and torch (the
# gradients' reference). Values are [b n] (states, sequences), [n] (params) or constants; broadcasting
# by name (ssmc) and by trailing axis (NumPy, torch) agree on these, and a sum over n keeps a unit axis.

class _NumpyS:
    exp, conj, real, imag = np.exp, np.conj, np.real, np.imag
    sin, cos, expm1, log1p, atan2 = np.sin, np.cos, np.expm1, np.log1p, np.arctan2
    clamp = staticmethod(lambda v, lo, hi: np.clip(v, lo, hi))
    complex = staticmethod(lambda re, im: re + 1j * im)
    sum = staticmethod(lambda v, axis: np.sum(v, -1, keepdims=True))


def _t(v):
    """A number as a float64 / complex128 torch scalar (torch's defaults are single precision)."""
    if isinstance(v, torch.Tensor):
        return v
    return torch.as_tensor(v, dtype=torch.complex128 if np.iscomplexobj(v) else torch.float64)


class _TorchS:
    exp = staticmethod(lambda v: torch.exp(_t(v)))
    conj = staticmethod(lambda v: torch.conj(_t(v)))
    real = staticmethod(lambda v: _t(v).real)
    imag = staticmethod(lambda v: _t(v).imag if _t(v).is_complex() else torch.zeros_like(_t(v)))
    complex = staticmethod(lambda re, im: re + 1j * im)
    sum = staticmethod(lambda v, axis: torch.sum(v, -1, keepdim=True))
    sin = staticmethod(lambda v: torch.sin(_t(v)))
    cos = staticmethod(lambda v: torch.cos(_t(v)))
    expm1 = staticmethod(lambda v: torch.expm1(_t(v)))
    log1p = staticmethod(lambda v: torch.log1p(_t(v)))
    atan2 = staticmethod(lambda y, x: torch.atan2(_t(y), _t(x)))
    clamp = staticmethod(lambda v, lo, hi: torch.clamp(_t(v), lo, hi))


SEQS, LEAVES = ["x", "r"], ["h", "g", "x", "r", "a", "w", "0.7", "(0.3 - 0.4j)"]
UNARY = ["S.conj({})", "S.exp(0.2 * {})", "abs({})", "S.real({})", "S.imag({})", "(0.5j * {})", "({} ** 2)",
         "S.complex(S.real({0}), -S.imag({0}))",
         # the real elementary ops of issue #44 on the parts of complex values
         "S.complex(S.cos(S.real({0})), S.sin(S.imag({0})))",
         "S.complex(S.expm1(0.3 * S.real({0})), S.atan2(S.imag({0}), 1.5))",
         "S.complex(S.clamp(S.real({0}), -2.0, 2.0), S.log1p(abs({0})))"]
BINARY = ["({} + {})", "({} - {})", "({} * {})", "({} / (1.5 + abs({})))"]


def _expressions():
    leaf = st.sampled_from(LEAVES)
    summed = st.builds(lambda s, o: f"S.sum({s} * {o}, 'n')", st.sampled_from(SEQS), leaf)

    def extend(inner):
        return st.one_of(st.builds(lambda u, e: u.format(e), st.sampled_from(UNARY), inner),
                         st.builds(lambda b, l, r: b.format(l, r), st.sampled_from(BINARY), inner, inner))
    return st.recursive(st.one_of(leaf, summed), extend, max_leaves=5)


BODY = """\
    lam = S.exp(S.complex(-S.exp(w), S.imag(a)))
    e = {e1}
    h = lam * h + e / (1.5 + abs(e))
    q = S.real({e2})
    g = 0.5 * g + q / (1.5 + abs(q))
    return (h, g), {{"y": h * ({e3}), "yr": g * S.real({e3})}}
"""
SPEC_ARGS = ('h: ssmc.State["b n", complex], g: ssmc.State["b n"], x: ssmc.Seq["b n", complex], '
             'r: ssmc.Seq["b n"], a: ssmc.Param["n", complex], w: ssmc.Param["n"]')


def _build(e1: str, e2: str, e3: str):
    body = BODY.format(e1=e1, e2=e2, e3=e3)
    spec_ns = {"ssmc": ssmc, "S": ssmc}
    exec(f"def step({SPEC_ARGS}):\n{body}", spec_ns)
    ref = {}
    for name, S in (("numpy", _NumpyS), ("torch", _TorchS)):
        ns = {"S": S}
        exec(f"def step(h, g, x, r, a, w):\n{body}", ns)
        ref[name] = ns["step"]
    return ssmc.recurrence(spec_ns["step"], name="random_complex"), ref["numpy"], ref["torch"]


def _loop(step, h, g, x, r, a, w, stack):
    ys, yrs = [], []
    for t in range(x.shape[0]):
        (h, g), out = step(h, g, x[t], r[t], a, w)
        ys.append(out["y"])
        yrs.append(out["yr"])
    return stack(ys), stack(yrs), h, g


def _inputs(rng, length: int, b: int = 2, n: int = 3) -> dict:
    c = lambda *s: rng.standard_normal(s) + 1j * rng.standard_normal(s)  # noqa: E731
    return {"x": c(length, b, n), "r": rng.standard_normal((length, b, n)), "a": c(n),
            "w": rng.uniform(-1.0, 1.0, n), "h": c(b, n), "g": rng.standard_normal((b, n))}


ORDER = ["h", "g", "x", "r", "a", "w"]


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_random_complex_specs(backend):
    @settings(max_examples=examples(8 if backend == "interpreter" else 2, ci=3 if backend == "interpreter" else 1),
              deadline=None)
    @given(e1=_expressions(), e2=_expressions(), e3=_expressions(), seed=st.integers(0, 2**16))
    def prop(e1, e2, e3, seed):
        spec, numpy_step, torch_step = _build(e1, e2, e3)
        f = ssmc.compile(spec, backend, layout="t b n")    # every array's axes in this order
        grad = ssmc.grad(spec, backend, layout="t b n")
        for length in LENGTHS:
            rng = np.random.default_rng(seed + length)
            v = _inputs(rng, length)
            (y, yr), (h, g) = f(v["x"], v["r"], v["a"], v["w"], h=v["h"], g=v["g"], return_final_states=True)
            want = _loop(numpy_step, *(v[k] for k in ORDER), np.stack)
            want = [np.broadcast_to(want[0], np.shape(y)), np.broadcast_to(want[1], np.shape(yr)), *want[2:]]
            for got, w in zip((y, yr, h, g), want):
                assert rel_err(got, w) <= TOL[np.complex128], (e1, e2, e3, length)
            cot = [rng.standard_normal(np.shape(w)) + (1j * rng.standard_normal(np.shape(w)) if np.iscomplexobj(w)
                                                       else 0) for w in want]
            got = grad(v["x"], v["r"], v["a"], v["w"], h=v["h"], g=v["g"], grad_outputs={"y": cot[0], "yr": cot[1]},
                       grad_final_states={"h": cot[2], "g": cot[3]})
            leaves = {k: torch.tensor(v[k], requires_grad=True) for k in ORDER}
            outs = _loop(torch_step, *(leaves[k] for k in ORDER), torch.stack)
            outs = [o.expand(*c.shape) if o.shape != c.shape else o for o, c in zip(outs, cot)]
            ref = torch.autograd.grad(outs, list(leaves.values()), [torch.tensor(c) for c in cot], allow_unused=True)
            for k, r in zip(ORDER, ref):
                r = np.zeros_like(v[k]) if r is None else r.numpy()
                assert got[k].dtype == r.dtype, k
                assert np.abs(got[k] - r).max() <= TOL[np.complex128] * max(np.abs(r).max(), 1.0), \
                    (e1, e2, e3, length, k)

    prop()


# -- misuse ----------------------------------------------------------------------------------------

def _trace(tmp_path, args: str, line: str, ret: str = "h, y"):
    path = tmp_path / "spec_with_complex.py"
    path.write_text(f"import ssmc\n\n\ndef step({args}):\n    y = {line}\n    return {ret}\n")
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return lambda: ssmc.recurrence(namespace["step"])


Z = "h: ssmc.State['b n', complex], x: ssmc.Seq['b n', complex]"


@pytest.mark.parametrize("args, line, ret, message", [
    (Z, "ssmc.sigmoid(x)", "h, y", r"ssmc\.sigmoid of a complex value: it takes real values"),
    (Z, "ssmc.tanh(h * x)", "h, y", r"ssmc\.tanh of a complex value"),
    (Z, "ssmc.maximum(x, 0.0)", "h, y", r"a complex value where a real value is required"),
    (Z, "x < 0.0", "h, y", r"comparing a complex value"),
    (Z, "x == h", "h, y", r"comparing a complex value"),
    (Z, "ssmc.complex(x, 1.0)", "h, y", r"ssmc.complex\(re, im\): re is complex"),
    (Z, "x ** 0.5", "h, y", r"only integer powers"),
    ("h: ssmc.State['b n'], x: ssmc.Seq['b n', complex]", "h * x", "y, h",
     r"new value of state 'h' is complex but 'h' is declared real"),
    ("h: ssmc.State['b n'], x: ssmc.Seq['b n']", "h * 1j", "y, h",
     r"new value of state 'h' is complex but 'h' is declared real"),
    ("h: ssmc.State['b n', complex], h_re: ssmc.Seq['b n']", "h_re", "h, y",
     r"argument 'h_re' has the name the complex argument 'h'"),
    ("h: ssmc.State['b n', int], x: ssmc.Seq['b n']", "x", "h, y", r"takes the axes and optionally the type"),
])
def test_misuse_is_a_spec_error_at_the_users_line(tmp_path, args, line, ret, message):
    with pytest.raises(ssmc.SpecError, match=message) as err:
        _trace(tmp_path, args, line, ret)()
    assert "spec_with_complex.py:" in str(err.value)
    if "state" not in message and "argument" not in message and "type" not in message:
        assert "spec_with_complex.py:5:" in str(err.value) and line in str(err.value)


def test_complex_argument_of_attention_is_a_spec_error():
    def score_mod(score, q_idx, kv_idx, bias: ssmc.Param["h", complex]):
        return score

    with pytest.raises(ssmc.SpecError, match="complex values are supported in recurrences only"):
        ssmc.attention(score_mod=score_mod)


def test_wrong_arrays_are_value_errors_naming_the_argument():
    inputs = lru.make_inputs(np.random.default_rng(0), 4)
    f = ssmc.compile(lru.SPEC, "interpreter", layout=lru.LAYOUT)
    with pytest.raises(ValueError, match=r"argument 'B' of lru is declared complex: give a complex array"):
        f(**{**inputs, "B": inputs["B"].real})
    with pytest.raises(ValueError, match=r"argument 'h' of lru is declared complex"):
        f(**{**inputs, "h": inputs["h"].real})
    with pytest.raises(ValueError, match=r"argument 'D' of lru is declared real but a complex array"):
        f(**{**inputs, "D": inputs["D"] + 0j})
    with pytest.raises(ValueError, match=r"argument 'x' of lru is declared real"):
        ssmc.torch.function(lru.SPEC, layout=lru.LAYOUT)(**{k: torch.tensor(v) for k, v in
                                                             {**inputs, "x": inputs["x"] + 1j}.items()})
    with pytest.raises(ValueError, match=r"grad_final_states\['h'\]|unknown names"):
        ssmc.grad(lru.SPEC, "interpreter", layout=lru.LAYOUT)(**inputs, grad_final_states={"q": inputs["h"]})


def test_python_complex_numbers_and_dict_layouts():
    """``2j * x`` makes a complex value; a dict layout naming a complex sequence covers its pair."""
    @ssmc.recurrence
    def rot(h: ssmc.State["b n", complex], x: ssmc.Seq["b n"]):
        h = (0.6 + 0.3j) * h + 2j * x - x / (1 - 1j)
        return h, {"z": h.conj(), "m": abs(h), "p": ssmc.angle(h)}

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 3))
    (z, m, p), h = ssmc.compile(rot, "interpreter", layout={"x": "b t n", "*": "b t ..."})(x, return_final_states=True)
    hh, zs = np.zeros((2, 3), complex), []
    for t in range(5):
        hh = (0.6 + 0.3j) * hh + 2j * x[:, t] - x[:, t] / (1 - 1j)
        zs.append(hh)
    zs = np.stack(zs, 1)
    assert rel_err(z, zs.conj()) <= 1e-13 and rel_err(m, np.abs(zs)) <= 1e-13
    assert rel_err(p, np.angle(zs)) <= 1e-13 and rel_err(h, hh) <= 1e-13


def test_shift_of_a_complex_value_and_unbind():
    """``x.shift(1)`` of a complex sequence: its register is the complex state ``x_shift1`` (given and
    returned complex, so a sequence runs in pieces); ``unbind`` of a complex param."""
    @ssmc.recurrence
    def conv(h: ssmc.State["b n", complex], x: ssmc.Seq["b n", complex], w: ssmc.Param["n g=2", complex]):
        w0, w1 = w.unbind("g")
        h = 0.5 * h + w0 * x.shift(1) + w1 * x
        return h, ssmc.sum(h, "n")

    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 2, 3)) + 1j * rng.standard_normal((6, 2, 3))
    w = rng.standard_normal((3, 2)) + 1j * rng.standard_normal((3, 2))
    f = ssmc.compile(conv, "interpreter")
    y, (h, x1) = f(x, w, return_final_states=True)
    hh, prev, ys = np.zeros((2, 3), complex), np.zeros((2, 3), complex), []
    for t in range(6):
        hh, prev = 0.5 * hh + w[:, 0] * prev + w[:, 1] * x[t], x[t]
        ys.append(hh.sum(-1))
    assert rel_err(y, np.stack(ys)) <= 1e-13 and rel_err(h, hh) <= 1e-13 and rel_err(x1, x[-1]) == 0
    y1, (h1, s1) = f(x[:2], w, return_final_states=True)
    y2 = f(x[2:], w, h=h1, x_shift1=s1)
    assert rel_err(np.concatenate([y1, y2]), y) <= 1e-13
    assert ssmc.grad(conv, "interpreter")(x, w, grad_outputs=np.ones((6, 2)) * 1j)["x_shift1"].dtype == np.complex128


def test_lru_step_by_step_equals_the_whole_sequence():
    """ssmc.step on complex specs: the complex state goes back in as ``states=``."""
    inputs = lru.make_inputs(np.random.default_rng(2), 5)
    whole, h_last = ssmc.compile(lru.SPEC, "interpreter", layout=lru.LAYOUT)(**inputs, return_final_states=True)
    step = ssmc.step(lru.SPEC, "interpreter", layout=lru.LAYOUT)
    h, ys = inputs["h"], []
    params = {k: v for k, v in inputs.items() if k not in ("x", "h")}
    for t in range(5):
        y, h = step(inputs["x"][:, t], **params, states=h)
        ys.append(y)
    assert h.dtype == np.complex128
    assert rel_err(np.stack(ys, 1), whole) <= 1e-13 and rel_err(h, h_last) <= 1e-13


def test_torch_recurrence_module_holds_complex_params_as_real_pairs():
    """ssmc.torch.Recurrence of the LRU: B and C are the parameters B_re, B_im, C_re, C_im; the final
    state comes back complex, and the output is the LRU's with B = B_re + i B_im."""
    torch.manual_seed(0)
    layer = ssmc.torch.Recurrence(lru.SPEC, layout=lru.LAYOUT, sizes={"d": 4, "n": 3}).double()
    names = dict(layer.named_parameters())
    assert {"B_re", "B_im", "C_re", "C_im"} <= set(names)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    y, h = layer(x, return_final_states=True)
    assert h.dtype == torch.complex128
    p = {k: v.detach().numpy() for k, v in names.items()}
    want, h_ref = lru.reference(x.numpy(), p["nu_log"], p["theta_log"], p["gamma_log"], p["B_re"] + 1j * p["B_im"],
                                p["C_re"] + 1j * p["C_im"], p["D"])
    assert rel_err(y.detach().numpy(), want) <= 1e-12 and rel_err(h.detach().numpy(), h_ref) <= 1e-12
    y.sum().backward()
    assert all(v.grad is not None for v in names.values())

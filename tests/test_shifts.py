"""Values from earlier steps (issue #44): ``x.shift(k)`` and ``ssmc.causal_conv(x, w, width=...)``, which
the trace turns into states of its own (frontend/shifts.py, a shift register: ``x_shift1 <- x``,
``x_shift2 <- x_shift1``, ...). A shift register is the pattern a state-copy bug breaks (an update
that is another state's old value, read after it was overwritten), so one spec with several chains
(a width-4 convolution, a width-1 and a width-2 one, a shift by 5, a shift of the state inside its own
update, a shift of the new state and of an expression of it, a shift of a shift) is checked against
a NumPy loop at L = 1, 2, 3, 4, 5, 7, 180, on Numba and the emulated CUDA backend against the
interpreter (outputs, final states, every gradient), and its gradients against central finite
differences. Also: a run in two pieces (final states fed back) against one run, the convolution
against torch's conv1d, and misuse as SpecErrors at the user's line."""

from __future__ import annotations

import numpy as np
import pytest

import ssmc
from ssmc.backends.cuda import emulator

LENGTHS = [1, 2, 3, 4, 5, 7, 180]


@ssmc.recurrence
def shifted(h: ssmc.State["b d"], x: ssmc.Seq["b d"], a: ssmc.Seq["b d"], w: ssmc.Param["d w=4"],
            w1: ssmc.Param["d v=1"], w2: ssmc.Param["u=2 d"]):
    c = ssmc.causal_conv(x, w, width=4)
    f = ssmc.sigmoid(a)
    old = h
    h = f * h + (1 - f) * ssmc.tanh(c + 0.5 * old.shift(2))
    return h, {"c": c, "c1": ssmc.causal_conv(x, w1), "c2": ssmc.causal_conv(a, w2, width=2),
               "s5": x.shift(5), "hn1": h.shift(1), "e3": (h * x).shift(3), "ss": x.shift(1).shift(2) - x.shift(3)}


NAMES = [n for n, _ in shifted.program.outputs]
B, D = 2, 3


def inputs(length: int, seed: int) -> dict[str, np.ndarray]:
    """Layout "t ...": x, a [t b d]; w [d 4], w1 [d 1], w2 [2 d]; the initial h [b d] (the shift
    states start at zero)."""
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((length, B, D)), "a": rng.standard_normal((length, B, D)),
            "w": rng.uniform(-1, 1, (D, 4)), "w1": rng.uniform(-1, 1, (D, 1)), "w2": rng.uniform(-1, 1, (2, D)),
            "h": rng.standard_normal((B, D))}


def lag(seq: np.ndarray, k: int) -> np.ndarray:
    """seq [t ...] k steps later in time: out[t] = seq[t - k], zero for t < k."""
    out = np.zeros_like(seq)
    if k < len(seq):
        out[k:] = seq[:len(seq) - k]
    return out


def conv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Depthwise causal convolution of x [t b d] by w [d width]: sum_j w[:, j] * x[t - (width - 1) + j]."""
    width = w.shape[1]
    return sum(w[:, j] * lag(x, width - 1 - j) for j in range(width))


def reference(x, a, w, w1, w2, h) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The plain loop in NumPy: (outputs [t b d] by name, final h)."""
    length = len(x)
    c = conv(x, w)
    before = []                      # h before step t (the carry), for old.shift(2)
    news = []
    for t in range(length):
        before.append(h)
        f = 1 / (1 + np.exp(-a[t]))
        old2 = before[t - 2] if t >= 2 else np.zeros_like(h)
        h = f * h + (1 - f) * np.tanh(c[t] + 0.5 * old2)
        news.append(h)
    hn = np.stack(news)
    out = {"c": c, "c1": conv(x, w1), "c2": conv(a, w2.T), "s5": lag(x, 5), "hn1": lag(hn, 1),
           "e3": lag(hn * x, 3), "ss": lag(x, 3) - lag(x, 3)}
    return out, h


def _np(v) -> np.ndarray:
    return np.asarray(v.cpu() if hasattr(v, "cpu") else v, dtype=np.float64)


def _run(backend: str, values: dict):
    ys, finals = ssmc.compile(shifted, backend)(**values, return_final_states=True)
    return dict(zip(NAMES, map(_np, ys))), [_np(v) for v in finals]


def test_the_trace_adds_one_chain_per_shifted_value():
    states = [(s.name, s.axes) for s in shifted.program.states]
    names = ["h", "x_shift1", "x_shift2", "x_shift3", "x_shift4", "x_shift5", "h_shift1", "h_shift2", "a_shift1",
             "shifted0_shift1", "shifted1_shift1", "shifted1_shift2", "shifted1_shift3"]
    assert states == [(n, ("b", "d")) for n in names]   # x.shift(1).shift(2) is x_shift3, in x's chain


@pytest.mark.parametrize("length", LENGTHS)
def test_interpreter_matches_numpy(length):
    values = inputs(length, length)
    got, finals = _run("interpreter", values)
    want, h = reference(**values)
    for n, w in want.items():
        assert np.abs(got[n] - w).max() <= 1e-12 * max(np.abs(w).max(), 1.0), n
    assert np.abs(finals[0] - h).max() <= 1e-12
    x = values["x"]
    for k in range(1, 6):   # x_shiftk ends as x k steps before the end (zero before the start)
        assert np.array_equal(finals[k], x[length - k] if length >= k else 0 * x[0]), k


def _backend(name: str):
    if name == "cuda":
        if not emulator.available():
            pytest.skip("no C++ compiler for the CUDA emulator")
        pytest.importorskip("torch")


@pytest.mark.parametrize("backend", ["numba", "cuda"])
def test_backends_match_the_interpreter(backend, emulated_cuda):
    """Outputs, final states and every gradient (of x, a, the weights, the initial h and the shift
    states' initial values), float64, at every length of LENGTHS, against the interpreter."""
    _backend(backend)
    for length in LENGTHS:
        values = inputs(length, 50 + length)
        rng = np.random.default_rng(length)
        values["x_shift2"] = rng.standard_normal((B, D))     # one shift state given, the others zero
        want, want_finals = _run("interpreter", values)
        got, got_finals = _run(backend, values)
        for n in NAMES:
            assert np.abs(got[n] - want[n]).max() <= 1e-10 * max(np.abs(want[n]).max(), 1.0), (length, n)
        for g, w in zip(got_finals, want_finals):
            assert np.abs(g - w).max() <= 1e-10 * max(np.abs(w).max(), 1.0), length
        cot = {n: rng.standard_normal(v.shape) for n, v in want.items()}
        cot_h = {"h": rng.standard_normal((B, D)), "x_shift3": rng.standard_normal((B, D))}
        want_g = ssmc.grad(shifted, "interpreter")(**values, grad_outputs=cot, grad_final_states=cot_h)
        got_g = ssmc.grad(shifted, backend)(**values, grad_outputs=cot, grad_final_states=cot_h)
        assert set(got_g) == set(want_g)
        for key, wg in want_g.items():
            assert np.abs(_np(got_g[key]) - wg).max() <= 1e-9 * max(np.abs(wg).max(), 1.0), (length, key)


@pytest.mark.parametrize("length", [1, 4, 7])
def test_gradients_match_finite_differences(length):
    """d loss / d input along a random direction (loss = cotangents times outputs and final states),
    against the central difference of the interpreter's loss (float64, step 1e-6), the shift
    states' initial values among the inputs."""
    values = inputs(length, 10 + length)
    rng = np.random.default_rng(length)
    for k in (1, 2, 3):
        values[f"x_shift{k}"] = rng.standard_normal((B, D))
    values["h_shift1"] = rng.standard_normal((B, D))
    f = ssmc.compile(shifted, "interpreter")
    got, finals = _run("interpreter", values)
    cot = {n: rng.standard_normal(v.shape) for n, v in got.items()}
    states = [s.name for s in shifted.program.states]
    cot_h = {s: rng.standard_normal(v.shape) for s, v in zip(states, finals)}

    def loss(vals):
        ys, fin = f(**vals, return_final_states=True)
        return (sum(float(np.sum(cot[n] * v)) for n, v in zip(NAMES, ys))
                + sum(float(np.sum(cot_h[s] * v)) for s, v in zip(states, fin)))

    grads = ssmc.grad(shifted, "interpreter")(**values, grad_outputs=cot, grad_final_states=cot_h)
    eps = 1e-6
    for key, value in values.items():
        v = rng.standard_normal(value.shape)
        fd = (loss({**values, key: value + eps * v}) - loss({**values, key: value - eps * v})) / (2 * eps)
        g = float(np.sum(grads[key] * v))
        assert abs(g - fd) <= 1e-6 * max(float(np.sum(np.abs(grads[key] * v))), 1.0), f"{key}: {g} against {fd}"


@pytest.mark.parametrize("cut", [1, 2, 3, 5])
def test_a_sequence_run_in_pieces_continues_exactly(cut):
    """The shift states' final values, fed back as initial states, continue the convolution."""
    values = inputs(9, cut)
    f = ssmc.compile(shifted, "interpreter")
    whole, _ = f(**values, return_final_states=True)
    first = {**values, "x": values["x"][:cut], "a": values["a"][:cut]}
    ys1, finals = f(**first, return_final_states=True)
    second = {**values, "x": values["x"][cut:], "a": values["a"][cut:],
              **{s.name: v for s, v in zip(shifted.program.states, finals)}}
    ys2, _ = f(**second, return_final_states=True)
    for n, w, a, b in zip(NAMES, whole, ys1, ys2):
        assert np.abs(np.concatenate([a, b]) - w).max() <= 1e-13, n


def test_causal_conv_is_torchs_depthwise_conv1d():
    torch = pytest.importorskip("torch")

    @ssmc.recurrence
    def step(h: ssmc.State["b d"], x: ssmc.Seq["b d"], w: ssmc.Param["d w=4"]):
        return h, ssmc.causal_conv(x, w, width=4)

    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((2, 5, 11)), rng.standard_normal((5, 4))      # [b d t], [d w]
    got = ssmc.compile(step, "interpreter", layout="b d t")(x, w)
    want = torch.nn.functional.conv1d(torch.from_numpy(x), torch.from_numpy(w)[:, None, :], groups=5,
                                      padding=3)[..., :11].numpy()
    assert np.abs(got - want).max() <= 1e-13


def _trace(tmp_path, args: str, line: str):
    path = tmp_path / "spec_with_a_bad_shift.py"
    path.write_text(f"import ssmc\n\n\ndef step(h: ssmc.State['b d'], {args}):\n    y = {line}\n    return h, y\n")
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return lambda: ssmc.recurrence(namespace["step"])


@pytest.mark.parametrize("args, line, message", [
    ("x: ssmc.Seq['b d']", "x.shift(-1)", r"shift by -1: a negative shift would read a later step"),
    ("x: ssmc.Seq['b d']", "x.shift(1.5)", r"shift by 1.5: the number of steps must be an integer >= 0"),
    ("x: ssmc.Seq['b d']", "x.shift(True)", r"shift by True: the number of steps must be an integer"),
    ("x: ssmc.Seq['b d']", "(x > 0).shift(1)", r"shift of a boolean value"),
    ("x: ssmc.Seq['b d'], w: ssmc.Param['d w=4']", "ssmc.causal_conv(x, w, width=0)",
     r"causal_conv: width 0 < 1"),
    ("x: ssmc.Seq['b d'], w: ssmc.Param['d w=4']", "ssmc.causal_conv(x, w, width=3)",
     r"causal_conv: width 3 but the taps axis 'w' has size 4"),
    ("x: ssmc.Seq['b d'], w: ssmc.Param['d w']", "ssmc.causal_conv(x, w, width=4)",
     r"causal_conv: the taps axis 'w' needs a static size"),
    ("x: ssmc.Seq['b d'], w: ssmc.Param['d']", "ssmc.causal_conv(x, w, width=4)",
     r"causal_conv: the weight needs exactly one axis the value lacks"),
    ("x: ssmc.Seq['b d'], w: ssmc.Param['d n w=4']", "ssmc.causal_conv(x, w)",
     r"causal_conv: the weight needs exactly one axis the value lacks"),
])
def test_misuse_is_a_spec_error_at_the_users_line(tmp_path, args, line, message):
    with pytest.raises(ssmc.SpecError, match=message) as err:
        _trace(tmp_path, args, line)()
    assert "spec_with_a_bad_shift.py:5:" in str(err.value) and line in str(err.value)


def test_shift_outside_a_recurrence_is_a_spec_error():
    def score_mod(score, q_idx, kv_idx):
        return score + score.shift(1)

    with pytest.raises(ssmc.SpecError, match="shift outside a recurrence's step"):
        ssmc.attention(score_mod=score_mod)


@pytest.mark.parametrize("chunk", [None, 2])
def test_torch_function_gradcheck_of_the_mamba_conv_example(chunk):
    """ssmc.torch.function over the example, the window's initial states among the inputs and the
    final states among the results, one chunk or chunks recomputed from their boundaries."""
    torch = pytest.importorskip("torch")
    import ssmc.torch as ssmc_torch
    from ssmc.examples import mamba_conv as m

    values = m.make_inputs(np.random.default_rng(0), 5, batch=1, dim=2, state=2)
    names = [d.name for d in m.SPEC.program.inputs] + [s.name for s in m.SPEC.program.states]
    assert names[-3:] == ["x_shift1", "x_shift2", "x_shift3"]
    tensors = [torch.tensor(values[n], dtype=torch.float64, requires_grad=True) for n in names]
    f = ssmc_torch.function(m.SPEC, "interpreter", layout=m.LAYOUT, chunk=chunk, return_final_states=True)
    count = len(m.SPEC.program.inputs)

    def flat(*xs):
        ys, finals = f(*xs[:count], **dict(zip(names[count:], xs[count:])))
        return (ys, *finals)

    assert torch.autograd.gradcheck(flat, tensors)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_on_a_gpu_against_the_interpreter(dtype):
    """As test_backends_match_the_interpreter on CUDA tensors, L up to 1000, against the interpreter
    on the inputs rounded to `dtype`."""
    import torch

    tol, grad_tol = (1e-10, 1e-9) if dtype == "float64" else (1e-4, 1e-3)
    for length in [*LENGTHS, 1000]:
        values = inputs(length, 70 + length)
        gpu = {k: torch.tensor(v, device="cuda").to(getattr(torch, dtype)) for k, v in values.items()}
        exact = {k: v.double().cpu().numpy() for k, v in gpu.items()}
        want, want_finals = _run("interpreter", exact)
        got, got_finals = _run("cuda", gpu)
        for g, w in zip([*got.values(), *got_finals], [*want.values(), *want_finals]):
            assert np.abs(g - w).max() <= tol * max(np.abs(w).max(), 1.0), length
        rng = np.random.default_rng(length)
        cot = {n: rng.standard_normal(v.shape) for n, v in want.items()}
        want_g = ssmc.grad(shifted, "interpreter")(**exact, grad_outputs=cot)
        got_g = ssmc.grad(shifted, "cuda")(**gpu, grad_outputs={
            n: torch.tensor(c, device="cuda").to(getattr(torch, dtype)) for n, c in cot.items()})
        for key, wg in want_g.items():
            assert np.abs(_np(got_g[key]) - wg).max() <= grad_tol * max(np.abs(wg).max(), 1.0), (length, key)

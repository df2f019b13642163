"""Every example in examples/ (packaged as ssmc.examples) against its own plain-NumPy reference."""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest
from profiles import in_ci

import ssmc
from ssmc.backends.cuda import emulator

RECURRENCES = ("hgrn", "mamba1", "mamba1_block", "mamba2", "mingru", "linear_attention", "retnet", "lstm", "gru",
               "layernorm_lstm", "mamba_conv", "mamba_block_conv", "lru", "simple_gla", "gla", "slstm")
ATTENTIONS = ("alibi_attention", "relpos_attention", "doc_attention")
ALL = RECURRENCES + ATTENTIONS
FAMILIES = {"diagonal linear", "matrix linear", "nonlinear", "softmax over keys"}
REL_TOL = 1e-10  # float64: the two sides differ only in the order of roundings


def load(name: str):
    return importlib.import_module(f"ssmc.examples.{name}")


def leaves(value) -> list[np.ndarray]:
    """Arrays of a (nested) result, in order; tuples are walked, arrays are leaves."""
    if isinstance(value, tuple):
        return [leaf for v in value for leaf in leaves(v)]
    assert isinstance(value, np.ndarray), f"expected an array, got {type(value).__name__}"
    return [value]


def global_names(code) -> set[str]:
    """Names a function (and the comprehensions / helpers nested in it) looks up."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= global_names(const)
    return names


def structure(value):
    return tuple(structure(v) for v in value) if isinstance(value, tuple) else value.shape


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def check(got, want):
    assert structure(got) == structure(want)
    for i, (a, b) in enumerate(zip(leaves(got), leaves(want))):
        assert np.all(np.isfinite(b)), f"leaf {i}: the reference is not finite"
        err = rel_err(a, b)
        assert err <= REL_TOL, f"leaf {i} of shape {b.shape}: relative error {err:.3e} > {REL_TOL:.0e}"


@pytest.mark.parametrize("name", ALL)
def test_contract(name):
    m = load(name)
    for attr in ("SPEC", "LAYOUT", "FAMILY", "make_inputs", "reference", "main"):
        assert hasattr(m, attr), f"{name} lacks {attr}"
    assert m.FAMILY in FAMILIES
    assert isinstance(m.LAYOUT, str) and "t" in m.LAYOUT.split()
    assert m.__doc__ and m.__doc__.strip()
    assert "ssmc" not in global_names(m.reference.__code__), "the reference must not use ssmc"
    assert (m.FAMILY == "softmax over keys") == (name in ATTENTIONS)


def state_names(spec) -> list[str]:
    """The states as the user declared them (a complex state is one, its IR program has a real pair)."""
    signature = getattr(spec, "complex_signature", None)
    if signature is not None:
        return [name for name, _ in signature.states]
    return [s.name for s in spec.program.states]


@pytest.mark.parametrize("name", RECURRENCES)
def test_initial_states_given(name):
    m = load(name)
    inputs = m.make_inputs(np.random.default_rng(0), 3)
    states = set(state_names(m.SPEC))
    assert states <= inputs.keys(), f"make_inputs leaves out initial states {states - inputs.keys()}"
    assert all(isinstance(v, np.ndarray) and v.dtype in (np.float64, np.complex128) for v in inputs.values())


@pytest.mark.parametrize("length", (1, 7, 180, 1000))
@pytest.mark.parametrize("name", RECURRENCES)
def test_recurrence_matches_reference(name, length):
    m = load(name)
    inputs = m.make_inputs(np.random.default_rng(1234), length)
    got = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, return_final_states=True)
    want = m.reference(**inputs)
    assert isinstance(got, tuple) and len(got) == 2
    check(got, want)


@pytest.mark.parametrize("name", RECURRENCES)
def test_recurrence_zero_initial_states(name):
    """Leaving the initial states out means zeros, on both sides."""
    m = load(name)
    inputs = m.make_inputs(np.random.default_rng(99), 7)
    for s in state_names(m.SPEC):
        del inputs[s]
    got = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, return_final_states=True)
    check(got, m.reference(**inputs))


@pytest.mark.parametrize("length", (1, 7, 180, 300))
@pytest.mark.parametrize("name", ATTENTIONS)
def test_attention_matches_reference(name, length):
    m = load(name)
    inputs = m.make_inputs(np.random.default_rng(1234), length)
    got = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs)
    check(got, m.reference(**inputs))


@pytest.mark.parametrize("name", ALL)
def test_main_runs(name, capsys):
    err = load(name).main()
    assert err < 1e-10
    assert name in capsys.readouterr().out


def test_lstm_gru_references_follow_torch_gate_order():
    """The LSTM / GRU docstrings claim torch.nn's gate order and formulation: check the references."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    for name, cls in (("lstm", torch.nn.LSTM), ("gru", torch.nn.GRU)):
        m = load(name)
        inputs = m.make_inputs(rng, 9)
        x, W, U = inputs["x"], inputs["W"], inputs["U"]
        inp, gates, hidden = W.shape
        net = cls(inp, hidden, batch_first=True).double()
        with torch.no_grad():
            # torch's weight_ih is [gates * hidden, input], row g * hidden + k
            net.weight_ih_l0.copy_(torch.from_numpy(W.reshape(inp, gates * hidden).T.copy()))
            net.weight_hh_l0.copy_(torch.from_numpy(U.reshape(hidden, gates * hidden).T.copy()))
            if name == "lstm":
                net.bias_ih_l0.copy_(torch.from_numpy(inputs["bias"].reshape(-1)))
                net.bias_hh_l0.zero_()
                h0 = (torch.from_numpy(inputs["h"])[None], torch.from_numpy(inputs["c"])[None])
            else:
                net.bias_ih_l0.copy_(torch.from_numpy(inputs["b_i"].reshape(-1)))
                net.bias_hh_l0.copy_(torch.from_numpy(inputs["b_h"].reshape(-1)))
                h0 = torch.from_numpy(inputs["h"])[None]
            y, hn = net(torch.from_numpy(x), h0)
        want_finals = tuple(s[0].numpy() for s in hn) if name == "lstm" else hn[0].numpy()
        check((y.numpy(), want_finals), m.reference(**inputs))


def _numpy(v) -> np.ndarray:
    return np.asarray(v.detach().cpu() if hasattr(v, "detach") else v, dtype=np.float64)


def _gradient_lengths(backend: str) -> tuple[int, ...]:
    """The lengths whose gradients a backend checks. In CI (tests/profiles.py) the emulated CUDA
    backend's at L = 7 only (its kernels are compiled per length: some 25 s of CPU a length) and
    Numba's not at all (its backward's compile is some 50 s of CPU; its forward shares main()'s
    kernels, and the backward's parts run in CI in test_shifts.py (the convolution) and
    test_fusion.py (the norm)); every length locally and nightly."""
    if not in_ci() or backend == "interpreter":
        return (3, 7)
    return (7,) if backend == "cuda" else ()


def _against_finite_differences(reference, values: dict, grads: dict, cot, cot_finals: list, rng):
    """Each gradient along a random direction against the central difference (step 1e-6, float64) of
    loss = sum(cot * out) + sum over the final states of their cotangent times them, out and the
    final states from `reference` (plain NumPy)."""
    def loss(vals):
        out, finals = reference(**vals)
        return float(np.sum(cot * out)) + sum(float(np.sum(c * f)) for c, f in zip(cot_finals, finals))

    eps = 1e-6
    for key, value in values.items():
        v = rng.standard_normal(value.shape)
        fd = (loss({**values, key: value + eps * v}) - loss({**values, key: value - eps * v})) / (2 * eps)
        g = float(np.sum(grads[key] * v))
        assert abs(g - fd) <= 1e-6 * max(float(np.sum(np.abs(grads[key] * v))), 1.0), (key, g, fd)


@pytest.mark.parametrize("backend", ["interpreter", "numba", "cuda"])
def test_the_whole_mamba_block_on_every_backend(backend, emulated_cuda):
    """examples/mamba_block_conv.py (conv1d, silu, selective scan, gate, RMSNorm over d, residual: one
    spec), float64, L = 3 (shorter than the convolution's window) and 7, the window's initial states
    given: outputs and final states against the NumPy reference; the interpreter's gradients (of every
    input, param and initial state, the final states' cotangents included) against central differences
    of the NumPy reference along a random direction; Numba's and the emulated CUDA backend's against the
    interpreter's (at the lengths of `_gradient_lengths`)."""
    if backend == "cuda":
        if not emulator.available():
            pytest.skip("no C++ compiler for the CUDA emulator")
        torch = pytest.importorskip("torch")
    wrap = (lambda a: torch.tensor(a)) if backend == "cuda" else (lambda a: a)
    m = load("mamba_block_conv")
    states = state_names(m.SPEC)
    for length in (3, 7):
        rng = np.random.default_rng(40 + length)
        values = m.make_inputs(rng, length, batch=2, dim=4, state=3)
        args = {k: wrap(v) for k, v in values.items()}
        out, finals = ssmc.compile(m.SPEC, backend, layout=m.LAYOUT)(**args, return_final_states=True)
        want_out, want_finals = m.reference(**values)
        check((_numpy(out), tuple(map(_numpy, finals))), (want_out, want_finals))
        if length not in _gradient_lengths(backend):
            continue
        cot = rng.standard_normal(want_out.shape)
        cot_h = {s: rng.standard_normal(w.shape) for s, w in zip(states, want_finals)}
        grads = ssmc.grad(m.SPEC, "interpreter", layout=m.LAYOUT)(**values, grad_outputs=cot, grad_final_states=cot_h)
        assert set(grads) == set(values)
        if backend == "interpreter":
            _against_finite_differences(m.reference, values, grads, cot, [cot_h[s] for s in states], rng)
            continue
        got = ssmc.grad(m.SPEC, backend, layout=m.LAYOUT)(**args, grad_outputs=wrap(cot),
                                                          grad_final_states={s: wrap(c) for s, c in cot_h.items()})
        assert set(got) == set(grads)
        for key, want in grads.items():
            assert rel_err(_numpy(got[key]), want) <= 1e-9, (length, key)

"""Every example in examples/ (packaged as ssmc.examples) against its own plain-NumPy reference."""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest

import ssmc

RECURRENCES = ("hgrn", "mamba1", "mamba1_block", "mamba2", "mingru", "linear_attention", "retnet", "lstm", "gru",
               "layernorm_lstm", "mamba_conv", "lru", "simple_gla")
ATTENTIONS = ("alibi_attention",)
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

"""`torch.compile` of models that call `ssmc.torch.function` (CPU tensors, the aot_eager backend): one
graph, no break, outputs and every gradient equal to eager (ssmc/torch_library.py)."""

from __future__ import annotations

import numpy as np
import pytest

from ssmc.examples import alibi_attention, hgrn, lstm, mamba1

torch = pytest.importorskip("torch")
st = pytest.importorskip("ssmc.torch")
tl = pytest.importorskip("ssmc.torch_library")

pytestmark = pytest.mark.skipif(not tl.supported(), reason="this torch has no torch.library custom ops")


def _compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _check(model, compiled, args, params, rtol, atol):
    """compiled(*args) == model(*args), and the gradients of every arg and param."""
    eager_args, compiled_args = _leaves(*args), _leaves(*args)
    want = model(*eager_args)
    want_grads = torch.autograd.grad(want, eager_args + params)
    got = compiled(*compiled_args)
    got_grads = torch.autograd.grad(got, compiled_args + params)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


class _Hgrn:
    """A Linear making hgrn's x and gate, the recurrence from a given initial state, a loss of the
    outputs and the final state."""

    def __init__(self):
        torch.manual_seed(0)
        self.linear = torch.nn.Linear(5, 10, dtype=torch.float64)
        self.f = st.function(hgrn.SPEC, layout=hgrn.LAYOUT, return_final_states=True)

    def __call__(self, u, h):
        x, gate = self.linear(u).chunk(2, dim=-1)
        y, h_last = self.f(x, gate, h=h)
        return (y ** 2).mean() + (h_last * torch.arange(5, dtype=h_last.dtype)).sum()


@pytest.fixture(scope="module")
def hgrn_model():
    model = _Hgrn()
    return model, _compiled(model)


def _hgrn_args(length, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, length, 5, generator=g, dtype=torch.float64),
            torch.randn(2, 5, generator=g, dtype=torch.float64))


def test_hgrn_model_compiles_to_the_eager_outputs_and_gradients(hgrn_model):
    model, compiled = hgrn_model
    _check(model, compiled, _hgrn_args(7), list(model.linear.parameters()), rtol=1e-10, atol=1e-12)


def test_another_length_works_without_a_break(hgrn_model):
    """Dynamic shapes: a second length recompiles (with a symbolic length) and still matches."""
    model, compiled = hgrn_model
    for length in (11, 1):
        _check(model, compiled, _hgrn_args(length, seed=length), list(model.linear.parameters()),
               rtol=1e-10, atol=1e-12)


def test_one_graph_with_the_custom_op_and_no_break(hgrn_model):
    model, _ = hgrn_model
    explanation = torch._dynamo.explain(model)(*_leaves(*_hgrn_args(7)))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    targets = [str(n.target) for n in explanation.graphs[0].graph.nodes if n.op == "call_function"]
    assert any(t.startswith("ssmc.hgrn_") for t in targets), targets


def test_eager_calls_keep_their_autograd_functions():
    """Outside torch.compile the op is not taken: the eager path's host time is unchanged."""
    f = st.function(hgrn.SPEC, layout=hgrn.LAYOUT)
    x, gate = _leaves(*(torch.randn(2, 7, 5, dtype=torch.float64) for _ in range(2)))
    names = {type(f(x, gate).grad_fn).__name__ for _ in range(2)}  # the first call, then one like it
    assert names <= {"_RecurrenceBackward", "_LeanRecurrenceBackward"}


def test_a_bad_input_names_the_argument_under_compile():
    """A list (no tensor) of the wrong rank: eager, the binding's ValueError; compiled, torch's error
    with that message (the fake implementation binds the call)."""
    f = st.function(hgrn.SPEC, layout=hgrn.LAYOUT)
    gate = torch.randn(2, 7, 5)
    message = r"argument 'x' has 2 dimensions, expected 3 for axes \[b t d\]"
    with pytest.raises(ValueError, match=message):
        f([[1.0, 2.0]], gate)
    with pytest.raises(Exception, match=message):
        _compiled(lambda g: f([[1.0, 2.0]], g))(gate)


def test_mamba1_with_params_float32():
    """Params as nn.Parameters (A, D, delta_bias), layout b d t, float32."""
    torch.manual_seed(1)
    rng = np.random.default_rng(1)
    values = mamba1.make_inputs(rng, 9)
    params = {n: torch.nn.Parameter(torch.tensor(values[n], dtype=torch.float32)) for n in ("A", "D", "delta_bias")}
    linear = torch.nn.Linear(4, 4)
    f = st.function(mamba1.SPEC, layout=mamba1.LAYOUT)

    def model(u, delta, B, C, z):
        u = linear(u.transpose(1, 2)).transpose(1, 2)
        y = f(u, delta, params["A"], B, C, params["D"], z, params["delta_bias"])
        return (y * torch.tanh(y)).sum()

    args = tuple(torch.tensor(values[n], dtype=torch.float32) for n in ("u", "delta", "B", "C", "z"))
    _check(model, _compiled(model), args, [*params.values(), *linear.parameters()], rtol=1e-5, atol=1e-6)


def test_lstm_final_states_the_loss_does_not_use():
    """Two states given, both final states returned but unused: their cotangents come as zeros."""
    rng = np.random.default_rng(2)
    values = lstm.make_inputs(rng, 6)
    params = [torch.nn.Parameter(torch.tensor(values[n])) for n in ("W", "U", "bias")]
    f = st.function(lstm.SPEC, layout=lstm.LAYOUT, return_final_states=True)

    def model(x, h, c):
        y, _finals = f(x, *params, h=h, c=c)
        return y.pow(2).sum()

    args = tuple(torch.tensor(values[n]) for n in ("x", "h", "c"))
    _check(model, _compiled(model), args, params, rtol=1e-10, atol=1e-12)


def test_attention_model_compiles_with_its_lse_saved():
    """An attention spec (ALiBi, causal): one graph with its op, no break; outputs and the gradients of
    q, k, v, the slopes and a Linear equal to eager, at two lengths."""
    torch.manual_seed(3)
    linear = torch.nn.Linear(8, 8, dtype=torch.float64)
    f = st.function(alibi_attention.SPEC, layout=alibi_attention.LAYOUT)

    def model(q, k, v, slope):
        return (f(linear(q), k, v, slope) ** 2).sum()

    compiled = _compiled(model)
    for length in (9, 13):
        values = alibi_attention.make_inputs(np.random.default_rng(length), length)
        args = tuple(torch.tensor(values[n]) for n in ("q", "k", "v", "slope"))
        _check(model, compiled, args, list(linear.parameters()), rtol=1e-10, atol=1e-12)
    explanation = torch._dynamo.explain(model)(*args)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    targets = [str(n.target) for n in explanation.graphs[0].graph.nodes if n.op == "call_function"]
    assert any(t.startswith("ssmc.alibi") for t in targets), targets


def test_a_recurrence_layer_compiles():
    """`ssmc.torch.Recurrence` (an nn.Module owning the LSTM's params) under compile: eager's loss and the
    gradients of the input and of every nn.Parameter."""
    torch.manual_seed(3)
    layer = st.Recurrence(lstm.SPEC, layout=lstm.LAYOUT, sizes={"i": 5, "k": 6, "j": 6}, dtype=torch.float64)

    def model(x):
        return layer(x).square().sum()

    x = torch.randn(2, 9, 5, dtype=torch.float64)
    _check(model, _compiled(model), (x,), list(layer.parameters()), rtol=1e-10, atol=1e-12)

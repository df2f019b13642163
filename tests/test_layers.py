"""`ssmc.torch.Recurrence` (a spec as an nn.Module owning its params) and the single-step form
(`ssmc.step`, `Recurrence.step`): L steps equal one full-sequence call (#43)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

import ssmc
from ssmc.api import time_positions
from ssmc.examples import hgrn, lstm, mamba1, mamba2

torch = pytest.importorskip("torch")
st = pytest.importorskip("ssmc.torch")

RECURRENCES = ("hgrn", "mamba1", "mamba1_block", "mamba2", "mingru", "linear_attention", "retnet", "lstm", "gru",
               "layernorm_lstm", "mamba_conv", "lstm_heads", "mamba_block_conv", "simple_gla", "gla")
LENGTH = 5
LSTM_SIZES = {"i": 3, "j": 4, "k": 4}


def _example(name):
    return importlib.import_module(f"ssmc.examples.{name}")


def _close(got, want, tol=1e-9):
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    assert float(np.abs(got - want).max(initial=0.0)) <= tol * scale


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


# -- ssmc.step: L single steps equal one full call -------------------------------------------------------


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
@pytest.mark.parametrize("name", RECURRENCES)
def test_stepping_equals_the_full_sequence_call(name, backend):
    module = _example(name)
    p = module.SPEC.program
    values = module.make_inputs(np.random.default_rng(1), LENGTH)
    state_names = [s.name for s in p.states]
    inputs = {d.name: values[d.name] for d in p.inputs}
    ys, finals = ssmc.compile(module.SPEC, backend, layout=module.LAYOUT)(
        **inputs, **{s: values[s] for s in state_names}, return_final_states=True)
    seq_time, out_time = time_positions(p, module.LAYOUT)
    step = ssmc.step(module.SPEC, backend, layout=module.LAYOUT)
    order = range(LENGTH - 1, -1, -1) if p.reverse else range(LENGTH)
    states = tuple(values[s] for s in state_names)
    got = {}
    for t in order:
        one = {n: (np.take(x, t, axis=seq_time[n]) if n in seq_time else x) for n, x in inputs.items()}
        y_t, states = step(**one, states=states)
        got[t] = _as_tuple(y_t)
        states = _as_tuple(states)
    for k, pos in enumerate(out_time.values()):
        _close(np.stack([got[t][k] for t in range(LENGTH)], axis=pos), _as_tuple(ys)[k])
    for a, b in zip(states, _as_tuple(finals)):
        _close(a, b)


def test_step_starts_from_zero_states_and_takes_them_by_name():
    values = hgrn.make_inputs(np.random.default_rng(2), 1)
    step = ssmc.step(hgrn.SPEC, "interpreter", layout=hgrn.LAYOUT)
    x, f = values["x"][:, 0], values["f"][:, 0]
    y0, h0 = step(x, f)
    want, _ = hgrn.reference(values["x"], values["f"])
    _close(y0, want[:, 0])
    y1, _ = step(x, f, h=h0)
    y2, _ = step(x, f, states=h0)
    _close(y1, y2)
    with pytest.raises(ValueError, match="states"):
        step(x, f, states=(h0, h0))
    with pytest.raises(ValueError, match="missing"):
        step(x)


# -- Recurrence: params, state_dict, dtype, gradients ---------------------------------------------------


def test_params_are_registered_with_their_shapes_and_the_default_init():
    layer = st.Recurrence(lstm.SPEC, sizes=LSTM_SIZES)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    assert shapes == {"W": (3, 4, 4), "U": (4, 4, 4), "bias": (4, 4)}  # g=4 from the spec
    assert all(isinstance(p, torch.nn.Parameter) for p in layer.parameters())
    assert float(layer.W.detach().abs().max()) <= 1 / np.sqrt(3)  # W's i is contracted: uniform +-1/sqrt(3)
    assert float(layer.U.detach().abs().max()) <= 1 / np.sqrt(4)
    assert layer.W.dtype == torch.get_default_dtype()
    assert set(layer.state_dict()) == {"W", "U", "bias"}


def test_init_by_callable_and_by_tensor():
    A = -torch.ones(4, 3)
    layer = st.Recurrence(mamba1.SPEC, layout=mamba1.LAYOUT, sizes={"d": 4, "n": 3},
                          init={"A": A, "D": torch.nn.init.ones_, "delta_bias": lambda t: torch.full_like(t, -1.0)})
    assert torch.equal(layer.A, A) and torch.equal(layer.D, torch.ones(4))
    assert torch.equal(layer.delta_bias, -torch.ones(4))


def test_init_and_size_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"init: .*\['V'\]"):
        st.Recurrence(lstm.SPEC, sizes=LSTM_SIZES, init={"V": torch.nn.init.zeros_})
    with pytest.raises(ValueError, match=r"sizes: param 'W'.*\['i'\]"):
        st.Recurrence(lstm.SPEC, sizes={"j": 4, "k": 4})
    with pytest.raises(ValueError, match="sizes: axis 'g' is 4"):
        st.Recurrence(lstm.SPEC, sizes={**LSTM_SIZES, "g": 3})
    with pytest.raises(ValueError, match="init: param 'bias' has the shape"):
        st.Recurrence(lstm.SPEC, sizes=LSTM_SIZES, init={"bias": torch.zeros(3)})
    with pytest.raises(ValueError, match="options"):
        st.Recurrence(lstm.SPEC, sizes=LSTM_SIZES, chunks=3)


def test_state_dict_round_trip_and_to_float64():
    a = st.Recurrence(lstm.SPEC, sizes=LSTM_SIZES, backend="numba")
    b = st.Recurrence(lstm.SPEC, sizes=LSTM_SIZES, backend="numba")
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, LENGTH, 3)
    assert torch.equal(a(x), b(x))
    a.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in a.parameters())
    y64 = a(x.double())
    assert y64.dtype == torch.float64
    assert torch.allclose(y64.float(), b(x), atol=1e-5)


def test_gradients_reach_the_parameters_as_with_the_function():
    layer = st.Recurrence(lstm.SPEC, sizes=LSTM_SIZES, dtype=torch.float64, backend="numba")
    x = torch.randn(2, LENGTH, 3, dtype=torch.float64)
    h0 = torch.randn(2, 4, dtype=torch.float64)
    y, (_, c) = layer(x, initial_states={"h": h0}, return_final_states=True)
    (y.square().sum() + c.sum()).backward()
    params = {n: p.detach().clone().requires_grad_() for n, p in layer.named_parameters()}
    f = st.function(lstm.SPEC, "numba", layout=lstm.LAYOUT, return_final_states=True)
    y2, (_, c2) = f(x, params["W"], params["U"], params["bias"], h=h0)
    (y2.square().sum() + c2.sum()).backward()
    for n, p in layer.named_parameters():
        assert p.grad is not None
        assert torch.allclose(p.grad, params[n].grad, rtol=1e-12, atol=1e-12), n


@pytest.mark.parametrize("backend", ["interpreter", "numba"])
def test_params_freed_between_forward_and_backward_as_fsdp_does(backend):
    """FSDP frees a unit's gathered params after its forward (their storage resized to zero) and gathers
    them again, into new memory, before its backward (tests/test_ddp.py runs it). Done by hand here: the
    resize is allowed (Tensor.numpy() of a param would forbid it), and the gradients, forward without grad
    too, equal those of params left alone."""
    layer = st.Recurrence(lstm.SPEC, sizes=LSTM_SIZES, dtype=torch.float64, backend=backend)
    x = torch.randn(2, LENGTH, 3, dtype=torch.float64)
    y = layer(x)
    y.square().sum().backward()
    want = {n: p.grad.clone() for n, p in layer.named_parameters()}
    layer.zero_grad()
    saved = {n: p.detach().clone() for n, p in layer.named_parameters()}

    def free_and_gather():
        for n, p in layer.named_parameters():
            p.untyped_storage().resize_(0)  # "Trying to resize storage that is not resizable" where viewed
            p.untyped_storage().resize_(saved[n].numel() * saved[n].element_size())
            p.data.copy_(saved[n])  # `.data`: the version counter stays, as FSDP's gathers keep it

    with torch.no_grad():
        assert torch.equal(layer(x), y.detach())
    free_and_gather()
    y = layer(x)
    free_and_gather()
    y.square().sum().backward()
    for n, p in layer.named_parameters():
        assert torch.allclose(p.grad, want[n], rtol=1e-12, atol=1e-14), n


def test_initial_states_must_be_a_prefix():
    layer = st.Recurrence(lstm.SPEC, sizes=LSTM_SIZES)
    with pytest.raises(ValueError, match="initial_states: give the states in order"):
        layer(torch.randn(2, LENGTH, 3), initial_states={"c": torch.zeros(2, 4)})
    with pytest.raises(ValueError, match="missing"):
        layer()


@pytest.mark.parametrize("module, sizes", [(lstm, LSTM_SIZES), (mamba2, {"g": 2, "r": 2})],
                         ids=["lstm", "mamba2"])
def test_module_steps_equal_its_forward_and_are_differentiable(module, sizes):
    layer = st.Recurrence(module.SPEC, layout=module.LAYOUT, sizes=sizes, dtype=torch.float64, backend="numba")
    values = module.make_inputs(np.random.default_rng(3), LENGTH)
    p = module.SPEC.program
    seqs = [torch.tensor(values[d.name]) for d in p.seqs]
    ys, finals = layer(*seqs, return_final_states=True)
    states, got = None, []
    for t in range(LENGTH):
        y_t, states = layer.step(*(s[:, t] for s in seqs), states=states)
        got.append(y_t)
    assert torch.allclose(torch.stack(got, 1), ys, rtol=1e-10, atol=1e-10)
    for a, b in zip(_as_tuple(states), _as_tuple(finals)):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-10)
    sum(y.sum() for y in got).backward()
    assert all(q.grad is not None for q in layer.parameters())


def test_module_step_writes_out_and_the_states_in_place():
    """`Recurrence.step` with ``out=`` and ``in_place=True`` (decoding, no grad): L steps into one output
    tensor and one buffer a state equal the allocating steps and `forward`; the same storage throughout."""
    layer = st.Recurrence(lstm.SPEC, layout=lstm.LAYOUT, sizes=LSTM_SIZES, dtype=torch.float64, backend="numba")
    values = lstm.make_inputs(np.random.default_rng(5), LENGTH)
    x = torch.tensor(values["x"])
    with torch.no_grad():
        ys, finals = layer(x, return_final_states=True)
        h, c = torch.zeros_like(finals[0]), torch.zeros_like(finals[1])
        out = torch.empty_like(ys[:, 0])
        ptrs = (h.data_ptr(), c.data_ptr(), out.data_ptr())
        for t in range(LENGTH):
            y_t, (h2, c2) = layer.step(x[:, t], states=(h, c), out=out, in_place=True)
            assert y_t is out and h2 is h and c2 is c
            _close(out.numpy(), ys[:, t].numpy(), 1e-12)
        assert (h.data_ptr(), c.data_ptr(), out.data_ptr()) == ptrs
        _close(h.numpy(), finals[0].numpy(), 1e-12)
        _close(c.numpy(), finals[1].numpy(), 1e-12)
        with pytest.raises(ValueError, match="in_place"):
            layer.step(x[:, 0], states=(h,), in_place=True)
        with pytest.raises(ValueError, match="out"):
            layer.step(x[:, 0], states=(h, c), out=torch.empty(2))

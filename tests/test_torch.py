"""`ssmc.torch` on the CPU (Numba) and `Grad.forward` / `Grad.backward`: the forward keeps a tape,
the backward recomputes only what the tape lacks."""

from __future__ import annotations

import numpy as np
import pytest

import ssmc
from ssmc.autograd import Grad, default_chunk
from ssmc.examples import hgrn, lstm, mamba1

torch = pytest.importorskip("torch")
st = pytest.importorskip("ssmc.torch")


def _inputs(module, length, seed=0):
    return module.make_inputs(np.random.default_rng(seed), length)


@pytest.mark.parametrize("chunk", [None, 3])  # one chunk (every carry kept) and chunks recomputed
@pytest.mark.parametrize("module", [hgrn, lstm], ids=lambda m: m.__name__.rsplit(".", 1)[-1])
def test_gradcheck_in_float64(module, chunk):
    values = _inputs(module, 7)
    names = [d.name for d in module.SPEC.program.inputs] + [s.name for s in module.SPEC.program.states]
    tensors = [torch.tensor(values[n], dtype=torch.float64, requires_grad=True) for n in names]
    f = st.function(module.SPEC, "numba", layout=module.LAYOUT, chunk=chunk, return_final_states=True)

    def flat(*xs):
        ys, finals = f(*xs[:len(module.SPEC.program.inputs)], **dict(zip(names[len(module.SPEC.program.inputs):],
                                                                          xs[len(module.SPEC.program.inputs):])))
        return (*(ys if isinstance(ys, tuple) else (ys,)), *(finals if isinstance(finals, tuple) else (finals,)))

    assert torch.autograd.gradcheck(flat, tensors)


def test_inference_runs_the_plain_forward_and_matches():
    values = _inputs(mamba1, 180)
    names = [d.name for d in mamba1.SPEC.program.inputs]
    f = st.function(mamba1.SPEC, "numba", layout=mamba1.LAYOUT)
    with torch.no_grad():
        y = f(*(torch.tensor(values[n]) for n in names))
    want, _ = mamba1.reference(**{n: values[n] for n in names})
    assert not y.requires_grad
    assert float((y.numpy() - want).__abs__().max() / abs(want).max()) <= 1e-10
    y = f(*(torch.tensor(values[n], requires_grad=True) for n in names))
    assert y.requires_grad and float((y.detach().numpy() - want).__abs__().max() / abs(want).max()) <= 1e-10


def _hgrn_tensors(dtypes=None, requires_grad=True):
    values = _inputs(hgrn, 7)
    names = [d.name for d in hgrn.SPEC.program.inputs]
    dtypes = dtypes or {}
    return [torch.tensor(values[n], dtype=dtypes.get(n, torch.float64), requires_grad=requires_grad) for n in names]


def test_an_input_changed_in_place_before_the_backward_is_an_error():
    """The tape holds views of the inputs: changed in place after the forward, the gradient would
    be silently wrong; torch's version check says so instead."""
    f = st.function(hgrn.SPEC, "numba", layout=hgrn.LAYOUT)
    x, gate = _hgrn_tensors()
    moved = gate.detach().clone().requires_grad_()
    y = f(x, moved * 1.0)  # an intermediate (not a leaf) the caller may change in place
    y2 = f(x, gate)
    with torch.no_grad():
        gate.mul_(0.5)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y2.sum().backward()
    y.sum().backward()  # untouched: fine
    assert moved.grad is not None


def test_a_second_derivative_is_an_error_not_zeros():
    f = st.function(hgrn.SPEC, "numba", layout=hgrn.LAYOUT)
    x, gate = _hgrn_tensors()
    (gx,) = torch.autograd.grad(f(x, gate).pow(2).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        gx.sum().backward()


def test_outputs_have_the_first_inputs_dtype_with_or_without_a_tape():
    """Mixed dtypes (x float32, the rest float64): the same output dtype for inference and training."""
    f = st.function(hgrn.SPEC, "numba", layout=hgrn.LAYOUT)
    with torch.no_grad():
        inference = f(*_hgrn_tensors({"x": torch.float32}, requires_grad=False))
    training = f(*_hgrn_tensors({"x": torch.float32}))
    assert inference.dtype == training.dtype == torch.float32
    assert torch.allclose(inference, training.detach())


@pytest.mark.parametrize("length", [1, 7, 180, 1000])
def test_tape_gives_the_gradients_of_a_fresh_run(length):
    """forward + backward from the tape == the one-call gradient with chunks recomputed, at awkward L."""
    values = _inputs(mamba1, length, seed=length)
    names = [d.name for d in mamba1.SPEC.program.inputs]
    kwargs = {n: values[n] for n in names} | {"h": values["h"]}
    dy = np.random.default_rng(1).standard_normal(values["u"].shape)
    g = Grad(mamba1.SPEC.program, "numba", mamba1.LAYOUT)
    outs, finals, tape = g.forward(**kwargs)
    assert tape.chunk >= length and tape.carries is not None   # small: one chunk, nothing recomputed
    y_ref, h_ref = mamba1.reference(**kwargs)
    assert np.abs(outs["y"].transpose(1, 2, 0) - y_ref).max() <= 1e-10 * np.abs(y_ref).max()
    assert np.abs(finals["h"] - h_ref).max() <= 1e-10 * np.abs(h_ref).max()
    got = g.backward(tape, grad_outputs=dy)
    want = ssmc.grad(mamba1.SPEC, "numba", layout=mamba1.LAYOUT, chunk=64)(**kwargs, grad_outputs=dy)
    for k in want:
        assert np.abs(got[k] - want[k]).max() <= 1e-10 * max(np.abs(want[k]).max(), 1e-300), k


def test_cpu_chunk_keeps_the_carries_within_a_budget():
    p = mamba1.SPEC.program
    small = {"b": 2, "d": 256, "n": 16}
    assert default_chunk("numba", 1024, p, small, 4) == 1024              # 32 MB of carries: one chunk
    assert default_chunk("numba", 4096, p, {"b": 4, "d": 256, "n": 16}, 4) == 1024   # 64 KB a step: 64 MB
    assert default_chunk("numba", 4096, p, {"b": 64, "d": 2048, "n": 16}, 4) == 64   # never below 64 steps

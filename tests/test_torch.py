"""`ssmc.torch` on the CPU (Numba) and `Grad.forward` / `Grad.backward`: the forward keeps a tape,
the backward recomputes only what the tape lacks."""

from __future__ import annotations

import numpy as np
import pytest

import ssmc
from ssmc.examples import hgrn, lstm, mamba1
from ssmc.grad import Grad, default_chunk

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

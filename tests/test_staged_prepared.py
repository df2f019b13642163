"""Prepared calls of a layer run in stages around a chunked core (Mamba-2 / SSD: pre, chunked core, post;
`backends/cuda/staged.py`, `autograd/stages.PreparedStages`), emulated (``SSMC_CUDA_EMULATE=1``), float64,
tiny sizes: the calls after the first of a signature take the prepared paths of `ssmc.compile`, `ssmc.grad`
and the torch op, and give what the interpreter gives, forward and gradients, call after call and after a
change of shape (a new signature: the general path first, then its own prepared path)."""

from __future__ import annotations

import numpy as np
import pytest
from profiles import in_ci
from test_cuda import rel_err

import ssmc
from ssmc.backends.cuda import emulator
from ssmc.examples import mamba2

pytestmark = pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")


def _want(inputs: dict, cot):
    ys, finals = ssmc.compile(mamba2.SPEC, "interpreter", layout=mamba2.LAYOUT)(**inputs, return_final_states=True)
    grads = ssmc.grad(mamba2.SPEC, "interpreter", layout=mamba2.LAYOUT)(**inputs, grad_outputs=cot)
    return ys, finals, grads


def test_staged_prepared_calls_match_the_interpreter(monkeypatch):
    torch = pytest.importorskip("torch")
    import ssmc.torch as ssmc_torch

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    f = ssmc.compile(mamba2.SPEC, "cuda", layout=mamba2.LAYOUT)
    g = ssmc.grad(mamba2.SPEC, "cuda", layout=mamba2.LAYOUT)
    op = ssmc_torch.function(mamba2.SPEC, "cuda", layout=mamba2.LAYOUT, return_final_states=True)
    names = [d.name for d in mamba2.SPEC.program.inputs]
    # each length a new signature (a cache miss: the general path, then prepared again), and within one the
    # call without an initial state another (no kernel compiled anew for it); CI keeps one length (each
    # compiles a dozen emulated kernels)
    for length in (70,) if in_ci() else (7, 70):
        rng = np.random.default_rng(length)
        inputs = mamba2.make_inputs(rng, length)
        no_h = {k: v for k, v in inputs.items() if k != "h"}  # without an initial state too
        cot = rng.standard_normal(inputs["x"].shape)
        for case in (inputs, no_h):
            want_y, want_h, want = _want(case, cot)
            tensors = {k: torch.tensor(v) for k, v in case.items()}
            for call in range(3):
                y, h = f(**tensors, return_final_states=True)
                assert rel_err(y, want_y) <= 1e-10 and rel_err(h, want_h) <= 1e-10, (length, call)
                got = g(**tensors, grad_outputs=torch.tensor(cot))
                for key in want:
                    assert rel_err(got[key], want[key]) <= 1e-9, (length, call, key)
                leaves = {k: t.clone().requires_grad_(True) for k, t in tensors.items()}
                states = {k: v for k, v in leaves.items() if k not in names}
                y, h = op(*(leaves[k] for k in names), **states)
                assert rel_err(y, want_y) <= 1e-10 and rel_err(h, want_h) <= 1e-10, (length, call, "op")
                grads = torch.autograd.grad(y, list(leaves.values()), torch.tensor(cot))
                for key, gr in zip(leaves, grads):
                    assert rel_err(gr, want[key]) <= 1e-9, (length, call, "op", key)
    # cotangents of the final state too: the general backward from a prepared forward's tape
    cot_h = np.random.default_rng(1).standard_normal(want_h.shape)
    want = ssmc.grad(mamba2.SPEC, "interpreter", layout=mamba2.LAYOUT)(**case, grad_outputs=cot,
                                                                       grad_final_states=cot_h)
    got = g(**tensors, grad_outputs=torch.tensor(cot), grad_final_states=torch.tensor(cot_h))
    leaves = {k: t.clone().requires_grad_(True) for k, t in tensors.items()}
    y, h = op(*(leaves[k] for k in names))
    grads = torch.autograd.grad((y, h), list(leaves.values()), (torch.tensor(cot), torch.tensor(cot_h)))
    for key, gr in zip(leaves, grads):
        assert rel_err(got[key], want[key]) <= 1e-9 and rel_err(gr, want[key]) <= 1e-9, key
    # every signature served by the prepared paths after its first call
    assert f._calls and all(f._calls.values())
    assert g._steps and all(g._steps.values())
    assert op.grad._steps and all(op.grad._steps.values())
    # a call unlike the prepared ones is bound and checked again: the same error as a first call
    bad = {k: torch.tensor(v) for k, v in inputs.items()}
    bad["B"] = bad["B"][..., :-1]
    with pytest.raises(ValueError, match="n"):
        f(**bad)
    with pytest.raises(ValueError, match="n"):
        g(**bad, grad_outputs=torch.tensor(cot))
    with pytest.raises(ValueError, match="shape"):  # cotangents of another shape: checked as on the general path
        g(**{k: torch.tensor(v) for k, v in inputs.items()}, grad_outputs=torch.tensor(cot[:, :-1]))


def test_a_chunked_core_alone_is_prepared_and_matches_the_interpreter(monkeypatch):
    """RetNet is a matrix-linear core with no stage around it: `ChunkedCore.prepare_run` runs the calls after
    the first of a signature (no binding), with and without an initial state, and after a change of length."""
    torch = pytest.importorskip("torch")
    from ssmc.examples import retnet

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    f = ssmc.compile(retnet.SPEC, "cuda", layout=retnet.LAYOUT, dtype="float64")
    want_f = ssmc.compile(retnet.SPEC, "interpreter", layout=retnet.LAYOUT)
    for length in (9, 70):
        inputs = retnet.make_inputs(np.random.default_rng(length), length)
        for case in (inputs, {k: v for k, v in inputs.items() if k != "S"}):
            want_y, want_s = want_f(**case, return_final_states=True)
            tensors = {k: torch.tensor(v) for k, v in case.items()}
            for call in range(3):
                y, s = f(**tensors, return_final_states=True)
                assert rel_err(y, want_y) <= 1e-10 and rel_err(s, want_s) <= 1e-10, (length, call)
    assert len([v for v in f._calls.values() if v]) == 4   # two lengths, with and without S: each prepared


def test_16_bit_cotangents_reach_the_chunked_core_as_given(monkeypatch):
    """A bf16 training step through the torch op: at its second call (prepared) the output's cotangent
    reaches the chunked core in bf16 as given (`ChunkedCore.takes_half_cotangents`: no cast to fp32 that
    the core would round back), where the first call's (the general path) cast it to fp32; the gradients
    bit for bit the first call's (at these sizes the core runs its torch path, in fp32 either way)."""
    torch = pytest.importorskip("torch")
    import ssmc.torch as ssmc_torch
    from ssmc.backends.cuda.kernels.chunk import ChunkedCore

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    seen = []
    monkeypatch.setattr(ChunkedCore, "backward", lambda self, seqs, params, tape, cot, *a, _f=ChunkedCore.backward:
                        seen.append({v.dtype for v in cot.values()}) or _f(self, seqs, params, tape, cot, *a))
    names = [d.name for d in mamba2.SPEC.program.inputs]
    rng = np.random.default_rng(3)
    inputs = {k: v for k, v in mamba2.make_inputs(rng, 7).items() if k != "h"}
    bf = {k: torch.tensor(v).to(torch.bfloat16 if v.ndim > 2 else torch.float32) for k, v in inputs.items()}
    cot = torch.tensor(rng.standard_normal(inputs["x"].shape)).to(torch.bfloat16)
    op = ssmc_torch.function(mamba2.SPEC, "cuda", layout=mamba2.LAYOUT)
    grads = []
    for _ in range(2):  # the first call general, the second prepared
        leaves = {k: v.clone().requires_grad_(True) for k, v in bf.items()}
        grads.append(torch.autograd.grad(op(*(leaves[k] for k in names)), list(leaves.values()), cot))
    assert op.grad._steps and all(op.grad._steps.values())
    assert seen == [{torch.float32}, {torch.bfloat16}], seen
    for key, general, prepared in zip(bf, *grads):
        assert prepared.dtype == bf[key].dtype and torch.equal(prepared, general), key

"""The torch op's plans (ssmc/torch.py `SsmcFunction._plan`): a call signature is planned once, at its
first call; later calls of it run the plan without planning again, and give what the first call gave."""

from __future__ import annotations

import numpy as np
import pytest

import ssmc

torch = pytest.importorskip("torch")
import ssmc.torch as ssmc_torch  # noqa: E402


@ssmc.recurrence
def scan(h: ssmc.State["b d"], a: ssmc.Seq["b d"], x: ssmc.Seq["b d"]):
    h = a * h + x
    return h, h


@pytest.fixture
def planned(monkeypatch) -> list:
    """The signatures `SsmcFunction._plan` is asked for, as the call signatures of their tensors."""
    calls = []
    plan = ssmc_torch.SsmcFunction._plan

    def counted(self, tensors):
        calls.append(ssmc_torch._call_signature(tensors))
        return plan(self, tensors)
    monkeypatch.setattr(ssmc_torch.SsmcFunction, "_plan", counted)
    return calls


def _leaves(seed: int, b=2, d=3, t=5, dtype=torch.float64) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.rand(b, d, t, generator=g, dtype=dtype).requires_grad_(True),
            "x": torch.randn(b, d, t, generator=g, dtype=dtype).requires_grad_(True)}


def test_a_signature_is_planned_once_and_its_plan_repeats_the_first_call(planned):
    f = ssmc_torch.function(scan, "interpreter", layout="b d t", return_final_states=True)
    leaves = _leaves(0)
    results = []
    for _ in range(3):
        y, h = f(leaves["a"], x=leaves["x"])
        y.backward(torch.ones_like(y))
        results.append((y.detach(), h.detach(), *(t.grad.clone() for t in leaves.values())))
        for t in leaves.values():
            t.grad = None
    assert len(planned) == 1  # the second and third calls ran the first call's plan
    for got in results[1:]:
        for want, g in zip(results[0], got):
            assert torch.equal(g, want)
    want = np.zeros((2, 3))  # the plain loop h = a h + x
    for t in range(5):
        want = leaves["a"].detach().numpy()[..., t] * want + leaves["x"].detach().numpy()[..., t]
    np.testing.assert_allclose(results[0][1].numpy(), want, rtol=1e-12)
    f(a=leaves["a"], x=leaves["x"])  # the same signature, its arguments by name: no new plan
    assert len(planned) == 1
    with torch.no_grad():  # another signature each: grad mode, a shape, a requires_grad, a dtype
        f(leaves["a"], leaves["x"])
        f(leaves["a"], leaves["x"])
    f(*_leaves(1, t=6).values())
    f(leaves["a"].detach(), leaves["x"])
    f(*_leaves(2, dtype=torch.float32).values())
    assert len(planned) == 5
    for args in ((leaves["a"], leaves["x"]), (leaves["a"].detach(), leaves["x"])):
        f(*args)  # planned before: still no new plan
    assert len(planned) == 5
    assert len({key for key in planned}) == 5


def test_arguments_that_are_not_tensors_are_never_planned(planned):
    """A NumPy argument is converted on each call (the general call), not planned."""
    f = ssmc_torch.function(scan, "interpreter", layout="b d t")
    a, x = (v.detach().numpy() for v in _leaves(3).values())
    ys = [f(a, x) for _ in range(2)]
    assert planned == [] and torch.equal(ys[0], ys[1])


def test_the_emulated_cuda_ops_later_calls_take_the_lean_plan(planned, monkeypatch):
    """On the CUDA backend (emulated), a signature the fused backward serves is planned at its first call
    onto its `LeanStep`; the later calls take it (no planning, no general autograd Function), with the
    first call's outputs and gradients. Setting an SSMC_CUDA_* variable plans again."""
    from ssmc.examples import mamba1

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    rng = np.random.default_rng(0)
    inputs = mamba1.make_inputs(rng, 70, batch=2, dim=8)  # the sizes of test_cuda_emulated's prepared calls
    f = ssmc_torch.function(mamba1.SPEC, "cuda", layout=mamba1.LAYOUT)
    names = [d.name for d in mamba1.SPEC.program.inputs]
    leaves = {k: torch.tensor(inputs[k]).requires_grad_(True) for k in names}
    general = []
    apply = ssmc_torch._Recurrence.apply
    monkeypatch.setattr(ssmc_torch._Recurrence, "apply", lambda *a: general.append(1) or apply(*a))
    results = []
    for _ in range(3):
        y = f(**leaves)
        grads = torch.autograd.grad(y, list(leaves.values()), torch.ones_like(y))
        results.append((y.detach(), *grads))
    assert len(planned) == 1 and len(general) == 1  # the first call alone took the general path
    assert [type(v).__name__ for v in f._lean.values()] == ["LeanStep"]
    for got in results[1:]:
        for want, g in zip(results[0], got):
            torch.testing.assert_close(g, want, rtol=1e-12, atol=1e-12)
    monkeypatch.setenv("SSMC_CUDA_LANES_BACKWARD", "1")  # other options: the plan no longer holds
    f(**leaves)
    assert len(planned) == 2

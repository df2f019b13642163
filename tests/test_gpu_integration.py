"""ssmc's torch ops inside a real training setup on the GPU (issue 43): `torch.compile(fullgraph=True)`
with inductor, and a whole training step (forward + backward) captured once as a CUDA graph and replayed
on new values. One case per kernel family: a diagonal scan (hgrn, Mamba-1), a recurrence with recurrent
products (LSTM, the persistent kernel), matrix-linear recurrences in chunks (Mamba-2, RetNet), softmax attention
(ALiBi, the flash kernels). Each is checked against the same model run eagerly."""

from __future__ import annotations

import numpy as np
import pytest
from cuda_graphs import captured

from ssmc.examples import alibi_attention, hgrn, lstm, mamba1, mamba2, retnet

torch = pytest.importorskip("torch")
st = pytest.importorskip("ssmc.torch")

pytestmark = pytest.mark.gpu


def _tensors(values: dict, dtype, half: tuple[str, ...] = (), half_dtype=None) -> dict:
    return {n: torch.tensor(v, dtype=half_dtype if n in half else dtype, device="cuda") for n, v in values.items()}


def _case(name: str):
    """(model(*args) -> scalar loss, args, params, rtol, atol) for the family's example."""
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    if name == "hgrn":
        v = _tensors(hgrn.make_inputs(rng, 300, batch=4, dim=256), torch.float32)
        linear = torch.nn.Linear(256, 256, device="cuda")
        f = st.function(hgrn.SPEC, layout=hgrn.LAYOUT, return_final_states=True)

        def model(x, g, h):
            y, h_last = f(linear(x), g, h=h)
            return (y ** 2).mean() + h_last.sum()
        return model, [v["x"], v["f"], v["h"]], list(linear.parameters()), 1e-4, 1e-5
    if name == "mamba1":
        v = _tensors(mamba1.make_inputs(rng, 180, batch=4, dim=128, state=16), torch.float32)
        params = [torch.nn.Parameter(v[n]) for n in ("A", "D", "delta_bias")]
        f = st.function(mamba1.SPEC, layout=mamba1.LAYOUT)

        def model(u, delta, B, C, z):
            y = f(u, delta, params[0], B, C, params[1], z, params[2])
            return (y * torch.tanh(y)).sum()
        return model, [v[n] for n in ("u", "delta", "B", "C", "z")], params, 1e-4, 1e-4
    if name == "lstm":
        v = _tensors(lstm.make_inputs(rng, 64, batch=16, inp=128, hidden=128), torch.float32)
        params = [torch.nn.Parameter(v[n]) for n in ("W", "U", "bias")]
        f = st.function(lstm.SPEC, layout=lstm.LAYOUT)

        def model(x, h, c):
            return f(x, *params, h=h, c=c).pow(2).sum()
        return model, [v["x"], v["h"], v["c"]], params, 1e-4, 1e-4
    if name == "mamba2":
        values = mamba2.make_inputs(rng, 300, batch=2, groups=1, heads=4, headdim=64, state=64)
        v = _tensors(values, torch.float32, half=("x", "dt", "B", "C"), half_dtype=torch.bfloat16)
        f = st.function(mamba2.SPEC, layout=mamba2.LAYOUT)
        params = [torch.nn.Parameter(v["A"]), torch.nn.Parameter(v["D"])]

        def model(x, dt, B, C):
            return f(x, dt, params[0], B, C, params[1]).float().pow(2).mean()
        return model, [v[n] for n in ("x", "dt", "B", "C")], params, 3e-2, 3e-2
    if name == "retnet":  # a decay given as is: the chunk path checks it is positive (not while captured)
        values = retnet.make_inputs(rng, 300, batch=2, heads=4, dk=64, dv=64)
        v = _tensors(values, torch.float32, half=("q", "k", "v"), half_dtype=torch.bfloat16)
        f = st.function(retnet.SPEC, layout=retnet.LAYOUT)

        def model(q, k, vv):
            return f(q, k, vv, v["gamma"]).float().pow(2).mean()
        return model, [v["q"], v["k"], v["v"]], [], 3e-2, 3e-2
    if name == "alibi":
        values = alibi_attention.make_inputs(rng, 500, batch=2, heads=4, dim=64)
        v = _tensors(values, torch.bfloat16, half=("slope",), half_dtype=torch.float32)
        f = st.function(alibi_attention.SPEC, layout=alibi_attention.LAYOUT)

        def model(q, k, vv):
            return f(q, k, vv, v["slope"]).float().pow(2).mean()
        return model, [v["q"], v["k"], v["v"]], [], 3e-2, 3e-2
    raise ValueError(name)


CASES = ["hgrn", "mamba1", "lstm", "mamba2", "retnet", "alibi"]


def _grads(model, args, params):
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    loss = model(*leaves)
    return [loss, *torch.autograd.grad(loss, [a for a in leaves if a.requires_grad] + params)]


def _close(got, want, rtol, atol):
    for g, w in zip(got, want, strict=True):
        scale = max(w.float().abs().max().item(), 1e-6)
        err = (g.float() - w.float()).abs().max().item()
        assert err <= atol + rtol * scale, f"max error {err:.3g}, largest value {scale:.3g}"


@pytest.mark.parametrize("name", CASES)
def test_gpu_inductor_fullgraph(name):
    """`torch.compile(model, fullgraph=True)` with inductor: no graph break, eager's loss and gradients."""
    model, args, params, rtol, atol = _case(name)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    _close(_grads(compiled, args, params), _grads(model, args, params), rtol, atol)


@pytest.mark.parametrize("name", CASES)
def test_gpu_cuda_graph_of_a_training_step(name):
    """A training step (loss and gradients) captured once with torch.cuda.graph, then replayed on new
    values copied into its inputs: the eager step's loss and gradients on those values."""
    model, args, params, rtol, atol = _case(name)
    static = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]

    def step():
        loss = model(*static)
        return [loss, *torch.autograd.grad(loss, [a for a in static if a.requires_grad] + params)]
    graph, outs = captured(step)
    for seed in (1, 2):
        new = [a * (1 + 0.1 * seed) if a.is_floating_point() else a for a in args]
        with torch.no_grad():
            for s, n in zip(static, new, strict=True):
                s.copy_(n)
        graph.replay()
        torch.cuda.synchronize()
        _close([o.clone() for o in outs], _grads(model, new, params), rtol, atol)

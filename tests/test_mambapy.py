"""ssmc inside a model it did not write: mambapy's Mamba (pure PyTorch, its own `pscan`) with each block's
`selective_scan` replaced by an ssmc op of the same step (issue 43). Same weights, same input: the
model's output and the gradient of every parameter equal mambapy's own; then a few AdamW steps give the
same losses. On the CPU (Numba) at a small size in CI; on a GPU (CUDA kernels) at a training size."""

from __future__ import annotations

import copy

import pytest

import ssmc

torch = pytest.importorskip("torch")
mambapy = pytest.importorskip("mambapy.mamba")
st = pytest.importorskip("ssmc.torch")


@ssmc.recurrence
def selective_scan(h: ssmc.State["b e n"], x: ssmc.Seq["b e"], delta: ssmc.Seq["b e"], A: ssmc.Param["e n"],
                   B: ssmc.Seq["b n"], C: ssmc.Seq["b n"], D: ssmc.Param["e"]):
    """mambapy's `MambaBlock.selective_scan` (delta already through softplus):
    h = exp(delta A) h + delta x B;  y = sum_n h C + D x."""
    h = ssmc.exp(delta * A) * h + delta * x * B
    y = ssmc.dot(h, C, over="n") + D * x
    return h, y


def _models(d_model: int, layers: int, device: str):
    """(mambapy's Mamba, a copy of it whose blocks scan through ssmc)."""
    torch.manual_seed(0)
    config = mambapy.MambaConfig(d_model=d_model, n_layers=layers, d_state=16, expand_factor=2)
    theirs = mambapy.Mamba(config).to(device)
    ours = copy.deepcopy(theirs)
    scan = st.function(selective_scan, layout="b t ...")
    for layer in ours.layers:
        layer.mixer.selective_scan = lambda x, delta, A, B, C, D: scan(x, delta, A, B, C, D)
    return theirs, ours


def _compare(theirs, ours, x, rtol: float):
    y_theirs, y_ours = theirs(x), ours(x)
    scale = y_theirs.abs().max().item()
    assert (y_ours - y_theirs).abs().max().item() <= rtol * scale
    y_theirs.square().mean().backward()
    y_ours.square().mean().backward()
    for (name, p), q in zip(theirs.named_parameters(), ours.parameters(), strict=True):
        scale = max(p.grad.abs().max().item(), 1e-12)
        assert (q.grad - p.grad).abs().max().item() <= rtol * scale, name


def _losses(model, x, steps: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("length", [1, 33])
def test_mambapy_with_ssmc_scans_on_the_cpu(length):
    theirs, ours = _models(16, 2, "cpu")
    x = torch.randn(2, length, 16, generator=torch.Generator().manual_seed(length))
    _compare(theirs, ours, x, 1e-4)


def test_mambapy_trains_the_same_on_the_cpu():
    theirs, ours = _models(16, 2, "cpu")
    x = torch.randn(2, 20, 16, generator=torch.Generator().manual_seed(1))
    want, got = _losses(theirs, x, 5), _losses(ours, x, 5)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-4, (got, want)


@pytest.mark.gpu
def test_gpu_mambapy_with_ssmc_scans():
    """A 4-layer d_model 256 Mamba at B8 L1024 (the measured training size): output and every gradient,
    then 5 AdamW steps' losses."""
    theirs, ours = _models(256, 4, "cuda")
    x = torch.randn(8, 1024, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
    _compare(theirs, ours, x, 2e-3)
    theirs, ours = _models(256, 4, "cuda")
    want, got = _losses(theirs, x, 5), _losses(ours, x, 5)
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-4, (got, want)

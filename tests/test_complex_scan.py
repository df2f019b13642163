"""A complex diagonal recurrence as a diagonal-linear scan (issue #44).

A complex state is traced as two real states (frontend/complex.py); classification finds the pair
from the derivatives of their updates (passes/classify.py, "complex diagonal"), so the CUDA backend
runs it as the diagonal-linear scans: time blocks (summary, combine, rescan with complex products)
where time is not contiguous, the warp kernel (lanes combined with complex products) and its fused
backward (the adjoint: the conjugate coefficient in reverse time) where it is.

- Classification: a hand-split pair with any names is found; couplings that are not a complex
  product (a hyperbolic rotation, unequal diagonals) are not; the adjoint pairs up too.
- The emulated CUDA backend (no GPU) under each scan strategy against the interpreter at
  L = 1, 7, 180, 1000, complex128: outputs, the complex final state, every gradient; and a state with
  an axis of its own (S4D-like) through the state-major warp kernels and fused backward.
- NVRTC: the scan kernels at B8 D1536 L2048 complex64 compile for sm_80 and sm_90 without spills.
- GPU (``-m gpu``): the same on the hardware in complex64 and complex128, against a torch loop.
"""

from __future__ import annotations

import numpy as np
import pytest
from profiles import in_ci

import ssmc
from ssmc.backends.cuda import emulator
from ssmc.backends.cuda.fused_backward import fused_backward_runner
from ssmc.backends.cuda.report import kernel_reports
from ssmc.backends.cuda.runner import runner_for
from ssmc.passes.autodiff import derive_backward
from ssmc.passes.classify import classify

torch = pytest.importorskip("torch")

LENGTHS = [1, 7, 180, 1000]


@ssmc.recurrence
def complex_diagonal(h: ssmc.State["b d", complex], x: ssmc.Seq["b d", complex], lam: ssmc.Param["d", complex]):
    """h[b, d] = lam[d] * h[b, d] + x[t, b, d] for each t (complex); y = h."""
    h = lam * h + x
    return h, h


@ssmc.recurrence
def complex_s4d(h: ssmc.State["b d n", complex], x: ssmc.Seq["b d"], Bt: ssmc.Seq["b n"], C: ssmc.Seq["b n"],
                A: ssmc.Param["d n", complex]):
    """S4D-like, a state axis of its own read along a sequence (as Mamba-1's B[t, n]): h[b, d, n] =
    A[d, n] h[b, d, n] + x[t, b, d] Bt[t, b, n]; y[b, d] = Re(sum_n h[b, d, n] C[t, b, n])."""
    h = A * h + x * Bt
    return h, ssmc.sum(h * C, "n").real


@ssmc.recurrence
def split_by_hand(u: ssmc.State["b d"], v: ssmc.State["b d"], p: ssmc.Seq["b d"], r: ssmc.Param["d"],
                  w: ssmc.Param["d"]):
    """The complex product written out in real parts, under names that say nothing."""
    u, v = ssmc.exp(r) * u - w * v + p, w * u + ssmc.exp(r) * v
    return (u, v), u * v


@ssmc.recurrence
def hyperbolic(u: ssmc.State["b d"], v: ssmc.State["b d"], p: ssmc.Seq["b d"], r: ssmc.Param["d"],
               w: ssmc.Param["d"]):
    """u + v and u - v scale apart: no complex product."""
    u, v = r * u + w * v + p, w * u + r * v
    return (u, v), u


@ssmc.recurrence
def unequal(u: ssmc.State["b d"], v: ssmc.State["b d"], p: ssmc.Seq["b d"], r: ssmc.Param["d"],
            w: ssmc.Param["d"]):
    u, v = r * u - w * v + p, w * u + 0.5 * r * v
    return (u, v), u


def test_a_complex_pair_is_classified_from_the_ir():
    c = classify(split_by_hand.program)
    assert c.family == "diagonal linear" and c.pairs() == {"u": "v"}
    u, v = c.states
    assert (u.partner, u.imag, v.partner, v.imag) == ("v", False, "u", True)
    for spec in (hyperbolic, unequal):
        assert classify(spec.program).family == "general linear", spec.program.name
        assert classify(spec.program).pairs() == {}
    # the complex spec and its adjoint (grad_h = conj(lam) grad_h' + ..., reverse time)
    assert classify(complex_diagonal.program).pairs() == {"h_re": "h_im"}
    adjoint = classify(derive_backward(complex_diagonal.program).adjoint)
    assert adjoint.family == "diagonal linear" and adjoint.reverse
    assert adjoint.pairs() == {"grad_h_re": "grad_h_im"}


def _inputs(rng, length: int, layout: str, batch: int = 2, dim: int = 3) -> dict:
    lam = np.sqrt(rng.uniform(0.5, 0.99, dim)) * np.exp(1j * rng.uniform(0.0, 2 * np.pi, dim))
    x = rng.standard_normal((batch, length, dim)) + 1j * rng.standard_normal((batch, length, dim))
    if layout == "b d t":
        x = np.ascontiguousarray(np.moveaxis(x, 1, 2))
    h = rng.standard_normal((batch, dim)) + 1j * rng.standard_normal((batch, dim))
    return {"x": x, "lam": lam, "h": h}


def _rel(got, want) -> float:
    got = got.detach().cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float(np.abs(got - want).max(initial=0.0) / max(np.abs(want).max(initial=0.0), 1e-30))


# (strategy forced, layout): the time blocks with time not contiguous; the warp kernel and its fused
# backward with time contiguous
CASES = [("time blocks", "b t d"), ("warp", "b d t")]


@pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")
@pytest.mark.parametrize("strategy, layout", CASES)
def test_emulated_complex_scans_match_the_interpreter(strategy, layout, monkeypatch):
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", strategy)
    program = complex_diagonal.program
    if strategy == "warp":
        monkeypatch.setenv("SSMC_CUDA_FUSED_BACKWARD", "1")
        fused = fused_backward_runner(derive_backward(program), "float64")
        assert fused is not None and fused.applies_at({"b": 2, "d": 3}, 180, True)
    else:
        assert runner_for(program, "float64").strategy({"b": 8, "d": 64}, 2048) == "time blocks"
    f = ssmc.compile(complex_diagonal, "cuda", layout=layout)
    g = ssmc.grad(complex_diagonal, "cuda", layout=layout)
    fi = ssmc.compile(complex_diagonal, "interpreter", layout=layout)
    gi = ssmc.grad(complex_diagonal, "interpreter", layout=layout)
    for length in [7, 1000] if in_ci() else LENGTHS:
        rng = np.random.default_rng(length)
        inputs = _inputs(rng, length, layout)
        y, h = fi(**inputs, return_final_states=True)
        tensors = {k: torch.tensor(v) for k, v in inputs.items()}
        got_y, got_h = f(**tensors, return_final_states=True)
        assert got_h.dtype == torch.complex128
        assert _rel(got_y, y) <= 1e-10 and _rel(got_h, h) <= 1e-10, length
        cot = rng.standard_normal(y.shape) + 1j * rng.standard_normal(y.shape)
        cot_h = rng.standard_normal(h.shape) + 1j * rng.standard_normal(h.shape)
        want = gi(**inputs, grad_outputs=cot, grad_final_states=cot_h)
        got = g(**tensors, grad_outputs=torch.tensor(cot), grad_final_states=torch.tensor(cot_h))
        assert set(got) == set(want)
        for k, w in want.items():
            assert _rel(got[k], w) <= 1e-10, (length, k)


@pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")
def test_emulated_state_major_complex_scans_match_the_interpreter(monkeypatch):
    """A complex state with an axis of its own, time contiguous, the warp kernel forced: its forward,
    training forward and fused backward are the state-major kernels (each state value scanned across
    the lanes in turn, `_combine_state_values`), against the interpreter, complex128."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "warp")
    monkeypatch.setenv("SSMC_CUDA_FUSED_BACKWARD", "1")
    reports = kernel_reports(complex_s4d.program, {"b": 2, "d": 4, "n": 3}, 180, "float64", compile_kernels=False,
                             time_contiguous=True)
    assert all("one state value at a time" in r.source for r in reports), [r.program for r in reports]
    layout = "b ... t"
    f, g = ssmc.compile(complex_s4d, "cuda", layout=layout), ssmc.grad(complex_s4d, "cuda", layout=layout)
    fi = ssmc.compile(complex_s4d, "interpreter", layout=layout)
    gi = ssmc.grad(complex_s4d, "interpreter", layout=layout)
    for length in [180] if in_ci() else [7, 180]:
        rng = np.random.default_rng(length)
        b, d, n = 2, 4, 3
        inputs = {"x": rng.standard_normal((b, d, length)), "Bt": rng.standard_normal((b, n, length)),
                  "C": rng.standard_normal((b, n, length)),
                  "A": np.sqrt(rng.uniform(0.5, 0.99, (d, n))) * np.exp(1j * rng.uniform(0.0, 2 * np.pi, (d, n))),
                  "h": rng.standard_normal((b, d, n)) + 1j * rng.standard_normal((b, d, n))}
        y, h = fi(**inputs, return_final_states=True)
        tensors = {k: torch.tensor(v) for k, v in inputs.items()}
        got_y, got_h = f(**tensors, return_final_states=True)
        assert _rel(got_y, y) <= 1e-10 and _rel(got_h, h) <= 1e-10, length
        cot = rng.standard_normal(y.shape)
        want = gi(**inputs, grad_outputs=cot)
        got = g(**tensors, grad_outputs=torch.tensor(cot))
        for k, w in want.items():
            assert _rel(got[k], w) <= 1e-10, (length, k)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("contiguous", [False, True])
def test_complex_scan_kernels_compile_without_spills(arch, contiguous):
    reports = kernel_reports(complex_diagonal.program, {"b": 8, "d": 1536}, 2048, "float32", arch,
                             time_contiguous=contiguous)
    strategies = {r.strategy.split(",")[0].split(" (")[0] for r in reports if r.program.startswith("forward")}
    assert strategies == ({"warp"} if contiguous else {"time blocks"}), strategies
    if contiguous:
        assert any(r.strategy.startswith("fused backward") for r in reports)
    for r in reports:
        assert r.resources is not None, (r.name, r.error)
        assert not r.resources.spills, (r.name, r.resources.summary())


def complex_diagonal_torch(x, lam, h):
    """The torch loop (time second): y[:, t] = h = lam * h + x[:, t]."""
    ys = []
    for t in range(x.shape[1]):
        h = lam * h + x[:, t]
        ys.append(h)
    return torch.stack(ys, 1), h


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128])
@pytest.mark.parametrize("layout", ["b t d", "b d t"])
def test_gpu_complex_scans_match_torch(layout, dtype):
    """On a GPU, the strategy the heuristic picks (time blocks, or the warp kernel and fused backward
    with time contiguous) against torch autograd of the torch loop in complex128."""
    tol = 1e-9 if dtype == torch.complex128 else 2e-4
    f = ssmc.compile(complex_diagonal, "cuda", layout=layout)
    g = ssmc.grad(complex_diagonal, "cuda", layout=layout)
    for length in [*LENGTHS, 4096]:
        rng = np.random.default_rng(length)
        inputs = _inputs(rng, length, "b t d", batch=4, dim=96)
        wide = {k: torch.tensor(v, requires_grad=True) for k, v in inputs.items()}
        y, h = complex_diagonal_torch(wide["x"], wide["lam"], wide["h"])
        cot = torch.randn(y.shape, dtype=torch.complex128)
        cot_h = torch.randn(h.shape, dtype=torch.complex128)
        want = dict(zip(("x", "lam", "h"), torch.autograd.grad([y, h], list(wide.values()), [cot, cot_h])))
        gpu = {k: torch.tensor(v).to("cuda", dtype) for k, v in inputs.items()}
        c, c_y = cot.to("cuda", dtype), cot_h.to("cuda", dtype)
        if layout == "b d t":
            gpu["x"], c = gpu["x"].transpose(1, 2).contiguous(), c.transpose(1, 2).contiguous()
        got_y, got_h = f(**gpu, return_final_states=True)
        got = g(**gpu, grad_outputs=c, grad_final_states=c_y)
        if layout == "b d t":
            got_y, got["x"] = got_y.transpose(1, 2), got["x"].transpose(1, 2)
        assert got_h.dtype == dtype and got_h.is_cuda
        assert _rel(got_y, y.detach().numpy()) <= tol, length
        assert _rel(got_h, h.detach().numpy()) <= tol, length
        for k, w in want.items():
            assert _rel(got[k], w.numpy()) <= tol, (length, k)

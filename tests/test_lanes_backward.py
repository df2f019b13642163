"""The lanes backward (kernels/lanes/backward_analysis.py, kernels/lanes/backward.py): its split of Mamba-1's
fused backward, its kernels compiled without spills (NVRTC, no GPU needed), and on a GPU its gradients
against the interpreter's. The emulated checks are in test_cuda_emulated.py (`test_emulated_lanes_backward`)."""

from __future__ import annotations

import numpy as np
import pytest
from test_cuda import rel_err

import ssmc
from ssmc.backends.cuda import fused_backward, nvrtc
from ssmc.backends.cuda.kernels import lanes
from ssmc.backends.cuda.kernels.lanes import backward as lanes_kernel
from ssmc.backends.cuda.kernels.lanes.backward_analysis import lanes_backward
from ssmc.backends.cuda.report import kernel_reports
from ssmc.examples import hgrn, mamba1
from ssmc.lowering.loops import accesses
from ssmc.passes.autodiff import derive_backward


def _runner(spec, compute="float32"):
    return fused_backward.fused_backward_runner(derive_backward(spec.program), compute)


def test_mamba1_splits_into_the_lanes_backward():
    """Mamba-1's four state-major steps as the lanes backward's parts: dt computed once (the forward
    summary's and the carries' pre both compute it), exp(dt A[n]) and the carry registers of one
    state index, the three sums over n per step, grad_B / grad_C summed over the rows, grad_A per lane
    and grad_D / grad_delta_bias per thread; the exponentials base 2 of a scaled copy of A."""
    fb = _runner(mamba1.SPEC)
    lb = fb.lanes_backward
    assert lb is not None
    assert lb.step_registers == ("sv1",) and lb.forward_state == "st_h"
    assert {name for name, _ in lb.sums} == {"acc_m6", "acc_m7", "acc_m15"}
    assert [a for a, _ in lb.atomic] == ["out_grad_B", "out_grad_C"]
    assert lb.accumulators == ("grad_A",) and set(lb.thread_accumulators) == {"grad_D", "grad_delta_bias"}
    softplus = [s for s in lb.pre if "softplus" in repr(s.value)]
    assert len(softplus) == 1  # the two pre's dt, once
    assert lb.row_seqs == ("delta", "grad_y", "u", "z") and lb.state_seqs == ("B", "C")
    # exp(dt A[n]) read as exp2(dt A'[n]), A' = A log2 e; the adjoint's other use of A reads A itself
    assert lb.lane_params == ("A",) and lb.log2e_params == ("A",)
    read = [e.array for s in lb.carries + lb.adjoint for e in accesses(s)]
    assert "log2e_A" in read and "A" in read
    assert "fn='exp'" not in repr(lb.carries + lb.adjoint) and "fn='exp2'" in repr(lb.carries)


def test_a_scan_has_no_lanes_backward():
    """HGRN's state has no axis of its own: no lanes forward, so no lanes backward."""
    fb = _runner(hgrn.SPEC)
    assert fb is None or fb.lanes is None or lanes_backward(fb.plan, fb.lanes) is None


@pytest.mark.skipif(not nvrtc.available(), reason=nvrtc.unavailable_reason())
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("sizes, length", [({"b": 32, "d": 512, "n": 16}, 180), ({"b": 8, "d": 1536, "n": 16}, 2048),
                                           ({"b": 32, "d": 500, "n": 64}, 100),
                                           ({"b": 16, "d": 512, "n": 33}, 33), ({"b": 8, "d": 500, "n": 256}, 1000)])
def test_lanes_backward_kernels_compile_without_spills(sizes, length, arch):
    """The training step's kernels where the lanes backward runs (sequences with time strided, "b t d"),
    up to Mamba's largest state (256): they compile, the backward reported as the lanes backward,
    and none spills."""
    reports = kernel_reports(mamba1.SPEC.program, sizes, length, "float32", arch, time_contiguous=False)
    backward = [r for r in reports if "lanes backward" in r.strategy]
    if sizes["n"] == 256:  # 32 values a lane: its checkpoints take more shared memory than a block has
        assert not backward
        return
    assert backward
    for r in reports:
        assert r.resources is not None, r.error
        assert not r.resources.spills, (r.strategy, r.resources.summary())


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["b d t", "b t d"])
@pytest.mark.parametrize("batch, dim, state, length", [(2, 40, 16, 1), (3, 24, 16, 7), (2, 72, 16, 180),
                                                       (1, 50, 5, 1000), (2, 16, 33, 97)])
def test_lanes_backward_on_the_gpu(batch, dim, state, length, layout, monkeypatch, fresh_runners):
    """Mamba-1's gradients through the lanes backward (forced; the lanes forward's fill threshold
    lowered) against the interpreter's, fp32 inputs rounded first, by relative error: every input's
    gradient and the initial state's."""
    _check_on_the_gpu(batch, dim, state, length, layout, monkeypatch, lanes_kernel.CHUNK)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["b d t", "b t d"])
@pytest.mark.parametrize("batch, dim, state, length", [(2, 40, 16, 1), (3, 24, 16, 7), (2, 72, 16, 180),
                                                       (1, 50, 12, 1000), (2, 16, 16, 97)])
def test_bounded_lanes_backward_on_the_gpu(batch, dim, state, length, layout, monkeypatch, fresh_runners):
    """The same through the bounded kernel (chunks of 16 steps, `__launch_bounds__(64, 8)`), which runs
    with many rows, forced at these sizes; the training forward saving two carries a chunk."""
    monkeypatch.setattr(lanes_kernel, "UNBOUNDED_WAVE_THREADS_AN_SM", 0)
    _check_on_the_gpu(batch, dim, state, length, layout, monkeypatch, lanes_kernel.SHORT_CHUNK)


def _check_on_the_gpu(batch, dim, state, length, layout, monkeypatch, chunk):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(lanes, "LANES_FILL", 1)
    monkeypatch.setenv("SSMC_CUDA_LANES_BACKWARD", "1")
    fb = _runner(mamba1.SPEC)
    assert fb.backward_lanes({"b": batch, "d": dim, "n": state}, length, layout == "b d t").chunk == chunk
    rng = np.random.default_rng(length + dim)
    inputs = mamba1.make_inputs(rng, length, batch=batch, dim=dim, state=state)
    if layout == "b t d":
        inputs = {k: (np.ascontiguousarray(np.swapaxes(v, 1, 2)) if k in ("u", "delta", "z", "B", "C") else v)
                  for k, v in inputs.items()}
    inputs = {k: v.astype(np.float32).astype(np.float64) for k, v in inputs.items()}
    cot = rng.standard_normal(inputs["u"].shape).astype(np.float32).astype(np.float64)
    want = ssmc.grad(mamba1.SPEC, "interpreter", layout=layout)(**inputs, grad_outputs=cot)
    gpu = {k: torch.tensor(v, dtype=torch.float32, device="cuda") for k, v in inputs.items()}
    g = ssmc.grad(mamba1.SPEC, "cuda", layout=layout)
    for call in range(2):
        got = g(**gpu, grad_outputs=torch.tensor(cot, dtype=torch.float32, device="cuda"))
        for key in want:
            assert rel_err(got[key], want[key]) <= 1e-4, (call, key)

"""Rows of a recurrence (lowering/split_sum.py, `recurrence_row_axis`; CUDA: the "rows" strategy):
which programs a block of threads per row may run with the normalised axis shared, when the CUDA
backend runs a staged layer as that one kernel, and what it generates (no GPU needed; the GPU tests
in tests/test_cuda.py run them against the interpreter)."""

from __future__ import annotations

import importlib

import pytest
from row_layers import layernorm_layer, norm_inside, softmax_layer

import ssmc
from ssmc.backends.cuda import nvrtc
from ssmc.backends.cuda.report import kernel_reports
from ssmc.backends.cuda.runner import CudaRunner, one_kernel
from ssmc.lowering.plan import lower
from ssmc.lowering.split_sum import recurrence_row_axis
from ssmc.lowering.stages import fuse

BLOCK = importlib.import_module("ssmc.examples.mamba1_block").SPEC.program
MAMBA1 = importlib.import_module("ssmc.examples.mamba1").SPEC.program


@ssmc.recurrence
def per_state_norm(h: ssmc.State["b d n"], x: ssmc.Seq["b d"], B: ssmc.Seq["b n"]):
    """A statistic over d per state index n: a vector per row, not a scalar (refused)."""
    h = 0.9 * h + x * B
    s = (h * h).sum("d")
    return h, (h / ssmc.sqrt(s + 1.0)).sum("n")


def _axis(program):
    fused = fuse(program)
    return recurrence_row_axis(lower(program, map_reduce=True).kernels[0], fused.row_axes)


def test_which_programs_share_their_rows():
    assert fuse(BLOCK).row_axes == ("d",) and _axis(BLOCK) == "d"
    for spec in (softmax_layer, layernorm_layer, norm_inside):
        assert _axis(spec.program) == "d", spec.program.name
    assert fuse(MAMBA1).row_axes == () and _axis(MAMBA1) is None          # no row statistic
    assert fuse(per_state_norm.program).staged and _axis(per_state_norm.program) is None
    assert fuse(BLOCK).shared_row_axis() == "d" and fuse(per_state_norm.program).shared_row_axis() is None
    core = fuse(BLOCK).core.program
    assert fuse(core).shared_row_axis() is None                            # the stages have none left
    assert "or on CUDA 1 kernel" in fuse(BLOCK).describe()
    assert "a block of threads shares each row along d" in fuse(norm_inside.program).describe()


def test_when_a_staged_layer_runs_as_one_kernel(monkeypatch):
    """Where a block owns each row (at most 2 channels a thread) and the scan would run a thread per
    recurrence anyway (many rows, time outermost); SSMC_CUDA_ROW_RECURRENCE forces it either way."""
    monkeypatch.delenv("SSMC_CUDA_ROW_RECURRENCE", raising=False)
    monkeypatch.delenv("SSMC_CUDA_STRATEGY", raising=False)
    fused = fuse(BLOCK)
    big = {"b": 256, "d": 1024, "n": 16}
    assert one_kernel(fused, "float32", big, 1024, time_contiguous=False)
    assert not one_kernel(fused, "float32", big, 1024, time_contiguous=True)     # the scan: a warp kernel
    assert not one_kernel(fused, "float32", {"b": 8, "d": 1536, "n": 16}, 2048, False)  # time blocks
    assert not one_kernel(fused, "float32", {"b": 256, "d": 4096, "n": 16}, 1024, False)  # 8 channels a thread
    assert one_kernel(fused, "float32", {"b": 2, "d": 5, "n": 3}, 7, True)       # too short to split time
    assert not one_kernel(fuse(per_state_norm.program), "float32", {"b": 256, "d": 1024, "n": 16}, 1024, False)
    monkeypatch.setenv("SSMC_CUDA_ROW_RECURRENCE", "1")
    assert one_kernel(fused, "float32", {"b": 8, "d": 1536, "n": 16}, 2048, True)
    monkeypatch.setenv("SSMC_CUDA_ROW_RECURRENCE", "0")
    assert not one_kernel(fused, "float32", big, 1024, False)
    monkeypatch.setenv("SSMC_CUDA_ROW_RECURRENCE", "2")
    with pytest.raises(ValueError, match="SSMC_CUDA_ROW_RECURRENCE='2'"):
        one_kernel(fused, "float32", big, 1024, False)


def test_a_norm_inside_the_update_runs_as_rows(monkeypatch):
    monkeypatch.delenv("SSMC_CUDA_ROW_RECURRENCE", raising=False)
    runner = CudaRunner(norm_inside.program)
    assert runner.strategy({"b": 8, "d": 1536}, 2048) == "rows"
    (launch,) = runner.launches({"b": 8, "d": 1536}, 2048)
    assert launch.mapping.groups == 512 and launch.grid == (8, 512)            # a block per b, 3 channels a thread
    assert runner.launches({"b": 8, "d": 300}, 64)[0].mapping.groups == 320     # whole warps, one channel each
    small = runner.launches({"b": 3, "d": 5}, 7)[0]
    assert small.mapping.groups == 8 and small.grid == (1, 128)                # 16 rows of 8 threads a block
    monkeypatch.setenv("SSMC_CUDA_ROW_RECURRENCE", "0")
    assert runner.strategy({"b": 8, "d": 1536}, 2048) == "fused"               # a thread per b, as before
    monkeypatch.delenv("SSMC_CUDA_ROW_RECURRENCE")
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "rows")
    with pytest.raises(ValueError, match="no row statistic"):
        CudaRunner(MAMBA1).strategy({"b": 8, "d": 16, "n": 4}, 64)


def test_the_one_kernel_source():
    """The layer's one kernel: each thread's channels unrolled (states in registers), the row's sums
    combined every step, stores by the threads that own them."""
    (forward,) = kernel_reports(BLOCK, {"b": 256, "d": 1024, "n": 16}, 1024, backward=False, compile_kernels=False)
    assert forward.strategy.startswith("rows (the layer in one kernel)")
    src = forward.source
    assert "acc_m5 = group_sum<512>(acc_m5, ssmc_part);" in src
    assert "for (int j_d = 0; j_d < 2; ++j_d) {" in src and "const int i_d = grp + j_d * 512;" in src
    assert "st_h[j_d][i_n]" in src and "F st_h[2][n_n];" in src
    assert "if (valid) out_y[" in src and "if (valid) final_h[" in src
    assert "__launch_bounds__(512)" in src
    # a training step's forward runs the stages (each stage's backward reads its own tape)
    reports = kernel_reports(BLOCK, {"b": 256, "d": 1024, "n": 16}, 1024, compile_kernels=False)
    training = [r.strategy.split(":")[0] for r in reports if r.program == "forward (training)"]
    assert training[:2] == ["core", "post"]
    # the core's gradient (Mamba-1's scan, time strided): the lanes forward saving its chunks, the lanes backward
    core = [r.strategy for r in reports if r.strategy.startswith("core") and r.program in ("forward (training)",
                                                                                          "backward")]
    assert core[-2:] == ["core: lanes, 4 lanes a row", "core: lanes backward, 4 lanes a row, chunks of 16 steps"]


@pytest.mark.skipif(not nvrtc.available(), reason=nvrtc.unavailable_reason())
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("program, sizes", [
    (BLOCK, {"b": 256, "d": 1024, "n": 16}),   # G = 512, 2 channels a thread
    (BLOCK, {"b": 1024, "d": 96, "n": 16}),    # G = 128: 4 warps a row, one channel a thread
    (BLOCK, {"b": 3, "d": 5, "n": 16}),        # G = 8: 4 rows a warp, shuffles only
    (softmax_layer.program, {"b": 256, "d": 1000}),  # G = 512, the second channel of 24 threads past d
    (layernorm_layer.program, {"b": 2, "d": 300}),    # G = 320
    (norm_inside.program, {"b": 8, "d": 1024}),
], ids=["block-d1024", "block-d96", "block-d5", "softmax", "layernorm", "norm-inside"])
def test_rows_compile_without_spills(program, sizes, arch, dtype, monkeypatch):
    monkeypatch.setenv("SSMC_CUDA_ROW_RECURRENCE", "1")
    (forward,) = kernel_reports(program, sizes, 1024, dtype, arch, backward=False)
    assert forward.launch.mapping.recurrence
    assert forward.resources is not None, forward.error
    if dtype == "float32":  # float64 (the reference dtype) may spill: two channels of 16 doubles a thread
        assert not forward.resources.spills, forward.resources.summary()

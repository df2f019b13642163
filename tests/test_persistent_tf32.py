"""The persistent kernel's fp32 tensor-core form (backends/cuda/kernels/persistent/, `Plan.tf32`): an fp32
call keeps U and each step's operand (h, or the adjoint's dz) in fp32 in shared memory and multiplies them
with mma.sync m16n8k8 tf32, each value split in registers into hi = tf32(x) and lo = tf32(x - hi):
3xTF32 (hi hi + hi lo + lo hi, about fp32's accuracy) by default, plain TF32 (hi hi) where allowed
(SSMC_CUDA_TF32=1, or torch.backends.cuda.matmul.allow_tf32 where that variable is unset); the FMA form
where SSMC_CUDA_PERSISTENT_MMA=0.

CPU: the plans and the choice of the form, NVRTC (sm_80, sm_90: no spills) at the benchmark shape and
B16 H256, one emulated block against the interpreter (the emulator multiplies the tf32 fragments lane by
lane, the inputs' lower 13 bits dropped as the tensor cores drop them: templates/ssmc_mma.cuh).
GPU: tests/test_persistent_rnn.py's fp32 cases run this form (it is the default)."""

from __future__ import annotations

import numpy as np
import pytest
from persistent_helpers import (
    adjoint_program,
    check_fp32,
    forward_program,
    no_barrier_timed_out,
    record_launches,
    training_source,
)
from profiles import in_ci, nightly_case

from ssmc.backends.cuda.kernels.persistent import runner as persistent_runner
from ssmc.backends.cuda.kernels.persistent.analysis import BLOCK_SHARED, analyse, plan, tf32_warp_grid
from ssmc.backends.cuda.kernels.persistent.forward import kernel_name
from ssmc.examples import gru, lstm

torch = pytest.importorskip("torch")

# §6 of docs/design/persistent-rnn.md: 3xTF32 emulated within 1e-5 of the float64 interpreter (outputs, finals
# and every gradient); plain TF32 keeps 10 bits of mantissa in each product's inputs
TF32_TOL = 5e-3        # outputs and final states: max |got - want| / max |want|
TF32_GRAD_TOL = 1e-2   # every gradient, the same measure


BENCH = {"b": 64, "k": 512, "j": 512, "i": 512}
SMALL = {"b": 16, "k": 256, "j": 256, "i": 128}


# -- plans ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec,cols", [(lstm, 4), (gru, 3)], ids=["lstm", "gru"])
def test_fp32_benchmark_shape_plans_on_tensor_cores(spec, cols):
    """B64 H512 fp32: U fp32 in shared memory (16 units x G gates x 512, padded rows: 129 KiB a block for the
    LSTM), 4 batch tiles of 16 rows (one whole m16 tile) x 32 blocks, forward and adjoint; the warps' tiles
    cover the block's product."""
    sizes = BENCH | {"g": cols}
    for program, ncols in ((forward_program(spec.SPEC), cols), (adjoint_program(spec.SPEC), 1)):
        cell = analyse(program)
        chosen = plan(cell, sizes, 132, mma=True, tf32=3)
        assert not isinstance(chosen, str), chosen
        assert (chosen.mma, chosen.tf32, chosen.elem, chosen.blocks, chosen.tiles, chosen.trows, chosen.units,
                chosen.cols, chosen.threads) == (True, 3, 4, 128, 4, 16, 16, ncols, 256)
        assert chosen.shared_bytes <= BLOCK_SHARED and chosen.chunk % 16 == 0
        gm, gn, gk, wm, wn = tf32_warp_grid(chosen)
        assert gm * gn * gk <= chosen.threads // 32 and gm * wm * 16 >= chosen.mpad and gn * wn * 8 >= chosen.npad
        assert (chosen.chunk // 8) % gk == 0
        assert chosen.sp_bytes == 4 * chosen.mpad * chosen.sps * gk


def test_the_form_follows_the_options(monkeypatch):
    """An fp32 call: 3xTF32 by default; plain TF32 where SSMC_CUDA_TF32=1 or, that variable unset, where torch
    allows TF32 for its fp32 matrix products; 3xTF32 again where SSMC_CUDA_TF32=0 overrides torch; the FMA form
    where SSMC_CUDA_PERSISTENT_MMA=0. A 16-bit call keeps its m16n8k16 form (tf32 0)."""
    program = forward_program(lstm.SPEC)
    loop = persistent_runner.PersistentLoop(program, "float32", None, analyse(program))
    sizes = BENCH | {"g": 4}
    for var in ("SSMC_CUDA_TF32", "SSMC_CUDA_PERSISTENT_MMA", "SSMC_CUDA_EMULATE"):
        monkeypatch.delenv(var, raising=False)
    matmul = torch.backends.cuda.matmul
    allowed = matmul.allow_tf32

    def form():
        chosen = loop.plan_for(sizes)
        assert not isinstance(chosen, str), chosen
        return chosen.mma, chosen.tf32

    try:
        matmul.allow_tf32 = False
        assert form() == (True, 3)
        monkeypatch.setenv("SSMC_CUDA_TF32", "1")
        assert form() == (True, 1)
        monkeypatch.delenv("SSMC_CUDA_TF32")
        matmul.allow_tf32 = True
        assert form() == (True, 1)
        monkeypatch.setenv("SSMC_CUDA_TF32", "0")
        assert form() == (True, 3)
        monkeypatch.setenv("SSMC_CUDA_PERSISTENT_MMA", "0")
        assert form() == (False, 0)
        half = loop.plan_for(sizes, half=True)
        assert (half.mma, half.tf32, half.elem) == (True, 0, 2)
    finally:
        matmul.allow_tf32 = allowed


# -- NVRTC ----------------------------------------------------------------------------------------------------

NVRTC_CASES = [(f"{name} {which} b{sizes['b']}", spec, which, sizes | {"g": g})
               for name, spec, g in (("lstm", lstm, 4), ("gru", gru, 3))
               for which in ("forward", "adjoint") for sizes in (BENCH, SMALL)]


def _compiled(program, sizes, arch, passes):
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.source import compile_options

    if not nvrtc.available():
        pytest.skip(nvrtc.unavailable_reason())
    cell = analyse(program)
    chosen = plan(cell, sizes, 132, mma=True, tf32=passes)
    assert not isinstance(chosen, str) and chosen.tf32 == passes, chosen
    source = training_source(cell, chosen, sizes, half=False)
    assert f"#define TF32 {passes}" in source and "mma.sync.aligned.m16n8k8.row.col.f32.tf32" in source
    used = nvrtc.compile_source(source, arch, compile_options(source)).resources[kernel_name(cell)]
    assert not used.spills and used.stack_frame_bytes == 0, used.summary()
    assert used.registers <= 255 and used.shared_bytes == 0, used.summary()
    return used


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name,spec,which,sizes", NVRTC_CASES, ids=[c[0] for c in NVRTC_CASES])
def test_nvrtc_3xtf32_compiles_without_spills(name, spec, which, sizes, arch):
    if in_ci() and (arch == "sm_80" or sizes["b"] != BENCH["b"]) and not (name.startswith("lstm") and arch == "sm_90"):
        pytest.skip("CI compiles the LSTM for sm_90 and the GRU at the benchmark shape (nightly: all of them)")
    _compiled(forward_program(spec.SPEC) if which == "forward" else adjoint_program(spec.SPEC), sizes, arch, 3)


@pytest.mark.parametrize("which", ["forward", "adjoint"])
def test_nvrtc_tf32_compiles_without_spills(which):
    """Plain TF32 (two accumulator sets by k8 parity, two k8 steps an iteration) at the benchmark shape."""
    program = forward_program(lstm.SPEC) if which == "forward" else adjoint_program(lstm.SPEC)
    _compiled(program, BENCH | {"g": 4}, "sm_90", 1)


# -- against the interpreter -----------------------------------------------------------------------------------

@pytest.fixture
def forms(monkeypatch):
    """(program, `Plan.mma`, `Plan.tf32`) of every persistent launch."""
    return record_launches(monkeypatch, lambda loop, chosen, _: (loop.program.name, chosen.mma, chosen.tf32))


SPECS = {"lstm": lstm, "gru": gru}


def check(name: str, length: int, batch: int, hidden: int, tol: float, grad_tol: float, seed: int = 0):
    """`name`'s fp32 call against the interpreter's float64: outputs and final states within `tol`, every
    gradient (`ssmc.grad`) within `grad_tol`."""
    m = SPECS[name]
    rng = np.random.default_rng(seed)
    inputs = m.make_inputs(rng, length, batch=batch, inp=4, hidden=hidden)
    check_fp32(m.SPEC, m.LAYOUT, inputs, rng, tol, grad_tol, context=(name, length, batch, hidden))


# B 19 (two m16 tiles, the second partial) x H 37 (the LSTM's 148 columns in 19 n8 tiles, the last partial; the
# forward's 37 contracted indices in 2 chunks of 32, the adjoint's 148 in 2 of 128): the warps split the chunks'
# k8 steps (GK 4 in the adjoints), 3 pairs a thread
# (CI: L 1; tests/test_persistent_rnn.py and test_persistent_backward.py run both at L 7 in this form, B3 H5)
EMULATED = [("lstm", 1), ("gru", 1), nightly_case("lstm", 3, reason="L 1's kernels, more steps"),
            nightly_case("gru", 3, reason="L 1's kernels, more steps")]


@pytest.mark.parametrize("name,length", EMULATED)
def test_emulated_3xtf32(name, length, emulated_cuda, forms):
    """The forward, the recording forward and the adjoint all in the 3xTF32 form, within 1e-5 of float64."""
    emulated_cuda.setenv("SSMC_CUDA_TF32", "0")
    check(name, length, batch=19, hidden=37, tol=1e-5, grad_tol=1e-5)
    assert {(mma, tf) for _, mma, tf in forms} == {(True, 3)}, forms
    assert {name, f"{name}_backward"} <= {n for n, _, _ in forms}, forms


def test_emulated_tf32(emulated_cuda, forms):
    """SSMC_CUDA_TF32=1: one mma a tile (the inputs rounded to 10 bits of mantissa), within TF32's bounds; and
    farther from float64 than 3xTF32 (the form does change the products)."""
    emulated_cuda.setenv("SSMC_CUDA_TF32", "1")
    check("lstm", 3, batch=5, hidden=37, tol=TF32_TOL, grad_tol=TF32_GRAD_TOL)
    assert {tf for _, _, tf in forms} == {1} and {"lstm", "lstm_backward"} <= {n for n, _, _ in forms}, forms
    with pytest.raises(AssertionError):
        check("lstm", 3, batch=5, hidden=37, tol=1e-5, grad_tol=1e-5)


def test_emulated_fma_form(emulated_cuda, forms):
    """SSMC_CUDA_PERSISTENT_MMA=0: the FMA form (U and the operand fp32, no tensor cores), forward and
    gradients."""
    emulated_cuda.setenv("SSMC_CUDA_PERSISTENT_MMA", "0")
    check("gru", 3, batch=5, hidden=9, tol=1e-5, grad_tol=1e-5)
    assert {mma for _, mma, _ in forms} == {False} and {"gru", "gru_backward"} <= {n for n, _, _ in forms}, forms


# -- GPU ----------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["lstm", "gru"])
@pytest.mark.parametrize("length,batch,hidden", [(1, 5, 37), (7, 3, 129), (7, 64, 512), (180, 5, 37)])
@pytest.mark.parametrize("form", ["3xtf32", "tf32", "fma"])
def test_gpu_fp32_forms(name, length, batch, hidden, form, forms, monkeypatch):
    """Many blocks and the grid barrier in each form of an fp32 call (3xTF32, the default, also runs every fp32
    case of tests/test_persistent_rnn.py): forward and gradients against float64."""
    from ssmc.backends.cuda.kernels.persistent import analysis

    monkeypatch.setattr(analysis, "MIN_BLOCK_PAIRS", 1)
    monkeypatch.setenv("SSMC_CUDA_TF32", "1" if form == "tf32" else "0")
    if form == "fma":
        monkeypatch.setenv("SSMC_CUDA_PERSISTENT_MMA", "0")
    tol, grad_tol = (TF32_TOL, TF32_GRAD_TOL) if form == "tf32" else (1e-4, 1e-3)
    check(name, length, batch, hidden, tol, grad_tol)
    want = {"3xtf32": (True, 3), "tf32": (True, 1), "fma": (False, 0)}[form]
    assert forms and {(mma, tf) for _, mma, tf in forms} == {want}, forms
    no_barrier_timed_out()

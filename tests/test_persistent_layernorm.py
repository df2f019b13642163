"""Reductions across the units inside the persistent kernel's cell (backends/cuda/kernels/persistent/): the
LayerNorm LSTM (examples/layernorm_lstm.py), whose cell normalises the recurrent pre-activations over "g k"
and the cell over "k", and whose adjoint sums over the units too. Which levels of reductions the analysis
finds, forward and adjoint; the kernels through NVRTC for sm_80 / sm_90 (no spills); emulated on the CPU
against the float64 interpreter, forward and every gradient, with the units in one block and spread over
several (`runner.EMULATED_BLOCKS`: the call then runs step by step, each step's exchanges among the blocks
completed launch by launch), fp32 and bf16; the peephole LSTM's refusal; on a GPU, B16 H256 and B64 H512."""

from __future__ import annotations

import numpy as np
import pytest
from persistent_helpers import (
    BF16_GRAD_TOL,
    BF16_LONG_GRAD_TOL,
    BF16_TOL,
    FP32_GRAD_TOL,
    FP32_TOL,
    check_fp32,
    check_rounded,
    no_barrier_timed_out,
    record_launches,
)
from profiles import nightly_case

import ssmc
from ssmc.backends.cuda.kernels.persistent import analysis
from ssmc.backends.cuda.kernels.persistent import runner as persistent_runner
from ssmc.backends.cuda.kernels.persistent.analysis import BLOCK_SHARED, Cell, analyse, plan
from ssmc.backends.cuda.kernels.persistent.forward import kernel_name, kernel_source
from ssmc.examples import layernorm_lstm
from ssmc.lowering.hoist import hoist
from ssmc.passes.autodiff import derive_backward

torch = pytest.importorskip("torch")

def _core(program):
    """The program the CUDA backend runs `program`'s recurrence as (its fusion stages' core: the row statistics
    of x W's LayerNorm come from a state-free stage before it), hoisted as the persistent kernel reads it."""
    from ssmc.backends.cuda.backend import cuda_stages

    return hoist(cuda_stages(program).core.program, transpose=False).program


def _forward():
    from ssmc.backends.cuda.backend import cuda_stages

    return _core(cuda_stages(layernorm_lstm.SPEC.program).core.program)


def _adjoint():
    from ssmc.backends.cuda.backend import cuda_stages

    return _core(derive_backward(cuda_stages(layernorm_lstm.SPEC.program).core.program).adjoint)


# -- analysis -------------------------------------------------------------------------------------------------------

def test_the_cells_and_their_levels():
    """The forward: the recurrent LayerNorm's mean and variance, then the cell's, each level one exchange after
    the product (4); the adjoint: its sums over the units all before the product (4 levels), where its operand
    needs them. Every level one value a row. The hoisting: x W out of the loop (its LayerNorm's statistics in a
    stage before), the gains' and biases' gradients summed over the rows after the loop, not in it."""
    fwd, adj = analyse(_forward()), analyse(_adjoint())
    assert isinstance(fwd, Cell) and isinstance(adj, Cell), (fwd, adj)
    assert (fwd.state, fwd.split, fwd.local) == ("h", "k", ("g",))
    assert len(fwd.reductions) == 4 and [len(s) for s in fwd.phases] == [0, 4]
    assert all(len(level) == 1 for level in fwd.phases[1])
    assert (adj.state, adj.contracted) == ("dz", ("g", "k"))
    assert len(adj.reductions) == 6 and [len(s) for s in adj.phases] == [4, 0]
    assert {s.name for s in _adjoint().states} == {"grad_h", "grad_c"}
    assert "4 levels" in fwd.describe() and "4 before the product" in adj.describe()
    sizes = {"b": 64, "k": 512, "j": 512, "g": 4, "i": 512}
    for cell in (fwd, adj):
        for form in ({}, {"mma": True, "tf32": 3}, {"mma": True}):
            chosen = plan(cell, sizes, 132, **form)
            assert not isinstance(chosen, str), chosen
            assert chosen.ksplit == 1 and chosen.rlevels == 4 and chosen.blocks // chosen.tiles > 1
            assert chosen.red_bytes > 0 and chosen.shared_bytes <= BLOCK_SHARED
    # the step loop's programs elsewhere are unchanged: an LSTM has no reductions, no extra shared memory
    from ssmc.examples import lstm

    cell = analyse(hoist(lstm.SPEC.program, transpose=False).program)
    assert cell.reductions == () and plan(cell, sizes, 132).red_bytes == 0


def test_inspect_reports_the_persistent_kernels():
    """`ssmc inspect`'s path notes: the forward's and the adjoint's (as it runs: its own stages') persistent plans
    at B64 H512, each with its levels of sums exchanged among a tile's 32 blocks."""
    from ssmc.backends.cuda.report import path_notes

    notes = path_notes(layernorm_lstm.SPEC.program, {"b": 64, "i": 512, "k": 512}, 180)
    forward = [n for n in notes if n.startswith("persistent forward: layernorm_lstm:")]
    adjoint = [n for n in notes if n.startswith("persistent adjoint: layernorm_lstm_backward:")]
    assert len(forward) == len(adjoint) == 1, notes
    for note in (*forward, *adjoint):
        assert "128 blocks x 256 threads" in note and "4 levels of sums over the units a step" in note, note
        assert "exchanged among the tile's 32 blocks" in note, note
    assert any("a grid barrier a step and one a level of reductions" in n for n in notes), notes


@ssmc.recurrence
def peephole_lstm(h: ssmc.State["b k"], c: ssmc.State["b k"], x: ssmc.Seq["b i"], W: ssmc.Param["i g=4 k"],
                  U: ssmc.Param["j g=4 k"], bias: ssmc.Param["g k"], p: ssmc.Param["g3=3 k"]):
    """An LSTM with peepholes: the gates read the carry (c_{t-1} p_i, c_{t-1} p_f, c_t p_o)."""
    z = ssmc.dot(x, W, over="i") + ssmc.dot(h.rename(k="j"), U, over="j") + bias
    i, f, g, o = z.unbind("g")
    pi, pf, po = p.unbind("g3")
    c_new = ssmc.sigmoid(f + pf * c) * c + ssmc.sigmoid(i + pi * c) * ssmc.tanh(g)
    h = ssmc.sigmoid(o + po * c_new) * ssmc.tanh(c_new)
    return (h, c_new), h


def test_peephole_lstm():
    """The peephole LSTM: the forward is taken (the peepholes' own axis g3, selected at fixed indices, held
    whole by a thread like the gates); so is its adjoint, whose peepholes' gradient (sum_b dz_i c_{t-1} a gate,
    stacked along g3 by where(g3 == i, ., 0)) the hoisting writes every step as one value [g3 b k] and sums over
    the rows and time after the loop."""
    fwd = analyse(_core(peephole_lstm.program))
    assert isinstance(fwd, Cell) and "g3" in fwd.local, fwd
    adj = analyse(_core(derive_backward(peephole_lstm.program).adjoint))
    assert isinstance(adj, Cell) and "g3" in adj.local, adj
    from ssmc.backends.cuda.backend import cuda_stages

    hoisted = hoist(cuda_stages(derive_backward(peephole_lstm.program).adjoint).core.program, transpose=False)
    assert "grad_p" in dict(hoisted.post_accumulators)


# -- NVRTC ----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("which", ["forward", "adjoint"])
@pytest.mark.parametrize("form", ["fma", "tf32", "bf16"])
@pytest.mark.parametrize("batch,hidden", [(64, 512), (16, 256), (3, 37)])
def test_nvrtc_compiles_without_spills(arch, which, form, batch, hidden):
    """The kernels at the benchmark shapes (several blocks a tile: the exchanges) and a small one (one block):
    no spills, no stack frame, at most 255 registers, all shared memory dynamic and within a block's."""
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.source import compile_options

    if not nvrtc.available():
        pytest.skip(nvrtc.unavailable_reason())
    program = _forward() if which == "forward" else _adjoint()
    cell = analyse(program)
    sizes = {"b": batch, "k": hidden, "j": hidden, "g": 4, "i": hidden}
    form_args = {"fma": {}, "tf32": {"mma": True, "tf32": 3}, "bf16": {"mma": True}}[form]
    chosen = plan(cell, sizes, 132, **form_args)
    assert not isinstance(chosen, str), chosen
    if hidden >= 256:
        assert chosen.blocks // chosen.tiles > 1  # the units over several blocks: the exchanges compiled in
    source = kernel_source(cell, chosen, sizes)
    assert "grid_barrier(bar + 3 + tile, (unsigned int)(s * BPS + " in source
    built = nvrtc.compile_source(source, arch, compile_options(source))
    used = built.resources[kernel_name(cell)]
    assert not used.spills and used.stack_frame_bytes == 0, used.summary()
    assert used.registers <= 255, used.summary()
    assert used.shared_bytes == 0 and chosen.shared_bytes <= BLOCK_SHARED, used.summary()


# -- emulated -------------------------------------------------------------------------------------------------------

@pytest.fixture
def launches(monkeypatch):
    """(program, blocks, batch tiles) of every persistent launch (not the step loop's fallback)."""
    return record_launches(monkeypatch, lambda loop, chosen, _: (loop.program.name, chosen.blocks, chosen.tiles))


def check(length: int, batch: int, hidden: int, dtype=torch.float32, device: str = "cpu", seed: int = 0,
          tol: float = FP32_TOL, grad_tol: float = FP32_GRAD_TOL) -> None:
    """The LayerNorm LSTM's call in `dtype` (inputs rounded to it) against the interpreter's float64 on the same
    rounded values: outputs and final states within `tol`, every gradient (x, W, U, gamma, beta, gamma_c,
    beta_c, h0, c0; `ssmc.grad`, cotangents rounded too) within `grad_tol` (max |got - want| / max |want|)."""
    m = layernorm_lstm
    rng = np.random.default_rng(seed)
    names = check_rounded(m.SPEC, m.LAYOUT, m.make_inputs(rng, length, batch, 6, hidden), rng, device, dtype, tol,
                          grad_tol, context=(length, batch, hidden))
    assert names == {"x", "W", "U", "gamma", "beta", "gamma_c", "beta_c", "h", "c"}


PROGRAMS = {"layernorm_lstm", "layernorm_lstm_recording", "layernorm_lstm_backward"}


def _ran_all(launches, blocks: int, tiles: int = 1) -> None:
    """The forward, the recording forward and the adjoint each launched the persistent kernel, over `blocks`."""
    assert {name for name, _, _ in launches} == PROGRAMS, launches
    assert {(b, t) for _, b, t in launches} == {(blocks, tiles)}, launches


# (blocks, batch, hidden): the units in one block; spread over 3 (5, 5 and 3 units: the last block partial)
SPLITS = [(1, 1, 5), (1, 3, 6), (3, 3, 13), (3, 1, 13)]


def _cases(splits) -> list:
    """(length, blocks, batch, hidden) of `splits` at L 1, 7 and 65; over several blocks L 65 nightly (its steps
    launched one by one, 2 + levels times each: about 2 minutes a case)."""
    return [nightly_case(length, *split, reason="several blocks at L 65") if length == 65 and split[0] > 1
            else (length, *split) for length in (1, 7, 65) for split in splits]


@pytest.mark.parametrize("length,blocks,batch,hidden", _cases(SPLITS))
def test_emulated_fp32(length, blocks, batch, hidden, emulated_cuda, launches, monkeypatch):
    monkeypatch.setattr(persistent_runner, "EMULATED_BLOCKS", blocks if blocks > 1 else None)
    check(length, batch, hidden)
    _ran_all(launches, blocks)


def test_emulated_batch_tiles(emulated_cuda, launches, monkeypatch):
    """Two batch tiles (of 2 rows, then 1) of 3 blocks each: a tile's blocks exchange among themselves only."""
    monkeypatch.setattr(persistent_runner, "EMULATED_BLOCKS", 6)
    monkeypatch.setattr(analysis, "MIN_TF32_TILE_ROWS", 1)
    check(7, 3, 13)
    _ran_all(launches, 6, tiles=2)


@pytest.mark.parametrize("length,blocks,batch,hidden", _cases([(1, 3, 6), (3, 3, 13), (3, 1, 13)]))
def test_emulated_bf16(length, blocks, batch, hidden, emulated_cuda, launches, monkeypatch):
    """bf16 inputs: the tensor-core form (U and the operand in bf16 on chip; the cell, its reductions and the
    carries fp32)."""
    monkeypatch.setattr(persistent_runner, "EMULATED_BLOCKS", blocks if blocks > 1 else None)
    check(length, batch, hidden, dtype=torch.bfloat16, tol=BF16_TOL,
          grad_tol=BF16_GRAD_TOL if length < 65 else BF16_LONG_GRAD_TOL)
    _ran_all(launches, blocks)


def test_emulated_the_tolerance_can_fail(emulated_cuda, launches, monkeypatch):
    """A wrong exchange (every block's own sums taken for the row's: the other blocks' units left out) fails
    the fp32 check: the split tests above would see a missing exchange."""
    monkeypatch.setattr(persistent_runner, "EMULATED_BLOCKS", 3)
    monkeypatch.setattr(persistent_runner, "_LOOPS", {})  # runners whose sources no earlier test printed
    original = persistent_runner.kernel_source

    def broken(*a, **k):
        source = original(*a, **k)
        return source.replace("for (int b = 1; b < NBT; ++b) {", "for (int b = 1; b < 1; ++b) {")
    monkeypatch.setattr(persistent_runner, "kernel_source", broken)
    with pytest.raises(AssertionError):
        check(1, 3, 13)


# -- GPU ------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("batch,hidden", [(16, 256), (64, 512)])
def test_gpu_fp32(batch, hidden, launches, monkeypatch):
    """L 180 on the GPU, 3xTF32 (SSMC_CUDA_TF32=0): many blocks a tile, the grid barriers of the exchanges; outputs
    and every gradient against the float64 interpreter; no barrier timed out."""
    monkeypatch.setenv("SSMC_CUDA_TF32", "0")
    check(180, batch, hidden, device="cuda", tol=1e-4, grad_tol=1e-3)
    names = {name for name, _, _ in launches}  # (the gradient's forward: recording the carries, or its carries)
    assert {"layernorm_lstm", "layernorm_lstm_backward"} <= names, launches
    assert names & {"layernorm_lstm_recording", "layernorm_lstm_carries"}, launches
    assert all(b // t > 1 for _, b, t in launches), launches
    no_barrier_timed_out()


@pytest.mark.parametrize("blocks,hidden", [(1, 5), (3, 13)])
def test_emulated_peephole(blocks, hidden, emulated_cuda, launches, monkeypatch):
    """The peephole LSTM through the persistent kernels (forward, recording forward, adjoint) against the
    interpreter: outputs, final states and every gradient (p's included)."""
    monkeypatch.setattr(persistent_runner, "EMULATED_BLOCKS", blocks if blocks > 1 else None)
    rng = np.random.default_rng(0)
    b, length, i, k = 3, 7, 4, hidden
    inputs = {"x": rng.standard_normal((b, length, i)), "W": rng.uniform(-0.5, 0.5, (i, 4, k)),
              "U": rng.uniform(-0.5, 0.5, (k, 4, k)), "bias": rng.uniform(-0.5, 0.5, (4, k)),
              "p": rng.uniform(-0.5, 0.5, (3, k)), "h": rng.standard_normal((b, k)), "c": rng.standard_normal((b, k))}
    assert "p" in check_fp32(peephole_lstm, "b t ...", inputs, rng, FP32_TOL, FP32_GRAD_TOL)
    names = {name for name, _, _ in launches}  # (the gradient's forward: its carries, or recording them)
    assert names - {"peephole_lstm_carries", "peephole_lstm_recording"} == {"peephole_lstm", "peephole_lstm_backward"}
    assert len(names) == 3, launches
    assert {bl for _, bl, _ in launches} == {blocks}


@ssmc.recurrence
def softmax_cell(h: ssmc.State["b k"], x: ssmc.Seq["b k"], U: ssmc.Param["j k"]):
    """A softmax across the units: a max over them, then a sum (forward); the adjoint sums over them too."""
    h = ssmc.softmax(x + ssmc.dot(h.rename(k="j"), U, over="j"), "k")
    return h, h


@pytest.mark.parametrize("blocks", [1, 3])
def test_emulated_softmax_across_the_units(blocks, emulated_cuda, launches, monkeypatch):
    """A max and a sum over the units in the forward's cell (2 levels), 2 levels of sums in its adjoint: the
    forward, the carries' forward and the adjoint persistent, over 1 and 3 blocks, against the interpreter."""
    assert [len(s) for s in analyse(_core(softmax_cell.program)).phases] == [0, 2]
    assert [len(s) for s in analyse(_core(derive_backward(softmax_cell.program).adjoint)).phases] == [2, 0]
    monkeypatch.setattr(persistent_runner, "EMULATED_BLOCKS", blocks if blocks > 1 else None)
    rng = np.random.default_rng(0)
    b, length, k = 3, 5, 13
    inputs = {"x": rng.standard_normal((b, length, k)), "U": rng.standard_normal((k, k)),
              "h": rng.standard_normal((b, k))}
    check_fp32(softmax_cell, "b t ...", inputs, rng, FP32_TOL, FP32_GRAD_TOL)
    names = {name for name, _, _ in launches}
    assert {"softmax_cell", "softmax_cell_backward"} <= names and len(names) == 3, launches
    assert {bl for _, bl, _ in launches} == {blocks}

"""The persistent forward of recurrences with a recurrent product (backends/cuda/kernels/persistent/):
which programs and shapes it takes and why not others; its kernel through NVRTC for sm_80 and sm_90
(registers, shared memory, no spills); one emulated block on the CPU against the interpreter
(indexing and the printed cell; the grid barrier is compiled out there); the switch back to the step
loop; on a GPU, LSTM and GRU at odd sizes and L = 1, 7, 180 against the interpreter."""

from __future__ import annotations

import numpy as np
import pytest
from persistent_helpers import (
    adjoint_program,
    check_fp32,
    flat,
    forward_program,
    no_barrier_timed_out,
    one_step_blocks,
    one_step_inputs,
    one_step_reference,
    relative,
)
from profiles import in_ci

import ssmc
from ssmc.backends.cuda.kernels.persistent import analysis
from ssmc.backends.cuda.kernels.persistent import runner as persistent_runner
from ssmc.backends.cuda.kernels.persistent.analysis import BLOCK_SHARED, Cell, analyse, plan
from ssmc.backends.cuda.kernels.persistent.forward import kernel_name, kernel_source
from ssmc.examples import gru, layernorm_lstm, lstm, lstm_heads, slstm

pytest.importorskip("torch")


@ssmc.recurrence
def elman(h: ssmc.State["b k"], x: ssmc.Seq["b k"], U: ssmc.Param["j k"], V: ssmc.Param["k o"]):
    """A product of the new state after the step (y = h V: hoisted out of the loop, after it)."""
    h = ssmc.tanh(x + ssmc.dot(h.rename(k="j"), U, over="j"))
    y = ssmc.dot(h, V, over="k")
    return h, y


@ssmc.recurrence
def two(h: ssmc.State["b k"], x: ssmc.Seq["b k"], U1: ssmc.Param["j k"], U2: ssmc.Param["j k"]):
    """Two recurrent products of h (not fused yet: refused)."""
    hj = h.rename(k="j")
    h = ssmc.tanh(x + ssmc.dot(hj, U1, over="j")) * ssmc.sigmoid(ssmc.dot(hj, U2, over="j"))
    return h, h


@ssmc.recurrence
def swap(h: ssmc.State["b k"], c: ssmc.State["b k"], x: ssmc.Seq["b k"], U: ssmc.Param["j k"]):
    """The product reads the second state, the states trade places, the output is the old carry."""
    new_h = ssmc.tanh(x + ssmc.dot(c.rename(k="j"), U, over="j"))
    return (c, new_h), h


@ssmc.recurrence
def gated(h: ssmc.State["b k"], x: ssmc.Seq["b k"], U: ssmc.Param["j k"], bias: ssmc.Param["k"]):
    """No gate axis, a comparison and a select in the cell."""
    z = x + ssmc.dot(h.rename(k="j"), U, over="j") + bias
    h = ssmc.where(z > 0.0, ssmc.tanh(z), 0.5 * ssmc.sigmoid(z))
    return h, h


@ssmc.recurrence
def row_mean(h: ssmc.State["b k"], x: ssmc.Seq["b k"], U: ssmc.Param["j k"]):
    """The batch's mean in the cell (a sum across the rows, which batch tiles split: refused)."""
    z = x + ssmc.dot(h.rename(k="j"), U, over="j")
    h = ssmc.tanh(z - ssmc.mean(z, "b"))
    return h, h


def _recurrent(rng, hidden: int):
    """A recurrent matrix of spectral radius about 0.8: a larger one makes the recurrence chaotic, where
    float32 and float64 loops part after a few steps whatever the kernel (0.4 x N(0, 1) at hidden 512
    has radius 9: NumPy's own float32 loop is then off by 1e-3 after 7 steps, by 100% after 180)."""
    return 0.8 / np.sqrt(hidden) * rng.standard_normal((hidden, hidden))


def _elman_inputs(rng, length: int, batch: int = 3, hidden: int = 5) -> dict:
    return {"x": rng.standard_normal((batch, length, hidden)), "U": _recurrent(rng, hidden),
            "V": rng.standard_normal((hidden, 3)), "h": 0.5 * rng.standard_normal((batch, hidden))}


@ssmc.recurrence
def two_rows(h: ssmc.State["b d k"], x: ssmc.Seq["b d k"], U: ssmc.Param["j k"], a: ssmc.Param["d k"]):
    """Two row axes (b, d) sharing one U: the rows flattened in the kernel."""
    h = ssmc.tanh(x + a * ssmc.dot(h.rename(k="j"), U, over="j"))
    return h, h


def _two_rows_inputs(rng, length: int, batch: int = 3, hidden: int = 5) -> dict:
    return {"x": rng.standard_normal((batch, length, 2, hidden)), "U": _recurrent(rng, hidden),
            "a": rng.standard_normal((2, hidden)), "h": rng.standard_normal((batch, 2, hidden))}


def _swap_inputs(rng, length: int, batch: int = 3, hidden: int = 5) -> dict:
    return {"x": rng.standard_normal((batch, length, hidden)), "U": _recurrent(rng, hidden),
            "h": rng.standard_normal((batch, hidden)), "c": rng.standard_normal((batch, hidden))}


def _gated_inputs(rng, length: int, batch: int = 3, hidden: int = 5) -> dict:
    return {"x": rng.standard_normal((batch, length, hidden)), "U": _recurrent(rng, hidden),
            "bias": 0.1 * rng.standard_normal(hidden), "h": rng.standard_normal((batch, hidden))}


CASES = {
    "lstm": (lstm.SPEC, lstm.LAYOUT, lambda rng, L, b, k: lstm.make_inputs(rng, L, batch=b, inp=4, hidden=k)),
    "gru": (gru.SPEC, gru.LAYOUT, lambda rng, L, b, k: gru.make_inputs(rng, L, batch=b, inp=4, hidden=k)),
    # xLSTM's sLSTM: exponential gates and a stabiliser state (a max), four states
    "slstm": (slstm.SPEC, slstm.LAYOUT, lambda rng, L, b, k: slstm.make_inputs(rng, L, batch=b, inp=4, hidden=k)),
    "elman": (elman, "b t ...", _elman_inputs),
    "swap": (swap, "b t ...", _swap_inputs),
    "two_rows": (two_rows, "b t ...", _two_rows_inputs),
    "gated": (gated, "b t ...", _gated_inputs),
}


def _check(name: str, length: int, batch: int, hidden: int, tol: float, seed: int = 0, grads: bool = False):
    """`name`'s float32 call against the interpreter's float64: outputs and final states within `tol`, with `grads`
    every gradient within 10 `tol`."""
    spec, layout, make = CASES[name]
    rng = np.random.default_rng(seed)
    check_fp32(spec, layout, make(rng, length, batch, hidden), rng, tol, 10 * tol if grads else None,
               context=(name, length, batch, hidden))


# -- which programs and shapes ----------------------------------------------------------------------------------------

def test_lstm_and_gru_fit():
    for spec, cols in ((lstm.SPEC, 4), (gru.SPEC, 3)):
        cell = analyse(forward_program(spec))
        assert isinstance(cell, Cell), cell
        assert (cell.state, cell.weight, cell.contracted, cell.split, cell.rows, cell.local) == (
            "h", "U", ("j",), "k", ("b",), ("g",))
        chosen = plan(cell, {"b": 64, "k": 512, "j": 512, "g": cols, "i": 512}, 132)
        # 4 batch tiles of 16 rows, each 32 blocks of 16 units (a 128 KiB U slice a block)
        assert (chosen.blocks, chosen.tiles, chosen.units, chosen.threads, chosen.pairs) == (128, 4, 16, 256, 1)
        assert chosen.shared_bytes <= BLOCK_SHARED
    # GRU's three gates padded to four in shared memory (one 16-byte load a contracted index) where
    # that fits; at H 1400 it does not, and the unpadded slice still does
    gru_cell = analyse(forward_program(gru.SPEC))
    assert plan(gru_cell, {"b": 64, "k": 512, "j": 512, "g": 3}, 132).cpad == 4
    wide = plan(gru_cell, {"b": 64, "k": 1400, "j": 1400, "g": 3}, 132)
    assert wide.cpad == 3 and wide.shared_bytes <= BLOCK_SHARED
    assert isinstance(analyse(forward_program(swap)), Cell) and analyse(forward_program(swap)).state == "c"
    assert isinstance(analyse(forward_program(elman)), Cell)
    assert isinstance(analyse(forward_program(gated)), Cell)


def test_refusals_say_why():
    # LayerNorm across the units: sums over the units in the cell (tests/test_persistent_layernorm.py); across the
    # rows, refused
    assert isinstance(analyse(forward_program(layernorm_lstm.SPEC)), Cell)
    assert "sum over b" in analyse(forward_program(row_mean))
    assert "2 recurrent products" in analyse(forward_program(two))            # h U1 and h U2
    cell = analyse(forward_program(lstm.SPEC))
    too_wide = plan(cell, {"b": 64, "k": 2048, "j": 2048, "g": 4}, 132)
    assert isinstance(too_wide, str) and "exceed" in too_wide
    too_many_rows = plan(cell, {"b": 5000, "k": 64, "j": 64, "g": 4}, 132)
    assert isinstance(too_many_rows, str) and "rows" in too_many_rows


# -- NVRTC ----------------------------------------------------------------------------------------------------------

SHAPES = [("lstm", {"b": 64, "k": 512, "j": 512, "g": 4}), ("gru", {"b": 64, "k": 512, "j": 512, "g": 3}),
          ("lstm", {"b": 5, "k": 37, "j": 37, "g": 4}), ("gru", {"b": 7, "k": 129, "j": 129, "g": 3}),
          ("lstm", {"b": 256, "k": 256, "j": 256, "g": 4}), ("gated", {"b": 3, "k": 700, "j": 700})]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name,sizes", SHAPES)
def test_nvrtc_compiles_without_spills(name, sizes, arch):
    compiles_without_spills(forward_program(CASES[name][0]), sizes, arch)


def compiles_without_spills(program, sizes: dict[str, int], arch: str):
    """`program`'s persistent kernel at `sizes`, through NVRTC for `arch`: a plan, no spills, no stack
    frame, at most 255 registers, all its shared memory dynamic and within a block's."""
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.source import compile_options

    if not nvrtc.available():
        pytest.skip(nvrtc.unavailable_reason())
    cell = analyse(program)
    chosen = plan(cell, sizes, 132)
    assert not isinstance(chosen, str), chosen
    source = kernel_source(cell, chosen, sizes)
    built = nvrtc.compile_source(source, arch, compile_options(source))
    used = built.resources[kernel_name(cell)]
    assert not used.spills and used.stack_frame_bytes == 0, used.summary()
    assert used.registers <= 255, used.summary()
    assert used.shared_bytes == 0 and chosen.shared_bytes <= BLOCK_SHARED, used.summary()  # all dynamic


# -- emulated: one block on the CPU ----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("length", [1, 7])
def test_emulated_matches_the_interpreter(name, length, emulated_cuda, launched):
    _check(name, length, batch=3, hidden=5, tol=1e-5)
    assert launched, "the persistent kernel did not run"


def test_emulated_more_pairs_than_threads(emulated_cuda, launched):
    """B 37 x H 9 = 333 (row, unit) pairs over 256 threads: two pairs a thread, the second partial."""
    _check("lstm", 5, batch=37, hidden=9, tol=1e-5)
    assert launched == ["lstm"]


def test_emulated_gradients(emulated_cuda, launched):
    """`ssmc.grad` through the persistent kernel: the recording forward, the carries' recompute and the
    adjoint (tests/test_persistent_backward.py) run it."""
    _check("lstm", 6, batch=3, hidden=5, tol=1e-5, grads=True)
    assert "lstm" in launched and "lstm_backward" in launched


def test_a_shape_that_does_not_fit_runs_the_step_loop(emulated_cuda, launched):
    """One emulated block holds all of U: at H 128 (256 KiB of LSTM weights) it does not fit in the
    227 KiB of shared memory a block, and the call runs as the step loop with the reason kept."""
    _check("lstm", 3, batch=2, hidden=128, tol=1e-5)
    assert launched == []
    refusals = [r for loop in persistent_runner._LOOPS.values() if loop is not None for r in loop.refusals.values()]
    assert any("exceed" in r for r in refusals), refusals


def test_switched_off_runs_the_step_loop(emulated_cuda, launched):
    emulated_cuda.setenv("SSMC_CUDA_PERSISTENT", "0")
    _check("gru", 4, batch=3, hidden=5, tol=1e-5)
    assert launched == []


def test_a_barrier_that_timed_out_raises_at_the_next_call(emulated_cuda, launched):
    """A grid barrier that waited past its limit flags bar[1] (and the step in bar[2]) and goes on: the
    runner reads the flag behind the launch and raises BarrierTimeout at the loop's next call, naming the
    step (here the flag is set by hand on the launch's kept barrier words; the emulator has no barrier)."""
    _check("lstm", 3, batch=2, hidden=5, tol=1e-5)
    loops = [loop for loop in persistent_runner._LOOPS.values()
             if loop is not None and loop.program.name == "lstm" and loop._pending is not None]
    assert launched == ["lstm"] and len(loops) == 1
    words = loops[0]._pending[1]
    words[1], words[2] = 1, 2
    with pytest.raises(persistent_runner.BarrierTimeout, match="timed out at step 2 of an earlier call"):
        _check("lstm", 3, batch=2, hidden=5, tol=1e-5)
    _check("lstm", 3, batch=2, hidden=5, tol=1e-5)  # reported once: the calls after it run


# -- the split of the contracted indices (tensor-core form) -----------------------------------------------------

def test_the_bf16_adjoint_at_h1024_splits_its_contracted_indices():
    """LSTM B256 H1024's adjoint (dh = dz U^T, 4096 contracted indices) in the tensor-core form: a tile's 64
    blocks as 4 K groups x 16 J groups (each block stages a quarter of dz's indices: 32 MiB of L2 a step plus
    8 of fp32 partials, not 128); the forward (1024 indices) is not split; small shapes are not."""
    sizes = {"b": 256, "k": 1024, "j": 1024, "g": 4, "i": 1024}
    adjoint = plan(analyse(adjoint_program(lstm.SPEC)), sizes, 132, mma=True)
    assert (adjoint.ksplit, adjoint.jsplit, adjoint.tiles, adjoint.units, adjoint.nunits) == (4, 16, 2, 16, 64)
    assert adjoint.step_bytes == (32 + 8) << 20 and adjoint.shared_bytes <= BLOCK_SHARED
    unsplit = plan(analyse(adjoint_program(lstm.SPEC)), sizes, 132, mma=True, ksplit=1)
    assert unsplit.step_bytes == 128 << 20
    assert plan(analyse(forward_program(lstm.SPEC)), sizes, 132, mma=True).ksplit == 1
    small = {"b": 64, "k": 512, "j": 512, "g": 4, "i": 512}
    assert plan(analyse(adjoint_program(lstm.SPEC)), small, 132, mma=True).ksplit == 1


_NOT_IN_CI = pytest.mark.skipif(in_ci(), reason="CI splits the LSTM's adjoint (the form the plan takes; the "
                                                "forward and the heads have the same code path)")


@pytest.mark.parametrize("case", ["adjoint", pytest.param("forward", marks=_NOT_IN_CI),
                                  pytest.param("heads adjoint", marks=_NOT_IN_CI)])
def test_emulated_split_matches_the_interpreter(case):
    """The split (2 K groups x 2 J groups; H 13 over 4 blocks of 4 units, 3 pad units in the last J group; the
    partials summed 4 units a 16-byte load; with heads, 2 x 2 blocks a head) against the interpreter at L 1,
    within bf16's rounding (a wrong index or group is off by O(1)); outside CI also against the same blocks
    unsplit (the same bf16 operand and U, only the fp32 sums in another order)."""
    spec = lstm_heads.SPEC if case.startswith("heads") else lstm.SPEC
    program = forward_program(spec) if case == "forward" else adjoint_program(spec)
    sizes = {"b": 3, "n": 2, "k": 13, "j": 13, "g": 4, "i": 4}
    blocks = 8 if case.startswith("heads") else 4
    inputs = one_step_inputs(program, sizes, np.random.default_rng(0))
    split = one_step_blocks(program, sizes, blocks, 2, inputs)
    for a, b in zip(flat(split), one_step_reference(program, sizes, inputs), strict=True):
        assert relative(a, np.asarray(b, np.float64)) < 1e-2
    if not in_ci():
        for a, b in zip(flat(split), flat(one_step_blocks(program, sizes, blocks, 1, inputs)), strict=True):
            assert relative(a, b) < 1e-5


@pytest.mark.parametrize("case", ["adjoint", pytest.param("forward", marks=_NOT_IN_CI)])
def test_emulated_split_with_the_options(case):
    """The split blocks of test_emulated_split_matches_the_interpreter with every option of the persistent
    kernel on (the late stores with the reloaded index and the early loads, the prefetch, the phases' counters):
    the same values
    as without them, within the fp32 sums' order (the operand, U and the order of the sums are the same)."""
    program = forward_program(lstm.SPEC) if case == "forward" else adjoint_program(lstm.SPEC)
    sizes = {"b": 3, "k": 13, "j": 13, "g": 4, "i": 4}
    inputs = one_step_inputs(program, sizes, np.random.default_rng(1))
    options = {"late": True, "reload": True, "prefetch": True, "phases": True, "early_loads": True}
    got = one_step_blocks(program, sizes, 4, 2, inputs, **options)
    for a, b in zip(flat(got), flat(one_step_blocks(program, sizes, 4, 2, inputs)), strict=True):
        assert relative(a, b) < 1e-6


# -- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["lstm", "gru", "elman", "swap", "gated", "two_rows"])
@pytest.mark.parametrize("length", [1, 7, 180])
@pytest.mark.parametrize("batch,hidden", [(5, 37), (3, 129), (64, 512)])
def test_gpu(name, length, batch, hidden, launched, monkeypatch):
    """Many blocks and the grid barrier: H 37 (37 blocks of one unit), 129, 512 (128 blocks of 4, 4 batch
    tiles); a block for every pair allowed (MIN_BLOCK_PAIRS 1: by default these small shapes take 1 and 3
    blocks, and the barrier is what this tests)."""
    monkeypatch.setattr(analysis, "MIN_BLOCK_PAIRS", 1)
    for seed in (0, 1):
        _check(name, length, batch, hidden, tol=1e-4, seed=seed)
    assert launched, "the persistent kernel did not run (a refusal: see PersistentLoop.refusals)"
    no_barrier_timed_out()


@pytest.mark.gpu
def test_gpu_too_wide_streams_or_falls_back(launched, monkeypatch):
    """LSTM H 2100: the U slices (16 units x 4 gates x 2100, 525 KiB) exceed a block's shared memory: U is
    streamed (tests/test_persistent_streamed.py); on fp32 FMAs, which have no streamed form, the step loop runs.
    Same results both ways."""
    _check("lstm", 7, batch=3, hidden=2100, tol=1e-4)
    assert launched == ["lstm"]
    launched.clear()
    monkeypatch.setenv("SSMC_CUDA_PERSISTENT_MMA", "0")
    monkeypatch.setattr(persistent_runner, "_LOOPS", {})
    _check("lstm", 7, batch=3, hidden=2100, tol=1e-4)
    assert launched == []


@pytest.mark.gpu
def test_gpu_gradients(launched):
    _check("lstm", 40, batch=5, hidden=37, tol=1e-4, grads=True)
    assert "lstm" in launched


@pytest.mark.gpu
@pytest.mark.parametrize("length,batch,hidden", [(180, 5, 37), (7, 3, 129)])
def test_gpu_slstm(length, batch, hidden, launched, monkeypatch):
    """sLSTM's exponential gating with its stabiliser over many blocks, forward and every gradient."""
    monkeypatch.setattr(analysis, "MIN_BLOCK_PAIRS", 1)
    _check("slstm", length, batch, hidden, tol=1e-4, grads=True)
    assert {"slstm", "slstm_backward"} <= set(launched), launched


@pytest.mark.gpu
@pytest.mark.parametrize("ksplit", [2, 4])
@pytest.mark.parametrize("length,batch,hidden", [(1, 5, 37), (7, 3, 129), (180, 5, 37), (7, 19, 700)])
def test_gpu_bf16_split_adjoint(ksplit, length, batch, hidden, launched, monkeypatch):
    """The adjoint's contracted indices in `ksplit` K groups (forced at every size, a block for every pair
    allowed, so the odd shapes take many blocks: H 37 as 40 blocks of one unit in 4 K groups, a pad unit in
    three of them), both barriers a step and the partials' parity buffers over 180 steps: bf16 gradients
    against the interpreter (tests/test_persistent_half.py's bounds)."""
    from test_persistent_half import check_half

    monkeypatch.setattr(analysis, "SPLIT_BYTES", 0)
    monkeypatch.setattr(analysis, "SPLITS", (ksplit,))
    monkeypatch.setattr(analysis, "MIN_BLOCK_PAIRS", 1)
    check_half("lstm", length, batch, hidden, device="cuda")
    split = [p for loop in persistent_runner._LOOPS.values()
             if loop is not None and loop.program.name == "lstm_backward"
             for p in loop._plans.values() if not isinstance(p, str) and p.ksplit == ksplit]
    assert split and "lstm_backward" in launched, "the split adjoint did not run"
    no_barrier_timed_out()

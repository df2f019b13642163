"""The adjoint of a recurrence with a recurrent product on the persistent kernel
(backends/cuda/kernels/persistent/): its product reads the cotangent dz, not a renamed state,

    grad_h[b, k] = sum over g, k' of dz[g, b, k'] U[k, g, k']     (+ the cell's local terms)

so each block owns a slice of the output units, keeps U[its units, all g, all k'] in shared memory,
publishes dz of its own units each step and reads every block's. Which adjoints fit and why others
do not; the kernels through NVRTC (sm_80, sm_90, no spills); `ssmc.grad` with one emulated block on
the CPU against the interpreter's gradients, the adjoint counted as a persistent launch; on a GPU,
the same at L 1, 7, 180 with many blocks and the grid barrier."""

from __future__ import annotations

import numpy as np
import pytest
from persistent_helpers import (
    adjoint_program,
    flat,
    forward_program,
    no_barrier_timed_out,
    one_step_arrays,
    one_step_inputs,
    one_step_reference,
    relative,
)
from profiles import nightly_case
from test_persistent_rnn import CASES, compiles_without_spills, two

import ssmc
from ssmc.backends.cuda.kernels.persistent import analysis
from ssmc.backends.cuda.kernels.persistent.analysis import BLOCK_SHARED, Cell, analyse, plan
from ssmc.backends.cuda.kernels.persistent.forward import kernel_name, kernel_source
from ssmc.examples import layernorm_lstm
from ssmc.lowering.hoist import hoist
from ssmc.passes.autodiff import derive_backward

pytest.importorskip("torch")


def _check_grads(name: str, length: int, batch: int, hidden: int, tol: float, seed: int = 0):
    """`ssmc.grad` on the CUDA backend against the interpreter's (float64) for every input."""
    spec, layout, make = CASES[name]
    rng = np.random.default_rng(seed)
    inputs = make(rng, length, batch, hidden)
    outs = ssmc.compile(spec, layout=layout, backend="interpreter")(**inputs)
    cot = rng.standard_normal(np.shape(outs))
    want = ssmc.grad(spec, backend="interpreter", layout=layout)(**inputs, grad_outputs=cot)
    have = ssmc.grad(spec, backend="cuda", layout=layout, dtype="float32")(**inputs, grad_outputs=cot)
    assert set(have) == set(want)
    for k in want:
        (a,), (b,) = flat(have[k]), flat(want[k])
        assert relative(a, b) < tol, (name, k, length, batch, hidden, relative(a, b))


# -- which adjoints ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,gates", [("lstm", 4), ("gru", 3), ("elman", 1), ("swap", 1), ("gated", 1)])
def test_adjoints_fit(name, gates):
    cell = analyse(adjoint_program(CASES[name][0]))
    assert isinstance(cell, Cell), cell
    local = ("g",) if gates > 1 else ()
    assert (cell.weight, cell.split, cell.unit, cell.out_unit, cell.rows, cell.cols, cell.op_local) == (
        "U", "k", "k", "j", ("b",), (), local)
    assert set(cell.contracted) == {"k", *local}
    sizes = {"b": 64, "k": 512, "j": 512, "g": gates, "i": 512, "o": 3}
    chosen = plan(cell, sizes, 132)
    assert not isinstance(chosen, str), chosen
    # batch tiles: as many as the U slices fit (U spread over a tile's blocks; a block stages its tile's rows)
    tiles = 4 if gates == 4 else 8
    assert (chosen.blocks, chosen.tiles, chosen.trows, chosen.units, chosen.cols, chosen.depth, chosen.vec) == (
        128, tiles, 64 // tiles, 512 * tiles // 128, 1, gates * 512, True)
    assert chosen.shared_bytes <= BLOCK_SHARED


def test_adjoint_refusals_say_why():
    # LayerNorm across the units: sums over the units before the product (tests/test_persistent_layernorm.py)
    assert len(analyse(adjoint_program(layernorm_lstm.SPEC)).reductions) == 12
    assert "2 recurrent products" in analyse(adjoint_program(two))
    too_wide = plan(analyse(adjoint_program(CASES["lstm"][0])), {"b": 64, "k": 2048, "j": 2048, "g": 4}, 132)
    assert isinstance(too_wide, str) and "exceed" in too_wide
    # a row axis the weight's gradient sums over (grad a = sum over b of the loop's dz h U): the value written
    # every step, summed over the rows and time after the loop (`hoist`: the program has a recurrent product)
    two_rows = hoist(derive_backward(CASES["two_rows"][0].program).adjoint, transpose=False)
    assert isinstance(analyse(two_rows.program), Cell) and "grad_a" in dict(two_rows.post_accumulators)


# -- NVRTC ----------------------------------------------------------------------------------------------------------

SHAPES = [("lstm", {"b": 64, "k": 512, "j": 512, "g": 4}), ("gru", {"b": 64, "k": 512, "j": 512, "g": 3}),
          ("lstm", {"b": 5, "k": 37, "j": 37, "g": 4}), ("gru", {"b": 7, "k": 129, "j": 129, "g": 3}),
          ("elman", {"b": 3, "k": 700, "j": 700, "o": 3})]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name,sizes", SHAPES)
def test_nvrtc_compiles_without_spills(name, sizes, arch):
    compiles_without_spills(adjoint_program(CASES[name][0]), sizes, arch)


# -- emulated: one block on the CPU ----------------------------------------------------------------------

@pytest.mark.parametrize("name", ["lstm", "gru", "elman", "swap", "gated", "two_rows"])
@pytest.mark.parametrize("length", [1, 7])
def test_emulated_gradients(name, length, emulated_cuda, launched):
    _check_grads(name, length, batch=3, hidden=5, tol=1e-5)
    assert f"{name}_backward" in launched, launched


def test_emulated_gradients_more_pairs_than_threads(emulated_cuda, launched):
    """B 37 x H 9 = 333 (row, unit) pairs over 256 threads: two pairs a thread, the second partial."""
    _check_grads("lstm", 5, batch=37, hidden=9, tol=1e-5)
    assert "lstm_backward" in launched


def test_switched_off(emulated_cuda, launched):
    emulated_cuda.setenv("SSMC_CUDA_PERSISTENT", "0")
    _check_grads("gru", 4, batch=3, hidden=5, tol=1e-5)
    assert launched == []


# -- GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["lstm", "gru", "elman"])
@pytest.mark.parametrize("length", [1, 7, 180])
@pytest.mark.parametrize("batch,hidden", [(5, 37), (3, 129), (64, 512)])
def test_gpu_gradients(name, length, batch, hidden, launched, monkeypatch):
    """Many blocks and the grid barrier: H 37 (37 blocks of one unit), 129, 512 (128 blocks of 4; a block
    for every pair allowed, MIN_BLOCK_PAIRS 1, where small shapes take 1 and 3 by default). At
    L 180 the fp32 sums over steps (the adjoint's carries, dU = sum_t h dz) part further from float64;
    a wrong index parts by O(1)."""
    monkeypatch.setattr(analysis, "MIN_BLOCK_PAIRS", 1)
    _check_grads(name, length, batch, hidden, tol=1e-4 if length < 100 else 1e-3)
    assert f"{name}_backward" in launched, "the adjoint did not run persistent (see PersistentLoop.refusals)"
    no_barrier_timed_out()


# -- emulated: several blocks, one step -----------------------------------------------------------------------

# a case compiles its own kernel for the emulator: CI splits every way for the LSTM, two ways (blocks over
# batch tiles, a partial one at B 3; warps of 8 rows at B 16) for the GRU and Elman cells (their gates'
# count changes the units' layout, not the split)
BLOCK_SPLITS = [(2, 1, 3, 5), (3, 1, 3, 5), (4, 2, 3, 5), (6, 3, 3, 5), (2, 2, 16, 8), (4, 2, 16, 16)]


@pytest.mark.parametrize("blocks,tiles,batch,hidden,name,direction", [
    (*split, name, direction) if name == "lstm" or split in ((4, 2, 3, 5), (4, 2, 16, 16)) else nightly_case(
        *split, name, direction, reason="a split the LSTM's cases take (the gates change the units' layout)")
    for direction in ("forward", "adjoint") for name in ("lstm", "gru", "elman") for split in BLOCK_SPLITS])
def test_emulated_blocks_one_step(name, direction, blocks, tiles, batch, hidden):
    """The split over blocks (U slices, publish offsets, each block's units of the outputs) at L 1, and
    over batch tiles (each block's rows, a partial last tile at B 3, a warp of 8 rows x 4 units at B 16):
    the emulator runs blocks one after another with the grid barrier compiled out, so a first launch
    leaves every block's step-0 operand in xo (it reads only the initial carries and the step's
    sequences), and a second launch with the same xo computes the step from the complete operand."""
    import torch

    from ssmc.backends.cuda.emulator import emulated

    spec = CASES[name][0]
    program = forward_program(spec) if direction == "forward" else adjoint_program(spec)
    cell = analyse(program)
    assert isinstance(cell, Cell), cell
    gates = {"lstm": 4, "gru": 3, "elman": 1}[name]
    sizes = {"b": batch, "k": hidden, "j": hidden, "g": gates, "i": 4, "o": 3}
    chosen = plan(cell, sizes, 132, blocks=blocks, tiles=tiles)
    assert not isinstance(chosen, str) and (chosen.blocks, chosen.tiles) == (blocks, tiles), chosen
    inputs = one_step_inputs(program, sizes, np.random.default_rng(blocks))
    want = one_step_reference(program, sizes, inputs)
    arrays, outs, finals = one_step_arrays(program, sizes, inputs)
    xo = torch.full((2 * chosen.tiles * chosen.trows * chosen.jpad,), float("nan"))
    bar = torch.zeros(3 + chosen.tiles, dtype=torch.int32)
    arrays += [xo, bar]
    fn = emulated(kernel_source(cell, chosen, sizes), kernel_name(cell))
    for _ in range(2):
        fn((chosen.blocks, chosen.threads), 1, 0, [t.data_ptr() for t in arrays])
    names = [*(n for n, _ in program.outputs), *(s.name for s in program.states)]
    for what, got, w in zip(names, [*outs, *finals], want, strict=True):
        assert relative(got.double().numpy(), w) < 1e-5, what


# -- the training step: one recording forward, one adjoint ----------------------------------------------------

def test_training_step_keeps_every_carry():
    """A recurrence read through a recurrent product keeps every carry on the device (the chunk is the
    whole sequence): recomputing them would be a second sequential pass as long as the forward. Before,
    LSTM B64 L180 I512 H512 had chunks of 90 steps (carries no bigger than the inputs), so a training
    step ran the forward twice, the carries' recompute twice and the adjoint twice."""
    from ssmc.autograd import default_chunk
    from ssmc.examples import lstm, mamba1

    sizes = {"b": 64, "i": 512, "k": 512, "g": 4}
    assert default_chunk("cuda", 180, lstm.SPEC.program, sizes) == 180
    assert default_chunk("cuda", 100_000, lstm.SPEC.program, sizes) < 100_000   # within the budget
    # a scan's carries stay as before (no larger than its inputs)
    assert default_chunk("cuda", 2048, mamba1.SPEC.program, {"b": 8, "d": 1536, "n": 16}) < 2048


def test_emulated_training_step_launches(emulated_cuda, launched):
    """`ssmc.torch.function`'s training step of the LSTM, at a length the old rule cut into 3 chunks
    (B3 I4 H5 L200: 80 steps): one launch of the recording forward and one of the adjoint, no
    carries' recompute, no plain forward; the gradients as the interpreter's."""
    import torch

    import ssmc.torch
    from ssmc.examples import lstm

    rng = np.random.default_rng(0)
    length = 200
    inputs = lstm.make_inputs(rng, length, batch=3, inp=4, hidden=5)
    leaves = {k: torch.tensor(v, dtype=torch.float32, requires_grad=True) for k, v in inputs.items()}
    dy = rng.standard_normal((3, length, 5))
    fn = ssmc.torch.function(lstm.SPEC, "cuda", layout=lstm.LAYOUT)
    for _ in range(2):  # the first call of a signature, then one through its prepared step
        launched.clear()
        for v in leaves.values():
            v.grad = None
        with _CountedOps() as ops:
            fn(**leaves).backward(torch.tensor(dy, dtype=torch.float32))
        assert launched == ["lstm_recording", "lstm_backward"], launched
        # the matrix products: x W (the forward), dz W^T, x^T dz, h^T dz; not h U again (the forward
        # recorded its product); no copy of a sequence (the kernels write as the products read), nor of a
        # param (`SsmcFunction._own_host_params` copies them for the host backends only)
        assert ops.get("mm") == 4 and not ops.get("clone") and not ops.get("copy_"), ops
    want = ssmc.grad(lstm.SPEC, backend="interpreter", layout=lstm.LAYOUT)(**inputs, grad_outputs=dy)
    for k, w in want.items():
        assert relative(leaves[k].grad.double().numpy(), w) < 1e-5, k


class _CountedOps:
    """The aten ops run inside a `with` (name -> calls), through torch's dispatch."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counts: dict = {}

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__.split(".")[0]
                counts[name] = counts.get(name, 0) + 1
                return func(*args, **(kwargs or {}))
        self.mode = Mode()
        self.mode.__enter__()
        return counts

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

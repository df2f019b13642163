"""The persistent kernel's tensor-core form (backends/cuda/kernels/persistent/, `Plan.mma`): 16-bit
inputs keep U and each step's operand (h, or the adjoint's dz) in bf16 / fp16 on chip and multiply
them with mma.sync m16n8k16 into fp32 accumulators, the cell and its carries in fp32; heads (a
block-diagonal U, examples/lstm_heads.py) as batch tiles within one head; the grid of a small shape.

CPU: the plans at the benchmark shapes, NVRTC (sm_80, sm_90: no spills), one emulated block against
the interpreter (the emulator multiplies the mma fragments lane by lane: templates/ssmc_mma.cuh).
GPU: bf16 calls and their gradients against the interpreter (float64, on the bf16-rounded inputs) at
L = 1, 7, 180 and hidden sizes that are not multiples of the tiles."""

from __future__ import annotations

import numpy as np
import pytest
from persistent_helpers import (
    BF16_GRAD_TOL,
    BF16_TOL,
    adjoint_program,
    as_float64,
    check_fp32,
    check_rounded,
    forward_program,
    no_barrier_timed_out,
    record_launches,
    recording_program,
    relative,
    training_source,
)
from profiles import in_ci, nightly_case

import ssmc
from ssmc.backends.cuda.kernels.persistent import runner as persistent_runner
from ssmc.backends.cuda.kernels.persistent.analysis import BLOCK_SHARED, analyse, plan
from ssmc.backends.cuda.kernels.persistent.forward import kernel_name, kernel_source, warp_grid
from ssmc.examples import gru, lstm, lstm_heads
from ssmc.lowering.hoist import hoist
from ssmc.passes.autodiff import derive_backward

torch = pytest.importorskip("torch")

LSTM_BIG = {"b": 256, "k": 1024, "j": 1024, "g": 4, "i": 1024}
HEADS = {"b": 64, "n": 4, "k": 128, "j": 128, "g": 4, "i": 512}


# -- plans ------------------------------------------------------------------------------------------------------

def test_bf16_lstm_h1024_plans_on_tensor_cores():
    """B256 H1024: U in bf16 (8 MiB) spread over 128 blocks in 2 batch tiles of 128 rows, 16 units x 4
    gates a block (129 KiB); in fp32 only 1 tile fits (8 units a block, every block staging all 256 rows)."""
    for program, cols in ((forward_program(lstm.SPEC), 4), (adjoint_program(lstm.SPEC), 1)):
        cell = analyse(program)
        half = plan(cell, LSTM_BIG, 132, mma=True)
        assert not isinstance(half, str), half
        assert (half.mma, half.blocks, half.tiles, half.trows, half.units, half.cols) == (True, 128, 2, 128, 16, cols)
        assert half.shared_bytes <= BLOCK_SHARED and half.chunk % 16 == 0
        gm, gn, wm, wn = warp_grid(half)
        assert gm * gn <= half.threads // 32 and gm * wm * 16 >= half.mpad and gn * wn * 8 >= half.npad
        full = plan(cell, LSTM_BIG, 132)
        assert not full.mma and full.tiles == 1


def test_the_ring_options(monkeypatch):
    """SSMC_CUDA_PERSISTENT_FORWARD_CHUNK / _STAGES: the B256 H1024 forward's staging (by default 128 indices x 2
    buffers, all that fits beside U) as asked where it fits (a chunk alone: its deepest ring), the rule's ring
    where it does not; the adjoint keeps its own (32 x 8) unless _ADJOINT_CHUNK / _STAGES say."""
    forward, adjoint = analyse(forward_program(lstm.SPEC)), analyse(adjoint_program(lstm.SPEC))
    assert (plan(forward, LSTM_BIG, 132, mma=True).chunk, plan(forward, LSTM_BIG, 132, mma=True).stages) == (128, 2)
    for ring, want in (((64, None), (64, 5)), ((32, 3), (32, 3)), ((None, 3), (64, 3)), ((128, 3), (128, 2))):
        chosen = plan(forward, LSTM_BIG, 132, mma=True, ring=ring)
        assert (chosen.chunk, chosen.stages) == want and chosen.shared_bytes <= BLOCK_SHARED, (ring, chosen)
        assert (plan(adjoint, LSTM_BIG, 132, mma=True, ring=ring).chunk,
                plan(adjoint, LSTM_BIG, 132, mma=True, ring=ring).stages) == (32, 8)
    chosen = plan(adjoint, LSTM_BIG, 132, mma=True, ring=(64, None), deep_ring=(64, None))
    assert (chosen.chunk, chosen.stages, chosen.ksplit) == (64, 5, 4), chosen  # (SSMC_CUDA_PERSISTENT_ADJOINT_*)
    monkeypatch.setenv("SSMC_CUDA_PERSISTENT_FORWARD_CHUNK", "64")
    loop = persistent_runner.PersistentLoop(forward_program(lstm.SPEC), "float32", None, forward)
    assert loop.plan_for(LSTM_BIG, half=True).chunk == 64


def test_heads_take_the_persistent_kernel():
    """4 heads of 128: each head's tiles own its rows and its U slice (a block never spans two heads)."""
    for program in (forward_program(lstm_heads.SPEC), adjoint_program(lstm_heads.SPEC)):
        cell = analyse(program)
        assert not isinstance(cell, str), cell
        assert cell.heads == ("n",) and cell.rows[0] == "n"
        for mma in (False, True):
            chosen = plan(cell, HEADS, 132, mma=mma)
            assert not isinstance(chosen, str), chosen
            assert chosen.heads == 4 and chosen.tiles % 4 == 0 and 64 % (chosen.tiles // 4) == 0
            assert chosen.blocks <= 132 and chosen.xrows >= chosen.rows + chosen.trows


def test_small_shapes_take_fewer_fuller_blocks():
    """B16 H256 (4096 pairs): 32 blocks of 128 threads, not 128 of 32 (a barrier of fewer arrivals, the
    same work a thread); `max_blocks` (SSMC_CUDA_PERSISTENT_BLOCKS) caps the grid; a large shape keeps
    a block an SM."""
    cell = analyse(forward_program(lstm.SPEC))
    small = {"b": 16, "k": 256, "j": 256, "g": 4, "i": 128}
    chosen = plan(cell, small, 132)
    assert (chosen.blocks, chosen.threads, chosen.pairs) == (32, 128, 1)
    capped = plan(cell, small, 132, max_blocks=8)
    assert capped.blocks <= 8 and capped.pairs <= 8
    assert plan(cell, {"b": 64, "k": 512, "j": 512, "g": 4}, 132).blocks == 128


def test_inspect_names_the_persistent_split(monkeypatch):
    """`ssmc inspect`'s notes (report.path_notes) give the forward's and the adjoint's split at the sizes and
    dtype asked: the tensor-core form in bf16; in fp32 its 3xTF32 form, or the FMA form where
    SSMC_CUDA_PERSISTENT_MMA=0."""
    from ssmc.backends.cuda.report import path_notes

    sizes = {"b": 256, "i": 1024, "k": 1024}
    half = [line for line in path_notes(lstm.SPEC.program, sizes, 1024, "bfloat16") if line.startswith("persistent")]
    assert len(half) == 2 and all("tensor cores" in line and "2 batch tiles" in line for line in half), half
    monkeypatch.setenv("SSMC_CUDA_TF32", "0")
    full = [line for line in path_notes(lstm.SPEC.program, sizes, 1024) if line.startswith("persistent")]
    assert len(full) == 2 and all("3xTF32" in line for line in full), full
    monkeypatch.setenv("SSMC_CUDA_PERSISTENT_MMA", "0")
    fma = [line for line in path_notes(lstm.SPEC.program, sizes, 1024) if line.startswith("persistent")]
    assert len(fma) == 2 and not any("tensor cores" in line for line in fma), fma


def test_only_the_tensor_core_form_writes_in_16_bits():
    """dz (the adjoint's hf0, which only the post products read) is written in 16 bits where the plan is the
    tensor-core form and the call's inputs are 16-bit; the FMA form, an fp32 call and a forward (no such
    output) keep fp32; the kernel source refuses 16-bit outputs outside the tensor-core form."""
    program = adjoint_program(lstm.SPEC)
    cell = analyse(program)
    loop = persistent_runner.PersistentLoop(program, "float32", None, cell)
    orders = hoist(derive_backward(lstm.SPEC.program).adjoint, transpose=False).product_orders
    half, full = plan(cell, LSTM_BIG, 132, mma=True), plan(cell, LSTM_BIG, 132)
    assert loop.half_outputs(half, orders, torch.bfloat16) == {"hf0"}
    assert loop.half_outputs(full, orders, torch.bfloat16) == frozenset()
    assert loop.half_outputs(half, orders, None) == frozenset()
    fwd = forward_program(lstm.SPEC)
    forward = persistent_runner.PersistentLoop(fwd, "float32", None, analyse(fwd))
    assert forward.half_outputs(half, {}, torch.bfloat16) == frozenset()
    with pytest.raises(ValueError, match="tensor-core form"):
        kernel_source(cell, full, LSTM_BIG, half_outs=frozenset({"hf0"}))


# -- NVRTC ----------------------------------------------------------------------------------------------------

HALF_SHAPES = [("lstm", forward_program(lstm.SPEC), LSTM_BIG),
               ("lstm adjoint", adjoint_program(lstm.SPEC), LSTM_BIG),
               ("heads", forward_program(lstm_heads.SPEC), HEADS),
               ("heads adjoint", adjoint_program(lstm_heads.SPEC), HEADS),
               ("gru", forward_program(gru.SPEC), {"b": 64, "k": 512, "j": 512, "g": 3}),
               ("lstm odd", forward_program(lstm.SPEC), {"b": 5, "k": 129, "j": 129, "g": 4})]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name,program,sizes", HALF_SHAPES, ids=[s[0] for s in HALF_SHAPES])
def test_nvrtc_tensor_core_form_compiles_without_spills(name, program, sizes, arch):
    """The training step's kernels (`training_source`; the forward of a call that records nothing has the
    same code less the recording's stores)."""
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.source import compile_options

    if not nvrtc.available():
        pytest.skip(nvrtc.unavailable_reason())
    cell = analyse(program)
    chosen = plan(cell, sizes, 132, mma=True)
    assert not isinstance(chosen, str) and chosen.mma, chosen
    source = training_source(cell, chosen, sizes, half=True)
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16" in source
    assert ("H* __restrict__ o0" if program.reverse else "H* __restrict__ rp") in source
    used = nvrtc.compile_source(source, arch, compile_options(source)).resources[kernel_name(cell)]
    assert not used.spills and used.stack_frame_bytes == 0, used.summary()
    assert used.registers <= 255 and used.shared_bytes == 0, used.summary()


# the CudaOptions of the persistent kernel (kernel_source's arguments as the runner passes them: the late stores
# imply the reloaded index)
OPTIONS = {"late": {"late": True, "reload": True}, "early loads": {"late": True, "reload": True, "early_loads": True},
           "reload": {"reload": True}, "prefetch": {"prefetch": True}, "phases": {"phases": True}}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("option", ["early loads", *(nightly_case(o, reason="one option's build; CI builds the "
                                                                      "late stores with the early loads, the build "
                                                                      "nearest the registers' limit")
                                                     for o in ("late", "reload", "prefetch", "phases"))])
@pytest.mark.parametrize("name", ["recording", "adjoint"])
def test_nvrtc_options_compile_without_spills(name, option, arch):
    """The training step's kernels at B256 H1024 (the recording forward: y, the carries before the step and h U
    a step) with each option (OPTIONS): no spills (the late stores' adjoint
    keeps dz for its stores and dc's update across the barrier's arrival: 245 registers with the reloaded
    index, spills without it; the early loads' raw sequences, loaded by every pair: 245, 216 bytes of spills
    where the pairs that are off skipped them); the phases' counters are the only static shared memory (8
    clocks)."""
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.source import compile_options

    if not nvrtc.available():
        pytest.skip(nvrtc.unavailable_reason())
    cell = analyse(recording_program(lstm.SPEC) if name == "recording" else adjoint_program(lstm.SPEC))
    chosen = plan(cell, LSTM_BIG, 132, mma=True)
    source = training_source(cell, chosen, LSTM_BIG, half=True, **OPTIONS[option])
    used = nvrtc.compile_source(source, arch, compile_options(source)).resources[kernel_name(cell)]
    assert not used.spills and used.stack_frame_bytes == 0, used.summary()
    assert used.registers <= 255 and used.shared_bytes == (64 if option == "phases" else 0), used.summary()


# -- against the interpreter -----------------------------------------------------------------------------------

def _inputs(name: str, rng, length: int, batch: int, hidden: int) -> dict:
    if name == "heads":
        return lstm_heads.make_inputs(rng, length, batch=batch, inp=4, heads=3, hidden=hidden)
    module = {"lstm": lstm, "gru": gru}[name]
    return module.make_inputs(rng, length, batch=batch, inp=4, hidden=hidden)


SPECS = {"lstm": lstm, "gru": gru, "heads": lstm_heads}


def check_half(name: str, length: int, batch: int, hidden: int, device: str, grads: bool = True,
               dtype=torch.bfloat16, seed: int = 0) -> None:
    """`name`'s call in `dtype` (inputs rounded to it) against the interpreter's float64 on the same rounded
    values: outputs and final states within BF16_TOL, every gradient (`ssmc.grad`, cotangents rounded
    too) within BF16_GRAD_TOL."""
    m = SPECS[name]
    rng = np.random.default_rng(seed)
    check_rounded(m.SPEC, m.LAYOUT, _inputs(name, rng, length, batch, hidden), rng, device, dtype, BF16_TOL,
                  BF16_GRAD_TOL, grads=grads, context=(name, length, batch, hidden))


@pytest.fixture
def half_launches(monkeypatch):
    """(program, whether the tensor-core form) of every persistent launch."""
    return record_launches(monkeypatch, lambda loop, chosen, _: (loop.program.name, chosen.mma))


def _written(loop, chosen, result) -> tuple:
    outs, _, recorded = result
    dtypes = {name: o.dtype for (name, _), o in zip(loop.program.outputs, outs)}
    return loop.program.name, chosen.mma, dtypes, None if recorded is None else recorded.dtype


@pytest.fixture
def written(monkeypatch):
    """(program, whether the tensor-core form, {output: dtype of the array the launch wrote}, dtype of the
    recorded product or None) of every persistent launch."""
    return record_launches(monkeypatch, _written)


def test_emulated_bf16_lstm(emulated_cuda, half_launches, written):
    """One emulated block: the forward, the carries' recompute and the adjoint all in the tensor-core form
    (the gradient's path casts the inputs to fp32: runtime/precision.py keeps their dtype known). The adjoint
    writes dz (hf0: only the post products read it) in bf16, its other outputs none; the forward that records
    h U for the adjoint records it in bf16 (read as x W is), and writes its carries in fp32 (the adjoint's
    cell reads them)."""
    check_half("lstm", 7, batch=3, hidden=5, device="cpu")
    assert {name for name, mma in half_launches if mma} >= {"lstm", "lstm_backward"}, half_launches
    adjoint = [dtypes for name, mma, dtypes, _ in written if name == "lstm_backward"]
    assert adjoint == [{"hf0": torch.bfloat16}], written
    recorded = [(dtypes, rec) for name, _, dtypes, rec in written if name != "lstm_backward" and rec is not None]
    assert recorded and all(rec == torch.bfloat16 for _, rec in recorded), written
    assert all(d == torch.float32 for dtypes, _ in recorded for d in dtypes.values()), written


@pytest.mark.parametrize("names", ["late_stores,early_loads",
                                   nightly_case("late_stores", reason="the late stores without the early loads: CI "
                                                                      "runs them with"),
                                   nightly_case("prefetch,phases", reason="these two move no value")])
def test_emulated_bf16_lstm_options(names, emulated_cuda, half_launches, monkeypatch):
    """One emulated block with SSMC_CUDA_PERSISTENT_<names>: the recording forward (y and rp stored a step late,
    the carries at the publish) and the adjoint (dz stored at the publish, dc's update computed there) against
    the interpreter at L 7 (CI: 3), as test_emulated_bf16_lstm (the early loads: the adjoint's sequences of step s - 1
    loaded after step s's product); their sources built with the option."""
    for name in names.split(","):
        monkeypatch.setenv(f"SSMC_CUDA_PERSISTENT_{name.upper()}", "1")
    check_half("lstm", 3 if in_ci() else 7, batch=3, hidden=5, device="cpu")  # (L 3: a store late, a load early)
    assert {name for name, mma in half_launches if mma} >= {"lstm", "lstm_backward"}, half_launches
    macro = {"late_stores": "LATE", "prefetch": "PREFETCH", "phases": "PHASES", "early_loads": "NEXT_LOADS"}
    # (early loads: the forwards' cells read their sequences, so they keep the loads at a step's top)
    want = {name: [f"#define {macro[n]} {int(name == 'lstm_backward' or n != 'early_loads')}"
                   for n in names.split(",")] for name in ("lstm", "lstm_recording", "lstm_backward")}
    built = {loop.program.name for loop in persistent_runner._LOOPS.values() if loop is not None
             for key in loop._functions if loop.program.name in want
             and all(line in key[1] for line in want[loop.program.name])}
    assert "lstm_backward" in built and built & {"lstm", "lstm_recording"}, built
    if "phases" in names:  # (the emulator counts no clocks: the words are there, zero)
        loops = [loop for loop in persistent_runner._LOOPS.values() if loop is not None and loop._phase_at]
        assert loops and loops[0].phases() == [0.0] * 6


@pytest.mark.parametrize("spec", [lstm, lstm_heads], ids=["lstm", "heads"])
def test_post_products_of_a_16_bit_dz(spec):
    """The post products of the adjoint (`hoist.compute_post` through `TorchArrays(bf16)`, on the CPU) from a dz
    written in bf16: grad_W, grad_U (with heads a batched product, an einsum: the fp32 h cast as `pair` casts
    it, not multiplied with the bf16 dz as it is) and grad_x within bf16's rounding of float64 on the same dz,
    grad_x in fp32; grad_bias, the sum of dz over time and batch, accumulated and returned in fp32: within
    1e-5 of float64 (summed or returned in bf16 it is off by its rounding, about 1e-3)."""
    from ssmc.backends.cuda.hoisted import TorchArrays
    from ssmc.lowering.hoist import compute_post

    h = hoist(derive_backward(spec.SPEC.program).adjoint, transpose=False)
    sizes = {"b": 8, "n": 2, "k": 5, "j": 5, "g": 4, "i": 4}
    length, rng = 16, np.random.default_rng(0)
    seqs = {d.name: rng.standard_normal((length, *(sizes[a] for a in d.axes)))
            for d in h.original.decls if d.role.value == "seq"}
    params = {d.name: rng.standard_normal([sizes[a] for a in d.axes]) for d in h.original.params}
    (factor, node), = h.factors  # dz as the runner returns it: [L, *its axes]
    dz = torch.as_tensor(rng.standard_normal((length, *(sizes[a] for a in node.axes)))).to(torch.bfloat16)
    initial = {s.name: np.zeros([sizes[a] for a in s.axes]) for s in h.original.states}
    want_outs, want = compute_post(h, seqs, params, {factor: dz.double().numpy()}, initial)

    def f32(arrays):
        return {n: torch.as_tensor(v, dtype=torch.float32) for n, v in arrays.items()}

    outs, got = compute_post(h, f32(seqs), f32(params), {factor: dz}, f32(initial), xp=TorchArrays(torch.bfloat16),
                             dtype=torch.float32)
    want.update(want_outs)
    got.update(outs)
    assert set(got) == {"grad_x", "grad_W", "grad_U", "grad_bias"}
    for name, value in got.items():
        assert value.dtype == torch.float32, (name, value.dtype)
        err = relative(as_float64(value), np.asarray(want[name], np.float64))
        assert err < (1e-5 if name == "grad_bias" else 2e-2), (name, err)


@pytest.mark.skipif(in_ci(), reason="CI runs the bf16 LSTM (the same kernel; heads only change its indexing)")
def test_emulated_heads(emulated_cuda, half_launches):
    """3 heads, a block each (emulated blocks run one after another: no barrier between heads)."""
    check_half("heads", 7, batch=3, hidden=5, device="cpu")
    assert ("lstm_heads", True) in half_launches and ("lstm_heads_backward", True) in half_launches


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["3xtf32", "fma"])
def test_emulated_heads_fp32(tensor_cores, emulated_cuda, half_launches):
    """The heads in fp32 (the tensor cores' 3xTF32 form; the FMA form where SSMC_CUDA_PERSISTENT_MMA=0), forward
    only, against the interpreter."""
    emulated_cuda.setenv("SSMC_CUDA_TF32", "0")
    if not tensor_cores:
        emulated_cuda.setenv("SSMC_CUDA_PERSISTENT_MMA", "0")
    rng = np.random.default_rng(3)
    inputs = lstm_heads.make_inputs(rng, 5, batch=2, inp=3, heads=2, hidden=3)
    check_fp32(lstm_heads.SPEC, lstm_heads.LAYOUT, inputs, rng, 1e-5)
    assert half_launches == [("lstm_heads", tensor_cores)]


def test_heads_example_matches_its_reference():
    err = lstm_heads.reference(**lstm_heads.make_inputs(np.random.default_rng(0), 7))[0]
    got = ssmc.compile(lstm_heads.SPEC, "interpreter", layout=lstm_heads.LAYOUT)(
        **lstm_heads.make_inputs(np.random.default_rng(0), 7))
    assert np.abs(got - err).max() < 1e-12


# -- GPU ----------------------------------------------------------------------------------------------------------

# (batch, hidden) neither a multiple of the m16 / n8 tiles; H 700 at L 1 and 7 only (the interpreter's
# float64 reference of 180 steps at that size takes minutes)
ODD = ((5, 37), (3, 129), (19, 700))
GPU_CASES = ([("lstm", length, batch, hidden) for length in (1, 7) for batch, hidden in ODD]
             + [("lstm", 180, 5, 37), ("lstm", 180, 3, 129)]
             + [("gru", 1, 19, 700), ("gru", 7, 3, 129), ("gru", 180, 5, 37)]
             + [("heads", 1, 19, 300), ("heads", 7, 3, 129), ("heads", 180, 5, 37)])


@pytest.mark.gpu
@pytest.mark.parametrize("name,length,batch,hidden", GPU_CASES)
def test_gpu_bf16(name, length, batch, hidden, half_launches):
    """Many blocks, the grid barrier, m16 tiles past the rows (5, 3, 19 rows) and n8 tiles past the units
    (37, 129, 700 units; 3 heads of 37, 129, 300), forward and gradients."""
    check_half(name, length, batch, hidden, device="cuda")
    assert any(mma for _, mma in half_launches), f"no tensor-core launch: {half_launches}"
    no_barrier_timed_out()


@pytest.mark.gpu
def test_gpu_bf16_benchmark_shape(half_launches):
    """LSTM B256 L3 H1024 in bf16: the benchmark's plan (2 batch tiles x 64 blocks), the forward (L 3: the
    interpreter's float64 reference at this size takes a while)."""
    check_half("lstm", 3, batch=256, hidden=1024, device="cuda", grads=False)
    assert ("lstm", True) in half_launches

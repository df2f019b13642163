"""The persistent kernel's streamed form (`Plan.streamed`, issue 41): U not resident on chip. The same split by
columns as the resident grid form, but each block's U slice lies in global memory (the kernel's prologue writes it
in the on-chip type) and every step streams it through shared memory a chunk at a time, beside the operand's chunk,
into the same mma.sync products (bf16 m16n8k16; fp32 3xTF32 / TF32 m16n8k8); forward and adjoint. Taken where U
does not fit on chip in any resident form, or forced by SSMC_CUDA_PERSISTENT=streamed.

CPU: the choice by size and by the switch, `ssmc inspect`'s note; NVRTC (sm_80, sm_90: no spills) at LSTM B64 H2048
bf16 and fp32 H1536 (the training step's kernels) and B16 H256; emulated forced calls over 1 and 3 blocks against
the interpreter's float64 (LSTM, GRU; fp32 and bf16; forward and every gradient). GPU: LSTM B16 L33 H2048 bf16."""

from __future__ import annotations

import numpy as np
import pytest
from persistent_helpers import (
    BF16_GRAD_TOL,
    BF16_LONG_GRAD_TOL,
    BF16_TOL,
    FP32_GRAD_TOL,
    FP32_TOL,
    adjoint_program,
    check_fp32,
    check_rounded,
    flat,
    forward_program,
    no_barrier_timed_out,
    one_step_blocks,
    one_step_inputs,
    one_step_reference,
    record_launches,
    recording_program,
    relative,
    training_source,
)
from profiles import nightly_case

from ssmc.backends.cuda.kernels.persistent import runner as persistent_runner
from ssmc.backends.cuda.kernels.persistent.analysis import BLOCK_SHARED, analyse, plan
from ssmc.backends.cuda.kernels.persistent.forward import kernel_name
from ssmc.examples import gru, lstm, lstm_heads

torch = pytest.importorskip("torch")

SPECS = {"lstm": lstm, "gru": gru, "heads": lstm_heads}
H2048 = {"b": 64, "k": 2048, "j": 2048, "g": 4, "i": 1024}
H1536 = {"b": 64, "k": 1536, "j": 1536, "g": 4, "i": 1024}
H512 = {"b": 64, "k": 512, "j": 512, "g": 4, "i": 512}
SMALL = {"b": 16, "k": 256, "j": 256, "g": 4, "i": 128}


def _loop(program):
    return persistent_runner.PersistentLoop(program, "float32", None, analyse(program))


# -- the choice -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sizes,half", [(H2048, True), (H1536, False)], ids=["bf16-h2048", "fp32-h1536"])
def test_a_large_u_takes_the_streamed_form(sizes, half, monkeypatch):
    """LSTM B64 H2048 bf16 (U 32 MiB) and H1536 fp32 (36 MiB): no resident form fits, so the forward, the recording
    forward and the adjoint all plan the streamed form (not the step loop): one batch tile (a tile's blocks read
    all of U a step), 128 blocks, the slices together U's size once, the ring within a block's shared memory."""
    monkeypatch.setenv("SSMC_CUDA_TF32", "0")
    u_bytes = sizes["k"] * sizes["g"] * sizes["k"] * (2 if half else 4)
    for program in (forward_program(lstm.SPEC), recording_program(lstm.SPEC), adjoint_program(lstm.SPEC)):
        cell = analyse(program)
        assert isinstance(plan(cell, sizes, 132, mma=True, tf32=0 if half else 3), str)  # resident: no
        chosen = _loop(program).plan_for(sizes, half=half)
        assert not isinstance(chosen, str), chosen
        assert chosen.streamed and chosen.mma and chosen.tf32 == (0 if half else 3), chosen
        assert (chosen.tiles, chosen.blocks) == (1, 128) and chosen.shared_bytes <= BLOCK_SHARED
        assert chosen.slices * chosen.slice_elems * chosen.elem == u_bytes, chosen
        assert chosen.u_bytes == 0 and "U streamed" in chosen.describe()


def test_a_resident_u_stays_resident_unless_forced(monkeypatch):
    """B64 H512 keeps U resident; SSMC_CUDA_PERSISTENT=streamed streams it (the same tensor-core form otherwise),
    and refuses with the reason where no tensor-core form is allowed (SSMC_CUDA_PERSISTENT_MMA=0 in fp32)."""
    monkeypatch.setenv("SSMC_CUDA_TF32", "0")
    for program in (forward_program(lstm.SPEC), adjoint_program(lstm.SPEC)):
        assert not _loop(program).plan_for(H512, half=True).streamed
        monkeypatch.setenv("SSMC_CUDA_PERSISTENT", "streamed")
        for half in (True, False):
            chosen = _loop(program).plan_for(H512, half=half)
            assert chosen.streamed and chosen.mma and "SSMC_CUDA_PERSISTENT=streamed" in chosen.describe(), chosen
        monkeypatch.setenv("SSMC_CUDA_PERSISTENT_MMA", "0")
        refused = _loop(program).plan_for(H512, half=False)
        assert isinstance(refused, str) and "streamed" in refused and "tensor-core" in refused
        monkeypatch.delenv("SSMC_CUDA_PERSISTENT_MMA")
        monkeypatch.delenv("SSMC_CUDA_PERSISTENT")
    assert plan(analyse(forward_program(lstm.SPEC)), H512, 132, streamed=True) == (
        "the streamed form needs the tensor-core form (SSMC_CUDA_PERSISTENT_MMA=0 keeps U resident)")


def test_the_switch_parses():
    """SSMC_CUDA_PERSISTENT takes 0, 1 and streamed; anything else is refused, naming them."""
    from ssmc.backends.cuda.options import CudaOptions

    assert CudaOptions.parse({"SSMC_CUDA_PERSISTENT": "streamed"}).persistent == "streamed"
    assert CudaOptions.parse({"SSMC_CUDA_PERSISTENT": "0"}).persistent is False
    with pytest.raises(ValueError, match="expected 0 or 1 or streamed"):
        CudaOptions.parse({"SSMC_CUDA_PERSISTENT": "resident"})


def test_inspect_names_the_streamed_form():
    """`ssmc inspect`'s notes at LSTM B64 H2048 bf16: the forward and the adjoint streamed, with U's bytes and why
    (the resident plan's refusal)."""
    from ssmc.backends.cuda.report import path_notes

    lines = [line for line in path_notes(lstm.SPEC.program, {"b": 64, "i": 1024, "k": 2048}, 180, "bfloat16")
             if line.startswith("persistent")]
    assert len(lines) == 2 and all("U streamed" in line and "32.0 MiB" in line and "U fits on chip in no form" in line
                                   for line in lines), lines


# -- NVRTC ----------------------------------------------------------------------------------------------------------

NVRTC_CASES = [("lstm recording bf16 H2048", recording_program(lstm.SPEC), H2048, 0),
               ("lstm adjoint bf16 H2048", adjoint_program(lstm.SPEC), H2048, 0),
               ("lstm recording fp32 H1536", recording_program(lstm.SPEC), H1536, 3),
               ("lstm adjoint fp32 H1536", adjoint_program(lstm.SPEC), H1536, 3),
               ("lstm forward bf16 B16 H256", forward_program(lstm.SPEC), SMALL, 0),
               ("lstm adjoint bf16 B16 H256", adjoint_program(lstm.SPEC), SMALL, 0),
               ("gru recording bf16 H2048", recording_program(gru.SPEC), {**H2048, "g": 3}, 0),
               ("gru adjoint bf16 H2048", adjoint_program(gru.SPEC), {**H2048, "g": 3}, 0)]


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name,program,sizes,tf32", NVRTC_CASES, ids=[c[0] for c in NVRTC_CASES])
def test_nvrtc_streamed_compiles_without_spills(name, program, sizes, tf32, arch):
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.source import compile_options

    if not nvrtc.available():
        pytest.skip(nvrtc.unavailable_reason())
    cell = analyse(program)
    chosen = plan(cell, sizes, 132, mma=True, tf32=tf32, streamed=True)
    assert not isinstance(chosen, str) and chosen.streamed, chosen
    source = training_source(cell, chosen, sizes, half=not chosen.tf32)
    assert "#define STREAMED 1" in source and "stage_u(" in source
    used = nvrtc.compile_source(source, arch, compile_options(source)).resources[kernel_name(cell)]
    assert not used.spills and used.stack_frame_bytes == 0, used.summary()
    assert used.registers <= 255 and used.shared_bytes == 0, used.summary()


# -- emulated, against the interpreter ------------------------------------------------------------------------------

def check(name: str, length: int, batch: int, hidden: int, device: str, dtype, tol: float, grad_tol: float,
          grads: bool = True, seed: int = 0) -> None:
    """`name`'s call in `dtype` (inputs rounded to it) against the interpreter's float64 on the same values: the
    outputs and final states within `tol`, every gradient (`ssmc.grad`, the cotangent rounded too) within
    `grad_tol` (max |got - want| / max |want|)."""
    m = SPECS[name]
    rng = np.random.default_rng(seed)
    extra = {"heads": 3} if name == "heads" else {}
    values = m.make_inputs(rng, length, batch=batch, inp=4, hidden=hidden, **extra)
    # (bf16 inputs as given: the tensor-core form of 16-bit inputs)
    compute = "float32" if dtype == torch.float32 else None
    check_rounded(m.SPEC, m.LAYOUT, values, rng, device, dtype, tol, grad_tol, grads=grads, compute=compute,
                  context=(name, length, batch, hidden))


class Launches(list):
    forms: list


@pytest.fixture
def streamed_launches(monkeypatch):
    """(program, whether streamed, blocks) of every persistent launch (not the step loop's fallback); `.forms`: each
    launch's `Plan.tf32` (0: the 16-bit form)."""
    ran = Launches()
    ran.forms = []

    def entry(loop, chosen, _):
        ran.forms.append(chosen.tf32)
        return loop.program.name, chosen.streamed, chosen.blocks
    return record_launches(monkeypatch, entry, ran)


def _ran_streamed(launches, name: str, blocks: int) -> None:
    """The forward, the gradient's forward (its carries) and the adjoint each launched, streamed, over `blocks`."""
    assert {n for n, _, _ in launches} == {name, f"{name}_carries", f"{name}_backward"}, launches
    assert {(s, b) for _, s, b in launches} == {(True, blocks)}, launches


# (name, blocks, batch, hidden): one block; three (5, 5 and 3 units: the last partial; GRU 4, 4, 3) at hidden sizes
# that are no multiple of the n8 tiles (LSTM 13 x 4 gates = 52 columns, 20 a block) and rows past an m16 tile
SPLITS = [("lstm", 1, 3, 5), ("lstm", 3, 3, 13), ("gru", 1, 2, 6), ("gru", 3, 3, 11)]


def _cases() -> list:
    """(dtype, name, length, blocks, batch, hidden). CI (2 cores; each case compiles its own kernels, about 10-30 s):
    fp32 at L 1 and 7 of every split, bf16 at L 7, and the LSTM over one block at L 65 in both; nightly the rest (L 65
    over 3 blocks: each step launched twice, 1-2 minutes a case)."""
    out = []
    for dtype in ("fp32", "bf16"):
        for length in (1, 7, 65):
            for name, blocks, batch, hidden in SPLITS:
                case = (dtype, name, length, blocks, batch, hidden)
                kept = (length == 7 or (length == 1 and dtype == "fp32")
                        or (length == 65 and blocks == 1 and name == "lstm"))
                out.append(case if kept else nightly_case(*case, reason="CI keeps L 7 of every split, L 1 in fp32 "
                                                                         "and one block at L 65"))
    return out


@pytest.mark.parametrize("dtype,name,length,blocks,batch,hidden", _cases())
def test_emulated_streamed(name, length, blocks, batch, hidden, dtype, emulated_cuda, streamed_launches):
    """Forced streamed (SSMC_CUDA_PERSISTENT=streamed): the forward, the gradient's forward and the adjoint each one
    streamed launch a call (over 3 blocks: step by step, `runner.EMULATED_BLOCKS`), the outputs and every gradient
    against float64; fp32 as 3xTF32."""
    emulated_cuda.setenv("SSMC_CUDA_PERSISTENT", "streamed")
    emulated_cuda.setenv("SSMC_CUDA_TF32", "0")
    emulated_cuda.setattr(persistent_runner, "EMULATED_BLOCKS", blocks if blocks > 1 else None)
    if dtype == "fp32":
        check(name, length, batch, hidden, "cpu", torch.float32, FP32_TOL, FP32_GRAD_TOL)
    else:
        check(name, length, batch, hidden, "cpu", torch.bfloat16, BF16_TOL,
              BF16_GRAD_TOL if length < 65 else BF16_LONG_GRAD_TOL)
    _ran_streamed(streamed_launches, name, blocks)
    assert set(streamed_launches.forms) == {3 if dtype == "fp32" else 0}, streamed_launches.forms


def test_emulated_a_stale_u_chunk_fails(emulated_cuda, streamed_launches, monkeypatch):
    """The check above can fail: U's chunks staged from the wrong place (every chunk the slice's first) miss the
    fp32 tolerance by far."""
    emulated_cuda.setenv("SSMC_CUDA_PERSISTENT", "streamed")
    emulated_cuda.setenv("SSMC_CUDA_TF32", "0")
    monkeypatch.setattr(persistent_runner, "_LOOPS", {})  # runners whose sources no earlier test printed
    original = persistent_runner.kernel_source

    def broken(*a, **k):
        return original(*a, **k).replace("ugs + (long long)n * JPAD + c * CHUNK + j", "ugs + (long long)n * JPAD + j")
    monkeypatch.setattr(persistent_runner, "kernel_source", broken)
    with pytest.raises(AssertionError):
        check("lstm", 1, 3, 37, "cpu", torch.float32, FP32_TOL, FP32_GRAD_TOL, grads=False)
    assert streamed_launches and all(s for _, s, _ in streamed_launches)


def test_emulated_streamed_ring_wraps(emulated_cuda, streamed_launches):
    """Chunks of 16 indices in rings of 2 (the forwards) and 3 (the adjoint; SSMC_CUDA_PERSISTENT_FORWARD_* /
    _ADJOINT_*): H 37 takes 3 chunks in the forwards and 10 in the adjoint, so every ring is refilled within a step,
    U's chunks staged in the same groups as the operand's; fp32 (3xTF32), forward and every gradient, 3 blocks."""
    for name, value in (("FORWARD_CHUNK", "16"), ("FORWARD_STAGES", "2"), ("ADJOINT_CHUNK", "16"),
                        ("ADJOINT_STAGES", "3"), ("", "streamed")):
        emulated_cuda.setenv("SSMC_CUDA_PERSISTENT" + (f"_{name}" if name else ""), value)
    emulated_cuda.setenv("SSMC_CUDA_TF32", "0")
    emulated_cuda.setattr(persistent_runner, "EMULATED_BLOCKS", 3)
    emulated_cuda.setattr(persistent_runner, "_LOOPS", {})  # this call's runners alone (an earlier file's: other axes)
    check("lstm", 3, 2, 37, "cpu", torch.float32, FP32_TOL, FP32_GRAD_TOL)
    _ran_streamed(streamed_launches, "lstm", 3)
    plans = [loop.plan_for({"b": 2, "k": 37, "j": 37, "g": 4, "i": 4}, False)
             for loop in persistent_runner._LOOPS.values() if loop is not None]
    assert plans and all(p.streamed and p.chunk == 16 and p.jpad // p.chunk > p.stages - 1 for p in plans), plans


def test_emulated_streamed_heads(emulated_cuda, streamed_launches):
    """A block-diagonal U (examples/lstm_heads.py, 2 heads of 3; emulated, a block a head): each head's block streams
    its head's slice of U; the forward in fp32 against the interpreter. (The emulator runs the blocks one after
    another, each writing its slice before reading it: two heads sharing a slot would not show here.)"""
    emulated_cuda.setenv("SSMC_CUDA_PERSISTENT", "streamed")
    emulated_cuda.setenv("SSMC_CUDA_TF32", "0")
    rng = np.random.default_rng(3)
    inputs = lstm_heads.make_inputs(rng, 5, batch=2, inp=3, heads=2, hidden=3)
    check_fp32(lstm_heads.SPEC, lstm_heads.LAYOUT, inputs, rng, FP32_TOL)
    assert list(streamed_launches) == [("lstm_heads", True, 2)], streamed_launches


def test_emulated_streamed_split_matches_the_resident_split():
    """The adjoint in 2 K groups x 2 J groups (what H2048's adjoint takes, in 4): H 13 over 4 blocks (3 pad units in
    the last J group), each block streaming its K group's slice of its J group's U; at L 1 against the interpreter
    within bf16's rounding, and against the resident split within the fp32 sums' order."""
    program = adjoint_program(lstm.SPEC)
    sizes = {"b": 3, "k": 13, "j": 13, "g": 4, "i": 4}
    inputs = one_step_inputs(program, sizes, np.random.default_rng(0))
    got = one_step_blocks(program, sizes, 4, 2, inputs, streamed=True)
    for a, b in zip(flat(got), one_step_reference(program, sizes, inputs), strict=True):
        assert relative(a, np.asarray(b, np.float64)) < 1e-2
    for a, b in zip(flat(got), flat(one_step_blocks(program, sizes, 4, 2, inputs)), strict=True):
        assert relative(a, b) < 1e-5


# -- GPU ------------------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_streamed_lstm_h2048_bf16(streamed_launches):
    """LSTM B16 L33 H2048 bf16: U (32 MiB) streamed by the rule, not forced; the forward, the recording forward and
    the adjoint against the interpreter's float64, every gradient; no barrier timed out."""
    check("lstm", 33, 16, 2048, "cuda", torch.bfloat16, BF16_TOL, BF16_GRAD_TOL)
    _ran = {(n, s) for n, s, _ in streamed_launches}
    assert {("lstm", True), ("lstm_carries", True), ("lstm_backward", True)} <= _ran, streamed_launches
    no_barrier_timed_out()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name,length,batch,hidden", [("lstm", 7, 5, 37), ("lstm", 7, 3, 129), ("gru", 7, 19, 300),
                                                     ("heads", 7, 3, 129)])
def test_gpu_streamed_forced(name, length, batch, hidden, dtype, streamed_launches, monkeypatch):
    """Forced streamed over many blocks (MIN_BLOCK_PAIRS 1: a block for every few pairs, so the grid barrier and
    every block's own slice of U in global memory are exercised; 3 heads of 129: a head's slices its own), rows and
    units past the m16 / n8 tiles; forward and every gradient against float64 (fp32 as 3xTF32)."""
    from ssmc.backends.cuda.kernels.persistent import analysis

    monkeypatch.setattr(analysis, "MIN_BLOCK_PAIRS", 1)
    monkeypatch.setenv("SSMC_CUDA_PERSISTENT", "streamed")
    monkeypatch.setenv("SSMC_CUDA_TF32", "0")
    if dtype == "fp32":
        check(name, length, batch, hidden, "cuda", torch.float32, FP32_TOL, FP32_GRAD_TOL)
    else:
        check(name, length, batch, hidden, "cuda", torch.bfloat16, BF16_TOL, BF16_GRAD_TOL)
    assert streamed_launches and all(s and b > 1 for _, s, b in streamed_launches), streamed_launches
    no_barrier_timed_out()

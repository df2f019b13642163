"""CUDA kernels run on the CPU by the emulator (backends/cuda/emulator.py; no GPU needed, a C++20
compiler is), against the interpreter at tiny sizes: a training step through the fused backward's
two kernels (`emulation.fused_step`: the block sums, the lanes training forward, random specs), and
the whole backend with ``SSMC_CUDA_EMULATE=1`` (every example through `ssmc.compile` and `ssmc.grad`
under the strategies it picks or is forced to, random recurrences). These check the kernels' logic
(indexing, partial rounds and chunks, barriers, shuffles) and the runners' plans in CI; the GPU tests
check them on the hardware. The emulated block sums reproduce the bug of 2026-11-26 (a round's
vectors past the block's threads were never added) on the code before.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from emulation import fused_step
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from profiles import examples, in_ci, nightly_case
from strategies import diagonal_linear_recurrences, draw_inputs, near_ties, recurrences, time_last
from test_cuda import flat, rel_err
from test_fused_backward import FIVE_SUMS, WIDE

import ssmc
from ssmc.backends.cuda import emulator, fused_backward
from ssmc.backends.cuda.kernels import lanes
from ssmc.backends.cuda.kernels.lanes import backward as lanes_backward
from ssmc.passes.autodiff import derive_backward

pytestmark = pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")

TOL = {np.float64: 1e-10, np.float32: 1e-4}


def _check(spec, inputs: dict, rng, dtype, tol: float | None = None):
    """The emulated step's outputs and gradients (`fused_step`) against the interpreter's, inputs time
    last ("... t"), rounded to `dtype` first; relative to the largest value of each."""
    rounded = {k: np.asarray(v).astype(dtype).astype(np.float64) for k, v in inputs.items()}
    f = ssmc.compile(spec, "interpreter", layout="... t")
    outs, finals = f.run(**rounded)
    program = spec.program
    cot = {n: np.moveaxis(rng.standard_normal(outs[n].shape), 0, -1).astype(dtype).astype(np.float64)
           for n, _ in program.outputs}
    want = ssmc.grad(spec, "interpreter", layout="... t")(**rounded, grad_outputs=cot)
    got_outs, got = fused_step(spec, rounded, cot, dtype)
    tol = tol or TOL[dtype]
    scale = max(float(np.abs(w).max(initial=0.0)) for w in want.values())
    for n, _ in program.outputs:
        w = np.moveaxis(outs[n], 0, -1)
        assert np.abs(got_outs[n] - w).max() <= tol * max(np.abs(w).max(), 1e-30), n
    for s in program.states:  # the final states
        assert np.abs(got_outs[s.name] - finals[s.name]).max() <= tol * max(np.abs(finals[s.name]).max(), 1e-30)
    for key, w in want.items():
        assert np.abs(got[key] - w).max() <= tol * max(np.abs(w).max(), 1e-6 * scale, 1e-30), key


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("length", [7, 70, nightly_case(200, reason="a partial last round, state-major: 70's")])
@pytest.mark.parametrize("name", ["mamba1", "hgrn"])
def test_emulated_fused_backward_matches_the_interpreter(name, length, dtype, monkeypatch):
    """Mamba-1 (state-major backward from L = 70, step-major at 7) and HGRN (a scan: no sums over
    the recurrences), the warp kernel forced as the forward so that the fused backward runs at any
    length; a partial last round at 7, 70 and 200."""
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "warp")
    monkeypatch.setenv("SSMC_CUDA_FUSED_BACKWARD", "1")
    m = importlib.import_module(f"ssmc.examples.{name}")
    rng = np.random.default_rng(length)
    inputs = m.make_inputs(rng, length, batch=2, dim=8, **({"state": 5} if name == "mamba1" else {}))
    if m.LAYOUT.startswith("b t"):  # time second: last instead
        seqs = {d.name for d in m.SPEC.program.seqs}
        inputs = {k: (np.moveaxis(v, 1, -1) if k in seqs else v) for k, v in inputs.items()}
    _check(m.SPEC, inputs, rng, dtype)


@pytest.mark.parametrize("spec, steps, length", [("mamba1", "6", 192), ("mamba1", "8", 256), ("five_sums", "", 64),
                                                  ("wide", "", 64)])
def test_emulated_block_sums_add_every_vector(spec, steps, length, monkeypatch):
    """The block sums where a round has more vectors than the block's 128 threads (K = 6 and 8 forced;
    five summed arrays; `wide`, which takes K = 2 to fit its shared memory): float32, d = 8 (the block's
    4 warps share b), rows of whole vectors. On the code before 2026-11-26 the emulated step gave
    grad_C (K = 6) and grad_G (five_sums, wide) a relative error of 1.0."""
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "warp")
    monkeypatch.setenv("SSMC_CUDA_STATE_MAJOR_BACKWARD", "1")
    if steps:
        monkeypatch.setenv("SSMC_CUDA_BACKWARD_STEPS_PER_LANE", steps)
    m = {"five_sums": FIVE_SUMS, "wide": WIDE}.get(spec) or importlib.import_module(f"ssmc.examples.{spec}")
    rng = np.random.default_rng(length)
    _check(m.SPEC, m.make_inputs(rng, length, batch=2, dim=8, state=5), rng, np.float32)


@pytest.mark.parametrize("length", [64, 100])
def test_emulated_lanes_training_forward(length, monkeypatch, fresh_runners):
    """Mamba-1's training forward as the lanes kernel (its fill threshold lowered, so that it runs at
    B2 D8), saving the round carries the fused backward starts from: its outputs and the gradients;
    100 steps end in a partial chunk."""
    monkeypatch.setattr(lanes, "LANES_FILL", 1)
    m = importlib.import_module("ssmc.examples.mamba1")
    sizes = {"b": 2, "d": 8, "n": 5}
    fb = fused_backward.fused_backward_runner(derive_backward(m.SPEC.program), "float32")
    assert fb.forward_lanes(sizes, length, True) is not None and fb.applies_at(sizes, length, True)
    rng = np.random.default_rng(length)
    _check(m.SPEC, m.make_inputs(rng, length, batch=2, dim=8, state=5), rng, np.float32)


@pytest.mark.parametrize("batch, dim, length, offset", [
    (1, 32, 100, 0),   # one block of 32 rows: chunks 1 and 2 copied whole, chunk 3 (steps 96-99) checked
    (2, 40, 100, 0),   # rows 0-31 a whole block; rows 32-39 in a block reaching past the row axis: checked
    (1, 32, 100, 1),   # every array one value past 16 bytes: `vec` false, the checked copies only
    (1, 32, 64, 0),    # two whole chunks
])
def test_emulated_lanes_whole_chunk_copies(batch, dim, length, offset, monkeypatch, fresh_runners):
    """The lanes forward copies a next chunk that lies wholly inside the sequence and the row axis,
    its arrays aligned, by 16-byte `cp.async` without bounds checks (`lanes._issue`'s `whole`), else
    with them: Mamba-1 float32 time last ("b d t"), its kernel emulated, outputs and final states
    against the interpreter at sizes that take either copies or both in one launch."""
    torch = pytest.importorskip("torch")

    monkeypatch.setattr(lanes, "LANES_FILL", 1)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    m = importlib.import_module("ssmc.examples.mamba1")
    rng = np.random.default_rng(length + offset)
    inputs = m.make_inputs(rng, length, batch=batch, dim=dim, state=16)
    inputs = {k: v.astype(np.float32).astype(np.float64) for k, v in inputs.items()}
    want_y, want_h = ssmc.compile(m.SPEC, "interpreter", layout="b d t")(**inputs, return_final_states=True)

    def placed(v):  # a float32 tensor `offset` values into a larger one
        flat_ = torch.zeros(v.size + offset, dtype=torch.float32)
        flat_[offset:] = torch.tensor(v.ravel(), dtype=torch.float32)
        return flat_[offset:].view(v.shape)

    sources = []
    monkeypatch.setattr(lanes, "lanes_source", _recording(lanes.lanes_source, sources))
    got_y, got_h = ssmc.compile(m.SPEC, "cuda", layout="b d t")(**{k: placed(v) for k, v in inputs.items()},
                                                              return_final_states=True)
    assert rel_err(got_y, want_y) <= 1e-4 and rel_err(got_h, want_h) <= 1e-4
    source, = sources
    assert "if (vec && t0 + 2 * T <= L" in source and "const int tid = fresh_thread_index();" in source
    assert (" && r0 + R <= n_d)" in source) == (dim % 32 != 0)


@pytest.mark.parametrize("length", [1, 7])
def test_emulated_lanes_short_chunks_at_a_long_state_axis(length, monkeypatch, fresh_runners):
    """At n = 128 chunks of 32 steps of B and C do not fit a block's static shared memory: the lanes
    forward stages chunks of 8 (`lanes.forward.lanes_chunk`; before, a thread per recurrence with its 128
    state values in local memory), for calls of one chunk at most (a decode step: longer ones keep the scan
    strategies). Mamba-1 float32 "b d t", 1 step and 7: outputs and final states against the interpreter;
    at 7 the gradients too, nightly (the training forward's lanes kernel saves its round carries). One step
    runs the chunked kernel with ``SSMC_CUDA_LANES_STEP=0`` only (else its step form: test_lanes_step.py)."""
    torch = pytest.importorskip("torch")

    monkeypatch.setattr(lanes, "LANES_FILL", 1)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setenv("SSMC_CUDA_LANES_STEP", "0")
    m = importlib.import_module("ssmc.examples.mamba1")
    rng = np.random.default_rng(length)
    inputs = m.make_inputs(rng, length, batch=1, dim=16, state=128)
    inputs = {k: v.astype(np.float32).astype(np.float64) for k, v in inputs.items()}
    want_y, want_h = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, return_final_states=True)
    sources = []
    monkeypatch.setattr(lanes, "lanes_source", _recording(lanes.lanes_source, sources))
    got_y, got_h = ssmc.compile(m.SPEC, "cuda", layout=m.LAYOUT)(
        **{k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()}, return_final_states=True)
    assert rel_err(got_y, want_y) <= 1e-4 and rel_err(got_h, want_h) <= 1e-4
    assert sources and "T = 8, P = 12" in sources[0]
    from ssmc.backends.cuda.runner import runner_for

    runner = runner_for(m.SPEC.program, "float32")
    sizes = {"b": 1, "d": 16, "n": 128}
    assert runner.strategy(sizes, 9, True) != "lanes" and runner.strategy(sizes, 8, True) == "lanes"
    if length > 1 and not in_ci():  # the gradients' kernels compile for a minute: nightly
        cot = rng.standard_normal(want_y.shape).astype(np.float32).astype(np.float64)
        want = ssmc.grad(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, grad_outputs=cot)
        got = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)(
            **{k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()},
            grad_outputs=torch.tensor(cot, dtype=torch.float32))
        for key, w in want.items():
            assert rel_err(got[key], w) <= 1e-4, key


def _recording(fn, sources: list):
    def record(*args, **kwargs):
        sources.append(fn(*args, **kwargs))
        return sources[-1]
    return record


# CI: each layout once, each with_state once (6 emulated training steps a case)
@pytest.mark.parametrize("layout, with_state", [
    ("b d t", False), nightly_case("b d t", True, reason="the lean steps of 'b d t' run without the state"),
    nightly_case("b t d", False, reason="the prepared steps of 'b t d' run with the state"), ("b t d", True)])
def test_emulated_lean_training_steps(layout, with_state, monkeypatch, fresh_runners):
    """`ssmc.grad`'s calls like earlier ones (the third on) take a `LeanStep` (grad.py `_lean_call`:
    one allocation and launch each way), Mamba-1 float32 through the fused backward, its kernels
    emulated: every call on fresh values against the interpreter, the cotangent as a tensor, as a
    dict, and in float64 (unlike the first ones: the general backward from the lean forward's tape).
    Time before the channels ("b t d") the gradients' views are not contiguous: after one lean
    forward the prepared step's path serves the calls."""
    torch = pytest.importorskip("torch")
    from ssmc.autograd.lean import LeanStep

    monkeypatch.setattr(lanes, "LANES_FILL", 1)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    m = importlib.import_module("ssmc.examples.mamba1")
    length = 72  # grad_B's rows a whole number of 16 bytes: the gradients' views contiguous, the lean backward
    g = ssmc.grad(m.SPEC, "cuda", layout=layout)
    want_grad = ssmc.grad(m.SPEC, "interpreter", layout=layout)
    for call in range(6):
        rng = np.random.default_rng(call)
        inputs = m.make_inputs(rng, length, batch=2, dim=40, state=16)
        if not with_state:
            inputs.pop("h")
        if layout == "b t d":
            inputs = {k: (np.ascontiguousarray(np.swapaxes(v, 1, 2)) if k in ("u", "delta", "z", "B", "C") else v)
                      for k, v in inputs.items()}
        inputs = {k: v.astype(np.float32).astype(np.float64) for k, v in inputs.items()}
        cot = rng.standard_normal(inputs["u"].shape).astype(np.float32).astype(np.float64)
        want = want_grad(**inputs, grad_outputs=cot)
        tensors = {k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()}
        dy = torch.tensor(cot, dtype=torch.float32)
        if call == 4:
            dy = {"y": dy}
        elif call == 5:  # another dtype than the first ones'
            dy = dy.double()
        got = g(**tensors, grad_outputs=dy)
        assert list(got) == list(want), call
        for key in want:
            assert rel_err(got[key], want[key]) <= 1e-4, (call, key)
        leans = list(g._leans.values())
        if layout == "b d t":
            assert (call >= 2) == (len(leans) == 1 and isinstance(leans[0], LeanStep)), call
            assert call < 2 or leans[0].backward == leans[0]._lean_backward, call
        else:  # time before the channels: the gradients' views in that layout are not contiguous
            assert leans == ([False] if call >= 2 else []), call


# CI: every size in "b t d" (the lanes backward's default), the first in "b d t" too (forced there)
_B_T_D_SIZES = "the sizes' tiles in 'b t d'; 'b d t' (forced) at the first size"
LANES_SIZES = [
    (2, 40, 16, 100),   # 4 lanes a row, 3 blocks of 16 rows (the last 8 past d), a partial chunk
    (2, 8, 5, 64),      # 2 lanes a row owning 3 and 2 state values, two whole chunks
    (1, 32, 16, 70),    # two blocks of 16 rows tiling d (no row past the last), whole chunks, then a partial one
    (1, 3, 8, 1),       # one step
    (3, 20, 33, 33),    # 8 lanes a row, 5 values each (the last lane 33 - 32 = 1)
]


@pytest.mark.parametrize("batch, dim, state, length, layout", [
    (*size, layout) if layout == "b t d" or size == LANES_SIZES[0] else nightly_case(*size, layout, reason=_B_T_D_SIZES)
    for layout in ("b d t", "b t d") for size in LANES_SIZES])
def test_emulated_lanes_backward(batch, dim, state, length, layout, monkeypatch, fresh_runners):
    """Mamba-1's backward as lanes (kernels/lanes/backward.py) through `ssmc.grad` and the torch
    op, every kernel emulated: the training forward as the lanes kernel saving every chunk's carry
    (its fill threshold lowered, so that it runs at these sizes), then the lanes backward, in both
    layouts (forced in "b d t", the default in "b t d"), the initial state given and its gradient
    wanted; against the interpreter's gradients.
    Float32 only: the kernel's staging does not fit a block's shared memory in float64 (the warp
    kernel's fused backward runs there)."""
    _check_lanes_backward(batch, dim, state, length, layout, monkeypatch, lanes_backward.CHUNK)


@pytest.mark.parametrize("batch, dim, state, length, layout", [
    (2, 40, 16, 100, "b d t"),  # 4 lanes a row, 3 blocks of 16 rows (the last 8 past d), a partial chunk
    (1, 32, 16, 70, "b t d"),   # rows tiling d, chunks of 16 steps whole, then a partial one
    (2, 8, 12, 64, "b d t"),    # 3 state values a lane, a block's 16 rows 8 past d, whole chunks
])
def test_emulated_bounded_lanes_backward(batch, dim, state, length, layout, monkeypatch, fresh_runners):
    """The bounded lanes backward (chunks of 16 steps, 8 blocks an SM: `lanes_backward.SHORT_CHUNK`),
    which runs where the rows are many, forced at these sizes: the training forward then saves a carry
    every 16 steps, two in each of its chunks of 32."""
    monkeypatch.setattr(lanes_backward, "UNBOUNDED_WAVE_THREADS_AN_SM", 0)
    _check_lanes_backward(batch, dim, state, length, layout, monkeypatch, lanes_backward.SHORT_CHUNK)


def _check_lanes_backward(batch, dim, state, length, layout, monkeypatch, chunk):
    torch = pytest.importorskip("torch")
    import ssmc.torch as ssmc_torch

    monkeypatch.setattr(lanes, "LANES_FILL", 1)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    if layout == "b d t":  # where the warp kernel's fused backward runs by default
        monkeypatch.setenv("SSMC_CUDA_LANES_BACKWARD", "1")
    m = importlib.import_module("ssmc.examples.mamba1")
    dtype = "float32"
    fb = fused_backward.fused_backward_runner(derive_backward(m.SPEC.program), dtype)
    sizes = {"b": batch, "d": dim, "n": state}
    assert fb.backward_lanes(sizes, length, layout == "b d t").chunk == chunk
    assert fb.applies_at(sizes, length, layout == "b d t")
    rng = np.random.default_rng(length + state)
    inputs = m.make_inputs(rng, length, batch=batch, dim=dim, state=state)
    if layout == "b t d":
        inputs = {k: (np.ascontiguousarray(np.swapaxes(v, 1, 2)) if k in ("u", "delta", "z", "B", "C") else v)
                  for k, v in inputs.items()}
    inputs = {k: v.astype(dtype).astype(np.float64) for k, v in inputs.items()}
    cot = rng.standard_normal(inputs["u"].shape).astype(dtype).astype(np.float64)
    want = ssmc.grad(m.SPEC, "interpreter", layout=layout)(**inputs, grad_outputs=cot)
    tensors = {k: torch.tensor(v, dtype=getattr(torch, dtype)) for k, v in inputs.items()}
    tol = 1e-4
    g = ssmc.grad(m.SPEC, "cuda", layout=layout)
    for call in range(2):  # the second call takes the prepared step
        got = g(**tensors, grad_outputs=torch.tensor(cot, dtype=getattr(torch, dtype)))
        for key in want:
            assert rel_err(got[key], want[key]) <= tol, (call, key)
    # grad_u written where the caller wants it: time innermost in "b d t", strided by d in "b t d"
    grad_u, = (a for launch in fb._plans.values() for a in launch.allocations if a.name == "out_grad_u")
    assert grad_u.strides[0] == (1 if layout == "b d t" else dim), grad_u
    op = ssmc_torch.function(m.SPEC, "cuda", layout=layout)
    names = [d.name for d in m.SPEC.program.inputs]
    leaves = {k: t.clone().requires_grad_(True) for k, t in tensors.items()}
    for call in range(2):  # the second call through a `LeanStep`: the outputs contiguous in either layout
        y = flat(op(*(leaves[k] for k in names), h=leaves["h"]))[0]
        assert y.is_contiguous()
        grads = torch.autograd.grad(y, list(leaves.values()), torch.tensor(cot, dtype=getattr(torch, dtype)))
        for key, gr in zip(leaves, grads):
            assert rel_err(gr, want[key]) <= tol, ("op", call, key)
    assert [type(lean).__name__ for lean in op._lean.values()] == ["LeanStep"]


# each fusing example compiles its kernels with the host C++ compiler: 2 in CI (tests/profiles.py)
@settings(max_examples=examples(4, ci=2), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large])
@given(spec=diagonal_linear_recurrences(), length=st.sampled_from([7, 70]), seed=st.integers(0, 2**16))
def test_emulated_random_specs_through_the_fused_backward(spec, length, seed):
    """Random diagonal-linear specs that fuse, float64, the warp kernel and the fused backward forced."""
    import os

    assume(fused_backward.fused_backward_runner(derive_backward(spec.program)) is not None)
    inputs = time_last(spec, draw_inputs(spec, length, seed))
    os.environ.update(SSMC_CUDA_STRATEGY="warp", SSMC_CUDA_FUSED_BACKWARD="1")
    try:
        _check(spec, inputs, np.random.default_rng(seed), np.float64, tol=1e-8)
    finally:
        del os.environ["SSMC_CUDA_STRATEGY"], os.environ["SSMC_CUDA_FUSED_BACKWARD"]


@ssmc.recurrence
def _gated_toward_a_constant(h: ssmc.State["b d n"], x: ssmc.Seq["b d"], s: ssmc.Seq["b n"], p: ssmc.Param["d n"]):
    """Its step reads a value the same every step (tanh(0.5), hoisted into the forward's setup)."""
    a = ssmc.sigmoid(x + p)
    h = a * h + (1 - a) * ssmc.where(x > 0.5, s, ssmc.tanh(0.5))
    return h, (h * 0.5).sum("n") + x


@pytest.mark.parametrize("length", [7, 70])
@pytest.mark.parametrize("name, n", [("mamba1", 16), ("mamba1", 5), ("gated_toward_a_constant", 3)])
def test_emulated_gradients_only_steps_through_the_lanes(name, n, length, monkeypatch, fresh_runners):
    """Specs shaped like Mamba-1 whose training step runs as lanes (the forward and the lanes backward,
    forced), float32 "... t": `ssmc.grad`'s call, which wants only the gradients, runs the forward
    without its outputs (`lanes_summary_kernel`: what only the outputs read dropped too); every
    gradient against the interpreter's. The last spec's lanes backward did not compile before
    2026-11-27 (test_cuda_compile.py, `test_the_lanes_backward_assigns_the_forwards_hoisted_values`)."""
    torch = pytest.importorskip("torch")
    sizes = {"b": 2, "d": 8, "n": n}
    if name == "mamba1":  # its own inputs ("b d t"): random ones make its decays grow without bound
        m = importlib.import_module("ssmc.examples.mamba1")
        spec, inputs = m.SPEC, m.make_inputs(np.random.default_rng(n), length, batch=2, dim=8, state=n)
    else:
        spec = _gated_toward_a_constant
        inputs = time_last(spec, draw_inputs(spec, length, length + n, sizes))
    inputs = {k: v.astype(np.float32).astype(np.float64) for k, v in inputs.items()}
    rng = np.random.default_rng(length)
    outs, _ = ssmc.compile(spec, "interpreter", layout="... t").run(**inputs)
    cot = {k: np.moveaxis(rng.standard_normal(v.shape), 0, -1).astype(np.float32).astype(np.float64)
           for k, v in outs.items()}
    want = ssmc.grad(spec, "interpreter", layout="... t")(**inputs, grad_outputs=cot)
    monkeypatch.setattr(lanes, "LANES_FILL", 1)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setenv("SSMC_CUDA_LANES_BACKWARD", "1")
    fb = fused_backward.fused_backward_runner(derive_backward(spec.program), "float32")
    assert fb.lanes_summary is not None and fb.backward_lanes(sizes, length, True) is not None
    got = ssmc.grad(spec, "cuda", layout="... t")(
        **{k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()},
        grad_outputs={k: torch.tensor(v, dtype=torch.float32) for k, v in cot.items()})
    planned = {kernel for kernel, *_ in fb._plans}  # (the forward with outputs is planned, not run)
    assert fb.lanes_summary_kernel.name in planned, planned
    for key in want:
        assert rel_err(got[key], want[key]) <= 1e-4, key


# -- the whole backend emulated: SSMC_CUDA_EMULATE=1, torch CPU tensors for device memory ---------

EXAMPLES = ["hgrn", "mamba1", "mamba1_block", "mamba2", "mingru", "linear_attention", "retnet", "lstm", "gru",
            "layernorm_lstm", "mamba_conv"]


def _example_inputs(name: str, length: int, rng) -> tuple:
    m = importlib.import_module(f"ssmc.examples.{name}")
    try:
        return m, m.make_inputs(rng, length, batch=2, dim=8)
    except TypeError:  # examples of other sizes' names
        return m, m.make_inputs(rng, length)


# the examples whose kernels a forced strategy changes at these sizes; the others fall back to the kernels
# of their (70, "") case (the same inputs): those repeats run locally and nightly
FORCED_STRATEGY_APPLIES = {"hgrn", "mamba1", "mamba1_block", "mingru"}
EXAMPLE_CASES = [case if case[2] == "" or case[0] in FORCED_STRATEGY_APPLIES else nightly_case(
    *case, reason="the forced strategy falls back to the kernels of the example's (70, '') case")
    for case in [(name, length, strategy) for name in EXAMPLES
                 for length, strategy in [(7, ""), (70, ""), (70, "warp"), (70, "time blocks")]]]


@pytest.mark.parametrize("name, length, strategy", EXAMPLE_CASES)
def test_emulated_examples_match_the_interpreter(name, length, strategy, monkeypatch):
    """Every example through `ssmc.compile` and `ssmc.grad` on the cuda backend, its kernels emulated
    (the runners' own plans, launches and allocations, on torch CPU tensors), float64, with the
    strategy the heuristic picks or one forced where it applies (others fall back as on a GPU):
    outputs, final states and every gradient against the interpreter."""
    torch = pytest.importorskip("torch")

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    if strategy:
        monkeypatch.setenv("SSMC_CUDA_STRATEGY", strategy)
    rng = np.random.default_rng(length)
    m, inputs = _example_inputs(name, length, rng)
    want_y, want_h = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, return_final_states=True)
    tensors = {k: torch.tensor(v) for k, v in inputs.items()}
    got_y, got_h = ssmc.compile(m.SPEC, "cuda", layout=m.LAYOUT)(**tensors, return_final_states=True)
    pairs = list(zip(flat(got_y) + flat(got_h), flat(want_y) + flat(want_h)))
    for g, w in pairs:
        assert not g.is_cuda and rel_err(g, w) <= 1e-10
    cot = rng.standard_normal(np.shape(flat(want_y)[0]))
    want = ssmc.grad(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, grad_outputs=cot)
    got = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)(**tensors, grad_outputs=torch.tensor(cot))
    for key in want:
        assert rel_err(got[key], want[key]) <= 1e-9, key


@pytest.mark.parametrize("bad", ["abc", [[1.0], [1.0, 2.0]], "meta tensor"])
def test_emulated_bad_arguments_are_value_errors_naming_them(bad, monkeypatch):
    """A string, a ragged list or a tensor on another device given to the cuda backend (emulated: its
    device is the CPU) raises a ValueError naming the argument, from `ssmc.compile` and `ssmc.grad`,
    before any kernel runs."""
    torch = pytest.importorskip("torch")

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    m = importlib.import_module("ssmc.examples.hgrn")
    tensors = {k: torch.tensor(v, dtype=torch.float32) for k, v in m.make_inputs(np.random.default_rng(0), 5).items()}
    tensors["f"] = torch.zeros(tensors["f"].shape, device="meta") if bad == "meta tensor" else bad
    with pytest.raises(ValueError, match="argument 'f'"):
        ssmc.compile(m.SPEC, "cuda", layout=m.LAYOUT)(**tensors)
    with pytest.raises(ValueError, match="argument 'f'"):
        ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)(**tensors, grad_outputs=tensors["x"])


# each example compiles a random spec's kernels with the host C++ compiler: 3 in CI (tests/profiles.py), 6 locally
@settings(max_examples=examples(6, ci=3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=recurrences(), length=st.sampled_from([1, 7, 40]), seed=st.integers(0, 2**16))
def test_emulated_random_recurrences(spec, length, seed):
    """Random recurrences (time first, float64) forward and gradient through the emulated cuda backend."""
    import os

    torch = pytest.importorskip("torch")

    inputs = draw_inputs(spec, length, seed)
    assume(not near_ties(spec, inputs))  # a max's gradient or a comparison decided by the last bits
    outs, finals = ssmc.compile(spec, "interpreter").run(**inputs)
    rng = np.random.default_rng(seed)
    cot = {n: rng.standard_normal(v.shape) for n, v in outs.items()}
    want = ssmc.grad(spec, "interpreter")(**inputs, grad_outputs=cot)
    os.environ["SSMC_CUDA_EMULATE"] = "1"
    try:
        tensors = {k: torch.tensor(v) for k, v in inputs.items()}
        got_outs, got_finals = ssmc.compile(spec, "cuda").run(**tensors)
        got = ssmc.grad(spec, "cuda")(**tensors, grad_outputs={n: torch.tensor(v) for n, v in cot.items()})
    finally:
        del os.environ["SSMC_CUDA_EMULATE"]
    for n in outs:
        assert rel_err(got_outs[n], outs[n]) <= 1e-9, n
    for n in finals:
        assert rel_err(got_finals[n], finals[n]) <= 1e-9, n
    scale = max(float(np.abs(w).max(initial=0.0)) for w in want.values())
    for key in want:  # as test_cuda.py's random gradients: cancellation to roundoff by an absolute bound
        err = np.abs(got[key].double().numpy() - want[key]).max()
        assert rel_err(got[key], want[key]) <= 1e-8 or err <= 1e-12 * max(scale, 1.0), key


@pytest.mark.parametrize("length", [nightly_case(7, reason="the prepared calls' plumbing: L = 70's"), 70])
@pytest.mark.parametrize("name", ["hgrn", "mamba1", "mingru", "lstm", "mamba1_block"])
def test_emulated_prepared_calls_and_torch_steps(name, length, monkeypatch):
    """Calls alike after the first take the prepared paths (`api.Compiled._calls`, `Grad._steps`:
    `grad_prepared.PreparedStep` / `PreparedChunk`) and the torch op's later steps its lean one
    (`LeanStep`): three calls of each, emulated, float64, each against the interpreter."""
    torch = pytest.importorskip("torch")
    import ssmc.torch as ssmc_torch

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    rng = np.random.default_rng(length)
    m, inputs = _example_inputs(name, length, rng)
    want_y = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs)
    cot = rng.standard_normal(np.shape(flat(want_y)[0]))
    want = ssmc.grad(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, grad_outputs=cot)
    tensors = {k: torch.tensor(v) for k, v in inputs.items()}
    f = ssmc.compile(m.SPEC, "cuda", layout=m.LAYOUT)
    g = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)
    op = ssmc_torch.function(m.SPEC, "cuda", layout=m.LAYOUT)
    names = [d.name for d in m.SPEC.program.inputs]
    for call in range(3):
        assert rel_err(flat(f(**tensors))[0], flat(want_y)[0]) <= 1e-10, call
        got = g(**tensors, grad_outputs=torch.tensor(cot))
        for key in want:
            assert rel_err(got[key], want[key]) <= 1e-9, (call, key)
        leaves = {k: tensors[k].clone().requires_grad_(True) for k in inputs}
        states = {k: v for k, v in leaves.items() if k not in names}  # the initial state, by name
        ys = flat(op(*(leaves[k] for k in names), **states))
        grads = torch.autograd.grad(ys[0], list(leaves.values()), torch.tensor(cot))
        for key, gr in zip(leaves, grads):
            assert rel_err(gr, want[key]) <= 1e-9, (call, "op", key)
    if name in ("hgrn", "mamba1"):  # one launch a run, no matrix products, not staged: all prepared
        assert f._calls and g._steps and op._lean


def test_an_emulated_block_that_never_finishes_is_an_error():
    """Threads waiting at barriers the others never reach (half a warp at __syncwarp, the rest at
    __syncthreads): the launch raises `EmulatedHang` as soon as no thread can go on, not a hung run."""
    source = ('extern "C" __global__ void stuck(int L, int nblk, float* __restrict__ y)\n{\n'
              "    if (threadIdx.x % 32 < 16) __syncwarp(); else __syncthreads();\n    y[threadIdx.x] = 1.0f;\n}\n")
    y = np.zeros(64, np.float32)
    with pytest.raises(emulator.EmulatedHang, match="block 0 of 1"):
        emulator.emulated(source, "stuck")((1, 64), 1, 1, [y.ctypes.data])
    assert not y.any()


def test_an_emulated_block_that_loops_forever_through_barriers_is_an_error(monkeypatch):
    """A loop through barriers that never ends runs past SSMC_EMULATE_TIMEOUT seconds: `EmulatedHang`.
    The next launch in the same process (the stuck block's fibers abandoned) runs as usual."""
    monkeypatch.setenv("SSMC_EMULATE_TIMEOUT", "0.5")
    source = ('extern "C" __global__ void spin(int L, int nblk, float* __restrict__ y)\n{\n'
              "    while (y[0] == 0.0f) __syncthreads();\n}\n")
    y = np.zeros(64, np.float32)
    with pytest.raises(emulator.EmulatedHang, match=r"ran past 0\.5 s"):
        emulator.emulated(source, "spin")((2, 64), 1, 1, [y.ctypes.data])
    source = ('extern "C" __global__ void fill(int L, int nblk, float* __restrict__ y)\n{\n'
              "    __shared__ float s[64];\n    s[63 - threadIdx.x] = (float)threadIdx.x;\n    __syncthreads();\n"
              "    y[blockIdx.x * 64 + threadIdx.x] = s[threadIdx.x] + __shfl_xor_sync(~0u, 1.0f * threadIdx.x, 1);\n"
              "}\n")
    y = np.zeros(128, np.float32)
    emulator.emulated(source, "fill")((2, 64), 1, 1, [y.ctypes.data])
    t = np.arange(64)
    np.testing.assert_array_equal(y, np.tile(63 - t + (t ^ 1), 2).astype(np.float32))


def test_emulation_is_never_the_default_backend(monkeypatch):
    """With SSMC_CUDA_EMULATE=1 the cuda backend runs where asked for (`ssmc demo --backend cuda`
    names the emulation as its device) but is not picked by default: it is for tests, and slow."""
    from ssmc.backends.registry import default_backend
    from ssmc.cli import _device

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    assert default_backend() == "numba"
    assert "emulated" in _device("cuda")

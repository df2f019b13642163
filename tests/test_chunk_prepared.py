"""Prepared calls of a chunked core (backends/cuda/kernels/chunk: `PreparedForward`, `mma.ForwardPlan`), emulated
(``SSMC_CUDA_EMULATE=1``), RetNet's core at the kernels' smallest sizes (K = V = 64, one chunk of 64 steps, bf16):
the plan worked out at the first call of a layout is taken by the calls after it (no plan made again), gives
the general path's results bit for bit, and is not taken where the layout differs (another storage offset:
a plan of its own; other strides or options: another call key, so another prepared call)."""

from __future__ import annotations

import numpy as np
import pytest
from profiles import nightly_case
from test_chunk_kernels import _core, _core_inputs, count_prepared_calls

from ssmc.backends.cuda import emulator

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")

LENGTH = 64  # one whole chunk: the sources the other emulated chunk tests build (no module compiled anew)


@pytest.fixture
def counted(monkeypatch):
    """{"plans": plans a prepared call made, "general": `ChunkedCore.forward` calls, "launches": kernel launch sets
    run (either path)}, the chunk backend emulated."""
    from ssmc.backends.cuda.kernels.chunk import mma

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    for name in ("SSMC_CUDA_CHUNK_KERNELS", "SSMC_CUDA_CHUNK", "SSMC_CUDA_CHUNK_OUTPUT", "SSMC_CUDA_CHUNK_STATES"):
        monkeypatch.delenv(name, raising=False)
    counts = count_prepared_calls(monkeypatch, {"plans": 0, "general": 0, "launches": 0})

    def run(*a, _f=mma._run_specs):
        counts["launches"] += 1
        return _f(*a)
    monkeypatch.setattr(mma, "_run_specs", run)
    return counts


def _equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].shape == want[k].shape and got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


def test_prepared_run_takes_its_plan_and_gives_the_general_runs_results(counted):
    from ssmc.backends.cuda.kernels.chunk import ChunkedCore

    program, sizes = _core("retnet")
    core = ChunkedCore(program, "float32")
    seqs, params, initial = _core_inputs(program, sizes, LENGTH, np.random.default_rng(1), torch.bfloat16)
    run = core.prepare_run(seqs, params, initial, sizes, LENGTH, torch.bfloat16)
    for call in range(2):  # new values each call, the same arrays' layouts: one plan
        rng = np.random.default_rng(10 + call)
        seqs, params, initial = _core_inputs(program, sizes, LENGTH, rng, torch.bfloat16)
        want = core.run(seqs, params, initial, sizes, LENGTH, out_dtype=torch.bfloat16)
        got = run(seqs, params, initial)
        _equal(got[0], want[0])
        _equal(got[1], want[1])
    # (the first call general, as it works the plan out)
    assert counted["plans"] == 1 and counted["general"] == 3 and counted["launches"] == 4
    # q at another storage offset (the same shape and strides: the same signature): a plan of its own
    q = seqs["q"]
    buffer = torch.zeros(q.numel() + 8, dtype=q.dtype)
    moved = buffer[8:].view(q.shape)
    moved.copy_(q)
    want = core.run({**seqs, "q": moved}, params, initial, sizes, LENGTH, out_dtype=torch.bfloat16)
    got = run({**seqs, "q": moved}, params, initial)
    _equal(got[0], want[0])
    assert counted["plans"] == 2
    _equal(run(seqs, params, initial)[0], core.run(seqs, params, initial, sizes, LENGTH, out_dtype=torch.bfloat16)[0])
    assert counted["plans"] == 2  # the first layout's plan kept
    # the decays written in place (RetNet's gamma, a param: its log kept per array as it stands): read again
    params["gamma"].mul_(0.5)
    fresh = ChunkedCore(program, "float32")  # (nothing kept from the calls before)
    want = fresh.run(seqs, params, initial, sizes, LENGTH, out_dtype=torch.bfloat16)
    got = run(seqs, params, initial)
    _equal(got[0], want[0])
    _equal(got[1], want[1])


@pytest.mark.parametrize("name, length", [
    ("retnet", LENGTH),
    nightly_case("mamba2", 128, reason="SSD's core (β, skip, B and C summed over heads) on 128-step chunks: the "
                 "retnet case takes the same plans' paths")])
def test_prepared_training_forward_and_backward_are_the_general_ones(counted, name, length):
    """`prepare_forward` (a tape whose `Chunks` are made only where the backward asks) and `prepare_backward` on its
    tape (`PreparedBackward`: the second call on its plan): outputs, final state and every gradient bit for bit the
    general path's."""
    from ssmc.backends.cuda.kernels.chunk import ChunkedCore, PreparedBackward
    from ssmc.passes.autodiff import GRAD

    program, sizes = _core(name)
    core = ChunkedCore(program, "float32")
    rng = np.random.default_rng(2)
    seqs, params, initial = _core_inputs(program, sizes, length, rng, torch.bfloat16)
    want_outs, want_finals, want_tape = core.forward(seqs, params, initial, sizes, length)
    forward = core.prepare_forward(seqs, params, initial, sizes, length)
    out, state = core.output, program.states[0].name
    cot = {GRAD + out: torch.from_numpy(rng.standard_normal(tuple(want_outs[out].shape))).to(torch.bfloat16)}
    lam = {GRAD + state: torch.from_numpy(rng.standard_normal(tuple(want_finals[state].shape))).float()}
    want = core.backward(seqs, params, want_tape, cot, lam, None, sizes, length)
    backward = core.prepare_backward(seqs, params, want_tape, cot, lam, None, sizes, length)
    for _ in range(3):  # each first call general (its plan made), then on the plans
        outs, finals, tape = forward(seqs, params, initial)
        _equal(outs, want_outs)
        _equal(finals, want_finals)
        got = backward(seqs, params, tape, cot, lam, None)
        _equal(got[0], want[0])
        _equal(got[1], want[1])
    assert counted["plans"] == 1 and counted["general"] == 2
    assert isinstance(backward, PreparedBackward) and len(backward.plans) == 1 and all(backward.plans.values())


def test_compiled_calls_of_other_strides_or_options_are_prepared_apart(counted, monkeypatch):
    """Through `ssmc.compile`: q with other strides, and SSMC_CUDA_CHUNK_KERNELS=0, are other call keys (no plan
    of the first taken: the torch path launches no kernel), each result the first call's (within bf16 rounding
    for the torch path)."""
    import ssmc
    from ssmc.examples import retnet

    rng = np.random.default_rng(3)
    inputs = retnet.make_inputs(rng, LENGTH, batch=1, heads=2, dk=64, dv=64)
    tensors = {k: torch.tensor(v).to(torch.bfloat16 if k in ("q", "k", "v") else torch.float32)
               for k, v in inputs.items()}
    f = ssmc.compile(retnet.SPEC, "cuda", layout=retnet.LAYOUT)
    first = f(**tensors)
    assert torch.equal(f(**tensors), first) and torch.equal(f(**tensors), first)
    assert counted["plans"] == 1 and counted["launches"] == 3  # one plan, made at the first (general) call
    q = tensors["q"]
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # [b, t, h, k] with h outer: other strides
    assert strided.stride() != q.stride()
    for _ in range(2):
        assert torch.equal(f(**{**tensors, "q": strided}), first)
    assert counted["plans"] == 2 and len(f._calls) == 2
    monkeypatch.setenv("SSMC_CUDA_CHUNK_KERNELS", "0")
    launches = counted["launches"]
    for _ in range(2):
        got = f(**tensors)
        assert float((got.double() - first.double()).norm() / first.double().norm()) < 1e-2
    assert counted["launches"] == launches and len(f._calls) == 3


@pytest.mark.parametrize("length, dkv", [(LENGTH, "split"), (70, "split"), (LENGTH, "fused")])
def test_torch_op_calls_with_16_bit_inputs_take_the_prepared_step(counted, monkeypatch, length, dkv):
    """`ssmc.torch.function` of RetNet with bf16 q, k, v: from the second call of a signature its plan calls the
    prepared step directly in the inputs' 16-bit context (`_HalfStep`, as `Grad.forward` would, without its
    look-ups); outputs and every gradient bit for bit the first (general) call's. At 70 steps (chunks of 64: the
    last of 6 steps, padded) as well: the core's plan made once, the third call on it; and with dk and dv from one
    kernel (SSMC_CUDA_CHUNK_DKV=fused: the prepared plan asks the backward's which gradients it writes)."""
    monkeypatch.setenv("SSMC_CUDA_CHUNK_DKV", dkv)
    import ssmc.torch
    from ssmc import torch as ssmc_torch
    from ssmc.examples import retnet

    taken = []
    forward = ssmc_torch._HalfStep.forward
    monkeypatch.setattr(ssmc_torch._HalfStep, "forward",
                        lambda self, *a: (taken.append(self.half), forward(self, *a))[1])
    if length != LENGTH:
        monkeypatch.setenv("SSMC_CUDA_CHUNK", "64")
    rng = np.random.default_rng(4)
    inputs = retnet.make_inputs(rng, length, batch=1, heads=2, dk=64, dv=64)
    tensors = {k: torch.tensor(v).to(torch.bfloat16 if k in ("q", "k", "v") else torch.float32)
               for k, v in inputs.items()}
    f = ssmc.torch.function(retnet.SPEC, "cuda", layout=retnet.LAYOUT)
    dy = None
    results = []
    for _ in range(3):
        leaves = {k: t.clone().requires_grad_(k in ("q", "k", "v")) for k, t in tensors.items()}
        y = f(**leaves)
        dy = torch.from_numpy(rng.standard_normal(tuple(y.shape))).to(y.dtype) if dy is None else dy
        y.backward(dy)
        results.append([y.detach(), *(leaves[k].grad for k in ("q", "k", "v"))])
    assert taken == [torch.bfloat16, torch.bfloat16]
    # the general forward at the first call and at the prepared forward's first (which makes the plan) only
    assert counted["plans"] == 1 and counted["general"] == 2
    for got in results[1:]:
        for a, b in zip(got, results[0], strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_ssd_training_step_memory_does_not_grow():
    """bench/chunk_memory.py's SSD training step (B4 L4096 H32 P64 N128 bf16, emulated, no launches: every
    allocation's size and lifetime as on the GPU) peaks at 302 MiB on the host's count, as chunk_dv's output (the
    gradient of x) is made while d_end, the tape's entering states and y are live: a plan holding an array past its
    last use (the head subsets' partial sums once added, d_end after chunk_dv, the row dots' parts once summed, the
    final state's cotangent copied for the states pass, say) shows here. The gradient of x the
    backward kernels write time first comes in bf16 (64 MiB, chunk_dv_ho), no fp32 array of it (128 MiB: the peak
    was 383 MiB with it, at chunk_dv); chunk_dstates_pass keeps no fp32 chunk sums (128 MiB: the peak was 361 MiB
    with them)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "bench" / "chunk_memory.py"), "--min-mib", "64"], cwd=root,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    peak = next(float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("peak "))
    assert peak <= 303.0, done.stdout[-3000:]
    # the time-first gradient of x as `ChunkedCore._made_out` makes it (the allocations of 64 MiB and more listed)
    made = [line for line in done.stdout.splitlines() if line.startswith("alloc") and "(4096, 4, 1, 32, 64)" in line
            and "(_time_first_out) <" in line and "(out) <" in line]
    assert made and all(" bfloat16 64.0 MiB" in line for line in made), "\n".join(made)


def test_an_expanded_cotangent_gives_the_contiguous_ones_gradients(counted):
    """dO as `y.sum().backward()` gives it, a scalar expanded (every stride 0): the kernels read a contiguous copy,
    which must outlive their launches (the backward's plain and prepared paths), and the prepared backward must
    take it in the layout its plan was made for; every gradient as from the same cotangent made contiguous."""
    from ssmc.backends.cuda.kernels.chunk import ChunkedCore
    from ssmc.passes.autodiff import GRAD

    program, sizes = _core("retnet")
    core = ChunkedCore(program, "float32")
    seqs, params, initial = _core_inputs(program, sizes, LENGTH, np.random.default_rng(5), torch.bfloat16)
    outs, finals, tape = core.forward(seqs, params, initial, sizes, LENGTH)
    out, state = core.output, program.states[0].name
    expanded = torch.ones((), dtype=torch.bfloat16).expand(outs[out].shape)
    lam = {GRAD + state: torch.zeros(tuple(finals[state].shape))}
    want = core.backward(seqs, params, tape, {GRAD + out: expanded.contiguous()}, lam, None, sizes, LENGTH)
    assert all(float(w.abs().max()) > 0 for w in want[0].values())
    _equal(core.backward(seqs, params, tape, {GRAD + out: expanded}, lam, None, sizes, LENGTH)[0], want[0])
    forward = core.prepare_forward(seqs, params, initial, sizes, LENGTH)
    backward = core.prepare_backward(seqs, params, tape, {GRAD + out: expanded}, lam, None, sizes, LENGTH)
    for _ in range(3):  # the first call general, then on the plans
        _, _, tape = forward(seqs, params, initial)
        got = backward(seqs, params, tape, {GRAD + out: expanded}, lam, None)
        _equal(got[0], want[0])


def _new_plans(monkeypatch) -> dict:
    """{"forward": `mma.ForwardPlan`s made, "backward": `mma.BackwardPlan`s made} from now on."""
    from ssmc.backends.cuda.kernels.chunk import mma

    made = {"forward": 0, "backward": 0}
    for name, cls in (("forward", mma.ForwardPlan), ("backward", mma.BackwardPlan)):
        def init(self, *a, _f=cls.__init__, _name=name, **kw):
            made[_name] += 1
            _f(self, *a, **kw)
        monkeypatch.setattr(cls, "__init__", init)
    return made


@pytest.mark.parametrize("name, length, chunk", [
    ("retnet", 7, None),      # one chunk of 64 (the kernels' choice for a short call), 57 steps padded
    ("mamba2", 70, 64),       # two chunks, the last of 6 steps; β, the skip, B and C summed over 2 heads
    nightly_case("retnet", 1, None, reason="one step: the 7-step case takes the same paths"),
    nightly_case("retnet", 127, None, reason="a chunk of 128 one step short: the 70-step case's host paths"),
    nightly_case("retnet", 129, 64, reason="three chunks, the last of one step: the 70-step case's host paths"),
    nightly_case("mamba2", 180, None, reason="the short SSD workload's 128 + 52 steps: the 70-step case's paths"),
    nightly_case("retnet", 300, 256, reason="chunks of 256: the 64- and 128-step cases take the same host paths")])
def test_prepared_partial_last_chunk_takes_its_plans_and_gives_the_general_results(counted, monkeypatch, name,
                                                                                    length, chunk):
    """A length that is no multiple of the chunk (the operands padded to whole chunks each call): the prepared
    forward and backward make their plans once (the second call of the signature makes none, the third neither)
    and give the first, general, call's outputs, final state and every gradient bit for bit."""
    from ssmc.backends.cuda.kernels.chunk import ChunkedCore, PreparedBackward, PreparedTape
    from ssmc.passes.autodiff import GRAD

    if chunk is not None:
        monkeypatch.setenv("SSMC_CUDA_CHUNK", str(chunk))
    program, sizes = _core(name)
    if name == "retnet":
        sizes = {**sizes, "h": 1}
    core = ChunkedCore(program, "float32")
    rng = np.random.default_rng(7)
    seqs, params, initial = _core_inputs(program, sizes, length, rng, torch.bfloat16)
    forward = core.prepare_forward(seqs, params, initial, sizes, length)
    made = _new_plans(monkeypatch)
    arranged = []  # `_arrange`'s own copies (a prepared call's are `_Padding`'s, in one allocation)
    monkeypatch.setattr(ChunkedCore, "_arrange", lambda *a, _f=ChunkedCore._arrange: (arranged.append(a), _f(*a))[1])
    out, state = core.output, program.states[0].name
    first = None
    for call in range(3):  # the first call general (its plans made), then on the plans
        arranged.clear()
        outs, finals, tape = forward(seqs, params, initial)
        assert first is None or not arranged
        if first is None:
            assert not isinstance(tape, PreparedTape) and counted["general"] == 1
            cot = {GRAD + out: torch.from_numpy(rng.standard_normal(tuple(outs[out].shape))).to(torch.bfloat16)}
            lam = {GRAD + state: torch.from_numpy(rng.standard_normal(tuple(finals[state].shape))).float()}
            backward = core.prepare_backward(seqs, params, tape, cot, lam, None, sizes, length)
            assert isinstance(backward, PreparedBackward)
        else:
            assert isinstance(tape, PreparedTape)
        grads = backward(seqs, params, tape, cot, lam, None)
        if first is None:
            first = (outs, finals, *grads)
            assert made == {"forward": 2, "backward": 1}  # (`_plan`'s, and the general path's own)
            continue
        for got, want in zip((outs, finals, *grads), first, strict=True):
            _equal(got, want)
        assert made == {"forward": 2, "backward": 2}, call  # the backward's plan made at its first prepared call
    assert counted["general"] == 1 and counted["plans"] == 1
    assert forward.padded
    assert len(backward.plans) == 1 and all(backward.plans.values())

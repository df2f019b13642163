"""The lanes kernel's step form (kernels/lanes/step.py): a call of one step of a program the lanes strategy
takes runs it (no chunks staged in shared memory), emulated on the CPU (``SSMC_CUDA_EMULATE=1``) against the
interpreter; at decode sizes it compiles for sm_90 without spills (NVRTC); ``SSMC_CUDA_LANES_STEP=0`` keeps the
chunked kernel."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from test_cuda import rel_err

import ssmc
from ssmc.backends.cuda import emulator, nvrtc
from ssmc.backends.cuda.kernels import lanes
from ssmc.backends.cuda.kernels.lanes import step as lanes_step

torch = pytest.importorskip("torch")

emulated_only = pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")


def _recording(fn, sources: list):
    def record(*args, **kwargs):
        sources.append(fn(*args, **kwargs))
        return sources[-1]
    return record


def _mamba1(length: int, batch: int, dim: int, state: int, seed: int = 0):
    m = importlib.import_module("ssmc.examples.mamba1")
    inputs = m.make_inputs(np.random.default_rng(seed), length, batch=batch, dim=dim, state=state)
    return m, {k: v.astype(np.float32).astype(np.float64) for k, v in inputs.items()}


@emulated_only
@pytest.mark.parametrize("batch, dim, state", [
    (2, 40, 128),  # 8 lanes a row owning 16 n each, 16 rows a block: 3 blocks a batch row, the last 8 rows past d
    (3, 20, 33),   # 8 lanes owning 5 n (the last lane 33 - 32 = 1: the guard on n)
    (2, 8, 16),    # 4 lanes owning 4 n
])
def test_emulated_mamba1_step_runs_the_step_form(batch, dim, state, monkeypatch, fresh_runners):
    """Mamba-1 float32 "b d t", one step through `ssmc.step` in place and the full call at L = 1: the lanes
    strategy (no fill threshold at one step) prints the step form (nothing in shared memory); the outputs and
    new states equal the interpreter's within 1e-5 (float32 sums over n in another order)."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    m, inputs = _mamba1(1, batch, dim, state)
    want_y, want_h = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, return_final_states=True)
    sources = []
    monkeypatch.setattr(lanes, "lanes_step_source", _recording(lanes.lanes_step_source, sources))
    t = {k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()}
    got_y, got_h = ssmc.compile(m.SPEC, "cuda", layout=m.LAYOUT)(**t, return_final_states=True)
    assert rel_err(got_y, want_y) <= 1e-5 and rel_err(got_h, want_h) <= 1e-5
    assert sources and "nothing staged" in sources[-1] and "__shared__" not in sources[-1].split("mamba1_fused(")[1]

    step = ssmc.step(m.SPEC, "cuda", layout=m.LAYOUT)
    h = t.pop("h").clone()
    one = {k: (v[..., 0] if k in ("u", "delta", "B", "C", "z") else v) for k, v in t.items()}
    y = torch.empty(batch, dim)
    step(**one, states=h, out=y, in_place=True)
    assert {p.strategy for p in step._own.plans.values()} == {"lanes"}
    assert rel_err(y, want_y[..., 0]) <= 1e-5 and rel_err(h, want_h) <= 1e-5


@emulated_only
def test_emulated_step_form_walks_many_steps(monkeypatch, fresh_runners):
    """The step form is correct at any length (a kernel built for one step that a longer call reused would
    still be right): forced for a call of 6 steps, Mamba-1's outputs and final states against the interpreter."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setattr(lanes, "LANES_FILL", 1)
    m, inputs = _mamba1(6, 2, 24, 40, seed=3)
    want_y, want_h = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, return_final_states=True)
    forced = []

    def source(self, runner, k, specs, sizes, mapping, length):
        forced.append(length)
        return lanes.lanes_step_source(runner.lowered, runner.state_lanes, k, specs, sizes, mapping, runner.ctype)
    monkeypatch.setattr(lanes.Lanes, "source", source)
    got_y, got_h = ssmc.compile(m.SPEC, "cuda", layout=m.LAYOUT)(
        **{k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()}, return_final_states=True)
    assert forced == [6]
    assert rel_err(got_y, want_y) <= 1e-5 and rel_err(got_h, want_h) <= 1e-5


def test_lanes_step_option_keeps_the_chunked_kernel(monkeypatch, fresh_runners):
    """At B1 D2048 N128 one step is the lanes strategy (fewer threads than its fill threshold: before, a thread
    per (b, d) walking its 128 n); with ``SSMC_CUDA_LANES_STEP=0`` the selection is the old one (fused), and
    at B64 the chunked kernel's source (chunks of 8 steps)."""
    from ssmc.backends.cuda.kernels.lanes.forward import lanes_source
    from ssmc.backends.cuda.printer import ArraySpec
    from ssmc.backends.cuda.runner import runner_for

    m = importlib.import_module("ssmc.examples.mamba1")
    runner = runner_for(m.SPEC.program, "float32")
    small, big = {"b": 1, "d": 2048, "n": 128}, {"b": 64, "d": 2048, "n": 128}
    assert runner.strategy(small, 1, True) == "lanes" and runner.strategy(small, 2, True) != "lanes"
    monkeypatch.setenv("SSMC_CUDA_LANES_STEP", "0")
    assert runner.strategy(small, 1, True) != "lanes" and runner.strategy(big, 1, True) == "lanes"
    (launch,) = runner.launches(big, 1, True)
    specs = {a.name: ArraySpec("float32", (1,) * len(a.axes)) for a in launch.kernel.arrays}
    assert runner.source_for(launch.kernel, specs, big, launch.mapping, 1, "lanes") == lanes_source(
        runner.lowered, runner.state_lanes, launch.kernel, specs, big, launch.mapping, runner.ctype)


def test_training_forward_at_one_step_keeps_its_strategy(fresh_runners):
    """The step form is the plain forward's alone: a training step's forward (its round carries) at L = 1 asks
    the table without it (`Shape.step`), so the fused backward takes the lanes forward and backward where it
    did before (B64 D2048 N128: the lanes forward), not at B2 D8 N16 (fewer threads than the fill threshold),
    where the plain forward's one step is the step form."""
    from ssmc.backends.cuda.fused_backward import fused_backward_runner
    from ssmc.passes.autodiff import derive_backward

    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    fb = fused_backward_runner(derive_backward(program), "float32")
    small, big = {"b": 2, "d": 8, "n": 16}, {"b": 64, "d": 2048, "n": 128}
    assert fb.forward_runner.strategy(small, 1, True) == "lanes"
    assert fb.forward_runner.strategy(small, 1, True, step=False) != "lanes"
    assert fb.forward_lanes(small, 1, True) is None and fb.backward_lanes(small, 1, True) is None
    assert fb.forward_lanes(big, 1, True) is not None


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("name, sizes", [("mamba1", dict(batch=64, dim=2048, state=128)),
                                         ("mamba1", dict(batch=64, dim=1536, state=16)),
                                         ("mamba2", dict(batch=16, groups=1, heads=32, headdim=64, state=128))])
def test_step_form_compiles_without_spills(name, sizes, monkeypatch):
    """The in-place step's kernel at decode sizes (planned through the emulated backend, not run) is the step
    form and compiles for sm_90 without spills; Mamba-1 at N = 128 bounded to STEP_REGISTERS (8 blocks of 128
    threads an SM; the chunked kernel took 168 registers and spilled)."""
    from ssmc.backends.cuda import runner as runner_module
    from ssmc.backends.cuda.source import compile_options

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    m = importlib.import_module(f"ssmc.examples.{name}")
    p = m.SPEC.program
    seq_time, _ = ssmc.api.time_positions(p, m.LAYOUT)
    values = m.make_inputs(np.random.default_rng(5), 1, **sizes)
    one = {d.name: torch.tensor(values[d.name], dtype=torch.float32) for d in p.inputs}
    one = {n: (x.select(seq_time[n], 0) if n in seq_time else x) for n, x in one.items()}
    states = {s.name: torch.tensor(values[s.name], dtype=torch.float32) for s in p.states}
    sources = []
    monkeypatch.setattr(runner_module.CudaRunner, "function", lambda self, source, kernel: sources.append(source))
    step = ssmc.step(m.SPEC, "cuda", layout=m.LAYOUT)
    plan = step._own._plan(one, states, None, True)
    assert plan is not None and plan.strategy == "lanes"
    (source,) = sources
    assert "nothing staged" in source
    (resources,) = nvrtc.compile_source(source, "sm_90", options=compile_options(source)).resources.values()
    assert not resources.spills, resources.summary()
    if name == "mamba1" and sizes["state"] == 128:
        assert f"__launch_bounds__(128, {lanes_step.REGISTER_FILE // (128 * lanes_step.STEP_REGISTERS)})" in source
        assert resources.registers <= lanes_step.STEP_REGISTERS, resources.summary()


@pytest.mark.gpu
@pytest.mark.parametrize("batch, dim, state", [(64, 2048, 128), (1, 2048, 128), (64, 1536, 16)])
def test_gpu_mamba1_decode_step(batch, dim, state, monkeypatch):
    """On a GPU, float32, Mamba-1 at decode sizes: an in-place step (the step form) against the example's NumPy
    reference in float64 (within 1e-5 of the largest value) and against ``SSMC_CUDA_LANES_STEP=0``'s step (the
    chunked lanes kernel, or a thread per (b, d) at B1) within 1e-6."""
    m, inputs = _mamba1(1, batch, dim, state, seed=11)
    want_y, want_h = m.reference(**inputs)
    t = {k: torch.tensor(v, dtype=torch.float32, device="cuda") for k, v in inputs.items()}
    one = {k: (v[..., 0].contiguous() if k in ("u", "delta", "B", "C", "z") else v) for k, v in t.items() if k != "h"}
    results = []
    for setting in ("1", "0"):
        monkeypatch.setenv("SSMC_CUDA_LANES_STEP", setting)
        step = ssmc.step(m.SPEC, "cuda", layout=m.LAYOUT)
        h, y = t["h"].clone(), torch.empty(batch, dim, device="cuda")
        step(**one, states=h, out=y, in_place=True)
        torch.cuda.synchronize()
        results.append((y.cpu(), h.cpu()))
    (y, h), (y0, h0) = results
    assert rel_err(y, want_y[..., 0]) <= 1e-5 and rel_err(h, want_h) <= 1e-5
    assert rel_err(y, y0.numpy()) <= 1e-6 and rel_err(h, h0.numpy()) <= 1e-6

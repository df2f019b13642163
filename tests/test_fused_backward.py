"""The fused backward of diagonal-linear programs (kernels/warp/backward_analysis.py, backends/cuda/fused_backward.py).

On the CPU: the per-thread terms of the partial adjoint add up to the adjoint (interpreter), which
programs fuse, and the two kernels compile for sm_80 / sm_90 without spills. On a GPU (marked
`gpu`): forward and every gradient against the interpreter, at L = 1 ... 4097, float64 / float32 /
bfloat16, with initial and final state cotangents, random specs, and `gradcheck` through ssmc.torch.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from profiles import examples
from strategies import diagonal_linear_recurrences, draw_inputs

import ssmc
from ssmc.backends import interpreter
from ssmc.backends.cuda import nvrtc
from ssmc.backends.cuda.kernels.warp.backward_analysis import fused_backward, partial_adjoint
from ssmc.lowering.kernel import independent_axes
from ssmc.passes.autodiff import derive_backward

FUSED = ["hgrn", "mamba1"]
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                                        HealthCheck.filter_too_much]}


def rel_err(a, b, floor: float = 1e-30) -> float:
    """max |a - b| / max |b|, the scale bounded below by `floor`."""
    a = a.detach().double().cpu().numpy() if hasattr(a, "detach") else np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), floor)) if b.size else 0.0


# -- CPU: the rewrite --------------------------------------------------------------------------


def _check_partials_add_up(program, seqs, params, initial, sizes, length, rng):
    """The partial adjoint's outputs and accumulators, summed over the axes each lacks, against the
    adjoint's (interpreter, float64); inputs time first, the forward's carries computed."""
    bw = derive_backward(program)
    partials = partial_adjoint(bw.adjoint, independent_axes(program))
    assert partials is not None
    prev, _ = interpreter.run_recurrence(bw.carries, seqs, params, initial, sizes, length)
    seqs = {**seqs, **{s.name: prev[f"prev_{s.name}"] for s in program.states}}
    seqs.update({f"grad_{n}": rng.standard_normal((length, *(sizes[a] for a in y.axes))) for n, y in program.outputs})
    init = {s.name: rng.standard_normal(tuple(sizes[a] for a in s.axes)) for s in bw.adjoint.states}
    want_outs, want_finals = interpreter.run_recurrence(bw.adjoint, seqs, params, init, sizes, length)
    p = partials.program
    start = {s.name: (np.zeros(tuple(sizes[a] for a in s.axes)) if s.name in partials.accumulators else init[s.name])
             for s in p.states}
    got_outs, got_finals = interpreter.run_recurrence(p, seqs, params, start, sizes, length)

    def summed(x, axes, keep):
        letters = {a: chr(97 + i) for i, a in enumerate(axes)}
        return np.einsum(f"{''.join(letters[a] for a in axes)}->{''.join(letters[a] for a in keep)}", x)

    for name, y in p.outputs:
        got = got_outs[name]
        if name in partials.atomic:  # the threads' terms, summed over the axes the output lacks
            got = summed(got, ("t", *y.axes), ("t", *partials.atomic[name]))
        assert rel_err(got, want_outs[name]) <= 1e-10, name  # another order of the sum: rounding only
    for s in p.states:
        got = got_finals[s.name]
        if s.name in partials.accumulators:
            got = init[s.name] + summed(got, s.axes, partials.accumulators[s.name])
        assert rel_err(got, want_finals[s.name]) <= 1e-10, s.name


@pytest.mark.parametrize("length", [1, 7, 180])
@pytest.mark.parametrize("name", [*FUSED, "mingru"])
def test_partial_adjoint_terms_add_up_to_the_adjoint(name, length):
    """Mamba-1's grad_B / grad_C (sums over d) and grad_A / grad_D / grad_delta_bias (over b and time),
    minGRU's grad_x (a sum of sums over d) and its weight gradients, left to the threads: their terms
    summed afterwards equal the adjoint's results (float64 interpreter)."""
    from ssmc.runtime.binding import layout_of

    m = importlib.import_module(f"ssmc.examples.{name}")
    program = m.SPEC.program
    rng = np.random.default_rng(length)
    inputs = m.make_inputs(rng, length)
    seqs = {}
    for d in program.seqs:  # time first
        order = layout_of(m.LAYOUT, d.name, d.axes)
        seqs[d.name] = np.transpose(inputs[d.name], [order.index(a) for a in ("t", *d.axes)])
    params = {d.name: inputs[d.name] for d in program.params}
    sizes = {a: n for d in program.params + program.states for a, n in zip(d.axes, np.shape(inputs[d.name]))}
    sizes.update({a: seqs[d.name].shape[1 + i] for d in program.seqs for i, a in enumerate(d.axes)})
    initial = {s.name: inputs[s.name] for s in program.states}
    _check_partials_add_up(program, seqs, params, initial, sizes, length, rng)


# each example compiles a fusing spec's kernels with NVRTC (14 s on CI's 2 cores): 5 in CI (tests/profiles.py)
@settings(max_examples=examples(20, ci=5), **SETTINGS)
@given(spec=diagonal_linear_recurrences(), seed=st.integers(0, 2**16))
def test_random_partial_adjoints_add_up(spec, seed):
    """And, where the fused backward takes the spec, its two kernels compile through NVRTC."""
    program = spec.program
    bw = derive_backward(program)
    # most random specs have scalar states, or a root the rewrite leaves alone (the unfused path runs them)
    assume(independent_axes(program) and partial_adjoint(bw.adjoint, independent_axes(program)) is not None)
    rng = np.random.default_rng(seed)
    inputs = draw_inputs(spec, 7, seed)
    sizes = {a: n for d in program.decls for a, n in
             zip(d.axes, np.shape(inputs[d.name])[1:] if d in program.seqs else np.shape(inputs[d.name]))}
    _check_partials_add_up(program, {d.name: inputs[d.name] for d in program.seqs},
                           {d.name: inputs[d.name] for d in program.params},
                           {s.name: inputs[s.name] for s in program.states}, sizes, 7, rng)
    from ssmc.backends.cuda.fused_backward import fused_backward_runner

    fused = fused_backward_runner(bw, "float64")
    sources = fused.sources(sizes, 7) if fused is not None else []
    if len(sources) == 3:  # the forward without outputs: the forward's own lines, less its stores
        forward, summary = (source.split("__global__")[-1].splitlines() for _, source in (sources[0], sources[2]))
        extra = [line for line in summary[1:] if line not in forward and "const bool vec" not in line]
        assert not extra and not any("out_" in line for line in summary), extra
    if nvrtc.available():  # its kernels compile (GPU tests run them)
        for launch, source in sources:
            nvrtc.compile_source(source, arch="sm_90", name=f"{launch.kernel.name}.cu")


def test_which_programs_fuse():
    """Diagonal-linear forwards with per-recurrence states fuse; matrix-linear and nonlinear ones do not,
    nor minGRU, whose weight-gradient terms span its input axis i (a row of i per thread)."""
    got = {}
    for name in ["hgrn", "mamba1", "mingru", "mamba2", "linear_attention", "retnet", "lstm", "gru"]:
        program = importlib.import_module(f"ssmc.examples.{name}").SPEC.program
        got[name] = fused_backward(derive_backward(program)) is not None
    assert got == {"hgrn": True, "mamba1": True, "mingru": False, "mamba2": False, "linear_attention": False,
                   "retnet": False, "lstm": False, "gru": False}
    plan = fused_backward(derive_backward(importlib.import_module("ssmc.examples.mamba1").SPEC.program))
    assert plan.partials.atomic == {"grad_B": ("b", "n"), "grad_C": ("b", "n")}
    assert set(plan.partials.accumulators) == {"grad_A", "grad_D", "grad_delta_bias"}
    assert plan.core == ("grad_h",)
    # softplus(delta + bias) and exp(dt A): computed by the forward's summary, read by the three later steps
    shared = dict(plan.forward_summary.program.outputs)
    assert [shared[v].op.name for v in plan.shared] == ["SOFTPLUS", "EXP"]


def test_when_the_fused_backward_runs(monkeypatch):
    """Where the forward is the warp kernel (time contiguous, at least two rounds) and the adjoint
    sums over recurrences (Mamba-1); as the lanes backward wherever the forward is the lanes kernel
    (Mamba-1 with many rows, either layout); a plain scan (hgrn) only when forced; never when turned
    off, or for a program run in fusion stages (the block)."""
    from ssmc.backends.cuda.fused_backward import fused_backward_runner

    def runner(name):
        program = importlib.import_module(f"ssmc.examples.{name}").SPEC.program
        return fused_backward_runner(derive_backward(program))

    mamba, scan = runner("mamba1"), runner("hgrn")
    big = {"b": 8, "d": 1536, "n": 16}
    # the lanes backward wherever the forward is the lanes kernel (8192 rows and more), in either layout;
    # the bounded kernel of 16-step chunks where the rows are more than one wave of the unbounded one
    for sizes, chunk in (({"b": 32, "d": 512, "n": 16}, 16), (big, 16), ({"b": 4, "d": 2048, "n": 16}, 32)):
        for length in (7, 180, 2048):
            assert mamba.backward_lanes(sizes, length, True).chunk == chunk
            assert mamba.backward_lanes(sizes, length, False).chunk == chunk
    assert mamba.applies_at(big, 2048, True) and mamba.applies_at(big, 2048, False)
    assert mamba.backward_lanes({"b": 2, "d": 2048, "n": 16}, 2048, True) is None  # the warp kernel's
    monkeypatch.setenv("SSMC_CUDA_LANES_BACKWARD", "0")
    assert not mamba.applies_at(big, 2048, False) and mamba.backward_lanes(big, 2048, True) is None
    assert mamba.applies_at(big, 2048, True)
    monkeypatch.delenv("SSMC_CUDA_LANES_BACKWARD")
    assert mamba.applies_at({"b": 64, "d": 4096, "n": 16}, 2048, True)  # warps whatever the count
    # a scan's adjoint (no sums): where a warp per recurrence fills the GPU over a long sequence
    assert scan.applies_at({"b": 8, "d": 2048}, 4096, True) and scan.applies_at({"b": 8, "d": 512}, 1024, True)
    assert not scan.applies_at({"b": 2, "d": 512}, 4096, True) and not scan.applies_at({"b": 32, "d": 512}, 180, True)
    assert runner("mamba1_block") is None and runner("lstm") is None
    # the forward without outputs (a step that wants only gradients) where the warp kernel is not
    # state-major: the scan's; Mamba-1's warp forward shares per-step values by name with its summary
    assert scan.summary_kernel is not None and "out_y" not in {a.name for a in scan.summary_kernel.arrays}
    assert mamba.summary_kernel is None
    # state-major (4 steps per lane) where its longer rounds waste little of the last one, 2 where
    # rounds of 64 steps pad less (L = 40, 180); step-major (1 step per lane) at L = 7: one round of
    # 32 steps against one of 64
    assert mamba.state_major(2048) and mamba.state_major(180) and mamba.state_major(40)
    assert not mamba.state_major(7)
    assert [mamba.round_steps(n) for n in (2048, 180, 40, 7)] == [128, 64, 64, 32] and not scan.state_major(4096)
    monkeypatch.setenv("SSMC_CUDA_STATE_MAJOR_BACKWARD", "1")
    assert mamba.state_major(7)
    monkeypatch.setenv("SSMC_CUDA_STATE_MAJOR_BACKWARD", "0")
    assert not mamba.state_major(2048) and mamba.round_steps(2048) == 32
    monkeypatch.setenv("SSMC_CUDA_FUSED_BACKWARD", "1")
    assert scan.applies_at({"b": 2, "d": 512}, 4096, True)
    monkeypatch.setenv("SSMC_CUDA_FUSED_BACKWARD", "0")
    assert not mamba.applies_at(big, 2048, True) and not scan.applies_at({"b": 8, "d": 2048}, 4096, True)


@pytest.mark.skipif(not nvrtc.available(), reason=nvrtc.unavailable_reason())
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_training_kernels_compile_without_spills(arch, monkeypatch):
    """At the benchmark shapes with time contiguous, `ssmc inspect` lists a training step's kernels (the
    forward saving round carries, the warp kernel's fused backward, the forward without outputs) and they
    compile with zero spills. (Mamba-1's step there takes the lanes backward by default:
    turned off here; test_cuda_compile.py checks that one.)"""
    from ssmc.backends.cuda.report import kernel_reports

    monkeypatch.setenv("SSMC_CUDA_FUSED_BACKWARD", "1")
    monkeypatch.setenv("SSMC_CUDA_LANES_BACKWARD", "0")
    cases = {"mamba1": ({"b": 8, "d": 1536, "n": 16}, 2048), "hgrn": ({"b": 8, "d": 2048}, 4096)}
    for name, (sizes, length) in cases.items():
        program = importlib.import_module(f"ssmc.examples.{name}").SPEC.program
        reports = kernel_reports(program, sizes, length, arch=arch, time_contiguous=True)
        roles = {r.program: r for r in reports}
        # the forward also without outputs, for steps that want gradients only (the scan's as the warp
        # kernel, Mamba-1's as the lanes kernel)
        assert set(roles) == {"forward", "forward (training)", "backward", "forward (gradients only)"}, name
        assert "out_" not in roles["forward (gradients only)"].source.split("__global__")[-1].split(")")[0]
        assert "rounds_h" in roles["forward (gradients only)"].source
        assert roles["backward"].strategy.startswith("fused backward")
        assert "atomicAdd" in roles["backward"].source or name == "hgrn"
        if name == "mamba1":  # exp(dt A) once per step and state, where the four steps would each compute it
            source = roles["backward"].source  # state-major: a round's code for full rounds, one for the rest
            assert source.count("one state value at a time") == 2 and source.count("exp_(") == 2
        for r in reports:
            assert r.resources is not None, r.error
            assert not r.resources.spills, (name, r.name, r.resources.summary())


@ssmc.recurrence
def five_sums(h: ssmc.State["b d n"], u: ssmc.Seq["b d"], delta: ssmc.Seq["b d"], A: ssmc.Param["d n"],
              B: ssmc.Seq["b n"], E: ssmc.Seq["b n"], F: ssmc.Seq["b n"], C: ssmc.Seq["b n"],
              G: ssmc.Seq["b n"]):
    """Mamba-1's scan with five sequences along n: five gradients summed over d (grad_B ... grad_G), so
    a round's block sums have 5 x 32 K values to add, more than a block's 128 threads at K = 4."""
    dt = ssmc.softplus(delta)
    h = ssmc.exp(dt * A) * h + dt * u * B + dt * E + u * F
    y = ssmc.dot(h, C, over="n") + ssmc.dot(h, G, over="n")
    return h, y


def _five_sums_inputs(rng, length: int, batch: int = 2, dim: int = 8, state: int = 5) -> dict:
    along_n = {k: rng.standard_normal((batch, state, length)) for k in "BEFCG"}
    return {"u": rng.standard_normal((batch, dim, length)), "delta": rng.standard_normal((batch, dim, length)),
            "A": -np.exp(rng.uniform(-1.0, 1.0, (dim, state))), **along_n,
            "h": 0.5 * rng.standard_normal((batch, dim, state))}


FIVE_SUMS = SimpleNamespace(SPEC=five_sums, LAYOUT="b d t", make_inputs=_five_sums_inputs)


@ssmc.recurrence
def wide(h: ssmc.State["b d n"], u: ssmc.Seq["b d"], delta: ssmc.Seq["b d"], A: ssmc.Param["d n"],
         B: ssmc.Seq["b n"], E: ssmc.Seq["b n"], F: ssmc.Seq["b n"], C: ssmc.Seq["b n"], G: ssmc.Seq["b n"],
         z: ssmc.Seq["b d"], w: ssmc.Seq["b d"], v: ssmc.Seq["b d"], q: ssmc.Seq["b d"]):
    """`five_sums` with four more sequences per row: the fused backward stages 11 sequences and
    outputs and sums five arrays, 53760 bytes of shared memory at K = 4 (more than 48 KiB)."""
    dt = ssmc.softplus(delta)
    h = ssmc.exp(dt * A) * h + dt * u * B + dt * E * w + u * F * v
    y = (ssmc.dot(h, C, over="n") + ssmc.dot(h, G, over="n") * q) * ssmc.silu(z)
    return h, y


def _wide_inputs(rng, length: int, batch: int = 2, dim: int = 8, state: int = 5) -> dict:
    rows = {k: rng.standard_normal((batch, dim, length)) for k in "zwvq"}
    return {**_five_sums_inputs(rng, length, batch, dim, state), **rows}


WIDE = SimpleNamespace(SPEC=wide, LAYOUT="b d t", make_inputs=_wide_inputs)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_fused_backward_fits_a_block_shared_memory(dtype, monkeypatch):
    """The fused backward's shared memory, as the runner works it out to choose its rounds
    (`fused_backward_shared_bytes`), is the compiled kernel's; where K = 4 would not fit 48 KiB
    (`wide`, float32), the state-major backward takes rounds of K = 2 and compiles. Before, it took K =
    4 and `ssmc.grad` stopped at ptxas' "uses too much shared data". The warp kernel's (at L = 180
    the lanes backward runs otherwise)."""
    monkeypatch.setenv("SSMC_CUDA_LANES_BACKWARD", "0")
    from ssmc.backends.cuda.fused_backward import fused_backward_runner
    from ssmc.backends.cuda.hardware import STATIC_SHARED
    from ssmc.backends.cuda.kernels.warp.backward import fused_backward_shared_bytes
    from ssmc.backends.cuda.report import kernel_reports
    from ssmc.backends.cuda.source import compile_options

    value_bytes = 8 if dtype == "float64" else 4
    sizes = {"b": 8, "d": 1536, "n": 16}
    for name, spec in [("mamba1", importlib.import_module("ssmc.examples.mamba1").SPEC), ("wide", wide),
                       ("five_sums", five_sums)]:
        for length in (180, 2048):
            runner = fused_backward_runner(derive_backward(spec.program), dtype)
            steps, major = runner.backward_steps(length), runner.state_major(length)
            # the reports' sources, and NVRTC for the fused backward's alone (as `kernel_reports` builds
            # each kernel: the other kernels' builds are minutes of CI's CPU)
            reports = kernel_reports(spec.program, sizes, length, dtype=dtype, time_contiguous=True,
                                     compile_kernels=False)
            backward, = [r for r in reports if r.strategy.startswith("fused backward")]
            built = nvrtc.compile_source(backward.source, arch="sm_90", name=f"{backward.name}.cu",
                                         options=compile_options(backward.source))
            resources = built.resources[backward.name]
            want = fused_backward_shared_bytes(runner.plan, value_bytes, steps, major)
            assert resources.shared_bytes == want <= STATIC_SHARED, (name, length)
            if name == "wide" and length == 2048 and dtype == "float32":
                assert major and steps == 2 and fused_backward_shared_bytes(runner.plan, 4, 4, True) > STATIC_SHARED


@pytest.mark.parametrize("name, steps, sums", [("mamba1", 2, 2), ("mamba1", 4, 2), ("mamba1", 6, 2),
                                               ("mamba1", 8, 2), ("five_sums", 4, 5)])
def test_block_sums_cover_every_vector_of_a_round(name, steps, sums, monkeypatch):
    """The block's warps add their terms of each summed array up in shared memory, then its threads add
    every vector of the round (`sums` arrays x 32 K steps) into memory: 128 threads took one vector
    each, so where there were more (K = 6 and 8, or five arrays) the rest were lost. There both
    kernels (full rounds, the partial one) loop over all of them; all compile without spills."""
    from ssmc.backends.cuda.kernels.warp.backward import _vector_width
    from ssmc.backends.cuda.report import kernel_reports

    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "warp")
    monkeypatch.setenv("SSMC_CUDA_STATE_MAJOR_BACKWARD", "1")
    monkeypatch.setenv("SSMC_CUDA_BACKWARD_STEPS_PER_LANE", str(steps))
    spec = FIVE_SUMS.SPEC if name == "five_sums" else importlib.import_module(f"ssmc.examples.{name}").SPEC
    # float32 with rows of a multiple of K steps: the lanes add their K steps as vectors (`_vector_atomics`)
    reports = kernel_reports(spec.program, {"b": 2, "d": 8, "n": 5}, 192, arch="sm_90", time_contiguous=True)
    backward, = [r for r in reports if r.strategy.startswith("fused backward")]
    vectors = sums * 32 * steps // _vector_width(steps)
    if vectors <= 128:  # a vector a thread
        assert backward.source.count(f"if (j < {sums} && base + s < L)") == 2
    else:
        assert backward.source.count(f"for (int i = threadIdx.x; i < {vectors}; i += 128)") == 2
    assert backward.resources is not None and not backward.resources.spills, backward.resources.summary()


# -- GPU -----------------------------------------------------------------------------------------


def _to_gpu(inputs: dict, dtype: str) -> dict:
    import torch

    return {k: torch.tensor(v, device="cuda").to(getattr(torch, dtype)) for k, v in inputs.items()}


def _fused_tape(g, gpu: dict) -> bool:
    return g.forward(**gpu)[2].rounds is not None


def _interpreter_gradients(m, gpu: dict, rng, dtype: str):
    """(outputs, cotangents on the GPU, gradients): the example `m` on the interpreter in float64 at the
    rounded inputs `gpu`, with random cotangents of its output y and final state h."""
    exact = {k: v.double().cpu().numpy() for k, v in gpu.items()}  # the rounded inputs, in float64
    outs, finals = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**exact, return_final_states=True)
    cot = _to_gpu({"y": rng.standard_normal(np.shape(outs)), "h": rng.standard_normal(np.shape(finals))}, dtype)
    exact_cot = {k: v.double().cpu().numpy() for k, v in cot.items()}
    want = ssmc.grad(m.SPEC, "interpreter", layout=m.LAYOUT)(**exact, grad_outputs=exact_cot["y"],
                                                             grad_final_states=exact_cot["h"])
    return outs, cot, want


def _check_fused_gradients(m, gpu: dict, rng, dtype: str):
    """The CUDA gradient of example `m` at `gpu` (through the fused backward) against the interpreter's."""
    _, cot, want = _interpreter_gradients(m, gpu, rng, dtype)
    g = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)
    assert _fused_tape(g, gpu)
    got = g(**gpu, grad_outputs=cot["y"], grad_final_states=cot["h"])
    tol = {"float64": 1e-9, "float32": 1e-3, "bfloat16": 1e-3}[dtype]  # bf16 inputs: fp32 compute
    for key in want:
        assert rel_err(got[key], want[key]) <= tol, key


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("length", [1, 7, 180, 1000, 4097])
@pytest.mark.parametrize("name", FUSED)
def test_fused_backward_matches_the_interpreter(name, length, dtype, monkeypatch):
    """Every gradient (sequences, params, the initial state) with cotangents of the outputs and of
    the final state; the warp strategy forced so that short sequences take the fused path too."""
    if length == 4097 and dtype != "float32":
        pytest.skip("one dtype at the longest length")
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "warp")
    monkeypatch.setenv("SSMC_CUDA_FUSED_BACKWARD", "1")  # the scan (hgrn) too
    m = importlib.import_module(f"ssmc.examples.{name}")
    rng = np.random.default_rng(length)
    inputs = m.make_inputs(rng, length)
    gpu = _to_gpu(inputs, dtype)
    _check_fused_gradients(m, gpu, rng, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("length", [1, 7, 180, 2047])
def test_the_state_major_fused_backward_at_any_length(length, dtype, monkeypatch):
    """The state-major fused backward forced where it would not be chosen (short sequences: one
    partial round) and at a length that is no multiple of a lane's 4 steps (rows of grad_B padded);
    every gradient against the interpreter."""
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "warp")
    monkeypatch.setenv("SSMC_CUDA_STATE_MAJOR_BACKWARD", "1")
    m = importlib.import_module("ssmc.examples.mamba1")
    rng = np.random.default_rng(length)
    inputs = m.make_inputs(rng, length, batch=2, dim=5, state=7)
    gpu = _to_gpu(inputs, dtype)
    _check_fused_gradients(m, gpu, rng, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [96, 180, 600])
@pytest.mark.parametrize("name, steps", [("mamba1", 2), ("mamba1", 4), ("mamba1", 6), ("mamba1", 8),
                                         ("five_sums", 4)])
def test_block_sums_add_every_step_of_a_round(name, steps, length, monkeypatch):
    """Every gradient against the interpreter where the block sums have more vectors than threads
    (`test_block_sums_cover_every_vector_of_a_round`): float32 and lengths of a multiple of K steps
    (but 180 at K = 8), so that the lanes add their steps as vectors; d = 8, a multiple of the block's
    4 warps, so that the warps add their terms up in shared memory first; 600 ends in a partial
    round. Mamba-1 with K = 6 forced lost grad_C's later steps of each round (relative error 0.99 at
    B32 D512 L180 on an H200, 2026-11-26)."""
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "warp")
    monkeypatch.setenv("SSMC_CUDA_STATE_MAJOR_BACKWARD", "1")
    monkeypatch.setenv("SSMC_CUDA_BACKWARD_STEPS_PER_LANE", str(steps))
    m = FIVE_SUMS if name == "five_sums" else importlib.import_module(f"ssmc.examples.{name}")
    rng = np.random.default_rng(length + steps)
    gpu = _to_gpu(m.make_inputs(rng, length, batch=2, dim=8, state=5), "float32")
    _check_fused_gradients(m, gpu, rng, "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("length", [180, 2048])
def test_a_fused_backward_of_many_sequences_takes_smaller_rounds(length):
    """`wide` (float32, d = 8: block sums), where rounds of K = 4 would not fit the block's shared
    memory: every gradient against the interpreter (K = 2). Its ssmc.grad failed to compile before."""
    m = WIDE
    rng = np.random.default_rng(length)
    gpu = _to_gpu(m.make_inputs(rng, length, batch=2, dim=8, state=5), "float32")
    _check_fused_gradients(m, gpu, rng, "float32")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("length", [7, 180, 1000])
def test_the_mamba1_block_takes_the_fused_backward_for_its_scan(length, dtype, monkeypatch):
    """The block's gradient chains its stages (`grad_stages.py`): the scan stage, Mamba-1 itself,
    by the fused backward; the norm's by row and map kernels. Every gradient, with cotangents of
    the output and the final state, against the interpreter; d = 40 is not a power of two."""
    from ssmc.autograd import StagedGrad

    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "warp")
    m = importlib.import_module("ssmc.examples.mamba1_block")
    rng = np.random.default_rng(length)
    gpu = _to_gpu(m.make_inputs(rng, length, batch=2, dim=40, state=5), dtype)
    outs, cot, want = _interpreter_gradients(m, gpu, rng, dtype)
    g = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)
    assert isinstance(g, StagedGrad)
    ys, _, tape = g.forward(**gpu)
    assert tape.tapes[0].rounds is not None  # the scan stage ran the forward of the fused backward
    assert rel_err(ys["y"].movedim(0, -1), outs) <= (1e-10 if dtype == "float64" else 1e-4)
    got = g.backward(tape, grad_outputs=cot["y"], grad_final_states=cot["h"])
    tol = {"float64": 1e-9, "float32": 1e-3}[dtype]
    for key in want:
        assert rel_err(got[key], want[key]) <= tol, key

@pytest.mark.gpu
@pytest.mark.parametrize("batch, dim, length", [(8, 1536, 2048), (1, 1024, 300), (3, 1028, 130)])
def test_fused_and_unfused_backward_agree_at_benchmark_size(monkeypatch, batch, dim, length):
    """Mamba-1 at B8 D1536 L2048 N16 float32 (the benchmark's shape: blocks spread over b), at B1
    D1024 (blocks in order: one b) and B3 D1028 (spread over 3 b, the last round partial): the
    fused backward against the chunked one (recompute + adjoint + epilogue kernels)."""
    import torch

    m = importlib.import_module("ssmc.examples.mamba1")
    rng = np.random.default_rng(8)
    gpu = _to_gpu(m.make_inputs(rng, length, batch=batch, dim=dim, state=16), "float32")
    dy = torch.tensor(rng.standard_normal((batch, dim, length)), device="cuda", dtype=torch.float32)
    g = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)
    assert _fused_tape(g, gpu)
    fused = g(**gpu, grad_outputs=dy)
    monkeypatch.setenv("SSMC_CUDA_FUSED_BACKWARD", "0")
    g = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)
    assert not _fused_tape(g, gpu)
    chunked = g(**gpu, grad_outputs=dy)
    for key in chunked:
        assert rel_err(fused[key], chunked[key].double().cpu().numpy()) <= 1e-4, key


@pytest.mark.gpu
@pytest.mark.parametrize("length", [64, 1000, 4097])
def test_a_scan_that_wants_only_gradients_runs_the_forward_without_outputs(length, monkeypatch):
    """The first-order scan with time contiguous ("b d t"), float64, the fused backward forced (by
    default it takes it from 4096 recurrences and 1024 steps; it needs the warp kernel's two
    rounds): `ssmc.grad`'s call runs the forward without outputs (`summary_kernel`, prepared once
    per signature), `Grad.forward` the one with them; every gradient against the interpreter, at
    the first and a later call."""
    from ssmc.autograd.prepared import PreparedStep

    @ssmc.recurrence
    def scan(h: ssmc.State["b d"], a: ssmc.Seq["b d"], x: ssmc.Seq["b d"]):
        h = a * h + x
        return h, h

    monkeypatch.setenv("SSMC_CUDA_FUSED_BACKWARD", "1")
    rng = np.random.default_rng(length)
    a, x, dy = rng.uniform(0.5, 1.0, (2, 37, length)), *rng.standard_normal((2, 2, 37, length))
    want = ssmc.grad(scan, "interpreter", layout="b d t")(a=a, x=x, grad_outputs=dy)
    gpu = _to_gpu({"a": a, "x": x, "dy": dy}, "float64")
    g = ssmc.grad(scan, "cuda", layout="b d t")
    for _ in range(2):
        got = g(a=gpu["a"], x=gpu["x"], grad_outputs=gpu["dy"])
        for key in want:
            assert rel_err(got[key], want[key]) <= 1e-10, key
    step, = g._steps.values()
    out = f"out_{scan.program.outputs[0][0]}"
    assert isinstance(step, PreparedStep) and step.run_summary is not None
    assert "rounds_h" in step.run_summary.launch.names and out not in step.run_summary.launch.names
    assert out in step.run_forward.launch.names
    outs, _, tape = g.forward(a=gpu["a"], x=gpu["x"])
    y = ssmc.compile(scan, "interpreter", layout="b d t")(a=a, x=x)
    assert tape.rounds is not None and rel_err(outs[out[4:]].permute(1, 2, 0), y) <= 1e-10
    got = g.backward(tape, grad_outputs=gpu["dy"])
    for key in want:
        assert rel_err(got[key], want[key]) <= 1e-10, key


@pytest.mark.gpu
@settings(max_examples=8, **SETTINGS)  # about 1 random spec in 20 fuses
@given(spec=diagonal_linear_recurrences(), length=st.sampled_from([1, 7, 180, 1000]), seed=st.integers(0, 2**16))
def test_random_specs_through_the_fused_backward(spec, length, seed):
    """Random diagonal-linear specs with time contiguous ("... t"), float64, against the interpreter."""
    import os

    from ssmc.backends.cuda.fused_backward import fused_backward_runner

    program = spec.program
    assume(fused_backward_runner(derive_backward(program)) is not None)  # else the unfused path: test_cuda.py
    inputs = draw_inputs(spec, length, seed)  # time first
    seqs = {d.name for d in program.seqs}
    moved = {k: (np.ascontiguousarray(np.moveaxis(v, 0, -1)) if k in seqs else v) for k, v in inputs.items()}
    outs, _ = ssmc.compile(spec, "interpreter", layout="... t").run(**moved)  # time first
    rng = np.random.default_rng(seed)
    cot = {n: np.moveaxis(rng.standard_normal(v.shape), 0, -1) for n, v in outs.items()}
    want = ssmc.grad(spec, "interpreter", layout="... t")(**moved, grad_outputs=cot)
    os.environ.update(SSMC_CUDA_STRATEGY="warp", SSMC_CUDA_FUSED_BACKWARD="1")
    try:
        g = ssmc.grad(spec, "cuda", layout="... t")
        got = g(**_to_gpu(moved, "float64"), grad_outputs=_to_gpu(cot, "float64"))
        op_grads = _op_steps(spec, _to_gpu(moved, "float64"), _to_gpu(cot, "float64"), [n for n, _ in program.outputs])
    finally:
        del os.environ["SSMC_CUDA_STRATEGY"], os.environ["SSMC_CUDA_FUSED_BACKWARD"]
    # float64 rounding, measured against the largest gradient: a gradient that is itself tiny through
    # cancellation (1 - tanh(v)^2 at v = -15: 1e-13, where the interpreter and Numba differ by 6e-7 of
    # it) is compared at that scale, not its own
    # (a spec whose gradients are all zero, a relu off at every step, gives scale 0: then any nonzero
    # gradient fails, where 0 / 0 failed every time)
    scale = max(float(np.abs(w).max(initial=0.0)) for w in want.values())
    for key in want:
        assert rel_err(got[key], want[key], floor=max(1e-6 * scale, 1e-30)) <= 1e-8, key
        for step, grads in enumerate(op_grads):  # ssmc.torch's steps: the general path, then lean ones
            assert rel_err(grads[key], want[key], floor=max(1e-6 * scale, 1e-30)) <= 1e-8, (key, step)


def _op_steps(spec, arrays: dict, cot: dict, outputs: list[str], steps: int = 3) -> list[dict]:
    """The gradients of `steps` training steps through `ssmc.torch` (layout "... t"), by argument name."""
    import torch

    import ssmc.torch as st_torch

    f = st_torch.function(spec, "cuda", layout="... t")
    leaves = {k: v.clone().requires_grad_(True) for k, v in arrays.items()}
    out = []
    for _ in range(steps):
        ys = f(**leaves)
        ys = ys if isinstance(ys, tuple) else (ys,)
        grads = torch.autograd.grad(ys, list(leaves.values()), [cot[n] for n in outputs], allow_unused=True)
        out.append(dict(zip(leaves, grads)))
    return out


@pytest.mark.gpu
def test_gradcheck_through_the_fused_backward(monkeypatch):
    import torch

    import ssmc.torch as st_torch

    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "warp")
    m = importlib.import_module("ssmc.examples.mamba1")
    inputs = m.make_inputs(np.random.default_rng(3), 150, batch=1, dim=2, state=3)  # rounds of 32, the last partial
    f = st_torch.function(m.SPEC, "cuda", layout=m.LAYOUT)
    names = [d.name for d in m.SPEC.program.inputs]
    tensors = [torch.tensor(inputs[n], device="cuda", dtype=torch.float64, requires_grad=True) for n in names]
    g = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)
    assert _fused_tape(g, {n: t.detach() for n, t in zip(names, tensors)})
    assert torch.autograd.gradcheck(lambda *xs: f(*xs), tensors)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("layout", ["b d t", "b t d"])
@pytest.mark.parametrize("length", [7, 180, 1000])
@pytest.mark.parametrize("with_state", [False, True])
def test_prepared_training_steps_match_the_interpreter(length, layout, dtype, with_state):
    """A call like an earlier one takes its prepared step (grad_prepared.py: no binding, no checks):
    the third call, on fresh values, through `Grad` (cotangent as one tensor and as a dict) and
    through ssmc.torch, every gradient against the interpreter's at those values."""
    import torch

    import ssmc.torch as st_torch

    m = importlib.import_module("ssmc.examples.mamba1")
    perm = {"b d t": None, "b t d": (0, 2, 1)}[layout]

    def draw(seed):
        rng = np.random.default_rng(seed)
        inputs = m.make_inputs(rng, length, batch=3, dim=37, state=16)
        if not with_state:
            inputs.pop("h")
        gpu = _to_gpu(inputs, dtype)
        if perm is not None:  # time before the channels: the same values, another layout
            gpu = {k: (v.permute(*perm).contiguous() if k in ("u", "delta", "z", "B", "C") else v)
                   for k, v in gpu.items()}
        dy = torch.tensor(rng.standard_normal((3, 37, length)), device="cuda").to(getattr(torch, dtype))
        return gpu, dy if perm is None else dy.permute(*perm).contiguous()

    g = ssmc.grad(m.SPEC, "cuda", layout=layout)
    for seed in (1, 2):
        g(**draw(seed)[0], grad_outputs=draw(seed)[1])
    gpu, dy = draw(3)
    exact = {k: v.double().cpu().numpy() for k, v in gpu.items()}
    want = ssmc.grad(m.SPEC, "interpreter", layout=layout)(**exact, grad_outputs=dy.double().cpu().numpy())
    tol = 1e-3
    from ssmc.autograd.prepared import PreparedChunk, PreparedStep

    tape = g.forward(**gpu)[2]
    fused = tape.rounds is not None
    assert fused or (layout, length) != ("b d t", 180)  # the benchmark's small shape takes it
    # no fused backward: a prepared step where one chunk covers the sequence, else the general path
    kind = [PreparedStep] if fused else [PreparedChunk] if tape.chunk >= length else []
    for got in (g(**gpu, grad_outputs=dy), g(**gpu, grad_outputs={"y": dy})):
        assert [type(step) for step in g._steps.values()] == kind and set(got) == set(want)
        for key in want:
            assert rel_err(got[key], want[key]) <= tol, key
    f = st_torch.function(m.SPEC, "cuda", layout=layout)
    for seed in (4, 3):  # the second step is a prepared one
        leaves = {k: v.clone().requires_grad_(True) for k, v in (draw(seed)[0] if seed != 3 else gpu).items()}
        f(**leaves).backward(draw(seed)[1] if seed != 3 else dy)
    tol = {"float32": 1e-3, "bfloat16": 1e-2}[dtype]  # the op's gradients come in the inputs' dtype
    for key, leaf in leaves.items():
        assert rel_err(leaf.grad, want[key]) <= tol, key
    # the op's backward took the prepared path too (no cotangent of the final state)
    assert not kind or any(step.backwards for step in f.grad._steps.values())
    if dtype == "float32":  # float64 compute asked for: the prepared calls cast the float32 inputs
        g64 = ssmc.grad(m.SPEC, "cuda", layout=layout, dtype=np.float64)
        for seed in (1, 2):
            g64(**draw(seed)[0], grad_outputs=draw(seed)[1])
        got = g64(**gpu, grad_outputs=dy)
        for key in want:
            assert got[key].dtype == torch.float64 and rel_err(got[key], want[key]) <= 1e-8, key

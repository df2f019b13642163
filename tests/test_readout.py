"""The readout cut (`ssmc/lowering/readout.py`): outputs that read the states through a matrix-product-like
contraction run after the recurrence, as products over all steps (CUDA's stages, `cuda_stages`).

- What it takes and refuses, read off the IR (no compile): the LRU example (complex: the readout
  ``Re(C h)`` distributed into two products), its post stage hoisted into matrix products, and the post
  stage's adjoint (``grad_C`` summed over time and batch by one product, ``C^T grad_y`` one product per
  step, nothing written per step besides); Mamba-1's ``sum_n h C`` (no axis of its own on C: not a matrix
  product), adjoints, outputs that read the state besides the contraction.
- Runs against the interpreter (the program as written), float64, forward and every gradient, L = 1, 7,
  180 at sizes no tile divides: the stages on the interpreter; a spec with two states (one nonlinear),
  three readouts (one of a product of states, one under a tanh) and an output kept in the recurrence,
  on the emulated CUDA backend (staged) and on Numba (hoisting only). The LRU example itself on both is
  tests/test_complex.py's.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples, in_ci, nightly_case

import ssmc
from ssmc.backends import interpreter
from ssmc.backends.cuda import emulator
from ssmc.backends.cuda.backend import cuda_stages
from ssmc.backends.registry import run_stages
from ssmc.examples import lru, mamba1
from ssmc.ir.node import toposort
from ssmc.ir.ops import Op
from ssmc.lowering.hoist import hoist
from ssmc.lowering.plan import lower
from ssmc.lowering.readout import readout_stages
from ssmc.passes.autodiff import derive_backward
from ssmc.runtime.binding import bind_arrays
from ssmc.runtime.random_inputs import random_recurrence_inputs

TOL = 1e-9
SIZES = {"b": 3, "d": 5, "n": 3, "e": 2}


@ssmc.recurrence
def two_states(h: ssmc.State["b n"], g: ssmc.State["b n"], x: ssmc.Seq["b d"], a: ssmc.Param["n"],
               B: ssmc.Param["n d"], C: ssmc.Param["d n"], E: ssmc.Param["e n"], D: ssmc.Param["d"]):
    """A scan h and a nonlinear g beside it; y and z read them through C and E, w is h itself."""
    h = ssmc.sigmoid(a) * h + ssmc.dot(B, x, over="d")
    g = ssmc.tanh(g + h)
    y = ssmc.dot(C, h, over="n") - ssmc.dot(C, g * h, over="n") + D * x
    z = ssmc.tanh(ssmc.dot(E, g, over="n"))
    return (h, g), {"y": y, "z": z, "w": 2.0 * h}


@ssmc.recurrence
def readout_and_sum(h: ssmc.State["b n"], x: ssmc.Seq["b n"], C: ssmc.Param["d n"]):
    h = 0.5 * h + x
    return h, ssmc.dot(C, h, over="n") + h.sum("n")


@ssmc.recurrence
def batched_readout(h: ssmc.State["b n"], x: ssmc.Seq["b n"], C: ssmc.Seq["b d n"]):
    h = 0.5 * h + x
    return h, ssmc.dot(C, h, over="n")


def readout_spec(update: str, readout: str, operand: str, outer: str):
    """A scan h (linear or under a tanh) and a nonlinear g; y reads `readout` of them through C (a param)
    or E (a sequence without the batch), combined with x as `outer` says."""

    @ssmc.recurrence
    def spec(h: ssmc.State["b n"], g: ssmc.State["b n"], x: ssmc.Seq["b d"], a: ssmc.Param["n"],
             B: ssmc.Param["n d"], C: ssmc.Param["d n"], E: ssmc.Seq["d n"], D: ssmc.Param["d"]):
        u = ssmc.sigmoid(a) * h + ssmc.dot(B, x, over="d")
        h = u if update == "linear" else ssmc.tanh(u)
        g = ssmc.tanh(g + h)
        f = {"h": h, "square": h * h, "tanh": ssmc.tanh(h), "product": g * h}[readout]
        r = ssmc.dot(C if operand == "param" else E, f, over="n")
        y = {"plain": r + D * x, "negated": D * x - r, "squashed": ssmc.tanh(r) * x,
             "two": r - ssmc.dot(C, g, over="n")}[outer]
        return (h, g), y
    return spec


readout_specs = st.builds(readout_spec, st.sampled_from(["linear", "tanh"]),
                          st.sampled_from(["h", "square", "tanh", "product"]), st.sampled_from(["param", "seq"]),
                          st.sampled_from(["plain", "negated", "squashed", "two"]))
awkward_sizes = st.fixed_dictionaries({a: st.integers(1, 5) for a in "bdn"})


def _sums(program) -> list:
    return [n for n in toposort(program.roots) if n.op is Op.SUM]


def test_lru_reads_its_state_after_the_scan_as_matrix_products():
    fused = readout_stages(lru.SPEC.program)
    assert fused is not None and cuda_stages(lru.SPEC.program) is fused
    assert [s.kind for s in fused.stages] == ["core", "post"]
    core, post = (s.program for s in fused.stages)
    cuts = fused.stages[0].writes
    assert len(cuts) == 2 and all(dict(core.outputs)[c].axes == ("b", "n") for c in cuts)  # as h lies
    assert [dict(core.outputs)[c].args[0] for c in cuts] == list(core.updates)  # the new h_re, h_im
    assert [n for n, _ in core.outputs] == list(cuts)
    assert lower(core, map_reduce=True).kernels[0].parallel == ("b", "n")   # was [b]: y lacks n
    assert not post.states and dict(post.outputs)["y"].axes == dict(lru.SPEC.program.outputs)["y"].axes
    h = hoist(post, transpose=False)
    assert len(h.pre) == 2 and not _sums(h.program)           # Re(C h): two products, then a map
    adjoint = hoist(derive_backward(post).adjoint, transpose=False)
    assert len(adjoint.pre) == 2 and not adjoint.factors      # C^T grad_y (the second negated)
    assert {s for s, _ in adjoint.post_accumulators} == {"grad_C_re", "grad_C_im"}


@pytest.mark.parametrize("spec", [mamba1.SPEC, readout_and_sum, batched_readout])
def test_what_is_no_matrix_product_after_the_scan_is_not_cut(spec):
    assert readout_stages(spec.program) is None


def test_adjoints_are_not_cut():
    assert readout_stages(derive_backward(lru.SPEC.program).adjoint) is None


def _inputs(program, length: int, seed: int, sizes=None) -> dict:
    return random_recurrence_inputs(program, length, np.random.default_rng(seed), sizes=sizes or SIZES)


def _run_stages_on_the_interpreter(program, fused, kwargs):
    bound = bind_arrays(program.inputs, program.states, (), kwargs, "t ...", program.static_sizes, program.name,
                        program.roots)
    seqs = {d.name: bound.arrays[d.name] for d in program.seqs}
    params = {d.name: bound.arrays[d.name] for d in program.params}
    runs = [partial(interpreter.run_recurrence, st.program) for st in fused.stages]
    got_y, got_h = run_stages(fused, runs, seqs, params, bound.initial, bound.sizes, bound.length)
    return {**got_y, **got_h}


@settings(max_examples=examples(30, ci=10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=readout_specs, sizes=awkward_sizes, length=st.sampled_from([1, 7, 180]), seed=st.integers(0, 2**16))
def test_random_readouts_are_cut_and_their_stages_compute_the_program(spec, sizes, length, seed):
    program = spec.program
    fused = readout_stages(program)
    assert fused is not None and [s.kind for s in fused.stages] == ["core", "post"]
    core, post = (s.program for s in fused.stages)
    assert not post.states and all(set(dict(core.outputs)[c].axes) <= {"b", "n"} for c in fused.stages[0].writes)
    for st_ in fused.stages:
        derive_backward(st_.program)   # each stage has its own adjoint (StagedGrad's)
    kwargs = _inputs(program, length, seed, sizes)
    got = _run_stages_on_the_interpreter(program, fused, kwargs)
    want_y, want_h = ssmc.compile(program, "interpreter").run(**kwargs)
    for name, want in {**want_y, **want_h}.items():
        assert np.abs(got[name] - want).max() <= TOL * max(np.abs(want).max(), 1.0), name


@pytest.mark.parametrize("length", [1, 7, 180])
def test_the_stages_compute_the_program(length):
    program = two_states.program
    fused = readout_stages(program)
    assert [s.kind for s in fused.stages] == ["core", "post"]
    assert {n for n, _ in fused.stages[1].program.outputs} == {"y", "z"}
    kwargs = _inputs(program, length, length)
    got = _run_stages_on_the_interpreter(program, fused, kwargs)
    want_y, want_h = ssmc.compile(program, "interpreter").run(**kwargs)
    for name, want in {**want_y, **want_h}.items():
        assert np.abs(got[name] - want).max() <= TOL * max(np.abs(want).max(), 1.0), name


def _backend(name: str, monkeypatch):
    if name == "cuda":
        if not emulator.available():
            pytest.skip("no C++ compiler for the CUDA emulator")
        monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")


def _check(backend: str, lengths, to=np.asarray, spec=two_states, sizes=None, seed=10):
    """Forward (outputs, final states) and every gradient of `spec` on `backend` against the
    interpreter, float64; `to` puts the arrays where the backend takes them."""
    f, g = ssmc.compile(spec, backend), ssmc.grad(spec, backend)
    want_f, want_g = ssmc.compile(spec, "interpreter"), ssmc.grad(spec, "interpreter")

    def close(got, want, what):
        got = got.detach().cpu().numpy() if hasattr(got, "detach") else np.asarray(got)
        err = np.abs(got - want).max()
        assert err <= TOL * max(np.abs(want).max(), 1.0), (what, err)

    for length in lengths:
        kwargs = _inputs(spec.program, length, seed + length, sizes)
        given = {k: to(v) for k, v in kwargs.items()}
        got_y, got_h = f.run(**given)
        want_y, want_h = want_f.run(**kwargs)
        for name, want in {**want_y, **want_h}.items():
            close({**got_y, **got_h}[name], want, (length, name))
        rng = np.random.default_rng(length)
        cot = {n: rng.standard_normal(v.shape) for n, v in want_y.items()}
        lam = {n: rng.standard_normal(v.shape) for n, v in want_h.items()}
        got = g(**given, grad_outputs={k: to(v) for k, v in cot.items()},
                grad_final_states={k: to(v) for k, v in lam.items()})
        want = want_g(**kwargs, grad_outputs=cot, grad_final_states=lam)
        assert set(got) == set(want)
        for name, w in want.items():
            close(got[name], w, (length, name))


# the emulated kernels' C++ builds take a minute on CI's cores: there the staged CUDA run is the LRU's
# (tests/test_complex.py, L = 1, 7, 180), the cut's arithmetic test_the_stages_compute_the_program's
@pytest.mark.parametrize("backend", ["numba", nightly_case("cuda", reason="the LRU's staged run covers it")])
def test_forward_and_every_gradient_match_the_interpreter(backend, monkeypatch):
    _backend(backend, monkeypatch)
    _check(backend, (1, 7, 180))


@pytest.mark.gpu
def test_gpu_forward_and_every_gradient_match_the_interpreter():
    """On a GPU, CUDA tensors in float64: the staged run (core kernels, products after) at L = 1, 7, 180, 1000."""
    torch = pytest.importorskip("torch")
    _check("cuda", (1, 7, 180, 1000), lambda a: torch.tensor(a, device="cuda"))


# each example builds its stages' kernels with the emulator's C++ (a minute): a few locally and nightly
@pytest.mark.skipif(in_ci(), reason="nightly: the emulated kernels' builds (the LRU's staged run covers CI)")
@settings(max_examples=examples(2), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=readout_specs, sizes=awkward_sizes, seed=st.integers(0, 2**16))
def test_random_readouts_on_emulated_cuda_match_the_interpreter(spec, sizes, seed):
    if not emulator.available():
        pytest.skip("no C++ compiler for the CUDA emulator")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSMC_CUDA_EMULATE", "1")
        _check("cuda", (1, 7, 180), spec=spec, sizes=sizes, seed=seed)

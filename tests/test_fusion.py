"""The fusion stage (`ssmc/lowering/stages.py`) and the layer functions (`ssmc.rmsnorm`, `ssmc.layernorm`).

Staged runs are checked against the interpreter on the whole program: the stages run through the
interpreter (fused == unfused, forward and adjoint), and through Numba in float64 (forward and every
gradient), for random layers: a scan, an optional gate, a norm over a feature axis of awkward size,
an optional residual add.
"""

from __future__ import annotations

import importlib
from functools import partial

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from profiles import examples
from strategies import layers

import ssmc
from ssmc.autograd import Grad, StagedGrad, make_grad
from ssmc.backends import interpreter
from ssmc.backends.registry import run_stages
from ssmc.lowering.plan import lower
from ssmc.lowering.stages import fuse, op_by_op_kernels
from ssmc.passes.autodiff import derive_backward
from ssmc.runtime.binding import bind_arrays
from ssmc.runtime.random_inputs import axis_sizes, random_recurrence_inputs

TOL = 1e-9   # float64, relative to the largest magnitude of the reference
EXAMPLES = ["hgrn", "mamba1", "mamba2", "mingru", "linear_attention", "retnet", "lstm", "gru"]
SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) if a.size else 0.0


# -- random layers (strategies.layers) ---------------------------------------------------------------


def inputs_for(program, length: int, seed: int, d: int) -> dict:
    rng = np.random.default_rng(seed)
    return random_recurrence_inputs(program, length, rng, sizes=axis_sizes(program, rng, given={"d": d}))


def run_fused_on_the_interpreter(program, kwargs):
    """The program's stages, each run by the interpreter, chained by `run_stages`."""
    fused = fuse(program)
    bound = bind_arrays(program.inputs, program.states, (), kwargs, "t ...", program.static_sizes, program.name,
                        program.roots)
    seqs = {d.name: bound.arrays[d.name] for d in program.seqs}
    params = {d.name: bound.arrays[d.name] for d in program.params}
    runs = [partial(interpreter.run_recurrence, st.program) for st in fused.stages]
    return run_stages(fused, runs, seqs, params, bound.initial, bound.sizes, bound.length)


def check_fused_equals_unfused(program, kwargs):
    got_y, got_h = run_fused_on_the_interpreter(program, kwargs)
    want_y, want_h = ssmc.compile(program, "interpreter").run(**kwargs)
    for name in want_y:
        assert rel_err(got_y[name], want_y[name]) <= TOL, name
    for name in want_h:
        assert rel_err(got_h[name], want_h[name]) <= TOL, name


@settings(max_examples=25, **SETTINGS)
@given(spec=layers(), length=st.sampled_from([1, 7, 180]), d=st.sampled_from([1, 3, 5, 12]),
       seed=st.integers(0, 2**16))
def test_random_layers_fused_equal_unfused_on_the_interpreter(spec, length, d, seed):
    """Forward and adjoint: the staged program computes what the program does, and it is staged."""
    program = spec.program
    assert fuse(program).staged and not fuse(program).left_in
    check_fused_equals_unfused(program, inputs_for(program, length, seed, d))
    adjoint = derive_backward(program).adjoint
    assert fuse(adjoint).staged
    check_fused_equals_unfused(adjoint, inputs_for(adjoint, length, seed + 1, d))


# each example compiles a random layer's stages with Numba: 3 in CI (tests/profiles.py), 5 locally
@settings(max_examples=examples(5, ci=3), **SETTINGS)
@given(spec=layers(), length=st.sampled_from([1, 7, 180]), d=st.sampled_from([3, 7, 12]),
       seed=st.integers(0, 2**16))
def test_random_layers_on_numba_match_the_interpreter(spec, length, d, seed):
    """Forward and every gradient, Numba float64 (staged) against the interpreter (the program as written)."""
    inputs = inputs_for(spec.program, length, seed, d)
    want_y, _ = ssmc.compile(spec, "interpreter").run(**inputs)
    got_y, _ = ssmc.compile(spec, "numba").run(**inputs)
    for name in want_y:
        assert rel_err(got_y[name], want_y[name]) <= TOL, name
    rng = np.random.default_rng(seed)
    cot = {n: rng.standard_normal(v.shape) for n, v in want_y.items()}
    want = ssmc.grad(spec, "interpreter", chunk=64)(**inputs, grad_outputs=cot)
    got = ssmc.grad(spec, "numba", chunk=64)(**inputs, grad_outputs=cot)
    assert set(got) == set(want)
    for key in want:
        assert rel_err(got[key], want[key]) <= TOL, key


# -- the Mamba-1 block, and what is not staged ----------------------------------------------------


def test_mamba1_block_forward_is_a_scan_kernel_and_a_row_kernel():
    m = importlib.import_module("ssmc.examples.mamba1_block")
    fused = fuse(m.SPEC.program)
    assert [s.kind for s in fused.stages] == ["core", "post"]
    core, post = (s.program for s in fused.stages)
    (cut,) = fused.stages[0].writes
    assert dict(core.outputs)[cut].axes == ("b", "d")     # the gated y, one value per recurrence and step
    assert not post.states and [n for n, _ in post.outputs] == ["y"]
    assert [len(lower(p, map_reduce=True).kernels) for p in (core, post)] == [1, 1]
    assert lower(core, map_reduce=True).kernels[0].parallel == ("b", "d")
    assert op_by_op_kernels(m.SPEC.program) > 2 * 5
    text = fused.describe()
    assert "kernels: 2 (op by op:" in text and "sum over d" in text


def test_mamba1_block_adjoint_reads_row_statistics_and_runs_its_scan_in_parallel_over_b_d_n():
    m = importlib.import_module("ssmc.examples.mamba1_block")
    fused = fuse(derive_backward(m.SPEC.program).adjoint)
    assert [s.kind for s in fused.stages] == ["pre", "core"]
    pre = fused.stages[0].program
    assert not pre.states and all(y.op.value == "sum" for _, y in pre.outputs)
    low = lower(fused.stages[1].program, map_reduce=True)
    assert low.strategy == "split" and low.kernels[0].parallel == ("b", "d", "n")



def test_a_staged_layer_takes_its_gradient_stage_by_stage():
    """Compiled backends chain the stages' gradients (`grad_stages.py`); the interpreter keeps the
    whole program's adjoint. The block's stages: Mamba-1 itself, then the norm and the residual,
    whose adjoint sums over time alone (grad_norm_weight) and so is split into map kernels."""
    m = importlib.import_module("ssmc.examples.mamba1_block")
    mamba1 = importlib.import_module("ssmc.examples.mamba1")
    assert isinstance(make_grad(m.SPEC.program, "numba"), StagedGrad)
    assert isinstance(make_grad(m.SPEC.program, "interpreter"), Grad)
    assert isinstance(make_grad(mamba1.SPEC.program, "numba"), Grad)
    core, post = (st.program for st in fuse(m.SPEC.program).stages)
    assert [d.name for d in core.inputs] == [d.name for d in mamba1.SPEC.program.inputs]
    post_adjoint = fuse(derive_backward(post).adjoint).stages[-1].program
    assert lower(post_adjoint).strategy == "fused"
    low = lower(post_adjoint, map_reduce=True)
    assert low.strategy == "split" and not low.core_states
    assert all(k.time_blocks for k in low.kernels)


@pytest.mark.parametrize("length", [1, 7, 180])
def test_mamba1_block_gradients_through_the_stages_on_numba(length):
    """Every gradient, initial and final state included, layout "b d t", against the interpreter."""
    m = importlib.import_module("ssmc.examples.mamba1_block")
    rng = np.random.default_rng(length)
    inputs = m.make_inputs(rng, length, batch=2, dim=5, state=3)
    out, h = ssmc.compile(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, return_final_states=True)
    cot = {"grad_outputs": rng.standard_normal(out.shape), "grad_final_states": rng.standard_normal(h.shape)}
    want = ssmc.grad(m.SPEC, "interpreter", layout=m.LAYOUT)(**inputs, **cot)
    g = ssmc.grad(m.SPEC, "numba", layout=m.LAYOUT)
    assert isinstance(g, StagedGrad)
    got_y, got_h, tape = g.forward(**inputs)
    assert rel_err(np.moveaxis(got_y["y"], 0, -1), out) <= TOL and rel_err(got_h["h"], h) <= TOL
    got = g.backward(tape, **cot)
    assert set(got) == set(want)
    for key in want:
        assert got[key].shape == want[key].shape, key
        assert rel_err(got[key], want[key]) <= TOL, key

@pytest.mark.parametrize("name", EXAMPLES)
def test_examples_without_a_norm_are_not_staged(name):
    """The rule is specific: contractions (x W, h U, sum over n) and their transposes are no row statistics."""
    program = importlib.import_module(f"ssmc.examples.{name}").SPEC.program
    bw = derive_backward(program)
    for p in (program, bw.adjoint, bw.carries):
        assert not fuse(p).staged, p.name


@ssmc.recurrence
def norm_inside(h: ssmc.State["b d"], x: ssmc.Seq["b d"], a: ssmc.Seq["b d"]):
    h = ssmc.rmsnorm(ssmc.sigmoid(a) * h + x, over="d")
    return h, h


def test_a_norm_inside_the_recurrence_stays_there_and_is_correct():
    fused = fuse(norm_inside.program)
    assert not fused.staged and len(fused.left_in) == 1
    assert "left in the recurrence" in fused.describe()
    assert lower(norm_inside.program).kernels[0].parallel == ("b",)
    inputs = inputs_for(norm_inside.program, 7, 0, 5)
    want, _ = ssmc.compile(norm_inside, "interpreter").run(**inputs)
    got, _ = ssmc.compile(norm_inside, "numba").run(**inputs)
    assert rel_err(got["y"], want["y"]) <= TOL


# -- the layer functions ----------------------------------------------------------------------------


@ssmc.recurrence
def norms(h: ssmc.State["b d"], x: ssmc.Seq["b d"], w: ssmc.Param["d"], beta: ssmc.Param["d"]):
    h = h + x
    return h, (ssmc.rmsnorm(h, over="d", weight=w, eps=1e-6), ssmc.layernorm(h, over="d", weight=w, bias=beta),
               ssmc.layernorm(h, over="d"))


@pytest.mark.parametrize("d", [1, 5, 12])
def test_norms_match_torch(d):
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    rng = np.random.default_rng(d)
    x, w, beta = rng.standard_normal((4, 2, d)), rng.standard_normal(d), rng.standard_normal(d)
    rms, ln, plain = ssmc.compile(norms, "interpreter", layout="t b d")(x, w, beta)
    h = torch.from_numpy(np.cumsum(x, axis=0))
    wt, bt = torch.from_numpy(w), torch.from_numpy(beta)
    assert rel_err(rms, (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * wt).numpy()) <= 1e-12
    assert rel_err(ln, F.layer_norm(h, (d,), wt, bt, eps=1e-5).numpy()) <= 1e-12
    assert rel_err(plain, F.layer_norm(h, (d,), eps=1e-5).numpy()) <= 1e-12


def test_norm_errors_name_the_spec_line():
    with pytest.raises(ssmc.SpecError, match=r"test_fusion.py:\d+: rmsnorm over axis 'k'"):
        @ssmc.recurrence
        def bad_axis(h: ssmc.State["b d"], x: ssmc.Seq["b d"]):
            return h + x, ssmc.rmsnorm(h, over="k")
    with pytest.raises(ssmc.SpecError, match=r"weight must be a param over the normalised axis \[d\]"):
        @ssmc.recurrence
        def bad_weight(h: ssmc.State["b d"], x: ssmc.Seq["b d"], w: ssmc.Param["b"]):
            return h + x, ssmc.layernorm(h, over="d", weight=w)


def test_show_stage_fused(capsys):
    from ssmc.cli import main

    m = importlib.import_module("ssmc.examples.mamba1_block")
    assert main(["show", "--stage", "fused", m.__file__]) == 0
    out = capsys.readouterr().out
    assert "post  mamba1_block_post: 1 kernel" in out and "backward" in out and "pre" in out

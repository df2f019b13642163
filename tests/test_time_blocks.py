"""The time-parallel scan (summary, combine, rescan; lowering/time_blocks.py) against the interpreter.

The phases are ordinary kernels, so they run here through Numba on the CPU with the same arrays the
CUDA backend gives them; the GPU tests run them through CUDA.
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from profiles import examples
from strategies import diagonal_linear_recurrences, draw_inputs

import ssmc
from ssmc.backends.numba.runner import NumbaRunner
from ssmc.lowering.kernel import Lowered
from ssmc.lowering.time_blocks import run_time_blocks, time_blocks
from ssmc.passes.autodiff import derive_backward
from ssmc.runtime.binding import bind_arrays

LINEAR = ["hgrn", "mamba1", "mamba2", "mingru", "linear_attention", "retnet"]
TOL = 1e-10  # float64, relative to the largest magnitude of the reference


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) if a.size else 0.0


def run_blocked(program, kwargs: dict, nblk: int, layout="t ..."):
    """`program` on the inputs `kwargs` (float64), time split into `nblk` blocks, through Numba."""
    tb = time_blocks(program)
    assert tb is not None, f"{program.name}: time blocks do not apply"
    bound = bind_arrays(program.inputs, program.states, (), kwargs, layout, program.static_sizes, program.name,
                        program.roots)
    runner = NumbaRunner(program, "float64", Lowered(program, "time blocks", [tb.summary, tb.combine, tb.rescan]))

    def launch(k, arrays, length, blocks):
        return runner._call(k, arrays, bound.sizes, length, blocks)

    seqs = {d.name: bound.arrays[d.name] for d in program.seqs}
    params = {d.name: bound.arrays[d.name] for d in program.params}
    return run_time_blocks(tb, launch, lambda shape, v: np.full(shape, v), seqs, params, bound.initial,
                           bound.sizes, bound.length, nblk)


def check(program, kwargs, nblk, layout="t ..."):
    got_y, got_h = run_blocked(program, kwargs, nblk, layout)
    want_y, want_h = ssmc.compile(program, "interpreter", layout=layout).run(**kwargs)
    assert set(got_y) == set(want_y) and set(got_h) == set(want_h)
    for name in want_y:
        assert rel_err(got_y[name], want_y[name]) <= TOL, name
    for name in want_h:
        assert rel_err(got_h[name], want_h[name]) <= TOL, name


@pytest.mark.parametrize("length, nblk", [(1, 1), (7, 3), (180, 7), (1000, 16)])
@pytest.mark.parametrize("name", LINEAR)
def test_examples(name, length, nblk):
    m = importlib.import_module(f"ssmc.examples.{name}")
    check(m.SPEC.program, m.make_inputs(np.random.default_rng(length), length), nblk, m.LAYOUT)


def test_more_blocks_than_steps_leaves_empty_blocks_as_the_identity():
    m = importlib.import_module("ssmc.examples.hgrn")
    check(m.SPEC.program, m.make_inputs(np.random.default_rng(0), 5), 9, m.LAYOUT)


def test_reverse_adjoint_of_a_scan():
    """The adjoint of h = a*h + x (a a sequence): reverse, diagonal linear, no param sums."""

    @ssmc.recurrence
    def scan(h: ssmc.State["b d"], a: ssmc.Seq["b d"], x: ssmc.Seq["b d"]):
        h = a * h + x
        return h, h

    adjoint = derive_backward(scan.program).adjoint
    assert adjoint.reverse
    rng = np.random.default_rng(0)
    kwargs = {d.name: rng.standard_normal((180, 3, 5)) for d in adjoint.seqs}
    kwargs.update({s.name: rng.standard_normal((3, 5)) for s in adjoint.states})
    check(adjoint, kwargs, 7)


def test_nonlinear_and_split_programs_are_not_time_blocked():
    for name in ("lstm", "gru"):
        m = importlib.import_module(f"ssmc.examples.{name}")
        assert time_blocks(m.SPEC.program) is None
    m = importlib.import_module("ssmc.examples.mamba1")
    assert time_blocks(derive_backward(m.SPEC.program).adjoint) is None  # accumulators: split instead


# each example compiles a random spec's three phases with Numba: 3 in CI (tests/profiles.py), 8 locally
@settings(max_examples=examples(8, ci=3), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(spec=diagonal_linear_recurrences(), length=st.sampled_from([1, 7, 180]), nblk=st.integers(2, 11),
       seed=st.integers(0, 2**16))
def test_random_diagonal_linear_recurrences(spec, length, nblk, seed):
    program = spec.program
    assume(time_blocks(program) is not None)  # e.g. no independent axis: nothing to block
    check(program, draw_inputs(spec, length, seed), nblk)


def test_the_cuda_heuristic_blocks_time_only_when_recurrences_are_too_few(monkeypatch):
    from ssmc.backends.cuda.kernels.time_blocks import FILL_THREADS
    from ssmc.backends.cuda.runner import CudaRunner

    monkeypatch.delenv("SSMC_CUDA_TIME_BLOCKS", raising=False)
    m = importlib.import_module("ssmc.examples.hgrn")  # parallel over b d
    runner = CudaRunner(m.SPEC.program)
    assert runner.strategy({"b": 8, "d": 2048}, 4096) == "time blocks"
    launches = runner.launches({"b": 8, "d": 2048}, 4096)
    assert [x.kernel.name for x in launches] == ["hgrn_summary", "hgrn_combine", "hgrn_rescan"]
    assert launches[0].threads >= FILL_THREADS and launches[0].nblk == FILL_THREADS // (8 * 2048)
    assert runner.strategy({"b": 8, "d": 2048}, 31) == "fused"          # too short to split
    assert runner.strategy({"b": 32, "d": 512}, 512) == "fused"         # short: one launch, not three
    assert runner.strategy({"b": 32, "d": 512}, 513) == "time blocks"
    assert runner.strategy({"b": 64, "d": 4096}, 4096) == "fused"       # enough recurrences
    # time contiguous ("b d t"): a warp per recurrence whatever their count, lanes on neighbouring steps
    assert runner.strategy({"b": 64, "d": 4096}, 4096, time_contiguous=True) == "warp"
    assert runner.strategy({"b": 64, "d": 4096}, 63, time_contiguous=True) == "fused"  # under two rounds
    monkeypatch.setenv("SSMC_CUDA_TIME_BLOCKS", "1")
    assert runner.strategy({"b": 8, "d": 2048}, 4096) == "fused"

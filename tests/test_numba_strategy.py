"""The Numba backend's choice of parallel axes (`ssmc/backends/numba/strategy.py`).

Relative error = max|got - want| / max|want| against the float64 interpreter; thresholds 1e-10
(float64) and 2e-4 (float32).
"""

from __future__ import annotations

import importlib

import numpy as np
import pytest

from ssmc.backends import interpreter
from ssmc.backends.numba import strategy
from ssmc.backends.numba.runner import NumbaRunner
from ssmc.passes.autodiff import derive_backward

mamba1 = importlib.import_module("ssmc.examples.mamba1")
BW = derive_backward(mamba1.SPEC.program)
PROGRAMS = {"forward": mamba1.SPEC.program, "carries": BW.carries, "adjoint": BW.adjoint}


def test_mamba1_carries_and_adjoint_core_run_parallel_over_b_d_only_when_that_is_enough():
    for name in ("carries", "adjoint"):
        runner = NumbaRunner(PROGRAMS[name], "float32")
        assert runner.narrow is not None, name
        wide = [k.parallel for k in runner.lowered.kernels if len(k.parallel) > 2]
        assert wide == [("b", "d", "n")], name
        narrowed = [k.parallel for k in runner.narrow.kernels if k.name.endswith(strategy.SUFFIX)]
        assert narrowed == [("b", "d")], name
        assert strategy.use_narrow(runner.narrow, {"b": 2, "d": 256, "n": 16}, threads=2)
        assert not strategy.use_narrow(runner.narrow, {"b": 1, "d": 3, "n": 16}, threads=2)
    assert NumbaRunner(PROGRAMS["forward"], "float32").narrow is None  # already [b d]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("sizes", [{"b": 1, "d": 3, "n": 5}, {"b": 3, "d": 7, "n": 5}])
@pytest.mark.parametrize("name", list(PROGRAMS))
def test_narrow_and_wide_kernels_match_the_interpreter(name, sizes, dtype):
    program = PROGRAMS[name]
    length = 7
    rng = np.random.default_rng(3)
    seqs = {d.name: 0.5 * rng.standard_normal((length, *(sizes[a] for a in d.axes))) for d in program.seqs}
    params = {d.name: -np.abs(rng.standard_normal([sizes[a] for a in d.axes])) for d in program.params}
    initial = {d.name: rng.standard_normal([sizes[a] for a in d.axes]) for d in program.states}
    want = interpreter.run_recurrence(program, seqs, params, initial, sizes, length)
    cast = [{k: v.astype(dtype) for k, v in d.items()} for d in (seqs, params, initial)]
    got = NumbaRunner(program, dtype).run(*cast, sizes, length)
    tol = 1e-10 if dtype == "float64" else 2e-4
    for w, g in zip(want, got):
        for key in w:
            err = np.abs(g[key] - w[key]).max() / max(np.abs(w[key]).max(), 1e-30)
            assert err <= tol, (key, err)

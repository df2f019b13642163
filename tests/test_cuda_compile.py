"""Every generated CUDA kernel of the examples compiles for sm_80 and sm_90 with zero spills (no GPU needed)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from strategies import recurrences

from ssmc.backends.cuda import nvrtc
from ssmc.backends.cuda.report import kernel_reports
from ssmc.runtime.random_inputs import axis_sizes

pytestmark = pytest.mark.skipif(not nvrtc.available(), reason=nvrtc.unavailable_reason())

RECURRENCES = ["hgrn", "mamba1", "mamba1_block", "mamba2", "mingru", "linear_attention", "retnet", "lstm", "gru"]


def kernels(program, arch="sm_90", dtype="float32", lengths=(16, 4096)):
    """Every kernel the CUDA backend launches for `program`'s forward and gradient (ssmc inspect's
    reports), at a short length (one thread per recurrence) and a long one (time blocks)."""
    sizes = axis_sizes(program, np.random.default_rng(0), low=8, high=8, given={"n": 16})
    seen = set()
    for length in lengths:
        for r in kernel_reports(program, sizes, length, dtype, arch):
            if r.source not in seen:
                seen.add(r.source)
                yield r


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", RECURRENCES)
def test_example_kernels_compile_without_spills(name, arch):
    module = importlib.import_module(f"ssmc.examples.{name}")
    # CUDA part 1 covers the diagonal-linear family: none of its kernels may spill, forward or
    # backward. Other families' adjoint cores (one thread per head or per batch row, holding a whole
    # matrix state) must compile; they spill until their own lowerings (chunked matrix form, per-step
    # GEMMs) replace them.
    strict = module.FAMILY == "diagonal linear"
    reports = list(kernels(module.SPEC.program, arch))
    assert {"forward", "recompute", "adjoint"} <= {r.program for r in reports}
    for r in reports:
        assert r.resources is not None, r.error
        if strict or r.program == "forward":
            assert not r.resources.spills, r.resources.summary()


def test_map_kernels_along_time_compile():
    """At the benchmark size with time contiguous (layout "b d t"): every kernel of the Mamba-1 block
    compiles (the fusion stage's sequences `row<k>` next to the template's own names), and the norm's
    row kernel runs consecutive threads along time."""
    program = importlib.import_module("ssmc.examples.mamba1_block").SPEC.program
    sizes = {"b": 8, "d": 1536, "n": 16}
    reports = kernel_reports(program, sizes, 2048, time_contiguous=True)
    assert all(r.resources is not None for r in reports), [r.error for r in reports if r.error]
    rows = [r for r in reports if r.strategy.endswith(": map")]
    assert rows and all(r.resources is not None and not r.resources.spills for r in rows)
    assert all("consecutive threads along time" in r.source for r in rows if r.launch.nblk == 2048)


SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


@settings(max_examples=15, **SETTINGS)
@given(spec=recurrences())
def test_random_recurrence_kernels_compile(spec):
    """Every random spec's kernels compile (spills are a speed matter here; examples must not spill)."""
    for r in kernels(spec.program, lengths=(4096,)):
        assert r.resources is not None, r.error

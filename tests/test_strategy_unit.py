"""The steps of docs/architecture.md's "How to add a strategy", followed by a toy strategy defined
here: it registers in the CUDA strategy table, is selected by its rule (and passed over elsewhere),
prints its kernel from its own template, and runs against the interpreter under the CUDA emulator."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import ssmc
from ssmc.backends.cuda import select
from ssmc.backends.cuda.kernels import template
from ssmc.backends.cuda.kernels.base import Shape, Verdict
from ssmc.backends.cuda.kernels.thread import PerIndex, kernel_context
from ssmc.backends.cuda.printer import with_free_array_names
from ssmc.backends.cuda.source import exact_products, has_half, render

TEMPLATE = Path(__file__).with_name("toy_strategy.cu.j2")


class Toy(PerIndex):
    """Step 1: a thread per recurrence, time inside, from its own template; for forward scans whose
    program is named "toy_scan" (its rule), at any size."""

    name = "toy"

    def consider(self, runner, shape: Shape, forced: str | None) -> Verdict:
        if forced:
            return self.refused(f"SSMC_CUDA_STRATEGY={forced}")
        if runner.program.name != "toy_scan" or runner.time_blocks is None:
            return self.refused("not the toy scan")
        return self.taken("the toy rule: a forward scan named toy_scan")

    def source(self, runner, k, specs, sizes, mapping, length):
        """Step 2: its template context (the thread kernel's, with its own template) rendered."""
        def build():
            context = {**kernel_context(k, specs, sizes, mapping), "template": template(TEMPLATE)}
            return render(runner.program.name, self.name, runner.ctype, [context], has_half(specs),
                          exact_products(runner.program))
        return with_free_array_names(set(specs), build)


@ssmc.recurrence
def toy_scan(h: ssmc.State["b d"], a: ssmc.Seq["b d"], x: ssmc.Seq["b d"]):
    h = a * h + x
    return h, h


@pytest.fixture
def toy(fresh_runners, monkeypatch):
    """Step 3: the strategy in the table, before the warp kernel, for the test's duration."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    select.register(Toy(), before="warp")
    yield
    select.unregister("toy")


def test_the_toy_strategy_is_selected_by_its_rule_and_passed_over_elsewhere(toy):
    from ssmc.backends.cuda.runner import runner_for

    chosen = runner_for(toy_scan.program).selection({"b": 2, "d": 3}, 7, time_contiguous=True)
    assert chosen.strategy == "toy" and chosen.reason.startswith("the toy rule")
    assert [v.strategy for v in chosen.tried] == ["rows", "lanes", "lowered", "toy"]
    from ssmc.examples import hgrn

    passed = runner_for(hgrn.SPEC.program).selection({"b": 2, "d": 3}, 180, time_contiguous=True)
    assert passed.strategy == "warp" and "toy: not the toy scan" in passed.refusals()


@pytest.mark.parametrize("length", [1, 7, 180])
def test_the_toy_strategy_runs_against_the_interpreter(toy, length):
    """Step 4: its kernel, built from its template, runs under the CUDA emulator and matches."""
    from ssmc.backends.cuda.report import kernel_reports

    rng = np.random.default_rng(length)
    a, x = rng.uniform(0.5, 1.0, (2, length, 3)), rng.standard_normal((2, length, 3))
    h0 = rng.standard_normal((2, 3))
    want_y, want_h = ssmc.compile(toy_scan, "interpreter", layout="b t ...")(a=a, x=x, h=h0, return_final_states=True)
    got_y, got_h = ssmc.compile(toy_scan, "cuda", layout="b t ...")(a=a, x=x, h=h0, return_final_states=True)
    np.testing.assert_allclose(np.asarray(got_y), want_y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.asarray(got_h), want_h, rtol=1e-12, atol=1e-12)
    forward, *_ = kernel_reports(toy_scan.program, {"b": 2, "d": 3}, length, "float64", compile_kernels=False)
    assert forward.strategy == "toy" and "run by the toy strategy" in forward.source

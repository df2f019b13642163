"""bench/cpu.py runs end to end at its --quick sizes (a real process, as a user would run it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "cpu.py"


def test_cpu_bench_quick_interpreter_runs():
    pytest.importorskip("torch")
    pytest.importorskip("numba")
    env = dict(os.environ)
    # Not a measurement: on a shared machine, OpenMP threads that spin while waiting for a busy core make
    # torch's backward hundreds of times slower; passive waiting keeps this test short there.
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cmd = [sys.executable, str(BENCH), "--quick", "--backend", "interpreter"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    out = proc.stdout
    assert "| workload | implementation |" in out
    for row in ("torch loop", "numba loop", "torch.nn.LSTM", "ssmc [interpreter]"):
        assert row in out, row
    assert "FAIL" not in out

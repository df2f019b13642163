"""The benchmark scripts run end to end at small sizes (a real process, as a user would run it):
bench/cpu.py anywhere; bench/block_scan.py's and bench/lanes_backward_probe.py's kernels compiled by
NVRTC anywhere and run on a GPU; the edits of bench/lanes_variants.py and bench/backward_variants.py
find their text in the generated kernels, which compile."""

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


def _bench_module(name: str):
    """A script of bench/ imported as a module (its kernels' sources), or a skip without NVRTC."""
    import importlib

    from ssmc.backends.cuda import nvrtc

    if not nvrtc.available():
        pytest.skip(f"NVRTC: {nvrtc.unavailable_reason()}")
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "bench"))


def test_block_scan_kernels_compile_without_spills():
    """bench/block_scan.py's three block scans (Hillis-Steele, Blelloch, warp shuffles) for sm_90."""
    from ssmc.backends.cuda import nvrtc

    block_scan = _bench_module("block_scan")
    built = nvrtc.compile_source(block_scan.source(), "sm_90", ("-std=c++17",))
    assert set(built.resources) == set(block_scan.VARIANTS.values())
    for name, usage in built.resources.items():
        assert not usage.spill_store_bytes and not usage.spill_load_bytes, name


@pytest.mark.gpu
def test_block_scan_bench_runs_and_checks_its_outputs(tmp_path):
    """At a length of two tiles and a partial third (2052 steps, 3 channels): each variant's output
    agrees with the float64 loop (the script exits non-zero otherwise) and the table is written."""
    cmd = [sys.executable, str(ROOT / "bench" / "block_scan.py"), "--batch", "1", "--dim", "3", "--length", "2052",
           "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    table = (tmp_path / "block_scan.md").read_text()
    for variant in ("hillis", "blelloch", "warp"):
        assert f"| {variant} |" in table


def test_lanes_backward_probe_variants_compile():
    """Every variant of the hand-written lanes backward compiles for sm_90; those that do not ask
    ptxas for a register bound, and the lean ones, spill nothing; the lean ones fit 6 blocks of 64
    threads an SM (<= 168 registers, <= 228 KiB / 6 - 1 KiB of shared memory), which puts Mamba-1's
    B8 D1536 (768 blocks) on an H100's 132 SMs in one wave."""
    from ssmc.backends.cuda import nvrtc

    probe = _bench_module("lanes_backward_probe")
    for variant, flags in probe.VARIANTS.items():
        usage = nvrtc.compile_source(probe.source(variant), "sm_90", ("-std=c++17",)).resources[
            "mamba1_lanes_backward"]
        if flags["MIN_BLOCKS"] == 1 or flags["LEAN"]:
            assert not usage.spill_store_bytes and not usage.spill_load_bytes, (variant, usage)
        if flags["LEAN"]:
            assert usage.registers <= 168 and usage.shared_bytes <= 233472 // 6 - 1024, (variant, usage)


@pytest.mark.gpu
def test_lanes_backward_probe_runs_and_agrees():
    """At B2 D32 L96 (3 chunks, 2 blocks of rows): every variant's gradients agree with ssmc's
    (the script exits non-zero otherwise)."""
    cmd = [sys.executable, str(ROOT / "bench" / "lanes_backward_probe.py"), "--batch", "2", "--dim", "32",
           "--length", "96"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for variant in ("registers", "lean-6"):
        assert f"{variant}: " in proc.stdout and "registers," in proc.stdout


def test_lanes_variants_edit_the_generated_forward_and_compile():
    """bench/lanes_variants.py's edits each find their text in the generated Mamba-1 lanes forward
    (B8 D1536 L2048 N16, "b d t"): were the generator to change it, a variant would time the unedited
    kernel and report no change. The variants that keep the results compile for sm_90 without spills."""
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.report import kernel_reports
    from ssmc.examples import mamba1

    variants = _bench_module("lanes_variants")
    report, = kernel_reports(mamba1.SPEC.program, {"b": 8, "d": 1536, "n": 16}, 2048, backward=False,
                             compile_kernels=False, time_contiguous=True)
    assert report.strategy.startswith("lanes"), report.strategy
    for name, (edit, _, drops) in variants.VARIANTS.items():
        if edit is None:
            continue
        edited = edit(report.source)
        assert edited != report.source, name
        if not drops:
            usage = nvrtc.compile_source(edited, "sm_90", name="lanes_variant.cu").resources[report.name]
            assert not usage.spill_store_bytes and not usage.spill_load_bytes, (name, usage)


@pytest.mark.parametrize("sizes, length", [({"b": 8, "d": 1536, "n": 16}, 2048), ({"b": 32, "d": 512, "n": 16}, 180)])
def test_backward_variants_edit_the_generated_backward_and_compile(sizes, length, monkeypatch):
    """bench/backward_variants.py's edits each find their text in the generated Mamba-1 fused backward
    at both benchmark shapes ("b d t"), and every edited kernel compiles for sm_90; those that keep
    the results without spills, but where they bound the registers (`__launch_bounds__`). The warp
    kernel's, as the script takes it (at L 180 the lanes backward runs by default)."""
    monkeypatch.setenv("SSMC_CUDA_LANES_BACKWARD", "0")
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.report import kernel_reports
    from ssmc.examples import mamba1

    variants = _bench_module("backward_variants")
    reports = kernel_reports(mamba1.SPEC.program, sizes, length, compile_kernels=False, time_contiguous=True)
    report, = [r for r in reports if r.name.endswith("_fused_backward")]
    assert variants.KERNEL in report.source
    for name, (edit, _, drops, *_) in variants.VARIANTS.items():
        if edit is None:
            continue
        edited = edit(report.source)  # raises NotInSource where its pattern is not there
        assert edited != report.source, name
        usage = nvrtc.compile_source(edited, "sm_90", name="backward_variant.cu").resources[report.name]
        if not drops and "__launch_bounds__" not in name:
            assert not usage.spill_store_bytes and not usage.spill_load_bytes, (name, usage)

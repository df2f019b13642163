"""The ``ssmc`` command line, run in-process through `ssmc.cli.main` (and once as a real process)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points
from pathlib import Path

import pytest

import ssmc
from ssmc import examples, pipeline
from ssmc.cli import main

ROOT = Path(__file__).resolve().parents[1]
HGRN = str(ROOT / "examples" / "hgrn.py")


def write_spec(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("import ssmc\n\n" + textwrap.dedent(body))
    return path


def line_of(path: Path, text: str) -> int:
    """1-based number of the first line of `path` containing `text`."""
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


TWO_SPECS = """
@ssmc.recurrence
def first(h: ssmc.State["b d"], x: ssmc.Seq["b d"]):
    return 0.5 * h + x, h

@ssmc.recurrence
def second(h: ssmc.State["b d"], x: ssmc.Seq["b d"]):
    h = ssmc.tanh(h + x)
    return h, h
"""


# -- show --------------------------------------------------------------------------------------

def test_show_prints_the_ir(capsys):
    assert main(["show", HGRN, "--stage", "ir"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("recurrence hgrn")
    assert "sigmoid f" in out and "h <- %" in out
    assert out.count("recurrence ") == 1  # `SPEC = hgrn` is the same spec: shown once


def test_show_all_specs_or_one_by_name(tmp_path, capsys):
    path = write_spec(tmp_path, "two.py", TWO_SPECS)
    assert main(["show", str(path)]) == 0
    out = capsys.readouterr().out
    assert "recurrence first" in out and "recurrence second" in out
    assert main(["show", f"{path}:second"]) == 0
    out = capsys.readouterr().out
    assert "recurrence second" in out and "first" not in out and "tanh" in out


def test_show_unknown_name_is_one_line(tmp_path, capsys):
    path = write_spec(tmp_path, "two.py", TWO_SPECS)
    assert main(["show", f"{path}:third"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no spec named 'third'" in err and "first, second" in err


def test_show_unknown_stage(capsys):
    assert main(["show", HGRN, "--stage", "no_such_stage"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "no_such_stage" in err


def test_show_help_lists_the_stages(capsys):
    assert main(["show", "--help"]) == 0
    out = capsys.readouterr().out
    for name, (description, _) in pipeline.STAGES.items():
        assert name in out and description in out


def test_missing_file(capsys):
    assert main(["show", "no/such/file.py"]) == 1
    assert capsys.readouterr().err == "error: no/such/file.py: no such file\n"


# -- check -------------------------------------------------------------------------------------

def test_check_example(capsys):
    assert main(["check", HGRN, "--length", "7", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "hgrn.py:hgrn" in out and "recurrence" in out and "L=7" in out and "finite" in out


def test_check_bad_spec_is_one_line_naming_file_and_line(tmp_path, capsys):
    path = write_spec(tmp_path, "bad_spec.py", """
        @ssmc.recurrence
        def bad(h: ssmc.State["b d"], x: ssmc.Seq["b d"]):
            h = h + x.sum("zz")
            return h, h
    """)
    assert main(["check", str(path)]) == 1
    captured = capsys.readouterr()
    err = captured.err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert f"bad_spec.py:{line_of(path, 'zz')}:" in err and "'zz'" in err
    assert "Traceback" not in err + captured.out


def test_check_file_that_raises_is_one_line(tmp_path, capsys):
    path = write_spec(tmp_path, "broken.py", "x = 1\ny = undefined_name\n")
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {path}:{line_of(path, 'undefined_name')}: NameError: " \
                  "name 'undefined_name' is not defined\n"


def test_check_non_finite_output_fails(tmp_path, capsys):
    path = write_spec(tmp_path, "nan_spec.py", """
        @ssmc.recurrence
        def nan_spec(h: ssmc.State["b d"], x: ssmc.Seq["b d"]):
            h = h + ssmc.log(x - 10.0)       # log of a negative number
            return h, h
    """)
    assert main(["check", str(path)]) == 1
    assert "NOT FINITE" in capsys.readouterr().out


def test_check_runs_every_file_and_attention(tmp_path, capsys):
    bad = write_spec(tmp_path, "bad.py", "raise ValueError('nope')\n")
    attn = write_spec(tmp_path, "attn.py", """
        def alibi(score, q_idx, kv_idx, slope: ssmc.Param["h"]):
            return score - slope * (q_idx - kv_idx)

        attn = ssmc.attention(score_mod=alibi, mask_mod=ssmc.causal)
    """)
    assert main(["check", str(bad), HGRN, str(attn)]) == 1
    captured = capsys.readouterr()
    assert f"bad.py:{line_of(bad, 'nope')}: ValueError: nope" in captured.err
    assert "hgrn.py:hgrn" in captured.out
    assert "attn.py:attn  attention" in captured.out and "out[64," in captured.out


# -- bench -------------------------------------------------------------------------------------

def _bench_rows(out: str) -> dict[str, str]:
    """The table's rows by spec name (its first column)."""
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("spec "))
    return {line.split()[0]: line for line in lines[head + 1:] if line.strip()}


def test_bench_checks_then_times_forward_and_gradient(capsys):
    assert main(["bench", HGRN, "--backend", "numba", "--sizes", "b=3,d=5", "--length", "180", "--repeat", "2",
                 "--check-length", "7", "--layout", "b t ..."]) == 0
    out = capsys.readouterr().out
    assert "backend numba" in out and "layout 'b t ...'" in out and "medians of 2 calls" in out
    row = _bench_rows(out)["hgrn"].split()
    assert row[1:4] == ["b=3", "d=5", "180"]
    fwd, grad, err = float(row[4]), float(row[5]), float(row[6])
    assert fwd > 0 and grad > 0 and err < 1e-3 and row[7] == "(L=7)" and row[-1] == "OK"


def test_bench_forward_only_in_float64_on_the_interpreter(capsys):
    assert main(["bench", HGRN, "--backend", "interpreter", "--dtype", "float64", "--length", "7", "--repeat", "1",
                 "--forward-only"]) == 0
    row = _bench_rows(capsys.readouterr().out)["hgrn"].split()
    assert float(row[4]) > 0 and row[5] == "-" and float(row[6]) == 0.0 and row[-1] == "OK"


def test_bench_a_backend_that_disagrees_fails_untimed(monkeypatch, capsys):
    from ssmc.runtime import benchmark

    monkeypatch.setattr(benchmark, "check", lambda *args: (0.5, "grad x"))
    assert main(["bench", HGRN, "--backend", "numba", "--length", "7", "--repeat", "1"]) == 1
    row = _bench_rows(capsys.readouterr().out)["hgrn"]
    assert "FAIL (grad x; tolerance 0.001; not timed)" in row and row.split()[3:6] == ["7", "-", "-"]


def test_bench_growing_recurrence_is_one_line_and_the_others_run(tmp_path, capsys):
    path = write_spec(tmp_path, "grow.py", """
        @ssmc.recurrence
        def grow(h: ssmc.State["b d"], x: ssmc.Seq["b d"]):
            h = 4.0 * h + x                   # grows without bound on any input
            return h, h

        @ssmc.recurrence
        def slow_growth(h: ssmc.State["b d"], x: ssmc.Seq["b d"]):
            h = 1.5 * h + x                   # within float32 over 40 steps, past it over 400
            return h, h
    """)
    assert main(["bench", str(path), "--backend", "numba", "--length", "400", "--check-length", "40",
                 "--repeat", "1"]) == 1
    captured = capsys.readouterr()
    # less the compile notes (runtime/progress.py: "ssmc: compiling ..." where a compile takes over a
    # second, as on a busy machine or beside another test worker)
    err = "".join(line for line in captured.err.splitlines(keepends=True) if not line.startswith("ssmc: "))
    assert err.startswith("error: grow: on random inputs of scale 0.5 its outputs reach ")
    assert err.count("\n") == 1 and "Traceback" not in err
    rows = _bench_rows(captured.out)
    assert "grow" not in rows  # checked over 40 steps (1.5^40 ~ 1e7), timed over 400 (past float32)
    assert "OK (outputs over 400 steps not finite: the inputs make it grow; see --scale)" in rows["slow_growth"]


def test_bench_rejects_bad_options_before_any_work(capsys):
    for argv, message in ((["--repeat", "0"], "--repeat must be at least 1, got 0"),
                          (["--length", "0"], "--length must be at least 1, got 0"),
                          (["--check-length", "-2"], "--check-length must be at least 1, got -2"),
                          (["--scale", "nan"], "--scale must be a positive number, got nan"),
                          (["--scale", "-1"], "--scale must be a positive number, got -1.0"),
                          (["--sizes", "b=2,d=4,b=3"], "--sizes: b given twice")):
        assert main(["bench", HGRN, *argv]) == 1
        captured = capsys.readouterr()
        assert captured.err == f"error: {message}\n" and captured.out == "", argv
    assert main(["inspect", HGRN, "--length", "-3"]) == 1
    assert capsys.readouterr().err == "error: --length must be at least 1, got -3\n"
    assert main(["show", str(ROOT / "examples")]) == 1
    assert "a folder; give a spec file" in capsys.readouterr().err


@pytest.mark.gpu
def test_bench_on_the_gpu_checks_and_times_mamba1(capsys):
    """Mamba-1 on the cuda backend, channels before time, at an awkward length and channel count."""
    assert main(["bench", str(ROOT / "examples" / "mamba1.py"), "--backend", "cuda", "--layout", "b d t",
                 "--sizes", "b=2,d=37,n=16", "--length", "1000", "--repeat", "3", "--scale", "0.005"]) == 0
    out = capsys.readouterr().out
    assert "backend cuda" in out
    row = _bench_rows(out)["mamba1"].split()
    assert float(row[5]) > 0 and float(row[6]) > 0 and float(row[7]) < 1e-3 and "OK" in row


def test_bench_rejects_unknown_axes_and_skips_attention(capsys):
    assert main(["bench", HGRN, "--sizes", "q=3"]) == 1
    assert capsys.readouterr().err == "error: hgrn: --sizes: no axes ['q'] (its axes: b d)\n"
    assert main(["bench", str(ROOT / "examples" / "alibi_attention.py"), "--backend", "interpreter"]) == 0
    assert "attention's tiled torch path is timed by bench/harness.py" in capsys.readouterr().out


# -- demo --------------------------------------------------------------------------------------

def test_demo_runs_every_example(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    names = [m.name for m in pkgutil.iter_modules(examples.__path__) if not m.name.startswith("_")]
    assert "hgrn" in names
    for name in names:
        assert any(line.startswith(name + " ") and line.endswith("OK") for line in out.splitlines()), name
    assert f"backend {ssmc.default_backend()}" in out
    assert f"{len(names)} of {len(names)} examples OK" in out


# -- as a program ------------------------------------------------------------------------------

def test_version_and_entry_point():
    (script,) = entry_points(group="console_scripts", name="ssmc")
    assert script.value == "ssmc.cli:main" and script.load() is main
    done = subprocess.run([sys.executable, "-m", "ssmc", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == f"ssmc {ssmc.__version__}"
    done = subprocess.run([sys.executable, "-m", "ssmc", "show", HGRN + ":nope"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 1 and done.stderr.startswith("error: ") and done.stderr.count("\n") == 1


def test_inspect_lists_every_kernel_with_its_launch_and_resources(capsys):
    from ssmc.backends.cuda import nvrtc

    assert main(["inspect", HGRN, "--sizes", "b=2,d=64", "--length", "4096", "--time-contiguous"]) == 0
    out = capsys.readouterr().out
    assert "hgrn: b=2 d=64 L=4096 float32, sm_90" in out
    for kernel in ("hgrn_warp", "hgrn_carries_warp", "hgrn_backward_warp"):
        row = next(line for line in out.splitlines() if kernel in line.split()[1:-3])
        assert "warp, 8 warps a recurrence" in row and "128 x 256" in row  # 2 * 64 recurrences, 8 warps each
        if nvrtc.available():
            registers = int(row.split()[-3])
            assert registers > 0
        assert f"{kernel}: " in out and ".cu" in out
    assert main(["inspect", HGRN, "--sizes", "b=2,d=64", "--length", "16", "--forward-only"]) == 0
    out = capsys.readouterr().out
    assert "hgrn_fused" in out and "backward" not in out


def test_inspect_says_why_each_strategy_and_warns_when_a_grid_cannot_fill_the_gpu(capsys, monkeypatch):
    """The LSTM at B64 as kernels: a thread per batch row, one block of 128 threads on a GPU of 132 SMs;
    by default its step loop. Mamba-2's element-wise adjoint; by default its chunked core."""
    lstm_args = ["inspect", str(ROOT / "examples" / "lstm.py"), "--sizes", "b=64,i=512,k=512", "--length", "180"]
    mamba2_args = ["inspect", str(ROOT / "examples" / "mamba2.py"), "--sizes", "b=2,g=1,r=8,p=64,n=64",
                   "--length", "1024"]
    assert main(lstm_args) == 0
    assert "step loop: lstm: a nonlinear recurrence reading its states through 1 recurrent product" in (
        capsys.readouterr().out)
    assert main(mamba2_args) == 0
    out = capsys.readouterr().out
    assert "chunked: mamba2_core (matrix linear h [b g r p n]" in out and "β [b g r]" in out
    # the core reads x as given, β = softplus(dt) apart: no pre kernel writes v = softplus(dt) x
    assert "mamba2_pre_mamba2_beta" in out and "mamba2_pre_mamba2_v " not in out
    monkeypatch.setenv("SSMC_CUDA_STEP_LOOP", "0")
    monkeypatch.setenv("SSMC_CUDA_CHUNKED", "0")
    assert main(lstm_args) == 0
    out = capsys.readouterr().out
    assert "why forward is fused: independent along [b]: a thread per recurrence, 64" in out
    assert "warning: lstm_fused launches 1 block of 128 threads, fewer than the 132 SMs of the GPU" in out
    assert main(mamba2_args) == 0
    out = capsys.readouterr().out
    assert "why adjoint is split: the sums over time (grad_A, grad_D) reduce axes" in out
    assert "warning: mamba2_summary" not in out


def test_inspect_lists_the_flash_kernels_of_an_attention_spec(capsys):
    """ALiBi attention at d 64, bf16: the forward, delta and key-block kernels with their config and grid
    (B2 H4 L1000: 8 query blocks of 128 a batch index, 16 key blocks of 64), ptxas' registers and no
    spills; float32 names why no flash kernel runs."""
    from ssmc.backends.cuda import nvrtc

    spec = str(ROOT / "examples" / "alibi_attention.py")
    assert main(["inspect", spec, "--sizes", "b=2,h=4,d=64", "--length", "1000", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "flash kernels (bfloat16, sm_90):" in out
    rows = {line.split()[1]: line.split() for line in out.splitlines() if line.startswith(("forward ", "backward "))}
    assert rows["wg128"][3:6] == ["64", "x", "256"] and rows["wgp"][3:6] == ["128", "x", "128"]
    assert rows["delta"][3:6] == ["2000", "x", "128"]
    if nvrtc.available():
        for row in rows.values():
            assert 0 < int(row[6]) <= 255 and row[-1] == "0", row
    assert "warning: flash_fwd" in out  # 64 blocks on a GPU of 132 SMs
    assert main(["inspect", spec, "--sizes", "d=64", "--dtype", "float32", "--forward-only"]) == 0
    assert "no flash kernels: float32 inputs" in capsys.readouterr().out


def test_inspect_rejects_bad_sizes(capsys):
    assert main(["inspect", HGRN, "--sizes", "b=two"]) == 1
    assert "--sizes" in capsys.readouterr().err
    assert main(["inspect", HGRN, "--sizes", "q=3"]) == 1
    assert "no axes ['q']" in capsys.readouterr().err


def test_show_cuda_prints_the_generated_source(capsys):
    assert main(["show", "--stage", "cuda", HGRN]) == 0
    out = capsys.readouterr().out
    assert 'extern "C" __global__ void hgrn_' in out and "constexpr int n_b = 16;" in out


def test_show_numba_prints_the_generated_source(capsys):
    assert main(["show", "--stage", "numba", str(ROOT / "examples" / "mamba1.py")]) == 0
    out = capsys.readouterr().out
    assert "def mamba1_fused(" in out and "numba.prange" in out
    assert "ah_m0[t - c0] = m0" in out  # softplus(delta + bias) computed ahead of the sequential steps

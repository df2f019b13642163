"""bench/gpu_robustness.py (issue 38's GPU robustness run) works before it reaches a GPU: its command line
parses, its plans are worked out on the host (which forced strategies apply, which give the same kernels,
the order a time budget cuts), compute-sanitizer logs are read back to the workload that ran, and with the
CUDA kernels emulated (``SSMC_CUDA_EMULATE=1``) a sanitizer workload, a long-sequence item and the overflow
checks run at tiny sizes, and the whole script runs end to end with a stand-in for compute-sanitizer."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# the emulated workloads share their kernels (the same sizes, length and layout "b t ...": the strides are
# in the generated source) so that few are compiled
SIZES = {"batch": 3, "dim": 37}
LENGTH = 7


@pytest.fixture(scope="module")
def script():
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module("gpu_robustness")
    finally:
        sys.path.remove(str(BENCH))


def _emulator_or_skip():
    pytest.importorskip("torch")
    from ssmc.backends.cuda import emulator

    if not emulator.available():
        pytest.skip("no C++ compiler for the CUDA emulator")


def test_the_command_line_parses(script, capsys):
    with pytest.raises(SystemExit) as exc:
        script.parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--out", "--quick", "--sanitize", "--long", "--overflow", "--budget-s", "--sanitize-worker"):
        assert flag in text, flag
    args = script.parse_args(["--quick", "--out", "somewhere", "--tools", "memcheck", "--lengths", "7,180"])
    assert args.quick and args.out == "somewhere" and script._csv(args.lengths, int) == [7, 180]
    assert script.parse_args([]).tools.split(",") == list(script.TOOLS)
    with pytest.raises(SystemExit):  # a worker needs its plan and results files
        script.parse_args(["--worker", "long"])


def test_the_sanitizer_plan_at_the_example_sizes(script):
    plan = script.sanitize_plan(["hgrn", "mamba1"], quick=True)
    assert [e["index"] for e in plan] == list(range(len(plan)))
    assert len({e["id"] for e in plan}) == len(plan)
    by = {(e["example"], e["length"], e["strategy"]): e for e in plan}
    lanes = by[("hgrn", 180, "lanes")]
    assert lanes["status"] == "n/a" and "SSMC_CUDA_STRATEGY=lanes" in lanes["note"]
    assert by[("hgrn", 180, "rows")]["status"] == "n/a"
    assert by[("hgrn", 180, "fused")]["status"] == "same"  # a thread per recurrence is what it picks anyway
    assert by[("mamba1", 180, "lanes")]["status"] == "run" and by[("mamba1", 180, "lanes")]["kernels"]
    run = [e for e in plan if e["status"] == "run"]
    assert [e["tier"] for e in run] == sorted(e["tier"] for e in run)
    assert [e["strategy"] for e in run[:2]] == ["auto", "auto"]  # every example's own choice first
    assert {e["layout"] for e in plan} == {"b t ...", "b d t"}  # each example's own layout in --quick


def test_the_full_plans(script):
    def stub(name, layout, length, dtype, strategy):  # as kernel_plan: (signature, kernels, labels)
        if strategy in ("rows", "lanes"):
            raise ValueError(f"SSMC_CUDA_STRATEGY={strategy}: does not apply")
        same = "auto" if strategy == "fused" else strategy
        return (name, layout, length, dtype, same), [f"{name}_kernel"], [same]

    plan = script.sanitize_plan(planner=stub)
    run = [e for e in plan if e["status"] == "run"]
    examples = list(script.SANITIZE_EXAMPLES)
    assert [e["example"] for e in run[:len(examples)]] == examples
    assert all(e["length"] == 180 and e["strategy"] == "auto" and e["tier"] == 0 for e in run[:len(examples)])
    assert {e["length"] for e in run} == {1, 7, 180, 1000} and {e["dtype"] for e in run} == {"float32", "bfloat16"}
    assert {e["layout"] for e in run if e["example"] == "linear_attention"} == {"b h t ...", "b t ...", "b d t"}
    assert {e["status"] for e in plan} == {"run", "n/a", "same"}

    long = script.long_plan()
    assert {(i["kind"], i["length"]) for i in long} == {("forward", 10**6), ("gradient", 200_000),
                                                        ("reference", 100_000)}
    assert {i["example"] for i in long} == {"mamba1", "hgrn", "retnet", "mamba2", "simple_gla", "gla"}
    assert {i["dtype"] for i in long} == {"float32", "bfloat16"}
    assert [i["kind"] for i in long[:10]] == ["forward"] * 10
    over = script.overflow_plan()
    assert all(i["elements"] > 2**31 for i in over) and len(script.overflow_plan(quick=True)) == 1
    assert {i["layout"] for i in over} == {"b t ...", "b d t"} and {i["kind"] for i in over} == {"forward", "gradient"}
    assert max(script.overflow_bytes(i) for i in over) < 70 * 2**30  # each fits a card of 80 GB alone
    cmd = script.sanitizer_command("compute-sanitizer", "racecheck")
    assert cmd[:3] == ["compute-sanitizer", "--tool", "racecheck"]
    assert cmd[cmd.index("--error-exitcode") + 1] == "99"
    assert cmd[cmd.index("--destroy-on-device-error") + 1] == "kernel"


def test_list_prints_the_plans(script, capsys):
    assert script.main(["--list", "--quick", "--examples", "hgrn", "--lengths", "7"]) == 0
    text = capsys.readouterr().out
    assert "sanitizer plan:" in text and "hgrn [b t ...] L=7 fp32 auto" in text
    assert "long-sequence plan:" in text and "overflow plan:" in text and "2,147,942,400 elements" in text


LOG = """\
========= COMPUTE-SANITIZER
========= Program hit cudaErrorInvalidValue (error 1) due to "invalid argument" on CUDA API call to cudaFree.
@@gpu-robustness begin 3 hgrn [b t ...] L=7 fp32 auto
========= Invalid __global__ read of size 4 bytes
=========     at 0x1f0 in hgrn_backward
=========     by thread (37,0,0) in block (0,0,0)
=========
========= Warning: Race reported between Read access at hgrn+0x30
@@gpu-robustness end 3 ok
@@gpu-robustness begin 5 mamba1 [b d t] L=7 fp32 auto
========= Error: Race reported between Write access at 0x90 in mamba1_lanes
=========     and Read access at 0x120 in mamba1_lanes [8 hazards]
========= Uninitialized __global__ memory read of size 4 bytes
=========     at mamba1_lanes_backward+0x40
@@gpu-robustness end 5 ok
@@gpu-robustness begin 6 retnet [b t ...] L=7 fp32 auto
@@gpu-robustness end 6 ok
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
========= ERROR SUMMARY: 4 errors
"""


def test_sanitizer_logs_are_read_back_to_the_workload(script):
    parsed = script.parse_sanitizer_log(LOG)
    w = parsed["workloads"]
    assert (w[3]["errors"], w[3]["warnings"], w[3]["api"]) == (1, 1, 0)
    assert "hgrn_backward" in w[3]["messages"][0]
    assert w[5]["errors"] == 2 and "mamba1_lanes" in w[5]["messages"][0]
    assert "mamba1_lanes_backward" in w[5]["messages"][1]
    assert 6 not in w  # ran clean
    assert (parsed["outside"]["errors"], parsed["outside"]["api"]) == (0, 1)
    assert parsed["total"] == 4 and len(parsed["summaries"]) == 2
    assert script.tool_cell({"status": "ok"}, w.get(6)) == "clean"
    assert script.tool_cell({"status": "ok"}, w[5]).startswith("**2 errors**")
    assert script.tool_cell({"status": "n/a"}, None) == "n/a"


def test_emulated_workloads_long_sequences_and_overflow_checks(script, monkeypatch, tmp_path):
    """A sanitizer workload (forward and three gradient calls against the interpreter), a forced strategy
    that does not apply, a long-sequence item and the overflow checks (forward, gradient; a wrong answer
    noticed) at tiny sizes through the emulated cuda backend, and the report they make."""
    _emulator_or_skip()
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setitem(script.SANITIZE_SIZES, "hgrn", dict(SIZES))
    plan = script.sanitize_plan(["hgrn"], quick=True, lengths=[LENGTH], strategies=["auto", "lanes"])
    entry = next(e for e in plan if e["status"] == "run")
    got = script.run_sanitize_workload(entry, "cpu", reference=True)
    assert got["status"] == "ok" and got["err"] < 1e-5, got
    na = script.run_sanitize_workload({**entry, "strategy": "lanes"}, "cpu", reference=True)
    assert na["status"] == "n/a" and "lanes" in na["note"]

    long = script.long_plan(examples=["hgrn"], lengths=dict.fromkeys(("forward", "gradient", "reference"), LENGTH))
    long = [dict(i, sizes=dict(SIZES)) for i in long if i["dtype"] == "float32" and i["kind"] != "gradient"]
    long_results = {i["index"]: script.run_long_item(i, "cpu") for i in long}
    for i in long:
        assert long_results[i["index"]]["status"] == "finite" and long_results[i["index"]]["err"] < 1e-5, i["id"]

    over = [dict(i, dtype="float32", batch=3, elements=3 * 37 * LENGTH)
            for i in script.overflow_plan(dim=37, length=LENGTH) if i["example"] == "hgrn" and i["layout"] == "b t ..."]
    over = over[:2]
    over_results = {i["index"]: script.run_overflow_item(i, "cpu") for i in over}
    assert [over_results[i["index"]]["status"] for i in over] == ["right", "right"], over_results
    assert {i["kind"] for i in over} == {"forward", "gradient"}
    monkeypatch.setattr(script, "_from_native", lambda arr, native: arr[0][::-1])  # steps reversed: wrong
    wrong = script.run_overflow_item(over[0], "cpu")
    assert wrong["status"] == "wrong" and wrong["finding"], wrong

    state = {"meta": {"date": "today", "command": "python bench/gpu_robustness.py", "budget_s": 1.0},
             "long": {"plan": long, "results": long_results, "info": [{"device": "emulated"}]},
             "overflow": {"plan": over, "results": {**over_results, over[0]["index"]: wrong}, "info": []}}
    text = script.write_report(tmp_path, state).read_text()
    assert "device: emulated" in text and "## 2. Long sequences" in text and "## 3. Inputs over 2^31" in text
    assert "| wrong |" in text and "**yes**" in text and (tmp_path / "robustness.json").exists()


FAKE_SANITIZER = """\
import subprocess, sys
args = sys.argv[1:]
if args == ["--version"]:
    print("stand-in compute-sanitizer")
    sys.exit(0)
app = next(k for k, a in enumerate(args) if a.endswith("gpu_robustness.py")) - 1
print("========= COMPUTE-SANITIZER", flush=True)
proc = subprocess.Popen(args[app:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
errors = 0
for line in proc.stdout:
    sys.stdout.write(line)
    sys.stdout.flush()
    if line.startswith("@@gpu-robustness begin") and not errors:
        print("========= Invalid __global__ read of size 4 bytes", flush=True)
        print("=========     at 0x70 in hgrn", flush=True)
        errors += 1
rc = proc.wait()
print(f"========= ERROR SUMMARY: {errors} errors", flush=True)
sys.exit(99 if errors else rc)
"""


def test_the_script_end_to_end_with_a_stand_in_sanitizer(tmp_path):
    """The parent plans, runs a "memcheck" worker (a stand-in that reports one error in the first workload)
    as a subprocess on the emulated backend, and writes the report and the logs (the plain pass is the same
    worker without the sanitizer: left out for time)."""
    _emulator_or_skip()
    fake = tmp_path / "compute-sanitizer"
    fake.write_text(f"#!{sys.executable}\n{FAKE_SANITIZER}")
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "SSMC_CUDA_EMULATE": "1"}
    cmd = [sys.executable, str(BENCH / "gpu_robustness.py"), "--sanitize", "--quick", "--examples", "hgrn",
           "--lengths", str(LENGTH), "--strategies", "auto,lanes", "--tools", "memcheck", "--sanitizer", str(fake),
           "--no-plain", "--budget-s", "120", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    assert "memcheck: 1 workloads run, 1 errors (NOT clean)" in proc.stdout, proc.stdout
    text = (out / "robustness.md").read_text()
    assert "| memcheck | 1 / 1 | 1 |" in text and "**no**" in text
    assert "| hgrn [b t ...] L=7 fp32 auto |" in text and "**1 error**" in text
    assert "Forced strategies that do not apply (n/a, by plan): hgrn: lanes." in text
    assert "Invalid __global__ read" in (out / "sanitizer-memcheck.log").read_text()

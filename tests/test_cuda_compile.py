"""Every generated CUDA kernel of the examples compiles for sm_80 and sm_90 with zero spills (no GPU needed)."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from profiles import examples, nightly_case
from strategies import (
    diagonal_linear_recurrences,
    many_sequences,
    param_in_setup,
    recurrences,
    state_axis_recurrences,
    summed_over_batch,
)

import ssmc
from ssmc.backends.cuda import nvrtc
from ssmc.backends.cuda.report import kernel_reports
from ssmc.runtime.random_inputs import axis_sizes

pytestmark = pytest.mark.skipif(not nvrtc.available(), reason=nvrtc.unavailable_reason())

RECURRENCES = ["hgrn", "mamba1", "mamba1_block", "mamba2", "mingru", "linear_attention", "retnet", "lstm", "gru",
               "layernorm_lstm", "mamba_conv", "lru"]


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


# CI builds sm_80 for the diagonal-linear examples (none of their kernels may spill); the others' (their
# forward must not spill; their adjoint cores compile) sm_80 builds run locally and nightly
STRICT = {"hgrn", "mamba1", "mamba1_block", "mingru", "lru"}


@pytest.mark.parametrize("name, arch", [
    (name, arch) if arch == "sm_90" or name in STRICT else nightly_case(
        name, arch, reason="sm_80 builds of a family outside the diagonal-linear one (sm_90's run)")
    for name in RECURRENCES for arch in ("sm_80", "sm_90")])
def test_example_kernels_compile_without_spills(name, arch, monkeypatch):
    # the kernels, also of the programs the chunked path and the step loop run as matrix products
    monkeypatch.setenv("SSMC_CUDA_CHUNKED", "0")
    monkeypatch.setenv("SSMC_CUDA_STEP_LOOP", "0")
    module = importlib.import_module(f"ssmc.examples.{name}")
    # CUDA part 1 covers the diagonal-linear family: none of its kernels may spill, forward or
    # backward. Other families' adjoint cores (one thread per head or per batch row, holding a whole
    # matrix state) must compile; they spill until their own lowerings (chunked matrix form, per-step
    # GEMMs) replace them.
    strict = module.FAMILY == "diagonal linear"
    assert strict == (name in STRICT)
    reports = list(kernels(module.SPEC.program, arch))
    assert {"forward", "recompute", "adjoint"} <= {r.program for r in reports}
    for r in reports:
        assert r.resources is not None, r.error
        if strict or r.program == "forward":
            assert not r.resources.spills, r.resources.summary()


def test_inspect_says_which_kernel_asks_more_local_memory_than_cuda_allows(monkeypatch):
    """The LSTM's adjoint with its products in the kernels (`SSMC_CUDA_HOIST=0`) at hidden 256: its
    epilogue holds grad_W [i g k] in one thread (4 MB); the report says it will not run. Hoisted (the
    default), every kernel stays under the limit."""
    from ssmc.backends.cuda.report import format_reports
    from ssmc.backends.cuda.runner import MAX_LOCAL_BYTES

    program = importlib.import_module("ssmc.examples.lstm").SPEC.program
    sizes = {"b": 2, "i": 256, "k": 256, "j": 256, "g": 4}
    monkeypatch.setenv("SSMC_CUDA_STEP_LOOP", "0")  # the kernels, not the loop of matrix products
    monkeypatch.setenv("SSMC_CUDA_HOIST", "0")
    text = format_reports(kernel_reports(program, sizes, 7))
    assert "lstm_backward_epilogue_grad_W needs" in text and "will not run on the GPU" in text
    monkeypatch.delenv("SSMC_CUDA_HOIST")
    reports = kernel_reports(program, sizes, 7)
    assert all(r.resources.stack_frame_bytes <= MAX_LOCAL_BYTES for r in reports)
    assert "will not run" not in format_reports(reports)


PROJECTED_GATE = """
import ssmc

@ssmc.recurrence
def projected_gate(h: ssmc.State["b d"], x: ssmc.Seq["b d"], a: ssmc.Seq["b d"], Wx: ssmc.Param["e d"]):
    f = ssmc.sigmoid(a)
    h = f * h + (1 - f) * ssmc.silu(ssmc.dot(x.rename(d="e"), Wx, over="e")) * x
    return h, ssmc.rmsnorm(h, over="d")
"""


def _projected_gate(tmp_path):
    path = tmp_path / "projected_gate.py"
    path.write_text(PROJECTED_GATE)
    namespace = {}
    exec(compile(PROJECTED_GATE, str(path), "exec"), namespace)
    return namespace["projected_gate"]


@pytest.mark.parametrize("case", ["mamba2 B4 L4096 H32 P64 N128 bf16", "mamba2 B2 L1024 H8 P64 N64",
                                  "projected gate b8 d1024 L2048"])
def test_backward_kernels_fit_cudas_local_memory_at_real_sizes(case, tmp_path, monkeypatch):
    """Kernels that asked more local memory a thread than CUDA allows, so the backward refused: the
    Mamba-2 adjoint fused with its parameter gradients (a thread per head walking b p n: 12.7 MB), now
    split into a core over every state axis and epilogues; a gate's input projection whose gradient
    reads x beside the projection (grad_Wx += sum_b g[b, d] x[b, d] x[b, e], a thread per (e, d) holding
    the rest: 12.6 MB), now a matrix product of the written g x with x."""
    from ssmc.backends.cuda.report import format_reports
    from ssmc.backends.cuda.runner import MAX_LOCAL_BYTES

    if case.startswith("mamba2"):
        monkeypatch.setenv("SSMC_CUDA_CHUNKED", "0")  # the element-wise scans' kernels (the fallback)
        program = importlib.import_module("ssmc.examples.mamba2").SPEC.program
        big = "B4" in case
        sizes = {"b": 4, "g": 1, "r": 32, "p": 64, "n": 128} if big else {"b": 2, "g": 1, "r": 8, "p": 64, "n": 64}
        length, dtype = (4096, "bfloat16") if big else (1024, "float32")
    else:
        program = _projected_gate(tmp_path).program
        sizes, length, dtype = {"b": 8, "d": 1024, "e": 1024}, 2048, "float32"
    reports = kernel_reports(program, sizes, length, dtype)
    assert all(r.resources is not None for r in reports), [r.error for r in reports if r.error]
    assert all(r.resources.stack_frame_bytes <= MAX_LOCAL_BYTES for r in reports), format_reports(reports)
    if case.startswith("mamba2"):
        assert {r.strategy for r in reports if r.program == "adjoint"} == {"split"}
    else:
        assert any("grad_Wx after" in r.strategy for r in reports if r.program == "adjoint")


def test_map_kernels_along_time_compile():
    """At the benchmark size with time contiguous (layout "b d t"): every kernel of the Mamba-1 block
    compiles (the fusion stage's sequences `row<k>` next to the template's own names), and the norm's
    row kernel runs consecutive threads along time."""
    program = importlib.import_module("ssmc.examples.mamba1_block").SPEC.program
    sizes = {"b": 8, "d": 1536, "n": 16}
    reports = kernel_reports(program, sizes, 2048, time_contiguous=True)
    assert all(r.resources is not None for r in reports), [r.error for r in reports if r.error]
    rows = [r for r in reports if ": map" in r.strategy]
    assert rows and all(r.resources is not None and not r.resources.spills for r in rows)
    assert all("consecutive threads along time" in r.source for r in rows if r.launch.nblk == 2048)


def test_the_block_norm_is_a_row_kernel_at_benchmark_size(monkeypatch):
    """B8 D1536 L2048, layout "b d t": the norm's kernel shares each (b, t) row among 16 threads of
    a block (32 rows of 16 threads, consecutive threads along time), each summing every 16th channel,
    the partials combined in shared memory; no buffer as long as the row; `ssmc inspect` says so.
    The gradient goes stage by stage: the scan stage's lanes backward, then the norm's adjoint, whose
    row statistics over d (its pre stage) are row kernels too and whose sum over time and b
    (grad_norm_weight) is split into blocks of time."""
    from ssmc.backends.cuda.printer import Threads

    program = importlib.import_module("ssmc.examples.mamba1_block").SPEC.program
    sizes = {"b": 8, "d": 1536, "n": 16}
    reports = {r.name: r for r in kernel_reports(program, sizes, 2048, time_contiguous=True)}
    post = reports["mamba1_block_post_y"]
    assert post.launch.mapping == Threads(time_fastest=True, groups=16, split="d", row=True)
    assert post.launch.grid == (8 * 2048 // 32, 512)
    assert post.strategy == "post: map, rows d/16"
    assert "row_sum<16>(acc_" in post.source and "[n_d]" not in post.source
    assert post.resources.shared_bytes >= 512 * 4 and not post.resources.spills
    assert reports["mamba1_block_fused_backward"].strategy == "core: lanes backward, 4 lanes a row, chunks of 16 steps"
    for name in ("mamba1_block_post_backward_pre_row0", "mamba1_block_post_backward_pre_row1"):
        assert reports[name].launch.mapping.row and reports[name].strategy.startswith("post: pre: map, rows d/")
    weight = reports["mamba1_block_post_backward_epilogue_grad_norm_weight"]
    assert weight.strategy == "post: core: split" and weight.launch.nblk > 1
    # without the fused backward, the scan's epilogue sum over d that split-K takes stays split-K
    monkeypatch.setenv("SSMC_CUDA_FUSED_BACKWARD", "0")
    reports = {r.name: r for r in kernel_reports(program, sizes, 2048, time_contiguous=True, compile_kernels=False)}
    assert reports["mamba1_block_backward_epilogue_grad_B"].strategy.endswith("split-K d/16")


def test_mamba1_warp_kernels_are_state_major_and_keep_four_blocks_per_sm(monkeypatch):
    """B8 D1536 L2048 N16, layout "b d t" (the benchmark's), the warp kernel forced (the plain forward
    runs as the lanes kernel there; the training forward is the warp kernel anyway): it is state-major
    (kernels/warp/analysis.py): a lane takes 4 consecutive steps, loads its 4 steps of B[:, n] and
    C[:, n] as one float4 each in full rounds, computes exp(dt A[n]) once for the summary and the
    step (sh0), and fits 128 registers without spills (4 blocks of 4 warps per SM) with its params
    in memory. The training forward keeps them in registers (rp_A); the fused backward does not:
    its registers held for the whole kernel cost a block per SM there."""
    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "warp")
    reports = {r.name: r for r in kernel_reports(program, {"b": 8, "d": 1536, "n": 16}, 2048, time_contiguous=True)}
    forward, rounds = reports["mamba1_warp"], reports["mamba1_warp_rounds"]
    backward = reports["mamba1_fused_backward"]
    for r in (forward, rounds):
        assert "one state value at a time" in r.source and "load_steps<4>(ld0, B + " in r.source
        assert "sh0[tt] = exp_(" in r.source and r.source.count("exp_(") == 2  # full and partial rounds
        assert all(f"pf_{name}[4]" in r.source for name in ("delta", "u", "z"))
        assert not r.resources.spills
    assert "rp_" not in forward.source and forward.resources.registers <= 128
    assert "rp_A" in rounds.source and "sv_h[i_n] = v_st_h;" in rounds.source
    # the fused backward state-major too, 4 steps per lane, the block's terms of grad_B / grad_C added
    # up in shared memory and then as one vector each; the loop over n rolled, the next n's loads made
    # while one computes
    assert "rp_A" not in backward.source and "pf_grad_y[4]" in backward.source
    assert "sm_sums[sums_at][1][w][lane * 4 + tt] = at1[tt];" in backward.source
    assert "add_steps<4>(to, v);" in backward.source and "load_steps<4>(next_ld0, B + " in backward.source
    assert backward.resources.registers <= 168 and not backward.resources.spills  # 3 blocks per SM


def test_state_major_vector_loads_into_a_float64_compute_type():
    """B and C in float32 with the other inputs float64: the compute type is double and the float4
    loads of B[:, n] / C[:, n] convert into it (`load_steps` was float-only)."""
    from ssmc.backends.cuda.printer import ArraySpec, contiguous_strides
    from ssmc.backends.cuda.runner import runner_for

    runner = runner_for(importlib.import_module("ssmc.examples.mamba1").SPEC.program, "float64")
    k = runner.time_blocks.lane_rescan
    sizes, length = {"b": 2, "d": 8, "n": 16}, 256
    specs = {}
    for a in k.arrays:
        shape = [length if ax == "t" else sizes[ax] for ax in a.axes]
        if a.axes[:1] == ("t",):  # time contiguous, as the runner allocates and "b d t" gives
            inner = contiguous_strides([*shape[1:], shape[0]])
            strides = (inner[-1], *inner[:-1])
        else:
            strides = contiguous_strides(shape)
        specs[a.name] = ArraySpec("float32" if a.name in ("B", "C") else "float64", strides)
    source = runner.source_for(k, specs, sizes, length=length, strategy="warp")
    assert "typedef double F" in source and "load_steps<4>(ld0, B + " in source
    resources = nvrtc.compile_source(source, options=("--std=c++17",)).resources["mamba1_warp"]
    assert not resources.spills


@pytest.mark.parametrize("state", [64, 256])
def test_mamba1_warp_kernels_with_large_states_do_not_spill(state):
    """Mamba state up to 256: the state-major loop over n stays a loop past 128 values a round
    (arrays in local memory), and the copies of the carries are not unrolled (unrolled, ptxas kept
    256 carries in registers and spilled)."""
    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    reports = {r.name: r for r in kernel_reports(program, {"b": 2, "d": 64, "n": state}, 300, time_contiguous=True)}
    for name in ("mamba1_warp", "mamba1_warp_rounds"):
        assert reports[name].resources is not None and not reports[name].resources.spills, reports[name].error
    assert "#pragma unroll 1\n            for (int i_n" in reports["mamba1_warp"].source


@pytest.mark.parametrize("groups", ["", "512"])
@pytest.mark.parametrize("contiguous", [False, True])
@pytest.mark.parametrize("name", ["softmax_layer", "layernorm_layer"])
def test_row_kernels_of_a_softmax_and_a_layernorm_compile(name, contiguous, groups, monkeypatch):
    """A max and a sum (softmax), two sums in turn (LayerNorm) over d = 300: every row kernel of the
    forward and the adjoint compiles without spills, each statistic combined across the groups; in
    float64 with 512 threads per row (forced) too, within its launch bounds (seen on an H200: the
    adjoint's softmax row kernel asked for 255 registers x 512 threads and could not launch)."""
    from row_layers import LAYERS

    monkeypatch.setenv("SSMC_CUDA_ROW_RECURRENCE", "0")  # the stages (at L 37 the layer could be one kernel)
    if groups:
        monkeypatch.setenv("SSMC_CUDA_ROW_GROUPS", groups)
    g = int(groups or 8)
    reports = kernel_reports(LAYERS[name].program, {"b": 2, "d": 300}, 37, dtype="float64" if groups else "float32",
                             time_contiguous=contiguous)
    rows = [r for r in reports if r.launch.mapping.row]
    assert {r.program for r in rows} == {"forward", "adjoint"}
    for r in rows:
        assert r.resources is not None and not r.resources.spills, r.error
        assert r.resources.registers * 512 <= 65536 and "__launch_bounds__(512, 1)" in r.source
    post = next(r for r in rows if r.program == "forward")
    assert post.source.count(f"row_sum<{g}>(") + post.source.count(f"row_max<{g}>(") == 2


SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large]}


# NVRTC takes about 40 s a random spec's kernels on CI's 2 cores: 3 in CI (tests/profiles.py), 10 locally
@settings(max_examples=examples(10, ci=3), **SETTINGS)
@given(spec=recurrences())
def test_random_recurrence_kernels_compile(spec):
    """Every random spec's kernels compile (spills are a speed matter here; examples must not spill)."""
    for r in kernels(spec.program, lengths=(4096,)):
        assert r.resources is not None, r.error


@settings(max_examples=examples(8, ci=2), **SETTINGS)  # about 60 s a spec on CI's 2 cores
@given(spec=diagonal_linear_recurrences(), dtype=st.sampled_from(["float32", "float64"]),
       warps=st.sampled_from(["", "8"]))
def test_random_time_contiguous_warp_kernels_compile(spec, dtype, warps):
    """Time contiguous at L4096 (the warp kernels, their warps sharing a recurrence as many as fit
    the static shared memory, even where forced to 8): every kernel compiles, forward and gradient."""
    import os

    sizes = axis_sizes(spec.program, np.random.default_rng(0), low=8, high=8)
    os.environ["SSMC_CUDA_RECURRENCE_WARPS"] = warps
    try:
        reports = kernel_reports(spec.program, sizes, 4096, dtype, time_contiguous=True)
    finally:
        del os.environ["SSMC_CUDA_RECURRENCE_WARPS"]
    for r in reports:
        assert r.resources is not None, r.error


@pytest.mark.parametrize("length", [180, 1000, 4096])
@pytest.mark.parametrize("name", ["hgrn", "mingru"])
def test_warps_sharing_a_recurrence_compile_without_spills(name, length):
    """Time contiguous (the warp kernel): a scalar state per recurrence is shared by a block of up to
    8 warps (a power of two, at most the sequence's rounds of one warp: 180 steps are 2 rounds of
    128), forward and gradient; their totals combined through shared memory behind one barrier a
    round."""
    program = importlib.import_module(f"ssmc.examples.{name}").SPEC.program
    reports = [r for r in kernel_reports(program, {"b": 4, "d": 96, "i": 16}, length, time_contiguous=True)
               if r.launch.kernel.name.endswith("_warp")]
    forward, = (r for r in reports if r.program == "forward")
    assert forward.launch.mapping.warps == {180: 2, 1000: 8, 4096: 8}[length]
    assert len(reports) >= 2  # the recompute's too (hgrn's adjoint as well)
    for r in reports:
        warps = r.launch.mapping.warps
        assert r.launch.grid == (4 * 96, 32 * warps) if warps > 1 else r.launch.grid[1] == 128
        assert ("__syncthreads();" in r.source) == (warps > 1)
        assert r.resources is not None and not r.resources.spills, r.name


def test_state_major_warp_kernels_keep_one_warp_a_recurrence(monkeypatch):
    """Mamba-1's states have their own axis n: its warp kernels stay one warp per (b, d), even forced."""
    from ssmc.backends.cuda.kernels.warp import recurrence_warps
    from ssmc.backends.cuda.runner import CudaRunner

    runner = CudaRunner(importlib.import_module("ssmc.examples.mamba1").SPEC.program)
    monkeypatch.setenv("SSMC_CUDA_RECURRENCE_WARPS", "4")
    assert recurrence_warps(runner, 4096) == 1


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("layout", [False, True])
@pytest.mark.parametrize("sizes,length", [({"b": 8, "d": 1536, "n": 16}, 2048), ({"b": 32, "d": 512, "n": 16}, 180),
                                          ({"b": 2, "d": 5, "n": 33}, 7)])
def test_mamba1_forward_runs_as_lanes_along_n_without_spills(sizes, length, layout, arch, monkeypatch):
    """At the benchmark shapes Mamba-1's forward is the lanes kernel (4 lanes a row of [b d], 4 values
    of n each; chunks of steps staged through shared memory): it compiles without spills, in either
    layout; forced, also where n is no multiple of the lanes (33: 8 lanes, 5 values, a guard)."""
    if length == 7:
        monkeypatch.setenv("SSMC_CUDA_STRATEGY", "lanes")
    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    forward, = kernel_reports(program, sizes, length, arch=arch, backward=False, time_contiguous=layout)
    assert forward.strategy.startswith("lanes"), forward.strategy
    assert forward.launch.mapping.lanes == (4 if sizes["n"] == 16 else 8)
    assert "copy_async" in forward.source and "reduce_scatter" in forward.source
    assert forward.resources is not None and not forward.resources.spills, forward.error


@pytest.mark.parametrize("layout", [False, True])
def test_lanes_params_scaled_by_log2e_only_where_the_body_alone_reads_them(layout):
    """Mamba-1's A, read only as exp(dt A), is loaded times log2 e for the body's exp2; a spec whose
    setup also reads A (tanh(A), hoisted) loads it as it is and keeps exp (the setup read the
    scaled value before: a silently wrong tanh)."""
    mamba1 = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    sizes = {"b": 8, "d": 1536, "n": 16}
    for program, scaled in ((mamba1, True), (param_in_setup.program, False)):
        forward, = kernel_reports(program, sizes, 2048, backward=False, time_contiguous=layout, compile_kernels=False)
        assert forward.strategy.startswith("lanes"), forward.strategy
        src = forward.source
        assert ("rp_A[j] = i_n < n_n ? F(to_f(A[(p_d) * 16LL + (i_n)])) * F(1.4426950408889634)" in src) == scaled
        assert ("exp2_(" in src) == scaled
    assert "tanh_(rp_A[j])" in src


def _blocks_per_sm(registers: int, shared: int, threads: int) -> int:
    """Blocks of a kernel resident at once on one SM of an H100 / H200 (sm_90): 64 K registers
    (allocated 8 a thread, 256 a warp), 228 KiB of shared memory with 1 KiB reserved a block,
    2048 threads, 32 blocks."""
    warps = -(-threads // 32)
    per_warp = -(-(-(-registers // 8) * 8 * 32) // 256) * 256
    return min(65536 // (per_warp * warps), 233472 // (shared + 1024), 2048 // threads, 32)


@pytest.mark.parametrize("layout", [False, True])
def test_mamba1_small_forward_runs_in_one_wave(layout):
    """Mamba-1 at B32 D512 L180: the body's sum over n lives in delta's chunk buffer (which only the
    pre phase reads, lanes.hosted_sums), so the lanes kernel takes blocks of 128 threads and its
    grid is resident on an H100's 132 SMs at once (as the training forward's is, time contiguous).
    Before, 7 blocks of 64 threads fit an SM and the 1024 blocks ran in two waves: 0.060 ms against
    0.041 at B28 (896 blocks), H100. Time last ("b t d") it took 160 registers, 3 blocks an SM, until
    its row params were staged once per block (`lanes.row_params`): 126. The forward of a step that
    wants only the gradients runs in one wave too. Each asks ptxas for 4 blocks an SM
    (`lanes.lanes_min_blocks`): the device's NVRTC, unbounded, gave the training forward 148
    registers (H100, 2026-11-27), where this machine's gives 128 or fewer."""
    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    reports = kernel_reports(program, {"b": 32, "d": 512, "n": 16}, 180, time_contiguous=layout,
                             backward=layout)
    lanes = [r for r in reports if r.strategy.startswith("lanes,")]  # the forwards (the backward: test_lanes_backward)
    assert [r.program for r in lanes] == (["forward", "forward (training)", "forward (gradients only)"] if layout
                                          else ["forward"])
    for r in lanes:
        if r.program != "forward (gradients only)":  # (which has no sums over n)
            assert "= sr_delta[buf];" in r.source and "pv_acc_" not in r.source.split("for (int t0 = 0")[0]
        assert f"__launch_bounds__(128, 4) {r.name}(" in r.source
        blocks, threads = r.launch.grid
        res = r.resources
        assert res is not None and not res.spills, r.error
        assert _blocks_per_sm(res.registers, res.shared_bytes, threads) * 132 >= blocks, (r.name, res)


@pytest.mark.skipif(not nvrtc.available(), reason=nvrtc.unavailable_reason())
def test_reports_build_with_the_options_cupy_builds_with(monkeypatch):
    """`ssmc inspect` and these tests compile with the options the GPU's build gets: CuPy's
    `RawModule` appends ``-ftz=true`` to every build, so a report without it read other registers and
    spills than the GPU ran (the bounded lanes backward's, 2026-11-27). The options NVRTC is given
    here are recorded and must hold it, as `compile_options` gives the runner."""
    from ssmc.backends.cuda import nvrtc as nv
    from ssmc.backends.cuda.source import compile_options

    given = []
    compile_source = nv.compile_source
    monkeypatch.setattr(nv, "compile_source", lambda *a, **kw: given.append(kw.get("options", ())) or
                        compile_source(*a, **kw))
    kernel_reports(importlib.import_module("ssmc.examples.mamba1").SPEC.program, {"b": 2, "d": 72, "n": 16}, 61)
    assert given and all("-ftz=true" in options and "--std=c++17" in options for options in given), given
    assert "-ftz=true" in compile_options("") and "--fmad=false" in compile_options("#define SSMC_NO_CONTRACTION\n")


def test_programs_comparing_recomputed_values_build_without_contraction():
    """A program with a max over an axis, whose gradient compares each value with the max
    (`source.exact_products`), is built with --fmad=false: every kernel of its forward's and its
    gradient's programs, so every kernel that holds the max or the comparison (the states' recompute,
    a program without either, is not: the others read the states it stores); the examples' kernels
    are built with contraction."""
    from test_cuda import max_over_batch

    from ssmc.backends.cuda.source import compile_options

    reports = kernel_reports(max_over_batch.program, {"b": 2, "n": 5}, 9, dtype="float64")
    exact = {r.name for r in reports if "--fmad=false" in compile_options(r.source)}
    bodies = {r.name: r.source.split('extern "C"', 1)[1] for r in reports}
    comparing = {n for n, body in bodies.items() if "max_(" in body or " == " in body}
    assert len(comparing) >= 4 and comparing <= exact, (comparing, exact)
    assert all(r.resources is not None and not r.resources.spills for r in reports), [r.error for r in reports]
    for name, sizes in [("mamba1", {"b": 2, "d": 64, "n": 16}), ("hgrn", {"b": 2, "d": 64}),
                        ("retnet", {"b": 2, "h": 2, "k": 16, "v": 16})]:
        program = importlib.import_module(f"ssmc.examples.{name}").SPEC.program
        sources = [r.source for r in kernel_reports(program, sizes, 64, compile_kernels=False)]
        assert not any("--fmad=false" in compile_options(s) for s in sources), name


@pytest.mark.parametrize("sizes, dtype", [({"b": 8, "d": 1536, "n": 32}, "float32"),
                                          ({"b": 32, "d": 512, "n": 16}, "float64"),
                                          ({"b": 8, "d": 1536, "n": 16}, "float32")])
def test_lanes_forwards_stay_unbounded_where_128_registers_would_spill(sizes, dtype):
    """A lane holding more than 16 state values x steps (n = 32: 8 lanes of 4 values, each over 8
    steps), or float64 values, leaves ptxas its registers (`__launch_bounds__(threads, 1)`): bounded to
    128, Mamba-1's n = 32 forward spilled 48 bytes (NVRTC 13.5, sm_90). So does a grid that fits one
    wave at 3 blocks an SM (B8 D1536: 384 blocks; bounded, a random spec's kernel at b = 3, d = 37 had
    failed the spill test)."""
    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    reports = kernel_reports(program, sizes, 2048, dtype=dtype, backward=False, compile_kernels=False)
    (forward,) = [r for r in reports if r.strategy.startswith("lanes,")]
    assert f"__launch_bounds__({forward.launch.grid[1]}, 1) {forward.name}(" in forward.source


@pytest.mark.skipif(not nvrtc.available(), reason=nvrtc.unavailable_reason())
@pytest.mark.parametrize("batch", [16, 64])
def test_decode_step_at_a_long_state_axis_asks_for_three_blocks_an_sm_without_spills(batch, monkeypatch):
    """Mamba-1's decode step at N = 128 on the chunked lanes kernel (``SSMC_CUDA_LANES_STEP=0``; short chunks,
    16 state values a lane) streams its states once: unbounded it took 243 registers, 2 blocks of 4 warps an SM
    (`lanes.SHORT_CHUNK_BLOCKS`); bounded to 3 an SM it compiles unspilled for sm_80 and sm_90."""
    monkeypatch.setenv("SSMC_CUDA_LANES_STEP", "0")
    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    for arch in ("sm_80", "sm_90"):
        reports = kernel_reports(program, {"b": batch, "d": 2048, "n": 128}, 1, backward=False, arch=arch)
        (forward,) = [r for r in reports if r.strategy.startswith("lanes,")]
        assert f"__launch_bounds__({forward.launch.grid[1]}, 3) {forward.name}(" in forward.source
        res = forward.resources
        assert res is not None and not res.spills and res.registers <= 65536 // (3 * forward.launch.grid[1]), res


@pytest.mark.skipif(not nvrtc.available(), reason=nvrtc.unavailable_reason())
@pytest.mark.parametrize("batch", [1, 64])
def test_decode_step_form_at_a_long_state_axis_asks_for_eight_blocks_an_sm_without_spills(batch):
    """Mamba-1's decode step at N = 128 as the lanes kernel's step form (kernels/lanes/step.py; B1 too, under
    the lanes fill threshold): nothing in shared memory, bounded to 8 blocks of 128 threads an SM
    (`step.STEP_REGISTERS`), unspilled for sm_80 and sm_90."""
    from ssmc.backends.cuda.kernels.lanes import step

    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    blocks = step.REGISTER_FILE // (128 * step.STEP_REGISTERS)
    for arch in ("sm_80", "sm_90"):
        reports = kernel_reports(program, {"b": batch, "d": 2048, "n": 128}, 1, backward=False, arch=arch)
        (forward,) = [r for r in reports if r.strategy.startswith("lanes,")]
        assert forward.launch.grid[1] == 128 and "nothing staged" in forward.source
        assert f"__launch_bounds__(128, {blocks}) {forward.name}(" in forward.source
        res = forward.resources
        assert res is not None and not res.spills and res.shared_bytes == 0, res
        assert res.registers <= step.STEP_REGISTERS, res


@pytest.mark.parametrize("layout", [False, True])
def test_lanes_row_params_are_staged_once_per_block(layout):
    """Mamba-1's delta_bias[d] and D[d], which the pre and post phases read at each row's own index,
    are loaded once per block into shared memory (`lanes.row_params`), not from global memory per
    row and step inside the time loop."""
    from ssmc.backends.cuda.kernels.lanes.forward import row_params
    from ssmc.backends.cuda.runner import CudaRunner

    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    assert row_params(CudaRunner(program).state_lanes) == ["D", "delta_bias"]
    forward, = kernel_reports(program, {"b": 8, "d": 1536, "n": 16}, 2048, backward=False, time_contiguous=layout,
                              compile_kernels=False)
    before, loop = forward.source.split("for (int t0 = 0", 1)
    assert "sq_delta_bias[i] = F(to_f(delta_bias[(min(r0 + i, n_d - 1))]))" in before
    assert "sq_delta_bias[r]" in loop and "sq_D[r]" in loop
    assert "delta_bias[(" not in loop and " D[(" not in loop and "(D[(" not in loop


@ssmc.recurrence
def _gated_toward_a_constant(h: ssmc.State["b d n"], x: ssmc.Seq["b d"], s: ssmc.Seq["b n"], p: ssmc.Param["d n"]):
    a = ssmc.sigmoid(x + p)
    h = a * h + (1 - a) * ssmc.where(x > 0.5, s, ssmc.tanh(0.5))  # tanh(0.5): the same every step
    return h, (h * 0.5).sum("n")


def test_the_lanes_backward_assigns_the_forwards_hoisted_values(monkeypatch, fresh_runners):
    """A value the same every step (here tanh(0.5)) is hoisted into the forward's setup, where the lanes
    backward's pre phase and carries read it: that kernel declared it but never assigned it, and did
    not compile (a random Mamba-shaped spec's emulated step found it, 2026-11-27). Every kernel of the
    training step, the lanes backward forced, compiles."""
    from ssmc.backends.cuda.kernels import lanes

    monkeypatch.setattr(lanes, "LANES_FILL", 1)
    monkeypatch.setenv("SSMC_CUDA_LANES_BACKWARD", "1")
    reports = kernel_reports(_gated_toward_a_constant.program, {"b": 2, "d": 8, "n": 3}, 7, time_contiguous=True)
    backward = next(r for r in reports if r.program == "backward")
    assert backward.strategy.startswith("lanes backward")
    assert "= tanh_(F(0.5));" in backward.source.split("for (int c = ")[0]
    for r in reports:
        assert r.resources is not None, (r.program, r.error)


@pytest.mark.parametrize("sizes,length,chunk", [({"b": 8, "d": 1536, "n": 16}, 2048, 16),
                                               ({"b": 32, "d": 512, "n": 16}, 180, 16),
                                               ({"b": 4, "d": 2048, "n": 16}, 512, 32)])
def test_mamba1_training_forward_runs_as_lanes_saving_round_carries(sizes, length, chunk):
    """A training step at the benchmark shapes (and one of 8192 rows): its forward is the lanes kernel
    too, which writes the carry into each chunk of the lanes backward, and neither spills. With more
    rows than one wave of the backward's unbounded kernel takes, that is the bounded kernel (16-step
    chunks, 8 blocks of 64 threads an SM): the forward's chunks of 32 steps save two carries each, at
    their start and after their groups reaching step 16. A step that wants only the gradients runs that
    forward without its outputs."""
    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    reports = kernel_reports(program, sizes, length, time_contiguous=True)
    assert [(r.program, r.name) for r in reports] == [
        ("forward", "mamba1_fused"), ("forward (training)", "mamba1_lanes_rounds"),
        ("backward", "mamba1_fused_backward"), ("forward (gradients only)", "mamba1_lanes_summary_rounds")]
    training, backward, summary = reports[1], reports[2], reports[3]
    assert training.strategy == "lanes, 4 lanes a row" and training.launch.mapping.lanes == 4
    assert backward.strategy == f"lanes backward, 4 lanes a row, chunks of {chunk} steps"
    assert f"if (valid && (t0) % {chunk} == 0) {{" in training.source
    assert f"rounds_h[((t0) / {chunk}) * " in training.source
    inside = f"if (valid && (t0 + tb + G) % {chunk} == 0 && tb + G < 32 && t0 + tb + G < L) {{"
    assert (inside in training.source) == (chunk < 32)
    assert f"T = {chunk}, P = {chunk + 4}, BLOCK = 64;" in backward.source
    assert f"__launch_bounds__(64, {8 if chunk == 16 else 1})" in backward.source
    # the forward of a step that wants only the gradients: the same carries, no outputs, and nothing that
    # only they read (the sum over n of h C, the post phase: C and z not staged)
    kernel = summary.source.split("__global__")[-1]
    assert summary.strategy == training.strategy and summary.launch.mapping == training.launch.mapping
    assert f"rounds_h[((t0) / {chunk}) * " in kernel and (inside in kernel) == (chunk < 32)
    for gone in ("out_y", "reduce_scatter", "sl_C", "sr_z", "the outputs, along"):
        assert gone in training.source.split("__global__")[-1] and gone not in kernel, gone
    assert kernel.count("__syncthreads()") == 2  # the chunk's start, after the pre phase: no post phase
    for r in (training, backward, summary):
        assert r.resources is not None and not r.resources.spills, r.error


@pytest.mark.skipif(not nvrtc.available() or nvrtc.toolkit_include() is None,
                    reason="NVRTC and a CUDA toolkit's half-type headers are needed")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("length", [180, 4097])
def test_half_type_lanes_forwards_compile_without_spills(length, dtype):
    """Mamba-1 "b d t" on bf16 / fp16 inputs, whose staging converts each value as it copies (no
    `cp.async`), 4 values an index: the lanes forwards compile (a grouped copy's store once read
    `*&buffer[...] + q = ...`, which NVRTC rejects: the GPU suite's bf16 test failed, 2026-11-27)
    and do not spill."""
    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    reports = [r for r in kernel_reports(program, {"b": 8, "d": 1024, "n": 16}, length, dtype=dtype,
                                         time_contiguous=True) if r.strategy.startswith("lanes,")]
    assert reports
    for r in reports:
        assert r.resources is not None and not r.resources.spills, (r.name, r.error)


@pytest.mark.skipif(not nvrtc.available(), reason=nvrtc.unavailable_reason())
@pytest.mark.parametrize("length", [4097, 181])
def test_lanes_forwards_copy_rows_off_16_bytes_four_values_an_index(length):
    """Mamba-1 "b d t" at an L that is not a multiple of 4: no row starts on 16 bytes, so no 16-byte
    copies; each thread copies 4 neighbouring values from one index computation (not one a value:
    B8 D1536 L4097 on an H200, forward 0.658 -> 0.568 ms), and the kernels compile without spills."""
    program = importlib.import_module("ssmc.examples.mamba1").SPEC.program
    reports = [r for r in kernel_reports(program, {"b": 8, "d": 1536, "n": 16}, length, time_contiguous=True)
               if r.strategy.startswith("lanes,")]
    assert len(reports) == 3, [r.strategy for r in reports]  # forward, training forward, gradients-only
    for r in reports:
        assert "copy_async<16>" not in r.source and "const int r = i / T, tt = i % T;" not in r.source, r.name
        assert "for (int q = 0; q < (16 / sizeof(F)); ++q) copy_async<sizeof(F)>(" in r.source, r.name
        assert r.resources is not None and not r.resources.spills, (r.name, r.error)


def test_lanes_kernel_with_one_lane_a_row_does_not_spill(monkeypatch):
    """n = 3: one lane a row (G = 1), so the block's loops over rows x steps have 32 iterations a
    thread; fully unrolled, this spec's tanh / sigmoid took 255 registers and spilled (found by
    test_random_lanes_kernels_compile_without_spills, 2026-11-25): they unroll 8 at most."""

    @ssmc.recurrence
    def step(h0: ssmc.State["b d n"], x0: ssmc.Seq["b d"], s0: ssmc.Seq["b n"], x1: ssmc.Seq["b d"],
             p0: ssmc.Param["d n"]):
        v2 = ssmc.sigmoid(ssmc.tanh(p0 + 0.5))
        v6 = ssmc.tanh(0.45 * (ssmc.sigmoid(0.5) * h0 + ssmc.tanh(0.5 + x0)))
        v7 = v2 * h0 + (1 - v2) * v6
        return v7, (v7 * (x0 + s0)).sum("n")

    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "lanes")
    for contiguous in (False, True):
        forward, = kernel_reports(step.program, {"b": 3, "d": 37, "n": 3}, 100, backward=False,
                                  time_contiguous=contiguous)
        assert forward.launch.mapping.lanes == 1 and "#pragma unroll 8" in forward.source
        assert forward.resources is not None and not forward.resources.spills, forward.resources.summary()


# most random specs do not split along n (kernels/warp/analysis.py's conditions): filtered out, so more are drawn
LANES_SETTINGS = {**SETTINGS,
                  "suppress_health_check": [*SETTINGS["suppress_health_check"], HealthCheck.filter_too_much]}


@settings(max_examples=examples(10, ci=5), **LANES_SETTINGS)
@given(spec=state_axis_recurrences(), n=st.sampled_from([1, 3, 16, 33, 64]),
       dtype=st.sampled_from(["float32", "float64"]), time_contiguous=st.booleans())
def test_random_lanes_kernels_compile_without_spills(spec, n, dtype, time_contiguous):
    """Random specs shaped like Mamba-1 (states [b d n]) whose step splits along n (kernels/lanes/analysis.py):
    the lanes kernel, forced, compiles without spills in float32 and float64, either layout (bf16 needs
    the CUDA headers, which NVRTC alone does not have: the GPU tests build it)."""
    import os

    from ssmc.backends.cuda.runner import CudaRunner

    sizes = {"b": 3, "d": 37, "n": n}
    assume(CudaRunner(spec.program, "float64" if dtype == "float64" else "float32").lane_threads(sizes) is not None)
    os.environ.update(SSMC_CUDA_STRATEGY="lanes", SSMC_CUDA_STEP_LOOP="0", SSMC_CUDA_CHUNKED="0")
    try:
        forward, = kernel_reports(spec.program, sizes, 100, dtype, backward=False, time_contiguous=time_contiguous)
    finally:
        for name in ("SSMC_CUDA_STRATEGY", "SSMC_CUDA_STEP_LOOP", "SSMC_CUDA_CHUNKED"):
            del os.environ[name]
    assert forward.resources is not None and not forward.resources.spills, forward.error or forward.source


def _scan_with_an_argument(name: str):
    namespace: dict = {}
    exec(f"""
import ssmc

@ssmc.recurrence
def scan(h: ssmc.State["b d"], {name}: ssmc.Seq["b d"], x: ssmc.Seq["b d"], wp: ssmc.Param["d"]):
    h = ssmc.sigmoid({name}) * h + x * wp
    return h, h
""", namespace)
    return namespace["scan"].program


@pytest.mark.parametrize("name", ["w", "L", "F", "t", "nblk", "st_h", "valid", "buf"])
def test_an_argument_named_like_the_generated_code_s_own_variables_compiles_as_any_other(name):
    """Arrays named like the generated code's own variables (a warp's index `w`, the length `L`, the
    compute type `F`, the step `t`, the state's registers `st_h`) are printed by another name
    (`printer.with_free_array_names`): every kernel compiles to the same cubin as the spec whose
    argument is called so (`name_`, which sorts among the others as `name` does: the kernels take
    their arrays by position, and some loops go over them in sorted order)."""
    for length in (7, 1000):
        for contiguous in (False, True):
            reports = [kernel_reports(_scan_with_an_argument(n), {"b": 2, "d": 64}, length, compile_kernels=False,
                                      time_contiguous=contiguous) for n in (name, name + "_")]
            for clashing, plain in zip(*reports):
                # a kernel named after the argument (an epilogue's grad_<name>) is the one other difference
                sources = (clashing.source, plain.source.replace(plain.name, clashing.name))
                built = [nvrtc.compile_source(source, name=f"{clashing.name}.cu") for source in sources]
                assert built[0].cubin == built[1].cubin, (name, clashing.name)


def test_every_array_renamed_gives_the_same_kernels(monkeypatch):
    """Each print of an array's name goes through `printer.c_array`: with every array of the examples'
    kernels renamed, they compile to the same cubins (a print that missed the name would not
    compile, or would read another variable)."""
    from ssmc.backends.cuda import printer
    from ssmc.runtime.random_inputs import default_sizes

    renamed = lambda arrays, taken: {name: name + "_zz" for name in arrays}  # noqa: E731
    cases = [("mamba1", 1000, True, "float32"), ("mamba1", 180, True, "float64"), ("mamba1", 7, False, "float32"),
             ("linear_attention", 180, True, "float32"), ("lstm", 7, False, "float32")]
    for example, length, contiguous, dtype in cases:
        program = importlib.import_module(f"ssmc.examples.{example}").SPEC.program
        both = []
        for rename in (False, True):
            if rename:
                monkeypatch.setattr(printer, "free_names", renamed)
            both.append(kernel_reports(program, default_sizes(program), length, dtype=dtype, compile_kernels=False,
                                       time_contiguous=contiguous))
        monkeypatch.undo()
        for plain, other in zip(*both):
            assert "_zz" in other.source and plain.source != other.source
            cubins = [nvrtc.compile_source(r.source, name=f"{r.name}.cu").cubin for r in (plain, other)]
            assert cubins[0] == cubins[1], (example, plain.name)


def test_reverse_state_major_warp_kernel_takes_its_lanes_steps_backwards():
    """The adjoint of `strategies.summed_over_batch`'s staged core (reverse time, states with axes of
    their own) runs time last as the state-major warp kernel: each lane's step tt is at time
    L - 1 - (t0 + tt). It read L - 1 - t0 + tt (a missing pair of parentheses) until 2026-11-26."""
    from ssmc.backends.cuda.runner import CudaRunner
    from ssmc.lowering.stages import fuse
    from ssmc.passes.autodiff import derive_backward

    adjoint = derive_backward(fuse(summed_over_batch.program).stages[0].program).adjoint
    sizes = {"b": 2, "d": 4, "k": 2}
    runner = CudaRunner(adjoint, "float64")
    assert runner.strategy(sizes, 180, True) == "warp" and adjoint.reverse
    report, = kernel_reports(adjoint, sizes, 180, dtype="float64", backward=False, time_contiguous=True,
                             compile_kernels=False)
    assert "const int t = L - 1 - (t0 + tt);" in report.source
    assert "L - 1 - t0 + tt" not in report.source


@pytest.mark.parametrize("length", [192, 4096])
def test_kernels_of_many_sequences_fit_the_shared_memory(length):
    """`strategies.many_sequences` in float64, time contiguous: every kernel of its forward and gradient
    compiles (the adjoint's warp kernel stages what fits 48 KiB of shared memory and reads the rest in
    place), the adjoint with some of its per-step arrays staged."""
    reports = kernel_reports(many_sequences.program, {"b": 8, "d": 2048}, length, "float64", "sm_90",
                             time_contiguous=True)
    for r in reports:
        assert r.resources is not None, (r.name, r.error)
        assert r.resources.shared_bytes <= 48 * 1024, r.name
    adjoint, = [r for r in reports if r.program == "adjoint"]
    assert 0 < adjoint.source.count("__shared__ F sm_") < 26


@pytest.mark.skipif(nvrtc.toolkit_include() is None, reason="no CUDA toolkit headers (cuda_fp16.h) on this machine")
@pytest.mark.parametrize("name", ["hgrn", "mamba1"])
def test_half_type_kernels_compile_with_the_toolkit_headers(name):
    """bfloat16 inputs: the kernels include cuda_fp16.h / cuda_bf16.h, which NVRTC lacks; `ssmc inspect`
    passes a CUDA toolkit's include directory (`nvrtc.toolkit_include`), so they compile without a GPU."""
    program = importlib.import_module(f"ssmc.examples.{name}").SPEC.program
    reports = kernel_reports(program, {"b": 4, "d": 64, "n": 16}, 1024, "bfloat16", "sm_90", time_contiguous=True)
    assert any("#define SSMC_HALF" in r.source for r in reports)  # the forward's (the training kernels: fp32)
    for r in reports:
        assert r.resources is not None, (r.name, r.error)

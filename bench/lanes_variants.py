"""What bounds the lanes kernel of Mamba-1's forward (GPU): the generated kernel timed against variants
of its own source, edited as text before it compiles.

Each variant replaces a piece of the generated source (`VARIANTS`) and runs Mamba-1's forward through
`ssmc.compile` at B8 D1536 L2048 N16 (and, with --small, B32 D512 L180), fp32, layout "b d t". Some
variants keep the results (an unrolled loop, a state value fewer a lane); the others drop work the
kernel needs (marked "drops": their outputs are wrong and say how wrong) to measure what that work
costs. Every variant's output is compared with the unedited kernel's; times are do_bench medians and
the kernel's own time (torch.profiler).

    python3 bench/lanes_variants.py [--small] [--only NAME ...] [--lengths L ...]

Results and what they say: bench/results/2026-11-25-h100-devices-lanes-forward-bound.md.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from lanes_backward_probe import kernel_times  # bench/ is the script's folder, on sys.path
from source_edits import FTZ, both, editing, install

import ssmc
from ssmc.backends.cuda import fused_backward, runner
from ssmc.examples import mamba1

_BODY_LOOP = "#pragma unroll 1\n            for (int tb = 0; tb < 32; tb += G)"
# the last chunk's loop
_LAST_LOOP = "#pragma unroll 1\n            for (int tb = 0, tb_end = min(T, L - t0); tb < tb_end; tb += G)"
_LATE = "F late_m3[G] = {};  // the group before's sums, scattered while this one computes\n            "


def _replace(old: str, new: str, count: int = -1):
    def edit(source: str) -> str:
        return source.replace(old, new, count)
    return edit


_NO_SOFTPLUS = _replace("w_m0[q] = softplus(", "w_m0[q] = (")
_NO_SILU = _replace("silu(vp_z[q])", "(vp_z[q])")
_NO_EXP = _replace("exp2_((m0[tt] * rp_A[j]))", "(1.0f - (m0[tt] * rp_A[j]))")

# name -> (edit of the source or None, state values a lane, drops work the kernel needs)
VARIANTS = {
    "generated": (None, 4, False),
    "body's loop over groups of G steps unrolled 2": (_replace(_BODY_LOOP, _BODY_LOOP.replace("1\n", "2\n"), 1),
                                                      4, False),
    "body's loop unrolled 8 (all)": (_replace(_BODY_LOOP, _BODY_LOOP.replace("1\n", "8\n"), 1), 4, False),
    "2 state values a lane (8 lanes a row)": (None, 2, False),
    "valid known true (the blocks' rows tile d, as the lanes backward has it)": (_replace(
        "const bool valid = r0 + ch < n_d;", "constexpr bool valid = true;", 1), 4, False),
    "exp2 as ex2.approx.ftz (1 SASS instruction, not 4)": (both(
        _replace("__device__ __forceinline__ float exp2e(float x) { return exp2f(",
                 FTZ + "__device__ __forceinline__ float exp2e(float x) { return ex2_ftz("),
        _replace("SSMC_UNARY(exp2_, exp2f(x)", "SSMC_UNARY(exp2_, ex2_ftz(x)")), 4, False),
    "the reduce-scatter of each group after the next group's chains (software-pipelined)": (both(
        # the last chunk runs all its groups: its sums' last store is the last group's
        _replace(_BODY_LOOP, _LATE + _BODY_LOOP), _replace(_LAST_LOOP, _LATE + _BODY_LOOP),
        _replace("for (int tt = 0; tt < G; ++tt) acc_m3[tt] = F(0);\n",
                 "for (int tt = 0; tt < G; ++tt) acc_m3[tt] = F(0);\n"
                 "                pv_acc_m3[ch][((tb + 32 - G) & 31) + g] = reduce_scatter<G>(late_m3, g, SumOp());\n"),
        _replace("pv_acc_m3[ch][tb + g] = reduce_scatter<G>(acc_m3, g, SumOp());\n            }\n",
                 "#pragma unroll\n                for (int q = 0; q < G; ++q) late_m3[q] = acc_m3[q];\n            }\n"
                 "            pv_acc_m3[ch][32 - G + g] = reduce_scatter<G>(late_m3, g, SumOp());\n")), 4, False),
    "drops: B and C read from shared memory": (both(
        _replace("load_steps<G>(ld1, &sl_C[buf][i_n][tb]);", "for (int q = 0; q < G; ++q) ld1[q] = ld0[q] * 0.5f;"),
        _replace("load_steps<G>(ld0, &sl_B[buf][i_n][tb]);", "for (int q = 0; q < G; ++q) ld0[q] = m1[q] * rp_A[j];")),
        4, True),
    "drops: softplus (pre phase)": (_NO_SOFTPLUS, 4, True),
    "drops: silu (post phase)": (_NO_SILU, 4, True),
    "drops: exp of the body": (_NO_EXP, 4, True),
    "drops: softplus, silu and the body's exp": (both(_NO_SOFTPLUS, _NO_SILU, _NO_EXP), 4, True),
    "drops: the reduce-scatter of the sums over n": (_replace(
        "pv_acc_m3[ch][tb + g] = reduce_scatter<G>(acc_m3, g, SumOp());",
        "pv_acc_m3[ch][tb + g] = acc_m3[0] + acc_m3[1] + acc_m3[2] + acc_m3[3];"), 4, True),
    "drops: the barrier between pre phase and body": (_replace("        __syncthreads();\n        if (t0 + T <= L) {",
                                                               "        if (t0 + T <= L) {"), 4, True),
}

_lane_groups = runner.lane_groups


def run_variant(name: str, x: dict) -> tuple[torch.Tensor, float, float]:
    """(output, do_bench ms, kernel ms) of the forward with variant `name`'s source (fresh runners)."""
    import triton

    edit, per_lane, _ = VARIANTS[name]
    runner._RUNNERS.clear()
    fused_backward._RUNNERS.clear()
    runner.lane_groups = lambda n: _lane_groups(n, per_lane)
    try:
        with editing(edit):
            f = ssmc.compile(mamba1.SPEC, "cuda", layout=mamba1.LAYOUT)
            y = f(**x)
            ms = triton.testing.do_bench(lambda: f(**x), warmup=25, rep=200)
            kernels = kernel_times(lambda: f(**x), 20)
    finally:
        runner.lane_groups = _lane_groups
        runner._RUNNERS.clear()
    return y, ms, sum(kernels.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="also B32 D512 L180")
    ap.add_argument("--only", nargs="*", choices=list(VARIANTS), help="these variants (and the generated kernel)")
    ap.add_argument("--lengths", nargs="*", type=int, help="only the generated kernel at B32 D512 and these lengths")
    args = ap.parse_args(argv)
    install()
    if args.lengths:
        print(f"Mamba-1 forward, lanes kernel, {torch.cuda.get_device_name()}\n\n| shape | kernel ms |\n|---|---|")
        for length in args.lengths:
            values = mamba1.make_inputs(np.random.default_rng(0), length, batch=32, dim=512, state=16)
            x = {k: torch.tensor(v, device="cuda", dtype=torch.float32) for k, v in values.items()}
            print(f"| B32 D512 L{length} | {run_variant('generated', x)[2]:.4f} |", flush=True)
        return 0
    names = ["generated", *[n for n in (args.only or VARIANTS) if n != "generated"]]
    shapes = [(8, 1536, 2048)] + ([(32, 512, 180)] if args.small else [])
    print(f"Mamba-1 forward, lanes kernel, {torch.cuda.get_device_name()}\n")
    print("| shape | variant | kernel ms | do_bench ms | vs generated | output's rel. diff |")
    print("|---|---|---|---|---|---|")
    failed = False
    for batch, dim, length in shapes:
        values = mamba1.make_inputs(np.random.default_rng(0), length, batch=batch, dim=dim, state=16)
        x = {k: torch.tensor(v, device="cuda", dtype=torch.float32) for k, v in values.items()}
        want = base = None
        for name in names:
            y, ms, kernel = run_variant(name, x)
            want = y if want is None else want
            base = kernel if base is None else base
            diff = float((y - want).abs().max() / want.abs().max())
            if not VARIANTS[name][2] and not diff <= 1e-5:
                failed = True  # a variant that keeps the results did not
            print(f"| B{batch} D{dim} L{length} | {name} | {kernel:.4f} | {ms:.4f} | {kernel / base:.3f} "
                  f"| {diff:.1e} |")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

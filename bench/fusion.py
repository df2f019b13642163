"""The Mamba-1 block tail, fused by ssmc against the same computed unfused, in one run (GPU).

    y   = selective_scan(u, delta, A, B, C, D, z, delta_bias)      (softplus, D skip, silu(z) gate)
    out = res + rmsnorm(y over d) * norm_weight

ssmc: `examples/mamba1_block.py`, one spec; its fusion stages run it as a scan kernel that writes
the gated y and a row kernel per (b, t) for the norm and the residual (`ssmc show --stage fused`).
Unfused: mamba-ssm's `selective_scan_cuda` (scan, skip and gate in one kernel) followed by PyTorch
ops (`F.rms_norm` over the channels of the (B, L, D) view, the residual add), autograd through both.

For each: the median time (triton's do_bench, fresh random inputs, outputs and gradients checked
against each other first), the CUDA kernels one call launches (torch.profiler), and the bytes the
kernels must move at least (each array read or written once per kernel that touches it).

    python bench/fusion.py [--build-mamba | --mamba-so PATH] [--peers peers] [--quick] [--out DIR]
                           [--shape B,D,L,N]

At shapes where ssmc's forward runs the whole layer as one kernel (a block of threads per b owning
the channels, time inside: `backends/cuda/runner.py`, `one_kernel`), a third row times ssmc's
staged forward (SSMC_CUDA_ROW_RECURRENCE=0) against it; a training step runs the stages either way.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_peers as gp
from overrides import overriding

EPS = 1e-5
TOL = 1e-3  # fp32 against fp32, relative (norm of the difference / norm)


def make_inputs(B: int, D: int, L: int, N: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = torch.exp(torch.rand(D, generator=g, device="cuda") * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    return {
        "u": torch.randn((B, D, L), generator=g, device="cuda"),
        "delta": 0.5 * torch.randn((B, D, L), generator=g, device="cuda"),
        "A": -torch.exp(0.5 * torch.randn((D, N), generator=g, device="cuda")),
        "B": torch.randn((B, N, L), generator=g, device="cuda"),
        "C": torch.randn((B, N, L), generator=g, device="cuda"),
        "D": torch.randn(D, generator=g, device="cuda"),
        "z": torch.randn((B, D, L), generator=g, device="cuda"),
        "delta_bias": dt + torch.log(-torch.expm1(-dt)),
        "res": torch.randn((B, D, L), generator=g, device="cuda"),
        "norm_weight": 1.0 + 0.1 * torch.randn(D, generator=g, device="cuda"),
    }


KEYS = ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "res", "norm_weight"]
SCAN_KEYS = KEYS[:8]


def unfused(ext):
    """mamba-ssm's kernel, then PyTorch's rms_norm and add: (fwd, fwdbwd)."""
    def tail(y, i):
        normed = F.rms_norm(y.transpose(1, 2), (y.shape[1],), i["norm_weight"], EPS).transpose(1, 2)
        return i["res"] + normed

    def fwd(i):
        y = ext.fwd(i["u"], i["delta"], i["A"], i["B"].unsqueeze(1), i["C"].unsqueeze(1), i["D"], i["z"],
                    i["delta_bias"], True)[2]
        return tail(y, i)

    def fwdbwd(i, dout):
        args = [i[k] for k in KEYS]
        out = tail(gp._MambaSelectiveScan.apply(ext, *args[:8]), i)
        return dict(zip(KEYS, torch.autograd.grad(out, args, dout)))

    return fwd, fwdbwd


def row_recurrence(setting: str | None):
    """SSMC_CUDA_ROW_RECURRENCE set to `setting` (None: as it was) while the block runs."""
    return overriding(SSMC_CUDA_ROW_RECURRENCE=setting)


def fused(setting: str | None = None):
    """ssmc's compiled Mamba-1 block (layout b d t, read in place): (fwd, fwdbwd); `setting`:
    SSMC_CUDA_ROW_RECURRENCE during the calls ("0": the forward's stages even where one kernel would run)."""
    import ssmc
    from ssmc.examples import mamba1_block

    assert mamba1_block.EPS == EPS
    f = ssmc.compile(mamba1_block.SPEC, "cuda", layout="b d t")
    g = ssmc.grad(mamba1_block.SPEC, "cuda", layout="b d t")

    def fwd(i):
        with row_recurrence(setting):
            return f(**{k: i[k] for k in KEYS})

    def fwdbwd(i, dout):
        with row_recurrence(setting):
            return {k: v for k, v in g(**{k: i[k].detach() for k in KEYS}, grad_outputs=dout).items() if k in KEYS}
    return fwd, fwdbwd


def one_kernel_forward(B, D, L, N) -> bool:
    """Whether ssmc's forward runs the block as one kernel at this shape (time contiguous)."""
    from ssmc.backends.cuda.runner import one_kernel
    from ssmc.examples import mamba1_block
    from ssmc.lowering.stages import fuse

    return one_kernel(fuse(mamba1_block.SPEC.program), "float32", {"b": B, "d": D, "n": N}, L, True)


def kernel_count(fn) -> int:
    """CUDA kernels one call launches (after a warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def ssmc_bytes(B, D, L, N, backward: bool, staged: bool = False) -> int:
    """Bytes the ssmc kernel plan moves: every array of every kernel the run launches, once (fp32),
    from `kernel_reports` (what `ssmc inspect` lists). A training step runs, per fusion stage, the
    forward (the one saving round carries where the stage's fused backward applies) and the
    stage's backward kernels; `staged`: the forward's stages where it would be one kernel."""
    from ssmc.backends.cuda.report import kernel_reports
    from ssmc.examples import mamba1_block

    sizes = {"b": B, "d": D, "n": N}
    with row_recurrence("0" if backward or staged else None):  # a training step's forward runs the stages
        reports = kernel_reports(mamba1_block.SPEC.program, sizes, L, time_contiguous=True, compile_kernels=False)
    forward = [r for r in reports if r.program == "forward"]
    if backward:
        trained = {r.strategy.split(":")[0] for r in reports if r.program == "forward (training)"}
        runs = [r for r in forward if r.strategy.split(":")[0] not in trained]
        runs += [r for r in reports if r.program != "forward"]
    else:
        runs = forward
    total = 0
    for r in runs:
        launch = r.launch
        extent = {"t": launch.length, "block": launch.nblk, "round": -(-launch.length // 32), **sizes}
        for a in launch.kernel.arrays:
            total += 4 * math.prod(extent[ax] for ax in a.axes)
    return total


def unfused_bytes(B, D, L, N, backward: bool) -> int:
    """Bytes the unfused run moves at least (fp32): mamba-ssm's kernel reads u, delta, z, B, C and
    writes y; rms_norm reads y, writes its output; the add reads that and res, writes out.
    Backward: mamba-ssm reads u, delta, z, B, C, dy and writes du, ddelta, dz, dB, dC; the norm's
    backward reads dout, y and writes dy; the add passes dout through."""
    bdl, bnl = B * D * L, B * N * L
    fwd = (3 * bdl + 2 * bnl + bdl) + 2 * bdl + 3 * bdl
    if not backward:
        return 4 * fwd
    return 4 * (fwd + (4 * bdl + 2 * bnl) + (3 * bdl + 2 * bnl) + 3 * bdl)


def rel(x, y) -> float:
    return ((x.double() - y.double()).norm() / y.double().norm().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", default="peers")
    ap.add_argument("--build-mamba", action="store_true")
    ap.add_argument("--mamba-so")
    ap.add_argument("--quick", action="store_true", help="B2 D64 L256 (a smoke test)")
    ap.add_argument("--out", default=None, help="write results.json and table.md here")
    ap.add_argument("--shape", default="8,1536,2048,16", help="B,D,L,N (default: the benchmark's)")
    args = ap.parse_args()
    B, D, L, N = (2, 64, 256, 16) if args.quick else tuple(int(x) for x in args.shape.split(","))
    peers = Path(args.peers).resolve()
    env = gp.PeerEnv(peers, peers / "_site", peers / "_src", peers / "_ext")
    gp.setup_peers(env)
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    ext = gp.load_mamba_ext(env, args.mamba_so, args.build_mamba, out_dir)
    timer = gp.Timer(warmup_ms=50, rep_ms=400)
    one = one_kernel_forward(B, D, L, N)
    impls = {f"ssmc fused (examples/mamba1_block.py){', forward in one kernel' * one}": fused(),
             "mamba-ssm selective_scan_cuda + torch rms_norm + add": unfused(ext)}
    if one:
        impls["ssmc, forward staged (SSMC_CUDA_ROW_RECURRENCE=0)"] = fused("0")

    # check: outputs and every gradient, fused against unfused, on the same inputs
    inp = make_inputs(B, D, L, N, 0)
    dout = torch.randn_like(inp["u"])
    leaves = {k: v.clone().requires_grad_() for k, v in inp.items()}
    (f_fwd, f_bwd), (u_fwd, u_bwd), *others = impls.values()
    with torch.no_grad():
        err = {"out": rel(f_fwd(inp), u_fwd(inp))}
        err.update({f"out (impl {j + 3})": rel(o_fwd(inp), u_fwd(inp)) for j, (o_fwd, _) in enumerate(others)})
    gf, gu = f_bwd(leaves, dout), u_bwd(leaves, dout)
    err.update({k: rel(gf[k], gu[k]) for k in KEYS})
    bad = {k: v for k, v in err.items() if not v <= TOL}
    print("relative errors, fused vs unfused:", ", ".join(f"{k} {v:.1e}" for k, v in err.items()), flush=True)
    if bad:
        print(f"FAILED check (> {TOL}): {bad}")
        return 1

    rows = []
    for name, (fwd, fwdbwd) in impls.items():
        times = {"fwd": [], "fwdbwd": []}
        for seed in (1, 2, 3):  # fresh random inputs each round; the median of medians is reported
            i = make_inputs(B, D, L, N, seed)
            lv = {k: v.clone().requires_grad_() for k, v in i.items()}
            d = torch.randn_like(i["u"])
            with torch.no_grad():
                times["fwd"].append(timer(partial(fwd, i)))
            times["fwdbwd"].append(timer(partial(fwdbwd, lv, d)))
        with torch.no_grad():
            k_fwd = kernel_count(partial(fwd, inp))
        k_bwd = kernel_count(partial(fwdbwd, leaves, dout))
        by = (partial(ssmc_bytes, staged="RECURRENCE=0" in name) if name.startswith("ssmc") else unfused_bytes)
        rows.append({"impl": name, "fwd_ms": sorted(times["fwd"])[1], "fwdbwd_ms": sorted(times["fwdbwd"])[1],
                     "fwd_kernels": k_fwd, "fwdbwd_kernels": k_bwd,
                     "fwd_MB": by(B, D, L, N, False) / 1e6, "fwdbwd_MB": by(B, D, L, N, True) / 1e6})
    base = rows[1]
    lines = [f"Mamba-1 block tail B{B} D{D} L{L} N{N} fp32, {torch.cuda.get_device_name()}, "
             f"{datetime.date.today()}, {timer.method}",
             "| impl | fwd ms | fwd+bwd ms | speed-up fwd | speed-up fwd+bwd | kernels fwd | kernels fwd+bwd "
             "| MB moved fwd | MB moved fwd+bwd |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['impl']} | {r['fwd_ms']:.3f} | {r['fwdbwd_ms']:.3f} | {base['fwd_ms'] / r['fwd_ms']:.2f}x "
                     f"| {base['fwdbwd_ms'] / r['fwdbwd_ms']:.2f}x | {r['fwd_kernels']} | {r['fwdbwd_kernels']} "
                     f"| {r['fwd_MB']:.0f} | {r['fwdbwd_MB']:.0f} |")
    table = "\n".join(lines)
    print(table)
    if out_dir:
        (out_dir / "fusion.md").write_text(table + "\n")
        (out_dir / "fusion.json").write_text(json.dumps({"rows": rows, "errors": err, "notes": env.notes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

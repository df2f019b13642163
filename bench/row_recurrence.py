"""Rows of a recurrence (a block of threads per row sharing the normalised axis, time inside)
against the plans they replace, in one run (GPU), layout "t b d" (time outermost, channels
contiguous: where a thread per recurrence reads coalesced and the plans below are chosen):

- the Mamba-1 block (`examples/mamba1_block.py`) forward as one kernel (scan, skip, gate, RMSNorm,
  residual) against its stages (the scan kernel writing y, then the norm's row kernel):
  `SSMC_CUDA_ROW_RECURRENCE` = 1 / 0;
- a norm inside the state update (`tests/row_layers.py`, `norm_inside`): a block per b sharing d
  against a thread per b looping over d (what ran before).

Medians of triton's do_bench over fresh random inputs; the two runs' outputs are compared first.

    python bench/row_recurrence.py [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))
import fusion  # noqa: E402
import gpu_peers as gp  # noqa: E402

TOL = 1e-4
BLOCK_SHAPES = [(256, 1024, 1024, 16), (1024, 256, 1024, 16), (8, 1536, 2048, 16)]
INSIDE_SHAPES = [(8, 1536, 2048), (64, 1024, 2048), (256, 256, 1024)]


def block_inputs(B, D, L, N, seed):
    """The benchmark's Mamba-1 block inputs, moved to layout "t b d" (time outermost, contiguous)."""
    i = fusion.make_inputs(B, D, L, N, seed)
    return {k: v.permute(2, 0, 1).contiguous() if v.dim() == 3 else v for k, v in i.items()}


def inside_inputs(B, D, L, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return {"x": torch.randn((L, B, D), generator=g, device="cuda"),
            "a": torch.randn((L, B, D), generator=g, device="cuda"),
            "w": 1.0 + 0.1 * torch.randn(D, generator=g, device="cuda")}


def compare(label, spec, make, shape, timer):
    """Time `spec`'s forward with rows (1) and without (0) at `shape`; outputs compared first."""
    import ssmc

    f = ssmc.compile(spec, "cuda", layout="t b d")
    run = {s: (lambda i, s=s: _with(s, lambda: f(**i))) for s in ("1", "0")}
    inp = make(*shape, 0)
    with torch.no_grad():
        a, b = run["1"](inp), run["0"](inp)
    err = ((a.double() - b.double()).norm() / b.double().norm()).item()
    if not err <= TOL:
        raise SystemExit(f"{label} {shape}: rows and the old plan disagree ({err:.1e})")
    times = {}
    for s in ("1", "0"):
        per_seed = []
        for seed in (1, 2, 3):
            i = make(*shape, seed)
            with torch.no_grad():
                per_seed.append(timer(lambda i=i, s=s: run[s](i)))
        times[s] = sorted(per_seed)[1]
    return {"what": label, "shape": shape, "rows_ms": times["1"], "old_ms": times["0"], "err": err}


def _with(setting, fn):
    with fusion.row_recurrence(setting):
        return fn()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from row_layers import norm_inside

    from ssmc.backends.cuda.runner import one_kernel
    from ssmc.examples import mamba1_block
    from ssmc.lowering.stages import fuse

    timer = gp.Timer(warmup_ms=50, rep_ms=400)
    rows = []
    for shape in BLOCK_SHAPES:
        r = compare("Mamba-1 block forward: one kernel vs stages", mamba1_block.SPEC, block_inputs, shape, timer)
        B, D, L, N = shape
        r["default"] = "one kernel" if one_kernel(fuse(mamba1_block.SPEC.program), "float32",
                                                  {"b": B, "d": D, "n": N}, L, False) else "stages"
        rows.append(r)
        print(r, flush=True)
    for shape in INSIDE_SHAPES:
        r = compare("norm inside the update: block per b vs thread per b", norm_inside, inside_inputs, shape, timer)
        r["default"] = "rows"
        rows.append(r)
        print(r, flush=True)
    lines = [f"Rows of a recurrence, layout t b d, fp32, {torch.cuda.get_device_name()}, {datetime.date.today()}, "
             f"{timer.method}",
             "| what | shape | rows ms | old plan ms | speed-up | default now |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['what']} | {'x'.join(map(str, r['shape']))} | {r['rows_ms']:.3f} | {r['old_ms']:.3f} "
                     f"| {r['old_ms'] / r['rows_ms']:.2f}x | {r['default']} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "row_recurrence.md").write_text(table + "\n")
        (out / "row_recurrence.json").write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())

#!/usr/bin/env python3
"""Check, then time, the forward's chunk_output kernel in its two forms (SSMC_CUDA_CHUNK_OUTPUT).

    python bench/chunk_output_variants.py [--only retnet,ssd] [--chunks 64,128,256] [--reps 50]

On the chunked cores of bench/chunk_check.py (RetNet B4 L4096 H16 K128 V128, SSD B4 L4096 H32 P64 N128,
bf16: `core_chunks`), per chunk size, for a training call's forward (fp32 states and output:
chunk_output) and an inference call's (16-bit states and output: chunk_output_hs_ho):

1. check: `mma.forward` with the form "balanced" (chunk_output*_b: half the warps, each two row stripes)
   against the default "warps": the output, entering states and final state equal bit for bit (the same
   sums in the same order per row); and both within 2e-2 (relative RMS) of `algorithm.forward` in fp32;
   a mismatch prints FAIL and the exit status is 1 (no times are taken then);
2. time: each kernel's median milliseconds over --reps calls (CUDA events around each launch, as
   chunk_check's `kernel_times`), the two forms measured in turns (warps, balanced, warps, balanced),
   the better of the two rounds kept; chunk_output's time, the sum of the kernels, and the ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

from chunk_check import core_chunks, kernel_times, rel  # noqa: E402

from ssmc.backends.cuda.kernels.chunk import algorithm, mma  # noqa: E402

FORMS = ("warps", "balanced")
TOLERANCE = 2e-2


class form:
    """SSMC_CUDA_CHUNK_OUTPUT set to `name` for the duration."""

    def __init__(self, name: str):
        self.name = name

    def __enter__(self):
        self.old = os.environ.get("SSMC_CUDA_CHUNK_OUTPUT")
        os.environ["SSMC_CUDA_CHUNK_OUTPUT"] = self.name

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop("SSMC_CUDA_CHUNK_OUTPUT", None)
        else:
            os.environ["SSMC_CUDA_CHUNK_OUTPUT"] = self.old


def check(x: algorithm.Chunks, kw: dict) -> bool:
    """Both forms bit for bit alike and near the torch forward; prints a line."""
    got = {}
    for name in FORMS:
        with form(name):
            got[name] = [t.float() for t in mma.forward(x, **kw)]
    wide = [None if t is None else t.float() for t in (x.q, x.k, x.v, x.ell, x.s0, x.beta, x.skip)]
    ref_out, _, ref_final = algorithm.forward(algorithm.Chunks(*wide))
    same = all(torch.equal(a, b) for a, b in zip(got["warps"], got["balanced"]))
    errs = {name: (rel(o[0], ref_out), rel(o[2], ref_final)) for name, o in got.items()}
    ok = same and all(e < TOLERANCE for pair in errs.values() for e in pair)
    print(f"  check: bit-equal {same}; rel err (out, final) " +
          ", ".join(f"{n} {e[0]:.2e} {e[1]:.2e}" for n, e in errs.items()) + ("" if ok else "  FAIL"), flush=True)
    return ok


def times(x: algorithm.Chunks, kw: dict, reps: int) -> dict[str, dict[str, float]]:
    """Per form the kernels' median ms, the better of two rounds taken in turns."""
    best: dict[str, dict[str, float]] = {}
    for _ in range(2):
        for name in FORMS:
            with form(name):
                t = kernel_times(x, reps=reps, call=lambda ev: mma.forward(x, events=ev, **kw))
            if name not in best or sum(t.values()) < sum(best[name].values()):
                best[name] = t
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="retnet,ssd")
    ap.add_argument("--chunks", default=",".join(map(str, mma.CHUNKS)))
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for name in args.only.split(","):
        for c in map(int, args.chunks.split(",")):
            x = core_chunks(name, g, c)
            for call, kw in (("training", {}), ("inference", {"half_states": True, "out_dtype": x.q.dtype})):
                cases.append((f"{name} chunk {c} {call}", x, kw))
    ok = True
    for label, x, kw in cases:
        print(label, flush=True)
        ok = check(x, kw) and ok
    if not ok:
        print("FAIL: the forms disagree; no times")
        return 1
    print("\n| case | kernel | warps ms | balanced ms | balanced / warps | warps total | balanced total |")
    print("|---|---|---|---|---|---|---|")
    for label, x, kw in cases:
        t = times(x, kw, args.reps)
        plain = next(k for k in t["warps"] if k.startswith("chunk_output"))
        w, b = t["warps"][plain], t["balanced"][plain + "_b"]
        print(f"| {label} | {plain} | {w:.4f} | {b:.4f} | {b / w:.3f} | {sum(t['warps'].values()):.4f} | "
              f"{sum(t['balanced'].values()):.4f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Check, then time, the forward's kernels in their forms (SSMC_CUDA_CHUNK_OUTPUT, SSMC_CUDA_CHUNK_STATES).

    python bench/chunk_output_variants.py [--only retnet,ssd] [--chunks 64,128,256] [--reps 50] [--out DIR]

On the chunked cores of bench/chunk_check.py (RetNet B4 L4096 H16 K128 V128, SSD B4 L4096 H32 P64 N128,
bf16: `core_chunks`), per chunk size, for a training call's forward (fp32 states and output:
chunk_output) and an inference call's (16-bit states and output: chunk_output_hs_ho), each configuration
of `CONFIGS` (chunk_output's form: warps, balanced *_b, staged *_s with 64 values a block, wide *_s with all
values a block; the entering states: split, chunk_states then state_pass*, or fused, chunk_states_pass*) and
the default (both unset):

1. check: `mma.forward` in each configuration against ("warps", "split"): the output, entering states and
   final state equal bit for bit (the same sums in the same order per row); and each within 2e-2 (relative
   RMS) of `algorithm.forward` in fp32; a mismatch prints FAIL and the exit status is 1 (no times then);
2. time: each kernel's median milliseconds over --reps calls (CUDA events around each launch, as
   chunk_check's `kernel_times`), the configurations measured in turns, the better of two rounds kept; per
   configuration the kernels' times, their sum, and the sum's ratio to ("warps", "split")'s.

Prints the table; with --out, also writes it to DIR/chunk_output_variants.md.
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

BASE = ("warps", "split")
CONFIGS = (BASE, ("balanced", "split"), ("staged", "split"), ("wide", "split"), ("balanced", "fused"),
           ("staged", "fused"), ("wide", "fused"), (None, None))
TOLERANCE = 2e-2
VARIABLES = ("SSMC_CUDA_CHUNK_OUTPUT", "SSMC_CUDA_CHUNK_STATES")


class config:
    """SSMC_CUDA_CHUNK_OUTPUT and SSMC_CUDA_CHUNK_STATES set to `values` (None: unset) for the duration."""

    def __init__(self, values):
        self.values = values

    def __enter__(self):
        self.old = [os.environ.get(n) for n in VARIABLES]
        for n, v in zip(VARIABLES, self.values):
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v

    def __exit__(self, *exc):
        for n, v in zip(VARIABLES, self.old):
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def label(values) -> str:
    return "default" if values == (None, None) else "/".join(values)


def check(x: algorithm.Chunks, kw: dict) -> bool:
    """Every configuration bit for bit BASE's and near the torch forward; prints a line."""
    got = {}
    for values in CONFIGS:
        with config(values):
            got[values] = [t.float() for t in mma.forward(x, **kw)]
    wide = [None if t is None else t.float() for t in (x.q, x.k, x.v, x.ell, x.s0, x.beta, x.skip)]
    ref_out, _, ref_final = algorithm.forward(algorithm.Chunks(*wide))
    ok = True
    for values, outs in got.items():
        same = all(torch.equal(a, b) for a, b in zip(outs, got[BASE]))
        errs = (rel(outs[0], ref_out), rel(outs[2], ref_final))
        fine = same and all(e < TOLERANCE for e in errs)
        ok = ok and fine
        print(f"  check {label(values)}: bit-equal {same}; rel err (out, final) {errs[0]:.2e} {errs[1]:.2e}"
              + ("" if fine else "  FAIL"), flush=True)
    return ok


def times(x: algorithm.Chunks, kw: dict, reps: int) -> dict:
    """Per configuration the kernels' median ms, the better of two rounds taken in turns."""
    best: dict = {}
    for _ in range(2):
        for values in CONFIGS:
            with config(values):
                t = kernel_times(x, reps=reps, call=lambda ev: mma.forward(x, events=ev, **kw))
            if values not in best or sum(t.values()) < sum(best[values].values()):
                best[values] = t
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="retnet,ssd")
    ap.add_argument("--chunks", default=",".join(map(str, mma.CHUNKS)))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", type=Path, help="also write DIR/chunk_output_variants.md")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for name in args.only.split(","):
        for c in map(int, args.chunks.split(",")):
            x = core_chunks(name, g, c)
            for call, kw in (("training", {}), ("inference", {"half_states": True, "out_dtype": x.q.dtype})):
                cases.append((f"{name} chunk {c} {call}", x, kw))
    ok = True
    for title, x, kw in cases:
        print(title, flush=True)
        ok = check(x, kw) and ok
    if not ok:
        print("FAIL: the configurations disagree; no times")
        return 1
    lines = ["| case | chunk_output / states | kernels (ms) | total ms | / warps/split |", "|---|---|---|---|---|"]
    print("\n" + "\n".join(lines), flush=True)
    for title, x, kw in cases:
        t = times(x, kw, args.reps)
        base = sum(t[BASE].values())
        for values in CONFIGS:
            parts = ", ".join(f"{k} {v:.4f}" for k, v in t[values].items())
            total = sum(t[values].values())
            line = f"| {title} | {label(values)} | {parts} | {total:.4f} | {total / base:.3f} |"
            lines.append(line)
            print(line, flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "chunk_output_variants.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

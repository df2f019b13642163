"""Where the time of one ssmc CUDA call goes: kernels by total GPU time (torch.profiler).

    python bench/profile_cuda.py                 # Mamba-1 B8 D1536 L2048 N16 fp32, forward + gradient
    python bench/profile_cuda.py --batch 32 --dim 512 --length 180
    python bench/profile_cuda.py --example mamba1_block   # the block tail (scan, gate, RMSNorm, residual)

Prints one line per kernel name (calls, total and mean time) and the call's wall time, after a
warm-up call (compilation excluded), and the peak memory the call allocated beyond its inputs.
"""

from __future__ import annotations

import argparse
import importlib
import time

import numpy as np
import torch

import ssmc


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dim", type=int, default=1536)
    ap.add_argument("--state", type=int, default=16)
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--example", default="mamba1", choices=["mamba1", "mamba1_block"])
    args = ap.parse_args()
    example = importlib.import_module(f"ssmc.examples.{args.example}")  # both in layout "b d t"
    rng = np.random.default_rng(0)
    inputs = example.make_inputs(rng, args.length, batch=args.batch, dim=args.dim, state=args.state)
    inputs = {k: torch.tensor(v, device="cuda", dtype=torch.float32) for k, v in inputs.items()}
    dy = torch.randn(args.batch, args.dim, args.length, device="cuda")
    grad = ssmc.grad(example.SPEC, "cuda", layout=example.LAYOUT)
    fwd = ssmc.compile(example.SPEC, "cuda", layout=example.LAYOUT)
    for label, call in (("forward", lambda: fwd(**inputs)), ("forward+gradient",
                                                             lambda: grad(**inputs, grad_outputs=dy))):
        call()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            call()
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        events = [e for e in prof.key_averages() if e.device_time_total > 0]
        events.sort(key=lambda e: -e.device_time_total)
        total = sum(e.device_time_total for e in events)
        state = args.batch * args.dim * args.state * args.length * 4
        print(f"\n{label}: wall {wall * 1e3:.2f} ms, GPU busy {total / 1e3:.2f} ms "
              f"(B{args.batch} D{args.dim} N{args.state} L{args.length} fp32); peak memory beyond the inputs "
              f"{extra / 2**20:.0f} MiB (all states over L would be {state / 2**20:.0f} MiB)")
        for e in events[:args.top]:
            print(f"  {e.device_time_total / 1e3:8.3f} ms  {e.count:5d} calls  {e.key[:90]}")


if __name__ == "__main__":
    main()

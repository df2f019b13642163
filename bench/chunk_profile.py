"""Where the chunked matrix-linear path (backends/cuda/kernels/chunk/) spends its time, per chunk size.

    python bench/chunk_profile.py [--chunks 64,128] [--only mamba2,retnet] [--profile]

For each workload (the bench/workloads/matrix.py shapes, bf16) and chunk size: the forward through
`ssmc.compile` and the training step through `ssmc.grad`, timed with CUDA events (median of 20), the
result checked against the element-wise scan (SSMC_CUDA_CHUNKED=0) at a shorter length first; with
--profile the torch profiler's top kernels of one forward and one training step.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

import ssmc
from ssmc.examples import mamba2, retnet

SHAPES = {
    "mamba2": (mamba2, {"b": 4, "t": 4096, "g": 1, "r": 32, "p": 64, "n": 128}),
    "retnet": (retnet, {"b": 4, "t": 4096, "h": 16, "k": 128, "v": 128}),
}


def inputs(name: str, s: dict, length: int, dtype, g: torch.Generator) -> dict:
    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale + shift).to(dtype)
    if name == "mamba2":
        b, gr, r, p, n = s["b"], s["g"], s["r"], s["p"], s["n"]
        return {"x": randn(b, length, gr, r, p), "dt": randn(b, length, gr, r, shift=-1.0),
                "A": -torch.exp(torch.rand(gr, r, generator=g, device="cuda") * 2 - 1),
                "B": randn(b, length, gr, n), "C": randn(b, length, gr, n), "D": randn(gr, r).float()}
    b, h, k, v = s["b"], s["h"], s["k"], s["v"]
    return {"q": randn(b, length, h, k), "k": randn(b, length, h, k, scale=k ** -0.5), "v": randn(b, length, h, v),
            "gamma": 1 - 2.0 ** (-5.0 - torch.arange(h, device="cuda", dtype=torch.float32))}


def timed(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", default="64,128")
    ap.add_argument("--only", default="mamba2,retnet")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.only.split(","):
        measure(name, args, g)


def measure(name: str, args, g: torch.Generator) -> None:
    module, sizes = SHAPES[name]
    out_name = module.SPEC.program.outputs[0][0]
    # the check: chunked against the element-wise scan, fp32, a shorter length
    small = inputs(name, sizes, 512, torch.float32, g)
    os.environ["SSMC_CUDA_CHUNKED"] = "0"
    ref = ssmc.compile(module.SPEC, layout=module.LAYOUT, backend="cuda")(**small, return_final_states=True)
    os.environ.pop("SSMC_CUDA_CHUNKED")
    got = ssmc.compile(module.SPEC, layout=module.LAYOUT, backend="cuda")(**small, return_final_states=True)
    err = max(float((a - b).norm() / b.norm()) for a, b in zip(got, ref))
    print(f"{name}: chunked vs element-wise scan, fp32 L512: relative error {err:.2e}", flush=True)
    x = inputs(name, sizes, sizes["t"], torch.bfloat16, g)
    run = ssmc.compile(module.SPEC, layout=module.LAYOUT, backend="cuda")
    grad = ssmc.grad(module.SPEC, backend="cuda", layout=module.LAYOUT)
    cot = {out_name: torch.randn_like(run(**x), dtype=torch.float32)}

    def forward():
        return run(**x)

    def step():
        return grad(**x, grad_outputs=cot)

    for chunk in args.chunks.split(","):
        os.environ["SSMC_CUDA_CHUNK"] = chunk
        torch.cuda.reset_peak_memory_stats()
        print(f"{name} C={chunk}: forward {timed(forward):.3f} ms, training step (ssmc.grad) {timed(step):.3f} ms,"
              f" peak {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile
            for what, fn in (("forward", forward), ("step", step)):
                with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                    fn()
                    torch.cuda.synchronize()
                print(f"-- {name} C={chunk} {what}")
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
    os.environ.pop("SSMC_CUDA_CHUNK", None)

if __name__ == "__main__":
    main()

"""Host time of ssmc's torch op per call, apart from the GPU's: is a small training step kernel-bound?

    python bench/host_time.py [--out DIR] [--calls 50]

For Mamba-1 at the seed size (`examples/mamba1.py`, "b d t", B32 D512 L180 N16 fp32, gradients of the 8
inputs) and the first-order scan h = a * h + x (bench/workloads/diagonal.py, B32 D512 L180): the host
milliseconds of a forward call and of a backward call, `--calls` of each back to back (`torch.cuda._sleep`
keeps the GPU busy meanwhile, so the Python returns before any kernel runs: the wall time is host time alone,
and a call that waits for the GPU shows as the sleep's length), the GPU kernels' time of one training step
(the torch profiler's sum), and the step's time back to back (CUDA events around `--calls` steps). Prints a
markdown table; with --out, writes DIR/host_time.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ssmc.torch
from ssmc.examples import mamba1

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads.diagonal import scan as scan1  # h = a * h + x

SLEEP_CYCLES = 400_000_000  # ~0.2 s of GPU time: longer than all the host calls queued behind it


def mamba1_inputs(b=32, d=512, n=16, t=180) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale + shift).requires_grad_(True)
    return {"u": randn(b, d, t), "delta": randn(b, d, t, shift=-1.0), "A": randn(d, n, scale=0.5),
            "B": randn(b, n, t), "C": randn(b, n, t), "D": randn(d), "z": randn(b, d, t),
            "delta_bias": randn(d, scale=0.1)}


def scan1_inputs(b=32, d=512, t=180) -> dict:
    g = torch.Generator(device="cuda").manual_seed(1)
    a = torch.rand(b, d, t, generator=g, device="cuda").requires_grad_(True)
    return {"a": a, "x": torch.randn(b, d, t, generator=g, device="cuda").requires_grad_(True)}


def host_ms(fns) -> float:
    """Host milliseconds per call of the calls `fns`, made back to back (steady state) while the GPU works
    through a long sleep queued before them."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for fn in fns:
        fn()
    ms = (time.perf_counter() - t0) * 1e3 / len(fns)
    torch.cuda.synchronize()
    return ms


def measure(name: str, fn, inputs: dict, calls: int) -> dict:
    leaves = list(inputs.values())

    def forward():
        return fn(**inputs)

    def step():
        fn(**inputs).backward(cotangent)
    cotangent = torch.randn_like(forward())
    for _ in range(5):
        step()
    fwd = host_ms([forward] * calls)
    outs = [forward() for _ in range(calls)]
    bwd = host_ms([lambda y=y: y.backward(cotangent) for y in outs])
    del outs
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        step()
    end.record()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = sum(e.self_device_time_total for e in prof.key_averages()
                  if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3  # kernels alone, not the ops above them
    for t in leaves:
        t.grad = None
    return {"name": name, "fwd_host": fwd, "bwd_host": bwd, "step": start.elapsed_time(end) / calls,
            "kernels": kernels}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    rows = [measure("Mamba-1 B32 D512 L180 N16 fp32", ssmc.torch.function(mamba1.SPEC, "cuda", layout=mamba1.LAYOUT),
                    mamba1_inputs(), args.calls),
            measure("scan h = a h + x B32 D512 L180 fp32", ssmc.torch.function(scan1, "cuda", layout="b d t"),
                    scan1_inputs(), args.calls)]
    lines = ["| workload | host ms forward | host ms backward | kernels ms (step) | step ms back to back |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['name']} | {r['fwd_host']:.4f} | {r['bwd_host']:.4f} | {r['kernels']:.4f} | {r['step']:.4f} |"
              for r in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_time.md").write_text(text)


if __name__ == "__main__":
    main()

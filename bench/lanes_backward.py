"""The lanes backward (backends/cuda/lanes_backward.py) against the warp kernel's fused backward (GPU):
Mamba-1 training steps through `ssmc.grad`, fp32, at the benchmark shapes, one run.

For each shape and layout: the gradients with the lanes backward (SSMC_CUDA_LANES_BACKWARD=1) and
without it (=0: the warp kernel's fused backward in "b d t", the unfused backward's kernels in
"b t d", where the lanes backward is the default), compared with each other and with a
float64 step of the interpreter's formulas on the GPU (the float64 warp kernel's fused backward);
then both steps timed (`triton.testing.do_bench`, medians, fresh inputs) and their kernels' own times
(torch.profiler). Exits non-zero where the two disagree.

    python3 bench/lanes_backward.py [--shape BxDxL ...] [--layout "b d t"] [--out FILE]
"""

from __future__ import annotations

import argparse

import torch
from lanes_backward_probe import kernel_times  # bench/ is the script's folder, on sys.path
from overrides import overriding

import ssmc
from ssmc.examples import mamba1

SHAPES = ["32x512x180", "32x512x192", "8x1536x2048"]
N = 16
TOL = 1e-4


def inputs(B: int, D: int, L: int, layout: str, seed: int, dtype=torch.float32) -> dict:
    """Mamba-1's inputs as bench/gpu_peers.py draws them, in `layout` ("b d t" or "b t d")."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=dtype)

    x = {"u": r(B, D, L), "delta": 0.5 * r(B, D, L), "A": -torch.exp(0.5 * r(D, N)), "B": r(B, N, L),
         "C": r(B, N, L), "D": r(D), "z": r(B, D, L),
         "delta_bias": torch.rand(D, generator=g, device="cuda", dtype=dtype) - 2}
    if layout == "b t d":
        x = {k: (v.transpose(1, 2).contiguous() if v.dim() == 3 else v) for k, v in x.items()}
    return x


def with_setting(value: str, fn):
    """`fn()` with SSMC_CUDA_LANES_BACKWARD set to `value` ("1" forces the lanes backward, "0" turns it off)."""
    with overriding(SSMC_CUDA_LANES_BACKWARD=value):
        return fn()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def measure(B: int, D: int, L: int, layout: str) -> tuple[str, float]:
    """One shape and layout: the table's row and the lanes backward's largest relative error."""
    import triton

    grad = ssmc.grad(mamba1.SPEC, "cuda", layout=layout)
    x = inputs(B, D, L, layout, 0)
    dy = torch.randn_like(x["u"])
    lanes = with_setting("1", lambda: grad(**x, grad_outputs=dy))
    other = with_setting("0", lambda: grad(**x, grad_outputs=dy))
    ref = grad(**{k: v.double() for k, v in x.items()}, grad_outputs=dy.double())
    err_lanes = max(rel(lanes[k], ref[k]) for k in ref)
    err_other = max(rel(other[k], ref[k]) for k in ref)
    fresh = inputs(B, D, L, layout, 1)
    dy = torch.randn_like(fresh["u"])

    def step():
        return grad(**fresh, grad_outputs=dy)

    t_lanes = with_setting("1", lambda: triton.testing.do_bench(step, warmup=50, rep=200))
    t_other = with_setting("0", lambda: triton.testing.do_bench(step, warmup=50, rep=200))
    k_lanes = with_setting("1", lambda: kernel_times(step))
    k_other = with_setting("0", lambda: kernel_times(step))
    print("   lanes kernels:", {k[:50]: round(v, 4) for k, v in k_lanes.items()})
    print("   kernels without:", {k[:50]: round(v, 4) for k, v in k_other.items()})

    def backward(kernels: dict) -> float:
        return sum(v for k, v in kernels.items() if "backward" in k)

    row = (f"| B{B} D{D} L{L} | {layout} | {t_lanes:.4f} | {t_other:.4f} | {t_other / t_lanes:.2f} | "
           f"{backward(k_lanes):.4f} | {backward(k_other):.4f} | {err_lanes:.1e} | {err_other:.1e} |")
    return row, err_lanes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", nargs="*", default=SHAPES)
    ap.add_argument("--layout", nargs="*", default=["b d t", "b t d"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    lines = [f"Mamba-1 N{N} fp32 training step (`ssmc.grad`), {torch.cuda.get_device_name()}",
             "| shape | layout | step, lanes backward ms | step without ms | ratio | lanes backward kernel ms "
             "| backward kernels without ms | max rel err lanes vs fp64 | without vs fp64 |",
             "|---|---|---|---|---|---|---|---|---|"]
    failed = False
    for shape in args.shape:
        B, D, L = map(int, shape.split("x"))
        for layout in args.layout:
            row, err = measure(B, D, L, layout)
            failed |= not err < TOL
            lines.append(row)
            print(row, flush=True)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

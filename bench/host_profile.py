"""Where a small Mamba-1 call spends host time on the GPU path: per-call host time and a profile.

    python3 bench/host_profile.py [--batch 32 --dim 512 --length 180] [--calls 300] [--top 25]
                                  [--sort tottime|cumulative] [--only NAME] [--scan | --families]

For the forward (`ssmc.compile`), a training step (`ssmc.grad`) and its forward (`Grad.forward`),
the torch op (`ssmc.torch`: its forward alone, forward + `backward()` into the leaves' `.grad`, and
through `torch.autograd.grad` as bench/gpu_peers.py times it), and an empty `autograd.Function` of
as many inputs (torch's own cost a call), each on the same inputs (layout "b d t", fp32):

    host µs a call   `calls` calls back to back, one synchronize at the end: where the host is
                     slower than the kernels this is its time per call (else the kernels')
    kernels µs       the CUDA time of one call (torch.profiler, averaged)
    profile          cProfile of the back-to-back calls, the `top` functions by own time

The host times again with every launch through CuPy instead of the driver (backends/cuda/launch.py),
then the warp kernel's fused backward's time with its steps per lane forced (SSMC_CUDA_BACKWARD_STEPS_PER_LANE).
`--scan`: the first-order scan's training step (`ssmc.grad` and the torch op) instead; `--families`:
a training step of each family's example at small shapes (`family_times`) instead.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import numpy as np
import torch
from lanes_backward_probe import kernel_times  # bench/ is the script's folder, on sys.path
from overrides import overriding

import ssmc  # the scan's annotations are evaluated in this module's globals


def per_call_us(fn, calls: int) -> float:
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def kernel_us(fn, reps: int = 20) -> tuple[float, dict[str, float]]:
    """The CUDA time of one call of `fn` and of each kernel it launches, µs (`kernel_times`)."""
    kernels = {name: ms * 1000 for name, ms in kernel_times(fn, reps).items()}
    return sum(kernels.values()), kernels


def profile(fn, calls: int, top: int, sort: str = "tottime") -> str:
    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats(sort).print_stats(top)
    return out.getvalue()


@ssmc.recurrence
def scan(h: ssmc.State["b d"], a: ssmc.Seq["b d"], x: ssmc.Seq["b d"]):  # noqa: F722
    """The first-order scan of bench/gpu_peers.py: h = a * h + x, y = h."""
    h = a * h + x
    return h, h


def scan_times() -> None:
    """The first-order scan of bench/gpu_peers.py (B8 D2048 L4096 fp32, "b d t"): a training step's
    do_bench median and host time a call, launches through the driver and through CuPy."""
    import triton

    import ssmc.torch as ssmc_torch
    from ssmc.backends.cuda import launch

    a = torch.rand(8, 2048, 4096, device="cuda") * 0.5 + 0.5
    x, dy = torch.randn_like(a), torch.randn_like(a)
    grad = ssmc.grad(scan, "cuda", layout="b d t")
    print("\n| scan B8 D2048 L4096 training step | do_bench ms | host µs a call | kernels µs |\n|---|---|---|---|")
    for driver in (True, False, True):
        launch.use_driver = driver
        step = lambda: grad(a=a, x=x, grad_outputs=dy)  # noqa: E731
        ms = triton.testing.do_bench(step, warmup=50, rep=200)
        total, _ = kernel_us(step)
        print(f"| {'driver' if driver else 'CuPy'} launches | {ms:.3f} | {per_call_us(step, 50):.1f} | {total:.1f} |")
    launch.use_driver = True
    op = ssmc_torch.function(scan, layout="b d t")
    leaves = [a.clone().requires_grad_(True), x.clone().requires_grad_(True)]
    op_step = lambda: torch.autograd.grad(op(*leaves), leaves, dy)  # noqa: E731
    total, kernels = kernel_us(op_step)
    listed = ", ".join(f"{k[:40]} {v:.1f}" for k, v in kernels.items())
    print(f"| torch op, autograd.grad | {triton.testing.do_bench(op_step, warmup=50, rep=200):.3f} "
          f"| {per_call_us(op_step, 50):.1f} | {total:.1f}: {listed} |")
    print(f"\n## profile: scan training step\n\n{profile(step, 50, 25)}")


def family_times(calls: int) -> None:
    """A training step of each family's example at small shapes (HGRN and minGRU "b t ...", the
    first-order scan and Mamba-1 "b d t"; B32 D512 L180, minGRU I512; HGRN at B2 D512 L4096, which runs
    as time blocks; and the scan at B8 D2048 L4096): host µs a call and kernels of the op's step
    (`autograd.grad`), of `ssmc.grad`'s, and of an empty `autograd.Function` of as many inputs."""
    import ssmc.torch as ssmc_torch
    from ssmc.examples import hgrn, mamba1, mingru

    rng = np.random.default_rng(0)
    B, D, L = 32, 512, 180
    cases = [(f"HGRN B{B} D{D} L{L}", hgrn.SPEC, hgrn.LAYOUT, hgrn.make_inputs(rng, L, batch=B, dim=D), (B, L, D)),
             (f"minGRU B{B} I{D} D{D} L{L}", mingru.SPEC, mingru.LAYOUT,
              mingru.make_inputs(rng, L, batch=B, inp=D, dim=D), (B, L, D)),
             (f"scan B{B} D{D} L{L}", scan, "b d t",
              {"a": rng.uniform(0.5, 1.0, (B, D, L)), "x": rng.standard_normal((B, D, L))}, (B, D, L)),
             (f"Mamba-1 B{B} D{D} L{L}", mamba1.SPEC, mamba1.LAYOUT,
              mamba1.make_inputs(rng, L, batch=B, dim=D, state=16), (B, D, L)),
             ("HGRN B2 D512 L4096 (time blocks)", hgrn.SPEC, hgrn.LAYOUT, hgrn.make_inputs(rng, 4096, batch=2, dim=D),
              (2, 4096, D)),
             ("scan B8 D2048 L4096", scan, "b d t",
              {"a": rng.uniform(0.5, 1.0, (8, 2048, 4096)), "x": rng.standard_normal((8, 2048, 4096))},
              (8, 2048, 4096))]
    print(f"{torch.cuda.get_device_name()}\n")
    print("| case | call | host µs a call | kernels µs | kernels |\n|---|---|---|---|---|")
    for name, spec, layout, inputs, dy_shape in cases:
        x = {k: torch.tensor(v, device="cuda", dtype=torch.float32) for k, v in inputs.items() if k != "h"}
        for label, fn in _steps(ssmc_torch.function(spec, layout=layout), ssmc.grad(spec, "cuda", layout=layout), x,
                                torch.randn(*dy_shape, device="cuda")).items():
            total, kernels = kernel_us(fn)
            print(f"| {name} | {label} | {per_call_us(fn, calls):.1f} | {total:.1f} | {len(kernels)} |", flush=True)


def _steps(op, grad, x: dict, dy) -> dict:
    """The op's training step, `ssmc.grad`'s, and an empty `autograd.Function`'s, on inputs `x`."""
    tensors = [v.clone().requires_grad_(True) for v in x.values()]
    return {"op, autograd.grad": lambda: torch.autograd.grad(op(*tensors), tensors, dy),
            "ssmc.grad": lambda: grad(**x, grad_outputs=dy),
            "empty autograd.Function": lambda: torch.autograd.grad(_Floor.apply(*tensors), tensors, dy)}


class _Floor(torch.autograd.Function):
    """A Function whose forward and backward launch nothing: what torch's autograd costs a call."""

    @staticmethod
    def forward(ctx, *tensors):
        ctx.like = tensors
        return torch.empty_like(tensors[0])

    @staticmethod
    def backward(ctx, dy):
        return tuple(torch.empty_like(t) for t in ctx.like)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--length", type=int, default=180)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", choices=["tottime", "cumulative"], help="the profiles' order")
    ap.add_argument("--only", default=None, help="profile only the calls whose name contains this")
    ap.add_argument("--scan", action="store_true", help="only the first-order scan's training step (scan_times)")
    ap.add_argument("--families", action="store_true", help="only each family's training step (family_times)")
    args = ap.parse_args(argv)
    if args.scan:
        scan_times()
        return 0
    if args.families:
        family_times(min(args.calls, 200))
        return 0
    import ssmc.torch
    from ssmc.examples import mamba1

    x = mamba1.make_inputs(np.random.default_rng(0), args.length, batch=args.batch, dim=args.dim, state=16)
    x = {k: torch.tensor(v, device="cuda", dtype=torch.float32) for k, v in x.items() if k != "h"}
    dy = torch.randn(args.batch, args.dim, args.length, device="cuda")
    fwd = ssmc.compile(mamba1.SPEC, "cuda", layout="b d t")
    grad = ssmc.grad(mamba1.SPEC, "cuda", layout="b d t")
    op = ssmc.torch.function(mamba1.SPEC, layout="b d t")
    leaves = {k: v.clone().requires_grad_(True) for k, v in x.items()}

    def torch_step():
        y = op(**leaves)
        y.backward(dy)

    tensors = list(leaves.values())

    def torch_grad():  # as bench/gpu_peers.py times the op and mamba-ssm's wrapper
        torch.autograd.grad(op(*tensors), tensors, dy)

    def floor_grad():  # torch's own cost of a Function of as many inputs: kernels-free, the same calls
        torch.autograd.grad(_Floor.apply(*tensors), tensors, dy)

    calls = {"forward": lambda: fwd(**x), "training step (ssmc.grad)": lambda: grad(**x, grad_outputs=dy),
             "training forward (Grad.forward)": lambda: grad.forward(**x),
             "torch op forward (graph kept, no backward)": lambda: op(*tensors),
             "torch op forward + backward()": torch_step, "torch op, autograd.grad": torch_grad,
             "empty autograd.Function, autograd.grad": floor_grad}
    print(f"Mamba-1 B{args.batch} D{args.dim} L{args.length} N16 fp32, {torch.cuda.get_device_name()}")
    print("| call | host µs a call (back to back) | kernels µs | kernels |\n|---|---|---|---|")
    for name, fn in calls.items():
        total, kernels = kernel_us(fn)
        listed = ", ".join(f"{k[:32]} {v:.1f}" for k, v in kernels.items())
        print(f"| {name} | {per_call_us(fn, args.calls):.1f} | {total:.1f} | {listed} |")
    from ssmc.backends.cuda import launch

    launch.use_driver = False  # the same calls, every launch through CuPy
    for name, fn in calls.items():
        print(f"| {name}, CuPy launches | {per_call_us(fn, args.calls):.1f} | | |")
    launch.use_driver = True
    for name, fn in calls.items():
        if args.only is None or args.only in name:
            print(f"\n## profile: {name}\n")
            print(profile(fn, args.calls, args.top, args.sort))
    print("\n| SSMC_CUDA_BACKWARD_STEPS_PER_LANE | kernels µs of a training step |\n|---|---|")
    for k in ("", "1", "2", "4", "8"):
        # forced steps: the warp kernel's fused backward (at L <= 192 the lanes backward runs by default)
        with overriding(SSMC_CUDA_BACKWARD_STEPS_PER_LANE=k or None, SSMC_CUDA_LANES_BACKWARD="0" if k else None):
            try:
                total, kernels = kernel_us(lambda: grad(**x, grad_outputs=dy))
                listed = ", ".join(f"{n[:32]} {v:.1f}" for n, v in kernels.items())
                print(f"| {k or 'default'} | {total:.1f}: {listed} |")
            except Exception as exc:
                print(f"| {k} | {type(exc).__name__}: {str(exc)[:100]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

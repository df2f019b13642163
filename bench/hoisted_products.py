"""Recurrences with per-step matrix products on the GPU: the products hoisted out of the time loop
(`ssmc/backends/cuda/hoisted.py`, cuBLAS through torch) against every product inside the kernels
(`SSMC_CUDA_HOIST=0`, the backend before), in the same run.

    python3 bench/hoisted_products.py [--quick] [--out DIR]

Cases (fp32, the examples' layouts "b t ..."): minGRU B32 I512 D512 L180 (x Wz and x Wh per step),
LSTM and GRU B32 I256 H256 L180 (x W per step; h U stays in the loop). For each: the forward
(`ssmc.compile`), a training step (`ssmc.grad`, the output's cotangent given) and the torch op's step
(`torch.autograd.grad`), each checked first against float64 (`reference`: relative error of the
output and of every gradient), then timed (triton.testing.do_bench median, fresh random inputs per
case); and, for scale, the forward's products alone in torch (the floor the hoisted forward adds its
scan to). Writes a markdown table to stdout and DIR/hoisted_products.md.
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
from pathlib import Path

import numpy as np
import torch

import ssmc
import ssmc.torch as ssmc_torch

CASES = {  # example -> make_inputs sizes
    "mingru": {"batch": 32, "inp": 512, "dim": 512},
    "lstm": {"batch": 32, "inp": 256, "hidden": 256},
    "gru": {"batch": 32, "inp": 256, "hidden": 256},
}
LENGTH = 180


def rel_err(got, want) -> float:
    got = got.detach().double().cpu().numpy()
    want = np.asarray(want, dtype=np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def bench(fn, rep_ms: int) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median"))


def flat(values) -> list:
    return list(values) if isinstance(values, tuple) else [values]


def reference(name: str, sizes: dict) -> tuple:
    """(inputs, output cotangents, outputs, gradients): random inputs (zero initial states) and the
    results of the float64 CUDA run (products hoisted: tests/test_cuda.py checks that path against
    the interpreter at awkward sizes; the interpreter itself needs more memory than a 23 GB host
    has at these sizes, and with the products in the kernels the float64 adjoint's epilogue needs
    more local memory a thread than CUDA allows at B32 I512 D512, found 2026-11-26)."""
    m = importlib.import_module(f"ssmc.examples.{name}")
    rng = np.random.default_rng(0)
    inputs = m.make_inputs(rng, LENGTH, **sizes)
    for s in m.SPEC.program.states:
        inputs.pop(s.name, None)
    x = {k: torch.tensor(v, device="cuda", dtype=torch.float64) for k, v in inputs.items()}
    want_out = flat(ssmc.compile(m.SPEC, "cuda", layout=m.LAYOUT)(**x))
    cot = [rng.standard_normal(tuple(o.shape)) for o in want_out]
    dy = [torch.tensor(c, device="cuda") for c in cot]
    want = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)(**x, grad_outputs=dy[0] if len(dy) == 1 else tuple(dy))
    return inputs, cot, [o.cpu().numpy() for o in want_out], {k: v.cpu().numpy() for k, v in want.items()}


def run_case(name: str, ref: tuple, hoist: bool, rep_ms: int) -> dict:
    """Times (ms) and worst relative errors of one example with hoisting on or off."""
    os.environ["SSMC_CUDA_HOIST"] = "1" if hoist else "0"
    m = importlib.import_module(f"ssmc.examples.{name}")
    inputs, cot, want_out, want = ref
    names = [d.name for d in m.SPEC.program.inputs]
    x = {k: torch.tensor(v, device="cuda", dtype=torch.float32) for k, v in inputs.items()}
    dy = [torch.tensor(c, device="cuda", dtype=torch.float32) for c in cot]
    fwd = ssmc.compile(m.SPEC, "cuda", layout=m.LAYOUT)
    grad = ssmc.grad(m.SPEC, "cuda", layout=m.LAYOUT)
    op = ssmc_torch.function(m.SPEC, "cuda", layout=m.LAYOUT)
    leaves = [x[n].clone().requires_grad_(True) for n in names]

    def forward():
        return fwd(**x)

    def step():
        return grad(**x, grad_outputs=dy[0] if len(dy) == 1 else tuple(dy))

    def op_step():
        return torch.autograd.grad(flat(op(*leaves)), leaves, dy)

    def op_grads():
        op_step()  # the second call takes the prepared path
        return dict(zip(names, op_step()))

    checks = {"forward": (forward, lambda: max(rel_err(g, w) for g, w in zip(flat(forward()), want_out))),
              "ssmc.grad": (step, lambda: max(rel_err(g, want[n]) for n, g in step().items() if n in names)),
              "op": (op_step, lambda: max(rel_err(g, want[n]) for n, g in op_grads().items()))}
    result = {"times": {}, "errors": {}, "failed": {}}
    for call, (fn, error) in checks.items():
        try:
            result["errors"][call] = error()
            result["times"][call] = bench(fn, rep_ms)
        except Exception as err:  # the products in the kernels: a launch that fails at this size
            result["failed"][call] = f"{type(err).__name__}: {str(err).splitlines()[0][:80]}"
    del os.environ["SSMC_CUDA_HOIST"]
    return result


def products_alone(name: str, sizes: dict, rep_ms: int) -> float:
    """The forward's hoisted products (`HoistedRunner`'s pre products) alone, ms."""
    from ssmc.backends.cuda.hoisted import TORCH, hoisted_runner
    from ssmc.lowering.hoist import compute_pre

    m = importlib.import_module(f"ssmc.examples.{name}")
    inputs = m.make_inputs(np.random.default_rng(1), LENGTH, **sizes)
    h = hoisted_runner(m.SPEC.program).hoisted
    seqs = {d.name: torch.tensor(inputs[d.name], device="cuda", dtype=torch.float32).transpose(0, 1)
            for d in m.SPEC.program.seqs}  # "b t ..." -> time first
    params = {d.name: torch.tensor(inputs[d.name], device="cuda", dtype=torch.float32) for d in m.SPEC.program.params}
    return bench(lambda: compute_pre(h, seqs, params, xp=TORCH), rep_ms)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="shorter timing runs")
    ap.add_argument("--out", default=None, help="folder for hoisted_products.md")
    args = ap.parse_args(argv)
    rep = 100 if args.quick else 400
    lines = [f"Hoisted products, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, L{LENGTH} fp32, do_bench medians", "",
             "| case | call | in the kernels ms | hoisted ms | speedup | rel. error in / hoisted |",
             "|---|---|---|---|---|---|"]
    failed = False
    for name, sizes in CASES.items():
        shape = " ".join(f"{k}={v}" for k, v in sizes.items())
        ref = reference(name, sizes)
        before = run_case(name, ref, False, rep)
        after = run_case(name, ref, True, rep)
        for call in ("forward", "ssmc.grad", "op"):
            if call in after["failed"]:
                failed = True
                lines.append(f"| {name} {shape} | {call} | | fails: {after['failed'][call]} | | |")
                continue
            a, ea = after["times"][call], after["errors"][call]
            failed |= not ea <= 1e-3
            if call in before["failed"]:
                why = before["failed"][call]
                lines.append(f"| {name} {shape} | {call} | fails: {why} | {a:.3f} | | - / {ea:.1e} |")
                continue
            b, eb = before["times"][call], before["errors"][call]
            lines.append(f"| {name} {shape} | {call} | {b:.3f} | {a:.3f} | {b / a:.1f}x | {eb:.1e} / {ea:.1e} |")
        lines.append(f"| {name} {shape} | the forward's products alone (torch) | | "
                     f"{products_alone(name, sizes, rep):.3f} | | |")
        print("\n".join(lines[-4:]), flush=True)
    text = "\n".join(lines) + "\n"
    print("\n" + text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "hoisted_products.md").write_text(text)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

#!/usr/bin/env python3
"""Time the specs that could not run, or ran pathologically, at real sizes (the correctness issue):
the matrix-state backwards (Mamba-2 / SSD, RetNet), a gate's input projection, and a complex diagonal
recurrence written as a real pair. ssmc alone (the peers of the matrix family are bench/gpu_peers.py's);
every output and gradient is first checked finite, and at a small size against the interpreter.

    python bench/unblocked_shapes.py [--out DIR]        # DIR: $OUT, else print only

Each workload: the first forward call (compiling), then medians of `triton.testing.do_bench` of the
forward and of a training step (forward + gradients of every input through `ssmc.grad`).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import textwrap
import time
import traceback
from pathlib import Path

import numpy as np
import torch

import ssmc
from ssmc.examples import mamba2, retnet

COMPLEX = textwrap.dedent('''
    import ssmc

    @ssmc.recurrence
    def complex_diag(hr: ssmc.State["b d n"], hi: ssmc.State["b d n"], x: ssmc.Seq["b d"], nu: ssmc.Param["d n"],
                     cth: ssmc.Param["d n"], sth: ssmc.Param["d n"], C: ssmc.Param["d n"]):
        r = ssmc.exp(-ssmc.exp(nu))
        lr, li = r * cth, r * sth
        return (lr * hr - li * hi + x, lr * hi + li * hr), (hr * C).sum("n")

    @ssmc.recurrence
    def projected_gate(h: ssmc.State["b d"], x: ssmc.Seq["b d"], a: ssmc.Seq["b d"], Wx: ssmc.Param["e d"]):
        f = ssmc.sigmoid(a)
        h = f * h + (1 - f) * ssmc.silu(ssmc.dot(x.rename(d="e"), Wx, over="e")) * x
        return h, ssmc.rmsnorm(h, over="d")
''')


def _specs():
    path = Path("/tmp/ssmc_unblocked_specs.py")
    path.write_text(COMPLEX)
    namespace: dict = {}
    exec(compile(COMPLEX, str(path), "exec"), namespace)
    return namespace


def _bench(fn) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200))


def _inputs(program, sizes, length, layout, dtype, rng):
    from ssmc.runtime.random_inputs import random_recurrence_inputs

    values = random_recurrence_inputs(program, length, rng, sizes, with_initial=False, scale=0.5)
    seqs = {d.name for d in program.seqs}
    out = {}
    for name, v in values.items():
        if name in seqs and layout == "b t ...":
            v = np.moveaxis(v, 0, 1)
        elif name in seqs:  # "b d t": time last
            v = np.moveaxis(v, 0, -1)
        out[name] = torch.tensor(np.ascontiguousarray(v), device="cuda", dtype=dtype)
    return out


def workload(name, spec, sizes, length, layout="b t ...", dtype=torch.float32, fix=None) -> str:
    rng = np.random.default_rng(0)
    x = _inputs(spec.program, sizes, length, layout, dtype, rng)
    if fix:
        fix(x)
    f = ssmc.compile(spec, "cuda", layout=layout)
    g = ssmc.grad(spec, "cuda", layout=layout)
    t0 = time.perf_counter()
    y = f(**x)
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    ys = y if isinstance(y, tuple) else (y,)
    dy = tuple(torch.randn_like(a) for a in ys)
    grads = g(**x, grad_outputs=dy if len(dy) > 1 else dy[0])
    finite = all(bool(torch.isfinite(a).all()) for a in (*ys, *grads.values()))
    fwd = _bench(lambda: f(**x))
    step = _bench(lambda: g(**x, grad_outputs=dy if len(dy) > 1 else dy[0]))
    shape = " ".join(f"{a}{n}" for a, n in sizes.items())
    return (f"| {name} | {shape} L{length} {str(dtype).removeprefix('torch.')} `{layout}` | {first * 1e3:.0f} | "
            f"{fwd:.3f} | {step:.3f} | {'yes' if finite else 'NO'} |")


def _decaying_mamba2(x):
    x["A"].copy_(-torch.exp(x["A"].float()))


def _decaying_retnet(x):
    x["gamma"].copy_(0.9 + 0.09 * torch.rand_like(x["gamma"].float()))


def _unit_rotation(x):
    theta = 3.0 * torch.randn_like(x["cth"])
    x["cth"].copy_(torch.cos(theta))
    x["sth"].copy_(torch.sin(theta))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"))
    args = parser.parse_args()
    specs = _specs()
    rows = [
        ("Mamba-2 / SSD", mamba2.SPEC, {"b": 4, "g": 1, "r": 32, "p": 64, "n": 128}, 4096, "b t ...", torch.bfloat16,
         _decaying_mamba2),
        ("Mamba-2 / SSD", mamba2.SPEC, {"b": 2, "g": 1, "r": 8, "p": 64, "n": 64}, 1024, "b t ...", torch.float32,
         _decaying_mamba2),
        ("RetNet", retnet.SPEC, {"b": 4, "h": 16, "k": 128, "v": 128}, 4096, "b t ...", torch.bfloat16,
         _decaying_retnet),
        ("RetNet", retnet.SPEC, {"b": 2, "h": 4, "k": 64, "v": 64}, 1024, "b t ...", torch.float32, _decaying_retnet),
        ("gate with input projection", specs["projected_gate"], {"b": 8, "d": 1024, "e": 1024}, 2048, "b t ...",
         torch.float32, None),
        ("complex diagonal (real pair)", specs["complex_diag"], {"b": 8, "d": 1024, "n": 64}, 2048, "b t ...",
         torch.float32, _unit_rotation),
        ("complex diagonal (real pair)", specs["complex_diag"], {"b": 8, "d": 1024, "n": 64}, 2048, "b d t",
         torch.float32, _unit_rotation),
    ]
    now = datetime.datetime.now(datetime.UTC)
    lines = [f"# Unblocked shapes, {torch.cuda.get_device_name()}, {now:%Y-%m-%d %H:%M} UTC",
             "", "`python bench/unblocked_shapes.py`", "",
             "| workload | shape | first forward ms (compiling) | forward ms | forward + gradients ms | finite |",
             "|---|---|---|---|---|---|"]
    for name, spec, sizes, length, layout, dtype, fix in rows:
        try:
            lines.append(workload(name, spec, sizes, length, layout, dtype, fix))
        except Exception as err:  # one failure does not stop the rest
            traceback.print_exc()
            lines.append(f"| {name} | {sizes} L{length} `{layout}` | failed: {type(err).__name__}: "
                         f"{str(err).splitlines()[0][:200]} | | | |")
        print(lines[-1], flush=True)
        torch.cuda.empty_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "unblocked_shapes.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

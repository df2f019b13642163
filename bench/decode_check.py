"""Check and time ssmc's single-step (decode) form of Mamba-1 against mamba-ssm's `selective_state_update`.

    python bench/decode_check.py [--out DIR] [--peers peers]

For each of B1, B16, B64 at D1536 N16 and D2048 N128 (fp32): `ssmc.step(mamba1.SPEC, "cuda",
layout="b d t")` on one step (u, delta, B, C, z of [b d] / [b n], the state [b d n]) and mamba-ssm's Triton
`selective_state_update` (softplus(dt + dt_bias), D skip, z gate: the same step): the outputs and new
states compared first (max |difference| / max |value|), then the time of a step as a decoder loop sees it
(back-to-back calls, CUDA events around 200 of them: host time counts where the step is host-bound), and
each one's host time per call (wall time of the 200 calls' Python, the GPU not waited for). Prints a
markdown table; with --out, writes it to DIR/decode.md. Needs torch, triton, cupy; the peer comes from
the mamba-ssm sdist in peers/ as bench/harness.py installs it (no network).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

from harness import Peers  # noqa: E402

import ssmc  # noqa: E402
from ssmc.examples import mamba1  # noqa: E402

SHAPES = [(b, d, n) for d, n in ((1536, 16), (2048, 128)) for b in (1, 16, 64)]
CALLS = 200


def inputs(b: int, d: int, n: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(b * 7 + n)

    def randn(*shape, scale=1.0, shift=0.0):
        return torch.randn(*shape, generator=g, device="cuda") * scale + shift
    return {"u": randn(b, d), "delta": randn(b, d, shift=-1.0), "A": -torch.exp(randn(d, n, scale=0.5)),
            "B": randn(b, n), "C": randn(b, n), "D": randn(d), "z": randn(b, d), "delta_bias": randn(d, scale=0.1),
            "h": randn(b, d, n, scale=0.5)}


def per_call(fn) -> tuple[float, float]:
    """(milliseconds a call takes back to back, host milliseconds a call): CALLS calls after a warm-up."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    for _ in range(CALLS):
        fn()
    host = (time.perf_counter() - t0) * 1e3 / CALLS
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / CALLS, host


def rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def row(update, b: int, d: int, n: int) -> dict:
    a = inputs(b, d, n)
    step = ssmc.step(mamba1.SPEC, "cuda", layout=mamba1.LAYOUT)
    args = [a[k] for k in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")]
    y, h = step(*args, states=a["h"])
    state = a["h"].clone()
    y_peer = update(state, a["u"], a["delta"], a["A"], a["B"], a["C"], D=a["D"], z=a["z"], dt_bias=a["delta_bias"],
                    dt_softplus=True)
    errors = (rel(y, y_peer), rel(h, state))
    ms, host = per_call(lambda: step(*args, states=a["h"]))
    peer_ms, peer_host = per_call(lambda: update(state, a["u"], a["delta"], a["A"], a["B"], a["C"], D=a["D"], z=a["z"],
                                                 dt_bias=a["delta_bias"], dt_softplus=True))
    return {"shape": f"B{b} D{d} N{n}", "err": errors, "ms": ms, "host": host, "peer_ms": peer_ms,
            "peer_host": peer_host}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--peers", type=Path, default=BENCH.parent / "peers")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ssmc_peers"))
    args = ap.parse_args()
    update = Peers(args.peers, args.work, build=False).mamba(
        "mamba_ssm.ops.triton.selective_state_update").selective_state_update
    lines = ["| Mamba-1 step fp32 | rel err y, state | ssmc ms / call | ssmc host ms | selective_state_update ms | "
             "its host ms | peer / ssmc |", "|---|---|---|---|---|---|---|"]
    for b, d, n in SHAPES:
        r = row(update, b, d, n)
        lines.append(f"| {r['shape']} | {r['err'][0]:.1e}, {r['err'][1]:.1e} | {r['ms']:.4f} | {r['host']:.4f} | "
                     f"{r['peer_ms']:.4f} | {r['peer_host']:.4f} | {r['peer_ms'] / r['ms']:.2f}x |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode.md").write_text(text)


if __name__ == "__main__":
    main()

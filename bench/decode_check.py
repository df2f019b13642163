"""Check and time ssmc's single-step (decode) forms of Mamba-1 and Mamba-2 against mamba-ssm's `selective_state_update`.

    python bench/decode_check.py [--out DIR] [--peers peers] [--family mamba1|mamba2|lstm|all]

Mamba-1: for each of B1, B16, B64 at D1536 N16 and D2048 N128 (fp32): `ssmc.step(mamba1.SPEC, "cuda",
layout="b d t")` on one step (u, delta, B, C, z of [b d] / [b n], the state [b d n]) and mamba-ssm's Triton
`selective_state_update` (softplus(dt + dt_bias), D skip, z gate: the same step).

Mamba-2: for each of B1, B16, B64 at D2048 = H32 x P64, N128, one group, bf16 x, dt, B, C (fp32 A, D and
state): `ssmc.step(mamba2.SPEC, "cuda", layout="b t ...")` on one step (x [b 1 32 64], dt [b 1 32], B and C
[b 1 128], the state [b 1 32 64 128]) and `selective_state_update`'s multi-head form as mamba-ssm's Mamba2.step
calls it (state [b 32 64 128], x [b 32 64], dt, A, D repeated along the head's p and n by stride-0 views,
B and C [b 1 128], dt_softplus, no dt_bias, no z: the same step).

LSTM (`lstm_rows`): B1, B16, B64 at input = hidden = 1024 (fp32), the two ways ssmc's cuda backend can run a
step in place (the default, two cuBLAS products then one kernel; one kernel alone), against torch.nn.LSTMCell
with the same weights.

Each: the outputs and new states compared first (max |difference| / max |value|), then the time of a step as a
decoder loop sees it (back-to-back calls, CUDA events around 200 of them: host time counts where the step is
host-bound), and each one's host time per call (wall time of the 200 calls' Python, the GPU not waited for).
ssmc twice: allocating its results, and with ``out=`` and ``in_place=True`` (the kernel writes the output and
the state given: no allocation), as mamba-ssm's update writes its state in place. Prints a markdown table;
with --out, writes it to DIR/decode.md. Needs torch, triton, cupy; the peer comes from the mamba-ssm sdist in
peers/ as bench/harness.py installs it (no network).
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
from ssmc.examples import mamba1, mamba2  # noqa: E402

SHAPES = [(b, d, n) for d, n in ((1536, 16), (2048, 128)) for b in (1, 16, 64)]
MAMBA2_SHAPES = [(b, 32, 64, 128) for b in (1, 16, 64)]  # (B, heads, head dim, N): D = 2048
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
    out, buffer = torch.empty_like(y), a["h"].clone()
    in_place_ms, in_place_host = per_call(lambda: step(*args, states=buffer, out=out, in_place=True))
    peer_ms, peer_host = per_call(lambda: update(state, a["u"], a["delta"], a["A"], a["B"], a["C"], D=a["D"], z=a["z"],
                                                 dt_bias=a["delta_bias"], dt_softplus=True))
    return {"shape": f"B{b} D{d} N{n}", "err": errors, "ms": ms, "host": host, "in_place_ms": in_place_ms,
            "in_place_host": in_place_host, "peer_ms": peer_ms, "peer_host": peer_host}


def mamba2_inputs(b: int, heads: int, p: int, n: int) -> dict:
    """Mamba-2's step in ssmc's layout (one group: g = 1, r = heads), the sequences bf16."""
    g = torch.Generator(device="cuda").manual_seed(b * 11 + heads)

    def randn(*shape, scale=1.0, shift=0.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g, device="cuda") * scale + shift).to(dtype)
    half = torch.bfloat16
    return {"x": randn(b, 1, heads, p, dtype=half), "dt": randn(b, 1, heads, shift=-1.0, dtype=half),
            "A": -torch.exp(randn(1, heads, scale=0.5)), "B": randn(b, 1, n, dtype=half),
            "C": randn(b, 1, n, dtype=half), "D": randn(1, heads), "h": randn(b, 1, heads, p, n, scale=0.5)}


def mamba2_row(update, b: int, heads: int, p: int, n: int) -> dict:
    a = mamba2_inputs(b, heads, p, n)
    step = ssmc.step(mamba2.SPEC, "cuda", layout=mamba2.LAYOUT)
    args = {k: a[k] for k in ("x", "dt", "A", "B", "C", "D")}
    y, h = step(**args, states=a["h"])
    # mamba-ssm's Mamba2.step: per-head dt, A, D repeated along p (and n) as views, x and the state by head
    state = a["h"][:, 0].clone()                                             # [b heads p n]
    x = a["x"][:, 0]                                                         # [b heads p]
    dt = a["dt"][:, 0, :, None].expand(b, heads, p)
    A = a["A"][0, :, None, None].expand(heads, p, n)
    D = a["D"][0, :, None].expand(heads, p)
    dt_bias = torch.zeros(heads, 1, device="cuda").expand(heads, p)  # zero: its tied-head path asks for one

    def peer():
        return update(state, x, dt, A, a["B"], a["C"], D=D, z=None, dt_bias=dt_bias, dt_softplus=True)
    y_peer = peer()
    errors = (rel(y[:, 0], y_peer), rel(h[:, 0], state))
    ms, host = per_call(lambda: step(**args, states=a["h"]))
    out, buffer = torch.empty_like(y), a["h"].clone()
    in_place_ms, in_place_host = per_call(lambda: step(**args, states=buffer, out=out, in_place=True))
    peer_ms, peer_host = per_call(peer)
    return {"shape": f"B{b} H{heads} P{p} N{n}", "err": errors, "ms": ms, "host": host, "in_place_ms": in_place_ms,
            "in_place_host": in_place_host, "peer_ms": peer_ms, "peer_host": peer_host}


LSTM_SHAPES = [(b, 1024, 1024) for b in (1, 16, 64)]  # (B, input, hidden)
# how ssmc's cuda backend runs an LSTM step (backends/cuda/step.py), by the overrides that pick it
LSTM_FORMS = {"products (default)": {}, "one kernel": {"SSMC_CUDA_STEP_PRODUCTS": "1"}}


def lstm_rows(b: int, inp: int, hidden: int) -> list[str]:
    """An LSTM step (fp32) two ways (`LSTM_FORMS`: x W and h U as two cuBLAS products into the step's arrays, then
    one kernel; one kernel of a thread per [b k] summing both products itself), each in place (``out=``,
    ``in_place=True``), against torch.nn.LSTMCell (the same weights)."""
    import os

    from ssmc.examples import lstm

    torch.manual_seed(b)
    cell = torch.nn.LSTMCell(inp, hidden, device="cuda")
    x, h, c = (torch.randn(b, n, device="cuda") for n in (inp, hidden, hidden))
    W = cell.weight_ih.detach().view(4, hidden, inp).permute(2, 0, 1)
    U = cell.weight_hh.detach().view(4, hidden, hidden).permute(2, 0, 1)
    bias = (cell.bias_ih + cell.bias_hh).detach().view(4, hidden)
    with torch.no_grad():
        want_h, want_c = cell(x, (h, c))
        peer_ms, peer_host = per_call(lambda: cell(x, (h, c)))
    step = ssmc.step(lstm.SPEC, "cuda", layout=lstm.LAYOUT)
    rows = []
    for form, env in LSTM_FORMS.items():
        os.environ.update(env)
        try:
            out, hb, cb = torch.empty_like(h), h.clone(), c.clone()
            step(x=x, W=W, U=U, bias=bias, states=(hb, cb), out=out, in_place=True)
            errors = (rel(hb, want_h), rel(cb, want_c))
            hb.copy_(h), cb.copy_(c)
            ms, host = per_call(lambda hb=hb, cb=cb, out=out: step(x=x, W=W, U=U, bias=bias, states=(hb, cb), out=out,
                                                                   in_place=True))
        finally:
            for name in env:
                del os.environ[name]
        rows.append(f"| B{b} I{inp} H{hidden} {form} | {errors[0]:.1e}, {errors[1]:.1e} | {ms:.4f} | {host:.4f} | "
                    f"{peer_ms:.4f} | {peer_host:.4f} | {peer_ms / ms:.2f}x |")
    return rows


def line(r: dict) -> str:
    return (f"| {r['shape']} | {r['err'][0]:.1e}, {r['err'][1]:.1e} | {r['ms']:.4f} | {r['host']:.4f} | "
            f"{r['in_place_ms']:.4f} | {r['in_place_host']:.4f} | {r['peer_ms']:.4f} | {r['peer_host']:.4f} | "
            f"{r['peer_ms'] / r['in_place_ms']:.2f}x |")


HEADER = ("| rel err y, state | ssmc ms / call | ssmc host ms | in place ms / call | in place host ms | "
          "selective_state_update ms | its host ms | peer / ssmc in place |", "|---|---|---|---|---|---|---|---|---|")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--peers", type=Path, default=BENCH.parent / "peers")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ssmc_peers"))
    ap.add_argument("--family", choices=("mamba1", "mamba2", "lstm", "all"), default="all")
    args = ap.parse_args()
    lines = []
    if args.family in ("lstm", "all"):  # no peer package: torch's own cell
        lines += ["| LSTM step fp32, in place | rel err h, c | ssmc ms / call | ssmc host ms | LSTMCell ms | "
                  "its host ms | peer / ssmc |", "|---|---|---|---|---|---|---|"]
        for shape in LSTM_SHAPES:
            lines += lstm_rows(*shape)
            print("\n".join(lines[-len(LSTM_FORMS):]), flush=True)
        lines.append("")
        if args.family == "lstm":
            args.family = "none"
    update = None if args.family == "none" else Peers(args.peers, args.work, build=False).mamba(
        "mamba_ssm.ops.triton.selective_state_update").selective_state_update
    if args.family in ("mamba1", "all"):
        lines += [f"| Mamba-1 step fp32 {HEADER[0]}", HEADER[1]]
        for b, d, n in SHAPES:
            lines.append(line(row(update, b, d, n)))
            print(lines[-1], flush=True)
        lines.append("")
    if args.family in ("mamba2", "all"):
        lines += [f"| Mamba-2 step bf16 {HEADER[0]}", HEADER[1]]
        for shape in MAMBA2_SHAPES:
            lines.append(line(mamba2_row(update, *shape)))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "decode.md").write_text(text)


if __name__ == "__main__":
    main()

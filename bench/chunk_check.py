#!/usr/bin/env python3
"""Check and time the chunked matrix-linear forward and backward on tensor cores (backends/cuda/kernels/chunk/mma.py).

    python bench/chunk_check.py [--out DIR] [--peers peers/] [--work /tmp/ssmc_peers] [--no-cores]
                                [--only ssd,retnet,gla,ssd_short,gla_vector] [--chunk-dkv split,fused,narrow]

SSD (examples/mamba2.py) at B4 L4096 H32 P64 N128 bf16, RetNet (examples/retnet.py) at B4 L4096 H16 K128
V128 bf16, simple GLA (examples/simple_gla.py, "gla": a log-decay per head and step) at the same shape against
fla's `chunk_simple_gla`, and SSD at a short sequence ("ssd_short": B32 L180 H16 P64 N64, steps 1 and 3):

1. check: ssmc's forward on the kernels against the peer (mamba-ssm's Triton `mamba_chunk_scan_combined`,
   chunk 256, from the sdist in peers/; fla's `chunk_retention`) and against ssmc's torch path
   (SSMC_CUDA_CHUNK_KERNELS=0), relative RMS error ||got - want|| / ||want||, the output and (ssmc
   sides) the final state; the kernels must be within 2e-2 of the peer;
2. time (triton.testing.do_bench, else CUDA events; median ms): the whole compiled forward on the
   kernels, on the torch path, the peer's forward; and the chunked core alone (`mma.forward` against
   `algorithm.forward` on the same chunked operands) at each chunk the kernels take (64, 128, 256),
   with each kernel's own time (CUDA events around its launch, median of 30 calls) and the bytes it
   moves at the least, as GB/s, also of an inference call's variants (state_pass_half, chunk_output_hs_ho:
   16-bit entering states and output); and the one-pass states variant (`mma.forward(x, one_pass=True)`:
   chunk_states_scan in place of chunk_states and state_pass), its time and error;
3. forward + backward (`ssmc.torch.function`, a training step's `.backward(dy)`): first every gradient
   against the peer's (autograd through the peer's Triton backward; RetNet: q, k, v, fla fixes gamma)
   and against ssmc's torch backward on the same forward (SSMC_CUDA_CHUNK_BACKWARD=0), then the times
   of ssmc on the backward kernels, ssmc with the torch backward, and the peer, and the peak memory a
   training step allocates beyond its inputs (ssmc's, the peer's); the core's backward alone (SSD, RetNet:
   `mma.backward` against `algorithm.vjp` on the same tape) with each backward kernel's time. With
   --chunk-dkv FORMS (of split, fused, narrow), 3.'s rows once per form, SSMC_CUDA_CHUNK_DKV set to it (the
   backward's chunk_dk and chunk_dv, or chunk_dkv / chunk_dkv_n for both), in one process: each row's part names
   its form.

GLA with its decay per key ("gla_vector": examples/gla.py, B4 L4096 H16 K128 V128 bf16, g = logsigmoid / 16 per
key as fla's GLA layer makes it) runs its own kernels (`mma.forward_per_key`, `backward_per_key`): `run_torch_case`
checks the call (its output and final state against fla's `chunk_gla` and against ssmc in float64, every
gradient against the peer's), then times its forward and its training step against `chunk_gla`'s
(`fused_recurrent_gla` where the chunk backward refuses), with the peak memory of each; the torch column stays
empty.

Prints each workload's rows as it finishes them, then the whole markdown table; with --out, writes it
to DIR/chunk.md. --no-cores skips 2.'s sweep of the cores alone (most of the run's time). Needs
torch, triton, cupy; the peers are installed from peers/ as bench/harness.py does (no network).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH), str(BENCH.parent)]

import ssmc  # noqa: E402
from ssmc.backends.cuda.kernels.chunk import algorithm, mma  # noqa: E402
from ssmc.examples import gla, mamba2, retnet, simple_gla  # noqa: E402

SSD = {"b": 4, "t": 4096, "g": 1, "r": 32, "p": 64, "n": 128}
SSD_SHORT = {"b": 32, "t": 180, "g": 1, "r": 16, "p": 64, "n": 64}
RETNET = {"b": 4, "t": 4096, "h": 16, "k": 128, "v": 128}
TOLERANCE = 2e-2


def timed(fn) -> float:
    """Milliseconds a call of `fn` takes (median)."""
    try:
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=200))
    except ImportError:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]


def rel(got, want) -> float:
    """‖got − want‖ / ‖want‖; where `got` has 1 on head axes `want` has more (dq, dk, which mma.backward
    sums over the heads q, k lack), `want` summed over them, against the size of its terms ‖want‖."""
    got, want = got.double(), want.double()
    axes = [i for i, (g, w) in enumerate(zip(got.shape, want.shape)) if g == 1 and w > 1]
    return float((got - (want.sum(axes, keepdim=True) if axes else want)).norm() / want.norm().clamp_min(1e-30))


class switched_off:
    """An SSMC_CUDA_* switch set to 0 for the duration."""

    def __init__(self, variable: str):
        self.variable = variable

    def __enter__(self):
        self.old = os.environ.get(self.variable)
        os.environ[self.variable] = "0"

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(self.variable, None)
        else:
            os.environ[self.variable] = self.old


def kernels_off():
    """SSMC_CUDA_CHUNK_KERNELS=0 for the duration (the torch path)."""
    return switched_off("SSMC_CUDA_CHUNK_KERNELS")


class environment_set:
    """An SSMC_CUDA_* variable set to `value` for the duration (None: left as it is)."""

    def __init__(self, variable: str, value: str | None):
        self.variable, self.value = variable, value

    def __enter__(self):
        self.old = os.environ.get(self.variable)
        if self.value is not None:
            os.environ[self.variable] = self.value

    def __exit__(self, *exc):
        if self.old is None:
            os.environ.pop(self.variable, None)
        else:
            os.environ[self.variable] = self.old


def backward_kernels_off():
    """SSMC_CUDA_CHUNK_BACKWARD=0 for the duration (the torch backward on the kernels' forward)."""
    return switched_off("SSMC_CUDA_CHUNK_BACKWARD")


def counted_kernels():
    """A list that grows by one per `mma.forward` call (the kernels ran), and the undo."""
    calls, original = [], mma.forward

    def wrapped(x, *args, **kwargs):
        calls.append(1)
        return original(x, *args, **kwargs)

    mma.forward = wrapped
    return calls, lambda: setattr(mma, "forward", original)


def ssd_inputs(g: torch.Generator, s: dict = SSD) -> dict:
    b, t, gr, r, p, n = s["b"], s["t"], s["g"], s["r"], s["p"], s["n"]

    def randn(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale + shift).to(torch.bfloat16)

    return {"x": randn(b, t, gr, r, p), "dt": randn(b, t, gr, r, shift=-1.0),
            "A": -torch.exp(torch.rand(gr, r, generator=g, device="cuda") * 2 - 1),
            "B": randn(b, t, gr, n), "C": randn(b, t, gr, n),
            "D": torch.randn(gr, r, generator=g, device="cuda")}


def retnet_inputs(g: torch.Generator) -> dict:
    s = RETNET
    b, t, h, k, v = s["b"], s["t"], s["h"], s["k"], s["v"]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    # fla's chunk_retention fixes the decays: gamma_h = 1 - 2^(-5 - h)
    return {"q": randn(b, t, h, k, scale=k ** -0.5), "k": randn(b, t, h, k, scale=k ** -0.5), "v": randn(b, t, h, v),
            "gamma": 1 - 2.0 ** (-5.0 - torch.arange(h, device="cuda", dtype=torch.float32))}


def gla_inputs(g: torch.Generator) -> dict:
    a = retnet_inputs(g)
    b, t, h = a["q"].shape[:3]
    log_decay = torch.log(1 - 2.0 ** (-5.0 - 4 * torch.rand(b, t, h, generator=g, device="cuda")))
    return {"q": a["q"], "k": a["k"], "v": a["v"], "g": log_decay.to(torch.bfloat16)}


def gla_peer(peers, a: dict):
    chunk_simple_gla = peers.module("fla.ops.simple_gla").chunk_simple_gla
    return lambda: chunk_simple_gla(a["q"], a["k"], a["v"], a["g"].float(), scale=1.0)[0]


def gla_recurrent_peer(peers, a: dict):
    """fla's fused_recurrent_simple_gla: the issue's fallback peer where chunk_simple_gla's backward refuses."""
    fused = peers.module("fla.ops.simple_gla").fused_recurrent_simple_gla
    return lambda: fused(a["q"], a["k"], a["v"], a["g"].float(), scale=1.0)[0]


def gla_vector_inputs(g: torch.Generator, s: dict = RETNET, device: str = "cuda") -> dict:
    """GLA's inputs (examples/gla.py) in bf16: q, k scaled by K ** -0.5, g = logsigmoid(x) / 16 per key (fla's
    GLA layer's gate: decays in [exp(-ln(2)/16 ...), 1), some near 1, a few strong)."""
    b, t, h, k, v = s["b"], s["t"], s["h"], s["k"], s["v"]

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(torch.bfloat16)

    gate = torch.nn.functional.logsigmoid(torch.randn(b, t, h, k, generator=g, device=device) * 4) / 16
    return {"q": randn(b, t, h, k, scale=k ** -0.5), "k": randn(b, t, h, k, scale=k ** -0.5), "v": randn(b, t, h, v),
            "g": gate.to(torch.bfloat16)}


def gla_vector_peer(peers, a: dict, final: bool = False):
    """fla's chunk_gla (g its natural-log decays per key, fp32); `final`: (output, final state [B, H, K, V])."""
    chunk_gla = peers.module("fla.ops.gla").chunk_gla
    if final:
        return lambda: chunk_gla(a["q"], a["k"], a["v"], a["g"].float(), scale=1.0, output_final_state=True)
    return lambda: chunk_gla(a["q"], a["k"], a["v"], a["g"].float(), scale=1.0)[0]


def gla_vector_recurrent_peer(peers, a: dict):
    """fla's fused_recurrent_gla: the peer of a training step where chunk_gla's backward refuses."""
    fused = peers.module("fla.ops.gla").fused_recurrent_gla
    return lambda: fused(a["q"], a["k"], a["v"], gk=a["g"].float(), scale=1.0)[0]


# a training step's peer where the first one refuses (fla's chunk backward guards against a Triton miscompile)
TRAINING_FALLBACK = {"gla": (gla_recurrent_peer, "fla fused_recurrent_simple_gla"),
                     "gla_vector": (gla_vector_recurrent_peer, "fla fused_recurrent_gla")}


def ssd_peer(peers, a: dict):
    combined = peers.mamba("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined
    b, t, g, r, p = a["x"].shape
    x, dt = a["x"].reshape(b, t, g * r, p), a["dt"].reshape(b, t, g * r)
    A, D = a["A"].reshape(g * r).float(), a["D"].reshape(g * r).float()

    def run():
        return combined(x, dt, A, a["B"], a["C"], 256, D=D, dt_softplus=True).reshape(b, t, g, r, p)
    return run


def retnet_peer(peers, a: dict):
    chunk_retention = peers.module("fla.ops.retention").chunk_retention
    return lambda: chunk_retention(a["q"], a["k"], a["v"], scale=1.0)[0]


# name: (title, spec, inputs, peer, peer's name, whether the cores alone are timed too)
CASES = {
    "ssd": ("SSD B4 L4096 H32 P64 N128 bf16", mamba2, ssd_inputs, ssd_peer, "mamba_chunk_scan_combined", True),
    "retnet": ("RetNet B4 L4096 H16 K128 V128 bf16", retnet, retnet_inputs, retnet_peer, "fla chunk_retention",
               True),
    "gla": ("simple GLA B4 L4096 H16 K128 V128 bf16", simple_gla, gla_inputs, gla_peer, "fla chunk_simple_gla",
            False),
    "ssd_short": ("SSD B32 L180 H16 P64 N64 bf16", mamba2, lambda g: ssd_inputs(g, SSD_SHORT), ssd_peer,
                  "mamba_chunk_scan_combined", False),
}
# workloads timed through the spec's call alone (a decay per key: its own kernels, `mma.forward_per_key`;
# `run_torch_case`), as CASES
TORCH_CASES = {
    "gla_vector": ("GLA (a decay per key) B4 L4096 H16 K128 V128 bf16", gla, gla_vector_inputs, gla_vector_peer,
                   "fla chunk_gla", False),
}


def peak_mib(step) -> float:
    """MiB a call of `step` allocates at its peak beyond what was allocated before it."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def kernel_times(x: algorithm.Chunks, reps: int = 30, one_pass: bool | None = None, call=None) -> dict[str, float]:
    """Each kernel of `mma.forward(x)` (or of ``call(events)``): median milliseconds over `reps` calls
    (CUDA events)."""
    if call is None:
        def call(events):
            return mma.forward(x, events=events, one_pass=one_pass)
    for _ in range(3):
        call(None)
    runs = []
    for _ in range(reps):
        events: list = []
        call(events)
        runs.append(events)
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for events in runs:
        for name, start, end in events:
            times.setdefault(name, []).append(start.elapsed_time(end))
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def kernel_bytes(x: algorithm.Chunks) -> dict[str, int]:
    """The least bytes each kernel moves through HBM (every operand and state read or written once per
    block that needs it: chunk_output reads q, k once per value tile)."""
    heads = torch.broadcast_shapes(x.q.shape[:-3], x.v.shape[:-3], x.ell.shape[:-2])
    nh = int(torch.tensor(heads).prod()) if heads else 1
    nc, c, key, value = x.q.shape[-3], x.q.shape[-2], x.q.shape[-1], x.v.shape[-1]
    steps = nc * c
    qk = steps * key * 2 * nh                     # one of q, k over all heads (as read, not as stored)
    vv = steps * value * 2 * nh
    ell = steps * 4 * nh
    states = nh * nc * key * value * 4
    tiles_v = value // 64
    output = 2 * qk * tiles_v + vv + ell
    return {"chunk_states": qk * tiles_v + vv * (key // 64) + ell + states,
            "chunk_states_scan": qk * tiles_v + vv * (key // 64) + ell + states + 2 * nh * key * value * 4,
            "state_pass": 2 * states + nh * key * value * 8,
            "state_pass_half": states + states // 2 + nh * key * value * 8,
            "chunk_output": output + states + steps * value * 4 * nh,
            "chunk_output_ho": output + states + steps * value * 2 * nh,
            "chunk_output_hs": output + states // 2 + steps * value * 4 * nh,
            "chunk_output_hs_ho": output + states // 2 + steps * value * 2 * nh,
            # the balanced and staged forms: the same bytes (the wide one reads k once: less)
            **{name + form: b for form in ("_b", "_s") for name, b in (
                ("chunk_output", output + states + steps * value * 4 * nh),
                ("chunk_output_ho", output + states + steps * value * 2 * nh),
                ("chunk_output_hs", output + states // 2 + steps * value * 4 * nh),
                ("chunk_output_hs_ho", output + states // 2 + steps * value * 2 * nh))},
            # the entering states written once
            "chunk_states_pass": qk * tiles_v + vv * (key // 64) + ell + states + 2 * nh * key * value * 4,
            "chunk_states_pass_half": qk * tiles_v + vv * (key // 64) + ell + states // 2 + 2 * nh * key * value * 4}


def core_chunks(name: str, g: torch.Generator, c: int = mma.CHUNK) -> algorithm.Chunks:
    """Random chunked operands of the workload's core at chunk `c` (SSD: q, k shared by the heads; its
    β = softplus(dt) per step and head, and D per head as the skip, as the compiled call's core reads them)."""
    if name == "ssd":
        b, r, p, n, t = SSD["b"], SSD["r"], SSD["p"], SSD["n"], SSD["t"]
        heads_qk, heads_v, key, value = (b, 1), (b, r), n, p
    else:
        b, h, key, value, t = RETNET["b"], RETNET["h"], RETNET["k"], RETNET["v"], RETNET["t"]
        heads_qk = heads_v = (b, h)
    nc = t // c

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(torch.bfloat16)

    q, k = randn(*heads_qk, nc, c, key, scale=key ** -0.5), randn(*heads_qk, nc, c, key)
    v = randn(*heads_v, nc, c, value)
    ell = -torch.rand(*heads_v, nc, c, generator=g, device="cuda") * 0.1
    s0 = torch.zeros(*heads_v, key, value, device="cuda")
    if name != "ssd":
        return algorithm.Chunks(q, k, v, ell, s0)
    beta = torch.rand(*heads_v, nc, c, generator=g, device="cuda") + 0.1
    skip = torch.randn(1, heads_v[1], 1, 1, generator=g, device="cuda").expand(*heads_v, nc, c)
    return algorithm.Chunks(q, k, v, ell, s0, beta, skip)


def counted_backward():
    """A list that grows by one per `mma.backward` call (the backward kernels ran), and the undo."""
    calls, original = [], mma.backward

    def wrapped(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    mma.backward = wrapped
    return calls, lambda: setattr(mma, "backward", original)


# gradients held to TOLERANCE against the peer's; the decays' (sums over every step of differences) to this
DECAY_TOLERANCE = 5e-2


def training_rows(name: str, spec, layout, a: dict, peers, g: torch.Generator) -> list[dict]:
    """The forward + backward rows (module docstring, 3.)."""
    import ssmc.torch

    title, _, _, make_peer, peer, cores = CASES[name]
    tfn = ssmc.torch.function(spec, layout=layout)
    leaves = {k: (v.detach().clone().requires_grad_(True) if v.is_floating_point() else v) for k, v in a.items()}
    peer_leaves = {k: v.detach().clone().requires_grad_(True) for k, v in leaves.items()}
    dy = torch.randn(tfn(**leaves).shape, generator=g, device="cuda").to(torch.bfloat16)

    def train(fn, inputs):
        def step():
            for v in inputs.values():
                v.grad = None
            fn(**inputs).backward(dy)
        return step

    def grads(inputs):
        return {k: v.grad.detach().clone() for k, v in inputs.items() if v.grad is not None}

    ssmc_step = train(tfn, leaves)
    calls, undo = counted_backward()
    try:
        ssmc_step()
        if not calls:
            raise RuntimeError("the backward kernels did not run (see mma.backward_applies)")
        got = grads(leaves)
        with backward_kernels_off():
            ssmc_step()
            torch_bwd = grads(leaves)
        checks: dict = {}
        ok = True
        decays = {"dt", "A", "gamma", "g"}
        for k, v in got.items():
            checks[f"d{k} vs torch backward"] = e = rel(v, torch_bwd[k])
            ok &= e < (DECAY_TOLERANCE if k in decays else TOLERANCE)
        peer_step = None
        candidates = [(make_peer, peer), *([TRAINING_FALLBACK[name]] if name in TRAINING_FALLBACK else [])]
        for make, peer_name in candidates:
            try:
                run = make(peers, peer_leaves)

                def peer_step(run=run):
                    for v in peer_leaves.values():
                        v.grad = None
                    run().backward(dy)
                peer_step()
                want = grads(peer_leaves)
                for k, w in want.items():
                    checks[f"d{k} vs {peer_name}"] = e = rel(got[k], w)
                    ok &= e < (DECAY_TOLERANCE if k in decays else TOLERANCE)
                peer = peer_name
                break
            except Exception as err:
                checks[f"{peer_name}"] = f"unavailable: {type(err).__name__}: {err}"[:200]
                peer_step = None
        t_kernels = timed(ssmc_step)
        with backward_kernels_off():
            t_torch = timed(ssmc_step)
        t_peer = timed(peer_step) if peer_step is not None else None
        checks["peak MiB ssmc"] = f"{peak_mib(ssmc_step):.0f}"
        if peer_step is not None:
            checks["peak MiB peer"] = f"{peak_mib(peer_step):.0f}"
        if not cores:
            return [{"workload": title, "what": "forward + backward (torch column: SSMC_CUDA_CHUNK_BACKWARD=0)",
                     "kernels": t_kernels, "torch": t_torch, "peer": t_peer, "peer_name": peer, "checks": checks,
                     "ok": ok}]
        # the core's backward alone, at the default chunk
        x = core_chunks(name, g)
        out, entering, final = mma.forward(x)
        d_out = torch.randn(out.shape, generator=g, device="cuda").to(x.q.dtype)
        d_final = torch.zeros_like(final)
        t_core = timed(lambda: mma.backward(x, entering, final, d_out, d_final))
        t_core_torch = timed(lambda: algorithm.vjp(x, entering, final, d_out.float(), d_final))
        errs = [rel(a_, b_) for a_, b_ in zip(mma.backward(x, entering, final, d_out, d_final),
                                              algorithm.vjp(x, entering, final, d_out.float(), d_final))
                if b_ is not None]  # dbeta, dskip: None without β, without a skip
        parts = {"errors dq, dk, dv, dell, ds0 (dbeta, dskip) vs torch vjp": ", ".join(f"{e:.1e}" for e in errs)}
        for k, t in kernel_times(x, call=lambda ev: mma.backward(x, entering, final, d_out, d_final,
                                                                   events=ev)).items():
            parts[k] = f"{t:.3f} ms"
    finally:
        undo()
    return [{"workload": title, "what": "forward + backward (torch column: SSMC_CUDA_CHUNK_BACKWARD=0)",
             "kernels": t_kernels, "torch": t_torch, "peer": t_peer, "peer_name": peer, "checks": checks, "ok": ok},
            {"workload": title, "what": f"core backward only (chunk {x.q.shape[-2]})", "kernels": t_core,
             "torch": t_core_torch, "peer": None, "peer_name": "", "checks": parts,
             "ok": max(errs) < TOLERANCE}]


def run_case(name: str, peers, g: torch.Generator, cores_too: bool = True,
             dkv_forms: tuple[str | None, ...] = (None,)) -> list[dict]:
    title, example, make_inputs, make_peer, peer, cores = CASES[name]
    spec, layout = example.SPEC, example.LAYOUT
    a = make_inputs(g)
    fn = ssmc.compile(spec, layout=layout, backend="cuda")
    rows = []
    calls, undo = counted_kernels()
    try:
        y, final = fn(**a, return_final_states=True)
        if not calls:
            raise RuntimeError("the chunked kernels did not run (see mma.kernels_apply)")
        with kernels_off():
            y_torch, final_torch = fn(**a, return_final_states=True)
        checks = {"vs torch path: output": rel(y, y_torch), "vs torch path: final state": rel(final, final_torch)}
        peer_run = None
        try:
            peer_run = make_peer(peers, a)
            checks["vs peer: output"] = rel(y, peer_run())
        except Exception as err:  # a peer that does not import or run: reported, the rest goes on
            checks["peer"] = f"unavailable: {type(err).__name__}: {err}"[:200]
        ok = all(isinstance(v, str) or v < TOLERANCE for v in checks.values())
        t_kernels = timed(lambda: fn(**a, return_final_states=True))
        with kernels_off():
            t_torch = timed(lambda: fn(**a))
        t_peer = timed(peer_run) if peer_run is not None else None
        cores = []
        for c in mma.CHUNKS if cores_too and cores else ():
            x = core_chunks(name, g, c)
            assert mma.kernels_apply(x)
            t_core = timed(lambda x=x: mma.forward(x))
            t_core_torch = timed(lambda x=x: algorithm.forward(x))
            core_err = rel(mma.forward(x)[0], algorithm.forward(x)[0])
            moved = kernel_bytes(x)
            parts = {}
            for one_pass in (False, True):
                for k, t in kernel_times(x, one_pass=one_pass).items():
                    parts[k] = f"{t:.3f} ms, {moved[k] / t / 1e6:.0f} GB/s"
            # an inference call's kernels: the entering states and the output in 16 bits
            for k, t in kernel_times(x, call=lambda ev, x=x: mma.forward(x, events=ev, half_states=True,
                                                                         out_dtype=x.q.dtype)).items():
                parts[k] = f"{t:.3f} ms, {moved[k] / t / 1e6:.0f} GB/s"
            t_half = timed(lambda x=x: mma.forward(x, half_states=True, out_dtype=x.q.dtype))
            half_err = rel(mma.forward(x, half_states=True, out_dtype=x.q.dtype)[0], algorithm.forward(x)[0])
            parts["16-bit states and output (inference)"] = f"{t_half:.3f} ms, error {half_err:.1e}"
            one_err = rel(mma.forward(x, one_pass=True)[0], algorithm.forward(x)[0])
            t_one = timed(lambda x=x: mma.forward(x, one_pass=True))
            parts["one pass (chunk_states_scan)"] = f"{t_one:.3f} ms, error {one_err:.1e}"
            cores.append((c, t_core, t_core_torch, core_err, parts))
    finally:
        undo()
    rows.append({"workload": title, "what": "forward", "kernels": t_kernels, "torch": t_torch, "peer": t_peer,
                 "peer_name": peer, "checks": checks, "ok": ok})
    for c, t_core, t_core_torch, core_err, parts in cores:
        rows.append({"workload": title, "what": f"core only (chunk {c})", "kernels": t_core, "torch": t_core_torch,
                     "peer": None, "peer_name": "", "checks": {"kernels vs torch core: output": core_err, **parts},
                     "ok": core_err < TOLERANCE})
    for form in dkv_forms:  # (None: SSMC_CUDA_CHUNK_DKV as the environment has it)
        with environment_set("SSMC_CUDA_CHUNK_DKV", form):
            rows += [dict(r, what=r["what"] + ("" if form is None else f", SSMC_CUDA_CHUNK_DKV={form}"))
                     for r in training_rows(name, spec, layout, a, peers, g)]
    return rows


def run_torch_case(name: str, peers, g: torch.Generator, sizes: dict | None = None, device: str = "cuda"
                   ) -> list[dict]:
    """A workload of TORCH_CASES (module docstring): rows as `run_case`'s, the torch column None. `sizes`,
    `device`: another shape and device than the workload's (a check of this function on the CPU)."""
    import ssmc.torch

    title, example, make_inputs, make_peer, peer, _ = TORCH_CASES[name]
    spec, layout = example.SPEC, example.LAYOUT
    a = make_inputs(g) if sizes is None else make_inputs(g, sizes, device)
    fn = ssmc.compile(spec, layout=layout, backend="cuda")
    ran, original = [], mma.forward_per_key
    mma.forward_per_key = lambda *args, **kw: (ran.append(1), original(*args, **kw))[1]
    try:
        y, final = fn(**a, return_final_states=True)
    finally:
        mma.forward_per_key = original
    if not ran and device == "cuda":
        raise RuntimeError("the per-key kernels did not run (see mma.per_key_applies, ChunkedCore)")
    print(f"{name}: forward ran; the float64 check of the first batch row", flush=True)
    exact = ssmc.compile(spec, layout=layout, backend="cuda", dtype="float64")
    y64, final64 = exact(**{k: v[:1].double() for k, v in a.items()}, return_final_states=True)
    checks: dict = {"vs float64 (batch row 0): output": rel(y[:1], y64),
                    "vs float64 (batch row 0): final state": rel(final[:1], final64)}
    print(f"{name}: {checks}; the peer's forward", flush=True)
    peer_run = None
    try:
        # the final state too, as the check's call: another specialization of the peer's kernels would autotune
        # (compile) them all again inside the timing
        peer_run = make_peer(peers, a, final=True)
        y_peer, final_peer = peer_run()
        checks["vs peer: output"] = rel(y, y_peer)
        checks["vs peer: final state"] = rel(final, final_peer)
    except Exception as err:  # a peer that does not import or run: reported, the rest goes on
        checks["peer"] = f"unavailable: {type(err).__name__}: {err}"[:200]
        peer_run = None
    ok = all(isinstance(v, str) or v < TOLERANCE for v in checks.values())
    print(f"{name}: {checks}; timing the forwards, then the training step", flush=True)
    t_kernels = timed(lambda: fn(**a, return_final_states=True))
    print(f"{name}: ssmc's forward {t_kernels:.3f} ms; the peer's", flush=True)
    t_peer = timed(peer_run) if peer_run is not None else None
    print(f"{name}: the peer's forward {t_peer} ms", flush=True)
    rows = [{"workload": title, "what": "forward", "kernels": t_kernels, "torch": None, "peer": t_peer,
             "peer_name": peer, "checks": checks, "ok": ok}]

    # a training step: every gradient against the peer's, then times and peak memory
    tfn = ssmc.torch.function(spec, layout=layout)
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in a.items()}
    peer_leaves = {k: v.detach().clone().requires_grad_(True) for k, v in a.items()}
    dy = torch.randn(y.shape, generator=g, device=y.device).to(torch.bfloat16)

    def step():
        for v in leaves.values():
            v.grad = None
        tfn(**leaves).backward(dy)
    ran, original = [], mma.backward_per_key
    mma.backward_per_key = lambda *args, **kw: (ran.append(1), original(*args, **kw))[1]
    try:
        step()
    finally:
        mma.backward_per_key = original
    if not ran and device == "cuda":
        raise RuntimeError("the per-key backward kernels did not run (see mma.per_key_backward_applies)")
    got = {k: v.grad.detach().clone() for k, v in leaves.items()}
    checks, ok, peer_step, peer_name = {}, True, None, peer
    for make, candidate in [(make_peer, peer), TRAINING_FALLBACK[name]]:
        try:
            run = make(peers, peer_leaves)

            def peer_step(run=run):
                for v in peer_leaves.values():
                    v.grad = None
                run().backward(dy)
            peer_step()
            for k, v in peer_leaves.items():
                checks[f"d{k} vs {candidate}"] = e = rel(got[k], v.grad)
                ok &= e < (DECAY_TOLERANCE if k == "g" else TOLERANCE)
            peer_name = candidate
            break
        except Exception as err:
            checks[candidate] = f"unavailable: {type(err).__name__}: {err}"[:200]
            peer_step = None
    print(f"{name}: gradients {checks}; timing the training steps", flush=True)
    t_step = timed(step)
    print(f"{name}: ssmc's training step {t_step:.3f} ms", flush=True)
    t_peer_step = timed(peer_step) if peer_step is not None else None
    checks["peak MiB ssmc"] = f"{peak_mib(step):.0f}"
    if peer_step is not None:
        checks["peak MiB peer"] = f"{peak_mib(peer_step):.0f}"
    rows.append({"workload": title, "what": "forward + backward", "kernels": t_step, "torch": None,
                 "peer": t_peer_step, "peer_name": peer_name, "checks": checks, "ok": ok})
    return rows


def table(rows: list[dict]) -> str:
    def ms(v):
        return "-" if v is None else f"{v:.3f}"

    def ratio(a, b):
        return "-" if a is None or b is None else f"{a / b:.2f}x"

    lines = ["| workload | part | ssmc kernels ms | ssmc torch path ms | peer ms | peer / kernels | torch / kernels "
             "| check |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        checks = "; ".join(f"{k} {v:.1e}" if not isinstance(v, str) else f"{k}: {v}" for k, v in r["checks"].items())
        lines.append(f"| {r['workload']} | {r['what']} | {ms(r['kernels'])} | {ms(r['torch'])} | "
                     f"{ms(r['peer'])} {r['peer_name']} | {ratio(r['peer'], r['kernels'])} | "
                     f"{ratio(r['torch'], r['kernels'])} | {'ok' if r['ok'] else 'FAILED'}: {checks} |")
    return "\n".join(lines) + "\n"


def tuned_note() -> str:
    """The chunks SSMC_CUDA_CHUNK_TUNE=1 chose in this run (kernels/chunk/tune.py), with the times it took."""
    from ssmc.backends.cuda.kernels.chunk import tune

    lines = [f"- {heads} heads, L {length}, state {key} x {value}: chunk {chunk} ("
             + ", ".join(f"{c}: {ms:.3f} ms" for c, ms in times.items()) + ")"
             for (_, _, _, heads, key, value, length), (chunk, times) in tune._chosen.items()]
    return "\n\nChunks tuned in this run:\n" + "\n".join(lines) + "\n" if lines else ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write DIR/chunk.md")
    ap.add_argument("--peers", type=Path, default=BENCH.parent / "peers")
    ap.add_argument("--work", type=Path, default=Path("/tmp/ssmc_peers"))
    ap.add_argument("--only", default=",".join([*CASES, *TORCH_CASES]))
    ap.add_argument("--no-cores", action="store_true",
                    help="skip the cores alone at every chunk (the whole calls' forward and forward + backward only)")
    ap.add_argument("--chunk-dkv", default="",
                    help="the training rows once per SSMC_CUDA_CHUNK_DKV form (split, fused, narrow; comma-separated)")
    args = ap.parse_args()
    forms = tuple(f for f in args.chunk_dkv.split(",") if f) or (None,)
    if any(f not in ("split", "fused", "narrow") for f in forms if f is not None):
        ap.error(f"--chunk-dkv {args.chunk_dkv!r}: forms of split, fused, narrow")
    from harness import Peers

    peers = Peers(args.peers, args.work, build=False)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows, failed = [], False
    for name in args.only.split(","):
        try:
            done = (run_torch_case(name, peers, g) if name in TORCH_CASES
                    else run_case(name, peers, g, cores_too=not args.no_cores, dkv_forms=forms))
            rows += done
            print(table(done), flush=True)  # as it goes: a run cut short by a time limit still shows these
        except Exception:
            failed = True
            traceback.print_exc()
            rows.append({"workload": name, "what": "error", "kernels": None, "torch": None, "peer": None,
                         "peer_name": "", "checks": {"error": traceback.format_exc().splitlines()[-1][:200]},
                         "ok": False})
    text = (f"# Chunked matrix-linear forward and backward: mma.sync kernels\n\n{torch.cuda.get_device_name()}, torch "
            f"{torch.__version__}\n\n" + table(rows) + "\n" + "\n".join(peers.notes) + tuned_note())
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "chunk.md").write_text(text)
    return 1 if failed or not all(r["ok"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Matrix linear recurrences: Mamba-2 (SSD) and RetNet, whose states are matrices per head.

    mamba2(_fp32)  examples/mamba2.py, "b t ..."   vs mamba-ssm's mamba_chunk_scan_combined (Triton, chunk 256)
    retnet(_fp32)  examples/retnet.py, "b t ..."   vs fla's chunk_retention (Triton)

The peers' chunked kernels run on tensor cores; ssmc's path is its chunked core as batched torch
matrix products (backends/cuda/kernels/chunk/) until its generated kernels land (docs/performance.md).
"""

from __future__ import annotations

import torch

from ssmc.examples import mamba2, retnet

from . import Side, Workload, autograd_side, cuda_only, randn, ssmc_sides, uniform

MAMBA2_KEYS = ("x", "dt", "A", "B", "C", "D")
RETNET_KEYS = ("q", "k", "v")


def _mamba2_inputs(sizes, device, dtype, g):
    b, t, gr, r, p, n = sizes["b"], sizes["t"], sizes["g"], sizes["r"], sizes["p"], sizes["n"]
    values = {
        "x": randn((b, t, gr, r, p), device, g),
        "dt": randn((b, t, gr, r), device, g, shift=-1.0),
        "A": -torch.exp(uniform((gr, r), device, g, -1.0, 1.0)),
        "B": randn((b, t, gr, n), device, g),
        "C": randn((b, t, gr, n), device, g),
        "D": randn((gr, r), device, g),
    }
    return {k: v.to(dtype) for k, v in values.items()}


def _mamba2_peer(peers, device: str) -> Side:
    cuda_only(device, "mamba-ssm's Triton kernels")
    combined = peers.mamba("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined

    def heads(v):  # ssmc's heads are (g, r), g major: mamba-ssm's head h is in group h // r
        b, t, g, r, p = v["x"].shape
        return {"x": v["x"].reshape(b, t, g * r, p), "dt": v["dt"].reshape(b, t, g * r),
                "A": v["A"].reshape(g * r).float(), "B": v["B"], "C": v["C"], "D": v["D"].reshape(g * r).float(),
                "shape": (b, t, g, r, p)}

    def run(a):
        y = combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 256, D=a["D"], dt_softplus=True)
        return y.reshape(a["shape"])

    return autograd_side("mamba-ssm mamba_chunk_scan_combined", run, MAMBA2_KEYS, prepare=heads)


def _retnet_inputs(sizes, device, dtype, g):
    b, t, h, k, v = sizes["b"], sizes["t"], sizes["h"], sizes["k"], sizes["v"]
    values = {
        "q": randn((b, t, h, k), device, g),
        "k": randn((b, t, h, k), device, g, scale=k ** -0.5),
        "v": randn((b, t, h, v), device, g),
        # fla's chunk_retention fixes the decays: gamma_h = 1 - 2^(-5 - h)
        "gamma": 1 - 2.0 ** (-5.0 - torch.arange(h, device=device, dtype=torch.float32)),
    }
    # gamma stays fp32: in bf16, 1 - 2^-9 and closer decays round to 1
    return {name: x if name == "gamma" else x.to(dtype) for name, x in values.items()}


def _retnet_peer(peers, device: str) -> Side:
    cuda_only(device, "fla (Triton)")
    chunk_retention = peers.module("fla.ops.retention").chunk_retention
    # scale 1: examples/retnet.py reads y = S^T q with q as given
    return autograd_side("fla chunk_retention", lambda a: chunk_retention(a["q"], a["k"], a["v"], scale=1.0)[0],
                         RETNET_KEYS)


def _mamba2(name: str, sizes: dict[str, int], tiny: dict[str, int], dtype: torch.dtype) -> Workload:
    return Workload(
        name=name, family="matrix", title="Mamba-2 SSD B{b} L{t} H{r} P{p} N{n} G{g}", sizes=sizes,
        tiny=tiny, build=_mamba2_inputs,
        ssmc=lambda backend: ssmc_sides(mamba2.SPEC, mamba2.LAYOUT, backend, MAMBA2_KEYS),
        peer=_mamba2_peer, peer_name="mamba-ssm mamba_chunk_scan_combined", compare=MAMBA2_KEYS, dtype=dtype,
        # the peer's Triton products of fp32 inputs run in TF32 (tl.dot's default): 1.8e-3 from float64 in grad A
        tolerance=5e-2 if dtype == torch.bfloat16 else 5e-3)


def _retnet(name: str, sizes: dict[str, int], tiny: dict[str, int], dtype: torch.dtype) -> Workload:
    return Workload(
        name=name, family="matrix", title="RetNet B{b} L{t} H{h} K{k} V{v}", sizes=sizes,
        tiny=tiny, build=_retnet_inputs,
        ssmc=lambda backend: ssmc_sides(retnet.SPEC, retnet.LAYOUT, backend, RETNET_KEYS),
        peer=_retnet_peer, peer_name="fla chunk_retention", compare=RETNET_KEYS, dtype=dtype,
        tolerance=5e-2 if dtype == torch.bfloat16 else 1e-3)


WORKLOADS = [
    _mamba2("mamba2", {"b": 4, "t": 4096, "g": 1, "r": 32, "p": 64, "n": 128},
            {"b": 1, "t": 33, "g": 1, "r": 2, "p": 4, "n": 8}, torch.bfloat16),
    _mamba2("mamba2_fp32", {"b": 2, "t": 1024, "g": 1, "r": 8, "p": 64, "n": 64},
            {"b": 2, "t": 21, "g": 2, "r": 2, "p": 3, "n": 5}, torch.float32),
    _retnet("retnet", {"b": 4, "t": 4096, "h": 16, "k": 128, "v": 128}, {"b": 1, "t": 33, "h": 2, "k": 8, "v": 8},
            torch.bfloat16),
    _retnet("retnet_fp32", {"b": 2, "t": 1024, "h": 4, "k": 64, "v": 64}, {"b": 2, "t": 21, "h": 3, "k": 5, "v": 6},
            torch.float32),
]

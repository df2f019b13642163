"""Softmax attention over keys: causal, and causal with an ALiBi bias.

    causal  ssmc.attention(mask_mod=ssmc.causal), "b h t ..."   vs torch SDPA (is_causal: the flash backend)
    alibi   examples/alibi_attention.py, "b h t ..."            vs torch SDPA with the bias as a tensor

ssmc runs attention on its interpreter until its GPU kernels land (``ssmc_gpu=False``): on a GPU the
harness checks SDPA against ssmc at the tiny sizes on the CPU, and times SDPA alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ssmc
from ssmc.examples import alibi_attention

from . import Workload, autograd_side, randn, ssmc_sides

KEYS = ("q", "k", "v")
CAUSAL = ssmc.attention(mask_mod=ssmc.causal, batch="b h", head_dim="d", name="causal")


def _inputs(with_slope: bool):
    def build(sizes, device, dtype, g):
        shape = (sizes["b"], sizes["h"], sizes["t"], sizes["d"])
        values = {name: randn(shape, device, g).to(dtype) for name in KEYS}
        if with_slope:  # ALiBi's geometric slopes, one per head
            h = sizes["h"]
            values["slope"] = 2.0 ** (-8.0 * torch.arange(1, h + 1, device=device, dtype=torch.float32) / h)
        return values

    return build


def _causal_peer(peers, device: str):
    return autograd_side("torch SDPA (is_causal)",
                         lambda a: F.scaled_dot_product_attention(a["q"], a["k"], a["v"], is_causal=True), KEYS)


def _with_bias(a):
    """The leaves and the ALiBi bias as SDPA takes it: -slope[h] (i - j) where j <= i, -inf after."""
    t = a["q"].shape[2]
    pos = torch.arange(t, device=a["q"].device)
    distance = (pos[:, None] - pos[None, :]).to(torch.float32)
    bias = -a["slope"].detach().float()[:, None, None] * distance
    bias = bias.masked_fill(distance < 0, float("-inf")).to(a["q"].dtype)
    return {**a, "bias": bias[None]}


def _alibi_peer(peers, device: str):
    return autograd_side("torch SDPA (ALiBi bias tensor)",
                         lambda a: F.scaled_dot_product_attention(a["q"], a["k"], a["v"], attn_mask=a["bias"]),
                         KEYS, prepare=_with_bias)


def _attention(name: str, spec, layout: str, with_slope: bool, peer, title: str) -> Workload:
    return Workload(
        name=name, family="attention", title=title + " B{b} H{h} L{t} d{d}",
        sizes={"b": 4, "h": 16, "t": 4096, "d": 128}, tiny={"b": 1, "h": 2, "t": 17, "d": 8},
        build=_inputs(with_slope), ssmc=lambda backend: ssmc_sides(spec, layout, backend, KEYS, op=False),
        peer=peer, peer_name="torch SDPA", compare=KEYS, dtype=torch.bfloat16, tolerance=2e-2, ssmc_gpu=False)


WORKLOADS = [
    _attention("causal", CAUSAL, "b h t ...", False, _causal_peer, "causal attention"),
    _attention("alibi", alibi_attention.SPEC, alibi_attention.LAYOUT, True, _alibi_peer, "causal attention + ALiBi"),
]

"""Softmax attention over keys: causal, causal with an ALiBi bias, a sliding window.

    causal  ssmc.attention(mask_mod=ssmc.causal), "b h t ..."          vs torch SDPA (is_causal: flash)
    alibi   examples/alibi_attention.py, "b h t ..."                   vs FlexAttention (torch.compile, block mask)
    window  ssmc.attention(mask_mod=ssmc.sliding_window(512))          vs FlexAttention (torch.compile, block mask)

ssmc runs attention through its tiled torch path (ssmc/backends/tiled_attention.py: a loop over
blocks of queries, matrix products and elementwise ops through torch, keys outside the mask's spans
skipped) until its generated kernels land; its sides are `ssmc.compile` / `ssmc.grad` and the
`ssmc.torch` function. FlexAttention needs a GPU (its peers are unavailable in the CPU dry run).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ssmc
from ssmc.examples import alibi_attention

from . import Unavailable, Workload, autograd_side, cuda_only, randn, ssmc_sides

KEYS = ("q", "k", "v")
WINDOW = 512
CAUSAL = ssmc.attention(mask_mod=ssmc.causal, batch="b h", head_dim="d", name="causal")
SLIDING = ssmc.attention(mask_mod=ssmc.sliding_window(WINDOW), batch="b h", head_dim="d", name="sliding_window")
NOTE = ("ssmc runs its tiled torch path (backends/tiled_attention.py), not generated kernels: "
        "torch matrix products per block of queries")


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


def _flex():
    """(torch.compile'd flex_attention, create_block_mask), or `Unavailable`."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as err:
        raise Unavailable(f"torch {torch.__version__} has no FlexAttention ({err})") from None
    return torch.compile(flex_attention), create_block_mask


def _causal_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _window_mask(b, h, q_idx, kv_idx):
    return (kv_idx <= q_idx) & (q_idx - kv_idx < WINDOW)


def _flex_peer(mask_mod, with_slope: bool):
    """FlexAttention with `mask_mod` as its block mask (built untimed) and, `with_slope`, ALiBi's bias
    ``score - slope[h] * (q_idx - kv_idx)`` as its score_mod (the slopes not differentiated: the
    comparison is of q, k and v)."""
    def peer(peers, device: str):
        cuda_only(device, "FlexAttention")
        attend, create_block_mask = _flex()

        def prepare(a):
            t = a["q"].shape[2]
            block_mask = create_block_mask(mask_mod, None, None, t, t, device=a["q"].device)
            score_mod = None
            if with_slope:
                slope = a["slope"].detach()

                def score_mod(score, b, h, q_idx, kv_idx):
                    return score - slope[h] * (q_idx - kv_idx)
            return {**a, "block_mask": block_mask, "score_mod": score_mod}

        return autograd_side(
            "FlexAttention (torch.compile, block mask)",
            lambda a: attend(a["q"], a["k"], a["v"], score_mod=a["score_mod"], block_mask=a["block_mask"]),
            KEYS, prepare=prepare)

    return peer


def _attention(name: str, spec, layout: str, with_slope: bool, peer, peer_name: str, title: str) -> Workload:
    return Workload(
        name=name, family="attention", title=title + " B{b} H{h} L{t} d{d}",
        sizes={"b": 4, "h": 16, "t": 4096, "d": 128}, tiny={"b": 1, "h": 2, "t": 17, "d": 8},
        build=_inputs(with_slope), ssmc=lambda backend: ssmc_sides(spec, layout, backend, KEYS),
        peer=peer, peer_name=peer_name, compare=KEYS, dtype=torch.bfloat16, tolerance=2e-2, notes=[NOTE])


WORKLOADS = [
    _attention("causal", CAUSAL, "b h t ...", False, _causal_peer, "torch SDPA", "causal attention"),
    _attention("alibi", alibi_attention.SPEC, alibi_attention.LAYOUT, True, _flex_peer(_causal_mask, True),
               "FlexAttention", "causal attention + ALiBi"),
    _attention("window", SLIDING, "b h t ...", False, _flex_peer(_window_mask, False), "FlexAttention",
               f"sliding window {WINDOW}"),
]

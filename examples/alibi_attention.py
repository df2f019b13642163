"""Causal softmax attention with an ALiBi bias (softmax-over-keys family).

    s[i, j] = (q_i . k_j) / sqrt(d) - slope * (i - j)        for j <= i, -inf for j > i
    out_i   = sum_j softmax_j(s[i, :]) v_j

per batch index b and head h, with one slope per head. As a plain loop: for each (b, h, i), take
the scores of keys 0..i, subtract slope[h] * (i - j), softmax them, and average v with those weights.

Layout ``"b h t ..."``: q and k ``[b h t d]``, v ``[b h t d]``, out ``[b h t d]``; param slope ``[h]``.
"""

from __future__ import annotations

import numpy as np

import ssmc


def alibi(score, q_idx, kv_idx, slope: ssmc.Param["h"]):
    return score - slope * (q_idx - kv_idx)


SPEC = ssmc.attention(score_mod=alibi, mask_mod=ssmc.causal, batch="b h", head_dim="d")
LAYOUT = "b h t ..."
FAMILY = "softmax over keys"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, heads: int = 4, dim: int = 8) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT): q, k, v and the per-head ALiBi slopes."""
    return {
        "q": rng.standard_normal((batch, heads, length, dim)),
        "k": rng.standard_normal((batch, heads, length, dim)),
        "v": rng.standard_normal((batch, heads, length, dim)),
        "slope": 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads),   # ALiBi's geometric slopes
    }


def reference(q, k, v, slope):
    """Plain NumPy, written without ssmc: returns out [b h t d]."""
    batch, heads, length, dim = q.shape
    out = np.empty((batch, heads, length, v.shape[-1]))
    pos = np.arange(length)
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                keys = pos[: i + 1]
                s = k[b, h, : i + 1] @ q[b, h, i] / np.sqrt(dim) - slope[h] * (i - keys)
                w = np.exp(s - s.max())
                out[b, h, i] = (w / w.sum()) @ v[b, h, : i + 1]
    return out


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    out = SPEC.compile(layout=LAYOUT)(**inputs)
    err = np.abs(out - reference(**inputs)).max()
    print(f"alibi_attention: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

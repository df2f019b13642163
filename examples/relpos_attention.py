"""Causal softmax attention with a learned relative-position bias table (T5 style, softmax-over-keys family).

    s[i, j] = (q_i . k_j) / sqrt(d) + table[h, min(i - j, R - 1)]        for j <= i, -inf for j > i
    out_i   = sum_j softmax_j(s[i, :]) v_j

per batch index b and head h, with R learned biases per head: distances 0 .. R - 2 each their own entry, every
distance from R - 1 on sharing the last (T5's buckets, with a bucket per distance up to the cap). As a plain
loop: for each (b, h, i), take the scores of keys 0..i, add table[h, min(i - j, R - 1)], softmax them, and
average v with those weights. The table's gradient sums the scores' gradients over the (i, j) reading each
entry.

Layout ``"b h t ..."``: q and k ``[b h t d]``, v ``[b h t d]``, out ``[b h t d]``; param table ``[h r]``.
"""

from __future__ import annotations

import numpy as np

import ssmc

R = 16  # the table's entries per head


def relative_bias(score, q_idx, kv_idx, table: ssmc.Param["h r=16"]):
    return score + table[ssmc.clamp(q_idx - kv_idx, 0, R - 1)]


SPEC = ssmc.attention(score_mod=relative_bias, mask_mod=ssmc.causal, batch="b h", head_dim="d")
LAYOUT = "b h t ..."
FAMILY = "softmax over keys"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, heads: int = 4, dim: int = 8) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT): q, k, v and the per-head bias table."""
    return {
        "q": rng.standard_normal((batch, heads, length, dim)),
        "k": rng.standard_normal((batch, heads, length, dim)),
        "v": rng.standard_normal((batch, heads, length, dim)),
        "table": 0.5 * rng.standard_normal((heads, R)),
    }


def reference(q, k, v, table):
    """Plain NumPy, written without ssmc: returns out [b h t d]."""
    batch, heads, length, dim = q.shape
    out = np.empty((batch, heads, length, v.shape[-1]))
    pos = np.arange(length)
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                keys = pos[: i + 1]
                s = k[b, h, : i + 1] @ q[b, h, i] / np.sqrt(dim) + table[h, np.minimum(i - keys, R - 1)]
                w = np.exp(s - s.max())
                out[b, h, i] = (w / w.sum()) @ v[b, h, : i + 1]
    return out


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    out = SPEC.compile(layout=LAYOUT)(**inputs)
    err = np.abs(out - reference(**inputs)).max()
    print(f"relpos_attention: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

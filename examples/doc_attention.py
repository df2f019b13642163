"""Causal softmax attention over packed documents: a mask from per-position document ids (softmax-over-keys
family).

    s[i, j] = (q_i . k_j) / sqrt(d)        where j <= i and doc[b, j] == doc[b, i], else -inf
    out_i   = sum_j softmax_j(s[i, :]) v_j

per batch index b and head h: several documents packed along time, each query attending to the keys of its own
document up to itself. As a plain loop: for each (b, h, i), take the keys j <= i with doc[b, j] == doc[b, i],
softmax their scores, and average v with those weights. The ids are an ``ssmc.Seq["b"]``: an integer per
position [b t], passed with q, k, v; sorted ids (packed documents) let whole key tiles be skipped.

Layout ``"b h t ..."``: q and k ``[b h t d]``, v ``[b h t d]``, out ``[b h t d]``; sequence doc ``[b t]``.
"""

from __future__ import annotations

import numpy as np

import ssmc


def document_causal(q_idx, kv_idx, doc: ssmc.Seq["b"]):
    return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])


SPEC = ssmc.attention(mask_mod=document_causal, batch="b h", head_dim="d")
LAYOUT = "b h t ..."
FAMILY = "softmax over keys"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, heads: int = 4, dim: int = 8) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT): q, k, v and each row's document ids (documents of random
    lengths packed one after another: ids 0, 0, ..., 1, 1, ...)."""
    starts = np.sort(rng.integers(1, max(2, length), (batch, 3)), axis=1)
    doc = (np.arange(length)[None, :, None] >= starts[:, None, :]).sum(-1)
    return {
        "q": rng.standard_normal((batch, heads, length, dim)),
        "k": rng.standard_normal((batch, heads, length, dim)),
        "v": rng.standard_normal((batch, heads, length, dim)),
        "doc": doc,
    }


def reference(q, k, v, doc):
    """Plain NumPy, written without ssmc: returns out [b h t d]."""
    batch, heads, length, dim = q.shape
    out = np.empty((batch, heads, length, v.shape[-1]))
    for b in range(batch):
        for h in range(heads):
            for i in range(length):
                keys = [j for j in range(i + 1) if doc[b, j] == doc[b, i]]
                s = k[b, h, keys] @ q[b, h, i] / np.sqrt(dim)
                w = np.exp(s - s.max())
                out[b, h, i] = (w / w.sum()) @ v[b, h, keys]
    return out


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    out = SPEC.compile(layout=LAYOUT)(**inputs)
    err = np.abs(out - reference(**inputs)).max()
    print(f"doc_attention: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

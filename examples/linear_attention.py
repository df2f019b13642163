"""Causal linear attention (matrix linear family): a [k v] state per head, no decay.

    S_t = S_{t-1} + k_t v_t^T                  [b h k v]   (outer product, by broadcasting k * v)
    y_t = S_t^T q_t = sum_k S_t * q_t          [b h v]

As a plain loop over t:  S[b,h] += outer(k[b,h,t], v[b,h,t]);  y[b,h,t] = q[b,h,t] @ S[b,h].

Layout ``"b h t ..."`` (heads before time): q and k ``[b h t k]``, v ``[b h t v]``, y ``[b h t v]``;
the state S is ``[b h k v]``.
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def linear_attention(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"],
                     v: ssmc.Seq["b h v"]):
    S = S + k * v
    y = ssmc.dot(S, q, over="k")
    return S, y


SPEC = linear_attention
LAYOUT = "b h t ..."
FAMILY = "matrix linear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, heads: int = 2, dk: int = 3,
                dv: int = 4) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial state included."""
    return {
        "q": rng.standard_normal((batch, heads, length, dk)),
        "k": rng.standard_normal((batch, heads, length, dk)) / np.sqrt(dk),
        "v": rng.standard_normal((batch, heads, length, dv)),
        "S": 0.5 * rng.standard_normal((batch, heads, dk, dv)),
    }


def reference(q, k, v, S=None):
    """Plain NumPy, written without ssmc: returns (y [b h t v], final S [b h k v])."""
    batch, heads, length, dk = q.shape
    dv = v.shape[-1]
    S = np.zeros((batch, heads, dk, dv)) if S is None else S.copy()
    y = np.empty((batch, heads, length, dv))
    for t in range(length):
        S = S + k[:, :, t, :, None] * v[:, :, t, None, :]
        y[:, :, t] = np.einsum("bhk,bhkv->bhv", q[:, :, t], S)
    return y, S


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, S_last = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, S_ref = reference(**inputs)
    err = max(np.abs(y - y_ref).max(), np.abs(S_last - S_ref).max())
    print(f"linear_attention: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

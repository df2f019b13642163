"""Gated linear attention (matrix linear family): simple GLA's state with a decay per head, step and key.

    S_t = exp(g_t)[:, None] * S_{t-1} + k_t v_t^T     [b h k v]   (g_t <= 0: a log-decay per key)
    y_t = S_t^T q_t                                   [b h v]

As a plain loop over t, for every b, h:
    S[b,h] = exp(g[b,t,h])[:, None] * S[b,h] + outer(k[b,t,h], v[b,t,h]);   y[b,t,h] = q[b,t,h] @ S[b,h]

Row κ of the state decays by its own exp(g[b,t,h,κ]), the decay runs along the key axis (the one the
output contracts). fla's ``chunk_gla(q, k, v, g)`` computes the same with q scaled by k's size ** -0.5
(scale q first to match), g its log decays (``logsigmoid(x Wg) / 16`` in GLA, here an input).
Layout ``"b t ..."``: q, k and g ``[b t h k]``, v ``[b t h v]``, y ``[b t h v]``; the state S is
``[b h k v]``.
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def gla(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"], v: ssmc.Seq["b h v"],
        g: ssmc.Seq["b h k"]):
    S = ssmc.exp(g) * S + k * v
    y = ssmc.dot(S, q, over="k")
    return S, y


SPEC = gla
LAYOUT = "b t ..."
FAMILY = "matrix linear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, heads: int = 3, dk: int = 3,
                dv: int = 4) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial state included."""
    return {
        "q": rng.standard_normal((batch, length, heads, dk)),
        "k": rng.standard_normal((batch, length, heads, dk)) / np.sqrt(dk),
        "v": rng.standard_normal((batch, length, heads, dv)),
        "g": np.log(rng.uniform(0.5, 1.0, (batch, length, heads, dk))),
        "S": 0.5 * rng.standard_normal((batch, heads, dk, dv)),
    }


def reference(q, k, v, g, S=None):
    """Plain NumPy, written without ssmc: returns (y [b t h v], final S [b h k v])."""
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    S = np.zeros((batch, heads, dk, dv)) if S is None else S.copy()
    y = np.empty((batch, length, heads, dv))
    for t in range(length):
        S = np.exp(g[:, t, :, :, None]) * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        y[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], S)
    return y, S


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, S_last = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, S_ref = reference(**inputs)
    err = max(np.abs(y - y_ref).max(), np.abs(S_last - S_ref).max())
    print(f"gla: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

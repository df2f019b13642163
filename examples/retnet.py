"""RetNet retention, recurrent form (matrix linear family): a [k v] state per head, decayed by gamma.

    S_t = gamma * S_{t-1} + k_t v_t^T          [b h k v]   (gamma in (0, 1), one per head)
    y_t = S_t^T q_t = sum_k S_t * q_t          [b h v]

As a plain loop over t, for every b, h:
    S[b,h] = gamma[h] * S[b,h] + outer(k[b,t,h], v[b,t,h]);   y[b,t,h] = q[b,t,h] @ S[b,h]

Layout ``"b t ..."``: q and k ``[b t h k]``, v ``[b t h v]``, y ``[b t h v]``; param gamma ``[h]``;
the state S is ``[b h k v]``.
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def retnet(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"], v: ssmc.Seq["b h v"],
           gamma: ssmc.Param["h"]):
    S = gamma * S + k * v
    y = ssmc.dot(S, q, over="k")
    return S, y


SPEC = retnet
LAYOUT = "b t ..."
FAMILY = "matrix linear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, heads: int = 3, dk: int = 3,
                dv: int = 4) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial state included."""
    # RetNet uses gamma_i = 1 - 2^(-5 - i); these decay faster, so that short runs see heads differ
    gamma = 1.0 - 2.0 ** (-1.0 - 2.0 * np.arange(heads))
    return {
        "q": rng.standard_normal((batch, length, heads, dk)),
        "k": rng.standard_normal((batch, length, heads, dk)) / np.sqrt(dk),
        "v": rng.standard_normal((batch, length, heads, dv)),
        "gamma": gamma,
        "S": 0.5 * rng.standard_normal((batch, heads, dk, dv)),
    }


def reference(q, k, v, gamma, S=None):
    """Plain NumPy, written without ssmc: returns (y [b t h v], final S [b h k v])."""
    batch, length, heads, dk = q.shape
    dv = v.shape[-1]
    S = np.zeros((batch, heads, dk, dv)) if S is None else S.copy()
    y = np.empty((batch, length, heads, dv))
    for t in range(length):
        S = gamma[None, :, None, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        y[:, t] = np.einsum("bhk,bhkv->bhv", q[:, t], S)
    return y, S


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, S_last = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, S_ref = reference(**inputs)
    err = max(np.abs(y - y_ref).max(), np.abs(S_last - S_ref).max())
    print(f"retnet: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

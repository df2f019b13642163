"""Mamba-2 / SSD (diagonal linear family): one scalar decay per head, B and C shared within a group.

Heads are written as g groups x r heads per group, so a head is the pair (g, r) and B, C carry only g:

    a_t   = softplus(dt_t)                                  [b g r]
    h_t   = exp(a_t * A) * h_{t-1} + a_t * x_t * B_t         [b g r p n]   (A < 0: decay in (0, 1))
    y_t   = sum_n h_t * C_t + D * x_t                        [b g r p]

As a plain loop over t, for every b, g, r, p, n:
    h[b,g,r,p,n] = exp(a[b,g,r]*A[g,r]) * h[b,g,r,p,n] + a[b,g,r] * x[b,g,r,p] * B[b,g,n]

Layout ``"b t ..."``: x ``[b t g r p]``, dt ``[b t g r]``, B and C ``[b t g n]``, y ``[b t g r p]``.
Params A, D ``[g r]``; the state h is ``[b g r p n]``.
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def mamba2(h: ssmc.State["b g r p n"], x: ssmc.Seq["b g r p"], dt: ssmc.Seq["b g r"],
           A: ssmc.Param["g r"], B: ssmc.Seq["b g n"], C: ssmc.Seq["b g n"], D: ssmc.Param["g r"]):
    a = ssmc.softplus(dt)
    h = ssmc.exp(a * A) * h + a * x * B
    y = ssmc.dot(h, C, over="n") + D * x
    return h, y


SPEC = mamba2
LAYOUT = "b t ..."
FAMILY = "matrix linear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, groups: int = 2, heads: int = 2,
                headdim: int = 3, state: int = 4) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial state included."""
    return {
        "x": rng.standard_normal((batch, length, groups, heads, headdim)),
        "dt": rng.standard_normal((batch, length, groups, heads)) - 1.0,
        "A": -np.exp(rng.uniform(-1.0, 1.0, (groups, heads))),
        "B": rng.standard_normal((batch, length, groups, state)),
        "C": rng.standard_normal((batch, length, groups, state)),
        "D": rng.standard_normal((groups, heads)),
        "h": 0.5 * rng.standard_normal((batch, groups, heads, headdim, state)),
    }


def reference(x, dt, A, B, C, D, h=None):
    """Plain NumPy, written without ssmc: returns (y [b t g r p], final h [b g r p n])."""
    batch, length, groups, heads, headdim = x.shape
    state = B.shape[-1]
    h = np.zeros((batch, groups, heads, headdim, state)) if h is None else h.copy()
    y = np.empty_like(x)
    for t in range(length):
        d = dt[:, t]
        a = np.maximum(d, 0.0) + np.log1p(np.exp(-np.abs(d)))           # softplus, [b g r]
        decay = np.exp(a * A[None])[..., None, None]                     # [b g r 1 1]
        inject = (a[..., None] * x[:, t])[..., None] * B[:, t][:, :, None, None, :]
        h = decay * h + inject
        y[:, t] = np.einsum("bgrpn,bgn->bgrp", h, C[:, t]) + D[None, :, :, None] * x[:, t]
    return y, h


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, h_last = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, h_ref = reference(**inputs)
    err = max(np.abs(y - y_ref).max(), np.abs(h_last - h_ref).max())
    print(f"mamba2: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

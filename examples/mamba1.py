"""Mamba-1 selective scan (diagonal linear family), one state of size n per channel d.

    dt_t   = softplus(delta_t + delta_bias)                      [b d]
    h_t    = exp(dt_t * A) * h_{t-1} + dt_t * u_t * B_t           [b d n]   (A < 0, so the decay is in (0, 1))
    y_t    = (sum_n h_t * C_t + D * u_t) * silu(z_t)              [b d]

As a plain loop over t, for every b, d, n:  h[b,d,n] = exp(dt[b,d]*A[d,n]) * h[b,d,n] + dt[b,d]*u[b,d]*B[b,n].

Layout ``"b d t"``, as the mamba kernels take it: channels before time. Sequences u, delta, z are
``[b d t]``; B and C (no d axis) fill the ``d`` placeholder with ``n`` and are ``[b n t]``; the output y
is ``[b d t]``. Params A ``[d n]``, D ``[d]``, delta_bias ``[d]``; the state h is ``[b d n]``.
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def mamba1(h: ssmc.State["b d n"], u: ssmc.Seq["b d"], delta: ssmc.Seq["b d"], A: ssmc.Param["d n"],
           B: ssmc.Seq["b n"], C: ssmc.Seq["b n"], D: ssmc.Param["d"], z: ssmc.Seq["b d"],
           delta_bias: ssmc.Param["d"]):
    dt = ssmc.softplus(delta + delta_bias)
    h = ssmc.exp(dt * A) * h + dt * u * B
    y = (ssmc.dot(h, C, over="n") + D * u) * ssmc.silu(z)
    return h, y


SPEC = mamba1
LAYOUT = "b d t"
FAMILY = "diagonal linear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, dim: int = 4, state: int = 3) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial state included."""
    return {
        "u": rng.standard_normal((batch, dim, length)),
        "delta": rng.standard_normal((batch, dim, length)),
        "A": -np.exp(rng.uniform(-1.0, 1.0, (dim, state))),
        "B": rng.standard_normal((batch, state, length)),
        "C": rng.standard_normal((batch, state, length)),
        "D": rng.standard_normal(dim),
        "z": rng.standard_normal((batch, dim, length)),
        "delta_bias": rng.uniform(-2.0, 0.0, dim),
        "h": 0.5 * rng.standard_normal((batch, dim, state)),
    }


def _softplus(x):
    return np.maximum(x, 0.0) + np.log1p(np.exp(-np.abs(x)))


def reference(u, delta, A, B, C, D, z, delta_bias, h=None):
    """Plain NumPy, written without ssmc: returns (y [b d t], final h [b d n])."""
    batch, dim, length = u.shape
    state = A.shape[1]
    h = np.zeros((batch, dim, state)) if h is None else h.copy()
    y = np.empty_like(u)
    for t in range(length):
        dt = _softplus(delta[:, :, t] + delta_bias[None, :])                 # [b d]
        decay = np.exp(dt[:, :, None] * A[None, :, :])                      # [b d n]
        h = decay * h + (dt * u[:, :, t])[:, :, None] * B[:, None, :, t]
        zt = z[:, :, t]
        gate = zt / (1.0 + np.exp(-zt))
        y[:, :, t] = (np.einsum("bdn,bn->bd", h, C[:, :, t]) + D[None, :] * u[:, :, t]) * gate
    return y, h


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, h_last = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, h_ref = reference(**inputs)
    err = max(np.abs(y - y_ref).max(), np.abs(h_last - h_ref).max())
    print(f"mamba1: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

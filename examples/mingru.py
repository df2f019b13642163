"""minGRU (diagonal linear family), from "Were RNNs All We Needed?" (Feng et al., 2024).

The gate and the candidate depend on the input only, so the recurrence is linear in h:

    z_t       = sigmoid(x_t Wz + bz)                              [b d]
    htilde_t  = x_t Wh + bh                                        [b d]   (linear in x, no tanh)
    h_t       = (1 - z_t) * h_{t-1} + z_t * htilde_t               [b d]     y_t = h_t

As a plain loop over t:  k = x[t] @ Wz + bz;  z = sigmoid(k);  h = (1 - z) * h + z * (x[t] @ Wh + bh).

Layout ``"b t ..."``: x ``[b t i]``, y ``[b t d]``. Params Wz, Wh ``[i d]``, bz, bh ``[d]``; the state h
is ``[b d]``.
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def mingru(h: ssmc.State["b d"], x: ssmc.Seq["b i"], Wz: ssmc.Param["i d"], bz: ssmc.Param["d"],
           Wh: ssmc.Param["i d"], bh: ssmc.Param["d"]):
    k = ssmc.dot(x, Wz, over="i") + bz
    z = ssmc.sigmoid(k)
    htilde = ssmc.dot(x, Wh, over="i") + bh
    h = (1 - z) * h + z * htilde
    return h, h


SPEC = mingru
LAYOUT = "b t ..."
FAMILY = "diagonal linear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, inp: int = 3, dim: int = 5) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial state included."""
    return {
        "x": rng.standard_normal((batch, length, inp)),
        "Wz": rng.standard_normal((inp, dim)) / np.sqrt(inp),
        "bz": rng.standard_normal(dim),
        "Wh": rng.standard_normal((inp, dim)) / np.sqrt(inp),
        "bh": rng.standard_normal(dim),
        "h": 0.5 * rng.standard_normal((batch, dim)),
    }


def reference(x, Wz, bz, Wh, bh, h=None):
    """Plain NumPy, written without ssmc: returns (y [b t d], final h [b d])."""
    batch, length, _ = x.shape
    dim = Wz.shape[1]
    h = np.zeros((batch, dim)) if h is None else h.copy()
    y = np.empty((batch, length, dim))
    for t in range(length):
        k = x[:, t] @ Wz + bz
        z = 1.0 / (1.0 + np.exp(-k))
        htilde = x[:, t] @ Wh + bh
        h = (1.0 - z) * h + z * htilde
        y[:, t] = h
    return y, h


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, h_last = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, h_ref = reference(**inputs)
    err = max(np.abs(y - y_ref).max(), np.abs(h_last - h_ref).max())
    print(f"mingru: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

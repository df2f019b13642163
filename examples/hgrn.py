"""HGRN-style gated linear recurrence (diagonal linear family).

    h_t = sigmoid(f_t) * h_{t-1} + (1 - sigmoid(f_t)) * silu(x_t)        y_t = h_t

Inputs are batch-first, ``[b t d]``.
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def hgrn(h: ssmc.State["b d"], x: ssmc.Seq["b d"], f: ssmc.Seq["b d"]):
    a = ssmc.sigmoid(f)
    h = a * h + (1 - a) * ssmc.silu(x)
    return h, h


SPEC = hgrn
LAYOUT = "b t ..."
FAMILY = "diagonal linear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, dim: int = 5) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial state included."""
    return {
        "x": rng.standard_normal((batch, length, dim)),
        "f": rng.standard_normal((batch, length, dim)) + 1.0,
        "h": 0.5 * rng.standard_normal((batch, dim)),
    }


def reference(x, f, h=None):
    """Plain NumPy, written without ssmc: returns (y [b t d], final h [b d])."""
    batch, length, dim = x.shape
    h = np.zeros((batch, dim)) if h is None else h.copy()
    y = np.empty_like(x)
    for t in range(length):
        a = 1.0 / (1.0 + np.exp(-f[:, t]))
        silu = x[:, t] / (1.0 + np.exp(-x[:, t]))
        h = a * h + (1.0 - a) * silu
        y[:, t] = h
    return y, h


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, h_last = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, h_ref = reference(**inputs)
    err = max(np.abs(y - y_ref).max(), np.abs(h_last - h_ref).max())
    print(f"hgrn: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

"""LSTM (nonlinear family): the gates depend on the previous h through a matrix, so no scan applies.

    z_t = x_t W + h_{t-1} U + bias                   [b g k], gates g = (i, f, g, o), the order of
    i, f, g, o = z_t along g                                    torch.nn.LSTM's weight rows
    c_t = sigmoid(f) * c_{t-1} + sigmoid(i) * tanh(g)
    h_t = sigmoid(o) * tanh(c_t)                     y_t = h_t

As a plain loop over t:  z = einsum("bi,igk->bgk", x[t], W) + einsum("bj,jgk->bgk", h, U) + bias; ...

Layout ``"b t ..."``: x ``[b t i]``, y ``[b t k]``. Params W ``[i g=4 k]``, U ``[j g=4 k]`` (j is the
previous h's axis, renamed from k, so its size must equal k's), bias ``[g k]`` (torch's b_ih + b_hh).
States h and c are ``[b k]``; final states come back as (h, c).
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def lstm(h: ssmc.State["b k"], c: ssmc.State["b k"], x: ssmc.Seq["b i"], W: ssmc.Param["i g=4 k"],
         U: ssmc.Param["j g=4 k"], bias: ssmc.Param["g k"]):
    z = ssmc.dot(x, W, over="i") + ssmc.dot(h.rename(k="j"), U, over="j") + bias
    i, f, g, o = z.unbind("g")
    c = ssmc.sigmoid(f) * c + ssmc.sigmoid(i) * ssmc.tanh(g)
    h = ssmc.sigmoid(o) * ssmc.tanh(c)
    return (h, c), h


SPEC = lstm
LAYOUT = "b t ..."
FAMILY = "nonlinear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, inp: int = 3, hidden: int = 4) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial states included."""
    scale = 1.0 / np.sqrt(hidden)
    return {
        "x": rng.standard_normal((batch, length, inp)),
        "W": rng.uniform(-scale, scale, (inp, 4, hidden)),
        "U": rng.uniform(-scale, scale, (hidden, 4, hidden)),
        "bias": rng.uniform(-scale, scale, (4, hidden)),
        "h": 0.5 * rng.standard_normal((batch, hidden)),
        "c": 0.5 * rng.standard_normal((batch, hidden)),
    }


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def reference(x, W, U, bias, h=None, c=None):
    """Plain NumPy, written without ssmc: returns (y [b t k], (final h [b k], final c [b k]))."""
    batch, length, inp = x.shape
    hidden = W.shape[2]
    h = np.zeros((batch, hidden)) if h is None else h.copy()
    c = np.zeros((batch, hidden)) if c is None else c.copy()
    Wm = W.reshape(inp, 4 * hidden)          # column g * hidden + k
    Um = U.reshape(hidden, 4 * hidden)
    bm = bias.reshape(4 * hidden)
    y = np.empty((batch, length, hidden))
    for t in range(length):
        z = x[:, t] @ Wm + h @ Um + bm
        zi, zf, zg, zo = (z[:, j * hidden:(j + 1) * hidden] for j in range(4))
        c = _sigmoid(zf) * c + _sigmoid(zi) * np.tanh(zg)
        h = _sigmoid(zo) * np.tanh(c)
        y[:, t] = h
    return y, (h, c)


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, finals = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, finals_ref = reference(**inputs)
    err = max(np.abs(a - b).max() for a, b in zip((y, *finals), (y_ref, *finals_ref)))
    print(f"lstm: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

"""LSTM with a head-wise hidden state (nonlinear family): the hidden units split into heads, each head
its own recurrence with its own recurrent matrix (U block-diagonal over the heads), the input
projection shared by all of them.

    z_t[n] = x_t W[n] + h_{t-1}[n] U[n] + bias[n]    [b n g k], heads n, units k of a head,
    i, f, g, o = z_t[n] along g                               gates g = (i, f, g, o)
    c_t[n] = sigmoid(f) * c_{t-1}[n] + sigmoid(i) * tanh(g)
    h_t[n] = sigmoid(o) * tanh(c_t[n])               y_t = h_t

As a plain loop over t:  z = einsum("bi,nigk->bngk", x[t], W) + einsum("bnj,njgk->bngk", h, U) + bias; ...

Layout ``"b t ..."``: x ``[b t i]``, y ``[b t n k]``. Params W ``[n i g=4 k]``, U ``[n j g=4 k]`` (j: the
previous h's units of the same head, renamed from k), bias ``[n g k]``. States h and c are ``[b n k]``.
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def lstm_heads(h: ssmc.State["b n k"], c: ssmc.State["b n k"], x: ssmc.Seq["b i"], W: ssmc.Param["n i g=4 k"],
               U: ssmc.Param["n j g=4 k"], bias: ssmc.Param["n g k"]):
    z = ssmc.dot(x, W, over="i") + ssmc.dot(h.rename(k="j"), U, over="j") + bias
    i, f, g, o = z.unbind("g")
    c = ssmc.sigmoid(f) * c + ssmc.sigmoid(i) * ssmc.tanh(g)
    h = ssmc.sigmoid(o) * ssmc.tanh(c)
    return (h, c), h


SPEC = lstm_heads
LAYOUT = "b t ..."
FAMILY = "nonlinear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, inp: int = 3, heads: int = 2,
                hidden: int = 4) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial states included; `hidden` units a head."""
    scale = 1.0 / np.sqrt(hidden)
    return {
        "x": rng.standard_normal((batch, length, inp)),
        "W": rng.uniform(-scale, scale, (heads, inp, 4, hidden)),
        "U": rng.uniform(-scale, scale, (heads, hidden, 4, hidden)),
        "bias": rng.uniform(-scale, scale, (heads, 4, hidden)),
        "h": 0.5 * rng.standard_normal((batch, heads, hidden)),
        "c": 0.5 * rng.standard_normal((batch, heads, hidden)),
    }


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def reference(x, W, U, bias, h=None, c=None):
    """Plain NumPy, written without ssmc: returns (y [b t n k], (final h [b n k], final c [b n k]))."""
    batch, length, _ = x.shape
    heads, _, _, hidden = W.shape
    h = np.zeros((batch, heads, hidden)) if h is None else h.copy()
    c = np.zeros((batch, heads, hidden)) if c is None else c.copy()
    y = np.empty((batch, length, heads, hidden))
    for t in range(length):
        for n in range(heads):
            z = np.einsum("bi,igk->bgk", x[:, t], W[n]) + np.einsum("bj,jgk->bgk", h[:, n], U[n]) + bias[n]
            c[:, n] = _sigmoid(z[:, 1]) * c[:, n] + _sigmoid(z[:, 0]) * np.tanh(z[:, 2])
            h[:, n] = _sigmoid(z[:, 3]) * np.tanh(c[:, n])
        y[:, t] = h
    return y, (h, c)


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    # the interpreter: the heads are for the GPU's persistent kernel; on the CPU the default backend's
    # (Numba's) compile of this cell and its gradient takes minutes on a CI machine
    y, finals = ssmc.compile(SPEC, "interpreter", layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, finals_ref = reference(**inputs)
    err = max(np.abs(a - b).max() for a, b in zip((y, *finals), (y_ref, *finals_ref)))
    print(f"lstm_heads: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

"""sLSTM (nonlinear family, xLSTM's scalar-memory cell): exponential input and forget gates kept finite by a
stabiliser state m, a normaliser state n beside the cell c.

    z_t = x_t W + h_{t-1} U + bias                   [b g k], gates g = (i, f, z, o) as pre-activations
    m_t = max(f + m_{t-1}, i)                        the stabiliser (log space; the forget gate exp(f))
    i'  = exp(i - m_t),  f' = exp(f + m_{t-1} - m_t) both at most 1
    c_t = f' c_{t-1} + i' tanh(z)
    n_t = f' n_{t-1} + i'
    h_t = sigmoid(o) * c_t / n_t                     y_t = h_t

As a plain loop over t:  z = einsum("bi,igk->bgk", x[t], W) + einsum("bj,jgk->bgk", h, U) + bias; ...
n_t ≥ i' > 0 after the first step (exp(i - m_t) = 1 where the input gate sets m_t), so the division is safe
wherever n_0 > 0 or the first step's input gate is the maximum (n_0 = 1, m_0 = 0 below).

Layout ``"b t ..."``: x ``[b t i]``, y ``[b t k]``. Params W ``[i g=4 k]``, U ``[j g=4 k]`` (j: the previous
h's axis), bias ``[g k]``. States h, c, n, m are ``[b k]``; final states come back as (h, c, n, m).
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def slstm(h: ssmc.State["b k"], c: ssmc.State["b k"], n: ssmc.State["b k"], m: ssmc.State["b k"],
          x: ssmc.Seq["b i"], W: ssmc.Param["i g=4 k"], U: ssmc.Param["j g=4 k"], bias: ssmc.Param["g k"]):
    z = ssmc.dot(x, W, over="i") + ssmc.dot(h.rename(k="j"), U, over="j") + bias
    i, f, g, o = z.unbind("g")
    m_new = ssmc.maximum(f + m, i)
    i_gate = ssmc.exp(i - m_new)
    f_gate = ssmc.exp(f + m - m_new)
    c = f_gate * c + i_gate * ssmc.tanh(g)
    n = f_gate * n + i_gate
    h = ssmc.sigmoid(o) * c / n
    return (h, c, n, m_new), h


SPEC = slstm
LAYOUT = "b t ..."
FAMILY = "nonlinear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, inp: int = 3, hidden: int = 4) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial states included (n = 1 and m = 0, as xLSTM starts)."""
    scale = 1.0 / np.sqrt(hidden)
    return {
        "x": rng.standard_normal((batch, length, inp)),
        "W": rng.uniform(-scale, scale, (inp, 4, hidden)),
        "U": rng.uniform(-scale, scale, (hidden, 4, hidden)),
        "bias": rng.uniform(-scale, scale, (4, hidden)),
        "h": 0.5 * rng.standard_normal((batch, hidden)),
        "c": 0.5 * rng.standard_normal((batch, hidden)),
        "n": np.ones((batch, hidden)),
        "m": np.zeros((batch, hidden)),
    }


def reference(x, W, U, bias, h=None, c=None, n=None, m=None):
    """Plain NumPy, written without ssmc: returns (y [b t k], (final h, c, n, m, each [b k]))."""
    batch, length, inp = x.shape
    hidden = W.shape[2]
    h = np.zeros((batch, hidden)) if h is None else h.copy()
    c = np.zeros((batch, hidden)) if c is None else c.copy()
    n = np.zeros((batch, hidden)) if n is None else n.copy()
    m = np.zeros((batch, hidden)) if m is None else m.copy()
    Wm, Um, bm = W.reshape(inp, 4 * hidden), U.reshape(hidden, 4 * hidden), bias.reshape(4 * hidden)
    y = np.empty((batch, length, hidden))
    for t in range(length):
        z = x[:, t] @ Wm + h @ Um + bm
        zi, zf, zg, zo = (z[:, j * hidden:(j + 1) * hidden] for j in range(4))
        m_new = np.maximum(zf + m, zi)
        ig, fg = np.exp(zi - m_new), np.exp(zf + m - m_new)
        c = fg * c + ig * np.tanh(zg)
        n = fg * n + ig
        m = m_new
        h = 0.5 * (1.0 + np.tanh(0.5 * zo)) * c / n
        y[:, t] = h
    return y, (h, c, n, m)


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, finals = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, finals_ref = reference(**inputs)
    err = max(np.abs(a - b).max() for a, b in zip((y, *finals), (y_ref, *finals_ref)))
    print(f"slstm: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

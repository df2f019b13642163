"""LayerNorm LSTM (Ba, Kiros and Hinton, 2016): the pre-activations of all four gates normalised
together, over the gate axis and the hidden axis at once (``over="g k"``), and the cell normalised
over k before its tanh.

    zx_t = LN_{g k}(x_t W) * gamma                   [b g k], gates g = (i, f, g, o) as lstm.py
    zh_t = LN_{g k}(h_{t-1} U)                       (no gain: gamma scales the sum's first term)
    i, f, g, o = zx_t + zh_t + beta  along g
    c_t = sigmoid(f) * c_{t-1} + sigmoid(i) * tanh(g)
    h_t = sigmoid(o) * tanh(LN_k(c_t) * gamma_c + beta_c)          y_t = h_t

LN_{g k}(v)[b, g, k] = (v[b, g, k] - mu[b]) / sqrt(var[b] + eps), mu and var (biased) over the 4 * k
values of row b; LN_k likewise over k alone. The statistics over "g k" are two reductions in turn
(over g, then k), so every backend and the derived backward see ordinary sums.

Layout ``"b t ..."``: x ``[b t i]``, y ``[b t k]``. Params W ``[i g=4 k]``, U ``[j g=4 k]``, gamma
and beta ``[g k]``, gamma_c and beta_c ``[k]``. States h and c ``[b k]``.
"""

from __future__ import annotations

import numpy as np

import ssmc

EPS = 1e-5


@ssmc.recurrence
def layernorm_lstm(h: ssmc.State["b k"], c: ssmc.State["b k"], x: ssmc.Seq["b i"], W: ssmc.Param["i g=4 k"],
                   U: ssmc.Param["j g=4 k"], gamma: ssmc.Param["g k"], beta: ssmc.Param["g k"],
                   gamma_c: ssmc.Param["k"], beta_c: ssmc.Param["k"]):
    zx = ssmc.layernorm(ssmc.dot(x, W, over="i"), over="g k", weight=gamma, eps=EPS)
    zh = ssmc.layernorm(ssmc.dot(h.rename(k="j"), U, over="j"), over="g k", eps=EPS)
    i, f, g, o = (zx + zh + beta).unbind("g")
    c = ssmc.sigmoid(f) * c + ssmc.sigmoid(i) * ssmc.tanh(g)
    h = ssmc.sigmoid(o) * ssmc.tanh(ssmc.layernorm(c, over="k", weight=gamma_c, bias=beta_c, eps=EPS))
    return (h, c), h


SPEC = layernorm_lstm
LAYOUT = "b t ..."
FAMILY = "nonlinear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, inp: int = 3, hidden: int = 4) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial states included."""
    scale = 1.0 / np.sqrt(hidden)
    return {
        "x": rng.standard_normal((batch, length, inp)),
        "W": rng.uniform(-scale, scale, (inp, 4, hidden)),
        "U": rng.uniform(-scale, scale, (hidden, 4, hidden)),
        "gamma": rng.uniform(0.5, 1.5, (4, hidden)),
        "beta": rng.uniform(-0.5, 0.5, (4, hidden)),
        "gamma_c": rng.uniform(0.5, 1.5, hidden),
        "beta_c": rng.uniform(-0.5, 0.5, hidden),
        "h": 0.5 * rng.standard_normal((batch, hidden)),
        "c": 0.5 * rng.standard_normal((batch, hidden)),
    }


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def _layer_norm(v, axes):
    """(v - mean) / sqrt(var + EPS) over `axes` (a tuple of dimensions), the biased variance."""
    mu = v.mean(axis=axes, keepdims=True)
    var = ((v - mu) ** 2).mean(axis=axes, keepdims=True)
    return (v - mu) / np.sqrt(var + EPS)


def reference(x, W, U, gamma, beta, gamma_c, beta_c, h=None, c=None):
    """Plain NumPy, written without ssmc: returns (y [b t k], (final h [b k], final c [b k]))."""
    batch, length, _ = x.shape
    hidden = W.shape[2]
    h = np.zeros((batch, hidden)) if h is None else h.copy()
    c = np.zeros((batch, hidden)) if c is None else c.copy()
    y = np.empty((batch, length, hidden))
    for t in range(length):
        zx = _layer_norm(np.einsum("bi,igk->bgk", x[:, t], W), (1, 2)) * gamma
        zh = _layer_norm(np.einsum("bj,jgk->bgk", h, U), (1, 2))
        z = zx + zh + beta
        c = _sigmoid(z[:, 1]) * c + _sigmoid(z[:, 0]) * np.tanh(z[:, 2])
        h = _sigmoid(z[:, 3]) * np.tanh(_layer_norm(c, (1,)) * gamma_c + beta_c)
        y[:, t] = h
    return y, (h, c)


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, finals = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, finals_ref = reference(**inputs)
    err = max(np.abs(np.asarray(a) - b).max() for a, b in zip((y, *finals), (y_ref, *finals_ref)))
    print(f"layernorm_lstm: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

"""GRU in PyTorch's formulation (nonlinear family), gates (r, z, n) in torch.nn.GRU's row order.

    r_t = sigmoid(x_t W_r + b_ir + h_{t-1} U_r + b_hr)
    z_t = sigmoid(x_t W_z + b_iz + h_{t-1} U_z + b_hz)
    n_t = tanh(x_t W_n + b_in + r_t * (h_{t-1} U_n + b_hn))        (r gates the hidden part only)
    h_t = (1 - z_t) * n_t + z_t * h_{t-1}                           y_t = h_t

As a plain loop over t:  gi = x[t] @ W + b_i;  gh = h @ U + b_h;  r, z, n as above, per gate block.

Layout ``"b t ..."``: x ``[b t i]``, y ``[b t k]``. Params W ``[i g=3 k]``, U ``[j g=3 k]`` (j is the
previous h's axis renamed from k: same size as k), b_i and b_h ``[g k]``; the state h is ``[b k]``.
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def gru(h: ssmc.State["b k"], x: ssmc.Seq["b i"], W: ssmc.Param["i g=3 k"], U: ssmc.Param["j g=3 k"],
        b_i: ssmc.Param["g k"], b_h: ssmc.Param["g k"]):
    gi = ssmc.dot(x, W, over="i") + b_i
    gh = ssmc.dot(h.rename(k="j"), U, over="j") + b_h
    i_r, i_z, i_n = gi.unbind("g")
    h_r, h_z, h_n = gh.unbind("g")
    r = ssmc.sigmoid(i_r + h_r)
    z = ssmc.sigmoid(i_z + h_z)
    n = ssmc.tanh(i_n + r * h_n)
    h = (1 - z) * n + z * h
    return h, h


SPEC = gru
LAYOUT = "b t ..."
FAMILY = "nonlinear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, inp: int = 3, hidden: int = 4) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial state included."""
    scale = 1.0 / np.sqrt(hidden)
    return {
        "x": rng.standard_normal((batch, length, inp)),
        "W": rng.uniform(-scale, scale, (inp, 3, hidden)),
        "U": rng.uniform(-scale, scale, (hidden, 3, hidden)),
        "b_i": rng.uniform(-scale, scale, (3, hidden)),
        "b_h": rng.uniform(-scale, scale, (3, hidden)),
        "h": 0.5 * rng.standard_normal((batch, hidden)),
    }


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))


def reference(x, W, U, b_i, b_h, h=None):
    """Plain NumPy, written without ssmc: returns (y [b t k], final h [b k])."""
    batch, length, _ = x.shape
    hidden = W.shape[2]
    h = np.zeros((batch, hidden)) if h is None else h.copy()
    y = np.empty((batch, length, hidden))
    for t in range(length):
        gi = np.einsum("bi,igk->bgk", x[:, t], W) + b_i
        gh = np.einsum("bj,jgk->bgk", h, U) + b_h
        r = _sigmoid(gi[:, 0] + gh[:, 0])
        z = _sigmoid(gi[:, 1] + gh[:, 1])
        n = np.tanh(gi[:, 2] + r * gh[:, 2])
        h = (1.0 - z) * n + z * h
        y[:, t] = h
    return y, h


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, h_last = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, h_ref = reference(**inputs)
    err = max(np.abs(y - y_ref).max(), np.abs(h_last - h_ref).max())
    print(f"gru: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

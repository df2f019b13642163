"""A Mamba-1 block's causal depthwise conv1d (width 4) and selective scan as one spec.

    u_t    = silu(sum_{j<4} conv_w[d, j] * x_{t-3+j} + conv_b)           [b d]   (x_s = 0 for s < 0)
    dt_t   = softplus(delta_t + delta_bias)                              [b d]
    h_t    = exp(dt_t * A) * h_{t-1} + dt_t * u_t * B_t                   [b d n]
    y_t    = (sum_n h_t * C_t + D * u_t) * silu(z_t)                      [b d]

The convolution is ``ssmc.causal_conv(x, conv_w, width=4)``: ``x.shift(3) * conv_w[:, 0] + ... +
x * conv_w[:, 3]``, torch's ``conv1d(x, w, groups=d, padding=3)[..., :L]`` as mamba_ssm calls it. The
compiler carries the last three steps of x as states of its own, ``x_shift1``, ``x_shift2``,
``x_shift3`` ([b d], x one, two and three steps back: Mamba's ``conv_state``), a shift register in the
scan's loop; they start at zero unless given and come back among the final states after h, so a
sequence run in pieces continues exactly. The scan's input now reads those states through a silu, so
the recurrence classifies as nonlinear (``ssmc show --stage classify``) and runs a thread per (b, d)
with time inside, not the diagonal scans' time-parallel kernels.

Layout ``"b d t"`` as mamba1.py: x, delta, z ``[b d t]``, B and C ``[b n t]``, y ``[b d t]``. Params A
``[d n]``, D, conv_b, delta_bias ``[d]``, conv_w ``[d w=4]``; states h ``[b d n]`` and the window.
"""

from __future__ import annotations

import numpy as np

import ssmc
from ssmc.examples import mamba1

WIDTH = 4


@ssmc.recurrence
def mamba_conv(h: ssmc.State["b d n"], x: ssmc.Seq["b d"], delta: ssmc.Seq["b d"], A: ssmc.Param["d n"],
               B: ssmc.Seq["b n"], C: ssmc.Seq["b n"], D: ssmc.Param["d"], z: ssmc.Seq["b d"],
               conv_w: ssmc.Param["d w=4"], conv_b: ssmc.Param["d"], delta_bias: ssmc.Param["d"]):
    u = ssmc.silu(ssmc.causal_conv(x, conv_w, width=WIDTH) + conv_b)
    dt = ssmc.softplus(delta + delta_bias)
    h = ssmc.exp(dt * A) * h + dt * u * B
    y = (ssmc.dot(h, C, over="n") + D * u) * ssmc.silu(z)
    return h, y


SPEC = mamba_conv
LAYOUT = "b d t"
FAMILY = "nonlinear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, dim: int = 4, state: int = 3) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial states included: mamba1's with the scan's
    input u renamed x, the convolution's weight and bias, and a window of three earlier steps of x."""
    inputs = mamba1.make_inputs(rng, length, batch, dim, state)
    inputs["x"] = inputs.pop("u")
    inputs["conv_w"] = rng.uniform(-0.5, 0.5, (dim, WIDTH))
    inputs["conv_b"] = rng.uniform(-0.5, 0.5, dim)
    for k in range(1, WIDTH):
        inputs[f"x_shift{k}"] = rng.standard_normal((batch, dim))
    return inputs


def reference(x, delta, A, B, C, D, z, conv_w, conv_b, delta_bias, h=None, x_shift1=None, x_shift2=None,
              x_shift3=None):
    """Plain NumPy, written without ssmc: the convolution over x preceded by its window (x_shift3,
    x_shift2, x_shift1: x three, two, one steps before the first; zeros where not given), then
    mamba1's reference scan. Returns (y [b d t], (final h [b d n], x_shift1, x_shift2, x_shift3 [b d]))."""
    batch, dim, length = x.shape
    window = [np.zeros((batch, dim)) if v is None else v for v in (x_shift3, x_shift2, x_shift1)]
    padded = np.concatenate([np.stack(window, axis=-1), x], axis=-1)            # [b d 3 + t]
    conv = sum(conv_w[None, :, j, None] * padded[:, :, j:j + length] for j in range(WIDTH))
    pre = conv + conv_b[None, :, None]
    u = pre / (1.0 + np.exp(-pre))
    y, h = mamba1.reference(u, delta, A, B, C, D, z, delta_bias, h)
    last = padded[:, :, -(WIDTH - 1):]                                          # x at t = L-3, L-2, L-1
    return y, (h, last[:, :, 2], last[:, :, 1], last[:, :, 0])


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, finals = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, finals_ref = reference(**inputs)
    err = max(np.abs(np.asarray(a) - b).max() for a, b in zip((y, *finals), (y_ref, *finals_ref)))
    print(f"mamba_conv: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

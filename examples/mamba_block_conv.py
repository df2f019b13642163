"""A whole Mamba-1 block between its projections as one spec: causal depthwise conv1d (width 4),
SiLU, selective scan, D skip, silu(z) gate, RMSNorm over the channels, residual add.

    u_t    = silu(sum_{j<4} conv_w[d, j] * x_{t-3+j} + conv_b)           [b d]   (x_s = 0 for s < 0)
    dt_t   = softplus(delta_t + delta_bias)                              [b d]
    h_t    = exp(dt_t * A) * h_{t-1} + dt_t * u_t * B_t                   [b d n]
    y_t    = (sum_n h_t * C_t + D * u_t) * silu(z_t)                      [b d]
    out_t  = res_t + y_t / sqrt(mean_d y_t**2 + eps) * norm_weight        [b d]

mamba_conv.py's step (the convolution is ``ssmc.causal_conv``, its window the states ``x_shift1``,
``x_shift2``, ``x_shift3``: x one, two and three steps back) followed by mamba1_block.py's tail (the
norm reduces over d, across the recurrences). The convolution's silu makes the scan's input depend
on states, so the recurrence classifies as nonlinear (``ssmc show --stage classify``); the norm and
the residual are a row stage after it (``ssmc show --stage fused``).

Layout ``"b d t"`` as mamba1.py: x, delta, z, res ``[b d t]``, B and C ``[b n t]``, out ``[b d t]``.
Params A ``[d n]``, D, conv_b, delta_bias, norm_weight ``[d]``, conv_w ``[d w=4]``; states h
``[b d n]`` and the window x_shift1..3 ``[b d]`` (zeros unless given; final values returned after h).
"""

from __future__ import annotations

import numpy as np

import ssmc
from ssmc.examples import mamba_conv

WIDTH = mamba_conv.WIDTH
EPS = 1e-5


@ssmc.recurrence
def mamba_block_conv(h: ssmc.State["b d n"], x: ssmc.Seq["b d"], delta: ssmc.Seq["b d"], A: ssmc.Param["d n"],
                     B: ssmc.Seq["b n"], C: ssmc.Seq["b n"], D: ssmc.Param["d"], z: ssmc.Seq["b d"],
                     conv_w: ssmc.Param["d w=4"], conv_b: ssmc.Param["d"], delta_bias: ssmc.Param["d"],
                     res: ssmc.Seq["b d"], norm_weight: ssmc.Param["d"]):
    u = ssmc.silu(ssmc.causal_conv(x, conv_w, width=WIDTH) + conv_b)
    dt = ssmc.softplus(delta + delta_bias)
    h = ssmc.exp(dt * A) * h + dt * u * B
    y = (ssmc.dot(h, C, over="n") + D * u) * ssmc.silu(z)
    return h, res + ssmc.rmsnorm(y, over="d", weight=norm_weight, eps=EPS)


SPEC = mamba_block_conv
LAYOUT = "b d t"
FAMILY = "nonlinear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, dim: int = 4, state: int = 3) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial states included: mamba_conv's (the window of
    three earlier steps of x among them), plus the residual stream and the norm's weight."""
    inputs = mamba_conv.make_inputs(rng, length, batch, dim, state)
    inputs["res"] = rng.standard_normal((batch, dim, length))
    inputs["norm_weight"] = rng.uniform(0.5, 1.5, dim)
    return inputs


def reference(x, delta, A, B, C, D, z, conv_w, conv_b, delta_bias, res, norm_weight, h=None, x_shift1=None,
              x_shift2=None, x_shift3=None):
    """Plain NumPy, written without ssmc: mamba_conv's reference (convolution, silu, scan, skip, gate)
    for y, then the norm over d and the residual. Returns (out [b d t], (final h [b d n], x_shift1,
    x_shift2, x_shift3 [b d]))."""
    y, finals = mamba_conv.reference(x, delta, A, B, C, D, z, conv_w, conv_b, delta_bias, h, x_shift1, x_shift2,
                                     x_shift3)
    rstd = 1.0 / np.sqrt(np.mean(y * y, axis=1, keepdims=True) + EPS)      # [b 1 t]
    return res + y * rstd * norm_weight[None, :, None], finals


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    out, finals = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    out_ref, finals_ref = reference(**inputs)
    err = max(np.abs(np.asarray(a) - b).max() for a, b in zip((out, *finals), (out_ref, *finals_ref)))
    print(f"mamba_block_conv: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

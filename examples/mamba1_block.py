"""The tail of a Mamba-1 block as one spec: selective scan, D skip, silu(z) gate, RMSNorm, residual.

    dt_t   = softplus(delta_t + delta_bias)                              [b d]
    h_t    = exp(dt_t * A) * h_{t-1} + dt_t * u_t * B_t                   [b d n]
    y_t    = (sum_n h_t * C_t + D * u_t) * silu(z_t)                      [b d]
    out_t  = res_t + y_t / sqrt(mean_d y_t**2 + eps) * norm_weight        [b d]

The RMSNorm reduces over the channels d, along which the scan runs as independent recurrences:
the fusion stage (``ssmc show --stage fused``) keeps the scan, the skip and the gate in the scan
kernel, which writes y, and gives the norm and the residual add one row kernel per (b, t).
Layout ``"b d t"`` as in mamba1.py; ``res`` is ``[b d t]``, ``norm_weight`` ``[d]``.
"""

from __future__ import annotations

import numpy as np

import ssmc
from ssmc.examples import mamba1

EPS = 1e-5


@ssmc.recurrence
def mamba1_block(h: ssmc.State["b d n"], u: ssmc.Seq["b d"], delta: ssmc.Seq["b d"], A: ssmc.Param["d n"],
                 B: ssmc.Seq["b n"], C: ssmc.Seq["b n"], D: ssmc.Param["d"], z: ssmc.Seq["b d"],
                 delta_bias: ssmc.Param["d"], res: ssmc.Seq["b d"], norm_weight: ssmc.Param["d"]):
    dt = ssmc.softplus(delta + delta_bias)
    h = ssmc.exp(dt * A) * h + dt * u * B
    y = (ssmc.dot(h, C, over="n") + D * u) * ssmc.silu(z)
    return h, res + ssmc.rmsnorm(y, over="d", weight=norm_weight, eps=EPS)


SPEC = mamba1_block
LAYOUT = "b d t"
FAMILY = "diagonal linear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, dim: int = 5, state: int = 3) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial state included: mamba1's, plus the
    residual stream and the norm's weight."""
    inputs = mamba1.make_inputs(rng, length, batch, dim, state)
    inputs["res"] = rng.standard_normal((batch, dim, length))
    inputs["norm_weight"] = rng.uniform(0.5, 1.5, dim)
    return inputs


def reference(u, delta, A, B, C, D, z, delta_bias, res, norm_weight, h=None):
    """Plain NumPy, written without ssmc: mamba1's reference for the gated y, then the norm over d
    and the residual. Returns (out [b d t], final h [b d n])."""
    y, h = mamba1.reference(u, delta, A, B, C, D, z, delta_bias, h)
    rstd = 1.0 / np.sqrt(np.mean(y * y, axis=1, keepdims=True) + EPS)      # [b 1 t]
    return res + y * rstd * norm_weight[None, :, None], h


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    out, h_last = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    out_ref, h_ref = reference(**inputs)
    err = max(np.abs(out - out_ref).max(), np.abs(h_last - h_ref).max())
    print(f"mamba1_block: max abs error vs NumPy reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

"""LRU, the Linear Recurrent Unit (Orvieto et al. 2023): a complex diagonal recurrence, written as in the paper.

    lambda = exp(-exp(nu_log) + i exp(theta_log))                [n]      complex, |lambda| < 1
    h_t    = lambda * h_{t-1} + exp(gamma_log) * (B x_t)         [b n]    complex; B [n d] complex
    y_t    = Re(C h_t) + D * x_t                                 [b d]    C [d n] complex, D [d] real

As a plain loop over t, for every b, n:  h[b,n] = lam[n] * h[b,n] + gamma[n] * sum_d B[n,d] x[b,d];
then y[b,d] = Re(sum_n C[d,n] h[b,n]) + D[d] x[b,d]. gamma = exp(gamma_log) is the paper's
normalisation sqrt(1 - |lambda|^2) (a parameter, initialised so).

Layout ``"b t ..."``: x and y are ``[b t d]``. The state h ``[b n]`` and the params B ``[n d]`` and
C ``[d n]`` are complex (complex128 arrays); nu_log, theta_log, gamma_log ``[n]`` and D ``[d]`` real.
ssmc traces the complex values as pairs of real ones, so h runs as two real states (the complex
arithmetic written out), which classification pairs up as a complex diagonal recurrence: the
diagonal-linear scans run it.
"""

from __future__ import annotations

import numpy as np

import ssmc


@ssmc.recurrence
def lru(h: ssmc.State["b n", complex], x: ssmc.Seq["b d"], nu_log: ssmc.Param["n"], theta_log: ssmc.Param["n"],
        gamma_log: ssmc.Param["n"], B: ssmc.Param["n d", complex], C: ssmc.Param["d n", complex],
        D: ssmc.Param["d"]):
    lam = ssmc.exp(ssmc.complex(-ssmc.exp(nu_log), ssmc.exp(theta_log)))
    h = lam * h + ssmc.exp(gamma_log) * ssmc.dot(B, x, over="d")
    y = ssmc.dot(C, h, over="n").real + D * x
    return h, y


SPEC = lru
LAYOUT = "b t ..."
FAMILY = "diagonal linear"


def make_inputs(rng: np.random.Generator, length: int, batch: int = 2, dim: int = 4, state: int = 3,
                r_min: float = 0.4, r_max: float = 0.99, max_phase: float = 2 * np.pi) -> dict:
    """Keyword arguments for SPEC (layout LAYOUT), initial state included: the paper's initialisation
    (|lambda| uniform on the ring [r_min, r_max], phases in [0, max_phase])."""
    radius = np.sqrt(rng.uniform(r_min**2, r_max**2, state))
    phase = rng.uniform(0.0, max_phase, state)
    return {
        "x": rng.standard_normal((batch, length, dim)),
        "nu_log": np.log(-np.log(radius)),
        "theta_log": np.log(phase),
        "gamma_log": np.log(np.sqrt(1.0 - radius**2)),
        "B": (rng.standard_normal((state, dim)) + 1j * rng.standard_normal((state, dim))) / np.sqrt(2 * dim),
        "C": (rng.standard_normal((dim, state)) + 1j * rng.standard_normal((dim, state))) / np.sqrt(state),
        "D": rng.standard_normal(dim),
        "h": 0.5 * (rng.standard_normal((batch, state)) + 1j * rng.standard_normal((batch, state))),
    }


def reference(x, nu_log, theta_log, gamma_log, B, C, D, h=None):
    """Plain NumPy in complex128, written without ssmc: returns (y [b t d], final h [b n] complex)."""
    batch, length, _ = x.shape
    lam = np.exp(-np.exp(nu_log) + 1j * np.exp(theta_log))                  # [n]
    gamma = np.exp(gamma_log)
    h = np.zeros((batch, lam.shape[0]), np.complex128) if h is None else np.array(h, np.complex128)
    y = np.empty_like(x)
    for t in range(length):
        h = lam[None, :] * h + gamma[None, :] * (x[:, t, :] @ B.T)          # [b n]
        y[:, t, :] = (h @ C.T).real + D[None, :] * x[:, t, :]
    return y, h


def main() -> float:
    rng = np.random.default_rng(0)
    inputs = make_inputs(rng, length=64)
    y, h_last = ssmc.compile(SPEC, layout=LAYOUT)(**inputs, return_final_states=True)
    y_ref, h_ref = reference(**inputs)
    err = max(np.abs(y - y_ref).max(), np.abs(h_last - h_ref).max())
    print(f"lru: max abs error vs NumPy complex reference {err:.2e}")
    return err


if __name__ == "__main__":
    main()

"""The backward of `ssmc.attention`: FlashAttention's, with the score modifier differentiated.

Given the saved log-sum-exp, the probabilities are recomputed, ``P = exp(mod(S) - lse)``, and

    dV = Pᵀ dO,   dP = dO Vᵀ,   dM = P ⊙ (dP - rowsum(dO ⊙ O))       (M = mod(S), per (i, j))
    dS = dM ⊙ ∂mod/∂S,   dθ = Σ_{i,j} dM ⊙ ∂mod/∂θ,   dQ = scale · dS K,   dK = scale · dSᵀ Q

This pass derives the two elementwise pieces, ``dS`` and each ``dθ`` summand, as IR over the
leaves ``grad_score`` (= dM), ``score``, ``q_idx``, ``kv_idx`` and the params, by the same
reverse-mode rules as recurrences (SymPy for the local derivatives).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir import build
from ..ir.node import Node
from ..ir.ops import Op
from ..ir.program import Attention
from .autodiff import vjp


@dataclass(frozen=True)
class AttentionBackward:
    forward: Attention
    d_score: Node                              # dS per (query, key), batch axes
    param_grads: tuple[tuple[str, Node], ...]  # per (query, key) summand of each param's gradient


def derive_attention_backward(program: Attention) -> AttentionBackward:
    grad_score = Node.make(Op.INPUT, (), "grad_score", program.batch_axes)
    score = Node.make(Op.INPUT, (), "score", program.batch_axes)
    if program.score is None:
        return AttentionBackward(program, grad_score, tuple((d.name, build.ZERO) for d in program.params))
    adj = vjp((program.score,), (grad_score,))
    d_score = build.expand(adj.get(score, build.ZERO), program.batch_axes)
    params = []
    for d in program.params:
        g = adj.get(Node.make(Op.INPUT, (), d.name, d.axes))
        params.append((d.name, build.ZERO if g is None else g))
    return AttentionBackward(program, d_score, tuple(params))

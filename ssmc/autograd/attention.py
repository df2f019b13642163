"""Gradients of `ssmc.attention`: the FlashAttention backward with the score modifier differentiated
(passes/attention_grad.py), run by the interpreter on every backend until attention's kernels are built."""

from __future__ import annotations

import numpy as np

from ..backends import interpreter
from ..ir.axes import TIME
from ..passes.attention_grad import derive_attention_backward
from ..runtime.binding import DEFAULT_LAYOUT, layout_of, to_float64
from ..runtime.prologue import bind_attention


class AttentionGrad:
    """Gradients of `ssmc.attention`'s q, k, v and params given the output's cotangent."""

    def __init__(self, spec, layout=DEFAULT_LAYOUT):
        self.layout = layout
        self.backward = derive_attention_backward(spec.program)

    def __call__(self, q, k, v, grad_outputs=None, layout=None, **params) -> dict[str, np.ndarray]:
        p = self.backward.forward
        layout = layout or self.layout
        qb, kv = bind_attention(p, q, k, v, layout, params)
        sizes = {**kv.sizes, **qb.sizes}
        order = layout_of(layout, "out", p.v_axes)
        canonical = (TIME, *p.v_axes)
        want = tuple(qb.arrays["q"].shape[0] if a == TIME else sizes[a] for a in order)
        d_out = np.zeros(want) if grad_outputs is None else to_float64(grad_outputs, "grad_outputs")
        if d_out.shape != want:
            raise ValueError(f"grad_outputs has shape {d_out.shape}, expected {want} for axes {' '.join(order)}")
        d_out = d_out.transpose([order.index(a) for a in canonical])
        grads = interpreter.run_attention_backward(
            self.backward, qb.arrays["q"], kv.arrays["k"], kv.arrays["v"],
            {d.name: kv.arrays[d.name] for d in p.params}, sizes, d_out)
        for name, axes in (("q", p.q_axes), ("k", p.q_axes), ("v", p.v_axes)):
            order = layout_of(layout, name, axes)
            canonical = (TIME, *axes)
            grads[name] = np.require(grads[name].transpose([canonical.index(a) for a in order]), requirements="C")
        return grads

"""Gradients of `ssmc.attention`: the FlashAttention backward with the score modifier differentiated
(passes/attention_grad.py). It runs as the backend's `Backend.attention` says: the tiled torch path
(backends/tiled_attention.py) where torch imports, else (and on the interpreter backend) the interpreter."""

from __future__ import annotations

import numpy as np

from ..backends import interpreter
from ..backends.registry import get_backend
from ..ir.axes import TIME
from ..passes.attention_grad import derive_attention_backward
from ..runtime.binding import DEFAULT_LAYOUT, layout_of, to_float64
from ..runtime.prologue import bind_attention, group_sum


class AttentionGrad:
    """Gradients of `ssmc.attention`'s q, k, v and params given the output's cotangent: NumPy arrays in
    the inputs' layouts (float64 on the interpreter; on the tiled path q's dtype, params in float32 or
    float64, and torch tensors on their device where q is one)."""

    def __init__(self, spec, layout=DEFAULT_LAYOUT, backend: str = "interpreter"):
        self.layout = layout
        self.backend = backend
        self.tiled = get_backend(backend).attention(spec.program)
        self.path = "interpreter" if self.tiled is None else "torch tiled"
        self.backward = derive_attention_backward(spec.program)

    def __call__(self, q, k, v, grad_outputs=None, layout=None, cu_seqlens=None, cu_seqlens_k=None,
                 **params) -> dict:
        """`cu_seqlens` [N+1]: sequences packed along time in a batch of 1 (packed.py): each sequence's
        gradients, q's, k's and v's packed as the inputs, the params' summed over the sequences."""
        p = self.backward.forward
        layout = layout or self.layout
        if cu_seqlens is not None or cu_seqlens_k is not None:
            from .. import packed

            q, k, v = (x if hasattr(x, "shape") else np.asarray(x) for x in (q, k, v))
            return packed.attention_gradients(lambda qi, ki, vi, d: self(qi, ki, vi, d, layout, **params),
                                              p, layout, q, k, v, grad_outputs, cu_seqlens, cu_seqlens_k)
        if self.tiled is not None:
            return self.tiled.gradients(q, k, v, grad_outputs, layout, params)
        qb, kv, group = bind_attention(p, q, k, v, layout, params)
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
            {d.name: qb.arrays[d.name] for d in p.inputs}, sizes, d_out)
        if group > 1:  # k and v were repeated to q's heads: their gradients summed back
            at = 1 + p.batch_axes.index(p.kv_heads)
            grads["k"], grads["v"] = (group_sum(grads[n], group, at) for n in ("k", "v"))
        for name, axes in (("q", p.q_axes), ("k", p.q_axes), ("v", p.v_axes)):
            order = layout_of(layout, name, axes)
            canonical = (TIME, *axes)
            grads[name] = np.require(grads[name].transpose([canonical.index(a) for a in order]), requirements="C")
        return grads

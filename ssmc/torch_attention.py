"""`ssmc.torch.function` of an `ssmc.attention` spec: a differentiable torch function.

    f = ssmc.torch.function(alibi_attention.SPEC, layout="b h t ...")
    out = f(q, k, v, slope)            # or slope=...; q, k [b h t d], v [b h t e] -> out [b h t e]
    out.sum().backward()               # q.grad, k.grad, v.grad, slope.grad
    out = f(q, k, v, slope, cu_seqlens=cu)   # packed: q, k, v [1 h T d], cu [N+1] (packed.py)

Forward and backward run `TiledAttention` (backends/tiled_attention.py) on the tensors' device
whatever `backend` `ssmc.torch.function` is given: the flash kernels on CUDA bf16 / fp16 tensors they
take, else the tiled torch path. The forward keeps the log-sum-exp of each query row (and the output,
for the flash backward's delta), the backward recomputes the probabilities from it. The output has
q's dtype; each gradient its input's. Under `torch.compile` the function is one custom op
(torch_library.py).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .backends.tiled_attention import TiledAttention
from .runtime.prologue import attention_params
from .torch_library import attention_op


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: AttentionFunction, names: tuple, q, k, v, *params):
        tiled, p = fn.tiled, fn.program
        call = tiled.bind(q, k, v, fn.layout, dict(zip(names, params)))
        # params that need no gradient (ALiBi's fixed slopes, say) let the flash backward sum none of them
        param_grads = any(ctx.needs_input_grad[5:])
        out32 = tiled.delta_output(call, param_grads)
        out, lse = tiled.forward(call, out32=out32)
        y = tiled.to_layout(call, out, "out", p.v_axes, fn.layout)
        # saved, so an input changed in place before the backward is torch's error, not a wrong gradient;
        # the output too where the flash backward takes its delta from it (its fp32 copy where params are)
        flash = tiled.flash_backward(call) is not None and out32 is None
        ctx.save_for_backward(q, k, v, *params, *((y,) if flash else ()))
        ctx.fn, ctx.call, ctx.lse, ctx.flash, ctx.out32, ctx.param_grads = fn, call, lse, flash, out32, param_grads
        ctx.names = names
        return y

    @staticmethod
    @once_differentiable  # the backward is not itself differentiable by torch: an error, not zeros
    def backward(ctx, d_y):
        tensors = ctx.saved_tensors  # torch checks here that no input changed in place since the forward
        fn, call = ctx.fn, ctx.call
        tiled, p = fn.tiled, fn.program
        # the output and cotangent as given (16-bit where the flash backward reads them so: no widening copies)
        out = tiled.from_layout(call, tensors[-1], "out", fn.layout, keep_dtype=True) if ctx.flash else ctx.out32
        d_out = tiled.from_layout(call, d_y, "grad_outputs", fn.layout, keep_dtype=True)
        grads = tiled.backward(call, ctx.lse, d_out, out=out, param_grads=ctx.param_grads)
        q, k, v = tensors[:3]
        result = [tiled.to_layout(call, grads[name], name, axes, fn.layout, t.dtype)
                  for name, axes, t in (("q", p.q_axes, q), ("k", p.q_axes, k), ("v", p.v_axes, v))]
        params = {d.name for d in p.params}  # sequences (document ids) get no gradient
        result += [grads[n].to(t.dtype) if ctx.param_grads and n in params else None
                   for n, t in zip(ctx.names, tensors[3:len(tensors) - ctx.flash])]
        return (None, None, *result)


class AttentionFunction:
    """An attention spec as a differentiable function of torch tensors (module docstring)."""

    def __init__(self, spec, layout="t ..."):
        self.program = spec.program
        self.layout = layout
        self.tiled = TiledAttention(self.program)
        self._op = attention_op(self)  # the custom op torch.compile traces (None: this torch has none)

    def __repr__(self) -> str:
        return f"<ssmc.torch.function {self.program.name} (attention, torch tiled)>"

    def __call__(self, q, k, v, *args, cu_seqlens=None, cu_seqlens_k=None, **params):
        """`args`: the modifiers' params in their order after q, k, v (or by name in `params`).
        `cu_seqlens` [N+1]: sequences packed along time in a batch of 1 (packed.py), a call per sequence
        on its views of q, k, v, so that the gradients flow through torch's split and concatenation (the
        params' summed over the sequences)."""
        if cu_seqlens is not None or cu_seqlens_k is not None:
            return self._packed(q, k, v, args, params, cu_seqlens, cu_seqlens_k)
        given = attention_params(self.program, args, params)
        names = tuple(d.name for d in self.program.inputs if d.name in given)
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise ValueError(f"{self.program.name}: unexpected argument {unknown[0]!r}; params are "
                             f"{[d.name for d in self.program.inputs]}")
        tensors = [x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in (q, k, v)]
        values = [given[n] if isinstance(given[n], torch.Tensor) else torch.as_tensor(given[n]) for n in names]
        if _compiling() and self._op is not None and not self.program.seqs and len(names) == len(self.program.params):
            return self._op(*tensors, values)[0]  # traced by torch.compile: one custom op (torch_library.py)
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in (*tensors, *values))):
            return self.tiled(*tensors, self.layout, dict(zip(names, values)))
        return _Attention.apply(self, names, *tensors, *values)

    def _packed(self, q, k, v, args, params, cu_seqlens, cu_seqlens_k):
        from . import packed

        q, k, v = (x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in (q, k, v))
        return packed.attention_call(lambda *one: self(*one, *args, **params), self.program, self.layout,
                                     q, k, v, cu_seqlens, cu_seqlens_k)

    def op_forward(self, q, k, v, params: list, fake: bool = False) -> tuple:
        """The custom op's forward (torch_library.py): (out in the layout, the log-sum-exp [*batch, Lq]);
        `fake`: empty tensors of their shapes, dtypes and device, from the binding alone."""
        tiled, p = self.tiled, self.program
        call = tiled.bind(q, k, v, self.layout, dict(zip((d.name for d in p.params), params)))
        if fake:
            out = call.q.new_empty((*call.q.shape[:-1], call.v.shape[-1]), dtype=call.acc)
            lse = call.q.new_empty(call.q.shape[:-1], dtype=call.acc)
        else:
            out, lse = tiled.forward(call)
        return tiled.to_layout(call, out, "out", p.v_axes, self.layout), lse

    def op_backward(self, q, k, v, params: list, lse, d_out) -> list:
        """The custom op's backward: the gradients of q, k, v and the params, each in its input's dtype."""
        tiled, p = self.tiled, self.program
        call = tiled.bind(q, k, v, self.layout, dict(zip((d.name for d in p.params), params)))
        grads = tiled.backward(call, lse, tiled.from_layout(call, d_out, "grad_outputs", self.layout, keep_dtype=True))
        result = [tiled.to_layout(call, grads[name], name, axes, self.layout, t.dtype)
                  for name, axes, t in (("q", p.q_axes, q), ("k", p.q_axes, k), ("v", p.v_axes, v))]
        return result + [grads[d.name].to(t.dtype) for d, t in zip(p.params, params)]


_compiling = getattr(torch.compiler, "is_compiling", lambda: False)

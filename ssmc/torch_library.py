"""ssmc's torch functions as torch custom ops, so that `torch.compile` traces them without a graph break.

    f = ssmc.torch.function(hgrn.SPEC, layout="b t ...")       # built outside the compiled function
    step = torch.compile(lambda x, g: f(x, g).sum(), fullgraph=True)

While torch traces (`torch.compiler.is_compiling()`), `SsmcFunction.__call__` calls the op
`torch.ops.ssmc.<name>` instead of its autograd Functions; eager calls never do, so they cost no
more host time than before. Per function (one op per program, layout, backend and chunk; the name is
the spec's plus a hash of these, so that equal functions share one op and a name means the same op
in every process):

- `<name>(Tensor[] tensors) -> Tensor[]`: the inputs, then the initial states given (a prefix of the
  states); the outputs in their layouts, then every final state. Its implementation is the eager
  forward without a tape; its fake implementation binds the fake tensors (`bind_arrays`, no
  conversion) for the axis sizes and returns empty tensors of the outputs' and final states' shapes,
  dtypes and device, running no kernel.
- `<name>_backward(Tensor[] tensors, Tensor[] cotangents) -> Tensor[]`: the gradients of the
  tensors. A tape is a Python object and cannot cross the graph, so the backward runs the forward
  again from the saved inputs for its tape, then the derived backward (`Grad.backward`). Cotangents
  of outputs the loss does not use come as zeros. It is not itself differentiable.

An attention spec's function is one op the same way (`attention_op`), whose backward takes the
forward's log-sum-exp, an output of the forward op, instead of running the forward again.

The ops' Python side (`_FUNCTIONS`) holds the first function registered under each name for the
life of the process.
"""

from __future__ import annotations

import hashlib

import torch

from .ir.axes import TIME
from .ir.printer import format_program
from .runtime.binding import bind_arrays, hashable_layout, layout_of

NAMESPACE = "ssmc"
_LIBRARY = None
_FUNCTIONS: dict[str, object] = {}  # op name -> the function its implementations call


def supported() -> bool:
    """Whether this torch registers custom ops with fake implementations and autograd formulas."""
    return hasattr(torch.library, "register_fake") and hasattr(torch.library, "register_autograd")


def op_name(program, *options) -> str:
    """A valid, unique op name: the program's name (as an identifier) and a hash of the program and
    `options`."""
    text = format_program(program) + "\n" + repr(options)
    digest = hashlib.sha256(text.encode()).hexdigest()[:12]
    stem = "".join(c if c.isalnum() else "_" for c in program.name) or "spec"
    return f"{stem}_{digest}"


def _library():
    global _LIBRARY
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
    return _LIBRARY


def recurrence_op(fn):
    """The forward op of `fn` (an `ssmc.torch.SsmcFunction`), registered on first use; None where this
    torch has no custom ops."""
    if not supported():
        return None
    name = op_name(fn.program, hashable_layout(fn.layout), fn.backend, fn.chunk)
    if name not in _FUNCTIONS:
        _register_recurrence(name, fn)
    return getattr(torch.ops.ssmc, name)


def _register_recurrence(name: str, fn) -> None:
    lib = _library()
    qual, qual_bwd = f"{NAMESPACE}::{name}", f"{NAMESPACE}::{name}_backward"
    lib.define(f"{name}(Tensor[] tensors) -> Tensor[]")
    lib.define(f"{name}_backward(Tensor[] tensors, Tensor[] cotangents) -> Tensor[]")
    _FUNCTIONS[name] = fn

    def forward(tensors):
        return list(_unaliased(fn.op_forward(list(tensors)), tensors))

    def forward_fake(tensors):
        outputs, finals = recurrence_shapes(fn, tensors)
        like = tensors[0]
        return ([like.new_empty(shape) for shape in outputs]
                + [like.new_empty(shape, dtype=dtype) for shape, dtype in finals])

    def backward(tensors, cotangents):
        return list(_unaliased(fn.op_backward(list(tensors), list(cotangents)), tensors))

    def backward_fake(tensors, cotangents):
        return [t.new_empty(t.shape) for t in tensors]

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[0])

    def grad_formula(ctx, cotangents):
        return (getattr(torch.ops.ssmc, f"{name}_backward")(list(ctx.saved_tensors), list(cotangents)),)

    lib.impl(name, forward, "CompositeExplicitAutograd")
    lib.impl(f"{name}_backward", backward, "CompositeExplicitAutograd")
    torch.library.register_fake(qual, forward_fake, lib=lib)
    torch.library.register_fake(qual_bwd, backward_fake, lib=lib)
    torch.library.register_autograd(qual, grad_formula, setup_context=setup_context, lib=lib)


def _unaliased(results, inputs):
    """`results`, each copied where it shares storage with an input (a custom op's results may not)."""
    storages = {t.untyped_storage().data_ptr() for t in inputs}
    return [r.clone() if r.untyped_storage().data_ptr() in storages else r for r in results]


def recurrence_shapes(fn, tensors) -> tuple[list, list]:
    """(the outputs' shapes in their layouts, (shape, dtype) of each final state) of a call of `fn` with
    `tensors`, from the binding alone (`bind_arrays` over the tensors as they are: fake tensors and
    symbolic sizes pass). Checks what binding checks: a ValueError naming the argument."""
    p = fn.program
    n_in = len(p.inputs)
    states = {s.name: t for s, t in zip(p.states, tensors[n_in:])}
    bound = bind_arrays(p.inputs, p.states, tuple(tensors[:n_in]), states, fn.layout, p.static_sizes, p.name,
                        p.roots, convert=lambda x, name: x, zeros=lambda shape: None)
    sizes, length = bound.sizes, bound.length
    outputs = [[length if a == TIME else sizes[a] for a in layout_of(fn.layout, name, y.axes)]
               for name, y in p.outputs]
    dtype = fn.final_dtype(tensors)
    finals = [([sizes[a] for a in s.axes], dtype) for s in p.states]
    return outputs, finals


def attention_op(fn):
    """The forward op of `fn` (a `torch_attention.AttentionFunction`), registered on first use; None where
    this torch has no custom ops.

    `<name>(Tensor q, Tensor k, Tensor v, Tensor[] params) -> (Tensor, Tensor)`: the output in its
    layout and the log-sum-exp of each query row ([*batch, Lq], fp32 or fp64), which the backward op
    `<name>_backward(q, k, v, params, lse, d_out) -> Tensor[]` takes as the tiled path's backward does
    (no forward again): the gradients of q, k, v and the params, in that order."""
    if not supported():
        return None
    name = op_name(fn.program, hashable_layout(fn.layout), "attention")
    if name not in _FUNCTIONS:
        _register_attention(name, fn)
    return getattr(torch.ops.ssmc, name)


def _register_attention(name: str, fn) -> None:
    lib = _library()
    qual, qual_bwd = f"{NAMESPACE}::{name}", f"{NAMESPACE}::{name}_backward"
    lib.define(f"{name}(Tensor q, Tensor k, Tensor v, Tensor[] params) -> (Tensor, Tensor)")
    lib.define(f"{name}_backward(Tensor q, Tensor k, Tensor v, Tensor[] params, Tensor lse, Tensor d_out) "
               "-> Tensor[]")
    _FUNCTIONS[name] = fn

    def forward(q, k, v, params):
        return tuple(_unaliased(fn.op_forward(q, k, v, list(params)), (q, k, v, *params)))

    def forward_fake(q, k, v, params):
        return fn.op_forward(q, k, v, list(params), fake=True)

    def backward(q, k, v, params, lse, d_out):
        return list(_unaliased(fn.op_backward(q, k, v, list(params), lse, d_out), (q, k, v, *params, lse, d_out)))

    def backward_fake(q, k, v, params, lse, d_out):
        return [t.new_empty(t.shape) for t in (q, k, v, *params)]

    def setup_context(ctx, inputs, output):
        q, k, v, params = inputs
        ctx.save_for_backward(q, k, v, output[1], *params)

    def grad_formula(ctx, d_out, _d_lse):
        q, k, v, lse, *params = ctx.saved_tensors
        grads = getattr(torch.ops.ssmc, f"{name}_backward")(q, k, v, params, lse, d_out)
        return grads[0], grads[1], grads[2], list(grads[3:])

    lib.impl(name, forward, "CompositeExplicitAutograd")
    lib.impl(f"{name}_backward", backward, "CompositeExplicitAutograd")
    torch.library.register_fake(qual, forward_fake, lib=lib)
    torch.library.register_fake(qual_bwd, backward_fake, lib=lib)
    torch.library.register_autograd(qual, grad_formula, setup_context=setup_context, lib=lib)

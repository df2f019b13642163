"""PyTorch integration: a recurrence as a differentiable function of torch tensors.

    f = ssmc.torch.function(spec, layout="b t ...")          # backend: cuda on GPU tensors, else numba
    y = f(x, gate, h=h0)                                     # h: optional initial state
    y, h_last = ssmc.torch.function(spec, return_final_states=True)(x, gate)
    loss(y).backward()                                       # gradients from the derived backward
    y, h_last = f(x, gate, cu_seqlens=cu)    # packed: x [1 T ...], cu [N+1]; h_last [N ...] (packed.py)
    attn = ssmc.torch.function(alibi_attention.SPEC, layout="b h t ...")   # ssmc.attention: torch_attention.py
    layer = ssmc.torch.Recurrence(lstm.SPEC, sizes={"i": 16, "j": 32, "k": 32})      # an nn.Module: torch_layers.py

The forward runs through `ssmc.grad`'s `Grad.forward` and keeps its tape (the inputs in the
compute dtype and the carries at chunk boundaries, or, when one chunk covers the sequence on the
CPU, every carry); the backward runs the adjoint from it, recomputing only what the tape lacks.
A call's host work is decided once per call signature (`SsmcFunction._plan`: the arguments' types,
shapes, strides, dtypes, devices and requires_grad, and whether grad mode is on): the backend, the
path (a `LeanStep`'s, the general autograd Function's, or the forward without a tape), which params
are copied; later calls of that signature compute the signature, look its plan up and run it.
Under `torch.compile` (fullgraph too) the function is one custom op with a fake implementation and an
autograd formula (torch_library.py); build it outside the compiled code. Eager calls do not take it.
"""

from __future__ import annotations

import operator

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from . import packed
from .api import compile
from .autograd import make_grad
from .autograd.driver import Grad
from .autograd.lean import LeanStep
from .autograd.prepared import PreparedChunk, PreparedStep
from .autograd.stages import StagedGrad
from .backends.cuda.devices import current_device
from .backends.cuda.options import options as cuda_options
from .backends.registry import for_tensor, get_backend
from .frontend.attention import AttentionSpec
from .runtime.binding import from_time_first
from .runtime.precision import casting_gradients, given_half, half_of
from .runtime.prologue import PreparedCalls, program_of
from .torch_layers import Recurrence, set_function
from .torch_library import recurrence_op

__all__ = ["ComplexFunction", "Recurrence", "SsmcFunction", "function"]


def _to_torch(x, like: torch.Tensor) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.contiguous()
    x = np.ascontiguousarray(x)
    if not x.flags.writeable:  # torch warns of tensors over read-only memory
        x = x.copy()
    return torch.from_numpy(x).to(device=like.device)


def _in_dtype(t: torch.Tensor, dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _to_torch_in(x, like: torch.Tensor, dtype) -> torch.Tensor:
    """`_in_dtype(_to_torch(x, like), dtype)` in one copy at most: a torch tensor (a permuted view of a
    time-first output, say) made contiguous and cast at once, not copied in its dtype and then cast."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype=dtype, memory_format=torch.contiguous_format)
    return _in_dtype(_to_torch(x, like), dtype)


def _permute(x, perm):
    return x.permute(*perm) if isinstance(x, torch.Tensor) else x.transpose(perm)


def _first_order(backward):
    """`once_differentiable` at less host time: torch runs a backward with grad mode off unless it builds a
    graph of the backward (``create_graph=True``), and only then is torch's wrapper needed (it makes a
    second derivative an error, not zeros); else the backward runs as it is, without the wrapper's
    ``torch.no_grad()`` and its look at the cotangents."""
    checked = once_differentiable(backward)
    enabled = torch.is_grad_enabled

    def wrapper(ctx, *cotangents):
        if enabled():
            return checked(ctx, *cotangents)
        return backward(ctx, *cotangents)
    return wrapper


class _Recurrence(torch.autograd.Function):
    """The general path: `Grad.forward` (its tape kept) and `Grad.backward`. `call`: the count of tensors
    given, or (from a plan) the prepared step (`autograd.prepared`) that serves calls of this signature,
    whose forward and backward are called directly: what `Grad.forward` and `Grad.backward` would call,
    without their look-ups (the call key, 16-bit inputs, the device) that the plan made once."""

    @staticmethod
    def forward(ctx, fn: SsmcFunction, call, *tensors):
        names = fn.names[:len(tensors)]
        # as given: `Grad` detaches what it keeps (binding, or a prepared step's casts)
        if isinstance(call, int):
            outs, finals, tape = fn.grad.forward(**dict(zip(names, tensors)))
        else:
            outs, finals, tape = call.forward((), dict(zip(names, tensors)), True)
        # the tape holds views of the inputs: saved, so an input changed in place before the backward
        # is torch's "modified by an inplace operation" error, not a wrong gradient
        ctx.save_for_backward(*tensors)
        # outputs the loss does not use get None, not zeros torch fills in: without a cotangent of the
        # final states the backward takes its prepared path (autograd/prepared.py)
        ctx.materialize_grads = False  # `set_materialize_grads(False)`, without its Python call
        ctx.fn, ctx.grad, ctx.tape, ctx.direct = fn, fn.grad, tape, not isinstance(call, int)
        fn.last_step = getattr(tape, "step", None)  # the step a `LeanStep` serves calls like this one from
        like = tensors[0]
        ys = [_to_torch_in(_permute(outs[name], perm), like, like.dtype)
              for name, perm in fn.output_perms]  # as `ssmc.compile` returns them
        return tuple(ys + [_to_torch(finals[s], like) for s in fn.state_names])

    @staticmethod
    @_first_order  # the derived backward is not itself differentiable by torch: an error, not zeros
    def backward(ctx, *cotangents):
        tensors = ctx.saved_tensors  # torch checks here that no input changed in place since the forward
        return (None, None, *_general_backward(ctx.fn, ctx.grad, ctx.tape, tensors, cotangents, ctx.direct))


class _HalfStep:
    """A prepared step of calls with 16-bit inputs, called as `Grad.forward` calls it: in the inputs' 16-bit
    context (runtime/precision.py), the tape marked with their dtype (its backward then sets the context
    again: `_general_backward`)."""

    __slots__ = ("half", "step")

    def __init__(self, step, half):
        self.step, self.half = step, half

    def forward(self, args: tuple, kwargs: dict, outputs: bool):
        with given_half(self.half):
            found = self.step.forward(args, kwargs, outputs)
        if found[2] is not None:
            found[2].half = self.half
        return found


class _LeanRecurrence(torch.autograd.Function):
    """`_Recurrence` for calls like an earlier one that an `autograd.lean.LeanStep` serves."""

    @staticmethod
    def forward(ctx, fn: SsmcFunction, lean, *tensors):
        results, buffer = lean.forward(tensors)
        ctx.save_for_backward(*tensors)
        ctx.materialize_grads = False  # `set_materialize_grads(False)`, without its Python call
        ctx.call = (fn, lean, buffer, fn.grad)
        return results

    @staticmethod
    @_first_order
    def backward(ctx, *cotangents):
        tensors = ctx.saved_tensors
        fn, lean, buffer, grad = ctx.call
        grads = lean.backward(tensors, buffer, cotangents)
        if grads is None:  # cotangents it does not take: the general path, from a tape made now
            grads = _general_backward(fn, grad, lean.tape(tensors, buffer), tensors, cotangents)
        return (None, None, *grads)


def _c_apply(cls):
    """torch's `Function.apply` of `cls` without its Python wrapper, which binds default arguments for a
    `setup_context` (these Functions have none) and looks for functorch transforms: a plan's call takes it
    where no functorch transform is active. `cls.apply` where this torch has no such C method."""
    apply = getattr(getattr(torch._C, "_FunctionBase", None), "__dict__", {}).get("apply")
    return apply.__get__(None, cls) if hasattr(apply, "__get__") else cls.apply


_apply_lean, _apply_general = _c_apply(_LeanRecurrence), _c_apply(_Recurrence)
_transforms_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)


_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _general_backward(fn: SsmcFunction, grad, tape, tensors, cotangents, direct: bool = False) -> tuple:
    """The gradients of `tensors` through `grad.backward` (the `Grad` the forward ran), each as a torch
    tensor of its argument's dtype. `direct`: the tape is a prepared step's, of a call on the current device
    (a plan's: `SsmcFunction._prepared_step`), whose backward is tried first, as `Grad.backward` would."""
    n_out = len(fn.output_perms)
    grad_y = {name: c for (name, _), c in zip(fn.output_perms, cotangents[:n_out]) if c is not None}
    grad_h = {s: c for s, c in zip(fn.state_names, cotangents[n_out:]) if c is not None}
    if tape.step is not None:  # a prepared step's backward casts each gradient as it lays it out (one copy)
        tape.gradient_dtypes = {n: t.dtype for n, t in zip(fn.names, tensors)}
    # the 16-bit inputs' gradients are only cast to their dtypes below: a runner may write them so (the chunked
    # core's time-first ones: no fp32 array of them, the cast then none)
    with casting_gradients(frozenset(n for n, t in zip(fn.names, tensors) if t.dtype in _HALF_DTYPES)):
        if direct:
            with given_half(tape.half):  # as `Grad.backward` sets it (None: unchanged)
                grads = tape.step.backward(tape, grad_y, grad_h or None)
        else:
            grads = None
        if grads is None:
            grads = grad.backward(tape, grad_outputs=grad_y, grad_final_states=grad_h or None)
    like = tensors[0]
    return tuple(_to_torch_in(grads[n], like, t.dtype) for n, t in zip(fn.names, tensors))


class SsmcFunction:
    """A spec as a differentiable function of torch tensors (see the module docstring)."""

    def __init__(self, spec, backend=None, layout="t ...", chunk: int | None = None,
                 return_final_states: bool = False):
        self.program = program_of(spec)
        self.layout = layout
        self.backend = backend
        self.chunk = chunk
        self.return_final_states = return_final_states
        self.names = [d.name for d in self.program.inputs] + [s.name for s in self.program.states]
        self.state_names = [s.name for s in self.program.states]
        self.param_names = {d.name for d in self.program.params}
        # per output: its name and the permutation from time first to its layout (`ssmc.compile`'s)
        self.output_perms = [(name, from_time_first(layout, name, y.axes))
                             for name, y in self.program.outputs]
        self._by_backend: dict[str, tuple] = {}
        self._lean = PreparedCalls()  # call signature (`_signature`) -> its LeanStep, or None (the general path)
        self.last_step = None
        self._reset_fn = None  # packed calls in one (packed.reset_program), made at the first such call
        self._op = recurrence_op(self)  # the custom op torch.compile traces (None: this torch has none)
        # (positional count, keyword names as given) -> the keyword names in the op's order (`names`), for
        # calls of torch tensors only, without cu_seqlens
        self._keywords: dict[tuple, tuple[str, ...]] = {}
        self._plans = PreparedCalls()  # call signature (`_call_signature`) -> its `_Plan`

    def _for(self, backend: str):
        if backend not in self._by_backend:
            self._by_backend[backend] = (compile(self.program, backend, layout=self.layout),
                                         make_grad(self.program, backend, self.layout, self.chunk))
        return self._by_backend[backend]

    def __call__(self, *args, **kwargs):
        # a call of a signature planned before: its plan (`_plan`), after a look-up of the signature
        keywords = self._keywords.get((len(args), *kwargs))
        if keywords is not None and not _compiling():
            tensors = [*args, *map(kwargs.__getitem__, keywords)] if keywords else list(args)
            try:
                key = _call_signature(tensors)
            except AttributeError:  # an argument that is not a tensor: the general call converts it
                key = None
            plan = self._plans.get(key) if key is not None else None
            if plan is not None and plan.current():
                return plan.run(tensors)
        return self._call(args, kwargs)

    def _call(self, args: tuple, kwargs: dict):
        """A call whose signature has no plan yet (or one that takes none: cu_seqlens, arguments that are not
        torch tensors, under torch.compile): the arguments checked, the call made, and its signature
        planned (`_plan`) for the calls like it."""
        given = (len(args), *kwargs)
        inputs = list(args) + [kwargs.pop(d.name) for d in self.program.inputs[len(args):] if d.name in kwargs]
        if len(inputs) != len(self.program.inputs):
            names = [d.name for d in self.program.inputs]
            raise ValueError(f"{self.program.name} takes the inputs {names}; got {len(inputs)}")
        states = []
        for s in self.program.states:
            if s.name in kwargs:
                states.append(kwargs.pop(s.name))
            else:
                break  # initial states are given as a prefix, by name
        cu_seqlens = kwargs.pop("cu_seqlens", None)
        if kwargs:
            raise ValueError(f"unexpected arguments {sorted(kwargs)}")
        tensors = [x if isinstance(x, torch.Tensor) else torch.as_tensor(x) for x in inputs + states]
        if cu_seqlens is not None:
            return self._results(self._packed(tensors, cu_seqlens))
        results = self._results(self._flat(tensors))
        if not _compiling() and all(x is t for x, t in zip(inputs + states, tensors)):
            self._keywords[given] = tuple(self.names[len(args):len(tensors)])
            key = _call_signature(tensors)
            plan = self._plans.get(key)
            if plan is None or not plan.current():
                self._plans.remember(key, self._plan(tensors))
        return results

    def _plan(self, tensors: list) -> _Plan:
        """What calls of the signature of `tensors` do, decided once, after the first such call made its
        prepared steps (`_flat`): the backend, the params copied (`_own_host_params`), and the path: the
        forward without a tape where no gradient is wanted, else the `LeanStep` the first call left, else
        the general autograd Function."""
        backend = self.backend or for_tensor(tensors[0])
        compiled, grad = self._for(backend)
        target = get_backend(backend)
        copied = [] if target.on_device else [i for i, (n, t) in enumerate(zip(self.names, tensors))
                                             if n in self.param_names and t.device.type == "cpu"]
        # what the function returns of the results (`_results`): the one output where that is all it returns
        one_output = len(self.program.outputs) == 1 and not self.return_final_states
        shape_results = _first if one_output else self._results

        def owned(tensors: list) -> list:
            for i in copied:
                tensors[i] = tensors[i].clone()
            return tensors

        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            def run(tensors: list):
                self.compiled, self.grad = compiled, grad
                return shape_results(self._inference(owned(tensors)))
            return _Plan(run)
        key = _signature(target, tensors)
        lean = self._lean.get(key) if key is not None else None
        if lean is None or copied:
            step = None if key is None or copied else self._prepared_step(grad, target, tensors)
            call = len(tensors) if step is None else step

            def run(tensors: list):
                self.compiled, self.grad = compiled, grad
                self.last_step = None
                apply = _Recurrence.apply if _transforms_active() else _apply_general
                return shape_results(apply(self, call, *owned(tensors)))
            # on the device, the path (a prepared step or not) holds for the options and the current device
            # it was decided under (a call on another device than the current one takes the general path)
            return _Plan(run, cuda_options(), current_device()) if target.on_device else _Plan(run)

        def run(tensors: list):
            self.compiled, self.grad = compiled, grad
            if _transforms_active():
                return shape_results(_LeanRecurrence.apply(self, lean, *tensors))
            return shape_results(_apply_lean(self, lean, *tensors))
        return _Plan(run, cuda_options(), current_device())  # the lean step holds for these

    def _packed(self, tensors: list, cu_seqlens) -> tuple:
        """A packed call (packed.py): without initial states given or final states wanted, one call of the
        program that restarts its states at the boundaries (`packed.reset_program`); else one call of
        `_flat` per sequence, joined by torch (autograd follows)."""
        p = self.program
        n_in, n_out = len(p.inputs), len(p.outputs)
        inputs = dict(zip(self.names[:n_in], tensors[:n_in]))
        states = dict(zip(self.state_names, tensors[n_in:]))
        reset = None if states or self.return_final_states else packed.reset_program(p)
        if reset is not None:
            cu, _ = packed.checked(p, self.layout, inputs, states, cu_seqlens)
            if self._reset_fn is None:
                self._reset_fn = SsmcFunction(reset, self.backend, self.layout, self.chunk)
            marks = packed.reset_sequence(p, self.layout, cu, inputs[p.seqs[0].name])
            return self._reset_fn._flat([*tensors[:n_in], marks])[:n_out]

        def run(one: dict, h0: dict) -> tuple:
            results = self._flat([one[n] for n in inputs] + [h0[s] for s in states])
            return results[:n_out], results[n_out:]

        ys, finals = packed.call(run, p, self.layout, inputs, states, cu_seqlens)
        return ys + finals

    def _flat(self, tensors: list) -> tuple:
        """One call: the outputs, then every final state."""
        if _compiling() and self._op is not None:  # traced by torch.compile: one custom op (torch_library.py)
            return self._op(tensors)
        backend = self.backend or for_tensor(tensors[0])
        self.compiled, self.grad = self._for(backend)
        tensors = self._own_host_params(tensors, backend)
        if not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
            results = self._inference(tensors)
        else:
            key = _signature(get_backend(backend), tensors)
            lean = self._lean.get(key)
            if lean is not None:
                results = _LeanRecurrence.apply(self, lean, *tensors)
            else:
                self.last_step = None
                results = _Recurrence.apply(self, len(tensors), *tensors)
                if key is not None and key not in self._lean:
                    self._lean.remember(key, LeanStep.build(self.last_step, self.names[:len(tensors)],
                                                            self.output_perms, tensors))
        return results

    def _prepared_step(self, grad, target, tensors: list):
        """The prepared step (`autograd.prepared`: `PreparedStep`, `PreparedChunk`) that `grad` keeps for
        calls like this one, where `Grad.forward` would take it as it is: a `Grad`, the tensors on the current
        device (the caller's key says), with 16-bit inputs in their context as `Grad.forward` sets it
        (`_HalfStep`); for a `StagedGrad` its `PreparedStages` (which sets each stage's 16-bit context itself);
        else None."""
        if isinstance(grad, StagedGrad):
            key = grad._steps.key(target, (), dict(zip(self.names, tensors)), grad.layout)
            return (grad._steps.get(key) or None) if key is not None else None
        if not isinstance(grad, Grad):
            return None
        key = grad._steps.key(target, (), dict(zip(self.names, tensors)), grad.layout)
        step = grad._steps.get(key) if key is not None else None
        if not isinstance(step, (PreparedStep, PreparedChunk)):
            return None
        half = half_of(tensors)
        return step if half is None else _HalfStep(step, half)

    def _own_host_params(self, tensors: list, backend: str) -> list:
        """`tensors` with each param on the CPU replaced by a copy (autograd flows through it), where
        `backend` runs on the host.

        On the host the backends read views of the tensors' memory (`Tensor.numpy()`, after which torch
        refuses to resize that storage) and the tape keeps them until the backward. A param's storage may
        be freed and refilled in between: FSDP (`fully_shard`, and `FullyShardedDataParallel`) frees the
        gathered params after the forward by resizing their storage to zero and gathers them again before
        the backward. A copy gives the host backends memory of their own; params are small beside the
        sequences."""
        if get_backend(backend).on_device:  # a device backend reads tensors through torch, never NumPy views
            return tensors
        params = self.param_names
        return [t.clone() if n in params and t.device.type == "cpu" else t for n, t in zip(self.names, tensors)]

    def _results(self, results) -> tuple:
        n_out = len(self.program.outputs)
        ys, finals = results[:n_out], results[n_out:]
        ys = ys[0] if len(ys) == 1 else tuple(ys)
        if not self.return_final_states:
            return ys
        return ys, finals[0] if len(finals) == 1 else tuple(finals)

    def op_forward(self, tensors: list) -> tuple:
        """The custom op's forward (torch_library.py): outputs, then every final state, in the dtype
        `final_dtype` says."""
        self.compiled, self.grad = self._for(self.backend or for_tensor(tensors[0]))
        results = self._inference(tensors)
        n_out, dtype = len(self.program.outputs), self.final_dtype(tensors)
        return results[:n_out] + tuple(f.to(dtype) for f in results[n_out:])

    def op_backward(self, tensors: list, cotangents: list) -> tuple:
        """The custom op's backward: the forward again for its tape, then the gradients of `tensors`."""
        self.compiled, self.grad = self._for(self.backend or for_tensor(tensors[0]))
        tape = self.grad.forward(**dict(zip(self.names, tensors)))[2]
        return _general_backward(self, self.grad, tape, tensors, cotangents)

    def final_dtype(self, tensors: list) -> torch.dtype:
        """The final states' dtype for these tensors: the backend's compute dtype (float64 where one
        is float64 or not floating point, as binding converts them)."""
        given = np.float64 if any(t.dtype == torch.float64 or not t.is_floating_point() for t in tensors) \
            else np.float32
        dtype = get_backend(self.backend or for_tensor(tensors[0])).compute_dtype(np.dtype(given))
        return _TORCH_DTYPES[np.dtype(dtype)]

    def _inference(self, tensors: list) -> tuple:
        """The plain forward, no tape: outputs in the first input's dtype (as with a tape), then the
        final states."""
        names = self.names[:len(tensors)]
        ys, finals = self.compiled(**dict(zip(names, tensors)), return_final_states=True)
        like = tensors[0]
        ys = tuple(_in_dtype(_to_torch(y, like), like.dtype) for y in (ys if isinstance(ys, tuple) else (ys,))
                   ) if ys is not None else ()
        finals = tuple(_to_torch(f, like) for f in (finals if isinstance(finals, tuple) else (finals,)))
        return ys + finals


_first = operator.itemgetter(0)
_TORCH_DTYPES = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}
_compiling = getattr(torch.compiler, "is_compiling", lambda: False)


class _Plan:
    """A call signature's plan (`SsmcFunction._plan`): `run(tensors)` makes a call and returns what the
    function returns; `current()` says whether the plan still holds: one made under the CUDA backend's
    options and current device (`options`, `device`; None: it depends on neither) holds while they stay."""

    __slots__ = ("device", "options", "run")

    def __init__(self, run, options=None, device=None):
        self.run, self.options, self.device = run, options, device

    def current(self) -> bool:
        if self.options is None:
            return True
        return cuda_options() is self.options and current_device() == self.device


def _call_signature(tensors: list) -> tuple:
    """What a call's plan depends on of its arguments: whether grad mode is on and, per tensor, its type,
    shape, strides, dtype, device and requires_grad (AttributeError where one is not a tensor)."""
    return (torch.is_grad_enabled(),
            *[(type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors])


def _signature(backend, tensors: list) -> tuple | None:
    """What a `LeanStep` depends on of a call (`Backend.call_key`: shapes, strides, dtypes and devices of
    its tensors, the overrides); None where its first tensor is not on the backend's current device
    (the general path switches devices), or the backend prepares no such call."""
    if not backend.on_current_device(tensors[0]):
        return None
    return backend.call_key(tuple(tensors), {})


class ComplexFunction:
    """`SsmcFunction` of a spec with complex values, called on complex torch tensors where the spec
    declares complex values. Each is split into its real and imaginary parts by torch (``x.real``,
    ``x.imag``) and complex results joined by ``torch.complex``, around the function of the real
    program: torch's autograd differentiates the split and the join, so gradients follow its
    convention for complex tensors (complex_io.py)."""

    def __init__(self, signature, spec, backend=None, layout="t ...", chunk: int | None = None,
                 return_final_states: bool = False):
        from .complex_io import ComplexCall

        self.call = ComplexCall(signature)
        self.return_final_states = return_final_states
        self.inner = SsmcFunction(program_of(spec), backend, self.call.layout(layout), chunk, True)
        self.program = self.inner.program

    def __call__(self, *args, **kwargs):
        given = self.call.arguments(args, kwargs)
        p = self.program
        names = [d.name for d in p.inputs] + [s.name for s in p.states]
        tensors = {n: given[n] if isinstance(given[n], torch.Tensor) else torch.as_tensor(given[n])
                   for n in names if n in given}
        ys, finals = self.inner(**tensors)
        ys = ys if isinstance(ys, tuple) else (ys,) if p.outputs else ()
        finals = finals if isinstance(finals, tuple) else (finals,)
        ys = self.call.joined(dict(zip([n for n, _ in p.outputs], ys)), self.call.output_names)
        ys = tuple(ys.values())
        ys = ys[0] if len(ys) == 1 else ys
        if not self.return_final_states:
            return ys
        finals = tuple(self.call.joined(dict(zip([s.name for s in p.states], finals)), self.call.state_names).values())
        return ys, finals[0] if len(finals) == 1 else finals


def function(spec, backend=None, *, layout="t ...", chunk: int | None = None,
             return_final_states: bool = False):
    """Wrap a recurrence spec as a differentiable torch function (module docstring); an attention spec
    as `torch_attention.AttentionFunction` (the tiled torch path on the tensors' device); a spec with
    complex values as `ComplexFunction` (complex tensors in and out)."""
    if isinstance(spec, AttentionSpec):
        if return_final_states:
            raise ValueError("attention has no final states (return_final_states=True)")
        from .torch_attention import AttentionFunction

        return AttentionFunction(spec, layout)
    signature = getattr(spec, "complex_signature", None)
    if signature is not None:
        return ComplexFunction(signature, spec, backend, layout, chunk, return_final_states)
    return SsmcFunction(spec, backend, layout, chunk, return_final_states)


set_function(function)  # what `Recurrence` builds its function with (torch_layers.py imports no ssmc.torch)

"""Complex arrays at the API boundary: a spec with complex inputs, states or outputs, called on
complex NumPy arrays (or torch tensors).

A complex argument ``x`` is the program's two real inputs ``x_re`` and ``x_im`` (frontend/complex.py);
here it is split on the way in (complex128 -> two float64 arrays, complex64 -> two float32) and the
results are joined on the way out: a complex output or final state comes back as one complex array.

Gradients follow torch's convention for complex inputs: for a real loss L, the gradient of a
complex ``x = a + ib`` is ``dL/da + i dL/db``, and a complex cotangent ``g`` of a complex output
``y = u + iv`` means ``dL/du = Re g``, ``dL/dv = Im g`` (as ``y.backward(g)``), so
``ssmc.torch.function`` on complex tensors agrees with torch autograd of a torch loop.
"""

from __future__ import annotations

import numpy as np

from .frontend.complex import ComplexSignature

__all__ = ["ComplexCall", "ComplexCompiled", "ComplexGrad", "ComplexStep"]


def is_complex_array(x) -> bool:
    if hasattr(x, "is_complex") and callable(x.is_complex):  # torch
        return bool(x.is_complex())
    return np.iscomplexobj(x)


def split(x) -> tuple:
    """(re, im) of a complex array, each contiguous (torch: differentiable views made contiguous)."""
    if hasattr(x, "is_complex") and callable(x.is_complex):
        return x.real.contiguous(), x.imag.contiguous()
    x = np.asarray(x)
    return np.ascontiguousarray(x.real), np.ascontiguousarray(x.imag)


def join(re, im):
    """``re + i im`` as one complex array (complex64 for float32 parts, complex128 else)."""
    if hasattr(re, "is_complex") and callable(re.is_complex):
        import torch

        if re.dtype != im.dtype:
            im = im.to(re.dtype)
        return torch.complex(re, im)
    re, im = np.asarray(re), np.asarray(im)
    out = np.empty(np.broadcast_shapes(re.shape, im.shape),
                   np.complex64 if re.dtype == np.float32 and im.dtype == np.float32 else np.complex128)
    out.real, out.imag = re, im
    return out


class ComplexCall:
    """The pairing of a spec's complex names with its program's real ones (`ComplexSignature`), and
    the splitting and joining of a call's arrays by it."""

    def __init__(self, signature: ComplexSignature):
        self.signature = signature
        self.pairs = signature.parts()
        self.input_names = [n for n, _ in signature.inputs]
        self.state_names = [n for n, _ in signature.states]
        self.output_names = [n for n, _ in signature.outputs]
        self.part_of = {p: n for n, pair in self.pairs.items() for p in pair}

    def layout(self, layout):
        """A layout for the program: a dict naming a complex input or output names both its parts."""
        if not isinstance(layout, dict):
            return layout
        out = {}
        for name, template in layout.items():
            for part in self.pairs.get(name, (name,)):
                out.setdefault(part, template)
        return out

    def arguments(self, args: tuple, kwargs: dict, views: bool = False) -> dict:
        """The call's arrays by the program's names: positional args are the inputs in signature
        order, keywords inputs or initial states by name (a real part's own name passes as it is).
        `views`: a complex torch tensor's parts are its ``.real`` and ``.imag`` views (no copy; every other
        element of its memory), not `split`'s contiguous copies."""
        sig = self.signature
        # the program's inputs, in order: a complex input's pair where it stands
        program_inputs = [n for name, pair in sig.inputs for n in (pair or (name,))]
        if len(args) > len(program_inputs):
            raise ValueError(f"{sig.name} takes the inputs {self.input_names}; got {len(args)} positional arguments")
        # more positional arguments than the user's inputs: the program's real inputs (ssmc.torch.Recurrence)
        given = dict(zip(self.input_names if len(args) <= len(self.input_names) else program_inputs, args))
        for name, value in kwargs.items():
            if name in given:
                raise ValueError(f"argument {name!r} given twice")
            given[name] = value
        out = {}
        for name, value in given.items():
            pair = self.pairs.get(name)
            if pair is None:
                if name in self.pairs or (name not in self.part_of and name not in self.input_names
                                          and name not in self.state_names):
                    raise ValueError(f"{sig.name} has no input or state {name!r}; its inputs are "
                                     f"{self.input_names}, its states {self.state_names}")
                if is_complex_array(value):
                    raise ValueError(f"argument {name!r} of {sig.name} is declared real but a complex array "
                                     f"was given (take its real part, or declare it ssmc.<Role>[..., complex])")
                out[name] = value
                continue
            if not is_complex_array(value):
                dtype = getattr(value, "dtype", type(value).__name__)
                raise ValueError(f"argument {name!r} of {sig.name} is declared complex: give a complex array "
                                 f"(complex128 or complex64), not {dtype}")
            out[pair[0]], out[pair[1]] = (value.real, value.imag) if views and hasattr(value, "data_ptr") \
                else split(value)
        return out

    def cotangents(self, values, names: list[str], what: str) -> dict | None:
        """Cotangents given by the user's names (a dict, one array, or a tuple in order) by the
        program's: a complex one's real and imaginary parts go to its two parts."""
        if values is None:
            return None
        if isinstance(values, dict):
            unknown = sorted(set(values) - set(names))
            if unknown:
                raise ValueError(f"{what}: unknown names {unknown}; expected {names}")
            named = dict(values)
        elif len(names) == 1 and not isinstance(values, (tuple, list)):
            named = {names[0]: values}
        else:
            if len(values) != len(names):
                raise ValueError(f"{what}: expected {len(names)} arrays for {names}, got {len(values)}")
            named = dict(zip(names, values))
        out = {}
        for name, value in named.items():
            pair = self.pairs.get(name)
            if pair is None:
                if is_complex_array(value):
                    raise ValueError(f"{what}[{name!r}] is complex but {name!r} is real")
                out[name] = value
            elif is_complex_array(value):
                out[pair[0]], out[pair[1]] = split(value)
            else:  # a real cotangent of a complex value: its imaginary part zero
                out[pair[0]] = value
        return out

    def joined(self, arrays: dict, names: list[str]) -> dict:
        """`arrays` by the program's names as arrays by the user's `names`, complex ones joined."""
        out = {}
        for name in names:
            pair = self.pairs.get(name)
            out[name] = arrays[name] if pair is None else join(arrays[pair[0]], arrays[pair[1]])
        return out

    def gradients(self, grads: dict) -> dict:
        """Gradients by the program's names as gradients by the user's (torch's convention: the
        gradient of a complex x = a + ib is dL/da + i dL/db)."""
        return self.joined(grads, self.input_names + self.state_names)


def _single(values: tuple):
    return values[0] if len(values) == 1 else values


class ComplexCompiled:
    """`api.Compiled` of a spec with complex values: called like it, on complex arrays where the spec
    declares complex values; complex outputs and final states come back complex."""

    def __init__(self, signature: ComplexSignature, compiled):
        self.call = ComplexCall(signature)
        self.compiled = compiled        # the `Compiled` of the real program
        self.program = compiled.program
        self.backend = compiled.backend
        self.layout = compiled.layout

    def __repr__(self) -> str:
        return f"<ssmc.Compiled {self.program.name} backend={self.backend} (complex)>"

    def run(self, *args, layout=None, **kwargs) -> tuple[dict, dict]:
        """(outputs, final states) by the user's names, time first (`Compiled.run`)."""
        outs, finals = self.compiled.run(layout=self.call.layout(layout), **self.call.arguments(args, kwargs))
        return self.call.joined(outs, self.call.output_names), self.call.joined(finals, self.call.state_names)

    def __call__(self, *args, return_final_states: bool = False, layout=None, **kwargs):
        ys, finals = self.compiled(layout=self.call.layout(layout), return_final_states=True,
                                   **self.call.arguments(args, kwargs))
        p = self.program
        ys = ys if isinstance(ys, tuple) else (ys,) if ys is not None else ()
        finals = finals if isinstance(finals, tuple) else (finals,)
        ys = self.call.joined(dict(zip([n for n, _ in p.outputs], ys)), self.call.output_names)
        ys = _single(tuple(ys.values())) if ys else None
        if not return_final_states:
            return ys
        finals = self.call.joined(dict(zip([s.name for s in p.states], finals)), self.call.state_names)
        return ys, _single(tuple(finals.values()))


class ComplexGrad:
    """`ssmc.grad` of a spec with complex values (`autograd.Driver`'s calls, by the user's names and
    on complex arrays; the gradient convention is the module docstring's)."""

    def __init__(self, signature: ComplexSignature, driver):
        self.call = ComplexCall(signature)
        self.driver = driver           # the gradient of the real program
        self.program = driver.program
        self.backend = driver.backend

    def __call__(self, *args, grad_outputs=None, grad_final_states=None, layout=None, **kwargs) -> dict:
        """{input or state name: gradient}, complex for a complex one."""
        c = self.call
        grads = self.driver(grad_outputs=c.cotangents(grad_outputs, c.output_names, "grad_outputs"),
                            grad_final_states=c.cotangents(grad_final_states, c.state_names, "grad_final_states"),
                            layout=c.layout(layout), **c.arguments(args, kwargs))
        return c.gradients(grads)

    def forward(self, *args, layout=None, **kwargs):
        """(outputs, final states, tape) as `Driver.forward`, complex ones joined."""
        c = self.call
        outs, finals, tape = self.driver.forward(layout=c.layout(layout), **c.arguments(args, kwargs))
        return c.joined(outs, c.output_names), c.joined(finals, c.state_names), tape

    def backward(self, tape, grad_outputs=None, grad_final_states=None) -> dict:
        c = self.call
        grads = self.driver.backward(tape, grad_outputs=c.cotangents(grad_outputs, c.output_names, "grad_outputs"),
                                     grad_final_states=c.cotangents(grad_final_states, c.state_names,
                                                                    "grad_final_states"))
        return c.gradients(grads)


class ComplexStep:
    """`api.Step` (the single-step form) of a spec with complex values: one step of each sequence,
    complex where declared; it returns (the outputs at that step, the new states), complex ones
    joined, and the new states go back in as ``states=``. ``out=`` and ``in_place=`` as `api.Step`'s (the
    complex arrays given written by a copy)."""

    def __init__(self, signature: ComplexSignature, step):
        self.call = ComplexCall(signature)
        self.step = step               # the `Step` of the real program
        self.program = step.program
        self.backend = step.backend

    def __repr__(self) -> str:
        return f"<ssmc.Step {self.program.name} backend={self.backend} (complex)>"

    def __call__(self, *args, states=None, out=None, in_place: bool = False, **kwargs):
        c = self.call
        if states is not None:
            if isinstance(states, dict):
                given = dict(states)
            elif isinstance(states, (tuple, list)):
                given = dict(zip(c.state_names, states))
            else:
                given = {c.state_names[0]: states}
            for name in given:
                if name in kwargs:
                    raise ValueError(f"argument {name!r} given twice")
            kwargs = {**kwargs, **given}
        absent = [n for n in c.state_names if n not in kwargs]
        if in_place and absent:
            raise ValueError(f"{self.program.name} step: in_place=True writes the new states into the arrays given; "
                             f"missing the states {absent}")
        targets = tuple(kwargs.get(n) for n in c.state_names)
        done = self._own(args, kwargs, out, in_place, targets)
        if done is not None:
            return done
        ys, finals = self.step(**c.arguments(args, kwargs))
        p = self.program
        ys = ys if isinstance(ys, tuple) else (ys,) if ys is not None else ()
        finals = finals if isinstance(finals, tuple) else (finals,)
        ys = tuple(c.joined(dict(zip([n for n, _ in p.outputs], ys)), c.output_names).values())
        finals = tuple(c.joined(dict(zip([s.name for s in p.states], finals)), c.state_names).values())
        ys, finals = (_single(ys) if ys else None), _single(finals)
        if out is not None:
            ys = self.step.written(out, ys, list(c.output_names), "out")
        if in_place:
            finals = self.step.written(targets, finals, list(c.state_names), "states")
        return ys, finals

    def _own(self, args: tuple, kwargs: dict, out, in_place: bool, targets: tuple):
        """The real step's own path (`api.Step`'s ``_own``: on cuda its kernels) on the ``.real`` and ``.imag``
        views of complex torch tensors: its kernels read the parts where they lie, write the ``out=`` arrays
        (real outputs) and, ``in_place``, the new states into the parts of the complex state tensors given, so
        with both given a step copies and allocates nothing. None where that path does not take the call (then
        the parts are split and joined by copies)."""
        step, c = self.step, self.call
        own = getattr(step, "_own", None)
        if own is None or (out is not None and any(n in c.pairs for n in c.output_names)):
            return None
        if not all(hasattr(v, "data_ptr") for v in (*args, *kwargs.values())):
            return None  # NumPy arrays: the general path
        if any(v.is_conj() or v.is_neg() for v in (*args, *kwargs.values())):
            return None  # a lazy conjugate: its ``.imag`` view's memory holds the part unnegated (a bit says so)
        real = c.arguments(args, kwargs, views=True)
        given = {n: real[n] for n in step._names if n in real}
        initial = {n: real[n] for n in step._state_names if n in real}
        if len(given) != len(step._names) or len(given) + len(initial) != len(real):
            return None  # missing inputs or other keywords: the general path's errors
        done = own(given, initial, out, in_place)
        if done is None:
            return None
        ys, finals = done
        p = self.program
        if out is None:
            ys = ys if isinstance(ys, tuple) else (ys,) if ys is not None else ()
            ys = tuple(c.joined(dict(zip([n for n, _ in p.outputs], ys)), c.output_names).values())
            ys = _single(ys) if ys else None
        if in_place:
            return ys, _single(targets)
        finals = finals if isinstance(finals, tuple) else (finals,)
        return ys, _single(tuple(c.joined(dict(zip([s.name for s in p.states], finals)), c.state_names).values()))

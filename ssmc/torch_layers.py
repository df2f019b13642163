"""`ssmc.torch.Recurrence`: a recurrence spec as an `nn.Module` that owns the spec's params.

    layer = ssmc.torch.Recurrence(lstm.SPEC, layout="b t ...", sizes={"i": 16, "j": 32, "k": 32})
    y = layer(x)                                           # x [b t i]; W, U, bias are layer's parameters
    y, (h, c) = layer(x, return_final_states=True)
    y_t, (h, c) = layer.step(x_t, states=(h, c))           # one step: x_t [b i], no time axis

Every `ssmc.Param` of the spec is an `nn.Parameter` of the module under its own name, of the shape its
axes' sizes give (`sizes=`, or the static sizes the spec declares, ``"g=4"``), so it moves with `.to()`,
saves and loads with `state_dict` and trains like any other, under DDP and FSDP too (tests/test_ddp.py;
FSDP2 gathers the params around `forward` alone: ``torch.distributed.fsdp.register_fsdp_forward_method(
layer, "step")`` for `step`). The call runs `ssmc.torch.function` (built once per module) on the
sequences given and the parameters, in the spec's signature order.

Initialisation (`reset_parameters`): `init` maps a param's name to a callable that fills a tensor in
place (`torch.nn.init.*` alike; a tensor it returns is copied in) or to a tensor (or array) of the
param's shape. A param `init` leaves out gets the default: where some axis of it is one a sum in the
step reduces (`ssmc.dot(x, W, over="i")`: W's ``i``), uniform in +-1/sqrt(fan_in), fan_in the product
of those axes' sizes (torch.nn.Linear's rule); otherwise normal with standard deviation 0.02. Params
with a meaning of their own (Mamba's negative ``A``, a decay) want an `init` of their own.

This module does not import `ssmc.torch` (which re-exports it): `ssmc.torch` hands it its `function`
(`set_function`), as `api.py` hands the front end its compiler.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from .api import Step, state_dict_of, time_positions
from .frontend.attention import AttentionSpec
from .ir.ops import Op
from .runtime.prologue import program_of

_FUNCTION = None  # ssmc.torch.function, set by ssmc.torch
OPTIONS = ("backend", "chunk")  # what `ssmc.torch.function` takes besides the spec and layout
DEFAULT_STD = 0.02
_OWN_STEPS: dict = {}  # (program, layout, backend) -> the backend's own step path, or None (`Recurrence._own_step`)


def set_function(function) -> None:
    global _FUNCTION
    _FUNCTION = function


def reduced_axes(program) -> set[str]:
    """The axes some sum or max in the step reduces."""
    return {n.arg for n in program.nodes() if n.op in (Op.SUM, Op.REDUCE_MAX)}


def param_shapes(program, sizes: dict | None) -> dict[str, tuple[int, ...]]:
    """Each param's shape from `sizes` and the program's static sizes; a ValueError naming `sizes`
    where an axis has neither, or a size given disagrees with the spec's."""
    sizes = dict(sizes or {})
    static = program.static_sizes
    for axis, n in sizes.items():
        if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
            raise ValueError(f"sizes: axis {axis!r} needs a positive integer size, not {n!r}")
        if axis in static and static[axis] != n:
            raise ValueError(f"sizes: axis {axis!r} is {static[axis]} in {program.name}, not {n}")
    known = {**sizes, **static}
    shapes = {}
    for d in program.params:
        missing = [a for a in d.axes if a not in known]
        if missing:
            raise ValueError(f"sizes: param {d.name!r} of {program.name} has axes {list(d.axes)}; "
                             f"give the size of {missing} (sizes={{{missing[0]!r}: ...}})")
        shapes[d.name] = tuple(int(known[a]) for a in d.axes)
    return shapes


class Recurrence(nn.Module):
    """A recurrence spec as a layer owning its params (module docstring).

    `layout`: the sequences' layout (``ssmc.torch.function``'s); `init`: name -> callable or tensor;
    `dtype` / `device`: the params' (default: torch's default dtype, the CPU); `sizes`: axis -> size
    for the params' axes the spec leaves open; `options`: ``backend``, ``chunk`` for the function.
    """

    def __init__(self, spec, layout="b t ...", init: dict | None = None, dtype=None, *, sizes: dict | None = None,
                 device=None, **options):
        super().__init__()
        if isinstance(spec, AttentionSpec):
            raise ValueError("spec: Recurrence takes a recurrence spec; use ssmc.torch.function for attention")
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"options: unknown {unknown}; Recurrence passes on {list(OPTIONS)}")
        if _FUNCTION is None:  # pragma: no cover - ssmc.torch sets it on import
            raise RuntimeError("import ssmc.torch to use ssmc.torch.Recurrence")
        program = program_of(spec)
        self.program = program
        self.layout = layout
        self.options = dict(options)
        shapes = param_shapes(program, sizes)
        init = dict(init or {})
        unknown = sorted(set(init) - set(shapes))
        if unknown:
            raise ValueError(f"init: {program.name} has the params {list(shapes)}, not {unknown}")
        self._init = init
        for name, shape in shapes.items():
            if hasattr(self, name):
                raise ValueError(f"spec: param {name!r} clashes with an attribute of nn.Module; rename it")
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype, device=device)))
        self.param_names = list(shapes)
        self._reduced = reduced_axes(program)
        self._seq_time, self._out_time = time_positions(program, layout)
        self._fn = _FUNCTION(spec, layout=layout, return_final_states=True, **options)
        self.reset_parameters()

    def extra_repr(self) -> str:
        return f"{self.program.name}, layout={self.layout!r}"

    def reset_parameters(self) -> None:
        """Each param from its `init`, else the default (module docstring)."""
        with torch.no_grad():
            for d in self.program.params:
                p = getattr(self, d.name)
                how = self._init.get(d.name)
                if how is None:
                    fan_in = math.prod(n for a, n in zip(d.axes, p.shape) if a in self._reduced)
                    if any(a in self._reduced for a in d.axes):
                        bound = 1.0 / math.sqrt(fan_in)
                        nn.init.uniform_(p, -bound, bound)
                    else:
                        nn.init.normal_(p, 0.0, DEFAULT_STD)
                elif callable(how):
                    out = how(p)
                    if isinstance(out, torch.Tensor) and out is not p:
                        self._copy_in(d.name, p, out)
                else:
                    self._copy_in(d.name, p, how)

    @staticmethod
    def _copy_in(name: str, p: torch.Tensor, value) -> None:
        value = torch.as_tensor(value)
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"init: param {name!r} has the shape {tuple(p.shape)}, not {tuple(value.shape)}")
        p.copy_(value)

    def _arguments(self, seqs: tuple, named: dict) -> list:
        """The function's inputs in signature order: the sequences given, then the params."""
        p = self.program
        seq_names = [d.name for d in p.seqs]
        if len(seqs) > len(seq_names):
            raise ValueError(f"{p.name} takes the sequences {seq_names}; got {len(seqs)}")
        given = dict(zip(seq_names, seqs))
        for name, x in named.items():
            if name not in seq_names:
                raise ValueError(f"unexpected argument {name!r}: {p.name} takes the sequences {seq_names}")
            if name in given:
                raise ValueError(f"argument {name!r} given twice")
            given[name] = x
        missing = [n for n in seq_names if n not in given]
        if missing:
            raise ValueError(f"{p.name} takes the sequences {seq_names}; missing {missing}")
        return [given[d.name] if d.name in given else getattr(self, d.name) for d in p.inputs]

    def _own_step(self, first):
        """The backend's own step path (`Backend.step_runner`) for tensors like `first`, or None."""
        from .backends.registry import for_tensor, get_backend
        from .runtime.binding import hashable_layout

        backend = self.options.get("backend") or for_tensor(first)
        key = (self.program, hashable_layout(self.layout), backend)
        if key not in _OWN_STEPS:  # kept here, not on the module: a layer deep-copies without them
            _OWN_STEPS[key] = get_backend(backend).step_runner(self.program, self.layout)
        return _OWN_STEPS[key]

    def _states(self, states, argument: str) -> dict:
        """The initial states as the function takes them: by name, a prefix of the states in order."""
        given = state_dict_of(self.program, states, argument)
        names = [s.name for s in self.program.states]
        prefix = names[:len(given)]
        if set(prefix) != set(given):
            raise ValueError(f"{argument}: give the states in order from the first ({names}); got {sorted(given)}")
        return {n: given[n] for n in prefix}

    def forward(self, *seqs, initial_states=None, return_final_states: bool = False, cu_seqlens=None, **named):
        """The outputs over the sequences (in `layout`), and with `return_final_states` the final
        states (one tensor, or a tuple in state order). `initial_states`: one tensor, a tuple in state
        order, or a dict by name (the states left out start at zero, those given from the first on).
        `cu_seqlens` [N+1]: sequences packed along time in a batch of 1, states per sequence (packed.py)."""
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        ys, finals = self._fn(*self._arguments(seqs, named), **self._states(initial_states, "initial_states"),
                              **packed)
        return (ys, finals) if return_final_states else ys

    def step(self, *seqs, states=None, out=None, in_place: bool = False, **named):
        """One step: each sequence without its time axis, `states` as `forward`'s `initial_states`
        (None: zeros). Returns (the outputs at that step, the new states), the new states in the form
        `states` takes. Differentiable like `forward`; stepping L times equals one `forward`.

        For decoding (under ``torch.no_grad()``), as `ssmc.step`'s: ``out=`` tensors (one, or a tuple in
        output order, each the output's shape less time) receive the outputs and are returned;
        ``in_place=True`` writes the new states into the state tensors given (all of them), returned as the
        new states. On the cuda backend without grad, a step whose program lowers to one kernel is one launch
        writing them directly (nothing allocated where both are given: backends/cuda/step.py); elsewhere by
        ``copy_`` after the step (its own results allocated as without them)."""
        given = self._states(states, "states")
        if in_place and len(given) < len(self.program.states):
            raise ValueError(f"{self.program.name} step: in_place=True writes the new states into the tensors "
                             f"given; give all the states {[s.name for s in self.program.states]}")
        if (in_place or out is not None) and torch.is_grad_enabled() and any(
                t.requires_grad for t in given.values()):
            raise ValueError(f"{self.program.name} step: out= and in_place=True are for decoding under "
                             "torch.no_grad(); a state that requires grad would be overwritten in the graph")
        args = self._arguments(seqs, named)
        names = [d.name for d in self.program.inputs]
        if not torch.is_grad_enabled():
            own = self._own_step(args[0])
            done = own and own(dict(zip(names, args)), given, out, in_place)
            if done:
                return done
        args = [x.unsqueeze(self._seq_time[n]) if n in self._seq_time else x for n, x in zip(names, args)]
        ys, finals = self._fn(*args, **given)
        positions = list(self._out_time.values())
        if isinstance(ys, tuple):
            ys = tuple(y.squeeze(pos) for y, pos in zip(ys, positions))
        else:
            ys = ys.squeeze(positions[0])
        if out is not None:
            ys = Step.written(out, ys, [n for n, _ in self.program.outputs], "out")
        if in_place:
            finals = Step.written(tuple(given.values()), finals, list(given), "states")
        return ys, finals

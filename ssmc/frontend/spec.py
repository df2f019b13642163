"""``@ssmc.recurrence``: trace a step function into a `Recurrence` program.

    @ssmc.recurrence
    def hgrn(h: ssmc.State["b d"], x: ssmc.Seq["b d"], f: ssmc.Seq["b d"]):
        a = ssmc.sigmoid(f)
        h = a * h + (1 - a) * x
        return h, h                    # (new carry, per-step outputs)

The step is called once, on symbolic tensors; what it computes becomes the IR. Anything that goes
wrong while tracing becomes a `SpecError` at the user's line.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import Loc, SpecError, loc_from_traceback, user_loc
from ..ir.axes import format_axes, parse_axes
from ..ir.node import BOOL, Node
from ..ir.ops import Op
from ..ir.program import Decl, Recurrence, Role
from ..ir.verify import verify
from . import complex as cx
from .shifts import ShiftRegisters
from .shifts import current as shift_registers
from .tensor import Tensor, _static_sizes, _trace_locs, as_tensor


@dataclass(frozen=True)
class Annotation:
    role: Role
    axes: str
    complex: bool = False  # ssmc.State["b d n", complex]: traced as a real pair (frontend/complex.py)

    def __repr__(self) -> str:
        return f"ssmc.{self.role.name.title()}[{self.axes!r}{', complex' if self.complex else ''}]"


class _RoleMarker:
    """``ssmc.State["b d n"]`` and friends: the role and axes of a step argument."""

    def __init__(self, role: Role, doc: str):
        self.role = role
        self.__doc__ = doc

    def __getitem__(self, key) -> Annotation:
        """``[axes]`` or ``[axes, complex]`` (``[axes, float]``: real, the default)."""
        if isinstance(key, tuple):
            if len(key) == 2 and key[1] is cx.complex_:  # ssmc.complex for complex: the same meaning
                key = (key[0], complex)
            if len(key) != 2 or key[1] not in (complex, float):
                raise SpecError(f"ssmc.{self.role.name.title()}[...] takes the axes and optionally the type "
                                f"complex or float (ssmc.{self.role.name.title()}[\"b d\", complex]), got {key!r}",
                                user_loc(2))
            return Annotation(self.role, key[0], key[1] is complex)
        return Annotation(self.role, key)

    def __repr__(self) -> str:
        return f"ssmc.{self.role.name.title()}"


State = _RoleMarker(Role.STATE, "A carry: one value per step, passed from step t-1 to step t.")
Seq = _RoleMarker(Role.SEQ, "A per-step input: one slice of the sequence per step.")
Param = _RoleMarker(Role.PARAM, "An input constant over time (weights, decays, biases).")


class SourceInfo:
    """Line numbers of a function's parameters and return statements (from its source, if any)."""

    def __init__(self, fn: Callable):
        code = fn.__code__
        self.def_loc = Loc(code.co_filename, code.co_firstlineno)
        self.param_lines: dict[str, int] = {}
        self.return_lines: list[int] = []
        try:
            lines, start = inspect.getsourcelines(fn)
            tree = ast.parse(textwrap.dedent("".join(lines)))
        except (OSError, TypeError, SyntaxError):
            return
        func = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))), None)
        if func is None:
            return
        offset = start - 1
        for a in func.args.args + func.args.kwonlyargs:
            self.param_lines[a.arg] = a.lineno + offset
        if isinstance(func, ast.FunctionDef):
            self.def_loc = Loc(code.co_filename, func.lineno + offset)
            self.return_lines = [n.lineno + offset for n in _walk_own(func) if isinstance(n, ast.Return)]

    def param(self, name: str) -> Loc:
        line = self.param_lines.get(name)
        return Loc(self.def_loc.path, line) if line else self.def_loc

    @property
    def return_loc(self) -> Loc:
        return Loc(self.def_loc.path, self.return_lines[-1]) if self.return_lines else self.def_loc


def _walk_own(func: ast.FunctionDef):
    """Nodes of `func` without descending into nested functions."""
    stack = list(func.body)
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))


def read_signature(fn: Callable, src: SourceInfo, allowed: tuple[Role, ...],
                   skip: int = 0, pairs: dict[str, tuple[str, str]] | None = None
                   ) -> tuple[list[Decl], dict[str, int]]:
    """Declarations from a step function's annotations, and the static axis sizes they give.

    A complex argument is declared as its real pair (``x_re``, ``x_im``, adjacent), recorded in
    `pairs` (argument name -> pair); where `pairs` is None complex arguments are a SpecError."""
    try:
        hints = inspect.get_annotations(fn, eval_str=True)
    except Exception as err:
        raise SpecError(f"cannot read the annotations of {fn.__name__}: {err}", src.def_loc) from None
    params = list(inspect.signature(fn).parameters.values())[skip:]
    decls: list[Decl] = []
    sizes: dict[str, int] = {}
    for p in params:
        loc = src.param(p.name)
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise SpecError(f"*{p.name} / **{p.name}: every step argument must be named and annotated", loc)
        ann = hints.get(p.name)
        if not isinstance(ann, Annotation):
            kinds = " / ".join(f"ssmc.{r.name.title()}[...]" for r in allowed)
            raise SpecError(f"argument {p.name!r} needs an annotation {kinds}", loc)
        if ann.role not in allowed:
            kinds = " or ".join(f"ssmc.{r.name.title()}" for r in allowed)
            raise SpecError(f"argument {p.name!r} is a {ann!r} where a {kinds} must be", loc)
        try:
            axes, static = parse_axes(ann.axes)
        except ValueError as err:
            raise SpecError(f"argument {p.name!r}: {err}", loc) from None
        for axis, n in static.items():
            if sizes.setdefault(axis, n) != n:
                raise SpecError(f"axis {axis!r} declared with size {n} here but {sizes[axis]} before", loc)
        if not ann.complex:
            decls.append(Decl(p.name, ann.role, axes, loc))
            continue
        if pairs is None:
            raise SpecError(f"argument {p.name!r} is complex; complex values are supported in recurrences only", loc)
        pairs[p.name] = cx.part_names(p.name)
        decls.extend(Decl(n, ann.role, axes, loc) for n in pairs[p.name])
    names = [p.name for p in params]
    for arg, (re, im) in (pairs or {}).items():
        for part in (re, im):
            if part in names:
                raise SpecError(f"argument {part!r} has the name the complex argument {arg!r}'s real pair "
                                f"takes ({re}, {im}): rename one", src.param(part))
    return decls, sizes


def trace(fn: Callable, leaves: list[Tensor], sizes: dict[str, int], src: SourceInfo,
          locs: dict[Node, Loc] | None = None, registers: ShiftRegisters | None = None):
    """Call `fn` on symbolic tensors; any failure becomes a SpecError at the user's line.

    `locs`, when given, receives the line that built each node in this trace; `registers`, the
    states that ``x.shift(k)`` adds (a recurrence's step; without it a shift is an error).
    """
    token = _static_sizes.set(sizes)
    locs_token = _trace_locs.set({} if locs is None else locs)
    shifts_token = shift_registers.set(registers)
    try:
        return fn(*leaves)
    except SpecError as err:
        raise err.with_traceback(None) from None
    except Exception as err:
        loc = loc_from_traceback(err.__traceback__) or src.def_loc
        raise SpecError(f"{type(err).__name__} while tracing the step: {err}", loc) from None
    finally:
        shift_registers.reset(shifts_token)
        _trace_locs.reset(locs_token)
        _static_sizes.reset(token)


def input_leaf(decl: Decl) -> Tensor:
    return Tensor(Node.make(Op.INPUT, (), decl.name, decl.axes, loc=decl.loc))


def input_leaves(decls: list[Decl], pairs: dict[str, tuple[str, str]]) -> list:
    """One leaf per step argument: a complex one's two real declarations as one `ComplexTensor`."""
    by_name = {d.name: d for d in decls}
    firsts = {re: im for re, im in pairs.values()}
    seconds = set(firsts.values())
    leaves = []
    for d in decls:
        if d.name in firsts:
            leaves.append(cx.ComplexTensor(input_leaf(d), input_leaf(by_name[firsts[d.name]])))
        elif d.name not in seconds:
            leaves.append(input_leaf(d))
    return leaves


def _as_node(value, what: str, loc: Loc) -> Node:
    try:
        return as_tensor(value).node
    except SpecError as err:
        raise SpecError(f"{what}: {err.message}", loc) from None


def _carry_items(carry, names: list[str], loc: Loc) -> list:
    """The values of the returned carry, one per state name, in state order."""
    if isinstance(carry, dict):
        missing = [n for n in names if n not in carry]
        extra = [k for k in carry if k not in names]
        if missing or extra:
            raise SpecError(f"the returned carry must have the states {names}; missing {missing}, "
                            f"unknown {extra}", loc)
        items = [carry[n] for n in names]
    elif isinstance(carry, (tuple, list)) or len(names) > 1:
        items = list(carry) if isinstance(carry, (tuple, list)) else [carry]
        if len(items) != len(names):
            missing = names[len(items):]
            hint = f"; state {missing[0]!r} is not returned" if missing else ""
            raise SpecError(f"the step returns {len(items)} carry value{'s' * (len(items) != 1)} for "
                            f"{len(names)} states {names}{hint}", loc)
    else:
        items = [carry]
    return items


def _split_carry(items: list, user_states: list[tuple[str, tuple[str, str] | None]], loc: Loc,
                 locs: dict[Node, Loc]) -> list:
    """The carry values of the user's states as values of the program's real states: a complex
    state's value as its (re, im) pair (a real value for it has zero imaginary part)."""
    out = []
    for (name, pair), value in zip(user_states, items):
        if pair is None:
            if isinstance(value, cx.ComplexTensor):
                node_loc = locs.get(value.re.node) or loc
                raise SpecError(f"new value of state {name!r} is complex but {name!r} is declared real: "
                                f"declare it ssmc.State[..., complex], or keep the real part (z.real)", node_loc)
            out.append(value)
            continue
        if cx.is_complex(value):
            z = cx.promote(value)
            out.extend((z.re, z.im))
        else:
            out.extend((value, 0.0))
    return out


def _read_carry(carry, states: list[Decl], loc: Loc, locs: dict[Node, Loc],
                user_states: list[tuple[str, tuple[str, str] | None]] | None = None) -> tuple[Node, ...]:
    """The program's state updates from the returned carry; `user_states`: the states as the user
    declared them (name, real pair if complex), where some are complex."""
    if user_states is None:
        items = _carry_items(carry, [s.name for s in states], loc)
    else:
        items = _split_carry(_carry_items(carry, [n for n, _ in user_states], loc), user_states, loc, locs)
    updates = []
    for state, value in zip(states, items):
        node = _as_node(value, f"new value of state {state.name!r}", loc)
        node_loc = locs.get(node) or loc
        extra = [a for a in node.axes if a not in state.axes]
        if extra:
            raise SpecError(f"new value of state {state.name!r} has axes {format_axes(node.axes)}, "
                            f"but {state.name!r} is declared {format_axes(state.axes)} "
                            f"(reduce or rename {extra})", node_loc)
        missing = [a for a in state.axes if a not in node.axes]
        if missing and node.op is not Op.CONST:  # a plain number (`return 0.0`) fills the state
            raise SpecError(_lost_axes_message(state, node.axes, missing, node_loc, loc), node_loc)
        if node.dtype == BOOL:
            raise SpecError(f"new value of state {state.name!r} is boolean; states hold floats "
                            "(use ssmc.where(cond, 1.0, 0.0))", node_loc)
        if set(node.axes) != set(state.axes):
            node = Node.make(Op.EXPAND, (node,), state.axes, loc=node_loc)
            locs.setdefault(node, node_loc)
        updates.append(node)
    return tuple(updates)


def _lost_axes_message(state: Decl, axes: tuple[str, ...], missing: list[str], at: Loc, ret: Loc) -> str:
    """A new state value without some of its state's axes: almost always an output returned as the
    carry, or an update that forgot a factor. Broadcasting it is possible, but only when asked for."""
    names = " ".join(missing)
    lacks = f"axis {missing[0]!r}" if len(missing) == 1 else "axes " + ", ".join(map(repr, missing))
    returned = f" (returned at line {ret.line})" if at != ret and at.path == ret.path else ""
    return (f"new value of state {state.name!r}{returned} has axes {format_axes(axes)} but {state.name!r} "
            f"is declared {format_axes(state.axes)}: it lacks {lacks} (an output returned as the carry?); "
            f'to broadcast it along {names!r} on purpose, return value.broadcast("{names}")')


def _read_outputs(outputs, decl_names: set[str], loc: Loc,
                  pairs: dict[str, tuple[str, str]] | None = None) -> tuple[tuple[str, Node], ...]:
    """The named outputs; a complex one as its real pair (``y_re``, ``y_im``, recorded in `pairs`)."""
    if outputs is None:
        return ()
    if isinstance(outputs, dict):
        items = list(outputs.items())
    elif isinstance(outputs, (tuple, list)):
        items = [(f"y{i}", v) for i, v in enumerate(outputs)]
    else:
        items = [("y", outputs)]
    named = []
    for name, value in items:
        if not isinstance(name, str) or not name.isidentifier():
            raise SpecError(f"output name {name!r} must be an identifier", loc)
        if name in decl_names:
            raise SpecError(f"output name {name!r} is also the name of an input", loc)
        if cx.is_complex(value):
            z = cx.promote(value).aligned()  # both parts over the same axes: one complex array
            re, im = cx.part_names(name)
            if pairs is not None:
                pairs[name] = (re, im)
            for part, v in ((re, z.re), (im, z.im)):
                if part in decl_names or any(part == n for n, _ in named) or part in dict(items):
                    raise SpecError(f"complex output {name!r}'s real pair {re}, {im} clashes with the name "
                                    f"{part!r}", loc)
                named.append((part, _as_node(v, f"output {name!r}", loc)))
            continue
        named.append((name, _as_node(value, f"output {name!r}", loc)))
    return tuple(named)


# What calling a spec runs: `ssmc.compile`, which `ssmc.api` installs here as it is imported (with
# the package). The front end traces; it imports no backend (tests/test_layering.py).
_compile: Callable | None = None


def set_compiler(compile_fn: Callable) -> None:
    """Install ``compile_fn(spec, backend=None, *, layout=...)`` (`ssmc.compile`) as what calling a
    spec runs."""
    global _compile
    _compile = compile_fn


def compile_spec(spec, backend: str | None = None, **options):
    """`spec` compiled by the installed `ssmc.compile` (`set_compiler`)."""
    if _compile is None:  # pragma: no cover - ssmc/__init__ imports ssmc.api, which installs it
        raise RuntimeError("ssmc.api is not imported: nothing runs a spec")
    return _compile(spec, backend, **options)


class RecurrenceSpec:
    """What ``@ssmc.recurrence`` returns: the traced program plus a default way to run it.

    ``spec(*inputs, **initial_states)`` runs it with the default backend
    (see `ssmc.compile`); ``spec.program`` is the IR.
    """

    def __init__(self, program: Recurrence, fn: Callable, complex_signature: cx.ComplexSignature | None = None):
        self.program = program
        # where some input, state or output is complex: how the user's names pair with the program's
        self.complex_signature = complex_signature
        self.fn = fn
        self.__doc__ = fn.__doc__
        self.__name__ = program.name
        self._compiled: dict[object, object] = {}

    def __repr__(self) -> str:
        return f"<ssmc.recurrence {self.program.name} at {self.program.loc}>"

    def __call__(self, *args, **kwargs):
        layout = kwargs.pop("layout", None)
        key = ("default", layout)
        if key not in self._compiled:
            self._compiled[key] = compile_spec(self, layout=layout)
        return self._compiled[key](*args, **kwargs)


def recurrence(fn: Callable | None = None, *, name: str | None = None):
    """Turn a step function into a recurrence (see the module docstring)."""
    if fn is None:
        return lambda f: recurrence(f, name=name)
    if not callable(fn) or not hasattr(fn, "__code__"):
        raise TypeError(f"@ssmc.recurrence takes a step function (def step(h: ssmc.State[...], ...)), "
                        f"not {type(fn).__name__}")
    src = SourceInfo(fn)
    pairs: dict[str, tuple[str, str]] = {}
    decls, sizes = read_signature(fn, src, (Role.STATE, Role.SEQ, Role.PARAM), pairs=pairs)
    states = [d for d in decls if d.role is Role.STATE]
    if not states:
        raise SpecError(f"{fn.__name__} declares no state: annotate the carry as ssmc.State[...]", src.def_loc)
    if not any(d.role is Role.SEQ for d in decls):
        raise SpecError(f"{fn.__name__} declares no sequence: the number of steps comes from the inputs "
                        "annotated ssmc.Seq[...] (one slice per step)", src.def_loc)
    locs: dict[Node, Loc] = {}
    registers = ShiftRegisters({d.name for d in decls})
    result = trace(fn, input_leaves(decls, pairs), sizes, src, locs, registers)
    ret = src.return_loc
    if not isinstance(result, tuple) or len(result) != 2:
        got = f"a tuple of {len(result)}" if isinstance(result, tuple) else type(result).__name__
        raise SpecError(f"the step must return (new_carry, outputs), got {got}", ret)
    carry, outputs = result
    user = _user_names(fn, pairs)
    user_states = [(n, pairs.get(n)) for n, role in user if role is Role.STATE]
    updates = _read_carry(carry, states, ret, locs, user_states)
    shift_decls, shift_updates = registers.states()   # x.shift(k)'s states, after the declared ones
    decls, updates = decls + list(shift_decls), updates + shift_updates
    out_pairs: dict[str, tuple[str, str]] = {}
    outs = _read_outputs(outputs, {d.name for d in decls} | {n for n, _ in user}, ret, out_pairs)
    signature = None
    if pairs or out_pairs:
        signature = cx.ComplexSignature(
            name=name or fn.__name__,
            inputs=tuple((n, pairs.get(n)) for n, role in user if role is not Role.STATE),
            states=tuple(user_states) + _shift_states([d.name for d in shift_decls], pairs),
            outputs=tuple(_user_outputs(outs, out_pairs)))
    program = Recurrence(name=name or fn.__name__, decls=tuple(decls), updates=updates, outputs=outs,
                         sizes=tuple(sorted(sizes.items())), loc=src.def_loc, doc=inspect.getdoc(fn) or "")
    try:
        verify(program, locs)
    except SpecError as err:
        raise err.with_traceback(None) from None
    return RecurrenceSpec(program, fn, signature)


def _user_names(fn: Callable, pairs: dict[str, tuple[str, str]]) -> list[tuple[str, Role]]:
    """The step's arguments as the user declared them: (name, role), in signature order."""
    hints = inspect.get_annotations(fn, eval_str=True)
    return [(p, hints[p].role) for p in inspect.signature(fn).parameters]


def _shift_states(names: list[str], pairs: dict[str, tuple[str, str]]) -> tuple:
    """The shift registers' states (name, real pair or None): a complex input's registers, ``x_re_shiftk``
    and ``x_im_shiftk``, pair up as the complex state ``x_shiftk``; the others are real."""
    out, taken = [], set()
    for n in names:
        if n in taken:
            continue
        for arg, (re, im) in pairs.items():
            if n.startswith(re + "_shift") and im + n[len(re):] in names:
                pair = (n, im + n[len(re):])
                out.append((arg + n[len(re):], pair))
                taken.update(pair)
                break
        else:
            out.append((n, None))
    return tuple(out)


def _user_outputs(outs, out_pairs: dict[str, tuple[str, str]]):
    """(name, real pair or None) per output as the user returned them, from the program's outputs."""
    by_part = {re: name for name, (re, _) in out_pairs.items()}
    skip = {im for _, im in out_pairs.values()}
    for n, _ in outs:
        if n in by_part:
            yield by_part[n], out_pairs[by_part[n]]
        elif n not in skip:
            yield n, None

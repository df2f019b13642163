"""Binding a call: match arrays to a program's inputs, check them, and learn the axis sizes.

Every backend calls through here, so every backend rejects bad input the same way: a ValueError
that names the argument, before any work is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from ..ir.axes import TIME, format_axes, resolve_layout
from ..ir.node import toposort
from ..ir.ops import Op
from ..ir.program import Decl, Role

DEFAULT_LAYOUT = "t ..."
# prepared calls a compiled function or a gradient keeps (one per shape, layout and dtypes called with)
MAX_PREPARED_CALLS = 64


def check_layout(layout, program) -> None:
    """ValueError for a layout that is neither a template string nor a dict from the program's input,
    state and output names (or "*") to template strings: a misspelled key would otherwise leave its
    array in the default layout without a word."""
    if layout is None or isinstance(layout, str):
        return
    if not isinstance(layout, dict):
        raise ValueError(f"layout must be a template like \"b t ...\" or a dict of them by array name, "
                         f"not {type(layout).__name__}")
    names = [d.name for d in program.inputs] + [s.name for s in program.states] + [n for n, _ in program.outputs]
    unknown = sorted(k for k in layout if k not in names and k != "*")
    if unknown:
        raise ValueError(f"layout: {program.name} has no arrays {unknown} (its arrays: {', '.join(names)}; "
                         "\"*\" for the rest)")
    for key, template in layout.items():
        if not isinstance(template, str):
            raise ValueError(f"layout[{key!r}] must be a template like \"b t ...\", not {template!r}")


def hashable_layout(layout):
    """`layout` as part of a cache key: a dict's items sorted, as text (a bad value, a list say, is
    then a key like any other, and `check_layout` names it on the call that binds)."""
    if isinstance(layout, dict):
        return tuple(sorted((str(k), repr(v)) for k, v in layout.items()))
    return layout if isinstance(layout, str) or layout is None else repr(layout)


def layout_of(layout: str | dict[str, str] | None, name: str, axes: tuple[str, ...]) -> tuple[str, ...]:
    """Axis order (time included) of the array for input or output `name`."""
    if isinstance(layout, dict):
        template = layout.get(name, layout.get("*", DEFAULT_LAYOUT))
    else:
        template = layout or DEFAULT_LAYOUT
    try:
        order = resolve_layout(template, tuple(axes))
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None
    extra = [a for a in order if a != TIME and a not in axes]
    if extra:  # pragma: no cover - resolve_layout only places the array's own axes
        raise ValueError(f"{name}: layout names axes {extra} it does not have")
    return order


def to_time_first(layout: str | dict[str, str] | None, name: str, axes: tuple[str, ...]) -> list[int]:
    """The permutation taking array `name` (its axes `axes` and time, in `layout`) to time first, then
    `axes` in their order: ``arr.permute(*to_time_first(...))``."""
    order = layout_of(layout, name, axes)
    return [order.index(a) for a in (TIME, *axes)]


def from_time_first(layout: str | dict[str, str] | None, name: str, axes: tuple[str, ...]) -> list[int]:
    """The inverse of `to_time_first`: an array of time, then `axes`, to `name`'s layout."""
    canonical = (TIME, *axes)
    return [canonical.index(a) for a in layout_of(layout, name, axes)]


def numeric_array(x, name: str) -> np.ndarray:
    """``np.asarray(x)``; a ValueError naming the argument where `x` is not an array (a ragged nested
    list, say) or holds no numbers (strings, objects). Complex numbers pass: callers say what they take."""
    try:
        arr = np.asarray(x)
    except (ValueError, TypeError) as err:
        raise ValueError(f"argument {name!r} is not an array: {err}") from None
    if arr.dtype.kind not in "fiubc":
        raise ValueError(f"argument {name!r} is not an array of numbers (dtype {arr.dtype})")
    return arr


def to_array(x, name: str) -> np.ndarray:
    """A NumPy view or copy of an array-like (NumPy, PyTorch, CuPy, lists), checking its dtype.

    float32 and float64 stay as they are; integers and booleans become float64, float16 and
    bfloat16 float32.
    """
    if hasattr(x, "detach"):  # torch
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":  # NumPy has no bfloat16
            x = x.float()
        x = x.numpy()
    elif hasattr(x, "get") and hasattr(x, "__cuda_array_interface__"):  # cupy
        x = x.get()
    arr = numeric_array(x, name)
    if arr.dtype.kind not in "fiub":
        raise ValueError(f"argument {name!r} has dtype {arr.dtype}; ssmc takes real numbers "
                         "(floating point, or integers converted to float)")
    if arr.dtype.kind != "f":
        return arr.astype(np.float64)
    return arr if arr.dtype.itemsize >= 4 else arr.astype(np.float32)


def to_float64(x, name: str) -> np.ndarray:
    return to_array(x, name).astype(np.float64)


@dataclass
class Bound:
    """A checked call: arrays in canonical layout (time first, then declared axes), as given.

    `dtype` is float64 when an array given is float64, float32 otherwise.
    """

    length: int
    sizes: dict[str, int]
    arrays: dict[str, np.ndarray]     # inputs: (L, *axes) for sequences, axes for params
    initial: dict[str, np.ndarray]    # states, zeros unless given
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float64))


def check_axis_relations(roots, sizes: dict[str, int], source: dict[str, str]) -> None:
    """Sizes that ops tie together: a renamed axis keeps its size; split parts add up."""

    def where(a):
        return source.get(a, "no input")

    for node in _relating_nodes(tuple(roots)):
        if node.op is Op.RENAME:
            for old, new in node.arg:
                if old in sizes and new not in sizes:  # the new name takes the old one's size
                    sizes[new] = sizes[old]
                    source[new] = f"the rename of {old!r}"
                if old in sizes and new in sizes and sizes[old] != sizes[new]:
                    raise ValueError(f"axis {old!r} (size {sizes[old]}, from {where(old)}) is renamed to {new!r} "
                                     f"(size {sizes[new]}, from {where(new)}): renaming keeps the size")
        elif node.op is Op.SLICE:
            axis, _, parts, _ = node.arg
            if axis in sizes and all(p in sizes for p in parts):
                total = sum(sizes[p] for p in parts)
                if total != sizes[axis]:
                    raise ValueError(f"axis {axis!r} (size {sizes[axis]}, from {where(axis)}) is split into "
                                     f"{list(parts)} of total size {total}")


@lru_cache(maxsize=256)  # once per program, not per call
def _relating_nodes(roots: tuple) -> tuple:
    """The renames and slices of a graph, in topological order."""
    return tuple(n for n in toposort(roots) if n.op in (Op.RENAME, Op.SLICE))


def _is_float64(dtype) -> bool:
    """A NumPy or torch dtype that is float64 (without `str(dtype)`, slow on NumPy dtypes)."""
    if isinstance(dtype, np.dtype):
        return dtype.kind == "f" and dtype.itemsize == 8
    return str(dtype) == "torch.float64"


def _permute(arr, perm):
    return arr.permute(*perm) if hasattr(arr, "permute") else arr.transpose(perm)


def bind_arrays(decls: tuple[Decl, ...], states: tuple[Decl, ...], args: tuple, kwargs: dict,
                layout, static: dict[str, int], what: str, roots=(), convert=None, zeros=None) -> Bound:
    """Match positional / keyword arrays to `decls` (inputs) and `states` (optional initial values).

    `roots` (the program's graph) lets the sizes be checked against the ops that relate axes.
    `convert(x, name)` makes each argument an array (default: NumPy, `to_array`); `zeros(shape)`
    makes the initial states not given (default: NumPy float64 zeros).
    """
    convert = convert or to_array
    zeros = zeros or np.zeros
    names = [d.name for d in decls]
    if len(args) > len(decls):
        raise ValueError(f"{what} takes {len(decls)} inputs {names}, got {len(args)} positional arguments")
    given = dict(zip(names, args))
    state_names = {s.name for s in states}
    for key, value in kwargs.items():
        if value is None and key in state_names:
            continue  # h=None: the state starts at zeros, as when not given
        if key in given:
            raise ValueError(f"{what}: argument {key!r} given twice")
        if key not in names and key not in state_names:
            raise ValueError(f"{what}: unexpected argument {key!r}; inputs are {names}, "
                             f"initial states {sorted(state_names)}")
        given[key] = value
    missing = [n for n in names if n not in given]
    if missing:
        raise ValueError(f"{what}: missing input {missing[0]!r} (inputs are {names})")

    sizes = dict(static)
    source = {a: "its declaration" for a in static}
    length = None
    arrays: dict[str, np.ndarray] = {}

    def learn(axis: str, n: int, name: str):
        if axis in sizes and sizes[axis] != n:
            raise ValueError(f"axis {axis!r} has size {n} in {name!r} but {sizes[axis]} in {source[axis]}")
        sizes.setdefault(axis, n)
        source.setdefault(axis, repr(name))

    for d in (*decls, *(s for s in states if s.name in given)):
        arr = convert(given[d.name], d.name)
        timed = d.role in (Role.SEQ,)
        order = layout_of(layout, d.name, d.axes) if timed else d.axes
        if arr.ndim != len(order):
            raise ValueError(f"argument {d.name!r} has {arr.ndim} dimensions, expected {len(order)} "
                             f"for axes {format_axes(order)}" + ("" if timed else " (no time axis)"))
        for axis, n in zip(order, arr.shape):
            if axis == TIME:
                if n < 1:
                    raise ValueError(f"argument {d.name!r} has 0 time steps; sequences need at least one step")
                if length is not None and n != length:
                    raise ValueError(f"argument {d.name!r} has {n} time steps, other sequences have {length}")
                length = n
            else:
                learn(axis, n, d.name)
        if timed:
            arr = _permute(arr, [order.index(a) for a in (TIME, *d.axes)])
        arrays[d.name] = arr
    check_axis_relations(roots, sizes, source)
    if length is None:
        raise ValueError(f"{what}: no sequence input, so the number of steps is unknown")
    if length < 1:
        raise ValueError(f"{what}: sequences must have at least one step (got length 0)")
    initial = {}
    for s in states:
        unknown = [a for a in s.axes if a not in sizes]
        if unknown:
            raise ValueError(f"{what}: the size of axis {unknown[0]!r} of state {s.name!r} is unknown; "
                             f"pass an initial value {s.name}=...")
        initial[s.name] = arrays.pop(s.name) if s.name in given else zeros([sizes[a] for a in s.axes])
    given_dtypes = [a.dtype for a in arrays.values()] + [initial[s].dtype for s in initial if s in given]
    # float64 as soon as one array is (or when nothing was given); else float32 (fp16 / bf16 compute in fp32)
    any64 = not given_dtypes or any(_is_float64(d) for d in given_dtypes)
    dtype = np.dtype(np.float64 if any64 else np.float32)
    return Bound(length, sizes, arrays, initial, dtype)

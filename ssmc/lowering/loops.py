"""A small loop-nest IR that every compiled backend prints: scalar expressions and statements.

The lowering (`plan.py`) turns the step graph into these; a backend prints them as Python for
Numba or as CUDA C. Index expressions are plain strings (``"i_n"``, ``"(i_e + o3)"``) whose
syntax Python and C share.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# -- scalar expressions --------------------------------------------------------------------------


@dataclass(frozen=True)
class Num:
    value: float


@dataclass(frozen=True)
class Var:
    """A scalar variable: a local, a size, or an index used as a number."""

    name: str


@dataclass(frozen=True)
class Load:
    """``array[index...]``."""

    array: str
    index: tuple[str, ...]


@dataclass(frozen=True)
class Call:
    """A math function (``exp``, ``sigmoid``, ...) applied to scalars."""

    fn: str
    args: tuple


@dataclass(frozen=True)
class Bin:
    """``a op b`` with op one of + - * / < <= > >= == != and or."""

    op: str
    a: object
    b: object


@dataclass(frozen=True)
class Select:
    """``a if cond else b``."""

    cond: object
    a: object
    b: object


@dataclass(frozen=True)
class InRange:
    """``lo <= index < hi`` for index expressions (the bounds of a split block)."""

    index: str
    lo: str
    hi: str


Expr = Num | Var | Load | Call | Bin | Select | InRange


# -- statements ----------------------------------------------------------------------------------


@dataclass
class Loop:
    var: str
    extent: str
    body: list = field(default_factory=list)
    reverse: bool = False


@dataclass
class Assign:
    """``target = value`` (target a Var or a Load); ``op="+="`` / ``"max="`` accumulate."""

    target: Var | Load
    value: Expr
    op: str = "="


@dataclass
class Buffer:
    """A scratch array of the given shape (size expressions), allocated before the time loop."""

    name: str
    shape: tuple[str, ...]


Stmt = Loop | Assign | Buffer


def walk(stmts):
    for s in stmts:
        yield s
        if isinstance(s, Loop):
            yield from walk(s.body)


def subexpressions(e):
    """`e` and every expression inside it, outermost first."""
    yield e
    if isinstance(e, Call):
        for a in e.args:
            yield from subexpressions(a)
    elif isinstance(e, Bin):
        yield from subexpressions(e.a)
        yield from subexpressions(e.b)
    elif isinstance(e, Select):
        for a in (e.cond, e.a, e.b):
            yield from subexpressions(a)


def map_children(e, fn):
    """`e` with `fn` applied to each of its direct subexpressions (a leaf as it is)."""
    if isinstance(e, Call):
        return Call(e.fn, tuple(fn(a) for a in e.args))
    if isinstance(e, Bin):
        return Bin(e.op, fn(e.a), fn(e.b))
    if isinstance(e, Select):
        return Select(fn(e.cond), fn(e.a), fn(e.b))
    return e


def loads(e):
    """Every `Load` inside the expression `e`."""
    return (x for x in subexpressions(e) if isinstance(x, Load))


def accesses(s: Assign):
    """Every `Load` the assignment `s` reads, then its target where that is a `Load`."""
    yield from loads(s.value)
    if isinstance(s.target, Load):
        yield s.target


def scalars_read(s: Assign) -> set[str]:
    """The names of the scalars (`Var`s) the value of the assignment `s` reads."""
    return {e.name for e in subexpressions(s.value) if isinstance(e, Var)}


_NAME = re.compile(r"[A-Za-z_]\w*")


def reads_of_scalars(stmts: list) -> set[str]:
    """The names that `stmts` read as scalars: the `Var`s of their values, and every name in their index
    expressions and loop extents (an index string may name a scalar)."""
    names: set[str] = set()
    for s in walk(stmts):
        if isinstance(s, Loop):
            names.update(_NAME.findall(s.extent))
        elif isinstance(s, Assign):
            names |= scalars_read(s)
            for e in accesses(s):
                for index in e.index:
                    names.update(_NAME.findall(index))
    return names


def drop_unread(stmts: list, read: set[str]) -> list:
    """`stmts` without the assignments of scalars not in `read`, and without the loops that leaves empty."""
    out = []
    for s in stmts:
        if isinstance(s, Assign) and isinstance(s.target, Var) and s.target.name not in read:
            continue
        if isinstance(s, Loop):
            body = drop_unread(s.body, read)
            if not body:
                continue
            s = Loop(s.var, s.extent, body, s.reverse)
        out.append(s)
    return out


def rename_arrays(stmts: list, names: dict[str, str]) -> list:
    """`stmts` with every `Load` of an array in `names` reading (or writing) ``names[array]``."""
    def expr(e):
        if isinstance(e, Load):
            return Load(names.get(e.array, e.array), e.index)
        return map_children(e, expr)

    out = []
    for s in stmts:
        if isinstance(s, Loop):
            s = Loop(s.var, s.extent, rename_arrays(s.body, names), s.reverse)
        elif isinstance(s, Assign):
            s = Assign(expr(s.target), expr(s.value), s.op)
        out.append(s)
    return out


# marks the arrays' names in a module rendered to find what else it names (the backends' printers:
# `free_names` then picks the names to print the arrays by)
ARRAY_MARK = "ssmc_array_"


def free_names(arrays: set[str], taken: set[str]) -> dict[str, str]:
    """A name to print each array by: its own, or with underscores appended while the printed module
    uses that name for something else (`taken`) or another array is called so. The backends'
    kernels take their arrays by position, so printing them by other names changes nothing else."""
    names, used = {}, set(taken)
    for name in sorted(arrays):
        free = name
        while free in used or (free != name and free in arrays):
            free += "_"
        names[name] = free
        used.add(free)
    return names

"""Loop nests -> Python source for Numba (one module per lowered program, from a Jinja template)."""

from __future__ import annotations

import ast
import builtins
import hashlib
import keyword
import math
import re
from dataclasses import replace
from functools import cache
from pathlib import Path

import jinja2

from ...lowering.kernel import Kernel, Lowered
from ...lowering.loops import (
    ARRAY_MARK,
    Assign,
    Bin,
    Buffer,
    Call,
    InRange,
    Load,
    Loop,
    Num,
    Select,
    Var,
    free_names,
    rename_arrays,
)
from ...lowering.plan import size_var
from ...lowering.unroll import unroll_sums
from ...version import __version__
from . import blocking, simd
from .ahead import TILE, split_ahead
from .blocking import BlockedKernel, block_kernel, wants_blocking
from .tiles import TILE_ROWS, TiledProduct, packing_lines, product_line, tile_products

_FUNCS = {"abs": "abs_", "max": "max_", "min": "min_", "pow": "pow_"}


def expr(e) -> str:
    if isinstance(e, Num):
        v = e.value
        if math.isinf(v):
            return "F(np.inf)" if v > 0 else "F(-np.inf)"
        if math.isnan(v):
            return "F(np.nan)"
        return f"F({v!r})"
    if isinstance(e, Var):
        return e.name
    if isinstance(e, Load):
        return f"{e.array}[{', '.join(e.index)}]"
    if isinstance(e, Call):
        if e.fn == "not":
            return f"(not {expr(e.args[0])})"
        return f"{_FUNCS.get(e.fn, e.fn)}({', '.join(expr(a) for a in e.args)})"
    if isinstance(e, Bin):
        return f"({expr(e.a)} {e.op} {expr(e.b)})"
    if isinstance(e, Select):
        return f"({expr(e.a)} if {expr(e.cond)} else {expr(e.b)})"
    if isinstance(e, InRange):
        return f"({e.lo} <= {e.index} < {e.hi})"
    raise TypeError(e)


def statements(stmts, depth: int) -> list[str]:
    pad = "    " * depth
    out: list[str] = []
    for s in stmts:
        if isinstance(s, Loop):
            out.append(f"{pad}for {s.var} in range({s.extent}):")
            out.extend(statements(s.body, depth + 1) or [f"{pad}    pass"])
        elif isinstance(s, TiledProduct):
            out.append(f"{pad}{product_line(s)}")
        elif isinstance(s, Buffer):
            shape = ", ".join(s.shape) + ("," if len(s.shape) == 1 else "")
            out.append(f"{pad}{s.name} = np.empty(({shape}), dtype=F)")
        elif isinstance(s, Assign):
            target, value = expr(s.target), expr(s.value)
            if s.op == "=":
                out.append(f"{pad}{target} = {value}")
            elif s.op == "+=":
                out.append(f"{pad}{target} += {value}")
            else:  # max=
                out.append(f"{pad}{target} = max_({target}, {value})")
        else:
            raise TypeError(s)
    return out


def _unflatten(parallel: tuple[str, ...], extent=size_var) -> list[str]:
    """p -> one index per parallel axis (the last axis varies fastest)."""
    lines = []
    rest = "p"
    for a in reversed(parallel):
        lines.append(f"p_{a} = {rest} % {extent(a)}")
        lines.append(f"rest_{a} = {rest} // {extent(a)}")
        rest = f"rest_{a}"
    return lines


def _kernel_context(k: Kernel) -> dict:
    if wants_blocking(k):
        k = block_kernel(k)
    blocked = isinstance(k, BlockedKernel)
    extent = (lambda a: blocking.extent(k, a)) if blocked else size_var
    ahead = None if blocked else split_ahead(k)
    if ahead is not None:
        setup = [Buffer(b, (str(TILE),)) for b in ahead.buffers] + k.setup
        return {
            **_common_context(k, extent, [], setup), "tile": TILE, "tiled": False,
            "ahead": "\n".join(statements(ahead.ahead, 4)),
            "step": "\n".join(statements(unroll_sums(ahead.step), 4)) or "                pass",
        }
    step, prelude = k.step, []
    if blocked:
        axis = k.blocked
        params = {a.name for a in k.arrays if a.role == "param"}
        step, packings = tile_products(step, k.setup, params, f"q_{axis}", f"b0_{axis}_end - b0_{axis}",
                                       f"bs_{axis}")
        prelude = blocking.prelude(k) + [line for p in packings for line in packing_lines(p)]
    return {**_common_context(k, extent, prelude, k.setup), "tile": 0, "ahead": "",
            "step": "\n".join(statements(unroll_sums(step), 3)) or "            pass",
            "tiled": any(isinstance(s, TiledProduct) for s in step)}


def _common_context(k: Kernel, extent, prelude: list[str], setup: list) -> dict:
    blocked = isinstance(k, BlockedKernel)
    return {
        "name": k.name,
        "sizes": [size_var(a) for a in k.sizes],
        "arrays": [a.name for a in k.arrays],
        "prelude": prelude,
        "total": " * ".join(extent(a) for a in k.parallel) or "1",
        "unflatten": _unflatten(k.parallel, extent) + (blocking.block_bounds(k) if blocked else []),
        "reverse": k.reverse,
        "setup": "\n".join(statements(unroll_sums(setup), 2)),
        "finish": "\n".join(statements(k.finish, 2)),
    }


@cache
def _template() -> jinja2.Template:
    env = jinja2.Environment(loader=jinja2.PackageLoader("ssmc", "templates"), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    return env.get_template("numba_module.py.j2")


def module_source(lowered: Lowered, dtype: str) -> str:
    """The Numba module of `lowered`'s kernels, their arrays printed by `array_names` (the user's
    names, but where the module uses one for something else too)."""
    return _render(lowered, dtype, array_names(lowered, dtype))


def _render(lowered: Lowered, dtype: str, names: dict[str, str]) -> str:
    kernels = [_kernel_context(_renamed(k, names)) for k in lowered.kernels]
    tiled = any(k["tiled"] for k in kernels)

    def module(elementary: bool) -> str:
        return _template().render(version=__version__, program_name=lowered.program.name, dtype=dtype,
                                  strategy=lowered.strategy, kernels=kernels, tile_rows=TILE_ROWS if tiled else (),
                                  simd_digest=_digest(simd.__file__) if tiled else "", elementary=elementary)
    source = module(False)
    return module(True) if _ELEMENTARY_CALL.search(source) else source


# calls of the template's elementary functions (sin, atan2, ...), which a module defines only where
# its kernels call one, so that the others keep their source (and array names)
_ELEMENTARY_CALL = re.compile(r"(?<![\w.])(?:sin|cos|tan|log1p|expm1|sign|atan2)\(")


def array_names(lowered: Lowered, dtype: str) -> dict[str, str]:
    """Arrays (the user's sequences, params and states, and what derives from them) whose names the
    module also uses for something else, each with a free name to print it by: a state `c` and the
    loop over tiles `c`, a sequence `F` and the compute type `F`, a param `tanh` and the function.
    Found by rendering the module once with every array's name marked: the module's globals and
    every name inside the kernels' functions (and Python's keywords and builtins) are taken; the
    helpers' own locals are not. The kernels take their arrays by position, so the runner binds
    them as before."""
    arrays = {a.name for k in lowered.kernels for a in k.arrays}
    tree = ast.parse(_render(lowered, dtype, {name: ARRAY_MARK + name for name in arrays}))
    kernels = {k.name for k in lowered.kernels}
    taken = set(keyword.kwlist) | set(dir(builtins))
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            taken.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            taken |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        else:
            taken |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if isinstance(node, ast.FunctionDef) and node.name in kernels:
            taken |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
            taken |= {n.arg for n in ast.walk(node) if isinstance(n, ast.arg)}
    taken = {name for name in taken if not name.startswith(ARRAY_MARK)}
    return {name: free for name, free in free_names(arrays, taken).items() if free != name}


def _renamed(k: Kernel, names: dict[str, str]) -> Kernel:
    """`k` with its arrays called by `names` (those not in it as they are)."""
    if not any(a.name in names for a in k.arrays):
        return k
    return replace(k, arrays=[replace(a, name=names.get(a.name, a.name)) for a in k.arrays],
                   setup=rename_arrays(k.setup, names), step=rename_arrays(k.step, names),
                   finish=rename_arrays(k.finish, names))


@cache
def _digest(path: str) -> str:
    """A short hash of a file's bytes: a generated module that calls into it names it, so that a
    change there gives the module a new name and a new Numba cache entry."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]

"""Unrolling the summed loop of a per-step contraction, so each pass over the accumulator does several terms.

`step.StepBuilder` writes a contraction such as an LSTM's ``m[g, k] = sum_j h[j] U[j, g, k]`` as

    for j in range(n_j):                 # summed: not an index of the target
        for g in range(n_g):             # the target's axes, innermost contiguous
            for k in range(n_k):
                m[g, k] += h[j] * U[j, g, k]

which compilers vectorise along k, but every term loads and stores the accumulator (the loop is
bound by those memory operations, not by arithmetic). `unroll_sums` rewrites it as

    for u_j in range(n_j // 8):
        for g, k:  m[g, k] = fma(h[8 u_j + 7], U[..], ... fma(h[8 u_j], U[8 u_j, g, k], m[g, k]))
    for j in range(n_j % 8):
        for g, k:  m[g, k] += t(n_j // 8 * 8 + j)

so the accumulator is loaded and stored once per 8 terms (faster than the plain nest on the
LSTM's recurrent product; see bench/results/2026-11-27-from-code-comments.md). Products are added
by explicit fused multiply-adds in order (`fma`: one rounding per term, one instruction where
fastmath-free code has two); other terms as one pairwise sum. A sum into a scalar,
``for n: acc += h[n] C[n]`` (Mamba-1's y), is a chain of dependent additions, one per term; it is
rewritten the same way with `SCALAR_FACTOR` terms per pass, so the chain is 4x shorter and the
terms of a pass are independent. In a blocked kernel,
whose rows q of a batch block all read the same ``U[j, g, k]``, `ROWS` rows go per pass and
share those loads (`_paired`). Only the order of the additions changes, and it is fixed (no
reassociation by the compiler). The rows loop may also sit between the summed loops, as in an
LSTM adjoint's ``for g: for q: for k: for j: m[q, j] += gz[q, g, k] U[g, k, j]`` (`_rows_outside`).
Backend-neutral: it rewrites the loop-nest IR (`loops.py`).
"""

from __future__ import annotations

import re

from .loops import Assign, Bin, Call, InRange, Load, Loop, Select, Var, loads, map_children

FACTOR = 8
SCALAR_FACTOR = 4
# rows per pass and terms per row when rows share loads: 4 x 4 keeps the 16 per-row scalars and
# the 4 shared ones in registers; on the LSTM's recording kernel (one core, pairwise sums) 4 x 4
# beat 8 x 2, 8 x 4 and 4 x 2 terms x rows (see bench/results/2026-11-27-from-code-comments.md)
ROWS = 4
ROW_FACTOR = 4


def unroll_sums(stmts: list, factor: int | None = None) -> list:
    """`stmts` with every accumulation nest of the form above unrolled by `factor`."""
    factor = factor or FACTOR
    if factor <= 1:
        return stmts
    out = []
    for s in stmts:
        if isinstance(s, Loop):
            chain = _axpy_chain(s)
            if chain is not None:
                out.extend(_unrolled(s, chain, factor))
            elif _scalar_sum(s):
                out.extend(_unrolled_scalar(s, SCALAR_FACTOR))
            elif (rows := _rows_outside(s)) is not None:
                out.extend(rows)
            else:
                out.append(Loop(s.var, s.extent, unroll_sums(s.body, factor), s.reverse))
        else:
            out.append(s)
    return out


def _axpy_chain(loop: Loop) -> list[Loop] | None:
    """The loops under `loop` down to one ``+=``, when they all index the target and `loop` does not."""
    chain, body = [], loop.body
    while len(body) == 1 and isinstance(body[0], Loop):
        chain.append(body[0])
        body = body[0].body
    if not chain or len(body) != 1 or not isinstance(body[0], Assign) or body[0].op != "+=":
        return None
    target = body[0].target
    if not isinstance(target, Load):
        return None
    used = {tok for idx in target.index for tok in re.findall(r"\w+", idx)}
    if loop.var in used or any(c.var not in used for c in chain) or loop.reverse:
        return None
    if not target.index or chain[-1].var not in re.findall(r"\w+", target.index[-1]):
        return None  # the innermost loop must run along the target's last (contiguous) axis
    return chain


def _unrolled(loop: Loop, chain: list[Loop], factor: int) -> list:
    assign = chain[-1].body[0]
    block = f"u_{loop.var.removeprefix('i_')}"
    main = _paired(chain, _accumulation(loop, assign, ROW_FACTOR), f"h{block}")
    if main is None:
        main = _nest(chain, _accumulation(loop, assign, factor), f"h{block}")
    else:
        factor = ROW_FACTOR
    return [Loop(block, f"({loop.extent}) // {factor}", main), _remainder(loop, chain, assign, factor)]


def _accumulation(loop: Loop, assign: Assign, factor: int) -> Assign:
    """`factor` consecutive terms of the summed loop (block ``u_<axis>``) added to the target: by
    fused multiply-adds in order when every term is a product of loads (one rounding per term),
    else as one pairwise sum (a chain of calls over general terms made Numba's parfor passes take
    minutes on a random spec's adjoint)."""
    block = f"u_{loop.var.removeprefix('i_')}"
    terms = [_subst(assign.value, loop.var, f"({factor} * {block} + {r})") for r in range(factor)]
    if all(isinstance(t, Bin) and t.op == "*" and _product_of_loads(t) for t in terms):
        value = assign.target
        for t in terms:
            value = Call("fma", (t.a, t.b, value))
        return Assign(assign.target, value)
    return Assign(assign.target, _pairwise(terms), "+=")


def _remainder(loop: Loop, chain: list[Loop], assign: Assign, factor: int) -> Loop:
    """The summed loop's last ``extent % factor`` terms, one per pass."""
    extent = f"({loop.extent})"
    rest_index = f"({extent} // {factor} * {factor} + {loop.var})"
    rest = _wrap(chain, Assign(assign.target, _subst(assign.value, loop.var, rest_index), "+="))
    return Loop(loop.var, f"{extent} % {factor}", rest)


def _rows_outside(rows: Loop) -> list | None:
    """``for q: for k (summed): for j: m[q, j] += t(q, k, j)`` with q's rows sharing loads (an LSTM
    adjoint's ``gz[q, g, k] U[g, k, j]``): `ROWS` rows per pass, as `_paired` does where the rows
    loop is inside the summed one. Rows being an index of the target, each element still adds the
    same terms in the same order: the blocks of k, then k's remainder."""
    if rows.reverse or len(rows.body) != 1 or not isinstance(rows.body[0], Loop):
        return None
    (loop,) = rows.body
    chain = _axpy_chain(loop)
    if chain is None or rows.var not in _tokens_of(chain[-1].body[0].target):
        return None
    assign = chain[-1].body[0]
    block = f"u_{loop.var.removeprefix('i_')}"
    blocks = Loop(block, f"({loop.extent}) // {ROW_FACTOR}", [])
    main = _paired([rows, blocks, *chain], _accumulation(loop, assign, ROW_FACTOR), f"h{block}")
    if main is None:
        return None
    return [*main, Loop(rows.var, rows.extent, [_remainder(loop, chain, assign, ROW_FACTOR)])]


def _nest(chain: list[Loop], acc: Assign, prefix: str) -> list:
    """The chain's loops around the accumulation, invariant loads read once at their level."""
    hoisted: list[list] = [[] for _ in chain]
    value = _hoist_loads(acc.value, [c.var for c in chain], hoisted, prefix)
    return _wrap(chain, Assign(acc.target, value, acc.op), hoisted)


def _paired(chain: list[Loop], acc: Assign, prefix: str) -> list | None:
    """The nest with the outermost chain loop's iterations `ROWS` at a time, when they share loads.

    In a blocked kernel's ``for q: for g, k: m[q, g, k] += h[q, j] U[j, g, k] + ...`` (an LSTM's
    ``h U`` for a block of batch rows) every row q reads the same ``U[j, g, k]``. `ROWS` rows per
    pass read them once into scalars in the innermost loop and add to every row's accumulator
    (the compiler cannot do it: the stores to ``m`` might change ``U``). Each element's sum is
    the same expression as before, so the result is too; the last rows (fewer than `ROWS`) run
    as a single-row nest."""
    rows, inner = chain[0], chain[1:]
    inner_vars = {c.var for c in inner}
    target, value = acc.target, acc.value
    if not inner or rows.reverse or rows.var not in _tokens_of(target) or not _product_of_loads(value):
        return None
    shared = list(dict.fromkeys(ld for ld in loads(value)
                                if rows.var not in _tokens_of(ld) and _tokens_of(ld) & inner_vars))
    if not shared:
        return None
    names = {ld: Var(f"{prefix}s{i}") for i, ld in enumerate(shared)}
    value = _replace_loads(value, names)
    pair = f"{rows.var}2"
    hoisted: list[list] = [[] for _ in chain]
    innermost = [Assign(name, ld) for ld, name in names.items()]
    for r in range(ROWS):
        row = f"({ROWS} * {pair} + {r})"
        v = _hoist_loads(_subst(value, rows.var, row), [pair, *(c.var for c in inner)], hoisted, f"{prefix}r{r}")
        innermost.append(Assign(_subst(target, rows.var, row), v, acc.op))
    body = innermost
    for i in reversed(range(len(inner))):
        body = hoisted[i + 1] + [Loop(inner[i].var, inner[i].extent, body, inner[i].reverse)]
    paired = hoisted[0] + [Loop(pair, f"({rows.extent}) // {ROWS}", body)]
    last = f"(({rows.extent}) // {ROWS} * {ROWS} + {rows.var})"
    odd = Loop(rows.var, f"({rows.extent}) % {ROWS}", [])
    single = _nest([odd, *inner], Assign(_subst(target, rows.var, last), _subst(_replace_loads(value, {
        name: ld for ld, name in names.items()}), rows.var, last), acc.op), f"{prefix}o")
    return paired + single


def _product_of_loads(e) -> bool:
    """A sum of products of loads: a contraction's terms, cheap to repeat for every row (a general
    expression, repeated ROWS x ROW_FACTOR times, would only make the kernel long to compile)."""
    if isinstance(e, Bin) and e.op in ("+", "*"):
        return _product_of_loads(e.a) and _product_of_loads(e.b)
    if isinstance(e, Call) and e.fn == "fma":
        return all(_product_of_loads(a) for a in e.args)
    return isinstance(e, (Load, Var))


def _tokens_of(e) -> set[str]:
    return {tok for ld in loads(e) for idx in ld.index for tok in re.findall(r"\w+", idx)}


def _replace_loads(e, mapping: dict):
    """`e` with loads (or variables) replaced by `mapping`'s values."""
    if e in mapping:
        return mapping[e]
    return map_children(e, lambda a: _replace_loads(a, mapping))


def _scalar_sum(loop: Loop) -> bool:
    """``for j: acc += value`` with a scalar accumulator."""
    body = loop.body
    return (len(body) == 1 and isinstance(body[0], Assign) and body[0].op == "+=" and isinstance(body[0].target, Var)
            and not loop.reverse)


def _unrolled_scalar(loop: Loop, factor: int) -> list:
    (assign,) = loop.body
    var, extent = loop.var, f"({loop.extent})"
    block = f"u_{var.removeprefix('i_')}"
    terms = [_subst(assign.value, var, f"({factor} * {block} + {r})") for r in range(factor)]
    rest_index = f"({extent} // {factor} * {factor} + {var})"
    return [Loop(block, f"{extent} // {factor}", [Assign(assign.target, _pairwise(terms), "+=")]),
            Loop(var, f"{extent} % {factor}", [Assign(assign.target, _subst(assign.value, var, rest_index), "+=")])]


def _hoist_loads(e, chain_vars: list[str], hoisted: list[list], prefix: str):
    """`e` with every load that is invariant in the innermost chain loops read once into a scalar,
    just inside the last chain loop it depends on (e.g. ``h[j]`` of ``m[k] += h[j] U[j, k]``): the
    compiler then need not prove that the accumulator's stores leave it unchanged."""
    if isinstance(e, Load):
        tokens = {tok for idx in e.index for tok in re.findall(r"\w+", idx)}
        depth = max((i + 1 for i, v in enumerate(chain_vars) if v in tokens), default=0)
        if depth < len(chain_vars):
            name = f"{prefix}_{sum(len(h) for h in hoisted)}"
            hoisted[depth].append(Assign(Var(name), e))
            return Var(name)
        return e
    if isinstance(e, Select):
        return e  # a select's loads stay where they are (each may be guarded by its condition)
    return map_children(e, lambda a: _hoist_loads(a, chain_vars, hoisted, prefix))


def _wrap(chain: list[Loop], stmt, hoisted: list[list] | None = None) -> list:
    """The chain's loops around `stmt`; hoisted[i] goes before chain[i] (inside chain[i - 1])."""
    hoisted = hoisted or [[] for _ in chain]
    body = [stmt]
    for i in reversed(range(len(chain))):
        c = chain[i]
        body = hoisted[i] + [Loop(c.var, c.extent, body, c.reverse)]
    return body


def _pairwise(terms: list):
    while len(terms) > 1:
        terms = [Bin("+", terms[i], terms[i + 1]) if i + 1 < len(terms) else terms[i]
                 for i in range(0, len(terms), 2)]
    return terms[0]


def _subst(e, var: str, new: str):
    """Expression `e` with the loop variable `var` replaced by the index expression `new`."""
    pattern = re.compile(rf"\b{re.escape(var)}\b")

    def idx(s: str) -> str:
        return pattern.sub(new, s)

    if isinstance(e, Load):
        return Load(e.array, tuple(idx(i) for i in e.index))
    if isinstance(e, Var):
        return Var(new) if e.name == var else e
    if isinstance(e, InRange):
        return InRange(idx(e.index), idx(e.lo), idx(e.hi))
    return map_children(e, lambda a: _subst(a, var, new))  # a number as it is

"""Which keys a block of queries can see: the key span a mask leaves, proven by interval arithmetic.

    spans = key_spans(program.mask, lq, lk, block_q, tile, sizes)
    for b, (lo, hi) in enumerate(spans):     # queries [b * block_q, min((b + 1) * block_q, lq))
        ...                                  # every key outside [lo, hi) is masked for every one of them

The mask is evaluated over intervals: `q_idx` over the query block's positions, `kv_idx` over a tile
of `tile` keys. A tile whose mask is false for every (query, key) pair of the rectangle is skipped;
the span runs from the first tile that may be visible to the last. The analysis is sound, never
exact: an op it has no interval rule for (or a param: its values are not known here) may be true,
so its tile is visited and masked element-wise. Causal masks, sliding windows and prefixes, written
with positions, constants, + - *, comparisons and & | ~, give the span the mask leaves (up to tiles).

Sequence inputs (document ids, ``doc[q_idx] == doc[kv_idx]``) are runtime data: given `seqs`, each
one's (min, max) over the batch per position, a read ``doc[q_idx]`` over a block's positions lies within
the least min and greatest max there. Ids sorted along time (packed documents) make a block's and a tile's
ranges meet only where they may share a document, so the span is the block's documents' keys (up to
tiles); unsorted ids stay sound (wider ranges: tiles visited and masked element-wise).
"""

from __future__ import annotations

import math

import numpy as np

from ..ir.axes import TIME
from ..ir.node import BOOL, Node, toposort
from ..ir.ops import COMPARISONS, Op

# an interval (lo, hi) of numbers, or for booleans (may be true, may be false); None: anything
Bound = tuple[float, float] | tuple[bool, bool] | None
ANY_BOOL = (True, True)


def key_spans(mask: Node | None, lq: int, lk: int, block_q: int, tile: int, sizes: dict[str, int],
              seqs: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> list[tuple[int, int]]:
    """Per block of `block_q` queries, the keys [lo, hi) outside which `mask` is false (module
    docstring); (0, lk) for every block without a mask, (0, 0) for a block that sees no key. `seqs`:
    each sequence input's per-position (min, max) over its batch axes, [L] arrays (None: unknown)."""
    blocks = range(0, lq, block_q)
    if mask is None:
        return [(0, lk) for _ in blocks]
    order = toposort([mask])
    tiles = -(-lk // tile)
    spans = []
    for q0 in blocks:
        q = (float(q0), float(min(q0 + block_q, lq) - 1))

        def maybe(t0, t1, q=q):  # may a key of tiles [t0, t1) be visible to the block?
            k = (float(t0 * tile), float(min(t1 * tile, lk) - 1))
            return _bool(_evaluate(order, q, k, sizes, seqs))[0]

        first = _search(maybe, 0, tiles, last=False)
        if first is None:
            spans.append((0, 0))
            continue
        last = _search(maybe, first, tiles, last=True)
        spans.append((first * tile, min((last + 1) * tile, lk)))
    return spans


def _search(maybe, t0: int, t1: int, last: bool) -> int | None:
    """The first (`last`: the last) tile of [t0, t1) that `maybe` does not rule out, ruling out halves
    of the range whole where it can (a few evaluations for masks like causal, not one per tile)."""
    if t0 >= t1 or not maybe(t0, t1):
        return None
    if t1 - t0 == 1:
        return t0
    mid = (t0 + t1) // 2
    halves = ((mid, t1), (t0, mid)) if last else ((t0, mid), (mid, t1))
    for a, b in halves:
        found = _search(maybe, a, b, last)
        if found is not None:
            return found
    return None


def _bool(b: Bound) -> tuple[bool, bool]:
    return ANY_BOOL if b is None else b


def _evaluate(order: list[Node], q: tuple[float, float], k: tuple[float, float], sizes: dict[str, int],
              seqs: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> Bound:
    memo: dict[Node, Bound] = {}
    for node in order:
        if node.op is Op.GATHER:
            memo[node] = _sequence_read(node, memo[node.args[1]], seqs)
        else:
            memo[node] = _rule(node, [memo[a] for a in node.args], q, k, sizes)
    return memo[order[-1]]


def _sequence_read(node: Node, positions: Bound, seqs) -> Bound:
    """A sequence read ``doc[q_idx]`` over an interval of positions: within the ids' least min and greatest
    max there; a table's entry (or a sequence without its ranges): anything."""
    source = node.args[0]
    if node.arg != TIME or not seqs or source.arg not in seqs or positions is None:
        return None
    lo, hi = seqs[source.arg]
    a, b = max(0, math.floor(positions[0])), min(len(lo) - 1, math.ceil(positions[1]))
    if a > b:
        return None
    return float(lo[a:b + 1].min()), float(hi[a:b + 1].max())


def _rule(node: Node, args: list[Bound], q, k, sizes) -> Bound:
    op = node.op
    if op is Op.INPUT:
        return {"q_idx": q, "kv_idx": k}.get(node.arg)
    if op is Op.CONST:
        return None if math.isnan(node.arg) else (node.arg, node.arg)
    if op is Op.SIZE:
        return (float(sizes[node.arg]),) * 2 if node.arg in sizes else None
    if op is Op.IOTA:
        return (0.0, float(sizes[node.arg] - 1)) if node.arg in sizes else None
    if op in (Op.RENAME, Op.EXPAND, Op.SELECT, Op.SLICE, Op.REDUCE_MAX):
        return args[0]  # the same values, fewer or more of them
    if op is Op.NOT:
        t, f = _bool(args[0])
        return (f, t)
    if op in (Op.AND, Op.OR):
        (at, af), (bt, bf) = _bool(args[0]), _bool(args[1])
        return (at and bt, af or bf) if op is Op.AND else (at or bt, af and bf)
    if op is Op.WHERE:
        t, f = _bool(args[0])
        branches = [b for b, taken in ((args[1], t), (args[2], f)) if taken]
        if any(b is None for b in branches):
            return None
        if node.dtype == BOOL:
            return (any(b[0] for b in branches), any(b[1] for b in branches))
        return (min(b[0] for b in branches), max(b[1] for b in branches))
    if any(a is None for a in args):
        return None
    if op in COMPARISONS:
        return _compare(op, *args)
    if op is Op.NEG:
        lo, hi = args[0]
        return (-hi, -lo)
    if op is Op.ABS:
        lo, hi = args[0]
        return (0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
    if op in (Op.ADD, Op.SUB, Op.MUL, Op.MIN, Op.MAX):
        (alo, ahi), (blo, bhi) = args
        if op is Op.ADD:
            return (alo + blo, ahi + bhi)
        if op is Op.SUB:
            return (alo - bhi, ahi - blo)
        if op is Op.MIN:
            return (min(alo, blo), min(ahi, bhi))
        if op is Op.MAX:
            return (max(alo, blo), max(ahi, bhi))
        corners = [x * y for x in (alo, ahi) for y in (blo, bhi)]
        return None if any(math.isnan(c) for c in corners) else (min(corners), max(corners))
    if op is Op.SUM and node.arg in sizes:
        n = sizes[node.arg]
        lo, hi = args[0]
        return (lo * n, hi * n)
    return None  # no rule: anything


def _compare(op: Op, a: tuple[float, float], b: tuple[float, float]) -> tuple[bool, bool]:
    """(may be true, may be false) of `a op b` for some / every pair of values in the intervals."""
    (alo, ahi), (blo, bhi) = a, b
    if op is Op.LT:
        return (alo < bhi, ahi >= blo)
    if op is Op.LE:
        return (alo <= bhi, ahi > blo)
    if op is Op.GT:
        return (ahi > blo, alo <= bhi)
    if op is Op.GE:
        return (ahi >= blo, alo < bhi)
    overlap = alo <= bhi and blo <= ahi
    single = alo == ahi == blo == bhi
    if op is Op.EQ:
        return (overlap, not single)
    return (not single, overlap)  # NE

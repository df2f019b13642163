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
from ..ir.program import Attention

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
    if seqs:  # runtime data, per call: every (block, tile) at once
        return [(lo, hi) for lo, hi, _, _ in grid_spans(mask, lq, lk, block_q, tile, sizes, seqs)]
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


_OTHER = object()  # `_common`: a node the rule of its caller bounds


def _common(node: Node, args: list, q, k, sizes):
    """The bounds both rules (`_rule`, over numbers; `_grid_rule`, over arrays) give alike: leaves, the ops that
    pass their values on, NOT; `_OTHER` for the rest."""
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
    return _OTHER


def _rule(node: Node, args: list[Bound], q, k, sizes) -> Bound:
    op = node.op
    common = _common(node, args, q, k, sizes)
    if common is not _OTHER:
        return common
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


# -- every (query block, key tile) at once: for sequence inputs, whose spans are computed per call -----------

class _RangeTable:
    """Least and greatest value over any [a, b] of positions in O(1) (sparse tables of `lo`'s minima and
    `hi`'s maxima over power-of-two windows), for arrays of (a, b)."""

    def __init__(self, lo: np.ndarray, hi: np.ndarray):
        self.mins, self.maxs = [np.asarray(lo, np.float64)], [np.asarray(hi, np.float64)]
        width = 1
        while 2 * width <= len(lo):
            m, x = self.mins[-1], self.maxs[-1]
            self.mins.append(np.minimum(m[:-width], m[width:]))
            self.maxs.append(np.maximum(x[:-width], x[width:]))
            width *= 2

    def query(self, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.mins[0])
        a, b = np.clip(a, 0, n - 1).astype(np.int64), np.clip(b, 0, n - 1).astype(np.int64)
        a, b = np.broadcast_arrays(a, np.maximum(a, b))
        level = np.floor(np.log2(b - a + 1)).astype(np.int64)
        lo, hi = np.empty(a.shape), np.empty(a.shape)
        for k in np.unique(level):  # a few levels: one fancy index each
            at = level == k
            first, last = a[at], b[at] - (1 << int(k)) + 1
            lo[at] = np.minimum(self.mins[k][first], self.mins[k][last])
            hi[at] = np.maximum(self.maxs[k][first], self.maxs[k][last])
        return lo, hi


def grid_spans(mask: Node, lq: int, lk: int, block_q: int, tile: int, sizes: dict[str, int],
               seqs: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> list[tuple[int, int, int, int]]:
    """Per block of `block_q` queries, (lo, hi, full_lo, full_hi) as `key_spans` and the flash kernels'
    `block_spans` define them (the keys the mask may leave visible; the longest run of tiles it leaves wholly
    visible, below Lk), the mask evaluated over every (block, tile) rectangle at once with NumPy: the same
    interval rules as `_rule`, over arrays."""
    q0 = np.arange(0, lq, block_q, dtype=np.float64)[:, None]
    q = (q0, np.minimum(q0 + block_q, lq) - 1)
    t0 = np.arange(0, lk, tile, dtype=np.float64)[None, :]
    k = (t0, np.minimum(t0 + tile, lk) - 1)
    tables = {name: _RangeTable(*r) for name, r in (seqs or {}).items()}
    memo: dict[Node, Bound] = {}
    for node in toposort([mask]):
        memo[node] = _grid_rule(node, [memo[a] for a in node.args], q, k, sizes, tables)
    shape = (q0.shape[0], t0.shape[1])
    result = memo[mask]
    may_true, may_false = ((np.ones(shape, bool),) * 2 if result is None else
                           (np.broadcast_to(result[0], shape), np.broadcast_to(result[1], shape)))
    whole = (t0[0] + tile <= lk)[None, :] & ~may_false
    out = []
    for b in range(shape[0]):
        hits = np.flatnonzero(may_true[b])
        if hits.size == 0:
            out.append((0, 0, 0, 0))
            continue
        first, last = int(hits[0]), int(hits[-1])
        best, run = (0, 0), None
        for t in np.flatnonzero(whole[b, first:last + 1]) + first:
            run = (run[0], int(t) + 1) if run is not None and run[1] == t else (int(t), int(t) + 1)
            if run[1] - run[0] > best[1] - best[0]:
                best = run
        out.append((first * tile, min((last + 1) * tile, lk), best[0] * tile, best[1] * tile))
    return out


def _grid_rule(node: Node, args: list, q, k, sizes, tables) -> Bound:
    """`_rule` over arrays of intervals (numbers: (lo, hi); booleans: (may be true, may be false))."""
    op = node.op
    if op is Op.GATHER:
        source, positions = node.args[0], args[1]
        if node.arg != TIME or source.arg not in tables or positions is None:
            return None
        return tables[source.arg].query(np.floor(positions[0]), np.ceil(positions[1]))
    common = _common(node, args, q, k, sizes)
    if common is not _OTHER:
        return common
    if op in (Op.AND, Op.OR):
        (at, af), (bt, bf) = _bool(args[0]), _bool(args[1])
        return (at & bt, af | bf) if op is Op.AND else (at | bt, af & bf)
    if op is Op.WHERE:
        t, f = _bool(args[0])
        if args[1] is None or args[2] is None:
            return None
        (a0, a1), (b0, b1) = args[1], args[2]
        if node.dtype == BOOL:
            return ((t & a0) | (f & b0), (t & a1) | (f & b1))
        big = np.inf
        lo = np.minimum(np.where(t, a0, big), np.where(f, b0, big))
        hi = np.maximum(np.where(t, a1, -big), np.where(f, b1, -big))
        return (lo, hi)
    if any(a is None for a in args):
        return None
    if op in COMPARISONS:
        (alo, ahi), (blo, bhi) = args
        if op is Op.LT:
            return (alo < bhi, ahi >= blo)
        if op is Op.LE:
            return (alo <= bhi, ahi > blo)
        if op is Op.GT:
            return (ahi > blo, alo <= bhi)
        if op is Op.GE:
            return (ahi >= blo, alo < bhi)
        overlap = (alo <= bhi) & (blo <= ahi)
        single = (alo == ahi) & (ahi == blo) & (blo == bhi)
        return (overlap, ~single) if op is Op.EQ else (~single, overlap)
    if op is Op.NEG:
        lo, hi = args[0]
        return (-hi, -lo)
    if op is Op.ABS:
        lo, hi = args[0]
        return (np.where((lo <= 0) & (hi >= 0), 0.0, np.minimum(abs(lo), abs(hi))), np.maximum(abs(lo), abs(hi)))
    if op in (Op.ADD, Op.SUB, Op.MUL, Op.MIN, Op.MAX):
        (alo, ahi), (blo, bhi) = args
        if op is Op.ADD:
            return (alo + blo, ahi + bhi)
        if op is Op.SUB:
            return (alo - bhi, ahi - blo)
        if op is Op.MIN:
            return (np.minimum(alo, blo), np.minimum(ahi, bhi))
        if op is Op.MAX:
            return (np.maximum(alo, blo), np.maximum(ahi, bhi))
        with np.errstate(invalid="ignore"):
            corners = np.stack(np.broadcast_arrays(*(x * y for x in (alo, ahi) for y in (blo, bhi))))
        if np.isnan(corners).any():
            return None
        return (corners.min(0), corners.max(0))
    if op is Op.SUM and node.arg in sizes:
        n = sizes[node.arg]
        lo, hi = args[0]
        return (lo * n, hi * n)
    return None


def sequence_ranges(program: Attention, arrays: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each sequence input's (min, max) over its batch axes per position, [L] NumPy arrays, from its tensor
    (L, *axes; torch): what `key_spans` bounds a read ``doc[q_idx]`` by (one device-to-host copy of
    2 L numbers a sequence)."""
    out = {}
    for d in program.seqs:
        t = arrays[d.name].reshape(arrays[d.name].shape[0], -1)
        out[d.name] = (t.amin(1).cpu().numpy(), t.amax(1).cpu().numpy())
    return out

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

def grid_spans(mask: Node, lq: int, lk: int, block_q: int, tile: int, sizes: dict[str, int],
               seqs: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> list[tuple[int, int, int, int]]:
    """Per block of `block_q` queries, (lo, hi, full_lo, full_hi) as `key_spans` and the flash kernels'
    `block_spans` define them (the keys the mask may leave visible; the longest run of tiles it leaves wholly
    visible, below Lk): `span_tables` on CPU tensors in float64, for one row of per-position ranges `seqs`."""
    import torch

    reads = {name: tuple(torch.as_tensor(np.asarray(x, np.float64))[None] for x in r)
             for name, r in (seqs or {}).items()}
    return [tuple(s) for s in span_tables(mask, lq, lk, block_q, tile, sizes, reads)[0].tolist()]


def span_tables(mask: Node | None, lq: int, lk: int, block_q: int, tile: int, sizes: dict[str, int],
                seqs: dict | None = None, device=None):
    """[R, blocks, 4] int64 torch, per row r and block of `block_q` queries, (lo, hi, full_lo, full_hi) as
    `grid_spans`, from the rules over every (block, tile) rectangle at once in torch ops on the ids' device:
    no host copy of the ids and no loop over rows, blocks or tiles (a fixed sequence of kernels that waits for
    nothing, as a CUDA graph needs; the shape's own tensors are made on its first call, `_grid_axes`). `seqs`:
    each sequence input's per-position (min, max) over the batch indices of a row, two [R, L] tensors (R = 1, or
    the same R for every input; L >= 1). As a plain loop (`_grid_rule`, `_runs`):

        for r, b, t: may[r, b, t] = the mask's (may be true, may be false) over queries of block b, keys of tile t,
                                    doc[q_idx] within (min, max) of seqs["doc"][r] over the block's positions
        lo, hi = first and last tile where it may be true;  full = the longest run of tiles in [lo, hi) where it
        cannot be false and that end below lk (the first of equals); (0, 0, 0, 0) where no tile may be true

    A read at a position other than q_idx or kv_idx (the frontend allows none) is unknown: sound."""
    import torch

    seqs = seqs or {}
    first = next(iter(seqs.values()), (None,))[0]
    device = first.device if first is not None else device
    dtype = first.dtype if first is not None and first.is_floating_point() else torch.float64
    rows = max([lo.shape[0] for lo, _ in seqs.values()] or [1])
    nb, nt = -(-lq // block_q), -(-lk // tile)
    if nb == 0 or nt == 0:
        return torch.zeros((rows, nb, 4), dtype=torch.int64, device=device)
    length = first.shape[-1] if first is not None else 0
    q, k, at, ends_inside = _grid_axes(lq, lk, block_q, tile, length, device, dtype)
    windows = {"q_idx": (nb, block_q, (nb, 1)), "kv_idx": (nt, tile, (1, nt))}
    reads = {}  # (sequence, index input) -> (min, max) of its windows

    def read(source: str, index: Node):
        if index.op is not Op.INPUT or index.arg not in windows or source not in seqs:
            return None
        key = (source, index.arg)
        if key not in reads:
            count, width, shape = windows[index.arg]
            lo, hi = seqs[source]
            lo = lo[:, at[index.arg]].view(-1, count, width)
            hi = lo if hi is seqs[source][0] else hi[:, at[index.arg]].view(-1, count, width)  # one row's own ids
            reads[key] = lo.amin(-1).view(-1, *shape), hi.amax(-1).view(-1, *shape)
        return reads[key]

    if mask is None:
        result = None
    else:
        order = toposort([mask])
        last_use = {a: i for i, n in enumerate(order) for a in n.args}
        memo: dict[Node, Bound] = {}
        for i, node in enumerate(order):
            memo[node] = _grid_rule(node, [memo[a] for a in node.args], q, k, sizes, read, device, dtype)
            for a in node.args:
                if last_use[a] == i and a is not mask:
                    memo.pop(a, None)  # large grids: keep only the values still to be read
        result = memo[mask]
    shape = (rows, nb, nt)
    if result is None:  # no mask: every tile whole; a mask the rules know nothing of: every tile partial
        may_true = torch.ones(shape, dtype=torch.bool, device=device)
        may_false = torch.full(shape, mask is not None, dtype=torch.bool, device=device)
    else:
        may_true, may_false = (torch.as_tensor(x, device=device).expand(shape) for x in result)
    return _spans_of(may_true, ~may_false & ends_inside, tile, lk)


_AXES: dict = {}


def _grid_axes(lq: int, lk: int, block_q: int, tile: int, length: int, device, dtype):
    """What `span_tables` needs of a shape alone, made once (cached): the query blocks' and key tiles' position
    intervals ([1, blocks, 1], [1, 1, tiles] (lo, hi) pairs), per index input the positions its windows read
    ([w * width, min((w + 1) * width, lq or lk) - 1], padded to `width` by the last, clamped into the `length`
    ids: the kernels clamp a read so), and which tiles end below lk ([1, 1, tiles])."""
    import torch

    key = (lq, lk, block_q, tile, length, device, dtype)
    hit = _AXES.get(key)
    if hit is None:
        nb, nt = -(-lq // block_q), -(-lk // tile)
        q0 = torch.arange(nb, device=device, dtype=dtype).mul_(block_q).view(1, nb, 1)
        t0 = torch.arange(nt, device=device, dtype=dtype).mul_(tile).view(1, 1, nt)
        at = {name: torch.arange(n * width, device=device).clamp_(max=max(0, min(end, length) - 1))
              for name, n, width, end in (("q_idx", nb, block_q, lq), ("kv_idx", nt, tile, lk))}
        if len(_AXES) >= 64:
            _AXES.clear()
        hit = _AXES[key] = ((q0, (q0 + block_q).clamp_(max=lq) - 1), (t0, (t0 + tile).clamp_(max=lk) - 1), at,
                            t0 + tile <= lk)
    return hit


def _runs(hit, whole):
    """(first, last, run_start, run_length), each [...] int64, over the last axis of `hit` and `whole` [..., n]
    bool: the first and last index where `hit` (-1 for last where none), and the longest run of consecutive
    indices in [first, last] where `whole` (the first of equals; length 0 where none)."""
    import torch

    n = hit.shape[-1]
    idx = torch.arange(n, device=hit.device)
    first = torch.where(hit, idx, n).amin(-1)
    last = torch.where(hit, idx, -1).amax(-1)
    inside = whole & (idx >= first[..., None]) & (idx <= last[..., None])
    gap = torch.where(inside, -1, idx).cummax(-1).values  # the last index at or before each not in a run
    length = torch.where(inside, idx - gap, 0)
    best, end = length.max(-1)  # the first maximum: the first of the longest runs
    return first, last, end + 1 - best, best


def _spans_of(may_true, whole, tile: int, limit: int):
    """[R, blocks, 4] int64: (lo, hi, full_lo, full_hi) in positions from the tiles a block may see (`may_true`
    [R, blocks, tiles]) and those it sees wholly (`whole`), tiles of `tile` positions, hi at most `limit`."""
    import torch

    first, last, start, length = _runs(may_true, whole)
    seen = last >= 0
    lo = torch.where(seen, first * tile, 0)
    hi = torch.where(seen, ((last + 1) * tile).clamp(max=limit), 0)
    run = seen & (length > 0)
    return torch.stack((lo, hi, torch.where(run, start * tile, 0), torch.where(run, (start + length) * tile, 0)), -1)


def _grid_rule(node: Node, args: list, q, k, sizes, read, device, dtype) -> Bound:
    """`_rule` over torch tensors of intervals broadcast over [R, blocks, tiles] (numbers: (lo, hi); booleans:
    (may be true, may be false)). A NaN bound (inf - inf, 0 * inf) widens to -inf or +inf: unknown, so sound."""
    import torch

    def _bool(b):  # (may be true, may be false) as tensors: torch.where takes no Python bool
        return (torch.ones((), dtype=torch.bool, device=device),) * 2 if b is None else b

    op = node.op
    if op is Op.GATHER:
        return read(node.args[0].arg, node.args[1]) if node.arg == TIME and node.args[0].op is Op.INPUT else None
    common = _common(node, args, q, k, sizes)
    if common is not _OTHER:
        if isinstance(common, tuple) and not torch.is_tensor(common[0]):  # a constant: tensors, for ~ and where
            common = tuple(torch.full((), v, device=device, dtype=torch.bool if isinstance(v, bool) else dtype)
                           for v in common)
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
        inf = math.inf
        return (torch.minimum(torch.where(t, a0, inf), torch.where(f, b0, inf)),
                torch.maximum(torch.where(t, a1, -inf), torch.where(f, b1, -inf)))
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
        return (torch.where((lo <= 0) & (hi >= 0), 0.0, torch.minimum(lo.abs(), hi.abs())), torch.maximum(lo.abs(),
                                                                                                        hi.abs()))
    if op in (Op.ADD, Op.SUB, Op.MUL, Op.MIN, Op.MAX):
        (alo, ahi), (blo, bhi) = args
        if op is Op.ADD:
            return _widened(alo + blo, ahi + bhi)
        if op is Op.SUB:
            return _widened(alo - bhi, ahi - blo)
        if op is Op.MIN:
            return (torch.minimum(alo, blo), torch.minimum(ahi, bhi))
        if op is Op.MAX:
            return (torch.maximum(alo, blo), torch.maximum(ahi, bhi))
        corners = torch.stack(torch.broadcast_tensors(*(x * y for x in (alo, ahi) for y in (blo, bhi))))
        return _widened(corners.amin(0), corners.amax(0))  # a NaN corner makes both NaN: widened
    if op is Op.SUM and node.arg in sizes:
        n = sizes[node.arg]
        lo, hi = args[0]
        return _widened(lo * n, hi * n)
    return None


def _widened(lo, hi):
    """(lo, hi) with a NaN bound (inf - inf, 0 * inf: any value) made -inf or +inf."""
    import torch

    return torch.where(lo.isnan(), -math.inf, lo), torch.where(hi.isnan(), math.inf, hi)


def sequence_ranges(program: Attention, arrays: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each sequence input's (min, max) over its batch axes per position, [L] NumPy arrays, from its tensor
    (L, *axes; torch): what `key_spans` bounds a read ``doc[q_idx]`` by (one device-to-host copy of
    2 L numbers a sequence)."""
    out = {}
    for d in program.seqs:
        t = arrays[d.name].reshape(arrays[d.name].shape[0], -1)
        out[d.name] = (t.amin(1).cpu().numpy(), t.amax(1).cpu().numpy())
    return out

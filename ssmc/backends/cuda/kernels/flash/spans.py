"""The flash kernels' span tables over per-position ids (document masks) from one generated kernel.

    text, name = span_source(mask, block_q, tile, sizes, seqs)          # None where the rule cannot print
    table = span_kernel_table(mask, lq, lk, block_q, tile, sizes, seqs, gqa)  # None: use span_tables

`mask_blocks.span_tables` builds these tables from a few dozen torch ops a call; here the same values come
from one launch: the mask's interval rule (`mask_blocks._grid_rule`, the same ops, the same rounding: the
rule's numbers in the ids' float type, float64 for integer ids) printed as C over scalars. `seqs` as
`span_tables` takes it: each sequence input's per-position (min, max) over a row's batch indices, two [R, L]
tensors (R = 1 or the same R for each; any strides). The result is `forward.row_span_table`'s layout:
[R * (4 * blocks + 2)] int32, blocks = ceil(lq / block_q), each row's (lo, hi, full_lo, full_hi) per block
then gqa's (group, inner). As a plain loop (a block of threads per row r):

    for each read s[idx] of the mask (idx q_idx or kv_idx), window w of its blocks (tiles), positions clamped
        into the ids:  scratch[s, idx, r, w] = (min of lo[r, p], max of hi[r, p]) over the window's positions
    for each block b:
        for each tile t: (may_true, may_false)[t] = the rule over queries of b, keys of t, reads from scratch
        lo, hi = first and last tile that may be true; full = the longest run of tiles in [lo, hi] that cannot
        be false and end below lk (the first of equals); (0, 0, 0, 0) where no tile may be true
    with key_bn (the backward): after a barrier, per key block of key_bn keys, `backward.key_block_tables` from
        the row's query spans just written (a second [R * (4 * key blocks + 2)] table)

With integer ids the rule's sums of two reads are exact here in float64, where torch's NaN-widening rounds
them to float32: the tables agree while ids stay below 2**24 in magnitude.

A call's whole per-call work with document ids (the flash forward's and backward's, `forward.fused_tables`): one buffer,
one launch of the kernel in its fused form, which also writes the flash kernels' param table (`forward.param_table`'s
values) from the ids as the user gave them (`Call.seqs`: ids the modifiers only compare, any printable type):

    plan = forward.fused_plan(program, call, block_q, tile, gqa, key_bn)   # once per signature; None: apart
    buffer, table_at, spans_at, keys_at = forward.fused_tables(plan, program, call)   # per call: addresses

    per row r (a block), before the loop above:
        table[:prefix] = the cached columns (and the params' part, `forward.table_prefix`)   (grid-strided)
        for each sequence s:  table[tail_s + r * L + p] = ids[r, p] - min_p ids[r, p]   where exact in float32
                              (whole numbers less than 2**24 apart), else the rank of ids[r, p] among the row's
                              distinct ids (an O(L^2) loop; a NaN: L + p, a document of its own)
    then the loop above reads the table's rows of ids (float32), as the flash kernels will: either way every ==
    and < between two positions of a row is what the ids gave, and the spans are those of `row_ranks`' ids.
"""

from __future__ import annotations

import hashlib
import math

from .....ir.axes import TIME
from .....ir.node import BOOL, Node, toposort
from .....ir.ops import COMPARISONS, Op
from .. import template
from ..loaded import loaded_function

THREADS = 256
_ID_TYPES = {"torch.int64": "long long", "torch.int32": "int", "torch.int16": "short", "torch.uint8": "unsigned char",
             "torch.float32": "float", "torch.float64": "double"}
_PASS = (Op.RENAME, Op.EXPAND, Op.SELECT, Op.SLICE, Op.REDUCE_MAX)


class Unprintable(Exception):
    """A mask whose rule this printer does not mirror exactly (the torch ops then build the tables)."""


def _literal(x: float) -> str:
    if math.isinf(x):
        return "SPAN_INF" if x > 0 else "(-SPAN_INF)"
    return f"(span_t){float(x)!r}"


def print_rule(mask: Node | None, sizes: dict[str, int], seqs: dict[str, str]) -> tuple[str, list, list]:
    """(the body of ``span_rule``, the reads [(source, index input)], the size names it reads): `_grid_rule` over
    the mask's nodes as C statements on scalars, an interval (lo, hi) a number and (may be true, may be false) a
    boolean, `seqs` the sequence inputs (name -> the C type of their ids). Raises `Unprintable`."""
    lines: list[str] = []
    reads: list[tuple[str, str]] = []
    names: list[str] = []
    if mask is None:
        return "    may_true = true;\n    may_false = false;\n", reads, names
    values: dict[Node, tuple | None] = {}
    true = ("b", "true", "true")

    def boolean(v):
        if v is None:
            return true
        if v[0] != "b":
            raise Unprintable("a number where the rule takes a boolean")
        return v

    def number(*vs):
        if any(v[0] != "n" for v in vs):
            raise Unprintable("a boolean where the rule takes a number")

    def size(name: str) -> int:
        if name not in names:
            names.append(name)
        return 2 * names.index(name)

    for i, node in enumerate(toposort([mask])):
        args = [values[a] for a in node.args]
        op, v = node.op, f"v{i}"
        out: tuple | None = None
        if op is Op.GATHER:
            index = node.args[1]
            if (node.arg == TIME and node.args[0].op is Op.INPUT and node.args[0].arg in seqs
                    and index.op is Op.INPUT and index.arg in ("q_idx", "kv_idx")):
                key = (node.args[0].arg, index.arg)
                if key not in reads:
                    reads.append(key)
                j = [r for r in reads if r[1] == index.arg].index(key)
                side = "rq" if index.arg == "q_idx" else "rk"
                out = ("n", f"{side}[{j}][0]", f"{side}[{j}][1]")
        elif op is Op.INPUT:
            out = {"q_idx": ("n", "q0", "q1"), "kv_idx": ("n", "k0", "k1")}.get(node.arg)
        elif op is Op.CONST:
            out = None if math.isnan(node.arg) else ("n", _literal(node.arg), _literal(node.arg))
        elif op in (Op.SIZE, Op.IOTA):
            if node.arg in sizes:
                k = size(node.arg)
                out = ("n", f"dims_f[{k}]", f"dims_f[{k}]") if op is Op.SIZE else ("n", "(span_t)0", f"dims_f[{k + 1}]")
        elif op in _PASS:
            out = args[0]
        elif op is Op.NOT:
            _, t, f = boolean(args[0])
            out = ("b", f, t)
        elif op in (Op.AND, Op.OR):
            (_, at, af), (_, bt, bf) = boolean(args[0]), boolean(args[1])
            if op is Op.AND:
                lines += [f"    const bool {v}_t = {at} && {bt}, {v}_f = {af} || {bf};"]
            else:
                lines += [f"    const bool {v}_t = {at} || {bt}, {v}_f = {af} && {bf};"]
            out = ("b", f"{v}_t", f"{v}_f")
        elif op is Op.WHERE:
            _, t, f = boolean(args[0])
            if args[1] is not None and args[2] is not None:
                (ka, a0, a1), (kb, b0, b1) = args[1], args[2]
                if node.dtype == BOOL:
                    if ka != "b" or kb != "b":
                        raise Unprintable("a number where the rule takes a boolean")
                    lines += [f"    const bool {v}_t = ({t} && {a0}) || ({f} && {b0}), "
                              f"{v}_f = ({t} && {a1}) || ({f} && {b1});"]
                    out = ("b", f"{v}_t", f"{v}_f")
                else:
                    number(args[1], args[2])
                    lines += [f"    const span_t {v}_lo = span_min({t} ? {a0} : SPAN_INF, {f} ? {b0} : SPAN_INF),",
                              f"                 {v}_hi = span_max({t} ? {a1} : -SPAN_INF, {f} ? {b1} : -SPAN_INF);"]
                    out = ("n", f"{v}_lo", f"{v}_hi")
        elif any(a is None for a in args):
            out = None
        elif op in COMPARISONS:
            number(*args)
            (_, alo, ahi), (_, blo, bhi) = args
            t, f = {Op.LT: (f"{alo} < {bhi}", f"{ahi} >= {blo}"), Op.LE: (f"{alo} <= {bhi}", f"{ahi} > {blo}"),
                    Op.GT: (f"{ahi} > {blo}", f"{alo} <= {bhi}"), Op.GE: (f"{ahi} >= {blo}", f"{alo} < {bhi}")}.get(
                op, (None, None))
            if t is None:
                overlap = f"({alo} <= {bhi} && {blo} <= {ahi})"
                single = f"({alo} == {ahi} && {ahi} == {blo} && {blo} == {bhi})"
                t, f = (overlap, f"!{single}") if op is Op.EQ else (f"!{single}", overlap)
            lines += [f"    const bool {v}_t = {t}, {v}_f = {f};"]
            out = ("b", f"{v}_t", f"{v}_f")
        elif op in (Op.NEG, Op.ABS):
            number(*args)
            _, lo, hi = args[0]
            if op is Op.NEG:
                lines += [f"    const span_t {v}_lo = -{hi}, {v}_hi = -{lo};"]
            else:
                lines += [f"    const span_t {v}_lo = {lo} <= 0 && {hi} >= 0 ? (span_t)0 : span_min(span_abs({lo}), "
                          f"span_abs({hi})), {v}_hi = span_max(span_abs({lo}), span_abs({hi}));"]
            out = ("n", f"{v}_lo", f"{v}_hi")
        elif op in (Op.ADD, Op.SUB, Op.MUL, Op.MIN, Op.MAX) or (op is Op.SUM and node.arg in sizes):
            number(*args)
            (_, alo, ahi) = args[0]
            if op is Op.SUM:
                k = size(node.arg)
                (_, blo, bhi) = ("n", f"dims_f[{k}]", f"dims_f[{k}]")
                op = Op.MUL  # by n >= 0: the corners' min and max are lo * n and hi * n
            else:
                (_, blo, bhi) = args[1]
            if op is Op.MIN or op is Op.MAX:
                fn = "span_min" if op is Op.MIN else "span_max"
                lines += [f"    const span_t {v}_lo = {fn}({alo}, {blo}), {v}_hi = {fn}({ahi}, {bhi});"]
            elif op is Op.MUL:
                if node.op is Op.SUM:
                    lines += [f"    span_t {v}_lo = SPAN_MUL({alo}, {blo}), {v}_hi = SPAN_MUL({ahi}, {bhi});"]
                else:
                    c = [f"SPAN_MUL({x}, {y})" for x in (alo, ahi) for y in (blo, bhi)]
                    a, b, d, e = (f"{v}_c[{j}]" for j in range(4))
                    lines += [f"    const span_t {v}_c[4] = {{{', '.join(c)}}};",
                              f"    span_t {v}_lo = span_min(span_min({a}, {b}), span_min({d}, {e})),",
                              f"           {v}_hi = span_max(span_max({a}, {b}), span_max({d}, {e}));",
                              # a NaN corner (0 * inf): torch's amin and amax are NaN, then widened
                              f"    if ({v}_c[0] != {v}_c[0] || {v}_c[1] != {v}_c[1] || {v}_c[2] != {v}_c[2] "
                              f"|| {v}_c[3] != {v}_c[3]) {{ {v}_lo = {v}_hi = (span_t)0 / (span_t)0; }}"]
            else:
                lo, hi = (f"SPAN_ADD({alo}, {blo})", f"SPAN_ADD({ahi}, {bhi})") if op is Op.ADD else \
                    (f"SPAN_ADD({alo}, -{bhi})", f"SPAN_ADD({ahi}, -{blo})")
                lines += [f"    span_t {v}_lo = {lo}, {v}_hi = {hi};"]
            if op not in (Op.MIN, Op.MAX):  # inf - inf, 0 * inf: any value (`_widened`)
                lines += [f"    {v}_lo = {v}_lo != {v}_lo ? -SPAN_INF : {v}_lo;",
                          f"    {v}_hi = {v}_hi != {v}_hi ? SPAN_INF : {v}_hi;"]
            out = ("n", f"{v}_lo", f"{v}_hi")
        values[node] = out
    result = values[mask]
    if result is None:  # the rule knows nothing: every tile may be true and may be false
        lines += ["    may_true = true;", "    may_false = true;"]
    else:
        _, t, f = boolean(result)
        lines += [f"    may_true = {t};", f"    may_false = {f};"]
    return "\n".join(lines) + "\n", reads, names


_SOURCES: dict = {}


def span_source(mask: Node | None, block_q: int, tile: int, size_names: tuple[str, ...], seqs: dict,
                key_bn: int = 0, fused: tuple = ()) -> tuple | None:
    """(CUDA source, kernel name, reads, size names, the inputs read in order) of the span kernel for `mask` over
    `seqs` (name -> (lo, hi) tensors, as `span_tables` takes them); None where the rule or the ids' types do not
    print (`Unprintable`, ids of a 16-bit float type). `fused`: ((name, torch dtype string), ...) of the param
    table's sequence rows (`forward.fused_tables`): the kernel then writes the param table too and its rule reads those
    rows (float32; `seqs` unused), the ids as given passed instead."""
    types = ({name: "torch.float32" for name, _ in fused} if fused else
             {name: str(lo.dtype) for name, (lo, _) in seqs.items()})
    first = next(iter(types.values()), "torch.float64")
    key = (mask, block_q, tile, size_names, tuple(types.items()), key_bn, fused)
    if key in _SOURCES:
        return _SOURCES[key]
    hit = body = None
    if all(t in _ID_TYPES for t in types.values()) and all(t in _ID_TYPES for _, t in fused):
        try:
            ctypes = {n: _ID_TYPES[t] for n, t in types.items()}
            body, reads, names = print_rule(mask, dict.fromkeys(size_names, 0), ctypes)
        except Unprintable:
            body = None
        if body is not None:
            inputs = list(dict.fromkeys(s for s, _ in reads))
            ctx_reads, offset = [], []
            for source, index in reads:
                q = index == "q_idx"
                ctx_reads.append({"q": q, "input": inputs.index(source), "offset": " + ".join(offset) or "0"})
                offset.append("2 * nb" if q else "2 * nt")
            pointers = [f"const {_ID_TYPES[types[s]]}* __restrict__ ids_{side}{i}" for i, s in enumerate(inputs)
                        for side in ("lo", "hi")]
            names_fused = [n for n, _ in fused]
            if fused:
                pointers = [f"const {_ID_TYPES[t]}* __restrict__ raw{i}" for i, (_, t) in enumerate(fused)]
            ftype = "float" if first == "torch.float32" else "double"
            digest = hashlib.sha1(repr((body, block_q, tile, ftype, pointers, key_bn)).encode()).hexdigest()[:12]
            name = f"ssmc_spans_{digest}"
            if fused and not set(inputs) <= set(names_fused):
                body = None  # a read of a sequence the param table has no rows of
        if body is not None:
            text = template("flash/spans.cu.j2").render(
                F=ftype, body=body, threads=THREADS, name=name, pointers=pointers, bq=block_q, tile=tile,
                reads=ctx_reads, inputs=len(inputs), key_bn=key_bn, sizes=2 * len(names),
                nq=sum(r["q"] for r in ctx_reads),
                nk=sum(not r["q"] for r in ctx_reads),
                fused=[{"type": _ID_TYPES[t], "integer": "int" in t} for _, t in fused],
                rule_inputs=[names_fused.index(s) for s in inputs] if fused else [])
            hit = (text, name, reads, names, inputs, ftype)
    if len(_SOURCES) >= 64:
        _SOURCES.clear()
    _SOURCES[key] = hit
    return hit


_DIMS: dict = {}


def span_kernel_table(mask: Node | None, lq: int, lk: int, block_q: int, tile: int, sizes: dict[str, int],
                      seqs: dict, gqa: tuple[int, int] = (1, 1), key_bn: int = 0):
    """`forward.row_span_table(span_tables(mask, lq, lk, block_q, tile, sizes, seqs), gqa)` from one launch of
    the span kernel (module docstring), on the ids' device; None where the kernel cannot build it (the caller
    then runs the torch ops). `key_bn` (a multiple of `tile`): a pair, then the backward's key blocks of
    `key_bn` too, `row_span_table(backward.key_block_tables(spans, lk, key_bn), gqa)`, from the same launch."""
    import torch

    from ...launch import launch_kernel

    if not seqs:
        return None
    if key_bn % tile:
        return None
    found = span_source(mask, block_q, tile, tuple(sorted(sizes)), seqs, key_bn)
    if found is None:
        return None
    text, name, reads, names, inputs, ftype = found
    lo0 = next(iter(seqs.values()))[0]
    device, length = lo0.device, lo0.shape[-1]
    rows = max(lo.shape[0] for lo, _ in seqs.values())
    nb, nt = -(-lq // block_q), -(-lk // tile)
    strides = []
    for s in inputs:
        lo, hi = seqs[s]
        if lo.stride() != hi.stride() or lo.shape != hi.shape or lo.dtype != hi.dtype:
            return None
        strides += [0 if lo.shape[0] == 1 else lo.stride(0), lo.stride(1)]
    numbers = [length, rows, *strides, *(x for n in names for x in (sizes[n], sizes[n] - 1)), *gqa]
    key = (device, tuple(numbers))
    dims = _DIMS.get(key)
    if dims is None:  # a shape's numbers, copied to the device once
        if len(_DIMS) >= 64:
            _DIMS.clear()
        dims = _DIMS[key] = torch.tensor(numbers, dtype=torch.int64, device=device)
    table = torch.empty(rows * (4 * nb + 2), dtype=torch.int32, device=device)
    scratch = torch.empty(max(1, 2 * rows * sum(nb if i == "q_idx" else nt for _, i in reads)),
                          dtype=torch.float32 if ftype == "float" else torch.float64, device=device)
    keys = torch.empty(rows * (4 * -(-lk // key_bn) + 2) if key_bn else 0, dtype=torch.int32, device=device)
    if rows == 0:
        return (table, keys) if key_bn else table
    fn = loaded_function(text, name, device)
    pointers = [dims.data_ptr(), *(x.data_ptr() for s in inputs for x in seqs[s]), table.data_ptr(),
                scratch.data_ptr(), *([keys.data_ptr()] if key_bn else [])]
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):
            launch_kernel(fn, (rows, THREADS), lq, lk, pointers)
    else:
        launch_kernel(fn, (rows, THREADS), lq, lk, pointers)
    return (table, keys) if key_bn else table


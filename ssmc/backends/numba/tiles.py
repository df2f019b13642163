"""A blocked kernel's per-step products with a param, as calls to a register-tiled micro-kernel.

A blocked kernel (`blocking.py`) owns a block of rows q (batch indices) and, every step, adds
products of a param such as

    for j: for q: for g, k:        m[q, g, k] += h[q, j] U[j, g, k]         # an LSTM's h U
    for g: for q: for k: for j:    m[q, j] += gz[q, g, k] Ut[g, k, j]       # its adjoint's gz U^T

that is ``T[q, n] += A[q, kk] B[kk, n]`` with kk the summed axes and n the target's other axes
(each group flattened in the order the loops index it). As loop nests (`lowering/unroll.py`) they
load and store the accumulator every few terms. `tile_products` replaces each such nest by

    tile_product(T.reshape(bs, N), A.reshape(bs, K), pk<i>, rows)

where ``pk<i>`` is B packed once per kernel call, before the prange, as panels of NR = two SIMD
vectors of columns, ``pk[p, kk, r] = B[kk, p * NR + r]`` (zero past N). The micro-kernel (in the
module template) keeps a tile of 8 rows x NR columns of T in 16 vector registers while kk runs
(`simd.py`): per kk it loads two vectors of the panel, broadcasts 8 values of A and does 16 vector
FMAs; the panel (K x NR) streams from L1 for every tile of rows. Each element of T still gets
its terms added by fused multiply-adds in the order of kk.

For the LSTM's h U in fp32 on two cores, tiles with packed U beat tiles reading U in place, and
both beat the plain nest by far; see bench/results/2026-11-27-from-code-comments.md.

Applies where T and A are the block's own buffers (C-contiguous, rows first, the other axes in
the loops' order) and B is a param (unchanged over the call) indexed by the summed loops, then
the target's, each by its loop variable alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...lowering.loops import Assign, Bin, Buffer, Load, Loop, walk

TILE_ROWS = (8, 4, 1)  # micro-kernels by rows: 8 x 2 vectors = 16 accumulators of 32 AVX-512 registers


@dataclass
class TiledProduct:
    """``target[:rows] += a[:rows] @ B`` (2-D views of the block's buffers), B packed as `packed`."""

    target: str
    a: str
    packed: str
    rows: str          # the block's row count
    block: str         # the buffers' first extent
    n: str             # flattened extent of the target's other axes
    k: str             # flattened extent of the summed axes


@dataclass
class Packing:
    """``packed[p, kk, r] = array[kk..., (p NR + r)...]``: a param as panels of NR columns."""

    packed: str
    array: str
    k_axes: tuple[tuple[str, str], ...]   # (loop variable, extent), summed axes in order
    n_axes: tuple[tuple[str, str], ...]


def tile_products(step: list, setup: list, params: set[str], rows_var: str, rows_extent: str,
                  block: str) -> tuple[list, list[Packing]]:
    """`step` with every matching top-level nest (module docstring) replaced by a `TiledProduct`,
    and the packings they read. `setup` declares the block's buffers; `rows_var` is the block's
    row loop variable (``q_b``) and `rows_extent` its extent."""
    buffers = {s.name: s.shape for s in walk(setup) if isinstance(s, Buffer)}
    packings: dict[tuple, Packing] = {}
    out = []
    for s in step:
        found = _match(s, buffers, params, rows_var, rows_extent, block) if isinstance(s, Loop) else None
        if found is None:
            out.append(s)
            continue
        target, a, array, k_axes, n_axes, k, n = found
        key = (array, k_axes, n_axes)
        if key not in packings:
            packings[key] = Packing(f"pk{len(packings)}", array, k_axes, n_axes)
        out.append(TiledProduct(target, a, packings[key].packed, rows_extent, block, n, k))
    return out, list(packings.values())


def _match(loop: Loop, buffers: dict, params: set[str], q: str, rows_extent: str, block: str):
    """(target, a, param, k axes, n axes, K, N) when `loop` is a perfect nest ``T[q, n] += A[q, kk] B[kk, n]``
    (K, N: the flattened extents of A's and T's buffers past the rows)."""
    loops, body = [], [loop]
    while len(body) == 1 and isinstance(body[0], Loop):
        loops.append(body[0])
        body = body[0].body
    if len(body) != 1 or not isinstance(body[0], Assign) or any(x.reverse for x in loops):
        return None
    assign = body[0]
    t, value = assign.target, assign.value
    if assign.op != "+=" or not isinstance(t, Load) or not isinstance(value, Bin) or value.op != "*":
        return None
    if not (isinstance(value.a, Load) and isinstance(value.b, Load)):
        return None
    extents = {x.var: x.extent for x in loops}
    if len(extents) != len(loops) or extents.get(q) != rows_extent:
        return None
    for a, b in ((value.a, value.b), (value.b, value.a)):
        if a.array in params or b.array not in params or not (a.index and t.index):
            continue
        if a.index[0] != q or t.index[0] != q or a.array == t.array:
            continue
        k_vars, n_vars = a.index[1:], t.index[1:]
        if b.index != (*k_vars, *n_vars) or set(extents) != {q, *k_vars, *n_vars} or not k_vars or not n_vars:
            continue
        k_axes = tuple((v, extents[v]) for v in k_vars)
        n_axes = tuple((v, extents[v]) for v in n_vars)
        # the buffers' own extents (a renamed axis, h[q, j] of a state h [b k], has another name
        # for the same size)
        a_shape, t_shape = buffers.get(a.array), buffers.get(t.array)
        if not (a_shape and t_shape and a_shape[0] == block == t_shape[0]):
            continue
        if len(a_shape) != 1 + len(k_vars) or len(t_shape) != 1 + len(n_vars):
            continue
        return t.array, a.array, b.array, k_axes, n_axes, " * ".join(a_shape[1:]), " * ".join(t_shape[1:])
    return None


def _flat_extent(axes) -> str:
    return " * ".join(e for _, e in axes)


def _flat_index(axes) -> str:
    index = axes[0][0]
    for var, extent in axes[1:]:
        index = f"({index}) * {extent} + {var}"
    return index


def packing_lines(p: Packing, dtype_var: str = "F") -> list[str]:
    """Source lines (before the prange) that allocate and fill ``p.packed``; NR is the module's
    panel width. The outer summed loop runs in parallel."""
    k, n = _flat_extent(p.k_axes), _flat_extent(p.n_axes)
    kk, nn = _flat_index(p.k_axes), _flat_index(p.n_axes)
    index = ", ".join(v for v, _ in (*p.k_axes, *p.n_axes))
    lines = [f"{p.packed} = np.zeros(((({n}) + NR - 1) // NR, {k}, NR), dtype={dtype_var})"]
    loops = [*p.k_axes, *p.n_axes]
    for depth, (var, extent) in enumerate(loops):
        kind = "numba.prange" if depth == 0 else "range"
        lines.append(f"{'    ' * depth}for {var} in {kind}({extent}):")
    pad = "    " * len(loops)
    lines.append(f"{pad}{p.packed}[({nn}) // NR, {kk}, ({nn}) % NR] = {p.array}[{index}]")
    return lines


def product_line(s: TiledProduct) -> str:
    """The call that replaces the nest."""
    return (f"tile_product({s.target}.reshape(({s.block}, {s.n})), {s.a}.reshape(({s.block}, {s.k})), "
            f"{s.packed}, {s.rows})")

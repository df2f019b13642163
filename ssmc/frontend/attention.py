"""``ssmc.attention``: softmax attention whose score modifier and mask are written in the spec language.

    def alibi(score, q_idx, kv_idx, slope: ssmc.Param["h"]):
        return score - slope * (q_idx - kv_idx)

    attn = ssmc.attention(score_mod=alibi, mask_mod=ssmc.causal, batch="b h", head_dim="d")
    out = attn(q, k, v, slope=slopes)       # q, k: [b h t d], v: [b h t e] with layout "b h t ..."

Grouped-query attention: ``kv_heads="h"`` lets k and v have fewer heads than q (a divisor of q's):
query head h reads key / value head h // (Hq / Hkv); params along h stay per query head.

`score` has the batch axes; `q_idx` and `kv_idx` are the query and key positions (scalars per
step); captured tensors must be `ssmc.Param` (constant over time). The mask returns True where a
key is visible. The meaning, as a plain loop, is in `ssmc.ir.program.Attention`.

Indexed reads: a modifier may index a param table at an integer expression of the positions, the index
clamped into the table (T5's bucketed relative positions), and read per-position inputs, ``ssmc.Seq``
(one value per position, e.g. document ids [b, t]), at the query's or key's position:

    def rel(score, q_idx, kv_idx, table: ssmc.Param["h r"]):
        return score + table[q_idx - kv_idx]          # table[h, clamp(i - j, 0, R - 1)]

    def doc_mask(q_idx, kv_idx, doc: ssmc.Seq["b"]):
        return (kv_idx <= q_idx) & (doc[q_idx] == doc[kv_idx])

    attn(q, k, v, table=t, doc=ids)   # ids [b, t] in the layout's order (integers), q's length

The table's gradient is the sum of the scores' gradients over the (i, j) that read each entry (summed in a
fixed order: deterministic); sequences get none.

Packed sequences: ``attn(q, k, v, cu_seqlens=cu)`` with q, k, v packed along time in a batch of 1 and
`cu` [N+1] the cumulative lengths (flash-attn's varlen offsets): each query attends to the keys of its own
sequence, q_idx and kv_idx counted from that sequence's start (ssmc/packed.py). Where the keys are packed apart
(``cu_seqlens_k``) and a sequence has more keys than queries, a causal mask lines its queries up with its first
keys (flash-attn's causal varlen lines them up with the last).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import numpy as np

from ..errors import Loc, SpecError
from ..ir.axes import TIME, format_axes, parse_axes
from ..ir.node import BOOL, FLOAT, Node, toposort
from ..ir.ops import Op
from ..ir.program import Attention, Decl, Role
from ..ir.verify import verify_nodes
from .spec import SourceInfo, compile_spec, input_leaf, read_signature, trace
from .tensor import Tensor, as_tensor


def causal(q_idx, kv_idx):
    """Mask: a query sees keys at its own position and before."""
    return kv_idx <= q_idx


def sliding_window(size: int):
    """Mask: a query sees the `size` most recent keys, itself included (`size` a whole number >= 1)."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"sliding_window takes a whole number of keys >= 1, got {size!r}")

    def mask(q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < size)
    mask.__name__ = f"sliding_window_{size}"
    return mask


def _trace_mod(fn: Callable, kind: str, leading: list[Tensor], batch: tuple[str, ...], locs: dict[Node, Loc]
               ) -> tuple[Node, list[Decl], dict[str, int]]:
    src = SourceInfo(fn)
    n_lead = len(leading)
    sig = list(inspect.signature(fn).parameters)
    if len(sig) < n_lead:
        want = "(score, q_idx, kv_idx, *params)" if kind == "score_mod" else "(q_idx, kv_idx, *params)"
        raise SpecError(f"{kind} must take {want}", src.def_loc)
    decls, sizes = read_signature(fn, src, (Role.PARAM, Role.SEQ), skip=n_lead)
    for d in decls:
        if d.role is Role.SEQ and any(a not in batch for a in d.axes):
            raise SpecError(f"sequence {d.name!r} has axes {format_axes(d.axes)} beyond the batch axes "
                            f"{format_axes(batch)}: it holds one value per position (and some batch axes)", d.loc)
    leaves = [input_leaf(d) if d.role is Role.PARAM else
              Tensor(Node.make(Op.INPUT, (), d.name, (TIME, *d.axes), loc=d.loc)) for d in decls]
    result = trace(fn, leading + leaves, sizes, src, locs)
    ret = src.return_loc
    try:
        node = as_tensor(result).node
    except SpecError as err:
        raise SpecError(f"{kind} result: {err.message}", ret) from None
    node_loc = locs.get(node) or ret
    seq_decls = {d.name: d for d in decls if d.role is Role.SEQ}
    for n in toposort([node]):  # a sequence is read only at a position (a gather along time)
        used = [a for i, a in enumerate(n.args) if a.op is Op.INPUT and a.arg in seq_decls
                and not (n.op is Op.GATHER and i == 0 and n.arg == TIME)]
        if used or (n is node and n.op is Op.INPUT and n.arg in seq_decls):
            d = seq_decls[(used[0] if used else n).arg]
            raise SpecError(f"{kind} uses {d.name!r}, an ssmc.Seq (one value per position), as a whole: read it "
                            f"at a position, {d.name}[q_idx] or {d.name}[kv_idx]; a value constant over time is an "
                            "ssmc.Param", d.loc)
    extra = [a for a in node.axes if a not in batch]
    if extra:
        raise SpecError(f"{kind} returns axes {format_axes(node.axes)}, but scores have only the batch "
                        f"axes {format_axes(batch)}", node_loc)
    for n in toposort([node]):
        if n.op is Op.GATHER and n.arg in batch:
            what = getattr(n.args[0], "arg", None)
            raise SpecError(f"{kind}: {what!r} is indexed along {n.arg!r}, one of the batch axes "
                            f"{format_axes(batch)}: index a table along an axis of its own "
                            f"(ssmc.Param[\"h r\"] indexed along r)", locs.get(n) or node_loc)
    want = FLOAT if kind == "score_mod" else BOOL
    if node.dtype != want:
        raise SpecError(f"{kind} must return a {'score (float)' if want == FLOAT else 'boolean mask'}, "
                        f"got a {node.dtype}", node_loc)
    return node, decls, sizes


class AttentionSpec:
    """What ``ssmc.attention`` returns: the program and a way to call it (see module docstring)."""

    def __init__(self, program: Attention):
        self.program = program
        self.__name__ = program.name

    def __repr__(self) -> str:
        return f"<ssmc.attention {self.program.name}>"

    def compile(self, backend=None, *, layout="t ..."):
        """`ssmc.compile` of this spec (`api.CompiledAttention`)."""
        return compile_spec(self, backend, layout=layout)

    def __call__(self, q, k, v, *args, layout="t ...", return_lse=False, cu_seqlens=None, cu_seqlens_k=None,
                 **params):
        # as `ssmc.compile` on the default backend: the tiled torch path where torch imports
        return compile_spec(self, None, layout=layout)(q, k, v, *args, return_lse=return_lse, cu_seqlens=cu_seqlens,
                                                       cu_seqlens_k=cu_seqlens_k, **params)


def attention(score_mod: Callable | None = None, mask_mod: Callable | None = None, *, batch: str = "b h",
              head_dim: str = "d", value_dim: str | None = None, scale: float | None = None,
              name: str | None = None, kv_heads: str | None = None) -> AttentionSpec:
    """Softmax attention over keys, with an optional score modifier and mask (module docstring)."""
    from ..errors import user_loc

    loc = user_loc(2)
    try:
        batch_axes, static = parse_axes(batch)
        (hd,), _ = parse_axes(head_dim)
        (vd,), _ = parse_axes(value_dim or head_dim)
    except ValueError as err:
        raise SpecError(f"attention axes: {err}", loc) from None
    if hd in batch_axes or vd in batch_axes:
        raise SpecError("attention: head_dim / value_dim must differ from the batch axes", loc)
    if kv_heads is not None and kv_heads not in batch_axes:
        raise SpecError(f"attention: kv_heads {kv_heads!r} is not one of the batch axes {format_axes(batch_axes)}",
                        loc)
    score_leaf = Tensor(Node.make(Op.INPUT, (), "score", batch_axes, loc=loc))
    q_idx = Tensor(Node.make(Op.INPUT, (), "q_idx", (), loc=loc))
    kv_idx = Tensor(Node.make(Op.INPUT, (), "kv_idx", (), loc=loc))
    decls: dict[str, Decl] = {}
    sizes = dict(static)
    traced = {}
    locs: dict[Node, Loc] = {}
    for kind, fn, leading in (("score_mod", score_mod, [score_leaf, q_idx, kv_idx]),
                              ("mask_mod", mask_mod, [q_idx, kv_idx])):
        if fn is None:
            traced[kind] = None
            continue
        node, mod_decls, mod_sizes = _trace_mod(fn, kind, leading, batch_axes, locs)
        for d in mod_decls:
            if d.name in ("score", "q_idx", "kv_idx", "q", "k", "v"):
                raise SpecError(f"{kind}: parameter name {d.name!r} is reserved", d.loc)
            if d.name in decls and (decls[d.name].axes, decls[d.name].role) != (d.axes, d.role):
                raise SpecError(f"{d.role.value} {d.name!r} has axes {format_axes(d.axes)} here but "
                                f"{decls[d.name].role.value} {format_axes(decls[d.name].axes)} in the other "
                                "modifier", d.loc)
            decls.setdefault(d.name, d)
        for a, n in mod_sizes.items():
            if sizes.setdefault(a, n) != n:
                raise SpecError(f"axis {a!r} has static size {n} here but {sizes[a]} elsewhere", loc)
        traced[kind] = node
    all_decls = {d.name: d for d in decls.values()}
    all_decls.update({
        "score": Decl("score", Role.INDEX, batch_axes),
        "q_idx": Decl("q_idx", Role.INDEX, ()),
        "kv_idx": Decl("kv_idx", Role.INDEX, ()),
    })
    roots = [n for n in traced.values() if n is not None]
    verify_nodes(roots, all_decls, set(sizes), None, locs)
    if scale is not None and (isinstance(scale, (bool, str)) or not isinstance(scale, (int, float, np.number))):
        raise SpecError(f"attention scale must be a number, got {scale!r}", loc)
    if scale is not None and not np.isfinite(scale):
        raise SpecError(f"attention scale must be a finite number, got {scale}", loc)
    program = Attention(name=name or (getattr(score_mod, "__name__", None) or "attention"),
                        batch_axes=batch_axes, head_dim=hd, value_dim=vd,
                        params=tuple(d for d in decls.values() if d.role is Role.PARAM),
                        seqs=tuple(d for d in decls.values() if d.role is Role.SEQ),
                        score=traced["score_mod"], mask=traced["mask_mod"], scale=scale,
                        sizes=tuple(sorted(sizes.items())), loc=loc, kv_heads=kv_heads)
    return AttentionSpec(program)

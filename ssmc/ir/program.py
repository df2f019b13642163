"""Programs: a recurrence (a step graph scanned over time) and softmax attention.

A `Recurrence` means, as a plain loop (time runs backward when `reverse`):

    carry = initial states (zeros unless given)
    for t in range(L):                       # or reversed(range(L))
        env = carry | {x: x[t] for x in seqs} | params
        new = [evaluate(u, env) for u in updates]        # one per state
        ys[t] = [evaluate(y, env) for _, y in outputs]   # may use old and new carry alike
        carry = new
    return ys, carry                         # per-step outputs, final states
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from ..errors import Loc
from .node import Node, toposort
from .ops import Op


class Role(Enum):
    STATE = "state"
    SEQ = "seq"
    PARAM = "param"
    INDEX = "index"  # attention's query / key positions


@dataclass(frozen=True)
class Decl:
    """A declared input of a program: its name, role and axes."""

    name: str
    role: Role
    axes: tuple[str, ...]
    loc: Loc | None = field(default=None, compare=False)


@dataclass(frozen=True)
class Recurrence:
    name: str
    decls: tuple[Decl, ...]                     # signature order
    updates: tuple[Node, ...]                   # new carry, one per state (state order)
    outputs: tuple[tuple[str, Node], ...]       # per-step outputs
    sizes: tuple[tuple[str, int], ...] = ()     # static axis sizes ("g=4")
    reverse: bool = False                       # time runs from L-1 down to 0
    loc: Loc | None = field(default=None, compare=False)
    doc: str = field(default="", compare=False)

    @property
    def states(self) -> tuple[Decl, ...]:
        return tuple(d for d in self.decls if d.role is Role.STATE)

    @property
    def seqs(self) -> tuple[Decl, ...]:
        return tuple(d for d in self.decls if d.role is Role.SEQ)

    @property
    def params(self) -> tuple[Decl, ...]:
        return tuple(d for d in self.decls if d.role is Role.PARAM)

    @property
    def inputs(self) -> tuple[Decl, ...]:
        """What the caller passes: sequences and params, in signature order."""
        return tuple(d for d in self.decls if d.role is not Role.STATE)

    def decl(self, name: str) -> Decl:
        for d in self.decls:
            if d.name == name:
                return d
        raise KeyError(name)

    @property
    def roots(self) -> tuple[Node, ...]:
        return self.updates + tuple(y for _, y in self.outputs)

    def nodes(self) -> list[Node]:
        return toposort(self.roots)

    @property
    def static_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    def with_roots(self, updates, outputs, new_seqs=(), states=None, name: str | None = None) -> Recurrence:
        """This program with other roots: its inputs trimmed to those the roots read, sequences
        `new_seqs` ((name, axes) pairs) added, the states named in `states` kept (default: all;
        `updates` gives one per kept state, in order)."""
        used = {n.arg for n in toposort(tuple(updates) + tuple(y for _, y in outputs)) if n.op is Op.INPUT}
        keep = {d.name for d in self.states} if states is None else set(states)
        decls = [d for d in self.decls if (d.name in keep if d.role is Role.STATE else d.name in used)]
        decls += [Decl(n, Role.SEQ, axes) for n, axes in new_seqs]
        return Recurrence(name=name or self.name, decls=tuple(decls), updates=tuple(updates),
                          outputs=tuple(outputs), sizes=self.sizes, reverse=self.reverse, loc=self.loc,
                          doc=self.doc)


@dataclass(frozen=True)
class Attention:
    """Softmax attention with a score modifier and a mask, as a plain loop:

        for each batch index ..., query position i < Lq:
            s[j] = score_mod(scale * sum_d q[i, d] k[j, d], i, j, params)   for j < Lk
            s[j] = -inf where not mask_mod(i, j, params)
            p = softmax(s);   out[i, e] = sum_j p[j] v[j, e]

    `score` is the INPUT leaf named "score" with the batch axes; `q_idx` / `kv_idx` are INDEX
    leaves; captured params are PARAM decls. A modifier may index a param (a table) at an integer
    expression of i and j, ``table[clamp(i - j, 0, R - 1)]`` (a GATHER node, the index clamped into the
    table), and read per-position inputs, SEQ decls (`seqs`: one value per position along time, with
    some of the batch axes, e.g. document ids [b, t]) at the query's or key's position, ``doc[i]``,
    ``doc[j]``: their INPUT leaves have axes (t, *decl.axes) and are read only through a GATHER along t
    at q_idx or kv_idx. Sequences have q's length (self-attention) and get no gradient.
    """

    name: str
    batch_axes: tuple[str, ...]
    head_dim: str
    value_dim: str
    params: tuple[Decl, ...]
    score: Node | None                # the modified score (None: unmodified)
    mask: Node | None                 # bool, True where the key is visible (None: all visible)
    scale: float | None = None        # None: 1/sqrt(size of head_dim)
    sizes: tuple[tuple[str, int], ...] = ()
    loc: Loc | None = field(default=None, compare=False)
    kv_heads: str | None = None       # the batch axis k and v may be smaller along (GQA)
    seqs: tuple[Decl, ...] = ()       # per-position inputs read at q_idx / kv_idx (document ids)

    @property
    def inputs(self) -> tuple[Decl, ...]:
        """What a call passes besides q, k, v: the params, then the sequences."""
        return self.params + self.seqs

    @property
    def static_sizes(self) -> dict[str, int]:
        return dict(self.sizes)

    @property
    def q_axes(self) -> tuple[str, ...]:
        return (*self.batch_axes, self.head_dim)

    @property
    def v_axes(self) -> tuple[str, ...]:
        return (*self.batch_axes, self.value_dim)

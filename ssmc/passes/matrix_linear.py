"""Matrix-linear recurrences read off the IR, and the stage cut that gives them a chunked core.

A program is taken when it has one state ``S[H, κ, ν]`` (H: head axes, the batch among them) and,
as a plain loop over t:

    S_t = a_t ⊙ S_{t-1} + β_t k_t ⊗ v_t      a: axes ⊆ H ∪ {κ} (a scalar per head, or per key), β: axes ⊆ H
    o_t = Σ_κ S_t ⊙ q_t                        the outputs' one read of the state
    y_t = post(o_t, inputs_t)                  state-free

with ``k`` over H ∪ {κ}, ``v`` over H ∪ {ν} (the injection's factors along ν), ``β`` the injection's
factors with neither κ nor ν (SSD's softplus(dt), a sign), ``q`` over H ∪ {κ}; an operand may lack
head axes (broadcast: SSD's B and C lack the heads of a group).
The decay is kept as its log ``ℓ`` where the spec writes ``exp(ℓ)`` (Mamba-2, GLA-style gates) or a
positive constant; any other decay (RetNet's ``gamma``) is kept as ``a`` and must be positive at
run time (the chunked form takes its log). A decay may vary along the key axis κ (GLA's per-key gate:
``S[κ, ν] = exp(ℓ_t[κ]) S[κ, ν] + k_t[κ] v_t[ν]``, `MatrixLinear.per_key`), not along ν (refused).

`chunk_stages` cuts such a program into a state-free ``pre`` program (the operands), the core

    S = exp(ell) * S + k * v * beta   (or  a * S + ...,  or  S + ...;  beta where there is one)
    o = dot(S, q, over=κ)

and a state-free ``post`` program, so that a backend can run the core as chunks of matrix
products (backends/cuda/kernels/chunk/) and the rest on its ordinary kernels; `StagedGrad`
chains their gradients. ``beta`` is kept apart from ``v`` where ``v`` is then an input as given (SSD:
v = x, beta = softplus(dt), a [b t g r] array that pre writes as it writes ell), so that the core
reads x itself and no pre pass writes a copy of it scaled; otherwise beta is folded into v. Where v
is so read and post is ``o + s ⊙ v`` (s over heads only: SSD's D x), post joins the core as its
output (`MatrixLinear.skip`): the chunk kernels add it as they write o, and no post stage remains.
`core_form` recognises a core (every operand a sequence as it is).

A rank-R injection, a sum of outer products (``S_t = a_t ⊙ S_{t-1} + Σ_i k_i ⊗ v_i``, a term either a
product or a sum over a rank axis r that neither S nor q has, ``ssmc.dot(k, v, over="r")``), is taken as
`MatrixLinear.terms`: (k_i, v_i with β and signs folded in, r_i or None) each; its core is

    S = exp(ell) * S + Σ_i Σ_{r_i} k_i * v_i          o = dot(S, q, over=κ)

(no β apart, no skip), which `chunk.RankCore` runs as R sub-steps of a rank-1 core a step.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache

from ..ir import build
from ..ir.node import Node, input_names, substitute, toposort
from ..ir.ops import Op
from ..ir.program import Decl, Recurrence, Role
from ..lowering.stages import Fused, Stage, fuse
from .classify import classify


@dataclass(frozen=True)
class MatrixLinear:
    """A matrix-linear program's parts (module docstring); nodes are the program's own."""

    state: Decl
    key: str                        # κ, contracted by the output
    value: str                      # ν
    heads: tuple[str, ...]          # the state's other axes, in its order
    q: Node
    k: Node
    v: Node                         # the injection's factors along ν
    beta: Node | None               # its factors with neither κ nor ν (negation included), None where 1
    log_decay: Node | None          # ℓ where the decay is exp(ℓ) or a positive constant (axes ⊆ H ∪ {κ})
    decay: Node | None              # a otherwise (None with ℓ None: no decay; axes ⊆ H ∪ {κ})
    contraction: Node               # the SUM over κ the outputs read
    outputs: tuple[tuple[str, Node], ...]   # the outputs over INPUT(`o`) in place of `contraction`
    o: str                          # that input's name
    # a rank-R injection's terms (k_i, v_i, rank axis r_i or None), β and signs folded into v_i; () for a
    # rank-1 injection k ⊗ v (k, v, beta above). Rank-R: k, v the first term's (describe only), beta None
    terms: tuple[tuple[Node, Node, str | None], ...] = ()

    @property
    def per_key(self) -> bool:
        """Whether the decay varies along the key axis κ (GLA): ℓ (or a) then has κ besides head axes."""
        node = self.log_decay if self.log_decay is not None else self.decay
        return node is not None and self.key in node.axes

    @property
    def skip(self) -> Node | None:
        """s where the one output is ``o + s ⊙ v`` (s over heads only: SSD's ``D``), else None."""
        if self.terms:  # (a rank-R core reads no v as given)
            return None
        if len(self.outputs) != 1 or self.outputs[0][1].op is not Op.ADD:
            return None
        for first, other in (self.outputs[0][1].args, self.outputs[0][1].args[::-1]):
            if first.op is Op.INPUT and first.arg == self.o:
                factors, neg = _factors(other)
                if factors.count(self.v) == 1:
                    rest = [f for f in factors if f != self.v]
                    if all(set(f.axes) <= set(self.heads) for f in rest):
                        return _product(rest, neg)
        return None

    def describe(self) -> str:
        decay = ("none" if self.log_decay is None and self.decay is None else
                 f"exp(ℓ), ℓ [{' '.join(self.log_decay.axes)}]" if self.log_decay is not None else
                 f"a [{' '.join(self.decay.axes)}], positive at run time")
        if self.per_key:
            decay += f", per key {self.key}"
        beta = "" if self.beta is None else f", β [{' '.join(self.beta.axes)}]"
        if self.terms:
            beta = f", injection of rank {self.rank_text} (run as that many sub-steps a step)"
        return (f"matrix linear {self.state.name} [{' '.join(self.state.axes)}]: key axis {self.key}, value axis"
                f" {self.value}, heads [{' '.join(self.heads)}], decay {decay}{beta}")

    @property
    def rank_text(self) -> str:
        """The injection's rank as a sum of the rank axes' names and single terms ("r", "2", "r + 1")."""
        axes = [r for _, _, r in self.terms if r is not None]
        single = sum(r is None for _, _, r in self.terms) or (0 if self.terms else 1)
        return " + ".join([*axes, *([str(single)] if single else [])])

    def rank(self, sizes) -> int:
        """The injection's rank R at `sizes` (1 for k ⊗ v)."""
        return sum(sizes[r] if r is not None else 1 for _, _, r in self.terms) if self.terms else 1

    @property
    def injected(self) -> Node:
        """v with β folded in (β v): the injection's factors other than k."""
        return self.v if self.beta is None else build.mul(self.beta, self.v)


def _factors(node: Node) -> tuple[list[Node], int]:
    """`node` as a product: (its factors, the number of negations taken out)."""
    if node.op is Op.MUL:
        fa, na = _factors(node.args[0])
        fb, nb = _factors(node.args[1])
        return fa + fb, na + nb
    if node.op is Op.NEG:
        f, n = _factors(node.args[0])
        return f, n + 1
    if node.op is Op.EXPAND:
        return _factors(node.args[0])
    return [node], 0


def _product(factors: list[Node], negations: int = 0) -> Node:
    out = build.ONE
    for f in factors:
        out = build.mul(out, f)
    return build.neg(out) if negations % 2 else out


def matrix_linear(program: Recurrence) -> MatrixLinear | str:
    """The program's parts, or why it is not taken (one line)."""
    if program.reverse:
        return "time runs backward"
    if len(program.states) != 1:
        return f"{len(program.states)} states: the chunked form takes one matrix-linear state"
    (cls,) = classify(program).states
    got = _analyse(program, cls, False) if cls.family == "matrix linear" else f"the state is {cls.family}"
    # a rank-R injection (`_rank_terms`), which classify calls diagonal linear (it looks for one outer
    # product), tried only where the rank-1 reading fails: a spec it takes is read as before
    if (isinstance(got, str) and cls.family in ("diagonal linear", "matrix linear")
            and _rank_terms(cls.b, program.states[0]) is not None):
        ranked = _analyse(program, cls, True)
        if not isinstance(ranked, str):
            return ranked
        if cls.family != "matrix linear":
            return f"{got}; as a rank-R injection: {ranked}"
    return got


def _analyse(program: Recurrence, cls, rank_r: bool) -> MatrixLinear | str:
    """`matrix_linear` past the classification: the injection read as k ⊗ v, or (`rank_r`) as a sum."""
    state, update = program.states[0], program.updates[0]
    a, b = cls.a, cls.b

    # the outputs' reads of the state: one contraction SUM_κ(update * q)
    nodes = toposort([y for _, y in program.outputs])
    carried = _factors(update)[0][0] if update.op is Op.EXPAND else update  # as the outputs' products see it
    contractions = []
    for n in nodes:
        if n.op is Op.SUM and n.args[0].op is Op.MUL:
            factors, neg = _factors(n.args[0])
            if factors.count(carried) == 1:
                contractions.append((n, [f for f in factors if f is not carried], neg))
    if not contractions:
        return "no output contracts the state with a query"
    if len({c[0] for c in contractions}) > 1:
        return "two contractions of the state (two queries)"
    contraction, q_factors, q_neg = contractions[0]
    key = contraction.arg
    o = _fresh("o", {d.name for d in program.decls} | {n for n, _ in program.outputs})
    o_leaf = Node.make(Op.INPUT, (), o, contraction.axes)
    outputs = tuple(zip([n for n, _ in program.outputs],
                        substitute(tuple(y for _, y in program.outputs), {contraction: o_leaf})))
    if state.name in input_names(y for _, y in outputs) or update in toposort(y for _, y in outputs):
        return "an output reads the state other than by one contraction"

    if rank_r:
        return _rank_r(program, state, a, b, key, contraction, q_factors, q_neg, outputs, o)
    # the injection: k (with κ) times v (the rest)
    if b.op is Op.ADD:
        return "the injection is a sum of terms (rank-R injections are not taken yet)"
    b_factors, b_neg = _factors(b)
    k_factors = [f for f in b_factors if key in f.axes]
    v_factors = [f for f in b_factors if key not in f.axes]
    if not k_factors:
        return f"the injection has no factor along the contracted axis {key}"
    k_axes = {x for f in k_factors for x in f.axes}
    v_axes = {x for f in v_factors for x in f.axes}
    # (an axis of v's along which the decay varies is a head: SSD's r)
    candidates = [x for x in state.axes if x in v_axes and x not in k_axes and x != key]
    values = [x for x in candidates if x not in a.axes]
    if not values and len(candidates) == 1:
        return (f"the decay varies along the value axis {candidates[0]} (a per-value decay; a decay along the key"
                f" axis {key} is taken)")
    if len(values) != 1:
        return ("the injection is no outer product k ⊗ v" if not values
                else f"{len(values)} value axes ({' '.join(values)})")
    value = values[0]
    heads = tuple(x for x in state.axes if x not in (key, value))
    for what, factors, allowed in (("k", k_factors, {*heads, key}), ("v", v_factors, {*heads, value}),
                                   ("q", q_factors, {*heads, key})):
        extra = {x for f in factors for x in f.axes} - allowed
        if extra:
            return f"{what} has axes {' '.join(sorted(extra))} besides the heads and its own"

    log_decay = decay = None
    if build.is_const(a, 1.0):
        pass
    elif a.op is Op.EXP:
        log_decay = a.args[0]
    elif build.is_const(a) and a.arg > 0:
        log_decay = build.const(math.log(a.arg))
    elif build.is_const(a):
        return f"the decay is the constant {a.arg}: no log form"
    else:
        decay = a
    along = [f for f in v_factors if value in f.axes]
    scalars = [f for f in v_factors if value not in f.axes]
    beta = _product(scalars, b_neg) if scalars or b_neg % 2 else None
    if beta is not None and build.is_const(beta, 1.0):
        beta = None
    return MatrixLinear(state, key, value, heads, _product(q_factors, q_neg), _product(k_factors),
                        _product(along), beta, log_decay, decay, contraction, outputs, o)


def _decay_forms(a: Node) -> tuple[Node | None, Node | None] | str:
    """(ℓ, a) of a decay as `MatrixLinear` keeps them, or why it has no log form."""
    if build.is_const(a, 1.0):
        return None, None
    if a.op is Op.EXP:
        return a.args[0], None
    if build.is_const(a) and a.arg > 0:
        return build.const(math.log(a.arg)), None
    if build.is_const(a):
        return f"the decay is the constant {a.arg}: no log form"
    return None, a


def _summands(node: Node, neg: int = 0) -> list[tuple[Node, int]]:
    """`node` as a sum: (its terms, each with the number of negations taken out)."""
    if node.op is Op.ADD:
        return _summands(node.args[0], neg) + _summands(node.args[1], neg)
    if node.op is Op.SUB:
        return _summands(node.args[0], neg) + _summands(node.args[1], neg + 1)
    if node.op is Op.NEG:
        return _summands(node.args[0], neg + 1)
    if node.op is Op.EXPAND:
        return _summands(node.args[0], neg)
    return [(node, neg)]


def _rank_terms(b: Node, state: Decl) -> list[tuple[list[Node], int, str | None, tuple]] | None:
    """The injection `b` as a rank-R sum (factors, negations, rank axis r or None, (the factors with the sum
    over r kept whole, their negations), per term), where it is one: two terms or more, or a term summed over
    an axis r the state lacks (a dot over r); else None."""
    terms = []
    for node, neg in _summands(b):
        factors, n = _factors(node)
        whole = (factors, neg + n)
        sums = [f for f in factors if f.op is Op.SUM and f.arg not in state.axes]
        if len(sums) > 1:
            return None
        rank = None
        if sums:  # Σ_r k ⊗ v, perhaps scaled: its factors and the outer ones
            inner, m = _factors(sums[0].args[0])
            factors = [f for f in factors if f is not sums[0]] + inner
            n, rank = n + m, sums[0].arg
        terms.append((factors, neg + n, rank, whole))
    if len(terms) < 2 and not (terms and terms[0][2] is not None):
        return None
    return terms


def _rank_r(program: Recurrence, state: Decl, a: Node, b: Node, key: str, contraction: Node, q_factors,
            q_neg: int, outputs, o: str) -> MatrixLinear | str:
    """`matrix_linear` of a rank-R injection (`_rank_terms`): each term k_i (its factors along κ) ⊗ v_i (the
    others, β and signs included), summed over r_i where it has one."""
    split = []
    for factors, neg, r, whole in _rank_terms(b, state):
        ks = [f for f in factors if key in f.axes]
        vs = [f for f in factors if key not in f.axes]
        if r is not None and not (any(r in f.axes for f in ks) and any(r in f.axes for f in vs)):
            # a sum over r inside k's or v's factors alone (a projection, ``B * dot(W, x, over="j")``) is no
            # rank axis (R = |r| sub-steps a step, each operand |r| times its size): the sum one factor, rank 1
            ks = [f for f in whole[0] if key in f.axes]
            vs = [f for f in whole[0] if key not in f.axes]
            neg, r = whole[1], None
        split.append((ks, vs, neg, r))
    if len(split) < 2 and split[0][3] is None:
        return "the injection is one outer product (not read as one: see the rank-1 reason)"
    if any(not ks for ks, _, _, _ in split):
        return f"a term of the injection has no factor along the contracted axis {key}"
    k_axes = {x for ks, _, _, _ in split for f in ks for x in f.axes}
    v_axes = {x for _, vs, _, _ in split for f in vs for x in f.axes}
    candidates = [x for x in state.axes if x in v_axes and x not in k_axes and x != key]
    values = [x for x in candidates if x not in a.axes]
    if not values and len(candidates) == 1:
        return f"the decay varies along the value axis {candidates[0]} (a per-value decay)"
    if len(values) != 1:
        return ("the injection is no sum of outer products k ⊗ v" if not values
                else f"{len(values)} value axes ({' '.join(values)})")
    value = values[0]
    heads = tuple(x for x in state.axes if x not in (key, value))
    extra = {x for f in q_factors for x in f.axes} - {*heads, key}
    if extra:
        return f"q has axes {' '.join(sorted(extra))} besides the heads and its own"
    terms = []
    for ks, vs, neg, r in split:
        rank = {r} if r is not None else set()
        for what, fs, allowed, own in (("k", ks, {*heads, key, *rank}, key), ("v", vs, {*heads, value, *rank}, value)):
            axes = {x for f in fs for x in f.axes}
            if axes - allowed:
                return f"{what} of a term has axes {' '.join(sorted(axes - allowed))} besides the heads, its own and r"
            if own not in axes:
                return f"a term of the injection has no {what} along {own}: no outer product"
        terms.append((_product(ks), _product(vs, neg), r))
    forms = _decay_forms(a)
    if isinstance(forms, str):
        return forms
    log_decay, decay = forms
    return MatrixLinear(state, key, value, heads, _product(q_factors, q_neg), terms[0][0], terms[0][1], None,
                        log_decay, decay, contraction, outputs, o, tuple(terms))


def _fresh(stem: str, taken: set[str]) -> str:
    name, i = stem, 0
    while name in taken:
        i += 1
        name = f"{stem}{i}"
    return name


def _is_input(program: Recurrence, node: Node, roles=(Role.SEQ,)) -> bool:
    """Is `node` an input of one of `roles` as declared (the core reads it as given)?"""
    return node.op is Op.INPUT and any(d.name == node.arg and d.role in roles and d.axes == node.axes
                                       for d in program.decls)


_SEQ_OR_PARAM = (Role.SEQ, Role.PARAM)


def core_form(program: Recurrence) -> MatrixLinear | None:
    """The parts of a chunked core (q, k, v sequences as given, the decay, β and the skip s a sequence, a
    param, a constant or none, the one output the contraction itself or ``o + s ⊙ v``), else None."""
    ml = matrix_linear(program)
    if isinstance(ml, str) or len(ml.outputs) != 1:
        return None
    skip = ml.skip
    if skip is not None:
        if not (_is_input(program, skip, _SEQ_OR_PARAM) or build.is_const(skip)):
            return None
    elif ml.outputs[0][1].op is not Op.INPUT or ml.outputs[0][1].arg != ml.o:
        return None
    if not all(_is_input(program, x) for x in (ml.q, ml.k, ml.v, *(x for t in ml.terms for x in t[:2]))):
        return None
    if ml.decay is not None and not _is_input(program, ml.decay, _SEQ_OR_PARAM):
        return None
    if ml.beta is not None and not (_is_input(program, ml.beta, _SEQ_OR_PARAM) or build.is_const(ml.beta)):
        return None
    if ml.log_decay is not None and not (_is_input(program, ml.log_decay, _SEQ_OR_PARAM)
                                         or build.is_const(ml.log_decay)):
        return None
    return ml


@lru_cache(maxsize=256)
def chunk_stages(program: Recurrence) -> Fused | None:
    """`program` as pre / core / post stages around a chunked core (module docstring), or None where
    it is not matrix linear, is a core already, or the fusion stage cuts it otherwise."""
    if fuse(program).staged:
        return None
    ml = matrix_linear(program)
    if isinstance(ml, str) or core_form(program) is not None:
        return None
    taken = {d.name for d in program.decls} | {n for n, _ in program.outputs} | {ml.o}
    prep: list[tuple[str, Node]] = []

    def operand(stem: str, node: Node, roles=(Role.SEQ,)) -> Node:
        """`node` as an input of the core: itself where it is one of `roles` (or a constant), else
        a sequence that pre writes."""
        if _is_input(program, node, roles) or build.is_const(node):
            return node
        name = _fresh(f"{program.name}_{stem}", taken)
        taken.add(name)
        prep.append((name, node))
        return Node.make(Op.INPUT, (), name, node.axes)

    if ml.terms:  # rank R: each term's k and v (β folded in) as inputs, v never read apart from β
        q = operand("q", ml.q)
        terms = [(operand("k", tk), operand("v", tv), r) for tk, tv, r in ml.terms]
        (k, v, _), beta = terms[0], None
    else:
        q, k = operand("q", ml.q), operand("k", ml.k)
        if ml.beta is not None and _is_input(program, ml.v):  # v read as given, β apart (pre writes β, not v)
            v, beta = ml.v, operand("beta", ml.beta, _SEQ_OR_PARAM)
        else:
            v, beta = operand("v", ml.injected), None
    leaf = Node.make(Op.INPUT, (), ml.state.name, ml.state.axes)
    if ml.log_decay is not None:
        carried = build.mul(build.unary(Op.EXP, operand("ell", ml.log_decay, _SEQ_OR_PARAM)), leaf)
    elif ml.decay is not None:
        carried = build.mul(operand("a", ml.decay, _SEQ_OR_PARAM), leaf)
    else:
        carried = leaf
    if ml.terms:
        injection = None
        for tk, tv, r in terms:
            term = build.mul(tk, tv)
            injection = build.add(injection, term if r is None else build.reduce_sum(term, r))
        update = build.add(carried, injection)
    else:
        update = build.add(carried, build.mul(build.mul(k, v), beta) if beta is not None else build.mul(k, v))
    o = build.reduce_sum(build.mul(update, q), ml.key)
    # the core's o has its update's axis order, which a decay lacking the batch axis (RetNet's gamma [h] * S)
    # permutes; a core_form reads no transposed output, so a post stage transposes it to the contraction's
    permuted = o.axes != ml.contraction.axes
    outputs = ml.outputs
    if permuted:
        transposed = build.expand(Node.make(Op.INPUT, (), ml.o, o.axes), ml.contraction.axes)
        outputs = tuple(zip([n for n, _ in outputs], substitute(
            tuple(y for _, y in outputs), {Node.make(Op.INPUT, (), ml.o, ml.contraction.axes): transposed})))
    identity = (not permuted and len(ml.outputs) == 1 and ml.outputs[0][1].op is Op.INPUT
                and ml.outputs[0][1].arg == ml.o)
    o_name = ml.outputs[0][0] if identity else ml.o
    skip = ml.skip if v is ml.v and not permuted else None
    if skip is not None and (_is_input(program, skip, _SEQ_OR_PARAM) or build.is_const(skip)):
        # post is o + s ⊙ v with v read as given (SSD's D x): the core's kernels add it as they write o
        o = substitute((ml.outputs[0][1],), {Node.make(Op.INPUT, (), ml.o, ml.contraction.axes): o})[0]
        identity, o_name = True, ml.outputs[0][0]
    pre_seqs = [(n, x.axes) for n, x in prep]
    core = Recurrence(name=f"{program.name}_core",
                      decls=(ml.state, *(d for d in program.inputs if d.name in input_names([update, o])),
                             *(Decl(n, Role.SEQ, axes) for n, axes in pre_seqs if n in input_names([update, o]))),
                      updates=(update,), outputs=((o_name, o),), sizes=program.sizes, loc=program.loc,
                      doc=program.doc)
    if core_form(core) is None:  # the rebuilt core must read back as one (else: not taken)
        return None
    stages = []
    if prep:
        pre = program.with_roots((), prep, states=(), name=f"{program.name}_pre")
        if not pre.seqs:  # operands of params alone (a decay sigmoid(w)): a sequence it declares gives the steps
            pre = dataclasses.replace(pre, decls=(*pre.decls, program.seqs[0]))
        stages.append(Stage("pre", pre, tuple(n for n, _ in prep)))
    stages.append(Stage("core", core, () if identity else (ml.o,)))
    if not identity:
        post = program.with_roots((), outputs, [(ml.o, o.axes)], states=(), name=f"{program.name}_post")
        stages.append(Stage("post", post))
    return Fused(program, tuple(stages))

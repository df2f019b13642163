"""Rank-R cores (`MatrixLinear.terms`) as R sub-steps a step of a rank-1 chunked core.

A core ``S_t = a_t ⊙ S_{t-1} + Σ_i Σ_{r_i} k_i ⊗ v_i; o_t = Σ_κ S_t q_t`` (R = Σ_i |r_i|, 1 for a term
without a rank axis) is, as a plain loop, the rank-1 recurrence over L·R sub-steps

    for t in range(L):
        for j in range(R):                  # the terms' rank slices, in term order
            S = (a_t if j == 0 else 1) ⊙ S + k[t, j] ⊗ v[t, j]
            o[t, j] = Σ_κ S (q_t if j == R - 1 else 0)
        y_t = o[t, R - 1]

so `RankCore` lays the operands out over the sub-steps (time-first [L, R, ..] arrays viewed as [L·R, ..]: k, v
interleaved, the log decay 0 (the decay 1) and q 0 past the first / before the last sub-step), runs a
`ChunkedCore` of that rank-1 program on them (its kernels or its torch path, as for any core) and reads
the output at every R-th sub-step. Its VJP is the inner core's on the long sequence, the gradients taken
back by the same layouts (the output's cotangent zero at the other sub-steps; q's and the decay's read at
their sub-step; k's and v's split per term and summed over the heads an input lacks).
"""

from __future__ import annotations

import torch

from .....ir import build
from .....ir.node import Node
from .....ir.ops import Op
from .....ir.program import Decl, Recurrence, Role
from .....passes.autodiff import GRAD
from .....passes.matrix_linear import core_form
from .algorithm import or_scan

_T = "~t"  # time's name in the layouts below


def _lay(arr: torch.Tensor, names: list[str], target: list[str], sizes: dict) -> torch.Tensor:
    """`arr` (axes `names`) as axes `target` (a view: the names it lacks broadcast to `sizes`)."""
    y = arr.permute(*[names.index(n) for n in target if n in names])
    y = y.reshape([arr.shape[names.index(n)] if n in names else 1 for n in target])
    return y.expand([arr.shape[names.index(n)] if n in names else sizes[n] for n in target])


def _unlay(g: torch.Tensor, target: list[str], names: list[str]) -> torch.Tensor:
    """The inverse of `_lay` for a gradient: `g` (axes `target`) summed over the names `names` lacks, as `names`."""
    lacks = [i for i, n in enumerate(target) if n not in names]
    if lacks:
        g = g.sum(lacks)
    kept = [n for n in target if n in names]
    return g.permute(*[kept.index(n) for n in names])


class RankTape:
    """A rank-R forward's tape: the inner core's and the long arrays it ran on."""

    def __init__(self, inner, seqs):
        self.inner, self.seqs = inner, seqs


class RankCore:
    """Runs one rank-R core program (`core_form` with `terms`) as a `ChunkedCore` over R sub-steps a step
    (module docstring); the runner and fused-backward contracts of `ChunkedCore`. `core`: the rank-1 runner's
    class (`ChunkedCore`, given by the package, which imports this module)."""

    def __init__(self, program: Recurrence, compute: str, core):
        self.program = program
        self.ml = ml = core_form(program)
        assert ml is not None and ml.terms, f"{program.name} is no rank-R matrix-linear core"
        self.compute = compute
        self.output, self.out_node = program.outputs[0]
        self.seq_names = frozenset(d.name for d in program.seqs)
        taken = {d.name for d in program.decls} | {self.output}

        def fresh(stem):
            name, i = stem, 0
            while name in taken:
                i += 1
                name = f"{stem}{i}"
            taken.add(name)
            return name

        # the inner rank-1 core: q as given, k [*H, κ], v [*H, ν] and the decay (ℓ or a, a sequence) its own
        self.k_name, self.v_name = fresh("k_sub"), fresh("v_sub")
        state = ml.state
        leaf = Node.make(Op.INPUT, (), state.name, state.axes)
        k = Node.make(Op.INPUT, (), self.k_name, (*ml.heads, ml.key))
        v = Node.make(Op.INPUT, (), self.v_name, (*ml.heads, ml.value))
        decls = [state, Decl(ml.q.arg, Role.SEQ, ml.q.axes), Decl(self.k_name, Role.SEQ, k.axes),
                 Decl(self.v_name, Role.SEQ, v.axes)]
        self.decay_node = ml.log_decay if ml.log_decay is not None else ml.decay
        self.decay_name = None
        carried = leaf
        if self.decay_node is not None:
            self.decay_name = fresh("ell_sub" if ml.log_decay is not None else "a_sub")
            d = Node.make(Op.INPUT, (), self.decay_name, self.decay_node.axes)
            decls.append(Decl(self.decay_name, Role.SEQ, d.axes))
            carried = build.mul(build.unary(Op.EXP, d) if ml.log_decay is not None else d, leaf)
        update = build.add(carried, build.mul(k, v))
        o = build.reduce_sum(build.mul(update, ml.q), ml.key)
        inner = Recurrence(name=f"{program.name}_sub", decls=tuple(decls), updates=(update,),
                           outputs=((self.output, o),), sizes=program.sizes, loc=program.loc, doc=program.doc)
        self.inner = core(inner, compute)
        self.inner_out_axes = list(o.axes)

    # -- the layouts -------------------------------------------------------------------------------
    def kernels_wanted(self, dtype: torch.dtype, sizes) -> bool:
        return self.inner.kernels_wanted(dtype, sizes)

    def _array(self, node, seqs, params):
        """(the array of an INPUT node, its axes' names: time first where it is a sequence)."""
        if node.arg in seqs:
            return seqs[node.arg], [_T, *node.axes]
        return params[node.arg], list(node.axes)

    def _terms(self, sizes) -> list[tuple[Node, Node, str | None, int]]:
        return [(k, v, r, sizes[r] if r is not None else 1) for k, v, r in self.ml.terms]

    def _long(self, seqs, params, sizes, length: int) -> dict:
        """The inner core's sequences over the L·R sub-steps (module docstring), time first."""
        ml = self.ml
        rank = ml.rank(sizes)
        at = {**sizes, _T: length}
        ks, vs = [], []
        for k, v, r, _ in self._terms(sizes):
            for node, own, out in ((k, ml.key, ks), (v, ml.value, vs)):
                arr, names = self._array(node, seqs, params)
                y = _lay(arr, names, [_T, *([r] if r is not None else []), *ml.heads, own], at)
                out.append(y if r is not None else y.unsqueeze(1))
        out = {}
        for name, parts in ((self.k_name, ks), (self.v_name, vs)):
            whole = torch.cat(parts, 1) if len(parts) > 1 else parts[0].contiguous()
            out[name] = whole.reshape(length * rank, *whole.shape[2:])
        q = seqs[ml.q.arg]
        q_long = q.new_zeros((length, rank, *q.shape[1:]))
        q_long[:, rank - 1] = q
        out[ml.q.arg] = q_long.reshape(length * rank, *q.shape[1:])
        node = self.decay_node
        if node is not None:
            if node.op is Op.CONST:
                given = torch.full((length,), node.arg, dtype=self.inner.dtype, device=q.device)
            else:
                arr, names = self._array(node, seqs, params)
                given = _lay(arr, names, [_T, *node.axes], at)
            fill = torch.zeros if self.ml.log_decay is not None else torch.ones  # no decay past the first sub-step
            long = fill((length, rank, *given.shape[1:]), dtype=given.dtype, device=given.device)
            long[:, 0] = given
            out[self.decay_name] = long.reshape(length * rank, *given.shape[1:])
        return out

    def _output(self, o_long: torch.Tensor, rank: int, length: int) -> torch.Tensor:
        """The output at every step's last sub-step, in the program's layout [L, *axes]."""
        o = o_long.reshape(length, rank, *o_long.shape[1:])[:, rank - 1]
        names = [_T, *self.inner_out_axes]
        return o.permute(*[names.index(n) for n in (_T, *self.out_node.axes)]).contiguous()

    # -- the runner contract -----------------------------------------------------------------------
    def run(self, seqs, params, initial, sizes, length, out_dtype=None):
        """Same contract as `interpreter.run_recurrence`; a decay given as is with values <= 0 runs as the
        element-wise scan instead."""
        from ...runner import output_dtype

        out_dtype = output_dtype(out_dtype, self.output)

        def attempt():
            return self.forward(seqs, params, initial, sizes, length, out_dtype=out_dtype, tape=False)
        return or_scan(self, attempt, seqs, params, initial, sizes, length, out_dtype)

    def prepare_run(self, seqs, params, initial, sizes, length, out_dtype=None):
        """`run` for calls of one signature (no plan kept: the long arrays are made each call)."""
        def call(seqs, params, initial):
            return self.run(seqs, params, initial, sizes, length, out_dtype)
        call.time_first = True
        return call

    # -- the fused-backward contract ----------------------------------------------------------------
    def applies(self, seqs, sizes, length) -> bool:
        return True

    def half_inputs(self, cast: dict, given: dict, sizes) -> dict:
        """`ChunkedCore.half_inputs`: q and the terms' k and v as given (time first) where q is 16-bit and the
        kernels take its sizes, so that the long copies are 16-bit and the inner core runs its kernels."""
        ml = self.ml
        q = given.get(ml.q.arg)
        if q is None or not self.kernels_wanted(q.dtype, sizes):
            return cast
        nodes = (ml.q, *(x for k, v, _ in ml.terms for x in (k, v)))
        keep = {n.arg for n in nodes if n.arg in given and given[n.arg].dtype == q.dtype}
        return {n: given[n] if n in keep else v for n, v in cast.items()}

    def operand_dtypes(self, seqs, sizes) -> dict:
        """None in 16 bits (the long arrays are copies anyway)."""
        return {}

    def forward(self, seqs, params, initial, sizes, length, outputs: bool = True, out_dtype=None, tape=True):
        """(outputs, final states, `RankTape`) as `ChunkedCore.forward`'s, over R sub-steps a step."""
        rank = self.ml.rank(sizes)
        long = self._long(seqs, params, sizes, length)
        outs, finals, inner_tape = self.inner.forward(long, {}, initial, sizes, length * rank, outputs,
                                                      out_dtype=out_dtype, tape=tape)
        outs = {self.output: self._output(outs[self.output], rank, length)}
        return outs, finals, RankTape(inner_tape, long) if tape else None

    def backward(self, seqs, params, tape: RankTape, cot: dict, lam: dict, extra, sizes, length, plans=None):
        """({GRAD + sequence: [L, *axes]}, {GRAD + param or state: gradient}) as `ChunkedCore.backward`'s: the
        inner core's VJP over the sub-steps, taken back to the inputs' layouts (module docstring)."""
        ml, rank = self.ml, self.ml.rank(sizes)
        cot_out = cot[GRAD + self.output]
        names = [_T, *self.out_node.axes]
        c = cot_out.permute(*[names.index(n) for n in (_T, *self.inner_out_axes)])
        c_long = c.new_zeros((length, rank, *c.shape[1:]))
        c_long[:, rank - 1] = c
        inner_cot = {GRAD + self.output: c_long.reshape(length * rank, *c.shape[1:])}
        g_seqs, g_rest = self.inner.backward(tape.seqs, {}, tape.inner, inner_cot, lam, extra, sizes, length * rank)
        grads: dict[str, torch.Tensor] = {}

        def add(node, g, target):
            arr, names = self._array(node, seqs, params)
            g = _unlay(g, target, names)
            g = g.to(arr.dtype if arr.dtype not in (torch.bfloat16, torch.float16) else self.inner.dtype)
            key = GRAD + node.arg
            grads[key] = grads[key] + g if key in grads else g

        def steps(name):  # an inner sequence's gradient as [L, R, ..]
            g = g_seqs[GRAD + name]
            return g.reshape(length, rank, *g.shape[1:])

        add(ml.q, steps(ml.q.arg)[:, rank - 1], [_T, *ml.q.axes])
        for name, index, own in ((self.k_name, 0, ml.key), (self.v_name, 1, ml.value)):
            g, start = steps(name), 0
            for term in self._terms(sizes):
                node, r, size = term[index], term[2], term[3]
                part = g[:, start:start + size]
                start += size
                add(node, part if r is not None else part[:, 0], [_T, *([r] if r is not None else []), *ml.heads, own])
        if self.decay_node is not None and self.decay_node.op is not Op.CONST:
            add(self.decay_node, steps(self.decay_name)[:, 0], [_T, *self.decay_node.axes])
        state = GRAD + ml.state.name
        outs = {k: v.contiguous() for k, v in grads.items() if k[len(GRAD):] in self.seq_names}
        finals = {state: g_rest[state]}
        finals.update((k, v.contiguous()) for k, v in grads.items() if k[len(GRAD):] not in self.seq_names)
        return outs, finals

    def prepare_forward(self, seqs, params, initial, sizes, length, outputs: bool = True):
        """`forward` (with a tape) for calls of one signature."""
        def call(seqs, params, initial):
            return self.forward(seqs, params, initial, sizes, length, outputs)
        return call

    def prepare_backward(self, seqs, params, tape, cot, lam, extra, sizes, length):
        """`backward` for calls of one signature."""
        def call(seqs, params, tape, cot, lam, extra):
            return self.backward(seqs, params, tape, cot, lam, extra, sizes, length)
        return call

"""Hoisting contractions out of the time loop, to be done for all steps at once by a matrix product.

A *contraction* is ``sum over R of (f1 * f2 * ...)`` (a chain of SUMs over a product). Two kinds
do not need the sequential loop:

- **pre**: a contraction whose factors read sequences and params only (through renames and
  unbinds), e.g. an LSTM's gate term ``z_x[t, b, g, k] = sum_i x[t, b, i] W[i, g, k]``. It becomes a
  new sequence input ``hz<n>`` of the program, computed before the kernel for every t:

      for t: hz[t, ...] = sum over R of prod(factors at t)          # one einsum over (t, ...)

- **post**: a root that is a contraction of one value `f` the kernel computes (anything, states
  included) with sequences / params, e.g. an adjoint's ``grad_x[t, b, i] = sum_{g,k} gz[t, g, b, k]
  W[i, g, k]`` or a param-gradient accumulator ``grad_W += sum_b gz[t, g, b, k] x[t, b, i]``. The
  kernel then writes `f` as a new per-step output ``hf<n>`` and the root is computed afterwards:

      for t: y[t, ...] = sum over R of f[t] * prod(other factors at t)     # an output
      acc = init + sum over t, R of f[t] * prod(other factors at t)       # an accumulator

  so an accumulator that sums over the batch and time is one matrix product over (t, b) and leaves
  the program (which then often needs no split into core + epilogue at all).

Only matrix-product-like contractions are hoisted (`gemm_like`: something is summed and two
factors each have an axis the others lack), plus plain sums of an `f` that is written anyway.
The pass is backend-neutral: `hoist` rewrites the IR; `compute_pre` / `compute_post` evaluate the
hoisted parts in the arrays' dtype with NumPy, or with another array library (`NumPyArrays`: the CUDA
backend passes torch's, whose matrix products run on cuBLAS: backends/cuda/hoisted.py).
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from functools import cached_property, lru_cache, reduce
from itertools import pairwise

import numpy as np

from ..ir import build
from ..ir.node import Node, substitute, toposort
from ..ir.ops import Op
from ..ir.program import Decl, Recurrence, Role
from ..passes.classify import classify
from ..passes.recurrent_products import recurrent_products

TIME = "~t"  # the label of the time axis while evaluating


@dataclass(frozen=True)
class Hoisted:
    """`program` with contractions hoisted (module docstring) and how to compute them.

    pre:          (new sequence name, state-free contraction node of the original program)
    factors:      (new output name, the value f the kernel writes per step)
    post_outputs: (output name, contraction node over leaves and INPUT(f's output name))
    post_accumulators: (state name, increment node, like post_outputs), summed over time
    transposed:   (new param name, original param name, its axes in the new order)
    """

    original: Recurrence
    program: Recurrence
    pre: tuple[tuple[str, Node], ...] = ()
    factors: tuple[tuple[str, Node], ...] = ()
    post_outputs: tuple[tuple[str, Node], ...] = ()
    post_accumulators: tuple[tuple[str, Node], ...] = ()
    transposed: tuple[tuple[str, str, tuple[str, ...]], ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.pre or self.factors or self.transposed or self.post_accumulators)

    @cached_property  # read by every run's compute_post
    def product_orders(self) -> dict[str, tuple[str, ...]]:
        """Written factor name -> the axis order its post products read it in (`_product_order`)."""
        return {name: _product_order(self, name, f) for name, f in self.factors}

    def describe(self) -> str:
        copies = ", ".join(f"{n} = {p}[{' '.join(a)}]" for n, p, a in self.transposed)
        lines = [f"hoisted before the time loop: {', '.join(n for n, _ in self.pre) or '-'}",
                 f"params copied in the loop order: {copies or '-'}",
                 f"per-step values written for after it: {', '.join(n for n, _ in self.factors) or '-'}",
                 f"computed after it: {', '.join(n for n, _ in self.post_outputs + self.post_accumulators) or '-'}"]
        return "\n".join(lines)


# -- recognising contractions -------------------------------------------------------------------


def split_contraction(node: Node) -> tuple[tuple[str, ...], tuple[Node, ...]] | None:
    """(summed axes, factors) when `node` is ``sum over R of a product`` (R non-empty), else None."""
    summed = []
    while node.op is Op.SUM:
        summed.append(node.arg)
        node = node.args[0]
    if not summed:
        return None
    factors, stack = [], [node]
    while stack:
        n = stack.pop()
        if n.op is Op.MUL:
            stack.extend(reversed(n.args))
        else:
            factors.append(n)
    return tuple(summed), tuple(factors)


def gemm_like(summed, factors) -> bool:
    """Something summed and at least two factors with an axis no other factor has."""
    if not summed or len(factors) < 2:
        return False
    own = 0
    for i, f in enumerate(factors):
        others = {a for j, g in enumerate(factors) if j != i for a in g.axes}
        own += any(a not in others and a not in summed for a in f.axes)
    return own >= 2


def _leafy(node: Node, roles: dict[str, Role]) -> bool:
    """An input (sequence / param) seen through renames, unbinds and negations only (an adjoint's
    ``-grad_y``: `_evaluate` negates the product instead)."""
    while node.op in (Op.RENAME, Op.SELECT, Op.NEG):
        node = node.args[0]
    return node.op is Op.INPUT and roles.get(node.arg) in (Role.SEQ, Role.PARAM)


def _timed(node: Node, roles: dict[str, Role]) -> bool:
    return any(n.op is Op.INPUT and roles.get(n.arg) is Role.SEQ for n in toposort([node]))


# -- the pass ------------------------------------------------------------------------------------


@lru_cache(maxsize=256)  # a program is hoisted by its runner and, for an adjoint, by `grad._recording`
def hoist(program: Recurrence, transpose: bool = True) -> Hoisted:
    """Hoist the program's pre and post contractions (module docstring); unchanged if none. With
    `transpose`, params that the loop's own contractions read are copied into its loop order
    (`transpose_params`: Numba's threads loop along the contraction; CUDA's threads do not)."""
    roles = {d.name: d.role for d in program.decls}
    pre = _find_pre(program, roles, set(_accumulators(program).values()))
    mapping = {node: Node.make(Op.INPUT, (), name, node.axes) for name, node in pre}
    updates = substitute(program.updates, mapping) if mapping else program.updates
    outputs = tuple(zip([n for n, _ in program.outputs],
                        substitute(tuple(y for _, y in program.outputs), mapping))) if mapping else program.outputs
    staged = program.with_roots(updates, outputs, new_seqs=[(n, node.axes) for n, node in pre])
    staged_roles = {d.name: d.role for d in staged.decls}

    factors: dict[Node, str] = {}
    post_outputs, post_acc = [], []
    accs = _accumulators(staged)
    # what the loop computes for the states it keeps whatever is hoisted (not the accumulators)
    in_loop = set(toposort([u for s, u in zip(staged.states, staged.updates) if s.name not in accs]))

    # a program with a recurrent product (an LSTM's adjoint, run by the persistent kernel, whose blocks each own a
    # batch tile) writes the loop's value of every accumulator's increment that is a plain sum of it (a LayerNorm
    # gain's sum_b dz n), summed over time and the rows after the loop, rather than summing it across the rows
    # in the loop
    written = bool(recurrent_products(staged))

    def post_form(root: Node, gemm_only: bool, accumulator: bool = False) -> Node | None:
        if written and accumulator and not gemm_only and root.op is Op.ADD:
            root = _pulled_sum(root) or root  # (a peephole's gradient: a row sum a gate, stacked along g3)
        if root.op is Op.ADD and gemm_only:  # a sum of contractions (minGRU's grad_x: g_z Wz^T + g_h Wh^T)
            forms = [post_form(a, gemm_only, accumulator) for a in root.args]
            return None if any(f is None for f in forms) or root in in_loop else build.add(*forms)
        parts = split_contraction(root)
        if parts is None or root in in_loop:  # the loop computes it anyway: a product after it would repeat it
            return None
        summed, fs = parts
        kernel_values = [f for f in fs if not _leafy(f, staged_roles)]
        if not kernel_values:
            # an accumulator's increment over sequences and params alone (a post stage's adjoint:
            # grad_C += sum_b grad_y[t] cut[t]): one product over (t, b) after the loop, nothing written
            return root if accumulator and gemm_only and gemm_like(summed, fs) else None
        # several factors the loop computes (minGRU's g * z (1 - z) ...): their product is the one value
        # it writes, the same node for every root with those factors
        f = reduce(build.mul, kernel_values)
        leafy = [g for g in fs if _leafy(g, staged_roles)]
        if gemm_only and not gemm_like(summed, (f, *leafy)):
            # an input elementwise with the loop's values (x in sum_b g[b, d] x[b, d] x[b, e]) is written
            # with them: the product is then a matrix product of the written value and what is left
            within = [g for g in leafy if set(g.axes) <= set(f.axes)]
            if within:
                kernel_values += within
                leafy = [g for g in leafy if g not in within]
                f = reduce(build.mul, kernel_values)
        if f.op is Op.INPUT or not (gemm_like(summed, (f, *leafy)) if gemm_only
                                    else f in factors or (written and accumulator)):
            return None
        name = factors.setdefault(f, f"hf{len(factors)}")
        value = Node.make(Op.INPUT, (), name, f.axes)
        if len(kernel_values) == 1:
            return substitute((root,), {f: value})[0]
        form = reduce(build.mul, leafy, value)
        for axis in reversed(summed):
            form = build.reduce_sum(form, axis)
        return form

    # two rounds: matrix-product-like roots first, then plain sums of a value already written
    for gemm_only in (True, False):
        for name, y in staged.outputs:
            if name not in dict(post_outputs) and (form := post_form(y, gemm_only)) is not None:
                post_outputs.append((name, form))
        for s, b in accs.items():
            if s not in dict(post_acc) and (form := post_form(b, gemm_only, True)) is not None:
                post_acc.append((s, form))
    if not pre and not post_outputs and not post_acc:
        if not transpose:
            return Hoisted(program, program)
        program_t, transposed = transpose_params(program)
        return Hoisted(program, program_t, transposed=transposed)
    drop_out = {n for n, _ in post_outputs}
    drop_state = {s for s, _ in post_acc}
    keep = [i for i, s in enumerate(staged.states) if s.name not in drop_state]
    updates = tuple(staged.updates[i] for i in keep)
    outputs = tuple((n, y) for n, y in staged.outputs if n not in drop_out)
    outputs += tuple((name, f) for f, name in factors.items())
    kept = [staged.states[i].name for i in keep]
    final = staged.with_roots(updates, outputs, states=kept)
    final, transposed = transpose_params(final) if transpose else (final, ())
    return Hoisted(program, final, tuple(pre), tuple((n, f) for f, n in factors.items()),
                   tuple(post_outputs), tuple(post_acc), transposed)


def _pulled_sum(node: Node) -> Node | None:
    """`node` as one sum over an axis a of a summand, where it is a tree of additions and selections
    ``where(c, ., 0)`` (c without a) over sums over a: ``sum_i where(g3 == i, sum_b f_i, 0)`` as
    ``sum_b sum_i where(g3 == i, f_i, 0)``; else None."""
    def summand(n: Node, axis: str | None) -> tuple[str, Node] | None:
        if n.op is Op.SUM and axis in (None, n.arg):
            return n.arg, n.args[0]
        if n.op is Op.ADD:
            first = summand(n.args[0], axis)
            second = first and summand(n.args[1], first[0])
            return second and (first[0], build.add(first[1], second[1]))
        if (n.op is Op.WHERE and n.args[2].op is Op.CONST and n.args[2].arg == 0
                and (axis is None or axis not in n.args[0].axes)):
            inner = summand(n.args[1], axis)
            if inner is not None and inner[0] not in n.args[0].axes:
                return inner[0], build.where(n.args[0], inner[1], n.args[2])
        return None

    found = summand(node, None)
    return None if found is None else build.reduce_sum(found[1], found[0])


def transpose_params(program: Recurrence) -> tuple[Recurrence, tuple]:
    """Params read by a per-step contraction, copied into the contraction's loop order.

    A sum accumulates in its operand's axis order (`step.StepBuilder.compute`), so for
    ``sum_{g,k} f[g, k] U[j, g, k]`` (operand axes g k j) the innermost loop runs along j, which
    is strided in U. A copy ``hp[g, k, j] = U[j, g, k]`` made once per run makes it contiguous.
    """
    roles = {d.name: d.role for d in program.decls}
    nodes = toposort(program.roots)
    users: dict[Node, list[Node]] = {}
    for n in nodes:
        for a in n.args:
            users.setdefault(a, []).append(n)
    mapping: dict[Node, Node] = {}
    transposed: list[tuple[str, str, tuple[str, ...]]] = []
    for n in nodes:
        if n.op is not Op.SUM or any(u.op is Op.SUM for u in users.get(n, [])):
            continue
        x = n
        while x.op is Op.SUM:
            x = x.args[0]
        factors = split_contraction(n)[1]
        for f in factors:
            renames, leaf = [], f
            while leaf.op is Op.RENAME:
                renames.append(dict(leaf.arg))
                leaf = leaf.args[0]
            if leaf.op is not Op.INPUT or roles.get(leaf.arg) is not Role.PARAM or f in mapping:
                continue
            back = {}  # the factor's axis name -> the param's own name
            for a in leaf.axes:
                name = a
                for r in reversed(renames):
                    name = r.get(name, name)
                back[name] = a
            want = tuple(back[a] for a in x.axes if a in back)
            if want == leaf.axes or len(want) != len(leaf.axes):
                continue
            name = f"hp{len(transposed)}"
            transposed.append((name, leaf.arg, want))
            new_leaf = Node.make(Op.INPUT, (), name, want)
            mapping[f] = substitute((f,), {leaf: new_leaf})[0]
    if not mapping:
        return program, ()
    updates = substitute(program.updates, mapping)
    outs = substitute(tuple(y for _, y in program.outputs), mapping)
    decls = [d for d in program.decls]
    decls += [Decl(name, Role.PARAM, axes) for name, _, axes in transposed]
    staged = Recurrence(name=program.name, decls=tuple(decls), updates=updates,
                        outputs=tuple(zip([n for n, _ in program.outputs], outs)), sizes=program.sizes,
                        reverse=program.reverse, loc=program.loc, doc=program.doc)
    return staged.with_roots(staged.updates, staged.outputs), tuple(transposed)


def _find_pre(program: Recurrence, roles, increments: set[Node] = frozenset()) -> list[tuple[str, Node]]:
    """State-free, time-varying, matrix-product-like contractions; the outermost of each SUM chain.
    Not an accumulator's increment (`increments`): that is summed over time too, by one product after
    the loop (`hoist`'s post accumulators), not written for every step."""
    stateful = {d.name for d in program.states}
    nodes = toposort(program.roots)
    free = set()
    for n in nodes:
        if n.op is Op.INPUT:
            if n.arg not in stateful:
                free.add(n)
        elif n.op not in (Op.IOTA,) and all(a in free for a in n.args):
            free.add(n)
    # a sum summed again, and read by nothing else: its outer sum is the contraction (a sum that other nodes
    # read too, a LayerNorm's x W whose mean sums it over g and k, is hoisted itself, the outer sums left to
    # the loop)
    users: dict[Node, set] = {}
    for n in nodes:
        for a in n.args:
            users.setdefault(a, set()).add(n.op)
    inner = {n.args[0] for n in nodes if n.op is Op.SUM and n in free and users[n.args[0]] == {Op.SUM}}
    found = []
    for n in nodes:
        if n.op is not Op.SUM or n not in free:
            continue
        if n in inner or n in increments:
            continue
        summed, fs = split_contraction(n)
        if all(_leafy(f, roles) for f in fs) and gemm_like(summed, fs) and _timed(n, roles):
            found.append((f"hz{len(found)}", n))
    return found


def _accumulators(program: Recurrence) -> dict[str, Node]:
    """state name -> per-step increment `b` for states updated as ``s = s + b`` (nothing else reads s)."""
    out = {}
    for c in classify(program).states:
        if c.family != "accumulator" or c.b is None:
            continue
        decl = program.decl(c.state)
        if set(c.b.axes) == set(decl.axes):
            out[c.state] = c.b
    return out


# -- evaluating the hoisted parts (NumPy or torch, in the arrays' dtype) -------------------------------


class NumPyArrays:
    """What evaluating the hoisted parts asks of an array library (NumPy here; torch on the GPU:
    backends/cuda/hoisted.py). Axes are given as positions, permutations as lists."""

    @staticmethod
    def take(arr, index: int, axis: int):
        return np.take(arr, index, axis=axis)

    @staticmethod
    def einsum(spec: str, *arrays):
        return np.einsum(spec, *arrays, optimize=True)

    @staticmethod
    def sum(arr, axes: tuple[int, ...]):
        return arr.sum(axis=axes)

    @staticmethod
    def permute(arr, perm: list[int]):
        return arr.transpose(perm)

    @staticmethod
    def contiguous(arr, dtype=None):
        """`arr` C-contiguous (a copy only where it is not), in `dtype` where given."""
        return np.ascontiguousarray(arr, dtype=dtype)

    @staticmethod
    def dtype_of(*arrays):
        return np.result_type(*arrays)

    @staticmethod
    def pair(a, la: tuple[str, ...], b, lb: tuple[str, ...], out: tuple[str, ...]):
        """``sum over shared of a * b`` as the library's own matrix product, (array, labels); None:
        `einsum` computes it (NumPy's, or the `matmul` given to `_evaluate`)."""
        return None


NUMPY = NumPyArrays()


def _evaluate(node: Node, env: dict[str, tuple[np.ndarray, tuple[str, ...]]], sum_time: bool = False,
              matmul=None, xp=NUMPY):
    """(array, axis labels) of a leafy contraction; TIME labels the time axis of sequences.

    `matmul(a, b)` (2-D NumPy arrays) computes two-factor contractions; None: `xp.einsum` does all."""
    if node.op is Op.INPUT:
        return env[node.arg]
    if node.op is Op.RENAME:
        arr, labels = _evaluate(node.args[0], env, matmul=matmul, xp=xp)
        mapping = dict(node.arg)
        return arr, tuple(mapping.get(a, a) for a in labels)
    if node.op is Op.SELECT:
        arr, labels = _evaluate(node.args[0], env, matmul=matmul, xp=xp)
        axis, index = node.arg
        pos = labels.index(axis)
        return xp.take(arr, index, pos), labels[:pos] + labels[pos + 1:]
    if node.op is Op.NEG:
        arr, labels = _evaluate(node.args[0], env, sum_time, matmul, xp)
        return -arr, labels
    if node.op is Op.ADD:  # contractions added (`hoist`'s post_form): each, in the first one's axis order
        (total, labels), *rest = (_evaluate(a, env, sum_time, matmul, xp) for a in node.args)
        for arr, own in rest:
            total = total + xp.permute(arr, [own.index(a) for a in labels])
        return total, labels
    _, fs = split_contraction(node)
    negated = False
    for f in fs:
        while f.op is Op.NEG:  # a negated factor: the (often smaller) product negated instead
            f, negated = f.args[0], not negated
    if negated:
        fs = tuple(_without_neg(f) for f in fs)
        arr, labels = _evaluate(_product(fs, node), env, sum_time, matmul, xp)
        return -arr, labels
    operands = [_evaluate(f, env, matmul=matmul, xp=xp) for f in fs]
    timed = any(TIME in labels for _, labels in operands)
    out = ((TIME,) if timed and not sum_time else ()) + tuple(node.axes)
    if len(operands) == 2:
        (a, la), (b, lb) = operands
        done = _as_matmul(operands, out, matmul) if matmul is not None else xp.pair(a, la, b, lb, out)
        if done is not None:
            return done
    letters = {}
    for _, labels in operands:
        for a in labels:
            letters.setdefault(a, string.ascii_letters[len(letters)])
    spec = ",".join("".join(letters[a] for a in labels) for _, labels in operands)
    spec += "->" + "".join(letters[a] for a in out)
    return xp.einsum(spec, *(arr for arr, _ in operands)), out


def _without_neg(node: Node) -> Node:
    while node.op is Op.NEG:
        node = node.args[0]
    return node


def _product(factors: tuple[Node, ...], like: Node) -> Node:
    """``sum over like's summed axes of prod(factors)``: `like` with other factors."""
    summed, _ = split_contraction(like)
    out = reduce(lambda a, b: Node.make(Op.MUL, (a, b)), factors)
    for axis in summed[::-1]:
        out = Node.make(Op.SUM, (out,), axis)
    return out


def _as_matmul(operands, out: tuple[str, ...], matmul):
    """``sum over shared of a * b`` as one matrix product; None for other forms (batched axes)."""
    (a, la), (b, lb) = operands
    a, la = _sum_out(a, la, set(lb) | set(out))
    b, lb = _sum_out(b, lb, set(la) | set(out))
    shared = [x for x in la if x in lb]
    if any(x in out for x in shared):
        return None
    fa = [x for x in la if x not in lb]
    fb = [x for x in lb if x not in la]
    if set(fa + fb) != set(out):
        return None
    size = dict(zip(la, a.shape)) | dict(zip(lb, b.shape))
    # free axes in the order the result is wanted in (no transposed copy of the result after);
    # the summed ones in the order a or b lies in memory (largest stride first), whichever copies
    # fewer bytes: a 2-D reshape is a view wherever the memory allows; `matmul` reads `a` at any
    # strides, `b` C-contiguous.
    fa, fb = sorted(fa, key=out.index), sorted(fb, key=out.index)
    orders = [sorted(shared, key=lambda x: -b.strides[lb.index(x)]),
              sorted(shared, key=lambda x: -a.strides[la.index(x)])]
    shared = min(orders, key=lambda order: _copied(a, la, fa, order, False) + _copied(b, lb, order, fb, True))
    a2 = a.transpose([la.index(x) for x in fa + shared]).reshape(_prod(size, fa), _prod(size, shared))
    b2 = b.transpose([lb.index(x) for x in shared + fb]).reshape(_prod(size, shared), _prod(size, fb))
    c = matmul(a2, b2)
    return c.reshape([size[x] for x in fa + fb]), tuple(fa + fb)



def _copied(arr: np.ndarray, labels, rows, cols, contiguous: bool) -> int:
    """Bytes copied to read `arr` as the matrix (rows, cols): 0 when that is a view (and, with
    `contiguous`, a C-contiguous one)."""
    if contiguous:
        return 0 if arr.transpose([labels.index(x) for x in (*rows, *cols)]).flags.c_contiguous else arr.nbytes

    def merges(group) -> bool:  # the group's axes, outer to inner, flatten to one strided axis
        dims = [labels.index(x) for x in group if arr.shape[labels.index(x)] != 1]
        return all(arr.strides[i] == arr.strides[j] * arr.shape[j] for i, j in pairwise(dims))

    return 0 if merges(rows) and merges(cols) else arr.nbytes


def _sum_out(arr, labels, keep):
    drop = [i for i, x in enumerate(labels) if x not in keep]
    if not drop:
        return arr, labels
    return arr.sum(axis=tuple(drop)), tuple(x for x in labels if x in keep)


def _prod(size, axes) -> int:
    out = 1
    for x in axes:
        out *= size[x]
    return out


def _env(h: Hoisted, seqs: dict, params: dict) -> dict:
    """name -> (array, labels) for the original program's sequences and params and the ``hz<n>``."""
    env = {}
    for d in h.original.decls:
        if d.role is Role.SEQ and d.name in seqs:
            env[d.name] = (seqs[d.name], (TIME, *d.axes))
        elif d.role is Role.PARAM and d.name in params:
            env[d.name] = (params[d.name], d.axes)
    for name, node in h.pre:
        if name in seqs:
            env[name] = (seqs[name], (TIME, *node.axes))
    return env


def _ordered(arr, labels: tuple[str, ...], want: tuple[str, ...], dtype, xp=NUMPY):
    return xp.contiguous(xp.permute(arr, [labels.index(a) for a in want]), dtype)


def compute_params(h: Hoisted, params: dict, xp=NUMPY) -> dict:
    """The transposed param copies ``hp<n>`` (contiguous, in the params' dtype)."""
    out = {}
    for name, source, axes in h.transposed:
        own = h.original.decl(source).axes
        out[name] = xp.contiguous(xp.permute(params[source], [own.index(a) for a in axes]))
    return out


def compute_pre(h: Hoisted, seqs: dict, params: dict, matmul=None, products: dict | None = None,
                xp=NUMPY) -> dict:
    """The hoisted sequences ``hz<n>`` [t, *axes] from the run's sequences and params.

    `matmul`: as in `_evaluate` (a backend's own matrix product; None: `xp.einsum`). `products`:
    contraction node -> its array, read and filled, shared by runs of several programs over the
    same sequences and params (nodes are interned: a recording forward's ``x W`` is the very node
    its adjoint recomputes, which then takes it from here). `xp`: the arrays' library (`NumPyArrays`)."""
    env = _env(h, seqs, params)
    out = {}
    for name, node in h.pre:
        if products is not None and node in products:
            out[name] = products[node]
            continue
        dtype = xp.dtype_of(*(env[n.arg][0] for n in toposort([node]) if n.op is Op.INPUT))
        arr, labels = _evaluate(node, env, matmul=matmul, xp=xp)
        out[name] = _ordered(arr, labels, (TIME, *node.axes), dtype, xp)
        if products is not None:
            products[node] = out[name]
    return out


def in_original_order(h: Hoisted, outs: dict, xp=NUMPY) -> dict:
    """The hoisted program's outputs [t, *axes] with their axes in the original program's order.

    A rewritten output may list its axes in another order: axis order follows the operands, and a
    param read through its reordered copy ``hp<n>`` has another (a random spec's grad_x0 came out
    as [k b n], not [n k b])."""
    rewritten = dict(h.program.outputs)
    out = dict(outs)
    for name, y in h.original.outputs:
        own = rewritten[name].axes if name in rewritten else y.axes
        if name in out and own != y.axes:
            out[name] = xp.permute(out[name], [0, *(1 + own.index(a) for a in y.axes)])
    return out


def compute_post(h: Hoisted, seqs: dict, params: dict, written: dict, initial: dict, matmul=None, xp=NUMPY,
                 dtype=None):
    """(outputs [t, *axes], final accumulators) of the post contractions, from the kernel's ``hf<n>``.

    `seqs` includes the ``hz<n>`` of `compute_pre`; `written` holds the kernel's outputs. The outputs come
    out in `dtype` (None: the first ``hf<n>``'s), the accumulators in their initial values'."""
    env = _env(h, seqs, params)
    for name, f in h.factors:
        order = h.product_orders[name]
        arr = written[name]
        if order != f.axes:  # at most one copy (none where the runner allocated it in this order)
            arr = xp.contiguous(xp.permute(arr, [0, *(1 + f.axes.index(a) for a in order)]))
        env[name] = (arr, (TIME, *order))
    outs, finals = {}, {}
    axes = {name: y.axes for name, y in h.original.outputs}  # a rebuilt contraction may list them in another order
    for name, node in h.post_outputs:
        arr, labels = _evaluate(node, env, matmul=matmul, xp=xp)
        outs[name] = _ordered(arr, labels, (TIME, *axes[name]), dtype or written[h.factors[0][0]].dtype, xp)
    for s, node in h.post_accumulators:
        axes = h.original.decl(s).axes
        init = initial[s]
        arr, labels = _evaluate(node, env, sum_time=True, matmul=matmul, xp=xp)
        if TIME in labels:
            arr, labels = xp.sum(arr, (labels.index(TIME),)), tuple(a for a in labels if a != TIME)
        finals[s] = init + _ordered(arr, labels, axes, init.dtype, xp)
    return outs, finals


def _product_order(h: Hoisted, name: str, f: Node) -> tuple[str, ...]:
    """The order of a written factor's axes in which the post products read it as a matrix without
    a copy: the axes it shares with a sequence factor first, then the others (in f's order).

    An LSTM adjoint's gate gradient gz [g b k]: ``grad_x = gz (t b, g k) @ W`` and
    ``grad_W = gz^T (g k, t b) @ x (t b, i)`` both read (t, b, g, k) as a 2-D view."""
    seq_axes = set()
    roles = {d.name: d.role for d in h.original.decls}
    for _, node in h.post_outputs + h.post_accumulators:
        parts = split_contraction(node)
        if parts is None or not any(x.op is Op.INPUT and x.arg == name for x in toposort(parts[1])):
            continue
        for x in parts[1]:
            if _timed(x, roles):
                seq_axes.update(a for a in x.axes)
    first = tuple(a for a in f.axes if a in seq_axes)
    return first + tuple(a for a in f.axes if a not in seq_axes)

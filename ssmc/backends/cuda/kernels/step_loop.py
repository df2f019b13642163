"""Nonlinear recurrences with a recurrent product (LSTM, GRU: ``dot(h, U, over=j)``) as a loop over
steps of torch operations, each product of a state with a param one matrix product (cuBLAS).

The thread-per-row kernels give such a program one thread per batch row walking the whole product
alone; here every step is spread over the GPU by the matrix product, as a plain loop:

    free = the nodes that read no state, evaluated once for all steps (x W already hoisted out)
    carry = initial states
    for t in range(L):                    # reversed for an adjoint
        env = carry | free[t] | params
        new, ys[t] = evaluate(updates, env), evaluate(outputs, env)
        carry = new

Every node is evaluated by `backends/torch_eval.py`; a ``SUM over a of MUL(x, y)`` whose product is
read by nothing else is one matrix product (an einsum where the shapes do not allow; never the
[b, j, g, k] product). A call works out each node's permutations and shapes at its first step. The gradient's programs
(the recompute of the carries, the adjoint, whose ``dh Uᵀ`` and ``Σ_b hᵀ dg`` are such products) run
the same way, so `ssmc.grad` works unchanged. This is the first step of the persistent kernel the
nonlinear family needs (U resident on chip across steps, a grid-wide barrier per step): it launches
one kernel per op and step. From a signature's second call on, the whole call is one CUDA graph
(`CapturedLoop`), so the host's time per launch is paid once, at the capture.
"""

from __future__ import annotations

from functools import cached_property, partial

from ....ir.node import Node, depending_on, toposort
from ....ir.ops import Op
from ....passes.classify import classify
from ....passes.recurrent_products import recurrent_products
from ..options import options


def applies(program) -> str | None:
    """Why the step loop takes `program` (one line), or None: states that are not diagonal or matrix
    linear (those have their scans), read through a recurrent product."""
    if not program.states:
        return None
    family = classify(program).family
    if family not in ("nonlinear", "general linear"):
        return None
    products = recurrent_products(program)
    if not products:
        return None
    names = ", ".join(f"sum over {p.arg}" for p in products)
    return (f"a {family} recurrence reading its states through {len(products)} recurrent product(s) ({names}):"
            " a loop over steps, each product one matrix product")


class StepLoop:
    """Runs one program as the loop of the module docstring (the runner contract)."""

    def __init__(self, program, compute: str = "float32"):
        self.program = program
        self.compute = compute
        nodes = toposort(program.roots)
        state_names = {s.name for s in program.states}
        stateful = depending_on(nodes, state_names)
        users: dict[Node, int] = {}
        for n in nodes:
            for a in set(n.args):
                users[a] = users.get(a, 0) + 1
        roots = set(program.roots)
        # the free values the steps read, and the free roots (outputs computed for all steps at once)
        self.free = [n for n in nodes if n not in stateful and (
            n in roots or any(n in u.args for u in stateful))]
        self.step_roots = tuple(program.updates) + tuple(y for _, y in program.outputs)
        # SUM over a of MUL(x, y), the product read by nothing else: one matrix product (`_matmul_plan`)
        self.contractions = {n: n.args[0] for n in nodes if n.op is Op.SUM and n.args[0].op is Op.MUL
                             and users.get(n.args[0]) == 1 and n.args[0] not in roots}
        skip = set(self.contractions.values())
        self.order = [n for n in nodes if n in stateful and n not in skip]
        self.free_order = [n for n in toposort(self.free) if n not in skip]
        # signature -> 0 (called once), its CapturedLoop, or False (the capture failed): `run`
        self._graphs: dict[tuple, CapturedLoop | int] = {}

    @cached_property
    def describe(self) -> str:
        return applies(self.program) or "a loop over steps"

    def run(self, seqs, params, initial, sizes, length, out_dtype=None):
        """Same contract as `interpreter.run_recurrence` (torch tensors in and out, time first). On a
        GPU, from the second call of a signature on (SSMC_CUDA_STEP_GRAPHS=0: never), the whole loop
        is one CUDA graph replayed (`CapturedLoop`): the host's launch per op and step is paid once."""
        arrays = [*seqs.values(), *params.values(), *initial.values()]
        if (options().step_graphs is not False and length >= GRAPH_STEPS and arrays
                and arrays[0].device.type == "cuda"):
            key = (_signature(seqs), _signature(params), _signature(initial), tuple(sorted(sizes.items())),
                   length, out_dtype, arrays[0].device)
            captured = self._graphs.get(key)
            if captured is None:  # the first call of the signature runs op by op
                self._graphs[key] = 0
                _forget_oldest(self._graphs)
            elif captured == 0:
                loop = partial(self._loop, sizes=sizes, length=length, out_dtype=out_dtype)
                captured = self._graphs[key] = CapturedLoop.capture(loop, seqs, params, initial) or False
                _forget_oldest(self._graphs)
            if captured:
                return captured(seqs, params, initial)
        return self._loop(seqs, params, initial, sizes, length, out_dtype)

    def _loop(self, seqs, params, initial, sizes, length, out_dtype=None):
        """The loop of the module docstring, op by op."""
        import torch

        from ...torch_eval import TIME, TorchEvaluator, align

        p = self.program
        dtype = torch.float64 if self.compute == "float64" else torch.float32
        arrays = [*seqs.values(), *params.values(), *initial.values()]
        device = arrays[0].device if arrays else None
        ev = TorchEvaluator(sizes, dtype, device)
        env = {d.name: (params[d.name].to(dtype), d.axes) for d in p.params}
        env.update((d.name, (seqs[d.name].to(dtype).movedim(0, -1), (*d.axes, TIME))) for d in p.seqs)
        free: dict = {}
        self._evaluate(ev, env, free, self.free_order)
        free = {n: free[n] for n in self.free}
        outs = {name: torch.empty((length, *[sizes[a] for a in y.axes]), dtype=out_dtype or dtype, device=device)
                for name, y in p.outputs}
        for name, y in p.outputs:
            if y in free:  # reads no state: all steps at once
                outs[name].copy_(align(free[y], (*y.axes, TIME)).movedim(-1, 0).expand(outs[name].shape))
        stepped = [(name, y) for name, y in p.outputs if y not in free]
        k = len(p.updates)
        fast: dict = {}  # the nodes' per-step work, worked out at the first step (`_fast`)

        def step(carry: dict, at: dict):
            """(the new carry, the step's outputs) from the carry and the free values at a step."""
            memo = dict(at)
            self._evaluate(ev, {**env, **carry}, memo, self.order, fast)
            values = [memo[r] for r in self.step_roots]
            new = {s.name: (align(v, s.axes).expand([sizes[a] for a in s.axes]), s.axes)
                   for s, v in zip(p.states, values[:k])}
            ys = {name: align(v, y.axes) for (name, y), v in zip(p.outputs, values[k:]) if y not in free}
            return new, ys

        carry = {s.name: (initial[s.name].to(dtype), s.axes) for s in p.states}
        steps = range(length - 1, -1, -1) if p.reverse else range(length)
        for t in steps:
            carry, ys = step(carry, {n: _at(v, t, TIME) for n, v in free.items()})
            for name, _ in stepped:
                outs[name][t] = ys[name]
        finals = {name: value.to(out_dtype or dtype).contiguous() for name, (value, _) in carry.items()}
        return outs, finals

    def _evaluate(self, ev, env: dict, memo: dict, order: list[Node], fast: dict | None = None) -> None:
        """The values of the nodes of `order` into `memo`. `fast` (node -> a function of its arguments'
        values, or None): the per-step work of the nodes evaluated before, kept across the steps of a
        call (`_fast`): their arguments' layouts are the same every step."""
        for n in order:
            if n in memo:
                continue
            args = self.contractions[n].args if n in self.contractions else n.args
            known = fast.get(n) if fast is not None else None
            if known is not None:
                memo[n] = known([memo[a] for a in args])
                continue
            values = [memo[a] for a in args]
            value = _contract(n, *values, ev.sizes) if n in self.contractions else ev.eval_node(n, values, env)
            memo[n] = value
            if fast is not None and n.op is not Op.INPUT and n not in fast:  # None: the general path each step
                fast[n] = _fast(n, values, value, n in self.contractions, ev.sizes)


def _fast(node: Node, args: list, value, contraction: bool, sizes: dict[str, int]):
    """A function of `node`'s argument values giving its value, with the permutations and shapes its
    first evaluation worked out (`args`, `value`) fixed; None where the general path is as quick."""
    from ...torch_eval import BINARY, UNARY

    if contraction:
        return _matmul_plan(node, *args, sizes)
    op = node.op
    if op in UNARY:
        fn = UNARY[op]
    elif op in BINARY:
        fn = BINARY[op]
    elif op is Op.WHERE:
        import torch

        fn = torch.where
    else:
        return None
    target = value[1]
    preps = []
    for t, axes in args:
        present = [a for a in target if a in axes]
        perm = None if tuple(present) == tuple(axes) else [axes.index(a) for a in present]
        shape = None if len(present) == len(target) else [t.shape[axes.index(a)] if a in axes else 1 for a in target]
        preps.append((perm, shape))

    def run(values):
        ts = []
        for (t, _), (perm, shape) in zip(values, preps):
            if perm is not None:
                t = t.permute(*perm)
            if shape is not None:
                t = t.reshape(shape)
            ts.append(t)
        return fn(*ts), target
    return run


def _matmul_plan(node: Node, a, b, sizes: dict[str, int]):
    """``SUM over node.arg of a * b`` as one 2-D matrix product (the operands permuted and viewed as
    [rows, inner] and [inner, cols]) where the shapes allow: no axis both keep, the shared axes of one
    size in both, nothing summed in one operand alone; else the einsum of `_contract`."""
    (ta, xa), (tb, xb) = a, b
    shared = [x for x in xa if x in xb]
    if (shared != [node.arg] or ta.shape[xa.index(node.arg)] != tb.shape[xb.index(node.arg)]
            or ta.shape[xa.index(node.arg)] == 1):
        return lambda values: _contract(node, *values, sizes)
    fa = [x for x in xa if x != node.arg]
    fb = [x for x in xb if x != node.arg]
    pa = [xa.index(x) for x in (*fa, node.arg)]
    pb = [xb.index(x) for x in (node.arg, *fb)]
    inner = ta.shape[xa.index(node.arg)]
    rows = 1
    for x in fa:
        rows *= ta.shape[xa.index(x)]
    cols = 1
    for x in fb:
        cols *= tb.shape[xb.index(x)]
    shape = [ta.shape[xa.index(x)] for x in fa] + [tb.shape[xb.index(x)] for x in fb]
    axes = (*fa, *fb)

    def run(values):
        (ta, _), (tb, _) = values
        product = ta.permute(*pa).reshape(rows, inner) @ tb.permute(*pb).reshape(inner, cols)
        return product.reshape(shape), axes
    return run


def _at(value, t: int, time: str):
    """`value` at step `t` (itself where it is the same at every step)."""
    tensor, axes = value
    if time not in axes:
        return value
    i = axes.index(time)
    return tensor.select(i, t if tensor.shape[i] != 1 else 0), axes[:i] + axes[i + 1:]


def _contract(node: Node, a, b, sizes: dict[str, int]):
    """``SUM over node.arg of a * b`` as one einsum over the values' named dims (size-1 dims broadcast;
    an axis summed where both are constant along it counts its size)."""
    import torch

    (ta, xa), (tb, xb) = a, b
    names = list(dict.fromkeys((*xa, *xb)))
    letters = {x: chr(ord("a") + i) for i, x in enumerate(names)}
    out = tuple(x for x in names if x != node.arg)
    spec = f"{''.join(letters[x] for x in xa)},{''.join(letters[x] for x in xb)}->{''.join(letters[x] for x in out)}"
    result = torch.einsum(spec, ta, tb)
    axis = node.arg
    if (axis not in xa or ta.shape[xa.index(axis)] == 1) and (axis not in xb or tb.shape[xb.index(axis)] == 1):
        result = result * float(sizes[axis])
    return result, out


# steps from which a signature's loop is captured as a CUDA graph (shorter loops launch little)
GRAPH_STEPS = 8
# signatures a step loop keeps captured (each holds its inputs, outputs and intermediates on the GPU)
GRAPH_SIGNATURES = 4


class CapturedLoop:
    """A step loop's whole call as one CUDA graph, for the calls of one signature (shapes, dtypes,
    strides, device): the call's tensors copied into the graph's inputs, one replay, its outputs cloned
    (the next replay writes over them)."""

    def __init__(self, graph, inputs: tuple[dict, dict, dict], result):
        self.graph, self.inputs, self.result = graph, inputs, result

    @classmethod
    def capture(cls, loop, seqs: dict, params: dict, initial: dict) -> CapturedLoop | None:
        """`loop(seqs, params, initial)` captured on copies of the given tensors; None where capture
        fails (an op the graph cannot hold): the caller runs op by op."""
        import torch

        inputs = tuple({n: t.clone() for n, t in group.items()} for group in (seqs, params, initial))
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # a warm-up call first: cuBLAS's workspace, lazy inits
                loop(*inputs)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                result = loop(*inputs)
        except RuntimeError:
            return None
        return cls(graph, inputs, result)

    def __call__(self, seqs: dict, params: dict, initial: dict):
        for given, static in zip((seqs, params, initial), self.inputs):
            for name, t in static.items():
                t.copy_(given[name])
        self.graph.replay()
        outs, finals = self.result
        return {n: t.clone() for n, t in outs.items()}, {n: t.clone() for n, t in finals.items()}


def _signature(tensors: dict) -> tuple:
    return tuple((n, tuple(t.shape), t.dtype, t.stride()) for n, t in tensors.items())


def _forget_oldest(graphs: dict) -> None:
    """Keep the newest GRAPH_SIGNATURES captured loops and the newest 16 x as many signatures seen
    (dicts keep insertion order)."""
    captured = [k for k, v in graphs.items() if v]
    for k in captured[:max(0, len(captured) - GRAPH_SIGNATURES)]:
        del graphs[k]
    for k in list(graphs)[:max(0, len(graphs) - 16 * GRAPH_SIGNATURES)]:
        del graphs[k]

_LOOPS: dict[tuple, StepLoop | None] = {}


def step_loop(program, compute: str = "float32") -> StepLoop | None:
    """The step loop of `program` where it applies (`applies`) and SSMC_CUDA_STEP_LOOP is not 0; where
    its program fits the persistent kernel (kernels/persistent/, SSMC_CUDA_PERSISTENT=0: off), that
    kernel's runner, with this loop as its fallback."""
    if options().step_loop is False:
        return None
    key = (program, compute)
    if key not in _LOOPS:
        _LOOPS[key] = StepLoop(program, compute) if applies(program) else None
    from .persistent.runner import persistent_loop  # here: the persistent package imports this module

    return persistent_loop(program, compute, _LOOPS[key])

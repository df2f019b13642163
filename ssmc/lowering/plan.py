"""Lowering a recurrence to loop nests: the "sequential in time" strategies every backend shares.

A program is split into independent recurrences along its *independent axes*: the axes every
state and output has and no op reduces, renames, unbinds or splits (Mamba-1's ``b d``; an LSTM's
``b``). One kernel then runs, as a plain loop:

    for p in parallel(product of independent axes):        # prange / one CUDA thread each
        setup: load the carry of p; compute what depends on params only
        for t in range(L):                                  # reversed for adjoints
            step: per-step loop nests over the other axes, one per materialised value
        finish: store the final carry of p

When nothing is independent (an adjoint whose param-gradient accumulators sum over the batch),
the program is *split*: a **core** kernel runs the states that feed back (parallel over the core's
independent axes) and writes each carry before its step; an **epilogue** kernel then computes the
outputs and the accumulators (sums over time) from those carries, parallel over blocks of time
(each block sums privately; the blocks are added afterwards).

Inside a step, elementwise regions are inlined into one expression per materialised value. A value
is materialised when it is a root (update, output), a reduction, used twice, or used inside a loop
over an axis it does not have (so it is not recomputed there); values that depend on params only
are computed once per `p`, before the time loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..ir import build
from ..ir.node import BOOL, Node, toposort
from ..ir.ops import ELEMENTWISE, LEAVES, Op
from ..ir.program import Decl, Recurrence, Role
from ..passes.classify import classify
from .loops import Assign, Bin, Buffer, Call, InRange, Load, Loop, Num, Select, Var

_VIEWS = {Op.RENAME, Op.SELECT, Op.SLICE, Op.PAD, Op.EXPAND}
_BINOPS = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.DIV: "/", Op.LT: "<", Op.LE: "<=", Op.GT: ">",
           Op.GE: ">=", Op.EQ: "==", Op.NE: "!=", Op.AND: "and", Op.OR: "or"}
_CALLS = {Op.NEG: "neg", Op.EXP: "exp", Op.LOG: "log", Op.SQRT: "sqrt", Op.RSQRT: "rsqrt", Op.ABS: "abs",
          Op.SIGMOID: "sigmoid", Op.TANH: "tanh", Op.SOFTPLUS: "softplus", Op.SILU: "silu", Op.GELU: "gelu",
          Op.RELU: "relu", Op.ERF: "erf", Op.NOT: "not", Op.MAX: "max", Op.MIN: "min", Op.POW: "pow"}


def size_var(axis: str) -> str:
    return f"n_{axis}"


def touched_axes(node: Node) -> set[str]:
    """Axes `node` reduces, renames, unbinds or splits: along those, values mix across indices."""
    if node.op in (Op.SUM, Op.REDUCE_MAX):
        return {node.arg}
    if node.op is Op.RENAME:
        return {a for pair in node.arg for a in pair}
    if node.op is Op.SELECT:
        return {node.arg[0]}
    if node.op in (Op.SLICE, Op.PAD):
        return {node.arg[0], node.arg[1]}
    return set()


def independent_axes(program: Recurrence) -> tuple[str, ...]:
    """Axes along which `program` is a family of independent recurrences (see module docstring)."""
    roots = program.roots
    if not roots:
        return ()
    common = [a for a in roots[0].axes]
    for r in roots[1:]:
        common = [a for a in common if a in r.axes]
    for s in program.states:
        common = [a for a in common if a in s.axes]
    for n in toposort(roots):
        touched = touched_axes(n)
        common = [a for a in common if a not in touched]
    order = program.states[0].axes if program.states else roots[0].axes
    return tuple(a for a in order if a in common)


@dataclass
class Array:
    """An array a kernel reads or writes: its name, what it is, and its axes ("t" for time)."""

    name: str
    role: str          # seq | param | init | final | out | prev
    axes: tuple[str, ...]


@dataclass
class Kernel:
    """One loop-nest kernel (module docstring): parallel over `parallel`, time inside."""

    name: str
    program: Recurrence
    parallel: tuple[str, ...]
    time_blocks: bool = False         # also parallel over blocks of time (states are sums over time)
    blocked_init: bool = False        # with time_blocks: each block starts from its own carry init[blk]
    sum_over_time: bool = False       # with time_blocks: states are plain sums over time (any steps, any order)
    store_prev: tuple[str, ...] = ()  # states written out before each step ("prev_<name>")
    arrays: list[Array] = field(default_factory=list)
    setup: list = field(default_factory=list)
    step: list = field(default_factory=list)
    finish: list = field(default_factory=list)
    sizes: tuple[str, ...] = ()       # axes whose sizes the kernel takes

    @property
    def reverse(self) -> bool:
        return self.program.reverse


@dataclass
class Lowered:
    """The kernels for a program and how they connect: one fused kernel, or a core and an epilogue."""

    program: Recurrence
    strategy: str                     # "fused" | "split" | "map" (no states: per-output kernels)
    kernels: list[Kernel]
    core_states: tuple[str, ...] = ()
    accumulators: tuple[str, ...] = ()
    # accumulators that are sums of an output (map/reduce only): (accumulator, output, axes summed
    # besides time); the runner sums the output instead of launching a kernel (`_sums_of_outputs`)
    from_outputs: tuple[tuple[str, str, tuple[str, ...]], ...] = ()
    reason: str = ""                  # why this strategy (`ssmc inspect` prints it)

    def describe(self) -> str:
        lines = [f"strategy: {self.strategy}"]
        for k in self.kernels:
            par = " ".join(k.parallel) or "-"
            tb = " + blocks of time" if k.time_blocks else ""
            lines.append(f"  kernel {k.name}: parallel over [{par}]{tb}, time {'reversed' if k.reverse else 'forward'}")
        return "\n".join(lines)


# -- the step builder ------------------------------------------------------------------------------


class StepBuilder:
    """Loop nests for one kernel: which values are materialised, and the code computing each."""

    def __init__(self, kernel: Kernel, prefix: str = ""):
        self.k = kernel
        p = kernel.program
        self.parallel = set(kernel.parallel)
        self.roles = {d.name: d.role for d in p.decls}
        self.nodes = toposort(p.roots)
        self.users: dict[Node, list[Node]] = {n: [] for n in self.nodes}
        for n in self.nodes:
            for a in n.args:
                if n not in self.users[a]:
                    self.users[a].append(n)
        self.invariant = self._invariant()
        self.names: dict[Node, str] = {}
        for s, u in zip(p.states, p.updates):
            self.names.setdefault(u, f"{prefix}nx_{s.name}")
        self.prefix = prefix
        self.state_of = {u: s for s, u in zip(p.states, p.updates)}
        self.materialised = self._choose()
        self.materialised_set = set(self.materialised)
        self.sum_groups = self._sum_groups()
        self.lets = self._lets()

    def _invariant(self) -> set[Node]:
        """Nodes that depend on params only (computed once per parallel index, before time)."""
        timed = {d.name for d in self.k.program.decls if d.role in (Role.SEQ, Role.STATE)}
        out = set()
        for n in self.nodes:
            if n.op is Op.INPUT:
                if n.arg not in timed:
                    out.add(n)
            elif n.op is Op.IOTA:
                out.add(n)  # depends on its axis index only
            elif all(a in out for a in n.args):
                out.add(n)
        return out

    def local(self, node: Node) -> tuple[str, ...]:
        return tuple(a for a in node.axes if a not in self.parallel)

    def _choose(self) -> list[Node]:
        roots = set(self.k.program.roots)
        # a map kernel (no states, one step per block of time) computes an output where it stores it:
        # no buffer as long as the output's local axes (a norm's whole row) between the two
        kept_roots = set() if self.k.time_blocks and not self.k.program.states else roots
        chosen: list[Node] = []
        carried_over = self._carried_over()
        for n in self.nodes:
            if n in carried_over:
                chosen.append(n)
                continue
            if n.op in LEAVES or (n.op in _VIEWS and n not in kept_roots):
                continue
            keep = n in kept_roots or n.op in (Op.SUM, Op.REDUCE_MAX)
            if n.op is Op.SUM and n not in roots and self._summed_again(n):
                keep = False  # fused into its consumer's accumulation loop (`sum_chain`)
            if not keep and n.op in ELEMENTWISE:
                consumers = self.users[n]
                keep = len(consumers) > 1 or any(set(self._loop_axes(c)) - set(self.local(n)) for c in consumers)
                if n in self.invariant and any(c not in self.invariant for c in consumers):
                    keep = True  # hoist out of the time loop
            if keep:
                chosen.append(n)
        taken = {d.name for d in self.k.program.decls}  # a user's sequence `m0` is not a temporary
        for i, n in enumerate(chosen):
            name = f"{self.prefix}m{i}"
            while name in taken:
                name += "_"
            self.names.setdefault(n, name)
        return chosen

    def _carried_over(self) -> set[Node]:
        """Updates that are another state's old value (``return (b, a), ...``; a shift register).

        The step assigns the new carries one state after another, so every update must be computed
        from the old carries before the first assignment: an update that is any other expression is
        materialised in the step (a root is), but a leaf would be read at the assignment, where an
        earlier state's may already have been overwritten. These leaves are copied in the step too.
        """
        return {u for s, u in zip(self.k.program.states, self.k.program.updates)
                if u.op is Op.INPUT and self.roles.get(u.arg) is Role.STATE and u.arg != s.name}

    def _lets(self) -> dict[Node, list[Node]]:
        """Values used twice inside one sum's loop body only, made scalars of that body: {sum: lets}.

        ``sum_d f(s[d]) * g(s[d])`` with ``s = softplus(delta[d])``: instead of a buffer ``s[n_d]``
        filled by its own loop, ``s`` is computed once per iteration of the sum's loop (a buffer as
        long as a reduced axis is local memory on a GPU). Consumers first, so a let's operands
        can become lets of the same sum.
        """
        lets: dict[Node, list[Node]] = {}
        sums = [n for n in self.materialised if n.op in (Op.SUM, Op.REDUCE_MAX)
                and self.sum_groups.get(n, (n,))[-1] is n]  # a group of sums: its last one owns the loop
        for n in reversed(list(self.materialised)):
            if n.op not in ELEMENTWISE or n in self.state_of or n in self.invariant or n in self.k.program.roots:
                continue
            if len(self.users[n]) < 2 or any(set(self._loop_axes(c)) - set(self.local(n)) for c in self.users[n]):
                continue
            self.materialised_set.discard(n)  # as if inlined, to find the region it falls in
            owner = next((s for s in sums if set(self.users[n]) <= self._group_region(s)), None)
            # a let is one scalar an iteration: it may not have an axis the body's loops do not run
            # over (an unbind's SELECTs read a pre-activation z[g, k] at several g in one iteration)
            if owner is None or set(self.local(n)) - set(self.local(self.sum_chain(owner))) \
                    or not self._confined(n, owner):
                self.materialised_set.add(n)
                continue
            lets.setdefault(owner, []).insert(0, n)
        self.materialised = [n for n in self.materialised if n in self.materialised_set]
        return lets

    def _confined(self, node: Node, owner: Node) -> bool:
        """Is every use of `node` inlined into `owner`'s loop body only? A value of that body that
        reads it and is also a root (stored by its own loop) or read from outside the body would
        read the let's stale last value there."""
        region = self._group_region(owner)
        inside = set(region)
        for s in self.sum_groups.get(owner, (owner,)):  # the sums themselves, and unmaterialised ones below
            x = s
            while x.op is Op.SUM and (x is s or x not in self.materialised_set):
                inside.add(x)
                x = x.args[0]
        roots = set(self.k.program.roots)
        reading = {node}
        for m in self.nodes:
            if m in region and m not in reading and any(a in reading for a in m.args):
                reading.add(m)
        return not any(m in roots or any(u not in inside for u in self.users[m])
                       for m in reading if m is not node)

    def _accumulates(self, node: Node) -> bool:
        """A SUM computed by zeroing its buffer and adding in a nest over its operand's axes."""
        return node.op is Op.SUM and bool(self.layout(node) or node.args[0] is not self.sum_chain(node))

    def _sum_groups(self) -> dict[Node, tuple[Node, ...]]:
        """Sums that add into buffers of one layout in one nest over the same axes, none reading
        another (``m2[b] = sum_n m1[b,n] B[b,n]`` and ``m5[b] = sum_n m1[b,n] h[b,n]``), accumulated
        together in one loop nest at the place of the last one (so ``m1`` can be a let of that loop):
        {member: group}. Nothing materialised between the members may read them."""
        order = {n: i for i, n in enumerate(self.materialised)}
        groups: list[list[Node]] = []
        for n in self.materialised:
            if not self._accumulates(n) or n in self.state_of:
                continue
            key = (self.sum_chain(n).axes, self.layout(n), n in self.invariant)
            for g in groups:
                head = g[0]
                if (self.sum_chain(head).axes, self.layout(head), head in self.invariant) != key:
                    continue
                between = self.materialised[order[g[0]] + 1:order[n] + 1]
                if not any(m in toposort([b]) for m in g for b in between):
                    g.append(n)
                    break
            else:
                groups.append([n])
        return {n: tuple(g) for g in groups if len(g) > 1 for n in g}

    def _group_region(self, node: Node) -> set[Node]:
        """The nodes inlined into the loop body `node` (a SUM, the last of its group) owns."""
        return set().union(*(self._region(m) for m in self.sum_groups.get(node, (node,))))

    def _region(self, node: Node) -> set[Node]:
        """The nodes inlined into the loop body of a SUM (elementwise ops reached without crossing a
        materialised value or a view that changes indices)."""
        seen: set[Node] = set()
        x = self.sum_chain(node)
        if x in self.materialised_set:
            return seen  # the loop reads x's buffer; nothing is inlined into it
        stack = [x]
        while stack:
            m = stack.pop()
            if m in seen:
                continue
            seen.add(m)
            if m.op in ELEMENTWISE or m.op is Op.EXPAND:
                stack += [a for a in m.args if a not in self.materialised_set]
        return seen

    def body(self, node: Node, env: dict[str, str], stmts: list) -> list:
        """`stmts` of a SUM's loop body, after the lets of that sum (scalars computed per iteration)."""
        lets = self.lets.get(node, ())
        return [Assign(Var(self.names[n]), self.expr(n, env, inline_root=True)) for n in lets] + stmts

    def _summed_again(self, node: Node) -> bool:
        """A sum whose only consumer is another sum (``sum_k sum_g x``): one loop nest does both."""
        users = self.users[node]
        return len(users) == 1 and users[0].op is Op.SUM

    def sum_chain(self, node: Node) -> Node:
        """The operand under a SUM and the unmaterialised SUMs directly below it."""
        x = node.args[0]
        while x.op is Op.SUM and x not in self.materialised_set:
            x = x.args[0]
        return x

    def _loop_axes(self, node: Node) -> tuple[str, ...]:
        """Local axes a consumer loops over while it reads its operands."""
        if node.op is Op.SUM:
            x = node.args[0]
            while x.op is Op.SUM and self._summed_again(x) and x not in self.k.program.roots:
                x = x.args[0]
            return self.local(x)
        if node.op is Op.REDUCE_MAX:
            return self.local(node.args[0])
        if node.op in _VIEWS:  # views are inlined: their consumers' loops are what count
            users = self.users.get(node, [])
            return tuple({a for c in users for a in self._loop_axes(c)}) if users else self.local(node)
        return self.local(node)

    # -- expressions ---------------------------------------------------------------------------
    def layout(self, node: Node) -> tuple[str, ...]:
        """The axes of a materialised node's buffer, in order (an update's: its state's order)."""
        if node in self.state_of:
            return self.local_of_state(self.state_of[node])
        return self.local(node)

    def ref(self, node: Node, env: dict[str, str]):
        """The value of a materialised node or a leaf at the indices `env` (axis -> index expr)."""
        name = self.names[node]
        idx = tuple(env[a] for a in self.layout(node))
        return Load(name, idx) if idx else Var(name)

    def leaf(self, node: Node, env: dict[str, str]):
        role = self.roles[node.arg]
        full = tuple(env[a] for a in node.axes)
        if role is Role.STATE:
            idx = tuple(env[a] for a in self.local(node))
            return Load(f"st_{node.arg}", idx) if idx else Var(f"st_{node.arg}")
        if role is Role.SEQ:
            return Load(node.arg, ("t", *full))
        return Load(node.arg, full) if full else Load(node.arg, ("0",))

    def expr(self, node: Node, env: dict[str, str], inline_root: bool = False):
        if node in self.names and not inline_root:
            if node in self.materialised_set:
                return self.ref(node, env)
            if any(node in ls for ls in self.lets.values()):
                return Var(self.names[node])
        op = node.op
        if op is Op.INPUT:
            return self.leaf(node, env)
        if op is Op.CONST:
            return Num(node.arg)
        if op is Op.IOTA:
            return Var(env[node.arg])
        if op is Op.SIZE:
            return Var(size_var(node.arg))
        if op is Op.WHERE:
            c, a, b = (self.expr(x, env) for x in node.args)
            return Select(c, a, b)
        if op in _BINOPS:
            return Bin(_BINOPS[op], self.expr(node.args[0], env), self.expr(node.args[1], env))
        if op in _CALLS:
            return Call(_CALLS[op], tuple(self.expr(a, env) for a in node.args))
        (x,) = node.args
        if op is Op.EXPAND:
            return self.expr(x, env)
        if op is Op.RENAME:  # the operand's axis `old` is indexed like this node's axis `new`
            forward = dict(node.arg)
            return self.expr(x, {**self.env_for(()), **{a: env[forward.get(a, a)] for a in x.axes}})
        if op is Op.SELECT:
            axis, index = node.arg
            return self.expr(x, {**env, axis: str(index)})
        if op is Op.SLICE:
            axis, new, parts, i = node.arg
            return self.expr(x, {**env, axis: f"({env[new]} + {_offset(parts, i)})"})
        if op is Op.PAD:
            axis, new, parts, i = node.arg
            off = _offset(parts, i)
            inner = self.expr(x, {**env, new: f"({env[axis]} - {off})"})
            return Select(InRange(env[axis], off, f"{off} + {size_var(new)}"), inner, Num(0.0))
        raise NotImplementedError(f"lowering: {op}")  # reductions are always materialised

    # -- statements ----------------------------------------------------------------------------
    def env_for(self, axes) -> dict[str, str]:
        env = {a: f"p_{a}" for a in self.parallel}
        env.update({a: f"i_{a}" for a in axes if a not in self.parallel})
        return env

    def nest(self, axes: tuple[str, ...], body: list) -> list:
        """Loops over the local `axes` (outermost first) around `body`."""
        for a in reversed([a for a in axes if a not in self.parallel]):
            body = [Loop(f"i_{a}", size_var(a), body)]
        return body

    def compute(self, node: Node) -> list:
        """Statements computing a materialised node into its buffer (or scalar)."""
        env = self.env_for(node.axes)
        name = self.names[node]
        local = self.layout(node)
        target = Load(name, tuple(env[a] for a in local)) if local else Var(name)
        if self._accumulates(node):
            # zero, then accumulate in the operand's axis order: the innermost loop runs along
            # the operand's last axis (contiguous in its inputs), not along the reduced one;
            # nested sums (sum_k sum_g x) accumulate in one nest over x's axes; a group of sums
            # (`_sum_groups`) in one nest, where its last member is computed
            group = self.sum_groups.get(node, (node,))
            if node is not group[-1]:
                return []
            arg_env = self.env_for(self.sum_chain(node).axes)
            zero, accumulate = [], []
            for m in group:
                env_m, local_m = self.env_for(m.axes), self.layout(m)
                target_m = Load(self.names[m], tuple(env_m[a] for a in local_m)) if local_m else Var(self.names[m])
                zero += self.nest(local_m, [Assign(target_m, Num(0.0))])
                acc = Load(self.names[m], tuple(arg_env[a] for a in local_m)) if local_m else Var(self.names[m])
                accumulate.append(Assign(acc, self.expr(self.sum_chain(m), arg_env), "+="))
            return zero + self.nest(self.sum_chain(node).axes, self.body(node, arg_env, accumulate))
        if node.op in (Op.SUM, Op.REDUCE_MAX):
            (x,) = node.args
            axis = node.arg
            inner_env = {**env, axis: f"i_{axis}"} if axis not in self.parallel else env
            acc = Var(f"acc_{name}")
            init = Num(0.0) if node.op is Op.SUM else Num(float("-inf"))
            body = [Assign(acc, init),
                    Loop(f"i_{axis}", size_var(axis), self.body(node, inner_env, [Assign(
                        acc, self.expr(x, inner_env), "+=" if node.op is Op.SUM else "max=")])),
                    Assign(target, acc)]
            return self.nest(local, body)
        value = self.expr(node, env, inline_root=True)
        if node.dtype == BOOL:
            value = Select(value, Num(1.0), Num(0.0))
        return self.nest(local, [Assign(target, value)])

    def buffers(self) -> list:
        out = []
        for n in self.materialised:
            local = self.layout(n)
            if local:
                out.append(Buffer(self.names[n], tuple(size_var(a) for a in local)))
        return out

    def local_of_state(self, s: Decl) -> tuple[str, ...]:
        return tuple(a for a in s.axes if a not in self.parallel)


def _offset(parts, i) -> str:
    return " + ".join(size_var(p) for p in parts[:i]) or "0"


# -- kernels ---------------------------------------------------------------------------------------


def build_kernel(name: str, program: Recurrence, parallel: tuple[str, ...], time_blocks: bool = False,
                 store_prev: tuple[str, ...] = (), blocked_init: bool = False, prefix: str = "",
                 load_init: bool = True) -> Kernel:
    """A scan kernel for `program` (module docstring), its loop nests filled in.

    With `time_blocks` the kernel is also parallel over blocks of time; each block starts from
    zero (sums over time), or from its own carry ``init_<state>[blk]`` when `blocked_init`.
    `prefix` starts the names of its scratch values (two kernels' steps can then share one body);
    without `load_init` the setup leaves the carry unset (whoever splices the step sets it).
    """
    k = Kernel(name, program, parallel, time_blocks=time_blocks, blocked_init=blocked_init, store_prev=store_prev)
    b = StepBuilder(k, prefix)
    axes_used = set()
    for n in b.nodes:
        axes_used.update(n.axes)
        if n.op in (Op.SLICE, Op.PAD):
            axes_used.update(n.arg[2])
            axes_used.add(n.arg[0])
        if n.op is Op.SIZE:  # a mean over an axis the kernel's arrays may no longer have
            axes_used.add(n.arg)
    for d in program.decls:
        axes_used.update(d.axes)
    k.sizes = tuple(sorted(axes_used))
    k.arrays = [Array(d.name, "seq", ("t", *d.axes)) for d in program.seqs]
    k.arrays += [Array(d.name, "param", d.axes) for d in program.params]
    k.arrays += [Array(f"init_{s.name}", "init", (("block",) if blocked_init else ()) + s.axes)
                 for s in program.states]
    k.arrays += [Array(f"final_{s.name}", "final", (("block",) if time_blocks else ()) + s.axes)
                 for s in program.states]
    k.arrays += [Array(f"out_{n}", "out", ("t", *y.axes)) for n, y in program.outputs]
    k.arrays += [Array(f"prev_{s}", "prev", ("t", *program.decl(s).axes)) for s in store_prev]

    # setup: state buffers, scratch buffers, the carry loaded (or zeroed for time blocks), invariants
    setup: list = []
    for s in program.states:
        local = b.local_of_state(s)
        if local:
            setup.append(Buffer(f"st_{s.name}", tuple(size_var(a) for a in local)))
    setup += b.buffers()
    for s in program.states if load_init else ():
        env = b.env_for(s.axes)
        local = b.local_of_state(s)
        target = Load(f"st_{s.name}", tuple(env[a] for a in local)) if local else Var(f"st_{s.name}")
        if blocked_init:
            value = Load(f"init_{s.name}", ("blk", *(env[a] for a in s.axes)))
        elif time_blocks:
            value = Num(0.0)
        else:
            value = Load(f"init_{s.name}", tuple(env[a] for a in s.axes) or ("0",))
        setup += b.nest(s.axes, [Assign(target, value)])
    step: list = []
    for n in b.materialised:
        stmts = b.compute(n)
        (setup if n in b.invariant else step).extend(stmts)

    # outputs, the previous carry (before the update is applied), then the carry update
    outs: list = []
    for out_name, y in program.outputs:
        env = b.env_for(y.axes)
        value = b.expr(y, env)
        if y.dtype == BOOL:
            value = Select(value, Num(1.0), Num(0.0))
        outs += b.nest(y.axes, [Assign(Load(f"out_{out_name}", ("t", *(env[a] for a in y.axes))), value)])
    prev: list = []
    for s_name in store_prev:
        s = program.decl(s_name)
        env = b.env_for(s.axes)
        local = b.local_of_state(s)
        cur = Load(f"st_{s_name}", tuple(env[a] for a in local)) if local else Var(f"st_{s_name}")
        prev += b.nest(s.axes, [Assign(Load(f"prev_{s_name}", ("t", *(env[a] for a in s.axes))), cur)])
    swap: list = []
    for s, u in zip(program.states, program.updates):
        env = b.env_for(s.axes)
        local = b.local_of_state(s)
        idx = tuple(env[a] for a in local)
        cur = Load(f"st_{s.name}", idx) if local else Var(f"st_{s.name}")
        swap += b.nest(s.axes, [Assign(cur, b.ref(u, env) if u in b.materialised_set else b.expr(u, env))])
    k.setup = setup
    k.step = prev + step + outs + swap
    finish: list = []
    for s in program.states:
        env = b.env_for(s.axes)
        local = b.local_of_state(s)
        cur = Load(f"st_{s.name}", tuple(env[a] for a in local)) if local else Var(f"st_{s.name}")
        idx = (("blk",) if time_blocks else ()) + tuple(env[a] for a in s.axes)
        finish += b.nest(s.axes, [Assign(Load(f"final_{s.name}", idx or ("0",)), cur)])
    k.finish = finish
    return k


def lower(program: Recurrence, map_reduce: bool = False) -> Lowered:
    """Choose the strategy for `program` and build its kernels (module docstring).

    `map_reduce` splits a split program's epilogue into one kernel per output and per accumulator,
    each parallel over that root's own independent axes (and blocks of time), instead of one kernel
    that computes a whole step per block: what a GPU needs, where a step's buffers are too big for
    one thread. A program without states then becomes such "map" kernels alone, one per output, and
    one whose states are all accumulators is split (an epilogue without a core) even where it has
    independent axes.
    """
    if not program.states and map_reduce:  # nothing carried: every step is a map, parallel over time too
        kernels = [build_kernel(p.name, p, independent_axes(p), time_blocks=True) for p in _per_root(program)]
        return Lowered(program, "map", kernels, reason="no states: every step a map, parallel over time too")
    parallel = independent_axes(program)
    if not program.states:
        return Lowered(program, "fused", [build_kernel(f"{program.name}_fused", program, parallel)],
                       reason=f"no states: independent along [{' '.join(parallel)}]")
    classes = {c.state: c for c in classify(program).states}
    acc = tuple(s.name for s in program.states if classes[s.name].family == "accumulator")
    core_states = tuple(s.name for s in program.states if s.name not in acc)
    # on a GPU, split where the fused kernel would leave parallelism unused: sums over time alone
    # (the adjoint of a state-free stage: map kernels over blocks of time beat a thread per
    # recurrence walking every step), or a core independent along axes that the accumulators or
    # (in an adjoint no diagonal scan runs) the outputs sum over: fused, each thread would walk whole
    # states (Mamba-2's b p n, through local memory). Forwards and diagonal adjoints keep their fused
    # kernel, whose scans split such axes among lanes or blocks of time instead.
    spread = map_reduce and (acc or (program.reverse and not _scans(program))) and (
        not core_states or _core_spreads_wider(program, core_states, parallel))
    if parallel and not spread:
        return Lowered(program, "fused", [build_kernel(f"{program.name}_fused", program, parallel)],
                       reason=f"independent along [{' '.join(parallel)}]")
    kernels = []
    if core_states:
        core = _subprogram(program, f"{program.name}_core", core_states, ())
        kernels.append(build_kernel(core.name, core, independent_axes(core), store_prev=core_states))
    epilogue = _epilogue(program, core_states, acc, classes)
    from_outputs = _sums_of_outputs(program, acc, classes) if map_reduce else ()
    parts = _per_root(epilogue, skip={s for s, _, _ in from_outputs}) if map_reduce else [epilogue]
    for e in parts:
        k = build_kernel(e.name, e, independent_axes(e) if map_reduce else (), time_blocks=True)
        k.sum_over_time = True  # the epilogue's states are accumulators: blocks may take any steps
        kernels.append(k)
    if not parallel:
        reason = "no axis along which every state and output is independent"
    elif not core_states:
        reason = "every state a sum over time: map kernels over blocks of time"
    else:
        sums = f"the sums over time ({', '.join(acc)})" if acc else "the outputs"
        reason = (f"{sums} reduce axes the core's states are independent along: a core over "
                  f"[{' '.join(independent_axes(kernels[0].program))}], then the rest over blocks of time")
    return Lowered(program, "split", kernels, core_states, acc, from_outputs, reason)


def _scans(program: Recurrence) -> bool:
    """Does a time-parallel diagonal scan (time_blocks.py) apply to `program`?"""
    from .time_blocks import time_blocks  # it builds on this module's kernels

    return time_blocks(program) is not None


def _core_spreads_wider(program: Recurrence, core_states: tuple[str, ...], parallel: tuple[str, ...]) -> bool:
    """Is the core (the states that feed back) independent along an axis the whole program is not?"""
    core = _subprogram(program, f"{program.name}_core", core_states, ())
    return bool(set(independent_axes(core)) - set(parallel))


def _sums_of_outputs(program: Recurrence, acc, classes) -> tuple[tuple[str, str, tuple[str, ...]], ...]:
    """Accumulators whose increment is an output summed over some of its axes: an adjoint's
    ``grad_bias += sum_b grad_x`` where x + bias was used (Mamba-1's delta_bias). Summing the
    written output afterwards reads it once; a kernel of its own would compute it all again."""
    found = []
    for s in acc:
        node, summed = classes[s].b, []
        while node.op is Op.SUM:
            summed.append(node.arg)
            node = node.args[0]
        for name, y in program.outputs:
            if y is node and set(y.axes) - set(summed) == set(program.decl(s).axes):
                found.append((s, name, tuple(summed)))
                break
    return tuple(found)


def sum_of_output(program: Recurrence, acc: str, output: str, summed: tuple[str, ...]):
    """For an entry of `Lowered.from_outputs`: the dims of the output's array ([t, *axes]) to sum,
    and the permutation that puts what is left in the accumulator's axis order."""
    order = ("t", *dict(program.outputs)[output].axes)
    left = [a for a in order if a not in ("t", *summed)]
    return tuple(order.index(a) for a in ("t", *summed)), tuple(left.index(a) for a in program.decl(acc).axes)


def _subprogram(program: Recurrence, name: str, states: tuple[str, ...], outputs) -> Recurrence:
    """`program` restricted to some of its states and outputs (and the inputs those read)."""
    updates = tuple(u for s, u in zip(program.states, program.updates) if s.name in states)
    return program.with_roots(updates, outputs, states=states, name=name)


def _epilogue(program: Recurrence, core_states, acc, classes) -> Recurrence:
    """Outputs and accumulators, with the core's carries (before each step) as sequences."""
    updates = tuple(build.add(Node.make(Op.INPUT, (), s, program.decl(s).axes), classes[s].b) for s in acc)
    updates = tuple(build.expand(u, program.decl(s).axes) for u, s in zip(updates, acc))
    roots = updates + tuple(y for _, y in program.outputs)
    used = {n.arg for n in toposort(roots) if n.op is Op.INPUT}
    decls = []
    for d in program.decls:
        if d.role is Role.STATE and d.name in acc:
            decls.append(d)
        elif d.role is Role.STATE and d.name in core_states and d.name in used:
            decls.append(Decl(d.name, Role.SEQ, d.axes, d.loc))
        elif d.role is not Role.STATE and d.name in used:
            decls.append(d)
    return Recurrence(name=f"{program.name}_epilogue", decls=tuple(decls), updates=updates,
                      outputs=program.outputs, sizes=program.sizes, reverse=program.reverse, loc=program.loc)


def _per_root(epilogue: Recurrence, skip=frozenset()) -> list[Recurrence]:
    """The epilogue as one program per accumulator (but those in `skip`) and per output (each reads
    only what it uses)."""
    parts = [_subprogram(epilogue, f"{epilogue.name}_{s.name}", (s.name,), ())
             for s in epilogue.states if s.name not in skip]
    parts += [_subprogram(epilogue, f"{epilogue.name}_{name}", (), ((name, y),)) for name, y in epilogue.outputs]
    return parts

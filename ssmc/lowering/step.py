"""One step of a recurrence as loop nests: the values a step materialises (roots, reductions,
values used twice or inside a loop over an axis they lack), each inlined into one expression per
materialised value and assigned in an order that reads every old carry before the first new one is
written (`StepBuilder`); `plan.build_kernel` wraps a step into a kernel."""

from __future__ import annotations

from ..ir.node import BOOL, Node, toposort
from ..ir.ops import ELEMENTWISE, LEAVES, Op
from ..ir.program import Decl, Role
from .kernel import Kernel
from .loops import Assign, Bin, Buffer, Call, InRange, Load, Loop, Num, Select, Var

_VIEWS = {Op.RENAME, Op.SELECT, Op.SLICE, Op.PAD, Op.EXPAND}
# the IR ops printed as C operators and as ssmc_math.cuh's functions (the persistent kernel's cell too)
BINOPS = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.DIV: "/", Op.LT: "<", Op.LE: "<=", Op.GT: ">",
          Op.GE: ">=", Op.EQ: "==", Op.NE: "!=", Op.AND: "and", Op.OR: "or"}
CALLS = {Op.NEG: "neg", Op.EXP: "exp", Op.LOG: "log", Op.SQRT: "sqrt", Op.RSQRT: "rsqrt", Op.ABS: "abs",
         Op.SIGMOID: "sigmoid", Op.TANH: "tanh", Op.SOFTPLUS: "softplus", Op.SILU: "silu", Op.GELU: "gelu",
         Op.RELU: "relu", Op.ERF: "erf", Op.SIN: "sin", Op.COS: "cos", Op.TAN: "tan", Op.LOG1P: "log1p",
         Op.EXPM1: "expm1", Op.SIGN: "sign", Op.ATAN2: "atan2", Op.NOT: "not", Op.MAX: "max", Op.MIN: "min",
         Op.POW: "pow"}


def size_var(axis: str) -> str:
    return f"n_{axis}"



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
        if op in BINOPS:
            return Bin(BINOPS[op], self.expr(node.args[0], env), self.expr(node.args[1], env))
        if op in CALLS:
            return Call(CALLS[op], tuple(self.expr(a, env) for a in node.args))
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



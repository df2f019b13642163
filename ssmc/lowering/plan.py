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

from ..ir import build
from ..ir.node import BOOL, Node, toposort
from ..ir.ops import Op
from ..ir.program import Decl, Recurrence, Role
from ..passes.classify import classify
from .kernel import Array, Kernel, Lowered, independent_axes
from .loops import Assign, Buffer, Load, Num, Select, Var
from .step import StepBuilder, size_var
from .summary import splits_in_time

# -- the step builder ------------------------------------------------------------------------------


def build_kernel(name: str, program: Recurrence, parallel: tuple[str, ...], time_blocks: bool = False,
                 store_prev: tuple[str, ...] = (), blocked_init: bool = False, prefix: str = "",
                 load_init: bool = True) -> Kernel:
    """A scan kernel for `program` (module docstring), its loop nests filled in.

    With `time_blocks` the kernel is also parallel over blocks of time; each block starts from
    zero (sums over time), or from its own carry ``init_<state>[blk]`` when `blocked_init`.
    `prefix` starts the names of its scratch values (two kernels' steps can then share one body);
    without `load_init` the setup leaves the carry unset (whoever splices the step sets it).
    One function although long: the kernel's arrays, setup, step and finish are filled in order
    from one `StepBuilder` and the same per-state buffers.
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
    return splits_in_time(program)


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

"""The warp kernel of a diagonal-linear scan (``forward.cu.j2``): a warp per recurrence, each lane a
block of consecutive steps, the lanes' summaries combined by shuffles (lowering/time_blocks.py)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from .....lowering.kernel import Kernel, Lowered
from .....lowering.loops import (
    Assign,
    Buffer,
    Load,
    Select,
    Var,
    loads,
)
from .....lowering.plan import size_var
from .....lowering.summary import complex_pairs, partial_name, product_name
from ...hardware import (
    STATIC_SHARED,
    WARP,
)
from ...printer import (
    BLOCK,
    MIN_BLOCKS,
    ONE_GROUP,
    STATE_REGISTERS,
    UNROLL_LIMIT,
    ArraySpec,
    CPrinter,
    Threads,
    _at_t,
    _load_param_registers,
    _scalar_names,
    _stageable,
    _store,
    _within,
    c_array,
    param_registers,
    with_free_array_names,
)
from ...source import exact_products, has_half, render
from .. import template
from ..thread import kernel_context
from .analysis import (
    StateMajor,
    scalar_name,
    share,
    warp_state_major,
)


def warp_kernel_context(k: Kernel, summary: Kernel, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                        steps_per_lane: int, round_steps: int = 0, ragged: bool = True, warps: int = 1) -> dict:
    """The warp kernel (lowering/time_blocks.py) of the program step `k`: the `summary` step and
    `k`'s spliced around a scan of the (product, partial) pairs across the warp's lanes. Where `k`
    has arrays ``rounds_<state>`` (kernels/warp/backward_analysis.py), the lane whose steps start a round of
    `round_steps` (the fused backward's) writes its carry there. `warps` > 1 (`shares_recurrence`):
    a block of that many warps per recurrence, a round of warps x 32 x K steps.

    One function although long: the summary's and the step's lines are spliced around the lane scan
    from one set of printers, staged arrays and parameter registers, in the template's order."""
    program = k.program
    if warps > 1 and not shares_recurrence(k, summary):
        raise ValueError(f"{k.name}: only a warp kernel with scalar states, without rounds, can share a "
                         "recurrence among warps")
    stage_len = WARP * (steps_per_lane + 1)  # a slot skipped after each lane's steps: no bank conflicts
    block_warps = warps if warps > 1 else BLOCK // WARP
    value_bytes = 8 if any(a.dtype == "float64" for a in arrays.values()) else 4  # F: double where any is
    room = STATIC_SHARED - 4 * warps * len(program.states) * value_bytes  # less the warps' aggregates
    staged = _within(_stageable(k.arrays, (summary, k), set(k.parallel)), block_warps * stage_len * value_bytes, room)
    ctx = kernel_context(k, arrays, sizes)
    ctx["template"] = template("warp/forward.cu.j2")
    in_registers = param_registers((summary, k), set(k.parallel), sizes)
    major = warp_state_major(summary, k)
    unrolled = major is not None and _state_loop_unrolled(program.states, set(k.parallel), sizes, steps_per_lane)
    # Params stay in registers only in the state-major kernel that saves the backward's rounds: the
    # plain forward then fits 128 registers, 4 blocks per SM, and ran faster without them than with
    # them, where the rounds kernel ran faster with them (Mamba-1 B8 D1536 L2048; see
    # bench/results/2026-11-27-from-code-comments.md). Indexed by a rolled loop, a register array would
    # be local memory.
    if major is not None and not round_steps:
        in_registers = {}
    elif major is not None and not unrolled:
        in_registers = {name: local for name, local in in_registers.items() if not local}
    ps = CPrinter(summary, arrays, sizes, staged, param_registers=in_registers)
    pr = CPrinter(k, arrays, sizes, staged, param_registers=in_registers)
    ctx["shared"] = [f"__shared__ F sm_{a}[{block_warps}][{stage_len}];" for a in sorted(staged)]
    ctx["shared"] += [f"__shared__ F sm_agg_{s.name}[2][{warps}][2];  // the warps' (product, partial), two rounds"
                      for s in program.states if warps > 1]
    ctx["warps"] = warps
    index = {a.name: a for a in k.arrays}
    ctx["stage_in"] = [(a, f"F(to_f({c_array(a)}[{pr.index(_at_t(index[a]))}]))")
                       for a in sorted(staged) if index[a].role == "seq"]
    ctx["stage_out"] = [f"if (valid) {c_array(a)}[{pr.index(_at_t(index[a]))}] = "
                        f"{_store(arrays[a].dtype, f'sm_{a}[w][slot]')};"
                        for a in sorted(staged) if index[a].role == "out"]
    ctx["vector_stage"] = major is None and _vector_stage(k, staged, arrays, steps_per_lane)
    if ctx["vector_stage"]:
        at = {a: f"{c_array(a)} + ({pr.index(_at_t(index[a]))})" for a in staged}
        ctx["stage_in_at"] = [(a, at[a]) for a in sorted(staged) if index[a].role == "seq"]
        ctx["stage_out_at"] = [(a, at[a]) for a in sorted(staged) if index[a].role == "out"]
        width = 4 * _vector_width(steps_per_lane)
        ctx["aligned"] = " && ".join(f"(unsigned long long){c_array(a)} % {width} == 0" for a in sorted(staged))
    declared = set(ctx["declarations"])
    ctx["declarations"] += [d for d in ps.scalars() if d not in declared]
    per = f"a block of {warps} warps" if warps > 1 else "one warp"
    ctx["comment"] = (f"{program.name}: {per} per [{' '.join(k.parallel) or '-'}], its lanes over blocks "
                      f"of {steps_per_lane} steps")
    ctx["steps_per_lane"] = steps_per_lane
    small = _state_values(program.states, set(k.parallel), sizes) <= STATE_REGISTERS
    ctx["bounds"] = f"__launch_bounds__({BLOCK}, {MIN_BLOCKS}) " if small and major is None else ""
    if warps > 1:
        ctx["bounds"] = f"__launch_bounds__({warps * WARP}) "
    loads = _load_param_registers(in_registers, (summary, k), pr)
    ctx["summary_setup"] = "\n".join(["    " + line for line in loads] + ps.stmts(summary.setup, 1))
    ctx["summary_step"] = "\n".join(ps.stmts(summary.step, 3))
    ctx["step"] = "\n".join(pr.stmts(k.step, 3))
    ctx["finish"] = "\n".join(CPrinter(k, arrays, sizes).stmts(k.finish, 2))
    scan = _lane_scan(program.states, set(k.parallel), sizes, warps=warps, pairs=complex_pairs(program))
    save = [f"{head}{c_array(name)}[{pr.index(Load(name, (f't0 / {round_steps}', *env)))}]"
            f" = {_store(arrays[name].dtype, f'st_{s}{idx}')};"
            for s, head, idx, env, name in _round_arrays(k)]
    if save:  # after the combine: st_<s> is the carry into this lane's steps
        save = [f"if (t0 < L && t0 % {round_steps} == 0) {{  // this lane's steps start a round of the backward",
                *(f"    {line}" for line in save), "}"]
    pad = "    "
    ctx["carry"] = "\n".join(pad + line for line in scan.carry)
    ctx["reset"] = "\n".join(2 * pad + line for line in scan.reset)
    ctx["combine"] = "\n".join(2 * pad + line for line in scan.combine + save)
    ctx["final_carry"] = "\n".join(pad + line for line in scan.final)
    ctx["state_major"] = ""
    if major is not None:
        first, second = share(*major)
        per_step = list(dict.fromkeys(second.per_step + first.per_step))
        seqs = {a.name for a in k.arrays if a.role == "seq"}
        vectors = _vector_loads(first.body + second.body, seqs, k.reverse, arrays, steps_per_lane)
        pm = CPrinter(k, arrays, sizes, staged, param_registers=in_registers)
        pv = CPrinter(k, arrays, sizes, staged, param_registers=in_registers, vectors=vectors)
        for printer in (pm, pv):  # the summary's buffers (values hoisted before time) are arrays here too
            printer.buffers |= set(per_step) | {s.name for s in summary.setup if isinstance(s, Buffer)}
        names = _scalar_names(summary.setup + k.setup + k.finish + second.pre + first.pre + second.post)
        names += [n for n in first.scalars + second.scalars if n not in names]
        ctx["declarations"] = ([f"F {n} = F(0);" for n in names if n not in per_step]
                               + [f"F {n}[{steps_per_lane}];  // one per step of the lane" for n in per_step])
        ctx["declarations"] += [f"F sv_{s.name}" + "".join(f"[{size_var(a)}]" for a in s.axes if a not in k.parallel)
                                + ";  // the carries into this lane's steps, for the backward"
                                for s in program.states if s.name in {n for n, *_ in _round_arrays(k)}]
        ctx["state_major"] = "\n".join(_state_major_lines(first, second, k, (pv, pm), steps_per_lane,
                                                          round_steps, unrolled, ragged))
        ctx["comment"] += ", the states' own axes outside the steps"
    return ctx


# The state-major warp kernel (kernels/warp/analysis.py) unrolls its loop over the states' own axes
# (their values in registers) while that loop times the lane's steps is at most this.
STATE_MAJOR_UNROLL = 128


def _state_loop_unrolled(states, parallel: set[str], sizes: dict[str, int], steps_per_lane: int) -> bool:
    own = [a for a in states[0].axes if a not in parallel]
    return math.prod(sizes[a] for a in own) * steps_per_lane <= STATE_MAJOR_UNROLL


def _lane_steps_loop(depth: int, k: Kernel, steps_per_lane: int, body: list[str], mode: str) -> list[str]:
    """C lines of a loop over this lane's steps (unrolled; `t` and `slot` bound) around `body`.
    `mode` "full": every lane has all its steps (straight-line code); "exit": the loop ends after
    the lane's last step; "live": straight-line too, steps past L read the last step (`t` clamped)
    and `live` is false for them (their results are dropped: `_predicated`)."""
    pad = "    " * depth
    at = "min(t0 + tt, L - 1)" if mode == "live" else "t0 + tt"
    t = f"L - 1 - ({at})" if k.reverse else at
    head = {"full": [], "exit": [f"{pad}    if (tt >= t1 - t0) break;"],
            "live": [f"{pad}    const bool live = tt < t1 - t0;"]}[mode]
    return [f"{pad}#pragma unroll",
            f"{pad}for (int tt = 0; tt < {steps_per_lane}; ++tt) {{",
            *head,
            f"{pad}    const int t = {t};",
            f"{pad}    const int slot = lane * {steps_per_lane + 1} + tt;",
            *body,
            f"{pad}}}"]


def _predicated(body: list, carried: set[str]) -> list:
    """`body` with its assignments to the `carried` scalars kept only for live steps."""
    return [Assign(s.target, Select(Var("live"), s.value, s.target), s.op)
            if isinstance(s.target, Var) and s.target.name in carried and s.op == "=" else s for s in body]


def _vector_loads(body: list, seqs: set[str], reverse: bool, arrays: dict[str, ArraySpec],
                  steps_per_lane: int) -> dict:
    """Loads of `body` (state-major: inside the loop over the states' own axes) that a lane can make
    for its K steps at once, as K // 4 (K // 2) vector loads: float32 sequences (names in `seqs`)
    with time contiguous whose other strides keep a lane's first step aligned (multiples of K), in
    a program not `reverse` in time, K even. (array, index) -> the register array ``ld<j>``
    (indexed by the step)."""
    if reverse or steps_per_lane % 2:
        return {}
    out = {}
    for s in body:
        for e in loads(s.value):
            spec = arrays.get(e.array)
            if (e.array in seqs and spec.dtype == "float32" and spec.strides[0] == 1 and e.index[0] == "t"
                    and all(st % steps_per_lane == 0 for st in spec.strides[1:])
                    and not any("t" in _words(i) for i in e.index[1:]) and (e.array, e.index) not in out):
                out[e.array, e.index] = f"ld{len(out)}"
    return out


def _words(index: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_]\w*", index))


def _state_major_lines(first: StateMajor, second: StateMajor, k: Kernel, printers: tuple[CPrinter, CPrinter],
                       steps_per_lane: int, round_steps: int, unrolled: bool, ragged: bool) -> list[str]:
    """A round of the state-major warp kernel (kernels/warp/analysis.py), twice: for a round whose
    lanes all have their K steps, straight-line code, in which the scheduler overlaps one state
    value's scan across the lanes with the next one's chains (with an exit per step in between, the
    rounds were latency-bound and much slower; see bench/results/2026-11-27-from-code-comments.md), loads along
    the states' axes made as vectors (`_vector_loads`) where the arrays are aligned; and for the
    last, partial, round (and unaligned arrays)."""
    vector, scalar = printers
    full = _state_major_round(first, second, k, vector, steps_per_lane, round_steps, unrolled, "full")
    # A partial last round (`ragged`: the length is no multiple of the round) runs straight-line too,
    # unless a step stores along the states' axes (a step past L would). Where every round is full,
    # the other branch only takes unaligned arrays, with exits: straight-line, its registers slowed
    # the full rounds' code (Mamba-1 B8 D1536 L2048; see bench/results/2026-11-27-from-code-comments.md).
    stores = any(isinstance(s.target, Load) and s.target.array not in scalar.buffers
                 for s in first.body + second.body)
    partial = _state_major_round(first, second, k, scalar, steps_per_lane, round_steps, unrolled,
                                 "live" if ragged and not stores else "exit")
    return _full_or_partial(full, partial, steps_per_lane, {a for a, _ in vector.vectors})


def _full_or_partial(full: list[str], partial: list[str], steps_per_lane: int, vectors: set[str]) -> list[str]:
    """C lines running the round's `full` code where every lane has all its steps and the arrays
    accessed as vectors (`vectors`) are aligned, its `partial` code otherwise."""
    align = 4 * _vector_width(steps_per_lane)
    aligned = "".join(f" && (unsigned long long){c_array(a)} % {align} == 0" for a in sorted(vectors))
    return [f"        if (base + {WARP * steps_per_lane} <= L{aligned}) {{  // every lane has all its steps",
            *("    " + line for line in full),
            "        } else {",
            *("    " + line for line in partial),
            "        }"]


def _state_major_round(first: StateMajor, second: StateMajor, k: Kernel, pm: CPrinter, steps_per_lane: int,
                       round_steps: int, unrolled: bool, mode: str) -> list[str]:
    """One round: the steps' values, then per index of the states' own axes the summary's chain
    over the lane's steps, the scan across the lanes and the step's chain, then what reads the sums
    over those axes. `mode`: of the chains' loops (`_lane_steps_loop`); the loops before and after
    the chains exit after the lane's last step unless the round is full."""
    parallel = set(k.parallel)
    states = k.program.states
    own = [a for a in states[0].axes if a not in parallel]
    depth = 2 + len(own)
    outer = "full" if mode == "full" else "exit"
    summary = first.body
    if mode == "live":  # a step past L leaves the summary as it was
        summary = _predicated(summary, {scalar_name(f"st_{f(s.name)}") for s in states
                                        for f in (product_name, partial_name)})
    lines = _lane_steps_loop(2, k, steps_per_lane, pm.stmts(second.pre + first.pre, 3), outer)
    for i, a in enumerate(own):
        pad = "    " * (2 + i)
        lines += [f"{pad}#pragma unroll" if unrolled else f"{pad}#pragma unroll 1",
                  f"{pad}for (int i_{a} = 0; i_{a} < {size_var(a)}; ++i_{a}) {{  // one state value at a time"]
    pad = "    " * depth
    for (array, index), reg in pm.vectors.items():  # this lane's K steps of each, at once
        first_step = pm.index(Load(array, ("t0", *index[1:])))
        lines += [f"{pad}F {reg}[{steps_per_lane}];",
                  f"{pad}load_steps<{steps_per_lane}>({reg}, {c_array(array)} + {first_step});"]
    lines += _summary_identity(states, pad, complex_pairs(k.program))
    lines += _lane_steps_loop(depth, k, steps_per_lane, pm.stmts(summary, depth + 1), mode)
    rounds = {name for name, *_ in _round_arrays(k)}
    idx = {s.name: _state_loops(s, parallel)[1] for s in states}
    lines += _combine_state_values(states, lambda n: f"cr_{n}{idx[n]}", pad, pairs=complex_pairs(k.program))
    for s in states:
        if s.name in rounds:  # kept for the store after the loop (a branch here would split the round)
            lines.append(f"{pad}sv_{s.name}{idx[s.name]} = {scalar_name(f'st_{s.name}')};")
    lines += _lane_steps_loop(depth, k, steps_per_lane, pm.stmts(second.body, depth + 1), mode)
    lines += ["    " * (depth - 1 - i) + "}" for i in range(len(own))]
    for s in states:
        if s.name in rounds:  # this lane's steps start a round of the backward: its carries are saved
            head, idx, env = _state_loops(s, parallel)
            at = pm.index(Load(f"rounds_{s.name}", (f"t0 / {round_steps}", *env)))
            store = _store(pm.arrays[f"rounds_{s.name}"].dtype, f"sv_{s.name}{idx}")
            lines += [f"        if (t0 < L && t0 % {round_steps} == 0) {{",
                      f"            {head}{c_array(f'rounds_{s.name}')}[{at}] = {store};", "        }"]
    lines += _lane_steps_loop(2, k, steps_per_lane, pm.stmts(second.post, 3), outer)
    return lines


def _summary_identity(states, pad: str, pairs: dict[str, str] | None = None) -> list[str]:
    """C lines starting the state-major summaries (scalars, one state index) of `states` at (1, 0)
    (a complex pair's products at 1 + 0i: `pairs`, real part's state -> imaginary part's)."""
    imag = set((pairs or {}).values())
    names = [(scalar_name(f"st_{product_name(s.name)}"), scalar_name(f"st_{partial_name(s.name)}"),
              "F(0)" if s.name in imag else "F(1)") for s in states]
    return [f"{pad}{prod} = {one}; {part} = F(0);" for prod, part, one in names]


def _combine_state_value(state: str, carry: str, pad: str, reverse: bool = False) -> list[str]:
    """C lines scanning one state value's summary across the lanes (`_combine_one`, state-major
    scalars): the carry into this lane's steps becomes ``v_st_<state>``, `carry` the one past the round."""
    prod, part = (scalar_name(f"st_{name(state)}") for name in (product_name, partial_name))
    return [f"{pad}{{", *(pad + line for line in _combine_one(prod, part, carry, scalar_name(f"st_{state}"), reverse)),
            f"{pad}}}"]


def _combine_state_values(states, carry, pad: str, reverse: bool = False,
                          pairs: dict[str, str] | None = None) -> list[str]:
    """`_combine_state_value` for each of `states` (`carry(name)`: its carry's C name), a complex
    pair's two states scanned together with complex products (`_combine_complex`)."""
    pairs = pairs or {}
    imag = set(pairs.values())
    lines = []
    for s in states:
        if s.name in imag:
            continue
        if s.name not in pairs:
            lines += _combine_state_value(s.name, carry(s.name), pad, reverse)
            continue
        re, im = s.name, pairs[s.name]
        scan = _combine_complex([scalar_name(f"st_{product_name(n)}") for n in (re, im)],
                                [scalar_name(f"st_{partial_name(n)}") for n in (re, im)],
                                [carry(re), carry(im)], [scalar_name(f"st_{n}") for n in (re, im)], reverse)
        lines += [f"{pad}{{", *(pad + line for line in scan), f"{pad}}}"]
    return lines


@dataclass
class _LaneScan:
    """C lines of the scan of (product, partial) pairs across a warp's lanes, per state:
    `carry` (cr_<s> from st_<s>, after the setup), `reset` (a round's summaries to identity),
    `combine` (each lane's carry into its steps, st_<s>, and the carry past the round, cr_<s>),
    `final` (st_<s> = cr_<s>)."""

    carry: list[str]
    reset: list[str]
    combine: list[str]
    final: list[str]


def _state_loops(s, parallel: set[str]) -> tuple[str, str, list[str]]:
    """(loop heads over the state's local axes, its local index, the index of each of its axes)."""
    local = [a for a in s.axes if a not in parallel]
    head = "".join(f"for (int i_{a} = 0; i_{a} < {size_var(a)}; ++i_{a}) " for a in local)
    return head, "".join(f"[i_{a}]" for a in local), [f"p_{a}" if a in parallel else f"i_{a}" for a in s.axes]


def _lane_scan(states, parallel: set[str], sizes: dict[str, int], reverse: bool = False,
               warps: int = 1, pairs: dict[str, str] | None = None) -> _LaneScan:
    """`_LaneScan` for `states`; `reverse`: lane 0 holds the latest steps of the round, the carry
    comes from the later side (a suffix scan, lanes after compose first); `warps` > 1: the block's
    warps share the recurrence (scalar states only: `_combine_across_warps`). `pairs` (real part's
    state -> imaginary part's): complex diagonal states, scanned as complex values (`_combine_complex`)."""
    pairs = pairs or {}
    imag = set(pairs.values())
    if pairs and warps > 1:
        raise ValueError("complex states are not shared among warps (`shares_recurrence`)")
    carry, reset, combine, final = [], [], [], []
    for s in states:
        head, idx, _ = _state_loops(s, parallel)
        local = [a for a in s.axes if a not in parallel]
        if math.prod(sizes[a] for a in local) > UNROLL_LIMIT:  # unrolled, ptxas would try registers and spill
            head = "#pragma unroll 1\n" + head
        carry.append(f"F cr_{s.name}{''.join(f'[{size_var(a)}]' for a in local)};")
        carry += f"{head}cr_{s.name}{idx} = st_{s.name}{idx};".split("\n")
        prod, part = f"st_{product_name(s.name)}{idx}", f"st_{partial_name(s.name)}{idx}"
        reset += f"{head}{{ {prod} = {'F(0)' if s.name in imag else 'F(1)'}; {part} = F(0); }}".split("\n")
        final += f"{head}st_{s.name}{idx} = cr_{s.name}{idx};".split("\n")
        if s.name in imag:  # scanned with its real part
            continue
        if s.name in pairs:
            re, im = s.name, pairs[s.name]
            lines = _combine_complex([f"st_{product_name(n)}{idx}" for n in (re, im)],
                                     [f"st_{partial_name(n)}{idx}" for n in (re, im)],
                                     [f"cr_{n}{idx}" for n in (re, im)], [f"st_{n}{idx}" for n in (re, im)], reverse)
        elif warps > 1:
            lines = _combine_across_warps(prod, part, f"cr_{s.name}", f"st_{s.name}", f"sm_agg_{s.name}", warps)
        else:
            lines = _combine_one(prod, part, f"cr_{s.name}{idx}", f"st_{s.name}{idx}", reverse)
        combine += [*f"{head}{{".split("\n"), *lines, "}"]
    return _LaneScan(carry, reset, combine, final)


def _combine_one(prod: str, part: str, carry: str, into: str, reverse: bool = False) -> list[str]:
    """C lines (indented one level) scanning one state value's (product, partial) pairs across the
    lanes: `into` becomes the carry into this lane's steps, `carry` the carry past the round."""
    shfl, first, last = ("__shfl_down_sync", WARP - 1, 0) if reverse else ("__shfl_up_sync", 0, WARP - 1)
    return [
        f"    F P = {prod}, H = {part};",
        f"    if (lane == {first}) H = P * {carry} + H;  // the carry enters: H becomes the state past",
        *_inclusive_lane_scan(reverse, "inclusive: the lanes nearer the carry first", total_product=False),
        f"    const F into = {shfl}(0xffffffffu, H, 1);  // the state past the previous lane's steps",
        f"    {into} = lane == {first} ? {carry} : into;  // the carry into this lane's steps",
        f"    {carry} = __shfl_sync(0xffffffffu, H, {last});",
    ]


def _combine_complex(prods: list[str], parts: list[str], carries: list[str], intos: list[str],
                     reverse: bool = False) -> list[str]:
    """`_combine_one` for a complex value, each argument its (real, imaginary) C names: the pairs
    (P, H) of complex numbers combine as (P2 P1, P2 H1 + H2), complex products."""
    shfl, first, last = ("__shfl_down_sync", WARP - 1, 0) if reverse else ("__shfl_up_sync", 0, WARP - 1)
    before = f"lane + off < {WARP}" if reverse else "lane >= off"
    (pr, pi), (hr, hi), (cr, ci), (ir, ii) = prods, parts, carries, intos
    return [
        f"    F Pr = {pr}, Pi = {pi}, Hr = {hr}, Hi = {hi};  // a complex (product, partial)",
        f"    if (lane == {first}) {{  // the carry enters: H becomes the state past",
        f"        const F er = Pr * {cr} - Pi * {ci} + Hr, ei = Pi * {cr} + Pr * {ci} + Hi;",
        "        Hr = er; Hi = ei;",
        "    }",
        "    #pragma unroll",
        f"    for (int off = 1; off < {WARP}; off <<= 1) {{  // inclusive: the lanes nearer the carry first",
        f"        const F Hbr = {shfl}(0xffffffffu, Hr, off), Hbi = {shfl}(0xffffffffu, Hi, off);",
        f"        const F Pbr = off < {WARP // 2} ? {shfl}(0xffffffffu, Pr, off) : F(1);  // the last P is unused",
        f"        const F Pbi = off < {WARP // 2} ? {shfl}(0xffffffffu, Pi, off) : F(0);",
        f"        if ({before}) {{",
        "            const F nr = Pr * Hbr - Pi * Hbi + Hr, ni = Pi * Hbr + Pr * Hbi + Hi;",
        "            const F qr = Pr * Pbr - Pi * Pbi, qi = Pr * Pbi + Pi * Pbr;",
        "            Hr = nr; Hi = ni; Pr = qr; Pi = qi;",
        "        }",
        "    }",
        f"    const F intor = {shfl}(0xffffffffu, Hr, 1), intoi = {shfl}(0xffffffffu, Hi, 1);",
        f"    {ir} = lane == {first} ? {cr} : intor;  // the carry into this lane's steps",
        f"    {ii} = lane == {first} ? {ci} : intoi;",
        f"    {cr} = __shfl_sync(0xffffffffu, Hr, {last});",
        f"    {ci} = __shfl_sync(0xffffffffu, Hi, {last});",
    ]


def _inclusive_lane_scan(reverse: bool, comment: str, total_product: bool) -> list[str]:
    """C lines (indented one level) of the shuffle scan of the (P, H) pairs across a warp's lanes
    (from lane 0 up, or `reverse` from lane 31 down): each lane's H becomes the state past its own
    and the earlier lanes' steps. `total_product`: P too becomes the whole prefix's product (the
    warp's total is used); else its last shuffle is skipped."""
    shfl = "__shfl_down_sync" if reverse else "__shfl_up_sync"
    before = f"lane + off < {WARP}" if reverse else "lane >= off"
    pb = (f"{shfl}(0xffffffffu, P, off);" if total_product
          else f"off < {WARP // 2} ? {shfl}(0xffffffffu, P, off) : F(1);  // the last P is unused")
    return [
        "    #pragma unroll",
        f"    for (int off = 1; off < {WARP}; off <<= 1) {{  // {comment}",
        f"        const F Hb = {shfl}(0xffffffffu, H, off);",
        f"        const F Pb = {pb}",
        f"        if ({before}) {{ H = P * Hb + H; P = P * Pb; }}",
        "    }",
    ]


def _combine_across_warps(prod: str, part: str, carry: str, into: str, totals: str, warps: int) -> list[str]:
    """C lines (indented one level) scanning one scalar state's (product, partial) pairs across the
    `warps` warps of a block that share its recurrence, the earlier steps on the lower warps: each
    warp's inclusive scan over its lanes, the warps' totals through shared memory (`totals`, two
    rounds' worth, so one barrier a round suffices), then the carry folded through the warps before
    this one. `into` becomes the carry into this lane's steps, `carry` the carry past the round (the
    same in every warp)."""
    return [
        f"    F P = {prod}, H = {part};",
        *_inclusive_lane_scan(False, "inclusive, within the warp", total_product=True),
        f"    if (lane == {WARP - 1}) {{ {totals}[par][wr][0] = P; {totals}[par][wr][1] = H; }}  // the warp's",
        "    const F Pe = __shfl_up_sync(0xffffffffu, P, 1), He = __shfl_up_sync(0xffffffffu, H, 1);  // exclusive",
        "    __syncthreads();",
        f"    F c = {carry};",
        "    #pragma unroll",
        f"    for (int j = 0; j < {warps}; ++j) {{  // c: the state past warps 0 .. j - 1",
        f"        if (j == wr) {into} = lane == 0 ? c : Pe * c + He;",
        f"        c = {totals}[par][j][0] * c + {totals}[par][j][1];",
        "    }",
        f"    {carry} = c;",
    ]


def _vector_stage(k: Kernel, staged, arrays: dict[str, ArraySpec], steps_per_lane: int) -> bool:
    """Whether the warp kernel moves its `staged` arrays a lane's own K steps at a time, as vectors
    (K // 4 float4 or K // 2 float2 per array), instead of K coalesced scalars: all float32, time
    contiguous, their other strides multiples of K (each lane's first step aligned; the pointers are
    checked when the kernel starts), K even, forward in time, and not state-major (which loads its
    own vectors, `_vector_loads`). In hand-edited kernels of the scan at B8 D2048 L4096 (8 warps a
    channel), vectors in ran slightly faster than scalars; see
    bench/results/2026-11-27-from-code-comments.md."""
    if k.reverse or steps_per_lane % 2 or not staged:
        return False
    specs = [arrays[a] for a in staged]
    return all(s.dtype == "float32" and s.strides[0] == 1 and all(st % steps_per_lane == 0 for st in s.strides[1:])
               for s in specs)


def shares_recurrence(k: Kernel, summary: Kernel) -> bool:
    """Whether the warp kernel of `k` can spread one recurrence over several warps of a block
    (`_combine_across_warps`): its states scalar per recurrence (no own axes), not state-major, no
    carries saved for the fused backward's rounds."""
    parallel = set(k.parallel)
    return (warp_state_major(summary, k) is None and not any(a.role == "rounds" for a in k.arrays)
            and all(a in parallel for s in k.program.states for a in s.axes) and not complex_pairs(k.program))


def recurrence_warps_fit(k: Kernel, summary: Kernel, steps_per_lane: int, value_bytes: int) -> int:
    """How many warps sharing one recurrence fit the static shared memory of a block: each stages a
    round of its sequences and outputs (`_stageable`) and keeps its states' totals."""
    staged = len(_stageable(k.arrays, (summary, k), set(k.parallel)))
    per_warp = (staged * WARP * (steps_per_lane + 1) + 4 * len(k.program.states)) * value_bytes
    return max(1, STATIC_SHARED // max(1, per_warp))


def _state_values(states, parallel: set[str], sizes: dict[str, int]) -> int:
    """How many state values one thread of a warp kernel holds (the sizes of the states' local axes)."""
    return sum(math.prod(sizes[a] for a in s.axes if a not in parallel) for s in states)


def _round_arrays(k: Kernel):
    """(state, loop heads, local index, array index, array name) of each ``rounds_<state>`` of `k`."""
    parallel = set(k.parallel)
    names = {a.name for a in k.arrays if a.role == "rounds"}
    for s in k.program.states:
        if f"rounds_{s.name}" in names:
            head, idx, env = _state_loops(s, parallel)
            yield s.name, head, idx, env, f"rounds_{s.name}"


def _vector_width(steps_per_lane: int) -> int:
    """Values per vector load or reduction of a lane's steps (`load_steps`, `add_steps`)."""
    return 4 if steps_per_lane % 4 == 0 else 2


def warp_source(lowered: Lowered, ctype: str, k: Kernel, specs: dict[str, ArraySpec], sizes: dict[str, int],
                summary: Kernel, steps_per_lane: int, threads: Threads = ONE_GROUP, round_steps: int = 0,
                ragged: bool = True) -> str:
    """CUDA C of the warp kernel whose step is `k` (of `lowered`) and whose lanes' summary step is
    `summary`, with the layouts of its arrays (`round_steps`: see `warp_kernel_context`; `ragged`:
    its last round may be partial, `_state_major_lines`)."""
    def build():
        context = warp_kernel_context(k, summary, specs, sizes, steps_per_lane, round_steps, ragged, threads.warps)
        return render(lowered.program.name, lowered.strategy, ctype, [context], has_half(specs),
                      exact_products(lowered.program))
    return with_free_array_names(set(specs), build)

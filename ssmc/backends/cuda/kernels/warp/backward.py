"""The fused backward's warp kernel (``backward.cu.j2``): the forward's carries recomputed in
registers round by round from the last, and the adjoint scanned alongside (kernels/warp/backward_analysis.py)."""

from __future__ import annotations

import math

from .....lowering.loops import (
    Assign,
    Buffer,
    Load,
)
from .....lowering.plan import size_var
from .....lowering.summary import complex_pairs
from ...hardware import (
    WARP,
)
from ...printer import (
    BLOCK,
    C_TYPES,
    ArraySpec,
    CPrinter,
    _at_t,
    _next,
    _next_index_loads,
    _scalar_names,
    _stageable,
    _store,
    c_array,
    with_free_array_names,
)
from ...source import exact_products, has_half, render
from .. import template
from ..thread import _unflatten
from .analysis import (
    STEP,
    FusedStateMajor,
    fused_state_major,
    scalar_name,
)
from .backward_analysis import FusedBackward
from .forward import (
    _combine_state_values,
    _full_or_partial,
    _lane_scan,
    _state_loops,
    _summary_identity,
    _vector_loads,
    _vector_width,
    _words,
)


def fused_backward_context(fb: FusedBackward, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                           steps_per_lane: int, state_major: bool = False) -> dict:
    """The fused backward kernel (kernels/warp/backward_analysis.py): the forward's summary and carries and
    the adjoint's summary and step spliced around two lane scans, a round at a time, last first;
    with `state_major`, where `fused_state_major` applies, the states' own axes outside those.

    One function although long: the four steps' lines share the staging, the parameter registers
    and the block sums' buffers it sets up, and go into the template's slots in order."""
    kernels = (fb.forward_summary, fb.forward_carries, fb.adjoint_summary, fb.adjoint)
    parallel = set(fb.parallel)
    registers = {f"prev_{s}": f"rg_{s}" for s in fb.carried} | {s: f"rg_{s}" for s in fb.carried}
    registers |= {f"out_{v}": f"rg_{v}" for v in fb.shared} | {v: f"rg_{v}" for v in fb.shared}
    staged = _stageable(fb.arrays, kernels, parallel)
    printers = [CPrinter(k, arrays, sizes, staged, registers=registers) for k in kernels]
    fs, fc, as_, ad = printers
    index = {a.name: a for a in fb.arrays}
    params = []
    for a in fb.arrays:
        const = "const " if a.role in ("seq", "param", "init", "rounds") else ""
        params.append(f"{const}{C_TYPES[arrays[a.name].dtype]}* __restrict__ {c_array(a.name)}")
    axes = sorted({a for k in kernels for a in k.sizes})
    constants = [f"constexpr int {size_var(a)} = {sizes[a]};" for a in axes]
    constants.append(f"constexpr long long total = {' * '.join(str(sizes[a]) for a in fb.parallel)};")
    unflatten = _unflatten(fb.parallel)
    declarations = []
    for pr in printers:
        declarations += [d for d in pr.scalars() if d not in declarations]
    stage_len = WARP * (steps_per_lane + 1)
    fwd_states = fb.backward.forward.states
    core_states = [s for s in fb.adjoint.program.states if s.name in fb.core]
    forward_scan = _lane_scan(fwd_states, parallel, sizes, pairs=_forward_pairs(fb))
    adjoint_scan = _lane_scan(core_states, parallel, sizes, reverse=True, pairs=_core_pairs(fb))
    registers_decl = []
    load_round = []
    for s in fwd_states:
        head, idx, env = _state_loops(s, parallel)
        local = [size_var(a) for a in s.axes if a not in parallel]
        registers_decl.append(f"F rg_{s.name}[{steps_per_lane}]" + "".join(f"[{d}]" for d in local) + ";"
                              "  // the carry before each of this lane's steps")
        registers_decl.append(f"F cr_{s.name}" + "".join(f"[{d}]" for d in local) + ";")
        at = fc.index(Load(f"rounds_{s.name}", ("r", *env)))
        load_round.append(f"{head}cr_{s.name}{idx} = F(to_f({c_array(f'rounds_{s.name}')}[{at}]));")
    for a in fb.forward_summary.arrays:  # values the forward's summary keeps for the later steps
        if a.role == "out" and a.name[len("out_"):] in fb.shared:
            local = "".join(f"[{size_var(x)}]" for x in a.axes[1:] if x not in parallel)
            registers_decl.append(f"F rg_{a.name[len('out_'):]}[{steps_per_lane}]{local};"
                                  "  // a value of each of this lane's steps, computed once")
    accumulate = []
    for name, axes_ in fb.partials.accumulators.items():
        s = fb.adjoint.program.decl(name)
        head, idx, _ = _state_loops(s, parallel)
        at = {a: (f"p_{a}" if a in parallel else f"i_{a}") for a in s.axes}
        target = f"{c_array(f'final_{name}')}[{ad.index(Load(f'final_{name}', tuple(at[a] for a in axes_) or ('0',)))}]"
        accumulate += [f"{head}{{  // this warp's sum of its threads' terms, added into the result",
                       f"    F v = st_{name}{idx};",
                       "    #pragma unroll",
                       f"    for (int off = {WARP // 2}; off > 0; off >>= 1)",
                       "        v += __shfl_xor_sync(0xffffffffu, v, off);",
                       f"    if (lane == 0) atomicAdd(&{target}, v);",
                       "}"]
    pad = "    "
    ctx = {
        "template": template("warp/backward.cu.j2"),
        "fused_backward": True,
        "name": fb.name,
        "comment": (f"{fb.backward.adjoint.name}: one warp per [{' '.join(fb.parallel)}], its lanes over blocks of "
                    f"{steps_per_lane} steps, rounds last first; the forward's carries recomputed in registers"),
        "params": params,
        "constants": constants,
        "unflatten": unflatten,
        "declarations": declarations,
        "steps_per_lane": steps_per_lane,
        "vector_stage": False,
        "shared": [f"__shared__ F sm_{a}[{BLOCK // WARP}][{stage_len}];" for a in sorted(staged)],
        "stage_in": [(a, f"F(to_f({c_array(a)}[{ad.index(_at_t(index[a]))}]))")
                     for a in sorted(staged) if index[a].role == "seq"],
        "stage_out": [f"if (valid) {c_array(a)}[{ad.index(_at_t(index[a]))}] = "
                      f"{_store(arrays[a].dtype, f'sm_{a}[w][slot]')};"
                      for a in sorted(staged) if index[a].role == "out"],
        "setup": "\n".join(line for pr, k in zip(printers, kernels) for line in pr.stmts(k.setup, 1)),
        "carry": "\n".join(pad + line for line in adjoint_scan.carry + registers_decl),
        "load_round": "\n".join(2 * pad + line for line in load_round),
        "forward_reset": "\n".join(2 * pad + line for line in forward_scan.reset),
        "forward_summary": "\n".join(fs.stmts(fb.forward_summary.step, 3)),
        "forward_combine": "\n".join(2 * pad + line for line in forward_scan.combine),
        "forward_step": "\n".join(fc.stmts(fb.forward_carries.step, 3)),
        "adjoint_reset": "\n".join(2 * pad + line for line in adjoint_scan.reset),
        "adjoint_summary": "\n".join(as_.stmts(fb.adjoint_summary.step, 3)),
        "adjoint_combine": "\n".join(2 * pad + line for line in adjoint_scan.combine),
        "adjoint_step": "\n".join(ad.stmts(fb.adjoint.step, 3)),
        "final_carry": "\n".join(pad + line for line in adjoint_scan.final),
        "finish": "\n".join(CPrinter(fb.adjoint, arrays, sizes).stmts(fb.adjoint.finish, 2)),
        "accumulate": "\n".join(pad + line for line in accumulate),
        "state_major": "",
        "spread": 0,
        "spread_blocks": 0,
    }
    major = fused_state_major(fb) if state_major else None
    if major is not None:
        extra = _fused_state_major(fb, major, arrays, sizes, steps_per_lane, staged, registers)
        ctx["shared"] += extra.pop("shared")
        ctx.update(extra)
        ctx["comment"] += "; the states' own axes outside the steps"
        # no launch bounds: bounded to 4 blocks per SM (128 registers) it spilled at N = 16 and 256 and
        # ran about as fast as unbounded, in 134 (Mamba-1 B8 D1536 L2048 N16; see
        # bench/results/2026-11-27-from-code-comments.md)
    return ctx


def _fused_state_major(fb: FusedBackward, major: FusedStateMajor, arrays: dict[str, ArraySpec],
                       sizes: dict[str, int], steps_per_lane: int, staged, registers: dict[str, str]) -> dict:
    """The fused backward's context entries for its state-major round (kernels/warp/analysis.py,
    `FusedStateMajor`): declarations (a register per step for the per-step values and the forward's
    carries and shared values, of one state index at a time) and the round, twice: straight-line
    code with a lane's steps of B[:, n] loaded and its terms of grad_B[:, n] added as vectors,
    for rounds whose lanes all have their steps and aligned arrays; and with exits after the
    lane's last step for the others (a partial last round, which runs first)."""
    kernels = (fb.forward_summary, fb.forward_carries, fb.adjoint_summary, fb.adjoint)
    steps = major.steps()
    K = steps_per_lane
    per_step = list(dict.fromkeys(n for sm in steps for n in sm.per_step))
    seqs = {a.name for a in fb.arrays if a.role == "seq"}
    vectors = _vector_loads([x for sm in steps for x in sm.body], seqs, False, arrays, K)
    atomics = _vector_atomics(major.adjoint.body, arrays, K)
    hoisted = {b.name for k in kernels for b in k.setup if isinstance(b, Buffer)}

    def printers(vec: dict) -> list[CPrinter]:
        out = []
        for k in kernels:
            pr = CPrinter(k, arrays, sizes, staged, registers=registers, vectors=vec, one_value=True)
            pr.buffers |= set(per_step) | hoisted | set(atomics.values())
            out.append(pr)
        return out

    summed = BLOCK_SUMS and _block_sums(fb, atomics, sizes)
    full = _fused_state_major_round(fb, major, printers(vectors), sizes, K, atomics, False, summed)
    partial = _fused_state_major_round(fb, major, printers({}), sizes, K, atomics, True, summed)
    declarations = []
    for k, sm in zip(kernels, steps):
        for n in _scalar_names(k.setup + k.finish + sm.pre + sm.post) + list(sm.scalars):
            line = f"F {n} = F(0);"
            if n not in per_step and line not in declarations:
                declarations.append(line)
    declarations += [f"F {n}[{K}];  // one per step of the lane" for n in per_step + sorted(set(atomics.values()))]
    carried = [f"F rg_{s}[{K}];  // the carry before each of this lane's steps, of one state index"
               for s in fb.carried]
    carried += [f"F rg_{v}[{K}];  // a value of each of this lane's steps, computed once" for v in fb.shared]
    pad = "    "
    core = [s for s in fb.adjoint.program.states if s.name in fb.core]
    shared = [f"__shared__ F sm_sums[2][{len(atomics)}][{BLOCK // WARP}][{WARP * K}];  // the warps' atomic terms"
              f" of one state index, twice: a barrier per index"] if summed else []
    return {
        "spread": _spread(fb, sizes, summed),
        "spread_blocks": sizes[fb.parallel[-1]] // (BLOCK // WARP),
        "shared": shared,
        "declarations": declarations + (["int sums_at = 0;  // which copy of sm_sums"] if summed else []),
        "carry": "\n".join(pad + line for line in _lane_scan(core, set(fb.parallel), sizes, reverse=True).carry
                           + carried),
        "state_major": "\n".join(_full_or_partial(full, partial, K, {a for a, _ in vectors} | {a for a, _ in atomics})),
    }


# Where the warps of a block take neighbouring indices of the axis an atomic add sums over (Mamba-1's
# d, for grad_B[b, n, t]), they add their terms up in shared memory first and one reduction per
# block and vector goes to memory (`_block_sums`).
BLOCK_SUMS = True


def _block_sums(fb: FusedBackward, atomics: dict, sizes: dict[str, int]) -> bool:
    """Whether the warps of a block may add their atomic terms (`_vector_atomics`) up before the
    reductions: they differ only in the last parallel axis (its size a multiple of the warps per
    block, so that no warp leaves early and a block's warps share the other indices), which every
    such array sums over."""
    last = fb.parallel[-1]
    axes = {a.name: a.axes for a in fb.arrays}
    return bool(atomics) and sizes[last] % (BLOCK // WARP) == 0 and all(last not in axes[a] for a, _ in atomics)


def _block_sum_lines(depth: int, atomics: dict, printer: CPrinter, steps_per_lane: int) -> list[str]:
    """C lines adding the block's warps' terms of each atomic array (`at<j>`, a lane's K steps) up in
    shared memory, then one vector reduction (`add_steps`) per block and vector of the round, by the
    first threads; steps past L are not added (their rows are padded to whole vectors only)."""
    pad = "    " * depth
    K, width = steps_per_lane, _vector_width(steps_per_lane)
    per_array = WARP * K // width  # vectors of one array in a round
    lines = [f"{pad}{{  // the block's warps add their terms up: one reduction per vector of the round"]
    for j, reg in enumerate(atomics.values()):
        lines += [f"{pad}    #pragma unroll", f"{pad}    for (int tt = 0; tt < {K}; ++tt) "
                  f"sm_sums[sums_at][{j}][w][lane * {K} + tt] = {reg}[tt];"]
    warps = " + ".join(f"sm_sums[sums_at][j][{x}][s + e]" for x in range(BLOCK // WARP))
    targets = [f"({c_array(array)} + {printer.index(Load(array, ('base + s', *at[1:])))})" for array, at in atomics]
    target = targets[-1]
    for j in reversed(range(len(targets) - 1)):
        target = f"j == {j} ? {targets[j]} : {target}"
    vectors = len(atomics) * per_array
    if vectors <= BLOCK:  # a vector a thread
        head = [f"{pad}    const int j = threadIdx.x / {per_array}, s = threadIdx.x % {per_array} * {width};",
                f"{pad}    if (j < {len(atomics)} && base + s < L) {{"]
    else:  # BLOCK at a time (one a thread lost the rest: Mamba-1 at K = 6 lost grad_C's later steps,
        # five summed arrays the fifth). Not everywhere: the loop took Mamba-1's
        # backward at K = 2 from 80 to 95 registers
        head = [f"{pad}    for (int i = threadIdx.x; i < {vectors}; i += {BLOCK}) {{",
                f"{pad}        const int j = i / {per_array}, s = i % {per_array} * {width};",
                f"{pad}        if (base + s >= L) continue;"]
    lines += [f"{pad}    __syncthreads();",
              *head,
              f"{pad}        F v[{width}];",
              f"{pad}        #pragma unroll",
              f"{pad}        for (int e = 0; e < {width}; ++e) v[e] = {warps};",
              f"{pad}        F* to = {target};",
              f"{pad}        if ((unsigned long long)to % {4 * width} == 0) add_steps<{width}>(to, v);",
              f"{pad}        else for (int e = 0; e < {width} && base + s + e < L; ++e) atomicAdd(to + e, v[e]);",
              f"{pad}    }}",
              f"{pad}    sums_at ^= 1;  // the next index writes the other copy: no second barrier",
              f"{pad}}}"]
    return lines


def _vector_atomics(body: list, arrays: dict[str, ArraySpec], steps_per_lane: int) -> dict:
    """Atomic adds of `body` (state-major, a lane's steps inside) that a lane can make for its K
    steps at once (`add_steps`): into float32 arrays with time contiguous at step t whose other
    strides keep a lane's first step aligned, K even. (array, index) -> the register array ``at<j>``
    collecting the lane's K terms."""
    if steps_per_lane % 2:
        return {}
    out = {}
    for s in body:
        e = s.target
        if s.op == "atomic+=" and isinstance(e, Load) and (e.array, e.index) in out:
            return {}  # two terms into one register a step: the second would replace the first
        if s.op == "atomic+=" and isinstance(e, Load):
            spec = arrays[e.array]
            if (spec.dtype == "float32" and spec.strides[0] == 1 and e.index[0] == "t"
                    and all(st % steps_per_lane == 0 for st in spec.strides[1:])
                    and not any("t" in _words(i) for i in e.index[1:])):
                out[e.array, e.index] = f"at{len(out)}"
    return out


def _fused_steps_loop(depth: int, steps_per_lane: int, body: list[str], exits: bool, backwards: bool) -> list[str]:
    """C lines of a loop over this lane's steps (unrolled; `t` and `slot` bound) around `body`, the
    last step first if `backwards`; with `exits`, steps past the lane's last are skipped."""
    pad = "    " * depth
    head = f"for (int tt = {steps_per_lane - 1}; tt >= 0; --tt)" if backwards else \
        f"for (int tt = 0; tt < {steps_per_lane}; ++tt)"
    skip = [f"{pad}    if (tt >= nt) {'continue' if backwards else 'break'};"] if exits else []
    return [f"{pad}#pragma unroll", f"{pad}{head} {{", *skip,
            f"{pad}    const int t = t0 + tt;",
            f"{pad}    const int slot = lane * {steps_per_lane + 1} + tt;",
            *body, f"{pad}}}"]


# The state-major fused backward's loop over the states' own axes is unrolled this many times. Each
# index's chains and scans depend on loads (B[:, n], the round's carry): rolled, with the next index's
# loaded while one computes (`_next_index_loads`), the kernel keeps fewer registers and more warps in
# flight. For Mamba-1 at B8 D1536 L2048 N16 the rolled loop (even without those loads ahead) beat the
# step-major kernel, and the unrolled one (185 registers, loads stalled) was the slowest of the three;
# see bench/results/2026-11-27-from-code-comments.md.
FUSED_STATE_UNROLL = 1


def _fused_state_major_round(fb: FusedBackward, major: FusedStateMajor, printers: list[CPrinter],
                             sizes: dict[str, int], steps_per_lane: int, atomics: dict, exits: bool,
                             summed: bool) -> list[str]:
    """One round of the state-major fused backward (`_fused_state_major`); `atomics`: the adjoint's
    atomic adds made per lane as vectors (`_vector_atomics`); `exits`: a round whose lanes may have
    fewer steps (their vectors' other terms are zeros, added into the rows' padding past L: the
    arrays are allocated with rows of whole vectors, `fused_backward._row`) or unaligned arrays;
    `summed`: the block's warps add those terms up first (`_block_sums`)."""
    fs, fc, as_, ad = major.steps()
    pfs, pfc, pas, pad_ = printers
    K = steps_per_lane
    parallel = set(fb.parallel)
    forward_states = fb.backward.forward.states
    core = [s for s in fb.adjoint.program.states if s.name in fb.core]
    lines = _fused_steps_loop(2, K, pfs.stmts(fs.pre, 3) + pfc.stmts(fc.pre, 3), exits, False)
    lines += _fused_steps_loop(2, K, pas.stmts(as_.pre, 3) + pad_.stmts(ad.pre, 3), exits, True)
    # what each index of the state loop reads before its chains: (register, steps (0: a scalar), load)
    index = "".join(f"[{v}]" for v in major.local)
    reads = [(reg, K, f"{c_array(array)} + {pfs.index(Load(array, ('t0', *at[1:])))}")
             for (array, at), reg in pfs.vectors.items()]
    for s in forward_states:  # the carry into the round, as the forward saved it
        at = pfc.index(Load(f"rounds_{s.name}", ("r", *_state_loops(s, parallel)[2])))
        reads.append((f"cf_{s.name}", 0, f"F(to_f({c_array(f'rounds_{s.name}')}[{at}]))"))
    reads += [(f"ca_{s.name}", 0, f"cr_{s.name}{index}") for s in core]
    reads += [(scalar_name(f"st_{n}"), 0, f"st_{n}{index}") for n in major.accumulators]
    own = [v[len("i_"):] for v in major.local]
    ahead = len(own) == 1  # the next index's reads made while this one computes
    if ahead:
        lines += _next_index_loads(2, reads, major.local[0], "0")
    for i, a in enumerate(own):
        pad = "    " * (2 + i)
        lines += [f"{pad}#pragma unroll {FUSED_STATE_UNROLL}",
                  f"{pad}for (int i_{a} = 0; i_{a} < {size_var(a)}; ++i_{a}) {{  // one state value at a time"]
    depth = 2 + len(own)
    pad = "    " * depth
    for reg, steps, load in reads:
        if steps:
            lines.append(f"{pad}F {reg}[{steps}];")
            lines += ([f"{pad}#pragma unroll", f"{pad}for (int tt = 0; tt < {steps}; ++tt) {reg}[tt] = next_{reg}[tt];"]
                      if ahead else [f"{pad}load_steps<{steps}>({reg}, {load});"])
        else:
            lines.append(f"{pad}{'' if reg.startswith('v_') else 'F '}{reg} = {f'next_{reg}' if ahead else load};")
    if ahead:
        var = major.local[0]
        lines += [f"{pad}{{",
                  f"{pad}    const int {_next(var)} = min({var} + 1, {size_var(own[0])} - 1);",
                  *_next_index_loads(depth + 1, reads, var, _next(var), declare=False), f"{pad}}}"]
    lines += _summary_identity(forward_states, pad, _forward_pairs(fb))
    lines += _fused_steps_loop(depth, K, pfs.stmts(fs.body, depth + 1), exits, False)
    lines += _combine_state_values(forward_states, lambda n: f"cf_{n}", pad, pairs=_forward_pairs(fb))
    lines += _fused_steps_loop(depth, K, pfc.stmts(fc.body, depth + 1), exits, False)
    lines += _summary_identity(core, pad, _core_pairs(fb))
    lines += _fused_steps_loop(depth, K, pas.stmts(as_.body, depth + 1), exits, True)
    lines += _combine_state_values(core, lambda n: f"ca_{n}", pad, reverse=True, pairs=_core_pairs(fb))
    lines += [f"{pad}cr_{s.name}{index} = ca_{s.name};  // the carry past the round" for s in core]
    body = [Assign(Load(atomics[s.target.array, s.target.index], (STEP,)), s.value)
            if s.op == "atomic+=" and (s.target.array, s.target.index) in atomics else s for s in ad.body]
    if exits:
        lines += [f"{pad}for (int tt = 0; tt < {K}; ++tt) {reg}[tt] = F(0);" for reg in atomics.values()]
    lines += _fused_steps_loop(depth, K, pad_.stmts(body, depth + 1), exits, True)
    if summed:
        lines += _block_sum_lines(depth, atomics, pad_, K)
    for (array, at), reg in ({} if summed else atomics).items():  # this lane's K terms of each, at once
        target = f"{c_array(array)} + {pad_.index(Load(array, ('t0', *at[1:])))}"
        if exits:
            lines += [f"{pad}if (t0 < L) {{",
                      f"{pad}    if ((unsigned long long)({target}) % {4 * _vector_width(K)} == 0) "
                      f"add_steps<{K}>({target}, {reg});",
                      f"{pad}    else for (int tt = 0; tt < nt; ++tt) atomicAdd({target} + tt, {reg}[tt]);",
                      f"{pad}}}"]
        else:
            lines.append(f"{pad}add_steps<{K}>({target}, {reg});")
    lines += [f"{pad}st_{n}{index} = {scalar_name(f'st_{n}')};" for n in major.accumulators]
    lines += ["    " * (depth - 1 - i) + "}" for i in range(len(own))]
    lines += _fused_steps_loop(2, K, pad_.stmts(ad.post, 3), exits, True)
    return lines


def _spread(fb: FusedBackward, sizes: dict[str, int], summed: bool) -> int:
    """How many indices of the parallel axes but the last the fused backward's blocks take in turn
    (0: blocks in order). Where the block sums (`_block_sums`) add into arrays over the last axis
    (Mamba-1's grad_B[b, n, t], summed over d), a grid in order has the blocks running at once take
    neighbouring d of one b and add into the same addresses; in turns over b they spread over the
    batch, fewer of them adding into one address at once. In Mamba-1's backward (bench/backward_variants.py)
    spread was a little faster than in order at B8 D1536 L2048 and B32 D512 L180, and about even at
    B4 D2048 L2048 and B16 D1024 L1024. (Each block starting its loop over n at its own index as well
    helped B8 D1536 L2048 but slowed five other shapes, B1 to B32: not kept.) See
    bench/results/2026-11-27-from-code-comments.md."""
    spread = math.prod(sizes[a] for a in fb.parallel[:-1]) if summed else 0
    return spread if spread > 1 else 0


def fused_backward_shared_bytes(fb: FusedBackward, value_bytes: int, steps_per_lane: int, state_major: bool) -> int:
    """Static shared memory the fused backward kernel declares (`fused_backward_context`): each staged
    sequence and output, a round of 32 K steps (and a pad word every K) per warp; where it runs
    state-major and adds float32 terms atomically, two copies of the warps' terms of each summed
    array (the block sums; counted wherever they may run, so an upper bound)."""
    kernels = (fb.forward_summary, fb.forward_carries, fb.adjoint_summary, fb.adjoint)
    staged = len(_stageable(fb.arrays, kernels, set(fb.parallel)))
    warps = BLOCK // WARP
    total = staged * warps * WARP * (steps_per_lane + 1)
    if state_major and value_bytes == 4 and fb.partials.atomic and fused_state_major(fb) is not None:
        total += 2 * len(fb.partials.atomic) * warps * WARP * steps_per_lane
    return total * value_bytes


def fused_backward_source(fb: FusedBackward, ctype: str, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                          steps_per_lane: int, state_major: bool = False) -> str:
    """CUDA C of the fused backward kernel (kernels/warp/backward_analysis.py) for these array layouts
    (`state_major`: see `fused_backward_context`)."""
    def build():
        context = fused_backward_context(fb, arrays, sizes, steps_per_lane, state_major)
        return render(fb.backward.adjoint.name, "fused backward", ctype, [context], has_half(arrays),
                      exact_products(fb.backward.adjoint))
    return with_free_array_names(set(arrays), build)


def _forward_pairs(fb: FusedBackward) -> dict[str, str]:
    """The forward's complex diagonal states (real part's -> imaginary part's)."""
    return complex_pairs(fb.backward.forward)


def _core_pairs(fb: FusedBackward) -> dict[str, str]:
    """The adjoint recurrences' complex diagonal states (real part's -> imaginary part's): where the
    forward's are complex, so are their adjoints (the conjugate coefficient, in reverse time)."""
    return {re: im for re, im in complex_pairs(fb.adjoint.program).items() if re in fb.core}

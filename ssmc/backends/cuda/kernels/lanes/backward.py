"""CUDA C of the lanes backward (kernels/lanes/backward_analysis.py): the fused backward with G lanes a row, each
owning S values of the states' axis, the chunks of T steps last first.

A block holds R = threads / G rows (consecutive indices of the row axis under one index of the
others), as the forward's lanes kernel (lanes.py). Per chunk:

    stage   its row sequences (u, delta, z, grad_y) and sequences along the states' axis (B, C) into
            shared memory (zeros past L)
    pre     each thread its row's steps g, g + G, ... (consecutive lanes on consecutive steps: no bank
            conflicts): the per-step values into shared memory; its sums over time (grad_D) in a register
    lanes   the chunk's forward from the carry the forward saved, the state every G steps into shared
            memory; then per G steps, last first, per state value: the carries again, the adjoint
            backwards; its sums over the states' axis a register a step, then across the row's lanes
            (`reduce_scatter`); its terms of the sums over the rows across the warp's rows
            (`rows_reduce_scatter`: each sum then held by one lane), into the warp's slab
    post    each thread its row's steps: the gradients of the row sequences
    flush   the warps' slabs added, into the summed arrays (one atomic add per block, value and step)

Two forms (`lanes_backward_shape`): chunks of T = 32 steps, and where the rows are many the bounded
kernel, chunks of 16 steps at 8 blocks an SM (SHORT_CHUNK's comment). For Mamba-1 fp32 "b d t" this
backward kernel beat the warp kernel's fused backward at B32 D512 L180, B8 D1536 L2048 and B16 D1024
L2048 (bench/lanes_backward.py), and the bounded kernel matched the hand-written probe of the 32-step
form (bench/lanes_backward_probe.py); see bench/results/2026-11-27-from-code-comments.md. It runs
wherever the training forward is the lanes kernel (`FusedBackwardRunner.backward_lanes`).
"""

from __future__ import annotations

from .....lowering.loops import Assign, Load, Var, accesses
from .....lowering.plan import size_var
from ...hardware import BOUNDED_LANE_VALUES, SM_BLOCK_SHARED, SM_SHARED, STATIC_SHARED, WARP, bounded_blocks
from ...options import options
from ...printer import C_TYPES, ArraySpec, CPrinter, _scalar_names, _store, c_array, with_free_array_names
from ...source import exact_products, has_half, render
from .. import template
from ..thread import _unflatten
from ..warp.backward_analysis import FusedBackward
from ..warp.forward import _predicated
from .analysis import StateLanes
from .backward_analysis import LOG2E, LanesBackward
from .forward import CHUNK, _lane_loops, lane_groups, sum_identity

BLOCKS = (128, 64, 32)  # threads a block: the first whose shared memory fits

# The bounded kernel: chunks of SHORT_CHUNK steps, BOUNDED_BLOCK threads a block, at most
# BOUNDED_REGISTERS registers a thread (`__launch_bounds__`), so that 8 blocks run on an SM where the
# kernel of 32-step chunks takes about 230 registers and 46 KB of shared memory, 4 an SM. It runs where
# the rows' lanes are more threads than that kernel runs at once on the GPU (UNBOUNDED_WAVE_THREADS_AN_SM an SM),
# its shared memory fits 8 blocks, and a lane's body holds few values (S x G at most BOUNDED_LANE_VALUES:
# more would spill at 128 registers). For Mamba-1 N16 fp32 "b d t" the bounded backward kernel beat the
# kernel of 32-step chunks at B8 D1536 L2048 (there the warp kernel's fused backward too), B32 D512 L180
# and B64 D1024 L1024, but was slower at B4 D2048 L512 (8192 rows, one wave of the unbounded kernel); see
# bench/results/2026-11-27-from-code-comments.md.
SHORT_CHUNK = 16
BOUNDED_BLOCK = 64
UNBOUNDED_WAVE_THREADS_AN_SM = 4 * 64

# A staged sequence's next chunk is loaded into registers while a chunk computes where a thread takes
# at most this many of its values (Mamba-1 at n = 16: 8 of each of u, delta, z, grad_y, B, C); more
# (B and C at n = 64, 8 lanes a row, 32 threads a block: 64 each) spilled, so those load at the
# chunk's start; so too everything where a lane's body takes more than PREFETCH_LANE_VALUES state values
# and steps (S x G) at once (n = 64: 8 x 8; with 16 values a thread prefetched it spilled 196 bytes)
PREFETCH_VALUES = 8
PREFETCH_LANE_VALUES = 16


def shared_bytes(lb: LanesBackward, sizes: dict[str, int], axis: str, groups: int, block: int,
                 value_bytes: int, chunk: int = CHUNK) -> int:
    """Static shared memory of the kernel with `block` threads and chunks of `chunk` steps (module
    docstring's arrays)."""
    rows = block // groups
    per_lane = -(-sizes[axis] // groups)
    pitch = chunk + 4
    values = (rows * pitch * (len(lb.row_seqs) + len(lb.per_step)) + sizes[axis] * pitch * len(lb.state_seqs)
              + len(lb.atomic) * sizes[axis] * chunk * (block // WARP) + (chunk // groups) * per_lane * block)
    return values * value_bytes


def min_blocks(block: int, chunk: int) -> int:
    """The blocks an SM must hold at once (`__launch_bounds__`): those of the bounded kernel's registers."""
    return bounded_blocks(block) if chunk == SHORT_CHUNK else 1


def lanes_backward_shape(lb: LanesBackward, sizes: dict[str, int], axis: str, value_bytes: int,
                         rows: int) -> tuple[int, int] | None:
    """(threads a block, steps a chunk) of the lanes backward over `rows` rows (recurrences of the states'
    axis): the bounded kernel where it applies (SHORT_CHUNK's comment), else chunks of CHUNK steps in the
    most threads of `BLOCKS` whose shared memory fits `STATIC_SHARED`; None where none fits."""
    groups = lane_groups(sizes[axis])
    per_lane = -(-sizes[axis] // groups)
    bounded = shared_bytes(lb, sizes, axis, groups, BOUNDED_BLOCK, value_bytes, SHORT_CHUNK)
    blocks_an_sm = min_blocks(BOUNDED_BLOCK, SHORT_CHUNK)
    wave = UNBOUNDED_WAVE_THREADS_AN_SM * options().sm_count
    if (value_bytes == 4 and per_lane * groups <= BOUNDED_LANE_VALUES and BOUNDED_BLOCK // groups >= 1
            and rows * groups > wave and (bounded + SM_BLOCK_SHARED) * blocks_an_sm <= SM_SHARED):
        return BOUNDED_BLOCK, SHORT_CHUNK
    for block in BLOCKS:
        if block // groups >= 1 and shared_bytes(lb, sizes, axis, groups, block, value_bytes) <= STATIC_SHARED:
            return block, CHUNK
    return None


def lanes_backward_source(fb: FusedBackward, lb: LanesBackward, lanes: StateLanes, arrays: dict[str, ArraySpec],
                          sizes: dict[str, int], block: int, ctype: str, chunk: int = CHUNK) -> str:
    """CUDA C of the lanes backward of `fb` (split as `lb`, rows and axis as the forward's `lanes`)
    for these array layouts, `block` threads a block, chunks of `chunk` steps; the forward saved its
    carry into every chunk (``rounds_<h>``)."""
    def build():
        context = lanes_backward_context(fb, lb, lanes, arrays, sizes, block, ctype, chunk)
        return render(fb.backward.adjoint.name, "lanes backward", ctype, [context], has_half(arrays),
                      exact_products(fb.backward.adjoint))
    return with_free_array_names(set(arrays), build)


def lanes_backward_context(fb: FusedBackward, lb: LanesBackward, lanes: StateLanes, arrays: dict[str, ArraySpec],
                           sizes: dict[str, int], block: int, ctype: str = "float", chunk: int = CHUNK) -> dict:
    """The template's context for the lanes backward (module docstring); `ctype` the compute type,
    `chunk` its steps a chunk (SHORT_CHUNK: the bounded kernel).

    One function although long: it fills the template's slots in the order the kernel runs them
    (staging, forward carries, adjoint, sums, stores), and most slots read the same two dozen
    locals (lane buffers, the row index, the printers); split, they would travel as arguments."""
    k = fb.adjoint
    axis, row, var = lanes.axis, lanes.row_axis, lanes.var
    n = size_var(axis)
    groups = lane_groups(sizes[axis])
    rows = block // groups
    per_lane = -(-sizes[axis] // groups)
    steps_a_thread = chunk // groups
    bounded = chunk == SHORT_CHUNK  # the bounded kernel (8 blocks an SM): its loops rolled where they spilled
    rows_whole = sizes[row] % rows == 0  # no block has rows past the last
    index = {a.name: a for a in fb.arrays}
    registers = set(lb.step_registers) | {lb.forward_state[len("st_"):]}
    sums = dict(lb.sums)
    atomic_slot = {key: j for j, key in enumerate(lb.atomic)}  # (array, index) -> its place in the slab
    terms = 1
    while terms < len(lb.atomic) * groups:
        terms *= 2

    # printers: per row and step (pre, post: shared memory at [ch][tt]), per state index and step (lanes)
    per_row = {name: (lambda e: f"pv_{e.array}[ch][tt]") for name in lb.per_step}
    per_row |= {a: (lambda e: f"sr_{e.array}[ch][tt]") for a in lb.row_seqs}
    pp = CPrinter(k, arrays, sizes, views=per_row)
    in_lane = {name: (lambda e: f"{e.array}[tt]") for name in lb.per_step}
    in_lane |= {name: (lambda e: f"rg_{e.array}[tt]") for name in registers}
    in_lane |= {a: (lambda e: f"sr_{e.array}[ch][tb + tt]") for a in lb.row_seqs}
    in_lane |= {a: (lambda e: f"sl_{e.array}[{var}][tb + tt]") for a in lb.state_seqs}
    in_lane |= {p: (lambda e: f"rp_{e.array}[j]") for p in lb.lane_params}
    in_lane |= {LOG2E + p: (lambda e: f"rl_{e.array[len(LOG2E):]}[j]") for p in lb.log2e_params}
    pl = CPrinter(k, arrays, sizes, views=in_lane)
    lane_buffers = (lb.forward_state, *lb.adjoint_states)
    own = {name: (lambda e: f"{e.array}[j]") for name in lane_buffers}
    po = CPrinter(k, arrays, sizes, views=own)

    thread_carried = {f"st_{a}" for a in lb.thread_accumulators}
    pre = pp.stmts(_predicated(lb.pre, thread_carried), 0)
    adjoint_carried = {f"v_{s}" for s in lb.adjoint_states}
    adjoint_stmts = [Assign(Load("av", (f"{atomic_slot[s.target.array, s.target.index]} * G + tt",)), s.value)
                     if s.op == "atomic+=" else s for s in _predicated(lb.adjoint, adjoint_carried)]
    pl.buffers.add("av")
    lane_params_loads = []
    for name in lb.lane_params:
        at = next(e for s in lb.carries + lb.adjoint for e in accesses(s) if e.array in (name, LOG2E + name))
        at = Load(name, at.index)
        scaled = ([f"    rl_{name}[j] = rp_{name}[j] * F(1.4426950408889634);  // read as exp2(x * P log2 e)"]
                  if name in lb.log2e_params else [])
        lane_params_loads += ["#pragma unroll", "for (int j = 0; j < S; ++j) {", f"    const int {var} = g + j * G;",
                              f"    rp_{name}[j] = {var} < {n} ? F(to_f({c_array(name)}[{pl.index(at)}])) : F(0);",
                              *scaled, "}"]
    read_in_lane = [name for name in lb.per_step if name not in sums
                    and any(e.array == name for s in lb.carries + lb.adjoint for e in accesses(s))]
    forward_scalar = f"v_{lb.forward_state}"

    def group_values(pad: str) -> list[str]:  # a group's per-step values, from shared memory
        out = []
        for name in read_in_lane:
            out += [f"{pad}F {name}[G];", f"{pad}#pragma unroll",
                    f"{pad}for (int tt = 0; tt < G; ++tt) {name}[tt] = pv_{name}[ch][tb + tt];"]
        return out

    def guarded(body: list[str]) -> list[str]:  # lines (indented once) for the lane's state values only
        if sizes[axis] % groups == 0:
            return body
        return [f"    if ({var} < {n}) {{", *("    " + b for b in body), "    }"]

    def state_loop(pad: str, body: list[str]) -> list[str]:
        return [f"{pad}#pragma unroll", f"{pad}for (int j = 0; j < S; ++j) {{  // this lane's state values",
                f"{pad}    const int {var} = g + j * G;", *(pad + b for b in guarded(body)), f"{pad}}}"]

    def carries(start: str) -> list[str]:  # a state value's carries over the group's G steps, from `start`
        return [f"    {forward_scalar} = {start};", "    #pragma unroll", "    for (int tt = 0; tt < G; ++tt) {",
                *pl.stmts(lb.carries, 2), "    }"]

    # the chunk's forward: the state before every G steps into shared memory
    # (groups wholly past L, in the last chunk, are skipped: their values are never read)
    forward = ["#pragma unroll 1", "for (int tb = 0; tb < T && t0 + tb < L; tb += G) {", *group_values("    ")]
    forward += [f"    F rg_{r}[G];  (void)rg_{r};" for r in sorted(registers)]
    forward += state_loop("    ", [f"    ck[(tb / G * S + j) * BLOCK + threadIdx.x] = {lb.forward_state}[j];",
                                   *carries(f"{lb.forward_state}[j]"),
                                   f"    {lb.forward_state}[j] = {forward_scalar};"])
    forward.append("}")

    # the adjoint, G steps at a time, last first (a second copy for whole chunks, without the steps'
    # `live` selects, was slightly faster at B32 D512 L180 and as much slower at B8 D1536 L2048: not
    # kept; see bench/results/2026-11-27-from-code-comments.md)
    per_lane_writes = (terms * groups + WARP - 1) // WARP  # the sums over the rows a lane holds after the scatter

    adj = ["#pragma unroll 1", "for (int tb = min(T, L - t0 + G - 1) / G * G - G; tb >= 0; tb -= G) {",
           *group_values("    ")]
    for name, op in sums.items():
        adj += [f"    F {name}[G];", "    #pragma unroll",
                f"    for (int tt = 0; tt < G; ++tt) {name}[tt] = {sum_identity(op)};"]
    inner = [f"    F rg_{r}[G];  (void)rg_{r};" for r in sorted(registers)]
    if lb.atomic:
        inner += [f"    F av[{terms}];  // the terms of the sums over the rows, [array * G + step]",
                  "    #pragma unroll", f"    for (int e = 0; e < {terms}; ++e) av[e] = F(0);"]
    chain = [*carries("ck[(tb / G * S + j) * BLOCK + threadIdx.x]"),
             *(f"    v_{s} = {s}[j];" for s in lb.adjoint_states),
             "    #pragma unroll", "    for (int tt = G - 1; tt >= 0; --tt) {",
             "        const bool live = t0 + tb + tt < L;  // a step past L changes nothing",
             *pl.stmts(adjoint_stmts, 2), "    }", *(f"    {s}[j] = v_{s};" for s in lb.adjoint_states)]
    inner += guarded(chain)
    if lb.atomic:
        if not rows_whole:  # a row past the last: its terms are the last row's again
            inner += ["    #pragma unroll", f"    for (int e = 0; e < {terms}; ++e) av[e] = valid ? av[e] : F(0);"]
        inner += [f"    rows_reduce_scatter<{terms}, G>(av, lane);", "    #pragma unroll",
                  f"    for (int e = 0; e < {per_lane_writes}; ++e)",
                  f"        if (slab_at[e] >= 0{'' if sizes[axis] % groups == 0 else f' && {var} < {n}'}) "
                  "slab_w[slab_at[e] + j * G * T + tb] = av[e];"]
    adj += [f"    {line}" for line in [
        "#pragma unroll", "for (int j = 0; j < S; ++j) {  // this lane's state values",
        f"    const int {var} = g + j * G;", *inner, "}"]]
    for name, op in sums.items():
        fn = "SumOp" if op == "+=" else "MaxOp"
        adj.append(f"    pv_{name}[ch][tb + g] = reduce_scatter<G>({name}, g, {fn}());")
    adj.append("}")

    slab_setup = []
    if lb.atomic:  # where the lane's sums go in its warp's slab, [array][state index][step]: -1 for none
        slab_setup = [f"int slab_at[{per_lane_writes}];  // this lane's sums of the rows: offsets at state index g",
                      "{", f"    const int first = rows_scatter_first<{terms}, G>(lane);", "    #pragma unroll",
                      f"    for (int e = 0; e < {per_lane_writes}; ++e) {{", "        const int at = first + e;",
                      f"        slab_at[e] = first >= 0 && at < {len(lb.atomic)} * G",
                      f"                     ? (at / G * {n} + g) * T + at % G : -1;",
                      "    }", "}", f"F* const slab_w = slab[threadIdx.x / {WARP}];"]

    # the block's sums over the rows into memory: consecutive threads on consecutive steps (a warp's
    # atomic adds one request), the loop's count known (its index arithmetic folds; unrolled 8, "b t d"
    # spilled; the bounded kernel's, unrolled 4, spilled 32 bytes at B32 D512 L180)
    flush = []
    if lb.atomic:
        flush = ["#pragma unroll 1" if bounded else "#pragma unroll 4",
                 f"for (int k = 0; k < ({n} * T + BLOCK - 1) / BLOCK; ++k) {{",
                 "    const int i = threadIdx.x + k * BLOCK;",
                 f"    if (({n} * T) % BLOCK != 0 && i >= {n} * T) break;",
                 f"    const int {var} = i / T, tt = i % T, t = t0 + tt;", "    if (t >= L) continue;"]
        for j, (array, at) in enumerate(lb.atomic):
            flush += [f"    F v{j} = F(0);", "    #pragma unroll",
                      f"    for (int w = 0; w < BLOCK / {WARP}; ++w) v{j} += slab[w][{j} * {n} * T + i];",
                      f"    atomicAdd(&{c_array(array)}[{po.index(Load(array, at))}], v{j});"]
        flush.append("}")

    # staging: the chunk before's values loaded into registers while this one computes (`prefetch`,
    # chunk `cc`), stored into shared memory at its start (`stage`)
    prefetch, stage, declare, aligned = [], [], [], []
    vector_type = ctype == "float"
    for name in lb.row_seqs + lb.state_seqs:
        a, spec = index[name], arrays[name]
        staged_row = name in lb.row_seqs
        count, rv = ("R", "r") if staged_row else (n, "s")
        at = {"t": "t", row: f"min(r0 + {rv}, {size_var(row)} - 1)"} if staged_row else {"t": "t", axis: rv}

        def src(t: str, name=name, at=at, a=a) -> str:  # the array's value at step `t`, the staged row
            index = tuple(t if ax == "t" else at.get(ax, f"p_{ax}") for ax in a.axes)
            return f"{c_array(name)}[{po.index(Load(name, index))}]"

        dst = f"{'sr' if staged_row else 'sl'}_{name}"
        vector = _in_vectors(spec, ctype)
        if vector:  # 4 consecutive steps a load where the arrays are aligned (`vec`)
            items = f"{count} * (T / 4)"
            mapping = f"const int {rv} = i / (T / 4), tt = (i % (T / 4)) * 4, t = cc * T + tt;"
            load = [f"if (vec && t + 4 <= L) load_steps<4>(pf_{name}[k], &{src('t')});",
                    f"else for (int q = 0; q < 4; ++q) pf_{name}[k][q] = t + q < L ? F(to_f({src('t + q')})) : F(0);"]
            store = [f"store_steps<4>(&{dst}[{rv}][tt], pf_{name}[k]);"]
            declare.append(f"F pf_{name}[({items} + BLOCK - 1) / BLOCK][4];  // the next chunk's, 4 steps a load")
            aligned.append(f"(unsigned long long){c_array(name)} % 16 == 0")
        else:
            items = f"{count} * T"
            mapping = (f"const int {rv} = i / T, tt = i % T, t = cc * T + tt;" if spec.strides[0] == 1
                       else f"const int {rv} = i % {count}, tt = i / {count}, t = cc * T + tt;")
            load = [f"pf_{name}[k] = t < L ? F(to_f({src('t')})) : F(0);"]
            store = [f"{dst}[{rv}][tt] = pf_{name}[k];"]
            declare.append(f"F pf_{name}[({items} + BLOCK - 1) / BLOCK];  // the next chunk's")
        values = (rows if staged_row else sizes[axis]) * chunk
        if per_lane * groups > PREFETCH_LANE_VALUES or -(-values // block) > PREFETCH_VALUES:
            # too many registers: loaded when the chunk starts
            declare.pop()
            load = [x.replace(f"pf_{name}[k]", "v") for x in load]
            load = [f"F v{'[4]' if vector else ''};", *load,
                    *(x.replace(f"pf_{name}[k]", "v") for x in store)]
            parts = ((stage, load),)
        else:
            parts = ((prefetch, load), (stage, store))
        for lines, body in parts:
            # loads at the chunk's start in flight 4 at a time (unrolled whole, n = 64's 32 vectors of
            # B and C were loaded at once and spilled)
            unroll = "#pragma unroll" if len(parts) == 2 else "#pragma unroll 4"
            lines += [unroll, f"for (int k = 0; k < ({items} + BLOCK - 1) / BLOCK; ++k) {{",
                      "    const int i = threadIdx.x + k * BLOCK;", f"    if (i >= {items}) break;",
                      f"    {mapping}  (void)t;", *("    " + b for b in body), "}"]

    # the post phase's outputs: a thread's consecutive steps in registers, stored as vectors where the
    # array is float32 with time contiguous and aligned, its steps all within L (whole 32-byte sectors:
    # one value a thread every G steps left the sectors of long sequences half written)
    post_views = dict(per_row)
    stores = list(dict.fromkeys(s.target.array for s in lb.post if isinstance(s.target, Load)
                                and index.get(s.target.array) is not None and index[s.target.array].role == "out"))
    post_views |= {name: (lambda e: f"o_{e.array}[s_q]") for name in stores}
    post_reads = []
    if vector_type:  # a thread's steps read from shared memory as vectors: [ch][g S' + s_q] one value at a
        # time had 4-way bank conflicts (rows 36 words apart, threads 8 words apart)
        read = list(dict.fromkeys(e.array for s in lb.post for e in accesses(s)
                                  if e.array in lb.per_step or e.array in lb.row_seqs))
        post_views |= {name: (lambda e: f"vp_{e.array}[s_q]") for name in read}
        for name in read:
            staged = f"{'pv' if name in lb.per_step else 'sr'}_{name}[ch][g * {steps_a_thread}]"
            post_reads += [f"F vp_{name}[{steps_a_thread}];", f"load_steps<{steps_a_thread}>(vp_{name}, &{staged});"]
    post = CPrinter(k, arrays, sizes, views=post_views).stmts(lb.post, 0)
    post_store = []
    for name in stores:
        spec = arrays[name]
        target = next(s.target for s in lb.post if isinstance(s.target, Load) and s.target.array == name)
        plain = f"{c_array(name)}[{po.index(target)}]"
        scalar = [f"for (int s_q = 0; s_q < {steps_a_thread}; ++s_q) {{",
                  f"    const int t = t0 + g * {steps_a_thread} + s_q;",
                  f"    if (valid && t < L) {plain} = {_store(spec.dtype, f'o_{name}[s_q]')};", "}"]
        if _in_vectors(spec, ctype):
            first = po.index(Load(name, (f"t0 + g * {steps_a_thread}", *target.index[1:])))
            post_store += [f"if (valid && t0 + (g + 1) * {steps_a_thread} <= L && "
                           f"(unsigned long long){c_array(name)} % 16 == 0) {{",
                           f"    store_steps<{steps_a_thread}>(&{c_array(name)}[{first}], o_{name});",
                           "} else {", *("    " + x for x in scalar), "}"]
        else:
            post_store += scalar

    # before the chunks and after them; first the forward's scalars its lowering hoisted out of the step
    # (``fs_m4 = tanh(0.5)``), which the pre phase and the carries read
    hoisted = [s for s in fb.forward_summary.setup if isinstance(s, Assign) and isinstance(s.target, Var)]
    setup = _lane_loops(hoisted + k.setup, lanes, po, False)
    rounds = f"rounds_{lb.forward_state[len('st_'):]}"
    at = po.index(Load(rounds, ("c", *_state_index(fb, var))))
    load_carry = state_loop("", [f"    {lb.forward_state}[j] = F(to_f({c_array(rounds)}[{at}]));"])
    finish = _lane_loops(k.finish, lanes, po, True)
    for name in lb.accumulators:
        axes_ = fb.partials.accumulators[name]
        at = tuple(f"p_{a}" if a in fb.parallel else f"i_{a}" for a in axes_) or ("0",)
        target = f"{c_array(f'final_{name}')}[{po.index(Load(f'final_{name}', at))}]"
        finish += state_loop("", [f"    if (valid) atomicAdd(&{target}, st_{name}[j]);"])
    for name in lb.thread_accumulators:
        axes_ = fb.partials.accumulators[name]
        at = tuple(f"p_{a}" for a in axes_) or ("0",)
        target = f"{c_array(f'final_{name}')}[{po.index(Load(f'final_{name}', at))}]"
        finish += ["{  // the row's lanes' sums, added into the result",
                   f"    F v = st_{name};", "    #pragma unroll",
                   "    for (int off = G / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);",
                   f"    if (valid && g == 0) atomicAdd(&{target}, v);", "}"]
    def row_index(ch: str) -> list[str]:  # the flat index p of the lane's row `ch` and its axes' p_<axis>
        return [f"const long long p = q * {size_var(row)} + min(r0 + {ch}, {size_var(row)} - 1);",
                *_unflatten(fb.parallel)]

    # the finish's indices derived anew from the thread index: kept from the kernel's start they held a
    # register across every chunk, which the bounded kernel spilled (B32 D512 L180, NVRTC 13.5 -ftz=true)
    finish = ["{  // the row's indices read anew", "    const int tid_f = fresh_thread_index();",
              "    const int g = tid_f % G;  (void)g;", *("    " + x for x in row_index("tid_f / G")),
              *("    " + x for x in finish), "}"]

    params = [("const " if index[a.name].role in ("seq", "param", "init", "rounds") else "")
              + f"{C_TYPES[arrays[a.name].dtype]}* __restrict__ {c_array(a.name)}" for a in fb.arrays]
    scalars = [f"F {name} = F(0);" for name in dict.fromkeys(
        [*lb.scalars, *(f"v_{s}" for s in lane_buffers), *_scalar_names(hoisted + k.setup)])]
    return {
        "template": template("lanes/backward.cu.j2"),
        "lanes_backward": True,
        "name": fb.name,
        "block": block,
        "min_blocks": min_blocks(block, chunk),
        "comment": (f"{fb.backward.adjoint.name}: {groups} lanes per [{' '.join(fb.parallel)}], each owning "
                    f"{per_lane} {axis}; {rows} rows per block, chunks of {chunk} steps last first"),
        "params": params,
        "constants": [f"constexpr int {size_var(a)} = {sizes[a]};" for a in sorted({a for a in sizes})
                      if a in {x for arr in fb.arrays for x in arr.axes}]
        + [f"constexpr int G = {groups}, S = {per_lane}, R = {rows}, T = {chunk}, P = {chunk + 4}, BLOCK = {block};"
           f"  // lanes a row, state values a lane, rows a block, steps a chunk"],
        "row_size": size_var(row),
        "rows_whole": rows_whole,
        "shared": [f"__shared__ __align__(16) F sr_{a}[R][P];" for a in lb.row_seqs]
        + [f"__shared__ __align__(16) F sl_{a}[{n}][P];" for a in lb.state_seqs]
        + [f"__shared__ __align__(16) F pv_{name}[R][P];  // per row and step of the chunk" for name in lb.per_step]
        + ([f"__shared__ F slab[BLOCK / {WARP}][{len(lb.atomic)} * {n} * T];  // each warp's sums over its rows"
            "  (a lane's store each: no shared atomic adds, which took half the kernel's time)"] if lb.atomic else [])
        + ["__shared__ F ck[T / G * S * BLOCK];  // the state before every G steps, a column a thread"],
        "row_index": row_index("ch"),
        "declarations": scalars + [f"F {name}[S];" for name in lane_buffers]
        + [f"F rp_{name}[S];" for name in lb.lane_params] + [f"F rl_{name}[S];" for name in lb.log2e_params],
        "setup": lane_params_loads + setup + slab_setup,
        "stage": stage,
        "prefetch": prefetch,
        "prefetch_declarations": declare,
        "aligned": " && ".join(aligned) or "false",
        "post_declarations": [f"F o_{name}[{steps_a_thread}];" for name in stores] + post_reads,
        "post_store": post_store,
        "load_carry": load_carry,
        "steps_a_thread": steps_a_thread,
        # the bounded kernel's pre phase a step at a time: unrolled, B8 D1536 L2048 spilled 12 bytes
        "pre_unroll": 1 if bounded else 0,
        "pre": pre,
        "forward": forward,
        "adjoint": adj,
        "flush": flush,
        "post": post,
        "finish": finish,
    }


def _in_vectors(spec: ArraySpec, ctype: str) -> bool:
    """Whether a sequence's consecutive steps are read (staging: 4 a load) or written (post phase: a
    thread's steps) as vectors: float32, time contiguous, every other stride a multiple of 4 (the kernel
    checks the pointer's alignment)."""
    return ctype == "float" and spec.dtype == "float32" and spec.strides[0] == 1 and all(
        st % 4 == 0 for st in spec.strides[1:])


def _state_index(fb: FusedBackward, var: str) -> tuple[str, ...]:
    """The forward state's index but its round (``rounds_<h>[c, ...]``): p_<parallel>, the lane's state index."""
    (state,) = fb.backward.forward.states
    return tuple(f"p_{a}" if a in fb.parallel else var for a in state.axes)


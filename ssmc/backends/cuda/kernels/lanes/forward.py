"""CUDA C of the "lanes" kernel (kernels/lanes/analysis.py): G lanes a row, each owning S values of the
states' own axis for the whole sequence, time in order, chunks of CHUNK steps through shared memory (fewer,
`lanes_chunk`, where a long state axis's staged sequences would not fit: the strategy then takes calls of one
chunk only; a call of one step, a decode step, runs the step form instead: step.py).

A block holds R = threads / G rows: consecutive indices of the last parallel axis (Mamba-1's d) under
one index of the others (b), so the sequences along the states' axis (B[b, n, t], C) are staged once
for all of them. Per chunk (buffers of two chunks: the next one's copies are in flight, `cp.async`,
while this one computes):

    pre   the block's threads over rows x steps: the step's values (dt, dt u) into shared memory
    body  each lane, G steps at a time: per state value, its chain over the G steps (registers),
          the sums over the states' axis one register per step, then across the row's G lanes by
          a reduce-scatter (lane g gets step g's sum), into shared memory
    post  the block's threads over rows x steps: the outputs, stored along the arrays' contiguous axis

In hand-written probes of this kernel (Mamba-1 B8 D1536 L2048 N16 fp32), this staging, 4 state values
a lane and fast softplus / silu ran far faster than synchronous staging with per-step shuffles
of the sums; the generated kernel gained from exp2 of a param scaled by log2 e, softplus's series and
the vector post phase, and ran faster than both the warp kernel and mamba-ssm (bench/gpu_peers.py; see
bench/results/2026-11-27-from-code-comments.md). Where a training step's forward runs so, it also
saves the fused backward's round carries (`_save_rounds`).
"""

from __future__ import annotations

import math

from .....lowering.kernel import Kernel, Lowered
from .....lowering.loops import Assign, Buffer, Call, Load, Loop, accesses, loads, subexpressions
from .....lowering.plan import size_var
from ...hardware import BOUNDED_LANE_VALUES, SM_BLOCK_SHARED, SM_SHARED, STATIC_SHARED, bounded_blocks
from ...options import options
from ...printer import C_TYPES, ArraySpec, CPrinter, Threads, _scalar_names, _store, c_array, with_free_array_names
from ...source import exact_products, has_half, render
from .. import template
from ..thread import _unflatten
from ..warp.analysis import scalar_name
from ..warp.forward import _predicated
from .analysis import StateLanes

CHUNK = 32              # steps a chunk stages (a multiple of every G)
# chunks of fewer steps where CHUNK's buffers fit no block: 2 x N values of each sequence along the states'
# axis (B, C) at N = 128 take 72 KiB in chunks of 32; a thread per recurrence, the fallback, keeps its N
# state values in local memory and reads them a row a thread (uncoalesced)
SHORT_CHUNKS = (16, 8)
STATES_PER_LANE = 4     # state values a lane owns where the axis allows (a little faster than 2 in the probes)
MAX_LANES = 8           # lanes a row: a lane holds G steps of each per-step value (registers)
LANE_REGISTERS = 96     # 4-byte registers the per-step and per-lane arrays may take (else: another strategy)
LANES_BLOCKS = (128, 64, 32)  # threads per block, the first whose shared memory fits
STEPS_A_THREAD = 4      # consecutive steps of a row a thread takes in the pre and post phases (16-byte vectors)
# The block's loops over rows x steps (copies, pre, post) run T / G iterations a thread: unrolled up
# to this many (Mamba-1's G = 4: 8, all of them; G = 1 unrolled all 32 and a random spec's kernel
# took 255 registers and spilled)
PHASE_UNROLL = 8
UNBOUNDED_LANES_BLOCKS = 3  # blocks an SM of an unbounded lanes kernel (up to 148 registers, 128 threads)
# blocks an SM of a short-chunk kernel (a decode step at a long state axis): unbounded, Mamba-1's N = 128 step
# (16 state values a lane) took 243 registers, 2 blocks of 4 warps an SM, for a step that only streams its
# states; 3 an SM fit 168 registers unspilled (4: 128, spilled)
SHORT_CHUNK_BLOCKS = 3


def lane_groups(n: int, per_lane: int = STATES_PER_LANE) -> int:
    """Lanes per row for a state axis of `n` values: a power of two, about n / per_lane, at most MAX_LANES."""
    groups = 1
    while groups < MAX_LANES and groups * per_lane < n:
        groups *= 2
    return groups


def hosted_sums(lanes: StateLanes) -> dict[str, str]:
    """The body's sums over the states' axis (by name) kept in the chunk buffer of a row sequence
    that only the pre phase reads (Mamba-1's sum_n h C in delta's): the pre phase is done with
    that buffer when the body writes the sums, the post phase reads them, and the buffer takes the
    chunk after next only once every thread is past the post phase (the barrier at the chunk's
    start). One [R][P] array of shared memory less a sum: Mamba-1's blocks of 128 threads now fit
    the 48 KiB of static shared memory (46080 bytes; blocks of 64 took 29952 before), 4 an SM, so
    at B32 D512 its 512 blocks run in one wave on 132 SMs, where 1024 blocks of 64 threads, 7 an
    SM, ran in two (the kernel took clearly longer at B32 than at B28, whose blocks fit one wave);
    see bench/results/2026-11-27-from-code-comments.md."""
    later = {e.array for s in lanes.major.body + lanes.major.post for e in accesses(s)}
    hosts = [a for a in lanes.row_seqs if a not in later]
    return dict(zip((name for name, _ in lanes.sums), hosts))


def row_params(lanes: StateLanes) -> list[str]:
    """Arrays the pre and post phases read at their row's own index only (params along the row axis:
    Mamba-1's delta_bias[d] and D[d]), staged once per block in shared memory (``sq_<name>[r]``). Read
    from global memory per row and step, each was a load the phase then waited on: ncu's source
    counters of Mamba-1's forward (B8 D1536 L2048) put stall samples on the add after delta_bias's
    load and on the multiply after D's (see bench/results/2026-11-27-from-code-comments.md)."""
    at_row = (f"p_{lanes.row_axis}",)
    reads = [e for s in lanes.major.pre + lanes.major.post for e in loads(s.value)]
    named = {e.array for e in reads if e.index == at_row} - set(lanes.row_seqs) - set(lanes.major.per_step)
    return sorted(n for n in named if all(e.index == at_row for e in reads if e.array == n))


def pitch(chunk: int) -> int:
    """A staged row's length: rows start on 16 bytes; 8 rows read as vectors hit distinct banks."""
    return chunk + 4


def lanes_chunk(lanes: StateLanes, sizes: dict[str, int], groups: int, value_bytes: int) -> int:
    """Steps a chunk of the lanes kernel stages: CHUNK where its buffers fit a block of `LANES_BLOCKS`,
    else the one of SHORT_CHUNKS whose buffers fit the most threads a block, the longer of equals (CHUNK
    where none fits: `lanes_block` then refuses)."""
    def most_threads(chunk: int) -> int:
        return max((block for block in LANES_BLOCKS if block // groups >= 1 and lanes_shared_bytes(
            lanes, sizes, groups, block, value_bytes, chunk) <= STATIC_SHARED), default=0)
    if most_threads(CHUNK):
        return CHUNK
    best = max(SHORT_CHUNKS, key=lambda chunk: (most_threads(chunk), chunk))
    return best if most_threads(best) else CHUNK


def lanes_block(lanes: StateLanes, sizes: dict[str, int], groups: int, value_bytes: int) -> int | None:
    """Threads per block of the lanes kernel (the most of `LANES_BLOCKS` whose staged chunks of
    `lanes_chunk` steps and per-step values fit `STATIC_SHARED`), or None: none fits, or a lane's
    register arrays (G steps of each per-step value and sequence along the states' axis, S values of
    each buffer and param along it) would take more than LANE_REGISTERS, or (float64) the body calls a
    function other than exp: libdevice's double tanh / erf, unrolled over the S x G values and steps,
    overflow the registers (a random spec's gelu of a sequence along n spilled 44 bytes at n = 33)."""
    per_lane = -(-sizes[lanes.axis] // groups)
    arrays = (groups * (len(lanes.major.per_step) + len(lanes.state_seqs))
              + per_lane * (len(lanes.lane_buffers) + len(lanes.lane_params)))
    if arrays * value_bytes // 4 > LANE_REGISTERS:
        return None
    if value_bytes == 8 and any(isinstance(e, Call) and e.fn not in ("exp", "exp2")
                                for s in lanes.major.body for e in subexpressions(s.value)):
        return None
    chunk = lanes_chunk(lanes, sizes, groups, value_bytes)
    for block in LANES_BLOCKS:
        if (block // groups >= 1
                and lanes_shared_bytes(lanes, sizes, groups, block, value_bytes, chunk) <= STATIC_SHARED):
            return block
    return None


def lanes_shared_bytes(lanes: StateLanes, sizes: dict[str, int], groups: int, block: int, value_bytes: int,
                       chunk: int = CHUNK) -> int:
    """Static shared memory of the lanes kernel at `block` threads: two chunks of `chunk` steps of each
    staged sequence, the per-step values of a chunk, the staged row params."""
    rows = block // groups
    values = (2 * rows * len(lanes.row_seqs) + 2 * sizes[lanes.axis] * len(lanes.state_seqs)
              + rows * (len(lanes.major.per_step) - len(hosted_sums(lanes))))
    return (values * pitch(chunk) + rows * len(row_params(lanes))) * value_bytes


def lane_blocks(k: Kernel, sizes: dict[str, int], groups: int, block: int) -> int:
    """Blocks of the lanes kernel `k` (`groups` lanes a row, `block` threads a block): one per index of
    the parallel axes but the last, times the blocks of rows (block / groups a block) along the last."""
    last = sizes[k.parallel[-1]]
    return math.prod(sizes[a] for a in k.parallel[:-1]) * -(-last // (block // groups))


def lanes_min_blocks(lanes: StateLanes, k: Kernel, sizes: dict[str, int], groups: int, block: int,
                     ctype: str) -> int:
    """The blocks an SM must hold at once (`__launch_bounds__`): as many as the kernel's shared memory
    lets, at most those of BOUNDED_REGISTERS a thread, where the grid has more blocks than the SMs
    hold at UNBOUNDED_LANES_BLOCKS each, the kernel is float and a lane's body holds at most
    BOUNDED_LANE_VALUES state values x steps; else 1 (unbounded). Unbounded, the GPU's NVRTC gave
    Mamba-1's n = 16 training forward 148 registers (this machine's NVRTC 13.5 at most 132): 3 blocks
    an SM, so B32 D512's 512 blocks ran in two waves (its "b t d" forward clearly slower than bounded;
    see bench/results/2026-11-27-from-code-comments.md); bounded, 102-128 and no spills. More values a
    lane (n = 32, 64) or float64 spilled at 128, and so may bodies heavier than Mamba-1's (a random spec's kernel failed
    the spill test under the bound, local CI): the bound is kept to the grids that need it. A short-chunk kernel
    (calls of one chunk: decode steps) asks for SHORT_CHUNK_BLOCKS instead."""
    per_lane = -(-sizes[lanes.axis] // groups)
    blocks = lane_blocks(k, sizes, groups, block)
    few = blocks <= UNBOUNDED_LANES_BLOCKS * options().sm_count
    if ctype != "float" or few:
        return 1
    chunk = lanes_chunk(lanes, sizes, groups, 4)
    shared = lanes_shared_bytes(lanes, sizes, groups, block, 4, chunk) + SM_BLOCK_SHARED
    if chunk < CHUNK:  # a decode step's kernel (Lanes.consider): its states streamed once, occupancy first
        return max(1, min(SHORT_CHUNK_BLOCKS, SM_SHARED // shared))
    if per_lane * groups > BOUNDED_LANE_VALUES:
        return 1
    return max(1, min(bounded_blocks(block), SM_SHARED // shared))


def lanes_source(lowered: Lowered, lanes: StateLanes, k: Kernel, arrays: dict[str, ArraySpec],
                 sizes: dict[str, int], mapping: Threads, ctype: str, round_steps: int = 0) -> str:
    """CUDA C of the lanes kernel of `k` (lowered's fused kernel, split as `lanes`) for these layouts;
    `round_steps` where `k` also saves the fused backward's round carries (`rounds_<state>`)."""
    def build():
        context = state_lanes_context(k, lanes, arrays, sizes, mapping.lanes, mapping.block, ctype, round_steps)
        return render(lowered.program.name, lowered.strategy, ctype, [context], has_half(arrays),
                      exact_products(lowered.program))
    return with_free_array_names(set(arrays), build)


def state_lanes_context(k: Kernel, lanes: StateLanes, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                        groups: int, block: int, ctype: str, round_steps: int = 0) -> dict:
    """The template's context for the lanes kernel of `k` (module docstring); where `k` has arrays
    ``rounds_<state>`` (a training step's forward, backends/cuda/fused_backward.py), each lane writes
    its values of the state into them at every chunk that starts a round of `round_steps` steps (a
    multiple of the chunk, or a divisor of it): the carry into the round.

    One function although long: it fills the template's slots in the kernel's order from one set of
    printers and index maps (`body_phase` prints the full and the partial chunk alike)."""
    axis, row = lanes.axis, lanes.row_axis
    n, var = size_var(axis), lanes.var
    rows = block // groups
    per_lane = -(-sizes[axis] // groups)
    chunk = lanes_chunk(lanes, sizes, groups, 8 if ctype == "double" else 4)
    major = lanes.major
    sums = dict(lanes.sums)
    index = {a.name: a for a in k.arrays}
    vector = ctype == "float"

    def pv(where: str):
        return lambda e: f"pv_{e.array}[{where}][tt]"

    per_step_views = {name: pv("r") for name in major.per_step}
    row_views = {a: (lambda e: f"sr_{e.array}[buf][r][tt]") for a in lanes.row_seqs}
    staged_params = row_params(lanes)
    param_views = {a: (lambda e: f"sq_{e.array}[r]") for a in staged_params}
    pp = CPrinter(k, arrays, sizes, views={**per_step_views, **row_views, **param_views})

    # the body: per-step values in registers (name[tt]), sequences along the states' axis loaded as
    # vectors of the G steps (ld<j>[tt]), the lane's buffers and params at its own indices ([j])
    vectors = {}
    for s in major.body:
        for e in accesses(s):
            if e.array in lanes.state_seqs and (e.array, e.index) not in vectors:
                vectors[e.array, e.index] = f"ld{len(vectors)}"
    own = {name: (lambda e: f"{e.array}[j]") for name in lanes.lane_buffers}
    own |= {name: (lambda e: f"rp_{e.array}[j]") for name in lanes.lane_params}
    own |= {a: (lambda e: f"sr_{e.array}[buf][ch][tb + tt]") for a in lanes.row_seqs}
    own_printer = CPrinter(k, arrays, sizes, views=own)
    pb = CPrinter(k, arrays, sizes, vectors=vectors, views=own)
    pb.buffers |= set(major.per_step)
    read_in_body = [name for name in major.per_step if name not in sums
                    and any(e.array == name for s in major.body for e in accesses(s))]
    carried = {scalar_name(b): b for b in lanes.carried}
    body_scalars = [name for name in _scalar_names(major.body) if name not in carried]
    # rounds shorter than a chunk: the carries into those that start inside it, after their groups
    in_body_saves = (_save_rounds(k, lanes, arrays, own_printer, round_steps, chunk, "t0 + tb + G",
                                  f" && tb + G < {chunk} && t0 + tb + G < L")
                     if 0 < round_steps < chunk else [])

    def body_phase(partial: bool) -> list[str]:
        # the last, partial chunk: a step past L changes no state, and its sums are outputs past L, which the
        # post phase does not store. A short-chunk kernel's calls (decode steps) are one partial chunk, whose
        # G - 1 dead steps of each state value were most of the arithmetic: it skips them (a branch the same
        # for the whole warp); the others keep the states' assignments predicated (fewer registers for the
        # whole kernel, whose full chunks are the work).
        skip = partial and chunk < CHUNK
        body = _predicated(major.body, set(carried)) if partial and not skip else major.body
        # the last chunk stops at the group holding step L - 1: the groups wholly past L change no state,
        # and their sums are outputs past L, which the post phase does not store (its bound worked out
        # before the loop: as `tb < T && t0 + tb < L`, "b t d" at B32 D512 took 154 registers, not 128)
        loop = "int tb = 0, tb_end = min(T, L - t0); tb < tb_end" if partial else f"int tb = 0; tb < {chunk}"
        lines = ["#pragma unroll 1", f"for ({loop}; tb += G) {{  // G steps: one reduce-scatter"]
        for name in read_in_body:
            lines += [f"    F {name}[G];", f"    {_load_steps(name, f'&pv_{name}[ch][tb]', vector)}"]
        for name, op in sums.items():
            lines += [f"    F {name}[G];", "    #pragma unroll",
                      f"    for (int tt = 0; tt < G; ++tt) {name}[tt] = {sum_identity(op)};"]
        lines += ["    #pragma unroll", "    for (int j = 0; j < S; ++j) {  // this lane's state values, one at a time",
                  f"        const int {var} = g + j * G;"]
        guard = sizes[axis] % groups != 0
        inner = "            " if guard else "        "
        if guard:
            lines.append(f"        if ({var} < {n}) {{")
        lines += [f"{inner}F {scalar} = {buffer}[j];" for scalar, buffer in carried.items()]
        lines += [f"{inner}F {name};" for name in body_scalars]
        for (array, _), reg in vectors.items():
            lines += [f"{inner}F {reg}[G];", f"{inner}{_load_steps(reg, f'&sl_{array}[buf][{var}][tb]', vector)}"]
        lines += [f"{inner}#pragma unroll", f"{inner}for (int tt = 0; tt < G; ++tt) {{"]
        if skip:
            lines.append(f"{inner}    if (t0 + tb + tt >= L) continue;")
        elif partial:
            lines.append(f"{inner}    const bool live = t0 + tb + tt < L;")
        lines += pb.stmts(body, len(inner) // 4 + 1)
        lines.append(f"{inner}}}")
        lines += [f"{inner}{buffer}[j] = {scalar};" for scalar, buffer in carried.items()]
        if guard:
            lines.append("        }")
        lines.append("    }")
        lines += ["    " + line for line in in_body_saves]
        for name, op in sums.items():
            fn = "SumOp" if op == "+=" else "MaxOp"
            lines.append(f"    pv_{name}[ch][tb + g] = reduce_scatter<G>({name}, g, {fn}());")
        lines.append("}")
        return lines

    # the sums start in the body
    pre = [s for s in major.pre if not (isinstance(s.target, Load) and s.target.array in sums)]
    out_arrays = [a for a in k.arrays if a.role == "out"]
    along_time = bool(out_arrays) and arrays[out_arrays[0].name].strides[0] == 1

    vector_copies = vector_stages(lanes, arrays, ctype)
    hosted = hosted_sums(lanes)
    return {
        "template": template("lanes/forward.cu.j2"),
        "name": k.name,
        "block": block,
        "min_blocks": lanes_min_blocks(lanes, k, sizes, groups, block, ctype),
        "lanes": True,
        "unroll": PHASE_UNROLL,
        "comment": (f"{k.program.name}: {groups} lanes per [{' '.join(k.parallel)}], each owning {per_lane} "
                    f"{axis} for the whole sequence; {rows} rows per block, chunks of {chunk} steps"),
        "params": [("const " if a.role in ("seq", "param", "init") else "") + f"{C_TYPES[arrays[a.name].dtype]}* "
                   f"__restrict__ {c_array(a.name)}" for a in k.arrays],
        "constants": [f"constexpr int {size_var(a)} = {sizes[a]};" for a in k.sizes]
        + [f"constexpr long long total = {' * '.join(str(sizes[a]) for a in k.parallel)};",
           f"constexpr int G = {groups}, S = {per_lane}, R = {rows}, T = {chunk}, P = {pitch(chunk)}, "
           f"BLOCK = {block};  // lanes a row, state values a lane, rows a block, steps a chunk"],
        "row_size": size_var(row),
        "shared": [f"__shared__ __align__(16) F sr_{a}[2][R][P];  // two chunks of each row's steps"
                   for a in lanes.row_seqs]
        + [f"__shared__ __align__(16) F sl_{a}[2][{n}][P];  // two chunks, shared by the block's rows"
           for a in lanes.state_seqs]
        + [f"__shared__ __align__(16) F pv_{name}[R][P];  // per row and step of the chunk"
           for name in major.per_step if name not in hosted]
        + [f"__shared__ F sq_{name}[R];  // the block's rows' values, loaded once" for name in staged_params],
        "chunk_views": [f"F (* const pv_{name})[P] = sr_{host}[buf];  // the sums in {host}'s chunk, which only "
                        "the pre phase reads" for name, host in hosted.items()],
        "unflatten": _unflatten(k.parallel),
        "declarations": [f"F {name} = F(0);" for name in _scalar_names(k.setup + pre + major.post)]
        + [f"F {name}[S];" for name in lanes.lane_buffers]
        + [f"F rp_{name}[S];" for name in lanes.lane_params],
        "setup": _lane_loops(k.setup, lanes, own_printer, False),
        "finish": _lane_loops(k.finish, lanes, own_printer, True),
        "save": _save_rounds(k, lanes, arrays, own_printer, round_steps, chunk),
        "params_once": _lane_params(lanes, own_printer) + _row_param_loads(k, lanes, staged_params, own_printer),
        "issue": _issue(lanes, arrays, index, pp, ctype, vector_copies),
        # the next chunk's copies where it lies wholly inside the sequence (and the block's rows inside
        # the row axis), each a few instructions where the checked ones took about 28: Mamba-1's "b d t"
        # forward kernel ran faster at B8 D1536 L2048 and B16 D1024 L2048, unchanged at B32 D512 L180
        # (see bench/results/2026-11-27-from-code-comments.md). The thread index read fresh (`fresh_thread_index`):
        # addresses kept across chunks took 138 registers where the kernel had 114 (NVRTC 13.5)
        "issue_whole": ["const int tid = fresh_thread_index();",
                        *_issue(lanes, arrays, index, pp, ctype, vector_copies, (sizes, rows, block, chunk))]
        if vector_copies else [],
        "rows_inside": "" if sizes[row] % rows == 0 else f" && r0 + R <= {size_var(row)}",
        "aligned": " && ".join(f"(unsigned long long){c_array(a)} % 16 == 0" for a in sorted(vector_copies))
        or "false",
        **_pre_phase(k, lanes, arrays, sizes, pre, pp, vector, param_views),
        "body_full": body_phase(False),
        "body_partial": body_phase(True),
        **_post_phase(k, lanes, arrays, sizes, major.post, along_time, vector, param_views),
    }


def _pre_phase(k: Kernel, lanes: StateLanes, arrays: dict[str, ArraySpec], sizes: dict[str, int], pre: list,
               scalar_printer: CPrinter, vector: bool, param_views: dict) -> dict:
    """The template's `pre_steps` and `pre` lines: the steps' values per row and step of the chunk
    into shared memory (rows past the last compute the last one: the body reads them). With `vector`
    (float) a thread takes STEPS_A_THREAD consecutive steps of a row: the staged sequences read as
    vectors, the values kept in registers (``w_<name>``) and stored as vectors (Mamba-1's forward
    kernel at B8 D1536 L2048 ran faster with the post phase so too than with this one alone; see
    bench/results/2026-11-27-from-code-comments.md)."""
    row = lanes.row_axis
    clamp = f"const int p_{row} = min(r0 + r, {size_var(row)} - 1);"
    if not vector:
        return {"pre_steps": 1, "pre": ["const int r = i / T, tt = i % T, t = t0 + tt;  (void)t;", clamp,
                                        *scalar_printer.stmts(pre, 0)]}
    steps = STEPS_A_THREAD
    per_step = set(lanes.major.per_step)
    written = list(dict.fromkeys(s.target.array for s in pre if isinstance(s.target, Load)
                                 and s.target.array in per_step))
    read = list(dict.fromkeys(e.array for s in pre for e in loads(s.value)
                              if e.array in lanes.row_seqs or (e.array in per_step and e.array not in written)))
    views = {a: (lambda e: f"vp_{e.array}[q]") for a in read}
    views |= {name: (lambda e: f"w_{e.array}[q]") for name in written}
    views |= param_views
    lines = [f"const int r = i / (T / {steps}), t4 = (i % (T / {steps})) * {steps};  // {steps} steps of a row",
             clamp]
    for a in read:
        src = f"&sr_{a}[buf][r][t4]" if a in lanes.row_seqs else f"&pv_{a}[r][t4]"
        lines += [f"F vp_{a}[{steps}];", f"load_steps<{steps}>(vp_{a}, {src});"]
    lines += [f"F w_{name}[{steps}];" for name in written]
    lines += ["#pragma unroll", f"for (int q = 0; q < {steps}; ++q) {{",
              "    const int tt = t4 + q, t = t0 + tt;  (void)t;",
              *CPrinter(k, arrays, sizes, views=views).stmts(pre, 1), "}"]
    lines += [f"store_steps<{steps}>(&pv_{name}[r][t4], w_{name});" for name in written]
    return {"pre_steps": steps, "pre": lines}


def _post_phase(k: Kernel, lanes: StateLanes, arrays: dict[str, ArraySpec], sizes: dict[str, int], post: list,
                along_time: bool, vector: bool, param_views: dict) -> dict:
    """The template's `post_steps` (steps a thread takes per row, consecutive) and `post` lines: the
    outputs per row and step of the chunk, consecutive threads along the outputs' contiguous axis
    (`along_time`: time). With `vector` (float) and `along_time` a thread takes
    STEPS_A_THREAD consecutive steps of a row: what it reads per step from shared memory as vectors
    (``vp_<name>``), its outputs into registers (``o_<name>``), then stored as one vector where aligned
    (Mamba-1's forward kernel at B8 D1536 L2048 ran faster with the pre phase vectorised too than with
    this one alone; see bench/results/2026-11-27-from-code-comments.md)."""
    if not post:  # nothing per step after the body (a training step's forward without outputs)
        return {"post_steps": 1, "post": []}
    row = lanes.row_axis
    rows = size_var(row)
    scalar_views = {a: (lambda e: f"sr_{e.array}[buf][r][tt]") for a in lanes.row_seqs}
    scalar_views |= {name: (lambda e: f"pv_{e.array}[r][tt]") for name in lanes.major.per_step}
    scalar_views |= param_views
    if not (vector and along_time):
        return {"post_steps": 1, "post": [
            "const int r = i / T, tt = i % T;" if along_time else "const int r = i % R, tt = i / R;",
            "const int t = t0 + tt;", f"if (t < L && r0 + r < {rows}) {{", f"    const int p_{row} = r0 + r;",
            *CPrinter(k, arrays, sizes, views=scalar_views).stmts(post, 1), "}"]}
    steps = STEPS_A_THREAD
    read = list(dict.fromkeys(e.array for s in post for e in loads(s.value)
                              if e.array in scalar_views and e.array not in param_views))
    stores = list({s.target.array: s.target for s in post if isinstance(s.target, Load)}.values())
    views = {a: (lambda e: f"vp_{e.array}[q]") for a in read}
    views |= {t.array: (lambda e: f"o_{e.array}[q]") for t in stores}
    views |= param_views
    pr = CPrinter(k, arrays, sizes, views=views)
    lines = [f"const int r = i / (T / {steps}), t4 = (i % (T / {steps})) * {steps};  // {steps} steps of a row",
             f"if (r0 + r < {rows}) {{", f"    const int p_{row} = r0 + r;"]
    for a in read:
        src = f"&sr_{a}[buf][r][t4]" if a in lanes.row_seqs else f"&pv_{a}[r][t4]"
        lines += [f"    F vp_{a}[{steps}];", f"    load_steps<{steps}>(vp_{a}, {src});"]
    lines += [f"    F o_{t.array}[{steps}];" for t in stores]
    lines += ["    #pragma unroll", f"    for (int q = 0; q < {steps}; ++q) {{",
              "        const int tt = t4 + q, t = t0 + tt;  (void)t;", *pr.stmts(post, 2), "    }"]
    plain = CPrinter(k, arrays, sizes)
    for t in stores:
        at, spec = plain.index(t), arrays[t.array]
        whole = spec.dtype == "float32" and spec.strides[0] == 1 and all(st % steps == 0 for st in spec.strides[1:])
        scalar = [f"for (int q = 0; q < {steps}; ++q) {{", "    const int t = t0 + t4 + q;",
                  f"    if (t < L) {c_array(t.array)}[{at}] = {_store(spec.dtype, f'o_{t.array}[q]')};", "}"]
        if not whole:
            lines += ["    " + line for line in scalar]
            continue
        out = c_array(t.array)
        lines += [f"    if (t0 + t4 + {steps} <= L && (unsigned long long){out} % 16 == 0) {{",
                  "        const int t = t0 + t4;", f"        store_steps<{steps}>(&{out}[{at}], o_{t.array});",
                  "    } else {", *("        " + line for line in scalar), "    }"]
    return {"post_steps": steps, "post": [*lines, "}"]}


def sum_identity(op: str) -> str:
    """C text of the value a per-step sum over the states' axis starts from ("+=": 0; "max=": -inf)."""
    return "F(0)" if op == "+=" else "F(-__int_as_float(0x7f800000))"


def _load_steps(reg: str, src: str, vector: bool) -> str:
    if vector:
        return f"load_steps<G>({reg}, {src});"
    return f"for (int q = 0; q < G; ++q) {reg}[q] = ({src})[q];"


def _lane_loops(stmts: list, lanes: StateLanes, pr: CPrinter, stores: bool) -> list[str]:
    """The setup's (finish's) scalars, and its loops over the states' axis, each lane over its own indices."""
    var, n = lanes.var, size_var(lanes.axis)
    out = []
    for s in stmts:
        if isinstance(s, Buffer):
            continue
        if isinstance(s, Assign):
            out += pr.stmts([s], 0)
            continue
        assert isinstance(s, Loop)
        out += ["#pragma unroll", "for (int j = 0; j < S; ++j) {", f"    const int {var} = g + j * G;",
                f"    if ({var} < {n}{' && valid' if stores else ''}) {{", *pr.stmts(s.body, 2), "    }", "}"]
    return out


def _save_rounds(k: Kernel, lanes: StateLanes, arrays: dict[str, ArraySpec], pr: CPrinter,
                 round_steps: int, chunk: int, step: str = "t0", due: str = "") -> list[str]:
    """C lines storing this lane's values of each state into ``rounds_<state>`` where `step` (C text:
    the step the states hold the carry into) starts a round of `round_steps` steps: at a chunk's start
    (`step` t0), or, where the rounds are shorter than a chunk (a divisor of `chunk`: the lanes backward's
    short chunks), after a group of the body too (`step` t0 + tb + G, `due` its further condition)."""
    names = [a.name for a in k.arrays if a.role == "rounds"]
    if not names:
        return []
    if round_steps <= 0 or (round_steps % chunk and chunk % round_steps):
        raise ValueError(f"{k.name}: rounds of {round_steps} steps neither divide nor are whole chunks of {chunk}")
    var, n = lanes.var, size_var(lanes.axis)
    lines = []
    for s in k.program.states:
        name = f"rounds_{s.name}"
        if name not in names:
            continue
        at = pr.index(Load(name, (f"({step}) / {round_steps}",
                                  *(var if a == lanes.axis else f"p_{a}" for a in s.axes))))
        store = _store(arrays[name].dtype, f"st_{s.name}[j]")
        lines.append(f"        if ({var} < {n}) {c_array(name)}[{at}] = {store};")
    return [f"if (valid && ({step}) % {round_steps} == 0{due}) {{  // the carry into a round of the fused backward",
            "    #pragma unroll", "    for (int j = 0; j < S; ++j) {", f"        const int {var} = g + j * G;",
            *lines, "    }", "}"]


def _lane_params(lanes: StateLanes, pr: CPrinter) -> list[str]:
    """Loads of the params the body reads along the states' axis, this lane's S values of each."""
    var, n = lanes.var, size_var(lanes.axis)
    seen, out = set(), []
    for s in lanes.major.body:
        for e in accesses(s):
            if e.array in lanes.lane_params and e.array not in seen:
                seen.add(e.array)
                value = f"F(to_f({c_array(e.array)}[{pr.index(e)}]))"
                if e.array in lanes.log2e_params:  # read as exp2(x * P): exp(x * P) is exp2(x * P log2 e)
                    value += " * F(1.4426950408889634)"
                out += ["#pragma unroll", "for (int j = 0; j < S; ++j) {", f"    const int {var} = g + j * G;",
                        f"    rp_{e.array}[j] = {var} < {n} ? {value} : F(0);", "}"]
    return out


def _row_param_loads(k: Kernel, lanes: StateLanes, names: list[str], pr: CPrinter) -> list[str]:
    """Loads of the `row_params` into ``sq_<name>[r]``, the block's R rows (rows past the last take the
    last one's); the first chunk's barrier orders them before the pre phase."""
    last = f"{size_var(lanes.row_axis)} - 1"
    return [f"for (int i = threadIdx.x; i < R; i += BLOCK) "
            f"sq_{name}[i] = F(to_f({c_array(name)}[{pr.index(Load(name, (f'min(r0 + i, {last})',)))}]));"
            for name in names]


def _issue(lanes: StateLanes, arrays: dict[str, ArraySpec], index: dict, pr: CPrinter, ctype: str,
           vector: set[str], whole: tuple[dict[str, int], int, int, int] | None = None) -> list[str]:
    """C lines copying the chunk that starts at step `tn` into buffer `nb`: each staged sequence's
    rows x steps, consecutive threads along its contiguous axis; `cp.async` where the array holds the
    compute type (else loads and stores), 16 bytes at a time for the arrays in `vector` (time
    contiguous, rows of whole vectors) where `vec` (their pointers aligned), one value a copy
    else. The loops run a fixed count of iterations per thread: unrolled.

    `whole` = (sizes, rows a block, threads a block, steps a chunk): the copies of a chunk known to lie wholly inside
    the sequence and the row axis, with `vec` true: the arrays in `vector` without any bounds check
    (nor the loops' own where the copies are a multiple of the block's threads)."""
    row, axis = lanes.row_axis, lanes.axis
    same = "float32" if ctype == "float" else "float64"
    value_bytes = 4 if ctype == "float" else 8
    out = []
    for name in lanes.row_seqs + lanes.state_seqs:
        a = index[name]
        spec = arrays[name]
        per_row = name in lanes.row_seqs
        count, rowvar = ("R", "r") if per_row else (size_var(axis), "s")
        at = {"t": "t", row: "(r0 + r)"} if per_row else {"t": "t", axis: "s"}
        src = f"{c_array(name)} + ({pr.index(Load(name, tuple(at.get(ax, f'p_{ax}') for ax in a.axes)))})"
        dst = f"&{'sr' if per_row else 'sl'}_{name}[nb][{rowvar}][tt]"
        rows = f" && r0 + r < {size_var(row)}" if per_row else ""
        asynchronous = spec.dtype == same
        along_time = spec.strides[0] == 1
        scalar = _copy_loop(f"{count} * T", f"const int {rowvar} = i / T, tt = i % T;" if along_time
                            else f"const int {rowvar} = i % {count}, tt = i / {count};",
                            [f"if (t < L{rows}) {_copy(asynchronous, dst, src)}"])
        steps = "(16 / sizeof(F))"  # values a 16-byte copy moves
        vectors = f"{count} * (T / {steps})"
        mapping = f"const int {rowvar} = i / (T / {steps}), tt = (i % (T / {steps})) * {steps};"
        # a time-contiguous array whose rows do not start on 16 bytes (L = 4097 in "b d t"): a thread's
        # `steps` neighbouring values one copy each, their index worked out once, not once a value
        # (faster for Mamba-1 at B8 D1536 L4097, both the forward and the gradients-only forward; see
        # bench/results/2026-11-27-from-code-comments.md)
        each = _copy(asynchronous, dst + " + q", src + " + q")
        grouped = _copy_loop(vectors, mapping, [f"if (t + {steps} <= L{rows}) for (int q = 0; q < {steps}; ++q) {each}",
                                                f"else if (t < L{rows}) for (int q = 0; q < {steps} && t + q < L; ++q) "
                                                f"{each}"])
        if name not in vector:
            out += grouped if along_time else scalar
            continue
        if whole is not None:
            sizes, rows_a_block, block, chunk = whole
            copies = (rows_a_block if per_row else sizes[axis]) * (chunk * value_bytes // 16)
            out += _copy_loop(vectors, mapping, [f"copy_async<16>({dst}, {src});"], copies % block != 0, "tid")
            continue
        out += ["if (vec) {",
                *("    " + line for line in _copy_loop(
                    vectors, mapping,
                    [f"if (t + {steps} <= L{rows}) copy_async<16>({dst}, {src});",
                     f"else if (t < L{rows}) for (int q = 0; q < {steps} && t + q < L; ++q) {each}"])),
                # misaligned pointers (rare): value by value; the grouped copies here took the aligned
                # kernels' registers from 93 to 74 and made the gradients-only forward at B32 D512 L180
                # slower (see bench/results/2026-11-27-from-code-comments.md)
                "} else {", *("    " + line for line in scalar), "}"]
    return out


def _copy(asynchronous: bool, dst: str, src: str) -> str:
    """One value from global `src` to shared `dst` (pointers)."""
    return f"copy_async<sizeof(F)>({dst}, {src});" if asynchronous else f"*({dst}) = F(to_f(*({src})));"


def _copy_loop(items: str, mapping: str, body: list[str], ragged: bool = True,
               thread: str = "threadIdx.x") -> list[str]:
    """C lines of the block's threads taking `items` copies, each thread a fixed count (unrolled);
    `ragged`: the copies may not be a multiple of the threads (the last ones checked); `thread`: the
    thread's index, as the loop reads it."""
    return [f"#pragma unroll {PHASE_UNROLL}", f"for (int k = 0; k < ({items} + BLOCK - 1) / BLOCK; ++k) {{",
            f"    const int i = {thread} + k * BLOCK;", *([f"    if (i >= {items}) break;"] if ragged else []),
            f"    {mapping}", "    const int t = tn + tt;", *("    " + line for line in body), "}"]


def vector_stages(lanes: StateLanes, arrays: dict[str, ArraySpec], ctype: str) -> set[str]:
    """The staged sequences the lanes kernel copies 16 bytes at a time where aligned: holding the compute
    type, time contiguous, every other stride a whole number of 16 bytes."""
    same, values = ("float32", 4) if ctype == "float" else ("float64", 2)
    return {name for name in lanes.row_seqs + lanes.state_seqs
            if arrays[name].dtype == same and arrays[name].strides[0] == 1
            and all(st % values == 0 for st in arrays[name].strides[1:])}

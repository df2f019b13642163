"""Kernels with a thread per parallel index (``thread.cu.j2``, ``rows.cu.j2``, ``map_rows.cu.j2``):
the template context of a loop nest run with time inside each thread, or a map/reduce epilogue
over blocks of time."""

from __future__ import annotations

from ....lowering.kernel import Kernel, Lowered
from ....lowering.loops import (
    Load,
)
from ....lowering.plan import size_var
from ..hardware import (
    STATIC_SHARED,
    WARP,
)
from ..printer import (
    BLOCK,
    C_TYPES,
    ONE_GROUP,
    ArraySpec,
    CPrinter,
    Threads,
    _store,
    c_array,
    with_free_array_names,
)
from ..source import exact_products, has_half, render
from . import template
from .base import Shape, Strategy, Verdict, threads


def _staged_prev(k: Kernel, arrays: dict[str, ArraySpec]) -> list[str]:
    """Carries `prev_*` a thread-per-recurrence kernel writes one value of per step, into an array
    with time contiguous: written through shared memory, 32 steps at a time, so that a warp's
    writes are coalesced (a thread writing its own steps would touch a line per lane and step). As
    many as the block's static shared memory holds (the others are written directly)."""
    if k.time_blocks:
        return []
    parallel = set(k.parallel)
    staged, room = [], STATIC_SHARED
    for a in k.arrays:
        if (a.role == "prev" and set(a.axes[1:]) <= parallel and arrays[a.name].strides[0] == 1
                and len(a.axes) > 1):
            need = BLOCK * (WARP + 1) * (8 if arrays[a.name].dtype == "float64" else 4)
            if need <= room:
                staged.append(a.name)
                room -= need
    return staged


def _flush_prev(k: Kernel, pr: CPrinter, staged: list[str]) -> list[str]:
    """C lines writing row `r`'s staged steps (`count` from `base`) of every staged carry, the warp's
    active lanes taking consecutive steps."""
    step = "t1 - 1 - (base + s)" if k.reverse else "t0 + base + s"
    index = {a.name: a for a in k.arrays}
    out = []
    for name in staged:
        a = index[name]
        at_zero = pr.index(Load(name, ("0", *(f"p_{ax}" for ax in a.axes[1:]))))
        value = _store(pr.arrays[name].dtype, f"sm_{name}[ssmc_row0 + r][s]")
        out += [f"const long long o_{name} = __shfl_sync(lanes, (long long)({at_zero}), r);",
                f"for (int s = lane; s < count; s += nact) {c_array(name)}[o_{name} + ({step})] = {value};"]
    return out


def _unflatten(parallel) -> list[str]:
    """C lines splitting the flat index `p` into one index `p_<axis>` per parallel axis (the last fastest)."""
    lines, rest = [], "p"
    for a in reversed(parallel):
        lines += [f"const int p_{a} = (int)({rest} % {size_var(a)});",
                  f"const long long rest_{a} = {rest} / {size_var(a)};"]
        rest = f"rest_{a}"
    return lines


def kernel_context(k: Kernel, arrays: dict[str, ArraySpec], sizes: dict[str, int],
                   threads: Threads = ONE_GROUP) -> dict:
    staged = _staged_prev(k, arrays)
    pr = CPrinter(k, arrays, sizes, frozenset(staged), threads=threads)
    params = []
    for a in k.arrays:
        ctype = C_TYPES[arrays[a.name].dtype]
        const = "const " if a.role in ("seq", "param", "init") else ""
        params.append(f"{const}{ctype}* __restrict__ {c_array(a.name)}")
    constants = [f"constexpr int {size_var(a)} = {sizes[a]};" for a in k.sizes]
    total = " * ".join(str(sizes[a]) for a in k.parallel) or "1"
    constants.append(f"constexpr long long total = {total};")
    unflatten = _unflatten(k.parallel)
    par = " ".join(k.parallel) or "-"
    comment = f"{k.program.name}: one thread per [{par}]" + (" and block of time" if k.time_blocks else "")
    row = threads.row and threads.groups > 1
    if row and threads.recurrence:
        comment = (f"{k.program.name}: a recurrence per [{par}], time inside, {threads.groups} threads per "
                   f"recurrence, each owning every {threads.groups}-th {threads.split}; "
                   f"{threads.rows_per_block} per block")
    elif row:
        comment = (f"{k.program.name}: a row per [{par}] and step, {threads.groups} threads per row, each taking "
                   f"every {threads.groups}-th {threads.split}; {threads.rows_per_block} rows per block")
    elif threads.groups > 1:
        comment += f" and group of {threads.split} ({threads.groups} groups, partial sums)"
    if threads.time_fastest:
        comment += ", consecutive threads along time"
    return {
        "template": template("rows.cu.j2" if row and threads.recurrence else "map_rows.cu.j2" if row
                             else "thread.cu.j2"),
        "name": k.name,
        "comment": comment,
        "time_fastest": threads.time_fastest,
        "interleaved": threads.time_fastest and k.sum_over_time,
        "groups": threads.groups,
        "row": row and not threads.recurrence,
        "row_recurrence": row and threads.recurrence,
        "rows_per_block": threads.rows_per_block,
        "params": params,
        "constants": constants,
        "unflatten": unflatten,
        "declarations": pr.scalars(),
        "reverse": k.reverse,
        "setup": "\n".join(pr.stmts(k.setup, 1)),
        "step": "\n".join(pr.stmts(k.step, 2)),
        "finish": "\n".join(pr.stmts(k.finish, 1)),
        "stage_prev": [f"__shared__ F sm_{a}[{BLOCK}][{WARP + 1}];" for a in staged],
        "flush_prev": _flush_prev(k, pr, staged),
    }


def thread_source(lowered: Lowered, ctype: str, kernels: list[tuple[Kernel, dict[str, ArraySpec]]],
                  sizes: dict[str, int], threads: dict[str, Threads] | None = None) -> str:
    """CUDA C for the given kernels of `lowered`, each with the layouts of its arrays and its thread
    mapping (`threads`, by kernel name; default: `ONE_GROUP`)."""
    def build():
        contexts = [kernel_context(k, specs, sizes, (threads or {}).get(k.name, ONE_GROUP)) for k, specs in kernels]
        return render(lowered.program.name, lowered.strategy, ctype, contexts,
                      any(has_half(specs) for _, specs in kernels), exact_products(lowered.program))
    return with_free_array_names({name for _, specs in kernels for name in specs}, build)


class PerIndex(Strategy):
    """Strategies whose kernels run a thread (or a group of threads) per parallel index: their
    source is `thread_source`."""

    def source(self, runner, k, specs: dict, sizes: dict[str, int], mapping: Threads, length: int | None) -> str:
        return thread_source(runner.lowered, runner.ctype, [(k, specs)], sizes, {k.name: mapping})


class AsLowered(PerIndex):
    """A program that is not a diagonal-linear scan runs as the lowering built it: one kernel with
    time inside each thread ("fused"), or a core and map/reduce epilogues ("split"), or per-output
    maps parallel over time too ("map"); the strategies after this one are for scans only."""

    name = "lowered"
    names = ("split", "map")
    prepared = False  # a split program's core and epilogues: the runner's general path

    def prepare(self, runner, seqs, params, initial, sizes, length, out_dtype, contiguous: bool):
        """Map kernels alone (a state-free program: the stages around a chunked core) are worked out
        once (`CudaRunner.prepare_maps`); else None: the runner's general path."""
        return runner.prepare_maps(seqs, params, initial, sizes, length, out_dtype, contiguous)

    def consider(self, runner, shape: Shape, forced: str | None) -> Verdict:
        low = runner.lowered
        if runner.time_blocks is not None:
            return self.refused("a diagonal-linear scan: the scan strategies decide")
        if low.strategy != "fused":
            return Verdict(low.strategy, True, low.reason)
        return Verdict("fused", True, f"{low.reason}: a thread per recurrence, {threads(low.kernels[0], shape.sizes)}")


AS_LOWERED = AsLowered()

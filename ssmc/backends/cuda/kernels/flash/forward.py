"""The flash attention forward of an `Attention` program: one kernel launch on the tensor cores.

    reason = unsupported(program)                      # None where the modifiers print as CUDA C
    name, text = kernel_source(program, d=128, bf16=True)
    fwd = FlashForward(program); out, lse = fwd(call, spans)   # a bound call of CUDA bf16/fp16 tensors

The kernel (``forward.cu.j2``), per batch index bh (the batch axes flattened) and block of `BM` query
rows i, as a plain loop:

    for each key tile [n0, n0 + BN) of the block's span [lo, hi)                       (block_spans)
        s[i, j] = score_mod(scale * sum_d q[bh, i, d] k[bh, j, d], i, j, params[bh])
        s[i, j] = -inf where j >= Lk or not mask_mod(i, j, params[bh])   (not evaluated on full tiles)
        online softmax: m[i] = running max, l[i] = running sum of exp(s - m), o[i] = running sum of exp(s - m) v
    out[bh, i] = o[i] / l[i]  (0 where l[i] = 0);   lse[bh, i] = log(l[i]) + m[i]  (-inf where l[i] = 0)

Under grouped-query attention k and v keep their own heads: k[bh] and v[bh] above are those of index
`kv_index`(bh, group, inner) (a build of its own: ``kernel_source(..., gqa=True)``).

Products in the inputs' 16-bit type with fp32 accumulation (mma.sync m16n8k16; on sm_90 parts the
"wg128" config's warpgroup products, ``forward_wgmma.cu.j2``); scores, softmax, l, m
in fp32; P rounded to the input type as the P V product's operand (as FlashAttention). The modifiers
are printed from the IR as straight-line CUDA C over (score, q_idx, kv_idx, the params' values for
bh); anything else (a param with an axis beyond the batch axes, reductions, iota) is refused with a
reason, and the call stays on the tiled torch path.

Indexed reads (``table[i - j]``, ``doc[q_idx]``: `gather_sources`) read through `prm`, which then points at the
batch index's row of the param table in global memory (not a copy in registers): the table's last columns hold,
per gather source, the offset from that row to the batch index's row of the source (the table's entries for
its head, or the sequence's ids) and the row's last index, the rows appended after the table (`param_table`).
The printed read is ``prm[(int)prm[c] + clamp(index, 0, prm[c + 1])]``. A mask's reads at q_idx alone or kv_idx
alone (``doc[q_idx]``, ``doc[kv_idx]``: `hoisted_reads`) are made once per row and once per column of a tile the
mask is evaluated on (those `block_spans` does not prove full: with sorted document ids, the tiles that straddle a
document boundary), into registers the printed mask reads (`printed_mask`); other reads (``table[i - j]``), a load
per (query, key) evaluated.

With document ids a call's param table and span table come from one launch of the span kernel (`fused_tables`:
the table's columns and layout cached per signature, `table_layout`; the ids' rows written from the ids as given,
the params' part from their values each call, since a param changed in place, through ``.data`` too, must be seen),
into one buffer: the forward's per-call work is then that buffer, that launch and its own.

Head dims (`HEAD_DIMS`) 64, 128 and 256, the value dim the same. At d 256 a warp's 16 rows of the fp32 output
accumulator alone are 128 registers a thread, so d 256 has its own configs (`CONFIGS`): "bm128w8" with key tiles
of 32 and Q's fragments read from shared memory per tile (not held in registers), and "wg128" (sm_90a, the default
on sm_90 parts) with key tiles of 64, its P V product one m64n256k16 instruction a k-step.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from .....ir.node import BOOL, Node, toposort
from .....ir.ops import Op
from .....ir.program import Attention
from ...launch import launch_kernel
from ...options import options
from .. import template
from ..loaded import loaded_function
from .spans import THREADS as SPAN_THREADS
from .spans import span_source

BM = 64                 # query rows a block of the "bm64" kernel: 4 warps of 16
BN = 64                 # keys a tile (also the mask analysis' tile: spans start on tile boundaries)
THREADS = 128
HEAD_DIMS = (64, 128, 256)  # the kernels' head (and value) dims; others stay on the tiled path


@dataclass(frozen=True)
class Config:
    """One forward kernel's shape: `bm` query rows a block, `warps` warps of `rt` tiles of 16 rows, key
    tiles of `bn`; "bm64" is ``forward.cu.j2`` (static shared memory, K and V single-buffered), the others
    ``forward_bm128.cu.j2`` (K and V double-buffered in dynamic shared memory); `qreg`: Q's fragments in
    registers for the whole block (else read from shared memory per tile); `min_blocks`: the launch
    bounds' blocks an SM."""

    name: str
    bm: int
    bn: int
    warps: int
    rt: int = 1
    qreg: bool = True
    min_blocks: int = 1
    wgmma: bool = False
    stagger: bool = False

    @property
    def arch(self) -> str | None:
        """The architecture the kernel must be built for (None: the device's own)."""
        return "sm_90a" if self.wgmma else None

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def shared(self, d: int) -> int:
        """Bytes of dynamic shared memory a block (0: "bm64"'s static arrays): Q where not in registers,
        then two stages of a K and a V tile, rows padded to d + 8 values."""
        if self.name == "bm64":
            return 0
        if self.wgmma:  # Q, two (three: stagger) stages of K and V, unpadded (swizzled), 1024 bytes to align them
            return (self.bm + 2 * (3 if self.stagger else 2) * self.bn) * d * 2 + 1024
        return ((0 if self.qreg else self.bm) + 4 * self.bn) * (d + 8) * 2


# per head dim; "bm128w8": 8 warps of 16 rows, Q in registers, key tiles of 64 ("bm128w8n128": of 128, half
# the barriers and rescales a key, twice the shared memory); "bm128w4": 4 warps of 32 rows (at d 128 Q read
# from shared memory and key tiles of 32: Q's 64 fragment registers, O's 128 and S's 64 accumulators would
# not fit 255 registers, and with tiles of 64 keys a soft-capping modifier spilled); "wg128" (sm_90a): two
# warpgroups of 64 rows, key tiles of 128, wgmma from swizzled shared memory (``forward_wgmma.cu.j2``);
# "wg128s": the same with warpgroup 1 half a tile behind (its products beside warpgroup 0's softmax), 3 stages.
# At d 256 a warp's 16 rows of O are 128 fp32 registers a thread, so two configs have a build there: "bm128w8"
# with Q read from shared memory and key tiles of 32 (S's 16 accumulators beside O's 128; Q's 64 fragment
# registers would not fit, and tiles of 64 take 198 KiB of shared memory, past an sm_80 block's 163), and "wg128"
# with key tiles of 64 (two stages of 128-key tiles take 321 KiB, past 227; "wg128s"' three stages of 64, 257)
CONFIGS = {
    "bm64": {64: Config("bm64", 64, 64, 4), 128: Config("bm64", 64, 64, 4)},
    "bm128w8": {64: Config("bm128w8", 128, 64, 8), 128: Config("bm128w8", 128, 64, 8),
                256: Config("bm128w8", 128, 32, 8, qreg=False)},
    "bm128w8n128": {64: Config("bm128w8n128", 128, 128, 8), 128: Config("bm128w8n128", 128, 128, 8)},
    "bm128w4": {64: Config("bm128w4", 128, 64, 4, rt=2), 128: Config("bm128w4", 128, 32, 4, rt=2, qreg=False)},
    "wg128": {64: Config("wg128", 128, 128, 8, wgmma=True), 128: Config("wg128", 128, 128, 8, wgmma=True),
              256: Config("wg128", 128, 64, 8, wgmma=True)},
    "wg128s": {d: Config("wg128s", 128, 128, 8, wgmma=True, stagger=True) for d in (64, 128)},
}
# per head dim, where SSMC_CUDA_FLASH_FORWARD is unset: the fastest in bench/flash_forward_configs.py (d 256:
# bench/flash_check.py --d 256), on
# sm_90 parts (wgmma) and elsewhere (mma.sync; also the CPU emulator's)
DEFAULT_CONFIG = {64: "bm128w4", 128: "bm128w4", 256: "bm128w8"}
HOPPER_CONFIG = {64: "wg128", 128: "wg128s", 256: "wg128"}
# the staggered kernel pays half a tile at each end of a block's span: on spans shorter than this many key
# tiles on average (a sliding window) the default takes the plain one
STAGGER_MIN_TILES = 8
_HOPPER: dict = {}  # torch device index -> whether it is an sm_90 part


def hopper(device) -> bool:
    """Whether `device` (a torch device, or None) is a CUDA device of compute capability 9.0 (wgmma)."""
    if device is None or getattr(device, "type", None) != "cuda":
        return False
    index = device.index if device.index is not None else -1
    hit = _HOPPER.get(index)
    if hit is None:
        import torch

        hit = _HOPPER[index] = torch.cuda.get_device_capability(device) == (9, 0)
    return hit


def _forced() -> bool:
    """Whether ``SSMC_CUDA_FLASH_FORWARD`` names the config."""
    from ...options import options

    return bool(options().flash_forward)


def config(d: int, name: str | None = None, device=None) -> Config:
    """The forward's config at head dim `d`: `name`'s, else ``SSMC_CUDA_FLASH_FORWARD``'s, else the default
    for `device` (`HOPPER_CONFIG` on an sm_90 part, else `DEFAULT_CONFIG`). A config the option names that has
    no build at `d` (at d 256 "bm128w8" and "wg128" have one) gives way to the default; a `name` given
    here that has none is a ValueError."""
    if name is None:
        from ...options import options

        default = (HOPPER_CONFIG if hopper(device) else DEFAULT_CONFIG)[d]
        name = options().flash_forward or default
        if d not in CONFIGS.get(name, {d: None}):
            name = default
    elif d not in CONFIGS[name]:
        raise ValueError(f"flash forward config {name!r} has no build at head dim {d}")
    cfg = CONFIGS[name][d]
    if cfg.wgmma and device is not None and getattr(device, "type", None) == "cuda" and not hopper(device):
        raise ValueError(f"flash forward config {name!r} needs an sm_90 GPU (wgmma); {device} is not one")
    return cfg


class Unprintable(ValueError):
    """A modifier the flash kernel's printer has no C for (the message says which op and why)."""


_UNARY = {
    Op.NEG: "(-{0})", Op.EXP: "expf({0})", Op.LOG: "logf({0})", Op.SQRT: "sqrtf({0})", Op.RSQRT: "rsqrtf({0})",
    Op.ABS: "fabsf({0})", Op.SIGMOID: "(1.0f / (1.0f + expf(-({0}))))", Op.TANH: "tanhf({0})",
    Op.SOFTPLUS: "(({0}) > 20.0f ? ({0}) : log1pf(expf({0})))", Op.SILU: "(({0}) / (1.0f + expf(-({0}))))",
    Op.GELU: "(0.5f * ({0}) * (1.0f + erff(({0}) * 0.70710678118654752f)))", Op.RELU: "fmaxf({0}, 0.0f)",
    Op.ERF: "erff({0})", Op.SIN: "sinf({0})", Op.COS: "cosf({0})", Op.TAN: "tanf({0})", Op.LOG1P: "log1pf({0})",
    Op.EXPM1: "expm1f({0})", Op.SIGN: "(float)((({0}) > 0.0f) - (({0}) < 0.0f))", Op.NOT: "(!{0})",
}
_BINARY = {
    Op.ADD: "({0} + {1})", Op.SUB: "({0} - {1})", Op.MUL: "({0} * {1})", Op.DIV: "({0} / {1})",
    Op.POW: "powf({0}, {1})", Op.MAX: "fmaxf({0}, {1})", Op.MIN: "fminf({0}, {1})", Op.ATAN2: "atan2f({0}, {1})",
    Op.LT: "({0} < {1})", Op.LE: "({0} <= {1})", Op.GT: "({0} > {1})", Op.GE: "({0} >= {1})",
    Op.EQ: "({0} == {1})", Op.NE: "({0} != {1})", Op.AND: "({0} && {1})", Op.OR: "({0} || {1})",
}


def float_literal(x: float) -> str:
    """A float constant as CUDA C (infinities and NaN by their bits: NVRTC has no math.h)."""
    if math.isnan(x):
        return "__uint_as_float(0x7fc00000u)"
    if math.isinf(x):
        return "__uint_as_float(0x7f800000u)" if x > 0 else "__uint_as_float(0xff800000u)"
    return f"{float(x)!r}f" if "e" in repr(float(x)) or "." in repr(float(x)) else f"{float(x)!r}.0f"


def gather_sources(program: Attention) -> list[str]:
    """The inputs the modifiers index (a param table, a sequence), in the order they are first read."""
    roots = [n for n in (program.score, program.mask) if n is not None]
    out: list[str] = []
    for n in toposort(roots):
        if n.op is Op.GATHER and n.args[0].op is Op.INPUT and n.args[0].arg not in out:
            out.append(n.args[0].arg)
    return out


def row_axes(program: Attention) -> tuple[str, ...] | None:
    """The batch axes the spans follow, one span table a row (`row_spans`): the sequence inputs' axes where they
    share some (document ids [b, t]: a row per b); None for one table for every batch index."""
    axes = {d.axes for d in program.seqs}
    return next(iter(axes)) if len(axes) == 1 and next(iter(axes)) else None


def table_width(program: Attention) -> int:
    """Columns of the param table (`param_table`): one a param, then two a gather source (offset, last index),
    then with `row_axes` the batch index's row of the spans."""
    return len(program.params) + 2 * len(gather_sources(program)) + (row_axes(program) is not None)


def print_body(root: Node | None, program: Attention, default: str,
               leaves: tuple[str, ...] = ("score", "q_idx", "kv_idx"), batch_sums: bool = False,
               hoisted: dict[Node, str] | None = None) -> str:
    """The statements of a modifier's C function body returning `root` (`default` where None): one
    local per node, in topological order; `leaves` are the function's own arguments (the backward adds
    "grad_score"). `batch_sums`: a sum over batch axes prints as its argument, the value of one batch
    index (a param gradient's summand, linear in grad_score: the host sums the batch indices). `hoisted`:
    nodes computed outside the function (`hoisted_reads`), printed as the C expression given (``rv[0]``),
    their arguments not printed. Raises `Unprintable` for an op or leaf outside the subset."""
    if root is None:
        return f"    return {default};"
    lines, names = _statements([root], program, leaves, batch_sums, hoisted or {})
    lines.append(f"    return {names[root]};")
    return "\n".join(lines)


def _statements(roots: list[Node], program: Attention, leaves: tuple[str, ...], batch_sums: bool,
                hoisted: dict[Node, str]) -> tuple[list[str], dict[Node, str]]:
    """(C statements, a C name per node) computing `roots` (`print_body`)."""
    params = [d.name for d in program.params]
    sources = gather_sources(program)
    batch = set(program.batch_axes)
    static = program.static_sizes
    # the nodes the roots read, not looking past a hoisted node
    needed: set[int] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if id(n) in needed:
            continue
        needed.add(id(n))
        if n not in hoisted:
            stack.extend(n.args)
    names: dict[Node, str] = {}
    lines = []
    for i, n in enumerate(toposort(roots)):
        if id(n) not in needed:
            continue
        if n in hoisted:
            names[n] = hoisted[n]
            continue
        if n.op is Op.INPUT and n.arg in sources:
            names[n] = ""  # read only through its gathers (below)
            continue
        if any(names[a] == "" for j, a in enumerate(n.args) if not (n.op is Op.GATHER and j == 0)):
            raise Unprintable(f"{n.op.name.lower()} reads an indexed input whole")
        if n.op is Op.GATHER:
            col = len(params) + 2 * sources.index(n.args[0].arg)
            x = names[n.args[1]]
            at = f"({x} <= 0.0f ? 0 : ({x} >= prm[{col + 1}] ? (int)prm[{col + 1}] : (int){x}))"
            names[n] = f"n{i}"
            lines.append(f"    const float n{i} = prm[(int)prm[{col}] + {at}];")
            continue
        if any(a not in batch for a in n.axes):
            raise Unprintable(f"{n.op.name.lower()} has axes {n.axes} beyond the batch axes")
        op, a = n.op, [names[x] for x in n.args]
        if op is Op.INPUT:
            if n.arg in leaves:
                names[n] = str(n.arg)
                continue
            if n.arg not in params:
                raise Unprintable(f"input {n.arg!r} is no param of the spec")
            expr = f"prm[{params.index(n.arg)}]"
        elif op is Op.CONST:
            expr = float_literal(n.arg)
        elif op is Op.SIZE and n.arg in static:
            expr = float_literal(float(static[n.arg]))
        elif op is Op.SUM and batch_sums and set(n.arg if isinstance(n.arg, tuple) else (n.arg,)) <= batch:
            names[n] = a[0]
            continue
        elif op in (Op.RENAME, Op.EXPAND):
            names[n] = a[0]  # the same value per batch index
            continue
        elif op in _UNARY:
            expr = _UNARY[op].format(*a)
        elif op in _BINARY:
            expr = _BINARY[op].format(*a)
        elif op is Op.WHERE:
            expr = f"({a[0]} ? {a[1]} : {a[2]})"
        else:
            raise Unprintable(f"op {op.name.lower()} has no inline C in the flash kernel")
        names[n] = f"n{i}"
        lines.append(f"    const {'bool' if n.dtype == BOOL else 'float'} n{i} = {expr};")
    return lines, names


_LEAVES = ("score", "q_idx", "kv_idx", "grad_score")


def hoisted_reads(root: Node | None, program: Attention) -> tuple[list[Node], list[Node]]:
    """(row reads, column reads): the indexed reads (gathers) of `root` whose index depends on q_idx (or on
    neither index) and on no other leaf, and those whose index depends on kv_idx alone: ``doc[q_idx]``,
    ``doc[kv_idx]``, not ``table[q_idx - kv_idx]``. A kernel computes a row's reads once per row and a
    column's once per column (`printed_mask`), not at every (row, column) element."""
    if root is None:
        return [], []
    sources = set(gather_sources(program))
    deps: dict[Node, frozenset] = {}
    rows: list[Node] = []
    cols: list[Node] = []
    for n in toposort([root]):
        if n.op is Op.INPUT and n.arg in _LEAVES:
            deps[n] = frozenset((n.arg,))
            continue
        deps[n] = frozenset().union(*(deps[a] for a in n.args))
        if n.op is Op.GATHER and n.args[0].op is Op.INPUT and n.args[0].arg in sources:
            if deps[n] <= {"q_idx"}:
                rows.append(n)
            elif deps[n] == {"kv_idx"}:
                cols.append(n)
    return rows, cols


def _print_reads(nodes: list[Node], program: Attention, leaf: str, out: str) -> str:
    """The body of a C function of (`leaf`, prm, `out`) storing `nodes`' values at out[0], out[1], ..."""
    if not nodes:
        return f"    (void){leaf}; (void)prm; (void){out};"
    lines, names = _statements(nodes, program, (leaf,), False, {})
    lines += [f"    {out}[{k}] = {names[n]};" for k, n in enumerate(nodes)]
    return "\n".join(lines)


def printed_mask(program: Attention) -> dict:
    """The mask printed with its row and column reads hoisted (`hoisted_reads`), as template arguments:
    ``mask_body`` (the body of ``mask_mod(q_idx, kv_idx, prm, rv, cv)``: row read k at rv[k], column read k
    at cv[k]), ``row_body`` (of ``row_reads(q_idx, prm, rv)``), ``col_body`` (of ``col_reads(kv_idx, prm,
    cv)``), ``nrow`` and ``ncol`` (the reads' counts). As a plain loop, per element (i, j):
    ``row_reads(i, rv); col_reads(j, cv); mask_mod(i, j, rv, cv)``, the same value as the unhoisted mask."""
    rows, cols = hoisted_reads(program.mask, program)
    hoisted = {n: f"rv[{k}]" for k, n in enumerate(rows)} | {n: f"cv[{k}]" for k, n in enumerate(cols)}
    return dict(mask_body=print_body(program.mask, program, "true", hoisted=hoisted),
                row_body=_print_reads(rows, program, "q_idx", "rv"),
                col_body=_print_reads(cols, program, "kv_idx", "cv"), nrow=len(rows), ncol=len(cols))


def unsupported(program: Attention) -> str | None:
    """Why the flash kernel cannot run `program` whatever the call (None: it can, for supported calls)."""
    sources = gather_sources(program)
    for d in program.params:
        if any(a not in program.batch_axes for a in d.axes) and d.name not in sources:
            return f"param {d.name!r} has axes {d.axes} beyond the batch axes {program.batch_axes}"
    try:
        print_body(program.score, program, "score")
        print_body(program.mask, program, "true")
    except Unprintable as err:
        return str(err)
    return None


def call_unsupported(call) -> str | None:
    """Why a bound call (tiled_attention.Call) cannot run on the flash kernel (None: it can)."""
    from ...options import emulating

    q, k, v = call.q, call.k, call.v
    if not (q.is_cuda and k.is_cuda and v.is_cuda) and not emulating():
        return "not CUDA tensors"
    import torch

    if q.dtype not in (torch.bfloat16, torch.float16) or not (q.dtype == k.dtype == v.dtype):
        return f"dtype {q.dtype} (the kernel takes bf16 or fp16 q, k, v)"
    d, e = q.shape[-1], v.shape[-1]
    if d not in HEAD_DIMS or e != d:
        return f"head dim {d}, value dim {e} (the kernel takes equal head and value dims in {HEAD_DIMS})"
    return None


def cupy_missing() -> str | None:
    """Why the kernel cannot be compiled and loaded here (None: CuPy imports)."""
    global _CUPY
    if _CUPY is None:
        import importlib.util

        _CUPY = "" if importlib.util.find_spec("cupy") is not None else "CuPy is not installed"
    return _CUPY or None


_CUPY: str | None = None
_SOURCES: dict = {}


def printed_modifiers(program: Attention, d: int) -> tuple[str, str, float, str]:
    """(score_mod's body, mask_mod's body as CUDA C, the score scale at head dim `d`, a digest of the three
    for kernel names): what every flash kernel of `program` prints."""
    score_body = print_body(program.score, program, "score")
    mask_body = print_body(program.mask, program, "true")
    scale = program.scale if program.scale is not None else 1.0 / math.sqrt(d)
    digest = hashlib.sha256(f"{score_body}\n{mask_body}\n{scale!r}".encode()).hexdigest()[:10]
    return score_body, mask_body, scale, digest


def kernel_source(program: Attention, d: int, bf16: bool, config_name: str | None = None,
                  gqa: bool = False) -> tuple[str, str]:
    """(kernel name, CUDA source with the tile-product header) of `program`'s flash forward at head dim
    `d` (`HEAD_DIMS`), bf16 or fp16 inputs, in config `config_name` (`config`: None for the options);
    `gqa`: k and v with fewer heads than q (`kv_index`, the group and inner size from the spans' tail;
    a kernel of its own, so that the multi-head kernel keeps its registers); cached. Raises
    `Unprintable` where `unsupported` says why."""
    from ...source import mma_header

    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d}: the flash kernel takes {HEAD_DIMS}")
    cfg = config(d, config_name)
    key = (program, d, bf16, cfg, gqa)
    hit = _SOURCES.get(key)
    if hit is not None:
        return hit
    score_body, mask_body, scale, digest = printed_modifiers(program, d)
    suffix = ("" if cfg.name == "bm64" else "_" + cfg.name) + ("_gqa" if gqa else "")
    name = f"flash_fwd_d{d}_{'bf16' if bf16 else 'fp16'}{suffix}_{digest}"
    common = dict(name=name, d=d, bm=cfg.bm, bn=cfg.bn, bf16=bf16, nparams=len(program.params),
                  scale=float_literal(scale), score_body=score_body, mask_body=mask_body, gqa=gqa,
                  gather=bool(gather_sources(program)), width=table_width(program),
                  row_spans=row_axes(program) is not None, span_col=table_width(program) - 1)
    common.update(printed_mask(program))  # the mask with its row and column reads hoisted
    if cfg.name == "bm64":
        text = template("flash/forward.cu.j2").render(**common)
    elif cfg.wgmma:
        from ..wgmma import header

        text = header() + "\n" + template("flash/forward_wgmma.cu.j2").render(
            **common, shared=cfg.shared(d), raw=program.score is None and scale > 0, stagger=cfg.stagger)
    else:
        text = template("flash/forward_bm128.cu.j2").render(
            **common, warps=cfg.warps, rt=cfg.rt, qreg=cfg.qreg, min_blocks=cfg.min_blocks, shared=cfg.shared(d),
            raw=program.score is None and scale > 0)
    _SOURCES[key] = hit = (name, mma_header() + "\n" + text)
    return hit


MAX_EXACT = 1 << 24  # offsets into the param table are floats: exact up to here


def _batch_rows(axes: tuple[str, ...], batch: tuple[str, ...], sizes: dict[str, int], device=None):
    """[BH] int64 on `device`: per flattened batch index, the row of an array whose leading axes are `axes` (batch
    axes, in that order, flattened the last fastest) that it reads (made there: no copy from the host)."""
    import torch

    n = math.prod(sizes[a] for a in axes)
    rows = torch.arange(n, dtype=torch.int64, device=device).reshape([sizes[a] for a in axes])
    order = [a for a in batch if a in axes]
    rows = rows.permute([axes.index(a) for a in order])  # a list: no dims where no batch axis
    shape = [sizes[a] for a in batch]
    return rows.reshape([sizes[a] if a in axes else 1 for a in batch]).expand(shape).reshape(-1)


@dataclass(frozen=True)
class TableLayout:
    """Where `param_table` puts what (numbers from the table's start): the [BH, width] columns, then each table
    source's rows, then each sequence source's rows (the table's tail: `prefix` numbers before it, `total` in all).
    `header` [BH * width] fp32 on the device: the columns that depend on no value (each gather source's offset and
    last index, the span row), the params' columns 0."""

    bh: int
    width: int
    header: object
    tables: tuple   # (name, start) per table source
    seqs: tuple     # (name, start, rows) per sequence source: `rows` rows of the ids' length each
    prefix: int
    total: int


_LAYOUTS: dict = {}


def table_layout(program: Attention, sizes: dict[str, int], length: int, device) -> TableLayout:
    """`TableLayout` of a program's param table at `sizes`, sequences of `length` positions, on `device`: made
    once per signature (its header copied to the device then)."""
    import torch

    key = (program, tuple(sorted(sizes.items())), length, str(device))
    hit = _LAYOUTS.get(key)
    if hit is not None:
        return hit
    batch = program.batch_axes
    bh = math.prod(sizes[a] for a in batch)
    width = table_width(program)
    decls = {d.name: d for d in program.inputs}
    seqs = {d.name for d in program.seqs}
    sources = gather_sources(program)
    header = torch.zeros((bh, width), dtype=torch.float64)
    row0 = torch.arange(bh, dtype=torch.int64) * width
    start, tables, seq_rows = bh * width, [], []
    # tables' rows first, then the sequences': the ids' rows a call writes are the table's tail
    for name in [n for n in sources if n not in seqs] + [n for n in sources if n in seqs]:
        d = decls[name]
        if name in seqs:
            lead, n = d.axes, length
        else:
            lead = tuple(a for a in d.axes if a in batch)
            (axis,) = [a for a in d.axes if a not in batch]
            n = sizes[axis]
        rows = math.prod(sizes[a] for a in lead)
        col = len(program.params) + 2 * sources.index(name)
        header[:, col] = (start + _batch_rows(lead, batch, sizes) * n - row0).double()
        header[:, col + 1] = float(n - 1)
        (seq_rows.append((name, start, rows)) if name in seqs else tables.append((name, start)))
        start += rows * n
    if row_axes(program) is not None:  # the batch index's row of the spans (`row_span_table`)
        header[:, -1] = _batch_rows(row_axes(program), batch, sizes).double()
    if start >= MAX_EXACT:
        raise ValueError(f"the flash kernel's param table with the indexed inputs would hold {start} numbers, "
                         f"past the {MAX_EXACT} its float offsets reach exactly")
    prefix = seq_rows[0][1] if seq_rows else start
    hit = TableLayout(bh, width, header.to(torch.float32).reshape(-1).to(device), tuple(tables), tuple(seq_rows),
                      prefix, start)
    if len(_LAYOUTS) >= 64:
        _LAYOUTS.clear()
    _LAYOUTS[key] = hit
    return hit


def _param_column(program: Attention, d, t, sizes: dict[str, int]):
    """[BH] fp32: a param of batch axes only, its value per flattened batch index (broadcast where it lacks one)."""
    import torch

    batch = program.batch_axes
    t = t.to(torch.float32)
    order = [a for a in batch if a in d.axes]
    t = t.permute([d.axes.index(a) for a in order])  # a list: a scalar param has no dims
    t = t.reshape([sizes[a] if a in d.axes else 1 for a in batch]).expand([sizes[a] for a in batch])
    return t.reshape(-1)


def table_prefix(program: Attention, layout: TableLayout, params: dict, sizes: dict[str, int]):
    """The param table up to its sequences' rows (`TableLayout.prefix` numbers, fp32): the header with the params'
    columns, then the tables' rows, from the params' values (the header itself, no op, without params)."""
    import torch

    if not program.params:
        return layout.header
    batch = program.batch_axes
    table = layout.header.reshape(layout.bh, layout.width).clone()
    parts = [table.reshape(-1)]
    decls = {d.name: d for d in program.params}
    for i, d in enumerate(program.params):
        if all(a in batch for a in d.axes):
            table[:, i] = _param_column(program, d, params[d.name], sizes)
    for name, _ in layout.tables:
        d, t = decls[name], params[name]
        lead = tuple(a for a in d.axes if a in batch)
        (axis,) = [a for a in d.axes if a not in batch]
        parts.append(t.permute(*[d.axes.index(a) for a in (*lead, axis)]).to(torch.float32).reshape(-1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def param_table(program: Attention, params: dict, sizes: dict[str, int]):
    """params [BH, NP] fp32 (torch, contiguous): each param's value per flattened batch index (the
    batch axes in order, the last fastest), broadcast over the batch axes it lacks. With gather sources
    (module docstring) NP is `table_width`: a table's own column is unused (0), and each source's two
    columns hold the offset from the batch index's row to its row of the source, and that row's last index;
    the sources' rows follow the [BH, NP] table (one flat tensor: `table_layout`, the tables' rows, then the
    sequences' ids along time per index of their axes)."""
    import torch

    sources = gather_sources(program)
    if not sources:
        batch = program.batch_axes
        bh = math.prod(sizes[a] for a in batch)
        cols = [_param_column(program, d, params[d.name], sizes) for d in program.params]
        if not cols:
            return torch.zeros((bh, 0), dtype=torch.float32)
        return torch.stack(cols, dim=1).contiguous()
    seqs = {d.name for d in program.seqs}
    length = next((params[n].shape[0] for n in sources if n in seqs), 0)
    layout = table_layout(program, sizes, length, params[sources[0]].device)
    parts = [table_prefix(program, layout, params, sizes)]
    for name, _, _ in layout.seqs:  # (L, *axes) -> (*axes, L)
        t = params[name]
        parts.append(t.permute(*range(1, t.dim()), 0).to(torch.float32).reshape(-1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _merged_stride(shape, strides) -> int | None:
    """The one stride that steps through dims `shape` (strides `strides`) flattened, the last fastest; None where
    they do not flatten without a copy."""
    stride = expected = None
    for n, st in zip(reversed(shape), reversed(strides)):
        if n == 1:
            continue
        if expected is None:
            stride = st
        elif st != expected:
            return None
        expected = st * n
    return 1 if stride is None else stride


class FusedPlan:
    """What every `fused_tables` call of one signature launches: the span kernel writing the param table too, the
    device's numbers it reads, and where each table lies in the one buffer a call allocates (byte offsets)."""

    def __init__(self, fn, rows: int, dims, layout, names: tuple, offsets: tuple, nbytes: int, key_bn: int,
                 params: bool):
        self.fn, self.rows, self.dims, self.layout, self.names, self.key_bn = fn, rows, dims, layout, names, key_bn
        self.spans_at, self.keys_at, self.scratch_at = offsets
        self.nbytes, self.params, self.device, self.dims_at = nbytes, params, dims.device, dims.data_ptr()


def _aligned(n: int) -> int:
    return -(-n // 16) * 16


def fused_plan(program, call, block_q: int, tile: int, gqa: tuple[int, int], key_bn: int = 0) -> FusedPlan | None:
    """The `FusedPlan` of a call's signature, or None where the fused kernel does not take it (the caller then builds
    the param table and span tables apart): sequences whose rows follow batch axes of their own (`row_axes`),
    every one compared only (`Call.seqs`: the ids as given), ids of a printable type whose rows flatten without a
    copy, a rule that prints."""
    import torch

    if row_axes(program) is None or key_bn % tile:
        return None
    seq_names = [d.name for d in program.seqs]
    sources = [n for n in gather_sources(program) if n in seq_names]
    if not sources or any(n not in call.seqs for n in seq_names):
        return None
    raw = [call.seqs[n] for n in sources]
    length, rows = raw[0].shape[0], math.prod(raw[0].shape[1:])
    layout = table_layout(program, call.sizes, length, raw[0].device)
    if [n for n, _, _ in layout.seqs] != sources or any(r != rows for _, _, r in layout.seqs):
        return None
    fused = tuple((n, str(t.dtype)) for n, t in zip(sources, raw))
    found = span_source(program.mask, block_q, tile, tuple(sorted(call.sizes)), {}, key_bn, fused)
    if found is None:
        return None
    text, name, reads, names, inputs, _ = found
    raw_numbers = []
    for t, (_, start, _) in zip(raw, layout.seqs):
        row = _merged_stride(t.shape[1:], t.stride()[1:])
        if row is None or t.shape[0] != length or math.prod(t.shape[1:]) != rows:
            return None
        raw_numbers += [row if rows > 1 else 0, t.stride(0), start]
    nb, nt = -(-call.lq // block_q), -(-call.lk // tile)
    windows = max(1, 2 * rows * sum(nb if i == "q_idx" else nt for _, i in reads))
    numbers = [length, rows, *(x for _ in inputs for x in (length, 1)),
               *(x for n in names for x in (call.sizes[n], call.sizes[n] - 1)), *gqa,
               layout.prefix, windows, *raw_numbers]
    dims = torch.tensor(numbers, dtype=torch.int64, device=raw[0].device)
    spans_at = _aligned(4 * layout.total)
    keys_at = spans_at + _aligned(4 * rows * (4 * nb + 2))
    scratch_at = keys_at + _aligned(4 * rows * (4 * -(-call.lk // key_bn) + 2) if key_bn else 0)
    nbytes = scratch_at + 4 * (windows + rows * length)
    fn = loaded_function(text, name, raw[0].device)
    return FusedPlan(fn, rows, dims, layout, tuple(sources), (spans_at, keys_at, scratch_at), nbytes, key_bn,
                     bool(program.params))


def cached_fused_plan(program, call, block_q: int, tile: int, key_bn: int, plans: dict):
    """`fused_plan` of a call, kept in `plans` (a kernel's, per options) by what it depends on, and by the call's
    bind signature where it has one (`Call.signature`: the same shapes, strides, dtypes and devices)."""
    if not options().span_kernel:
        plan = None
    else:
        key = (block_q, tile, key_bn, call.lq, call.lk, tuple(call.sizes.items()), gqa_shape(call),
               *((t.dtype, t.shape, t.stride(), t.device) for t in call.seqs.values()))
        plan = plans.get(key, False)
        if plan is False:
            plan = plans[key] = fused_plan(program, call, block_q, tile, gqa_shape(call), key_bn)
    if call.signature is not None:
        if len(plans) >= 64:
            plans.clear()
        plans[call.signature] = plan
    return plan


def fused_tables(plan: FusedPlan, program, call) -> tuple:
    """One launch of `plan`'s kernel for a call: (the buffer, the address of its param table, of its query blocks'
    span table, of its key blocks' (0 without)). The buffer holds them all (`forward.param_table`'s values and
    `forward.row_span_table`'s layout; a scratch after): no other op than its allocation, where the program has no
    params (else the params' part of the table from their values, each call: `forward.table_prefix`)."""
    import torch

    device = plan.device
    prefix = table_prefix(program, plan.layout, call.params, call.sizes) if plan.params else plan.layout.header
    buffer = torch.empty(plan.nbytes, dtype=torch.uint8, device=device)
    base = buffer.data_ptr()
    keys = base + plan.keys_at if plan.key_bn else 0
    pointers = [plan.dims_at, *(call.seqs[n].data_ptr() for n in plan.names), base + plan.spans_at,
                base + plan.scratch_at, *([keys] if keys else []), prefix.data_ptr(), base]
    if plan.rows:
        if device.type == "cuda" and device.index != torch.cuda.current_device():
            with torch.cuda.device(device):
                launch_kernel(plan.fn, (plan.rows, SPAN_THREADS), call.lq, call.lk, pointers)
        else:
            launch_kernel(plan.fn, (plan.rows, SPAN_THREADS), call.lq, call.lk, pointers)
    return buffer, base, base + plan.spans_at, keys


def block_spans(mask: Node | None, lq: int, lk: int, sizes: dict[str, int], bm: int = BM,
                bn: int = BN, seqs: dict | None = None) -> list[tuple[int, int, int, int]]:
    """Per block of `bm` queries, (lo, hi, full_lo, full_hi): keys outside [lo, hi) are masked for every
    query of the block (`mask_blocks.key_spans` over key tiles of `bn`), and every key tile inside
    [full_lo, full_hi) is visible to every query of the block and below Lk (the mask proven true over the
    whole rectangle), so the kernel evaluates no mask there; an empty [full_lo, full_hi) where no tile is.
    `seqs`: the sequence inputs' per-position ranges (`mask_blocks.sequence_ranges`)."""
    from .....passes.mask_blocks import _bool, _evaluate, grid_spans, key_spans

    if seqs and mask is not None:  # per call: every (block, tile) at once
        return grid_spans(mask, lq, lk, bm, bn, sizes, seqs)
    spans = key_spans(mask, lq, lk, bm, bn, sizes, seqs)
    order = toposort([mask]) if mask is not None else None
    out = []
    for b, (lo, hi) in enumerate(spans):
        q = (float(b * bm), float(min((b + 1) * bm, lq) - 1))
        full = []
        for t0 in range(lo, hi, bn):
            if t0 + bn > lk:
                continue  # keys past Lk: masked element-wise
            if order is None or not _bool(_evaluate(order, q, (float(t0), float(t0 + bn - 1)), sizes, seqs))[1]:
                full.append(t0)
        # the longest run of consecutive full tiles (others stay partial: sound)
        best, run = (0, 0), None
        for t0 in full:
            run = (run[0], t0 + bn) if run is not None and run[1] == t0 else (t0, t0 + bn)
            if run[1] - run[0] > best[1] - best[0]:
                best = run
        out.append((lo, hi, *best))
    return out


def sequence_reads(program: Attention, arrays: dict) -> dict:
    """Each sequence input's per-position (min, max) over a row's batch indices, two [R, L] tensors on the ids'
    device (`mask_blocks.span_tables`' `seqs`; no host copy): a row per index of `row_axes` (each row's own ids,
    min = max: exact), else one row over every batch index."""
    out = {}
    for d in program.seqs:
        t = arrays[d.name].reshape(arrays[d.name].shape[0], -1)
        if row_axes(program) is None:
            out[d.name] = (t.amin(1)[None], t.amax(1)[None])
        else:
            t = t.t()
            out[d.name] = (t, t)
    return out


def row_span_table(spans, gqa: tuple[int, int]):
    """The kernels' spans with a table a row: [R * (4 * blocks + 2)] int32 on `spans`' device, each row's spans
    [R, blocks, 4] then the group and inner size (`span_table`'s layout a row), rows one after another; a kernel
    with `row_axes` offsets by its batch index's row (the param table's last column)."""
    import torch

    rows = spans.shape[0]
    tail = spans.new_full((rows, 2), gqa[0])
    tail[:, 1] = gqa[1]
    return torch.cat([spans.reshape(rows, -1), tail], 1).to(torch.int32).reshape(-1)


def mean_tiles(spans, bn: int):
    """The mean key tiles of `bn` a query block visits over spans [..., 4] (a 0-d tensor: no host copy)."""
    return (spans[..., 1] - spans[..., 0] + bn - 1).div(bn, rounding_mode="floor").clamp(min=0).double().mean()


def span_table(spans: list[tuple[int, ...]], group: int = 1, inner: int = 1) -> list[int]:
    """The kernel's spans array: [lo_0, hi_0, full_lo_0, full_hi_0, lo_1, ..., group, inner] (`block_spans`;
    then grouped-query attention's `kv_index` numbers)."""
    return [*(x for span in spans for x in span), group, inner]


def kv_index(bh: int, group: int, inner: int) -> int:
    """The batch index of k and v that flattened batch index `bh` of q reads under grouped-query attention:
    q's batch axes [*outer, H, *rest] flattened (the last fastest), k's and v's [*outer, H / group, *rest],
    query head h reading KV head h // group, `inner` = prod(rest). As a plain loop (the kernels' formula):

        outer_and_head, r = divmod(bh, inner)       # outer * H + h, since H = Hkv * group:
        return outer_and_head // group * inner + r  # (outer * Hkv + h // group) * inner + r"""
    return (bh // inner) // group * inner + bh % inner


def gqa_shape(call) -> tuple[int, int]:
    """(group, inner) of a bound call (`kv_index`): (1, 1) where k and v have q's heads."""
    if call.group == 1:
        return 1, 1
    return call.group, math.prod(call.q.shape[call.kv_axis + 1:-2])


class FlashForward:
    """The flash forward of one program on CUDA tensors (module docstring): compiled per (device, source)
    with CuPy (NVRTC), launched on torch's current stream, in the config `config` (a `CONFIGS` name; None:
    ``SSMC_CUDA_FLASH_FORWARD``'s at each call, else the device's default: `config`)."""

    def __init__(self, program: Attention, config: str | None = None):
        if config is not None and config not in CONFIGS:
            raise ValueError(f"flash forward config {config!r}: expected one of {', '.join(CONFIGS)}")
        self.program = program
        self.config = config
        self.reason = unsupported(program)
        self.tables = any(a not in program.batch_axes for d in program.params for a in d.axes)
        self._spans: dict = {}
        self._launches: dict = {}

    def _function(self, device, d: int, bf16: bool, cfg: Config, gqa: bool = False):
        name, text = kernel_source(self.program, d, bf16, cfg.name, gqa)
        return loaded_function(text, name, device, arch=cfg.arch)

    def _span_tensor(self, call, cfg: Config, mean: bool = True):
        """(the spans as the kernel takes them, the mean key tiles a query block visits), cached per shape (with
        sequence inputs, document ids, per call on the device from the ids: the mean then a 0-d tensor, None
        where not `mean`)."""
        import torch

        from ...options import options

        gqa = gqa_shape(call)
        if self.program.seqs:  # the ids' spans on their device, no host copy: one generated kernel, else torch ops
            from .....passes.mask_blocks import span_tables

            reads = sequence_reads(self.program, call.param_values())
            table = None
            if options().span_kernel:
                from .spans import span_kernel_table

                table = span_kernel_table(self.program.mask, call.lq, call.lk, cfg.bm, cfg.bn, call.sizes, reads, gqa)
            if table is None:
                spans = span_tables(self.program.mask, call.lq, call.lk, cfg.bm, cfg.bn, call.sizes, reads)
                return row_span_table(spans, gqa), mean_tiles(spans, cfg.bn) if mean else None
            if not mean:
                return table, None
            nb = -(-call.lq // cfg.bm)
            return table, mean_tiles(table.view(-1, 4 * nb + 2)[:, :4 * nb].view(-1, nb, 4), cfg.bn)
        key = (call.lq, call.lk, tuple(sorted(call.sizes.items())), call.q.device, cfg.bm, cfg.bn, gqa)
        hit = self._spans.get(key)
        if hit is None:
            if len(self._spans) > 64:
                self._spans.clear()
            spans = block_spans(self.program.mask, call.lq, call.lk, call.sizes, cfg.bm, cfg.bn)
            tiles = sum(-(-(hi - lo) // cfg.bn) for lo, hi, _, _ in spans if hi > lo) / max(1, len(spans))
            t = torch.tensor(span_table(spans, *gqa), dtype=torch.int32, device=call.q.device)
            hit = self._spans[key] = (t, tiles)
        return hit

    def __call__(self, call, out32=None):
        """(out [*batch, Lq, d] in q's dtype, lse [*batch, Lq] fp32) of a bound call that `call_unsupported`
        accepts (k and v with their own heads under grouped-query attention: `kv_index`); where `out32` (an
        fp32 contiguous tensor of out's shape) is given, the output unrounded into it too."""
        import torch

        from ...launch import launch_kernel

        q, k, v = (t.contiguous() for t in (call.q, call.k, call.v))
        q, k, v = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (q, k, v))
        batch = q.shape[:-2]
        bh, lq, lk, d = math.prod(batch), call.lq, call.lk, q.shape[-1]
        out = torch.empty((*batch, lq, d), dtype=q.dtype, device=q.device)
        lse = torch.empty((*batch, lq), dtype=torch.float32, device=q.device)
        if bh == 0 or lq == 0:
            return out, lse
        fn, grid, shared, spans, no_params, cfg, plans = self._launch(call, q, k, v)
        tables = self._tables(call, cfg, plans) if call.seqs else None  # the param and span tables of these ids
        if tables is not None:
            params_at, spans_at = tables[1], tables[2]
        else:
            if self.program.seqs:  # the ids are this call's
                spans = self._span_tensor(call, cfg, mean=False)[0]
            # per call: a param tensor may be new at a freed one's address, or changed in place (through `.data`,
            # unseen by its version counter): a table cached by pointers or versions could go stale
            params = no_params if no_params is not None else param_table(
                self.program, call.param_values(), call.sizes).to(q.device)
            params_at, spans_at = params.data_ptr(), spans.data_ptr()
        pointers = [q.data_ptr(), k.data_ptr(), v.data_ptr(), params_at, spans_at, out.data_ptr(),
                    lse.data_ptr(), 0 if out32 is None else out32.data_ptr()]
        if q.is_cuda and q.device.index != torch.cuda.current_device():  # the function lives in q's device's context
            with torch.cuda.device(q.device):
                launch_kernel(fn, grid, lq, lk, pointers, shared=shared)
        else:
            launch_kernel(fn, grid, lq, lk, pointers, shared=shared)
        return out, lse

    def _tables(self, call, cfg: Config, plans: dict):
        """With sequence inputs, `fused_tables` of a call (one launch: the param table and the span table
        from the ids, in one buffer), where its signature's `fused_plan` exists (kept in `plans`, the launch's:
        by the call's bind signature, else by what it depends on); else None."""
        plan = plans.get(call.signature, False) if call.signature is not None else False
        if plan is False:
            plan = cached_fused_plan(self.program, call, cfg.bm, cfg.bn, 0, plans)
        return None if plan is None else fused_tables(plan, self.program, call)

    def _launch(self, call, q, k, v) -> tuple:
        """(function, grid, dynamic shared bytes, spans, the param table where the program has no params: else
        None, the config, the fused tables' plans by signature: `_tables`) of a call, the same for every call of
        its shapes, dtype, device, group and options: cached."""
        import torch

        from ...options import options

        key = (q.shape, k.shape, v.shape, q.dtype, q.device, call.group, call.kv_axis, options())
        hit = self._launches.get(key)
        if hit is None:
            bh, lq, d = math.prod(q.shape[:-2]), call.lq, q.shape[-1]
            cfg = config(d, self.config, q.device)
            if cfg.name == "bm128w4" and d == 64 and self.config is None and not _forced() and self.tables:
                cfg = CONFIGS["bm128w8"][d]  # a table's loads spilled the 4-warp build's registers: the same tiles
            spans, tiles = self._span_tensor(call, cfg)
            # with ids the mean is a device tensor: read once per shape (the first call's ids decide the config)
            if cfg.stagger and float(tiles) < STAGGER_MIN_TILES and self.config is None and not _forced():
                cfg = CONFIGS["wg128"][d]  # the same tiles, so the same spans
            fn = self._function(q.device, d, q.dtype == torch.bfloat16, cfg, call.group > 1)
            no_params = None if table_width(self.program) else torch.zeros((bh, 0), dtype=torch.float32,
                                                                            device=q.device)
            if len(self._launches) >= 64:
                self._launches.clear()
            hit = self._launches[key] = (fn, (-(-lq // cfg.bm) * bh, cfg.threads), cfg.shared(d), spans, no_params,
                                         cfg, {})
        return hit

"""The flash attention backward of an `Attention` program: one kernel launch on the tensor cores.

    reason = unsupported(program)                      # None where the backward's modifiers print as CUDA C
    name, text = kernel_source(program, d=128, bf16=True)
    bwd = FlashBackward(program); grads = bwd(call, out, lse, d_out)   # {"q", "k", "v", param names}

FlashAttention-2's backward: delta[bh, i] = sum_e d_out[bh, i, e] out[bh, i, e] in fp32 (a small kernel,
``backward_delta.cu.j2``, a warp a row, which also zeroes the atomic dQ's rows), then the key-block kernel,
per batch index bh and block of `config(d).bn` keys j, as a plain loop:

    for each query tile [m0, m0 + BQ) of the queries the key block may be visible to   (key_block_spans)
        s[i, j] = scale * sum_d q[bh, i, d] k[bh, j, d];  m = score_mod(s, i, j, params[bh])
        p[i, j] = exp(m - lse[bh, i]), 0 where not mask_mod(i, j) or j >= Lk or lse[bh, i] = -inf
        dv[bh, j] += sum_i p[i, j] d_out[bh, i]
        dm[i, j] = p[i, j] (sum_e d_out[bh, i, e] v[bh, j, e] - delta[bh, i])
        ds[i, j] = d_score(dm, s, i, j, params[bh])        (0 where p = 0; passes/attention_grad.py)
        dk[bh, j] += scale * sum_i ds[i, j] q[bh, i];   dq[bh, i] += scale * sum_j ds[i, j] k[bh, j]  (fp32 atomics)
        dparams[kb, bh, n] += sum_{i, j} d_param_n(dm, s, i, j, params[bh])

Configs (`CONFIGS`, ``SSMC_CUDA_FLASH_BACKWARD_CONFIG``): "bn64" (``backward.cu.j2``: 4 warps of 16 keys,
query tiles of 32 rows at d 64 and 16 at d 128, static shared memory, Q and dO single-buffered), "w4q64" and
"w8q64", "w8q32" (``backward_wide.cu.j2``: 4 or 8 warps of 16 keys, a block of 64 or 128 keys, query tiles
of 64 or 32 rows, Q and dO of the next tile by cp.async into a second stage while this one computes, K, V,
both stages and dS^T in dynamic shared memory); the default is "w4q64" at d 64 and "w8q32" at d 128
(`DEFAULT_CONFIG`); on sm_90 parts "wg" (``backward_wgmma.cu.j2``: the wide kernel's algorithm on wgmma,
warpgroups of 64 keys, query tiles of 64); "wgp" is "wg" with more of a tile's steps overlapped (the next
tile's lse and delta loaded ahead, P computed while dP^T multiplies, dV's product issued before dS'); "wgws",
"wgwsa", "wgwss", "wgwse" run "wgp"'s loop in warp-specialized blocks (``backward_wgmma_ws.cu.j2``: a producer
warpgroup loads the query tiles into mbarrier stages; dQ by bulk reductions, atomics, per warpgroup, or with the
next tile's S^T issued early). At d 256 (`HEAD_DIMS`) one config, on every device: "w8q16s2" (the wide kernel with
two warps a 16 keys, `Config.split`: each computes the keys' whole S^T and dP^T and holds dK and dV of half the
columns, 2 x 64 fp32 accumulators a thread where one warp would need 2 x 128, past 255 registers; blocks of 64
keys, query tiles of 16), and dQ by atomics only (`atomic_dq`: the dQ kernel has no d 256 build).
dK, dV accumulate in registers over the visible query tiles (no atomics); dQ accumulates by fp32 atomics
into a zeroed [BH, Lq, d] buffer (summation order not fixed), or with ``SSMC_CUDA_FLASH_DQ=kernel`` a
second kernel (``backward_dq.cu.j2``) per block of `BM` queries recomputes S and dP over the forward's
spans and sums dq[i] = scale * sum_j ds[i, j] k[j] in registers (no atomics: bitwise repeatable, 7
products instead of 5); the params' per-(key block, batch index) sums are added up by torch in a fixed
order. Products in the inputs' 16-bit type with fp32 accumulation;
P and dS rounded to 16 bits as operands (as FlashAttention).

Grouped-query attention (`FlashBackward.reads_kv_heads`: every config but "bn64" and "wgwse"): k and v keep their
own heads and the key-block kernel's GQA build (``kernel_source(..., gqa=True)``) runs a block per KV index kvh and
key block, the loop above once for each query head bh of the group (`forward.kv_index`(bh) = kvh), dk[kvh, j] and
dv[kvh, j] summed over them in registers and stored once (the warp-specialized blocks: the heads' query tiles one
sequence through the producer's ring; their param sums a row of partials per warp); the dQ kernel's reads KV index
kv_index(bh).

With document ids the param table, the key blocks' span table and the dQ kernel's query blocks' come from one
launch of the span kernel a call (`forward.fused_tables`, as the forward's; the backward's block sizes differ from the
forward's, so it makes its own from the saved ids, which torch keeps unchanged until then).

Delta's correction for the params: the forward's output (even its fp32 copy) took P rounded to 16 bits in
its P V product, so delta misses rowsum(P dP) by r[i] = sum_j dm[i, j] (~1e-3 a row, where 0 is exact).
A param's summand is linear in grad_score, d_param(dm) = dm * g, and g may grow with the positions (ALiBi:
-(i - j)): the error sum_i r[i] sum_j p[i, j] g[i, j] reached 5-20x the tolerance at Lq >> Lk. The
kernels also sum per query row r[i] and G_n[i] = sum_j d_param_n(p[i, j]) (the summand at grad_score =
p), and the host subtracts sum_i r[i] G_n[i]: exactly the gradient with delta = rowsum(P dP). With atomic
dQ the key-block kernel adds its keys' part of r and G into a zeroed [BH, Lq, 1 + NP] buffer (atomics);
the dQ kernel sees whole rows and writes per query block the sum of the products (fixed order).
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

from .....ir import build
from .....ir.node import Node, substitute
from .....ir.program import Attention
from .....passes.attention_grad import derive_attention_backward
from ...options import options
from .. import template
from ..loaded import loaded_function
from .forward import (
    BM,
    BN,
    HEAD_DIMS,
    THREADS,
    Unprintable,
    block_spans,
    cached_fused_plan,
    float_literal,
    fused_tables,
    gather_sources,
    gqa_shape,
    print_body,
    printed_mask,
    row_axes,
    row_span_table,
    sequence_reads,
    table_width,
)

BQ = {64: 32, 128: 16}   # "bn64": query rows a tile per head dim (its registers and static shared memory bound it)
LEAVES = ("grad_score", "score", "q_idx", "kv_idx")


@dataclass(frozen=True)
class Config:
    """The key-block kernel's shape: `warps` warps of 16 keys (a block of `bn` = 16 `warps` keys), query
    tiles of `bq` rows. "bn64" is ``backward.cu.j2`` (static shared memory, Q and dO single-buffered), the
    others ``backward_wide.cu.j2`` (K, V, two stages of Q and dO, dS^T in dynamic shared memory)."""

    name: str
    warps: int
    bq: int
    min_blocks: int = 1
    # the wide kernel's warps a 16 keys, each summing dK and dV over d / `split` columns (S^T and dP^T over every
    # column in each): a block of 16 warps / split keys
    split: int = 1
    wgmma: bool = False
    pipelined: bool = False  # wgmma only: the next tile's lse / delta prefetched, S^T and dP^T waited apart, dV early
    # wgmma only: a producer warpgroup loads the query tiles into `stages` stages (``backward_wgmma_ws.cu.j2``),
    # setmaxnreg gives (producer, consumer) `regs` registers a thread; `bulk_dq`: dQ by bulk fp32 reductions;
    # `split_dq`: each warpgroup sums its own keys' part of dQ (no barrier between the warpgroups)
    specialized: bool = False
    stages: int = 2
    regs: tuple[int, int] = (0, 0)
    bulk_dq: bool = False
    split_dq: bool = False
    early_s: bool = False  # specialized: the next tile's S^T issued at the end of this one (`_pipelines`' specs)

    @property
    def arch(self) -> str | None:
        """The architecture the kernel must be built for (None: the device's own)."""
        return "sm_90a" if self.wgmma else None

    @property
    def gqa(self) -> bool:
        """Whether the config has a grouped-query build (`kernel_source(..., gqa=True)`: a block per KV index
        and key block, walking the group's query heads); the others run on k and v repeated to q's heads
        ("wgwse": its early S^T across a head's end spilled hundreds of bytes)."""
        return self.name != "bn64" and not self.early_s

    @property
    def bn(self) -> int:
        return 16 * self.warps // self.split

    @property
    def threads(self) -> int:
        return 32 * self.warps + (128 if self.specialized else 0)

    def shared(self, d: int, atomic_dq: bool) -> int:
        """Bytes of dynamic shared memory a block (0: "bn64"'s static arrays)."""
        if self.name == "bn64":
            return 0
        if self.specialized:  # K, V, the stages, dS^T (two buffers unless split), fp32 dQ tiles (rows padded), align
            tiles = self.warps // 4 if self.split_dq else 1
            dq = (1 if self.split_dq else 2) * 2 * self.bn * self.bq
            dq += tiles * self.bq * (4 * d + 32) if self.bulk_dq else 0
            return 2 * (2 * self.bn * d + 2 * self.stages * self.bq * d) + (dq if atomic_dq else 0) + 1024
        if self.wgmma:  # swizzled, unpadded tiles and 1024 bytes to align them
            return 2 * (2 * self.bn * d + 4 * self.bq * d + (self.bn * self.bq if atomic_dq else 0)) + 1024
        return 2 * (2 * self.bn * (d + 8) + 4 * self.bq * (d + 8) + (self.bn * (self.bq + 8) if atomic_dq else 0))


CONFIGS = {
    "bn64": {d: Config("bn64", 4, BQ[d]) for d in (64, 128)},
    "w4q64": {d: Config("w4q64", 4, 64) for d in (64, 128)},
    "w8q64": {d: Config("w8q64", 8, 64) for d in (64, 128)},
    "w8q32": {d: Config("w8q32", 8, 32) for d in (64, 128)},
    # d 256 only: the wide kernel with two warps a 16 keys (`Config.split`), each holding dK and dV of 128 columns
    # (128 accumulator registers a thread, not 256), blocks of 64 keys, query tiles of 16 (of 32 the atomic dQ
    # build spilled)
    "w8q16s2": {256: Config("w8q16s2", 8, 16, split=2)},
    # sm_90a (``backward_wgmma.cu.j2``): warpgroups of 64 keys, one at d 64, two at d 128; query tiles of 64
    "wg": {64: Config("wg", 4, 64, wgmma=True), 128: Config("wg", 8, 64, wgmma=True)},
    # "wg" with its tile's steps overlapped (``backward_wgmma.cu.j2``'s `pipelined` loop) for specs without params
    # whose dS does not read the score (`_pipelines`; "wg"'s loop for the others)
    "wgp": {d: Config("wgp", 4 if d == 64 else 8, 64, wgmma=True, pipelined=True) for d in (64, 128)},
    # "wgp"'s loop in warp-specialized blocks (``backward_wgmma_ws.cu.j2``): a producer warpgroup loads Q, dO, lse and
    # delta into two stages on mbarriers; the consumers keep the block's registers (setmaxnreg; two blocks an SM at
    # d 64); "wgws" sums dQ by bulk reductions of a tile from shared memory, "wgwsa" by the consumers' atomics,
    # "wgwss" by bulk reductions of each warpgroup's own keys' part (twice the reductions, no barrier between them)
    # (at d 64 one warpgroup: "wgwss" is "wgws"); the bulk sums and the split only for `_pipelines`' specs (the others:
    # "wgwsa"'s atomics, in the same shared memory layout; registers)
    # "wgwse" is "wgws" with the next tile's S^T issued at the end of this one (behind dK's product)
    **{name: {64: Config(name, 4, 64, min_blocks=2, wgmma=True, pipelined=True, specialized=True, regs=(40, 216),
                         bulk_dq=bulk, early_s=early),
              128: Config(name, 8, 64, wgmma=True, pipelined=True, specialized=True, regs=(24, 240), bulk_dq=bulk,
                          split_dq=split, early_s=early)}
       for name, bulk, split, early in (("wgws", True, False, False), ("wgwsa", False, False, False),
                                        ("wgwss", True, True, False), ("wgwse", True, False, True))},
}
# at d 128 the 64-row tiles of 8 warps sit at 255 registers and ptxas spills a word or four for some
# modifiers: query tiles of 32 there (no spills; the same 128-key blocks, so the same Q / dO traffic and dQ atomics)
DEFAULT_CONFIG = {64: "w4q64", 128: "w8q32", 256: "w8q16s2"}
# on sm_90 parts: at d 128 the warp-specialized blocks ("wgws": dQ by bulk reductions for the specs whose loop
# pipelines, atomics on "wg"'s loop for the others; faster than "wgp" for both in bench/flash_backward_configs.py,
# causal and ALiBi with its slope's gradient; its GQA build walks the group's query heads through one ring of
# stages); at d 64 "wgp" ("wgws" no faster there)
# at d 256 the wide kernel's split "w8q16s2" there too (the wgmma kernels' warpgroups of 64 keys would hold 2 x 128
# fp32 accumulators of dK and dV a thread)
HOPPER_CONFIG = {64: "wgp", 128: "wgws", 256: "w8q16s2"}


def config(d: int, name: str | None = None, device=None) -> Config:
    """The key-block kernel's config at head dim `d`: `name`'s, else ``SSMC_CUDA_FLASH_BACKWARD_CONFIG``'s,
    else the head dim's default for `device` (`HOPPER_CONFIG` on an sm_90 part, else `DEFAULT_CONFIG`). A config
    the option names that has no build at `d` gives way to the default; a `name` given here without one is a
    ValueError."""
    from .forward import hopper

    if name is None:
        default = (HOPPER_CONFIG if hopper(device) else DEFAULT_CONFIG)[d]
        name = options().flash_backward_config or default
        if d not in CONFIGS.get(name, {d: None}):
            name = default  # the option's config has no build at this head dim (d 256: only "w8q16s2")
    elif d not in CONFIGS[name]:
        raise ValueError(f"flash backward config {name!r} has no build at head dim {d}")
    cfg = CONFIGS[name][d]
    if cfg.wgmma and device is not None and getattr(device, "type", None) == "cuda" and not hopper(device):
        raise ValueError(f"flash backward config {name!r} needs an sm_90 GPU (wgmma); {device} is not one")
    return cfg


MAX_TABLE = 32  # a table's entries the kernels sum one by one (a summand and an accumulator each)


def summands(program: Attention) -> list[tuple[str, int | None, Node]]:
    """The kernels' sums, one a column of their partials: (param, None, its summand) for a param per batch
    index; for an indexed table along axis r of static size R <= `MAX_TABLE`, (table, c, its entry c's summand)
    for c < R: the gradient's one-hot ``where(r == clamp(index), dM, 0)`` at r = c, so that each entry is a sum
    over (i, j) of its own, added up as a param's is (partials per key block, summed in a fixed order). Raises
    `Unprintable` for a table whose size is not static or past `MAX_TABLE`."""
    bw = derive_attention_backward(program)
    static = program.static_sizes
    out: list[tuple[str, int | None, Node]] = []
    for d, (_, g) in zip(program.params, bw.param_grads):
        extra = [a for a in d.axes if a not in program.batch_axes]
        if not extra:
            out.append((d.name, None, g))
            continue
        (axis,) = extra
        size = static.get(axis)
        if size is None or size > MAX_TABLE:
            raise Unprintable(f"the gradient of the indexed table {d.name!r} (a scatter-add over positions) is "
                              f"summed by the tiled backward: the kernels sum a table's entries one by one, for "
                              f"a static size up to {MAX_TABLE} (ssmc.Param[\"... {axis}=N\"]), not "
                              f"{'a size known only when called' if size is None else size}")
        iota = build.iota(axis)
        for c in range(size):
            (entry,) = substitute((g,), {iota: build.const(float(c))})
            out.append((d.name, c, entry))
    return out


def _bodies(program: Attention, param_grads: bool = True) -> tuple[str, list[str]]:
    """(dS as C, each sum's summand as C (`summands`): none where `param_grads` is False, the params then only
    read)."""
    bw = derive_attention_backward(program)
    dscore = print_body(bw.d_score if program.score is not None else None, program, "grad_score", LEAVES)
    if not param_grads:
        return dscore, []
    params = [print_body(g, program, "0.0f", LEAVES, batch_sums=True) for _, _, g in summands(program)]
    return dscore, params


def unsupported(program: Attention) -> str | None:
    """Why the flash backward cannot run `program` whatever the call (None: it can, for supported calls)."""
    from .forward import unsupported as forward_unsupported

    reason = forward_unsupported(program)
    if reason is not None:
        return reason
    try:
        _bodies(program)
    except Unprintable as err:
        return f"backward: {err}"
    return None


_SOURCES: dict = {}


def dq_mode() -> str:
    """How the backward sums dQ: "atomic" (default: fp32 atomics in the key-block kernel, 5 products) or
    "kernel" (``SSMC_CUDA_FLASH_DQ=kernel``: a second kernel per query block, no atomics, bitwise
    repeatable, 7 products)."""
    return options().flash_dq or "atomic"


def atomic_dq(d: int) -> bool:
    """Whether the backward at head dim `d` sums dQ by atomics: `dq_mode`'s "atomic", and at every head dim the
    dQ kernel has no build for (d 256: its 64 query rows of Q and dO in static shared memory are 67 KiB, past 48,
    and a warp's Q and dO fragments beside dQ's 128 accumulators past 255 registers)."""
    return dq_mode() == "atomic" or d not in BN_DQ


def _printed(program: Attention, d: int, param_grads: bool = True) -> tuple[dict, str]:
    """What both backward templates print of `program` at head dim `d`: (their common arguments: the score
    modifier, mask, dS and each param's summand as C (none without `param_grads`: the kernels then sum no
    param and write zeros for them), the scale, the head dim; a digest of the printed code for the kernel's
    name). Raises `Unprintable` where `unsupported` says why."""
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d}: the flash kernel takes {HEAD_DIMS}")
    score_body = print_body(program.score, program, "score")
    mask = printed_mask(program)  # its row and column reads hoisted
    dscore_body, param_bodies = _bodies(program, param_grads)
    scale = program.scale if program.scale is not None else 1.0 / math.sqrt(d)
    digest = hashlib.sha256("\n".join([score_body, mask["mask_body"], mask["row_body"], mask["col_body"],
                                       dscore_body, *param_bodies, repr(scale)]).encode())
    return (dict(d=d, nparams=len(summands(program)), gather=bool(gather_sources(program)), width=table_width(program),
                 row_spans=row_axes(program) is not None, span_col=table_width(program) - 1,
                 scale=float_literal(scale), score_body=score_body, **mask,
                 dscore_body=dscore_body, param_bodies=param_bodies), digest.hexdigest()[:10])


def _source(key: tuple, program: Attention, d: int, build, param_grads: bool = True) -> tuple[str, str]:
    """(kernel name, CUDA source with the tile-product header), cached by `key`: `build(args, digest)`
    gives (name, the rendered template) from `_printed`'s arguments."""
    from ...source import mma_header

    hit = _SOURCES.get(key)
    if hit is None:
        name, text = build(*_printed(program, d, param_grads))
        _SOURCES[key] = hit = (name, mma_header() + "\n" + text)
    return hit


def _pipelines(args: dict) -> bool:
    """Whether the pipelined wgmma loop ("wgp") takes the spec printed in `_printed`'s `args`: no param summands
    (dS' pass reads P back rounded to 16 bits, which their position-weighted sums would feel: the dQ kernel's delta
    correction, from P in fp32, then misses by 10x the tolerance; P kept in fp32 spills at d 128; a spec whose
    params need no gradient prints none), and a dS that
    does not read the score (the tile's scores kept beside P through dS' pass: 32 registers more, spills at
    d 128). Elsewhere "wgp" runs "wg"'s loop."""
    return not args["param_bodies"] and not re.search(r"\bscore\b", args["dscore_body"])


def kernel_source(program: Attention, d: int, bf16: bool, atomic_dq: bool = True,
                  config_name: str | None = None, gqa: bool = False, param_grads: bool = True) -> tuple[str, str]:
    """(kernel name, CUDA source with the tile-product header) of `program`'s flash backward at head dim
    `d` (`HEAD_DIMS`), bf16 or fp16 inputs, with dQ by atomics or without (`dq_source`'s kernel then), in
    config `config_name` (`config`: None for the options'), summing the params' gradients or not
    (`param_grads`); cached. Raises `Unprintable` where `unsupported` says why."""
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d}: the flash kernel takes {HEAD_DIMS}")
    cfg = config(d, config_name)

    def build(args: dict, digest: str):
        suffix = ("" if cfg.name == "bn64" else "_" + cfg.name) + ("_gqa" if gqa else "")
        name = f"flash_bwd{'' if atomic_dq else '_kv'}_d{d}_{'bf16' if bf16 else 'fp16'}{suffix}_{digest}"
        common = dict(name=name, bf16=bf16, atomic_dq=atomic_dq, row_sums=atomic_dq and bool(args["param_bodies"]),
                      gqa=gqa, **args)
        if cfg.name == "bn64":
            return name, template("flash/backward.cu.j2").render(bn=BN, bq=cfg.bq, **common)
        if cfg.specialized:
            from ..wgmma import header

            producer, consumer = cfg.regs
            if gqa and _pipelines(args) and producer < 40:
                # the GQA build's producer walks the group's heads: with 24 registers ptxas spilled there (and
                # with 32 for ALiBi with a fixed slope); 40 / 232 takes the block's count at launch as 24 / 240
                producer, consumer = producer + 16, consumer - 8
            return name, header() + "\n" + template("flash/backward_wgmma_ws.cu.j2").render(
                warps=cfg.warps, bq=cfg.bq, stages=cfg.stages, min_blocks=cfg.min_blocks, producer_regs=producer,
                consumer_regs=consumer, bulk_dq=cfg.bulk_dq and atomic_dq and _pipelines(args),
                split_dq=cfg.split_dq and atomic_dq and _pipelines(args), bulk_layout=cfg.bulk_dq and atomic_dq,
                split_layout=cfg.split_dq and atomic_dq, early_s=cfg.early_s and atomic_dq and _pipelines(args),
                shared=cfg.shared(d, atomic_dq),
                pipelined=_pipelines(args), **common)
        if cfg.wgmma:
            from ..wgmma import header

            return name, header() + "\n" + template("flash/backward_wgmma.cu.j2").render(
                warps=cfg.warps, bq=cfg.bq, shared=cfg.shared(d, atomic_dq),
                pipelined=cfg.pipelined and _pipelines(args), **common)
        return name, template("flash/backward_wide.cu.j2").render(
            warps=cfg.warps, bq=cfg.bq, min_blocks=cfg.min_blocks, shared=cfg.shared(d, atomic_dq), split=cfg.split,
            **common)
    if gqa and not cfg.gqa:
        raise ValueError(f"flash backward config {cfg.name!r} has no grouped-query build")
    return _source((program, d, bf16, atomic_dq, cfg, gqa, param_grads), program, d, build, param_grads)


BN_DQ = {64: 32, 128: 32}  # keys a tile of the dQ kernel per head dim (its registers bound it; none at d 256)


def dq_source(program: Attention, d: int, bf16: bool, gqa: bool = False, param_grads: bool = True) -> tuple[str, str]:
    """(kernel name, CUDA source) of the dQ kernel (``backward_dq.cu.j2``): per batch index and block of
    `BM` queries, dq[i] = scale * sum_j ds[i, j] k[j] over the forward's `block_spans`; `gqa`: k and v with
    fewer heads than q (`forward.kv_index`, the group and inner size from the spans' tail); cached. Raises
    ValueError at a head dim without a build (`atomic_dq`)."""
    if d not in BN_DQ:
        raise ValueError(f"head dim {d}: the dQ kernel takes {tuple(BN_DQ)} (atomic dQ at the others)")

    def build(args: dict, digest: str):
        name = f"flash_bwd_dq_d{d}_{'bf16' if bf16 else 'fp16'}{'_gqa' if gqa else ''}_{digest}"
        return name, template("flash/backward_dq.cu.j2").render(name=name, bn2=BN_DQ[d], bf16=bf16, gqa=gqa, **args)
    return _source((program, d, bf16, "dq", gqa, param_grads), program, d, build, param_grads)


def delta_source(d: int, bf16: bool, out32: bool) -> tuple[str, str]:
    """(kernel name, CUDA source) of the delta kernel (``backward_delta.cu.j2``): delta[r] = sum_e dout[r, e]
    out[r, e] in fp32 per row, dout 16-bit, out 16-bit or fp32 (`out32`); cached."""
    from ...source import mma_header

    key = ("delta", d, bf16, out32)
    hit = _SOURCES.get(key)
    if hit is None:
        name = f"flash_bwd_delta_d{d}_{'bf16' if bf16 else 'fp16'}{'_out32' if out32 else ''}"
        text = template("flash/backward_delta.cu.j2").render(name=name, d=d, bf16=bf16, out32=out32)
        _SOURCES[key] = hit = (name, mma_header() + "\n" + text)
    return hit


def key_block_spans(mask, lq: int, lk: int, sizes: dict[str, int], bn: int = BN,
                    seqs: dict | None = None) -> list[tuple[int, int, int, int]]:
    """Per block of `bn` keys (a multiple of `BN`), (qlo, qhi, qflo, qfhi) in query rows (multiples of `BM`):
    queries outside [qlo, qhi) see none of its keys (the query blocks whose `block_spans` span holds the key
    block, first to last; a block between them that does not is visited with its mask evaluated: sound),
    and in [qflo, qfhi) the key block is a full tile (every key visible to every query, below Lk: no mask).
    A block of several `BN` tiles: the union of their query spans, the intersection of their full ones
    (none where the block passes Lk). `seqs`: the sequence inputs' per-position ranges (`block_spans`)."""
    if bn != BN:
        per = key_block_spans(mask, lq, lk, sizes, seqs=seqs)
        k = bn // BN
        out = []
        for kb in range(-(-lk // bn)):
            parts = per[kb * k:(kb + 1) * k]
            seen = [(lo, hi) for lo, hi, _, _ in parts if lo < hi]
            lo, hi = (min(a for a, _ in seen), max(b for _, b in seen)) if seen else (0, 0)
            flo, fhi = max(p[2] for p in parts), min(p[3] for p in parts)
            if len(parts) < k or flo >= fhi or any(p[2] >= p[3] for p in parts):
                flo = fhi = 0
            out.append((lo, hi, flo, fhi))
        return out
    spans = block_spans(mask, lq, lk, sizes, seqs=seqs)
    out = []
    for kb in range(-(-lk // BN)):
        n0 = kb * BN
        seen = [b for b, (lo, hi, _, _) in enumerate(spans) if lo <= n0 < hi]
        full = [b for b, (_, _, flo, fhi) in enumerate(spans) if flo <= n0 and n0 + BN <= fhi]
        if not seen:
            out.append((0, 0, 0, 0))
            continue
        best, run = (0, 0), None  # the longest run of consecutive full query blocks
        for b in full:
            run = (run[0], b + 1) if run is not None and run[1] == b else (b, b + 1)
            if run[1] - run[0] > best[1] - best[0]:
                best = run
        out.append((seen[0] * BM, (seen[-1] + 1) * BM, best[0] * BM, best[1] * BM))
    return out


def key_block_tables(spans, lk: int, bn: int = BN):
    """`key_block_spans` on torch tensors, from the query blocks' spans [R, blocks, 4] (`mask_blocks.span_tables`
    at `BM` and `BN`) to the key blocks' [R, key blocks, 4], every row at once in torch ops on their device. As a
    plain loop, per row and key tile n0 of `BN` keys: (first and last block whose [lo, hi) holds n0, the longest
    run of blocks whose [full_lo, full_hi) holds the tile) in query rows; then per block of `bn // BN` tiles the
    union of the tiles' spans and the intersection of their full ones (none unless all are full and below Lk)."""
    import torch

    from .....passes.mask_blocks import _spans_of

    rows, tiles = spans.shape[0], -(-lk // BN)
    if tiles == 0 or spans.shape[1] == 0:
        return spans.new_zeros((rows, -(-lk // bn), 4))
    n0 = torch.arange(tiles, device=spans.device).mul_(BN).view(1, tiles, 1)
    lo, hi, flo, fhi = (x[:, None, :] for x in spans.unbind(-1))  # [R, 1, blocks]
    per = _spans_of((lo <= n0) & (n0 < hi), (flo <= n0) & (n0 + BN <= fhi), BM, spans.shape[1] * BM)
    if bn == BN:
        return per
    k = bn // BN
    blocks = -(-tiles // k)
    real = torch.arange(blocks * k, device=spans.device).view(1, blocks, k) < tiles  # the last block's tiles
    parts = torch.cat([per, per.new_zeros((rows, blocks * k - tiles, 4))], 1).view(rows, blocks, k, 4)
    plo, phi, pflo, pfhi = parts.unbind(-1)
    seen = real & (plo < phi)
    lo = torch.where(seen, plo, torch.iinfo(torch.int64).max).amin(-1)
    hi = torch.where(seen, phi, -1).amax(-1)
    any_seen = seen.any(-1)
    flo, fhi = pflo.amax(-1), pfhi.amin(-1)
    full = real.all(-1) & (pflo < pfhi).all(-1) & (flo < fhi)
    zero = torch.zeros_like(lo)
    return torch.stack((torch.where(any_seen, lo, zero), torch.where(any_seen, hi, zero),
                        torch.where(full, flo, zero), torch.where(full, fhi, zero)), -1)


@dataclass(frozen=True)
class _Plan:
    """A backward's launches for one signature (`FlashBackward._plan`): dQ by atomics or the dQ kernel, the
    shapes of the zeroed sums (() for none), (function, grid, shared bytes, n0, n1) per launch (delta, key
    blocks, then dQ's kernel), their span tables, and a zeroed fp32 dummy for pointers no kernel reads."""

    atomic: bool
    sums: tuple
    launches: list
    spans: list
    dummy: object
    bn: int       # keys a block of the key-block kernel
    fused: dict   # the fused tables' plans (`forward.cached_fused_plan`)


class FlashBackward:
    """The flash backward of one program on CUDA tensors (module docstring): compiled per (device, source)
    with CuPy (NVRTC), launched on torch's current stream."""

    def __init__(self, program: Attention):
        self.program = program
        self.reason = unsupported(program)
        self.columns = [] if self.reason else [(name, c) for name, c, _ in summands(program)]
        self.tables = any(a not in program.batch_axes for d in program.params for a in d.axes)
        self._spans: dict = {}
        self._plans: dict = {}

    def head_dim_reason(self, d: int) -> str | None:
        """Why the kernels do not take head dim `d` for this program (None: they do): an indexed table's gradient
        needs the dQ kernel's fixed order to be repeatable, and head dims without a dQ kernel sum by atomics."""
        if self.tables and d not in BN_DQ:
            return (f"an indexed table's gradient at head dim {d} (no fixed-order dQ kernel there: atomics would "
                    "make it unrepeatable)")
        return None

    def reads_kv_heads(self, call) -> bool:
        """Whether the kernels run a grouped-query call (`call.group` > 1) on k and v with their own heads (the
        device's config has a GQA build: `Config.gqa`); where not, the caller repeats k and v to q's heads and
        sums dK and dV over each group. Not where the spans follow the query heads (ids along the KV-heads axis: a
        span table a query head), since a GQA key block runs its group's heads on its first head's table."""
        rows = row_axes(self.program)
        if rows is not None and self.program.kv_heads in rows:
            return False
        return call.group > 1 and config(call.q.shape[-1], None, call.q.device).gqa

    def _function(self, device, d: int, bf16: bool, which: str = "atomic", gqa: bool = False,
                  param_grads: bool = True):
        if which.startswith("delta"):
            name, text = delta_source(d, bf16, which == "delta32")
        elif which == "dq":
            name, text = dq_source(self.program, d, bf16, gqa, param_grads)
        else:
            cfg = config(d, None, device)
            name, text = kernel_source(self.program, d, bf16, atomic_dq=which == "atomic", config_name=cfg.name,
                                       gqa=gqa, param_grads=param_grads)
            return loaded_function(text, name, device, arch=cfg.arch)
        return loaded_function(text, name, device)

    def _span_tensor(self, call, per_query_block: bool = False, bn: int = BN):
        """The spans as the kernels take them (`forward.span_table`: then grouped-query attention's group and
        inner size), per key block of `bn` (`key_block_spans`) or per query block (`block_spans`); cached (with
        sequence inputs, per call on the device from the ids: `key_block_tables`)."""
        import torch

        from .forward import span_table

        gqa = gqa_shape(call)
        if self.program.seqs:
            return self.sequence_span_tensors(call, bn, per_query_block)[-1]
        key = (call.lq, call.lk, tuple(sorted(call.sizes.items())), call.q.device, per_query_block, bn, gqa)
        t = self._spans.get(key)
        if t is None:
            if len(self._spans) > 64:
                self._spans.clear()
            if per_query_block:
                spans = block_spans(self.program.mask, call.lq, call.lk, call.sizes)
            else:
                spans = key_block_spans(self.program.mask, call.lq, call.lk, call.sizes, bn)
            t = self._spans[key] = torch.tensor(span_table(spans, *gqa), dtype=torch.int32, device=call.q.device)
        return t

    def sequence_span_tensors(self, call, bn: int, dq_kernel: bool) -> list:
        """With sequence inputs, a call's span tables as `_span_tensor` gives them, from one `span_tables` of its
        ids on their device (a fixed sequence of torch ops, no host copy): the key blocks' of `bn`, then with
        `dq_kernel` the query blocks'."""
        from .....passes.mask_blocks import span_tables

        gqa = gqa_shape(call)
        reads = sequence_reads(self.program, call.param_values())
        if options().span_kernel:  # both tables from one generated kernel (kernels/flash/spans.py)
            from .spans import span_kernel_table

            found = span_kernel_table(self.program.mask, call.lq, call.lk, BM, BN, call.sizes, reads, gqa, bn)
            if found is not None:
                return [found[1]] + ([found[0]] if dq_kernel else [])
        spans = span_tables(self.program.mask, call.lq, call.lk, BM, BN, call.sizes, reads)
        return [row_span_table(key_block_tables(spans, call.lk, bn), gqa)] + (
            [row_span_table(spans, gqa)] if dq_kernel else [])

    def _tables(self, call, bn: int, plans: dict):
        """`forward.fused_tables` of a call (one launch: the param table, the dQ kernel's query-block spans and the
        key blocks' of `bn`, from the ids), where its signature's `forward.fused_plan` exists (kept in `plans`, the
        backward plan's); else None."""
        plan = plans.get(call.signature, False) if call.signature is not None else False
        if plan is False:
            plan = cached_fused_plan(self.program, call, BM, BN, bn, plans)
        return None if plan is None else fused_tables(plan, self.program, call)

    def _plan(self, call, q, out_dtype, param_grads: bool) -> _Plan:
        """What every backward of a call's shapes, dtypes, device, group and options launches: cached."""
        import torch

        key = (q.shape, call.k.shape, q.dtype, out_dtype, q.device, call.group, call.kv_axis, param_grads, options())
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        bh, lq, lk, d = math.prod(q.shape[:-2]), call.lq, call.lk, q.shape[-1]
        cfg = config(d, None, q.device)
        gqa = call.group > 1
        if gqa and not cfg.gqa:
            raise ValueError(f"flash backward config {cfg.name!r} has no grouped-query build: repeat k and v")
        nkb, nparams = -(-lk // cfg.bn), len(self.columns)
        np_ = nparams if param_grads else 0
        # an indexed table: its entries' row sums (delta's correction) in the dQ kernel's fixed order, not by
        # atomics, so that its gradient is bitwise repeatable (d 256, without a dQ kernel, keeps atomics); its
        # loads beside the atomic build's registers spilled in the warp-specialized config, so always there
        atomic = atomic_dq(d) and not (d in BN_DQ and self.tables)
        bf16 = q.dtype == torch.bfloat16
        # zeroed a call: partials [key blocks, BH, NP] (written, as zeros, without `param_grads` too), the row
        # sums with atomic dQ, the dQ kernel's correction sums; () where no kernel writes one: a dummy pointer
        # (the warp-specialized GQA build: a row of partials per key block and consumer warp, each written once)
        rows = nkb * (cfg.warps if gqa and cfg.specialized else 1)
        sums = ((rows, bh, nparams) if nparams else (), (bh, lq, 1 + np_) if np_ and atomic else (),
                (-(-lq // BM), bh, np_) if np_ and not atomic else ())
        launches = [(self._function(q.device, d, bf16, "delta32" if out_dtype == torch.float32 else "delta"),
                     (-(-bh * lq // 4), 128), 0, bh * lq, 0),
                    (self._function(q.device, d, bf16, "atomic" if atomic else "kv", gqa, param_grads),
                     (nkb * (bh // call.group), cfg.threads), cfg.shared(d, atomic), lq, lk)]
        spans = [self._span_tensor(call, bn=cfg.bn)]
        if not atomic:
            launches.append((self._function(q.device, d, bf16, "dq", gqa, param_grads), (-(-lq // BM) * bh, THREADS),
                             0, lq, lk))
            spans.append(self._span_tensor(call, True))
        if len(self._plans) >= 64:
            self._plans.clear()
        dummy = torch.zeros(max(1, bh * nparams), dtype=torch.float32, device=q.device)
        plan = self._plans[key] = _Plan(atomic, sums, launches, spans, dummy, cfg.bn, {})
        return plan

    def param_gradients(self, per_bh, sizes: dict[str, int]) -> dict:
        """Each param's gradient by its axes from its sums `per_bh` [BH, NP] (fp32) per batch index (`columns`: a
        table's entries one column each): summed over the batch axes the param lacks."""
        p = self.program
        batch = p.batch_axes
        per_bh = per_bh.reshape(*[sizes[a] for a in batch], per_bh.shape[-1])
        out = {}
        for d in p.params:
            cols = [n for n, (name, _) in enumerate(self.columns) if name == d.name]
            g = per_bh[..., cols]  # [*batch, entries]: one entry a param per batch index, R a table
            lacking = [i for i, a in enumerate(batch) if a not in d.axes]
            if lacking:
                g = g.sum(dim=lacking)
            kept = [a for a in batch if a in d.axes]
            extra = [a for a in d.axes if a not in batch]
            order = (*kept, *extra) if extra else kept
            g = g if extra else g[..., 0]
            out[d.name] = g.permute([order.index(a) for a in d.axes]).contiguous()  # a list: a scalar param has none
        return out

    def __call__(self, call, out, lse, d_out, param_grads: bool = True) -> dict:
        """{"q": dq fp32, "k", "v": in q's dtype, param names: fp32 by their axes (not without `param_grads`:
        kernels that sum no param then, the pipelined loop's where the config has one)}, canonical, of a bound
        call that `forward.call_unsupported` accepts, given the forward's out [*batch, Lq, d] and lse
        [*batch, Lq] and the output's cotangent d_out [*batch, Lq, d]. Under grouped-query attention
        (`reads_kv_heads`) k and v with their own heads: dk and dv come back so, summed over each group by
        the key-block kernel (a block per KV index and key block walking the group's query heads)."""
        import torch

        from ...launch import launch_kernel
        from .forward import param_table

        q, k, v = (t.contiguous() for t in (call.q, call.k, call.v))
        do = d_out.to(q.dtype).contiguous()
        out = (out if out.dtype in (q.dtype, torch.float32) else out.float()).contiguous()
        q, k, v, do, out = (t if t.data_ptr() % 16 == 0 else t.clone() for t in (q, k, v, do, out))
        batch = q.shape[:-2]
        bh, lq, lk, d = math.prod(batch), call.lq, call.lk, q.shape[-1]
        # delta in fp32 from the 16-bit cotangent the products see and the forward's output: a kernel
        delta = torch.empty((*batch, lq), dtype=torch.float32, device=q.device)
        lse = lse.to(torch.float32).contiguous()
        launched = bool(bh and lq and lk)
        # no fills where the kernels write every element: the key-block kernel stores every row of dk and dv
        # (zeros for a key block no query sees), the dQ kernel every row of dq, and the delta kernel zeroes
        # the atomic dQ's accumulator in its pass over the rows
        new = torch.empty if launched else torch.zeros
        dq = new((*batch, lq, d), dtype=torch.float32, device=q.device)
        dk = new(k.shape, dtype=q.dtype, device=q.device)
        dv = new(v.shape, dtype=q.dtype, device=q.device)
        plan = self._plan(call, q, out.dtype, param_grads)
        np_ = len(self.columns) if param_grads else 0
        # the kernels read every param (their table has NP columns) but sum only where asked; delta's correction
        # (module docstring): per query row, sum_j dM and each param's sum_j summand at P (atomic dQ: added up
        # by the key-block kernel), or per query block the sum of their products (the dQ kernel, which sees
        # whole rows: fixed order)
        partials, rowsums, corr = (torch.zeros(shape, dtype=torch.float32, device=q.device) if shape else plan.dummy
                                   for shape in plan.sums)
        if launched:
            # with document ids: the param table and both span tables of this call's ids from one launch
            tables = self._tables(call, plan.bn, plan.fused) if call.seqs else None
            if tables is not None:
                params_at, spans_at = tables[1], [tables[3], tables[2]]
            else:
                spans = plan.spans
                if self.program.seqs:  # the ids are this call's
                    spans = self.sequence_span_tensors(call, config(d, None, q.device).bn, not plan.atomic)
                params = plan.dummy if not table_width(self.program) else param_table(
                    self.program, call.param_values(), call.sizes).to(q.device)
                params_at, spans_at = params.data_ptr(), [t.data_ptr() for t in spans]
            inputs = [q.data_ptr(), k.data_ptr(), v.data_ptr(), do.data_ptr(), lse.data_ptr(), delta.data_ptr(),
                      params_at]
            pointers = [[do.data_ptr(), out.data_ptr(), delta.data_ptr(), dq.data_ptr() if plan.atomic else 0],
                        [*inputs, spans_at[0], dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                         partials.data_ptr(), rowsums.data_ptr()]]
            if not plan.atomic:
                pointers.append([*inputs, spans_at[1], dq.data_ptr(), corr.data_ptr()])
            for (fn, grid, shared, n0, n1), args in zip(plan.launches, pointers):
                if q.is_cuda and q.device.index != torch.cuda.current_device():
                    with torch.cuda.device(q.device):
                        launch_kernel(fn, grid, n0, n1, args, shared=shared)
                else:
                    launch_kernel(fn, grid, n0, n1, args, shared=shared)
        if not np_:
            return {"q": dq, "k": dk, "v": dv}
        per_bh = partials.sum(0) - ((rowsums[..., :1] * rowsums[..., 1:]).sum(1) if plan.atomic else corr.sum(0))
        return {"q": dq, "k": dk, "v": dv, **self.param_gradients(per_bh, call.sizes)}

"""`ssmc.attention` in torch, tiled over query blocks: the same code on CPU and CUDA tensors.

The forward, per batch index and block of queries [q0, q1) (`block_q` rows):

    lo, hi = the keys the mask may leave visible to the block        (passes/mask_blocks.py)
    s[i, j]  = scale * sum_d q[i, d] k[j, d]        for i in [q0, q1), j in [lo, hi), in fp32 (fp64 for fp64)
    s[i, j]  = score_mod(s[i, j], i, j, params);  -inf where not mask_mod(i, j, params)
    lse[i]   = log sum_j exp(s[i, j])                (-inf for a row that sees no key)
    out[i, e] = sum_j exp(s[i, j] - lse[i]) v[j, e]  (0 for a row that sees no key)

so a block holds O(block_q * Lk) scores, never Lq * Lk; keys outside [lo, hi) are never read (a
causal mask's keys after the block's last query, a sliding window's before its first). The
backward recomputes P = exp(s - lse) per block from the saved log-sum-exp and runs FlashAttention's
backward with the score modifier's derivatives from `passes/attention_grad.py` (the IR of dS and of
each param's summand, evaluated like the modifier); dK, dV and the params' gradients accumulate over
the blocks in fp32. The modifiers are evaluated from the IR by `backends/torch_eval.py`.

On CUDA tensors of bf16 / fp16 (head dim 64 or 128, modifiers the printer takes) the forward is one
launch of the generated flash kernel instead (backends/cuda/kernels/flash; `TiledAttention.flash` says
when, ``SSMC_CUDA_FLASH=0`` turns it off), and so is the backward (`TiledAttention.flash_backward`; a
delta from the forward's output, then one kernel per key block; ``SSMC_CUDA_FLASH_BACKWARD=0`` keeps
the tiled backward from the kernel's lse).

Matrix products take the inputs' dtype (bf16 / fp16 stay so on the GPU, with fp32 results); scores,
softmax and every sum are fp32 (fp64 for fp64 inputs). Arrays are canonical here: q [*batch, Lq, d],
k [*batch, Lk, d], v [*batch, Lk, e] (under GQA with their own heads: `Call.repeated`), params by their
axes; `TiledAttention.bind` makes them so from a call in any layout (NumPy arrays become CPU tensors) and
`to_layout` puts results back.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache

import numpy as np
import torch

from ..ir.axes import TIME
from ..ir.node import Node, depending_on, toposort
from ..ir.ops import COMPARISONS, Op
from ..ir.program import Attention
from ..passes.attention_grad import derive_attention_backward
from ..passes.mask_blocks import key_spans, sequence_ranges
from ..runtime.binding import layout_of, numeric_array
from ..runtime.prologue import bind_attention, group_sum, repeat_heads
from .torch_eval import TorchEvaluator, align, loop_sum

SCORES_BUDGET = 256 << 20  # bytes of one block's fp32 scores: the block's rows follow from it
MIN_BLOCK, MAX_BLOCK = 16, 1024
KEY_TILE = 64  # keys per tile of the mask's span analysis
PER_BLOCK = ("score", "q_idx", "kv_idx", "grad_score")  # leaves that change from block to block

_FLOATS = {np.dtype(np.float32): torch.float32, np.dtype(np.float64): torch.float64}


def to_tensor(x, name: str) -> torch.Tensor:
    """A torch tensor of an argument (torch as it is, detached; CuPy on its GPU; NumPy and lists on the
    CPU, NumPy's memory shared where torch can): floats keep their dtype, integers and booleans become
    float64 (as `binding.to_array`); ValueError naming the argument for anything else."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
    elif hasattr(x, "__cuda_array_interface__"):  # CuPy: zero-copy, on its GPU
        t = torch.as_tensor(x, device="cuda")
    else:
        arr = numeric_array(x, name)
        if arr.dtype.kind == "c":
            raise ValueError(f"argument {name!r} has dtype {arr.dtype}; attention takes real numbers")
        arr = np.asarray(arr, dtype=arr.dtype if arr.dtype.kind == "f" else np.float64)
        if not arr.flags.writeable or any(st < 0 for st in arr.strides):  # what torch.from_numpy cannot share
            arr = arr.copy()
        t = torch.from_numpy(arr)
    if t.is_complex():
        raise ValueError(f"argument {name!r} has dtype {t.dtype}; attention takes real numbers")
    return t if t.is_floating_point() else t.to(torch.float64)


@dataclass
class Call:
    """A bound call: canonical tensors on one device (module docstring) and what results come back as."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    params: dict[str, torch.Tensor]  # in `acc`
    sizes: dict[str, int]
    acc: torch.dtype                  # scores, softmax, sums: float32, or float64 for float64 inputs
    out_dtype: torch.dtype            # results: the dtype of q as given
    numpy: bool                       # q was no torch tensor: results as NumPy arrays
    group: int = 1                    # GQA: k and v have q's heads / `group` along batch axis `kv_axis`,
    kv_axis: int = 0                  # query head h reading KV head h // group (`repeated`)
    # sequence inputs the modifiers only compare (`compared_only`): their ids as given (time first, on q's device,
    # integers kept), not in `params` (`param_values` makes them `acc` on first use; the flash kernels read them so)
    seqs: dict = field(default_factory=dict)
    memo: dict = field(default_factory=dict)  # this call's derived values (`param_values`)
    # a number per signature `bind` remembers (None: not one): calls of one number share every shape, stride, dtype,
    # device and size, so a kernel's per-signature plan may be keyed by it
    signature: int | None = None

    def param_values(self) -> dict[str, torch.Tensor]:
        """The params with every sequence input's ids in `acc`, as the tiled path reads them: `seqs` converted
        (`seq_values`) once for the call."""
        if not self.seqs:
            return self.params
        hit = self.memo.get("params")
        if hit is None:
            hit = self.memo["params"] = {**self.params, **{n: seq_values(t, self.acc) for n, t in self.seqs.items()}}
        return hit

    def repeated(self) -> Call:
        """This call with k and v repeated to q's heads (each KV head `group` times in a row), group 1:
        what the tiled path and the backward kernels take (the flash forward reads KV head h // group
        itself). A new copy each time: the forward keeps none alive until the backward."""
        if self.group == 1:
            return self
        k, v = (repeat_heads(t, self.group, self.kv_axis) for t in (self.k, self.v))
        return replace(self, k=k, v=v, group=1, signature=None)

    @property
    def lq(self) -> int:
        return self.q.shape[-2]

    @property
    def lk(self) -> int:
        return self.k.shape[-2]


_SIGNATURES = itertools.count()  # `Call.signature`'s numbers, unique in the process


def _view_signature(layout, given: tuple, params: dict) -> tuple | None:
    """What `TiledAttention.bind`'s checks and views depend on of a call (None: a call it does not
    remember: an argument that is not a plain torch tensor)."""
    if any(type(t) is not torch.Tensor for t in given):
        return None
    if isinstance(layout, dict):  # per-array layouts: a key of their items
        layout = tuple(sorted(layout.items()))
    try:
        hash(layout)
    except TypeError:
        return None
    return (layout, tuple(params), *[(t.shape, t.stride(), t.dtype, t.device) for t in given])


def _views(given: tuple, canonical: list) -> list | None:
    """How each canonical tensor views the given one at its position: (index, shape, strides, offset from
    the given tensor's), or None where one is not such a view (a copy or a dtype change)."""
    out = []
    for i, (g, c) in enumerate(zip(given, canonical)):
        if c is None or c.dtype != g.dtype or c.device != g.device:
            return None
        if c.untyped_storage().data_ptr() != g.untyped_storage().data_ptr():
            return None
        out.append((i, tuple(c.shape), c.stride(), c.storage_offset() - g.storage_offset()))
    return out


def block_rows(call: Call) -> int:
    """Query rows per block: as many as keep a block's fp32 scores within `SCORES_BUDGET`, a power of two
    in [MIN_BLOCK, MAX_BLOCK]."""
    return _rows(math.prod(call.q.shape[:-2]), call.lk)


def _rows(batch: int, lk: int) -> int:
    rows = max(1, SCORES_BUDGET // max(1, batch * lk * 4))
    return min(MAX_BLOCK, max(MIN_BLOCK, 1 << (rows.bit_length() - 1)))


_OUT_DTYPE_BMM: dict[str, bool] = {}  # device type -> whether torch.bmm takes out_dtype there


def _mm(a: torch.Tensor, b: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """a @ b over matching leading dims, the result in `acc`: in b's dtype with `acc` results where
    torch offers it (half types on CUDA), else both operands in `acc`."""
    if a.dtype == b.dtype == acc:
        return torch.matmul(a, b)
    if a.is_cuda and _OUT_DTYPE_BMM.get("cuda", True):
        lead, m, n = a.shape[:-2], a.shape[-2], b.shape[-1]
        try:
            out = torch.bmm(a.to(b.dtype).reshape(-1, m, a.shape[-1]), b.reshape(-1, *b.shape[-2:]), out_dtype=acc)
            return out.reshape(*lead, m, n)
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_BMM["cuda"] = False
    return torch.matmul(a.to(acc), b.to(acc))


@lru_cache(maxsize=256)
def compared_only(program: Attention, name: str) -> bool:
    """Whether the modifiers read sequence `name` only in comparisons of two of its reads (``doc[q_idx] ==
    doc[kv_idx]``, or <, <=, ...: never in the score, in arithmetic or against a constant), so that renumbering
    each batch row's ids in order (`row_ranks`) leaves every mask as it was."""
    def read(n: Node) -> bool:
        return n.op is Op.GATHER and n.args[0].op is Op.INPUT and n.args[0].arg == name

    if program.score is not None and any(n.op is Op.INPUT and n.arg == name for n in toposort([program.score])):
        return False
    if program.mask is None:
        return True
    if read(program.mask):
        return False
    return all(n.op in COMPARISONS and all(read(a) for a in n.args)
               for n in toposort([program.mask]) if any(read(a) for a in n.args))


_EXACT32 = (torch.float32, torch.float16, torch.bfloat16, torch.int16, torch.int8, torch.uint8, torch.bool)


def seq_values(ids: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """A compared-only sequence's ids [L, *axes] in `acc`: renumbered per row in order first (`row_ranks`) where
    float32 `acc` would not keep them apart (ids of a wider type)."""
    if acc == torch.float32 and ids.dtype not in _EXACT32:
        ids = row_ranks(ids)
    return ids.to(acc)


def row_ranks(ids: torch.Tensor) -> torch.Tensor:
    """ids [L, *axes] (time first) -> [L, *axes] int64 on their device, each batch row's ids (a column over
    time) numbered in order from 0 by a sort (no host copy). As a loop, per row c and position t:

        ranks[t, c] = len({ids[s, c] for s in range(L) if ids[s, c] < ids[t, c]})

    Equal ids stay equal and order is kept, so comparisons of two reads of one row give what the ids gave (a row
    of a batch index is all its reads see); ranks are below L, exact in float32. NaN ids (never equal to
    themselves) are not kept so."""
    t = ids.reshape(ids.shape[0], -1)
    values, order = t.sort(0)
    step = torch.zeros(t.shape, dtype=torch.int64, device=t.device)
    step[1:] = values[1:] != values[:-1]
    return torch.empty_like(step).scatter_(0, order, step.cumsum(0)).reshape(ids.shape)


class TiledAttention:
    """The tiled path of one `Attention` program (module docstring)."""

    def __init__(self, program: Attention):
        self.program = program
        self._spans: dict = {}
        self._flash = None         # the flash forward kernel, made on the first CUDA call
        self.flash_reason = None   # why the last call did not run it (None: it did)
        self._flash_bwd = None     # the flash backward kernel, likewise
        self.flash_backward_reason = None  # why the last backward did not run it (None: it did)
        self._binds: dict = {}     # a call's signature -> how its canonical tensors view the given ones (`bind`)
        self._decided: dict = {}   # what `_kernels` decided, by what it depends on

    @cached_property
    def backward_ir(self):
        return derive_attention_backward(self.program)

    # -- binding -------------------------------------------------------------------------------

    def bind(self, q, k, v, layout, params: dict) -> Call:
        """Check and bind a call (`prologue.bind_attention`: a ValueError naming the argument for a
        wrong shape, dtype or device, before any compute); canonical tensors on q's device.

        The checks depend only on the arguments' types, shapes, strides, dtypes and devices (and the
        layout): a call of a signature bound before whose canonical tensors were all views of the given
        ones (no copy, no dtype change) makes the same views again, with the first call's sizes."""
        given = (q, k, v, *params.values())
        key = _view_signature(layout, given, params)
        recipe = self._binds.get(key) if key is not None else None
        if recipe is not None:
            views, template = recipe
            tensors = [torch.as_strided(given[i].detach(), shape, stride, given[i].storage_offset() + delta)
                       for i, shape, stride, delta in views]
            named = dict(zip(params, tensors[3:]))
            return replace(template, q=tensors[0], k=tensors[1], v=tensors[2],
                           params={n: named[n] for n in template.params}, seqs={n: named[n] for n in template.seqs},
                           memo={})
        call = self._bind(q, k, v, layout, params)
        if key is not None:
            views = _views(given, [call.q, call.k, call.v, *(call.params[n] if n in call.params else call.seqs.get(n)
                                                            for n in params)])
            if views is not None:
                if len(self._binds) >= 64:
                    self._binds.clear()
                # the template keeps no tensor of this call alive
                self._binds[key] = (views, replace(call, q=None, k=None, v=None, params=dict.fromkeys(call.params),
                                                   seqs=dict.fromkeys(call.seqs), memo={},
                                                   signature=next(_SIGNATURES)))
        return call

    def _bind(self, q, k, v, layout, params: dict) -> Call:
        p, q_given = self.program, q
        seq_names = {d.name for d in p.seqs}

        def convert(x, name):  # integer ids stay so: the flash kernels take them as given (else `seq_values`)
            if name in seq_names and isinstance(x, torch.Tensor) and not (
                    x.is_floating_point() or x.is_complex() or x.dtype == torch.bool):
                return x.detach()
            return to_tensor(x, name)

        qb, kv, group = bind_attention(p, q, k, v, layout, params, convert=convert, repeat=False)
        arrays = {**qb.arrays, **kv.arrays}
        device = arrays["q"].device
        for name, t in arrays.items():
            if t.device != device and (name in ("k", "v") or t.device.type != "cpu"):
                raise ValueError(f"argument {name!r} is on {t.device}, but 'q' is on {device}")
        in_dtype = torch.promote_types(torch.promote_types(arrays["q"].dtype, arrays["k"].dtype), arrays["v"].dtype)
        acc = torch.float64 if in_dtype == torch.float64 else torch.float32
        n = len(p.batch_axes)
        perm = [*range(1, n + 1), 0, n + 1]  # time first -> [*batch, t, d]
        q, k, v = (arrays[name].permute(*perm).to(in_dtype) for name in ("q", "k", "v"))
        params = {d.name: arrays[d.name].to(device=device, dtype=acc) for d in p.params}
        seqs = {}
        for d in p.seqs:  # ids, time first
            if arrays[d.name].shape[0] != arrays["k"].shape[0]:
                raise ValueError(f"sequence {d.name!r} has {arrays[d.name].shape[0]} positions; it takes one per "
                                 f"position of q and k, which need the same length (here "
                                 f"{arrays['q'].shape[0]} and {arrays['k'].shape[0]})")
            ids = arrays[d.name].to(device)
            if compared_only(p, d.name):  # as given: `Call.param_values` renumbers them where float32 would merge
                seqs[d.name] = ids
                continue
            ids = ids if ids.is_floating_point() else ids.to(torch.float64)
            # float32 would merge ids 2**24 apart: a sync (the values themselves count), for these specs only
            if acc == torch.float32 and ids.dtype == torch.float64 and ids.numel() and bool(ids.abs().max() >= 2 ** 24):
                raise ValueError(f"sequence {d.name!r} holds values of magnitude 2**24 or more, which "
                                 "float32 (the compute dtype of these inputs) does not keep apart; number them "
                                 "from 0 (e.g. torch.unique(ids, return_inverse=True)[1]) or pass float64 q, k, v")
            params[d.name] = ids.to(acc)
        numpy = not isinstance(q_given, torch.Tensor)
        kv_axis = p.batch_axes.index(p.kv_heads) if group > 1 else 0
        return Call(q, k, v, params, {**kv.sizes, **qb.sizes}, acc, arrays["q"].dtype, numpy, group, kv_axis, seqs)

    def to_layout(self, call: Call, x: torch.Tensor, name: str, axes: tuple[str, ...], layout, dtype=None):
        """Canonical `x` of array `name` with `axes` (the batch axes, then its own: time after the batch
        axes) in `layout`'s order, in `dtype` (default: the call's result dtype); a NumPy array where
        the call gave q so."""
        n = len(self.program.batch_axes)
        canonical = (*axes[:n], TIME, *axes[n:])
        order = layout_of(layout, name, axes)
        x = x.permute(*[canonical.index(a) for a in order]).to(dtype or call.out_dtype).contiguous()
        return x.cpu().numpy() if call.numpy else x

    def from_layout(self, call: Call, x, name: str, layout, keep_dtype: bool = False) -> torch.Tensor:
        """`to_layout`'s inverse for the output's cotangent `x` (any array, in `layout`'s order for
        "out"): canonical, in `call.acc` (in its own float dtype with `keep_dtype`: the backward takes
        either, and the flash kernels read 16 bits, so a 16-bit cotangent or output is not widened only
        to be rounded back), on the call's device; a ValueError naming `name` for a wrong shape."""
        axes = self.program.v_axes
        n = len(self.program.batch_axes)
        canonical = (*axes[:n], TIME, *axes[n:])
        order = layout_of(layout, "out", axes)
        t = to_tensor(x, name)
        lengths = {TIME: call.lq, **call.sizes}
        want = tuple(lengths[a] for a in order)
        if tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {want} for axes {' '.join(order)}")
        return t.permute(*[order.index(a) for a in canonical]).to(device=call.q.device,
                                                                 dtype=t.dtype if keep_dtype else call.acc)

    # -- calls as ssmc.compile and ssmc.grad make them ------------------------------------------------

    def __call__(self, q, k, v, layout, params: dict, return_lse: bool = False):
        """out in `layout` (and lse, in fp32 or fp64), as `interpreter.run_attention` defines them, as NumPy
        arrays where q is one, else torch tensors of q's dtype on its device."""
        p = self.program
        call = self.bind(q, k, v, layout, params)
        out, lse = self.forward(call)
        y = self.to_layout(call, out, "out", p.v_axes, layout)
        return (y, self.to_layout(call, lse, "lse", p.batch_axes, layout, call.acc)) if return_lse else y

    def gradients(self, q, k, v, grad_outputs, layout, params: dict) -> dict:
        """Gradients of q, k, v (in their layouts, q's dtype) and the params (fp32, or fp64) given the
        output's cotangent in `layout` (None: zeros); NumPy where q is, else torch tensors."""
        p = self.program
        call = self.bind(q, k, v, layout, params)
        out32 = self.delta_output(call)
        out, lse = self.forward(call, out32=out32)
        if grad_outputs is None:
            d_out = torch.zeros_like(out)
        else:
            d_out = self.from_layout(call, grad_outputs, "grad_outputs", layout)
        grads = self.backward(call, lse, d_out, out=out if out32 is None else out32)
        result = {name: self.to_layout(call, grads[name], name, axes, layout)
                  for name, axes in (("q", p.q_axes), ("k", p.q_axes), ("v", p.v_axes))}
        for d in p.params:
            g = grads[d.name]
            result[d.name] = g.cpu().numpy() if call.numpy else g
        return result

    def describe(self, sizes: dict[str, int], lq: int, lk: int) -> str:
        """What a call at these sizes runs, in words (`ssmc inspect`)."""
        batch = math.prod(sizes[a] for a in self.program.batch_axes)
        block = _rows(batch, lk)
        spans = key_spans(self.program.mask, lq, lk, block, KEY_TILE, sizes)
        visited = sum((hi - lo) * (min(lq, (b + 1) * block) - b * block) for b, (lo, hi) in enumerate(spans))
        text = (f"tiled torch path: {len(spans)} blocks of {block} query rows; the scores of "
                f"{visited / (lq * lk):.0%} of the Lq x Lk pairs computed (keys outside the mask's spans "
                f"skipped); per block 2 matrix products forward, 5 backward, scores and softmax in fp32")
        from .cuda.kernels.flash.backward import unsupported as backward_unsupported
        from .cuda.kernels.flash.forward import unsupported

        reason = unsupported(self.program)
        back = backward_unsupported(self.program) if reason is None else reason
        flash = ("the flash forward and backward kernels on CUDA bf16 / fp16 tensors of head dim 64 or 128, the "
                 "tiled path elsewhere" if back is None else
                 f"the flash forward kernel on CUDA bf16 / fp16 tensors of head dim 64 or 128, the tiled path "
                 f"elsewhere and for the backward ({back})" if reason is None else f"no flash forward kernel: {reason}")
        return f"{text}; {flash}"

    # -- the forward -----------------------------------------------------------------------------

    def spans(self, call: Call, block: int) -> list[tuple[int, int]]:
        if self.program.seqs:  # ids are runtime data: their per-position ranges bound the spans, per call
            return key_spans(self.program.mask, call.lq, call.lk, block, KEY_TILE, call.sizes, sequence_ranges(
                self.program, call.param_values()))
        key = (call.lq, call.lk, block, tuple(sorted(call.sizes.items())))
        spans = self._spans.get(key)
        if spans is None:
            if len(self._spans) > 64:
                self._spans.clear()
            spans = self._spans[key] = key_spans(self.program.mask, call.lq, call.lk, block, KEY_TILE, call.sizes)
        return spans

    def _block_env(self, call: Call, env: dict, raw: torch.Tensor, q0: int, q1: int, lo: int, hi: int) -> dict:
        target = (*self.program.batch_axes, "~q", "~k")
        dev, dt = call.q.device, call.acc
        return {**env, "score": (raw, target),
                "q_idx": (torch.arange(q0, q1, device=dev, dtype=dt), ("~q",)),
                "kv_idx": (torch.arange(lo, hi, device=dev, dtype=dt), ("~k",))}

    def _scores(self, call: Call, ev, env, memo, q0, q1, lo, hi):
        """(the scores, modified, -inf where masked; the block's env, raw scores under "score"; its memo)
        of the block of queries [q0, q1) and keys [lo, hi)."""
        p = self.program
        scale = p.scale if p.scale is not None else 1.0 / math.sqrt(call.sizes[p.head_dim])
        raw = _mm(call.q[..., q0:q1, :], call.k[..., lo:hi, :].transpose(-1, -2), call.acc) * scale
        benv = self._block_env(call, env, raw, q0, q1, lo, hi)
        memo = dict(memo)
        target = (*p.batch_axes, "~q", "~k")
        mod = raw
        if p.score is not None:
            (value,) = ev.run([p.score], benv, memo)
            mod = align(value, target)
        if p.mask is not None:
            (visible,) = ev.run([p.mask], benv, memo)
            mod = mod.masked_fill(~align(visible, target), -math.inf)
        elif mod is not raw:
            mod = mod.expand_as(raw)
        return mod, benv, memo

    def inputs(self, call: Call) -> dict:
        """The evaluator's env of a call's params (by their axes) and sequences (time first, as (t, *axes))."""
        values = call.param_values()
        env = {d.name: (values[d.name], d.axes) for d in self.program.params}
        env.update((d.name, (values[d.name], (TIME, *d.axes))) for d in self.program.seqs)
        return env

    def hoisted(self, call: Call, ev, env, roots) -> dict:
        """Values of the nodes of `roots` that depend on no per-block leaf (params' functions, constants):
        once per call."""
        nodes = toposort(roots)
        varying = depending_on(nodes, set(PER_BLOCK))
        free = [n for n in nodes if n not in varying]
        memo: dict[Node, tuple] = {}
        ev.run(free, env, memo)
        return memo

    def flash(self, call: Call):
        """The flash forward kernel (backends/cuda/kernels/flash) where it runs this call, else None: CUDA
        tensors (CPU ones with ``SSMC_CUDA_EMULATE=1``: the kernel on the emulator), bf16 / fp16, a head dim
        it takes, modifiers it prints, CuPy importable, ``SSMC_CUDA_FLASH`` not 0. `flash_reason` keeps why
        not."""
        kernel, self.flash_reason, _, _ = self._kernels(call)
        return kernel

    def flash_backward(self, call: Call):
        """The flash backward kernel where it runs this call, else None: where `flash` would run the
        forward, the backward's modifiers print, and ``SSMC_CUDA_FLASH_BACKWARD`` is not 0.
        `flash_backward_reason` keeps why not."""
        _, self.flash_reason, kernel, self.flash_backward_reason = self._kernels(call)
        return kernel

    def _kernels(self, call: Call) -> tuple:
        """(flash forward or None, why not, flash backward or None, why not) of a call: decided by its dtypes,
        device, head and value dims and the options, so remembered for them."""
        from .cuda.options import options

        q = call.q
        key = (q.dtype, call.k.dtype, call.v.dtype, q.device, q.shape[-1], call.v.shape[-1], options())
        hit = self._decided.get(key)
        if hit is None:
            forward, reason = self._decide_forward(call)
            backward, backward_reason = (None, reason) if forward is None else self._decide_backward()
            late = backward.head_dim_reason(q.shape[-1]) if backward is not None else None
            if late is not None:
                backward, backward_reason = None, late
            if len(self._decided) >= 64:
                self._decided.clear()
            hit = self._decided[key] = (forward, reason, backward, backward_reason)
        return hit

    def _decide_forward(self, call: Call) -> tuple:
        from .cuda.options import emulating, options

        if not (call.q.is_cuda or emulating()):  # SSMC_CUDA_EMULATE=1: CPU tensors on the emulated kernel
            return None, "CPU tensors"
        if not options().flash:
            return None, "SSMC_CUDA_FLASH=0"
        from .cuda.kernels.flash import forward as flash

        if self._flash is None:
            self._flash = flash.FlashForward(self.program)
        reason = (self._flash.reason or flash.call_unsupported(call)
                  or (flash.cupy_missing() if call.q.is_cuda else None))
        return (None if reason else self._flash), reason

    def _decide_backward(self) -> tuple:
        from .cuda.options import options

        if not options().flash_backward:
            return None, "SSMC_CUDA_FLASH_BACKWARD=0"
        from .cuda.kernels.flash import backward as flash_bwd

        if self._flash_bwd is None:
            self._flash_bwd = flash_bwd.FlashBackward(self.program)
        return (None if self._flash_bwd.reason else self._flash_bwd), self._flash_bwd.reason

    def delta_output(self, call: Call, param_grads: bool = True) -> torch.Tensor | None:
        """An fp32 buffer [*batch, Lq, e] for the flash forward's unrounded output where the flash backward
        runs the call and the spec has params whose gradients are asked (`param_grads`: sums weighted by
        positions, which would feel a 16-bit output's rounding in delta); else None (delta from the 16-bit
        output, as FlashAttention)."""
        if not (self.program.params and param_grads) or self.flash_backward(call) is None:
            return None
        return torch.empty((*call.q.shape[:-1], call.v.shape[-1]), dtype=torch.float32, device=call.q.device)

    def forward(self, call: Call, block: int | None = None,
                out32: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(out [*batch, Lq, e] in `call.acc`, lse [*batch, Lq] in `call.acc`): the module docstring's loop.
        Where the flash kernel runs the call (`flash`; not when a `block` is forced), one launch of it
        instead: out then in q's dtype (the 16-bit result the call returns), lse fp32, and the output in
        fp32 also into `out32` where given (`delta_output`)."""
        if block is None:
            kernel = self.flash(call)
            if kernel is not None:
                return kernel(call, out32)  # k and v as given: the kernel reads KV head h // group
        call = call.repeated()
        p = self.program
        block = block or block_rows(call)
        ev = TorchEvaluator(call.sizes, call.acc, call.q.device)
        env = self.inputs(call)
        memo = self.hoisted(call, ev, env, [n for n in (p.score, p.mask) if n is not None])
        batch = call.q.shape[:-2]
        out = torch.zeros((*batch, call.lq, call.v.shape[-1]), dtype=call.acc, device=call.q.device)
        lse = torch.full((*batch, call.lq), -math.inf, dtype=call.acc, device=call.q.device)
        for b, (lo, hi) in enumerate(self.spans(call, block)):
            q0, q1 = b * block, min((b + 1) * block, call.lq)
            if hi <= lo:
                continue  # no key visible: out 0, lse -inf
            s, _, _ = self._scores(call, ev, env, memo, q0, q1, lo, hi)
            m = s.amax(-1, keepdim=True)
            m = torch.where(torch.isfinite(m), m, 0.0)
            e = torch.exp(s - m)
            total = e.sum(-1, keepdim=True)
            o = _mm(e.to(call.v.dtype) if call.q.is_cuda else e, call.v[..., lo:hi, :], call.acc)
            out[..., q0:q1, :] = o * torch.where(total > 0, 1.0 / total, 0.0)
            lse[..., q0:q1] = (torch.log(total) + m).squeeze(-1)
        return out, lse

    # -- the backward ----------------------------------------------------------------------------

    def backward(self, call: Call, lse: torch.Tensor, d_out: torch.Tensor, block: int | None = None,
                 out: torch.Tensor | None = None, param_grads: bool = True) -> dict[str, torch.Tensor]:
        """Gradients {"q", "k", "v", param names} in `call.acc`, canonical, given the forward's `lse`
        [*batch, Lq] and the output's cotangent `d_out` [*batch, Lq, e] (any float dtype). A block holds
        its rows' whole key span, so FlashAttention's rowsum(dO * O) is taken as rowsum(P * dP) in fp32
        and the output is not needed (a bf16 output's rounding would reach the params' gradients, sums
        weighted by positions).

        Where the flash backward kernel runs the call (`flash_backward`; not when a `block` is forced),
        one launch of it instead, from the forward's output `out` [*batch, Lq, e] (canonical, the fp32 one
        of `delta_output` where the spec has params; recomputed by the forward kernel where None): dq fp32,
        dk, dv in q's dtype, params fp32. Under GQA dk and dv come back with k's and v's own heads: from
        the kernels reading them so where the device's config has a grouped-query build (`reads_kv_heads`:
        a key-block kernel per KV head summing dK and dV over the group's query heads), else from k and v
        repeated to q's heads, the gradients summed over each group after. Without `param_grads` the flash
        kernels sum no param (the params' gradients are then missing from the result; `out` is the 16-bit
        output, `delta_output(call, False)` being None)."""
        if call.group > 1 and block is None:
            kernel = self.flash_backward(call)
            if kernel is not None and kernel.reads_kv_heads(call):
                return self._backward(call, lse, d_out, block, out, param_grads)
        grads = self._backward(call.repeated(), lse, d_out, block, out, param_grads)
        if call.group > 1:  # k and v repeated to q's heads for the backward: their gradients summed back
            grads["k"], grads["v"] = (group_sum(grads[n], call.group, call.kv_axis) for n in ("k", "v"))
        return grads

    def _backward(self, call: Call, lse: torch.Tensor, d_out: torch.Tensor, block: int | None,
                  out: torch.Tensor | None, param_grads: bool) -> dict[str, torch.Tensor]:
        if block is None:
            kernel = self.flash_backward(call)
            if kernel is not None:
                if out is None:
                    out32 = self.delta_output(call, param_grads)
                    out, lse = self.forward(call, out32=out32)
                    out = out if out32 is None else out32
                return kernel(call, out, lse, d_out, param_grads)
        p, bw = self.program, self.backward_ir
        # a table's gradient summand holds each (i, j)'s one-hot row over the table's own axes: fewer rows
        spread = max([math.prod(call.sizes[a] for a in d.axes if a not in p.batch_axes) for d in p.params] or [1])
        block = block or (block_rows(call) if spread == 1 else
                          _rows(math.prod(call.q.shape[:-2]) * spread, call.lk))
        scale = p.scale if p.scale is not None else 1.0 / math.sqrt(call.sizes[p.head_dim])
        ev = TorchEvaluator(call.sizes, call.acc, call.q.device)
        env = self.inputs(call)
        grad_roots = [g for _, g in bw.param_grads]
        roots = [n for n in (p.score, p.mask) if n is not None]
        if p.score is not None:
            roots.append(bw.d_score)
        memo = self.hoisted(call, ev, env, roots + grad_roots)
        target = (*p.batch_axes, "~q", "~k")
        acc, dev = call.acc, call.q.device
        d_out = d_out.to(acc)
        lse_safe = torch.where(torch.isfinite(lse), lse, math.inf).unsqueeze(-1)
        dq = torch.zeros(call.q.shape, dtype=acc, device=dev)
        dk = torch.zeros(call.k.shape, dtype=acc, device=dev)
        dv = torch.zeros(call.v.shape, dtype=acc, device=dev)
        d_params = {d.name: torch.zeros([call.sizes[a] for a in d.axes], dtype=acc, device=dev) for d in p.params}
        half = call.q.is_cuda  # products in the inputs' dtype (fp32 results) on the GPU
        for b, (lo, hi) in enumerate(self.spans(call, block)):
            q0, q1 = b * block, min((b + 1) * block, call.lq)
            if hi <= lo:
                continue  # no key visible: no gradient
            s, benv, bmemo = self._scores(call, ev, env, memo, q0, q1, lo, hi)
            prob = torch.exp(s - lse_safe[..., q0:q1, :])
            do = d_out[..., q0:q1, :]
            dv[..., lo:hi, :] += _mm(prob.transpose(-1, -2), (do.to(call.v.dtype) if half else do), acc)
            dp = _mm(do.to(call.v.dtype) if half else do, call.v[..., lo:hi, :].transpose(-1, -2), acc)
            d_mod = prob * (dp - (prob * dp).sum(-1, keepdim=True))  # rowsum(P dP) = rowsum(dO O), in fp32
            if p.score is None:
                ds = d_mod
            else:
                benv["grad_score"] = (d_mod, target)
                values = ev.run([bw.d_score, *grad_roots], benv, bmemo)
                ds = align(values[0], target).expand_as(d_mod)
                counts = {"~q": q1 - q0, "~k": hi - lo}
                for d, value in zip(p.params, values[1:]):
                    d_params[d.name] += loop_sum(value, d.axes, counts)
            dsc = ds.to(call.k.dtype) if half else ds
            dq[..., q0:q1, :] = _mm(dsc, call.k[..., lo:hi, :], acc) * scale
            dk[..., lo:hi, :] += _mm(dsc.transpose(-1, -2), call.q[..., q0:q1, :], acc) * scale
        return {"q": dq, "k": dk, "v": dv, **d_params}


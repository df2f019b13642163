"""Matrix-linear cores (SSD, RetNet, linear attention) as chunks of matrix products.

`passes/matrix_linear.py` cuts a matrix-linear program into a state-free pre stage (the operands),
a core ``S = exp(ℓ) S + β k ⊗ v; o = Σ_κ S q (+ s ⊙ v)`` (β and the skip s per-step scalars of the
heads, or 1 and 0) and a state-free post stage; the CUDA backend runs
the core here (`CudaBackend.compiled`, `CudaBackend.fused_backward`) and the other stages on its
ordinary kernels. This module moves a call's arrays between the program's layout (time first, each
input's own axes) and the chunked one of `algorithm.py`, which holds the math:

    ChunkedCore(program, "float32").run(seqs, params, initial, sizes, length)   # the runner contract
    g = ChunkedCore(...); outs, finals, tape = g.forward(...); g.backward(..., tape, cot, lam, ...)

The forward runs on the mma.sync kernels of `mma.py` (chunk.cu.j2) where q, k, v are 16-bit with
key and value sizes they take, else (fp32 / float64 inputs, other sizes, SSMC_CUDA_CHUNK_KERNELS=0)
as `algorithm.py`'s batched torch matrix products (cuBLAS); the backward likewise: `mma.backward`
where the kernels take the call (the output's cotangent rounded to q's 16 bits;
SSMC_CUDA_CHUNK_BACKWARD=0: not), else `algorithm.vjp`, both on what either forward saved
(docs/design/matrix-linear-chunks.md). A per-key decay (GLA: ℓ along the key axis, `MatrixLinear.per_key`)
runs on the per-key kernels (`mma.forward_per_key`, `mma.backward_per_key`, per_key.cu.j2: 16-bit q, k, v, key
and value sizes the kernels take, chunks of `mma.PER_KEY_CHUNK`; SSMC_CUDA_CHUNK_PER_KEY=0: not;
SSMC_CUDA_CHUNK_BACKWARD=0: the VJP as torch), else on `algorithm.py` (`_kernels_apply`: the other kernels take a
decay per head and step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .....ir.ops import Op
from .....passes.autodiff import GRAD
from .....passes.matrix_linear import MatrixLinear, core_form
from .....runtime.precision import cast_gradients
from ...devices import emulating
from ...launch import zero_bytes
from ...options import options
from . import mma, tune
from .algorithm import Chunks, NonPositiveDecay, forward, or_scan, vjp

# Steps per chunk where SSMC_CUDA_CHUNK does not say: the masked decay matrices ([C, C] per head and
# chunk) and the chunk states ([K, V] per head and chunk) are both materialised, so C balances
# L·C against L·K·V / C
CHUNK = 64
_DTYPES = {"float32": torch.float32, "float64": torch.float64}
# the gradients the backward kernels write time first (`ChunkedCore._direct_roles`) in the input's 16-bit dtype where
# it is q's and the caller only casts them to it (`cast_gradients`: ssmc.torch's backward), the fp32 sums rounded once
# as stored (chunk_d*_ho), the values that cast gives: not an fp32 array only a cast reads (SSD's dx: 128 MiB at B4
# L4096 H32 P64); False: fp32 (tests compare the two)
HALF_GRADIENTS = True


def chunk_size(ml: MatrixLinear, sizes: dict[str, int], length: int, dtype: torch.dtype | None = None,
               device: torch.device | None = None, operands=None) -> int:
    """Steps per chunk: SSMC_CUDA_CHUNK where set (the kernels take 64, 128 and 256; another size runs the
    torch path); where q of `dtype` would run on the kernels (`mma.kernels_wanted`: a short call pads its one
    chunk), `tune.chunk_for`'s (SSMC_CUDA_CHUNK_TUNE=1 on a GPU: the fastest for the shape, timed at its first
    use on `operands`(chunk), the call's `Chunks`, where given; else `mma.chunk_for`'s rule); else by the state's
    size."""
    forced = options().chunk
    if forced is not None:
        return max(1, forced)
    if dtype is not None and ml.per_key:
        if mma.per_key_wanted(dtype, sizes[ml.key], sizes[ml.value]):
            return mma.PER_KEY_CHUNK
    elif dtype is not None and mma.kernels_wanted(dtype, sizes[ml.key], sizes[ml.value]):
        if device is None:
            return mma.chunk_for(length)
        heads = math.prod(sizes[h] for h in ml.heads)
        return tune.chunk_for(length, heads, sizes[ml.key], sizes[ml.value], dtype, device, operands)
    kv = sizes[ml.key] * sizes[ml.value]
    size = 128 if kv >= 8192 else CHUNK
    return max(1, min(size, 1 << max(0, math.ceil(math.log2(max(length, 1))))))


def _kernels_apply(x: Chunks) -> bool:
    """`mma.kernels_apply`, never for a per-key decay (the kernels take one decay per head and step)."""
    return not x.per_key and mma.kernels_apply(x)


def _dense(shape) -> tuple[int, ...]:
    """The strides of a contiguous array of `shape`."""
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return tuple(strides)


def _zeros(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """`torch.zeros(shape)`, by a memset on the device where it is one (one driver call, `zero_bytes`: no fill
    kernel's launch)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    nbytes = out.numel() * out.element_size()
    # (the memset goes on the current device's stream: only for an array of that device)
    if nbytes % 4 == 0 and (emulating() or (out.is_cuda and out.device.index == torch.cuda.current_device())):
        zero_bytes(out.data_ptr(), nbytes, out.zero_)
    else:
        out.zero_()
    return out


@dataclass
class ChunkTape:
    """What the backward needs from a training forward: the chunked inputs and the chunk states."""

    chunks: Chunks
    entering: torch.Tensor
    final: torch.Tensor
    decay: torch.Tensor | None   # the decay as given, [*H, NC, C] (per key: [*H, NC, C, K]), where the core takes a


# decays found positive: (address, shape, strides, dtype) -> (a weak reference to the storage, its
# version). Binding hands the kernels a new tensor object a call (detached, a view), so the key is the
# memory it reads: a hit needs that storage alive (memory freed and reused by another array is checked
# again) and unwritten since (an in-place write through any alias bumps the shared version counter)
_POSITIVE: dict = {}


def _positive_key(x: torch.Tensor) -> tuple:
    return (x.device, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)


def _positive_before(x: torch.Tensor) -> bool:
    seen = _POSITIVE.get(_positive_key(x))
    return seen is not None and not seen[0].expired() and seen[1] == x._version


def _found_positive(x: torch.Tensor) -> None:
    if len(_POSITIVE) > 256:  # ever new arrays (decays given as sequences): keep it bounded
        _POSITIVE.clear()
    _POSITIVE[_positive_key(x)] = (StorageWeakRef(x.untyped_storage()), x._version)


def _param_decay_before(cache: dict, x: torch.Tensor, steps: tuple) -> tuple | None:
    """What `_found_param_decay` kept for `x` (a param's decays) as it stands, or None."""
    seen = cache.get((*_positive_key(x), steps))
    if seen is None or seen[0].expired() or seen[1] != x._version:
        return None
    return seen[2]


def _found_param_decay(cache: dict, x: torch.Tensor, steps: tuple, found: tuple) -> None:
    """Keep `found` (the decays of param `x` and their log, as `_scalars` takes them over `steps`) for calls that
    pass `x` as it stands: keyed and checked as `_POSITIVE` (the storage alive, its version unchanged)."""
    if len(cache) > 64:
        cache.clear()
    cache[(*_positive_key(x), steps)] = (StorageWeakRef(x.untyped_storage()), x._version, found)


class _Made:
    """An array made when first asked for, then kept (`array`): mma.backward's `outs`, made as late as the
    kernel that writes it. `like()`: an array of its layout that holds no memory (on the meta device), where
    the plan reads only its layout (`mma.BackwardPlan`); `dtype`: the array's (`mma.backward`'s plans key on it)."""

    def __init__(self, make, like=None, dtype=None):
        self.make, self.array, self.like, self.dtype = make, None, like, dtype

    def __call__(self) -> torch.Tensor:
        if self.array is None:
            self.array = self.make()
        return self.array


class ChunkedCore:
    """Runs one core program (`core_form`) chunked, forward and backward (module docstring)."""

    # the output's cotangent may come in a 16-bit dtype (the prepared steps pass one so as given): `backward`
    # rounds it to q's 16 bits for the kernels anyway (a view where it is q's dtype already), else casts it
    # to the compute dtype
    takes_half_cotangents = True

    def __init__(self, program, compute: str = "float32"):
        self.program = program
        self.ml = core_form(program)
        assert self.ml is not None and not self.ml.terms, f"{program.name} is no rank-1 matrix-linear core"
        self.compute = compute
        self.dtype = _DTYPES[compute]
        self.output, self.out_node = program.outputs[0]
        self.skip = self.ml.skip  # (a property that works it out each time)
        self.seq_names = frozenset(d.name for d in program.seqs)
        self.input_names = tuple(d.name for d in program.inputs)
        self.param_decays: dict = {}  # `_found_param_decay`'s
        self._unarranged: dict = {}   # `_unarrange_steps` per shape
        self._padded: dict = {}       # `_arrange_steps` per layout

    # -- layouts ---------------------------------------------------------------------------------
    def kernels_wanted(self, dtype: torch.dtype, sizes) -> bool:
        """`mma.kernels_wanted` for this core's key and value sizes (`mma.per_key_wanted` for a per-key decay)."""
        ml = self.ml
        wanted = mma.per_key_wanted if ml.per_key else mma.kernels_wanted
        return wanted(dtype, sizes[ml.key], sizes[ml.value])

    def _names(self, node_axes, timed: bool) -> list[str]:
        return (["~t"] if timed else []) + list(node_axes)

    def _arrange(self, x: torch.Tensor, axes, timed: bool, inner: str | None, length: int, chunk: int,
                 dtype=None) -> torch.Tensor:
        """`x` ([L, *axes] where `timed`, else [*axes]) as [*H (1 where absent), NC, C(, inner)],
        zero past `length`."""
        padded = -(-length // chunk) * chunk
        dtype = dtype or x.dtype
        if timed and padded == length:  # whole chunks: a view (a copy only for another dtype)
            names = self._names(axes, timed)
            target = [*self.ml.heads, "~t", *([inner] if inner else [])]
            y = x.permute(*[names.index(n) for n in target if n in names])
            shape = [x.shape[names.index(n)] if n in names else 1 for n in target]
            t = len(self.ml.heads)
            return y.reshape(shape).to(dtype).reshape(*shape[:t], padded // chunk, chunk, *shape[t + 1:])
        # a copy, zero past `length` (a param repeated over the steps): the views it copies between worked out once
        # per layout (host time a call: a short call pads its operands each call)
        out_shape, source, dest = self._padded_steps(x, axes, timed, inner, length, chunk)
        out = _zeros(out_shape, dtype, x.device)
        torch.as_strided(out, *dest).copy_(torch.as_strided(x, *source, x.storage_offset()))
        return out

    def _padded_steps(self, x, axes, timed: bool, inner: str | None, length: int, chunk: int) -> tuple:
        """`_arrange_steps` of `x`'s layout, worked out once per layout."""
        key = (tuple(x.shape), x.stride(), tuple(axes), timed, inner, length, chunk)
        steps = self._padded.get(key)
        if steps is None:
            if len(self._padded) >= 256:
                self._padded.clear()
            steps = self._padded[key] = self._arrange_steps(x, axes, timed, inner, length, chunk)
        return steps

    def _arrange_steps(self, x, axes, timed: bool, inner: str | None, length: int, chunk: int) -> tuple:
        """(the shape [*H, NC, C(, inner)] of `_arrange`'s copy of `x`; the size and strides of `x` read as
        [*H, length(, inner)] (stride 0 along the heads it lacks and, where not `timed`, along time); those of the
        copy's first `length` steps, the same shape)."""
        names = self._names(axes, timed)
        target = [*self.ml.heads, "~t", *([inner] if inner else [])]
        t = len(self.ml.heads)
        shape = [x.shape[names.index(n)] if n in names else 1 for n in target]
        shape[t] = length
        strides = [x.stride(names.index(n)) if n in names else 0 for n in target]
        padded = -(-length // chunk) * chunk
        dense = _dense([*shape[:t], padded, *shape[t + 1:]])  # the copy's strides, [*H, padded(, inner)] contiguous
        return ((*shape[:t], padded // chunk, chunk, *shape[t + 1:]), (tuple(shape), tuple(strides)),
                (tuple(shape), dense))

    def _unarrange(self, y: torch.Tensor, axes, timed: bool, inner: str | None, length: int) -> torch.Tensor:
        """The inverse of `_arrange` for a gradient: [*H, NC, C(, inner)] summed over the heads `axes`
        lack (and over time where not `timed`), as [L, *axes] or [*axes]."""
        key = (tuple(y.shape), tuple(axes), timed, inner, length)
        steps = self._unarranged.get(key)
        if steps is None:  # worked out once per shape (host time a call)
            if len(self._unarranged) >= 256:
                self._unarranged.clear()
            steps = self._unarranged[key] = self._unarrange_steps(y.shape, axes, timed, inner, length)
        flat, narrow, lacks, shape, order = steps
        y = y.reshape(flat)
        if narrow:
            y = y.narrow(len(self.ml.heads), 0, length)
        if lacks:
            y = y.sum(lacks, keepdim=True)
        y = y.reshape(shape)
        return y if order is None else y.permute(order)

    def _unarrange_steps(self, shape, axes, timed: bool, inner: str | None, length: int) -> tuple:
        """(the steps' flat shape, whether past `length` is cut, the axes summed, the shape after, the permutation
        to `axes`' order or None) of `_unarrange` for a gradient of `shape`."""
        t = len(self.ml.heads)
        flat = (*shape[:t], shape[t] * shape[t + 1], *shape[t + 2:])
        lacks = [i for i, h in enumerate(self.ml.heads) if h not in axes]
        if not timed:
            lacks.append(t)
        names = [*self.ml.heads, "~t", *([inner] if inner else [])]
        cut = (*flat[:t], length, *flat[t + 1:])
        keep = [i for i, n in enumerate(names) if i not in lacks]
        kept = [names[i] for i in keep]
        order = [kept.index(n) for n in self._names(axes, timed)]
        # (a sum over axes of one entry each, as dq and dk come where the kernels summed them, only copies)
        summed = lacks if any(cut[i] != 1 for i in lacks) else []
        return (flat, flat[t] != length, summed, [cut[i] for i in keep],
                None if order == list(range(len(order))) else order)

    def _input(self, node, seqs, params):
        """(the array of an operand's INPUT node, whether it is a sequence)."""
        if node.arg in seqs:
            return seqs[node.arg], True
        return params[node.arg], False

    def _chunks(self, seqs, params, initial, sizes, length, chunk):
        """(`Chunks` of a call, the decay as given where the core takes it so, else None)."""
        q, k, v = self._operands(seqs, params, length, chunk)
        ell, s0, beta, skip, decay = self._scalars(seqs, params, initial, length, chunk, q.device)
        return Chunks(q, k, v, ell, s0, beta, skip), decay

    def _operands(self, seqs, params, length, chunk, arrange=None):
        """The call's q, k, v as `Chunks` holds them (`_arrange`d: views where the chunks are whole and the dtype
        q's 16 bits, or the compute dtype, already). `arrange`: what makes them in `_arrange`'s place (the same
        values: `_Padding`'s)."""
        ml, f = self.ml, self.dtype
        arrange = arrange or self._arrange
        q_arr, _ = self._input(ml.q, seqs, params)
        mm = q_arr.dtype if q_arr.dtype in (torch.bfloat16, torch.float16) else f

        def operand(node, inner):
            arr, timed = self._input(node, seqs, params)
            return arrange(arr, node.axes, timed, inner, length, chunk, mm)

        return operand(ml.q, ml.key), operand(ml.k, ml.key), operand(ml.v, ml.value)

    def _scalars(self, seqs, params, initial, length, chunk, device, arrange=None):
        """(ell, s0, beta, skip as `Chunks` holds them, the decay as given where the core takes it so, else
        None): what a call computes from its decays, β, skip and initial state. `arrange` as `_operands`'."""
        ml, f = self.ml, self.dtype
        arrange = arrange or self._arrange
        decay = None
        if ml.log_decay is not None and ml.log_decay.op is Op.CONST:
            ell = torch.zeros((*[1] * len(ml.heads), -(-length // chunk) * chunk), dtype=f, device=device)
            ell[..., :length] = ml.log_decay.arg
            ell = ell.reshape(*ell.shape[:-1], -1, chunk)
        elif ml.log_decay is not None or ml.decay is not None:
            node = ml.log_decay if ml.log_decay is not None else ml.decay
            arr, timed = self._input(node, seqs, params)
            if ml.decay is not None:
                given, arr = arr, arr.to(f)
                # a host sync: not while a CUDA graph is captured (a decay <= 0 then gives NaN outputs), and
                # once per array as it stands (a param's decays, RetNet's gamma, checked at its first call
                # only: a sync a call would leave the GPU idle while the host launches the next call)
                capturing = arr.is_cuda and torch.cuda.is_current_stream_capturing()
                if not capturing and not _positive_before(given):
                    if not bool((arr > 0).all()):
                        raise NonPositiveDecay(
                            f"the decay {node.arg!r} has values <= 0: the chunked matrix-linear path takes its"
                            " log (SSMC_CUDA_CHUNKED=0 runs the element-wise scan, which takes any decay)")
                    _found_positive(given)
            steps = (length // chunk, chunk)
            whole = not timed and length % chunk == 0 and not ml.per_key  # (a param per head: a view)
            if whole and ml.decay is not None and (
                    found := _param_decay_before(self.param_decays, given, steps)) is not None:
                decay, ell = found  # (this array's, as it stands, worked out at an earlier call)
            elif whole:
                # a param's decays over whole chunks (RetNet's gamma): taken per head once (its log), then
                # repeated over the steps as a view (step stride 0), the values `_arrange` would copy out
                names = list(node.axes)
                y = arr.to(f).permute(*[names.index(n) for n in ml.heads if n in names])
                shape = [arr.shape[names.index(n)] if n in names else 1 for n in ml.heads]
                y = y.reshape(*shape, 1, 1)
                steps = (*shape, *steps)
                if ml.decay is not None:
                    # (the decays a copy: the tape's, as they were at this call)
                    decay, ell = y.clone().expand(steps), torch.log(y).expand(steps)
                    _found_param_decay(self.param_decays, given, (length // chunk, chunk), (decay, ell))
                else:
                    ell = y.expand(steps)
            else:  # (per key: [*H, NC, C, K])
                ell = arrange(arr, node.axes, timed, ml.key if ml.per_key else None, length, chunk, f)
                if ml.decay is not None:  # padded steps: decay 1
                    decay = ell.masked_fill(ell == 0, 1.0)
                    ell = torch.log(decay)
        else:
            ell = torch.zeros((*[1] * len(ml.heads), -(-length // chunk), chunk), dtype=f, device=device)
        def scalar(node):  # β or the skip: [*H, NC, C] in the compute dtype, zero past `length` (v is too)
            if node is None:
                return None
            if node.op is Op.CONST:
                out = torch.zeros((*[1] * len(ml.heads), -(-length // chunk) * chunk), dtype=f, device=device)
                out[..., :length] = node.arg
                return out.reshape(*out.shape[:-1], -1, chunk)
            arr, timed = self._input(node, seqs, params)
            if not timed:  # a param (SSD's D): a view repeated over the steps, no copy (past `length` v is 0)
                names = list(node.axes)
                y = arr.to(f).permute(*[names.index(n) for n in ml.heads if n in names])
                shape = [arr.shape[names.index(n)] if n in names else 1 for n in ml.heads]
                return y.reshape(*shape, 1, 1).expand(*shape, -(-length // chunk), chunk)
            return arrange(arr, node.axes, timed, None, length, chunk, f)

        s = ml.state
        s0 = initial[s.name].to(f)
        s0 = s0.permute(*[s.axes.index(n) for n in (*ml.heads, ml.key, ml.value)])
        return ell, s0, scalar(ml.beta), scalar(self.skip), decay

    def _time_first_layout(self, axes, inner: str) -> bool:
        """Whether an [L, *axes] array can be viewed as the kernels' [*H, NC, C, inner]: every head axis and
        `inner` last (`_time_first_out`)."""
        return set(axes) == {*self.ml.heads, inner} and axes[-1] == inner

    def _time_first_out(self, sizes, length, chunk, device, dtype=torch.float32, axes=None, inner=None
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(the output as the program holds it, [padded length, *axes] of `dtype`, and the same memory as
        [*H, NC, C, V], the layout `mma.forward` writes), where the output has every head axis and the
        value axis last; else None. The kernels then write the output in place: no permuting copy.
        `axes`, `inner`: those of another [L, *axes] array than the output, its last axis `inner` (the
        gradient of an operand, which `mma.backward` writes so)."""
        ml = self.ml
        axes = tuple(self.out_node.axes if axes is None else axes)
        inner = ml.value if inner is None else inner
        if not self._time_first_layout(axes, inner):
            return None
        padded = -(-length // chunk) * chunk
        buf = torch.empty((padded, *[sizes[a] for a in axes]), dtype=dtype, device=device)
        names = ["~t", *axes]
        view = buf.permute(*[names.index(n) for n in (*ml.heads, "~t", inner)])
        t = len(ml.heads)
        return buf, view.reshape(*view.shape[:t], padded // chunk, chunk, view.shape[-1])

    def _outputs(self, out, final, sizes, length, out_dtype, time_first=None, as_is: bool = False,
                 copy: bool = True):
        """(outputs, final states) in the program's layouts, from O [*H, NC, C, V] or, where given, the
        time-first array O was written into (`_time_first_out`; `as_is`: that array is the output as it is).
        `copy` False (a training forward, `out_dtype` None): the output O's time-first view as it is where O has
        every head (the runners take time-first arrays of any strides; the torch op's cast to the input's layout
        and dtype is then its one copy), else contiguous."""
        ml = self.ml
        t = len(ml.heads)
        full = [sizes[h] for h in ml.heads]
        if as_is:
            o = time_first
        elif time_first is not None:
            o = time_first.narrow(0, 0, length)  # a contiguous view
        else:
            o = out.reshape(*out.shape[:t], -1, out.shape[-1]).narrow(t, 0, length)
            o = o.expand(*full, length, sizes[ml.value])
            names = [*ml.heads, "~t", ml.value]
            o = o.permute(*[names.index(n) for n in ("~t", *self.out_node.axes)])
        if not as_is and (copy or out_dtype is not None or tuple(out.shape[:t]) != tuple(full)):
            # (cast and made contiguous in one copy: `.to` alone keeps a permuted view's strides)
            o = o.contiguous() if out_dtype is None else o.to(dtype=out_dtype, memory_format=torch.contiguous_format)
        s = ml.state
        final = final.expand(*full, sizes[ml.key], sizes[ml.value])
        names = [*ml.heads, ml.key, ml.value]
        final = final.permute(*[names.index(n) for n in s.axes]).contiguous()
        return {self.output: o}, {s.name: final}

    # -- the runner contract -----------------------------------------------------------------------
    def run(self, seqs, params, initial, sizes, length, out_dtype=None):
        """Same contract as `interpreter.run_recurrence` (torch tensors in and out). A decay given as is
        with values <= 0 runs as the element-wise scan instead."""
        from ...runner import output_dtype

        out_dtype = output_dtype(out_dtype, self.output)

        def attempt():
            return self.forward(seqs, params, initial, sizes, length, out_dtype=out_dtype, tape=False)
        return or_scan(self, attempt, seqs, params, initial, sizes, length, out_dtype)

    def prepare_run(self, seqs, params, initial, sizes, length, out_dtype=None):
        """`run` for every call alike (`Backend.preparer`: the same shapes, strides, dtypes, device and options),
        skipping the binding and the strategy's choice, the kernels' launches planned once (`PreparedForward`);
        the call's sequences go time first, as `run` reads them."""
        from ...runner import output_dtype

        forward = PreparedForward(self, sizes, length, output_dtype(out_dtype, self.output), tape=False)

        def call(seqs, params, initial):
            return or_scan(self, lambda: forward(seqs, params, initial), seqs, params, initial, sizes, length,
                           out_dtype)
        call.time_first = True
        return call

    # -- the fused-backward contract (`driver.Grad`'s "fused" path) -------------------------------------
    def applies(self, seqs, sizes, length) -> bool:
        return True

    def half_inputs(self, cast: dict, given: dict, sizes) -> dict:
        """The sequences a training call runs on: those `Grad` cast to the compute dtype (`cast`), but q, k
        and v as given (`given`, time first) where q is 16-bit and the kernels take its sizes, so that the
        training forward and backward run on the tensor-core kernels as an inference call does (the
        operands rounded to q's 16 bits either way: `_chunks`); else `cast` as is."""
        ml = self.ml
        q = given.get(ml.q.arg)
        if q is None or not self.kernels_wanted(q.dtype, sizes):
            return cast
        keep = {node.arg for node in (ml.q, ml.k, ml.v) if node.arg in given and given[node.arg].dtype == q.dtype}
        return {n: given[n] if n in keep else v for n, v in cast.items()}

    def operand_dtypes(self, seqs, sizes) -> dict:
        """{name: 16-bit dtype} for the operands q, k, v that an earlier stage writes (names not in `seqs`,
        the call's and earlier stages' sequences), where q is among `seqs` in 16 bits and the kernels take
        the sizes: `_chunks` rounds them to q's dtype either way, so the stage may write them so."""
        ml = self.ml
        q = seqs.get(ml.q.arg)
        if q is None or not self.kernels_wanted(q.dtype, sizes):
            return {}
        return {node.arg: q.dtype for node in (ml.k, ml.v) if node.arg not in seqs}

    def forward(self, seqs, params, initial, sizes, length, outputs: bool = True, out_dtype=None, tape=True):
        """(outputs, final states, tape) of a training forward: outputs time first; on the kernels the tape's
        entering states are 16-bit (`mma.forward`'s half_states). `tape` False (an inference call): the
        output written in `out_dtype` by the kernels where that is q's 16-bit dtype."""
        q_arr, _ = self._input(self.ml.q, seqs, params)
        chunk = chunk_size(self.ml, sizes, length, q_arr.dtype, q_arr.device,
                           lambda c: self._chunks(seqs, params, initial, sizes, length, c)[0])
        x, decay = self._chunks(seqs, params, initial, sizes, length, chunk)
        time_first = None
        if x.per_key and mma.per_key_applies(x):
            out, entering, final = mma.forward_per_key(x)
        elif _kernels_apply(x):
            o_dtype = out_dtype if out_dtype == x.q.dtype else torch.float32
            direct = self._time_first_out(sizes, length, chunk, x.q.device, o_dtype)
            # the entering states in q's 16 bits, with a tape too: chunk_output and the backward's chunk_dq read
            # them rounded (mma.backward), so half the bytes are kept
            out, entering, final = mma.forward(x, out=None if direct is None else direct[1], half_states=True,
                                               out_dtype=o_dtype)
            if direct is not None and out.data_ptr() == direct[1].data_ptr():
                time_first = direct[0]
        else:
            out, entering, final = forward(x)
        outs, finals = self._outputs(out, final, sizes, length, out_dtype, time_first, copy=not tape)
        return outs, finals, ChunkTape(x, entering, final, decay)

    def backward(self, seqs, params, tape: ChunkTape, cot: dict, lam: dict, _unused, sizes, length,
                 plans: dict | None = None):
        """({GRAD + sequence: [L, *axes]}, {GRAD + param or state: gradient}) from the cotangents of the
        output (``cot[GRAD + output]``, time first) and of the final state (``lam[GRAD + state]``): each in its input's
        dtype, the compute dtype where that is 16-bit, but the gradients the kernels write in a 16-bit input's dtype
        where the caller only casts them (`_direct_roles`). `plans`
        (`prepare_backward`: calls of one signature): the kernels' `mma.BackwardPlan`s, kept there per layout of
        the arrays' memory (their storage offsets, whether the bases are 16-byte aligned)."""
        ml, x = self.ml, tape.chunks
        chunk = x.q.shape[-2]
        s = ml.state
        d_final = lam[GRAD + s.name].to(x.compute)
        d_final = d_final.permute(*[s.axes.index(n) for n in (*ml.heads, ml.key, ml.value)])
        cot_out = cot[GRAD + self.output]
        d_out = None
        if x.per_key and mma.per_key_applies(x) and options().chunk_backward is not False:
            d_out = self._arrange(cot_out, self.out_node.axes, True, ml.value, length, chunk, x.q.dtype)
            if mma.per_key_backward_applies(x, d_out):
                grads = mma.backward_per_key(x, tape.entering, d_out, d_final)
                return self._gradients(seqs, params, tape, grads, sizes, length)
            d_out = None  # (not the scalar-decay kernels' either: `mma.backward_applies` does not look at per_key)
        if _kernels_apply(x) and options().chunk_backward is not False:  # 16-bit dO, as the peers round it
            d_out = self._arrange(cot_out, self.out_node.axes, True, ml.value, length, chunk, x.q.dtype)
        if d_out is not None and mma.backward_applies(x, d_out):
            # the gradients of q, k, v written time first by the kernels where the operand is a sequence of
            # every head and its own (SSD's x; RetNet's q, k, v): returned as they are, no permuting copy after
            # (each made as its kernel runs, so that it is not live before: `_Made`), in the input's 16 bits
            # where it is q's and the caller only casts the gradient to it (`HALF_GRADIENTS`)
            direct = {role: self._made_out(sizes, length, chunk, x.q.device, axes, inner, dtype)
                      for role, _, axes, inner, dtype in self._direct_roles(seqs, x.q.dtype)}
            dq, dk, dv, d_ell, ds0, d_beta, d_skip = mma.backward(x, tape.entering, tape.final, d_out, d_final,
                                                                  outs=direct, plans=plans)
        else:
            d_out = self._arrange(cot_out, self.out_node.axes, True, ml.value, length, chunk, x.compute)
            # (the kernels' 16-bit entering states in the compute dtype: the torch path's products take one dtype)
            dq, dk, dv, d_ell, ds0, d_beta, d_skip = vjp(x, tape.entering.to(x.compute), tape.final, d_out, d_final)
        return self._gradients(seqs, params, tape, (dq, dk, dv, d_ell, ds0, d_beta, d_skip), sizes, length)

    def _gradients(self, seqs, params, tape, chunked, sizes, length, done: dict | None = None,
                   state_as_is: bool = False):
        """`backward`'s result from the gradients of the chunked arrays `chunked` (dq, dk, dv, d_ell, ds0, d_beta,
        d_skip as `mma.backward` returns them): each summed over the heads its input lacks and laid out as the
        input. `done`: {GRAD + name: gradient} of inputs whose gradient is made already (time first, as returned);
        `state_as_is`: ds0 is the initial state's gradient as it is (every head, the state's axes in order)."""
        ml, s, f = self.ml, self.ml.state, self.dtype
        dq, dk, dv, d_ell, ds0, d_beta, d_skip = chunked
        grads: dict[str, torch.Tensor] = dict(done or {})

        def add(node, grad, inner):
            key = GRAD + node.arg
            if done is not None and key in done:
                return
            arr, timed = self._input(node, seqs, params)
            g = self._unarrange(grad, node.axes, timed, inner, length)
            # fp32 where kept 16-bit, but a gradient the kernels wrote in the input's 16 bits (`_direct_roles`),
            # which reaches the caller as it is (no fp32 round trip: the caller's cast to the input's dtype a no-op)
            if g.dtype != arr.dtype:
                g = g.to(f if arr.dtype in (torch.bfloat16, torch.float16) else arr.dtype)
            grads[key] = grads[key] + g if key in grads else g

        add(ml.q, dq, ml.key)
        add(ml.k, dk, ml.key)
        add(ml.v, dv, ml.value)
        for node, grad in ((ml.beta, d_beta), (self.skip, d_skip)):
            if node is not None and node.op is not Op.CONST:
                add(node, grad, None)
        if ml.decay is not None:
            add(ml.decay, d_ell / tape.decay, ml.key if ml.per_key else None)
        elif ml.log_decay is not None and ml.log_decay.op is not Op.CONST:
            add(ml.log_decay, d_ell, ml.key if ml.per_key else None)
        if state_as_is:
            finals = {GRAD + s.name: ds0}
        else:
            full = [sizes[h] for h in ml.heads]
            ds0 = ds0.expand(*full, sizes[ml.key], sizes[ml.value])
            names = [*ml.heads, ml.key, ml.value]
            finals = {GRAD + s.name: ds0.permute(*[names.index(n) for n in s.axes]).contiguous()}
        seq_names = self.seq_names
        # the sequences' gradients time first in any strides (the runners' contract; `_unarrange`'s views of the
        # chunked arrays): the caller's permute to the input's layout and cast is their one copy
        outs = {k: v for k, v in grads.items() if k[len(GRAD):] in seq_names}
        finals.update((k, v) for k, v in grads.items() if k[len(GRAD):] not in seq_names)
        for name in self.input_names:  # inputs no operand reads (none in a core as built): zeros
            if GRAD + name not in outs and GRAD + name not in finals:
                arr = seqs.get(name, params.get(name))
                (outs if name in seq_names else finals)[GRAD + name] = torch.zeros_like(arr)
        return outs, finals

    def _made_out(self, sizes, length, chunk, device, axes, inner, dtype=torch.float32) -> _Made:
        """A time-first gradient's [*H, NC, C, inner] view of `dtype` (`_time_first_out`), made when its kernel
        runs."""
        def out(on):
            return self._time_first_out(sizes, length, chunk, on, dtype, axes=axes, inner=inner)[1]
        return _Made(lambda: out(device), lambda: out(torch.device("meta")), dtype)

    def _direct_roles(self, seqs, half: torch.dtype) -> list[tuple]:
        """(role, node, axes, inner, dtype) of the gradients of q, k, v the kernels write time first (`backward`):
        an operand that is a sequence of every head and its own inner axis, and no other operand's array; `dtype`
        the input's where it is `half` (q's 16-bit dtype, the kernels') and the caller only casts the gradient to it
        (`cast_gradients`; `HALF_GRADIENTS`), else fp32."""
        ml = self.ml
        cast = cast_gradients() if HALF_GRADIENTS else frozenset()
        found = []
        for role, node, inner in (("dq", ml.q, ml.key), ("dk", ml.k, ml.key), ("dv", ml.v, ml.value)):
            unique = sum(n.arg == node.arg for n in (ml.q, ml.k, ml.v)) == 1  # else two gradients summed
            axes = tuple(node.axes)
            if node.arg in seqs and unique and self._time_first_layout(axes, inner):
                dtype = half if node.arg in cast and seqs[node.arg].dtype == half else torch.float32
                found.append((role, node, axes, inner, dtype))
        return found

    def prepare_forward(self, seqs, params, initial, sizes, length, outputs: bool = True):
        """`forward` (with a tape) for calls of one signature: `PreparedForward`."""
        return PreparedForward(self, sizes, length, None, tape=True)

    def prepare_backward(self, seqs, params, tape, cot, lam, extra, sizes, length):
        """`backward` for calls of one signature (and of their cotangents): `PreparedBackward`."""
        return PreparedBackward(self, sizes, length)


class _Padding:
    """Where a padded prepared call (`PreparedForward`) makes its copies of whole chunks (`ChunkedCore._arrange`'s,
    the same values and layouts): one allocation a call, zeroed by one memset (rather than an allocation and a fill
    each), each copy a view at its own offset (`ALIGN`-byte aligned), in the order the call's `_operands` and
    `_scalars` ask for them; as a plain loop, a call's

        buffer = zeros(nbytes)
        for each array asked for: view = buffer[offset : offset + its bytes] as [*H, NC, C(, inner)] of its dtype
                                  view[.., :length, ..] = the array (as `_arrange` lays it out)

    An array asked for otherwise than at the first call (its layout or dtype: the signature fixes both) is
    `_arrange`'s own copy."""

    ALIGN = 256

    def __init__(self, core: ChunkedCore, asked: list[tuple]):
        self.core = core
        self.slots, offset = [], 0
        for key, dtype, (shape, source, dest) in asked:  # (the layout key, the copy's dtype, `_arrange_steps`)
            itemsize = dtype.itemsize
            self.slots.append((key, dtype, shape, _dense(shape), offset // itemsize, source, dest))
            offset += -(-math.prod(shape) * itemsize // self.ALIGN) * self.ALIGN
        self.nbytes = offset

    @staticmethod
    def of(core: ChunkedCore, seqs, params, initial, length: int, chunk: int) -> _Padding:
        """The padding of calls like this one: the copies its `_operands` and `_scalars` ask `_arrange` for."""
        asked = []

        def record(x, axes, timed, inner, length, chunk, dtype=None):
            out = core._arrange(x, axes, timed, inner, length, chunk, dtype)
            asked.append(((tuple(x.shape), x.stride(), x.dtype, tuple(axes), timed, inner, length, chunk), out.dtype,
                          core._padded_steps(x, axes, timed, inner, length, chunk)))
            return out
        q = core._operands(seqs, params, length, chunk, record)[0]
        core._scalars(seqs, params, initial, length, chunk, q.device, record)
        return _Padding(core, asked)

    def arrange(self, device):
        """A call's `_arrange` (its copies in one new zeroed allocation on `device`)."""
        core, slots = self.core, self.slots
        buffer = _zeros((self.nbytes,), torch.uint8, device)
        typed, asked = {}, iter(range(len(slots)))

        def arrange(x, axes, timed, inner, length, chunk, dtype=None):
            dtype = dtype or x.dtype
            i = next(asked, None)
            key = (tuple(x.shape), x.stride(), x.dtype, tuple(axes), timed, inner, length, chunk)
            if i is None or slots[i][0] != key or slots[i][1] != dtype:
                return core._arrange(x, axes, timed, inner, length, chunk, dtype)
            _, _, shape, strides, offset, source, dest = slots[i]
            view = typed.get(dtype)
            if view is None:
                view = typed[dtype] = buffer.view(dtype)
            torch.as_strided(view, *dest, offset).copy_(torch.as_strided(x, *source, x.storage_offset()))
            return torch.as_strided(view, shape, strides, offset)
        return arrange


class PreparedTape(ChunkTape):
    """A prepared forward's tape (`PreparedForward`): its `Chunks` (views of q, k, v made where asked for; a call
    with a partial last chunk: the padded copies the kernels read, kept), and the forward's plan
    (`mma.ForwardPlan`) with the addresses of q, k, v, ell, beta, skip it launched on."""

    def __init__(self, make, entering, final, decay, addresses, key):
        self.make, self.made = make, None
        self.entering, self.final, self.decay, self.addresses, self.key = entering, final, decay, addresses, key

    @property
    def chunks(self) -> Chunks:
        if self.made is None:
            self.made = self.make()
        return self.made


class PreparedForward:
    """``call(seqs, params, initial) -> (outputs, finals, tape)``: `ChunkedCore.forward` for the calls of one
    signature (shapes, strides, dtypes, device, options: the caller's `Backend.call_key`), `out_dtype` and `tape`
    (`ChunkTape`, or None) as `forward` takes them. Where the kernels run it, the first call of each layout of the
    operands' memory (their storage offsets, whether their bases are 16-byte aligned: the offset tables and the
    kernels' choice read them, the signature does not) runs as `forward` and works out a `mma.ForwardPlan` and
    what is made around it; later calls take them, as a plain loop:

        ell, s0, beta, skip = the call's decays, initial state, β, skip   (`_scalars`: they read its values)
        out = torch.empty(the time-first output)                          (where the kernels write it so)
        launch the plan's kernels on the addresses of q, k, v (as given: no views), ell, beta, skip, out
        outputs, finals = out, final  (views or copies only where the layouts ask: `_outputs`)

    A call whose last chunk is partial (`padded`: length not a multiple of the chunk) copies q, k, v and its
    sequences of decays, β and skip each call into zeroed arrays of whole chunks, as `forward` does (`_arrange`):
    the kernels read every step of a chunk. Those copies' layouts are the signature's, so their plan is worked out
    once as well; the tape keeps the copies (the backward's plan reads them at the same addresses).
    Elsewhere (the torch path, operands the core copies over whole chunks) each call is `forward`'s."""

    def __init__(self, core: ChunkedCore, sizes, length, out_dtype, tape: bool):
        self.core, self.sizes, self.length, self.out_dtype, self.tape = core, sizes, length, out_dtype, tape
        self.plans: dict = {}   # layout key (`__call__`) -> (plan, what is made around it), or False
        self.general: bool | None = None  # whether no call of the signature runs the kernels (set at the first)
        self.chunk = 0
        # whether the last chunk is partial (set at the first call): the operands are then copied each call, padded
        # with zeros to whole chunks as `forward` copies them, and the plan is keyed by the copies' layout
        self.padded = False
        self.padding: _Padding | None = None  # (where `padded`: made at the first call)
        # (names of ell's, beta's, skip's inputs, None where absent) where `Chunks` holds them as views of the
        # arrays as given (SSD's log decays and β, its D: set by the first `_plan`), else None (`_scalars` a call)
        self.given: tuple | None = None
        self.given_found = False
        s = core.ml.state
        self.state_order = [s.axes.index(n) for n in (*core.ml.heads, core.ml.key, core.ml.value)]

    def __call__(self, seqs, params, initial):
        core, ml, length = self.core, self.core.ml, self.length
        q = seqs[ml.q.arg] if ml.q.arg in seqs else params[ml.q.arg]
        if self.general is None:
            self.chunk = chunk_size(ml, self.sizes, length, q.dtype, q.device,
                                    lambda c: core._chunks(seqs, params, initial, self.sizes, length, c)[0])
            # (a per-key decay: no plan, `forward` each call)
            self.general = ml.per_key or not core.kernels_wanted(q.dtype, self.sizes)
            self.padded = length % self.chunk != 0
        if self.general:
            return self._general(seqs, params, initial)
        padded, given = self.padded, self.given
        if padded:  # the operands copied into whole chunks, zero past `length` (as `forward` pads: `_Padding`)
            if self.padding is None:
                self.padding = _Padding.of(core, seqs, params, initial, length, self.chunk)
            arrange = self.padding.arrange(q.device)
            q, k, v = core._operands(seqs, params, length, self.chunk, arrange)
            ell, s0, beta, skip, decay = core._scalars(seqs, params, initial, length, self.chunk, q.device, arrange)
        else:
            k = seqs[ml.k.arg] if ml.k.arg in seqs else params[ml.k.arg]
            v = seqs[ml.v.arg] if ml.v.arg in seqs else params[ml.v.arg]
            if given is not None:  # ell, beta, skip: the arrays as given (`_plan`), only their addresses read
                ell, beta, skip = (None if n is None else seqs[n] if n in seqs else params[n] for n in given)
                s0 = initial[ml.state.name].to(core.dtype).permute(self.state_order)
                decay = None
            else:
                ell, s0, beta, skip, decay = core._scalars(seqs, params, initial, length, self.chunk, q.device)
        bq, bk, bv = mma._base(q), mma._base(k), mma._base(v)
        key = (q.storage_offset(), k.storage_offset(), v.storage_offset(), ell.storage_offset(),
               None if beta is None else beta.storage_offset(), None if skip is None else skip.storage_offset(),
               (bq | bk | bv) % 16 == 0)
        found = self.plans.get(key)
        if found is None:  # the layout's first call: its plan made, the call itself `forward`'s
            if given is not None:  # the views `_plan` reads the layouts of
                ell, s0, beta, skip, decay = core._scalars(seqs, params, initial, length, self.chunk, q.device)
            if self._plan(key, seqs, params, ell, s0, beta, skip, (bq, bk, bv), (q, k, v) if padded else None
                          ) is False and padded:
                self.general = True  # (the copies' layouts are the signature's: no call of it takes a plan)
            return self._general(seqs, params, initial)
        if found is False:
            return self._general(seqs, params, initial)
        plan, buf_shape, buf_dtype, out_as_is, final_as_is = found
        addresses = [bq, bk, bv, mma._base(ell), 0 if beta is None else mma._base(beta),
                     0 if skip is None else mma._base(skip)]
        buf = None if buf_shape is None else torch.empty(buf_shape, dtype=buf_dtype, device=q.device)
        out, entering, final = plan.launch(list(addresses), s0, buf)
        if out_as_is and final_as_is:  # the output and the final state are the arrays the kernels wrote, as they are
            outs, finals = {core.output: buf}, {ml.state.name: final}
        else:
            # (a training call's output as `core.forward`'s first call of this layout gave it: the next stage's
            # prepared step was made for those strides)
            outs, finals = core._outputs(out, final, self.sizes, length, self.out_dtype, buf, out_as_is,
                                         copy=not self.tape)
        if not self.tape:
            return outs, finals, None
        if padded:  # the copies the kernels read: the tape's (the backward reads them at the same addresses)
            made = Chunks(q, k, v, ell, s0, beta, skip)
            return outs, finals, PreparedTape(lambda: made, entering, final, decay, addresses, key)
        chunk = self.chunk

        def make():  # the tape's chunked operands, made only where the general backward asks for them
            if self.given is not None:  # (the scalars were read as given: made now)
                scalars = core._scalars(seqs, params, initial, length, chunk, q.device)[:4]
            else:
                scalars = (ell, s0, beta, skip)
            return Chunks(*core._operands(seqs, params, length, chunk), *scalars)
        return outs, finals, PreparedTape(make, entering, final, decay, addresses, key)

    def _general(self, seqs, params, initial):
        outs, finals, tape = self.core.forward(seqs, params, initial, self.sizes, self.length,
                                               out_dtype=self.out_dtype, tape=self.tape)
        return outs, finals, tape if self.tape else None

    def _given(self, seqs, params, x: Chunks) -> tuple | None:
        """(the names of the inputs ell, beta, skip are, None where absent) where `x` holds each as a view of that
        input as given (the same memory and dtype: its address is the view's), else None."""
        ml, core = self.core.ml, self.core
        if ml.decay is not None:  # its log is taken
            return None
        names = []
        for node, a in ((ml.log_decay, x.ell), (ml.beta, x.beta), (core.skip, x.skip)):
            if node is None and a is None:
                names.append(None)
                continue
            if node is None or node.op is not Op.INPUT or a is None:
                return None
            arr = seqs[node.arg] if node.arg in seqs else params.get(node.arg)
            if arr is None or arr.dtype != a.dtype or mma._base(arr) != mma._base(a) or arr.storage_offset() != (
                    a.storage_offset()):
                return None
            names.append(node.arg)
        return tuple(names)

    def _plan(self, key, seqs, params, ell, s0, beta, skip, bases, padded=None):
        """The plan of calls of layout `key` (`__call__`), or False where the kernels do not take them or (whole
        chunks) q, k, v are no views of the arrays as given (a copy `_arrange` makes: `forward` each call).
        `padded`: the call's q, k, v padded to whole chunks (`__call__` copies them so each call, always in the same
        layout), which the plan reads."""
        core, length, chunk = self.core, self.length, self.chunk
        q, k, v = core._operands(seqs, params, length, chunk) if padded is None else padded
        x = Chunks(q, k, v, ell, s0, beta, skip)
        found = False
        if _kernels_apply(x) and all(mma._base(a) == b for a, b in zip((q, k, v), bases)):
            o_dtype = self.out_dtype if self.out_dtype == q.dtype else torch.float32
            direct = core._time_first_out(self.sizes, length, chunk, q.device, o_dtype)
            plan = mma.ForwardPlan(x, out=None if direct is None else direct[1], half_states=True,
                                    out_dtype=o_dtype)
            if not any(plan.copies):
                buf = direct is not None and plan.out_given
                # whether `_outputs` would give the arrays the kernels wrote as they are (whole chunks, the
                # output's dtype, the final state's heads and axes in order)
                ml = core.ml
                s = ml.state
                out_as_is = (buf and -(-length // chunk) * chunk == length
                             and (self.out_dtype is None or self.out_dtype == o_dtype))
                final_as_is = (plan.final_shape == tuple(self.sizes[a] for a in s.axes)
                               and list(s.axes) == [*ml.heads, ml.key, ml.value])
                found = (plan, tuple(direct[0].shape) if buf else None, o_dtype, out_as_is, final_as_is)
                if not self.given_found and padded is None:
                    self.given_found = True
                    self.given = self._given(seqs, params, x)
        if len(self.plans) >= 16:  # views at ever new storage offsets: keep it bounded
            self.plans.clear()
        self.plans[key] = found
        return found


class PreparedBackward:
    """``call(seqs, params, tape, cot, lam, extra) -> (gradients of sequences, of params and states)``:
    `ChunkedCore.backward` for the calls of one signature and of one of their cotangents. On a `PreparedTape`
    where the kernels run the backward, the first call of each layout of the memory (the forward's, and the
    output cotangent's storage offset and alignment) works out the kernels' `mma.BackwardPlan` and what is made
    around it; later calls take them, as a plain loop:

        launch the plan's kernels on the forward's addresses of q, k, v, ell, beta, skip and dO's (the cotangent
        as given where it is a view of it), the time-first gradients made as their kernels run
        the other gradients summed over the heads their inputs lack (`_gradients`)

    Elsewhere each call is `backward`'s (with its kernels' plans kept: its `plans`)."""

    def __init__(self, core: ChunkedCore, sizes, length):
        self.core, self.sizes, self.length = core, sizes, length
        self.plans: dict = {}   # layout key (`__call__`) -> what `_plan` found, or False
        self.kernel_plans: dict = {}  # `backward`'s, where this path does not apply
        ml, s = core.ml, core.ml.state
        self.state_order = [s.axes.index(n) for n in (*ml.heads, ml.key, ml.value)]

    def __call__(self, seqs, params, tape, cot, lam, extra):
        core, sizes, length = self.core, self.sizes, self.length
        found = False
        if isinstance(tape, PreparedTape):
            cot_out = cot[GRAD + core.output]
            # (and the gradients the caller only casts: written in 16 bits or not, `_direct_roles`)
            key = (tape.key, cot_out.storage_offset(), cot_out.dtype, mma._base(cot_out) % 16 == 0, cast_gradients())
            found = self.plans.get(key)
            if found is None:
                found = self._plan(key, seqs, params, tape, cot_out)
        if found is False:
            return core.backward(seqs, params, tape, cot, lam, extra, sizes, length, self.kernel_plans)
        plan, d_out_view, made, state_as_is = found
        ml = core.ml
        addresses = list(tape.addresses)
        if d_out_view:
            addresses.append(mma._base(cot_out))
        else:  # (d_out stays referenced until the kernels are queued: a copy's memory is no one else's before)
            d_out = core._arrange(cot_out, core.out_node.axes, True, ml.value, length, plan.chunk, plan.dtype)
            if plan.copies[6]:  # the layout the plan's tables were made for (a contiguous copy: an expanded dy)
                d_out = mma._chunked_view(d_out, True)
            addresses.append(mma._base(d_out))
        d_final = lam[GRAD + ml.state.name].to(core.dtype).permute(self.state_order)
        device = plan.device
        direct = {role: _Made(lambda shape=shape, dtype=dtype: torch.empty(shape, dtype=dtype, device=device))
                  for role, shape, _, dtype in made}
        chunked = plan.launch(addresses, tape.entering, d_final, direct)
        # the time-first gradients the kernels wrote: returned as they are (whole chunks) or their first steps
        done = {name: direct[role].array if direct[role].array.shape[0] == length
                else direct[role].array.narrow(0, 0, length) for role, _, name, _ in made}
        return core._gradients(seqs, params, tape, chunked, sizes, length, done, state_as_is)

    def _plan(self, key, seqs, params, tape, cot_out):
        """What calls of layout `key` take (`__call__`), or False where the kernels do not run the backward."""
        core, sizes, length = self.core, self.sizes, self.length
        ml, x = core.ml, tape.chunks
        found = False
        if _kernels_apply(x) and options().chunk_backward is not False:
            chunk = x.q.shape[-2]
            d_out = core._arrange(cot_out, core.out_node.axes, True, ml.value, length, chunk, x.q.dtype)
            if mma.backward_applies(x, d_out):
                roles = core._direct_roles(seqs, x.q.dtype)
                direct = {role: core._made_out(sizes, length, chunk, x.q.device, axes, inner, dtype)
                          for role, _, axes, inner, dtype in roles}
                plan = mma.BackwardPlan(x, tape.entering, d_out, direct)
                if not any(plan.copies[:6]):
                    # the gradients the kernels write in the time-first arrays themselves (`writable_out`)
                    writes = plan.writes_given()
                    padded = -(-length // chunk) * chunk
                    made = [(role, (padded, *[sizes[a] for a in axes]), GRAD + node.arg, dtype)
                            for role, node, axes, _, dtype in roles if writes[role]]
                    s = ml.state
                    state_as_is = (plan.heads == tuple(sizes[h] for h in ml.heads)
                                   and list(s.axes) == [*ml.heads, ml.key, ml.value])
                    found = (plan, not plan.copies[6] and mma._base(d_out) == mma._base(cot_out), made, state_as_is)
        if len(self.plans) >= 16:
            self.plans.clear()
        self.plans[key] = found
        return found


_CORES: dict[tuple, ChunkedCore | None] = {}


def chunked_core(program, compute: str = "float32") -> ChunkedCore | None:
    """The chunked runner of `program` where it is a matrix-linear core and SSMC_CUDA_CHUNKED is not
    0, else None: a `rank.RankCore` (R sub-steps a step of a rank-1 core) where its injection has rank R."""
    if options().chunked is False:
        return None
    key = (program, compute)
    if key not in _CORES:
        ml = core_form(program)
        if ml is not None and ml.terms:
            from .rank import RankCore

            _CORES[key] = RankCore(program, compute, ChunkedCore)
        else:
            _CORES[key] = ChunkedCore(program, compute) if ml is not None else None
    return _CORES[key]

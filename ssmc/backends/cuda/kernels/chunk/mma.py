"""The chunked forward and backward on tensor cores (``chunk.cu.j2``): `algorithm.forward`'s result
from two kernels, `algorithm.vjp`'s from four (the earlier split forms: three and five), for 16-bit q, k, v
with fp32 decays and states.

    if kernels_apply(x): out, entering, final = forward(x)      # else algorithm.forward(x)
    dq, dk, dv, d_ell, ds0 = backward(x, entering, final, d_out, d_final)   # where backward_applies

Chunks of 64, 128 or 256 steps (`CHUNKS`; `chunk_for` picks; SSMC_CUDA_CHUNK forces one):

1. ``chunk_states``: per (head, chunk, 64 keys, 64 values), ``Σ_j exp(Γ − Λ_j) β_j k_jᵀ v_j`` (fp32);
2. ``state_pass``: per (head, 4 state entries), the chunks in order: the state entering each chunk, in
   place of the chunk's sum, and the final state (``state_pass_half``, ChunkedCore's calls: the entering
   states in 16 bits, as chunk_output and the backward's chunk_dq read them);
   or, for both (``one_pass``), ``chunk_states_scan``: per (head, 64 keys, 64 values), the chunks in
   order, the state in registers;
3. ``chunk_output``: per (head, chunk, 64 values), ``exp(Λ_i) q_i S_p + Σ_{j≤i} exp(Λ_i − Λ_j)
   β_j (q_i·k_j) v_j``, the scores in registers only.

The staged kernels (``staged.cu.j2``: tiles copied by cp.async as they lie, fragments by ldmatrix) take
steps 1-2 as one, ``chunk_states_pass(_half)`` (per (head, 64 keys, 64 values), the chunks in order, the
state in registers, the next chunk's tiles copied while this one multiplies; the same states bit for bit;
`FUSED_STATES`, SSMC_CUDA_CHUNK_STATES), and step 3 as ``chunk_output*_s`` (the balanced form's sums, bit
for bit; SSMC_CUDA_CHUNK_OUTPUT "staged": 64 values a block, "wide": all V, so that k is staged once).

β (`Chunks.beta`, fp32, SSD's softplus(dt); none: 1) is read by the kernels where v is: v stays the
input as given (no pass writes β v); ``chunk_dv`` also gives β's cotangent, ``Σ_ν dṼ_jν v_jν``.
The skip (`Chunks.skip`, SSD's D) is added by ``chunk_output`` as it writes O (``O_i + skip_i v_i``),
so that O is the program's output; its backward part (`algorithm.skip_grad`) is ``chunk_dv``'s: dv_i
gains ``skip_i dO_i`` as it is stored, and the skip's cotangent ``Σ_ν v_iν dO_iν`` comes with it.

The backward (`backward`): ``chunk_dstates_pass`` (staged.cu.j2; split: ``chunk_dstates`` and
``state_pass_reverse``) gives the cotangent of each chunk's end state (the chunks last first, as the
forward's states; in 16 bits, as chunk_dk and chunk_dv read it), then ``chunk_dq``, ``chunk_dk``,
``chunk_dv`` are ``chunk_output`` with other operands in its roles (dk and dv anti-causal; or dk and dv
from one block a chunk, ``chunk_dkv*`` in staged.cu.j2, the same sums: `dkv_form`, SSMC_CUDA_CHUNK_DKV); the log
decays' cotangent is `algorithm.log_decay_grad`'s from the row dots the kernels take of their fp32
results before they store them (q_i·dq_i, k_i·dk_i: chunk_dq, chunk_dk; the end dots: chunk_dv;
``exp(Γ) ⟨d_end, S_p⟩``: chunk_dstates_pass), so that torch only sums them over each chunk
(`algorithm.reverse_chunk_sums`).

A per-key decay (GLA; `Chunks.per_key`) has kernels of its own (``per_key.cu.j2``): `forward_per_key` (per_key_states,
per_key_output) and `backward_per_key` (per_key_dstates, per_key_dq, per_key_dkv), chunks of
`PER_KEY_CHUNK` steps, where `per_key_applies` (SSMC_CUDA_CHUNK_PER_KEY=0: not).

Heads may broadcast (SSD's B and C lack the head axis r): each operand's offset per head is a table
the kernels read, so no operand is expanded. Under ``SSMC_CUDA_EMULATE=1`` the same launches run on
the CPU (backends/cuda/emulator.py), on CPU tensors.
"""

from __future__ import annotations

import math
from functools import cache

import torch

from ...devices import current_device, emulating, on_backend_device
from ...launch import launch_kernel
from ...options import options
from .. import template
from .algorithm import Chunks, reverse_chunk_sums

CHUNKS = (64, 128, 256)  # steps per chunk the kernels take (chunk_output: a warp per 16 query rows)
# the default: the fp32 chunk states ([K, V] per head and chunk, written, passed and read again) shrink
# as 1/C, the intra-chunk products (≈ C/2 (K + V) per step) grow as C; at K·V ≥ 8192 and C = 64 the states'
# bytes outweigh the operands' (docs/design/matrix-linear-chunks.md, "where step 2 stands")
CHUNK = 128
SHORT = 64               # calls of at most this many steps: one chunk of 64 (less padding)
SIZES = (64, 128)        # key and value sizes they take
# the states by chunk_states_scan (a block per state tile walks the chunks: each state written once)
# in place of chunk_states + state_pass (a block per chunk, then a pass: chunk sums written and read
# again, but NC times the blocks); off until timed (bench/chunk_check.py times both)
ONE_PASS = False
# the states by chunk_states_pass(_half) (staged.cu.j2: chunk_states_scan's walk with cp.async stages, the same
# sums as chunk_states + state_pass) where SSMC_CUDA_CHUNK_STATES is unset; "split" / "fused" choose
FUSED_STATES = True
# chunk_output's form where SSMC_CUDA_CHUNK_OUTPUT is unset, per chunk size (options.CHUNK_OUTPUT's forms)
OUTPUT_FORMS = {64: "warps", 128: "wide", 256: "warps"}
STAGED_SHARED_MAX = 160 * 1024  # "wide" takes all V columns a block where its tiles fit this (sm_80's 163 KiB)
# the backward's dk and dv where SSMC_CUDA_CHUNK_DKV is unset: "split" (chunk_dk, chunk_dv), "fused" (one kernel,
# chunk_dkv* of staged.cu.j2: q, dO and d_end staged once a chunk, a warp all output columns, each score tile made
# once a row stripe; the same sums as chunk_dk and chunk_dv) or "narrow" (chunk_dkv_n*: the same block, 64 output
# columns a warp's pass, each score tile made once a pass, 128 registers: two blocks an SM). The fused forms take
# chunks of `DKV_CHUNKS` (8 warps at most), tiles within `STAGED_SHARED_MAX`, and calls whose k has every head (a
# group's dk summed over its heads stays chunk_dk's); other calls take chunk_dk, chunk_dv
DKV_FORM = "fused"
DKV_CHUNKS = (64, 128)
DKV_BLOCKS = 1  # chunk_dkv's __launch_bounds__ blocks an SM (2: at most 128 registers, it spilled at K = V = 128)
DKV_N_BLOCKS = 2  # chunk_dkv_n's (64 output columns a warp's pass: "narrow")
_modules: dict = {}
_tables: dict = {}


def chunk_for(length: int) -> int:
    """Steps per chunk of a call of `length` steps on the kernels (`CHUNK`; `SHORT` calls take 64)."""
    return CHUNKS[0] if length <= SHORT else CHUNK


@cache
def shared_bytes(key: int, value: int, chunk: int) -> dict[str, int]:
    """Bytes of dynamic shared memory of each kernel of the module of (`key`, `value`) (the 16-bit
    tiles, rows padded by 8 values)."""
    tile, pad = 64, 8
    states = 2 * tile * (chunk + pad) * 2
    product = (chunk * (key + pad) + tile * (chunk + pad) + tile * (key + pad)) * 2
    passing = 2 * 2 * chunk * (tile + pad) * 2  # chunk_states_pass*: two stages of k and v rows [chunk, tile + pad]
    return {"chunk_states": states, "chunk_states_scan": states, "chunk_dstates": states,
            "state_pass": 0, "state_pass_half": 0, "state_pass_reverse": 0,
            "chunk_output": product, "chunk_output_hs": product, "chunk_output_ho": product,
            "chunk_output_hs_ho": product, **{name + "_b": product for name in (
                "chunk_output", "chunk_output_hs", "chunk_output_ho", "chunk_output_hs_ho")},
            "chunk_dq": product, "chunk_dk": product, "chunk_dv": product,
            "chunk_dq_ho": product, "chunk_dk_ho": product, "chunk_dv_ho": product,
            "chunk_states_pass": passing, "chunk_states_pass_half": passing, "chunk_dstates_pass": passing,
            **{name + "_s": staged_bytes(key, value, chunk, staged_block(key, value, chunk, "staged")) for name in (
                "chunk_output", "chunk_output_hs", "chunk_output_ho", "chunk_output_hs_ho")},
            **{name: dkv_bytes(key, value, chunk) for name in ("chunk_dkv", "chunk_dkv_ho", "chunk_dkv_n",
                                                                 "chunk_dkv_n_ho")}}


def staged_bytes(key: int, value: int, chunk: int, vb: int) -> int:
    """Dynamic shared memory of chunk_output*_s with `vb` value columns a block: k rows [chunk, key + 8],
    v rows [chunk, vb + 8], S_p rows [key, vb + 8], 16-bit."""
    return (chunk * (key + 8) + chunk * (vb + 8) + key * (vb + 8)) * 2


def staged_block(key: int, value: int, chunk: int, form: str) -> int:
    """Value columns a block of chunk_output*_s takes in `form` ("staged": 64; "wide": all `value` where the
    tiles fit `STAGED_SHARED_MAX`, else 64)."""
    if form == "wide" and staged_bytes(key, value, chunk, value) <= STAGED_SHARED_MAX:
        return value
    return 64


def dkv_bytes(key: int, value: int, chunk: int) -> int:
    """Dynamic shared memory of chunk_dkv*: q rows [chunk, key + 8], dO rows [chunk, value + 8], d_end rows
    [key, value + 8], 16-bit."""
    return (chunk * (key + 8) + chunk * (value + 8) + key * (value + 8)) * 2


def dkv_fits(key: int, value: int, chunk: int) -> bool:
    """Whether the module of (`key`, `value`, `chunk`) has chunk_dkv* (`DKV_CHUNKS`, its tiles within
    `STAGED_SHARED_MAX`; rendered with staged.cu.j2's kernels)."""
    return chunk in DKV_CHUNKS and dkv_bytes(key, value, chunk) <= STAGED_SHARED_MAX


def dkv_form() -> str:
    """How the backward's dk and dv are made where chunk_dkv* takes the call: "split" (chunk_dk and chunk_dv),
    "fused" (chunk_dkv*) or "narrow" (chunk_dkv_n*) (SSMC_CUDA_CHUNK_DKV, else `DKV_FORM`)."""
    return options().chunk_dkv or DKV_FORM


def fused_states() -> bool:
    """Whether the states pass is one kernel walking the chunks (chunk_states_pass*, the backward's
    chunk_dstates_pass) rather than a kernel per chunk and a pass (SSMC_CUDA_CHUNK_STATES, else `FUSED_STATES`)."""
    return (options().chunk_states or ("fused" if FUSED_STATES else "split")) == "fused"


def module_forms(key: int, value: int, chunk: int, one_pass: bool = False) -> tuple[bool, int, int]:
    """(balanced, vb, staged) of the forward at these sizes (`OUTPUT_FORMS`, the options): chunk_output's balanced
    form or not, the value columns a block of chunk_output*_s (0: not staged), and `source`'s `staged` argument for
    its module. The backward asks for the forward's module (`one_pass` False), so that a training call compiles it
    once; a forward with `one_pass` has a module of its own."""
    form = options().chunk_output or OUTPUT_FORMS.get(chunk, "warps")
    vb = staged_block(key, value, chunk, form) if form in ("staged", "wide") else 0
    return form == "balanced", vb, vb or (64 if fused_states() and not one_pass else 0)


@cache
def source(key: int, value: int, chunk: int, bf16: bool, aligned: bool = False, balanced: bool = False,
           staged: int = 0) -> str:
    """The module of the kernels for these sizes and 16-bit format; `aligned`: q, k, v's head offsets
    and step strides multiples of 8 and their bases 16-byte aligned (the tiles load 16 bytes at a time);
    `balanced`: with the balanced forms of chunk_output (chunk_output*_b; a module of its own, so that
    the default one builds no kernels it does not launch); `staged`: with staged.cu.j2's kernels
    (chunk_states_pass*, the backward's chunk_dstates_pass and chunk_dkv* where `dkv_fits`, and chunk_output*_s
    taking `staged` value columns a block), where not 0."""
    from ...source import mma_header

    shared = shared_bytes(key, value, chunk)
    body = template("chunk/chunk.cu.j2").render(K=key, V=value, C=chunk, bf16=bf16, aligned=aligned,
                                                  balanced_forms=balanced, states_shared=shared["chunk_states"],
                                                  output_shared=shared["chunk_output"])
    if staged:
        fits = dkv_fits(key, value, chunk)
        body += "\n" + template("chunk/staged.cu.j2").render(
            bf16=bf16, vb=staged, staged_shared=staged_bytes(key, value, chunk, staged),
            pass_shared=shared["chunk_states_pass"], dkv_shared=shared["chunk_dkv"] if fits else 0,
            dkv_blocks=DKV_BLOCKS, dkv_n_blocks=DKV_N_BLOCKS)
    return mma_header() + "\n" + body


def _function(text: str, name: str):
    key = (current_device(), text, name)
    fn = _modules.get(key)
    if fn is None:
        if emulating():
            from ...emulator import emulated

            fn = emulated(text, name)
        else:
            import cupy

            from ...source import compile_options

            mkey = (current_device(), text)
            module = _modules.get(mkey)
            if module is None:
                module = _modules[mkey] = cupy.RawModule(code=text, options=compile_options(text))
            fn = module.get_function(name)
        _modules[key] = fn
    return fn


def kernels_wanted(dtype: torch.dtype, key: int, value: int) -> bool:
    """Whether a call with q of `dtype` and these key / value sizes would run on the kernels (the
    chunk size then is theirs)."""
    return (dtype in (torch.bfloat16, torch.float16) and key in SIZES and value in SIZES
            and options().chunk_kernels is not False)


def kernels_apply(x: Chunks) -> bool:
    """Whether `forward` takes `x`: 16-bit q, k, v of one format on the backend's device, fp32 decays
    and initial state, chunks of a size in `CHUNKS`, key and value sizes in `SIZES`."""
    q, k, v = x.q, x.k, x.v
    beta = tuple(b for b in (x.beta, x.skip) if b is not None)
    return (kernels_wanted(q.dtype, q.shape[-1], v.shape[-1]) and k.dtype == q.dtype and v.dtype == q.dtype
            and k.shape[-1] == q.shape[-1] and q.shape[-2] in CHUNKS and x.ell.dtype == torch.float32
            and x.s0.dtype == torch.float32 and all(b.dtype == torch.float32 for b in beta)
            and all(t.numel() > 0 and on_backend_device(t) for t in (q, k, v, x.ell, x.s0, *beta)))


def _chunked_view(t: torch.Tensor, inner: bool) -> torch.Tensor:
    """`t` ([*H, NC, C(, D)]) with a unit stride along D (where `inner`) and the chunk stride C times
    the step stride, the layout the kernels index; a copy only where it is not so already."""
    d = 1 if inner else 0  # trailing axes after the step axis
    step, chunk_stride = t.stride(-1 - d), t.stride(-2 - d)
    ok = (not inner or t.stride(-1) == 1) and (t.shape[-2 - d] == 1 or chunk_stride == t.shape[-1 - d] * step)
    return t if ok else t.contiguous()


def _addresses(arrays, copies, inner) -> tuple[list, list]:
    """(each array's base address, 0 for None, of the array or of its `_chunked_view` where `copies` says; the
    views made), with a unit inner stride for the arrays at positions `inner`."""
    views = [None if a is None else _chunked_view(a, i in inner) if copy else a
             for i, (a, copy) in enumerate(zip(arrays, copies))]
    return [0 if v is None else _base(v) for v in views], views


def _tables_for(heads: tuple[int, ...], arrays, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(offsets [heads, len(arrays)] int64: each array's element offset of a head, its storage offset
    included, repeated along the head axes it lacks; steps [len(arrays)] int64: each array's stride
    between steps), on `device`; and per array whether every offset and the step stride are multiples
    of 8 (bool [len(arrays)], on the host). Cached per layout: a call of a layout seen before copies
    nothing to the device."""
    layouts = tuple((t.shape[:len(heads)], t.stride()[:len(heads)], t.storage_offset(),
                     t.stride(-2) if t.dim() > len(heads) + 2 else t.stride(-1)) for t in arrays)
    key = (heads, layouts, str(device))
    found = _tables.get(key)
    if found is None:
        cols = []
        for shape, strides, base, _ in layouts:
            off = torch.full(heads, base, dtype=torch.int64)
            for d, (n, s) in enumerate(zip(shape, strides)):
                if n != 1:
                    view = [1] * len(heads)
                    view[d] = n
                    off = off + torch.arange(n, dtype=torch.int64).reshape(view) * s
            cols.append(off.reshape(-1))
        steps = torch.tensor([layout[3] for layout in layouts], dtype=torch.int64)
        if len(_tables) >= 256:  # views at ever new storage offsets: keep the cache bounded
            _tables.clear()
        table = torch.stack(cols, 1)
        eights = ((table % 8 == 0).all(0) & (steps % 8 == 0))
        found = _tables[key] = (table.contiguous().to(device), steps.to(device), eights)
    return found


def writable_out(out: torch.Tensor | None, heads, nc: int, chunk: int, value: int,
                 dtypes=(torch.float32,)) -> bool:
    """Whether `forward` can write O into `out`: [*heads, NC, C, V] of one of `dtypes`, the value axis
    contiguous, the chunk stride C step strides, every head's offset and the step stride even (column
    pairs: 8-byte fp32 or 4-byte 16-bit stores)."""
    if out is None or out.dtype not in dtypes or tuple(out.shape) != (*heads, nc, chunk, value):
        return False
    t = len(heads)
    step = out.stride(t + 1)
    return (out.stride(-1) == 1 and (nc == 1 or out.stride(t) == chunk * step) and step % 2 == 0
            and out.storage_offset() % 2 == 0 and all(s % 2 == 0 or n == 1 for n, s in zip(heads, out.stride())))


def forward(x: Chunks, events: list | None = None, out: torch.Tensor | None = None,
            one_pass: bool | None = None, half_states: bool = False, out_dtype: torch.dtype = torch.float32):
    """`algorithm.forward(x)` on the kernels: (O [*H, NC, C, V] fp32, the state entering each chunk
    [*H, NC, K, V] fp32, the final state [*H, K, V] fp32), H the heads of all operands broadcast.
    `out`: where `writable_out`, O is written there (a view of the program's time-first output, say)
    and returned; else into a new array. `one_pass`: the states by chunk_states_scan (default
    `ONE_PASS`); else by chunk_states_pass* (`FUSED_STATES`, SSMC_CUDA_CHUNK_STATES=fused) or chunk_states
    and state_pass*. `half_states` (ChunkedCore's calls, with a tape or not): the entering states are passed
    to chunk_output in q's 16 bits (state_pass_half or chunk_states_pass_half; chunk_output rounds them so
    either way: the same output, half the bytes written and read) and returned so; not with `one_pass`.
    `out_dtype`: O in fp32 or in q's 16-bit dtype (rounded once from the fp32 sums); `out` of either dtype is taken.
    `events`: where a list (on a GPU), each launch appends (kernel name, CUDA start event, end event),
    recorded around it on the current stream (bench/chunk_check.py times the kernels with them)."""
    plan = ForwardPlan(x, out, one_pass, half_states, out_dtype)
    addresses, kept = plan.addresses(x)
    result = plan.launch(addresses, x.s0, out if plan.out_given else None, events)
    del kept  # the copies the kernels read: alive until the launches are queued
    return result


# the arrays whose addresses a launch takes per call (`ForwardPlan`, `BackwardPlan`): slots of a list made per
# call; every other argument (an offset table's address, 0 for an operand absent) is fixed by the layouts
_Q, _K, _V, _ELL, _BETA, _SKIP, _OUT, _S0, _ENTERING, _FINAL, _STATES, _GAMMA = range(12)


class _Slot(int):
    """A launch argument filled per call: the address in slot `int(self)` of the call's list."""


def _launch_specs(text: str, launches, shared: dict, nc: int, chunk: int) -> list[tuple]:
    """Per launch (name, its function, blocks, threads, length, nblk, shared bytes, its fixed arguments with 0
    where a slot goes, (position, slot) of each slot)."""
    specs = []
    for launch in launches:
        name, blocks, threads, pointers = launch[:4]
        length = launch[4] if len(launch) > 4 else nc * chunk
        fixed = [0 if isinstance(p, _Slot) else p for p in pointers]
        fills = tuple((i, int(p)) for i, p in enumerate(pointers) if isinstance(p, _Slot))
        specs.append((name, _function(text, name), blocks, threads, length, nc, shared[name], fixed, fills))
    return specs


def _run_specs(specs: list[tuple], values: list, events: list | None) -> None:
    """Launch `specs` (`_launch_specs`) with the call's addresses `values` in their slots."""
    for name, fn, blocks, threads, length, nblk, shared, fixed, fills in specs:
        pointers = list(fixed)
        for i, slot in fills:
            pointers[i] = values[slot]
        _launch(fn, name, blocks, threads, length, nblk, pointers, shared, events)


class ForwardPlan:
    """What `forward` works out from the layouts of its arrays alone (their shapes, strides, storage offsets
    and dtypes, whether q's, k's and v's bases are 16-byte aligned, the options): the arrays it makes, the
    module, each launch and its arguments, the offset tables (kept alive here). A call of the same layouts
    then only makes the arrays and launches (`launch`): ChunkedCore's prepared calls keep one per signature.
    As a plain loop, `launch` is

        out, entering, final (and the split path's states, gamma) = torch.empty(shape, dtype) each
        for kernel, grid, arguments in launches: kernel<<<grid>>>(the call's addresses in their slots)
    """

    def __init__(self, x: Chunks, out: torch.Tensor | None = None, one_pass: bool | None = None,
                 half_states: bool = False, out_dtype: torch.dtype = torch.float32):
        q = _chunked_view(x.q, True)
        k = _chunked_view(x.k, True)
        v = _chunked_view(x.v, True)
        ell = _chunked_view(x.ell, False)
        beta = None if x.beta is None else _chunked_view(x.beta, False)
        skip = None if x.skip is None else _chunked_view(x.skip, False)
        # where `_chunked_view` copies, the call's addresses are the copies' (`addresses`)
        self.copies = tuple(a is not b for a, b in ((q, x.q), (k, x.k), (v, x.v), (ell, x.ell), (beta, x.beta),
                                                     (skip, x.skip)))
        t = q.dim() - 3
        heads = _broadcast(q.shape[:t], k.shape[:t], v.shape[:t], ell.shape[:t], x.s0.shape[:t],
                           *[b.shape[:t] for b in (x.beta, x.skip) if b is not None])
        nh = math.prod(heads)
        nc, chunk, key, value = q.shape[-3], q.shape[-2], q.shape[-1], v.shape[-1]
        self.device = dev = q.device
        if out_dtype not in (torch.float32, q.dtype):
            raise ValueError(f"the kernels write O in fp32 or in q's {q.dtype}, not {out_dtype}")
        self.out_given = writable_out(out, heads, nc, chunk, value, (torch.float32, q.dtype))
        if not self.out_given:  # (its layout: `launch` makes it)
            out = torch.empty((*heads, nc, chunk, value), dtype=out_dtype, device="meta")
        self.out_shape, self.out_dtype = out.shape, out.dtype
        # no extra: v again; no β: ell in its column (not read)
        self.tables = offs, steps, aligned_rows = _tables_for(
            heads, (q, k, v, ell, out, v, ell if beta is None else beta, ell if skip is None else skip), dev)
        beta_ptr = 0 if beta is None else _Slot(_BETA)
        self.heads, self.key, self.value = heads, key, value
        self.s0_as_is = x.s0.shape == (*heads, key, value) and x.s0.is_contiguous()
        self.final_shape = (*heads, key, value)
        self.aligned = aligned = bool(aligned_rows[:3].all()) and all(_base(a) % 16 == 0 for a in (q, k, v))
        # chunk_output's form (`OUTPUT_FORMS`): *_b, half the warps, two row stripes each (the same causal work a
        # warp); *_s, the same sums from tiles staged by cp.async and read by ldmatrix
        fused = fused_states()
        one_pass = ONE_PASS if one_pass is None else one_pass
        balanced, vb, staged = module_forms(key, value, chunk, one_pass)
        text = source(key, value, chunk, q.dtype == torch.bfloat16, aligned, balanced, staged)
        shared = dict(shared_bytes(key, value, chunk))

        tiles = (key // 64) * (value // 64)
        state_args = [_Slot(_K), _Slot(_V), _Slot(_ELL), beta_ptr, offs.data_ptr(), steps.data_ptr(), _Slot(_S0),
                      _Slot(_ENTERING), _Slot(_FINAL)]
        self.states_shape = None  # the split path's fp32 chunk sums and gamma, made per call
        if one_pass:
            self.entering = ((*heads, nc, key, value), torch.float32)
            launches = [("chunk_states_scan", nh * tiles, 128, state_args)]
        elif fused:  # the entering states written once, in 16 bits where half_states
            self.entering = ((*heads, nc, key, value), q.dtype if half_states else torch.float32)
            launches = [("chunk_states_pass" + ("_half" if half_states else ""), nh * tiles, 128, state_args)]
        else:
            self.states_shape = ((*heads, nc, key, value), (*heads, nc))
            launches = [
                ("chunk_states", nh * nc * tiles, 128,
                 [_Slot(_K), _Slot(_V), _Slot(_ELL), beta_ptr, offs.data_ptr(), steps.data_ptr(), _Slot(_STATES),
                  _Slot(_GAMMA)]),
            ]
            if half_states:
                self.entering = ((*heads, nc, key, value), q.dtype)
                launches.append(("state_pass_half", nh * key * value // 1024, 256,
                                 [_Slot(_GAMMA), _Slot(_S0), _Slot(_STATES), _Slot(_ENTERING), _Slot(_FINAL)]))
            else:  # the entering states are the chunk sums, passed in place
                self.entering = None
                launches.append(("state_pass", nh * key * value // 1024, 256,
                                 [_Slot(_GAMMA), _Slot(_S0), _Slot(_STATES), _Slot(_FINAL)]))
        entering_dtype = torch.float32 if self.entering is None else self.entering[1]
        output = "chunk_output" + ("_hs" if entering_dtype != torch.float32 else "") + (
            "_ho" if out.dtype != torch.float32 else "") + ("_b" if balanced else "_s" if vb else "")
        # blocks: per (head, chunk, 64 values), or per vb values (*_s); threads: a warp per 16 rows (*_b: two),
        # *_s a warp per two row stripes and 64 values
        blocks, threads = (nh * nc * (value // vb), chunk * vb // 64) if vb else (
            nh * nc * (value // 64), chunk if balanced else 2 * chunk)
        if vb:
            shared[output] = staged_bytes(key, value, chunk, vb)
        launches += [
            (output, blocks, threads,
             [_Slot(_Q), _Slot(_K), _Slot(_V), _Slot(_ELL), beta_ptr, 0 if skip is None else _Slot(_SKIP),
              offs.data_ptr(), steps.data_ptr(), _Slot(_ENTERING), _Slot(_OUT)]),
        ]
        self.specs = _launch_specs(text, launches, shared, nc, chunk)

    def addresses(self, x: Chunks) -> tuple[list, list]:
        """(the call's list of addresses (slots `_Q` .. `_SKIP`) of `x` laid out as the plan's, the copies made
        for that: the caller keeps them until the launches are queued, or their memory is another array's)."""
        return _addresses((x.q, x.k, x.v, x.ell, x.beta, x.skip), self.copies, (0, 1, 2))

    def launch(self, values: list, s0: torch.Tensor, out: torch.Tensor | None = None, events: list | None = None):
        """(O, entering states, final state) as `forward` returns them, from the call's addresses `values` (of
        q, k, v, ell, beta, skip: `addresses`; the list is extended), its initial state `s0` and, where the plan
        was made with one (`out_given`), `out` laid out as then."""
        dev = self.device
        if out is None:
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=dev)
        if not self.s0_as_is:
            s0 = s0.expand(self.final_shape).contiguous()
        final = torch.empty(self.final_shape, dtype=torch.float32, device=dev)
        states = gamma = None
        if self.states_shape is not None:
            states = torch.empty(self.states_shape[0], dtype=torch.float32, device=dev)
            gamma = torch.empty(self.states_shape[1], dtype=torch.float32, device=dev)
        entering = states if self.entering is None else torch.empty(self.entering[0], dtype=self.entering[1],
                                                                    device=dev)
        values += [_base(out), s0.data_ptr(), entering.data_ptr(), final.data_ptr(),
                   0 if states is None else states.data_ptr(), 0 if gamma is None else gamma.data_ptr()]
        _run_specs(self.specs, values, events)
        return out, entering, final


@cache
def _broadcast(*shapes) -> tuple[int, ...]:
    """`torch.broadcast_shapes` of `shapes`, once per shapes (it costs host time a call)."""
    return tuple(torch.broadcast_shapes(*shapes))


def _base(a: torch.Tensor) -> int:
    """The address of `a`'s storage (its storage offset goes into the offset tables)."""
    return a.data_ptr() - a.storage_offset() * a.element_size()


def _launch(fn, name: str, blocks: int, threads: int, length: int, nblk: int, pointers, shared: int,
            events: list | None) -> None:
    """Launch kernel `name` (its function `fn`) with (length, nblk), timed into `events` where a list."""
    timing = events is not None and not emulating()
    if timing:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    launch_kernel(fn, (blocks, threads), length, nblk, pointers, shared=shared)
    if timing:
        end.record()
        events.append((name, start, end))


# chunk_dq / chunk_dk sum dq (dk) over the heads q (k) lacks in the kernels (SSD's r heads of a group) rather
# than writing it per head (r times the bytes: 256 MiB each at B4 L4096 H32 N128, against 8 summed): a block set
# loops over `per` of a group's heads, in order. All r in one set leaves few blocks (B·G·NC·K/64: 256 at that
# shape, for 132 SMs holding two such blocks each: one partial wave); so the heads are split into r / per subsets,
# each its own partial sum ([.., subsets, NC, C, K], summed by one reduction after), per the most heads that still give
# at least BLOCKS_PER_SM blocks an SM: several waves of blocks, so that the last one's tail costs little
BLOCKS_PER_SM = 6


def _heads_summed(operand: tuple[int, ...], heads: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """(r, the operand's head shape) where the operand's heads are `heads` but for a trailing block of r > 1
    it lacks (SSD's B, C: [b, g, 1] of [b, g, r]): the kernels sum its gradient over those; else (1, heads)."""
    m = len(heads)
    while m > 0 and operand[m - 1] == 1:
        m -= 1
    r = math.prod(heads[m:])
    if r == 1 or tuple(operand[:m]) != tuple(heads[:m]):
        return 1, heads
    return r, (*heads[:m], *[1] * (len(heads) - m))


def _heads_a_block(r: int, blocks_a_head: int, sets: int) -> int:
    """The heads a block set of chunk_dq / chunk_dk sums (a divisor of r): the most whose grid, `sets` · r /
    per sets of `blocks_a_head` blocks, still gives `BLOCKS_PER_SM` blocks to each SM."""
    want = BLOCKS_PER_SM * options().sm_count
    for per in sorted((d for d in range(1, r + 1) if r % d == 0), reverse=True):
        if sets * (r // per) * blocks_a_head >= want:
            return per
    return 1


def backward_applies(x: Chunks, d_out: torch.Tensor) -> bool:
    """Whether `backward` takes `x` (as `kernels_apply`, SSMC_CUDA_CHUNK_BACKWARD not 0) with `d_out`
    in q's dtype and shape [*H, NC, C, V]."""
    return (kernels_apply(x) and options().chunk_backward is not False and d_out.dtype == x.q.dtype
            and tuple(d_out.shape[-3:]) == (*x.q.shape[-3:-1], x.v.shape[-1]) and on_backend_device(d_out))


def backward(x: Chunks, entering: torch.Tensor, final: torch.Tensor, d_out: torch.Tensor, d_final: torch.Tensor,
             events: list | None = None, parts: dict | None = None, outs: dict | None = None,
             heads_a_block: int | None = None, plans: dict | None = None):
    """`algorithm.vjp` on the kernels: (dq [*Hq, NC, C, K], dk [*Hk, NC, C, K], dv [*H, NC, C, V], dell
    [*H, NC, C], ds0 [*H, K, V], dbeta and dskip [*H, NC, C] or None where `x` has no β, no skip), all
    fp32 (but a 16-bit array of `outs`) over every head H (the caller sums them over the heads an operand
    lacks), but dq and dk, which the kernels sum over a trailing block of heads q (k) lacks (SSD's C, B:
    Hq = [b, g, 1] of H = [b, g, r]; `_heads_summed`), in their order: Hq is H with 1 there (else Hq = H).
    `heads_a_block`: the heads a block of chunk_dq / chunk_dk sums (a divisor of r; tests force it), default
    `_heads_a_block`'s. From what `forward` returned (entering [*H, NC, K, V], final [*H, K, V]), d_out
    [*H', NC, C, V] in q's 16-bit dtype (the output's cotangent rounded, as the peers round it) and
    d_final [*H', K, V] fp32. `events` as `forward`'s. `outs`: {"dq" / "dk" / "dv": array, or a function
    that makes it, called as the kernel that writes it is launched (so that it is not live before)}, each
    written there where `writable_out` (a view of a time-first gradient, say) and returned: fp32, or q's 16-bit
    dtype (the fp32 sums rounded once as stored, the values a cast of the fp32 gradient gives: chunk_d*_ho; dq and
    dk so only where the kernels sum no heads into them; the row dots, end dots, dbeta and dskip still of the
    fp32 values).
    `parts`: where a dict, it receives the kernels' side outputs the log decays' cotangent is made of
    (tests read them): "rows" [*H, NC, C, 2 K/64] (q_i·dq_i over each key tile, then −k_i·dk_i),
    "ends" [*H, NC, C, V/64], "entered" [*H, NC, KV/1024] (KV/128 where the states are split: per warp of
    chunk_dstates_pass (state_pass_reverse), exp(Γ) ⟨d_end, S_p⟩'s parts, of the fp32 d_end and the 16-bit S_p)
    and "d_end" [*H, NC, K, V] (16-bit).
    `plans`: where a dict, the `BackwardPlan`s of calls whose arrays (`outs`' too) have the same shapes, strides
    and dtypes (a caller's signature), kept there per storage offsets and alignment."""
    if plans is None:
        plan = BackwardPlan(x, entering, d_out, outs or {}, heads_a_block)
        addresses, kept = plan.addresses(x, d_out)
        result = plan.launch(addresses, entering, d_final, outs or {}, events, parts)
        del kept  # the copies the kernels read: alive until the launches are queued
        return result
    # the plans of calls alike (ChunkedCore's prepared backward): per layout of the arrays' memory, the rest of
    # their layouts being the caller's signature's
    arrays = (x.q, x.k, x.v, x.ell, x.beta, x.skip, d_out)
    bases = [0 if a is None else _base(a) for a in arrays]
    key = (*(None if a is None else a.storage_offset() for a in arrays),
           (bases[0] | bases[1] | bases[2] | bases[6]) % 16 == 0, heads_a_block,
           *((n, getattr(a, "dtype", None)) for n, a in sorted((outs or {}).items())))  # (fp32 or 16-bit outs)
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= 16:
            plans.clear()
        plan = plans[key] = BackwardPlan(x, entering, d_out, outs or {}, heads_a_block)
    addresses, kept = plan.addresses(x, d_out) if any(plan.copies) else (bases, None)
    result = plan.launch(addresses, entering, d_final, outs or {}, events, parts)
    del kept  # the copies the kernels read: alive until the launches are queued
    return result


# the backward's per-call slots past the operands' (`_Q` .. `_SKIP`, then d_out)
(_DO, _B_ENTERING, _B_DFINAL, _SUMS, _DEND, _DS0, _B_GAMMA, _ROWS, _ENDS, _ENTERED, _DBETA, _DSKIP,
 _DQ, _DK, _DV) = range(6, 21)


class BackwardPlan:
    """What `backward` works out from the layouts of its arrays alone (as `ForwardPlan`): the arrays it makes, the
    modules, each launch and its arguments, how dq and dk are summed over the heads q and k lack; `launch` makes the
    arrays (each as late as the kernel that writes it) and launches, as `backward` did a call."""

    def __init__(self, x: Chunks, entering: torch.Tensor, d_out: torch.Tensor, outs: dict,
                 heads_a_block: int | None = None):
        q = _chunked_view(x.q, True)
        k = _chunked_view(x.k, True)
        v = _chunked_view(x.v, True)
        do = _chunked_view(d_out, True)
        ell = _chunked_view(x.ell, False)
        beta = None if x.beta is None else _chunked_view(x.beta, False)
        skip = None if x.skip is None else _chunked_view(x.skip, False)
        self.copies = tuple(a is not b for a, b in ((q, x.q), (k, x.k), (v, x.v), (ell, x.ell), (beta, x.beta),
                                                     (skip, x.skip), (do, d_out)))
        beta_col, beta_ptr = (ell, 0) if beta is None else (beta, _Slot(_BETA))
        skip_col, skip_ptr = (ell, 0) if skip is None else (skip, _Slot(_SKIP))
        self.t = t = q.dim() - 3
        self.heads = heads = tuple(entering.shape[:t])
        nh = math.prod(heads)
        self.nc, self.chunk, self.key, self.value = nc, chunk, key, value = (q.shape[-3], q.shape[-2], q.shape[-1],
                                                                               v.shape[-1])
        self.device = dev = q.device
        self.dtype = q.dtype
        self.state_shape = (*heads, key, value)
        self.beta, self.skip = beta is not None, skip is not None
        bf16 = q.dtype == torch.bfloat16
        _, _, eights = _tables_for(heads, (q, k, v, do), dev)
        aligned = bool(eights.all()) and all(_base(a) % 16 == 0 for a in (q, k, v, do))
        self.fused = fused_states()
        balanced, _, staged = module_forms(key, value, chunk)
        kv = source(key, value, chunk, bf16, aligned, balanced, staged)  # the forward's module: the states, dv
        vk = source(value, key, chunk, bf16, aligned)   # contractions over V: dq, dk
        self.tables = []  # kept alive with the plan

        def table(*arrays):
            offs, steps, _ = found = _tables_for(heads, arrays, dev)
            self.tables.append(found)
            return offs.data_ptr(), steps.data_ptr()

        def spec(text, name, blocks, threads, ck, cv, pointers, length=None):
            shared = {name: shared_bytes(ck, cv, chunk)[name]}
            launch = (name, blocks, threads, pointers) + (() if length is None else (length,))
            return _launch_specs(text, [launch], shared, nc, chunk)

        def made(shape, dtype=torch.float32):  # an array laid out as the call's will be (its table's column)
            return torch.empty(shape, dtype=dtype, device="meta")

        # `outs`' arrays, whose layouts the plan reads: of no memory where they say how (`like`: made as late as
        # their kernels, by `launch`), else made now where they are functions
        given = {}
        for name in ("dq", "dk", "dv"):
            a = outs.get(name)
            like = getattr(a, "like", None)
            given[name] = like() if like is not None else a() if callable(a) else a
        tiles = (key // 64) * (value // 64)
        # the table's columns are (q, k, v, ell, out, extra, beta, skip) of chunk_output's roles
        if self.fused:  # one walk of the chunks, last first: no fp32 chunk sums in memory
            self.states = spec(kv, "chunk_dstates_pass", nh * tiles, 128, key, value,
                               [_Slot(_Q), _Slot(_DO), _Slot(_ELL), *table(q, q, do, ell, q, q, ell, ell),
                                _Slot(_B_DFINAL), _Slot(_DEND), _Slot(_DS0), _Slot(_B_ENTERING), _Slot(_ENTERED)])
        else:  # each chunk's sum (a block each), then the pass over them
            self.states = spec(kv, "chunk_dstates", nh * nc * tiles, 128, key, value,
                               [_Slot(_Q), _Slot(_DO), _Slot(_ELL), *table(q, q, do, ell, q, q, ell, ell),
                                _Slot(_SUMS), _Slot(_B_GAMMA)]) + spec(
                kv, "state_pass_reverse", nh * key * value // 1024, 256, key, value,
                [_Slot(_B_GAMMA), _Slot(_B_DFINAL), _Slot(_SUMS), _Slot(_DEND), _Slot(_DS0), _Slot(_B_ENTERING),
                 _Slot(_ENTERED)])
        # dk and dv by chunk_dkv* or chunk_dkv_n* (`dkv_form`) where the module has them, k has every head and both
        # arrays are fp32 or both 16-bit (the kernels' two forms); its spec in `dkv`, (dk given, dv given) in
        # `dkv_given`
        self.dkv = self.dkv_given = None
        form = dkv_form()
        if (form != "split" and staged and dkv_fits(key, value, chunk)
                and _heads_summed(tuple(k.shape[:t]), heads)[0] == 1):
            f32, types = torch.float32, (torch.float32, self.dtype)
            dk_a, dv_a = given["dk"], given["dv"]
            dk_given = writable_out(dk_a, heads, nc, chunk, key, types)
            dv_given = writable_out(dv_a, heads, nc, chunk, value, types)
            dk_out = dk_a if dk_given else made((*heads, nc, chunk, key))
            dv_out = dv_a if dv_given else made((*heads, nc, chunk, value))
            if (dk_out.dtype == f32) == (dv_out.dtype == f32):
                self.dkv_given = (dk_given, dv_given)
                name = "chunk_dkv" + ("_n" if form == "narrow" else "") + ("" if dk_out.dtype == f32 else "_ho")
                self.dkv = spec(kv, name, nh * nc, 2 * chunk, key, value,
                                [_Slot(_Q), _Slot(_K), _Slot(_V), _Slot(_DO), _Slot(_ELL), beta_ptr, skip_ptr,
                                 *table(q, k, v, ell, dv_out, do, beta_col, skip_col), *table(dk_out),
                                 _Slot(_DEND), _Slot(_DK), _Slot(_DV), _Slot(_ROWS), _Slot(_ENDS), _Slot(_DBETA),
                                 _Slot(_DSKIP)])
        self.summed = {}
        for name, operand, roles, slots, state in (("dq", q, (do, v, k), (_DO, _V, _K), _B_ENTERING),
                                                   ("dk", k, (v, do, q), (_V, _DO, _Q), _DEND)):
            if name == "dk" and self.dkv is not None:
                continue
            r, shape = _heads_summed(tuple(operand.shape[:t]), heads)
            per = 1 if r == 1 else heads_a_block or _heads_a_block(r, nc * (key // 64), nh // r)
            if r % per or per >= 1 << 16 or r // per >= 1 << 15:
                raise ValueError(f"{per} heads a block do not divide the {r} summed")
            a = given[name]
            half = False  # (a 16-bit `outs` array: the kernel that rounds as it stores, a head a block alone)
            if r == 1:  # where `outs` has a place the kernels can write, there
                how = "given" if writable_out(a, heads, nc, chunk, key, (torch.float32, self.dtype)) else "new"
                half = how == "given" and a.dtype != torch.float32
                out = a if how == "given" else made((*heads, nc, chunk, key))
                out_shape = (*heads, nc, chunk, key)
            elif r == per and writable_out(a, shape, nc, chunk, key):
                how, out, out_shape = "given", a, None
            else:  # [*Hq, subsets, NC, C, K]; the kernels' out: subset 0, the others NC·C·K elements apart each
                how, out_shape = ("sums" if r != per else "new_sums"), (*shape, r // per, nc, chunk, key)
                out = made(out_shape).select(t, 0)
            ra, rb, rw = roles
            self.summed[name] = (how, out_shape, r // per, spec(
                vk, f"chunk_{name}" + ("_ho" if half else ""), nh // per * nc * (key // 64), 2 * chunk, value, key,
                [_Slot(slots[0]), _Slot(slots[1]), _Slot(slots[2]), _Slot(_ELL), beta_ptr, 0,
                 *table(ra, rb, rw, ell, out, operand, beta_col, ell), _Slot(state),
                 _Slot(_DQ if name == "dq" else _DK), _Slot(_Q if name == "dq" else _K), _Slot(_ROWS)],
                (r // per) << 16 | per))
        self.dv = self.dv_given = None
        if self.dkv is None:
            dv = given["dv"]
            self.dv_given = writable_out(dv, heads, nc, chunk, value, (torch.float32, self.dtype))
            if not self.dv_given:
                dv = made((*heads, nc, chunk, value))
            half = dv.dtype != torch.float32  # chunk_dv_ho: dv rounded to 16 bits as stored
            self.dv = spec(kv, "chunk_dv" + ("_ho" if half else ""), nh * nc * (value // 64), 2 * chunk, key, value,
                           [_Slot(_K), _Slot(_Q), _Slot(_DO), _Slot(_ELL), beta_ptr, skip_ptr,
                            *table(k, q, do, ell, dv, v, beta_col, skip_col), _Slot(_DEND), _Slot(_DV), _Slot(_V),
                            _Slot(_ENDS), _Slot(_DBETA), _Slot(_DSKIP)])

    def writes_given(self) -> dict[str, bool]:
        """Which of dq, dk, dv the kernels write into the arrays given as `direct` (the rest are made here)."""
        dk, dv = self.dkv_given if self.dkv is not None else (self.summed["dk"][0] == "given", self.dv_given)
        return {"dq": self.summed["dq"][0] == "given", "dk": bool(dk), "dv": bool(dv)}

    def addresses(self, x: Chunks, d_out: torch.Tensor) -> tuple[list, list]:
        """(the call's addresses (slots `_Q` .. `_SKIP`, `_DO`) of `x` and `d_out` laid out as the plan's, the
        copies made for that: `ForwardPlan.addresses`)."""
        return _addresses((x.q, x.k, x.v, x.ell, x.beta, x.skip, d_out), self.copies, (0, 1, 2, 6))

    def launch(self, values: list, entering: torch.Tensor, d_final: torch.Tensor, outs: dict,
               events: list | None = None, parts: dict | None = None):
        """`backward`'s result from the call's addresses `values` (`addresses`; the list is extended), the
        forward's entering states, d_final and `outs` (as `backward` takes them, laid out as the plan's)."""
        heads, nc, chunk, key, value = self.heads, self.nc, self.chunk, self.key, self.value
        dev, t = self.device, self.t
        f32 = torch.float32
        # the states in q's 16 bits, as chunk_dq reads them rounded (forward's half_states gives them so; fp32
        # ones are rounded here) and the reverse states pass takes ⟨d_end, S_p⟩ with
        if entering.dtype != self.dtype or not entering.is_contiguous():
            entering = entering.to(self.dtype).contiguous()
        if d_final.dtype != f32 or d_final.shape != self.state_shape or not d_final.is_contiguous():
            d_final = d_final.to(f32).expand(self.state_shape).contiguous()
        # the cotangent of each chunk's end state in 16 bits (chunk_dk and chunk_dv read it rounded either way):
        # chunk_dstates_pass, or each chunk's Σ_i exp(Λ_i) q_iᵀ dO_i (chunk_dstates) and state_pass_reverse's walk
        # over them (the fp32 sums freed before chunk_dq's arrays are made)
        sums = gamma = None
        if not self.fused:
            sums = torch.empty((*heads, nc, key, value), dtype=f32, device=dev)
            gamma = torch.empty((*heads, nc), dtype=f32, device=dev)
        d_end = torch.empty((*heads, nc, key, value), dtype=self.dtype, device=dev)
        ds0 = torch.empty((*heads, key, value), dtype=f32, device=dev)
        # the kernels' side outputs, per key or value tile (summed below): q·dq and −k·dk (chunk_dq, chunk_dk),
        # the end dots, β's and the skip's cotangents (chunk_dv); ⟨d_end, S_p⟩ per warp (of a 64 x 64 tile's 16
        # rows: chunk_dstates_pass; of 128 entries: state_pass_reverse)
        rows = torch.empty((*heads, nc, chunk, 2 * (key // 64)), dtype=f32, device=dev)
        ends = torch.empty((*heads, nc, chunk, value // 64), dtype=f32, device=dev)
        entered = torch.empty((*heads, nc, key * value // (1024 if self.fused else 128)), dtype=f32, device=dev)
        d_beta = torch.empty_like(ends) if self.beta else None
        d_skip = torch.empty_like(ends) if self.skip else None
        values += [entering.data_ptr(), d_final.data_ptr(), 0 if sums is None else sums.data_ptr(),
                   d_end.data_ptr(), ds0.data_ptr(), 0 if gamma is None else gamma.data_ptr(), rows.data_ptr(),
                   ends.data_ptr(), entered.data_ptr(), 0 if d_beta is None else d_beta.data_ptr(),
                   0 if d_skip is None else d_skip.data_ptr(), 0, 0, 0]
        _run_specs(self.states, values, events)
        del sums, gamma, d_final  # (d_final: a contiguous fp32 copy where it was not one, read by that pass alone)

        def given(name):  # `outs`' array, made now where it is a function (as late as the kernel that writes it)
            a = outs.get(name)
            return a() if callable(a) else a

        grads = {}
        for name, slot in (("dq", _DQ), ("dk", _DK)):
            if name not in self.summed:
                continue
            how, shape, _, spec = self.summed[name]
            sums = None
            if how == "given":
                out = given(name)
            elif how == "new":
                out = torch.empty(shape, dtype=f32, device=dev)
            else:
                sums = torch.empty(shape, dtype=f32, device=dev)
                out = sums.select(t, 0)
            values[slot] = _base(out)
            _run_specs(spec, values, events)
            if how == "sums":  # the subsets' partial sums by one reduction (a loop of adds: 2 r / per torch calls)
                out = sums.sum(t)
                sums = None  # freed now, not live at the next kernels' arrays (nor at the function's end)
            grads[name] = out
        if self.dkv is not None:  # chunk_dkv*: dk and dv (and their dots) from one launch, after chunk_dq's
            shapes = ((*heads, nc, chunk, key), (*heads, nc, chunk, value))
            for name, slot, made_given, shape in zip(("dk", "dv"), (_DK, _DV), self.dkv_given, shapes):
                grads[name] = given(name) if made_given else torch.empty(shape, dtype=f32, device=dev)
                values[slot] = _base(grads[name])
            _run_specs(self.dkv, values, events)
            dv = grads["dv"]
        row_dots = rows.sum(-1)  # (chunk_dq's and chunk_dk's (dkv's) alone: summed before chunk_dv's arrays are made)
        if parts is not None:
            parts["rows"] = rows
        del rows
        if self.dkv is None:
            dv = given("dv") if self.dv_given else torch.empty((*heads, nc, chunk, value), dtype=f32, device=dev)
            values[_DV] = _base(dv)
            _run_specs(self.dv, values, events)
        if parts is not None:
            parts.update(ends=ends, entered=entered, d_end=d_end)
        del d_end  # (read by chunk_dk and chunk_dv alone) not live at the sums below, nor at the stages after
        d_ell = reverse_chunk_sums(row_dots, ends.sum((-1, -2)) + entered.sum(-1))

        def tiles_summed(a):  # [.., V/64] -> [..]: a view where there is one tile
            return None if a is None else a[..., 0] if a.shape[-1] == 1 else a.sum(-1)

        # the skip's part (o + skip v: dv gains skip dO, the skip Σ_ν v dO) is chunk_dv's, from the 16-bit dO
        return grads["dq"], grads["dk"], dv, d_ell, ds0, tiles_summed(d_beta), tiles_summed(d_skip)


# -- a per-key decay (GLA; per_key.cu.j2) ---------------------------------------------------------------------------
PER_KEY_CHUNK = 64  # steps per chunk of the per-key kernels (a warp per query sub-block of `algorithm.SUB` steps)


def per_key_states_shared() -> int:
    """Dynamic shared memory of per_key_states and per_key_dstates: two stages of the a, b rows [C, 72] (16-bit) and
    ell [C, 64] (fp32) of a 64 x 64 state tile."""
    c, pad, tile = PER_KEY_CHUNK, 8, 64
    return 2 * (2 * c * (tile + pad) * 2 + c * tile * 4)


def per_key_shared(key: int, value: int) -> int:
    """Dynamic shared memory of per_key_output: Λ [C, key + 4] fp32, later S_p rows [key, value + 8] 16-bit in its
    place; the anchors' factors [14, key] and the diagonal sub-blocks' scores [4, 16, 16] fp32; q, k rows [C, key + 8],
    v rows [C, value + 8], 16-bit."""
    c, pad = PER_KEY_CHUNK, 8
    lam = max(c * (key + 4) * 4, key * (value + pad) * 2)
    return lam + (14 * key + 4 * 16 * 16) * 4 + (2 * c * (key + pad) + c * (value + pad)) * 2


def per_key_threads(value: int) -> int:
    """Threads of a per_key_output block: four warps (one a query sub-block) per 64 value columns."""
    return 128 * (value // 64)


def per_key_dq_shared(key: int, value: int) -> int:
    """Dynamic shared memory of per_key_dq: Λ [C, key + 4], the anchors' factors [14, key] and dA's diagonal
    sub-blocks [4, 16, 16] fp32; k rows [C, key + 8], v, dO rows [C, value + 8] and S_p rows [key, value + 8],
    16-bit."""
    c, pad = PER_KEY_CHUNK, 8
    return (c * (key + 4) + 14 * key + 4 * 16 * 16) * 4 + (c * (key + pad) + (2 * c + key) * (value + pad)) * 2


def per_key_dkv_shared(key: int, value: int) -> int:
    """Dynamic shared memory of per_key_dkv: Λ [C, key + 4], the anchors' factors [14, key], A's and dA's diagonal
    sub-blocks [2, 4, 16, 16] fp32; q, k rows [C, key + 8], v, dO rows [C, value + 8], d_end rows [key, value + 8],
    16-bit."""
    c, pad = PER_KEY_CHUNK, 8
    return (c * (key + 4) + 14 * key + 2 * 4 * 16 * 16) * 4 + (2 * c * (key + pad) + (2 * c + key) * (value + pad)) * 2


def per_key_backward_shared(key: int, value: int) -> int:
    """The most dynamic shared memory a block of the per-key backward takes (per_key_dq's, per_key_dkv's)."""
    return max(per_key_dq_shared(key, value), per_key_dkv_shared(key, value))


def per_key_backward_threads(key: int, value: int) -> int:
    """Threads of a per_key_dq / per_key_dkv block: four warps (one a sub-block) per 64 of the larger size's columns."""
    return 128 * (max(key, value) // 64)


@cache
def per_key_source(key: int, value: int, bf16: bool) -> str:
    """The module of the per-key kernels (per_key_states, per_key_output; the backward's per_key_dstates, per_key_dq,
    per_key_dkv) for these sizes and 16-bit format."""
    from ...source import mma_header

    body = template("chunk/per_key.cu.j2").render(K=key, V=value, bf16=bf16, states_shared=per_key_states_shared(),
                                                  output_shared=per_key_shared(key, value),
                                                  dq_shared=per_key_dq_shared(key, value),
                                                  dkv_shared=per_key_dkv_shared(key, value))
    return mma_header() + "\n" + body


@cache
def per_key_dell_source(key: int, value: int, bf16: bool) -> str:
    """The module of per_key_dell (per_key_dell.cu.j2: the per-key log decays' cotangent from the backward kernels'
    dq, dk, end dots, d_end and the entering states, a block per (head, chunk), a thread per key) for these sizes and
    16-bit format."""
    from ...source import mma_header

    return mma_header() + "\n" + template("chunk/per_key_dell.cu.j2").render(K=key, V=value, bf16=bf16)


def per_key_dell(q: torch.Tensor, k: torch.Tensor, ell: torch.Tensor, tables: tuple, dq: torch.Tensor,
                 dk: torch.Tensor, ends: torch.Tensor, d_end: torch.Tensor, entering: torch.Tensor,
                 events: list | None = None) -> torch.Tensor:
    """`algorithm.log_decay_grad(q, k, dq, dk, ends.sum(-2), ell.sum(-2), d_end, entering, per_key=True)` by one
    launch of per_key_dell: dell [*H, NC, C, K] fp32, from dq, dk [*H, NC, C, K], ends [*H, NC, C / 16, K], d_end and
    entering [*H, NC, K, V] (fp32, contiguous: `backward_per_key`'s arrays) and q, k, ell as the per-key kernels read
    them (`tables`: their offset table and step strides, (offs, steps) as `_tables_for` makes them)."""
    heads, (nc, chunk, key), value = dq.shape[:-3], dq.shape[-3:], d_end.shape[-1]
    dell = torch.empty_like(dq)
    offs, steps = tables
    _launch(_function(per_key_dell_source(key, value, q.dtype == torch.bfloat16), "per_key_dell"), "per_key_dell",
            math.prod(heads) * nc, key, nc * chunk, nc,
            [_base(q), _base(k), _base(ell), offs.data_ptr(), steps.data_ptr(), dq.data_ptr(), dk.data_ptr(),
             ends.data_ptr(), d_end.data_ptr(), entering.data_ptr(), dell.data_ptr()], 0, events)
    return dell


def per_key_wanted(dtype: torch.dtype, key: int, value: int) -> bool:
    """Whether a per-key call with q of `dtype` and these sizes would run on the per-key kernels (the chunk then is
    `PER_KEY_CHUNK`): `kernels_wanted`, SSMC_CUDA_CHUNK_PER_KEY not 0."""
    return kernels_wanted(dtype, key, value) and options().chunk_per_key is not False


def per_key_applies(x: Chunks) -> bool:
    """Whether `forward_per_key` takes `x`: a per-key decay, 16-bit q, k, v of one format on the backend's device
    (`per_key_wanted`), fp32 log decays and initial state, chunks of `PER_KEY_CHUNK`, no β and no skip (GLA has
    neither; they run on `algorithm.py`), per_key_output's shared memory within what a block of the device may opt
    into (GPUs of 99 KiB a block run the torch path at K = V = 128)."""
    q, k, v = x.q, x.k, x.v
    return (x.per_key and x.beta is None and x.skip is None and per_key_wanted(q.dtype, q.shape[-1], v.shape[-1])
            and k.dtype == q.dtype and v.dtype == q.dtype and k.shape[-1] == q.shape[-1]
            and q.shape[-2] == PER_KEY_CHUNK and x.ell.shape[-1] == q.shape[-1] and x.ell.dtype == torch.float32
            and x.s0.dtype == torch.float32
            and all(t.numel() > 0 and on_backend_device(t) for t in (q, k, v, x.ell, x.s0))
            and per_key_shared(q.shape[-1], v.shape[-1]) <= _block_shared_limit())


def _lines_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` (the last axis contiguous) if each of its rows starts 16-byte aligned (the per-key kernels copy their
    tiles 16 bytes at a time), else a contiguous copy (whose rows do: every axis' stride a multiple of 16 bytes at the
    sizes the kernels take)."""
    unit = 16 // t.element_size()
    aligned = t.data_ptr() % 16 == 0 and all(s % unit == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1]) if n > 1)
    return t if aligned else t.clone(memory_format=torch.contiguous_format)


def forward_per_key(x: Chunks, events: list | None = None):
    """`algorithm.forward(x)` of a per-key decay on the kernels (where `per_key_applies`): (O [*H, NC, C, V], the
    state entering each chunk [*H, NC, K, V], the final state [*H, K, V]), all fp32, H the heads of all operands
    broadcast. Two launches: per_key_states (a block per (head, 64 keys, 64 values) walks the chunks, the state in
    registers), then per_key_output (a block per (head, chunk), `per_key_threads`). Operands whose rows are not 16-byte
    aligned are copied first (`_lines_aligned`: the kernels' cp.async copies). `events` as `forward`'s."""
    q, k, v, ell = (_lines_aligned(_chunked_view(a, True)) for a in (x.q, x.k, x.v, x.ell))
    t = q.dim() - 3
    heads = _broadcast(q.shape[:t], k.shape[:t], v.shape[:t], ell.shape[:t], x.s0.shape[:t])
    nh = math.prod(heads)
    nc, chunk, key, value = q.shape[-3], q.shape[-2], q.shape[-1], v.shape[-1]
    dev, f32 = q.device, torch.float32
    out = torch.empty((*heads, nc, chunk, value), dtype=f32, device=dev)
    entering = torch.empty((*heads, nc, key, value), dtype=f32, device=dev)
    final = torch.empty((*heads, key, value), dtype=f32, device=dev)
    s0 = x.s0.expand(*heads, key, value).contiguous()
    offs, steps, _ = _tables_for(heads, (q, k, v, ell, out, v), dev)  # (no dO: v in its column)
    text = per_key_source(key, value, q.dtype == torch.bfloat16)
    tables = (offs.data_ptr(), steps.data_ptr())
    _launch(_function(text, "per_key_states"), "per_key_states", nh * (key // 64) * (value // 64), 128, nc * chunk,
            nc, [_base(k), _base(v), _base(ell), *tables, s0.data_ptr(), entering.data_ptr(), final.data_ptr()],
            per_key_states_shared(), events)
    _launch(_function(text, "per_key_output"), "per_key_output", nh * nc, per_key_threads(value), nc * chunk, nc,
            [_base(q), _base(k), _base(v), _base(ell), *tables, entering.data_ptr(), _base(out)],
            per_key_shared(key, value), events)
    return out, entering, final


def per_key_backward_applies(x: Chunks, d_out: torch.Tensor) -> bool:
    """Whether `backward_per_key` takes `x` (`per_key_applies`, SSMC_CUDA_CHUNK_BACKWARD not 0) with `d_out` in q's
    dtype and shape [*H, NC, C, V] on the backend's device, whose blocks may take its kernels' shared memory (GPUs
    of 99 KiB a block run the torch VJP at K 128)."""
    return (per_key_applies(x) and options().chunk_backward is not False and d_out.dtype == x.q.dtype
            and tuple(d_out.shape[-3:]) == (*x.q.shape[-3:-1], x.v.shape[-1]) and on_backend_device(d_out)
            and per_key_backward_shared(x.q.shape[-1], x.v.shape[-1]) <= _block_shared_limit())


_SHARED_LIMITS: dict = {}


def _block_shared_limit() -> int:
    """The dynamic shared memory a block may opt into on the current device (the emulator: sm_90's)."""
    if emulating():
        return 227 * 1024
    device = current_device()
    limit = _SHARED_LIMITS.get(device)
    if limit is None:
        props = torch.cuda.get_device_properties(device)
        # (a torch without the field: sm_80's and sm_90's opt-in limits by capability, else 99 KiB)
        known = {(8, 0): 163 * 1024, (9, 0): 227 * 1024}.get((props.major, props.minor), 99 * 1024)
        limit = _SHARED_LIMITS[device] = getattr(props, "shared_memory_per_block_optin", known)
    return limit


def backward_per_key(x: Chunks, entering: torch.Tensor, d_out: torch.Tensor, d_final: torch.Tensor,
                     events: list | None = None):
    """`algorithm.vjp` of a per-key decay on the kernels (where `per_key_backward_applies`): (dq, dk [*H, NC, C, K],
    dv [*H, NC, C, V], dell [*H, NC, C, K], ds0 [*H, K, V], None, None), fp32 over every head H (the caller sums them
    over the heads an operand lacks), from the forward's entering states [*H, NC, K, V] (fp32, or 16-bit: read
    rounded either way), d_out [*H', NC, C, V] in q's 16-bit dtype and d_final [*H', K, V].

    per_key_dstates walks the chunks last first (the cotangent of each chunk's end state, d_end, and ds0); then
    per_key_dq and per_key_dkv (dk and dv together, with the end dots Σ_j k_j·(dk_j's part through d_end), per key), a
    block per (head, chunk) each. The log decays' cotangent is `algorithm.log_decay_grad`'s per key: the row
    products q ⊙ dq − k ⊙ dk, the end term ``at_end + exp(Γ) Σ_ν d_end S_p`` at each chunk's last step, summed in
    reverse over the chunk (`per_key_dell`: one launch, a block per (head, chunk))."""
    q, k, v, do, ell = (_lines_aligned(_chunked_view(a, True)) for a in (x.q, x.k, x.v, d_out, x.ell))
    t = q.dim() - 3
    heads = _broadcast(q.shape[:t], k.shape[:t], v.shape[:t], ell.shape[:t], x.s0.shape[:t], do.shape[:t],
                       d_final.shape[:t])
    nh = math.prod(heads)
    nc, chunk, key, value = q.shape[-3], q.shape[-2], q.shape[-1], v.shape[-1]
    dev, f32 = q.device, torch.float32
    entering = entering.to(f32).expand(*heads, nc, key, value).contiguous()
    d_final = d_final.to(f32).expand(*heads, key, value).contiguous()
    d_end = torch.empty((*heads, nc, key, value), dtype=f32, device=dev)
    ds0 = torch.empty((*heads, key, value), dtype=f32, device=dev)
    dq = torch.empty((*heads, nc, chunk, key), dtype=f32, device=dev)
    dk = torch.empty_like(dq)
    dv = torch.empty((*heads, nc, chunk, value), dtype=f32, device=dev)
    ends = torch.empty((*heads, nc, chunk // 16, key), dtype=f32, device=dev)
    offs, steps, _ = _tables_for(heads, (q, k, v, ell, dq, do), dev)
    text = per_key_source(key, value, q.dtype == torch.bfloat16)
    tables = (offs.data_ptr(), steps.data_ptr())
    operands = [_base(q), _base(k), _base(v), _base(do), _base(ell), *tables]
    length = nc * chunk
    _launch(_function(text, "per_key_dstates"), "per_key_dstates", nh * (key // 64) * (value // 64), 128, length, nc,
            [_base(q), _base(do), _base(ell), *tables, d_final.data_ptr(), d_end.data_ptr(), ds0.data_ptr()],
            per_key_states_shared(), events)
    threads = per_key_backward_threads(key, value)
    _launch(_function(text, "per_key_dq"), "per_key_dq", nh * nc, threads, length, nc,
            [*operands, entering.data_ptr(), dq.data_ptr()], per_key_dq_shared(key, value), events)
    _launch(_function(text, "per_key_dkv"), "per_key_dkv", nh * nc, threads, length, nc,
            [*operands, d_end.data_ptr(), dk.data_ptr(), dv.data_ptr(), ends.data_ptr()],
            per_key_dkv_shared(key, value), events)
    # the log decays' cotangent per key (algorithm.log_decay_grad with per_key): one launch, no torch op
    d_ell = per_key_dell(q, k, ell, (offs, steps), dq, dk, ends, d_end, entering, events)
    return dq, dk, dv, d_ell, ds0, None, None

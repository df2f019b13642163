"""Attention decode on CUDA: one launch a step appends the new token's key and value to the KV cache and
attends its query over keys 0..pos (``decode.cu.j2``: flash-decoding, the keys split across blocks, the
last block of a batch index combining the splits' partial max, sum and output).

    name, text = kernel_source(program, d=128, bf16=True)
    dec = FlashDecode(program)
    dec(q, k, v, cache, out, splits)   # canonical [BH, d] 16-bit tensors; cache: attention_step.AttentionCache

As a plain loop, per flattened batch index bh, with pos = cache.length:

    kc[bh, pos] = k[bh];  vc[bh, pos] = v[bh]
    s[j] = score_mod(scale * sum_d q[bh, d] kc[bh, j, d], pos, j, params[bh])  for j <= pos
    s[j] = -inf where not mask_mod(pos, j, params[bh])
    out[bh] = softmax(s) @ vc[bh, :pos + 1]    (0 where every key is masked)

The modifiers are printed by the flash forward's printer (forward.print_body); K and V 16-bit, every
product and sum in fp32, the output rounded to the 16-bit type once. Head dims 64, 128 (128 threads a block)
and 256 (256 threads: the merges take a thread a head dim; a warp a key, 32 lanes of 16 bytes).
"""

from __future__ import annotations

from .....ir.program import Attention
from .. import template
from ..loaded import loaded_function
from .forward import HEAD_DIMS, float_literal, printed_modifiers

# threads a block per head dim: the merges of the block's groups and of the splits take a thread a head dim, so
# 256 at d 256 (where a warp takes one key at a time: 32 lanes of 16 bytes)
THREADS = {64: 128, 128: 128, 256: 256}
KEYS_A_PASS = {64: 64, 128: 32, 256: 32}  # KPB of decode.cu.j2: THREADS / 32 warps x (32 / (d / 8)) keys x 4 in flight
MIN_KEYS_A_SPLIT = 256           # fewer keys than this a block: the combine's cost is no longer small
MAX_SPLITS = 64

_SOURCES: dict = {}
_SMS: dict = {}  # device index -> multiprocessors


def kernel_source(program: Attention, d: int, bf16: bool) -> tuple[str, str]:
    """(kernel name, CUDA source) of `program`'s decode step at head dim `d` (`HEAD_DIMS`, the value dim
    the same), bf16 or fp16 cache; cached. Raises `forward.Unprintable` where the modifiers do not print."""
    from ...source import mma_header

    if d not in HEAD_DIMS:
        raise ValueError(f"head dim {d}: the decode kernel takes {HEAD_DIMS}")
    key = (program, d, bf16)
    hit = _SOURCES.get(key)
    if hit is not None:
        return hit
    score_body, mask_body, scale, digest = printed_modifiers(program, d)
    name = f"attn_decode_d{d}_{'bf16' if bf16 else 'fp16'}_{digest}"
    text = template("flash/decode.cu.j2").render(name=name, d=d, bf16=bf16, threads=THREADS[d],
                                                 nparams=len(program.params), scale=float_literal(scale),
                                                 score_body=score_body, mask_body=mask_body, gather=False,
                                                 width=len(program.params))
    _SOURCES[key] = hit = (name, mma_header() + "\n" + text)
    return hit


def multiprocessors(device) -> int:
    """The device's SM count (1 for the CPU emulator), asked once a device."""
    if device.type != "cuda":
        return 1
    n = _SMS.get(device.index)
    if n is None:
        import torch

        n = _SMS[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return n


def choose_splits(bh: int, keys: int, d: int, sms: int) -> int:
    """Blocks a batch index for `keys` keys: enough blocks for about 4 a multiprocessor, each with at
    least `MIN_KEYS_A_SPLIT` keys, at most `MAX_SPLITS`; 1 where the batch fills the device alone. The
    count of splits the kernel's whole passes give (none empty)."""
    want = min(MAX_SPLITS, -(-4 * sms // max(1, bh)), max(1, keys // MIN_KEYS_A_SPLIT))
    return fitted_splits(keys, d, max(1, want))


def most_splits(bh: int, max_len: int, sms: int) -> int:
    """An upper bound of `choose_splits` over every length up to `max_len`: the workspace made once."""
    return max(1, min(MAX_SPLITS, -(-4 * sms // max(1, bh)), max_len // MIN_KEYS_A_SPLIT))


def fitted_splits(keys: int, d: int, splits: int) -> int:
    """`splits` cut down to the splits the kernel's whole passes of keys make non-empty."""
    passes = -(-keys // KEYS_A_PASS[d])
    per = -(-passes // max(1, splits))
    return -(-passes // per)


class FlashDecode:
    """The decode step of one program (module docstring), compiled per (device, source); launched on
    torch's current stream (or run on the emulator for CPU tensors under ``SSMC_CUDA_EMULATE=1``)."""

    def __init__(self, program: Attention):
        self.program = program
        self._functions: dict = {}  # (device, d, bf16) -> the loaded kernel (finding the source hashes the IR)

    def __call__(self, q, k, v, cache, params, out, splits: int, room: int = 1) -> None:
        """One step: q, k, v [*batch, d] contiguous 16-bit tensors (BH rows of d); `params` the [BH, NP]
        fp32 table (contiguous); `out` contiguous, q's shape and dtype; `splits` from `choose_splits`;
        `room`: the most splits later steps of this cache may ask (their workspace made now, once).
        Writes k, v into the cache at row `cache.length` and the output into `out` (the caller advances
        the length)."""
        import torch

        from ...launch import launch_kernel

        d = q.shape[-1]
        bh = q.numel() // d
        key = (q.device, d, q.dtype)
        fn = self._functions.get(key)
        if fn is None:
            name, text = kernel_source(self.program, d, q.dtype == torch.bfloat16)
            fn = self._functions[key] = loaded_function(text, name, q.device)
        room = max(splits, room, most_splits(bh, cache.max_len, multiprocessors(q.device)))
        work, meta = cache.workspace(room)
        pointers = [q.data_ptr(), k.data_ptr(), v.data_ptr(), cache.k.data_ptr(), cache.v.data_ptr(),
                    params.data_ptr(), work.data_ptr(), meta.data_ptr(), out.data_ptr()]
        grid = (bh * splits, THREADS[d])
        if q.is_cuda and q.device.index != torch.cuda.current_device():
            with torch.cuda.device(q.device):
                launch_kernel(fn, grid, cache.length, splits, pointers)
        else:
            launch_kernel(fn, grid, cache.length, splits, pointers)

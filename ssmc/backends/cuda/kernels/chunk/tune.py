"""The chunk size of the matrix-linear kernels, autotuned per shape at its first use on a GPU (SSMC_CUDA_CHUNK_TUNE=1).

A call's chunk C trades the chunk states' bytes ([K, V] per head and chunk: L / C of them) against the
intra-chunk products (about C / 2 (K + V) per step) and, for a call whose length is no multiple of C, the
padded steps. `chunk_for` times a training call's core at each candidate (`candidates`): `mma.forward` and
`mma.backward` on the call's own operands arranged at that chunk (`operands`: ChunkedCore's, so that heads shared
by q and k, strides and padding are the call's) or, where none are given (`ssmc inspect`), on random ones of the
call's heads, key and value sizes and length, with CUDA events, and keeps the fastest for the process, as a plain
loop:

    for c in candidates(L):
        x = operands(c), or random Chunks [H, ceil(L / c), c, K] (q, k), [..., V] (v), log decays, zero state
        times[c] = median over 3 runs of (mma.forward(x); mma.backward(x, ...))
    chosen[H, K, V, L, dtype, device] = argmin(times)

SSMC_CUDA_CHUNK forces a chunk (`chunk_size` reads it first); unless SSMC_CUDA_CHUNK_TUNE=1, `mma.chunk_for`'s
rule (chunk 128 past 64 steps) stands. (Random per-head operands once chose, on SSD's benchmark shape, a chunk
whose real training call was slower and held more memory than 128's: SSD's q and k are shared by the heads.) The
emulator and CPU tensors take the rule too. `tuned` lists what was timed (`ssmc inspect` shows it). A choice is
kept per (heads, key and value sizes, length, dtype, device): the first call of a shape decides for later calls of
that shape whatever their operands' layouts (heads shared by q and k or not). Tuning compiles the kernels of every
candidate chunk at first use: seconds to tens of seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .....runtime.progress import progress
from ...options import options
from . import mma
from .algorithm import Chunks

_chosen: dict = {}   # (device, dtype, heads, key, value, length) -> (chunk, {chunk: ms})


def candidates(length: int) -> tuple[int, ...]:
    """The kernels' chunk sizes worth timing at `length` steps: up to the first that holds the call whole."""
    out = []
    for c in mma.CHUNKS:
        out.append(c)
        if c >= length:
            break
    return tuple(out)


def chunk_for(length: int, heads: int, key: int, value: int, dtype: torch.dtype, device: torch.device,
              operands: Callable[[int], Chunks] | None = None) -> int:
    """Steps per chunk of a call on the kernels: the fastest candidate for this shape on `device` (timed at its
    first use, module docstring) where `device` is a GPU and tuning is asked for, else `mma.chunk_for`'s rule.
    `operands`: the call's own `Chunks` at a chunk size, timed in place of random ones."""
    opts = options()
    if not opts.chunk_tune or opts.emulate:
        return mma.chunk_for(length)
    found = tuned(length, heads, key, value, dtype, device)
    if found is not None:
        return found[0]
    choices = candidates(length)
    if device.type != "cuda" or len(choices) == 1 or torch.cuda.is_current_stream_capturing():
        # (no timing inside a CUDA graph's capture)
        return mma.chunk_for(length)
    with progress(f"timing the chunk kernels at chunks {', '.join(map(str, choices))} ({heads} heads, L {length}, "
                  f"state {key} x {value})"):
        times = {c: _time(c, length, heads, key, value, dtype, device, None if operands is None else operands(c))
                 for c in choices}
    best = min(times, key=times.get)
    if len(_chosen) >= 256:
        _chosen.clear()
    _chosen[_key(length, heads, key, value, dtype, device)] = (best, times)
    return best


def tuned(length: int, heads: int, key: int, value: int, dtype: torch.dtype,
          device: torch.device) -> tuple[int, dict[int, float]] | None:
    """(the chunk chosen, {chunk: ms timed}) where this shape was tuned in this process, else None."""
    return _chosen.get(_key(length, heads, key, value, dtype, device))


def _key(length, heads, key, value, dtype, device) -> tuple:
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda"
                                                           else 0)
    return (device.type, index, dtype, heads, key, value, length)


def _time(chunk: int, length: int, heads: int, key: int, value: int, dtype, device, x: Chunks | None = None,
          runs: int = 3) -> float:
    """Median milliseconds of a training call's core (forward, then backward) at `chunk` on `x` (the call's
    operands at that chunk) or, where None, on random operands."""
    g = torch.Generator(device=device).manual_seed(0)
    nc = math.ceil(length / chunk)
    if x is not None and not mma.kernels_apply(x):  # (operands the kernels would not take: random ones timed)
        x = None
    if x is None:
        def randn(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

        q, k = randn(heads, nc, chunk, key, scale=key ** -0.5), randn(heads, nc, chunk, key)
        x = Chunks(q, k, randn(heads, nc, chunk, value), -torch.rand(heads, nc, chunk, generator=g, device=device)
                   * 0.1, torch.zeros(heads, key, value, device=device))
    out, _, final = mma.forward(x, half_states=True, out_dtype=dtype)  # (the kernels compiled and loaded)
    d_out = torch.randn(out.shape, generator=g, device=device).to(dtype)
    d_final = torch.zeros_like(final)
    del out, final  # (not live while the call is timed)

    def call():
        _, entering, final = mma.forward(x, half_states=True, out_dtype=dtype)
        mma.backward(x, entering, final, d_out, d_final)

    call()  # (the kernels compiled and loaded)
    times = []
    for _ in range(runs):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]

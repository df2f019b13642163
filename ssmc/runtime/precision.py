"""The 16-bit dtype a call's inputs were given in, where a path computes in fp32 all the same.

`ssmc.grad` and `ssmc.torch.function` cast 16-bit inputs to the fp32 compute dtype before any runner
sees them; a runner with a 16-bit form (the persistent kernel's tensor-core product, the hoisted
matrix products in bf16 with fp32 accumulation) reads `half_inputs()` to take it anyway:

    with given_half(torch.bfloat16):    # around the forward, and around its backward
        ... runners: half_inputs() -> torch.bfloat16
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

_HALF: ContextVar = ContextVar("ssmc_half_inputs", default=None)
_CAST: ContextVar = ContextVar("ssmc_cast_gradients", default=frozenset())


def half_inputs():
    """The torch 16-bit dtype (bfloat16 / float16) the current call's inputs came in, or None."""
    return _HALF.get()


def half_of(arrays):
    """The first 16-bit floating dtype among `arrays` (torch tensors; anything else is skipped), or None."""
    for a in arrays:
        dtype = getattr(a, "dtype", None)
        if dtype is not None and str(dtype) in ("torch.bfloat16", "torch.float16"):
            return dtype
    return None


@contextmanager
def given_half(dtype):
    """`half_inputs()` is `dtype` inside (None: unchanged from outside)."""
    if dtype is None:
        yield
        return
    token = _HALF.set(dtype)
    try:
        yield
    finally:
        _HALF.reset(token)


def cast_gradients() -> frozenset:
    """The names of the inputs whose gradients the caller only casts to the input's 16-bit dtype, nothing added
    into them first (`ssmc.torch`'s backward; a staged layer narrows it per stage to the inputs that stage alone
    reads): a runner may write such a gradient in that dtype (the chunked core's time-first ones), the values the
    cast would give. Empty elsewhere (`ssmc.grad` returns the compute dtype's gradients)."""
    return _CAST.get()


@contextmanager
def casting_gradients(names: frozenset):
    """`cast_gradients()` is `names` inside."""
    token = _CAST.set(names)
    try:
        yield
    finally:
        _CAST.reset(token)

"""The environment variables that override the CUDA backend's choices, read on every call.

Every decision the backend caches per shape (a strategy, a launch plan, a prepared call) has the
overrides' values in its key, so that setting one between two calls takes effect (the benchmark
scripts force strategies that way). A small training step asks for them a few dozen times, and
``os.environ.get`` encodes its key each time (about 3 µs on the GPU machines' hosts): `overrides()`
reads the environment's own table with keys encoded once.
"""

from __future__ import annotations

import os

NAMES = ("SSMC_CUDA_STRATEGY", "SSMC_CUDA_TIME_BLOCKS", "SSMC_CUDA_STEPS_PER_LANE", "SSMC_CUDA_ROW_GROUPS",
         "SSMC_CUDA_ROW_RECURRENCE", "SSMC_CUDA_RECURRENCE_WARPS", "SSMC_CUDA_FUSED_BACKWARD",
         "SSMC_CUDA_STATE_MAJOR_BACKWARD", "SSMC_CUDA_BACKWARD_STEPS_PER_LANE", "SSMC_CUDA_HOIST",
         "SSMC_CUDA_EMULATE", "SSMC_CUDA_LANES_BACKWARD")

# os.environ keeps its values in a dict of encoded keys (`_data`; bytes on POSIX), which
# os.environ[...] = ... and del update; where that differs, the public reads
_TABLE = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
_KEYS = tuple(map(_ENCODE, NAMES)) if _TABLE is not None and _ENCODE is not None else None


_EMULATE = _ENCODE("SSMC_CUDA_EMULATE") if _KEYS is not None else None
_ONE = os.environ.encodevalue("1") if _KEYS is not None else None


def emulate() -> bool:
    """Whether ``SSMC_CUDA_EMULATE`` is "1" (read as `overrides` reads: it is asked per launch)."""
    if _EMULATE is not None:
        return _TABLE.get(_EMULATE) == _ONE
    return os.environ.get("SSMC_CUDA_EMULATE") == "1"


def overrides() -> tuple:
    """The overrides' current values (None where unset), one per name of `NAMES`, comparable between
    calls (encoded as the environment keeps them)."""
    if _KEYS is not None:
        return tuple(map(_TABLE.get, _KEYS))
    return tuple(map(os.environ.get, NAMES))

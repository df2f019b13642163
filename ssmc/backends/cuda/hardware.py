"""The GPU limits the CUDA backend plans kernels against (sm_80 / sm_90 parts)."""

from __future__ import annotations

WARP = 32


STATIC_SHARED = 48 * 1024  # bytes of static shared memory a block may declare


SM_REGISTERS = 65536       # 4-byte registers an SM has for its threads (sm_80, sm_90)


SM_SHARED = 233472         # bytes of shared memory an SM has for its blocks (sm_90 parts)...


SM_BLOCK_SHARED = 1024     # ...of which each block takes this many more than it declares


BOUNDED_REGISTERS = 128    # registers a thread where a kernel's `__launch_bounds__` asks for more blocks an SM...


BOUNDED_LANE_VALUES = 16   # ...in a lanes kernel whose lane holds at most this many state values x steps (S x G)


def bounded_blocks(block: int) -> int:
    """Blocks of `block` threads an SM holds at BOUNDED_REGISTERS a thread (a `__launch_bounds__` minimum)."""
    return SM_REGISTERS // (block * BOUNDED_REGISTERS)

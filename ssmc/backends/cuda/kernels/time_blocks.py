"""Scans split in time (lowering/time_blocks.py): blocks of steps each summarised, the summaries
combined, each block rescanned from its carry; three launches of thread-per-index kernels. And the
scan that is not split: a thread per recurrence, time inside it.

Time-parallel scans are used when the independent recurrences give fewer than FILL_THREADS
threads (about one full wave of the GPU), splitting time into as many blocks as make up the
difference, each at least MIN_BLOCK_STEPS long. Up to SHORT_SCAN steps a scan runs as a thread per
recurrence even where blocks of time would fill the GPU better: their three launches a run cost more
host time than the longer kernel (bench/results/ has the measurements).
"""

from __future__ import annotations

from ..options import options
from .base import Launch, Shape, Verdict, threads
from .thread import PerIndex

FILL_THREADS = 1 << 18
MIN_BLOCK_STEPS = 32
SHORT_SCAN = 512


def time_block_count(total: int, length: int) -> int:
    """How many blocks of time a scan over `total` independent recurrences runs in (1: sequential).

    `SSMC_CUDA_TIME_BLOCKS` overrides it (a count; 1 or 0 turns time-parallel scans off).
    """
    forced = options().time_blocks
    if forced is not None:
        return max(1, min(forced, length))
    if total >= FILL_THREADS:
        return 1
    return max(1, min(-(-FILL_THREADS // max(total, 1)), length // MIN_BLOCK_STEPS))


class TimeBlocks(PerIndex):
    """A diagonal-linear scan of too few recurrences to fill the GPU over a long sequence."""

    name = "time blocks"

    def consider(self, runner, shape: Shape, forced: str | None) -> Verdict:
        if forced:
            return self.forced_verdict(forced)
        total = threads(runner.time_blocks.summary, shape.sizes)
        blocks = time_block_count(total, shape.length)
        if blocks > 1 and (shape.length > SHORT_SCAN or options().time_blocks is not None):
            return self.taken(f"a diagonal-linear scan of {total} recurrences, too few to fill the GPU "
                              f"alone over {shape.length} steps: blocks of time, combined")
        if blocks == 1:
            return self.refused(f"{total} recurrences fill the GPU")
        return self.refused(f"{shape.length} steps, at most {SHORT_SCAN}: one launch costs less host time than three")

    def prepare(self, runner, seqs, params, initial, sizes: dict[str, int], length: int, out_dtype,
                contiguous: bool):
        return runner.prepare_time_blocks(seqs, params, initial, sizes, length, out_dtype, contiguous)

    def launches(self, runner, shape: Shape) -> list[Launch]:
        tb, sizes, length = runner.time_blocks, shape.sizes, shape.length
        total = threads(tb.summary, sizes)
        nblk = time_block_count(total, length)
        return [Launch(tb.summary, length, nblk, total * nblk), Launch(tb.combine, nblk, 1, total),
                Launch(tb.rescan, length, nblk, total * nblk)]


class ThreadPerRecurrence(PerIndex):
    """A scan with a thread per recurrence and time inside it: the last resort of the table."""

    name = "fused"

    def consider(self, runner, shape: Shape, forced: str | None) -> Verdict:
        if forced:
            return self.forced_verdict(forced)
        total = threads(runner.time_blocks.summary, shape.sizes)
        why = f"{total} recurrences fill the GPU" if time_block_count(total, shape.length) == 1 \
            else f"{shape.length} steps are too few for blocks of time"
        return self.taken(f"a thread per recurrence ({runner.lowered.reason}): {why}")



TIME_BLOCKS = TimeBlocks()
THREAD = ThreadPerRecurrence()

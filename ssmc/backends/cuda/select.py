"""The one table that picks how a program's forward runs on the GPU, in order, and records why each
strategy was taken or refused (`ssmc inspect` prints it).

    selection = select(runner, Shape(sizes, length, time_contiguous))
    selection.strategy, selection.reason   # "warp", "a diagonal-linear scan with time contiguous: ..."
    selection.tried                        # every strategy asked, each Verdict(taken, reason)

The first strategy that takes the shape runs it. SSMC_CUDA_STRATEGY forces one (options.py): the
strategies before it still see the shape (a program that is no diagonal scan runs as it was
lowered); "rows" and "lanes" raise a ValueError where forced and unable to run. A new strategy is a
module of kernels/ with a `Strategy` subclass, placed in `FORWARD` by `register`.
"""

from __future__ import annotations

from dataclasses import dataclass

from .kernels.base import Shape, Strategy, Verdict
from .kernels.lanes import LANES
from .kernels.rows import ROWS
from .kernels.thread import AS_LOWERED
from .kernels.time_blocks import THREAD, TIME_BLOCKS
from .kernels.warp import WARP_STRATEGY
from .options import options

# The order in which strategies are asked: a row statistic shared by a block first (a thread per row
# would walk the row alone each step), then lanes over the states' own axis, then programs that are
# no diagonal scan as lowered; for scans, a warp per recurrence where time is contiguous, blocks of
# time where the recurrences are too few, and a thread per recurrence.
FORWARD: list[Strategy] = [ROWS, LANES, AS_LOWERED, WARP_STRATEGY, TIME_BLOCKS, THREAD]


@dataclass(frozen=True)
class Selection:
    """The strategy chosen, why, and every verdict of the table up to it."""

    strategy: str
    reason: str
    tried: tuple[Verdict, ...]

    def refusals(self) -> list[str]:
        """"<strategy>: <why not>" for each strategy asked before the chosen one."""
        return [f"{v.strategy}: {v.reason}" for v in self.tried if not v.taken]


def select(runner, shape: Shape) -> Selection:
    """The strategy of `runner`'s program at `shape` (module docstring)."""
    forced = options().strategy
    tried = []
    for strategy in FORWARD:
        verdict = strategy.consider(runner, shape, forced)
        tried.append(verdict)
        if verdict.taken:
            return Selection(verdict.strategy, verdict.reason, tuple(tried))
    # forced to one the table passed over (the lanes kernel where the fused backward asks without it)
    return Selection(forced, f"forced by SSMC_CUDA_STRATEGY={forced}", tuple(tried))


def strategy(name: str) -> Strategy:
    """The strategy a selection's name stands for (a lowered program's "split" and "map" included)."""
    for s in FORWARD:
        if name == s.name or name in getattr(s, "names", ()):
            return s
    raise KeyError(f"no CUDA strategy {name!r}: expected one of {', '.join(s.name for s in FORWARD)}")


def register(new: Strategy, before: str) -> None:
    """Put strategy `new` in the table just before the one named `before` (a strategy already there
    by that name is replaced)."""
    FORWARD[:] = [s for s in FORWARD if s.name != new.name]
    FORWARD.insert(next(i for i, s in enumerate(FORWARD) if s.name == before), new)


def unregister(name: str) -> None:
    """Take strategy `name` out of the table."""
    FORWARD[:] = [s for s in FORWARD if s.name != name]

"""Values from earlier steps: ``x.shift(k)`` as states the compiler adds (a shift register).

``x.shift(k)`` is the value `x` had `k` steps earlier, 0 for the first `k` steps. A step sees one
time step, so the earlier values must be carried: for each shifted value `x` the trace adds a chain
of states, named after `x` (``u_shift1``, ``u_shift2``, ... for an input ``u``; ``shifted0_shift1``,
... for an expression), updated as

    x_shift1 <- x                      (the value this step: the next step's x.shift(1))
    x_shift2 <- x_shift1               (one step older)
    ...
    x_shiftK <- x_shift{K-1}

so that during step t, ``x_shiftj`` (the old carry) holds x at step t - j, and ``x.shift(j)`` reads
it. The chain is as long as the longest shift of `x`; a shift of a shift (``x.shift(1).shift(2)``)
extends the same chain. The states start at zero (the value before the sequence starts) unless the
caller gives them, and come back among the final states, after the declared ones: feeding them back
continues a sequence run in pieces (a causal convolution's window, Mamba's ``conv_state``).
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

from ..errors import Loc, SpecError
from ..ir.node import BOOL, Node
from ..ir.ops import Op
from ..ir.program import Decl, Role


@dataclass
class _Chain:
    base: str                           # the name its states are built from
    value: Node                         # the shifted value (the chain's first state's update)
    states: list[tuple[str, Loc | None]]


class ShiftRegisters:
    """The states `x.shift(k)` adds to the recurrence being traced (module docstring).

    `taken` holds the names already in use (the step's arguments); each added state's name is new.
    """

    def __init__(self, taken: set[str]):
        self.taken = set(taken)
        self.chains: dict[Node, _Chain] = {}
        self.of_state: dict[str, tuple[_Chain, int]] = {}   # added state -> (its chain, its shift)

    def shifted(self, x: Node, k: int, loc: Loc | None) -> Node:
        """The INPUT node of the state holding `x` from `k` (>= 1) steps earlier."""
        if x.op is Op.INPUT and x.arg in self.of_state:   # a shift of a shift: further along its chain
            chain, j = self.of_state[x.arg]
            x, k = chain.value, j + k
        if x.dtype == BOOL:
            raise SpecError("shift of a boolean value: states hold floats (shift ssmc.where(cond, 1.0, 0.0))", loc)
        chain = self.chains.get(x)
        if chain is None:
            expressions = sum(c.value.op is not Op.INPUT for c in self.chains.values())
            base = x.arg if x.op is Op.INPUT else f"shifted{expressions}"
            chain = self.chains[x] = _Chain(base, x, [])
        while len(chain.states) < k:
            name = f"{chain.base}_shift{len(chain.states) + 1}"
            while name in self.taken:
                name += "_"
            self.taken.add(name)
            chain.states.append((name, loc))
            self.of_state[name] = (chain, len(chain.states))
        return Node.make(Op.INPUT, (), chain.states[k - 1][0], x.axes, loc=loc)

    def states(self) -> tuple[tuple[Decl, ...], tuple[Node, ...]]:
        """The added states' declarations and their updates, chain by chain."""
        decls, updates = [], []
        for chain in self.chains.values():
            previous = chain.value
            for name, loc in chain.states:
                decls.append(Decl(name, Role.STATE, chain.value.axes, loc))
                updates.append(previous)
                previous = Node.make(Op.INPUT, (), name, chain.value.axes, loc=loc)
        return tuple(decls), tuple(updates)


# The shift registers of the recurrence being traced (None outside one: attention's functions).
current: contextvars.ContextVar[ShiftRegisters | None] = contextvars.ContextVar("ssmc_shift_registers",
                                                                               default=None)

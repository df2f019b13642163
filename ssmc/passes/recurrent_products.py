"""The recurrent products of a program: where a state's every unit reads every unit of the state
before (an LSTM's ``dot(h, U, over=j)``). The step loop and the persistent kernel
(backends/cuda/kernels/) take programs that have them; the element-wise kernels do not."""

from __future__ import annotations

from ..ir.node import Node, depending_on, toposort
from ..ir.ops import Op


def recurrent_products(program) -> list[Node]:
    """The matrix-vector products of a state-dependent value with a value that reads no state and no
    sequence (a param's): ``SUM over a of MUL(h, U)`` where U brings an axis h lacks (an LSTM's
    ``sum_j h[b, j] U[j, g, k]``: each unit of the new state reads every unit of the old). A product
    that brings no new axis (a convolution's taps, ``sum_n h[b, d, n] C[n]``) keeps the recurrences
    independent: the kernels run it."""
    nodes = toposort(program.roots)
    state_names = {s.name for s in program.states}
    stateful = depending_on(nodes, state_names)
    timed = depending_on(nodes, state_names | {d.name for d in program.seqs})
    found = []
    for n in nodes:
        if n.op is Op.SUM and n.args[0].op is Op.MUL:
            a, b = n.args[0].args
            for state_side, fixed in ((a, b), (b, a)):
                if state_side in stateful and fixed not in timed and (
                        set(fixed.axes) - set(state_side.axes) - {n.arg}):
                    found.append(n)
                    break
    return found

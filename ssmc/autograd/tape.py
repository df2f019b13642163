"""The tape a training step's forward leaves for its backward, and the cotangents the backward reads.

One `Tape` type for every driver and path: `Grad`'s (chunk boundaries, or every carry, or the fused
backward's rounds; `step` where a prepared step made it) and `StagedGrad`'s (`tapes`: a tape per
stage).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..ir.axes import TIME
from ..runtime.binding import layout_of


@dataclass
class Tape:
    """What a driver's `forward` keeps for its `backward`: arrays in the compute dtype, time first.

    `boundaries[c]` is the carry before chunk c; `carries` holds ``prev_<state>`` of every step
    when one chunk covers the sequence and the backend ran the recording forward (then the
    backward recomputes nothing, and takes from `products` the matrix products its adjoint would
    recompute: an LSTM's ``x W``, hoisted by the forward, and ``h U``, saved per step).
    `rounds` holds the carry into every round of the backend's fused backward, written by its
    forward (`boundaries` is then the initial state alone). `step`: the prepared step whose forward
    made the tape, whose backward's path it takes (prepared.py). `tapes`: a staged layer's tape per
    stage, in stage order (`StagedGrad`; its own arrays are then empty). `half`: the 16-bit dtype the
    forward's inputs came in (its backward runs under it too: runtime/precision.py). `gradient_dtypes`:
    {input name: torch dtype} the caller wants the gradients in (the torch op: its arguments'), which a
    prepared step's backward casts them to as it makes them contiguous in their layouts (one copy, not a
    copy and a cast); None: the compute dtype."""

    sizes: dict[str, int]
    length: int
    dtype: np.dtype
    layout: object
    seqs: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    chunk: int = 0
    boundaries: list[dict] = field(default_factory=list)
    carries: dict | None = None
    products: dict = field(default_factory=dict)
    rounds: dict | None = None
    step: object = None
    tapes: list[Tape] | None = None
    half: object = None  # the 16-bit dtype the inputs were given in (runtime/precision.py), or None
    gradient_dtypes: dict | None = None


def tape_arrays(tape: Tape) -> tuple[dict, dict]:
    """The arrays a tape holds (the device its backward runs on: `on_arrays_device`)."""
    if tape.tapes:
        return tape_arrays(tape.tapes[0])
    return tape.seqs, tape.params


def _as_dict(values, names: list[str], what: str) -> dict:
    if values is None:
        return {}
    if isinstance(values, dict):
        unknown = set(values) - set(names)
        if unknown:
            raise ValueError(f"{what}: unknown names {sorted(unknown)}; expected {names}")
        return dict(values)
    if len(names) == 1 and not isinstance(values, (tuple, list)):
        return {names[0]: values}
    if len(values) != len(names):
        raise ValueError(f"{what}: expected {len(names)} arrays for {names}, got {len(values)}")
    return dict(zip(names, values))


def cotangents(program, xp, tape: Tape, grad_outputs, grad_final_states) -> tuple[dict, dict]:
    """The cotangents of `program`'s outputs (time first) and final states, in the tape's compute
    dtype, from arrays given in the forward's layout; zeros for those not given. `xp`: the
    backend's `ArrayOps`."""
    sizes, length, dtype = tape.sizes, tape.length, tape.dtype
    gy = _as_dict(grad_outputs, [n for n, _ in program.outputs], "grad_outputs")
    gh = _as_dict(grad_final_states, [s.name for s in program.states], "grad_final_states")
    cot = {}
    for name, y in program.outputs:
        order = layout_of(tape.layout, name, y.axes)
        if name in gy:
            arr = xp.convert(gy[name], f"grad_outputs[{name!r}]")
            want = tuple(length if a == TIME else sizes[a] for a in order)
            if tuple(arr.shape) != want:
                raise ValueError(f"grad_outputs[{name!r}] has shape {arr.shape}, expected {want} "
                                 f"for axes {' '.join(order)}")
            cot[name] = xp.cast(xp.permute(arr, [order.index(a) for a in (TIME, *y.axes)]), dtype)
        else:
            cot[name] = xp.zeros((length, *(sizes[a] for a in y.axes)), dtype)
    lam = {}
    for s in program.states:
        shape = tuple(sizes[a] for a in s.axes)
        arr = xp.convert(gh[s.name], f"grad_final_states[{s.name!r}]") if s.name in gh else xp.zeros(shape, dtype)
        if tuple(arr.shape) != shape:
            raise ValueError(f"grad_final_states[{s.name!r}] has shape {arr.shape}, expected {shape}")
        lam[s.name] = xp.cast(arr, dtype)
    return cot, lam


def in_layout(program, grads: dict, layout, xp) -> dict:
    """`grads` (sequences time first) with each sequence's gradient in its input's layout, contiguous."""
    out = {}
    for d in program.inputs:
        g = grads[d.name]
        if d in program.seqs:
            order = layout_of(layout, d.name, d.axes)
            canonical = (TIME, *d.axes)
            g = xp.permute(g, [canonical.index(a) for a in order])
        out[d.name] = xp.contiguous(g)
    for s in program.states:
        out[s.name] = grads[s.name]
    return out

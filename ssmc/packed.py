"""Packed variable-length batches: ``cu_seqlens=`` (#43 item 5), as fla and flash-attn take them.

N sequences of lengths L_0 .. L_{N-1} are packed one after another along the time axis of a batch
of size 1 (every sequence input [1, T, ...] in its layout, T = sum L_i); ``cu_seqlens`` [N+1] holds
the cumulative lengths, 0 first and T last. The states restart at each boundary:

    for i in range(N):
        a, b = cu_seqlens[i], cu_seqlens[i + 1]
        states = initial_states[i] if given else zeros          # each [N, ...] in place of the batch axis
        y[:, a:b], final_states[i] = run(inputs[:, a:b], params, states)

so the outputs are packed as the inputs are, and each state comes back per sequence, [N, ...] with N in
place of the batch axis. The batch axis is the first axis of the first state that every sequence and
state has and no param does (``b`` in every example; `batch_axis`).

The general path runs exactly that loop: one call per sequence over its time slice, so the work
follows the total length T (no padding to the longest sequence), gradients flowing through torch's
autograd over the slices and the concatenation; its cost is a call (kernel launches, host time) per
sequence. A call that gives no initial states and wants no final states (a training step on packed
batches) runs as ONE call instead, of `reset_program`: the program with one more sequence,

    reset[t] = 1 where the step after t starts a new sequence (in the program's time order), else 0
    new carry = (1 - reset[t]) * update(carry, inputs[t])       every state, every step

so each sequence starts from the zero states a call of its own starts from, and the outputs (which
read the unmasked update) are those of the sequences alone. A diagonal-linear program stays diagonal
linear (a and b scaled by 1 - reset) and takes its scans; a matrix-linear one (whose chunked core
takes the log of its decay) keeps the per-sequence calls.

Attention (`ssmc.attention`) takes ``cu_seqlens=`` the same way (`attention_call`): q, k, v packed along
time in a batch of 1, each query seeing only the keys of its own sequence, q_idx and kv_idx counted from
the sequence's first step (a causal mask, ALiBi, a window apply within it):

    for i in range(N):
        a, b = cu_seqlens[i], cu_seqlens[i + 1]
        c, e = cu_seqlens_k[i], cu_seqlens_k[i + 1]          # cu_seqlens_k defaults to cu_seqlens
        out[:, a:b] = attention(q[:, a:b], k[:, c:e], v[:, c:e], params)

run as that loop: one call per sequence (its kernels compiled once for all lengths, the lengths being
launch arguments), so the work follows the total length; the params' gradients are sums over the
sequences, q's, k's and v's the sequences' gradients packed.
"""

from __future__ import annotations

import sys
from functools import lru_cache
from itertools import pairwise

import numpy as np

ARGUMENT = "cu_seqlens"
RESET = "cu_seqlens_reset"  # the sequence `reset_program` adds


def batch_axis(program) -> str:
    """The batch axis: the first axis of the first state (else sequence) that every sequence and state has
    and no param does (``b`` in every example); a ValueError where there is none."""
    arrays = [s.axes for s in program.states] + [d.axes for d in program.seqs]
    in_params = {a for d in program.params for a in d.axes}
    for a in arrays[0] if arrays else ():
        if a not in in_params and all(a in axes for axes in arrays):
            return a
    raise ValueError(f"{ARGUMENT}: {program.name} has no batch axis (an axis of every sequence and state and "
                     f"of no param)")


def offsets(cu_seqlens, total: int, name: str = ARGUMENT) -> list[int]:
    """`cu_seqlens` as a list of ints, checked: 1-D integers, 0 first, increasing, `total` last (a
    ValueError naming the argument, `name`, else)."""
    if hasattr(cu_seqlens, "detach"):  # torch
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    elif hasattr(cu_seqlens, "get") and not isinstance(cu_seqlens, (dict, np.ndarray)):  # cupy
        cu_seqlens = cu_seqlens.get()
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2:
        raise ValueError(f"{name}: a 1-D array [N+1] of at least two offsets, not shape {cu.shape}")
    if cu.dtype.kind not in "iu":
        raise ValueError(f"{name}: integer offsets, not dtype {cu.dtype}")
    cu = [int(c) for c in cu]
    if cu[0] != 0:
        raise ValueError(f"{name}: the first offset is 0, not {cu[0]}")
    if any(b <= a for a, b in pairwise(cu)):
        raise ValueError(f"{name}: offsets strictly increasing (every sequence at least one step), not {cu}")
    if cu[-1] != total:
        raise ValueError(f"{name}: the last offset is the packed length {total}, not {cu[-1]}")
    return cu


def _take(x, position: int, start: int, stop: int):
    return x[(slice(None),) * position + (slice(start, stop),)]


def _concatenate(parts: list, position: int):
    first = parts[0]
    if hasattr(first, "detach"):  # torch: autograd follows the cat
        import torch

        return torch.cat(parts, dim=position)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(first, cupy.ndarray):
        return cupy.concatenate(parts, axis=position)
    return np.concatenate(parts, axis=position)


def checked(program, layout, inputs: dict, states: dict, cu_seqlens) -> tuple[list[int], dict[str, int]]:
    """(the offsets as ints, each sequence's time position in `layout`), after checking a packed call:
    sequences in a batch of 1, offsets that cover their time axis, an initial state per sequence; a
    ValueError naming the argument else."""
    from .ir.axes import TIME
    from .runtime.binding import layout_of

    batch = batch_axis(program)
    seq_time = {}
    for d in program.seqs:
        order = layout_of(layout, d.name, d.axes)
        seq_time[d.name] = order.index(TIME)
        size = inputs[d.name].shape[order.index(batch)]
        if size != 1:
            raise ValueError(f"{ARGUMENT}: sequences are packed along time in a batch of 1; "
                             f"{d.name!r} has a batch of {size}")
    first = program.seqs[0].name
    cu = offsets(cu_seqlens, int(inputs[first].shape[seq_time[first]]))
    n = len(cu) - 1
    for s in program.states:
        if s.name in states and states[s.name].shape[s.axes.index(batch)] != n:
            position = s.axes.index(batch)
            raise ValueError(f"{ARGUMENT}: {n} sequences, so initial state {s.name!r} has {n} along its batch "
                             f"axis {batch!r} (position {position}), not {states[s.name].shape[position]}")
    return cu, seq_time


def call(run, program, layout, inputs: dict, states: dict, cu_seqlens) -> tuple[tuple, tuple]:
    """The packed call (module docstring): `run(inputs, states)` runs one sequence, both dicts by name,
    and returns (the outputs in program order, the final states in state order), in `layout`; `inputs`
    holds every input (sequences packed, batch 1), `states` the initial states given ([N, ...]).
    Returns the outputs packed and the final states per sequence, as `run` orders them."""
    from .ir.axes import TIME
    from .runtime.binding import layout_of

    cu, seq_time = checked(program, layout, inputs, states, cu_seqlens)
    state_batch = {s.name: s.axes.index(batch_axis(program)) for s in program.states}
    ys, finals = [], []
    # the sequences cut by one split each (torch: its backward one concatenation, where a slice a sequence would
    # each scatter into a zero tensor of the whole input's size: O(N T) work)
    pieces = {k: _split(x, seq_time[k], cu) for k, x in inputs.items() if k in seq_time}
    for i, _ in enumerate(pairwise(cu)):
        one = {k: pieces[k][i] if k in pieces else x for k, x in inputs.items()}
        h0 = {k: _take(h, state_batch[k], i, i + 1) for k, h in states.items()}
        y, f = run(one, h0)
        ys.append(y)
        finals.append(f)
    out_time = [layout_of(layout, name, y.axes).index(TIME) for name, y in program.outputs]
    packed = tuple(_concatenate([y[k] for y in ys], pos) for k, pos in enumerate(out_time))
    per_sequence = tuple(_concatenate([f[k] for f in finals], state_batch[s.name])
                         for k, s in enumerate(program.states))
    return packed, per_sequence


@lru_cache(maxsize=64)
def reset_program(program):
    """`program` with the sequence RESET [batch] that restarts its states (module docstring), or None
    where the one-call path does not apply: no states, no batch axis, a name taken, or a core the chunked
    matrix-linear path takes (`passes.matrix_linear`)."""
    from .ir import build
    from .ir.node import Node
    from .ir.ops import Op
    from .ir.program import Decl, Recurrence, Role
    from .passes.matrix_linear import matrix_linear

    if not program.states or any(d.name == RESET for d in program.decls):
        return None
    if not isinstance(matrix_linear(program), str):  # the chunked core takes it (a reset would hide its form)
        return None
    try:
        batch = batch_axis(program)
    except ValueError:
        return None
    keep = build.sub(build.ONE, Node.make(Op.INPUT, (), RESET, (batch,)))
    updates = tuple(build.expand(build.mul(u, keep), s.axes) for u, s in zip(program.updates, program.states))
    decls = (*program.decls, Decl(RESET, Role.SEQ, (batch,), program.loc))
    return Recurrence(f"{program.name}_packed", decls, updates, program.outputs, program.sizes, program.reverse,
                      program.loc, program.doc)


def reset_sequence(program, layout, cu: list[int], like):
    """RESET's array for `reset_program(program)` in `layout` (batch 1, time T = cu[-1]; `cu` the
    offsets as `checked` returns them), of `like`'s kind, dtype and device: 1 at the last step of every
    sequence but the last (at the first step of every sequence but the first, for a program that runs
    time backward), 0 elsewhere."""
    from .ir.axes import TIME
    from .runtime.binding import layout_of

    order = layout_of(layout, RESET, (batch_axis(program),))
    steps = cu[1:-1] if program.reverse else [c - 1 for c in cu[1:-1]]
    flat = np.zeros(cu[-1])
    flat[steps] = 1.0
    values = flat.reshape([cu[-1] if a == TIME else 1 for a in order])
    if hasattr(like, "detach"):  # torch
        import torch

        return torch.as_tensor(values, dtype=like.dtype, device=like.device)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(like, cupy.ndarray):
        return cupy.asarray(values, dtype=like.dtype)
    dtype = np.asarray(like).dtype
    return values.astype(dtype if dtype.kind == "f" else np.float64)


# -- attention (module docstring): a call per sequence, no states -----------------------------------------

ARGUMENT_K = "cu_seqlens_k"


def attention_batch_axis(program) -> str | None:
    """The batch axis of an `Attention` program, which a packed call must have of size 1: of two or more batch
    axes, the first that no param has and that is not `kv_heads` (``b`` of ``batch="b h"``); None where there is
    one batch axis alone (the heads: flash-attn's varlen layout [T, H, d] is ``batch="h"``, layout "t h ...") or
    none qualifies (the sequences then share every batch axis, and no size is checked)."""
    if len(program.batch_axes) < 2:
        return None
    in_params = {a for d in program.params for a in d.axes}
    for a in program.batch_axes:
        if a not in in_params and a != program.kv_heads:
            return a
    return None


def _split(x, position: int, cu: list[int]) -> list:
    """`x` cut along axis `position` at the offsets `cu` (views). torch's split, whose backward
    concatenates the pieces' gradients: slices would each scatter into a zero tensor of x's size."""
    if hasattr(x, "detach"):  # torch
        import torch

        return list(torch.split(x, [b - a for a, b in pairwise(cu)], dim=position))
    cupy = sys.modules.get("cupy")
    xp = cupy if cupy is not None and isinstance(x, cupy.ndarray) else np
    return xp.split(x, cu[1:-1], axis=position)


def attention_checked(program, layout, q, k, v, cu_seqlens, cu_seqlens_k=None
                      ) -> tuple[list[int], list[int], dict[str, int]]:
    """(the query offsets, the key offsets, each of q, k, v's time position in `layout`) after checking
    a packed attention call: q, k, v arrays of their layouts' ranks, a batch of 1 along
    `attention_batch_axis`, offsets that cover q's time axis (`cu_seqlens`) and k's and v's
    (`cu_seqlens_k`, else `cu_seqlens` again), as many sequences in both; a ValueError naming the
    argument else, before any compute."""
    from .ir.axes import TIME
    from .runtime.binding import layout_of

    if cu_seqlens is None:
        raise ValueError(f"{ARGUMENT_K} is given without {ARGUMENT}")
    if program.seqs:  # document ids already say what cu_seqlens would: one or the other
        raise ValueError(f"{ARGUMENT} with the sequence inputs {[d.name for d in program.seqs]}: pass the packed "
                         "batch whole, its document ids masking across documents")
    batch = attention_batch_axis(program)
    arrays = {"q": (q, program.q_axes), "k": (k, program.q_axes), "v": (v, program.v_axes)}
    time, lengths = {}, {}
    for name, (x, axes) in arrays.items():
        order = layout_of(layout, name, axes)
        shape = tuple(x.shape)
        if len(shape) != len(order):
            raise ValueError(f"argument {name!r} has shape {shape}, expected {len(order)} axes "
                             f"({' '.join(order)})")
        time[name] = order.index(TIME)
        lengths[name] = shape[time[name]]
        if batch is not None and shape[order.index(batch)] != 1:
            raise ValueError(f"{ARGUMENT}: sequences are packed along time in a batch of 1; {name!r} has "
                             f"{shape[order.index(batch)]} along {batch!r}")
    cu = offsets(cu_seqlens, lengths["q"])
    if cu_seqlens_k is None:
        if lengths["k"] != lengths["q"]:
            raise ValueError(f"{ARGUMENT}: q has {lengths['q']} steps but 'k' {lengths['k']}; give "
                             f"{ARGUMENT_K} for keys packed apart from the queries")
        cu_k = cu
    else:
        cu_k = offsets(cu_seqlens_k, lengths["k"], ARGUMENT_K)
        if len(cu_k) != len(cu):
            raise ValueError(f"{ARGUMENT_K}: {len(cu) - 1} query sequences ({ARGUMENT}) but {len(cu_k) - 1} "
                             f"key sequences")
    if lengths["v"] != lengths["k"]:
        raise ValueError(f"{ARGUMENT}: 'k' has {lengths['k']} steps but 'v' {lengths['v']}")
    return cu, cu_k, time


def attention_call(run, program, layout, q, k, v, cu_seqlens, cu_seqlens_k=None, return_lse: bool = False):
    """The packed attention call (module docstring): `run(q_i, k_i, v_i)` runs one sequence (its slices,
    in `layout`) and returns out (and lse with `return_lse`) in `layout`; returns the same packed along
    time. q, k, v: arrays (NumPy, torch, CuPy) with a shape."""
    from .ir.axes import TIME
    from .runtime.binding import layout_of

    cu, cu_k, time = attention_checked(program, layout, q, k, v, cu_seqlens, cu_seqlens_k)
    pieces = zip(_split(q, time["q"], cu), _split(k, time["k"], cu_k), _split(v, time["v"], cu_k))
    results = [run(*one) for one in pieces]
    out_time = layout_of(layout, "out", program.v_axes).index(TIME)
    if not return_lse:
        return _concatenate(results, out_time)
    lse_time = layout_of(layout, "lse", program.batch_axes).index(TIME)
    return (_concatenate([r[0] for r in results], out_time), _concatenate([r[1] for r in results], lse_time))


def attention_gradients(run, program, layout, q, k, v, grad_outputs, cu_seqlens, cu_seqlens_k=None) -> dict:
    """`ssmc.grad`'s packed attention call: `run(q_i, k_i, v_i, d_out_i)` gives one sequence's gradients
    {"q", "k", "v", param names} (`d_out_i` its slice of `grad_outputs`, or None for zeros); returns q's,
    k's and v's packed along time (in `layout`) and each param's summed over the sequences."""
    from .ir.axes import TIME
    from .runtime.binding import layout_of

    cu, cu_k, time = attention_checked(program, layout, q, k, v, cu_seqlens, cu_seqlens_k)
    n = len(cu) - 1
    if grad_outputs is None:
        d_outs = [None] * n
    else:
        if not hasattr(grad_outputs, "shape"):
            grad_outputs = np.asarray(grad_outputs)
        order = layout_of(layout, "out", program.v_axes)
        if len(grad_outputs.shape) != len(order) or grad_outputs.shape[order.index(TIME)] != cu[-1]:
            raise ValueError(f"grad_outputs has shape {tuple(grad_outputs.shape)}, expected {len(order)} axes "
                             f"({' '.join(order)}) with {cu[-1]} steps along time")
        d_outs = _split(grad_outputs, order.index(TIME), cu)
    pieces = zip(_split(q, time["q"], cu), _split(k, time["k"], cu_k), _split(v, time["v"], cu_k), d_outs)
    results = [run(*one) for one in pieces]
    grads = {name: _concatenate([r[name] for r in results], time[name]) for name in ("q", "k", "v")}
    for d in program.params:
        total = results[0][d.name]
        for r in results[1:]:
            total = total + r[d.name]
        grads[d.name] = total
    return grads

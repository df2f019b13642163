"""What every call does before its backend's work: `ssmc.compile`'s, `ssmc.grad`'s and the torch function's.

    bound, dtype = bind_call(backend, program, args, kwargs, layout, requested_dtype)

checks the layout (`check_layout`), binds the arguments to the program's inputs and states as the
backend's arrays (`Backend.array_support`, `bind_arrays`: names, dimensions and axis sizes, a
ValueError naming the argument before any work is done), checks the arrays together
(`Backend.check_arrays`: one device) and picks the compute dtype (`Backend.compute_dtype`).

Where a backend prepares calls (`Backend.call_key`), a call like an earlier one skips the prologue:
`PreparedCalls` keeps, per call key and layout, what the first such call worked out.
"""

from __future__ import annotations

import numpy as np

from ..frontend.spec import RecurrenceSpec
from ..ir.program import Attention, Decl, Recurrence, Role
from .binding import MAX_PREPARED_CALLS, Bound, bind_arrays, check_layout, hashable_layout


def program_of(spec) -> Recurrence:
    """The recurrence of an ``@ssmc.recurrence`` spec (or a `Recurrence` as it is); TypeError else."""
    if isinstance(spec, RecurrenceSpec):
        return spec.program
    if isinstance(spec, Recurrence):
        return spec
    raise TypeError(f"expected an @ssmc.recurrence spec, got {type(spec).__name__}")


def bind_call(backend, program: Recurrence, args: tuple, kwargs: dict, layout, requested=None,
              read_only_zeros: bool = False) -> tuple[Bound, np.dtype]:
    """(the call's arguments bound to `program`, time first, as `backend`'s arrays; its compute dtype).

    `requested`: the dtype the caller fixed (None: as the inputs are); `read_only_zeros`: the caller
    never writes nor returns the zero initial states (a forward: `Backend.array_support`)."""
    check_layout(layout, program)
    convert, zeros = backend.array_support(read_only_zeros)
    bound = bind_arrays(program.inputs, program.states, args, kwargs, layout, program.static_sizes, program.name,
                        program.roots, convert, zeros)
    backend.check_arrays({**bound.arrays, **bound.initial})
    return bound, backend.compute_dtype(bound.dtype, requested)


class PreparedCalls(dict):
    """Call key (`key`) -> what a backend worked out once for calls alike (a prepared run, a training
    step, or a false value: none applies), at most `MAX_PREPARED_CALLS` (calls of ever new shapes:
    start over)."""

    @staticmethod
    def key(backend, args: tuple, kwargs: dict, layout) -> tuple | None:
        """The key of a call (`Backend.call_key` and the layout), or None where the backend prepares
        no call like it."""
        key = backend.call_key(args, kwargs)
        return None if key is None else (hashable_layout(layout), *key)

    def remember(self, key, value):
        """Keep `value` for calls of `key`; returns it."""
        if len(self) >= MAX_PREPARED_CALLS:
            self.clear()
        self[key] = value
        return value


def attention_params(program: Attention, args: tuple, params: dict) -> dict:
    """The modifiers' params by name, from those given after q, k, v in their order (`args`) and by
    name (`params`)."""
    names = [d.name for d in program.inputs]
    if len(args) > len(names):
        raise ValueError(f"{program.name} takes q, k, v and the params {names}, got {3 + len(args)} "
                         "positional arguments")
    params = dict(params)
    for name, value in zip(names, args):
        if name in params:
            raise ValueError(f"{program.name}: argument {name!r} given twice")
        params[name] = value
    return params


def bind_attention(program: Attention, q, k, v, layout, params: dict, convert=None,
                   repeat: bool = True) -> tuple[Bound, Bound, int]:
    """(q and the params bound, k / v bound, the GQA group): time first, NumPy (or as `convert(x, name)`
    makes each argument). k and v share a length, q may differ: the two groups are bound separately,
    then their sizes checked against each other. Along `program.kv_heads` k and v may have fewer heads
    than q (a divisor of q's, group = Hq / Hkv): with `repeat` they come back repeated to q's heads, each
    KV head `group` times in a row, so that query head h reads KV head h // group, and the caller sums
    their gradients back over the group (`group_sum`); without, as given (k's and v's sizes keep their
    own heads), for a caller that reads KV head h // group itself."""
    qd = Decl("q", Role.SEQ, program.q_axes)
    kd = Decl("k", Role.SEQ, program.q_axes)
    vd = Decl("v", Role.SEQ, program.v_axes)
    static = program.static_sizes
    qb = bind_arrays((qd, *program.inputs), (), (q,), params, layout, static, program.name, convert=convert)
    kv_static = {a: n for a, n in static.items() if a != program.kv_heads}
    kv = bind_arrays((kd, vd), (), (k, v), {}, layout, kv_static, program.name, convert=convert)
    group = 1
    for axis, n in qb.sizes.items():
        m = kv.sizes.get(axis, n)
        if m == n:
            continue
        if axis != program.kv_heads:
            hint = "" if program.kv_heads else " (ssmc.attention(..., kv_heads=...) lets k and v have fewer heads)"
            raise ValueError(f"axis {axis!r} has size {n} in 'q' but {m} in 'k'/'v'{hint}")
        if m < 1 or n % m:
            raise ValueError(f"'k'/'v' have {m} heads along {axis!r}, which does not divide the {n} of 'q'")
        group = n // m
        if not repeat:
            continue
        at = 1 + program.batch_axes.index(axis)  # time first
        for name in ("k", "v"):
            kv.arrays[name] = repeat_heads(kv.arrays[name], group, at)
        kv.sizes[axis] = n
    return qb, kv, group


def repeat_heads(x, times: int, axis: int):
    """`x` with each index along `axis` repeated `times` in a row (NumPy or torch): GQA's KV heads
    as the query heads that read them."""
    if isinstance(x, np.ndarray):
        return np.repeat(x, times, axis=axis)
    if times == 1:
        return x
    # a broadcast view copied once (a plain copy; torch's repeat_interleave gathers through an index)
    shape = (*x.shape[:axis], x.shape[axis] * times, *x.shape[axis + 1:])
    return x.unsqueeze(axis + 1).expand(*x.shape[:axis + 1], times, *x.shape[axis + 1:]).reshape(shape)


def group_sum(x, group: int, axis: int):
    """The gradient of `repeat_heads`: `x` summed over each run of `group` indices along `axis`."""
    if group == 1:
        return x
    shape = (*x.shape[:axis], x.shape[axis] // group, group, *x.shape[axis + 1:])
    return x.reshape(shape).sum(axis + 1)

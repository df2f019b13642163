"""The torch function's training step at the least host time a call, for calls like one a
`prepared.PreparedStep` served: a forward is one allocation, one launch and the outputs' views, a
backward one allocation and memset, one launch and the gradients' views. `Grad.__call__` takes it
too, for the gradients alone.
"""

from __future__ import annotations

from ..passes.autodiff import GRAD
from .prepared import PreparedStep
from .tape import Tape

# Where each of a kernel's arrays comes from, per call (`LeanStep`): an argument, an offset of the
# call's buffer, an array the step keeps (its address), a cotangent, an offset of the forward's buffer
ARGUMENT, BUFFER, KEPT, COTANGENT, FORWARD_BUFFER = range(5)


class LeanStep:
    """The torch op's training step (ssmc/torch.py) for calls like one a `PreparedStep` served, at the
    least host time a call: a forward is one allocation, one launch and the outputs' views, made in
    their layouts; a backward one allocation and memset, one launch and the gradients' views. Where
    each of the kernels' arrays comes from is worked out once (`_sources`). At a small shape every
    torch call of the host counts (bench/results/ has the measurements).

    `names`: the op's arguments (the inputs, then the initial states given), as it passes them to
    `Grad.forward`; `output_perms`: per output, its name and permutation from time first to its
    layout. `forward(tensors)` returns (outputs + final states, the forward's buffer);
    `backward(tensors, buffer, cotangents)` the gradients in the order of `names`, then (with
    `gradients_only`, for `Grad.__call__`, which returns them too) of the initial states not among
    them (`returned`), or None where the cotangents do not suit (one of the final states, or one of
    other shape, strides or dtype than the first backward's): the caller then takes the general path
    with `tape(tensors, buffer)`.
    `gradients_only`: the forward a call that wants no outputs runs (`PreparedStep.run_summary`,
    which a call through `PreparedStep.forward` prepared), its outputs not returned."""

    def __init__(self, step: PreparedStep, names: list[str], output_perms: list[tuple[str, list[int]]],
                 gradients_only: bool = False):
        self.step, self.names = step, names
        self.returned = names + ([s.name for s in step.program.states if s.name not in names] if gradients_only
                                 else [])
        if gradients_only:  # `Grad.__call__`'s gradients in the general path's order (inputs, then states):
            order = [*(d.name for d in step.program.inputs), *(s.name for s in step.program.states)]
            self.order = [(n, self.returned.index(n)) for n in order]  # each name and its place in `returned`
        self.output_names = [n for n, _ in output_perms]
        prepared = step.run_summary if gradients_only else step.run_forward
        self.forward_launch, self.length = prepared.launch, prepared.length
        self.arguments = {name: i for i, name in enumerate(names)}
        self.arguments.update((f"init_{s}", self.arguments[s]) for s in step.given_states if s in self.arguments)
        self.kept = {f"init_{s}": t for s, t in step.zeros.items()}  # zero initial states: only read
        self.forward_sources = self._sources(self.forward_launch, {}, {})
        self.forward_slots = _slots(self.forward_sources)
        allocated = {a.name: a for a in self.forward_launch.allocations}
        self.outputs = [] if gradients_only else [_view(allocated[f"out_{n}"], perm) for n, perm in output_perms]
        self.outputs += [_view(allocated[f"final_{s.name}"], None, [step.sizes[a] for a in s.axes])
                         for s in step.program.states]
        self.rounds = {s.name: allocated[f"rounds_{s.name}"] for s in step.program.states}
        self.backward = self._first_backward

    @classmethod
    def build(cls, step, names: list[str], output_perms: list[tuple[str, list[int]]], tensors: list,
              gradients_only: bool = False):
        """The lean step of calls like one with `tensors` that `step` served, or None: where the
        tensors are not of the compute dtype (the general path casts them) or the outputs in their
        layouts are not contiguous (the op returns them contiguous: the general path copies them)."""
        from ..backends.cuda.backward_launch import PreparedLaunch

        forward = getattr(step, "run_summary" if gradients_only else "run_forward", None)
        if not isinstance(step, PreparedStep) or not isinstance(forward, PreparedLaunch):
            return None
        if any(t.dtype != step.compute for t in tensors):
            return None
        try:
            lean = cls(step, names, output_perms, gradients_only)
        except KeyError:  # a kernel array it does not know where from: the general path
            return None
        return lean if all(_contiguous(shape, strides) for shape, strides, _ in lean.outputs) else None

    def _sources(self, launch, cotangents: dict, forward_buffer: dict) -> tuple:
        """Per kernel array of `launch` (in order): (kind, value) as the kinds above say; `cotangents`
        and `forward_buffer` (byte offsets) by kernel array name."""
        offsets = {a.name: a.offset * launch.dtype.itemsize for a in launch.allocations}
        out = []
        for name in launch.names:
            if name in self.arguments:
                out.append((ARGUMENT, self.arguments[name]))
            elif name in cotangents:
                out.append((COTANGENT, cotangents[name]))
            elif name in forward_buffer:
                out.append((FORWARD_BUFFER, forward_buffer[name]))
            elif name in offsets:
                out.append((BUFFER, offsets[name]))
            else:
                out.append((KEPT, self.kept[name].data_ptr()))
        return tuple(out)

    def forward(self, tensors: tuple):
        import torch

        launch = self.forward_launch
        buffer = launch.buffer()
        base = buffer.data_ptr()
        pointers, arguments, offsets = self.forward_slots[:3]
        pointers = pointers.copy()
        for slot, i in arguments:
            pointers[slot] = tensors[i].data_ptr()
        for slot, offset in offsets:
            pointers[slot] = base + offset
        launch.launch_pointers(pointers, self.length)
        as_strided = torch.as_strided
        return tuple([as_strided(buffer, *view) for view in self.outputs]), buffer

    @property
    def lean_backward(self) -> bool:
        """Whether a backward is (still, or from the second one on) one launch and views: where the first
        one found the gradients' views not contiguous, or a kernel array it did not know, none is."""
        return self.backward in (self._first_backward, self._lean_backward)

    def tape(self, tensors: tuple, buffer) -> Tape:
        """The tape `Grad.backward` takes for this call (the general path)."""
        import torch

        tape = self.step._arrays((), dict(zip(self.names, tensors)))[3]
        tape.rounds = {s: torch.as_strided(buffer, a.shape, a.strides, a.offset) for s, a in self.rounds.items()}
        return tape

    def _first_backward(self, tensors: tuple, buffer, cotangents: tuple):
        """The first backward: through `PreparedStep.backward`, whose launch it then keeps for the
        later ones (`_lean_backward`), where the cotangents are the outputs' and torch CUDA tensors."""
        n_out = len(self.output_names)
        if any(c is None for c in cotangents[:n_out]) or any(c is not None for c in cotangents[n_out:]):
            return None
        tape = self.tape(tensors, buffer)
        given = dict(zip(self.output_names, cotangents))
        found = self.step._cotangents(tape, given, None)
        if found is None:
            return None
        (_, launch, lam), cot = found
        outs, finals = launch(tape.seqs, tape.params, tape.rounds, cot, lam, {})
        grads = self.step._in_layouts(outs, finals)
        # the later backwards: cotangents like these, the other kernel arrays as this one had them
        self.cotangent_like = [(c.shape, c.stride(), c.dtype) for c in cotangents[:n_out]]
        self.kept.update((f"init_{n}", v) for n, v in lam.items())
        try:
            self._plan_backward(launch.launch, tensors)
        except KeyError:  # a kernel array it does not know where from: the general path from now on
            self.backward = lambda *args: None
        return tuple(grads[n] for n in self.returned)

    def _plan_backward(self, launch, tensors: tuple) -> None:
        """Where the backward's arrays come from, and its gradients' views in the arguments' layouts;
        the later backwards lean where those are contiguous (the general path copies them else)."""
        rounds = {f"rounds_{s}": a.offset * self.forward_launch.dtype.itemsize for s, a in self.rounds.items()}
        self.backward_sources = self._sources(launch, {GRAD + n: i for i, n in enumerate(self.output_names)}, rounds)
        self.backward_slots = _slots(self.backward_sources)
        allocated = {a.name: a for a in launch.allocations}
        self.gradients = []
        shapes = [list(t.shape) for t in tensors]
        shapes += [[self.step.sizes[a] for a in self.step.program.decl(n).axes] for n in self.returned[len(tensors):]]
        for name, shape in zip(self.returned, shapes):
            a = allocated.get(f"out_{GRAD}{name}") or allocated[f"final_{GRAD}{name}"]
            perm = self.step.to_layout.get(name)
            self.gradients.append(_view(a, perm, None if perm else shape))
        self.backward_launch = launch
        # the kernel reads the cotangents as they are: in the compute dtype only
        lean = all(_contiguous(shape, strides) for shape, strides, _ in self.gradients) and \
            all(dtype == self.step.compute for _, _, dtype in self.cotangent_like)
        self.backward = self._lean_backward if lean else (lambda *args: None)

    def _lean_backward(self, tensors: tuple, buffer, cotangents: tuple):
        import torch

        n_out = len(self.output_names)
        cot = list(cotangents[:n_out])
        if len(cotangents) > n_out and any(c is not None for c in cotangents[n_out:]):
            return None
        for i, (c, (shape, strides, dtype)) in enumerate(zip(cot, self.cotangent_like)):
            if c is None or c.dtype != dtype or c.shape != shape:
                return None
            if c.stride() != strides:
                c = cot[i] = c.contiguous()
                if c.stride() != strides:
                    return None
        launch = self.backward_launch
        grads = launch.buffer()
        base, forward = grads.data_ptr(), buffer.data_ptr()
        pointers, arguments, offsets, given, saved = self.backward_slots
        pointers = pointers.copy()
        for slot, i in arguments:
            pointers[slot] = tensors[i].data_ptr()
        for slot, offset in offsets:
            pointers[slot] = base + offset
        for slot, i in given:
            pointers[slot] = cot[i].data_ptr()
        for slot, offset in saved:
            pointers[slot] = forward + offset
        launch.launch_pointers(pointers, self.length)
        as_strided = torch.as_strided
        return tuple([as_strided(grads, *view) for view in self.gradients])


def _slots(sources: tuple) -> tuple:
    """`sources` (`LeanStep._sources`) as a launch fills its pointers: (the pointers with the kept arrays'
    addresses in their slots, then per kind of the others, ARGUMENT, BUFFER, COTANGENT, FORWARD_BUFFER,
    its [(slot, value)]), so that a call writes each slot without asking its kind."""
    pointers = [v if k == KEPT else 0 for k, v in sources]
    return (pointers, *([(slot, v) for slot, (k, v) in enumerate(sources) if k == kind]
                        for kind in (ARGUMENT, BUFFER, COTANGENT, FORWARD_BUFFER)))


def _contiguous(shape, strides) -> bool:
    """Whether a view of `shape` and `strides` is contiguous (as torch's `is_contiguous` says)."""
    expected = 1
    for n, st in zip(reversed(shape), reversed(strides)):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


def _view(a, perm: list[int] | None, shape: list[int] | None = None) -> tuple:
    """(shape, strides, offset) of allocation `a` in another layout: its axes permuted by `perm`, or
    (contiguous as it is) reshaped to `shape`."""
    if perm is not None:
        return [a.shape[i] for i in perm], [a.strides[i] for i in perm], a.offset
    if shape is None or list(a.shape) == list(shape):
        return list(a.shape), list(a.strides), a.offset
    from ..backends.cuda.printer import contiguous_strides

    return list(shape), list(contiguous_strides(shape)) if shape else [], a.offset

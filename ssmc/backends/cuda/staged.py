"""Prepared runs of a layer run in stages around a chunked core (`passes/matrix_linear.chunk_stages`: a
state-free pre stage, the matrix-linear core, a state-free post stage; Mamba-2 / SSD, RetNet, GLA).

`base.run_stages` chains the stages' runs and every run works its call out again: the stage's run
function looked up, its strategy and launches planned, its dtypes decided. For calls alike (the same
`Backend.call_key`: shapes, strides, dtypes, devices, overrides) all of that holds, so `StagedPreparer`
keeps it: per stage the names it reads, the dtypes it writes, and its run, prepared at its first call
(`CudaRunner.prepare`: the launches of a map stage worked out once) or the stage's run function (the
chunked core). As a plain loop, a prepared call is

    for stage in stages:
        outputs, finals = stage.run(the call's and earlier stages' sequences it reads, its params, states)
        intermediates += the outputs it writes for later stages; results += the others

The stages read their sequences time first (the core permutes them), so `time_first` tells
`api.Compiled` to pass them so.
"""

from __future__ import annotations

from ..base import Runner


def staged_preparer(backend, program, dtype) -> StagedPreparer | None:
    """The `StagedPreparer` of `program` where the CUDA backend runs it as stages around a chunked core
    (not as one "rows" kernel: `runner.layer_runner`), else None; one per program and dtype."""
    from ...passes.matrix_linear import chunk_stages
    from .options import options
    from .runner import runner_for

    if options().chunked is False or chunk_stages(program) is None:
        return None
    key = (program, dtype.name, options().key)
    found = _PREPARERS.get(key)
    if found is None:
        if len(_PREPARERS) >= 64:
            _PREPARERS.clear()
        found = _PREPARERS[key] = (StagedPreparer(backend, program, dtype)
                                   if runner_for(program, dtype.name).row_axis is None else False)
    return found or None


_PREPARERS: dict = {}


class StagedPreparer:
    """``prepare(seqs, params, initial, sizes, length, out_dtype) -> call`` of a chunk-staged program
    (module docstring), for `Backend.preparer`."""

    def __init__(self, backend, program, dtype):
        self.fused = backend.stages(program)
        self.backend, self.dtype = backend, dtype
        self.runs: list[Runner] = [backend.compiled(st.program, dtype) for st in self.fused.stages]
        self.preparers = [backend.preparer(st.program, dtype) for st in self.fused.stages]
        self.dtypes = backend.stage_dtypes(self.fused, dtype)

    def __call__(self, seqs, params, initial, sizes, length, out_dtype=None):
        return _StagedCall(self, sizes, length, out_dtype)


class _StagedCall:
    """A prepared call (`StagedPreparer`): ``call(seqs, params, initial) -> (outputs, finals)`` as
    `run_stages` returns them. Each stage's run is prepared at the call's first run of it, on that
    call's arrays (the intermediates' layouts are then known), and taken as it is afterwards."""

    time_first = True  # the call's sequences go time first (`api._bound_call`)

    def __init__(self, preparer: StagedPreparer, sizes, length, out_dtype):
        fused = preparer.fused
        self.preparer, self.sizes, self.length, self.out_dtype = preparer, sizes, length, out_dtype
        self.stages = [([d.name for d in st.program.seqs], [d.name for d in st.program.params],
                        [s.name for s in st.program.states], set(st.writes)) for st in fused.stages]
        self.outputs = [n for n, _ in fused.program.outputs]
        self.states = [s.name for s in fused.program.states]
        self.runs: list = [None] * len(fused.stages)  # per stage: (its prepared run, its out_dtype keyword)

    def _stage_run(self, index: int, values: dict, seqs: dict, params: dict, initial: dict):
        """Stage `index`'s run for calls like this one, worked out on this call's arrays (`values`: the
        call's and the earlier stages' sequences, as `run_stages` hands `Backend.stage_dtypes`)."""
        prep = self.preparer
        own = prep.dtypes(index, values, self.sizes, self.out_dtype) if prep.dtypes is not None else None
        keywords = {} if own is None else {"out_dtype": own}
        prepare = prep.preparers[index]
        call = prepare and prepare(seqs, params, initial, self.sizes, self.length, **keywords)
        if call:
            return call
        run, sizes, length = prep.runs[index], self.sizes, self.length
        return lambda seqs, params, initial: run(seqs, params, initial, sizes, length, **keywords)

    def __call__(self, seqs, params, initial):
        values = dict(seqs)
        outs, finals = {}, {}
        out_dtype = self.out_dtype
        for index, (seq_names, param_names, state_names, writes) in enumerate(self.stages):
            stage_seqs = {n: values[n] for n in seq_names}
            stage_params = {n: params[n] for n in param_names}
            stage_initial = {n: initial[n] for n in state_names}
            run = self.runs[index]
            if run is None:
                run = self.runs[index] = self._stage_run(index, values, stage_seqs, stage_params, stage_initial)
            got, fin = run(stage_seqs, stage_params, stage_initial)
            finals.update(fin)
            for name, value in got.items():
                if name in writes:
                    values[name] = value
                else:  # as `run_stages`: no copy where so already
                    outs[name] = value if out_dtype is None else value.to(out_dtype)
        return {n: outs[n] for n in self.outputs}, {s: finals[s] for s in self.states}


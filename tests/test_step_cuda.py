"""`ssmc.step` on the cuda backend (#43 item 4): stepping L times equals the full-sequence call for every
recurrence example, its kernels emulated on the CPU (``SSMC_CUDA_EMULATE=1``, torch CPU tensors, float32),
the kernels a step launches counted; ``out=`` and ``in_place=True`` write the given arrays and equal the
allocating call (interpreter, NumPy; emulated cuda, torch); and on a GPU (marked `gpu`) the same examples
in float32, mamba1 and mamba2 in bf16 too."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from profiles import nightly_case

import ssmc
from ssmc.api import time_positions
from ssmc.backends.cuda import emulator
from ssmc.complex_io import ComplexCall

torch = pytest.importorskip("torch")

# every example that is a recurrence (alibi_attention is attention: test_attention_step.py); lru is complex
RECURRENCES = ("hgrn", "mamba1", "mamba1_block", "mamba2", "mingru", "linear_attention", "retnet", "lstm", "gru",
               "layernorm_lstm", "mamba_conv", "lstm_heads", "mamba_block_conv", "simple_gla", "lru")
LENGTH = 5

# the generated kernels one step launches (emulated, at these sizes; the step's torch ops not counted: the
# staged input products of the LSTM-likes, the chunked form of linear_attention / retnet / simple_gla, which
# runs no generated kernel at L = 1): an upper bound, so that a step launching more is caught
# (layernorm_lstm: its x W LayerNorm's two row statistics, then the persistent kernel of its cell)
STEP_KERNELS = {"mamba2": 2, "layernorm_lstm": 3, "lru": 2, "linear_attention": 0, "retnet": 0, "simple_gla": 0}

# CI runs a case a kernel path (each compiles its kernels with the host C++ compiler, seconds on CI's 2 cores);
# the others repeat a kept case's path and run locally and nightly
REPEATS = {"mamba1_block": "mamba1", "mamba_conv": "mamba_block_conv", "mingru": "hgrn and lstm", "gru": "lstm",
           "layernorm_lstm": "lstm"}
EMULATED_CASES = [nightly_case(name, reason=f"the kernels of {REPEATS[name]}'s case") if name in REPEATS else name
                  for name in RECURRENCES]

emulated_only = pytest.mark.skipif(not emulator.available(), reason="no C++ compiler for the CUDA emulator")


def _example(name):
    return importlib.import_module(f"ssmc.examples.{name}")


def _names(module):
    """(input names, state names, sequence -> its time position, output -> its time position) of the
    example's spec, by its own names (a complex spec's, not its real program's parts)."""
    p = module.SPEC.program
    seq_time, out_time = time_positions(p, module.LAYOUT)
    signature = getattr(module.SPEC, "complex_signature", None)
    if signature is None:
        return [d.name for d in p.inputs], [s.name for s in p.states], seq_time, out_time
    part_of = ComplexCall(signature).part_of
    seq_time = {part_of.get(n, n): t for n, t in seq_time.items()}
    out_time = {part_of.get(n, n): t for n, t in out_time.items()}
    return ([n for n, _ in signature.inputs], [n for n, _ in signature.states], seq_time,
            {n: out_time[n] for n, _ in signature.outputs})


def _as_tuple(x):
    return x if isinstance(x, tuple) else (x,)


def _tensors(values: dict, dtype, device, half: tuple[str, ...] = (), half_dtype=None) -> dict:
    """The example's NumPy inputs as tensors: real ones `dtype` (`half_dtype` for the names in `half`),
    complex ones complex64."""
    out = {}
    for n, v in values.items():
        v = np.asarray(v)
        dt = torch.complex64 if v.dtype.kind == "c" else half_dtype if n in half else dtype
        out[n] = torch.tensor(v, dtype=dt, device=device)
    return out


def _rel(got, want) -> float:
    got, want = got.detach().cpu(), want.detach().cpu()
    if want.is_complex():
        got, want = torch.view_as_real(got.to(torch.complex128)), torch.view_as_real(want.to(torch.complex128))
    got, want = got.double(), want.double()
    assert got.shape == want.shape
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


def _stepped(module, step, inputs: dict, states: tuple, launches: list | None = None):
    """(outputs stacked along time as the full call returns them, final states): `step` called LENGTH times,
    the sequences sliced at each step (from the last down for a reverse-time program); the emulated
    launches of each step appended to `launches`."""
    _, _, seq_time, out_time = _names(module)
    got = {}
    for t in (range(LENGTH - 1, -1, -1) if module.SPEC.program.reverse else range(LENGTH)):
        one = {n: (x.select(seq_time[n], t) if n in seq_time else x) for n, x in inputs.items()}
        before = emulator.launched
        y_t, states = step(**one, states=states)
        if launches is not None:
            launches.append(emulator.launched - before)
        got[t] = _as_tuple(y_t)
        states = _as_tuple(states)
    ys = tuple(torch.stack([got[t][k] for t in range(LENGTH)], dim=pos) for k, pos in enumerate(out_time.values()))
    return ys, states


def _check_steps(name: str, tensors: dict, tol: float, launches: list | None = None):
    module = _example(name)
    names, state_names, _, _ = _names(module)
    states = tuple(tensors[s] for s in state_names if s in tensors)
    inputs = {n: tensors[n] for n in names}
    ys, finals = ssmc.compile(module.SPEC, "cuda", layout=module.LAYOUT)(
        **inputs, **{s: tensors[s] for s in state_names if s in tensors}, return_final_states=True)
    step = ssmc.step(module.SPEC, "cuda", layout=module.LAYOUT)
    got_ys, got_finals = _stepped(module, step, inputs, states or None, launches)
    for k, (g, w) in enumerate(zip(got_ys, _as_tuple(ys))):
        assert g.device == w.device and _rel(g, w) <= tol, (name, "output", k)
    for s, g, w in zip(state_names, got_finals, _as_tuple(finals)):
        assert _rel(g, w) <= tol, (name, "state", s)


@emulated_only
@pytest.mark.parametrize("name", EMULATED_CASES)
def test_emulated_stepping_equals_the_full_sequence_call(name, monkeypatch):
    """L = 5 steps of float32 CPU tensors through the emulated cuda backend against its full-sequence call
    (the kernels of L = 1 and of L = 5, which for the chunked and staged forms take other paths: float32
    roundoff apart), from the example's initial states; a step launches at most STEP_KERNELS kernels."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    values = _example(name).make_inputs(np.random.default_rng(3), LENGTH)
    launches = []
    _check_steps(name, _tensors(values, torch.float32, "cpu"), 2e-5, launches)
    assert launches[-1] <= STEP_KERNELS.get(name, 1), (name, launches)


# -- out= and in_place=True --------------------------------------------------------------------------------


def _given_arrays(ys, finals, like):
    """Fresh arrays shaped as a step's outputs and states (`like`: np.empty_like or torch.empty_like)."""
    return tuple(like(y) for y in _as_tuple(ys)), tuple(like(h) for h in _as_tuple(finals))


def _written_in_place(step, one, states, want_y, want_h, close):
    """A step with ``out=`` and ``in_place=True`` into fresh tensors: the very tensors come back (data_ptr) and
    hold the allocating step's `want_y`, `want_h` (`close(got, want)`); returns (the out tensors, the state
    buffers)."""
    outs, _ = _given_arrays(want_y, want_h, torch.empty_like)
    buffers = tuple(h.clone() for h in states)
    ptrs = [b.data_ptr() for b in (*outs, *buffers)]
    got_y, got_h = step(**one, states=buffers, out=outs if len(outs) > 1 else outs[0], in_place=True)
    assert [b.data_ptr() for b in (*_as_tuple(got_y), *_as_tuple(got_h))] == ptrs
    for g, w in zip((*_as_tuple(got_y), *_as_tuple(got_h)), (*_as_tuple(want_y), *_as_tuple(want_h))):
        assert close(g, w)
    return outs, buffers


def _in_place_case(name, backend, convert):
    module = _example(name)
    names, state_names, seq_time, _ = _names(module)
    values = {k: convert(v) for k, v in module.make_inputs(np.random.default_rng(4), 1).items()}
    one = {n: (values[n].squeeze(seq_time[n]) if n in seq_time else values[n]) for n in names}
    states = tuple(values[s] for s in state_names)
    step = ssmc.step(module.SPEC, backend, layout=module.LAYOUT)
    want_y, want_h = step(**one, states=states)
    return step, one, states, want_y, want_h


@pytest.mark.parametrize("name", ["hgrn", "lstm", "lru"])
def test_step_out_and_in_place_write_the_given_numpy_arrays(name):
    """Interpreter (NumPy): ``out=`` returns the given output arrays holding the outputs; ``in_place=True``
    writes the new states into the given state arrays and returns them; the values are the allocating
    call's; a wrong shape or a missing state is a ValueError naming the argument."""
    step, one, states, want_y, want_h = _in_place_case(name, "interpreter", np.array)
    outs, _ = _given_arrays(want_y, want_h, np.empty_like)
    buffers = tuple(np.array(h) for h in states)
    got_y, got_h = step(**one, states=buffers, out=outs if len(outs) > 1 else outs[0], in_place=True)
    for g, given, w in zip(_as_tuple(got_y), outs, _as_tuple(want_y)):
        assert g is given and np.array_equal(g, w)
    for g, given, w in zip(_as_tuple(got_h), buffers, _as_tuple(want_h)):
        assert g is given and np.array_equal(g, w)
    with pytest.raises(ValueError, match=r"out: .* must be an array of shape"):
        step(**one, states=states, out=np.zeros((1, 1)))
    if len(states) > 1:
        with pytest.raises(ValueError, match="in_place=True writes the new states"):
            step(**one, states=states[:1], in_place=True)
        # two states in one array: the second write would overwrite the first; nothing written before the error
        shared = np.array(states[0])
        kept = shared.copy()
        with pytest.raises(ValueError, match="share memory"):
            step(**one, states=(shared, shared, *states[2:]), in_place=True)
        assert np.array_equal(shared, kept)
    first = _as_tuple(want_y)[0]
    with pytest.raises(ValueError, match="must be of dtype"):  # an int array would truncate the outputs
        step(**one, states=states, out=tuple(np.zeros(y.shape, dtype=np.int64) for y in _as_tuple(want_y))
             if len(outs) > 1 else np.zeros(first.shape, dtype=np.int64))


@emulated_only
@pytest.mark.parametrize("name", ["hgrn", "lstm", nightly_case("mamba2", reason="hgrn's and lstm's paths")])
def test_emulated_step_out_and_in_place_write_the_given_tensors(name, monkeypatch):
    """Emulated cuda backend (float32 CPU tensors): the outputs land in the ``out=`` tensors and the new
    states in the given state tensors (the same storage: data_ptr), equal to the allocating call's; ten
    steps alternating the two forms stay equal."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    step, one, states, want_y, want_h = _in_place_case(name, "cuda", lambda v: torch.tensor(v, dtype=torch.float32))
    outs, buffers = _written_in_place(step, one, states, want_y, want_h, torch.equal)
    h = _as_tuple(want_h)
    for _ in range(3):  # allocating and in place, step after step
        want_y, h = step(**one, states=h)
        step(**one, states=buffers, out=outs if len(outs) > 1 else outs[0], in_place=True)
        h = _as_tuple(h)
        for g, w in zip((*outs, *buffers), (*_as_tuple(want_y), *h)):
            assert torch.equal(g, w)


# -- on a GPU ----------------------------------------------------------------------------------------------

BF16 = {"mamba1": ("u", "delta", "B", "C", "z"), "mamba2": ("x", "dt", "B", "C")}
GPU_CASES = [(name, "float32") for name in RECURRENCES] + [(name, "bfloat16") for name in BF16]


@pytest.mark.gpu
@pytest.mark.parametrize("name, dtype", GPU_CASES)
def test_gpu_stepping_equals_the_full_sequence_call(name, dtype):
    """L = 5 steps on CUDA tensors against the full-sequence call: float32 for every recurrence example,
    bf16 sequences (float32 params and states) for mamba1 and mamba2; then a step with ``out=`` and
    ``in_place=True`` writes the given tensors with the allocating step's values."""
    values = _example(name).make_inputs(np.random.default_rng(3), LENGTH)
    half = BF16[name] if dtype == "bfloat16" else ()
    tensors = _tensors(values, torch.float32, "cuda", half=half, half_dtype=torch.bfloat16)
    _check_steps(name, tensors, 2e-5 if dtype == "float32" else 3e-2)
    module = _example(name)
    names, state_names, seq_time, _ = _names(module)
    one = {n: (tensors[n].select(seq_time[n], 0) if n in seq_time else tensors[n]) for n in names}
    step = ssmc.step(module.SPEC, "cuda", layout=module.LAYOUT)
    states = tuple(tensors[s] for s in state_names)
    want_y, want_h = step(**one, states=states)
    # the same step twice: equal but for a kernel's order of atomic adds
    _written_in_place(step, one, states, want_y, want_h, lambda g, w: _rel(g, w) <= 1e-6)

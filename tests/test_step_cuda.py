"""`ssmc.step` on the cuda backend (#43 item 4): stepping L times equals the full-sequence call for every
recurrence example, its kernels emulated on the CPU (``SSMC_CUDA_EMULATE=1``, torch CPU tensors, float32),
the kernels a step launches counted; ``out=`` and ``in_place=True`` write the given arrays and equal the
allocating call (interpreter, NumPy; emulated cuda, torch); and on a GPU (marked `gpu`) the same examples
in float32, mamba1 and mamba2 in bf16 too."""

from __future__ import annotations

import importlib
import re

import numpy as np
import pytest
from profiles import nightly_case

import ssmc
from ssmc.api import time_positions
from ssmc.backends.cuda import emulator, nvrtc
from ssmc.complex_io import ComplexCall

torch = pytest.importorskip("torch")

# every example that is a recurrence (alibi_attention is attention: test_attention_step.py); lru is complex
RECURRENCES = ("hgrn", "mamba1", "mamba1_block", "mamba2", "mingru", "linear_attention", "retnet", "lstm", "gru",
               "layernorm_lstm", "mamba_conv", "lstm_heads", "mamba_block_conv", "simple_gla", "gla", "lru")
LENGTH = 5

# what one step launches (emulated, at the examples' sizes, a step like the ones before it): (the generated
# kernels, the torch ops that launch work on a GPU: products, fills, copies; views and `torch.empty` not counted).
# Not listed: (1, 0), the whole program as one kernel (backends/cuda/step.py). The listed ones read their states
# through a recurrent product (x W and h U as two torch mm into arrays of the step's own, then one kernel,
# `step.product_form`; lstm_heads' two batched over its heads, bmm) or hoist a product a thread per batch row would
# walk (lru's B u: `step.split_form`, a kernel of the new states, then one of the readout; the complex new state
# joined by torch where it is not written in place)
STEP_LAUNCHES = {"lstm": (1, 2), "gru": (1, 2), "lstm_heads": (1, 2), "layernorm_lstm": (1, 2), "lru": (2, 1)}
# the same with ``out=`` and ``in_place=True`` (lru's kernels write the parts of its complex state tensor)
IN_PLACE_LAUNCHES = {**STEP_LAUNCHES, "lru": (2, 0)}
# the steps that allocate where given ``out=`` and ``in_place=True`` (the general path: the full call's results,
# then copied into the arrays given); every other step allocates nothing then
ALLOCATING_IN_PLACE = ()
# torch ops that launch nothing on a GPU (views of the same memory, allocations)
NOT_LAUNCHING = {"view", "_unsafe_view", "permute", "unsqueeze", "squeeze", "detach", "expand", "select", "slice",
                 "transpose", "t", "alias", "as_strided", "view_as_real", "view_as_complex", "empty", "empty_strided",
                 "promote_types", "reshape", "unbind", "split"}
OUT = " (out=)"  # how `_TorchOps` records an op writing an array given (`torch.matmul(a, b, out=c)`)

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


def _float32(v):
    return torch.tensor(v, dtype=torch.float32)


def _first_step(module, values: dict) -> tuple[dict, dict]:
    """(the inputs of the example's first step: its sequences at t = 0 and its params; its states by name) from
    `values`, the example's tensors over time."""
    names, state_names, seq_time, _ = _names(module)
    one = {n: (values[n].select(seq_time[n], 0) if n in seq_time else values[n]) for n in names}
    return one, {s: values[s] for s in state_names}


def _rel(got, want) -> float:
    got, want = got.detach().cpu(), want.detach().cpu()
    if want.is_complex():
        got, want = torch.view_as_real(got.to(torch.complex128)), torch.view_as_real(want.to(torch.complex128))
    got, want = got.double(), want.double()
    assert got.shape == want.shape
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


class _TorchOps:
    """The torch ops run inside it, by name (`ops`)."""

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(func.overloadpacket.__name__ + (OUT if "out" in (kwargs or {}) else ""))
                return func(*args, **(kwargs or {}))
        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def launching(self) -> int:
        return sum(op.removesuffix(OUT) not in NOT_LAUNCHING for op in self.ops)

    def allocating(self) -> int:
        """Ops that make a new tensor (not a view, not an in-place op such as ``copy_``, none writing an array
        given)."""
        return sum(op not in NOT_LAUNCHING - {"empty", "empty_strided"} and not op.endswith(("_", OUT))
                   for op in self.ops)


def _stepped(module, step, inputs: dict, states: tuple, launches: list | None = None):
    """(outputs stacked along time as the full call returns them, final states): `step` called LENGTH times,
    the sequences sliced at each step (from the last down for a reverse-time program); per step, (the emulated
    launches, the torch ops launching work) appended to `launches`."""
    _, _, seq_time, out_time = _names(module)
    got = {}
    for t in (range(LENGTH - 1, -1, -1) if module.SPEC.program.reverse else range(LENGTH)):
        one = {n: (x.select(seq_time[n], t) if n in seq_time else x) for n, x in inputs.items()}
        before = emulator.launched
        with _TorchOps() as ops:
            y_t, states = step(**one, states=states)
        if launches is not None:
            launches.append((emulator.launched - before, ops.launching()))
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
    roundoff apart), from the example's initial states; a step launches what STEP_LAUNCHES says (one kernel
    and no torch op where it does not list the example)."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    values = _example(name).make_inputs(np.random.default_rng(3), LENGTH)
    launches = []
    _check_steps(name, _tensors(values, torch.float32, "cpu"), 2e-5, launches)
    assert launches[-1] == STEP_LAUNCHES.get(name, (1, 0)), (name, launches)


# -- out= and in_place=True --------------------------------------------------------------------------------


def _given_arrays(ys, finals, like):
    """Fresh arrays shaped as a step's outputs and states (`like`: np.empty_like or torch.empty_like)."""
    return tuple(like(y) for y in _as_tuple(ys)), tuple(like(h) for h in _as_tuple(finals))


def _out(outs: tuple):
    """The ``out=`` argument writing `outs`: the one array alone."""
    return outs if len(outs) > 1 else outs[0]


def _written_in_place(step, one, states, want_y, want_h, close):
    """A step with ``out=`` and ``in_place=True`` into fresh tensors: the very tensors come back (data_ptr) and
    hold the allocating step's `want_y`, `want_h` (`close(got, want)`); returns (the out tensors, the state
    buffers)."""
    outs, _ = _given_arrays(want_y, want_h, torch.empty_like)
    buffers = tuple(h.clone() for h in states)
    ptrs = [b.data_ptr() for b in (*outs, *buffers)]
    got_y, got_h = step(**one, states=buffers, out=_out(outs), in_place=True)
    assert [b.data_ptr() for b in (*_as_tuple(got_y), *_as_tuple(got_h))] == ptrs
    for g, w in zip((*_as_tuple(got_y), *_as_tuple(got_h)), (*_as_tuple(want_y), *_as_tuple(want_h))):
        assert close(g, w)
    return outs, buffers


def _allocating_step(module, backend: str, one: dict, states: tuple):
    """(the example's step on `backend`, `one`, `states`, the outputs and new states of an allocating step)."""
    step = ssmc.step(module.SPEC, backend, layout=module.LAYOUT)
    want_y, want_h = step(**one, states=states)
    return step, one, states, want_y, want_h


def _in_place_case(name, backend, convert):
    """`_allocating_step` of the example's inputs at L 1 (`convert`ed to the backend's arrays)."""
    module = _example(name)
    names, state_names, seq_time, _ = _names(module)
    values = {k: convert(v) for k, v in module.make_inputs(np.random.default_rng(4), 1).items()}
    one = {n: (values[n].squeeze(seq_time[n]) if n in seq_time else values[n]) for n in names}
    return _allocating_step(module, backend, one, tuple(values[s] for s in state_names))


def _in_place_again(step, one, states, want_y, want_h) -> tuple:
    """Emulated: a first in-place step (`_written_in_place`, bit for bit: it plans the call), an allocating step
    from the states it wrote, then the in-place step again, which writes the state buffers given. Returns (that
    step's emulated launches, its `_TorchOps`, whether its results equal the allocating step's bit for bit)."""
    outs, buffers = _written_in_place(step, one, states, want_y, want_h, torch.equal)
    want_y, want_h = step(**one, states=tuple(b.clone() for b in buffers))
    before = emulator.launched
    with _TorchOps() as ops:
        got_y, got_h = step(**one, states=buffers, out=_out(outs), in_place=True)
    launched = emulator.launched - before
    assert [b.data_ptr() for b in _as_tuple(got_h)] == [b.data_ptr() for b in buffers]
    equal = all(torch.equal(g, w) for g, w in zip((*_as_tuple(got_y), *_as_tuple(got_h)),
                                                  (*_as_tuple(want_y), *_as_tuple(want_h))))
    return launched, ops, equal


@pytest.mark.parametrize("name", ["hgrn", "lstm", "lru"])
def test_step_out_and_in_place_write_the_given_numpy_arrays(name):
    """Interpreter (NumPy): ``out=`` returns the given output arrays holding the outputs; ``in_place=True``
    writes the new states into the given state arrays and returns them; the values are the allocating
    call's; a wrong shape or a missing state is a ValueError naming the argument."""
    step, one, states, want_y, want_h = _in_place_case(name, "interpreter", np.array)
    outs, _ = _given_arrays(want_y, want_h, np.empty_like)
    buffers = tuple(np.array(h) for h in states)
    got_y, got_h = step(**one, states=buffers, out=_out(outs), in_place=True)
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
    step, one, states, want_y, want_h = _in_place_case(name, "cuda", _float32)
    outs, buffers = _written_in_place(step, one, states, want_y, want_h, torch.equal)
    h = _as_tuple(want_h)
    for _ in range(3):  # allocating and in place, step after step
        want_y, h = step(**one, states=h)
        step(**one, states=buffers, out=_out(outs), in_place=True)
        h = _as_tuple(h)
        for g, w in zip((*outs, *buffers), (*_as_tuple(want_y), *h)):
            assert torch.equal(g, w)


def _real_or_complex(v):
    v = np.asarray(v)
    return torch.tensor(v, dtype=torch.complex64 if v.dtype.kind == "c" else torch.float32)


@emulated_only
@pytest.mark.parametrize("name", EMULATED_CASES)
def test_emulated_in_place_step_allocates_nothing(name, monkeypatch):
    """Emulated cuda backend: a step with ``out=`` and ``in_place=True`` (after a first such step, which plans
    it) allocates nothing and launches what IN_PLACE_LAUNCHES says (one kernel; the LSTMs' two matrix products
    before it into arrays of the step's own; lru's two kernels), where ALLOCATING_IN_PLACE does not list the
    example (those allocate: the general path's results, copied); its outputs and new states are the
    allocating step's from the same states, bit for bit."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    launched, ops, equal = _in_place_again(*_in_place_case(name, "cuda", _real_or_complex))
    assert equal, name
    if name in ALLOCATING_IN_PLACE:
        assert ops.allocating() > 0, (name, ops.ops)  # listed: moved to the one-kernel path, update the table
    else:
        assert ops.allocating() == 0 and (launched, ops.launching()) == IN_PLACE_LAUNCHES.get(name, (1, 0)), \
            (name, launched, ops.ops)


@emulated_only
@pytest.mark.parametrize("name", ["mamba2", "linear_attention", nightly_case("mamba1", reason="mamba2's lanes path")])
def test_emulated_lanes_step_in_place(name, monkeypatch):
    """The lanes kernel (forced: at the examples' sizes a thread per recurrence is chosen; decode sizes choose
    it) as the step's one kernel: in place it equals the allocating step bit for bit, and L = 5 such steps
    equal the full-sequence call."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "lanes")
    step, one, states, want_y, want_h = _in_place_case(name, "cuda", _float32)
    _written_in_place(step, one, states, want_y, want_h, torch.equal)
    assert {p.strategy for p in step._own.plans.values()} == {"lanes"}
    module = _example(name)
    names, state_names, _, _ = _names(module)
    tensors = _tensors(module.make_inputs(np.random.default_rng(3), LENGTH), torch.float32, "cpu")
    inputs, states = {n: tensors[n] for n in names}, {s: tensors[s] for s in state_names}
    monkeypatch.delenv("SSMC_CUDA_STRATEGY")  # the full call's chunked core takes no forced strategy
    ys, finals = ssmc.compile(module.SPEC, "cuda", layout=module.LAYOUT)(**inputs, **states,
                                                                         return_final_states=True)
    monkeypatch.setenv("SSMC_CUDA_STRATEGY", "lanes")
    got_ys, got_finals = _stepped(module, step, inputs, tuple(states.values()))
    for g, w in zip((*got_ys, *got_finals), (*_as_tuple(ys), *_as_tuple(finals))):
        assert _rel(g, w) <= 2e-5, name
    assert {p.strategy for p in step._own.plans.values()} == {"lanes"}


@emulated_only
@pytest.mark.parametrize("name", ["hgrn", "linear_attention"])
def test_emulated_step_writes_strided_arrays_in_place(name, monkeypatch):
    """``out=`` and state arrays that are strided views (every other element of their last axis): the kernel
    writes them as they lie, the elements between untouched, the values the allocating step's."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    step, one, states, want_y, want_h = _in_place_case(name, "cuda", _float32)

    def strided(x, fill):
        big = torch.full((*x.shape[:-1], 2 * x.shape[-1]), fill)
        big[..., ::2] = x
        return big, big[..., ::2]

    out_big, out = strided(_as_tuple(want_y)[0], float("nan"))
    state_bigs, buffers = zip(*(strided(h, 7.0) for h in states))
    got_y, got_h = step(**one, states=buffers, out=out, in_place=True)
    assert got_y is out and torch.equal(out, _as_tuple(want_y)[0])
    for big, g, w in zip(state_bigs, _as_tuple(got_h), _as_tuple(want_h)):
        assert torch.equal(g, w) and bool((big[..., 1::2] == 7.0).all())
    assert bool(out_big[..., 1::2].isnan().all())


@emulated_only
def test_emulated_layer_step_in_place_is_one_launch(monkeypatch):
    """`ssmc.torch.Recurrence.step` on the (emulated) cuda backend without grad: with ``out=`` and
    ``in_place=True`` each step after the first is one launch and no torch op; L steps equal `forward`."""
    import ssmc.torch as st

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    module = _example("hgrn")
    values = _tensors(module.make_inputs(np.random.default_rng(6), LENGTH), torch.float32, "cpu")
    layer = st.Recurrence(module.SPEC, layout=module.LAYOUT, backend="cuda")
    with torch.no_grad():
        ys, final = layer(values["x"], values["f"], return_final_states=True)
        h = torch.zeros_like(final)
        out = torch.empty_like(ys[:, 0])
        for t in range(LENGTH):
            x_t, f_t = values["x"][:, t], values["f"][:, t]
            before = emulator.launched
            with _TorchOps() as ops:
                y_t, h_t = layer.step(x_t, f_t, states=h, out=out, in_place=True)
            assert y_t is out and h_t is h
            assert _rel(out, ys[:, t]) <= 1e-6
            if t:
                assert (emulator.launched - before, ops.ops) == (1, []), ops.ops
        assert _rel(h, final) <= 1e-6


@emulated_only
def test_emulated_step_out_overlapping_an_input_takes_the_copying_path(monkeypatch):
    """``out=`` the memory of an input (hgrn's x_t): the kernel would write what other threads may still read,
    so the step runs the general path (torch ops, the results copied) and `out` holds the allocating step's
    outputs; with the arrays apart again the next step is one launch and no torch op."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    step, one, states, want_y, want_h = _in_place_case("hgrn", "cuda", _float32)
    x = one["x"].clone()
    with _TorchOps() as ops:
        got_y, got_h = step(**{**one, "x": x}, states=states, out=x)
    assert got_y is x and torch.equal(x, want_y) and torch.equal(got_h, want_h) and ops.ops
    out = torch.empty_like(x)
    step(**one, states=states, out=out)
    before = emulator.launched
    with _TorchOps() as ops:
        step(**one, states=states, out=out)
    assert (emulator.launched - before, ops.launching()) == (1, 0) and torch.equal(out, want_y)


def _product_step_case(name):
    """An LSTM-like's steps, emulated in fp32 under the caller's settings: L = 5 steps checked against the full call
    (`_check_steps`), then an in-place step after an allocating one. Returns (each step's launches, the in-place
    step's kernels and its `_TorchOps`, whether its results equal the allocating step's bit for bit)."""
    values = _example(name).make_inputs(np.random.default_rng(3), LENGTH)
    launches = []
    _check_steps(name, _tensors(values, torch.float32, "cpu"), 2e-5, launches)
    return launches, *_in_place_again(*_in_place_case(name, "cuda", _float32))


@emulated_only
@pytest.mark.parametrize("name", ["lstm", nightly_case("gru", reason="lstm's path"),
                                  nightly_case("lstm_heads", reason="lstm's path")])
def test_emulated_product_step_is_one_kernel(name, monkeypatch):
    """``SSMC_CUDA_STEP_PRODUCTS=1``: a step of a recurrence with a recurrent product is one kernel (a thread per
    [b k] summing x W and h U itself, `step.step_program`) and no torch op; L = 5 steps equal the full call; in
    place it equals the allocating step bit for bit, allocates nothing, and copies the new h over the old one
    after the kernel (other threads read the old h: it is written aside), c written in place by the kernel."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setenv("SSMC_CUDA_STEP_PRODUCTS", "1")
    launches, launched, ops, equal = _product_step_case(name)
    assert launches[1:] == [(1, 0)] * (LENGTH - 1), launches
    assert (launched, ops.ops) == (1, ["copy_"]), ops.ops
    assert equal


@emulated_only
@pytest.mark.parametrize("name", ["lstm", nightly_case("gru", reason="lstm's path")])
def test_emulated_product_form_step(name, monkeypatch):
    """A step of an LSTM (as of layernorm_lstm; ``SSMC_CUDA_PERSISTENT=0`` too, where the full call is the step loop)
    is its two products x W and h U as torch matrix products into arrays of the step's own, then one kernel
    (`step.product_form`); L = 5 steps equal the full call; in place (h written by the kernel after the product
    read it) it equals the allocating step bit for bit and allocates nothing."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setenv("SSMC_CUDA_PERSISTENT", "0")
    launches, launched, ops, equal = _product_step_case(name)
    assert launches[1:] == [(1, 2)] * (LENGTH - 1), launches
    assert (launched, ops.launching(), ops.allocating()) == (1, 2, 0), ops.ops
    assert equal


def _sized_step_case(name, sizes: dict, half: tuple[str, ...] = ()):
    """`name`'s steps at `sizes` (make_inputs' keywords), emulated, float32 (bf16 for the inputs in `half`): L = 5
    steps checked against the full call (float32: 2e-5; bf16 operands: 1e-2), then an in-place step (the states'
    own buffers, ``out=``) after a first one. Returns (the step, each allocating step's launches, the in-place
    step's kernels and `_TorchOps`, whether it equals the allocating step bit for bit)."""
    module = _example(name)
    values = _tensors(module.make_inputs(np.random.default_rng(3), LENGTH, **sizes), torch.float32, "cpu",
                      half=half, half_dtype=torch.bfloat16)
    launches = []
    _check_steps(name, values, 1e-2 if half else 2e-5, launches)
    one, states = _first_step(module, values)
    case = _allocating_step(module, "cuda", one, tuple(states.values()))
    return case[0], launches, *_in_place_again(*case)


@emulated_only
@pytest.mark.parametrize("sizes", [dict(batch=1), dict(batch=3, inp=5, heads=3, hidden=2)], ids=["B1", "B3H3"])
def test_emulated_batched_product_step(sizes, monkeypatch):
    """lstm_heads (U block-diagonal over its heads): x W and h U are each one batched matrix product (`torch.bmm`
    of 3-d operands, x read by every head at batch stride 0) into arrays of the step's own, then one kernel
    (`step.product_form`, `step.matrices`); L = 5 steps equal the full call at batch 1 and at other sizes; in
    place it equals the allocating step bit for bit and allocates nothing."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    step, launches, launched, ops, equal = _sized_step_case("lstm_heads", sizes)
    assert launches[1:] == [(1, 2)] * (LENGTH - 1), launches
    assert (launched, ops.launching(), ops.allocating()) == (1, 2, 0), ops.ops
    assert ops.ops.count("bmm" + OUT) == 2, ops.ops
    assert equal
    plan = next(p for p in step._own.plans.values() if p is not None and p.in_place)
    (a, _, x_w), (_, _, h_u) = plan.matmuls
    assert x_w.dim() == h_u.dim() == 3 and a[2][0] == 0  # x's batch stride: every head reads the same row


@emulated_only
def test_emulated_batched_product_step_with_bf16_operands(monkeypatch):
    """lstm_heads with a bf16 x (float32 params and states): no 16-bit products of the step's own (the general
    path: the full call on one step); L = 5 steps equal the full call, and ``out=`` / ``in_place=True`` write the
    given arrays."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    step, _, _, _, equal = _sized_step_case("lstm_heads", {}, half=("x",))
    assert all(p is None for p in step._own.plans.values())
    assert equal


@emulated_only
@pytest.mark.parametrize("sizes", [dict(batch=1), dict(batch=3, dim=5, state=7)], ids=["B1", "B3"])
def test_emulated_split_step(sizes, monkeypatch):
    """LRU (its ``B u`` over n hoisted by the full call): a step is two kernels (`step.split_form`), a thread per
    state element [b n] summing its own ``B u`` and writing the new state, then a thread per [b d] summing the
    readout over n; the complex arrays read and written as their real and imaginary parts where they lie
    (`complex_io.ComplexStep`): in place it writes the complex state tensor given, equals the allocating step bit
    for bit, and allocates and copies nothing; L = 5 steps equal the full call."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    step, launches, launched, ops, equal = _sized_step_case("lru", sizes)
    assert launches[1:] == [(2, 1)] * (LENGTH - 1), launches  # the new complex state joined
    assert (launched, ops.launching(), ops.allocating()) == (2, 0, 0), ops.ops
    assert equal
    plans = [p for p in step.step._own.plans.values() if p is not None]
    assert plans and all(len(p.kernels) == 2 for p in plans)


@emulated_only
@pytest.mark.parametrize("name", ["hgrn", "linear_attention", nightly_case("mamba2", reason="linear_attention's path")])
def test_emulated_split_step_of_other_families(name, monkeypatch):
    """`step.split_form` where the whole program would be one kernel (forced: its one launch refused): two
    kernels, the new states (a thread per element, matrix states too) then the outputs from them; L = 5 steps
    equal the full call, and in place the step equals the allocating one bit for bit and allocates nothing."""
    from ssmc.backends.cuda import step as step_module

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    whole = step_module.one_launch
    monkeypatch.setattr(step_module, "one_launch", lambda program, compute, sizes, parallel=None:
                        None if parallel is None else whole(program, compute, sizes, parallel))
    _, launches, launched, ops, equal = _sized_step_case(name, {})
    assert launches[1:] == [(2, 0)] * (LENGTH - 1), launches
    assert (launched, ops.launching(), ops.allocating()) == (2, 0, 0), ops.ops
    assert equal


@ssmc.recurrence
def _shifted_state(h: ssmc.State["b n"], x: ssmc.Seq["b d"], B: ssmc.Param["n d"], C: ssmc.Param["d n"]):
    """LRU's shape (``B x`` over n hoisted by the full call) with a shift register of the state: its new value
    ``h_shift1 <- h`` is the old h as it is."""
    h = 0.5 * h + ssmc.dot(B, x, over="d") + 0.3 * h.shift(1)
    return h, ssmc.dot(C, h, over="n")


@emulated_only
def test_emulated_in_place_step_of_a_state_shift_register(monkeypatch):
    """A new state that is another state's old value as it is (``h.shift(1)``) is no `step.split_form` (its
    states kernel would load h where it stores h_shift1, after h's new value was stored over it in place): L = 5
    in-place steps equal the full call (float32: 2e-5)."""
    from ssmc.backends.cuda import step as step_module

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    assert step_module.split_form(_shifted_state.program) is None
    rng = np.random.default_rng(0)
    b, d, n = 2, 4, 3
    x = torch.tensor(rng.standard_normal((b, LENGTH, d)), dtype=torch.float32)
    params = {k: torch.tensor(rng.standard_normal(s), dtype=torch.float32) for k, s in (("B", (n, d)), ("C", (d, n)))}
    want, _ = ssmc.compile(_shifted_state, "cuda", layout="b t ...")(x=x, **params, return_final_states=True)
    step = ssmc.step(_shifted_state, "cuda", layout="b t ...")
    states = (torch.zeros(b, n), torch.zeros(b, n))
    got = []
    for t in range(LENGTH):
        out = torch.empty(b, d)
        step(x=x[:, t], **params, states=states, out=out, in_place=True)
        got.append(out.clone())
    assert (torch.stack(got, 1) - want).abs().max().item() <= 2e-5


@emulated_only
def test_emulated_split_step_of_lazy_conjugates(monkeypatch):
    """LRU's step given complex tensors with torch's conjugate bit (``B.conj()`` of the conjugate values, the state
    likewise, written in place): their ``.imag`` views' memory holds the parts unnegated, so they run the general
    path (the parts split by copies); outputs and new states equal the step on plain tensors (float32: 1e-6)."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    module = _example("lru")
    values = module.make_inputs(np.random.default_rng(0), 1)
    tensors = {n: torch.tensor(v).to(torch.complex64 if np.iscomplexobj(v) else torch.float32)
               for n, v in values.items()}
    h, x = tensors.pop("h"), tensors.pop("x")[:, 0]
    step = ssmc.step(module.SPEC, "cuda", layout=module.LAYOUT)
    want_y, want_h = step(x=x, **tensors, states=h)
    lazy = dict(tensors, B=tensors["B"].conj().resolve_conj().conj())
    state = h.conj().resolve_conj().conj()
    assert lazy["B"].is_conj() and state.is_conj()
    out = torch.empty_like(want_y)
    step(x=x, **lazy, states=state, out=out, in_place=True)
    assert (out - want_y).abs().max().item() <= 1e-6 and (state - want_h).abs().max().item() <= 1e-6


# decode sizes (make_inputs' keywords) the in-place kernels are built at for NVRTC: the strategies a GPU's step
# takes there (lanes for mamba2 and linear attention, rows for mamba1_block, a thread per recurrence for hgrn)
DECODE_SIZES = {"mamba2": dict(batch=16, groups=1, heads=32, headdim=64, state=128),
                "linear_attention": dict(batch=16, heads=16, dk=64, dv=64),
                "mamba1_block": dict(batch=16, dim=1024, state=16), "hgrn": dict(batch=16, dim=2048)}


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("name", sorted(DECODE_SIZES))
def test_in_place_step_kernels_compile_without_spills(name, monkeypatch):
    """The kernel an in-place step builds at decode sizes (planned through the emulated backend, not run), its
    state's ``init_`` and ``final_`` parameters one array and so not ``__restrict__``, compiles for sm_90 with
    NVRTC and spills no more than the allocating step's kernel (restrict pointers); hgrn, linear attention
    and mamba1_block's spill nothing (mamba2's lanes kernel at N = 128 spills a few bytes either way)."""
    from ssmc.backends.cuda import runner as runner_module
    from ssmc.backends.cuda.source import compile_options

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    module = _example(name)
    values = _tensors(module.make_inputs(np.random.default_rng(5), 1, **DECODE_SIZES[name]), torch.float32, "cpu")
    one, states = _first_step(module, values)
    sources = []
    monkeypatch.setattr(runner_module.CudaRunner, "function", lambda self, source, kernel: sources.append(source))
    step = ssmc.step(module.SPEC, "cuda", layout=module.LAYOUT)
    assert step._own._plan(one, states, None, False) is not None
    assert step._own._plan(one, states, None, True) is not None
    allocating, in_place = sources
    for s in states:
        assert f"__restrict__ init_{s}" in allocating and f"__restrict__ init_{s}" not in in_place
        assert f"__restrict__ final_{s}" not in in_place
    spills = []
    for source in (allocating, in_place):
        (resources,) = nvrtc.compile_source(source, "sm_90", options=compile_options(source)).resources.values()
        spills.append(resources.spill_store_bytes + resources.spill_load_bytes)
    assert spills[1] <= spills[0] and (name == "mamba2" or spills == [0, 0]), spills


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
@pytest.mark.parametrize("name", ["lstm", "gru"])
def test_product_step_kernel_compiles_without_spills(name, monkeypatch):
    """``SSMC_CUDA_STEP_PRODUCTS=1``: the one kernel of an LSTM's / GRU's in-place step at decode sizes (B16,
    input and hidden 1024; planned through the emulated backend, not run) compiles for sm_90 with NVRTC and
    spills nothing; c's array is written in place (not ``__restrict__``), h's aside (restrict kept)."""
    from ssmc.backends.cuda import runner as runner_module
    from ssmc.backends.cuda.source import compile_options

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    monkeypatch.setenv("SSMC_CUDA_STEP_PRODUCTS", "1")
    module = _example(name)
    values = _tensors(module.make_inputs(np.random.default_rng(5), 1, batch=16, inp=1024, hidden=1024),
                      torch.float32, "cpu")
    one, states = _first_step(module, values)
    sources = []
    monkeypatch.setattr(runner_module.CudaRunner, "function", lambda self, source, kernel: sources.append(source))
    step = ssmc.step(module.SPEC, "cuda", layout=module.LAYOUT)
    plan = step._own._plan(one, states, None, True)
    assert plan is not None and [s for _, s in plan.copies] == ["h"]
    (source,) = sources
    assert re.search(r"__restrict__ h[,)]", source)
    if "c" in states:
        assert re.search(r"\* c[,)]", source) and not re.search(r"__restrict__ c[,)]", source)
        assert re.search(r"\* out_next_c[,)]", source)
    (resources,) = nvrtc.compile_source(source, "sm_90", options=compile_options(source)).resources.values()
    assert not resources.spills, resources.summary()


@pytest.mark.skipif(not nvrtc.available(), reason="no NVRTC")
def test_split_step_kernels_compile_without_spills(monkeypatch):
    """LRU's in-place step at decode sizes (B16, dim 1024, 256 complex states; planned through the emulated
    backend on the complex tensors' real and imaginary views, not run): its two kernels (`step.split_form`)
    compile for sm_90 with NVRTC and spill nothing; the state's parts, read and written in place by the first,
    are not ``__restrict__``."""
    from ssmc.backends.cuda import runner as runner_module
    from ssmc.backends.cuda.source import compile_options

    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    module = _example("lru")
    values = module.make_inputs(np.random.default_rng(5), 1, batch=16, dim=1024, state=256)
    tensors = {n: _real_or_complex(v) for n, v in values.items()}
    given = {"x": tensors["x"][:, 0], **{n: tensors[n] for n in ("nu_log", "theta_log", "gamma_log", "D")}}
    for n in ("B", "C"):
        given[f"{n}_re"], given[f"{n}_im"] = tensors[n].real, tensors[n].imag
    states = {"h_re": tensors["h"].real, "h_im": tensors["h"].imag}
    sources = []
    monkeypatch.setattr(runner_module.CudaRunner, "function", lambda self, source, kernel: sources.append(source))
    step = ssmc.step(module.SPEC, "cuda", layout=module.LAYOUT).step
    assert step._own._plan(given, states, None, True) is not None
    new_states, _ = sources
    for s in ("h_re", "h_im"):
        assert re.search(rf"\* {s}[,)]", new_states) and not re.search(rf"__restrict__ {s}[,)]", new_states)
    for source in sources:
        (resources,) = nvrtc.compile_source(source, "sm_90", options=compile_options(source)).resources.values()
        assert not resources.spills, resources.summary()


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
    one, states = _first_step(module, tensors)
    # the same step twice: equal but for a kernel's order of atomic adds
    _written_in_place(*_allocating_step(module, "cuda", one, tuple(states.values())), lambda g, w: _rel(g, w) <= 1e-6)


def _gpu_in_place(name):
    """On a GPU, float32: the example's in-place step (``out=`` and ``in_place=True``) checked against the
    allocating one (`_written_in_place`), run once more (it plans the call), then again with the allocations of
    torch's CUDA allocator counted. Returns (the step, a call of the in-place step, those allocations)."""
    step, one, states, want_y, want_h = _in_place_case(name, "cuda", lambda v: _real_or_complex(v).cuda())
    outs, buffers = _written_in_place(step, one, states, want_y, want_h, lambda g, w: _rel(g, w) <= 1e-6)

    def in_place():
        step(**one, states=buffers, out=_out(outs), in_place=True)
        torch.cuda.synchronize()

    in_place()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    in_place()
    return step, in_place, torch.cuda.memory_stats()["allocation.all.allocated"] - before


@pytest.mark.gpu
@pytest.mark.parametrize("name", RECURRENCES)
def test_gpu_in_place_step_is_one_kernel_and_allocates_nothing(name):
    """On a GPU, float32: a step with ``out=`` and ``in_place=True`` after a first such step (which plans it)
    equals the allocating step, makes no allocation of torch's CUDA allocator and runs what IN_PLACE_LAUNCHES
    says (CUDA kernels the profiler saw, copies and fills aside; the LSTMs' cuBLAS products too; lru's two
    kernels), where ALLOCATING_IN_PLACE does not list the example; those allocate."""
    _, in_place, allocated = _gpu_in_place(name)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        in_place()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    if name in ALLOCATING_IN_PLACE:
        assert allocated > 0, name
    else:  # its kernels; the LSTMs' matrix products before them (cuBLAS may take more than one kernel each)
        generated, products = IN_PLACE_LAUNCHES.get(name, (1, 0))
        assert allocated == 0, (name, allocated)
        assert len(kernels) == generated if not products else len(kernels) >= generated + products, (name, kernels)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["lstm", "gru", "lstm_heads"])
def test_gpu_product_step_is_one_kernel(name, monkeypatch):
    """On a GPU, ``SSMC_CUDA_STEP_PRODUCTS=1``, float32: L = 5 steps equal the full call; a step with ``out=``
    and ``in_place=True`` equals the allocating one, makes no allocation and runs its one kernel and the copy
    of the new h over the old (h written aside: other threads read the old one)."""
    monkeypatch.setenv("SSMC_CUDA_STEP_PRODUCTS", "1")
    values = _example(name).make_inputs(np.random.default_rng(3), LENGTH)
    _check_steps(name, _tensors(values, torch.float32, "cuda"), 2e-5)
    step, _, allocated = _gpu_in_place(name)
    assert allocated == 0, name
    assert [s for _, s in next(p for p in step._own.plans.values() if p is not None and p.in_place).copies] == ["h"]

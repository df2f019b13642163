"""Generated matrix-linear specs (tests/strategies.py, `matrix_linear_specs`) through the CUDA backend's chunked
path against the interpreter: outputs, final states and every gradient (sequences, params, the initial state).

- every generated spec is taken by the chunked path (the analysis, and on the emulator the chunked core's
  forward and backward counted): a spec that silently fell to the element-wise scans would pass the
  comparisons and test nothing of the chunked path;
- on the CPU: the CUDA backend emulated (its chunked core on torch CPU tensors, the stages around it as
  emulated kernels), float64, L in {1, 7, 63, 64, 65, 180} in chunks that leave a partial one, both layouts;
- on a GPU: L up to 4097, fp32 and bf16 (key and value sizes of the tensor-core kernels, 64 and 128, among
  the draws), both layouts, with the tolerances of tests/test_chunked.py's and tests/test_chunk_kernels.py's
  GPU tests.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

import ssmc
from ssmc.passes.matrix_linear import chunk_stages, core_form, matrix_linear
from tests.profiles import examples, nightly_case
from tests.strategies import matrix_linear_specs

torch = pytest.importorskip("torch")

LAYOUTS = ("b t ...", "b h t ...")


def _host(x) -> np.ndarray:
    return np.asarray(x.detach().double().cpu() if hasattr(x, "detach") else x, dtype=np.float64)


def _max_relative(a, b) -> float:
    """max |a - b| / max |b| (b the reference)."""
    a, b = _host(a), _host(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def _rms_relative(a, b) -> float:
    """‖a − b‖ / ‖b‖ (b the reference), tests/test_chunk_kernels.py's `_rel`."""
    a, b = _host(a), _host(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def assert_chunked(case) -> None:
    """The analysis takes `case`'s spec as matrix linear, and the CUDA backend runs a chunked core for it
    (the spec itself, or one of the stages it is cut into), as `backends/cuda/backend.py` decides."""
    from ssmc.backends.cuda.backend import cuda_stages
    from ssmc.backends.cuda.kernels.chunk import chunked_core

    program = case.spec.program
    ml = matrix_linear(program)
    assert not isinstance(ml, str), f"not matrix linear: {ml}"
    assert (ml.decay is not None or ml.log_decay is not None) == (case.decay != "none"), ml.describe()
    assert ml.per_key == (case.decay == "key"), ml.describe()
    assert core_form(program) is not None or chunk_stages(program) is not None, (
        f"matrix linear ({ml.describe()}) but cut into no chunked core")
    stages = cuda_stages(program).stages
    assert chunked_core(program) is not None or any(chunked_core(s.program) is not None for s in stages)


def _reference(case, inputs: dict, layout: str, rng, rounded=lambda x: x):
    """The interpreter's (float64) outputs, final state and gradients for random cotangents of both (each
    passed through `rounded`)."""
    spec = case.spec
    state, output = spec.program.states[0].name, spec.program.outputs[0][0]
    ref = ssmc.compile(spec, layout=layout, backend="interpreter")(**inputs, return_final_states=True)
    cot = {output: rounded(rng.standard_normal(np.shape(ref[0])))}
    lam = {state: rounded(rng.standard_normal(np.shape(ref[1])))}
    grads = ssmc.grad(spec, backend="interpreter", layout=layout)(**inputs, grad_outputs=cot, grad_final_states=lam)
    return ref, cot, lam, grads


def _compare_float(case, inputs, layout, dtype: str, ref, cot, lam, want, tol: float) -> None:
    """The CUDA backend at `dtype` (float64 or float32, the inputs as NumPy arrays) against the reference:
    outputs, final state and every gradient within `tol`, max |error| / max |reference|."""
    spec = case.spec
    got = ssmc.compile(spec, layout=layout, backend="cuda", dtype=dtype)(**inputs, return_final_states=True)
    for what, g, r in (("output", got[0], ref[0]), ("final state", got[1], ref[1])):
        assert np.shape(_host(g)) == np.shape(r), what
        assert _max_relative(g, r) < tol, (what, dtype, _max_relative(g, r))
    grads = ssmc.grad(spec, backend="cuda", layout=layout, dtype=dtype)(**inputs, grad_outputs=cot,
                                                                        grad_final_states=lam)
    assert set(grads) == set(want) == {*inputs}, (sorted(grads), sorted(want))
    for name, w in want.items():
        assert np.isfinite(_host(grads[name])).all(), name
        assert _max_relative(grads[name], w) < tol, (name, dtype, _max_relative(grads[name], w))


# -- on the CPU: the emulated CUDA backend, float64 -------------------------------------------------------

@settings(max_examples=examples(12, ci=3), deadline=None)
@given(case=matrix_linear_specs(), length=st.sampled_from([1, 7, 63, 64, 65, 180]),
       chunk=st.sampled_from([None, 5, 16, 48]), layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2 ** 16))
def test_generated_specs_match_the_interpreter_emulated(case, length, chunk, layout, seed):
    """float64 through the chunked torch path (chunks of `chunk` steps, the default where None: 64, or the
    next power of two at short L; 5, 16 and 48 divide none of 63, 65, 180 and leave a partial chunk):
    everything within 1e-9 of the interpreter (max |error| / max |reference|; a chunked product sums
    in another order than the loop, so not bit for bit). The chunked core's forward and backward counted."""
    from ssmc.backends.cuda.kernels import chunk as chunk_module

    event(case.kind)
    assert_chunked(case)
    rng = np.random.default_rng(seed)
    inputs = case.inputs(rng, length, layout)
    ref, cot, lam, want = _reference(case, inputs, layout, rng)
    calls = {"forward": 0, "backward": 0}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SSMC_CUDA_EMULATE", "1")
        if chunk is not None:
            mp.setenv("SSMC_CUDA_CHUNK", str(chunk))
        for what in calls:
            original = getattr(chunk_module.ChunkedCore, what)

            def counted(self, *a, _original=original, _what=what, **k):
                calls[_what] += 1
                return _original(self, *a, **k)
            mp.setattr(chunk_module.ChunkedCore, what, counted)
        _compare_float(case, inputs, layout, "float64", ref, cot, lam, want, 1e-9)
    assert calls["forward"] >= 1 and calls["backward"] == 1, calls


# -- on a GPU: fp32 and bf16 -------------------------------------------------------------------------------

# key and value sizes: the tensor-core kernels' (64, 128) often, others (16, 32) too; batch and heads small (the
# interpreter's reference at L 4097 with K = V = 128 takes seconds a head)
GPU_SIZES = st.tuples(st.integers(1, 2), st.integers(1, 2), st.integers(1, 2), st.sampled_from((16, 64, 64, 128)),
                      st.sampled_from((32, 64, 128, 128)))
LONG_GPU_SIZES = st.tuples(st.just(1), st.just(1), st.integers(1, 2), st.sampled_from((32, 64, 128)),
                           st.sampled_from((64, 128)))


def fp32_and_bf16_match_the_interpreter(case, length: int, layout: str, seed: int, device: str = "cuda") -> bool:
    """`case` on inputs rounded to bf16 (the reference, float64 in the interpreter, on the same values and on
    cotangents rounded alike) through the CUDA backend:

    - fp32 (`dtype="float32"`, NumPy inputs): outputs, final state and every gradient within 1e-4, max
      |error| / max |reference| (tests/test_chunked.py::test_gpu_float32_and_bfloat16);
    - bf16 (torch tensors on `device`: arrays of rank > 1 in bf16, the others fp32, as tests/test_chunked.py's
      GPU test): the output and final state within 2e-2 relative RMS error, every gradient through
      ssmc.torch.function within 2e-2, those of params and of the inputs of the decay and β (sums over
      every step) within 3e-2 (tests/test_chunk_kernels.py's GPU spec tests).

    Returns whether the bf16 forward ran on the tensor-core kernels."""
    import ssmc.torch
    from ssmc.backends.cuda.kernels.chunk import mma

    rng = np.random.default_rng(seed)
    inputs = case.inputs(rng, length, layout)
    bf = {k: torch.as_tensor(v, device=device).to(torch.bfloat16 if np.ndim(v) > 1 else torch.float32)
          for k, v in inputs.items()}
    rounded = {k: v.double().cpu().numpy() for k, v in bf.items()}
    ref, cot, lam, want = _reference(case, rounded, layout, rng,
                                     lambda x: torch.as_tensor(x).to(torch.bfloat16).double().numpy())
    _compare_float(case, rounded, layout, "float32", ref, cot, lam, want, 1e-4)

    calls = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mma, "forward", lambda *a, _f=mma.forward, **kw: calls.append(1) or _f(*a, **kw))
        got = ssmc.compile(case.spec, layout=layout, backend="cuda")(**bf, return_final_states=True)
        for what, g, r in (("output", got[0], ref[0]), ("final state", got[1], ref[1])):
            assert tuple(g.shape) == np.shape(r), what
            assert _rms_relative(g, r) < 2e-2, (what, _rms_relative(g, r))
        fn = ssmc.torch.function(case.spec, layout=layout, return_final_states=True)
        leaves = {k: v.clone().requires_grad_(True) for k, v in bf.items()}
        y, final = fn(**leaves)
        (dy,), (dfinal,) = cot.values(), lam.values()
        torch.autograd.backward([y, final], [torch.as_tensor(dy, device=device).to(y.dtype),
                                             torch.as_tensor(dfinal, device=device).to(final.dtype)])
    params = {d.name for d in case.spec.program.params}
    for name, w in want.items():
        g = leaves[name].grad
        assert g is not None and tuple(g.shape) == np.shape(w), name
        tol = 3e-2 if name in params or name in case.decay_inputs else 2e-2
        assert _rms_relative(g, w) < tol, (name, _rms_relative(g, w))
    return bool(calls)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 7, 63, 64, 65, 180, 1000, 4097])
@settings(max_examples=examples(1), deadline=None)
@given(data=st.data(), layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2 ** 16))
def test_gpu_generated_specs_fp32_and_bf16(length, data, layout, seed):
    """One generated spec a length (`fp32_and_bf16_match_the_interpreter`), key and value sizes of the
    tensor-core kernels among the draws; batch and heads 1 at L >= 1000 (the interpreter's reference)."""
    case = data.draw(matrix_linear_specs(sizes=LONG_GPU_SIZES if length >= 1000 else GPU_SIZES), label="case")
    event(case.kind)
    assert_chunked(case)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("SSMC_CUDA_EMULATE", raising=False)
        kernels = fp32_and_bf16_match_the_interpreter(case, length, layout, seed)
    event(f"bf16 on the tensor-core kernels: {kernels}")


# -- a case the generator found -------------------------------------------------------------------------------

@ssmc.recurrence
def transposed_by_the_decay(S: ssmc.State["b h n p"], C: ssmc.Seq["b h n"], B: ssmc.Seq["b h n"],
                            x: ssmc.Seq["b h p"], gamma: ssmc.Param["h"], z: ssmc.Seq["b h p"]):
    """RetNet's decay (a param over the heads, before S: the update's axes [h b n p]) and an output gate: the
    core's o is [h b p], the contraction dot(C, S) the output reads [b h p]. chunk_stages built the core's
    output as a transposing EXPAND of o, which core_form does not read: the spec fell to the scans."""
    S = gamma * S + B * x
    return S, ssmc.dot(C, S, over="n") * ssmc.silu(z)


@pytest.mark.parametrize("layout", ["t ...", nightly_case("b t ...", reason="the same stages; time second")])
def test_a_core_transposed_by_its_decay_is_chunked(layout, emulated_cuda):
    """The core writes o as its update orders it and a post stage transposes it: chunked, and against the
    interpreter (float64, outputs, final state, every gradient) in a layout that keeps the output's axis
    order ("t ...") and one that names b first."""
    fused = chunk_stages(transposed_by_the_decay.program)
    assert fused is not None and [s.kind for s in fused.stages] == ["core", "post"]
    assert fused.stages[0].program.outputs[0][1].axes == ("h", "b", "p")
    rng = np.random.default_rng(1)
    length, time_at = 21, 0 if layout == "t ..." else 1
    shapes = {"C": (2, 3, 2), "B": (2, 3, 2), "x": (2, 3, 4), "z": (2, 3, 4)}
    inputs = {n: np.moveaxis(rng.standard_normal((length, *shape)), 0, time_at) for n, shape in shapes.items()}
    inputs.update(gamma=rng.uniform(0.5, 1.0, 3), S=rng.standard_normal((2, 3, 2, 4)))
    case = type("Case", (), {"spec": transposed_by_the_decay})
    ref, cot, lam, want = _reference(case, inputs, layout, rng)
    _compare_float(case, inputs, layout, "float64", ref, cot, lam, want, 1e-10)


# -- a decay of params alone ----------------------------------------------------------------------------------

@ssmc.recurrence
def decay_of_params_alone(S: ssmc.State["b h k v"], q: ssmc.Seq["b h k"], k: ssmc.Seq["b h k"],
                          v: ssmc.Seq["b h v"], w: ssmc.Param["h"]):
    """RetNet with its decay a sigmoid of a param: the decay, no input as given, is a pre stage's output."""
    S = ssmc.sigmoid(w) * S + k * v
    return S, ssmc.dot(S, q, over="k")


def test_a_decay_of_params_alone(emulated_cuda, monkeypatch):
    """Its pre stage reads no sequence of its own: it declares one of the layer's (matrix_linear.chunk_stages),
    so its own call, in the staged gradient, knows the steps. Cut into pre and core, the chunked core's forward
    and backward counted (the scans would match the interpreter too)."""
    from ssmc.backends.cuda.kernels import chunk as chunk_module

    fused = chunk_stages(decay_of_params_alone.program)
    assert fused is not None and [s.kind for s in fused.stages] == ["pre", "core"]
    assert [d.name for d in fused.stages[0].program.seqs] == ["q"]
    calls = {"forward": 0, "backward": 0}
    for what in calls:
        original = getattr(chunk_module.ChunkedCore, what)

        def counted(self, *a, _original=original, _what=what, **k):
            calls[_what] += 1
            return _original(self, *a, **k)
        monkeypatch.setattr(chunk_module.ChunkedCore, what, counted)
    rng = np.random.default_rng(0)
    inputs = {"q": rng.standard_normal((1, 3, 2, 2)), "k": rng.standard_normal((1, 3, 2, 2)),
              "v": rng.standard_normal((1, 3, 2, 2)), "w": rng.standard_normal(2)}
    ref = ssmc.compile(decay_of_params_alone, layout="b t ...", backend="interpreter")(**inputs)
    got = ssmc.compile(decay_of_params_alone, layout="b t ...", backend="cuda", dtype="float64")(**inputs)
    assert _max_relative(got, ref) < 1e-10
    cot = {"y": rng.standard_normal(ref.shape)}
    want = ssmc.grad(decay_of_params_alone, backend="interpreter", layout="b t ...")(**inputs, grad_outputs=cot)
    grads = ssmc.grad(decay_of_params_alone, backend="cuda", layout="b t ...", dtype="float64")(**inputs,
                                                                                             grad_outputs=cot)
    for name, w in want.items():
        assert _max_relative(grads[name], w) < 1e-10, name
    assert calls["forward"] >= 1 and calls["backward"] == 1, calls

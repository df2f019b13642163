"""The matrix-linear kernels' chunk, autotuned per shape at first use where SSMC_CUDA_CHUNK_TUNE=1
(backends/cuda/kernels/chunk/tune.py).

CPU: the candidates, the choice and its cache with the timing stubbed, the rule where tuning is off or the
tensors are not on a GPU, `ssmc inspect`'s note. GPU (``-m gpu``): a tuned call equals the call forced to the
chunk it chose, bit for bit, and the choice is one of the candidates.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import ssmc  # noqa: E402
from ssmc.backends.cuda.kernels.chunk import chunk_size, mma, tune  # noqa: E402
from ssmc.examples import mamba2  # noqa: E402

GPU = torch.device("cuda", 0)


@pytest.fixture
def stub_timing(monkeypatch):
    """tune's timing replaced by fixed times per chunk (128 fastest), its calls counted, its cache emptied."""
    calls = []

    def timed(chunk, length, heads, key, value, dtype, device, x=None, runs=3):
        calls.append((chunk, length) if x is None else (chunk, length, x))
        return {64: 0.5, 128: 0.3, 256: 0.4}[chunk]

    monkeypatch.setattr(tune, "_time", timed)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(tune, "_chosen", {})
    monkeypatch.setenv("SSMC_CUDA_CHUNK_TUNE", "1")
    monkeypatch.delenv("SSMC_CUDA_CHUNK", raising=False)
    monkeypatch.delenv("SSMC_CUDA_EMULATE", raising=False)
    return calls


def test_candidates_run_up_to_the_first_chunk_holding_the_call():
    assert tune.candidates(1) == tune.candidates(64) == (64,)
    assert tune.candidates(65) == tune.candidates(128) == (64, 128)
    assert tune.candidates(180) == tune.candidates(4096) == (64, 128, 256)


def test_the_fastest_candidate_is_chosen_once_per_shape(stub_timing):
    assert tune.chunk_for(4096, 128, 128, 64, torch.bfloat16, GPU) == 128
    assert sorted(stub_timing) == [(64, 4096), (128, 4096), (256, 4096)]
    assert tune.chunk_for(4096, 128, 128, 64, torch.bfloat16, GPU) == 128
    assert len(stub_timing) == 3                                         # kept: not timed again
    assert tune.tuned(4096, 128, 128, 64, torch.bfloat16, GPU) == (128, {64: 0.5, 128: 0.3, 256: 0.4})
    assert tune.chunk_for(100, 128, 128, 64, torch.bfloat16, GPU) == 128  # another length: timed (64, 128)
    assert stub_timing[3:] == [(64, 100), (128, 100)]
    assert tune.chunk_for(50, 128, 128, 64, torch.bfloat16, GPU) == 64    # one candidate: nothing timed
    assert len(stub_timing) == 5


def test_the_calls_own_operands_are_timed_where_given(stub_timing):
    """`operands` (ChunkedCore's: the call's `Chunks` at a chunk size, so that SSD's q and k shared by the heads
    are timed as they are) is asked for each candidate, and each timing runs on what it gave."""
    asked = []
    made = lambda c: asked.append(c) or f"operands at {c}"  # noqa: E731
    assert tune.chunk_for(180, 8, 64, 64, torch.bfloat16, GPU, made) == 128
    assert asked == [64, 128, 256]
    assert stub_timing == [(c, 180, f"operands at {c}") for c in (64, 128, 256)]


def test_the_rule_where_tuning_is_off_or_not_on_a_gpu(stub_timing, monkeypatch):
    assert tune.chunk_for(4096, 8, 64, 64, torch.bfloat16, torch.device("cpu")) == mma.chunk_for(4096)
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    assert tune.chunk_for(4096, 8, 64, 64, torch.bfloat16, GPU) == mma.chunk_for(4096)
    monkeypatch.delenv("SSMC_CUDA_EMULATE")
    tune._chosen[tune._key(4096, 8, 64, 64, torch.bfloat16, GPU)] = (256, {256: 0.1})  # tuned before
    assert tune.chunk_for(4096, 8, 64, 64, torch.bfloat16, GPU) == 256
    monkeypatch.setenv("SSMC_CUDA_CHUNK_TUNE", "0")                       # the option over the kept choice
    assert tune.chunk_for(4096, 8, 64, 64, torch.bfloat16, GPU) == mma.chunk_for(4096)
    monkeypatch.delenv("SSMC_CUDA_CHUNK_TUNE")                            # unset: the rule
    assert tune.chunk_for(4096, 8, 64, 64, torch.bfloat16, GPU) == mma.chunk_for(4096)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setenv("SSMC_CUDA_CHUNK_TUNE", "1")
    tune._chosen.clear()  # (a kept choice holds inside a capture: nothing is timed for it)
    assert tune.chunk_for(4096, 8, 64, 64, torch.bfloat16, GPU) == mma.chunk_for(4096)  # inside a capture
    assert stub_timing == []


def test_chunk_size_tunes_for_the_kernels_and_the_option_forces(stub_timing, monkeypatch):
    """`chunk_size`: the kernels' calls on a GPU tuned (the heads' product, key and value sizes of the core), an
    fp32 call by the state's size, SSMC_CUDA_CHUNK over both."""
    from ssmc.backends.cuda.report import _stages, chunked_core

    (ml,) = [core.ml for stage in _stages(mamba2.SPEC.program).stages
             if (core := chunked_core(stage.program, "float32")) is not None]
    sizes = {"b": 2, "g": 1, "r": 4, "p": 64, "n": 64}
    monkeypatch.setattr(tune, "_time", lambda c, *a, **k: stub_timing.append(a) or {64: 0.1, 128: 0.2, 256: 0.3}[c])
    assert chunk_size(ml, sizes, 1000, torch.bfloat16, GPU) == 64
    assert stub_timing[0][:4] == (1000, 8, 64, 64)  # length, heads b g r, key n, value p
    assert chunk_size(ml, sizes, 1000, torch.bfloat16) == mma.chunk_for(1000)  # no device: the rule
    monkeypatch.setenv("SSMC_CUDA_CHUNK", "256")
    assert chunk_size(ml, sizes, 1000, torch.bfloat16, GPU) == 256


def test_inspect_says_how_the_chunk_is_chosen(stub_timing):
    from ssmc.backends.cuda.report import path_notes

    sizes = {"b": 2, "g": 1, "r": 4, "p": 64, "n": 64}
    line = next(x for x in path_notes(mamba2.SPEC.program, sizes, 1000, "bfloat16") if x.startswith("chunked"))
    if torch.cuda.is_available():
        assert "(autotuned: 64 0.500 ms, 128 0.300 ms, 256 0.400 ms)" in line, line
    else:
        assert "(the rule's; SSMC_CUDA_CHUNK_TUNE=1 times 64, 128, 256 on a GPU at first use)" in line, line


@pytest.mark.gpu
@pytest.mark.parametrize("length", [180, 1000])
def test_gpu_a_tuned_call_runs_at_its_chunk(length, monkeypatch):
    """SSD bf16 on the kernels, the timing stubbed to prefer 256 (not the rule's 128): the call runs at 256
    (its output equal, bit for bit, to the call forced to 256 by SSMC_CUDA_CHUNK, and not to chunk 128's); the
    real timing then picks one of the candidates."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(tune, "_chosen", {})
    monkeypatch.setenv("SSMC_CUDA_CHUNK_TUNE", "1")
    monkeypatch.delenv("SSMC_CUDA_CHUNK", raising=False)
    g = torch.Generator(device="cuda").manual_seed(length)
    b, r, p, n = 2, 4, 64, 64

    def randn(*shape, shift=0.0):
        return (torch.randn(*shape, generator=g, device="cuda") + shift).to(torch.bfloat16)

    a = {"x": randn(b, length, 1, r, p), "dt": randn(b, length, 1, r, shift=-1.0),
         "A": -torch.rand(1, r, generator=g, device="cuda") - 0.5, "B": randn(b, length, 1, n),
         "C": randn(b, length, 1, n), "D": torch.randn(1, r, generator=g, device="cuda")}

    def call():
        return ssmc.compile(mamba2.SPEC, layout=mamba2.LAYOUT, backend="cuda")(**a)

    with monkeypatch.context() as m:
        m.setattr(tune, "_time", lambda c, *args, **kw: {64: 3.0, 128: 2.0, 256: 1.0}[c])
        tuned = call()
    assert [found[0] for found in tune._chosen.values()] == [256]
    monkeypatch.setenv("SSMC_CUDA_CHUNK", "256")
    assert torch.equal(tuned, call())
    monkeypatch.setenv("SSMC_CUDA_CHUNK", "128")
    assert not torch.equal(tuned, call())
    monkeypatch.delenv("SSMC_CUDA_CHUNK")
    monkeypatch.setattr(tune, "_chosen", {})
    call()
    ((chosen, times),) = tune._chosen.values()
    assert chosen in tune.candidates(length) and set(times) == set(tune.candidates(length))

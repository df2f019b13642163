"""Attention decode (`ssmc.step` of an attention spec, ssmc/attention_step.py): stepping L times against a
KV cache equals the full-sequence call, for every spec of test_flash_attention.SPECS, on the interpreter
(float64 NumPy), the torch path (CPU tensors) and the generated decode kernel on the CPU emulator
(``SSMC_CUDA_EMULATE=1``, bf16 / fp16), and on a GPU (``-m gpu``); the errors, raised before any compute."""

from __future__ import annotations

import numpy as np
import pytest
from profiles import in_ci
from test_flash_attention import OUT_TOL, SPECS, _params, needs_emulator

import ssmc

torch = pytest.importorskip("torch")

LENGTHS = [1, 7, 180]


def _inputs(name: str, length: int, b=2, h=3, d=8, seed=0):
    """q, k, v [b, h, L, d] float64 and the spec's params (NumPy)."""
    rng = np.random.default_rng(seed + length)
    q, k, v = (rng.standard_normal((b, h, length, d)) for _ in range(3))
    return q, k, v, _params(SPECS[name].program, {"b": b, "h": h, "d": d}, rng)


def _want(name: str, q, k, v, params) -> np.ndarray:
    """The outputs [b, h, L, e] stepping must give, in float64 from the interpreter: the full-sequence
    call's (query i sees keys 0..i under a causal mask); for "full" (no mask) step i's query sees the keys
    so far, the last row of the full call over the first i + 1 tokens."""
    f = ssmc.compile(SPECS[name], backend="interpreter", layout="b h t ...")
    if name != "full":
        return f(q, k, v, **params)
    return np.stack([f(q[:, :, :i + 1], k[:, :, :i + 1], v[:, :, :i + 1], **params)[:, :, i]
                     for i in range(q.shape[2])], axis=2)


def _steps(s, cache, q, k, v, params, to=lambda x: x) -> np.ndarray:
    outs = []
    for t in range(q.shape[2]):
        y = s(*(to(np.ascontiguousarray(x[:, :, t])) for x in (q, k, v)), cache,
              **{n: to(x) for n, x in params.items()})
        outs.append(y.double().numpy() if hasattr(y, "numpy") and hasattr(y, "double") else np.asarray(y))
    return np.stack(outs, axis=2)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("length", LENGTHS)
def test_interpreter_steps_equal_the_full_call(name, length):
    q, k, v, params = _inputs(name, length)
    s = ssmc.step(SPECS[name], backend="interpreter", layout="b h t ...")
    cache = s.cache({"b": 2, "h": 3, "d": 8}, max_len=length)
    got = _steps(s, cache, q, k, v, params)
    np.testing.assert_allclose(got, _want(name, q, k, v, params), atol=1e-12, rtol=1e-12)
    assert cache.length == length and np.array_equal(cache.k, k) and np.array_equal(cache.v, v)
    if name == "softcap_empty_rows" and length > 8:
        assert (got[:, :, 8:] == 0).all()  # queries past 8 see no key


# CI's time: 180 steps of the torch ops for two specs (the mask with rows without a key among them)
TORCH_CASES = [(n, length) for n in SPECS for length in LENGTHS
               if length < 180 or not in_ci() or n in ("alibi", "softcap_empty_rows")]


@pytest.mark.parametrize("name, length", TORCH_CASES)
def test_torch_steps_equal_the_full_call(name, length):
    """The torch ops (backend "numba": attention through torch) on CPU float64 tensors."""
    q, k, v, params = _inputs(name, length, seed=1)
    s = ssmc.step(SPECS[name], backend="numba", layout="b h t ...")
    cache = s.cache({"b": 2, "h": 3, "d": 8}, max_len=length + 3, dtype=torch.float64)
    got = _steps(s, cache, q, k, v, params, to=torch.from_numpy)
    assert s.kernel_reason == "CPU tensors"
    np.testing.assert_allclose(got, _want(name, q, k, v, params), atol=1e-12, rtol=1e-12)


def test_the_layout_orders_the_token_arrays_and_the_output():
    """Layout "h b t ...": q_t, k_t, v_t and the output are [h b d]; the same numbers as "b h t ..."."""
    q, k, v, params = _inputs("alibi", 9)
    want = _want("alibi", q, k, v, params)
    s = ssmc.step(SPECS["alibi"], backend="interpreter", layout="h b t ...")
    cache = s.cache({"b": 2, "h": 3, "d": 8}, max_len=9)
    got = np.stack([s(*(x[:, :, t].transpose(1, 0, 2) for x in (q, k, v)), cache, params["slope"])
                    for t in range(9)], axis=2)
    assert got.shape == (3, 2, 9, 8)
    np.testing.assert_allclose(got.transpose(1, 0, 2, 3), want, atol=1e-12)
    cache.reset()
    out = np.full((3, 2, 8), np.nan)
    assert s(*(x[:, :, 0].transpose(1, 0, 2) for x in (q, k, v)), cache, params["slope"], out=out) is out
    np.testing.assert_allclose(out, got[:, :, 0], atol=1e-12)


def test_reset_and_a_cache_the_user_owns():
    q, k, v, params = _inputs("causal", 5)
    s = ssmc.step(SPECS["causal"], backend="numba", layout="b h t ...")
    cache = ssmc.AttentionCache(*(torch.zeros(2, 3, 5, 8, dtype=torch.float64) for _ in range(2)))
    first = _steps(s, cache, q, k, v, params, to=torch.from_numpy)
    cache.reset()
    again = _steps(s, cache, q, k, v, params, to=torch.from_numpy)
    np.testing.assert_array_equal(first, again)
    np.testing.assert_allclose(first, _want("causal", q, k, v, params), atol=1e-12)


# -- the errors: ValueErrors before anything is written ----------------------------------------------------

def _error_step(backend="numba"):
    s = ssmc.step(SPECS["alibi"], backend=backend, layout="b h t ...")
    cache = s.cache({"b": 2, "h": 3, "d": 8}, max_len=2, dtype=None if backend == "interpreter" else torch.float32)
    x = torch.zeros(2, 3, 8) if backend != "interpreter" else np.zeros((2, 3, 8))
    slope = torch.ones(3) if backend != "interpreter" else np.ones(3)
    return s, cache, x, slope


@pytest.mark.parametrize("backend", ["numba", "interpreter"])
def test_wrong_shapes_params_and_a_full_cache_raise_before_any_write(backend):
    s, cache, x, slope = _error_step(backend)
    bad = x[:, :2]
    with pytest.raises(ValueError, match=r"argument 'k' has shape \(2, 2, 8\), expected \(2, 3, 8\)"):
        s(x, bad, x, cache, slope)
    with pytest.raises(ValueError, match="missing the params"):
        s(x, x, x, cache)
    with pytest.raises(ValueError, match="unknown arguments"):
        s(x, x, x, cache, slope, gamma=slope)
    with pytest.raises(ValueError, match=r"param 'slope' has shape \(2,\)"):
        s(x, x, x, cache, slope[:2])
    with pytest.raises(ValueError, match="must be an AttentionCache"):
        s(x, x, x, {"k": x}, slope)
    assert cache.length == 0 and not (cache.k != 0).any()
    s(x + 1, x + 1, x + 1, cache, slope)
    s(x, x, x, cache, slope)
    with pytest.raises(ValueError, match=r"the cache is full \(2 of 2 tokens\)"):
        s(x, x, x, cache, slope)
    assert cache.length == 2


def test_wrong_dtype_and_cache_arguments_raise():
    s, cache, x, slope = _error_step()
    with pytest.raises(ValueError, match=r"argument 'v' is torch\.float64 but the cache holds torch\.float32"):
        s(x, x, x.double(), cache, slope)
    with pytest.raises(ValueError, match="sizes must name the axes"):
        s.cache({"b": 2, "d": 8}, max_len=4)
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        s.cache({"b": 2, "h": 3, "d": 8}, max_len=0)
    with pytest.raises(ValueError, match="same batch sizes and max_len"):
        ssmc.AttentionCache(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 5, 8))
    with pytest.raises(ValueError, match="out must be an array of shape"):
        s(x, x, x, cache, slope, out=torch.zeros(2, 3, 7))
    assert cache.length == 0


# -- the decode kernel on the CPU emulator ------------------------------------------------------------------

# (spec, L, head dim, bf16, forced splits): every spec at each length locally and nightly, fp16 at d 128;
# in CI the combine of two splits (alibi at 100 keys) and the rows without a key
EMULATED = [(n, length, 64, True, 3 if length == 180 else None) for n in SPECS for length in LENGTHS]
EMULATED += [("alibi", 40, 128, False, 2), ("softcap_empty_rows", 20, 64, True, 2)]
if in_ci():
    EMULATED = [("alibi", 100, 64, True, 2), ("softcap_empty_rows", 20, 64, True, 2)]


@needs_emulator
@pytest.mark.parametrize("name, length, d, bf16, splits", EMULATED)
def test_emulated_decode_kernel_steps_equal_the_full_call(name, length, d, bf16, splits, monkeypatch):
    """The kernel writes k_t, v_t into the cache and attends; against the interpreter's full call in
    float64 from the same 16-bit inputs (the output rounded to 16 bits once: within its ulp). `out=` given:
    no buffer is made after the first step (the workspace stays put)."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    dtype = torch.bfloat16 if bf16 else torch.float16
    q, k, v, params = _inputs(name, length, b=1, h=2, d=d, seed=2)
    q, k, v = (torch.from_numpy(x).to(dtype) for x in (q, k, v))
    s = ssmc.step(SPECS[name], backend="cuda", layout="b h t ...")
    s.splits = splits
    cache = s.cache({"b": 1, "h": 2, "d": d}, max_len=length, dtype=dtype)
    out = torch.full((1, 2, d), float("nan"), dtype=dtype)
    outs, work = [], None
    for t in range(length):
        y = s(q[:, :, t].contiguous(), k[:, :, t].contiguous(), v[:, :, t].contiguous(), cache,
              **{n: torch.from_numpy(x) for n, x in params.items()}, out=out)
        assert s.kernel_reason is None and y is out
        work = work or (cache._work.data_ptr(), cache.table.data_ptr())
        assert (cache._work.data_ptr(), cache.table.data_ptr()) == work
        outs.append(y.double().numpy().copy())
        out.fill_(float("nan"))  # an output the next step does not write fails
    got = np.stack(outs, axis=2)
    want = _want(name, *(x.double().numpy() for x in (q, k, v)), params)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got, want, atol=OUT_TOL[bf16], rtol=0)
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)  # every token written at its row
    assert (cache._meta[1:] == 0).all()  # the split counters reset for the next step


@needs_emulator
def test_emulated_kernel_returns_the_layout_and_falls_back_when_turned_off(monkeypatch):
    """Without out=: the output in the layout's order; SSMC_CUDA_FLASH=0: the torch ops, the same numbers."""
    monkeypatch.setenv("SSMC_CUDA_EMULATE", "1")
    q, k, v, _ = _inputs("causal", 3, b=2, h=1, d=64, seed=3)
    q, k, v = (torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v))
    s = ssmc.step(SPECS["causal"], backend="cuda", layout="h b t ...")
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("SSMC_CUDA_FLASH", flag)
        cache = s.cache({"b": 2, "h": 1, "d": 64}, max_len=3, dtype=torch.bfloat16)
        results.append([s(*(x[:, :, t].transpose(0, 1) for x in (q, k, v)), cache) for t in range(3)])
        assert s.kernel_reason == (None if flag == "1" else "SSMC_CUDA_FLASH=0")
    for a, b in zip(*results):
        assert a.shape == (1, 2, 64) and a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), atol=1.6e-2, rtol=0)


def test_decode_kernel_builds_without_spills():
    """NVRTC: no spills for sm_80 and sm_90 at every head dim (the soft-capping modifier included)."""
    from ssmc.backends.cuda import nvrtc
    from ssmc.backends.cuda.kernels.flash import decode
    from ssmc.backends.cuda.source import compile_options

    if not nvrtc.available():
        pytest.skip("no NVRTC")
    for name in ("softcap_empty_rows",) if in_ci() else ("alibi", "softcap_empty_rows"):
        for d in (64, 128, 256):
            for arch in ("sm_80", "sm_90"):
                kname, text = decode.kernel_source(SPECS[name].program, d, True)
                usage = nvrtc.compile_source(text, arch=arch, options=compile_options(text)).resources[kname]
                assert not usage.spills and usage.registers <= 128, str(usage)


def test_split_choice():
    from ssmc.backends.cuda.kernels.flash.decode import choose_splits, fitted_splits

    assert choose_splits(16, 8192, 128, 132) == 32          # B1 H16: the keys spread over ~4 blocks an SM
    assert choose_splits(1024, 8192, 128, 132) == 1         # B64 H16: the batch fills the device
    assert choose_splits(16, 100, 128, 132) == 1            # short caches: one block
    assert fitted_splits(180, 64, 3) == 3 and fitted_splits(70, 64, 3) == 2 and fitted_splits(1, 128, 5) == 1


# -- on a GPU --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("length", [1, 7, 180, 1000])
@pytest.mark.parametrize("dtype, d", [("bfloat16", 128), ("float16", 64)])
def test_gpu_decode_steps_equal_the_full_call(name, length, dtype, d):
    """The kernel on CUDA against the interpreter's float64 full call from the same 16-bit inputs (at 1000
    keys several splits a batch index: the combine)."""
    dtype = getattr(torch, dtype)
    q, k, v, params = _inputs(name, length, b=2, h=4, d=d, seed=4)
    qt, kt, vt = (torch.from_numpy(x).to(device="cuda", dtype=dtype) for x in (q, k, v))
    prm = {n: torch.from_numpy(x).cuda() for n, x in params.items()}
    s = ssmc.step(SPECS[name], backend="cuda", layout="b h t ...")
    cache = s.cache({"b": 2, "h": 4, "d": d}, max_len=length, dtype=dtype, device="cuda")
    outs = [s(qt[:, :, t], kt[:, :, t], vt[:, :, t], cache, **prm) for t in range(length)]
    assert s.kernel_reason is None
    got = torch.stack(outs, 2).double().cpu().numpy()
    q16, k16, v16 = (x.double().cpu().numpy() for x in (qt, kt, vt))
    if name != "full" or length <= 180:
        want = _want(name, q16, k16, v16, params)
    else:  # "full" at 1000 keys: the last step's query sees every key (the full call's last row)
        got = got[:, :, -1:]
        want = ssmc.compile(SPECS[name], backend="interpreter", layout="b h t ...")(q16, k16, v16)[:, :, -1:]
    np.testing.assert_allclose(got, want, atol=OUT_TOL[dtype == torch.bfloat16], rtol=0)
    assert torch.equal(cache.k, kt) and torch.equal(cache.v, vt)


@pytest.mark.gpu
def test_gpu_decode_matches_sdpa_on_a_long_cache_and_allocates_nothing():
    """B1 H16 d128 bf16, 8191 tokens prefilled then one causal step: the kernel (32 splits) against SDPA on
    the cache slice; with out= the step makes no new CUDA allocation."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    s = ssmc.step(SPECS["causal"], backend="cuda", layout="b h t ...")
    cache = s.cache({"b": 1, "h": 16, "d": 128}, max_len=8192, dtype=torch.bfloat16, device="cuda")
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    cache.length = 8191
    q, k, v = (torch.randn(1, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    out = torch.empty_like(q)
    s(q, k, v, cache, out=out)
    cache.length = 8191
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    s(q, k, v, cache, out=out)
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    want = torch.nn.functional.scaled_dot_product_attention(q[:, :, None], cache.k, cache.v)[:, :, 0]
    torch.testing.assert_close(out.float(), want.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.gpu
def test_gpu_decode_step_replays_from_a_cuda_graph():
    """One step (ALiBi, B2 H4 d128 bf16, 300 tokens held, splits chosen) captured in a CUDA graph: its
    replay writes the eager step's output (the position is the one captured)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    s = ssmc.step(SPECS["alibi"], backend="cuda", layout="b h t ...")
    s.splits = 3
    cache = s.cache({"b": 2, "h": 4, "d": 128}, max_len=301, dtype=torch.bfloat16, device="cuda")
    cache.k.normal_(generator=gen)
    cache.v.normal_(generator=gen)
    q, k, v = (torch.randn(2, 4, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    slope = torch.rand(4, device="cuda")
    out = torch.empty_like(q)
    for _ in range(3):  # warm-up: the kernel loaded, the workspace and the params' table made
        cache.length = 300
        s(q, k, v, cache, slope, out=out)
    want = out.clone()
    out.zero_()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cache.length = 300
        s(q, k, v, cache, slope, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
